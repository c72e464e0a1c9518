"""DeepSeek-V4's attention layer: the definition (``mla.reference.v4.layer``) against a loop
over tokens written here, and the serving form (``mla.reference.v4.serving``: paged caches,
``sparse_mla_decode`` with two scopes, ``sparse_mla_prefill`` over a workspace) against the
definition, for every layer kind, every cache dtype, MTP steps and ragged batches.

Error budget. The definition and the serving form compute the same float64 numbers in a
different order: attention sums over at most W + n_c keys with weights summing to <= 1, then
two projections of width <= 512, each adding a few 2^-53 relative: measured at most 1.9e-15
over every case here. The bound, 1e-14, leaves 5x for another BLAS's order of summation; it
is far below any convention error (a wrong window edge, a missing sink or a misplaced entry
move the output by more than 1e-3) and within the 1e-10 the serving form is held to. With
bf16 or fp8 caches both sides round the same values at the same points and agree exactly here
(a rounding boundary crossed by a 1e-16 difference would show as one bf16 step, 4e-3, and
fail).
"""

from __future__ import annotations

import math

import pytest
import torch

from mla.reference.v4.config import V4_PRESETS, get_v4_config
from mla.reference.v4.layer import (
    KV_CACHE_DTYPES,
    v4_cache_round,
    v4_layer_definition,
)
from mla.reference.v4.rope import rope_gptj
from mla.reference.v4.serving import V4Cache, v4_layer_step
from mla.reference.v4.weights import V4LayerWeights, v4_weight_shapes

F64 = torch.float64
TINY = get_v4_config("tiny-v4")
SERVING_RTOL = 1e-14


def _x(T: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, TINY.hidden_size, generator=gen, dtype=F64)


def _rms(v: torch.Tensor) -> torch.Tensor:
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + TINY.rms_norm_eps)


def _loop_definition(x: torch.Tensor, w: V4LayerWeights) -> torch.Tensor:
    """The window-only layer token by token, in float64, from the equations alone."""
    c = w.config
    T = x.shape[0]
    pos = torch.arange(T)
    c_q = _rms(x @ w["wq_a.weight"].T) * w["q_norm.weight"]
    c_kv = _rms(x @ w["wkv.weight"].T) * w["kv_norm.weight"]
    q = _rms((c_q @ w["wq_b.weight"].T).view(T, c.num_heads, c.head_dim))
    q = rope_gptj(q, pos, c, 1)
    k = rope_gptj(c_kv, pos, c, 1)
    out = torch.zeros(T, c.hidden_size, dtype=F64)
    for t in range(T):
        keys = k[max(t - c.sliding_window + 1, 0):t + 1]
        heads = []
        for h in range(c.num_heads):
            logits = keys @ q[t, h] / math.sqrt(c.head_dim)
            e = torch.exp(logits)
            sink = math.exp(float(w["attn_sink"][h]))
            heads.append((e[:, None] * keys).sum(0) / (e.sum() + sink))
        o = rope_gptj(torch.stack(heads)[None], pos[t:t + 1], c, 1, inverse=True)[0]
        y = o.reshape(c.o_groups, -1)
        w_a = w["wo_a.weight"].view(c.o_groups, c.o_lora_rank, -1)
        z = torch.stack([w_a[g] @ y[g] for g in range(c.o_groups)])
        out[t] = w["wo_b.weight"] @ z.flatten()
    return out


def test_presets() -> None:
    v4, pro = V4_PRESETS["deepseek-v4"], V4_PRESETS["deepseek-v4-pro"]
    assert (v4.hidden_size, v4.num_heads, v4.q_lora_rank, v4.o_groups, v4.num_layers) == (
        4096, 64, 1024, 8, 43)
    assert v4.compress_ratios[:5] == (1, 1, 4, 128, 4)
    assert (pro.hidden_size, pro.num_heads, pro.q_lora_rank, pro.o_groups, pro.index_topk) == (
        7168, 128, 1536, 16, 1024)
    assert v4.softmax_scale == 512 ** -0.5 and v4.nope_head_dim == 448
    assert v4.layer_ratio(43) == 1  # the MTP layer is window-only
    with pytest.raises(ValueError, match="unknown DeepSeek-V4 preset"):
        get_v4_config("deepseek-v5")
    with pytest.raises(ValueError, match="compress_ratios"):
        TINY.replace(compress_ratios=(1, 3))
    with pytest.raises(ValueError, match="o_groups"):
        TINY.replace(o_groups=3)


def test_weight_names_and_fp8_checkpoint() -> None:
    shapes = v4_weight_shapes(V4_PRESETS["deepseek-v4"], 4)
    assert shapes["wo_a.weight"] == (8 * 1024, 8 * 512)
    assert shapes["compressor.ape"] == (4, 1024)
    assert shapes["indexer.compressor.wkv.weight"] == (256, 4096)
    assert "indexer.wq_b.weight" not in v4_weight_shapes(V4_PRESETS["deepseek-v4"], 128)
    w = V4LayerWeights.random(TINY, 1, seed=3)
    state = w.state_dict("layers.0.attn.")
    # an FP8 block-quantized wq_b with per-128x128-block scales, as the checkpoint holds it
    wq_b = state["layers.0.attn.wq_b.weight"]
    scale = torch.full((math.ceil(wq_b.shape[0] / 128), 1), 2.0 ** -8, dtype=torch.float32)
    state["layers.0.attn.wq_b.weight"] = (wq_b / 2.0 ** -8).to(torch.float8_e4m3fn)
    state["layers.0.attn.wq_b.scale"] = scale
    loaded = V4LayerWeights.from_state_dict(TINY, 1, state, "layers.0.attn.")
    want = (wq_b / 2.0 ** -8).to(torch.float8_e4m3fn).double() * 2.0 ** -8
    assert torch.equal(loaded["wq_b.weight"], want)
    del state["layers.0.attn.kv_norm.weight"]
    with pytest.raises(ValueError, match="kv_norm.weight"):
        V4LayerWeights.from_state_dict(TINY, 1, state, "layers.0.attn.")


def test_definition_is_the_loop_over_tokens() -> None:
    w = V4LayerWeights.random(TINY, 1, seed=5)
    x = _x(19, seed=6)  # a window of 8 slides over 19 tokens
    got = v4_layer_definition(x, w, kv_cache_dtype="float64").out
    want = _loop_definition(x, w)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12 * want.abs().max())


def test_window_and_sink_move_the_output() -> None:
    """Broken twins of the window-only layer: each changes the output far beyond 1e-10."""
    w = V4LayerWeights.random(TINY, 1, seed=7)
    x = _x(20, seed=8)
    base = v4_layer_definition(x, w, kv_cache_dtype="float64").out
    wider = v4_layer_definition(x, V4LayerWeights(TINY.replace(sliding_window=9), 1, w.tensors),
                                kv_cache_dtype="float64").out
    no_sink = V4LayerWeights(TINY, 1, {**w.tensors, "attn_sink": torch.full(
        (TINY.num_heads,), -math.inf, dtype=F64)})
    for twin in (wider, v4_layer_definition(x, no_sink, kv_cache_dtype="float64").out):
        assert (twin - base)[9:].abs().max() > 1e-3 * base.abs().max()
    # tokens whose window has not slid yet (p < 8) do not see the wider window's difference
    assert torch.allclose(wider[:8], base[:8], rtol=0, atol=1e-14)


def test_cache_rounding() -> None:
    k = torch.randn(6, 512, dtype=F64)
    assert torch.equal(v4_cache_round(k, "float64"), k)
    bf = v4_cache_round(k, "bfloat16")
    assert torch.equal(bf, k.to(torch.bfloat16).double())
    fp8 = v4_cache_round(k, "fp8_ds_mla")
    assert torch.equal(fp8[:, 448:], bf[:, 448:])  # RoPE dims stay bf16
    rel = ((fp8 - k)[:, :448].abs() / k[:, :448].abs().clamp_min(1e-3)).max()
    assert 2 ** -6 < rel <= 2 ** -4 + 2 ** -8  # e4m3's half ulp after bf16's
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        v4_cache_round(k, "fp16")


# a ragged batch: a short request, one past the window, one past a page of 64, and one past two
# ratio-128 entries (completed inside a prefill chunk, 127 and 255, and read by decodes)
LENS = (5, 23, 70, 260)
STEPS = ((3, 10, 40, 130), (1, 1, 1, 1), (1, 1, 1, 1), (0, 11, 28, 124), (1, 1, 1, 1),
         (1, 1, 1, 1))


def _serve(w: V4LayerWeights, xs: list[torch.Tensor], steps: tuple[tuple[int, ...], ...],
           path: str, kv_cache_dtype: str) -> list[torch.Tensor]:
    cache = V4Cache.empty(w, len(xs), 300, kv_cache_dtype=kv_cache_dtype, seed=11)
    pos = [0] * len(xs)
    outs: list[list[torch.Tensor]] = [[] for _ in xs]
    for step in steps:
        new = [x[p:p + n] for x, p, n in zip(xs, pos, step)]
        # chunks of many tokens are prefills (vLLM's rule: a decode has <= 1 + MTP tokens)
        chunk = path if max(step) <= 2 else "prefill"
        for b, o in enumerate(v4_layer_step(new, cache, path=chunk)):
            outs[b].append(o)
        pos = [p + n for p, n in zip(pos, step)]
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_serving_equals_definition(ratio: int, path: str, kv_cache_dtype: str) -> None:
    w = V4LayerWeights.random(TINY, ratio, seed=ratio)
    xs = [_x(L, seed=20 + i) for i, L in enumerate(LENS)]
    steps = tuple(tuple(min(n, L - sum(s[b] for s in STEPS[:i])) for b, (n, L) in
                        enumerate(zip(step, LENS))) for i, step in enumerate(STEPS))
    served = _serve(w, xs, steps, path, kv_cache_dtype)
    for x, got in zip(xs, served):
        want = v4_layer_definition(x[:got.shape[0]], w, kv_cache_dtype=kv_cache_dtype).out
        err = (got - want).abs().max() / want.abs().max()
        assert err <= SERVING_RTOL, err


@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_mtp_decode_rows_have_their_own_windows(ratio: int) -> None:
    """s_q = 2 decode steps (MTP): each token its own row, its own window and compressed
    entries: a pair can complete an entry at its second token (positions 11, 15; 255)."""
    w = V4LayerWeights.random(TINY, ratio, seed=31)
    first = 254 if ratio == 128 else 10
    x = _x(first + 6, seed=32)
    served = _serve(w, [x], ((first,), (2,), (2,), (2,)), "decode", "fp8_ds_mla")[0]
    want = v4_layer_definition(x, w, kv_cache_dtype="fp8_ds_mla").out
    assert (served - want).abs().max() <= SERVING_RTOL * want.abs().max()


def test_bad_input() -> None:
    w = V4LayerWeights.random(TINY, 1)
    with pytest.raises(ValueError, match="x must have shape"):
        v4_layer_definition(torch.zeros(3, 7, dtype=F64), w)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        v4_layer_definition(_x(3, 0), w, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="topk is only for ratio-4"):
        v4_layer_definition(_x(3, 0), w, topk=torch.zeros(3, 3, dtype=torch.int32))
    cache = V4Cache.empty(w, 2, 8)
    with pytest.raises(ValueError, match="list of 2 tensors"):
        v4_layer_step([_x(1, 0)], cache)
    with pytest.raises(ValueError, match="path must be"):
        v4_layer_step([_x(1, 0), _x(1, 1)], cache, path="chunked")
    with pytest.raises(ValueError, match="weight 'wkv.weight' must have shape"):
        V4LayerWeights(TINY, 1, {**w.tensors, "wkv.weight": torch.zeros(3, 3, dtype=F64)})


def test_empty_and_single_token() -> None:
    w = V4LayerWeights.random(TINY, 1, seed=41)
    assert v4_layer_definition(_x(0, 0), w).out.shape == (0, TINY.hidden_size)
    one = v4_layer_definition(_x(1, 42), w, kv_cache_dtype="float64")
    assert torch.allclose(one.out, _loop_definition(_x(1, 42), w), rtol=1e-12, atol=1e-13)
