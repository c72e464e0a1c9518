"""How ``mla bench`` times a call, and the ceilings it compares with (CUDA only).

- ``time_call``: the call captured in a CUDA graph (run once on a side stream first, which
  compiles and allocates), then the median of ``reps`` replays, each between two CUDA events,
  after five dropped ones: the way a serving engine launches decode. Before each replay,
  outside the timed span, the L2 is flushed by reading a 256 MB buffer (a read leaves no dirty
  lines for the timed kernel to write back), unless ``flush=False`` ("warm": the previous
  replay's lines stay; a ``torch.cuda._sleep`` of about 25 µs is queued instead, because a
  start event recorded on an idle GPU fires at once and the time would then take in the
  host's launch of the graph: 11-17 µs for an empty kernel on an H200 on 2026-12-07, 3-4 µs
  with the flush in front). A call that cannot be captured (a host synchronisation, a host-side
  allocation it needs) is timed eagerly the same way and marked ``"eager"`` with the reason.
- ``ceilings``: what this GPU reaches in the same run: a device-to-device copy of 1 GiB
  (bytes read + written, GB/s), an 8192³ bf16 matmul (TFLOP/s) and an 8192³ e4m3 one
  (``torch._scaled_mm``, fast accumulation, bf16 out: the rate of the indexer's fp8 MMAs;
  left out, with the reason, where this torch or GPU has none), each the median of
  event-timed calls.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

import torch

__all__ = ["Timing", "capture", "ceilings", "median_ms", "time_call"]

FLUSH_BYTES = 256 << 20
DROPPED = 5
BUSY_CYCLES = 50_000  # the warm timing's sleep before each run: about 25 µs at 2 GHz


@dataclasses.dataclass(frozen=True)
class Timing:
    """A median time in µs; ``method`` ``"graph"`` or ``"eager"`` (``why``: the capture's
    error), ``l2`` ``"flushed"`` or ``"warm"``, over ``reps`` runs."""

    us: float
    method: str
    l2: str
    reps: int
    why: str = ""


def median_ms(run: Callable[[], object], reps: int, before: Callable[[], object] | None
              ) -> float:
    """The median ms of ``reps`` event-timed calls of ``run`` (``DROPPED`` more first, not
    counted), ``before()`` run outside the timed span before each."""
    times = []
    for _ in range(reps + DROPPED):
        if before is not None:
            before()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[DROPPED:])


def capture(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """``fn`` run once on a side stream, then captured; returns the graph and the captured
    call's outputs (kept alive with the graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def time_call(fn: Callable[[], object], reps: int = 50, flush: bool = True,
              graph: bool = True) -> Timing:
    """The median time of ``fn()`` (see the module doc); ``graph=False`` times it eagerly."""
    buf = torch.ones(FLUSH_BYTES, dtype=torch.int8, device="cuda") if flush else None

    def before() -> None:
        if buf is not None:
            buf.sum(dtype=torch.int64)
        else:  # the start event then waits for this, not for the host's launch of fn
            torch.cuda._sleep(BUSY_CYCLES)

    l2 = "flushed" if flush else "warm"
    why = "eager asked for"
    if graph:
        try:
            g, out = capture(fn)
        except Exception as e:  # noqa: BLE001 (any capture failure: time it eagerly)
            torch.cuda.synchronize()
            why = f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        else:
            ms = median_ms(g.replay, reps, before)
            del g, out
            return Timing(ms * 1e3, "graph", l2, reps)
    fn()
    torch.cuda.synchronize()
    ms = median_ms(fn, reps, before)
    return Timing(ms * 1e3, "eager", l2, reps, why)


def _copy_ms(n: int, reps: int) -> float:
    x = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    return median_ms(lambda: y.copy_(x), reps, None)


def _matmul_ms(m: int, reps: int) -> float:
    a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    return median_ms(lambda: a @ b, reps, None)


def _fp8_matmul_ms(m: int, reps: int) -> float:
    a = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn).t()  # column-major
    one = torch.ones((), device="cuda")
    return median_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                              out_dtype=torch.bfloat16, use_fast_accum=True),
                     reps, None)


def ceilings(reps: int = 20) -> dict[str, float | str]:
    """``{"copy_GBps": ..., "matmul_TFLOPs": ..., "fp8_matmul_TFLOPs": ...}`` measured now on
    the current CUDA device (``"fp8_matmul_error"`` in place of the last where the e4m3
    matmul does not run)."""
    n = 1 << 30
    copy_ms = _copy_ms(n, reps)
    m = 8192
    mm_ms = _matmul_ms(m, reps)
    out: dict[str, float | str] = {"copy_GBps": 2 * n / (copy_ms * 1e-3) / 1e9,
                                   "matmul_TFLOPs": 2 * m ** 3 / (mm_ms * 1e-3) / 1e12}
    try:
        out["fp8_matmul_TFLOPs"] = 2 * m ** 3 / (_fp8_matmul_ms(m, reps) * 1e-3) / 1e12
    except Exception as e:  # noqa: BLE001 (no fp8 MMA here, pre-sm_89: say so, go on)
        torch.cuda.synchronize()
        out["fp8_matmul_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    torch.cuda.empty_cache()
    return out
