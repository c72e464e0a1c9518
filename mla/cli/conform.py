"""``mla conform``: the conformance catalogue on a target, as a table (``mla.conformance``).

    mla conform --target {mla.fast, reference, flashmla, vllm-triton, flashinfer,
                          pkg.module, pkg.module:attr}
                [--kernels K ...] [--cases C ...] [--device D] [--dtype T] [--seed N]
                [--out report.md] [--json report.json] [--fuzz 300s | --fuzz 200]
                [--fuzz-db PATH] [--properties all | P ...]

One progress line per case on stderr while it runs, the table on stdout at the end (the cases
of kernels the target lacks as one line, the JSON report with a row each). A module given as
``pkg.module`` is found from the working directory first, as ``python -m`` finds it. Exit
statuses: 0 no case failed or raised (unsupported ones allowed), 1 a case failed or raised,
2 bad arguments (an unknown target, kernel or case included), 3 the device is not available.

``--fuzz 300s`` (seconds) or ``--fuzz 200`` (examples per kernel) searches the kernels' inputs
with hypothesis instead of running the named cases (``mla.conformance.fuzz``): each failure is
shrunk to a minimal spec and printed with a snippet that reproduces it (it loads the target
from the same ``--target`` spec); a named peer's inputs are drawn within what its adapter
states it takes (``mla.conformance.fuzz_strategies.accepts_for``); ``--fuzz-db`` (default
``$MLA_FUZZ_DB`` or ``.hypothesis/mla-fuzz``) keeps the failures, which a re-run tries first.
``--properties all`` (or some of ``batch_invariance page_placement batch_permutation``) also
checks, on every decode case or example within its budgets, that the outputs keep their bits
when the batch or the pages change (``mla.conformance.properties``); a broken property fails
the case with the property's convention.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mla.conformance.report import Row

__all__ = ["add_conform_parser"]

DTYPES = ("bfloat16", "float16", "float32", "float64")


def add_conform_parser(sub: argparse._SubParsersAction) -> None:
    from mla.conformance.targets import TARGETS

    named = "\n".join(f"  {k:<12} {v}" for k, v in TARGETS.items())
    p = sub.add_parser(
        "conform", help="run the conformance catalogue on a kernel target",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the catalogue of named cases (each pins one convention or edge) on a\n"
                    "target's kernels against the float64 reference, and print one row per "
                    "case.",
        epilog=f"targets:\n{named}\n  pkg.module   a module with kernels named like "
               "mla.reference's\n  pkg.module:attr  a mapping or object of kernels, or one "
               "function (name\n               its kernel with --kernels)\n\n"
               "On the CPU, Triton kernels run under Triton's interpreter: this command sets\n"
               "TRITON_INTERPRET=1 unless it is set; the dtype defaults to float32 there and\n"
               "to bfloat16 on CUDA.\n\nexit status: 0 no case failed, 1 a case failed or "
               "raised, 2 bad arguments,\n3 the device is not available.")
    p.add_argument("--target", required=True, metavar="TARGET",
                   help="a named target, pkg.module or pkg.module:attr")
    p.add_argument("--kernels", nargs="+", metavar="K", help="only these kernels")
    p.add_argument("--cases", nargs="+", metavar="C",
                   help="only these cases: kernel/name, a name or a topic")
    p.add_argument("--device", help="cpu or cuda[:n] (default: cuda when there is one)")
    p.add_argument("--dtype", choices=DTYPES,
                   help="input dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", metavar="PATH", help="also write the report as markdown")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--fuzz", metavar="N|Ns", type=_fuzz_budget,
                   help="search the inputs with hypothesis instead of the cases: N examples "
                        "per kernel, or Ns seconds in all (e.g. 300s)")
    p.add_argument("--fuzz-db", metavar="PATH",
                   help="the fuzz's example database (default: $MLA_FUZZ_DB, else "
                        ".hypothesis/mla-fuzz)")
    p.add_argument("--keep-going", action="store_true",
                   help="with --fuzz: after a failure, search the rest of the budget for "
                        "failures of other modes (other conventions, properties or outputs)")
    p.add_argument("--properties", nargs="+", metavar="P",
                   help="also check these metamorphic properties of the decodes' cases (or, "
                        "with --fuzz, examples), bit for bit ('all', or batch_invariance, "
                        "page_placement, batch_permutation)")
    p.set_defaults(run=_conform, parser=p)


def _fuzz_budget(text: str) -> tuple[str, float]:
    """``"300s"`` -> ("seconds", 300.0), ``"200"`` -> ("examples", 200)."""
    seconds = text.endswith("s")
    try:
        value = float(text[:-1]) if seconds else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of examples (200) or of seconds (300s), got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive budget, got {text!r}")
    return ("seconds" if seconds else "examples", value)


def _conform(args: argparse.Namespace) -> int:
    import torch

    try:
        device = torch.device(args.device) if args.device else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
    except RuntimeError as e:
        args.parser.error(f"--device {args.device!r}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"mla conform: --device {args.device} asked for but CUDA is not available here",
              file=sys.stderr)
        return 3
    if device.type == "cpu":
        # the interpreter is chosen when triton is first imported (mla.fast, a peer): set it
        # before loading the target
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if args.target == "mla.fast" and os.environ["TRITON_INTERPRET"] != "1":
            args.parser.error(f"--target mla.fast on the CPU runs under Triton's interpreter: "
                              f"TRITON_INTERPRET must be 1, it is "
                              f"{os.environ['TRITON_INTERPRET']!r}")

    from mla.conformance.catalogue import KERNELS, cases_of
    from mla.conformance.runner import kernels_of, run
    from mla.conformance.targets import load_target

    unknown = sorted(set(args.kernels or ()) - set(KERNELS))
    if unknown:
        args.parser.error(f"argument --kernels: unknown kernels {unknown}; expected some of "
                          f"{', '.join(KERNELS)}")
    try:
        selected = list(cases_of(args.kernels, args.cases))
    except ValueError as e:
        args.parser.error(f"argument --cases: {e}")
    if not selected:
        topics = sorted({c.topic for c in cases_of(args.kernels)})
        args.parser.error(f"argument --cases: {args.cases} select no case of --kernels "
                          f"{args.kernels}; the topics of those kernels: {', '.join(topics)}")
    try:
        name, target = load_target(args.target, args.kernels)
    except (ValueError, TypeError) as e:
        args.parser.error(str(e))
    if args.fuzz:
        return _fuzz(args, name, target, device, getattr(torch, args.dtype) if args.dtype
                     else None)
    if args.keep_going:
        args.parser.error("--keep-going goes on fuzzing after a failure: add --fuzz N or Ns")
    has = kernels_of(target)
    # the cases of kernels the target lacks are not run: no progress line, one line at the end
    total = sum(1 for c in selected if c.kernel in has)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    done = 0

    def progress(row: Row) -> None:
        nonlocal done
        if row.kernel not in has:
            return
        done += 1
        print(f"[{done}/{total}] {row.status:<11} {row.kernel}/{row.case}  "
              f"({row.seconds:.1f} s)", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    report = run(target, kernels=args.kernels, device=device, dtype=dtype, cases=args.cases,
                 seed=args.seed, name=name, progress=progress,
                 properties=_properties(args))
    print(f"mla conform: target {name}, {report.dtype} on {report.device}, seed {args.seed}, "
          f"{time.perf_counter() - t0:.1f} s")
    print("reference: float64 on the CPU on the same inputs; budgets: conventions §11")
    print()
    print(report.to_text())
    _write(report, args)
    return 1 if any(r.status in ("fail", "error") for r in report.rows) else 0


def _properties(args: argparse.Namespace) -> tuple[str, ...] | None:
    """``--properties``, checked (an unknown name is a usage error)."""
    if not args.properties:
        return None
    from mla.conformance.properties import properties_of
    try:
        return properties_of(args.properties)
    except ValueError as e:
        args.parser.error(f"--properties: {e}")
        raise  # (parser.error exits)


def _fuzz(args: argparse.Namespace, name: str, target: object, device: object,
          dtype: object) -> int:
    """``--fuzz``: the search, its report on stdout (and ``--out`` / ``--json``)."""
    from mla.conformance.fuzz import FUZZED, fuzz
    from mla.conformance.runner import kernels_of

    if args.cases:
        args.parser.error("--fuzz draws its own inputs: it takes no --cases")
    kernels = args.kernels or [k for k in FUZZED if k in kernels_of(target)]
    other = [k for k in kernels if k not in FUZZED]
    if other or not kernels:
        args.parser.error(f"--fuzz: no strategy for {other or 'the target'}; fuzzed kernels: "
                          f"{', '.join(FUZZED)}")
    props = _properties(args)
    kind, value = args.fuzz
    t0 = time.perf_counter()

    def progress(run: object) -> None:
        print(f"fuzzed {run.kernel}: {run.examples} examples, "  # type: ignore[attr-defined]
              f"{'a failure' if run.failure else 'no failure'}"  # type: ignore[attr-defined]
              f" ({run.seconds:.1f} s)", file=sys.stderr, flush=True)  # type: ignore[attr-defined]

    # the spec, not the loaded target: each failure's snippet then loads the kernel itself
    # (load_target(spec)), runnable as it stands
    report = fuzz(args.target, kernels, seed=args.seed, device=device, dtype=dtype,
                  database=args.fuzz_db, name=name, progress=progress,
                  properties=props, keep_going=args.keep_going, **{kind: value})
    print(f"mla conform --fuzz: target {name}, {', '.join(report.dtypes)} on {report.device}, "
          f"seed {args.seed}, {time.perf_counter() - t0:.1f} s, database {report.database}")
    print()
    print(report.to_text())
    for f in report.failures:
        print(f"\n# reproduce {f.kernel}:\n{f.snippet}")
    _write(report, args)
    return 0 if report.passed else 1


def _write(report: Any, args: argparse.Namespace) -> None:
    """The report's markdown to ``--out`` and JSON to ``--json``, where asked for."""
    for path, text in ((args.out, report.to_markdown), (args.json, report.to_json)):
        if path:
            with open(path, "w") as f:
                f.write(text())
