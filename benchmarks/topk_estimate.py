"""``python -m benchmarks.topk_estimate --out DIR``: the top-k's estimate alone, by bisection
(``mla.fast.topk_kernels._threshold``, the default) against radix levels of 5, 6 or 8 bits
(``tl.histogram`` a level: ``_level``, the scan's), one program a row, at 4 and 8 warps.

Both take the same sample (1024 runs of 8 keys) and aim at the same rank; what differs is how
the sample's rank is found: about 20 block-wide counts of every sampled key (bisection), or
three to four levels each a window, a histogram and a scan of its bins. Times are CUDA-graph
replays with the L2 flushed by a read; ``survivors`` are the row's keys reaching the threshold
(random rows of 128K keys, ``k = 2048``), which both must keep between ``k`` and the list.
Writes ``topk_estimate.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from benchmarks.common import log, time_graph
from benchmarks.topk_stream import _keys
from mla.environment import environment
from mla.fast.topk import CANDIDATES, TopkPlan
from mla.fast.topk_kernels import _sample, _threshold
from mla.fast.topk_search import _level


@triton.jit
def _threshold_levels(src, n, topk, OVERSAMPLE: tl.constexpr, CAP: tl.constexpr,
                      SAMPLE_RUNS: tl.constexpr, RUN: tl.constexpr, BITS: tl.constexpr):
    """``_threshold``'s sample and rank, the rank found by radix levels of ``BITS``."""
    u, rank = _sample(src, n, topk, OVERSAMPLE, CAP, SAMPLE_RUNS, RUN)
    c = u.to(tl.int64)
    slack = rank // 16 + 2
    need = rank
    found = tl.zeros((), tl.int64)
    mask = tl.zeros((), tl.int64)
    done = tl.zeros((), tl.int32)
    while done == 0:  # a bucket within the slack, or of one value, ends it
        found, mask, need, inside, shift = _level(c, (c & mask) == found, need, BITS)
        done = ((inside - need <= slack) | (shift == 0)).to(tl.int32)
    return (found.to(tl.uint32) ^ 0x80000000).to(tl.int32, bitcast=True)


@triton.jit
def _estimate_probe(logits, thresh, W, topk, OVERSAMPLE: tl.constexpr, CAP: tl.constexpr,
                    LEVEL_BITS: tl.constexpr, SAMPLE_RUNS: tl.constexpr, RUN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = logits + row * W
    n = W + 0 * row
    if LEVEL_BITS == 0:
        t = _threshold(src, n, topk, OVERSAMPLE, CAP, SAMPLE_RUNS, RUN)
    else:
        t = _threshold_levels(src, n, topk, OVERSAMPLE, CAP, SAMPLE_RUNS, RUN, LEVEL_BITS)
    tl.store(thresh + row, t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.topk_estimate",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[128, 512, 1024])
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    plan, W, topk = TopkPlan(), 131072, 2048
    res = {"environment": environment(), "rows": []}
    for R in args.rows:
        x = torch.randn(R, W, device="cuda")
        k = _keys(x)
        for bits, warps in [(0, 8), (8, 8), (6, 8), (5, 8), (8, 4), (0, 4)]:
            t = torch.empty(R, dtype=torch.int32, device="cuda")

            def run(_x=x, _t=t, _R=R, _bits=bits, _warps=warps) -> None:
                _estimate_probe[(_R,)](_x, _t, W, topk, OVERSAMPLE=float(plan.oversample),
                                      CAP=CANDIDATES, LEVEL_BITS=_bits,
                                      SAMPLE_RUNS=plan.sample_runs, RUN=plan.sample_run,
                                      num_warps=_warps)

            run()
            torch.cuda.synchronize()
            surv = (k >= t[:, None]).sum(1).float()
            row = {"R": R, "W": W, "mode": "bisection" if bits == 0 else f"levels of {bits}",
                   "warps": warps, "us": time_graph(run, reps=20, read_flush=True) * 1e3,
                   "survivors_min": float(surv.min()), "survivors_mean": float(surv.mean()),
                   "survivors_max": float(surv.max())}
            res["rows"].append(row)
            log(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in row.items()))
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "topk_estimate.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
