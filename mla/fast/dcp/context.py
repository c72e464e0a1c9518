"""DCP chunked prefill on the fast path: local gather, all-gather, ``reorg_kvcache``, merge.

Same contract as ``mla.reference.dcp.context`` (conventions §9 and §7, derivation (23)), with
the same ``DCPChunkPlan`` (a plan is a value; nothing here re-plans):

    (o, lse)  = mla.fast.chunked_prefill_attention(new tokens, no context)      the suffix
    for chunk c:
        local     = gather_cache_known(local cache, cp_chunk_starts[c], ...)    Triton, no sync
        gathered  = all_gather(local)                                           [W·toks, D]
        rows      = gathered[reorg_index(plan, c)]                              one index_select
        k, v      = up_project(rows);  (o_c, l_c) = flash_attention_with_lse(non-causal)
        (o, lse)  = merge_attn_states(o_c, l_c, o, lse)                         Triton

**``reorg_kvcache`` fast.** The reference builds the row index in a Python loop over every
row, ``O(rows)`` interpreter work per chunk (a 64K-token chunk costs milliseconds of host
time). Here the index is built from the ``B·W`` segments with two ``repeat_interleave`` on the
device, whose output size (the chunk's row count) is known on the host, so nothing is read back;
the segment lengths and vLLM's asserts are computed on the host from the plan's integers,
``O(B·W)``.
"""

from __future__ import annotations

import torch

from mla.fast.attention import flash_attention_with_lse
from mla.fast.chunked import chunked_prefill_attention
from mla.fast.dcp.threads import KERNEL_LOCK
from mla.fast.merge import merge_attn_states
from mla.fast.paged_cache import gather_cache_known
from mla.fast.prefill import up_project
from mla.reference.chunked import check_chunked_prefill_args, plan_context_chunks
from mla.reference.dcp.comm import Communicator
from mla.reference.dcp.context import (
    DCPChunkPlan,
    check_plan_world_size,
    check_reorg_args,
    reorg_segments,
)
from mla.reference.dcp.sharding import head_slice, shard_kv_cache

__all__ = ["reorg_index", "reorg_kvcache", "dcp_gather_context_chunk",
           "dcp_chunked_prefill_attention", "dcp_chunked_prefill_rank"]


def _index(starts: list[int], lens: list[int], total: int, device: torch.device
           ) -> torch.Tensor:
    """``cat(arange(s, s + n) for s, n)`` on the device, without reading anything back."""
    s = torch.tensor(starts, dtype=torch.int64, device=device)
    n = torch.tensor(lens, dtype=torch.int64, device=device)
    offsets = torch.cumsum(n, 0) - n  # where each segment begins in the output
    seg_start = torch.repeat_interleave(s - offsets, n, output_size=total)
    return seg_start + torch.arange(total, device=device)


def reorg_index(plan: DCPChunkPlan, chunk_idx: int, device: torch.device) -> torch.Tensor:
    """Rows of chunk ``chunk_idx``'s all-gathered ``[W·toks]`` buffer, in the order
    ``reorg_kvcache`` keeps them (int64, on ``device``)."""
    c = chunk_idx
    starts, lens, _ = reorg_segments(plan.cp_chunk_seq_lens[c], plan.origin_context_lens,
                                     plan.world_size, plan.chunk_size, c, plan.seq_tot[c])
    return _index(starts, lens, plan.cu_seq_lens_lst[c][-1], device)


def reorg_kvcache(
    allgatered_kv_c_normed: torch.Tensor,
    allgatered_k_pe: torch.Tensor,
    cp_chunk_seq_lens_lst: list[int],
    origin_context_lens: list[int],
    cp_world_size: int,
    sum_seq_len: int,
    max_seq_len: int,
    chunk_size: int,
    chunk_idx: int,
    toks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla.reference.dcp.reorg_kvcache`` (vLLM's function, its asserts as ``ValueError``),
    with the row index built per segment on the device (see the module doc)."""
    starts, lens, _ = check_reorg_args(
        allgatered_kv_c_normed, allgatered_k_pe, cp_chunk_seq_lens_lst, origin_context_lens,
        cp_world_size, sum_seq_len, max_seq_len, chunk_size, chunk_idx, toks)
    idx = _index(starts, lens, sum_seq_len, allgatered_kv_c_normed.device)
    return (allgatered_kv_c_normed.index_select(0, idx),
            allgatered_k_pe.index_select(0, idx))


def dcp_gather_context_chunk(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    plan: DCPChunkPlan,
    chunk_idx: int,
    kv_lora_rank: int,
    comm: Communicator,
    workspace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk ``chunk_idx`` of every request's context, whole, on every rank (as the
    reference's): ``kv_c [sum, Lkv]`` and ``k_pe [sum, R]``, request ``i``'s rows at
    ``plan.cu_seq_lens_lst[chunk_idx][i]``. Reads nothing on the host."""
    check_plan_world_size(plan, comm)
    B, c = len(plan.origin_context_lens), chunk_idx
    toks = plan.seq_tot[c]
    if workspace is None:
        workspace = kv_cache.new_empty(toks, kv_cache.shape[2])
    dev = kv_cache.device
    cu = torch.tensor(plan.cp_cu_seq_lens[c], dtype=torch.int32, device=dev)
    starts = torch.tensor(plan.cp_chunk_starts[c], dtype=torch.int32, device=dev)
    with KERNEL_LOCK:
        local = gather_cache_known(kv_cache, workspace, block_table, cu, B, starts, toks,
                                   max(plan.cp_chunk_seq_lens[c], default=0))
    gathered = comm.all_gather(local, dim=0)  # [W·toks, Lkv+R], rank-major
    rows = gathered.index_select(0, reorg_index(plan, c, dev))
    return rows[:, :kv_lora_rank], rows[:, kv_lora_rank:]


def dcp_chunked_prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    plan: DCPChunkPlan,
    W_UK: torch.Tensor,  # noqa: N803
    W_UV: torch.Tensor,  # noqa: N803
    softmax_scale: float,
    comm: Communicator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla.fast.chunked_prefill_attention`` with the context sharded over ``comm``'s ranks
    (as ``mla.reference.dcp.dcp_chunked_prefill_attention``): ``kv_cache``/``block_table`` are
    this rank's local cache, the heads whatever ``q_nope``/``W_UK``/``W_UV`` carry. Returns
    ``o [T, N', V]`` and ``lse [N', T]`` float32."""
    check_plan_world_size(plan, comm)
    B = len(plan.origin_context_lens)
    qsl = check_chunked_prefill_args(q_nope, q_pe, kv_c, k_pe, query_start_loc, kv_cache,
                                     block_table, B, W_UK, softmax_scale)
    # the suffix: the single-rank fast path with no context (its plan has no chunks)
    no_context = plan_context_chunks([0] * B, max_context_chunk=plan.chunk_size)
    with KERNEL_LOCK:
        o, lse = chunked_prefill_attention(q_nope, q_pe, kv_c, k_pe, query_start_loc,
                                           kv_cache, block_table, no_context, W_UK, W_UV,
                                           softmax_scale)
    Lkv = kv_c.shape[1]
    qsl_dev = query_start_loc.to(torch.int32)
    max_q = max((b - a for a, b in zip(qsl, qsl[1:])), default=0)
    workspace = kv_cache.new_empty(max(plan.seq_tot, default=0), kv_cache.shape[2])
    for c in range(plan.num_chunks):
        ctx_kv_c, ctx_k_pe = dcp_gather_context_chunk(kv_cache, block_table, plan, c, Lkv, comm,
                                                      workspace)
        k_nope, v = up_project(ctx_kv_c.to(q_nope.dtype), W_UK, W_UV)
        k_pe_heads = ctx_k_pe.to(q_nope.dtype)[:, None, :].expand(-1, q_nope.shape[1], -1)
        cu = torch.tensor(plan.cu_seq_lens_lst[c], dtype=torch.int32, device=kv_cache.device)
        with KERNEL_LOCK:
            o_c, lse_c = flash_attention_with_lse(q_nope, q_pe, k_nope, k_pe_heads, v, qsl_dev,
                                                  cu, max_q, softmax_scale, causal=False)
            o, lse = merge_attn_states(o_c, lse_c, o, lse.to(lse_c.dtype))
    return o, lse


def dcp_chunked_prefill_rank(comm: Communicator, q_nope: torch.Tensor, q_pe: torch.Tensor,
                             kv_c: torch.Tensor, k_pe: torch.Tensor,
                             query_start_loc: torch.Tensor, kv_cache: torch.Tensor,
                             block_table: torch.Tensor, plan: DCPChunkPlan,
                             W_UK: torch.Tensor, W_UV: torch.Tensor,  # noqa: N803
                             softmax_scale: float, shard_seed: int | None = 0
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank program of fast DCP chunked prefill, given the *global* inputs (as
    ``mla.reference.dcp.dcp_chunked_prefill_rank``): returns this rank's heads'
    ``o [T, N/W, V]`` and ``lse [N/W, T]``."""
    heads = head_slice(q_nope.shape[1], comm.world_size, comm.rank)
    ctx = torch.tensor(plan.origin_context_lens, dtype=torch.int32, device=kv_cache.device)
    shard = shard_kv_cache(kv_cache, block_table, ctx, comm.world_size,
                           seed=shard_seed)[comm.rank]
    return dcp_chunked_prefill_attention(
        q_nope[:, heads], q_pe[:, heads], kv_c, k_pe, query_start_loc, shard.kv_cache,
        shard.block_table, plan, W_UK[:, heads], W_UV[:, heads], softmax_scale, comm)
