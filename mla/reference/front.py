"""The shared front of both MLA paths: hidden states to queries and the cached latent.

conventions §1 (DeepSeek-V2 section 2.1.2-2.1.3, equations 9-10 and 12-17):

    q_c      = RMSNorm(h_t @ W_DQ)                 [S, Lq]     (V2-Lite: q = h_t @ W_Q)
    q_nope   = (q_c @ W_UQ).view(S, N, P)
    q_pe     = RoPE((q_c @ W_QR).view(S, N, R), positions)
    kv_c     = RMSNorm(h_t @ W_DKV)                [S, Lkv]    the "normed latent": cached
    k_pe     = RoPE(h_t @ W_KR, positions)         [S, R]      one rope key for all heads

``q_b_proj`` holds ``[W_UQ; W_QR]`` per head, so ``(q_c @ q_b_proj.T).view(S, N, P+R)`` splits
into ``q_nope`` and the un-rotated ``q_pe`` along the last dim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mla.reference.rope import apply_rope
from mla.validation import (
    acc_dtype,
    check_float,
    check_index,
    check_same_device,
    check_same_dtype,
)
from mla.weights import MLAWeights

__all__ = ["Front", "rms_norm", "mla_front", "front_and_latent"]


class Front(NamedTuple):
    q_nope: torch.Tensor  # [S, N, P]
    q_pe: torch.Tensor  # [S, N, R], rotated
    kv_c: torch.Tensor  # [S, Lkv], normed
    k_pe: torch.Tensor  # [S, R], rotated


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · x / sqrt(mean(x²) + eps)`` over the last dim, computed in float32 or wider."""
    work = acc_dtype(x.dtype)
    xw = x.to(work)
    y = xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(work)).to(x.dtype)


def mla_front(weights: MLAWeights, hidden: torch.Tensor,
              positions: torch.Tensor) -> Front:
    """``hidden [S, H]`` at absolute ``positions [S]`` -> ``Front(q_nope, q_pe, kv_c, k_pe)``."""
    return front_and_latent(weights, hidden, positions)[0]


def front_and_latent(weights: MLAWeights, hidden: torch.Tensor, positions: torch.Tensor
                     ) -> tuple[Front, torch.Tensor | None]:
    """``mla_front`` and the normed q latent it computed on the way (``q_c = RMSNorm(h @
    W_DQ)``, the indexer's input; ``None`` for a model without one)."""
    c = weights.config
    check_float("hidden", hidden, shape=[None, c.hidden_size])
    check_index("positions", positions, shape=[hidden.shape[0]])
    check_same_device(hidden=hidden, positions=positions, weights=weights.kv_b_proj)
    check_same_dtype(hidden=hidden, weights=weights.kv_b_proj)
    S, N = hidden.shape[0], c.num_heads
    q_c = None
    if weights.q_proj is not None:
        q = hidden @ weights.q_proj.T
    else:
        q_c = rms_norm(hidden @ weights.q_a_proj.T, weights.q_a_layernorm, c.rms_norm_eps)
        q = q_c @ weights.q_b_proj.T
    q_nope, q_pe = q.view(S, N, c.qk_head_dim).split(
        [c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
    kv = hidden @ weights.kv_a_proj_with_mqa.T
    kv_c, k_pe = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
    kv_c = rms_norm(kv_c, weights.kv_a_layernorm, c.rms_norm_eps)
    front = Front(
        q_nope=q_nope.contiguous(),
        q_pe=apply_rope(q_pe, positions, c),
        kv_c=kv_c.contiguous(),
        k_pe=apply_rope(k_pe, positions, c),
    )
    return front, q_c
