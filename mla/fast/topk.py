"""``top_k_per_row`` in Triton: a radix select over order-preserving integer keys, one row a
program.

Same selection as ``mla.reference.indexer_logits.top_k_per_row`` (conventions §10, "Indexer
logits and top-k"): per row the ``min(topk, end - start)`` highest logits of columns
``[start, end)``, ties to the lower index, NaN above every number, as ``j - start``; the rest
of the row ``-1``. Columns outside ``[start, end)`` are never read. The set is returned in
column order (ascending), not highest first: the sparse attention sums over it, the catalogue
compares sets, and no sort is spent on it.

**Keys.** A float32's bits ``b`` map to a uint32 that orders as the floats do: ``~b`` for a
negative float, ``b | 2^31`` for a positive one; ``-0`` is read as ``+0`` (equal, as the
reference's sort has them) and every NaN as ``2^32 - 1`` (above ``+inf``).

**Select.** Three histogram passes over the row find the key of the ``topk``-th best, 11, 11
and 10 bits at a time (each pass counts only the keys that share the digits found so far), and
how many keys equal to it are still needed; a last pass writes the keys above it and that many
equal ones, the first in column order. Four reads of the row (the later ones mostly from L2),
no sort, no scratch memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.fast.common import should_validate
from mla.validation import check_float, check_index, check_same_device

__all__ = ["top_k_per_row"]

BLOCK = 2048
BINS = 2048  # 11 bits a pass


@triton.jit
def _order_keys(x):
    """float32 -> int32 keys in the floats' order (``-0`` as ``+0``, NaN above all): a negative
    float's magnitude bits inverted. ``key ^ -2^31`` is the uint32 key of the module doc."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit
def _topk_kernel(
    logits, starts, ends, out, W, topk, s_l_r, s_o_r,
    BLOCK: tl.constexpr, BINS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    start = tl.load(starts + row).to(tl.int64)
    end = tl.load(ends + row).to(tl.int64)
    start = tl.maximum(start, 0)
    end = tl.minimum(end, W)  # unvalidated ranges: never read outside the row
    n = tl.maximum(end - start, 0)
    src = logits + row * s_l_r
    cols0 = tl.arange(0, BLOCK)
    bins = tl.arange(0, BINS)

    # the key of the topk-th best (threshold) and how many keys equal to it are taken; with
    # n <= topk every key is taken (all keys lie above -2^31)
    found = tl.zeros((), tl.int32)  # the threshold's digits so far, as uint32 bits
    need = topk.to(tl.int64)
    if n > topk:
        for p in tl.static_range(3):
            shift = 21 - 11 * p + p // 2  # digits: bits 31-21, 20-10, 9-0
            known = shift + 11 - p // 2  # the digits found in the passes before
            hist = tl.zeros((BINS,), tl.int32)
            for c in range(start, end, BLOCK):
                cols = c + cols0
                live = cols < end
                u = _order_keys(tl.load(src + cols, mask=live, other=0.0)) ^ -2147483648
                if p > 0:  # only the keys sharing the digits found so far
                    live = live & ((u >> known) == (found >> known))
                hist += tl.histogram((u >> shift) & ((BINS - 1) >> (p // 2)), BINS, mask=live)
            above = tl.cumsum(hist, axis=0, reverse=True)  # keys at or above each digit
            d = tl.sum((above >= need).to(tl.int32), axis=0) - 1
            need -= tl.sum(tl.where(bins > d, hist, 0), axis=0)
            found = found | (d << shift)
        threshold = found ^ -2147483648
    else:
        threshold = tl.full((), -2147483648, tl.int32)
        need = tl.zeros((), tl.int64)

    dst = out + row * s_o_r
    written = tl.zeros((), tl.int64)
    equal_seen = tl.zeros((), tl.int64)
    for c in range(start, end, BLOCK):
        cols = c + cols0
        live = cols < end
        key = _order_keys(tl.load(src + cols, mask=live, other=0.0))
        equal = live & (key == threshold)
        rank = equal_seen + tl.cumsum(equal.to(tl.int64), axis=0) - 1
        take = live & ((key > threshold) | (equal & (rank < need)))
        pos = written + tl.cumsum(take.to(tl.int64), axis=0) - 1
        tl.store(dst + pos, (cols - start).to(tl.int32), mask=take & (pos < topk))
        written += tl.sum(take.to(tl.int64), axis=0)
        equal_seen += tl.sum(equal.to(tl.int64), axis=0)
    for c in range(0, topk, BLOCK):
        pos = c + cols0
        tl.store(dst + pos, tl.full((BLOCK,), -1, tl.int32), mask=(pos >= written) & (pos < topk))


def top_k_per_row(logits: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor,
                  topk: int, *, validate: bool | None = None) -> torch.Tensor:
    """int32 ``[R, topk]``: per row the highest logits of columns ``[start, end)`` as indices
    ``j - start`` in column order, ties to the lower index, then ``-1`` (the reference's set).

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
    _topk_kernel[(R,)](
        logits, row_starts, row_ends, out, W, topk, logits.stride(0), out.stride(0),
        BLOCK=BLOCK, BINS=BINS, num_warps=8,
    )
    return out
