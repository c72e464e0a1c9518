"""The sparse case families of ``mla.conformance`` (``sparse_mla_decode``,
``sparse_mla_prefill``, ``convert_req_index_to_global_index``) bite.

The float64 reference passes every case; a twin of the reference with one convention broken
fails every case of the topic that pins that convention, fails nothing outside the topics it
may touch, and the report names the convention where the catalogue knows it (no other
kernel's case calls these kernels: ``test_conformance.py``). All in float64 on the CPU; one
small run of ``mla.fast`` under Triton's interpreter.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch
from _interpreter import needs_interpreter

import mla.conformance.cases  # noqa: F401  (the families register on import)
import mla.reference as ref
from mla.conformance import Case, Row, Setting, Trial, cases_of, run, run_case
from mla.conformance.cases.deepseek_v4 import TOPICS as V4_TOPICS
from mla.conformance.cases.sparse_decode import once_each, unscaled_fp8
from mla.conformance.diagnose import LOG2E

SPARSE = ("sparse_mla_decode", "sparse_mla_prefill", "convert_req_index_to_global_index")
SETTING = Setting(torch.device("cpu"), torch.float64, 0, True)
INF = float("inf")


# ---- broken twins of the reference ----------------------------------------------------------

def _nan_last_head(out: torch.Tensor) -> torch.Tensor:
    out = out.clone()
    out[..., -1, :] = float("nan")
    return out


def _lonely_minus_inf(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isposinf(lse), -INF, lse)


def dec_scale_ignored(q, kv, idx, scale, fp8, tl=None, dv=512):
    return ref.sparse_mla_decode(q, kv, idx, q.shape[-1] ** -0.5, fp8, tl, dv)


def dec_lonely_minus_inf(*args):
    out, lse = ref.sparse_mla_decode(*args)
    return out, _lonely_minus_inf(lse)


def dec_minus_one_reads_slot_0(q, kv, idx, *rest):
    return ref.sparse_mla_decode(q, kv, torch.where(idx == -1, 0, idx), *rest)


def dec_topk_length_ignored(q, kv, idx, scale, fp8, tl=None, dv=512):
    return ref.sparse_mla_decode(q, kv, idx, scale, fp8, None, dv)


def dec_lse_log2(*args):
    out, lse = ref.sparse_mla_decode(*args)
    return out, lse * LOG2E


def dec_repeats_once(q, kv, idx, *rest):
    return ref.sparse_mla_decode(q, kv, once_each(idx), *rest)


def dec_last_head_nan(*args):
    out, lse = ref.sparse_mla_decode(*args)
    return _nan_last_head(out), lse


def dec_fp8_scales_ignored(q, kv, idx, scale, fp8, *rest):
    return ref.sparse_mla_decode(q, unscaled_fp8(kv) if fp8 else kv, idx, scale, fp8, *rest)


def pre_scale_ignored(q, kv, idx, scale, dv=512, tl=None):
    return ref.sparse_mla_prefill(q, kv, idx, q.shape[-1] ** -0.5, dv, tl)


def pre_lse_log2(*args):
    out, mx, lse = ref.sparse_mla_prefill(*args)
    return out, mx, lse * LOG2E


def pre_lse_and_max_log2(*args):
    out, mx, lse = ref.sparse_mla_prefill(*args)
    return out, mx * LOG2E, lse * LOG2E


def pre_lonely_minus_inf(*args):
    out, mx, lse = ref.sparse_mla_prefill(*args)
    return out, mx, _lonely_minus_inf(lse)


def pre_only_minus_one_dropped(q, kv, idx, *rest):
    """Decode's rule: -1 is dropped; any other index is clamped into the rows."""
    clamped = torch.where(idx == -1, idx, idx.clamp(0, kv.shape[0] - 1))
    return ref.sparse_mla_prefill(q, kv, clamped, *rest)


def pre_topk_length_ignored(q, kv, idx, scale, dv=512, tl=None):
    return ref.sparse_mla_prefill(q, kv, idx, scale, dv, None)


def pre_repeats_once(q, kv, idx, *rest):
    return ref.sparse_mla_prefill(q, kv, once_each(idx), *rest)


def pre_last_head_nan(*args):
    out, mx, lse = ref.sparse_mla_prefill(*args)
    return _nan_last_head(out), mx, lse


def conv_workspace_ignored(req, table, tok, bs, *workspace):
    return ref.convert_req_index_to_global_index(req, table, tok, bs)


def conv_negatives_wrap(req, table, tok, bs, *workspace):
    """Only -1 kept as -1: other negatives wrap into the row (Python's modulo)."""
    row = table.shape[1] * bs
    wrapped = torch.where(tok < -1, tok.long() % row, tok.long()).to(torch.int32)
    return ref.convert_req_index_to_global_index(req, table, wrapped, bs, *workspace)


def conv_past_row_clamped(req, table, tok, bs, *workspace):
    """A position past the block-table row read from its last block instead of -1."""
    t = tok.long()
    last = (table.shape[1] - 1) * bs
    clamped = torch.where(t // bs >= table.shape[1], last + t % bs, t).to(torch.int32)
    return ref.convert_req_index_to_global_index(req, table, clamped, bs, *workspace)


def conv_page_64(req, table, tok, bs, *workspace):
    return ref.convert_req_index_to_global_index(req, table, tok, 64, *workspace)


@dataclasses.dataclass(frozen=True)
class Twin:
    kernel: str
    fn: Callable
    must_fail: tuple[str, ...]  # topics or case names: every case of them fails
    may_fail: tuple[str, ...] | None  # the topics any failure lies in (None: any)
    names: str | None  # what each must-fail row's convention line says (None: no line)


TWINS = [
    Twin("sparse_mla_decode", dec_scale_ignored, ("scale",), ("scale",), "1/sqrt(576)"),
    Twin("sparse_mla_decode", dec_lonely_minus_inf, ("empty",), ("empty", "topk_length"),
         "-inf for a query that sees no key"),
    Twin("sparse_mla_decode", dec_minus_one_reads_slot_0, ("sentinels", "empty"),
         ("sentinels", "empty"), "-1 entries read slot 0"),
    Twin("sparse_mla_decode", dec_topk_length_ignored, ("topk_length",), ("topk_length",),
         None),
    Twin("sparse_mla_decode", dec_lse_log2, ("shapes", "s_q", "pages"), None, "base 2"),
    Twin("sparse_mla_decode", dec_repeats_once, ("repeats",), ("repeats",), "counted once"),
    Twin("sparse_mla_decode", dec_last_head_nan, ("shapes", "heads", "empty"), None,
         "holds NaN where the reference has values"),
    Twin("sparse_mla_decode", dec_fp8_scales_ignored,
         ("deepseek_v32_tp8", "deepseek_v32_tp1", "minus_one_fp8", "scale_yarn_v32"), None,
         "tile scales ignored"),
    Twin("sparse_mla_prefill", pre_scale_ignored, ("scale",), ("scale",), "1/sqrt(576)"),
    Twin("sparse_mla_prefill", pre_lse_log2, ("lse", "shapes"), None, "lse in base 2"),
    Twin("sparse_mla_prefill", pre_lse_and_max_log2, ("lse", "shapes"), None,
         "lse and max_logits in base 2"),
    Twin("sparse_mla_prefill", pre_lonely_minus_inf, ("empty",), ("empty", "topk_length"),
         "-inf for a query that sees no key"),
    Twin("sparse_mla_prefill", pre_only_minus_one_dropped, ("negative_indices", "past_s_kv"),
         ("sentinels", "empty"), "clamped to the nearest row"),
    Twin("sparse_mla_prefill", pre_topk_length_ignored, ("topk_length",), ("topk_length",),
         None),
    Twin("sparse_mla_prefill", pre_repeats_once, ("repeats",), ("repeats",), "counted once"),
    Twin("sparse_mla_prefill", pre_last_head_nan, ("shapes", "heads", "empty"), None,
         "holds NaN where the reference has values"),
    Twin("convert_req_index_to_global_index", conv_workspace_ignored, ("workspace",),
         ("workspace",), "workspace pair ignored"),
    Twin("convert_req_index_to_global_index", conv_negatives_wrap, ("sentinels",),
         ("sentinels",), None),
    Twin("convert_req_index_to_global_index", conv_past_row_clamped, ("lengths",),
         ("lengths", "empty"), None),
    Twin("convert_req_index_to_global_index", conv_page_64, ("pages",), None, None),
]


# ---- running twins on trials built once -----------------------------------------------------

@functools.cache
def _trials(kernel: str) -> tuple[tuple[Case, Trial], ...]:
    """Every case's trial, its alternatives computed once (the reference on changed inputs)."""
    trials = []
    for c in cases_of([kernel]):
        if c.topic in V4_TOPICS:  # DeepSeek-V4's: their twins are in test_conformance_v4.py
            continue
        t = c.build(SETTING)
        alts = {why: functools.cache(make) for why, make in t.alternatives.items()}
        trials.append((c, dataclasses.replace(t, alternatives=alts)))
    return tuple(trials)


def _run(kernel: str, fn: Callable) -> list[Row]:
    """Every case of ``kernel`` on ``fn``, reusing the trials (inputs, the reference's outputs
    and its alternatives) across twins: a twin never writes into its inputs."""
    return [run_case(fn, dataclasses.replace(c, build=lambda s, t=t: t), SETTING)
            for c, t in _trials(kernel)]


def test_reference_passes_every_sparse_case():
    report = run({k: getattr(ref, k) for k in SPARSE}, kernels=list(SPARSE), device="cpu",
                 dtype=torch.float64)
    assert report.passed, report.to_text()
    counts = {k: sum(r.kernel == k for r in report.rows) for k in SPARSE}
    assert all(counts.values()), counts
    assert {r.status for r in report.rows} == {"pass"}


@pytest.mark.parametrize("twin", TWINS, ids=lambda t: t.fn.__name__)
def test_broken_twin_fails_its_topic(twin: Twin):
    rows = _run(twin.kernel, twin.fn)
    must = {c.name for c in cases_of([twin.kernel], list(twin.must_fail))}
    assert must
    for r in rows:
        if r.case in must:
            assert r.status == "fail", (r.case, r.status, r.detail)
            if twin.names:
                assert twin.names in r.convention, (r.case, r.convention, r.detail)
            else:
                assert r.detail, r.case
        if twin.may_fail is not None and r.status != "pass":
            assert r.topic in twin.may_fail, (r.case, r.topic, r.status, r.detail)


@needs_interpreter
def test_fast_passes_a_few_sparse_cases_under_the_interpreter():
    import mla.fast as fast

    report = run(fast, kernels=list(SPARSE), device="cpu", dtype=torch.float32,
                 cases=["heads_5", "minus_one", "topk_length_zero", "prefill_workspace"])
    assert report.passed, report.to_text()
    assert len(report.rows) == 7
