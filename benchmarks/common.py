"""What the benchmark scripts share: progress lines, the machine's ceilings, CUDA-graph timing,
and the heading and rows of their reports."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton.testing

from mla.bench.timing import capture as mla_capture
from mla.bench.timing import median_ms

__all__ = ["ceilings", "kernel_name", "log", "report_heading", "report_rows", "time_graph",
           "write_out"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _copy_ms(n: int) -> float:
    x = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")


def _matmul_ms(n: int) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")


def ceilings() -> dict[str, float]:
    n = 1 << 30  # bytes each way
    t_copy = _copy_ms(n)
    torch.cuda.empty_cache()
    t_mm = _matmul_ms(8192)
    torch.cuda.empty_cache()
    return {"copy_TBps": 2 * n / (t_copy * 1e-3) / 1e12,
            "matmul_TFLOPs": 2 * 8192 ** 3 / (t_mm * 1e-3) / 1e12}


def capture(fn) -> torch.cuda.CUDAGraph:
    """``fn`` run once on a side stream (compiles, allocates), then captured in a CUDA graph
    (``mla.bench.timing.capture``). The graph holds addresses, not tensors: the caller keeps
    what ``fn`` launches on (its scratch included) alive while it replays, or the replays use
    freed memory."""
    return mla_capture(fn)[0]


def time_replays(g: torch.cuda.CUDAGraph, reps: int = 50, read_flush: bool = False) -> float:
    """Median ms of ``reps`` replays of ``g`` (five more first, dropped), L2 flushed (outside
    the timing) before each: by writing 256 MB, or (``read_flush``) by reading them, which
    leaves no dirty lines in the L2 for the timed kernel's reads to write back (~50 MB of them
    on the H200)."""
    flush = torch.ones(256 << 20, dtype=torch.int8, device="cuda")

    def before() -> None:
        if read_flush:
            flush.sum(dtype=torch.int64)
        else:
            flush.zero_()
    return median_ms(g.replay, reps, before)


def time_graph(fn, reps: int = 50, read_flush: bool = False) -> float:
    """Median ms of graph replays of ``fn`` (``capture``, ``time_replays``)."""
    return time_replays(capture(fn), reps, read_flush)


def report_heading(title: str, res: dict) -> list[str]:
    """The first lines of every benchmark report: GPU, date, versions and the ceilings."""
    env, ceil = res["environment"], res["ceilings"]
    line = (f"torch {env['torch']}, triton {env['triton']}, CUDA {env.get('cuda', '?')}. "
            f"Ceilings measured in the same run: copy {ceil['copy_TBps']:.2f} TB/s")
    if "matmul_TFLOPs" in ceil:
        line += f", bf16 matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s"
    return [f"# {title}, {env.get('gpu', '?')}, {env['date']}", "", line + ".", ""]


def kernel_name(plan: dict, fp8: bool | None = None) -> str:
    """Which kernel a plan ran: the Gluon sm_90 one takes 64-row plans with ``sm90`` (on an
    H100/H200; the benchmarks run there). ``fp8``: the call's rows are ``fp8_ds_mla`` (the
    plan's ``ds_mla_kernel`` runs) or in q's dtype (its ``bf16_kernel``); None: unknown (a
    sparse plan's ``ds_mla_kernel`` names it)."""
    if not (plan.get("sm90", False) and plan["block_m"] == 64):
        return "Triton"
    field = {True: "ds_mla_kernel", False: "bf16_kernel", None: "ds_mla_kernel"}[fp8]
    return "Gluon sm90 ws" if plan.get(field) == "warp_specialized" else "Gluon sm90"


def report_rows(e: dict) -> list[tuple[str, dict]]:
    """The default plan, the fastest if another, and the fastest Triton plan of a sweep when
    the default is the sm_90 kernel (what the Gluon kernel gained)."""
    rows = [("default", e["default"])] if e.get("default") else []
    if e.get("best") and e["best"] != e.get("default"):
        rows.append(("best", e["best"]))
    timed = [r for r in e.get("variants", []) if "error" not in r]
    tri = [r for r in timed if kernel_name(r["plan"]) == "Triton"
           and r.get("rel_err_vs_default", 0.0) < 1e-2]
    if tri and all(kernel_name(r["plan"]) != "Triton" for _, r in rows):
        rows.append(("best Triton", min(tri, key=lambda r: min(r["us"], r["us_graph"]))))
    return rows


def write_out(name: str, res: dict) -> str:
    """``res`` as JSON in ``$OUT/name`` (``/tmp/out`` without ``OUT``, as on the GPU machine's
    steps, ``benchmarks/device_run.sh``); its path."""
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    return path
