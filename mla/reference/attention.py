"""Scaled dot-product attention that also returns the log-sum-exp of the logits.

conventions §5. For one query ``i`` and head ``n`` over its visible keys ``j``:

    s_j  = scale · q_i · k_j
    lse  = log Σ_j exp(s_j)                    (natural log)
    o_i  = Σ_j exp(s_j - lse) · v_j

Visibility is decided by absolute positions: with ``causal=True`` query ``i`` sees key ``j``
iff ``k_positions[j] <= q_positions[i]``. The default positions align the last query with the
last key (``q_positions = Skv - Sq + arange(Sq)``, ``k_positions = arange(Skv)``), which is
the convention of FlashAttention and of a prefill whose context precedes the new tokens.

Edge case, decided here: a query with no visible key (or ``Skv = 0``) gets ``o = 0`` and
``lse = -inf``. ``-inf`` is the natural value (the log of an empty sum) and is what the merge
of conventions §6 treats as "no keys"; the FlashMLA-compatible entry points convert it to ``+inf``.

Grouped heads: ``k`` and ``v`` may have ``Nk`` heads with ``N % Nk == 0`` (``Nk = 1`` is the
MQA of the absorbed path, ``Nk = N`` the MHA of the compute-friendly path).
Accumulation is float64 for float64 inputs and float32 otherwise; ``o`` has ``q``'s dtype and
``lse`` the accumulation dtype.
"""

from __future__ import annotations

import torch

from mla.validation import (
    acc_dtype,
    check_float,
    check_index,
    check_same_device,
    check_same_dtype,
    check_scale,
)

__all__ = ["attention_with_lse", "default_positions"]


def default_positions(sq: int, skv: int, device: torch.device) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
    """Bottom-right aligned positions: the last query sits at the last key."""
    k_pos = torch.arange(skv, device=device)
    q_pos = torch.arange(skv - sq, skv, device=device)
    return q_pos, k_pos


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool = False,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [Sq,N,D]``, ``k [Skv,Nk,D]``, ``v [Skv,Nk,Dv]`` -> ``(o [Sq,N,Dv], lse [N,Sq])``."""
    check_float("q", q, ndim=3)
    check_float("k", k, ndim=3)
    check_float("v", v, ndim=3)
    check_same_dtype(q=q, k=k, v=v)
    check_same_device(q=q, k=k, v=v)
    check_scale("softmax_scale", softmax_scale)
    Sq, N, D = q.shape
    Skv, Nk, _ = k.shape
    if k.shape[2] != D:
        raise ValueError(f"k must have head dim {D} (q's), got shape {list(k.shape)}")
    if v.shape[0] != Skv or v.shape[1] != Nk:
        raise ValueError(f"v must have shape [{Skv}, {Nk}, *] (k's tokens and heads), "
                         f"got {list(v.shape)}")
    if N % Nk:
        raise ValueError(f"q's heads ({N}) must be a multiple of k's heads ({Nk})")
    if q_positions is None or k_positions is None:
        dq, dk = default_positions(Sq, Skv, q.device)
        q_positions = dq if q_positions is None else q_positions
        k_positions = dk if k_positions is None else k_positions
    check_index("q_positions", q_positions, shape=[Sq], device=q.device)
    check_index("k_positions", k_positions, shape=[Skv], device=q.device)

    work = acc_dtype(q.dtype)
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    group = N // Nk
    # logits [N, Sq, Skv]; head n uses kv head n // group
    kw = kw.repeat_interleave(group, dim=1)
    vw = vw.repeat_interleave(group, dim=1)
    s = torch.einsum("ind,jnd->nij", qw, kw) * softmax_scale
    if causal:
        visible = k_positions[None, :] <= q_positions[:, None]  # [Sq, Skv]
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1) if Skv else s.new_full((N, Sq), float("-inf"))
    empty = torch.isneginf(lse)
    p = torch.exp(s - torch.where(empty, 0.0, lse)[..., None])  # exp(-inf) = 0 on masked keys
    o = torch.einsum("nij,jnd->ind", p, vw)
    return o.to(q.dtype), lse
