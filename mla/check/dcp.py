"""Decode context parallelism on a real ``torch.distributed`` process group: the tool.

``mla.reference.dcp`` writes the DCP math once against a four-method communicator, as rank
programs ``fn(comm, ...)``, and runs them on simulated ranks or on a process group through
``ProcessGroupCommunicator`` (gloo on CPU, NCCL on GPUs). This module starts the processes:

- ``run_process_group(world_size, fn)`` spawns ``world_size`` CPU processes on a gloo group
  (``file://`` rendezvous in a temporary directory, no TCP port to pick), runs ``fn(comm)`` on
  each and returns the results in rank order: the process-group twin of ``run_simulated``.
- ``python -m mla.check.dcp --check --out result.json``, launched by ``torchrun`` on ``W``
  processes, runs DCP decode (kernel level, N = 16 and 128) and DCP decode / chunked prefill
  from hidden states (DeepSeek-V2-Lite shapes) in bfloat16 and float32 on realistic sizes,
  compares each rank's heads with the single-rank float64 reference on the same (upcast)
  inputs, and writes GPU, versions, date and errors as JSON::

      torchrun --nproc-per-node 2 -m mla.check.dcp --check --out dcp_nccl.json
      torchrun --nproc-per-node 2 -m mla.check.dcp --check --backend gloo --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from mla.compare import LSE_ABS_TOL, TOLERANCES, max_abs_err, rel_err
from mla.config import MLAConfig, get_config
from mla.reference.dcp import (
    Communicator,
    ProcessGroupCommunicator,
    dcp_chunked_prefill_forward_rank,
    dcp_decode_forward_rank,
    dcp_decode_rank,
    head_slice,
    plan_dcp_context_chunks,
)
from mla.reference.decode import mla_decode_paged
from mla.reference.model import chunked_prefill_forward, decode_forward, write_context
from mla.reference.paged_cache import make_block_table
from mla.weights import MLAWeights

__all__ = ["run_process_group", "run_all", "run_check", "main"]

Result = TypeVar("Result")


# --- spawning a CPU group ------------------------------------------------------------------

def _child(rank: int, world_size: int, fn: Callable[[Communicator], object], backend: str,
           init_method: str, out_dir: str, timeout: float) -> None:
    torch.set_num_threads(1)  # W processes share the machine's cores
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        result = fn(ProcessGroupCommunicator())
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _start_method() -> str:
    """``forkserver`` where there is one: a server that imported torch once forks every rank,
    so a group starts in a fraction of a second instead of re-importing torch per rank.
    (Plain ``fork`` of a process that has run torch can deadlock in its thread pools.)"""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "torch.distributed", "mla.reference.dcp", "mla.check.dcp"])
    return "forkserver"


def run_process_group(world_size: int, fn: Callable[[Communicator], Result], *,
                      backend: str = "gloo", timeout: float = 120.0) -> list[Result]:
    """Run ``fn(comm)`` on ``world_size`` fresh CPU processes forming one process group.

    ``fn`` must be picklable (a module-level function or a ``functools.partial`` of one).
    Results come back in rank order (through ``torch.save`` files). A rank's exception is
    re-raised here (``torch.multiprocessing.ProcessRaisedException``, with its traceback);
    a group still running after ``timeout`` seconds is killed and ``TimeoutError`` raised.
    """
    import torch.multiprocessing as mp

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    with tempfile.TemporaryDirectory(prefix="mla-dcp-") as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(_child, args=(world_size, fn, backend, init, tmp, timeout),
                                 nprocs=world_size, join=False, start_method=_start_method())
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join()
                raise TimeoutError(f"the process group of {world_size} ranks did not finish "
                                   f"within {timeout} s")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]


def run_all(comm: Communicator, fns: Sequence[Callable[[Communicator], object]]
            ) -> list[object]:
    """Run several rank programs one after the other on the same group (one spawn for all)."""
    return [fn(comm) for fn in fns]


# --- the check on realistic shapes ---------------------------------------------------------

def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _kernel_decode_case(comm: Communicator, device: torch.device, dtype: torch.dtype,
                        num_heads: int, lens: Sequence[int], s_q: int, block_size: int,
                        seed: int) -> dict[str, object]:
    """``dcp_decode`` of this rank's heads vs ``mla_decode_paged`` (float64, global cache)."""
    Lkv, R = 512, 64
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = make_block_table(list(lens), block_size, spare_blocks=1, seed=seed)
    # the inputs are rounded to ``dtype`` once; the reference sees those numbers upcast
    kv_cache = _randn(gen, num_blocks, block_size, Lkv + R).to(dtype)
    q = _randn(gen, len(lens), s_q, num_heads, Lkv + R).to(dtype)
    seqlens = torch.tensor(list(lens), dtype=torch.int32)
    scale = (128 + 64) ** -0.5
    ref_o, ref_lse = mla_decode_paged(q.to(device, torch.float64),
                                      kv_cache.to(device, torch.float64), table.to(device),
                                      seqlens.to(device), scale, causal=True, head_dim_v=Lkv)
    t0 = time.perf_counter()
    out, lse = dcp_decode_rank(comm, q.to(device), kv_cache.to(device), table.to(device),
                               seqlens.to(device), scale, causal=True, head_dim_v=Lkv)
    _sync(device)
    heads = head_slice(num_heads, comm.world_size, comm.rank)
    # the single-rank path in the same dtype: what DCP's error should be compared with
    single_o, _ = mla_decode_paged(q.to(device), kv_cache.to(device), table.to(device),
                                   seqlens.to(device), scale, causal=True, head_dim_v=Lkv)
    return {"rel_err": rel_err(out, ref_o[:, :, heads]),
            "lse_max_abs_err": max_abs_err(lse, ref_lse[:, heads]),
            "single_rank_rel_err": rel_err(single_o, ref_o),
            "seconds": time.perf_counter() - t0}


def _filled_cache(weights: MLAWeights, config: MLAConfig, contexts: Sequence[int],
                  capacities: Sequence[int], block_size: int, gen: torch.Generator,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    table, num_blocks = make_block_table(list(capacities), block_size, spare_blocks=1,
                                         device=device)
    kv_cache = torch.full((num_blocks, block_size, config.latent_dim), float("nan"),
                          dtype=weights.dtype, device=device)
    for i, n in enumerate(contexts):
        hidden = _randn(gen, n, config.hidden_size).to(device=device, dtype=weights.dtype)
        write_context(weights, hidden, kv_cache, table[i])
    return kv_cache, table


def _model_decode_case(comm: Communicator, device: torch.device, dtype: torch.dtype,
                       config: MLAConfig, contexts: Sequence[int], s_q: int, block_size: int,
                       seed: int) -> dict[str, object]:
    """``dcp_decode_forward`` vs ``decode_forward`` (float64, same weights, cache, hidden)."""
    gen = torch.Generator().manual_seed(seed)
    weights = MLAWeights.random(config, seed=seed, dtype=dtype, device=device)
    kv_cache, table = _filled_cache(weights, config, contexts,
                                    [n + s_q for n in contexts], block_size, gen, device)
    hidden = _randn(gen, len(contexts), s_q, config.hidden_size).to(device=device, dtype=dtype)
    seqlens = torch.tensor(list(contexts), dtype=torch.int32, device=device)
    ref = decode_forward(weights.to(dtype=torch.float64), hidden.double(), kv_cache.double(),
                         table, seqlens)
    t0 = time.perf_counter()
    out = dcp_decode_forward_rank(comm, weights, hidden, kv_cache, table, seqlens)
    _sync(device)
    single = decode_forward(weights, hidden, kv_cache.clone(), table, seqlens)
    return {"rel_err": rel_err(out, ref), "seconds": time.perf_counter() - t0,
            "single_rank_rel_err": rel_err(single, ref), "ranks_agree": _ranks_agree(comm, out)}


def _model_prefill_case(comm: Communicator, device: torch.device, dtype: torch.dtype,
                        config: MLAConfig, contexts: Sequence[int], new_tokens: Sequence[int],
                        block_size: int, chunk_size: int, seed: int) -> dict[str, object]:
    """``dcp_chunked_prefill_forward`` vs ``chunked_prefill_forward`` (float64, same plan)."""
    gen = torch.Generator().manual_seed(seed)
    weights = MLAWeights.random(config, seed=seed, dtype=dtype, device=device)
    kv_cache, table = _filled_cache(weights, config, contexts,
                                    [c + n for c, n in zip(contexts, new_tokens)], block_size,
                                    gen, device)
    hidden = _randn(gen, sum(new_tokens), config.hidden_size).to(device=device, dtype=dtype)
    qsl = torch.tensor([0, *torch.tensor(list(new_tokens)).cumsum(0).tolist()],
                       dtype=torch.int32, device=device)
    plan = plan_dcp_context_chunks(list(contexts), comm.world_size,
                                   max_context_chunk=chunk_size)
    ref = chunked_prefill_forward(weights.to(dtype=torch.float64), hidden.double(), qsl,
                                  list(contexts), kv_cache.double(), table, plan=plan.plan)
    t0 = time.perf_counter()
    out = dcp_chunked_prefill_forward_rank(comm, weights, hidden, qsl, list(contexts), kv_cache,
                                           table, plan=plan)
    _sync(device)
    single = chunked_prefill_forward(weights, hidden, qsl, list(contexts), kv_cache.clone(),
                                     table, plan=plan.plan)
    return {"rel_err": rel_err(out, ref), "seconds": time.perf_counter() - t0,
            "single_rank_rel_err": rel_err(single, ref), "num_chunks": plan.num_chunks,
            "ranks_agree": _ranks_agree(comm, out)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ranks_agree(comm: Communicator, out: torch.Tensor) -> bool:
    """Every rank must hold the very same output (it was all-gathered)."""
    gathered = comm.all_gather(out.double()[None], dim=0)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _cases(quick: bool) -> list[tuple[str, dict[str, object], Callable[..., dict]]]:
    """(name, parameters, function) of every case; ``quick``: tiny shapes for CI."""
    dtypes = (torch.bfloat16, torch.float32)
    if quick:
        heads, lens, bs = (4,), (1, 2, 37, 70), 16
        config = get_config("tiny")
        contexts, new_tokens, chunk = (0, 1, 37, 70), (3, 1, 4, 2), 16
    else:
        heads, lens, bs = (16, 128), (1, 63, 1000, 3001), 64
        config = get_config("deepseek-v2-lite")
        contexts, new_tokens, chunk = (0, 1, 700, 2500), (5, 3, 17, 64), 1024
    out = []
    for dtype in dtypes:
        dt = str(dtype).removeprefix("torch.")
        for n in heads:
            for s_q in (1, 2):
                out.append((f"decode kernel N={n} s_q={s_q} {dt}",
                            dict(dtype=dtype, num_heads=n, lens=lens, s_q=s_q, block_size=bs,
                                 seed=1), _kernel_decode_case))
        for s_q in (1, 2):
            out.append((f"decode model {config.name} s_q={s_q} {dt}",
                        dict(dtype=dtype, config=config, contexts=contexts, s_q=s_q,
                             block_size=bs, seed=2), _model_decode_case))
        out.append((f"chunked prefill model {config.name} chunk={chunk} {dt}",
                    dict(dtype=dtype, config=config, contexts=contexts, new_tokens=new_tokens,
                         block_size=bs, chunk_size=chunk, seed=3), _model_prefill_case))
    return out


def _jsonable(params: dict[str, object]) -> dict[str, object]:
    conv = {}
    for k, v in params.items():
        if isinstance(v, torch.dtype):
            v = str(v).removeprefix("torch.")
        elif isinstance(v, MLAConfig):
            v = v.name
        elif isinstance(v, tuple):
            v = list(v)
        conv[k] = v
    return conv


def run_check(comm: Communicator, device: torch.device, quick: bool = False
              ) -> list[dict[str, object]]:
    """Run every case on this rank; return one record per case, errors maxed over ranks."""
    records = []
    for name, params, fn in _cases(quick):
        res = fn(comm, device, **params)
        errs = torch.tensor([float(res["rel_err"]), float(res.get("lse_max_abs_err", 0.0))],
                            dtype=torch.float64, device=device)
        worst = comm.all_gather(errs[None], dim=0).max(dim=0).values.tolist()
        dtype = params["dtype"]
        tol = TOLERANCES[dtype]  # type: ignore[index]
        rec = {"case": name, **_jsonable(params), "rel_err": worst[0], "tolerance": tol,
               "seconds": res["seconds"]}
        ok = worst[0] <= tol
        if "lse_max_abs_err" in res:
            rec["lse_max_abs_err"] = worst[1]
            rec["lse_tolerance"] = LSE_ABS_TOL
            ok = ok and worst[1] <= LSE_ABS_TOL
        for key in ("single_rank_rel_err", "ranks_agree", "num_chunks"):
            if key in res:
                rec[key] = res[key]
        ok = ok and rec.get("ranks_agree", True)
        rec["passed"] = bool(ok)
        records.append(rec)
    return records


def _environment(backend: str, device: torch.device, world_size: int) -> dict[str, object]:
    env: dict[str, object] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": backend, "world_size": world_size, "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        nccl = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    else:
        env["gpu"] = None
        env["cpu"] = platform.processor() or platform.machine()
    return env


def _table(records: Sequence[dict[str, object]]) -> str:
    lines = [f"{'case':<58} {'rel err':>10} {'1 rank':>10} {'lse err':>10} {'time':>9}  ok"]
    for r in records:
        lse = f"{r['lse_max_abs_err']:.2e}" if "lse_max_abs_err" in r else "-"
        lines.append(f"{r['case']:<58} {r['rel_err']:>10.2e} {r['single_rank_rel_err']:>10.2e}"
                     f" {lse:>10} {r['seconds'] * 1e3:>7.1f}ms  {'yes' if r['passed'] else 'NO'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mla.check.dcp",
        description="DCP decode and chunked prefill on a real process group, checked against "
                    "the single-rank float64 reference. Launch with torchrun.")
    parser.add_argument("--check", action="store_true", help="run the check (required)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                        help="default: nccl when CUDA is available, else gloo")
    parser.add_argument("--out", default=None, help="write the JSON result here (rank 0)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (for CI)")
    args = parser.parse_args(argv)
    if not args.check:
        parser.error("nothing to do: pass --check")
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "RANK" not in os.environ:
        parser.error("launch with torchrun, e.g. torchrun --nproc-per-node 2 -m mla.check.dcp "
                     "--check --out result.json")
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    try:
        comm = ProcessGroupCommunicator()
        records = run_check(comm, device, quick=args.quick)
        if comm.rank == 0:
            result = {**_environment(backend, device, comm.world_size), "quick": args.quick,
                      "max_rel_err": {}, "passed": all(r["passed"] for r in records),
                      "cases": records}
            for r in records:
                prev = result["max_rel_err"].get(r["dtype"], 0.0)
                result["max_rel_err"][r["dtype"]] = max(prev, r["rel_err"])
            print(_table(records))
            print(f"{'PASSED' if result['passed'] else 'FAILED'}: max rel err "
                  f"{result['max_rel_err']} on {comm.world_size} ranks ({backend})")
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=2)
                print(f"wrote {args.out}")
        passed = all(r["passed"] for r in records)
    finally:
        dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

