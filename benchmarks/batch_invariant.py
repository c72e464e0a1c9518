"""``python -m benchmarks.batch_invariant [--out-dir DIR]``: what batch invariance costs.

A decode that splits a request's keys over several programs (split-KV) fills the GPU at small
batches; its result then depends on the batch, because the split count does. Both ``mla.fast``
(``batch_invariant=True``: runs of a fixed number of keys or entries, whatever the batch, merged
in split order) and FlashMLA (``enable_batch_invariant=True``) have a mode whose result does
not. This times each decode both ways, in CUDA graphs with the L2 flushed, at batches from 1 to
128, on DeepSeek-V3's dense decode (N = 16 and 128 heads), V3.2's sparse decode over the
``fp8_ds_mla`` cache (N = 128, top-k 2048) and V4's MODEL1 decode (N = 64, top-k 512 and a
window of 128). Writes ``batch_invariant_<date>.json`` and ``.md``: per shape and target the
time both ways and their ratio, with the copy and matmul ceilings measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from datetime import date

import torch

from mla.bench.runner import Target, run_bench
from mla.bench.shapes import Shape
from mla.bench.timing import ceilings
from mla.environment import environment

BATCHES = (1, 2, 8, 32, 128)
FAMILIES = (
    ("deepseek-v3 N=16", dict(kernel="mla_decode_paged", N=16, L=8192)),
    ("deepseek-v3 N=128", dict(kernel="mla_decode_paged", N=128, L=8192)),
    ("deepseek-v3.2 N=128", dict(kernel="sparse_mla_decode", N=128, L=8192, topk=2048,
                                 cache="fp8_ds_mla")),
    ("deepseek-v4 N=64", dict(kernel="sparse_mla_decode", N=64, L=8192, topk=512, window=128,
                              D=512, cache="model1")),
)


def shapes() -> list[Shape]:
    return [Shape(family, "decode", "memory", B=b, **kw)
            for family, kw in FAMILIES for b in BATCHES]


def targets() -> list[Target]:
    import mla.fast as fast
    from mla.conformance.adapters.flashmla import target as flashmla
    from mla.conformance.runner import kernels_of

    decodes = ("mla_decode_paged", "sparse_mla_decode")
    plain = {k: fn for k, fn in kernels_of(fast).items() if k in decodes}
    out = [Target("mla.fast", plain),
           Target("mla.fast batch-invariant",
                  {k: functools.partial(fn, batch_invariant=True) for k, fn in plain.items()})]
    try:
        from mla.conformance.adapters import import_peer
        from mla.conformance.adapters.flashmla import INTERFACE

        import_peer(INTERFACE, "FlashMLA")
        out += [Target("flashmla", {k: v for k, v in flashmla().items() if k in decodes}),
                Target("flashmla batch-invariant", flashmla(batch_invariant=True))]
    except Exception as e:  # noqa: BLE001 (no peer here: the rows say why)
        out += [Target("flashmla", skipped=str(e)[:200]),
                Target("flashmla batch-invariant", skipped=str(e)[:200])]
    return out


def report(rows: list[dict], meta: dict) -> str:
    env, ceil = meta["environment"], meta["ceilings"]
    lines = [f"# Batch invariance: its cost in time, {env.get('gpu', '?')}, {env['date']}", "",
             f"torch {env['torch']}, triton {env['triton']}, CUDA {env.get('cuda', '?')}. "
             f"Ceilings measured in the same run: copy {ceil['copy_GBps']:.0f} GB/s, bf16 "
             f"matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s. Median of {meta['reps']} CUDA-graph "
             "replays, L2 flushed before each.", "",
             "`ratio`: the batch-invariant time over the default's.", "",
             "| shape | B | target | default µs | % copy | batch-invariant µs | % copy | ratio |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r.get("why"):
            plain = (f"{r['us']:.1f} | {100 * r['frac_copy']:.0f}%" if r.get("us") is not None
                     else "- | -")
            lines.append(f"| {r['shape']} | {r['B']} | {r['target']} | {plain} | "
                         f"{r['why'][:120]} | | |")
            continue
        lines.append(f"| {r['shape']} | {r['B']} | {r['target']} | {r['us']:.1f} | "
                     f"{100 * r['frac_copy']:.0f}% | {r['us_bi']:.1f} | "
                     f"{100 * r['frac_copy_bi']:.0f}% | {r['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.batch_invariant", description=__doc__)
    p.add_argument("--out-dir", default=".")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.batch_invariant needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    meta = {"environment": environment(device), "ceilings": ceilings(), "reps": args.reps}
    ts = targets()
    results = run_bench(shapes(), ts, device, reps=args.reps,
                        ceil=meta["ceilings"],
                        progress=lambda r: print(f"{r.shape} B={r.dims} {r.target}: {r.us}",
                                                 file=sys.stderr, flush=True))
    by = {(r.shape, r.dims, r.target): r for r in results}
    rows = []
    for s in shapes():
        for plain in ("mla.fast", "flashmla"):
            a, b = by[(s.name, s.dims, plain)], by[(s.name, s.dims, plain + " batch-invariant")]
            row = {"shape": s.preset, "B": s.B, "dims": s.dims, "target": plain}
            if a.us is None or b.us is None:
                row["why"] = a.skipped or a.error or b.skipped or b.error or "no time"
                if a.us is not None:
                    row.update(us=a.us, frac_copy=a.frac_copy)
            else:
                row.update(us=a.us, us_bi=b.us, ratio=b.us / a.us, frac_copy=a.frac_copy,
                           frac_copy_bi=b.frac_copy, TFLOPs=a.TFLOPs, TFLOPs_bi=b.TFLOPs)
            rows.append(row)
    stem = os.path.join(args.out_dir, f"batch_invariant_{date.today().isoformat()}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows,
                   "results": [dataclasses.asdict(r) for r in results]}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(report(rows, meta))
    print(report(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
