"""``python -m benchmarks.results_index [--check]``: the index of ``benchmarks/results/``.

Results are grouped by topic (a folder each). The index, ``benchmarks/results/README.md``, is
written from two sources: ``CURRENT`` below, the result that stands today for each kernel and
question (the one the README, the paper and the notes cite), and the folders themselves, whose
files are listed by series (the name without its date), newest first. ``--check`` exits 1
when the committed index differs from the one this would write, or when a current result or a
file outside the topics' folders is missing from it (``tests/test_results_index.py``).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
INDEX = RESULTS / "README.md"

TOPICS = {
    "decode": "dense paged decode (`mla_decode_paged`): ceilings, plans, peers, direct calls",
    "sparse": "sparse top-k attention (V3.2) and DeepSeek-V4's sinks and MODEL1 pages",
    "indexer": "the lightning indexer's logits (`fp8_mqa_logits`, `fp8_paged_mqa_logits`)",
    "topk": "`top_k_per_row`: routes, plans, peers and the designs measured",
    "prefill": "prefill attention with its LSE, by route",
    "small": "the memory-bound helpers (merge, cache writes, gathers, index conversion)",
    "layers": "whole layers: stage-by-stage checks and decode steps",
    "dcp": "decode context parallelism over NCCL (2 GPUs)",
    "bench": "`mla bench` reports: a target's kernels on the named shapes beside FlashMLA",
    "conformance": "`mla conform` reports: `mla.fast` and the peers on the catalogue",
    "checks": "`mla.check` on the GPU, error budgets, compute-sanitizer, GPU test logs",
}

# (kernel or question, topic/file): the result that stands today
CURRENT = [
    ("GPU check of every kernel source (bf16, H100)", "checks/gpu_check.md"),
    ("`mla_decode_paged` on the target shapes", "decode/decode_2026-11-30.md"),
    ("`mla_decode_paged` beside FlashMLA and vLLM", "decode/decode_peers_2026-11-30.md"),
    ("a direct call against its kernel (decode)", "decode/direct_call_2026-11-30.md"),
    ("a direct call against its kernel (sparse)", "decode/direct_call_sparse_2026-11-30.md"),
    ("`sparse_mla_decode` / `sparse_mla_prefill` (V3.2)", "sparse/sparse_2026-11-30.md"),
    ("MODEL1 sparse decode and sinks beside FlashMLA (V4)",
     "sparse/sparse_v4_kernels_2026-12-01.md"),
    ("the MODEL1 Gluon kernels side by side", "sparse/sparse_v4_ws_2026-12-01.md"),
    ("the sparse kernels' plans swept, warp-specialized fp8_ds_mla decode the default (H100)",
     "sparse/sparse_sweep_2026-12-06.md"),
    ("the warp-specialized kernel over rows in q's dtype beside the coupled one (H100)",
     "sparse/sparse_sweep_bf16_2026-12-06.md"),
    ("V3.2's sparse kernels, logits and top-k beside FlashMLA, DeepGEMM and vLLM (H100)",
     "sparse/sparse_peers_2026-12-07.md"),
    ("V3.2's and V4's sparse attention beside FlashMLA, the seesaw sparse prefill (H100)",
     "sparse/sparse_peers_seesaw_2026-12-06.md"),
    ("sparse prefill: the seesaw kernel with its producer group, without it, and the "
     "warp-specialized one beside FlashMLA (H100)", "sparse/seesaw_producer_2026-12-06.json"),
    ("the V3.2 step with the seesaw sparse prefill (H100, quick shapes)",
     "layers/step_peers_seesaw_2026-12-06.md"),
    ("indexer prefill logits, rows compressed: 8, 16, 32 and 64 tiles a program beside "
     "DeepGEMM (H100)", "indexer/indexer_peers_tiles_2026-12-07.md"),
    ("`fp8_paged_mqa_logits` plans", "indexer/indexer_logits_2026-11-30.md"),
    ("indexer logits beside DeepGEMM", "indexer/indexer_peers_v3_2026-12-02.md"),
    ("indexer prefill logits on the Gluon kernel and the Triton one beside DeepGEMM (H100)",
     "indexer/indexer_peers_gluon_2026-12-06.md"),
    ("`top_k_per_row` on the H200", "topk/topk_parts_unspecialized_2026-12-02.md"),
    ("`top_k_per_row` beside vLLM's top-k kernels", "topk/topk_peers_2026-12-02.md"),
    ("prefill attention by route", "prefill/prefill_routes.md"),
    ("memory-bound helpers", "small/small_2026-11-30.md"),
    ("V3.2 sparse decode step (fast against torch)", "layers/sparse_layer_2026-12-01.md"),
    ("V3.2 sparse steps beside the peers' composition, every shape (H100)",
     "layers/step_peers_2026-12-07.md"),
    ("V4.1 cache codecs against vLLM's Triton writers (H100)",
     "checks/v41_codecs_2026-12-06.json"),
    ("V4 compressors and indexer q: vLLM's Triton kernels against the reference (H100)",
     "checks/v4_peers_check_2026-12-06.json"),
    ("DeepSeek-V4's layer on mla.fast.v4: stage checks and the decode step (H100)",
     "layers/v4_layer_2026-12-06.md"),
    ("vLLM's V4 Triton kernels on the conformance catalogue (H100)",
     "conformance/conformance_vllm-v4_2026-12-06.md"),
    ("the V3.2 step with the front's weights prepared once (H100, quick shapes)",
     "layers/step_peers_prepared_front_2026-12-06.md"),
    ("`mla bench --target mla.fast` on every preset beside FlashMLA (H100)",
     "bench/mla_bench_fast_2026-12-06.md"),
    ("`mla bench` of FlashMLA, vLLM's Triton kernels and both batch-invariant targets (H100)",
     "bench/mla_bench_vllm-triton_2026-12-06.md"),
    ("the fuzz of 21 kernels of mla.fast, FlashMLA, vLLM and DeepGEMM, 5 min a kernel (H100)",
     "conformance/fuzz_2026-12-06.md"),
    ("`mla bench` of vLLM's top-k and DeepGEMM's logits beside mla.fast (H100)",
     "bench/mla_bench_deepgemm_2026-12-06.md"),
    ("what batch invariance costs (fixed-length splits), and V3.2 sparse decode beside "
     "FlashMLA at B = 1-128 (H100)", "decode/batch_invariant_2026-12-06.md"),
    ("the V4 decode step beside the torch composition and vLLM's V4 kernels (H100)",
     "layers/v4_step_peers_2026-12-06.md"),
    ("DCP on 2 GPUs", "dcp/dcp_scaling_2xH200_2026-11-30.md"),
    ("`mla.fast` on the conformance catalogue (H100)",
     "conformance/conformance_mla_fast_2026-12-06.md"),
    ("FlashMLA on the conformance catalogue (H100)",
     "conformance/conformance_flashmla_2026-12-06.md"),
    ("vLLM's Triton kernels on the conformance catalogue (H100)",
     "conformance/conformance_vllm-triton_2026-12-06.md"),
    ("the catalogue's decode cases held to batch invariance: FlashMLA's batch-invariant mode "
     "(H100)", "conformance/properties_flashmla-batch-invariant_2026-12-06.md"),
]

_DATE = re.compile(r"_?(20\d\d-\d\d-\d\d)")


def series(name: str) -> tuple[str, str]:
    """``(series, date)`` of a result file: its name without the date and the extension."""
    stem = name.split(".", 1)[0]
    m = _DATE.search(stem)
    return (_DATE.sub("", stem, count=1), m.group(1)) if m else (stem, "")


def render(results: Path = RESULTS) -> str:
    """The index as it should be committed."""
    lines = ["# Benchmark results", "",
             "Written by `python -m benchmarks.results_index`; do not edit by hand. Every file",
             "carries its GPU, versions and date. The current result of each kernel first, then",
             "each topic's files by series, newest first (older files are the history the notes",
             "in `benchmarks/notes/` cite).", "", "## Current", "",
             "| kernel or question | result |", "| --- | --- |"]
    lines += [f"| {what} | [`{path}`]({path}) |" for what, path in CURRENT]
    for topic, what in TOPICS.items():
        folder = results / topic
        by_series: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for p in sorted(folder.iterdir()) if folder.is_dir() else []:
            name, date = series(p.name)
            by_series[name].append((date, p.name))
        lines += ["", f"## {topic}/", "", what + ".", "", "| series | files (newest first) |",
                  "| --- | --- |"]
        for name in sorted(by_series):
            files = sorted(by_series[name], reverse=True)
            lines.append(f"| {name} | "
                         + ", ".join(f"[`{f}`]({topic}/{f})" for _, f in files) + " |")
    return "\n".join(lines) + "\n"


def problems(results: Path = RESULTS) -> list[str]:
    """What keeps the results folder from matching its index."""
    out = [f"current result {path} is missing" for _, path in CURRENT
           if not (results / path).exists()]
    out += [f"{p.name} is outside the topics' folders" for p in results.iterdir()
            if p.name != "README.md" and not (p.is_dir() and p.name in TOPICS)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.results_index", description=__doc__)
    p.add_argument("--check", action="store_true",
                   help="exit 1 if the committed index is stale (nothing written)")
    args = p.parse_args(argv)
    found = problems()
    for line in found:
        print(f"results_index: {line}", file=sys.stderr)
    if args.check:
        stale = not INDEX.exists() or INDEX.read_text() != render()
        if stale:
            print("results_index: benchmarks/results/README.md is stale: run "
                  "python -m benchmarks.results_index", file=sys.stderr)
        return int(stale or bool(found))
    INDEX.write_text(render())
    return int(bool(found))


if __name__ == "__main__":
    sys.exit(main())
