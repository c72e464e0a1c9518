"""The GPU check's registry: contexts, cases, results, running them, and what a result records.

A kernel family registers its cases with ``@register(kernel, fast_name)`` on a function
``(ctx: Ctx) -> Iterable[Case]``; ``fast_name`` is the kernel's public name in ``mla.fast``
(a kernel whose fast function cannot be imported fails with one result saying so: nothing is
skipped). Each case's ``run()`` returns its measured errors by quantity (``out_rel``,
``lse_abs``, ..., ``mismatches``; a ``[i]`` suffix for repeats). Limits are not the case's
own: each error is held to ``mla.compare.budget(kernel, dtype, quantity)`` (``mismatches``: 0),
so the budget table is the one place a tolerance lives (a case that returns ``Measured``
brings its limits along: the conformance catalogue's, see ``mla.check.catalogue``). A case
fails on an error over its budget, on a quantity without a budget, on an exception, or when
it measures nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from mla.compare import budget
from mla.environment import environment
from mla.fast.sm90 import GIVEN_UP as GLUON_GIVEN_UP

__all__ = ["Ctx", "Case", "Measured", "Result", "REGISTRY", "register", "gen", "limits_for",
           "run_checks", "graph_replay_metrics", "environment", "kernel_sources",
           "worst_errors", "dtype_name"]

Metrics = dict[str, float]
EXACT = "mismatches"  # bit-for-bit quantities: the limit is 0, whatever the dtype
# GLUON_GIVEN_UP: how mla.fast.sm90 says a Gluon kernel failed to build. From then on the
# process runs a Triton kernel in its place, so a check that went on would pass on a kernel it
# was not meant to check.
_PASSED_ON: dict = {}  # the warnings passed on, so that the filters' "once a place" holds


@dataclasses.dataclass(frozen=True)
class Ctx:
    device: torch.device
    dtype: torch.dtype  # of the fast path's inputs
    quick: bool  # edge-case sizes only (interpreter, compute-sanitizer)
    seed: int = 0


@dataclasses.dataclass
class Measured:
    """What a case returns when some of its limits are its own (the catalogue's cases:
    an fp8 dequantization error held to the reference's own on the same inputs)."""
    metrics: Metrics
    limits: Metrics


@dataclasses.dataclass
class Case:
    name: str
    run: Callable[[], Metrics | Measured]
    dtype: torch.dtype | None = None  # the inputs' dtype when it is not the context's


@dataclasses.dataclass
class Result:
    kernel: str
    case: str
    dtype: str
    metrics: Metrics
    limits: Metrics
    passed: bool
    seconds: float
    error: str = ""
    seed: int = 0


REGISTRY: dict[str, tuple[str, Callable[[Ctx], Iterable[Case]]]] = {}


def register(kernel: str, fast_name: str) -> Callable:
    """Register a case generator for ``kernel``, run by ``mla.fast.<fast_name>``."""
    def deco(fn: Callable[[Ctx], Iterable[Case]]) -> Callable[[Ctx], Iterable[Case]]:
        REGISTRY[kernel] = (fast_name, fn)
        return fn
    return deco


def gen(ctx: Ctx, salt: int) -> torch.Generator:
    """The CPU generator of one case: its inputs depend on the random seed and the salt only."""
    return torch.Generator().manual_seed(ctx.seed * 1000003 + salt)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def quantity(metric: str) -> str:
    """``out_rel[2]`` -> ``out_rel``."""
    return metric.split("[", 1)[0]


def limits_for(kernel: str, dtype: torch.dtype, metrics: Metrics) -> Metrics:
    """Each metric's limit from the budget table (``ValueError`` for a quantity without one)."""
    return {k: 0.0 if quantity(k) == EXACT else budget(kernel, dtype, quantity(k))
            for k in metrics}


def _missing(fast_name: str) -> str:
    """Why ``mla.fast.<fast_name>`` cannot be called, or "" when it can."""
    try:
        import mla.fast as fast
    except ImportError as e:
        return f"mla.fast fails to import: {type(e).__name__}: {e}"
    return "" if callable(getattr(fast, fast_name, None)) else f"mla.fast has no {fast_name}"


def run_checks(ctx: Ctx, kernels: list[str] | None = None,
               progress: Callable[[str], None] | None = None) -> list[Result]:
    """Every registered case (of ``kernels``, when given) under ``ctx``."""
    results = []
    for kernel, (fast_name, cases) in REGISTRY.items():
        if kernels and kernel not in kernels:
            continue
        missing = _missing(fast_name)
        if missing:
            results.append(Result(kernel, "import", dtype_name(ctx.dtype), {}, {}, False, 0.0,
                                  missing[:500], ctx.seed))
            if progress:
                progress(f"FAIL {kernel}: {missing}")
            continue
        for case in cases(ctx):
            dtype = case.dtype or ctx.dtype
            t0 = time.perf_counter()
            metrics: Metrics = {}
            limits: Metrics = {}
            try:
                got = _run_watching_gluon(case)
                if isinstance(got, Measured):
                    metrics, limits = got.metrics, got.limits
                else:
                    metrics, limits = got, limits_for(kernel, dtype, got)
                passed = bool(metrics) and all(metrics[k] <= limits[k] for k in metrics)
                err = ""
            except Exception as e:  # a crash is a failed case, reported, not a stopped run
                passed, err = False, f"{type(e).__name__}: {e}"
            res = Result(kernel, case.name, dtype_name(dtype), metrics, limits, passed,
                         time.perf_counter() - t0, err[:500], ctx.seed)
            results.append(res)
            if progress:
                progress(f"{'PASS' if passed else 'FAIL'} {kernel}: {case.name} "
                         f"({res.seconds:.1f} s) {err[:200]}")
    return results


def _run_watching_gluon(case: Case) -> Metrics | Measured:
    """``case.run()``, raising ``RuntimeError`` when a Gluon sm_90 kernel (or all of them) was
    given up during it (``GLUON_GIVEN_UP``): the case that made a Gluon kernel fail to build
    fails, and so does the check, though its later cases pass on the Triton kernels. Other
    warnings are passed on as they came."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = case.run()
    given_up = ""
    for w in seen:
        if str(w.message).startswith(GLUON_GIVEN_UP):
            given_up = str(w.message)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno,
                                   registry=_PASSED_ON)
    if given_up:
        raise RuntimeError(f"{given_up[:300]}; every later case of this run runs the Triton "
                           "kernels in the place of what was given up")
    return got


def graph_replay_metrics(
        static: list[torch.Tensor], sets: list[tuple[torch.Tensor, ...]],
        call: Callable[[bool | None], tuple[torch.Tensor, torch.Tensor]],
        metrics: Callable[[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor], Metrics]
        ) -> Metrics:
    """A kernel call captured in a CUDA graph and replayed on new inputs (CUDA only).

    ``call(validate)`` runs the kernel on the ``static`` buffers. First, with
    ``validate=False``, it must make no device-to-host sync
    (``torch.cuda.set_sync_debug_mode('error')``); then it is captured (``validate=None``: the
    kernel skips its host checks while capturing) and replayed after copying each input set
    of ``sets`` (the first last) into ``static``, its outputs poisoned with NaN before each
    replay. Returns ``metrics(set, out, lse)`` of every replay, suffixed ``[i]``."""
    call(False)  # compile outside the capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        call(False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = call(None)
    measured: Metrics = {}
    for i, x in enumerate(sets[1:] + sets[:1]):
        for dst, src in zip(static, x):
            dst.copy_(src)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for k, v in metrics(x, out, lse).items():
            measured[f"{k}[{i}]"] = v
    return measured


def worst_errors(results: Iterable[Result]) -> dict[str, dict]:
    """The largest error of each ``kernel|dtype|quantity`` over ``results`` (all seeds), with
    the case and seed that gave it; exact quantities are left out (their budget is 0)."""
    worst: dict[str, dict] = {}
    for r in results:
        for k, v in r.metrics.items():
            q = quantity(k)
            if q == EXACT:
                continue
            key = f"{r.kernel}|{r.dtype}|{q}"
            # NaN or inf is a failure, not a measurement: it must not hide as a small number
            v = v if math.isfinite(v) else math.inf
            if key not in worst or v > worst[key]["error"]:
                worst[key] = {"error": v, "case": r.case, "seed": r.seed}
    return dict(sorted(worst.items()))


KERNEL_DIR = Path(__file__).resolve().parent.parent / "fast"


def kernel_sources(root: Path = KERNEL_DIR) -> dict[str, str]:
    """sha256 of every ``.py`` under ``mla/fast/`` (the kernels and their wrappers), keyed by
    the path relative to the repository root: what a check result was measured on."""
    repo = root.parent.parent
    return {p.relative_to(repo).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*.py"))}
