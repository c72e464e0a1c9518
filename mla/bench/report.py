"""``mla bench``'s outputs: a text table, markdown, JSON and a bar plot (matplotlib, optional)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from mla.bench.runner import Result
from mla.bench.shapes import SHAPES

__all__ = ["heading", "plot", "shape_listing", "to_json", "to_markdown", "to_text"]


def shape_listing() -> str:
    """The presets' shapes, one line each (``mla bench --list-shapes``)."""
    from mla.bench.shapes import work

    w = max(len(s.name) for s in SHAPES)
    lines = [f"{'shape':<{w}}  {'kernel':<18}  {'GFLOP':>8}  {'MB':>8}  {'FLOP/B':>6}  sizes"]
    for s in SHAPES:
        flops, nbytes = work(s)
        lines.append(f"{s.name:<{w}}  {s.kernel:<18}  {flops / 1e9:>8.1f}  {nbytes / 1e6:>8.1f}"
                     f"  {flops / nbytes:>6.1f}  {s.dims}")
    return "\n".join(lines) + "\n(bf16 inputs; formulas and why each is memory- or compute-" \
        "bound: mla.bench.shapes)"


ADAPTED = ("a peer is timed through its adapter (mla.conformance.adapters): its kernel and what "
           "the adapter adds to return the reference's outputs (for DeepGEMM's logits, the "
           "scheduler's metadata and -inf past each row's keys, which DeepGEMM leaves undefined)")


def heading(meta: dict) -> list[str]:
    """The lines above the table: GPU, versions, ceilings, how the times were taken."""
    env = meta.get("environment", {})
    where = env.get("gpu", meta.get("device", "?"))
    lines = [f"mla bench: target {meta['target']}, {meta['dtype']} on {where}, torch "
             f"{env.get('torch', '?')}, triton {env.get('triton', '?')}, {env.get('date', '')}"]
    ceil = meta.get("ceilings")
    if meta.get("dry_run"):
        lines.append("dry run: tiny sizes, each kernel called once, nothing timed")
    elif ceil:
        fp8 = ceil.get("fp8_matmul_TFLOPs")
        lines.append(f"ceilings measured in this run: copy {ceil['copy_GBps']:.0f} GB/s, bf16 "
                     f"matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s, "
                     + (f"fp8 matmul {fp8:.0f} TFLOP/s (the % matmul of the fp8 logits)"
                        if isinstance(fp8, float) else
                        f"no fp8 matmul ({ceil.get('fp8_matmul_error', 'not measured')})"))
        lines.append(f"times: median of {meta['reps']} "
                     f"{'CUDA-graph replays' if meta['graph'] else 'eager calls'}, L2 "
                     f"{'flushed before each' if meta['flush'] else 'warm'} (eager: capture "
                     "failed, see the notes)")
        lines.append(ADAPTED)
    return lines


def _cells(r: Result) -> list[str]:
    if r.skipped or r.error:
        return [r.shape, r.kernel, r.dims, r.target,
                ("skipped: " + r.skipped) if r.skipped else ("error: " + (r.error or ""))]
    if r.outputs is not None:
        return [r.shape, r.kernel, r.dims, r.target,
                "called: " + ", ".join("x".join(map(str, o)) for o in r.outputs)]

    def pct(x: float | None) -> str:
        return f"{100 * x:.0f}%" if x is not None else ""
    tflops = f"{r.TFLOPs:.1f}" if r.flops else "-"
    return [r.shape, r.kernel, r.dims, r.target, f"{r.us:.1f}", r.method, f"{r.GBps:.0f}",
            pct(r.frac_copy), tflops, pct(r.frac_matmul) if r.flops else "-"]


_HEAD = ["shape", "kernel", "sizes", "target", "µs", "how", "GB/s", "% copy", "TFLOP/s",
         "% matmul"]


def to_text(results: Sequence[Result], meta: dict) -> str:
    """The table: one row per shape and target; a skipped or failed one says why."""
    rows = [_cells(r) for r in results]
    full = [c for c in rows if len(c) == len(_HEAD)]
    widths = [max([len(h)] + [len(c[i]) for c in full]) for i, h in enumerate(_HEAD)]
    short = [max([len(h)] + [len(c[i]) for c in rows]) for i, h in enumerate(_HEAD[:4])]
    widths[:4] = short

    def line(cells: list[str]) -> str:
        return "  ".join(f"{c:<{w}}" if i < 4 or i == 5 else f"{c:>{w}}"
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out = heading(meta) + ["", line(_HEAD)] + [line(c) for c in rows]
    out += _notes(results)
    return "\n".join(out)


def _notes(results: Sequence[Result]) -> list[str]:
    why = sorted({f"{r.target} on {r.shape}: {r.why}" for r in results if r.method == "eager"
                  and r.why})
    return ["", "eager timings:"] + [f"  {w}" for w in why] if why else []


def to_markdown(results: Sequence[Result], meta: dict) -> str:
    """The table as markdown, under the heading's lines."""
    lines = [f"# {heading(meta)[0]}", ""] + [h + "  " for h in heading(meta)[1:]] + [""]
    lines += ["| " + " | ".join(_HEAD) + " |", "|" + " --- |" * len(_HEAD)]
    for r in results:
        c = _cells(r)
        c += [""] * (len(_HEAD) - len(c))
        lines.append("| " + " | ".join(x.replace("|", "\\|") for x in c) + " |")
    lines += _notes(results)
    return "\n".join(lines) + "\n"


def _finite(v: object) -> object:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def to_json(results: Sequence[Result], meta: dict) -> str:
    """``{"meta": ..., "results": [...]}`` (a non-finite number as null)."""
    doc = {"meta": meta, "results": [{k: _finite(v) for k, v in r.to_dict().items()}
                                     for r in results]}
    return json.dumps(doc, indent=1, allow_nan=False) + "\n"


def plot(results: Sequence[Result], meta: dict, path: str) -> None:
    """Time per shape, one bar per target (log scale); ``ImportError`` without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r.shape for r in results))
    targets = list(dict.fromkeys(r.target for r in results))
    times = {(r.shape, r.target): r.us for r in results if r.us is not None}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(shapes) + 2), 4.5))
    w = 0.8 / max(len(targets), 1)
    for k, t in enumerate(targets):
        xs = [i - 0.4 + w * (k + 0.5) for i in range(len(shapes))]
        ax.bar(xs, [times.get((s, t), 0.0) for s in shapes], w, label=t)
    ax.set_xticks(range(len(shapes)), shapes, rotation=30, ha="right", fontsize=8)
    if times:
        ax.set_yscale("log")
    ax.set_ylabel("µs per call (lower is faster)")
    ax.set_title(heading(meta)[0], fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
