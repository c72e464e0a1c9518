"""The fast sparse layers (``mla.fast.sparse.model``) against the float64 reference, stage by
stage (``benchmarks.sparse_layer_check``), on the bf16 and the fp8_ds_mla latent caches.

DeepSeek-V3.2's head dims (576-wide rows, 128-wide index keys, hidden 7168, q latent 1536)
with 4 heads, 8 index heads and topk 16 under Triton's interpreter (float32), so that short
contexts already select; bf16 on a GPU. Top-k compares are exact and cannot be flaky: the
fast selection against the reference's on the *same* logits, and against the float64 logits
only outside near ties. Broken twins fail exactly their stage.
"""

from __future__ import annotations

import pytest
import torch
from _interpreter import needs_interpreter

import mla.fast.sparse.model as fast_sparse
from benchmarks.layer_stages import assert_stages
from benchmarks.sparse_layer_check import (
    build_sparse,
    sparse_decode_check,
    sparse_prefill_check,
)
from mla.compare import assert_close, rel_err
from mla.config import get_config
from mla.reference.indexer import IndexerWeights
from mla.weights import MLAWeights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
CFG = get_config("deepseek-v3.2").replace(num_heads=4, index_n_heads=8, index_topk=16)


def _failing(stages):
    return {s.stage for s in stages if not s.passed}


@pytest.mark.parametrize("fp8_kv", [False, True])
@pytest.mark.parametrize("lens,s_q,block_size", [
    ([37, 0, 1, 80], 1, 16),  # empty and length-1 requests; fewer keys than topk; more
    ([65, 3], 2, 64),  # MTP: s_q = 2
    ([20, 47], 3, 1),  # pages of one token
])
def test_sparse_decode_layer(fp8_kv, lens, s_q, block_size):
    stages = sparse_decode_check(CFG, DTYPE, DEVICE, lens, s_q, block_size, fp8_kv, seed=5)
    assert_stages(stages)
    assert {"index cache", "logits", "top-k", "top-k vs float64", "conversion",
            "attention.o_lat", "layer (same keys)"} <= {s.stage for s in stages}


@pytest.mark.parametrize("fp8_kv", [False, True])
@pytest.mark.parametrize("context_lens,new_lens", [
    ([40, 0, 17], [5, 3, 1]),
    ([0], [30]),  # no context: the new tokens select among themselves
    ([33, 2], [0, 4]),  # a request with no new token
])
def test_sparse_prefill_layer(fp8_kv, context_lens, new_lens):
    stages = sparse_prefill_check(CFG, DTYPE, DEVICE, context_lens, new_lens, 16, fp8_kv, 6)
    assert_stages(stages)


def test_selection_bites():
    """With 80 cached keys and topk 16 the selected set is a strict subset of the context."""
    w, iw, kv, ik, bt, hidden = build_sparse(CFG, DTYPE, DEVICE, [80], [1], 16, False, 0)
    tr = fast_sparse.sparse_decode_layer(w, iw, hidden.view(1, 1, -1), kv, ik, bt,
                                         torch.tensor([80], dtype=torch.int32, device=DEVICE))
    chosen = tr.local[0]
    assert (chosen >= 0).sum() == 16 and len(set(chosen.tolist())) == 16
    assert int(chosen.max()) <= 80


def _twin(name, change):
    """The module's ``name`` with its result changed by ``change``."""
    real = getattr(fast_sparse, name)

    def twin(*args, **kwargs):
        return change(real(*args, **kwargs))

    return twin


def test_broken_logits_fail_their_stage(monkeypatch):
    monkeypatch.setattr(fast_sparse, "fp8_paged_mqa_logits",
                        _twin("fp8_paged_mqa_logits", lambda x: x * 1.01))
    bad = _failing(sparse_decode_check(CFG, DTYPE, DEVICE, [50, 9], 1, 16))
    assert "logits" in bad and "cache" not in bad and "top-k" not in bad


def test_broken_topk_fails_its_stage(monkeypatch):
    """The k-th highest key swapped for the k+1-th: the top-k stage on the same logits."""
    real = fast_sparse.top_k_per_row

    def shifted(logits, starts, ends, topk, **kwargs):
        out = real(logits, starts, ends, topk + 1, **kwargs)
        return torch.cat([out[:, :topk - 1], out[:, topk:]], dim=1)

    monkeypatch.setattr(fast_sparse, "top_k_per_row", shifted)
    bad = _failing(sparse_decode_check(CFG, DTYPE, DEVICE, [50, 40], 1, 16))
    assert "top-k" in bad and "logits" not in bad


def test_broken_attention_fails_its_stage(monkeypatch):
    monkeypatch.setattr(fast_sparse, "sparse_mla_decode",
                        _twin("sparse_mla_decode", lambda r: (r[0] * 1.01, r[1])))
    bad = _failing(sparse_decode_check(CFG, DTYPE, DEVICE, [50, 9], 1, 16, fp8_kv=True))
    assert "attention.o_lat" in bad and "top-k" not in bad and "conversion" not in bad


def test_broken_conversion_fails_its_stage(monkeypatch):
    """Request-local indices passed on as if global: the conversion stage."""
    monkeypatch.setattr(fast_sparse, "convert_req_index_to_global_index",
                        lambda req, bt, local, bs, **kw: local)
    bad = _failing(sparse_prefill_check(CFG, DTYPE, DEVICE, [40, 17], [5, 1], 16))
    assert "conversion" in bad and "top-k" not in bad


def test_broken_index_cache_fails_bytes(monkeypatch):
    real = fast_sparse.indexer_k_quant_and_cache
    monkeypatch.setattr(fast_sparse, "indexer_k_quant_and_cache",
                        lambda k, cache, slots, **kw: real(k * 1.5, cache, slots, **kw))
    bad = _failing(sparse_decode_check(CFG, DTYPE, DEVICE, [30, 9], 1, 16))
    assert "index cache" in bad and "cache" not in bad


def test_float_index_cache_is_refused():
    w, iw, kv, ik, bt, hidden = build_sparse(CFG, DTYPE, DEVICE, [10], [1], 16, False, 0)
    float_ik = torch.zeros(*ik.shape[:2], 128, dtype=DTYPE, device=DEVICE)
    sl = torch.tensor([10], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="fp8 index key cache"):
        fast_sparse.sparse_decode_forward(w, iw, hidden.view(1, 1, -1), kv, float_ik, bt, sl)
    with pytest.raises(ValueError, match="use_fp8_indexer"):
        fast_sparse.sparse_decode_forward(w, iw, hidden.view(1, 1, -1), kv, ik, bt, sl, False)
    with pytest.raises(ValueError, match="query_start_loc"):
        fast_sparse.sparse_prefill_forward(w, iw, hidden, torch.tensor([0, 2], device=DEVICE),
                                           [10], kv, ik, bt)


def test_nan_hidden_stays_in_its_request():
    w, iw, kv, ik, bt, hidden = build_sparse(CFG, DTYPE, DEVICE, [20, 25], [1, 1], 16, True, 0)
    hidden[1, 3] = float("nan")
    sl = torch.tensor([20, 25], dtype=torch.int32, device=DEVICE)
    out = fast_sparse.sparse_decode_forward(w, iw, hidden.view(2, 1, -1), kv, ik, bt, sl)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).any()


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_sparse_decode_step_is_capturable():
    cfg = get_config("deepseek-v3.2")
    w, iw, kv, ik, bt, hidden = build_sparse(cfg, DTYPE, DEVICE, [3000, 100], [1, 1], 64,
                                             True, 0)
    sl = torch.tensor([3000, 100], dtype=torch.int32, device=DEVICE)
    h = hidden.view(2, 1, -1)
    ref = fast_sparse.sparse_decode_forward(w, iw, h, kv.clone(), ik.clone(), bt, sl)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fast_sparse.sparse_decode_forward(w, iw, h, kv, ik, bt, sl, validate=False)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fast_sparse.sparse_decode_forward(w, iw, h, kv, ik, bt, sl, validate=False)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    # cuBLAS may pick other GEMM algorithms under capture: equal to about one bf16 rounding
    assert rel_err(out, ref) < 2.0 ** -8


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element of ``x`` (in ``x``'s dtype, as float64)."""
    fi = torch.finfo(x.dtype)
    mag = x.double().abs().clamp_min(fi.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * fi.eps


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_fast_front_against_the_reference_front(dtype):
    """``mla.fast.sparse.front``. Float64: the reference's arithmetic, bit for bit. Float32 and
    float16: the fused front (five GEMMs, two kernels) computes each float32 value the
    reference does up to its sum order, sqrt and FMAs (a few float32 roundings; measured 3e-7
    of each tensor's largest value in float32), then rounds once to the output dtype: every
    element within one unit in the last place of the reference's (float16 measured: 1 of 3584
    kv_c elements off by one), and float32 outputs within 1e-6 of the tensor's largest value.
    Positions up to 163,000 (RoPE's angles in float64), the absorbed query and the output
    projection within one rounding, and an in-place weight update is seen (the prepared
    copies are made again). Bf16 runs on the GPU (mla.check): the interpreter truncates bf16
    casts instead of rounding them."""
    from mla.fast.sparse.front import absorb_query, output_projection, sparse_front
    from mla.reference.sparse_model import project_output, reference_absorb, reference_front

    cfg = CFG
    w = MLAWeights.random(cfg, seed=3, dtype=dtype)
    iw = IndexerWeights.random(cfg, seed=4, dtype=dtype)
    h = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(5)).to(dtype)
    pos = torch.tensor([0, 1, 5, 9, 130, 163_000, 4000])

    def agree(got: tuple, want: tuple) -> None:
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape
            if dtype == torch.float64:
                assert torch.equal(a, b)
            elif a.dtype == torch.float32:
                assert (a - b).abs().max() <= 1e-6 * b.abs().max()
            else:
                assert ((a.double() - b.double()).abs() <= _ulp(b)).all()

    for _ in range(2):  # the second call uses the prepared weights
        f, qk = sparse_front(w, iw, h, pos)
        rf, rqk = reference_front(w, iw, h, pos)
        agree((*f, *qk), (*rf, *rqk))
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2.0 ** -10}[dtype]
    assert_close(absorb_query(w, f.q_nope), reference_absorb(w, f.q_nope), tol)
    # with q_pe: the attention's query, written in place beside q_pe's exact copy
    q = absorb_query(w, f.q_nope, f.q_pe)
    assert torch.equal(q[..., cfg.kv_lora_rank:], f.q_pe)
    assert_close(q, reference_absorb(w, f.q_nope, f.q_pe), tol)
    o_lat = torch.randn(7, cfg.num_heads, cfg.kv_lora_rank).to(dtype)
    assert_close(output_projection(w, o_lat), project_output(w, o_lat), tol)
    with torch.no_grad():
        iw.wq_b.mul_(2.0)
        w.kv_b_proj.mul_(2.0)
        w.kv_a_proj_with_mqa.mul_(0.5)
    f2, qk2 = sparse_front(w, iw, h, pos)
    agree((*f2, *qk2), (*reference_front(w, iw, h, pos)[0], *reference_front(w, iw, h, pos)[1]))
    assert_close(absorb_query(w, f.q_nope), reference_absorb(w, f.q_nope), tol)


@needs_interpreter
def test_fast_front_edges():
    """The fused front on no token and one token; a NaN hidden row gives NaN in that token's
    outputs only; inputs of the wrong dtype or device, or positions of the wrong length, are
    refused naming the argument."""
    from mla.fast.sparse.front import sparse_front
    from mla.reference.sparse_model import reference_front

    w = MLAWeights.random(CFG, seed=6, dtype=torch.float32)
    iw = IndexerWeights.random(CFG, seed=7, dtype=torch.float32)
    for S in (0, 1):
        h = torch.randn(S, CFG.hidden_size, generator=torch.Generator().manual_seed(8))
        pos = torch.arange(S) + 77
        got = sparse_front(w, iw, h, pos)
        want = reference_front(w, iw, h, pos)
        for a, b in zip((*got[0], *got[1]), (*want[0], *want[1])):
            assert a.shape == b.shape
            assert (a - b).abs().max() <= 1e-6 * b.abs().max() if S else a.numel() == 0
    h = torch.randn(3, CFG.hidden_size, generator=torch.Generator().manual_seed(9))
    h[1, 5] = float("nan")
    f, qk = sparse_front(w, iw, h, torch.tensor([3, 4, 5]))
    for t in (*f, *qk):
        assert torch.isnan(t[1]).any() and not torch.isnan(t[[0, 2]]).any()
    with pytest.raises(TypeError, match="hidden"):
        sparse_front(w, iw, h.to(torch.float16), torch.tensor([3, 4, 5]))
    with pytest.raises(ValueError, match="positions"):
        sparse_front(w, iw, h, torch.tensor([3, 4]))


def test_unchecked_prefill_equals_the_checked_one(monkeypatch):
    """``validate=False``: the same output, and the only host read is ``query_start_loc``."""
    w, iw, kv, ik, bt, hidden = build_sparse(CFG, DTYPE, DEVICE, [40, 0, 17], [5, 3, 1], 16,
                                             True, 0)
    qsl = torch.tensor([0, 5, 8, 9], dtype=torch.int32, device=DEVICE)
    args = (w, iw, hidden, qsl, [40, 0, 17], kv, ik, bt)
    checked = fast_sparse.sparse_prefill_forward(*args)
    reads = []
    for name in ("tolist", "item"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, **k):
            if self.device.type == DEVICE:
                reads.append(tuple(self.shape))
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    unchecked = fast_sparse.sparse_prefill_forward(*args, validate=False)
    monkeypatch.undo()
    assert reads == [(4,)]
    torch.testing.assert_close(unchecked, checked, rtol=0, atol=0)
    with pytest.raises(TypeError, match="validate must be a bool"):
        fast_sparse.sparse_prefill_forward(*args, validate=None)
