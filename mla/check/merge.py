"""``python -m mla.check`` cases for ``mla.fast.merge_attn_states`` (conventions §6).

Random partial states with empty entries on either side (lse ``+inf`` as FlashMLA writes it,
``-inf``, both) whose outputs hold NaN: an empty side must not leak into the merge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

import mla.fast as fast
from mla.check.registry import Case, Ctx, Metrics, gen, register
from mla.compare import max_abs_err, poisoned_alloc, rel_err
from mla.reference.merge import merge_attn_states as ref_merge

__all__ = ["merge_cases"]


def _case(ctx: Ctx, salt: int, T: int, N: int, D: int, lse_scale: float = 4.0
          ) -> Callable[[], Metrics]:
    def run() -> Metrics:
        g = gen(ctx, salt)
        o = [torch.randn(T, N, D, generator=g).to(ctx.dtype).to(ctx.device) for _ in range(2)]
        lse = [(torch.randn(N, T, generator=g) * lse_scale).to(ctx.device) for _ in range(2)]
        # empty sides: +inf (FlashMLA), -inf, both; NaN in an empty side's output
        for k, val in enumerate((float("inf"), float("-inf"))):
            lse[k][:, k::5] = val
            o[k][k::5] = float("nan")
        lse[0][:, 4::5] = float("inf")
        lse[1][:, 4::5] = float("-inf")
        with poisoned_alloc():
            out, out_lse = fast.merge_attn_states(o[0], lse[0], o[1], lse[1])
        r_out, r_lse = ref_merge(o[0].double(), lse[0].double(), o[1].double(),
                                 lse[1].double())
        return {"out_rel": rel_err(out, r_out), "lse_abs": max_abs_err(out_lse, r_lse)}
    return run


@register("merge_attn_states", "merge_attn_states")
def merge_cases(ctx: Ctx) -> Iterator[Case]:
    # lse of a few units, and of a few thousand (its float32 rounding, then, is about 1e-4)
    shapes = [(37, 4, 40, 4.0), (37, 4, 40, 1e3)] if ctx.quick else [
        (1, 16, 512, 4.0), (1000, 16, 512, 4.0), (4099, 128, 512, 4.0), (333, 16, 128, 4.0),
        (1000, 16, 512, 1e3)]
    for i, (T, N, D, x) in enumerate(shapes):
        yield Case(f"T={T} N={N} D={D} lse ~{x:g} (+inf/-inf/both empty)",
                   _case(ctx, 50 + i, T, N, D, x))
