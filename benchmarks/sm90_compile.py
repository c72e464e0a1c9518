"""``python -m benchmarks.sm90_compile``: compile the Gluon sm_90 kernels without a GPU.

``mla.fast.sm90.decode.decode_kernel`` and ``mla.fast.sm90.sparse.sparse_kernel``
cannot run under the Triton interpreter, but Triton compiles them ahead of time for a named
target with the ``ptxas`` it ships. So what decides whether they can be fast, and whether they
fit at all, can be read on a CPU-only machine before any GPU time is spent: shared memory per
program (the H200 allows 232448 bytes), registers and spilled bytes per thread (from the bundled
``cuobjdump``), the ``wgmma`` instruction shapes, and how the keys arrive (TMA bulk copies or
16-byte ``cp.async`` gathers). ``tests/test_sm90_compile.py`` asserts these facts.

Each argument gets the specialization a real launch gives it: pointers 16-byte aligned, and each
integer a representative value of a DeepSeek launch (576-element rows, 64-row pages, N heads)
specialized by Triton's rule (a multiple of 16 is marked divisible by 16, a 1 becomes a
constant: ``num_splits`` of an unsplit launch, the LSE head stride at ``s_q = 1``). The argument
lists come from the kernels' ``arg_names``, so an added or removed argument needs no edit here;
an integer this file has no value for is compiled as a plain ``i32``, and a constexpr it has no
value for is an error.

The Triton interpreter replaces every ``@jit`` function, the language's own helpers included,
when ``triton`` is imported with ``TRITON_INTERPRET=1``; such a process cannot compile for a
GPU (``Unsupported function referenced: InterpretedFunction``). Run this without it.

Prints one line per variant; ``--json`` prints the same facts as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from mla.fast import decode as fast_decode
from mla.fast.decode import plan_decode
from mla.fast.sm90 import decode as sm90_decode
from mla.fast.sm90 import sparse as sm90_sparse

TARGET = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 232448  # bytes of shared memory one program may use on an H200 (227 KB)
NUM_WARPS = 8  # both kernels: two warp groups
_D, _DV = 576, 512
_FP8_ROW_BYTES = 656  # fp8_ds_mla: 512 e4m3 + 4 float32 scales + 64 bf16 rope values
_ROPE_OFFSET = 528
_DTYPES = {"bf16": "bf16", "fp16": "fp16"}


def _specialize(fn, const: dict, ptrs: dict, floats: dict, ints: dict,
                source: type = GluonASTSource) -> GluonASTSource:
    """The source of ``fn`` specialized as a launch with these arguments would specialize it:
    ``const`` gives the constexprs, ``ptrs`` pointer element types, ``floats`` float scalar
    types, ``ints`` representative integer values."""
    names = fn.arg_names
    unspecialized = {p.name for p in fn.params if p.do_not_specialize}
    wanted = [p.name for p in fn.params if p.is_constexpr]
    missing = [n for n in wanted if n not in const]
    if missing:
        raise ValueError(f"{fn.__name__}: no value for constexpr {missing}; add it to "
                         "benchmarks/sm90_compile.py")
    constexprs = {n: v for n, v in const.items() if n in wanted}
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = "*" + ptrs[n]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 256-byte aligned
        elif n in floats:
            sig[n] = floats[n]
        elif n in ints and ints[n] == 1 and n not in unspecialized:
            sig[n] = "constexpr"  # Triton turns an integer argument equal to 1 into a constant
            constexprs[n] = 1
        else:
            v = ints.get(n)  # an unknown integer: plain i32, no divisibility
            sig[n] = "i64" if v is not None and abs(v) >= 2**31 else "i32"
            if v is not None and v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return source(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)


def compile_decode(N: int = 128, S_Q: int = 1, CAUSAL: bool = False, SPLIT: bool = False,
                   dtype: str = "bf16", HAS_SINK: bool = False, SPLIT_TILES: int = 0,
                   SPLIT_CAP: int = 0) -> triton.compiler.CompiledKernel:
    """``decode_kernel`` for sm_90 as ``mla.fast.decode.mla_decode_paged`` launches it:
    a ``[B, S_Q, N, 576]`` query, 64-row pages of a 576-column cache, 32K-token block tables;
    ``SPLIT_TILES``, ``SPLIT_CAP``: the batch-invariant plans' fixed-length splits."""
    dt = _DTYPES[dtype]
    page, splits, max_pages = 64, 4 if SPLIT else 1, 512
    const = dict(N=N, S_Q=S_Q, PAGE_SIZE=page, CAUSAL=CAUSAL, SPLIT=SPLIT, HAS_SINK=HAS_SINK,
                 SPLIT_TILES=SPLIT_TILES, SPLIT_CAP=SPLIT_CAP)
    ptrs = dict(Q=dt, KV=dt, BT="i32", SEQLENS="i32", O=dt, LSE="fp32", OP="fp32",
                LSEP="fp32", SINK="fp32")
    ints = dict(stride_qb=S_Q * N * _D, stride_qt=N * _D, stride_qh=_D,
                stride_kvb=page * _D, stride_kvr=_D, stride_btb=max_pages,
                stride_ob=S_Q * N * _DV, stride_ot=N * _DV, stride_oh=_DV,
                stride_lb=N * S_Q, stride_lh=S_Q,  # lse is [B, N, S_Q]
                num_splits=splits, kv_rows=4096 * page, num_blocks=4096,
                max_blocks=max_pages)
    src = _specialize(sm90_decode.decode_kernel, const, ptrs, {"qk_scale": "fp32"}, ints)
    return triton.compile(src, target=TARGET, options={"num_warps": NUM_WARPS})


def compile_triton_decode(N: int = 128, S_Q: int = 1, CAUSAL: bool = False,
                          dtype: str = "bf16",
                          batch_invariant: bool = False) -> triton.compiler.CompiledKernel:
    """``mla.fast.decode``'s Triton kernel for sm_90 with the plan ``plan_decode`` gives a
    ``[1, S_Q, N, 576]`` query over 64-row pages and a 32K-token block table: the kernel every
    float32 call runs, and 16-bit calls where the Gluon route is not taken
    (``batch_invariant``: the batch-invariant plan, fixed-length splits)."""
    dt = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}[dtype]
    torch_dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    page, max_pages = 64, 512
    plan = plan_decode(1, S_Q, N, _D, _DV, max_pages, page, torch_dt, 132,
                       batch_invariant=batch_invariant)
    fixed = plan.split_keys // plan.block_n
    const = dict(N=N, S_Q=S_Q, DV=_DV, DR=_D - _DV, PAGE_SIZE=page, BLOCK_M=plan.block_m,
                 BLOCK_N=plan.block_n, BLOCK_DV=_DV, BLOCK_DR=_D - _DV, HAS_PE=True,
                 PAGE_TILE=page % plan.block_n == 0, USE_TMA=plan.use_tma, CAUSAL=CAUSAL,
                 SPLIT=plan.num_splits > 1 or fixed > 0, HAS_SINK=False,
                 DOT_PREC="ieee" if dtype == "fp32" else "tf32", SPLIT_TILES=fixed,
                 SPLIT_CAP=plan.num_splits if fixed else 0)
    ptrs = dict(Q=dt, KV=dt, BT="i32", SEQLENS="i32", O=dt, LSE="fp32", OP="fp32",
                LSEP="fp32", SINK="fp32")
    ints = dict(stride_qb=S_Q * N * _D, stride_qt=N * _D, stride_qh=_D,
                stride_kvb=page * _D, stride_kvr=_D, stride_btb=max_pages,
                stride_ob=S_Q * N * _DV, stride_ot=N * _DV, stride_oh=_DV,
                stride_lb=N * S_Q, stride_lh=S_Q, num_splits=plan.num_splits,
                kv_rows=4096 * page, num_blocks=4096, max_blocks=max_pages)
    src = _specialize(fast_decode._decode_kernel, const, ptrs, {"qk_scale": "fp32"}, ints,
                      source=ASTSource)
    return triton.compile(src, target=TARGET, options={"num_warps": plan.num_warps,
                                                       "num_stages": plan.num_stages})


def compile_sparse(FP8: bool = True, SPLIT: bool = False, HAS_TOPK_LEN: bool = False,
                   HAS_MAXL: bool = False, N: int = 128, S: int = 1,
                   dtype: str = "bf16", HAS_SINK: bool = False,
                   CHECK_RANGE: bool = False, MODEL1: bool = False, HAS_EXTRA: bool = False,
                   HAS_TOPK_LEN2: bool = False, D: int = 576, RAW_STAGES: int = 2,
                   MODEL1_KERNEL: str = "staged", DS_MLA_KERNEL: str = "staged",
                   BF16_KERNEL: str = "staged", SPLIT_TILES: int = 0,
                   SPLIT_CAP: int = 0) -> triton.compiler.CompiledKernel:
    """``sparse_kernel`` for sm_90 as ``mla.fast.sparse`` launches it: a ``[Q, N, 576]``
    query, top-k 2048, a cache of 576-element rows or ``fp8_ds_mla`` 656-byte rows, or
    (``MODEL1``) a ``[Q, N, 512]`` query over MODEL1 pages of 64 tokens; ``MODEL1_KERNEL``
    names the plan's MODEL1 kernel (``mla.fast.sparse.plan.MODEL1_KERNELS``), ``DS_MLA_KERNEL``
    its ``fp8_ds_mla`` kernel (``mla.fast.sparse.plan.DS_MLA_KERNELS``), ``BF16_KERNEL`` its
    kernel over rows in q's dtype (``mla.fast.sparse.plan.BF16_KERNELS``)."""
    dt = _DTYPES[dtype]
    if FP8 and dt != "bf16":
        raise ValueError("fp8_ds_mla takes a bf16 query")
    topk, splits, rows = 2048, 4 if SPLIT else 1, 1 << 20
    const = dict(N=N, S=S, GROUPS=math.ceil(N / 64), FP8=FP8, HAS_TOPK_LEN=HAS_TOPK_LEN,
                 HAS_MAXL=HAS_MAXL, SPLIT=SPLIT, SCALE_OFFSET=_DV if FP8 else 0,
                 ROPE_OFFSET=_ROPE_OFFSET, HAS_SINK=HAS_SINK, CHECK_RANGE=CHECK_RANGE,
                 MODEL1=MODEL1, HAS_EXTRA=HAS_EXTRA, HAS_TOPK_LEN2=HAS_TOPK_LEN2,
                 HAS_PE=not MODEL1 and D == _D, RAW_STAGES=RAW_STAGES if MODEL1 else 1,
                 SPLIT_TILES=SPLIT_TILES, SPLIT_CAP=SPLIT_CAP)
    fn = sm90_sparse.sparse_kernel
    if MODEL1 and MODEL1_KERNEL == "warp_specialized":
        from mla.fast.sm90.sparse_ws import model1_ws_kernel

        fn = model1_ws_kernel
    if FP8 and DS_MLA_KERNEL == "warp_specialized":
        from mla.fast.sm90.sparse_ws_ds import ds_mla_ws_kernel

        fn = ds_mla_ws_kernel
    warps = NUM_WARPS
    if not FP8 and not MODEL1 and BF16_KERNEL == "warp_specialized":
        from mla.fast.sm90.sparse_ws_bf16 import plain_ws_kernel

        fn = plain_ws_kernel
    if not FP8 and not MODEL1 and BF16_KERNEL == "seesaw_producer":
        from mla.fast.sm90 import sparse_seesaw

        fn, warps = sparse_seesaw.plain_seesaw_kernel, sparse_seesaw.NUM_WARPS
    d = 512 if MODEL1 else D
    ptrs = dict(Q=dt, KV="u8" if FP8 or MODEL1 else dt, IDX="i32", TOPK_LEN="i32", SINK="fp32",
                O=dt, LSE="fp32", KV2="u8" if FP8 or MODEL1 else dt, IDX2="i32",
                TOPK_LEN2="i32", MAXL="fp32", OP="fp32", LSEP="fp32", MAXP="fp32")
    ints = dict(stride_qq=N * d, stride_qh=d, stride_iq=topk,
                stride_row=37440 if MODEL1 else _FP8_ROW_BYTES if FP8 else d,
                page_size=64 if MODEL1 else 0, stride_oq=N * _DV, stride_oh=_DV,
                stride_iq2=128, stride_row2=37440 if MODEL1 else _FP8_ROW_BYTES if FP8 else d,
                page_size2=64 if MODEL1 else 0, n_rows2=rows, topk2=128,
                # lse strides for (q // S, q % S, head) of an [B, S, N] lse; max_logits [Q, N]
                stride_lb=S * N, stride_lt=N, stride_lh=1,
                stride_mq=N if HAS_MAXL else 0, stride_mh=1 if HAS_MAXL else 0,
                n_rows=rows, topk=topk, num_splits=splits)
    src = _specialize(fn, const, ptrs, {"qk_scale": "fp32"}, ints)
    return triton.compile(src, target=TARGET, options={"num_warps": warps})


def compile_logits(COMPRESSED: bool = True, M: int = 32768) -> triton.compiler.CompiledKernel:
    """``mla.fast.sm90.logits.ragged_logits_kernel`` for sm_90 as ``mla.fast.fp8_mqa_logits``
    launches it: 4096 queries of 64 heads over 32K keys of 128 e4m3 codes, 16 tiles a
    program, rows compressed or full; ``M`` the width of the output's rows (1: every row
    compressed to one column)."""
    from mla.fast.sm90 import logits as sm90_logits

    const = dict(STAGES=sm90_logits.STAGES, COMPRESSED=COMPRESSED)
    ptrs = dict(Q="fp8e4nv", W="fp32", CODES="fp8e4nv", K_SCALE="fp32", KS="i32", KE="i32",
                OUT="fp32")
    ints = dict(S=4096, N=32768, M=M, chunk=1024, splits=32, TILES=16, s_q_t=64 * 128,
                s_q_h=128, s_w_t=64, s_c_n=128)
    src = _specialize(sm90_logits.ragged_logits_kernel, const, ptrs, {}, ints)
    return triton.compile(src, target=TARGET, options={"num_warps": sm90_logits.NUM_WARPS})


def resource_usage(cubin: bytes) -> dict[str, int]:
    """``REG``, ``STACK`` and ``LOCAL`` of the kernel in ``cubin``, from the ``cuobjdump``
    shipped with Triton (the compiled kernel reports registers only once loaded on a GPU)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    usage = {}
    for key in ("REG", "STACK", "LOCAL"):
        m = re.search(rf"\b{key}:(\d+)", out)
        if m is None:
            raise RuntimeError(f"no {key} in cuobjdump output:\n{out}")
        usage[key.lower()] = int(m.group(1))
    return usage


def facts(k: triton.compiler.CompiledKernel) -> dict:
    """What the tests check and the table prints, read off one compiled kernel."""
    ptx = k.asm["ptx"]
    copies = re.findall(r"\bcp\.async\.(?:ca|cg)\.shared\.global[^;]*;", ptx)
    return {
        "shared": k.metadata.shared,
        **resource_usage(k.asm["cubin"]),
        "ptx_local": re.search(r"\.local\b", ptx) is not None,
        "wgmma": dict(Counter(re.findall(r"\bwgmma\.mma_async\.[\w.]+", ptx))),
        "tma": len(re.findall(r"\bcp\.async\.bulk\.tensor\b", ptx)),
        "cp_async_16": sum(1 for c in copies if re.search(r",\s*0x10\b", c)),
        "cp_async_other": sum(1 for c in copies if not re.search(r",\s*0x10\b", c)),
        # arrivals on an mbarrier fired when the issuing thread's cp.async copies land
        "cp_async_mbarrier": len(re.findall(r"\bcp\.async\.mbarrier\.arrive\b", ptx)),
    }


def compile_facts(kernel: str, kwargs: dict) -> dict:
    """``facts`` of ``compile_decode(**kwargs)`` (kernel ``"decode"``), ``compile_sparse``,
    ``compile_triton_decode`` or ``compile_logits``."""
    fn = {"decode": compile_decode, "sparse": compile_sparse,
          "triton_decode": compile_triton_decode, "logits": compile_logits}[kernel]
    return facts(fn(**kwargs))


VARIANTS = [
    ("decode", dict(N=128, S_Q=1)),
    ("decode", dict(N=128, S_Q=1, SPLIT=True)),
    ("decode", dict(N=128, S_Q=2, CAUSAL=True)),
    ("decode", dict(N=128, S_Q=2, CAUSAL=True, SPLIT=True)),
    ("decode", dict(N=16, S_Q=4, CAUSAL=True)),
    ("decode", dict(N=128, S_Q=1, dtype="fp16")),
    ("sparse", dict(FP8=True)),
    ("sparse", dict(FP8=True, SPLIT=True, HAS_TOPK_LEN=True, HAS_MAXL=True)),
    ("sparse", dict(FP8=False)),
    ("sparse", dict(FP8=False, SPLIT=True, HAS_TOPK_LEN=True, HAS_MAXL=True)),
    ("sparse", dict(FP8=False, N=64, S=2, dtype="fp16")),
    ("sparse", dict(FP8=True, HAS_TOPK_LEN=True, HAS_SINK=True, CHECK_RANGE=True)),
    ("sparse", dict(FP8=False, HAS_MAXL=True, HAS_SINK=True)),
    ("sparse", dict(FP8=False, MODEL1=True, N=64)),
    ("sparse", dict(FP8=False, MODEL1=True, HAS_TOPK_LEN=True, HAS_SINK=True,
                    CHECK_RANGE=True, SPLIT=True)),
    ("sparse", dict(FP8=False, MODEL1=True, N=64, HAS_EXTRA=True, HAS_TOPK_LEN=True,
                    HAS_TOPK_LEN2=True, HAS_SINK=True, CHECK_RANGE=True)),
    ("sparse", dict(FP8=True, HAS_EXTRA=True, HAS_SINK=True, CHECK_RANGE=True)),
    ("sparse", dict(FP8=False, D=512, N=64, HAS_MAXL=True, HAS_SINK=True, HAS_TOPK_LEN=True)),
    # the warp-specialized kernel over rows in q's dtype (SparsePlan.bf16_kernel): prefill at
    # 576 and 512, bf16 decode
    ("sparse", dict(FP8=False, HAS_MAXL=True, BF16_KERNEL="warp_specialized")),
    ("sparse", dict(FP8=False, D=512, N=64, HAS_MAXL=True, HAS_SINK=True, HAS_TOPK_LEN=True,
                    BF16_KERNEL="warp_specialized")),
    ("sparse", dict(FP8=False, HAS_TOPK_LEN=True, CHECK_RANGE=True,
                    BF16_KERNEL="warp_specialized")),
    # the batch-invariant plans: fixed-length splits (mla.fast.decode.plan, mla.fast.sparse.plan)
    ("decode", dict(N=128, S_Q=1, SPLIT=True, SPLIT_TILES=16, SPLIT_CAP=32)),
    ("decode", dict(N=128, S_Q=2, CAUSAL=True, SPLIT=True, HAS_SINK=True, SPLIT_TILES=16,
                    SPLIT_CAP=32)),
    ("sparse", dict(FP8=True, SPLIT=True, HAS_TOPK_LEN=True, CHECK_RANGE=True, SPLIT_TILES=8,
                    SPLIT_CAP=16)),
    ("sparse", dict(FP8=False, MODEL1=True, N=64, HAS_EXTRA=True, HAS_TOPK_LEN=True,
                    HAS_TOPK_LEN2=True, HAS_SINK=True, CHECK_RANGE=True, SPLIT=True,
                    MODEL1_KERNEL="warp_specialized", SPLIT_TILES=8, SPLIT_CAP=16)),
    ("triton_decode", dict(N=16, S_Q=1, batch_invariant=True)),
    ("triton_decode", dict(N=128, S_Q=2, CAUSAL=True, dtype="fp32", batch_invariant=True)),
]


def _shape(instr: str) -> str:
    """``m64n32k16.bf16`` of ``wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16``."""
    return re.search(r"m\d+n\d+k\d+", instr).group() + "." + instr.split(".")[-1]


def _line(kernel: str, kwargs: dict, f: dict) -> str:
    shapes = " ".join(f"{_shape(s)} x{c}" for s, c in sorted(f["wgmma"].items()))
    over = " OVER THE LIMIT" if f["shared"] > SMEM_LIMIT else ""
    spill = " SPILLS" if f["stack"] or f["local"] or f["ptx_local"] else ""
    args = " ".join(f"{k}={v}" for k, v in kwargs.items())
    return (f"{kernel} {args}: {f['shared']} B shared{over}, {f['reg']} registers, "
            f"{f['stack']} B stack{spill}, wgmma {shapes}, TMA x{f['tma']}, "
            f"cp.async 16 B x{f['cp_async_16']} (other sizes x{f['cp_async_other']})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")
    args = parser.parse_args(argv)
    if triton.knobs.runtime.interpret:
        print("TRITON_INTERPRET is set: this process cannot compile for a GPU; unset it",
              file=sys.stderr)
        return 2
    results, failed = [], 0
    for kernel, kwargs in VARIANTS:
        try:
            f = compile_facts(kernel, kwargs)
        except Exception as e:  # report and go on: a variant that does not compile is a result
            failed += 1
            print(f"{kernel} {kwargs}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        results.append({"kernel": kernel, "args": kwargs, **f})
        if not args.json:
            print(_line(kernel, kwargs, f), flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
