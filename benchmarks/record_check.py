"""``python -m benchmarks.record_check DIR --about TEXT``: commit-ready record of a GPU check.

``benchmarks/device_run.sh check`` leaves ``gpu_check.json``, ``gpu_check_table.md`` and
``check.log`` in ``DIR``. This copies the JSON to ``benchmarks/results/checks/gpu_check.json``
(what ``tests/test_gpu_check_record.py`` holds the kernel sources and the registered cases
to) and writes ``gpu_check.md``: one line saying which GPU, when, how many cases, the
versions, the run's seconds (read from ``check.log``) and ``TEXT`` (what the sources add),
then the table. A check with a failure is refused: fix it, run again.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

CHECKS = Path(__file__).resolve().parent / "results" / "checks"


def header(result: dict, seconds: int | None, about: str) -> str:
    """The record's first line, from the check's JSON."""
    env = result["environment"]
    took = f", {seconds} s" if seconds is not None else ""
    return (f"GPU check of mla.fast, {env.get('gpu', '?')}, {env['date']}: "
            f"{result['n_results']} cases, {result['n_failed']} failed, {result['dtype']}; "
            f"torch {env['torch']}, triton {env['triton']}, CUDA {env.get('cuda', '?')}; one run "
            "of one tree (`PYTHONPATH=. python -m mla.check --out "
            f"benchmarks/results/checks/gpu_check.json`){took}. {about}".rstrip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.record_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="where device_run.sh check wrote its files")
    p.add_argument("--about", required=True, help="what the checked sources add")
    p.add_argument("--to", type=Path, default=CHECKS)
    args = p.parse_args(argv)
    result = json.loads((args.dir / "gpu_check.json").read_text())
    if not result.get("passed") or result.get("n_failed"):
        print(f"the check failed {result.get('n_failed')} of {result.get('n_results')} cases: "
              "not recorded", file=sys.stderr)
        return 1
    log = args.dir / "check.log"
    found = re.search(r"passed in (\d+) s", log.read_text()) if log.exists() else None
    table = (args.dir / "gpu_check_table.md").read_text()
    args.to.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(args.dir / "gpu_check.json", args.to / "gpu_check.json")
    text = header(result, int(found.group(1)) if found else None, args.about)
    (args.to / "gpu_check.md").write_text(text + "\n\n" + table)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
