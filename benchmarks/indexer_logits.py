"""The paged decode logits' routes and plans on the GPU (``python -m benchmarks.indexer_logits
--out DIR``): what each ``LogitsPlan`` variant of ``fp8_paged_mqa_logits`` costs, and that
every route stays the reference's.

- Correctness: each route (``paged_loads`` tma / page / gather) against the float64 reference
  on small caches poisoned with NaN bytes (-1 table entries, lengths off the tiles,
  ``next_n`` 1, 2, 4), the error in ``mla.compare.logits_err``'s measure (over the magnitude:
  the reference with the weights' absolute values) beside the budget (``logits_budget``) and the
  ``-inf`` pattern; and the default call captured in a CUDA graph, replayed on new values.
- Timings: DeepSeek-V3.2's 64 heads of 128 on scattered pages of 64, B in {1, 32, 128},
  ``next_n`` 1, 2 (and 4 at L = 32K), each variant against the default plan's logits
  (``rel_to_default``), TFLOP/s against the fp8 matmul rate and against the roofline
  ``min(fp8 rate, FLOPs/bytes · copy bandwidth)``, both measured in the same run. The
  variants: the previous kernel (per-key gathers, two stages, programs for twice the SMs),
  pointer page tiles, and the tensor-descriptor kernel at other depths and program lengths
  (a one-wave persistent grid was measured and rejected: ``benchmarks/notes/indexer.md``).

Time: the median of CUDA graph replays of one call (``benchmarks.common.time_graph``, L2
flushed before each: the GPU's time, whatever the host's launch costs) and, beside it, the
eager ``triton.testing.do_bench`` median.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os

import torch
import triton
import triton.testing

import mla.reference as ref
from benchmarks.common import ceilings, log, report_heading, time_graph
from benchmarks.indexer import fp8_matmul_tflops, paged_inputs
from mla.compare import logits_err, poison_like, rel_err
from mla.environment import environment
from mla.fast import fp8_paged_mqa_logits
from mla.fast.indexer.logits import logits_budget
from mla.fast.indexer.logits_paged import (
    _RESIDENT,
    PAGED_PLAN,
    WIDE_PAGED_PLAN,
    launch_plan,
    paged_loads,
    paged_plan,
)
from mla.fast.indexer.logits_tile import LogitsPlan

H, D, PAGE = 64, 128, 64

def _library(q8, cache, w, lens, table, width, plan):
    return fp8_paged_mqa_logits(q8, cache, w, lens, table, width, plan=plan)


def _plan(name: str, next_n: int) -> LogitsPlan:
    """The variant's plan (``None``: the default's for ``next_n``, as the library picks)."""
    return VARIANTS[name][0] or paged_plan(next_n)


_SPREAD = LogitsPlan()  # the previous default: 4 programs a SM, at most 16 tiles each

VARIANTS = {  # name: (plan, how it runs)
    "default": (None, _library),  # paged_plan(next_n)
    "spread, 16 tiles (previous default)": (_SPREAD, _library),
    "spread, 32 tiles": (dataclasses.replace(_SPREAD, max_tiles=32), _library),
    "waves, at most 16 tiles": (dataclasses.replace(PAGED_PLAN, max_tiles=16), _library),
    "waves, at most 64 tiles": (dataclasses.replace(PAGED_PLAN, max_tiles=64), _library),
    "waves, page (cp.async)": (dataclasses.replace(PAGED_PLAN, paged_loads="page"), _library),
    "waves, tma, host descriptors": (PAGED_PLAN, _library),
    "waves, tma, in-kernel descriptors": (WIDE_PAGED_PLAN, _library),
    "waves, tma, host descriptors, 3 stages": (dataclasses.replace(PAGED_PLAN, stages=3),
                                               _library),
    "waves, tma, host descriptors, 64 tiles": (
        dataclasses.replace(PAGED_PLAN, paged_loads="tma_host", max_tiles=64), _library),
    "spread, tma, host descriptors": (dataclasses.replace(_SPREAD, paged_loads="tma_host"),
                                      _library),
    "waves, page, 64 tiles": (dataclasses.replace(PAGED_PLAN, paged_loads="page",
                                                  max_tiles=64), _library),
    "waves, tma, 3 stages": (dataclasses.replace(WIDE_PAGED_PLAN, stages=3), _library),
    "waves, tma, 5 stages": (dataclasses.replace(WIDE_PAGED_PLAN, stages=5), _library),
    "waves, page, 3 stages": (dataclasses.replace(PAGED_PLAN, paged_loads="page", stages=3),
                              _library),
    "spread, 8 programs a SM": (dataclasses.replace(_SPREAD, programs_per_sm=8), _library),
    "spread, 1 program a SM, 32 tiles": (dataclasses.replace(_SPREAD, programs_per_sm=1,
                                                             max_tiles=32), _library),
    "spread, page, 8 programs a SM": (dataclasses.replace(_SPREAD, paged_loads="page",
                                                          programs_per_sm=8), _library),
    "gather, 2 stages, 2 programs a SM (the first kernel)": (
        LogitsPlan(paged_loads="gather", stages=2, programs_per_sm=2), _library),
}

SHAPES = [(1, 1, 8192), (1, 1, 131072), (1, 2, 131072), (32, 1, 32768), (32, 2, 32768),
          (32, 4, 32768), (32, 1, 131072), (32, 2, 131072), (128, 1, 32768), (128, 2, 32768),
          (128, 4, 32768), (128, 1, 131072), (128, 2, 131072)]


@triton.jit
def _empty_kernel(x):
    """Nothing: what a graph replay of one Triton launch costs by itself."""


def floor() -> dict:
    """The fixed cost under the B = 1 rows, in graph replays: an empty Triton kernel, and the
    default call on one request of 64 keys (one program of one tile: its launch, the queries'
    and the table's reads, one tile and the store, in a chain), beside B = 1 at 8K and 128K."""
    x = torch.empty(1, device="cuda")
    res = {"empty_kernel_ms": time_graph(lambda: _empty_kernel[(1,)](x))}
    for L in (64, 8192, 131072):
        q8, cache, w, lens, table = paged_inputs(1, 1, L)
        for name, plan in (("default", PAGED_PLAN),
                           ("page", dataclasses.replace(PAGED_PLAN, paged_loads="page")),
                           ("tma", WIDE_PAGED_PLAN)):
            res[f"{name} L={L} ms"] = time_graph(functools.partial(
                fp8_paged_mqa_logits, q8, cache, w, lens, table, L, plan=plan))
    log("floor (graph replays): " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in res.items()))
    return res


def heads_probe() -> list[dict]:
    """Where the time goes: the default call with the queries' first 16 or 32 of the 64 heads
    (a quarter or half of the MMA and of the epilogue, the same cache bytes), graph replays.
    Near the 64-head time: the loads' pipeline bounds the kernel, not its arithmetic."""
    rows = []
    for B, next_n, L in ((32, 1, 32768), (32, 2, 32768), (128, 2, 131072)):
        q8, cache, w, lens, table = paged_inputs(B, next_n, L)
        for heads in (16, 32, 64):
            ms = time_graph(functools.partial(fp8_paged_mqa_logits, q8[:, :, :heads], cache,
                                              w[:, :heads], lens, table, L))
            rows.append({"B": B, "next_n": next_n, "L": L, "heads": heads, "ms": ms})
            log(f"probe B={B} next_n={next_n} L={L} heads={heads}: graph {ms * 1e3:.1f} us")
        del q8, cache, w, lens, table
        torch.cuda.empty_cache()
    return rows


def flush_probe() -> list[dict]:
    """The default call and an empty kernel timed after a written (``time_graph``) and after
    a read L2 flush: what the write-back of the flush's dirty lines adds to each time."""
    x = torch.empty(1, device="cuda")

    def empty() -> None:
        _empty_kernel[(1,)](x)

    rows = [{"what": "empty kernel", "written_ms": time_graph(empty),
             "read_ms": time_graph(empty, read_flush=True)}]
    for B, next_n, L in ((32, 1, 32768), (32, 2, 32768), (128, 2, 131072)):
        q8, cache, w, lens, table = paged_inputs(B, next_n, L)
        run = functools.partial(fp8_paged_mqa_logits, q8, cache, w, lens, table, L)
        rows.append({"what": f"B={B} next_n={next_n} L={L}", "B": B, "next_n": next_n, "L": L,
                     "written_ms": time_graph(run), "read_ms": time_graph(run, read_flush=True)})
        del q8, cache, w, lens, table, run
        torch.cuda.empty_cache()
    for r in rows:
        log(f"flush probe {r['what']}: after a written flush {r['written_ms'] * 1e3:.1f} us, "
            f"after a read flush {r['read_ms'] * 1e3:.1f} us")
    return rows


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def _small_case(seed: int, lens: list[int], next_n: int):
    """A CPU case as the tests build it: keys at shuffled pages of a cache of 0xFF (NaN)
    bytes, unused table entries -1."""
    g = torch.Generator().manual_seed(seed)
    table, nb = ref.make_block_table(lens, PAGE, spare_blocks=1, seed=seed)
    cache = poison_like(torch.empty(nb, PAGE, 132, dtype=torch.uint8))
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        gain = 2.0 ** torch.randint(-4, 5, (n, 1), generator=g)
        k = (torch.randn(n, D, generator=g, dtype=torch.float64) * gain).bfloat16()
        ref.indexer_k_quant_and_cache(k, cache, table[b].long()[pos // PAGE] * PAGE
                                      + pos % PAGE)
    q = torch.randn(len(lens) * next_n, H, D, generator=g, dtype=torch.float64)
    w = torch.randn(len(lens) * next_n, H, generator=g, dtype=torch.float64) * (H * D) ** -0.5
    q8, wq = ref.quantize_indexer_q(q, w)
    return (q8.view(len(lens), next_n, H, D), cache, wq, torch.tensor(lens, dtype=torch.int32),
            table.to(torch.int32))


def correctness(names: list[str]) -> list[dict]:
    """Each variant timed (``names``) against the float64 reference; the default in a CUDA
    graph."""
    rows, budget = [], logits_budget("cuda")
    for seed, (lens, next_n) in enumerate([([5000, 1, 0, 4097], 1), ([3000, 130, 64], 2),
                                           ([2500, 7], 4)]):
        args = _small_case(seed, lens, next_n)
        width = max(lens) + 100
        want = ref.fp8_paged_mqa_logits(args[0], args[1], args[2].double(), *args[3:], width)
        gpu = tuple(a.cuda() for a in args)
        mag = ref.fp8_paged_mqa_logits(args[0], args[1], args[2].double().abs(), *args[3:],
                                       width)
        for name in names:
            plan, runner = _plan(name, next_n), VARIANTS[name][1]
            got = runner(*gpu, width, plan).cpu()
            err = logits_err(got, want, mag)
            same_inf = bool(torch.equal(torch.isneginf(got), torch.isneginf(want)))
            row = {"lens": lens, "next_n": next_n, "variant": name,
                   "route": paged_loads(plan, gpu[1]), "err": err, "budget": budget,
                   "same_neg_inf": same_inf, "ok": err <= budget and same_inf}
            rows.append(row)
            log(f"check lens={lens} next_n={next_n} {name} ({row['route']}): err {err:.2e} "
                f"(budget {budget:.1e}), -inf pattern {'same' if same_inf else 'DIFFERS'}"
                f"{'' if row['ok'] else '  FAIL'}")
        # the default call in a CUDA graph, replayed after the inputs change in place
        q8, cache, w, lens_t, table = gpu
        out = {}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fp8_paged_mqa_logits(q8, cache, w, lens_t, table, width)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out["logits"] = fp8_paged_mqa_logits(q8, cache, w, lens_t, table, width)
        w.mul_(2.0)
        graph.replay()
        torch.cuda.synchronize()
        err = logits_err(out["logits"].cpu(), want * 2, mag * 2)
        ok = err <= budget
        rows.append({"lens": lens, "next_n": next_n, "variant": "default in a CUDA graph",
                     "route": paged_loads(paged_plan(next_n), cache), "err": err,
                     "budget": budget, "same_neg_inf": True, "ok": ok})
        log(f"check lens={lens} next_n={next_n} CUDA graph replay (weights x2): err {err:.2e}"
            f"{'' if ok else '  FAIL'}")
    return rows


def timings(fp8_tflops: float, copy_tbps: float, names: list[str], rows: list[dict],
            save) -> None:
    """Each variant at each shape into ``rows``, ``save()`` after each shape (a run cut short
    keeps what it timed)."""
    for B, next_n, L in SHAPES:
        q8, cache, w, lens, table = paged_inputs(B, next_n, L)
        flops, nbytes, roof = _roofline(B, next_n, L, fp8_tflops, copy_tbps)
        base = fp8_paged_mqa_logits(q8, cache, w, lens, table, L)
        for name in names:
            plan, runner = _plan(name, next_n), VARIANTS[name][1]
            row = {"B": B, "next_n": next_n, "L": L, "variant": name,
                   "plan": dataclasses.asdict(plan), "route": paged_loads(plan, cache),
                   "roofline_TFLOPs": roof}
            try:
                if runner is _library:  # the split it launches: tiles a program, programs
                    _, grid, args, _ = launch_plan(plan, q8, cache, w, lens, table, base)
                    row["split"] = [args[-6], grid[0] * grid[1]]
                run = functools.partial(runner, q8, cache, w, lens, table, L, plan)
                row["rel_to_default"] = rel_err(run(), base)
                row["eager_ms"] = _bench(run)
                ms = time_graph(run)  # the GPU's time, whatever the host's launch costs
                tf = flops / (ms * 1e-3) / 1e12
                row.update(ms=ms, TFLOPs=tf, pct_fp8=100 * tf / fp8_tflops,
                           pct_roofline=100 * tf / roof, GBps=nbytes / (ms * 1e-3) / 1e9,
                           pct_copy=100 * nbytes / (ms * 1e-3) / (copy_tbps * 1e12))
                log(f"B={B} next_n={next_n} L={L} {name}: graph {ms:.3f} ms (eager "
                    f"{row['eager_ms']:.3f}), {tf:.0f} TFLOP/s ({row['pct_fp8']:.0f}% fp8, "
                    f"{row['pct_roofline']:.0f}% of roofline {roof:.0f}), {row['GBps']:.0f} "
                    f"GB/s, vs default {row['rel_to_default']:.1e}")
            except Exception as e:  # a variant that does not compile or fit is a result too
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                log(f"B={B} next_n={next_n} L={L} {name}: {row['error']}")
            rows.append(row)
        del q8, cache, w, lens, table, base
        torch.cuda.empty_cache()
        save()


def _roofline(B: int, next_n: int, L: int, fp8_tflops: float, copy_tbps: float
              ) -> tuple[float, float, float]:
    """(FLOPs, bytes moved, roofline TFLOP/s) of one call: the cache read once, the queries,
    weights and logits."""
    flops = 2 * B * next_n * H * D * L
    nbytes = B * L * 132 + B * next_n * (H * D + H * 4 + L * 4)
    return flops, nbytes, min(fp8_tflops, flops / nbytes * copy_tbps)


def _roof_pct(res: dict, next_n: int) -> float:
    """The roofline at ``next_n`` as % of the fp8 rate (B = 128, L = 128K)."""
    fp8 = res["ceilings"]["fp8_matmul_TFLOPs"]
    return 100 * _roofline(128, next_n, 131072, fp8, res["ceilings"]["copy_TBps"])[2] / fp8


def _floor_line(res: dict) -> str:
    if "floor" not in res:
        return "Fixed floor: not measured in this run."
    f = res["floor"]
    tiny = f["default L=64 ms"]
    parts = [f"B = 1 at {L // 1024}K: {f[f'default L={L} ms'] * 1e3:.1f} us (floor "
             f"{100 * tiny / f[f'default L={L} ms']:.0f}%; page route "
             f"{f[f'page L={L} ms'] * 1e3:.1f} us)" for L in (8192, 131072)]
    return (f"Fixed floor (graph replays): an empty Triton kernel {f['empty_kernel_ms'] * 1e3:.1f}"
            f" us; the default call on one request of 64 keys (one program, one tile) "
            f"{tiny * 1e3:.1f} us (page route {f['page L=64 ms'] * 1e3:.1f}, in-kernel "
            f"descriptors {f['tma L=64 ms'] * 1e3:.1f}); " + "; ".join(parts)
            + ".")


def markdown(res: dict) -> str:
    ceil = res["ceilings"]
    lines = report_heading("Paged indexer logits: routes and plans", res)
    lines[2] = lines[2].rstrip(".") + f", fp8 matmul {ceil['fp8_matmul_TFLOPs']:.0f} TFLOP/s."
    bad = [r for r in res["correctness"] if not r["ok"]]
    worst = max(r["err"] for r in res["correctness"])
    lines += [f"Against the float64 reference (`logits_err`: over the magnitude, the reference "
              f"with |weights|): {len(res['correctness']) - len(bad)}/"
              f"{len(res['correctness'])} checks pass (worst {worst:.2e}, budget "
              f"{res['correctness'][0]['budget']:.1e}).", "",
              "The roofline is min(fp8 rate, FLOPs/bytes · copy bandwidth). At next_n = 1 the "
              "work is ~124 FLOP a byte of cache, so the roofline is "
              f"{_roof_pct(res, 1):.0f}% of the fp8 rate: 50% of fp8 is out of reach there by "
              "construction; next_n = 2 (~248 FLOP/byte, roofline "
              f"{_roof_pct(res, 2):.0f}% of fp8) and 4 can reach it.", "",
              _floor_line(res), "",
              "Heads probe (the default call on the queries' first 16 / 32 / 64 heads: the "
              "same cache bytes, a quarter / half / all of the MMA and epilogue; graph us): "
              + "; ".join(f"B = {B} next_n = {n} L = {L // 1024}K: " + " / ".join(
                  f"{r['ms'] * 1e3:.1f}" for r in res.get("heads_probe", [])
                  if (r["B"], r["next_n"], r["L"]) == (B, n, L))
                  for B, n, L in dict.fromkeys((r["B"], r["next_n"], r["L"])
                                               for r in res.get("heads_probe", []))) + ".", "",
              "L2 flush probe (graph us after time_graph's written flush / after a read flush, "
              "which leaves no dirty lines to write back): " + "; ".join(
                  f"{r['what']}: {r['written_ms'] * 1e3:.1f} / {r['read_ms'] * 1e3:.1f}"
                  for r in res.get("flush_probe", [])) + ".", "",
              "| B | next_n | L | variant | route | graph ms | eager ms | TFLOP/s | % fp8 | "
              "roofline | % roofline | GB/s | vs default |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["timings"]:
        cells = (f"{r['ms']:.3f} | {r['eager_ms']:.3f} | {r['TFLOPs']:.0f} | "
                 f"{r['pct_fp8']:.0f} | {r['roofline_TFLOPs']:.0f} | {r['pct_roofline']:.0f} | "
                 f"{r['GBps']:.0f} | "
                 f"{r['rel_to_default']:.1e}" if "ms" in r else f"{r['error']} | | | | | | |")
        split = f" ({r['split'][1]} x {r['split'][0]} tiles)" if "split" in r else ""
        lines.append(f"| {r['B']} | {r['next_n']} | {r['L']} | {r['variant']}{split} "
                     f"| {r['route']} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.indexer_logits",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "indexer"))
    p.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.indexer_logits needs a CUDA GPU")
    env = environment()
    ceil = ceilings()
    ceil["fp8_matmul_TFLOPs"] = fp8_matmul_tflops()
    log(f"ceilings: copy {ceil['copy_TBps']:.2f} TB/s, fp8 matmul "
        f"{ceil['fp8_matmul_TFLOPs']:.0f} TFLOP/s")
    res = {"environment": env, "ceilings": ceil, "correctness": correctness(args.variants)}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"indexer_logits_{env['date'][:10]}")

    def save() -> None:
        res["resident"] = {f"{k[0].__name__} {dict(k[2])}": v for k, v in _RESIDENT.items()}
        with open(stem + ".json", "w") as f:
            json.dump(res, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(markdown(res))

    res["timings"] = []
    timings(ceil["fp8_matmul_TFLOPs"], ceil["copy_TBps"], args.variants, res["timings"], save)
    for name, probe in (("floor", floor), ("heads_probe", heads_probe),
                        ("flush_probe", flush_probe)):
        try:
            res[name] = probe()
        except Exception as e:  # a diagnostic that fails leaves the timings written
            res[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
            log(f"{name}: {res[f'{name}_error']}")
        save()
    for k, v in res["resident"].items():
        log(f"programs a SM holds: {v}: {k}")
    log(f"wrote {stem}.json / .md")
    return 0 if all(r["ok"] for r in res["correctness"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
