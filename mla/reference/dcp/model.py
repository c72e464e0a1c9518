"""DCP from hidden states: ``decode_forward`` and ``chunked_prefill_forward`` on a DCP group.

conventions §9, papers/derivation.md (21) to (23). Every rank runs the front (§1) on the new
tokens; the owner of a new token (position ``t`` on rank ``t mod W``, (21)) writes its latent
into its local cache; each rank keeps the query of its ``N/W`` heads and runs DCP decode (22)
or DCP chunked prefill (23); the heads' outputs are all-gathered and multiplied by the whole
``W_O``:

    o_r   = DCP attention of rank r's heads                  [..., N/W, V]
    out   = all_gather_heads(o_r) @ W_O                      [..., H], the same on every rank

The attention follows vLLM 0.11 ``v1/attention/backends/mla/common.py``
(``MLACommonImpl.forward``). The output projection does not: under tensor parallelism
``o_proj`` is row-parallel and followed by an all-reduce; gathering the heads instead gives
every rank the single-rank path's numbers, in the same order of operations.
"""

from __future__ import annotations

import torch

from mla.reference.dcp.comm import Communicator
from mla.reference.dcp.context import (
    DCPChunkPlan,
    dcp_chunked_prefill_attention,
    plan_dcp_context_chunks,
)
from mla.reference.dcp.decode import dcp_decode
from mla.reference.dcp.sharding import dcp_slot_mapping, head_slice, shard_kv_cache
from mla.reference.decode import absorb_q
from mla.reference.front import mla_front
from mla.reference.paged_cache import concat_and_cache_mla
from mla.validation import check_float, check_index, check_same_device
from mla.weights import MLAWeights

__all__ = ["dcp_decode_forward", "dcp_chunked_prefill_forward", "dcp_decode_forward_rank",
           "dcp_chunked_prefill_forward_rank"]


def _own_heads_out(o: torch.Tensor, weights: MLAWeights, comm: Communicator) -> torch.Tensor:
    """``o [..., N/W, V]`` of this rank's heads -> ``[..., H]`` on every rank."""
    o_all = comm.all_gather(o, dim=-2)
    return o_all.flatten(-2) @ weights.W_O


def dcp_decode_forward(weights: MLAWeights, hidden: torch.Tensor, kv_cache: torch.Tensor,
                       block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                       comm: Communicator) -> torch.Tensor:
    """``decode_forward`` on one rank of a DCP group: ``hidden [B, s_q, H] -> [B, s_q, H]``.

    ``kv_cache``/``block_table`` are this rank's local cache; ``cache_seqlens [B]`` the
    *global* number of tokens cached before this step. Every rank runs the front (the latent
    of a new token is needed by its owner only, which writes it), keeps the query of its
    ``N/W`` heads, and runs ``dcp_decode``; all ranks return the same output.
    """
    c = weights.config
    check_float("hidden", hidden, shape=[None, None, c.hidden_size])
    B, s_q, _ = hidden.shape
    check_index("cache_seqlens", cache_seqlens, shape=[B])
    check_index("block_table", block_table, shape=[B, None])
    check_same_device(hidden=hidden, kv_cache=kv_cache, block_table=block_table,
                      cache_seqlens=cache_seqlens)
    heads = head_slice(c.num_heads, comm.world_size, comm.rank)
    dev = hidden.device
    positions = (cache_seqlens.long()[:, None] + torch.arange(s_q, device=dev)).flatten()
    req = torch.arange(B, device=dev).repeat_interleave(s_q)
    f = mla_front(weights, hidden.reshape(B * s_q, -1), positions)
    slots = dcp_slot_mapping(block_table, req, positions, kv_cache.shape[1], comm.world_size,
                             comm.rank)
    concat_and_cache_mla(f.kv_c, f.k_pe, kv_cache, slots)
    ql_nope = absorb_q(f.q_nope[:, heads], weights.W_UK[:, heads])
    q = torch.cat([ql_nope, f.q_pe[:, heads]], dim=-1).view(B, s_q, -1, c.latent_dim)
    o_lat, _ = dcp_decode(q, kv_cache, block_table.to(torch.int32),
                          (cache_seqlens + s_q).to(torch.int32), c.softmax_scale, comm,
                          causal=True, head_dim_v=c.kv_lora_rank)
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
    """``chunked_prefill_forward`` on one rank of a DCP group: ``hidden [T, H] -> [T, H]``.

    ``kv_cache``/``block_table`` are this rank's local cache holding its share of the
    context; the new tokens are written by their owners. Without ``plan`` vLLM's plan for
    ``workspace_size`` is used (its chunk size must be divisible by ``W``).
    """
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
    req = torch.cat([torch.full((qsl[i + 1] - qsl[i],), i) for i in range(B)]).to(dev)
    positions = torch.cat([torch.arange(context_lens[i], context_lens[i] + qsl[i + 1] - qsl[i])
                           for i in range(B)]).to(dev)
    f = mla_front(weights, hidden, positions)
    slots = dcp_slot_mapping(block_table, req, positions, kv_cache.shape[1], comm.world_size,
                             comm.rank)
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
    """The rank program of DCP decode from hidden states, given the *global* inputs of
    ``decode_forward``; every rank returns ``decode_forward``'s output (``same_on_all_ranks``
    takes it from the list ``run_simulated`` returns).

    The global cache is read, not written: the rank shards it and the new tokens go to the
    shards.
    """
    s_q = hidden.shape[1]
    shard = shard_kv_cache(kv_cache, block_table, cache_seqlens, comm.world_size,
                           capacities=(cache_seqlens + s_q).tolist(), seed=shard_seed)
    mine = shard[comm.rank]
    return dcp_decode_forward(weights, hidden, mine.kv_cache, mine.block_table, cache_seqlens,
                              comm)


def dcp_chunked_prefill_forward_rank(comm: Communicator, weights: MLAWeights,
                                     hidden: torch.Tensor, query_start_loc: torch.Tensor,
                                     context_lens: list[int], kv_cache: torch.Tensor,
                                     block_table: torch.Tensor, plan: DCPChunkPlan | None = None,
                                     workspace_size: int = 64 * 1024,
                                     shard_seed: int | None = 0) -> torch.Tensor:
    """The rank program of DCP chunked prefill from hidden states, given the *global* inputs of
    ``chunked_prefill_forward``; every rank returns its output (see ``same_on_all_ranks``).

    The global cache is read, not written, as in ``dcp_decode_forward_rank``.
    """
    qsl = query_start_loc.tolist()
    caps = [n + qsl[i + 1] - qsl[i] for i, n in enumerate(context_lens)]
    ctx = torch.tensor(list(context_lens), dtype=torch.int32, device=kv_cache.device)
    mine = shard_kv_cache(kv_cache, block_table, ctx, comm.world_size, capacities=caps,
                          seed=shard_seed)[comm.rank]
    return dcp_chunked_prefill_forward(weights, hidden, query_start_loc, context_lens,
                                       mine.kv_cache, mine.block_table, comm, plan=plan,
                                       workspace_size=workspace_size)
