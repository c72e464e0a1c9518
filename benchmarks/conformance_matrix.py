"""The conformance matrix: the catalogue run on several targets, one column per target.

    python -m benchmarks.conformance_matrix run --targets mla.fast flashmla vllm-triton \
        [--dtype bfloat16] [--out-dir benchmarks/results]
    python -m benchmarks.conformance_matrix matrix REPORT.json ... --out MATRIX.md

``run`` writes each target's report (``conformance_<target>_<date>.json`` and ``.md``) and the
combined matrix (``conformance_<date>.md``): rows are cases, columns targets, a cell is the
status and, for a failure, the convention the library named. Under the table, every failure
and error of each target with its detail: where a peer follows another convention than the
reference, that is a finding about the peer, said plainly.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

__all__ = ["matrix_markdown", "main"]

MARK = {"pass": "pass", "fail": "**FAIL**", "error": "**ERROR**", "unsupported": "–"}


def _cell(row: dict) -> str:
    mark = MARK[row["status"]]
    if row["status"] in ("fail", "error") and row.get("convention"):
        mark += f": {row['convention']}"
    return mark.replace("|", "/")


def matrix_markdown(reports: list[dict]) -> str:
    """The combined matrix of ``reports`` (``Report.to_json()`` dicts)."""
    targets = [r["target"] for r in reports]
    cases: dict[str, dict] = {}
    for r in reports:
        for row in r["rows"]:
            cases.setdefault(f"{row['kernel']}/{row['case']}", row)
    by = [{f"{row['kernel']}/{row['case']}": row for row in r["rows"]} for r in reports]
    env = reports[0].get("environment", {}) if reports else {}
    lines = ["# Conformance matrix", "",
             f"Date {env.get('date', '?')}; GPU {env.get('gpu', 'none')}; torch "
             f"{env.get('torch', '?')}, triton {env.get('triton', '?')}, CUDA "
             f"{env.get('cuda', '?')}. Inputs in {reports[0]['dtype'] if reports else '?'}; "
             "every output against the float64 reference, held to the error budgets of "
             "`mla.compare` (exact for indices and bytes). `–`: the target has no such kernel "
             "or its adapter does not take the inputs (the reason is in the target's report).",
             "", "| target | pass | fail | error | unsupported |", "|---|---|---|---|---|"]
    for r in reports:
        c = r["counts"]
        lines.append(f"| `{r['target']}` | {c['pass']} | {c['fail']} | {c['error']} | "
                     f"{c['unsupported']} |")
    lines += ["", "| case | pins | " + " | ".join(f"`{t}`" for t in targets) + " |",
              "|---|---|" + "---|" * len(targets)]
    for key, row in cases.items():
        cells = [_cell(b[key]) if key in b else "" for b in by]
        lines.append(f"| `{key}` | {row['doc'].replace('|', '/')} | " + " | ".join(cells) + " |")
    lines += ["", "## Failures and errors, by target", ""]
    for r in reports:
        bad = [row for row in r["rows"] if row["status"] in ("fail", "error")]
        lines.append(f"### `{r['target']}`: {len(bad)} of {len(r['rows'])}")
        lines.append("")
        for row in bad:
            errs = ", ".join(f"{k} {v if isinstance(v, str) else f'{v:.2e}'}"
                             for k, v in row["errors"].items())
            lines.append(f"- `{row['kernel']}/{row['case']}` ({row['status']}"
                         f"{', ' + errs if errs else ''}): "
                         f"{(row['convention'] + '. ') if row.get('convention') else ''}"
                         f"{row['detail'][:500]}")
        lines.append("")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    from mla.conformance import run
    from mla.conformance.targets import load_target

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    dtype = getattr(torch, args.dtype)
    reports = []
    for spec in args.targets:
        name, target = load_target(spec)
        print(f"== {name}", file=sys.stderr, flush=True)
        report = run(target, device=args.device, dtype=dtype, name=name, seed=args.seed,
                     progress=lambda row: print(f"{row.status:11s} {row.kernel}/{row.case} "
                                                f"({row.seconds:.1f} s)", file=sys.stderr,
                                                flush=True))
        stem = f"conformance_{name.replace('.', '_').replace(':', '_')}_{date}"
        (out / f"{stem}.json").write_text(report.to_json())
        (out / f"{stem}.md").write_text(report.to_markdown())
        print(report.summary(), flush=True)
        reports.append(json.loads(report.to_json()))
    (out / f"conformance_{date}.md").write_text(matrix_markdown(reports))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.conformance_matrix",
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the catalogue on targets and write reports + matrix")
    r.add_argument("--targets", nargs="+", required=True)
    r.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    r.add_argument("--device", default=None)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out-dir", default="benchmarks/results")
    m = sub.add_parser("matrix", help="combine existing JSON reports into one matrix")
    m.add_argument("reports", nargs="+")
    m.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.cmd == "run":
        return _run(args)
    reports = [json.loads(Path(f).read_text()) for f in args.reports]
    Path(args.out).write_text(matrix_markdown(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
