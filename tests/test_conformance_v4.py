"""DeepSeek-V4's conformance cases (``mla.conformance.cases.deepseek_v4``: attention sinks, the
MODEL1 cache, the second KV scope, ``d_qk = 512``) bite.

The float64 reference passes every case; ``mla.fast``, which takes none of these inputs yet,
reads "unsupported" with its reason on each, never "fail" or "error"; a twin of the reference
with one DeepSeek-V4 convention broken fails every case that pins it, with the convention
named, and no case of another topic or kernel. All on the CPU, in float64 but for
``mla.fast`` (float32 under Triton's interpreter).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import pytest
import torch
from _interpreter import needs_interpreter

import mla.reference as ref
from mla.conformance import KERNELS, Case, Row, Setting, Trial, Unsupported, cases_of, run
from mla.conformance.cases.common import call_v4
from mla.conformance.cases.deepseek_v4 import TOPICS
from mla.conformance.cases.sparse_decode import model1_misread
from mla.conformance.runner import run_case

V4_KERNELS = ("sparse_mla_decode", "sparse_mla_prefill", "mla_decode_paged")
SETTING = Setting(torch.device("cpu"), torch.float64, 0, True)
EXTRA = ("extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length")


# ---- broken twins of the reference ----------------------------------------------------------

def _heads_last(kernel: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """lse laid out as out[..., 0] (and back): decode's lse is [B, N, s_q], prefill's [s_q, N]."""
    if kernel == "sparse_mla_prefill":
        return lambda lse: lse
    return lambda lse: lse.transpose(1, 2)


def sink_ignored(kernel: str) -> Callable:
    fn = getattr(ref, kernel)

    def twin(*args, attn_sink=None, **kw):
        return fn(*args, **kw)
    return twin


def sink_on_lse_too(kernel: str) -> Callable:
    fn, hl = getattr(ref, kernel), _heads_last(kernel)

    def twin(*args, attn_sink=None, **kw):
        *rest, lse = fn(*args, attn_sink=attn_sink, **kw)
        if attn_sink is not None:
            lse_h = hl(lse)
            lse = hl(torch.where(torch.isposinf(lse_h), lse_h,
                                 torch.logaddexp(lse_h, attn_sink.to(lse.dtype))))
        return (*rest, lse)
    return twin


def sink_inverted(kernel: str) -> Callable:
    fn, hl = getattr(ref, kernel), _heads_last(kernel)

    def twin(*args, attn_sink=None, **kw):
        out, *rest = fn(*args, **kw)
        if attn_sink is not None:
            lse = hl(rest[-1])
            factor = torch.where(torch.isposinf(lse), 1.0,
                                 torch.sigmoid(attn_sink.to(lse.dtype) - lse))
            out = out * factor[..., None]
        return (out, *rest)
    return twin


def dec_sink_per_scope(q, kv, idx, scale, fp8, tl=None, dv=512, *, attn_sink=None,
                       extra_k_cache=None, extra_indices_in_kvcache=None,
                       extra_topk_length=None):
    """Each scope attended with the sink, then the two merged by their lse."""
    if attn_sink is None or extra_k_cache is None:
        return ref.sparse_mla_decode(q, kv, idx, scale, fp8, tl, dv, attn_sink=attn_sink,
                                     extra_k_cache=extra_k_cache,
                                     extra_indices_in_kvcache=extra_indices_in_kvcache,
                                     extra_topk_length=extra_topk_length)
    parts = [ref.sparse_mla_decode(q, kv, idx, scale, fp8, tl, dv, attn_sink=attn_sink),
             ref.sparse_mla_decode(q, extra_k_cache, extra_indices_in_kvcache, scale, fp8,
                                   extra_topk_length, dv, attn_sink=attn_sink)]
    lses = [torch.where(torch.isposinf(lse), -math.inf, lse) for _, lse in parts]
    lse = torch.logaddexp(*lses)
    seen = torch.isfinite(lse)
    out = sum(torch.where(seen, torch.exp(part - lse), 0.0).transpose(1, 2)[..., None] * o
              for part, (o, _) in zip(lses, parts))
    return out.to(q.dtype), torch.where(seen, lse, math.inf)


def dec_second_scope_ignored(*args, attn_sink=None, **kw):
    return ref.sparse_mla_decode(*args, attn_sink=attn_sink)


def _model1_misreading(how: str) -> Callable:
    def twin(q, kv, idx, scale, fp8, tl=None, dv=512, **kw):
        if fp8 and kv.shape[-1] == 584:
            kv, fp8 = model1_misread(kv, how).to(q.dtype), False
            if kw.get("extra_k_cache") is not None:
                kw["extra_k_cache"] = model1_misread(kw["extra_k_cache"], how).to(q.dtype)
        return ref.sparse_mla_decode(q, kv, idx, scale, fp8, tl, dv, **kw)
    twin.__name__ = f"dec_model1_{how}"
    return twin


@dataclasses.dataclass(frozen=True)
class Twin:
    name: str
    kernel: str
    fn: Callable
    must_fail: tuple[str, ...]  # case names: each fails, with ``names`` in its convention line
    may_fail: tuple[str, ...]  # the topics any failure lies in
    names: str
    unnamed: tuple[str, ...] = ()  # must-fail cases another convention explains as well


# the sink cases where a finite or +inf sink reaches an output (-inf changes nothing)
SINK_BITES = {
    "sparse_mla_decode": ("sink_finite", "sink_plus_inf", "sink_lonely_queries",
                          "sink_per_head_fp8", "sink_d_qk_512", "sink_once_over_two_scopes",
                          "model1_v4_full"),
    "sparse_mla_prefill": ("sink_finite", "sink_plus_inf", "sink_lonely_queries",
                           "sink_per_head_d_qk_512"),
    "mla_decode_paged": ("sink_finite", "sink_plus_inf", "sink_empty_request",
                         "sink_per_head_causal"),
}
SECOND_SCOPE = ("second_scope", "second_scope_576", "second_scope_topk_length",
                "second_scope_one_empty", "second_scope_model1", "sink_once_over_two_scopes",
                "model1_v4_full")
MODEL1 = ("model1_v4_64_heads", "model1_128_heads_mtp", "model1_page_1", "model1_minus_one",
          "model1_lonely_queries", "model1_topk_length", "model1_v4_full",
          "second_scope_model1")

TWINS = [
    *(Twin(f"{k}_sink_ignored", k, sink_ignored(k), SINK_BITES[k], ("sink", "model1"),
           "attn_sink ignored") for k in V4_KERNELS),
    *(Twin(f"{k}_sink_on_lse_too", k, sink_on_lse_too(k), SINK_BITES[k], ("sink", "model1"),
           "applied to the lse too") for k in V4_KERNELS),
    # +inf: the inverted factor is 1, the same as no sink
    *(Twin(f"{k}_sink_inverted", k, sink_inverted(k),
           SINK_BITES[k] + ("sink_minus_inf",), ("sink", "model1"), "factor inverted",
           unnamed=("sink_plus_inf",)) for k in V4_KERNELS),
    Twin("sink_per_scope", "sparse_mla_decode", dec_sink_per_scope,
         ("sink_once_over_two_scopes", "model1_v4_full"), ("sink", "model1"), "per scope"),
    Twin("second_scope_ignored", "sparse_mla_decode", dec_second_scope_ignored, SECOND_SCOPE,
         ("second_scope", "sink", "model1"), "second KV scope ignored"),
    Twin("model1_scales_per_128", "sparse_mla_decode", _model1_misreading("tile128"), MODEL1,
         ("model1", "second_scope"), "one per 128 nope values"),
    Twin("model1_rope_e4m3", "sparse_mla_decode", _model1_misreading("rope_e4m3"), MODEL1,
         ("model1", "second_scope"), "rope read as e4m3"),
]


@functools.cache
def _trials(kernel: str) -> tuple[tuple[Case, Trial], ...]:
    """Every case's trial of ``kernel``, its alternatives computed once."""
    trials = []
    for c in cases_of([kernel]):
        t = c.build(SETTING)
        alts = {why: functools.cache(make) for why, make in t.alternatives.items()}
        trials.append((c, dataclasses.replace(t, alternatives=alts)))
    return tuple(trials)


def _run(kernel: str, fn: Callable) -> list[Row]:
    return [run_case(fn, dataclasses.replace(c, build=lambda s, t=t: t), SETTING)
            for c, t in _trials(kernel)]


# ---- the reference, mla.fast, the twins ---------------------------------------------------

def test_reference_passes_every_v4_case_in_float64():
    report = run({k: getattr(ref, k) for k in KERNELS}, device="cpu", dtype=torch.float64,
                 cases=list(TOPICS))
    assert report.passed, report.to_text()
    assert {(r.kernel, r.topic) for r in report.rows} >= {
        ("sparse_mla_decode", "sink"), ("sparse_mla_decode", "model1"),
        ("sparse_mla_decode", "second_scope"), ("sparse_mla_prefill", "sink"),
        ("mla_decode_paged", "sink")}
    assert {r.status for r in report.rows} == {"pass"}


@needs_interpreter
def test_mla_fast_passes_the_v4_cases_its_kernels_take():
    """mla.fast passes every DeepSeek-V4 case of the topics its kernels take (the sparse ones
    take all three); a case of a topic a kernel does not take yet reads "unsupported" with its
    reason, and is exactly what the GPU check leaves out (``not_in_fast``)."""
    import mla.fast as fast
    from mla.check.catalogue import not_in_fast

    assert not not_in_fast("sparse_mla_decode") and "sink" not in not_in_fast("sparse_mla_prefill")
    report = run(fast, device="cpu", dtype=torch.float32, cases=list(TOPICS))
    assert report.rows
    for r in report.rows:
        if r.topic in not_in_fast(r.kernel):
            assert r.status == "unsupported" and "takes no" in r.detail, (r.case, r.detail)
        else:
            assert r.status == "pass", (r.kernel, r.case, r.status, r.detail)


def test_call_v4_reads_keywords_and_model1_refusals():
    def plain(x):
        return x

    def any_keyword(x, **kw):
        return x

    def refuses_model1(x, **kw):
        raise ValueError("kv_cache is a MODEL1 cache, which this kernel does not read")

    with pytest.raises(Unsupported, match="takes no attn_sink"):
        call_v4(plain, 1, attn_sink=2)
    assert call_v4(any_keyword, 1, attn_sink=2) == 1
    with pytest.raises(Unsupported, match="refuses the MODEL1 cache"):
        call_v4(refuses_model1, 1, model1=True)
    with pytest.raises(ValueError, match="MODEL1"):  # no MODEL1 input: a real error
        call_v4(refuses_model1, 1)


@pytest.mark.parametrize("twin", TWINS, ids=lambda t: t.name)
def test_broken_twin_fails_its_cases_and_is_named(twin: Twin):
    rows = _run(twin.kernel, twin.fn)
    names = {c.name for c in cases_of([twin.kernel])}
    assert set(twin.must_fail) <= names
    for r in rows:
        if r.case in twin.must_fail:
            assert r.status == "fail", (r.case, r.status, r.detail)
            if r.case not in twin.unnamed:
                assert twin.names in r.convention, (r.case, r.convention, r.detail)
        elif r.status != "pass":
            assert r.topic in twin.may_fail and r.status == "fail", (
                r.case, r.topic, r.status, r.detail)
