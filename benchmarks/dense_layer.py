"""One DeepSeek-V3 layer's whole dense decode step on the GPU: ``mla.fast.decode_forward``
against the same step composed of PyTorch operations (``mla.reference.decode_forward`` on CUDA
in bf16).

``python -m benchmarks.dense_layer --out DIR``: B in {1, 32, 128}, L in {8K, 32K}, one new
token per request, bf16 weights and cache sized for one layer (B · (L + 1) tokens). The step
is the front, the cache write, the absorbed paged decode and the projections. Timing as
``benchmarks.sparse_layer``: ``do_bench`` and CUDA-graph replays for the fast step, CUDA events
over a few runs for the composition. The cache holds 64K random rows tiled over the pages, in
a scrambled page order.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback

import torch
import triton
import triton.testing

from benchmarks.common import log, time_graph
from benchmarks.sparse_layer import events_ms, step_table
from mla.config import get_config
from mla.environment import environment
from mla.fast import model as fast_model
from mla.reference import model as ref_model
from mla.weights import MLAWeights

BLOCK = 64
TEMPLATE_PAGES = 1024


def bench_one(B: int, L: int, w: MLAWeights, seed: int = 0) -> dict:
    cfg, device = w.config, "cuda"
    per_req = -(-(L + 1) // BLOCK)
    num_pages = B * per_req
    g = torch.Generator(device=device).manual_seed(seed)
    tpl = torch.randn(min(TEMPLATE_PAGES, num_pages), BLOCK, cfg.latent_dim, generator=g,
                      device=device, dtype=torch.bfloat16)
    cache = tpl.repeat(-(-num_pages // tpl.shape[0]), 1, 1)[:num_pages].contiguous()
    del tpl
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    bt = perm.view(B, per_req).to(torch.int32).to(device)
    sl = torch.full((B,), L, dtype=torch.int32, device=device)
    hidden = torch.randn(B, 1, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    res: dict = {"B": B, "L": L, "cache_GB": cache.numel() * 2 / 1e9}

    def fast() -> torch.Tensor:
        return fast_model.decode_forward(w, hidden, cache, bt, sl, validate=False)

    out_fast = fast_model.decode_forward(w, hidden, cache, bt, sl, validate=True)
    res["fast_ms"] = triton.testing.do_bench(fast, warmup=10, rep=100, return_mode="median")
    try:
        res["fast_graph_ms"] = time_graph(fast, reps=30)
    except Exception as e:  # noqa: BLE001 (recorded: the step is not capturable)
        res["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        torch.cuda.synchronize()

    def composed() -> torch.Tensor:
        return ref_model.decode_forward(w, hidden, cache, bt, sl)

    try:
        out_ref = composed()
        res["torch_ms"] = events_ms(composed, 5 if B * L <= 32 * 32768 else 2)
        diff = (out_fast.float() - out_ref.float()).norm() / out_ref.float().norm()
        res["rel_diff_fast_vs_torch"] = diff.item()
        res["speedup"] = res["torch_ms"] / min(res["fast_ms"],
                                               res.get("fast_graph_ms", float("inf")))
    except torch.OutOfMemoryError as e:
        res["torch_error"] = f"out of memory: {str(e).splitlines()[0][:160]}"
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--lengths", default="8192,32768")
    args = p.parse_args(argv)
    env = environment()
    w = MLAWeights.random(get_config("deepseek-v3"), dtype=torch.bfloat16, device="cuda")
    os.makedirs(args.out, exist_ok=True)
    rows: list[dict] = []
    for B in [int(x) for x in args.batches.split(",")]:
        for L in [int(x) for x in args.lengths.split(",")]:
            log(f"dense layer B={B} L={L}")
            try:
                r = bench_one(B, L, w)
            except Exception as e:  # noqa: BLE001 (one size failing must not hide the others)
                traceback.print_exc()
                r = {"B": B, "L": L, "error": f"{type(e).__name__}: {e}"[:300]}
            log(json.dumps(r))
            rows.append(r)
            torch.cuda.empty_cache()
            with open(os.path.join(args.out, f"dense_layer_{env['date'][:10]}.json"), "w") as fh:
                json.dump({"environment": env, "rows": rows}, fh, indent=1)
    md = step_table("Dense decode layer step (DeepSeek-V3, bf16 weights and cache)", rows, env)
    with open(os.path.join(args.out, f"dense_layer_{env['date'][:10]}.md"), "w") as fh:
        fh.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
