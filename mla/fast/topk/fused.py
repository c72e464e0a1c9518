"""The one-launch kernel of ``mla.fast.top_k_per_row``: the programs of a row estimate its
threshold, each marks its part of the row in the row's bitmask in one read, and the last of
them selects among the marked keys (the plan, the route and the semantics: ``mla.fast.topk``;
the shared pieces: ``mla.fast.topk.kernels``).

Against the three launches it saves two kernels' start and drain and the threshold's round
trip through memory. A program holds a candidate list in registers for the select, so few are
resident a SM (two, registers capped, where they outnumber the SMs); splitting each row over
at least two of them keeps the memory busy: while one program selects its row, the other
program on its SM still reads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mla.fast.topk.kernels import (
    _chunk_range,
    _list_part,
    _mask_chunk,
    _row_range,
    _select_row,
    _threshold,
    _wait_ready,
    _work_row,
)


@triton.jit
def _mark_share_arrive(src, bits, start, end, part, parts, chunk, t, W, list_keys, list_cols,
                       fill, arrivals, CAP: tl.constexpr, TILE: tl.constexpr,
                       BLOCK: tl.constexpr, STAGES: tl.constexpr, SHARE: tl.constexpr,
                       ARRIVE: tl.constexpr):
    """Part ``part`` of ``parts`` of a row longer than ``CAP`` (``src``: its column 0; ``bits``:
    its bitmask): marks its ``chunk`` with the threshold ``t`` (``_mask_chunk``); ``SHARE``:
    lists its marked keys in the row's list (``_list_part``, places counted in ``fill``);
    ``ARRIVE``: then arrives by one atomic on ``arrivals``. Returns whether it selects the
    row: it arrived last (``ARRIVE``), else it is part 0."""
    _first, lo, hi = _chunk_range(start, end, part, chunk, BLOCK)
    if lo < hi:  # (a part past a short row's end has nothing to mark)
        marked = _mask_chunk(src, bits, start, end, part, chunk, t, W, BLOCK, STAGES)
        tl.debug_barrier()  # the part's words stored by every thread before any reads
        if SHARE:
            _list_part(src + start, bits, start, lo, hi, marked, list_keys, list_cols, fill,
                       CAP, TILE, 2 * TILE)
            tl.debug_barrier()  # the share stored by every thread before it arrives
    last = part == 0
    if ARRIVE:
        last = tl.atomic_add(arrivals, 1, sem="acq_rel") == parts - 1
        tl.debug_barrier()  # every thread past the arrival before any reads the list or words
    return last


@triton.jit
def _fused_kernel(logits, starts, ends, work, words, sync, out, W, topk, s_l_r, s_o_r, s_w_r,
                  chunk, OVERSAMPLE: tl.constexpr, SAMPLE_RUNS: tl.constexpr,
                  RUN: tl.constexpr, CAP: tl.constexpr, SMALL: tl.constexpr,
                  TILE: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                  STAGES: tl.constexpr, SPLIT: tl.constexpr, PART_LISTS: tl.constexpr,
                  OUT_BLOCK: tl.constexpr, WORD_TILE: tl.constexpr,
                  QUAD_ESTIMATE: tl.constexpr, QUAD_SELECT: tl.constexpr):
    """Programs ``(row, part)``: a row of no more than ``CAP`` keys is selected whole by its
    part 0; a longer one gets its threshold from the sample (each part with columns of the
    row alike), each part marks its ``chunk`` of columns in the row's bitmask
    (``_mask_chunk``: steps of ``BLOCK`` keys, ``STAGES`` in flight), and the row is selected
    from the marked keys (``_select_row``; the row streamed where the threshold failed); then
    ``-1`` past the row's count.

    ``SPLIT``, several parts a row: each part arrives by one atomic on ``sync[row, 0]``
    (``sync`` ``[R, 2]``, zeroed by the caller before the first launch) after its words; the
    part that arrives last selects, then zeroes the row's ``sync`` again, so that the same
    launch may run again (a CUDA graph's replays). ``PART_LISTS`` (with ``SPLIT``): before
    arriving, each part also lists its marked keys with their keys in the row's candidate
    list (``_list_part``, places counted in ``sync[row, 1]``), so that the last selects at
    once; else the last lists the whole bitmask. ``QUAD_ESTIMATE``, ``QUAD_SELECT``: the
    estimate's and the select's searches by ``_quad_search`` (``TopkPlan.estimate_search``,
    ``select_search``)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    start, end, n = _row_range(starts, ends, row, W)
    src = logits + row * s_l_r
    bits = words + row * s_w_r
    selects = part == 0
    if n > CAP:
        _first, lo, hi = _chunk_range(start, end, part, chunk, BLOCK)
        t = tl.zeros((), tl.int32)
        if lo < hi:  # (a part past a short row's end neither estimates nor marks)
            t = _threshold(src + start, n, topk, OVERSAMPLE, CAP, SAMPLE_RUNS, RUN,
                           QUAD_ESTIMATE)
        list_keys, list_cols, _few, _thresh, _count = _work_row(work, row, CAP, SMALL)
        selects = _mark_share_arrive(src, bits, start, end, part, tl.num_programs(1), chunk, t,
                                     W, list_keys, list_cols, sync + 2 * row + 1,
                                     sync + 2 * row, CAP, TILE, BLOCK, STAGES, PART_LISTS,
                                     SPLIT)
    if selects:
        _select_row(src, start, end, n, topk, bits, work, row, out + row * s_o_r,
                    sync + 2 * row + 1, CAP, SMALL, TILE, BITS, OUT_BLOCK, WORD_TILE,
                    PART_LISTS, QUAD_SELECT)
        if SPLIT:
            if n > CAP:
                # the row's counts zeroed for the next launch (a CUDA graph replays them)
                tl.debug_barrier()  # every thread done reading them
                tl.store(sync + 2 * row + tl.arange(0, 2), tl.zeros((2,), tl.int32))


# ``parts`` never specialized: a launch with one part a row (rows of 8K-32K keys) would make it
# the constant 1, and Triton then compiles the mark's loads as 4-byte copies, not 16-byte ones
# (``benchmarks.topk_sweep --sm90``; 2048 x 32K took 267 us against 236 with 16-byte copies)
@triton.jit(do_not_specialize=["parts"])
def _mark_select_kernel(logits, starts, ends, work, words, ready, out, W, topk, s_l_r, s_o_r,
                        s_w_r, chunk, parts, CAP: tl.constexpr, SMALL: tl.constexpr,
                        TILE: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                        STAGES: tl.constexpr, OUT_BLOCK: tl.constexpr,
                        WORD_TILE: tl.constexpr, QUAD: tl.constexpr):
    """Two launches' second, after the estimate (``_estimate_kernel``: the thresholds, the
    counts zeroed): program ``row · parts + part`` (a grid of one dimension: rows past 65535
    fit), the parts of a row next to each other in the grid, so that rows finish one after
    another and a row's select overlaps the later rows' reads. Each part of a row longer than
    ``CAP`` marks its ``chunk`` (``_mask_chunk``), lists its share (``_list_part``) and
    arrives; the last selects (``_select_row``). A shorter row is selected whole by its part
    0. The row's programs wait for its estimate alone (its flag ``ready[row]``, set by the
    estimate, cleared by the selecting program), so that, launched as the estimate's
    programmatic dependent, the first rows mark while later rows are estimated (H200: 255
    against 265 us at 1024 x 128K, 145 against 153 at 512). ``QUAD``: the select's search
    (``TopkPlan.select_search``)."""
    part = tl.program_id(0) % parts
    row = (tl.program_id(0) // parts).to(tl.int64)
    start, end, n = _row_range(starts, ends, row, W)
    src = logits + row * s_l_r
    bits = words + row * s_w_r
    list_keys, list_cols, _few, thresh, count = _work_row(work, row, CAP, SMALL)
    selects = part == 0
    if (n > CAP) | selects:
        _wait_ready(ready + row)  # the row's threshold and zeroed counts
    if n > CAP:
        selects = _mark_share_arrive(src, bits, start, end, part, parts, chunk,
                                     tl.load(thresh), W, list_keys, list_cols, count, count + 1,
                                     CAP, TILE, BLOCK, STAGES, True, True)
    if selects:
        _select_row(src, start, end, n, topk, bits, work, row, out + row * s_o_r, count, CAP,
                    SMALL, TILE, BITS, OUT_BLOCK, WORD_TILE, True, QUAD)
        tl.store(ready + row, 0)  # for the next launch (every part of the row is past it)
