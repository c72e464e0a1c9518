"""Probe: why the prefill step's gathers and sparse attention trail the peers' stages.

Times, on ``step_peers``' prefill shape (2K new tokens after 16K), CUDA graphs, L2 flushed:
the latent gather (ours at several tile sizes / grids / warps, vLLM's op), the index-key
gather (ours, vLLM's), and the sparse attention on both sides' indices and q layouts.
Writes ``$OUT/prefill_step_probe.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

from benchmarks.step_peers import _graph_us, _run, _run_peers, _weights, prefill_inputs
from benchmarks.step_stages import load_peers, prefill_stages
from mla.fast.common import num_sms
from mla.fast.sparse import gather as gth
from mla.fast.sparse import sparse_mla_prefill


def main() -> int:
    chunk, context = (int(x) for x in (sys.argv[1:3] if len(sys.argv) > 2 else (2048, 16384)))
    out_dir = os.environ.get("OUT", "/tmp/out")
    w, iw = _weights()
    cfg = w.config
    peers = load_peers()
    inputs = prefill_inputs(cfg, chunk, context)
    ours, theirs, peer_of = prefill_stages(w, iw, peers, inputs)
    st_ours = _run(ours, inputs)
    timings: dict = {}
    _, st_peers = _run_peers(ours, theirs, inputs, peer_of, timings)
    torch.cuda.synchronize()
    res: dict = {"gpu": torch.cuda.get_device_name(), "peer_of": peer_of, "errors": timings}
    reps = 30
    kv, bt32, n_keys = inputs["kv"], inputs["bt32"], inputs["n_keys"]
    res["kv"] = {"shape": list(kv.shape), "stride": list(kv.stride()), "dtype": str(kv.dtype)}
    ws = torch.empty(n_keys, cfg.latent_dim, dtype=torch.bfloat16, device="cuda")
    cache = kv.view(torch.uint8)
    lat: dict = {}

    def ours_latent(rows: int, per_sm: int, warps: int) -> None:
        W = ws.shape[0]
        grid = (1, min(triton.cdiv(W, rows), per_sm * num_sms(ws.device), 65535), 1)
        gth._latent_kernel[grid](cache, ws, bt32, inputs["ws_lens"], inputs["ws_starts"],
                               cache.shape[0], W, bt32.shape[1], *cache.stride(), *ws.stride(),
                               *bt32.stride(), BLOCK_SIZE=cache.shape[1], BLOCK_T=rows,
                               num_warps=warps)

    ref = gth.gather_and_upconvert_fp8_ds_mla(kv, ws.clone(), bt32, inputs["ws_lens"],
                                            inputs["ws_starts"], 1, validate=False)
    lat["shipped"] = _graph_us(lambda: gth.gather_and_upconvert_fp8_ds_mla(
        kv, ws, bt32, inputs["ws_lens"], inputs["ws_starts"], 1, validate=False), reps)
    for rows in (4, 8, 16, 32):
        for per_sm in (2, 8, 32):
            for warps in (2, 4, 8):
                name = f"rows{rows}_persm{per_sm}_w{warps}"
                try:
                    ours_latent(rows, per_sm, warps)
                    torch.cuda.synchronize()
                    ok = torch.equal(ws.view(torch.int16), ref.view(torch.int16))
                    lat[name] = [_graph_us(lambda r=rows, p=per_sm, wa=warps:
                                           ours_latent(r, p, wa), reps), ok]
                except Exception as e:  # noqa: BLE001
                    lat[name] = repr(e)[:300]
    vllm = peers.get("vllm", {})
    fn = dict(theirs)
    if "cp_gather_and_upconvert_fp8_kv_cache" in vllm:
        lat["vllm"] = _graph_us(lambda: fn["latent_gather"](inputs), reps)
    res["latent_gather_us"] = lat
    print(json.dumps(lat, indent=1), flush=True)
    keys: dict = {"shipped": _graph_us(lambda: dict(ours)["index_key_gather"](inputs), reps)}
    if "cp_gather_indexer_k_quant_cache" in vllm:
        keys["vllm"] = _graph_us(lambda: fn["index_key_gather"](inputs), reps)
    res["index_key_gather_us"] = keys
    print(json.dumps(keys, indent=1), flush=True)
    att: dict = {}
    q = st_ours["q"]
    res["q"] = {"shape": list(q.shape), "stride": list(q.stride()),
                "contiguous": q.is_contiguous()}
    scale = cfg.softmax_scale

    def ours_att(s: dict, qq: torch.Tensor, idx: torch.Tensor) -> None:
        sparse_mla_prefill(qq, s["workspace"], idx, scale, d_v=cfg.kv_lora_rank, validate=False)

    att["ours_on_ours"] = _graph_us(lambda: ours_att(st_ours, q, st_ours["slots_sel"]), reps)
    qc = q.contiguous()
    att["ours_on_ours_q_contiguous"] = _graph_us(
        lambda: ours_att(st_ours, qc, st_ours["slots_sel"]), reps)
    if st_peers is not None:
        att["ours_on_peers_indices"] = _graph_us(
            lambda: ours_att(st_ours, q, st_peers["slots_sel"]), reps)
        srt = st_ours["slots_sel"].sort(dim=-1).values
        att["ours_on_sorted_indices"] = _graph_us(lambda: ours_att(st_ours, q, srt), reps)
        if "sparse_attention" in fn:
            att["flashmla_on_peers"] = _graph_us(lambda: fn["sparse_attention"](st_peers), reps)
            att["flashmla_on_ours"] = _graph_us(lambda: fn["sparse_attention"](st_ours), reps)
        sel = st_ours["slots_sel"]
        res["indices"] = {"ours_shape": list(sel.shape), "ours_neg": int((sel < 0).sum()),
                          "peers_neg": int((st_peers["slots_sel"] < 0).sum()),
                          "ours_sorted_rows": int((sel[:, 1:] >= sel[:, :-1]).all(-1).sum()),
                          "ours_row0_head": sel[0, :16].tolist(),
                          "peers_row0_head": st_peers["slots_sel"][0, :16].tolist()}
    res["sparse_attention_us"] = att
    print(json.dumps(att, indent=1), json.dumps(res.get("indices")), flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "prefill_step_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
