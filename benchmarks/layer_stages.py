"""What the layer checks share: a compared quantity (``Stage``), the GEMM budget, the
comparisons (relative Frobenius, max absolute, bytes) and the front's stages.

Used by ``benchmarks.layer_check`` (dense layers and the command) and
``benchmarks.sparse_layer_check`` (sparse layers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mla.compare import TOLERANCES, max_abs_err, rel_err

__all__ = ["Stage", "gemm_budget", "rel_stage", "abs_stage", "bytes_stage", "assert_stages",
           "front_stages"]


@dataclass
class Stage:
    """One compared quantity: the error, its budget and whether it holds."""

    layer: str
    stage: str
    error: float
    budget: float
    measure: str  # "rel" (Frobenius), "abs" (max), "bytes" (count of differing bytes),
    # "logits_err" (mla.compare's, the indexer logits')

    @property
    def passed(self) -> bool:
        return self.error <= self.budget

    def line(self) -> str:
        mark = "ok  " if self.passed else "FAIL"
        return (f"{mark} {self.layer:<34} {self.stage:<18} {self.measure:<5} "
                f"{self.error:.3e} <= {self.budget:.3e}")


def _unit_roundoff(dtype: torch.dtype) -> float:
    return {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8,
            torch.float16: 2.0 ** -11}[dtype]


def gemm_budget(dtype: torch.dtype, contractions: list[int]) -> float:
    """Relative Frobenius budget of a chain of GEMMs computed in ``dtype`` with float32
    accumulation, against float64 on the same inputs.

    Each GEMM rounds its output once to ``dtype`` (unit roundoff ``u``): the absolute error is
    uniform in ``±u·2^E`` for a value ``m·2^E``, and with mantissas ``m`` log-uniform in
    ``[1, 2)`` the relative error's mean square is ``(u²/3)·E[1/m²] = u²/(8 ln 2)``, an rms of
    ``0.42·u`` (measured on bf16 GEMMs at DeepSeek-V3's shapes: ``0.43·u``). The ``K`` float32
    additions of the accumulation add ``K·u32²/(8 ln 2)`` as a random walk (an upper estimate:
    BLAS sums in blocks; for float32 outputs the measured error is 3 to 10 times below it).
    The GEMMs' errors are independent and random weights carry a relative error through, so
    they add in quadrature: ``sqrt(Σ (u² + K·u32²) / (8 ln 2))``, then ×2 as every budget of
    ``mla.compare``. A 1% error exceeds it in every dtype the layers run in.
    """
    u, u32 = _unit_roundoff(dtype), 2.0 ** -24
    mean_square = sum(u * u + k * u32 * u32 for k in contractions) / (8.0 * math.log(2.0))
    return 2.0 * math.sqrt(mean_square)


def rel_stage(layer: str, stage: str, out: torch.Tensor, ref: torch.Tensor,
         bound: float) -> Stage:
    return Stage(layer, stage, rel_err(out, ref), bound, "rel")


def abs_stage(layer: str, stage: str, out: torch.Tensor, ref: torch.Tensor,
         bound: float) -> Stage:
    return Stage(layer, stage, max_abs_err(out, ref), bound, "abs")


def bytes_stage(layer: str, stage: str, out: torch.Tensor, ref: torch.Tensor) -> Stage:
    """Number of differing bytes (NaN bit patterns compare as bytes too); budget 0."""
    a = out.detach().cpu().contiguous().view(torch.uint8)
    b = ref.detach().cpu().contiguous().view(torch.uint8)
    if a.shape != b.shape:
        return Stage(layer, stage, float("inf"), 0.0, "bytes")
    return Stage(layer, stage, float((a != b).sum()), 0.0, "bytes")


def assert_stages(stages: list[Stage]) -> None:
    """Raise ``AssertionError`` listing every stage over its budget."""
    bad = [" ".join(s.line().split()) for s in stages if not s.passed]
    assert not bad, "stages over budget: " + " | ".join(bad)  # one line: pytest -rf shows it


def front_stages(layer: str, f, f_ref, dtype: torch.dtype) -> list[Stage]:
    tol = TOLERANCES[dtype]
    return [rel_stage(layer, f"front.{name}", getattr(f, name), getattr(f_ref, name), tol)
            for name in ("q_nope", "q_pe", "kv_c", "k_pe")]
