"""Kernels whose element offsets pass 2^31 on inputs that fit one GPU.

A 32-bit offset ``t * stride`` wraps negative once it passes 2^31 elements: the kernel then
reads and writes *before* its tensors (garbage, another tensor overwritten, or a fault). Each
case here builds the smallest input that crosses the limit (4-40 GB on the GPU), with outputs
poisoned by NaN, and checks the rows past the limit against the float64 definition, every
element written, and the inputs unchanged (a wrapped store lands in them).

GPU only (the interpreter's memory would be the host's); each case skips where the GPU has
less free memory than it needs.
"""

from __future__ import annotations

import pytest
import torch

from mla import compare
from mla.compare import assert_close, budget
from mla.fast import DecodePlan, merge_attn_states, mla_decode_paged
from mla.fast.dcp import correct_attn_out
from mla.fast.paged_cache import gather_cache
from mla.reference.decode import mla_decode_paged as ref_decode_paged
from mla.reference.merge import merge_attn_states as ref_merge

I32 = 2**31
GB = 2**30


def _need(gigabytes: float) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU (the inputs are several GB)")
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < gigabytes * GB:
        pytest.skip(f"needs {gigabytes} GB of free GPU memory, {free / GB:.1f} GB free")


def _checksum(x: torch.Tensor) -> float:
    return float(x.float().sum(dtype=torch.float64))


@pytest.mark.parametrize("plan", [None, DecodePlan(16, 16, 1, 4, 1, use_tma=False, sm90=False)],
                         ids=["default", "16-row-pointer-gathers"])
def test_decode_query_rows_past_2_31_elements(plan):
    """The Triton decode kernel (pages of 16: not the Gluon route), one request of
    s_q = 32,800 queries of 128 heads: q's offsets reach 32,799 · 128 · 576 > 2^31 and out's
    32,799 · 128 · 512 > 2^31. Non-causal over 37 keys, so each query row is checked alone."""
    _need(12)
    s_q, N, D, DV, page, L = 32_800, 128, 576, 512, 16, 37
    assert (s_q - 1) * N * D >= I32 and (s_q - 1) * N * DV >= I32
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, s_q, N, D, generator=g, device="cuda", dtype=torch.bfloat16)
    pages = -(-L // page)
    kv = torch.randn(pages + 1, page, D, generator=g, device="cuda", dtype=torch.bfloat16)
    bt = torch.arange(1, pages + 1, dtype=torch.int32, device="cuda")[None]  # page 0 unused
    sl = torch.tensor([L], dtype=torch.int32, device="cuda")
    q_sum = _checksum(q)
    with compare.poisoned_alloc():
        out, lse = mla_decode_paged(q, kv, bt, sl, D**-0.5, False, DV, plan=plan)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "rows left unwritten"
    assert _checksum(q) == q_sum, "q changed: a store wrapped below out"
    # rows on both sides of the limits: q's (row 29,128 -> 29,129) and out's (32,767 -> 32,768)
    ts = torch.tensor([0, 29_127, 29_128, 29_129, 32_767, 32_768, s_q - 1])
    ref_out, ref_lse = ref_decode_paged(q[:, ts].double().cpu(), kv.double().cpu(), bt.cpu(),
                                        sl.cpu(), D**-0.5, False, DV)
    assert_close(out[:, ts], ref_out, budget("mla_decode_paged", torch.bfloat16, "out_rel"),
                 name="out")
    assert (lse[:, :, ts].double().cpu() - ref_lse).abs().max() <= budget(
        "mla_decode_paged", torch.bfloat16, "lse_abs")


def test_merge_rows_past_2_31():
    """``merge_attn_states`` with T · N = 2^31 + 128 rows (D = 1): the row count itself passes
    2^31. bf16 lses keep the input at ~26 GB."""
    _need(30)
    N, T, D = 128, 2**24 + 1, 1
    g = torch.Generator(device="cuda").manual_seed(1)
    o_p = torch.randn(T, N, D, generator=g, device="cuda", dtype=torch.bfloat16)
    o_s = torch.randn(T, N, D, generator=g, device="cuda", dtype=torch.bfloat16)
    l_p = torch.randn(N, T, generator=g, device="cuda", dtype=torch.bfloat16)
    l_s = torch.randn(N, T, generator=g, device="cuda", dtype=torch.bfloat16)
    sums = [_checksum(x) for x in (o_p, o_s, l_p, l_s)]
    with compare.poisoned_alloc():
        out, out_lse = merge_attn_states(o_p, l_p, o_s, l_s)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and not torch.isnan(out_lse).any(), "rows left unwritten"
    assert [_checksum(x) for x in (o_p, o_s, l_p, l_s)] == sums, "an input changed"
    ts = torch.tensor([0, 2**24 - 1, 2**24], device="cuda")  # the last spans 2^31
    ref_o, ref_l = ref_merge(o_p[ts].double().cpu(), l_p[:, ts].double().cpu(),
                             o_s[ts].double().cpu(), l_s[:, ts].double().cpu())
    assert_close(out[ts], ref_o, budget("merge_attn_states", torch.bfloat16, "out_rel"),
                 name="out")
    # the merged lse is rounded to bf16 (the lses' dtype): half an ulp below 8 (|lse| < 7
    # here), plus the float32 sums' 1e-5
    assert ref_l.abs().max() < 8
    assert (out_lse[:, ts].double().cpu() - ref_l).abs().max() <= 2**-6 + 1e-5


def test_dcp_correction_rank_offsets_past_2_31():
    """``correct_attn_out`` on rank 1 of 2 with T · N = 2^31 + 128: the all-gathered lses'
    rank offset ``1 · T · N`` and the row count pass 2^31 (~39 GB)."""
    _need(44)
    W, rank, N, T, D = 2, 1, 128, 2**24 + 1, 1
    g = torch.Generator(device="cuda").manual_seed(2)
    out_r = torch.randn(T, N, D, generator=g, device="cuda", dtype=torch.bfloat16)
    lses = torch.randn(W, T, N, generator=g, device="cuda")
    sums = [_checksum(out_r), _checksum(lses)]
    with compare.poisoned_alloc():
        scaled, lse = correct_attn_out(out_r, lses, rank)
    torch.cuda.synchronize()
    assert not torch.isnan(scaled).any() and not torch.isnan(lse).any(), "rows left unwritten"
    assert [_checksum(out_r), _checksum(lses)] == sums, "an input changed"
    ts = torch.tensor([0, 2**24 - 1, 2**24], device="cuda")
    l64 = lses[:, ts].double().cpu()
    ref_lse = torch.logsumexp(l64, dim=0)  # the definition, float64
    ref_scaled = torch.exp(l64[rank] - ref_lse)[..., None] * out_r[ts].double().cpu()
    assert_close(scaled[ts], ref_scaled, budget("merge_attn_states", torch.float32, "out_rel"),
                 name="scaled")
    assert (lse[ts].double().cpu() - ref_lse).abs().max() <= budget(
        "merge_attn_states", torch.float32, "lse_abs")


def test_gather_cache_table_row_stride_past_2_31():
    """``gather_cache`` with a block table whose rows lie 2^30 entries apart (a strided view of
    an 8.6 GB table; a stride of 2^31 or more would reach the kernel as an int64): request 2's
    ``b · stride`` is 2^31."""
    _need(10)
    page, D = 16, 576
    store = torch.zeros(2 * 2**30 + 4, dtype=torch.int32, device="cuda")
    table = store.as_strided((3, 4), (2**30, 1))
    table[0] = torch.tensor([3, 1, 0, 0], dtype=torch.int32)
    table[2] = torch.tensor([2, 4, 0, 0], dtype=torch.int32)
    src = torch.randn(5, page, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 20, 20, 45], dtype=torch.int32, device="cuda")  # request 1 empty
    dst = torch.full((45, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = gather_cache(src, dst, table, cu, 3)
    want = torch.cat([src[[3, 1]].reshape(-1, D)[:20], src[[2, 4]].reshape(-1, D)[:25]])
    assert torch.equal(got, want)
