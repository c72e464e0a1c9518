"""Whole sparse MLA layers (DeepSeek-V3.2) on the fast path: ``mla.reference.sparse_model``'s
serving forwards, same signatures, on vLLM's fp8 index key cache.

Step for step the reference's path for an fp8 index cache (conventions §10), with the fast
kernels where they exist:

    front              mla.reference.front.mla_front, indexer_qk    plain torch: GEMMs, norms
    latent cache       mla.fast.concat_and_cache_mla / concat_and_cache_fp8_ds_mla
    index key cache    Hadamard rotation (a GEMM), mla.fast.indexer_k_quant_and_cache
    indexer q          Hadamard rotation, quantize_indexer_q (e4m3, scale into the weights)
    logits             decode: mla.fast.fp8_paged_mqa_logits over the block table
                       prefill: the keys gathered per request (the reference's torch
                       gather), mla.fast.fp8_mqa_logits
    top-k              mla.fast.top_k_per_row: request-local indices
    conversion         mla.fast.convert_req_index_to_global_index
    attention          mla.fast.sparse_mla_decode (bf16 or fp8_ds_mla cache)
                       mla.fast.sparse_mla_prefill (bf16 cache; fp8_ds_mla: the requests'
                       rows dequantized into a workspace by the reference's torch gather)
    projection         o_lat · W_UV, · W_O: cuBLAS GEMMs

``sparse_decode_layer`` and ``sparse_prefill_layer`` return every stage (``SparseTrace``) for a
stage-by-stage check.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from mla.fast.common import should_validate
from mla.fast.fp8 import concat_and_cache_fp8_ds_mla
from mla.fast.indexer_cache import indexer_k_quant_and_cache
from mla.fast.indexer_logits import fp8_mqa_logits, fp8_paged_mqa_logits
from mla.fast.model import token_slots
from mla.fast.paged_cache import concat_and_cache_mla
from mla.fast.sparse import (
    convert_req_index_to_global_index,
    sparse_mla_decode,
    sparse_mla_prefill,
)
from mla.fast.topk import top_k_per_row
from mla.reference.decode import absorb_q
from mla.reference.fp8 import gather_and_upconvert_fp8_ds_mla
from mla.reference.front import Front, mla_front
from mla.reference.indexer import IndexerWeights, _hadamard, indexer_qk, q_latent
from mla.reference.indexer_cache import gather_indexer_k_cache
from mla.reference.indexer_logits import decode_row_ends, quantize_indexer_q
from mla.reference.paged_cache import slot_mapping_from_block_table
from mla.reference.sparse_model import check_sparse_caches, is_byte_cache, project_output
from mla.validation import check_float, check_index, check_nonnegative, check_same_device
from mla.weights import MLAWeights

__all__ = ["SparseTrace", "sparse_decode_layer", "sparse_decode_forward",
           "sparse_prefill_layer", "sparse_prefill_forward"]


class SparseTrace(NamedTuple):
    """Every stage of one sparse step, for a stage-by-stage check (``T`` new tokens)."""

    front: Front  # [T, ...]
    index_k: torch.Tensor  # [T, 128]: the rotated index keys quantized into the index cache
    q_index: torch.Tensor  # [T, n_I, 128] e4m3: the indexer's quantized, rotated query
    index_weights: torch.Tensor  # [T, n_I] float32, q's scale folded in
    logits: torch.Tensor  # [T, keys] float32: decode [T, max_model_len], prefill [T, ragged]
    row_starts: torch.Tensor  # [T] int32: first logits column of each row's request
    row_ends: torch.Tensor  # [T] int32: one past each row's last visible key
    local: torch.Tensor  # [T, topk] int32 request-local indices, -1 = none
    slots: torch.Tensor  # [T, topk] int32: global cache slots (or workspace rows)
    q: torch.Tensor  # [T, N, Lkv+R]: absorbed query (decode: [B, s_q, N, Lkv+R])
    o_lat: torch.Tensor  # attention output in the latent space
    lse: torch.Tensor  # decode [B, N, s_q]; prefill [T, N]
    out: torch.Tensor  # [T, H] (decode: [B, s_q, H])


@functools.lru_cache(maxsize=16)
def _hadamard_on(d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The reference's normalized Hadamard matrix, built once per device: built per call (as
    ``hadamard_rotate`` does) it is a host-to-device copy, which a CUDA graph cannot capture."""
    return _hadamard(d, dtype, device)


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """``hadamard_rotate(x)``: ``x @ H_d / sqrt(d)`` over the last dim (one GEMM)."""
    return x @ _hadamard_on(x.shape[-1], x.dtype, x.device)


def _fast_check_caches(weights: MLAWeights, indexer_weights: IndexerWeights,
                       kv_cache: torch.Tensor, index_k_cache: torch.Tensor,
                       use_fp8_indexer: bool | None) -> None:
    check_sparse_caches(weights, indexer_weights, kv_cache, index_k_cache, use_fp8_indexer)
    if not is_byte_cache(index_k_cache):
        raise ValueError(f"the fast sparse layers read vLLM's fp8 index key cache (uint8 "
                         f"[num_blocks, block_size, 132]), got {index_k_cache.dtype} "
                         f"{list(index_k_cache.shape)}; the float index cache is the "
                         f"reference's (mla.reference.sparse_model)")


def _front_and_index(weights: MLAWeights, indexer_weights: IndexerWeights,
                     hidden: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     kv_cache: torch.Tensor, index_k_cache: torch.Tensor, validate: bool
                     ) -> tuple[Front, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cache the latent and the index key at ``slots``; return the front, the rotated index
    key, the e4m3 indexer query and its weights (as the reference's fp8 index cache path)."""
    f = mla_front(weights, hidden, positions)
    write = concat_and_cache_fp8_ds_mla if is_byte_cache(kv_cache) else concat_and_cache_mla
    write(f.kv_c, f.k_pe, kv_cache, slots, validate=validate)
    qk = indexer_qk(indexer_weights, hidden, q_latent(weights, hidden), positions, use_fp8=False)
    k_rot = _rotate(qk.k_index)
    indexer_k_quant_and_cache(k_rot, index_k_cache, slots, validate=validate)
    q_fp8, w_q = quantize_indexer_q(_rotate(qk.q_index), qk.weights)
    return f, k_rot, q_fp8, w_q


def sparse_decode_layer(
    weights: MLAWeights,
    indexer_weights: IndexerWeights,
    hidden: torch.Tensor,
    kv_cache: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    use_fp8_indexer: bool | None = None,
    *,
    validate: bool | None = None,
) -> SparseTrace:
    """``sparse_decode_forward`` with every stage returned (``SparseTrace``)."""
    c = weights.config
    check_float("hidden", hidden, shape=[None, None, c.hidden_size])
    B, s_q, _ = hidden.shape
    check_index("cache_seqlens", cache_seqlens, shape=[B])
    check_index("block_table", block_table, shape=[B, None])
    check_same_device(hidden=hidden, kv_cache=kv_cache, index_k_cache=index_k_cache,
                      block_table=block_table, cache_seqlens=cache_seqlens)
    _fast_check_caches(weights, indexer_weights, kv_cache, index_k_cache, use_fp8_indexer)
    checked = should_validate(validate, hidden)
    if checked:
        check_nonnegative("cache_seqlens", cache_seqlens)
    dev = hidden.device
    bs = kv_cache.shape[1]
    positions = (cache_seqlens.long()[:, None] + torch.arange(s_q, device=dev)).flatten()
    req = torch.arange(B, device=dev).repeat_interleave(s_q)
    slots = token_slots(block_table, req, positions, bs, checked)
    f, k_rot, q_fp8, w_q = _front_and_index(weights, indexer_weights,
                                            hidden.reshape(B * s_q, -1), slots, positions,
                                            kv_cache, index_k_cache, checked)
    seq_lens = (cache_seqlens + s_q).to(torch.int32)
    table32 = block_table.to(torch.int32)
    logits = fp8_paged_mqa_logits(q_fp8.view(B, s_q, *q_fp8.shape[1:]), index_k_cache, w_q,
                                  seq_lens, table32, block_table.shape[1] * bs,
                                  validate=checked)
    starts = torch.zeros(B * s_q, dtype=torch.int32, device=dev)
    ends = decode_row_ends(seq_lens, s_q)
    local = top_k_per_row(logits, starts, ends, indexer_weights.config.index_topk,
                          validate=checked)
    gslots = convert_req_index_to_global_index(req.to(torch.int32), table32, local, bs,
                                               validate=checked)
    q = torch.cat([absorb_q(f.q_nope, weights.W_UK), f.q_pe], dim=-1)
    q = q.view(B, s_q, c.num_heads, c.latent_dim)
    o_lat, lse = sparse_mla_decode(q, kv_cache, gslots.view(B, s_q, -1), c.softmax_scale,
                                   is_byte_cache(kv_cache), head_dim_v=c.kv_lora_rank,
                                   validate=checked)
    return SparseTrace(front=f, index_k=k_rot, q_index=q_fp8, index_weights=w_q, logits=logits,
                       row_starts=starts, row_ends=ends, local=local, slots=gslots, q=q,
                       o_lat=o_lat, lse=lse, out=project_output(weights, o_lat))


def sparse_decode_forward(
    weights: MLAWeights,
    indexer_weights: IndexerWeights,
    hidden: torch.Tensor,
    kv_cache: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    use_fp8_indexer: bool | None = None,
    *,
    validate: bool | None = None,
) -> torch.Tensor:
    """Sparse decode of ``s_q`` new tokens per request: ``hidden [B, s_q, H] -> [B, s_q, H]``.

    As ``mla.reference.sparse_decode_forward`` on an fp8 index key cache (uint8 ``[nb, bs,
    132]``); ``kv_cache`` bf16/fp16/fp32 ``[nb, bs, 576]`` or ``fp8_ds_mla`` uint8
    ``[nb, bs, 656]``. ``validate``: the host value checks (``should_validate``'s rule);
    without them the step reads nothing on the host.
    """
    return sparse_decode_layer(weights, indexer_weights, hidden, kv_cache, index_k_cache,
                               block_table, cache_seqlens, use_fp8_indexer,
                               validate=validate).out


def sparse_prefill_layer(
    weights: MLAWeights,
    indexer_weights: IndexerWeights,
    hidden: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: list[int],
    kv_cache: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    use_fp8_indexer: bool | None = None,
) -> SparseTrace:
    """``sparse_prefill_forward`` with every stage returned (``SparseTrace``)."""
    c = weights.config
    check_float("hidden", hidden, shape=[None, c.hidden_size])
    B = len(context_lens)
    check_index("query_start_loc", query_start_loc, shape=[B + 1])
    check_index("block_table", block_table, shape=[B, None])
    check_same_device(hidden=hidden, kv_cache=kv_cache, index_k_cache=index_k_cache,
                      block_table=block_table, query_start_loc=query_start_loc)
    _fast_check_caches(weights, indexer_weights, kv_cache, index_k_cache, use_fp8_indexer)
    qsl = query_start_loc.tolist()
    if qsl[0] != 0 or qsl[-1] != hidden.shape[0] or any(b < a for a, b in zip(qsl, qsl[1:])):
        raise ValueError(f"query_start_loc must rise from 0 to hidden's {hidden.shape[0]} "
                         f"tokens, got {qsl}")
    dev = hidden.device
    bs = kv_cache.shape[1]
    lens = [qsl[i + 1] - qsl[i] for i in range(B)]
    req = torch.repeat_interleave(torch.arange(B, device=dev), torch.tensor(lens, device=dev))
    ctx = torch.tensor(list(context_lens), dtype=torch.long, device=dev)
    positions = ctx[req] + torch.arange(hidden.shape[0], device=dev) - query_start_loc[req]
    slots = slot_mapping_from_block_table(block_table, req, positions, bs)
    f, k_rot, q_fp8, w_q = _front_and_index(weights, indexer_weights, hidden, slots,
                                            positions, kv_cache, index_k_cache, True)
    # vLLM's prefill: each request's keys gathered into one ragged array; query t of the
    # request starting at row ks sees rows [ks, ks + position + 1)
    seq = [context_lens[i] + lens[i] for i in range(B)]
    cu = torch.tensor([0] + torch.tensor(seq).cumsum(0).tolist(), dtype=torch.int32,
                      device=dev)
    keys = gather_indexer_k_cache(index_k_cache, block_table, cu)
    ks = cu[req].to(torch.int32)
    ke = (ks + positions + 1).to(torch.int32)
    logits = fp8_mqa_logits(q_fp8, keys, w_q, ks, ke, validate=True)
    local = top_k_per_row(logits, ks, ke, indexer_weights.config.index_topk, validate=True)
    q = torch.cat([absorb_q(f.q_nope, weights.W_UK), f.q_pe], dim=-1)  # [T, N, Lkv+R]
    req32, table32 = req.to(torch.int32), block_table.to(torch.int32)
    if is_byte_cache(kv_cache):
        # the requests' rows dequantized into a workspace, read by workspace rows
        seq_lens = torch.tensor(seq, dtype=torch.int32, device=dev)
        starts = cu[:-1].contiguous()
        kv = torch.empty(sum(seq), c.latent_dim, dtype=q.dtype, device=dev)
        gather_and_upconvert_fp8_ds_mla(kv_cache, kv, table32, seq_lens, starts, B)
        gslots = convert_req_index_to_global_index(req32, table32, local, bs,
                                                   prefill_workspace_request_ids=req32,
                                                   prefill_workspace_starts=starts,
                                                   validate=True)
    else:
        kv = kv_cache.view(-1, c.latent_dim)
        gslots = convert_req_index_to_global_index(req32, table32, local, bs, validate=True)
    o_lat, _, lse = sparse_mla_prefill(q, kv, gslots, c.softmax_scale, d_v=c.kv_lora_rank,
                                       validate=True)
    return SparseTrace(front=f, index_k=k_rot, q_index=q_fp8, index_weights=w_q, logits=logits,
                       row_starts=ks, row_ends=ke, local=local, slots=gslots, q=q,
                       o_lat=o_lat, lse=lse, out=project_output(weights, o_lat))


def sparse_prefill_forward(
    weights: MLAWeights,
    indexer_weights: IndexerWeights,
    hidden: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: list[int],
    kv_cache: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    use_fp8_indexer: bool | None = None,
) -> torch.Tensor:
    """Sparse prefill of ``hidden [T, H]`` (requests split by ``query_start_loc``) after
    ``context_lens`` cached tokens: as ``mla.reference.sparse_prefill_forward`` on an fp8 index
    key cache. Returns ``[T, H]``."""
    return sparse_prefill_layer(weights, indexer_weights, hidden, query_start_loc,
                                context_lens, kv_cache, index_k_cache, block_table,
                                use_fp8_indexer).out
