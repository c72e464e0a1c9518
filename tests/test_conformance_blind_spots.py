"""Three corners where a broken kernel once passed the whole catalogue, and the cases that
close them (float64, the reference's twins, on the CPU).

- A merge that weighs a present side ``w · o`` even where ``w`` underflowed to 0: with that
  side's output inf or NaN the row is NaN, and the reference drops the side. Every merge case
  but ``underflowed_side_holds_*`` passes it (their present sides hold finite outputs); those
  fail and name it.
- A DCP correction that loses a NaN lse when every other rank is empty (a NaN-ignoring max
  finds no rank with keys and returns ``out 0, lse -inf``). The old NaN case has no empty rank
  beside its NaN and passes it; ``nan_lse_beside_empty_ranks`` fails it.
- A kernel that applies the causal mask when ``causal=False``: the decode's and
  ``attention_with_lse``'s non-causal cases fail it, named so.
"""

from __future__ import annotations

import pytest
import torch
from _blind_spot_twins import dcp_nan_lost_beside_empty, merge_times_zero

import mla.reference as ref
from mla.conformance import KERNELS, cases_of, run

F64 = dict(device="cpu", dtype=torch.float64)
REFERENCE = {k: getattr(ref, k) for k in KERNELS}
INF = float("inf")




def decode_always_causal(q, kv, table, lens, scale, causal=False, dv=512, **kw):
    return ref.mla_decode_paged(q, kv, table, lens, scale, True, dv, **kw)


def attention_always_causal(q, k, v, scale, causal=False, *pos):
    return ref.attention_with_lse(q, k, v, scale, True, *pos)


def _split(report):
    rows = {r.case: r for r in report.rows}
    bad = {c for c, r in rows.items() if r.status != "pass"}
    return rows, bad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_reference_and_the_new_cases(dtype):
    new = ["underflowed_side_holds_inf", "underflowed_side_holds_nan",
           "nan_lse_beside_empty_ranks"]
    report = run(REFERENCE, kernels=["merge_attn_states", "cp_lse_ag_out_rs"], cases=new,
                 device="cpu", dtype=dtype)
    assert report.passed and len(report.rows) == 3, report.to_text()


def test_a_merge_computing_x_times_0_fails_only_the_underflow_cases():
    report = run({"merge_attn_states": merge_times_zero}, kernels=["merge_attn_states"], **F64)
    rows, bad = _split(report)
    assert bad == {"underflowed_side_holds_inf", "underflowed_side_holds_nan"}, report.to_text()
    for name in bad:
        assert rows[name].convention.startswith(
            "a side whose weight underflowed to 0 multiplied by its output"), rows[name].detail
    assert len(rows) == sum(1 for _ in cases_of(["merge_attn_states"]))


def test_a_dcp_losing_a_nan_beside_empty_ranks_fails_the_new_case_only():
    report = run({"cp_lse_ag_out_rs": dcp_nan_lost_beside_empty},
                 kernels=["cp_lse_ag_out_rs"], **F64)
    rows, bad = _split(report)
    assert bad == {"nan_lse_beside_empty_ranks"}, report.to_text()
    row = rows["nan_lse_beside_empty_ranks"]
    assert row.convention.startswith("a NaN lse read as 'no keys' where every other rank is "
                                  "empty"), (
        row.convention, row.detail)
    assert rows["nan_lse_is_not_empty"].status == "pass"  # the blind spot: the old case passes


@pytest.mark.parametrize("kernel, twin, topic", [
    ("mla_decode_paged", decode_always_causal, "non_causal"),
    ("attention_with_lse", attention_always_causal, None),
])
def test_a_causal_mask_applied_when_causal_is_false_is_named(kernel, twin, topic):
    report = run({kernel: twin}, kernels=[kernel], cases=[topic] if topic else None, **F64)
    named = [r for r in report.rows
             if r.convention == "causal mask applied although causal=False"]
    assert named, report.to_text()
    for r in named:
        assert r.status == "fail"
    if topic:  # every non-causal case of s_q > 1 names it
        assert len(named) == len(report.rows) >= 2, report.to_text()
