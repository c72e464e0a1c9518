"""The indexer's fp8 key cache (bytes of hand-built pages), its logits from fp8 inputs against
``index_scores`` in float64, and the top-k per row with its tie rule."""

from __future__ import annotations

import struct

import pytest
import torch

from mla.reference.fp8 import act_quant as ref_act_quant
from mla.reference.indexer import index_scores, select_topk
from mla.reference.indexer_cache import (
    dequantize_indexer_k,
    gather_indexer_k_cache,
    indexer_k_quant_and_cache,
    quantize_indexer_k,
    read_indexer_k_cache,
)
from mla.reference.indexer_logits import (
    decode_row_ends,
    fp8_mqa_logits,
    fp8_paged_mqa_logits,
    quantize_indexer_q,
    top_k_per_row,
)
from mla.reference.paged_cache import make_block_table


def _f32(x: float) -> list[int]:
    return list(struct.pack("<f", x))


# ---- the cache's bytes ------------------------------------------------------------------------

def test_a_hand_built_page_byte_for_byte():
    """Pages of 2 tokens: each page holds its tokens' 128 value bytes, then their 4-byte
    scales; slot -1 writes nothing; every other byte keeps its value."""
    a = torch.ones(128)
    a[0], a[1] = 448.0, -2.0  # amax 448: scale 1; codes 0x7E, 0xC0, the rest 1.0 = 0x38
    b = torch.full((128,), 0.5)
    b[5] = 3.5  # amax 3.5: scale 3.5/448 = 2^-7 exactly; 3.5 -> 448 (0x7E), 0.5 -> 64 (0x68)
    c = torch.zeros(128)
    c[7] = 5.0  # 5/448 rounds up to 2^-6: 5 -> 320 (0x7A); zeros -> 0x00
    k = torch.stack([a, b, c, a]).to(torch.bfloat16)
    cache = torch.full((2, 2, 132), 0xAB, dtype=torch.uint8)
    indexer_k_quant_and_cache(k, cache, torch.tensor([3, 0, 2, -1]))

    codes_a = [0x7E, 0xC0] + [0x38] * 126
    codes_b = [0x68] * 5 + [0x7E] + [0x68] * 122
    codes_c = [0x00] * 7 + [0x7A] + [0x00] * 120
    page0 = codes_b + [0xAB] * 128 + _f32(2.0 ** -7) + [0xAB] * 4
    page1 = codes_c + codes_a + _f32(2.0 ** -6) + _f32(1.0)
    assert cache[0].flatten().tolist() == page0
    assert cache[1].flatten().tolist() == page1

    codes, scale = read_indexer_k_cache(cache, torch.tensor([3, 0, 2]))
    assert scale.tolist() == [1.0, 2.0 ** -7, 2.0 ** -6]
    assert torch.equal(dequantize_indexer_k(codes, scale), k[:3].float())


def test_page_size_one_rows_are_token_rows_and_scales_are_the_e4m3_rule():
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(7, 128, generator=g) * 2.0 ** torch.randint(-12, 8, (7, 1),
                                                               generator=g)).bfloat16()
    cache = torch.zeros(9, 1, 132, dtype=torch.uint8)
    slots = torch.tensor([8, 0, 3, 4, 1, 7, 2])
    indexer_k_quant_and_cache(k, cache, slots)
    codes, scale = quantize_indexer_k(k)
    assert torch.equal(cache[slots, 0, :128], codes)
    assert torch.equal(cache[slots, 0, 128:].contiguous().view(torch.float32)[:, 0], scale)
    amax = k.float().abs().amax(-1)
    assert torch.equal(scale, torch.pow(2.0, torch.ceil(torch.log2(amax.clamp_min(1e-4) / 448))))
    deq = dequantize_indexer_k(codes, scale).double()
    err = (deq - k.double()).abs() / k.double().abs().amax(-1, keepdim=True)
    assert float(err.max()) <= 2.0 ** -4 + 1e-12  # half an e4m3 ulp of the token's largest


def test_unrounded_scale_and_saturation():
    k = torch.full((1, 128), 1.0)
    k[0, 0] = 3.0  # scale 3/448 (not a power of two): 3/scale rounds near 448, saturates there
    codes, scale = quantize_indexer_k(k, scale_fmt=None)
    assert scale.item() == pytest.approx(3 / 448, rel=1e-7)
    assert codes[0, 0].item() == 0x7E


def test_nan_stays_in_its_value_and_an_all_zero_key_gets_the_floor():
    k = torch.zeros(2, 128)
    k[1, 3] = float("nan")
    k[1, 4] = 2.0
    codes, scale = quantize_indexer_k(k)
    assert scale[0].item() == 2.0 ** -22  # 1e-4 / 448 rounded up
    assert codes[0].eq(0).all()
    deq = dequantize_indexer_k(codes, scale)
    assert torch.isnan(deq[1, 3]) and int(torch.isnan(deq).sum()) == 1
    assert deq[1, 4].item() == 2.0


def test_gather_concatenates_requests_in_order():
    g = torch.Generator().manual_seed(2)
    table, nb = make_block_table([5, 0, 9], 4, seed=3)
    k = torch.randn(14, 128, generator=g).bfloat16()
    req = [0] * 5 + [2] * 9
    pos = list(range(5)) + list(range(9))
    slots = torch.tensor([int(table[r, p // 4]) * 4 + p % 4 for r, p in zip(req, pos)])
    cache = torch.zeros(nb, 4, 132, dtype=torch.uint8)
    indexer_k_quant_and_cache(k, cache, slots)
    codes, scale = gather_indexer_k_cache(cache, table, torch.tensor([0, 5, 5, 14]))
    want_codes, want_scale = quantize_indexer_k(k)
    assert torch.equal(codes.view(torch.uint8), want_codes) and torch.equal(scale, want_scale)
    # the token count a caller knows is checked against cu_seq_lens, never trusted
    told = gather_indexer_k_cache(cache, table, torch.tensor([0, 5, 5, 14]), num_tokens=14)
    assert torch.equal(told[0].view(torch.uint8), want_codes)
    with pytest.raises(ValueError, match="num_tokens must be .* = 14, got 13"):
        gather_indexer_k_cache(cache, table, torch.tensor([0, 5, 5, 14]), num_tokens=13)


@pytest.mark.parametrize("bad, match", [
    (dict(kv_cache=torch.zeros(2, 4, 656, dtype=torch.uint8)), "132"),
    (dict(kv_cache=torch.zeros(2, 4, 132)), "dtype"),
    (dict(slot_mapping=torch.tensor([0, 8])), r"\[-1, 8\)"),
    (dict(slot_mapping=torch.tensor([0, -2])), r"\[-1, 8\)"),
    (dict(quant_block_size=64), "quant_block_size"),
    (dict(scale_fmt="e8m0"), "scale_fmt"),
    (dict(k=torch.zeros(2, 64)), "k must have shape"),
])
def test_bad_writes_are_refused(bad, match):
    args = dict(k=torch.zeros(2, 128), kv_cache=torch.zeros(2, 4, 132, dtype=torch.uint8),
                slot_mapping=torch.tensor([0, 1]), quant_block_size=128, scale_fmt="ue8m0")
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        indexer_k_quant_and_cache(**args)


# ---- logits -----------------------------------------------------------------------------------

def _paged(lens, next_n, heads, page, seed=0):
    g = torch.Generator().manual_seed(seed)
    table, nb = make_block_table(lens, page, seed=seed)
    cache = torch.zeros(nb, page, 132, dtype=torch.uint8)
    keys = []
    for b, n in enumerate(lens):
        k = torch.randn(n, 128, generator=g).bfloat16()
        pos = torch.arange(n)
        indexer_k_quant_and_cache(k, cache, table[b].long()[pos // page] * page + pos % page)
        keys.append(k)
    q = torch.randn(len(lens), next_n, heads, 128, generator=g, dtype=torch.float64)
    w = torch.randn(len(lens) * next_n, heads, generator=g, dtype=torch.float64)
    q8, w8 = quantize_indexer_q(q.flatten(0, 1), w)
    return q8.view(q.shape), w8, cache, table


@pytest.mark.parametrize("page, next_n", [(1, 1), (16, 3), (64, 2)])
def test_paged_logits_equal_index_scores_on_the_dequantized_keys(page, next_n):
    lens = [next_n + 1, 70, 1, 129] if next_n == 1 else [next_n, 70, 1, 129]
    q8, w8, cache, table = _paged(lens, next_n, 8, page)
    got = fp8_paged_mqa_logits(q8, cache, w8.double(), torch.tensor(lens), table, 140)
    assert got.dtype == torch.float64 and got.shape == (len(lens) * next_n, 140)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        codes, scale = read_indexer_k_cache(cache, table[b].long()[pos // page] * page
                                            + pos % page)
        keys = dequantize_indexer_k(codes, scale, torch.float64)
        qpos = n - next_n + torch.arange(next_n)
        want = index_scores(q8[b].double(), w8[b * next_n:(b + 1) * next_n].double(), keys,
                            qpos, pos)
        rows = got[b * next_n:(b + 1) * next_n]
        assert torch.isneginf(rows[:, n:]).all()
        torch.testing.assert_close(rows[:, :n], want, rtol=1e-12, atol=0)
    # float32 weights: float32 accumulation, within the derived sqrt(128·H)·2^-24 of float64
    f32 = fp8_paged_mqa_logits(q8, cache, w8, torch.tensor(lens), table, 140)
    fin = torch.isfinite(got)
    err = (f32[fin].double() - got[fin]).norm() / got[fin].norm()
    assert f32.dtype == torch.float32 and float(err) < (128 * 8) ** 0.5 * 2.0 ** -24


def test_ragged_prefill_logits_equal_the_paged_ones_of_the_same_keys():
    lens = [5, 33]
    q8, w8, cache, table = _paged(lens, 1, 4, 16, seed=4)
    codes, scale = gather_indexer_k_cache(cache, table, torch.tensor([0, 5, 38]))
    # the last query of each request, as a prefill row: it sees its own request's keys
    ks = torch.tensor([0, 5])
    ke = torch.tensor([5, 38])
    ragged = fp8_mqa_logits(q8[:, 0], (codes, scale), w8.double(), ks, ke)
    paged = fp8_paged_mqa_logits(q8, cache, w8.double(), torch.tensor(lens), table, 33)
    assert torch.equal(ragged[0, :5], paged[0, :5]) and torch.isneginf(ragged[0, 5:]).all()
    assert torch.equal(ragged[1, 5:], paged[1]) and torch.isneginf(ragged[1, :5]).all()


def test_short_contexts_rows_that_see_no_key_are_all_minus_inf():
    q8, w8, cache, table = _paged([1, 0], 3, 2, 16)
    got = fp8_paged_mqa_logits(q8, cache, w8, torch.tensor([1, 0]), table, 4)
    assert decode_row_ends(torch.tensor([1, 0]), 3).tolist() == [0, 0, 1, 0, 0, 0]
    assert torch.isneginf(got[[0, 1, 3, 4, 5]]).all() and torch.isfinite(got[2, 0])


def test_paged_logits_refuse_what_they_cannot_read():
    q8, w8, cache, table = _paged([20], 1, 2, 16)
    with pytest.raises(ValueError, match="max_model_len"):
        fp8_paged_mqa_logits(q8, cache, w8, torch.tensor([20]), table, 10)
    bad = table.clone()
    bad[0, 1] = -1
    with pytest.raises(ValueError, match="points outside"):
        fp8_paged_mqa_logits(q8, cache, w8, torch.tensor([20]), bad, 32)
    with pytest.raises(TypeError, match="q must have dtype"):
        fp8_paged_mqa_logits(q8.float(), cache, w8, torch.tensor([20]), table, 32)


# ---- top-k ------------------------------------------------------------------------------------

def test_top_k_ties_go_to_the_lower_index_and_short_rows_pad_with_minus_one():
    nan = float("nan")
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, nan],
                           [nan, 5.0, 5.0, 7.0, nan, nan],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    got = top_k_per_row(logits, torch.tensor([0, 1, 2]), torch.tensor([5, 4, 2]), 2)
    # row 0: three 2.0s, the first two win; row 1: columns 1..3 (local 0..2), 7 then the
    # first 5; NaN outside the range never read; row 2: no key
    assert got.tolist() == [[1, 2], [2, 0], [-1, -1]]
    got = top_k_per_row(logits, torch.tensor([0, 1, 0]), torch.tensor([5, 4, 6]), 4)
    assert got.tolist() == [[1, 2, 3, 0], [2, 0, 1, -1], [0, 1, 2, 3]]


def test_top_k_with_a_nan_inside_the_range_selects_it_first():
    got = top_k_per_row(torch.tensor([[1.0, float("nan"), 3.0]]), torch.tensor([0]),
                        torch.tensor([3]), 2)
    assert got.tolist() == [[1, 2]]


def test_top_k_per_row_equals_select_topk_on_masked_scores():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(12, 300, generator=g).round(decimals=1)  # many ties
    ends = torch.randint(0, 301, (12,), generator=g)
    masked = logits.masked_fill(torch.arange(300)[None, :] >= ends[:, None], float("-inf"))
    got = top_k_per_row(logits, torch.zeros(12, dtype=torch.long), ends, 64)
    assert torch.equal(got, select_topk(masked, 64))


def test_the_cache_holds_act_quant_keys_exactly_and_folding_q_scale_changes_nothing():
    """The official path's keys (``act_quant`` per 128, ue8m0) re-quantize to the same values;
    q's scale folded into the weights gives ``index_scores`` of the dequantized q."""
    g = torch.Generator().manual_seed(6)
    y, s = ref_act_quant(torch.randn(9, 128, generator=g) * 3)
    official = y.float() * s
    codes, scale = quantize_indexer_k(official)
    assert torch.equal(dequantize_indexer_k(codes.view(torch.float8_e4m3fn), scale), official)

    q = torch.randn(4, 8, 128, generator=g, dtype=torch.float64)
    w = torch.randn(4, 8, generator=g, dtype=torch.float64)
    q8, w8 = quantize_indexer_q(q, w)
    qy, qs = ref_act_quant(q)
    assert torch.equal(q8.view(torch.uint8), qy.view(torch.uint8))
    got = fp8_mqa_logits(q8, (codes.view(torch.float8_e4m3fn), scale), w8.double(),
                         torch.zeros(4, dtype=torch.int32), torch.full((4,), 9))
    want = index_scores(qy.double() * qs.double(), w, official.double(),
                        torch.full((4,), 8), torch.arange(9))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # w8 = w·q_scale in float32
