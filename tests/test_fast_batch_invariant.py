"""``mla.fast``'s decodes: ``batch_invariant=True`` (no split-KV) and ``out=`` preallocated outputs.

A split decode cuts a request's keys into as many runs as the batch leaves SMs free, so a
request's sums are reduced in another order alone than in a crowd: the default plans are not
batch invariant (shown here, so the test of the mode can fail), and ``batch_invariant=True``
is, bit for bit, by ``mla.conformance.properties``' own check. Runs under
``TRITON_INTERPRET=1`` on the CPU (4 SMs there, so small batches split) and on a GPU.
"""

from __future__ import annotations

import functools

import pytest
import torch

import mla.fast as fast
from mla.conformance.cases.decode import DecodeSpec, decode_trial
from mla.conformance.cases.sparse_decode import SparseDecodeSpec, sparse_decode_trial
from mla.conformance.catalogue import Setting
from mla.conformance.properties import check, inputs_of

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SETTING = Setting(DEVICE, torch.bfloat16 if DEVICE.type == "cuda" else torch.float32, 3, True)

CASES = [
    ("mla_decode_paged", decode_trial, DecodeSpec((300, 5, 190), heads=3, page=16)),
    ("sparse_mla_decode", sparse_decode_trial,
     SparseDecodeSpec(batch=3, heads=3, topk=256, minus_one=0.1)),
]


@pytest.mark.parametrize("kernel, build, spec", CASES, ids=[c[0] for c in CASES])
def test_batch_invariant_mode_keeps_the_property_the_default_breaks(kernel, build, spec):
    trial = build(SETTING, spec, 0)
    results = {bi: check("batch_invariance", kernel,
                         functools.partial(getattr(fast, kernel), batch_invariant=bi),
                         trial, spec, 3) for bi in (False, True)}
    assert results[True].passed and results[True].ulps == 0, results[True]
    # the default splits the lone request's keys, not the crowd's: other bits
    assert not results[False].passed and results[False].ulps > 0, results[False]


def test_the_batch_invariant_plans_do_not_split():
    dense = fast.plan_decode(1, 1, 16, 576, 512, 128, 64, torch.bfloat16, 132)
    assert dense.num_splits > 1
    assert fast.plan_decode(1, 1, 16, 576, 512, 128, 64, torch.bfloat16, 132,
                            split_kv=False).num_splits == 1
    sparse = fast.plan_sparse(1, 128, 2048, torch.bfloat16, True, 132)
    assert sparse.num_splits > 1
    assert fast.plan_sparse(1, 128, 2048, torch.bfloat16, True, 132, split=False).num_splits == 1


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
