"""Model-level entry points: hidden states in, hidden states out, on a paged latent cache.

Each function runs the shared front (``front.py``), writes the new tokens' latent rows into the
cache (``concat_and_cache_mla``) and runs one attention path, then ``o.flatten(-2) @ W_O``:

    naive_forward            the definition (``naive.py``), one request, no cache
    prefill_forward          compute-friendly, one request, no cache (``prefill.py``)
    chunked_prefill_forward  a batch of prefills with cached context, chunked (``chunked.py``)
    decode_forward           absorbed MQA over the paged cache, ``s_q >= 1`` (``decode.py``)

All of them must agree with ``naive_forward`` on the same tokens; that is what the tests and
``mla walkthrough`` check.
"""

from __future__ import annotations

import torch

from mla.reference.chunked import ChunkPlan, chunked_prefill_attention, plan_context_chunks
from mla.reference.decode import absorb_q, mla_decode_paged
from mla.reference.front import mla_front
from mla.reference.naive import naive_forward
from mla.reference.paged_cache import concat_and_cache_mla, slot_mapping_from_block_table
from mla.reference.prefill import prefill_forward
from mla.validation import check_float, check_index, check_nonnegative, check_same_device
from mla.weights import MLAWeights

__all__ = ["naive_forward", "prefill_forward", "chunked_prefill_forward", "decode_forward",
           "write_context"]


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
    c = weights.config
    check_float("hidden", hidden, shape=[None, c.hidden_size])
    B = len(context_lens)
    check_index("query_start_loc", query_start_loc, shape=[B + 1])
    check_index("block_table", block_table, shape=[B, None])
    check_same_device(hidden=hidden, kv_cache=kv_cache, block_table=block_table,
                      query_start_loc=query_start_loc)
    if plan is None:
        plan = plan_context_chunks(context_lens, block_size=kv_cache.shape[1],
                                   workspace_size=workspace_size)
    elif list(plan.context_lens) != list(context_lens):
        raise ValueError(f"plan is for context lens {list(plan.context_lens)}, "
                         f"got context_lens {list(context_lens)}")
    qsl = query_start_loc.tolist()
    req = torch.cat([torch.full((qsl[i + 1] - qsl[i],), i) for i in range(B)]).to(hidden.device)
    positions = torch.cat([torch.arange(context_lens[i], context_lens[i] + qsl[i + 1] - qsl[i])
                           for i in range(B)]).to(hidden.device)
    f = mla_front(weights, hidden, positions)
    slots = slot_mapping_from_block_table(block_table, req, positions, kv_cache.shape[1])
    concat_and_cache_mla(f.kv_c, f.k_pe, kv_cache, slots)
    o, _ = chunked_prefill_attention(f.q_nope, f.q_pe, f.kv_c, f.k_pe, query_start_loc,
                                     kv_cache, block_table, plan, weights.W_UK, weights.W_UV,
                                     c.softmax_scale)
    return o.flatten(-2) @ weights.W_O


def decode_forward(weights: MLAWeights, hidden: torch.Tensor, kv_cache: torch.Tensor,
                   block_table: torch.Tensor, cache_seqlens: torch.Tensor) -> torch.Tensor:
    """Decode ``s_q`` new tokens per request: ``hidden [B, s_q, H] -> [B, s_q, H]``.

    ``cache_seqlens [B]`` counts the tokens cached *before* this step; the new tokens are
    written at the positions after them and attend causally (FlashMLA's MTP mask).
    """
    c = weights.config
    check_float("hidden", hidden, shape=[None, None, c.hidden_size])
    B, s_q, _ = hidden.shape
    check_index("cache_seqlens", cache_seqlens, shape=[B])
    check_index("block_table", block_table, shape=[B, None])
    # named here, not later as concat_and_cache_mla's k_pe or slot positions
    check_float("kv_cache", kv_cache, shape=[None, None, c.latent_dim])
    check_same_device(hidden=hidden, kv_cache=kv_cache, block_table=block_table,
                      cache_seqlens=cache_seqlens)
    check_nonnegative("cache_seqlens", cache_seqlens)
    positions = (cache_seqlens.long()[:, None] + torch.arange(s_q, device=hidden.device)).flatten()
    req = torch.arange(B, device=hidden.device).repeat_interleave(s_q)
    f = mla_front(weights, hidden.reshape(B * s_q, -1), positions)
    slots = slot_mapping_from_block_table(block_table, req, positions, kv_cache.shape[1])
    concat_and_cache_mla(f.kv_c, f.k_pe, kv_cache, slots)
    ql_nope = absorb_q(f.q_nope, weights.W_UK)
    q = torch.cat([ql_nope, f.q_pe], dim=-1).view(B, s_q, c.num_heads, c.latent_dim)
    o_lat, _ = mla_decode_paged(q, kv_cache, block_table.to(torch.int32),
                                (cache_seqlens + s_q).to(torch.int32), c.softmax_scale,
                                causal=True, head_dim_v=c.kv_lora_rank)
    o = torch.einsum("bsnl,lnv->bsnv", o_lat, weights.W_UV)
    return o.flatten(-2) @ weights.W_O
