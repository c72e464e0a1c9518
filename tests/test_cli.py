"""The walkthrough and the ``mla`` command line: every path agrees with the definition, the
exit status reflects the tolerance, and the subcommands print what they promise."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from mla import get_config, kv_cache_comparison
from mla.cli import main
from mla.cli.walkthrough import ROWS, Case, Measurement, RowSpec, run_walkthrough
from mla.compare import TOLERANCES
from mla.reference import plan_context_chunks, prefill_attention
from mla.reference.front import mla_front

PATHS = [spec.path for spec in ROWS]


@pytest.mark.parametrize("dtype, bound", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_walkthrough_tiny_agrees_with_definition(dtype: torch.dtype, bound: float) -> None:
    rows = run_walkthrough("tiny", dtype=dtype)
    assert [r.path for r in rows] == PATHS
    for r in rows:
        assert r.rel_err < bound, (r.path, r.rel_err)
        assert r.max_abs_err < float("inf") and r.seconds >= 0.0
        assert r.tolerance == TOLERANCES[dtype] and r.passed
    if dtype == torch.float32:
        # the paths really ran in float32: the definition itself shows float32 rounding
        assert rows[0].rel_err > 0.0


def test_walkthrough_edge_lengths_and_block_size() -> None:
    # one request, context 0, new tokens exactly 2, block size 1 and chunks of 1 token
    rows = run_walkthrough("tiny", context_lens=[0], new_tokens=2, block_size=1,
                           max_context_chunk=1, seed=3)
    assert all(r.rel_err < 1e-10 for r in rows), [(r.path, r.rel_err) for r in rows]
    rows = run_walkthrough("tiny", context_lens=[5, 0, 130], new_tokens=4, block_size=64,
                           max_context_chunk=7, seed=4)
    assert all(r.rel_err < 1e-10 for r in rows), [(r.path, r.rel_err) for r in rows]


def _wrong_scale(case: Case) -> Measurement:
    """The classic bug: the absorbed path's 1/sqrt(Lkv+R) as softmax scale."""
    c, w = case.config, case.weights
    outs = []
    for h in case.hidden:
        pos = torch.arange(h.shape[0])
        f = mla_front(w, h, pos)
        o, _ = prefill_attention(f.q_nope, f.q_pe, f.kv_c, f.k_pe, w.W_UK, w.W_UV,
                                 c.latent_dim ** -0.5, q_positions=pos, k_positions=pos)
        outs.append(o.flatten(-2) @ w.W_O)
    return Measurement(torch.cat(outs), torch.cat(case.reference), 0.0)


@pytest.fixture
def buggy_row(monkeypatch: pytest.MonkeyPatch) -> str:
    import mla.cli.walkthrough as wt

    monkeypatch.setattr(wt, "ROWS", [*ROWS, RowSpec("wrong scale", "naive_forward",
                                                    _wrong_scale)])
    return "wrong scale"


def test_walkthrough_flags_a_wrong_path(buggy_row: str) -> None:
    rows = run_walkthrough("tiny")
    bad = [r for r in rows if not r.passed]
    assert [r.path for r in bad] == [buggy_row]
    assert bad[0].rel_err > 1e-3


def test_cli_exit_status_follows_tolerance(buggy_row: str, capsys: pytest.CaptureFixture,
                                           tmp_path) -> None:
    path = tmp_path / "rows.json"
    assert main(["walkthrough", "--preset", "tiny", "--json", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"1 of {len(ROWS) + 1} rows exceed the tolerance" in out and buggy_row in out
    doc = json.loads(path.read_text())
    assert [r["passed"] for r in doc["rows"]] == [True] * len(ROWS) + [False]


def test_cli_walkthrough_prints_table(capsys: pytest.CaptureFixture) -> None:
    assert main(["walkthrough", "--preset", "tiny", "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("path"))
    assert lines[header].split()[:4] == ["path", "against", "rel", "err"]
    body = lines[header + 2: header + 2 + len(PATHS)]
    for path, line in zip(PATHS, body):
        assert line.startswith(path) and line.endswith("yes")
    assert f"all {len(PATHS)} rows within 1e-05" in captured.out
    # progress, one line per row, on stderr
    assert [f"[{k + 1}/{len(PATHS)}]" in captured.err for k in range(len(PATHS))] == \
        [True] * len(PATHS)


def test_cli_walkthrough_json(tmp_path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "rows.json"
    argv = ["walkthrough", "--preset", "tiny", "--context-lens", "0", "1", "17",
            "--new-tokens", "2", "--block-size", "8", "--seed", "5", "--json", str(path)]
    assert main(argv) == 0
    capsys.readouterr()
    doc = json.loads(path.read_text())
    assert doc["preset"] == "tiny" and doc["context_lens"] == [0, 1, 17]
    assert doc["block_size"] == 8 and doc["seed"] == 5
    assert [r["path"] for r in doc["rows"]] == PATHS
    for r in doc["rows"]:
        assert r["passed"] is True and 0.0 <= r["rel_err"] < 1e-10
        assert r["tolerance"] == TOLERANCES[torch.float64]


def test_bad_preset_is_a_clear_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["walkthrough", "--preset", "deepseek-v9"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--preset" in err and "'deepseek-v9'" in err and "deepseek-v2-lite" in err
    with pytest.raises(ValueError, match="unknown preset 'deepseek-v9'"):
        run_walkthrough("deepseek-v9")


@pytest.mark.parametrize("argv, message", [
    (["--new-tokens", "1"], "new_tokens must be >= 2"),
    (["--context-lens", "3", "-1"], "context_lens must be ints >= 0"),
    (["--block-size", "0"], "block_size and max_context_chunk must be positive"),
])
def test_bad_walkthrough_arguments(argv, message, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["walkthrough", "--preset", "tiny", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_run_walkthrough_rejects_bad_dtype() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        run_walkthrough("tiny", dtype="float8")
    with pytest.raises(TypeError, match="dtype must be one of"):
        run_walkthrough("tiny", dtype=torch.int32)


def test_cli_config_deepseek_v2(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "--preset", "deepseek-v2"]) == 0
    out = capsys.readouterr().out
    c = get_config("deepseek-v2")
    assert c.kv_lora_rank + c.qk_rope_head_dim == 576  # conventions §0: the 576-wide cached row
    line = next(line for line in out.splitlines() if "Lkv + R" in line)
    assert line.split()[-1] == "576"
    # Table 1: every row's number, and MLA at 4.5 d_h·l as the paper says
    for row in kv_cache_comparison(c):
        line = next(line for line in out.splitlines() if line.split()[:1] == [row["attention"]])
        assert str(row["numbers_per_token"]) in line.split()
    mla = next(line for line in out.splitlines() if line.split()[:1] == ["MLA"])
    assert mla.split()[-1] == "4.50"


def test_cli_plan(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--context-lens", "0", "5", "17", "--max-context-chunk", "4"]) == 0
    out = capsys.readouterr().out
    assert str(plan_context_chunks([0, 5, 17], max_context_chunk=4)) in out
    assert main(["plan", "--context-lens", "0", "100", "300", "--block-size", "16",
                 "--workspace-size", "200"]) == 0
    out = capsys.readouterr().out
    # 200 // 2 requests with context = 100, rounded down to whole blocks of 16
    assert str(plan_context_chunks([0, 100, 300], max_context_chunk=96)) in out


def test_python_dash_m_mla() -> None:
    done = subprocess.run([sys.executable, "-m", "mla", "config", "--preset", "tiny"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "preset tiny" in done.stdout
