"""The one-launch kernel of ``mla.fast.top_k_per_row``: the programs of a row estimate its
threshold, read their part of the row once listing the keys that reach it, and the last of
them selects among those (the plan, the route and the semantics: ``mla.fast.topk``; the
shared pieces: ``mla.fast.topk_kernels``).

Against the three launches it saves two kernels' start and drain and the threshold's round
trip through memory; a part's survivors go to ``count + cumsum(keep) - 1`` with the count in
a register (no atomic a block), and a row of few parts spreads its read over as many SMs.
What it cannot do is run many programs a SM: a program holds a candidate list in registers
for the select (127 registers a thread at 8 warps), so few are resident a SM, and a whole row
read by one program is a chain of block-wide scans (~3.4 GB/s on the H200).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mla.fast.topk_kernels import (
    _order_keys,
    _row_range,
    _select_listed_or_row,
    _threshold,
    _work_row,
    _write_all,
    _write_tail,
)


@triton.jit
def _fused_kernel(logits, starts, ends, work, parts, sync, out, W, topk, s_l_r, s_o_r, chunk,
                  OVERSAMPLE: tl.constexpr, SAMPLE_RUNS: tl.constexpr, RUN: tl.constexpr,
                  CAP: tl.constexpr, SMALL: tl.constexpr,
                  TILE: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                  STAGES: tl.constexpr, SPLIT: tl.constexpr,
                  OUT_BLOCK: tl.constexpr):
    """Programs ``(row, part)``: a row of no more than ``CAP`` keys is selected whole by its
    part 0; a longer one gets its threshold from the sample (each part alike), each part
    streams its ``chunk`` of columns once in steps of ``BLOCK`` keys (``STAGES`` in flight)
    listing the keys reaching it, and the list (or, when the threshold let fewer than ``topk``
    or more than fit through, the row) is selected; then ``-1`` past the row's count.

    One part a row: its list is the row's (``_stream_list``). ``SPLIT``, several: each part
    lists into its own ``parts`` list (``CAP``), reserves its place in the row's list by one
    atomic on ``sync[row, 0]`` (zeroed by the caller) and copies it there; the part that
    arrives last (``sync[row, 1]``) selects.
    The survivor count is stored for ``mla.fast.topk.survivors`` (past ``CAP`` where a list
    overflowed)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    start, end, n = _row_range(starts, ends, row, W)
    src = logits + row * s_l_r
    dst = out + row * s_o_r
    keys_out, cols_out, few, _thresh, count_ptr = _work_row(work, row, CAP, SMALL)
    if n <= CAP:
        if part == 0:
            if n <= topk:
                _write_all(dst, n, OUT_BLOCK)
            else:
                _select_listed_or_row(src + start, n, topk, keys_out, cols_out, part * 0, few,
                                      dst, CAP, SMALL, TILE, BITS)
            _write_tail(dst, n, topk, OUT_BLOCK)
    else:
        t = _threshold(src + start, n, topk, OVERSAMPLE, CAP, SAMPLE_RUNS, RUN)
        # from start rounded down to 16, so that the loads are 16-byte vectors; columns as
        # int32 (W < 2^31)
        first = start.to(tl.int32)
        lo = tl.multiple_of(first - first % 16 + part * chunk, 16)
        hi = tl.minimum(lo + chunk, end.to(tl.int32))
        if SPLIT:
            mine = parts + (row * tl.num_programs(1) + part) * (2 * CAP)
            kept = _stream_list(src, first, lo, hi, t, W, mine, mine + CAP, CAP, BLOCK, STAGES)
            tl.debug_barrier()  # the part's list written by every thread before it is copied
            base = tl.atomic_add(sync + 2 * row, kept, sem="relaxed")
            for g in range(0, tl.minimum(kept, CAP - base), TILE):
                i = g + tl.arange(0, TILE)
                m = (i < kept) & (base + i < CAP)
                tl.store(keys_out + base + i, tl.load(mine + i, mask=m), mask=m)
                tl.store(cols_out + base + i, tl.load(mine + CAP + i, mask=m), mask=m)
            tl.debug_barrier()  # the part's copy written by every thread before it arrives
            arrived = tl.atomic_add(sync + 2 * row + 1, 1, sem="acq_rel")
            if arrived == tl.num_programs(1) - 1:
                count = tl.atomic_add(sync + 2 * row, 0, sem="acq_rel")
                tl.store(count_ptr, count)
                _select_listed_or_row(src + start, n, topk, keys_out, cols_out, count, few,
                                      dst, CAP, SMALL, TILE, BITS)
                _write_tail(dst, n, topk, OUT_BLOCK)
        else:
            count = _stream_list(src, first, lo, hi, t, W, keys_out, cols_out, CAP, BLOCK, STAGES)
            tl.store(count_ptr, count)
            tl.debug_barrier()  # the list written by every thread before any reads it
            _select_listed_or_row(src + start, n, topk, keys_out, cols_out, count, few, dst,
                                  CAP, SMALL, TILE, BITS)
            _write_tail(dst, n, topk, OUT_BLOCK)


@triton.jit
def _stream_list(src, first, lo, hi, t, W, keys_out, cols_out, CAP: tl.constexpr,
                 BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """One read of columns ``[max(lo, first), hi)`` of the row (``src``: its column 0;
    ``lo`` a multiple of 16) listing the keys at or above ``t`` (columns from ``first``) at
    ``count + cumsum(keep) - 1`` (a block-wide scan a step); returns the count (past ``CAP``,
    the list is incomplete)."""
    count = tl.zeros((), tl.int32)
    for c0 in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        cols = tl.multiple_of(c0, 16) + tl.arange(0, BLOCK)
        k = _order_keys(tl.load(src + cols, mask=cols < W, other=0.0))
        keep = (cols >= first) & (cols < hi) & (k >= t)
        pos = count + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        ok = keep & (pos < CAP)
        tl.store(keys_out + pos, k, mask=ok)
        tl.store(cols_out + pos, cols - first, mask=ok)
        count += tl.sum(keep.to(tl.int32), axis=0)
    return count
