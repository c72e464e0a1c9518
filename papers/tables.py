"""The generated tables of ``papers/derivation.md``: ``python -m papers.tables --write``.

Each table lives in the paper between two markers,

    <!-- BEGIN GENERATED: name -->
    ...
    <!-- END GENERATED: name -->

and is regenerated from its source of truth:

- ``table1``: DeepSeek-V2's Table 1 (KV cache per token of MHA, GQA, MQA and MLA), computed
  from the presets by ``mla.kv_cache_comparison``;
- ``kv_cache``: the MLA cache per token and per 128K-token context for each preset, from
  ``MLAConfig`` (and the 656-byte ``fp8_ds_mla`` row of ``mla.reference.fp8``);
- ``equivalence``: ``mla.check`` on the GPU, per kernel (``checks/gpu_check.json``);
- ``peers``: the kernels beside FlashMLA, DeepGEMM and vLLM, the rows ``PEERS`` selects from
  the committed results under ``benchmarks/results/<topic>/``;
- ``conformance``: the conformance matrix as counts, from the reports ``CONFORMANCE`` lists.

A results file that is missing or unreadable, or lacks a selected shape, is named under its
table (``Not shown: ...``), never a crash.

Run from the repository root:

    python -m papers.tables            print the sections
    python -m papers.tables --write    rewrite them in papers/derivation.md
    python -m papers.tables --check    exit 1 if the paper's sections are stale
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from mla.config import get_config, kv_cache_comparison
from mla.reference.fp8 import FP8_DS_MLA_BYTES

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "papers" / "derivation.md"
RESULTS = ROOT / "benchmarks" / "results"
REGENERATE = "python -m papers.tables --write"
LINK = "../benchmarks/results"  # the results as the paper links them

TABLE1_PRESETS = ("deepseek-v2", "deepseek-v2-lite", "deepseek-v3")
CACHE_PRESETS = ("tiny", "deepseek-v2-lite", "deepseek-v2", "deepseek-v3", "deepseek-v3.2")
GQA_GROUPS = 8
CONTEXT = 128 * 1024  # tokens, for the per-request cache size


def _row(cells: list[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)]


def _units(x: float) -> str:
    """A multiple of ``d_h·l`` as the paper writes it: ``4.5``, ``256`` (not ``256.0``)."""
    return f"{x:g}"


def render_table1() -> str:
    """DeepSeek-V2's Table 1, reproduced for the presets (numbers cached per token, all layers)."""
    comparisons = {name: kv_cache_comparison(get_config(name), GQA_GROUPS)
                   for name in TABLE1_PRESETS}
    first = comparisons[TABLE1_PRESETS[0]]
    header = ["attention", "KV cache per token (elements)"]
    header += [f"{name}: in d_h·l" for name in TABLE1_PRESETS]
    header += [f"{name}: elements" for name in TABLE1_PRESETS]
    rows = []
    for i, entry in enumerate(first):
        row: list[object] = [entry["attention"], f"`{entry['formula']}`"]
        row += [_units(comparisons[n][i]["in_units_of_d_h_l"]) for n in TABLE1_PRESETS]
        row += [f"{comparisons[n][i]['numbers_per_token']:,}" for n in TABLE1_PRESETS]
        rows.append(row)
    v2 = get_config("deepseek-v2")
    note = (f"`d_h = qk_nope_head_dim`, `l` layers, GQA with `n_g = {GQA_GROUPS}` groups "
            f"(our choice: the paper gives GQA's formula, no group count). "
            f"DeepSeek-V2 (`n_h = {v2.num_heads}`, `d_c = {v2.kv_lora_rank} = "
            f"{v2.kv_lora_rank // v2.qk_nope_head_dim}·d_h`, `d_h^R = {v2.qk_rope_head_dim} = "
            f"d_h/{v2.qk_nope_head_dim // v2.qk_rope_head_dim}`): the paper's "
            f"`(d_c + d_h^R)·l ≈ 9/2·d_h·l` for MLA, the cache of GQA with 2.25 groups; "
            f"every other number here is computed from the presets.")
    return "\n".join(_table(header, rows) + ["", note])


def render_kv_cache() -> str:
    """The MLA cache of each preset: per token and layer, per token, per 128K context."""
    header = ["preset", "layers", "`Lkv + R`", "bf16 bytes / token / layer",
              "bf16 KiB / token", f"bf16 GiB / {CONTEXT // 1024}K context",
              "MHA-equivalent GiB / 128K context"]
    rows = []
    for name in CACHE_PRESETS:
        c = get_config(name)
        per_token = c.cache_bytes_per_token(2)
        mha = kv_cache_comparison(c, GQA_GROUPS)[0]["numbers_per_token"] * 2
        rows.append([name, c.num_layers, c.latent_dim, c.cache_bytes_per_token_per_layer(2),
                     f"{per_token / 1024:.1f}", f"{per_token * CONTEXT / 2 ** 30:.2f}",
                     f"{mha * CONTEXT / 2 ** 30:.1f}"])
    v32 = get_config("deepseek-v3.2")
    fp8 = FP8_DS_MLA_BYTES * v32.num_layers
    note = (f"With the `fp8_ds_mla` cache of DeepSeek-V3.2 a token's row is {FP8_DS_MLA_BYTES} "
            f"bytes instead of {v32.cache_bytes_per_token_per_layer(2)}: "
            f"{fp8 * CONTEXT / 2 ** 30:.2f} GiB per 128K context over "
            f"{v32.num_layers} layers.")
    return "\n".join(_table(header, rows) + ["", note])


# --- GPU results: the files under benchmarks/results/<topic>/ ---------------------------------

def _load(results: Path, rel: str) -> tuple[object, str]:
    """``(data, "")`` of the JSON file ``results/rel``, or ``(None, why)`` if it cannot be read."""
    path = results / rel
    if not path.is_file():
        return None, "missing"
    try:
        return json.loads(path.read_text()), ""
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"not readable as JSON ({type(e).__name__})"


def _link(rel: str) -> str:
    """A result file as the paper links it (relative to ``papers/``)."""
    return f"[`{Path(rel).name}`]({LINK}/{rel})"


def _run(data: dict) -> str:
    """``H200, 2026-11-30`` from a file's ``environment`` (``2× H200`` for a run on two)."""
    env = data.get("environment", {})
    gpu = str(env.get("gpu", "?")).replace("NVIDIA ", "")
    gpus = env.get("gpus", 1)
    return f"{f'{gpus}× ' if gpus != 1 else ''}{gpu}, {str(env.get('date', '?'))[:10]}"


def _us(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.1f}"


def _pct(frac: float, of: str) -> str:
    return f"{100 * frac:.0f}% {of}"


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# Each reader turns one results file into ``{key: row}`` (the key is the shape, or the kernel
# and shape where one file holds several kernels), a row being ``(kernel, shape, ours µs,
# share of a ceiling, peer, peer µs, timing)``; peer and peer µs are ``"", None`` where the file
# measures no peer. "graph": CUDA-graph replays of both kernels, the same inputs, one run.

def _decode_peers(data: dict) -> dict[str, tuple]:
    """``python -m benchmarks.run`` with the peers: the default plan beside each, graph times."""
    out = {}
    for e in data["decode"]:
        s, ours = e["shape"], e["default"]
        peers = {n: p["us_graph"] for n, p in e.get("peers", {}).items() if _finite(p["us_graph"])}
        peer = min(peers, key=peers.get) if peers else ""
        share = {"memory": _pct(ours["frac_bw"], "copy"),
                 "compute": _pct(ours["frac_flops"], "matmul")}.get(s["bound"], "")
        out[s["name"]] = ("`mla_decode_paged`", s["name"], ours["us_graph"], share, peer,
                          peers.get(peer), "graph")
    return out


def _direct_sparse(data: dict) -> dict[str, tuple]:
    """``python -m benchmarks.direct_call --kinds sparse``: kernel against FlashMLA's kernel."""
    return {e["name"]: ("`sparse_mla_prefill`" if e["shape"]["prefill"] else "`sparse_mla_decode`",
                        e["name"], e["kernel_us"], "", "FlashMLA", e["FlashMLA"]["kernel_us"],
                        "graph")
            for e in data["shapes"]}


def _sparse_v4(data: dict) -> dict[str, tuple]:
    """``python -m benchmarks.sparse --v4``: the MODEL1 decode beside FlashMLA's."""
    matmul = data["ceilings"]["matmul_TFLOPs"]
    return {e["shape"]["name"]: ("`sparse_mla_decode` (V4)", e["shape"]["name"], e["ours_graph_us"],
                                 _pct(e["TFLOPs"] / matmul, "matmul"), "FlashMLA",
                                 e["flashmla_graph_us"], "graph")
            for e in data["v4"] if "TFLOPs" in e}


def _indexer_peers(data: dict) -> dict[str, tuple]:
    """``python -m benchmarks.indexer_peers``: ours beside DeepGEMM; DeepGEMM writes the ragged
    logits compressed to the longest row, so ours is timed compressed too where it was."""
    out = {}
    for e in data["decode"]:
        name = f"B {e['B']}, next_n {e['next_n']}, L {e['L'] // 1024}K"
        out[name] = (f"`{e['kernel']}`", name, 1000 * e["mla_fast"]["ms"],
                     _pct(e["mla_fast"]["pct_fp8"] / 100, "fp8"), "DeepGEMM",
                     1000 * e["deepgemm"]["ms"], "graph")
    for e in data["prefill"]:
        ours = e.get("mla_fast_compressed", e["mla_fast"])
        shape = e["shape"] + (", rows compressed" if "mla_fast_compressed" in e else "")
        out[e["shape"]] = (f"`{e['kernel']}`", shape, 1000 * ours["ms"],
                           _pct(ours["pct_fp8"] / 100, "fp8"), "DeepGEMM",
                           1000 * e["deepgemm"]["ms"], "graph")
    return out


def _topk_peers(data: dict) -> dict[str, tuple]:
    """``python -m benchmarks.topk_peers``: ``top_k_per_row`` beside vLLM's fastest kernel."""
    out = {}
    for e in data["rows"]:
        peers = {n: e[n]["ms"] for n in e if n.startswith("vllm_") and isinstance(e[n], dict)
                 and _finite(e[n].get("ms"))}
        peer = min(peers, key=peers.get) if peers else ""
        shape = f"{e['R']} x {e['L'] // 1024}K, k {data['topk']}"
        out[shape] = (
            "`top_k_per_row`", shape, 1000 * e["mla_fast"]["ms"],
            _pct(e["mla_fast"]["pct_of_copy"] / 100, "copy"),
            f"vLLM `{peer[5:]}`" if peer else "", 1000 * peers[peer] if peer else None, "graph")
    return out


def _dcp(data: dict) -> dict[str, tuple]:
    """``python -m benchmarks.dcp_scaling``: a dense layer's decode step on 2 GPUs beside 1."""
    ms = {(r["L"], r["B"], r["W"]): r["layer_ms"] for r in data["rows"]}
    return {f"L {L // 1024}K, B {B}": ("DCP decode layer, W = 2", f"L {L // 1024}K, B {B}",
                                       1000 * ms[L, B, 2], "", "W = 1", 1000 * ms[L, B, 1],
                                       "graph")
            for L, B, W in ms if W == 2 and (L, B, 1) in ms}


def _small(data: dict) -> dict[str, tuple]:
    """``python -m benchmarks.small``: the memory-bound helpers against the copy ceiling."""
    return {f"{r['kernel']} {r['shape']}": (f"`{r['kernel']}`", r["shape"], 1000 * r["ms"],
                                             _pct(r["frac_copy"], "copy"), "", None, "do_bench")
            for r in data["results"]}


def _merge(data: dict) -> dict[str, tuple]:
    """``python -m benchmarks.prefill_routes``: the merge's default launch against copy."""
    m = data["merge"]
    shape = "T {}, N {}, D {}".format(*m["shape"])
    return {shape: ("`merge_attn_states`", shape, 1000 * m["default_ms"],
                    _pct(m["default_frac_copy"], "copy"), "", None, "do_bench")}


# (file under benchmarks/results/, its reader, the keys of the rows shown): section 12.4
PEERS = [
    ("decode/decode_peers_2026-11-30.json", _decode_peers,
     ["N16 B64 L16384", "N128 B128 L8192 s_q1", "N128 B1 L4096 latency"]),
    ("decode/direct_call_sparse_2026-11-30.json", _direct_sparse,
     ["sparse decode fp8 B=64 N=128 topk=2048",
      "sparse prefill s_q=4096 s_kv=32768 N=128 topk=2048"]),
    ("sparse/sparse_v4_kernels_2026-12-01.json", _sparse_v4,
     ["MODEL1 decode B64 N64 topk2048", "MODEL1 decode B64 N128 topk2048"]),
    ("indexer/indexer_peers_compressed_v2_2026-12-02.json", _indexer_peers,
     ["B 128, next_n 1, L 128K", "4096 queries of a 32K request",
      "8 requests of 2048, every query"]),
    ("topk/topk_peers_2026-12-02.json", _topk_peers,
     ["1 x 128K, k 2048", "1024 x 128K, k 2048", "256 x 8K, k 2048"]),
    ("dcp/dcp_scaling_2xH200_2026-11-30.json", _dcp, ["L 512K, B 64"]),
    ("prefill/prefill_routes.json", _merge, ["T 16384, N 128, D 512"]),
    ("small/small_2026-11-30.json", _small, ["concat_and_cache_mla T=65536 page=64"]),
]

# (caption, file): the figures shown under the table, where the file exists
FIGURES = [
    ("`mla_decode_paged`: share of the ceilings, and time beside FlashMLA and vLLM",
     "decode/decode_peers_2026-11-30.png"),
    ("Decode context parallelism: a step on 1 and 2 GPUs", "dcp/dcp_scaling_2xH200_2026-11-30.png"),
]


def _problems(lines: list[str], problems: list[str]) -> list[str]:
    return lines + ["", "Not shown: " + "; ".join(problems) + "."] if problems else lines


def render_peers(results: Path = RESULTS, selection: list | None = None,
                 figures: list | None = None) -> str:
    """Section 12.4: the rows ``PEERS`` selects, read from ``results``; a file that is missing
    or unreadable, or a shape it lacks, is named under the table."""
    rows, problems = [], []
    for rel, reader, keys in PEERS if selection is None else selection:
        data, why = _load(results, rel)
        try:
            found = reader(data) if data is not None else {}
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
            found, why = {}, f"unexpected layout ({type(e).__name__}: {e})"
        if why:
            problems.append(f"`{rel}` ({why})")
            continue
        for key in keys:
            if key not in found:
                problems.append(f"`{rel}` has no shape `{key}`")
                continue
            kernel, shape, ours, share, peer, peer_us, timing = found[key]
            ratio = f"{ours / peer_us:.2f}" if peer_us else ""
            rows.append([kernel, shape, _us(ours), share or "—", peer or "—",
                         _us(peer_us) if peer_us else "", ratio, timing, _run(data), _link(rel)])
    lines = _table(["kernel", "shape", "ours µs", "share of a ceiling", "beside", "its µs",
                    "ours / it", "timing", "GPU, date", "source"], rows)
    for caption, rel in FIGURES if figures is None else figures:
        if (results / rel).is_file():
            lines += ["", f"![{caption}]({LINK}/{rel})"]
        else:
            problems.append(f"figure `{rel}` (missing)")
    return "\n".join(_problems(lines, problems))


# (target, the cases run, file): the rows of section 12.5
CONFORMANCE = [
    ("`mla.fast`", "catalogue", "conformance/conformance_mla_fast_2026-12-06.json"),
    ("`mla.fast`, batch invariant", "catalogue",
     "conformance/conformance_mla_fast-batch-invariant_2026-12-06.json"),
    ("`mla.fast`", "indexer and top-k cases",
     "conformance/conformance_mla_fast_indexer_v2_2026-12-02.json"),
    ("FlashMLA", "catalogue", "conformance/conformance_flashmla_2026-12-06.json"),
    ("FlashMLA, batch invariant", "catalogue",
     "conformance/conformance_flashmla-batch-invariant_2026-12-06.json"),
    ("DeepGEMM", "catalogue", "conformance/conformance_deepgemm_2026-12-06.json"),
    ("vLLM cache kernels", "catalogue", "conformance/conformance_vllm-cache_2026-12-06.json"),
    ("vLLM top-k", "catalogue", "conformance/conformance_vllm-topk_2026-12-06.json"),
    ("vLLM top-k", "top-k cases", "conformance/conformance_topk_cases_vllm-topk_2026-12-02.json"),
    ("vLLM persistent top-k", "top-k cases",
     "conformance/conformance_topk_cases_vllm_persistent_topk_2026-12-02.json"),
    ("vLLM Triton", "catalogue", "conformance/conformance_vllm-triton_2026-12-06.json"),
    ("vLLM V4 Triton", "catalogue", "conformance/conformance_vllm-v4_2026-12-06.json"),
    ("FlashInfer", "catalogue", "conformance/conformance_flashinfer_2026-11-30.json"),
]
STATUSES = ("pass", "fail", "error", "unsupported")


def _failures(rows: list[dict]) -> str:
    """The cases that failed or raised, by kernel: ``kernel/case`` for one, ``kernel ×n``."""
    by_kernel: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] in ("fail", "error"):
            by_kernel.setdefault(r["kernel"], []).append(
                r["case"] + (" (error)" if r["status"] == "error" else ""))
    return ", ".join(f"`{k}/{c[0]}`" if len(c) == 1 else f"`{k}` ×{len(c)}"
                     for k, c in by_kernel.items())


def render_conformance(results: Path = RESULTS, selection: list | None = None) -> str:
    """Section 12.5: each report's counts (recounted from its rows) and what fails."""
    rows, problems = [], []
    for target, cases, rel in CONFORMANCE if selection is None else selection:
        data, why = _load(results, rel)
        try:
            counts = {s: 0 for s in STATUSES} if data is not None else {}
            for r in data["rows"] if data is not None else []:
                counts[r["status"]] += 1
            failing = _failures(data["rows"]) if data is not None else ""
        except (KeyError, TypeError, AttributeError) as e:
            why = f"unexpected layout ({type(e).__name__}: {e})"
        if why:
            problems.append(f"`{rel}` ({why})")
            continue
        rows.append([target, f"{cases} ({sum(counts.values())})",
                     *(counts[s] for s in STATUSES), failing or "—", _run(data), _link(rel)])
    lines = _table(["target", "cases run", *STATUSES, "what fails", "GPU, date", "source"], rows)
    return "\n".join(_problems(lines, problems))


def render_equivalence(results: Path = RESULTS, rel: str = "checks/gpu_check.json") -> str:
    """Section 12.3: ``mla.check`` on the GPU, per kernel: cases, passed, and the case nearest
    its error budget (the largest error / budget over the case's metrics; exact where every
    budget is 0)."""
    data, why = _load(results, rel)
    try:
        records = data["results"] if data is not None else []
        per: dict[str, list] = {}
        for r in records:
            k = per.setdefault(r["kernel"], [0, 0, None])
            k[0] += 1
            k[1] += bool(r["passed"])
            for metric, value in r["metrics"].items():
                limit = r["limits"].get(metric)
                if limit and (k[2] is None or value / limit > k[2][0]):
                    k[2] = (value / limit, metric.split("[")[0], value, limit)
    except (KeyError, TypeError, AttributeError, ZeroDivisionError) as e:
        data, why = None, f"unexpected layout ({type(e).__name__}: {e})"
    if data is None:
        return f"Not shown: `{rel}` ({why})."
    rows = [[f"`{k}`", n, ok, "exact (every byte or index)" if w is None else
             f"{w[1]} {w[2]:.1e} of {w[3]:.1e} ({100 * w[0]:.0f}%)"]
            for k, (n, ok, w) in per.items()]
    total, passed = sum(r[1] for r in rows), sum(r[2] for r in rows)
    head = (f"`python -m mla.check` on {_run(data)} ({data.get('dtype', '?')} inputs, every "
            f"output against the float64 reference): {passed} of {total} cases pass "
            f"({_link(rel)}).")
    return "\n".join([head, ""] + _table(["kernel", "cases", "pass",
                                          "nearest its budget: error of budget"], rows))


SECTIONS = {"table1": render_table1, "kv_cache": render_kv_cache,
            "equivalence": render_equivalence, "peers": render_peers,
            "conformance": render_conformance}


def sections() -> dict[str, str]:
    return {name: fn() for name, fn in SECTIONS.items()}


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- BEGIN GENERATED: {name} -->", f"<!-- END GENERATED: {name} -->"


def _pattern(name: str) -> re.Pattern[str]:
    begin, end = (re.escape(m) for m in _markers(name))
    return re.compile(rf"{begin}\n(.*?)\n?{end}", re.S)


def extract_section(text: str, name: str) -> str:
    """The text between the markers of section ``name``; ``ValueError`` if they are missing."""
    match = _pattern(name).search(text)
    if match is None:
        raise ValueError(f"papers/derivation.md has no markers for the generated section "
                         f"{name!r}")
    return match.group(1)


def replace_sections(text: str, new: dict[str, str]) -> str:
    """``text`` with the body between each section's markers replaced by ``new[name]``."""
    for name, body in new.items():
        extract_section(text, name)  # the markers must be there
        block = f"{_markers(name)[0]}\n{body}\n{_markers(name)[1]}"
        text = _pattern(name).sub(lambda _m, blk=block: blk, text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m papers.tables",
                                     description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="rewrite papers/derivation.md")
    group.add_argument("--check", action="store_true", help="exit 1 if the paper is stale")
    args = parser.parse_args(argv)
    new = sections()
    if args.write or args.check:
        text = PAPER.read_text()
        updated = replace_sections(text, new)
        if args.check:
            stale = [n for n in new if extract_section(text, n) != new[n]]
            if stale:
                print(f"stale generated sections in {PAPER.name}: {', '.join(stale)}; "
                      f"run {REGENERATE}")
                return 1
            return 0
        PAPER.write_text(updated)
        print(f"wrote {len(new)} sections into {PAPER}")
        return 0
    for name, body in new.items():
        print(f"<!-- {name} -->\n{body}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
