"""Attention sinks (DeepSeek-V4, FlashMLA's ``attn_sink``): a per-head logit with no value.

conventions §14. A sink is one more key per head whose logit is ``sink[h]`` and whose value
row is zero. It takes a share of the softmax and gives nothing back, so, with ``lse`` the
log-sum-exp of the real logits,

    out_sink = Σ_j exp(s_j) v_j / (Σ_j exp(s_j) + exp(sink))
             = out · exp(lse) / (exp(lse) + exp(sink))  =  out · σ(lse − sink)

and the returned ``lse`` is the real keys' one, unchanged (FlashMLA's interface: "no effect
on the returned softmax_lse"; so a merge of two states still sees the real keys alone).

Corners, as FlashMLA's ``tests/ref.py`` has them: ``sink = +inf`` gives ``out = 0``,
``sink = -inf`` changes nothing, a query with no key keeps ``out = 0`` and ``lse = +inf``
whatever the sink. One choice is ours: a NaN sink makes that head's ``out`` NaN for every
query, a query with no key included (conventions §13: a NaN is never turned into the zero
of an empty query). FlashMLA's prefill reference does the same; its decode reference zeroes
a keyless query after the sink, so it would give 0 there.
"""

from __future__ import annotations

import torch

from mla.validation import check_tensor

__all__ = ["apply_attn_sink", "check_attn_sink"]


def check_attn_sink(attn_sink: torch.Tensor | None, num_heads: int,
                    device: torch.device) -> None:
    """``attn_sink`` is None or float32 ``[num_heads]`` on ``device`` (FlashMLA's contract)."""
    if attn_sink is None:
        return
    check_tensor("attn_sink", attn_sink, shape=[num_heads], dtype=(torch.float32,))
    if attn_sink.device != device:
        raise ValueError(f"attn_sink is on {attn_sink.device} but q is on {device}")


_VECTOR = 64  # elements: a multiple of every CPU vector width torch uses


def _sigmoid_by_whole_vectors(x: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid`` with every element computed in the vectorized body: on the CPU torch
    rounds an element of a tensor's scalar tail differently from one in its body, so that a
    query's factor would depend on how many other queries share the batch. Padding the flat
    tensor to whole vectors makes an element's value depend on its value alone (a request's
    output the same bits alone or in any batch)."""
    flat = x.reshape(-1)
    pad = (-flat.numel()) % _VECTOR
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return torch.sigmoid(flat)[:x.numel()].view(x.shape)


def apply_attn_sink(out: torch.Tensor, lse: torch.Tensor,
                    attn_sink: torch.Tensor | None) -> torch.Tensor:
    """``out [..., h, d_v]`` times ``σ(lse − sink)`` per head; ``lse [..., h]`` uses ``+inf``
    for a query with no key (FlashMLA's convention). Computed in ``lse``'s dtype, returned in
    ``out``'s."""
    if attn_sink is None:
        return out
    sink = attn_sink.to(lse.dtype)
    factor = _sigmoid_by_whole_vectors(lse - sink)  # σ(-inf) = 0 (+inf sink), σ(+inf) = 1
    # no key: out is already 0 (and σ(+inf − +inf) would be NaN)
    factor = torch.where(torch.isposinf(lse), 1.0, factor)
    factor = torch.where(torch.isnan(sink), float("nan"), factor)
    return (out.to(lse.dtype) * factor[..., None]).to(out.dtype)
