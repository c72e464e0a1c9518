"""The Triton decode (``mla.fast.mla_decode_paged``) against the float64 reference.

Runs under ``TRITON_INTERPRET=1`` on the CPU (conftest sets it on machines without a GPU), so
inputs are float16/float32 (the interpreter's bf16 ``tl.dot`` is wrong) and shapes are small;
the bf16 grid at DeepSeek sizes is ``python -m mla.check`` on a GPU. Every case poisons what a
kernel could leave unwritten (outputs, split partials, cache rows past each length) with NaN.
"""

from __future__ import annotations

import pytest
import torch
from _nan_rule import assert_nan_rule

from mla import compare
from mla.compare import assert_close, budget
from mla.fast import DecodePlan, mla_decode_paged, plan_decode
from mla.reference.decode import mla_decode_paged as ref_decode_paged
from mla.reference.paged_cache import make_block_table

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(lens: list[int], s_q: int, N: int, D: int, block_size: int,
                dtype: torch.dtype, seed: int, spare_blocks: int = 1):
    """Random q and cache; cache rows no request uses hold NaN (a kernel must not read them
    into its sums)."""
    g = torch.Generator().manual_seed(seed)
    bt, nb = make_block_table([max(n, 1) for n in lens], block_size,
                              spare_blocks=spare_blocks, seed=seed)
    kv = torch.full((nb, block_size, D), float("nan"), dtype=torch.float64)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        rows = bt[b].long()[pos // block_size] * block_size + pos % block_size
        kv.view(-1, D)[rows] = torch.randn(n, D, generator=g, dtype=torch.float64)
    q = torch.randn(len(lens), s_q, N, D, generator=g, dtype=torch.float64)
    sl = torch.tensor(lens, dtype=torch.int32)
    return (q.to(dtype).to(DEVICE), kv.to(dtype).to(DEVICE), bt.to(DEVICE), sl.to(DEVICE))


@pytest.fixture
def poisoned_alloc():
    """Every buffer the kernel wrapper allocates (outputs, split partials) starts poisoned."""
    with compare.poisoned_alloc():
        yield


def check_against_reference(q, kv, bt, sl, causal, head_dim_v, plan=None, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = mla_decode_paged(q, kv, bt, sl, scale, causal, head_dim_v, plan=plan)
    ref_out, ref_lse = ref_decode_paged(q.double().cpu(), kv.double().cpu(), bt.cpu(), sl.cpu(),
                                        scale, causal, head_dim_v)
    assert out.shape == ref_out.shape and out.dtype == q.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert_close(out, ref_out, budget("mla_decode_paged", q.dtype, "out_rel"), name="out")
    assert_close(lse, ref_lse, name="lse", abs_tol=budget("mla_decode_paged", q.dtype, "lse_abs"))
    return out, lse


# (lens, s_q, N, block_size, plan): lengths not multiples of the tiles, empty and length-1
# requests, one split and several, tensor-descriptor tiles and pointer gathers, one head group
# and several (N·s_q > block_m).
TINY_CASES = [
    ([37, 0, 1, 80], 1, 4, 16, None),
    ([37, 0, 1, 80], 1, 4, 16, DecodePlan(16, 16, 3, 4, 1, use_tma=True)),
    ([65, 3, 0], 2, 4, 64, DecodePlan(16, 32, 2, 4, 1, use_tma=True)),
    ([65, 3, 0], 2, 4, 64, DecodePlan(16, 32, 2, 4, 1, use_tma=False)),
    ([20, 1, 47], 3, 8, 1, DecodePlan(16, 16, 2, 4, 1)),  # page size 1: per-row gather
    ([33, 2], 4, 5, 16, DecodePlan(16, 16, 1, 4, 1)),  # N·s_q = 20 rows: two head groups
    ([70, 0, 5], 2, 8, 32, DecodePlan(16, 32, 2, 4, 1, use_tma=True)),  # pages of 32
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens,s_q,N,block_size,plan", TINY_CASES)
def test_tiny_preset_dims(poisoned_alloc, dtype, causal, lens, s_q, N, block_size, plan):
    """The tiny preset's latent: D = Lkv + R = 32 + 8 (neither a power of two nor a tile)."""
    q, kv, bt, sl = make_inputs(lens, s_q, N, 40, block_size, dtype, seed=len(lens) * 7 + s_q)
    check_against_reference(q, kv, bt, sl, causal, 32, plan)


@pytest.mark.parametrize("causal,s_q,plan", [
    (False, 1, None),
    (True, 2, DecodePlan(16, 64, 2, 4, 1, use_tma=True)),
])
def test_deepseek_dims(poisoned_alloc, causal, s_q, plan):
    """D = 576, head_dim_v = 512 with few heads and short, ragged lengths."""
    q, kv, bt, sl = make_inputs([70, 1, 0, 129], s_q, 2, 576, 64, torch.float16, seed=3)
    check_against_reference(q, kv, bt, sl, causal, 512, plan)


def test_causal_shorter_than_s_q(poisoned_alloc):
    """L < s_q: the first queries see no key (lse +inf, out 0), the last ones some."""
    q, kv, bt, sl = make_inputs([2, 1, 4], 4, 3, 40, 16, torch.float32, seed=5)
    out, lse = check_against_reference(q, kv, bt, sl, True, 32)
    assert torch.isinf(lse[0, :, :2]).all() and (lse[0, :, :2] > 0).all()
    assert (out[0, :2] == 0).all()


def test_no_rope_columns_and_adversarial_logits(poisoned_alloc):
    """head_dim_v == D (no rope part) and logits scaled ×30 (one key dominates)."""
    q, kv, bt, sl = make_inputs([19, 50], 1, 4, 32, 16, torch.float32, seed=6)
    check_against_reference(q, kv, bt, sl, False, 32, scale=30 * 32 ** -0.5)


def test_strided_q_and_many_splits(poisoned_alloc):
    """q as a strided view (heads of a wider buffer); more splits than a request has tiles."""
    q_wide, kv, bt, sl = make_inputs([45, 9], 1, 8, 40, 16, torch.float32, seed=7)
    q = q_wide[:, :, ::2]
    assert not q.is_contiguous()
    check_against_reference(q, kv, bt, sl, False, 32, DecodePlan(16, 16, 7, 4, 1))


def test_plan_uses_shapes_only():
    """The split count follows batch, heads, capacity and SMs; small batches get splits."""
    small = plan_decode(1, 1, 128, 576, 512, 64, 64, torch.bfloat16, num_sms=132)
    large = plan_decode(256, 1, 128, 576, 512, 128, 64, torch.bfloat16, num_sms=132)
    assert small.num_splits > 1 and large.num_splits == 1
    assert small.block_m == 64 and plan_decode(4, 1, 16, 576, 512, 64, 64, torch.bfloat16,
                                               132).block_m == 16
    assert plan_decode(4, 1, 16, 576, 512, 64, 16, torch.bfloat16, 132).block_n == 16
    # never more splits than whole tiles of the capacity
    tiny = plan_decode(1, 1, 16, 576, 512, 2, 64, torch.bfloat16, num_sms=132)
    assert tiny.num_splits == 1


def test_argument_errors():
    q, kv, bt, sl = make_inputs([5, 3], 1, 2, 40, 16, torch.float32, seed=8)
    with pytest.raises(TypeError, match="q"):
        mla_decode_paged(q.double(), kv.double(), bt, sl, 0.1, head_dim_v=32)
    with pytest.raises(ValueError, match="head_dim_v"):
        mla_decode_paged(q, kv, bt, sl, 0.1, head_dim_v=41)
    with pytest.raises(TypeError, match="block_table"):
        mla_decode_paged(q, kv, bt.long(), sl, 0.1, head_dim_v=32)
    bad = sl.clone()
    bad[0] = bt.shape[1] * 16 + 1
    with pytest.raises(ValueError, match="cache_seqlens"):
        mla_decode_paged(q, kv, bt, bad, 0.1, head_dim_v=32)
    bad[0] = -1
    with pytest.raises(ValueError, match="cache_seqlens"):
        mla_decode_paged(q, kv, bt, bad, 0.1, head_dim_v=32, validate=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("plan", [DecodePlan(16, 16, 1, 4, 1), DecodePlan(16, 16, 3, 4, 1)],
                         ids=["one split", "three splits"])
def test_nan_input_is_nan_out_not_a_marker(poisoned_alloc, plan, causal):
    """conventions §13, on both paths: a NaN in one query's q makes that query's out and lse
    NaN (not lse = +inf, the "no key" marker; with splits, not the combine's "empty split"
    either); a NaN in a cache row makes every query that sees it NaN; a query of a request
    without keys stays "no key"; every other query is untouched."""
    q, kv, bt, sl = make_inputs([37, 0, 20], 2, 4, 40, 16, torch.float32, seed=12)
    q[0, 1, 2, 5] = float("nan")
    q[1, 0, 1, 0] = float("nan")  # request 1 has no keys
    row = bt[2, 1].long() * 16 + 2  # request 2's key 18: both of its queries see it
    kv.view(-1, 40)[row, 7] = float("nan")
    scale = 40 ** -0.5
    out, lse = mla_decode_paged(q, kv, bt, sl, scale, causal, 32, plan=plan)
    ref_out, ref_lse = ref_decode_paged(q.double().cpu(), kv.double().cpu(), bt.cpu(), sl.cpu(),
                                        scale, causal, 32)
    assert torch.isnan(ref_lse[0, 2, 1]) and torch.isnan(ref_lse[2]).all()
    assert torch.isposinf(ref_lse[1]).all() and (ref_out[1] == 0).all()
    assert_nan_rule(out, ref_out, 1e-5, name="out")
    assert_nan_rule(lse, ref_lse, name="lse", abs_tol=1e-5)
