"""Probe: where the halves' time goes (``mla.fast.topk.halves``, ``TopkPlan(halves=True)``).

On an H100 (2026-12-07) the halves took 53-70 us at 1-256 rows of 8193 and 16K keys, about
the same at every row count, against 22-42 for the general route and 12.5 for a held row of
8192 (``benchmarks/results/topk/topk_peers_halves_2026-12-07.json``): a cost a row that does
not grow with the rows, so the rows' second phases (the last half's select, one program a
row, all at once) rather than the halves' loads. This probe times, in CUDA graphs with the L2
flushed by a read, at 1 and 128 rows:

- ``general``: the default's general route at 8193;
- ``held_8192``: rows of 8192, held whole (the default);
- ``halves``, ``halves_bracket`` (``held_search="bracket"``), ``halves_k1`` (``topk`` 1:
  each half lists its whole first bracket of at most 4096, the last selects one);
- ``halves_held_rows``: the halves' kernel on logits 8193 wide whose rows end at 8192 (half
  0 selects them as a held row, half 1 returns);
- ``halves_sorted``: rows sorted down, so that each half's list is its first columns;

and ``general``, ``held_8192`` and ``halves`` again with the L2 not flushed between replays
(``*_warm``). The hypothesis these test: compiled for sm_90 the halves' kernel is about
17,400 SASS instructions (280 KB of code: the held rows' path, the halves' cut and the last
half's select, each with its own search and scan), the held rows' kernel 4,400; a replay
after the L2 flush fetches the code from memory, once for all the programs that run it side
by side, which is a cost that does not grow with the rows.

``python -m benchmarks.probes.topk_halves_probe``: prints one JSON row a shape and writes
``$OUT/topk_halves_probe.json``."""

from __future__ import annotations

import functools
import json

import torch

from benchmarks.common import capture, time_replays, write_out
from mla.bench.timing import median_ms
from mla.environment import environment
from mla.fast.topk import TopkPlan, launches


def _time(x: torch.Tensor, ends: torch.Tensor, topk: int, plan: TopkPlan,
          flush: bool = True) -> float:
    R = x.shape[0]
    starts = torch.zeros(R, dtype=torch.int32, device=x.device)
    out = torch.empty(R, topk, dtype=torch.int32, device=x.device)
    _work, steps = launches(x, starts, ends, out, topk, plan)

    def run() -> None:
        for s in steps:
            s()
    run()
    torch.cuda.synchronize()
    want = torch.topk(x[:, :int(ends.max())], topk, dim=1).values
    got = x.gather(1, out.long()).sort(dim=1, descending=True).values
    assert torch.equal(got, want), "wrong answer"
    g = capture(run)
    if not flush:
        return median_ms(g.replay, 30, None) * 1e3
    return time_replays(g, 30, read_flush=True) * 1e3


def main() -> int:
    res = {"environment": environment(), "rows": []}
    halves = TopkPlan(halves=True)
    for R in (1, 128):
        torch.manual_seed(R)
        x = torch.randn(R, 8193, device="cuda")
        full = torch.full((R,), 8193, dtype=torch.int32, device="cuda")
        short = torch.full((R,), 8192, dtype=torch.int32, device="cuda")
        held = x[:, :8192].contiguous()
        t = functools.partial(_time, x)
        row = {"R": R,
               "general": t(full, 2048, TopkPlan()),
               "held_8192": _time(held, short, 2048, TopkPlan()),
               "halves": t(full, 2048, halves),
               "halves_bracket": t(full, 2048, TopkPlan(halves=True, held_search="bracket")),
               "halves_k1": t(full, 1, halves),
               "halves_held_rows": t(short, 2048, halves),
               "halves_sorted": _time(x.sort(dim=1, descending=True).values, full, 2048,
                                      halves),
               "general_warm": t(full, 2048, TopkPlan(), False),
               "held_8192_warm": _time(held, short, 2048, TopkPlan(), False),
               "halves_warm": t(full, 2048, halves, False)}
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
    write_out("topk_halves_probe.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
