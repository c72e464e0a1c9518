"""DCP scaling on one host: a DeepSeek-V3 layer's decode step on W = 1 GPU against W = 2 (NCCL).

    python -m benchmarks.dcp_scaling --out DIR [--lengths 32768 131072 524288] [--batches 1 16 64]

Spawns one process per GPU (two when there are two; W = 1 runs on GPU 0 alone while the other
waits). For every context length ``L`` and batch ``B`` (N = 128 heads, absorbed shapes
576/512, bf16, page 64, one new token per request):

- ``attention``: the decode step of one layer's attention. W = 1: ``mla.fast.mla_decode_paged``
  over ``L`` tokens. W = 2: ``mla.fast.dcp.dcp_decode`` (q all-gather, local decode over
  ``L/2`` tokens, lse all-gather, Triton correction, float32 reduce-scatter);
- ``layer``: the whole dense layer from hidden states (front, cache write, attention, W_UV,
  output projection): ``mla.fast.model.decode_forward`` against
  ``mla.fast.dcp.dcp_decode_forward`` (which all-gathers the heads before ``W_O``);
- ``collectives``: the same step's collectives alone, same shapes (a graph of its own);
- ``local``: W = 2's local decode alone (no collective).

Times are medians of CUDA-graph replays (the L2 flushed before each, the ranks aligned by a
barrier before each, the slowest rank's median reported); where a capture fails, eager calls
timed the same way (the JSON says which). KV bytes are per GPU. The longest ``L`` that fits is
*computed*, not run: free memory at start, less a reserve for weights and workspaces, divided
by the cache bytes per token (``B · 576 · 2 / W``). One cache per (L, W), allocated for the
largest batch and reused by the smaller ones.

Prediction. At N = 128 the decode is compute-bound (``2·B·N·L·1088`` FLOP) and at B = 64 its
128 programs (two 64-head groups per request) fill the 132 SMs once on either world size, so
W = 2's local decode takes half of W = 1's. The rest is fixed per step: the q all-gather
(``B·N/2·576·2`` bytes, 4.7 MB at B = 64), the lse all-gather (32 KB), the correction (reads
8.4 MB, writes 16.8 MB) and the float32 reduce-scatter (16.8 MB), about 0.1 ms over NVLink.
So at L >= 128K and B = 64 (W = 1: several ms) the ratio should be 0.5-0.55; at B = 1 and
32K (W = 1: tens of microseconds) the fixed part dominates and W = 2 is slower.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

LATENT, DV, HEADS, PAGE = 576, 512, 128, 64
RESERVE_BYTES = 6 << 30  # weights (0.4 GB), flush buffer, workspaces, NCCL buffers
TARGET = 0.6  # W = 2 step over W = 1 step at L >= 128K, B = 64


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Timer:
    """Median ms of graph replays (or eager calls), aligned across the group's ranks."""

    def __init__(self, reps: int, group_size: int) -> None:
        self.reps = reps
        self.group_size = group_size
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

    def __call__(self, fn: Callable[[], object], aligned: bool) -> tuple[float, str]:
        fn()  # compiles, initializes NCCL communicators
        torch.cuda.synchronize()
        mode = "graph"
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: NCCL's watchdog thread polls its events while this one captures
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                fn()
            run = graph.replay
        except Exception as e:  # noqa: BLE001 (reported: the JSON says the timing was eager)
            mode = f"eager ({type(e).__name__}: {str(e)[:120]})"
            torch.cuda.synchronize()
            run = fn
        times = []
        for _ in range(self.reps + 3):
            self.flush.zero_()
            torch.cuda.synchronize()
            if aligned and self.group_size > 1:
                dist.barrier()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times[3:]), mode


def _cache(num_requests: int, tokens: int, device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A random bf16 paged cache with room for ``tokens`` per request, pages in order."""
    pages = -(-tokens // PAGE)
    cache = torch.empty(num_requests * pages + 1, PAGE, LATENT, dtype=torch.bfloat16,
                        device=device)
    cache.normal_()
    table = torch.arange(num_requests * pages, dtype=torch.int32, device=device)
    return cache, table.view(num_requests, pages)


def _max(x: float, group_size: int) -> float:
    """The largest of the ranks' values (the slowest rank sets the step time)."""
    if group_size == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _run_w1(L: int, batches: list[int], timer: Timer, weights: object) -> list[dict]:
    """W = 1 on this GPU: attention and whole layer, every batch, one cache."""
    from mla.fast import mla_decode_paged
    from mla.fast.model import decode_forward

    dev = torch.device("cuda")
    cfg = weights.config  # type: ignore[attr-defined]
    cache, table = _cache(max(batches), L, dev)
    rows = []
    for B in batches:
        q = torch.randn(B, 1, HEADS, LATENT, dtype=torch.bfloat16, device=dev)
        lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        t_attn, mode = timer(functools.partial(
            mla_decode_paged, q, cache, table[:B], lens, cfg.softmax_scale, causal=True,
            head_dim_v=DV, validate=False), False)
        hidden = torch.randn(B, 1, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
        # the step caches token L - 1 and attends over L
        t_layer, mode_l = timer(functools.partial(
            decode_forward, weights, hidden, cache, table[:B], lens - 1, validate=False), False)
        rows.append({"W": 1, "L": L, "B": B, "attention_ms": t_attn, "layer_ms": t_layer,
                     "kv_bytes_per_gpu": B * L * LATENT * 2, "timing": mode,
                     "timing_layer": mode_l})
        log(f"W=1 L={L} B={B}: attention {t_attn:.3f} ms, layer {t_layer:.3f} ms ({mode})")
    return rows


def _collectives(comm: object, q_t: torch.Tensor, lse_t: torch.Tensor, part: torch.Tensor
                 ) -> None:
    """The DCP decode step's three collectives."""
    comm.all_gather(q_t, dim=0)  # type: ignore[attr-defined]
    comm.all_gather(lse_t, dim=0)  # type: ignore[attr-defined]
    comm.reduce_scatter(part, dim=1)  # type: ignore[attr-defined]


def _run_w2(L: int, batches: list[int], timer: Timer, weights: object, comm: object
            ) -> list[dict]:
    """W ranks of DCP: attention, its collectives, the local decode, the whole layer."""
    from mla.fast import mla_decode_paged
    from mla.fast.dcp import dcp_decode, dcp_decode_forward, local_visible_lens

    W, r = comm.world_size, comm.rank  # type: ignore[attr-defined]
    dev = torch.device("cuda")
    cfg = weights.config  # type: ignore[attr-defined]
    local_cap = -(-L // W)
    cache, table = _cache(max(batches), local_cap, dev)
    rows = []
    for B in batches:
        q = torch.randn(B, 1, HEADS // W, LATENT, dtype=torch.bfloat16, device=dev)
        lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        t_attn, mode = timer(functools.partial(
            dcp_decode, q, cache, table[:B], lens, cfg.softmax_scale, comm, causal=True,
            head_dim_v=DV, validate=False), True)
        # the same collectives alone, same shapes and dtypes (the output head-major)
        t_coll, _ = timer(functools.partial(
            _collectives, comm, q.movedim(2, 0).contiguous(),
            torch.zeros(1, B, HEADS, dtype=torch.float32, device=dev),
            torch.zeros(HEADS, B, DV, dtype=torch.float32, device=dev).movedim(0, 1)), True)
        q_all = torch.randn(B, 1, HEADS, LATENT, dtype=torch.bfloat16, device=dev)
        local = local_visible_lens(lens, 1, W, r, True)[:, 0].contiguous()
        t_local, _ = timer(functools.partial(
            mla_decode_paged, q_all, cache, table[:B], local, cfg.softmax_scale,
            head_dim_v=DV, validate=False), False)
        hidden = torch.randn(B, 1, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
        t_layer, mode_l = timer(functools.partial(
            dcp_decode_forward, weights, hidden, cache, table[:B], lens - 1, comm,
            validate=False), True)
        vals = [_max(x, W) for x in (t_attn, t_coll, t_local, t_layer)]
        rows.append({"W": W, "L": L, "B": B, "attention_ms": vals[0], "collectives_ms": vals[1],
                     "local_decode_ms": vals[2], "layer_ms": vals[3],
                     "kv_bytes_per_gpu": B * local_cap * LATENT * 2, "timing": mode,
                     "timing_layer": mode_l})
        if r == 0:
            log(f"W={W} L={L} B={B}: attention {vals[0]:.3f} ms (collectives {vals[1]:.3f}, "
                f"local {vals[2]:.3f}), layer {vals[3]:.3f} ms ({mode})")
    return rows


def _worker(rank: int, world: int, init: str, out_path: str, lengths: list[int],
            batches: list[int], reps: int, partial_path: str) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10), device_id=dev)
    try:
        from mla import MLAWeights, get_config
        from mla.fast.dcp import CapturableCommunicator

        comm = CapturableCommunicator()
        free, total = torch.cuda.mem_get_info(dev)
        weights = MLAWeights.random(get_config("deepseek-v3"), seed=0, dtype=torch.bfloat16,
                                    device=dev)
        timer = Timer(reps, world)
        rows: list[dict] = []
        for L in lengths:
            if rank == 0:
                rows += _run_w1(L, batches, timer, weights)
            torch.cuda.empty_cache()  # the W = 1 cache goes before the W = 2 one comes
            dist.barrier()
            if world > 1:
                rows += _run_w2(L, batches, timer, weights, comm)
                torch.cuda.empty_cache()
            dist.barrier()
            if rank == 0:  # what a run cut short still leaves behind
                with open(partial_path, "w") as f:
                    json.dump(rows, f, indent=1)
        if rank == 0:
            torch.save({"rows": rows, "free_bytes": free, "total_bytes": total}, out_path)
    finally:
        dist.destroy_process_group()


def _fits(free_bytes: int, batches: list[int], worlds: list[int]) -> list[dict]:
    usable = max(free_bytes - RESERVE_BYTES, 0)
    out = []
    for W in worlds:
        for B in batches:
            per_token = B * LATENT * 2 / W  # bytes per GPU per position of every request
            out.append({"W": W, "B": B, "max_L": int(usable // per_token)})
    return out


def _summary(rows: list[dict]) -> list[dict]:
    """W = 2 over W = 1 per (L, B), for the attention step and the whole layer."""
    one = {(r["L"], r["B"]): r for r in rows if r["W"] == 1}
    out = []
    for r in rows:
        if r["W"] == 1 or (r["L"], r["B"]) not in one:
            continue
        base = one[(r["L"], r["B"])]
        ratio = r["attention_ms"] / base["attention_ms"]
        out.append({"L": r["L"], "B": r["B"], "W": r["W"], "attention_ratio": ratio,
                    "layer_ratio": r["layer_ms"] / base["layer_ms"],
                    "target_applies": r["L"] >= 131072 and r["B"] == 64,
                    "meets_target": ratio <= TARGET})
    return out


def _markdown(res: dict) -> str:
    env = res["environment"]
    lines = [f"# DCP scaling, DeepSeek-V3 layer decode (N=128, bf16, page 64), "
             f"{env['gpus']} x {env['gpu']}, {env['date']}", "",
             f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, NCCL "
             f"{env['nccl']}. Timing: CUDA-graph replays, L2 flushed, ranks aligned, slowest "
             "rank's median.", "",
             "| L | B | W | attention ms | collectives ms | local decode ms | layer ms | "
             "KV GB/GPU | timing |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        coll = f"{r['collectives_ms']:.3f}" if "collectives_ms" in r else "-"
        loc = f"{r['local_decode_ms']:.3f}" if "local_decode_ms" in r else "-"
        lines.append(f"| {r['L']} | {r['B']} | {r['W']} | {r['attention_ms']:.3f} | {coll} | "
                     f"{loc} | {r['layer_ms']:.3f} | {r['kv_bytes_per_gpu'] / 1e9:.2f} | "
                     f"{r['timing'].split(' ')[0]} |")
    if res["summary"]:
        lines += ["", f"W = 2 step over W = 1 step (target at L >= 128K, B = 64: <= {TARGET}):",
                  "", "| L | B | attention | layer | target |", "|---|---|---|---|---|"]
        for s in res["summary"]:
            verdict = ("met" if s["meets_target"] else "MISSED") if s["target_applies"] else ""
            lines.append(f"| {s['L']} | {s['B']} | {s['attention_ratio']:.3f} | "
                         f"{s['layer_ratio']:.3f} | {verdict} |")
    lines += ["", f"Longest L that fits per GPU, *computed* (free memory at start "
              f"{res['free_bytes'] / 2**30:.1f} GiB less a {RESERVE_BYTES >> 30} GiB reserve, "
              "divided by B·576·2/W bytes per position), not run:", "",
              "| W | B | max L |", "|---|---|---|"]
    for f in res["fits"]:
        lines.append(f"| {f['W']} | {f['B']} | {f['max_L']:,} |")
    return "\n".join(lines) + "\n"


def _plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, key, title in ((axes[0], "attention_ms", "attention step"),
                           (axes[1], "layer_ms", "whole dense layer")):
        for W in sorted({r["W"] for r in res["rows"]}):
            for j, B in enumerate(sorted({r["B"] for r in res["rows"]})):
                pts = sorted((r["L"], r[key]) for r in res["rows"] if r["W"] == W
                             and r["B"] == B)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        ls="-" if W == 1 else "--", color=f"C{j}", label=f"W={W} B={B}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length L")
        ax.set_ylabel("ms per step (median of graph replays)")
        ax.set_title(f"{title}, DeepSeek-V3 N=128 bf16", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dcp_scaling",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for JSON, markdown, plot")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072, 524288])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs CUDA GPUs")
    import torch.multiprocessing as mp
    import triton

    world = min(2, torch.cuda.device_count())
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dcp-scaling-") as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        out_path = os.path.join(tmp, "rows.pt")
        partial = os.path.join(args.out, "dcp_scaling_partial.json")
        mp.start_processes(_worker, args=(world, init, out_path, args.lengths, args.batches,
                                          args.reps, partial), nprocs=world,
                           start_method="spawn")
        os.remove(partial)
        got = torch.load(out_path, weights_only=False)
    nccl = torch.cuda.nccl.version()
    res = {"environment": {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0), "gpus": world, "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        "python": platform.python_version()},
        "rows": got["rows"], "free_bytes": got["free_bytes"], "total_bytes": got["total_bytes"],
        "fits": _fits(got["free_bytes"], args.batches, sorted({1, world})),
        "summary": _summary(got["rows"]), "target": TARGET}
    with open(os.path.join(args.out, "dcp_scaling.json"), "w") as f:
        json.dump(res, f, indent=2)
    md = _markdown(res)
    with open(os.path.join(args.out, "dcp_scaling.md"), "w") as f:
        f.write(md)
    print(md)
    try:
        _plot(res, os.path.join(args.out, "dcp_scaling.png"))
    except ImportError as e:
        log(f"no plot: {e}")
    missed = [s for s in res["summary"] if s["target_applies"] and not s["meets_target"]]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
