"""The Triton kernels of ``mla.fast.top_k_per_row`` (the plan and the semantics: ``mla.fast.topk``).

Keys: a float32's bits ``b`` map to an int32 ``k`` that orders as the floats do (``b`` for a
positive float, ``b ^ 0x7FFFFFFF`` for a negative one; ``-0`` read as ``+0``, every NaN as
``2^31 - 1``). Ties go to the lower column. The select of held keys searches their unsigned
patterns (``_unsigned``); for a tied boundary key, held in column order (a row held whole, a
list from a bitmask) the ties are counted in place order, else a second search takes the
least of its equals' inverted columns (the searches and the radix levels:
``mla.fast.topk.search``); the scan
of a whole row (the threshold failed) runs radix levels on the non-negative int64
``(k + 2^31) << 31 | (0x7FFFFFFF - column)``, unique per row, so "the ``need`` best" is always
one exact set, and its digits are plain bit fields.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mla.fast.topk.search import (
    _bisect,
    _boundary,
    _bucket,
    _composite,
    _digits,
    _fix,
    _inverted,
    _level,
    _place,
    _quad_search,
    _search,
    _unsigned,
)

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
    ``SMALL`` int64 for a compacted boundary bucket, then the threshold, the survivor count
    and (two launches) the parts arrived."""
    base = work + row * (2 * CAP + 2 * SMALL + WORK_PAD)
    few = (base + 2 * CAP).to(tl.pointer_type(tl.int64))
    tail = base + 2 * CAP + 2 * SMALL
    return base, base + CAP, few, tail, tail + 1


@triton.jit
def _sample(src, n, topk, OVERSAMPLE: tl.constexpr, CAP: tl.constexpr,
            SAMPLE_RUNS: tl.constexpr, RUN: tl.constexpr):
    """The estimate's sample of a row of ``n`` keys (``src``: its first), ``SAMPLE_RUNS``
    evenly spaced runs of ``RUN`` keys (every part of the row is seen) as ``_unsigned``
    patterns, and the sample rank that about ``OVERSAMPLE * topk`` of the row's keys (plus
    three deviations) reach; for a large ``topk``, at most halfway to the list's length
    ``CAP``. For rows of more than ``CAP`` keys."""
    j = tl.arange(0, SAMPLE_RUNS).to(tl.int64)
    step = ((n - RUN).to(tl.int32) // (SAMPLE_RUNS - 1)).to(tl.int64)  # n < 2^31
    cols = (j * step)[:, None] + tl.arange(0, RUN)[None, :]
    u = tl.reshape(_unsigned(_order_keys(tl.load(src + cols))), (SAMPLE_RUNS * RUN,))
    expect = tl.fdiv((topk * 1.0) * (SAMPLE_RUNS * RUN), n.to(tl.float32))  # approximate
    fits = 0.5 * (expect + tl.fdiv(CAP * (SAMPLE_RUNS * RUN * 1.0), n.to(tl.float32)))
    aim = tl.ceil(OVERSAMPLE * expect + 3.0 * tl.sqrt(expect) + 8.0)
    return u, tl.minimum(tl.minimum(aim, fits), SAMPLE_RUNS * RUN).to(tl.int32)


@triton.jit
def _threshold(src, n, topk, OVERSAMPLE: tl.constexpr, CAP: tl.constexpr,
               SAMPLE_RUNS: tl.constexpr, RUN: tl.constexpr, QUAD: tl.constexpr):
    """The int32 key that about ``OVERSAMPLE * topk`` of the row's ``n`` keys (``src``: its
    first) reach, searched at ``_sample``'s rank by bisection or (``QUAD``) by
    ``_quad_search`` from its normal guess. For rows of more than ``CAP`` keys."""
    u, rank = _sample(src, n, topk, OVERSAMPLE, CAP, SAMPLE_RUNS, RUN)
    # any key that about rank to rank + rank / 16 + 2 of the sample reach (or, past it, a
    # tied one: its value) will do: the threshold only sets how many keys the read lists,
    # never which are selected
    slack = rank // 16 + 2
    if QUAD:
        t, _reach = _quad_search(u, rank, True, slack)
    else:
        t, _reach = _bisect(u, rank, slack)
    return (t ^ 0x80000000).to(tl.int32, bitcast=True)


@triton.jit
def _estimate_kernel(logits, starts, ends, work, ready, W, topk, s_l_r,
                     OVERSAMPLE: tl.constexpr, CAP: tl.constexpr, SAMPLE_RUNS: tl.constexpr,
                     RUN: tl.constexpr, SMALL: tl.constexpr, PDL: tl.constexpr,
                     READY: tl.constexpr, QUAD: tl.constexpr):
    """Per row its threshold (``_threshold``, ``QUAD`` its search) and its survivor count
    zeroed. Rows of no more
    than ``CAP`` keys need no threshold. ``PDL``: the next launch, its programmatic
    dependent, may start now (its programs wait for this kernel's results). ``READY``: then
    the row's flag ``ready[row]`` set to 1 (release), for the programs that wait for this row
    alone (``_wait_ready``)."""
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    start, end, n = _row_range(starts, ends, row, W)
    _keys, _cols, _few, thresh, count = _work_row(work, row, CAP, SMALL)
    tl.store(count + tl.arange(0, 2), tl.zeros((2,), tl.int32))  # the count, the arrivals
    if n > CAP:
        t = _threshold(logits + row * s_l_r + start, n, topk, OVERSAMPLE, CAP, SAMPLE_RUNS,
                       RUN, QUAD)
        tl.store(thresh, t)
    if READY:
        tl.debug_barrier()  # every thread's stores before the flag
        tl.atomic_xchg(ready + row, 1, sem="release")


@triton.jit
def _wait_ready(flag):
    """Spin until the estimate has set ``flag`` (acquire: its row's threshold and zeroed
    counts are then visible). Safe only where every estimate program has started (a
    programmatic dependent launches after all of them trigger) or ended (stream order)."""
    while tl.atomic_add(flag, 0, sem="acquire") == 0:
        pass


@triton.jit
def _mask_kernel(logits, starts, ends, work, words, W, s_l_r, s_w_r, chunk,
                 CAP: tl.constexpr, SMALL: tl.constexpr, BLOCK: tl.constexpr,
                 STAGES: tl.constexpr, PDL: tl.constexpr):
    """Program ``(row, c)`` marks chunk ``c`` of the row (``_mask_chunk``). ``PDL``: launched
    as the estimate's programmatic dependent, a program waits for the estimate's thresholds
    (``griddepcontrol.wait``; the row ranges are inputs, read before)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    start, end, n = _row_range(starts, ends, row, W)
    if PDL:
        gdc_wait()
    if n > CAP:
        _keys, _cols, _few, thresh, _count = _work_row(work, row, CAP, SMALL)
        _mask_chunk(logits + row * s_l_r, words + row * s_w_r, start, end, c, chunk,
                    tl.load(thresh), W, BLOCK, STAGES)


@triton.jit
def _chunk_range(start, end, c, chunk, BLOCK: tl.constexpr):
    """Chunk ``c``'s columns ``[lo, hi)`` of a row ``[start, end)``: chunks of ``chunk`` (a
    multiple of ``BLOCK``) from ``start`` rounded down to ``BLOCK``; empty (``lo >= hi``) past
    the row's end. Also ``start`` as int32."""
    first = start.to(tl.int32)
    lo = tl.multiple_of(first - first % BLOCK + c * chunk, BLOCK)
    return first, lo, tl.minimum(lo + chunk, end.to(tl.int32))


@triton.jit
def _key_floor(t):
    """The float32 ``f`` that the key threshold ``t`` is on the floats: a number's key
    reaches ``t`` exactly where it is ``>= f`` (``-0`` and ``+0`` compare equal, as their keys
    are; a ``t`` past ``+inf``'s key gives a NaN ``f``, which no number reaches; below
    ``-inf``'s, ``-inf``, which all do). A NaN's key reaches every ``t``."""
    f = tl.where(t < 0, t ^ 0x7FFFFFFF, t).to(tl.float32, bitcast=True)
    return tl.where(t <= -2139095041, float("-inf"), f)  # -2139095041: -inf's key


@triton.jit
def _mark_block(src, dst, c0, f, first, hi, W, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """Block ``c0`` of a row (``src``: its column 0): a bit a key, set where the key reaches
    the threshold (the float ``f``: ``_key_floor``), stored as ``BLOCK / 32`` int32 words at
    word ``c0 / 32`` of ``dst``; ``MASKED``: only columns in ``[first, hi)`` (a block at a
    chunk's ends), else the whole block is in it. Returns the bits set a thread holds."""
    cols = tl.multiple_of(c0, BLOCK) + tl.arange(0, BLOCK)
    if MASKED:
        # masked at the row's width, not the range's end: whole 16-byte vectors (the
        # neighbours loaded are never kept)
        x = tl.load(src + cols, mask=cols < W, other=0.0)
        keep = ((x >= f) | (x != x)) & (cols >= first) & (cols < hi)
    else:
        x = tl.load(src + cols)
        keep = (x >= f) | (x != x)
    keep = tl.reshape(keep.to(tl.int32), (BLOCK // 32, 32))
    tl.store(dst + c0 // 32 + tl.arange(0, BLOCK // 32),
             tl.sum(keep << tl.arange(0, 32)[None, :], axis=1))
    return keep


@triton.jit
def _mask_chunk(src, dst, start, end, c, chunk, t, W, BLOCK: tl.constexpr,
                STAGES: tl.constexpr):
    """One streaming read: chunk ``c`` of a row (``src``: its column 0; ``_chunk_range``)
    records a bit a key, set where the key reaches ``t``, as int32 words (bit ``b`` of word
    ``w``: column ``32 w + b``; zero outside ``[start, end)``). No scan, no atomic, no branch
    in the loop: a block's keys, compared as floats (``_key_floor``), become ``BLOCK / 32``
    stored words, and the loads stay in flight (``STAGES``); only the chunk's first and last
    blocks, where they pass its range, are masked. Returns the count of bits set (each thread
    counts its own keys; one sum at the end)."""
    first, lo, hi = _chunk_range(start, end, c, chunk, BLOCK)
    f = _key_floor(t)
    kept = tl.zeros((BLOCK // 32, 32), tl.int32)
    blocks = tl.maximum(hi - lo + BLOCK - 1, 0) // BLOCK
    head = (lo < first) & (blocks > 0)  # the row's first block begins before its start
    tail = ((hi - lo) % BLOCK != 0) & (blocks > head.to(tl.int32))  # a partial last block
    if head:
        kept += _mark_block(src, dst, lo, f, first, hi, W, BLOCK, True)
    inner_lo = lo + head.to(tl.int32) * BLOCK
    inner_hi = lo + (blocks - tail.to(tl.int32)) * BLOCK
    for c0 in tl.range(inner_lo, inner_hi, BLOCK, num_stages=STAGES):
        kept += _mark_block(src, dst, c0, f, first, hi, W, BLOCK, False)
    if tail:
        kept += _mark_block(src, dst, lo + (blocks - 1) * BLOCK, f, first, hi, W, BLOCK, True)
    return tl.sum(tl.sum(kept, axis=1), axis=0)


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
def _list_from_mask(bits, start, w0, w1, cols_out, CAP: tl.constexpr, TILE: tl.constexpr):
    """The columns (from ``start``) of the keys whose bits are set (``bits`` words
    ``[w0, w1)``), listed in column order: a tile of ``TILE`` words at a time, each word's set
    bits go to the places after the words before it (running counts of the words' popcounts),
    a bit a round, as many rounds as the tile's fullest word has bits (no loads in the
    rounds); places past ``CAP`` are dropped. Returns the count."""
    total = tl.zeros((), tl.int32)
    for g in range(w0, w1, TILE):
        j = g + tl.arange(0, TILE)
        word = tl.load(bits + j, mask=j < w1, other=0)
        pc = _popc(word)
        pos = total + tl.cumsum(pc, axis=0) - pc
        u = word.to(tl.uint32, bitcast=True)
        for _r in range(0, tl.max(pc, axis=0)):
            low = u & (0 - u)  # the lowest set bit
            # its place: a power of two is exact in float32, its exponent the place
            bit = (low.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
            has = (u != 0) & (pos < CAP)
            tl.store(cols_out + pos, j * 32 + bit - start.to(tl.int32), mask=has)
            pos += 1
            u = u & (u - 1)
        total += tl.sum(pc, axis=0)
    return total


@triton.jit
def _list_part(src, bits, start, lo, hi, marked, list_keys, list_cols, fill,
               CAP: tl.constexpr, WORD_TILE: tl.constexpr, TILE: tl.constexpr):
    """A part's share of the row's candidate list, after its marks (columns ``[lo, hi)``,
    ``marked`` of them set): one atomic on ``fill`` (the row's places taken, zeroed before
    the launch) reserves places ``[at, at + marked)`` of the list; the part lists its columns
    there in column order (the parts' shares in the order of their atomics), then gathers
    their keys beside them (``src``: the row's start), ``TILE`` a step. A share that would
    pass ``CAP`` is not written: ``fill`` then exceeds ``CAP`` and the row is scanned."""
    at = tl.atomic_add(fill, marked, sem="relaxed")
    if at + marked <= CAP:
        _list_from_mask(bits, start, lo // 32, (hi + 31) // 32, list_cols + at, CAP,
                        WORD_TILE)
        tl.debug_barrier()  # the columns stored by every thread before any reads them
        _gather_keys(src, list_cols + at, list_keys + at, marked, TILE)


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
def _held_keys(src, list_keys, i, items, from_list):
    """Items ``i``'s keys as ``_unsigned`` patterns, 0 past ``items``: the list's keys
    (``from_list``) or the row's floats made keys, by one load of 32-bit patterns."""
    live = i < items
    raw = tl.load(tl.where(from_list, list_keys, src.to(tl.pointer_type(tl.int32))) + i,
                  mask=live, other=0)
    k = tl.where(from_list, raw, _order_keys(raw.to(tl.float32, bitcast=True)))
    return tl.where(live, _unsigned(k), 0)


@triton.jit
def _select_in_registers(u, cols, need, dst, QUAD: tl.constexpr):
    """The exact ``need`` best of the held keys ``u`` (0: no item), their ``cols`` (in any
    order) written to ``dst`` in the items' order. ``QUAD``: ``_search``'s."""
    p, last = _boundary(u, cols, need, QUAD)
    take = (u > p) | ((u == p) & (_inverted(cols) >= last))
    tl.store(dst + tl.cumsum(take.to(tl.int32), axis=0) - 1, cols, mask=take)


@triton.jit
def _select_in_column_order(u, cols, need, dst, QUAD: tl.constexpr):
    """``_select_in_registers`` for items held in column order (a place's column below every
    later place's: a row held whole, a list from a bitmask): of a tied boundary key ``p`` the
    first ``need - above`` in place order are the lowest columns, so one scan of two 16-bit
    counts, the items above ``p`` and the ties so far, places every taken item; no search
    among the ties (an untied boundary, the common case, takes a scan of one count).
    ``QUAD``: ``_search``'s."""
    p, reach = _search(u, need, QUAD)
    take, pos = _column_order_places(u, p, reach, need)
    tl.store(dst + pos, cols, mask=take)


@triton.jit
def _column_order_places(u, p, reach, need):
    """Which held items (in column order) ``_select_in_column_order`` takes, and their places
    in the output, given the boundary ``p`` that ``reach`` items reach: above ``p`` every one,
    of its ties the first ``need - above`` (all, where ``reach <= need``)."""
    if reach > need:
        above = (u > p).to(tl.int32)
        tie = u == p
        keep = need - tl.sum(above, axis=0)  # the ties taken
        run = tl.cumsum(above + (tie.to(tl.int32) << 16), axis=0)
        ties = run >> 16
        take = (above != 0) | (tie & (ties <= keep))
        pos = (run & 0xFFFF) + tl.minimum(ties, keep) - 1
    else:  # at most need reach p: one count
        take = u >= p
        pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
    return take, pos


@triton.jit
def _select_in_tiles(src, list_keys, list_cols, items, need, dst, from_list,
                     HOLD: tl.constexpr, TILE: tl.constexpr, QUAD: tl.constexpr):
    """``_select_in_registers`` for up to ``HOLD`` items in memory (a row's keys, column
    ``i`` at place ``i``, or a list's, ``from_list``) too many to hold with their columns:
    the keys are held for the searches (``QUAD``: ``_search``'s), then read again in tiles of
    ``TILE`` to write the columns."""
    i = tl.arange(0, HOLD)
    u = _held_keys(src, list_keys, i, items, from_list)
    cols = tl.where(from_list, tl.load(list_cols + i, mask=(i < items) & from_list, other=0), i)
    p, last = _boundary(u, cols, need, QUAD)
    written = tl.zeros((), tl.int32)
    for t in range(0, items, TILE):
        j = t + tl.arange(0, TILE)
        w = _held_keys(src, list_keys, j, items, from_list)
        c = tl.where(from_list, tl.load(list_cols + j, mask=(w >= p) & from_list, other=0), j)
        take = (w > p) | ((w == p) & (_inverted(c) >= last))
        tl.store(dst + written + tl.cumsum(take.to(tl.int32), axis=0) - 1, c, mask=take)
        written += tl.sum(take.to(tl.int32), axis=0)


@triton.jit
def _gather_keys(src, list_cols, list_keys, items, TILE: tl.constexpr):
    """The keys of the listed columns (``src``: the row's start), stored beside them."""
    for g in range(0, items, TILE):
        i = g + tl.arange(0, TILE)
        live = i < items
        col = tl.load(list_cols + i, mask=live, other=0)
        tl.store(list_keys + i, _order_keys(tl.load(src + col, mask=live, other=0.0)),
                 mask=live)


@triton.jit
def _select_listed_or_row(src, n, topk, list_keys, list_cols, survivors, few, dst,
                          CAP: tl.constexpr, SMALL: tl.constexpr, TILE: tl.constexpr,
                          BITS: tl.constexpr, QUAD: tl.constexpr):
    """For ``n > topk``: the exact ``topk`` best of the row (``src``: its start) held whole
    (``n <= CAP``), of its candidate list held whole (``topk <= survivors <= CAP``, keys and
    columns in memory), or else of the row streamed (the threshold failed). Up to half the
    list's length, the keys and columns are held together. ``QUAD``: ``_search``'s."""
    items = tl.where(n <= CAP, n, survivors).to(tl.int32)
    from_list = n > CAP
    if (n <= CAP) | ((survivors >= topk) & (survivors <= CAP)):
        if items <= CAP // 2:
            i = tl.arange(0, CAP // 2)
            u = _held_keys(src, list_keys, i, items, from_list)
            cols = tl.where(from_list, tl.load(list_cols + i, mask=(i < items) & from_list,
                                               other=0), i)
            _select_in_registers(u, cols, topk, dst, QUAD)
        else:
            _select_in_tiles(src, list_keys, list_cols, items, topk, dst, from_list, CAP, TILE,
                             QUAD)
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
def _held_kernel(logits, starts, ends, out, few, W, topk, s_l_r, s_o_r, CAP: tl.constexpr,
                 HOLD: tl.constexpr, TILE: tl.constexpr, OUT_BLOCK: tl.constexpr,
                 IN_REGISTERS: tl.constexpr, QUAD: tl.constexpr, PREFETCH: tl.constexpr,
                 BOUNDED: tl.constexpr, BITS: tl.constexpr, SMALL: tl.constexpr):
    """One program a row, for rows of at most ``HOLD`` keys, ``HOLD`` at most ``CAP`` (every
    route, where the logits are no wider): the row's keys held, its exact ``topk`` best by
    the boundary's search (``QUAD``: ``_search``), the columns written from registers in
    column order (``HOLD`` at most ``CAP / 2``, as a list is, or any ``HOLD`` with
    ``IN_REGISTERS``: a held row's columns are its places, nothing more to hold;
    ``_select_in_column_order``) or by a second read of the row in tiles of ``TILE``
    (``_select_in_tiles``); then ``-1`` past the row's count. ``PREFETCH`` (the columns
    written from registers): the row's columns ``[0, W)`` loaded before its range is read,
    so that the range's load does not delay the row's, and from an aligned start (the
    range's start would make them 4-byte loads); the keys outside the range are dropped in
    registers. Only this path is compiled: the general kernels, which also hold the
    estimate, the listing and the scan, took 1.1-1.4x as long for the same rows on the H200
    (1 / 128 / 1024 x 8K: 32.8 / 27.5 / 108.6 us against 25.7 / 23.2 / 87.2).

    ``BOUNDED``: the logits are wider than ``HOLD`` and the caller's bound on the rows'
    lengths (``max_row_len``) put them here. A row's columns ``[base, base + HOLD)`` are
    loaded, ``base`` its start rounded down to 16 bytes (aligned loads wherever the row
    starts; a decode row starts at 0); a row that does not fit them (past the bound, or
    within 3 keys of it from an unaligned start) is selected exact, slowly, by the scan of
    the whole row (``_stream_select``, its scratch ``few``: ``2 * SMALL`` int32 a row)."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HOLD)
    if PREFETCH:  # columns [0, W), in 16-byte loads where the row's stride allows
        x = tl.load(logits + row * s_l_r + i, mask=i < W, other=0.0)
    start, end, n = _row_range(starts, ends, row, W)
    src = logits + row * s_l_r + start
    dst = out + row * s_o_r
    if BOUNDED:
        base = tl.multiple_of((start // 4) * 4, 4)
    else:
        base = tl.zeros((), tl.int64)
    if n <= topk:
        _write_all(dst, n, OUT_BLOCK)
    elif (end - base > HOLD) & BOUNDED:  # past the caller's bound: exact, slow
        _stream_select(src, n, topk, (few + row * (2 * SMALL)).to(tl.pointer_type(tl.int64)),
                       dst, TILE, BITS, SMALL)
    else:
        if HOLD * 2 <= CAP or IN_REGISTERS:
            if PREFETCH or BOUNDED:
                if BOUNDED:  # (masked at the width: whole 16-byte vectors)
                    x = tl.load(logits + row * s_l_r + base + i, mask=base + i < W, other=0.0)
                live = (base + i >= start) & (base + i < end)
                u = tl.where(live, _unsigned(_order_keys(x)), 0)
                _select_in_column_order(u, (base + i - start).to(tl.int32), topk, dst, QUAD)
            else:
                live = i < n
                u = tl.where(live, _unsigned(_order_keys(tl.load(src + i, mask=live,
                                                                 other=0.0))), 0)
                _select_in_column_order(u, i, topk, dst, QUAD)
        else:
            _select_in_tiles(src, dst, dst, n.to(tl.int32), topk, dst, False, HOLD, TILE, QUAD)
    _write_tail(dst, n, topk, OUT_BLOCK)


@triton.jit
def _select_kernel(logits, starts, ends, work, words, out, W, topk, s_l_r, s_o_r, s_w_r,
                   CAP: tl.constexpr, SMALL: tl.constexpr, TILE: tl.constexpr,
                   BITS: tl.constexpr, OUT_BLOCK: tl.constexpr, WORD_TILE: tl.constexpr,
                   QUAD: tl.constexpr):
    """One program a row: ``_select_row``."""
    row = tl.program_id(0).to(tl.int64)
    start, end, n = _row_range(starts, ends, row, W)
    _select_row(logits + row * s_l_r, start, end, n, topk, words + row * s_w_r, work, row,
                out + row * s_o_r, work, CAP, SMALL, TILE, BITS, OUT_BLOCK, WORD_TILE, False,
                QUAD)


@triton.jit
def _select_row(src, start, end, n, topk, bits, work, row, dst, fill, CAP: tl.constexpr,
                SMALL: tl.constexpr, TILE: tl.constexpr, BITS: tl.constexpr,
                OUT_BLOCK: tl.constexpr, WORD_TILE: tl.constexpr, LISTED: tl.constexpr,
                QUAD: tl.constexpr):
    """The exact ``topk`` best of the row (``src``: its column 0) held whole (no more than
    ``CAP`` keys), of the keys its bitmask ``bits`` marks (``_mask_chunk``; their count, stored
    for ``survivors``, from ``topk`` to ``CAP``), or else of the row streamed (the threshold
    failed); then ``-1`` past the row's count. A list of up to ``CAP / 2`` is gathered
    straight into registers (its keys never stored). ``LISTED``: the list and its keys are
    already in the scratch, ``fill`` places (``_list_part``). ``work``: the scratch
    (``_work_row``). ``QUAD``: the boundary by ``_quad_search`` (else ``_bracket_search``)."""
    src = src + start
    list_keys, list_cols, few, _thresh, count = _work_row(work, row, CAP, SMALL)
    if n <= topk:
        _write_all(dst, n, OUT_BLOCK)
    else:
        items = n.to(tl.int32)
        done = tl.zeros((), tl.int32)
        if n > CAP:
            if LISTED:
                items = tl.load(fill)
                tl.store(count, items)
            else:
                items = _list_from_mask(bits, start, (start // 32).to(tl.int32),
                                        ((end + 31) // 32).to(tl.int32), list_cols, CAP,
                                        WORD_TILE)
                tl.store(count, items)
                tl.debug_barrier()  # the list stored by every thread before any reads it
                if (items >= topk) & (items <= CAP // 2):
                    i = tl.arange(0, CAP // 2)
                    live = i < items
                    cols = tl.load(list_cols + i, mask=live, other=0)
                    u = tl.where(live, _unsigned(_order_keys(tl.load(src + cols, mask=live,
                                                                     other=0.0))), 0)
                    _select_in_column_order(u, cols, topk, dst, QUAD)
                    done = tl.full((), 1, tl.int32)
                elif (items > CAP // 2) & (items <= CAP):
                    _gather_keys(src, list_cols, list_keys, items, TILE)
                    tl.debug_barrier()  # the keys stored by every thread before any reads them
        if done == 0:
            _select_listed_or_row(src, n, topk, list_keys, list_cols, items, few, dst, CAP,
                                  SMALL, TILE, BITS, QUAD)
    _write_tail(dst, n, topk, OUT_BLOCK)
