"""``top_k_per_row`` in Triton: a radix select over order-preserving integer keys, each row
split across programs.

Same selection as ``mla.reference.indexer_logits.top_k_per_row`` (conventions §10, "Indexer
logits and top-k"): per row the ``min(topk, end - start)`` highest logits of columns
``[start, end)``, ties to the lower index, NaN above every number, as ``j - start``; the rest
of the row ``-1``. Columns outside ``[start, end)`` never count (the streaming passes load
whole 16-byte vectors of the row, so a neighbour may be loaded, then masked). The set is not
sorted by score (the sparse attention sums over it, the catalogue compares sets): the keys
above the boundary bucket come first, in column order, then the boundary's chosen keys, in
column order.

**Keys.** A float32's bits ``b`` map to an integer that orders as the floats do: ``b`` for a
positive float, ``b ^ 0x7FFFFFFF`` for a negative one (int32); ``-0`` is read as ``+0`` (equal, as
the reference's sort has them) and every NaN as ``2^31 - 1`` (above ``+inf``). ``key ^ -2^31``
is the same order as uint32 bits, whose top 11 bits are the first digit.

**Select**, four launches over ``R x C`` programs (``C`` chunks a row, enough to fill the GPU):

1. a histogram of each chunk's first digits (bits 31-21), kept, and summed over the row's
   chunks by atomics;
2. from the row's histogram, the bucket ``d`` that holds the ``topk``-th best; from each
   chunk's, its keys above ``d`` (all of them are selected) and in it (the candidates): no
   read of the logits;
3. each chunk writes its keys above ``d`` at its offset (a prefix over the earlier chunks'
   counts: column order, no atomics on the output) and its candidates' columns to a scratch row;
4. one program a row finishes on the candidates alone (usually a few thousand; a row with more
   than ``CANDIDATES`` is scanned again instead of listed): two more histogram passes (bits
   20-10, 9-0) give the boundary key and how many equal ones to take, the first in column
   order.

Two reads of the logits (the second mostly from L2), plus the boundary's few; rows with
``end - start <= topk`` skip the histograms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.fast.common import next_pow2, num_sms, should_validate
from mla.validation import check_float, check_index, check_same_device

__all__ = ["top_k_per_row"]

BLOCK = 1024
BINS = 2048  # 11 bits a digit
MAX_CHUNKS = 256
STAGES = 3  # blocks of a chunk in flight (software pipelining of the streaming reads)
CANDIDATES = 8192  # the boundary's scratch list, per row; a row with more is scanned instead


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
def _read(src, cols, W):
    """A block of a row's logits, masked by the row's width only: with ``W`` a multiple of 16
    (Triton specializes it) the loads are 16-byte vectors. Columns outside ``[start, end)``
    may be loaded with their neighbours but never count (the callers' ``live`` masks)."""
    return tl.load(src + cols, mask=cols < W, other=0.0)


@triton.jit
def _chunk(start, end, c, chunk):
    """Chunk ``c`` of a row: columns ``[lo, hi)`` counted from ``start`` rounded down to a
    multiple of 16 (so that the loads are 16-byte vectors; the columns before ``start`` are
    masked), ``hi`` clipped to ``end``."""
    lo = tl.multiple_of(start - start % 16 + c * chunk, 16)
    return lo, tl.minimum(lo + chunk, end)


@triton.jit
def _first_digit(hist_row, topk, n, BINS: tl.constexpr):
    """The first digit's bucket that holds the ``topk``-th best key; ``-1`` (every key above
    it) when the row has no more than ``topk`` keys."""
    bins = tl.arange(0, BINS)
    h = tl.load(hist_row + bins)
    above = tl.cumsum(h, axis=0, reverse=True)  # keys at or above each bucket
    d = tl.sum((above >= topk).to(tl.int32), axis=0) - 1
    return tl.where(n > topk, d, -1)


@triton.jit
def _candidates(src, cand_row, c0, items, listed, BLOCK: tl.constexpr):
    """Items ``[c0, c0 + BLOCK)`` of the boundary's candidates: their columns, uint32-ordered
    keys and liveness; from the scratch list (``listed``) or the row's columns."""
    i = c0 + tl.arange(0, BLOCK)
    live = i < items
    col = tl.where(listed, tl.load(cand_row + i, mask=live & listed, other=0), i)
    u = _order_keys(tl.load(src + col, mask=live, other=0.0)) ^ -2147483648
    return col.to(tl.int32), u, live


@triton.jit
def _hist_kernel(logits, starts, ends, hist, chunk_hist, W, topk, s_l_r, chunk, n_chunks,
                 BLOCK: tl.constexpr, BINS: tl.constexpr, STAGES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    start, end, n = _row_range(starts, ends, row, W)
    if n > topk:
        lo, hi = _chunk(start, end, c, chunk)
        src = logits + row * s_l_r
        h = tl.zeros((BINS,), tl.int32)
        for c0 in tl.range(lo, hi, BLOCK, num_stages=STAGES):
            cols = tl.multiple_of(c0, 16) + tl.arange(0, BLOCK)
            live = (cols >= start) & (cols < hi)
            u = _order_keys(_read(src, cols, W)) ^ -2147483648
            h += tl.histogram((u >> 21) & (BINS - 1), BINS, mask=live)
        bins = tl.arange(0, BINS)
        tl.store(chunk_hist + (row * n_chunks + c) * BINS + bins, h)
        tl.atomic_add(hist + row * BINS + bins, h, mask=h > 0, sem="relaxed")


@triton.jit
def _count_kernel(starts, ends, hist, chunk_hist, counts, first_digit, W, topk, chunk, n_chunks,
                  BINS: tl.constexpr):
    """Each chunk's keys above the boundary bucket and in it, from its own histogram (no read
    of the logits); a row of no more than ``topk`` keys takes all of them."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    start, end, n = _row_range(starts, ends, row, W)
    d = _first_digit(hist + row * BINS, topk, n, BINS)
    lo, hi = _chunk(start, end, c, chunk)
    keys = tl.maximum(hi - tl.maximum(lo, start), 0).to(tl.int32)
    above = keys
    inside = tl.zeros((), tl.int32)
    if n > topk:
        bins = tl.arange(0, BINS)
        h = tl.load(chunk_hist + (row * n_chunks + c) * BINS + bins)
        above = tl.sum(tl.where(bins > d, h, 0), axis=0)
        inside = tl.sum(tl.where(bins == d, h, 0), axis=0)
    at = counts + (row * n_chunks + c) * 2
    tl.store(at, above)
    tl.store(at + 1, inside)
    if c == 0:
        tl.store(first_digit + row, d)


@triton.jit
def _scatter_kernel(logits, starts, ends, hist, counts, out, cand, W, topk, s_l_r, s_o_r,
                    cand_cap, chunk, n_chunks,
                    BLOCK: tl.constexpr, BINS: tl.constexpr, CHUNKS: tl.constexpr,
                    STAGES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    start, end, n = _row_range(starts, ends, row, W)
    d = _first_digit(hist + row * BINS, topk, n, BINS)
    j = tl.arange(0, CHUNKS)
    earlier = j < c
    row_counts = counts + row * n_chunks * 2
    base_above = tl.sum(tl.load(row_counts + 2 * j, mask=earlier, other=0), axis=0)
    base_cand = tl.sum(tl.load(row_counts + 2 * j + 1, mask=earlier, other=0), axis=0)
    lo, hi = _chunk(start, end, c, chunk)
    src = logits + row * s_l_r
    for c0 in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        cols = tl.multiple_of(c0, 16) + tl.arange(0, BLOCK)
        live = (cols >= start) & (cols < hi)
        u = _order_keys(_read(src, cols, W)) ^ -2147483648
        digit = (u >> 21) & (BINS - 1)
        is_above = live & (digit > d)
        is_cand = live & (digit == d)
        pos = base_above + tl.cumsum(is_above.to(tl.int32), axis=0) - 1
        tl.store(out + row * s_o_r + pos, (cols - start).to(tl.int32), mask=is_above & (pos < topk))
        pos = base_cand + tl.cumsum(is_cand.to(tl.int32), axis=0) - 1
        tl.store(cand + row * cand_cap + pos, (cols - start).to(tl.int32),
                 mask=is_cand & (pos < cand_cap))  # a longer list is not used
        base_above += tl.sum(is_above.to(tl.int32), axis=0)
        base_cand += tl.sum(is_cand.to(tl.int32), axis=0)


@triton.jit
def _boundary_kernel(logits, starts, ends, counts, first_digit, out, cand, W, topk, s_l_r, s_o_r,
                     cand_cap, n_chunks,
                     BLOCK: tl.constexpr, BINS: tl.constexpr, CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start, end, n = _row_range(starts, ends, row, W)
    j = tl.arange(0, CHUNKS)
    row_counts = counts + row * n_chunks * 2
    n_above = tl.sum(tl.load(row_counts + 2 * j, mask=j < n_chunks, other=0), axis=0)
    n_cand = tl.sum(tl.load(row_counts + 2 * j + 1, mask=j < n_chunks, other=0), axis=0)
    kept = tl.minimum(n, topk)
    need = kept - n_above  # candidates to take; all of them share the first digit
    src = logits + row * s_l_r + start
    cand_row = cand + row * cand_cap
    dst = out + row * s_o_r + n_above
    if need > 0:
        # the candidates: the scratch list when it holds them all, else the row itself
        # filtered by the first digit (column order either way)
        listed = n_cand <= cand_cap
        items = tl.where(listed, n_cand, n)
        first = tl.load(first_digit + row)
        found = first << 21  # the first digit, bits 31-21
        bins = tl.arange(0, BINS)
        for p in tl.static_range(2):
            shift = 10 - 10 * p  # digits: bits 20-10, 9-0
            h = tl.zeros((BINS,), tl.int32)
            for c0 in range(0, items, BLOCK):
                col, u, live = _candidates(src, cand_row, c0, items, listed, BLOCK)
                live = live & ((u >> (21 - 11 * p)) == (found >> (21 - 11 * p)))
                h += tl.histogram((u >> shift) & ((BINS - 1) >> p), BINS, mask=live)
            above = tl.cumsum(h, axis=0, reverse=True)
            d = tl.sum((above >= need).to(tl.int32), axis=0) - 1
            need -= tl.sum(tl.where(bins > d, h, 0), axis=0)
            found = found | (d << shift)
        threshold = found ^ -2147483648
        written = tl.zeros((), tl.int64)
        equal_seen = tl.zeros((), tl.int64)
        for c0 in range(0, items, BLOCK):
            col, u, live = _candidates(src, cand_row, c0, items, listed, BLOCK)
            live = live & ((u >> 21) == (found >> 21))
            key = u ^ -2147483648
            equal = live & (key == threshold)
            rank = equal_seen + tl.cumsum(equal.to(tl.int64), axis=0) - 1
            take = live & ((key > threshold) | (equal & (rank < need)))
            pos = written + tl.cumsum(take.to(tl.int64), axis=0) - 1
            tl.store(dst + pos, col, mask=take & (n_above + pos < topk))
            written += tl.sum(take.to(tl.int64), axis=0)
            equal_seen += tl.sum(equal.to(tl.int64), axis=0)
    for c0 in range(0, topk, BLOCK):
        pos = c0 + tl.arange(0, BLOCK)
        tl.store(out + row * s_o_r + pos, tl.full((BLOCK,), -1, tl.int32),
                 mask=(pos >= kept) & (pos < topk))


def top_k_per_row(logits: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor,
                  topk: int, *, validate: bool | None = None) -> torch.Tensor:
    """int32 ``[R, topk]``: per row the highest logits of columns ``[start, end)`` as indices
    ``j - start``, ties to the lower index, then ``-1``: the reference's set, not sorted by
    score (module doc).

    ``logits [R, W]`` float32 (other float dtypes are read as float32, exactly);
    ``validate``: check the ranges within ``[0, W]`` on the host (a sync); ``None``: only when
    no CUDA graph is being captured. Unvalidated, a range is clipped to the row.
    """
    check_float("logits", logits, ndim=2)
    R, W = logits.shape
    check_index("row_starts", row_starts, shape=[R])
    check_index("row_ends", row_ends, shape=[R])
    check_same_device(logits=logits, row_starts=row_starts, row_ends=row_ends)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    if R and should_validate(validate, logits):
        lo, hi = torch.stack([row_starts.long().min(), row_ends.long().max()]).tolist()
        if lo < 0 or hi > W:
            raise ValueError(f"row_starts / row_ends must lie in [0, {W}] (logits' columns), "
                             f"got starts >= {lo}, ends <= {hi}")
    out = torch.empty(R, topk, dtype=torch.int32, device=logits.device)
    if R == 0:
        return out
    if logits.dtype == torch.float64:
        raise TypeError("logits must be float32, float16 or bfloat16 for the fast path (a "
                        "float64 row rounded to float32 could gain ties), got float64")
    if logits.dtype != torch.float32:
        logits = logits.float()  # exact
    if W and logits.stride(1) != 1:
        logits = logits.contiguous()
    chunks = max(1, min(MAX_CHUNKS, triton.cdiv(4 * num_sms(logits.device), R)))
    chunk = BLOCK * max(1, triton.cdiv(triton.cdiv(W, chunks), BLOCK))
    chunks = max(1, triton.cdiv(W, chunk))
    hist = torch.zeros(R, BINS, dtype=torch.int32, device=logits.device)
    chunk_hist = torch.empty(R, chunks, BINS, dtype=torch.int32, device=logits.device)
    counts = torch.empty(R, chunks, 2, dtype=torch.int32, device=logits.device)
    first = torch.empty(R, dtype=torch.int32, device=logits.device)
    cand = torch.empty(R, max(1, min(W, CANDIDATES)), dtype=torch.int32, device=logits.device)
    grid = (R, chunks)
    common = (logits, row_starts, row_ends)
    _hist_kernel[grid](*common, hist, chunk_hist, W, topk, logits.stride(0), chunk, chunks,
                       BLOCK=BLOCK, BINS=BINS, STAGES=STAGES, num_warps=4)
    _count_kernel[grid](row_starts, row_ends, hist, chunk_hist, counts, first, W, topk, chunk,
                        chunks, BINS=BINS, num_warps=4)
    _scatter_kernel[grid](*common, hist, counts, out, cand, W, topk, logits.stride(0),
                          out.stride(0), cand.stride(0), chunk, chunks,
                          BLOCK=BLOCK, BINS=BINS, CHUNKS=next_pow2(chunks), STAGES=STAGES,
                          num_warps=4)
    _boundary_kernel[(R,)](*common, counts, first, out, cand, W, topk, logits.stride(0),
                           out.stride(0), cand.stride(0), chunks,
                           BLOCK=BLOCK, BINS=BINS, CHUNKS=next_pow2(chunks), num_warps=4)
    return out
