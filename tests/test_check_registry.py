"""The GPU check command's CPU-side logic: registry, budgets per case, aggregation over seeds,
kernel source hashes, the JSON record and the command line (``mla.check``)."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from _interpreter import needs_interpreter

import mla.fast as fast
from mla.check import runner
from mla.check.registry import (
    REGISTRY,
    Case,
    Ctx,
    Result,
    kernel_sources,
    limits_for,
    run_checks,
    worst_errors,
)
from mla.compare import ERROR_BUDGETS

FAMILIES = {"attention_with_lse", "mla_decode_paged", "merge_attn_states",
            "concat_and_cache_mla", "gather_cache", "convert_req_index_to_global_index",
            "prefill_attention",
            "chunked_prefill_attention", "concat_and_cache_fp8_ds_mla", "sparse_mla_decode",
            "sparse_mla_prefill", "cp_lse_ag_out_rs", "indexer_k_quant_and_cache",
            "fp8_mqa_logits", "fp8_paged_mqa_logits", "top_k_per_row", "sparse_front"}
CPU = Ctx(device=torch.device("cpu"), dtype=torch.float16, quick=True)


def test_every_kernel_family_is_registered_under_its_public_fast_name():
    assert set(REGISTRY) == FAMILIES
    for kernel, (fast_name, _) in REGISTRY.items():
        assert callable(getattr(fast, fast_name)), kernel


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_case_lists_are_named_uniquely_and_budgeted(quick, device):
    """Generating the cases runs nothing; every float kernel's cases have a budget for their
    dtype (a missing one would fail the case on the GPU, not here)."""
    ctx = Ctx(device=torch.device(device), dtype=torch.bfloat16, quick=quick)
    for kernel, (_, cases) in REGISTRY.items():
        made = list(cases(ctx))
        assert made, kernel
        names = [c.name for c in made]
        assert len(names) == len(set(names)), kernel
        for c in made:
            dtype = str(c.dtype or ctx.dtype).removeprefix("torch.")
            if any(k == kernel for k, _, _ in ERROR_BUDGETS):
                assert (kernel, dtype, "out_rel") in ERROR_BUDGETS, (kernel, c.name)


def test_limits_come_from_the_budget_table():
    lim = limits_for("mla_decode_paged", torch.bfloat16,
                     {"out_rel": 1.0, "lse_abs[2]": 1.0, "mismatches": 3.0})
    assert lim == {"out_rel": ERROR_BUDGETS[("mla_decode_paged", "bfloat16", "out_rel")],
                   "lse_abs[2]": ERROR_BUDGETS[("mla_decode_paged", "bfloat16", "lse_abs")],
                   "mismatches": 0.0}
    with pytest.raises(ValueError, match="no error budget"):
        limits_for("mla_decode_paged", torch.bfloat16, {"made_up": 0.0})


def _fake(kernel: str, cases: list[Case]) -> None:
    REGISTRY[kernel] = ("mla_decode_paged", lambda ctx: iter(cases))


@pytest.fixture
def scratch_registry():
    saved = dict(REGISTRY)
    REGISTRY.clear()
    yield
    REGISTRY.clear()
    REGISTRY.update(saved)


def test_run_checks_pass_fail_crash_and_missing_budget(scratch_registry):
    b = ERROR_BUDGETS[("mla_decode_paged", "float16", "out_rel")]

    def boom():
        raise RuntimeError("kernel fell over")

    _fake("mla_decode_paged", [Case("under", lambda: {"out_rel": b / 2}),
                               Case("over", lambda: {"out_rel": b * 1.01}),
                               Case("nan", lambda: {"out_rel": math.nan}),
                               Case("crash", boom), Case("nothing", lambda: {}),
                               Case("unbudgeted", lambda: {"what": 0.0}),
                               Case("fp32", lambda: {"out_rel": b / 2}, torch.float32)])
    got = {r.case: r for r in run_checks(CPU)}
    assert got["under"].passed and got["under"].limits == {"out_rel": b}
    assert got["under"].dtype == "float16"
    for name in ("over", "nan", "crash", "nothing", "unbudgeted"):
        assert not got[name].passed, name
    assert "kernel fell over" in got["crash"].error
    assert "no error budget" in got["unbudgeted"].error
    # a case of another dtype is held to that dtype's (tighter) budget
    assert got["fp32"].dtype == "float32" and not got["fp32"].passed


def test_a_missing_fast_function_fails_not_skips(scratch_registry):
    REGISTRY["ghost"] = ("no_such_kernel", lambda ctx: iter([]))
    (r,) = run_checks(CPU)
    assert not r.passed and r.case == "import" and "no_such_kernel" in r.error


@pytest.mark.parametrize("one_kernel", [True, False])
def test_a_case_that_gives_up_the_gluon_kernels_fails(scratch_registry, monkeypatch,
                                                      one_kernel):
    """A Gluon kernel that fails to build turns every later call of the process that would
    launch it to a Triton kernel; Gluon that fails to import, every call (``mla.fast.sm90``).
    The case during which that happened fails, naming why, so the check fails instead of
    passing its later cases on other kernels. Other warnings pass."""
    from mla.check.registry import GLUON_GIVEN_UP
    from mla.fast import sm90

    # the give-up below is this test's alone
    monkeypatch.setattr(sm90, "_why_not", "")
    monkeypatch.setattr(sm90, "_unbuilt", {})
    b = ERROR_BUDGETS[("mla_decode_paged", "float16", "out_rel")]

    def gives_up():
        error = ValueError("'int' object has no attribute 'to'")
        if one_kernel:
            sm90._give_up_kernel("ragged_logits_kernel", error)
        else:
            sm90._give_up(error)
        return {"out_rel": b / 2}

    def other_warning():
        import warnings
        warnings.warn("something else", RuntimeWarning, stacklevel=1)
        return {"out_rel": b / 2}

    _fake("mla_decode_paged", [Case("gives up", gives_up), Case("warns", other_warning)])
    with pytest.warns(RuntimeWarning, match="something else"):
        got = {r.case: r for r in run_checks(CPU)}
    assert not got["gives up"].passed
    assert got["gives up"].error.startswith(f"RuntimeError: {GLUON_GIVEN_UP}")
    assert "has no attribute 'to'" in got["gives up"].error
    assert "every later case" in got["gives up"].error
    assert got["warns"].passed


def test_worst_errors_over_seeds():
    def res(case, seed, dtype, **m):
        return Result("k", case, dtype, m, {}, True, 0.0, "", seed)

    rs = [res("a", 0, "bfloat16", out_rel=1e-3, **{"lse_abs[0]": 2e-6, "lse_abs[1]": 5e-6}),
          res("b", 1, "bfloat16", out_rel=3e-3, mismatches=0.0),
          res("a", 1, "float16", out_rel=2e-4, lse_abs=math.nan)]
    w = worst_errors(rs)
    assert w["k|bfloat16|out_rel"] == {"error": 3e-3, "case": "b", "seed": 1}
    assert w["k|bfloat16|lse_abs"]["error"] == 5e-6
    assert w["k|float16|lse_abs"]["error"] == math.inf  # a NaN is recorded as a failure
    assert not any("mismatches" in k for k in w)


def test_kernel_sources_hash_every_fast_module(tmp_path):
    got = kernel_sources()
    assert "mla/fast/__init__.py" in got and all(k.startswith("mla/fast/") for k in got)
    import pathlib
    repo = pathlib.Path(runner.__file__).resolve().parents[2]
    for path, digest in got.items():
        assert hashlib.sha256((repo / path).read_bytes()).hexdigest() == digest
    # subpackages count too
    fake = tmp_path / "mla" / "fast"
    (fake / "sm90").mkdir(parents=True)
    (fake / "a.py").write_text("x = 1\n")
    (fake / "sm90" / "b.py").write_text("y = 2\n")
    (fake / "notes.txt").write_text("not a source\n")
    assert set(kernel_sources(fake)) == {"mla/fast/a.py", "mla/fast/sm90/b.py"}


@needs_interpreter
def test_command_writes_json_and_markdown(tmp_path, scratch_registry, capsys):
    b = ERROR_BUDGETS[("mla_decode_paged", "float16", "out_rel")]
    _fake("mla_decode_paged", [Case("one", lambda: {"out_rel": b / 3, "mismatches": 0.0})])
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    assert runner.main(["--device", "cpu", "--seeds", "3", "--seed", "5", "--out", str(out),
                        "--markdown", str(md)]) == 0
    rec = json.loads(out.read_text())
    assert rec["seeds"] == [5, 6, 7] and rec["passed"] and rec["n_results"] == 3
    assert rec["dtype"] == "float16" and rec["quick"]
    assert rec["kernel_sources"] == kernel_sources()
    assert rec["worst"]["mla_decode_paged|float16|out_rel"]["error"] == pytest.approx(b / 3)
    assert rec["results"] == []  # several seeds: only the failures are listed
    assert md.read_text().startswith("| kernel | case | dtype |")
    _fake("mla_decode_paged", [Case("bad", lambda: {"out_rel": 1.0})])
    assert runner.main(["--device", "cpu", "--out", str(out)]) == 1
    rec = json.loads(out.read_text())
    assert not rec["passed"] and rec["results"][0]["case"] == "bad"


def test_command_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        runner.main(["--seeds", "0"])
    assert e.value.code == 2 and "--seeds must be at least 1" in capsys.readouterr().err
    for argv, said in ((["--jobs", "0"], "--jobs must be at least 1"),
                       (["--jobs", "2", "--seeds", "2"], "--jobs runs one seed")):
        with pytest.raises(SystemExit) as e:
            runner.main(argv)
        assert e.value.code == 2 and said in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert runner.main(["--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_environment_keeps_its_import_path():
    """benchmarks/*.py take their report heading from here."""
    from mla.check.runner import environment

    env = environment()
    assert {"date", "torch", "triton", "python"} <= set(env)


def test_kernels_split_into_groups_of_about_as_many_cases():
    kernels = list(REGISTRY)
    count = {k: sum(1 for _ in REGISTRY[k][1](CPU)) for k in kernels}
    groups = runner.split_kernels(CPU, kernels, 3)
    assert len(groups) == 3 and sorted(k for g in groups for k in g) == sorted(kernels)
    sizes = [sum(count[k] for k in g) for g in groups]
    # greedy, largest first: no group passes the smallest by more than the largest kernel
    assert max(sizes) - min(sizes) <= max(count.values())
    for g in groups:
        assert g == [k for k in REGISTRY if k in g]  # the registry's order within a group
    assert runner.split_kernels(CPU, ["gather_cache"], 4) == [["gather_cache"]]


@needs_interpreter
def test_jobs_write_the_record_one_process_writes(tmp_path):
    """``--jobs 2``: the same results, in the same order, and the same record around them."""
    kernels = ["gather_cache", "concat_and_cache_mla", "convert_req_index_to_global_index"]
    args = [a for k in kernels for a in ("--kernel", k)]
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert runner.main(["--device", "cpu", "--out", str(one), *args]) == 0
    assert runner.main(["--device", "cpu", "--jobs", "2", "--out", str(two), *args]) == 0
    a, b = json.loads(one.read_text()), json.loads(two.read_text())

    def rows(rec):
        return [(r["kernel"], r["case"], r["passed"], r["metrics"]) for r in rec["results"]]

    assert rows(a) == rows(b) and len(rows(a)) > 3
    assert {r[0] for r in rows(b)} == set(kernels)
    for key in ("kernel_sources", "dtype", "quick", "seeds", "passed", "n_results", "worst"):
        assert a[key] == b[key], key


def test_a_process_that_dies_fails_its_kernels(monkeypatch):
    """A process of ``--jobs`` that ends without its record: each of its kernels fails,
    naming the exit status (never a pass by omission)."""
    class Dies:
        def __init__(self, cmd, **kwargs):
            self.kernels = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--kernel"]

        def wait(self):
            return -9

    monkeypatch.setattr(runner.subprocess, "Popen", Dies)
    got = runner.run_parallel(CPU, ["gather_cache", "merge_attn_states"], 2)
    assert [r.kernel for r in got] == [k for k in REGISTRY
                                       if k in ("gather_cache", "merge_attn_states")]
    assert all(not r.passed and "exited with status -9" in r.error for r in got)
