"""The committed index of ``benchmarks/results/`` is the one ``benchmarks.results_index`` writes:
every current result exists, and every file sits in a topic's folder."""

from __future__ import annotations

from benchmarks import results_index


def test_the_committed_index_is_current() -> None:
    assert results_index.problems() == []
    assert results_index.INDEX.read_text() == results_index.render(), (
        "benchmarks/results/README.md is stale: run python -m benchmarks.results_index")


def test_series_strips_the_date_and_extension() -> None:
    assert results_index.series("topk_peers_2026-12-02.md") == ("topk_peers", "2026-12-02")
    assert results_index.series("dcp_scaling_2xH200_2026-11-30.png") == (
        "dcp_scaling_2xH200", "2026-11-30")
    assert results_index.series("gpu_check.json") == ("gpu_check", "")


def test_a_stray_file_and_a_missing_current_result_are_problems(tmp_path, monkeypatch) -> None:
    (tmp_path / "decode").mkdir()
    (tmp_path / "stray.json").write_text("{}")
    monkeypatch.setattr(results_index, "CURRENT", [("x", "decode/gone.md")])
    found = results_index.problems(tmp_path)
    assert "current result decode/gone.md is missing" in found
    assert "stray.json is outside the topics' folders" in found
