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
    # the seesaw variant: unsplit 64-row 16-bit plans only
    assert large.seesaw and not small.seesaw and not tiny.seesaw
    assert plan_decode(64, 2, 128, 576, 512, 128, 64, torch.float16, 132).seesaw
    assert not plan_decode(256, 1, 128, 576, 512, 128, 64, torch.float32, 132).seesaw


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


# ------------------------------------------------------------------ attention sinks

SINK_PLANS = [None, DecodePlan(16, 16, 1, 4, 1), DecodePlan(16, 16, 3, 4, 1, use_tma=False)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("plan", SINK_PLANS,
                         ids=["default", "one split", "three splits"])
def test_sink_matches_reference(poisoned_alloc, plan, causal):
    """The sink in the decode kernel's epilogue (one split) and in the combine's (several):
    finite sinks of both signs, +inf (out 0), -inf (no change), NaN (that head's out NaN for
    every query, lse unchanged); an empty request and causal queries without keys keep out 0
    and lse +inf (NaN under the NaN sink). Against the float64 reference."""
    q, kv, bt, sl = make_inputs([37, 0, 2, 50], 3, 6, 40, 16, torch.float32, seed=21)
    sink = torch.tensor([0.5, -3.0, float("inf"), float("-inf"), float("nan"), 40.0],
                        device=DEVICE)
    scale = 40 ** -0.5
    out, lse = mla_decode_paged(q, kv, bt, sl, scale, causal, 32, attn_sink=sink, plan=plan)
    plain_out, plain_lse = mla_decode_paged(q, kv, bt, sl, scale, causal, 32, plan=plan)
    ref_out, ref_lse = ref_decode_paged(q.double().cpu(), kv.double().cpu(), bt.cpu(), sl.cpu(),
                                        scale, causal, 32, attn_sink=sink.cpu())
    assert torch.isnan(ref_out[:, :, 4]).all() and (ref_out[:, :, 2] == 0).all()
    assert torch.equal(lse, plain_lse)  # the sink leaves the lse alone
    assert torch.equal(out[:, :, 3], plain_out[:, :, 3])  # -inf: nothing changes
    assert_nan_rule(out, ref_out, budget("mla_decode_paged", q.dtype, "out_rel"), name="out")
    assert_close(lse, ref_lse, name="lse", abs_tol=budget("mla_decode_paged", q.dtype,
                                                          "lse_abs"))


def test_sink_broken_twin_fails():
    """The comparison above has the resolution to see a sink off by 0.01 (out off by 0.25% at
    most): the reference with that sink lies outside the budget."""
    q, kv, bt, sl = make_inputs([37, 5], 1, 4, 40, 16, torch.float32, seed=22)
    sink = torch.tensor([0.5, 1.0, 2.0, 3.0], device=DEVICE)
    scale = 40 ** -0.5
    out, _ = mla_decode_paged(q, kv, bt, sl, scale, False, 32, attn_sink=sink)
    args = (q.double().cpu(), kv.double().cpu(), bt.cpu(), sl.cpu(), scale, False, 32)
    tol = budget("mla_decode_paged", q.dtype, "out_rel")
    assert_close(out, ref_decode_paged(*args, attn_sink=sink.cpu())[0], tol, name="out")
    with pytest.raises(AssertionError):
        assert_close(out, ref_decode_paged(*args, attn_sink=sink.cpu() + 0.01)[0], tol,
                     name="out")


def test_sink_argument_errors():
    q, kv, bt, sl = make_inputs([5, 3], 1, 2, 40, 16, torch.float32, seed=23)
    with pytest.raises(ValueError, match=r"attn_sink must have shape \[2\]"):
        mla_decode_paged(q, kv, bt, sl, 0.1, head_dim_v=32, attn_sink=torch.zeros(3))
    with pytest.raises(TypeError, match="attn_sink must have dtype torch.float32"):
        mla_decode_paged(q, kv, bt, sl, 0.1, head_dim_v=32,
                         attn_sink=torch.zeros(2, dtype=torch.float64, device=DEVICE))


# ------------------------------------------------- value checks, and bad values without them

def _bad_inputs(kind: str, block_size: int):
    """Four requests; request 1 (and, for ``"two"``, request 3 too) carries the bad value."""
    q, kv, bt, sl = make_inputs([37, 29, 0, 20], 2, 4, 40, block_size, torch.float32, seed=31)
    nb, cap = kv.shape[0], bt.shape[1] * block_size
    if kind == "negative length":
        sl[1] = -5
    elif kind == "length past capacity":
        sl[1] = cap + 1
    elif kind == "huge length":
        sl[1] = 2**31 - 1
    elif kind == "entry -1":
        bt[1, -(-29 // block_size) - 1] = -1  # the last used entry
    elif kind == "entry num_blocks":
        bt[1, 0] = nb
    elif kind == "entry huge":
        bt[1, 0] = 2**31 - 1
    return q, kv, bt, sl


BAD_KINDS = ["negative length", "length past capacity", "huge length", "entry -1",
             "entry num_blocks", "entry huge"]
BAD_PLANS = [(16, DecodePlan(16, 16, 1, 4, 1, use_tma=True)),
             (16, DecodePlan(16, 16, 3, 4, 1, use_tma=False)),
             (4, DecodePlan(16, 16, 2, 4, 1)),  # pages smaller than a tile: per-row lookups
             (16, DecodePlan(16, 16, 2, 4, 1, use_tma=True))]


@pytest.mark.parametrize("kind", BAD_KINDS)
@pytest.mark.parametrize("block_size,plan", BAD_PLANS,
                         ids=["one split tma", "three splits", "page 4", "two splits tma"])
def test_bad_values_unvalidated_give_nan_rows(poisoned_alloc, kind, block_size, plan):
    """validate=False: a bad length or used block-table entry never makes the kernel read
    outside its tensors (compute-sanitizer runs this on the GPU); its request gets NaN out and
    lse for every query, and every other request is exact."""
    q, kv, bt, sl = _bad_inputs(kind, block_size)
    scale = 40 ** -0.5
    out, lse = mla_decode_paged(q, kv, bt, sl, scale, True, 32, plan=plan, validate=False)
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all(), kind
    good = [0, 2, 3]
    ref_out, ref_lse = ref_decode_paged(q[good].double().cpu(), kv.double().cpu(),
                                        bt[good].cpu(), sl[good].cpu(), scale, True, 32)
    assert_close(out[good], ref_out, budget("mla_decode_paged", q.dtype, "out_rel"), name="out")
    assert_close(lse[good], ref_lse, name="lse",
                 abs_tol=budget("mla_decode_paged", q.dtype, "lse_abs"))


@pytest.mark.parametrize("kind,message", [
    ("negative length", r"cache_seqlens must be >= 0, got -5 for request 1"),
    ("length past capacity", r"cache_seqlens\[1\] = 49 exceeds the block table's capacity "
                             r"3 blocks x 16 = 48"),
    ("entry -1", r"block_table\[1\] points outside kv_cache's \d+ blocks within its first 29 "
                 r"tokens: range \[-1, \d+\]"),
    ("entry num_blocks", r"block_table\[1\] points outside kv_cache's (\d+) blocks within its "
                         r"first 29 tokens: range \[\d+, \1\]"),
])
@pytest.mark.parametrize("path", ["fast", "reference"])
def test_value_check_messages(kind, message, path):
    """validate=True (and the reference, which shares the check): one message per kind naming
    the argument, the request and expected against actual."""
    q, kv, bt, sl = _bad_inputs(kind, 16)
    if path == "fast":
        call = lambda: mla_decode_paged(q, kv, bt, sl, 0.1, head_dim_v=32, validate=True)  # noqa: E731
    else:
        call = lambda: ref_decode_paged(q.double().cpu(), kv.double().cpu(), bt.cpu(),  # noqa: E731
                                        sl.cpu(), 0.1, head_dim_v=32)
    with pytest.raises(ValueError, match=message):
        call()


def test_value_check_names_the_first_bad_request():
    """Several bad requests: the message names the first (request order), whatever its kind;
    entries past a request's length are not checked (-1 padding is allowed there)."""
    q, kv, bt, sl = make_inputs([37, 29, 0, 20], 1, 2, 40, 16, torch.float32, seed=32)
    bt[0, -1] = -1  # request 0's last used entry (37 tokens: all 3 pages)
    bt[2, :] = -1  # request 2 is empty: nothing used
    sl[3] = -1
    with pytest.raises(ValueError, match=r"block_table\[0\] points outside"):
        mla_decode_paged(q, kv, bt, sl, 0.1, head_dim_v=32, validate=True)
    bt[0, -1] = 0
    with pytest.raises(ValueError, match=r"cache_seqlens must be >= 0, got -1 for request 3"):
        mla_decode_paged(q, kv, bt, sl, 0.1, head_dim_v=32, validate=True)
    sl[3] = 20
    sl[1] = 16  # request 1 now uses one page: a -1 in its second entry is never read
    bt[1, 1] = -1
    mla_decode_paged(q, kv, bt, sl, 0.1, head_dim_v=32, validate=True)


def test_validation_setting():
    """validate=None follows the global setting (on for this test run, conftest.py), which
    set_validation and the validation() context change; True and False decide per call."""
    import mla.fast as fast

    q, kv, bt, sl = _bad_inputs("negative length", 16)
    assert fast.validation_enabled()  # the test run's setting
    with pytest.raises(ValueError, match="cache_seqlens"):
        mla_decode_paged(q, kv, bt, sl, 0.1, head_dim_v=32)
    with fast.validation(False):
        assert not fast.validation_enabled()
        out, _ = mla_decode_paged(q, kv, bt, sl, 0.1, head_dim_v=32)  # unchecked: NaN rows
        assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()
        with pytest.raises(ValueError, match="cache_seqlens"):
            mla_decode_paged(q, kv, bt, sl, 0.1, head_dim_v=32, validate=True)
    assert fast.validation_enabled()
    fast.set_validation(False)
    try:
        mla_decode_paged(q, kv, bt, sl, 0.1, head_dim_v=32)
    finally:
        fast.set_validation(True)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        fast.set_validation(1)  # type: ignore[arg-type]


@pytest.mark.parametrize("env,expected", [(None, False), ("0", False), ("1", True)])
def test_validation_is_off_by_default(env, expected):
    """A fresh process: off unless MLA_FAST_VALIDATE=1 was set before mla.fast's import."""
    import os
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if k != "MLA_FAST_VALIDATE"}
    if env is not None:
        environ["MLA_FAST_VALIDATE"] = env
    done = subprocess.run([sys.executable, "-c", "import mla.fast as f; "
                           "print(f.validation_enabled())"], env=environ, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == str(expected)


# ------------------------------------------------------------ the per-shape launch cache

def test_launch_cache_keys_what_the_checks_read():
    """A second call of the same shapes reuses the launch; other strides, another dtype or a
    different causal flag get their own; a bad scale is still refused on a cached launch."""
    import mla.fast.decode as fast_decode

    q, kv, bt, sl = make_inputs([37, 5], 1, 4, 40, 16, torch.float32, seed=33)
    fast_decode._launches.clear()
    first = mla_decode_paged(q, kv, bt, sl, 0.1, head_dim_v=32)
    assert len(fast_decode._launches) == 1
    again = mla_decode_paged(q, kv, bt, sl, 0.1, head_dim_v=32)
    assert len(fast_decode._launches) == 1 and torch.equal(first[0], again[0])
    wide = q.repeat_interleave(2, dim=2)[:, :, ::2]  # same values, other strides
    assert wide.stride() != q.stride()
    assert torch.equal(mla_decode_paged(wide, kv, bt, sl, 0.1, head_dim_v=32)[0], first[0])
    mla_decode_paged(q, kv, bt, sl, 0.1, True, head_dim_v=32)
    assert len(fast_decode._launches) == 3
    for bad in (0.0, float("nan"), -1.0):
        with pytest.raises(ValueError, match="softmax_scale"):
            mla_decode_paged(q, kv, bt, sl, bad, head_dim_v=32)
    with pytest.raises(TypeError, match="head_dim_v must be an int"):
        mla_decode_paged(q, kv, bt, sl, 0.1, head_dim_v=32.0)  # equal to 32 as a key: refused
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        mla_decode_paged(q.tolist(), kv, bt, sl, 0.1, head_dim_v=32)


def test_specialization_classes_match_triton():
    """mla.fast.launch's integer and pointer classes determine Triton's own specialization of
    the argument (what a compiled kernel was built for): equal class, equal specialization."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from mla.fast.launch import int_spec, ptr_spec

    def triton_spec(x):
        return native_specialize_impl(BaseBackend, x, False, True, True)

    values = [0, 1, 2, 15, 16, 17, 32, 48, 576, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16,
              2**40, -1, -16, -(2**31), -(2**31) - 1, 2**63, 2**63 + 16]
    seen: dict = {}
    for v in values:
        seen.setdefault(int_spec(v), set()).add(str(triton_spec(v)))
    assert all(len(specs) == 1 for specs in seen.values()), seen
    assert len(seen) >= 5  # 1, divisible or not, 32-bit or wider
    base = torch.zeros(64, dtype=torch.float32)
    ptrs = {}
    for off in range(8):
        t = base[off:]
        ptrs.setdefault(ptr_spec(t), set()).add(str(triton_spec(t)))
    assert len(ptrs) == 2 and all(len(specs) == 1 for specs in ptrs.values()), ptrs


def test_compiled_launcher_protocol(monkeypatch):
    """mla.fast.launch.CompiledLauncher as the GPU runs it, with a stand-in kernel: the first
    launch of a key goes through the JIT and keeps what it returns; later ones call the
    compiled launcher with Triton 3.6's arguments (grid, stream, function, metadata, no hooks,
    every kernel argument); a launch hook sends it back to the JIT; a direct launch the
    launcher refuses falls back to the JIT for good, with one warning."""
    from triton import knobs

    import mla.fast.launch as launch

    calls = []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def __init__(self):
            self.refuse = False

        def run(self, *a):
            if self.refuse:
                raise TypeError("launcher signature")
            calls.append(("direct", a))

    compiled = Compiled()

    class Kernel:
        __name__ = "kernel"

        def __getitem__(self, grid):
            def jit(*args, **options):
                calls.append(("jit", grid, args, options))
                return compiled
            return jit

    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch.torch._C, "_cuda_getCurrentRawStream", lambda d: 77,
                        raising=False)
    launcher = launch.CompiledLauncher(Kernel())
    launcher("k", (2, 3, 1), ("a", 5, "C"), num_warps=4)
    launcher("k", (2, 3, 1), ("b", 6, "C"), num_warps=4)
    assert calls[0] == ("jit", (2, 3, 1), ("a", 5, "C"), {"num_warps": 4})
    assert calls[1] == ("direct", (2, 3, 1, 77, "fn", "meta", None, None, None, "b", 6, "C"))
    launcher(None, (1, 1, 1), ("c",))  # no key: the JIT, nothing kept
    assert calls[2][0] == "jit" and len(launcher.compiled) == 1
    chain = knobs.HookChain()  # Triton's default: an empty chain, no hook
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", chain)
    launcher("k", (2, 3, 1), ("d", 7, "C"), num_warps=4)
    assert calls[3][0] == "direct"
    chain.add(lambda *a: None)  # a profiler's hook: the JIT builds its launch metadata
    launcher("k", (2, 3, 1), ("d", 7, "C"), num_warps=4)
    assert calls[4][0] == "jit"
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    launcher("k", (2, 3, 1), ("d", 7, "C"), num_warps=4)
    assert calls[5][0] == "jit"
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", knobs.HookChain())
    compiled.refuse = True
    with pytest.warns(RuntimeWarning, match="launching kernel directly failed"):
        launcher("k", (2, 3, 1), ("e", 8, "C"), num_warps=4)
    assert calls[6][0] == "jit" and not launcher.direct
    launcher("k", (2, 3, 1), ("f", 9, "C"), num_warps=4)
    assert calls[7][0] == "jit" and len(calls) == 8
