"""``python -m benchmarks.topk_sweep --out DIR``: ``mla.fast.top_k_per_row`` on the GPU, its sets
against the reference's on random, adversarial and benchmark shapes, and its routes and plans
timed.

- Checks: the fast set equal to ``mla.reference.top_k_per_row``'s (run on the GPU: the same
  plain PyTorch), ``-1`` only after the set, on rows of every kind the kernels treat apart:
  shorter than ``topk``, empty, length 1, ragged starts and ends, all-equal, NaN-heavy,
  ``±inf``, ``±0``, sorted, the top ``2 * topk`` crowded into one narrow range, values planted
  where the estimate samples (it fails: too few survivors), ties overflowing the candidate
  list; bf16 logits; ``topk`` from 1 to past the list; a CUDA graph replay; each case by
  both routes (one launch, three launches). Each line says how many rows took the exact scan
  instead of the candidate list (``survivors``).
- Timing (CUDA-graph replays, L2 flushed by a read: no dirty lines to write back; and direct
  calls, ``triton.testing.do_bench`` medians, with the host's time a call): rows 1 to 256 of
  8K to 128K keys, ``k = 2048``, the default route, each route forced, the three launches
  one by one; two rows where the threshold fails (the scan's cost); ``TopkPlan`` alternatives
  of the one-launch kernel (block, warps, stages, sample) and of the three launches; GB/s of
  the logits read against the copy bandwidth of this run, beside ``torch.topk`` on the
  values. A table on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import signal
import time

import torch
import triton.testing

import mla.reference as ref
from benchmarks.common import capture, ceilings, log, time_graph, time_replays
from mla.conformance.cases.indexer import as_sets
from mla.environment import environment
from mla.fast import topk as fast_topk
from mla.fast.topk import (
    CANDIDATES,
    TopkPlan,
    launches,
    sample_columns,
    survivors,
    top_k_per_row,
)

TOPK = 2048
SHAPES = [(R, W) for W in (8192, 32768, 131072) for R in (1, 32, 128, 256)] + [
    (512, 131072), (1024, 131072)]
ONE = dict(route="one")  # the one-launch kernel at every row count (the default)
TWO = dict(route="two")  # the estimate, then a kernel that marks, lists and selects
THREE = dict(route="three")  # three launches at every row count
ROUTES = [("one", TopkPlan(**ONE)), ("two", TopkPlan(**TWO)), ("three", TopkPlan(**THREE))]
# rows as many as the SMs or more: the default's neighbours, and three launches
PLANS = [TopkPlan(**ONE), TopkPlan(**ONE, fused_min_parts=1), TopkPlan(**ONE, fused_min_parts=3),
         TopkPlan(**ONE, fused_block=2048), TopkPlan(**ONE, fused_stages=4),
         TopkPlan(**ONE, select_maxnreg=0), TopkPlan(**ONE, fused_warps=16),
         TopkPlan(**TWO), TopkPlan(**TWO, two_chunk=65536), TopkPlan(**TWO, fused_warps=4),
         TopkPlan(**ONE, sample_runs=512, sample_run=16),
         TopkPlan(**ONE, fused_part_lists=False), TopkPlan(**THREE), TopkPlan(**THREE, pdl=False)]
# rows fewer than the SMs: the one-launch kernel splits each row over SMs // rows programs
SPLIT_PLANS = [TopkPlan(**ONE), TopkPlan(**ONE, fused_block=2048), TopkPlan(**ONE, fused_warps=16),
               TopkPlan(**ONE, fused_min_parts=4), TopkPlan(**ONE, fused_part_lists=False),
               TopkPlan(**THREE)]
SWEEP_SHAPES = [(32, 131072), (128, 131072), (256, 131072), (128, 32768), (256, 32768), (128, 8192),
                (256, 8192)]


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def _full(R: int, W: int, dev: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(R, dtype=torch.int32, device=dev),
            torch.full((R,), W, dtype=torch.int32, device=dev))


def cases(seed: int = 0):
    """(name, logits, starts, ends, topk) on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    for R, W in SHAPES:
        yield f"random {R}x{W}", randn(R, W), *_full(R, W), TOPK
    R, W = 64, 40000
    ends = torch.randint(0, W + 1, (R,), device="cuda", generator=g)
    starts = (torch.rand(R, device="cuda", generator=g) * ends).long()
    ends[:6] = torch.tensor([0, 1, 2047, 2048, 2049, 8193], device="cuda")
    starts[:6] = torch.tensor([0, 0, 1, 3, 17, 33], device="cuda")
    yield "ragged starts/ends", randn(R, W), starts.int(), ends.int(), TOPK
    x = randn(R, 50000)
    st, en = _full(R, 50000)
    for k in (1, 7, 100, 4096, 5000, 9000):
        yield f"topk={k}", x, st, en, k
    yield "topk > W", randn(4, 1000), *_full(4, 1000), TOPK
    x = torch.full((16, 32768), 1.5, device="cuda")
    yield "all equal", x, *_full(16, 32768), TOPK
    x = randn(16, 131072)
    x[:8, ::20] = float("nan")  # 6554 NaN, more than k
    x[8:, ::200] = float("nan")  # 656 NaN
    yield "NaN", x, *_full(16, 131072), TOPK
    x = randn(16, 65536)
    x[:4, 1::2] = float("inf")
    x[4:8] = float("-inf")
    x[4:8, ::100] = 1.0
    x[8:12, ::3] = float("-inf")
    x[12:] = float("-inf")
    x[12:, 5] = float("inf")
    yield "+-inf", x, *_full(16, 65536), TOPK
    x = torch.where(randn(8, 65536) > 0, 0.0, -0.0)
    x[:4, ::64] = randn(4, 1024).abs()
    yield "-0/+0", x, *_full(8, 65536), TOPK
    x = randn(8, 131072).sort(dim=1).values
    x[4:] = x[4:].flip(1)
    yield "sorted rows", x, *_full(8, 131072), TOPK
    x = randn(8, 131072)
    top = 5.0 + torch.rand(8, 4096, device="cuda", generator=g) * 1e-5  # one narrow range
    x.scatter_(1, torch.randperm(131072, device="cuda", generator=g)[:4096].expand(8, -1), top)
    yield "top-2k in a narrow range", x, *_full(8, 131072), TOPK
    x = randn(8, 131072)
    sampled = sample_columns(131072).cuda()
    x[:, sampled] = 100.0 + randn(8, len(sampled))
    yield "values planted at the sample (too few survive)", x, *_full(8, 131072), TOPK
    x = randn(8, 131072)
    x[:, 1::2] = 3.0  # 65536 equal keys at the boundary: the list overflows
    yield "boundary ties overflow the list", x, *_full(8, 131072), TOPK
    yield "bf16", randn(16, 32768).bfloat16(), *_full(16, 32768), TOPK


def check(name: str, logits, starts, ends, topk, plan: TopkPlan, route: str) -> dict:
    got = top_k_per_row(logits, starts, ends, topk, plan=plan)
    want = ref.top_k_per_row(logits.float(), starts, ends, topk)
    same = torch.equal(as_sets(got), as_sets(want))
    kept = (got >= 0).sum(1)
    packed = torch.equal(got >= 0, torch.arange(topk, device="cuda")[None, :] < kept[:, None])
    work, steps = launches(logits.float().contiguous(), starts, ends,
                           torch.empty_like(got), topk, plan)
    _run(steps)
    n = (ends.long().clamp(max=logits.shape[1]) - starts.long().clamp(min=0)).clamp(min=0)
    cap = CANDIDATES
    s = survivors(work).long()
    filtered = n > cap
    listed = filtered & (s >= topk) & (s <= cap)
    row = {"case": name, "route": route, "shape": list(logits.shape), "topk": topk,
           "same_set": same, "packed": packed, "rows": len(n),
           "filtered_rows": int(filtered.sum()),
           "scanned_rows": int((filtered & ~listed).sum()),
           "survivors_min": int(s[filtered].min()) if filtered.any() else None,
           "survivors_max": int(s[filtered].max()) if filtered.any() else None}
    if not same:
        bad = (as_sets(got) != as_sets(want)).any(1).nonzero().flatten().tolist()
        row["bad_rows"] = bad[:10]
    log(f"check {route} {name} {list(logits.shape)} k={topk}: "
        f"{'OK' if same and packed else 'MISMATCH'} (scanned {row['scanned_rows']}/"
        f"{row['filtered_rows']} filtered rows, survivors "
        f"{row['survivors_min']}..{row['survivors_max']})")
    return row


def graph_check(plan: TopkPlan, route: str) -> dict:
    """A CUDA graph captures the call (no sync, no value-dependent launches) and its replay on
    new logits gives the new set."""
    x = torch.randn(8, 65536, device="cuda")
    st, en = _full(8, 65536)
    out = {}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        top_k_per_row(x, st, en, TOPK, plan=plan)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out["v"] = top_k_per_row(x, st, en, TOPK, plan=plan)
    x.copy_(torch.randn_like(x))
    g.replay()
    same = torch.equal(as_sets(out["v"]), as_sets(ref.top_k_per_row(x, st, en, TOPK)))
    log(f"CUDA graph replay {route}: {'OK' if same else 'MISMATCH'}")
    return {"case": "CUDA graph replay", "route": route, "same_set": same}


def _run(steps) -> None:
    for s in steps:
        s()


def replayed(x: torch.Tensor, st: torch.Tensor, en: torch.Tensor, plan: TopkPlan,
             reps: int = 30) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launches captured in a CUDA graph: median ms of ``reps`` replays (L2 flushed by a
    read), the first run's sets (``as_sets``), ``out`` of one more replay after ``-7``
    everywhere (a launch that works only once leaves it so), and the scratch."""
    out = torch.empty(x.shape[0], TOPK, dtype=torch.int32, device="cuda")
    work, steps = launches(x, st, en, out, TOPK, plan)  # kept: the scratch lives on
    g = capture(functools.partial(_run, steps))
    first = as_sets(out)
    ms = time_replays(g, reps=reps, read_flush=True)
    out.fill_(-7)
    g.replay()
    torch.cuda.synchronize()
    return ms, first, out, work


def _graph_ms(x, st, en, plan: TopkPlan, reps: int = 30) -> float:
    """``replayed``'s time; raises if the replay after the timing wrote another set than the
    first run (a launch that works only once would time less)."""
    ms, first, out, _work = replayed(x, st, en, plan, reps)
    if not torch.equal(as_sets(out), first):
        raise RuntimeError(f"{plan}: a replay of the launches wrote another set than the first run")
    return ms


def _split_times(x, st, en, plan: TopkPlan, reps: int = 30) -> dict:
    """The three launches one by one (graphs of the first 1, 2, 3): what each kernel costs."""
    out = torch.empty(x.shape[0], TOPK, dtype=torch.int32, device="cuda")
    _, steps = launches(x, st, en, out, TOPK, plan)
    upto = [time_graph(functools.partial(_run, steps[:i + 1]), reps=reps, read_flush=True)
            for i in range(len(steps))]
    names = ["estimate_ms", "filter_ms", "select_ms"]
    times = {n: upto[i] - (upto[i - 1] if i else 0.0) for i, n in enumerate(names)}
    # the select alone, on the list the first two left (it changes nothing they wrote)
    times["select_alone_ms"] = time_graph(steps[2], reps=reps, read_flush=True)
    return times


def _host_us(fn, calls: int = 100) -> float:
    """Host time of a call (Python and the launches), the GPU left to queue behind."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def _pct(R: int, W: int, ms: float, copy_tbps: float) -> float:
    """The logits' bytes read at ``ms`` against the copy bandwidth, in %."""
    return 100 * R * W * 4 / (ms * 1e-3) / (copy_tbps * 1e12)


def timing(copy_tbps: float) -> list[dict]:
    """Per shape: the default call direct (validated: its host sync included) and unvalidated,
    its host time, and each route in a CUDA graph."""
    rows = []
    for R, W in SHAPES:
        x = torch.randn(R, W, device="cuda")
        st, en = _full(R, W)
        call = functools.partial(top_k_per_row, x, st, en, TOPK)
        quiet = functools.partial(top_k_per_row, x, st, en, TOPK, validate=False)
        row = {"R": R, "L": W, "route": TopkPlan().route_for(R, W, x.device),
               "ms": _bench(call), "unvalidated_ms": _bench(quiet),
               "host_us": _host_us(quiet), "validated_host_us": _host_us(call),
               "graph_ms": _graph_ms(x, st, en, TopkPlan()),
               "one_graph_ms": _graph_ms(x, st, en, TopkPlan(**ONE)),
               "two_graph_ms": _graph_ms(x, st, en, TopkPlan(**TWO)),
               "three_graph_ms": _graph_ms(x, st, en, TopkPlan(**THREE)),
               **_split_times(x, st, en, TopkPlan(**THREE))}
        row["torch_topk_values_ms"] = _bench(functools.partial(torch.topk, x, TOPK, dim=1))
        # the floor of one read of the logits at this shape: a row maximum in a graph
        row["read_floor_ms"] = time_graph(functools.partial(torch.amax, x, dim=1), reps=30,
                                           read_flush=True)
        for k in ("ms", "unvalidated_ms", "graph_ms", "one_graph_ms", "two_graph_ms",
                  "three_graph_ms"):
            row[k.replace("ms", "pct_copy")] = _pct(R, W, row[k], copy_tbps)
        rows.append(row)
        log(f"time R={R} L={W} (route {row['route']}): direct {row['ms'] * 1e3:.1f} us "
            f"(unvalidated {row['unvalidated_ms'] * 1e3:.1f}, host {row['host_us']:.0f} us, "
            f"validated {row['validated_host_us']:.0f}); graph {row['graph_ms'] * 1e3:.1f} us "
            f"({row['graph_pct_copy']:.0f}% of copy); one launch "
            f"{row['one_graph_ms'] * 1e3:.1f}, two {row['two_graph_ms'] * 1e3:.1f}, three "
            f"{row['three_graph_ms'] * 1e3:.1f} "
            f"({row['estimate_ms'] * 1e3:.1f} + {row['filter_ms'] * 1e3:.1f} + "
            f"{row['select_ms'] * 1e3:.1f}, select alone {row['select_alone_ms'] * 1e3:.1f}); "
            f"torch.topk values "
            f"{row['torch_topk_values_ms'] * 1e3:.1f} us, amax {row['read_floor_ms'] * 1e3:.1f}")
        torch.cuda.empty_cache()
    return rows


def sweep(copy_tbps: float, rows: list[dict], save) -> list[dict]:
    """``TopkPlan`` alternatives (CUDA-graph times); each row appended to ``rows`` and saved as
    it comes."""
    for R, W in SWEEP_SHAPES:
        x = torch.randn(R, W, device="cuda")
        st, en = _full(R, W)
        want = as_sets(ref.top_k_per_row(x, st, en, TOPK))
        for plan in PLANS if R >= 96 else SPLIT_PLANS:
            row = {"R": R, "L": W, "plan": dataclasses.asdict(plan), "name": _changed(plan)}
            try:
                got = top_k_per_row(x, st, en, TOPK, plan=plan)
                row["same_set"] = bool(torch.equal(as_sets(got), want))
                row["graph_ms"] = _graph_ms(x, st, en, plan, reps=15)
                row["pct_copy"] = _pct(R, W, row["graph_ms"], copy_tbps)
                log(f"sweep R={R} L={W} {row['name']}: graph {row['graph_ms'] * 1e3:.1f} us, "
                    f"{row['pct_copy']:.0f}% of copy, same set {row['same_set']}")
            except Exception as e:  # a plan that does not compile or fit is a result too
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                log(f"sweep R={R} L={W} {row['name']}: {row['error']}")
            rows.append(row)
            save()
        torch.cuda.empty_cache()
    return rows


def _changed(plan: TopkPlan) -> str:
    """The fields a plan changes from the default (the route by name)."""
    base = dataclasses.asdict(TopkPlan())
    diff = {k: v for k, v in dataclasses.asdict(plan).items() if base[k] != v}
    route = diff.pop("route", "")
    return " ".join([route] * bool(route) + [f"{k}={v}" for k, v in diff.items()]) or "default"


def adversarial_timing() -> list[dict]:
    """The scan's cost where the threshold fails: every key equal (the list overflows), and
    half the row tied at the boundary; by each route."""
    rows = []
    for name, R, W in (("all equal", 128, 32768), ("half the row tied at the boundary", 32,
                                                   131072)):
        x = torch.randn(R, W, device="cuda")
        if name == "all equal":
            x.fill_(1.0)
        else:
            x[:, 1::2] = 3.0
        st, en = _full(R, W)
        for route, plan in ROUTES:
            ms = _graph_ms(x, st, en, plan, reps=10)
            rows.append({"case": name, "route": route, "R": R, "L": W, "graph_ms": ms})
            log(f"time {name} R={R} L={W} {route}: graph {ms * 1e3:.1f} us (the scan)")
    return rows


def compiled_facts() -> list[dict]:
    """Registers, spilled bytes and shared memory of every kernel this run compiled (the
    launchers keep them), one row per kernel and plan."""
    rows, seen = [], set()
    for name in ("_estimate", "_mask", "_select", "_fused", "_mark_select", "_held"):
        for (_dev, key), k in getattr(fast_topk, name).compiled.items():
            plan = key[0] if isinstance(key[0], TopkPlan) else key[0][0]
            row = {"kernel": name.strip("_"), "plan": _changed(plan),
                   "regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None),
                   "shared": getattr(k.metadata, "shared", None)}
            if tuple(row.values()) not in seen:
                seen.add(tuple(row.values()))
                rows.append(row)
    return rows


# the top-k kernels' pointer arguments, as sm90_facts and benchmarks.probes.topk_code_size
# compile them (16-byte aligned)
PTRS = dict(logits="fp32", starts="i32", ends="i32", work="i32", out="i32", words="i32",
            sync="i32", ready="i32", few="i32")


def fused_constants(plan: TopkPlan, split: bool) -> dict:
    """The one-launch kernel's constexprs as ``mla.fast.topk`` launches it for ``plan`` (a row
    split over programs or not)."""
    return dict(OVERSAMPLE=float(plan.oversample), SAMPLE_RUNS=plan.sample_runs,
                RUN=plan.sample_run, CAP=CANDIDATES, SMALL=fast_topk.SMALL,
                TILE=min(plan.select_tile, 1024), BITS=plan.select_bits, BLOCK=plan.fused_block,
                STAGES=plan.fused_stages, SPLIT=split, PART_LISTS=split and plan.fused_part_lists,
                OUT_BLOCK=1024, WORD_TILE=fast_topk.WORD_TILE,
                QUAD_ESTIMATE=plan.estimate_search == "quad",
                QUAD_SELECT=plan.select_search == "quad")


def mark_select_constants(plan: TopkPlan) -> dict:
    """The two launches' second kernel's constexprs for ``plan``."""
    return dict(CAP=CANDIDATES, SMALL=fast_topk.SMALL, TILE=min(plan.select_tile, 1024),
                BITS=plan.select_bits, BLOCK=plan.fused_block, STAGES=plan.fused_stages,
                OUT_BLOCK=1024, WORD_TILE=fast_topk.WORD_TILE, QUAD=plan.select_search == "quad")


def held_constants(plan: TopkPlan, hold: int) -> dict:
    """The held rows' kernel's constexprs for ``plan`` and rows of ``hold`` keys."""
    return dict(CAP=CANDIDATES, HOLD=hold, TILE=min(plan.select_tile, 1024), OUT_BLOCK=1024,
                IN_REGISTERS=plan.held_write == "registers", QUAD=plan.held_search == "quad",
                PREFETCH=plan.held_prefetch and (plan.held_write == "registers"
                                                  or 2 * hold <= CANDIDATES),
                BOUNDED=False, BITS=plan.select_bits, SMALL=fast_topk.SMALL)


def sm90_facts(plans: list[TopkPlan]) -> dict[str, dict]:
    """The one-launch kernel (a row a program, a row split), the two launches' second and the
    kernel of rows held whole (with their columns, in tiles) of each plan compiled for sm_90
    on any machine (no GPU; not under the interpreter), as ``benchmarks.indexer_compile``
    compiles the three launches and as ``mla.fast.topk`` launches them where their programs
    are no more than the SMs (``uncapped``): shared memory, registers, spilled bytes
    (``tests/test_fast_topk.py`` asserts none)."""
    from benchmarks.indexer_compile import _KEYS, _compile
    from benchmarks.sm90_compile import facts
    from mla.fast.topk.fused import _fused_kernel, _mark_select_kernel
    from mla.fast.topk.kernels import _held_kernel

    ptrs = PTRS
    ints = dict(W=_KEYS, topk=TOPK, s_l_r=_KEYS, s_o_r=TOPK, s_w_r=_KEYS // 32, chunk=_KEYS)
    found = {}
    for plan in plans:
        for split in (False, True):
            found[_changed(plan) + " split" * split] = facts(
                _compile(_fused_kernel, fused_constants(plan, split), ptrs, ints,
                         plan.fused_warps, **fast_topk.uncapped(plan.fused_warps)))
        const = mark_select_constants(plan)
        for warps in (plan.fused_warps, plan.two_warps):  # fewer rows, many rows
            for parts in (4, 1):  # rows of 128K, rows of at most two_chunk keys
                found[_changed(plan) + f" two launches, {warps} warps, {parts} parts"] = facts(
                    _compile(_mark_select_kernel, const, ptrs,
                             dict(ints, chunk=plan.two_chunk, parts=parts),
                             warps, **fast_topk.uncapped(warps)))
        for hold in (CANDIDATES // 2, CANDIDATES):  # rows held with their columns, in tiles
            const = held_constants(plan, hold)
            found[_changed(plan) + f" held rows of {hold}"] = facts(
                _compile(_held_kernel, const, ptrs, dict(ints, W=hold), plan.select_warps))
        if plan.held_maxnreg:  # as launched where the rows outnumber the SMs
            found[_changed(plan) + f" held rows of {CANDIDATES}, capped"] = facts(
                _compile(_held_kernel, const, ptrs, dict(ints, W=CANDIDATES),
                         plan.select_warps, maxnreg=plan.held_maxnreg))
        # rows held by a bound on their lengths in wider logits (max_row_len), as launched
        # with few rows and where they outnumber the SMs
        bounded = dict(held_constants(plan, CANDIDATES), PREFETCH=False, BOUNDED=True)
        caps = {"": fast_topk.uncapped(plan.select_warps)}
        if plan.held_maxnreg:
            caps[", capped"] = {"maxnreg": plan.held_maxnreg}
        for suffix, regs in caps.items():
            found[_changed(plan) + f" held rows of {CANDIDATES}, bounded{suffix}"] = facts(
                _compile(_held_kernel, bounded, ptrs, ints, plan.select_warps, **regs))
        # k = 1 and one key, constants in the launch (Triton specializes an int equal to 1)
        found[_changed(plan) + " held rows of 1, k = 1"] = facts(_compile(
            _held_kernel, dict(const, HOLD=32, OUT_BLOCK=1), ptrs,
            dict(ints, W=1, topk=1, s_o_r=1), plan.select_warps))
    return found


def table(res: dict) -> str:
    """The compact summary printed on stdout."""
    lines = [f"copy {res['ceilings']['copy_TBps']:.2f} TB/s; us in CUDA graphs (% of copy)",
             "R x L | default route | graph | one launch | two | three (est+filter+select) | "
             "direct | unvalidated | host | amax (one read)"]
    for r in res["timing"]:
        lines.append(
            f"{r['R']} x {r['L'] // 1024}K | {r['route']} | {r['graph_ms'] * 1e3:.1f} "
            f"({r['graph_pct_copy']:.0f}%) | {r['one_graph_ms'] * 1e3:.1f} | "
            f"{r['two_graph_ms'] * 1e3:.1f} | {r['three_graph_ms'] * 1e3:.1f} "
            f"({r['estimate_ms'] * 1e3:.0f}+"
            f"{r['filter_ms'] * 1e3:.0f}+{r['select_ms'] * 1e3:.0f}; select alone "
            f"{r['select_alone_ms'] * 1e3:.0f}) | {r['ms'] * 1e3:.1f} | "
            f"{r['unvalidated_ms'] * 1e3:.1f} | {r['host_us']:.0f} | "
            f"{r['read_floor_ms'] * 1e3:.1f}")
    shapes = sorted({(r["R"], r["L"]) for r in res["sweep"]}, key=SWEEP_SHAPES.index)
    for R, W in shapes:
        got = [r for r in res["sweep"] if (r["R"], r["L"]) == (R, W) and "graph_ms" in r]
        got.sort(key=lambda r: r["graph_ms"])
        lines.append(f"sweep {R} x {W // 1024}K: " + "; ".join(
            f"{r['name']} {r['graph_ms'] * 1e3:.1f}{'' if r['same_set'] else ' WRONG'}"
            for r in got))
    lines += [f"compiled {c['kernel']} {c['plan']}: {c['regs']} registers, {c['spills']} B "
              f"spilled, {c['shared']} B shared" for c in res["compiled"]]
    bad = [f"{c['case']} ({c['route']})" for c in res["checks"]
           if not (c["same_set"] and c.get("packed", 1))]
    lines.append(f"checks {len(res['checks']) - len(bad)}/{len(res['checks'])} OK; bad: {bad}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.topk_sweep",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "topk"))
    p.add_argument("--only", nargs="*", choices=("check", "time", "sweep"))
    p.add_argument("--sm90", action="store_true",
                   help="only compile the default one-launch kernel (a row a program, a row "
                        "split) for sm_90 (no GPU needed) and print its facts as JSON")
    args = p.parse_args(argv)
    if args.sm90:
        print(json.dumps(sm90_facts([TopkPlan()])))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.topk_sweep needs a CUDA GPU")
    want = set(args.only or ("check", "time", "sweep"))
    env = environment()
    ceil = ceilings()
    log(f"copy {ceil['copy_TBps']:.2f} TB/s")
    res = {"environment": env, "ceilings": ceil, "checks": [], "timing": [], "adversarial": [],
           "sweep": [], "compiled": []}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"topk_sweep_{env['date'][:10]}.json")

    def save() -> None:  # after each part: a run cut short keeps what it measured
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    def stop(*_) -> None:  # a time limit's SIGTERM: the table of what was measured still prints
        raise SystemExit(124)

    signal.signal(signal.SIGTERM, stop)
    try:
        if "check" in want:
            for route, plan in ROUTES:
                res["checks"] += [check(*c, plan, route) for c in cases()]
                res["checks"].append(graph_check(plan, route))
            save()
        if "time" in want:
            res["timing"] = timing(ceil["copy_TBps"])
            save()
        if "sweep" in want:
            sweep(ceil["copy_TBps"], res["sweep"], save)
        if "time" in want:
            res["adversarial"] = adversarial_timing()
            save()
    finally:
        res["compiled"] = compiled_facts()
        save()
        print(table(res), flush=True)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
