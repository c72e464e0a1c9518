"""The one comparison helper every differential test and check uses (conventions §11).

    rel_err(out, ref) = ‖out − ref‖_F / ‖ref‖_F        computed in float64

NaN never passes: a NaN anywhere in ``out`` (or a NaN/inf mismatch) is an infinite error.
Infinite entries (an empty query's ``lse``) must sit at the same places with the same sign
and are left out of the norm. ``poison_like`` gives NaN-filled buffers for kernels that write
into caller-provided outputs, so an unwritten element cannot pass as a correct one.
"""

from __future__ import annotations

import math

import torch

__all__ = ["TOLERANCES", "rel_err", "max_abs_err", "assert_close", "poison_like", "tolerance"]

# Relative Frobenius tolerances against a float64 reference on upcast inputs (conventions §11).
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
}
LSE_ABS_TOL = 1e-3  # absolute, for lse in float32


def tolerance(dtype: torch.dtype) -> float:
    """conventions §11's relative tolerance for outputs of ``dtype``."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no default tolerance for dtype {dtype}; pass tol= explicitly "
                         f"(known: {sorted(str(d) for d in TOLERANCES)})") from None


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


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor like ``t`` full of NaN (floating), 0xFF (uint8: NaN as e4m3, so an unwritten
    fp8 cache byte cannot pass) or the dtype's minimum (other integers)."""
    if t.is_floating_point():
        return torch.full_like(t, float("nan"))
    if t.dtype == torch.uint8:
        return torch.full_like(t, 0xFF)
    return torch.full_like(t, torch.iinfo(t.dtype).min)
