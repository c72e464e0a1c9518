"""Merging two attention results over disjoint key sets through their log-sum-exp.

conventions §6 (vLLM's ``merge_attn_states``; FlashAttention's split-KV combine):

    m   = max(lse_p, lse_s);   w_p = exp(lse_p - m);   w_s = exp(lse_s - m)
    lse = m + log(w_p + w_s)
    o   = (w_p · o_p + w_s · o_s) / (w_p + w_s)

Layouts as vLLM: ``o [T, N, D]``, ``lse [N, T]``.

Edge cases, decided here:
- ``+inf`` and ``-inf`` both mean "this side saw no keys" (FlashAttention versions disagree on
  which one an empty row returns; FlashMLA returns ``+inf``).
- One side empty: the other side's ``o`` and ``lse`` pass through bit for bit, whatever the
  empty side's ``o`` holds (even NaN).
- Both empty: ``o = 0`` and ``lse = -inf``. Never NaN.
- A NaN ``lse`` is not a marker (conventions §13): that side counts as present, so with another
  present side the merged ``o`` and ``lse`` are NaN, and with an empty one it passes through.
The weights are computed in float32 or wider; ``o`` keeps the dtype of ``prefix_output``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mla.validation import acc_dtype, check_float, check_same_device, check_same_dtype

__all__ = ["merge_attn_states", "merge_attn_states_list"]


def _check_pair(o_name: str, o: torch.Tensor, lse_name: str, lse: torch.Tensor) -> None:
    check_float(o_name, o, ndim=3)
    T, N, _ = o.shape
    check_float(lse_name, lse, shape=[N, T])
    check_same_device(**{o_name: o, lse_name: lse})


def merge_attn_states(
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o_p [T,N,D], lse_p [N,T])`` and ``(o_s, lse_s)`` -> ``(output, output_lse)``."""
    _check_pair("prefix_output", prefix_output, "prefix_lse", prefix_lse)
    _check_pair("suffix_output", suffix_output, "suffix_lse", suffix_lse)
    if suffix_output.shape != prefix_output.shape:
        raise ValueError(f"suffix_output must have prefix_output's shape "
                         f"{list(prefix_output.shape)}, got {list(suffix_output.shape)}")
    check_same_device(prefix_output=prefix_output, suffix_output=suffix_output)
    check_same_dtype(prefix_output=prefix_output, suffix_output=suffix_output)
    return merge_attn_states_list([prefix_output, suffix_output], [prefix_lse, suffix_lse])


def merge_attn_states_list(
    outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``K >= 1`` states in one pass.

    ``lse = logsumexp_k lse_k`` and the weights are ``exp(lse_k - lse)``.
    """
    if len(outputs) != len(lses) or not outputs:
        raise ValueError(f"outputs and lses must be non-empty lists of one length, got "
                         f"{len(outputs)} and {len(lses)}")
    for k, (o, lse) in enumerate(zip(outputs, lses)):
        _check_pair(f"outputs[{k}]", o, f"lses[{k}]", lse)
        if o.shape != outputs[0].shape or lse.shape != lses[0].shape:
            raise ValueError(f"outputs[{k}] has shape {list(o.shape)}, expected "
                             f"{list(outputs[0].shape)} like outputs[0]")
        check_same_device(**{"outputs[0]": outputs[0], f"outputs[{k}]": o})
        check_same_dtype(**{"outputs[0]": outputs[0], f"outputs[{k}]": o})
    out_dtype, lse_dtype = outputs[0].dtype, lses[0].dtype
    work = acc_dtype(out_dtype)
    lse_all = torch.stack([lse.to(work) for lse in lses])  # [K, N, T]
    lse_all = torch.where(torch.isinf(lse_all), float("-inf"), lse_all)  # +inf: empty too
    present = ~torch.isneginf(lse_all)
    m = lse_all.max(dim=0).values  # [N, T]
    any_present = ~torch.isneginf(m)
    m_safe = torch.where(any_present, m, 0.0)
    w = torch.where(present, torch.exp(lse_all - m_safe), 0.0)  # [K, N, T]
    w_sum = w.sum(dim=0)
    lse = torch.where(any_present, m_safe + torch.log(torch.where(any_present, w_sum, 1.0)),
                      float("-inf"))
    o = None
    for k, out_k in enumerate(outputs):
        wk = (w[k] / torch.where(any_present, w_sum, 1.0)).transpose(0, 1)[..., None]  # [T,N,1]
        # an empty side (or one whose weight underflowed) contributes exactly nothing, even if
        # its output is garbage; a NaN weight (a NaN lse) contributes NaN
        term = torch.where(wk != 0, out_k.to(work) * wk, 0.0)
        o = term if o is None else o + term
    assert o is not None
    merged = o.to(out_dtype)
    # exact passthrough when only one state is present
    n_present = present.sum(dim=0)  # [N, T]
    for k, out_k in enumerate(outputs):
        only_k = (n_present == 1) & present[k]
        merged = torch.where(only_k.transpose(0, 1)[..., None], out_k, merged)
        lse = torch.where(only_k, lses[k].to(lse.dtype), lse)
    return merged, lse.to(lse_dtype)
