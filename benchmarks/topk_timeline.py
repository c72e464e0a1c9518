"""``python -m benchmarks.topk_timeline --out DIR``: the one-launch top-k kernel's programs on a
time line, read off the GPU's global timer.

A probe kernel runs ``mla.fast.topk_fused._fused_kernel``'s steps (the same ``@triton.jit``
pieces of ``mla.fast.topk_kernels``, launched as ``mla.fast.topk`` launches them: parts,
chunk, registers) and stamps ``globaltimer`` at each program's start and after each step: the
threshold, the marks, the part's share of the list, the arrival, the select. Per program it
also records its SM and whether it selected. From the stamps (relative to the first start):
when programs start (a second wave shows as late starts), each step's mean, and the path of
the row that ends last, the one the call waits for. Random rows of 128K keys, k = 2048, the L2
flushed by a read before each run. Writes ``topk_timeline.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from benchmarks.common import log
from mla.environment import environment
from mla.fast import topk as fast_topk
from mla.fast.common import next_pow2
from mla.fast.topk import CANDIDATES, SMALL, WORD_TILE, TopkPlan
from mla.fast.topk_kernels import (
    _chunk_range,
    _list_part,
    _mask_chunk,
    _row_range,
    _select_row,
    _threshold,
    _work_row,
    work_columns,
)

STEPS = ["threshold", "marks", "share", "arrival", "select"]


@triton.jit
def _smid():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _timeline_kernel(logits, starts, ends, work, words, sync, out, stamps, W, topk, s_l_r,
                     s_o_r, s_w_r, chunk, OVERSAMPLE: tl.constexpr,
                     SAMPLE_RUNS: tl.constexpr, RUN: tl.constexpr, CAP: tl.constexpr,
                     SMALL: tl.constexpr, TILE: tl.constexpr, BITS: tl.constexpr,
                     BLOCK: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr,
                     PART_LISTS: tl.constexpr, OUT_BLOCK: tl.constexpr,
                     WORD_TILE: tl.constexpr):
    """``_fused_kernel`` with stamps (rows longer than ``CAP`` only)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    at = stamps + (row * tl.num_programs(1) + part) * 8
    t0 = globaltimer()
    start, end, n = _row_range(starts, ends, row, W)
    src = logits + row * s_l_r
    bits = words + row * s_w_r
    _first, lo, hi = _chunk_range(start, end, part, chunk, BLOCK)
    t = _threshold(src + start, n, topk, OVERSAMPLE, CAP, SAMPLE_RUNS, RUN)
    tl.debug_barrier()
    t1 = globaltimer()
    marked = _mask_chunk(src, bits, start, end, part, chunk, t, W, BLOCK, STAGES)
    tl.debug_barrier()
    t2 = globaltimer()
    if PART_LISTS:
        list_keys, list_cols, _few, _thresh, _count = _work_row(work, row, CAP, SMALL)
        _list_part(src + start, bits, start, lo, hi, marked, list_keys, list_cols,
                   sync + 2 * row + 1, CAP, TILE, 2 * TILE)
        tl.debug_barrier()
    t3 = globaltimer()
    selects = part == 0
    if SPLIT:
        arrived = tl.atomic_add(sync + 2 * row, 1, sem="acq_rel")
        selects = arrived == tl.num_programs(1) - 1
        tl.debug_barrier()
    t4 = globaltimer()
    if selects:
        _select_row(src, start, end, n, topk, bits, work, row, out + row * s_o_r,
                    sync + 2 * row + 1, CAP, SMALL, TILE, BITS, OUT_BLOCK, WORD_TILE,
                    PART_LISTS)
        tl.debug_barrier()
        if SPLIT:
            tl.store(sync + 2 * row + tl.arange(0, 2), tl.zeros((2,), tl.int32))
    t5 = globaltimer()
    tl.store(at + 0, t0)
    tl.store(at + 1, t1)
    tl.store(at + 2, t2)
    tl.store(at + 3, t3)
    tl.store(at + 4, t4)
    tl.store(at + 5, t5)
    tl.store(at + 6, _smid().to(tl.int64))
    tl.store(at + 7, selects.to(tl.int64))


def timeline(R: int, W: int, plan: TopkPlan, parts: int | None = None,
             maxnreg: int | None = None, topk: int = 2048) -> dict:
    """One run's stamps summarized (``parts``, ``maxnreg``: as ``mla.fast.topk`` picks them
    unless given)."""
    dev = torch.device("cuda")
    x = torch.randn(R, W, device=dev)
    st = torch.zeros(R, dtype=torch.int32, device=dev)
    en = torch.full((R,), W, dtype=torch.int32, device=dev)
    block = plan.fused_block
    if parts is None:
        parts, chunk = fast_topk.fused_parts(plan, R, W, dev)
    else:
        chunk = block * triton.cdiv(triton.cdiv(W, parts), block)
        parts = triton.cdiv(W, chunk)
    if maxnreg is None:
        capped, _tile = fast_topk._capped(plan, R * parts, dev)
        maxnreg = capped.get("maxnreg", fast_topk.uncapped(plan.fused_warps)["maxnreg"])
    s_w_r = triton.cdiv(W, block) * block // 32
    words = torch.empty(R, s_w_r, dtype=torch.int32, device=dev)
    sync = torch.zeros(R, 2, dtype=torch.int32, device=dev)
    work = torch.empty(R, work_columns(CANDIDATES, SMALL), dtype=torch.int32, device=dev)
    out = torch.empty(R, topk, dtype=torch.int32, device=dev)
    stamps = torch.zeros(R, parts, 8, dtype=torch.int64, device=dev)
    flush = torch.ones(256 << 20, dtype=torch.int8, device=dev)
    split = parts > 1
    lists = split and plan.fused_part_lists

    def run() -> None:
        _timeline_kernel[(R, parts)](
            x, st, en, work, words, sync, out, stamps, W, topk, W, topk, s_w_r, chunk,
            OVERSAMPLE=float(plan.oversample), SAMPLE_RUNS=plan.sample_runs,
            RUN=plan.sample_run, CAP=CANDIDATES, SMALL=SMALL, TILE=min(plan.select_tile, 1024),
            BITS=plan.select_bits, BLOCK=block, STAGES=plan.fused_stages, SPLIT=split,
            PART_LISTS=lists, OUT_BLOCK=min(1024, next_pow2(topk)), WORD_TILE=WORD_TILE,
            num_warps=plan.fused_warps, maxnreg=maxnreg)

    for _ in range(2):  # the first compiles
        flush.sum(dtype=torch.int64)
        torch.cuda.synchronize()
        run()
        torch.cuda.synchronize()
    same = torch.equal(out.sort(dim=1).values, x.topk(topk, dim=1).indices.int().sort(dim=1).values)
    s = stamps.double()
    t0 = s[..., 0].min()
    rel = (s[..., :6] - t0) / 1e3  # us from the first start
    steps = rel[..., 1:] - rel[..., :5]
    sel = s[..., 7] > 0
    row_end = rel[..., 5].max(dim=1).values
    last = int(row_end.argmax())
    lp = int(sel[last].nonzero()[0, 0]) if bool(sel[last].any()) else 0
    starts_us = rel[..., 0].flatten()
    return {
        "R": R, "W": W, "parts": parts, "maxnreg": maxnreg, "part_lists": lists,
        "same_set": same, "end_us": float(rel[..., 5].max()),
        "start_us": {"median": float(starts_us.median()), "max": float(starts_us.max()),
                     "late_programs": int((starts_us > 2.0).sum())},
        "programs_per_sm_max": int(torch.bincount(s[..., 6].long().flatten()).max()),
        "step_mean_us": {k: float(steps[..., i].mean()) for i, k in enumerate(STEPS[:4])}
        | {"select": float(steps[..., 4][sel].mean())},
        "last_row": {"row": last, "selecting_part": lp,
                     "stamps_us": [float(v) for v in rel[last, lp]]},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.topk_timeline",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    W, base = 131072, TopkPlan()
    found = []
    for R, plan, parts, maxnreg in [
            (128, base, None, None), (128, base, 1, None),
            (128, TopkPlan(fused_part_lists=False), None, None), (128, base, 2, 255),
            (256, base, None, None), (256, base, 1, None), (256, base, 1, 128),
            (32, base, None, None), (1, base, None, None)]:
        got = timeline(R, W, plan, parts, maxnreg)
        found.append(got)
        log(json.dumps(got))
    with open(os.path.join(args.out, "topk_timeline.json"), "w") as f:
        json.dump({"environment": environment(), "runs": found}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
