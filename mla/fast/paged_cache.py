"""The paged latent cache in Triton: write new rows by slot, gather a chunk's rows by block table.

Same contract as ``mla.reference.paged_cache`` (conventions §8):

    kv_cache [num_blocks, block_size, Lkv + R],   slot = block · block_size + offset
    write:  kv_cache.view(-1, Lkv+R)[slot_mapping[t]] = kv_c[t] ‖ k_pe[t]     (slot -1 skipped)
    gather: dst[cu_seq_lens[b] + i] = row (b, seq_starts[b] + i),  i < len_b

Both are copies: one program moves whole rows (``concat_and_cache_mla``: one token;
``gather_cache``: ``BLOCK_T`` rows of one request), so the floor is the bytes of the rows, read
once and written once.

Host synchronization, stated because it decides whether a call can sit in a CUDA graph:
- ``concat_and_cache_mla`` reads ``slot_mapping``'s range on the host (one small transfer) to
  reject bad slots as the reference does when its value checks run (``validate=True``, or the
  global setting ``mla.fast.set_validation``, off by default; never while a CUDA graph is
  being captured). The kernel writes only slots in ``[0, num_blocks·block_size)`` either way:
  unchecked, a bad slot's row is not written.
- ``gather_cache`` reads ``cu_seq_lens`` and ``seq_starts`` in one transfer: the length of its
  return value is ``cu_seq_lens[-1]``, which only the host can use to slice. Callers that know the
  lengths already (``mla.fast.chunked``, from its ``ChunkPlan``) call ``gather_cache_known``, which
  reads nothing.
  The used block-table entries come in the same transfer, so that an entry outside
  ``[0, num_blocks)`` is rejected as the reference rejects it. ``gather_cache_known`` trusts
  them: such an entry reads zeros there instead of faulting.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.fast.common import should_validate
from mla.fast.launch import check_grid
from mla.validation import (
    check_float,
    check_index,
    check_same_device,
    check_same_dtype,
    check_tensor,
)

__all__ = ["check_slot_range", "concat_and_cache_mla", "gather_cache", "gather_cache_known"]


def check_slot_range(slot_mapping: torch.Tensor, n_slots: int) -> None:
    """``slot_mapping`` within ``[-1, n_slots)``, as the reference's cache writes require: one
    small device-to-host transfer (its min and max)."""
    lo, hi = torch.stack(torch.aminmax(slot_mapping.long())).tolist()
    if lo < -1 or hi >= n_slots:
        raise ValueError(f"slot_mapping must lie in [-1, {n_slots}) (-1 = padding), got "
                         f"range [{lo}, {hi}]")


@triton.jit
def _concat_and_cache_kernel(
    kv_c, k_pe, cache, slot_mapping,
    Lkv, R, n_slots, block_size,
    s_kv_t, s_kv_d, s_pe_t, s_pe_d, s_c_b, s_c_s, s_c_d,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    # -1 is padding; anything else outside the cache is never written
    ok = (slot >= 0) & (slot < n_slots)
    row = cache + (slot // block_size) * s_c_b + (slot % block_size) * s_c_s
    for d0 in range(0, Lkv, BLOCK_L):
        d = d0 + tl.arange(0, BLOCK_L)
        m = ok & (d < Lkv)
        x = tl.load(kv_c + t * s_kv_t + d * s_kv_d, mask=m)
        tl.store(row + d * s_c_d, x, mask=m)
    r = tl.arange(0, BLOCK_R)
    m = ok & (r < R)
    x = tl.load(k_pe + t * s_pe_t + r * s_pe_d, mask=m)
    tl.store(row + (Lkv + r) * s_c_d, x, mask=m)


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, *, validate: bool | None = None) -> None:
    """Write ``kv_c [T, Lkv]`` and ``k_pe [T, R]`` (or ``[T, 1, R]``) into ``kv_cache`` in place.

    ``validate``: check ``slot_mapping``'s range on the host (a sync); ``None`` (default): as
    ``mla.fast.set_validation`` says (off unless turned on), never while a graph is captured.
    """
    check_float("kv_cache", kv_cache, ndim=3)
    if k_pe.dim() == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe[:, 0]
    check_float("kv_c", kv_c, ndim=2)
    T, Lkv = kv_c.shape
    D = kv_cache.shape[2]
    check_float("k_pe", k_pe, shape=[T, D - Lkv])
    check_index("slot_mapping", slot_mapping, shape=[T])
    check_same_device(kv_cache=kv_cache, kv_c=kv_c, k_pe=k_pe, slot_mapping=slot_mapping)
    check_same_dtype(kv_cache=kv_cache, kv_c=kv_c, k_pe=k_pe)  # as the reference: no down-cast
    n_slots = kv_cache.shape[0] * kv_cache.shape[1]
    if T == 0:
        return
    check_grid("concat_and_cache_mla (grid: tokens)", (T,))
    if should_validate(validate, kv_cache):
        check_slot_range(slot_mapping, n_slots)
    R = D - Lkv
    _concat_and_cache_kernel[(T,)](
        kv_c, k_pe, kv_cache, slot_mapping, Lkv, R, n_slots, kv_cache.shape[1],
        *kv_c.stride(), *k_pe.stride(), *kv_cache.stride(),
        BLOCK_L=min(triton.next_power_of_2(max(Lkv, 1)), 512),
        BLOCK_R=triton.next_power_of_2(max(R, 1)), num_warps=4,
    )


@triton.jit
def _gather_cache_kernel(
    src, dst, block_table, cu_seq_lens, seq_starts,
    D, block_size, num_blocks,
    s_src_b, s_src_s, s_src_d, s_dst_t, s_dst_d, s_bt_b, s_bt_p,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)  # int64: b · the table's row stride can pass 2^31
    tile = tl.program_id(1)
    row0 = tl.load(cu_seq_lens + b).to(tl.int64)
    n = tl.load(cu_seq_lens + b + 1).to(tl.int64) - row0
    start = tl.load(seq_starts + b).to(tl.int64)
    i = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = i < n
    pos = start + i
    blk = tl.load(block_table + b * s_bt_b + (pos // block_size) * s_bt_p, mask=row_ok,
                  other=0).to(tl.int64)
    blk_ok = row_ok & (blk >= 0) & (blk < num_blocks)
    src_row = blk * s_src_b + (pos % block_size) * s_src_s
    dst_row = (row0 + i) * s_dst_t
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = (d < D)[None, :]
        x = tl.load(src + src_row[:, None] + d[None, :] * s_src_d, mask=blk_ok[:, None] & d_ok,
                    other=0.0)
        tl.store(dst + dst_row[:, None] + d[None, :] * s_dst_d, x, mask=row_ok[:, None] & d_ok)


def _check_gather_shapes(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                         cu_seq_lens: torch.Tensor, batch_size: int,
                         seq_starts: torch.Tensor | None) -> None:
    check_float("src_cache", src_cache, ndim=3)
    check_tensor("dst", dst, shape=[None, src_cache.shape[2]], dtype=src_cache.dtype)
    check_index("block_table", block_table, ndim=2)
    check_index("cu_seq_lens", cu_seq_lens, shape=[batch_size + 1])
    if block_table.shape[0] < batch_size:
        raise ValueError(f"block_table must have at least batch_size={batch_size} rows, "
                         f"got {block_table.shape[0]}")
    if seq_starts is not None:
        check_index("seq_starts", seq_starts, shape=[batch_size])
    check_same_device(src_cache=src_cache, dst=dst, block_table=block_table,
                      cu_seq_lens=cu_seq_lens, seq_starts=seq_starts)


def gather_cache_known(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                       cu_seq_lens: torch.Tensor, batch_size: int,
                       seq_starts: torch.Tensor | None, total: int, max_len: int
                       ) -> torch.Tensor:
    """``gather_cache`` for a caller that already knows ``total = cu_seq_lens[-1]`` and the
    longest request ``max_len``: no device value is read, so it can sit in a CUDA graph.
    The values are trusted (``gather_cache`` checks them)."""
    _check_gather_shapes(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts)
    if total > dst.shape[0]:
        raise ValueError(f"dst has {dst.shape[0]} rows but total asks for {total}")
    if seq_starts is None:
        seq_starts = torch.zeros(batch_size, dtype=torch.int32, device=src_cache.device)
    D = src_cache.shape[2]
    block_t = 32
    if batch_size and max_len > 0:
        grid = (batch_size, triton.cdiv(max_len, block_t))
        check_grid("gather_cache (grid: requests, tiles of 32 rows of the longest)", grid)
        _gather_cache_kernel[grid](
            src_cache, dst, block_table, cu_seq_lens, seq_starts,
            D, src_cache.shape[1], src_cache.shape[0],
            *src_cache.stride(), *dst.stride(), *block_table.stride(),
            BLOCK_T=block_t, BLOCK_D=min(triton.next_power_of_2(max(D, 1)), 128), num_warps=4,
        )
    return dst[:total]


def gather_cache(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                 cu_seq_lens: torch.Tensor, batch_size: int,
                 seq_starts: torch.Tensor | None = None) -> torch.Tensor:
    """Copy each request's chunk of rows into the dense workspace ``dst``; return the filled part.

    As the reference, with its value checks. One device-to-host transfer (``cu_seq_lens``,
    ``seq_starts`` and the block table's first ``batch_size`` rows): the returned length and
    the value checks need them.
    """
    _check_gather_shapes(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts)
    parts = [cu_seq_lens.long(), block_table[:batch_size].reshape(-1).long()]
    if seq_starts is not None:
        parts.append(seq_starts.long())
    values = torch.cat(parts).tolist()
    cu = values[: batch_size + 1]
    max_blocks = block_table.shape[1]
    table = values[batch_size + 1: batch_size + 1 + batch_size * max_blocks]
    starts = values[batch_size + 1 + batch_size * max_blocks:] or [0] * batch_size
    lens = [cu[b + 1] - cu[b] for b in range(batch_size)]
    if cu[0] != 0 or min(lens, default=0) < 0:
        raise ValueError(f"cu_seq_lens must start at 0 and not decrease, got {cu}")
    if min(starts, default=0) < 0:
        raise ValueError(f"seq_starts must be >= 0, got minimum {min(starts)}")
    if cu[-1] > dst.shape[0]:
        raise ValueError(f"dst has {dst.shape[0]} rows but cu_seq_lens asks for {cu[-1]}")
    bs, num_blocks = src_cache.shape[1], src_cache.shape[0]
    for b in range(batch_size):
        if not lens[b]:
            continue
        end = starts[b] + lens[b]
        if end > max_blocks * bs:
            raise ValueError(
                f"request {b} needs positions up to {end - 1} but block_table "
                f"holds {max_blocks} blocks of {bs}")
        used = table[b * max_blocks + starts[b] // bs: b * max_blocks + -(-end // bs)]
        if min(used) < 0 or max(used) >= num_blocks:
            raise ValueError(
                f"block_table[{b}] points outside src_cache's {num_blocks} blocks for "
                f"positions [{starts[b]}, {end}): range [{min(used)}, {max(used)}]")
    return gather_cache_known(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts,
                              cu[-1], max(lens, default=0))
