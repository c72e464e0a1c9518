"""``compute-sanitizer --tool memcheck python -m benchmarks.topk_memcheck``: one call of
``mla.fast.top_k_per_row`` down every path its select can take, each set compared with
``mla.reference.top_k_per_row``, at sizes small enough for the sanitizer.

The paths: more rows than SMs (three launches, the select's registers capped), the
one-launch kernel a row a program (capped or not), rows split in two (capped) and a row split
over many programs, two launches a row a part and rows in parts of 4096, all from candidate
lists;
lists longer than half the list's length (``topk = 5000``: keys held, columns written in
tiles); rows held whole at ``CANDIDATES // 2`` keys (keys and columns held) and one more
(tiles), the boundary key tied; rows whose keys are all equal (the threshold fails: the scan).
Exits 1 if a set differs. ``benchmarks/results/sanitize_topk_paths_*.log`` is its output.
"""

from __future__ import annotations

import json

import torch

import mla.reference as ref
from mla.conformance.cases.indexer import as_sets
from mla.fast.topk import CANDIDATES, TopkPlan, top_k_per_row


def _same(x: torch.Tensor, topk: int, plan: TopkPlan | None = None) -> bool:
    R, W = x.shape
    st = torch.zeros(R, dtype=torch.int32, device=x.device)
    en = torch.full((R,), W, dtype=torch.int32, device=x.device)
    got = top_k_per_row(x, st, en, topk, plan=plan).cpu()
    want = ref.top_k_per_row(x.cpu(), st.cpu(), en.cpu(), topk)
    return bool(torch.equal(as_sets(got), as_sets(want)))


def main() -> int:
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(200, 20000, device="cuda", generator=g)
    half = CANDIDATES // 2
    tied = (torch.randn(150, half + 1, device="cuda", generator=g) * 40).round() / 40
    cases = [
        ("200x20000 three (capped, lists)", x, 2048, TopkPlan(route="three")),
        ("200x20000 one a row a program (capped)", x, 2048, TopkPlan(route="one")),
        ("100x20000 one (parts of two, capped)", x[:100].contiguous(), 2048,
         TopkPlan(route="one")),
        ("100x20000 one a row a program", x[:100].contiguous(), 2048,
         TopkPlan(route="one", fused_min_parts=1)),
        ("8x20000 one split over many", x[:8].contiguous(), 2048, TopkPlan(route="one")),
        ("200x20000 two (a row a part, capped)", x, 2048, TopkPlan(route="two")),
        ("200x20000 two (parts of 4096)", x, 2048, TopkPlan(route="two", two_chunk=4096)),
        ("200x20000 k=5000 (lists past half)", x, 5000, None),
        (f"150x{half + 1} ties (tiles)", tied, 2048, TopkPlan(route="three")),
        (f"150x{half} ties (registers)", tied[:, :half].contiguous(), 2048,
         TopkPlan(route="three")),
        ("all equal 140x12000 (scan)", torch.zeros(140, 12000, device="cuda"), 2048, None),
    ]
    found = []
    for name, logits, topk, plan in cases:
        found.append((name, _same(logits, topk, plan)))
        print(*found[-1], flush=True)
    print(json.dumps(found))
    return 0 if all(ok for _, ok in found) else 1


if __name__ == "__main__":
    raise SystemExit(main())
