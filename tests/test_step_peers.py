"""The parts of the step benchmark (``benchmarks.step_peers``) that decide what it reports, on
the CPU: its options and shapes, the floor's arithmetic on a hand-computed example, the bytes
and FLOPs it charges a step, the report row built from given timings and the tables; and its
prefill gather stages against the reference's gathers."""

from __future__ import annotations

import importlib
import types

import pytest
import torch

from benchmarks import step_peers as sp
from benchmarks.step_stages import prefill_stages
from mla.config import get_config
from mla.reference.fp8 import gather_and_upconvert_fp8_ds_mla
from mla.reference.indexer import IndexerWeights
from mla.reference.indexer_cache import gather_indexer_k_cache
from mla.weights import MLAWeights

V32 = get_config("deepseek-v3.2")
CEIL = {"copy_TBps": 4.0, "matmul_TFLOPs": 500.0}


def test_module_imports_without_cuda(monkeypatch):
    """Importing the module touches no GPU: reloaded with CUDA made unavailable and its
    initialization an error, it still loads."""
    def no_cuda(*a: object, **k: object) -> None:
        raise AssertionError("CUDA touched at import")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "init", no_cuda)
    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    mod = importlib.reload(sp)
    assert mod.STAGES[0] == "front" and callable(mod.main)


def test_arguments():
    a = sp.parse_args(["--out-dir", "d"])
    assert (str(a.out_dir), a.quick, a.reps, a.eager_runs) == ("d", False, 20, 10)
    a = sp.parse_args(["--out-dir", "d", "--quick", "--reps", "5", "--eager-runs", "3"])
    assert (a.quick, a.reps, a.eager_runs) == (True, 5, 3)
    with pytest.raises(SystemExit):
        sp.parse_args([])  # --out-dir is required
    with pytest.raises(SystemExit):
        sp.parse_args(["--out-dir", "d", "--reps", "0"])


def test_shapes_quick_and_full_target_first():
    quick = sp._shapes(True)
    assert quick == [("decode", (32, 32768, 1)), ("prefill", (2048, 16384)),
                     ("decode", (1, 8192, 1))]
    full = sp._shapes(False)
    assert full[:2] == quick[:2] and set(quick) <= set(full)
    assert len(full) == 3 * 3 * 2 + 2 and len(set(full)) == len(full)
    assert {s for k, s in full if k == "decode"} == {
        (B, L, n) for B in (1, 32, 128) for L in (8192, 32768, 131072) for n in (1, 2)}
    assert {s for k, s in full if k == "prefill"} == {(2048, 16384), (4096, 32768)}


def test_floor_on_a_hand_computed_example():
    # 2 GB at 4 TB/s: 500 us; 1e12 FLOPs at 500 TFLOP/s: 2000 us
    assert sp.floor_us(1e9, 1e9, 1e12, 4.0, 500.0) == pytest.approx(2500.0)
    assert sp.floor_us(0, 8e9, 0, 2.0, 1.0) == pytest.approx(4000.0)


def test_weight_bytes_by_hand_and_against_the_weights():
    # V3.2: q_a 7168·1536 + norm 1536 + q_b 1536·128·192 + kv_a 7168·576 + norm 512
    # + kv_b 512·128·256 + o 128·128·7168 = 187,107,328; indexer wq_b 1536·64·128
    # + wk 7168·128 + LayerNorm 2·128 + weights_proj 7168·64 = 13,959,424; bf16
    assert sp.weight_bytes(V32) == 2 * (187_107_328 + 13_959_424)
    tiny = V32.replace(hidden_size=64, num_heads=2, q_lora_rank=32, kv_lora_rank=16,
                       qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                       index_n_heads=2, index_head_dim=8, index_topk=4)
    w = MLAWeights.random(tiny, dtype=torch.float32)
    iw = IndexerWeights.random(tiny, dtype=torch.float32)
    tensors = [getattr(w, n) for n in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                                       "o_proj", "q_a_proj", "q_a_layernorm", "q_b_proj")]
    tensors += [iw.wq_b, iw.wk, iw.k_norm_weight, iw.k_norm_bias, iw.weights_proj]
    assert sp.weight_bytes(tiny, 4) == sum(t.numel() * 4 for t in tensors)


def test_step_cost_bytes_and_flops():
    c = sp.step_cost(V32, "decode", {"B": 1, "L": 8192, "next_n": 1})
    assert c["cache_bytes"] == 8193 * 132 + 2048 * 656
    assert c["weight_bytes"] == sp.weight_bytes(V32)
    # one more cached key: one more key scored (64 heads of 128, e4m3 at half), same top-k
    d = sp.step_cost(V32, "decode", {"B": 1, "L": 8193, "next_n": 1})
    assert d["flops"] - c["flops"] == pytest.approx(2 * 64 * 128 / 2)
    assert d["cache_bytes"] - c["cache_bytes"] == 132
    # B requests: B times the cache and the per-token work, the weights once
    c4 = sp.step_cost(V32, "decode", {"B": 4, "L": 8192, "next_n": 1})
    assert c4["cache_bytes"] == 4 * c["cache_bytes"]
    assert c4["flops"] == pytest.approx(4 * c["flops"])
    # next_n = 2: two rows of 8193 and 8194 keys, 2 · 2048 rows read, 8194 keys held
    m = sp.step_cost(V32, "decode", {"B": 1, "L": 8192, "next_n": 2})
    assert m["cache_bytes"] == 8194 * 132 + 2 * 2048 * 656
    p = sp.step_cost(V32, "prefill", {"chunk": 2048, "context": 16384})
    assert p["cache_bytes"] == (16384 + 2048) * (132 + 656)
    assert p["flops"] > 2048 * c["flops"]  # each token scores more keys than the decode's
    with pytest.raises(ValueError):
        sp.step_cost(V32, "verify", {})


def _timings() -> dict:
    return {"ours_us": 100.0, "peers_us": 125.0, "eager_us": 140.0, "peers_eager_us": 400.0,
            "ours_model_us": 101.0, "rel_diff_ours_vs_peers": 3e-3, "cache_GB": 0.8,
            "stages": {"front": {"ours_us": 40.0, "peers_us": 40.0},
                       "top_k": {"ours_us": 10.0, "peers_us": 20.0},
                       "index_conversion": {"ours_us": 3.0, "peers_us": 3.0},
                       "sparse_attention": {"ours_us": 30.0, "error": "Traceback\nOOM"}}}


def test_row_from_fake_timings():
    cost = {"weight_bytes": 4e8, "cache_bytes": 4e8, "flops": 5e9}
    peer_of = {"front": "torch (same)", "top_k": "vLLM persistent_topk"}
    shape = {"B": 32, "L": 32768, "next_n": 1}
    r = sp.make_row("decode", shape, _timings(), peer_of, cost, CEIL)
    assert r["step"] == "decode" and r["shape"] == shape
    assert r["ratio"] == pytest.approx(0.8)
    assert r["floor_us"] == pytest.approx(8e8 / 4e12 * 1e6 + 5e9 / 500e12 * 1e6)  # 210 us
    assert r["ours_over_floor"] == pytest.approx(100.0 / 210.0)
    assert r["eager_over_graph"] == pytest.approx(1.4)
    assert r["stages"]["top_k"] == {"ours_us": 10.0, "peers_us": 20.0,
                                    "peer": "vLLM persistent_topk", "ratio": 0.5}
    assert r["stages"]["index_conversion"]["peer"] == "ours"
    assert r["stages"]["front"]["peer"] == "torch (same)"
    assert r["stages"]["sparse_attention"]["error"].endswith("OOM")
    assert r["stages"]["sparse_attention"]["ratio"] is None
    assert (r["ours_model_us"], r["rel_diff_ours_vs_peers"]) == (101.0, 3e-3)
    json_safe = __import__("json").dumps(r)
    assert "NaN" not in json_safe
    # the peers missing: no ratio, ours still there
    t = _timings()
    del t["peers_us"], t["peers_eager_us"]
    r = sp.make_row("decode", shape, t, {}, cost, CEIL)
    assert r["peers_us"] is None and r["ratio"] is None and r["ours_us"] == 100.0


def test_tables():
    cost = {"weight_bytes": 4e8, "cache_bytes": 4e8, "flops": 5e9}
    rows = [sp.make_row("decode", {"B": 32, "L": 32768, "next_n": 1}, _timings(),
                        {"top_k": "vLLM persistent_topk"}, cost, CEIL),
            sp.make_row("prefill", {"chunk": 2048, "context": 16384, "requests": 1},
                        _timings(), {}, cost, CEIL),
            sp._failed_row("decode", (128, 131072, 2), "Traceback ...\n"
                           "torch.OutOfMemoryError: CUDA out of memory")]
    res = {"environment": {"gpu": "NVIDIA H200", "date": "2026-12-07T00:00:00+00:00",
                           "torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0"},
           "ceilings": {"copy_TBps": 4.0, "matmul_TFLOPs": 500.0},
           "peers_summary": "flashmla loaded", "method": "CUDA graphs.", "rows": rows}
    md = sp.markdown(res)
    assert md.startswith("# One V3.2 sparse step")
    assert "NVIDIA H200" in md and "bf16 matmul 500 TFLOP/s" in md
    assert "| decode B=32 L=32K next_n=1 | 100.0 | 125.0 | 0.80 | 210.0 | 0.48 | 140.0 | " \
           "1.40 | 400.0 |" in md
    assert "| prefill 2K over 16K |" in md
    assert "| decode B=128 L=128K next_n=2 | error: torch.OutOfMemoryError" in md
    assert "10.0 / 20.0 (vLLM persistent_topk)" in md
    assert "- decode B=128 L=128K next_n=2: torch.OutOfMemoryError: CUDA out of memory" in md
    short = sp.short_table(rows)
    assert short.splitlines()[1].split()[-5:] == ["100.0", "125.0", "0.80", "0.48", "1.40"]
    assert short.splitlines()[3].endswith("error")


def test_prefill_gather_stages_give_the_reference_gathers():
    """The prefill's gather stages on our side (``mla.fast``'s gathers) against the reference's
    on the benchmark's own inputs: one request of 150 cached tokens and 8 new (3 pages)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    st = sp.prefill_inputs(V32, 8, 150, device=device)
    ours = dict(prefill_stages(types.SimpleNamespace(config=V32), None, {}, st)[0])
    codes, scales = ours["index_key_gather"](st)["keys"]
    workspace = ours["latent_gather"](st)["workspace"]
    want_codes, want_scales = gather_indexer_k_cache(st["ik"], st["bt32"], st["cu_keys"])
    want = gather_and_upconvert_fp8_ds_mla(st["kv"], torch.empty_like(workspace), st["bt32"],
                                           st["ws_lens"], st["ws_starts"], 1)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales) and torch.equal(workspace, want)
