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

The steps are the single-rank ones (``mla.reference.model.run_decode`` and
``run_chunked_prefill``), run with ``dcp_layer_ops``: the DCP slot mapping and attentions bound
to the communicator, this rank's heads, the all-gather of the heads before ``W_O``.
"""

from __future__ import annotations

import functools

import torch

from mla.reference.dcp.comm import Communicator
from mla.reference.dcp.context import (
    DCPChunkPlan,
    dcp_chunked_prefill_attention,
    plan_dcp_context_chunks,
)
from mla.reference.dcp.decode import dcp_decode
from mla.reference.dcp.sharding import dcp_slot_mapping, head_slice, shard_kv_cache
from mla.reference.model import LayerOps, run_chunked_prefill, run_decode
from mla.weights import MLAWeights

__all__ = ["dcp_decode_forward", "dcp_chunked_prefill_forward", "dcp_decode_forward_rank",
           "dcp_chunked_prefill_forward_rank", "dcp_layer_ops", "REFERENCE_DCP_KERNELS",
           "shard_for_decode", "shard_for_prefill"]


def dcp_layer_ops(kernels: LayerOps, weights: MLAWeights, comm: Communicator) -> LayerOps:
    """The layer ops of rank ``comm.rank`` of a DCP group, from a DCP path's ``kernels`` whose
    group is still unbound (``slot_mapping(..., world_size=, rank=)``, ``decode(..., comm=)``,
    ``chunked_prefill(..., comm=)``, as ``dcp_slot_mapping``, ``dcp_decode``,
    ``dcp_chunked_prefill_attention``): those bound to ``comm``, the DCP chunk plan, this
    rank's ``N/W`` heads, and the all-gather of the heads before ``W_O``."""
    W, r = comm.world_size, comm.rank
    return LayerOps(
        cache_write=kernels.cache_write,
        slot_mapping=functools.partial(kernels.slot_mapping, world_size=W, rank=r),
        decode=functools.partial(kernels.decode, comm=comm),
        chunked_prefill=functools.partial(kernels.chunked_prefill, comm=comm),
        plan_chunks=functools.partial(plan_dcp_context_chunks, world_size=W),
        validate=kernels.validate,
        heads=head_slice(weights.config.num_heads, W, r),
        gather_heads=functools.partial(comm.all_gather, dim=-2))


# the reference's DCP kernels, their group bound by dcp_layer_ops
REFERENCE_DCP_KERNELS = LayerOps(slot_mapping=dcp_slot_mapping, decode=dcp_decode,
                                 chunked_prefill=dcp_chunked_prefill_attention)


def dcp_decode_forward(weights: MLAWeights, hidden: torch.Tensor, kv_cache: torch.Tensor,
                       block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                       comm: Communicator) -> torch.Tensor:
    """``decode_forward`` on one rank of a DCP group: ``hidden [B, s_q, H] -> [B, s_q, H]``.

    ``kv_cache``/``block_table`` are this rank's local cache; ``cache_seqlens [B]`` the
    *global* number of tokens cached before this step. Every rank runs the front (the latent
    of a new token is needed by its owner only, which writes it), keeps the query of its
    ``N/W`` heads, and runs ``dcp_decode``; all ranks return the same output.
    """
    return run_decode(dcp_layer_ops(REFERENCE_DCP_KERNELS, weights, comm), weights, hidden,
                      kv_cache, block_table, cache_seqlens).out


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
    return run_chunked_prefill(dcp_layer_ops(REFERENCE_DCP_KERNELS, weights, comm), weights,
                               hidden, query_start_loc, context_lens, kv_cache, block_table,
                               plan, workspace_size).out


def shard_for_decode(comm: Communicator, hidden: torch.Tensor, kv_cache: torch.Tensor,
                     block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                     shard_seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's local cache and block table for a decode step on the *global* cache, with
    room for the step's new tokens (the global cache is read, not written)."""
    s_q = hidden.shape[1]
    mine = shard_kv_cache(kv_cache, block_table, cache_seqlens, comm.world_size,
                          capacities=(cache_seqlens + s_q).tolist(),
                          seed=shard_seed)[comm.rank]
    return mine.kv_cache, mine.block_table


def shard_for_prefill(comm: Communicator, query_start_loc: torch.Tensor,
                      context_lens: list[int], kv_cache: torch.Tensor,
                      block_table: torch.Tensor, shard_seed: int | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's local cache and block table for a chunked prefill on the *global* cache,
    with room for the new tokens."""
    qsl = query_start_loc.tolist()
    caps = [n + qsl[i + 1] - qsl[i] for i, n in enumerate(context_lens)]
    ctx = torch.tensor(list(context_lens), dtype=torch.int32, device=kv_cache.device)
    mine = shard_kv_cache(kv_cache, block_table, ctx, comm.world_size, capacities=caps,
                          seed=shard_seed)[comm.rank]
    return mine.kv_cache, mine.block_table


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
    kv, table = shard_for_decode(comm, hidden, kv_cache, block_table, cache_seqlens, shard_seed)
    return dcp_decode_forward(weights, hidden, kv, table, cache_seqlens, comm)


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
    kv, table = shard_for_prefill(comm, query_start_loc, context_lens, kv_cache, block_table,
                                  shard_seed)
    return dcp_chunked_prefill_forward(weights, hidden, query_start_loc, context_lens, kv,
                                       table, comm, plan=plan, workspace_size=workspace_size)
