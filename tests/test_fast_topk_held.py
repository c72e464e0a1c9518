"""``mla.fast.top_k_per_row`` on rows held whole (logits no wider than ``CANDIDATES``: one
kernel a row, ``_held_kernel``) under every ``TopkPlan`` choice of theirs: the columns written
from registers or by a second read in tiles, either boundary search, the row prefetched or its
range read first, the registers capped. Exact against the reference, in column order, on tied,
all-equal, ragged and special rows and on a view of wider storage; the same hard rows just past
the held width, not held. The helpers and the other paths: ``tests/test_fast_topk.py``.
"""

from __future__ import annotations

import pytest
import torch
from test_fast_topk import DEVICE, _check, _check_paths, _full, _gen, _on, _rows

import mla.reference as ref
from mla.conformance.cases.indexer import as_sets
from mla.fast.topk import CANDIDATES, TopkPlan, launches, top_k_per_row

HELD_PLANS = {"registers, quad": TopkPlan(),
              "registers, bracket": TopkPlan(held_search="bracket"),
              "tiles, quad": TopkPlan(held_write="tiles"),
              "tiles, bracket": TopkPlan(held_write="tiles", held_search="bracket"),
              "registers, no prefetch": TopkPlan(held_prefetch=False)}


def _hard_rows(seed: int, width: int, last: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``width`` keys for ``topk = 2048``: random (0), a tied boundary starting at
    column 3 (1), 2048 and 2049 keys (2, 3), specials (4), all equal (5), a row ending at
    ``last[0]`` whose ``topk``-th key is tied with most of its lower half (1548 keys above,
    the 500 lowest ties taken: 6), then rows of random keys from column 1 to each further end
    in ``last``."""
    starts = [0, 3, 0, 0, 0, 0, 0] + [1] * (len(last) - 1)
    ends = [width, width - 1, 2048, 2049, width, width, *last]
    logits, st, en = _rows(_gen(seed), starts, ends, width)
    logits[1] = (logits[1] * 40).round() / 40
    logits[4, :7] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0,
                                  float("nan"), 1e30])
    logits[5] = 0.25
    logits[6] = -1.0
    logits[6, 1:3096:2] = torch.rand(1548, generator=_gen(seed + 1)) + 1.0
    return logits, st, en


@pytest.mark.parametrize("plan", HELD_PLANS)
def test_topk_held_with_columns_or_in_tiles(plan):
    """A row of ``CANDIDATES // 2`` keys is selected with its columns held beside its keys, a
    row of one more with its columns written from the held keys or (``held_write="tiles"``)
    by a second read in tiles, its boundary found by either search: exact, with the
    boundary key distinct and tied (a few hundred distinct values), in column order."""
    half = CANDIDATES // 2
    logits, st, en = _rows(_gen(50), [0, 0, 1, 0], [half, half + 1, half + 1, half + 1],
                           half + 1)
    logits[2:] = (logits[2:] * 40).round() / 40
    paths, got = _check_paths(logits, st, en, 2048, HELD_PLANS[plan])
    assert paths == ["direct"] * 4
    assert bool((got[:, 1:] > got[:, :-1]).all()), "a row held whole comes in column order"


@pytest.mark.parametrize("plan", HELD_PLANS)
def test_held_rows_at_the_widest(plan):
    """Rows held whole at ``CANDIDATES`` keys, every write and search: exact with distinct
    and tied boundaries, ragged ranges, a row of ``topk`` keys, one of ``topk + 1``, one of
    specials, one all equal (every key tied: the ``topk`` lowest columns) and one whose
    ``topk``-th key is tied with most of the row's lower half, in column order."""
    width = CANDIDATES
    logits, st, en = _hard_rows(71, width, [width - 9])
    got = _check(logits, st, en, 2048, HELD_PLANS[plan])
    assert bool((got[:, 1:] > got[:, :-1])[[0, 1, 4, 5, 6]].all()), "not in column order"
    assert torch.equal(got[5].cpu(), torch.arange(2048, dtype=torch.int32))


@pytest.mark.parametrize("plan", HELD_PLANS)
def test_held_rows_of_a_view(plan):
    """Logits that are a view of wider storage, three columns in (the row's first key, and
    the row stride, not 16-byte aligned: a prefetched row is read in 4-byte loads), ragged
    ranges with NaN outside them, a row past ``CANDIDATES // 2``: exact."""
    width = CANDIDATES - 1
    starts, ends = [0, 5, 1000], [width, width - 20, 3100]
    logits, st, en = _rows(_gen(74), starts, ends, width)
    logits[2] = (logits[2] * 40).round() / 40  # a tied boundary
    want = ref.top_k_per_row(logits, st, en, 2048)
    wide = torch.full((3, width + 7), float("nan"), device=DEVICE)
    view = wide[:, 3:3 + width]
    view.copy_(logits.to(DEVICE))
    assert view.data_ptr() % 16 and view.stride(0) % 4
    got = top_k_per_row(view, *_on((st, en)), 2048, plan=HELD_PLANS[plan]).cpu()
    assert torch.equal(as_sets(got), as_sets(want))


@pytest.mark.parametrize("width", [CANDIDATES + 1, 2 * CANDIDATES])
def test_rows_just_past_the_held_width(width):
    """Logits of one key past the list (a decode row of 8K + 1) and of twice it are not held
    whole (scratch is allocated: the estimate, filter and select run): exact with distinct
    and tied boundaries, ragged ranges, a row of ``topk`` keys and one of ``topk + 1``,
    specials, a row all equal (the ``topk`` lowest columns) and one whose ``topk``-th key is
    tied with most of its lower half."""
    logits, st, en = _hard_rows(75, width, [width, width - 2])
    plan = TopkPlan()
    got = _check(logits, st, en, 2048, plan)
    assert torch.equal(got[5].sort().values.cpu(), torch.arange(2048, dtype=torch.int32))
    x, s0, e0 = _on((logits, st, en))
    out = torch.empty(8, 2048, dtype=torch.int32, device=DEVICE)
    work, _steps = launches(x, s0, e0, out, 2048, plan)
    assert work.shape[1] > 0, work.shape


def test_held_plan_checks():
    """``held_write``, ``held_search``, ``held_maxnreg`` and ``held_prefetch`` reject what
    they cannot run."""
    for kwargs, name in (({"held_write": "tiled"}, "held_write"),
                         ({"held_search": "radix"}, "held_search"),
                         ({"held_maxnreg": 16}, "held_maxnreg"),
                         ({"held_maxnreg": True}, "held_maxnreg")):
        with pytest.raises(ValueError, match=name):
            TopkPlan(**kwargs)
    with pytest.raises(TypeError, match="held_prefetch"):
        TopkPlan(held_prefetch=1)


def test_held_rows_with_their_registers_capped():
    """``TopkPlan(held_maxnreg=128)``: where the rows outnumber the SMs (2 x SMs + 1 rows of
    ``CANDIDATES`` on a GPU; 4 rows under the interpreter, which takes no compiler option)
    the held kernel runs with its registers capped, its sets exact (distinct and tied)."""
    rows = 2 * torch.cuda.get_device_properties(0).multi_processor_count + 1 \
        if DEVICE == "cuda" else 4
    logits = torch.randn(rows, CANDIDATES, generator=_gen(73))
    logits[1::2] = (logits[1::2] * 40).round() / 40
    _check(*_full(logits), 2048, TopkPlan(held_maxnreg=128))
