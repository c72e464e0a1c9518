"""The seesaw variant of the Gluon sm_90 decode (``mla.fast.sm90.decode_seesaw``), on the CPU.

What it computes is checked on the GPU (it cannot run under the interpreter); here: what it
compiles to for the H200 (compiled in a child process without ``TRITON_INTERPRET``, as
``tests/test_sm90_compile.py`` explains), and that asking for it off Hopper changes nothing.
"""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch
from _compiled import compiled
from _interpreter import needs_interpreter

pytest.importorskip("triton.experimental.gluon")

import mla.fast as fast  # noqa: E402
from mla.check.decode import decode_metrics, paged_decode_inputs  # noqa: E402

SMEM_LIMIT = 232448  # bytes of shared memory per program on an H200 (227 KB)

VARIANTS = [dict(N=128, S_Q=1), dict(N=128, S_Q=1, SPLIT=True),
            dict(N=128, S_Q=2, CAUSAL=True), dict(N=128, S_Q=2, CAUSAL=True, SPLIT=True),
            dict(N=16, S_Q=4, CAUSAL=True), dict(N=128, S_Q=1, HAS_SINK=True),
            dict(N=128, S_Q=1, dtype="fp16")]

# sm90_compile.compile_decode's launch, with the seesaw kernel and its 4 (+4) warps
_CHILD = """
import json, sys
import triton
from benchmarks import sm90_compile as sc
from mla.fast.sm90 import decode_seesaw as ds
out = []
for a in json.loads(sys.argv[1]):
    N, S_Q, dt = a["N"], a["S_Q"], {"bf16": "bf16", "fp16": "fp16"}[a.get("dtype", "bf16")]
    page, splits, pages, D, DV = 64, 4 if a.get("SPLIT") else 1, 512, 576, 512
    const = dict(N=N, S_Q=S_Q, PAGE_SIZE=page, CAUSAL=a.get("CAUSAL", False),
                 SPLIT=a.get("SPLIT", False), HAS_SINK=a.get("HAS_SINK", False),
                 SPLIT_TILES=a.get("SPLIT_TILES", 0), SPLIT_CAP=a.get("SPLIT_CAP", 0))
    ptrs = dict(Q=dt, KV=dt, BT="i32", SEQLENS="i32", O=dt, LSE="fp32", OP="fp32",
                LSEP="fp32", SINK="fp32")
    ints = dict(stride_qb=S_Q * N * D, stride_qt=N * D, stride_qh=D, stride_kvb=page * D,
                stride_kvr=D, stride_btb=pages, stride_ob=S_Q * N * DV, stride_ot=N * DV,
                stride_oh=DV, stride_lb=N * S_Q, stride_lh=S_Q, num_splits=splits,
                kv_rows=4096 * page, num_blocks=4096, max_blocks=pages)
    src = sc._specialize(ds.seesaw_kernel, const, ptrs, {"qk_scale": "fp32"}, ints)
    k = triton.compile(src, target=sc.TARGET, options={"num_warps": ds.NUM_WARPS})
    f = sc.facts(k)
    f["setmaxnreg"] = k.asm["ptx"].count("setmaxnreg")
    out.append(f)
print(json.dumps(out))
"""


def _id(args: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in args.items())


@functools.cache
def _facts() -> dict[str, dict]:
    return {_id(a): f for a, f in zip(VARIANTS, compiled(["-c", _CHILD, json.dumps(VARIANTS)]))}


@pytest.mark.parametrize("args", VARIANTS, ids=_id)
def test_fits_one_program_per_sm_without_spills(args):
    # q 64 KB + two stages of 72 KB + two P tiles of 8 KB; the rope columns of q are in
    # registers. Two warp groups of 128 threads: 255 registers each at most; the wgmma
    # descriptors of the logits once made ptxas spill 488-576 bytes (benchmarks/notes/decode.md)
    f = _facts()[_id(args)]
    assert f["shared"] <= SMEM_LIMIT, f"{f['shared']} B of shared memory"
    assert f["reg"] <= 255 and f["stack"] == 0 and f["local"] == 0, f
    assert not f["ptx_local"], "the PTX declares local memory"
    assert f["setmaxnreg"] > 0, "not warp-specialized: no setmaxnreg in the PTX"


@pytest.mark.parametrize("args", VARIANTS, ids=_id)
def test_each_group_computes_whole_tiles_of_logits(args):
    # a group's tile of logits is 64 rows x 64 keys over 576 dims: 36 wgmma m64n64k16 (not the
    # current kernel's m64n32k16 halves); its half of P · V per tile: 4 m64n256k16. The
    # kernel has three places computing logits (group 0 in a pair and alone, group 1 in a
    # pair) and six products (group 0: P0 and P1, twice; group 1: P1 and P0, and P0 alone)
    f = _facts()[_id(args)]
    dt = {"bf16": "bf16", "fp16": "f16"}[args.get("dtype", "bf16")]
    shapes = {}
    for instr, count in f["wgmma"].items():
        m = re.fullmatch(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.(\w+)\.(\w+)",
                         instr)
        assert m is not None and m.group(2) == m.group(3) == dt, instr
        shapes[m.group(1)] = shapes.get(m.group(1), 0) + count
    assert shapes == {"m64n64k16": 3 * 36, "m64n256k16": 6 * 4}, f["wgmma"]
    assert f["tma"] > 0 and f["cp_async_16"] == f["cp_async_other"] == 0, f


@needs_interpreter
def test_seesaw_plan_off_hopper_runs_the_triton_kernel():
    # the plan field only selects among sm_90 kernels: on the CPU (the interpreter) the call
    # takes the Triton route and matches the reference
    g = torch.Generator().manual_seed(3)
    q, kv, bt, sl = paged_decode_inputs([0, 5, 70], 2, 16, 576, 64, torch.float32,
                                        torch.device("cpu"), g)
    plan = fast.DecodePlan(16, 64, 2, 4, 2, use_tma=False, seesaw=True)
    scale = 192 ** -0.5
    out, lse = fast.mla_decode_paged(q, kv, bt, sl, scale, True, 512, plan=plan)
    m = decode_metrics(q, kv, bt, sl, scale, True, 512, out, lse)
    assert m["out_rel"] < 1e-5 and m["lse_abs"] < 1e-5, m
