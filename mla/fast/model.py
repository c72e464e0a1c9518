"""Whole dense MLA layers on the fast path: ``mla.reference.model``'s forwards, same signatures.

The orchestration is the reference's (``mla.reference.model.run_decode`` and
``run_chunked_prefill``), run with the fast kernels in its ``LayerOps``:

    front          mla.reference.front.mla_front     plain torch: cuBLAS GEMMs, RMSNorm, RoPE
    cache write    mla.fast.concat_and_cache_mla
    attention      mla.fast.chunked_prefill_attention (prefill with context)
                   mla.fast.mla_decode_paged          (absorbed decode, s_q >= 1, causal)
    projection     o_lat · W_UV (decode), then o.flatten(-2) · W_O: cuBLAS GEMMs

The front and the projections are GEMMs already (cuBLAS on the GPU), so they are the
reference's own functions, not copies. ``decode_layer`` and ``chunked_prefill_layer`` return
every intermediate (``DecodeTrace``, ``PrefillTrace``) so that a check can hold each stage to
its own budget (``benchmarks.layer_check``); the ``*_forward`` functions return the output.

Host synchronization: decode reads nothing on the host unless it validates (``validate``: the
value checks of the slots, lengths and block table, resolved by
``mla.fast.common.should_validate`` as every fast kernel's), so without them the step can be
captured in a CUDA graph. Chunked prefill reads ``query_start_loc`` on the host, as the
reference and the fast kernel do, and so always validates.
"""

from __future__ import annotations

import functools

import torch

from mla.fast.chunked import chunked_prefill_attention
from mla.fast.common import should_validate
from mla.fast.decode import mla_decode_paged
from mla.fast.paged_cache import concat_and_cache_mla
from mla.reference.chunked import ChunkPlan
from mla.reference.model import (
    DecodeTrace,
    LayerOps,
    PrefillTrace,
    run_chunked_prefill,
    run_decode,
    run_write_context,
)
from mla.reference.paged_cache import slot_mapping_from_block_table
from mla.validation import check_float
from mla.weights import MLAWeights

__all__ = ["DecodeTrace", "PrefillTrace", "token_slots", "write_context",
           "chunked_prefill_layer", "chunked_prefill_forward", "decode_layer", "decode_forward"]


def token_slots(block_table: torch.Tensor, req: torch.Tensor, positions: torch.Tensor,
                block_size: int, validate: bool) -> torch.Tensor:
    """Cache slots of tokens ``(req[t], positions[t])``. With ``validate`` the reference's
    ``slot_mapping_from_block_table`` (it checks the ranges on the host); without, the same
    formula on the device only, so that a CUDA graph can capture it."""
    if validate:
        return slot_mapping_from_block_table(block_table, req, positions, block_size)
    blocks = block_table.long()[req, positions // block_size]
    return blocks * block_size + positions % block_size


def fast_layer_ops(validate: bool) -> LayerOps:
    """The fast kernels as the reference orchestration's ``LayerOps``, every host check on or
    off with ``validate``. Built per call from this module's names, so that a test can
    replace one kernel here (a broken twin)."""
    return LayerOps(
        cache_write=functools.partial(concat_and_cache_mla, validate=validate),
        slot_mapping=functools.partial(token_slots, validate=validate),
        decode=functools.partial(mla_decode_paged, validate=validate),
        chunked_prefill=chunked_prefill_attention,
        validate=validate)


def write_context(weights: MLAWeights, hidden: torch.Tensor, kv_cache: torch.Tensor,
                  block_table_row: torch.Tensor, start: int = 0) -> None:
    """Run the front on ``hidden [S, H]`` at positions ``start..start+S`` and cache its latent."""
    run_write_context(fast_layer_ops(True), weights, hidden, kv_cache, block_table_row, start)


def chunked_prefill_layer(
    weights: MLAWeights,
    hidden: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: list[int],
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    plan: ChunkPlan | None = None,
    workspace_size: int = 64 * 1024,
) -> PrefillTrace:
    """``chunked_prefill_forward`` with every stage returned (``PrefillTrace``)."""
    return run_chunked_prefill(fast_layer_ops(True), weights, hidden, query_start_loc,
                               context_lens, kv_cache, block_table, plan, workspace_size)


def chunked_prefill_forward(
    weights: MLAWeights,
    hidden: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: list[int],
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    plan: ChunkPlan | None = None,
    workspace_size: int = 64 * 1024,
) -> torch.Tensor:
    """Prefill ``hidden [T, H]`` (requests split by ``query_start_loc``) after their context.

    As ``mla.reference.chunked_prefill_forward``: request ``i`` has ``context_lens[i]`` tokens
    cached; its new tokens take the positions after them and are cached too. Returns ``[T, H]``.
    """
    return chunked_prefill_layer(weights, hidden, query_start_loc, context_lens, kv_cache,
                                 block_table, plan, workspace_size).out


def decode_layer(weights: MLAWeights, hidden: torch.Tensor, kv_cache: torch.Tensor,
                 block_table: torch.Tensor, cache_seqlens: torch.Tensor, *,
                 validate: bool | None = None) -> DecodeTrace:
    """``decode_forward`` with every stage returned (``DecodeTrace``)."""
    check_float("hidden", hidden, ndim=3)  # before should_validate reads its device
    return run_decode(fast_layer_ops(should_validate(validate, hidden)), weights, hidden,
                      kv_cache, block_table, cache_seqlens)


def decode_forward(weights: MLAWeights, hidden: torch.Tensor, kv_cache: torch.Tensor,
                   block_table: torch.Tensor, cache_seqlens: torch.Tensor, *,
                   validate: bool | None = None) -> torch.Tensor:
    """Decode ``s_q`` new tokens per request: ``hidden [B, s_q, H] -> [B, s_q, H]``.

    As ``mla.reference.decode_forward``: ``cache_seqlens [B]`` counts the tokens cached before
    this step; the new tokens are cached after them and attend causally. ``validate``: the host
    value checks (``None``: as ``mla.fast.common.should_validate`` decides).
    """
    return decode_layer(weights, hidden, kv_cache, block_table, cache_seqlens,
                        validate=validate).out
