"""The held-row radix probe (``benchmarks.topk_held_radix``) selects the reference's set.

Under the interpreter with one member a row (programs run one after another, so a member
cannot wait on another): every radix round, the early exact stop, the tied boundary taken by
the lowest columns, NaN above every number and ``-0`` equal to ``+0``, both ways of writing
the columns (from the held keys, or tile by tile from the row read again), and the scratch
left zeroed for the next launch. Rows of several members run on the GPU only
(``python -m benchmarks.topk_held_radix`` checks their sets against ``torch.topk``'s and the
reference's).
"""

from __future__ import annotations

import pytest
import torch

from tests._interpreter import needs_interpreter

pytestmark = needs_interpreter


def _rows(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    if name == "random":
        return torch.randn(3, 1000, generator=g)
    if name == "ties":  # five values: the boundary falls inside a run of equals
        return torch.randint(0, 5, (3, 1000), generator=g).float()
    if name == "zeros_nan":
        x = torch.randn(3, 1000, generator=g)
        x[:, ::7] = 0.0
        x[:, 1::7] = -0.0
        x[0, 5] = float("nan")
        x[1, 9::50] = float("nan")
        x[2, 11::300] = -float("nan")  # the sign bit set: still above every number
        return x
    if name == "signed_zeros":  # the boundary among zeros of both signs, -0 first
        x = -torch.rand(3, 1000, generator=g) - 1
        x[:, ::3] = -0.0
        x[:, 1::3] = 0.0
        return x
    x = torch.randn(2, 900, generator=g)  # "infinities"
    x[:, ::3] = float("-inf")
    x[:, 1::31] = float("inf")
    return x


@pytest.mark.parametrize("reload", [False, True])
@pytest.mark.parametrize("name", ["random", "ties", "zeros_nan", "signed_zeros",
                                  "infinities"])
@pytest.mark.parametrize("k", [1, 17, 300])
def test_one_member_a_row_selects_the_reference_set(name: str, k: int, reload: bool) -> None:
    from benchmarks.topk_held_radix import SCRATCH, _held_radix_kernel
    from mla.reference.indexer_logits import top_k_per_row

    x = _rows(name)
    R, N = x.shape
    out = torch.full((R, k), -7, dtype=torch.int32)
    scratch = torch.zeros(R, SCRATCH.value, dtype=torch.int32)
    _held_radix_kernel[(1,)](x, out, scratch, torch.zeros(1, dtype=torch.int64), R, N,
                             x.stride(0), out.stride(0), k, G=1, CHUNK=1024, PREFETCH=False,
                             RELOAD=reload, TILE=256, EVEN=False, STAMP=False,
                             EXCHANGE_ONLY=False)
    starts = torch.zeros(R, dtype=torch.int32)
    ends = torch.full((R,), N, dtype=torch.int32)
    want = top_k_per_row(x.double(), starts, ends, k)
    assert torch.equal(out.sort(dim=1).values, want.sort(dim=1).values)
    assert int(scratch[:, :4 * 256 + 8].abs().sum()) == 0  # zeroed by the last member out
