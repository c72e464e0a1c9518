"""DeepSeek-V4's indexer against its definition written as loops (exact and with vLLM's
roundings built by hand), the visibility rule, the short-context fill, ties, and a query
subset against the whole prefill. The selection is a set: rows are compared as sets.

Tolerance: float64 logits are sums over 4 heads of 128-term dot products, about 128 · 2^-53 ≈
1.4e-14 relative to the logits' magnitude at worst; measured 5e-16 (0 with the roundings: e4m3
products and power-of-two scales are exact). The tests allow 1e-13.
"""

from __future__ import annotations

import math

import pytest
import torch

from mla.reference.v4.compressor import CompressorWeights, compress
from mla.reference.v4.config import get_v4_config
from mla.reference.v4.indexer import (
    IndexerV4Weights,
    v4_indexer_k,
    v4_indexer_logits,
    v4_indexer_q,
    v4_indexer_topk,
    v4_indexer_weights,
)
from mla.reference.v4.rope import v4_rope_frequencies

CONFIG = get_v4_config("tiny-v4")  # 4 index heads of 128, top-k 3, hidden 64, q rank 32
H, D, TOPK = CONFIG.index_n_heads, CONFIG.index_head_dim, CONFIG.index_topk
RTOL = 1e-13
F64 = torch.float64
BF16 = torch.bfloat16


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    fin = torch.isfinite(b)
    assert torch.equal(fin, torch.isfinite(a)) and torch.equal(a[~fin], b[~fin])
    if fin.any():
        scale = max(1.0, float(b[fin].abs().max()))
        err = float((a[fin] - b[fin]).abs().max())
        assert err <= rtol * scale, f"max error {err:.3e} > {rtol:.0e} · {scale:.3e}"


def _inputs(L: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, CONFIG.hidden_size, generator=g, dtype=F64),
            torch.randn(L, CONFIG.q_lora_rank, generator=g, dtype=F64))


W = IndexerV4Weights.random(CONFIG, seed=1)


# ---- the definition ---------------------------------------------------------------------------

def _rotate(v: torch.Tensor, p: int) -> torch.Tensor:
    out = v.clone()
    base = v.shape[-1] - CONFIG.rope_head_dim
    for i, f in enumerate(v4_rope_frequencies(CONFIG, 4).tolist()):
        a, b = float(v[base + 2 * i]), float(v[base + 2 * i + 1])
        out[base + 2 * i] = a * math.cos(p * f) - b * math.sin(p * f)
        out[base + 2 * i + 1] = a * math.sin(p * f) + b * math.cos(p * f)
    return out


def _pow2_scale(v: torch.Tensor) -> float:
    return 2.0 ** math.ceil(math.log2(max(float(v.abs().max()), 1e-4) / 448))


def _e4m3(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float8_e4m3fn).to(F64)


def _definition_logits(x: torch.Tensor, qr: torch.Tensor, quantize: bool) -> torch.Tensor:
    """Per query t (position t) and visible entry j < (t+1)//4, as loops; with ``quantize``
    every rounding vLLM's kernels make, built here: bf16 GEMM outputs, the rotated rope
    rounded to bf16, e4m3 per (token, head) and per entry with power-of-two scales."""
    L = x.shape[0]
    keys = compress(x, W.compressor, CONFIG)
    k_val, k_s = [], []
    for e in keys:
        if quantize:
            e = e.to(BF16).to(F64)
            s = _pow2_scale(e)
            k_val.append(_e4m3(e / s))
            k_s.append(s)
        else:
            k_val.append(e)
            k_s.append(1.0)
    out = torch.full((L, keys.shape[0]), float("-inf"), dtype=F64)
    for t in range(L):
        qfull = qr[t] @ W.wq_b.T
        wrow = x[t] @ W.weights_proj.T
        if quantize:
            qfull, wrow = qfull.to(BF16).to(F64), wrow.to(BF16).to(F64)
        qs, ws = [], []
        for h in range(H):
            q = _rotate(qfull[h * D:(h + 1) * D], t)
            s = 1.0
            if quantize:
                q = q.to(BF16).to(F64)
                s = _pow2_scale(q)
                q = _e4m3(q / s)
            qs.append(q)
            ws.append(float(wrow[h]) * s * D ** -0.5 * H ** -0.5)
        for j in range((t + 1) // 4):
            out[t, j] = sum(ws[h] * max(0.0, float(qs[h] @ k_val[j])) for h in range(H)) * k_s[j]
    return out


def _logits(x: torch.Tensor, qr: torch.Tensor, quantize: bool,
            positions: torch.Tensor | None = None) -> torch.Tensor:
    pos = torch.arange(x.shape[0]) if positions is None else positions
    q, q_scale = v4_indexer_q(qr, W, pos, CONFIG, quantize=quantize)
    w = v4_indexer_weights(x[pos], W, CONFIG, q_scale, quantize=quantize)
    k, k_scale = v4_indexer_k(x, W, CONFIG, quantize=quantize)
    return v4_indexer_logits(q, w, k, k_scale, pos)


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("L", [0, 1, 3, 4, 5, 11, 21])
def test_logits_are_the_definition(L, quantize):
    x, qr = _inputs(L, seed=L)
    _close(_logits(x, qr, quantize), _definition_logits(x, qr, quantize))


def test_rounded_logits_are_near_the_exact_ones():
    x, qr = _inputs(24, seed=2)
    exact, rounded = _logits(x, qr, False), _logits(x, qr, True)
    fin = torch.isfinite(exact)
    assert torch.equal(fin, torch.isfinite(rounded))
    # e4m3 keeps 4 significant bits: each product within ~2^-3, and the sums of ReLUs agree
    assert float((rounded[fin] - exact[fin]).abs().max()) < 0.15 * float(exact[fin].abs().max())


def test_q_rounding_and_weight_fold():
    """The q codes are e4m3 numbers, the scales powers of two, and codes · scale is q within
    e4m3's relative step; the weights carry the scale and D^-0.5 · H^-0.5."""
    x, qr = _inputs(6, seed=3)
    pos = torch.arange(6)
    q, s = v4_indexer_q(qr, W, pos, CONFIG)
    q_exact, ones = v4_indexer_q(qr, W, pos, CONFIG, quantize=False)
    assert torch.equal(ones, torch.ones(6, H, dtype=F64))
    assert torch.equal(_e4m3(q), q) and torch.equal(torch.exp2(torch.log2(s).round()), s)
    assert float(((q * s[..., None]) - q_exact).abs().max()) <= 2.0 ** -3 * float(
        q_exact.abs().max())
    w = v4_indexer_weights(x, W, CONFIG, s, quantize=False)
    _close(w, (x @ W.weights_proj.T) * s / math.sqrt(D * H))


def test_logits_hand_built():
    """One head, two entries: ReLU drops the negative dot, the entry scale multiplies, the
    invisible entry is -inf."""
    q = torch.zeros(2, 1, 128, dtype=F64)
    q[:, 0, 0] = 1.0
    k = torch.zeros(2, 128, dtype=F64)
    k[0, 0], k[1, 0] = -2.0, 3.0
    w = torch.tensor([[0.5], [0.25]], dtype=F64)
    ks = torch.tensor([4.0, 8.0], dtype=F64)
    got = v4_indexer_logits(q, w, k, ks, torch.tensor([7, 6]))  # sees 2, then 1 entries
    want = torch.tensor([[0.0, 0.5 * 3 * 8], [0.0, float("-inf")]], dtype=F64)
    assert torch.equal(got, want)


# ---- the selection ----------------------------------------------------------------------------

def _sets(rows: torch.Tensor) -> list[set[int]]:
    return [set(r[r >= 0].tolist()) for r in rows]


@pytest.mark.parametrize("quantize", [False, True])
def test_topk_is_the_definition_as_sets(quantize):
    """L = 40: 10 entries > top-k 3, so the logits decide; each row holds the 3 (or all n_p <=
    3) visible entries of highest definition logit, then -1."""
    x, qr = _inputs(40, seed=4)
    got = v4_indexer_topk(x, qr, torch.arange(40), W, CONFIG, quantize=quantize)
    assert got.dtype == torch.int32 and got.shape == (40, TOPK)
    ref = _definition_logits(x, qr, quantize)
    for t in range(40):
        n = (t + 1) // 4
        want = set(ref[t, :n].argsort(descending=True)[:TOPK].tolist())
        assert _sets(got[[t]])[0] == want
        assert (got[t, min(n, TOPK):] == -1).all()


@pytest.mark.parametrize("L", [0, 1, 4, 15])
def test_short_context_fill(L):
    """L // 4 <= top-k (vLLM: max_seq_len // ratio <= index_topk): no logits, every row
    [0 .. n_p - 1, -1 ..] in ascending order."""
    x, qr = _inputs(L, seed=5)
    got = v4_indexer_topk(x, qr, torch.arange(L), W, CONFIG)
    for t in range(L):
        n = (t + 1) // 4
        assert got[t].tolist() == list(range(n)) + [-1] * (TOPK - n)


def test_rows_with_few_entries_hold_them_all_past_the_fill():
    """L = 16 (4 entries, over top-k 3): logits are computed, yet a row seeing <= 3 entries
    still holds exactly them, as the fill would."""
    x, qr = _inputs(16, seed=6)
    got = v4_indexer_topk(x, qr, torch.arange(16), W, CONFIG)
    for t in range(15):
        assert _sets(got[[t]])[0] == set(range((t + 1) // 4))
    assert len(_sets(got[[15]])[0]) == 3


def test_ties_go_to_the_lower_entry():
    """weights_proj = 0: every visible logit is 0, a tie; the lowest ids are kept, in order."""
    w0 = IndexerV4Weights(W.wq_b, torch.zeros_like(W.weights_proj), W.compressor)
    x, qr = _inputs(32, seed=7)
    got = v4_indexer_topk(x, qr, torch.arange(32), w0, CONFIG)
    assert got[31].tolist() == [0, 1, 2]


def test_a_query_subset_matches_the_whole_prefill():
    x, qr = _inputs(37, seed=8)
    full = v4_indexer_topk(x, qr, torch.arange(37), W, CONFIG)
    pos = torch.tensor([36, 20, 21, 5])
    got = v4_indexer_topk(x, qr[pos], pos, W, CONFIG)
    assert _sets(got) == _sets(full[pos])


# ---- bad input --------------------------------------------------------------------------------

def test_bad_input():
    x, qr = _inputs(20)
    pos = torch.arange(20)
    with pytest.raises(ValueError, match="ratio"):
        v4_indexer_topk(x, qr, pos, W, CONFIG, ratio=128)
    with pytest.raises(ValueError, match="compressor"):
        IndexerV4Weights(W.wq_b, W.weights_proj, CompressorWeights.random(64, 128, 128))
    with pytest.raises(ValueError, match="wq_b"):
        IndexerV4Weights(W.wq_b[:5], W.weights_proj, W.compressor)
    with pytest.raises(ValueError, match="qr"):
        v4_indexer_topk(x, qr[:, :5], pos, W, CONFIG)
    with pytest.raises(ValueError, match="positions"):
        v4_indexer_topk(x, qr, pos + 1, W, CONFIG)
    with pytest.raises(TypeError, match="positions"):
        v4_indexer_topk(x, qr, pos.float(), W, CONFIG)
    with pytest.raises(TypeError, match="quantize"):
        v4_indexer_topk(x, qr, pos, W, CONFIG, quantize=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config"):
        v4_indexer_topk(x, qr, pos, W, "tiny-v4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wq_b"):
        v4_indexer_q(qr, W, pos, CONFIG.replace(index_n_heads=8))
    q, s = v4_indexer_q(qr, W, pos, CONFIG)
    w = v4_indexer_weights(x, W, CONFIG, s)
    k, ks = v4_indexer_k(x, W, CONFIG)
    with pytest.raises(ValueError, match="visible"):
        v4_indexer_logits(q, w, k[:2], ks[:2], pos)
    with pytest.raises(ValueError, match="q_scale"):
        v4_indexer_weights(x, W, CONFIG, s[:, :2])
    with pytest.raises(ValueError, match="k_scale"):
        v4_indexer_logits(q, w, k, ks[:1], pos)


def test_a_layers_indexer():
    from mla.reference.front import rms_norm
    from mla.reference.v4.indexer import indexer_topk_for_layer, indexer_weights_of
    from mla.reference.v4.weights import V4LayerWeights
    lw = V4LayerWeights.random(CONFIG, 4, seed=13)
    iw = indexer_weights_of(lw)
    assert torch.equal(iw.wq_b, lw["indexer.wq_b.weight"]) and iw.compressor.ratio == 4
    x, _ = _inputs(30, seed=9)
    q_latent = rms_norm(x @ lw["wq_a.weight"].T, lw["q_norm.weight"], CONFIG.rms_norm_eps)
    pos = torch.arange(30)
    for dtype, quantize in (("float64", False), ("bfloat16", True), ("fp8_ds_mla", True)):
        assert torch.equal(indexer_topk_for_layer(x, q_latent, lw, dtype),
                           v4_indexer_topk(x, q_latent, pos, iw, CONFIG, quantize=quantize))
    with pytest.raises(ValueError, match="ratio"):
        indexer_weights_of(V4LayerWeights.random(CONFIG, 128))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        indexer_topk_for_layer(x, q_latent, lw, "fp8")
