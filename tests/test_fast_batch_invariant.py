"""``mla.fast``'s decodes: ``batch_invariant=True`` (fixed-length splits) and ``out=``.

A split decode cuts a request's keys into as many runs as the batch leaves SMs free, so a
request's sums are reduced in another order alone than in a crowd: the default plans are not
batch invariant (shown here, so the test of the mode can fail), and ``batch_invariant=True``
is, bit for bit, by ``mla.conformance.properties``' own check, while still splitting a long
request's keys (runs of a fixed length, ``mla.fast.decode.plan``; merged in split order).
Runs under ``TRITON_INTERPRET=1`` on the CPU (4 SMs there, so small batches split) and on a
GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import mla.fast as fast
from mla.compare import assert_close, budget
from mla.conformance.cases.decode import DecodeSpec, decode_trial
from mla.conformance.cases.sparse_decode import SparseDecodeSpec, sparse_decode_trial
from mla.conformance.catalogue import Setting
from mla.conformance.properties import check, inputs_of
from mla.fast.decode.plan import split_grid
from mla.reference.decode import mla_decode_paged as ref_decode_paged
from mla.reference.sparse import sparse_mla_decode as ref_sparse_decode

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SETTING = Setting(DEVICE, torch.bfloat16 if DEVICE.type == "cuda" else torch.float32, 3, True)

# a request alone gets more splits than in the batch: on the CPU (4 SMs) at any batch; on a
# GPU (132 SMs) only once the batch leaves fewer than the splits a long request can take
# (mla.fast.decode.plan: 528 / 6 = 88 against 94 at 3,000 keys in 16-key tiles;
# mla.fast.sparse.plan: 264 / 20 rounded, 11 after the tiles' rounding, against 16 at top-k 2048)
CASES = [
    ("mla_decode_paged", decode_trial,
     DecodeSpec((3000, 5, 1900, 0, 77, 2500) if DEVICE.type == "cuda" else (300, 5, 190),
                heads=3, page=16)),
    ("sparse_mla_decode", sparse_decode_trial,
     SparseDecodeSpec(batch=20, heads=3, topk=2048, slots=4096, minus_one=0.1)
     if DEVICE.type == "cuda" else SparseDecodeSpec(batch=3, heads=3, topk=256, minus_one=0.1)),
]
# the batch-invariant plan of the CPU's float32 sparse calls cuts lists of 512 entries (one run
# at top-k 256); this one cuts runs of 64 (4 at top-k 256) so that the lists split
SPARSE_PLAN = fast.SparsePlan(block_m=16, block_n=16, num_splits=16, num_warps=4,
                              num_stages=1, split_entries=64)


def _bi(kernel: str, plan: object = None) -> functools.partial:
    kw: dict = {"batch_invariant": True}
    if plan is not None:
        kw["plan"] = plan
    return functools.partial(getattr(fast, kernel), **kw)


@pytest.mark.parametrize("kernel, build, spec", CASES, ids=[c[0] for c in CASES])
def test_batch_invariant_mode_keeps_the_property_the_default_breaks(kernel, build, spec):
    trial = build(SETTING, spec, 0)
    results = {bi: check("batch_invariance", kernel,
                         functools.partial(getattr(fast, kernel), batch_invariant=bi),
                         trial, spec, 3) for bi in (False, True)}
    assert results[True].passed and results[True].ulps == 0, results[True]
    # the default splits the lone request's keys, not the crowd's: other bits
    assert not results[False].passed and results[False].ulps > 0, results[False]


# split inputs: a sink, s_q > 1 (causal), lists cut into runs of 64 entries
SPLIT_CASES = [
    ("mla_decode_paged", decode_trial,
     DecodeSpec((300, 40, 530), heads=2, s_q=2, causal=True, page=16, sink="finite"), None),
    ("sparse_mla_decode", sparse_decode_trial,
     SparseDecodeSpec(batch=2, s_q=2, heads=3, topk=256, minus_one=0.1, sink="finite",
                      topk_length=(256, 70)), SPARSE_PLAN),
]


@pytest.mark.parametrize("kernel, build, spec, plan", SPLIT_CASES,
                         ids=[c[0] for c in SPLIT_CASES])
def test_batch_invariant_splits_with_sink_and_several_queries(kernel, build, spec, plan):
    """Several splits per request, a sink (applied once, in the combine) and ``s_q = 2``: the
    same bits alone and in any batch, and the reference's values within the budgets."""
    trial = build(SETTING, spec, 0)
    fn = _bi(kernel, plan)
    result = check("batch_invariance", kernel, fn, trial, spec, 3)
    assert result.passed and result.ulps == 0, result
    x = inputs_of(trial)
    out, lse = fn(*x.args, **x.kwargs)
    ref = ref_decode_paged if kernel == "mla_decode_paged" else ref_sparse_decode
    args = [a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in x.args]
    kwargs = {k: v.cpu() if torch.is_tensor(v) else v for k, v in x.kwargs.items()}
    ref_out, ref_lse = ref(*[a.cpu() if torch.is_tensor(a) else a for a in args], **kwargs)
    assert_close(out, ref_out, budget(kernel, out.dtype, "out_rel"), name="out")
    assert_close(lse, ref_lse, name="lse", abs_tol=budget(kernel, out.dtype, "lse_abs"))


def test_a_wider_block_table_only_adds_empty_splits():
    """Request 0 alone, its table just wide enough, against the same request beside others
    in a table 8 times as wide (more programs along the keys, all past its end): the same
    bits. The grid's split count differs, the request's partition does not."""
    g = torch.Generator().manual_seed(5)
    page, N, D, DV, L = 16, 2, 40, 32, 290
    pages = -(-L // page)
    wide = 8 * pages
    kv = torch.randn(wide, page, D, generator=g).to(DEVICE)
    q = torch.randn(3, 1, N, D, generator=g).to(DEVICE)
    table = torch.randint(0, wide, (3, wide), generator=g, dtype=torch.int32).to(DEVICE)
    lens = torch.tensor([L, 7, 0], dtype=torch.int32, device=DEVICE)
    sink = torch.tensor([0.5, 9.0], device=DEVICE)
    kw = dict(causal=False, head_dim_v=DV, attn_sink=sink, batch_invariant=True)
    alone = fast.mla_decode_paged(q[:1], kv, table[:1, :pages].contiguous(), lens[:1],
                                  D ** -0.5, **kw)
    crowd = fast.mla_decode_paged(q, kv, table, lens, D ** -0.5, **kw)
    plan = fast.plan_decode(1, 1, N, D, DV, pages, page, q.dtype, 4, batch_invariant=True)
    assert plan == fast.plan_decode(3, 1, N, D, DV, wide, page, q.dtype, 4,
                                    batch_invariant=True)
    assert 1 < split_grid(plan, pages * page, plan.block_n) < split_grid(plan, wide * page,
                                                                          plan.block_n)
    assert torch.equal(alone[0], crowd[0][:1]) and torch.equal(alone[1], crowd[1][:1])


def test_the_batch_invariant_plans_split_by_a_fixed_length():
    dense = fast.plan_decode(1, 1, 16, 576, 512, 128, 64, torch.bfloat16, 132)
    assert dense.num_splits > 1 and dense.split_keys == 0
    assert fast.plan_decode(1, 1, 16, 576, 512, 128, 64, torch.bfloat16, 132,
                            split_kv=False).num_splits == 1
    # the batch-invariant plans: fixed-length splits, the same plan at every batch, table
    # width and SM count; at B = 1 they still split a long request (L = 8192 here)
    for n in (16, 128):
        bi = fast.plan_decode(1, 1, n, 576, 512, 128, 64, torch.bfloat16, 132,
                              batch_invariant=True)
        assert bi.split_keys > 0 and bi.num_splits > 1
        assert bi == fast.plan_decode(256, 1, n, 576, 512, 4096, 64, torch.bfloat16, 8,
                                      batch_invariant=True)
        assert split_grid(bi, 8192, 64) == 8192 // bi.split_keys > 1
    assert fast.plan_decode(1, 1, 128, 576, 512, 128, 64, torch.bfloat16, 132,
                            batch_invariant=True).seesaw
    sparse = fast.plan_sparse(1, 128, 2048, torch.bfloat16, True, 132)
    assert sparse.num_splits > 1 and sparse.split_entries == 0
    assert fast.plan_sparse(1, 128, 2048, torch.bfloat16, True, 132, split=False).num_splits == 1
    bi = fast.plan_sparse(1, 128, 2048, torch.bfloat16, True, 132, batch_invariant=True)
    assert bi.split_entries > 0 and bi == fast.plan_sparse(
        512, 128, 2048, torch.bfloat16, True, 8, batch_invariant=True)
    from mla.fast.sparse.plan import split_grid as sparse_split_grid

    assert sparse_split_grid(bi, 2048 // 64, 64) == 2048 // bi.split_entries > 1
    with pytest.raises(ValueError, match="split_keys must be"):
        fast.DecodePlan(64, 64, 4, 8, 2, split_keys=100)
    with pytest.raises(ValueError, match="split_entries must be"):
        fast.SparsePlan(64, 64, 4, 8, 2, split_entries=-64)


def _args(kernel, build, spec):
    x = inputs_of(build(SETTING, spec, 0))
    return x.args, x.kwargs


@pytest.mark.parametrize("kernel, build, spec", CASES, ids=[c[0] for c in CASES])
def test_out_is_written_and_returned(kernel, build, spec):
    args, kwargs = _args(kernel, build, spec)
    fn = getattr(fast, kernel)
    want, want_lse = fn(*args, **kwargs)
    out = torch.full_like(want, float("nan"))
    got, lse = fn(*args, **kwargs, out=out)
    assert got is out and torch.equal(got, want) and torch.equal(lse, want_lse)
    # the same call again (its launch kept): the buffer is written again
    out.fill_(float("nan"))
    assert fn(*args, **kwargs, out=out)[0] is out and torch.equal(out, want)


@pytest.mark.parametrize("kernel, build, spec", CASES, ids=[c[0] for c in CASES])
def test_bad_out_and_flags_are_refused(kernel, build, spec):
    args, kwargs = _args(kernel, build, spec)
    fn = getattr(fast, kernel)
    want, _ = fn(*args, **kwargs)
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        fn(*args, **kwargs, out=want.tolist())
    with pytest.raises(ValueError, match=r"out must be a .* of shape"):
        fn(*args, **kwargs, out=want[:, :, :-1].clone())
    with pytest.raises(ValueError, match=rf"out must be a {want.dtype} tensor .* got "
                       r"torch.float64"):
        fn(*args, **kwargs, out=want.double())
    with pytest.raises(ValueError, match="out must be contiguous"):
        fn(*args, **kwargs, out=torch.empty_like(want).transpose(0, 2).contiguous()
           .transpose(0, 2))
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        fn(*args, **kwargs, batch_invariant=1)
    plan = (fast.DecodePlan(block_m=16, block_n=32, num_splits=2, num_warps=4, num_stages=1,
                            use_tma=False) if kernel == "mla_decode_paged" else
            fast.SparsePlan(block_m=16, block_n=16, num_splits=2, num_warps=4, num_stages=1))
    with pytest.raises(ValueError, match="batch_invariant=True needs a plan with num_splits"):
        fn(*args, **kwargs, batch_invariant=True, plan=plan)
    # a plan of fixed-length splits is batch invariant
    fixed = (dataclasses.replace(plan, split_keys=64) if kernel == "mla_decode_paged" else
             dataclasses.replace(plan, split_entries=64))
    fn(*args, **kwargs, batch_invariant=True, plan=fixed)



def test_the_batch_invariant_targets_hold_the_two_decodes():
    """``mla conform --target mla.fast-batch-invariant --fuzz N --properties all`` (the GPU
    fuzz runs it): mla.fast's two decodes, called with ``batch_invariant=True``."""
    from mla.conformance.targets import load_target

    name, target = load_target("mla.fast-batch-invariant")
    assert sorted(target) == ["mla_decode_paged", "sparse_mla_decode"]
    assert all(fn.keywords == {"batch_invariant": True} for fn in target.values())
    _, peer = load_target("flashmla-batch-invariant")
    assert sorted(peer) == sorted(target)
    assert all(fn.keywords == {"batch_invariant": True} for fn in peer.values())
