"""Each error budget sits at about twice the worst error measured for it (conventions §11).

The measurements are the committed ``benchmarks/results/error_budget_*.json``, written by
``python -m mla.check --seeds N --out ...``: on an H200 in bfloat16 (its float16/float32 cases
too), and on the CPU under ``TRITON_INTERPRET=1`` in float16 and float32. For every entry of
``mla.compare.ERROR_BUDGETS`` the worst error over all of them must be measured, finite, and
between 1/3 and 2/3 of the budget: a budget far above its measurement lets a bug through; one
too close fails on the next seed. Missing measurements fail (they are never skipped).

The indexer's fp8 logits have their own measure and budget (``mla.compare.logits_err``,
``fp8_mma_logits_budget``), measured by ``python -m benchmarks.indexer --only errors prefill``
on an H200 (its JSON committed as ``benchmarks/results/indexer_errors_<date>.json``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from mla.compare import ERROR_BUDGETS, fp8_mma_logits_budget

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
LOW, HIGH = 1.5, 3.0
MIN_SEEDS = 10
COMMANDS = {
    ("cuda", "bfloat16"): "on a GPU, in parts that fit a time limit: PYTHONPATH=. python -m "
                          "mla.check --seed 0 --seeds 5 --out benchmarks/results/checks/"
                          "error_budget_gpu_bfloat16_s0.json, then --seed 5 ... _s5.json",
    ("cpu", "float16"): "TRITON_INTERPRET=1 python -m mla.check --device cpu --dtype float16 "
                        "--seeds 30 --out benchmarks/results/checks/error_budget_cpu_float16.json",
    ("cpu", "float32"): "TRITON_INTERPRET=1 python -m mla.check --device cpu --dtype float32 "
                        "--seeds 30 --out benchmarks/results/checks/error_budget_cpu_float32.json",
}


def _measurements() -> tuple[dict[str, float], dict[tuple[str, str], set[int]]]:
    worst: dict[str, float] = {}
    seeds: dict[tuple[str, str], set[int]] = {}
    for path in sorted((RESULTS / "checks").glob("error_budget_*.json")):
        rec = json.loads(path.read_text())
        key = (rec["device"].split(":")[0], rec["dtype"])
        seeds.setdefault(key, set()).update(rec["seeds"])
        for k, v in rec["worst"].items():
            worst[k] = max(worst.get(k, 0.0), v["error"])
    return worst, seeds


def test_every_run_is_measured_over_enough_seeds():
    _, seeds = _measurements()
    for run, command in COMMANDS.items():
        n = len(seeds.get(run, ()))
        assert n >= MIN_SEEDS, f"{run}: {n} seeds measured, want {MIN_SEEDS}: run {command}"


def test_each_budget_is_about_twice_the_worst_measured_error():
    worst, _ = _measurements()
    off = []
    for (kernel, dtype, q), b in sorted(ERROR_BUDGETS.items()):
        w = worst.get(f"{kernel}|{dtype}|{q}")
        if w is None or not math.isfinite(w) or w <= 0.0:
            off.append(f"{kernel} {dtype} {q}: measured {w}")
        elif not LOW * w <= b <= HIGH * w:
            off.append(f"{kernel} {dtype} {q}: budget {b:.2g} is {b / w:.2f}x the worst "
                       f"measured {w:.3g} (want {LOW}x to {HIGH}x; 2x = {2 * w:.2g})")
    assert not off, "\n".join(off)


def test_every_measured_float_quantity_has_a_budget():
    worst, _ = _measurements()
    kernels = {k for k, _, _ in ERROR_BUDGETS}
    missing = [k for k in worst if k.split("|")[0] in kernels
               and tuple(k.split("|")) not in ERROR_BUDGETS]
    assert not missing, missing


def test_the_fp8_logits_budget_is_about_twice_the_worst_measured_error():
    """DeepSeek-V3.2's 64 heads: the H200's worst ``logits_err`` over the benchmark's seeds and
    shapes, and that of the emulated FP8 MMA on the same inputs, each between 1/3 and 2/3 of
    the budget."""
    runs = sorted((RESULTS / "indexer").glob("indexer_errors_*.json"))
    assert runs, ("no indexer logits measurement: run PYTHONPATH=. python -m benchmarks.indexer "
                  "--only errors prefill --out DIR on a GPU, commit DIR/indexer_<date>.json as "
                  "benchmarks/results/indexer_errors_<date>.json")
    rec = json.loads(runs[-1].read_text())
    e = rec["errors"]
    assert e["measure"] == "logits_err" and e["seeds"] >= MIN_SEEDS
    shapes = [r for r in rec["prefill"] + rec["decode"] if math.isfinite(r["err"])]
    measured = max([e["paged_worst"], e["ragged_worst"]] + [r["err"] for r in shapes])
    model = max([e["model_worst"]] + [r["model_err"] for r in shapes])
    b = fp8_mma_logits_budget(64)
    for what, w in (("measured", measured), ("emulated", model)):
        assert LOW * w <= b <= HIGH * w, f"budget {b:.2g} is {b / w:.2f}x the worst {what} {w:.3g}"
