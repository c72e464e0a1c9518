"""Whole sparse MLA layers (DeepSeek-V3.2) on the fast path: ``mla.reference.sparse_model``'s
serving forwards, same signatures, on vLLM's fp8 index key cache.

The orchestration is the reference's (``mla.reference.sparse_model.run_sparse_decode`` and
``run_sparse_prefill``, its path for an fp8 index cache, conventions §10), run with the fast
kernels in its ``SparseOps`` where they exist:

    front              mla.fast.sparse.front: the reference's GEMMs, norms and RoPE, the
                       weights' float32 and bmm layouts prepared once
    latent cache       mla.fast.concat_and_cache_mla / concat_and_cache_fp8_ds_mla
    index key cache    Hadamard rotation (a GEMM), mla.fast.indexer_k_quant_and_cache
    indexer q          Hadamard rotation, mla.fast.quantize_indexer_q (e4m3, scale into the
                       weights, one kernel)
    logits             decode: mla.fast.fp8_paged_mqa_logits over the block table
                       prefill: the keys gathered per request
                       (mla.fast.gather_indexer_k_cache), mla.fast.fp8_mqa_logits
    top-k              mla.fast.top_k_per_row: request-local indices
    conversion         mla.fast.convert_req_index_to_global_index
    attention          mla.fast.sparse_mla_decode (bf16 or fp8_ds_mla cache)
                       mla.fast.sparse_mla_prefill (bf16 cache; fp8_ds_mla: the requests'
                       rows dequantized into a workspace by
                       mla.fast.gather_and_upconvert_fp8_ds_mla)
    absorbed q         q_nope · W_UK^T: one bmm over the heads
    projection         o_lat · W_UV (one bmm), · W_O: cuBLAS GEMMs

``sparse_decode_layer`` and ``sparse_prefill_layer`` return every stage (``SparseTrace``) for a
stage-by-stage check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from mla.fast.common import should_validate
from mla.fast.fp8 import concat_and_cache_fp8_ds_mla
from mla.fast.indexer.cache import indexer_k_quant_and_cache
from mla.fast.indexer.logits import fp8_mqa_logits, fp8_paged_mqa_logits
from mla.fast.indexer.query import quantize_indexer_q
from mla.fast.model import token_slots
from mla.fast.paged_cache import concat_and_cache_mla
from mla.fast.sparse import (
    convert_req_index_to_global_index,
    sparse_mla_decode,
    sparse_mla_prefill,
)
from mla.fast.sparse.front import absorb_query, output_projection, sparse_front
from mla.fast.sparse.gather import gather_and_upconvert_fp8_ds_mla, gather_indexer_k_cache
from mla.fast.sparse.index import decode_rows
from mla.fast.topk import top_k_per_row
from mla.reference.front import Front
from mla.reference.indexer import IndexerWeights, _hadamard
from mla.reference.sparse_model import (
    SparseOps,
    SparseTrace,
    check_sparse_caches,
    front_and_index,
    is_byte_cache,
    run_sparse_decode,
    run_sparse_prefill,
)
from mla.validation import check_float
from mla.weights import MLAWeights

__all__ = ["SparseTrace", "sparse_decode_layer", "sparse_decode_forward",
           "sparse_prefill_layer", "sparse_prefill_forward"]


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


def fast_sparse_ops(validate: bool) -> SparseOps:
    """The fast kernels as the reference orchestration's ``SparseOps``, every host check on or
    off with ``validate``. Built per call from this module's names, so that a test can
    replace one kernel here (a broken twin)."""
    def checked(kernel: Callable[..., Any]) -> Callable[..., Any]:
        return functools.partial(kernel, validate=validate)

    return SparseOps(
        front=sparse_front,
        absorb=absorb_query,
        project=output_projection,
        check_caches=_fast_check_caches,
        slot_mapping=checked(token_slots),
        decode_rows=checked(decode_rows),
        cache_write=checked(concat_and_cache_mla),
        fp8_cache_write=checked(concat_and_cache_fp8_ds_mla),
        rotate=_rotate,
        index_cache_write=checked(indexer_k_quant_and_cache),
        quantize_q=quantize_indexer_q,
        gather_index_keys=checked(gather_indexer_k_cache),
        gather_latent=checked(gather_and_upconvert_fp8_ds_mla),
        paged_logits=checked(fp8_paged_mqa_logits),
        ragged_logits=checked(fp8_mqa_logits),
        top_k=checked(top_k_per_row),
        convert=checked(convert_req_index_to_global_index),
        decode=checked(sparse_mla_decode),
        prefill=checked(sparse_mla_prefill),
        validate=validate)


def _front_and_index(weights: MLAWeights, indexer_weights: IndexerWeights,
                     hidden: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     kv_cache: torch.Tensor, index_k_cache: torch.Tensor, validate: bool
                     ) -> tuple[Front, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's front and cache writes alone (for the benchmarks' and checks' breakdowns):
    the front, the rotated index key, the e4m3 indexer query and its weights."""
    f, qk = front_and_index(fast_sparse_ops(validate), weights, indexer_weights, hidden, slots,
                            positions, kv_cache, index_k_cache, None)
    return f, qk.k_index, qk.q_index, qk.weights


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
    check_float("hidden", hidden, ndim=3)  # before should_validate reads its device
    return run_sparse_decode(fast_sparse_ops(should_validate(validate, hidden)), weights,
                             indexer_weights, hidden, kv_cache, index_k_cache, block_table,
                             cache_seqlens, use_fp8_indexer)


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
    *,
    validate: bool = True,
) -> SparseTrace:
    """``sparse_prefill_forward`` with every stage returned (``SparseTrace``)."""
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
    return run_sparse_prefill(fast_sparse_ops(validate), weights, indexer_weights, hidden,
                              query_start_loc, context_lens, kv_cache, index_k_cache,
                              block_table, use_fp8_indexer)


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
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Sparse prefill of ``hidden [T, H]`` (requests split by ``query_start_loc``) after
    ``context_lens`` cached tokens: as ``mla.reference.sparse_prefill_forward`` on an fp8 index
    key cache. Returns ``[T, H]``.

    The step reads ``query_start_loc`` on the host once (the requests' token counts size the
    gathers). ``validate=False`` skips the kernels' host value checks (block table entries,
    row ranges, indices in range), which would otherwise read device values between kernels;
    pass it only with inputs an engine has already checked."""
    return sparse_prefill_layer(weights, indexer_weights, hidden, query_start_loc,
                                context_lens, kv_cache, index_k_cache, block_table,
                                use_fp8_indexer, validate=validate).out
