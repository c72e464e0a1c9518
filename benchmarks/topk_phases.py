"""``python -m benchmarks.topk_phases``: where one program's time goes in the top-k's select,
read off the GPU's global timer.

``mla.fast.topk``'s select is a chain of block-wide steps, so its time is latency, which a
CUDA-graph time cannot split. A probe kernel runs the select's pieces (``mla.fast.topk_kernels``,
the same ``@triton.jit`` functions) on one row held in registers and stamps ``globaltimer``
between them: the keys' load, the first radix level, the whole ``_kth_key``, then the write of
the set; the threshold from the sample; one program's ``_stream_list`` over a whole row; and the
select of the list it made (its length printed too).
Prints the mean of each phase over a few rows (one program each), at 8 and 16 warps.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from mla.fast.topk import CANDIDATES, SMALL, TopkPlan
from mla.fast.topk_fused import _stream_list
from mla.fast.topk_kernels import _held_keys, _kth_key, _level32, _select_held, _threshold

PHASES = ["load", "first level", "kth key", "select (all)", "threshold", "stream 128K",
          "select list"]


@triton.jit
def _phases_kernel(logits, scratch, out, stamps, W, topk, CAP: tl.constexpr,
                   SMALL: tl.constexpr, TILE: tl.constexpr, BITS: tl.constexpr,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = logits + row * W
    few = (scratch + row * (4 * CAP)).to(tl.pointer_type(tl.int64))
    lst = scratch + row * (4 * CAP) + 2 * CAP
    dst = out + row * topk
    at = stamps + row * 16
    i = tl.arange(0, CAP)
    t0 = globaltimer()
    k = _held_keys(src, src, i, CAP, False)
    s = tl.sum(k, axis=0)  # the load complete
    t1 = globaltimer()
    found, _m, _n, inside, _s = _level32(k, i < CAP, topk, BITS)
    t2 = globaltimer()
    kth, left, inside2 = _kth_key(k, i < CAP, topk, few, BITS, SMALL)
    t3 = globaltimer()
    _select_held(src, src, src, CAP, topk, few, dst, False, CAP, TILE, BITS, SMALL)
    t4 = globaltimer()
    t = _threshold(src, W, topk, few, 1.5, CAP, 512, 8, 5, SMALL)
    t5 = globaltimer()
    count = _stream_list(src, 0, 0, W, t, W, lst, lst + CAP, CAP, BLOCK, 3)
    tl.debug_barrier()
    t6 = globaltimer()
    _select_held(src, lst, lst + CAP, count, topk, few, dst, True, CAP, TILE, BITS, SMALL)
    t7 = globaltimer()
    tl.store(at + 0, t1 - t0)
    tl.store(at + 1, t2 - t1)
    tl.store(at + 2, t3 - t2)
    tl.store(at + 3, t4 - t3)
    tl.store(at + 4, t5 - t4)
    tl.store(at + 5, t6 - t5)
    tl.store(at + 6, t7 - t6)
    tl.store(at + 7, count.to(tl.int64))
    tl.store(at + 8, (s + found + inside + kth + left + inside2).to(tl.int64))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.topk_phases",
                                description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--json", default=None, help="write the phases here too")
    args = p.parse_args(argv)
    plan = TopkPlan()
    W, topk = 131072, 2048
    x = torch.randn(args.rows, W, device="cuda")
    scratch = torch.empty(args.rows, 4 * CANDIDATES, dtype=torch.int32, device="cuda")
    out = torch.empty(args.rows, topk, dtype=torch.int32, device="cuda")
    stamps = torch.zeros(args.rows, 16, dtype=torch.int64, device="cuda")
    found = {}
    for warps in (8, 16):
        for _rep in range(3):  # the first compiles and warms
            _phases_kernel[(args.rows,)](x, scratch, out, stamps, W, topk, CAP=CANDIDATES,
                                         SMALL=SMALL, TILE=plan.select_tile,
                                         BITS=plan.select_bits, BLOCK=plan.fused_block,
                                         num_warps=warps)
            torch.cuda.synchronize()
        us = (stamps[:, :len(PHASES)].double().mean(0) / 1e3).tolist()
        found[warps] = dict(zip(PHASES, us))
        found[warps]["list"] = stamps[:, 7].double().mean().item()
        print(f"{warps} warps, one program a row, us: " +
              "; ".join(f"{n} {v:.1f}" for n, v in zip(PHASES, us)) +
              f"; list of {found[warps]['list']:.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
