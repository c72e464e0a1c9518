"""The fast DCP path on real ``torch.distributed`` process groups (gloo, CPU, Triton's
interpreter) gives the simulation's tensors and the single-rank references' numbers.

One spawn per world size (2 and 4 ranks) runs the rank programs of ``mla.fast.dcp``: decode
(s_q 1 and 3 causal, lengths shorter than W and not multiples of W or of the page), the
correction with empty ranks and a NaN lse, chunked prefill, and both forwards from hidden
states; each once through ``ProcessGroupCommunicator`` and the decode again through
``CapturableCommunicator`` (the same collectives without the shape exchange: bitwise the
same, as are both communicators' all-gathers and reduce-scatters along every dim). The results
are compared with ``run_simulated`` (to float32 rounding: gloo may add the ranks' partials in
another order) and with the float64 references (the budgets of tests/test_fast_dcp.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
from _interpreter import needs_interpreter

from mla import MLAWeights, get_config
from mla.check.dcp import run_all, run_process_group
from mla.compare import TOLERANCES, assert_close, budget, rel_err
from mla.fast import dcp as fdcp
from mla.fast.dcp.check import decode_budget
from mla.reference import (
    chunked_prefill_forward,
    decode_forward,
    make_block_table,
    mla_decode_paged,
    write_context,
)
from mla.reference import dcp as rdcp
from mla.reference.dcp import Communicator, run_simulated

pytestmark = [needs_interpreter,
              pytest.mark.skipif(not torch.distributed.is_available()
                                 or not torch.distributed.is_gloo_available(),
                                 reason="torch.distributed with gloo is not available")]

N, LKV, R, P, V, BS = 8, 32, 8, 16, 16, 4  # 8 heads: divisible by 2 and 4
SCALE = (P + R) ** -0.5
CONFIG = get_config("tiny").replace(name="tiny-8h", num_heads=N)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


# rank programs defined here must be module-level: the spawned ranks import them by name
def on_capturable(comm: Communicator, fn: functools.partial) -> object:
    """``fn`` through a ``CapturableCommunicator`` over the same (default) group."""
    return fn(fdcp.CapturableCommunicator())


def both_communicators(comm: Communicator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every dim's all-gather and reduce-scatter through the reference's communicator and
    through ``CapturableCommunicator``: pairs that must be bitwise equal."""
    cap = fdcp.CapturableCommunicator()
    x = randn(4, 8, 12, seed=comm.rank).float()  # every dim divisible by 2 and 4
    pairs = []
    for dim in (0, 1, 2, -2):
        pairs.append((comm.all_gather(x, dim=dim), cap.all_gather(x, dim=dim)))
        pairs.append((comm.reduce_scatter(x, dim=dim),
                      cap.reduce_scatter(x, dim=dim)))
    return pairs


def correction(comm: Communicator, outs: torch.Tensor, lses: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    return fdcp.cp_lse_ag_out_rs(outs[comm.rank], lses[comm.rank], comm, return_lse=True)


def jobs(W: int) -> tuple[list[functools.partial], dict[str, object]]:
    """Rank programs (global inputs bound) and what the checks need to build references."""
    lens = [1, W - 1, 2 * W + 1, 11]  # empty ranks; not multiples of W or of the page (4)
    table, nb = make_block_table(lens, BS, spare_blocks=1, seed=W)
    kv = randn(nb, BS, LKV + R, seed=1).float()
    seqlens = torch.tensor(lens, dtype=torch.int32)
    q3 = randn(len(lens), 3, N, LKV + R, seed=2).float()
    q1 = q3[:, :1].contiguous()
    dec = functools.partial(fdcp.dcp_decode_rank, kv_cache=kv, block_table=table,
                            cache_seqlens=seqlens, softmax_scale=SCALE, causal=True,
                            head_dim_v=LKV)
    # the correction: token 0 on rank 1 and token 2 everywhere without keys, one NaN lse
    outs = randn(W, 4, N, 24, seed=3).float()
    lses = (4 + randn(W, 4, N, seed=4)).float()
    lses[1, 0], outs[1, 0] = float("inf"), float("nan")
    lses[:, 2] = float("-inf")
    lses[0, 3, 1] = float("nan")
    # chunked prefill, kernel level
    ctx, new = [0, 1, 7, 13], [2, 1, 3, 2]
    ctable, cnb = make_block_table(ctx, BS, spare_blocks=1, seed=W + 1)
    ckv = randn(cnb, BS, LKV + R, seed=5).float()
    Tn = sum(new)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    plan = rdcp.plan_dcp_context_chunks(ctx, W, max_context_chunk=2 * W)
    pargs = dict(q_nope=randn(Tn, N, P, seed=6), q_pe=randn(Tn, N, R, seed=7),
                 kv_c=randn(Tn, LKV, seed=8), k_pe=randn(Tn, R, seed=9),
                 W_UK=randn(LKV, N, P, seed=10) * 0.3, W_UV=randn(LKV, N, V, seed=11) * 0.3)
    prefill = functools.partial(fdcp.dcp_chunked_prefill_rank,
                                **{k: v.float() for k, v in pargs.items()},
                                query_start_loc=qsl, kv_cache=ckv, block_table=ctable,
                                plan=plan, softmax_scale=SCALE)
    # from hidden states
    w = MLAWeights.random(CONFIG, seed=0, dtype=torch.float32)
    mctx, s_q = [0, 2, 9], 2
    mtable, mnb = make_block_table([n + 5 for n in mctx], BS, spare_blocks=1, seed=W + 2)
    mkv = torch.full((mnb, BS, CONFIG.latent_dim), float("nan"))
    for i, n in enumerate(mctx):
        write_context(w, randn(n, CONFIG.hidden_size, seed=20 + i).float(), mkv, mtable[i])
    hid = randn(len(mctx), s_q, CONFIG.hidden_size, seed=30).float()
    mseq = torch.tensor(mctx, dtype=torch.int32)
    pnew = [3, 1, 5]
    phid = randn(sum(pnew), CONFIG.hidden_size, seed=31).float()
    pqsl = torch.tensor([0, *torch.tensor(pnew).cumsum(0).tolist()], dtype=torch.int32)
    pplan = rdcp.plan_dcp_context_chunks(mctx, W, max_context_chunk=W)
    programs = [
        functools.partial(dec, q=q1), functools.partial(dec, q=q3),
        functools.partial(on_capturable, fn=functools.partial(dec, q=q3)),
        functools.partial(correction, outs=outs, lses=lses),
        prefill,
        functools.partial(fdcp.dcp_decode_forward_rank, weights=w, hidden=hid, kv_cache=mkv,
                          block_table=mtable, cache_seqlens=mseq),
        functools.partial(fdcp.dcp_chunked_prefill_forward_rank, weights=w, hidden=phid,
                          query_start_loc=pqsl, context_lens=mctx, kv_cache=mkv,
                          block_table=mtable, plan=pplan),
    ]
    refs = {
        "decode s_q=1": mla_decode_paged(q1.double(), kv.double(), table, seqlens, SCALE,
                                         causal=True, head_dim_v=LKV),
        "decode s_q=3": mla_decode_paged(q3.double(), kv.double(), table, seqlens, SCALE,
                                         causal=True, head_dim_v=LKV),
        # the reference in float64, and in float32 (the conformance catalogue's float32
        # limit: the merge's budget or twice the reference's own float32 error)
        "correction": [run_simulated(W, lambda comm, dt=dt: rdcp.cp_lse_ag_out_rs(
            outs[comm.rank].to(dt), lses[comm.rank].to(dt), comm, return_lse=True))
            for dt in (torch.float64, torch.float32)],
        "model decode": decode_forward(w.to(dtype=torch.float64), hid.double(), mkv.double(),
                                       mtable, mseq),
        "model prefill": chunked_prefill_forward(w.to(dtype=torch.float64), phid.double(), pqsl,
                                                 mctx, mkv.double(), mtable, plan=pplan.plan),
    }
    return programs, refs


def flatten(x: object) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in flatten(item)]  # type: ignore[union-attr]


def joined(results: list[object], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Program ``k``'s ``(out, lse)`` of every rank, joined along the heads."""
    outs = [r[k][0] for r in results]  # type: ignore[index]
    lses = [r[k][1] for r in results]  # type: ignore[index]
    return torch.cat(outs, dim=2), torch.cat(lses, dim=1)


@pytest.mark.parametrize("W", [2, 4])
def test_process_group_equals_simulation_and_reference(W: int) -> None:
    programs, refs = jobs(W)
    real = run_process_group(W, functools.partial(run_all, fns=[*programs, both_communicators]),
                             timeout=300.0)
    for r in range(W):
        for k, (ref, cap) in enumerate(real[r].pop()):
            assert torch.equal(ref, cap), (r, k)
    sim = run_simulated(W, functools.partial(run_all, fns=programs[:2] + programs[3:]))
    sim = [s[:2] + [s[1]] + s[2:] for s in sim]  # the capturable run is the s_q=3 decode's
    for r in range(W):
        for k, (got, want) in enumerate(zip(real[r], sim[r])):
            for t_got, t_want in zip(flatten(got), flatten(want), strict=True):
                assert t_got.dtype == t_want.dtype
                nan = torch.isnan(t_want)  # the correction's NaN lse: NaN at the same places
                assert torch.equal(torch.isnan(t_got), nan)
                assert_close(t_got[~nan], t_want[~nan], 1e-6, name=f"rank {r}, program {k}")
        # the capturable communicator issues the same collectives: bitwise the same
        assert all(torch.equal(a, b) for a, b in zip(real[r][1], real[r][2]))
    for k, name in ((0, "decode s_q=1"), (1, "decode s_q=3")):
        out, lse = joined(real, k)
        ref_o, ref_lse = refs[name]  # type: ignore[misc]
        assert_close(out, ref_o, decode_budget(torch.float32, "out_rel"), name=name)
        fin = ref_lse.isfinite()
        assert (lse.isinf() == ref_lse.isinf()).all()
        assert (lse[fin].double() - ref_lse[fin]).abs().max() <= decode_budget(
            torch.float32, "lse_abs")
    # the correction: the NaN stays NaN, the rest within the merge's budget
    out = torch.cat([real[r][3][0] for r in range(W)], dim=1)
    ref_o, ref32 = (torch.cat([p[0] for p in parts], dim=1)
                    for parts in refs["correction"])  # type: ignore[union-attr]
    assert torch.isnan(out).equal(torch.isnan(ref_o)) and torch.isnan(out[3, 1]).all()
    keep = ~torch.isnan(ref_o)
    limit = max(budget("merge_attn_states", torch.float32, "out_rel"),
                2 * rel_err(ref32[keep], ref_o[keep]))
    assert_close(out[keep], ref_o[keep], limit)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    for k, name in ((5, "model decode"), (6, "model prefill")):
        outs = [real[r][k] for r in range(W)]
        assert all(torch.equal(o, outs[0]) for o in outs), name
        assert_close(outs[0], refs[name], TOLERANCES[torch.float32], name=name)
