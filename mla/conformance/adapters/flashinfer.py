"""FlashInfer's MLA paged attention (``flashinfer.mla.BatchMLAPagedAttentionWrapper``) as a
conformance target, when ``import flashinfer`` works (``pip install flashinfer-python``; it
compiles its kernels with nvcc at the first ``plan``, so a machine without the CUDA toolkit or
without network for its dependencies gets "unsupported").

``mla_decode_paged`` plans and runs the wrapper as its docstring shows: ragged queries
(``qo_indptr = [0, s_q, 2·s_q, ...]``, ``q_nope [B·s_q, N, Lkv]``, ``q_pe [B·s_q, N, R]``), the
cache split into ``ckv_cache [num_pages, page, Lkv]`` and ``kpe_cache [num_pages, page, R]`` at
``head_dim_v`` (the logits over the whole row are ``q_nope · ckv + q_pe · kpe``, so the split is
exact), the pages of request ``b`` listed in ``kv_indices`` (its first ``ceil(L_b / page)``
block-table entries) with ``kv_indptr`` their prefix sums and ``kv_len_arr = cache_seqlens``,
``causal`` and ``sm_scale`` given to ``plan``, and ``run(..., return_lse=True)``. Its ``out
[B·s_q, N, Lkv]`` and ``lse [B·s_q, N]`` are reshaped to ``[B, s_q, N, Lkv]`` and ``[B, N,
s_q]``.

Conventions from its source, passed through unchanged: the lse is base 2 (``run``'s
``return_lse_base_on_e`` defaults to False in the versions that have it; older ones have only
base 2, a difference the catalogue names (vLLM PR #47079 was that bug); ``causal`` is
FlashInfer's mask aligned at the bottom right (its documentation: the last query sees every
key), as ours. Rows of ``kv_len = 0`` (FlashInfer #3047) are the "empty" topic's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mla.conformance.adapters import import_peer, require_device, require_dtype

__all__ = ["target", "mla_decode_paged"]

PEER = "FlashInfer's BatchMLAPagedAttentionWrapper"
_WORKSPACE_BYTES = 128 * 1024 * 1024  # the size FlashInfer's docstring recommends


def mla_decode_paged(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     cache_seqlens: torch.Tensor, softmax_scale: float, causal: bool = False,
                     head_dim_v: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """``BatchMLAPagedAttentionWrapper`` with ``mla.reference.mla_decode_paged``'s signature."""
    require_device(PEER, "cuda", q=q, kv_cache=kv_cache)
    require_dtype(PEER, (torch.float16, torch.bfloat16), q=q, kv_cache=kv_cache)
    fi = import_peer("flashinfer.mla", PEER, hint="pip install flashinfer-python")
    B, s_q, N, D = q.shape
    page = kv_cache.shape[1]
    dev = q.device
    lens = cache_seqlens.tolist()
    pages = [-(-n // page) for n in lens]
    kv_indices = torch.cat([block_table[b, :p] for b, p in enumerate(pages)]
                           + [block_table.new_zeros(0)]).to(torch.int32)
    kv_indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32,
                             device=dev)
    qo_indptr = torch.arange(B + 1, dtype=torch.int32, device=dev) * s_q
    wrapper = fi.BatchMLAPagedAttentionWrapper(
        torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=dev))
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, cache_seqlens, N, head_dim_v,
                 D - head_dim_v, page, causal, softmax_scale, q.dtype, kv_cache.dtype)
    rows = q.reshape(B * s_q, N, D)
    out, lse = wrapper.run(rows[..., :head_dim_v].contiguous(),
                           rows[..., head_dim_v:].contiguous(),
                           kv_cache[..., :head_dim_v].contiguous(),
                           kv_cache[..., head_dim_v:].contiguous(), return_lse=True)
    return (out.view(B, s_q, N, head_dim_v),
            lse.view(B, s_q, N).permute(0, 2, 1).contiguous())


def target() -> dict[str, Callable]:
    """FlashInfer's MLA paged decode."""
    return {"mla_decode_paged": mla_decode_paged}
