"""The top-k's searches among held keys (``mla.fast.topk.search``) on their own: for every
row, what each returns must be a boundary of the ``need`` largest nonzero patterns, read off a
sort.

A returned ``(a, reach)`` is right when ``reach`` items reach ``a``, and either exactly
``need`` do (then they are the ``need`` largest, whatever ``a`` is) or the ``need``-th largest
is tied and ``a`` is its value (more than ``need`` reach it, fewer than ``need`` pass it). The
rows are the ones that make a search hard: keys spread over the whole 32-bit range, two far
clusters (an interpolation aims between them), every key equal, a run of ties at the
boundary, the two least keys tied with ``need`` all but one, a run of consecutive patterns
present twice each (an item just below every probe), exponentially spread float keys, a few
keys among empty places, the extremes 1 and ``2^32 - 1``, ``need`` 1 and ``need`` every item.
The search's step of the bracket's extremes is also checked on its own.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from mla.fast.topk.search import _bisect, _bracket_extremes, _bracket_search, _quad_search

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N = 4096  # the select holds this many items with their columns


@triton.jit
def _search_rows(u_ptr, need_ptr, out_ptr, N: tl.constexpr, SEARCH: tl.constexpr,
                 GUESS: tl.constexpr, SLACK: tl.constexpr):
    row = tl.program_id(0)
    u = tl.load(u_ptr + row * N + tl.arange(0, N)).to(tl.uint32, bitcast=True)
    need = tl.load(need_ptr + row)
    slack = need // 16 + 2 if SLACK else 0  # the estimate's
    if SEARCH == "bracket":
        a, reach = _bracket_search(u, need)
    elif SEARCH == "bisect":
        a, reach = _bisect(u, need, slack)
    else:
        a, reach = _quad_search(u, need, GUESS, slack)
    tl.store(out_ptr + 2 * row, a.to(tl.int64))
    tl.store(out_ptr + 2 * row + 1, reach.to(tl.int64))


def _as_int32(u: torch.Tensor) -> torch.Tensor:
    """uint32 patterns held as int64, as int32 of the same bits (what the kernels load)."""
    return (u - (u >= 2 ** 31).long() * 2 ** 32).to(torch.int32)


def _float_patterns(x: torch.Tensor) -> torch.Tensor:
    """float32 values as the order-keeping uint32 patterns of the top-k (non-negative floats
    here: the sign bit set, the rest their bits), as int64."""
    return x.float().view(torch.int32).to(torch.int64) + 2 ** 31


def _rows() -> list[tuple[str, torch.Tensor, int]]:
    g = torch.Generator().manual_seed(7)
    full = torch.randint(1, 2 ** 32, (N,), generator=g, dtype=torch.int64)
    clusters = torch.cat([torch.randint(1, 1000, (N // 2,), generator=g),
                          torch.randint(2 ** 32 - 1000, 2 ** 32, (N - N // 2,), generator=g)])
    ties = torch.randint(1, 2 ** 20, (N,), generator=g, dtype=torch.int64)
    ties[torch.randperm(N, generator=g)[:300]] = 2 ** 19  # a run of equals around the median
    spread = _float_patterns(torch.empty(N).exponential_(generator=g) ** 8)
    few = torch.zeros(N, dtype=torch.int64)
    few[torch.randperm(N, generator=g)[:37]] = torch.randint(1, 2 ** 32, (37,), generator=g)
    extremes = torch.where(torch.rand(N, generator=g) < 0.5, 1, 2 ** 32 - 1)
    candidates = _float_patterns(torch.randn(N, generator=g).abs() + 2.0)  # alike a row's top
    candidates[3300:] = 0  # ~3300 candidates, as the select sees
    least_tied = torch.randperm(N, generator=g) + 10
    least_tied[:2] = 3  # the two least equal: need all but one ends on a tie at the bottom
    # every pattern of a run present (twice): an item sits just below every probe
    run = (torch.randperm(N, generator=g) // 2 + 1000).long()
    return [("full range", full, 2048), ("full range, need 1", full, 1),
            ("full range, need all", full, N), ("two clusters", clusters, N // 2 + 1),
            ("two clusters, inside one", clusters, 17), ("all equal", torch.full((N,), 5), 100),
            ("ties at the boundary", ties, N // 2), ("exponential spread", spread, 2048),
            ("a few among empties", few, 11), ("a few, need all", few, 37),
            ("extremes", extremes, N // 2), ("candidates", candidates, 2048),
            ("one item", torch.nn.functional.pad(torch.tensor([9]), (0, N - 1)), 1),
            ("the two least tied, need all but one", least_tied, N - 1),
            ("a run of patterns, twice each", run, 2047), ("a run, twice each, need 2", run, 2),
            ("a run, twice each, need all but one", run, N - 1)]


ROWS = _rows()


def _check_boundary(name: str, u: torch.Tensor, need: int, a: int, reach: int,
                    slack: int = 0) -> None:
    """``reach`` items reach ``a``, at least ``need`` (so the ``need`` largest all do) and
    at most ``need + slack`` unless ``a`` is the tied ``need``-th largest itself (a run of
    equals no search can cut)."""
    live = u[u != 0]
    v = int(live.sort(descending=True).values[need - 1])
    assert int((live >= a).sum()) == reach, f"{name}: the count returned is not the count at a"
    assert reach >= need, f"{name}: {reach} items reach a, fewer than need {need}"
    if reach > need + slack:
        assert a == v and int((live > v).sum()) < need, (
            f"{name}: {reach} > {need} reach a = {a}, but a is not the tied need-th {v}")


def _searched(search: str, guess: bool, slack: bool = False) -> list[list[int]]:
    """``(a, reach)`` of every row of ``ROWS`` by ``search`` (``slack``: the estimate's,
    ``need // 16 + 2``)."""
    u = torch.stack([r[1] for r in ROWS])
    need = torch.tensor([r[2] for r in ROWS], dtype=torch.int32)
    got = torch.zeros(len(ROWS), 2, dtype=torch.int64, device=DEVICE)
    _search_rows[(len(ROWS),)](_as_int32(u).to(DEVICE), need.to(DEVICE), got, N=N,
                               SEARCH=search, GUESS=guess, SLACK=slack)
    return got.cpu().tolist()


@pytest.mark.parametrize("search", ["bracket", "bisect", "quad", "quad guess"])
def test_search_returns_the_boundary_of_the_need_largest(search):
    got = _searched(search.split()[0], "guess" in search)
    for (name, row, k), (a, reach) in zip(ROWS, got):
        _check_boundary(name, row, k, a, reach)


@pytest.mark.parametrize("search", ["bisect", "quad guess"])
def test_search_with_slack_stops_within_it(search):
    """With the estimate's slack a search may stop once at most ``need + need // 16 + 2``
    items reach its key; at least one row stops short of the exact answer, so the slack is
    used, and ``_check_boundary`` with no slack would fail it."""
    got = _searched(search.split()[0], "guess" in search, slack=True)
    short = 0
    for (name, row, k), (a, reach) in zip(ROWS, got):
        _check_boundary(name, row, k, a, reach, k // 16 + 2)
        live = row[row != 0]
        short += reach > k and int((live > a).sum()) >= k  # past the exact, not a tie
    assert short > 0


def test_check_boundary_rejects_a_wrong_answer():
    """The check above fails a search that stops one pattern short or reports a wrong count."""
    name, row, need = ROWS[0]
    v = int(row.sort(descending=True).values[need - 1])
    _check_boundary(name, row, need, v, need)  # the exact answer passes
    for a, reach in [(v + 1, need - 1), (v - 10**6, int((row >= v - 10**6).sum())),
                     (v, need + 1)]:
        with pytest.raises(AssertionError):
            _check_boundary(name, row, need, a, reach)


def test_the_search_step_model_keeps_the_convention():
    """``benchmarks.probes.topk_search_model`` (a numpy model of ``_quad_search``'s rule, used
    to count steps a row): every rule returns a boundary of the ``need`` largest on every
    family of rows it reports, read off a sort, and the exchange of the bracket's least and
    greatest items closes a tied row in fewer steps (19 to 6 at the most of 132 rows)."""
    import numpy as np

    from benchmarks.probes import topk_search_model as model

    for family in model.FAMILIES:
        rng = np.random.default_rng(3)
        for _ in range(4):
            x = model.row(family, rng)
            u = model.patterns(x)
            plain = model.search(u, x, model.NEED, False)
            both = model.search(u, x, model.NEED, True)
            compact = model.search(u, x, model.NEED, False, 128)
            for a, reach, _steps in (plain, both, compact):
                model.check(u, model.NEED, a, reach)
            if family == "ties of 1/40":
                assert both[2] < plain[2], (both, plain)


def test_the_long_rows_model_keeps_the_convention():
    """``topk_search_model.run_long`` (the estimate's and the select's rules on rows longer
    than the list; each select's answer checked against a sort inside it): on normal rows
    the quad rule takes fewer steps than the bisection and the bracket rule, and the
    survivors fit the list."""
    from benchmarks.probes import topk_search_model as model

    res = model.run_long(8, 8193)
    for family in model.FAMILIES:
        assert model.NEED <= res[f"{family}, survivors"]["max"] <= 8192
    assert res["normal, estimate, quad"]["mean"] < res["normal, estimate, bisect"]["mean"]
    assert res["normal, select, quad"]["mean"] < res["normal, select, bracket"]["mean"]


@triton.jit
def _extremes_rows(u_ptr, ends_ptr, out_ptr, N: tl.constexpr):
    row = tl.program_id(0)
    u = tl.load(u_ptr + row * N + tl.arange(0, N)).to(tl.uint32, bitcast=True)
    a = tl.load(ends_ptr + 2 * row)
    z = tl.load(ends_ptr + 2 * row + 1)
    least, second, most = _bracket_extremes(u, a, z)
    tl.store(out_ptr + 3 * row, least.to(tl.int64))
    tl.store(out_ptr + 3 * row + 1, second.to(tl.int64))
    tl.store(out_ptr + 3 * row + 2, most.to(tl.int64))


def test_bracket_extremes_of_the_items_inside():
    """``_bracket_extremes(u, a, z)``: the least, second least (duplicates counted) and
    greatest of the items in ``[a, z)``, read off a sort, on brackets whose ends are items'
    patterns (``a`` and ``z - 1`` inside, ``z`` outside), with the least tied, and with
    ``z = 2^32`` (the greatest pattern inside)."""
    g = torch.Generator().manual_seed(13)
    rows, ends = [], []
    for a, z, tie in [(5000, 9000, False), (5000, 9000, True), (1, 2 ** 32, False),
                      (2 ** 32 - 300, 2 ** 32, True), (7, 9, False)]:
        u = torch.randint(1, 2 ** 32, (N,), generator=g)
        u[:3] = torch.tensor([a - 1, z - 1, min(z, 2 ** 32 - 1)])  # ends' neighbours
        u[3] = a  # a itself is inside
        u[4:8] = torch.randint(a, z, (4,), generator=g)
        if tie:
            u[8] = a
        rows.append(u)
        ends.append([a, z])
    u = torch.stack(rows)
    e = torch.tensor(ends, dtype=torch.int64)
    got = torch.zeros(len(rows), 3, dtype=torch.int64, device=DEVICE)
    _extremes_rows[(len(rows),)](_as_int32(u).to(DEVICE), e.to(DEVICE), got, N=N)
    for r, (a, z) in enumerate(ends):
        inside = u[r][(u[r] >= a) & (u[r] < z)].sort().values
        want = [int(inside[0]), int(inside[1]), int(inside[-1])]
        assert got[r].tolist() == want, (r, got[r].tolist(), want)
