"""The conformance families of the log-sum-exp kernels bite: ``merge_attn_states``,
``attention_with_lse`` and the DCP correction ``cp_lse_ag_out_rs`` (mla/conformance/cases/
merge.py, attention.py, dcp.py).

The reference passes every case in float64; each broken twin (the reference with one
convention changed: base-2 lse, a marker of "no keys" read as a real lse, the scale ignored,
the causal diagonal at the top-left, a rank without keys weighted 1, a NaN read as "no keys",
...) fails every case of the topic that pins the convention, and the failing rows name it.
No other kernel's case calls them (``test_conformance.py`` shows it for every kernel), so a
twin cannot fail another kernel's cases.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch

import mla.reference as ref
from mla.conformance import KERNELS, cases_of, run

F64 = dict(device="cpu", dtype=torch.float64)
REFERENCE = {k: getattr(ref, k) for k in KERNELS}
MINE = ("merge_attn_states", "attention_with_lse", "cp_lse_ag_out_rs")
LN2 = math.log(2.0)
NAN = float("nan")


def test_the_reference_passes_every_case_of_the_three_families_in_float64():
    report = run(REFERENCE, kernels=list(MINE), **F64)
    assert report.passed, report.to_text()
    assert {r.status for r in report.rows} == {"pass"}
    assert {r.kernel for r in report.rows} == set(MINE)
    counts = {k: sum(1 for c in cases_of([k])) for k in MINE}
    assert min(counts.values()) >= 10, counts


# ---- merge_attn_states twins ------------------------------------------------------------------

def _merge_log2(o_p, lse_p, o_s, lse_s):
    """Reads and writes the lse in base 2 (exp2/log2 weights)."""
    out, lse = ref.merge_attn_states(o_p, lse_p * LN2, o_s, lse_s * LN2)
    return out, lse / LN2


def _merge_plus_inf_real(o_p, lse_p, o_s, lse_s):
    """Only -inf means "no keys": a +inf side is present, m = +inf and exp(inf - inf) = NaN
    (the reference's NaN rule gives exactly that row)."""
    def real(lse):
        return lse.masked_fill(torch.isposinf(lse), NAN)
    return ref.merge_attn_states(o_p, real(lse_p), o_s, real(lse_s))


def _merge_minus_inf_real(o_p, lse_p, o_s, lse_s):
    """Only +inf means "no keys": a -inf side is present (weight 0 times its garbage)."""
    def real(lse):
        return lse.masked_fill(torch.isneginf(lse), NAN)
    return ref.merge_attn_states(o_p, real(lse_p), o_s, real(lse_s))


def _merge_reads_empty_side(o_p, lse_p, o_s, lse_s):
    """No passthrough: o = w_p·o_p + w_s·o_s with an empty side's weight 0 times its output."""
    out, lse = ref.merge_attn_states(o_p, lse_p, o_s, lse_s)
    for o, side in ((o_p, lse_p), (o_s, lse_s)):
        one_empty = torch.isinf(side) & ~(torch.isinf(lse_p) & torch.isinf(lse_s))
        out = out + 0 * torch.where(one_empty.transpose(0, 1)[..., None], o, 0.0)
    return out, lse


def _merge_both_empty_plus_inf(*args):
    """Both sides empty give FlashMLA's +inf instead of -inf."""
    out, lse = ref.merge_attn_states(*args)
    return out, lse.masked_fill(torch.isneginf(lse), math.inf)


def _nan_to_empty(lse):
    return lse.nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)


def _merge_nan_as_empty(o_p, lse_p, o_s, lse_s):
    """A NaN lse read as "no keys"."""
    return ref.merge_attn_states(o_p, _nan_to_empty(lse_p), o_s, _nan_to_empty(lse_s))


def _merge_nan_beside_empty_as_empty(o_p, lse_p, o_s, lse_s):
    """vLLM's Triton merge: max(NaN, -inf) drops the NaN, so a NaN beside an empty side meets
    the both-empty rule (out 0, lse -inf); a NaN beside keys stays NaN."""
    out, lse = ref.merge_attn_states(o_p, lse_p, o_s, lse_s)
    rows = (lse_p.isnan() & lse_s.isinf()) | (lse_s.isnan() & lse_p.isinf())
    return out.masked_fill(rows.transpose(0, 1)[..., None], 0.0), lse.masked_fill(rows, -math.inf)


# ---- attention_with_lse twins -----------------------------------------------------------------

def _attn_scale_ignored(q, k, v, scale, *args):
    return ref.attention_with_lse(q, k, v, q.shape[-1] ** -0.5, *args)


def _attn_top_left(q, k, v, scale, causal=False, q_positions=None, k_positions=None):
    """Causal diagonal at the top-left: query i sees keys 0..i."""
    if q_positions is None:
        q_positions = torch.arange(q.shape[0])
    return ref.attention_with_lse(q, k, v, scale, causal, q_positions, k_positions)


def _attn_positions_ignored(q, k, v, scale, causal=False, q_positions=None, k_positions=None):
    return ref.attention_with_lse(q, k, v, scale, causal)


def _attn_empty_plus_inf(*args):
    """FlashMLA's +inf for a query that sees no key."""
    o, lse = ref.attention_with_lse(*args)
    return o, lse.masked_fill(torch.isneginf(lse), math.inf)


def _attn_interleaved_heads(q, k, v, *args):
    """Query head n reads KV head n % Nk instead of n // (N / Nk)."""
    heads = torch.arange(q.shape[1]) % k.shape[1]
    return ref.attention_with_lse(q, k[:, heads], v[:, heads], *args)


# ---- cp_lse_ag_out_rs twins -------------------------------------------------------------------

def _dcp_log2(out, lse, comm, return_lse=False):
    res = ref.cp_lse_ag_out_rs(out, lse * LN2, comm, return_lse=return_lse)
    return (res[0], res[1] / LN2) if return_lse else res


def _dcp_plus_inf_real(out, lse, comm, return_lse=False):
    """A rank's +inf read as a real lse (exp(inf - inf) = NaN: the NaN rule's row)."""
    return ref.cp_lse_ag_out_rs(out, lse.masked_fill(torch.isposinf(lse), NAN), comm,
                                return_lse=return_lse)


def _dcp_empty_rank_weighted_one(out, lse, comm, return_lse=False):
    """A rank without keys adds its output unscaled."""
    o, l_ = ref.cp_lse_ag_out_rs(out, lse, comm, return_lse=True)
    o = o + comm.reduce_scatter(torch.where(torch.isinf(lse)[..., None], out, 0.0), dim=1)
    return (o, l_) if return_lse else o


def _dcp_all_empty_plus_inf(out, lse, comm, return_lse=False):
    """A query no rank saw gets +inf (the decode's marker) instead of -inf."""
    o, l_ = ref.cp_lse_ag_out_rs(out, lse, comm, return_lse=True)
    l_ = l_.masked_fill(torch.isneginf(l_), math.inf)
    return (o, l_) if return_lse else o


def _dcp_nan_as_empty(out, lse, comm, return_lse=False):
    return ref.cp_lse_ag_out_rs(out, _nan_to_empty(lse), comm, return_lse=return_lse)


def _dcp_always_returns_lse(out, lse, comm, return_lse=False):
    return ref.cp_lse_ag_out_rs(out, lse, comm, return_lse=True)


@dataclasses.dataclass(frozen=True)
class Twin:
    kernel: str
    fn: Callable
    topics: frozenset[str]  # every case of these topics must fail
    words: str | None  # what the failing rows of those topics' convention line says
    only: bool = False  # and no case outside them fails


TWINS = [
    Twin("merge_attn_states", _merge_log2, frozenset({"lse_base", "shapes", "heads"}),
         "base 2"),
    Twin("merge_attn_states", _merge_plus_inf_real, frozenset({"empty_plus_inf"}),
         "+inf read as a real lse"),
    Twin("merge_attn_states", _merge_minus_inf_real, frozenset({"empty_minus_inf"}),
         "-inf read as a real lse"),
    Twin("merge_attn_states", _merge_reads_empty_side,
         frozenset({"empty_plus_inf", "empty_minus_inf"}), "the empty side's output is read"),
    Twin("merge_attn_states", _merge_both_empty_plus_inf,
         frozenset({"both_empty", "nan_beside_empty"}), "both sides empty give lse +inf",
         only=True),
    Twin("merge_attn_states", _merge_nan_as_empty, frozenset({"nan", "nan_beside_empty"}),
         "NaN lse read as 'no keys' (the other side passed through)", only=True),
    Twin("merge_attn_states", _merge_nan_beside_empty_as_empty, frozenset({"nan_beside_empty"}),
         "NaN lse beside an empty side read as 'no keys'", only=True),
    Twin("attention_with_lse", _attn_scale_ignored, frozenset({"scale"}),
         "used instead of the scale passed", only=True),
    Twin("attention_with_lse", _attn_top_left, frozenset({"causal"}),
         "causal aligned at the top-left"),
    Twin("attention_with_lse", _attn_positions_ignored, frozenset({"positions"}),
         "q_positions / k_positions ignored", only=True),
    Twin("attention_with_lse", _attn_empty_plus_inf, frozenset({"empty"}),
         "+inf for a query that sees no key", only=True),
    Twin("cp_lse_ag_out_rs", _dcp_log2, frozenset({"lse_base", "ranks"}), "base 2"),
    Twin("cp_lse_ag_out_rs", _dcp_plus_inf_real, frozenset({"empty_plus_inf"}),
         "+inf lse read as a real lse"),
    Twin("cp_lse_ag_out_rs", _dcp_empty_rank_weighted_one, frozenset({"empty_minus_inf"}),
         "weighted 1"),
    Twin("cp_lse_ag_out_rs", _dcp_all_empty_plus_inf, frozenset({"all_empty"}),
         "no rank saw gets lse +inf", only=True),
    Twin("cp_lse_ag_out_rs", _dcp_nan_as_empty, frozenset({"nan"}),
         "NaN lse read as 'no keys'", only=True),
    Twin("cp_lse_ag_out_rs", _dcp_always_returns_lse, frozenset({"return_lse"}), None,
         only=True),
]


@pytest.mark.parametrize("twin", TWINS, ids=lambda t: t.fn.__name__.strip("_"))
def test_broken_twin_fails_its_topic_and_is_named(twin: Twin) -> None:
    report = run({twin.kernel: twin.fn}, kernels=[twin.kernel], **F64)
    pinned = [r for r in report.rows if r.topic in twin.topics]
    assert pinned and all(r.status in ("fail", "error") for r in pinned), report.to_text()
    if twin.words is not None:
        unnamed = [(r.case, r.convention) for r in pinned if twin.words not in r.convention]
        assert not unnamed, unnamed
    if twin.only:
        others = [r.case for r in report.rows if r.topic not in twin.topics
                  and r.status != "pass"]
        assert not others, report.to_text()


def test_the_interleaved_head_twin_fails_exactly_the_grouped_case() -> None:
    report = run({"attention_with_lse": _attn_interleaved_heads},
                 kernels=["attention_with_lse"], **F64)
    failing = [r for r in report.rows if r.status != "pass"]
    assert [r.case for r in failing] == ["heads_9_grouped"], report.to_text()
    assert "interleaved" in failing[0].convention
