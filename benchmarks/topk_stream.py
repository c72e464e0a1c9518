"""``python -m benchmarks.topk_stream --out DIR``: how fast can a Triton program stream a row of
logits against a threshold, and what does each way of recording the survivors cost?

The top-k's filter as it was when this probe was written (an atomic a block reserving each
block's place in the row's candidate list, since replaced by the bitmask of
``mla.fast.topk_kernels._mask_kernel``) streamed at 1.2-1.3 TB/s, a third of the copy rate.
These probe kernels read the same rows (float32, 128K keys, a fixed threshold that ~3000 keys
of a row reach) in one-warp-or-more programs over chunks of the row, and differ
only in what they do with the keys reaching it:

- ``count``: a per-thread count, summed once at the end (nothing stored: the ceiling);
- ``private``: listed at ``count + cumsum(keep) - 1`` in the program's own list (no atomic,
  the count in a register);
- ``private_if``: the same, the scan and the stores skipped in blocks with no survivor;
- ``bitmask``: one bit a key, a 32-bit word per 32 keys stored (no scan);
- ``atomic``: that filter (an atomic a block reserves the place in the row's list).

Each variant's results are checked (counts, listed columns, bits) before it is timed (CUDA-graph
replays, L2 flushed by a read). Beside them: a device copy of the logits and ``torch.amax``
of each row, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from benchmarks.common import ceilings, log, time_graph
from mla.environment import environment
from mla.fast.common import num_sms
from mla.fast.topk import TopkPlan, launches, top_k_per_row
from mla.fast.topk_kernels import _order_keys

MODES = {"count": 0, "private": 1, "private_if": 2, "bitmask": 3}


@triton.jit
def _probe_kernel(logits, thresh, lists, counts, W, chunk, MODE: tl.constexpr,
                  BLOCK: tl.constexpr, STAGES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    nc = tl.num_programs(1)
    t = tl.load(thresh + row)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, W)
    src = logits + row * W
    mine = lists + (row * nc + c) * (2 * chunk)  # MODE 1, 2: keys then columns
    words = lists + row * (W // 32)  # MODE 3
    acc = tl.zeros((BLOCK,), tl.int32)
    held = tl.zeros((), tl.int32)
    for c0 in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        cols = tl.multiple_of(c0, BLOCK) + tl.arange(0, BLOCK)
        x = tl.load(src + cols, mask=cols < hi, other=float("-inf"))
        k = _order_keys(x)
        keep = (cols < hi) & (k >= t)
        if MODE == 0:
            acc += keep.to(tl.int32)
        elif MODE == 1:
            pos = held + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(mine + pos, k, mask=keep)
            tl.store(mine + chunk + pos, cols, mask=keep)
            held += tl.sum(keep.to(tl.int32), axis=0)
        elif MODE == 2:
            kept = tl.sum(keep.to(tl.int32), axis=0)
            if kept > 0:
                pos = held + tl.cumsum(keep.to(tl.int32), axis=0) - 1
                tl.store(mine + pos, k, mask=keep)
                tl.store(mine + chunk + pos, cols, mask=keep)
                held += kept
        else:
            bits = tl.reshape(keep.to(tl.int32), (BLOCK // 32, 32)) << tl.arange(0, 32)[None, :]
            w = tl.sum(bits, axis=1)
            tl.store(words + c0 // 32 + tl.arange(0, BLOCK // 32), w)
    if MODE == 0:
        held = tl.sum(acc, axis=0)
    tl.store(counts + row * nc + c, held)


def _keys(x: torch.Tensor) -> torch.Tensor:
    b = x.view(torch.int32)
    return torch.where(b < 0, b ^ 0x7FFFFFFF, b)


def probe(R: int, W: int, mode: str, block: int, warps: int, stages: int, per_sm: int,
          x: torch.Tensor, t: torch.Tensor, want: torch.Tensor) -> dict:
    chunks = max(1, min(W // block, triton.cdiv(per_sm * num_sms(x.device), R)))
    chunk = block * triton.cdiv(triton.cdiv(W, chunks), block)
    chunks = triton.cdiv(W, chunk)
    m = MODES[mode]
    size = R * W // 32 if m == 3 else R * chunks * 2 * chunk
    lists = torch.zeros(size, dtype=torch.int32, device=x.device)
    counts = torch.zeros(R, chunks, dtype=torch.int32, device=x.device)

    def run() -> None:
        _probe_kernel[(R, chunks)](x, t, lists, counts, W, chunk, MODE=m, BLOCK=block,
                                   STAGES=stages, num_warps=warps)

    run()
    torch.cuda.synchronize()
    ok = True
    if m == 3:
        bits = (lists.view(R, W // 32)[:, :, None] >> torch.arange(32, device=x.device)) & 1
        ok = bool(torch.equal(bits.reshape(R, W).bool(), want))
    else:
        ok = bool(torch.equal(counts.sum(1), want.sum(1).int()))
        if m in (1, 2) and ok:
            lst = lists.view(R, chunks, 2, chunk)
            got = torch.zeros(R, W, dtype=torch.bool, device=x.device)
            idx = torch.arange(chunk, device=x.device)
            live = idx[None, None, :] < counts[:, :, None]
            cols = lst[:, :, 1, :].long().clamp(0, W - 1)
            rows = torch.arange(R, device=x.device)[:, None, None].expand_as(cols)
            got[rows[live], cols[live]] = True
            keys_ok = torch.equal(lst[:, :, 0, :][live], _keys(x)[rows[live], cols[live]])
            ok = bool(torch.equal(got, want)) and bool(keys_ok)
    ms = time_graph(run, read_flush=True)
    gbps = R * W * 4 / (ms * 1e-3) / 1e9
    return {"R": R, "W": W, "mode": mode, "block": block, "warps": warps, "stages": stages,
            "per_sm": per_sm, "chunks": chunks, "ok": ok, "us": ms * 1e3, "GBps": gbps}


def _current(x: torch.Tensor) -> dict:
    """The current three launches' times: the filter alone (after one estimate), and all."""
    R, W = x.shape
    starts = torch.zeros(R, dtype=torch.int32, device=x.device)
    ends = torch.full((R,), W, dtype=torch.int32, device=x.device)
    out = torch.empty(R, 2048, dtype=torch.int32, device=x.device)
    est, filt, select = launches(x, starts, ends, out, 2048, TopkPlan(route="three"))[1]
    est()
    return {"filter_us": time_graph(filt, read_flush=True) * 1e3,
            "estimate_us": time_graph(est, read_flush=True) * 1e3,
            "three_us": time_graph(lambda: (est(), filt(), select()), read_flush=True) * 1e3,
            "default_us": time_graph(lambda: top_k_per_row(x, starts, ends, 2048),
                                     read_flush=True) * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.topk_stream",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    ceil = ceilings()
    log(f"ceilings {ceil}")
    rows = []
    shapes = [(128, 131072), (256, 131072), (32, 131072), (128, 32768)]
    grid = [("count", 256, 1, 3, 64), ("count", 1024, 4, 3, 16), ("count", 2048, 4, 4, 8),
            ("count", 4096, 8, 3, 4),
            ("private", 256, 1, 3, 64), ("private", 512, 1, 3, 32), ("private", 1024, 2, 3, 16),
            ("private", 1024, 4, 3, 16), ("private", 2048, 4, 3, 8), ("private", 256, 1, 4, 32),
            ("private_if", 256, 1, 3, 64), ("private_if", 1024, 4, 3, 16),
            ("bitmask", 256, 1, 3, 64), ("bitmask", 1024, 4, 3, 16), ("bitmask", 2048, 4, 3, 8),
            ("bitmask", 4096, 8, 3, 4)]
    if args.quick:
        shapes, grid = shapes[:1], grid[:2] + grid[4:6] + grid[12:14]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for R, W in shapes:
        x = torch.randn(R, W, device="cuda", generator=gen)
        t = _keys(x).kthvalue(W - 3000 + 1, dim=1).values.int().contiguous()  # ~3000 reach it
        want = _keys(x) >= t[:, None]
        copy_dst = torch.empty_like(x)
        base = {"copy_us": time_graph(lambda d=copy_dst, s=x: d.copy_(s), read_flush=True) * 1e3,
                "amax_us": time_graph(lambda s=x: torch.amax(s, dim=1),
                                          read_flush=True) * 1e3}
        log(f"{R}x{W}: copy {base['copy_us']:.1f} us, amax {base['amax_us']:.1f} us")
        base.update(_current(x))
        log(f"  current three launches: {base}")
        for mode, block, warps, stages, per_sm in grid:
            try:
                r = probe(R, W, mode, block, warps, stages, per_sm, x, t, want)
            except Exception as e:  # a variant that does not compile is reported, not fatal
                r = {"R": R, "W": W, "mode": mode, "block": block, "warps": warps,
                     "error": f"{type(e).__name__}: {e}"[:300]}
            r.update(base)
            rows.append(r)
            log(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in r.items()))
        torch.cuda.empty_cache()
    res = {"environment": environment(), "ceilings": ceil, "rows": rows}
    with open(os.path.join(args.out, "topk_stream.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"copy {ceil['copy_TBps']:.2f} TB/s")
    print("| R x W | mode | block | warps | stages | per SM | ok | us | GB/s | copy us | amax us |")
    for r in rows:
        if "error" in r:
            print(f"| {r['R']}x{r['W']} | {r['mode']} | {r['block']} | {r['warps']} | "
                  f"error: {r['error'][:80]} |")
            continue
        print(f"| {r['R']}x{r['W']} | {r['mode']} | {r['block']} | {r['warps']} | "
              f"{r['stages']} | {r['per_sm']} | {r['ok']} | {r['us']:.1f} | {r['GBps']:.0f} | "
              f"{r['copy_us']:.1f} | {r['amax_us']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
