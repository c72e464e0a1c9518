"""``python -m benchmarks.topk_routes --out DIR``: ``top_k_per_row``'s routes (the default
``"auto"``, one, two and three launches) side by side on the GPU, each timed as CUDA-graph
replays and checked on a replay.

Per shape and route: ``launches()`` captured in a graph, replayed 25 times with the L2 flushed
by a read before each (the first five dropped), the median of three such runs; then ``out`` is
filled with -7, the graph replayed once more and its set compared with ``torch.topk``'s
(``same_set_after_replay``: a launch that selects only on its first run fails it). Random
float32 rows, k = 2048, the copy bandwidth measured in the same run. Writes
``topk_routes.json``.

``--plan NAME=FIELD=VALUE,...`` (repeatable) adds a named ``TopkPlan`` to the four routes, e.g.
``--plan w16=route=one,fused_warps=16,fused_min_parts=1``; ``--shapes 128x131072 ...`` times
those shapes only.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def _plan(spec: str) -> tuple[str, TopkPlan]:
    """``NAME=FIELD=VALUE,...`` -> (NAME, the plan), each value typed as the field's default."""
    name, _, fields = spec.partition("=")
    defaults = TopkPlan()
    changes = {}
    for item in filter(None, fields.split(",")):
        field, _, value = item.partition("=")
        if not hasattr(defaults, field):
            raise SystemExit(f"--plan {spec!r}: TopkPlan has no field {field!r}")
        kind = type(getattr(defaults, field))
        changes[field] = value.lower() in ("1", "true") if kind is bool else kind(value)
    return name, dataclasses.replace(defaults, **changes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.topk_routes",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--plan", action="append", default=[], help="NAME=FIELD=VALUE,...")
    p.add_argument("--shapes", nargs="*", help="ROWSxKEYS ... (default: all)")
    args = p.parse_args(argv)
    plans = dict(PLANS, **dict(_plan(spec) for spec in args.plan))
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes \
        else SHAPES
    os.makedirs(args.out, exist_ok=True)
    ceil = ceilings()
    copy = ceil["copy_TBps"]
    log(f"copy {copy:.2f} TB/s")
    rows = []
    for R, W in shapes:
        torch.manual_seed(R + W)
        x = torch.randn(R, W, device="cuda")
        st, en = _full(R, W)
        want = torch.topk(x, TOPK, dim=1).indices.sort(dim=1).values
        for name, plan in plans.items():
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
