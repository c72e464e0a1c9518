"""Model-level entry points: hidden states in, hidden states out, on a paged latent cache.

Each function runs the shared front (``front.py``), writes the new tokens' latent rows into the
cache (``concat_and_cache_mla``) and runs one attention path, then ``o.flatten(-2) @ W_O``:

    naive_forward            the definition (``naive.py``), one request, no cache
    prefill_forward          compute-friendly, one request, no cache (``prefill.py``)
    chunked_prefill_forward  a batch of prefills with cached context, chunked (``chunked.py``)
    decode_forward           absorbed MQA over the paged cache, ``s_q >= 1`` (``decode.py``)

All of them must agree with ``naive_forward`` on the same tokens; that is what the tests and
``mla walkthrough`` check.

The cached paths are written once, against ``LayerOps``: the kernels a layer step calls (the
cache write, the slot mapping, the decode and chunked prefill attentions, the chunk planner)
and the heads it runs. The default is this package's kernels on all heads; a DCP rank
(``mla.reference.dcp.model``) swaps in its attentions and its share of the heads, and
``mla.fast.model`` the fast kernels, so the orchestration (positions, front, slots, absorption,
projections) is the same code on every path. ``run_decode`` and ``run_chunked_prefill``
return every intermediate (``DecodeTrace``, ``PrefillTrace``) for stage-by-stage checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from mla.reference.chunked import ChunkPlan, chunked_prefill_attention, plan_context_chunks
from mla.reference.decode import absorb_q, mla_decode_paged
from mla.reference.front import Front, mla_front
from mla.reference.naive import naive_forward
from mla.reference.paged_cache import concat_and_cache_mla, slot_mapping_from_block_table
from mla.reference.prefill import prefill_forward
from mla.validation import check_float, check_index, check_nonnegative, check_same_device
from mla.weights import MLAWeights

__all__ = ["naive_forward", "prefill_forward", "chunked_prefill_forward", "decode_forward",
           "write_context", "LayerOps", "REFERENCE_OPS", "DecodeTrace", "PrefillTrace",
           "run_decode", "run_chunked_prefill", "run_write_context", "NewTokens", "new_tokens"]


@dataclass(frozen=True)
class LayerOps:
    """What a dense layer step calls, with the reference's signatures; the defaults are the
    reference's kernels on all heads of one rank.

    ``validate``: the orchestration's own host value checks (``cache_seqlens >= 0``); a path
    that must not read the device (a fast decode step without validation) turns them off and
    binds the same choice into its kernels. ``heads``: the heads this rank attends with;
    ``gather_heads``: joins the ranks' heads of ``o [..., N', V]`` before ``W_O`` (``None``:
    one rank holds them all).
    """

    cache_write: Callable[..., None] = concat_and_cache_mla
    slot_mapping: Callable[..., torch.Tensor] = slot_mapping_from_block_table
    decode: Callable[..., tuple[torch.Tensor, torch.Tensor]] = mla_decode_paged
    chunked_prefill: Callable[..., tuple[torch.Tensor, torch.Tensor]] = \
        chunked_prefill_attention
    plan_chunks: Callable[..., Any] = plan_context_chunks
    validate: bool = True
    heads: slice = field(default_factory=lambda: slice(None))  # all heads
    gather_heads: Callable[[torch.Tensor], torch.Tensor] | None = None

    def output(self, weights: MLAWeights, o: torch.Tensor) -> torch.Tensor:
        """``o [..., N', V]`` of this rank's heads -> ``[..., H]``."""
        if self.gather_heads is not None:
            o = self.gather_heads(o)
        return o.flatten(-2) @ weights.W_O


REFERENCE_OPS = LayerOps()


class DecodeTrace(NamedTuple):
    """Every stage of one decode step, for a stage-by-stage check."""

    front: Front  # [B·s_q, ...] rows, request-major
    q: torch.Tensor  # [B, s_q, N', Lkv+R]: absorbed q_nope ‖ q_pe, the attention's query
    o_lat: torch.Tensor  # [B, s_q, N', Lkv]: attention output in the latent space
    lse: torch.Tensor  # [B, N', s_q]
    out: torch.Tensor  # [B, s_q, H]


class PrefillTrace(NamedTuple):
    """Every stage of one chunked prefill, for a stage-by-stage check."""

    front: Front  # [T, ...]
    o: torch.Tensor  # [T, N', V]: attention output over context and new tokens
    lse: torch.Tensor  # [N', T]
    out: torch.Tensor  # [T, H]


class NewTokens(NamedTuple):
    """Where a prefill's new tokens go: request and position of each (``[T]`` int64, on
    ``hidden``'s device) and the count per request (on the host)."""

    req: torch.Tensor
    positions: torch.Tensor
    lens: list[int]


def host_ints(values: list[int], device: torch.device, dtype: torch.dtype = torch.long
              ) -> torch.Tensor:
    """``values`` as a tensor on ``device``. On a GPU through pinned memory without waiting:
    ``torch.tensor(values, device=...)`` copies from pageable memory, which waits for every
    kernel queued before it, and then the GPU idles while the host launches what follows."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def new_tokens(hidden: torch.Tensor, query_start_loc: torch.Tensor,
               context_lens: list[int]) -> NewTokens:
    """The new tokens of a prefill: request ``i``'s follow its ``context_lens[i]`` cached ones.
    Reads ``query_start_loc`` on the host to check it rises from 0 to ``hidden``'s rows."""
    B = len(context_lens)
    qsl = query_start_loc.tolist()
    if qsl[0] != 0 or qsl[-1] != hidden.shape[0] or any(b < a for a, b in zip(qsl, qsl[1:])):
        raise ValueError(f"query_start_loc must rise from 0 to hidden's {hidden.shape[0]} "
                         f"tokens, got {qsl}")
    dev = hidden.device
    lens = [qsl[i + 1] - qsl[i] for i in range(B)]
    req = torch.repeat_interleave(torch.arange(B, device=dev), host_ints(lens, dev),
                                  output_size=hidden.shape[0])
    starts = host_ints(context_lens, dev)
    # position of new token t: its request's context length plus its rank among the new ones
    positions = starts[req] + torch.arange(hidden.shape[0], device=dev) - query_start_loc[req]
    return NewTokens(req, positions.long(), lens)


def run_write_context(ops: LayerOps, weights: MLAWeights, hidden: torch.Tensor,
                      kv_cache: torch.Tensor, block_table_row: torch.Tensor,
                      start: int = 0) -> None:
    """``write_context`` with ``ops``' slot mapping and cache write."""
    check_float("hidden", hidden, shape=[None, weights.config.hidden_size])
    check_index("block_table_row", block_table_row, ndim=1)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a non-negative int, got {start!r}")
    S = hidden.shape[0]
    positions = torch.arange(start, start + S, device=hidden.device)
    f = mla_front(weights, hidden, positions)
    slots = ops.slot_mapping(block_table_row[None], torch.zeros_like(positions), positions,
                             kv_cache.shape[1])
    ops.cache_write(f.kv_c, f.k_pe, kv_cache, slots)


def run_chunked_prefill(ops: LayerOps, weights: MLAWeights, hidden: torch.Tensor,
                        query_start_loc: torch.Tensor, context_lens: list[int],
                        kv_cache: torch.Tensor, block_table: torch.Tensor,
                        plan: Any = None, workspace_size: int = 64 * 1024) -> PrefillTrace:
    """``chunked_prefill_forward`` with ``ops``' kernels, every stage returned. ``plan``: of
    the kind ``ops.plan_chunks`` makes (``None``: made for ``workspace_size``)."""
    c = weights.config
    check_float("hidden", hidden, shape=[None, c.hidden_size])
    B = len(context_lens)
    check_index("query_start_loc", query_start_loc, shape=[B + 1])
    check_index("block_table", block_table, shape=[B, None])
    check_float("kv_cache", kv_cache, shape=[None, None, c.latent_dim])
    check_same_device(hidden=hidden, kv_cache=kv_cache, block_table=block_table,
                      query_start_loc=query_start_loc)
    if plan is None:
        plan = ops.plan_chunks(context_lens, block_size=kv_cache.shape[1],
                               workspace_size=workspace_size)
    elif list(plan.context_lens) != list(context_lens):
        raise ValueError(f"plan is for context lens {list(plan.context_lens)}, "
                         f"got context_lens {list(context_lens)}")
    req, positions, _ = new_tokens(hidden, query_start_loc, context_lens)
    f = mla_front(weights, hidden, positions)
    ops.cache_write(f.kv_c, f.k_pe, kv_cache,
                    ops.slot_mapping(block_table, req, positions, kv_cache.shape[1]))
    h = ops.heads
    o, lse = ops.chunked_prefill(f.q_nope[:, h], f.q_pe[:, h], f.kv_c, f.k_pe, query_start_loc,
                                 kv_cache, block_table, plan, weights.W_UK[:, h],
                                 weights.W_UV[:, h], c.softmax_scale)
    return PrefillTrace(front=f, o=o, lse=lse, out=ops.output(weights, o))


def run_decode(ops: LayerOps, weights: MLAWeights, hidden: torch.Tensor,
               kv_cache: torch.Tensor, block_table: torch.Tensor,
               cache_seqlens: torch.Tensor) -> DecodeTrace:
    """``decode_forward`` with ``ops``' kernels, every stage returned. Reads nothing on the
    host itself unless ``ops.validate``."""
    c = weights.config
    check_float("hidden", hidden, shape=[None, None, c.hidden_size])
    B, s_q, _ = hidden.shape
    check_index("cache_seqlens", cache_seqlens, shape=[B])
    check_index("block_table", block_table, shape=[B, None])
    # named here, not later as the cache write's k_pe or slot positions
    check_float("kv_cache", kv_cache, shape=[None, None, c.latent_dim])
    check_same_device(hidden=hidden, kv_cache=kv_cache, block_table=block_table,
                      cache_seqlens=cache_seqlens)
    if ops.validate:
        check_nonnegative("cache_seqlens", cache_seqlens)
    dev = hidden.device
    positions = (cache_seqlens.long()[:, None] + torch.arange(s_q, device=dev)).flatten()
    req = torch.arange(B, device=dev).repeat_interleave(s_q)
    f = mla_front(weights, hidden.reshape(B * s_q, -1), positions)
    ops.cache_write(f.kv_c, f.k_pe, kv_cache,
                    ops.slot_mapping(block_table, req, positions, kv_cache.shape[1]))
    h = ops.heads
    q = torch.cat([absorb_q(f.q_nope[:, h], weights.W_UK[:, h]), f.q_pe[:, h]], dim=-1)
    q = q.view(B, s_q, -1, c.latent_dim)
    o_lat, lse = ops.decode(q, kv_cache, block_table.to(torch.int32),
                            (cache_seqlens + s_q).to(torch.int32), c.softmax_scale,
                            causal=True, head_dim_v=c.kv_lora_rank)
    o = torch.einsum("bsnl,lnv->bsnv", o_lat, weights.W_UV[:, h])
    return DecodeTrace(front=f, q=q, o_lat=o_lat, lse=lse, out=ops.output(weights, o))


def write_context(weights: MLAWeights, hidden: torch.Tensor, kv_cache: torch.Tensor,
                  block_table_row: torch.Tensor, start: int = 0) -> None:
    """Run the front on ``hidden [S, H]`` at positions ``start..start+S`` and cache its latent."""
    run_write_context(REFERENCE_OPS, weights, hidden, kv_cache, block_table_row, start)


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

    Request ``i`` already has ``context_lens[i]`` tokens in the cache; its new tokens take the
    positions after them and are written to the cache too. Without ``plan`` vLLM's plan for
    ``workspace_size`` is used. Returns ``[T, H]``.
    """
    return run_chunked_prefill(REFERENCE_OPS, weights, hidden, query_start_loc, context_lens,
                               kv_cache, block_table, plan, workspace_size).out


def decode_forward(weights: MLAWeights, hidden: torch.Tensor, kv_cache: torch.Tensor,
                   block_table: torch.Tensor, cache_seqlens: torch.Tensor) -> torch.Tensor:
    """Decode ``s_q`` new tokens per request: ``hidden [B, s_q, H] -> [B, s_q, H]``.

    ``cache_seqlens [B]`` counts the tokens cached *before* this step; the new tokens are
    written at the positions after them and attend causally (FlashMLA's MTP mask).
    """
    return run_decode(REFERENCE_OPS, weights, hidden, kv_cache, block_table,
                      cache_seqlens).out
