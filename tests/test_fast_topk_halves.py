"""``mla.fast.top_k_per_row`` on logits past the list up to twice it, the rows held by halves
(``mla.fast.topk.halves``, ``TopkPlan(halves=True)``): exact against the reference, in column
order, where the halves' cuts are easy (random rows), where they run to the exact boundary (a
tied cut past half the list) and where the row's best all sit in one half; rows of every length
up to the width; a replay of the same launches (the arrivals cleared); the route's limits. The
cut itself (``_quad_search`` stopping at ``enough``): ``tests/test_topk_search.py``.
"""

from __future__ import annotations

import pytest
import torch
from test_fast_topk import DEVICE, _check, _full, _gen, _on, _rows

from mla.fast.topk import CANDIDATES, TopkPlan, launches, survivors

HALF = CANDIDATES // 2
HALVES = TopkPlan(halves=True)  # "auto" with the halves (not yet the default)


def _in_column_order(got: torch.Tensor) -> bool:
    kept = got >= 0
    return bool(((got[:, 1:] > got[:, :-1]) | ~kept[:, 1:]).all())


@pytest.mark.parametrize("width", [CANDIDATES + 1, CANDIDATES + 77, 2 * CANDIDATES])
@pytest.mark.parametrize("topk", [1, 2048, HALF])
def test_halves_random_rows(width, topk):
    """Random rows of the whole width, of one key less (an odd split), from column 3, and
    rows of at most the list (held whole by half 0), of ``topk`` keys and of none: exact, in
    column order, ``-1`` past a short row."""
    starts = [0, 0, 3, 0, 5, 0]
    ends = [width, width - 1, width, CANDIDATES, 5 + topk, 0]
    logits, st, en = _rows(_gen(width + topk), starts, ends, width)
    got = _check(logits, st, en, topk, HALVES)
    assert _in_column_order(got), "not in column order"
    assert HALVES.route_for(len(starts), width, torch.device(DEVICE), topk) == "halves"


def test_halves_cut_tied_past_half_the_list():
    """Half 0 all one value (its cut cannot stop before the exact boundary: every key ties,
    ``CAP`` of them), half 1 random below it; a row whose boundary value is tied across both
    halves (the lowest columns are half 0's); a row all equal (columns 0 to topk - 1)."""
    width = 2 * CANDIDATES - 6
    logits, st, en = _full(torch.randn(3, width, generator=_gen(81)))
    logits[0, :width // 2] = 5.0
    logits[0, width // 2:] = logits[0, width // 2:].clamp(max=4.0)
    logits[1] = (logits[1] * 3).round() / 3  # ~20 values: the boundary's run spans both halves
    logits[2] = -2.5
    got = _check(logits, st, en, 2048, HALVES)
    assert _in_column_order(got)
    assert torch.equal(got[0].cpu(), torch.arange(2048, dtype=torch.int32))
    assert torch.equal(got[2].cpu(), torch.arange(2048, dtype=torch.int32))


def test_halves_best_all_in_one_half():
    """The row's 2048 best all in half 1 (half 0's cut lists 2048 keys that none of are
    taken), then all in half 0; with NaN (above every number), infinities and signed zeros."""
    width = CANDIDATES + 1000
    logits, st, en = _full(torch.randn(2, width, generator=_gen(82)))
    logits[0, width // 2 + 7:] += 100.0
    logits[1, :width // 2] += 100.0
    logits[0, 10:14] = torch.tensor([float("nan"), float("inf"), -0.0, 0.0])
    logits[1, width - 4:] = torch.tensor([float("nan"), -float("inf"), 0.0, -0.0])
    got = _check(logits, st, en, 2048, HALVES).cpu()
    assert _in_column_order(got)
    assert got[0, :2].tolist() == [10, 11] and int(got[0, 2:].min()) >= width // 2 + 7
    assert int(got[1, -1]) == width - 4 and int(got[1, :-1].max()) < width // 2


def test_halves_replayed():
    """The same launches run twice on the same buffers (as a CUDA graph replays them): the
    last half to arrive clears the row's arrivals, so the second run selects again and agrees,
    and the rows' survivor counts (both lists) are stored for ``survivors``."""
    width = CANDIDATES + 300
    logits, st, en = _rows(_gen(83), [0, 2, 0], [width, width - 9, 4000], width)
    x, s0, e0 = _on((logits, st, en))
    out = torch.full((3, 2048), -7, dtype=torch.int32, device=DEVICE)
    work, steps = launches(x, s0, e0, out, 2048, HALVES)
    assert len(steps) == 1 and work.shape[1] > 0
    steps[0]()
    first = out.clone()
    out.fill_(-7)
    steps[0]()
    assert torch.equal(out, first)
    s = survivors(work).cpu().tolist()
    assert all(2 * 2048 <= c <= CANDIDATES for c in s[:2]), s


def test_halves_route_limits():
    """``route="halves"`` named where the logits are wider than twice the list or ``topk``
    is past half of it: a ``ValueError`` naming both; the default plan keeps the general
    route."""
    x = torch.zeros(1, 2 * CANDIDATES + 1, device=DEVICE)
    s0 = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    e0 = torch.full((1,), x.shape[1], dtype=torch.int32, device=DEVICE)
    out = torch.empty(1, HALF + 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="route='halves'.*width 16385 and topk 2048"):
        launches(x, s0, e0, out[:, :2048], 2048, TopkPlan(route="halves"))
    with pytest.raises(ValueError, match="width 9000 and topk 4097"):
        launches(x[:, :9000], s0, e0, out, HALF + 1, TopkPlan(route="halves"))
    with pytest.raises(TypeError, match="halves"):
        TopkPlan(halves=1)
    assert TopkPlan().route_for(1, CANDIDATES + 1, x.device, 2048) == "one"
