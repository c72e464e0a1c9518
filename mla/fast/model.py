"""Whole dense MLA layers on the fast path: ``mla.reference.model``'s forwards, same signatures.

Each forward is the reference's, step for step, with the fast kernels where the reference has
a kernel-level twin:

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
reference and the fast kernel do.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mla.fast.chunked import chunked_prefill_attention
from mla.fast.common import should_validate
from mla.fast.decode import mla_decode_paged
from mla.fast.paged_cache import concat_and_cache_mla
from mla.reference.chunked import ChunkPlan, plan_context_chunks
from mla.reference.decode import absorb_q
from mla.reference.front import Front, mla_front
from mla.reference.paged_cache import slot_mapping_from_block_table
from mla.validation import check_float, check_index, check_nonnegative, check_same_device
from mla.weights import MLAWeights

__all__ = ["DecodeTrace", "PrefillTrace", "token_slots", "write_context",
           "chunked_prefill_layer", "chunked_prefill_forward", "decode_layer", "decode_forward"]


class DecodeTrace(NamedTuple):
    """Every stage of one decode step, for a stage-by-stage check."""

    front: Front  # [B·s_q, ...] rows, request-major
    q: torch.Tensor  # [B, s_q, N, Lkv+R]: absorbed q_nope ‖ q_pe, the attention's query
    o_lat: torch.Tensor  # [B, s_q, N, Lkv]: attention output in the latent space
    lse: torch.Tensor  # [B, N, s_q] float32
    out: torch.Tensor  # [B, s_q, H]


class PrefillTrace(NamedTuple):
    """Every stage of one chunked prefill, for a stage-by-stage check."""

    front: Front  # [T, ...]
    o: torch.Tensor  # [T, N, V]: attention output over context and new tokens
    lse: torch.Tensor  # [N, T]
    out: torch.Tensor  # [T, H]


def token_slots(block_table: torch.Tensor, req: torch.Tensor, positions: torch.Tensor,
                block_size: int, validate: bool) -> torch.Tensor:
    """Cache slots of tokens ``(req[t], positions[t])``. With ``validate`` the reference's
    ``slot_mapping_from_block_table`` (it checks the ranges on the host); without, the same
    formula on the device only, so that a CUDA graph can capture it."""
    if validate:
        return slot_mapping_from_block_table(block_table, req, positions, block_size)
    blocks = block_table.long()[req, positions // block_size]
    return blocks * block_size + positions % block_size


def write_context(weights: MLAWeights, hidden: torch.Tensor, kv_cache: torch.Tensor,
                  block_table_row: torch.Tensor, start: int = 0) -> None:
    """Run the front on ``hidden [S, H]`` at positions ``start..start+S`` and cache its latent."""
    check_float("hidden", hidden, shape=[None, weights.config.hidden_size])
    check_index("block_table_row", block_table_row, ndim=1)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a non-negative int, got {start!r}")
    S = hidden.shape[0]
    positions = torch.arange(start, start + S, device=hidden.device)
    f = mla_front(weights, hidden, positions)
    slots = slot_mapping_from_block_table(block_table_row[None], torch.zeros_like(positions),
                                          positions, kv_cache.shape[1])
    concat_and_cache_mla(f.kv_c, f.k_pe, kv_cache, slots)


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
    c = weights.config
    check_float("hidden", hidden, shape=[None, c.hidden_size])
    B = len(context_lens)
    check_index("query_start_loc", query_start_loc, shape=[B + 1])
    check_index("block_table", block_table, shape=[B, None])
    check_float("kv_cache", kv_cache, shape=[None, None, c.latent_dim])
    check_same_device(hidden=hidden, kv_cache=kv_cache, block_table=block_table,
                      query_start_loc=query_start_loc)
    if plan is None:
        plan = plan_context_chunks(context_lens, block_size=kv_cache.shape[1],
                                   workspace_size=workspace_size)
    elif list(plan.context_lens) != list(context_lens):
        raise ValueError(f"plan is for context lens {list(plan.context_lens)}, "
                         f"got context_lens {list(context_lens)}")
    qsl = query_start_loc.tolist()
    if qsl[0] != 0 or qsl[-1] != hidden.shape[0] or any(b < a for a, b in zip(qsl, qsl[1:])):
        raise ValueError(f"query_start_loc must rise from 0 to hidden's {hidden.shape[0]} "
                         f"tokens, got {qsl}")
    dev = hidden.device
    lens = torch.tensor([qsl[i + 1] - qsl[i] for i in range(B)], device=dev)
    req = torch.repeat_interleave(torch.arange(B, device=dev), lens)
    starts = torch.tensor(list(context_lens), dtype=torch.long, device=dev)
    # position of new token t: its request's context length plus its rank among the new ones
    positions = starts[req] + torch.arange(hidden.shape[0], device=dev) - query_start_loc[req]
    f = mla_front(weights, hidden, positions)
    slots = slot_mapping_from_block_table(block_table, req, positions, kv_cache.shape[1])
    concat_and_cache_mla(f.kv_c, f.k_pe, kv_cache, slots)
    o, lse = chunked_prefill_attention(f.q_nope, f.q_pe, f.kv_c, f.k_pe, query_start_loc,
                                       kv_cache, block_table, plan, weights.W_UK, weights.W_UV,
                                       c.softmax_scale)
    return PrefillTrace(front=f, o=o, lse=lse, out=o.flatten(-2) @ weights.W_O)


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
    c = weights.config
    check_float("hidden", hidden, shape=[None, None, c.hidden_size])
    B, s_q, _ = hidden.shape
    check_index("cache_seqlens", cache_seqlens, shape=[B])
    check_index("block_table", block_table, shape=[B, None])
    check_float("kv_cache", kv_cache, shape=[None, None, c.latent_dim])
    check_same_device(hidden=hidden, kv_cache=kv_cache, block_table=block_table,
                      cache_seqlens=cache_seqlens)
    checked = should_validate(validate, hidden)
    if checked:
        check_nonnegative("cache_seqlens", cache_seqlens)
    dev = hidden.device
    positions = (cache_seqlens.long()[:, None] + torch.arange(s_q, device=dev)).flatten()
    req = torch.arange(B, device=dev).repeat_interleave(s_q)
    f = mla_front(weights, hidden.reshape(B * s_q, -1), positions)
    slots = token_slots(block_table, req, positions, kv_cache.shape[1], checked)
    concat_and_cache_mla(f.kv_c, f.k_pe, kv_cache, slots, validate=checked)
    q = torch.cat([absorb_q(f.q_nope, weights.W_UK), f.q_pe], dim=-1)
    q = q.view(B, s_q, c.num_heads, c.latent_dim)
    o_lat, lse = mla_decode_paged(q, kv_cache, block_table.to(torch.int32),
                                  (cache_seqlens + s_q).to(torch.int32), c.softmax_scale,
                                  causal=True, head_dim_v=c.kv_lora_rank, validate=checked)
    o = torch.einsum("bsnl,lnv->bsnv", o_lat, weights.W_UV)
    return DecodeTrace(front=f, q=q, o_lat=o_lat, lse=lse, out=o.flatten(-2) @ weights.W_O)


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
