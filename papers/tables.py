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
- ``benchmarks``: the GPU results committed under ``benchmarks/results/*.json``
  (written on the H200 by ``python -m benchmarks.run``), or a note saying there are none.

Run from the repository root:

    python -m papers.tables            print the sections
    python -m papers.tables --write    rewrite them in papers/derivation.md
    python -m papers.tables --check    exit 1 if the paper's sections are stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from mla.config import get_config, kv_cache_comparison
from mla.reference.fp8 import FP8_DS_MLA_BYTES

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "papers" / "derivation.md"
RESULTS = ROOT / "benchmarks" / "results"
REGENERATE = "python -m papers.tables --write"

# which command writes which results file (by name prefix), run on the GPU machine
PRODUCERS = {
    "decode_sweep": "python -m benchmarks.run --sweep",
    "decode_triton": "python -m benchmarks.run (Triton kernels only, before the sm_90 kernels)",
    "host_overhead": "python -m benchmarks.host_overhead --out <file>",
    "check_decode": "python -m mla.check --kernel mla_decode_paged --out <file>",
    "check_sm90": ("python -m mla.check --kernel mla_decode_paged --kernel sparse_mla_decode "
                   "--kernel sparse_mla_prefill --out <file>"),
    "decode_n128_rerun": "python -m benchmarks.run --shapes N128 (final code, default plans)",
    "decode_": "python -m benchmarks.run",
    "prefill_routes": "python -m benchmarks.prefill_routes",
    "dcp_nccl": "torchrun --nproc-per-node 2 -m mla.check.dcp --check --out <file>",
    "check": "python -m mla.check --out <file>",
    "sanitize_check": "compute-sanitizer --tool memcheck python -m mla.check --quick --out <file>",
    "sparse_triton": "python -m benchmarks.run --only sparse (Triton kernels only, before sm_90)",
    "sparse_": "python -m benchmarks.run --only sparse",
    "small_": "python -m benchmarks.small",
    "prefill_check": "python -m mla.check --kernel prefill_attention --out <file>",
    "gpu_check": "python -m mla.check --out <file>",
    "error_budget_cpu": ("TRITON_INTERPRET=1 python -m mla.check --device cpu --dtype "
                         "<float16|float32> --seeds 30 --out <file>"),
    "error_budget_gpu": "python -m mla.check --seed <s> --seeds <n> --out <file>",
    "conformance_mla_fast_refusal": ("mla conform --target mla.fast --cases "
                                     "topk_length_past_topk --json <file>"),
    "conformance_flashmla_refusal": ("mla conform --target flashmla --cases "
                                     "topk_length_past_topk --json <file>"),
    "conformance_peers_manifest": "python -m benchmarks.peers (the unpacked peers' sha256)",
    "conformance_": "mla conform --target <target> --json <file> (python -m "
                    "benchmarks.conformance_matrix run for all targets at once)",
}

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


def _fmt(x: object) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def _render_decode(data: dict) -> list[str]:
    """``python -m benchmarks.run``'s results: ceilings, then each shape's default and best."""
    ceil = data["ceilings"]
    lines = [f"Ceilings measured in the same run: copy {ceil['copy_TBps']:.2f} TB/s, "
             f"bf16 matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s.", ""]
    rows = []
    for entry in data["decode"]:
        s = entry["shape"]
        for label in ("default", "best"):
            r = entry[label]
            if label == "best" and r == entry["default"]:
                continue
            unit = {"memory": "TB/s", "compute": "TFLOP/s", "latency": "µs"}[s["bound"]]
            rows.append([s["name"], label, f"{r['us']:.1f}", f"{r['us_graph']:.1f}",
                         f"{r['TBps']:.2f}", f"{r['TFLOPs']:.0f}",
                         f"{100 * r['frac_bw']:.0f}%", f"{100 * r['frac_flops']:.0f}%",
                         f"{'≤' if unit == 'µs' else '≥'} {s['target']:g} {unit}"])
    return lines + _table(["shape", "plan", "µs eager", "µs graph", "TB/s", "TFLOP/s",
                           "% copy BW", "% matmul", "target"], rows)


def _scalar(v: object) -> bool:
    return isinstance(v, (str, int, float, bool))


def _cell(v: object) -> str:
    """A scalar, or a small dict of scalars (e.g. a check's ``metrics``) as ``k v, k v``."""
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items() if _scalar(x))
    return "" if v is None else _fmt(v)


def _render_generic(data: object) -> list[str]:
    """Any other results file: each list of records becomes a table of its scalar fields
    (and of its small dicts of scalars); columns that are empty in every record are dropped."""
    lines: list[str] = []
    items = list(data.items()) if isinstance(data, dict) else [("results", data)]
    for key, value in items:
        if key == "environment" or not isinstance(value, list):
            continue
        records = [v for v in value if isinstance(v, dict)]
        columns: list[str] = []
        for rec in records:
            columns += [k for k, v in rec.items() if k not in columns and (
                _scalar(v) or (isinstance(v, dict) and any(_scalar(x) for x in v.values())))]
        columns = [c for c in columns if any(_cell(rec.get(c)) for rec in records)][:10]
        if not records or not columns:
            continue
        lines += [f"`{key}`:", ""]
        lines += _table(columns, [[_cell(rec.get(c)) for c in columns] for rec in records])
        lines.append("")
    return lines


def _metadata(data: object, skip: tuple[str, ...] = ()) -> list[str]:
    """The run's environment (``environment`` or the top-level scalars) and small summaries."""
    if not isinstance(data, dict):
        return []
    env = data.get("environment")
    if not isinstance(env, dict):
        env = {k: v for k, v in data.items() if isinstance(v, (str, int, float, bool))}
    lines = []
    if env:
        lines.append(", ".join(f"{k} {_fmt(v)}" for k, v in env.items()) + ".")
    for key, value in data.items():
        if key not in ("environment", *skip) and isinstance(value, dict) and value and all(
                isinstance(v, (str, int, float, bool)) for v in value.values()):
            lines.append(f"`{key}`: " + ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
                         + ".")
    return lines + [""] if lines else []


def producer(path: Path) -> str:
    """The command that writes ``path`` (by its name's prefix)."""
    for prefix, command in PRODUCERS.items():
        if path.name.startswith(prefix):
            return command.replace("<file>", f"benchmarks/results/{path.name}")
    return "the script named in the file's companion .md"


def _render_conformance(data: dict) -> list[str]:
    """A conformance report: its counts and the rows that failed or raised (every row is in
    the report's companion .md)."""
    c = data["counts"]
    lines = [f"Target `{data['target']}` on {data['device']} ({data['dtype']}): "
             + ", ".join(f"{v} {k}" for k, v in c.items()) + ".", ""]
    bad = [r for r in data["rows"] if r["status"] in ("fail", "error")]
    if bad:
        lines += _table(["kernel/case", "status", "errors", "convention"],
                        [[f"{r['kernel']}/{r['case']}", r["status"],
                          ", ".join(f"{k} {_fmt(v)}" for k, v in r["errors"].items()),
                          r.get("convention", "")[:120]] for r in bad])
    return lines


def render_benchmarks(results_dir: Path = RESULTS) -> str:
    """Tables of every ``*.json`` under ``results_dir``, or a note that there are none yet."""
    files = sorted(results_dir.rglob("*.json")) if results_dir.is_dir() else []
    if not files:
        return ("No GPU benchmark results are committed yet. On the H200, "
                "`python -m benchmarks.run` writes them to `benchmarks/results/`; then "
                f"`{REGENERATE}` puts them here.")
    out = ["From the files in `benchmarks/results/`, each written on the GPU machine by the "
           f"command named under it; `{REGENERATE}` rebuilds this section from them."]
    for path in files:
        out += ["", f"**`{path.name}`** (`{producer(path)}`)", ""]
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            out.append(f"not readable as JSON: {type(e).__name__}")
            continue
        # benchmarks.run's file: a "decode" list of shapes (the indexer's has a "decode" too)
        decode = (isinstance(data, dict) and "ceilings" in data
                  and isinstance(data.get("decode"), list)
                  and all(isinstance(e, dict) and "shape" in e for e in data["decode"]))
        conformance = isinstance(data, dict) and {"target", "counts", "rows"} <= set(data)
        out += _metadata(data, skip=("ceilings",) if decode else ())
        body = (_render_decode(data) if decode else _render_conformance(data) if conformance
                else _render_generic(data))
        while body and not body[-1]:
            body.pop()
        out += body or ["(no tables: the file holds no lists of records)"]
    return "\n".join(out).rstrip()


SECTIONS = {"table1": render_table1, "kv_cache": render_kv_cache,
            "benchmarks": render_benchmarks}


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
