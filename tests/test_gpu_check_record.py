"""No kernel edit goes unchecked on the GPU.

The Gluon sm_90 kernels cannot run in CI (Triton's interpreter does not run Gluon), so the
last committed GPU check, ``benchmarks/results/checks/gpu_check.json`` (written by ``PYTHONPATH=.
python -m mla.check --out benchmarks/results/checks/gpu_check.json`` on a GPU), records the sha256
of every source under ``mla/fast/`` it ran. This test fails when a source in the tree differs
from the one that check ran (edited, added or removed), when that check did not pass, when it
did not run the full bf16 case set on CUDA, or when the cases registered under ``mla/check/``
are no longer the ones it ran (a family or case added, renamed or removed). The fix is to
re-run the command above on a GPU and commit the result with the change.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mla.check.runner  # noqa: F401  (the kernel families register their cases on import)
from mla.check.registry import REGISTRY, Ctx, kernel_sources

RECORD = (Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "checks"
          / "gpu_check.json")
RERUN = ("re-run `PYTHONPATH=. python -m mla.check --out "
         "benchmarks/results/checks/gpu_check.json` on a GPU and commit the result")


@pytest.fixture(scope="module")
def record() -> dict:
    assert RECORD.exists(), f"no committed GPU check at {RECORD}: {RERUN}"
    return json.loads(RECORD.read_text())


def test_the_committed_gpu_check_passed_on_the_full_bf16_set(record):
    assert record["device"].startswith("cuda"), f"{RECORD} ran on {record['device']}: {RERUN}"
    assert record["dtype"] == "bfloat16" and not record["quick"], RERUN
    assert record["passed"] and record["n_failed"] == 0, (
        f"the committed GPU check has {record['n_failed']} failures: fix them, then {RERUN}")


def test_kernel_sources_are_the_ones_the_gpu_check_ran(record):
    ran, now = record["kernel_sources"], kernel_sources()
    changed = sorted(p for p in ran.keys() & now.keys() if ran[p] != now[p])
    added, removed = sorted(now.keys() - ran.keys()), sorted(ran.keys() - now.keys())
    assert not (changed or added or removed), (
        f"kernel sources differ from those the committed GPU check ({RECORD.name}) ran: "
        f"changed {changed}, new {added}, gone {removed}; {RERUN}")


def test_the_gpu_check_ran_every_case_registered_now(record):
    """The cases a CUDA bf16 check would run today (listed, not run: a case's tensors are
    made when it runs) are the ones the record holds, so a family or case added under
    ``mla/check/`` is not counted as checked on the GPU before it has been."""
    ctx = Ctx(device=torch.device("cuda"), dtype=torch.bfloat16, quick=False)
    now = sorted((kernel, case.name) for kernel, (_, cases) in REGISTRY.items()
                 for case in cases(ctx))
    ran = sorted((r["kernel"], r["case"]) for r in record["results"])
    assert ran == now, (
        f"the committed GPU check ran {len(ran)} cases, {len(now)} are registered now; "
        f"not run: {sorted(set(now) - set(ran))[:5]}, no longer registered: "
        f"{sorted(set(ran) - set(now))[:5]}; {RERUN}")
