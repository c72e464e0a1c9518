"""The one comparison helper every differential test and check uses (conventions §11).

    rel_err(out, ref) = ‖out − ref‖_F / ‖ref‖_F        computed in float64

NaN never passes: a NaN anywhere in ``out`` (or a NaN/inf mismatch) is an infinite error.
Infinite entries (an empty query's ``lse``) must sit at the same places with the same sign
and are left out of the norm. ``poison_like`` gives poisoned buffers for kernels that write
into caller-provided outputs and ``poisoned_alloc`` poisons the buffers a kernel allocates
itself, so an unwritten element cannot pass as a correct one.

Two kinds of limits: ``TOLERANCES`` / ``LSE_ABS_TOL`` for model-level paths (the reference run
in a low precision against float64), and ``ERROR_BUDGETS`` for each fast kernel, derived from
the roundings the kernel does and set at about twice the worst error measured over many seeds
(conventions §11, "Error budgets").
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

__all__ = ["TOLERANCES", "ERROR_BUDGETS", "LSE_ABS_TOL", "rel_err", "max_abs_err",
           "assert_close", "budget", "poison_like", "poisoned_alloc", "tolerance",
           "FP8_MMA_LOGITS_ERR", "fp8_mma_logits_budget", "logits_err"]

# Relative Frobenius tolerances against a float64 reference on upcast inputs (conventions §11).
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
}
LSE_ABS_TOL = 1e-3  # absolute, for lse in float32

# Each fast kernel's error budget, keyed (kernel, input dtype, quantity): out_rel is the
# relative Frobenius error of the output, lse_abs / max_abs the max absolute error of the
# float32 lse / max logit, all against the float64 reference on upcast inputs (lse_abs of the
# prefill paths: against the reference run in the input dtype; lse_abs_f64: against float64).
# Derivation and measurements: conventions §11, "Error budgets". Each budget is about twice the
# worst error measured over many seeds (benchmarks/results/error_budget_*.json; the test
# tests/test_check_budgets.py holds each between 1.5x and 3x of it).
ERROR_BUDGETS: dict[tuple[str, str, str], float] = {
    ("attention_with_lse", "bfloat16", "lse_abs"): 1e-4,
    ("attention_with_lse", "bfloat16", "out_rel"): 4e-3,
    ("attention_with_lse", "float16", "lse_abs"): 1.4e-4,
    ("attention_with_lse", "float16", "out_rel"): 5.8e-4,
    ("attention_with_lse", "float32", "lse_abs"): 2.4e-4,
    ("attention_with_lse", "float32", "out_rel"): 7.9e-6,
    ("chunked_prefill_attention", "bfloat16", "lse_abs"): 3.8e-6,
    ("chunked_prefill_attention", "bfloat16", "lse_abs_f64"): 9e-3,
    ("chunked_prefill_attention", "bfloat16", "out_rel"): 6.3e-3,
    ("chunked_prefill_attention", "float16", "lse_abs"): 3.8e-6,
    ("chunked_prefill_attention", "float16", "lse_abs_f64"): 1e-3,
    ("chunked_prefill_attention", "float16", "out_rel"): 6.9e-4,
    ("chunked_prefill_attention", "float32", "lse_abs"): 3.8e-6,
    ("chunked_prefill_attention", "float32", "lse_abs_f64"): 3.8e-6,
    ("chunked_prefill_attention", "float32", "out_rel"): 1.5e-6,
    ("merge_attn_states", "bfloat16", "lse_abs"): 1.9e-4,
    ("merge_attn_states", "bfloat16", "out_rel"): 2e-3,
    ("merge_attn_states", "float16", "lse_abs"): 1.2e-4,
    ("merge_attn_states", "float16", "out_rel"): 2.7e-4,
    ("merge_attn_states", "float32", "lse_abs"): 1.2e-4,
    ("merge_attn_states", "float32", "out_rel"): 7.5e-8,
    ("mla_decode_paged", "bfloat16", "lse_abs"): 3.4e-4,
    ("mla_decode_paged", "bfloat16", "out_rel"): 3.5e-3,
    ("mla_decode_paged", "float16", "lse_abs"): 4.7e-4,
    ("mla_decode_paged", "float16", "out_rel"): 4.1e-4,
    ("mla_decode_paged", "float32", "lse_abs"): 6.1e-5,
    ("mla_decode_paged", "float32", "out_rel"): 3.6e-6,
    ("prefill_attention", "bfloat16", "lse_abs"): 3.8e-6,
    ("prefill_attention", "bfloat16", "lse_abs_f64"): 9e-3,
    ("prefill_attention", "bfloat16", "out_rel"): 5.6e-3,
    ("prefill_attention", "float16", "lse_abs"): 4.8e-6,
    ("prefill_attention", "float16", "lse_abs_f64"): 1.5e-3,
    ("prefill_attention", "float16", "out_rel"): 7.9e-4,
    ("prefill_attention", "float32", "lse_abs"): 2.9e-6,
    ("prefill_attention", "float32", "lse_abs_f64"): 3.9e-6,
    ("prefill_attention", "float32", "out_rel"): 1.4e-6,
    ("sparse_mla_decode", "bfloat16", "lse_abs"): 2.9e-4,
    ("sparse_mla_decode", "bfloat16", "out_rel"): 3.9e-3,
    ("sparse_mla_decode", "float16", "lse_abs"): 3.1e-4,
    ("sparse_mla_decode", "float16", "out_rel"): 6.3e-4,
    ("sparse_mla_decode", "float32", "lse_abs"): 7.1e-5,
    ("sparse_mla_decode", "float32", "out_rel"): 3.8e-6,
    # the fused front (mla.check.front): a few roundings of the model dtype (the GEMMs' outputs,
    # the normed latents, the rotated query), against the float64 reference; measured on the
    # CPU 4.8e-4 (float16) and 9.9e-7 (float32) over 30 seeds, on an H100 3.43e-3 (bfloat16)
    # over 10 seeds
    ("sparse_front", "bfloat16", "out_rel"): 6.5e-3,
    ("sparse_front", "float16", "out_rel"): 1e-3,
    ("sparse_front", "float32", "out_rel"): 2e-6,
    ("sparse_mla_prefill", "bfloat16", "lse_abs"): 5e-4,
    ("sparse_mla_prefill", "bfloat16", "max_abs"): 5e-4,
    ("sparse_mla_prefill", "bfloat16", "out_rel"): 3.8e-3,
    ("sparse_mla_prefill", "float16", "lse_abs"): 5.8e-4,
    ("sparse_mla_prefill", "float16", "max_abs"): 5.8e-4,
    ("sparse_mla_prefill", "float16", "out_rel"): 5.1e-4,
    ("sparse_mla_prefill", "float32", "lse_abs"): 6.3e-5,
    ("sparse_mla_prefill", "float32", "max_abs"): 6.2e-5,
    ("sparse_mla_prefill", "float32", "out_rel"): 3.3e-6,
}

# The indexer's fp8 logits, ``k_scale · Σ_h w_h · ReLU(q_h · k)``, are measured by
# ``logits_err``: the error's Frobenius norm over that of their magnitude ``mag``, the same
# logits with every weight's absolute value (the reference's function on ``|w|``), not over the
# logits' own norm, which shrinks as heads of opposite weights cancel: how much they cancel is a
# property of the inputs, while every head's dot goes through the accumulator whatever its
# weight's sign. Budget: Hopper's FP8 tensor cores accumulate each 128-dim dot in an
# accumulator of 13 mantissa bits that truncates (DeepSeek-V3's report, §3.3.2; emulated in
# benchmarks/fp8_mma.py): FP8_MMA_LOGITS_ERR from DeepSeek-V3.2's 64 heads up, 1.8 times the
# worst an H200 measures there; with fewer heads the dots' roundings average less, sqrt(64 /
# heads) times it (fp8_mma_logits_budget).
# Derivation and measurements in conventions §11.
FP8_MMA_LOGITS_ERR = 2.0 ** -13


def fp8_mma_logits_budget(heads: int) -> float:
    """``logits_err``'s budget for FP8-MMA logits summed over ``heads`` heads."""
    if heads < 1:
        raise ValueError(f"heads must be >= 1, got {heads}")
    return FP8_MMA_LOGITS_ERR * math.sqrt(max(1.0, 64 / heads))


def logits_err(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor) -> float:
    """‖got − want‖ / ‖mag‖ (float64) over the entries where ``want`` is finite; ``inf`` on NaN
    or infinities that differ from ``want``'s (as ``rel_err``). ``mag``: the magnitude the
    error is measured against, the shape of ``want``, finite where ``want`` is."""
    if mag.shape != want.shape:
        raise ValueError(f"shape mismatch: mag {list(mag.shape)} vs want {list(want.shape)}")
    pair = _aligned(got, want)
    if pair is None:
        return float("inf")
    o, r = pair
    m = mag.detach().to(device="cpu", dtype=torch.float64)[~torch.isinf(
        want.detach().to(device="cpu", dtype=torch.float64))]
    if not torch.isfinite(m).all():
        raise ValueError("mag must be finite wherever want is")
    peak = max(o.abs().max().item(), r.abs().max().item(), m.abs().max().item()) \
        if o.numel() else 0.0
    if peak > 0.0:  # a power-of-two rescale, exact, as rel_err's
        s = 2.0 ** -max(math.frexp(peak)[1], -1000)
        o, r, m = o * s, r * s, m * s
    diff = torch.linalg.vector_norm(o - r).item()
    norm = torch.linalg.vector_norm(m).item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / norm


def tolerance(dtype: torch.dtype) -> float:
    """conventions §11's relative tolerance for outputs of ``dtype``."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no default tolerance for dtype {dtype}; pass tol= explicitly "
                         f"(known: {sorted(str(d) for d in TOLERANCES)})") from None


def budget(kernel: str, dtype: torch.dtype | str, quantity: str) -> float:
    """``ERROR_BUDGETS[(kernel, dtype, quantity)]``; a ``ValueError`` naming what is missing
    (a kernel, dtype or quantity without a measured budget has no silent default)."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    try:
        return ERROR_BUDGETS[(kernel, name, quantity)]
    except KeyError:
        known = sorted({f"{k}/{d}" for k, d, _ in ERROR_BUDGETS})
        raise ValueError(f"no error budget for kernel {kernel!r}, dtype {name}, quantity "
                         f"{quantity!r} (kernels/dtypes with budgets: {', '.join(known)})"
                         ) from None


def _aligned(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """float64 copies with the matching infinities removed; None when they do not match."""
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: out {list(out.shape)} vs ref {list(ref.shape)}")
    o = out.detach().to(device="cpu", dtype=torch.float64)
    r = ref.detach().to(device="cpu", dtype=torch.float64)
    if torch.isnan(o).any() or torch.isnan(r).any():
        return None
    o_inf, r_inf = torch.isinf(o), torch.isinf(r)
    if not torch.equal(o_inf, r_inf) or not torch.equal(o[o_inf], r[r_inf]):
        return None
    return o[~o_inf], r[~r_inf]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ (float64); ``inf`` on NaN or mismatched infinities; 0 for two empties."""
    pair = _aligned(out, ref)
    if pair is None:
        return float("inf")
    o, r = pair
    # torch's norm squares without rescaling: below ~1e-154 an error underflows to 0 (and
    # would pass), above ~1e154 it overflows. Scaling by a power of two first is exact.
    peak = max(o.abs().max().item(), r.abs().max().item()) if o.numel() else 0.0
    if peak > 0.0:
        s = 2.0 ** -max(math.frexp(peak)[1], -1000)  # subnormal peaks: 2**1074 overflows
        o, r = o * s, r * s
    diff = torch.linalg.vector_norm(o - r).item()
    norm = torch.linalg.vector_norm(r).item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / norm


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    pair = _aligned(out, ref)
    if pair is None:
        return float("inf")
    o, r = pair
    return (o - r).abs().max().item() if o.numel() else 0.0


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float | None = None, *,
                 name: str = "out", abs_tol: float | None = None) -> float:
    """Raise ``AssertionError`` unless ``rel_err <= tol`` (default: by ``out``'s dtype).

    With ``abs_tol`` the check is on the max absolute error instead (used for ``lse``).
    Returns the measured error.
    """
    if abs_tol is not None:
        err = max_abs_err(out, ref)
        if not err <= abs_tol:
            raise AssertionError(f"{name}: max abs error {err:.3e} > {abs_tol:.1e}")
        return err
    tol = tolerance(out.dtype) if tol is None else tol
    err = rel_err(out, ref)
    if not err <= tol:
        raise AssertionError(f"{name}: relative error {err:.3e} > {tol:.1e} "
                             f"(shape {list(out.shape)}, dtype {out.dtype})")
    return err


def _poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with NaN (floating, complex), 0xFF (uint8: NaN as e4m3, so an
    unwritten fp8 cache byte cannot pass), True (bool) or the dtype's minimum (other
    integers: an index no valid row has)."""
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype == torch.uint8:
        return t.fill_(0xFF)
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).min)


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor like ``t`` (shape, dtype, device, strides) full of poison (see ``_poison_``)."""
    return _poison_(torch.zeros_like(t))


@contextlib.contextmanager
def poisoned_alloc() -> Iterator[None]:
    """Within the block, every buffer from ``torch.empty``, ``torch.empty_like`` and
    ``Tensor.new_empty`` starts poisoned as ``poison_like``'s (floats, integers and bytes
    alike), so an output or workspace element a kernel wrapper allocates and never writes
    shows up as NaN or an impossible value. Not thread-safe: it patches ``torch`` globally."""
    real_empty, real_empty_like = torch.empty, torch.empty_like
    own_new_empty = "new_empty" in vars(torch.Tensor)
    real_new_empty = torch.Tensor.new_empty

    def empty(*args, **kwargs):  # type: ignore[no-untyped-def]
        return _poison_(real_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):  # type: ignore[no-untyped-def]
        return _poison_(real_empty_like(*args, **kwargs))

    def new_empty(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return _poison_(real_new_empty(self, *args, **kwargs))

    torch.empty, torch.empty_like = empty, empty_like  # type: ignore[assignment]
    torch.Tensor.new_empty = new_empty  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like  # type: ignore[assignment]
        if own_new_empty:
            torch.Tensor.new_empty = real_new_empty  # type: ignore[method-assign]
        else:
            del torch.Tensor.new_empty
