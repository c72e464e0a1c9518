"""The walkthrough and the ``mla`` command line: every path agrees with the definition, the
fast rows run under Triton's interpreter or say why they cannot, the exit status reflects the
tolerance (and a missing device), and the subcommands print what they promise."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec

import pytest
import torch
from _interpreter import needs_interpreter

from mla import get_config, kv_cache_comparison
from mla.cli import main
from mla.cli.case import CannotRunError, DeviceUnavailableError, check_device
from mla.cli.kernel_rows import fast_target, interpreter_requests
from mla.cli.walkthrough import ROWS, Case, Measurement, RowSpec, run_walkthrough
from mla.compare import TOLERANCES, budget
from mla.reference import plan_context_chunks, prefill_attention
from mla.reference.front import mla_front

PATHS = [spec.path for spec in ROWS]
FAST = [p for p in PATHS if p.startswith("fast ")]



@pytest.mark.parametrize("dtype, bound", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_walkthrough_tiny_agrees_with_definition(dtype: torch.dtype, bound: float) -> None:
    rows = run_walkthrough("tiny", dtype=dtype, fast=False)
    assert [r.path for r in rows] == PATHS
    ran = [r for r in rows if r.skipped is None]
    assert [r.path for r in ran] == [p for p in PATHS if p not in FAST
                                     and (dtype != torch.float64 or p != "naive (definition)")]
    for r in ran:
        assert r.rel_err < bound, (r.path, r.rel_err)
        assert r.max_abs_err < float("inf") and r.seconds >= 0.0
        assert r.tolerance == TOLERANCES[dtype] and r.passed and not r.failed
    if dtype == torch.float32:
        # the paths really ran in float32: the definition itself shows float32 rounding
        assert rows[0].path == "naive (definition)" and rows[0].rel_err > 0.0
    else:
        # float64 on the CPU: the definition is its own reference, a row that cannot fail
        assert "the definition is the reference itself" in rows[0].skipped
    for r in rows:
        if r.path in FAST:
            assert r.skipped == "not asked for (--no-fast)"
            assert not r.passed and not r.failed


def test_walkthrough_edge_lengths_and_block_size() -> None:
    # one request, context 0, new tokens exactly 2, block size 1 and chunks of 1 token; the
    # fast rows too where the interpreter runs them
    rows = run_walkthrough("tiny", context_lens=[0], new_tokens=2, block_size=1,
                           max_context_chunk=1, seed=3)
    assert all(r.passed for r in rows if r.skipped is None), [(r.path, r.error) for r in rows]
    assert all(r.rel_err < 1e-10 for r in rows if r.dtype == "float64")
    rows = run_walkthrough("tiny", context_lens=[5, 0, 130], new_tokens=4, block_size=64,
                           max_context_chunk=7, seed=4, fast=False)
    ran = [r for r in rows if r.skipped is None]
    assert len(ran) == len(PATHS) - len(FAST) - 1  # less the fast rows and the definition
    assert all(r.rel_err < 1e-10 for r in ran), [(r.path, r.rel_err) for r in ran]


@needs_interpreter
def test_walkthrough_fast_rows_run_under_the_interpreter() -> None:
    rows = {r.path: r for r in run_walkthrough("tiny", context_lens=[5, 0, 70])}
    for path in FAST:
        r = rows[path]
        if path == "fast prefill_attention: o":  # on the CPU its route is the reference
            assert "reference's own math" in r.skipped and not r.passed
            continue
        assert r.skipped is None and r.dtype == "float32" and r.passed, (path, r)
        assert r.metric == ("abs" if path.endswith("lse") else "rel")
        # against float64: float32 rounding shows, under the kernel's budget
        assert 0.0 < r.error < r.tolerance, (path, r.error, r.tolerance)
    assert rows["fast mla_decode_paged s_q=2: lse"].tolerance == budget(
        "mla_decode_paged", torch.float32, "lse_abs")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_walkthrough_fast_rows_on_cuda(dtype: str) -> None:
    rows = run_walkthrough("deepseek-v2-lite", dtype=dtype, device="cuda")
    assert all(r.skipped is None for r in rows), [(r.path, r.skipped) for r in rows]
    bad = [(r.path, r.error, r.tolerance) for r in rows if not r.passed]
    assert not bad
    assert {r.dtype for r in rows} == {dtype}


def test_interpreter_requests_are_the_two_ends() -> None:
    assert interpreter_requests([0, 1, 17, 40, 70]) == [0, 4]
    assert interpreter_requests([5, 0, 130, 7]) == [1, 2]
    assert interpreter_requests([9]) == [0]


@pytest.mark.parametrize("env, find, reason", [
    ("0", True, "need TRITON_INTERPRET=1 set before triton is imported"),
    ("1", False, "triton is not installed"),
])
def test_fast_rows_say_why_they_cannot_run(env: str, find: bool, reason: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import mla.cli.kernel_rows as kr

    monkeypatch.setenv("TRITON_INTERPRET", env)
    if not find:
        monkeypatch.setattr(kr.importlib.util, "find_spec",
                            lambda name, *a: None if name == "triton" else find_spec(name, *a))
    rows = run_walkthrough("tiny", context_lens=[3], new_tokens=2)
    for r in rows:
        if r.path in FAST:
            assert reason in r.skipped and not r.passed and not r.failed, r
        else:
            assert r.skipped is None or r.path == "naive (definition)"


def test_fast_rows_skip_float64_on_cuda_and_other_devices() -> None:
    case = Case.build("tiny", torch.float64, "cpu", [3], 2, 64, 16, 0)
    case.device = torch.device("cuda")  # as a CUDA run would be: only the check runs
    with pytest.raises(CannotRunError, match="take float16, bfloat16 or float32, the run is "
                                             "float64"):
        fast_target(case)
    case.device = torch.device("meta")
    with pytest.raises(CannotRunError, match="not on meta"):
        fast_target(case)


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
    rows = run_walkthrough("tiny", fast=False)
    bad = [r for r in rows if r.failed]
    assert [r.path for r in bad] == [buggy_row]
    assert bad[0].rel_err > 1e-3


def test_kernel_lse_row_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference decode's lse is compared with scores worked out independently: an lse
    off by 1e-6 (a wrong scale or a dropped key would be far more) fails the row."""
    import mla.reference

    real = mla.reference.mla_decode_paged

    def off(*args, **kwargs):  # type: ignore[no-untyped-def]
        o, lse = real(*args, **kwargs)
        return o, lse + 1e-6

    monkeypatch.setattr(mla.reference, "mla_decode_paged", off)
    rows = {r.path: r for r in run_walkthrough("tiny", context_lens=[0, 9], fast=False)}
    assert rows["reference mla_decode_paged s_q=2: lse"].failed
    assert rows["reference mla_decode_paged s_q=2: o"].passed


@needs_interpreter
def test_fast_rows_catch_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken twins of two fast kernels: a softmax scale 0.5% off in the decode, a merge that
    weighs the prefix 1% too much: their rows fail, the others still pass."""
    import mla.fast

    decode, merge = mla.fast.mla_decode_paged, mla.fast.merge_attn_states

    def decode_bad_scale(q, kv_cache, block_table, cache_seqlens, softmax_scale, *a, **k):
        return decode(q, kv_cache, block_table, cache_seqlens, softmax_scale * 1.005, *a, **k)

    def merge_heavy_prefix(o_p, lse_p, o_s, lse_s):  # type: ignore[no-untyped-def]
        return merge(o_p, lse_p + 0.01, o_s, lse_s)

    monkeypatch.setattr(mla.fast, "mla_decode_paged", decode_bad_scale)
    monkeypatch.setattr(mla.fast, "merge_attn_states", merge_heavy_prefix)
    rows = {r.path: r for r in run_walkthrough("tiny", context_lens=[0, 40])}
    assert [p for p in FAST if rows[p].failed] == [
        "fast mla_decode_paged s_q=2: o", "fast mla_decode_paged s_q=2: lse",
        "fast merge_attn_states, context | new tokens: o"]


def test_cli_exit_status_follows_tolerance(buggy_row: str, capsys: pytest.CaptureFixture,
                                           tmp_path) -> None:
    path = tmp_path / "rows.json"
    assert main(["walkthrough", "--preset", "tiny", "--no-fast", "--json", str(path)]) == 1
    out = capsys.readouterr().out
    ran = len(ROWS) + 1 - len(FAST) - 1  # the fast rows and the float64 definition skipped
    assert f"1 of {ran} rows exceed their tolerance; {len(FAST) + 1} skipped" in out
    assert buggy_row in out.splitlines()[-1]
    doc = json.loads(path.read_text())
    assert [r["passed"] for r in doc["rows"]][-1] is False
    assert doc["fast"] is False
    for r in doc["rows"]:
        if r["skipped"] is not None:  # a skipped row has no numbers, and did not pass
            assert r["rel_err"] is None and r["tolerance"] is None and r["passed"] is False


def test_cli_walkthrough_prints_table(capsys: pytest.CaptureFixture) -> None:
    assert main(["walkthrough", "--preset", "tiny", "--dtype", "float32", "--no-fast"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("path"))
    assert lines[header].split() == ["path", "against", "dtype", "rel", "err", "max", "abs",
                                     "err", "limit", "time", "ok"]
    body = lines[header + 2: header + 2 + len(PATHS)]
    for path, line in zip(PATHS, body):
        assert line.startswith(path)
        if path in FAST:
            assert line.split(None, len(path.split()))[-1] == \
                "skipped: not asked for (--no-fast)"
        else:
            assert line.endswith("yes") and " float32 " in line and "rel 1.0e-05" in line
    ran = len(PATHS) - len(FAST)
    assert f"all {ran} rows within their tolerance; {len(FAST)} skipped" in captured.out
    # progress, one line per row, on stderr
    assert [f"[{k + 1}/{len(PATHS)}]" in captured.err for k in range(len(PATHS))] == \
        [True] * len(PATHS)


@needs_interpreter
def test_cli_walkthrough_runs_fast_rows_on_the_cpu(capsys: pytest.CaptureFixture) -> None:
    assert main(["walkthrough", "--preset", "tiny", "--context-lens", "0", "4", "30"]) == 0
    out = capsys.readouterr().out
    assert "fast rows: Triton's interpreter on the CPU, float32, the requests with context " \
           "0 and 30" in out
    line = next(line for line in out.splitlines() if line.startswith(FAST[0]))
    assert " float32 " in line and line.endswith("yes")


def test_cli_walkthrough_json(tmp_path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "rows.json"
    argv = ["walkthrough", "--preset", "tiny", "--context-lens", "0", "1", "17",
            "--new-tokens", "2", "--block-size", "8", "--seed", "5", "--json", str(path),
            "--no-fast"]
    assert main(argv) == 0
    capsys.readouterr()
    doc = json.loads(path.read_text())
    assert doc["preset"] == "tiny" and doc["context_lens"] == [0, 1, 17]
    assert doc["block_size"] == 8 and doc["seed"] == 5
    assert [r["path"] for r in doc["rows"]] == PATHS
    for r in doc["rows"]:
        if r["skipped"] is None:
            assert r["passed"] is True and 0.0 <= r["rel_err"] < 1e-10
            assert r["tolerance"] == TOLERANCES[torch.float64] and r["dtype"] == "float64"


def test_cli_device_not_available_is_one_line_and_status_3(
        capsys: pytest.CaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert main(["walkthrough", "--preset", "tiny", "--device", "cuda"]) == 3
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("mla walkthrough: device 'cuda' is not available: ")
    # the same from the installed entry point: no traceback
    done = subprocess.run([sys.executable, "-m", "mla", "walkthrough", "--preset", "tiny",
                           "--device", "cuda"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and done.stdout == ""
    assert done.stderr.startswith("mla walkthrough: device 'cuda' is not available: ")
    assert done.stderr.count("\n") == 1, done.stderr
    with pytest.raises(DeviceUnavailableError, match="'cuda:3' is not available"):
        check_device("cuda:3")


def test_cli_bad_device_name_is_status_2(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["walkthrough", "--preset", "tiny", "--device", "gpu0"])
    assert exc.value.code == 2
    assert "device must be a torch device such as 'cpu'" in capsys.readouterr().err


def test_cli_help_lists_exit_statuses(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["walkthrough", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("exit status: 0 every row that ran is within its tolerance, 1 a row is over it, "
            "2 bad arguments, 3 the device is not available.") in out


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
