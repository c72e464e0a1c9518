"""``python -m benchmarks.topk_routes --out DIR``: ``top_k_per_row``'s routes (the default
``"auto"``, one, two and three launches) side by side on the GPU, each timed as CUDA-graph
replays and checked on a replay.

Per shape and route: ``launches()`` captured in a graph, replayed 25 times with the L2 flushed
by a read before each (the first five dropped), the median of three such runs; then ``out`` is
filled with -7, the graph replayed once more and its set compared with ``torch.topk``'s
(``same_set_after_replay``: a launch that selects only on its first run fails it). Random
float32 rows, k = 2048, the copy bandwidth measured in the same run. Writes
``topk_routes.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from benchmarks.common import ceilings, log
from benchmarks.topk_sweep import TOPK, _full, _pct, replayed
from mla.environment import environment
from mla.fast.topk import CANDIDATES, TopkPlan, survivors

PLANS = {"auto": TopkPlan(), "one": TopkPlan(route="one"), "two": TopkPlan(route="two"),
         "three": TopkPlan(route="three")}
SHAPES = [(1, 131072), (32, 131072), (128, 131072), (256, 131072), (512, 131072),
          (1024, 131072), (128, 32768), (256, 32768), (2048, 32768), (128, 8192), (256, 8192)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.topk_routes",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    ceil = ceilings()
    copy = ceil["copy_TBps"]
    log(f"copy {copy:.2f} TB/s")
    rows = []
    for R, W in SHAPES:
        torch.manual_seed(R + W)
        x = torch.randn(R, W, device="cuda")
        st, en = _full(R, W)
        want = torch.topk(x, TOPK, dim=1).indices.sort(dim=1).values
        for name, plan in PLANS.items():
            runs = [replayed(x, st, en, plan, reps=20) for _ in range(3)]
            ms = statistics.median(r[0] for r in runs)
            out, work = runs[-1][2], runs[-1][3]
            # (rows no longer than the list are selected whole: no survivors)
            surv = survivors(work).float() if W > CANDIDATES else torch.full((1,), float("nan"))
            row = {"R": R, "L": W, "plan": name, "us": ms * 1e3,
                   "pct_copy": _pct(R, W, ms, copy),
                   "same_set_after_replay": bool(torch.equal(out.sort(dim=1).values, want)),
                   "survivors_mean": float(surv.mean()), "survivors_max": float(surv.max())}
            rows.append(row)
            log(json.dumps(row))
        del x
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "topk_routes.json"), "w") as f:
        json.dump({"environment": environment(), "ceilings": ceil, "rows": rows}, f, indent=1)
    return 0 if all(r["same_set_after_replay"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
