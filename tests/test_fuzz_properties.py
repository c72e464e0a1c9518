"""``mla.conformance.properties``: the decodes' metamorphic properties, checked by the fuzzer.

The reference keeps batch invariance, page placement and batch permutation bit for bit, sinks
included (the fuzz found that ``torch.sigmoid`` on the CPU rounds an element of a tensor's
scalar tail differently from one in its vectorised body, so that a float32 sink factor depended
on the batch's size: ``mla.reference.sink`` computes it over whole vectors now, and a test here
holds it). Twins of the reference that break one property each are found and shrunk, and
their snippets reproduce the failure.
"""

from __future__ import annotations

import pytest
import torch

import mla.reference as ref
from mla.conformance import Unsupported, run
from mla.conformance.cases.decode import DecodeSpec, decode_trial
from mla.conformance.cases.sparse_decode import SparseDecodeSpec, sparse_decode_trial
from mla.conformance.catalogue import Setting
from mla.conformance.fuzz import fuzz
from mla.conformance.properties import PROPERTIES, check, properties_of, ulps

DECODES = ("mla_decode_paged", "sparse_mla_decode")
CPU32 = Setting(torch.device("cpu"), torch.float32, 3, True)


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "fuzz-db")


def without_sink(kernel):
    """The reference, refusing a sink (``Unsupported``: those examples are skipped)."""
    def fn(*args, attn_sink=None, **kw):
        if attn_sink is not None:
            raise Unsupported("no attn_sink")
        return getattr(ref, kernel)(*args, **kw)
    return fn


# ---- twins, each breaking one property --------------------------------------------------------

def decode_batch_dependent(q, *args, **kw):
    out, lse = ref.mla_decode_paged(q, *args, **kw)
    return out + 1e-6 * q.shape[0], lse


def decode_page_dependent(q, kv, table, *args, **kw):
    out, lse = ref.mla_decode_paged(q, kv, table, *args, **kw)
    return out + 1e-6 * table[:, :1, None, None].to(out.dtype), lse


def decode_mixes_rows(q, *args, **kw):
    out, lse = ref.mla_decode_paged(q, *args, **kw)
    return out + 1e-3 * out[:1], lse


def sparse_slot_dependent(q, kv, idx, *args, **kw):
    out, lse = ref.sparse_mla_decode(q, kv, idx, *args, **kw)
    return out + 1e-6 * idx[:, :1, :1, None].clamp_min(0).to(out.dtype), lse


# ---- the properties themselves --------------------------------------------------------------

@pytest.mark.parametrize("prop", PROPERTIES)
def test_the_reference_keeps_each_property(prop):
    specs = [("mla_decode_paged", decode_trial,
              DecodeSpec((1, 65, 0, 130), heads=3, s_q=2, causal=True, page=16)),
             ("mla_decode_paged", decode_trial, DecodeSpec((5, 7), unused_entry="-1")),
             ("sparse_mla_decode", sparse_decode_trial,
              SparseDecodeSpec(batch=3, s_q=2, heads=3, minus_one=0.3, topk_length=(64, 3, 0))),
             ("sparse_mla_decode", sparse_decode_trial,
              SparseDecodeSpec(batch=2, heads=3, fp8=True)),
             ("sparse_mla_decode", sparse_decode_trial,
              SparseDecodeSpec(batch=2, heads=3, d=512, model1=True,
                               extra=SparseDecodeSpec(page=16, slots=100, topk=16)))]
    for kernel, build, spec in specs:
        result = check(prop, kernel, getattr(ref, kernel), build(CPU32, spec, 0), spec, 3)
        assert result.passed and result.ulps == 0 and result.calls >= 2, (spec, result)


def test_ulps_counts_floats_between():
    a = torch.tensor([1.0, -0.0, float("nan"), 2.0, -1.0])
    b = torch.tensor([1.0, 0.0, float("nan"), float("nan"), torch.nextafter(
        torch.tensor(-1.0), torch.tensor(0.0)).item()])
    assert ulps(a, b).tolist() == [0.0, 0.0, 0.0, float("inf"), 1.0]
    assert properties_of("all") == PROPERTIES and properties_of(None) == ()
    with pytest.raises(ValueError, match="unknown properties"):
        properties_of(["batch_variance"])


# ---- through the fuzzer ---------------------------------------------------------------------

def test_the_reference_passes_the_fuzzed_properties_without_a_sink(db):
    target = {k: without_sink(k) for k in DECODES}
    report = fuzz(target, None, examples=25, database=db, properties="all",
                  dtype=(torch.float32, torch.bfloat16))
    assert report.passed, report.to_text()
    assert [r.kernel for r in report.runs] == list(DECODES)


def test_with_a_sink_the_reference_is_batch_invariant_in_float32(db):
    """The sink's σ(lse − sink) over whole vectors: the 60 examples that found the CPU
    sigmoid's scalar tail (2 ulps, a single request with a finite sink) now pass."""
    report = fuzz(ref, "sparse_mla_decode", examples=60, database=db,
                  properties=("batch_invariance",), budgets=False)
    assert report.passed, report.to_text()


def test_the_sink_factor_does_not_depend_on_the_tensor_length():
    from mla.reference.sink import apply_attn_sink
    g = torch.Generator().manual_seed(0)
    lse = torch.randn(67, 3, generator=g) * 5
    out = torch.randn(67, 3, 8, generator=g)
    sink = torch.randn(3, generator=g)
    whole = apply_attn_sink(out, lse, sink)
    for n in (1, 2, 7, 16, 33, 66):
        assert torch.equal(apply_attn_sink(out[:n], lse[:n], sink), whole[:n])


TWINS = [
    # twin, property, what the shrunk spec has, the convention (a prefix)
    (decode_batch_dependent, "batch_invariance",
     lambda s: len(s.lens) == 1 and s.heads == 1, "not batch invariant"),
    (decode_page_dependent, "page_placement",
     lambda s: len(s.lens) == 1 and s.heads == 1, "not page-placement invariant"),
    (decode_mixes_rows, "batch_permutation",
     lambda s: len(s.lens) == 2 and s.heads == 1, "not batch-permutation invariant"),
]


@pytest.mark.parametrize("twin, prop, small, convention", TWINS,
                         ids=[t[0].__name__ for t in TWINS])
def test_the_fuzz_finds_a_twin_and_shrinks_it(twin, prop, small, convention, db):
    report = fuzz({"mla_decode_paged": twin}, "mla_decode_paged", examples=30, database=db,
                  properties=(prop,), budgets=False, dtype=torch.float64)
    (failure,) = report.failures
    assert failure.status == "fail" and failure.property_name == prop
    assert small(failure.spec), failure.spec
    assert failure.convention.startswith(convention), failure.convention
    assert prop in report.to_markdown() and '"property": "' + prop in report.to_json()
    with pytest.raises(AssertionError):
        exec(compile(failure.snippet, "<snippet>", "exec"), {"KERNEL": twin})
    exec(compile(failure.snippet, "<snippet>", "exec"), {"KERNEL": ref.mla_decode_paged})


def test_a_sparse_twin_reading_slot_numbers_breaks_page_placement(db):
    report = fuzz({"sparse_mla_decode": sparse_slot_dependent}, "sparse_mla_decode",
                  examples=30, database=db, properties="all", budgets=False,
                  dtype=torch.float64)
    (failure,) = report.failures
    assert failure.property_name == "page_placement", failure.convention
    assert failure.spec.batch == 1 and failure.spec.heads == 1


def test_properties_beside_the_budgets(db):
    """A budget failure is still found with the properties on; no property for the others."""
    def scale_ignored(q, kv, table, lens, scale, *args, **kw):
        return ref.mla_decode_paged(q, kv, table, lens, q.shape[-1] ** -0.5, *args, **kw)

    report = fuzz({"mla_decode_paged": scale_ignored, "merge_attn_states":
                   ref.merge_attn_states}, None, examples=20, database=db, properties="all",
                  dtype=torch.float64)
    (failure,) = report.failures
    assert failure.property_name == "" and failure.convention.startswith("softmax scale")
    with pytest.raises(ValueError, match="properties alone"):
        fuzz(ref, "mla_decode_paged", examples=1, budgets=False)


# ---- the properties on the catalogue's cases --------------------------------------------------

def test_the_catalogue_holds_the_decodes_to_the_properties_asked():
    """``run(..., properties=...)``: a twin within every budget whose bits follow the batch's
    size passes the catalogue, and fails its batches with the property's convention once
    held to batch invariance (``length_1``: three requests of one key; ``length_page_edges``:
    six around a page's edges)."""
    def batch_dependent(q, *args, **kw):
        out, lse = ref.mla_decode_paged(q, *args, **kw)
        return out * (1 + 2.0 ** -44 * q.shape[0]), lse

    cases = ["length_page_edges", "length_1"]
    kw = dict(kernels=["mla_decode_paged"], cases=cases, device="cpu", dtype=torch.float64)
    assert run({"mla_decode_paged": batch_dependent}, **kw).passed
    held = run({"mla_decode_paged": batch_dependent}, properties="batch_invariance", **kw)
    for row in held.rows:
        assert row.status == "fail", row
        assert row.convention.startswith("not batch invariant"), row.convention
        assert row.errors["batch_invariance"] > 0 and row.limits["batch_invariance"] == 0
        assert "ulps" in held.to_markdown()


def test_the_reference_keeps_every_property_on_the_catalogue():
    report = run({k: getattr(ref, k) for k in DECODES}, kernels=list(DECODES), device="cpu",
                 dtype=torch.float64, properties="all")
    assert report.passed, report.to_text()
    assert sum(r.status == "pass" for r in report.rows) >= 80
