"""Two conventions of vLLM 0.33's Triton kernels that the fuzz on an H100 found unnamed
(benchmarks/results/conformance/fuzz_peers_2026-12-06.md), named by the judge now.

- ``mla_decode_paged`` with one query head (``kv_group_num == 1``: the non-grouped
  ``_fwd_kernel_stage1``): each score is ``tl.sum(q[None, :] * k, 1)`` over bf16 tensors, so
  every product and partial sum is rounded to bf16 (the grouped kernel's ``tl.dot``
  accumulates in float32).
- ``cp_lse_ag_out_rs`` with a NaN lse where the other ranks hold keys: the kernel reads NaN
  as "no keys" and drops the rank, and the ranks' scaled outputs are bf16 partials summed in
  bf16; each convention is named alone, and now both at once.

Their twins, the planted kernels below, behave as vLLM's do on a GPU: they reproduce the
H100's numbers, fail the new case of their convention with it named, and the reference
passes those cases; other twins keep their own names there. In bf16, on the CPU.
"""

from __future__ import annotations

import math

import pytest
import torch

import mla.reference as ref
from mla.conformance.cases.dcp import DcpSpec, dcp_trial
from mla.conformance.cases.decode import DecodeSpec, decode_trial, half_sum_scores
from mla.conformance.catalogue import CATALOGUE, Setting
from mla.conformance.diagnose import LOG2E, describe
from mla.conformance.fuzz import judge
from mla.reference.dcp.sharding import head_slice
from mla.reference.paged_cache import cache_rows

INF = float("inf")
SETTING = Setting(torch.device("cpu"), torch.bfloat16, seed=0, small=True)
DECODE_CASE = "mla_decode_paged/heads_1_single_keys"
DCP_CASE = "cp_lse_ag_out_rs/nan_lse_beside_ranks_with_keys"
BF16_SCORES = "each score q·k summed in bfloat16 (one query head per KV head"
NAN_AND_BF16 = "a NaN lse read as 'no keys' (the rank dropped: out and lse finite"


def decode_one_head_bf16_scores(q, kv, table, lens, scale, causal=False, dv=512, **kw):
    """vLLM's Triton decode as it runs one query head per KV head: bf16 scores, then stage
    1's softmax in float32 (one split) and the output rounded once. Several heads: the grouped
    kernel, which keeps the budgets (the reference stands in); an empty query keeps the
    reference's out 0, lse +inf, so that one convention differs."""
    if q.shape[2] != 1 or kw:
        return ref.mla_decode_paged(q, kv, table, lens, scale, causal, dv, **kw)
    B, s_q = q.shape[:2]
    out = torch.zeros(B, s_q, 1, dv, dtype=q.dtype)
    lse = torch.full((B, 1, s_q), INF, dtype=torch.float32)
    for b, L in enumerate(lens.tolist()):
        rows = cache_rows(kv, table[b], 0, L).double()
        for i in range(s_q):
            n = max(0, L - s_q + 1 + i) if causal else L
            if n:
                s = half_sum_scores(q[b, i].double(), rows[:n], q.dtype)[0].float() * scale
                m = s.max()
                p = torch.exp(s - m)
                e = p.sum()
                out[b, i, 0] = ((p[:, None] * rows[:n, :dv].float()).sum(0) / e).to(q.dtype)
                lse[b, 0, i] = m + torch.log(e)
    return out, lse


def decode_lse_log2(*args, **kw):
    out, lse = ref.mla_decode_paged(*args, **kw)
    return out, lse * LOG2E


def dcp_like_vllm(out, lse, comm, return_lse=False):
    """``correct_attn_cp_out_kernel`` and the reduce-scatter: NaN and +inf lse read as -inf,
    each rank's scaled output stored in out's dtype, the reduce-scatter summing in it."""
    lses = comm.all_gather(lse.float()[None], dim=0)  # [W, T, N]
    lses = torch.where(torch.isnan(lses) | torch.isposinf(lses), -INF, lses)
    m = lses.max(dim=0).values
    m = torch.where(torch.isneginf(m), 0.0, m)
    comb = torch.log(torch.exp(lses - m).sum(dim=0)) + m
    d = lses[comm.rank] - comb
    factor = torch.exp(torch.where(torch.isnan(d) | torch.isposinf(d), -INF, d))[..., None]
    scaled = torch.where(factor == 0, 0.0, out.float() * factor).to(out.dtype)
    o = comm.reduce_scatter(scaled, dim=1)
    heads = head_slice(out.shape[1], comm.world_size, comm.rank)
    return (o, comb[:, heads].contiguous()) if return_lse else o


def dcp_nan_as_empty(out, lse, comm, return_lse=False):
    """The reference with a NaN lse taken for "no keys" (the float32 sum kept)."""
    return ref.cp_lse_ag_out_rs(out, lse.nan_to_num(nan=-INF, posinf=INF, neginf=-INF), comm,
                                return_lse=return_lse)


def _six(x: torch.Tensor) -> str:
    """A one-element tensor as the report writes it (6 significant digits)."""
    return f"{x.item():.6g}"


def test_the_decode_twin_gives_the_h100s_numbers():
    """The fuzz's two shrunk inputs (one head, one request of 1 and 63 keys): vLLM returned
    lse 0.273438 for the first; out -0.384766 at column 227 and lse 5.95548 for the second."""
    t = decode_trial(SETTING, DecodeSpec((1,), heads=1), 0)
    got = t.invoke(decode_one_head_bf16_scores)
    assert _six(got["lse"]) == "0.273438" and _six(t.expected["lse"]) == "0.276325"
    t = decode_trial(SETTING, DecodeSpec((63,), heads=1, scale=0.07216878364870322), 0)
    got = t.invoke(decode_one_head_bf16_scores)
    assert _six(got["out"][0, 0, 0, 227]) == "-0.384766" and _six(got["lse"]) == "5.95548"


def test_the_dcp_twin_gives_the_h100s_numbers():
    """The fuzz's shrunk input (2 ranks, 1 token, 2 heads, a NaN lse on one rank)."""
    t = dcp_trial(SETTING, DcpSpec(2, 1, heads=2, d=128, nan=True), 0)
    lines = describe(t.invoke(dcp_like_vllm), t.expected, t.quantities)
    for line in ("out: worst element (0, 126): got -2.25, reference -2.25981",
                 "out_nan: differs at 128 of 256 elements, first at (0, 0, 0), (0, 0, 1), "
                 "(0, 0, 2), (0, 0, 3); dim 1 only at 0",
                 "lse_nan: differs at 1 of 2 elements, first at (0, 0); dim 1 only at 0"):
        assert line in lines, lines  # the report's (its lse keeps the budget, so is not told)


@pytest.fixture(scope="module")
def trials():
    """The two new cases' trials as ``run`` builds them on the CPU, built once."""
    return {key: CATALOGUE[key].build(SETTING) for key in (DECODE_CASE, DCP_CASE)}


@pytest.mark.parametrize("twin, case, named", [
    (decode_one_head_bf16_scores, DECODE_CASE, BF16_SCORES),
    (dcp_like_vllm, DCP_CASE, NAN_AND_BF16),
    # other twins keep their own names on the new cases
    (decode_lse_log2, DECODE_CASE, "lse in base 2"),
    (dcp_nan_as_empty, DCP_CASE,
     "a NaN lse read as 'no keys' (the rank dropped); NaN must stay NaN"),
])
def test_a_twin_fails_the_new_case_named(trials, twin, case, named):
    row = judge(case.split("/")[0], twin, trials[case], SETTING)
    assert row.status == "fail" and row.convention.startswith(named), (row.convention,
                                                                       row.detail)


def test_the_reference_passes_the_new_cases(trials):
    for case, trial in trials.items():
        kernel = case.split("/")[0]
        row = judge(kernel, getattr(ref, kernel), trial, SETTING)
        assert row.status == "pass", (case, row.errors, row.detail)


def test_both_decode_conventions_at_once_are_named():
    """The fuzz's third shrunk decode input (one head, s_q 2 causal over one key): its first
    query sees no key, so vLLM's empty-query NaN and its bf16 scores show together."""
    def vllm(*args, **kw):
        out, lse = decode_one_head_bf16_scores(*args, **kw)
        empty = torch.isposinf(lse)
        return (out.masked_fill(empty.transpose(1, 2)[..., None], math.nan),
                lse.masked_fill(empty, -math.inf))

    spec = DecodeSpec((1,), heads=1, s_q=2, causal=True, q_gain=30.0)
    row = judge("mla_decode_paged", vllm, decode_trial(SETTING, spec, 0), SETTING)
    assert row.convention.startswith(BF16_SCORES) and row.convention.endswith(
        "; and a query that sees no key gets out = NaN (0/0) and lse = -inf"), row.convention
