"""``mla bench``: a target's kernels timed on named shapes, beside mla.fast and FlashMLA.

    mla bench --target {mla.fast, reference, flashmla, ..., pkg.module, pkg.module:attr}
              [--kernels K ...] [--shapes PRESET|SHAPE ...] [--beside mla.fast flashmla | none]
              [--dtype T] [--reps N] [--warm] [--eager] [--seed N]
              [--json PATH] [--out PATH.md] [--plot PATH.png] [--dry-run] [--list-shapes]

Exit statuses: 0 done (rows may be skipped or hold a kernel's error), 2 bad arguments, or no
CUDA device without ``--dry-run`` (one line on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

__all__ = ["add_bench_parser"]

DTYPES = ("bfloat16", "float16", "float32")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from mla.bench.runner import BESIDE
    from mla.bench.shapes import KERNELS, PRESETS

    p = sub.add_parser(
        "bench", help="time a kernel target on named DeepSeek shapes",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Time a target's kernels (as mla conform takes targets) on named shapes,\n"
                    "beside mla.fast and FlashMLA on the same inputs; the copy and bf16 matmul\n"
                    "ceilings are measured in the same run and every time is also given as\n"
                    "GB/s and TFLOP/s and as fractions of them.",
        epilog=f"presets: {', '.join(PRESETS)} (mla bench --list-shapes: every shape)\n"
               f"kernels: {', '.join(KERNELS)}\n\n"
               "Times: median of CUDA-graph replays, L2 flushed by a 256 MB read before each\n"
               "(--warm: not flushed); a call that cannot be captured is timed eagerly and\n"
               "marked so. Needs a CUDA GPU; --dry-run builds every shape's inputs at tiny\n"
               "sizes on the CPU and calls the target's kernels once, timing nothing.\n\n"
               "exit status: 0 done, 2 bad arguments or no CUDA device.")
    p.add_argument("--target", metavar="TARGET",
                   help="a named target (mla.fast, reference, flashmla, ...), pkg.module or "
                        "pkg.module:attr")
    p.add_argument("--kernels", nargs="+", metavar="K", help="only the shapes of these kernels")
    p.add_argument("--shapes", nargs="+", metavar="NAME",
                   help=f"presets ({', '.join(PRESETS)}) or shape names "
                        "(deepseek-v3.2/decode-memory); default all")
    p.add_argument("--beside", nargs="+", metavar="T", default=list(BESIDE),
                   choices=[*BESIDE, "none"],
                   help="also time these on the same inputs (default: mla.fast flashmla; none)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="float input dtype")
    p.add_argument("--reps", type=_positive, default=50, help="timed runs per call (median)")
    p.add_argument("--warm", action="store_true", help="do not flush the L2 before each run")
    p.add_argument("--eager", action="store_true", help="time eager calls, not graph replays")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--out", metavar="PATH", help="also write the table as markdown")
    p.add_argument("--plot", metavar="PATH", help="also plot the times (needs matplotlib)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny inputs on the CPU, each kernel called once, nothing timed")
    p.add_argument("--list-shapes", action="store_true", help="print the shapes and exit")
    p.set_defaults(run=_bench, parser=p)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _bench(args: argparse.Namespace) -> int:
    from mla.bench.report import shape_listing

    if args.list_shapes:
        print(shape_listing())
        return 0
    if not args.target:
        args.parser.error("the following arguments are required: --target")
    import torch

    from mla.bench.shapes import select_shapes

    try:
        shapes = select_shapes(args.shapes, args.kernels)
    except ValueError as e:
        args.parser.error(str(e))
    if not shapes:
        args.parser.error(f"no shape of {args.shapes} times {args.kernels}")
    if not args.dry_run and not torch.cuda.is_available():
        print("mla bench: timing needs a CUDA GPU and none is available here (torch "
              f"{torch.__version__}); --dry-run checks the target on tiny CPU inputs",
              file=sys.stderr)
        return 2
    device = torch.device("cuda" if not args.dry_run else "cpu")
    if args.dry_run:
        # mla.fast on the CPU runs under Triton's interpreter, chosen when triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    beside = [] if "none" in args.beside else args.beside
    if args.dry_run:
        beside = []  # the target only: the peers need CUDA, mla.fast's interpreter is slow
    from mla.bench.runner import resolve_targets, run_bench

    try:
        targets = resolve_targets(args.target, args.kernels, beside)
    except (ValueError, TypeError) as e:
        args.parser.error(str(e))
    from mla.bench import report
    from mla.environment import environment

    dtype = getattr(torch, args.dtype)
    meta = {"target": targets[0].name, "beside": [t.name for t in targets[1:]],
            "dtype": args.dtype, "device": str(device), "dry_run": args.dry_run,
            "reps": args.reps, "flush": not args.warm, "graph": not args.eager,
            "seed": args.seed, "shapes": [s.name for s in shapes],
            "environment": environment(device)}
    if not args.dry_run:
        from mla.bench.timing import ceilings

        print("mla bench: measuring the ceilings ...", file=sys.stderr, flush=True)
        meta["ceilings"] = ceilings()
    t0 = time.perf_counter()

    def progress(r: object) -> None:
        what = (f"{r.us:.1f} us ({r.method})" if r.us is not None  # type: ignore[attr-defined]
                else "skipped" if r.skipped else "error" if r.error  # type: ignore[attr-defined]
                else "called")
        print(f"{r.shape} {r.target}: {what}", file=sys.stderr,  # type: ignore[attr-defined]
              flush=True)

    results = run_bench(shapes, targets, device, dtype, seed=args.seed, reps=args.reps,
                        flush=not args.warm, graph=not args.eager, dry_run=args.dry_run,
                        ceil=meta.get("ceilings"), progress=progress)
    meta["seconds"] = round(time.perf_counter() - t0, 2)
    print(report.to_text(results, meta))
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.to_json(results, meta))
    if args.out:
        with open(args.out, "w") as f:
            f.write(report.to_markdown(results, meta))
    if args.plot:
        try:
            report.plot(results, meta, args.plot)
        except ImportError as e:
            print(f"mla bench: --plot needs matplotlib ({e}); no plot written", file=sys.stderr)
    return 0
