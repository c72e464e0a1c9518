"""The indexer logits' error measure (``mla.compare.logits_err``) and the FP8 MMA budget behind
it: the emulated Hopper accumulator (``benchmarks.fp8_mma``) on the catalogue's cases sits
inside the budget of a CUDA device, logits 1% off or with one head dropped do not."""

from __future__ import annotations

import pytest
import torch

import mla.reference as ref
from benchmarks import fp8_mma
from mla.compare import FP8_MMA_LOGITS_ERR, fp8_mma_logits_budget, logits_err, rel_err
from mla.conformance import CATALOGUE
from mla.conformance.cases.indexer import HEADS, logits_budget_of
from mla.conformance.catalogue import Setting

F64 = torch.float64


def _e4m3(values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32).to(torch.float8_e4m3fn)
    assert torch.equal(t.double(), torch.tensor(values, dtype=F64)), "not e4m3 numbers"
    return t.double()


def test_truncate_bits_keeps_bits_after_the_leading_one_toward_zero():
    x = torch.tensor([1 + 2 ** -13, 1 + 2 ** -14, -(1 + 2 ** -14), 3 * 2 ** -40, 0.0], dtype=F64)
    got = fp8_mma.truncate_bits(x, 13)
    assert torch.equal(got, torch.tensor([1 + 2 ** -13, 1.0, -1.0, 3 * 2 ** -40, 0.0],
                                         dtype=F64))


def test_emulated_dots_truncate_at_each_step():
    # 240·32 then two products of 0.3: "sum" keeps 7680.5 (the step's exact sum truncated to
    # 13 bits), "align" drops both (each below the grid of 7680's 13 bits)
    q = _e4m3([240.0, 0.3125, 0.3125] + [0.0] * 29)
    k = _e4m3([32.0, 1.0, 1.0] + [0.0] * 29)
    assert fp8_mma.emulated_dots(q, k, mode="sum").item() == 7680.5
    assert fp8_mma.emulated_dots(q, k, mode="align").item() == 7680.0
    # a step's truncation carries into the next: 1 + 2^-14 is 1 after the first step of 16
    q, k = _e4m3([1.0] + [0.0] * 15 + [2.0 ** -7] + [0.0] * 15), _e4m3([1.0] * 32)
    assert fp8_mma.emulated_dots(q, k, step=16, mode="sum").item() == 1.0 + 2 ** -7
    with pytest.raises(ValueError, match="mode"):
        fp8_mma.emulated_dots(q, k, mode="round")
    with pytest.raises(ValueError, match="step"):
        fp8_mma.emulated_dots(q, k, step=24)


def test_logits_err_measures_against_the_magnitude():
    want = torch.tensor([[1.0, -1.0, float("-inf")], [0.5, 2.0, 3.0]], dtype=F64)
    mag = torch.tensor([[4.0, 4.0, float("-inf")], [2.0, 2.0, 3.0]], dtype=F64)
    got = want.clone()
    got[1, 1] += 1e-3
    assert logits_err(got, want, mag) == pytest.approx(1e-3 / mag[torch.isfinite(mag)].norm())
    assert logits_err(want.float(), want, mag) == 0.0
    nan = got.clone()
    nan[0, 0] = float("nan")
    assert logits_err(nan, want, mag) == float("inf")
    moved = got.clone()
    moved[0, 2] = 0.0  # a -inf the reference has, missing
    assert logits_err(moved, want, mag) == float("inf")
    with pytest.raises(ValueError, match="mag"):
        logits_err(got, want, mag[:1])
    with pytest.raises(ValueError, match="finite"):
        logits_err(got, want, torch.where(torch.isfinite(want), float("nan"), mag))
    tiny = 2.0 ** -1000  # squares underflow: rescaled before the norms, no passing 0
    assert logits_err(got * tiny, want * tiny, mag * tiny) == pytest.approx(
        logits_err(got, want, mag))


def test_the_fp8_budget_widens_below_64_heads():
    """Fewer heads average fewer dots' roundings: sqrt(64 / heads) times the budget below 64,
    the budget itself from 64 up (DeepSeek-V3.2's index heads)."""
    assert fp8_mma_logits_budget(64) == fp8_mma_logits_budget(128) == FP8_MMA_LOGITS_ERR
    assert fp8_mma_logits_budget(16) == 2 * FP8_MMA_LOGITS_ERR
    assert fp8_mma_logits_budget(1) == 8 * FP8_MMA_LOGITS_ERR
    with pytest.raises(ValueError, match="heads"):
        fp8_mma_logits_budget(0)


@pytest.mark.parametrize("name", ["fp8_paged_mqa_logits/page_64_long",
                                  "fp8_paged_mqa_logits/next_n_4_page_edge",
                                  "fp8_mqa_logits/ragged_requests"])
def test_the_fp8_mma_budget_holds_the_emulated_accumulator_and_bites(name: str):
    """On a catalogue case, a kernel whose dots accumulate as Hopper's FP8 MMA (emulated) is
    within a CUDA device's limit, and fails the CPU's float32 one; the same logits 1% off, or
    with one head's weight dropped, fail both."""
    case = CATALOGUE[name]
    trial = case.build(Setting(torch.device("cpu"), torch.float32, 0, small=True))
    want = trial.expected["logits"]
    cpu_limit = trial.limits["logits"]
    cuda_limit = cpu_limit / logits_budget_of(HEADS, "cpu") * logits_budget_of(HEADS, "cuda")
    assert logits_budget_of(HEADS, "cuda") == FP8_MMA_LOGITS_ERR
    emulated = trial.invoke(getattr(fp8_mma, case.kernel))["logits"]
    err = rel_err(emulated, want)
    assert err <= cuda_limit / 2, f"emulated FP8 MMA: {err:.2e} against {cuda_limit:.2e}"
    assert err > cpu_limit

    def one_head_dropped(q, kv, weights, *rest):
        w = weights.clone()
        w[:, 5] = 0.0
        return getattr(ref, case.kernel)(q, kv, w, *rest)

    for wrong in (lambda *a: getattr(ref, case.kernel)(*a) * 1.01, one_head_dropped):
        assert rel_err(trial.invoke(wrong)["logits"], want) > 10 * cuda_limit
