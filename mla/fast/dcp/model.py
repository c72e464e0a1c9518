"""DCP from hidden states on the fast path: ``mla.reference.dcp.model``'s forwards, same
signatures (conventions §9).

The orchestration is the reference's (``mla.reference.model.run_decode`` and
``run_chunked_prefill`` with ``mla.reference.dcp.model.dcp_layer_ops``), run with the fast
kernels:

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

import functools
from collections.abc import Callable

import torch

from mla.fast.common import should_validate
from mla.fast.dcp.context import dcp_chunked_prefill_attention
from mla.fast.dcp.decode import dcp_decode, dcp_slot_mapping
from mla.fast.dcp.threads import KERNEL_LOCK
from mla.fast.paged_cache import concat_and_cache_mla
from mla.reference.dcp.comm import Communicator
from mla.reference.dcp.context import DCPChunkPlan
from mla.reference.dcp.model import dcp_layer_ops, shard_for_decode, shard_for_prefill
from mla.reference.dcp.sharding import dcp_slot_mapping as checked_dcp_slot_mapping
from mla.reference.model import LayerOps, run_chunked_prefill, run_decode
from mla.validation import check_float
from mla.weights import MLAWeights

__all__ = ["dcp_decode_forward", "dcp_chunked_prefill_forward", "dcp_decode_forward_rank",
           "dcp_chunked_prefill_forward_rank"]


def _locked(kernel: Callable[..., None]) -> Callable[..., None]:
    """``kernel`` under ``KERNEL_LOCK`` (simulated ranks are threads of one process)."""
    def call(*args: object, **kwargs: object) -> None:
        with KERNEL_LOCK:
            kernel(*args, **kwargs)
    return call


def _ops(weights: MLAWeights, comm: Communicator, validate: bool) -> LayerOps:
    """The fast DCP kernels as rank ``comm.rank``'s layer ops: the owner's slots with the
    reference's range checks when validating, else the sync-free formula."""
    kernels = LayerOps(
        cache_write=_locked(functools.partial(concat_and_cache_mla, validate=validate)),
        slot_mapping=checked_dcp_slot_mapping if validate else dcp_slot_mapping,
        decode=functools.partial(dcp_decode, validate=validate),
        chunked_prefill=dcp_chunked_prefill_attention,
        validate=validate)
    return dcp_layer_ops(kernels, weights, comm)


def dcp_decode_forward(weights: MLAWeights, hidden: torch.Tensor, kv_cache: torch.Tensor,
                       block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                       comm: Communicator, *, validate: bool | None = None) -> torch.Tensor:
    """``decode_forward`` on one rank of a DCP group: ``hidden [B, s_q, H] -> [B, s_q, H]``.

    As ``mla.reference.dcp.dcp_decode_forward``: ``kv_cache``/``block_table`` this rank's
    local cache, ``cache_seqlens [B]`` the *global* tokens cached before this step; every rank
    returns the same output.
    """
    check_float("hidden", hidden, ndim=3)  # before should_validate reads its device
    return run_decode(_ops(weights, comm, should_validate(validate, hidden)), weights, hidden,
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
    """``chunked_prefill_forward`` on one rank of a DCP group: ``hidden [T, H] -> [T, H]``
    (as ``mla.reference.dcp.dcp_chunked_prefill_forward``). Reads ``query_start_loc`` on the
    host, as the single-rank prefill does, and so validates."""
    return run_chunked_prefill(_ops(weights, comm, True), weights, hidden, query_start_loc,
                               context_lens, kv_cache, block_table, plan, workspace_size).out


def dcp_decode_forward_rank(comm: Communicator, weights: MLAWeights, hidden: torch.Tensor,
                            kv_cache: torch.Tensor, block_table: torch.Tensor,
                            cache_seqlens: torch.Tensor, shard_seed: int | None = 0
                            ) -> torch.Tensor:
    """The rank program of fast DCP decode from hidden states, given the *global* inputs of
    ``decode_forward`` (as the reference's); the global cache is read, not written."""
    kv, table = shard_for_decode(comm, hidden, kv_cache, block_table, cache_seqlens, shard_seed)
    return dcp_decode_forward(weights, hidden, kv, table, cache_seqlens, comm)


def dcp_chunked_prefill_forward_rank(comm: Communicator, weights: MLAWeights,
                                     hidden: torch.Tensor, query_start_loc: torch.Tensor,
                                     context_lens: list[int], kv_cache: torch.Tensor,
                                     block_table: torch.Tensor, plan: DCPChunkPlan | None = None,
                                     workspace_size: int = 64 * 1024,
                                     shard_seed: int | None = 0) -> torch.Tensor:
    """The rank program of fast DCP chunked prefill from hidden states, given the *global*
    inputs of ``chunked_prefill_forward`` (as the reference's)."""
    kv, table = shard_for_prefill(comm, query_start_loc, context_lens, kv_cache, block_table,
                                  shard_seed)
    return dcp_chunked_prefill_forward(weights, hidden, query_start_loc, context_lens, kv,
                                       table, comm, plan=plan, workspace_size=workspace_size)
