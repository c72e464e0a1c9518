"""Kernels compiled for sm_90 in a child process, and the record of what they compiled to.

Triton's interpreter, which ``conftest.py`` sets where there is no GPU, cannot compile for a
GPU, so the tests that read what a kernel compiles to (registers, spills, shared memory,
instructions) run a child process without ``TRITON_INTERPRET`` that compiles it and prints
JSON (``compiled``). Compiling every variant takes minutes of CPU on a fresh machine, so
``compiled`` first looks in ``tests/sm90_compiled.json``: what each child printed, under its
command and a key of triton's version and the sources that decide the compile
(``source_key``). Where the tree's key is not the record's, the child runs: any edit of a
kernel compiles again. The record is only ever what a child printed for these exact sources;
refresh it after an edit, in one process (the record is read by every later run with the
same triton, CI's included):

    rm tests/sm90_compiled.json
    MLA_RECORD_COMPILED=1 python -m pytest -q -p no:xdist tests/test_sm90_compile.py \\
        tests/test_sm90_seesaw.py tests/test_fast_topk.py tests/test_fast_indexer.py \\
        tests/test_fast_v4.py -k "sm90 or fit or fits or instructions"
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "sm90_compiled.json"
COMPILERS = ("sm90_compile", "sparse_compile", "indexer_compile", "topk_sweep", "common")
_WRITING = threading.Lock()  # a test may compile in threads


def source_key(argv: list[str]) -> str:
    """sha256 over triton's version and the sources a compile reads: every ``.py`` file under
    ``mla/``, the benchmark modules that compile, and the module ``argv`` runs (``-m``)."""
    import triton

    h = hashlib.sha256(triton.__version__.encode())
    files = sorted((ROOT / "mla").rglob("*.py")) + [ROOT / "benchmarks" / f"{m}.py"
                                                    for m in COMPILERS]
    if argv[0] == "-m":
        files.append(ROOT / (argv[1].replace(".", "/") + ".py"))
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _parse(stdout: str) -> Any:
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        return json.loads(stdout.strip().splitlines()[-1])


def compiled(argv: list[str], timeout: int = 900) -> Any:
    """The JSON ``python argv`` prints (its whole output, or its last line), run in the
    repository's root without ``TRITON_INTERPRET``, or the record's for the same command
    and key."""
    name = json.dumps(argv)
    key = source_key(argv)
    runs = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    if runs.get(name, {}).get("key") == key:
        return runs[name]["printed"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, *argv], cwd=ROOT,
                          env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"compiling for sm_90 failed:\n{done.stderr[-4000:]}"
    printed = _parse(done.stdout)
    if os.environ.get("MLA_RECORD_COMPILED") == "1":
        with _WRITING:
            runs = json.loads(RECORD.read_text()) if RECORD.exists() else {}
            import triton

            runs[name] = {"key": key, "printed": printed, "triton": triton.__version__}
            RECORD.write_text(json.dumps(runs, indent=0, sort_keys=True) + "\n")
    return printed
