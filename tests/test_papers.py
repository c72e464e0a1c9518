"""papers/: the generated tables are current, every equation is tied to a function that exists,
and every citation is in the bibliography (and every bibliography entry is cited)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mla.config import get_config
from mla.reference.decode import absorbed_attention
from mla.reference.prefill import prefill_attention

PAPERS = Path(__file__).resolve().parents[1] / "papers"
PAPER = PAPERS / "derivation.md"
BIB = PAPERS / "references.bib"


def _load_tables():
    spec = importlib.util.spec_from_file_location("papers_tables", PAPERS / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = _load_tables()
TEXT = PAPER.read_text()


# --- the generated tables ------------------------------------------------------------------

@pytest.mark.parametrize("name", list(tables.SECTIONS))
def test_generated_section_equals_what_the_package_computes(name: str):
    committed = tables.extract_section(TEXT, name)
    assert committed == tables.SECTIONS[name](), (
        f"section {name!r} of papers/derivation.md is stale: run {tables.REGENERATE}")


def _table1_rows() -> dict[str, list[str]]:
    body = tables.extract_section(TEXT, "table1")
    lines = [ln for ln in body.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def test_table1_in_the_paper_follows_from_the_presets():
    """The committed numbers, re-derived from the config fields without kv_cache_comparison."""
    rows = _table1_rows()
    assert list(rows) == ["MHA", "GQA", "MQA", "MLA"]
    for name in tables.TABLE1_PRESETS:
        c = get_config(name)
        d_h, layers = c.qk_nope_head_dim, c.num_layers
        expected = {"MHA": 2 * c.num_heads * d_h * layers,
                    "GQA": 2 * tables.GQA_GROUPS * d_h * layers,
                    "MQA": 2 * d_h * layers,
                    "MLA": (c.kv_lora_rank + c.qk_rope_head_dim) * layers}
        for kind, value in expected.items():
            assert int(rows[kind][f"{name}: elements"].replace(",", "")) == value, (name, kind)
            assert float(rows[kind][f"{name}: in d_h·l"]) == value / (d_h * layers), (name, kind)


def test_table1_reproduces_the_deepseek_v2_paper():
    """DeepSeek-V2, Table 1: MHA 2·n_h = 256, GQA 2·n_g, MQA 2, MLA ≈ 9/2 (in units of d_h·l)."""
    rows = _table1_rows()
    v2 = get_config("deepseek-v2")
    col = "deepseek-v2: in d_h·l"
    assert float(rows["MHA"][col]) == 2 * v2.num_heads == 256
    assert float(rows["GQA"][col]) == 2 * tables.GQA_GROUPS
    assert float(rows["MQA"][col]) == 2
    assert float(rows["MLA"][col]) == 9 / 2


def test_check_and_write_detect_and_fix_a_stale_paper(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch):
    stale = tmp_path / "derivation.md"
    stale.write_text(TEXT.replace("| MLA | `(d_c + d_h^R)·l` | 4.5 |",
                                  "| MLA | `(d_c + d_h^R)·l` | 4.6 |"))
    assert stale.read_text() != TEXT
    monkeypatch.setattr(tables, "PAPER", stale)
    assert tables.main(["--check"]) == 1
    assert tables.main(["--write"]) == 0
    assert tables.main(["--check"]) == 0
    assert tables.extract_section(stale.read_text(), "table1") == tables.render_table1()


def test_missing_markers_raise():
    with pytest.raises(ValueError, match="no markers"):
        tables.extract_section("no generated sections here", "table1")
    with pytest.raises(ValueError, match="no markers"):
        tables.replace_sections("text", {"table1": "x"})


# --- the GPU results: sections 12.3 to 12.5, from benchmarks/results/<topic>/ ---------------

RESULT_SECTIONS = ("equivalence", "peers", "conformance")
LINKS = re.compile(r"\]\(([^)\s]+)\)")


def test_every_link_in_the_paper_resolves():
    links = [u for u in LINKS.findall(TEXT) if not re.match(r"[a-z]+:", u)]
    assert len(links) > 20
    for url in links:
        assert (PAPERS / url.split("#")[0]).resolve().exists(), f"the paper links {url}: gone"


@pytest.mark.parametrize("name", RESULT_SECTIONS)
def test_result_sections_cite_only_committed_files_and_miss_none(name: str):
    committed = tables.extract_section(TEXT, name)
    assert "Not shown" not in committed, "a selected file or shape is missing"
    cited = [u for u in LINKS.findall(committed)]
    assert cited and all(u.startswith(tables.LINK + "/") for u in cited)
    for url in cited:
        assert (PAPERS / url).resolve().is_file(), url


def test_the_peers_table_has_a_row_per_selected_shape_and_every_figure():
    body = tables.extract_section(TEXT, "peers")
    rows = [ln for ln in body.splitlines() if ln.startswith("| ")][2:]
    assert len(rows) == sum(len(keys) for _, _, keys in tables.PEERS) >= 12
    for rel, _, _ in tables.PEERS:
        assert f"({tables.LINK}/{rel})" in body
    for _, rel in tables.FIGURES:
        assert f"]({tables.LINK}/{rel})" in body


def test_the_peers_ratios_are_the_ones_the_files_state():
    """Our ratio, recomputed from the times read, equals the ratio each producer wrote."""
    stated = {}
    data = json.loads((tables.RESULTS / "decode/decode_peers_2026-11-30.json").read_text())
    for e in data["decode"]:
        stated[e["shape"]["name"]] = e["peers"]["FlashMLA"]["ours_over_peer_graph"]
    data = json.loads((tables.RESULTS / "sparse/sparse_v4_kernels_2026-12-01.json").read_text())
    stated |= {e["shape"]["name"]: e["ratio"] for e in data["v4"]}
    data = json.loads((tables.RESULTS / "decode/direct_call_sparse_2026-11-30.json").read_text())
    stated |= {e["name"]: e["ratios"]["kernel / FlashMLA kernel"] for e in data["shapes"]}
    checked = 0
    for line in tables.extract_section(TEXT, "peers").splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 6 and cells[1] in stated:
            assert float(cells[6]) == pytest.approx(stated[cells[1]], abs=0.006), cells[1]
            checked += 1
    assert checked >= 7


def test_the_conformance_counts_are_the_reports_own():
    body = tables.extract_section(TEXT, "conformance")
    for target, _, rel in tables.CONFORMANCE:
        report = json.loads((tables.RESULTS / rel).read_text())
        line = next(ln for ln in body.splitlines() if f"/{rel})" in ln)
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == target
        assert [int(c) for c in cells[2:6]] == [report["counts"][s] for s in tables.STATUSES]


def _env(gpu: str = "NVIDIA GPU-X", **more) -> dict:
    return {"environment": {"gpu": gpu, "date": "2030-01-02T03:04:05+00:00", **more}}


def _write(root: Path, rel: str, data: object) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(data if isinstance(data, str) else json.dumps(data))


def _decode_file() -> dict:
    """Two shapes: FlashMLA the only finite peer of the first, "Other" the faster of the second."""
    return {**_env(), "ceilings": {"copy_TBps": 4.0, "matmul_TFLOPs": 700.0}, "decode": [
        {"shape": {"name": "S1", "bound": "memory"},
         "default": {"us_graph": 200.0, "frac_bw": 0.5, "frac_flops": 0.1},
         "peers": {"FlashMLA": {"us_graph": 250.0}, "vLLM Triton": {"us_graph": math.nan}}},
        {"shape": {"name": "S2", "bound": "compute"},
         "default": {"us_graph": 1500.0, "frac_bw": 0.3, "frac_flops": 0.87},
         "peers": {"FlashMLA": {"us_graph": 1200.0}, "Other": {"us_graph": 1000.0}}}]}


def test_peers_render_a_synthetic_results_folder(tmp_path: Path):
    _write(tmp_path, "decode/d.json", _decode_file())
    _write(tmp_path, "topk/t.json", {**_env(), "topk": 64, "rows": [
        {"R": 4, "L": 2048, "mla_fast": {"ms": 0.01, "pct_of_copy": 25.0},
         "torch_topk": {"ms": 0.001}, "vllm_a": {"ms": 0.02}, "vllm_b": {"ms": 0.005}}]})
    _write(tmp_path, "dcp/p.json", {**_env(gpus=2), "rows": [
        {"L": 131072, "B": 8, "W": 1, "layer_ms": 2.0},
        {"L": 131072, "B": 8, "W": 2, "layer_ms": 1.2}]})
    _write(tmp_path, "small/s.json", {**_env(), "results": [
        {"kernel": "k1", "shape": "T=4", "ms": 0.05, "frac_copy": 0.4},
        {"kernel": "k2", "shape": "T=4", "ms": 0.07, "frac_copy": 0.3}]})
    _write(tmp_path, "decode/fig.png", "not really a png")
    out = tables.render_peers(
        tmp_path, selection=[("decode/d.json", tables._decode_peers, ["S2", "S1"]),
                             ("topk/t.json", tables._topk_peers, ["4 x 2K, k 64"]),
                             ("dcp/p.json", tables._dcp, ["L 128K, B 8"]),
                             ("small/s.json", tables._small, ["k2 T=4"])],
        figures=[("A figure", "decode/fig.png")])
    link = f"{tables.LINK}/"
    run = "GPU-X, 2030-01-02"
    expected = [
        # the second shape first, as selected; its fastest peer is "Other": 1500 / 1000
        f"| `mla_decode_paged` | S2 | 1,500 | 87% matmul | Other | 1,000 | 1.50 | graph | {run} "
        f"| [`d.json`]({link}decode/d.json) |",
        # vLLM Triton's NaN graph time is no peer: FlashMLA, 200 / 250
        f"| `mla_decode_paged` | S1 | 200.0 | 50% copy | FlashMLA | 250.0 | 0.80 | graph | {run} "
        f"| [`d.json`]({link}decode/d.json) |",
        # torch.topk is faster but no peer; vllm_b, 10 µs / 5 µs
        f"| `top_k_per_row` | 4 x 2K, k 64 | 10.0 | 25% copy | vLLM `b` | 5.0 | 2.00 | graph "
        f"| {run} | [`t.json`]({link}topk/t.json) |",
        f"| DCP decode layer, W = 2 | L 128K, B 8 | 1,200 | — | W = 1 | 2,000 | 0.60 | graph "
        f"| 2× {run} | [`p.json`]({link}dcp/p.json) |",
        f"| `k2` | T=4 | 70.0 | 30% copy | — |  |  | do_bench | {run} "
        f"| [`s.json`]({link}small/s.json) |",
    ]
    lines = out.splitlines()
    assert lines[2:2 + len(expected)] == expected
    assert f"![A figure]({link}decode/fig.png)" in out and "Not shown" not in out


def test_missing_or_unreadable_results_are_named_not_fatal(tmp_path: Path):
    _write(tmp_path, "decode/d.json", _decode_file())
    _write(tmp_path, "decode/broken.json", "{")
    _write(tmp_path, "decode/odd.json", {"decode": [{"shape": {}}]})
    _write(tmp_path, "decode/list.json", [1, 2])
    (tmp_path / "decode/binary.json").write_bytes(b"\xff\xfe\x00")
    selection = [(rel, tables._decode_peers, ["S1"]) for rel in (
        "decode/absent.json", "decode/broken.json", "decode/odd.json", "decode/list.json",
        "decode/binary.json")]
    selection.append(("decode/d.json", tables._decode_peers, ["S1", "S9"]))
    out = tables.render_peers(tmp_path, selection=selection,
                              figures=[("gone", "decode/gone.png")])
    assert out.count("| `mla_decode_paged` | S1 |") == 1
    notes = out.split("Not shown: ", 1)[1]
    for expected in ["`decode/absent.json` (missing)", "`decode/broken.json` (not readable",
                     "`decode/odd.json` (unexpected layout (KeyError", "`decode/list.json` "
                     "(unexpected layout (TypeError", "`decode/binary.json` (not readable",
                     "`decode/d.json` has no shape `S9`", "figure `decode/gone.png` (missing)"]:
        assert expected in notes, expected
    assert "gone.png)" not in out.split("Not shown")[0]
    # the other two sections: an empty folder is named, never a crash
    assert "`conformance/x.json` (missing)" in tables.render_conformance(
        tmp_path, selection=[("t", "cases", "conformance/x.json")])
    assert "Not shown: `checks/gpu_check.json` (missing)" in tables.render_equivalence(tmp_path)
    _write(tmp_path, "checks/gpu_check.json", {"results": [{"kernel": "k"}]})
    assert "unexpected layout (KeyError" in tables.render_equivalence(tmp_path)


def test_conformance_counts_are_recounted_from_the_rows(tmp_path: Path):
    statuses = [("k1", "c1", "pass"), ("k1", "c2", "pass"), ("k1", "c3", "fail"),
                ("k2", "c1", "fail"), ("k2", "c2", "fail"), ("k3", "c9", "error"),
                ("k4", "c1", "unsupported")]
    _write(tmp_path, "conformance/r.json", {**_env(), "target": "x", "rows": [
        {"kernel": k, "case": c, "status": s} for k, c, s in statuses]})
    _write(tmp_path, "conformance/ok.json", {**_env(), "rows": [
        {"kernel": "k", "case": "c", "status": "pass"}]})
    out = tables.render_conformance(tmp_path, selection=[
        ("Peer X", "catalogue", "conformance/r.json"), ("Ours", "a few", "conformance/ok.json")])
    link = f"{tables.LINK}/conformance"
    assert out.splitlines()[2:] == [
        "| Peer X | catalogue (7) | 2 | 3 | 1 | 1 | `k1/c3`, `k2` ×2, `k3/c9 (error)` "
        f"| GPU-X, 2030-01-02 | [`r.json`]({link}/r.json) |",
        f"| Ours | a few (1) | 1 | 0 | 0 | 0 | — | GPU-X, 2030-01-02 "
        f"| [`ok.json`]({link}/ok.json) |"]


def test_equivalence_names_the_case_nearest_each_budget(tmp_path: Path):
    _write(tmp_path, "checks/c.json", {**_env(), "dtype": "bfloat16", "results": [
        {"kernel": "k1", "passed": True, "metrics": {"out_rel": 1e-3, "lse_abs": 1e-5},
         "limits": {"out_rel": 4e-3, "lse_abs": 1e-4}},
        {"kernel": "k1", "passed": False, "metrics": {"out_rel[out]": 3e-3, "extra": 9.0},
         "limits": {"out_rel[out]": 4e-3}},
        {"kernel": "k2", "passed": True, "metrics": {"mismatches[idx]": 0.0},
         "limits": {"mismatches[idx]": 0.0}}]})
    out = tables.render_equivalence(tmp_path, "checks/c.json")
    assert out.splitlines()[0].startswith(
        "`python -m mla.check` on GPU-X, 2030-01-02 (bfloat16 inputs, every output against "
        "the float64 reference): 2 of 3 cases pass")
    # k1: the second case, 3e-3 / 4e-3 = 75% (the unbudgeted "extra" is not a ratio)
    assert out.splitlines()[-2:] == ["| `k1` | 2 | 1 | out_rel 3.0e-03 of 4.0e-03 (75%) |",
                                     "| `k2` | 1 | 1 | exact (every byte or index) |"]


def test_the_paper_names_no_sessions_and_no_device_time():
    for word in ("session", "device time"):
        assert word not in TEXT.lower(), word


# --- equations and the functions that implement them --------------------------------------

def _resolve(dotted: str) -> object:
    """Import the longest module prefix of ``dotted`` and getattr the rest."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


EQUATION = re.compile(r"\\tag\{(\d+)\}\$\$\n\nImplemented by: (.+?)(?:\n\n|\Z)", re.S)
# Equation numbers are never changed (the code, notebooks and conventions cite them), so one
# added later takes the next free number wherever it stands: (31)-(34), DeepSeek-V4's sink and
# MODEL1 page, sit in section 10, before (29) and (30).
FIRST_EDITION = 30


def test_every_equation_is_numbered_in_order_and_tied_to_functions():
    tags = [int(t) for t in re.findall(r"\\tag\{(\d+)\}", TEXT)]
    assert sorted(tags) == list(range(1, len(tags) + 1)) and len(tags) >= 25, "each number once"
    assert [t for t in tags if t <= FIRST_EDITION] == list(range(1, FIRST_EDITION + 1))
    later = [t for t in tags if t > FIRST_EDITION]
    assert later == sorted(later), "the later equations stand in the order of their numbers"
    tied = EQUATION.findall(TEXT)
    assert [int(t) for t, _ in tied] == tags, "each equation is followed by 'Implemented by:'"
    for tag, line in tied:
        names = re.findall(r"`(mla\.[\w.]+)`", line)
        assert names, f"equation ({tag}) names no function"
        for name in names:
            assert callable(_resolve(name)) or isinstance(_resolve(name), property), name


def test_every_package_name_in_the_paper_exists():
    names = set(re.findall(r"`(mla\.[\w.]+)`", TEXT))
    assert len(names) > 40
    for name in sorted(names):
        _resolve(name)  # raises if the module or the attribute is missing


def test_resolve_rejects_a_wrong_name():
    with pytest.raises(AttributeError):
        _resolve("mla.reference.decode.absorbed_attentoin")


# --- citations -----------------------------------------------------------------------------

def _bib_entries() -> dict[str, str]:
    text = BIB.read_text()
    starts = list(re.finditer(r"^@(\w+)\{([^,]+),", text, re.M))
    return {m.group(2): text[m.start(): (starts[i + 1].start() if i + 1 < len(starts)
                                         else len(text))]
            for i, m in enumerate(starts)}


def test_citations_and_bibliography_match():
    cited = set()
    for group in re.findall(r"\[(@[^\]]+)\]", TEXT):
        cited |= {k.split(",")[0].strip() for k in re.findall(r"@([\w-]+(?:,[^;\]]*)?)", group)}
    entries = _bib_entries()
    assert cited - set(entries) == set(), "cited but not in references.bib"
    assert set(entries) - cited == set(), "in references.bib but never cited"
    for key, entry in entries.items():
        for field in ("title", "author", "year"):
            assert re.search(rf"^\s*{field}\s*=", entry, re.M), f"{key} lacks {field}"


@pytest.mark.parametrize("needle", [
    "2405.04434", "2412.19437", "DeepSeek-V3.2-Exp", "FlashMLA", "2205.14135", "2307.08691",
    "2407.08608", "flashdecoding", "1805.02867", "2104.09864", "2309.00071", "2309.06180",
    "2501.01005", "2309.17453", "2508.10925",
])
def test_bibliography_has_the_works_the_issue_names(needle: str):
    assert needle in BIB.read_text()


# --- numbers the paper states, recomputed (the scale, the crossover, the ridge) -----------

def _eq13_flops(cfg, form: str, sq: float, skv: float) -> float:
    """Eq. (13) with every (query, key) pair computed (``π = Sq·Skv``)."""
    N, P, R, V, Lkv = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                       cfg.v_head_dim, cfg.kv_lora_rank)
    pairs = sq * skv
    if form == "compute-friendly":
        return 2 * skv * Lkv * N * (P + V) + 2 * pairs * N * (P + R + V)
    return 2 * sq * N * Lkv * (P + V) + 2 * pairs * N * (2 * Lkv + R)


def _crossover_by_bisection(cfg, skv: int) -> float:
    """The ``Sq`` where the two forms of (13) cost the same, solved numerically (not by (14))."""
    def gap(sq: float) -> float:
        return _eq13_flops(cfg, "absorbed", sq, skv) - _eq13_flops(cfg, "compute-friendly", sq, skv)
    lo, hi = 1e-9, 1e6
    assert gap(lo) < 0 < gap(hi)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def test_eq13_counts_the_flops_of_the_two_reference_functions():
    """(13) equals what FlopCounterMode counts running the reference on meta tensors."""
    cfg = get_config("deepseek-v3").replace(num_heads=4)
    N, P, R, V, Lkv = 4, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, 512
    sq, skv = 3, 37
    meta = dict(device="meta", dtype=torch.bfloat16)
    args = (torch.empty(sq, N, P, **meta), torch.empty(sq, N, R, **meta),
            torch.empty(skv, Lkv, **meta), torch.empty(skv, R, **meta),
            torch.empty(Lkv, N, P, **meta), torch.empty(Lkv, N, V, **meta))
    for form, fn in [("compute-friendly", prefill_attention), ("absorbed", absorbed_attention)]:
        with FlopCounterMode(display=False) as counter:
            fn(*args, cfg.softmax_scale, causal=True)
        assert counter.get_total_flops() == _eq13_flops(cfg, form, sq, skv), form


def _stated_crossovers() -> dict[int, float]:
    """The exact crossovers as the paper states them after (14): '146.3 at `Skv = 1024`, ...'."""
    match = re.search(r"The exact `S_q\^\*` grows with\s+`Skv` towards `S_q\^∞`: (.+?)\s+for\s+"
                      r"DeepSeek's dimensions", TEXT, re.S)
    assert match, "the paragraph after (14) that gives the exact crossover is gone"
    pairs = re.findall(r"([\d.]+) at (?:`Skv = )?(\d+)`?", match.group(1))
    return {int(skv): float(sq) for sq, skv in pairs}


def test_the_exact_crossover_the_paper_states_solves_eq13():
    cfg = get_config("deepseek-v3")
    stated = _stated_crossovers()
    assert set(stated) == {1024, 4096, 8192, 65536}
    P, R, V, Lkv = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                    cfg.kv_lora_rank)
    sq_inf = Lkv * (P + V) / (2 * Lkv + R - (P + R + V))
    assert round(sq_inf, 1) == 170.7 and "\\approx 170.7" in TEXT
    for skv, sq in stated.items():
        exact = _crossover_by_bisection(cfg, skv)
        assert round(exact, 1) == sq, (skv, exact, sq)
        assert exact == pytest.approx(1 / (1 / sq_inf + 1 / skv), rel=1e-9)  # (14) itself
        # N cancels: 16 heads cross at the same Sq
        assert _crossover_by_bisection(cfg.replace(num_heads=16), skv) == pytest.approx(exact)
    # the broken twin: the approximation that drops the absorbed form's 2·Sq·N·Lkv(P+V) term
    assert round(sq_inf, 1) != stated[1024] and abs(sq_inf - stated[1024]) > 20


def test_the_approximation_error_the_paper_states():
    match = re.search(r"overestimates the crossover by\s+the factor `1 \+ S_q\^∞/Skv`, "
                      r"(\d+)% at `Skv = 1024`, ([\d.]+)% at 8192 and ([\d.]+)% at 65536", TEXT)
    assert match, "the error of the approximation S_q^∞ is no longer stated"
    cfg = get_config("deepseek-v3")
    for text, skv in zip(match.groups(), (1024, 8192, 65536)):
        error = 100 * (_crossover_by_bisection(cfg, 10 ** 9) / _crossover_by_bisection(cfg, skv)
                       - 1)
        assert float(text) == pytest.approx(error, abs=0.5 * 10 ** -(len(text.split(".")[-1])
                                                                     if "." in text else 0)), skv


@pytest.mark.parametrize("preset, stated", [("deepseek-v3", 0.1352), ("deepseek-v2", 0.1147)])
def test_the_absorbed_scale_the_paper_states_is_the_presets(preset: str, stated: float):
    c = get_config(preset)
    # recomputed from the fields by (4), not read back from softmax_scale only
    lam = 0.1 * c.rope_mscale * math.log(c.rope_factor) + 1
    assert round(lam ** 2 / math.sqrt(c.qk_nope_head_dim + c.qk_rope_head_dim), 4) == stated
    assert round(c.softmax_scale, 4) == stated and round(c.mscale, 4) == round(lam, 4)
    assert round(1 / math.sqrt(c.latent_dim), 4) != stated  # the classic bug's scale
    name = "V3" if preset == "deepseek-v3" else "V2"
    assert f"{stated} for DeepSeek-{name}" in TEXT or f"{stated} for {name}" in TEXT
    table_row = next(ln for ln in TEXT.splitlines() if ln.startswith("| `τ` |"))
    assert str(stated) in table_row
    readme = (PAPERS.parent / "README.md").read_text()
    five_lines = readme.split("## MLA in five lines", 1)[1].split("\n## ", 1)[0]
    assert f"{stated} for {name}" in five_lines and "not `1/sqrt(576)`" in five_lines


def _measured_ceilings() -> list[tuple[float, float]]:
    """``(matmul TFLOP/s, copy TB/s)`` of every committed result file that measured them on
    the H200 (the paper's ridge is the H200's; a file that names another GPU is left out)."""
    out = []
    for path in sorted(tables.RESULTS.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
            ceil = data.get("ceilings")
        except (json.JSONDecodeError, AttributeError):
            continue
        env = data.get("environment") if isinstance(data.get("environment"), dict) else {}
        gpu = str(data.get("gpu", data.get("device", env.get("gpu", ""))))
        if gpu and "H200" not in gpu:
            continue
        if ceil:
            tbps = ceil.get("copy_TBps", ceil.get("copy_GBps", 0) / 1000)
            out.append((ceil["matmul_TFLOPs"], tbps))
    return out


def test_the_ridge_numbers_follow_from_the_measured_and_datasheet_ceilings():
    measured = _measured_ceilings()
    assert len(measured) >= 3
    # the paper's "about 700 TFLOP/s" and "about 4.25 TB/s" are the measured ceilings
    for tflops, tbps in measured:
        assert tflops == pytest.approx(700, rel=0.05) and tbps == pytest.approx(4.25, rel=0.02)
    assert round(700 / 4.25) == 165 and "≈ 165` FLOP/byte" in TEXT
    assert round(989 / 4.8) == 206 and "989·10^12 / 4.8·10^12 ≈ 206" in TEXT
    v3 = get_config("deepseek-v3")
    per_head = (2 * v3.kv_lora_rank + v3.qk_rope_head_dim) / v3.latent_dim
    assert round(per_head, 2) == 1.89 and "≈ 1.89·N·Sq" in TEXT
    assert round(1.89 * 128) == 242 and "`1.89·128 ≈ 242`" in TEXT
    assert 16 * per_head < 700 / 4.25 < 989 / 4.8 < 128 * per_head  # 16 heads below both ridges


def test_retired_notations_do_not_come_back():
    """One meaning per symbol: the notations that clashed were renamed and stay retired."""
    for old in ["L_{max}", "p_{t,s,n}", "m = 0.1", "\\frac{i-\\ell}{u-\\ell}", "R_{s-t}",
                "\\operatorname{top-}k", "n_r", "stays\n`τ = 1/√(P+R)`", "2mkn",
                "independently of `Skv`"]:
        # a symbol, not a piece of a word: "n_r" is retired, the tables' "attention_ratio" is not
        pattern = re.escape(old)
        if re.fullmatch(r"\w+", old):
            pattern = rf"(?<![A-Za-z0-9_]){pattern}(?![A-Za-z0-9])"
        assert not re.search(pattern, TEXT), old
