"""``mla.conformance.fuzz`` finds broken kernels, shrinks what it finds and keeps it.

Broken twins of the reference (each with one convention changed, as in
``test_conformance_merge.py`` and ``test_conformance_sparse.py``) are found within a few dozen
examples and shrunk to a spec of one request, one head; the diagnosis names the convention;
the snippet rebuilds the inputs and reproduces the failure; the example database replays the
failure first on the next run. The reference passes; inputs an adapter refuses are skipped.
Under Triton's interpreter, a short fuzz of each of ``mla.fast``'s fuzzed kernels passes, and
each of the attention kernels' 1% twins (the GPU check's: one output scaled by 1.01) is found
and shrunk (the indexer's twins: ``test_fuzz_indexer.py``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _blind_spot_twins import dcp_nan_lost_beside_empty, merge_times_zero
from _interpreter import needs_interpreter

import mla.reference as ref
from mla.conformance import KERNELS, Unsupported
from mla.conformance.cases.common import DEFAULT_SCALE
from mla.conformance.diagnose import LOG2E
from mla.conformance.fuzz import FUZZED, failure_mode, fuzz

REFERENCE = {k: getattr(ref, k) for k in KERNELS}
INF = float("inf")


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "fuzz-db")


# ---- broken twins of the reference ----------------------------------------------------------

def decode_scale_ignored(q, kv, table, lens, scale, causal=False, dv=512, **kw):
    return ref.mla_decode_paged(q, kv, table, lens, q.shape[-1] ** -0.5, causal, dv, **kw)


def sparse_minus_one_reads_slot_0(q, kv, idx, *rest, **kw):
    return ref.sparse_mla_decode(q, kv, torch.where(idx == -1, 0, idx), *rest, **kw)


def prefill_lse_log2(*args, **kw):
    out, max_logits, lse = ref.sparse_mla_prefill(*args, **kw)
    return out, max_logits, lse * LOG2E


def merge_reads_empty_side(o_p, lse_p, o_s, lse_s):
    """An empty side's weight 0 times its output (0 · NaN = NaN)."""
    out, lse = ref.merge_attn_states(o_p, lse_p, o_s, lse_s)
    for o, side in ((o_p, lse_p), (o_s, lse_s)):
        one_empty = torch.isinf(side) & ~(torch.isinf(lse_p) & torch.isinf(lse_s))
        out = out + 0 * torch.where(one_empty.transpose(0, 1)[..., None], o, 0.0)
    return out, lse


def decode_always_causal(q, kv, table, lens, scale, causal=False, dv=512, **kw):
    """The causal mask whatever ``causal`` says (the same as the reference for ``s_q = 1``
    or ``causal=True``: only ``s_q > 1`` without causal shows it)."""
    return ref.mla_decode_paged(q, kv, table, lens, scale, True, dv, **kw)


TWINS = [
    # kernel, twin, examples, what the shrunk spec has, the convention named (a prefix)
    ("mla_decode_paged", decode_scale_ignored, 40,
     lambda s: s.scale != DEFAULT_SCALE and len(s.lens) == 1 and s.heads == 1 and s.s_q == 1,
     "softmax scale 1/sqrt(576) used instead of the scale passed"),
    ("mla_decode_paged", decode_always_causal, 40,
     lambda s: s.s_q == 2 and not s.causal and len(s.lens) == 1 and s.heads == 1,
     "causal mask applied although causal=False"),
    ("sparse_mla_decode", sparse_minus_one_reads_slot_0, 40,
     lambda s: s.batch == 1 and s.s_q == 1 and s.heads == 1 and s.extra is None,
     "-1 entries read slot 0"),
    ("sparse_mla_prefill", prefill_lse_log2, 20,
     lambda s: s.s_q == 1 and s.heads == 1 and not s.sentinels, "lse in base 2"),
    ("merge_attn_states", merge_reads_empty_side, 40,
     lambda s: s.tokens == 1 and s.heads == 1, "the empty side's output is read"),
    ("merge_attn_states", merge_times_zero, 40,
     lambda s: s.tokens == 1 and s.heads == 1 and s.gap == 2000.0,
     "a side whose weight underflowed to 0 multiplied by its output"),
    ("cp_lse_ag_out_rs", dcp_nan_lost_beside_empty, 60,
     lambda s: s.nan and s.tokens <= 2, "a NaN lse read as 'no keys'"),
]


@pytest.mark.parametrize("kernel, twin, examples, small, convention", TWINS,
                         ids=[t[1].__name__ for t in TWINS])
def test_the_fuzz_finds_a_twin_and_shrinks_it(kernel, twin, examples, small, convention, db):
    report = fuzz({kernel: twin}, kernel, examples=examples, database=db, dtype=torch.float64)
    assert not report.passed
    (failure,) = report.failures
    assert failure.kernel == kernel and failure.status == "fail"
    assert small(failure.spec), failure.spec
    assert failure.convention.startswith(convention), (failure.convention, failure.detail)
    assert "shrunk to" in report.to_text()
    md, js = report.to_markdown(), report.to_json()
    assert failure.snippet.splitlines()[0] in md and '"passed": false' in js
    # the snippet rebuilds the inputs, calls the kernel and fails as the search did
    with pytest.raises(AssertionError):
        exec(compile(failure.snippet, "<snippet>", "exec"), {"KERNEL": twin})
    # the reference passes on the same snippet
    exec(compile(failure.snippet, "<snippet>", "exec"), {"KERNEL": REFERENCE[kernel]})


def test_the_reference_passes(db):
    report = fuzz(REFERENCE, None, examples=12, database=db,
                  dtype=(torch.float32, torch.bfloat16, torch.float64))
    assert report.passed, report.to_text()
    assert [r.kernel for r in report.runs] == list(FUZZED)
    assert all(r.examples >= 12 and not r.unsupported for r in report.runs)


def test_a_named_target_and_a_time_bound(db):
    report = fuzz("reference", "merge_attn_states", seconds=1.0, database=db)
    assert report.passed and report.runs[0].examples > 0
    assert report.runs[0].seconds < 10


def test_inputs_the_adapter_refuses_are_skipped(db):
    def page_64_only(q, kv, *args, **kw):
        if kv.shape[1] != 64:
            raise Unsupported("page 64 only")
        return ref.mla_decode_paged(q, kv, *args, **kw)

    report = fuzz({"mla_decode_paged": page_64_only}, "mla_decode_paged", examples=30,
                  database=db, dtype=torch.float64)
    (run,) = report.runs
    assert report.passed, report.to_text()
    assert run.unsupported > 0 and run.examples > run.unsupported


def test_the_database_replays_a_failure_first(db, tmp_path):
    first = fuzz({"merge_attn_states": merge_times_zero}, "merge_attn_states", examples=40,
                 database=db, dtype=torch.float64)
    (failure,) = first.failures
    assert any(p.is_file() for p in Path(db).rglob("*")), "nothing kept in the database"
    shapes = []

    def recording(o_p, *args):
        shapes.append(tuple(o_p.shape))
        return merge_times_zero(o_p, *args)

    # one example, another seed: only the failure replayed from the database can fail
    again = fuzz({"merge_attn_states": recording}, "merge_attn_states", examples=1, seed=7,
                 database=db, dtype=torch.float64)
    spec = failure.spec
    assert shapes[0] == (spec.tokens, spec.heads, spec.d)
    assert again.failures[0].spec == spec
    fresh = fuzz({"merge_attn_states": merge_times_zero}, "merge_attn_states", examples=1,
                 seed=7, database=str(tmp_path / "empty-db"), dtype=torch.float64)
    assert fresh.passed, fresh.to_text()  # the same budget without it finds nothing


def test_a_kernel_without_a_strategy_is_refused():
    with pytest.raises(ValueError, match="no fuzz strategy"):
        fuzz(REFERENCE, "gather_cache", examples=1)


@needs_interpreter
def test_mla_fast_merge_passes_and_its_one_percent_twin_is_found(db):
    import mla.fast as fast

    def off(*args):
        out, lse = fast.merge_attn_states(*args)
        return out * 1.01, lse

    report = fuzz("mla.fast", "merge_attn_states", examples=8, database=db)
    assert report.passed, report.to_text()
    twin = fuzz({"merge_attn_states": off}, "merge_attn_states", examples=10, database=db)
    (failure,) = twin.failures
    assert failure.spec.tokens <= 1 and failure.errors["out"] > 5e-3
    assert not math.isnan(failure.errors["out"])


# ---- mla.fast under the interpreter: it passes, and each of its 1% twins is found --------------

# the attention kernels' outputs (the indexer's twins: test_fuzz_indexer.py)
ATTENTION = ("mla_decode_paged", "sparse_mla_decode", "sparse_mla_prefill", "merge_attn_states",
             "cp_lse_ag_out_rs")
FAST_TWINS = [(kernel, label) for kernel in ATTENTION
              for label in ("out", "lse", "max_logits")
              if not (kernel == "cp_lse_ag_out_rs" and label != "out")
              and not (label == "max_logits" and kernel != "sparse_mla_prefill")]


def _one_percent(f, kernel: str, label: str):  # noqa: ANN001, ANN202
    """``f`` with one of its outputs (``label``) scaled by 1.01, as the GPU check's twins."""
    names = {"sparse_mla_prefill": ("out", "max_logits", "lse")}.get(kernel, ("out", "lse"))

    def g(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        res = f(*args, **kwargs)
        if not isinstance(res, tuple):
            return res * 1.01
        res = list(res)
        res[names.index(label)] = res[names.index(label)] * 1.01
        return tuple(res)
    return g


@needs_interpreter
@pytest.mark.parametrize("kernel", FUZZED)
def test_the_fuzz_passes_mla_fast(kernel, db):
    report = fuzz("mla.fast", kernel, examples=6, database=db, seed=1)
    assert report.passed, report.to_text()


@needs_interpreter
@pytest.mark.parametrize("kernel, label", FAST_TWINS, ids=[f"{k}-{v}" for k, v in FAST_TWINS])
def test_the_fuzz_finds_each_one_percent_twin_of_mla_fast(kernel, label, db):
    import mla.fast as fast
    twin = _one_percent(getattr(fast, kernel), kernel, label)
    report = fuzz({kernel: twin}, kernel, examples=10, database=db, seed=1)
    (failure,) = report.failures
    assert failure.errors[label] > failure.limits[label], failure.errors
    assert getattr(failure.spec, "heads", 1) <= 2  # shrunk


def merge_two_bugs(o_p, lse_p, o_s, lse_s):
    """Reads an empty side (NaN leaks) and returns its lse in base 2: two failure modes."""
    out, lse = merge_reads_empty_side(o_p, lse_p, o_s, lse_s)
    return out, lse * LOG2E


def test_keep_going_reports_one_shrunk_failure_per_mode(db):
    first = fuzz({"merge_attn_states": merge_two_bugs}, "merge_attn_states", examples=60,
                 database=db, dtype=torch.float64)
    assert len(first.failures) == 1  # the default stops at the first
    report = fuzz({"merge_attn_states": merge_two_bugs}, "merge_attn_states", examples=60,
                  database=db, dtype=torch.float64, keep_going=True)
    modes = [failure_mode(f.status, {"convention": f.convention, "errors": f.errors,
                                     "limits": f.limits}) for f in report.failures]
    assert len(report.failures) == 2 and len(set(modes)) == 2, report.to_text()
    (run,) = report.runs
    assert run.failure is report.failures[0] and run.repeats > 0
    assert "2 failure modes" in report.summary() and '"failures": [' in report.to_json()
    # each is shrunk: one token, one head
    assert all(f.spec.tokens == 1 and f.spec.heads == 1 for f in report.failures), \
        report.to_text()
