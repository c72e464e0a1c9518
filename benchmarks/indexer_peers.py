"""``python -m benchmarks.indexer_peers --out DIR``: ``mla.fast``'s indexer logits beside
DeepGEMM's, the kernels vLLM runs for DeepSeek-V3.2, on one GPU, timed the same way.

DeepGEMM 2.8.1 comes from vLLM 0.33.0's wheel (``python -m benchmarks.peers --deepgemm``;
``mla.conformance.adapters.deepgemm.load`` unpacks and imports it; its JIT compiles each
kernel with the machine's ``nvcc`` at the first call, before any timing). Both are called on
the same inputs (``benchmarks.indexer``'s: DeepSeek-V3.2's 64 heads of 128, e4m3 codes,
scattered pages of 64):

- decode, ``fp8_paged_mqa_logits``: B in {1, 32, 128} requests of L in {8K, 32K, 128K} keys,
  ``next_n`` 1 (and 2 at 32K). DeepGEMM's scheduler metadata is computed once, outside the
  timing, as vLLM computes it once a batch.
- prefill, ``fp8_mqa_logits``: ``benchmarks.indexer``'s ragged shapes (``PREFILL_SHAPES``:
  one long request, batches of short ones), ``mla.fast`` both with full rows ``[S, N]`` (the
  default) and with rows compressed to the longest (``max_seqlen_k``), as DeepGEMM writes
  them, each on its default plan (on Hopper, ``mla.fast.sm90.logits``), and compressed on the
  Triton kernel (``prefill_kernel="triton"``). ``--only prefill`` times these alone;
  ``--sweep`` adds the compressed rows with 8, 32 and 64 tiles a program.

Each is a CUDA graph of one call, replayed with the L2 flushed by a read before each (median
ms; ``benchmarks.common.time_graph``); TFLOP/s over the (query, key) pairs computed, against
the FP8 matmul rate measured in the same run (``torch._scaled_mm``, 8192³). Before timing, the
two answers are compared where both are defined (each row up to its length) in
``mla.compare.logits_err``'s measure against the magnitude of ``mla.fast``'s own logits with
``|w|``: a number for orientation (the conformance catalogue, ``mla conform --target
deepgemm``, is the check against the float64 reference). A peer that fails to load is
recorded as such and nothing of it is timed.

Nothing here is imported by ``mla``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os

import torch

from benchmarks.common import ceilings, log, report_heading, time_graph
from benchmarks.indexer import (
    PREFILL_SHAPES,
    D,
    H,
    fp8_matmul_tflops,
    paged_inputs,
    ragged_inputs,
)
from mla.compare import logits_err
from mla.conformance.adapters import deepgemm
from mla.conformance.catalogue import Unsupported
from mla.environment import environment
from mla.fast import fp8_mqa_logits, fp8_paged_mqa_logits
from mla.fast.indexer.logits import RAGGED_COMPRESSED_PLAN
from mla.reference.indexer_logits import decode_row_ends

DECODE = [(B, 1, L) for L in (8192, 32768, 131072) for B in (1, 32, 128)] + \
    [(B, 2, 32768) for B in (1, 32, 128)]
# the Triton kernel with rows compressed, beside the default (on Hopper, mla.fast.sm90.logits)
TRITON_COMPRESSED = dataclasses.replace(RAGGED_COMPRESSED_PLAN, prefill_kernel="triton")
# --sweep: the most tiles of 64 keys a program covers (the default plans': 16 full, 32
# compressed)
SWEEP_TILES = (8, 16, 64)
TITLE = "Indexer logits: mla.fast beside DeepGEMM (python -m benchmarks.indexer_peers)"


def _ms(fn) -> float:
    fn()  # compiles (DeepGEMM's JIT, Triton's) before the capture
    torch.cuda.synchronize()
    return time_graph(fn, reps=30, read_flush=True)


def _timed(row: dict, flops: int, fp8_tflops: float, **fns) -> dict:
    """``row`` with each of ``fns`` timed (``_ms``): ms, TFLOP/s and % of the fp8 rate; then
    logged."""
    for name, fn in fns.items():
        ms = _ms(fn)
        tf = flops / (ms * 1e-3) / 1e12
        row[name] = {"ms": ms, "TFLOPs": tf, "pct_fp8": 100 * tf / fp8_tflops}
    log(json.dumps(row))
    torch.cuda.empty_cache()
    return row


def _agreement(ours: torch.Tensor, theirs: torch.Tensor, mag: torch.Tensor) -> float:
    """``logits_err`` of DeepGEMM's logits against ours where ours are finite."""
    keep = torch.isfinite(ours)
    return logits_err(torch.where(keep, theirs, ours), ours, mag)


def decode(dg: object, fp8_tflops: float) -> list[dict]:
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for B, next_n, L in DECODE:
        q8, cache, w, lens, table = paged_inputs(B, next_n, L)
        flops = 2 * B * next_n * H * D * L
        per_row = decode_row_ends(lens, next_n).view(B, next_n)
        meta = dg.get_paged_mqa_logits_metadata(  # type: ignore[attr-defined]
            per_row, cache.shape[1], sms // (2 if next_n == 4 else 1))
        cache4 = cache.view(cache.shape[0], cache.shape[1], 1, -1)

        def theirs(q8=q8, cache4=cache4, w=w, per_row=per_row, table=table, meta=meta, L=L):
            return dg.fp8_fp4_paged_mqa_logits((q8, None), cache4, w, per_row, table,  # type: ignore[attr-defined]
                                               meta, L)

        ours = functools.partial(fp8_paged_mqa_logits, q8, cache, w, lens, table, L)
        row: dict = {"kernel": "fp8_paged_mqa_logits", "B": B, "next_n": next_n, "L": L}
        if B == 1:
            mine = ours()
            mag = fp8_paged_mqa_logits(q8, cache, w.abs(), lens, table, L)
            row["agreement_err"] = _agreement(mine, deepgemm.paged_logits(
                dg, q8, cache, w, lens, table, L, sms), mag)
        rows.append(_timed(row, flops, fp8_tflops, mla_fast=ours, deepgemm=theirs))
    return rows


def prefill(dg: object, fp8_tflops: float, sweep: bool = False) -> list[dict]:
    rows = []
    for name, requests, queries in PREFILL_SHAPES:
        q8, kv, w, ks, ke = ragged_inputs(requests, queries)
        longest = int((ke - ks).max())
        flops = 2 * int((ke - ks).long().sum()) * H * D

        def theirs(q8=q8, kv=kv, w=w, ks=ks, ke=ke, longest=longest):
            return dg.fp8_fp4_mqa_logits((q8, None), kv, w, ks, ke, longest)  # type: ignore[attr-defined]

        ours = functools.partial(fp8_mqa_logits, q8, kv, w, ks, ke)
        compressed = functools.partial(fp8_mqa_logits, q8, kv, w, ks, ke, longest)
        triton_compressed = functools.partial(fp8_mqa_logits, q8, kv, w, ks, ke, longest,
                                              plan=TRITON_COMPRESSED)
        sl = (q8[-8:], kv, w[-8:], ks[-8:], ke[-8:])
        mag = fp8_mqa_logits(sl[0], kv, sl[2].abs(), *sl[3:])
        mag_c = fp8_mqa_logits(sl[0], kv, sl[2].abs(), *sl[3:], longest)
        row: dict = {"kernel": "fp8_mqa_logits", "shape": name, "S": len(ks),
                     "N": kv[0].shape[0], "max_seqlen_k": longest,
                     "agreement_err": _agreement(fp8_mqa_logits(*sl),
                                                 deepgemm.ragged_logits(dg, *sl), mag),
                     "agreement_err_compressed": _agreement(
                         fp8_mqa_logits(*sl, longest),
                         deepgemm.ragged_logits(dg, *sl, longest), mag_c)}
        tiles = {f"mla_fast_compressed_tiles{t}": functools.partial(
            fp8_mqa_logits, q8, kv, w, ks, ke, longest,
            plan=dataclasses.replace(RAGGED_COMPRESSED_PLAN, max_tiles=t))
            for t in (SWEEP_TILES if sweep else ())}
        rows.append(_timed(row, flops, fp8_tflops, mla_fast=ours,
                           mla_fast_compressed=compressed,
                           mla_fast_triton_compressed=triton_compressed, deepgemm=theirs,
                           **tiles))
    return rows


def markdown(res: dict) -> str:
    copy = res["ceilings"]["copy_TBps"]
    lines = [f"fp8 matmul {res['fp8_TFLOPs']:.0f} TFLOP/s, copy {copy:.2f} TB/s; ms (TFLOP/s, "
             "% of the fp8 rate)", "",
             "| kernel | shape | mla.fast | mla.fast, rows compressed | mla.fast's Triton kernel, "
             "rows compressed | DeepGEMM (compressed) | agreement |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in res.get("decode", []) + res.get("prefill", []):
        shape = r.get("shape") or f"B {r['B']}, next_n {r['next_n']}, L {r['L'] // 1024}K"
        cells = [f"{r[k]['ms']:.3f} ({r[k]['TFLOPs']:.0f}, {r[k]['pct_fp8']:.0f}%)" if k in r
                 else "" for k in ("mla_fast", "mla_fast_compressed",
                                   "mla_fast_triton_compressed", "deepgemm")]
        agree = " / ".join(f"{r[k]:.1e}" for k in ("agreement_err", "agreement_err_compressed")
                           if k in r)
        lines.append(f"| {r['kernel']} | {shape} | {' | '.join(cells)} | {agree} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.indexer_peers",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--only", choices=("decode", "prefill"),
                   help="one of the two kernels (default: both)")
    p.add_argument("--sweep", action="store_true",
                   help="prefill: also the compressed rows with other tiles a program "
                        "(LogitsPlan.max_tiles)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    res: dict = {"environment": environment(), "ceilings": ceilings(),
                 "fp8_TFLOPs": fp8_matmul_tflops()}
    path = os.path.join(args.out, "indexer_peers.json")
    try:
        dg = deepgemm.load()
    except Unsupported as e:
        res["deepgemm"] = f"not loaded: {e}"
        log(res["deepgemm"])
    else:
        res["deepgemm"] = f"DeepGEMM {getattr(dg, '__version__', '?')}"
        if args.only != "prefill":
            res["decode"] = decode(dg, res["fp8_TFLOPs"])
        if args.only != "decode":
            res["prefill"] = prefill(dg, res["fp8_TFLOPs"], args.sweep)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    text = "\n".join(report_heading(TITLE, res)) + "\n\n" + (
        markdown(res) if "decode" in res or "prefill" in res else res["deepgemm"] + "\n")
    with open(os.path.join(args.out, "indexer_peers.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
