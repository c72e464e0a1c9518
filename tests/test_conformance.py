"""The conformance library's core: the catalogue, the runner's statuses, the report, and the
decode family's bite (each broken convention fails the cases that pin it, with its name).

The other families' broken twins are in tests/test_conformance_{sparse,merge,cache}.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable

import pytest
import torch
from _interpreter import needs_interpreter

import mla.reference as ref
from mla.conformance import CATALOGUE, KERNELS, Report, Row, Setting, Unsupported, cases_of, run
from mla.conformance.cases.deepseek_v4 import TOPICS as V4_TOPICS
from mla.conformance.runner import run_case
from mla.reference.decode import paged_mqa

F64 = dict(device="cpu", dtype=torch.float64)
REFERENCE = {k: getattr(ref, k) for k in KERNELS}


def _failing(report, status=("fail", "error")):
    return [r for r in report.rows if r.status in status]


# ---- the catalogue ----------------------------------------------------------------------------

def test_catalogue_has_sixty_documented_cases_over_every_kernel():
    cases = list(cases_of())
    assert len(cases) >= 60 and len(cases) == len(CATALOGUE)
    assert {c.kernel for c in cases} == set(KERNELS)
    for c in cases:
        assert c.doc.endswith(".") and len(c.doc) > 20, (c.kernel, c.name, c.doc)
        assert c.topic and c.name.isidentifier(), (c.kernel, c.name)


def test_the_reference_passes_every_case_in_float64_and_a_case_calls_only_its_kernel():
    """The whole catalogue on the reference: every case passes, and no case calls a kernel
    but its own, so a broken twin of one kernel cannot fail another kernel's cases (the
    families' twin tests run only their own kernels' cases)."""
    calls: list[str] = []

    def counting(name: str, fn: Callable) -> Callable:
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped

    called: dict[tuple[str, str], set[str]] = {}

    def progress(row: Row) -> None:
        called[(row.kernel, row.case)] = set(calls)
        calls.clear()

    report = run({k: counting(k, f) for k, f in REFERENCE.items()}, name="mla.reference",
                 progress=progress, **F64)
    assert report.passed, report.to_text()
    assert [r.status for r in report.rows] == ["pass"] * len(CATALOGUE)
    assert len(called) == len(CATALOGUE)
    strays = {case: names for case, names in called.items() if not names <= {case[0]}}
    assert not strays, strays
    # (a case that refuses its input may never reach the kernel; most reach their own)
    assert sum(names == {case[0]} for case, names in called.items()) > len(CATALOGUE) // 2


def test_selection_by_kernel_name_and_topic():
    one = run(REFERENCE, cases=["mla_decode_paged/length_1"], **F64)
    assert [r.case for r in one.rows] == ["length_1"]
    topic = run(REFERENCE, kernels=["mla_decode_paged"], cases=["causal"], **F64)
    assert topic.rows and {r.topic for r in topic.rows} == {"causal"}
    with pytest.raises(ValueError, match="unknown cases"):
        run(REFERENCE, cases=["no_such_case"], **F64)
    with pytest.raises(ValueError, match="unknown kernels"):
        run(REFERENCE, kernels=["flash_attn"], **F64)


# ---- statuses ---------------------------------------------------------------------------------

def test_a_missing_kernel_is_unsupported_not_a_failure():
    # every merge case (a missing kernel's cases build nothing: cheap) beside three decode
    # cases the target runs; the statuses do not depend on how many decode cases run
    decode = ["length_1", "heads_3", "causal_s_q_2"]
    merge = [f"merge_attn_states/{c.name}" for c in cases_of(["merge_attn_states"])]
    report = run({"mla_decode_paged": ref.mla_decode_paged}, kernels=["mla_decode_paged",
                                                                     "merge_attn_states"],
                 cases=decode + merge, **F64)
    merge_rows = [r for r in report.rows if r.kernel == "merge_attn_states"]
    assert len(merge_rows) == len(merge) and {r.status for r in merge_rows} == {"unsupported"}
    assert "has no merge_attn_states" in merge_rows[0].detail
    assert [(r.case, r.status) for r in report.rows if r.kernel == "mla_decode_paged"] == [
        (name, "pass") for name in ("heads_3", "length_1", "causal_s_q_2")]
    assert report.passed


def test_an_adapter_refusing_inputs_is_unsupported_with_its_reason():
    def only_one_query(q, *args):
        if q.shape[1] != 1:
            raise Unsupported("s_q > 1: this kernel takes one query row per request")
        return ref.mla_decode_paged(q, *args)

    # one query row and several, causal and not, and a DeepSeek-V4 sink case: the statuses do
    # not depend on how many decode cases run
    cases = ["heads_3", "length_1", "causal_s_q_2", "causal_s_q_3", "non_causal_s_q_4",
             "sink_finite"]
    report = run({"mla_decode_paged": only_one_query}, kernels=["mla_decode_paged"],
                 cases=cases, **F64)
    assert sorted(r.case for r in report.rows) == sorted(cases)
    # DeepSeek-V4's sink cases: "unsupported" too, the adapter taking no attn_sink
    refused = [r for r in report.rows if r.status == "unsupported" and r.topic not in V4_TOPICS]
    assert refused and all("one query row" in r.detail for r in refused)
    assert {r.case for r in refused} == {"causal_s_q_2", "causal_s_q_3", "non_causal_s_q_4"}
    assert {r.case for r in report.rows if r.status == "pass"} == {"heads_3", "length_1"}
    assert report.passed


def test_a_cuda_error_left_pending_is_the_error_of_the_case_that_left_it(monkeypatch):
    """A kernel whose launch the driver rejected returns normally; the runner's check after
    each case on CUDA (a synchronize and a tiny launch) raises it within that case. Here the
    tiny launch is made to fail after the ``heads_1`` case only; on the CPU nothing is
    checked."""
    from mla.conformance import runner

    armed = {"on": False}

    def decode(q, *args):
        armed["on"] = q.shape[2] == 1
        return ref.mla_decode_paged(q, *args)

    def pending(device):
        if armed["on"]:
            armed["on"] = False
            raise RuntimeError("the kernel returned, but left a CUDA error pending")

    monkeypatch.setattr(runner, "surface_pending_error", pending)
    report = run({"mla_decode_paged": decode}, kernels=["mla_decode_paged"],
                 cases=["heads_1", "causal_s_q_2", "empty_request"], **F64)
    assert len(report.rows) == 3
    bad = _failing(report)
    assert [(r.case, r.status) for r in bad] == [("heads_1", "error")]
    assert "left a CUDA error pending" in bad[0].detail


def test_no_pending_error_check_on_the_cpu():
    from mla.conformance.runner import surface_pending_error
    assert surface_pending_error("cpu") is None


def test_a_crash_is_an_error_row_and_the_run_goes_on():
    def crashes(q, *args):
        if q.shape[2] == 1:
            raise RuntimeError("illegal head count")
        return ref.mla_decode_paged(q, *args)

    report = run({"mla_decode_paged": crashes}, kernels=["mla_decode_paged"], **F64)
    bad = _failing(report)
    assert [r.case for r in bad] == ["heads_1", "heads_1_single_keys"], report.to_text()
    assert all(r.status == "error" and "RuntimeError: illegal head count" in r.detail
               for r in bad)
    assert not report.passed and sum(r.status == "pass" for r in report.rows) > 20


def test_a_wrong_shape_or_dtype_fails_with_what_was_expected():
    def lse_transposed(*args):
        out, lse = ref.mla_decode_paged(*args)
        return out, lse.transpose(1, 2)

    report = run({"mla_decode_paged": lse_transposed}, cases=["causal_s_q_3"], **F64)
    (row,) = report.rows
    assert row.status == "fail" and math.isinf(row.errors["lse"])
    assert "lse: shape" in row.detail and "expected" in row.detail


def test_bad_targets_and_arguments_are_refused():
    with pytest.raises(ValueError, match="does not know"):
        run({"mla_decode": ref.mla_decode_paged}, **F64)
    with pytest.raises(TypeError, match="callable"):
        run({"mla_decode_paged": 3}, **F64)
    with pytest.raises(TypeError, match="dtype"):
        run(REFERENCE, device="cpu", dtype=torch.int32)


def test_nothing_run_is_not_a_pass():
    report = run({}, kernels=["mla_decode_paged"], **F64)
    assert {r.status for r in report.rows} == {"unsupported"} and not report.passed


# ---- the report -------------------------------------------------------------------------------

def test_report_json_and_markdown_hold_every_row():
    # a few decode cases (one of them empty) on the twin whose lse is in base 2: failing rows
    # with the convention named, and a passing one
    report = run({**REFERENCE, "mla_decode_paged": _log2_lse}, kernels=["mla_decode_paged"],
                 cases=["length_1", "causal_s_q_2", "empty_request", "all_empty"], **F64)
    assert len(report.rows) == 4 and {r.status for r in report.rows} >= {"pass", "fail"}
    data = json.loads(report.to_json())
    assert data["passed"] is False and len(data["rows"]) == len(report.rows)
    for row in data["rows"]:
        assert {"kernel", "case", "status", "errors", "limits", "detail"} <= set(row)
    assert data["environment"]["torch"] == torch.__version__
    md = report.to_markdown()
    assert md.count("\n| mla_decode_paged |") == len(report.rows)
    assert "base 2" in md


# ---- the decode family bites ------------------------------------------------------------------

SETTING = Setting(torch.device("cpu"), torch.float64, 0, True)  # what run(**F64) uses


@functools.cache
def _decode_trials():
    """Every decode case's trial (its inputs, the reference's outputs), its alternatives
    computed once: built once a process for all the twins, as ``run`` would build each for
    each twin (the twins write nothing they are given)."""
    trials = []
    for c in cases_of(["mla_decode_paged"]):
        t = c.build(SETTING)
        alts = {why: functools.cache(make) for why, make in t.alternatives.items()}
        trials.append((c, dataclasses.replace(t, alternatives=alts)))
    return tuple(trials)


def _decode_report(twin):
    """The decode cases run on ``twin``, as ``run({**REFERENCE, "mla_decode_paged": twin},
    kernels=["mla_decode_paged"], **F64)`` runs them, on the trials built once."""
    rows = [run_case(twin, dataclasses.replace(c, build=lambda s, t=t: t), SETTING)
            for c, t in _decode_trials()]
    return Report(twin.__name__, "cpu", "float64", rows)


def _log2_lse(*args):
    out, lse = ref.mla_decode_paged(*args)
    return out, lse * (1 / math.log(2))


def _empty_minus_inf(*args):
    out, lse = ref.mla_decode_paged(*args)
    return out, torch.where(torch.isposinf(lse), float("-inf"), lse)


def _scale_ignored(q, kv, bt, lens, scale, causal, dv):
    return ref.mla_decode_paged(q, kv, bt, lens, q.shape[-1] ** -0.5, causal, dv)


def _causal_one_short(q, kv, bt, lens, scale, causal, dv):
    return paged_mqa(q, kv, bt, [n - 1 for n in lens.tolist()], lens.tolist(), scale, causal,
                     dv)


def _causal_ignored(q, kv, bt, lens, scale, causal, dv):
    return ref.mla_decode_paged(q, kv, bt, lens, scale, False, dv)


def _half_heads_unwritten(*args):
    out, lse = ref.mla_decode_paged(*args)
    out = out.clone()
    out[:, :, out.shape[2] // 2:] = float("nan")
    return out, lse


def _reads_one_past(q, kv, bt, lens, scale, causal, dv):
    return paged_mqa(q, kv, bt, lens.tolist(), [n + 1 if n else 0 for n in lens.tolist()],
                     scale, causal, dv)


# broken twin -> (the topics that must fail: all their cases and nothing else, the words the
# failing rows' convention line must hold)
DECODE_TWINS = {
    _empty_minus_inf: ({"empty"}, "-inf for a query that sees no key"),
    _scale_ignored: ({"scale"}, "1/sqrt(576) used instead"),
    _causal_one_short: ({"causal", "empty"}, "off by one"),
    _causal_ignored: ({"causal", "empty"}, "causal mask ignored"),
    _log2_lse: (None, "base 2"),
    _half_heads_unwritten: (None, "NaN where the reference has values"),
    _reads_one_past: (None, "read from an unused cache row"),
}


@pytest.mark.parametrize("twin", list(DECODE_TWINS), ids=lambda f: f.__name__.strip("_"))
def test_decode_broken_twin_fails_exactly_its_cases_and_is_named(twin):
    """The twin fails exactly the decode cases that pin its convention, and names it. The
    first twin runs the whole catalogue (the reference for every other kernel), to show that
    no other kernel's cases reach it; the rest run the decode cases only."""
    topics, words = DECODE_TWINS[twin]
    whole = twin is next(iter(DECODE_TWINS))
    report = (run({**REFERENCE, "mla_decode_paged": twin}, **F64) if whole
              else _decode_report(twin))
    failing = _failing(report)
    if whole:
        assert {r.kernel for r in report.rows} == set(KERNELS)
    assert failing and {r.kernel for r in failing} == {"mla_decode_paged"}, report.to_text()
    # the twins take no attn_sink: the sink cases are "unsupported" for them
    decode = [r for r in report.rows if r.kernel == "mla_decode_paged"
              and r.status != "unsupported"]
    if topics is None:  # a fault every decode case shows (lengths 0 aside)
        assert {r.case for r in failing} >= {r.case for r in decode if r.topic != "empty"}
    else:
        assert {r.topic for r in failing} == topics
        assert all(r.status == "fail" for r in decode if r.topic in topics - {"empty"})
    named = [r for r in failing if words in r.convention]
    assert len(named) >= len(failing) // 2, [(r.case, r.convention) for r in failing]


def test_a_one_percent_output_error_fails_every_dtype_budget():
    def one_percent(*args):
        out, lse = ref.mla_decode_paged(*args)
        return out * 1.01, lse

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        ref_in_dtype = run({"mla_decode_paged": one_percent}, cases=["length_page_edges"],
                           device="cpu", dtype=dtype)
        assert ref_in_dtype.rows[0].status == "fail", (dtype, ref_in_dtype.to_text())


def test_the_readme_five_lines_run(monkeypatch):
    """The README's "check your kernel" block, with the reference as ``my_kernels.my_decode``."""
    import re
    import sys
    import types
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Checking your kernel (conformance)", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len([line for line in code.splitlines() if line.strip()]) == 5
    monkeypatch.setitem(sys.modules, "my_kernels",
                        types.SimpleNamespace(my_decode=ref.mla_decode_paged))
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    report = scope["report"]
    assert report.passed and {r.kernel for r in report.rows if r.status == "pass"} == {
        "mla_decode_paged"}


def test_invalid_inputs_must_be_refused():
    """``topk_length`` past topk: a ValueError passes, a result fails, another crash errs."""
    def clamps(q, kv, idx, scale, fp8, topk_length, dv):
        return ref.sparse_mla_decode(q, kv, idx, scale, fp8,
                                     None if topk_length is None
                                     else topk_length.clamp(max=idx.shape[-1]), dv)

    def crashes(*args):
        raise RuntimeError("illegal memory access")

    rows = {}
    for name, fn in (("reference", ref.sparse_mla_decode), ("clamps", clamps),
                     ("crashes", crashes)):
        (rows[name],) = run({"sparse_mla_decode": fn}, cases=["topk_length_past_topk"],
                            kernels=["sparse_mla_decode"], **F64).rows
    assert rows["reference"].status == "pass" and "refused: ValueError" in rows["reference"].detail
    assert rows["clamps"].status == "fail" and "reads past" in rows["clamps"].detail
    assert rows["crashes"].status == "error"


@needs_interpreter
def test_mla_fast_passes_the_whole_catalogue_from_the_command(capsys):
    """``mla conform --target mla.fast`` on the CPU, Triton's interpreter, float32: every
    case passes but those of kernels or DeepSeek-V4 keywords mla.fast lacks (unsupported);
    exit status 0. DeepSeek-V4's layer kernels (``mla.fast.v4`` through
    ``adapters.fast_v4``) are left to ``test_conformance_v4_fast.py``, which runs their cases
    and pins the one that fails."""
    import mla.fast
    from mla.check.catalogue import not_in_fast
    from mla.cli import main
    from mla.conformance import kernels_of

    v4 = ("v4_compress", "v4_indexer_q", "v4_scope_indices", "v4_output", "v4_indexer_topk")
    kernels = [k for k in KERNELS if k not in v4]
    assert main(["conform", "--target", "mla.fast", "--device", "cpu", "--dtype",
                 "float32", "--kernels", *kernels]) == 0
    table = capsys.readouterr().out
    has = kernels_of(mla.fast)
    lacking = sum(c.kernel not in has or c.topic in not_in_fast(c.kernel)
                  for c in CATALOGUE.values() if c.kernel in kernels)
    assert "cp_lse_ag_out_rs" in has  # the fast DCP correction takes every DCP case
    ran = sum(c.kernel in kernels for c in CATALOGUE.values())
    assert f"{ran - lacking} pass, 0 fail, {lacking} unsupported, 0 error" in table
