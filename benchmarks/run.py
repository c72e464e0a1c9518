"""``python -m benchmarks.run``: the machine's ceilings, then the fast decode on the fast path's
target shapes.

1. Ceilings, measured in the same run: a device-to-device copy (bytes read + written) and an
   8192³ bf16 matmul, each the median of ``triton.testing.do_bench``.
2. ``mla.fast.mla_decode_paged`` (bf16, page size 64, scattered pages, random data, caches
   far larger than the 60 MB L2 except for the latency case) on:
   memory-bound ``N = 16``: B=128 L=4096, B=64 L=16384, B=16 L=65536 (target 3.2 TB/s);
   compute-bound ``N = 128``: B=128 L=8192 s_q=1, B=64 L=8192 s_q=2 causal (400 TFLOP/s);
   latency B=1 L=4096 N=128 (50 µs).
   FLOPs ``= 2·N·s_q·L·(576 + 512)`` per request and bytes ``= L·576·2`` (the cache read once)
   plus q, out and lse, as in FlashMLA's reports. Eager time is ``do_bench``'s median (it
   flushes L2 before each call); "graph" time replays the call captured in a CUDA graph, the
   way a serving engine runs decode, with L2 flushed before each replay too.
3. ``--sweep``: a few launch plans per shape (rows per program, splits, warps, stages, TMA),
   each checked against the default plan's output before it is timed.

4. The sparse group (``benchmarks/sparse.py``: sparse decode on the fp8 cache, sparse
   prefill), before the decode shapes; ``--only sparse`` or ``--only decode`` runs one group.

5. Beside FlashMLA's and vLLM's Triton decode whenever they import (``benchmarks.peers``
   unpacks them; ``benchmarks.peer_timing`` calls them as an engine does): their times on the
   same inputs, our time over theirs per shape (eager and graph), and the time of a call with
   default arguments (``mla_decode_paged(q, cache, block_table, lens, scale, causal)``).

Writes ``decode_<date>.json``, ``.md`` and ``.png`` (achieved fraction of the ceilings) into
``--out-dir`` (default ``benchmarks/results/decode``); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import triton
import triton.testing

from benchmarks.common import ceilings, kernel_name, log, report_heading, report_rows, time_graph
from benchmarks.peer_timing import flashmla_decode, vllm_triton_decode
from mla.check.runner import environment
from mla.compare import rel_err
from mla.fast.common import num_sms
from mla.fast.decode import DecodePlan, mla_decode_paged, plan_decode

D, DV = 576, 512
SCALE = 192 ** -0.5  # DeepSeek: 1 / sqrt(qk_nope + qk_rope)


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    B: int
    L: int
    N: int
    s_q: int = 1
    causal: bool = False
    bound: str = "memory"  # which ceiling the target refers to
    target: float = 0.0  # TB/s, TFLOP/s or µs


SHAPES = [
    Shape("N16 B128 L4096", 128, 4096, 16, target=3.2),
    Shape("N16 B64 L16384", 64, 16384, 16, target=3.2),
    Shape("N16 B16 L65536", 16, 65536, 16, target=3.2),
    Shape("N128 B128 L8192 s_q1", 128, 8192, 128, bound="compute", target=400),
    Shape("N128 B64 L8192 s_q2 causal", 64, 8192, 128, s_q=2, causal=True, bound="compute",
          target=400),
    Shape("N128 B1 L4096 latency", 1, 4096, 128, bound="latency", target=50),
]


def make_inputs(s: Shape, gen: torch.Generator):
    bs = 64
    blocks_per = -(-s.L // bs)
    nb = s.B * blocks_per
    perm = torch.randperm(nb, generator=gen, device="cpu").to(torch.int32)
    bt = perm.view(s.B, blocks_per).cuda()
    kv = torch.randn(nb, bs, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(s.B, s.s_q, s.N, D, device="cuda", dtype=torch.bfloat16)
    sl = torch.full((s.B,), s.L, dtype=torch.int32, device="cuda")
    return q, kv, bt, sl


def work(s: Shape) -> tuple[float, float]:
    flops = 2.0 * s.N * s.s_q * s.L * (D + DV) * s.B
    nbytes = (s.B * s.L * D * 2 + s.B * s.s_q * s.N * (D + DV) * 2 + s.B * s.N * s.s_q * 4)
    return flops, nbytes


def candidate_plans(s: Shape, default: DecodePlan) -> list[DecodePlan]:
    """Phase 1 of the sweep: warp/stage/TMA/tile variants at the default split."""
    rep = dataclasses.replace
    plans = [default]
    if s.N * s.s_q <= 32:
        plans += [rep(default, num_warps=8), rep(default, use_tma=True),
                  rep(default, num_stages=3)]
    else:
        tri = rep(default, sm90=False)  # the Triton kernel, against the Gluon sm_90 one
        plans += [tri, rep(tri, use_tma=False), rep(tri, num_stages=3), rep(tri, block_n=32)]
    out = []
    for p in plans:
        if p not in out:
            out.append(p)
    return out


def split_plans(s: Shape, best: DecodePlan) -> list[DecodePlan]:
    """Phase 2: the best phase-1 plan at other split counts."""
    k = best.num_splits
    ks = {1, max(1, k // 2), 2 * k, k + k // 2}
    if s.B == 1:
        ks |= {8, 16, 32, 64}
    return [dataclasses.replace(best, num_splits=x) for x in sorted(ks) if x != k]


def bench_shape(s: Shape, ceil: dict[str, float], sweep: bool, seed: int) -> dict:
    q, kv, bt, sl = make_inputs(s, torch.Generator().manual_seed(seed))
    default = plan_decode(s.B, s.s_q, s.N, D, DV, bt.shape[1], kv.shape[1], q.dtype,
                          num_sms(q.device))
    flops, nbytes = work(s)
    ref_out = None
    rows = []

    def time_plan(plan: DecodePlan) -> None:
        nonlocal ref_out

        def fn(plan=plan):
            return mla_decode_paged(q, kv, bt, sl, SCALE, s.causal, DV, validate=False,
                                    plan=plan)
        t0 = time.perf_counter()
        try:
            out, _ = fn()
            torch.cuda.synchronize()
        except Exception as e:  # a plan that does not compile or launch: report, go on
            log(f"  {s.name}: {plan} failed: {type(e).__name__}: {str(e)[:300]}")
            rows.append({"plan": dataclasses.asdict(plan), "error": str(e)[:1000]})
            return
        compile_s = time.perf_counter() - t0
        if ref_out is None:
            ref_out = out
        err = rel_err(out.float(), ref_out.float())
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        ms_graph = time_graph(fn)
        best = min(ms, ms_graph)
        row = {"plan": dataclasses.asdict(plan), "default": plan == default,
               "us": ms * 1e3, "us_graph": ms_graph * 1e3,
               "TBps": nbytes / (best * 1e-3) / 1e12, "TFLOPs": flops / (best * 1e-3) / 1e12,
               "rel_err_vs_default": err, "compile_s": compile_s}
        row["frac_bw"] = row["TBps"] / ceil["copy_TBps"]
        row["frac_flops"] = row["TFLOPs"] / ceil["matmul_TFLOPs"]
        rows.append(row)
        log(f"  {s.name}: {plan} -> {row['us']:.1f} us eager, {row['us_graph']:.1f} us graph, "
            f"{row['TBps']:.2f} TB/s, {row['TFLOPs']:.0f} TFLOP/s, err {err:.1e}")
    if not sweep:
        time_plan(default)
    else:
        for plan in candidate_plans(s, default):
            time_plan(plan)
        ok = [r for r in rows if "error" not in r and r["rel_err_vs_default"] < 1e-2]
        best1 = min(ok, key=lambda r: min(r["us"], r["us_graph"]))
        for plan in split_plans(s, DecodePlan(**best1["plan"])):
            time_plan(plan)
    timed = [r for r in rows if "error" not in r]
    valid = [r for r in timed if r["rel_err_vs_default"] < 1e-2]
    best = min(valid, key=lambda r: min(r["us"], r["us_graph"]))
    dflt = timed[0]
    # the call a user writes first: default arguments (no plan, no validate), timed eagerly
    dflt["us_default_args"] = triton.testing.do_bench(
        lambda: mla_decode_paged(q, kv, bt, sl, SCALE, s.causal, DV), warmup=25, rep=100,
        return_mode="median") * 1e3
    return {"shape": dataclasses.asdict(s), "flops": flops, "bytes": nbytes,
            "default": dflt, "best": best, "variants": rows,
            "peers": time_peers(s, q, kv, bt, sl, ref_out, dflt)}


def time_peers(s: Shape, q, kv, bt, sl, ours: torch.Tensor, dflt: dict) -> dict:
    """FlashMLA's and vLLM's Triton decode on the same inputs: their times, their distance
    from our output, and our time over theirs (eager against eager, graph against graph)."""
    res = {}
    for name, build in (("FlashMLA", flashmla_decode), ("vLLM Triton", vllm_triton_decode)):
        calls = build(q, kv, bt, sl, SCALE, s.causal, DV)
        if calls is None:
            continue
        try:
            out, _ = calls["kernel"]()
            torch.cuda.synchronize()
        except Exception as e:  # a peer that refuses the shape: report, go on
            log(f"  {s.name}: {name} failed: {type(e).__name__}: {str(e)[:300]}")
            res[name] = {"error": str(e)[:1000]}
            continue
        r = {"rel_err_vs_ours": rel_err(out.float(), ours.float()),
             "us": triton.testing.do_bench(calls["kernel"], warmup=25, rep=100,
                                           return_mode="median") * 1e3}
        try:
            r["us_graph"] = time_graph(calls["kernel"]) * 1e3
        except RuntimeError as e:  # vLLM's Triton decode copies a host scalar: not capturable
            log(f"  {s.name}: {name} cannot be captured in a CUDA graph: {str(e)[:200]}")
            r["us_graph"] = float("nan")
        if "direct" in calls:
            r["us_direct"] = triton.testing.do_bench(calls["direct"], warmup=25, rep=100,
                                                     return_mode="median") * 1e3
        r["ours_over_peer"] = dflt["us"] / r["us"]
        r["ours_over_peer_graph"] = dflt["us_graph"] / r["us_graph"]
        if "us_direct" in r:
            r["ours_default_args_over_peer_direct"] = dflt["us_default_args"] / r["us_direct"]
        log(f"  {s.name}: {name} {r['us']:.1f} us eager, {r['us_graph']:.1f} us graph; ours / "
            f"{name}: {r['ours_over_peer']:.2f} eager, {r['ours_over_peer_graph']:.2f} graph; "
            f"distance from ours {r['rel_err_vs_ours']:.1e}")
        res[name] = r
    return res


def metric(r: dict, s: dict) -> tuple[float, bool]:
    if s["bound"] == "memory":
        return r["TBps"], r["TBps"] >= s["target"]
    if s["bound"] == "compute":
        return r["TFLOPs"], r["TFLOPs"] >= s["target"]
    us = min(r["us"], r["us_graph"])
    return us, us <= s["target"]


def markdown(res: dict) -> str:
    lines = report_heading("Decode benchmark", res) + [
             "| shape | plan (block_m, block_n, splits, warps, stages, tma) | µs eager | "
             "µs graph | TB/s | TFLOP/s | % copy BW | % matmul | target | met |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in res["decode"]:
        s = e["shape"]
        for label, r in report_rows(e):
            p = r["plan"]
            plan = (f"{label} ({kernel_name(p)}): {p['block_m']}, {p['block_n']}, "
                    f"{p['num_splits']}, {p['num_warps']}, {p['num_stages']}, "
                    f"{int(p['use_tma'])}")
            unit = {"memory": "TB/s", "compute": "TFLOP/s", "latency": "µs"}[s["bound"]]
            _, met = metric(r, s)
            lines.append(
                f"| {s['name']} | {plan} | {r['us']:.1f} | {r['us_graph']:.1f} | "
                f"{r['TBps']:.2f} | {r['TFLOPs']:.0f} | {100 * r['frac_bw']:.0f}% | "
                f"{100 * r['frac_flops']:.0f}% | {'≥' if unit != 'µs' else '≤'} "
                f"{s['target']:g} {unit} | {'yes' if met else 'no'} |")
    lines += ["", "Beside other kernels, same inputs (ours: the default plan; a default-arguments "
              "call is `mla_decode_paged(q, cache, block_table, lens, scale, causal)`):", "",
              "| shape | ours µs (eager / graph) | ours, default arguments µs | peer | peer µs "
              "(eager / graph / direct) | ours / peer (eager / graph) | default call / peer "
              "direct | distance |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in res["decode"]:
        d = e["default"]
        for name, r in e.get("peers", {}).items():
            if "error" in r:
                lines.append(f"| {e['shape']['name']} | | | {name} | error: "
                             f"{r['error'][:80]} | | | |")
                continue
            direct = f" / {r['us_direct']:.1f}" if "us_direct" in r else ""
            dratio = (f"{r['ours_default_args_over_peer_direct']:.2f}"
                      if "us_direct" in r else "")
            lines.append(
                f"| {e['shape']['name']} | {d['us']:.1f} / {d['us_graph']:.1f} | "
                f"{d['us_default_args']:.1f} | {name} | {r['us']:.1f} / {r['us_graph']:.1f}"
                f"{direct} | {r['ours_over_peer']:.2f} / {r['ours_over_peer_graph']:.2f} | "
                f"{dratio} | {r['rel_err_vs_ours']:.1e} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, bw, fl = [], [], []
    for e in res["decode"]:
        names.append(e["shape"]["name"])
        bw.append(e["best"]["frac_bw"])
        fl.append(e["best"]["frac_flops"])
    x = range(len(names))
    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(15, 4.5), width_ratios=(2, 1))
    ax.bar([i - 0.2 for i in x], bw, 0.4, label="fraction of copy bandwidth")
    ax.bar([i + 0.2 for i in x], fl, 0.4, label="fraction of bf16 matmul rate")
    ceil = res["ceilings"]
    ax.axhline(3.2 / ceil["copy_TBps"], color="C0", ls="--", lw=1,
               label="memory-bound target (3.2 TB/s)")
    ax.axhline(400 / ceil["matmul_TFLOPs"], color="C1", ls="--", lw=1,
               label="compute-bound target (400 TFLOP/s)")
    ax.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("achieved / measured ceiling")
    env = res["environment"]
    ax.set_title(f"mla.fast.mla_decode_paged (bf16, page 64), {env.get('gpu', '?')}, "
                 f"{env['date'][:10]}", fontsize=10)
    ax.legend(fontsize=8)
    peers = sorted({n for e in res["decode"] for n, r in e.get("peers", {}).items()
                    if "error" not in r})
    for k, name in enumerate(peers):
        ratios = [e.get("peers", {}).get(name, {}).get("ours_over_peer_graph", float("nan"))
                  for e in res["decode"]]
        w = 0.8 / len(peers)
        ax_r.bar([i - 0.4 + w * (k + 0.5) for i in x], ratios, w, label=name)
    ax_r.axhline(1.0, color="k", lw=1)
    ax_r.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
    ax_r.set_ylabel("our time / their time (CUDA graph)")
    ax_r.set_title("beside other kernels, same inputs (< 1: ours faster)", fontsize=10)
    if peers:
        ax_r.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--out-dir",
                   default=os.path.join(os.path.dirname(__file__), "results", "decode"))
    p.add_argument("--sweep", action="store_true", help="time a few launch plans per shape")
    p.add_argument("--shapes", nargs="*", help="substrings of the shape names to run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("decode", "sparse"),
                   help="one shape group: dense decode, or sparse decode/prefill "
                        "(benchmarks/sparse.py); default both")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA GPU", file=sys.stderr)
        return 2
    env = environment()
    log(f"{env.get('gpu')} torch {env['torch']} triton {env['triton']}")
    log("ceilings ...")
    ceil = ceilings()
    log(f"copy {ceil['copy_TBps']:.2f} TB/s, matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s")
    if args.only != "decode":
        from benchmarks import sparse as sparse_bench

        sparse_bench.run(env, ceil, args.out_dir, args.sweep, args.seed, args.shapes)
    if args.only == "sparse":
        return 0
    shapes = [s for s in SHAPES if not args.shapes or any(k in s.name for k in args.shapes)]
    res = {"environment": env, "ceilings": ceil, "decode": []}
    for s in shapes:
        log(f"{s.name} ...")
        res["decode"].append(bench_shape(s, ceil, args.sweep, args.seed))
        torch.cuda.empty_cache()
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"decode_{env['date'][:10]}")
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(stem + ".md", "w") as f:
        f.write(md)
    plot(res, stem + ".png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
