"""Decode context parallelism, simulated (conventions §9; ``mla.reference.dcp``).

Every rank program runs on ``W`` simulated ranks through ``run_simulated``.

- DCP decode equals single-rank decode (``mla_decode_paged``, ``decode_forward``) in float64 to
  1e-10 for W in 1, 2, 3, 4, 8, lengths shorter than W, equal to W, not multiples of W or of
  the block size, in mixed batches, s_q 1 and 2;
- DCP chunked prefill equals the single-rank chunked prefill (kernel and model level);
- ``reorg_kvcache`` drops exactly the padding rows; hypothesis properties for
  ``dcp_local_seq_lens``, the sharding and ``reorg_kvcache`` over random layouts;
- the simulated communicator's collectives, failures that must not hang, ``same_on_all_ranks``,
  and bad input.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla import MLAWeights, get_config
from mla.compare import assert_close
from mla.reference import (
    cache_rows,
    chunked_prefill_attention,
    chunked_prefill_forward,
    decode_forward,
    make_block_table,
    merge_attn_states_list,
    mla_decode_paged,
    write_context,
)
from mla.reference.dcp import (
    DCPChunkPlan,
    DCPSharding,
    SimulatedCommunicator,
    cp_lse_ag_out_rs,
    dcp_chunked_prefill_forward_rank,
    dcp_chunked_prefill_rank,
    dcp_decode_forward_rank,
    dcp_decode_rank,
    dcp_local_decode,
    dcp_local_seq_lens,
    dcp_slot_mapping,
    head_slice,
    plan_dcp_context_chunks,
    reorg_kvcache,
    run_simulated,
    same_on_all_ranks,
    shard_kv_cache,
)

WORLD_SIZES = (1, 2, 3, 4, 8)
N, LKV, R, P, V = 24, 32, 8, 16, 16  # 24 heads: divisible by every world size above
BS = 16
SCALE = (P + R) ** -0.5
CONFIG = get_config("tiny").replace(name="tiny-24h", num_heads=N)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def mixed_lengths(W: int) -> list[int]:
    """Shorter than W, equal to W, just past it, and not multiples of W or of the block size."""
    return sorted({1, max(W - 1, 1), W, W + 1, 2 * W + 3, 37, 70})


def random_cache(lens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A scattered block table, every slot random (so a wrongly read slot changes the answer)."""
    table, num_blocks = make_block_table(lens, BS, spare_blocks=1, seed=seed)
    return randn(num_blocks, BS, LKV + R, seed=seed + 1), table


@functools.lru_cache(maxsize=1)
def weights() -> MLAWeights:
    return MLAWeights.random(CONFIG, seed=0, dtype=torch.float64)


def filled_cache(contexts: list[int], capacities: list[int], seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN cache holding the latents of ``contexts[i]`` random tokens per request."""
    table, num_blocks = make_block_table(capacities, BS, spare_blocks=1, seed=seed)
    kv_cache = torch.full((num_blocks, BS, CONFIG.latent_dim), float("nan"),
                          dtype=torch.float64)
    for i, n in enumerate(contexts):
        write_context(weights(), randn(n, CONFIG.hidden_size, seed=seed + 10 + i), kv_cache,
                      table[i])
    return kv_cache, table


def simulated_decode(W: int, q: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor,
                     seqlens: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``dcp_decode_rank`` on W simulated ranks, their heads joined: ``mla_decode_paged``'s."""
    parts = run_simulated(W, functools.partial(
        dcp_decode_rank, q=q, kv_cache=kv_cache, block_table=table, cache_seqlens=seqlens,
        softmax_scale=SCALE, **kwargs))
    return torch.cat([o for o, _ in parts], dim=2), torch.cat([lse for _, lse in parts], dim=1)


# --- decode -------------------------------------------------------------------------------

@pytest.mark.parametrize("W", WORLD_SIZES)
@pytest.mark.parametrize("s_q,causal", [(1, False), (2, True), (2, False)])
def test_dcp_decode_equals_single_rank(W: int, s_q: int, causal: bool) -> None:
    lens = mixed_lengths(W)
    kv_cache, table = random_cache(lens, seed=W)
    q = randn(len(lens), s_q, N, LKV + R, seed=100 + W)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    ref_o, ref_lse = mla_decode_paged(q, kv_cache, table, seqlens, SCALE, causal=causal,
                                      head_dim_v=LKV)
    out, lse = simulated_decode(W, q, kv_cache, table, seqlens, causal=causal, head_dim_v=LKV)
    assert_close(out, ref_o, 1e-10, name="out")
    assert_close(lse, ref_lse, 1e-10, name="lse")


@pytest.mark.parametrize("lens", [[1], [2, 1, 3], [8], [9, 1, 16, 17]])
def test_dcp_decode_with_idle_ranks(lens: list[int]) -> None:
    """W = 8 with requests shorter than W: most ranks hold nothing of them (lse -inf)."""
    kv_cache, table = random_cache(lens, seed=7)
    q = randn(len(lens), 1, N, LKV + R, seed=8)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    ref_o, ref_lse = mla_decode_paged(q, kv_cache, table, seqlens, SCALE, head_dim_v=LKV)
    out, lse = simulated_decode(8, q, kv_cache, table, seqlens, head_dim_v=LKV)
    assert_close(out, ref_o, 1e-10)
    assert_close(lse, ref_lse, 1e-10)


def test_dcp_decode_not_fooled_by_the_local_mask() -> None:
    """MTP under DCP: the causal mask is on global positions. Masking the last s_q *local*
    keys instead (FlashMLA's causal flag on a shard) gives a different answer here."""
    lens = [7, 12]
    kv_cache, table = random_cache(lens, seed=3)
    q = randn(2, 3, N, LKV + R, seed=4)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    ref_o, _ = mla_decode_paged(q, kv_cache, table, seqlens, SCALE, causal=True,
                                head_dim_v=LKV)
    out, _ = simulated_decode(2, q, kv_cache, table, seqlens, causal=True, head_dim_v=LKV)
    assert_close(out, ref_o, 1e-10)
    # the local-mask shortcut, on rank 0's shard: differs from the exact partial result
    shard = shard_kv_cache(kv_cache, table, seqlens, 2)[0]
    local_o, _ = mla_decode_paged(q, shard.kv_cache, shard.block_table, shard.seq_lens, SCALE,
                                  causal=True, head_dim_v=LKV)
    exact_o, _ = dcp_local_decode(q, shard.kv_cache, shard.block_table, seqlens, SCALE, 0, 2,
                                  causal=True, head_dim_v=LKV)
    assert (local_o - exact_o).abs().max() > 1e-3


def test_cp_lse_ag_out_rs_is_the_merge() -> None:
    """The combination equals merging the ranks' partial states (conventions §6), head by head;
    empty ranks (+inf or -inf) weigh nothing and a query no rank saw gives 0 and -inf."""
    W, Tq, H, D = 3, 5, 6, 4
    outs = [randn(Tq, H, D, seed=r) for r in range(W)]
    lses = [randn(Tq, H, seed=10 + r) * 3 for r in range(W)]
    lses[1][0] = float("inf")  # rank 1 saw nothing for token 0 (FlashMLA's value)
    lses[2][1] = float("-inf")  # rank 2 saw nothing for token 1
    outs[2][1] = float("nan")  # whatever an empty rank's output holds
    for r in range(W):
        lses[r][4, 2] = float("inf") if r % 2 else float("-inf")  # nobody saw (4, head 2)
        outs[r][4, 2] = 0.0
    got = run_simulated(W, lambda comm: cp_lse_ag_out_rs(outs[comm.rank], lses[comm.rank],
                                                        comm, return_lse=True))
    ref_o, ref_lse = merge_attn_states_list(outs, [lse.T for lse in lses])  # lse [N, T]
    out = torch.cat([o for o, _ in got], dim=1)
    lse = torch.cat([lse for _, lse in got], dim=1)
    assert_close(out, ref_o, 1e-12)
    assert_close(lse, ref_lse.T, 1e-12)
    assert out[4, 2].eq(0).all() and torch.isneginf(lse[4, 2])
    for r, (o_r, _) in enumerate(got):
        assert o_r.shape == (Tq, H // W, D)
        assert torch.equal(o_r, out[:, head_slice(H, W, r)])



def test_cp_lse_ag_out_rs_keeps_nan() -> None:
    """A NaN lse on one rank is a NaN result for that query and head on every path
    (conventions §13), not "no keys": the other queries and heads are untouched."""
    W, Tq, H, D = 2, 3, 4, 5
    outs = [randn(Tq, H, D, seed=r) for r in range(W)]
    lses = [randn(Tq, H, seed=20 + r) for r in range(W)]
    lses[1][2, 3] = float("nan")
    got = run_simulated(W, lambda comm: cp_lse_ag_out_rs(outs[comm.rank], lses[comm.rank],
                                                        comm, return_lse=True))
    out = torch.cat([o for o, _ in got], dim=1)
    lse = torch.cat([lse for _, lse in got], dim=1)
    assert out[2, 3].isnan().all() and lse[2, 3].isnan()
    keep = torch.ones(Tq, H, dtype=torch.bool)
    keep[2, 3] = False
    ref_o, ref_lse = merge_attn_states_list(outs, [x.T for x in lses])
    assert_close(out[keep], ref_o[keep], 1e-12)
    assert_close(lse[keep], ref_lse.T[keep], 1e-12)

# --- sharding -----------------------------------------------------------------------------

@given(lens=st.lists(st.integers(0, 200), min_size=1, max_size=6), W=st.integers(1, 9),
       data=st.data())
def test_dcp_local_seq_lens_properties(lens: list[int], W: int, data: st.DataObject) -> None:
    seq = torch.tensor(lens, dtype=torch.int32)
    per_rank = torch.stack([dcp_local_seq_lens(seq, W, r) for r in range(W)])  # [W, B]
    assert per_rank.dtype == torch.int32
    assert per_rank.sum(0).tolist() == lens
    assert (per_rank.max(0).values - per_rank.min(0).values).le(1).all()
    r = data.draw(st.integers(0, W - 1))
    counted = [sum(1 for t in range(L) if t % W == r) for L in lens]
    assert per_rank[r].tolist() == counted
    # vLLM's expression before vllm-project/vllm#27518 agrees unless W divides L, where it
    # counts one token too many
    pre_fix = seq // W + (r <= (seq - 1) % W).int()
    for L, mine, theirs in zip(lens, per_rank[r].tolist(), pre_fix.tolist()):
        if L and L % W == 0:
            assert theirs == mine + 1
        elif L:
            assert theirs == mine


@given(lens=st.lists(st.integers(0, 60), min_size=1, max_size=4), W=st.integers(1, 6),
       bs=st.sampled_from([1, 3, 8, 16]))
def test_sharding_properties(lens: list[int], W: int, bs: int) -> None:
    """Each rank's local cache holds exactly the global rows t ≡ r (mod W), in order, and the
    placement covers every position once."""
    table, num_blocks = make_block_table(lens, bs, spare_blocks=1, seed=1)
    kv_cache = randn(num_blocks, bs, 5, seed=2)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    shards = shard_kv_cache(kv_cache, table, seqlens, W)
    sharding = DCPSharding.of(lens, W)
    for i, L in enumerate(lens):
        whole = cache_rows(kv_cache, table[i], 0, L)
        rebuilt = torch.full_like(whole, float("nan"))
        seen = []
        for s in shards:
            n = int(s.seq_lens[i])
            assert n == sharding.local_seq_lens(s.rank)[i]
            pos = sharding.positions(i, s.rank)
            assert pos.tolist() == list(range(s.rank, L, W))
            rebuilt[pos] = cache_rows(s.kv_cache, s.block_table[i], 0, n)
            seen += pos.tolist()
        assert sorted(seen) == list(range(L))
        assert torch.equal(rebuilt, whole)


def test_sharding_description() -> None:
    sharding = DCPSharding.of([1, 4, 7, 40], 3)
    text = str(sharding)
    assert "3 ranks" in text
    lines = text.splitlines()
    assert lines[-2].split()[:5] == ["2", "7", "3", "2", "2"]  # request 2: 3 + 2 + 2 tokens
    assert "0 1 2 0 1 2 0" in lines[-2]
    assert lines[-1].endswith("...")  # 40 positions are abbreviated
    assert sharding.counts() == [[1, 2, 3, 14], [0, 1, 2, 13], [0, 1, 2, 13]]


def test_plots() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = DCPSharding.of([5, 12], 4).plot()
    assert ax.get_title().startswith("DCP interleaved")
    plan = plan_dcp_context_chunks([5, 0, 13], 2, max_context_chunk=8)
    ax = plan.plot(0)
    assert len(ax.patches) == 2 * plan.seq_tot[0]  # one bar per gathered row
    plt.close("all")


def test_slot_mapping_writes_each_token_once() -> None:
    W, lens = 3, [4, 11]
    table, _ = make_block_table([-(-n // W) for n in lens], 2, seed=0)
    req = torch.tensor([0] * 4 + [1] * 11)
    pos = torch.cat([torch.arange(4), torch.arange(11)])
    slots = torch.stack([dcp_slot_mapping(table, req, pos, 2, W, r) for r in range(W)])
    assert (slots >= 0).sum(0).eq(1).all()  # exactly one owner per token
    assert ((slots >= 0).int().argmax(0) == pos % W).all()


# --- the DCP chunk plan and reorg_kvcache -------------------------------------------------

def local_gather(plan: DCPChunkPlan, c: int, ids: list[torch.Tensor]) -> torch.Tensor:
    """What each rank's gather of chunk ``c`` yields, built here from the placement rule alone:
    rank r, request i, local position p holds global position p·W + r (NaN past the context).
    Returns the all-gathered, rank-major ``[W·toks, 1]`` buffer."""
    W, parts = plan.world_size, []
    for r in range(W):
        for i, ctx in enumerate(plan.origin_context_lens):
            for k in range(plan.cp_chunk_seq_lens[c][i]):
                t = (plan.cp_chunk_starts[c][i] + k) * W + r
                parts.append(ids[i][t] if t < ctx else torch.tensor(float("nan")))
    return torch.stack(parts)[:, None] if parts else torch.zeros(0, 1, dtype=torch.float64)


@given(ctx=st.lists(st.integers(0, 50), min_size=1, max_size=5), W=st.integers(1, 5),
       k=st.integers(1, 6), data=st.data())
def test_reorg_kvcache_properties(ctx: list[int], W: int, k: int, data: st.DataObject) -> None:
    """Rows out = the chunk's rows rebuilt rank-major (request by request, rank 0 first, in
    position order within a rank), count = sum_seq_len, no padding row kept."""
    plan = plan_dcp_context_chunks(ctx, W, max_context_chunk=k * W)
    if plan.num_chunks == 0:
        assert sum(ctx) == 0
        return
    c = data.draw(st.integers(0, plan.num_chunks - 1))
    ids = [torch.arange(n, dtype=torch.float64) + 1000 * (i + 1) for i, n in enumerate(ctx)]
    toks = plan.seq_tot[c]
    # vLLM's metadata: ceil(chunk_len / W) rows per rank, chunk starts c·MCC/W
    for i, n in enumerate(plan.plan.chunk_seq_lens[c]):
        assert plan.cp_chunk_seq_lens[c][i] == -(-n // W)
        assert plan.cp_chunk_starts[c][i] == c * k
    buffer = local_gather(plan, c, ids)
    assert buffer.shape[0] == W * toks
    assert sorted(torch.nonzero(torch.isnan(buffer[:, 0])).flatten().tolist()) \
        == plan.padding_rows(c)
    kv_c, k_pe = reorg_kvcache(buffer, -buffer, list(plan.cp_chunk_seq_lens[c]), ctx, W,
                               sum_seq_len=plan.cu_seq_lens_lst[c][-1],
                               max_seq_len=plan.max_seq_lens[c], chunk_size=k * W,
                               chunk_idx=c, toks=toks)
    expected = []
    for i, n in enumerate(ctx):
        lo, hi = c * k * W, min(n, (c + 1) * k * W)
        for r in range(W):
            expected += [ids[i][t] for t in range(lo, hi) if t % W == r]
    expected_t = torch.stack(expected)[:, None] if expected else torch.zeros(0, 1)
    assert kv_c.shape[0] == plan.plan.seq_tot[c] == sum(plan.plan.chunk_seq_lens[c])
    assert torch.equal(kv_c, expected_t.double())
    assert torch.equal(k_pe, -kv_c)


def test_reorg_kvcache_drops_exactly_the_padding_rows() -> None:
    """Tag every row of the gathered buffer with its index: the output holds each non-padding
    index once and no padding index."""
    ctx, W = [5, 0, 13, 1, 8], 4
    plan = plan_dcp_context_chunks(ctx, W, max_context_chunk=8)
    assert plan.num_chunks == 2
    for c in range(plan.num_chunks):
        toks = plan.seq_tot[c]
        buffer = torch.arange(W * toks, dtype=torch.float64)[:, None, None].expand(-1, 1, 3)
        kv_c, k_pe = reorg_kvcache(buffer, buffer[..., :1], list(plan.cp_chunk_seq_lens[c]),
                                   ctx, W, plan.cu_seq_lens_lst[c][-1], plan.max_seq_lens[c],
                                   plan.chunk_size, c, toks)
        kept = kv_c[:, 0, 0].long().tolist()
        pad = plan.padding_rows(c)
        assert pad  # this layout has padding in both chunks
        assert sorted(kept) == sorted(set(range(W * toks)) - set(pad))
        assert kv_c.shape == (W * toks - len(pad), 1, 3) and k_pe.shape[:2] == kv_c.shape[:2]
    # chunk 0 worked out by hand: every rank gathers 2 + 0 + 2 + 1 + 2 = 7 rows (rank r's block
    # starts at 7r). Request 0 (5 tokens: ranks hold 2, 1, 1, 1) pads row 1 of ranks 1-3;
    # request 3 (1 token: rank 0 only) pads its row 4 on ranks 1-3; requests 2, 4 (8 tokens)
    # hold 2 on every rank.
    assert plan.cp_chunk_seq_lens[0] == (2, 0, 2, 1, 2)
    assert plan.padding_rows(0) == [7 + 1, 7 + 4, 14 + 1, 14 + 4, 21 + 1, 21 + 4]


def test_reorg_kvcache_checks() -> None:
    ctx, W = [5, 3], 2
    plan = plan_dcp_context_chunks(ctx, W, max_context_chunk=4)
    toks = plan.seq_tot[0]
    buf = randn(W * toks, 1, 4, seed=0)
    good = dict(cp_chunk_seq_lens_lst=list(plan.cp_chunk_seq_lens[0]), origin_context_lens=ctx,
                cp_world_size=W, sum_seq_len=plan.cu_seq_lens_lst[0][-1],
                max_seq_len=plan.max_seq_lens[0], chunk_size=4, chunk_idx=0, toks=toks)
    reorg_kvcache(buf, buf, **good)
    bad = [(dict(sum_seq_len=good["sum_seq_len"] + 1), "sum_seq_len"),
           (dict(max_seq_len=good["max_seq_len"] - 1), "max_seq_len"),
           (dict(origin_context_lens=[5]), "one entry per request"),
           (dict(toks=toks + 1), "rows"),
           (dict(cp_world_size=0), "cp_world_size")]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            reorg_kvcache(buf, buf, **{**good, **change})
    with pytest.raises(ValueError, match="allgatered_k_pe"):
        reorg_kvcache(buf, buf[:-1], **good)


def test_dcp_chunk_plan_values_and_description() -> None:
    plan = plan_dcp_context_chunks([0, 5, 19, 1], 2, max_context_chunk=8)
    assert plan.origin_context_lens == (0, 5, 19, 1) and plan.chunk_size == 8
    assert plan.cp_chunk_seq_lens == ((0, 3, 4, 1), (0, 0, 4, 0), (0, 0, 2, 0))
    assert plan.cp_cu_seq_lens[0] == (0, 0, 3, 7, 8)
    assert plan.seq_tot == (8, 4, 2)
    assert plan.cu_seq_lens_lst == plan.plan.cu_seq_lens
    text = str(plan)
    assert "3 chunks" in text and "drops 2 padding" in text and "drops 1 padding" in text
    with pytest.raises(ValueError, match="divisible by world_size=4"):
        plan_dcp_context_chunks([5, 9], 4, max_context_chunk=6)
    with pytest.raises(ValueError, match="divisible by world_size=3"):
        DCPChunkPlan.from_plan(plan.plan, 3)


# --- chunked prefill ----------------------------------------------------------------------

@pytest.mark.parametrize("W", WORLD_SIZES)
def test_dcp_chunked_prefill_attention_equals_single_rank(W: int) -> None:
    ctx = [0, 1, max(W - 1, 1), W, 19, 37]
    new = [3, 1, 4, 2, 5, 1]
    kv_cache, table = random_cache(ctx, seed=20 + W)
    Tn = sum(new)
    q_nope, q_pe = randn(Tn, N, P, seed=1), randn(Tn, N, R, seed=2)
    kv_c, k_pe = randn(Tn, LKV, seed=3), randn(Tn, R, seed=4)
    W_UK, W_UV = randn(LKV, N, P, seed=5) * 0.3, randn(LKV, N, V, seed=6) * 0.3
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    # MCC = W: one local row per rank and chunk (the smallest DCP chunk); W = 1 starts at 4 to
    # keep the chunk count (and the runtime) small, chunk size 1 being test_chunked's business
    for mcc in sorted({W if W > 1 else 4, 8 * W, 48}):  # 48: divisible by every W here
        plan = plan_dcp_context_chunks(ctx, W, max_context_chunk=mcc)
        ref_o, ref_lse = chunked_prefill_attention(q_nope, q_pe, kv_c, k_pe, qsl, kv_cache,
                                                   table, plan.plan, W_UK, W_UV, SCALE)
        parts = run_simulated(W, functools.partial(
            dcp_chunked_prefill_rank, q_nope=q_nope, q_pe=q_pe, kv_c=kv_c, k_pe=k_pe,
            query_start_loc=qsl, kv_cache=kv_cache, block_table=table, plan=plan, W_UK=W_UK,
            W_UV=W_UV, softmax_scale=SCALE))
        # each rank returns its N/W heads: o [T, N/W, V], lse [N/W, T]
        out = torch.cat([o for o, _ in parts], dim=1)
        lse = torch.cat([lse for _, lse in parts], dim=0)
        assert_close(out, ref_o, 1e-10, name=f"o (MCC {mcc})")
        assert_close(lse, ref_lse, 1e-10, name=f"lse (MCC {mcc})")


# --- model level --------------------------------------------------------------------------

@pytest.mark.parametrize("W", WORLD_SIZES)
@pytest.mark.parametrize("s_q", [1, 2])
def test_dcp_decode_forward_equals_decode_forward(W: int, s_q: int) -> None:
    ctx = [0, 1, max(W - 1, 1), W, 13, 37]
    kv_cache, table = filled_cache(ctx, [n + s_q for n in ctx], seed=W)
    hidden = randn(len(ctx), s_q, CONFIG.hidden_size, seed=50 + W)
    seqlens = torch.tensor(ctx, dtype=torch.int32)
    before = kv_cache.clone()
    out = same_on_all_ranks(run_simulated(W, functools.partial(
        dcp_decode_forward_rank, weights=weights(), hidden=hidden, kv_cache=kv_cache,
        block_table=table, cache_seqlens=seqlens)))
    assert torch.equal(kv_cache.nan_to_num(7.0), before.nan_to_num(7.0))  # global untouched
    ref = decode_forward(weights(), hidden, kv_cache, table, seqlens)
    assert_close(out, ref, 1e-10)


@pytest.mark.parametrize("W", WORLD_SIZES)
def test_dcp_chunked_prefill_forward_equals_chunked_prefill_forward(W: int) -> None:
    ctx = [0, 1, max(W - 1, 1), 13, 37]
    new = [3, 1, 4, 2, 5]
    caps = [c + n for c, n in zip(ctx, new)]
    kv_cache, table = filled_cache(ctx, caps, seed=30 + W)
    hidden = randn(sum(new), CONFIG.hidden_size, seed=60 + W)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    for mcc in (W if W > 1 else 4, 24 if 24 % W == 0 else 8 * W):
        plan = plan_dcp_context_chunks(ctx, W, max_context_chunk=mcc)
        out = same_on_all_ranks(run_simulated(W, functools.partial(
            dcp_chunked_prefill_forward_rank, weights=weights(), hidden=hidden,
            query_start_loc=qsl, context_lens=ctx, kv_cache=kv_cache, block_table=table,
            plan=plan)))
        ref = chunked_prefill_forward(weights(), hidden, qsl, ctx, kv_cache.clone(), table,
                                      plan=plan.plan)
        assert_close(out, ref, 1e-10, name=f"out (MCC {mcc})")


def test_dcp_chunked_prefill_forward_default_plan() -> None:
    """Without a plan, vLLM's workspace-derived one (page-aligned chunks: 16 | 2, not 3)."""
    ctx, new = [40, 3], [2, 3]
    kv_cache, table = filled_cache(ctx, [c + n for c, n in zip(ctx, new)], seed=9)
    hidden = randn(sum(new), CONFIG.hidden_size, seed=10)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    program = functools.partial(dcp_chunked_prefill_forward_rank, weights=weights(),
                                hidden=hidden, query_start_loc=qsl, context_lens=ctx,
                                kv_cache=kv_cache, block_table=table, workspace_size=32)
    out = same_on_all_ranks(run_simulated(2, program))
    ref = chunked_prefill_forward(weights(), hidden, qsl, ctx, kv_cache.clone(), table,
                                  workspace_size=32)
    assert_close(out, ref, 1e-10)
    with pytest.raises(ValueError, match="divisible by world_size=3"):
        run_simulated(3, program)
    # a plan made for another number of ranks
    with pytest.raises(ValueError, match="plan is for world_size=2, the communicator has 3"):
        run_simulated(3, functools.partial(
            program, plan=plan_dcp_context_chunks(ctx, 2, max_context_chunk=6)))


# --- the simulated communicator -----------------------------------------------------------

def test_simulated_collectives() -> None:
    W = 3

    def program(comm: SimulatedCommunicator) -> tuple[torch.Tensor, ...]:
        x = torch.arange(12, dtype=torch.float64).view(2, 6) + 100 * comm.rank
        return (comm.rank, comm.all_gather(x, dim=0), comm.all_gather(x, dim=-1),
                comm.reduce_scatter(x, dim=1))

    res = run_simulated(W, program)
    xs = [torch.arange(12, dtype=torch.float64).view(2, 6) + 100 * r for r in range(W)]
    total = xs[0] + xs[1] + xs[2]
    for r, (rank, g0, g1, rs) in enumerate(res):
        assert rank == r
        assert torch.equal(g0, torch.cat(xs, 0)) and torch.equal(g1, torch.cat(xs, 1))
        assert torch.equal(rs, total[:, 2 * r: 2 * r + 2])


def test_simulated_mismatched_shards_raise_on_every_rank() -> None:
    def program(comm: SimulatedCommunicator) -> torch.Tensor:
        return comm.all_gather(torch.zeros(3 + comm.rank, 4))

    with pytest.raises(ValueError, match="rank 1 passed shape \\[4, 4\\] but rank 0 passed"):
        run_simulated(2, program)
    with pytest.raises(ValueError, match="divisible by world_size=3"):
        run_simulated(3, lambda comm: comm.reduce_scatter(torch.zeros(2, 4), dim=0))


def test_simulated_failures_do_not_hang() -> None:
    def one_rank_fails(comm: SimulatedCommunicator) -> torch.Tensor:
        if comm.rank == 2:
            raise RuntimeError("rank 2 broke before the collective")
        return comm.all_gather(torch.zeros(1))

    with pytest.raises(RuntimeError, match="rank 2 broke"):
        run_simulated(4, one_rank_fails, timeout=30.0)

    def one_rank_skips(comm: SimulatedCommunicator) -> torch.Tensor | None:
        return None if comm.rank == 0 else comm.all_gather(torch.zeros(1))

    with pytest.raises(TimeoutError, match="waited more than"):
        run_simulated(2, one_rank_skips, timeout=0.5)
    assert threading.active_count() < 20  # the rank threads are gone


def test_same_on_all_ranks() -> None:
    x = randn(2, 3, seed=0)
    assert torch.equal(same_on_all_ranks(run_simulated(3, lambda comm: x.clone())), x)
    assert torch.equal(same_on_all_ranks([x, x.clone()]), x)
    # a rank whose result differs in one element (its broken twin)
    y = x.clone()
    y[1, 2] += 1e-15
    with pytest.raises(ValueError, match="rank 2's result differs from rank 0's"):
        same_on_all_ranks([x, x.clone(), y])
    with pytest.raises(ValueError, match="one tensor per rank"):
        same_on_all_ranks([])


def test_bad_input() -> None:
    seq = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="world_size must be positive, got 0"):
        dcp_local_seq_lens(seq, 0, 0)
    with pytest.raises(ValueError, match=r"rank must lie in \[0, world_size=2\), got 2"):
        dcp_local_seq_lens(seq, 2, 2)
    with pytest.raises(ValueError, match="rank must lie"):
        dcp_local_seq_lens(seq, 2, -1)
    with pytest.raises(TypeError, match="seq_lens"):
        dcp_local_seq_lens(seq.float(), 2, 0)
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        dcp_local_seq_lens(torch.tensor([-1], dtype=torch.int32), 2, 0)
    with pytest.raises(ValueError, match="world_size must be positive"):
        run_simulated(0, lambda comm: None)
    with pytest.raises(ValueError, match="rank must lie"):
        SimulatedCommunicator(3, 2)
    with pytest.raises(ValueError, match="world_size must be positive"):
        DCPSharding.of([3], 0)
    with pytest.raises(ValueError, match="seq_lens must be ints >= 0"):
        DCPSharding.of([-3], 2)
    kv_cache, table = random_cache([5, 9], seed=0)
    q = randn(2, 1, N, LKV + R, seed=1)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"heads \(24\) must be divisible by world_size=5"):
        simulated_decode(5, q, kv_cache, table, lens, head_dim_v=LKV)
    with pytest.raises(ValueError, match="capacities"):
        shard_kv_cache(kv_cache, table, lens, 2, capacities=[5, 8])
    with pytest.raises(ValueError, match="q must have 4 dims"):
        simulated_decode(2, q[0], kv_cache, table, lens, head_dim_v=LKV)
