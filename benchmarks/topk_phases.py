"""``python -m benchmarks.topk_phases``: where one program's time goes in the top-k's select,
read off the GPU's global timer.

``mla.fast.topk``'s select is a chain of block-wide steps, so its time is latency, which a
CUDA-graph time cannot split. A probe kernel runs the select's pieces (``mla.fast.topk_kernels``,
the same ``@triton.jit`` functions) on one row held in registers and stamps ``globaltimer``
between them: the keys' load, the first radix level, the whole ``_kth_tiles``, then the write of
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
from mla.fast.topk_kernels import (
    _item_keys,
    _kth_tiles,
    _level_tiles,
    _list_from_mask,
    _mask_prefix,
    _select_held,
    _threshold,
)

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
    k, _live = _item_keys(src, scratch, scratch, scratch, i, CAP, 0, 0, 0, 0)
    s = tl.sum(k, axis=0)  # the load complete
    t1 = globaltimer()
    found, _m, _n, inside, _s = _level_tiles(src, lst, lst, lst, CAP, 0, 0, 0, 0, 0, 0, topk,
                                             BITS, TILE)
    t2 = globaltimer()
    kth, left, inside2 = _kth_tiles(src, lst, lst, CAP, topk, 0, 0, 0, few, BITS, SMALL, TILE)
    t3 = globaltimer()
    _select_held(src, lst, lst, CAP, topk, few, dst, 0, TILE, BITS, SMALL)
    t4 = globaltimer()
    t = _threshold(src, W, topk, few, 1.5, CAP, 512, 8, 5, SMALL)
    t5 = globaltimer()
    count = _stream_list(src, 0, 0, W, t, W, lst, lst + CAP, CAP, BLOCK, 3)
    tl.debug_barrier()
    t6 = globaltimer()
    _select_held(src, lst, lst + CAP, count, topk, few, dst, 1, TILE, BITS, SMALL)
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


MASK_PHASES = ["prefix", "list", "load list", "kth key", "select list"]


@triton.jit
def _mask_phases_kernel(logits, words, lists, scratch, out, stamps, W, topk,
                        CAP: tl.constexpr, SMALL: tl.constexpr, TILE: tl.constexpr,
                        BITS: tl.constexpr, WORD_TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    nw = W // 32
    src = logits + row * W
    bits = words + row * (2 * nw)
    incl = bits + nw
    keys_out = lists + row * (4 * CAP)
    cols_out = keys_out + CAP
    few = (scratch + row * (4 * CAP)).to(tl.pointer_type(tl.int64))
    dst = out + row * topk
    at = stamps + row * 16
    t0 = globaltimer()
    total = _mask_prefix(bits, incl, 0, nw, WORD_TILE)
    tl.debug_barrier()
    t1 = globaltimer()
    _list_from_mask(src, row * 0, bits, incl, 0, nw, total, keys_out, cols_out, WORD_TILE,
                    CAP)
    tl.debug_barrier()
    t2 = globaltimer()
    i = tl.arange(0, CAP)
    k, _live = _item_keys(src, keys_out, cols_out, keys_out, i, total, 0, 1, 0, 0)
    s = tl.sum(k, axis=0)
    t3 = globaltimer()
    kth, left, inside = _kth_tiles(src, keys_out, cols_out, total, topk, 0, 1, 0, few, BITS,
                                   SMALL, TILE)
    t4 = globaltimer()
    _select_held(src, keys_out, cols_out, total, topk, few, dst, 1, TILE, BITS, SMALL)
    t5 = globaltimer()
    tl.store(at + 0, t1 - t0)
    tl.store(at + 1, t2 - t1)
    tl.store(at + 2, t3 - t2)
    tl.store(at + 3, t4 - t3)
    tl.store(at + 4, t5 - t4)
    tl.store(at + 7, total.to(tl.int64))
    tl.store(at + 8, (s + kth + left + inside).to(tl.int64))


def mask_phases(rows: int, W: int = 131072, topk: int = 2048) -> dict:
    """The select's pieces on a bitmask made on the host (keys at or above each row's
    ~4000th largest)."""
    plan = TopkPlan()
    x = torch.randn(rows, W, device="cuda")
    t = x.kthvalue(W - 4000 + 1, dim=1).values
    keep = (x >= t[:, None]).view(rows, W // 32, 32).long()
    packed = (keep << torch.arange(32, device="cuda")).sum(-1)
    words = torch.zeros(rows, 2 * (W // 32), dtype=torch.int32, device="cuda")
    words[:, :W // 32] = torch.where(packed >= 2**31, packed - 2**32, packed).int()
    lists = torch.empty(rows, 4 * CANDIDATES, dtype=torch.int32, device="cuda")
    scratch = torch.empty(rows, 4 * CANDIDATES, dtype=torch.int32, device="cuda")
    out = torch.empty(rows, topk, dtype=torch.int32, device="cuda")
    stamps = torch.zeros(rows, 16, dtype=torch.int64, device="cuda")
    flush = torch.ones(256 << 20, dtype=torch.int8, device="cuda")
    found = {}
    for warps in (8, 16):
        for _rep in range(3):
            _mask_phases_kernel[(rows,)](x, words, lists, scratch, out, stamps, W, topk,
                                         CAP=CANDIDATES, SMALL=SMALL, TILE=plan.select_tile,
                                         BITS=plan.select_bits, WORD_TILE=4096,
                                         num_warps=warps)
            torch.cuda.synchronize()
        us = (stamps[:, :len(MASK_PHASES)].double().mean(0) / 1e3).tolist()
        flush.sum(dtype=torch.int64)  # the L2 emptied: the kernel's code and data come cold
        torch.cuda.synchronize()
        _mask_phases_kernel[(rows,)](x, words, lists, scratch, out, stamps, W, topk,
                                     CAP=CANDIDATES, SMALL=SMALL, TILE=plan.select_tile,
                                     BITS=plan.select_bits, WORD_TILE=4096, num_warps=warps)
        torch.cuda.synchronize()
        cold = (stamps[:, :len(MASK_PHASES)].double().mean(0) / 1e3).tolist()
        print(f"mask path, {warps} warps, after an L2 flush, us: " + "; ".join(
            f"{n} {v:.1f}" for n, v in zip(MASK_PHASES, cold)), flush=True)
        found[f"{warps} warps, cold"] = dict(zip(MASK_PHASES, cold))
        name = f"{warps} warps"
        found[name] = dict(zip(MASK_PHASES, us), total=stamps[:, 7].double().mean().item())
        print(f"mask path, {name}, us: " + "; ".join(f"{n} {v:.1f}"
                                                     for n, v in zip(MASK_PHASES, us)),
              flush=True)
    n = int(stamps[0, 7])
    same = torch.equal(lists[0, CANDIDATES:CANDIDATES + n].long(),
                       (x[0] >= t[0]).nonzero().flatten())
    print(f"the list holds the marked columns in order: {same}", flush=True)
    found["list_ok"] = same
    return found


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
    found["mask"] = mask_phases(args.rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
