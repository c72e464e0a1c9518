"""``python -m benchmarks.fuzz_summary DIR``: one report of the many fuzz runs in ``DIR``.

The ``fuzz-peers`` step of ``benchmarks/device_run.sh`` fuzzes each kernel of each target in
its own process (``mla conform --target T --kernels K --fuzz 300s --keep-going --json
DIR/fuzz_T_K.json``). This reads those JSON reports and writes ``DIR/fuzz_<date>.md`` (a
table of every target and kernel: examples judged and skipped, seconds, and each shrunk
failure with the convention the diagnosis names, then the snippets) and ``DIR/fuzz_<date>.json``
(the reports, whole).
"""

from __future__ import annotations

import json
import sys
from datetime import date
from pathlib import Path


def load(folder: Path) -> list[dict]:
    """The fuzz reports in ``folder`` (``fuzz_*.json``, not this module's own output)."""
    out = []
    for p in sorted(folder.glob("fuzz_*.json")):
        d = json.loads(p.read_text())
        if "kernels" in d:
            out.append(d)
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(reports: list[dict]) -> str:
    env = reports[0].get("environment", {}) if reports else {}
    dtypes = ", ".join(reports[0]["dtypes"]) if reports else "?"
    lines = [f"# Fuzz of mla.fast and the peers, {env.get('gpu', '?')}, {env.get('date', '?')}",
             "", f"torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, CUDA "
             f"{env.get('cuda', '?')}; inputs in {dtypes}"
             "; one process a target and kernel, run side by side; each example judged by "
             "the catalogue's budgets (and, for the decodes, the metamorphic properties, bit "
             "for bit). A failure is shrunk to a minimal input; `failures` counts the failure "
             "modes found (a mode: a convention, property or output over its budget).", "",
             "| target | kernel | judged | unsupported | seconds | failures | shrunk to | "
             "convention |", "|---|---|---|---|---|---|---|---|"]
    snippets = []
    for rep in reports:
        for k in rep["kernels"]:
            judged = k["examples"] - k["unsupported"]
            fails = k.get("failures") or ([k["failure"]] if k.get("failure") else [])
            head = (f"| {rep['target']} | {k['kernel']} | {judged} | {k['unsupported']} | "
                    f"{k['seconds']:.0f} | {len(fails)} |")
            if not fails:
                lines.append(head + " - | - |")
            for i, f in enumerate(fails):
                prefix = head if i == 0 else "| | | | | | |"
                lines.append(f"{prefix} `{_cell(f['spec'])}` | "
                             f"{_cell(f['convention'] or '(none known) ' + f['detail'][:200])} |")
                snippets.append((rep["target"], k["kernel"], f))
    for target, kernel, f in snippets:
        lines += ["", f"## {target} `{kernel}`: {f['status']}"
                  + (f" ({f['property']})" if f.get("property") else ""), "",
                  f"{f['convention'] or '(no convention known)'}. {f['detail'][:600]}", "",
                  "```python", f["snippet"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.fuzz_summary DIR", file=sys.stderr)
        return 2
    folder = Path(args[0])
    reports = load(folder)
    if not reports:
        print(f"fuzz_summary: no fuzz_*.json report in {folder}", file=sys.stderr)
        return 1
    day = reports[0].get("environment", {}).get("date", "")[:10] or date.today().isoformat()
    stem = folder / f"fuzz_{day}"
    stem.with_suffix(".json").write_text(json.dumps({"reports": reports}, indent=1) + "\n")
    text = to_markdown(reports)
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
