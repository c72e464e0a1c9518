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

from mla.fast import sparse

_PLANS = [  # (q dtype, fp8 cache, heads, block_m, block_n, warps, stages, extra flags)
    ("bf16", True, 128, 64, 64, 8, 2, {}),
    ("bf16", True, 128, 64, 64, 8, 2, {"HAS_TOPK_LEN": True}),
    ("bf16", True, 128, 64, 32, 8, 3, {}),
    ("bf16", False, 128, 64, 64, 8, 2, {"HAS_MAXL": True}),
    ("bf16", False, 128, 64, 64, 8, 2, {"HAS_TOPK_LEN": True}),
    ("bf16", False, 128, 64, 64, 8, 3, {"HAS_MAXL": True}),
    ("bf16", True, 16, 16, 64, 8, 2, {}),
    ("bf16", True, 16, 16, 64, 4, 2, {}),
    ("bf16", False, 16, 16, 64, 4, 2, {}),
    ("fp32", False, 16, 16, 16, 8, 1, {}),
]


def compile_plan(dt: str, fp8: bool, N: int, block_m: int, block_n: int, warps: int,
                 stages: int, flags: dict) -> triton.compiler.CompiledKernel:
    fn = sparse._sparse_kernel
    names = fn.arg_names
    const = dict(N=N, S=1, GROUPS=-(-N // block_m), DV=512, DR=64, BLOCK_M=block_m,
                 BLOCK_N=block_n, BLOCK_DV=512, BLOCK_DR=64, HAS_PE=True, FP8=fp8,
                 HAS_TOPK_LEN=False, HAS_MAXL=False, SPLIT=False,
                 DOT_PREC="ieee" if dt == "fp32" else "tf32", ROW_BYTES=656, NUM_TILES=4,
                 TILE=128, ROPE_OFFSET=528, num_splits=1)
    const.update(flags)
    ptrs = {"Q": dt, "KV": "u8" if fp8 else dt, "KV_F32": "fp32" if fp8 else dt,
            "KV_BF16": "bf16" if fp8 else dt, "IDX": "i32", "TOPK_LEN": "i32", "O": dt,
            "LSE": "fp32", "MAXL": "fp32", "OP": "fp32", "LSEP": "fp32", "MAXP": "fp32"}
    sig = {}
    for n in names:
        if n in const:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = "*" + ptrs[n]
        else:
            sig[n] = {"qk_scale": "fp32", "n_rows": "i64"}.get(n, "i32")
    aligned = [n for n in names if sig[n].startswith("*")] + [
        "stride_qq", "stride_qh", "stride_iq", "stride_row", "stride_oq", "stride_oh",
        "stride_lb", "stride_mq", "topk"]
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
    for dt, fp8, N, bm, bn, w, st, flags in _PLANS:
        name = (f"{dt} q, {'fp8' if fp8 else dt} cache, N={N} block_m={bm} block_n={bn} "
                f"warps={w} stages={st} {flags or ''}")
        try:
            k = compile_plan(dt, fp8, N, bm, bn, w, st, flags)
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
