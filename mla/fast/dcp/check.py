"""The fast DCP path on a real process group (NCCL on GPUs), against the float64 reference.

    torchrun --nproc-per-node 2 -m mla.fast.dcp.check --out dcp_fast_nccl.json

Each rank runs, through ``CapturableCommunicator``:

- DCP decode (``dcp_decode_rank``), N = 16 and 128, s_q 1 to 3 causal, lengths 1, 63, 1000,
  3001 on pages of 64, against ``mla.reference.mla_decode_paged`` in float64 on the same
  (upcast) inputs. Budget: the local decode's (``mla_decode_paged``'s) plus the correction's
  (``merge_attn_states``'s), per quantity: the partials carry the decode's error, and the
  correction adds the merge's arithmetic (a float32 exp-weighted sum, one rounding);
- the same decode step captured in a CUDA graph (``validate=False``) and replayed: bitwise
  the eager result;
- DCP decode and chunked prefill from hidden states (DeepSeek-V2-Lite) against the float64
  reference forwards, held to the model-level tolerances of ``mla.compare.TOLERANCES`` (as
  ``mla.check.dcp`` holds the reference's DCP).

Rank 0 prints a table and writes GPU, versions, date and errors as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from mla.compare import TOLERANCES, budget, max_abs_err, rel_err
from mla.config import get_config
from mla.fast.dcp.comm import CapturableCommunicator
from mla.fast.dcp.decode import dcp_decode, dcp_decode_rank
from mla.fast.dcp.model import dcp_chunked_prefill_forward_rank, dcp_decode_forward_rank
from mla.reference.dcp import Communicator, head_slice, plan_dcp_context_chunks, shard_kv_cache
from mla.reference.decode import mla_decode_paged
from mla.reference.model import chunked_prefill_forward, decode_forward, write_context
from mla.reference.paged_cache import make_block_table
from mla.weights import MLAWeights

__all__ = ["decode_budget", "run_check", "main"]


def decode_budget(dtype: torch.dtype, quantity: str) -> float:
    """The fast DCP decode's budget: the local decode's plus the correction's (the merge's)."""
    return budget("mla_decode_paged", dtype, quantity) + budget("merge_attn_states", dtype,
                                                                quantity)


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _decode_case(comm: Communicator, dev: torch.device, dtype: torch.dtype, heads: int,
                 s_q: int, seed: int) -> dict[str, object]:
    lens, bs, Lkv, R = (1, 63, 1000, 3001), 64, 512, 64
    gen = torch.Generator().manual_seed(seed)
    table, nb = make_block_table(list(lens), bs, spare_blocks=1, seed=seed)
    kv = _randn(gen, nb, bs, Lkv + R).to(dtype)
    q = _randn(gen, len(lens), s_q, heads, Lkv + R).to(dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    scale = 192 ** -0.5
    ref_o, ref_lse = mla_decode_paged(q.to(dev, torch.float64), kv.to(dev, torch.float64),
                                      table.to(dev), seqlens.to(dev), scale, causal=True,
                                      head_dim_v=Lkv)
    h = head_slice(heads, comm.world_size, comm.rank)
    t0 = time.perf_counter()
    out, lse = dcp_decode_rank(comm, q.to(dev), kv.to(dev), table.to(dev), seqlens.to(dev),
                               scale, causal=True, head_dim_v=Lkv)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return {"rel_err": rel_err(out, ref_o[:, :, h]),
            "lse_max_abs_err": max_abs_err(lse, ref_lse[:, h]),
            "tolerance": decode_budget(dtype, "out_rel"),
            "lse_tolerance": decode_budget(dtype, "lse_abs"),
            "seconds": time.perf_counter() - t0}


def _graph_case(comm: Communicator, dev: torch.device) -> dict[str, object]:
    """The decode step captured in a CUDA graph equals the eager step, bitwise."""
    lens, bs, heads = (5, 700, 3001), 64, 128
    gen = torch.Generator().manual_seed(7)
    table, nb = make_block_table(list(lens), bs, spare_blocks=1, seed=7)
    kv = _randn(gen, nb, bs, 576).to(torch.bfloat16).to(dev)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=dev)
    shard = shard_kv_cache(kv, table.to(dev), seqlens, comm.world_size)[comm.rank]
    n = heads // comm.world_size
    q = _randn(gen, len(lens), 1, heads, 576).to(torch.bfloat16)[:, :, :n].contiguous().to(dev)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        return dcp_decode(q, shard.kv_cache, shard.block_table, seqlens, 192 ** -0.5, comm,
                          causal=True, validate=False)

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: NCCL's watchdog thread polls its events while this one captures
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        captured = step()
    graph.replay()
    torch.cuda.synchronize(dev)
    same = all(torch.equal(a, b) for a, b in zip(eager, captured))
    return {"rel_err": 0.0 if same else float("inf"), "tolerance": 0.0, "seconds": 0.0,
            "graph_equals_eager": same}


def _filled(weights: MLAWeights, contexts: Sequence[int], caps: Sequence[int], gen:
            torch.Generator, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    c = weights.config
    table, nb = make_block_table(list(caps), 64, spare_blocks=1, device=dev)
    kv = torch.full((nb, 64, c.latent_dim), float("nan"), dtype=weights.dtype, device=dev)
    for i, n in enumerate(contexts):
        write_context(weights, _randn(gen, n, c.hidden_size).to(dev, weights.dtype), kv,
                      table[i])
    return kv, table


def _model_decode_case(comm: Communicator, dev: torch.device, dtype: torch.dtype, s_q: int
                       ) -> dict[str, object]:
    cfg, contexts = get_config("deepseek-v2-lite"), (0, 1, 700, 2500)
    gen = torch.Generator().manual_seed(2)
    w = MLAWeights.random(cfg, seed=2, dtype=dtype, device=dev)
    kv, table = _filled(w, contexts, [n + s_q for n in contexts], gen, dev)
    hidden = _randn(gen, len(contexts), s_q, cfg.hidden_size).to(dev, dtype)
    seqlens = torch.tensor(contexts, dtype=torch.int32, device=dev)
    ref = decode_forward(w.to(dtype=torch.float64), hidden.double(), kv.double(), table, seqlens)
    t0 = time.perf_counter()
    out = dcp_decode_forward_rank(comm, w, hidden, kv, table, seqlens)
    return {"rel_err": rel_err(out, ref), "tolerance": TOLERANCES[dtype],
            "seconds": time.perf_counter() - t0}


def _model_prefill_case(comm: Communicator, dev: torch.device, dtype: torch.dtype
                        ) -> dict[str, object]:
    cfg, contexts, new = get_config("deepseek-v2-lite"), (0, 1, 700, 2500), (5, 3, 17, 64)
    gen = torch.Generator().manual_seed(3)
    w = MLAWeights.random(cfg, seed=3, dtype=dtype, device=dev)
    kv, table = _filled(w, contexts, [c + n for c, n in zip(contexts, new)], gen, dev)
    hidden = _randn(gen, sum(new), cfg.hidden_size).to(dev, dtype)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32,
                       device=dev)
    plan = plan_dcp_context_chunks(list(contexts), comm.world_size, max_context_chunk=1024)
    ref = chunked_prefill_forward(w.to(dtype=torch.float64), hidden.double(), qsl,
                                  list(contexts), kv.double(), table, plan=plan.plan)
    t0 = time.perf_counter()
    out = dcp_chunked_prefill_forward_rank(comm, w, hidden, qsl, list(contexts), kv, table,
                                           plan=plan)
    return {"rel_err": rel_err(out, ref), "tolerance": TOLERANCES[dtype],
            "seconds": time.perf_counter() - t0}


def run_check(comm: Communicator, dev: torch.device) -> list[dict[str, object]]:
    """Every case on this rank; errors maxed over the ranks."""
    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        dt = str(dtype).removeprefix("torch.")
        for heads in (16, 128):
            for s_q in (1, 2, 3):
                cases.append((f"decode N={heads} s_q={s_q} causal {dt}",
                              lambda d=dtype, h=heads, s=s_q: _decode_case(comm, dev, d, h, s,
                                                                           1)))
        for s_q in (1, 2):
            cases.append((f"model decode v2-lite s_q={s_q} {dt}",
                          lambda d=dtype, s=s_q: _model_decode_case(comm, dev, d, s)))
        cases.append((f"model chunked prefill v2-lite {dt}",
                      lambda d=dtype: _model_prefill_case(comm, dev, d)))
    if dev.type == "cuda":
        cases.append(("decode step in a CUDA graph (bf16, N=128)",
                      lambda: _graph_case(comm, dev)))
    records = []
    for name, fn in cases:
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001 (recorded as a failed case, every rank agrees)
            res = {"rel_err": float("inf"), "tolerance": 0.0, "seconds": 0.0,
                   "error": f"{type(e).__name__}: {e}"[:300]}
        errs = torch.tensor([float(res["rel_err"]), float(res.get("lse_max_abs_err", 0.0))],
                            dtype=torch.float64, device=dev)
        worst = comm.all_gather(errs[None], dim=0).max(dim=0).values.tolist()
        ok = worst[0] <= res["tolerance"]
        rec = {"case": name, **res, "rel_err": worst[0]}
        if "lse_max_abs_err" in res:
            rec["lse_max_abs_err"] = worst[1]
            ok = ok and worst[1] <= res["lse_tolerance"]
        rec["passed"] = bool(ok)
        records.append(rec)
    return records


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mla.fast.dcp.check",
                                     description="The fast DCP path on a process group "
                                                 "against the float64 reference (torchrun).")
    parser.add_argument("--out", default=None, help="write the JSON result here (rank 0)")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("launch with torchrun --nproc-per-node 2 -m mla.fast.dcp.check")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10), device_id=dev)
    try:
        comm = CapturableCommunicator()
        records = run_check(comm, dev)
        passed = all(r["passed"] for r in records)
        if comm.rank == 0:
            import triton

            nccl = torch.cuda.nccl.version()
            result = {
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                "backend": "nccl", "world_size": comm.world_size, "torch": torch.__version__,
                "triton": triton.__version__, "python": platform.python_version(),
                "gpu": torch.cuda.get_device_name(dev), "cuda": torch.version.cuda,
                "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
                "passed": passed, "cases": records}
            for r in records:
                lse = f"{r['lse_max_abs_err']:.2e}/{r['lse_tolerance']:.1e}" \
                    if "lse_max_abs_err" in r else "-"
                print(f"{r['case']:<48} out {r['rel_err']:.2e}/{r['tolerance']:.1e} "
                      f"lse {lse:<18} {'ok' if r['passed'] else 'FAILED'} "
                      f"{r.get('error', '')}")
            print(f"{'PASSED' if passed else 'FAILED'} on {comm.world_size} ranks (nccl)")
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=2)
    finally:
        dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
