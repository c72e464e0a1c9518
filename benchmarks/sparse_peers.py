"""``python -m benchmarks.sparse_peers [--out-dir DIR] [--only attention|logits|topk]``:
DeepSeek-V3.2's sparse kernels beside the peers', one row a kernel and shape.

Writes ``sparse_peers_<date>.json`` and ``.md``: per row ``kernel``, ``shape``, ``ours_us``,
``peer``, ``peer_us`` and ``ratio`` (ours over the peer's: below 1 is faster), with the GPU,
the versions, the date and the copy and matmul ceilings measured in the same run.

- **Sparse attention beside FlashMLA** (``mla.bench``'s runner: one call captured in a CUDA
  graph and replayed, the L2 flushed before each replay, median): V3.2's decode over the
  ``fp8_ds_mla`` cache at B=64 N=128 and B=128 N=64 (top-k 2048), its prefill at
  s_q 4096 / s_kv 32K / N 128 and s_q 2048 / s_kv 16K / N 64, V4's prefill rows of 512 at
  N 64 and 128, and V4's MODEL1 decode at N=128, top-k 512 and 2048, with and without a
  window of 128 as the second scope. Prefill rows carry TFLOP/s and the fraction of the bf16
  matmul ceiling.
- **Indexer prefill logits beside DeepGEMM** (``benchmarks.indexer_peers.prefill``: its five
  ragged shapes, ours with rows compressed to the longest, as DeepGEMM writes them).
- **Top-k beside vLLM** (``benchmarks.topk_peers.run`` on rows of 8K to 32K, the common
  decode lengths; the peer is the fastest of vLLM's top-k kernels on that shape).

A peer that cannot be loaded leaves its rows with ``peer_us = null`` and the reason. Nothing
here is imported by ``mla``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import date

import torch

from mla.bench.runner import resolve_targets, run_bench
from mla.bench.shapes import Shape
from mla.bench.timing import ceilings
from mla.environment import environment

ATTENTION = (
    Shape("deepseek-v3.2", "decode", "memory", "sparse_mla_decode", N=128, B=64, L=32768,
          topk=2048, cache="fp8_ds_mla"),
    Shape("deepseek-v3.2", "decode", "memory", "sparse_mla_decode", N=64, B=128, L=32768,
          topk=2048, cache="fp8_ds_mla"),
    Shape("deepseek-v3.2", "prefill", "compute", "sparse_mla_prefill", N=128, s_q=4096,
          L=32768, topk=2048),
    Shape("deepseek-v3.2", "prefill", "compute", "sparse_mla_prefill", N=64, s_q=2048,
          L=16384, topk=2048),
    Shape("deepseek-v4", "prefill", "compute", "sparse_mla_prefill", N=128, s_q=4096,
          L=32768, topk=2048, D=512),
    Shape("deepseek-v4", "prefill", "compute", "sparse_mla_prefill", N=64, s_q=4096,
          L=32768, topk=2048, D=512),
) + tuple(
    Shape("deepseek-v4", "decode", "memory", "sparse_mla_decode", N=128, B=64, L=32768,
          topk=k, window=w, D=512, cache="model1")
    for k in (512, 2048) for w in (0, 128))
TOPK_ROWS = [(32, 8192), (128, 8192), (256, 8192), (32, 16384), (128, 16384), (32, 32768),
             (128, 32768), (256, 32768)]


def _row(kernel: str, shape: str, ours_us: float | None, peer: str, peer_us: float | None,
         **extra: object) -> dict:
    ratio = ours_us / peer_us if ours_us and peer_us else None
    return {"kernel": kernel, "shape": shape, "ours_us": ours_us, "peer": peer,
            "peer_us": peer_us, "ratio": ratio, **extra}


def attention(ceil: dict[str, float], reps: int) -> list[dict]:
    """The sparse attention rows: ``mla.fast`` beside FlashMLA on ``ATTENTION``."""
    res = run_bench(ATTENTION, resolve_targets("mla.fast"), torch.device("cuda"), reps=reps,
                    ceil=ceil, progress=lambda r: print(f"{r.dims} {r.target}: {r.us}",
                                                        file=sys.stderr, flush=True))
    rows = []
    for a, b in zip(res[0::2], res[1::2]):
        extra: dict = {"method": a.method, "l2": a.l2}
        if a.kernel == "sparse_mla_prefill":
            extra.update(ours_TFLOPs=a.TFLOPs, ours_frac_matmul=a.frac_matmul,
                         peer_TFLOPs=b.TFLOPs)
        why = a.skipped or a.error or b.skipped or b.error
        if why:
            extra["why"] = why
        rows.append(_row(a.kernel, a.dims, a.us, "FlashMLA", b.us, **extra))
    return rows


def logits() -> list[dict]:
    """The indexer's prefill logits beside DeepGEMM's (rows compressed on both sides)."""
    from benchmarks.indexer import fp8_matmul_tflops
    from benchmarks.indexer_peers import prefill
    from mla.conformance.adapters import deepgemm
    from mla.conformance.catalogue import Unsupported

    try:
        dg = deepgemm.load()
    except Unsupported as e:
        return [_row("fp8_mqa_logits", "prefill shapes", None, "DeepGEMM", None,
                     why=f"DeepGEMM not loaded: {e}")]
    rows = []
    for r in prefill(dg, fp8_matmul_tflops()):
        ours, theirs = r["mla_fast_compressed"], r["deepgemm"]
        rows.append(_row("fp8_mqa_logits", f"{r['shape']} (S={r['S']}, max_seqlen_k="
                         f"{r['max_seqlen_k']})", 1e3 * ours["ms"], "DeepGEMM",
                         1e3 * theirs["ms"], ours_TFLOPs=ours["TFLOPs"],
                         peer_TFLOPs=theirs["TFLOPs"]))
    return rows


def topk(copy_tbps: float, reps: int) -> list[dict]:
    """``top_k_per_row`` (k = 2048) beside the fastest of vLLM's top-k kernels."""
    from benchmarks.topk_peers import load_vllm, run

    vllm = load_vllm(None)
    rows = []
    for r in run(vllm, copy_tbps, reps, TOPK_ROWS):
        peers = {k: v for k, v in r.items() if k.startswith("vllm_") and "ms" in v}
        best = min(peers, key=lambda k: peers[k]["ms"]) if peers else None
        ours = r["mla_fast"].get("ms")
        extra = {} if best else {"why": vllm.get("error") or "no vLLM top-k timed"}
        rows.append(_row("top_k_per_row", f"{r['R']} rows of {r['L'] // 1024}K, k=2048",
                         1e3 * ours if ours else None, best or "vLLM",
                         1e3 * peers[best]["ms"] if best else None, **extra))
    return rows


def markdown(res: dict) -> str:
    env, ceil = res["environment"], res["ceilings"]
    lines = [f"# DeepSeek-V3.2's sparse kernels beside the peers, {env.get('gpu', '?')}, "
             f"{env['date']}", "",
             f"torch {env['torch']}, triton {env['triton']}, CUDA {env.get('cuda', '?')}. "
             f"Ceilings measured in the same run: copy {ceil['copy_GBps']:.0f} GB/s, bf16 "
             f"matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s. CUDA-graph replays, L2 flushed "
             "before each, median. `ratio`: ours over the peer's time.", "",
             "| kernel | shape | ours µs | peer | peer µs | ratio | note |",
             "| --- | --- | --- | --- | --- | --- | --- |"]

    def num(x: object, f: str) -> str:
        return format(x, f) if isinstance(x, (int, float)) else "-"
    for r in res["rows"]:
        note = r.get("why", "")[:100]
        if r.get("ours_frac_matmul") is not None:
            note = f"{r['ours_TFLOPs']:.0f} TFLOP/s, {100 * r['ours_frac_matmul']:.0f}% of matmul"
        lines.append(f"| {r['kernel']} | {r['shape']} | {num(r['ours_us'], '.1f')} | "
                     f"{r['peer']} | {num(r['peer_us'], '.1f')} | {num(r['ratio'], '.2f')} | "
                     f"{note} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sparse_peers",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=".")
    p.add_argument("--only", nargs="*", choices=("attention", "logits", "topk"))
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.sparse_peers needs a CUDA GPU", file=sys.stderr)
        return 2
    parts = args.only or ["attention", "logits", "topk"]
    ceil = ceilings()
    res: dict = {"environment": environment(torch.device("cuda")), "ceilings": ceil, "rows": []}
    if "attention" in parts:
        res["rows"] += attention(ceil, args.reps)
    if "logits" in parts:
        res["rows"] += logits()
    if "topk" in parts:
        res["rows"] += topk(ceil["copy_GBps"] / 1e3, args.reps)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"sparse_peers_{date.today().isoformat()}")
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    text = markdown(res)
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
