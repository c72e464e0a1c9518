"""DCP on real ``torch.distributed`` process groups (gloo, CPU) gives the simulation's tensors.

One spawn per world size (2 and 3 ranks) runs every rank program of ``mla.reference.dcp``
(kernel-level decode, kernel-level chunked prefill, both model-level paths) through
``ProcessGroupCommunicator``, plus the collectives and a mismatched-shape error; the results
are compared with ``run_simulated`` on the same inputs (bitwise for the all-gathers; to 1e-12
where gloo's reduction order may differ) and with the single-rank reference. The ``--check``
script runs under ``torchrun``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mla import MLAWeights, get_config
from mla.check.dcp import run_all, run_process_group
from mla.compare import assert_close
from mla.reference import chunked_prefill_forward, decode_forward, make_block_table, write_context
from mla.reference.dcp import (
    Communicator,
    ProcessGroupCommunicator,
    dcp_chunked_prefill_forward_rank,
    dcp_chunked_prefill_rank,
    dcp_decode_forward_rank,
    dcp_decode_rank,
    plan_dcp_context_chunks,
    run_simulated,
)

pytestmark = pytest.mark.skipif(not torch.distributed.is_available()
                                or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

ROOT = Path(__file__).resolve().parents[1]
N, LKV, R, P, V, BS = 6, 32, 8, 16, 16, 4  # 6 heads: divisible by 2 and 3
SCALE = (P + R) ** -0.5
CONFIG = get_config("tiny").replace(name="tiny-6h", num_heads=N)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


# rank programs defined here must be module-level: the spawned ranks import them by name
def collectives(comm: Communicator) -> tuple[torch.Tensor, ...]:
    x = randn(2, 6, 3, seed=comm.rank)
    return comm.all_gather(x, dim=0), comm.all_gather(x, dim=1), comm.reduce_scatter(x, dim=1)


def mismatched_all_gather(comm: Communicator) -> str:
    """Shards of different lengths: every rank must get the same ValueError, not a hang."""
    try:
        comm.all_gather(torch.zeros(3 + comm.rank, 2))
    except ValueError as e:
        return str(e)
    return "no error"


def jobs(W: int) -> tuple[list[functools.partial], list[tuple[str, object]]]:
    """Rank programs (global inputs bound) and, for each, its single-rank reference."""
    # kernel-level decode: a mixed batch, one request shorter than W
    lens = [1, W, 2 * W + 1, 11]
    table, nb = make_block_table(lens, BS, spare_blocks=1, seed=W)
    kv_cache = randn(nb, BS, LKV + R, seed=1)
    q = randn(len(lens), 2, N, LKV + R, seed=2)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    decode = functools.partial(dcp_decode_rank, q=q, kv_cache=kv_cache, block_table=table,
                               cache_seqlens=seqlens, softmax_scale=SCALE, causal=True,
                               head_dim_v=LKV)
    # kernel-level chunked prefill
    ctx, new = [0, 1, 7, 13], [2, 1, 3, 2]
    ctable, cnb = make_block_table(ctx, BS, spare_blocks=1, seed=W + 1)
    ckv = randn(cnb, BS, LKV + R, seed=3)
    Tn = sum(new)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    plan = plan_dcp_context_chunks(ctx, W, max_context_chunk=2 * W)
    prefill = functools.partial(
        dcp_chunked_prefill_rank, q_nope=randn(Tn, N, P, seed=4), q_pe=randn(Tn, N, R, seed=5),
        kv_c=randn(Tn, LKV, seed=6), k_pe=randn(Tn, R, seed=7), query_start_loc=qsl,
        kv_cache=ckv, block_table=ctable, plan=plan, W_UK=randn(LKV, N, P, seed=8) * 0.3,
        W_UV=randn(LKV, N, V, seed=9) * 0.3, softmax_scale=SCALE)
    # model level, from hidden states
    w = MLAWeights.random(CONFIG, seed=0, dtype=torch.float64)
    mctx, s_q = [0, 2, 9], 2
    mtable, mnb = make_block_table([n + 5 for n in mctx], BS, spare_blocks=1, seed=W + 2)
    mkv = torch.full((mnb, BS, CONFIG.latent_dim), float("nan"), dtype=torch.float64)
    for i, n in enumerate(mctx):
        write_context(w, randn(n, CONFIG.hidden_size, seed=20 + i), mkv, mtable[i])
    hid = randn(len(mctx), s_q, CONFIG.hidden_size, seed=30)
    mseq = torch.tensor(mctx, dtype=torch.int32)
    model_decode = functools.partial(dcp_decode_forward_rank, weights=w, hidden=hid,
                                     kv_cache=mkv, block_table=mtable, cache_seqlens=mseq)
    pnew = [3, 1, 5]
    phid = randn(sum(pnew), CONFIG.hidden_size, seed=31)
    pqsl = torch.tensor([0, *torch.tensor(pnew).cumsum(0).tolist()], dtype=torch.int32)
    pplan = plan_dcp_context_chunks(mctx, W, max_context_chunk=W)
    model_prefill = functools.partial(dcp_chunked_prefill_forward_rank, weights=w,
                                      hidden=phid, query_start_loc=pqsl, context_lens=mctx,
                                      kv_cache=mkv, block_table=mtable, plan=pplan)
    refs = [
        ("decode", None),  # compared with the simulation only (test_dcp covers the rest)
        ("prefill", None),
        ("model decode", decode_forward(w, hid, mkv.clone(), mtable, mseq)),
        ("model prefill", chunked_prefill_forward(w, phid, pqsl, mctx, mkv.clone(), mtable,
                                                  plan=pplan.plan)),
    ]
    return [decode, prefill, model_decode, model_prefill], refs


def flatten(x: object) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in flatten(item)]  # type: ignore[union-attr]


@pytest.mark.parametrize("W", [2, 3])
def test_process_group_equals_simulation(W: int) -> None:
    programs, refs = jobs(W)
    everything = [collectives, mismatched_all_gather, *programs]
    real = run_process_group(W, functools.partial(run_all, fns=everything), timeout=120.0)
    sim = run_simulated(W, functools.partial(run_all, fns=[collectives, *programs]))
    assert len(real) == W
    for r in range(W):
        real_r, sim_r = real[r], sim[r]
        msg = real_r.pop(1)
        assert "all_gather: rank 1 passed shape [4, 2] but rank 0 passed [3, 2]" in msg
        assert len(real_r) == len(sim_r)
        for k, (got, want) in enumerate(zip(real_r, sim_r)):
            got_t, want_t = flatten(got), flatten(want)
            assert len(got_t) == len(want_t)
            for t_got, t_want in zip(got_t, want_t):
                assert t_got.dtype == t_want.dtype
                assert_close(t_got, t_want, 1e-12, name=f"rank {r}, program {k}")
        # the all-gathers only move bytes: bitwise equal to the simulation's
        g0, g1, _ = real_r[0]
        s0, s1, _ = sim_r[0]
        assert torch.equal(g0, s0) and torch.equal(g1, s1)
    # the model-level outputs: identical on every rank, and equal to the single-rank paths
    for k, (name, ref) in enumerate(refs):
        if ref is None:
            continue
        outs = [real[r][1 + k] for r in range(W)]
        assert all(torch.equal(o, outs[0]) for o in outs), name
        assert_close(outs[0], ref, 1e-10, name=name)


def test_communicator_needs_a_process_group() -> None:
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="initialized process group"):
        ProcessGroupCommunicator()


def test_run_process_group_reraises_a_rank_error() -> None:
    from torch.multiprocessing import ProcessRaisedException

    with pytest.raises(ProcessRaisedException, match="ValueError"):
        run_process_group(2, functools.partial(dcp_decode_rank, q=randn(1, 1, 4, 6, seed=0),
                                               kv_cache=randn(2, 4, 6, seed=1),
                                               block_table=torch.zeros(1, 1, dtype=torch.int32),
                                               cache_seqlens=torch.tensor([3], dtype=torch.int32),
                                               softmax_scale=SCALE, head_dim_v=9),
                          timeout=60.0)


def test_check_script_under_torchrun(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 -m mla.check.dcp --check --backend gloo`` (tiny shapes)."""
    out = tmp_path / "dcp.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "mla.check.dcp", "--check", "--backend", "gloo", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["passed"] and result["world_size"] == 2 and result["backend"] == "gloo"
    assert result["torch"] == torch.__version__ and result["date"]
    names = [c["case"] for c in result["cases"]]
    assert any("decode kernel" in n for n in names) and any("chunked prefill" in n for n in names)
    for case in result["cases"]:
        assert case["rel_err"] <= case["tolerance"], case
        assert case.get("ranks_agree", True)
