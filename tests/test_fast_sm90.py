"""The Gluon sm_90 kernels' NaN rule (conventions §13), on an sm_90 GPU only.

The interpreter cannot run Gluon and ``tests/test_sm90_compile.py`` only compiles these
kernels, so the rule their epilogues follow (a NaN logit makes the query's out and lse NaN,
never the "no key" markers) is checked here, where a 64-row bf16 call at DeepSeek's dims takes
the sm_90 route. Elsewhere every test here is skipped.
"""

from __future__ import annotations

import pytest
import torch
from _nan_rule import assert_nan_rule

import mla.fast.decode as fast_decode
import mla.fast.sparse as fast_sparse
from mla.compare import budget
from mla.fast import DecodePlan, SparsePlan, mla_decode_paged, sparse_mla_prefill
from mla.reference.decode import mla_decode_paged as ref_decode
from mla.reference.paged_cache import make_block_table
from mla.reference.sparse import sparse_mla_prefill as ref_prefill

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the Gluon sm_90 kernels run on an sm_90 GPU only")

NAN = float("nan")
BF16 = torch.bfloat16


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_nan_input_is_nan_out(num_splits):
    g = torch.Generator().manual_seed(1)
    lens = [200, 0, 70]
    bt, nb = make_block_table([max(n, 1) for n in lens], 64, seed=1)
    kv = torch.randn(nb, 64, 576, generator=g, dtype=torch.float64).to(BF16).cuda()
    q = torch.randn(3, 1, 64, 576, generator=g, dtype=torch.float64).to(BF16).cuda()
    bt, sl = bt.cuda(), torch.tensor(lens, dtype=torch.int32).cuda()
    q[0, 0, 5, 3] = NAN
    q[1, 0, 0, 0] = NAN  # request 1 has no keys
    kv[int(bt[2, 0]), 10, 100] = NAN  # request 2's key 10
    plan = DecodePlan(64, 64, num_splits, 8, 2)
    assert fast_decode._sm90_route(plan, q, kv, 512)
    scale = 576 ** -0.5
    out, lse = mla_decode_paged(q, kv, bt, sl, scale, False, 512, plan=plan)
    r_out, r_lse = ref_decode(q.double().cpu(), kv.double().cpu(), bt.cpu(), sl.cpu(), scale,
                              False, 512)
    assert torch.isnan(r_lse[0, 5, 0]) and torch.isnan(r_lse[2]).all()
    assert torch.isposinf(r_lse[1]).all()
    assert_nan_rule(out, r_out, budget("mla_decode_paged", BF16, "out_rel"), name="out")
    assert_nan_rule(lse, r_lse, name="lse", abs_tol=budget("mla_decode_paged", BF16, "lse_abs"))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sparse_nan_input_is_nan_out(num_splits):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, 64, 576, generator=g, dtype=torch.float64).to(BF16).cuda()
    kv = torch.randn(300, 576, generator=g, dtype=torch.float64).to(BF16).cuda()
    idx = torch.randint(0, 300, (4, 256), generator=g, dtype=torch.int32).cuda()
    idx[1] = -1  # query 1 names nothing (lonely)
    q[0, 7, 11] = NAN
    q[1, 0, 0] = NAN
    kv[int(idx[3, 5]), 42] = NAN  # a row query 3 names
    plan = SparsePlan(64, 64, num_splits, 8, 2)
    assert fast_sparse._sm90_route(plan, q, kv, 512, False)
    got = sparse_mla_prefill(q, kv, idx, 0.05, 512, plan=plan)
    ref = ref_prefill(q.double().cpu(), kv.double().cpu(), idx.cpu(), 0.05, 512)
    assert torch.isnan(ref[2][0, 7]) and torch.isnan(ref[2][3]).all()
    assert torch.isposinf(ref[2][1]).all() and torch.isneginf(ref[1][1]).all()
    k = "sparse_mla_prefill"
    assert_nan_rule(got[0], ref[0], budget(k, BF16, "out_rel"), name="out")
    assert_nan_rule(got[1], ref[1], name="max_logits", abs_tol=budget(k, BF16, "max_abs"))
    assert_nan_rule(got[2], ref[2], name="lse", abs_tol=budget(k, BF16, "lse_abs"))


def _decode_inputs(lens, heads=64, seed=3):
    g = torch.Generator().manual_seed(seed)
    bt, nb = make_block_table([max(n, 1) for n in lens], 64, seed=seed)
    kv = torch.randn(nb, 64, 576, generator=g, dtype=torch.float64).to(BF16).cuda()
    q = torch.randn(len(lens), 2, heads, 576, generator=g, dtype=torch.float64).to(BF16).cuda()
    return q, kv, bt.cuda(), torch.tensor(lens, dtype=torch.int32).cuda()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_sink(num_splits):
    """The sink in the Gluon kernel's epilogue (one split) and in the combine after it:
    finite, +inf, -inf and NaN sinks, causal queries and an empty request."""
    q, kv, bt, sl = _decode_inputs([200, 0, 70, 1])
    sink = torch.randn(64, generator=torch.Generator().manual_seed(4)).cuda()
    sink[:4] = torch.tensor([float("inf"), float("-inf"), NAN, 30.0])
    plan = DecodePlan(64, 64, num_splits, 8, 2)
    assert fast_decode._sm90_route(plan, q, kv, 512)
    scale = 576 ** -0.5
    out, lse = mla_decode_paged(q, kv, bt, sl, scale, True, 512, plan=plan, attn_sink=sink)
    r_out, r_lse = ref_decode(q.double().cpu(), kv.double().cpu(), bt.cpu(), sl.cpu(), scale,
                              True, 512, attn_sink=sink.cpu())
    assert torch.isnan(r_out[:, :, 2]).all() and (r_out[:, :, 0] == 0).all()
    assert_nan_rule(out, r_out, budget("mla_decode_paged", BF16, "out_rel"), name="out")
    assert_nan_rule(lse, r_lse, name="lse", abs_tol=budget("mla_decode_paged", BF16, "lse_abs"))


@pytest.mark.parametrize("kind", ["negative length", "length past capacity", "entry -1",
                                  "entry num_blocks", "entry huge"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_bad_values_unvalidated(kind, num_splits):
    """validate=False on the Gluon route: the bad request's queries are all NaN, nothing is
    read outside (compute-sanitizer runs this), the other requests match the reference."""
    q, kv, bt, sl = _decode_inputs([200, 130, 0, 70], seed=5)
    if kind == "negative length":
        sl[1] = -3
    elif kind == "length past capacity":
        sl[1] = bt.shape[1] * 64 + 1
    elif kind == "entry -1":
        bt[1, 2] = -1
    elif kind == "entry num_blocks":
        bt[1, 0] = kv.shape[0]
    else:
        bt[1, 1] = 2**31 - 1
    plan = DecodePlan(64, 64, num_splits, 8, 2)
    assert fast_decode._sm90_route(plan, q, kv, 512)
    scale = 576 ** -0.5
    out, lse = mla_decode_paged(q, kv, bt, sl, scale, True, 512, plan=plan, validate=False)
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    good = [0, 2, 3]
    r_out, r_lse = ref_decode(q[good].double().cpu(), kv.double().cpu(), bt[good].cpu(),
                              sl[good].cpu(), scale, True, 512)
    assert_nan_rule(out[good], r_out, budget("mla_decode_paged", BF16, "out_rel"), name="out")
    assert_nan_rule(lse[good], r_lse, name="lse",
                    abs_tol=budget("mla_decode_paged", BF16, "lse_abs"))
