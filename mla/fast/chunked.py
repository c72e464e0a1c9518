"""Chunked prefill with cached context, fast: the reference's plan run on the fast pieces.

Same contract as ``mla.reference.chunked.chunked_prefill_attention`` (conventions §7), with the
same ``ChunkPlan`` (a plan is a value; nothing here re-plans):

    (o, lse) = attention(q, new keys, causal)                     suffix, all requests at once
    for chunk c:
        rows       = gather_cache_known(kv_cache, chunk c)        mla.fast.paged_cache
        k_nope, v  = up_project(rows)                             two GEMMs
        (o_c, l_c) = attention(q, chunk keys, non-causal)         all requests at once
        (o, lse)   = merge_attn_states(o_c, l_c, o, lse)          mla.fast.merge

The attention of a ragged batch goes one of two ways (``varlen_route``, measured):
- ``"triton"``: one launch of ``flash_attention_with_lse`` over the whole batch (a request with
  no rows in a chunk gets ``o = 0``, ``lse = -inf``, which the merge passes over): the context
  chunks;
- ``"cudnn"``: one cuDNN call per request (bf16/fp16 on CUDA): the causal new tokens;
- ``"reference"`` on the CPU: the reference's attention per request (the gathers and merges are
  still the Triton kernels, under ``TRITON_INTERPRET=1``).

Host synchronization: ``query_start_loc`` is read on the host once (the checks and the grid need
the query lengths, as in the reference); the chunk offsets come from the plan (host values), so
the gathers read nothing.
"""

from __future__ import annotations

import torch

from mla.fast.attention import cudnn_attention_with_lse, flash_attention_with_lse
from mla.fast.merge import merge_attn_states
from mla.fast.paged_cache import gather_cache_known
from mla.fast.prefill import up_project
from mla.reference.attention import attention_with_lse as _reference_attention
from mla.reference.chunked import ChunkPlan, check_chunked_prefill_args

__all__ = ["chunked_prefill_attention", "varlen_route"]


def varlen_route(device: torch.device, dtype: torch.dtype, causal: bool) -> str:
    """How a ragged batch's attention runs, from the H200 measurements in
    benchmarks/results/prefill/prefill_routes.md (8 requests of 1 to 4096 tokens; 6 requests of 1 to
    2000 queries over 4096-token context chunks):

    - causal (the new tokens among themselves): a cuDNN call per request, 341 TFLOP/s against
      277 for one Triton launch at N = 128 (equal at N = 16: 254 and 261);
    - non-causal (a context chunk): one Triton launch, 351 against 275 at N = 128 and 306
      against 180 at N = 16 (short query runs leave cuDNN's per-call tiles idle).
    """
    if device.type != "cuda" or dtype == torch.float64:
        return "reference"
    if causal and dtype in (torch.float16, torch.bfloat16) and torch.backends.cudnn.is_available():
        return "cudnn"
    return "triton"


def _ragged_attention(route: str, q_nope: torch.Tensor, q_pe: torch.Tensor,
                      k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                      qsl: list[int], ksl: list[int], qsl_dev: torch.Tensor,
                      ksl_dev: torch.Tensor, softmax_scale: float, causal: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``b``'s queries ``qsl[b]:qsl[b+1]`` over its keys ``ksl[b]:ksl[b+1]``."""
    Tk, N, _ = k_nope.shape
    k_pe_heads = k_pe[:, None, :].expand(Tk, N, k_pe.shape[1])
    if route == "triton":
        max_q = max((b - a for a, b in zip(qsl, qsl[1:])), default=0)
        return flash_attention_with_lse(q_nope, q_pe, k_nope, k_pe_heads, v, qsl_dev, ksl_dev,
                                        max_q, softmax_scale, causal)
    q = torch.cat([q_nope, q_pe], dim=-1)
    k = torch.cat([k_nope, k_pe_heads], dim=-1)
    attend = cudnn_attention_with_lse if route == "cudnn" else _reference_attention
    o_parts, lse_parts = [], []
    for b in range(len(qsl) - 1):
        sq, sk = slice(qsl[b], qsl[b + 1]), slice(ksl[b], ksl[b + 1])
        o_b, lse_b = attend(q[sq], k[sk], v[sk], softmax_scale, causal)
        o_parts.append(o_b)
        lse_parts.append(lse_b.float() if route == "cudnn" else lse_b)
    return torch.cat(o_parts, dim=0), torch.cat(lse_parts, dim=1)


def chunked_prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    plan: ChunkPlan,
    W_UK: torch.Tensor,  # noqa: N803
    W_UV: torch.Tensor,  # noqa: N803
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched prefill of new tokens ``[T, ...]`` over their own keys and their cached context.

    As the reference: ``query_start_loc [B+1]`` splits the ``T`` new tokens into requests;
    request ``i`` has ``plan.context_lens[i]`` cached tokens under ``block_table[i]``. Returns
    ``o [T, N, V]`` and ``lse [N, T]``.
    """
    B = len(plan.context_lens)
    qsl = check_chunked_prefill_args(q_nope, q_pe, kv_c, k_pe, query_start_loc, kv_cache,
                                     block_table, B, W_UK, softmax_scale)
    capacity = block_table.shape[1] * kv_cache.shape[1]
    if max(plan.context_lens, default=0) > capacity:
        raise ValueError(f"plan.context_lens {list(plan.context_lens)} exceed block_table's "
                         f"capacity {capacity} tokens")

    Lkv = kv_c.shape[1]
    qsl_dev = query_start_loc.to(torch.int32)

    # suffix: every request's new tokens, causal among themselves, one up-projection for all
    k_nope, v = up_project(kv_c, W_UK, W_UV)
    o, lse = _ragged_attention(varlen_route(q_nope.device, q_nope.dtype, True), q_nope, q_pe,
                               k_nope, k_pe, v, qsl, qsl, qsl_dev, qsl_dev, softmax_scale,
                               causal=True)
    route = varlen_route(q_nope.device, q_nope.dtype, False)

    # prefix: the cached context, chunk by chunk through one workspace
    workspace = kv_cache.new_empty(max(plan.seq_tot, default=0), kv_cache.shape[2])
    for c in range(plan.num_chunks):
        cu = list(plan.cu_seq_lens[c])
        cu_dev = torch.tensor(cu, dtype=torch.int32, device=kv_cache.device)
        starts = torch.tensor(plan.chunk_starts[c], dtype=torch.int32, device=kv_cache.device)
        rows = gather_cache_known(kv_cache, workspace, block_table, cu_dev, B, starts,
                                  plan.seq_tot[c], plan.max_seq_lens[c])
        kv_c_ctx = rows[:, :Lkv].to(q_nope.dtype)
        k_pe_ctx = rows[:, Lkv:].to(q_nope.dtype)
        k_nope_c, v_c = up_project(kv_c_ctx, W_UK, W_UV)
        o_c, lse_c = _ragged_attention(route, q_nope, q_pe, k_nope_c, k_pe_ctx, v_c, qsl, cu,
                                       qsl_dev, cu_dev, softmax_scale, causal=False)
        o, lse = merge_attn_states(o_c, lse_c, o, lse)
    return o, lse
