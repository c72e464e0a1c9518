"""The paged latent cache: one tensor per layer, one row per token, ``kv_c ‖ k_pe``.

conventions §8 (vLLM's ``concat_and_cache_mla`` and ``gather_and_maybe_dequant_cache``):

    kv_cache [num_blocks, block_size, Lkv + R]
    slot(r, p) = block_table[r, p // block_size] · block_size + p % block_size

- write: ``kv_cache.view(-1, Lkv+R)[slot_mapping[t]] = kv_c[t] ‖ k_pe[t]``; slot ``-1`` is
  padding and is skipped.
- gather: request ``b``'s rows ``[seq_starts[b], seq_starts[b] + len_b)`` land in
  ``dst[cu_seq_lens[b] : cu_seq_lens[b+1]]`` with ``len_b = cu_seq_lens[b+1] - cu_seq_lens[b]``.

The reference accepts any positive block size (DeepSeek serving uses 64) and any
``seq_starts`` (vLLM's CUDA gather wants them page-aligned; nothing here depends on it).
"""

from __future__ import annotations

import torch

from mla.validation import (
    check_float,
    check_index,
    check_nonnegative,
    check_same_device,
    check_same_dtype,
    check_tensor,
)

__all__ = [
    "slot_mapping_from_block_table",
    "concat_and_cache_mla",
    "gather_cache",
    "cache_rows",
    "make_block_table",
]


def slot_mapping_from_block_table(block_table: torch.Tensor, req_indices: torch.Tensor,
                                  positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots ``[T]`` (int64) of tokens ``(req_indices[t], positions[t])``.

    A position whose block index falls outside the block table raises a ``ValueError``.
    """
    check_index("block_table", block_table, ndim=2)
    check_index("req_indices", req_indices, ndim=1)
    check_index("positions", positions, shape=[req_indices.shape[0]])
    check_same_device(block_table=block_table, req_indices=req_indices, positions=positions)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    check_nonnegative("positions", positions)
    B, max_blocks = block_table.shape
    if req_indices.numel() and (int(req_indices.min()) < 0 or int(req_indices.max()) >= B):
        raise ValueError(f"req_indices must lie in [0, {B}) (block_table rows), got range "
                         f"[{int(req_indices.min())}, {int(req_indices.max())}]")
    block_idx = positions.long() // block_size
    if block_idx.numel() and int(block_idx.max()) >= max_blocks:
        raise ValueError(
            f"positions need block index {int(block_idx.max())} but block_table has "
            f"{max_blocks} columns (block_size {block_size})")
    blocks = block_table.long()[req_indices.long(), block_idx]
    return blocks * block_size + positions.long() % block_size


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """Write ``kv_c [T, Lkv]`` and ``k_pe [T, R]`` (or ``[T, 1, R]``) into ``kv_cache`` in place."""
    check_float("kv_cache", kv_cache, ndim=3)
    if k_pe.dim() == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe[:, 0]
    check_float("kv_c", kv_c, ndim=2)
    T, Lkv = kv_c.shape
    D = kv_cache.shape[2]
    if Lkv >= D:
        raise ValueError(f"kv_c must have fewer than kv_cache's {D} columns (room for k_pe), "
                         f"got shape {list(kv_c.shape)}")
    check_float("k_pe", k_pe, shape=[T, D - Lkv])
    check_index("slot_mapping", slot_mapping, shape=[T])
    check_same_device(kv_cache=kv_cache, kv_c=kv_c, k_pe=k_pe, slot_mapping=slot_mapping)
    # no silent down-cast: a float64 latent written into a float32 cache would lose digits
    check_same_dtype(kv_cache=kv_cache, kv_c=kv_c, k_pe=k_pe)
    n_slots = kv_cache.shape[0] * kv_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    if slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= n_slots):
        raise ValueError(f"slot_mapping must lie in [-1, {n_slots}) (-1 = padding), got range "
                         f"[{int(slots.min())}, {int(slots.max())}]")
    rows = torch.cat([kv_c, k_pe], dim=-1)
    kv_cache.view(n_slots, D)[slots[keep]] = rows[keep]


def cache_rows(kv_cache: torch.Tensor, block_table_row: torch.Tensor, start: int,
               length: int) -> torch.Tensor:
    """Rows ``[start, start + length)`` of one request: ``[length, Lkv+R]`` (a copy)."""
    bs = kv_cache.shape[1]
    pos = torch.arange(start, start + length, device=kv_cache.device)
    slots = block_table_row.long()[pos // bs] * bs + pos % bs
    return kv_cache.reshape(-1, kv_cache.shape[2])[slots]


def gather_cache(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                 cu_seq_lens: torch.Tensor, batch_size: int,
                 seq_starts: torch.Tensor | None = None) -> torch.Tensor:
    """Copy each request's chunk of rows into the dense workspace ``dst``; return the filled part.

    ``cu_seq_lens [batch_size + 1]`` are the prefix sums of the chunk lengths,
    ``seq_starts [batch_size]`` the chunk's first position inside each request (default 0).
    """
    check_float("src_cache", src_cache, ndim=3)
    check_tensor("dst", dst, shape=[None, src_cache.shape[2]], dtype=src_cache.dtype)
    check_index("block_table", block_table, ndim=2)
    check_index("cu_seq_lens", cu_seq_lens, shape=[batch_size + 1])
    if block_table.shape[0] < batch_size:
        raise ValueError(f"block_table must have at least batch_size={batch_size} rows, "
                         f"got {block_table.shape[0]}")
    if seq_starts is None:
        seq_starts = torch.zeros(batch_size, dtype=torch.int32, device=src_cache.device)
    check_index("seq_starts", seq_starts, shape=[batch_size])
    check_same_device(src_cache=src_cache, dst=dst, block_table=block_table,
                      cu_seq_lens=cu_seq_lens, seq_starts=seq_starts)
    check_nonnegative("seq_starts", seq_starts)
    cu = cu_seq_lens.tolist()
    lens = [cu[b + 1] - cu[b] for b in range(batch_size)]
    if cu[0] != 0 or min(lens, default=0) < 0:
        raise ValueError(f"cu_seq_lens must start at 0 and not decrease, got {cu}")
    if cu[-1] > dst.shape[0]:
        raise ValueError(f"dst has {dst.shape[0]} rows but cu_seq_lens asks for {cu[-1]}")
    bs, max_blocks = src_cache.shape[1], block_table.shape[1]
    for b in range(batch_size):
        start = int(seq_starts[b])
        if lens[b] == 0:
            continue
        if start + lens[b] > max_blocks * bs:
            raise ValueError(
                f"request {b} needs positions up to {start + lens[b] - 1} but block_table "
                f"holds {max_blocks} blocks of {bs}")
        # a -1 entry would silently read the last block; past the end, fail deep in torch
        used = block_table[b, start // bs: -(-(start + lens[b]) // bs)]
        if int(used.min()) < 0 or int(used.max()) >= src_cache.shape[0]:
            raise ValueError(
                f"block_table[{b}] points outside src_cache's {src_cache.shape[0]} blocks for "
                f"positions [{start}, {start + lens[b]}): range [{int(used.min())}, "
                f"{int(used.max())}]")
    for b in range(batch_size):  # every request checked before the first row is written
        if lens[b]:
            dst[cu[b]: cu[b + 1]] = cache_rows(src_cache, block_table[b], int(seq_starts[b]),
                                               lens[b])
    return dst[: cu[-1]]


def make_block_table(capacities: list[int], block_size: int, *, spare_blocks: int = 0,
                     seed: int | None = 0, device: str | torch.device = "cpu"
                     ) -> tuple[torch.Tensor, int]:
    """A block table whose request ``i`` can hold ``capacities[i]`` tokens.

    Blocks are handed out in a seeded random order (``seed=None``: in order), so that
    logically adjacent pages are physically scattered as in a real serving cache. Unused
    table entries are ``-1``. Returns ``(block_table [B, max_blocks] int32, num_blocks)``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if any(c < 0 for c in capacities):
        raise ValueError(f"capacities must be >= 0, got {capacities}")
    need = [-(-c // block_size) for c in capacities]
    num_blocks = sum(need) + spare_blocks
    if seed is None:
        order = torch.arange(num_blocks)
    else:
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    table = torch.full((len(capacities), max(max(need, default=0), 1)), -1, dtype=torch.int32)
    k = 0
    for i, n in enumerate(need):
        table[i, :n] = order[k: k + n].to(torch.int32)
        k += n
    return table.to(device), max(num_blocks, 1)
