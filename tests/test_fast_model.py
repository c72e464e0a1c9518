"""The fast dense layers (``mla.fast.model``) against the float64 reference, stage by stage.

DeepSeek-V2-Lite and V3 head dims (576-wide latent rows, 192/128 per head) with 4 heads and
short lengths under Triton's interpreter (float32: the interpreter's bf16 dots are wrong); bf16
on a GPU. Every stage has its budget (``benchmarks.layer_check``): front, cache bytes, the
attention's (o, lse), the projections, the whole layer. Broken twins (one stage off by 1%)
must fail exactly their stage.
"""

from __future__ import annotations

import pytest
import torch

import mla.fast.model as fast_model
from benchmarks.layer_check import build_dense, dense_decode_check, dense_prefill_check
from benchmarks.layer_stages import assert_stages, gemm_budget
from mla.compare import rel_err
from mla.config import get_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
CONFIGS = {name: get_config(name).replace(num_heads=4)
           for name in ("deepseek-v2-lite", "deepseek-v3")}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("lens,s_q,block_size", [
    ([37, 0, 1, 80], 1, 16),  # empty and length-1 requests, lengths off the tiles
    ([65, 3], 2, 64),  # MTP: s_q = 2, causal among the new tokens
    ([20, 47], 3, 1),  # pages of one token
])
def test_decode_layer(name, lens, s_q, block_size):
    stages = dense_decode_check(CONFIGS[name], DTYPE, DEVICE, lens, s_q, block_size, seed=7)
    assert_stages(stages)
    assert {s.stage for s in stages} >= {"cache", "attention.o_lat", "attention.lse",
                                         "projection", "layer"}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("context_lens,new_lens,workspace", [
    ([40, 0, 17], [5, 3, 1], 32),  # several context chunks, a request without context
    ([0, 0], [7, 1], 64),  # no context at all
    ([33], [0], 64),  # a request with no new token
])
def test_prefill_layer(name, context_lens, new_lens, workspace):
    stages = dense_prefill_check(CONFIGS[name], DTYPE, DEVICE, context_lens, new_lens, 16,
                                 workspace, seed=3)
    assert_stages(stages)


def _failing(stages):
    return {s.stage for s in stages if not s.passed}


def test_broken_attention_fails_its_stage(monkeypatch):
    """The decode kernel's output 1% off: the attention stage fails, the cache does not."""
    real = fast_model.mla_decode_paged

    def off(*args, **kwargs):
        o, lse = real(*args, **kwargs)
        return o * 1.01, lse

    monkeypatch.setattr(fast_model, "mla_decode_paged", off)
    bad = _failing(dense_decode_check(CONFIGS["deepseek-v3"], DTYPE, DEVICE, [37, 5], 1, 16))
    assert "attention.o_lat" in bad and "cache" not in bad and "front.kv_c" not in bad


def test_broken_prefill_lse_fails_its_stage(monkeypatch):
    real = fast_model.chunked_prefill_attention

    def off(*args, **kwargs):
        o, lse = real(*args, **kwargs)
        return o, lse + 2e-2  # twice the bf16 lse budget

    monkeypatch.setattr(fast_model, "chunked_prefill_attention", off)
    bad = _failing(dense_prefill_check(CONFIGS["deepseek-v2-lite"], DTYPE, DEVICE, [40], [5],
                                       16, 32))
    assert bad == {"attention.lse"}


def test_broken_cache_write_fails_bytes(monkeypatch):
    """A cache write one rope element off: the bytes differ (and nothing else is blamed on
    the front)."""
    real = fast_model.concat_and_cache_mla

    def off(kv_c, k_pe, kv_cache, slots, **kwargs):
        k_pe = k_pe.clone()
        k_pe[:, 0] *= 1.01
        real(kv_c, k_pe, kv_cache, slots, **kwargs)

    monkeypatch.setattr(fast_model, "concat_and_cache_mla", off)
    bad = _failing(dense_decode_check(CONFIGS["deepseek-v3"], DTYPE, DEVICE, [9, 30], 1, 16))
    assert "cache" in bad and not any(s.startswith("front") for s in bad)


def test_broken_projection_fails(monkeypatch):
    """The output projection 1% off (W_UV scaled): only the projection and layer stages."""
    def layer(w, *args, **kwargs):
        tr = fast_model.decode_layer(w, *args, **kwargs)
        return tr._replace(out=tr.out * 1.01)

    bad = _failing(dense_decode_check(CONFIGS["deepseek-v2-lite"], DTYPE, DEVICE, [20, 3], 1,
                                      16, decode=layer))
    assert "projection" in bad and "attention.o_lat" not in bad


def test_gemm_budget_sits_near_the_measured_bf16_error():
    """bf16 GEMMs on the CPU (float32 accumulation, one rounding of the output): the budget is
    between 1.5x and 3x the error measured on V3's absorption and projections, as every budget
    of mla.compare."""
    from mla.compare import rel_err
    from mla.reference.decode import absorb_q
    from mla.weights import MLAWeights

    cfg = CONFIGS["deepseek-v3"].replace(num_heads=16)
    w = MLAWeights.random(cfg, dtype=torch.bfloat16)
    w64 = w.to(torch.float64)
    g = torch.Generator().manual_seed(0)
    o_lat = (0.3 * torch.randn(8, 16, 512, generator=g)).to(torch.bfloat16)
    out = torch.einsum("snl,lnv->snv", o_lat, w.W_UV).flatten(-2) @ w.W_O
    out64 = torch.einsum("snl,lnv->snv", o_lat.double(), w64.W_UV).flatten(-2) @ w64.W_O
    ratio = gemm_budget(torch.bfloat16, [512, 16 * 128]) / rel_err(out, out64)
    assert 1.5 <= ratio <= 3.0, ratio
    q_nope = torch.randn(8, 16, 128, generator=g).to(torch.bfloat16)
    err = rel_err(absorb_q(q_nope, w.W_UK), absorb_q(q_nope.double(), w64.W_UK))
    assert 1.5 <= gemm_budget(torch.bfloat16, [128]) / err <= 3.0


def test_gemm_budget_catches_one_percent():
    """A 1% error exceeds the projection budget of every dtype the layers run in."""
    for dtype in (torch.float32, torch.bfloat16):
        assert gemm_budget(dtype, [512, 128 * 128]) < 1e-2 / 1.4


def test_write_context_equals_the_reference_bytes():
    """The fast write_context caches the same bytes as the reference's on the same device
    (the same front; the copy kernel against the reference's indexing), NaN elsewhere kept."""
    from mla.reference import write_context as ref_write_context

    cfg = CONFIGS["deepseek-v3"]
    w, cache, bt, hidden = build_dense(cfg, DTYPE, DEVICE, [0, 0], [45, 3], 16, 0)
    ref = cache.clone()
    fast_model.write_context(w, hidden[:45], cache, bt[0], start=0)
    fast_model.write_context(w, hidden[45:], cache, bt[1], start=5)
    ref_write_context(w, hidden[:45], ref, bt[0], start=0)
    ref_write_context(w, hidden[45:], ref, bt[1], start=5)
    assert torch.equal(cache.cpu().view(torch.int16 if DTYPE != torch.float32 else torch.int32),
                       ref.cpu().view(torch.int16 if DTYPE != torch.float32 else torch.int32))
    assert torch.isnan(cache).any()  # rows nobody wrote stay poisoned


def test_forward_is_the_trace_output():
    cfg = CONFIGS["deepseek-v2-lite"]
    w, cache, bt, hidden = build_dense(cfg, DTYPE, DEVICE, [10, 3], [1, 1], 16, 0)
    sl = torch.tensor([10, 3], dtype=torch.int32, device=DEVICE)
    c2 = cache.clone()
    out = fast_model.decode_forward(w, hidden.view(2, 1, -1), cache, bt, sl)
    tr = fast_model.decode_layer(w, hidden.view(2, 1, -1), c2, bt, sl)
    assert torch.equal(out, tr.out)


def test_nan_hidden_stays_in_its_request():
    """NaN in one request's new token: its output is NaN, the other request's is not."""
    cfg = CONFIGS["deepseek-v3"]
    w, cache, bt, hidden = build_dense(cfg, DTYPE, DEVICE, [10, 12], [1, 1], 16, 0)
    hidden[0, 5] = float("nan")
    sl = torch.tensor([10, 12], dtype=torch.int32, device=DEVICE)
    out = fast_model.decode_forward(w, hidden.view(2, 1, -1), cache, bt, sl)
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()


def test_bad_input_is_refused():
    cfg = CONFIGS["deepseek-v2-lite"]
    w, cache, bt, hidden = build_dense(cfg, DTYPE, DEVICE, [10], [1], 16, 0)
    sl = torch.tensor([10], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="hidden"):
        fast_model.decode_forward(w, hidden[:, :-1].view(1, 1, -1), cache, bt, sl)
    with pytest.raises(ValueError, match="kv_cache"):
        fast_model.decode_forward(w, hidden.view(1, 1, -1), cache[..., :-1], bt, sl)
    with pytest.raises(ValueError, match="cache_seqlens"):
        fast_model.decode_forward(w, hidden.view(1, 1, -1), cache, bt, -sl, validate=True)
    qsl = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="query_start_loc"):
        fast_model.chunked_prefill_forward(w, hidden, qsl, [10], cache, bt)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_decode_step_is_capturable():
    """A warm-up, then the step captured in a CUDA graph and replayed: same output."""
    cfg = get_config("deepseek-v3")
    w, cache, bt, hidden = build_dense(cfg, DTYPE, DEVICE, [300, 1000], [1, 1], 64, 0)
    sl = torch.tensor([300, 1000], dtype=torch.int32, device=DEVICE)
    h = hidden.view(2, 1, -1)
    ref = fast_model.decode_forward(w, h, cache.clone(), bt, sl)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fast_model.decode_forward(w, h, cache, bt, sl, validate=False)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = fast_model.decode_forward(w, h, cache, bt, sl, validate=False)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    # cuBLAS may pick other GEMM algorithms under capture: equal to about one bf16 rounding
    assert rel_err(out, ref) < 2.0 ** -8


def test_layer_check_command(tmp_path, monkeypatch):
    """``python -m benchmarks.layer_check --small``: its twelve runs (dense decode at s_q 1 and
    2 and chunked prefill for both presets, sparse decode and prefill on both caches), and for
    three of them (one dense decode, one dense prefill, one sparse run: the others are the
    stage tests' own runs, here and in ``test_fast_sparse_model.py``) every stage within its
    budget, the JSON written with each stage's error and budget."""
    import json

    import benchmarks.layer_check as layer_check

    runs = layer_check.layer_runs(DEVICE, small=True)
    assert len(runs) == 12
    monkeypatch.setattr(layer_check, "layer_runs",
                        lambda device, small=False: [runs[0], runs[5], runs[11]])
    assert layer_check.main(["--small", "--device", DEVICE, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "layer_check.json").read_text())
    assert not report["errors"] and report["stages"]
    assert all(s["passed"] and s["error"] <= s["budget"] for s in report["stages"])
    layers = {" ".join(s["layer"].split()[:2]) for s in report["stages"]}
    assert layers == {"decode deepseek-v2-lite", "prefill deepseek-v3", "sparse prefill"}
