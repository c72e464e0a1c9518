"""One DeepSeek-V3.2 layer's sparse step on ``mla.fast`` beside the same step composed of the
peers' kernels (DeepGEMM, vLLM, FlashMLA), stage by stage and in total, on the same inputs.

``python -m benchmarks.step_peers --out-dir DIR [--quick]``: one GPU (H100/H200); the peers
unpacked by ``python -m benchmarks.peers --topk --deepgemm`` into ``peers/`` (or
``$MLA_PEERS``). Shapes: DECODE, B in {1, 32, 128} requests of L in {8K, 32K, 128K} cached
tokens, ``next_n`` 1 and 2 new tokens a request (2: multi-token prediction); PREFILL, one
request's chunk of 2K new tokens over 16K of context and of 4K over 32K. ``--quick``: B = 32,
L = 32K, ``next_n`` 1, and the 2K prefill. bf16 weights (``MLAWeights.random``), the
fp8_ds_mla latent cache and vLLM's fp8 index key cache of one layer (``benchmarks.sparse_layer``'s
builder: 64K random tokens quantized by the fast writers, tiled over scrambled pages).

The step's stages, each side computing every stage from its own previous ones:

    stage              ours (mla.fast)                       peers
    front              mla.reference.front + indexer q/k, Hadamard rotations, e4m3 q: torch
                       (cuBLAS) on both sides, the same function
    cache_writes       concat_and_cache_fp8_ds_mla,          vLLM concat_and_cache_mla
                       indexer_k_quant_and_cache             ("fp8_ds_mla"), indexer_k_quant_and_
                                                             cache (128, "ue8m0")
    index_key_gather   (prefill) the requests' index keys:   vLLM cp_gather_indexer_k_quant_cache
                       torch gather at precomputed offsets
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
                       into the bf16 workspace: torch        kv_cache
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
``mla.fast.sparse_prefill_forward``, which validates and gathers on the host) and the peers'
composition. Measured in the same run: the copy bandwidth (1 GiB device-to-device) and the
bf16 matmul rate (8192³), ``benchmarks.common.ceilings``. The step's floor is
``(weight bytes + cache bytes read) / copy bandwidth + FLOPs / matmul rate``: bf16 weights of
the layer and its indexer; cache bytes: every index key of each request once (132 B) plus,
decode, the top-k fp8_ds_mla rows of each new token (656 B each) or, prefill, each request's
fp8_ds_mla rows once; FLOPs: the projections, the attention over top-k rows (576 + 512 a pair
and head) and the indexer logits counted at half (e4m3 runs at twice the bf16 rate on sm_90).
Each row also holds the relative difference of the two sides' outputs (top-k ties may pick
other keys; vLLM's writer quantizes the new index keys from bf16, ours from float32) and of
ours against ``mla.fast``'s own layer call.

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
from typing import Any

import torch

from benchmarks.common import capture, ceilings, log, report_heading, time_replays
from benchmarks.sparse_layer import BLOCK, _caches
from mla.config import MLAConfig, get_config
from mla.environment import environment
from mla.fast import (
    concat_and_cache_fp8_ds_mla,
    convert_req_index_to_global_index,
    fp8_mqa_logits,
    fp8_paged_mqa_logits,
    indexer_k_quant_and_cache,
    sparse_mla_decode,
    sparse_mla_prefill,
    top_k_per_row,
)
from mla.fast.model import token_slots
from mla.fast.sparse import model as fast_sparse
from mla.fast.sparse.model import _rotate
from mla.reference.decode import absorb_q
from mla.reference.fp8 import dequantize_fp8_ds_mla
from mla.reference.front import mla_front
from mla.reference.indexer import IndexerWeights, indexer_qk, q_latent
from mla.reference.indexer_cache import INDEX_K_BYTES, _byte_offsets
from mla.reference.indexer_logits import decode_row_ends, quantize_indexer_q
from mla.reference.sparse_model import project_output
from mla.weights import MLAWeights

__all__ = ["DECODE", "PREFILL", "QUICK_DECODE", "QUICK_PREFILL", "STAGES", "parse_args",
           "floor_us", "step_cost", "weight_bytes", "make_row", "markdown", "short_table",
           "load_peers", "decode_inputs", "prefill_inputs", "bench_decode", "bench_prefill",
           "main"]

FP8_DS_MLA_ROW = 656  # bytes of one fp8_ds_mla token
WORKSPACE_BYTES = 1 << 20  # vLLM's RADIX_TOPK_WORKSPACE_SIZE
COOPERATIVE_MAX_ROWS = 64  # vLLM's AUTO_COOPERATIVE_MAX_ROWS (cooperative_topk up to it)
DECODE = [(B, L, n) for n in (1, 2) for B in (1, 32, 128) for L in (8192, 32768, 131072)]
PREFILL = [(2048, 16384), (4096, 32768)]  # (new tokens, context) of one request
QUICK_DECODE = [(32, 32768, 1)]
QUICK_PREFILL = [(2048, 16384)]
STAGES = ["front", "cache_writes", "index_key_gather", "indexer_logits", "top_k",
          "index_conversion", "latent_gather", "sparse_attention", "output_projection"]
TITLE = "One V3.2 sparse step: mla.fast beside the peers' composition"

State = dict[str, Any]
StageFn = Callable[[State], State]


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
                   help="B=32 L=32K next_n=1 and the 2K-over-16K prefill only")
    p.add_argument("--reps", type=int, default=20, help="graph replays timed per graph")
    p.add_argument("--eager-runs", type=int, default=10, help="eager steps timed per side")
    args = p.parse_args(argv)
    if args.reps < 1 or args.eager_runs < 1:
        p.error("--reps and --eager-runs must be at least 1")
    return args


# ---- the peers -----------------------------------------------------------------------------


def load_peers() -> dict:
    """Each peer imported, or why not: ``{"flashmla", "deepgemm", "vllm"}`` -> module / ops
    or ``None``, and ``"status"`` -> a line each. Never raises."""
    from mla.conformance.adapters import import_peer
    from mla.conformance.adapters.flashmla import INTERFACE

    got: dict = {"status": {}}
    try:
        got["flashmla"] = import_peer(INTERFACE, "FlashMLA")
        got["status"]["flashmla"] = "loaded"
    except Exception as e:  # noqa: BLE001 (recorded: the composition runs ours instead)
        got["flashmla"] = None
        got["status"]["flashmla"] = f"not loaded: {type(e).__name__}: {e}"[:500]
    try:
        from mla.conformance.adapters import deepgemm
        dg = deepgemm.load()
        got["deepgemm"] = dg
        got["status"]["deepgemm"] = f"loaded, DeepGEMM {getattr(dg, '__version__', '?')}"
    except Exception as e:  # noqa: BLE001
        got["deepgemm"] = None
        got["status"]["deepgemm"] = f"not loaded: {type(e).__name__}: {e}"[:500]
    try:
        from mla.conformance.adapters.vllm_library import load_library
        how = load_library()
        ops = {}
        for ns, names in {"_C": ("persistent_topk", "cooperative_topk",
                                 "top_k_per_row_prefill"),
                          "_C_cache_ops": ("concat_and_cache_mla", "indexer_k_quant_and_cache",
                                           "cp_gather_indexer_k_quant_cache",
                                           "cp_gather_and_upconvert_fp8_kv_cache")}.items():
            for n in names:
                if hasattr(getattr(torch.ops, ns), n):
                    ops[n] = getattr(getattr(torch.ops, ns), n)
        got["vllm"] = ops
        missing = sorted({"persistent_topk", "cooperative_topk", "top_k_per_row_prefill",
                          "concat_and_cache_mla", "indexer_k_quant_and_cache",
                          "cp_gather_indexer_k_quant_cache",
                          "cp_gather_and_upconvert_fp8_kv_cache"} - set(ops))
        got["status"]["vllm"] = (f"loaded ({how.get('how')})"
                                 + (f"; ops missing: {', '.join(missing)}" if missing else ""))
    except Exception as e:  # noqa: BLE001
        got["vllm"] = {}
        got["status"]["vllm"] = f"not loaded: {type(e).__name__}: {e}"[:500]
    return got


def _manifest() -> dict | str:
    from mla.conformance.adapters import peers_dir

    path = peers_dir() / "MANIFEST.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"no manifest: {type(e).__name__}: {e}"[:300]


# ---- the step's stages ---------------------------------------------------------------------


def _front(w: MLAWeights, iw: IndexerWeights) -> StageFn:
    """Both sides' front: the projections, norms, RoPE, the indexer's rotated query (e4m3,
    its scale in the weights) and key, the absorbed query. ``k_rot_bf16``: the key as vLLM's
    writer takes it (the model's dtype), computed here so that neither side pays the cast."""
    cfg = w.config

    def front(st: State) -> State:
        h = st["hidden"]
        f = mla_front(w, h, st["positions"])
        qk = indexer_qk(iw, h, q_latent(w, h), st["positions"], use_fp8=False)
        k_rot = _rotate(qk.k_index)
        q_fp8, w_q = quantize_indexer_q(_rotate(qk.q_index), qk.weights)
        q = torch.cat([absorb_q(f.q_nope, w.W_UK), f.q_pe], dim=-1)  # [T, N, 576]
        return {"kv_c": f.kv_c, "k_pe": f.k_pe, "k_rot": k_rot,
                "k_rot_bf16": k_rot.to(torch.bfloat16), "q_fp8": q_fp8, "w_q": w_q,
                "q": q.view(q.shape[0], cfg.num_heads, cfg.latent_dim)}
    return front


def _output(w: MLAWeights) -> StageFn:
    def output(st: State) -> State:
        return {"out": project_output(w, st["o_lat"])}
    return output


def _ours_cache_writes(st: State) -> State:
    concat_and_cache_fp8_ds_mla(st["kv_c"], st["k_pe"], st["kv"], st["slots"], validate=False)
    indexer_k_quant_and_cache(st["k_rot"], st["ik"], st["slots"], validate=False)
    return {}


def _peer_cache_writes(vllm: dict, device: torch.device) -> StageFn | None:
    if not {"concat_and_cache_mla", "indexer_k_quant_and_cache"} <= set(vllm):
        return None
    from mla.conformance.adapters.vllm_cache import (
        INDEXER_QUANT_BLOCK,
        INDEXER_SCALE_FMT,
        _takes_skip_scale,
    )
    latent, keys = vllm["concat_and_cache_mla"], vllm["indexer_k_quant_and_cache"]
    scale = torch.ones(1, dtype=torch.float32, device=device)  # the layer's _k_scale
    extra = (False,) if _takes_skip_scale(latent) else ()

    def cache_writes(st: State) -> State:
        k_pe = st["k_pe"].squeeze(1) if st["k_pe"].dim() == 3 else st["k_pe"]
        latent(st["kv_c"], k_pe, st["kv"], st["slots"], "fp8_ds_mla", scale, *extra)
        keys(st["k_rot_bf16"], st["ik"], st["slots"], INDEXER_QUANT_BLOCK, INDEXER_SCALE_FMT)
        return {}
    return cache_writes


def _arity(op: object, default: int) -> int:
    """How many arguments a torch op's schema takes (``default`` where it has none)."""
    schema = getattr(getattr(op, "default", None), "_schema", None)
    return default if schema is None else len(schema.arguments)


def _ours_conversion(st: State) -> State:
    ws = {} if "ws_starts" not in st else {"prefill_workspace_request_ids": st["req32"],
                                           "prefill_workspace_starts": st["ws_starts"]}
    return {"slots_sel": convert_req_index_to_global_index(
        st["req32"], st["bt32"], st["local"], BLOCK, validate=False, **ws)}


# decode


def _decode_stages(w: MLAWeights, iw: IndexerWeights, peers: dict, st: State
                   ) -> tuple[list[tuple[str, StageFn]], list[tuple[str, StageFn]],
                              dict[str, str]]:
    """Ours and the peers' decode stages, and each stage's peer (or "ours")."""
    cfg = w.config
    B, n, width = st["B"], st["next_n"], st["width"]
    topk, scale = cfg.index_topk, cfg.softmax_scale
    front, output = _front(w, iw), _output(w)

    def logits(s: State) -> State:
        q = s["q_fp8"].view(B, n, *s["q_fp8"].shape[1:])
        return {"logits": fp8_paged_mqa_logits(q, s["ik"], s["w_q"], s["seq_lens"], s["bt32"],
                                               width, validate=False)}

    def top_k(s: State) -> State:
        return {"local": top_k_per_row(s["logits"], s["row_starts"], s["row_ends"], topk,
                                       validate=False)}

    def attention(s: State) -> State:
        o, _ = sparse_mla_decode(s["q"].view(B, n, cfg.num_heads, cfg.latent_dim), s["kv"],
                                 s["slots_sel"].view(B, n, topk), scale, True,
                                 head_dim_v=cfg.kv_lora_rank, validate=False)
        return {"o_lat": o}

    ours = [("front", front), ("cache_writes", _ours_cache_writes),
            ("indexer_logits", logits), ("top_k", top_k),
            ("index_conversion", _ours_conversion), ("sparse_attention", attention),
            ("output_projection", output)]
    theirs = dict(ours)
    peer_of = {"front": "torch (same)", "output_projection": "torch (same)"}
    dev = st["hidden"].device
    writes = _peer_cache_writes(peers.get("vllm", {}), dev)
    if writes is not None:
        theirs["cache_writes"], peer_of["cache_writes"] = writes, "vLLM concat_and_cache_mla " \
            "+ indexer_k_quant_and_cache"
    dg = peers.get("deepgemm")
    if dg is not None:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        rows2d = st["rows2d"]
        ik4 = st["ik"].view(st["ik"].shape[0], BLOCK, 1, INDEX_K_BYTES)
        meta: list[torch.Tensor] = []  # the schedule, computed at the first (eager) call

        def dg_logits(s: State) -> State:
            if not meta:
                meta.append(dg.get_paged_mqa_logits_metadata(rows2d, BLOCK,
                                                             sms // (2 if n == 4 else 1)))
            q = s["q_fp8"].view(B, n, *s["q_fp8"].shape[1:])
            return {"logits": dg.fp8_fp4_paged_mqa_logits((q, None), ik4, s["w_q"], rows2d,
                                                          s["bt32"], meta[0], width)}
        theirs["indexer_logits"] = dg_logits
        peer_of["indexer_logits"] = "DeepGEMM fp8_fp4_paged_mqa_logits"
    vllm = peers.get("vllm", {})
    R = B * n
    kernel = "cooperative_topk" if R <= COOPERATIVE_MAX_ROWS else "persistent_topk"
    if kernel in vllm:
        op = vllm[kernel]
        work = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        st["_topk_work"] = work
        max_seq_len = st["L"] + n

        def vllm_top_k(s: State) -> State:
            out = torch.full((R, topk), -1, dtype=torch.int32, device=dev)
            op(s["logits"], s["rows2d"], out, work, topk, max_seq_len)
            return {"local": out}
        theirs["top_k"], peer_of["top_k"] = vllm_top_k, f"vLLM {kernel}"
    fm = peers.get("flashmla")
    if fm is not None:
        sched, _ = fm.get_mla_metadata()  # filled at the first call, reused by every call
        st["_sched"] = sched
        k_cache = st["kv"].view(torch.uint8).unsqueeze(-2)  # [nb, 64, 1, 656]

        def fm_attention(s: State) -> State:
            q = s["q"].view(B, n, cfg.num_heads, cfg.latent_dim)
            o, _ = fm.flash_mla_with_kvcache(q, k_cache, None, None, cfg.kv_lora_rank, sched,
                                             None, scale, False, True,
                                             s["slots_sel"].view(B, n, topk))
            return {"o_lat": o}
        theirs["sparse_attention"] = fm_attention
        peer_of["sparse_attention"] = "FlashMLA flash_mla_with_kvcache (sparse, fp8_ds_mla)"
    return ours, list(theirs.items()), peer_of


# prefill


def _prefill_stages(w: MLAWeights, iw: IndexerWeights, peers: dict, st: State
                    ) -> tuple[list[tuple[str, StageFn]], list[tuple[str, StageFn]],
                               dict[str, str]]:
    cfg = w.config
    topk, scale = cfg.index_topk, cfg.softmax_scale
    front, output = _front(w, iw), _output(w)
    n_keys = st["n_keys"]

    def key_gather(s: State) -> State:
        flat = s["ik"].view(torch.uint8).reshape(-1)
        codes = flat[s["key_values_at"]].view(torch.float8_e4m3fn)
        k_scale = flat[s["key_scale_at"]].contiguous().view(torch.float32).reshape(-1)
        return {"keys": (codes, k_scale)}

    def logits(s: State) -> State:
        return {"logits": fp8_mqa_logits(s["q_fp8"], s["keys"], s["w_q"], s["ks"], s["ke"],
                                         validate=False)}

    def top_k(s: State) -> State:
        return {"local": top_k_per_row(s["logits"], s["ks"], s["ke"], topk, validate=False)}

    def latent_gather(s: State) -> State:
        kv_c, k_pe = dequantize_fp8_ds_mla(s["kv"].view(-1, FP8_DS_MLA_ROW)[s["ws_slots"]])
        return {"workspace": torch.cat([kv_c, k_pe], dim=-1)}

    def attention(s: State) -> State:
        o, _, _ = sparse_mla_prefill(s["q"], s["workspace"], s["slots_sel"], scale,
                                     d_v=cfg.kv_lora_rank, validate=False)
        return {"o_lat": o}

    ours = [("front", front), ("cache_writes", _ours_cache_writes),
            ("index_key_gather", key_gather), ("indexer_logits", logits), ("top_k", top_k),
            ("index_conversion", _ours_conversion), ("latent_gather", latent_gather),
            ("sparse_attention", attention), ("output_projection", output)]
    theirs = dict(ours)
    peer_of = {"front": "torch (same)", "output_projection": "torch (same)"}
    dev = st["hidden"].device
    vllm = peers.get("vllm", {})
    writes = _peer_cache_writes(vllm, dev)
    if writes is not None:
        theirs["cache_writes"], peer_of["cache_writes"] = writes, "vLLM concat_and_cache_mla " \
            "+ indexer_k_quant_and_cache"
    if "cp_gather_indexer_k_quant_cache" in vllm:
        op = vllm["cp_gather_indexer_k_quant_cache"]

        def vllm_key_gather(s: State) -> State:
            codes = torch.empty(n_keys, cfg.index_head_dim, dtype=torch.float8_e4m3fn,
                                device=dev)
            k_scale = torch.empty(n_keys, 4, dtype=torch.uint8, device=dev)
            op(s["ik"], codes, k_scale, s["bt32"], s["cu_keys"])
            return {"keys": (codes, k_scale.view(torch.float32).squeeze(-1))}
        theirs["index_key_gather"] = vllm_key_gather
        peer_of["index_key_gather"] = "vLLM cp_gather_indexer_k_quant_cache"
    dg = peers.get("deepgemm")
    if dg is not None:
        longest = st["max_seqlen_k"]

        def dg_logits(s: State) -> State:
            return {"logits": dg.fp8_fp4_mqa_logits((s["q_fp8"], None), s["keys"], s["w_q"],
                                                    s["ks"], s["ke"], longest)}
        theirs["indexer_logits"] = dg_logits
        peer_of["indexer_logits"] = "DeepGEMM fp8_fp4_mqa_logits (rows compressed)"
    if "top_k_per_row_prefill" in vllm:
        op_topk = vllm["top_k_per_row_prefill"]
        T = st["T"]
        zeros = torch.zeros(T, dtype=torch.int32, device=dev)
        st["_zeros"] = zeros

        def vllm_top_k(s: State) -> State:
            lg = s["logits"]
            out = torch.full((T, topk), -1, dtype=torch.int32, device=dev)
            # DeepGEMM's rows are compressed (column 0 = the row's first key); ours are not
            starts = zeros if dg is not None else s["ks"]
            ends = s["row_lens"] if dg is not None else s["ke"]
            op_topk(lg, starts, ends, out, T, lg.stride(0), lg.stride(1), topk)
            return {"local": out}
        theirs["top_k"], peer_of["top_k"] = vllm_top_k, "vLLM top_k_per_row_prefill"
    if "cp_gather_and_upconvert_fp8_kv_cache" in vllm:
        op_ws = vllm["cp_gather_and_upconvert_fp8_kv_cache"]
        # (src_cache, dst, block_table, workspace_starts, batch_size, then optional tensors:
        # seq_starts, and in 0.33 host_cache, host_row_ids, device_row_ids), passed as None
        ws_optional = (None,) * (_arity(op_ws, 9) - 5)

        def vllm_latent_gather(s: State) -> State:
            ws = torch.empty(n_keys, cfg.latent_dim, dtype=torch.bfloat16, device=dev)
            op_ws(s["kv"], ws, s["bt32"], s["ws_starts"], 1, *ws_optional)
            return {"workspace": ws}
        theirs["latent_gather"] = vllm_latent_gather
        peer_of["latent_gather"] = "vLLM cp_gather_and_upconvert_fp8_kv_cache"
    fm = peers.get("flashmla")
    if fm is not None:
        def fm_attention(s: State) -> State:
            T = s["q"].shape[0]
            o, _, _ = fm.flash_mla_sparse_fwd(s["q"], s["workspace"].view(-1, 1, cfg.latent_dim),
                                              s["slots_sel"].view(T, 1, topk), scale,
                                              cfg.kv_lora_rank)
            return {"o_lat": o}
        theirs["sparse_attention"] = fm_attention
        peer_of["sparse_attention"] = "FlashMLA flash_mla_sparse_fwd"
    return ours, list(theirs.items()), peer_of


# ---- timing --------------------------------------------------------------------------------


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
    ``context`` cached ones; the gathers' offsets, row ranges and workspace starts."""
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
    all_pos = torch.arange(n_keys, device=dev)
    all_slots = token_slots(bt32, torch.zeros_like(all_pos), all_pos, BLOCK, validate=False)
    values_at, scale_at = _byte_offsets(all_slots, BLOCK)
    ks = torch.zeros(chunk, dtype=torch.int32, device=dev)  # the request's keys start at 0
    ke = (positions + 1).to(torch.int32)
    return {
        "T": chunk, "context": context, "n_keys": n_keys, "max_seqlen_k": n_keys,
        "hidden": hidden, "positions": positions, "kv": kv, "ik": ik, "bt32": bt32,
        "req32": req.to(torch.int32),
        "slots": token_slots(bt32, req, positions, BLOCK, validate=False),
        "key_values_at": values_at, "key_scale_at": scale_at, "ws_slots": all_slots,
        "ks": ks, "ke": ke, "row_lens": (ke - ks).contiguous(),
        "cu_keys": torch.tensor([0, n_keys], dtype=torch.int32, device=dev),
        "ws_starts": torch.zeros(1, dtype=torch.int32, device=dev)}


def bench_decode(B: int, L: int, next_n: int, w: MLAWeights, iw: IndexerWeights, peers: dict,
                 ceil: dict, reps: int, runs: int, seed: int = 0) -> dict:
    """One decode shape's row (``make_row``)."""
    cfg = w.config
    shape = {"B": B, "L": L, "next_n": next_n}
    inputs = decode_inputs(cfg, B, L, next_n, "cuda", seed)
    kv, ik, bt32 = inputs["kv"], inputs["ik"], inputs["bt32"]
    hidden, cache_seqlens = inputs["hidden3"], inputs["cache_seqlens"]
    timings: dict = {"cache_GB": (kv.numel() + ik.numel()) / 1e9}
    ours, theirs, peer_of = _decode_stages(w, iw, peers, inputs)
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
    ours, theirs, peer_of = _prefill_stages(w, iw, peers, inputs)
    st_ours, _ = _time_sides(ours, theirs, inputs, reps, runs, peer_of, timings)
    qsl = torch.tensor([0, chunk], dtype=torch.int32, device=kv.device)

    def model() -> torch.Tensor:
        return fast_sparse.sparse_prefill_forward(w, iw, inputs["hidden"], qsl, [context], kv,
                                                  ik, inputs["bt32"])
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
        "peers": peers["status"], "peers_manifest": _manifest(), "ceilings": ceil,
        "peers_summary": "; ".join(f"{k} {v.split(':')[0]}" for k, v in peers["status"].items()),
        "method": (f"CUDA graphs, {args.reps} replays, L2 flushed by a 256 MB read before "
                   f"each, median; eager: {args.eager_runs} steps, the same flush, median."),
        "rows": []}
    w, iw = _weights()
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
