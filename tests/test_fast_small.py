"""The small fast kernels and the fast prefill against the reference, tensor by tensor.

``merge_attn_states``, ``concat_and_cache_mla`` (and its ``fp8_ds_mla`` form),
``gather_cache``, ``convert_req_index_to_global_index``, the Triton attention with LSE,
``prefill_attention`` and ``chunked_prefill_attention``. On a machine without a GPU the kernels
run under ``TRITON_INTERPRET=1`` (conftest) on float16/float32 CPU tensors (the interpreter's
bf16 dot and bf16 casts are wrong), small shapes, lengths that are not multiples of the tiles,
empty and length-1 cases. On a GPU the same tests add bfloat16. Buffers the kernels fill are
NaN-poisoned (``poison_like``; wrapper allocations through ``poisoned_alloc``), so an unwritten
element fails. Float results are compared with the reference in float64 on upcast inputs;
copies and index maps must match bit for bit. One exception, for the lse of the prefill paths
that up-project the latent: the keys ``kv_c · W_UK`` are materialized in the input dtype (as
the reference does when it runs in that dtype, and as any bf16 path feeding an attention
kernel must), which moves a bf16 lse by about 3e-3 from the float64 one (measured for the
reference itself in bf16: 3.1e-3 at S=512, N=16). Their lse is held to its budget (conventions
§11, ``mla.compare.ERROR_BUDGETS``) against the reference run in the input dtype (float32
accumulation); their ``o`` still against float64. Every limit is the kernel's budget.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _nan_rule import assert_nan_rule
from hypothesis import given, settings
from hypothesis import strategies as st

import mla.fast.attention as fast_attention
import mla.fast.chunked as fast_chunked
import mla.fast.prefill as fast_prefill
from mla import compare
from mla.compare import assert_close, budget, poison_like
from mla.fast.attention import _split_dim, attention_with_lse, flash_attention_with_lse
from mla.fast.chunked import chunked_prefill_attention
from mla.fast.fp8 import concat_and_cache_fp8_ds_mla
from mla.fast.merge import merge_attn_states
from mla.fast.paged_cache import concat_and_cache_mla, gather_cache
from mla.fast.prefill import prefill_attention
from mla.fast.sparse import convert_req_index_to_global_index
from mla.reference import attention as ref_attention
from mla.reference import chunked as ref_chunked
from mla.reference import fp8 as ref_fp8
from mla.reference import merge as ref_merge
from mla.reference import paged_cache as ref_cache
from mla.reference import prefill as ref_prefill
from mla.reference import sparse as ref_sparse
from mla.reference.paged_cache import make_block_table

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
FLOATS = (torch.float32, torch.float16) + ((torch.bfloat16,) if ON_GPU else ())
INF = float("inf")


def rand(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float64,
         scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype).to(DEVICE)


def up(t: torch.Tensor) -> torch.Tensor:
    return t.double().cpu()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN patterns and the sign of zero included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints).cpu(), b.contiguous().view(ints).cpu())


def out_tol(kernel: str, dtype: torch.dtype) -> float:
    return budget(kernel, dtype, "out_rel")


def lse_tol(kernel: str, dtype: torch.dtype) -> float:
    return budget(kernel, dtype, "lse_abs")


@pytest.fixture
def poisoned_alloc():
    """Every buffer a wrapper allocates (``torch.empty``, ``empty_like``, ``new_empty``)
    starts poisoned."""
    with compare.poisoned_alloc():
        yield


# ---------------------------------------------------------------------------------- merge

def merge_state(gen: torch.Generator, T: int, N: int, D: int, dtype: torch.dtype,
                pattern: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``pattern [N, T]``: 0 finite, 1 ``+inf``, 2 ``-inf``; empty entries hold NaN outputs."""
    o = rand(T, N, D, gen=gen, dtype=dtype)
    lse = rand(N, T, gen=gen, dtype=torch.float32, scale=scale)
    pattern = pattern.to(DEVICE)
    lse = torch.where(pattern == 1, INF, torch.where(pattern == 2, -INF, lse))
    o = torch.where((pattern != 0).T[..., None], float("nan"), o)
    return o, lse


# Below this many output elements the Frobenius budget (twice the worst error over the check's
# outputs of thousands of elements) does not hold: over 300 random merges of at most 840
# float32 elements it reached 1.1e-7 against 7.5e-8, while no element erred by more than 2.8
# float32 roundings of its terms' magnitude.
SMALL_MERGE = 1024


def assert_merge_elementwise(out, ref_o, ref_lse, o_p, lse_p, o_s, lse_s) -> None:
    """Each output element within the merge's rounding: four float32 roundings (the weight's
    exp, two products, the sum) of ``w_p·|o_p| + w_s·|o_s|``, plus one rounding of the result
    to the output dtype. An empty side (infinite lse) weighs 0 and is never read."""
    def part(o, lse):
        lse = up(lse)
        w = torch.where(torch.isfinite(lse), torch.exp(lse - ref_lse), 0.0).T[..., None]
        return torch.where(w > 0, w * up(o).abs(), 0.0)

    mag = part(o_p, lse_p) + part(o_s, lse_s)
    u_out = torch.finfo(out.dtype).eps / 2
    bound = 4 * 2.0 ** -24 * mag + u_out * ref_o.abs()
    err = (out.double().cpu() - ref_o).abs()
    assert bool((err <= bound).all()), f"o: element error {(err - bound).max():.3e} over bound"


def check_merge(o_p, lse_p, o_s, lse_s) -> None:
    out, out_lse = merge_attn_states(o_p, lse_p, o_s, lse_s)
    ref_o, ref_lse = ref_merge.merge_attn_states(up(o_p), up(lse_p), up(o_s), up(lse_s))
    assert out.dtype == o_p.dtype and out_lse.dtype == lse_p.dtype
    assert not torch.isnan(out).any() and not torch.isnan(out_lse).any()
    if out.numel() >= SMALL_MERGE:
        assert_close(out, ref_o, out_tol("merge_attn_states", o_p.dtype), name="o")
    else:  # the budget is a Frobenius statistic; a few elements do not average: bound each
        assert_merge_elementwise(out, ref_o, ref_lse, o_p, lse_p, o_s, lse_s)
    assert_close(out_lse, ref_lse, name="lse", abs_tol=lse_tol("merge_attn_states", o_p.dtype))
    # conventions §6 edge cases, exactly: one side empty passes the other through bit for bit
    p_empty, s_empty = torch.isinf(lse_p), torch.isinf(lse_s)
    for only, o_src, lse_src in ((p_empty & ~s_empty, o_s, lse_s),
                                 (s_empty & ~p_empty, o_p, lse_p)):
        assert bitwise_equal(out_lse[only], lse_src[only])
        assert bitwise_equal(out[only.T], o_src[only.T])
    both = p_empty & s_empty
    assert torch.all(out_lse[both] == -INF)
    assert bitwise_equal(out[both.T], torch.zeros_like(out[both.T]))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T,N,D", [(37, 3, 70), (1, 1, 1), (5, 2, 512), (9, 4, 576)])
def test_merge_matches_reference(T, N, D, dtype, poisoned_alloc):
    gen = torch.Generator().manual_seed(T * 100 + D)
    pat_p = torch.randint(0, 3, (N, T), generator=gen)
    pat_s = torch.randint(0, 3, (N, T), generator=gen)
    check_merge(*merge_state(gen, T, N, D, dtype, pat_p, 3.0),
                *merge_state(gen, T, N, D, dtype, pat_s, 3.0))


@settings(max_examples=25)
@given(T=st.integers(0, 7), N=st.integers(1, 3), D=st.integers(1, 40),
       data=st.data(), scale=st.sampled_from([1e-3, 1.0, 30.0, 1e3]),
       dtype=st.sampled_from(FLOATS), seed=st.integers(0, 2**31 - 1))
def test_merge_inf_patterns(T, N, D, data, scale, dtype, seed):
    cells = st.lists(st.integers(0, 2), min_size=N * T, max_size=N * T)
    pat_p = torch.tensor(data.draw(cells), dtype=torch.int64).reshape(N, T)
    pat_s = torch.tensor(data.draw(cells), dtype=torch.int64).reshape(N, T)
    gen = torch.Generator().manual_seed(seed)
    check_merge(*merge_state(gen, T, N, D, dtype, pat_p, scale),
                *merge_state(gen, T, N, D, dtype, pat_s, scale))


def test_merge_strided_inputs():
    gen = torch.Generator().manual_seed(1)
    T, N, D = 13, 3, 40
    o_p = rand(N, T, D, gen=gen).transpose(0, 1)  # [T, N, D], not contiguous
    o_s = rand(T, N, 2 * D, gen=gen)[..., ::2]
    lse_p = rand(T, N, gen=gen, dtype=torch.float32).T
    lse_s = rand(N, T, gen=gen, dtype=torch.float32)
    check_merge(o_p.float(), lse_p, o_s.float(), lse_s)


def test_merge_bad_input():
    o = torch.zeros(3, 2, 4, device=DEVICE)
    lse = torch.zeros(2, 3, device=DEVICE)
    with pytest.raises(ValueError, match="suffix_output"):
        merge_attn_states(o, lse, o[:, :1], lse[:1])
    with pytest.raises(ValueError, match="prefix_lse"):
        merge_attn_states(o, lse.T, o, lse)
    with pytest.raises(TypeError, match="suffix_output"):
        merge_attn_states(o, lse, o.half(), lse)


# ------------------------------------------------------------------------- paged cache

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T", [0, 1, 29])
def test_concat_and_cache_matches_reference(T, dtype):
    gen = torch.Generator().manual_seed(T)
    nb, bs, Lkv, R = 7, 5, 24, 8
    kv_cache = rand(nb, bs, Lkv + R, gen=gen, dtype=dtype)
    expected = kv_cache.clone()
    slots = torch.randperm(nb * bs, generator=gen)[:T]
    slots[::4] = -1
    slots = slots.to(torch.int32).to(DEVICE)
    kv_c = rand(T, Lkv, gen=gen, dtype=dtype)
    k_pe = rand(T, 1, R, gen=gen, dtype=dtype)  # the [T, 1, R] form vLLM passes
    concat_and_cache_mla(kv_c, k_pe, kv_cache, slots)
    ref_cache.concat_and_cache_mla(kv_c, k_pe, expected, slots)
    assert bitwise_equal(kv_cache, expected)


def test_concat_and_cache_rejects_bad_slots():
    kv_cache = torch.zeros(2, 4, 12, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        concat_and_cache_mla(torch.ones(2, 8, device=DEVICE), torch.ones(2, 4, device=DEVICE),
                             kv_cache, torch.tensor([0, 8], device=DEVICE))
    with pytest.raises(ValueError, match="k_pe"):
        concat_and_cache_mla(torch.ones(2, 8, device=DEVICE), torch.ones(2, 5, device=DEVICE),
                             kv_cache, torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(TypeError, match="kv_c"):
        concat_and_cache_mla(torch.ones(2, 8, device=DEVICE, dtype=torch.float64),
                             torch.ones(2, 4, device=DEVICE), kv_cache,
                             torch.tensor([0, 1], device=DEVICE))
    assert torch.all(kv_cache == 0)


def test_concat_and_cache_unvalidated_never_writes_outside():
    """With ``validate=False`` (the CUDA-graph path) an out-of-range slot writes nothing."""
    kv_cache = torch.zeros(2, 4, 12, device=DEVICE)
    concat_and_cache_mla(torch.ones(3, 8, device=DEVICE), torch.ones(3, 4, device=DEVICE),
                         kv_cache, torch.tensor([8, -5, 3], device=DEVICE), validate=False)
    assert torch.all(kv_cache.view(8, 12)[3] == 1) and kv_cache.sum() == 12


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("with_starts", [False, True])
def test_gather_cache_matches_reference(dtype, with_starts):
    gen = torch.Generator().manual_seed(3)
    caps, bs, D = [37, 0, 1, 70, 16], 16, 40
    bt, nb = make_block_table(caps, bs, spare_blocks=2, seed=3)
    src = rand(nb, bs, D, gen=gen, dtype=dtype)
    starts = [5, 0, 0, 33, 15] if with_starts else [0] * len(caps)
    lens = [29, 0, 1, 37, 1]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_starts = torch.tensor(starts, dtype=torch.int32).to(DEVICE) if with_starts else None
    dst = poison_like(torch.empty(sum(lens) + 3, D, dtype=dtype, device=DEVICE))
    out = gather_cache(src, dst, bt.to(DEVICE), cu.to(DEVICE), len(caps), seq_starts)
    expected = ref_cache.gather_cache(src, poison_like(dst), bt.to(DEVICE), cu.to(DEVICE),
                                      len(caps), seq_starts)
    assert out.shape[0] == sum(lens)
    assert bitwise_equal(out, expected)
    assert torch.isnan(dst[sum(lens):]).all()  # rows past the total are left alone


def test_gather_cache_empty_and_bad_input():
    src = torch.randn(2, 4, 6, device=DEVICE)
    bt = torch.tensor([[0], [1]], dtype=torch.int32, device=DEVICE)
    dst = torch.empty(5, 6, device=DEVICE)
    cu = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    assert gather_cache(src, dst, bt, cu, 2).shape == (0, 6)
    with pytest.raises(ValueError, match="cu_seq_lens"):
        gather_cache(src, dst, bt, torch.tensor([0, 3, 1], dtype=torch.int32, device=DEVICE), 2)
    with pytest.raises(ValueError, match="request 1"):
        gather_cache(src, dst, bt, torch.tensor([0, 0, 5], dtype=torch.int32, device=DEVICE), 2)
    with pytest.raises(TypeError, match="dst"):
        gather_cache(src, dst.half(), bt, cu, 2)
    # a block-table entry outside the cache within a used range: rejected, as the reference
    cu2 = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    for entry in (-1, 2):
        bad_bt = torch.tensor([[0], [entry]], dtype=torch.int32, device=DEVICE)
        for gather in (gather_cache, ref_cache.gather_cache):
            with pytest.raises(ValueError, match=r"block_table\[1\] points outside"):
                gather(src, dst, bad_bt, cu2, 2)
    # outside the used range it is never read
    assert gather_cache(src, dst, torch.tensor([[0], [-1]], dtype=torch.int32, device=DEVICE),
                        torch.tensor([0, 2, 2], dtype=torch.int32, device=DEVICE),
                        2).shape == (2, 6)


# --------------------------------------------------------------------------- fp8_ds_mla

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T", [1, 23])
def test_fp8_concat_and_cache_byte_exact(T, dtype):
    gen = torch.Generator().manual_seed(T)
    nb, bs = 5, 7
    mags = torch.logspace(-7, 4, T, dtype=torch.float64)[:, None]
    kv_c = (torch.randn(T, 512, generator=gen, dtype=torch.float64) * mags)
    kv_c[0, :128] = 0.0  # an all-zero tile: the 2^-13 floor
    if T > 3:
        kv_c[1, 200] = 448 * 2.0 ** -3  # amax / 448 exactly a power of two
        kv_c[2, 300:310] = 1e-30  # far below e4m3's subnormals
    kv_c = kv_c.to(dtype).to(DEVICE)
    k_pe = rand(T, 1, 64, gen=gen, dtype=torch.bfloat16)
    cache = torch.randint(0, 256, (nb, bs, 656), generator=gen, dtype=torch.uint8).to(DEVICE)
    expected = cache.clone()
    slots = torch.randperm(nb * bs, generator=gen)[:T].to(torch.int32)
    slots[T // 2] = -1
    slots = slots.to(DEVICE)
    concat_and_cache_fp8_ds_mla(kv_c, k_pe, cache, slots)
    ref_fp8.concat_and_cache_fp8_ds_mla(kv_c, k_pe, expected, slots)
    assert bitwise_equal(cache, expected)


def test_fp8_concat_and_cache_bad_input():
    cache = torch.zeros(2, 2, 640, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="kv_cache"):
        concat_and_cache_fp8_ds_mla(torch.ones(1, 512, device=DEVICE),
                                    torch.ones(1, 64, device=DEVICE), cache,
                                    torch.zeros(1, dtype=torch.int32, device=DEVICE))


# ------------------------------------------------------------------------ index conversion

@settings(max_examples=30)
@given(T=st.integers(0, 6), topk=st.integers(1, 70), block_size=st.sampled_from([1, 4, 16, 64]),
       max_blocks=st.integers(1, 5), workspace=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_convert_req_index_matches_reference(T, topk, block_size, max_blocks, workspace, seed):
    gen = torch.Generator().manual_seed(seed)
    R = 3
    block_table = torch.randint(-1, 50, (R, max_blocks), generator=gen, dtype=torch.int32)
    req_id = torch.randint(0, R, (T,), generator=gen, dtype=torch.int32)
    hi = max_blocks * block_size + 5  # some indices past the table: -1
    token_indices = torch.randint(-2, hi, (T, topk), generator=gen, dtype=torch.int32)
    args = [req_id, block_table, token_indices, block_size]
    if workspace:
        P = 2
        args += [torch.randint(-1, P, (T,), generator=gen, dtype=torch.int32),
                 torch.randint(0, 100, (P,), generator=gen, dtype=torch.int32)]
    args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    out = convert_req_index_to_global_index(*args)
    expected = ref_sparse.convert_req_index_to_global_index(*args)
    assert out.dtype == torch.int32 and bitwise_equal(out, expected)


def test_convert_req_index_bad_input():
    bt = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    ti = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="req_id"):
        convert_req_index_to_global_index(torch.tensor([0, 2], dtype=torch.int32,
                                                       device=DEVICE), bt, ti, 16)
    with pytest.raises(TypeError, match="token_indices"):
        convert_req_index_to_global_index(torch.zeros(2, dtype=torch.int32, device=DEVICE), bt,
                                          ti.long(), 16)


# ---------------------------------------------------------------- attention with LSE

ATTN_CASES = [
    # (q lens, k lens, N, Nk, D, Dv, causal, positions)
    ([37], [37], 2, 2, 24, 20, True, False),   # square causal; 24 = 16 + 8 split
    ([20], [53], 3, 1, 24, 16, True, False),   # context before the queries; MQA
    ([53], [20], 2, 2, 32, 16, True, False),   # more queries than keys: the first see nothing
    ([29], [45], 2, 2, 16, 16, False, False),  # non-causal, D a power of two (no second part)
    ([19], [23], 2, 2, 24, 16, True, True),    # explicit positions
    ([1], [1], 2, 2, 24, 16, True, False),     # length 1
    ([5, 0, 17, 1, 33], [5, 4, 40, 0, 33], 2, 2, 24, 16, True, False),  # ragged, empties
    ([5, 0, 17, 1, 33], [9, 4, 0, 3, 21], 2, 2, 24, 16, False, False),
]


def test_attention_cases_cover_both_load_paths():
    """The cases above take the tensor-descriptor tiles (16-byte rows) and the pointer tiles
    (Dv = 20 in float16: 40-byte rows)."""
    from mla.fast.attention import _tma_ok

    x = torch.empty(3, 2, 24, dtype=torch.float16, device=DEVICE)
    v16 = torch.empty(3, 2, 16, dtype=torch.float16, device=DEVICE)
    v20 = torch.empty(3, 2, 20, dtype=torch.float16, device=DEVICE)
    assert _tma_ok(x[..., :16], x[..., 16:], v16)
    assert not _tma_ok(x[..., :16], x[..., 16:], v20)


# The routes the attention and prefill tests force. "default" is whatever the function picks:
# on the CPU that is the reference's own math, which would compare the reference with itself,
# so there test_cpu_route_is_the_reference checks the choice once instead.
ROUTES = ["triton"] + (["default"] if ON_GPU else [])


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", ATTN_CASES)
def test_flash_attention_matches_reference(case, dtype, poisoned_alloc):
    q_lens, k_lens, N, Nk, D, Dv, causal, positions = case
    gen = torch.Generator().manual_seed(sum(q_lens) + D)
    q = rand(sum(q_lens), N, D, gen=gen, dtype=dtype)
    k = rand(sum(k_lens), Nk, D, gen=gen, dtype=dtype, scale=2.0)
    v = rand(sum(k_lens), Nk, Dv, gen=gen, dtype=dtype)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    q_pos = k_pos = None
    if positions:
        q_pos = torch.randint(0, 30, (sum(q_lens),), generator=gen).to(DEVICE)
        k_pos = torch.randint(0, 30, (sum(k_lens),), generator=gen).to(DEVICE)
    da, db = _split_dim(D)
    scale = D ** -0.5
    o, lse = flash_attention_with_lse(
        q[..., :da], q[..., da:] if db else None, k[..., :da], k[..., da:] if db else None, v,
        cu_q.to(DEVICE), cu_k.to(DEVICE), max(q_lens), scale, causal, q_pos, k_pos)
    ref_o, ref_lse = [], []
    for b in range(len(q_lens)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o_b, lse_b = ref_attention.attention_with_lse(
            up(q[sq]), up(k[sk]), up(v[sk]), scale, causal,
            None if q_pos is None else q_pos[sq].cpu(), None if k_pos is None else k_pos[sk].cpu())
        ref_o.append(o_b)
        ref_lse.append(lse_b)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert_close(o, torch.cat(ref_o), out_tol("attention_with_lse", dtype), name="o")
    assert_close(lse, torch.cat(ref_lse, dim=1), name="lse",
                 abs_tol=lse_tol("attention_with_lse", dtype))


def test_flash_attention_nan_is_nan_out_not_a_marker(poisoned_alloc):
    """conventions §13, on both paths: a NaN in one query's q makes its o and lse NaN (not
    lse = -inf, the "no key" marker); a NaN in a key makes exactly the queries that see it NaN
    (causally: the later ones); a request without keys stays "no key"."""
    gen = torch.Generator().manual_seed(9)
    q_lens, k_lens = [12, 3], [20, 0]
    q = rand(15, 2, 24, gen=gen, dtype=torch.float32)
    k = rand(20, 2, 24, gen=gen, dtype=torch.float32)
    v = rand(20, 2, 16, gen=gen, dtype=torch.float32)
    q[3, 1, 5] = float("nan")
    q[13, 0, 0] = float("nan")  # request 1 has no keys
    k[15, 0, 2] = float("nan")  # seen by queries 7.. of request 0, head 0
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    o, lse = flash_attention_with_lse(q[..., :16], q[..., 16:], k[..., :16], k[..., 16:], v,
                                      cu_q.to(DEVICE), cu_k.to(DEVICE), 12, 0.3, True)
    parts = [ref_attention.attention_with_lse(up(q[:12]), up(k), up(v), 0.3, True),
             ref_attention.attention_with_lse(up(q[12:]), up(k[:0]), up(v[:0]), 0.3, True)]
    ref_o = torch.cat([p[0] for p in parts])
    ref_lse = torch.cat([p[1] for p in parts], dim=1)
    assert torch.isnan(ref_lse[1, 3]) and torch.isnan(ref_lse[0, 7:12]).all()
    assert not torch.isnan(ref_lse[0, :7]).any() and torch.isneginf(ref_lse[:, 12:]).all()
    assert_nan_rule(o, ref_o, 1e-5, name="o")
    assert_nan_rule(lse, ref_lse, name="lse", abs_tol=1e-5)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("Sq,Skv,causal", [(33, 33, True), (17, 40, False), (0, 5, True)])
def test_attention_with_lse_dispatch(Sq, Skv, causal, dtype, route, monkeypatch):
    """The public entry point forced onto the Triton route (the kernel, under the interpreter
    on the CPU) and, on a GPU, by the route it picks (cuDNN for bf16/fp16)."""
    if route != "default":
        monkeypatch.setattr(fast_attention, "pick_route", lambda *args: route)
    gen = torch.Generator().manual_seed(Sq)
    N, D, Dv = 4, 24, 16
    q = rand(Sq, N, D, gen=gen, dtype=dtype)
    k = rand(Skv, N, D, gen=gen, dtype=dtype)
    v = rand(Skv, N, Dv, gen=gen, dtype=dtype)
    o, lse = attention_with_lse(q, k, v, D ** -0.5, causal)
    ref_o, ref_lse = ref_attention.attention_with_lse(up(q), up(k), up(v), D ** -0.5, causal)
    assert_close(o, ref_o, out_tol("attention_with_lse", dtype), name="o")
    assert_close(lse, ref_lse, name="lse", abs_tol=lse_tol("attention_with_lse", dtype))


# ----------------------------------------------------------------------- prefill, chunked

@pytest.mark.skipif(ON_GPU, reason="the CPU's route")
def test_cpu_route_is_the_reference():
    """On the CPU ``attention_with_lse`` and ``prefill_attention`` pick the reference's math
    (the Triton kernel runs there only under the interpreter, forced in the tests above): their
    results are the reference's own, bit for bit (float32 here, float64 alike)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (rand(9, 2, 24, gen=gen, dtype=torch.float32) for _ in range(3))
    assert fast_attention.pick_route(q.device, q.dtype, 9, 9, 2, 2, 24, 24, True,
                                     False) == "reference"
    got = attention_with_lse(q, k, v, 0.3, True)
    ref = ref_attention.attention_with_lse(q, k, v, 0.3, True)
    assert all(bitwise_equal(a, b) for a, b in zip(got, ref))
    W_UK, W_UV = _mla(gen, torch.float32)
    args = (rand(9, 4, 16, gen=gen, dtype=torch.float32), rand(9, 4, 8, gen=gen,
                                                               dtype=torch.float32),
            rand(9, 32, gen=gen, dtype=torch.float32), rand(9, 8, gen=gen, dtype=torch.float32),
            W_UK, W_UV, 0.2, True)
    got = prefill_attention(*args)
    ref = ref_prefill.prefill_attention(*args)
    assert all(bitwise_equal(a, b) for a, b in zip(got, ref))


def _mla(gen: torch.Generator, dtype: torch.dtype, Lkv: int = 32, N: int = 4, P: int = 16,
         R: int = 8, V: int = 16):
    W_UK = rand(Lkv, N, P, gen=gen, dtype=dtype, scale=0.3)
    W_UV = rand(Lkv, N, V, gen=gen, dtype=dtype, scale=0.3)
    return W_UK, W_UV


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("Sq,Skv,positions", [(29, 29, False), (11, 30, False), (9, 9, True)])
def test_prefill_attention_matches_reference(Sq, Skv, positions, dtype, route, monkeypatch):
    """Forced onto the Triton route (up-projection + the kernel; under the interpreter on the
    CPU) and, on a GPU, by the route ``pick_route`` picks."""
    if route != "default":
        monkeypatch.setattr(fast_prefill, "pick_route", lambda *args: route)
    gen = torch.Generator().manual_seed(Skv)
    W_UK, W_UV = _mla(gen, dtype)
    Lkv, N, P = W_UK.shape
    q_nope, q_pe = rand(Sq, N, P, gen=gen, dtype=dtype), rand(Sq, N, 8, gen=gen, dtype=dtype)
    kv_c, k_pe = rand(Skv, Lkv, gen=gen, dtype=dtype), rand(Skv, 8, gen=gen, dtype=dtype)
    pos = {}
    if positions:
        pos = dict(q_positions=torch.arange(Skv - Sq, Skv, device=DEVICE) * 2,
                   k_positions=torch.arange(Skv, device=DEVICE) * 2)
    scale = (P + 8) ** -0.5
    o, lse = prefill_attention(q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, scale, True, **pos)
    ref_o, _ = ref_prefill.prefill_attention(
        up(q_nope), up(q_pe), up(kv_c), up(k_pe), up(W_UK), up(W_UV), scale, True,
        **{k: v.cpu() for k, v in pos.items()})
    assert_close(o, ref_o, out_tol("prefill_attention", dtype), name="o")
    # the up-projected keys are rounded to the input dtype (by the reference too, when it runs
    # in that dtype); lse is held to its budget against the reference at this dtype
    _, ref_lse = ref_prefill.prefill_attention(q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, scale,
                                               True, **pos)
    assert_close(lse, ref_lse, name="lse", abs_tol=lse_tol("prefill_attention", dtype))


# "default" (on a GPU) is whatever varlen_route picks; cuDNN attention takes bf16/fp16 only.
# On the CPU the route varlen_route picks is the reference's attention, named "reference"
# here: those cases still run fast code, the gathers and merges (Triton, under the
# interpreter) around it. Chunk size 1 (40 chunks) on that route only: the interpreter runs
# each launch in Python.
_PICKED = "default" if ON_GPU else "reference"
CHUNKED_CASES = [(route, dtype, mcc) for dtype in FLOATS
                 for route in [_PICKED, "triton"] + (["cudnn"] if ON_GPU else [])
                 for mcc in ([1, 64] if route == _PICKED else [7, 64])
                 if not (route == "cudnn" and dtype == torch.float32)]


@pytest.mark.parametrize("route,dtype,mcc", CHUNKED_CASES)
def test_chunked_prefill_matches_reference(mcc, dtype, route, monkeypatch):
    if route != "default":
        monkeypatch.setattr(fast_chunked, "varlen_route", lambda *args: route)
    gen = torch.Generator().manual_seed(mcc)
    W_UK, W_UV = _mla(gen, dtype)
    Lkv, N, P = W_UK.shape
    ctx, new, bs = [0, 13, 40, 1], [3, 5, 1, 1], 8
    bt, nb = make_block_table(ctx, bs, spare_blocks=1, seed=mcc)
    kv_cache = rand(nb, bs, Lkv + 8, gen=gen, dtype=dtype)
    T = sum(new)
    q_nope, q_pe = rand(T, N, P, gen=gen, dtype=dtype), rand(T, N, 8, gen=gen, dtype=dtype)
    kv_c, k_pe = rand(T, Lkv, gen=gen, dtype=dtype), rand(T, 8, gen=gen, dtype=dtype)
    qsl = _cu(new).to(DEVICE)
    plan = ref_chunked.plan_context_chunks(ctx, max_context_chunk=mcc)
    scale = (P + 8) ** -0.5
    o, lse = chunked_prefill_attention(q_nope, q_pe, kv_c, k_pe, qsl, kv_cache, bt.to(DEVICE),
                                       plan, W_UK, W_UV, scale)
    ref_o, _ = ref_chunked.chunked_prefill_attention(
        up(q_nope), up(q_pe), up(kv_c), up(k_pe), qsl.cpu(), up(kv_cache), bt, plan,
        up(W_UK), up(W_UV), scale)
    assert_close(o, ref_o, out_tol("chunked_prefill_attention", dtype), name="o")
    # lse against the reference at this dtype (its keys rounded as ours are: see prefill above)
    _, ref_lse = ref_chunked.chunked_prefill_attention(
        q_nope, q_pe, kv_c, k_pe, qsl, kv_cache, bt.to(DEVICE), plan, W_UK, W_UV, scale)
    assert_close(lse, ref_lse, name="lse", abs_tol=lse_tol("chunked_prefill_attention", dtype))


# ------------------------------------------------------------------- the GPU check's own code

def test_gpu_check_fails_a_missing_kernel(monkeypatch):
    """A registered kernel whose fast function is missing is a failure, not a skip."""
    from mla.check import runner as check

    monkeypatch.setitem(check.REGISTRY, "nowhere", ("no_such_function", lambda ctx: []))
    ctx = check.Ctx(device=torch.device(DEVICE), dtype=torch.float16, quick=True)
    (result,) = check.run_checks(ctx, ["nowhere"])
    assert not result.passed and "no_such_function" in result.error


# ------------------------------------------------------------------------------- set-up

def test_import_without_triton_says_what_to_install():
    """Without triton, ``import mla.fast`` raises an ImportError naming the extra to install
    (not a bare ModuleNotFoundError), while ``mla`` and ``mla.reference`` import as usual."""
    code = ("import sys\n"
            "sys.modules['triton'] = None  # as if not installed: 'import triton' fails\n"
            "import mla, mla.reference\n"
            "try:\n"
            "    import mla.fast\n"
            "except ImportError as e:\n"
            "    print(type(e).__name__ + ': ' + str(e))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ImportError: mla.fast needs Triton"), done.stdout
    # the project is not on PyPI: naming its extra outside a checkout would install another
    assert 'pip install "triton>=3.6,<3.8"' in done.stdout and "mla[" not in done.stdout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("qk,v", [(192, 128), (576, 512), (256, 256), (64, 64), (40, 32)])
def test_attention_tiles_fit_shared_memory(dtype, qk, v):
    """The GPU tiles for every width the package uses fit an SM90 block's 227 KB (the absorbed
    widths 576/512 overflowed the prefill tiles: 553 KB), and the prefill widths in 16 bits
    keep the largest tiles."""
    da, db = _split_dim(qk)
    block = fast_attention._block
    bqk, bv = block(da) + (block(db) if db else 0), block(v)
    config = fast_attention.pick_config(dtype, bqk, bv)
    elem = 4 if dtype == torch.float32 else 2
    assert fast_attention.tile_bytes(config, bqk, bv, elem) <= 227 * 1024 - 4096
    if (qk, v) == (192, 128) and dtype != torch.float32:
        assert config == fast_attention.AttnConfig()
    assert fast_attention.tile_bytes(fast_attention.AttnConfig(), 576, 512, 2) > 227 * 1024
