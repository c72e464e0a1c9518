"""``python -m benchmarks.indexer_compile``: compile the indexer's Triton kernels for sm_90
without a GPU.

The interpreter runs ``mla.fast.indexer.cache``, ``indexer_logits`` and ``topk`` on a CPU but
says nothing of whether they compile for the H200 (a ``tl.constexpr`` reassigned inside a
``tl.static_range`` runs interpreted and does not compile), nor what they compile to. Triton
compiles them ahead of time for a named target with the ``ptxas`` it ships; this prints, per
kernel as ``mla.fast`` launches it at DeepSeek-V3.2's shapes (64 heads of 128, pages of 64,
128K keys), the shared memory, registers, spilled bytes and ``wgmma`` shapes (the logits must
use e4m3 ones). ``tests/test_fast_indexer.py`` asserts them. Run it without
``TRITON_INTERPRET`` (an interpreted process cannot compile for a GPU).
"""

from __future__ import annotations

import argparse
import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.sm90_compile import SMEM_LIMIT, facts
from mla.fast import topk
from mla.fast.indexer import cache as indexer_cache
from mla.fast.indexer import logits as indexer_logits
from mla.fast.indexer import logits_paged as indexer_logits_paged

TARGET = GPUTarget("cuda", 90, 32)
_KEYS = 131072
_LOGITS_PTRS = dict(q="fp8e4nv", w="fp32", out="fp32")


def _compile(fn, const: dict, ptrs: dict, ints: dict, num_warps: int, **options
             ) -> triton.compiler.CompiledKernel:
    """``fn`` specialized as a launch specializes it: pointers 16-byte aligned, integers that
    are multiples of 16 marked so, integers equal to 1 made constants unless the kernel says
    ``do_not_specialize`` (Triton's rule); ``options``: more compiler options."""
    sig, attrs, constexprs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        if param.is_constexpr:
            sig[name] = "constexpr"
            constexprs[name] = const[name]
        elif name in ptrs and ptrs[name].startswith("tensordesc"):  # a host descriptor
            sig[name] = ptrs[name]
        elif name in ptrs:
            sig[name] = "*" + ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if ints[name] == 1 and not param.do_not_specialize:  # a launch makes it constant
                sig[name] = "constexpr"
                constexprs[name] = 1
            elif ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps, **options})


def paged(next_n: int = 1, plan: indexer_logits.LogitsPlan | None = None):
    """The paged kernel that ``plan.paged_loads`` picks for pages of 64 on sm_90 (``None``:
    the default plan for ``next_n``)."""
    plan = plan or indexer_logits_paged.paged_plan(next_n)
    np_ = triton.next_power_of_2(next_n)
    const = dict(NP=np_, HP=64, D=128, BLOCK_N=plan.block_n, NAN_CODES=False,
                 STAGES=plan.stages)
    ints = dict(H=64, next_n=next_n, n_blocks=4096, block_size=64, max_blocks=2048,
                width=_KEYS, tiles=plan.max_tiles, s_q_b=next_n * 64 * 128, s_q_n=64 * 128,
                s_q_h=128, s_w_r=64, s_t_b=2048)
    ptrs = dict(_LOGITS_PTRS, cache_f8="fp8e4nv", cache_f32="fp32", lens="i32", table="i32",
                codes_desc="fp8e4nv", scale_desc="fp32")  # unused pointers, but by tma_host
    if plan.paged_loads == "tma_host":
        ptrs.update(codes_desc=f"tensordesc<fp8e4nv[{plan.block_n}, 128]>",
                    scale_desc=f"tensordesc<fp32[1, {plan.block_n}]>")
    if plan.paged_loads == "gather":
        return _compile(indexer_logits_paged._paged_gather_kernel, const, ptrs, ints,
                        plan.num_warps)
    const.update(PAGE=64, MAX_TILES=plan.max_tiles,
                 TMA={"page": 0, "tma": 1, "tma_host": 2}[plan.paged_loads])
    return _compile(indexer_logits_paged._paged_page_kernel, const, ptrs, ints,
                    plan.num_warps)


def ragged(plan: indexer_logits.LogitsPlan = indexer_logits.RAGGED_PLAN,
           compressed: bool = False):
    return _compile(
        indexer_logits._ragged_kernel,
        dict(BLOCK_Q=plan.queries, HP=64, D=128, BLOCK_N=plan.block_n, TILES=8,
             NAN_CODES=False, STAGES=plan.stages, COMPRESSED=compressed),
        dict(_LOGITS_PTRS, codes_f8="fp8e4nv", k_scale_ptr="fp32", ks="i32", ke="i32"),
        dict(S=4096, H=64, N=_KEYS, M=2048 if compressed else _KEYS, chunk=8 * plan.block_n,
             splits=4, s_q_t=64 * 128, s_q_h=128, s_w_t=64, s_c_n=128), plan.num_warps)


def topk_kernels() -> dict[str, triton.compiler.CompiledKernel]:
    plan, cap = topk.TopkPlan(), topk.CANDIDATES
    ptrs = dict(logits="fp32", starts="i32", ends="i32", work="i32", words="i32", ready="i32",
                out="i32")
    ints = dict(W=_KEYS, topk=2048, s_l_r=_KEYS, s_o_r=2048, s_w_r=2 * _KEYS // 32,
                chunk=32768)
    select = dict(CAP=cap, SMALL=topk.SMALL, TILE=plan.select_tile, BITS=plan.select_bits,
                  OUT_BLOCK=1024, WORD_TILE=topk.WORD_TILE, QUAD=plan.select_search == "quad")
    launches = {
        topk._estimate_kernel: (dict(CAP=cap, RUN=plan.sample_run,
                                     SAMPLE_RUNS=plan.sample_runs, SMALL=topk.SMALL,
                                     OVERSAMPLE=float(plan.oversample), PDL=plan.pdl,
                                     READY=False, QUAD=plan.estimate_search == "quad"),
                                plan.estimate_warps),
        topk._mask_kernel: (dict(CAP=cap, SMALL=topk.SMALL, BLOCK=plan.block,
                                 STAGES=plan.stages, PDL=plan.pdl), plan.filter_warps),
        topk._select_kernel: (select, plan.select_warps)}
    return {fn.__name__: _compile(fn, const, ptrs, ints, warps)
            for fn, (const, warps) in launches.items()}


def cache_write():
    return _compile(indexer_cache._indexer_k_cache_kernel,
                    dict(D=128, BLOCK_T=indexer_cache.BLOCK_T),
                    dict(k="bf16", cache_u8="u8", cache_f32="fp32", slot_mapping="i64"),
                    dict(T=1000, n_slots=65536, block_size=64, s_k_t=128, s_k_d=1), 4)


def all_facts() -> dict[str, dict]:
    """``facts`` of every kernel as ``mla.fast`` launches it by default."""
    kernels = {"paged next_n=1": paged(1), "paged next_n=2": paged(2), "ragged": ragged(),
               "ragged compressed": ragged(indexer_logits.RAGGED_COMPRESSED_PLAN, True),
               "cache write": cache_write(), **topk_kernels()}
    return {name: facts(k) for name, k in kernels.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.indexer_compile",
                                description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print the facts as JSON")
    args = p.parse_args(argv)
    found = all_facts()
    if args.json:
        print(json.dumps(found))
        return 0
    for name, f in found.items():
        shapes = " ".join(f"{s.split('.')[-4]}.{s.split('.')[-1]} x{c}"
                          for s, c in sorted(f["wgmma"].items()))
        over = " OVER THE LIMIT" if f["shared"] > SMEM_LIMIT else ""
        print(f"{name}: {f['shared']} B shared{over}, {f['reg']} registers, {f['stack']} B "
              f"stack, wgmma {shapes or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
