"""The stumbles a new user of ``mla.conformance`` hits, each pinned by a test that fails on the
old behaviour:

1. ``mla conform --target mykern:my_decode`` (the console script) finds ``mykern.py`` in the
   working directory, as ``python -m mla conform`` does;
2. an unknown ``--cases`` name is a usage error that lists the topics (and close names);
3. the diagnoses read right: an infinity of the other sign is named by its sign, the worst
   element of a NaN failure is the NaN, a merge that reads an empty side is told about its
   inputs (not a cache row), the markdown's errors are "out rel ...", not "out out_rel ...";
4. the cases of kernels the target lacks are one line of the text and markdown reports (every
   row stays in the JSON).

Each runs one or a few small cases in float64 on the CPU.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mla.reference as ref
from mla.cli import main
from mla.conformance import CATALOGUE, Unsupported, cases_of, kernels_of, run
from mla.conformance.diagnose import describe, explain
from mla.conformance.targets import load_target

F64 = dict(device="cpu", dtype=torch.float64)
INF, NAN = math.inf, math.nan
MLA_SCRIPT = Path(sys.executable).parent / "mla"  # the console script pip installed

KERNEL_SOURCE = '''\
import mla.reference as ref


def my_decode(*args, **kwargs):
    """Delegates to the reference."""
    return ref.mla_decode_paged(*args, **kwargs)
'''


# ---- 1. a module:function target from the working directory ----------------------------------

@pytest.mark.skipif(not MLA_SCRIPT.exists(), reason=f"no console script at {MLA_SCRIPT}")
def test_the_console_script_finds_the_target_module_in_the_working_directory(tmp_path: Path
                                                                            ) -> None:
    """The README's ``mla conform --target mykern:my_decode`` from the folder of mykern.py:
    a console script does not put the working directory on sys.path (``python -m`` does);
    the target's import looks there first. PYTHONPATH is cleared, so that nothing else
    does."""
    (tmp_path / "mykern.py").write_text(KERNEL_SOURCE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(MLA_SCRIPT), "conform", "--target", "mykern:my_decode",
                           "--kernels", "mla_decode_paged", "--cases", "length_1",
                           "--device", "cpu", "--dtype", "float64"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "target mykern:my_decode" in done.stdout
    assert "pass        mla_decode_paged/length_1" in done.stdout


def test_load_target_puts_the_working_directory_on_sys_path_for_the_import_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "newcomer_kern.py").write_text(KERNEL_SOURCE)
    monkeypatch.chdir(tmp_path)
    path = [p for p in sys.path
            if p not in ("", ".") and os.path.abspath(p) != os.getcwd()]
    monkeypatch.setattr(sys, "path", list(path))
    try:
        name, target = load_target("newcomer_kern:my_decode", ["mla_decode_paged"])
    finally:
        sys.modules.pop("newcomer_kern", None)
    assert name == "newcomer_kern:my_decode"
    assert list(kernels_of(target)) == ["mla_decode_paged"]
    assert sys.path == path  # the working directory taken off again
    with pytest.raises(ValueError, match="from the working directory .* and sys.path"):
        load_target("newcomer_no_such_module:f", ["mla_decode_paged"])
    assert sys.path == path


# ---- 2. an unknown --cases name -------------------------------------------------------------

def test_an_unknown_case_is_a_usage_error_listing_the_topics(capsys: pytest.CaptureFixture
                                                              ) -> None:
    with pytest.raises(SystemExit) as e:
        main(["conform", "--target", "reference", "--cases", "causl", "--device", "cpu"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "mla conform: error: argument --cases: unknown cases ['causl']" in err
    assert "expected kernel/name, a case name or a topic" in err
    assert "did you mean causal" in err
    topics = sorted({c.topic for c in CATALOGUE.values()})
    assert f"the topics: {', '.join(topics)}" in err


def test_unknown_case_errors_name_the_kernels_topics_and_an_empty_selection(
        capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError) as e:
        list(cases_of(["merge_attn_states"], ["no_such_case"]))
    merge_topics = sorted({c.topic for c in cases_of(["merge_attn_states"])})
    assert f"the topics of merge_attn_states: {', '.join(merge_topics)}" in str(e.value)
    # a known topic that none of the kernels chosen has: nothing would run, a usage error
    with pytest.raises(SystemExit) as e:
        main(["conform", "--target", "reference", "--kernels", "merge_attn_states",
              "--cases", "causal", "--device", "cpu"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert ("argument --cases: ['causal'] select no case of --kernels ['merge_attn_states']"
            in err)
    with pytest.raises(SystemExit) as e:
        main(["conform", "--target", "reference", "--kernels", "mla_decode", "--device", "cpu"])
    assert e.value.code == 2
    assert "argument --kernels: unknown kernels ['mla_decode']" in capsys.readouterr().err


# ---- 3. diagnoses ---------------------------------------------------------------------------

def _empty_minus_inf(*args):
    """lse -inf for a query that sees no key (the reference's is +inf)."""
    out, lse = ref.mla_decode_paged(*args)
    return out, torch.where(torch.isposinf(lse), -INF, lse)


def test_an_infinity_of_the_other_sign_is_named_by_its_sign() -> None:
    (row,) = run({"mla_decode_paged": _empty_minus_inf}, cases=["mla_decode_paged/all_empty"],
                 **F64).rows
    assert row.status == "fail"
    assert "lse: -inf where the reference has +inf at 32 of 32 elements" in row.detail
    assert "unexpected" not in row.detail and "reference has inf" not in row.detail
    got = torch.tensor([1.0, -INF, INF, INF, 2.0])
    want = torch.tensor([1.0, INF, -INF, 3.0, INF])
    lines = describe({"x": got}, {"x": want}, {"x": "lse_abs"})
    for line in ("x: +inf where the reference has -inf at 1 of 5 elements, first at (2,); "
                 "dim 0 only at 2",
                 "x: -inf where the reference has +inf at 1 of 5 elements, first at (1,); "
                 "dim 0 only at 1",
                 "x: unexpected +inf at 1 of 5 elements, first at (3,); dim 0 only at 3; the "
                 "reference has 3 at (3,)",
                 "x: reference has +inf at 1 of 5 elements, first at (4,); dim 0 only at 4; "
                 "got 2 at (4,)"):
        assert line in lines, lines


def test_the_worst_element_of_a_nan_failure_is_where_they_differ() -> None:
    want = torch.tensor([[0.5, 1.0], [2.0, 3.0]], dtype=torch.float64)
    got = want.clone()
    got[1, 0] = NAN
    lines = describe({"out": got}, {"out": want}, {"out": "out_rel"})
    worst = [line for line in lines if "worst element" in line]
    assert worst == ["out: worst element (1, 0), the first non-finite mismatch: got nan, "
                     "reference 2"], lines
    got[0, 1] = 1.5  # a finite difference too: named beside the NaN
    (worst,) = [line for line in describe({"out": got}, {"out": want}, {"out": "out_rel"})
                if "worst element" in line]
    assert worst.endswith("; the largest finite difference at (0, 1): got 1.5, reference 1")

    def half_heads_unwritten(*args):
        out, lse = ref.mla_decode_paged(*args)
        out = out.clone()
        out[:, :, out.shape[2] // 2:] = NAN
        return out, lse

    (row,) = run({"mla_decode_paged": half_heads_unwritten},
                 cases=["mla_decode_paged/length_1"], **F64).rows
    assert row.status == "fail"
    (worst,) = [p for p in row.detail.split("; out: ") if p.startswith("worst element")]
    assert "got nan, reference" in worst and "got nan, reference nan" not in worst


def _merge_reads_minus_inf_side(o_p, lse_p, o_s, lse_s):
    """Passes a +inf side's partner through, but weighs a -inf side 0 and multiplies its
    output (NaN) by it: NaN on some of the one-side-empty rows, not all of them, so none of
    the named conventions matches."""
    out, lse = ref.merge_attn_states(o_p, lse_p, o_s, lse_s)
    for o, side in ((o_p, lse_p), (o_s, lse_s)):
        one = torch.isneginf(side) & ~(torch.isinf(lse_p) & torch.isinf(lse_s))
        out = out + 0 * torch.where(one.transpose(0, 1)[..., None], o, 0.0)
    return out, lse


def test_a_merge_reading_an_empty_side_is_told_about_its_inputs_not_a_cache_row() -> None:
    (row,) = run({"merge_attn_states": _merge_reads_minus_inf_side},
                 cases=["merge_attn_states/both_sides_empty"], **F64).rows
    assert row.status == "fail"
    assert "a side with no keys (lse = -inf or +inf, weight 0) was read" in row.convention
    assert "not multiplied by 0" in row.convention
    assert "cache row" not in row.convention
    # the same output of another kernel: the words fit that kernel
    got, want = {"out": torch.tensor([NAN, 1.0])}, {"out": torch.tensor([0.0, 1.0])}
    args = (got, want, {"out": "out_rel"}, {"out": 1e-12}, {})
    assert "a rank with no keys" in explain(*args, kernel="cp_lse_ag_out_rs")
    assert "unused cache row" in explain(*args, kernel="mla_decode_paged")
    assert "unused cache row" in explain(*args)


def test_the_markdown_names_each_error_once_with_its_kind() -> None:
    report = run({"mla_decode_paged": _empty_minus_inf}, cases=["mla_decode_paged/all_empty"],
                 **F64)
    md = report.to_markdown()
    assert "out out_rel" not in md and "lse lse_abs" not in md
    assert "| out rel 0.00e+00 (1.0e-12), lse abs inf (1.0e-12) |" in md

    def zeroes(src, dst, *args, **kwargs):
        return dst.zero_()

    exact = run({"gather_cache": zeroes}, cases=["gather_cache/empty_requests"],
                **F64).to_markdown()
    assert "dst mismatches" not in exact and re.search(r"dst \d+ mismatches \(0\.0e\+00\)",
                                                       exact)


# ---- 4. the kernels the target lacks: one line ----------------------------------------------

def test_the_cases_of_kernels_the_target_lacks_are_one_line() -> None:
    """The README's five lines without ``kernels=[...]``: a target of one kernel, and every
    other kernel's case (152 of the 190) "unsupported". Here one decode case runs; the others
    cost nothing (the runner does not build a case whose kernel the target lacks)."""
    others = [k for k, c in CATALOGUE.items() if c.kernel != "mla_decode_paged"]
    report = run({"mla_decode_paged": ref.mla_decode_paged},
                 cases=["mla_decode_paged/length_1", *others], **F64)
    n = len(others)
    assert report.passed and report.counts()["unsupported"] == n > 150
    text = report.to_text()
    lines = text.splitlines()
    assert lines[0].startswith("pass        mla_decode_paged/length_1")
    assert len(lines) == 3, text  # the case, the line of the kernels lacking, the summary
    assert lines[1].startswith(f"{n} unsupported cases not listed: the target has no ")
    assert "sparse_mla_decode (43), sparse_mla_prefill (21)" in lines[1]
    assert "pass kernels=[...]" in lines[1]
    assert f"{n} unsupported" in lines[2]
    md = report.to_markdown()
    assert md.count("the target has no") == 1 and md.count("\n| mla_decode_paged |") == 1
    assert "| unsupported |" not in md
    rows = json.loads(report.to_json())["rows"]
    assert len(rows) == n + 1
    assert sum(r["detail"] == f"the target has no {r['kernel']}" for r in rows) == n


def test_unsupported_inputs_stay_listed_and_the_command_shows_no_lacking_kernel_progress(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
        ) -> None:
    def one_query_only(q, *args):
        if q.shape[1] != 1:
            raise Unsupported("s_q > 1: one query row per request")
        return ref.mla_decode_paged(q, *args)

    report = run({"mla_decode_paged": one_query_only},
                 cases=["mla_decode_paged/causal_s_q_2", "merge_attn_states/heads_1"], **F64)
    text = report.to_text()
    assert "unsupported mla_decode_paged/causal_s_q_2" in text and "one query row" in text
    assert "1 unsupported cases not listed: the target has no merge_attn_states (1)" in text

    (tmp_path / "newcomer_module.py").write_text(
        "from mla.reference import mla_decode_paged  # noqa: F401\n")
    monkeypatch.chdir(tmp_path)
    try:
        assert main(["conform", "--target", "newcomer_module", "--cases", "length_1",
                     "heads_1", "--device", "cpu", "--dtype", "float64"]) == 0
    finally:
        sys.modules.pop("newcomer_module", None)
    captured = capsys.readouterr()
    progress = captured.err.strip().splitlines()
    assert [p.split()[0] for p in progress] == ["[1/2]", "[2/2]"], captured.err
    assert "the target has no merge_attn_states" in captured.out
