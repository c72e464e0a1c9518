"""Properties of ``merge_attn_states`` and ``merge_attn_states_list`` (conventions §6).

Layouts: ``o [T, N, D]``, ``lse [N, T]``. An entry whose ``lse`` is ``-inf`` or ``+inf`` saw no
keys; its ``o`` is garbage (NaN, inf or a large number) that must never leak into the result.
Inputs are fresh random tensors drawn from a hypothesis seed; sizes include ``T = 0`` and
``T = 1``; ``lse`` spans magnitudes from 1e-3 to 1e30.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla import fast
from mla.compare import LSE_ABS_TOL, assert_close, rel_err
from mla.reference import attention_with_lse, merge_attn_states, merge_attn_states_list

GARBAGE = (float("nan"), float("inf"), float("-inf"), 1e30)
FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)

sizes = st.tuples(st.integers(0, 9), st.integers(1, 4), st.integers(1, 9))  # T, N, D
seeds = st.integers(0, 2**31 - 1)
lse_scales = st.sampled_from([1e-3, 1.0, 30.0, 1e3, 1e6, 1e30])
empty_fracs = st.sampled_from([0.0, 0.3, 0.7, 1.0])


def _state(gen: torch.Generator, T: int, N: int, D: int, *, scale: float, p_empty: float,
           garbage: float = float("nan"), dtype: torch.dtype = torch.float64
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A random ``(o, lse)``; a ``p_empty`` share of entries empty (±inf at random) with
    ``garbage`` in their output. ``lse`` is float32 unless ``dtype`` is float64."""
    o = torch.randn(T, N, D, generator=gen, dtype=torch.float64)
    lse = torch.randn(N, T, generator=gen, dtype=torch.float64) * scale
    empty = torch.rand(N, T, generator=gen, dtype=torch.float64) < p_empty
    sign = torch.where(torch.rand(N, T, generator=gen) < 0.5, 1.0, -1.0).to(torch.float64)
    lse = torch.where(empty, sign * float("inf"), lse)
    o = torch.where(empty.T[..., None], garbage, o)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return o.to(dtype), lse.to(lse_dtype)


def _is_empty(lse: torch.Tensor) -> torch.Tensor:
    return torch.isinf(lse)


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN equal to NaN of the same pattern, -0.0 distinct from 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


@given(sizes, seeds, lse_scales, empty_fracs, st.sampled_from(GARBAGE),
       st.sampled_from(FLOATS))
def test_commutative_bitwise(size, seed, scale, p_empty, garbage, dtype):
    # With two states the weights and the weighted sum are single additions, which are
    # commutative in IEEE arithmetic: the merge is commutative bit for bit, not just to rounding.
    gen = torch.Generator().manual_seed(seed)
    a = _state(gen, *size, scale=scale, p_empty=p_empty, garbage=garbage, dtype=dtype)
    b = _state(gen, *size, scale=scale, p_empty=p_empty, garbage=garbage, dtype=dtype)
    o_ab, lse_ab = merge_attn_states(*a, *b)
    o_ba, lse_ba = merge_attn_states(*b, *a)
    assert _bitwise(o_ab, o_ba)
    assert _bitwise(lse_ab, lse_ba)


@given(sizes, seeds, lse_scales, empty_fracs, st.sampled_from(GARBAGE))
def test_associative_float64(size, seed, scale, p_empty, garbage):
    gen = torch.Generator().manual_seed(seed)
    a, b, c = (_state(gen, *size, scale=scale, p_empty=p_empty, garbage=garbage)
               for _ in range(3))
    o_l, lse_l = merge_attn_states(*merge_attn_states(*a, *b), *c)
    o_r, lse_r = merge_attn_states(*a, *merge_attn_states(*b, *c))
    assert_close(o_l, o_r, 1e-12, name="o")
    assert_close(lse_l, lse_r, 1e-12, name="lse")


@given(sizes, seeds, lse_scales, empty_fracs, st.sampled_from(GARBAGE),
       st.sampled_from(FLOATS), st.booleans())
def test_one_side_empty_passes_through_bitwise(size, seed, scale, p_empty, garbage, dtype,
                                               empty_first):
    """Entries where exactly one side is empty equal the other side's, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    a = _state(gen, *size, scale=scale, p_empty=p_empty, garbage=garbage, dtype=dtype)
    b = _state(gen, *size, scale=scale, p_empty=p_empty, garbage=garbage, dtype=dtype)
    p, s = (a, b) if empty_first else (b, a)
    o, lse = merge_attn_states(*p, *s)
    assert o.dtype == dtype and lse.dtype == p[1].dtype
    only_p = ~_is_empty(p[1]) & _is_empty(s[1])  # [N, T]
    only_s = _is_empty(p[1]) & ~_is_empty(s[1])
    assert _bitwise(lse[only_p], p[1][only_p]) and _bitwise(lse[only_s], s[1][only_s])
    assert _bitwise(o[only_p.T], p[0][only_p.T]) and _bitwise(o[only_s.T], s[0][only_s.T])


@given(sizes, seeds, lse_scales, st.sampled_from(GARBAGE), st.sampled_from(FLOATS))
def test_whole_side_empty_is_identity(size, seed, scale, garbage, dtype):
    """A prefix with no keys at all (lse ±inf, output garbage) returns the suffix unchanged."""
    gen = torch.Generator().manual_seed(seed)
    empty = _state(gen, *size, scale=scale, p_empty=1.0, garbage=garbage, dtype=dtype)
    full = _state(gen, *size, scale=scale, p_empty=0.0, dtype=dtype)
    for args in ((*empty, *full), (*full, *empty)):
        o, lse = merge_attn_states(*args)
        assert _bitwise(o, full[0]) and _bitwise(lse, full[1])


@given(sizes, seeds, st.sampled_from(GARBAGE), st.sampled_from(FLOATS))
def test_both_empty_gives_zero_and_neg_inf(size, seed, garbage, dtype):
    gen = torch.Generator().manual_seed(seed)
    a = _state(gen, *size, scale=1.0, p_empty=1.0, garbage=garbage, dtype=dtype)
    b = _state(gen, *size, scale=1.0, p_empty=1.0, garbage=garbage, dtype=dtype)
    o, lse = merge_attn_states(*a, *b)
    assert _bitwise(o, torch.zeros_like(a[0]))  # +0.0, not -0.0, never NaN
    assert torch.isneginf(lse).all()
    o_k, lse_k = merge_attn_states_list([a[0], b[0], a[0]], [a[1], b[1], b[1]])
    assert _bitwise(o_k, torch.zeros_like(a[0])) and torch.isneginf(lse_k).all()


@given(sizes, seeds, lse_scales, st.sampled_from(FLOATS), st.integers(2, 5))
def test_never_nan_on_finite_inputs(size, seed, scale, dtype, K):
    """Finite inputs of any magnitude (also lse gaps of 1e30, where a weight underflows)."""
    gen = torch.Generator().manual_seed(seed)
    states = [_state(gen, *size, scale=scale, p_empty=0.0, dtype=dtype) for _ in range(K)]
    o, lse = merge_attn_states(*states[0], *states[1])
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    o, lse = merge_attn_states_list([s[0] for s in states], [s[1] for s in states])
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    # the merged lse is at least the largest input lse (the log of a sum of positives)
    lse_max = torch.stack([s[1] for s in states]).max(dim=0).values
    assert (lse >= lse_max).all()


@given(sizes, seeds, lse_scales, empty_fracs, st.sampled_from(GARBAGE),
       st.sampled_from(FLOATS))
def test_pos_inf_is_empty(size, seed, scale, p_empty, garbage, dtype):
    """Flipping every empty entry's lse between +inf and -inf changes nothing."""
    gen = torch.Generator().manual_seed(seed)
    a = _state(gen, *size, scale=scale, p_empty=p_empty, garbage=garbage, dtype=dtype)
    b = _state(gen, *size, scale=scale, p_empty=p_empty, garbage=garbage, dtype=dtype)
    o, lse = merge_attn_states(*a, *b)
    for sign in (1.0, -1.0):
        a_s = (a[0], torch.where(_is_empty(a[1]), sign * float("inf"), a[1]))
        b_s = (b[0], torch.where(_is_empty(b[1]), sign * float("inf"), b[1]))
        o_s, lse_s = merge_attn_states(*a_s, *b_s)
        assert _bitwise(o_s, o) and _bitwise(lse_s, lse)
    both = _is_empty(a[1]) & _is_empty(b[1])
    assert torch.isneginf(lse[both]).all()  # the merged "empty" is always -inf


@given(st.integers(0, 9), st.integers(0, 12), st.sampled_from([(1, 1), (4, 1), (4, 2), (3, 3)]),
       st.integers(1, 8), st.integers(1, 8), seeds, st.booleans(),
       st.sampled_from([1.0, 30.0]))
def test_merge_equals_attention_over_union(Sq, Skv, heads, D, Dv, seed, causal, logit_scale):
    """Split the keys of a random attention problem into two disjoint sets at random, attend
    to each, merge: the result is the attention over all keys (float64, 1e-12)."""
    N, Nk = heads
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(Sq, N, D, generator=gen, dtype=torch.float64)
    k = torch.randn(Skv, Nk, D, generator=gen, dtype=torch.float64)
    v = torch.randn(Skv, Nk, Dv, generator=gen, dtype=torch.float64)
    scale = logit_scale * D ** -0.5  # ×30: a few dominant keys
    # positions such that, causally, some queries see none of the keys
    q_pos = torch.randint(-3, Skv + 3, (Sq,), generator=gen)
    k_pos = torch.randperm(Skv, generator=gen)
    side = torch.rand(Skv, generator=gen) < torch.rand(1, generator=gen)  # maybe all one side
    o_full, lse_full = attention_with_lse(q, k, v, scale, causal=causal,
                                          q_positions=q_pos, k_positions=k_pos)
    halves = [attention_with_lse(q, k[m], v[m], scale, causal=causal, q_positions=q_pos,
                                 k_positions=k_pos[m]) for m in (side, ~side)]
    o, lse = merge_attn_states(*halves[0], *halves[1])
    assert_close(o, o_full, 1e-12, name="o")
    assert_close(lse, lse_full, 1e-12, name="lse")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_full))


@given(sizes, seeds, lse_scales, empty_fracs, st.sampled_from(GARBAGE), st.integers(2, 6))
def test_list_merge_equals_pairwise_fold(size, seed, scale, p_empty, garbage, K):
    gen = torch.Generator().manual_seed(seed)
    states = [_state(gen, *size, scale=scale, p_empty=p_empty, garbage=garbage)
              for _ in range(K)]
    o, lse = merge_attn_states_list([s[0] for s in states], [s[1] for s in states])
    o_f, lse_f = functools.reduce(lambda x, y: merge_attn_states(*x, *y), states)
    assert_close(o, o_f, 1e-12, name="o")
    assert_close(lse, lse_f, 1e-12, name="lse")
    if K == 2:  # the pairwise merge is the K = 2 list merge
        assert _bitwise(o, o_f) and _bitwise(lse, lse_f)


@given(sizes, seeds, lse_scales, empty_fracs, st.sampled_from(GARBAGE))
def test_list_merge_of_one_state(size, seed, scale, p_empty, garbage):
    """K = 1: present entries pass through bit for bit, empty ones become ``0`` and ``-inf``."""
    gen = torch.Generator().manual_seed(seed)
    o_in, lse_in = _state(gen, *size, scale=scale, p_empty=p_empty, garbage=garbage)
    o, lse = merge_attn_states_list([o_in], [lse_in])
    empty = _is_empty(lse_in)
    assert _bitwise(o[~empty.T], o_in[~empty.T]) and _bitwise(lse[~empty], lse_in[~empty])
    assert (o[empty.T] == 0).all() and torch.isneginf(lse[empty]).all()


@given(sizes, seeds, st.sampled_from([1.0, 30.0]), empty_fracs,
       st.sampled_from([torch.bfloat16, torch.float16]))
def test_low_precision_keeps_dtypes_and_accuracy(size, seed, scale, p_empty, dtype):
    """bf16/fp16 outputs stay bf16/fp16, lse stays float32, and the result matches a float64
    merge of the upcast inputs within conventions §11's tolerances."""
    gen = torch.Generator().manual_seed(seed)
    a = _state(gen, *size, scale=scale, p_empty=p_empty, dtype=dtype)
    b = _state(gen, *size, scale=scale, p_empty=p_empty, dtype=dtype)
    o, lse = merge_attn_states(*a, *b)
    assert o.dtype == dtype and lse.dtype == torch.float32
    o_k, lse_k = merge_attn_states_list([a[0], b[0], a[0]], [a[1], b[1], b[1]])
    assert o_k.dtype == dtype and lse_k.dtype == torch.float32
    o_ref, lse_ref = merge_attn_states(a[0].double(), a[1].double(), b[0].double(),
                                       b[1].double())
    assert_close(o, o_ref, name="o")  # the bf16/fp16 tolerance of conventions §11
    assert_close(lse, lse_ref, abs_tol=LSE_ABS_TOL, name="lse")


def test_merge_of_halves_is_not_their_average():
    """A sanity check that the properties above can fail: an unweighted average of two halves
    is far from the attention over all keys."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 2, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(11, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(11, 2, 8, generator=gen, dtype=torch.float64)
    o_full, _ = attention_with_lse(q, k, v, 1.0)
    (o_a, _), (o_b, _) = (attention_with_lse(q, k[:4], v[:4], 1.0),
                          attention_with_lse(q, k[4:], v[4:], 1.0))
    assert rel_err((o_a + o_b) / 2, o_full) > 1e-2


NAN = float("nan")
INF = float("inf")


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_nan_lse_is_nan_out_not_a_marker(path):
    """conventions §13 on both paths (the reference in float64, ``mla.fast``'s kernel in
    float32, under the interpreter on the CPU): a NaN lse is not the "empty" marker. Merged
    with a present side it gives NaN o and lse (not 0, not the other side passed through);
    beside an empty side it is the present one and passes through like any other; a NaN in a
    present side's o stays in that element; an empty side's NaN o is never read."""
    merge, dtype = ((merge_attn_states, torch.float64) if path == "reference"
                    else (fast.merge_attn_states, torch.float32))
    device = "cuda" if path == "fast" and torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(7)
    T, N, D = 6, 2, 5
    o_p, o_s = (torch.randn(T, N, D, generator=gen, dtype=torch.float64).to(dtype=dtype,
                                                                           device=device)
                for _ in range(2))
    lse_p, lse_s = (torch.randn(N, T, generator=gen, dtype=torch.float64).to(dtype=dtype,
                                                                              device=device)
                    for _ in range(2))
    clean_o, clean_lse = merge(o_p, lse_p, o_s, lse_s)
    lse_p[0, 0] = NAN  # (n, t) = (0, 0): NaN beside a present side
    lse_p[0, 1], lse_s[0, 1] = NAN, INF  # (0, 1): NaN beside an empty side
    lse_p[0, 2], lse_s[0, 2] = -INF, NAN  # (0, 2): the same, the other way round
    o_p[3, 0, 1] = NAN  # (0, 3): one NaN element in a present side's o
    lse_p[1, 4], lse_s[1, 4] = NAN, NAN  # (1, 4): both NaN
    lse_p[1, 5], o_p[5, 1] = INF, NAN  # (1, 5): an empty side holding NaN
    o, lse = merge(o_p, lse_p, o_s, lse_s)

    assert torch.isnan(o[0, 0]).all() and torch.isnan(lse[0, 0])
    assert torch.isnan(o[4, 1]).all() and torch.isnan(lse[1, 4])
    assert torch.equal(o[1, 0], o_p[1, 0]) and torch.isnan(lse[0, 1])
    assert torch.equal(o[2, 0], o_s[2, 0]) and torch.isnan(lse[0, 2])
    assert torch.isnan(o[3, 0, 1]) and not torch.isnan(o[3, 0, [0, 2, 3, 4]]).any()
    assert torch.equal(lse[0, 3], clean_lse[0, 3])
    assert torch.equal(o[5, 1], o_s[5, 1]) and torch.equal(lse[1, 5], lse_s[1, 5])
    untouched = torch.ones(N, T, dtype=torch.bool, device=device)
    untouched[0, :4] = untouched[1, 4:] = False
    assert torch.equal(o[untouched.T], clean_o[untouched.T])
    assert torch.equal(lse[untouched], clean_lse[untouched])


def test_nan_lse_in_a_list_merge():
    """The K-state merge: one NaN lse among present states makes the entry NaN."""
    gen = torch.Generator().manual_seed(8)
    states = [(torch.randn(3, 2, 4, generator=gen, dtype=torch.float64),
               torch.randn(2, 3, generator=gen, dtype=torch.float64)) for _ in range(3)]
    states[1][1][1, 2] = NAN
    o, lse = merge_attn_states_list([s[0] for s in states], [s[1] for s in states])
    assert torch.isnan(o[2, 1]).all() and torch.isnan(lse[1, 2])
    assert torch.isfinite(o[:2]).all() and torch.isfinite(lse[:, :2]).all()
