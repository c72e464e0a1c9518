"""The lightning indexer's fast path on the GPU: logits TFLOP/s and top-k GB/s against ceilings
measured in the same run (``python -m benchmarks.indexer --out DIR``).

- Ceilings: copy bandwidth (``benchmarks.common.ceilings``) and the FP8 matmul rate,
  ``torch._scaled_mm`` on 8192³ e4m3 matrices (fast accumulation, as the logits' MMA).
- ``fp8_paged_mqa_logits`` (decode; DeepSeek-V3.2's 64 heads of 128): B in {1, 32, 128},
  next_n 1 and 2, L in {8K, 32K, 128K} keys a request on scattered pages of 64.
  FLOPs ``2·B·next_n·H·128·L``; bytes: the keys' 132 bytes each, q, weights and the logits.
  Next to the FP8 rate, the roofline ``min(fp8 rate, FLOPs/bytes · copy bandwidth)``: at
  decode the keys are read once per ``next_n`` queries, so the kernel is bound by memory.
- ``fp8_mqa_logits`` (prefill, ragged): a chunk of queries at the end of a long request, and
  several short requests; FLOPs over the (query, key) pairs each query sees.
- ``top_k_per_row`` (k = 2048): rows ``B·next_n`` of L logits; bytes the logits read once plus
  the indices; timed as called and in a CUDA graph (the kernels without the host's launch
  cost between them); beside it ``torch.topk`` on int64 keys that pack the order-preserving
  float bits with the inverted column (the same set, ties to the lower index) and plain
  ``torch.topk`` on the values (no tie rule; for orientation).
- Errors: the logits against the float64 reference in ``mla.compare.logits_err``'s measure
  (the error over the magnitude ``k_scale · Σ_h |w_h| · ReLU(q_h · k)``) on a slice of each
  shape, and over 20 seeds on small shapes, beside the budget
  (``mla.fast.indexer.logits.logits_budget``) and the error of the FP8 MMA's accumulator
  emulated on the same inputs (``benchmarks.fp8_mma``, "model").
- ``--sweep``: a few ``LogitsPlan`` tilings and pipeline depths of both logits kernels on two
  decode shapes and one prefill shape, each compared with the default plan's logits.

Time: ``triton.testing.do_bench`` medians (L2 flushed before each call).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os

import torch
import triton.testing

import mla.reference as ref
from benchmarks import fp8_mma
from benchmarks.common import ceilings, log, report_heading, time_graph
from benchmarks.fp8_mma import emulated_logits
from mla.compare import logits_err, rel_err
from mla.conformance.cases.indexer import as_sets
from mla.environment import environment
from mla.fast import fp8_mqa_logits, fp8_paged_mqa_logits, top_k_per_row
from mla.fast.indexer.logits import LogitsPlan, logits_budget

H, D, PAGE, TOPK = 64, 128, 64, 2048
GiB = 1 << 30


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def fp8_matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major
    one = torch.ones((), device="cuda")
    ms = _bench(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                         out_dtype=torch.bfloat16, use_fast_accum=True))
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def _codes(shape: tuple[int, ...]) -> torch.Tensor:
    """Random e4m3 bytes, never NaN (0x7F / 0xFF)."""
    mag = torch.randint(0, 0x7F, shape, dtype=torch.uint8, device="cuda")
    return mag | (torch.randint(0, 2, shape, dtype=torch.uint8, device="cuda") << 7)


def _q(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(rows, H, D, device="cuda", generator=g)
    w = torch.randn(rows, H, device="cuda", generator=g) * (H * D) ** -0.5
    return ref.quantize_indexer_q(q, w)


def paged_inputs(B: int, next_n: int, L: int, seed: int = 0):
    pages = L // PAGE
    nb = B * pages
    cache = torch.empty(nb, PAGE, 132, dtype=torch.uint8, device="cuda")
    flat = cache.view(nb, PAGE * 132)
    flat[:, :PAGE * D] = _codes((nb, PAGE * D))
    flat[:, PAGE * D:].view(torch.float32).copy_(
        torch.rand(nb, PAGE, device="cuda") + 0.5)
    g = torch.Generator(device="cuda").manual_seed(seed)
    table = torch.randperm(nb, device="cuda", generator=g).view(B, pages).to(torch.int32)
    q8, w = _q(B * next_n, seed)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    return q8.view(B, next_n, H, D), cache, w, lens, table


def ragged_errors(got: torch.Tensor, q8: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                  w: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor) -> tuple[float, float]:
    """``logits_err`` of ``got`` and of the emulated FP8 MMA (on ``q8``'s device) against the
    float64 reference (the magnitude: the reference with ``|w|``)."""
    cpu = (q8.cpu(), (kv[0].cpu(), kv[1].cpu()), w.cpu().double(), ks.cpu(), ke.cpu())
    want = ref.fp8_mqa_logits(*cpu)
    mag = ref.fp8_mqa_logits(cpu[0], cpu[1], cpu[2].abs(), *cpu[3:])
    lo, hi = int(ks.min()), int(ke.max())  # the emulation only where some query looks
    model = torch.full_like(want, float("-inf"))
    model[:, lo:hi] = emulated_logits(q8, kv[0][lo:hi], kv[1][lo:hi], w).cpu()
    model = torch.where(torch.isinf(want), want, model)
    return logits_err(got, want, mag), logits_err(model, want, mag)


def paged_errors(got: torch.Tensor, q8: torch.Tensor, cache: torch.Tensor, w: torch.Tensor,
                 lens: torch.Tensor, table: torch.Tensor, width: int) -> tuple[float, float]:
    """As ``ragged_errors`` for the paged logits."""
    cpu = (q8.cpu(), cache.cpu(), w.cpu().double(), lens.cpu(), table.cpu())
    want = ref.fp8_paged_mqa_logits(*cpu, width)
    mag = ref.fp8_paged_mqa_logits(cpu[0], cpu[1], cpu[2].abs(), *cpu[3:], width)
    model = fp8_mma.fp8_paged_mqa_logits(q8, cache, w, lens, table, width).cpu()
    return logits_err(got, want, mag), logits_err(model, want, mag)


def bench_decode(fp8_tflops: float, copy_tbps: float) -> list[dict]:
    rows = []
    for L in (8192, 32768, 131072):
        for B in (1, 32, 128):
            for next_n in (1, 2):
                q8, cache, w, lens, table = paged_inputs(B, next_n, L)
                ms = _bench(functools.partial(fp8_paged_mqa_logits, q8, cache, w, lens, table, L))
                flops = 2 * B * next_n * H * D * L
                nbytes = B * L * 132 + B * next_n * (H * D + H * 4 + L * 4)
                roof = min(fp8_tflops, flops / nbytes * copy_tbps)
                err = model = math.nan  # checked where the cache is small enough (B = 1)
                if B == 1:
                    got = fp8_paged_mqa_logits(q8, cache, w, lens, table, L)
                    err, model = paged_errors(got, q8, cache, w, lens, table, L)
                tf = flops / (ms * 1e-3) / 1e12
                row = {"kernel": "fp8_paged_mqa_logits", "B": B, "next_n": next_n, "L": L,
                       "ms": ms, "TFLOPs": tf, "pct_fp8": 100 * tf / fp8_tflops,
                       "roofline_TFLOPs": roof, "pct_roofline": 100 * tf / roof,
                       "GBps": nbytes / (ms * 1e-3) / 1e9, "err": err, "model_err": model}
                rows.append(row)
                log(f"decode B={B} next_n={next_n} L={L}: {ms:.3f} ms, {tf:.0f} TFLOP/s "
                    f"({row['pct_fp8']:.0f}% of fp8, {row['pct_roofline']:.0f}% of roofline "
                    f"{roof:.0f}), err {_err(err)} (model {_err(model)})")
                torch.cuda.empty_cache()
    return rows


def ragged_inputs(requests: list[int], queries: int, seed: int = 0):
    """Requests of ``requests`` keys in one flat array, each asking with its last
    ``queries`` positions."""
    N = sum(requests)
    codes = _codes((N, D)).view(torch.float8_e4m3fn)
    scale = torch.rand(N, device="cuda") + 0.5
    ks, ke, first = [], [], 0
    for n in requests:
        pos = torch.arange(max(0, n - queries), n, device="cuda")
        ks.append(torch.full_like(pos, first))
        ke.append(first + pos + 1)
        first += n
    ks_t, ke_t = torch.cat(ks).to(torch.int32), torch.cat(ke).to(torch.int32)
    q8, w = _q(len(ks_t), seed)
    return q8, (codes, scale), w, ks_t, ke_t


# ragged prefill shapes (name, request lengths, queries a request: its last positions): one
# long request, and batches of short ones where most (query, key) pairs are other requests'
PREFILL_SHAPES = (
    ("4096 queries of a 32K request", [32768], 4096),
    ("2048 queries of a 64K request", [65536], 2048),
    ("8 requests of 2048, every query", [2048] * 8, 2048),
    ("64 requests of 1000, every query", [1000] * 64, 1000),
    ("16 requests of 40-4000, every query", [100, 4000, 250, 1800, 3000, 64, 900, 2200, 513,
                                             1500, 3700, 40, 2600, 1100, 777, 3333], 4000),
)


def bench_prefill(fp8_tflops: float) -> list[dict]:
    rows = []
    for name, requests, queries in PREFILL_SHAPES:
        q8, kv, w, ks, ke = ragged_inputs(requests, queries)
        ms = _bench(functools.partial(fp8_mqa_logits, q8, kv, w, ks, ke))
        pairs = int((ke - ks).long().sum())
        flops = 2 * pairs * H * D
        sl = (q8[-8:], kv, w[-8:], ks[-8:], ke[-8:])
        err, model = ragged_errors(fp8_mqa_logits(*sl), *sl)
        tf = flops / (ms * 1e-3) / 1e12
        row = {"kernel": "fp8_mqa_logits", "shape": name, "S": len(ks), "N": kv[0].shape[0],
               "ms": ms, "TFLOPs": tf, "pct_fp8": 100 * tf / fp8_tflops, "err": err,
               "model_err": model}
        rows.append(row)
        log(f"prefill {name}: {ms:.3f} ms, {tf:.0f} TFLOP/s ({row['pct_fp8']:.0f}% of fp8), "
            f"err {err:.1e} (model {model:.1e})")
        torch.cuda.empty_cache()
    return rows


SWEEP_PLANS = [LogitsPlan(), LogitsPlan(stages=1), LogitsPlan(stages=3), LogitsPlan(block_n=128),
               LogitsPlan(block_n=128, num_warps=8), LogitsPlan(num_warps=8),
               LogitsPlan(queries=2), LogitsPlan(block_n=128, queries=2)]


def sweep_plans(fp8_tflops: float) -> list[dict]:
    rows = []
    cases = [("decode B=32 next_n=1 L=32K", paged_inputs(32, 1, 32768), 32 * 1 * 32768),
             ("decode B=128 next_n=2 L=32K", paged_inputs(128, 2, 32768), 128 * 2 * 32768),
             ("prefill 4096 queries of 32K", ragged_inputs([32768], 4096), None)]
    for name, args, pairs in cases:
        if pairs is None:
            pairs = int((args[4] - args[3]).long().sum())
            run = functools.partial(fp8_mqa_logits, *args)
        else:
            run = functools.partial(fp8_paged_mqa_logits, *args, 32768)
        base = run()
        for plan in SWEEP_PLANS:
            if not name.startswith("prefill") and plan.queries != 4:
                continue  # queries a program is the prefill kernel's
            row = {"shape": name, "plan": dataclasses.asdict(plan)}
            try:
                out = run(plan=plan)
                row["rel_to_default"] = rel_err(out, base)
                row["ms"] = _bench(functools.partial(run, plan=plan))
                row["TFLOPs"] = 2 * pairs * H * D / (row["ms"] * 1e-3) / 1e12
                row["pct_fp8"] = 100 * row["TFLOPs"] / fp8_tflops
                log(f"sweep {name} {plan}: {row['ms']:.3f} ms, {row['TFLOPs']:.0f} TFLOP/s, "
                    f"vs default {row['rel_to_default']:.1e}")
            except Exception as e:  # a plan that does not compile or fit is a result too
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                log(f"sweep {name} {plan}: {row['error']}")
            rows.append(row)
        torch.cuda.empty_cache()
    return rows


def packed_topk(logits: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, k: int
                ) -> torch.Tensor:
    """``torch.topk`` on int64 keys (order-preserving float bits << 32 | inverted column): the
    reference's set, ties to the lower index (the library route)."""
    R, W = logits.shape
    bits = logits.view(torch.int32)
    bits = torch.where(bits == -(1 << 31), 0, bits)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = torch.where(torch.isnan(logits), 0x7FFFFFFF, key).long()
    cols = torch.arange(W, device=logits.device)
    packed = (key << 32) | (0xFFFFFFFF - cols)
    inside = (cols >= starts[:, None]) & (cols < ends[:, None])
    packed = torch.where(inside, packed, torch.iinfo(torch.int64).min)
    kk = min(k, W)
    top = torch.topk(packed, kk, dim=1, sorted=False).values
    idx = 0xFFFFFFFF - (top & 0xFFFFFFFF) - starts[:, None]
    out = torch.full((R, k), -1, dtype=torch.int32, device=logits.device)
    out[:, :kk] = torch.where(top != torch.iinfo(torch.int64).min, idx, -1).to(torch.int32)
    return out


def bench_topk(copy_tbps: float) -> list[dict]:
    rows = []
    for L in (8192, 32768, 131072):
        for R in (1, 32, 128, 256):
            logits = torch.randn(R, L, device="cuda")
            starts = torch.zeros(R, dtype=torch.int32, device="cuda")
            ends = torch.full((R,), L, dtype=torch.int32, device="cuda")
            nbytes = R * L * 4 + R * TOPK * 4
            row = {"R": R, "L": L}
            args = (logits, starts, ends, TOPK)
            for name, fn in (("triton", functools.partial(top_k_per_row, *args)),
                             ("packed_torch_topk", functools.partial(packed_topk, *args)),
                             ("torch_topk_values", functools.partial(torch.topk, logits,
                                                                     min(TOPK, L), dim=1))):
                ms = _bench(fn)
                row[f"{name}_ms"] = ms
                row[f"{name}_GBps"] = nbytes / (ms * 1e-3) / 1e9
            row["pct_copy"] = 100 * row["triton_GBps"] / (copy_tbps * 1e3)
            # the kernels alone: a CUDA graph has no host launch cost between them
            row["triton_graph_ms"] = time_graph(functools.partial(top_k_per_row, *args))
            row["graph_pct_copy"] = 100 * nbytes / (row["triton_graph_ms"] * 1e-3) / (
                copy_tbps * 1e12)
            few = slice(0, min(R, 4))
            got = top_k_per_row(logits[few], starts[few], ends[few], TOPK)
            want = ref.top_k_per_row(logits[few].cpu(), starts[few].cpu(), ends[few].cpu(),
                                     TOPK)
            packed = packed_topk(logits[few], starts[few], ends[few], TOPK)
            row["same_set"] = bool(torch.equal(as_sets(got), as_sets(want)))
            row["packed_same_set"] = bool(torch.equal(as_sets(packed), as_sets(want)))
            rows.append(row)
            log(f"top-k R={R} L={L}: triton {row['triton_ms']:.3f} ms "
                f"({row['triton_GBps']:.0f} GB/s, {row['pct_copy']:.0f}% of copy; in a graph "
                f"{row['triton_graph_ms']:.3f} ms, {row['graph_pct_copy']:.0f}%), packed "
                f"torch.topk {row['packed_torch_topk_ms']:.3f} ms, torch.topk values "
                f"{row['torch_topk_values_ms']:.3f} ms; sets equal: {row['same_set']} "
                f"(packed {row['packed_same_set']})")
            torch.cuda.empty_cache()
    return rows


def logits_errors(seeds: int = 20) -> dict:
    """Worst and mean ``logits_err`` of both kernels against the float64 reference over
    ``seeds`` draws (DeepSeek-V3.2's 64 heads; bf16 keys of gains 2^±4, q scale folded into w),
    and of the FP8 MMA's accumulator emulated on the same inputs."""
    paged, ragged, model = [], [], []
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        lens = [int(x) for x in torch.randint(1, 3000, (4,), generator=g)]
        table, nb = ref.make_block_table(lens, PAGE, spare_blocks=1, seed=seed)
        cache = torch.zeros(nb, PAGE, 132, dtype=torch.uint8)
        for b, n in enumerate(lens):
            pos = torch.arange(n)
            gain = 2.0 ** torch.randint(-4, 5, (n, 1), generator=g)
            k = (torch.randn(n, D, generator=g, dtype=torch.float64) * gain).bfloat16()
            ref.indexer_k_quant_and_cache(k, cache, table[b].long()[pos // PAGE] * PAGE
                                          + pos % PAGE)
        table = table.clamp_min(0).to(torch.int32)
        q = torch.randn(8, H, D, generator=g, dtype=torch.float64)
        w = torch.randn(8, H, generator=g, dtype=torch.float64) * (H * D) ** -0.5
        q8, wq = ref.quantize_indexer_q(q, w)
        args = (q8.view(4, 2, H, D).cuda(), cache.cuda(), wq.cuda(),
                torch.tensor(lens, dtype=torch.int32).cuda(), table.cuda())
        err, emulated = paged_errors(fp8_paged_mqa_logits(*args, max(lens)), *args, max(lens))
        paged.append(err)
        model.append(emulated)
        codes, scale = ref.read_indexer_k_cache(cache, (table[0].long()[torch.arange(
            lens[0]) // PAGE] * PAGE + torch.arange(lens[0]) % PAGE))
        ks = torch.zeros(8, dtype=torch.int32)
        ke = torch.tensor([max(1, lens[0] - 7 + i) for i in range(8)], dtype=torch.int32)
        sl = (q8.cuda(), (codes.cuda(), scale.cuda()), wq.cuda(), ks.cuda(), ke.cuda())
        err, emulated = ragged_errors(fp8_mqa_logits(*sl), *sl)
        ragged.append(err)
        model.append(emulated)
    res = {"measure": "logits_err", "seeds": seeds, "paged_worst": max(paged),
           "paged_mean": sum(paged) / seeds, "ragged_worst": max(ragged),
           "ragged_mean": sum(ragged) / seeds, "model_worst": max(model),
           "model_mean": sum(model) / len(model), "budget": logits_budget("cuda")}
    log(f"logits errors (logits_err) over {seeds} seeds: paged worst {res['paged_worst']:.2e} "
        f"(mean {res['paged_mean']:.2e}), ragged worst {res['ragged_worst']:.2e} (mean "
        f"{res['ragged_mean']:.2e}); emulated FP8 MMA worst {res['model_worst']:.2e}; budget "
        f"{res['budget']:.2e}")
    return res


def _err(e: float) -> str:
    return "-" if math.isnan(e) else f"{e:.1e}"  # checked at B = 1 only


def _roof_pct(res: dict, next_n: int) -> float:
    """The decode roofline at ``next_n`` as % of the fp8 rate (the longest rows measured)."""
    rows = [r for r in res["decode"] if r["next_n"] == next_n]
    r = max(rows, key=lambda r: (r["L"], r["B"]))
    return 100 * r["roofline_TFLOPs"] / res["ceilings"]["fp8_matmul_TFLOPs"]


def markdown(res: dict) -> str:
    ceil = res["ceilings"]
    lines = report_heading("Lightning indexer (fp8 logits, top-k)", res)
    lines[2] = lines[2].rstrip(".") + f", fp8 matmul {ceil['fp8_matmul_TFLOPs']:.0f} TFLOP/s."
    e = res["errors"]
    lines += [f"Logits against the float64 reference (`mla.compare.logits_err`: the error "
              "over the magnitude k_scale · Σ_h |w_h| · ReLU(q_h · k)) over "
              f"{e['seeds']} seeds: paged worst {e['paged_worst']:.2e}, ragged worst "
              f"{e['ragged_worst']:.2e}; the FP8 MMA's accumulator emulated on the same inputs "
              f"(`benchmarks.fp8_mma`) worst {e['model_worst']:.2e}; budget {e['budget']:.1e}. "
              "The err columns below are the same measure, model the emulation's.",
              "", "## fp8_paged_mqa_logits (decode, H = 64, pages of 64)", "",
              "The roofline is min(fp8 rate, FLOPs/bytes · copy bandwidth). At next_n = 1 "
              "the work is ~124 FLOP a byte of cache, so the roofline is "
              f"{_roof_pct(res, 1):.0f}% of the fp8 rate: 50% of fp8 is out of reach there by "
              "construction, and the measure is % of roofline; next_n = 2 (~248 FLOP/byte, "
              f"roofline {_roof_pct(res, 2):.0f}% of fp8) can reach 50% of fp8.", "",
              "| B | next_n | L | ms | TFLOP/s | % fp8 | roofline | % roofline | GB/s | err "
              "| model |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["decode"]:
        lines.append(f"| {r['B']} | {r['next_n']} | {r['L']} | {r['ms']:.3f} | "
                     f"{r['TFLOPs']:.0f} | {r['pct_fp8']:.0f} | {r['roofline_TFLOPs']:.0f} | "
                     f"{r['pct_roofline']:.0f} | {r['GBps']:.0f} | {_err(r['err'])} | "
                     f"{_err(r['model_err'])} |")
    lines += ["", "## fp8_mqa_logits (prefill, ragged)", "",
              "| shape | S | N | ms | TFLOP/s | % fp8 | err | model |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["prefill"]:
        lines.append(f"| {r['shape']} | {r['S']} | {r['N']} | {r['ms']:.3f} | "
                     f"{r['TFLOPs']:.0f} | {r['pct_fp8']:.0f} | {r['err']:.1e} | "
                     f"{r['model_err']:.1e} |")
    lines += ["", "## top_k_per_row (k = 2048)", "",
              "| rows | L | Triton ms | GB/s | % copy | in a CUDA graph ms | % copy | packed "
              "torch.topk ms | torch.topk values ms | set = reference |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["topk"]:
        lines.append(f"| {r['R']} | {r['L']} | {r['triton_ms']:.3f} | {r['triton_GBps']:.0f} "
                     f"| {r['pct_copy']:.0f} | {r['triton_graph_ms']:.3f} | "
                     f"{r['graph_pct_copy']:.0f} | {r['packed_torch_topk_ms']:.3f} | "
                     f"{r['torch_topk_values_ms']:.3f} | {r['same_set']} |")
    if res["sweep"]:
        lines += ["", "## Logits plans (--sweep)", "",
                  "| shape | block_n | queries | warps | stages | ms | TFLOP/s | % fp8 "
                  "| vs default |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in res["sweep"]:
            p = r["plan"]
            cells = (f"{r['ms']:.3f} | {r['TFLOPs']:.0f} | {r['pct_fp8']:.0f} | "
                     f"{r['rel_to_default']:.1e}" if "ms" in r else f"{r['error']} | | |")
            lines.append(f"| {r['shape']} | {p['block_n']} | {p['queries']} | "
                         f"{p['num_warps']} | {p['stages']} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.indexer",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "indexer"))
    p.add_argument("--only", nargs="*", choices=("errors", "decode", "prefill", "topk"))
    p.add_argument("--sweep", action="store_true", help="time LogitsPlan alternatives")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.indexer needs a CUDA GPU")
    env = environment()
    ceil = ceilings()
    ceil["fp8_matmul_TFLOPs"] = fp8_matmul_tflops()
    log(f"ceilings: copy {ceil['copy_TBps']:.2f} TB/s, fp8 matmul "
        f"{ceil['fp8_matmul_TFLOPs']:.0f} TFLOP/s, bf16 matmul {ceil['matmul_TFLOPs']:.0f}")
    want = set(args.only or ("errors", "decode", "prefill", "topk"))
    res = {"environment": env, "ceilings": ceil,
           "errors": logits_errors() if "errors" in want else {},
           "decode": bench_decode(ceil["fp8_matmul_TFLOPs"], ceil["copy_TBps"])
           if "decode" in want else [],
           "prefill": bench_prefill(ceil["fp8_matmul_TFLOPs"]) if "prefill" in want else [],
           "topk": bench_topk(ceil["copy_TBps"]) if "topk" in want else [],
           "sweep": sweep_plans(ceil["fp8_matmul_TFLOPs"]) if args.sweep else []}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"indexer_{env['date'][:10]}")
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    if res["errors"] and res["decode"] and res["prefill"] and res["topk"]:
        with open(stem + ".md", "w") as f:
            f.write(markdown(res))
    log(f"wrote {stem}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
