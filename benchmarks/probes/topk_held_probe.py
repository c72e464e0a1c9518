"""``python -m benchmarks.probes.topk_held_probe --out DIR``: where a held row's top-k time goes.

Rows of at most 8192 keys are selected by ``mla.fast.topk``'s held kernel: the row loaded into
registers, the boundary key found by ``_quad_search`` (a chain of block-wide counts), the
columns written by a block-wide scan. This probe times the pieces alone, each a kernel of the
same grid and warps, CUDA-graph replays with the L2 flushed by a read (``benchmarks.common``):

- ``empty``: one store a program (the launch and the replay's own cost);
- ``load``: the row loaded and made keys, one block-wide maximum;
- ``chain8``: the load, then 8 dependent block-wide counts (one step of a search, 8 times);
- ``chain8x4``: the same with four joint counts a step (8 probes a step, two 16-bit counts an
  int32, one exchange);
- ``chain8_pair``: 8 steps of four probes, as ``_quad_search`` counts them (two int32 of two
  16-bit counts in one joint ``tl.reduce``; as two ``tl.sum`` or one int64 ``tl.sum`` they
  were no faster: ``topk_held_probe_search_candidates_2026-12-07.json``);
- ``search``: the load and ``_bracket_search``;
- ``quad``: the load and ``_quad_search`` (four probes a step, the first from a normal guess);
- ``write``: the load and the scan that writes ``topk`` columns (no search);
- ``quad_then_write``: ``quad``, then the scan that writes the columns reaching its key (the
  select without its tie rule);
- ``select``: the held kernel's select (``_select_in_column_order``: ``quad``, then one scan
  of two 16-bit counts that also places a tied boundary's lowest columns), without the
  ``-1`` tail;
- ``select_tie_search``: ``quad``, then for a tied boundary a second search among the ties'
  inverted columns, then the write (the select before ``_select_in_column_order``);
- ``select_bracket``: ``_select_in_registers`` (``_bracket_search`` and its tie search);

beside the shipped route (``mla_fast``) and vLLM's kernels where they load, over 1-528 rows of
8K keys (``--width``: rows of 16K held the same way, which the shipped route does not hold)
and 4, 8 and 16 warps. Rows per SM tell latency (time flat in the rows) from issue
(time growing with the programs a SM holds)."""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.common import capture, ceilings, log, time_replays
from benchmarks.topk_peers import load_vllm, peer_calls
from mla.environment import environment
from mla.fast.topk import TopkPlan, launches
from mla.fast.topk.kernels import _order_keys, _select_in_column_order, _select_in_registers
from mla.fast.topk.search import _add2, _bracket_search, _inverted, _quad_search, _unsigned

TOPK = 2048
MODES = {"empty": 0, "load": 1, "chain8": 2, "chain8x4": 3, "search": 4, "write": 5,
         "select_bracket": 6, "quad": 7, "select_tie_search": 8, "select": 9,
         "quad_then_write": 10, "chain8_pair": 12}


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _probe_kernel(logits, out, W, s_l_r, s_o_r, topk, MODE: tl.constexpr, HOLD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = logits + row * s_l_r
    dst = out + row * s_o_r
    i = tl.arange(0, HOLD)
    if MODE == 0:
        tl.store(dst, row.to(tl.int32))
    else:
        live = i < W
        u = tl.where(live, _unsigned(_order_keys(tl.load(src + i, mask=live, other=0.0))), 0)
        if MODE == 1:
            tl.store(dst, tl.max(u, axis=0).to(tl.int32, bitcast=True))
        elif MODE == 2:
            p = tl.max(u, axis=0) >> 1
            for _ in tl.static_range(8):
                c = tl.sum((u >= p).to(tl.int32), axis=0)
                p = p + c.to(tl.uint32)
            tl.store(dst, p.to(tl.int32, bitcast=True))
        elif MODE == 3:
            p = tl.max(u, axis=0) >> 1
            for _ in tl.static_range(8):
                s0, s1, s2, s3 = tl.reduce(
                    ((u >= p).to(tl.int32) + ((u >= p + 1).to(tl.int32) << 16),
                     (u >= p + 2).to(tl.int32) + ((u >= p + 3).to(tl.int32) << 16),
                     (u >= p + 4).to(tl.int32) + ((u >= p + 5).to(tl.int32) << 16),
                     (u >= p + 6).to(tl.int32) + ((u >= p + 7).to(tl.int32) << 16)),
                    0, _add4)
                p = p + (s0 ^ s1 ^ s2 ^ s3).to(tl.uint32)
            tl.store(dst, p.to(tl.int32, bitcast=True))
        elif MODE == 12:  # four probes a step, two int32 of two 16-bit counts, one tl.reduce
            p = tl.max(u, axis=0) >> 1
            for _ in tl.static_range(8):
                s01, s23 = tl.reduce(
                    ((u >= p).to(tl.int32) + ((u >= p + 1).to(tl.int32) << 16),
                     (u >= p + 2).to(tl.int32) + ((u >= p + 3).to(tl.int32) << 16)), 0, _add2)
                p = p + (s01 ^ s23).to(tl.uint32)
            tl.store(dst, p.to(tl.int32, bitcast=True))
        elif MODE == 4:
            p, reach = _bracket_search(u, topk)
            tl.store(dst, p.to(tl.int32, bitcast=True))
            tl.store(dst + 1, reach)
        elif MODE == 5:
            take = i < topk
            tl.store(dst + tl.cumsum(take.to(tl.int32), axis=0) - 1, i, mask=take)
        elif MODE == 6:
            _select_in_registers(u, i, topk, dst, False)
        elif MODE == 7:
            p, reach = _quad_search(u, topk, True, 0)
            tl.store(dst, p.to(tl.int32, bitcast=True))
            tl.store(dst + 1, reach)
        elif MODE == 8:
            p, reach = _quad_search(u, topk, True, 0)
            last = tl.full((), 1, tl.uint32)
            if reach > topk:
                v = tl.where(u == p, _inverted(i), 0)
                last, _r = _quad_search(v, topk - tl.sum((u > p).to(tl.int32), axis=0),
                                         False, 0)
            take = (u > p) | ((u == p) & (_inverted(i) >= last))
            tl.store(dst + tl.cumsum(take.to(tl.int32), axis=0) - 1, i, mask=take)
        elif MODE == 9:
            _select_in_column_order(u, i, topk, dst, True)
        else:
            p, reach = _quad_search(u, topk, True, 0)
            take = u >= p
            tl.store(dst + tl.cumsum(take.to(tl.int32), axis=0) - 1, i, mask=take)


def _run_all(steps) -> None:
    for s in steps:
        s()


def _time(fn, reps: int) -> float | str:
    try:
        g = capture(fn)
        torch.cuda.synchronize()
        return time_replays(g, reps=reps, read_flush=True) * 1e3
    except Exception as e:  # noqa: BLE001 - a failure is a result
        return f"{type(e).__name__}: {str(e)[:200]}"


def run(rows: list[int], warps: list[int], W: int, reps: int, vllm: dict) -> list[dict]:
    res = []
    for R in rows:
        torch.manual_seed(R)
        x = torch.randn(R, W, device="cuda")
        out = torch.empty(R, TOPK, dtype=torch.int32, device="cuda")
        row = {"R": R, "W": W}
        for nw in warps:
            for name, mode in MODES.items():
                fn = functools.partial(_probe_kernel[(R,)], x, out, W, x.stride(0),
                                       out.stride(0), TOPK, MODE=mode,
                                       HOLD=triton.next_power_of_2(W), num_warps=nw)
                row[f"{name}_w{nw}"] = _time(fn, reps)
        starts = torch.zeros(R, dtype=torch.int32, device="cuda")
        lengths = torch.full((R,), W, dtype=torch.int32, device="cuda")
        _work, steps = launches(x, starts, lengths, out, TOPK, TopkPlan())
        row["mla_fast"] = _time(functools.partial(_run_all, steps), reps)
        if vllm.get("loaded"):
            for name, fn in peer_calls(x, lengths, out).items():
                if not name.startswith("_"):
                    row[name] = _time(fn, reps)
        log(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}))
        res.append(row)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 132, 264, 528])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--width", type=int, default=8192)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    vllm = load_vllm(None)
    res = {"environment": environment(), "ceilings": ceilings(), "topk": TOPK,
           "method": "CUDA-graph replays, L2 flushed by a read, median us",
           "rows": run(args.rows, args.warps, args.width, args.reps, vllm)}
    (args.out / f"topk_held_probe_{args.width}.json").write_text(json.dumps(res, indent=1))
    log(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
