"""Compute-friendly prefill: MHA over up-projected keys (``_forward_prefill`` of vLLM 0.11
``v1/attention/backends/mla/common.py``).

conventions §3. The latent of every key is expanded to per-head keys and values,

    k_nope = einsum("sl,lnp->snp", kv_c, W_UK)          [Skv, N, P]
    v      = einsum("sl,lnv->snv", kv_c, W_UV)          [Skv, N, V]
    k      = [k_nope, k_pe broadcast]                   [Skv, N, P+R]
    (o, lse) = MHA([q_nope, q_pe], k, v)                o [Sq, N, V], lse [N, Sq]

which costs ``N·(P+V)`` numbers per key but keeps the QK dot at ``P+R = 192``: the cheap path in
FLOPs when ``Sq/Skv`` is near 1. The reference needs no V padding (QK 192 vs V 128).
"""

from __future__ import annotations

import torch

from mla.reference.attention import attention_with_lse
from mla.reference.front import mla_front
from mla.validation import check_float, check_index
from mla.weights import MLAWeights

__all__ = ["up_project_kv", "prefill_attention", "prefill_forward"]


def up_project_kv(kv_c: torch.Tensor, k_pe: torch.Tensor, W_UK: torch.Tensor,  # noqa: N803
                  W_UV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: N803
    """``kv_c [S, Lkv]``, ``k_pe [S, R]`` -> per-head ``k [S, N, P+R]`` and ``v [S, N, V]``."""
    check_float("W_UK", W_UK, ndim=3)
    check_float("W_UV", W_UV, shape=[W_UK.shape[0], W_UK.shape[1], None])
    check_float("kv_c", kv_c, shape=[None, W_UK.shape[0]])
    check_float("k_pe", k_pe, shape=[kv_c.shape[0], None])
    S, N = kv_c.shape[0], W_UK.shape[1]
    k_nope = torch.einsum("sl,lnp->snp", kv_c, W_UK)
    v = torch.einsum("sl,lnv->snv", kv_c, W_UV)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(S, N, k_pe.shape[-1])], dim=-1)
    return k, v


def prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    W_UK: torch.Tensor,  # noqa: N803
    W_UV: torch.Tensor,  # noqa: N803
    softmax_scale: float,
    causal: bool = True,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_nope [Sq,N,P]``, ``q_pe [Sq,N,R]`` over keys ``kv_c [Skv,Lkv]``, ``k_pe [Skv,R]``.

    Returns ``o [Sq, N, V]`` and ``lse [N, Sq]``.
    """
    check_float("q_nope", q_nope, shape=[None, W_UK.shape[1], W_UK.shape[2]])
    check_float("q_pe", q_pe, shape=[q_nope.shape[0], q_nope.shape[1], k_pe.shape[-1]])
    k, v = up_project_kv(kv_c, k_pe, W_UK, W_UV)
    q = torch.cat([q_nope, q_pe], dim=-1)
    return attention_with_lse(q, k, v, softmax_scale, causal=causal,
                              q_positions=q_positions, k_positions=k_positions)


def prefill_forward(weights: MLAWeights, hidden: torch.Tensor,
                    positions: torch.Tensor | None = None) -> torch.Tensor:
    """One-shot prefill of one request: ``hidden [S, H] -> [S, H]`` by the compute-friendly path."""
    c = weights.config
    check_float("hidden", hidden, shape=[None, c.hidden_size])
    if positions is None:
        positions = torch.arange(hidden.shape[0], device=hidden.device)
    check_index("positions", positions, shape=[hidden.shape[0]], device=hidden.device)
    f = mla_front(weights, hidden, positions)
    o, _ = prefill_attention(f.q_nope, f.q_pe, f.kv_c, f.k_pe, weights.W_UK, weights.W_UV,
                             c.softmax_scale, causal=True, q_positions=positions,
                             k_positions=positions)
    return o.flatten(-2) @ weights.W_O
