"""The comparison helper every differential test relies on (``mla.compare``, conventions §11).

If this helper lets a NaN, a misplaced infinity or an unwritten output through, every test
built on it passes vacuously; so it is tested on its own.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla.compare import (
    ERROR_BUDGETS,
    LSE_ABS_TOL,
    TOLERANCES,
    assert_close,
    budget,
    max_abs_err,
    poison_like,
    poisoned_alloc,
    rel_err,
    tolerance,
)

FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3)
seeds = st.integers(0, 2**31 - 1)


def _pair(shape, seed, noise=1e-3):
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(*shape, generator=gen, dtype=torch.float64)
    out = ref + noise * torch.randn(*shape, generator=gen, dtype=torch.float64)
    return out, ref, gen


def _random_index(shape, gen):
    return tuple(int(torch.randint(0, s, (1,), generator=gen)) for s in shape)


# --- the value itself ------------------------------------------------------------------------

@given(shapes, seeds, st.sampled_from([1e-12, 1e-6, 1e-1, 10.0]))
def test_rel_err_is_relative_frobenius_in_float64(shape, seed, noise):
    out, ref, _ = _pair(shape, seed, noise)
    want = math.sqrt(((out - ref) ** 2).sum().item()) / math.sqrt((ref ** 2).sum().item())
    assert rel_err(out, ref) == pytest.approx(want, rel=1e-12)
    # relative: scaling both sides by a power of two changes nothing, also where squaring
    # would underflow (an error of 1e-180 must not read as 0) or overflow
    for e in (40, 600, -600, 1000, -1000):
        assert rel_err(out * 2.0**e, ref * 2.0**e) == pytest.approx(want, rel=1e-9)
    assert max_abs_err(out, ref) == pytest.approx((out - ref).abs().max().item(), rel=1e-12)


@given(shapes, seeds, st.sampled_from(FLOATS))
def test_low_precision_out_is_measured_in_float64(shape, seed, dtype):
    """The error of a bf16 output is that of its exact values, not of a bf16 subtraction."""
    out, ref, _ = _pair(shape, seed)
    low = out.to(dtype)
    exact = torch.linalg.vector_norm(low.double() - ref) / torch.linalg.vector_norm(ref)
    assert rel_err(low, ref) == pytest.approx(exact.item(), rel=1e-12)
    normal = ref.sign() * (ref.abs() + 1)  # away from fp16's subnormals
    assert rel_err(normal.to(dtype), normal) <= torch.finfo(dtype).eps / 2  # one rounding


def test_identical_tensors_have_zero_error():
    out, ref, _ = _pair([3, 4], 0)
    assert rel_err(ref, ref.clone()) == 0.0 and max_abs_err(ref, ref.clone()) == 0.0
    assert assert_close(ref.clone(), ref, 0.0) == 0.0


def test_shape_mismatch_is_an_error_not_a_broadcast():
    out, ref, _ = _pair([3, 4], 0)
    for f in (rel_err, max_abs_err, assert_close):
        with pytest.raises(ValueError, match=r"shape mismatch: out \[3, 1\] vs ref \[3, 4\]"):
            f(out[:, :1], ref)


# --- NaN never passes --------------------------------------------------------------------------

@given(shapes, seeds, st.sampled_from(FLOATS), st.booleans())
def test_nan_anywhere_is_infinite_error(shape, seed, dtype, in_out):
    out, ref, gen = _pair(shape, seed)
    out, ref = out.to(dtype), ref.to(dtype)
    target = out if in_out else ref
    target[_random_index(shape, gen)] = float("nan")
    assert rel_err(out, ref) == math.inf
    assert max_abs_err(out, ref) == math.inf
    with pytest.raises(AssertionError, match="relative error inf"):
        assert_close(out, ref, 1e300)
    with pytest.raises(AssertionError, match="max abs error inf"):
        assert_close(out, ref, abs_tol=1e300)


def test_nan_on_both_sides_at_the_same_place_still_fails():
    out, ref, _ = _pair([5], 1)
    out[2] = ref[2] = float("nan")
    assert rel_err(out, ref) == math.inf
    with pytest.raises(AssertionError):
        assert_close(out, ref, 1.0)


def test_nan_where_the_reference_is_infinite_fails():
    ref = torch.tensor([1.0, float("-inf"), 2.0], dtype=torch.float64)
    out = torch.tensor([1.0, float("nan"), 2.0], dtype=torch.float64)
    assert rel_err(out, ref) == math.inf


# --- infinities (an empty query's lse) -------------------------------------------------------

@given(shapes, seeds, st.sampled_from([float("inf"), float("-inf")]))
def test_matching_infinities_are_left_out(shape, seed, inf):
    out, ref, gen = _pair(shape, seed)
    mask = torch.rand(*shape, generator=gen) < 0.4
    mask[_random_index(shape, gen)] = False  # keep one finite entry
    want = rel_err(out[~mask], ref[~mask])
    out_i, ref_i = out.masked_fill(mask, inf), ref.masked_fill(mask, inf)
    assert rel_err(out_i, ref_i) == want
    assert max_abs_err(out_i, ref_i) == max_abs_err(out[~mask], ref[~mask])
    assert_close(out_i, ref_i, want)


def test_all_infinite_and_matching_is_zero_error():
    ref = torch.full((2, 3), float("-inf"))
    assert rel_err(ref.clone(), ref) == 0.0 and max_abs_err(ref.clone(), ref) == 0.0
    assert_close(ref.clone(), ref, 0.0, abs_tol=0.0)


@pytest.mark.parametrize(("o", "r"), [
    (float("inf"), 1.0),             # infinite output, finite reference
    (1.0, float("-inf")),            # finite output, infinite reference
    (float("inf"), float("-inf")),   # wrong sign: FlashMLA's +inf vs the reference's -inf
    (float("-inf"), float("inf")),
])
def test_mismatched_infinities_fail(o, r):
    out = torch.tensor([0.5, o, -2.0], dtype=torch.float64)
    ref = torch.tensor([0.5, r, -2.0], dtype=torch.float64)
    assert rel_err(out, ref) == math.inf and max_abs_err(out, ref) == math.inf
    with pytest.raises(AssertionError):
        assert_close(out, ref, 1e300)
    with pytest.raises(AssertionError):
        assert_close(out, ref, abs_tol=1e300)


# --- zero and empty references ---------------------------------------------------------------

def test_zero_reference():
    ref = torch.zeros(4, 3, dtype=torch.float64)
    assert rel_err(torch.zeros_like(ref), ref) == 0.0
    assert rel_err(-torch.zeros_like(ref), ref) == 0.0  # -0.0 == 0.0
    off = torch.zeros_like(ref)
    off[1, 2] = 1e-300
    assert rel_err(off, ref) == math.inf  # no scale to be relative to: any error is total
    with pytest.raises(AssertionError):
        assert_close(off, ref, 1e300)
    assert assert_close(off, ref, abs_tol=1e-299) == pytest.approx(1e-300)


def test_empty_tensors():
    e = torch.empty(0, 4)
    assert rel_err(e, e.clone()) == 0.0 and max_abs_err(e, e.clone()) == 0.0


# --- assert_close --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_assert_close_default_tolerance_follows_out_dtype(dtype):
    tol = tolerance(dtype)
    gen = torch.Generator().manual_seed(3)
    ref = torch.randn(64, generator=gen, dtype=torch.float64)
    direction = torch.randn(64, generator=gen, dtype=torch.float64)
    direction *= torch.linalg.vector_norm(ref) / torch.linalg.vector_norm(direction)
    # float64 outputs so the error is exactly what is asked for; the default follows out.dtype
    inside, outside = ref + 0.5 * tol * direction, ref + 2.0 * tol * direction
    assert assert_close(inside, ref, tol) == pytest.approx(0.5 * tol, rel=1e-6)
    with pytest.raises(AssertionError, match=r"myname: relative error .* > "):
        assert_close(outside, ref, tol, name="myname")
    if dtype == torch.float64:
        assert_close(inside, ref)
        with pytest.raises(AssertionError):
            assert_close(outside, ref)
    else:  # a low-precision output judged at its own dtype's tolerance
        rounded = ref.to(dtype)
        assert assert_close(rounded, ref) <= tol
        with pytest.raises(AssertionError, match=str(dtype)):
            assert_close((ref + 4 * tol * direction).to(dtype), ref)


def test_assert_close_abs_tol_mode():
    ref = torch.tensor([[10.0, -3.0], [float("-inf"), 2.0]], dtype=torch.float64)
    out = ref.clone()
    out[0, 1] += 0.9 * LSE_ABS_TOL
    assert assert_close(out, ref, abs_tol=LSE_ABS_TOL) == pytest.approx(0.9 * LSE_ABS_TOL)
    out[1, 1] += 2 * LSE_ABS_TOL
    with pytest.raises(AssertionError, match="lse: max abs error"):
        assert_close(out, ref, abs_tol=LSE_ABS_TOL, name="lse")


# --- the tolerances of conventions §11 ---------------------------------------------------

def test_tolerances_table_is_spec_11():
    # conventions §11: float64 paths agree to about 1e-10; float32 far under 1e-5; bf16 between 1e-3
    # and 1e-2 (fp16 no looser than bf16); LSE to 1e-3 absolute in fp32.
    spec = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2,
            torch.bfloat16: 1e-2}
    assert TOLERANCES == spec
    assert LSE_ABS_TOL == 1e-3
    for dtype, tol in spec.items():
        assert tolerance(dtype) == tol
    # each tolerance lets through at least the one rounding of the output to its dtype
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert TOLERANCES[dtype] > torch.finfo(dtype).eps / 2


# --- poisoned outputs ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_poison_like_float_is_all_nan_and_never_passes(dtype):
    t = torch.randn(3, 5).to(dtype)
    p = poison_like(t)
    assert p.shape == t.shape and p.dtype == t.dtype and p.device == t.device
    assert torch.isnan(p).all()
    assert rel_err(p, t) == math.inf
    # a kernel that writes all but one element of a poisoned buffer still fails
    p[...] = t
    p[2, 4] = float("nan")
    with pytest.raises(AssertionError):
        assert_close(p, t, 1e300)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8])
def test_poison_like_int_is_dtype_minimum(dtype):
    t = torch.arange(6, dtype=dtype).view(2, 3)
    p = poison_like(t)
    assert p.dtype == dtype and p.shape == t.shape
    assert (p == torch.iinfo(dtype).min).all()
    assert not torch.equal(p, t)


def test_poison_like_meta_device():
    p = poison_like(torch.empty(2, 3, device="meta", dtype=torch.bfloat16))
    assert p.device.type == "meta" and p.dtype == torch.bfloat16 and p.shape == (2, 3)


def test_poison_like_uint8_is_an_fp8_nan_byte():
    # 0x00 is a valid e4m3 value (zero); 0xFF is NaN, so an unwritten fp8 cache byte shows
    t = torch.zeros(4, 656, dtype=torch.uint8)
    p = poison_like(t)
    assert p.dtype == torch.uint8 and (p == 0xFF).all()
    assert torch.isnan(p.view(torch.float8_e4m3fn).float()).all()


def test_unknown_dtype_has_no_silent_default_tolerance():
    t = torch.arange(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="no default tolerance for dtype torch.int32"):
        assert_close(t, t)
    assert assert_close(t, t, tol=0.0) == 0.0


# --- poisoned allocations --------------------------------------------------------------------

POISON_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int32,
                 torch.int64, torch.int8, torch.uint8, torch.bool]


def _is_poison(t: torch.Tensor) -> bool:
    return torch.equal(t, poison_like(t)) if not t.is_floating_point() else bool(
        torch.isnan(t.float()).all())


@pytest.mark.parametrize("dtype", POISON_DTYPES)
def test_poisoned_alloc_poisons_every_dtype_and_allocator(dtype):
    """Floats (fp8 included) NaN, uint8 0xFF, bool True, other integers their minimum: from
    torch.empty, torch.empty_like and Tensor.new_empty alike, so an integer index output or
    a workspace a wrapper allocates with new_empty cannot pass unwritten."""
    base = torch.zeros(3, 4, dtype=dtype)
    with poisoned_alloc():
        made = [torch.empty(3, 4, dtype=dtype), torch.empty((2,), dtype=dtype),
                torch.empty_like(base), base.new_empty(5), base.new_empty((2, 2))]
    for t in made:
        assert t.dtype == dtype and _is_poison(t), (dtype, t)
    if dtype == torch.uint8:
        assert (made[0] == 0xFF).all()
    elif dtype == torch.bool:
        assert made[0].all()
    elif not base.is_floating_point():
        assert (made[0] == torch.iinfo(dtype).min).all()


def test_poisoned_alloc_restores_the_allocators():
    before = (torch.empty, torch.empty_like, torch.Tensor.new_empty)
    with pytest.raises(RuntimeError, match="inside"):
        with poisoned_alloc():
            with poisoned_alloc():  # nested: the inner exit restores the outer's patch
                pass
            assert torch.isnan(torch.empty(2)).all()
            raise RuntimeError("inside")
    assert (torch.empty, torch.empty_like, torch.Tensor.new_empty) == before
    assert "new_empty" not in vars(torch.Tensor)  # the method is TensorBase's again
    # outside the block, allocations are plain again (no fill at all: zeros stay zeros)
    assert torch.zeros(3).new_empty(0).numel() == 0


def test_poisoned_alloc_catches_an_unwritten_output():
    """A wrapper that forgets one element of its output fails the comparison."""
    def lazy_kernel(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        out[:-1] = x[:-1] * 2
        return out

    x = torch.randn(8, dtype=torch.float64)
    with poisoned_alloc():
        out = lazy_kernel(x)
    assert rel_err(out, x * 2) == math.inf


# --- error budgets ---------------------------------------------------------------------------

def test_budget_lookup_and_missing_keys():
    key = next(iter(ERROR_BUDGETS))
    assert budget(*key) == ERROR_BUDGETS[key]
    assert budget(key[0], getattr(torch, key[1]), key[2]) == ERROR_BUDGETS[key]
    with pytest.raises(ValueError, match="no error budget for kernel 'nope', dtype float16"):
        budget("nope", torch.float16, "out_rel")
    with pytest.raises(ValueError, match="quantity 'typo'"):
        budget(key[0], key[1], "typo")


def test_budgets_sit_under_the_old_blanket_tolerances_and_over_one_rounding():
    """Every budget is tighter than the blanket 1e-2 / 1e-3 they replace, so a 1% error fails;
    an output budget still lets through the output's own rounding (about 0.4 u, conventions
    §11), and an lse budget a float32 rounding of an lse of 10. (The prefill lse against
    float64 carries the keys' rounding to the input dtype: it had no limit before; its
    budget is held under the 1e-2 that a 1% error of an lse near 1 would reach.)"""
    u = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}
    for (kernel, dtype, q), b in ERROR_BUDGETS.items():
        if q == "out_rel":
            assert 0.4 * u[dtype] < b < 1e-2 / 1.5, (kernel, dtype, b)
        elif q == "lse_abs_f64":
            assert 10 * 2.0 ** -24 < b < 1e-2, (kernel, dtype, q, b)
        else:
            assert 10 * 2.0 ** -24 < b < LSE_ABS_TOL, (kernel, dtype, q, b)
