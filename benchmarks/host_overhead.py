"""``python -m benchmarks.host_overhead``: where the host time of one small decode call goes.

The B=1, L=4096, N=128 decode runs in about 24 µs on the GPU (CUDA graph); a direct call is
only as fast when its host side is shorter. This times the host side of the call (no GPU sync
inside the loop) with default arguments (no value checks), ``validate=False`` and
``validate=True``, then profiles the default call with cProfile and prints the functions with
the most own time and the call counts, so that the overhead can be cut where it is, not where
it is guessed. (``benchmarks.direct_call`` times the calls against their kernels.)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

from mla.fast.decode import mla_decode_paged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_overhead")
    p.add_argument("--out", help="write the numbers as JSON here")
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    B, L, N, D, bs = 1, 4096, 128, 576, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, 1, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(L // bs, bs, D, device="cuda", dtype=torch.bfloat16, generator=g)
    bt = torch.arange(L // bs, dtype=torch.int32, device="cuda").view(1, -1)
    sl = torch.full((B,), L, dtype=torch.int32, device="cuda")
    scale = 192 ** -0.5

    def call(validate: bool | None = None) -> None:
        mla_decode_paged(q, kv, bt, sl, scale, False, 512, validate=validate)

    res: dict = {}
    for name, fn in (("default arguments", call), ("validate=False", lambda: call(False)),
                     ("validate=True (one host read)", lambda: call(True))):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        host = (time.perf_counter() - t0) / args.calls
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.calls
        res[name] = {"host_us": host * 1e6, "wall_us": wall * 1e6}
        print(f"{name}: {host * 1e6:.1f} us host per call, {wall * 1e6:.1f} us wall per call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        call()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print(buf.getvalue())
    if args.out:  # the numbers as JSON, the profile beside it as text
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.splitext(args.out)[0] + "_profile.txt", "w") as f:
            f.write(buf.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
