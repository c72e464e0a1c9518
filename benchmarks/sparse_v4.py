"""DeepSeek-V4's sparse kernels beside FlashMLA's (``python -m benchmarks.sparse --v4``).

Two questions, each timed on the same inputs for ``mla.fast`` and FlashMLA (vLLM 0.33.0's copy,
unpacked by ``benchmarks.peers``; a shape it refuses is recorded with its error):

- **What a sink costs** (target <= 2% of the kernel's time): the same call with and without
  ``attn_sink``, sparse decode on the ``fp8_ds_mla`` cache (B=64, N=128, top-k 2048) and
  MODEL1 sparse decode with the default plan's kernel (B=64, N=64 and 128, top-k 2048, per-head
  sinks as in the MODEL1 rows), and sparse prefill (s_q=2048, s_kv=16384, N=128: rows of 576
  with top-k 2048, and DeepSeek-V4's rows of 512 with top-k 512).
- **MODEL1 sparse decode** (target <= 1.2 x FlashMLA's time) at DeepSeek-V4-like shapes: B=64,
  N in {64, 128}, top-k in {512, 2048}, without and with a second scope of 128 entries (pages
  of 64 in both caches), per-head sinks as DeepSeek-V4 uses them.

Inputs: every request owns 8192 tokens on scattered pages and picks distinct slots of them;
MODEL1 pages hold random e4m3 bytes (no NaN code), UE8M0 scales 2^-9..2^-6, bf16 rope values.
Our output is compared with the float64 reference on two requests, and with FlashMLA's on all
of them.

Time, two ways for each side (``validate=False``; FlashMLA with its scheduler metadata made once
per shape, as an engine does, and filled by one call before anything is timed or captured):

- **graph**: the call captured in a CUDA graph and replayed (``benchmarks.common.time_graph``,
  L2 flushed outside the timing): the kernels' GPU time alone, as a serving engine runs decode;
  the ratios to FlashMLA and the sink's cost are taken on these (kernel against kernel);
- **direct**: ``triton.testing.do_bench`` median of a Python call (L2 flushed before each): the
  events start while the flush runs, so a call's host time beyond the flush's shows up (what a
  user timing a call sees).

The MODEL1 rows also time, in graphs, the Triton kernel with the default split count, and with
``--sweep`` the Gluon kernel with other split counts and with one staging buffer (the plan's
``num_stages`` 1): the evidence behind ``plan_sparse``'s choices.

``python -m benchmarks.sparse_v4 --out DIR`` times the MODEL1 rows with every Gluon MODEL1
kernel a plan can name (``SparsePlan.model1_kernel``, ``mla.fast.sparse.plan.MODEL1_KERNELS``)
beside the default plan and FlashMLA, each variant's error against the reference too.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton.testing

from benchmarks.common import log, time_graph
from mla.compare import rel_err
from mla.fast.common import num_sms
from mla.fast.sparse import plan_sparse, sparse_mla_decode, sparse_mla_prefill
from mla.fast.sparse.plan import MODEL1_KERNELS
from mla.reference.fp8 import FP8_DS_MLA_BYTES
from mla.reference.fp8_model1 import fp8_model1_cache, fp8_model1_page_bytes

__all__ = ["run_v4", "markdown_v4"]

SCALE = 192 ** -0.5
PAGE = 64
CONTEXT = 8192  # tokens per request


@dataclasses.dataclass(frozen=True)
class V4Shape:
    name: str
    kind: str  # "model1", "sink_decode", "sink_model1", "sink_prefill"
    B: int  # requests (decode) or s_q (prefill)
    N: int
    topk: int
    extra_topk: int = 0
    target: float = 0.0  # ours / FlashMLA (model1) or sink overhead (sink_*), at most
    d: int = 576  # the prefill's row width (576: DeepSeek-V3.2; 512: DeepSeek-V4, V the row)


SHAPES = [
    *(V4Shape(f"MODEL1 decode B64 N{n} topk{k}" + (f" + scope {e}" if e else ""), "model1",
              64, n, k, e, target=1.2)
      for n in (64, 128) for k in (512, 2048) for e in (0, 128)),
    V4Shape("sink cost: decode fp8_ds_mla B64 N128 topk2048", "sink_decode", 64, 128, 2048,
            target=0.02),
    *(V4Shape(f"sink cost: decode MODEL1 B64 N{n} topk2048", "sink_model1", 64, n, 2048,
              target=0.02) for n in (64, 128)),
    V4Shape("sink cost: prefill s_q2048 s_kv16384 N128 topk2048", "sink_prefill", 2048, 128,
            2048, target=0.02),
    V4Shape("sink cost: prefill d512 s_q2048 s_kv16384 N128 topk512", "sink_prefill", 2048,
            128, 512, target=0.02, d=512),
]


def _distinct_slots(gen: torch.Generator, B: int, k: int, context: int) -> torch.Tensor:
    """``[B, 1, k]`` int32 slots: ``k`` distinct tokens of each request's own scattered pages."""
    pages_per = context // PAGE
    perm = torch.randperm(B * pages_per, device="cuda", generator=gen).view(B, pages_per)
    local = torch.rand(B, context, device="cuda", generator=gen).argsort(dim=1)[:, :k]
    slots = perm.gather(1, local // PAGE) * PAGE + local % PAGE
    return slots.to(torch.int32).view(B, 1, k)


def model1_pages(gen: torch.Generator, nb: int) -> torch.Tensor:
    """``[nb, 64, 584]`` MODEL1 view of random valid pages."""
    page_bytes = fp8_model1_page_bytes(PAGE)
    pages = torch.randint(0, 256, (nb, page_bytes), device="cuda", dtype=torch.uint8,
                          generator=gen)
    data = pages[:, :576 * PAGE].view(nb, PAGE, 576)
    data[..., :448] &= 0xFE  # e4m3 without the NaN codes 0x7F / 0xFF
    rope = torch.randn(nb, PAGE, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    data[..., 448:] = rope.view(torch.uint8)
    scales = pages[:, 576 * PAGE:584 * PAGE].view(nb, PAGE, 8)
    scales.copy_(torch.randint(118, 122, scales.shape, device="cuda", dtype=torch.uint8,
                               generator=gen))
    return fp8_model1_cache(pages, PAGE)


def fp8_ds_mla_cache(gen: torch.Generator, nb: int) -> torch.Tensor:
    cache = torch.randint(0, 256, (nb, PAGE, FP8_DS_MLA_BYTES), device="cuda",
                          dtype=torch.uint8, generator=gen)
    cache[..., :512] &= 0xFE
    scales = torch.pow(2.0, -torch.randint(7, 11, (nb, PAGE, 4), device="cuda",
                                           generator=gen).float())
    cache[..., 512:528] = scales.view(torch.uint8).view(nb, PAGE, 16)
    pe = torch.randn(nb, PAGE, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    cache[..., 528:] = pe.view(torch.uint8).view(nb, PAGE, 128)
    return cache


def _sinks(gen: torch.Generator, N: int, keys: int) -> torch.Tensor:
    return (torch.randn(N, device="cuda", generator=gen) + math.log(keys)).float()


def _bench(fn) -> float:
    """Direct call: do_bench median, µs."""
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def _graph(fn) -> float:
    """Graph replay: the kernels alone, µs."""
    return time_graph(fn, reps=40) * 1e3


def _time(row: dict, key: str, fn) -> None:
    """``row[key + "_graph_us"]`` and ``row[key + "_us"]`` (direct) of ``fn``."""
    row[key + "_graph_us"] = _graph(fn)
    row[key + "_us"] = _bench(fn)


def _flashmla():
    """FlashMLA's interface module, or the reason it cannot be imported."""
    from mla.conformance.adapters import import_peer
    from mla.conformance.adapters.flashmla import INTERFACE
    from mla.conformance.catalogue import Unsupported

    try:
        return import_peer(INTERFACE, "FlashMLA"), ""
    except Unsupported as e:
        return None, str(e)


def _time_peer(row: dict, key: str, fn) -> torch.Tensor | None:
    """Time FlashMLA's ``fn`` into ``row[key + "_graph_us"]`` and ``row[key + "_us"]`` or
    record why it failed; its output. The first call (before the capture) fills the
    scheduler metadata the captured call reads."""
    try:
        out = fn()[0].clone()
        torch.cuda.synchronize()
        _time(row, key, fn)
        return out
    except Exception as e:  # a shape or argument FlashMLA refuses: a result, not a crash
        row[key + "_error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
        log(f"  FlashMLA: {row[key + '_error']}")
        return None


def _model1(s: V4Shape, gen: torch.Generator, fm, sweep: bool = False,
            kernels: tuple[str, ...] = ()) -> dict:
    from mla.reference.sparse import sparse_mla_decode as ref_decode

    nb = s.B * CONTEXT // PAGE
    cache = model1_pages(gen, nb)
    q = torch.randn(s.B, 1, s.N, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    idx = _distinct_slots(gen, s.B, s.topk, CONTEXT)
    v4: dict = {"attn_sink": _sinks(gen, s.N, s.topk + s.extra_topk)}
    if s.extra_topk:
        window = -(-2 * s.extra_topk // PAGE) * PAGE  # the last tokens, whole pages
        v4["extra_k_cache"] = model1_pages(gen, s.B * window // PAGE)
        v4["extra_indices_in_kvcache"] = _distinct_slots(gen, s.B, s.extra_topk, window)

    def ours(plan=None):
        return sparse_mla_decode(q, cache, idx, SCALE, True, None, 512, validate=False,
                                 plan=plan, **v4)
    out = ours()[0]
    row: dict = {}
    _time(row, "ours", ours)
    # the Triton kernel on the same call (the default plan without the sm_90 route): a variant
    default = plan_sparse(s.B, s.N, s.topk + s.extra_topk, q.dtype, True, num_sms(q.device),
                          model1=True)
    row["plan"] = dataclasses.asdict(default)
    triton_plan = dataclasses.replace(default, sm90=False)
    row["ours_triton_graph_us"] = _graph(lambda: ours(triton_plan))
    row["rel_err_triton_vs_default"] = rel_err(ours(triton_plan)[0].float(), out.float())
    if sweep:  # the Gluon kernel (64-head programs) at other split counts, graph µs
        gluon = [dataclasses.replace(default, block_m=64, sm90=True, num_splits=n)
                 for n in (1, 2, 3, 4) if n != default.num_splits or not default.sm90]
        row["gluon_splits_graph_us"] = {p.num_splits: _graph(lambda p=p: ours(p))
                                        for p in gluon}
        # one MODEL1 staging buffer (the next tile's copies issued after the dequantization)
        one = dataclasses.replace(default, num_stages=1)
        row["one_staging_graph_us"] = _graph(lambda: ours(one))
        row["rel_err_one_staging_vs_default"] = rel_err(ours(one)[0].float(), out.float())
    r_out, _ = ref_decode(q[:2].double(), cache, idx[:2], SCALE, True, None, 512,
                          attn_sink=v4["attn_sink"],
                          **{k: v[:2] if k == "extra_indices_in_kvcache" else v
                             for k, v in v4.items() if k.startswith("extra")})
    row["rel_err_vs_reference"] = rel_err(out[:2], r_out)
    variants = {}
    for name in kernels:  # the same plan with another Gluon MODEL1 kernel
        plan = dataclasses.replace(default, model1_kernel=name)
        got = ours(plan)[0]
        variants[name] = {"graph_us": _graph(lambda plan=plan: ours(plan)),
                          "rel_err_vs_reference": rel_err(got[:2], r_out),
                          "rel_err_vs_default": rel_err(got.float(), out.float())}
    if variants:
        row["model1_kernels"] = variants
    if fm is not None:
        sched, _ = fm.get_mla_metadata()
        extra = v4.get("extra_k_cache")

        def peer():
            return fm.flash_mla_with_kvcache(
                q, cache.unsqueeze(2), None, None, 512, sched, None, SCALE, False, True,
                indices=idx, attn_sink=v4["attn_sink"],
                extra_k_cache=None if extra is None else extra.unsqueeze(2),
                extra_indices_in_kvcache=v4.get("extra_indices_in_kvcache"))
        peer_out = _time_peer(row, "flashmla", peer)
        if peer_out is not None:
            row["rel_err_vs_flashmla"] = rel_err(out.float(), peer_out.float())
            row["ratio"] = row["ours_graph_us"] / row["flashmla_graph_us"]
            row["ratio_direct"] = row["ours_us"] / row["flashmla_us"]
    flops = 2.0 * s.B * s.N * (s.topk + s.extra_topk) * (512 + 512)
    row["TFLOPs"] = flops / (row["ours_graph_us"] * 1e-6) / 1e12
    return row


def _sink_cost(s: V4Shape, gen: torch.Generator, fm) -> dict:
    sink = _sinks(gen, s.N, s.topk)
    row: dict = {}
    if s.kind == "sink_decode":
        nb = s.B * CONTEXT // PAGE
        cache = fp8_ds_mla_cache(gen, nb)
        q = torch.randn(s.B, 1, s.N, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
        idx = _distinct_slots(gen, s.B, s.topk, CONTEXT)

        def ours(attn_sink):
            return sparse_mla_decode(q, cache, idx, SCALE, True, validate=False,
                                     attn_sink=attn_sink)

        def peer(attn_sink, sched):
            return fm.flash_mla_with_kvcache(q, cache.unsqueeze(2), None, None, 512, sched,
                                             None, SCALE, False, True, indices=idx,
                                             attn_sink=attn_sink)
    elif s.kind == "sink_model1":
        cache = model1_pages(gen, s.B * CONTEXT // PAGE)
        q = torch.randn(s.B, 1, s.N, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
        idx = _distinct_slots(gen, s.B, s.topk, CONTEXT)

        def ours(attn_sink):
            return sparse_mla_decode(q, cache, idx, SCALE, True, None, 512, validate=False,
                                     attn_sink=attn_sink)

        def peer(attn_sink, sched):
            return fm.flash_mla_with_kvcache(q, cache.unsqueeze(2), None, None, 512, sched,
                                             None, SCALE, False, True, indices=idx,
                                             attn_sink=attn_sink)
    else:
        s_kv = 16384
        q = torch.randn(s.B, s.N, s.d, device="cuda", dtype=torch.bfloat16, generator=gen)
        kv = torch.randn(s_kv, s.d, device="cuda", dtype=torch.bfloat16, generator=gen)
        idx = torch.rand(s.B, s_kv, device="cuda", generator=gen).argsort(dim=1)[:, :s.topk]
        idx = idx.to(torch.int32)

        def ours(attn_sink):
            return sparse_mla_prefill(q, kv, idx, SCALE, 512, validate=False,
                                      attn_sink=attn_sink)

        def peer(attn_sink, sched):
            return fm.flash_mla_sparse_fwd(q, kv[:, None], idx[:, None], SCALE, 512,
                                           attn_sink=attn_sink)
    with_sink = ours(sink)[0]
    _time(row, "ours", lambda: ours(None))
    _time(row, "ours_sink", lambda: ours(sink))
    row["overhead"] = row["ours_sink_graph_us"] / row["ours_graph_us"] - 1.0
    if fm is not None:
        s1, _ = fm.get_mla_metadata()
        s2, _ = fm.get_mla_metadata()
        _time_peer(row, "flashmla", lambda: peer(None, s1))
        peer_out = _time_peer(row, "flashmla_sink", lambda: peer(sink, s2))
        if peer_out is not None:
            row["rel_err_vs_flashmla"] = rel_err(with_sink.float(), peer_out.float())
        if "flashmla_graph_us" in row and "flashmla_sink_graph_us" in row:
            row["flashmla_overhead"] = (row["flashmla_sink_graph_us"]
                                        / row["flashmla_graph_us"] - 1.0)
            row["ratio"] = row["ours_graph_us"] / row["flashmla_graph_us"]
            row["ratio_direct"] = row["ours_us"] / row["flashmla_us"]
    return row


def run_v4(seed: int = 0, names: list[str] | None = None, sweep: bool = False,
           on_row=None, kernels: tuple[str, ...] = ()) -> list[dict]:
    """Every V4 shape (``names``: substrings to select): one row each; ``sweep``: the MODEL1
    rows time the Gluon kernel at other split counts too; ``kernels``: and these Gluon MODEL1
    kernels; ``on_row(rows)`` after each row (a run cut short keeps what it measured)."""
    fm, why = _flashmla()
    if fm is None:
        log(f"FlashMLA not timed: {why}")
    rows = []
    for s in SHAPES:
        if names and not any(k in s.name for k in names):
            continue
        log(f"{s.name} ...")
        gen = torch.Generator(device="cuda").manual_seed(seed)
        try:
            row = (_model1(s, gen, fm, sweep, kernels) if s.kind == "model1"
                   else _sink_cost(s, gen, fm))
        except Exception as e:  # one shape's failure is a result; the others still run
            row = {"error": f"{type(e).__name__}: {str(e).strip()[:500]}"}
        row["shape"] = dataclasses.asdict(s)
        if s.kind == "model1" and "ratio" in row:
            row["met"] = row["ratio"] <= s.target
        elif "overhead" in row:
            row["met"] = row["overhead"] <= s.target
        log(f"  {row}")
        rows.append(row)
        if on_row is not None:
            on_row(rows)
        torch.cuda.empty_cache()
    return rows


def _f(row: dict, key: str, fmt: str) -> str:
    return format(row[key], fmt) if key in row else "-"


def _pair(row: dict, key: str) -> str:
    """``graph (direct)`` µs of ``key``, or FlashMLA's refusal."""
    if key + "_graph_us" in row:
        return f"{row[key + '_graph_us']:.1f} ({row[key + '_us']:.1f})"
    return "refused: " + row.get(key + "_error", "not importable")[:80]


def markdown_v4(rows: list[dict]) -> list[str]:
    lines = ["## DeepSeek-V4: sinks and the MODEL1 cache beside FlashMLA", "",
             "µs: CUDA-graph replay (direct call in brackets, do_bench). Ratios: ours / "
             "FlashMLA on the graph times (kernel against kernel), then on the direct calls.",
             "", "| shape | ours µs | FlashMLA µs | ours / FlashMLA | direct ratio | TFLOP/s | "
             "err vs ref | err vs FlashMLA | target | met |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    variants = ["", "Variants of the MODEL1 calls, graph µs: the Triton kernel (sm_90 route "
                "off) and, with --sweep, the Gluon kernel at other split counts.", "",
                "| shape | default plan | default | Triton | Triton / default | Gluon splits | "
                "one staging buffer |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        s = r["shape"]
        if "error" in r:
            lines.append(f"| {s['name']} | error: {r['error'][:120]} | | | | | | | | |")
            continue
        if s["kind"] == "model1":
            lines.append(
                f"| {s['name']} | {_pair(r, 'ours')} | {_pair(r, 'flashmla')} | "
                f"{_f(r, 'ratio', '.2f')} | {_f(r, 'ratio_direct', '.2f')} | "
                f"{r['TFLOPs']:.0f} | {r['rel_err_vs_reference']:.1e} | "
                f"{_f(r, 'rel_err_vs_flashmla', '.1e')} | <= {s['target']} x | "
                f"{'yes' if r.get('met') else 'no'} |")
            p = r["plan"]
            plan = (f"{'Gluon' if p['sm90'] and p['block_m'] == 64 else 'Triton'} "
                    f"m{p['block_m']} n{p['block_n']} splits {p['num_splits']}")
            sweep = ", ".join(f"{n}: {t:.1f}" for n, t in
                              r.get("gluon_splits_graph_us", {}).items())
            variants.append(f"| {s['name']} | {plan} | {r['ours_graph_us']:.1f} | "
                            f"{r['ours_triton_graph_us']:.1f} | "
                            f"{r['ours_triton_graph_us'] / r['ours_graph_us']:.2f} | "
                            f"{sweep or '-'} | {_f(r, 'one_staging_graph_us', '.1f')} |")
        else:
            ours = (f"{r['ours_graph_us']:.1f} → {r['ours_sink_graph_us']:.1f} with sink "
                    f"({r['ours_us']:.1f} → {r['ours_sink_us']:.1f})")
            peer = (f"{r['flashmla_graph_us']:.1f} → {r['flashmla_sink_graph_us']:.1f} "
                    f"({r['flashmla_us']:.1f} → {r['flashmla_sink_us']:.1f})"
                    if "flashmla_sink_graph_us" in r else "-")
            lines.append(
                f"| {s['name']} | {ours} ({100 * r['overhead']:+.1f}%) | {peer} "
                f"({_f(r, 'flashmla_overhead', '+.1%')}) | {_f(r, 'ratio', '.2f')} | "
                f"{_f(r, 'ratio_direct', '.2f')} | | | "
                f"{_f(r, 'rel_err_vs_flashmla', '.1e')} | sink <= {100 * s['target']:.0f}% | "
                f"{'yes' if r.get('met') else 'no'} |")
    return lines + variants


def _cell(us: float, err: float, peer: float | None) -> str:
    ratio = f" ({us / peer:.2f})" if peer else ""
    return f"{us:.1f}{ratio} [{err:.1e}]"


def markdown_kernels(rows: list[dict]) -> list[str]:
    """The MODEL1 rows' Gluon kernels: graph µs, ``/ FlashMLA``, error against the reference."""
    names = sorted({k for r in rows for k in r.get("model1_kernels", {})},
                   key=MODEL1_KERNELS.index)
    lines = ["## The Gluon MODEL1 kernels", "",
             "Graph µs (ours / FlashMLA) [relative error against the float64 reference, two "
             "requests]; the default plan's kernel first.", "",
             "| shape | FlashMLA | default | " + " | ".join(names) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in names) + " |"]
    for r in rows:
        if "model1_kernels" not in r:
            continue
        peer = r.get("flashmla_graph_us")
        v = r["model1_kernels"]
        lines.append(f"| {r['shape']['name']} | {_f(r, 'flashmla_graph_us', '.1f')} | "
                     f"{r['plan']['model1_kernel']}: "
                     f"{_cell(r['ours_graph_us'], r['rel_err_vs_reference'], peer)} | "
                     + " | ".join(_cell(v[n]['graph_us'], v[n]['rel_err_vs_reference'], peer)
                                  if n in v else "-" for n in names) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.sparse_v4 --out DIR [--kernels K ...] [--only S ...]``: the
    MODEL1 rows with the Gluon MODEL1 kernels; JSON and markdown into ``--out``."""
    import argparse
    import json
    import os

    from benchmarks.common import ceilings, report_heading
    from mla.check.registry import environment

    p = argparse.ArgumentParser(prog="python -m benchmarks.sparse_v4", description=main.__doc__)
    p.add_argument("--out", default="benchmarks/results", help="output directory")
    p.add_argument("--kernels", nargs="*", default=list(MODEL1_KERNELS),
                   choices=MODEL1_KERNELS, help="Gluon MODEL1 kernels to time")
    p.add_argument("--only", nargs="*", default=["MODEL1"], help="substrings of shape names")
    p.add_argument("--sweep", action="store_true", help="the default kernel's split counts")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    env = environment()
    res = {"environment": env, "ceilings": ceilings(), "v4": []}
    stem = os.path.join(args.out, f"sparse_v4_kernels_{env['date'][:10]}")

    def write(rows: list[dict]) -> str:
        res["v4"] = rows
        with open(stem + ".json", "w") as f:
            json.dump(res, f, indent=1)
        md = "\n".join(report_heading("Sparse MLA, DeepSeek-V4, MODEL1 kernels", res)
                       + markdown_kernels(rows) + [""] + markdown_v4(rows))
        with open(stem + ".md", "w") as f:
            f.write(md + "\n")
        return md

    rows = run_v4(args.seed, args.only, args.sweep, on_row=write, kernels=tuple(args.kernels))
    write(rows)
    print("\n".join(markdown_kernels(rows)))
    if args.sweep:
        print("\n".join(markdown_v4(rows)[-len(rows) - 2:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
