"""Sparse top-k MLA benchmark (``python -m benchmarks.run --only sparse``; the fast path's targets).

Shapes (DeepSeek-V3.2: rows of 576, V 512, top-k 2048, 128 heads):

- sparse decode, ``fp8_ds_mla`` cache, B=64 s_q=1 (target 200 TFLOP/s); the same on a bf16
  cache for comparison (no target). Each request owns a 32768-token context (a 1.4 GB fp8
  cache, far past the 60 MB L2) on scattered pages and picks 2048 distinct slots of it.
- sparse prefill, s_q=4096 s_kv=32768 (target 350 TFLOP/s): each query picks 2048 distinct
  rows of a bf16 ``kv [32768, 576]`` (38 MB: the gathers mostly hit L2, as in serving).

FLOPs ``= 2·queries·N·topk·(576 + 512)`` (FlashMLA's count); bytes ``= queries·topk·row``
(every gathered row read once per query; fp8 rows are 656 bytes, bf16 1152) plus q and out.
Time: ``triton.testing.do_bench`` median (L2 flushed before each call); decode also replayed
from a CUDA graph. The default plan's output is compared with the float64 reference on a
slice of the queries; ``--sweep`` times a few more plans, each compared with the default's
output before it counts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import torch
import triton
import triton.testing

from benchmarks.common import kernel_name, log, report_heading, report_rows, time_graph
from mla.compare import rel_err
from mla.fast.common import num_sms
from mla.fast.sparse import SparsePlan, plan_sparse, sparse_mla_decode, sparse_mla_prefill
from mla.reference.fp8 import FP8_DS_MLA_BYTES

D, DV = 576, 512
SCALE = 192 ** -0.5


@dataclasses.dataclass(frozen=True)
class SparseShape:
    name: str
    kind: str  # "decode" or "prefill"
    queries: int  # B (decode, s_q = 1) or s_q (prefill)
    N: int
    topk: int
    context: int  # tokens per request (decode) or s_kv (prefill)
    fp8: bool = False
    target: float = 0.0  # TFLOP/s; 0: no target


SHAPES = [
    SparseShape("sparse decode fp8 B64 N128 topk2048", "decode", 64, 128, 2048, 32768,
                fp8=True, target=200),
    SparseShape("sparse decode bf16 B64 N128 topk2048", "decode", 64, 128, 2048, 32768),
    SparseShape("sparse prefill s_q4096 s_kv32768 N128 topk2048", "prefill", 4096, 128, 2048,
                32768, target=350),
]


def _distinct(rows: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``rows × k`` distinct picks in ``[0, n)`` per row (unsorted), int64, on the GPU."""
    out = torch.empty(rows, k, dtype=torch.long, device="cuda")
    for a in range(0, rows, 512):  # bounded memory for the argsort
        b = min(a + 512, rows)
        out[a:b] = torch.rand(b - a, n, device="cuda", generator=gen).argsort(dim=1)[:, :k]
    return out


def make_inputs(s: SparseShape, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q_shape = (s.queries, 1, s.N, D) if s.kind == "decode" else (s.queries, s.N, D)
    q = torch.randn(q_shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    if s.kind == "prefill":
        kv = torch.randn(s.context, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        idx = _distinct(s.queries, s.context, s.topk, gen).to(torch.int32)
        return q, kv, idx
    page = 64
    pages_per = -(-s.context // page)
    nb = s.queries * pages_per
    perm = torch.randperm(nb, device="cuda", generator=gen).view(s.queries, pages_per)
    local = _distinct(s.queries, s.context, s.topk, gen)  # request-local positions
    slots = perm.gather(1, local // page) * page + local % page
    idx = slots.to(torch.int32).view(s.queries, 1, s.topk)
    if s.fp8:
        cache = torch.randint(0, 256, (nb, page, FP8_DS_MLA_BYTES), device="cuda",
                              dtype=torch.uint8, generator=gen)
        # valid e4m3 bytes (no NaN 0x7F/0xFF), scales 2^-10..2^-7 (|kv_c| <= 3.5), bf16 rope
        cache[..., :512] &= 0xFE
        scales = torch.pow(2.0, -torch.randint(7, 11, (nb, page, 4), device="cuda",
                                               generator=gen).float())
        cache[..., 512:528] = scales.view(torch.uint8).view(nb, page, 16)
        pe = torch.randn(nb, page, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
        cache[..., 528:] = pe.view(torch.uint8).view(nb, page, 128)
    else:
        cache = torch.randn(nb, page, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, cache, idx


def work(s: SparseShape) -> tuple[float, float]:
    flops = 2.0 * s.queries * s.N * s.topk * (D + DV)
    row = FP8_DS_MLA_BYTES if s.fp8 else 2 * D
    nbytes = s.queries * s.topk * (row + 4) + s.queries * s.N * (D + DV) * 2
    return flops, nbytes


def _ref_err(s: SparseShape, q, kv, idx, out, n: int = 128) -> float:
    """Relative error of the first ``n`` queries' output against the float64 reference."""
    from mla.reference.sparse import sparse_mla_decode as ref_decode
    from mla.reference.sparse import sparse_mla_prefill as ref_prefill

    if s.kind == "decode":
        r_out, _ = ref_decode(q[:n].double(), kv if s.fp8 else kv.double(), idx[:n], SCALE,
                              s.fp8)
    else:
        r_out, _, _ = ref_prefill(q[:n].double(), kv.double(), idx[:n], SCALE, DV)
    return rel_err(out[:n], r_out)


def candidate_plans(s: SparseShape, default: SparsePlan) -> list[SparsePlan]:
    rep = dataclasses.replace
    tri = rep(default, sm90=False)  # the Triton kernel, against the Gluon sm_90 one
    plans = [default, tri, rep(tri, block_n=32), rep(tri, num_stages=3),
             rep(tri, block_n=32, num_stages=3)]
    if s.kind == "decode":
        plans += [rep(default, num_splits=2), rep(tri, num_splits=2)]
    if s.kind == "decode" and s.fp8:  # the coupled fp8_ds_mla kernel (a plan choice)
        plans += [rep(default, ds_mla_kernel="staged")]
    if not s.fp8:  # the coupled kernel over rows in q's dtype (a plan choice)
        plans += [rep(default, bf16_kernel="staged")]
        if s.kind == "decode":
            plans += [rep(default, bf16_kernel="staged", num_splits=2)]
    out = []
    for p in plans:
        if p not in out:
            out.append(p)
    return out


def bench_shape(s: SparseShape, ceil: dict[str, float], sweep: bool, seed: int) -> dict:
    q, kv, idx = make_inputs(s, seed)
    default = plan_sparse(s.queries, s.N, s.topk, q.dtype, s.fp8, num_sms(q.device))
    flops, nbytes = work(s)
    rows: list[dict] = []
    ref_out = None

    def time_plan(plan: SparsePlan) -> None:
        nonlocal ref_out

        if s.kind == "decode":
            def fn(plan=plan):
                return sparse_mla_decode(q, kv, idx, SCALE, s.fp8, validate=False, plan=plan)
        else:
            def fn(plan=plan):
                return sparse_mla_prefill(q, kv, idx, SCALE, DV, validate=False, plan=plan)
        t0 = time.perf_counter()
        try:
            out = fn()[0]
            torch.cuda.synchronize()
        except Exception as e:  # a plan that does not compile or launch: report, go on
            log(f"  {s.name}: {plan} failed: {type(e).__name__}: {str(e)[:300]}")
            rows.append({"plan": dataclasses.asdict(plan), "error": str(e)[:1000]})
            return
        compile_s = time.perf_counter() - t0
        row: dict = {"plan": dataclasses.asdict(plan), "default": plan == default,
                     "compile_s": compile_s}
        if ref_out is None:
            ref_out = out
            row["rel_err_vs_reference"] = _ref_err(s, q, kv, idx, out)
        row["rel_err_vs_default"] = rel_err(out.float(), ref_out.float())
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        row["us"] = ms * 1e3
        row["us_graph"] = time_graph(fn) * 1e3 if s.kind == "decode" else row["us"]
        best = min(row["us"], row["us_graph"]) * 1e-6
        row["TFLOPs"] = flops / best / 1e12
        row["TBps"] = nbytes / best / 1e12
        row["frac_flops"] = row["TFLOPs"] / ceil["matmul_TFLOPs"]
        row["frac_bw"] = row["TBps"] / ceil["copy_TBps"]
        rows.append(row)
        log(f"  {s.name}: {plan} -> {row['us']:.1f} us eager, {row['us_graph']:.1f} us graph, "
            f"{row['TFLOPs']:.0f} TFLOP/s, {row['TBps']:.2f} TB/s, "
            f"err {row.get('rel_err_vs_reference', row['rel_err_vs_default']):.1e}")

    for plan in candidate_plans(s, default) if sweep else [default]:
        time_plan(plan)
    timed = [r for r in rows if "error" not in r]
    valid = [r for r in timed if r["rel_err_vs_default"] < 1e-2]
    best = max(valid, key=lambda r: r["TFLOPs"]) if valid else None
    return {"shape": dataclasses.asdict(s), "flops": flops, "bytes": nbytes,
            "default": timed[0] if timed and timed[0]["default"] else None, "best": best,
            "variants": rows}


def markdown(res: dict) -> str:
    lines = report_heading("Sparse MLA benchmark", res) + [
             "| shape | plan (block_m, block_n, splits, warps, stages) | µs eager | µs graph | "
             "TFLOP/s | TB/s | % matmul | % copy BW | err vs ref | target | met |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in res["sparse"]:
        s = e["shape"]
        for label, r in report_rows(e):
            p = r["plan"]
            plan = (f"{label} ({kernel_name(p, s['fp8'])}): {p['block_m']}, {p['block_n']}, "
                    f"{p['num_splits']}, {p['num_warps']}, {p['num_stages']}")
            err = r.get("rel_err_vs_reference")
            met = "-" if not s["target"] else ("yes" if r["TFLOPs"] >= s["target"] else "no")
            target = f"≥ {s['target']:g} TFLOP/s" if s["target"] else "-"
            lines.append(
                f"| {s['name']} | {plan} | {r['us']:.1f} | {r['us_graph']:.1f} | "
                f"{r['TFLOPs']:.0f} | {r['TBps']:.2f} | {100 * r['frac_flops']:.0f}% | "
                f"{100 * r['frac_bw']:.0f}% | {'-' if err is None else f'{err:.1e}'} | "
                f"{target} | {met} |")
        for r in e["variants"]:
            if "error" in r:
                lines.append(f"| {s['name']} | failed: {r['plan']} | {r['error'][:80]} "
                             f"| | | | | | | | |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [e for e in res["sparse"] if e["best"]]
    names = [e["shape"]["name"] for e in entries]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar([i - 0.2 for i in x], [e["best"]["frac_flops"] for e in entries], 0.4,
           label="fraction of bf16 matmul rate")
    ax.bar([i + 0.2 for i in x], [e["best"]["frac_bw"] for e in entries], 0.4,
           label="fraction of copy bandwidth")
    ceil = res["ceilings"]
    for i, e in enumerate(entries):
        if e["shape"]["target"]:
            y = e["shape"]["target"] / ceil["matmul_TFLOPs"]
            ax.plot([i - 0.4, i], [y, y], color="k", ls="--", lw=1)
    ax.set_xticks(list(x), names, rotation=15, ha="right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("achieved / measured ceiling (dashes: target)")
    env = res["environment"]
    ax.set_title(f"mla.fast sparse decode / prefill, {env.get('gpu', '?')}, {env['date'][:10]}",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(env: dict, ceil: dict[str, float], out_dir: str, sweep: bool, seed: int,
        names: list[str] | None = None) -> dict:
    """Benchmark the sparse shapes (``names``: substrings to select) and write
    ``sparse_<date>.json``, ``.md`` and ``.png`` into ``out_dir``."""
    res: dict = {"environment": env, "ceilings": ceil, "sparse": []}
    shapes = [s for s in SHAPES if not names or any(k in s.name for k in names)]
    if not shapes:
        return res
    for s in shapes:
        log(f"{s.name} ...")
        res["sparse"].append(bench_shape(s, ceil, sweep, seed))
        torch.cuda.empty_cache()
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"sparse_{env['date'][:10]}")
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(stem + ".md", "w") as f:
        f.write(md)
    plot(res, stem + ".png")
    print(md)
    return res


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.sparse [--v4] [--only S ...] --out DIR``: the V3.2 shapes (as
    ``benchmarks.run --only sparse``) or, with ``--v4``, DeepSeek-V4's beside FlashMLA
    (``benchmarks.sparse_v4``); JSON and markdown into ``--out``."""
    import argparse

    from benchmarks.common import ceilings
    from benchmarks.sparse_v4 import markdown_v4, run_v4
    from mla.check.registry import environment

    p = argparse.ArgumentParser(prog="python -m benchmarks.sparse", description=main.__doc__)
    p.add_argument("--v4", action="store_true", help="DeepSeek-V4's shapes beside FlashMLA")
    p.add_argument("--only", nargs="*", help="substrings of the shape names to run")
    p.add_argument("--out", default="benchmarks/results", help="output directory")
    p.add_argument("--sweep", action="store_true",
                   help="time more plans (V4: the Gluon MODEL1 kernel at other split counts)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    env = environment()
    ceil = ceilings()
    if not args.v4:
        run(env, ceil, args.out, args.sweep, args.seed, args.only)
        return 0
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"sparse_v4_{env['date'][:10]}")
    res = {"environment": env, "ceilings": ceil, "v4": []}

    def write(rows: list[dict]) -> str:
        res["v4"] = rows
        with open(stem + ".json", "w") as f:
            json.dump(res, f, indent=1)
        md = "\n".join(report_heading("Sparse MLA, DeepSeek-V4", res) + markdown_v4(rows))
        with open(stem + ".md", "w") as f:
            f.write(md + "\n")
        return md

    md = write(run_v4(args.seed, args.only, args.sweep, on_row=write))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
