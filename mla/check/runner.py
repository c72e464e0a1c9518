"""``python -m mla.check``: every fast kernel against the float64 reference, tensor by tensor.

Meant for a GPU (bf16 inputs, DeepSeek shapes); ``--device cpu`` runs the edge cases under
``TRITON_INTERPRET=1`` in float16 or float32 (the interpreter's bf16 ``tl.dot`` is wrong). The
reference runs in float64 on upcast copies of the same inputs; errors are conventions §11's:
relative Frobenius error of the outputs, max absolute error of the lse, exact equality for
integer and byte outputs, each held to its budget in ``mla.compare.ERROR_BUDGETS``. Buffers the
fast path allocates are poisoned (``mla.compare.poisoned_alloc``) and cache rows no request
uses hold NaN, so an unwritten element or a read past a length shows up as an infinite error.

``--seeds N`` runs every case with N seeds and records the worst error of each (kernel,
dtype, quantity): the measurement the budgets are set from. ``--jobs J`` runs the kernels in J
processes at once, each a share of the kernels of about as many cases (on a GPU machine the
cold run's time goes mostly to compiling, which runs on the CPUs), and writes one record as a
single process would. The JSON (``--out``) also records the sha256 of every kernel source the
run used, so that a later edit shows (tests/test_gpu_check_record.py). Exit status 1 on a
failure, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

# the kernel families register their cases on import
from mla.check import (  # noqa: F401
    attention,
    catalogue,
    decode,
    front,
    logits,
    prefill,
    sparse,
)
from mla.check.registry import (
    REGISTRY,
    Ctx,
    Result,
    dtype_name,
    environment,
    kernel_sources,
    run_checks,
    worst_errors,
)

__all__ = ["Ctx", "REGISTRY", "environment", "main", "run_checks", "run_parallel", "run_seeds",
           "report", "split_kernels"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def run_seeds(ctx: Ctx, seeds: list[int], kernels: list[str] | None = None,
              progress: Callable[[str], None] | None = None) -> list[Result]:
    """Every case once per seed."""
    results = []
    for seed in seeds:
        results += run_checks(dataclasses.replace(ctx, seed=seed), kernels, progress)
    return results


def split_kernels(ctx: Ctx, kernels: list[str], jobs: int) -> list[list[str]]:
    """``kernels`` in at most ``jobs`` groups of about as many cases each (the kernel with the
    most cases first, each to the group with the fewest so far), every group in the
    registry's order."""
    count = {k: sum(1 for _ in REGISTRY[k][1](ctx)) for k in kernels}
    groups: list[list[str]] = [[] for _ in range(min(jobs, len(kernels)))]
    sizes = [0] * len(groups)
    for k in sorted(kernels, key=lambda k: -count[k]):
        g = sizes.index(min(sizes))
        groups[g].append(k)
        sizes[g] += count[k]
    order = list(REGISTRY)
    return [sorted(g, key=order.index) for g in groups if g]


def run_parallel(ctx: Ctx, kernels: list[str] | None, jobs: int) -> list[Result]:
    """``run_checks`` of ``kernels`` (all when None) in ``jobs`` processes of ``python -m
    mla.check`` at once, one seed (``ctx.seed``); their results in the registry's order. A
    process that ends without its record (a crash) gives one failed result for each of its
    kernels, naming the exit status."""
    chosen = [k for k in REGISTRY if not kernels or k in kernels]
    groups = split_kernels(ctx, chosen, jobs)
    by_kernel: dict[str, list[Result]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for i, group in enumerate(groups):
            out = os.path.join(tmp, f"{i}.json")
            cmd = [sys.executable, "-m", "mla.check", "--device", str(ctx.device), "--dtype",
                   dtype_name(ctx.dtype), "--seed", str(ctx.seed), "--out", out,
                   *(["--quick"] if ctx.quick else []),
                   *[a for k in group for a in ("--kernel", k)]]
            runs.append((group, out, subprocess.Popen(cmd, stdout=subprocess.DEVNULL)))
        for group, out, proc in runs:
            status = proc.wait()
            if not os.path.exists(out):
                for k in group:
                    by_kernel[k] = [Result(k, "run", dtype_name(ctx.dtype), {}, {}, False, 0.0,
                                           f"the process checking {', '.join(group)} exited "
                                           f"with status {status} before writing its results",
                                           ctx.seed)]
                continue
            with open(out) as f:
                for row in json.load(f)["results"]:
                    by_kernel.setdefault(row["kernel"], []).append(Result(**row))
    return [r for k in chosen for r in by_kernel.get(k, [])]


def report(ctx: Ctx, seeds: list[int], results: list[Result]) -> dict:
    """The JSON record of a run: environment, kernel source hashes, the worst error of each
    (kernel, dtype, quantity), and every result (a single seed) or the failures (several)."""
    failures = [r for r in results if not r.passed]
    rows = results if len(seeds) == 1 else failures
    return {"environment": environment(), "device": str(ctx.device),
            "dtype": str(ctx.dtype).removeprefix("torch."), "quick": ctx.quick,
            "seeds": seeds, "passed": bool(results) and not failures,
            "n_results": len(results), "n_failed": len(failures),
            "kernel_sources": kernel_sources(), "worst": worst_errors(results),
            "results": [dataclasses.asdict(r) for r in rows]}


def _cells(r: Result) -> tuple[str, str, str, str, str]:
    errs = ", ".join(f"{k}={v:.2e}" for k, v in r.metrics.items()) or r.error[:60]
    lim = "/".join(sorted({f"{v:.1e}" for v in r.limits.values()}))
    return r.kernel, r.case, r.dtype, f"{errs} ({lim})", "yes" if r.passed else "NO"


def text_table(results: list[Result]) -> str:
    rows = [("kernel", "case", "dtype", "errors (limits)", "pass")] + [_cells(r)
                                                                      for r in results]
    widths = [min(max(len(row[i]) for row in rows), 90) for i in range(5)]
    return "\n".join("  ".join(c[:w].ljust(w) for c, w in zip(row, widths)) for row in rows)


def markdown_table(results: list[Result]) -> str:
    rows = [("kernel", "case", "dtype", "errors (limits)", "pass")] + [_cells(r)
                                                                      for r in results]
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * 5]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows[1:]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mla.check", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="inputs' dtype (default: bfloat16 on CUDA, float16 on the CPU)")
    p.add_argument("--quick", action="store_true",
                   help="edge-case sizes only (default on the CPU; use under compute-sanitizer)")
    p.add_argument("--kernel", action="append", choices=sorted(REGISTRY),
                   help="only this kernel (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--seeds", type=int, default=1,
                   help="run every case with this many seeds (seed, seed+1, ...) and record "
                        "the worst error of each kernel, dtype and quantity")
    p.add_argument("--jobs", type=int, default=1,
                   help="run the kernels in this many processes at once (one seed only)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--markdown", help="write the results as a markdown table here")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds must be at least 1, got {args.seeds}")
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.jobs > 1 and args.seeds > 1:
        p.error(f"--jobs runs one seed, got --seeds {args.seeds}")
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        print("on the CPU the kernels run only under TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    default = torch.bfloat16 if device.type == "cuda" else torch.float16
    ctx = Ctx(device=device, dtype=DTYPES[args.dtype] if args.dtype else default,
              quick=args.quick or device.type == "cpu", seed=args.seed)
    seeds = list(range(args.seed, args.seed + args.seeds))
    t0 = time.perf_counter()
    if args.jobs > 1:
        results = run_parallel(ctx, args.kernel, args.jobs)
    else:
        results = run_seeds(ctx, seeds, args.kernel,
                            progress=lambda s: print(s, file=sys.stderr, flush=True))
    shown = results if len(seeds) == 1 else [r for r in results if not r.passed]
    print(text_table(shown))
    n_fail = sum(not r.passed for r in results)
    print(f"\n{len(results) - n_fail}/{len(results)} passed in {time.perf_counter() - t0:.0f} s"
          f" on {device} ({ctx.dtype}, seeds {seeds[0]}..{seeds[-1]})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report(ctx, seeds, results), f, indent=1)
            f.write("\n")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_table(results))
    return 1 if n_fail or not results else 0


if __name__ == "__main__":
    sys.exit(main())
