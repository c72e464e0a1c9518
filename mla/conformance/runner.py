"""``run(target)``: every case of the catalogue on a target's kernels, as a ``Report``.

A target maps kernel names (``catalogue.KERNELS``) to callables with ``mla.reference``'s
signatures and conventions: a dict, a module, or any object with those attributes. A name the
target lacks is "unsupported". Each output is held to its error budget: ``mla.compare``'s table
for the input dtype (``ERROR_BUDGETS``, about twice the worst error our kernels measure over
many seeds, conventions §11), 0 for exact outputs (indices, bytes, copies), and
``FLOAT64_BUDGET`` for float64 inputs.

``properties`` (names of ``mla.conformance.properties.PROPERTIES``, or ``"all"``): the decodes'
cases that pass their budgets are also held to these metamorphic properties, bit for bit, and
fail with the property's convention where one breaks (a batch-invariant mode that is not).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from mla.compare import budget
from mla.conformance.catalogue import KERNELS, Case, Setting, Trial, Unsupported, cases_of
from mla.conformance.diagnose import describe, explain, measure
from mla.conformance.properties import PROPERTY_KERNELS, check, properties_of
from mla.conformance.report import Report, Row, missing_kernel_detail
from mla.environment import environment

__all__ = ["run", "run_case", "kernels_of", "FLOAT64_BUDGET", "limit"]

# float64 inputs: a float64 kernel differs from the reference only in the order of its sums,
# about n·2^-53 ≈ 1e-13 for the n ≤ 1e3 terms the cases sum per element; 1e-12 leaves 10x
# (a 1% bug is 1e10 times over it)
FLOAT64_BUDGET = 1e-12


def kernels_of(target: object) -> dict[str, Callable]:
    """The kernels ``target`` supplies, by name: a mapping's entries, or a module's (any
    object's) attributes of those names."""
    if isinstance(target, Mapping):
        found = {k: v for k, v in target.items() if k in KERNELS}
        bad = [k for k, v in found.items() if not callable(v)]
        if bad:
            raise TypeError(f"target's kernels must be callable; {bad} are not")
        unknown = sorted(set(target) - set(KERNELS))
        if unknown:
            raise ValueError(f"target names kernels the catalogue does not know: {unknown} "
                             f"(known: {list(KERNELS)})")
        return dict(found)
    return {k: getattr(target, k) for k in KERNELS if callable(getattr(target, k, None))}


def limit(kernel: str, dtype: torch.dtype, quantity: str) -> float:
    """The budget of one output: 0 when exact, ``FLOAT64_BUDGET`` in float64, else the table's
    (``ValueError`` when it has none)."""
    if quantity == "mismatches":
        return 0.0
    if dtype == torch.float64:
        return FLOAT64_BUDGET
    return budget(kernel, dtype, quantity)


def run_case(kernel_fn: Callable | None, c: Case, setting: Setting,
             properties: tuple[str, ...] = ()) -> Row:
    """One case on one kernel (``None``: the target lacks it); a decode's case within its
    budgets is then held to ``properties`` (``_hold_properties``)."""
    row = Row(c.kernel, c.name, c.topic, c.doc, "unsupported")
    if kernel_fn is None:
        row.detail = missing_kernel_detail(c.kernel)
        return row
    t0 = time.perf_counter()
    try:
        trial: Trial = c.build(setting)
        row.quantities = dict(trial.quantities)
        bk = trial.budget_kernel or c.kernel
        row.limits = {n: trial.limits[n] if n in trial.limits else limit(bk, setting.dtype, q)
                      for n, q in trial.quantities.items()}
        if trial.refuses:
            return _run_refusal(kernel_fn, trial, row, t0)
        outputs = trial.invoke(kernel_fn)
        surface_pending_error(setting.device)
    except Unsupported as e:
        row.detail = str(e) or "the target's adapter does not take these inputs"
        row.seconds = time.perf_counter() - t0
        return row
    except Exception as e:  # a crash is a result of the case, reported, not a stopped run
        row.status = "error"
        row.detail = f"{type(e).__name__}: {e}"[:600]
        row.seconds = time.perf_counter() - t0
        return row
    row.errors = {n: measure(q, outputs.get(n), trial.expected[n])
                  for n, q in trial.quantities.items()}
    ok = all(row.errors[n] <= row.limits[n] for n in row.errors)  # NaN: never <=
    row.status = "pass" if ok and row.errors else "fail"
    if row.status == "fail":
        wrong = {n: w for n, w in trial.expected.items() if not row.errors[n] <= row.limits[n]}
        row.detail = "; ".join(describe(outputs, wrong, trial.quantities))[:1500]
        row.convention = explain(outputs, trial.expected, trial.quantities, row.limits,
                                 trial.alternatives, kernel=c.kernel)
    elif properties and c.kernel in PROPERTY_KERNELS:
        _hold_properties(kernel_fn, c, trial, setting, properties, row)
    row.seconds = time.perf_counter() - t0
    return row


def _hold_properties(kernel_fn: Callable, c: Case, trial: Trial, setting: Setting,
                     properties: tuple[str, ...], row: Row) -> None:
    """Check each property on the case's inputs; the first that breaks fails the row (its
    worst difference in ulps against a limit of 0, where and what it means). A property the
    input cannot show (a batch of one) or whose transformed call is unsupported adds
    nothing."""
    for name in properties:
        try:
            result = check(name, c.kernel, kernel_fn, trial, trial.spec, setting.seed)
        except Unsupported:
            continue
        if result.applicable and not result.passed:
            row.status = "fail"
            row.quantities[name] = "ulps"
            row.errors[name], row.limits[name] = result.ulps, 0.0
            row.detail = f"{name}: the worst difference {result.ulps:g} ulps, at {result.where}"
            row.convention = result.convention
            return


def surface_pending_error(device: torch.device | str) -> None:
    """Raise, within the case that left it, a CUDA error a kernel left pending: a launch the
    driver rejected (an empty grid, say) returns no error to a caller that does not ask, and
    the next launch anywhere (the next case's) would report it. One synchronize and one tiny
    launch, whose check reads the error slot. On the CPU, nothing."""
    if torch.device(device).type != "cuda":
        return
    torch.cuda.synchronize(device)
    try:
        torch.zeros(1, device=device).add_(1)
    except Exception as e:
        raise RuntimeError(f"the kernel returned, but left a CUDA error pending (seen at the "
                           f"next launch): {type(e).__name__}: {str(e).splitlines()[0]}") from e


def _run_refusal(kernel_fn: Callable, trial: Trial, row: Row, t0: float) -> Row:
    """A case of invalid inputs: "pass" when the kernel raises one of ``trial.refuses``."""
    names = " or ".join(e.__name__ for e in trial.refuses)
    try:
        trial.invoke(kernel_fn)
    except trial.refuses as e:
        row.status, row.detail = "pass", f"refused: {type(e).__name__}: {e}"[:600]
    else:
        row.status = "fail"
        row.detail = (f"returned a result for inputs the reference refuses; expected {names} "
                      f"(a kernel that runs on them reads past what it was given)")
    row.seconds = time.perf_counter() - t0
    return row


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run(target: object, kernels: list[str] | None = None, device: str | torch.device | None
        = None, dtype: torch.dtype | None = None, cases: list[str] | None = None, seed: int = 0,
        name: str | None = None, progress: Callable[[Row], None] | None = None,
        small: bool | None = None, properties: str | Sequence[str] | None = None) -> Report:
    """Run the catalogue (or its ``kernels`` / ``cases``) on ``target``; see the module doc.

    ``device`` defaults to CUDA when there is one; ``dtype`` to bfloat16 on CUDA and float32
    on the CPU (Triton's interpreter). ``progress`` is called with each row as it finishes.
    ``small`` (default: on the CPU) shortens the "long" lengths, for the interpreter and for
    compute-sanitizer. ``properties``: also hold the decodes' cases to these (module doc).
    """
    dev = torch.device(device) if device is not None else _default_device()
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    props = properties_of(properties)
    fns = kernels_of(target)
    setting = Setting(dev, dtype, seed, dev.type == "cpu" if small is None else small)
    rows = []
    for c in cases_of(kernels, cases):
        row = run_case(fns.get(c.kernel), c, setting, props)
        rows.append(row)
        if progress:
            progress(row)
    label = name or getattr(target, "__name__", None) or type(target).__name__
    return Report(str(label), str(dev), str(dtype).removeprefix("torch."), rows,
                  environment(dev))
