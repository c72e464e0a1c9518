"""The Triton sparse kernels (``mla.fast.sparse_mla_decode`` / ``sparse_mla_prefill``) against
the float64 reference.

Runs under ``TRITON_INTERPRET=1`` on the CPU (conftest sets it without a GPU), so q is
float16/float32 (the interpreter's bf16 ``tl.dot`` is wrong) and shapes are small: the tiny
latent (rows of 40, V = the first 32 columns) for the bf16-style cache, DeepSeek's fixed
576/512 with 1-2 heads for ``fp8_ds_mla``. Top-k lengths are not multiples of the tiles.
Every output buffer the wrappers allocate starts as NaN, and every cache row no index names
holds NaN (fp8: 0xFF bytes, NaN as e4m3 and as float32 scale), so an unwritten element or a
read of a masked row shows up as an infinite error.
"""

from __future__ import annotations

import pytest
import torch
from _nan_rule import assert_nan_rule

from mla import compare
from mla.compare import assert_close, budget, poison_like
from mla.fast import SparsePlan, plan_sparse, sparse_mla_decode, sparse_mla_prefill
from mla.fast.sparse.plan import BF16_KERNELS, DS_MLA_KERNELS
from mla.reference.fp8 import quantize_fp8_ds_mla
from mla.reference.sparse import sparse_mla_decode as ref_decode
from mla.reference.sparse import sparse_mla_prefill as ref_prefill

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
I32 = torch.int32


@pytest.fixture
def poisoned_alloc():
    """Every buffer the wrappers allocate (outputs, split partials) starts poisoned."""
    with compare.poisoned_alloc():
        yield


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tols(kernel: str, dtype: torch.dtype) -> tuple[float, float]:
    """(budget of out's relative error, of lse's absolute error): conventions §11."""
    return budget(kernel, dtype, "out_rel"), budget(kernel, dtype, "lse_abs")


def _indices(g: torch.Generator, shape: tuple[int, ...], used: torch.Tensor,
             extra_invalid: tuple[int, ...] = (-1,)) -> torch.Tensor:
    """Random picks among the ``used`` rows (repeats included), a fifth replaced by the
    invalid values ``extra_invalid``."""
    pick = used[torch.randint(len(used), shape, generator=g)].to(I32)
    bad = torch.rand(shape, generator=g) < 0.2
    vals = torch.tensor(extra_invalid, dtype=I32)[torch.randint(len(extra_invalid), shape,
                                                                generator=g)]
    return torch.where(bad, vals, pick)


# --------------------------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------------------------

def prefill_inputs(s_q: int, h: int, D: int, s_kv: int, topk: int, dtype: torch.dtype,
                   seed: int, scale: float = 1.0):
    """q, kv (rows no index names hold NaN), indices with -1, other negatives, ``>= s_kv``
    and repeats; query 1 (if any) all invalid."""
    g = _gen(seed)
    q = (scale * torch.randn(s_q, h, D, generator=g, dtype=torch.float64)).to(dtype)
    kv = torch.randn(s_kv, D, generator=g, dtype=torch.float64).to(dtype)
    used = torch.randperm(s_kv, generator=g)[: max(1, (3 * s_kv) // 4)]
    unused = torch.ones(s_kv, dtype=torch.bool)
    unused[used] = False
    kv[unused] = float("nan")
    if not s_kv:  # nothing to pick: every index is invalid
        used = torch.tensor([-1])
    idx = _indices(g, (s_q, topk), used, (-1, -7, s_kv, s_kv + 3))
    if s_q > 1:
        idx[1] = torch.tensor([-1, s_kv, -2], dtype=I32)[torch.arange(topk) % 3]
    return q.to(DEVICE), kv.to(DEVICE), idx.to(DEVICE)


def check_prefill(q, kv, idx, scale, d_v, topk_length=None, plan=None):
    out, max_logits, lse = sparse_mla_prefill(q, kv, idx, scale, d_v, topk_length, plan=plan)
    r_out, r_max, r_lse = ref_prefill(q.double().cpu(), kv.double().cpu(), idx.cpu(), scale, d_v,
                                      None if topk_length is None else topk_length.cpu())
    assert out.shape == r_out.shape and out.dtype == q.dtype
    assert lse.shape == r_lse.shape and lse.dtype == torch.float32
    assert max_logits.shape == r_max.shape and max_logits.dtype == torch.float32
    tol, abs_tol = _tols("sparse_mla_prefill", q.dtype)
    assert_close(out, r_out, tol, name="out")
    assert_close(lse, r_lse, name="lse", abs_tol=abs_tol)
    assert_close(max_logits, r_max, name="max_logits",
                 abs_tol=budget("sparse_mla_prefill", q.dtype, "max_abs"))
    return out, max_logits, lse


# (s_q, h, topk, plan): one head group and two (h > block_m), one split and several (the
# interpreter plans for 4 SMs), tiles of 16 and 64 over top-k 37 and 70.
PREFILL_CASES = [
    (5, 3, 37, None),
    (4, 20, 70, None),  # 20 heads: two 16-head groups
    (3, 4, 70, SparsePlan(16, 16, 3, 4, 1)),
    (6, 2, 37, SparsePlan(16, 64, 1, 4, 2)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("s_q,h,topk,plan", PREFILL_CASES)
def test_prefill_tiny_dims(poisoned_alloc, dtype, s_q, h, topk, plan):
    """Rows of 40 (32 + 8, neither a power of two), masked indices, a lonely query."""
    q, kv, idx = prefill_inputs(s_q, h, 40, 53, topk, dtype, seed=s_q * 11 + h)
    out, max_logits, lse = check_prefill(q, kv, idx, 40 ** -0.5, 32, plan=plan)
    if s_q > 1:  # query 1 names nothing valid: FlashMLA's lonely-query values
        assert (out[1] == 0).all()
        assert torch.isposinf(lse[1]).all() and torch.isneginf(max_logits[1]).all()


@pytest.mark.parametrize("plan", [None, SparsePlan(16, 16, 2, 4, 1)])
def test_prefill_topk_length(poisoned_alloc, plan):
    """``topk_length``: 0 (lonely), 1, a partial tile, the whole list."""
    q, kv, idx = prefill_inputs(5, 4, 40, 30, 45, torch.float32, seed=21)
    lens = torch.tensor([0, 1, 17, 45, 33], dtype=I32, device=DEVICE)
    out, max_logits, lse = check_prefill(q, kv, idx, 0.2, 32, lens, plan)
    assert (out[0] == 0).all() and torch.isposinf(lse[0]).all()


def test_prefill_deepseek_dims_and_layouts(poisoned_alloc):
    """576/512, FlashMLA's ``kv [s_kv, 1, d]`` and ``indices [s_q, 1, topk]``, logits ×30."""
    q, kv, idx = prefill_inputs(3, 2, 576, 90, 70, torch.float16, seed=22, scale=30.0)
    check_prefill(q, kv[:, None], idx[:, None], 576 ** -0.5, 512)


def test_prefill_no_rope_and_edge_sizes(poisoned_alloc):
    """d_v = d_qk (no rope columns); top-k 1; an empty kv (every query lonely); top-k 0."""
    q, kv, idx = prefill_inputs(4, 3, 32, 20, 1, torch.float32, seed=23)
    check_prefill(q, kv, idx, 0.3, 32)
    q, kv, idx = prefill_inputs(3, 2, 40, 0, 5, torch.float32, seed=24)
    out, max_logits, lse = check_prefill(q, kv, idx, 0.3, 32)
    assert torch.isposinf(lse).all() and (out == 0).all()
    q, kv, idx = prefill_inputs(2, 2, 40, 10, 0, torch.float32, seed=25)
    check_prefill(q, kv, idx, 0.3, 32)


def test_prefill_strided_q(poisoned_alloc):
    """q as a strided view (every other head of a wider buffer), int32 indices non-contiguous."""
    q_wide, kv, idx_wide = prefill_inputs(4, 6, 40, 25, 2 * 37, torch.float32, seed=26)
    q, idx = q_wide[:, ::2], idx_wide[:, ::2]
    assert not q.is_contiguous() and not idx.is_contiguous()
    check_prefill(q, kv, idx, 0.25, 32, plan=SparsePlan(16, 16, 2, 4, 1))


# --------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------

def decode_inputs(B: int, s_q: int, N: int, D: int, nb: int, bs: int, topk: int,
                  dtype: torch.dtype, seed: int, fp8: bool = False):
    """q, a paged cache (rows no index names hold NaN; fp8: 0xFF bytes), indices [B, s_q,
    topk] of global slots with -1s and repeats; query (0, last) all -1."""
    g = _gen(seed)
    n_slots = nb * bs
    used = torch.randperm(n_slots, generator=g)[: (2 * n_slots) // 3]
    q = torch.randn(B, s_q, N, D, generator=g, dtype=torch.float64).to(dtype)
    if fp8:
        kv_c = torch.randn(len(used), 512, generator=g, dtype=torch.float64)
        kv_c[:, 128:256] *= 1e-3  # tiles of different scales, small values subnormal in e4m3
        k_pe = torch.randn(len(used), 64, generator=g, dtype=torch.float64)
        flat = torch.full((n_slots, 656), 0xFF, dtype=torch.uint8)
        flat[used] = quantize_fp8_ds_mla(kv_c, k_pe)
        cache = flat.view(nb, bs, 656)
    else:
        flat = torch.full((n_slots, D), float("nan"), dtype=torch.float64)
        flat[used] = torch.randn(len(used), D, generator=g, dtype=torch.float64)
        cache = flat.to(dtype).view(nb, bs, D)
    idx = _indices(g, (B, s_q, topk), used)
    idx[0, -1] = -1
    return q.to(DEVICE), cache.to(DEVICE), idx.to(DEVICE)


def check_decode(q, cache, idx, scale, fp8, topk_length=None, head_dim_v=512, plan=None,
                 validate=None):
    out, lse = sparse_mla_decode(q, cache, idx, scale, fp8, topk_length, head_dim_v,
                                 validate=validate, plan=plan)
    r_out, r_lse = ref_decode(q.double().cpu(), cache.cpu() if fp8 else cache.double().cpu(),
                              idx.cpu(), scale, fp8,
                              None if topk_length is None else topk_length.cpu(), head_dim_v)
    assert out.shape == r_out.shape and out.dtype == q.dtype
    assert lse.shape == r_lse.shape and lse.dtype == torch.float32
    tol, abs_tol = _tols("sparse_mla_decode", q.dtype)
    assert_close(out, r_out, tol, name="out")
    assert_close(lse, r_lse, name="lse", abs_tol=abs_tol)
    return out, lse


# (B, s_q, N, page, topk, plan)
DECODE_CASES = [
    (3, 1, 4, 16, 37, None),
    (2, 2, 3, 16, 70, SparsePlan(16, 16, 3, 4, 1)),
    (2, 3, 20, 64, 37, None),  # two head groups
    (4, 1, 5, 1, 70, SparsePlan(16, 64, 1, 4, 2)),  # page size 1
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,s_q,N,bs,topk,plan", DECODE_CASES)
def test_decode_tiny_dims(poisoned_alloc, dtype, B, s_q, N, bs, topk, plan):
    q, cache, idx = decode_inputs(B, s_q, N, 40, 6, bs, topk, dtype, seed=B * 13 + N)
    out, lse = check_decode(q, cache, idx, 40 ** -0.5, False, head_dim_v=32, plan=plan)
    assert (out[0, -1] == 0).all() and torch.isposinf(lse[0, :, -1]).all()


@pytest.mark.parametrize("plan", [None, SparsePlan(16, 16, 4, 4, 1)])
def test_decode_topk_length(poisoned_alloc, plan):
    """``topk_length [B]``: per request, for all its ``s_q`` queries; 0 makes it lonely."""
    q, cache, idx = decode_inputs(4, 2, 3, 40, 5, 16, 45, torch.float32, seed=31)
    lens = torch.tensor([45, 0, 1, 20], dtype=I32, device=DEVICE)
    out, lse = check_decode(q, cache, idx, 0.2, False, lens, 32, plan)
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("plan", [
    None,
    SparsePlan(16, 64, 2, 4, 1),
    SparsePlan(16, 32, 1, 8, 2),
])
def test_decode_fp8_cache(poisoned_alloc, q_dtype, plan):
    """``fp8_ds_mla`` rows dequantized in the kernel: 576/512, 1-2 heads, top-k 70 / 37."""
    N, topk = (2, 70) if q_dtype == torch.float16 else (1, 37)
    q, cache, idx = decode_inputs(2, 2, N, 576, 3, 16, topk, q_dtype, seed=32, fp8=True)
    lens = torch.tensor([topk, 29], dtype=I32, device=DEVICE)
    check_decode(q, cache, idx, 576 ** -0.5, True, lens, plan=plan)


def test_decode_fp8_layouts(poisoned_alloc):
    """FlashMLA's ``[nb, bs, 1, 656]`` cache, and the same bytes as ``float8_e4m3fn``."""
    q, cache, idx = decode_inputs(1, 1, 2, 576, 2, 16, 20, torch.float16, seed=33, fp8=True)
    out, lse = check_decode(q, cache[:, :, None], idx, 0.05, True)
    out2, lse2 = sparse_mla_decode(q, cache.view(torch.float8_e4m3fn), idx, 0.05, True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_decode_fp8_block_padded_cache_is_read_in_place(poisoned_alloc):
    """FlashMLA's ``quantize_k_cache`` form, ``[nb, bs + 1, 656]`` allocated and sliced to
    ``bs``: the kernel reads the rows in place (no copy of the cache), with the same result as
    the contiguous cache; without validation a slot past the cache still gives NaN."""
    from mla.fast.sparse.scope import decode_scope

    q, cache, idx = decode_inputs(2, 2, 2, 576, 3, 16, 37, torch.float16, seed=35, fp8=True)
    padded = torch.full((3, 17, 656), 0xFF, dtype=torch.uint8, device=DEVICE)
    padded[:, :16] = cache
    sliced = padded[:, :16]
    scope, _ = decode_scope("kv_cache", sliced, idx, None, True)
    assert scope.kv.untyped_storage().data_ptr() == padded.untyped_storage().data_ptr()
    out, lse = check_decode(q, sliced, idx, 576 ** -0.5, True)
    out2, lse2 = sparse_mla_decode(q, cache, idx, 576 ** -0.5, True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    bad = idx.clone()
    bad[1, 0, :2] = 3 * 16  # one past the last slot: inside the padded allocation
    out3, _ = sparse_mla_decode(q, sliced, bad, 576 ** -0.5, True, validate=False)
    assert torch.isnan(out3[1, 0]).all() and torch.equal(out3[0], out2[0])


def test_decode_out_of_range_indices(poisoned_alloc):
    """Indices outside ``[-1, num_slots)``: rejected when validating (as the reference); without
    validation the queries that use one get NaN out and lse (the kernel never reads outside
    the cache, and never answers as if the entry were -1); the other queries are exact."""
    q, cache, idx = decode_inputs(2, 2, 3, 40, 4, 16, 37, torch.float32, seed=34)
    bad = idx.clone()
    bad[0, 0, :5] = cache.shape[0] * cache.shape[1] + 7
    bad[1, 1, :3] = -5
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_decode(q, cache, bad, 0.2, False, head_dim_v=32)
    out, lse = sparse_mla_decode(q, cache, bad, 0.2, False, head_dim_v=32, validate=False)
    assert torch.isnan(out[0, 0]).all() and torch.isnan(out[1, 1]).all()
    assert torch.isnan(lse[0, :, 0]).all() and torch.isnan(lse[1, :, 1]).all()
    r_out, r_lse = ref_decode(q.double().cpu(), cache.double().cpu(), idx.cpu(), 0.2, False,
                              head_dim_v=32)
    for b, t in ((0, 1), (1, 0)):
        assert_close(out[b, t], r_out[b, t], 1e-5, name="out")
        assert_close(lse[b, :, t], r_lse[b, :, t], name="lse", abs_tol=1e-5)


@pytest.mark.parametrize("plan", [SparsePlan(16, 16, 1, 4, 1), SparsePlan(16, 16, 3, 4, 1)],
                         ids=["one split", "three splits"])
def test_nan_input_is_nan_out_not_a_marker(poisoned_alloc, plan):
    """conventions §13, on both paths: a NaN in one query's q makes its out, lse and
    max_logits NaN (never the lonely query's +inf / -inf, nor the combine's "empty split"); a
    NaN in a row that a query names makes that query NaN; a lonely query stays lonely whatever
    its q holds; every other query is untouched."""
    q, kv, idx = prefill_inputs(4, 3, 40, 30, 37, torch.float32, seed=27)
    q[0, 2, 4] = float("nan")
    q[1, 0, 0] = float("nan")  # query 1 names nothing valid (lonely)
    named = idx[3][(idx[3] >= 0) & (idx[3] < 30)]
    kv[named[0], 3] = float("nan")  # a row query 3 names
    got = sparse_mla_prefill(q, kv, idx, 0.2, 32, plan=plan)
    ref = ref_prefill(q.double().cpu(), kv.double().cpu(), idx.cpu(), 0.2, 32)
    assert torch.isnan(ref[2][0, 2]) and torch.isnan(ref[2][3]).all()
    assert torch.isposinf(ref[2][1]).all() and torch.isneginf(ref[1][1]).all()
    for name, g, r, tol in zip(("out", "max_logits", "lse"), got, ref, (1e-5, None, None)):
        assert_nan_rule(g, r, tol, name=name, abs_tol=None if tol else 1e-5)

    qd, cache, idx_d = decode_inputs(2, 2, 3, 40, 4, 16, 37, torch.float32, seed=35)
    qd[1, 0, 2, 9] = float("nan")
    qd[0, 1, 1, 0] = float("nan")  # query (0, last) names nothing valid
    out, lse = sparse_mla_decode(qd, cache, idx_d, 0.2, False, head_dim_v=32, plan=plan)
    r_out, r_lse = ref_decode(qd.double().cpu(), cache.double().cpu(), idx_d.cpu(), 0.2, False,
                              head_dim_v=32)
    assert torch.isnan(r_lse[1, 2, 0]) and torch.isposinf(r_lse[0, :, 1]).all()
    assert_nan_rule(out, r_out, 1e-5, name="out")
    assert_nan_rule(lse, r_lse, name="lse", abs_tol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon sm_90 kernels run on Hopper GPUs only")
@pytest.mark.parametrize("N,num_splits", [(128, 1), (64, 3)])
@pytest.mark.parametrize("kernel", DS_MLA_KERNELS)
def test_sm90_ds_mla_kernels(poisoned_alloc, monkeypatch, kernel, N, num_splits):
    """Each Gluon ``fp8_ds_mla`` kernel a plan can name (``ds_mla_kernel``), the route
    asserted: lengths off the tile grid (one request lonely), -1 entries and repeats, rows no
    index names poisoned (0xFF), 128 heads unsplit and 64 heads in 3 splits, against the
    float64 reference; then without value checks a length past top-k and a slot past the cache
    make exactly their queries NaN."""
    import mla.fast.sparse as fast_sparse
    from mla.fast.sparse.kernels import DS_MLA

    q, cache, idx = decode_inputs(4, 2, N, 576, 8, 64, 300, torch.bfloat16, seed=50 + N,
                                  fp8=True)
    plan = SparsePlan(64, 64, num_splits, 8, 2, ds_mla_kernel=kernel)
    assert fast_sparse._sm90_route(plan, q, cache.view(-1, 656), 512, DS_MLA)
    lens = torch.tensor([300, 0, 129, 63], dtype=I32, device=DEVICE)
    monkeypatch.setattr(fast_sparse, "_sm90_ws", {})  # built by this call only, if at all
    out, _ = check_decode(q, cache, idx, 576 ** -0.5, True, lens, plan=plan)
    assert (kernel == "warp_specialized") == ("ds_mla" in fast_sparse._sm90_ws)
    bad_idx, bad_lens = idx.clone(), lens.clone()
    bad_idx[0, :, 7] = cache.shape[0] * cache.shape[1]
    bad_lens[2] = 301
    out, lse = sparse_mla_decode(q, cache, bad_idx, 576 ** -0.5, True, bad_lens, plan=plan,
                                 validate=False)
    nan_q = torch.tensor([True, False, True, False], device=DEVICE)
    assert torch.isnan(out[nan_q]).all() and torch.isnan(lse[nan_q]).all()
    assert not torch.isnan(out[~nan_q]).any()


def test_ds_mla_kernel_names_are_checked():
    """``SparsePlan.ds_mla_kernel``: the warp-specialized kernel by default; a plan naming
    the warp-specialized one still runs elsewhere (the Triton kernel off Hopper)."""
    assert SparsePlan(64, 64, 1, 8, 2).ds_mla_kernel == "warp_specialized"
    assert plan_sparse(64, 128, 2048, torch.bfloat16, True, num_sms=132).ds_mla_kernel == \
        "warp_specialized"
    with pytest.raises(ValueError, match="ds_mla_kernel must be one of"):
        SparsePlan(64, 64, 1, 8, 2, ds_mla_kernel="coupled")


@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon sm_90 kernels run on Hopper GPUs only")
@pytest.mark.parametrize("D", [576, 512])
@pytest.mark.parametrize("N,num_splits", [(128, 1), (64, 3)])
@pytest.mark.parametrize("kernel", BF16_KERNELS)
def test_sm90_bf16_kernels(poisoned_alloc, monkeypatch, kernel, N, num_splits, D):
    """Each Gluon kernel over rows in q's dtype a plan can name (``bf16_kernel``), the route
    asserted. Prefill: rows of 576 (V the first 512 columns) and of 512 (V the whole row),
    lengths off the tile grid (0: lonely), indices -1, other negatives and ``>= s_kv``, a
    lonely query, a sink; decode (rows of 576): lengths off the tile grid, one request lonely;
    then without value checks a length past top-k and a slot past the cache make exactly
    their queries NaN. 128 heads unsplit and 64 heads in 3 splits."""
    import mla.fast.sparse as fast_sparse
    from mla.fast.sparse.kernels import PLAIN

    plan = SparsePlan(64, 64, num_splits, 8, 2, bf16_kernel=kernel)
    monkeypatch.setattr(fast_sparse, "_sm90_ws", {})  # built by these calls only, if at all
    q, kv, idx = prefill_inputs(6, N, D, 700, 300, torch.bfloat16, seed=60 + N + D)
    assert fast_sparse._sm90_route(plan, q, kv, 512, PLAIN)
    lens = torch.tensor([300, 299, 0, 129, 63, 1], dtype=I32, device=DEVICE)
    check_prefill(q, kv, idx, D ** -0.5, 512, lens, plan=plan)
    assert (kernel == "warp_specialized") == ("bf16" in fast_sparse._sm90_ws)
    sink = torch.randn(N, generator=_gen(61)).float().to(DEVICE) + 3.0
    out, max_logits, lse = sparse_mla_prefill(q, kv, idx, D ** -0.5, 512, lens,
                                              attn_sink=sink, plan=plan)
    r_out, r_max, r_lse = ref_prefill(q.double().cpu(), kv.double().cpu(), idx.cpu(),
                                      D ** -0.5, 512, lens.cpu(), attn_sink=sink.cpu())
    tol, abs_tol = _tols("sparse_mla_prefill", q.dtype)
    assert_close(out, r_out, tol, name="out (sink)")
    assert_close(lse, r_lse, name="lse (sink)", abs_tol=abs_tol)
    if D != 576:
        return
    q, cache, idx = decode_inputs(4, 2, N, 576, 8, 64, 300, torch.bfloat16, seed=62 + N)
    lens = torch.tensor([300, 0, 129, 63], dtype=I32, device=DEVICE)
    check_decode(q, cache, idx, 576 ** -0.5, False, lens, plan=plan)
    bad_idx, bad_lens = idx.clone(), lens.clone()
    bad_idx[0, :, 7] = cache.shape[0] * cache.shape[1]
    bad_lens[2] = 301
    out, lse = sparse_mla_decode(q, cache, bad_idx, 576 ** -0.5, False, bad_lens, plan=plan,
                                 validate=False)
    nan_q = torch.tensor([True, False, True, False], device=DEVICE)
    assert torch.isnan(out[nan_q]).all() and torch.isnan(lse[nan_q]).all()
    assert not torch.isnan(out[~nan_q]).any()


def test_bf16_kernel_names_are_checked(poisoned_alloc):
    """``SparsePlan.bf16_kernel``: the warp-specialized kernel by default, the seesaw one with
    its producer group in a prefill's default plan; a plan naming any kernel still runs
    elsewhere (the Triton kernel off Hopper)."""
    assert SparsePlan(64, 64, 1, 8, 2).bf16_kernel == "warp_specialized"
    assert plan_sparse(64, 128, 2048, torch.bfloat16, False, num_sms=132).bf16_kernel == \
        "warp_specialized"
    for bi in (False, True):
        assert plan_sparse(64, 128, 2048, torch.bfloat16, False, num_sms=132, prefill=True,
                           batch_invariant=bi).bf16_kernel == "seesaw_producer"
    for removed in ("coupled", "seesaw"):  # "seesaw": the form without a producer, removed
        with pytest.raises(ValueError, match="bf16_kernel must be one of"):
            SparsePlan(64, 64, 1, 8, 2, bf16_kernel=removed)
    plan = SparsePlan(16, 64, 2, 4, 1, bf16_kernel="staged")
    q, kv, idx = prefill_inputs(3, 2, 40, 30, 45, torch.float16, seed=63)
    check_prefill(q, kv, idx, 0.3, 32, plan=plan)
    q, cache, idx = decode_inputs(2, 1, 2, 40, 3, 16, 37, torch.float16, seed=64)
    check_decode(q, cache, idx, 0.3, False, head_dim_v=32, plan=plan)
    plan = SparsePlan(16, 64, 1, 4, 1, bf16_kernel="seesaw_producer")
    q, kv, idx = prefill_inputs(3, 2, 40, 30, 45, torch.float16, seed=65)
    check_prefill(q, kv, idx, 0.3, 32, plan=plan)


def test_decode_fp8_plan_naming_the_warp_specialized_kernel(poisoned_alloc):
    q, cache, idx = decode_inputs(2, 1, 2, 576, 3, 16, 70, torch.float16, seed=36, fp8=True)
    plan = SparsePlan(16, 64, 2, 4, 1, ds_mla_kernel="warp_specialized")
    check_decode(q, cache, idx, 576 ** -0.5, True, plan=plan)


# --------------------------------------------------------------------------------------------
# plans, arguments
# --------------------------------------------------------------------------------------------

def test_plan_uses_shapes_only():
    """Splits follow queries, heads and SMs; 128 heads are two 64-head groups."""
    big = plan_sparse(64, 128, 2048, torch.bfloat16, True, num_sms=132)
    assert (big.block_m, big.num_splits, big.num_warps) == (64, 1, 8)
    small = plan_sparse(1, 128, 2048, torch.bfloat16, True, num_sms=132)
    assert small.num_splits > 1 and small.num_splits <= 2048 // 64 // 2
    assert plan_sparse(4, 16, 2048, torch.bfloat16, False, 132).block_m == 16
    assert plan_sparse(4096, 128, 2048, torch.bfloat16, False, 132).num_splits == 1
    assert plan_sparse(1, 16, 37, torch.float16, False, 132).num_splits == 1  # 1 tile


def test_argument_errors():
    q, kv, idx = prefill_inputs(3, 2, 40, 20, 10, torch.float32, seed=40)
    with pytest.raises(TypeError, match="q"):
        sparse_mla_prefill(q.double(), kv.double(), idx, 0.1, 32)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_prefill(q, kv, idx[:2], 0.1, 32)
    with pytest.raises(ValueError, match="d_v"):
        sparse_mla_prefill(q, kv, idx, 0.1, 41)
    lens = torch.tensor([3, 11, 0], dtype=I32, device=DEVICE)
    with pytest.raises(ValueError, match="topk_length"):
        sparse_mla_prefill(q, kv, idx, 0.1, 32, lens)
    qd, cache, idx_d = decode_inputs(2, 1, 2, 40, 2, 16, 10, torch.float32, seed=41)
    with pytest.raises(TypeError, match="kv_cache"):
        sparse_mla_decode(qd, cache, idx_d, 0.1, True, head_dim_v=32)
    with pytest.raises(ValueError, match="topk_length"):
        sparse_mla_decode(qd, cache, idx_d, 0.1, False, lens, head_dim_v=32)
    with pytest.raises(TypeError, match="is_fp8_kvcache"):
        sparse_mla_decode(qd, cache, idx_d, 0.1, 0, head_dim_v=32)


def test_topk_length_out_of_range_without_validation(poisoned_alloc):
    """validate=False skips the host read; a length past topk or negative then makes that
    query NaN (out, lse, max_logits), never a read past the list nor a clamped guess."""
    q, kv, idx = prefill_inputs(3, 2, 40, 20, 10, torch.float32, seed=42)
    lens = torch.tensor([3, 11, -2], dtype=I32, device=DEVICE)
    got = sparse_mla_prefill(q, kv, idx, 0.1, 32, lens, validate=False)
    ref = ref_prefill(q.double().cpu(), kv.double().cpu(), idx.cpu(), 0.1, 32,
                      lens.clamp(0, 10).cpu())
    for name, g, r in zip(("out", "max_logits", "lse"), got, ref):
        assert torch.isnan(g[1:]).all(), name
        assert_close(g[:1], r[:1], 1e-5 if name == "out" else None, name=name,
                     abs_tol=None if name == "out" else 1e-5)


def test_poison_like_cache_is_unread(poisoned_alloc):
    """A cache that is all poison except the rows named: the named rows alone decide the
    result (the same call on a cache whose unnamed rows are random gives the same tensors)."""
    q, cache, idx = decode_inputs(2, 1, 2, 576, 2, 16, 20, torch.float16, seed=43, fp8=True)
    named = torch.unique(idx[idx >= 0]).long()
    poisoned = poison_like(cache).view(-1, 656)
    poisoned[named] = cache.view(-1, 656)[named]
    out, lse = sparse_mla_decode(q, poisoned.view(cache.shape), idx, 0.1, True)
    filled = torch.randint(0, 120, cache.shape, dtype=torch.uint8,
                           generator=_gen(44)).to(DEVICE).view(-1, 656)
    filled[named] = cache.view(-1, 656)[named]
    out2, lse2 = sparse_mla_decode(q, filled.view(cache.shape), idx, 0.1, True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert not torch.isnan(out).any()
