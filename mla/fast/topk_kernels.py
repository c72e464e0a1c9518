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
def _filter_kernel(logits, starts, ends, work, W, s_l_r, chunk,
                   CAP: tl.constexpr, SMALL: tl.constexpr, BLOCK: tl.constexpr,
                   STAGES: tl.constexpr):
    """One streaming read: chunk ``c`` of a row lists its keys at or above the row's threshold
    (key and request-local column) in the row's candidate list, its place reserved by one
    atomic a block. The count goes on past ``CAP`` (then nothing more is written, and the
    select reads the row instead)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    start, end, n = _row_range(starts, ends, row, W)
    if n > CAP:
        keys_out, cols_out, _few, thresh, count = _work_row(work, row, CAP, SMALL)
        t = tl.load(thresh)
        lo, hi, first = _chunk_range(start, end, c, chunk)
        src = logits + row * s_l_r
        for c0 in tl.range(lo, hi, BLOCK, num_stages=STAGES):
            cols = tl.multiple_of(c0, 16) + tl.arange(0, BLOCK)
            x = tl.load(src + cols, mask=cols < W, other=0.0)
            k = _order_keys(x)
            keep = (cols >= first) & (cols < hi) & (k >= t)
            kept = tl.sum(keep.to(tl.int32), axis=0)
            if kept > 0:
                base = tl.atomic_add(count, kept, sem="relaxed")
                _store_survivors(keys_out, cols_out, base, keep, k, cols, first, CAP)


@triton.jit
def _chunk_range(start, end, c, chunk):
    """Chunk ``c``'s columns ``[lo, hi)`` from the row's start rounded down to 16 (16-byte
    loads), and the start, as int32 (W < 2^31: half the registers and address arithmetic)."""
    lo = tl.multiple_of((start - start % 16 + c * chunk).to(tl.int32), 16)
    return lo, tl.minimum(lo + chunk, end.to(tl.int32)), start.to(tl.int32)


@triton.jit
def _filter_local_kernel(logits, starts, ends, work, local, W, s_l_r, chunk,
                         CAP: tl.constexpr, SMALL: tl.constexpr, BLOCK: tl.constexpr,
                         STAGES: tl.constexpr, LOCAL: tl.constexpr):
    """``_filter_kernel`` without a round trip a block: the program lists its survivors in its
    own ``local`` list of ``LOCAL`` and moves that list to the row's, its place reserved by
    one atomic, when the next block might not fit and at the end."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    start, end, n = _row_range(starts, ends, row, W)
    if n > CAP:
        keys_out, cols_out, _few, thresh, count = _work_row(work, row, CAP, SMALL)
        t = tl.load(thresh)
        lo, hi, first = _chunk_range(start, end, c, chunk)
        src = logits + row * s_l_r
        mine = local + (row * tl.num_programs(1) + c) * (2 * LOCAL)
        held = tl.zeros((), tl.int32)
        for c0 in tl.range(lo, hi, BLOCK, num_stages=STAGES):
            cols = tl.multiple_of(c0, 16) + tl.arange(0, BLOCK)
            x = tl.load(src + cols, mask=cols < W, other=0.0)
            k = _order_keys(x)
            keep = (cols >= first) & (cols < hi) & (k >= t)
            if held > LOCAL - BLOCK:  # this block might not fit: move the list first
                held = _move_local(mine, held, count, keys_out, cols_out, CAP, LOCAL, BLOCK)
            pos = held + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(mine + pos, k, mask=keep)
            tl.store(mine + LOCAL + pos, cols - first, mask=keep)
            held += tl.sum(keep.to(tl.int32), axis=0)
        if held > 0:
            _move_local(mine, held, count, keys_out, cols_out, CAP, LOCAL, BLOCK)


@triton.jit
def _move_local(mine, held, count, keys_out, cols_out, CAP: tl.constexpr, LOCAL: tl.constexpr,
                BLOCK: tl.constexpr):
    """A filter program's own list of ``held`` items moved to the row's list at a place one
    atomic reserves, ``BLOCK`` a step (the registers of a block); returns 0 (the list empty
    again)."""
    tl.debug_barrier()  # the list written by every thread before it is read
    base = tl.atomic_add(count, held, sem="relaxed")
    for g in range(0, held, BLOCK):
        i = g + tl.arange(0, BLOCK)
        m = (i < held) & (base + i < CAP)
        tl.store(keys_out + base + i, tl.load(mine + i, mask=m), mask=m)
        tl.store(cols_out + base + i, tl.load(mine + LOCAL + i, mask=m), mask=m)
    tl.debug_barrier()  # read by every thread before the list is written again
    return held * 0


@triton.jit
def _store_survivors(keys_out, cols_out, base, keep, k, cols, start, CAP: tl.constexpr):
    pos = base + tl.cumsum(keep.to(tl.int32), axis=0) - 1
    ok = keep & (pos < CAP)
    tl.store(keys_out + pos, k, mask=ok)
    tl.store(cols_out + pos, (cols - start).to(tl.int32), mask=ok)


@triton.jit
def _level32(k, match, need, BITS: tl.constexpr):
    """One radix level over the matching int32 keys ``k`` (signed order), read as unsigned
    bit patterns ``v = k ^ 0x80000000`` (same order): the boundary's prefix of ``v`` and its
    mask, the keys still needed, the boundary bucket's count and the window's place, which
    starts at the highest bit in which the matching keys differ (as ``_window``)."""
    kmin = tl.min(tl.where(match, k, 2147483647), axis=0)
    kmax = tl.max(tl.where(match, k, -2147483648), axis=0)
    shift = _place((kmin ^ kmax).to(tl.int64) & 0xFFFFFFFF, 0, BITS).to(tl.int32)
    v = k ^ -2147483648
    h = tl.histogram((v >> shift) & ((1 << BITS) - 1), 1 << BITS, mask=match)
    d, above, inside = _bucket(h, need, 1 << BITS)
    ones = tl.full((), -1, tl.int32)
    fixed = tl.where(shift + BITS >= 32, 0, ones << tl.minimum(shift + BITS, 31))
    found = ((kmin ^ -2147483648) & fixed) | (d << shift)
    return found, ones << shift, need - above, inside, shift


@triton.jit
def _kth_key(k, live, need, few_ptr, BITS: tl.constexpr, SMALL: tl.constexpr):
    """The ``need``-th largest of the ``live`` int32 keys ``k`` held in registers (``need`` at
    most their count), as a key ``kth`` such that every key above it is selected and, of the
    ``inside`` keys equal to it (or, when ``inside`` equals ``left``, at or above it), ``left``
    are. Radix levels until the boundary bucket holds exactly the keys still needed or is one
    value; once it fits ``SMALL`` it is compacted (``few_ptr``) and the levels go on over it.
    Returns ``kth, left, inside``."""
    need = tl.zeros((), tl.int32) + need
    found, mask, need, inside, shift = _level32(k, live, need, BITS)
    done = ((inside == need) | (shift == 0)).to(tl.int32)
    if (done == 0) & (inside <= SMALL):
        m = live & (((k ^ -2147483648) & mask) == found)
        few32 = few_ptr.to(tl.pointer_type(tl.int32))
        tl.store(few32 + tl.cumsum(m.to(tl.int32), axis=0) - 1, k, mask=m)
        tl.debug_barrier()  # every thread's keys written before they are read
        j = tl.arange(0, SMALL)
        held = j < inside
        few = tl.load(few32 + j, mask=held, other=0)
        while done == 0:
            found, mask, need, inside, shift = _level32(
                few, held & (((few ^ -2147483648) & mask) == found), need, BITS)
            done = ((inside == need) | (shift == 0)).to(tl.int32)
    while done == 0:
        found, mask, need, inside, shift = _level32(
            k, live & (((k ^ -2147483648) & mask) == found), need, BITS)
        done = ((inside == need) | (shift == 0)).to(tl.int32)
    return found ^ -2147483648, need, inside


@triton.jit
def _held_keys(src, list_keys, i, items, LISTED: tl.constexpr):
    """Keys of items ``i``: of the candidate list (``LISTED``) or of the row's columns."""
    if LISTED:
        return tl.load(list_keys + i, mask=i < items, other=0)
    return _order_keys(tl.load(src + i, mask=i < items, other=0.0))


@triton.jit
def _held_cols(list_cols, i, mask, LISTED: tl.constexpr):
    """Request-local columns of items ``i``."""
    if LISTED:
        return tl.load(list_cols + i, mask=mask, other=0)
    return i


@triton.jit
def _select_held(src, list_keys, list_cols, items, need, few_ptr, dst, LISTED: tl.constexpr,
                 HELD: tl.constexpr, TILE: tl.constexpr, BITS: tl.constexpr,
                 SMALL: tl.constexpr):
    """The exact ``need`` best of ``items <= HELD`` keys held in registers: a row's (column
    ``i`` at place ``i``) or its candidate list's (``LISTED``), their columns written to
    ``dst`` in the items' order. The keys alone decide unless the boundary key is tied; then
    a second select among the tied ones, on the inverted column, takes the lowest columns.
    Int32 keys, not int64 composites, and one tensor held at a time (the write reads the items
    again in tiles): the registers of one int32 a key."""
    i = tl.arange(0, HELD)
    kth, left, inside = _kth_key(_held_keys(src, list_keys, i, items, LISTED), i < items,
                                 need, few_ptr, BITS, SMALL)
    col_kth = tl.zeros((), tl.int32)  # every column of the boundary key when it is not tied
    if inside > left:
        k = _held_keys(src, list_keys, i, items, LISTED)
        tie = (i < items) & (k == kth)
        inverted = tl.where(tie, 0x7FFFFFFF - _held_cols(list_cols, i, tie, LISTED), -1)
        col_kth, _left, _inside = _kth_key(inverted, inverted >= 0, left, few_ptr, BITS,
                                           SMALL)
    written = tl.zeros((), tl.int32)
    for t in range(0, items, TILE):
        j = t + tl.arange(0, TILE)
        k = _held_keys(src, list_keys, j, items, LISTED)
        cols = _held_cols(list_cols, j, (j < items) & (k >= kth), LISTED)
        take = (j < items) & ((k > kth) | ((k == kth) & (0x7FFFFFFF - cols >= col_kth)))
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
    if n <= CAP:
        _select_held(src, list_keys, list_cols, n, topk, few, dst, False, CAP, TILE, BITS,
                     SMALL)
    elif (survivors >= topk) & (survivors <= CAP):
        _select_held(src, list_keys, list_cols, survivors, topk, few, dst, True, CAP, TILE,
                     BITS, SMALL)
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
def _select_kernel(logits, starts, ends, work, out, W, topk, s_l_r, s_o_r,
                   CAP: tl.constexpr, SMALL: tl.constexpr, TILE: tl.constexpr,
                   BITS: tl.constexpr, OUT_BLOCK: tl.constexpr):
    """One program a row: the exact ``topk`` best of the row's candidate list, or of the row
    itself when it has no more than ``CAP`` keys or its threshold failed
    (``_select_listed_or_row``); then ``-1`` past the row's count."""
    row = tl.program_id(0).to(tl.int64)
    start, end, n = _row_range(starts, ends, row, W)
    src = logits + row * s_l_r + start
    dst = out + row * s_o_r
    list_keys, list_cols, few, _thresh, count = _work_row(work, row, CAP, SMALL)
    if n <= topk:
        _write_all(dst, n, OUT_BLOCK)
    else:
        _select_listed_or_row(src, n, topk, list_keys, list_cols, tl.load(count), few, dst,
                              CAP, SMALL, TILE, BITS)
    _write_tail(dst, n, topk, OUT_BLOCK)
