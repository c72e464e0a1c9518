"""DeepSeek-V4's compressor against its definition written as loops over tokens, hand-built
windows, the serving step against the stateless form for every split, and the storage rounding.

Tolerance: everything is float64. An entry is a GEMM over 64 hidden dims, a softmax and a sum
over at most 128 tokens, an RMSNorm over at most 512 dims and a rotation: the longest sum
bounds the error by about 512 · 2^-53 ≈ 6e-14 relative to the entries' magnitude (the GEMMs may
block their sums differently from the loops here, or between steps). Measured: 7e-16. The
tests allow 1e-13.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from mla.reference.fp8_model1 import dequantize_fp8_model1
from mla.reference.v4.compressor import (
    CompressorState,
    CompressorWeights,
    V41CompressorWeights,
    compress,
    compress_pool,
    compressed_entries_model1_pages,
    compressor_init_state,
    compressor_kv_score,
    compressor_step,
    quantize_compressed_indexer_entries,
    round_compressed_entries,
    v41_compress,
    v41_compress_latent,
    v41_index_key,
)
from mla.reference.v4.config import get_v4_config
from mla.reference.v4.rope import v4_rope_frequencies

CONFIG = get_v4_config("tiny-v4")
HIDDEN = CONFIG.hidden_size
RTOL = 1e-13
F64 = torch.float64


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    if b.numel() == 0:
        return
    scale = max(1.0, float(b.abs().max()))
    err = float((a - b).abs().max())
    assert err <= rtol * scale, f"max error {err:.3e} > {rtol:.0e} · {scale:.3e}"


def _x(T: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=F64)


# ---- the definition, token by token -----------------------------------------------------------

def _definition(x: torch.Tensor, w: CompressorWeights) -> torch.Tensor:
    """Entry j at each p with (p+1) % r == 0: softmax over the window's unmasked tokens (the
    previous block's through channels [0, d), the own block's through the last d channels),
    the pooled row normed, then rotated by GPT-J pairs on its last 64 dims at j·r."""
    r, d = w.ape.shape[0], w.norm.shape[0]
    coff = 2 if r == 4 else 1
    kv = [x[p] @ w.wkv.T for p in range(x.shape[0])]
    sc = [x[p] @ w.wgate.T + w.ape[p % r] for p in range(x.shape[0])]
    freqs = v4_rope_frequencies(CONFIG, r)
    rows = []
    for p in range(x.shape[0]):
        if (p + 1) % r:
            continue
        j = p // r
        ks, ss = [], []
        for i in range(coff * r):
            q = p - coff * r + 1 + i
            if q < 0:
                continue
            c = i // r
            ks.append(kv[q][c * d:(c + 1) * d])
            ss.append(sc[q][c * d:(c + 1) * d])
        K, S = torch.stack(ks), torch.stack(ss)
        e = torch.exp(S - S.max(dim=0).values)
        pooled = (e * K).sum(0) / e.sum(0)
        n = pooled / math.sqrt(float((pooled ** 2).mean()) + CONFIG.rms_norm_eps) * w.norm
        out = n.clone()
        base = d - CONFIG.rope_head_dim
        for i, f in enumerate(freqs.tolist()):
            ang = j * r * f
            a, b = float(n[base + 2 * i]), float(n[base + 2 * i + 1])
            out[base + 2 * i] = a * math.cos(ang) - b * math.sin(ang)
            out[base + 2 * i + 1] = a * math.sin(ang) + b * math.cos(ang)
        rows.append(out)
    return torch.stack(rows) if rows else torch.zeros(0, d, dtype=F64)


CASES = [(4, 512), (128, 512), (4, 128)]


@pytest.mark.parametrize("ratio,d", CASES)
def test_compress_is_the_definition(ratio, d):
    w = CompressorWeights.random(HIDDEN, d, ratio, seed=ratio + d)
    r = ratio
    lengths = {0, 1, r - 1, r, r + 1, 2 * r + 3} | ({9, 17} if r == 4 else {3 * r + 1})
    for T in sorted(lengths):
        x = _x(T, seed=T)
        got = compress(x, w, CONFIG)
        assert got.dtype == F64 and got.shape == (T // r, d)
        _close(got, _definition(x, w))


def test_bf16_inputs_are_computed_in_float64():
    w = CompressorWeights.random(HIDDEN, 512, 4, seed=3, dtype=torch.bfloat16)
    w64 = CompressorWeights(*(t.to(F64) for t in (w.wkv, w.wgate, w.ape, w.norm)))
    x = _x(13).to(torch.bfloat16)
    _close(compress(x, w, CONFIG), _definition(x.to(F64), w64))


# ---- hand-built windows -----------------------------------------------------------------------

def test_nine_tokens_ratio_four_by_hand():
    """r = 4, 9 tokens: entries 0 and 1; entry 0 pools its own 4 tokens (channels [d, 2d)),
    its previous half (positions -4..-1) masked; entry 1 pools tokens 0..3 through [0, d) and
    4..7 through [d, 2d); token 8 closes no window. A constant score makes each a mean."""
    d = 3
    kv = torch.arange(9 * 2 * d, dtype=F64).view(9, 2 * d)
    score = torch.full_like(kv, 0.7)
    got = compress_pool(kv, score, 4, True)
    want0 = kv[0:4, d:].mean(0)
    want1 = torch.cat([kv[0:4, :d], kv[4:8, d:]]).mean(0)
    _close(got, torch.stack([want0, want1]))


def test_one_large_score_selects_one_token():
    d = 2
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(8, 2 * d, generator=g, dtype=F64)
    score = torch.zeros(8, 2 * d, dtype=F64)
    score[2, 0] = 1000.0  # entry 1, channel 0: the previous block's token 2 (slice [0, d))
    score[6, d + 1] = 1000.0  # entry 1, channel 1: the own block's token 6 (slice [d, 2d))
    got = compress_pool(kv, score, 4, True)
    assert got[1, 0] == kv[2, 0] and got[1, 1] == kv[6, d + 1]
    # ratio 128, no overlap: one token of the block
    kv = torch.randn(128, d, generator=g, dtype=F64)
    score = torch.zeros(128, d, dtype=F64)
    score[77] = 1000.0
    assert torch.equal(compress_pool(kv, score, 128, False)[0], kv[77])


def test_sharp_and_large_values_stay_finite():
    """Scores of ±1e4 (exp overflows without the max subtracted) and kv of 1e150."""
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(16, 8, generator=g, dtype=F64) * 1e150
    score = torch.randn(16, 8, generator=g, dtype=F64) * 1e4
    got = compress_pool(kv, score, 4, True)
    assert torch.isfinite(got).all()
    # each channel's pooled value is the kv of its window's largest score (others underflow)
    w = torch.cat([score[4:8, :4], score[8:12, 4:]])
    v = torch.cat([kv[4:8, :4], kv[8:12, 4:]])
    assert torch.equal(got[2], v.gather(0, w.argmax(0, keepdim=True))[0])


def test_nan_reaches_exactly_the_windows_that_hold_it():
    """r = 4 with overlap, 13 tokens, entries 0..2: a NaN in token 5 poisons entry 1 (its own
    block) and entry 2 (its previous block), not entry 0; a NaN in token 12, in no closed
    window, poisons nothing."""
    w = CompressorWeights.random(HIDDEN, 128, 4, seed=5)
    x = _x(13)
    clean = compress(x, w, CONFIG)
    y = x.clone()
    y[5, 3] = float("nan")
    got = compress(y, w, CONFIG)
    assert torch.isnan(got[1]).all() and torch.isnan(got[2]).all()
    assert torch.equal(got[0], clean[0])
    y = x.clone()
    y[12, 0] = float("nan")
    assert torch.equal(compress(y, w, CONFIG), clean)


def test_kv_score_applies_ape_by_position_mod_r():
    w = CompressorWeights.random(HIDDEN, 128, 4, seed=6)
    x = _x(3)
    pos = torch.tensor([5, 8, 11])
    kv, score = compressor_kv_score(x, w, pos)
    _close(kv, x @ w.wkv.T)
    _close(score, x @ w.wgate.T + w.ape[[1, 0, 3]])


# ---- the serving step -------------------------------------------------------------------------

def _stepped(x: torch.Tensor, w: CompressorWeights, cuts: list[int]) -> torch.Tensor:
    state = compressor_init_state(w)  # NaN rows: a position < 0 must never be read
    outs = []
    for a, b in zip([0, *cuts], [*cuts, x.shape[0]]):
        e, state = compressor_step(state, x[a:b], w, CONFIG)
        assert e.shape == (b // w.ratio - a // w.ratio, w.head_dim)
        outs.append(e)
    assert state.length == x.shape[0]
    return torch.cat(outs)


def test_step_equals_stateless_for_every_split_ratio_four():
    """Every split of 11 tokens into up to three steps (cuts mid-block and at block edges),
    and one token at a time."""
    w = CompressorWeights.random(HIDDEN, 512, 4, seed=7)
    x = _x(11)
    want = compress(x, w, CONFIG)
    for cuts in itertools.combinations_with_replacement(range(12), 2):
        _close(_stepped(x, w, list(cuts)), want)
    _close(_stepped(x, w, list(range(1, 11))), want)


def test_step_equals_stateless_ratio_128():
    w = CompressorWeights.random(HIDDEN, 512, 128, seed=8)
    x = _x(260)
    want = compress(x, w, CONFIG)
    for cuts in ([1], [127], [128], [129], [127, 128, 129], [100, 255, 256], [259]):
        _close(_stepped(x, w, cuts), want)


def test_step_state_holds_the_last_window():
    w = CompressorWeights.random(HIDDEN, 128, 4, seed=9)
    x = _x(10)
    _, state = compressor_step(compressor_init_state(w), x, w, CONFIG)
    kv, score = compressor_kv_score(x[2:], w, torch.arange(2, 10))
    _close(state.kv, kv)
    _close(state.score, score)


# ---- storage ----------------------------------------------------------------------------------

def _e4m3(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float8_e4m3fn).to(F64)


def test_model1_rounding_bf16_before_e4m3_and_rope_once():
    """A tile of amax 448 (scale 1): 1.0625 + 2^-12 rounds to 1.125 in e4m3 directly but to
    bf16 1.0625 first, a tie, then to 1.0 (even), as the kernels round. The rope half is its
    bf16."""
    e = torch.zeros(1, 512, dtype=F64)
    e[0, 0], e[0, 1] = 448.0, 1.0625 + 2.0 ** -12
    e[0, 448:] = torch.linspace(-3, 3, 64, dtype=F64) + 1e-5
    got = round_compressed_entries(e)
    assert got[0, 0] == 448.0 and got[0, 1] == 1.0
    assert torch.equal(got[0, 448:], e[0, 448:].to(torch.bfloat16).to(F64))


def test_model1_scale_floors():
    """A tile of amax 1e-5: the CuTe floor (max(amax/448, 1e-4)) gives the scale 2^-13, the
    Triton floor (max(amax, 1e-4)/448) 2^-22; above amax = 448·2^-14 they agree."""
    e = torch.zeros(1, 512, dtype=F64)
    e[0, :64] = torch.linspace(-1e-5, 1e-5, 64, dtype=F64)
    e[0, 64:128] = torch.linspace(-0.03, 0.03, 64, dtype=F64)
    nope = e[0, :128].to(torch.bfloat16).to(F64)
    cute = round_compressed_entries(e)
    triton = round_compressed_entries(e, scale_floor="vllm")
    assert torch.equal(cute[0, :64], _e4m3(nope[:64] / 2.0 ** -13) * 2.0 ** -13)
    assert torch.equal(triton[0, :64], _e4m3(nope[:64] / 2.0 ** -22) * 2.0 ** -22)
    assert not torch.equal(cute[0, :64], triton[0, :64])
    assert torch.equal(cute[0, 64:], triton[0, 64:])


@pytest.mark.parametrize("scale_floor", ["flashmla", "vllm"])
def test_model1_pages_hold_the_rounded_entries(scale_floor):
    w = CompressorWeights.random(HIDDEN, 512, 4, seed=10)
    e = compress(_x(24), w, CONFIG)  # 6 entries
    pages = compressed_entries_model1_pages(e, 3, scale_floor=scale_floor)
    held = dequantize_fp8_model1(pages, 3).reshape(6, 512).to(F64)
    assert torch.equal(held, round_compressed_entries(e, scale_floor=scale_floor))
    _close(held, e, rtol=2.0 ** -4)


def test_indexer_entry_rounding_one_pow2_scale():
    g = torch.Generator().manual_seed(11)
    e = torch.randn(5, 128, generator=g, dtype=F64)
    e[1] *= 1e-8  # amax below the floor: scale 2^ceil(log2(1e-4 / 448))
    got = round_compressed_entries(e)
    b = e.to(torch.bfloat16).to(F64)
    amax = b.abs().amax(1).clamp_min(1e-4)
    scale = torch.pow(2.0, torch.ceil(torch.log2(amax / 448)))
    assert torch.equal(got, _e4m3(b / scale[:, None]) * scale[:, None])
    codes, s = quantize_compressed_indexer_entries(e)
    assert codes.dtype == torch.uint8 and torch.equal(s.to(F64), scale)


# ---- bad input --------------------------------------------------------------------------------

def test_bad_input():
    w = CompressorWeights.random(HIDDEN, 128, 4)
    with pytest.raises(ValueError, match="ratio"):
        CompressorWeights.random(HIDDEN, 128, 2)
    with pytest.raises(ValueError, match="ape"):
        CompressorWeights(w.wkv, w.wgate, w.ape[:, :128], w.norm)
    with pytest.raises(ValueError, match="wgate"):
        CompressorWeights(w.wkv, w.wgate[:, :3], w.ape, w.norm)
    with pytest.raises(TypeError, match="wkv"):
        CompressorWeights(w.wkv.long(), w.wgate, w.ape, w.norm)
    with pytest.raises(ValueError, match="x"):
        compress(_x(4)[:, :5], w, CONFIG)
    with pytest.raises(ValueError, match="positions"):
        compressor_kv_score(_x(2), w, torch.tensor([0, -1]))
    kv = torch.zeros(8, 6, dtype=F64)
    with pytest.raises(ValueError, match="overlap"):
        compress_pool(kv, kv, 128, True)
    with pytest.raises(ValueError, match="ratio"):
        compress_pool(kv, kv, 8, False)
    with pytest.raises(ValueError, match="coff"):
        compress_pool(kv[:, :5], kv[:, :5], 4, True)
    with pytest.raises(ValueError, match="score"):
        compress_pool(kv, kv[:4], 4, True)
    with pytest.raises(TypeError, match="state"):
        compressor_step(None, _x(1), w, CONFIG)  # type: ignore[arg-type]
    st = compressor_init_state(w)
    with pytest.raises(ValueError, match="state.kv"):
        compressor_step(CompressorState(st.kv[1:], st.score, 0), _x(1), w, CONFIG)
    with pytest.raises(ValueError, match="state.length"):
        compressor_step(CompressorState(st.kv, st.score, -1), _x(1), w, CONFIG)
    with pytest.raises(ValueError, match="entries"):
        round_compressed_entries(torch.zeros(2, 100, dtype=F64))
    with pytest.raises(ValueError, match="scale_floor"):
        round_compressed_entries(torch.zeros(2, 512, dtype=F64), scale_floor="cute")
    with pytest.raises(ValueError, match="block_size"):
        compressed_entries_model1_pages(torch.zeros(3, 512, dtype=F64), 2)


# ---- a layer's compressor ---------------------------------------------------------------------

def test_a_layers_compressed_cache_entries():
    from mla.reference.v4.compressor import compressed_cache_entries, compressor_weights_of
    from mla.reference.v4.weights import V4LayerWeights
    lw = V4LayerWeights.random(CONFIG, 128, seed=12)
    w = compressor_weights_of(lw)
    assert w.ratio == 128 and w.head_dim == 512 and torch.equal(w.ape, lw["compressor.ape"])
    x = _x(260)
    exact = compress(x, w, CONFIG)
    assert torch.equal(compressed_cache_entries(x, lw, "float64"), exact)
    assert torch.equal(compressed_cache_entries(x, lw, "bfloat16"),
                       exact.to(torch.bfloat16).to(F64))
    assert torch.equal(compressed_cache_entries(x, lw), round_compressed_entries(exact))
    assert compressor_weights_of(V4LayerWeights.random(CONFIG, 4),
                                 "indexer.compressor.").norm.shape == (128,)
    with pytest.raises(ValueError, match="compressor"):
        compressor_weights_of(V4LayerWeights.random(CONFIG, 1))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        compressed_cache_entries(x, lw, "fp8")


# ---- DeepSeek-V4.1: ratios 1 and 2, no ape, no overlap ----------------------------------------

def _v41_definition(x: torch.Tensor, w: V41CompressorWeights) -> torch.Tensor:
    """The unrounded latents token by token: ratio 1 normalizes each token's kv; ratio 2 pools
    the pair (2j, 2j+1) by a per-channel softmax of the gate's scores (no ape), then RMSNorm."""
    r, d = w.ratio, w.norm.shape[0]
    latents = []
    for j in range(x.shape[0] // r):
        toks = [j * r + i for i in range(r)]
        kvs = [w.wkv @ x[q] for q in toks]
        if r == 1:
            c = kvs[0]
        else:
            c = torch.zeros(d, dtype=F64)
            for e in range(d):
                s = [float(w.wgate[e] @ x[q]) for q in toks]
                m = max(s)
                den = sum(math.exp(v - m) for v in s)
                c[e] = sum(math.exp(s[i] - m) / den * float(kvs[i][e]) for i in range(r))
        rms = math.sqrt(float((c * c).mean()) + CONFIG.rms_norm_eps)
        latents.append(c / rms * w.norm)
    return torch.stack(latents) if latents else torch.zeros(0, d, dtype=F64)


def _v41_rotate(latents: torch.Tensor, r: int) -> torch.Tensor:
    """Entry j: the compressed layers' GPT-J rotation of the last 64 dims at j·r."""
    d = latents.shape[1]
    freqs = v4_rope_frequencies(CONFIG, 4)
    out = latents.clone()
    for j in range(latents.shape[0]):
        for i in range(len(freqs)):
            a, b = float(latents[j, d - 64 + 2 * i]), float(latents[j, d - 64 + 2 * i + 1])
            ang = (j * r) * float(freqs[i])
            out[j, d - 64 + 2 * i] = a * math.cos(ang) - b * math.sin(ang)
            out[j, d - 64 + 2 * i + 1] = a * math.sin(ang) + b * math.cos(ang)
    return out


@pytest.mark.parametrize("ratio,T", [(1, 0), (1, 1), (1, 9), (2, 1), (2, 2), (2, 9), (2, 16)])
def test_v41_compress_is_the_definition(ratio, T):
    w = V41CompressorWeights.random(HIDDEN, 128, ratio, seed=ratio)
    x = _x(T, seed=T)
    exact = v41_compress_latent(x, w, CONFIG.rms_norm_eps, bf16=False)
    assert exact.shape == (T // ratio, 128)
    _close(exact, _v41_definition(x, w))
    rounded = v41_compress_latent(x, w, CONFIG.rms_norm_eps)
    assert torch.equal(rounded, exact.to(torch.bfloat16).to(F64))
    for bf16, latent in ((False, exact), (True, rounded)):
        _close(v41_compress(x, w, CONFIG, bf16=bf16), _v41_rotate(latent, ratio))


def test_v41_ratio_two_pools_pairs_without_overlap_or_ape():
    """Entry j reads only tokens 2j and 2j+1: changing token 2j+2 leaves entry j alone, and the
    softmax depends on the scores only (a shift of x's gate by the position would be ape)."""
    w = V41CompressorWeights.random(HIDDEN, 128, 2, seed=3)
    x = _x(8, seed=4)
    base = v41_compress_latent(x, w, CONFIG.rms_norm_eps, bf16=False)
    y = x.clone()
    y[4] = 100.0
    moved = v41_compress_latent(y, w, CONFIG.rms_norm_eps, bf16=False)
    assert torch.equal(moved[:2], base[:2]) and torch.equal(moved[3], base[3])
    assert not torch.equal(moved[2], base[2])
    # the same pair at other positions pools to the same latent (no positional term)
    z = torch.cat([x[2:4], x[2:4]])
    lat = v41_compress_latent(z, w, CONFIG.rms_norm_eps, bf16=False)
    assert torch.equal(lat[0], lat[1])
    _close(lat[0], base[1])


def test_v41_ratio_one_is_the_normed_projection():
    w = V41CompressorWeights.random(HIDDEN, 512, 1, seed=5)
    x = _x(5, seed=6)
    kv = x @ w.wkv.T
    want = kv / torch.sqrt((kv * kv).mean(-1, keepdim=True) + CONFIG.rms_norm_eps) * w.norm
    _close(v41_compress_latent(x, w, CONFIG.rms_norm_eps, bf16=False), want)
    # the rotation is at j (ratio 1) with the compressed rotary: the nope dims pass through
    e = v41_compress(x, w, CONFIG)
    lat = v41_compress_latent(x, w, CONFIG.rms_norm_eps)
    assert torch.equal(e[:, :448], lat[:, :448]) and torch.equal(e[0], lat[0])


def test_v41_index_key_norm_then_rope_in_bf16():
    w = V41CompressorWeights.random(HIDDEN, 512, 2, seed=7)
    x = _x(10, seed=8)
    latent = v41_compress_latent(x, w, CONFIG.rms_norm_eps)
    g = torch.Generator().manual_seed(9)
    wk = torch.randn(128, 512, generator=g, dtype=F64) * 512 ** -0.5
    k_norm = 1.0 + 0.1 * torch.randn(128, generator=g, dtype=F64)
    key = v41_index_key(latent, wk, k_norm, 2, CONFIG)
    assert key.shape == (5, 128)
    assert torch.equal(key, key.to(torch.bfloat16).to(F64))
    pre = (latent @ wk.T).to(torch.bfloat16).to(F64)
    normed = (pre / torch.sqrt((pre * pre).mean(-1, keepdim=True) + CONFIG.rms_norm_eps)
              * k_norm).to(torch.bfloat16).to(F64)
    assert torch.equal(key[:, :64], normed[:, :64])  # nope dims: only the roundings
    assert torch.equal(key[0], normed[0])  # entry 0 rotates by 0
    freqs = v4_rope_frequencies(CONFIG, 4)
    j = 3
    a, b = normed[j, 64::2], normed[j, 65::2]
    ang = 2 * j * freqs
    rot = torch.stack([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], -1)
    _close(key[j, 64:], rot.flatten().to(torch.bfloat16).to(F64), 2 ** -7)


def test_v41_bad_input():
    with pytest.raises(ValueError):
        V41CompressorWeights.random(HIDDEN, 128, 4)
    w = V41CompressorWeights.random(HIDDEN, 128, 2)
    with pytest.raises(ValueError):
        V41CompressorWeights(wkv=w.wkv, norm=w.norm, wgate=w.wgate[:, :3])
    with pytest.raises(TypeError):
        v41_compress_latent(_x(4), CompressorWeights.random(HIDDEN, 128, 4), 1e-6)
    with pytest.raises(ValueError):
        v41_index_key(torch.zeros(2, 128, dtype=F64), torch.zeros(128, 128, dtype=F64),
                      torch.ones(128, dtype=F64), 4, CONFIG)
