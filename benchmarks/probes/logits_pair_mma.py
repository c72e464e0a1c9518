"""Probe: the ragged prefill logits' Gluon kernel with one ``wgmma`` of N = 128 a tile (both
queries' 64 heads, interleaved: column ``2h + query``), against the shipped kernel's two
chains of N = 64 (``mla.fast.sm90.logits``). Each ``m64nNk32`` FP8 ``wgmma`` reads its A tile
(the keys, 2 KB) and its B tile (``N x 32`` codes) from shared memory: at N = 64 that is
4 KB for 262K FLOPs, 128 bytes a clock at the tensor cores' rate, the shared memory's whole
bandwidth; at N = 128, 96 bytes a clock. The two queries of a column pair sit in one
thread's register pair, so the sum over heads splits them with ``gl.split`` and no data
moves. Without a second accumulator the program's epilogue no longer overlaps its own
``wgmma``; the other programs of the SM (``PROGRAMS_PER_SM``) do. ``AHEAD`` (the
``pair_ahead`` rows) keeps two accumulators so that it does: 179 registers against 111, two
programs a SM.

``python -m benchmarks.probes.logits_pair_mma``: the five ragged shapes of
``benchmarks.indexer`` (rows compressed, as DeepGEMM writes them), the shipped kernel and
this one in alternation, beside DeepGEMM where it loads; each answer compared with the
shipped kernel's in ``mla.compare.logits_err``'s measure. ``--compile`` compiles it for
sm_90 on the CPU and prints its resources. ``$OUT/logits_pair_mma.json``."""

from __future__ import annotations

import json
import os
import sys

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mla.fast.sm90.logits import _query_range, _seen_written
from mla.fast.sm90.softmax import barrier


@gluon.jit
def _pair_out(acc, w2, k_scale, keys, out0, out1, lo0, vis0, lo1, vis1, span, N, ok0, ok1,
              row_layout: gl.constexpr, COMPRESSED: gl.constexpr):
    """Both queries' logits of a tile from ``acc [64 keys, 128]`` (column ``2h + query``)."""
    p = gl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL) * w2[None, :]
    p0, p1 = gl.split(gl.reshape(p, [acc.shape[0], acc.shape[1] // 2, 2]))
    v0 = gl.convert_layout(gl.sum(p0, axis=1), row_layout) * k_scale
    v1 = gl.convert_layout(gl.sum(p1, axis=1), row_layout) * k_scale
    seen, written = _seen_written(keys, lo0, vis0, span, N, ok0, COMPRESSED)
    gl.store(out0 + keys, gl.where(seen, v0, float("-inf")), mask=written)
    seen, written = _seen_written(keys, lo1, vis1, span, N, ok1, COMPRESSED)
    gl.store(out1 + keys, gl.where(seen, v1, float("-inf")), mask=written)
    return p


@gluon.jit
def _ahead_tile(acc, k_buf, ready, k_desc, w2, K_SCALE, col0, first, i, last, rows, out0, out1,
                lo0, vis0, lo1, vis1, span, N, ok0, ok1, row_layout: gl.constexpr,
                STAGES: gl.constexpr, COMPRESSED: gl.constexpr):
    """Tile ``i``'s chain waited for (one left in flight), its buffer refilled, its epilogue
    (stored only where ``i < last``)."""
    BN: gl.constexpr = 64
    a = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    barrier()
    if i + STAGES < last:
        s = (i - first) % STAGES
        mbarrier.expect(ready.index(s), BN * 128)
        tma.async_copy_global_to_shared(k_desc, [(col0 + (i + STAGES) * BN).to(gl.int32), 0],
                                        ready.index(s), k_buf.index(s))
    start = col0 + i * BN
    keys = start + rows
    k_scale = gl.load(K_SCALE + keys, mask=keys < N, other=0.0)
    live = i < last
    return _pair_out(a, w2, k_scale, keys, out0, out1, lo0, vis0, lo1, vis1, span, N,
                     ok0 & live, ok1 & live, row_layout, COMPRESSED)


@gluon.jit
def _issue(k_buf, ready, qt, acc, first, i, last, STAGES: gl.constexpr):
    """Tile ``i``'s chain issued (its buffer waited for where ``i < last``)."""
    s = (i - first) % STAGES
    if i < last:
        mbarrier.wait(ready.index(s), ((i - first) // STAGES) & 1)
    return warpgroup_mma(k_buf.index(s), qt, acc, use_acc=False, is_async=True)


@gluon.jit
def _ahead_loop(k_buf, ready, k_desc, qt, w2, K_SCALE, col0, first, last, rows, out0, out1,
                lo0, vis0, lo1, vis1, span, N, ok0, ok1, row_layout: gl.constexpr,
                mma: gl.constexpr, STAGES: gl.constexpr, COMPRESSED: gl.constexpr):
    """Tiles in pairs, two chains in flight: a tile's epilogue runs under the next's chain."""
    pa = gl.zeros([64, 128], gl.float32, layout=mma)
    pb = gl.zeros([64, 128], gl.float32, layout=mma)
    pa = _issue(k_buf, ready, qt, pa, first, first, last, STAGES)
    for j in range(first, last, 2):
        pb = _issue(k_buf, ready, qt, pb, first, j + 1, last, STAGES)
        pa = _ahead_tile(pa, k_buf, ready, k_desc, w2, K_SCALE, col0, first, j, last, rows,
                         out0, out1, lo0, vis0, lo1, vis1, span, N, ok0, ok1, row_layout,
                         STAGES, COMPRESSED)
        pa = _issue(k_buf, ready, qt, pa, first, j + 2, last, STAGES)
        pb = _ahead_tile(pb, k_buf, ready, k_desc, w2, K_SCALE, col0, first, j + 1, last, rows,
                         out0, out1, lo0, vis0, lo1, vis1, span, N, ok0, ok1, row_layout,
                         STAGES, COMPRESSED)
    pa = warpgroup_mma_wait(num_outstanding=0, deps=(pa,))


@gluon.jit(do_not_specialize=["M"])
def pair_logits_kernel(
    Q, W, CODES, K_SCALE, KS, KE, OUT,
    S, N, M, chunk, splits, TILES,
    s_q_t, s_q_h, s_w_t, s_c_n,
    STAGES: gl.constexpr, COMPRESSED: gl.constexpr, AHEAD: gl.constexpr = False,
):
    """``mla.fast.sm90.logits.ragged_logits_kernel``'s arguments and grid; one ``wgmma``
    chain of N = 128 a tile. ``AHEAD``: two accumulators, the next tile's chain issued before
    this tile's epilogue (tiles in pairs; past ``last`` a chain over a stale buffer whose
    logits are not stored)."""
    H: gl.constexpr = 64
    D: gl.constexpr = 128
    BN: gl.constexpr = 64
    TILE_BYTES: gl.constexpr = BN * D

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 2 * H, 32])
    ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8],
                                        warps_per_cta=[4, 1], order=[1, 0])
    fill: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                          warps_per_cta=[4], order=[0])
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                              rank=2)
    fp8: gl.constexpr = CODES.dtype.element_ty

    t0 = gl.program_id(0).to(gl.int64) * 2
    ok0 = t0 < S
    ok1 = t0 + 1 < S
    lo0, hi0 = _query_range(KS, KE, t0, ok0, COMPRESSED)
    lo1, hi1 = _query_range(KS, KE, t0 + 1, ok1, COMPRESSED)
    if COMPRESSED:
        slot = gl.program_id(1) // splits
        if (slot == 1) & ((not ok1) | (lo1 == lo0)):
            return
        lead = gl.where(slot == 0, lo0, lo1)
        ok0 = ok0 & (lo0 == lead)
        ok1 = ok1 & (lo1 == lead)
        lo0 = gl.where(ok0, lo0, -(1 << 30))
        hi0 = gl.where(ok0, hi0, -(1 << 30))
        lo1 = gl.where(ok1, lo1, -(1 << 30))
        hi1 = gl.where(ok1, hi1, -(1 << 30))
        col0 = lead.to(gl.int64) + (gl.program_id(1) % splits).to(gl.int64) * chunk
        span = M.to(gl.uint32)
        vis0 = gl.maximum(hi0 - lo0, 0).to(gl.uint32)
        vis1 = gl.maximum(hi1 - lo1, 0).to(gl.uint32)
        out0 = OUT + t0 * M - lo0
        out1 = OUT + (t0 + 1) * M - lo1
    else:
        col0 = gl.program_id(1).to(gl.int64) * chunk
        span = hi0  # (unused)
        vis0 = hi0
        vis1 = hi1
        out0 = OUT + t0 * M
        out1 = OUT + (t0 + 1) * M
    lo_any = gl.minimum(gl.where(ok0, lo0, N), gl.where(ok1, lo1, N))
    hi_any = gl.maximum(gl.where(ok0, hi0, 0), gl.where(ok1, hi1, 0))
    first = gl.minimum(gl.maximum(lo_any - col0, 0) // BN, TILES).to(gl.int32)
    last = gl.maximum(gl.minimum(gl.cdiv(gl.maximum(hi_any - col0, 0), BN), TILES),
                      first).to(gl.int32)

    if last > first:
        q_smem = gl.allocate_shared_memory(fp8, [2 * H, D], smem)
        k_buf = gl.allocate_shared_memory(fp8, [STAGES, BN, D], smem)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
        k_desc = tma.make_tensor_descriptor(CODES, shape=[N, D], strides=[s_c_n, 1],
                                            block_shape=[BN, D], layout=smem)
        # row r of the B operand: query r % 2's head r // 2 (zeros past S)
        r = gl.arange(0, 2 * H, layout=gl.SliceLayout(1, ld))
        t = t0 + r % 2
        d = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        x = gl.load(Q + t[:, None] * s_q_t + (r // 2)[:, None] * s_q_h + d[None, :],
                    mask=(t < S)[:, None], other=0.0)
        q_smem.store(x)
        c = gl.arange(0, 2 * H, layout=gl.SliceLayout(0, mma))
        tc = t0 + c % 2
        w2 = gl.load(W + tc * s_w_t + c // 2, mask=((c % 2 == 0) & ok0) | ((c % 2 == 1) & ok1),
                     other=0.0)
        fence_async_shared()
        barrier()
        for j in gl.static_range(STAGES):
            if first + j < last:
                mbarrier.expect(ready.index(j), TILE_BYTES)
                tma.async_copy_global_to_shared(k_desc, [(col0 + (first + j) * BN).to(gl.int32),
                                                         0], ready.index(j), k_buf.index(j))
        qt = q_smem.permute((1, 0))
        row_layout: gl.constexpr = gl.SliceLayout(1, mma)
        rows = gl.arange(0, BN, layout=row_layout)
        if AHEAD:
            _ahead_loop(k_buf, ready, k_desc, qt, w2, K_SCALE, col0, first, last, rows, out0,
                        out1, lo0, vis0, lo1, vis1, span, N, ok0, ok1, row_layout, mma,
                        STAGES, COMPRESSED)
        else:
            p = gl.zeros([BN, 2 * H], gl.float32, layout=mma)
            for i in range(first, last):
                it = i - first
                s = it % STAGES
                start = col0 + i * BN
                keys = start + rows
                k_scale = gl.load(K_SCALE + keys, mask=keys < N, other=0.0)
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                k_s = k_buf.index(s)
                a = warpgroup_mma(k_s, qt, p, use_acc=False, is_async=True)
                a = warpgroup_mma_wait(num_outstanding=0, deps=(a,))
                barrier()  # every warp's share of the dot has read buffer s
                if i + STAGES < last:
                    mbarrier.expect(ready.index(s), TILE_BYTES)
                    at = (start + STAGES * BN).to(gl.int32)
                    tma.async_copy_global_to_shared(k_desc, [at, 0], ready.index(s), k_s)
                p = _pair_out(a, w2, k_scale, keys, out0, out1, lo0, vis0, lo1, vis1, span, N,
                              ok0, ok1, row_layout, COMPRESSED)
        for j in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(j))
    for i in range(0, TILES):
        if (i < first) | (i >= last):
            keys = col0 + i * BN + gl.arange(0, BN, layout=fill)
            minus = gl.full([BN], float("-inf"), gl.float32, layout=fill)
            _seen, written = _seen_written(keys, lo0, vis0, span, N, ok0, COMPRESSED)
            gl.store(out0 + keys, minus, mask=written)
            _seen, written = _seen_written(keys, lo1, vis1, span, N, ok1, COMPRESSED)
            gl.store(out1 + keys, minus, mask=written)


class _Ahead:
    """``pair_logits_kernel`` launched with ``AHEAD=True`` (as ``sm90.launch`` calls it)."""

    __name__ = "pair_ahead_logits_kernel"

    def __getitem__(self, grid):
        return lambda *a, **k: pair_logits_kernel[grid](*a, AHEAD=True, **k)


def compile_for_sm90(COMPRESSED: bool = True, AHEAD: bool = False) -> dict:
    """The probe kernel compiled for sm_90 as ``benchmarks.sm90_compile.compile_logits``
    compiles the shipped one; its ``facts``."""
    import triton

    from benchmarks import sm90_compile as sc
    from mla.fast.sm90 import logits as sm90_logits

    const = dict(STAGES=sm90_logits.STAGES, COMPRESSED=COMPRESSED, AHEAD=AHEAD)
    ptrs = dict(Q="fp8e4nv", W="fp32", CODES="fp8e4nv", K_SCALE="fp32", KS="i32", KE="i32",
                OUT="fp32")
    ints = dict(S=4096, N=32768, M=32768, chunk=2048, splits=16, TILES=32, s_q_t=64 * 128,
                s_q_h=128, s_w_t=64, s_c_n=128)
    src = sc._specialize(pair_logits_kernel, const, ptrs, {}, ints)
    k = triton.compile(src, target=sc.TARGET, options={"num_warps": sm90_logits.NUM_WARPS})
    return sc.facts(k)


def run(reps: int = 3) -> dict:
    """Both kernels on the five ragged shapes, in alternation, beside DeepGEMM."""
    import functools

    import torch

    import mla.fast.sm90 as sm90
    from benchmarks.common import time_graph
    from benchmarks.indexer import PREFILL_SHAPES, D, H, fp8_matmul_tflops, ragged_inputs
    from mla.compare import logits_err
    from mla.conformance.adapters import deepgemm
    from mla.environment import environment
    from mla.fast import fp8_mqa_logits
    from mla.fast.sm90 import logits as sm90_logits

    shipped = sm90_logits.ragged_logits_kernel
    try:
        dg = deepgemm.load()
    except Exception as e:  # noqa: BLE001 - recorded, not raised
        dg, why = None, f"{type(e).__name__}: {e}"
    else:
        why = ""
    res = {"environment": environment(), "fp8_TFLOPs": fp8_matmul_tflops(), "deepgemm": why or
           "loaded", "rows": []}
    for name, requests, queries in PREFILL_SHAPES:
        q8, kv, w, ks, ke = ragged_inputs(requests, queries)
        longest = int((ke - ks).max())
        pairs = int((ke - ks).long().sum())
        flops = 2 * pairs * H * D
        call = functools.partial(fp8_mqa_logits, q8, kv, w, ks, ke, longest)
        sm90_logits.ragged_logits_kernel = shipped
        want = call()
        mag = fp8_mqa_logits(q8, kv, w.abs(), ks, ke, longest)
        row = {"shape": name, "S": len(ks), "pairs": pairs}
        kernels = (("shipped", shipped), ("pair", pair_logits_kernel), ("pair_ahead", _Ahead()))
        for label, kern in kernels[1:]:
            sm90_logits.ragged_logits_kernel = kern
            got = call()
            assert not sm90._unbuilt, f"a Gluon kernel failed to build: {sm90._unbuilt}"
            row[f"{label}_err_vs_shipped"] = logits_err(got, want, mag)
            row[f"{label}_max_abs_diff"] = float((got - want).nan_to_num(0, 0, 0).abs().max())
            row[f"{label}_same_inf"] = bool(torch.equal(torch.isinf(got), torch.isinf(want)))
        times = {label: [] for label, _ in kernels} | {"deepgemm": []}
        for _ in range(reps):
            for label, kern in kernels:
                sm90_logits.ragged_logits_kernel = kern
                times[label].append(time_graph(call))
            if dg is not None:
                times["deepgemm"].append(time_graph(functools.partial(
                    dg.fp8_fp4_mqa_logits, (q8, None), kv, w, ks, ke, longest)))
        sm90_logits.ragged_logits_kernel = shipped
        for label, ts in times.items():
            if ts:
                ms = sorted(ts)[len(ts) // 2]
                row[f"{label}_ms"] = ms
                row[f"{label}_pct_fp8"] = 100 * flops / (ms * 1e-3) / 1e12 / res["fp8_TFLOPs"]
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
    return res


def main(argv: list[str]) -> int:
    if "--compile" in argv:
        for compressed in (True, False):
            for ahead in (False, True):
                print(compressed, ahead, compile_for_sm90(compressed, ahead))
        return 0
    res = run()
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "logits_pair_mma.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
