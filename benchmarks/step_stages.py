"""The stages of one DeepSeek-V3.2 sparse step on both sides of ``benchmarks.step_peers``:
``mla.fast``'s kernels and the peers' (DeepGEMM's logits, vLLM's cache writers, top-k and
gathers, FlashMLA's attention), each stage a function from the step's state to its state, so
that a stage can be timed alone or the whole step captured in one CUDA graph. The front and the
output projection are the same torch code on both sides; a peer stage that cannot load falls
back to ours, and the row says so."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.sparse_layer import BLOCK
from mla.fast import (
    concat_and_cache_fp8_ds_mla,
    convert_req_index_to_global_index,
    fp8_mqa_logits,
    fp8_paged_mqa_logits,
    gather_and_upconvert_fp8_ds_mla,
    gather_indexer_k_cache,
    indexer_k_quant_and_cache,
    sparse_mla_decode,
    sparse_mla_prefill,
    top_k_per_row,
)
from mla.fast.sparse.front import absorb_query, output_projection, sparse_front
from mla.fast.sparse.model import _rotate
from mla.reference.indexer import IndexerWeights
from mla.reference.indexer_cache import INDEX_K_BYTES
from mla.reference.indexer_logits import quantize_indexer_q
from mla.weights import MLAWeights

FP8_DS_MLA_ROW = 656  # bytes of one fp8_ds_mla token
WORKSPACE_BYTES = 1 << 20  # vLLM's RADIX_TOPK_WORKSPACE_SIZE
COOPERATIVE_MAX_ROWS = 64  # vLLM's AUTO_COOPERATIVE_MAX_ROWS (cooperative_topk up to it)
State = dict[str, Any]
StageFn = Callable[[State], State]


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


def peers_manifest() -> dict | str:
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
    writer takes it (the model's dtype), computed here so that neither side pays the cast.
    ``mla.fast``'s front (``mla.fast.sparse.front``: five GEMMs and two Triton kernels) on
    both sides, so the step's ratio compares the other stages (the peers have no front of
    their own here)."""
    cfg = w.config

    def front(st: State) -> State:
        h = st["hidden"]
        f, qk = sparse_front(w, iw, h, st["positions"])
        k_rot = _rotate(qk.k_index)
        q_fp8, w_q = quantize_indexer_q(_rotate(qk.q_index), qk.weights)
        q = absorb_query(w, f.q_nope, f.q_pe)  # [T, N, 576]
        return {"kv_c": f.kv_c, "k_pe": f.k_pe, "k_rot": k_rot,
                "k_rot_bf16": k_rot.to(torch.bfloat16), "q_fp8": q_fp8, "w_q": w_q,
                "q": q.view(q.shape[0], cfg.num_heads, cfg.latent_dim)}
    return front


def _output(w: MLAWeights) -> StageFn:
    def output(st: State) -> State:
        return {"out": output_projection(w, st["o_lat"])}
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


def decode_stages(w: MLAWeights, iw: IndexerWeights, peers: dict, st: State
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


def prefill_stages(w: MLAWeights, iw: IndexerWeights, peers: dict, st: State
                    ) -> tuple[list[tuple[str, StageFn]], list[tuple[str, StageFn]],
                               dict[str, str]]:
    cfg = w.config
    topk, scale = cfg.index_topk, cfg.softmax_scale
    front, output = _front(w, iw), _output(w)
    n_keys = st["n_keys"]

    def key_gather(s: State) -> State:
        return {"keys": gather_indexer_k_cache(s["ik"], s["bt32"], s["cu_keys"],
                                               num_tokens=n_keys, validate=False)}

    def logits(s: State) -> State:
        return {"logits": fp8_mqa_logits(s["q_fp8"], s["keys"], s["w_q"], s["ks"], s["ke"],
                                         validate=False)}

    def top_k(s: State) -> State:
        return {"local": top_k_per_row(s["logits"], s["ks"], s["ke"], topk, validate=False)}

    def latent_gather(s: State) -> State:
        ws = torch.empty(n_keys, cfg.latent_dim, dtype=torch.bfloat16, device=s["kv"].device)
        return {"workspace": gather_and_upconvert_fp8_ds_mla(
            s["kv"], ws, s["bt32"], s["ws_lens"], s["ws_starts"], 1, validate=False)}

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


def profile_front(w: MLAWeights, iw: IndexerWeights, tokens: int, top: int = 15
                  ) -> list[dict[str, float | str | int]]:
    """Where the front's GPU time goes: its kernels at ``tokens`` new tokens, by total CUDA
    time over 5 calls after 3 warm-ups (``torch.profiler``), the ``top`` largest."""
    from torch.profiler import ProfilerActivity, profile
    st = {"hidden": torch.randn(tokens, w.config.hidden_size, device="cuda",
                                dtype=torch.bfloat16),
          "positions": torch.arange(tokens, device="cuda") + 30000}
    front = _front(w, iw)
    for _ in range(3):
        front(st)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            front(st)
        torch.cuda.synchronize()

    def device_us(e: Any) -> float:  # noqa: ANN401 (the name changed in torch 2.9)
        return e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total

    rows = [{"kernel": e.key[:120], "calls": e.count // 5, "us_per_front": device_us(e) / 5}
            for e in prof.key_averages()]
    rows = [r for r in rows if r["us_per_front"] > 0]
    return sorted(rows, key=lambda r: -float(r["us_per_front"]))[:top]

