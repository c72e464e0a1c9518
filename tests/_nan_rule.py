"""The NaN rule of conventions §13, as the tests of both paths check it.

A NaN in an input that reaches a query's logits or an lse makes that query's outputs NaN
(``o`` and ``lse``, and ``max_logits`` where there is one): never ``±inf`` (the "no key"
markers), never 0. A query that sees no key at all never uses its ``q``, so it stays "no key".
"""

from __future__ import annotations

import torch

from mla.compare import assert_close


def assert_nan_rule(out: torch.Tensor, ref: torch.Tensor, tol: float | None = None, *,
                    name: str, abs_tol: float | None = None) -> None:
    """NaN exactly where the float64 reference has NaN, the rest within tolerance."""
    nan_out, nan_ref = torch.isnan(out).cpu(), torch.isnan(ref).cpu()
    assert torch.equal(nan_out, nan_ref), (
        f"{name}: NaN at {nan_out.nonzero().tolist()[:8]}, "
        f"the reference at {nan_ref.nonzero().tolist()[:8]}")
    assert_close(out.cpu()[~nan_out], ref.cpu()[~nan_ref], tol, name=name, abs_tol=abs_tol)
