"""``python -m benchmarks.sparse_compile``: compile the sparse kernel for sm_90 without a GPU.

Triton compiles ahead of time for a named target with the ``ptxas`` it ships, so register use,
spills, shared memory and the instruction choice (``wgmma``, ``cp.async``) of each launch plan
can be read on a CPU-only machine before any GPU time is spent. The arguments get the
specializations a real launch gives them (16-byte aligned pointers, strides and ``topk``
divisible by 16, ``num_splits = 1`` as a constant): without them the row gathers are not
vectorized and the pipeliner does not turn them into ``cp.async`` copies.

Prints one line per plan: shared memory (the H200 allows 227 KB per program), registers and
spilled bytes per thread, whether the dots are ``wgmma`` and the gathers ``cp.async``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mla.fast.sparse import kernels as sparse_kernels
from mla.fast.sparse.kernels import DS_MLA, MODEL1, PLAIN

_V4 = {"HAS_TOPK_LEN": True, "HAS_EXTRA": True, "HAS_TOPK_LEN2": True, "HAS_SINK": True,
       "CHECK_RANGE": True}
_FORMATS = {PLAIN: "", DS_MLA: "fp8_ds_mla", MODEL1: "MODEL1"}

_PLANS = [  # (q dtype, cache format, heads, block_m, block_n, warps, stages, extra flags)
    ("bf16", DS_MLA, 128, 64, 64, 8, 2, {}),
    ("bf16", DS_MLA, 128, 64, 64, 8, 2, {"HAS_TOPK_LEN": True, "CHECK_RANGE": True}),
    ("bf16", DS_MLA, 128, 64, 32, 8, 3, {}),
    ("bf16", PLAIN, 128, 64, 64, 8, 2, {"HAS_MAXL": True}),
    ("bf16", PLAIN, 128, 64, 64, 8, 2, {"HAS_TOPK_LEN": True}),
    ("bf16", PLAIN, 128, 64, 64, 8, 3, {"HAS_MAXL": True}),
    ("bf16", PLAIN, 128, 64, 64, 8, 2, {"HAS_MAXL": True, "HAS_SINK": True}),
    ("bf16", DS_MLA, 16, 16, 64, 8, 2, {}),
    ("bf16", DS_MLA, 16, 16, 64, 4, 2, {}),
    ("bf16", PLAIN, 16, 16, 64, 4, 2, {}),
    ("fp32", PLAIN, 16, 16, 16, 8, 1, {}),
    # DeepSeek-V4: rows of 512 (V the whole row), MODEL1 pages, a second scope, sinks
    ("bf16", MODEL1, 16, 16, 32, 8, 2, _V4),  # plan_sparse's MODEL1 plan under 64 heads
    ("bf16", MODEL1, 64, 64, 64, 8, 2, {}),
    ("bf16", MODEL1, 64, 64, 64, 8, 2, {"HAS_EXTRA": True}),
    ("bf16", MODEL1, 64, 64, 64, 8, 2, {"CHECK_RANGE": True, "HAS_TOPK_LEN": True}),
    ("bf16", MODEL1, 64, 64, 64, 8, 2, _V4),
    ("bf16", MODEL1, 64, 64, 32, 8, 2, _V4),
    ("bf16", MODEL1, 64, 64, 64, 8, 1, _V4),
    ("bf16", MODEL1, 128, 64, 64, 8, 2, _V4),
    ("bf16", PLAIN, 64, 64, 64, 8, 2, {"D": 512, **_V4}),
]


def compile_plan(dt: str, fmt: int, N: int, block_m: int, block_n: int, warps: int,
                 stages: int, flags: dict) -> triton.compiler.CompiledKernel:
    fn = sparse_kernels.sparse_kernel
    names = fn.arg_names
    flags = dict(flags)
    D = flags.pop("D", 512 if fmt == MODEL1 else 576)
    dv = 512
    const = dict(N=N, S=1, GROUPS=-(-N // block_m), DV=dv, DR=D - dv, BLOCK_M=block_m,
                 BLOCK_N=block_n, BLOCK_DV=512, BLOCK_DR=64 if D > dv else 16,
                 HAS_PE=D > dv, FORMAT=fmt, HAS_TOPK_LEN=False, HAS_EXTRA=False,
                 HAS_TOPK_LEN2=False, HAS_SINK=False, CHECK_RANGE=False, HAS_MAXL=False,
                 SPLIT=False, DOT_PREC="ieee" if dt == "fp32" else "tf32", SPLIT_TILES=0,
                 SPLIT_CAP=0, num_splits=1)
    const.update(flags)
    cache = {PLAIN: dt, DS_MLA: "u8", MODEL1: "u8"}[fmt]
    ptrs = {"Q": dt, "KV": cache, "KV_F32": "fp32" if fmt == DS_MLA else cache,
            "KV_BF16": cache if fmt == PLAIN else "bf16", "IDX": "i32", "TOPK_LEN": "i32",
            "SINK": "fp32", "O": dt, "LSE": "fp32", "MAXL": "fp32", "OP": "fp32",
            "LSEP": "fp32", "MAXP": "fp32"}
    for n in ("KV", "KV_F32", "KV_BF16", "IDX", "TOPK_LEN"):
        ptrs[n.replace("KV", "KV2") if n.startswith("KV") else n + "2"] = ptrs[n]
    sig = {}
    for n in names:
        if n in const:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = "*" + ptrs[n]
        else:
            sig[n] = {"qk_scale": "fp32", "n_rows": "i64", "n_rows2": "i64"}.get(n, "i32")
    aligned = [n for n in names if sig[n].startswith("*")] + [
        "stride_qq", "stride_qh", "stride_iq", "stride_iq2", "stride_oq", "stride_oh",
        "stride_lb", "stride_mq", "topk", "topk2", "page_size", "page_size2", "page_stride",
        "page_stride2"] + (["stride_row", "stride_row2"] if fmt == PLAIN else [])
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def _usage(cubin: bytes) -> str:
    """``REG:.. STACK:..`` from ``cuobjdump --dump-resource-usage`` (shipped with Triton)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    path = "/tmp/_mla_sparse_kernel.cubin"
    with open(path, "wb") as f:
        f.write(cubin)
    out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True,
                         text=True).stdout
    regs = out.split("REG:")[1].split()[0] if "REG:" in out else "?"
    stack = out.split("STACK:")[1].split()[0] if "STACK:" in out else "?"
    return f"{regs} registers, {stack} B spilled"


def main() -> int:
    for dt, fmt, N, bm, bn, w, st, flags in _PLANS:
        name = (f"{dt} q, {_FORMATS[fmt] or dt} cache, N={N} block_m={bm} block_n={bn} "
                f"warps={w} stages={st} {flags or ''}")
        try:
            k = compile_plan(dt, fmt, N, bm, bn, w, st, flags)
        except Exception as e:  # report and go on: a plan that does not compile is a result
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        ttgir = k.asm["ttgir"]
        print(f"{name}: {k.metadata.shared / 1024:.0f} KB shared, {_usage(k.asm['cubin'])}, "
              f"wgmma={'warp_group_dot ' in ttgir}, "
              f"cp.async={'async_copy_global_to_local' in ttgir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
