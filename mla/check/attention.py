"""``python -m mla.check`` cases for ``mla.fast.attention_with_lse``: attention with a
log-sum-exp on given q, k, v (the kernel the prefill paths run after their up-projection),
causal by position, explicit positions with gaps, an empty query, grouped heads.

On the CPU the default route is the reference's own math, so the CPU cases force the Triton
route (they are there to run the kernel); on a GPU each case runs by the route picked, and
the long ones once more forced onto the Triton kernel.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

import mla.fast as fast
import mla.fast.attention as fast_attention
from mla.check.catalogue import catalogue_cases
from mla.check.prefill import forced_route
from mla.check.registry import Case, Ctx, Metrics, gen, register
from mla.compare import max_abs_err, poisoned_alloc, rel_err
from mla.reference.attention import attention_with_lse as ref_attention

__all__ = ["attention_cases"]


def _attention(ctx: Ctx, salt: int, Sq: int, Skv: int, N: int, Nk: int, D: int, Dv: int,
               causal: bool, positions: bool, route: str | None, logit_scale: float = 1.0
               ) -> Metrics:
    g = gen(ctx, salt)
    dev, dt = ctx.device, ctx.dtype
    q = (torch.randn(Sq, N, D, generator=g) * logit_scale).to(dt).to(dev)
    k = torch.randn(Skv, Nk, D, generator=g).to(dt).to(dev)
    v = torch.randn(Skv, Nk, Dv, generator=g).to(dt).to(dev)
    pos = {}
    if positions:  # gaps; the first query sees no key
        pos = {"q_positions": torch.arange(Skv - Sq, Skv, device=dev) * 2 - 1,
               "k_positions": torch.arange(Skv, device=dev) * 2}
    scale = D ** -0.5
    with forced_route(fast_attention, "pick_route", route), poisoned_alloc():
        out, lse = fast.attention_with_lse(q, k, v, scale, causal, **pos)
    r_out, r_lse = ref_attention(q.double(), k.double(), v.double(), scale, causal, **pos)
    return {"out_rel": rel_err(out, r_out), "lse_abs": max_abs_err(lse, r_lse)}


@register("attention_with_lse", "attention_with_lse")
def attention_cases(ctx: Ctx) -> Iterator[Case]:
    yield from catalogue_cases(ctx, "attention_with_lse")
    if ctx.quick:
        route = "triton" if ctx.device.type == "cpu" else None
        cases = [(33, 33, 4, 4, 24, 16, True, False, route, 1.0),
                 (17, 40, 4, 2, 24, 16, False, False, route, 1.0),
                 (9, 20, 2, 2, 24, 16, True, True, route, 1.0),
                 (1, 1, 2, 2, 24, 16, True, False, route, 1.0),
                 (17, 40, 4, 4, 24, 16, False, False, route, 30.0)]
    else:
        cases = [(s, k, N, N, 192, 128, c, p, r, 1.0) for r in (None, "triton")
                 for s, k, N, c, p in ((2048, 2048, 16, True, False),
                                       (777, 1300, 16, False, False),
                                       (500, 500, 128, True, True))]
        cases += [(1, 1, 128, 128, 192, 128, True, False, None, 1.0),
                  (777, 1300, 16, 16, 192, 128, False, False, "triton", 30.0)]
    for i, (Sq, Skv, N, Nk, D, Dv, causal, positions, route, x) in enumerate(cases):
        yield Case(f"Sq={Sq} Skv={Skv} N={N}/{Nk} D={D}/{Dv} causal={int(causal)} "
                   f"positions={int(positions)} route={route or 'default'}"
                   + (f" logits x{x:g}" if x != 1.0 else ""),
                   lambda a=(100 + i, Sq, Skv, N, Nk, D, Dv, causal, positions, route, x):
                   _attention(ctx, *a))
