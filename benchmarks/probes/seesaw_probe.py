"""Probe: the sparse prefill rows of ``benchmarks.sparse_peers`` with every default plan over
rows in q's dtype naming ``bf16_kernel`` (argv[1]: "seesaw_producer", "warp_specialized" or
"staged"), beside FlashMLA in the same process. Prints one line a shape;
``$OUT/seesaw_probe_<kernel>.json``."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import mla.fast.sparse as fast_sparse
from benchmarks import sparse_peers
from mla.bench.timing import ceilings


def main() -> int:
    kernel = sys.argv[1] if len(sys.argv) > 1 else "seesaw_producer"
    orig = fast_sparse.plan_sparse

    def plan(*a: object, **k: object) -> fast_sparse.SparsePlan:
        return dataclasses.replace(orig(*a, **k), bf16_kernel=kernel)

    fast_sparse.plan_sparse = plan
    sparse_peers.ATTENTION = tuple(s for s in sparse_peers.ATTENTION
                                   if s.kernel == "sparse_mla_prefill")
    ceil = ceilings()
    rows = sparse_peers.attention(ceil, 20)
    for r in rows:
        print(kernel, r["shape"], r["ours_us"], r["peer_us"], r["ratio"],
              r.get("ours_frac_matmul"), r.get("why", ""), flush=True)
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"seesaw_probe_{kernel}.json"), "w") as f:
        json.dump({"ceilings": ceil, "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
