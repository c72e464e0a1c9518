"""The paged decode logits' routes (``mla.fast.indexer.logits_paged``): tensor-descriptor
(TMA) page tiles, pointer page tiles and per-key gathers, each against the float64 reference
on caches poisoned with NaN bytes, with ``-1`` and out-of-cache table entries, lengths off the
tiles, rows split over many programs; and the argument checks that the fast path shares with
the reference (one function, the same messages).

Under ``TRITON_INTERPRET=1`` on the CPU with small shapes (``num_sms`` is 4 there, so the
splits are exercised); the same tests run compiled on a GPU.
"""

from __future__ import annotations

import re

import pytest
import torch

import mla.reference as ref
from mla.compare import logits_err, poison_like
from mla.fast import fp8_mqa_logits, fp8_paged_mqa_logits
from mla.fast.indexer.logits import logits_budget
from mla.fast.indexer.logits_paged import PAGED_PLAN, paged_loads
from mla.fast.indexer.logits_tile import PROGRAM_COST_TILES, LogitsPlan, split_keys, split_waves
from mla.reference.paged_cache import make_block_table

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D = 128


def _cache(g: torch.Generator, lens: list[int], page: int, minus_one: bool):
    """Each request's keys at shuffled pages of a cache whose other bytes are 0xFF (NaN codes
    and NaN scales); unused table entries hold -1 or point at a NaN page."""
    table, nb = make_block_table(lens, page, spare_blocks=1,
                                 seed=int(torch.randint(1 << 30, (1,), generator=g)))
    cache = poison_like(torch.empty(nb, page, 132, dtype=torch.uint8))
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        gain = 2.0 ** torch.randint(-4, 5, (n, 1), generator=g)
        k = (torch.randn(n, D, generator=g, dtype=torch.float64) * gain).bfloat16()
        ref.indexer_k_quant_and_cache(k, cache, table[b].long()[pos // page] * page
                                      + pos % page)
    if not minus_one:
        table = torch.where(table < 0, nb - 1, table)
    return cache, table.to(torch.int32)


def _inputs(seed: int, lens: list[int], next_n: int, page: int, heads: int = 64,
            minus_one: bool = True):
    g = torch.Generator().manual_seed(seed)
    cache, table = _cache(g, lens, page, minus_one)
    q = torch.randn(len(lens) * next_n, heads, D, generator=g, dtype=torch.float64)
    w = torch.randn(len(lens) * next_n, heads, generator=g, dtype=torch.float64)
    q8, wq = ref.quantize_indexer_q(q, w * (heads * D) ** -0.5)
    return (q8.view(len(lens), next_n, heads, D), cache, wq,
            torch.tensor(lens, dtype=torch.int32), table)


def _on(args: tuple) -> tuple:
    return tuple(a.to(DEVICE) for a in args)


def _check(got: torch.Tensor, args: tuple, width: int) -> None:
    """Against the float64 reference in ``logits_err``'s measure (the magnitude: the reference
    with the weights' absolute values)."""
    want = ref.fp8_paged_mqa_logits(args[0], args[1], args[2].double(), *args[3:], width)
    mag = ref.fp8_paged_mqa_logits(args[0], args[1], args[2].double().abs(), *args[3:], width)
    got = got.cpu()
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "-inf pattern differs"
    err = logits_err(got, want, mag)
    assert err <= logits_budget(DEVICE, args[2].shape[1]), f"logits_err {err:.3e}"


TMA_ROUTE = "tma" if DEVICE == "cpu" or torch.cuda.get_device_capability()[0] >= 9 else "page"
HOST_TMA_ROUTE = "tma_host" if TMA_ROUTE == "tma" else "page"


@pytest.mark.parametrize("plan,page,route", [
    (PAGED_PLAN, 64, HOST_TMA_ROUTE),                    # the default: split in waves
    (LogitsPlan(), 64, TMA_ROUTE),
    (LogitsPlan(paged_loads="tma_host", max_tiles=2), 128, HOST_TMA_ROUTE),  # 4 programs
    (LogitsPlan(), 128, TMA_ROUTE),                      # two tiles a page
    (LogitsPlan(block_n=32, stages=2), 32, TMA_ROUTE),   # the smallest TMA page
    (LogitsPlan(paged_loads="page"), 64, "page"),
    (LogitsPlan(block_n=16, paged_loads="page", stages=1), 16, "page"),  # no TMA row start
    (LogitsPlan(), 16, "gather"),                        # pages smaller than a tile
    (LogitsPlan(paged_loads="gather", stages=2), 64, "gather"),
])
@pytest.mark.parametrize("lens,next_n", [([1, 65, 200, 0], 1), ([130, 3, 64], 3)])
def test_routes_match_the_reference(plan: LogitsPlan, page: int, route: str, lens: list[int],
                                    next_n: int):
    args = _inputs(page + next_n + sum(lens), lens, next_n, page)
    assert paged_loads(plan, args[1].to(DEVICE)) == route
    width = max(lens) + 70  # -inf columns and whole tiles past every length
    _check(fp8_paged_mqa_logits(*_on(args), width, plan=plan), args, width)


@pytest.mark.parametrize("route", ["tma", "tma_host", "page", "gather"])
def test_one_long_row_over_many_programs(route: str):
    """One request over programs of 3 tiles (not a power of two: the page vector is padded),
    the last one partly past the length; the split is what the launch uses."""
    plan = LogitsPlan(paged_loads=route, max_tiles=4, programs_per_sm=2)
    L = 64 * 17 + 5
    if DEVICE == "cpu":  # the interpreter's 4 SMs: 8 programs wanted, 19 tiles
        assert split_keys(L + 64, 1, 64, torch.device(DEVICE), 2, 4) == (3, 7)
        assert split_waves(L + 64, 1, 64, 8, 4) == (3, 7)  # one wave of 8 slots
    args = _inputs(5, [L], 2, 64, minus_one=False)
    _check(fp8_paged_mqa_logits(*_on(args), L + 64, plan=plan), args, L + 64)


def test_split_fills_the_machine():
    """One long request is split over programs_per_sm programs a SM (``num_sms`` is 4 on the
    CPU); a batch of long requests over fewer, longer programs, none past ``max_tiles``; every
    tile covered once."""
    cpu = torch.device("cpu")
    for keys, rows, per_sm, max_tiles in [(131072, 1, 4, 16), (131072, 1, 8, 64),
                                          (131072, 128, 4, 16), (8192, 32, 4, 16), (65, 1, 4, 16)]:
        per, splits = split_keys(keys, rows, 64, cpu, per_sm, max_tiles)
        tiles = -(-keys // 64)
        assert 1 <= per <= max_tiles and (splits - 1) * per < tiles <= splits * per
        assert rows * splits >= min(per_sm * 4, rows * tiles) or per == max_tiles
    assert split_keys(131072, 1, 64, cpu, 4, 16) == (16, 128)


def test_split_in_whole_waves():
    """The wave split covers every tile once, in programs of at most ``max_tiles``, in no more
    waves than any other split; at the H200's 132 SMs x 5 programs it takes one wave of 640
    programs at B = 32, L = 32K (the spread split: 1024, 1.55 waves), one of 512 for one
    request of 128K, and 26 tiles a program for 4 waves at B = 128, L = 32K (not 32: the
    same 4 waves, longer)."""
    for keys, rows, slots, max_tiles in [(32768, 32, 660, 32), (131072, 1, 660, 32),
                                         (32768, 128, 660, 32), (131072, 128, 528, 64),
                                         (65, 1, 16, 4), (64 * 19, 3, 16, 4), (1, 5, 16, 32)]:
        per, splits = split_waves(keys, rows, 64, slots, max_tiles)
        tiles = -(-keys // 64)
        assert 1 <= per <= max_tiles and (splits - 1) * per < tiles <= splits * per
        waves = -(-rows * splits // slots)
        for other in range(1, min(max_tiles, tiles) + 1):
            w = -(-rows * -(-tiles // other) // slots)
            assert waves * (per + PROGRAM_COST_TILES) <= w * (other + PROGRAM_COST_TILES)
    assert split_waves(32768, 32, 64, 660, 32) == (26, 20)
    assert split_waves(131072, 1, 64, 660, 32) == (4, 512)
    assert split_waves(32768, 128, 64, 660, 32) == (26, 20)
    with pytest.raises(ValueError, match="LogitsPlan.split"):
        LogitsPlan(split="even")


@pytest.mark.parametrize("route", ["tma", "tma_host", "page", "gather"])
def test_pages_outside_the_cache_give_nan(route: str):
    """Unvalidated, a table entry outside the cache (past it, or -1) within the length gives
    NaN for that page's keys and nothing else; a length past the table's row too."""
    q8, cache, w, lens, table = _inputs(7, [150, 40], 1, 64, minus_one=False)
    nb = cache.shape[0]
    bad = table.clone()
    bad[0, 1] = nb + 5
    bad[1, 0] = -1
    plan = LogitsPlan(paged_loads=route)
    got = fp8_paged_mqa_logits(*_on((q8, cache, w, lens, bad)), 160, validate=False,
                               plan=plan).cpu()
    assert torch.isnan(got[0, 64:128]).all() and not torch.isnan(got[0, :64]).any()
    assert not torch.isnan(got[0, 128:150]).any() and torch.isneginf(got[0, 150:]).all()
    assert torch.isnan(got[1, :40]).all() and torch.isneginf(got[1, 40:]).all()
    # a length past the table's two pages: the keys past 128 are NaN, the row ends at 160
    got = fp8_paged_mqa_logits(*_on((q8, cache, w, lens * 0 + 150, table[:, :2])), 160,
                               validate=False, plan=plan).cpu()
    assert torch.isnan(got[0, 128:150]).all() and not torch.isnan(got[0, :128]).any()


@pytest.mark.parametrize("route", ["tma", "page"])
def test_nan_key_and_nan_query(route: str):
    """A NaN code inside a row's range gives NaN in its column only; a NaN q code gives NaN
    across its row's keys (the routes that read whole pages carry the page's NaN bytes past
    the length into the MMA, which must not reach a visible column)."""
    q8, cache, w, lens, table = _inputs(9, [100], 1, 64, minus_one=False)
    slot = int(table[0, 1]) * 64 + 2
    k = torch.randn(1, D, dtype=torch.float64).bfloat16()
    k[0, 7] = float("nan")
    ref.indexer_k_quant_and_cache(k, cache, torch.tensor([slot]))
    plan = LogitsPlan(paged_loads=route)
    got = fp8_paged_mqa_logits(*_on((q8, cache, w, lens, table)), 128, plan=plan).cpu()
    assert torch.isnan(got[0, 66]) and torch.isnan(got[0]).sum() == 1
    assert torch.isneginf(got[0, 100:]).all()
    q_nan = q8.clone().view(torch.uint8)
    q_nan[0, 0, 3, 0] = 0x7F
    got = fp8_paged_mqa_logits(*_on((q_nan.view(torch.float8_e4m3fn), cache, w, lens, table)),
                               128, plan=plan).cpu()
    assert torch.isnan(got[0, :100]).all() and torch.isneginf(got[0, 100:]).all()


def test_route_falls_back_where_the_cache_forbids_it():
    plan = LogitsPlan()
    assert paged_loads(plan, torch.empty(4, 48, 132, dtype=torch.uint8)) == "gather"
    assert paged_loads(LogitsPlan(block_n=16), torch.empty(4, 48, 132,
                                                           dtype=torch.uint8)) == "page"
    with pytest.raises(ValueError, match="LogitsPlan.paged_loads"):
        LogitsPlan(paged_loads="bulk")
    with pytest.raises(ValueError, match="LogitsPlan.max_tiles"):
        LogitsPlan(max_tiles=3)
    with pytest.raises(ValueError, match="LogitsPlan.programs_per_sm"):
        LogitsPlan(programs_per_sm=0)


# ---- the argument checks, one function for the reference and the fast path ------------------

def _bad_calls():
    q8, cache, w, lens, table = _inputs(3, [20, 3], 1, 16)
    return {
        "q dims": (q8[0], cache, w, lens, table, 24),
        "q dtype": (q8.float(), cache, w, lens, table, 24),
        "q last dim": (q8[..., :64], cache, w, lens, table, 24),
        "cache bytes": (q8, cache[..., :130], w, lens, table, 24),
        "cache dtype": (q8, cache.float(), w, lens, table, 24),
        "weights shape": (q8, cache, w[:1], lens, table, 24),
        "weights dtype": (q8, cache, w.int(), lens, table, 24),
        "lens shape": (q8, cache, w, lens[:1], table, 24),
        "lens dtype": (q8, cache, w, lens.float(), table, 24),
        "table rows": (q8, cache, w, lens, table[:1], 24),
        "table dims": (q8, cache, w, lens, table[0], 24),
        "max_model_len": (q8, cache, w, lens, table, -1),
        "max_model_len type": (q8, cache, w, lens, table, 24.0),
    }


@pytest.mark.parametrize("name", list(_bad_calls()))
def test_bad_arguments_same_error_as_the_reference(name: str):
    """Each bad argument raises the reference's error, message and type, from the fast path:
    the checks live in one function (``check_paged_logits_args``)."""
    args = _bad_calls()[name]
    with pytest.raises((TypeError, ValueError)) as want:
        ref.fp8_paged_mqa_logits(*args)
    on = tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)
    with pytest.raises(want.type, match=re.escape(str(want.value))):
        fp8_paged_mqa_logits(*on)


def test_ragged_checks_shared_with_the_reference():
    q = torch.zeros(3, 4, D, dtype=torch.uint8)
    kv = (torch.zeros(5, D, dtype=torch.uint8), torch.ones(5))
    w = torch.ones(3, 4)
    ks = torch.zeros(3, dtype=torch.int32)
    for bad in [(q, list(kv), w, ks, ks + 1), (q, kv, w[:2], ks, ks + 1),
                (q, (kv[0], kv[1][:4]), w, ks, ks + 1), (q, kv, w, ks, ks + 6)]:
        with pytest.raises((TypeError, ValueError)) as want:
            ref.fp8_mqa_logits(*bad)
        on = tuple(tuple(x.to(DEVICE) for x in a) if isinstance(a, tuple) else
                   a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in bad)
        with pytest.raises(want.type, match=re.escape(str(want.value))):
            fp8_mqa_logits(*on, validate=True)
