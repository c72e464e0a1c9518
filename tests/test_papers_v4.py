"""papers/derivation.md, DeepSeek-V4's equations: the sink (31), (32) and the MODEL1 page (33),
(34), each checked against the functions that implement it and the numbers the paper states."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from mla.reference.fp8 import quantize_fp8_ds_mla
from mla.reference.fp8_model1 import (
    FP8_MODEL1_BYTES,
    dequantize_fp8_model1,
    fp8_model1_page_bytes,
    quantize_fp8_model1,
)
from mla.reference.merge import merge_attn_states_list
from mla.reference.sink import apply_attn_sink
from mla.reference.sparse import sparse_mla_decode, sparse_mla_prefill

TEXT = (Path(__file__).resolve().parents[1] / "papers" / "derivation.md").read_text()


def _sink_by_definition(logits: torch.Tensor, v: torch.Tensor, sink: torch.Tensor
                        ) -> torch.Tensor:
    """(7) over the keys plus the key ⊥ of logit ``sink`` and value 0: ``logits [Sq, N, S]``,
    ``v [S, Dv]``, ``sink [N]``."""
    with_bot = torch.cat([logits, sink[None, :, None].expand(*logits.shape[:2], 1)], dim=-1)
    v_bot = torch.cat([v, v.new_zeros(1, v.shape[1])])
    return torch.softmax(with_bot, dim=-1) @ v_bot


def test_eq31_a_sink_is_one_more_key_whose_value_is_zero():
    g = torch.Generator().manual_seed(31)
    s_q, n, d, s_kv = 5, 4, 24, 9
    q = torch.randn(s_q, n, d, generator=g, dtype=torch.float64) * 2
    kv = torch.randn(s_kv, d, generator=g, dtype=torch.float64)
    idx = torch.arange(s_kv, dtype=torch.int32).expand(s_q, s_kv).contiguous()
    sink = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    scale = d ** -0.5
    o, _, lse = sparse_mla_prefill(q, kv, idx, scale, d_v=d)
    o_z, _, lse_z = sparse_mla_prefill(q, kv, idx, scale, d_v=d, attn_sink=sink)
    logits = scale * torch.einsum("tnd,sd->tns", q, kv)
    expected = _sink_by_definition(logits, kv, sink.double())
    assert torch.equal(lse_z, lse)  # "lse unchanged"
    assert (o_z - expected).abs().max() < 1e-12
    assert (apply_attn_sink(o, lse, sink) - expected).abs().max() < 1e-12
    # the broken twin: the sink's own share sigmoid(ζ − lse) in place of sigmoid(lse − ζ)
    wrong = o * torch.sigmoid(sink.double() - lse)[..., None]
    assert (wrong - expected).abs().max() > 1e-2
    # the corners the paper derives: +inf zeroes the output, -inf leaves it bit for bit
    inf = float("inf")
    assert torch.equal(apply_attn_sink(o, lse, torch.full((n,), inf)), torch.zeros_like(o))
    assert torch.equal(apply_attn_sink(o, lse, torch.full((n,), -inf)), o)


def test_eq32_the_sink_is_applied_once_after_the_merge():
    """Two scopes of sparse_mla_decode are (17) over two parts, then the sink once; a sink per
    part is not. The paper's two equal halves with ζ = lse: 1/3 per half instead of 1/2."""
    g = torch.Generator().manual_seed(32)
    n, d, dv, bs = 2, 16, 8, 4
    # V is a row's first dv columns; q is zero there, so the logits see only the rest: two
    # caches with the same keys and different values have equal lse_a, and lse = lse_a + ln 2
    q = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64)
    q[..., :dv] = 0
    keys = torch.randn(bs, d - dv, generator=g, dtype=torch.float64)
    k1, k2 = (torch.cat([torch.randn(bs, dv, generator=g, dtype=torch.float64), keys],
                        dim=1)[None] for _ in range(2))
    idx = torch.arange(bs, dtype=torch.int32)[None, None]
    scale = d ** -0.5
    o1, lse1 = sparse_mla_decode(q, k1, idx, scale, False, head_dim_v=dv)
    o2, lse2 = sparse_mla_decode(q, k2, idx, scale, False, head_dim_v=dv)
    assert torch.allclose(lse1, lse2, rtol=0, atol=1e-12)
    o, lse = merge_attn_states_list([o1[0], o2[0]], [lse1[0], lse2[0]])
    sink = lse[:, 0].float()  # ζ_n = lse of the whole key set
    o_union, lse_union = sparse_mla_decode(q, k1, idx, scale, False, head_dim_v=dv,
                                           attn_sink=sink, extra_k_cache=k2,
                                           extra_indices_in_kvcache=idx)
    assert torch.allclose(lse_union[0], lse, rtol=0, atol=1e-12)
    once = apply_attn_sink(o, lse.T, sink)
    assert (o_union[0] - once).abs().max() < 1e-6  # the sink is float32: ζ rounded once
    per_part, _ = merge_attn_states_list(
        [apply_attn_sink(o1[0], lse1[0].T, sink), apply_attn_sink(o2[0], lse2[0].T, sink)],
        [lse1[0], lse2[0]])
    assert "`sigmoid(−ln 2) = 1/3`" in TEXT and "`sigmoid(0) = 1/2`" in TEXT
    assert torch.sigmoid(torch.tensor(-math.log(2))).item() == pytest.approx(1 / 3)
    assert (per_part - once * (1 / 3) / (1 / 2)).abs().max() < 1e-6
    assert (per_part - once).abs().max() > 1e-2  # the twin the paper warns of


def _model1_cache(bs: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, bs, 512, generator=g) * torch.logspace(-3, 1, 512)


@pytest.mark.parametrize("bs", [1, 3, 64])
def test_eq33_the_page_holds_the_data_rows_then_the_scales(bs: int):
    k_cache = _model1_cache(bs, seed=bs)
    pages = quantize_fp8_model1(k_cache)
    page_bytes = 576 * -(-584 * bs // 576)
    assert pages.shape == (2, page_bytes) and fp8_model1_page_bytes(bs) == page_bytes
    deq = dequantize_fp8_model1(pages, bs)
    for k in range(2):
        for w in range(bs):
            data = pages[k, 576 * w: 576 * w + 576]
            codes = pages[k, 576 * bs + 8 * w: 576 * bs + 8 * w + 7]
            scale = torch.pow(2.0, codes.float() - 127).repeat_interleave(64)
            nope = data[:448].view(torch.float8_e4m3fn).float() * scale
            assert torch.equal(deq[k, w, :448], nope.to(torch.bfloat16))
            assert torch.equal(data[448:].view(torch.bfloat16), k_cache[k, w, 448:].bfloat16())
    assert not pages[:, 584 * bs:].any()  # the padding (written zero here)
    if bs > 1:  # the broken twin: token 1 read as an interleaved 584-byte record
        assert not torch.equal(pages[0, 584: 584 + 448], pages[0, 576: 576 + 448])


def test_eq34_ue8m0_scales_and_the_round_trip_bound():
    k_cache = _model1_cache(4, seed=34)
    pages = quantize_fp8_model1(k_cache)
    codes = pages[:, 576 * 4:].view(2, -1)[:, : 8 * 4].reshape(2, 4, 8)[..., :7]
    nope = k_cache[..., :448].unflatten(-1, (7, 64))
    sigma = torch.pow(2.0, torch.log2((nope.abs().amax(-1) / 448).clamp_min(1e-4)).ceil())
    assert torch.equal(codes.float(), torch.log2(sigma) + 127)  # (34): ue8m0 = log2 σ_T + 127
    err = (dequantize_fp8_model1(pages, 4)[..., :448].float() - k_cache[..., :448]).abs()
    bound = torch.maximum(2.0 ** -4 * k_cache[..., :448].abs(),
                          2.0 ** -10 * sigma.repeat_interleave(64, dim=-1))
    assert (err <= bound).all() and (err > bound / 4).any()  # the bound is nearly reached
    # the byte range the paper states: the floor's 2^-13 is byte 114, float32's largest 247
    floor = quantize_fp8_model1(torch.zeros(1, 1, 512))[0, 576:583]
    top = quantize_fp8_model1(torch.full((1, 1, 512), torch.finfo(torch.float32).max))
    assert floor.tolist() == [114] * 7 and top[0, 576:583].tolist() == [247] * 7
    assert "byte 114" in TEXT and "byte 247" in TEXT
    # the overflow corner the paper states: below 248·2^120 finite, above it ∞
    edge = torch.tensor([247.9, 248.1]).mul(2.0 ** 120)[:, None, None].expand(2, 1, 512)
    back = dequantize_fp8_model1(quantize_fp8_model1(edge), 1)[:, 0, 0]
    assert torch.isfinite(back[0]) and torch.isposinf(back[1])
    assert "`|z| < 248·2^{120} ≈ 3.3·10^{38}`" in TEXT


def test_the_model1_sizes_the_paper_states():
    ds_mla = quantize_fp8_ds_mla(torch.zeros(1, 512), torch.zeros(1, 64)).shape[-1]
    bf16 = 512 * 2
    assert (FP8_MODEL1_BYTES, ds_mla) == (584, 656)
    section = TEXT.split("### 10.1", 1)[1].split("## 11.", 1)[0]
    match = re.search(r"for `b = (\d+)`, a page is (\d+) bytes, (\d+) of\s+them padding, "
                      r"(\d+) bytes a token", section)
    assert match, "the padding example after (33) is gone"
    b, page, pad, per_token = map(int, match.groups())
    assert fp8_model1_page_bytes(b) == page and page - 584 * b == pad
    assert round(page / b) == per_token
    assert f"{ds_mla - FP8_MODEL1_BYTES} bytes fewer" in section and ds_mla - 584 == 64 + 8
    assert f"{bf16}/{FP8_MODEL1_BYTES} ≈ {bf16 / FP8_MODEL1_BYTES:.2f}" in section
