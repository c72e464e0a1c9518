"""The paged latent cache (conventions §8) and the paged decode kernel over it (section 12).

Write: exact rows at the slots of the formula, slot -1 skipped, nothing else touched (the cache
is NaN-poisoned first). Gather: page-unaligned ``seq_starts`` equal slicing the dense sequence.
A hypothesis property: write then gather round-trips for random block tables, lengths and block
sizes. ``mla_decode_paged`` equals a dense softmax written out here, for block sizes 1, 16, 64,
lengths that are not page multiples, empty and length-1 caches, ``s_q`` 1 and 3.
"""

from __future__ import annotations

import pytest
import torch
from _util import DTYPES, check, randn
from hypothesis import given
from hypothesis import strategies as st

from mla.compare import LSE_ABS_TOL, assert_close, poison_like
from mla.reference import (
    cache_rows,
    concat_and_cache_mla,
    gather_cache,
    make_block_table,
    mla_decode_paged,
    slot_mapping_from_block_table,
)


def _slots_by_hand(block_table: torch.Tensor, req: list[int], pos: list[int],
                   block_size: int) -> list[int]:
    return [int(block_table[r, p // block_size]) * block_size + p % block_size
            for r, p in zip(req, pos)]


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
def test_slot_mapping_formula(block_size: int) -> None:
    lens = [5, 0, 70, 17]
    block_table, _ = make_block_table(lens, block_size, seed=3)
    req = [r for r, n in enumerate(lens) for _ in range(n)]
    pos = [p for n in lens for p in range(n)]
    slots = slot_mapping_from_block_table(block_table, torch.tensor(req), torch.tensor(pos),
                                          block_size)
    assert slots.tolist() == _slots_by_hand(block_table, req, pos, block_size)
    assert len(set(slots.tolist())) == len(pos)  # no two tokens share a slot


def test_slot_mapping_rejects_position_past_table() -> None:
    block_table, _ = make_block_table([5], 4)
    with pytest.raises(ValueError, match="block"):
        slot_mapping_from_block_table(block_table, torch.tensor([0]), torch.tensor([8]), 4)


def _write_dense(dense: list[torch.Tensor], lat: int, block_size: int, dtype: torch.dtype,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-poisoned cache holding the rows ``dense[i] [len_i, lat + R]`` of each request."""
    D = dense[0].shape[1]
    block_table, num_blocks = make_block_table([d.shape[0] for d in dense], block_size,
                                               spare_blocks=1, seed=seed)
    kv_cache = poison_like(torch.empty(num_blocks, block_size, D, dtype=dtype))
    for i, d in enumerate(dense):
        n = d.shape[0]
        slots = slot_mapping_from_block_table(block_table, torch.full((n,), i), torch.arange(n),
                                              block_size)
        concat_and_cache_mla(d[:, :lat].to(dtype), d[:, lat:].to(dtype), kv_cache, slots)
    return kv_cache, block_table


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k_pe_3d", [False, True])
def test_concat_and_cache_mla_writes_exact_rows(dtype: torch.dtype, k_pe_3d: bool) -> None:
    lat, R, bs, nb = 12, 4, 16, 5
    T = 23
    kv_c, k_pe = randn(T, lat, seed=1, dtype=dtype), randn(T, R, seed=2, dtype=dtype)
    kv_cache = poison_like(torch.empty(nb, bs, lat + R, dtype=dtype))
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(nb * bs, generator=gen)[:T]
    slots[[0, 7, 8, 22]] = -1  # padding tokens, first and last included
    concat_and_cache_mla(kv_c, k_pe[:, None] if k_pe_3d else k_pe, kv_cache, slots)
    flat = kv_cache.view(-1, lat + R)
    written = torch.zeros(nb * bs, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], torch.cat([kv_c[t], k_pe[t]]))
            written[s] = True
    assert written.sum() == T - 4
    assert torch.isnan(flat[~written]).all(), "a row no valid token maps to was touched"


def test_concat_and_cache_mla_rejects_bad_slot() -> None:
    kv_cache = torch.zeros(2, 4, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="slot_mapping"):
        concat_and_cache_mla(randn(2, 4, seed=0), randn(2, 2, seed=1), kv_cache,
                             torch.tensor([0, 8]))


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_gather_cache_unaligned_starts(block_size: int) -> None:
    lens = [29, 0, 7, 40]
    dense = [randn(n, 10, seed=10 + i) for i, n in enumerate(lens)]
    kv_cache, block_table = _write_dense(dense, 8, block_size, torch.float64)
    starts = [3, 0, 5, 17]  # not multiples of the page (except where the page is 1)
    chunk = [20, 0, 2, 23]  # request 3's chunk runs to its last token
    cu = torch.tensor([0] + chunk).cumsum(0).to(torch.int32)
    dst = poison_like(torch.empty(sum(chunk) + 4, 10, dtype=torch.float64))
    got = gather_cache(kv_cache, dst, block_table, cu, len(lens),
                       seq_starts=torch.tensor(starts, dtype=torch.int32))
    want = torch.cat([d[s: s + n] for d, s, n in zip(dense, starts, chunk)])
    assert torch.equal(got, want)
    assert torch.isnan(dst[sum(chunk):]).all(), "gather wrote past cu_seq_lens[-1]"


@given(
    lens=st.lists(st.integers(0, 90), min_size=1, max_size=4),
    block_size=st.sampled_from([1, 2, 3, 16, 64]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_write_then_gather_round_trips(lens: list[int], block_size: int, seed: int,
                                       data: st.DataObject) -> None:
    lat, R = 6, 2
    dense = [randn(n, lat + R, seed=seed + i, dtype=torch.float32) for i, n in enumerate(lens)]
    block_table, num_blocks = make_block_table(lens, block_size, spare_blocks=2, seed=seed)
    kv_cache = poison_like(torch.empty(num_blocks, block_size, lat + R))
    # all tokens in one shuffled write, with padding slots mixed in
    req = torch.tensor([i for i, n in enumerate(lens) for _ in range(n)], dtype=torch.long)
    pos = torch.tensor([p for n in lens for p in range(n)], dtype=torch.long)
    rows = torch.cat(dense) if sum(lens) else torch.empty(0, lat + R)
    slots = slot_mapping_from_block_table(block_table, req, pos, block_size)
    pad = data.draw(st.integers(0, 3))
    slots = torch.cat([slots, torch.full((pad,), -1, dtype=slots.dtype)])
    rows = torch.cat([rows, randn(pad, lat + R, seed=seed + 99, dtype=torch.float32)])
    order = torch.randperm(len(slots), generator=torch.Generator().manual_seed(seed))
    concat_and_cache_mla(rows[order, :lat], rows[order, lat:], kv_cache, slots[order])
    assert int(torch.isnan(kv_cache).any(-1).logical_not().sum()) == sum(lens)

    starts = [data.draw(st.integers(0, n)) for n in lens]
    chunk = [data.draw(st.integers(0, n - s)) for n, s in zip(lens, starts)]
    cu = torch.tensor([0] + chunk).cumsum(0).to(torch.int32)
    dst = poison_like(torch.empty(sum(chunk), lat + R))
    got = gather_cache(kv_cache, dst, block_table, cu, len(lens),
                       seq_starts=torch.tensor(starts, dtype=torch.int32))
    want = [d[s: s + n] for d, s, n in zip(dense, starts, chunk)]
    assert torch.equal(got, torch.cat(want))
    for i, d in enumerate(dense):
        assert torch.equal(cache_rows(kv_cache, block_table[i], 0, lens[i]), d)


# ---------------------------------------------------------------------------------------------
# mla_decode_paged against a dense softmax
# ---------------------------------------------------------------------------------------------


def _dense_decode(q: torch.Tensor, rows: torch.Tensor, scale: float, causal: bool,
                  dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request, float64: ``q [s_q, N, D]`` over ``rows [n, D]``; lse +inf when empty."""
    s_q, n = q.shape[0], rows.shape[0]
    s = torch.einsum("ihd,jd->hij", q.double(), rows.double()) * scale
    if causal:  # query i sits at position n - s_q + i
        visible = torch.arange(n)[None] <= (n - s_q + torch.arange(s_q))[:, None]
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1) if n else s.new_full((q.shape[1], s_q), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a row with no visible key: all zeros
    o = torch.einsum("hij,jd->ihd", p, rows[:, :dv].double())
    return o, torch.where(torch.isneginf(lse), float("inf"), lse)


# empty, one token, page multiples and not, for pages of 1, 16 and 64
DECODE_LENS = [0, 1, 16, 17, 64, 70, 129]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("s_q", [1, 3])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lat,R,heads", [(32, 8, 4), (512, 64, 2)])
def test_mla_decode_paged_matches_dense(dtype: torch.dtype, block_size: int, s_q: int,
                                        causal: bool, lat: int, R: int, heads: int) -> None:
    D, B = lat + R, len(DECODE_LENS)
    dense = [randn(n, D, seed=50 + i) for i, n in enumerate(DECODE_LENS)]
    kv_cache, block_table = _write_dense(dense, lat, block_size, dtype)
    q = randn(B, s_q, heads, D, seed=60, dtype=dtype)
    scale = (lat // 4 + R) ** -0.5  # the scale of a P + R head, not of the D-wide dot
    out, lse = mla_decode_paged(q, kv_cache, block_table,
                                torch.tensor(DECODE_LENS, dtype=torch.int32), scale,
                                causal=causal, head_dim_v=lat)
    assert out.shape == (B, s_q, heads, lat) and out.dtype == dtype
    assert lse.shape == (B, heads, s_q) and lse.dtype in (torch.float32, torch.float64)
    refs = [_dense_decode(q[b], dense[b].to(dtype), scale, causal, lat) for b in range(B)]
    o_ref = torch.stack([r[0] for r in refs])
    lse_ref = torch.stack([r[1] for r in refs])
    check(out, o_ref, f"mla_decode_paged {dtype} bs={block_size} s_q={s_q} causal={causal}")
    if dtype == torch.float64:
        assert_close(lse, lse_ref, name="lse")
    else:
        assert_close(lse, lse_ref, abs_tol=LSE_ABS_TOL, name="lse")
    # "lonely" queries (empty cache; with causal, the queries past a 1-token cache): 0 and +inf
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isposinf(lse[0]).all()
    if causal and s_q > 1:
        assert torch.equal(out[1, : s_q - 1], torch.zeros_like(out[1, : s_q - 1]))
        assert torch.isposinf(lse[1, :, : s_q - 1]).all() and torch.isfinite(lse[1, :, -1]).all()
