"""``python -m benchmarks.topk_peers [--lib PATH] --out DIR``: ``mla.fast.top_k_per_row`` beside
vLLM's top-k kernels for the DeepSeek-V3.2 indexer, on one GPU, timed the same way.

vLLM 0.33 selects an indexer row's ``k`` best with one of several CUDA kernels (its
``vllm/model_executor/layers/indexer_topk.py``): ``cooperative_topk`` (the default up to 64
rows, on sm_90 and later), ``persistent_topk`` (the default past 64 rows) and
``top_k_per_row_decode`` (the older radix select, one block a row), all in the wheel's
``vllm/_C_stable_libtorch.abi3.so``. ``python -m benchmarks.peers --topk`` writes that
library for sm_90 alone, compressed (26 MB: small enough to travel to a GPU machine whose
uploads are capped); ``mla.conformance.adapters.vllm_library.load_library`` loads it (``--lib``,
else the peers directory's), the same library that adapter checks against the conformance
catalogue.

``--serving``: decode rows of 4K and 8K keys in logits 64K wide (vLLM sizes the decode logits
to ``max_model_len`` and hands its top-k kernels the batch's longest row), ours with and
without that bound (``max_row_len``), vLLM's with it (``max_seq_len``).

Per shape (rows x keys, ``k = 2048``, random normal float32 logits, every row whole):
CUDA-graph replays with the L2 flushed by a read before each (``benchmarks.common``), median
ms, and the logits' bytes read against the copy bandwidth measured in the same run. Each
peer's answer is checked before it is timed: indices in the row, none repeated, and the
values they pick, sorted, equal to ``torch.topk``'s (any correct top-k picks the same values;
which of tied keys it takes may differ, so the check does not compare indices). A peer that
fails to load, refuses a shape or answers wrongly is recorded as such and not timed.

Nothing here is imported by ``mla``: the peers are measured here, never called by
``mla.fast``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.common import capture, ceilings, log, time_replays
from mla.conformance.adapters.vllm_library import load_library
from mla.conformance.adapters.vllm_topk import COOPERATIVE_MAX_ROWS, WORKSPACE_BYTES
from mla.conformance.catalogue import Unsupported
from mla.environment import environment
from mla.fast.topk import CANDIDATES, TopkPlan, launches

TOPK = 2048
SHAPES = [(1, 131072), (32, 131072), (64, 131072), (128, 131072), (256, 131072),
          (512, 131072), (1024, 131072), (128, 32768), (256, 32768), (2048, 32768),
          (128, 8192), (256, 8192)]
# the decode lengths (--short; 8193: a decode row of 8K + 1, past the rows held whole)
SHORT_SHAPES = [(R, W) for W in (8192, 8193, 16384, 32768) for R in (1, 32, 128, 256)]
# --serving: decode rows of 4K and 8K keys in logits 64K wide (vLLM sizes them to
# max_model_len and hands its kernels the batch's longest row, max_seq_len)
SERVING_SHAPES = [(R, 65536, L) for L in (4096, 8192) for R in (1, 32, 128, 256)]
# rows held whole (at most CANDIDATES keys), beside the default (8 warps, the columns written
# from the held keys, the quad search, registers capped where the rows outnumber the SMs, the
# row prefetched): the columns by a second read in tiles, the bracket search, 16 warps, the
# registers uncapped (one program a SM), and the row's range read before its keys
HELD_PLANS = {"mla_fast_held_tiles": TopkPlan(held_write="tiles"),
              "mla_fast_held_bracket": TopkPlan(held_search="bracket"),
              "mla_fast_16w": TopkPlan(select_warps=16),
              "mla_fast_held_uncapped": TopkPlan(held_maxnreg=0),
              "mla_fast_held_no_prefetch": TopkPlan(held_prefetch=False)}
# rows longer than CANDIDATES: the estimate's and the select's searches by _quad_search, and
# with both, a sample of half the rank (fewer keys to load and search, more survivors) and
# marking steps of 2048 keys (more parts a row)
QUAD = TopkPlan(estimate_search="quad", select_search="quad")
LONG_PLANS = {"mla_fast_estimate_quad": TopkPlan(estimate_search="quad"),
              "mla_fast_select_quad": TopkPlan(select_search="quad"),
              "mla_fast_quad": QUAD,
              "mla_fast_quad_rank64": dataclasses.replace(QUAD, sample_rank=64),
              "mla_fast_quad_block2048": dataclasses.replace(QUAD, fused_block=2048)}


def load_vllm(lib: Path | None) -> dict:
    """vLLM's library loaded (``mla.conformance.adapters.vllm_library.load_library``: ``lib``,
    else the peers directory's); what loaded and how, or why not."""
    try:
        return {"loaded": True, **load_library(lib)}
    except Unsupported as e:
        return {"loaded": False, "error": str(e)}


def peer_calls(x: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor,
               max_seq_len: int | None = None) -> dict:
    """The peers' calls on ``x`` (``[R, W]``, rows of ``lengths``, none longer than
    ``max_seq_len``, by default ``W``), each writing ``out``."""
    R, W = x.shape
    longest = W if max_seq_len is None else max_seq_len
    work = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=x.device)
    calls = {
        "vllm_persistent_topk": lambda: torch.ops._C.persistent_topk(
            x, lengths, out, work, TOPK, longest),
        "vllm_top_k_per_row_decode": lambda: torch.ops._C.top_k_per_row_decode(
            x, 1, lengths, out, R, x.stride(0), x.stride(1), TOPK),
    }
    if R <= COOPERATIVE_MAX_ROWS:
        calls["vllm_cooperative_topk"] = lambda: torch.ops._C.cooperative_topk(
            x, lengths, out, work, TOPK, longest)
    calls["_work"] = work  # kept alive while the graphs replay
    return calls


def check(x: torch.Tensor, idx: torch.Tensor, best: torch.Tensor) -> str | None:
    """``None`` if ``idx`` (``[R, k]``) holds a correct top-k of every row of ``x`` (its
    columns: the rows' keys), else what is wrong. ``best``: ``torch.topk``'s values, sorted
    down."""
    R, W = x.shape
    idx = idx.long()
    if bool(((idx < 0) | (idx >= W)).any()):
        return f"indices outside [0, {W}): {int(((idx < 0) | (idx >= W)).sum())}"
    s = idx.sort(dim=1).values
    if bool((s[:, 1:] == s[:, :-1]).any()):
        return "an index repeated within a row"
    picked = x.gather(1, idx).sort(dim=1, descending=True).values
    wrong = (picked != best).any(dim=1)
    if bool(wrong.any()):
        return f"{int(wrong.sum())} of {R} rows pick other values than torch.topk"
    return None


def timed(fn, out: torch.Tensor, x: torch.Tensor, best: torch.Tensor, reps: int) -> dict:
    """``fn`` checked on its first run, then its graph's replays timed and checked again."""
    try:
        out.fill_(-7)
        torch.cuda.synchronize()
        g = capture(fn)  # runs fn once outside the graph, then captures it
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a peer's refusal is a result
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    wrong = check(x, out, best)
    if wrong:
        return {"wrong": wrong}
    ms = time_replays(g, reps=reps, read_flush=True)
    out.fill_(-7)
    g.replay()
    torch.cuda.synchronize()
    wrong = check(x, out, best)
    return {"ms": ms, **({"wrong_after_replay": wrong} if wrong else {})}


def _plans(W: int, L: int) -> dict:
    """The plans timed on rows of ``L`` keys in logits ``W`` wide, each with the bound on the
    rows' lengths it is given (``max_row_len``): the default, then the alternatives of its
    row length; rows shorter than the logits, the default given ``L`` as the bound."""
    if L < W:
        return {"mla_fast": (TopkPlan(), None), "mla_fast_bounded": (TopkPlan(), L)}
    extra = HELD_PLANS if W <= CANDIDATES else LONG_PLANS
    return {"mla_fast": (TopkPlan(), None), **{n: (p, None) for n, p in extra.items()}}


def _shape(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``(R, W)`` or ``(R, W, L)`` as ``(R, W, L)``: rows of ``L`` keys (``W`` by default)."""
    return (*shape, shape[1]) if len(shape) == 2 else shape  # type: ignore[return-value]


def _inputs(R: int, W: int, L: int) -> tuple[torch.Tensor, ...]:
    """Random logits ``[R, W]`` whose rows hold ``L`` keys (``-inf`` past them), the rows'
    starts and ends, and the output."""
    torch.manual_seed(R * 7 + W + L)
    x = torch.randn(R, W, device="cuda")
    x[:, L:] = float("-inf")
    lengths = torch.full((R,), L, dtype=torch.int32, device="cuda")
    starts = torch.zeros(R, dtype=torch.int32, device="cuda")
    return x, starts, lengths, torch.empty(R, TOPK, dtype=torch.int32, device="cuda")


def _compile_shape(shape: tuple[int, ...]) -> None:
    """Every plan's kernels for one shape compiled (and run once), into the Triton cache."""
    R, W, L = _shape(shape)
    x, starts, lengths, out = _inputs(R, W, L)
    for plan, bound in _plans(W, L).values():
        _run_all(launches(x, starts, lengths, out, TOPK, plan, bound)[1])
    torch.cuda.synchronize()


def compile_ahead(shapes: list[tuple[int, ...]], jobs: int) -> None:
    """The shapes' kernels compiled in ``jobs`` processes at once before any is timed (the
    compiles, on the CPU, are most of a run's time: a dozen kernels a shape)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        pool.map(_compile_shape, shapes, chunksize=1)


def _pct(R: int, W: int, ms: float, copy_tbps: float) -> float:
    return 100 * R * W * 4 / (ms * 1e-3) / (copy_tbps * 1e12)


def run(vllm: dict, copy_tbps: float, reps: int, shapes: list[tuple[int, ...]]) -> list[dict]:
    rows = []
    for shape in shapes:
        R, W, L = _shape(shape)
        x, starts, lengths, out = _inputs(R, W, L)
        best = torch.topk(x, TOPK, dim=1).values  # sorted down
        res = {"R": R, "L": L, "mla_route": TopkPlan().route_for(R, W, x.device, TOPK)}
        if L < W:
            res["W"] = W
        for name, (plan, bound) in _plans(W, L).items():
            _work, steps = launches(x, starts, lengths, out, TOPK, plan, bound)
            res[name] = timed(functools.partial(_run_all, steps), out, x, best, reps)
        vals = torch.empty(R, TOPK, device="cuda")
        ids = torch.empty(R, TOPK, dtype=torch.int64, device="cuda")
        res["torch_topk"] = _torch_topk(x, vals, ids, best, reps)
        if vllm.get("loaded"):
            peers = peer_calls(x, lengths, out, L)
            for name, fn in peers.items():
                if not name.startswith("_"):
                    res[name] = timed(fn, out, x, best, reps)
        for v in res.values():
            if isinstance(v, dict) and "ms" in v:
                v["pct_of_copy"] = _pct(R, L, v["ms"], copy_tbps)
        log(json.dumps(res))
        rows.append(res)
        torch.cuda.empty_cache()
    return rows


def _run_all(steps) -> None:
    for s in steps:
        s()


def _torch_topk(x, vals, ids, best, reps) -> dict:
    """``torch.topk`` on the values (its ties are not the lower index: checked like a peer)."""
    out = torch.empty(ids.shape, dtype=torch.int32, device=x.device)

    def fn():
        torch.topk(x, TOPK, dim=1, out=(vals, ids))
        out.copy_(ids)
    return timed(fn, out, x, best, reps)


def table(res: dict) -> str:
    names = ["mla_fast", *HELD_PLANS, *LONG_PLANS, "mla_fast_bounded", "vllm_persistent_topk",
             "vllm_cooperative_topk", "vllm_top_k_per_row_decode", "torch_topk"]
    lines = [f"copy {res['ceilings']['copy_TBps']:.2f} TB/s; us (% of copy)",
             "| rows x keys | " + " | ".join(names) + " |",
             "|" + " --- |" * (len(names) + 1)]
    for r in res["rows"]:
        cells = []
        for n in names:
            v = r.get(n)
            if v is None:
                cells.append("")
            elif "ms" in v:
                cells.append(f"{v['ms'] * 1e3:.1f} ({v['pct_of_copy']:.0f}%)")
            else:
                cells.append(next(iter(v)))
        keys = f"{r['L'] // 1024}K" if r["L"] % 1024 == 0 else str(r["L"])
        if "W" in r:
            keys += f" of {r['W'] // 1024}K"
        lines.append(f"| {r['R']} x {keys} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", type=Path, default=None,
                   help="vLLM's _C_stable_libtorch.abi3.so, or it compressed by xz (default: "
                        "the peers directory's, written by python -m benchmarks.peers --topk)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--short", action="store_true",
                   help="the decode lengths alone: 1-256 rows of 8K to 32K keys")
    p.add_argument("--widths", default="",
                   help="these logits' widths alone (comma-separated, e.g. 8193,16384)")
    p.add_argument("--serving", action="store_true",
                   help="decode rows of 4K and 8K keys in logits 64K wide, ours given the rows' "
                        "bound (max_row_len) and not, vLLM's given it (max_seq_len)")
    p.add_argument("--compile-jobs", type=int, default=0,
                   help="compile every shape's kernels in this many processes first (0: as "
                        "each is first timed)")
    args = p.parse_args(argv)
    shapes = SERVING_SHAPES if args.serving else SHORT_SHAPES if args.short else SHAPES
    if args.widths:
        widths = {int(w) for w in args.widths.split(",")}
        shapes = [s for s in shapes if s[1] in widths]
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if args.compile_jobs:
        compile_ahead(shapes, args.compile_jobs)
        log(f"compiled ahead in {args.compile_jobs} processes ({time.time() - t0:.1f} s)")
    vllm = load_vllm(args.lib)
    log(f"vLLM: {vllm} ({time.time() - t0:.1f} s)")
    res = {"environment": environment(), "vllm": vllm, "ceilings": ceilings(),
           "topk": TOPK, "method": "CUDA-graph replays, L2 flushed by a read, median"}
    res["rows"] = run(vllm, res["ceilings"]["copy_TBps"], args.reps, shapes)
    (args.out / "topk_peers.json").write_text(json.dumps(res, indent=1))
    print(table(res))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
