"""The fast DCP path (``mla.fast.dcp``) on simulated ranks, against the float64 reference.

Under Triton's interpreter (the rank programs hold ``KERNEL_LOCK`` around their kernels, so
the simulated ranks' threads take turns at the interpreter):

- the correction kernel and ``cp_lse_ag_out_rs``: the conformance catalogue's cases pass on
  mla.fast; ranks without keys (``±inf``, NaN or garbage outputs) add nothing; all ranks
  empty gives 0 / -inf; a NaN lse gives NaN; the sum runs in float32;
- ``local_visible_lens`` against counting, and the global causal positions (a twin that
  applies the causal mask to local positions fails);
- DCP decode for W = 2 and 4 against ``mla_decode_paged`` in float64: s_q 1 to 3 causal,
  s_q 2 not causal, lengths shorter than W (empty ranks), not multiples of W or of the page,
  held to the decode's budget plus the correction's (the merge's);
- the sync-free slot mapping equals the reference's; a decode step reads nothing on the host;
- the forwards from hidden states and the chunked prefill against the single-rank references;
- ``reorg_kvcache`` equals the reference's, row for row, with its errors.

CPU tensors throughout (``needs_interpreter``: skipped on a GPU machine, where the fast DCP
path is checked over NCCL by ``torchrun --nproc-per-node 2 -m mla.fast.dcp.check`` against the
same float64 references).
"""

from __future__ import annotations

import functools

import pytest
import torch
from _interpreter import needs_interpreter

import mla.fast
from mla import MLAWeights, get_config
from mla.compare import TOLERANCES, assert_close, budget, rel_err
from mla.conformance import run as conform
from mla.conformance.catalogue import CATALOGUE
from mla.fast import dcp as fdcp
from mla.fast.dcp.check import decode_budget
from mla.reference import (
    chunked_prefill_attention,
    chunked_prefill_forward,
    decode_forward,
    make_block_table,
    mla_decode_paged,
    write_context,
)
from mla.reference import dcp as rdcp
from mla.reference.dcp import run_simulated

pytestmark = needs_interpreter

N, LKV, R, P, V, BS = 8, 32, 8, 16, 16, 16
SCALE = (P + R) ** -0.5
CONFIG = get_config("tiny").replace(name="tiny-8h", num_heads=N)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


# --- the correction ------------------------------------------------------------------------

def test_correction_passes_the_catalogue_in_bfloat16() -> None:
    """The correction's catalogue cases in bf16 (its rounding on the GPU); in float32 they run
    in ``tests/test_conformance.py`` (``mla conform --target mla.fast``, every kernel) and in
    float16 in ``tests/test_check_broken_twins.py`` (the GPU check's quick cases)."""
    report = conform(mla.fast, kernels=["cp_lse_ag_out_rs"], device="cpu",
                     dtype=torch.bfloat16)
    bad = [(r.case, r.status, r.detail) for r in report.rows if r.status != "pass"]
    n_cases = sum(1 for name in CATALOGUE if name.startswith("cp_lse_ag_out_rs/"))
    assert not bad and len(report.rows) == n_cases >= 12, bad


def _on_ranks(fn, outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    parts = run_simulated(outs.shape[0], lambda comm: fn(outs[comm.rank], lses[comm.rank], comm,
                                                         return_lse=True))
    return torch.cat([o for o, _ in parts], dim=1), torch.cat([lse for _, lse in parts], dim=1)


def test_correction_empty_ranks_and_nan() -> None:
    """Rank 1 has no key of token 0 (+inf, NaN output) and token 1 (-inf, huge garbage);
    no rank has a key of token 2; rank 0's lse of token 3 is NaN."""
    W, T, D = 2, 4, 40
    outs = randn(W, T, N, D, seed=1).float()
    lses = (4 + randn(W, T, N, seed=2)).float()
    lses[1, 0], outs[1, 0] = float("inf"), float("nan")
    lses[1, 1], outs[1, 1] = float("-inf"), 1e30
    lses[:, 2], outs[:, 2] = float("inf"), float("nan")
    lses[0, 3, 2] = float("nan")
    out, lse = _on_ranks(fdcp.cp_lse_ag_out_rs, outs, lses)
    assert torch.equal(out[0], outs[0, 0]) and torch.equal(lse[0], lses[0, 0])  # weight 1
    assert torch.equal(out[1], outs[0, 1])
    assert torch.equal(out[2], torch.zeros(N, D)) and torch.isneginf(lse[2]).all()
    assert torch.isnan(out[3, 2]).all() and torch.isnan(lse[3, 2])
    assert not torch.isnan(out[3, :2]).any() and not torch.isnan(out[3, 3:]).any()
    ref_o, ref_lse = _on_ranks(rdcp.cp_lse_ag_out_rs, outs.double(), lses.double())
    keep = ~torch.isnan(ref_o)
    assert_close(out[keep], ref_o[keep], budget("merge_attn_states", torch.float32, "out_rel"))


def test_correction_sums_in_float32() -> None:
    """Eight bf16 partials of equal weight: their bf16 sum would round eight times; the
    float32 sum rounds once, within the merge's bf16 budget of the float64 result."""
    W, T, D = 8, 6, 64
    outs = randn(W, T, N, D, seed=3).to(torch.bfloat16)
    lses = torch.full((W, T, N), 3.0)
    out, _ = _on_ranks(fdcp.cp_lse_ag_out_rs, outs, lses)
    exact = outs.double().sum(0) / W
    err = rel_err(out, exact)
    bf16_sum = outs.float().div(W).to(torch.bfloat16)
    total = bf16_sum[0]
    for p in bf16_sum[1:]:
        total = total + p
    assert err <= budget("merge_attn_states", torch.bfloat16, "out_rel")
    assert rel_err(total, exact) > 1.5 * err  # the twin that sums bf16 partials is worse


def test_correction_bad_input() -> None:
    comm = rdcp.SimulatedCommunicator(0, 1)
    with pytest.raises(ValueError, match="cp_attn_lse must have shape"):
        fdcp.cp_lse_ag_out_rs(torch.zeros(2, 4, 8), torch.zeros(4, 2), comm)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        fdcp.cp_lse_ag_out_rs(torch.zeros(2, 4, 8, dtype=torch.float64), torch.zeros(2, 4),
                              comm)
    with pytest.raises(ValueError, match="rank must lie in"):
        fdcp.correct_attn_out(torch.zeros(2, 4, 8), torch.zeros(2, 2, 4), 2)


# --- local lengths and global causal positions --------------------------------------------

@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_local_visible_lens_count_positions(W: int) -> None:
    lens = torch.tensor([0, 1, 2, 3, 5, 8, 13, 64, 65], dtype=torch.int32)
    for s_q in (1, 2, 3):
        for r in range(W):
            got = fdcp.local_visible_lens(lens, s_q, W, r, causal=True)
            for b, L in enumerate(lens.tolist()):
                for i in range(s_q):
                    want = sum(1 for t in range(L) if t % W == r and t <= L - s_q + i)
                    assert got[b, i] == want, (W, r, L, s_q, i)
            plain = fdcp.local_visible_lens(lens, s_q, W, r, causal=False)
            assert torch.equal(plain[:, 0], rdcp.dcp_local_seq_lens(lens, W, r))


def mixed_lengths(W: int) -> list[int]:
    """Shorter than W (empty ranks), equal, and not multiples of W or of the page (16)."""
    return sorted({1, W - 1 or 1, W, W + 1, 2 * W + 3, 37, 70})


def fast_decode(W: int, q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor,
                lens: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    parts = run_simulated(W, functools.partial(
        fdcp.dcp_decode_rank, q=q, kv_cache=kv, block_table=table, cache_seqlens=lens,
        softmax_scale=SCALE, causal=causal, head_dim_v=LKV))
    return torch.cat([o for o, _ in parts], dim=2), torch.cat([lse for _, lse in parts], dim=1)


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("s_q,causal", [(1, True), (2, True), (3, True), (2, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dcp_decode_equals_single_rank(W: int, s_q: int, causal: bool,
                                       dtype: torch.dtype) -> None:
    lens = mixed_lengths(W)
    table, nb = make_block_table(lens, BS, spare_blocks=1, seed=W)
    kv = randn(nb, BS, LKV + R, seed=W + 1).to(dtype)
    kv.view(-1, LKV + R)[torch.isin(torch.arange(nb * BS) // BS, table.flatten(), invert=True)
                         ] = float("nan")  # the unused blocks: a wrong read shows
    q = randn(len(lens), s_q, N, LKV + R, seed=W + 2).to(dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    ref_o, ref_lse = mla_decode_paged(q.double(), kv.double(), table, seqlens, SCALE,
                                      causal=causal, head_dim_v=LKV)
    out, lse = fast_decode(W, q, kv, table, seqlens, causal)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, ref_o, decode_budget(dtype, "out_rel"), name="out")
    assert (lse.isinf() == ref_lse.isinf()).all()
    fin = ref_lse.isfinite()
    assert (lse[fin].double() - ref_lse[fin]).abs().max() <= decode_budget(dtype, "lse_abs")


def test_local_causal_mask_twin_fails() -> None:
    """The twin that masks causally on *local* positions (the fast kernel's own causal flag on
    the shard) is off by far more than the budget: the global positions matter."""
    W, s_q = 2, 3
    lens = [5, 37, 70]
    table, nb = make_block_table(lens, BS, spare_blocks=1, seed=9)
    kv = randn(nb, BS, LKV + R, seed=10).float()
    q = randn(len(lens), s_q, N, LKV + R, seed=11).float()
    seqlens = torch.tensor(lens, dtype=torch.int32)
    ref_o, _ = mla_decode_paged(q.double(), kv.double(), table, seqlens, SCALE, causal=True,
                                head_dim_v=LKV)

    def twin(comm: rdcp.Communicator) -> torch.Tensor:
        from mla.fast import mla_decode_paged as fast_paged

        shard = rdcp.shard_kv_cache(kv, table, seqlens, W)[comm.rank]
        local = rdcp.dcp_local_seq_lens(seqlens, W, comm.rank)
        with fdcp.threads.KERNEL_LOCK:
            o, lse = fast_paged(q, shard.kv_cache, shard.block_table, local, SCALE,
                                causal=True, head_dim_v=LKV)
        B = len(lens)
        return fdcp.cp_lse_ag_out_rs(o.reshape(B * s_q, N, LKV),
                                     lse.transpose(1, 2).reshape(B * s_q, N), comm)

    out = torch.cat(run_simulated(W, twin), dim=1).view(len(lens), s_q, N, LKV)
    assert rel_err(out, ref_o) > 100 * decode_budget(torch.float32, "out_rel")


# --- cache writes and host syncs ------------------------------------------------------------

def test_slot_mapping_equals_reference() -> None:
    lens = [3, 17, 40]
    table, _ = make_block_table([n + 4 for n in lens], BS, spare_blocks=1, seed=3)
    req = torch.arange(3).repeat_interleave(4)
    pos = torch.cat([torch.arange(n, n + 4) for n in lens])
    for W in (1, 2, 3, 4):
        local_table, _ = make_block_table([-(-(n + 4) // W) for n in lens], BS, seed=W)
        for r in range(W):
            want = rdcp.dcp_slot_mapping(local_table, req, pos, BS, W, r)
            got = fdcp.dcp_slot_mapping(local_table, req, pos, BS, W, r)
            assert torch.equal(got, want)


def test_decode_step_reads_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``validate=False`` a DCP decode step (s_q = 2, causal: the expanded path) calls
    none of the tensor methods that copy a device value to the host."""
    W, lens = 2, [5, 37]
    table, nb = make_block_table(lens, BS, spare_blocks=1, seed=4)
    kv = randn(nb, BS, LKV + R, seed=5).float()
    seqlens = torch.tensor(lens, dtype=torch.int32)
    shards = rdcp.shard_kv_cache(kv, table, seqlens, W)
    q = randn(2, 2, N, LKV + R, seed=6).float()
    want = fast_decode(W, q, kv, table, seqlens, True)

    def forbidden(*args: object, **kwargs: object) -> object:
        raise AssertionError("a host read of a device value")

    def step(comm: rdcp.Communicator, validate: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
        s = shards[comm.rank]
        h = rdcp.head_slice(N, W, comm.rank)
        return fdcp.dcp_decode(q[:, :, h], s.kv_cache, s.block_table, seqlens, SCALE, comm,
                               causal=True, head_dim_v=LKV, validate=validate)

    for name in ("item", "tolist", "__int__", "__float__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    parts = run_simulated(W, step)
    with pytest.raises(AssertionError, match="host read"):  # the validating twin reads
        run_simulated(W, functools.partial(step, validate=True))
    monkeypatch.undo()
    assert torch.equal(torch.cat([o for o, _ in parts], dim=2), want[0])


# --- from hidden states ----------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def weights() -> MLAWeights:
    return MLAWeights.random(CONFIG, seed=0, dtype=torch.float32)


def filled_cache(contexts: list[int], capacities: list[int], seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    table, nb = make_block_table(capacities, BS, spare_blocks=1, seed=seed)
    kv = torch.full((nb, BS, CONFIG.latent_dim), float("nan"))
    for i, n in enumerate(contexts):
        write_context(weights(), randn(n, CONFIG.hidden_size, seed=seed + 10 + i).float(), kv,
                      table[i])
    return kv, table


@pytest.mark.parametrize("W", [2, 4])
def test_decode_forward_equals_single_rank(W: int) -> None:
    contexts, s_q = [0, 1, 6, 21], 2
    kv, table = filled_cache(contexts, [n + s_q for n in contexts], seed=W)
    hidden = randn(len(contexts), s_q, CONFIG.hidden_size, seed=40).float()
    seqlens = torch.tensor(contexts, dtype=torch.int32)
    w64 = weights().to(dtype=torch.float64)
    ref = decode_forward(w64, hidden.double(), kv.double(), table, seqlens)
    outs = run_simulated(W, functools.partial(
        fdcp.dcp_decode_forward_rank, weights=weights(), hidden=hidden, kv_cache=kv,
        block_table=table, cache_seqlens=seqlens))
    out = rdcp.same_on_all_ranks(outs)
    assert_close(out, ref, TOLERANCES[torch.float32])


@pytest.mark.parametrize("W", [2, 4])
def test_chunked_prefill_equals_single_rank(W: int) -> None:
    ctx, new = [0, 1, 7, 13], [2, 1, 3, 2]
    table, nb = make_block_table(ctx, BS, spare_blocks=1, seed=W + 5)
    kv = randn(nb, BS, LKV + R, seed=3).float()
    Tn = sum(new)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    plan = rdcp.plan_dcp_context_chunks(ctx, W, max_context_chunk=2 * W)
    args = dict(q_nope=randn(Tn, N, P, seed=4), q_pe=randn(Tn, N, R, seed=5),
                kv_c=randn(Tn, LKV, seed=6), k_pe=randn(Tn, R, seed=7),
                W_UK=randn(LKV, N, P, seed=8) * 0.3, W_UV=randn(LKV, N, V, seed=9) * 0.3)
    ref_o, ref_lse = chunked_prefill_attention(
        **args, query_start_loc=qsl, kv_cache=kv.double(), block_table=table, plan=plan.plan,
        softmax_scale=SCALE)
    parts = run_simulated(W, functools.partial(
        fdcp.dcp_chunked_prefill_rank, **{k: v.float() for k, v in args.items()},
        query_start_loc=qsl, kv_cache=kv, block_table=table, plan=plan, softmax_scale=SCALE))
    o = torch.cat([p[0] for p in parts], dim=1)
    lse = torch.cat([p[1] for p in parts], dim=0)
    assert_close(o, ref_o, budget("chunked_prefill_attention", torch.float32, "out_rel"))
    assert (lse.double() - ref_lse).abs().max() <= budget("chunked_prefill_attention",
                                                          torch.float32, "lse_abs_f64")


def test_chunked_prefill_forward_equals_single_rank() -> None:
    W, mctx, pnew = 2, [0, 2, 9], [3, 1, 5]
    kv, table = filled_cache(mctx, [c + n for c, n in zip(mctx, pnew)], seed=50)
    hidden = randn(sum(pnew), CONFIG.hidden_size, seed=31).float()
    qsl = torch.tensor([0, *torch.tensor(pnew).cumsum(0).tolist()], dtype=torch.int32)
    plan = rdcp.plan_dcp_context_chunks(mctx, W, max_context_chunk=W)
    ref = chunked_prefill_forward(weights().to(dtype=torch.float64), hidden.double(), qsl, mctx,
                                  kv.double(), table, plan=plan.plan)
    outs = run_simulated(W, functools.partial(
        fdcp.dcp_chunked_prefill_forward_rank, weights=weights(), hidden=hidden,
        query_start_loc=qsl, context_lens=mctx, kv_cache=kv, block_table=table, plan=plan))
    assert_close(rdcp.same_on_all_ranks(outs), ref, TOLERANCES[torch.float32])


# --- reorg_kvcache -----------------------------------------------------------------------------

@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_reorg_kvcache_equals_reference(W: int) -> None:
    ctx = [0, 1, W - 1, W + 1, 2 * W + 3, 19]
    plan = rdcp.plan_dcp_context_chunks(ctx, W, max_context_chunk=2 * W)
    for c in range(plan.num_chunks):
        toks = plan.seq_tot[c]
        kv_c = randn(W * toks, 1, 5, seed=c)
        k_pe = randn(W * toks, 1, 3, seed=c + 100)
        kw = dict(cp_chunk_seq_lens_lst=list(plan.cp_chunk_seq_lens[c]),
                  origin_context_lens=ctx, cp_world_size=W,
                  sum_seq_len=plan.cu_seq_lens_lst[c][-1], max_seq_len=plan.max_seq_lens[c],
                  chunk_size=plan.chunk_size, chunk_idx=c, toks=toks)
        want = rdcp.reorg_kvcache(kv_c, k_pe, **kw)
        got = fdcp.reorg_kvcache(kv_c, k_pe, **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        bad = {**kw, "sum_seq_len": kw["sum_seq_len"] + 1}
        with pytest.raises(ValueError, match="sum_seq_len"):
            fdcp.reorg_kvcache(kv_c, k_pe, **bad)
        with pytest.raises(ValueError, match="max_seq_len"):
            fdcp.reorg_kvcache(kv_c, k_pe, **{**kw, "max_seq_len": kw["max_seq_len"] + 1})


def test_bad_input_is_refused_by_name() -> None:
    W, lens = 2, [5, 9]
    table, nb = make_block_table(lens, BS, spare_blocks=1, seed=1)
    kv = randn(nb, BS, LKV + R, seed=2).float()
    q = randn(2, 1, N // W, LKV + R, seed=3).float()
    seqlens = torch.tensor(lens, dtype=torch.int32)

    def call(comm: rdcp.Communicator, **change: object) -> object:
        args = dict(q=q, kv_cache=kv, block_table=table, seq_lens=seqlens,
                    softmax_scale=SCALE, comm=comm, head_dim_v=LKV)
        return fdcp.dcp_decode(**{**args, **change})

    comm = rdcp.SimulatedCommunicator(0, 1)
    with pytest.raises(TypeError, match="seq_lens must have dtype"):
        call(comm, seq_lens=seqlens.long())
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        call(comm, q=q.double())
    with pytest.raises(ValueError, match="kv_cache must have shape"):
        call(comm, kv_cache=kv[..., :-1])
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        call(comm, seq_lens=torch.tensor([5, -1], dtype=torch.int32), validate=True)
    with pytest.raises(ValueError, match="head_dim_v must be <="):
        call(comm, head_dim_v=LKV + R + 1)
    # 8 heads do not split over 3 ranks: the reduce-scatter along heads is refused
    with pytest.raises(ValueError, match="divisible by world_size=3"):
        run_simulated(3, lambda c: fdcp.cp_lse_ag_out_rs(torch.zeros(2, N, 4),
                                                         torch.zeros(2, N), c))
    with pytest.raises(ValueError, match="positions must have 1 dims"):
        fdcp.dcp_slot_mapping(table, torch.zeros(2, 1, dtype=torch.long),
                              torch.zeros(2, 1, dtype=torch.long), BS, W, 0)
