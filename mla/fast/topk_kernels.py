"""The Triton kernels of ``mla.fast.top_k_per_row`` (the plan and the semantics: ``mla.fast.topk``).

Keys: a float32's bits ``b`` map to an int32 ``k`` that orders as the floats do (``b`` for a
positive float, ``b ^ 0x7FFFFFFF`` for a negative one; ``-0`` read as ``+0``, every NaN as
``2^31 - 1``). Ties go to the lower column: the radix levels run on the non-negative int64
``(k + 2^31) << 31 | (0x7FFFFFFF - column)``, unique per row, so "the ``need`` best" is always
one exact set, and its digits are plain bit fields.
"""

from __future__ import annotations

import triton
import triton.language as tl

WORK_PAD = tl.constexpr(16)  # the threshold and the count, padded: each list 64-byte aligned


def work_columns(cap: int, small: int) -> int:
    """int32 a row of the kernels' scratch (``_work_row``)."""
    return 2 * cap + 2 * small + WORK_PAD.value


def count_column(cap: int, small: int) -> int:
    """The scratch column of a row's survivor count (``_work_row``)."""
    return 2 * cap + 2 * small + 1


@triton.jit
def _order_keys(x):
    """float32 -> int32 keys in the floats' order (``-0`` as ``+0``, NaN above all)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit
def _row_range(starts, ends, row, W):
    """The row's ``[start, end)`` clipped to ``[0, W]`` (unvalidated ranges are never read
    outside the row) and its length."""
    start = tl.maximum(tl.load(starts + row).to(tl.int64), 0)
    end = tl.minimum(tl.load(ends + row).to(tl.int64), W)
    return start, end, tl.maximum(end - start, 0)


@triton.jit
def _work_row(work, row, CAP: tl.constexpr, SMALL: tl.constexpr):
    """A row's scratch (``work_columns`` int32): the candidates' keys, their columns,
    ``SMALL`` int64 for a compacted boundary bucket, then the threshold and the survivor
    count."""
    base = work + row * (2 * CAP + 2 * SMALL + WORK_PAD)
    few = (base + 2 * CAP).to(tl.pointer_type(tl.int64))
    tail = base + 2 * CAP + 2 * SMALL
    return base, base + CAP, few, tail, tail + 1


@triton.jit
def _count_max_min(a0, a1, a2, b0, b1, b2):
    return a0 + b0, tl.maximum(a1, b1), tl.minimum(a2, b2)


@triton.jit
def _bucket(h, need, BINS: tl.constexpr):
    """The bucket ``d`` of histogram ``h`` that holds the ``need``-th best (from the top), the
    count strictly above it and in it: one joint reduction of the reverse cumulative counts
    (those of buckets at or below ``d`` reach ``need``; the largest of the others is the
    count above ``d``, the smallest of those ``d``'s own plus it)."""
    at_or_above = tl.cumsum(h, axis=0, reverse=True)
    reach = at_or_above >= need
    count, above, at_d = tl.reduce((reach.to(tl.int32), tl.where(reach, 0, at_or_above),
                                    tl.where(reach, at_or_above, 2147483647)), 0,
                                   _count_max_min)
    return count - 1, above, at_d - above


@triton.jit
def _composite(k, col):
    """``(key, 0x7FFFFFFF - column)`` as one non-negative int64 whose order is the selection's
    order (unique per row)."""
    return ((k.to(tl.int64) + 2147483648) << 31) | (0x7FFFFFFF - col.to(tl.int64))


@triton.jit
def _window(c, match, BITS: tl.constexpr):
    """The level's digit place: the ``BITS`` bits that end at the highest bit in which the
    matching ``c`` (non-negative) differ, the bits above it being common to all of them. That
    bit is read off the float64 exponent of ``min ^ max``, which rounding can only raise by
    one. Also returns the smallest matching ``c`` (its bits above the window are the
    common ones)."""
    cmin = tl.min(tl.where(match, c, 9223372036854775807), axis=0)
    cmax = tl.max(tl.where(match, c, 0), axis=0)
    return _place(cmin, cmax, BITS), cmin


@triton.jit
def _place(cmin, cmax, BITS: tl.constexpr):
    x = cmin ^ cmax
    top = (x.to(tl.float64).to(tl.int64, bitcast=True) >> 52) - 1023  # -1023 when x == 0
    return tl.maximum(top + 1 - BITS, 0)


@triton.jit
def _fix(cmin, shift, d, BITS: tl.constexpr):
    """The boundary's prefix after a level (the bits above the window, digit ``d`` in it) and
    the mask of the bits fixed so far."""
    ones = tl.full((), -1, tl.int64)
    above = tl.where(shift + BITS >= 63, 0, ones << tl.minimum(shift + BITS, 62))
    return (cmin & above) | (d.to(tl.int64) << shift), ones << shift


@triton.jit
def _digits(c, shift, match, BITS: tl.constexpr):
    """The histogram of the matching ``c``'s digits at ``shift``."""
    return tl.histogram((c >> shift).to(tl.int32) & ((1 << BITS) - 1), 1 << BITS, mask=match)


@triton.jit
def _level(c, match, need, BITS: tl.constexpr):
    """One radix level over the matching ``c``: the boundary's prefix and mask, the keys still
    needed, the boundary bucket's count (when it equals the keys still needed, the selection
    is every ``c`` at or above the prefix), and the window's place."""
    shift, cmin = _window(c, match, BITS)
    d, above, inside = _bucket(_digits(c, shift, match, BITS), need, 1 << BITS)
    found, mask = _fix(cmin, shift, d, BITS)
    return found, mask, need - above, inside, shift


@triton.jit
def _floor_of_rank(c, rank, few_ptr, slack, BITS: tl.constexpr, SMALL: tl.constexpr):
    """A value at or below the ``rank``-th largest of ``c`` (non-negative), with at most
    ``slack`` items more at or above it (or only equal ones): the floor of the radix bucket
    that holds the ``rank``-th, refined until the bucket is that small.

    A level costs the same for every element of ``c``, matching or not: after the first, the
    bucket's items (usually a few dozen) are compacted through ``few_ptr`` (``SMALL`` int64)
    into a ``SMALL`` tensor and the next levels run on that; a larger bucket (ties) stays.
    At most 16 levels (each fixes ``BITS`` more of 64 bits): the floor only sets how many
    keys the read lists, never which are selected, so the loop is bounded whatever happens."""
    need = tl.zeros((), tl.int32) + rank
    mask = tl.full((), -9223372036854775808, tl.int64)  # the sign bit: every item
    found = tl.zeros((), tl.int64)
    found, mask, need, inside, shift = _level(c, (c & mask) == found, need, BITS)
    levels = tl.zeros((), tl.int32) + 1
    done = ((inside <= slack) | (shift == 0)).to(tl.int32)
    if (done == 0) & (inside <= SMALL):
        m = (c & mask) == found
        tl.store(few_ptr + tl.cumsum(m.to(tl.int32), axis=0) - 1, c, mask=m)
        tl.debug_barrier()  # every thread's items written before they are read
        j = tl.arange(0, SMALL)
        few = tl.load(few_ptr + j, mask=j < inside, other=-1)
        while done == 0:
            found, mask, need, inside, shift = _level(few, (few & mask) == found, need, BITS)
            levels += 1
            done = ((inside <= slack) | (shift == 0) | (levels >= 16)).to(tl.int32)
    while done == 0:
        found, mask, need, inside, shift = _level(c, (c & mask) == found, need, BITS)
        levels += 1
        done = ((inside <= slack) | (shift == 0) | (levels >= 16)).to(tl.int32)
    return found


@triton.jit
def _threshold(src, n, topk, few, OVERSAMPLE: tl.constexpr, CAP: tl.constexpr,
               SAMPLE_RUNS: tl.constexpr, RUN: tl.constexpr, BITS: tl.constexpr,
               SMALL: tl.constexpr):
    """The int32 key that about ``OVERSAMPLE * topk`` of the row's ``n`` keys (``src``: its
    first) reach, from a sample of ``SAMPLE_RUNS`` evenly spaced runs of ``RUN`` keys (every
    part of the row is seen). For rows of more than ``CAP`` keys."""
    j = tl.arange(0, SAMPLE_RUNS).to(tl.int64)
    step = ((n - RUN).to(tl.int32) // (SAMPLE_RUNS - 1)).to(tl.int64)  # n < 2^31
    cols = (j * step)[:, None] + tl.arange(0, RUN)[None, :]
    k = _order_keys(tl.load(src + cols))
    c = tl.reshape(k.to(tl.int64) + 2147483648, (SAMPLE_RUNS * RUN,))  # keys only
    # the sample rank that OVERSAMPLE x topk keys (plus three deviations) reach in the row
    expect = tl.fdiv((topk * 1.0) * (SAMPLE_RUNS * RUN), n.to(tl.float32))  # approximate
    # (for a large topk, at most halfway to the list's length)
    fits = 0.5 * (expect + tl.fdiv(CAP * (SAMPLE_RUNS * RUN * 1.0), n.to(tl.float32)))
    aim = tl.ceil(OVERSAMPLE * expect + 3.0 * tl.sqrt(expect) + 8.0)
    rank = tl.minimum(tl.minimum(aim, fits), SAMPLE_RUNS * RUN).to(tl.int32)
    # a bucket of a few keys, or of equal keys, is taken whole: its floor is the threshold
    floor = _floor_of_rank(c, rank, few, rank // 8 + 4, BITS, SMALL)
    return (floor - 2147483648).to(tl.int32)


@triton.jit
def _estimate_kernel(logits, starts, ends, work, W, topk, s_l_r, OVERSAMPLE: tl.constexpr,
                     CAP: tl.constexpr, SAMPLE_RUNS: tl.constexpr, RUN: tl.constexpr,
                     BITS: tl.constexpr, SMALL: tl.constexpr):
    """Per row its threshold (``_threshold``) and its survivor count zeroed. Rows of no more
    than ``CAP`` keys need no threshold."""
    row = tl.program_id(0).to(tl.int64)
    start, end, n = _row_range(starts, ends, row, W)
    _keys, _cols, few, thresh, count = _work_row(work, row, CAP, SMALL)
    tl.store(count, 0)
    if n > CAP:
        t = _threshold(logits + row * s_l_r + start, n, topk, few, OVERSAMPLE, CAP,
                       SAMPLE_RUNS, RUN, BITS, SMALL)
        tl.store(thresh, t)


@triton.jit
def _mask_kernel(logits, starts, ends, work, words, W, s_l_r, s_w_r, chunk,
                 CAP: tl.constexpr, SMALL: tl.constexpr, BLOCK: tl.constexpr,
                 STAGES: tl.constexpr):
    """One streaming read: chunk ``c`` of a row (columns from its start rounded down to
    ``BLOCK``) records a bit a key, set where the key reaches the row's threshold, as int32
    words (bit ``b`` of word ``w``: column ``32 w + b``; zero outside ``[start, end)``). No
    scan, no atomic, no branch: a block's keys become ``BLOCK / 32`` stored words, and the
    loads stay in flight (``STAGES``)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    start, end, n = _row_range(starts, ends, row, W)
    if n > CAP:
        _keys, _cols, _few, thresh, _count = _work_row(work, row, CAP, SMALL)
        t = tl.load(thresh)
        first = start.to(tl.int32)
        lo = tl.multiple_of(first - first % BLOCK + c * chunk, BLOCK)
        hi = tl.minimum(lo + chunk, end.to(tl.int32))
        src = logits + row * s_l_r
        dst = words + row * s_w_r
        for c0 in tl.range(lo, hi, BLOCK, num_stages=STAGES):
            cols = tl.multiple_of(c0, BLOCK) + tl.arange(0, BLOCK)
            # masked at the row's width, not the range's end: whole 16-byte vectors (the
            # neighbours loaded are never kept)
            x = tl.load(src + cols, mask=cols < W, other=0.0)
            keep = (cols >= first) & (cols < hi) & (_order_keys(x) >= t)
            bits = tl.reshape(keep.to(tl.int32), (BLOCK // 32, 32)) << tl.arange(0, 32)[None, :]
            tl.store(dst + c0 // 32 + tl.arange(0, BLOCK // 32), tl.sum(bits, axis=1))


@triton.jit
def _popc(x):
    """Set bits of each int32 (SWAR on the unsigned pattern: no intrinsic, so the
    interpreter runs it too)."""
    u = x.to(tl.uint32, bitcast=True)
    u = u - ((u >> 1) & 0x55555555)
    u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
    u = (u + (u >> 4)) & 0x0F0F0F0F
    return ((u * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _mask_prefix(bits, incl, w0, w1, TILE: tl.constexpr):
    """Per word ``w`` of ``[w0, w1)`` the set bits of words ``w0..w`` (stored to ``incl``);
    returns the total."""
    total = tl.zeros((), tl.int32)
    for g in range(w0, w1, TILE):
        j = g + tl.arange(0, TILE)
        m = j < w1
        pc = _popc(tl.load(bits + j, mask=m, other=0))
        tl.store(incl + j, total + tl.cumsum(pc, axis=0), mask=m)
        total += tl.sum(pc, axis=0)
    return total


@triton.jit
def _list_from_mask(src, start, bits, incl, w0, w1, total, keys_out, cols_out,
                    TILE: tl.constexpr, HELD: tl.constexpr):
    """The candidate list of the ``total`` keys whose bits are set (``bits`` words
    ``[w0, w1)``, ``incl`` their running counts), in column order: each word's set bits go
    to the places after the words before it, a bit a round, as many rounds as the fullest
    word of a tile of ``TILE`` words has bits (no loads in the rounds); then the keys of the
    listed columns read from the row (``src``: column 0), ``HELD`` at a time."""
    for g in range(w0, w1, TILE):
        j = g + tl.arange(0, TILE)
        word = tl.load(bits + j, mask=j < w1, other=0)
        pc = _popc(word)
        pos = tl.load(incl + j, mask=j < w1, other=0) - pc
        u = word.to(tl.uint32, bitcast=True)
        for _r in range(0, tl.max(pc, axis=0)):
            low = u & (0 - u)  # the lowest set bit
            bit = _popc((low - 1).to(tl.int32, bitcast=True))  # its place
            has = u != 0
            tl.store(cols_out + pos, j * 32 + bit - start.to(tl.int32), mask=has)
            pos += has.to(tl.int32)
            u = u & (u - 1)
    tl.debug_barrier()  # every thread's columns stored before they are read
    for g in range(0, total, HELD):
        p = g + tl.arange(0, HELD)
        live = p < total
        col = tl.load(cols_out + p, mask=live, other=0)
        tl.store(keys_out + p, _order_keys(tl.load(src + start + col, mask=live, other=0.0)),
                 mask=live)


@triton.jit
def _rank_few(k, bucket, need, few32, TINY: tl.constexpr):
    """The ``need``-th largest of the at most ``TINY`` keys ``k`` in ``bucket``, exactly, in
    one step: compacted (``few32``) and ranked against each other (``TINY x TINY``
    comparisons). Returns the key ``kth``, how many of the bucket's keys equal to it are
    needed (``left``) and how many there are (``inside``)."""
    tl.debug_barrier()  # the scratch read by every thread before it is written again
    tl.store(few32 + tl.cumsum(bucket.to(tl.int32), axis=0) - 1, k, mask=bucket)
    tl.debug_barrier()  # every thread's keys written before they are read
    count = tl.sum(bucket.to(tl.int32), axis=0)
    j = tl.arange(0, TINY)
    held = j < count
    v = tl.load(few32 + j, mask=held, other=0)
    vt = tl.reshape(v, (1, TINY))
    ht = tl.reshape(held, (1, TINY))
    above = tl.sum((ht & (vt > v[:, None])).to(tl.int32), axis=1)
    equal = tl.sum((ht & (vt == v[:, None])).to(tl.int32), axis=1)
    at = held & (above < need) & (above + equal >= need)  # the need-th's value, however tied
    kth = tl.max(tl.where(at, v, -2147483648), axis=0)
    above_kth = tl.max(tl.where(at, above, 0), axis=0)
    inside = tl.max(tl.where(at, equal, 0), axis=0)
    return kth, need - above_kth, inside


@triton.jit
def _item_keys(src, list_keys, list_cols, few32, i, count, tie_key, listed, ties, few):
    """Items ``i``'s int32 keys and which are live (runtime modes, so that one copy of the
    code serves every mode): the row's keys (``src``), its list's (``listed``), or (``few``)
    the compacted ``few32``; with ``ties`` (not ``few``), the inverted columns
    ``0x7FFFFFFF - column`` of the items whose key is ``tie_key`` (the others dead): their
    largest are the lowest columns."""
    live = i < count
    from_list = (listed != 0) | (few != 0)
    k = tl.where(from_list, tl.load(tl.where(few != 0, few32, list_keys) + i,
                                    mask=live & from_list, other=0),
                 _order_keys(tl.load(src + i, mask=live & ~from_list, other=0.0)))
    tie = (ties != 0) & (few == 0)
    live = live & (~tie | (k == tie_key))
    col = tl.where(listed != 0, tl.load(list_cols + i, mask=live & tie & (listed != 0),
                                        other=0), i)
    return tl.where(tie, 0x7FFFFFFF - col, k), live


@triton.jit
def _level_tiles(src, list_keys, list_cols, few32, count, tie_key, listed, ties, few, found,
                 mask, need, BITS: tl.constexpr, TILE: tl.constexpr):
    """One radix level over the items (``_item_keys``) matching the boundary's prefix
    ``found`` (under ``mask``), read in tiles of ``TILE`` (keys as unsigned patterns
    ``k ^ 0x80000000``, the same order): their least and greatest, which place the digit
    window at the highest bit in which they differ, then their digits' histogram. Returns the
    boundary's prefix and mask, the keys still needed, the boundary bucket's count and the
    window's place."""
    kmin = tl.full((TILE,), 2147483647, tl.int32)
    kmax = tl.full((TILE,), -2147483648, tl.int32)
    for t in range(0, count, TILE):
        k, live = _item_keys(src, list_keys, list_cols, few32, t + tl.arange(0, TILE), count,
                             tie_key, listed, ties, few)
        match = live & (((k ^ -2147483648) & mask) == found)
        kmin = tl.minimum(kmin, tl.where(match, k, 2147483647))
        kmax = tl.maximum(kmax, tl.where(match, k, -2147483648))
    lo = tl.min(kmin, axis=0)
    shift = _place((lo ^ tl.max(kmax, axis=0)).to(tl.int64) & 0xFFFFFFFF, 0, BITS).to(tl.int32)
    h = tl.zeros((1 << BITS,), tl.int32)
    for t in range(0, count, TILE):
        k, live = _item_keys(src, list_keys, list_cols, few32, t + tl.arange(0, TILE), count,
                             tie_key, listed, ties, few)
        v = k ^ -2147483648
        h += tl.histogram((v >> shift) & ((1 << BITS) - 1), 1 << BITS,
                          mask=live & ((v & mask) == found))
    d, above, inside = _bucket(h, need, 1 << BITS)
    ones = tl.full((), -1, tl.int32)
    fixed = tl.where(shift + BITS >= 32, 0, ones << tl.minimum(shift + BITS, 31))
    return ((lo ^ -2147483648) & fixed) | (d << shift), ones << shift, need - above, inside, shift


@triton.jit
def _kth_tiles(src, list_keys, list_cols, items, need, tie_key, listed, ties, few_ptr,
               BITS: tl.constexpr, SMALL: tl.constexpr, TILE: tl.constexpr,
               TINY: tl.constexpr = 64):
    """The ``need``-th largest (``need`` at most their count) of the items' keys
    (``_item_keys``), as a key ``kth`` such that every key above it is selected and, of the
    ``inside`` keys equal to it (or, when ``inside`` equals ``left``, at or above it),
    ``left`` are. Radix levels (``_level_tiles``) until the boundary bucket holds exactly the
    keys still needed or is one value; once it fits ``SMALL`` its keys are compacted
    (``few_ptr``) and the levels go on over them; once it fits ``TINY`` they are ranked
    exactly (``_rank_few``). The items stay in memory, read in tiles, and the loop has one
    copy of each step: a select's time is its chain of block-wide steps, and a cold kernel
    fetches its code from DRAM, so the code it runs is kept small. Returns
    ``kth, left, inside``."""
    few32 = few_ptr.to(tl.pointer_type(tl.int32))
    items = (tl.zeros((), tl.int64) + items).to(tl.int32)  # fewer than 2^31 keys a row
    need = tl.zeros((), tl.int32) + need
    found = tl.zeros((), tl.int32)
    mask = tl.zeros((), tl.int32)  # no bit fixed: every live item matches
    inside = items
    held = items  # the items the levels read: the row's or list's, then the compacted few
    few = tl.zeros((), tl.int32)
    done = tl.zeros((), tl.int32)
    kth = tl.zeros((), tl.int32)
    while done == 0:
        if (few != 0) & (inside <= TINY):
            j = tl.arange(0, SMALL)
            keys = tl.load(few32 + j, mask=j < held, other=0)
            kth, need, inside = _rank_few(
                keys, (j < held) & (((keys ^ -2147483648) & mask) == found), need, few32,
                TINY)
            done = tl.full((), 1, tl.int32)
        elif (few == 0) & (inside <= SMALL):
            kept = tl.zeros((), tl.int32)
            for t in range(0, items, TILE):
                k, live = _item_keys(src, list_keys, list_cols, few32, t + tl.arange(0, TILE),
                                     items, tie_key, listed, ties, few)
                m = live & (((k ^ -2147483648) & mask) == found)
                tl.store(few32 + kept + tl.cumsum(m.to(tl.int32), axis=0) - 1, k, mask=m)
                kept += tl.sum(m.to(tl.int32), axis=0)
            tl.debug_barrier()  # every thread's keys written before they are read
            held = kept
            few = tl.full((), 1, tl.int32)
        else:
            found, mask, need, inside, shift = _level_tiles(src, list_keys, list_cols, few32,
                                                            held, tie_key, listed, ties, few,
                                                            found, mask, need, BITS, TILE)
            done = ((inside == need) | (shift == 0)).to(tl.int32)
            kth = found ^ -2147483648
    return kth, need, inside


@triton.jit
def _select_held(src, list_keys, list_cols, items, need, few_ptr, dst, listed,
                 TILE: tl.constexpr, BITS: tl.constexpr, SMALL: tl.constexpr):
    """The exact ``need`` best of ``items`` keys: a row's (column ``i`` at place ``i``) or its
    candidate list's (``listed``, at run time), their columns written to ``dst`` in the items'
    order. The keys alone decide unless the boundary key is tied; then a second select among
    the tied ones, on the inverted column, takes the lowest columns (the same loop again, so
    its code is there once). The items are read in tiles (``_kth_tiles``), never held
    whole."""
    listed = tl.zeros((), tl.int32) + listed
    kth = tl.zeros((), tl.int32)
    col_kth = tl.zeros((), tl.int32)  # every column of the boundary key when it is not tied
    ties = tl.zeros((), tl.int32)
    left = tl.zeros((), tl.int32) + need
    go = tl.full((), 1, tl.int32)
    while go != 0:
        key, left_now, inside = _kth_tiles(src, list_keys, list_cols, items, left, kth, listed,
                                           ties, few_ptr, BITS, SMALL, TILE)
        if ties == 0:
            kth = key
            left = left_now
            go = (inside > left_now).to(tl.int32)
            ties = tl.full((), 1, tl.int32)
        else:
            col_kth = key
            go = tl.zeros((), tl.int32)
    written = tl.zeros((), tl.int32)
    for t in range(0, items, TILE):
        j = t + tl.arange(0, TILE)
        k, live = _item_keys(src, list_keys, list_cols, list_keys, j, items, 0, listed, 0, 0)
        cols = tl.where(listed != 0, tl.load(list_cols + j, mask=live & (k >= kth), other=0), j)
        take = live & ((k > kth) | ((k == kth) & (0x7FFFFFFF - cols >= col_kth)))
        pos = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(dst + pos, cols, mask=take)
        written += tl.sum(take.to(tl.int32), axis=0)


@triton.jit
def _stream_select(src, n, need, few_ptr, dst, TILE: tl.constexpr, BITS: tl.constexpr,
                   SMALL: tl.constexpr):
    """The exact ``need`` best of a row of ``n`` keys too long to hold (``src``: its first),
    its threshold having failed, by one program, each level a read of the row in tiles (two:
    the window's place, then the histogram); once the boundary bucket fits ``SMALL``, one more
    read writes the keys above it (all selected, in column order) and compacts its items
    (``few_ptr``), and the levels go on in registers, then write the bucket's chosen ones (in
    column order). A bucket that never fits takes a last read to write the selection."""
    need = tl.zeros((), tl.int32) + need
    mask = tl.full((), -9223372036854775808, tl.int64)  # the sign bit: items only
    found = tl.zeros((), tl.int64)
    done = tl.zeros((), tl.int32)
    n = n.to(tl.int32)
    inside = n
    while (done == 0) & (inside > SMALL):
        cmin = tl.full((), 9223372036854775807, tl.int64)
        cmax = tl.zeros((), tl.int64)
        for t in range(0, n, TILE):
            c = _tile_composites(src, t + tl.arange(0, TILE), n)
            match = (c & mask) == found
            cmin = tl.minimum(cmin, tl.min(tl.where(match, c, 9223372036854775807), axis=0))
            cmax = tl.maximum(cmax, tl.max(tl.where(match, c, 0), axis=0))
        shift = _place(cmin, cmax, BITS)
        h = tl.zeros((1 << BITS,), tl.int32)
        for t in range(0, n, TILE):
            c = _tile_composites(src, t + tl.arange(0, TILE), n)
            h += _digits(c, shift, (c & mask) == found, BITS)
        d, above, inside = _bucket(h, need, 1 << BITS)
        need -= above
        found, mask = _fix(cmin, shift, d, BITS)
        done = (inside == need).to(tl.int32)
    written = tl.zeros((), tl.int32)
    if done == 0:
        # one read: the items above the bucket are written (all selected), its items compacted
        kept = tl.zeros((), tl.int32)
        for t in range(0, n, TILE):
            c = _tile_composites(src, t + tl.arange(0, TILE), n)
            m = (c & mask) == found
            tl.store(few_ptr + kept + tl.cumsum(m.to(tl.int32), axis=0) - 1, c, mask=m)
            kept += tl.sum(m.to(tl.int32), axis=0)
            written = _write_taken(dst, c, (c & mask) > found, written)
        tl.debug_barrier()  # the compacted items written by every thread before they are read
        j = tl.arange(0, SMALL)
        few = tl.load(few_ptr + j, mask=j < inside, other=-1)
        while done == 0:
            found, mask, need, inside, _ = _level(few, (few & mask) == found, need, BITS)
            done = (inside == need).to(tl.int32)
        _write_taken(dst, few, (few & mask) >= found, written)
    else:
        for t in range(0, n, TILE):
            c = _tile_composites(src, t + tl.arange(0, TILE), n)
            written = _write_taken(dst, c, (c & mask) >= found, written)


@triton.jit
def _tile_composites(src, i, n):
    """Composites of the row's columns ``i`` (``-1`` past ``n``)."""
    k = _order_keys(tl.load(src + i, mask=i < n, other=0.0))
    return tl.where(i < n, _composite(k, i), -1)


@triton.jit
def _write_taken(dst, c, take, written):
    """The columns of the taken ``c`` after the ``written`` ones, in their order."""
    pos = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(dst + pos, 0x7FFFFFFF - (c & 0x7FFFFFFF).to(tl.int32), mask=take)
    return written + tl.sum(take.to(tl.int32), axis=0)


@triton.jit
def _select_listed_or_row(src, n, topk, list_keys, list_cols, survivors, few, dst,
                          CAP: tl.constexpr, SMALL: tl.constexpr, TILE: tl.constexpr,
                          BITS: tl.constexpr):
    """For ``n > topk``: the exact ``topk`` best of the row held whole (``n <= CAP``), of its
    candidate list held whole (``topk <= survivors <= CAP``), or else of the row streamed
    (the threshold failed)."""
    if (n <= CAP) | ((survivors >= topk) & (survivors <= CAP)):  # one call: one copy of it
        _select_held(src, list_keys, list_cols, tl.where(n <= CAP, n, survivors), topk, few,
                     dst, (n > CAP).to(tl.int32), TILE, BITS, SMALL)
    else:
        _stream_select(src, n, topk, few, dst, TILE, BITS, SMALL)


@triton.jit
def _write_all(dst, n, OUT_BLOCK: tl.constexpr):
    """A row of no more than ``topk`` keys: all of them, in order."""
    for c0 in range(0, n, OUT_BLOCK):
        i = c0 + tl.arange(0, OUT_BLOCK)
        tl.store(dst + i, i, mask=i < n)


@triton.jit
def _write_tail(dst, n, topk, OUT_BLOCK: tl.constexpr):
    """``-1`` past the row's ``min(n, topk)`` indices."""
    kept = tl.minimum(n, topk)
    for c0 in range(0, topk, OUT_BLOCK):
        i = c0 + tl.arange(0, OUT_BLOCK)
        tl.store(dst + i, tl.full((OUT_BLOCK,), -1, tl.int32), mask=(i >= kept) & (i < topk))


@triton.jit
def _select_kernel(logits, starts, ends, work, words, out, W, topk, s_l_r, s_o_r, s_w_r,
                   CAP: tl.constexpr, SMALL: tl.constexpr, TILE: tl.constexpr,
                   BITS: tl.constexpr, OUT_BLOCK: tl.constexpr, WORD_TILE: tl.constexpr):
    """One program a row: the exact ``topk`` best of the row held whole (no more than ``CAP``
    keys), of the keys its bitmask marks (``_mask_kernel``; their count, stored for
    ``survivors``, from ``topk`` to ``CAP``), or else of the row streamed (the threshold
    failed); then ``-1`` past the row's count."""
    row = tl.program_id(0).to(tl.int64)
    start, end, n = _row_range(starts, ends, row, W)
    src = logits + row * s_l_r
    dst = out + row * s_o_r
    list_keys, list_cols, few, _thresh, count = _work_row(work, row, CAP, SMALL)
    if n <= topk:
        _write_all(dst, n, OUT_BLOCK)
    else:
        items = n.to(tl.int32)
        if n > CAP:
            bits = words + row * s_w_r
            incl = bits + s_w_r // 2
            w0 = (start // 32).to(tl.int32)
            w1 = ((end + 31) // 32).to(tl.int32)
            items = _mask_prefix(bits, incl, w0, w1, WORD_TILE)
            tl.store(count, items)
            tl.debug_barrier()  # every thread's running counts stored before any reads them
            if (items >= topk) & (items <= CAP):
                _list_from_mask(src, start, bits, incl, w0, w1, items, list_keys, list_cols,
                                WORD_TILE, CAP)
                tl.debug_barrier()  # the list stored by every thread before any reads it
        if (n <= CAP) | ((items >= topk) & (items <= CAP)):  # one call: one copy of it
            _select_held(src + start, list_keys, list_cols, items, topk, few, dst,
                         (n > CAP).to(tl.int32), TILE, BITS, SMALL)
        else:
            _stream_select(src + start, n, topk, few, dst, TILE, BITS, SMALL)
    _write_tail(dst, n, topk, OUT_BLOCK)
