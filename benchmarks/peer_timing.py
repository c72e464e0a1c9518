"""Other people's decode kernels, set up once per shape the way a serving engine calls them, so
that the benchmarks can time them beside ``mla.fast`` on the same inputs.

- FlashMLA's dense ``flash_mla_with_kvcache`` (vLLM 0.33.0's copy, unpacked by
  ``benchmarks.peers``): "kernel" reuses one scheduler metadata object across calls (an engine
  computes it once per step for every layer; in this version it is filled at the first call),
  "direct" asks ``get_mla_metadata()`` on every call, as a user who calls it once does.
- vLLM's Triton ``decode_attention_fwd`` as ``TritonMLAImpl.forward_mqa`` runs it: the split
  count from the host-known maximum length and the float32 workspace allocated per call (the
  backend allocates it per call too), one query row per request (``s_q > 1`` expanded).

Each builder returns ``None`` with a line on stderr when the peer cannot run the shape (not
unpacked, a page size it does not take, ...). Values are never changed: layouts only, as the
conformance adapters (``mla.conformance.adapters``) document.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.common import log
from mla.conformance.adapters import import_peer
from mla.conformance.adapters.flashmla import INTERFACE
from mla.conformance.adapters.vllm_triton import num_kv_splits
from mla.conformance.catalogue import Unsupported

__all__ = ["flashmla_decode", "vllm_triton_decode"]

Call = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def flashmla_decode(q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor,
                    seqlens: torch.Tensor, scale: float, causal: bool, head_dim_v: int = 512
                    ) -> dict[str, Call] | None:
    """``{"kernel": ..., "direct": ...}`` calls of FlashMLA's dense decode, or ``None``."""
    try:
        fm = import_peer(INTERFACE, "FlashMLA")
    except Unsupported as e:
        log(f"  FlashMLA: {e}")
        return None
    if kv.shape[1] != 64:
        log(f"  FlashMLA: takes page size 64 only, got {kv.shape[1]}")
        return None
    k_cache = kv.unsqueeze(2)
    sched, _ = fm.get_mla_metadata()

    def kernel() -> tuple[torch.Tensor, torch.Tensor]:
        return fm.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, head_dim_v, sched,
                                         None, scale, causal)

    def direct() -> tuple[torch.Tensor, torch.Tensor]:
        meta, _ = fm.get_mla_metadata()
        return fm.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, head_dim_v, meta,
                                         None, scale, causal)
    return {"kernel": kernel, "direct": direct}


def vllm_triton_decode(q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor,
                       seqlens: torch.Tensor, scale: float, causal: bool, head_dim_v: int = 512
                       ) -> dict[str, Call] | None:
    """``{"kernel": ...}``: vLLM's Triton decode as its MLA backend calls it, or ``None``."""
    try:
        mod = import_peer("vllm.v1.attention.ops.triton_decode_attention", "vLLM Triton")
    except Unsupported as e:
        log(f"  vLLM Triton: {e}")
        return None
    B, s_q, N, D = q.shape
    rows = B * s_q
    table, lens = block_table, seqlens
    if s_q > 1:  # the backend's expansion: one row per query token, causal extents
        table = block_table.repeat_interleave(s_q, dim=0)
        if causal:
            offsets = torch.arange(1 - s_q, 1, device=q.device, dtype=seqlens.dtype)
            lens = (seqlens.unsqueeze(1) + offsets).flatten().clamp(min=0)
        else:
            lens = seqlens.repeat_interleave(s_q)
    splits = num_kv_splits(int(seqlens.max()), q.device)  # host metadata in the backend
    k_buffer = kv.unsqueeze(2)
    q_rows = q.reshape(rows, N, D)

    def kernel() -> tuple[torch.Tensor, torch.Tensor]:
        o = torch.empty(rows, N, head_dim_v, dtype=q.dtype, device=q.device)
        lse = torch.empty(rows, N, dtype=torch.float32, device=q.device)
        ws = torch.empty(rows, N, splits, head_dim_v + 1, dtype=torch.float32, device=q.device)
        mod.decode_attention_fwd(q_rows, k_buffer, k_buffer[..., :head_dim_v], o, lse, table,
                                 lens, ws, splits, scale, kv.shape[1], is_mla=True)
        return o.view(B, s_q, N, head_dim_v), lse.view(B, s_q, N).permute(0, 2, 1)
    return {"kernel": kernel}
