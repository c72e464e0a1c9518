"""DeepSeek-V4's conventions on the fast sparse kernels (conventions §14): attention sinks, the
MODEL1 cache, a second KV scope, rows of ``d_qk = 512``, against the float64 reference.

Runs under ``TRITON_INTERPRET=1`` on the CPU (conftest), so q is float32/float16 and shapes
are small (1-4 heads, top-k lengths that are not multiples of the tiles, pages of 1, 16 and
64). Every buffer the wrappers allocate starts as NaN; cache rows no index names hold NaN
(MODEL1: NaN scale bytes 0xFF and NaN rope values). Each convention has a broken twin: the
same call with the convention undone is checked to land outside the budget, so the budget
check can fail. The last tests pin the policy without value checks (``validate=False``): a
length outside ``[0, topk]``, or a decode entry outside ``[-1, slots)``, is a NaN query.
"""

from __future__ import annotations

import math

import pytest
import torch
from _compiled import compiled
from _nan_rule import assert_nan_rule

from mla import compare
from mla.compare import assert_close, budget, rel_err
from mla.fast import SparsePlan, sparse_mla_decode, sparse_mla_prefill
from mla.fast.sparse.plan import MODEL1_KERNELS
from mla.reference.fp8_model1 import (
    fp8_model1_cache,
    fp8_model1_page_bytes,
    fp8_model1_rows,
    quantize_fp8_model1,
)
from mla.reference.sparse import sparse_mla_decode as ref_decode
from mla.reference.sparse import sparse_mla_prefill as ref_prefill

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
I32 = torch.int32
D4 = 512  # DeepSeek-V4's row: 448 nope + 64 rope, V the whole row
SPLITS = [None, SparsePlan(16, 16, 3, 4, 1)]  # the interpreter's default (4 SMs) and 3 splits
# float32 budgets (conventions §11) of the checks whose inputs are float32
OUT32 = budget("sparse_mla_decode", torch.float32, "out_rel")
LSE32 = budget("sparse_mla_decode", torch.float32, "lse_abs")


@pytest.fixture(autouse=True)
def poisoned_alloc():
    with compare.poisoned_alloc():
        yield


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sink(N: int, g: torch.Generator, keys: int) -> torch.Tensor:
    """Finite sinks near the lse of ``keys`` unit logits, head 0 ``+inf``, head 1 ``-inf``."""
    s = torch.randn(N, generator=g) * 1.5 + math.log(keys)
    s[:2] = torch.tensor([math.inf, -math.inf])[:N]
    return s.float().to(DEVICE)


def model1_cache(nb: int, bs: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[nb, bs, 584]`` MODEL1 view (a tile of another scale per row) and the written
    slots; the others hold NaN (scale bytes 0xFF, NaN rope)."""
    n = nb * bs
    used = torch.randperm(n, generator=g)[: max(1, (2 * n) // 3)]
    rows = torch.full((n, D4), float("nan"), dtype=torch.float64)
    rows[used] = torch.randn(len(used), D4, generator=g, dtype=torch.float64)
    rows[used, 64:128] *= 1e-3
    pages = quantize_fp8_model1(rows.view(nb, bs, D4)).to(DEVICE)
    return fp8_model1_cache(pages, bs), used


def plain_cache(nb: int, bs: int, D: int, dtype: torch.dtype, g: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    n = nb * bs
    used = torch.randperm(n, generator=g)[: max(1, (2 * n) // 3)]
    flat = torch.full((n, D), float("nan"), dtype=torch.float64)
    flat[used] = torch.randn(len(used), D, generator=g, dtype=torch.float64)
    return flat.to(dtype).view(nb, bs, D).to(DEVICE), used


def pick(g: torch.Generator, shape: tuple[int, ...], used: torch.Tensor,
         minus_one: float = 0.2) -> torch.Tensor:
    """Slots drawn from ``used`` (repeats included), a share of them ``-1``."""
    idx = used[torch.randint(len(used), shape, generator=g)].to(I32)
    idx[torch.rand(shape, generator=g) < minus_one] = -1
    return idx.to(DEVICE)


def _cpu(kw: dict) -> dict:
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def check_decode(q, cache, idx, fp8, lens=None, plan=None, **v4):
    """The fast decode against the float64 reference (a MODEL1 cache is read by the reference
    itself; a plain cache is upcast); returns both results."""
    out, lse = sparse_mla_decode(q, cache, idx, D4 ** -0.5, fp8, lens, 512, plan=plan,
                                 validate=True, **v4)
    ref_v4 = _cpu(v4)
    if not fp8 and "extra_k_cache" in ref_v4:
        ref_v4["extra_k_cache"] = ref_v4["extra_k_cache"].double()
    r_out, r_lse = ref_decode(q.double().cpu(), cache.cpu() if fp8 else cache.double().cpu(),
                              idx.cpu(), D4 ** -0.5, fp8, None if lens is None else lens.cpu(),
                              512, **ref_v4)
    assert out.shape == r_out.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    assert_close(out, r_out, budget("sparse_mla_decode", q.dtype, "out_rel"), name="out")
    assert_close(lse, r_lse, name="lse", abs_tol=budget("sparse_mla_decode", q.dtype, "lse_abs"))
    return (out, lse), (r_out, r_lse)


# ---- MODEL1 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bs,plan", [(64, None), (1, SPLITS[1]), (16, SparsePlan(16, 64, 2, 4, 1))])
def test_model1_decode(q_dtype, bs, plan):
    """The MODEL1 pages read by the kernel: pages of 64, 1 and 16 tokens, -1 entries and
    repeats, ragged topk_length (0: lonely), top-k 37 (not a tile multiple), NaN in every row
    no index names. Broken twin: the scale bytes ignored (every tile read at scale 1)."""
    g = _gen(bs)
    cache, used = model1_cache(max(2, 96 // bs), bs, g)
    q = torch.randn(3, 2, 2, D4, generator=g).to(q_dtype).to(DEVICE)
    idx = pick(g, (3, 2, 37), used)
    lens = torch.tensor([37, 0, 20], dtype=I32, device=DEVICE)
    (out, lse), (r_out, _) = check_decode(q, cache, idx, True, lens, plan)
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()
    pages = cache.as_strided((cache.shape[0], cache.stride(0)), (cache.stride(0), 1)).clone()
    codes = pages[:, 576 * bs:584 * bs].unflatten(1, (bs, 8))[..., :7]
    codes.copy_(torch.where(codes == 0xFF, 0xFF, 127))  # every scale 1, NaN kept
    unscaled, _ = sparse_mla_decode(q, fp8_model1_cache(pages, bs), idx, D4 ** -0.5, True,
                                    lens, plan=plan)
    assert rel_err(unscaled, r_out) > 100 * budget("sparse_mla_decode", q_dtype, "out_rel")


def test_model1_layouts_and_padding():
    """FlashMLA's ``[nb, bs, 1, 584]`` view of the same pages gives the same bits; the pages'
    padding bytes are never read (poisoned, same result)."""
    g = _gen(3)
    cache, used = model1_cache(3, 16, g)
    q = torch.randn(2, 1, 3, D4, generator=g).to(DEVICE)
    idx = pick(g, (2, 1, 40), used)
    out, lse = sparse_mla_decode(q, cache, idx, 0.05, True)
    out4, lse4 = sparse_mla_decode(q, cache[:, :, None], idx, 0.05, True)
    assert torch.equal(out, out4) and torch.equal(lse, lse4)
    pages = cache.as_strided((3, cache.stride(0)), (cache.stride(0), 1)).clone()
    pages[:, 584 * 16:] = 0xFF
    out_p, lse_p = sparse_mla_decode(q, fp8_model1_cache(pages, 16), idx, 0.05, True)
    assert torch.equal(out, out_p) and torch.equal(lse, lse_p)


# ---- rows of 512 on plain caches, and the prefill ------------------------------------------

@pytest.mark.parametrize("plan", SPLITS)
def test_d512_plain_cache_decode_and_prefill(plan):
    """d_qk = head_dim_v = 512 (no rope columns apart: V is the whole row) on a cache in q's
    dtype, and the prefill over ``kv [s_kv, 512]`` with indices ``>= s_kv`` and ``< -1``."""
    g = _gen(4)
    cache, used = plain_cache(5, 16, D4, torch.float16, g)
    q = torch.randn(2, 2, 3, D4, generator=g).to(torch.float16).to(DEVICE)
    check_decode(q, cache, pick(g, (2, 2, 45), used), False,
                 torch.tensor([45, 7], dtype=I32, device=DEVICE), plan)
    kv = torch.randn(40, D4, generator=g).to(DEVICE)
    qp = torch.randn(4, 3, D4, generator=g).to(DEVICE)
    idx = torch.randint(-3, 45, (4, 33), generator=g, dtype=I32).to(DEVICE)
    got = sparse_mla_prefill(qp, kv, idx, 0.04, 512, plan=plan)
    ref = ref_prefill(qp.double().cpu(), kv.double().cpu(), idx.cpu(), 0.04, 512)
    for name, a, b in zip(("out", "max_logits", "lse"), got, ref):
        quantity = "out_rel" if name == "out" else ("max_abs" if name == "max_logits" else
                                                     "lse_abs")
        tol = budget("sparse_mla_prefill", torch.float32, quantity)
        assert_close(a, b, tol if name == "out" else None, name=name,
                     abs_tol=None if name == "out" else tol)


# ---- the second KV scope --------------------------------------------------------------------

@pytest.mark.parametrize("model1", [False, True], ids=["plain", "model1"])
@pytest.mark.parametrize("plan", SPLITS)
def test_second_scope(model1, plan):
    """A second cache with its own page size (1) and indices, extra_topk_length (ragged, 0),
    first-scope lengths (0 for one request: that request sees the second scope alone); one
    query lonely in both scopes. Broken twin: the second scope ignored."""
    g = _gen(5 + model1)
    if model1:
        c1, u1 = model1_cache(3, 16, g)
        c2, u2 = model1_cache(50, 1, g)
        dt = torch.float32
    else:
        c1, u1 = plain_cache(3, 16, D4, torch.float32, g)
        c2, u2 = plain_cache(50, 1, D4, torch.float32, g)
        dt = torch.float32
    q = torch.randn(3, 2, 2, D4, generator=g).to(dt).to(DEVICE)
    idx1, idx2 = pick(g, (3, 2, 37), u1), pick(g, (3, 2, 21), u2)
    idx1[2, 1] = -1
    idx2[2, 1] = -1  # query (2, 1): lonely in both scopes
    lens1 = torch.tensor([37, 0, 30], dtype=I32, device=DEVICE)
    lens2 = torch.tensor([5, 21, 0], dtype=I32, device=DEVICE)
    (out, lse), (r_out, _) = check_decode(q, c1, idx1, model1, lens1, plan, extra_k_cache=c2,
                                          extra_indices_in_kvcache=idx2,
                                          extra_topk_length=lens2)
    assert (out[2, 1] == 0).all() and torch.isposinf(lse[2, :, 1]).all()
    one, _ = sparse_mla_decode(q, c1, idx1, D4 ** -0.5, model1, lens1, plan=plan)
    assert rel_err(one, r_out) > 1e-2


def test_second_scope_union_and_empty():
    """Both scopes naming the same rows equal one scope over the concatenated list (same
    cache, the second scope's page size 1 view of it); an all -1 second scope changes
    nothing, bit for bit."""
    g = _gen(7)
    c1, u1 = plain_cache(4, 16, D4, torch.float32, g)
    q = torch.randn(2, 1, 3, D4, generator=g).to(DEVICE)
    idx1, idx2 = pick(g, (2, 1, 30), u1), pick(g, (2, 1, 19), u1)
    flat = c1.view(64, 1, D4)  # the same rows as pages of one token: the same slots
    two, lse2 = sparse_mla_decode(q, c1, idx1, 0.05, False, extra_k_cache=flat,
                                  extra_indices_in_kvcache=idx2)
    one, lse1 = sparse_mla_decode(q, c1, torch.cat([idx1, idx2], dim=2), 0.05, False)
    assert_close(two, one, OUT32, name="out")
    assert_close(lse2, lse1, name="lse", abs_tol=LSE32)
    empty = torch.full((2, 1, 8), -1, dtype=I32, device=DEVICE)
    with_empty, lse_e = sparse_mla_decode(q, c1, idx1, 0.05, False, extra_k_cache=flat,
                                          extra_indices_in_kvcache=empty)
    alone, lse_a = sparse_mla_decode(q, c1, idx1, 0.05, False)
    assert torch.equal(with_empty, alone) and torch.equal(lse_e, lse_a)


# ---- attention sinks ------------------------------------------------------------------------

@pytest.mark.parametrize("plan", SPLITS)
def test_sink_decode(plan):
    """Per-head sinks (+inf, -inf, finite) over a MODEL1 cache and a second scope, applied once
    to the whole softmax; the lse is bit for bit the sinkless call's; a -inf sink leaves its
    head's output bit for bit; a lonely query stays 0. Broken twin: no sink."""
    g = _gen(8)
    c1, u1 = model1_cache(3, 16, g)
    c2, u2 = model1_cache(20, 1, g)
    q = torch.randn(2, 2, 4, D4, generator=g).to(DEVICE)
    idx1, idx2 = pick(g, (2, 2, 37), u1), pick(g, (2, 2, 11), u2)
    idx1[1, 0] = -1
    idx2[1, 0] = -1
    sink = _sink(4, g, 48)
    extra = dict(extra_k_cache=c2, extra_indices_in_kvcache=idx2)
    (out, lse), (r_out, _) = check_decode(q, c1, idx1, True, None, plan, attn_sink=sink,
                                          **extra)
    plain, plain_lse = sparse_mla_decode(q, c1, idx1, D4 ** -0.5, True, plan=plan, **extra)
    assert torch.equal(lse, plain_lse)
    assert (out[..., 0, :] == 0).all() and torch.equal(out[..., 1, :], plain[..., 1, :])
    assert (out[1, 0] == 0).all()
    assert rel_err(plain, r_out) > 1e-2


@pytest.mark.parametrize("plan", SPLITS)
def test_sink_prefill(plan):
    """The prefill's sink: out scaled, lse and max_logits bit for bit unchanged, a lonely
    query (all indices invalid) stays 0 / +inf / -inf."""
    g = _gen(9)
    q = torch.randn(5, 4, 40, generator=g).to(DEVICE)
    kv = torch.randn(30, 40, generator=g).to(DEVICE)
    idx = torch.randint(-2, 34, (5, 37), generator=g, dtype=I32).to(DEVICE)
    idx[3] = -1
    sink = _sink(4, g, 37)
    got = sparse_mla_prefill(q, kv, idx, 0.2, 32, attn_sink=sink, plan=plan)
    ref = ref_prefill(q.double().cpu(), kv.double().cpu(), idx.cpu(), 0.2, 32,
                      attn_sink=sink.cpu())
    assert_close(got[0], ref[0], budget("sparse_mla_prefill", torch.float32, "out_rel"))
    plain = sparse_mla_prefill(q, kv, idx, 0.2, 32, plan=plan)
    assert torch.equal(got[1], plain[1]) and torch.equal(got[2], plain[2])
    assert (got[0][3] == 0).all() and torch.isposinf(got[2][3]).all()
    assert rel_err(plain[0], ref[0]) > 1e-2


@pytest.mark.parametrize("plan", SPLITS)
def test_nan_sink_is_nan_for_every_query_of_its_head(plan):
    """conventions §14: a NaN sink makes its head's out NaN, a lonely query's included; the
    other heads and every lse are untouched."""
    g = _gen(10)
    cache, used = plain_cache(3, 16, 40, torch.float32, g)
    q = torch.randn(2, 1, 3, 40, generator=g).to(DEVICE)
    idx = pick(g, (2, 1, 37), used)
    idx[1] = -1
    sink = torch.tensor([0.5, float("nan"), 2.0], device=DEVICE)
    out, lse = sparse_mla_decode(q, cache, idx, 0.2, False, head_dim_v=32, attn_sink=sink,
                                 plan=plan)
    plain, plain_lse = sparse_mla_decode(q, cache, idx, 0.2, False, head_dim_v=32, plan=plan)
    assert torch.isnan(out[:, :, 1]).all()
    assert not torch.isnan(out[:, :, [0, 2]]).any() and torch.equal(lse, plain_lse)


# ---- without value checks: NaN, never a guess ----------------------------------------------

@pytest.mark.parametrize("plan", SPLITS)
def test_bad_lengths_are_nan_queries_without_validation(plan):
    """validate=False: a topk_length (either scope) or a prefill topk_length outside [0, topk]
    makes that request's / query's outputs NaN; the others are as the reference says. With
    validation the same inputs are a ValueError naming the argument."""
    g = _gen(11)
    cache, used = plain_cache(3, 16, 40, torch.float32, g)
    extra, used2 = plain_cache(10, 1, 40, torch.float32, g)
    q = torch.randn(4, 1, 3, 40, generator=g).to(DEVICE)
    idx, idx2 = pick(g, (4, 1, 20), used), pick(g, (4, 1, 6), used2)
    lens = torch.tensor([20, 21, 5, 0], dtype=I32, device=DEVICE)
    lens2 = torch.tensor([6, 0, -1, 3], dtype=I32, device=DEVICE)
    kw = dict(extra_k_cache=extra, extra_indices_in_kvcache=idx2)
    for first, second, name in ((lens, lens2.clamp(0, 6), "^topk_length"),
                                (lens.clamp(0, 20), lens2, "^extra_topk_length")):
        with pytest.raises(ValueError, match=name):
            sparse_mla_decode(q, cache, idx, 0.2, False, first, 32, validate=True,
                              extra_topk_length=second, **kw)
    out, lse = sparse_mla_decode(q, cache, idx, 0.2, False, lens, 32, validate=False,
                                 extra_topk_length=lens2, plan=plan, **kw)
    assert torch.isnan(out[1:3]).all() and torch.isnan(lse[1:3]).all()
    r_out, r_lse = ref_decode(q.double().cpu(), cache.double().cpu(), idx.cpu(), 0.2, False,
                              lens.clamp(0, 20).cpu(), 32, extra_k_cache=extra.double().cpu(),
                              extra_indices_in_kvcache=idx2.cpu(),
                              extra_topk_length=lens2.clamp(0, 6).cpu())
    keep = [0, 3]
    assert_close(out[keep], r_out[keep], OUT32, name="out")
    assert_close(lse[keep], r_lse[keep], name="lse", abs_tol=LSE32)

    qp, kv = torch.randn(3, 2, 40, generator=g).to(DEVICE), torch.randn(20, 40).to(DEVICE)
    idxp = torch.randint(-1, 20, (3, 10), generator=g, dtype=I32).to(DEVICE)
    lp = torch.tensor([3, 11, -2], dtype=I32, device=DEVICE)
    with pytest.raises(ValueError, match="topk_length"):
        sparse_mla_prefill(qp, kv, idxp, 0.1, 32, lp, validate=True)
    got = sparse_mla_prefill(qp, kv, idxp, 0.1, 32, lp, validate=False, plan=plan)
    ref = ref_prefill(qp.double().cpu(), kv.double().cpu(), idxp.cpu(), 0.1, 32,
                      lp.clamp(0, 10).cpu())
    for name, a, b, quantity in zip(("out", "max_logits", "lse"), got, ref,
                                    ("out_rel", "max_abs", "lse_abs")):
        assert torch.isnan(a[1:]).all(), name
        tol = budget("sparse_mla_prefill", torch.float32, quantity)
        assert_close(a[:1], b[:1], tol if name == "out" else None, name=name,
                     abs_tol=None if name == "out" else tol)


@pytest.mark.parametrize("model1", [False, True], ids=["plain", "model1"])
@pytest.mark.parametrize("plan", SPLITS)
def test_out_of_range_decode_entries_are_nan_queries_without_validation(model1, plan):
    """validate=False: a decode query that uses an entry outside [-1, slots) in either scope
    (slots, slots + 7, -5) gets NaN out and lse, and its row is never read; an out-of-range
    entry past the query's length is not read at all; the other queries are as the reference
    says. With validation: a ValueError naming the indices."""
    g = _gen(12 + model1)
    if model1:
        (cache, used), (extra, used2) = model1_cache(2, 16, g), model1_cache(9, 1, g)
    else:
        cache, used = plain_cache(2, 16, D4, torch.float32, g)
        extra, used2 = plain_cache(9, 1, D4, torch.float32, g)
    q = torch.randn(3, 2, 2, D4, generator=g).to(DEVICE)
    idx, idx2 = pick(g, (3, 2, 20), used), pick(g, (3, 2, 5), used2)
    bad, bad2 = idx.clone(), idx2.clone()
    bad[0, 1, 3] = 32  # = slots
    bad2[2, 0, 4] = 9 + 7
    bad[1, 0, 0] = -5
    bad[1, 1, 19] = 1 << 30  # past request 1's length 15: never read
    lens = torch.tensor([20, 15, 20], dtype=I32, device=DEVICE)
    kw = dict(extra_k_cache=extra)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_decode(q, cache, bad, 0.05, model1, lens, validate=True,
                          extra_indices_in_kvcache=bad2, **kw)
    out, lse = sparse_mla_decode(q, cache, bad, 0.05, model1, lens, validate=False, plan=plan,
                                 extra_indices_in_kvcache=bad2, **kw)
    nan_q = torch.zeros(3, 2, dtype=torch.bool)
    nan_q[0, 1] = nan_q[2, 0] = nan_q[1, 0] = True
    assert torch.isnan(out[nan_q]).all() and torch.isnan(lse.transpose(1, 2)[nan_q]).all()
    r_out, r_lse = ref_decode(q.double().cpu(), cache.cpu() if model1 else cache.double().cpu(),
                              idx.cpu(), 0.05, model1, lens.cpu(),
                              extra_k_cache=extra.cpu() if model1 else extra.double().cpu(),
                              extra_indices_in_kvcache=idx2.cpu())
    keep = ~nan_q
    assert_close(out[keep], r_out[keep], OUT32, name="out")
    assert_close(lse.transpose(1, 2)[keep], r_lse.transpose(1, 2)[keep], name="lse",
                 abs_tol=LSE32)


def test_v4_argument_errors():
    """A second scope in another format, a sink of the wrong length or dtype, half a second
    scope: ValueError/TypeError naming the argument, before any kernel runs."""
    g = _gen(14)
    cache, used = model1_cache(2, 16, g)
    plain, _ = plain_cache(2, 16, D4, torch.float32, g)
    q = torch.randn(1, 1, 2, D4, generator=g).to(DEVICE)
    idx = pick(g, (1, 1, 8), used)
    with pytest.raises(TypeError, match="extra_k_cache"):  # not bytes: not the same format
        sparse_mla_decode(q, cache, idx, 0.1, True, extra_k_cache=plain,
                          extra_indices_in_kvcache=idx)
    with pytest.raises(ValueError, match="extra_k_cache and extra_indices_in_kvcache"):
        sparse_mla_decode(q, cache, idx, 0.1, True, extra_k_cache=cache)
    with pytest.raises(ValueError, match="attn_sink"):
        sparse_mla_decode(q, cache, idx, 0.1, True, attn_sink=torch.zeros(3, device=DEVICE))
    with pytest.raises(TypeError, match="attn_sink"):
        sparse_mla_prefill(q[0], plain.view(-1, D4), idx[0], 0.1, 512,
                           attn_sink=torch.zeros(2, dtype=torch.float64, device=DEVICE))


@pytest.mark.parametrize("plan", SPLITS)
def test_nan_in_the_second_scope_is_nan_out(plan):
    """conventions §13 across scopes: a NaN row named only by the second scope makes that
    query's out and lse NaN (with a sink too), a NaN in q likewise; every other query is the
    reference's; a NaN row no entry names changes nothing."""
    g = _gen(15)
    c1, u1 = plain_cache(3, 16, 40, torch.float32, g)
    c2, u2 = plain_cache(12, 1, 40, torch.float32, g)
    q = torch.randn(3, 2, 3, 40, generator=g).to(DEVICE)
    idx1, idx2 = pick(g, (3, 2, 21), u1), pick(g, (3, 2, 7), u2)
    poisoned = int(u2[0])
    idx2[idx2 == poisoned] = -1
    idx2[1, 0, 3] = poisoned
    c2.view(-1, 40)[poisoned, 5] = float("nan")
    q[2, 1, 0, 7] = float("nan")
    sink = torch.tensor([0.5, 3.0, -1.0], device=DEVICE)
    kw = dict(extra_k_cache=c2, extra_indices_in_kvcache=idx2, attn_sink=sink)
    out, lse = sparse_mla_decode(q, c1, idx1, 0.2, False, None, 32, plan=plan, **kw)
    r_out, r_lse = ref_decode(q.double().cpu(), c1.double().cpu(), idx1.cpu(), 0.2, False, None,
                              32, extra_k_cache=c2.double().cpu(),
                              extra_indices_in_kvcache=idx2.cpu(), attn_sink=sink.cpu())
    assert torch.isnan(r_out[1, 0]).all() and torch.isnan(r_lse[1, :, 0]).all()
    assert torch.isnan(r_lse[2, 0, 1])
    assert_nan_rule(out, r_out, OUT32, name="out")
    assert_nan_rule(lse, r_lse, name="lse", abs_tol=LSE32)


@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon sm_90 kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("num_splits,num_stages", [(1, 2), (3, 2), (1, 1), (3, 1)])
def test_sm90_kernel_takes_model1_the_second_scope_and_sinks(num_splits, num_stages):
    """On an H200 the 64-head MODEL1 calls, with a second scope of pages of 1 and sinks, go to
    the coupled Gluon kernel when the plan names it (the route is asserted, not assumed) and
    match the reference within the bf16 budget, with one staging buffer and with two; so do
    rows of 512 in q's dtype (decode with a second scope, prefill)."""
    import mla.fast.sparse as fast_sparse
    from mla.fast.sparse.kernels import MODEL1, PLAIN

    g = _gen(16)
    c1, u1 = model1_cache(4, 64, g)
    c2, u2 = model1_cache(60, 1, g)
    q = torch.randn(3, 1, 64, D4, generator=g).to(torch.bfloat16).to(DEVICE)
    idx1, idx2 = pick(g, (3, 1, 200), u1), pick(g, (3, 1, 40), u2)
    plan = SparsePlan(64, 64, num_splits, 8, num_stages, model1_kernel="staged")
    pages = lambda c: c.as_strided((c.shape[0], c.stride(0)), (c.stride(0), 1))  # noqa: E731
    assert fast_sparse._sm90_route(plan, q, pages(c1), 512, MODEL1, pages(c2))
    lens = torch.tensor([200, 0, 77], dtype=I32, device=DEVICE)
    check_decode(q, c1, idx1, True, lens, plan, extra_k_cache=c2, extra_indices_in_kvcache=idx2,
                 attn_sink=_sink(64, g, 240))
    p1, v1 = plain_cache(4, 64, D4, torch.bfloat16, g)
    p2, v2 = plain_cache(60, 1, D4, torch.bfloat16, g)
    assert fast_sparse._sm90_route(plan, q, p1.view(-1, D4), 512, PLAIN, p2.view(-1, D4))
    check_decode(q, p1, pick(g, (3, 1, 200), v1), False, lens, plan, extra_k_cache=p2,
                 extra_indices_in_kvcache=pick(g, (3, 1, 40), v2), attn_sink=_sink(64, g, 240))
    qp = torch.randn(5, 64, D4, generator=g).to(torch.bfloat16).to(DEVICE)
    kv = torch.randn(256, D4, generator=g).to(torch.bfloat16).to(DEVICE)
    idx = torch.randint(-1, 260, (5, 130), generator=g, dtype=I32).to(DEVICE)
    sink = _sink(64, g, 130)
    got = sparse_mla_prefill(qp, kv, idx, 0.04, 512, attn_sink=sink, plan=plan)
    ref = ref_prefill(qp.double().cpu(), kv.double().cpu(), idx.cpu(), 0.04, 512,
                      attn_sink=sink.cpu())
    assert_nan_rule(got[0], ref[0], budget("sparse_mla_prefill", torch.bfloat16, "out_rel"),
                    name="out")
    for name, a, b in (("max_logits", got[1], ref[1]), ("lse", got[2], ref[2])):
        assert_nan_rule(a, b, name=name,
                        abs_tol=budget("sparse_mla_prefill", torch.bfloat16, "lse_abs"))



@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon sm_90 kernels run on Hopper GPUs only")
@pytest.mark.parametrize("N,num_splits", [(128, 1), (64, 3)])
@pytest.mark.parametrize("kernel", MODEL1_KERNELS)
def test_sm90_model1_kernels(kernel, N, num_splits):
    """Each Gluon MODEL1 kernel a plan can name (``model1_kernel``), the route asserted: a
    second scope of pages of 1 with its own lengths, sinks, lengths that are not tile
    multiples (one request lonely), -1 entries and repeats, 128 heads unsplit and 64 heads in 3
    splits, against the float64 reference; then without value checks a length past top-k and
    a slot past the cache make exactly their queries NaN (the same compiled kernel)."""
    import mla.fast.sparse as fast_sparse
    from mla.fast.sparse.kernels import MODEL1

    g = _gen(17 + N)
    c1, u1 = model1_cache(6, 64, g)
    c2, u2 = model1_cache(90, 1, g)
    q = torch.randn(4, 1, N, D4, generator=g).to(torch.bfloat16).to(DEVICE)
    idx1, idx2 = pick(g, (4, 1, 300), u1), pick(g, (4, 1, 70), u2)
    plan = SparsePlan(64, 64, num_splits, 8, 1, model1_kernel=kernel)
    pages = lambda c: c.as_strided((c.shape[0], c.stride(0)), (c.stride(0), 1))  # noqa: E731
    assert fast_sparse._sm90_route(plan, q, pages(c1), 512, MODEL1, pages(c2))
    lens = torch.tensor([300, 0, 129, 63], dtype=I32, device=DEVICE)
    lens2 = torch.tensor([70, 5, 0, 64], dtype=I32, device=DEVICE)
    v4 = dict(extra_k_cache=c2, extra_indices_in_kvcache=idx2, extra_topk_length=lens2,
              attn_sink=_sink(N, g, 370))
    check_decode(q, c1, idx1, True, lens, plan, **v4)
    bad_idx, bad_lens = idx1.clone(), lens.clone()
    bad_idx[0, 0, 7] = c1.shape[0] * c1.shape[1]
    bad_lens[2] = 301
    out, lse = sparse_mla_decode(q, c1, bad_idx, D4 ** -0.5, True, bad_lens, plan=plan,
                                 validate=False, **v4)
    nan_q = torch.tensor([True, False, True, False], device=DEVICE)
    assert torch.isnan(out[nan_q]).all() and torch.isnan(lse[nan_q]).all()
    assert not torch.isnan(out[~nan_q]).any()


def _exact_pages(g: torch.Generator, nb: int = 3, bs: int = 64, B: int = 8
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """MODEL1 pages (CPU) whose every non-NaN e4m3 code and UE8M0 bytes 0-246 (0: 2^-127;
    246: the largest short of bf16 overflow) dequantize to normal bf16 values (under byte 30,
    e4m3 magnitudes of 2 and up: products at or above 2^-126), and ``B`` distinct slots whose
    rows hold the extreme bytes (0, 1, 29 | 30, 127 | 128, 134 | 135, 246)."""
    pages = torch.randint(0, 256, (nb, fp8_model1_page_bytes(bs)), generator=g,
                          dtype=torch.uint8)
    data = pages[:, :576 * bs].view(nb, bs, 576)
    codes = pages[:, 576 * bs:584 * bs].view(nb, bs, 8)
    codes.copy_(torch.randint(0, 247, codes.shape, generator=g, dtype=torch.uint8))
    rows = torch.randperm(nb * bs, generator=g)[:B]
    forced = torch.tensor([0, 1, 29, 30, 127, 128, 134, 135, 246], dtype=torch.uint8)
    for b in range(B):
        codes[rows[b] // bs, rows[b] % bs, :7] = forced[(torch.arange(7) + 2 * b) % 9]
    nope = data[..., :448].view(nb, bs, 7, 64)
    nope.copy_(nope & 0xFE)  # no NaN code (0x7F, 0xFF): 0x7E, 0xFE instead
    nope.copy_(torch.where((codes[..., :7] < 30)[..., None], nope | 0x40, nope))
    data[..., 448:] = torch.randn(nb, bs, 64, generator=g).to(torch.bfloat16).view(torch.uint8)
    return pages, rows


def test_exact_pages_catch_a_scale_byte_misread():
    """The bit-exact test's pages can fail it: their rows dequantized with the byte 0 read as
    0 (the scale it once had in the kernel), or a scale off by one binade, differ from the
    reference's rows."""
    pages, rows = _exact_pages(_gen(29))
    data = pages[:, :576 * 64].reshape(-1, 576)[rows]
    codes = pages[:, 576 * 64:584 * 64].reshape(-1, 8)[rows, :7].to(torch.int32)
    x = data[:, :448].contiguous().view(torch.float8_e4m3fn).float().view(-1, 7, 64)
    want = fp8_model1_rows(pages, 64, rows)[:, :448].view(-1, 7, 64)
    for scale in (torch.where(codes == 0, 0.0, torch.pow(2.0, codes - 127.0)),
                  torch.pow(2.0, codes - 126.0)):
        got = (x * scale[..., None]).to(torch.bfloat16)
        assert torch.isfinite(want.float()).all() and not torch.equal(got, want)
    assert torch.equal((x * torch.pow(2.0, codes - 127.0)[..., None]).to(torch.bfloat16), want)


@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon sm_90 kernels run on Hopper GPUs only")
@pytest.mark.parametrize("N,num_splits", [(128, 1), (64, 3)])
def test_sm90_model1_dequantization_is_bit_exact(N, num_splits):
    """The default MODEL1 kernel's dequantization, bit for bit: with q = 0 and one valid entry
    a query, the softmax weighs that key by exactly 1, so the output is its dequantized row
    (V = K), equal to the reference's bf16 row (values: a -0 sums to +0), over
    ``_exact_pages`` (subnormal products are left out: they would test the tensor cores'
    P · V, not the dequantization); a NaN code in a query's row makes a NaN query."""
    import mla.fast.sparse as fast_sparse
    from mla.fast.sparse.kernels import MODEL1

    B, bs = 8, 64
    pages, rows = _exact_pages(_gen(29), B=B, bs=bs)
    nan_q = 5
    pages[:, :576 * bs].view(-1, bs, 576)[rows[nan_q] // bs, rows[nan_q] % bs, 100] = 0x7F
    idx = torch.full((B, 1, 100), -1, dtype=I32)
    for b in range(B):
        idx[b, 0, (17 * b + 3) % 100] = rows[b]
    cache = fp8_model1_cache(pages.to(DEVICE), bs)
    q = torch.zeros(B, 1, N, D4, dtype=torch.bfloat16, device=DEVICE)
    plan = SparsePlan(64, 64, num_splits, 8, 1)
    pages_of = cache.as_strided((cache.shape[0], cache.stride(0)), (cache.stride(0), 1))
    assert fast_sparse._sm90_route(plan, q, pages_of, 512, MODEL1, None)
    out, lse = sparse_mla_decode(q, cache, idx.to(DEVICE), D4 ** -0.5, True, None, 512,
                                 plan=plan)
    want = fp8_model1_rows(pages, bs, rows).view(B, 1, 1, D4).expand(B, 1, N, D4)
    ok = torch.arange(B) != nan_q
    assert torch.isfinite(want[ok].float()).all()
    got = out.cpu()
    assert torch.equal(got[ok], want[ok]), (got[ok] != want[ok]).sum()
    assert torch.isnan(got[nan_q]).all() and torch.isnan(lse.cpu()[nan_q]).all()
    assert (lse.cpu()[ok] == 0).all()


def test_model1_kernel_names_are_checked():
    with pytest.raises(ValueError, match="model1_kernel must be one of"):
        SparsePlan(64, 64, 1, 8, 1, model1_kernel="overlapped")

_PLAN_CHILD = """
import json, sys
import torch
from benchmarks.sparse_compile import _usage, compile_plan
from mla.fast.sparse import plan_sparse
from mla.fast.sparse.kernels import MODEL1, PLAIN
out = []
for fmt, N, D in json.loads(sys.argv[1]):
    p = plan_sparse(8, N, 512, torch.bfloat16, fmt != PLAIN, 132, model1=fmt == MODEL1)
    flags = {"D": D, "HAS_TOPK_LEN": True, "HAS_EXTRA": True, "HAS_TOPK_LEN2": True,
             "HAS_SINK": True, "CHECK_RANGE": True, "SPLIT": p.num_splits > 1}
    k = compile_plan("bf16", fmt, N, p.block_m, p.block_n, p.num_warps, p.num_stages, flags)
    out.append([fmt, N, D, k.metadata.shared, _usage(k.asm["cubin"])])
print(json.dumps(out))
"""


def test_default_triton_plans_of_v4_calls_fit_an_sm():
    """The Triton plans ``plan_sparse`` picks for DeepSeek-V4's calls under 64 heads (which
    the Gluon kernel does not take) compile for sm_90 within 227 KB of shared memory and
    without spills (MODEL1's 8-tile rows overflowed it at 64-row tiles). Compiled in a child
    process without TRITON_INTERPRET (see tests/test_sm90_compile.py)."""
    import json

    from mla.fast.sparse.kernels import MODEL1, PLAIN

    pytest.importorskip("triton.backends.nvidia")
    calls = [[MODEL1, 16, 512], [MODEL1, 32, 512], [PLAIN, 16, 512], [PLAIN, 32, 512]]
    for fmt, N, D, shared, usage in compiled(["-c", _PLAN_CHILD, json.dumps(calls)]):
        assert shared <= 232448, (fmt, N, D, shared)
        assert usage.endswith(" 0 B spilled"), (fmt, N, D, usage)
