"""Probe: what a kernel's code costs when the L2 has been flushed before the launch.

At one row the top-k kernels' times follow the size of their code (``benchmarks/notes/topk.md``,
"Rows of 8193 to 16K"): 4,400 SASS instructions 12.5 us, 8,500-10,500 21.7 us, 17,400 62.8 us,
on an H100 with the L2 flushed by a read before each CUDA-graph replay. If a replay fetches
the code from memory, a kernel pays for its size whatever it computes. This probe isolates
that: one program (and one a SM) of 8 warps loads 256 floats, runs ``OPS`` dependent
multiply-adds written out in full (``tl.static_range``: ``OPS`` instructions of code, each run
once; compiled for sm_90, ``OPS + 32`` SASS instructions), and stores the result, at ``OPS``
in 0, 4096, 6144 and 8192 (Triton's front end takes about a minute a size past that); each
timed with the L2 flushed by a read before each replay and without. The multiply-adds take
the same time either way (about 4 cycles each, a dependent chain); the difference between the
two times is what fetching the code costs. Both are ``mla.bench.timing.time_call``'s (CUDA-graph
replays), whose unflushed timing queues a ``torch.cuda._sleep`` of about 25 us before each
replay: an event recorded on an idle GPU fires at once, so without it the time of the
unflushed replay took in the host's launch of the graph (the run of 2026-12-07, before this:
11-17 us for the empty kernel unflushed against 3-4 flushed).

``python -m benchmarks.probes.code_fetch_probe``: one JSON row a size and grid, and
``$OUT/code_fetch_probe.json``; ``--compile``: the kernels compiled for sm_90 on the CPU, their
SASS instruction counts (no GPU)."""

from __future__ import annotations

import json
import sys

import triton
import triton.language as tl

SIZES = (0, 4096, 6144, 8192)  # compiled for sm_90: OPS + 32 SASS instructions
WARPS = 8


@triton.jit
def _padded_kernel(x, out, OPS: tl.constexpr):
    """``out = f(x)`` through ``OPS`` dependent multiply-adds written out in full."""
    i = tl.arange(0, 256)
    v = tl.load(x + i)
    for k in tl.static_range(OPS):
        v = v * 0.999 + k * 1e-7
    tl.store(out + tl.program_id(0) * 256 + i, v)


def _sass_count(ops: int) -> int:
    """SASS instructions of the kernel at ``ops`` compiled for sm_90 (no GPU)."""
    from triton.tools.disasm import get_sass

    from benchmarks.indexer_compile import _compile

    k = _compile(_padded_kernel, {"OPS": ops}, {"x": "fp32", "out": "fp32"}, {}, WARPS)
    return sum(line.rstrip().endswith(";") for line in get_sass(k.asm["cubin"]).splitlines())


def run() -> dict:
    import torch

    from mla.bench.timing import time_call
    from mla.environment import environment

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(256, device="cuda")
    res = {"environment": environment(), "rows": []}
    for programs in (1, sms):
        out = torch.empty(programs, 256, device="cuda")
        for ops in SIZES:
            def launch(ops=ops, out=out, programs=programs) -> None:
                _padded_kernel[(programs,)](x, out, OPS=ops, num_warps=WARPS)
            row = {"programs": programs, "ops": ops,
                   "flushed_us": time_call(launch, 30).us,
                   "warm_us": time_call(launch, 30, flush=False).us}
            row["fetch_us"] = row["flushed_us"] - row["warm_us"]
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
    return res


def main(argv: list[str]) -> int:
    from benchmarks.common import write_out

    if "--compile" in argv:
        for ops in SIZES:
            print(ops, _sass_count(ops))
        return 0
    res = run()
    write_out("code_fetch_probe.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
