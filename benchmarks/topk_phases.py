"""``python -m benchmarks.topk_phases``: where one program's time goes in the top-k's estimate
and select, read off the GPU's global timer.

``mla.fast.topk``'s estimate and select are chains of block-wide steps, so their time is
latency, which a CUDA-graph time cannot split. A probe kernel runs the select kernel's pieces
(``mla.fast.topk_kernels``, the same ``@triton.jit`` functions) on a bitmask made on the host
(keys at or above each row's ~3300th largest, as the estimate aims) and stamps ``globaltimer``
between them: the candidate list's columns (``_list_from_mask``), its keys gathered into
registers, the search for the boundary (``_boundary``; named "bisection" in the results of
2026-12-02 and before), the columns written; then the estimate (``_threshold``: the
sample's load, its bisection). Prints the mean of each phase over the rows (one program
each), warm and after an L2 flush (the kernel's code and data cold), at 8 and 16 warps.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from mla.fast.topk import CANDIDATES, WORD_TILE, TopkPlan
from mla.fast.topk_kernels import _list_from_mask, _order_keys, _threshold
from mla.fast.topk_search import _boundary, _inverted, _unsigned

PHASES = ["list", "gather", "search", "write", "estimate"]


@triton.jit
def _phases_kernel(logits, words, lists, out, stamps, W, topk, CAP: tl.constexpr,
                   WORD_TILE: tl.constexpr, RUN: tl.constexpr, SAMPLE_RUNS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = logits + row * W
    cols_out = lists + row * CAP
    dst = out + row * topk
    at = stamps + row * 16
    t0 = globaltimer()
    total = _list_from_mask(words + row * (W // 32), row * 0, 0, W // 32, cols_out, CAP,
                            WORD_TILE)
    tl.debug_barrier()
    t1 = globaltimer()
    i = tl.arange(0, CAP // 2)
    live = i < total
    cols = tl.load(cols_out + i, mask=live, other=0)
    u = tl.where(live, _unsigned(_order_keys(tl.load(src + cols, mask=live, other=0.0))), 0)
    s = tl.sum(u, axis=0)  # the load complete
    t2 = globaltimer()
    p, last = _boundary(u, cols, topk)
    t3 = globaltimer()
    take = (u > p) | ((u == p) & (_inverted(cols) >= last))
    tl.store(dst + tl.cumsum(take.to(tl.int32), axis=0) - 1, cols, mask=take)
    tl.debug_barrier()
    t4 = globaltimer()
    thresh = _threshold(src, W, topk, 1.5, CAP, SAMPLE_RUNS, RUN)
    t5 = globaltimer()
    tl.store(at + 0, t1 - t0)
    tl.store(at + 1, t2 - t1)
    tl.store(at + 2, t3 - t2)
    tl.store(at + 3, t4 - t3)
    tl.store(at + 4, t5 - t4)
    tl.store(at + 7, total.to(tl.int64))
    tl.store(at + 8, (s + p + last).to(tl.int64) + thresh)


def phases(rows: int, W: int = 131072, topk: int = 2048) -> dict:
    """The phases of ``rows`` programs (one a row) on random rows of ``W`` keys."""
    plan = TopkPlan()
    x = torch.randn(rows, W, device="cuda")
    t = x.kthvalue(W - 3300 + 1, dim=1).values
    keep = (x >= t[:, None]).view(rows, W // 32, 32).long()
    packed = (keep << torch.arange(32, device="cuda")).sum(-1)
    words = torch.where(packed >= 2**31, packed - 2**32, packed).int()
    lists = torch.empty(rows, CANDIDATES, dtype=torch.int32, device="cuda")
    out = torch.empty(rows, topk, dtype=torch.int32, device="cuda")
    stamps = torch.zeros(rows, 16, dtype=torch.int64, device="cuda")
    flush = torch.ones(256 << 20, dtype=torch.int8, device="cuda")
    found = {}
    for warps in (8, 16):
        def run(_warps: int = warps) -> list[float]:
            _phases_kernel[(rows,)](x, words, lists, out, stamps, W, topk, CAP=CANDIDATES,
                                    WORD_TILE=WORD_TILE, RUN=plan.sample_run,
                                    SAMPLE_RUNS=plan.sample_runs, num_warps=_warps)
            torch.cuda.synchronize()
            return (stamps[:, :len(PHASES)].double().mean(0) / 1e3).tolist()
        for _rep in range(3):  # the first compiles
            warm = run()
        flush.sum(dtype=torch.int64)  # the L2 emptied: the kernel's code and data come cold
        torch.cuda.synchronize()
        cold = run()
        for name, us in ((f"{warps} warps", warm), (f"{warps} warps, cold", cold)):
            found[name] = dict(zip(PHASES, us))
            print(f"{rows} rows, {name}, us: " + "; ".join(
                f"{n} {v:.1f}" for n, v in zip(PHASES, us)), flush=True)
    n = int(stamps[0, 7])
    same = torch.equal(lists[0, :n].long(),
                       (x[0] >= t[0]).nonzero().flatten())
    exact = torch.equal(out[0, :topk].sort().values.long(), x[0].topk(topk).indices.sort().values)
    print(f"the list holds the marked columns in order: {same}; the set is exact: {exact}",
          flush=True)
    found.update(list=n, list_ok=same, set_ok=exact)
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.topk_phases",
                                description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 128])
    p.add_argument("--json", default=None, help="write the phases here too")
    args = p.parse_args(argv)
    found = {f"{r} rows": phases(r) for r in args.rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
