"""DCP from hidden states on the fast path: ``mla.reference.dcp.model``'s forwards, same
signatures (conventions §9).

    front        mla.reference.front.mla_front (cuBLAS GEMMs, RMSNorm, RoPE), every rank
    cache write  mla.fast.concat_and_cache_mla on the owner's slots (dcp_slot_mapping)
    attention    mla.fast.dcp.dcp_decode / dcp_chunked_prefill_attention, this rank's heads
    projection   o_lat · W_UV of this rank's heads, all-gather of the heads, · W_O

As in the reference, the output projection gathers the heads and multiplies by the whole
``W_O`` on every rank (every rank then holds the single-rank path's numbers); a serving stack
would use a row-parallel ``o_proj`` and an all-reduce instead.

Host synchronization in decode: none unless it validates (``validate``; ``None``: as
``mla.fast.common.should_validate`` decides). With a ``CapturableCommunicator`` the whole
step, front to output, can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from mla.fast.common import should_validate
from mla.fast.dcp.context import dcp_chunked_prefill_attention
from mla.fast.dcp.decode import dcp_decode, dcp_slot_mapping
from mla.fast.dcp.threads import KERNEL_LOCK
from mla.fast.paged_cache import concat_and_cache_mla
from mla.reference.dcp.comm import Communicator
from mla.reference.dcp.context import DCPChunkPlan, plan_dcp_context_chunks
from mla.reference.dcp.sharding import dcp_slot_mapping as checked_dcp_slot_mapping
from mla.reference.dcp.sharding import head_slice, shard_kv_cache
from mla.reference.decode import absorb_q
from mla.reference.front import mla_front
from mla.validation import check_float, check_index, check_nonnegative, check_same_device
from mla.weights import MLAWeights

__all__ = ["dcp_decode_forward", "dcp_chunked_prefill_forward", "dcp_decode_forward_rank",
           "dcp_chunked_prefill_forward_rank"]


def _own_heads_out(o: torch.Tensor, weights: MLAWeights, comm: Communicator) -> torch.Tensor:
    """``o [..., N/W, V]`` of this rank's heads -> ``[..., H]`` on every rank."""
    o_all = comm.all_gather(o, dim=-2)
    return o_all.flatten(-2) @ weights.W_O


def _slots(block_table: torch.Tensor, req: torch.Tensor, positions: torch.Tensor,
           block_size: int, comm: Communicator, validate: bool) -> torch.Tensor:
    """The owner's local slots: the reference's (with its range checks) when validating,
    else the sync-free formula."""
    make = checked_dcp_slot_mapping if validate else dcp_slot_mapping
    return make(block_table, req, positions, block_size, comm.world_size, comm.rank)


def dcp_decode_forward(weights: MLAWeights, hidden: torch.Tensor, kv_cache: torch.Tensor,
                       block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                       comm: Communicator, *, validate: bool | None = None) -> torch.Tensor:
    """``decode_forward`` on one rank of a DCP group: ``hidden [B, s_q, H] -> [B, s_q, H]``.

    As ``mla.reference.dcp.dcp_decode_forward``: ``kv_cache``/``block_table`` this rank's
    local cache, ``cache_seqlens [B]`` the *global* tokens cached before this step; every rank
    returns the same output.
    """
    c = weights.config
    check_float("hidden", hidden, shape=[None, None, c.hidden_size])
    B, s_q, _ = hidden.shape
    check_index("cache_seqlens", cache_seqlens, shape=[B])
    check_index("block_table", block_table, shape=[B, None])
    check_float("kv_cache", kv_cache, shape=[None, None, c.latent_dim])
    check_same_device(hidden=hidden, kv_cache=kv_cache, block_table=block_table,
                      cache_seqlens=cache_seqlens)
    validate = should_validate(validate, hidden)
    if validate:
        check_nonnegative("cache_seqlens", cache_seqlens)
    heads = head_slice(c.num_heads, comm.world_size, comm.rank)
    dev = hidden.device
    positions = (cache_seqlens.long()[:, None] + torch.arange(s_q, device=dev)).flatten()
    req = torch.arange(B, device=dev)[:, None].expand(B, s_q).flatten()
    f = mla_front(weights, hidden.reshape(B * s_q, -1), positions)
    slots = _slots(block_table, req, positions, kv_cache.shape[1], comm, validate)
    with KERNEL_LOCK:
        concat_and_cache_mla(f.kv_c, f.k_pe, kv_cache, slots, validate=validate)
    ql_nope = absorb_q(f.q_nope[:, heads], weights.W_UK[:, heads])
    q = torch.cat([ql_nope, f.q_pe[:, heads]], dim=-1).view(B, s_q, -1, c.latent_dim)
    o_lat, _ = dcp_decode(q, kv_cache, block_table.to(torch.int32),
                          (cache_seqlens + s_q).to(torch.int32), c.softmax_scale, comm,
                          causal=True, head_dim_v=c.kv_lora_rank, validate=validate)
    o = torch.einsum("bsnl,lnv->bsnv", o_lat, weights.W_UV[:, heads])
    return _own_heads_out(o, weights, comm)


def dcp_chunked_prefill_forward(
    weights: MLAWeights,
    hidden: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: list[int],
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    comm: Communicator,
    plan: DCPChunkPlan | None = None,
    workspace_size: int = 64 * 1024,
) -> torch.Tensor:
    """``chunked_prefill_forward`` on one rank of a DCP group: ``hidden [T, H] -> [T, H]``
    (as ``mla.reference.dcp.dcp_chunked_prefill_forward``). Reads ``query_start_loc`` on the
    host, as the single-rank prefill does."""
    c = weights.config
    check_float("hidden", hidden, shape=[None, c.hidden_size])
    B = len(context_lens)
    check_index("query_start_loc", query_start_loc, shape=[B + 1])
    check_index("block_table", block_table, shape=[B, None])
    check_same_device(hidden=hidden, kv_cache=kv_cache, block_table=block_table,
                      query_start_loc=query_start_loc)
    if plan is None:
        plan = plan_dcp_context_chunks(context_lens, comm.world_size,
                                       block_size=kv_cache.shape[1],
                                       workspace_size=workspace_size)
    elif list(plan.origin_context_lens) != list(context_lens):
        raise ValueError(f"plan is for context lens {list(plan.origin_context_lens)}, "
                         f"got context_lens {list(context_lens)}")
    heads = head_slice(c.num_heads, comm.world_size, comm.rank)
    qsl = query_start_loc.tolist()
    dev = hidden.device
    new = [qsl[i + 1] - qsl[i] for i in range(B)]
    req = torch.repeat_interleave(torch.arange(B), torch.tensor(new, dtype=torch.int64)).to(dev)
    positions = torch.cat([torch.arange(context_lens[i], context_lens[i] + new[i])
                           for i in range(B)]).to(dev)
    f = mla_front(weights, hidden, positions)
    slots = _slots(block_table, req, positions, kv_cache.shape[1], comm, True)
    with KERNEL_LOCK:
        concat_and_cache_mla(f.kv_c, f.k_pe, kv_cache, slots)
    o, _ = dcp_chunked_prefill_attention(f.q_nope[:, heads], f.q_pe[:, heads], f.kv_c, f.k_pe,
                                         query_start_loc, kv_cache, block_table, plan,
                                         weights.W_UK[:, heads], weights.W_UV[:, heads],
                                         c.softmax_scale, comm)
    return _own_heads_out(o, weights, comm)


def dcp_decode_forward_rank(comm: Communicator, weights: MLAWeights, hidden: torch.Tensor,
                            kv_cache: torch.Tensor, block_table: torch.Tensor,
                            cache_seqlens: torch.Tensor, shard_seed: int | None = 0
                            ) -> torch.Tensor:
    """The rank program of fast DCP decode from hidden states, given the *global* inputs of
    ``decode_forward`` (as the reference's); the global cache is read, not written."""
    s_q = hidden.shape[1]
    mine = shard_kv_cache(kv_cache, block_table, cache_seqlens, comm.world_size,
                          capacities=(cache_seqlens + s_q).tolist(),
                          seed=shard_seed)[comm.rank]
    return dcp_decode_forward(weights, hidden, mine.kv_cache, mine.block_table, cache_seqlens,
                              comm)


def dcp_chunked_prefill_forward_rank(comm: Communicator, weights: MLAWeights,
                                     hidden: torch.Tensor, query_start_loc: torch.Tensor,
                                     context_lens: list[int], kv_cache: torch.Tensor,
                                     block_table: torch.Tensor, plan: DCPChunkPlan | None = None,
                                     workspace_size: int = 64 * 1024,
                                     shard_seed: int | None = 0) -> torch.Tensor:
    """The rank program of fast DCP chunked prefill from hidden states, given the *global*
    inputs of ``chunked_prefill_forward`` (as the reference's)."""
    qsl = query_start_loc.tolist()
    caps = [n + qsl[i + 1] - qsl[i] for i, n in enumerate(context_lens)]
    ctx = torch.tensor(list(context_lens), dtype=torch.int32, device=kv_cache.device)
    mine = shard_kv_cache(kv_cache, block_table, ctx, comm.world_size, capacities=caps,
                          seed=shard_seed)[comm.rank]
    return dcp_chunked_prefill_forward(weights, hidden, query_start_loc, context_lens,
                                       mine.kv_cache, mine.block_table, comm, plan=plan,
                                       workspace_size=workspace_size)
