"""``python -m mla.check``: every fast kernel against the float64 reference, tensor by tensor.

Meant for a GPU (bf16 inputs, DeepSeek shapes); ``--device cpu`` runs the edge cases under
``TRITON_INTERPRET=1`` in float16 (the interpreter's bf16 ``tl.dot`` is wrong). The reference
runs in float64 on upcast copies of the same inputs; errors are conventions §11's: relative
Frobenius
error of the outputs, max absolute error of the lse, exact equality for integer outputs.
Outputs and workspaces the fast path allocates are poisoned with NaN (``torch.empty`` is
patched while the fast call runs), and cache rows no request uses hold NaN, so an unwritten
element or a read past a length shows up as an infinite error.

Registry: a kernel adds its cases with ``@register("name")`` on a function
``(ctx: Ctx) -> Iterable[Case]``; each case's ``run()`` returns ``(metrics, limits)`` and
passes when every metric is at most its limit (and fails with no limits at all). A kernel
whose fast function cannot be imported fails (one result saying so): nothing is skipped.
Prints a table; ``--out FILE`` writes JSON; exit status 1 on a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from mla.compare import LSE_ABS_TOL, max_abs_err, rel_err

__all__ = ["Ctx", "Case", "Result", "register", "REGISTRY", "run_checks", "main"]

Metrics = dict[str, float]


@dataclasses.dataclass(frozen=True)
class Ctx:
    device: torch.device
    dtype: torch.dtype  # of the fast path's inputs
    quick: bool  # edge-case sizes only (interpreter, compute-sanitizer)
    seed: int = 0


@dataclasses.dataclass
class Case:
    name: str
    run: Callable[[], tuple[Metrics, Metrics]]


@dataclasses.dataclass
class Result:
    kernel: str
    case: str
    metrics: Metrics
    limits: Metrics
    passed: bool
    seconds: float
    error: str = ""


REGISTRY: dict[str, tuple[str, Callable[[Ctx], Iterable[Case]]]] = {}


def register(kernel: str, fast_path: str) -> Callable:
    """``fast_path`` = "module:function" under ``mla.fast``; the kernel fails when it does not
    exist."""
    def deco(fn: Callable[[Ctx], Iterable[Case]]) -> Callable[[Ctx], Iterable[Case]]:
        REGISTRY[kernel] = (fast_path, fn)
        return fn
    return deco


def _missing(fast_path: str) -> str:
    """Why ``mla.fast.<module>:<name>`` cannot be called, or "" when it can."""
    module, name = fast_path.split(":")
    try:
        found = getattr(importlib.import_module(f"mla.fast.{module}"), name, None)
    except ImportError as e:
        return f"mla.fast.{module} fails to import: {type(e).__name__}: {e}"
    return "" if callable(found) else f"mla.fast.{module} has no function {name}"


@contextlib.contextmanager
def poisoned_alloc() -> Iterator[None]:
    """Within the block, every floating buffer from ``torch.empty`` starts as NaN."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):  # type: ignore[no-untyped-def]
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = nan_empty  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.empty = real_empty  # type: ignore[assignment]


def _gen(ctx: Ctx, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(ctx.seed * 1000003 + salt)


# ---------------------------------------------------------------------------------------------
# mla_decode_paged


def paged_decode_inputs(lens: list[int], s_q: int, N: int, D: int, block_size: int,
                        dtype: torch.dtype, device: torch.device, gen: torch.Generator,
                        spare_blocks: int = 2):
    """Random q and cache (scattered pages); unused cache rows hold NaN."""
    from mla.reference.paged_cache import make_block_table

    bt, nb = make_block_table([max(n, 1) for n in lens], block_size, spare_blocks=spare_blocks,
                              seed=int(torch.randint(1 << 30, (1,), generator=gen)))
    kv = torch.full((nb * block_size, D), float("nan"), dtype=dtype)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        rows = bt[b].long()[pos // block_size] * block_size + pos % block_size
        kv[rows] = torch.randn(n, D, generator=gen).to(dtype)
    q = torch.randn(len(lens), s_q, N, D, generator=gen).to(dtype)
    sl = torch.tensor(lens, dtype=torch.int32)
    return (q.to(device), kv.view(nb, block_size, D).to(device), bt.to(device), sl.to(device))


def _decode_metrics(q, kv, bt, sl, scale, causal, dv, out, lse) -> tuple[Metrics, Metrics]:
    from mla.reference.decode import mla_decode_paged as ref

    ref_out, ref_lse = ref(q.double(), kv.double(), bt, sl, scale, causal, dv)
    ok_shape = (out.shape == ref_out.shape and lse.shape == ref_lse.shape
                and out.dtype == q.dtype and lse.dtype == torch.float32)
    tol = 1e-5 if q.dtype == torch.float32 else 1e-2
    lse_tol = 1e-5 if q.dtype == torch.float32 else LSE_ABS_TOL
    metrics = {"out_rel": rel_err(out, ref_out) if ok_shape else math.inf,
               "lse_abs": max_abs_err(lse, ref_lse) if ok_shape else math.inf}
    return metrics, {"out_rel": tol, "lse_abs": lse_tol}


def _decode_case(ctx: Ctx, salt: int, lens: list[int], s_q: int, N: int, causal: bool,
                 block_size: int = 64, D: int = 576, dv: int = 512, plan=None,
                 dtype: torch.dtype | None = None, logit_scale: float = 1.0
                 ) -> Callable[[], tuple[Metrics, Metrics]]:
    def run() -> tuple[Metrics, Metrics]:
        from mla.fast.decode import mla_decode_paged

        q, kv, bt, sl = paged_decode_inputs(lens, s_q, N, D, block_size, dtype or ctx.dtype,
                                            ctx.device, _gen(ctx, salt))
        scale = logit_scale * (192 if D == 576 else D) ** -0.5
        with poisoned_alloc():
            out, lse = mla_decode_paged(q, kv, bt, sl, scale, causal, dv, plan=plan)
        return _decode_metrics(q, kv, bt, sl, scale, causal, dv, out, lse)
    return run


def _decode_graph_case(ctx: Ctx) -> tuple[Metrics, Metrics]:
    """Capture one call in a CUDA graph, replay it on two new input sets (new lengths, new
    pages, new values, same shapes) and compare each with the reference. Also: the call makes
    no device-to-host sync (``torch.cuda.set_sync_debug_mode('error')``)."""
    from mla.fast.decode import mla_decode_paged

    lens_sets = [[1000, 0, 65, 1], [7, 1100, 0, 64], [1200, 1200, 3, 500]]
    s_q, N, causal, scale = 2, 16, True, 192 ** -0.5
    inputs = [paged_decode_inputs(lens, s_q, N, 576, 64, ctx.dtype, ctx.device,
                                  _gen(ctx, 900 + i), spare_blocks=0)
              for i, lens in enumerate(lens_sets)]
    # one static set of buffers big enough for every set: same shapes across sets
    nb = max(x[1].shape[0] for x in inputs)
    mb = max(x[2].shape[1] for x in inputs)

    def fit(x):
        q, kv, bt, sl = x
        kv_full = torch.full((nb, 64, 576), float("nan"), dtype=kv.dtype, device=kv.device)
        kv_full[: kv.shape[0]] = kv
        bt_full = torch.full((bt.shape[0], mb), -1, dtype=torch.int32, device=bt.device)
        bt_full[:, : bt.shape[1]] = bt
        return q, kv_full, bt_full, sl

    inputs = [fit(x) for x in inputs]
    static = [t.clone() for t in inputs[0]]
    mla_decode_paged(*static, scale, causal, validate=False)  # compile outside the capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        mla_decode_paged(*static, scale, causal, validate=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = mla_decode_paged(*static, scale, causal)  # validate=None: skipped here
    metrics: Metrics = {}
    limits: Metrics = {}
    for i, x in enumerate(inputs[1:] + inputs[:1]):
        for dst, src in zip(static, x):
            dst.copy_(src)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        m, lim = _decode_metrics(*x, scale, causal, 512, out, lse)
        for k in m:
            metrics[f"{k}[{i}]"] = m[k]
            limits[f"{k}[{i}]"] = lim[k]
    return metrics, limits


@register("mla_decode_paged", "decode:mla_decode_paged")
def decode_cases(ctx: Ctx) -> Iterator[Case]:
    from mla.fast.decode import DecodePlan

    edge = [0, 1, 63, 64, 65, 1037]
    if ctx.quick:  # interpreter / sanitizer: tiny latent, few heads, short lengths
        edge_small = [0, 1, 17, 64, 65, 130]
        for i, (N, s_q, causal, bs) in enumerate([(4, 1, False, 64), (4, 2, True, 64),
                                                 (3, 3, True, 16), (20, 1, False, 16)]):
            yield Case(f"D=40/32 N={N} s_q={s_q} causal={int(causal)} page={bs}",
                       _decode_case(ctx, i, edge_small, s_q, N, causal, bs, D=40, dv=32))
        yield Case("D=576/512 N=16 s_q=2 causal page=64 lens 0,1,65",
                   _decode_case(ctx, 10, [0, 1, 65], 2, 16, True))
        yield Case("D=576/512 N=2 split=3 no-TMA",
                   _decode_case(ctx, 11, [0, 1, 65, 200], 1, 2, False,
                                plan=DecodePlan(16, 64, 3, 4, 1, use_tma=False)))
        yield Case("D=576/512 N=64 s_q=2 causal TMA split=2",
                   _decode_case(ctx, 12, [0, 1, 65, 200], 2, 64, True,
                                plan=DecodePlan(64, 32, 2, 8, 2, use_tma=True)))
        if ctx.device.type == "cuda":
            yield Case("D=576/512 N=128 s_q=1 lens 0,1,63,64,65,130 (sm_90 kernel on Hopper)",
                       _decode_case(ctx, 13, [0, 1, 63, 64, 65, 130], 1, 128, False))
            yield Case("cuda graph capture + replay, no sync", lambda: _decode_graph_case(ctx))
        return
    grid = [(N, s_q, causal, bs) for N in (16, 128) for s_q, causal in ((1, False), (2, True))
            for bs in (64, 16)]
    for i, (N, s_q, causal, bs) in enumerate(grid):
        yield Case(f"N={N} s_q={s_q} causal={int(causal)} page={bs} lens 0,1,63,64,65,1037",
                   _decode_case(ctx, i, edge, s_q, N, causal, bs))
    yield Case("N=16 s_q=2 non-causal page=64", _decode_case(ctx, 20, edge, 2, 16, False))
    yield Case("N=16 s_q=4 causal page=64 lens 0..5,2050",
               _decode_case(ctx, 21, [0, 1, 2, 3, 4, 5, 2050], 4, 16, True))
    yield Case("N=128 s_q=1 B=1 L=8191 (many splits)", _decode_case(ctx, 22, [8191], 1, 128,
                                                                       False))
    yield Case("N=16 s_q=1 B=2 L=20000,3 (many splits)",
               _decode_case(ctx, 23, [20000, 3], 1, 16, False))
    yield Case("N=128 s_q=2 causal ragged 4096,1,300", _decode_case(ctx, 24, [4096, 1, 300], 2,
                                                                    128, True))
    yield Case("N=64 s_q=1 page=1 lens 0,1,77,300",
               _decode_case(ctx, 25, [0, 1, 77, 300], 1, 64, False, block_size=1))
    yield Case("N=32 s_q=3 causal page=32 lens 2,95,1000",
               _decode_case(ctx, 26, [2, 95, 1000], 3, 32, True, block_size=32))
    yield Case("N=16 logits x30", _decode_case(ctx, 27, edge, 1, 16, False, logit_scale=30.0))
    for j, plan in enumerate([DecodePlan(64, 64, 5, 8, 2, use_tma=False),
                              DecodePlan(16, 64, 3, 4, 2, use_tma=True),
                              DecodePlan(16, 64, 2, 4, 3, use_tma=False),
                              DecodePlan(32, 32, 1, 4, 3, use_tma=True)]):
        yield Case(f"N=16 s_q=2 causal forced {plan}",
                   _decode_case(ctx, 30 + j, edge, 2, 16, True, plan=plan))
    for j, plan in enumerate([DecodePlan(64, 32, 3, 8, 2, use_tma=True),
                              DecodePlan(64, 64, 1, 8, 3, use_tma=True),
                              DecodePlan(64, 64, 2, 8, 2, use_tma=False)]):
        yield Case(f"N=128 s_q=2 causal forced {plan}",
                   _decode_case(ctx, 35 + j, edge + [3000], 2, 128, True, plan=plan))
    # the Gluon sm_90 kernel (64-row programs, page a multiple of 64): several tiles per page,
    # a partly filled last head group, s_q = 4 with the causal diagonal across a tile edge
    yield Case("N=128 s_q=4 causal page=128 lens 0,1,63,64,65,1037,4097",
               _decode_case(ctx, 43, edge + [4097], 4, 128, True, block_size=128))
    yield Case("N=96 s_q=1 page=256 lens 0,1,63,64,65,1037 (half-empty group)",
               _decode_case(ctx, 44, edge, 1, 96, False, block_size=256))
    yield Case("N=64 s_q=3 causal page=64 lens 2,3,64,66,129",
               _decode_case(ctx, 45, [2, 3, 64, 66, 129], 3, 64, True))
    yield Case("float16 N=128 s_q=2 causal", _decode_case(ctx, 40, edge, 2, 128, True,
                                                         dtype=torch.float16))
    yield Case("float32 N=16 s_q=1 lens 0,1,65,300",
               _decode_case(ctx, 41, [0, 1, 65, 300], 1, 16, False, dtype=torch.float32))
    yield Case("tiny preset D=40/32 N=4 s_q=2 causal page=16",
               _decode_case(ctx, 42, edge, 2, 4, True, 16, D=40, dv=32))
    if ctx.device.type == "cuda":
        yield Case("cuda graph capture + replay, no sync", lambda: _decode_graph_case(ctx))


# ---------------------------------------------------------------------------------------------
# merge_attn_states


@register("merge_attn_states", "merge:merge_attn_states")
def merge_cases(ctx: Ctx) -> Iterator[Case]:
    def case(salt: int, T: int, N: int, D: int) -> Callable[[], tuple[Metrics, Metrics]]:
        def run() -> tuple[Metrics, Metrics]:
            from mla.fast.merge import merge_attn_states
            from mla.reference.merge import merge_attn_states as ref

            g = _gen(ctx, salt)
            o = [torch.randn(T, N, D, generator=g).to(ctx.dtype).to(ctx.device)
                 for _ in range(2)]
            lse = [(torch.randn(N, T, generator=g) * 4).to(ctx.device) for _ in range(2)]
            # empty sides: +inf (FlashMLA), -inf, both; NaN in an empty side's output
            for k, val in enumerate((float("inf"), float("-inf"))):
                lse[k][:, k::5] = val
                o[k][k::5] = float("nan")
            lse[0][:, 4::5] = float("inf")
            lse[1][:, 4::5] = float("-inf")
            with poisoned_alloc():
                out, out_lse = merge_attn_states(o[0], lse[0], o[1], lse[1])
            r_out, r_lse = ref(o[0].double(), lse[0].double(), o[1].double(), lse[1].double())
            return ({"out_rel": rel_err(out, r_out), "lse_abs": max_abs_err(out_lse, r_lse)},
                    {"out_rel": 1e-2 if ctx.dtype != torch.float32 else 1e-5,
                     "lse_abs": LSE_ABS_TOL})
        return run

    shapes = [(37, 4, 40)] if ctx.quick else [(1, 16, 512), (1000, 16, 512), (4099, 128, 512),
                                              (333, 16, 128)]
    for i, (T, N, D) in enumerate(shapes):
        yield Case(f"T={T} N={N} D={D} (+inf/-inf/both empty)", case(50 + i, T, N, D))


# ---------------------------------------------------------------------------------------------
# paged cache: concat_and_cache_mla, gather_cache


@register("concat_and_cache_mla", "paged_cache:concat_and_cache_mla")
def concat_cases(ctx: Ctx) -> Iterator[Case]:
    def run(T: int, bs: int, salt: int) -> tuple[Metrics, Metrics]:
        from mla.fast.paged_cache import concat_and_cache_mla
        from mla.reference.paged_cache import concat_and_cache_mla as ref

        g = _gen(ctx, salt)
        nb = -(-T // bs) + 2
        slots = torch.randperm(nb * bs, generator=g)[:T].to(torch.int32)
        slots[::7] = -1  # padding tokens
        kv_c = torch.randn(T, 512, generator=g).to(ctx.dtype)
        k_pe = torch.randn(T, 64, generator=g).to(ctx.dtype)
        cache = torch.randn(nb, bs, 576, generator=g).to(ctx.dtype)
        fast_cache = cache.clone().to(ctx.device)  # on the CPU .to() alone would alias cache
        concat_and_cache_mla(kv_c.to(ctx.device), k_pe.to(ctx.device), fast_cache,
                             slots.to(ctx.device))
        ref(kv_c, k_pe, cache, slots)
        diff = (fast_cache.cpu().view(torch.int16 if cache.element_size() == 2 else torch.int32)
                != cache.view(torch.int16 if cache.element_size() == 2 else torch.int32))
        return {"mismatches": float(diff.sum())}, {"mismatches": 0.0}

    for i, (T, bs) in enumerate([(5, 16)] if ctx.quick else [(1, 64), (1000, 64), (333, 16)]):
        yield Case(f"T={T} page={bs} (slot -1 skipped)", lambda T=T, bs=bs, i=i: run(T, bs, 60 + i))


@register("gather_cache", "paged_cache:gather_cache")
def gather_cases(ctx: Ctx) -> Iterator[Case]:
    def run(lens: list[int], starts: list[int], bs: int, salt: int) -> tuple[Metrics, Metrics]:
        from mla.fast.paged_cache import gather_cache
        from mla.reference.paged_cache import gather_cache as ref
        from mla.reference.paged_cache import make_block_table

        g = _gen(ctx, salt)
        bt, nb = make_block_table([s + n for s, n in zip(starts, lens)], bs, seed=salt)
        cache = torch.randn(nb, bs, 576, generator=g).to(ctx.dtype)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        st = torch.tensor(starts, dtype=torch.int32)
        dst = torch.full((sum(lens) + 3, 576), float("nan"), dtype=ctx.dtype)
        expect = ref(cache, dst.clone(), bt, cu, len(lens), st)
        got = gather_cache(cache.to(ctx.device), dst.to(ctx.device), bt.to(ctx.device),
                           cu.to(ctx.device), len(lens), st.to(ctx.device))
        same = got.shape == expect.shape and torch.equal(got.cpu().view(torch.int16),
                                                         expect.view(torch.int16))
        return {"mismatches": 0.0 if same else 1.0}, {"mismatches": 0.0}

    cases = [([3, 0, 17], [0, 5, 1], 16)] if ctx.quick else [
        ([1000, 0, 1, 65], [0, 7, 0, 63], 64), ([300, 129], [16, 0], 16)]
    for i, (lens, starts, bs) in enumerate(cases):
        yield Case(f"lens={lens} starts={starts} page={bs}",
                   lambda a=(lens, starts, bs, 70 + i): run(*a))


# ---------------------------------------------------------------------------------------------
# convert_req_index_to_global_index


@register("convert_req_index_to_global_index", "sparse_index:convert_req_index_to_global_index")
def convert_cases(ctx: Ctx) -> Iterator[Case]:
    def run(T: int, topk: int, bs: int, workspace: bool, salt: int) -> tuple[Metrics, Metrics]:
        from mla.fast.sparse_index import convert_req_index_to_global_index
        from mla.reference.paged_cache import make_block_table
        from mla.reference.sparse import convert_req_index_to_global_index as ref

        g = _gen(ctx, salt)
        R = 4
        bt, _ = make_block_table([3000, 100, 0, 2048], bs, seed=salt)
        req = torch.randint(R, (T,), generator=g, dtype=torch.int32)
        tok = torch.randint(-1, 3200, (T, topk), generator=g, dtype=torch.int32)
        extra = ()
        if workspace:
            ids = torch.randint(-1, 2, (T,), generator=g, dtype=torch.int32)
            extra = (ids, torch.tensor([0, 5000], dtype=torch.int32))
        expect = ref(req, bt, tok, bs, *extra)
        got = convert_req_index_to_global_index(req.to(ctx.device), bt.to(ctx.device),
                                                tok.to(ctx.device), bs,
                                                *(t.to(ctx.device) for t in extra))
        return {"mismatches": float((got.cpu() != expect).sum())}, {"mismatches": 0.0}

    cases = [(3, 20, 16, False), (3, 20, 16, True)] if ctx.quick else [
        (64, 2048, 64, False), (37, 2048, 64, True), (5, 100, 1, False)]
    for i, (T, topk, bs, ws) in enumerate(cases):
        yield Case(f"T={T} topk={topk} page={bs} workspace={int(ws)}",
                   lambda a=(T, topk, bs, ws, 80 + i): run(*a))


# ---------------------------------------------------------------------------------------------
# prefill with LSE, chunked prefill, fp8_ds_mla cache write: cases in mla/check_prefill.py


def _check_prefill_cases(name: str) -> Callable[[Ctx], Iterable[Case]]:
    def cases(ctx: Ctx) -> Iterable[Case]:
        from mla.check import prefill as check_prefill

        return getattr(check_prefill, name)(ctx, Case, poisoned_alloc, _gen)
    return cases


register("prefill_attention", "prefill:prefill_attention")(_check_prefill_cases("prefill_cases"))
register("chunked_prefill_attention", "chunked:chunked_prefill_attention")(
    _check_prefill_cases("chunked_cases"))
register("concat_and_cache_fp8_ds_mla", "fp8:concat_and_cache_fp8_ds_mla")(
    _check_prefill_cases("fp8_cache_cases"))


# sparse top-k decode (bf16 and fp8_ds_mla caches) and prefill: cases in mla/check_sparse.py
def _check_sparse_cases(name: str) -> Callable[[Ctx], Iterable[Case]]:
    def cases(ctx: Ctx) -> Iterable[Case]:
        from mla.check import sparse as check_sparse

        return getattr(check_sparse, name)(ctx, Case, poisoned_alloc, _gen)
    return cases


register("sparse_mla_decode", "sparse:sparse_mla_decode")(_check_sparse_cases("decode_cases"))
register("sparse_mla_prefill", "sparse:sparse_mla_prefill")(_check_sparse_cases("prefill_cases"))


# ---------------------------------------------------------------------------------------------


def run_checks(ctx: Ctx, kernels: list[str] | None = None,
               progress: Callable[[str], None] | None = None) -> list[Result]:
    results = []
    for kernel, (fast_path, cases) in REGISTRY.items():
        if kernels and kernel not in kernels:
            continue
        missing = _missing(fast_path)
        if missing:
            results.append(Result(kernel, "import", {}, {}, False, 0.0, missing[:500]))
            if progress:
                progress(f"FAIL {kernel}: {results[-1].error}")
            continue
        for case in cases(ctx):
            t0 = time.perf_counter()
            try:
                metrics, limits = case.run()
                passed = bool(limits) and all(metrics[k] <= limits[k] for k in limits)
                err = ""
            except Exception as e:  # a crash is a failed case, reported, not a stopped run
                metrics, limits, passed, err = {}, {}, False, f"{type(e).__name__}: {e}"
            res = Result(kernel, case.name, metrics, limits, passed,
                         time.perf_counter() - t0, err[:500])
            results.append(res)
            if progress:
                progress(f"{'PASS' if passed else 'FAIL'} {kernel}: {case.name} "
                         f"({res.seconds:.1f} s) {err[:200]}")
    return results


def _fmt(results: list[Result]) -> str:
    rows = [("kernel", "case", "errors (limit)", "pass")]
    for r in results:
        errs = ", ".join(f"{k}={v:.2e}" for k, v in r.metrics.items()) or r.error[:60]
        lim = sorted({f"{v:.0e}" for v in r.limits.values()})
        rows.append((r.kernel, r.case, f"{errs} ({'/'.join(lim)})", "yes" if r.passed else "NO"))
    widths = [min(max(len(row[i]) for row in rows), 90) for i in range(4)]
    return "\n".join("  ".join(c[:w].ljust(w) for c, w in zip(row, widths)) for row in rows)


def environment() -> dict[str, str]:
    import triton

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(),
           "triton_interpret": os.environ.get("TRITON_INTERPRET", "0")}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = str(torch.version.cuda)
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mla.check", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true",
                   help="edge-case sizes only (default on the CPU; use under compute-sanitizer)")
    p.add_argument("--kernel", action="append", help="only this kernel (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        print("on the CPU the kernels run only under TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    ctx = Ctx(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float16,
              quick=args.quick or device.type == "cpu", seed=args.seed)
    t0 = time.perf_counter()
    results = run_checks(ctx, args.kernel, progress=lambda s: print(s, file=sys.stderr,
                                                                   flush=True))
    print(_fmt(results))
    n_fail = sum(not r.passed for r in results)
    print(f"\n{len(results) - n_fail}/{len(results)} passed in "
          f"{time.perf_counter() - t0:.0f} s on {device} ({ctx.dtype})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": environment(), "dtype": str(ctx.dtype),
                       "quick": ctx.quick, "passed": n_fail == 0,
                       "results": [dataclasses.asdict(r) for r in results]}, f, indent=1)
    return 1 if n_fail or not results else 0


if __name__ == "__main__":
    sys.exit(main())
