"""``convert_req_index_to_global_index`` in Triton: the indexer's request-local top-k positions
to the cache slots the sparse kernels read, as ``mla.reference.sparse``'s (conventions §10;
vLLM 0.14's ``triton_convert_req_index_to_global_index``). One program converts ``BLOCK_N``
indices of one token: a load of the indices, a gather of at most ``BLOCK_N / bs + 1`` distinct
block-table entries (cached), a store.

Validation (``validate``, as every fast call's: ``mla.fast.common.should_validate``): the
ranges of ``req_id`` and the workspace ids, read on the host. Without it a token whose request
or workspace entry is out of range converts to ``-1`` everywhere.

``decode_rows``: a decode step's positions, requests, slots and logits rows (the reference's
``reference_decode_rows``) in one kernel, where torch takes about fifteen small ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.fast.common import should_validate
from mla.fast.launch import CompiledLauncher, check_grid, int_spec, ptr_spec
from mla.reference.sparse import check_index_conversion_shapes, check_index_conversion_values
from mla.reference.sparse_model import DecodeRows, reference_decode_rows
from mla.validation import check_index, check_same_device

__all__ = ["convert_req_index_to_global_index", "decode_rows"]


@triton.jit
def _convert_kernel(
    req_id, block_table, token_indices, out, ws_req, ws_starts,
    topk, num_reqs, max_blocks, num_prefills,
    s_bt_r, s_bt_b, s_ti_t, s_ti_k,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WORKSPACE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < topk
    req = tl.load(req_id + t).to(tl.int64)
    req_ok = (req >= 0) & (req < num_reqs)
    tok = tl.load(token_indices + t * s_ti_t + cols * s_ti_k, mask=col_ok, other=-1)
    tok = tok.to(tl.int64)
    block = tok // BLOCK_SIZE  # tok >= 0 wherever the result is used
    invalid = (tok < 0) | (block >= max_blocks) | ~req_ok
    use_table = col_ok & ~invalid
    if HAS_WORKSPACE:
        p = tl.load(ws_req + t).to(tl.int64)
        invalid = invalid | (p >= num_prefills) | (p < -1)
        use_table = use_table & (p < 0)  # prefill tokens read the workspace, not the table
    base = tl.load(block_table + req * s_bt_r + block * s_bt_b, mask=use_table,
                   other=0).to(tl.int64)
    slot = base * BLOCK_SIZE + tok % BLOCK_SIZE
    if HAS_WORKSPACE:
        start = tl.load(ws_starts + p, mask=(p >= 0) & (p < num_prefills), other=0).to(tl.int64)
        slot = tl.where(p >= 0, start + tok, slot)
    slot = tl.where(invalid, -1, slot)
    tl.store(out + t * topk + cols, slot.to(tl.int32), mask=col_ok)


_convert = CompiledLauncher(_convert_kernel)


def convert_req_index_to_global_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    block_size: int,
    prefill_workspace_request_ids: torch.Tensor | None = None,
    prefill_workspace_starts: torch.Tensor | None = None,
    *,
    validate: bool | None = None,
) -> torch.Tensor:
    """Request-local ``token_indices [T, topk]`` -> global cache slots (or workspace rows).

    As the reference (all int32; returns int32 ``[T, topk]``). ``validate``: run the range
    checks on the host (a sync); ``None``: only when no CUDA graph is being captured.
    """
    has_workspace = check_index_conversion_shapes(
        req_id, block_table, token_indices, block_size, prefill_workspace_request_ids,
        prefill_workspace_starts)
    T = req_id.shape[0]
    topk = token_indices.shape[1]
    block_n = min(triton.next_power_of_2(max(topk, 1)), 512)
    grid = (T, triton.cdiv(topk, block_n))
    check_grid("convert_req_index_to_global_index (grid: tokens, top-k tiles of 512)", grid)
    out = torch.empty((T, topk), dtype=torch.int32, device=token_indices.device)
    if T == 0 or topk == 0:
        return out
    if should_validate(validate, token_indices):
        check_index_conversion_values(req_id, block_table, prefill_workspace_request_ids,
                                      prefill_workspace_starts)
    ws_req = prefill_workspace_request_ids if has_workspace else req_id
    ws_starts = prefill_workspace_starts if has_workspace else req_id
    num_prefills = prefill_workspace_starts.shape[0] if has_workspace else 0
    pointers = (req_id, block_table, token_indices, out, ws_req, ws_starts)
    ints = (topk, block_table.shape[0], block_table.shape[1], num_prefills,
            *block_table.stride(), *token_indices.stride())
    key = (block_size, block_n, has_workspace, *(t.dtype for t in pointers),
           *(ptr_spec(t) for t in pointers), *(int_spec(x) for x in ints))
    _convert(key, (*grid, 1), (*pointers, *ints, block_size, block_n, has_workspace),
             num_warps=4)
    return out


@triton.jit
def _decode_rows_kernel(cache_seqlens, block_table, positions, req, slots, seq_lens, row_starts,
                        row_ends, T, s_q, max_blocks, s_bt_r, s_bt_b,
                        BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = t < T
    b = t // s_q
    n = t - b * s_q
    cached = tl.load(cache_seqlens + b, mask=live, other=0).to(tl.int64)
    pos = cached + n
    block = pos // BLOCK_SIZE
    inside = live & (pos >= 0) & (block < max_blocks)
    page = tl.load(block_table + b * s_bt_r + block * s_bt_b, mask=inside, other=-1).to(tl.int64)
    slot = tl.where(inside & (page >= 0), page * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
    tl.store(positions + t, pos, mask=live)
    tl.store(req + t, b.to(tl.int32), mask=live)
    tl.store(slots + t, slot, mask=live)
    tl.store(row_starts + t, tl.zeros_like(t).to(tl.int32), mask=live)
    tl.store(row_ends + t, tl.maximum(pos + 1, 0).to(tl.int32), mask=live)
    tl.store(seq_lens + b, (cached + s_q).to(tl.int32), mask=live & (n == 0))


_decode_rows = CompiledLauncher(_decode_rows_kernel)
DECODE_ROWS_BLOCK = 128


def decode_rows(cache_seqlens: torch.Tensor, block_table: torch.Tensor, s_q: int,
                block_size: int, *, validate: bool | None = None) -> DecodeRows:
    """A decode step's ``DecodeRows`` in one kernel: as ``mla.reference.sparse_model.
    reference_decode_rows``, whose torch version is about fifteen small kernels. ``validate``:
    the reference's own function, with its host checks (a sync); ``None``: only when no CUDA
    graph is being captured. Unvalidated, a token whose position is negative or past the
    block table, or whose page is negative, gets slot ``-1`` (padding: the cache writers skip
    it) and its logits row ends at ``max(position + 1, 0)``."""
    check_index("cache_seqlens", cache_seqlens, ndim=1)
    B = cache_seqlens.shape[0]
    check_index("block_table", block_table, shape=[B, None])
    check_same_device(cache_seqlens=cache_seqlens, block_table=block_table)
    if isinstance(s_q, bool) or not isinstance(s_q, int) or s_q < 0:
        raise ValueError(f"s_q must be an int >= 0, got {s_q!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    T = B * s_q
    if T == 0 or should_validate(validate, cache_seqlens):
        return reference_decode_rows(cache_seqlens, block_table, s_q, block_size)
    dev = cache_seqlens.device
    out = DecodeRows(positions=torch.empty(T, dtype=torch.int64, device=dev),
                     req=torch.empty(T, dtype=torch.int32, device=dev),
                     slots=torch.empty(T, dtype=torch.int64, device=dev),
                     seq_lens=torch.empty(B, dtype=torch.int32, device=dev),
                     row_starts=torch.empty(T, dtype=torch.int32, device=dev),
                     row_ends=torch.empty(T, dtype=torch.int32, device=dev))
    grid = (triton.cdiv(T, DECODE_ROWS_BLOCK), 1, 1)
    check_grid("decode_rows (grid: tiles of tokens)", grid)
    ints = (T, s_q, block_table.shape[1], *block_table.stride())
    key = (block_size, cache_seqlens.dtype, block_table.dtype,
           *(ptr_spec(x) for x in (cache_seqlens, block_table, *out)),
           *(int_spec(x) for x in ints))
    _decode_rows(key, grid, (cache_seqlens, block_table, *out, *ints, block_size,
                             DECODE_ROWS_BLOCK), num_warps=4)
    return out
