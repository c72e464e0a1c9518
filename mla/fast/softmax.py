"""Triton device functions shared by the decode and sparse kernels: the masked tile load that
feeds their dots, and one step of the online softmax with its ``P · V``.

(The Gluon sm_90 kernels share theirs in ``mla.fast.sm90.softmax``.)
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["load_2d", "softmax_pv"]


@triton.jit
def load_2d(ptrs, row_mask, col_mask, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """A ``[rows, cols]`` tile, zeros where masked. Row-only masks keep the loads vectorized
    along the contiguous columns; a column mask is needed only when the head dim is not a power
    of two."""
    if MASK_ROWS:
        if MASK_COLS:
            x = tl.load(ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    else:
        if MASK_COLS:
            x = tl.load(ptrs, mask=col_mask[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def softmax_pv(qk, m_i, l_i, acc, v, DOT_PREC: tl.constexpr):
    """Fold one tile into the running softmax: the logits ``qk [M, N]`` (log2 domain, ``-inf``
    where masked) update the running max ``m_i`` and sum ``l_i``, and ``acc += P · v``.
    Returns ``(acc, m_i, l_i)``.

    A row that has seen no key keeps ``m = -inf`` and ``l = 0``: it is shifted by 0 instead, so
    that ``exp2`` gives 0 rather than ``exp2(-inf + inf) = NaN``. A NaN logit is not masked: it
    makes the row's ``l`` NaN, which the kernels' epilogues pass on (``l != 0``: a key was seen).
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, m_new, l_i
