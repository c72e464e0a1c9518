"""``python -m benchmarks.direct_call``: what a direct call of the fast decode costs beside its
kernel, and beside FlashMLA's direct call.

For each decode shape (bf16, page size 64, scattered pages, lengths = L):

- ``kernel``: the call captured in a CUDA graph and replayed (``benchmarks.common.time_graph``,
  L2 flushed before each replay): the GPU time alone, as a serving engine runs decode;
- ``default``, ``validate=False``, ``validate=True``: ``do_bench`` medians of a direct call
  (L2 flushed before each), with default arguments (``mla_decode_paged(q, cache, block_table,
  lens, scale, causal)``: value checks off unless turned on), without value checks, with them;
- ``synced``: the GPU idle before each call (a sync), so the host's launch latency is not hidden
  behind the previous work: what a user timing one call sees;
- ``host_us``: Python time per call, calls back to back (no sync inside the loop); and the same
  with the per-shape launch cache emptied before each call (``no launch cache``: the argument
  checks and the plan every call) and with the compiled kernels forgotten too (``JIT
  dispatch``: Triton's ``kernel[grid](...)`` every launch, the launch path before the cache);
- ``sink``: the kernel (graph replay) with ``attn_sink``, its cost over the kernel without, and
  its output against the sink applied to the output without it (``mla.reference.sink``);
- FlashMLA's direct call (``get_mla_metadata()`` then ``flash_mla_with_kvcache``, as a user
  calls it) and its kernel (graph replay), when ``benchmarks.peers`` has unpacked it.

Ratios per shape: each call over our kernel, our default call over FlashMLA's direct call, the
sink's kernel over the kernel without. JSON and markdown into ``--out`` (a directory).

The sparse kernels (``--kinds sparse``), the same measurements at the shapes of DeepSeek-V3.2's
sparse attention: decode on the ``fp8_ds_mla`` cache (B=64 N=128 and B=128 N=64, top-k 2048,
distinct slots of 8192 tokens per request on scattered pages) and prefill (s_q=4096
s_kv=32768 N=128 and s_q=2048 s_kv=16384 N=64, top-k 2048 distinct rows, bf16), beside
FlashMLA's ``flash_mla_with_kvcache`` with indices (direct: ``get_mla_metadata()`` each call;
kernel: one metadata object, filled by a call before the capture) and ``flash_mla_sparse_fwd``.
Each also records whether the direct launch (a hit of the launch cache), the JIT's launch and
the graph replay give the same bits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import triton.testing

from benchmarks.common import log, time_graph
from benchmarks.peer_timing import flashmla_decode
from mla.check.runner import environment
from mla.compare import rel_err
from mla.fast import decode as fast_decode
from mla.fast import sparse as fast_sparse
from mla.fast.decode import mla_decode_paged
from mla.fast.sparse import sparse_mla_decode, sparse_mla_prefill
from mla.reference.sink import apply_attn_sink

D, DV, PAGE = 576, 512, 64
SCALE = 192 ** -0.5


@dataclasses.dataclass(frozen=True)
class Shape:
    B: int
    L: int
    N: int
    s_q: int = 1
    causal: bool = False

    @property
    def name(self) -> str:
        return f"B={self.B} L={self.L} N={self.N}" + (f" s_q={self.s_q}" if self.s_q > 1 else "")


SHAPES = [Shape(128, 4096, 16), Shape(64, 16384, 16), Shape(16, 65536, 16), Shape(32, 4096, 16),
          Shape(128, 8192, 128), Shape(64, 8192, 128, s_q=2, causal=True), Shape(1, 4096, 128)]


def make_inputs(s: Shape, seed: int):
    gen = torch.Generator().manual_seed(seed)
    per = -(-s.L // PAGE)
    nb = s.B * per
    bt = torch.randperm(nb, generator=gen).to(torch.int32).view(s.B, per).cuda()
    kv = torch.randn(nb, PAGE, D, generator=gen, dtype=torch.bfloat16).cuda()
    q = torch.randn(s.B, s.s_q, s.N, D, generator=gen, dtype=torch.bfloat16).cuda()
    sl = torch.full((s.B,), s.L, dtype=torch.int32, device="cuda")
    sink = (torch.randn(s.N, generator=gen) * 2).cuda()
    return q, kv, bt, sl, sink


def bench_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def synced_us(fn, reps: int = 50) -> float:
    """Median event time of one call started on an idle GPU (host launch latency included)."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    times = []
    for _ in range(reps + 5):
        flush.zero_()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times[5:])[len(times[5:]) // 2]


def host_us(fn, calls: int = 300, before=None) -> float:
    """Python time per call, back to back; ``before`` runs (untimed share included) each call."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        if before is not None:
            before()
        fn()
    t = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return t * 1e6


def _forget_launches() -> None:
    fast_decode._launches.clear()


def _forget_compiled() -> None:
    fast_decode._launches.clear()
    for launcher in (fast_decode._triton_decode, fast_decode._triton_combine,
                     fast_decode._sm90_decode):
        if launcher is not None:
            launcher.compiled.clear()


@dataclasses.dataclass(frozen=True)
class SparseShape:
    prefill: bool
    B: int  # requests (decode) or s_q (prefill)
    N: int
    topk: int = 2048
    s_kv: int = 0  # prefill

    @property
    def name(self) -> str:
        if self.prefill:
            return f"sparse prefill s_q={self.B} s_kv={self.s_kv} N={self.N} topk={self.topk}"
        return f"sparse decode fp8 B={self.B} N={self.N} topk={self.topk}"


SPARSE_SHAPES = [SparseShape(False, 64, 128), SparseShape(False, 128, 64),
                 SparseShape(True, 4096, 128, s_kv=32768), SparseShape(True, 2048, 64, s_kv=16384)]


def _forget_sparse_launches() -> None:
    fast_sparse._launches.clear()


def _forget_sparse_compiled() -> None:
    fast_sparse._launches.clear()
    for launcher in (fast_sparse._triton_sparse, fast_sparse._triton_combine,
                     fast_sparse._sm90_sparse):
        if launcher is not None:
            launcher.compiled.clear()


def _same_bits(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x.nan_to_num(), y.nan_to_num()) for x, y in zip(a, b))


def _sparse_calls(s: SparseShape, seed: int):
    """Our call (keywords passed on) and FlashMLA's ``{"kernel", "direct"}`` (or None)."""
    from benchmarks.sparse_v4 import PAGE, _distinct_slots, _flashmla, fp8_ds_mla_cache

    gen = torch.Generator(device="cuda").manual_seed(seed)
    fm, why = _flashmla()
    if fm is None:
        log(f"  FlashMLA: {why}")
    if s.prefill:
        q = torch.randn(s.B, s.N, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        kv = torch.randn(s.s_kv, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        idx = torch.empty(s.B, s.topk, device="cuda", dtype=torch.int32)
        for a in range(0, s.B, 512):  # distinct rows per query, a block of queries at a time
            r = torch.rand(min(512, s.B - a), s.s_kv, device="cuda", generator=gen)
            idx[a:a + 512] = r.argsort(dim=1)[:, :s.topk].to(torch.int32)

        def ours(**kw):
            return sparse_mla_prefill(q, kv, idx, SCALE, DV, **kw)
        peer = None if fm is None else {
            "kernel": lambda: fm.flash_mla_sparse_fwd(q, kv[:, None], idx[:, None], SCALE, DV),
            "direct": lambda: fm.flash_mla_sparse_fwd(q, kv[:, None], idx[:, None], SCALE, DV)}
        return ours, peer
    context = 8192
    cache = fp8_ds_mla_cache(gen, s.B * context // PAGE)
    q = torch.randn(s.B, 1, s.N, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    idx = _distinct_slots(gen, s.B, s.topk, context)

    def ours(**kw):
        return sparse_mla_decode(q, cache, idx, SCALE, True, **kw)
    if fm is None:
        return ours, None
    sched, _ = fm.get_mla_metadata()

    def peer_call(meta):
        return fm.flash_mla_with_kvcache(q, cache.unsqueeze(2), None, None, DV, meta, None,
                                         SCALE, False, True, indices=idx)
    return ours, {"kernel": lambda: peer_call(sched),
                  "direct": lambda: peer_call(fm.get_mla_metadata()[0])}


def bench_sparse_shape(s: SparseShape, seed: int) -> dict:
    ours, peer = _sparse_calls(s, seed)
    default = ours
    unvalidated, validated = (lambda: ours(validate=False)), (lambda: ours(validate=True))
    _forget_sparse_compiled()
    jit_out = [t.clone() for t in unvalidated()]  # a key's first call: through the JIT
    direct_out = unvalidated()  # a hit: the kept kernels launched directly
    torch.cuda.synchronize()
    r: dict = {"shape": dataclasses.asdict(s), "name": s.name,
               "direct_equals_jit": _same_bits(jit_out, direct_out)}
    r["kernel_us"] = time_graph(unvalidated) * 1e3
    r["default_us"] = bench_us(default)
    r["validate_false_us"] = bench_us(unvalidated)
    r["validate_true_us"] = bench_us(validated)
    r["synced_default_us"] = synced_us(default)
    r["host_us"] = {"default": host_us(default), "validate=True": host_us(validated),
                    "no launch cache": host_us(default, before=_forget_sparse_launches),
                    "JIT dispatch": host_us(default, before=_forget_sparse_compiled)}
    k = r["kernel_us"]
    r["ratios"] = {"default / kernel": r["default_us"] / k,
                   "validate=False / kernel": r["validate_false_us"] / k,
                   "validate=True / kernel": r["validate_true_us"] / k,
                   "synced default / kernel": r["synced_default_us"] / k}
    if peer is not None:
        try:
            peer_out = peer["kernel"]()[0]
            torch.cuda.synchronize()
            r["rel_err_vs_flashmla"] = rel_err(direct_out[0].float(), peer_out.float())
            fm = {"direct_us": bench_us(peer["direct"]), "kernel_us": time_graph(peer["kernel"])
                  * 1e3, "synced_direct_us": synced_us(peer["direct"])}
            r["FlashMLA"] = fm
            r["ratios"]["default / FlashMLA direct"] = r["default_us"] / fm["direct_us"]
            r["ratios"]["synced default / FlashMLA synced direct"] = (
                r["synced_default_us"] / fm["synced_direct_us"])
            r["ratios"]["kernel / FlashMLA kernel"] = k / fm["kernel_us"]
        except Exception as e:  # a peer that refuses the shape: report, go on
            r["FlashMLA"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    log(f"{s.name}: kernel {k:.1f} us, default {r['default_us']:.1f}, validate=False "
        f"{r['validate_false_us']:.1f}, validate=True {r['validate_true_us']:.1f}, synced "
        f"{r['synced_default_us']:.1f}, host {r['host_us']}; direct == JIT "
        f"{r['direct_equals_jit']}; FlashMLA {r.get('FlashMLA')}")
    return r


def bench_shape(s: Shape, seed: int) -> dict:
    q, kv, bt, sl, sink = make_inputs(s, seed)

    def call(**kw):
        return lambda: mla_decode_paged(q, kv, bt, sl, SCALE, s.causal, DV, **kw)

    default, unvalidated, validated = call(), call(validate=False), call(validate=True)
    with_sink = call(validate=False, attn_sink=sink)
    out, lse = unvalidated()
    out_sink, lse_sink = with_sink()
    expected = apply_attn_sink(out.double(), lse.transpose(1, 2).double(), sink)
    r: dict = {"shape": dataclasses.asdict(s), "name": s.name}
    r["sink_rel_err"] = rel_err(out_sink.double(), expected)
    r["sink_lse_equal"] = bool(torch.equal(lse, lse_sink))
    r["kernel_us"] = time_graph(unvalidated) * 1e3
    r["kernel_sink_us"] = time_graph(with_sink) * 1e3
    r["default_us"] = bench_us(default)
    r["validate_false_us"] = bench_us(unvalidated)
    r["validate_true_us"] = bench_us(validated)
    r["synced_default_us"] = synced_us(default)
    r["host_us"] = {"default": host_us(default), "validate=True": host_us(validated),
                    "no launch cache": host_us(default, before=_forget_launches),
                    "JIT dispatch": host_us(default, before=_forget_compiled)}
    k = r["kernel_us"]
    r["ratios"] = {"default / kernel": r["default_us"] / k,
                   "validate=False / kernel": r["validate_false_us"] / k,
                   "validate=True / kernel": r["validate_true_us"] / k,
                   "synced default / kernel": r["synced_default_us"] / k,
                   "sink kernel / kernel": r["kernel_sink_us"] / k}
    peer = flashmla_decode(q, kv, bt, sl, SCALE, s.causal, DV)
    if peer is not None:
        try:
            peer["kernel"]()
            torch.cuda.synchronize()
            fm = {"direct_us": bench_us(peer["direct"]), "kernel_us": time_graph(peer["kernel"])
                  * 1e3, "synced_direct_us": synced_us(peer["direct"])}
            r["FlashMLA"] = fm
            r["ratios"]["default / FlashMLA direct"] = r["default_us"] / fm["direct_us"]
            r["ratios"]["synced default / FlashMLA synced direct"] = (
                r["synced_default_us"] / fm["synced_direct_us"])
            r["ratios"]["kernel / FlashMLA kernel"] = k / fm["kernel_us"]
        except Exception as e:  # a peer that refuses the shape: report, go on
            r["FlashMLA"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    log(f"{s.name}: kernel {k:.1f} us, default {r['default_us']:.1f}, validate=False "
        f"{r['validate_false_us']:.1f}, validate=True {r['validate_true_us']:.1f}, synced "
        f"{r['synced_default_us']:.1f}, host {r['host_us']['default']:.1f} us; sink "
        f"{r['ratios']['sink kernel / kernel']:.3f}x (rel err {r['sink_rel_err']:.1e}); "
        f"FlashMLA {r.get('FlashMLA')}")
    return r


def markdown(res: dict) -> str:
    env = res["environment"]
    lines = [f"# Direct-call cost of the fast decode and sparse kernels, {env.get('gpu', '?')}, "
             f"{env['date']}", "",
             f"torch {env['torch']}, triton {env['triton']}. bf16, page size 64. µs: kernel = "
             "CUDA-graph replay; calls = do_bench medians (L2 flushed); synced = one call on an "
             "idle GPU; host = Python time per call.", "",
             "| shape | kernel | default | validate=False | validate=True | synced | host "
             "(default / no launch cache / JIT dispatch) | default / kernel | sink kernel / "
             "kernel | FlashMLA direct (synced) | FlashMLA kernel | default / FlashMLA direct | "
             "kernel / FlashMLA kernel |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["shapes"]:
        h, x = r["host_us"], r["ratios"]
        fm = r.get("FlashMLA", {})
        fm_s = (f"{fm['direct_us']:.1f} ({fm['synced_direct_us']:.1f})" if "direct_us" in fm
                else fm.get("error", "not importable")[:40])
        nan = float("nan")
        lines.append(
            f"| {r['name']} | {r['kernel_us']:.1f} | {r['default_us']:.1f} | "
            f"{r['validate_false_us']:.1f} | {r['validate_true_us']:.1f} | "
            f"{r['synced_default_us']:.1f} | {h['default']:.1f} / {h['no launch cache']:.1f} / "
            f"{h['JIT dispatch']:.1f} | {x['default / kernel']:.3f} | "
            f"{x.get('sink kernel / kernel', nan):.3f} | {fm_s} | "
            f"{fm.get('kernel_us', nan):.1f} | {x.get('default / FlashMLA direct', nan):.2f} | "
            f"{x.get('kernel / FlashMLA kernel', nan):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.direct_call")
    p.add_argument("--out", default="benchmarks/results", help="output directory")
    p.add_argument("--kinds", nargs="*", choices=("dense", "sparse"),
                   default=["dense", "sparse"], help="the dense decode's shapes, the sparse ones")
    p.add_argument("--shapes", type=int, nargs="*",
                   help="indices into the chosen kinds' shapes (default: all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    chosen = (SHAPES if "dense" in args.kinds else []) + (
        SPARSE_SHAPES if "sparse" in args.kinds else [])
    shapes = chosen if not args.shapes else [chosen[i] for i in args.shapes]
    res = {"environment": environment(), "shapes": []}
    os.makedirs(args.out, exist_ok=True)
    kinds = "" if len(set(args.kinds)) == 2 else "_" + args.kinds[0]
    stem = os.path.join(args.out, f"direct_call{kinds}_{res['environment']['date'][:10]}")
    for s in shapes:
        try:
            res["shapes"].append(bench_sparse_shape(s, args.seed) if isinstance(s, SparseShape)
                                 else bench_shape(s, args.seed))
        except Exception as e:  # report the shape, go on with the next
            log(f"{s.name}: failed: {type(e).__name__}: {str(e)[:500]}")
            res["shapes"].append({"name": s.name, "error": f"{type(e).__name__}: {e}"[:2000]})
        torch.cuda.empty_cache()
        ok = [r for r in res["shapes"] if "error" not in r]
        with open(stem + ".json", "w") as f:  # after every shape: a cut-short run keeps them
            json.dump(res, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(markdown({**res, "shapes": ok}))
    print(markdown({**res, "shapes": ok}))
    return 0 if len(ok) == len(res["shapes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
