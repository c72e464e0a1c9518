"""The end of a split decode: merging each query row's partial ``(o, lse)`` by their lse
(conventions §6), and the attention sink's factor, which is applied once, to the merged row.

- ``combine_kernel``: its own launch, grid ``(s_q · N, B)``, one program per query row (a
  merge by the last split program of each head group, one launch instead of two, measured
  slower on the H200 at every shape: benchmarks/notes/decode.md);
- ``sink_factor``: ``exp(lse) / (exp(lse) + exp(sink))`` per row.

``ORDERED`` (the batch-invariant plans' fixed-length splits): the max and the sum of the
weights run in a sequential loop over the splits, in split order, instead of ``tl.max`` /
``tl.sum`` over a padded power-of-two block, whose pairing of elements may change with the
block's size. A trailing empty split (lse ``-inf``, weight 0) then adds an exact 0 (``x + 0 =
x``), and the max ignores it: a row's bits do not depend on how many splits the grid has.

Partials: ``o [B, splits, rows, DV]`` float32 and ``lse [B, splits, rows]``, ``-inf`` for a
split that saw no key (its ``o`` unwritten), NaN for bad input (the merged row comes out NaN).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["combine_kernel", "sink_factor"]


@triton.jit
def sink_factor(lse, seen, SINK, h, row_ok):
    """``exp(lse) / (exp(lse) + exp(sink))`` per row, as ``1 / (1 + exp(sink - lse))`` (no
    overflow: a large ``sink - lse`` gives 0, a ``+inf`` sink 0, a ``-inf`` one 1); 1 for a
    query with no key (its out stays 0), NaN for a NaN sink (conventions §14)."""
    sink = tl.load(SINK + h, mask=row_ok, other=0.0)
    factor = tl.where(seen, 1.0 / (1.0 + tl.exp(sink - tl.where(seen, lse, 0.0))), 1.0)
    return tl.where(sink != sink, float("nan"), factor)


@triton.jit
def combine_kernel(
    OP, LSEP, O, LSE, SINK, num_splits,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
    N: tl.constexpr, S_Q: tl.constexpr, DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINK: tl.constexpr,
    ORDERED: tl.constexpr,
):
    """Grid ``(s_q · N, B)``: merge one query row's partials by their lse (conventions §6);
    ``ORDERED``: in split order, whatever the number of splits (module docstring)."""
    ROWS: tl.constexpr = S_Q * N
    r = tl.program_id(0)
    b = tl.program_id(1)
    t = (r // N).to(tl.int64)  # int64 addresses, as the decode kernel's
    h = (r % N).to(tl.int64)
    first = b.to(tl.int64) * num_splits
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    if ORDERED:
        m = tl.load(LSEP + first * ROWS + r)
        for s in range(1, num_splits):
            m = tl.maximum(m, tl.load(LSEP + (first + s) * ROWS + r))
        m_use = tl.where(m == float("-inf"), 0.0, m)
        w_sum = tl.zeros_like(m)
        for s in range(num_splits):
            lse_s = tl.load(LSEP + (first + s) * ROWS + r)
            w = tl.exp(lse_s - m_use)
            w_sum += w  # in split order; a NaN partial lse: NaN
            if lse_s > float("-inf"):  # an empty split wrote no o
                o_s = tl.load(OP + ((first + s) * ROWS + r) * DV + offs_dv, mask=dv_mask,
                              other=0.0)
                acc += w * o_s
    else:
        offs_s = tl.arange(0, BLOCK_S)
        lses = tl.load(LSEP + (first + offs_s) * ROWS + r, mask=offs_s < num_splits,
                       other=float("-inf"))
        m = tl.max(lses, 0)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        w_sum = tl.sum(tl.exp(lses - m_use), 0)
        for s in range(num_splits):
            lse_s = tl.load(LSEP + (first + s) * ROWS + r)
            if lse_s > float("-inf"):  # an empty split wrote no o
                o_s = tl.load(OP + ((first + s) * ROWS + r) * DV + offs_dv, mask=dv_mask,
                              other=0.0)
                acc += tl.exp(lse_s - m_use) * o_s
    seen = w_sum != 0.0  # a NaN partial lse makes w_sum NaN: NaN out, not "no key"
    o = acc / tl.where(seen, w_sum, 1.0)
    lse = m_use + tl.log(tl.where(seen, w_sum, 1.0))
    if HAS_SINK:
        o = o * sink_factor(lse, seen, SINK, h, True)
    tl.store(O + b.to(tl.int64) * stride_ob + t * stride_ot + h * stride_oh + offs_dv,
             o.to(O.dtype.element_ty), mask=dv_mask)
    tl.store(LSE + b.to(tl.int64) * stride_lb + h * stride_lh + t,
             tl.where(seen, lse, float("inf")))
