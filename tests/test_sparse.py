"""Sparse top-k MLA (conventions §10): index conversion, sparse prefill/decode, model level.

What must hold:
- the index conversion is vLLM's kernel's map (hypothesis, against a plain loop);
- with every visible key selected, sparse prefill and decode are the dense paths
  (``absorbed_attention``, ``mla_decode_paged``, ``naive_forward``), float64 to 1e-10;
- with a real top-k they are the masked dense formulation (dense scores, ``-inf`` off the
  selected set), float64 to 1e-10, kernel level and model level (hidden states in and out);
- FlashMLA's conventions: lonely queries (``out = 0``, ``lse = +inf``, ``max_logits = -inf``),
  ``topk_length``, invalid indices, the fp8_ds_mla cache read as FlashMLA dequantizes it.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla import MLAWeights, get_config
from mla.compare import assert_close, rel_err
from mla.reference import (
    IndexerWeights,
    absorb_q,
    absorbed_attention,
    cache_rows,
    concat_and_cache_fp8_ds_mla,
    convert_req_index_to_global_index,
    dequantize_fp8_ds_mla,
    gather_cache,
    make_block_table,
    mla_decode_paged,
    naive_forward,
    sparse_decode_forward,
    sparse_index_mask,
    sparse_masked_dense_forward,
    sparse_mla_decode,
    sparse_mla_prefill,
    sparse_prefill_forward,
)

TINY = get_config("tiny")  # Lkv 32, R 8: rows of 40, V = the first 32 columns
F64 = torch.float64
I32 = torch.int32


def _randn(*shape: int, seed: int, dtype: torch.dtype = F64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


# --------------------------------------------------------------------------------------------
# index conversion
# --------------------------------------------------------------------------------------------

def _convert_loop(req_id: list[int], block_table: list[list[int]], token_indices: list[list[int]],
                  bs: int, ws_ids: list[int] | None = None,
                  ws_starts: list[int] | None = None) -> list[list[int]]:
    """vLLM's kernel semantics, one index at a time."""
    max_blocks = len(block_table[0])
    out = []
    for t, row in enumerate(token_indices):
        res = []
        for i in row:
            block = i // bs
            if i < 0 or not 0 <= block < max_blocks:
                res.append(-1)
            elif ws_ids is not None and ws_ids[t] >= 0:
                res.append(ws_starts[ws_ids[t]] + i)
            else:
                res.append(block_table[req_id[t]][block] * bs + i % bs)
        out.append(res)
    return out


@given(st.data())
def test_conversion_matches_the_seed_semantics(data: st.DataObject) -> None:
    bs = data.draw(st.integers(1, 8), label="block_size")
    R = data.draw(st.integers(1, 3), label="requests")
    M = data.draw(st.integers(1, 4), label="max_blocks")
    T = data.draw(st.integers(0, 6), label="tokens")
    topk = data.draw(st.integers(1, 9), label="topk")
    table = data.draw(st.lists(st.lists(st.integers(0, 40), min_size=M, max_size=M),
                               min_size=R, max_size=R), label="block_table")
    req = data.draw(st.lists(st.integers(0, R - 1), min_size=T, max_size=T), label="req_id")
    index = st.one_of(st.just(-1), st.integers(-5, -1), st.integers(0, M * bs + 5),
                      st.integers(0, M * bs - 1))
    tok = data.draw(st.lists(st.lists(index, min_size=topk, max_size=topk), min_size=T,
                             max_size=T), label="token_indices")
    t_req = torch.tensor(req, dtype=I32)
    t_table = torch.tensor(table, dtype=I32)
    t_tok = torch.tensor(tok, dtype=I32).view(T, topk)
    got = convert_req_index_to_global_index(t_req, t_table, t_tok, bs)
    assert got.dtype == I32 and list(got.shape) == [T, topk]
    assert got.tolist() == _convert_loop(req, table, tok, bs) if T else got.numel() == 0

    # the workspace variant: prefill tokens read rows of a per-request workspace
    P = data.draw(st.integers(1, 3), label="prefills")
    ws_ids = data.draw(st.lists(st.integers(-1, P - 1), min_size=T, max_size=T))
    ws_starts = data.draw(st.lists(st.integers(0, 100), min_size=P, max_size=P))
    got = convert_req_index_to_global_index(
        t_req, t_table, t_tok, bs, prefill_workspace_request_ids=torch.tensor(ws_ids, dtype=I32),
        prefill_workspace_starts=torch.tensor(ws_starts, dtype=I32))
    if T:
        assert got.tolist() == _convert_loop(req, table, tok, bs, ws_ids, ws_starts)


@given(bs=st.integers(1, 7), length=st.integers(1, 30), seed=st.integers(0, 2 ** 16))
def test_conversion_inverts_the_block_table(bs: int, length: int, seed: int) -> None:
    """Valid positions of a request land in the slot its block table says; the rest are -1."""
    block_table, _ = make_block_table([length, 3], bs, spare_blocks=1, seed=seed)
    M = block_table.shape[1]
    pos = torch.arange(-2, M * bs + 3, dtype=I32)
    got = convert_req_index_to_global_index(torch.zeros(1, dtype=I32), block_table, pos[None],
                                            bs)[0]
    inside = (pos >= 0) & (pos < M * bs)
    assert torch.all(got[~inside] == -1)
    p = pos[inside].long()
    slots = got[inside].long()
    assert torch.equal(slots // bs, block_table[0].long()[p // bs])
    assert torch.equal(slots % bs, p % bs)


# --------------------------------------------------------------------------------------------
# kernel level: sparse prefill
# --------------------------------------------------------------------------------------------

def _masked_dense(q: torch.Tensor, kv: torch.Tensor, selected: torch.Tensor, scale: float,
                  d_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The official formulation: dense scores over all keys plus ``-inf`` off ``selected``."""
    s = torch.einsum("qhd,kd->qhk", q.to(F64), kv.to(F64).nan_to_num(0.0)) * scale
    s = s + torch.where(selected, 0.0, float("-inf"))[:, None, :].to(F64)
    lse = torch.logsumexp(s, dim=-1)
    lonely = torch.isneginf(lse)
    p = torch.exp(s - torch.where(lonely, 0.0, lse)[..., None])
    out = torch.einsum("qhk,kv->qhv", p, kv.to(F64).nan_to_num(0.0)[:, :d_v])
    return out, s.amax(dim=-1), torch.where(lonely, float("inf"), lse)


def _selection_loop(indices: torch.Tensor, s_kv: int,
                    topk_length: torch.Tensor | None = None) -> torch.Tensor:
    sel = torch.zeros(indices.shape[0], s_kv, dtype=torch.bool)
    for t, row in enumerate(indices.tolist()):
        n = len(row) if topk_length is None else int(topk_length[t])
        for i in row[:n]:
            if 0 <= i < s_kv:
                sel[t, i] = True
    return sel


def _causal_indices(q_pos: list[int], topk: int, s_kv: int, seed: int) -> torch.Tensor:
    """Row i: every key at or before q_pos[i], shuffled, padded with -1 or out-of-range ones."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for p in q_pos:
        keys = torch.randperm(p + 1, generator=gen)
        pad = torch.where(torch.rand(topk - p - 1, generator=gen) < 0.5, -1,
                          s_kv + torch.randint(0, 3, (topk - p - 1,), generator=gen))
        row = torch.cat([keys, pad])
        rows.append(row[torch.randperm(topk, generator=gen)])
    return torch.stack(rows).to(I32) if rows else torch.zeros(0, topk, dtype=I32)


@pytest.mark.parametrize("ctx,s_q,extra", [(0, 1, 0), (0, 7, 2), (5, 3, 0), (11, 1, 3),
                                           (9, 6, 1)])
def test_prefill_all_selected_equals_dense(ctx: int, s_q: int, extra: int) -> None:
    c = TINY
    w = MLAWeights.random(c, seed=ctx + s_q, dtype=F64)
    N, s_kv = c.num_heads, ctx + s_q
    q_nope = _randn(s_q, N, c.qk_nope_head_dim, seed=1)
    q_pe = _randn(s_q, N, c.qk_rope_head_dim, seed=2)
    kv_c = _randn(s_kv, c.kv_lora_rank, seed=3)
    k_pe = _randn(s_kv, c.qk_rope_head_dim, seed=4)
    q_pos = torch.arange(ctx, s_kv)
    o_ref, lse_ref = absorbed_attention(q_nope, q_pe, kv_c, k_pe, w.W_UK, w.W_UV,
                                        c.softmax_scale, causal=True, q_positions=q_pos,
                                        k_positions=torch.arange(s_kv))
    q = torch.cat([absorb_q(q_nope, w.W_UK), q_pe], dim=-1)
    kv = torch.cat([kv_c, k_pe], dim=-1)
    indices = _causal_indices(q_pos.tolist(), s_kv + extra, s_kv, seed=5)
    o_lat, max_logits, lse = sparse_mla_prefill(q, kv, indices, c.softmax_scale,
                                                d_v=c.kv_lora_rank)
    o = torch.einsum("snl,lnv->snv", o_lat, w.W_UV)
    assert_close(o, o_ref, 1e-10, name="o")
    assert_close(lse.T, lse_ref, 1e-10, name="lse")
    s = torch.einsum("shd,kd->shk", q, kv) * c.softmax_scale
    s = s.masked_fill((torch.arange(s_kv)[None, :] > q_pos[:, None])[:, None, :], float("-inf"))
    assert_close(max_logits, s.amax(-1), 1e-10, name="max_logits")


@pytest.mark.parametrize("with_topk_length", [False, True])
@pytest.mark.parametrize("s_q,s_kv,topk", [(1, 1, 1), (9, 13, 5), (6, 21, 8), (5, 4, 7)])
def test_prefill_topk_equals_masked_dense(s_q: int, s_kv: int, topk: int,
                                          with_topk_length: bool) -> None:
    D, d_v, h = 40, 32, 3
    gen = torch.Generator().manual_seed(s_q * 100 + s_kv)
    q = _randn(s_q, h, D, seed=s_q) * 2.0
    kv = _randn(s_kv, D, seed=s_kv)
    rows = []
    for _ in range(s_q):
        n = int(torch.randint(0, min(topk, s_kv) + 1, (1,), generator=gen))
        keys = torch.randperm(s_kv, generator=gen)[:n]
        pad = torch.where(torch.rand(topk - n, generator=gen) < 0.5, -1,
                          torch.randint(s_kv, s_kv + 4, (topk - n,), generator=gen))
        rows.append(torch.cat([keys, pad])[torch.randperm(topk, generator=gen)])
    rows[0] = torch.full((topk,), -1)  # a lonely query
    indices = torch.stack(rows).to(I32)
    topk_length = None
    if with_topk_length:
        topk_length = torch.randint(0, topk + 1, (s_q,), generator=gen, dtype=I32)
    selected = _selection_loop(indices, s_kv, topk_length)
    # poison the keys nobody selects: NaN must not leak through a zero weight
    kv[~selected.any(0)] = float("nan")
    assert torch.equal(sparse_index_mask(indices, s_kv, topk_length), selected)

    out, max_logits, lse = sparse_mla_prefill(q, kv, indices, 0.3, d_v=d_v,
                                              topk_length=topk_length)
    ref_out, ref_max, ref_lse = _masked_dense(q, kv, selected, 0.3, d_v)
    assert_close(out, ref_out, 1e-10, name="out")
    assert_close(lse, ref_lse, 1e-10, name="lse")
    assert_close(max_logits, ref_max, 1e-10, name="max_logits")
    lonely = ~selected.any(1)
    assert lonely[0]
    assert torch.all(out[lonely] == 0)
    assert torch.all(lse[lonely] == float("inf"))
    assert torch.all(max_logits[lonely] == float("-inf"))


def test_prefill_lonely_and_empty_cases() -> None:
    q = _randn(3, 2, 40, seed=1)
    kv = _randn(5, 40, seed=2)
    for indices, topk_length in [
        (torch.full((3, 4), -1, dtype=I32), None),  # every index -1
        (torch.tensor([[0, 1, 2, 3]] * 3, dtype=I32), torch.zeros(3, dtype=I32)),  # length 0
        (torch.tensor([[5, 7, -3, 99]] * 3, dtype=I32), None),  # all >= s_kv or negative
        (torch.zeros(3, 0, dtype=I32), None),  # topk = 0
    ]:
        out, max_logits, lse = sparse_mla_prefill(q, kv, indices, 0.5, d_v=32,
                                                  topk_length=topk_length)
        assert torch.all(out == 0) and out.shape == (3, 2, 32)
        assert torch.all(lse == float("inf")) and torch.all(max_logits == float("-inf"))
    out, max_logits, lse = sparse_mla_prefill(q, kv[:0], torch.tensor([[0, -1]] * 3, dtype=I32),
                                              0.5, d_v=32)  # s_kv = 0
    assert torch.all(out == 0) and torch.all(lse == float("inf"))
    out, max_logits, lse = sparse_mla_prefill(q[:0], kv, torch.zeros(0, 2, dtype=I32), 0.5,
                                              d_v=32)  # s_q = 0
    assert out.shape == (0, 2, 32) and lse.shape == (0, 2) and max_logits.shape == (0, 2)


def test_prefill_repeated_index_and_flashmla_layouts() -> None:
    q = _randn(4, 2, 40, seed=3)
    kv = _randn(6, 40, seed=4)
    once = torch.tensor([[1, 4, -1], [0, -1, -1], [5, 2, 3], [2, -1, -1]], dtype=I32)
    twice = torch.tensor([[1, 4, 4], [0, 0, -1], [5, 2, 3], [2, 2, 2]], dtype=I32)
    o1, m1, l1 = sparse_mla_prefill(q, kv, once, 0.4, d_v=32)
    o2, m2, l2 = sparse_mla_prefill(q, kv, twice, 0.4, d_v=32)
    # a repeated index counts once per appearance (FlashMLA's reference gathers it twice)
    assert_close(o2[1], o1[1], 1e-12)
    assert_close(l2[1], l1[1] + math.log(2), 1e-12)
    assert_close(l2[3], l1[3] + math.log(3), 1e-12)
    assert_close(m2, m1, 1e-12)
    assert rel_err(o2[0], o1[0]) > 1e-3  # row 0: key 4 got twice the weight
    # FlashMLA's [s_kv, 1, d] and [s_q, 1, topk] layouts give the same numbers
    o3, m3, l3 = sparse_mla_prefill(q, kv[:, None, :], once[:, None, :], 0.4, d_v=32)
    assert torch.equal(o3, o1) and torch.equal(m3, m1) and torch.equal(l3, l1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_low_precision_against_float64(dtype: torch.dtype) -> None:
    q = _randn(7, 4, 40, seed=5, dtype=dtype)
    kv = _randn(13, 40, seed=6, dtype=dtype)
    indices = _causal_indices(list(range(6, 13)), 15, 13, seed=7)
    out, max_logits, lse = sparse_mla_prefill(q, kv, indices, 0.2, d_v=32)
    assert out.dtype == dtype and lse.dtype == torch.float32 and max_logits.dtype == torch.float32
    ref_out, ref_max, ref_lse = sparse_mla_prefill(q.to(F64), kv.to(F64), indices, 0.2, d_v=32)
    assert_close(out, ref_out, name=f"out {dtype}")
    assert_close(lse, ref_lse, abs_tol=1e-3, name="lse")
    assert_close(max_logits, ref_max, abs_tol=1e-3, name="max_logits")


def test_workspace_prefill_equals_decode_on_the_paged_cache() -> None:
    """vLLM's two readings of one selection: global slots into the paged cache (decode
    kernel) and workspace rows after gathering each prefill request (prefill kernel)."""
    D, bs = 40, 4
    lens = [9, 6, 11]  # request 0 decodes, requests 1 and 2 prefill
    block_table, nb = make_block_table(lens, bs, spare_blocks=1, seed=2)
    cache = torch.full((nb, bs, D), float("nan"), dtype=F64)
    flat = cache.view(-1, D)
    for r, n in enumerate(lens):
        pos = torch.arange(n)
        flat[block_table[r].long()[pos // bs] * bs + pos % bs] = _randn(n, D, seed=10 + r)
    req_id = torch.tensor([0, 1, 1, 2, 2, 2], dtype=I32)
    q_pos = [8, 4, 5, 8, 9, 10]
    local = torch.cat([_causal_indices([p], 12, 99, seed=20 + t)
                       for t, p in enumerate(q_pos)]).clamp_max(11)
    local[local >= 11] = -1
    ws_ids = torch.tensor([-1, 0, 0, 1, 1, 1], dtype=I32)
    starts = torch.tensor([0, 6], dtype=I32)  # request 1 at rows 0..5, request 2 at 6..16
    rows = convert_req_index_to_global_index(req_id, block_table, local, bs, ws_ids, starts)
    slots = convert_req_index_to_global_index(req_id, block_table, local, bs)
    workspace = torch.full((17, D), float("nan"), dtype=F64)
    gather_cache(cache, workspace, block_table[1:], torch.tensor([0, 6, 17]), 2)
    q = _randn(6, 3, D, seed=30)
    out_ws, _, lse_ws = sparse_mla_prefill(q[1:], workspace, rows[1:], 0.3, d_v=32)
    out_dec, lse_dec = sparse_mla_decode(q[None, 1:], cache, slots[None, 1:], 0.3, False,
                                         head_dim_v=32)
    assert_close(out_ws, out_dec[0], 1e-12)
    assert_close(lse_ws, lse_dec[0].T, 1e-12)
    assert torch.equal(rows[0], slots[0])  # the decode token keeps its global slots


# --------------------------------------------------------------------------------------------
# kernel level: sparse decode
# --------------------------------------------------------------------------------------------

def _paged(lens: list[int], bs: int, D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    block_table, nb = make_block_table(lens, bs, spare_blocks=2, seed=seed)
    cache = torch.full((nb, bs, D), float("nan"), dtype=F64)  # unwritten rows are poison
    flat = cache.view(-1, D)
    for r, n in enumerate(lens):
        pos = torch.arange(n)
        flat[block_table[r].long()[pos // bs] * bs + pos % bs] = _randn(n, D, seed=seed + r)
    return cache, block_table


@pytest.mark.parametrize("s_q", [1, 2])
def test_decode_all_selected_equals_mla_decode_paged(s_q: int) -> None:
    c = TINY
    lens, bs, N, D = [13, 2, 7], 4, c.num_heads, c.latent_dim
    cache, block_table = _paged(lens, bs, D, seed=3)
    q = _randn(3, s_q, N, D, seed=4)
    topk = max(lens) + 2
    local = torch.cat([_causal_indices([n - s_q + j for j in range(s_q)], topk, n, seed=5 + b)
                       for b, n in enumerate(lens)])
    # the padding past a request's length must not name a (poisoned) slot of its table
    local[local >= torch.tensor(lens).repeat_interleave(s_q)[:, None]] = -1
    req_id = torch.arange(3, dtype=I32).repeat_interleave(s_q)
    slots = convert_req_index_to_global_index(req_id, block_table, local, bs).view(3, s_q, -1)
    out, lse = sparse_mla_decode(q, cache, slots, c.softmax_scale, False,
                                 head_dim_v=c.kv_lora_rank)
    ref_out, ref_lse = mla_decode_paged(q, cache, block_table, torch.tensor(lens, dtype=I32),
                                        c.softmax_scale, causal=True, head_dim_v=c.kv_lora_rank)
    assert out.shape == (3, s_q, N, c.kv_lora_rank) and lse.shape == (3, N, s_q)
    assert_close(out, ref_out, 1e-10, name="out")
    assert_close(lse, ref_lse, 1e-10, name="lse")


def test_decode_topk_equals_masked_dense() -> None:
    lens, bs, h, D, s_q, topk = [13, 5, 9], 4, 3, 40, 2, 6
    cache, block_table = _paged(lens, bs, D, seed=6)
    gen = torch.Generator().manual_seed(7)
    local = torch.full((3, s_q, topk), -1, dtype=I32)
    for b, n in enumerate(lens):
        for j in range(s_q):
            k = int(torch.randint(1, min(topk, n) + 1, (1,), generator=gen))
            local[b, j, :k] = torch.randperm(n, generator=gen)[:k].to(I32)
            local[b, j] = local[b, j][torch.randperm(topk, generator=gen)]
    local[1, 0] = -1  # a lonely query
    topk_length = torch.tensor([6, 4, 3], dtype=I32)
    req_id = torch.arange(3, dtype=I32).repeat_interleave(s_q)
    slots = convert_req_index_to_global_index(req_id, block_table, local.view(-1, topk), bs)
    q = _randn(3, s_q, h, D, seed=8)
    out, lse = sparse_mla_decode(q, cache, slots.view(3, s_q, topk), 0.25, False,
                                 topk_length=topk_length, head_dim_v=32)
    for b, n in enumerate(lens):
        rows = cache_rows(cache, block_table[b], 0, n)
        length = topk_length[b].repeat(s_q)
        selected = _selection_loop(local[b], n, length)
        ref_out, _, ref_lse = _masked_dense(q[b], rows, selected, 0.25, 32)
        assert_close(out[b], ref_out, 1e-10, name=f"out[{b}]")
        assert_close(lse[b].T, ref_lse, 1e-10, name=f"lse[{b}]")
    assert torch.all(out[1, 0] == 0) and torch.all(lse[1, :, 0] == float("inf"))


def test_decode_fp8_cache_reads_the_dequantized_rows() -> None:
    lens, bs, h, s_q, topk = [5, 9], 4, 2, 2, 7
    block_table, nb = make_block_table(lens, bs, spare_blocks=1, seed=8)
    fp8 = torch.full((nb, bs, 656), 0xFF, dtype=torch.uint8)  # 0xFF scales read as NaN
    exact = torch.full((nb, bs, 576), float("nan"), dtype=F64)
    for r, n in enumerate(lens):
        pos = torch.arange(n)
        slot = block_table[r].long()[pos // bs] * bs + pos % bs
        kv_c = _randn(n, 512, seed=40 + r) * torch.tensor([0.02, 1.0, 3.0, 40.0]).repeat_interleave(
            128)
        k_pe = _randn(n, 64, seed=50 + r)
        concat_and_cache_fp8_ds_mla(kv_c, k_pe, fp8, slot)
        exact.view(-1, 576)[slot] = torch.cat([kv_c, k_pe], dim=-1)
    deq_c, deq_pe = dequantize_fp8_ds_mla(fp8)
    dequant = torch.cat([deq_c, deq_pe], dim=-1).to(F64)
    gen = torch.Generator().manual_seed(9)
    local = torch.full((2, s_q, topk), -1, dtype=I32)
    for b, n in enumerate(lens):
        for j in range(s_q):
            k = min(topk, n - s_q + j + 1)
            local[b, j, :k] = torch.randperm(n - s_q + j + 1, generator=gen)[:k].to(I32)
    slots = convert_req_index_to_global_index(torch.arange(2, dtype=I32).repeat_interleave(s_q),
                                              block_table, local.view(-1, topk), bs)
    slots = slots.view(2, s_q, topk)
    q = _randn(2, s_q, h, 576, seed=10) * 0.1
    out, lse = sparse_mla_decode(q, fp8, slots, 576 ** -0.5, True)
    ref_out, ref_lse = sparse_mla_decode(q, dequant, slots, 576 ** -0.5, False)
    assert out.shape == (2, s_q, h, 512)
    assert_close(out, ref_out, 1e-12, name="out")
    assert_close(lse, ref_lse, 1e-12, name="lse")
    # FlashMLA's [num_blocks, block_size, 1, 656] layout, and a float8_e4m3fn-typed cache
    out4, lse4 = sparse_mla_decode(q, fp8.view(torch.float8_e4m3fn)[:, :, None], slots,
                                   576 ** -0.5, True)
    assert torch.equal(out4, out) and torch.equal(lse4, lse)
    # against the unquantized latent: the fp8 rounding (<= 2^-4 per value) shows, bounded
    err = rel_err(out, sparse_mla_decode(q, exact, slots, 576 ** -0.5, False)[0])
    print(f"fp8_ds_mla decode vs unquantized cache: relative error {err:.2e}")
    assert 0 < err < 2.0 ** -4
    # bf16 queries on the fp8 cache, as served: within conventions §11's bf16 tolerance
    out_bf16, lse_bf16 = sparse_mla_decode(q.to(torch.bfloat16), fp8, slots, 576 ** -0.5, True)
    assert_close(out_bf16, ref_out, name="out bf16")
    assert_close(lse_bf16, ref_lse, abs_tol=1e-2, name="lse bf16")


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------

def test_bad_input_raises_naming_the_argument() -> None:
    q = _randn(3, 2, 40, seed=1)
    kv = _randn(5, 40, seed=2)
    idx = torch.zeros(3, 4, dtype=I32)
    with pytest.raises(TypeError, match="indices"):
        sparse_mla_prefill(q, kv, idx.long(), 0.5, d_v=32)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_prefill(q, kv, idx[0], 0.5, d_v=32)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_prefill(q, kv, torch.zeros(3, 2, 4, dtype=I32), 0.5, d_v=32)
    with pytest.raises(ValueError, match="topk_length"):
        sparse_mla_prefill(q, kv, idx, 0.5, d_v=32, topk_length=torch.full((3,), 5, dtype=I32))
    with pytest.raises(TypeError, match="topk_length"):
        sparse_mla_prefill(q, kv, idx, 0.5, d_v=32, topk_length=torch.full((3,), 2))
    with pytest.raises(ValueError, match="kv"):
        sparse_mla_prefill(q, kv[:, :36], idx, 0.5, d_v=32)
    with pytest.raises(TypeError, match="kv"):
        sparse_mla_prefill(q, kv.float(), idx, 0.5, d_v=32)
    with pytest.raises(ValueError, match="d_v"):
        sparse_mla_prefill(q, kv, idx, 0.5, d_v=48)
    with pytest.raises(ValueError, match="d_v"):
        sparse_mla_prefill(q, kv, idx, 0.5)  # FlashMLA's default 512 > 40
    with pytest.raises(ValueError, match="sm_scale"):
        sparse_mla_prefill(q, kv, idx, -1.0, d_v=32)

    qd = _randn(2, 1, 2, 576, seed=3)
    cache = torch.zeros(3, 4, 576, dtype=F64)
    ids = torch.zeros(2, 1, 4, dtype=I32)
    with pytest.raises(ValueError, match="kv_cache"):
        sparse_mla_decode(qd, torch.zeros(3, 4, 600, dtype=F64), ids, 0.1, False)
    with pytest.raises(ValueError, match="kv_cache"):
        sparse_mla_decode(qd, torch.zeros(3, 4, 576, dtype=torch.uint8), ids, 0.1, True)
    with pytest.raises(TypeError, match="kv_cache"):
        sparse_mla_decode(qd, cache, ids, 0.1, True)
    with pytest.raises(TypeError, match="kv_cache"):
        sparse_mla_decode(qd, torch.zeros(3, 4, 656, dtype=torch.uint8), ids, 0.1, False)
    with pytest.raises(TypeError, match="indices"):
        sparse_mla_decode(qd, cache, ids.long(), 0.1, False)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_decode(qd, cache, ids[0], 0.1, False)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_decode(qd, cache, torch.full((2, 1, 4), 12, dtype=I32), 0.1, False)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_decode(qd, cache, torch.full((2, 1, 4), -2, dtype=I32), 0.1, False)
    with pytest.raises(ValueError, match="topk_length"):
        sparse_mla_decode(qd, cache, ids, 0.1, False, topk_length=torch.tensor([1, 5], dtype=I32))
    with pytest.raises(ValueError, match="topk_length"):
        sparse_mla_decode(qd, cache, ids, 0.1, False, topk_length=torch.tensor([1], dtype=I32))
    with pytest.raises(TypeError, match="is_fp8_kvcache"):
        sparse_mla_decode(qd, cache, ids, 0.1, "fp8_ds_mla")

    table = torch.zeros(2, 3, dtype=I32)
    tok = torch.zeros(2, 4, dtype=I32)
    req = torch.zeros(2, dtype=I32)
    with pytest.raises(TypeError, match="token_indices"):
        convert_req_index_to_global_index(req, table, tok.long(), 4)
    with pytest.raises(ValueError, match="token_indices"):
        convert_req_index_to_global_index(req, table, tok[:1], 4)
    with pytest.raises(ValueError, match="req_id"):
        convert_req_index_to_global_index(torch.tensor([0, 2], dtype=I32), table, tok, 4)
    with pytest.raises(ValueError, match="prefill_workspace"):
        convert_req_index_to_global_index(req, table, tok, 4,
                                          prefill_workspace_request_ids=req)
    with pytest.raises(ValueError, match="prefill_workspace_request_ids"):
        convert_req_index_to_global_index(req, table, tok, 4, torch.tensor([0, 3], dtype=I32),
                                          torch.zeros(2, dtype=I32))
    with pytest.raises(ValueError, match="block_size"):
        convert_req_index_to_global_index(req, table, tok, 0)


# --------------------------------------------------------------------------------------------
# model level
# --------------------------------------------------------------------------------------------

def _sparse_config(topk: int, fp8_sized: bool = False):
    if fp8_sized:  # fp8_ds_mla fixes the latent at 512 + 64
        return TINY.replace(name="tiny-fp8", num_heads=2, kv_lora_rank=512,
                            qk_rope_head_dim=64, index_n_heads=2, index_head_dim=64,
                            index_topk=topk)
    return TINY.replace(name="tiny-sparse", index_n_heads=4, index_head_dim=16,
                        index_topk=topk)


# request lengths 13 and 5: a prefill of 5 and 1 tokens, a second prefill of 4 and 0 after
# that context, then decode steps of 1, 1 and 2 (MTP) tokens
FIRST, SECOND, DECODE_STEPS = [5, 1], [4, 0], [1, 1, 2]
LENGTHS = [f + s + sum(DECODE_STEPS) for f, s in zip(FIRST, SECOND)]


def _run_paged(w: MLAWeights, iw: IndexerWeights, hidden: list[torch.Tensor], fp8: bool,
               use_fp8_indexer: bool = False, bs: int = 4) -> list[torch.Tensor]:
    """Serve both requests step by step on one paged cache; return their outputs."""
    c = w.config
    block_table, nb = make_block_table(LENGTHS, bs, spare_blocks=2, seed=11)
    if fp8:
        kv_cache = torch.full((nb, bs, 656), 0xFF, dtype=torch.uint8)
    else:
        kv_cache = torch.full((nb, bs, c.latent_dim), float("nan"), dtype=hidden[0].dtype)
    index_k_cache = torch.full((nb, bs, c.index_head_dim), float("nan"), dtype=hidden[0].dtype)
    outs: list[list[torch.Tensor]] = [[], []]
    done = [0, 0]
    for step in (FIRST, SECOND):
        parts = [hidden[i][done[i]: done[i] + step[i]] for i in range(2)]
        qsl = torch.tensor([0, step[0], step[0] + step[1]])
        out = sparse_prefill_forward(w, iw, torch.cat(parts), qsl, list(done), kv_cache,
                                     index_k_cache, block_table, use_fp8_indexer)
        outs[0].append(out[: step[0]])
        outs[1].append(out[step[0]:])
        done = [done[i] + step[i] for i in range(2)]
    for s_q in DECODE_STEPS:
        h = torch.stack([hidden[i][done[i]: done[i] + s_q] for i in range(2)])
        out = sparse_decode_forward(w, iw, h, kv_cache, index_k_cache, block_table,
                                    torch.tensor(done), use_fp8_indexer)
        for i in range(2):
            outs[i].append(out[i])
        done = [d + s_q for d in done]
    return [torch.cat(o) for o in outs]


def _model(topk: int, dtype: torch.dtype = F64, fp8_sized: bool = False):
    c = _sparse_config(topk, fp8_sized)
    w = MLAWeights.random(c, seed=21, dtype=dtype)
    iw = IndexerWeights.random(c, seed=22, dtype=dtype)
    hidden = [_randn(n, c.hidden_size, seed=23 + i, dtype=dtype) for i, n in enumerate(LENGTHS)]
    return w, iw, hidden


def test_model_topk_covering_the_context_equals_naive() -> None:
    w, iw, hidden = _model(topk=64)
    outs = _run_paged(w, iw, hidden, fp8=False)
    for i, h in enumerate(hidden):
        assert_close(outs[i], naive_forward(w, h), 1e-10, name=f"request {i}")
        assert_close(sparse_masked_dense_forward(w, iw, h), naive_forward(w, h), 1e-10)


@pytest.mark.parametrize("use_fp8_indexer", [False, True])
def test_model_topk_equals_masked_dense(use_fp8_indexer: bool) -> None:
    w, iw, hidden = _model(topk=4)
    outs = _run_paged(w, iw, hidden, fp8=False, use_fp8_indexer=use_fp8_indexer)
    for i, h in enumerate(hidden):
        ref = sparse_masked_dense_forward(w, iw, h, use_fp8_indexer=use_fp8_indexer)
        assert_close(outs[i], ref, 1e-10, name=f"request {i}")
    # the selection bites: request 0 (13 tokens) differs from dense attention
    assert rel_err(outs[0], naive_forward(w, hidden[0])) > 1e-2


def test_model_fp8_cache_equals_masked_dense_on_the_rounded_latent() -> None:
    w, iw, hidden = _model(topk=5, fp8_sized=True)
    outs = _run_paged(w, iw, hidden, fp8=True)  # prefill via the workspace, decode on fp8
    exact = _run_paged(w, iw, hidden, fp8=False)
    for i, h in enumerate(hidden):
        ref = sparse_masked_dense_forward(w, iw, h, fp8_kv_cache=True)
        assert_close(outs[i], ref, 1e-10, name=f"request {i} (fp8_ds_mla)")
        assert_close(exact[i], sparse_masked_dense_forward(w, iw, h), 1e-10,
                     name=f"request {i} (float cache)")
        err = rel_err(outs[i], exact[i])
        print(f"request {i}: fp8_ds_mla cache vs float cache, relative error {err:.2e}")
        assert 0 < err < 2.0 ** -4


def test_model_bfloat16_against_float64() -> None:
    w, iw, hidden = _model(topk=64, dtype=torch.bfloat16)  # no selection to flip
    outs = _run_paged(w, iw, hidden, fp8=False)
    for i, h in enumerate(hidden):
        ref = naive_forward(w.to(dtype=F64), h.to(F64))
        assert outs[i].dtype == torch.bfloat16
        assert_close(outs[i], ref, name=f"request {i} bf16")


def test_model_bad_input() -> None:
    w, iw, hidden = _model(topk=4)
    block_table, nb = make_block_table(LENGTHS, 4, seed=1)
    kv = torch.zeros(nb, 4, 40, dtype=F64)
    ik = torch.zeros(nb, 4, 16, dtype=F64)
    qsl = torch.tensor([0, 2, 3])
    h = hidden[0][:3]
    with pytest.raises(ValueError, match="index_k_cache"):
        sparse_prefill_forward(w, iw, h, qsl, [0, 0], kv, ik[..., :8], block_table)
    with pytest.raises(ValueError, match="kv_cache"):
        sparse_prefill_forward(w, iw, h, qsl, [0, 0], kv[..., :39], ik, block_table)
    with pytest.raises(ValueError, match="fp8_ds_mla"):
        sparse_prefill_forward(w, iw, h, qsl, [0, 0], torch.zeros(nb, 4, 656, dtype=torch.uint8),
                               ik, block_table)
    with pytest.raises(ValueError, match="query_start_loc"):
        sparse_prefill_forward(w, iw, h, torch.tensor([0, 2, 4]), [0, 0], kv, ik, block_table)
