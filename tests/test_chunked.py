"""Chunked prefill with cached context (conventions §7): the plan, and the answer it gives.

The plan: vLLM's workspace formula on examples worked by hand, MCC rounded down to whole
pages, ``num_chunks = cdiv(max ctx, MCC)``, prefix sums, and (hypothesis) that the chunks
partition every request's context exactly. The answer: ``chunked_prefill_forward`` equals the
definition on the whole sequence for chunk sizes 1, the block size, odd sizes and sizes past the
context, in a batch that mixes requests with and without context.
"""

from __future__ import annotations

import matplotlib
import pytest
import torch
from _util import (
    CONFIGS,
    DTYPES,
    SMALL,
    check,
    hidden,
    paged_cache,
    randn,
    scale_queries,
    upcast,
    weights,
    write_contexts,
)
from hypothesis import given
from hypothesis import strategies as st

from mla.compare import LSE_ABS_TOL, assert_close
from mla.reference import (
    chunked_prefill_attention,
    chunked_prefill_forward,
    concat_and_cache_mla,
    naive_attention,
    naive_forward,
    plan_context_chunks,
    slot_mapping_from_block_table,
    workspace_size,
)

matplotlib.use("Agg")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------

# W = max(min(max(8·max_model_len, 4·max_num_seqs·block_size), 64·1024), max_num_seqs·block_size)
WORKSPACE_EXAMPLES = [
    # max(32768, 16384) = 32768; min(., 65536) = 32768; max(., 4096) = 32768
    (4096, 256, 16, 32768),
    # max(1310720, 65536) = 1310720; capped at 65536; max(., 16384) = 65536
    (163840, 256, 64, 65536),
    # max(1024, 524288) = 524288; capped at 65536; one page per sequence wins: 2048·64 = 131072
    (128, 2048, 64, 131072),
    # max(800, 128) = 800; min(., 65536) = 800; max(., 32) = 800
    (100, 2, 16, 800),
    # max(80, 4·4·64 = 1024) = 1024; min = 1024; max(., 256) = 1024
    (10, 4, 64, 1024),
]


@pytest.mark.parametrize("max_model_len,max_num_seqs,block_size,expected", WORKSPACE_EXAMPLES)
def test_workspace_size_by_hand(max_model_len: int, max_num_seqs: int, block_size: int,
                                expected: int) -> None:
    assert workspace_size(max_model_len, max_num_seqs, block_size) == expected


def test_plan_by_hand() -> None:
    """Three requests, one without context; W = 100, block 16.

    Two requests have context, so MCC = round_down(100 // 2, 16) = 48; num_chunks =
    cdiv(100, 48) = 3. Request 0 (100 tokens) gets 48, 48, 4; request 2 (37 tokens) 37, 0, 0.
    """
    plan = plan_context_chunks([100, 0, 37], block_size=16, workspace_size=100)
    assert plan.max_context_chunk == 48
    assert plan.num_chunks == 3
    assert plan.chunk_starts == ((0, 0, 0), (48, 48, 48), (96, 96, 96))
    assert plan.chunk_seq_lens == ((48, 0, 37), (48, 0, 0), (4, 0, 0))
    assert plan.cu_seq_lens == ((0, 48, 48, 85), (0, 48, 48, 48), (0, 4, 4, 4))
    assert plan.seq_tot == (85, 48, 4)
    assert plan.max_seq_lens == (48, 48, 4)


def test_plan_no_context_has_no_chunks() -> None:
    plan = plan_context_chunks([0, 0], block_size=16, workspace_size=64)
    assert plan.num_chunks == 0 and plan.seq_tot == ()


@given(lens=st.lists(st.integers(0, 300), min_size=1, max_size=6),
       block_size=st.sampled_from([1, 2, 16, 64]), workspace=st.integers(1, 2000))
def test_mcc_rounds_down_to_pages(lens: list[int], block_size: int, workspace: int) -> None:
    with_context = max(sum(n > 0 for n in lens), 1)
    share = workspace // with_context
    if share < block_size:  # less than a page per request: refused, never silently zero
        with pytest.raises(ValueError):
            plan_context_chunks(lens, block_size=block_size, workspace_size=workspace)
        return
    plan = plan_context_chunks(lens, block_size=block_size, workspace_size=workspace)
    mcc = plan.max_context_chunk
    assert mcc % block_size == 0 and share - block_size < mcc <= share
    assert plan.num_chunks == _cdiv(max(lens), mcc)


@given(lens=st.lists(st.integers(0, 200), min_size=1, max_size=6), mcc=st.integers(1, 250))
def test_chunks_partition_every_context(lens: list[int], mcc: int) -> None:
    plan = plan_context_chunks(lens, max_context_chunk=mcc)
    assert plan.max_context_chunk == mcc
    assert plan.num_chunks == _cdiv(max(lens), mcc)
    for c in range(plan.num_chunks):
        n = plan.chunk_seq_lens[c]
        assert all(0 <= x <= mcc for x in n)
        assert all(s == c * mcc for s in plan.chunk_starts[c])
        prefix = [0]
        for x in n:
            prefix.append(prefix[-1] + x)
        assert list(plan.cu_seq_lens[c]) == prefix
        assert plan.seq_tot[c] == prefix[-1]
    for i, ctx in enumerate(lens):
        covered = []
        for c in range(plan.num_chunks):
            s, n = plan.chunk_starts[c][i], plan.chunk_seq_lens[c][i]
            covered.extend(range(s, s + n))
        assert covered == list(range(ctx))  # every token once, in order
        assert sum(plan.chunk_seq_lens[c][i] for c in range(plan.num_chunks)) == ctx


def test_plan_str_mentions_every_chunk() -> None:
    plan = plan_context_chunks([10, 0, 23], max_context_chunk=8)
    text = str(plan)
    assert plan.num_chunks == 3
    for c in range(plan.num_chunks):
        assert f"chunk {c}:" in text
        for s, n in zip(plan.chunk_starts[c], plan.chunk_seq_lens[c]):
            if n:
                assert f"[{s}, {s + n})" in text
    assert "MCC 8" in text and "[10, 0, 23]" in text


def test_plan_plot() -> None:
    import matplotlib.pyplot as plt

    plan = plan_context_chunks([10, 0, 23, 5], max_context_chunk=8)
    ax = plan.plot()
    try:
        bars = ax.patches
        nonempty = [(c, i) for c in range(plan.num_chunks)
                    for i, n in enumerate(plan.chunk_seq_lens[c]) if n]
        assert len(bars) == len(nonempty) > 0
        widths = sorted(b.get_width() for b in bars)
        assert widths == sorted(plan.chunk_seq_lens[c][i] for c, i in nonempty)
    finally:
        plt.close(ax.figure)


# ---------------------------------------------------------------------------------------------
# the answer: chunked prefill equals the definition
# ---------------------------------------------------------------------------------------------

# a batch mixing requests with and without context; no context length is a page multiple
CTX = [0, 5, 37, 0, 1]
NEW = [3, 1, 4, 2, 1]
BLOCK = 4


def _chunked_case(name: str, dtype: torch.dtype, ctx: list[int], new: list[int],
                  block_size: int, w=None, **plan_kw) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = CONFIGS[name]
    w = weights(name, dtype) if w is None else w
    full = [hidden(cfg, c + n, seed=200 + i, dtype=dtype) for i, (c, n) in enumerate(zip(ctx, new))]
    kv_cache, block_table = paged_cache(cfg, [c + n for c, n in zip(ctx, new)], block_size, dtype)
    write_contexts(w, [h[:c] for h, c in zip(full, ctx)], kv_cache, block_table)
    qsl = torch.tensor([0] + new).cumsum(0)
    if "max_context_chunk" in plan_kw:
        plan_kw = dict(plan=plan_context_chunks(ctx, **plan_kw))
    out = chunked_prefill_forward(w, torch.cat([h[c:] for h, c in zip(full, ctx)]), qsl, ctx,
                                  kv_cache, block_table, **plan_kw)
    assert out.dtype == dtype
    w64 = upcast(w)
    ref = torch.cat([naive_forward(w64, h.double())[c:] for h, c in zip(full, ctx)])
    return out, ref


# chunk sizes: 1, the block size, odd sizes, one past the longest context
MCCS = [1, BLOCK, 3, 7, 38]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("mcc", MCCS)
def test_chunked_prefill_equals_naive(name: str, dtype: torch.dtype, mcc: int) -> None:
    out, ref = _chunked_case(name, dtype, CTX, NEW, BLOCK, max_context_chunk=mcc)
    check(out, ref, f"chunked {name} {dtype} MCC={mcc}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("workspace", [24, 64 * 1024])
def test_chunked_prefill_seed_plan(dtype: torch.dtype, workspace: int) -> None:
    """No plan given: vLLM's plan from the workspace size (24 rows: MCC = round_down(24 // 3,
    4) = 8, five chunks for 37 tokens; 64K: one chunk)."""
    out, ref = _chunked_case("tiny", dtype, CTX, NEW, BLOCK, workspace_size=workspace)
    check(out, ref, f"chunked seed plan W={workspace} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mcc", [1, 16, 45])
def test_chunked_prefill_v2_lite(dtype: torch.dtype, mcc: int) -> None:
    out, ref = _chunked_case("deepseek-v2-lite", dtype, [0, 19, 3], [2, 3, 1], 16,
                             max_context_chunk=mcc)
    check(out, ref, f"chunked deepseek-v2-lite {dtype} MCC={mcc}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_chunked_prefill_logits_x30(dtype: torch.dtype) -> None:
    w = scale_queries(weights("tiny", dtype), 30.0)
    out, ref = _chunked_case("tiny", dtype, CTX, NEW, BLOCK, w=w, max_context_chunk=3)
    check(out, ref, f"chunked logits x30 {dtype}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("mcc", [1, 5, 16])
def test_chunked_attention_dominant_key_and_lse(dtype: torch.dtype, mcc: int) -> None:
    """Attention level, random latents: one context key far above everything else sits in an
    early chunk, so the merge must let it win; o equals the definition, and lse equals the
    logsumexp of all logits computed here."""
    cfg = CONFIGS["tiny"]
    w = weights("tiny", dtype)
    N, P, R, L = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    ctx, new = [23, 0, 9], [4, 3, 1]
    T = sum(new)
    u = torch.nn.functional.normalize(randn(R, seed=30), dim=0)
    q_nope, q_pe = randn(T, N, P, seed=31), randn(T, N, R, seed=32) + 6 * u
    kv_c_ctx = [randn(c, L, seed=33 + i) for i, c in enumerate(ctx)]
    k_pe_ctx = [randn(c, R, seed=36 + i) for i, c in enumerate(ctx)]
    k_pe_ctx[0][2] += 12 * u  # the dominant key: request 0, context token 2 (the first chunk)
    kv_c_new, k_pe_new = randn(T, L, seed=40), randn(T, R, seed=41)
    kv_cache, block_table = paged_cache(cfg, [c + n for c, n in zip(ctx, new)], BLOCK, dtype)
    for i, c in enumerate(ctx):
        slots = slot_mapping_from_block_table(block_table, torch.full((c,), i), torch.arange(c),
                                              BLOCK)
        concat_and_cache_mla(kv_c_ctx[i].to(dtype), k_pe_ctx[i].to(dtype), kv_cache, slots)
    qsl = torch.tensor([0] + new).cumsum(0)
    plan = plan_context_chunks(ctx, max_context_chunk=mcc)
    o, lse = chunked_prefill_attention(
        q_nope.to(dtype), q_pe.to(dtype), kv_c_new.to(dtype), k_pe_new.to(dtype), qsl, kv_cache,
        block_table, plan, w.W_UK, w.W_UV, cfg.softmax_scale)

    w64 = upcast(w)
    o_ref, lse_ref = [], []
    for i, (c, n) in enumerate(zip(ctx, new)):
        sl = slice(int(qsl[i]), int(qsl[i + 1]))
        kv_c = torch.cat([kv_c_ctx[i], kv_c_new[sl]])
        k_pe = torch.cat([k_pe_ctx[i], k_pe_new[sl]])
        k = torch.cat([torch.einsum("tl,lnp->tnp", kv_c, w64.W_UK),
                       k_pe[:, None].expand(c + n, N, R)], -1)
        v = torch.einsum("tl,lnv->tnv", kv_c, w64.W_UV)
        q = torch.cat([q_nope[sl], q_pe[sl]], -1)
        q_pos, k_pos = torch.arange(c, c + n), torch.arange(c + n)
        o_ref.append(naive_attention(q, k, v, cfg.softmax_scale, q_pos, k_pos))
        s = torch.einsum("snd,tnd->nst", q, k) * cfg.softmax_scale
        s = s.masked_fill(~(k_pos[None] <= q_pos[:, None]), float("-inf"))
        lse_ref.append(torch.logsumexp(s, -1))
        if i == 0:
            assert torch.exp(s[..., 2] - lse_ref[-1]).min() > 0.99, "the key is not dominant"
    check(o, torch.cat(o_ref), f"chunked attention {dtype} MCC={mcc}")
    lse_ref = torch.cat(lse_ref, dim=1)
    if dtype == torch.float64:
        assert_close(lse, lse_ref, name="lse")
    else:
        assert_close(lse, lse_ref, abs_tol=LSE_ABS_TOL, name="lse")
