"""papers/: the generated tables are current, every equation is tied to a function that exists,
and every citation is in the bibliography (and every bibliography entry is cited)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from pathlib import Path

import pytest

from mla.config import get_config

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

@pytest.mark.parametrize("name", ["table1", "kv_cache"])
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


# --- benchmark results ---------------------------------------------------------------------

def test_benchmarks_without_results_say_how_to_make_them(tmp_path: Path):
    note = tables.render_benchmarks(tmp_path / "absent")
    assert "python -m benchmarks.run" in note and tables.REGENERATE in note


def test_benchmarks_render_the_decode_format_and_others(tmp_path: Path):
    shape = {"name": "N16 B2 L100", "bound": "memory", "target": 3.2}
    default = {"us": 10.0, "us_graph": 9.0, "TBps": 2.5, "TFLOPs": 40.0, "frac_bw": 0.6,
               "frac_flops": 0.06}
    best = dict(default, us=8.0, TBps=3.3)
    (tmp_path / "decode_x.json").write_text(json.dumps({
        "environment": {"gpu": "GPU-X", "torch": "t", "triton": "tr", "date": "d"},
        "ceilings": {"copy_TBps": 4.2, "matmul_TFLOPs": 700.0},
        "decode": [{"shape": shape, "default": default, "best": best}]}))
    (tmp_path / "other.json").write_text(json.dumps({"gpu": "GPU-Y", "passed": True,
                                                     "cases": [{"case": "a", "err": 1e-3}]}))
    (tmp_path / "broken.json").write_text("{")
    out = tables.render_benchmarks(tmp_path)
    assert "GPU-X" in out and "N16 B2 L100" in out and "3.30" in out and "4.20 TB/s" in out
    assert out.count("| N16 B2 L100 |") == 2  # default and best
    assert "GPU-Y" in out and "| a | 0.001 |" in out
    assert "not readable as JSON" in out
    assert "python -m benchmarks.run" in out  # decode_*.json's producer


def test_committed_benchmark_results_render_and_the_paper_names_only_existing_files():
    rendered = tables.render_benchmarks()
    for path in sorted(tables.RESULTS.glob("*.json")):
        assert path.name in rendered
    committed = tables.extract_section(TEXT, "benchmarks")
    for name in re.findall(r"\*\*`([^`]+\.json)`\*\*", committed):
        assert (tables.RESULTS / name).exists(), f"the paper shows {name}, which is gone"


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


def test_every_equation_is_numbered_in_order_and_tied_to_functions():
    tags = [int(t) for t in re.findall(r"\\tag\{(\d+)\}", TEXT)]
    assert tags == list(range(1, len(tags) + 1)) and len(tags) >= 25
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
    "2501.01005",
])
def test_bibliography_has_the_works_the_issue_names(needle: str):
    assert needle in BIB.read_text()
