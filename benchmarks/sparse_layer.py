"""One DeepSeek-V3.2 layer's whole sparse decode step on the GPU: ``mla.fast`` against the same
step composed of PyTorch operations (``mla.reference``'s functions on CUDA in bf16).

``python -m benchmarks.sparse_layer --out DIR``: B in {1, 32, 128}, L in {8K, 32K, 128K}, one
new token per request (s_q = 1), bf16 weights, the fp8_ds_mla latent cache and vLLM's fp8
index key cache, sized for one layer (B · (L + 1) tokens). The step is everything a layer
does: front, both cache writes, the indexer (rotations, q quantization, paged fp8 logits,
top-k), the index conversion, the sparse attention, the projections.

Timing: the fast step by ``triton.testing.do_bench`` (median) and, when it can be captured,
CUDA-graph replays (median, L2 flushed before each); the composition (host syncs and Python
loops over requests included, as a user of the reference would run it) by CUDA events over
a few runs after a warm-up, since one run can take a second. Target: fast >= 10x faster than
the composition at B = 32, L = 32K.

The caches hold 64K random tokens (quantized by the fast writers) tiled over all pages, in
a scrambled page order: the values a step reads are realistic, their repetition is not
timed differently by any kernel here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import traceback

import torch
import triton
import triton.testing

from benchmarks.common import log, time_graph
from mla.config import get_config
from mla.environment import environment
from mla.fast import fp8_paged_mqa_logits, sparse_mla_decode, top_k_per_row
from mla.fast.fp8 import concat_and_cache_fp8_ds_mla
from mla.fast.indexer.cache import indexer_k_quant_and_cache
from mla.fast.sparse import model as fast_sparse
from mla.reference import sparse_model as ref_sparse
from mla.reference.indexer import IndexerWeights
from mla.reference.sparse_model import project_output
from mla.weights import MLAWeights

BLOCK = 64
TEMPLATE_PAGES = 1024  # 64K tokens of random content, tiled


def _caches(num_pages: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_ds_mla latent cache and fp8 index key cache of ``num_pages`` pages of 64 tokens."""
    g = torch.Generator(device=device).manual_seed(seed)
    n_tpl = min(TEMPLATE_PAGES, num_pages)
    kv_t = torch.empty(n_tpl, BLOCK, 656, dtype=torch.uint8, device=device)
    ik_t = torch.empty(n_tpl, BLOCK, 132, dtype=torch.uint8, device=device)
    T = n_tpl * BLOCK
    slots = torch.arange(T, device=device)
    kv_c = torch.randn(T, 512, generator=g, device=device, dtype=torch.bfloat16)
    k_pe = torch.randn(T, 64, generator=g, device=device, dtype=torch.bfloat16)
    concat_and_cache_fp8_ds_mla(kv_c, k_pe, kv_t, slots)
    k_idx = torch.randn(T, 128, generator=g, device=device, dtype=torch.bfloat16)
    indexer_k_quant_and_cache(k_idx, ik_t, slots)
    del kv_c, k_pe, k_idx
    reps = -(-num_pages // n_tpl)
    kv = kv_t.repeat(reps, 1, 1)[:num_pages].contiguous()
    ik = ik_t.repeat(reps, 1, 1)[:num_pages].contiguous()
    return kv, ik


def events_ms(fn, runs: int) -> float:
    """Median ms of ``runs`` calls after one warm-up, by CUDA events (for slow steps)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _breakdown(w: MLAWeights, iw: IndexerWeights, hidden: torch.Tensor, kv: torch.Tensor,
               ik: torch.Tensor, bt: torch.Tensor, sl: torch.Tensor) -> dict[str, float]:
    """Median ms of each part of the fast step on the step's own intermediates (eager calls,
    launch overhead included): where the time goes."""
    B, cfg = hidden.shape[0], w.config
    tr = fast_sparse.sparse_decode_layer(w, iw, hidden, kv, ik, bt, sl, validate=True)
    pos = sl.long()
    req = torch.arange(B, device=hidden.device)
    slots = bt.long()[req, pos // BLOCK] * BLOCK + pos % BLOCK
    seq = (sl + 1).to(torch.int32)
    h2 = hidden.reshape(B, -1)
    parts = {
        "front_and_cache_writes": lambda: fast_sparse._front_and_index(w, iw, h2, slots, pos, kv,
                                                                       ik, False),
        "index_logits": lambda: fp8_paged_mqa_logits(
            tr.q_index.view(B, 1, *tr.q_index.shape[1:]), ik, tr.index_weights, seq, bt,
            tr.logits.shape[1], validate=False),
        "top_k": lambda: top_k_per_row(tr.logits, tr.row_starts, tr.row_ends, cfg.index_topk,
                                       validate=False),
        "sparse_attention": lambda: sparse_mla_decode(
            tr.q, kv, tr.slots.view(B, 1, -1), cfg.softmax_scale, True,
            head_dim_v=cfg.kv_lora_rank, validate=False),
        "output_projection": lambda: project_output(w, tr.o_lat),
    }
    return {k: triton.testing.do_bench(f, warmup=5, rep=50, return_mode="median")
            for k, f in parts.items()}


def bench_one(B: int, L: int, w: MLAWeights, iw: IndexerWeights, device: str = "cuda",
              seed: int = 0) -> dict:
    cfg = w.config
    per_req = -(-(L + 1) // BLOCK)
    num_pages = B * per_req
    kv, ik = _caches(num_pages, device, seed)
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    bt = perm.view(B, per_req).to(torch.int32).to(device)
    sl = torch.full((B,), L, dtype=torch.int32, device=device)
    hidden = torch.randn(B, 1, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    res: dict = {"B": B, "L": L, "cache_GB": (kv.numel() + ik.numel()) / 1e9}

    def fast() -> torch.Tensor:
        return fast_sparse.sparse_decode_forward(w, iw, hidden, kv, ik, bt, sl, validate=False)

    out_fast = fast_sparse.sparse_decode_forward(w, iw, hidden, kv, ik, bt, sl, validate=True)
    res["fast_ms"] = triton.testing.do_bench(fast, warmup=10, rep=100, return_mode="median")
    try:
        res["fast_graph_ms"] = time_graph(fast, reps=30)
    except Exception as e:  # noqa: BLE001 (recorded: the step is not capturable)
        res["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        torch.cuda.synchronize()

    def composed() -> torch.Tensor:
        return ref_sparse.sparse_decode_forward(w, iw, hidden, kv, ik, bt, sl)

    runs = 5 if B * L <= 32 * 32768 else 2
    try:
        out_ref = composed()
        res["torch_ms"] = events_ms(composed, runs)
        res["torch_runs"] = runs
        diff = (out_fast.float() - out_ref.float()).norm() / out_ref.float().norm()
        res["rel_diff_fast_vs_torch"] = diff.item()
    except torch.OutOfMemoryError as e:
        res["torch_error"] = f"out of memory: {str(e).splitlines()[0][:160]}"
    best = min(res["fast_ms"], res.get("fast_graph_ms", float("inf")))
    if "torch_ms" in res:
        res["speedup"] = res["torch_ms"] / best
    if (B, L) == (32, 32768):
        res["fast_parts_ms"] = _breakdown(w, iw, hidden, kv, ik, bt, sl)
    return res


def step_table(title: str, rows: list[dict], env: dict) -> str:
    """The markdown report of a layer-step benchmark: heading, versions, one row per size."""
    lines = [f"# {title}, {env['gpu']}, {env['date']}", "",
             f"torch {env['torch']}, triton {env['triton']}. One layer, s_q = 1.", "",
             "| B | L | cache GB | fast ms | fast graph ms | torch composition ms | speedup |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['B']} | {r['L']} | | error: {r['error'][:80]} | | | |")
            continue
        g = f"{r['fast_graph_ms']:.3f}" if "fast_graph_ms" in r else "n/a"
        t = f"{r['torch_ms']:.2f}" if "torch_ms" in r else r.get("torch_error", "n/a")
        s = f"{r['speedup']:.1f}x" if "speedup" in r else "n/a"
        lines.append(f"| {r['B']} | {r['L']} | {r['cache_GB']:.2f} | {r['fast_ms']:.3f} | {g} "
                     f"| {t} | {s} |")
    graph_errors = {r["graph_error"] for r in rows if "graph_error" in r}
    if graph_errors:
        lines += ["", "Not captured in a CUDA graph: " + "; ".join(sorted(graph_errors))]
    for r in rows:
        if "fast_parts_ms" in r:
            parts = ", ".join(f"{k} {v:.3f}" for k, v in r["fast_parts_ms"].items())
            lines += ["", f"Parts of the fast step at B={r['B']}, L={r['L']} (ms, eager): "
                      f"{parts}."]
    return "\n".join(lines) + "\n"


TITLE = ("Sparse decode layer step (DeepSeek-V3.2, bf16 weights, fp8_ds_mla cache, fp8 "
         "indexer)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--lengths", default="8192,32768,131072")
    args = p.parse_args(argv)
    env = environment()
    sizes = [(int(b), int(n)) for b in args.batches.split(",") for n in args.lengths.split(",")]
    # the target's size first, so that a run cut short still has it
    sizes.sort(key=lambda bl: bl != (32, 32768))
    os.makedirs(args.out, exist_ok=True)
    stamp = env["date"][:10]
    cfg = get_config("deepseek-v3.2")
    w = MLAWeights.random(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    iw = IndexerWeights.random(cfg, seed=1, dtype=torch.bfloat16, device="cuda")
    rows = []
    for B, L in sizes:
        log(f"sparse layer B={B} L={L}")
        try:
            r = bench_one(B, L, w, iw)
        except Exception as e:  # noqa: BLE001 (one size failing must not hide the others)
            traceback.print_exc()
            r = {"B": B, "L": L, "error": f"{type(e).__name__}: {e}"[:300]}
        log(json.dumps(r))
        rows.append(r)
        torch.cuda.empty_cache()  # this size's caches are gone: free them for the next
        rows.sort(key=lambda x: (x["B"], x["L"]))
        with open(os.path.join(args.out, f"sparse_layer_{stamp}.json"), "w") as fh:
            json.dump({"environment": env, "rows": rows}, fh, indent=1)
        md = step_table(TITLE, rows, env)
        with open(os.path.join(args.out, f"sparse_layer_{stamp}.md"), "w") as fh:
            fh.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
