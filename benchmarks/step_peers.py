"""One DeepSeek-V3.2 layer's sparse step on ``mla.fast`` beside the same step composed of the
peers' kernels (DeepGEMM, vLLM, FlashMLA), stage by stage and in total, on the same inputs.

``python -m benchmarks.step_peers --out-dir DIR [--quick]``: one GPU (H100/H200); the peers
unpacked by ``python -m benchmarks.peers --topk --deepgemm`` into ``peers/`` (or
``$MLA_PEERS``). Shapes: DECODE, B in {1, 32, 128} requests of L in {8K, 32K, 128K} cached
tokens, ``next_n`` 1 and 2 new tokens a request (2: multi-token prediction); PREFILL, one
request's chunk of 2K new tokens over 16K of context and of 4K over 32K. ``--quick``: B = 1,
L = 8K and B = 32, L = 32K at ``next_n`` 1, and the 2K prefill. bf16 weights
(``MLAWeights.random``), the fp8_ds_mla latent cache and vLLM's fp8 index key cache of one
layer (``benchmarks.sparse_layer``'s builder: 64K random tokens quantized by the fast writers,
tiled over scrambled pages).

The step's stages, each side computing every stage from its own previous ones:

    stage              ours (mla.fast)                       peers
    front              mla.reference.front + indexer q/k, Hadamard rotations, e4m3 q: torch
                       (cuBLAS) on both sides, the same function
    cache_writes       concat_and_cache_fp8_ds_mla,          vLLM concat_and_cache_mla
                       indexer_k_quant_and_cache             ("fp8_ds_mla"), indexer_k_quant_and_
                                                             cache (128, "ue8m0")
    index_key_gather   (prefill) the requests' index keys:   vLLM cp_gather_indexer_k_quant_cache
                       gather_indexer_k_cache
    indexer_logits     fp8_paged_mqa_logits / fp8_mqa_logits DeepGEMM fp8_fp4_paged_mqa_logits
                                                             (its schedule metadata computed once
                                                             per step, outside the step, as vLLM)
                                                             / fp8_fp4_mqa_logits (rows compressed)
    top_k              top_k_per_row                         vLLM cooperative_topk (<= 64 rows) or
                                                             persistent_topk (decode, vLLM's
                                                             "auto"), top_k_per_row_prefill
    index_conversion   convert_req_index_to_global_index     ours (vLLM's Triton kernel is not
                                                             unpacked into peers/)
    latent_gather      (prefill) fp8_ds_mla rows dequantized vLLM cp_gather_and_upconvert_fp8_
                       into the bf16 workspace:              kv_cache
                       gather_and_upconvert_fp8_ds_mla
    sparse_attention   sparse_mla_decode / sparse_mla_       FlashMLA flash_mla_with_kvcache with
                       prefill                               indices (fp8_ds_mla) /
                                                             flash_mla_sparse_fwd
    output_projection  o_lat · W_UV, · W_O: torch (cuBLAS), the same function

A stage whose peer is not there (not unpacked, not importable, an op missing from vLLM's
library) runs ours on the peers' side and its row says ``"peer": "ours"``; a peer the run could
not load is named with the reason in the JSON's ``peers``. Both sides read and write the same
caches. The slot mapping, the prefill's row ranges and workspace offsets are computed once per
shape outside the step (an engine's per-step metadata, shared by every layer).

Timing: each stage, and each side's whole step, as a CUDA graph of the step's own
intermediates, replayed ``--reps`` times with the L2 flushed by reading 256 MB before each
(``benchmarks.common.time_replays(read_flush=True)``, median). Eagerly (host launches and
checks included, the L2 flushed the same way, median of ``--eager-runs``): ``mla.fast``'s own
layer call (``mla.fast.sparse_decode_forward(validate=False)``; prefill:
``mla.fast.sparse_prefill_forward(validate=False)``, which reads ``query_start_loc`` on the
host once) and the peers' composition. Measured in the same run: the copy bandwidth (1 GiB
device-to-device) and the bf16 matmul rate (8192³), ``benchmarks.common.ceilings``. The step's
floor is ``(weight bytes + cache bytes read) / copy bandwidth + FLOPs / matmul rate``: bf16
weights of the layer and its indexer; cache bytes: every index key of each request once (132 B)
plus, decode, the top-k fp8_ds_mla rows of each new token (656 B each) or, prefill, each
request's fp8_ds_mla rows once; FLOPs: the projections, the attention over top-k rows (576 +
512 a pair and head) and the indexer logits counted at half (e4m3 runs at twice the bf16 rate
on sm_90). Each row also holds the relative difference of the two sides' outputs (top-k ties
may pick other keys; vLLM's writer quantizes the new index keys from bf16, ours from float32)
and of ours against ``mla.fast``'s own layer call.

Targets, reported and not asserted: ours <= 1.00x the peers' composition at every shape, ours
within 2x of the floor at B >= 32, eager within 1.5x of the graph replay.

Output: ``DIR/step_peers_<YYYY-MM-DD>.json`` (``gpu``, versions, the peers' MANIFEST, ``date``,
``ceilings``, ``rows``) and ``DIR/step_peers_<YYYY-MM-DD>.md``, rewritten after every shape;
a shape that fails (out of memory at B = 128, L = 128K, a peer refusing) records its traceback
in its row's ``error`` and the others still run. Nothing here is imported by ``mla``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import capture, ceilings, log, report_heading, time_replays
from benchmarks.sparse_layer import BLOCK, _caches
from benchmarks.step_stages import (
    FP8_DS_MLA_ROW,
    StageFn,
    State,
    decode_stages,
    load_peers,
    peers_manifest,
    prefill_stages,
    profile_front,
)
from mla.config import MLAConfig, get_config
from mla.environment import environment
from mla.fast.model import token_slots
from mla.fast.sparse import model as fast_sparse
from mla.reference.indexer import IndexerWeights
from mla.reference.indexer_cache import INDEX_K_BYTES
from mla.reference.indexer_logits import decode_row_ends
from mla.weights import MLAWeights

__all__ = ["DECODE", "PREFILL", "QUICK_DECODE", "QUICK_PREFILL", "STAGES", "parse_args",
           "floor_us", "step_cost", "weight_bytes", "make_row", "markdown", "short_table",
           "load_peers", "decode_inputs", "prefill_inputs", "bench_decode", "bench_prefill",
           "main"]

DECODE = [(B, L, n) for n in (1, 2) for B in (1, 32, 128) for L in (8192, 32768, 131072)]
PREFILL = [(2048, 16384), (4096, 32768)]  # (new tokens, context) of one request
QUICK_DECODE = [(1, 8192, 1), (32, 32768, 1)]
QUICK_PREFILL = [(2048, 16384)]
STAGES = ["front", "cache_writes", "index_key_gather", "indexer_logits", "top_k",
          "index_conversion", "latent_gather", "sparse_attention", "output_projection"]
TITLE = "One V3.2 sparse step: mla.fast beside the peers' composition"



# ---- arithmetic: the floor, the row, the tables (no GPU) ----------------------------------


def weight_bytes(cfg: MLAConfig, itemsize: int = 2) -> int:
    """Bytes of one layer's MLA and indexer weights in a dtype of ``itemsize`` bytes."""
    H, N, Lq, Lkv = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    P, R, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    nI, dI = cfg.index_n_heads, cfg.index_head_dim
    mla = (H * Lq + Lq + Lq * N * (P + R) + H * (Lkv + R) + Lkv + Lkv * N * (P + V)
           + N * V * H)
    indexer = Lq * nI * dI + H * dI + 2 * dI + H * nI
    return (mla + indexer) * itemsize


def step_cost(cfg: MLAConfig, step: str, shape: dict) -> dict[str, float]:
    """What bounds one step from below: ``weight_bytes``, ``cache_bytes`` read, ``flops``
    (bf16-equivalent: the e4m3 indexer logits counted at half, module doc).

    ``shape``: decode ``{"B", "L", "next_n"}`` (``L`` tokens cached before the step);
    prefill ``{"chunk", "context"}`` (one request)."""
    H, N, Lq, Lkv = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    P, R, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    nI, dI, topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    per_token = 2 * (H * Lq + Lq * N * (P + R) + H * (Lkv + R) + N * P * Lkv  # front
                     + Lq * nI * dI + H * dI + H * nI + dI * dI * (nI + 1)  # indexer q, k
                     + N * Lkv * V + N * V * H)  # output projection
    pair = 2 * N * ((Lkv + R) + Lkv)  # q·k over 576, p·v over 512, per head
    if step == "decode":
        B, L, n = shape["B"], shape["L"], shape["next_n"]
        T = B * n
        keys_scored = B * sum(L + j + 1 for j in range(n))  # row j sees L + j + 1 keys
        keys_held = B * (L + n)
        selected = B * sum(min(topk, L + j + 1) for j in range(n))
        cache = keys_held * INDEX_K_BYTES + selected * FP8_DS_MLA_ROW
    elif step == "prefill":
        T, C = shape["chunk"], shape["context"]
        keys_scored = sum(C + t + 1 for t in range(T))
        selected = sum(min(topk, C + t + 1) for t in range(T))
        cache = (C + T) * (INDEX_K_BYTES + FP8_DS_MLA_ROW)
    else:
        raise ValueError(f"step must be 'decode' or 'prefill', got {step!r}")
    flops = T * per_token + selected * pair + keys_scored * 2 * nI * dI / 2
    return {"weight_bytes": float(weight_bytes(cfg)), "cache_bytes": float(cache),
            "flops": float(flops)}


def floor_us(weight_bytes: float, cache_bytes: float, flops: float, copy_TBps: float,
             matmul_TFLOPs: float) -> float:
    """``(weight_bytes + cache_bytes) / copy + flops / matmul``, in microseconds."""
    return ((weight_bytes + cache_bytes) / (copy_TBps * 1e12)
            + flops / (matmul_TFLOPs * 1e12)) * 1e6


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def make_row(step: str, shape: dict, timings: dict, peer_of: dict[str, str], cost: dict,
             ceil: dict) -> dict:
    """One report row from a shape's timings (microseconds; ``None`` where not measured).

    ``timings``: ``ours_us``, ``peers_us`` (graph replays of the whole step), ``eager_us``
    (``mla.fast``'s layer call), ``peers_eager_us``, optionally ``ours_model_us``, and
    ``stages`` ``{stage: {"ours_us", "peers_us"}}`` (a stage may carry an ``error``);
    ``peer_of``: each stage's peer's name, or ``"ours"``; ``cost``: ``step_cost``'s;
    ``ceil``: ``ceilings()``'."""
    ours, peers = timings.get("ours_us"), timings.get("peers_us")
    fl = floor_us(cost["weight_bytes"], cost["cache_bytes"], cost["flops"],
                  ceil["copy_TBps"], ceil["matmul_TFLOPs"])
    stages = {}
    for name, t in timings.get("stages", {}).items():
        s = {"ours_us": t.get("ours_us"), "peers_us": t.get("peers_us"),
             "peer": peer_of.get(name, "ours")}
        s["ratio"] = _ratio(s["ours_us"], s["peers_us"])
        if "error" in t:
            s["error"] = t["error"]
        stages[name] = s
    row = {"step": step, "shape": dict(shape), "ours_us": ours, "peers_us": peers,
           "ratio": _ratio(ours, peers), "floor_us": fl, "ours_over_floor": _ratio(ours, fl),
           "eager_us": timings.get("eager_us"),
           "eager_over_graph": _ratio(timings.get("eager_us"), ours),
           "peers_eager_us": timings.get("peers_eager_us"), "cost": dict(cost),
           "stages": stages}
    for k in ("ours_model_us", "ours_model_error", "rel_diff_ours_vs_peers",
              "rel_diff_ours_vs_model", "peers_error", "peer_stage_errors", "cache_GB"):
        if k in timings:
            row[k] = timings[k]
    return row


def _shape_name(row: dict) -> str:
    s = row["shape"]
    if row["step"] == "decode":
        return f"decode B={s['B']} L={s['L'] // 1024}K next_n={s['next_n']}"
    return f"prefill {s['chunk'] // 1024}K over {s['context'] // 1024}K"


def _f(v: float | None, spec: str = ".1f") -> str:
    return "" if v is None else format(v, spec)


def markdown(res: dict) -> str:
    """The report: heading (GPU, versions, ceilings), the step table, then each stage."""
    lines = report_heading(TITLE, res)
    lines += [f"Peers: {res.get('peers_summary', 'none')}. {res.get('method', '')}", "",
              "| step | ours us | peers us | ours/peers | floor us | ours/floor | eager us | "
              "eager/graph | peers eager us |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        if "error" in r and r.get("ours_us") is None:
            err = r["error"].strip().splitlines()[-1][:120]
            lines.append(f"| {_shape_name(r)} | error: {err} | | | | | | | |")
            continue
        lines.append(f"| {_shape_name(r)} | {_f(r['ours_us'])} | {_f(r['peers_us'])} | "
                     f"{_f(r['ratio'], '.2f')} | {_f(r['floor_us'])} | "
                     f"{_f(r['ours_over_floor'], '.2f')} | {_f(r['eager_us'])} | "
                     f"{_f(r['eager_over_graph'], '.2f')} | {_f(r['peers_eager_us'])} |")
    lines += ["", "Stages, us (CUDA graph of the stage alone): ours / peers (peer)", "",
              "| step | " + " | ".join(STAGES) + " |", "|" + " --- |" * (len(STAGES) + 1)]
    for r in res["rows"]:
        if not r.get("stages"):
            continue
        cells = []
        for name in STAGES:
            s = r["stages"].get(name)
            if s is None:
                cells.append("")
            elif "error" in s:
                cells.append("error")
            else:
                peer = "" if s["peer"] == "ours" else f" ({s['peer']})"
                cells.append(f"{_f(s['ours_us'])} / {_f(s['peers_us'])}{peer}")
        lines.append(f"| {_shape_name(r)} | " + " | ".join(cells) + " |")
    errors = [(r, r["error"]) for r in res["rows"] if "error" in r] + \
        [(r, r["peers_error"]) for r in res["rows"] if "peers_error" in r]
    if errors:
        lines += ["", "Errors (last line; the JSON has the tracebacks):", ""]
        lines += [f"- {_shape_name(r)}: {e.strip().splitlines()[-1][:200]}" for r, e in errors]
    return "\n".join(lines) + "\n"


def short_table(rows: list[dict]) -> str:
    """A few columns a row, for the terminal."""
    out = [f"{'step':<34} {'ours us':>9} {'peers us':>9} {'ratio':>6} {'floor':>6} "
           f"{'eager/g':>7}"]
    for r in rows:
        if r.get("ours_us") is None:
            out.append(f"{_shape_name(r):<34} error")
            continue
        out.append(f"{_shape_name(r):<34} {_f(r['ours_us']):>9} {_f(r['peers_us']):>9} "
                   f"{_f(r['ratio'], '.2f'):>6} {_f(r['ours_over_floor'], '.2f'):>6} "
                   f"{_f(r['eager_over_graph'], '.2f'):>7}")
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_peers",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--quick", action="store_true",
                   help="B=1 L=8K and B=32 L=32K at next_n=1, and the 2K-over-16K prefill")
    p.add_argument("--reps", type=int, default=20, help="graph replays timed per graph")
    p.add_argument("--eager-runs", type=int, default=10, help="eager steps timed per side")
    p.add_argument("--profile-front", action="store_true",
                   help="also list the front's kernels by GPU time (B=32 and 128 tokens)")
    args = p.parse_args(argv)
    if args.reps < 1 or args.eager_runs < 1:
        p.error("--reps and --eager-runs must be at least 1")
    return args


def _run(stages: list[tuple[str, StageFn]], inputs: State) -> State:
    st = dict(inputs)
    for _, fn in stages:
        st.update(fn(st))
    return st


def _graph_us(fn: Callable[[], object], reps: int) -> float:
    g = capture(fn)
    try:
        return 1e3 * time_replays(g, reps=reps, read_flush=True)
    finally:
        del g


def _eager_us(fn: Callable[[], object], runs: int) -> float:
    """Median us of ``runs`` eager calls after one, the L2 flushed by a read before each."""
    flush = torch.ones(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        flush.sum(dtype=torch.int64)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return 1e3 * statistics.median(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _tb() -> str:
    return traceback.format_exc()[-4000:]


def _run_peers(ours: list[tuple[str, StageFn]], theirs: list[tuple[str, StageFn]],
               inputs: State, peer_of: dict[str, str], timings: dict
               ) -> tuple[list[tuple[str, StageFn]], State]:
    """The peers' step run once, stage by stage (their JIT compiles, FlashMLA fills its
    schedule): a peer stage that raises is replaced by ours, its ``peer_of`` set to
    ``"ours"`` and its traceback kept in ``timings["peer_stage_errors"]``."""
    ours_fn = dict(ours)
    kept: list[tuple[str, StageFn]] = []
    st = dict(inputs)
    for name, fn in theirs:
        try:
            st.update(fn(st))
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 (recorded: ours runs in its place)
            if fn is ours_fn[name]:
                raise
            timings.setdefault("peer_stage_errors", {})[name] = _tb()
            log(f"  peer stage {name} failed, ours in its place: "
                + timings["peer_stage_errors"][name].strip().splitlines()[-1])
            torch.cuda.synchronize()
            fn = ours_fn[name]
            peer_of[name] = "ours"
            st.update(fn(st))
        kept.append((name, fn))
    return kept, st


def _time_sides(ours: list[tuple[str, StageFn]], theirs: list[tuple[str, StageFn]],
                inputs: State, reps: int, runs: int, peer_of: dict[str, str], timings: dict
                ) -> tuple[State, State | None]:
    """Both sides run once (compiles, JIT, FlashMLA's schedule), then each stage and each
    whole step timed as graphs; the peers' whole step eagerly too. Fills ``timings`` (and
    ``peer_of`` where a peer stage fails)."""
    with_peers = any(v != "ours" and not v.startswith("torch") for v in peer_of.values())
    st_ours = _run(ours, inputs)
    st_peers = None
    if with_peers:
        try:
            theirs, st_peers = _run_peers(ours, theirs, inputs, peer_of, timings)
            timings["rel_diff_ours_vs_peers"] = _rel(st_ours["out"], st_peers["out"])
        except Exception:  # noqa: BLE001 (recorded: ours is still timed)
            timings["peers_error"] = _tb()
            log("  peers' step failed: " + timings["peers_error"].strip().splitlines()[-1])
            st_peers = None
    torch.cuda.synchronize()
    timings["ours_us"] = _graph_us(lambda: _run(ours, inputs), reps)
    if st_peers is not None:
        try:
            timings["peers_us"] = _graph_us(lambda: _run(theirs, inputs), reps)
            timings["peers_eager_us"] = _eager_us(lambda: _run(theirs, inputs), runs)
        except Exception:  # noqa: BLE001
            timings["peers_error"] = _tb()
            torch.cuda.synchronize()
    stages: dict = {}
    theirs_fn = dict(theirs)
    for name, fn in ours:
        s: dict = {}
        try:
            s["ours_us"] = _graph_us(lambda fn=fn: fn(st_ours), reps)
            if st_peers is not None:
                pfn = theirs_fn[name]
                s["peers_us"] = s["ours_us"] if pfn is fn else \
                    _graph_us(lambda pfn=pfn: pfn(st_peers), reps)
        except Exception:  # noqa: BLE001 (one stage failing must not hide the others)
            s["error"] = _tb()
            torch.cuda.synchronize()
        stages[name] = s
    timings["stages"] = stages
    return st_ours, st_peers


def _weights(device: str = "cuda") -> tuple[MLAWeights, IndexerWeights]:
    cfg = get_config("deepseek-v3.2")
    return (MLAWeights.random(cfg, seed=0, dtype=torch.bfloat16, device=device),
            IndexerWeights.random(cfg, seed=1, dtype=torch.bfloat16, device=device))


def decode_inputs(cfg: MLAConfig, B: int, L: int, next_n: int, device: str = "cuda",
                  seed: int = 0) -> State:
    """A decode shape's inputs and per-step metadata: ``B`` requests of ``L`` cached tokens
    (caches of ``B · ceil((L + next_n) / 64)`` scrambled pages), ``next_n`` new tokens each."""
    dev = torch.device(device)
    per_req = -(-(L + next_n) // BLOCK)
    num_pages = B * per_req
    kv, ik = _caches(num_pages, device, seed)
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    bt32 = perm.view(B, per_req).to(torch.int32).to(dev)
    cache_seqlens = torch.full((B,), L, dtype=torch.int32, device=dev)
    g = torch.Generator(device=dev).manual_seed(seed + 1)
    hidden = torch.randn(B, next_n, cfg.hidden_size, device=dev, dtype=torch.bfloat16,
                         generator=g)
    T = B * next_n
    positions = (cache_seqlens.long()[:, None] + torch.arange(next_n, device=dev)).flatten()
    req = torch.arange(B, device=dev).repeat_interleave(next_n)
    seq_lens = (cache_seqlens + next_n).to(torch.int32)
    row_ends = decode_row_ends(seq_lens, next_n)
    return {
        "B": B, "L": L, "next_n": next_n, "T": T, "width": per_req * BLOCK,
        "hidden3": hidden, "cache_seqlens": cache_seqlens,
        "hidden": hidden.reshape(T, -1), "positions": positions, "kv": kv, "ik": ik,
        "bt32": bt32, "req32": req.to(torch.int32),
        "slots": token_slots(bt32, req, positions, BLOCK, validate=False),
        "seq_lens": seq_lens, "row_ends": row_ends,
        "row_starts": torch.zeros(T, dtype=torch.int32, device=dev),
        "rows2d": row_ends.view(B, next_n).contiguous()}


def prefill_inputs(cfg: MLAConfig, chunk: int, context: int, device: str = "cuda",
                   seed: int = 0) -> State:
    """A prefill shape's inputs and per-step metadata: one request, ``chunk`` new tokens after
    ``context`` cached ones; the gathers' lengths and workspace starts, the rows' ranges."""
    dev = torch.device(device)
    n_keys = context + chunk
    per_req = -(-n_keys // BLOCK)
    kv, ik = _caches(per_req, device, seed)
    perm = torch.randperm(per_req, generator=torch.Generator().manual_seed(seed))
    bt32 = perm.view(1, per_req).to(torch.int32).to(dev)
    g = torch.Generator(device=dev).manual_seed(seed + 1)
    hidden = torch.randn(chunk, cfg.hidden_size, device=dev, dtype=torch.bfloat16, generator=g)
    positions = context + torch.arange(chunk, device=dev)
    req = torch.zeros(chunk, dtype=torch.long, device=dev)
    ks = torch.zeros(chunk, dtype=torch.int32, device=dev)  # the request's keys start at 0
    ke = (positions + 1).to(torch.int32)
    return {
        "T": chunk, "context": context, "n_keys": n_keys, "max_seqlen_k": n_keys,
        "hidden": hidden, "positions": positions, "kv": kv, "ik": ik, "bt32": bt32,
        "req32": req.to(torch.int32),
        "slots": token_slots(bt32, req, positions, BLOCK, validate=False),
        "ks": ks, "ke": ke, "row_lens": (ke - ks).contiguous(),
        "cu_keys": torch.tensor([0, n_keys], dtype=torch.int32, device=dev),
        "ws_starts": torch.zeros(1, dtype=torch.int32, device=dev),
        "ws_lens": torch.tensor([n_keys], dtype=torch.int32, device=dev)}


def bench_decode(B: int, L: int, next_n: int, w: MLAWeights, iw: IndexerWeights, peers: dict,
                 ceil: dict, reps: int, runs: int, seed: int = 0) -> dict:
    """One decode shape's row (``make_row``)."""
    cfg = w.config
    shape = {"B": B, "L": L, "next_n": next_n}
    inputs = decode_inputs(cfg, B, L, next_n, "cuda", seed)
    kv, ik, bt32 = inputs["kv"], inputs["ik"], inputs["bt32"]
    hidden, cache_seqlens = inputs["hidden3"], inputs["cache_seqlens"]
    timings: dict = {"cache_GB": (kv.numel() + ik.numel()) / 1e9}
    ours, theirs, peer_of = decode_stages(w, iw, peers, inputs)
    st_ours, _ = _time_sides(ours, theirs, inputs, reps, runs, peer_of, timings)

    def model() -> torch.Tensor:
        return fast_sparse.sparse_decode_forward(w, iw, hidden, kv, ik, bt32, cache_seqlens,
                                                 validate=False)
    out_model = model()
    timings["rel_diff_ours_vs_model"] = _rel(st_ours["out"].reshape(out_model.shape),
                                             out_model)
    timings["eager_us"] = _eager_us(model, runs)
    try:
        timings["ours_model_us"] = _graph_us(model, reps)
    except Exception:  # noqa: BLE001 (recorded beside the composition's number)
        timings["ours_model_error"] = _tb()
    return make_row("decode", shape, timings, peer_of, step_cost(cfg, "decode", shape), ceil)


def bench_prefill(chunk: int, context: int, w: MLAWeights, iw: IndexerWeights, peers: dict,
                  ceil: dict, reps: int, runs: int, seed: int = 0) -> dict:
    """One prefill shape's row: one request, ``chunk`` new tokens after ``context`` cached."""
    cfg = w.config
    shape = {"chunk": chunk, "context": context, "requests": 1}
    inputs = prefill_inputs(cfg, chunk, context, "cuda", seed)
    kv, ik = inputs["kv"], inputs["ik"]
    timings: dict = {"cache_GB": (kv.numel() + ik.numel()) / 1e9}
    ours, theirs, peer_of = prefill_stages(w, iw, peers, inputs)
    st_ours, _ = _time_sides(ours, theirs, inputs, reps, runs, peer_of, timings)
    qsl = torch.tensor([0, chunk], dtype=torch.int32, device=kv.device)

    def model() -> torch.Tensor:
        return fast_sparse.sparse_prefill_forward(w, iw, inputs["hidden"], qsl, [context], kv,
                                                  ik, inputs["bt32"], validate=False)
    timings["rel_diff_ours_vs_model"] = _rel(st_ours["out"], model())
    timings["eager_us"] = _eager_us(model, max(2, runs // 3))
    return make_row("prefill", shape, timings, peer_of, step_cost(cfg, "prefill", shape), ceil)


def _shapes(quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    dec = QUICK_DECODE if quick else DECODE
    pre = QUICK_PREFILL if quick else PREFILL
    shapes = [("decode", s) for s in dec] + [("prefill", s) for s in pre]
    # the target's shape and the small prefill first, so that a run cut short has them
    first = [("decode", (32, 32768, 1)), ("prefill", (2048, 16384))]
    return [s for s in first if s in shapes] + [s for s in shapes if s not in first]


def _failed_row(kind: str, s: tuple[int, ...], err: str) -> dict:
    shape = ({"B": s[0], "L": s[1], "next_n": s[2]} if kind == "decode"
             else {"chunk": s[0], "context": s[1], "requests": 1})
    return {"step": kind, "shape": shape, "ours_us": None, "peers_us": None, "ratio": None,
            "floor_us": None, "eager_us": None, "stages": {}, "error": err}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    stamp = env["date"][:10]
    log("ceilings")
    ceil = ceilings()
    peers = load_peers()
    for k, v in peers["status"].items():
        log(f"peer {k}: {v}")
    res: dict = {
        "gpu": env.get("gpu"), "torch": env["torch"], "triton": env["triton"],
        "cuda": env.get("cuda"), "date": env["date"], "environment": env,
        "peers": peers["status"], "peers_manifest": peers_manifest(), "ceilings": ceil,
        "peers_summary": "; ".join(f"{k} {v.split(':')[0]}" for k, v in peers["status"].items()),
        "method": (f"CUDA graphs, {args.reps} replays, L2 flushed by a 256 MB read before "
                   f"each, median; eager: {args.eager_runs} steps, the same flush, median."),
        "rows": []}
    w, iw = _weights()
    if args.profile_front:
        res["front_profile"] = {str(t): profile_front(w, iw, t) for t in (32, 128)}
        for t, rows in res["front_profile"].items():
            log(f"front at {t} tokens: " + "; ".join(
                f"{r['kernel'][:40]} {float(r['us_per_front']):.1f} us" for r in rows[:6]))
    json_path = args.out_dir / f"step_peers_{stamp}.json"
    md_path = args.out_dir / f"step_peers_{stamp}.md"
    for kind, s in _shapes(args.quick):
        log(f"{kind} {s}")
        try:
            if kind == "decode":
                row = bench_decode(*s, w, iw, peers, ceil, args.reps, args.eager_runs)
            else:
                row = bench_prefill(*s, w, iw, peers, ceil, args.reps, args.eager_runs)
        except Exception:  # noqa: BLE001 (one shape failing must not lose the others)
            err = _tb()
            log(f"  failed: {err.strip().splitlines()[-1]}")
            row = _failed_row(kind, s, err)
        res["rows"].append(row)
        log("  " + json.dumps({k: row.get(k) for k in ("ours_us", "peers_us", "ratio",
                                                         "floor_us", "eager_us")}))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        json_path.write_text(json.dumps(res, indent=1, default=str))
        md_path.write_text(markdown(res))
    print(short_table(res["rows"]))
    print(f"\n{json_path}\n{md_path}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
