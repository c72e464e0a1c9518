"""The lightning indexer's fast path (``mla.fast.indexer_k_quant_and_cache``,
``fp8_mqa_logits``, ``fp8_paged_mqa_logits``) against the reference; ``top_k_per_row`` in
``tests/test_fast_topk.py``.

Under ``TRITON_INTERPRET=1`` on the CPU (conftest sets it without a GPU) with small shapes; the
same tests run compiled on a GPU. The cache write is held to the reference byte for byte on a
cache poisoned with ``0xFF`` (NaN as e4m3 and as float32 scale); the logits to the float64
reference within the budget of the device's accumulation (``logits_budget``, in
``mla.compare.logits_err``'s measure: the error over the magnitude, the reference's logits with
the weights' absolute values). What the kernels
compile to for sm_90 is checked on any machine (``benchmarks/indexer_compile.py``).
"""

from __future__ import annotations

import pytest
import torch
from _compiled import compiled

import mla.reference as ref
from mla.compare import logits_err, poison_like
from mla.conformance.cases.indexer import as_sets
from mla.fast import fp8_mqa_logits, fp8_paged_mqa_logits, indexer_k_quant_and_cache
from mla.fast import top_k_per_row as fast_top_k_per_row
from mla.fast.indexer.logits import LogitsPlan, logits_budget
from mla.reference.paged_cache import make_block_table

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D = 128


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- the cache write --------------------------------------------------------------------------

def _keys(g: torch.Generator, n: int, dtype: torch.dtype = torch.bfloat16,
          spread: int = 6) -> torch.Tensor:
    gain = 2.0 ** torch.randint(-spread, spread + 1, (n, 1), generator=g)
    return (torch.randn(n, D, generator=g, dtype=torch.float64) * gain).to(dtype)


def _both_writes(k: torch.Tensor, slots: torch.Tensor, blocks: int, page: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fast, reference) caches after writing ``k`` at ``slots`` into the same poisoned cache,
    both on the test's device: the sign of the NaN that ``inf / inf`` gives is the platform's
    (negative on x86, positive on CUDA), in the reference as in the kernel."""
    cache = poison_like(torch.empty(blocks, page, 132, dtype=torch.uint8, device=DEVICE))
    want = cache.clone()
    ref.indexer_k_quant_and_cache(k.to(DEVICE), want, slots.to(DEVICE))
    got = cache.clone()
    indexer_k_quant_and_cache(k.to(DEVICE), got, slots.to(DEVICE))
    return got.cpu(), want.cpu()


def _assert_same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    bad = torch.nonzero(got != want)
    assert len(bad) == 0, (f"{len(bad)} bytes differ, first at {bad[0].tolist()}: "
                           f"{int(got[tuple(bad[0])])} vs {int(want[tuple(bad[0])])}")


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("tokens", [1, 17, 40])
def test_cache_write_bytes(page: int, tokens: int):
    """Scattered slots, tokens not a multiple of the program's 16, keys over 2^±6 (bf16, as
    vLLM passes them)."""
    g = _gen(page * 100 + tokens)
    blocks = -(-tokens // page) + 2
    slots = torch.randperm(blocks * page, generator=g)[:tokens]
    _assert_same_bytes(*_both_writes(_keys(g, tokens), slots, blocks, page))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_cache_write_bytes_other_dtypes(dtype: torch.dtype):
    g = _gen(3)
    slots = torch.randperm(48, generator=g)[:33]
    _assert_same_bytes(*_both_writes(_keys(g, 33, dtype), slots, 3, 16))


def test_cache_write_adversarial_values():
    """Rows at the scale's boundary (amax = 448·2^j exactly, and one bf16 step either side),
    e4m3 rounding ties, zeros, the 1e-4 floor, subnormal codes, huge values, NaN elements and
    whole NaN rows, infinities."""
    rows = []
    for j in (-20, -3, 0, 5, 100):
        for f in (1.75, 1.7421875, 1.7578125):  # 448·2^j, and the bf16 neighbours of 1.75
            r = torch.linspace(-1, 1, D, dtype=torch.float64) * f * 2.0 ** (j + 8)
            rows.append(r)
    tie = torch.zeros(D, dtype=torch.float64)
    tie[0] = 448.0  # scale 1: the rest are e4m3 values and midpoints between them
    tie[1:64] = torch.tensor([1.0625, 1.1875, 0.0029296875, 0.0009765625, -0.0048828125,
                              17.0, 19.0, 240.0, 232.0, 0.013671875] * 6 + [3.0, 5.0, 7.0],
                             dtype=torch.float64)
    rows.append(tie)
    rows.append(torch.zeros(D, dtype=torch.float64))
    rows.append(torch.full((D,), 3e-5, dtype=torch.float64))  # below the floor on amax
    rows.append(torch.full((D,), -2.0 ** -130, dtype=torch.float64))  # subnormal in float32
    huge = torch.linspace(-3e38, 3e38, D, dtype=torch.float64)
    rows.append(huge)
    nan_some = torch.linspace(-5, 5, D, dtype=torch.float64)
    nan_some[[0, 7, 127]] = float("nan")
    rows.append(nan_some)
    rows.append(torch.full((D,), float("nan"), dtype=torch.float64))
    inf_row = torch.linspace(-5, 5, D, dtype=torch.float64)
    inf_row[9] = float("inf")
    rows.append(inf_row)
    k = torch.stack(rows).float()
    n = k.shape[0]
    slots = torch.randperm(64, generator=_gen(5))[:n]
    _assert_same_bytes(*_both_writes(k, slots, 4, 16))


def test_cache_write_skips_padding_and_empty():
    g = _gen(7)
    k = _keys(g, 20)
    slots = torch.randperm(32, generator=g)[:20]
    slots[[0, 9, 19]] = -1
    got, want = _both_writes(k, slots, 2, 16)
    _assert_same_bytes(got, want)
    untouched = poison_like(torch.empty(2, 16, 132, dtype=torch.uint8))
    written = torch.zeros(2 * 16 * 132, dtype=torch.bool)
    for s in slots[slots >= 0].tolist():
        p, o = divmod(s, 16)
        written[p * 16 * 132 + o * 128: p * 16 * 132 + o * 128 + 128] = True
        written[p * 16 * 132 + 16 * 128 + 4 * o: p * 16 * 132 + 16 * 128 + 4 * o + 4] = True
    assert torch.equal(got.view(-1)[~written], untouched.view(-1)[~written])
    empty, _ = _both_writes(k[:0], slots[:0], 2, 16)
    _assert_same_bytes(empty, untouched)


def test_cache_write_a_broken_twin_fails():
    """The byte comparison bites: the reference with scales not rounded to a power of two."""
    g = _gen(8)
    k = _keys(g, 5)
    slots = torch.arange(5)
    got, want = _both_writes(k, slots, 1, 16)
    twin = poison_like(torch.empty(1, 16, 132, dtype=torch.uint8))
    ref.indexer_k_quant_and_cache(k, twin, slots, scale_fmt=None)
    _assert_same_bytes(got, want)
    with pytest.raises(AssertionError, match="bytes differ"):
        _assert_same_bytes(got, twin)


def test_cache_write_refuses_bad_input():
    cache = torch.zeros(2, 16, 132, dtype=torch.uint8, device=DEVICE)
    k = torch.zeros(3, D, device=DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping must lie in"):
        indexer_k_quant_and_cache(k, cache, torch.tensor([0, 32, 1], device=DEVICE),
                                  validate=True)
    with pytest.raises(ValueError, match="slot_mapping must lie in"):
        indexer_k_quant_and_cache(k, cache, torch.tensor([0, -2, 1], device=DEVICE),
                                  validate=True)
    # unvalidated, a slot outside the cache is never written (nor is anything else)
    indexer_k_quant_and_cache(k, cache, torch.tensor([-2, 32, 10**9], device=DEVICE),
                              validate=False)
    assert int(cache.count_nonzero()) == 0
    with pytest.raises(ValueError, match=r"\[num_blocks, block_size, 132\]"):
        indexer_k_quant_and_cache(k, torch.zeros(2, 16, 656, dtype=torch.uint8,
                                                 device=DEVICE), slots)
    with pytest.raises(ValueError, match="k"):
        indexer_k_quant_and_cache(torch.zeros(3, 64, device=DEVICE), cache, slots)
    with pytest.raises(ValueError, match="quant_block_size"):
        indexer_k_quant_and_cache(k, cache, slots, quant_block_size=64)
    with pytest.raises(ValueError, match="scale_fmt"):
        indexer_k_quant_and_cache(k, cache, slots, scale_fmt=None)
    with pytest.raises((TypeError, ValueError), match="kv_cache"):
        indexer_k_quant_and_cache(k, cache.float(), slots)


# ---- the logits -------------------------------------------------------------------------------

def _fp8_q(g: torch.Generator, rows: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 ``q [rows, heads, 128]`` and float32 weights with q's scale folded in."""
    q = torch.randn(rows, heads, D, generator=g, dtype=torch.float64)
    w = torch.randn(rows, heads, generator=g, dtype=torch.float64) * (heads * D) ** -0.5
    return ref.quantize_indexer_q(q, w)


def _check_logits(got: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor, int]) -> float:
    """Within the budget against ``want = (logits, magnitude, heads)``, with the reference's
    ``-inf`` exactly where it has them."""
    logits, mag, heads = want
    assert got.dtype == torch.float32 and got.shape == logits.shape
    got = got.cpu()
    assert torch.equal(torch.isneginf(got), torch.isneginf(logits)), "-inf pattern differs"
    err = logits_err(got, logits, mag)
    limit = logits_budget(DEVICE, heads)
    assert err <= limit, f"logits: logits_err {err:.3e} > {limit:.1e}"
    return err


def _ragged_want(args: tuple) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The float64 reference's ragged logits, their magnitude (the weights' absolute values)
    and the number of heads."""
    w = args[2].double()
    return (ref.fp8_mqa_logits(*args[:2], w, *args[3:]),
            ref.fp8_mqa_logits(*args[:2], w.abs(), *args[3:]), w.shape[1])


def _paged_want(args: tuple, width: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """As ``_ragged_want`` for the paged logits."""
    w = args[2].double()
    return (ref.fp8_paged_mqa_logits(*args[:2], w, *args[3:], width),
            ref.fp8_paged_mqa_logits(*args[:2], w.abs(), *args[3:], width), w.shape[1])


def _ragged(g: torch.Generator, lens: list[int], queries: int, heads: int = 64):
    """Requests of ``lens`` keys in one flat array, each asking with its last ``queries``
    positions; a NaN key (code and scale) after the last request that no query may see."""
    codes, scale = ref.quantize_indexer_k(_keys(g, sum(lens) + 1, spread=4))
    codes[-1], scale[-1] = 0x7F, float("nan")
    ks, ke, first = [], [], 0
    for n in lens:
        for p in range(max(0, n - queries), n):
            ks.append(first)
            ke.append(first + p + 1)
        first += n
    q8, w = _fp8_q(g, len(ks), heads)
    return (q8, (codes.view(torch.float8_e4m3fn), scale), w,
            torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32))


def _on(device: str, args: tuple) -> tuple:
    return tuple(_on(device, a) if isinstance(a, tuple) else
                 a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("lens,queries,heads", [
    ([1, 17, 70], 8, 64),      # rows of 1 to 70 keys; 22 queries, not a multiple of 4
    ([200, 3], 5, 64),         # keys past several tiles, a short request after
    ([33, 9], 9, 3),           # 3 heads: padded to 16 with zero weights
    ([130], 2, 128),           # 128 heads: two queries a program
])
def test_ragged_logits(lens: list[int], queries: int, heads: int):
    args = _ragged(_gen(sum(lens) + heads), lens, queries, heads)
    got = fp8_mqa_logits(*_on(DEVICE, args))
    _check_logits(got, _ragged_want(args))


@pytest.mark.parametrize("lens,queries,extra", [
    ([1, 17, 70], 8, 0),        # as wide as the longest row
    ([1, 17, 70], 8, 37),       # wider: -inf after each row, columns past the last key
    ([200, 3], 5, 11),          # a row over several tiles; compressed rows past the keys
    ([3, 1, 4, 1, 5, 9, 2, 6], 9, 2),  # every query of short requests: tiles across requests
])
def test_ragged_logits_compressed(lens: list[int], queries: int, extra: int):
    """``max_seqlen_k``: column ``j`` of row ``t`` holds key ``ks[t] + j`` (the reference's
    ``compressed_rows`` of its full rows), ``-inf`` from ``ke - ks`` on, including columns
    whose key would lie past the last one; the top-k over them with starts 0 and ends
    ``ke - ks`` is the top-k over the full rows, fast and reference alike."""
    args = _ragged(_gen(sum(lens) + extra), lens, queries)
    q8, kv, w, ks, ke = args
    m = int((ke - ks).max()) + extra
    logits, mag, heads = _ragged_want(args)
    want = (ref.compressed_rows(logits, ks, ke, m), ref.compressed_rows(mag, ks, ke, m), heads)
    assert torch.equal(want[0], ref.fp8_mqa_logits(q8, kv, w.double(), ks, ke, m))
    got = fp8_mqa_logits(*_on(DEVICE, args), m, validate=True)
    assert got.shape == (len(ks), m)
    _check_logits(got, want)
    if extra:  # (ks + j past the keys: no chunk of the key array holds them)
        assert torch.isneginf(got[:, int((ke - ks).max()):].cpu()).all()
    k = 4
    zero = torch.zeros_like(ks)
    full = ref.top_k_per_row(logits, ks, ke, k)
    assert torch.equal(ref.top_k_per_row(want[0], zero, ke - ks, k), full)
    fast_full = fast_top_k_per_row(fp8_mqa_logits(*_on(DEVICE, args)), *_on(DEVICE, (ks, ke)),
                                   k).cpu()
    fast_compressed = fast_top_k_per_row(got, *_on(DEVICE, (zero, ke - ks)), k).cpu()
    assert torch.equal(as_sets(fast_compressed), as_sets(fast_full))


def test_ragged_logits_one_tile_a_program():
    """Programs of one tile of 16 keys: most hold no key their queries see (past the
    diagonal, or another request's keys) and only write ``-inf``, loading no queries; full
    rows and compressed rows, tiles across requests among them."""
    plan = LogitsPlan(block_n=16, queries=2, stages=1, max_tiles=1)
    args = _ragged(_gen(33), [40, 3, 25, 1], 40)
    q8, kv, w, ks, ke = args
    logits, mag, heads = _ragged_want(args)
    _check_logits(fp8_mqa_logits(*_on(DEVICE, args), plan=plan), (logits, mag, heads))
    m = int((ke - ks).max()) + 5
    want = (ref.compressed_rows(logits, ks, ke, m), ref.compressed_rows(mag, ks, ke, m), heads)
    _check_logits(fp8_mqa_logits(*_on(DEVICE, args), m, plan=plan), want)


def test_ragged_logits_rows_that_see_no_key():
    """Queries whose range is empty (``ke == ks``, and ``ke < ks``, which the checks allow):
    rows of ``-inf``, full or compressed, the other rows as the reference's."""
    args = _ragged(_gen(20), [12, 30], 6)
    q8, kv, w, ks, ke = args
    ke = ke.clone()
    ke[0], ke[7] = ks[0], ks[7] - 3
    args = (q8, kv, w, ks, ke)
    logits, mag, heads = _ragged_want(args)
    for m in (0, int((ke - ks).max()) + 2):
        want = (logits, mag, heads) if not m else (
            ref.compressed_rows(logits, ks, ke, m), ref.compressed_rows(mag, ks, ke, m), heads)
        got = fp8_mqa_logits(*_on(DEVICE, args), m)
        _check_logits(got, want)
        assert torch.isneginf(got[[0, 7]].cpu()).all()


def test_ragged_logits_compressed_refuse_bad_input():
    """A row longer than ``max_seqlen_k`` (validated), a negative or non-int width: errors
    that name the argument, in the reference and the fast path; unvalidated, a row keeps its
    first ``max_seqlen_k`` keys."""
    args = _ragged(_gen(19), [9, 4], 9)
    q8, kv, w, ks, ke = args
    for fn in (ref.fp8_mqa_logits, lambda *a: fp8_mqa_logits(*a, validate=True)):
        with pytest.raises(ValueError, match="max_seqlen_k must hold every query's keys"):
            fn(*_on(DEVICE, args), 8)
        for bad in (-1, True, 2.0):
            with pytest.raises(ValueError, match="max_seqlen_k must be a non-negative int"):
                fn(*_on(DEVICE, args), bad)
    with pytest.raises(ValueError, match="max_seqlen_k plus the keys must be below 2\\^30"):
        fp8_mqa_logits(*_on(DEVICE, args), (1 << 30) - 10)  # (before allocating the rows)
    got = fp8_mqa_logits(*_on(DEVICE, args), 8, validate=False).cpu()
    full = ref.fp8_mqa_logits(q8, kv, w.double(), ks, ke)
    clipped = ref.compressed_rows(full, ks, torch.minimum(ke, ks + 8), 8)
    assert torch.equal(torch.isneginf(got), torch.isneginf(clipped))
    none = fp8_mqa_logits(*_on(DEVICE, (q8, (kv[0][:0], kv[1][:0]), w, ks * 0, ke * 0)), 3)
    assert none.shape == (len(ks), 3) and torch.isneginf(none).all()


def _paged(g: torch.Generator, lens: list[int], next_n: int, page: int, heads: int = 64,
           minus_one: bool = False):
    """The cache holds each request's keys at shuffled pages; every other byte is 0xFF (NaN);
    unused table entries point at a NaN page, or hold -1."""
    table, nb = make_block_table(lens, page, spare_blocks=1,
                                 seed=int(torch.randint(1 << 30, (1,), generator=g)))
    cache = poison_like(torch.empty(nb, page, 132, dtype=torch.uint8))
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        ref.indexer_k_quant_and_cache(_keys(g, n, spread=4), cache,
                                      table[b].long()[pos // page] * page + pos % page)
    if not minus_one:
        table = torch.where(table < 0, nb - 1, table)
    q8, w = _fp8_q(g, len(lens) * next_n, heads)
    return (q8.view(len(lens), next_n, heads, D), cache, w,
            torch.tensor(lens, dtype=torch.int32), table.to(torch.int32))


@pytest.mark.parametrize("lens,next_n,page,heads,minus_one", [
    ([1, 65, 130], 1, 64, 64, False),
    ([15, 16, 17, 1], 2, 16, 64, True),
    ([0, 1, 2, 9], 3, 16, 64, False),      # the first queries of short requests see no key
    ([66, 130, 4], 4, 64, 64, True),      # the diagonal across a page edge
    ([1, 2, 17], 1, 1, 64, False),
    ([40, 7], 2, 16, 5, False),           # 5 heads, padded to 16
])
def test_paged_logits(lens: list[int], next_n: int, page: int, heads: int, minus_one: bool):
    args = _paged(_gen(sum(lens) + next_n + page), lens, next_n, page, heads, minus_one)
    width = max(lens) + 67  # columns past every length: -inf, and a tile past them all
    got = fp8_paged_mqa_logits(*_on(DEVICE, args), width)
    _check_logits(got, _paged_want(args, width))


@pytest.mark.parametrize("plan", [LogitsPlan(block_n=128, queries=2, stages=3),
                                  LogitsPlan(block_n=16, queries=1, stages=1)])
def test_logits_other_plans(plan: LogitsPlan):
    """Tiles of 128 and of 16 keys, one or two prefill queries a program, 1 or 3 stages: the
    same logits."""
    args = _paged(_gen(31), [150, 17], 2, 16)
    _check_logits(fp8_paged_mqa_logits(*_on(DEVICE, args), 160, plan=plan),
                  _paged_want(args, 160))
    args = _ragged(_gen(32), [140, 30], 5)
    _check_logits(fp8_mqa_logits(*_on(DEVICE, args), plan=plan), _ragged_want(args))
    with pytest.raises(ValueError, match="LogitsPlan.block_n"):
        LogitsPlan(block_n=48)
    with pytest.raises(ValueError, match="LogitsPlan.stages"):
        LogitsPlan(stages=0)


def test_paged_logits_deepgemm_cache_view_and_uint8_q():
    q8, cache, w, lens, table = _paged(_gen(11), [20, 3], 1, 16)
    want = _paged_want((q8, cache, w, lens, table), 24)
    args = _on(DEVICE, (q8.view(torch.uint8), cache[:, :, None], w, lens, table))
    _check_logits(fp8_paged_mqa_logits(*args, 24), want)


def test_logits_nan_in_nan_out():
    """A NaN key inside a row's range (a NaN element, written by the cache as 0x7F) gives NaN
    in that column, never 0 or -inf; a NaN q element gives NaN across the row's keys."""
    q8, cache, w, lens, table = _paged(_gen(12), [20], 1, 16)
    k = _keys(_gen(13), 1)
    k[0, 5] = float("nan")
    slot = int(table[0, 0]) * 16 + 3
    ref.indexer_k_quant_and_cache(k, cache, torch.tensor([slot]))
    got = fp8_paged_mqa_logits(*_on(DEVICE, (q8, cache, w, lens, table)), 20).cpu()
    assert torch.isnan(got[0, 3]) and not torch.isnan(got[0, :3]).any()
    q_nan = q8.clone().view(torch.uint8)
    q_nan[0, 0, 7, 9] = 0x7F
    got = fp8_paged_mqa_logits(*_on(DEVICE, (q_nan.view(torch.float8_e4m3fn), cache, w, lens,
                                             table)), 20).cpu()
    assert torch.isnan(got[0, :20]).all()


def test_logits_empty():
    q8, cache, w, lens, table = _paged(_gen(14), [5], 1, 16)
    out = fp8_paged_mqa_logits(*_on(DEVICE, (q8, cache, w, lens * 0, table)), 0)
    assert out.shape == (1, 0)
    none = fp8_paged_mqa_logits(*_on(DEVICE, (q8[:0], cache, w[:0], lens[:0], table[:0])), 7)
    assert none.shape == (0, 7)
    q8, kv, w, ks, ke = _ragged(_gen(15), [4], 2)
    assert fp8_mqa_logits(*_on(DEVICE, (q8[:0], kv, w[:0], ks[:0], ke[:0]))).shape == (0, 5)
    empty_kv = (kv[0][:0], kv[1][:0])
    got = fp8_mqa_logits(*_on(DEVICE, (q8, empty_kv, w, ks * 0, ke * 0)))
    assert got.shape == (2, 0)


def test_logits_a_broken_twin_fails():
    """The budget bites: logits 1% off, or with one head's weight dropped, or the causal rule
    one key short, fail the check that the kernel passes, and so does a plain float32
    computation of the logits."""
    args = _paged(_gen(16), [70, 9], 2, 16)
    got = fp8_paged_mqa_logits(*_on(DEVICE, args), 72)
    want = _paged_want(args, 72)
    _check_logits(got, want)
    q8, cache, w, lens, table = args
    _check_logits(ref.fp8_paged_mqa_logits(q8, cache, w, lens, table, 72), want)  # float32
    one_head = w.clone()
    one_head[:, 7] = 0.0
    for wrong in (ref.fp8_paged_mqa_logits(q8, cache, w, lens, table, 72) * 1.01,
                  ref.fp8_paged_mqa_logits(q8, cache, one_head, lens, table, 72)):
        with pytest.raises(AssertionError, match="logits_err"):
            _check_logits(wrong, want)
    with pytest.raises(AssertionError, match="-inf pattern"):
        _check_logits(got, (ref.fp8_paged_mqa_logits(q8, cache, w.double(), lens - 1, table,
                                                      72), *want[1:]))


def test_logits_refuse_bad_input():
    q8, cache, w, lens, table = _on(DEVICE, _paged(_gen(17), [20, 3], 1, 16))
    with pytest.raises(ValueError, match="context_lens"):
        fp8_paged_mqa_logits(q8, cache, w, lens, table, 10, validate=True)
    bad = table.clone()
    bad[0, 1] = 999
    with pytest.raises(ValueError, match=r"block_tables\[0\] points outside"):
        fp8_paged_mqa_logits(q8, cache, w, lens, bad, 24, validate=True)
    with pytest.raises(ValueError, match="blocks of 16"):
        fp8_paged_mqa_logits(q8, cache, w, lens, table[:, :1], 24, validate=True)
    with pytest.raises(ValueError, match="q's last dim"):
        fp8_paged_mqa_logits(q8[..., :64], cache, w, lens, table, 24)
    with pytest.raises((TypeError, ValueError), match="q"):
        fp8_paged_mqa_logits(q8.float(), cache, w, lens, table, 24)
    with pytest.raises(ValueError, match="weights"):
        fp8_paged_mqa_logits(q8, cache, w[:1], lens, table, 24)
    with pytest.raises(ValueError, match="max_model_len"):
        fp8_paged_mqa_logits(q8, cache, w, lens, table, -1)
    # unvalidated, a page outside the cache gives NaN for its keys, never another key
    got = fp8_paged_mqa_logits(q8, cache, w, lens, bad, 24, validate=False).cpu()
    assert torch.isnan(got[0, 16:20]).all() and not torch.isnan(got[0, :16]).any()
    q8, kv, w, ks, ke = _on(DEVICE, _ragged(_gen(18), [6], 3))
    with pytest.raises(ValueError, match="cu_seqlen_ks / cu_seqlen_ke"):
        fp8_mqa_logits(q8, kv, w, ks, ke + 5, validate=True)
    with pytest.raises(TypeError, match="kv must be a tuple"):
        fp8_mqa_logits(q8, list(kv), w, ks, ke)


# ---- what the kernels compile to on sm_90 -----------------------------------------------------

def test_kernels_compile_for_sm90():
    """Every kernel compiles for the H200 (in a child process without the interpreter, which
    cannot compile for a GPU): no spills, shared memory within a program's limit, and the
    logits' dots on the FP8 tensor cores (e4m3 ``wgmma``)."""
    found = compiled(["-m", "benchmarks.indexer_compile", "--json"], timeout=600)
    assert len(found) == 8  # 5 indexer kernels (ragged full and compressed), 3 of the top-k
    for name, f in found.items():
        assert f["stack"] == 0 and f["local"] == 0 and not f["ptx_local"], f"{name} spills"
        assert f["shared"] <= 232448, f"{name}: {f['shared']} B of shared memory"
        e4m3 = [s for s in f["wgmma"] if s.endswith(".e4m3.e4m3")]
        assert bool(e4m3) == name.startswith(("paged", "ragged")), f"{name}: {f['wgmma']}"
