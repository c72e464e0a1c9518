"""``mla.fast.top_k_per_row`` against ``mla.reference.top_k_per_row``: the sets exactly, on every
path the kernels take (a row selected directly, a row's candidate list, a row scanned because
its threshold failed) and on the rows that make each one hard.

Under ``TRITON_INTERPRET=1`` on the CPU (conftest sets it without a GPU) with small shapes; the
same tests run compiled on a GPU. ``benchmarks/topk_sweep.py`` repeats the adversarial cases at
the benchmark's shapes on the GPU. Rows held whole under each of their plans:
``tests/test_fast_topk_held.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from _compiled import compiled

import mla.reference as ref
from mla.conformance.cases.indexer import as_sets
from mla.fast import topk as fast_topk
from mla.fast.topk import (
    CANDIDATES,
    TopkPlan,
    launches,
    sample_columns,
    survivors,
    top_k_per_row,
)
from mla.fast.topk.kernels import _key_floor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LONG = CANDIDATES + 3000  # a row longer than the candidate list: estimated, then filtered
# each route at every row count: one launch; two (the estimate, then parts marking, listing and
# the last selecting, 4096 keys a part here); three (estimate, filter, select)
ROUTES = {"one": TopkPlan(route="one"), "two": TopkPlan(route="two", two_chunk=2048),
          "three": TopkPlan(route="three")}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _on(args: tuple) -> tuple:
    return tuple(a.to(DEVICE) for a in args)


def _check(logits: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, topk: int,
           plan: TopkPlan | None = None) -> torch.Tensor:
    """The fast set equals the reference's (no index twice, ``-1`` only after the set)."""
    want = ref.top_k_per_row(logits.float(), starts, ends, topk)
    got = top_k_per_row(*_on((logits, starts, ends)), topk, plan=plan).cpu()
    assert got.dtype == torch.int32 and got.shape == want.shape
    assert torch.equal(as_sets(got), as_sets(want)), "top-k sets differ"
    kept = (got >= 0).sum(1)
    assert torch.equal(got >= 0, torch.arange(topk)[None, :] < kept[:, None]), "-1 inside"
    return got


def _paths(logits: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, topk: int,
           plan: TopkPlan | None = None) -> list[str]:
    """Which path each row takes: ``direct``, ``listed`` or ``scanned`` (``survivors``)."""
    logits, starts, ends = _on((logits.float(), starts, ends))
    out = torch.empty(len(starts), topk, dtype=torch.int32, device=DEVICE)
    work, steps = launches(logits, starts, ends, out, topk, plan or TopkPlan())
    for step in steps:
        step()
    return _read_paths(work, starts, ends, topk)


def _read_paths(work: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                topk: int) -> list[str]:
    cap, s = CANDIDATES, survivors(work).cpu().tolist()
    n = (ends - starts).cpu().tolist()
    return ["direct" if n[r] <= cap else "listed" if topk <= s[r] <= cap else "scanned"
            for r in range(len(n))]


def _check_paths(logits: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, topk: int,
                 plan: TopkPlan | None = None) -> tuple[list[str], torch.Tensor]:
    """``_paths`` and ``_check`` of one run: ``top_k_per_row`` (``_check``, every assertion of
    it) with the scratch of the ``launches`` it calls kept (``_checked_work``), from which
    each row's path is read as ``_paths`` reads it. The same launches on the same inputs as
    ``_paths`` runs, run once rather than once for the paths and again for the set."""
    work, got = _checked_work(logits, starts, ends, topk, plan)
    return _read_paths(work, starts, ends, topk), got


def _checked_work(logits: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, topk: int,
                  plan: TopkPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``_check``'s run and the scratch of the one ``launches`` it called (the survivor
    counts: ``survivors``)."""
    works = []
    real = fast_topk.launches

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        work, steps = real(*args, **kwargs)
        works.append(work)
        return work, steps

    fast_topk.launches = recording
    try:
        got = _check(logits, starts, ends, topk, plan)
    finally:
        fast_topk.launches = real
    (work,) = works
    return work, got


def _rows(g: torch.Generator, starts: list[int], ends: list[int], width: int,
          ties: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random logits with NaN outside each row's range (never read)."""
    logits = torch.randn(len(starts), width, generator=g)
    if ties:  # a few hundred distinct values: the k-th place sits inside a run of equals
        logits = (logits * 40).round() / 40
    st, en = torch.tensor(starts), torch.tensor(ends)
    cols = torch.arange(width)[None, :]
    logits = logits.masked_fill((cols < st[:, None]) | (cols >= en[:, None]), float("nan"))
    return logits, st.to(torch.int32), en.to(torch.int32)


def _full(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    R, W = logits.shape
    return logits, torch.zeros(R, dtype=torch.int32), torch.full((R,), W, dtype=torch.int32)


@pytest.mark.parametrize("starts,ends,width,topk,ties", [
    ([0, 0, 0], [4100, 2049, 4000], 4105, 2048, False),
    ([0, 0, 0, 0], [0, 1, 2047, 2048], 2050, 2048, False),   # fewer keys than k, and none
    ([0, 0, 0], [3000, 2600, 4100], 4100, 2048, True),      # ties at the boundary
    ([17, 90, 3], [2517, 100, 2051], 2600, 2048, False),    # row offsets: request-local
    ([5, 0], [700, 333], 800, 7, True),                     # small k among ties
    ([0], [1], 1, 1, False),
    ([0, 13, 1001], [LONG, LONG - 5, LONG + 77], LONG + 90, 2048, False),  # filtered rows
    ([3, 0], [LONG + 3, LONG], LONG + 16, 2048, True),      # filtered, ties at the boundary
    ([0, 7], [LONG, LONG + 7], LONG + 7, 1, False),         # filtered, k = 1
])
@pytest.mark.parametrize("route", ROUTES)
def test_topk_sets(starts, ends, width, topk, ties, route):
    _check(*_rows(_gen(width + topk), starts, ends, width, ties), topk, ROUTES[route])


@pytest.mark.parametrize("route", ROUTES)
def test_topk_paths(route):
    """Each path is taken where the module doc says, and each gives the reference's set: a
    short row directly, a random long row from its candidate list, a long row of equal keys (the
    list overflows) and a long row whose sampled columns hold its highest values (too few
    survive) by the scan."""
    logits, st, en = _full(torch.randn(4, LONG, generator=_gen(30)))
    en[0] = CANDIDATES
    logits[2] = 0.5
    sampled = sample_columns(LONG, TopkPlan().sample_runs_for(LONG, 2048))
    logits[3, sampled] = 100.0 + torch.rand(len(sampled), generator=_gen(31))
    plan = ROUTES[route]
    assert _check_paths(logits, st, en, 2048, plan)[0] == ["direct", "listed", "scanned", "scanned"]


@pytest.mark.parametrize("route", ROUTES)
def test_topk_samples_where_the_plan_says(route):
    """A plan's own sample layout (``sample_runs`` runs of ``sample_run``) is the one
    ``sample_columns`` names: the row whose columns there hold its highest values is scanned
    (too few keys reach the threshold), under the default layout it is listed."""
    logits, st, en = _full(torch.randn(2, LONG, generator=_gen(32)))
    plan = dataclasses.replace(ROUTES[route], sample_runs=256, sample_run=32, sample_rank=1000)
    assert plan.sample_runs_for(LONG, 2048) == 256
    planted = sample_columns(LONG, 256, 32)
    logits[1, planted] = 100.0 + torch.rand(len(planted), generator=_gen(33))
    assert _check_paths(logits, st, en, 2048, plan)[0] == ["listed", "scanned"]
    assert _paths(logits, st, en, 2048, ROUTES[route]) == ["listed", "listed"]


@pytest.mark.skipif(DEVICE == "cpu", reason="a dependent launch needs a GPU (none here)")
def test_topk_filter_launched_as_dependent():
    """On sm_90 and later the three launches' filter is the estimate's programmatic dependent
    (its compiled kernel launched with ``launch_pdl``), the select not; off with ``pdl=False``;
    the sets exact either way."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    logits, st, en = _rows(_gen(34), [0, 11], [LONG, LONG - 3], LONG)
    for pdl in (True, False):
        _check(logits, st, en, 2048, TopkPlan(route="three", pdl=pdl))
        kept = {name: {k.metadata.launch_pdl for key, k in launcher.compiled.items()
                       if key[1][0][0] == TopkPlan(route="three", pdl=pdl)}
                for name, launcher in (("filter", fast_topk._mask),
                                       ("select", fast_topk._select))}
        assert kept == {"filter": {pdl}, "select": {False}}, kept


@pytest.mark.parametrize("route", ROUTES)
def test_topk_rows_held_whole_run_one_kernel(route):
    """Logits no wider than the list: every route runs the held rows' kernel alone (one
    launch), exact at widths held with their columns and in tiles, with ragged ranges and a
    row of ``topk`` keys or fewer; one column wider, the route's own launches run."""
    for width in (300, CANDIDATES // 2, CANDIDATES):
        ends = [width, width, min(2048, width), width - 5]
        logits, st, en = _rows(_gen(width), [0, 7, 0, 0], ends, width)
        logits[3] = (logits[3] * 30).round() / 30  # a tied boundary
        out = torch.empty(4, 2048, dtype=torch.int32, device=DEVICE)
        _work, steps = launches(*_on((logits, st, en)), out, 2048, ROUTES[route])
        assert len(steps) == 1
        _check(logits, st, en, 2048, ROUTES[route])
    logits, st, en = _full(torch.randn(1, CANDIDATES + 1, generator=_gen(60)))
    out = torch.empty(1, 2048, dtype=torch.int32, device=DEVICE)
    _work, steps = launches(*_on((logits, st, en)), out, 2048, ROUTES[route])
    assert len(steps) == {"one": 1, "two": 2, "three": 3}[route]


@pytest.mark.parametrize("ties", [False, True])
def test_topk_rows_held_by_a_bound_in_wider_logits(ties):
    """``max_row_len`` (serving's decode logits are ``max_model_len`` wide, the rows shorter):
    rows no longer than the bound in logits wider than the list run the held rows' kernel
    alone (one launch, no list), exact from column 0 and from unaligned starts, below and at
    the bound, with a tied boundary and a row of fewer keys than k. Unvalidated, rows past
    the bound are still exact: one the held columns cover from its aligned start, one within
    3 keys of them from an unaligned start and one past them (both scanned); validated, a
    row past the bound is a ``ValueError``."""
    W, bound = CANDIDATES + 3000, 3000  # rows held in 4096 registers' worth of columns
    starts = [0, 5, 7001, 9, 1, 3, 0, 100]
    ends = [3000, 2505, 10001, 1500, 4096, 4099, 5000, 100]
    logits, st, en = _rows(_gen(70 + ties), starts, ends, W, ties)
    out = torch.empty(len(starts), 2048, dtype=torch.int32, device=DEVICE)
    work, steps = launches(*_on((logits, st, en)), out, 2048, TopkPlan(), max_row_len=bound)
    assert len(steps) == 1 and work.shape[1] == 0
    want = ref.top_k_per_row(logits, st, en, 2048)
    got = top_k_per_row(*_on((logits, st, en)), 2048, max_row_len=bound, validate=False).cpu()
    assert torch.equal(as_sets(got), as_sets(want)), "top-k sets differ"
    got = top_k_per_row(*_on((logits[:4], st[:4], en[:4])), 2048, max_row_len=bound).cpu()
    assert torch.equal(as_sets(got), as_sets(want[:4])), "top-k sets differ (validated)"
    with pytest.raises(ValueError, match="max_row_len is 3000, but a row has 5000 keys"):
        top_k_per_row(*_on((logits, st, en)), 2048, max_row_len=bound, validate=True)
    for bad in (True, -1, 3000.0):
        with pytest.raises(ValueError, match="max_row_len must be None or an int >= 0"):
            top_k_per_row(*_on((logits, st, en)), 2048, max_row_len=bad)


@pytest.mark.parametrize("route", ROUTES)
def test_topk_row_order(route):
    """A row selected from its own columns comes in column order when held whole (a short
    row), as at most two runs in column order when scanned (the keys above the boundary
    bucket, then the bucket's chosen ones)."""
    logits, st, en = _full(torch.randn(3, LONG, generator=_gen(32)))
    en[0] = 5000
    logits[2] = -1.0  # every key tied: its threshold lets too many through
    plan = ROUTES[route]
    paths, got = _check_paths(logits, st, en, 2048, plan)
    assert paths == ["direct", "listed", "scanned"]
    for r, runs in ((0, 1), (2, 2)):
        descents = int((got[r, 1:] < got[r, :-1]).sum())
        assert descents < runs, f"row {r}: {descents + 1} runs"


@pytest.mark.parametrize("route", ROUTES)
def test_topk_special_values(route):
    """NaN inside the range ranks above every number (the reference's sort); -inf inside is a
    value like any other; -0 and +0 are equal, so their tie goes to the lower index; a row of
    equal values keeps its first k columns. Short rows (direct) and long ones (filtered)."""
    for width, k in ((300, 5), (LONG, 2048)):
        logits, st, en = _rows(_gen(21), [0, 0, 0, 10], [width] * 3 + [width - 10], width)
        logits[0, [5, 77, 250]] = float("nan")
        logits[1, :] = float("-inf")
        logits[1, [3, 200]] = 1.0
        logits[2, ::2] = -0.0
        logits[2, 1::2] = 0.0
        logits[3, 10:width - 10] = 2.5
        got = _check(logits, st, en, k, ROUTES[route])
        assert {5, 77, 250} <= set(got[0].tolist())
        assert got[2].tolist() == list(range(k)) and got[3].tolist() == list(range(k))


@pytest.mark.parametrize("route", ROUTES)
def test_topk_nan_and_inf_heavy_rows(route):
    """More NaN than k (the threshold is NaN's key, the list overflows), fewer NaN than k,
    half +inf, all -inf but a few: filtered rows."""
    logits, st, en = _full(torch.randn(5, LONG, generator=_gen(33)))
    logits[0, ::3] = float("nan")
    logits[1, ::40] = float("nan")
    logits[2, 1::2] = float("inf")
    logits[3] = float("-inf")
    logits[3, ::100] = 1.0
    logits[4, ::7] = float("-inf")
    _check(logits, st, en, 2048, ROUTES[route])


@pytest.mark.parametrize("route", ROUTES)
def test_topk_narrow_range_and_overflowing_ties(route):
    """The top 2k packed into a range a few ulps wide (the estimate must resolve it to the
    last level), and more keys equal at the boundary than the list holds (scanned)."""
    width = 2 * CANDIDATES
    logits, st, en = _full(torch.randn(2, width, generator=_gen(34)))
    cols = torch.randperm(width, generator=_gen(35))[:4096]
    logits[0, cols] = 5.0 + torch.rand(4096, generator=_gen(36)) * 1e-5
    logits[1, torch.randperm(width, generator=_gen(37))[:CANDIDATES + 100]] = 3.0
    assert _check_paths(logits, st, en, 2048, ROUTES[route])[0] == ["listed", "scanned"]


@pytest.mark.parametrize("plan", [TopkPlan(), TopkPlan(route="three", programs_per_sm=1)])
def test_topk_sorted_rows(plan):
    """Rows sorted either way: the stratified sample still brackets the k-th key; the
    survivors crowd one end of the row (one program's part, a run of whole bitmask words)."""
    x = torch.randn(2, LONG, generator=_gen(38)).sort(dim=1).values
    x[1] = x[1].flip(0)
    assert _check_paths(*_full(x), 2048, plan)[0] == ["listed", "listed"]


@pytest.mark.parametrize("topk", [1, 100, 3000, 5000])
def test_topk_other_k(topk):
    """``topk`` other than 2048: the estimate aims at most halfway from ``topk`` to the list's
    length, so a large ``topk`` still fits it."""
    logits, st, en = _full(torch.randn(2, 2 * CANDIDATES + 100, generator=_gen(topk)))
    assert _check_paths(logits, st, en, topk)[0] == ["listed", "listed"]


def test_topk_k_past_the_list():
    """A ``topk`` larger than the list is scanned: still exact."""
    logits, st, en = _full(torch.randn(1, 3 * CANDIDATES, generator=_gen(39)))
    assert _check_paths(logits, st, en, CANDIDATES + 10)[0] == ["scanned"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topk_half_dtypes(dtype):
    """Logits in bf16 and fp16 (their keys widened to float32's order)."""
    logits, st, en = _full(torch.randn(2, LONG, generator=_gen(40)).to(dtype))
    _check(logits, st, en, 2048, TopkPlan())


@pytest.mark.parametrize("plan", [TopkPlan(block=1024), TopkPlan(programs_per_sm=1),
                                  TopkPlan(stages=1, filter_warps=4),
                                  TopkPlan(select_bits=5), TopkPlan(select_bits=6),
                                  TopkPlan(select_tile=1024), TopkPlan(oversample=1.0),
                                  TopkPlan(block=2048, filter_warps=8, programs_per_sm=4),
                                  TopkPlan(sample_runs=256, estimate_warps=4),
                                  TopkPlan(sample_runs=256, sample_run=32),
                                  TopkPlan(route="three", pdl=False),
                                  TopkPlan(route="one", fused_block=1024, fused_stages=2),
                                  TopkPlan(route="one", fused_warps=4, fused_parts=1),
                                  TopkPlan(route="one", fused_part_lists=False),
                                  TopkPlan(route="two", fused_block=1024, two_chunk=1024),
                                  TopkPlan(route="two", pdl=False, fused_stages=1),
                                  TopkPlan(route="three", block=1024, filter_warps=4),
                                  TopkPlan(route="three", block=32, programs_per_sm=1)])
def test_topk_other_plans(plan):
    logits, st, en = _rows(_gen(41), [0, 5], [LONG, LONG - 9], LONG)
    _check(logits, st, en, 2048, plan=plan)


@pytest.mark.parametrize("route", ["one", "two", "one, whole bitmask"])
def test_topk_quad_searches(route):
    """The estimate's and the select's searches by ``_quad_search`` (``TopkPlan``'s
    ``estimate_search`` and ``select_search``) on rows longer than the list: random rows, at
    k = 2048, 1 and 3000, listed (the estimate within its slack: the survivors between k and
    1.5 k at k = 2048), rows rounded to 1/40 (ties at the boundary), special values, NaN and
    inf heavy rows, a few ulps wide top. The three launches' kernels run the same estimate
    (the two launches') and the same select (the one launch's, listing the whole bitmask)."""
    base = TopkPlan(route="one", fused_part_lists=False) if "whole" in route else ROUTES[route]
    plan = dataclasses.replace(base, estimate_search="quad", select_search="quad")
    logits, st, en = _rows(_gen(61), [0, 13, 1001], [LONG, LONG - 5, LONG + 77], LONG + 90)
    work, _got = _checked_work(logits, st, en, 2048, plan)
    assert _read_paths(work, st, en, 2048) == ["listed"] * 3
    assert all(2048 <= s <= 3072 for s in survivors(work).tolist()), survivors(work)
    for k in (1, 3000):
        _check(logits, st, en, k, plan)
    _check(*_rows(_gen(62), [3, 0], [LONG + 3, LONG], LONG + 16, ties=True), 2048, plan)
    logits, st, en = _full(torch.randn(4, LONG, generator=_gen(63)))
    logits[0, ::3] = float("nan")
    logits[1, 1::2] = float("inf")
    logits[2] = float("-inf")
    logits[2, ::100] = 1.0
    logits[3, torch.randperm(LONG, generator=_gen(64))[:4096]] = (
        5.0 + torch.rand(4096, generator=_gen(65)) * 1e-5)
    _check(logits, st, en, 2048, plan)


@pytest.mark.parametrize("part_lists", [True, False])
def test_topk_split_rows(part_lists):
    """Rows fewer than the SMs split over several programs each (the last to finish selects;
    the parts list their shares first, or the last lists the whole bitmask): a random row
    from the gathered list, a row with its start and end off the 16-key grid, more NaN than k
    (listed: the NaN all tie, the lowest columns win) and more equal keys than the list holds
    (scanned), one row and two."""
    plan = TopkPlan(route="one", fused_block=1024, fused_part_lists=part_lists)
    logits, st, en = _full(torch.randn(2, LONG + 50, generator=_gen(45)))
    st[1], en[1] = 21, LONG + 37
    assert _check_paths(logits[:1], st[:1], en[:1], 2048, plan)[0] == ["listed"]
    assert _check_paths(logits, st, en, 2048, plan)[0] == ["listed", "listed"]
    logits[0, ::3] = float("nan")
    logits[1, torch.randperm(LONG, generator=_gen(46))[:CANDIDATES + 100] + 21] = 3.0
    assert _check_paths(logits, st, en, 2048, plan)[0] == ["listed", "scanned"]


@pytest.mark.parametrize("part_lists", [True, False])
def test_topk_split_rows_short_of_the_width(part_lists):
    """Rows much shorter than the logits' width (ragged prefill): the parts past a row's end
    mark nothing and arrive at once, the others' shares (or the whole bitmask) make the list;
    and a row whose survivors overflow one part's share of the list (scanned)."""
    plan = TopkPlan(route="one", fused_block=1024, fused_part_lists=part_lists)
    W = 3 * LONG
    logits, st, en = _rows(_gen(47), [0, 2 * LONG - 5, 7], [LONG, W - 2, 2 * LONG], W)
    logits[2, 7 + torch.randperm(LONG, generator=_gen(48))[:CANDIDATES - 500]] = 3.0
    logits[2, 17500:18500] = 3.0  # in the second part (chunks of 17408 keys): one share fits
    assert _check_paths(logits, st, en, 2048, plan)[0] == ["listed", "listed", "scanned"]


@pytest.mark.parametrize("route", ROUTES)
def test_topk_launches_repeated(route):
    """The same launches run again (as a CUDA graph replays them) select again: the split
    rows' arrival counts are zeroed by the kernel that used them."""
    logits, st, en = _on(_rows(_gen(49), [0, 3], [LONG, LONG - 40], LONG))
    out = torch.empty(2, 2048, dtype=torch.int32, device=DEVICE)
    _work, steps = launches(logits, st, en, out, 2048, ROUTES[route])
    want = as_sets(ref.top_k_per_row(logits.cpu(), st.cpu(), en.cpu(), 2048))
    for _ in range(3):
        out.fill_(-7)
        for step in steps:
            step()
        assert torch.equal(as_sets(out.cpu()), want)


@pytest.mark.parametrize("route", ["one", "two", "three"])
def test_topk_grids_put_the_rows_on_x(monkeypatch: pytest.MonkeyPatch, route: str):
    """CUDA takes at most 65535 programs on a grid's y and z (2^31 - 1 on x), and a prefill of
    64K tokens is 64K rows: every launch of every route puts the rows on x, its y and z not
    growing with the rows (launches recorded, not run)."""
    grids: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    rows = 0

    def recorder(name: str):
        def launch(key, grid, args, **options) -> None:
            grids.setdefault(rows, []).append((name, tuple(grid)))
        return launch

    for name in ("_estimate", "_mask", "_select", "_fused", "_mark_select", "_held"):
        monkeypatch.setattr(fast_topk, name, recorder(name))
    for rows in (7, 9):
        logits = torch.randn(rows, 9000, device=DEVICE)
        starts = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
        fast_topk.top_k_per_row(logits, starts, starts + 9000, 2048,
                                plan=TopkPlan(route=route, two_chunk=2048))
    assert [n for n, _ in grids[7]] == [n for n, _ in grids[9]] and grids[7]
    for (name, seven), (_, nine) in zip(grids[7], grids[9]):
        assert seven[0] < nine[0] and seven[1] >= nine[1] and seven[2] >= nine[2], (
            name, seven, nine)


def test_topk_route_for():
    """``route="auto"``: two launches where a row fits one of their parts and the rows
    outnumber the SMs (4 under the interpreter, the GPU's count on one) or where
    the rows are more than two a SM, else one launch; a route named is taken at every shape."""
    sms = fast_topk.num_sms(torch.device(DEVICE))
    auto, dev = TopkPlan(), torch.device(DEVICE)
    assert auto.route_for(sms + 1, 32768, dev, 2048) == "two"
    assert auto.route_for(sms, 32768, dev, 2048) == "one"
    assert auto.route_for(4 * sms, CANDIDATES, dev, 2048) == "one"  # held whole: no estimate
    assert auto.route_for(2 * sms, 32769, dev, 2048) == "one"  # two parts of the second launch
    assert auto.route_for(2 * sms + 1, 32769, dev, 2048) == "two"  # many rows: two launches
    assert TopkPlan(many_rows_per_sm=4).route_for(4 * sms, 131072, dev, 2048) == "one"
    assert TopkPlan(two_chunk=65536).route_for(sms + 1, 65536, dev, 2048) == "two"
    for route in ("one", "two", "three"):
        assert TopkPlan(route=route).route_for(1, 131072, dev, 2048) == route


def test_topk_sample_runs_for():
    """The estimate samples ``sample_rank * W / topk`` keys, rounded up to whole runs and a
    power of two of them, from 2 to ``sample_runs``."""
    plan = TopkPlan()
    assert plan.sample_runs_for(131072, 2048) == 1024  # 8192 keys: the k-th at rank ~128
    assert plan.sample_runs_for(32768, 2048) == 256
    assert plan.sample_runs_for(32769, 2048) == 512  # rounded up
    assert plan.sample_runs_for(LONG, 2048) == 128
    assert plan.sample_runs_for(131072, 16) == 1024  # capped at sample_runs
    assert plan.sample_runs_for(16384, 8192) == 32
    assert plan.sample_runs_for(16, 2048) == 2  # at least two runs
    assert TopkPlan(sample_runs=64).sample_runs_for(131072, 2048) == 64
    assert TopkPlan(sample_rank=256).sample_runs_for(32768, 2048) == 512
    assert TopkPlan(sample_runs=256, sample_run=32).sample_runs_for(32768, 2048) == 64
    with pytest.raises(ValueError, match="TopkPlan.sample_rank"):
        TopkPlan(sample_rank=0)


def test_topk_a_broken_twin_fails():
    """The set comparison bites: ties broken toward the higher index differ."""
    logits, st, en = _rows(_gen(22), [0], [500], 500, ties=True)
    logits[0, 100:] = logits[0, :100].max()  # 400 equal values share the 64th place
    got = _check(logits, st, en, 64)
    flipped = ref.top_k_per_row(logits.flip(1), 500 - en, 500 - st, 64).long()
    high = torch.where(flipped >= 0, 499 - flipped, -1).to(torch.int32)
    assert not torch.equal(as_sets(got), as_sets(high))


def test_topk_empty_and_bad_input():
    logits, st, en = _on(_rows(_gen(23), [0, 0], [10, 3], 10))
    assert top_k_per_row(logits[:0], st[:0], en[:0], 4).shape == (0, 4)
    empty = top_k_per_row(logits[:, :0], st * 0, en * 0, 3).cpu()
    assert torch.equal(empty, torch.full((2, 3), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="row_starts / row_ends"):
        top_k_per_row(logits, st, en + 1, 4, validate=True)
    with pytest.raises(ValueError, match="topk"):
        top_k_per_row(logits, st, en, 0)
    with pytest.raises(TypeError, match="float64"):
        top_k_per_row(logits.double(), st, en, 4)
    with pytest.raises(ValueError, match="row_ends"):
        top_k_per_row(logits, st, en[:1], 4)
    with pytest.raises(TypeError, match="TopkPlan"):
        top_k_per_row(logits, st, en, 4, plan={"block": 1024})
    with pytest.raises(ValueError, match="TopkPlan.block"):
        TopkPlan(block=1000)
    with pytest.raises(ValueError, match="TopkPlan.stages"):
        TopkPlan(stages=0)
    with pytest.raises(ValueError, match="TopkPlan.oversample"):
        TopkPlan(oversample=0.5)
    with pytest.raises(ValueError, match="TopkPlan.sample_runs"):
        TopkPlan(sample_runs=2048)
    with pytest.raises(ValueError, match="TopkPlan.sample_run "):
        TopkPlan(sample_run=12)
    with pytest.raises(ValueError, match="sample_runs \\* sample_run must be at most 8192"):
        TopkPlan(sample_runs=1024, sample_run=16)
    with pytest.raises(TypeError, match="TopkPlan.fused_part_lists must be a bool"):
        TopkPlan(fused_part_lists=1)
    with pytest.raises(TypeError, match="TopkPlan.pdl must be a bool"):
        TopkPlan(pdl=1)
    with pytest.raises(ValueError, match="TopkPlan.fused_block"):
        TopkPlan(fused_block=8)
    with pytest.raises(ValueError, match="TopkPlan.block"):
        TopkPlan(block=16)
    with pytest.raises(ValueError, match="TopkPlan.select_maxnreg"):
        TopkPlan(select_maxnreg=8)
    with pytest.raises(ValueError, match="TopkPlan.route"):
        TopkPlan(route="fused")
    with pytest.raises(ValueError, match="TopkPlan.fused_min_parts"):
        TopkPlan(fused_min_parts=0)
    with pytest.raises(ValueError, match="TopkPlan.estimate_search must be 'bisect' or 'quad'"):
        TopkPlan(estimate_search="bracket")
    with pytest.raises(ValueError, match="TopkPlan.select_search must be 'bracket' or 'quad'"):
        TopkPlan(select_search="bisect")
    # unvalidated, a range past the row is clipped to it
    got = top_k_per_row(logits.nan_to_num(-1.0), st, en + 5, 20, validate=False).cpu()
    assert sorted(got[0][got[0] >= 0].tolist()) == list(range(10))


@triton.jit
def _floor_marks_kernel(t_ptr, x_ptr, out_ptr, T: tl.constexpr, X: tl.constexpr):
    t = tl.load(t_ptr + tl.arange(0, T))
    x = tl.load(x_ptr + tl.arange(0, X))
    f = _key_floor(t)[:, None]
    marks = (x[None, :] >= f) | (x[None, :] != x[None, :])
    tl.store(out_ptr + tl.arange(0, T)[:, None] * X + tl.arange(0, X)[None, :],
             marks.to(tl.int8))


def test_topk_float_threshold_is_the_key_threshold():
    """The streaming read compares floats with ``_key_floor(t)``: for every key threshold
    ``t`` (those of the special values and their neighbours, past ``+inf`` and below
    ``-inf``, random ones) and every float (both zeros, denormals, infinities, NaN, random),
    ``x >= f`` or NaN exactly where the key of ``x`` (the reference's order: ``-0`` as ``+0``,
    NaN above all) reaches ``t``. On a GPU the compare runs compiled (denormals not flushed)."""
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.17e-38, -1.17e-38, 1.0, -1.0,
                            float("inf"), float("-inf"), float("nan"), 3.4e38, -3.4e38])
    x = torch.cat([special, torch.randn(128 - len(special), generator=_gen(5)) * 10])
    bits = x.view(torch.int32)
    bits = torch.where(bits == -2147483648, 0, bits)
    keys = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    keys = torch.where(x.isnan(), 0x7FFFFFFF, keys).long()
    edges = torch.tensor([-2139095041 - 1, -2139095041, -2139095040, -2147483648, -2, -1, 0, 1,
                          2139095040, 2139095041, 2147483647])
    t = torch.cat([edges, keys[:40] - 1, keys[:40], keys[:40] + 1,
                   torch.randint(-2 ** 31, 2 ** 31, (256 - 11 - 120,), generator=_gen(6))])
    t = t.clamp(-2 ** 31, 2 ** 31 - 1).to(torch.int32)
    out = torch.empty(256, 128, dtype=torch.int8, device=DEVICE)
    _floor_marks_kernel[(1,)](t.to(DEVICE), x.to(DEVICE), out, 256, 128)
    want = keys[None, :] >= t.long()[:, None]
    assert torch.equal(out.cpu().bool(), want)


def test_one_launch_kernel_compiles_for_sm90():
    """The default one-launch kernel, a row a program and a row split over programs, the
    two launches' second and the kernel of rows held whole compile for the H200 without
    spills, but for a few bytes of stack where the held rows' registers are capped (in a
    child process without the interpreter, which cannot compile for a GPU; the three
    launches' kernels: ``tests/test_fast_indexer.py``)."""
    found = compiled(["-m", "benchmarks.topk_sweep", "--sm90"], timeout=600)
    # a row a program, a row split, two launches at 8 and 4 warps with rows in 4 parts and in
    # one, rows held of 4096 and 8192, of 8192 with the registers capped (as launched where
    # the rows outnumber the SMs), rows of 8192 held by a bound in wider logits (uncapped and
    # capped), and of one key with k = 1 (both constants in a launch)
    assert len(found) == 12, sorted(found)
    for name, f in found.items():
        # capped at 128 registers, the held kernel keeps 16 bytes of stack (measured; two
        # programs a SM were faster at 256 x 8K, TopkPlan.held_maxnreg); nothing else spills
        stack = 16 if name.endswith(", capped") else 0
        assert f["stack"] <= stack and f["local"] == 0 and not f["ptx_local"], \
            f"{name} spills: {f}"
        assert f["shared"] <= 232448, f"{name}: {f['shared']} B of shared memory"
    # the two launches' mark reads 16 bytes a copy whatever the parts: with one part a row
    # made the constant 1 it compiled to 4-byte copies (2048 x 32K 13% slower on the H200)
    two = {name: f for name, f in found.items() if "two launches" in name}
    assert len(two) == 4 and all(f["cp_async_16"] > 0 and f["cp_async_other"] == 0
                                 for f in two.values()), two


def test_streaming_read_costs_few_instructions_a_key():
    """The top-k's one read of a row, compiled for sm_90 (``benchmarks.probes.topk_mark_sass``, in a
    child process without the interpreter): its loop takes at most 16 SASS instructions a
    key a thread. Measured 13.25 under triton 3.6.0 and 12.94 under 3.7.1; comparing integer
    keys, as the read did before its float threshold (``_key_floor``), took 26.3."""
    facts = compiled(["-m", "benchmarks.probes.topk_mark_sass"], timeout=600)
    assert facts["keys_per_thread"] == 16 and facts["opcodes"].get("LDGSTS", 0) > 0, facts
    assert facts["per_key"] <= 16, f"the read's loop takes {facts['per_key']} a key: {facts}"


def test_held_rows_kernel_instructions_stay_few():
    """The held rows' kernel compiled for sm_90, its SASS counted by source function
    (``benchmarks.probes.topk_code_size``, in a child process): at most 4,600 instructions
    (4,376 under triton 3.7.1). After the benchmark's L2 flush a kernel of 4,128 straight-line
    instructions cost its compute alone on an H200 and one of 8,224 about 24 µs more
    (``benchmarks/notes/topk.md``), so growth here is to be timed, not assumed free. Every
    instruction is attributed to a function (line info), the general kernels' too."""
    found = compiled(["-m", "benchmarks.probes.topk_code_size", "--json"], timeout=600)
    kernels = found["kernels"]
    assert set(kernels) == {"held rows of 8192", "one launch", "one launch, a row split",
                            "two launches' second"}, sorted(kernels)
    for name, k in kernels.items():
        assert sum(k["by_function"].values()) == k["total"], name
        assert k["by_function"].get("?", 0) < 0.01 * k["total"], (name, k["by_function"])
    held = kernels["held rows of 8192"]
    assert held["total"] <= 4600, held
