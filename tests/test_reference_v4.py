"""DeepSeek-V4's kernel conventions in the reference (conventions §14): attention sinks, the
MODEL1 fp8 cache read by the sparse decode, a second KV scope, ``d_qk = 512`` (the codec
itself: ``tests/test_fp8_model1.py``).

What must hold, in float64 against definitions written here:
- a sink is one more key per head, of logit ``sink[h]`` and value row zero (the softmax over
  ``[logits, sink]``), and the same through the reference itself with that key built into
  ``q`` and the cache; the lse and max_logits are the real keys' alone; ``+inf`` zeroes the
  output, ``-inf`` changes nothing, a keyless query keeps ``out = 0``, ``lse = +inf``, a NaN
  sink gives NaN (keyless queries too);
- two KV scopes equal one scope over their union;
- ``d_qk = 512`` rows with ``d_v = 512`` (V is the whole row) on the sparse prefill and decode,
  bf16 and MODEL1 caches, with ``topk_length``.
The sink and two-scope checks have broken twins that fail them.
"""

from __future__ import annotations

import pytest
import torch

from mla.compare import assert_close
from mla.reference import (
    dequantize_fp8_model1,
    fp8_model1_cache,
    make_block_table,
    mla_decode_paged,
    quantize_fp8_model1,
    sparse_mla_decode,
    sparse_mla_prefill,
)

F64 = torch.float64
I32 = torch.int32
INF = float("inf")
NAN = float("nan")


def _randn(*shape: int, seed: int, dtype: torch.dtype = F64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def _randint(lo: int, hi: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(I32)


def _definition(q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, scale: float,
                d_v: int, sink: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [s, h, d]`` over ``rows [s, k, d]`` where ``valid [s, k]``: (out, lse), float64.

    The sink is a key of logit ``sink[h]`` whose value row is zero (finite sinks only: the
    softmax of a row holding ``+inf`` is NaN). lse is the real keys' (``+inf`` for none).
    """
    s_q, h = q.shape[:2]
    rows = torch.where(valid[..., None], rows.double(), 0.0)
    logits = torch.einsum("shd,skd->shk", q.double(), rows) * scale
    logits = logits.masked_fill(~valid[:, None, :], -INF)
    values = rows[..., :d_v]
    lse = torch.logsumexp(logits, dim=-1) if logits.shape[-1] else logits.new_full((s_q, h), -INF)
    if sink is not None:
        logits = torch.cat([logits, sink.double().expand(s_q, h)[..., None]], dim=-1)
        values = torch.cat([values, values.new_zeros(s_q, 1, d_v)], dim=1)
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row of -inf only: no key, out 0
    out = torch.einsum("shk,skv->shv", p, values)
    return out, torch.where(torch.isneginf(lse), INF, lse)


# --------------------------------------------------------------------------------------------
# attention sinks: sparse prefill
# --------------------------------------------------------------------------------------------

S_Q, H, D, S_KV, TOPK, D_V = 6, 4, 24, 11, 7, 16
SINK = torch.tensor([-1.5, 0.3, 2.0, 6.0], dtype=torch.float32)  # the last outweighs the keys


def _prefill_case(seed: int = 1):
    q = _randn(S_Q, H, D, seed=seed) * 0.7
    kv = _randn(S_KV, D, seed=seed + 1)
    idx = _randint(-2, S_KV + 3, (S_Q, TOPK), seed=seed + 2)  # some -1, -2 and >= s_kv
    idx[2] = -1  # a lonely query
    topk_length = torch.tensor([7, 5, 7, 0, 3, 6], dtype=I32)  # query 3: lonely by length
    return q, kv, idx, topk_length


def _prefill_valid(idx: torch.Tensor, topk_length: torch.Tensor) -> torch.Tensor:
    cols = torch.arange(idx.shape[1])
    return (idx >= 0) & (idx < S_KV) & (cols[None, :] < topk_length[:, None])


def _prefill_sink_errors(fn) -> list[str]:
    """Which parts of the sink's definition ``fn`` (sparse_mla_prefill's signature) breaks."""
    q, kv, idx, topk_length = _prefill_case()
    out, max_logits, lse = fn(q, kv, idx, 0.4, D_V, topk_length, attn_sink=SINK)
    plain_out, plain_max, plain_lse = sparse_mla_prefill(q, kv, idx, 0.4, D_V, topk_length)
    ref_out, ref_lse = _definition(q, kv[idx.clamp(0, S_KV - 1).long()],
                                   _prefill_valid(idx, topk_length), 0.4, D_V, SINK)
    errors = []
    try:
        assert_close(out, ref_out, 1e-13, name="out")
    except AssertionError as e:
        errors.append(str(e))
    if not (torch.equal(lse, plain_lse) and torch.equal(max_logits, plain_max)):
        errors.append("lse or max_logits changed by the sink")
    if not torch.allclose(lse, ref_lse, rtol=1e-13, atol=0):
        errors.append("lse is not the real keys' log-sum-exp")
    if not torch.equal(out[2:4], torch.zeros_like(out[2:4])):
        errors.append("a lonely query's out is not 0")
    if torch.equal(out, plain_out):
        errors.append("the sink did nothing")
    return errors


def test_prefill_sink_is_a_key_of_logit_sink_with_a_zero_value() -> None:
    assert _prefill_sink_errors(sparse_mla_prefill) == []


def _swapped_sink(q, kv, idx, scale, d_v, topk_length, *, attn_sink):
    out, m, lse = sparse_mla_prefill(q, kv, idx, scale, d_v, topk_length)
    factor = torch.sigmoid(attn_sink.double() - lse).nan_to_num(1.0)  # σ(sink − lse): wrong
    return out * factor[..., None], m, lse


def _sink_in_lse(q, kv, idx, scale, d_v, topk_length, *, attn_sink):
    out, m, lse = sparse_mla_prefill(q, kv, idx, scale, d_v, topk_length, attn_sink=attn_sink)
    return out, m, torch.logaddexp(lse, attn_sink.double())  # the sink folded into the lse


def _sink_ignored(q, kv, idx, scale, d_v, topk_length, *, attn_sink):
    return sparse_mla_prefill(q, kv, idx, scale, d_v, topk_length)


@pytest.mark.parametrize("twin", [_swapped_sink, _sink_in_lse, _sink_ignored])
def test_prefill_sink_twins_fail(twin) -> None:
    assert _prefill_sink_errors(twin) != []


def test_prefill_sink_through_an_extra_key() -> None:
    """The reference without a sink, on a key built to have logit ``sink[h]`` and value 0."""
    q, kv, idx, topk_length = _prefill_case(seed=5)
    scale = 0.4
    # one more dim: q carries sink[h] / scale there, the sink row a 1, the real rows a 0
    q_ext = torch.cat([q, (SINK.double() / scale).expand(S_Q, H)[..., None]], dim=-1)
    kv_ext = torch.cat([kv, torch.zeros(S_KV, 1, dtype=F64)], dim=-1)
    kv_ext = torch.cat([kv_ext, torch.zeros(1, D + 1, dtype=F64)])
    kv_ext[S_KV, D] = 1.0
    # the sink key first, so that topk_length + 1 keeps it; an index s_kv was invalid before
    # and now names the sink row: it must stay invalid
    idx_ext = torch.cat([torch.full((S_Q, 1), S_KV, dtype=I32),
                         torch.where(idx == S_KV, -1, idx)], dim=1)
    out_ext, _, lse_ext = sparse_mla_prefill(q_ext, kv_ext, idx_ext, scale, D_V, topk_length + 1)
    out, _, lse = sparse_mla_prefill(q, kv, idx, scale, D_V, topk_length, attn_sink=SINK)
    assert_close(out, out_ext, 1e-13, name="out")
    finite = torch.isfinite(lse)
    assert torch.allclose(torch.logaddexp(lse[finite], SINK.double().expand(S_Q, H)[finite]),
                          lse_ext[finite], rtol=1e-13, atol=0)


def test_prefill_sink_corners() -> None:
    q, kv, idx, topk_length = _prefill_case(seed=7)
    plain_out, _, plain_lse = sparse_mla_prefill(q, kv, idx, 0.4, D_V, topk_length)
    sink = torch.tensor([INF, -INF, NAN, 0.0], dtype=torch.float32)
    out, _, lse = sparse_mla_prefill(q, kv, idx, 0.4, D_V, topk_length, attn_sink=sink)
    assert torch.equal(lse, plain_lse)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))  # +inf: the output vanishes
    assert torch.equal(out[:, 1], plain_out[:, 1])  # -inf: nothing changes, bit for bit
    assert torch.isnan(out[:, 2]).all()  # NaN: NaN, the lonely queries 2 and 3 included
    lonely = out[2:4, [0, 1, 3]]
    assert torch.equal(lonely, torch.zeros_like(lonely))
    assert torch.isposinf(lse[2:4]).all()


def test_prefill_sink_empty_kv_and_low_precision() -> None:
    q, kv, idx, topk_length = _prefill_case(seed=9)
    out, _, lse = sparse_mla_prefill(q, kv[:0], idx, 0.4, D_V, attn_sink=SINK)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()
    ref_out, _, ref_lse = sparse_mla_prefill(q, kv, idx, 0.4, D_V, topk_length, attn_sink=SINK)
    for dtype in (torch.float32, torch.bfloat16):
        o, _, lse = sparse_mla_prefill(q.to(dtype), kv.to(dtype), idx, 0.4, D_V, topk_length,
                                       attn_sink=SINK)
        assert o.dtype == dtype and lse.dtype == torch.float32
        assert_close(o, ref_out, name=f"out {dtype}")


# --------------------------------------------------------------------------------------------
# attention sinks: sparse decode and dense paged decode
# --------------------------------------------------------------------------------------------

def _paged(lens: list[int], bs: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 paged cache (unwritten rows NaN) holding ``lens[r]`` random rows each."""
    block_table, nb = make_block_table(lens, bs, spare_blocks=1, seed=seed)
    cache = torch.full((nb, bs, d), NAN, dtype=F64)
    flat = cache.view(-1, d)
    for r, n in enumerate(lens):
        pos = torch.arange(n)
        flat[block_table[r].long()[pos // bs] * bs + pos % bs] = _randn(n, d, seed=seed + r)
    return cache, block_table


def _all_slots(block_table: torch.Tensor, lens: list[int], bs: int, topk: int) -> torch.Tensor:
    """``[B, 1, topk]`` global slots of every row of each request, ``-1`` after its length."""
    out = torch.full((len(lens), 1, topk), -1, dtype=I32)
    for r, n in enumerate(lens):
        pos = torch.arange(n)
        out[r, 0, :n] = (block_table[r].long()[pos // bs] * bs + pos % bs).to(I32)
    return out


def test_decode_sinks_sparse_and_dense_against_the_definition() -> None:
    lens, bs, N, d, dv = [9, 0, 4], 4, 4, 20, 12  # request 1 has no key
    cache, block_table = _paged(lens, bs, d, seed=11)
    q = _randn(3, 1, N, d, seed=12)
    slots = _all_slots(block_table, lens, bs, topk=10)
    sparse_out, sparse_lse = sparse_mla_decode(q, cache, slots, 0.3, False, head_dim_v=dv,
                                               attn_sink=SINK)
    dense_out, dense_lse = mla_decode_paged(q, cache, block_table, torch.tensor(lens, dtype=I32),
                                            0.3, head_dim_v=dv, attn_sink=SINK)
    flat = cache.view(-1, d)
    for b in range(3):
        valid = slots[b] >= 0
        ref_out, ref_lse = _definition(q[b], flat[slots[b].clamp_min(0).long()], valid, 0.3, dv,
                                       SINK)
        for name, out, lse in (("sparse", sparse_out, sparse_lse),
                               ("dense", dense_out, dense_lse)):
            assert_close(out[b], ref_out, 1e-13, name=f"{name} out[{b}]")
            assert torch.allclose(lse[b].T, ref_lse, rtol=1e-13, atol=0), name
    assert torch.equal(dense_out[1], torch.zeros_like(dense_out[1]))
    assert torch.isposinf(dense_lse[1]).all() and torch.isposinf(sparse_lse[1]).all()
    # corners, both paths: +inf zeroes, -inf is a no-op, NaN is NaN (the keyless request too)
    sink = torch.tensor([INF, -INF, NAN, 0.0], dtype=torch.float32)
    seqlens = torch.tensor(lens, dtype=I32)
    for run in (lambda **kw: sparse_mla_decode(q, cache, slots, 0.3, False, head_dim_v=dv, **kw),
                lambda **kw: mla_decode_paged(q, cache, block_table, seqlens, 0.3, head_dim_v=dv,
                                              **kw)):
        (out, lse), (plain_out, plain_lse) = run(attn_sink=sink), run()
        assert torch.equal(lse, plain_lse)
        assert torch.equal(out[..., 0, :], torch.zeros_like(out[..., 0, :]))
        assert torch.equal(out[..., 1, :], plain_out[..., 1, :])
        assert torch.isnan(out[..., 2, :]).all()


def test_dense_decode_sink_low_precision_rounds_once() -> None:
    lens, bs, N, d, dv = [7, 3], 2, 4, 16, 8
    cache, block_table = _paged(lens, bs, d, seed=13)
    q = _randn(2, 2, N, d, seed=14)
    seqlens = torch.tensor(lens, dtype=I32)
    ref_out, ref_lse = mla_decode_paged(q, cache, block_table, seqlens, 0.3, causal=True,
                                        head_dim_v=dv, attn_sink=SINK)
    for dtype in (torch.float32, torch.bfloat16):
        out, lse = mla_decode_paged(q.to(dtype), cache.to(dtype), block_table, seqlens, 0.3,
                                    causal=True, head_dim_v=dv, attn_sink=SINK)
        assert out.dtype == dtype
        assert_close(out, ref_out, name=f"out {dtype}")
        assert_close(lse, ref_lse, abs_tol=1e-2, name=f"lse {dtype}")


def test_sink_bad_input() -> None:
    q, kv, idx, _ = _prefill_case()
    with pytest.raises(TypeError, match="attn_sink"):
        sparse_mla_prefill(q, kv, idx, 0.4, D_V, attn_sink=SINK.double())
    with pytest.raises(ValueError, match="attn_sink"):
        sparse_mla_prefill(q, kv, idx, 0.4, D_V, attn_sink=SINK[:3])
    cache, block_table = _paged([3], 2, D, seed=1)
    qd = _randn(1, 1, H, D, seed=2)
    with pytest.raises(ValueError, match="attn_sink"):
        sparse_mla_decode(qd, cache, _all_slots(block_table, [3], 2, 4), 0.3, False,
                          head_dim_v=D_V, attn_sink=SINK[None])
    with pytest.raises(TypeError, match="attn_sink"):
        mla_decode_paged(qd, cache, block_table, torch.tensor([3], dtype=I32), 0.3,
                         head_dim_v=D_V, attn_sink=SINK.half())


# --------------------------------------------------------------------------------------------
# a second KV scope, d_qk = 512
# --------------------------------------------------------------------------------------------

def _scope(lens: list[int], bs: int, d: int, topk: int, seed: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 paged cache and ``[B, 2, topk]`` global slots: a random selection of each
    request's rows, ``-1`` padded."""
    cache, block_table = _paged(lens, bs, d, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    slots = torch.full((len(lens), 2, topk), -1, dtype=I32)
    for b, n in enumerate(lens):
        for j in range(2):
            k = min(topk, n)
            pos = torch.randperm(n, generator=gen)[:k]
            slots[b, j, :k] = (block_table[b].long()[pos // bs] * bs + pos % bs).to(I32)
            slots[b, j] = slots[b, j][torch.randperm(topk, generator=gen)]
    return cache, slots


def _union(cache_a: torch.Tensor, slots_a: torch.Tensor, length_a: torch.Tensor | None,
           cache_b: torch.Tensor, slots_b: torch.Tensor, length_b: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One cache (block size 1: a's rows, then b's) and one index row per query naming both
    scopes' entries, the columns past each ``topk_length`` turned to -1."""
    def cut(slots: torch.Tensor, length: torch.Tensor | None) -> torch.Tensor:
        if length is None:
            return slots
        cols = torch.arange(slots.shape[2])
        return torch.where(cols[None, None, :] < length[:, None, None], slots, -1)
    n_a = cache_a.shape[0] * cache_a.shape[1]
    d = cache_a.shape[-1]
    cache = torch.cat([cache_a.reshape(-1, d), cache_b.reshape(-1, d)])[:, None, :]
    b_cut = cut(slots_b, length_b)
    return cache, torch.cat([cut(slots_a, length_a), torch.where(b_cut >= 0, b_cut + n_a, -1)],
                            dim=2)


def _two_scope_errors(run) -> list[str]:
    """``run(q, ..., extra_*)`` against the one-scope decode over the union, float64."""
    lens_a, lens_b, N, d, dv = [9, 3, 6], [5, 7, 0], 4, 20, 12
    cache_a, slots_a = _scope(lens_a, 4, d, topk=6, seed=70)
    cache_b, slots_b = _scope(lens_b, 3, d, topk=5, seed=80)  # its own page size
    slots_a[1, 0] = -1
    slots_b[1, 0] = -1  # query (1, 0): lonely in both scopes
    length_a = torch.tensor([6, 2, 0], dtype=I32)
    length_b = torch.tensor([4, 5, 5], dtype=I32)
    q = _randn(3, 2, N, d, seed=90)
    out, lse = run(q, cache_a, slots_a, 0.3, False, length_a, dv, attn_sink=SINK,
                   extra_k_cache=cache_b, extra_indices_in_kvcache=slots_b,
                   extra_topk_length=length_b)
    union, slots = _union(cache_a, slots_a, length_a, cache_b, slots_b, length_b)
    ref_out, ref_lse = sparse_mla_decode(q, union, slots, 0.3, False, None, dv, attn_sink=SINK)
    errors = []
    for name, got, want in (("out", out, ref_out), ("lse", lse, ref_lse)):
        try:
            assert_close(got, want, 1e-13, name=name)
        except AssertionError as e:
            errors.append(str(e))
    lonely = torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))
    if not (lonely and torch.isposinf(lse[1, :, 0]).all()):
        errors.append("the query lonely in both scopes is not out 0, lse +inf")
    return errors


def test_two_scopes_equal_one_scope_over_their_union() -> None:
    assert _two_scope_errors(sparse_mla_decode) == []


def _extra_length_ignored(*args, **kw):
    return sparse_mla_decode(*args, **{**kw, "extra_topk_length": None})


def _scopes_apart(q, cache, slots, scale, fp8, length, dv, *, attn_sink, extra_k_cache,
                  extra_indices_in_kvcache, extra_topk_length):
    """Twin: each scope its own softmax, the outputs averaged (lse of the first)."""
    a = sparse_mla_decode(q, cache, slots, scale, fp8, length, dv, attn_sink=attn_sink)
    b = sparse_mla_decode(q, extra_k_cache, extra_indices_in_kvcache, scale, fp8,
                          extra_topk_length, dv, attn_sink=attn_sink)
    return (a[0] + b[0]) / 2, a[1]


@pytest.mark.parametrize("twin", [_extra_length_ignored, _scopes_apart])
def test_two_scope_twins_fail(twin) -> None:
    assert _two_scope_errors(twin) != []


def test_an_all_empty_second_scope_changes_nothing() -> None:
    cache, slots = _scope([5, 4], 2, 16, topk=4, seed=100)
    extra = torch.full((3, 3, 16), NAN, dtype=F64)  # never read
    q = _randn(2, 2, H, 16, seed=101)
    plain = sparse_mla_decode(q, cache, slots, 0.3, False, head_dim_v=8)
    for extra_slots, extra_len in ((torch.full((2, 2, 3), -1, dtype=I32), None),
                                   (torch.zeros(2, 2, 3, dtype=I32), torch.zeros(2, dtype=I32))):
        out, lse = sparse_mla_decode(q, cache, slots, 0.3, False, head_dim_v=8,
                                     extra_k_cache=extra, extra_indices_in_kvcache=extra_slots,
                                     extra_topk_length=extra_len)
        # the same sums with masked terms added: equal up to the order of summation
        assert_close(out, plain[0], 1e-15, name="out")
        assert_close(lse, plain[1], 1e-15, name="lse")


def _masked_dense_512(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor,
                      length: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention over all of ``kv`` with ``-inf`` off each query's selected set, V the
    whole 512-wide row (DeepSeek-V4's d_qk = d_v = 512)."""
    s_kv = kv.shape[0]
    cols = torch.arange(idx.shape[1])
    keep = (idx >= 0) & (idx < s_kv) & (cols[None, :] < length[:, None])
    selected = torch.zeros(idx.shape[0], s_kv + 1, dtype=torch.bool)
    selected.scatter_(1, torch.where(keep, idx.long(), s_kv), True)
    rows = kv[None].expand(idx.shape[0], s_kv, 512)
    return _definition(q, rows, selected[:, :s_kv], scale, 512)


def test_d_qk_512_sparse_prefill_with_topk_length() -> None:
    s_q, h, s_kv, topk = 5, 3, 12, 6
    q = _randn(s_q, h, 512, seed=110) * 0.1
    kv = _randn(s_kv, 512, seed=111)
    idx = torch.stack([torch.randperm(s_kv, generator=torch.Generator().manual_seed(112 + i))[
        :topk] for i in range(s_q)]).to(I32)
    length = torch.tensor([6, 1, 0, 4, 6], dtype=I32)
    out, _, lse = sparse_mla_prefill(q, kv[:, None], idx[:, None], 512 ** -0.5, 512, length)
    ref_out, ref_lse = _masked_dense_512(q, kv, idx, length, 512 ** -0.5)
    assert out.shape == (s_q, h, 512)
    assert_close(out, ref_out, 1e-13, name="out")
    assert torch.allclose(lse, ref_lse, rtol=1e-13, atol=0)


def test_d_qk_512_sparse_decode_model1_and_bf16_caches() -> None:
    """Two MODEL1 scopes (page sizes 4 and 3) read as their dequantized rows, and the bf16
    caches of the same rows, with topk_length on both scopes and a sink."""
    lens_a, lens_b = [9, 5], [4, 7]
    cache_a, slots_a = _scope(lens_a, 4, 512, topk=6, seed=120)
    cache_b, slots_b = _scope(lens_b, 3, 512, topk=5, seed=130)
    pages_a = quantize_fp8_model1(cache_a.nan_to_num(0.0))
    pages_b = quantize_fp8_model1(cache_b.nan_to_num(0.0))
    fp8_a, fp8_b = fp8_model1_cache(pages_a, 4), fp8_model1_cache(pages_b, 3)
    deq_a, deq_b = dequantize_fp8_model1(pages_a, 4), dequantize_fp8_model1(pages_b, 3)
    length_a, length_b = torch.tensor([5, 6], dtype=I32), torch.tensor([2, 5], dtype=I32)
    q = _randn(2, 2, H, 512, seed=140) * 0.1
    kw = dict(attn_sink=SINK, extra_topk_length=length_b)
    out, lse = sparse_mla_decode(q, fp8_a, slots_a, 512 ** -0.5, True, length_a, 512,
                                 extra_k_cache=fp8_b, extra_indices_in_kvcache=slots_b, **kw)
    assert out.shape == (2, 2, H, 512) and lse.shape == (2, H, 2)
    ref_out, ref_lse = sparse_mla_decode(q, deq_a.double(), slots_a, 512 ** -0.5, False,
                                         length_a, 512, extra_k_cache=deq_b.double(),
                                         extra_indices_in_kvcache=slots_b, **kw)
    assert_close(out, ref_out, 1e-13, name="out")
    assert_close(lse, ref_lse, 1e-13, name="lse")
    # bf16 queries on the bf16 caches of the same rows (as served without fp8)
    out_bf16, lse_bf16 = sparse_mla_decode(q.bfloat16(), deq_a, slots_a, 512 ** -0.5, False,
                                           length_a, 512, extra_k_cache=deq_b,
                                           extra_indices_in_kvcache=slots_b, **kw)
    assert_close(out_bf16, ref_out, name="out bf16")
    assert_close(lse_bf16, ref_lse, abs_tol=1e-2, name="lse bf16")


def test_second_scope_and_model1_bad_input() -> None:
    cache, slots = _scope([5, 4], 2, 16, topk=4, seed=150)
    q = _randn(2, 2, H, 16, seed=151)

    def run(**kw):
        return sparse_mla_decode(q, cache, slots, 0.3, False, head_dim_v=8, **kw)

    with pytest.raises(ValueError, match="extra_k_cache and extra_indices_in_kvcache"):
        run(extra_k_cache=cache)
    with pytest.raises(ValueError, match="extra_topk_length"):
        run(extra_topk_length=torch.zeros(2, dtype=I32))
    with pytest.raises(ValueError, match="extra_indices_in_kvcache"):
        run(extra_k_cache=cache, extra_indices_in_kvcache=slots[:1])
    with pytest.raises(ValueError, match="extra_indices_in_kvcache"):
        run(extra_k_cache=cache[:1], extra_indices_in_kvcache=slots)  # names slots >= 4
    with pytest.raises(ValueError, match="extra_topk_length"):
        run(extra_k_cache=cache, extra_indices_in_kvcache=slots,
            extra_topk_length=torch.full((2,), 5, dtype=I32))
    with pytest.raises(ValueError, match="extra_k_cache"):
        run(extra_k_cache=cache[..., :12], extra_indices_in_kvcache=slots)
    with pytest.raises(TypeError, match="extra_k_cache"):
        run(extra_k_cache=cache.float(), extra_indices_in_kvcache=slots)
    # MODEL1 caches need d_qk = 512 and head_dim_v = 512; fp8 scopes share a format
    pages = quantize_fp8_model1(torch.zeros(2, 4, 512))
    model1 = fp8_model1_cache(pages, 4)
    q576 = _randn(1, 1, H, 576, seed=152)
    idx = torch.zeros(1, 1, 2, dtype=I32)
    with pytest.raises(ValueError, match="MODEL1"):
        sparse_mla_decode(q576, model1, idx, 0.1, True)
    q512 = _randn(1, 1, H, 512, seed=153)
    with pytest.raises(ValueError, match="head_dim_v"):
        sparse_mla_decode(q512, model1, idx, 0.1, True, head_dim_v=448)
    with pytest.raises(ValueError, match="fp8_ds_mla"):
        sparse_mla_decode(q512, torch.zeros(2, 4, 656, dtype=torch.uint8), idx, 0.1, True)
    with pytest.raises(ValueError, match="extra_k_cache"):
        sparse_mla_decode(q512, model1, idx, 0.1, True,
                          extra_k_cache=torch.zeros(2, 4, 656, dtype=torch.uint8),
                          extra_indices_in_kvcache=idx)
    with pytest.raises(ValueError, match="kv_cache"):  # a per-token tensor is no page view
        sparse_mla_decode(q512, model1.transpose(0, 1), idx, 0.1, True)


def test_nan_in_a_selected_row_of_the_second_scope_reaches_that_query_only() -> None:
    """conventions §13, in a bf16-style plain cache and in a MODEL1 cache (the NaN tile's scale
    byte becomes 0xFF); the unselected rows of both caches are NaN already (never read)."""
    cache_a, slots_a = _scope([6, 5], 2, 512, topk=3, seed=160)
    cache_b, slots_b = _scope([4, 4], 3, 512, topk=2, seed=170)
    q = _randn(2, 2, H, 512, seed=180) * 0.1
    others = set(slots_b.view(4, -1)[:3].flatten().tolist())
    slot = next(s for s in slots_b[1, 1].tolist() if s >= 0 and s not in others)
    poisoned = cache_b.clone()
    poisoned.view(-1, 512)[slot, 5] = NAN  # named by query (1, 1) alone
    keep = torch.ones(2, 2, dtype=torch.bool)
    keep[1, 1] = False
    cases = {
        "plain": (cache_a, cache_b, poisoned, False),
        "MODEL1": (fp8_model1_cache(quantize_fp8_model1(cache_a), 2),
                   fp8_model1_cache(quantize_fp8_model1(cache_b), 3),
                   fp8_model1_cache(quantize_fp8_model1(poisoned), 3), True),
    }
    for name, (first, clean, dirty, fp8) in cases.items():
        out, lse = sparse_mla_decode(q, first, slots_a, 0.1, fp8, None, 512, attn_sink=SINK,
                                     extra_k_cache=dirty, extra_indices_in_kvcache=slots_b)
        plain_out, plain_lse = sparse_mla_decode(q, first, slots_a, 0.1, fp8, None, 512,
                                                 attn_sink=SINK, extra_k_cache=clean,
                                                 extra_indices_in_kvcache=slots_b)
        assert torch.isnan(out[1, 1]).all() and torch.isnan(lse[1, :, 1]).all(), name
        assert torch.equal(out[keep], plain_out[keep]), name
        assert torch.equal(lse.transpose(1, 2)[keep], plain_lse.transpose(1, 2)[keep]), name
