"""FlashMLA (as vendored in vLLM 0.33.0, unpacked by ``benchmarks.peers``) as a conformance target.

``vllm/third_party/flashmla/flash_mla_interface.py`` over ``vllm/_flashmla_C.abi3.so`` (torch's
stable ABI, CUDA 13, SM90 and SM100 kernels):

- ``mla_decode_paged``: ``flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens,
  head_dim_v, sched_meta, None, softmax_scale, causal)`` with ``k_cache =
  kv_cache.unsqueeze(2)`` (FlashMLA's cache is ``[num_blocks, page, h_k = 1, D]``) and a
  fresh ``get_mla_metadata()[0]`` per call (in this version an empty ``FlashMLASchedMeta``
  filled at the first call). Its outputs are ours already: ``out [B, s_q, N, 512]`` and
  ``lse [B, N, s_q]`` float32. What its C++ checks take (csrc ``dense_decode``): SM90 only,
  float16 or bfloat16, head dim 576 (or 512, DeepSeek-V4), ``head_dim_v = 512``, page size 64,
  batch >= 1. It ignores ``causal`` when ``s_q = 1``.
- ``sparse_mla_decode``: the same function with ``indices`` and ``topk_length``; in this
  version the interface asserts ``is_fp8_kvcache`` for sparse decode, so a bf16 cache is
  "unsupported". The fp8_ds_mla cache (656 bytes a row) is passed as ``uint8 [num_blocks,
  page, 1, 656]``, as vLLM does (``.view(torch.uint8).unsqueeze(-2)``).
- ``sparse_mla_prefill``: ``flash_mla_sparse_fwd(q, kv [s_kv, 1, d], indices [s_q, 1, topk],
  sm_scale, d_v, topk_length=...)`` returning ``(out, max_logits, lse)``, bfloat16 only.
- DeepSeek-V4 (conventions §14): ``attn_sink`` (padding heads get ``-inf``, no effect), the
  MODEL1 cache (its ``[num_blocks, page, 584]`` view, ``unsqueeze(2)``, head dim 512) and the
  second scope (``extra_*``, its indices padded as the first's) are passed through;
  ``extra_topk_length`` is refused on sm_90 as ``topk_length`` is.

Layout plumbing, as vLLM's backends do it (``flashmla_sparse.py``), never a change of values:
the sparse kernels take 64 or 128 query heads (and ``topk`` a multiple of the kernel's
``B_TOPK``, 64 or 128), so ``q`` is padded with zero heads to 64 or 128 and the padding heads'
results are sliced off, and ``indices`` is padded with ``-1`` columns (FlashMLA's "no index")
to a multiple of 128, ``topk_length`` unchanged.

The lse, as read in this version's sources and passed through unchanged: natural-log in all
three (the interface calls it "log-sum-exp of attention scores"; FlashMLA's ``tests/ref.py``
computes it with ``torch.logsumexp`` and compares the kernel's to it unconverted; vLLM feeds
the sparse prefill's to its natural-log DCP combine). A query with no valid key: ``out = 0``,
``lse = +inf`` and ``max_logits = -inf`` (``tests/ref.py``'s "lonely q"), the reference's own
convention, which it took from FlashMLA.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from mla.conformance.adapters import import_peer, require, require_device, require_dtype

__all__ = ["target", "mla_decode_paged", "sparse_mla_decode", "sparse_mla_prefill"]

INTERFACE = "vllm.third_party.flashmla.flash_mla_interface"
DENSE = "FlashMLA's flash_mla_with_kvcache (dense)"
SPARSE_DECODE = "FlashMLA's flash_mla_with_kvcache (sparse)"
SPARSE_PREFILL = "FlashMLA's flash_mla_sparse_fwd"
_HEADS = (64, 128)  # what the sparse kernels take (vLLM pads to these)
_TOPK_ALIGN = 128  # a multiple of both kernels' B_TOPK (vLLM's _SPARSE_PREFILL_TOPK_ALIGNMENT)


def _padded_heads(peer: str, n: int) -> int:
    require(n <= _HEADS[-1], peer, f"takes at most {_HEADS[-1]} query heads, got {n}")
    return next(h for h in _HEADS if n <= h)


def _pad_heads(q: torch.Tensor, dim: int, heads: int) -> torch.Tensor:
    """``q`` with zero heads appended along ``dim`` up to ``heads``."""
    n = q.shape[dim]
    if n == heads:
        return q
    shape = list(q.shape)
    shape[dim] = heads - n
    return torch.cat([q, q.new_zeros(shape)], dim=dim)


def _pad_topk(indices: torch.Tensor) -> torch.Tensor:
    """``indices`` with ``-1`` columns appended up to a multiple of ``_TOPK_ALIGN``."""
    topk = indices.shape[-1]
    want = max(_TOPK_ALIGN, -(-topk // _TOPK_ALIGN) * _TOPK_ALIGN)
    if want == topk:
        return indices
    pad = indices.new_full((*indices.shape[:-1], want - topk), -1)
    return torch.cat([indices, pad], dim=-1)


def mla_decode_paged(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     cache_seqlens: torch.Tensor, softmax_scale: float, causal: bool = False,
                     head_dim_v: int = 512, *, batch_invariant: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``flash_mla_with_kvcache`` with ``mla.reference.mla_decode_paged``'s signature
    (``batch_invariant``: its ``enable_batch_invariant``)."""
    require_device(DENSE, "cuda", q=q, kv_cache=kv_cache, block_table=block_table,
                   cache_seqlens=cache_seqlens)
    require_dtype(DENSE, (torch.bfloat16, torch.float16), q=q, kv_cache=kv_cache)
    require(q.shape[-1] in (576, 512), DENSE, f"takes head dim 576 (or 512) only, got "
            f"{q.shape[-1]}")
    require(head_dim_v == 512, DENSE, f"takes head_dim_v = 512 only, got {head_dim_v}")
    require(kv_cache.shape[1] == 64, DENSE, f"takes page size 64 only, got {kv_cache.shape[1]}")
    require(q.shape[0] > 0, DENSE, "takes a batch of at least one request, got 0")
    fm = import_peer(INTERFACE, DENSE)
    sched, _ = fm.get_mla_metadata()
    return fm.flash_mla_with_kvcache(q, kv_cache.unsqueeze(2), block_table, cache_seqlens,
                                     head_dim_v, sched, None, softmax_scale, causal,
                                     enable_batch_invariant=batch_invariant)


def _pad_sink(attn_sink: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """``attn_sink`` with ``-inf`` (no effect) for the padding heads."""
    if attn_sink is None or attn_sink.shape[0] == heads:
        return attn_sink
    pad = attn_sink.new_full((heads - attn_sink.shape[0],), float("-inf"))
    return torch.cat([attn_sink, pad])


def sparse_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                      softmax_scale: float, is_fp8_kvcache: bool,
                      topk_length: torch.Tensor | None = None, head_dim_v: int = 512, *,
                      attn_sink: torch.Tensor | None = None,
                      extra_k_cache: torch.Tensor | None = None,
                      extra_indices_in_kvcache: torch.Tensor | None = None,
                      extra_topk_length: torch.Tensor | None = None,
                      batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse ``flash_mla_with_kvcache`` with ``mla.reference.sparse_mla_decode``'s signature,
    DeepSeek-V4's keywords and ``enable_batch_invariant`` (``batch_invariant``) included (the
    MODEL1 cache is passed as the ``[num_blocks, page, 1, 584]`` view of its pages, as
    FlashMLA's ``quantize_k_cache`` returns it)."""
    require_device(SPARSE_DECODE, "cuda", q=q, kv_cache=kv_cache, indices=indices,
                   topk_length=topk_length)
    require(is_fp8_kvcache, SPARSE_DECODE, "takes the fp8_ds_mla cache only (its interface "
            "asserts is_fp8_kvcache when indices are given)")
    require_dtype(SPARSE_DECODE, (torch.bfloat16,), q=q)
    require((q.shape[-1] == 576 or (q.shape[-1] == 512 and kv_cache.shape[-1] == 584))
            and head_dim_v == 512, SPARSE_DECODE,
            f"takes DeepSeek-V3.2's rows (head dim 576) or MODEL1's (512), head_dim_v 512, got "
            f"{q.shape[-1]} and {head_dim_v}")
    # measured on an H200 (vLLM 0.33.0's build): the sm_90 sparse decode kernel asserts
    # topk_length == nullptr on the host, so it has no topk_length there
    sm90 = torch.cuda.get_device_capability(q.device)[0] == 9
    require((topk_length is None and extra_topk_length is None) or not sm90,
            SPARSE_DECODE, "takes no topk_length on sm_90 (its kernel asserts topk_length "
            "== nullptr)")
    # measured on an H100 (2026-12-06): with enable_batch_invariant its sm_90 sparse decode
    # aborts ("the chosen implementation does not support all required features")
    require(not (batch_invariant and sm90), SPARSE_DECODE,
            "has no batch-invariant mode on sm_90 (its kernel aborts: the chosen "
            "implementation does not support all required features)")
    fm = import_peer(INTERFACE, SPARSE_DECODE)
    N = q.shape[2]
    heads = _padded_heads(SPARSE_DECODE, N)

    def paged(cache: torch.Tensor) -> torch.Tensor:
        k = cache.view(torch.uint8)
        return k.unsqueeze(2) if k.dim() == 3 else k  # [num_blocks, page, 1, row]
    extra = {}
    if extra_k_cache is not None:
        extra = {"extra_k_cache": paged(extra_k_cache),
                 "extra_indices_in_kvcache": _pad_topk(extra_indices_in_kvcache),
                 "extra_topk_length": extra_topk_length}
    sched, _ = fm.get_mla_metadata()
    out, lse = fm.flash_mla_with_kvcache(
        _pad_heads(q, 2, heads), paged(kv_cache), None, None, head_dim_v,
        sched, None, softmax_scale, False, True, _pad_topk(indices), topk_length=topk_length,
        attn_sink=_pad_sink(attn_sink, heads), enable_batch_invariant=batch_invariant, **extra)
    return out[:, :, :N], lse[:, :N]


def sparse_mla_prefill(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                       sm_scale: float, d_v: int = 512,
                       topk_length: torch.Tensor | None = None, *,
                       attn_sink: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``flash_mla_sparse_fwd`` with ``mla.reference.sparse_mla_prefill``'s signature."""
    require_device(SPARSE_PREFILL, "cuda", q=q, kv=kv, indices=indices,
                   topk_length=topk_length)
    require_dtype(SPARSE_PREFILL, (torch.bfloat16,), q=q, kv=kv)
    require(q.shape[-1] in (576, 512) and d_v == 512, SPARSE_PREFILL,
            f"takes head dim 576 (or 512) with d_v 512 only, got {q.shape[-1]} and {d_v}")
    # FlashMLA does not check topk_length against topk: with the padded indices below it
    # would read the padding, unpadded past the array; such inputs are not passed to it
    require(topk_length is None or not topk_length.numel()
            or int(topk_length.max()) <= indices.shape[-1], SPARSE_PREFILL,
            "is not given topk_length past topk: it does not check it and would read past "
            "the index array")
    fm = import_peer(INTERFACE, SPARSE_PREFILL)
    N = q.shape[1]
    kv3 = kv if kv.dim() == 3 else kv.unsqueeze(1)  # [s_kv, h_kv = 1, d]
    idx3 = indices if indices.dim() == 3 else indices.unsqueeze(1)  # [s_q, h_kv = 1, topk]
    heads = _padded_heads(SPARSE_PREFILL, N)
    out, max_logits, lse = fm.flash_mla_sparse_fwd(
        _pad_heads(q, 1, heads), kv3, _pad_topk(idx3), sm_scale, d_v,
        attn_sink=_pad_sink(attn_sink, heads), topk_length=topk_length)
    return out[:, :N], max_logits[:, :N], lse[:, :N]


def target(batch_invariant: bool = False) -> dict[str, Callable]:
    """FlashMLA's dense decode, sparse decode and sparse prefill; with ``batch_invariant``
    its two decodes alone, run with ``enable_batch_invariant=True``."""
    if batch_invariant:
        return {k: functools.partial(fn, batch_invariant=True) for k, fn in
                (("mla_decode_paged", mla_decode_paged),
                 ("sparse_mla_decode", sparse_mla_decode))}
    return {"mla_decode_paged": mla_decode_paged, "sparse_mla_decode": sparse_mla_decode,
            "sparse_mla_prefill": sparse_mla_prefill}
