"""The definition: MLA as plain multi-head attention over up-projected keys and values.

conventions §2 (DeepSeek-V2 section 2.1, equations 9-19). For one request of ``S`` tokens at
absolute positions ``positions``:

    k_nope = einsum("sl,lnp->snp", kv_c, W_UK)          [S, N, P]
    v      = einsum("sl,lnv->snv", kv_c, W_UV)          [S, N, V]
    k      = [k_nope, k_pe broadcast to N heads]        [S, N, P+R]
    q      = [q_nope, q_pe]                             [S, N, P+R]
    o      = softmax(scale · q kᵀ, causal by position) v
    out    = o.flatten(-2) @ W_O                        [S, H]

This module deliberately shares no attention code with the rest of the package: it writes the
softmax out with ``torch.softmax`` and a boolean mask, so that every other path is checked
against something independent of it.
"""

from __future__ import annotations

import torch

from mla.reference.front import mla_front
from mla.validation import acc_dtype, check_float, check_index
from mla.weights import MLAWeights

__all__ = ["naive_attention", "naive_forward"]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                    q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """Causal-by-position MHA: ``q [Sq,N,D]``, ``k [Skv,N,D]``, ``v [Skv,N,Dv]`` -> ``[Sq,N,Dv]``.

    A query that sees no key gets zeros.
    """
    check_float("q", q, ndim=3)
    check_float("k", k, shape=[None, q.shape[1], q.shape[2]])
    check_float("v", v, shape=[k.shape[0], q.shape[1], None])
    check_index("q_positions", q_positions, shape=[q.shape[0]])
    check_index("k_positions", k_positions, shape=[k.shape[0]])
    work = acc_dtype(q.dtype)
    scores = torch.einsum("qnd,knd->nqk", q.to(work), k.to(work)) * softmax_scale
    mask = k_positions[None, :] <= q_positions[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    # rows with no key: 0. Chosen by the mask, not by nan_to_num, so that a NaN in the
    # inputs still reaches the output (the oracle must never hide one)
    seen = mask.any(dim=-1)[None, :, None]  # [1, Sq, 1]
    probs = torch.where(seen, torch.softmax(scores, dim=-1), 0.0)
    return torch.einsum("nqk,knv->qnv", probs, v.to(work)).to(q.dtype)


def naive_forward(weights: MLAWeights, hidden: torch.Tensor,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
    """The whole layer for one request, causal over its own tokens: ``[S, H] -> [S, H]``."""
    c = weights.config
    check_float("hidden", hidden, shape=[None, c.hidden_size])
    S, N = hidden.shape[0], c.num_heads
    if positions is None:
        positions = torch.arange(S, device=hidden.device)
    check_index("positions", positions, shape=[S], device=hidden.device)
    f = mla_front(weights, hidden, positions)
    k_nope = torch.einsum("sl,lnp->snp", f.kv_c, weights.W_UK)
    v = torch.einsum("sl,lnv->snv", f.kv_c, weights.W_UV)
    k = torch.cat([k_nope, f.k_pe[:, None, :].expand(S, N, c.qk_rope_head_dim)], dim=-1)
    q = torch.cat([f.q_nope, f.q_pe], dim=-1)
    o = naive_attention(q, k, v, c.softmax_scale, positions, positions)
    return o.flatten(-2) @ weights.W_O
