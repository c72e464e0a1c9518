"""Time a target's kernels on the named shapes, beside ``mla.fast`` and FlashMLA.

Each shape's inputs are built once (``mla.bench.inputs``) and every target is called on the
same tensors, in ``mla.reference``'s signature of the kernel. A target without the shape's
kernel, or one that refuses the shape (``Unsupported`` from a conformance adapter: FlashMLA
takes page size 64, bf16 and 64 or 128 padded heads, for example), gets a row that says why;
a call that raises gets a row with the error, and the run goes on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from mla.bench.inputs import build_inputs
from mla.bench.shapes import Shape, element_size, tiny, work

__all__ = ["BESIDE", "Result", "Target", "resolve_targets", "run_bench"]

BESIDE = ("mla.fast", "flashmla")


@dataclasses.dataclass
class Target:
    """A labelled set of kernels, or ``skipped``: why there are none here."""

    name: str
    kernels: dict[str, Callable] = dataclasses.field(default_factory=dict)
    skipped: str | None = None


@dataclasses.dataclass
class Result:
    """One target on one shape: its time and rates, or why it has none (``skipped``,
    ``error``). A dry run fills ``outputs`` (the shapes it returned) instead of a time."""

    shape: str
    kernel: str
    dims: str
    bound: str
    target: str
    flops: float
    bytes: float
    us: float | None = None
    method: str = ""
    l2: str = ""
    why: str = ""
    GBps: float | None = None
    TFLOPs: float | None = None
    frac_copy: float | None = None
    frac_matmul: float | None = None
    skipped: str | None = None
    error: str | None = None
    outputs: list[list[int]] | None = None

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _fast() -> Target:
    try:
        import mla.fast as fast
    except Exception as e:  # noqa: BLE001 (no triton, a broken install: say so, go on)
        return Target("mla.fast", skipped=f"mla.fast is not importable: {type(e).__name__}: "
                                           f"{e}"[:300])
    from mla.conformance.runner import kernels_of

    return Target("mla.fast", kernels_of(fast))  # value checks off, as a caller runs it


def _flashmla() -> Target:
    from mla.conformance.adapters import import_peer
    from mla.conformance.adapters.flashmla import INTERFACE, target
    from mla.conformance.catalogue import Unsupported

    try:
        import_peer(INTERFACE, "FlashMLA")
    except Unsupported as e:
        return Target("flashmla", skipped=str(e))
    return Target("flashmla", target())


def resolve_targets(spec: str, kernels: list[str] | None = None,
                    beside: Sequence[str] = BESIDE) -> list[Target]:
    """The target ``spec`` (as ``mla conform --target`` takes it: a named target,
    ``pkg.module`` or ``pkg.module:attr``), then the ``beside`` ones that are not it
    (``mla.fast``, ``flashmla``; each skipped with a reason when it cannot load).
    ``ValueError``/``TypeError`` from ``mla.conformance.targets.load_target`` for a bad
    spec."""
    from mla.conformance.runner import kernels_of
    from mla.conformance.targets import load_target

    bad = sorted(set(beside) - set(BESIDE))
    if bad:
        raise ValueError(f"cannot time {bad} beside the target; known: {list(BESIDE)}")
    if spec == "mla.fast":
        main = _fast()
        if main.skipped:
            raise ValueError(f"target 'mla.fast': {main.skipped}")
    elif spec == "flashmla":
        main = _flashmla()  # the same adapter, its absence a row rather than an error
    else:
        name, obj = load_target(spec, kernels)
        main = Target(name, kernels_of(obj))
    out = [main]
    for b in beside:
        if b != spec:
            out.append(_fast() if b == "mla.fast" else _flashmla())
    return out


def _shapes_of(out: object) -> list[list[int]]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [list(t.shape) for t in items if isinstance(t, torch.Tensor)]


def _one(s: Shape, t: Target, fn: Callable[[], object], row: Result, dry_run: bool,
         device: torch.device, reps: int, flush: bool, graph: bool,
         ceil: dict[str, float | str] | None) -> None:
    from mla.conformance.catalogue import Unsupported

    try:
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Unsupported as e:
        row.skipped = str(e)[:300]
        return
    except Exception as e:  # noqa: BLE001 (a kernel that raises: a row, not a crash)
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return
    if dry_run:
        row.outputs = _shapes_of(out)
        return
    del out
    from mla.bench.timing import time_call

    tm = time_call(fn, reps=reps, flush=flush, graph=graph)
    row.us, row.method, row.l2, row.why = tm.us, tm.method, tm.l2, tm.why
    sec = tm.us * 1e-6
    row.GBps = row.bytes / sec / 1e9
    row.TFLOPs = row.flops / sec / 1e12
    if ceil:
        row.frac_copy = row.GBps / ceil["copy_GBps"]
        # the indexer's logits are fp8 MMAs: against the fp8 rate, where it was measured
        rate = ceil.get("fp8_matmul_TFLOPs" if s.precision == "fp8" else "matmul_TFLOPs")
        row.frac_matmul = row.TFLOPs / rate if isinstance(rate, float) and rate > 0 else None


def run_bench(shapes: Sequence[Shape], targets: Sequence[Target], device: torch.device | str,
              dtype: torch.dtype = torch.bfloat16, seed: int = 0, reps: int = 50,
              flush: bool = True, graph: bool = True, dry_run: bool = False,
              ceil: dict[str, float | str] | None = None,
              progress: Callable[[Result], None] | None = None) -> list[Result]:
    """One ``Result`` per shape and target, in order. ``dry_run``: each shape at its tiny
    sizes (``mla.bench.shapes.tiny``), each kernel called once, nothing timed; else each call
    timed by ``mla.bench.timing.time_call`` and its rates set against ``ceil``
    (``mla.bench.timing.ceilings``: GB/s against the copy, TFLOP/s against the bf16 matmul,
    or for the fp8 kernels (``Shape.precision``) the fp8 one)."""
    device = torch.device(device)
    e = element_size(str(dtype).removeprefix("torch."))
    results = []
    for full in shapes:
        s = tiny(full) if dry_run else full
        flops, nbytes = work(s, e)
        inputs = None
        for t in targets:
            row = Result(s.name, s.kernel, s.dims, s.bound, t.name, flops, nbytes)
            kernel = t.kernels.get(s.kernel)
            if t.skipped:
                row.skipped = t.skipped
            elif kernel is None:
                row.skipped = f"{t.name} has no {s.kernel}"
            else:
                if inputs is None:
                    inputs = build_inputs(s, device, dtype, seed)

                def fn(kernel: Callable = kernel, a: tuple = inputs.args,
                       kw: dict = inputs.kwargs) -> object:
                    return kernel(*a, **kw)
                _one(s, t, fn, row, dry_run, device, reps, flush, graph, ceil)
            results.append(row)
            if progress is not None:
                progress(row)
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results
