"""The halves kernel of ``mla.fast.top_k_per_row``: rows of up to twice the candidate list,
each held by two programs, one a half (the plan, the route and the semantics:
``mla.fast.topk``; the shared pieces: ``mla.fast.topk.kernels``).

A decode row just past the list (the cache's 8192 keys and the new token: 8193) is too long to
hold whole in one program's registers at 8 warps, and the general route (a threshold estimated
from a sample, a marking read, a list, a select) takes about twice what holding it whole does.
Here each half of the row (at most ``CAP`` keys) is held by its own program, as a row held
whole is, and cut down without an estimate: its search stops at the first bracket whose lower
end ``a`` at most ``CAP / 2`` of the half's keys reach (``enough``), and at least ``need`` do,
so every key of the half that is among the row's ``need`` best reaches ``a`` (a key that
``need`` of the half's keys beat is beaten by ``need`` of the row's). The half lists those
keys with their columns, in column order; where a tied ``a`` puts more than ``CAP / 2`` keys
there, the search has run to the exact boundary and the half lists exactly its ``need`` best
(the lowest columns of the ties: every one of the row's ``need`` best in the half is among
them). The halves arrive by one atomic; the last holds both lists (at most ``CAP`` items,
column order kept: half 0's columns are below half 1's) and selects the row's exact ``need``
best as a row held whole is selected (``_column_order_places``), the columns read back only
for the items taken. A row of at most ``CAP`` keys is listed by half 0 alone (half 1 lists
nothing), so every row takes the same two rounds.

The kernel is kept small: with a third pass for rows of at most ``CAP`` keys (selected whole
by half 0, as a held row), it compiled for sm_90 to about 17,400 SASS instructions (280 KB,
four times the held rows' kernel) and took 53-70 us at 1-256 rows of 8193 and 16K keys on an
H100 (2026-12-07), about the same at every row count, against the general route's 22-42
(``benchmarks/notes/topk.md``): a fixed cost, as of code fetched from memory after the
benchmark's L2 flush. In two passes it compiles to about 11,700 (217 registers uncapped, 128
capped, no stack). A loop of two turns sharing one search and one scan compiled to about
7,100 but kept 56 bytes of stack uncapped and 336 capped.

On random rows a half's search stops after the normal guess's one step, and the last half's
exact search over about 6200 items takes about 3 steps (a numpy model of the rule). Needs
``topk <= CAP / 2`` (the two lists fit one); ``launches`` routes nothing else here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mla.fast.topk.kernels import (
    _column_order_places,
    _order_keys,
    _row_range,
    _work_row,
    _write_tail,
)
from mla.fast.topk.search import _search, _unsigned


@triton.jit
def _halves_kernel(logits, starts, ends, work, sync, out, W, topk, s_l_r, s_o_r,
                   CAP: tl.constexpr, SMALL: tl.constexpr, OUT_BLOCK: tl.constexpr,
                   QUAD: tl.constexpr):
    """Programs ``(row, half)`` over logits at most ``2 * CAP`` wide, ``topk <= CAP / 2``.
    Half ``h`` holds the row's keys ``[h * m0, ...)`` (``m0``: the first half's length,
    ``ceil(n / 2)``, or ``n`` where the row has at most ``CAP`` keys), lists the keys that its
    cut reaches (module docstring) in ``work``'s list at ``h * CAP / 2`` (keys, then columns
    ``CAP`` further on), their count in the row's ``few`` space, and arrives on ``sync[row]``
    (zeroed by the caller before the first launch); the last to arrive selects from both
    lists, stores their total as the row's survivor count, ``-1`` past its ``topk`` (a row of
    fewer keys) and zeroes ``sync[row]`` for the next launch (a CUDA graph's replays)."""
    LIMIT: tl.constexpr = CAP // 2
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    start, end, n = _row_range(starts, ends, row, W)
    src = logits + row * s_l_r + start
    dst = out + row * s_o_r
    list_keys, list_cols, few, _thresh, count = _work_row(work, row, CAP, SMALL)
    counts = few.to(tl.pointer_type(tl.int32))
    m0 = tl.where(n <= CAP, n, (n + 1) // 2)
    lo = h * m0
    m = tl.maximum(tl.minimum(m0, n - lo), 0)
    i = tl.arange(0, CAP)
    live = i < m
    x = tl.load(src + lo + i, mask=live, other=0.0)
    u = tl.where(live, _unsigned(_order_keys(x)), 0)
    need = tl.minimum(topk, m).to(tl.int32)
    p, reach = _search(u, need, QUAD, LIMIT)
    listed = tl.where(reach <= LIMIT, reach, need)
    take, pos = _column_order_places(u, p, reach, listed)
    tl.store(list_keys + h * LIMIT + pos, u.to(tl.int32, bitcast=True), mask=take)
    tl.store(list_cols + h * LIMIT + pos, (lo + i).to(tl.int32), mask=take)
    tl.store(counts + h, listed)
    tl.debug_barrier()  # the half's list stored by every thread before it arrives
    if tl.atomic_add(sync + row, 1, sem="acq_rel") == 1:
        tl.debug_barrier()  # every thread past the arrival before any reads the lists
        # the last half's items: both lists, half 1's after half 0's (place LIMIT on)
        c0 = tl.load(counts)
        total = c0 + tl.load(counts + 1)
        at = tl.where(i < c0, i, LIMIT + i - c0)
        w = tl.load(list_keys + at, mask=i < total, other=0).to(tl.uint32, bitcast=True)
        need = tl.minimum(topk, total).to(tl.int32)
        q, q_reach = _search(w, need, QUAD, need)
        take, pos = _column_order_places(w, q, q_reach, need)
        # the columns taken, read back from the list (their places computed anew here, not
        # held through the search)
        at = i + tl.where(i < c0, 0, LIMIT - c0)
        tl.store(dst + pos, tl.load(list_cols + at, mask=take, other=0), mask=take)
        tl.store(count, total)
        _write_tail(dst, total, topk, OUT_BLOCK)
        tl.store(sync + row, 0)
