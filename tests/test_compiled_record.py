"""``tests/_compiled.py``: a recorded child's output is used only under the tree's key."""

from __future__ import annotations

import json

import _compiled
import pytest

ARGV = ["-c", "print('[1, 2]')"]


def _write(path, key: str, printed) -> None:
    path.write_text(json.dumps({json.dumps(ARGV): {"key": key, "printed": printed}}))


def test_the_record_answers_under_the_trees_key(tmp_path, monkeypatch):
    monkeypatch.setattr(_compiled, "RECORD", tmp_path / "record.json")
    monkeypatch.delenv("MLA_RECORD_COMPILED", raising=False)
    _write(_compiled.RECORD, _compiled.source_key(ARGV), [7])
    assert _compiled.compiled(ARGV) == [7]


def test_a_stale_record_runs_the_child(tmp_path, monkeypatch):
    monkeypatch.setattr(_compiled, "RECORD", tmp_path / "record.json")
    monkeypatch.delenv("MLA_RECORD_COMPILED", raising=False)
    _write(_compiled.RECORD, "0" * 64, [7])
    assert _compiled.compiled(ARGV) == [1, 2]
    assert json.loads(_compiled.RECORD.read_text())[json.dumps(ARGV)]["printed"] == [7]


def test_recording_writes_what_the_child_printed(tmp_path, monkeypatch):
    monkeypatch.setattr(_compiled, "RECORD", tmp_path / "record.json")
    monkeypatch.setenv("MLA_RECORD_COMPILED", "1")
    assert _compiled.compiled(ARGV) == [1, 2]
    entry = json.loads(_compiled.RECORD.read_text())[json.dumps(ARGV)]
    import triton

    assert entry == {"key": _compiled.source_key(ARGV), "printed": [1, 2],
                     "triton": triton.__version__}


def test_the_key_follows_the_sources(tmp_path, monkeypatch):
    """A different kernel source, or another module run, gives another key."""
    before = _compiled.source_key(ARGV)
    assert _compiled.source_key(["-m", "benchmarks.sm90_compile"]) != before
    fake = tmp_path / "mla" / "fast"
    fake.mkdir(parents=True)
    (fake / "k.py").write_text("x = 1\n")
    monkeypatch.setattr(_compiled, "ROOT", tmp_path)
    (tmp_path / "benchmarks").mkdir()
    for m in _compiled.COMPILERS:
        (tmp_path / "benchmarks" / f"{m}.py").write_text("")
    one = _compiled.source_key(ARGV)
    (fake / "k.py").write_text("x = 2\n")
    assert _compiled.source_key(ARGV) != one


def test_the_committed_record_is_the_trees():
    """Every entry of ``tests/sm90_compiled.json`` recorded under this triton is under the
    tree's key. A kernel or compiler module edited without refreshing the record still passes
    every other test, but compiles each variant again on every run: minutes of CI."""
    import triton

    runs = json.loads(_compiled.RECORD.read_text())
    mine = {name: run for name, run in runs.items() if run.get("triton") == triton.__version__}
    if not mine:
        made = sorted({run.get("triton", "?") for run in runs.values()})
        pytest.skip(f"the record was made under triton {made}, this is {triton.__version__}")
    stale = [name[:80] for name, run in mine.items()
             if run["key"] != _compiled.source_key(json.loads(name))]
    assert not stale, (f"{len(stale)} of {len(mine)} recorded compiles are stale; refresh "
                       f"the record as tests/_compiled.py says: {stale}")
