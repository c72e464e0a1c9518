"""``python -m mla.check`` cases for ``mla.fast.prefill_attention`` and
``mla.fast.chunked_prefill_attention``.

DeepSeek shapes on a GPU (QK 128 + 64, V 128, latent 512, bf16), tiny ones with ``quick``.
The reference runs in float64 on upcast copies on the same device; outputs the fast path
allocates are poisoned while it runs. The prefill paths materialize the up-projected keys
``kv_c · W_UK`` in the input dtype (so does the reference run in that dtype): that rounding
moves a bf16 lse by a few 1e-3 from the float64 one. So the lse is measured twice:
``lse_abs`` against the reference run in the input dtype (what the attention kernel itself
adds, float32-small) and ``lse_abs_f64`` against float64 (the whole path, the keys' rounding
included); each has its own budget (conventions §11). ``out_rel`` is against float64.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType

import torch

import mla.fast as fast
import mla.fast.chunked as fast_chunked
import mla.fast.prefill as fast_prefill
from mla.check.registry import Case, Ctx, Metrics, gen, register
from mla.compare import max_abs_err, poisoned_alloc, rel_err
from mla.reference.chunked import chunked_prefill_attention as ref_chunked
from mla.reference.chunked import plan_context_chunks
from mla.reference.paged_cache import make_block_table
from mla.reference.prefill import prefill_attention as ref_prefill

__all__ = ["prefill_cases", "chunked_cases", "forced_route"]


def _dims(quick: bool) -> tuple[int, int, int, int]:
    """``(Lkv, P, R, V)``."""
    return (32, 16, 8, 16) if quick else (512, 128, 64, 128)


def _weights(g: torch.Generator, Lkv: int, N: int, P: int, V: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # scaled so that the up-projected keys and the logits are O(1)
    W_UK = (torch.randn(Lkv, N, P, generator=g) * Lkv ** -0.5).to(dtype).to(device)
    W_UV = (torch.randn(Lkv, N, V, generator=g) * Lkv ** -0.5).to(dtype).to(device)
    return W_UK, W_UV


@contextlib.contextmanager
def forced_route(module: ModuleType, picker: str, route: str | None) -> Iterator[None]:
    """Force ``module.<picker>`` to answer ``route`` within the block (None: leave it be).
    On the CPU the default route is the reference's own math, so the CPU cases force the
    Triton route: they are there to run the kernel."""
    picked = getattr(module, picker)
    if route is not None:
        setattr(module, picker, lambda *args: route)
    try:
        yield
    finally:
        setattr(module, picker, picked)


def _cpu_route(ctx: Ctx) -> str | None:
    return "triton" if ctx.device.type == "cpu" else None


def _metrics(out: torch.Tensor, lse: torch.Tensor, r_out: torch.Tensor, r_lse: torch.Tensor,
             r_lse_dt: torch.Tensor) -> Metrics:
    return {"out_rel": rel_err(out, r_out), "lse_abs": max_abs_err(lse, r_lse_dt),
            "lse_abs_f64": max_abs_err(lse, r_lse)}


def _prefill(ctx: Ctx, salt: int, Sq: int, Skv: int, N: int, positions: bool,
             route: str | None) -> Metrics:
    Lkv, P, R, V = _dims(ctx.quick)
    g = gen(ctx, salt)
    dev, dt = ctx.device, ctx.dtype
    W_UK, W_UV = _weights(g, Lkv, N, P, V, dt, dev)
    q_nope = torch.randn(Sq, N, P, generator=g).to(dt).to(dev)
    q_pe = torch.randn(Sq, N, R, generator=g).to(dt).to(dev)
    kv_c = torch.randn(Skv, Lkv, generator=g).to(dt).to(dev)
    k_pe = torch.randn(Skv, R, generator=g).to(dt).to(dev)
    pos = {}
    if positions:  # gaps in the positions; the first query sees nothing
        pos = {"q_positions": torch.arange(Skv - Sq, Skv, device=dev) * 3 - 1,
               "k_positions": torch.arange(Skv, device=dev) * 3}
    scale = (P + R) ** -0.5
    with forced_route(fast_prefill, "pick_route", route), poisoned_alloc():
        out, lse = fast.prefill_attention(q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, scale, True,
                                          **pos)
    r_out, r_lse = ref_prefill(q_nope.double(), q_pe.double(), kv_c.double(), k_pe.double(),
                               W_UK.double(), W_UV.double(), scale, True, **pos)
    _, r_lse_dt = ref_prefill(q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, scale, True, **pos)
    return _metrics(out, lse, r_out, r_lse, r_lse_dt)


@register("prefill_attention", "prefill_attention")
def prefill_cases(ctx: Ctx) -> Iterator[Case]:
    """The cuDNN route (square causal) and the Triton route (context before the queries,
    explicit positions), with a length-1 and a lonely-query case."""
    cases = ([(37, 37, 4, False), (11, 30, 4, False), (9, 9, 2, True), (1, 1, 2, False)]
             if ctx.quick else
             [(2048, 2048, 16, False), (1000, 1000, 128, False), (1, 1, 128, False),
              (777, 1300, 16, False), (500, 500, 16, True)])
    route = _cpu_route(ctx)
    for i, (Sq, Skv, N, positions) in enumerate(cases):
        what = ("square causal" if Sq == Skv and not positions else
                "positions" if positions else "context first")
        yield Case(f"Sq={Sq} Skv={Skv} N={N} ({what}) route={route or 'default'}",
                   lambda a=(200 + i, Sq, Skv, N, positions, route): _prefill(ctx, *a))


def _chunked(ctx: Ctx, salt: int, ctx_lens: list[int], new: list[int], N: int, mcc: int,
             bs: int, route: str | None) -> Metrics:
    Lkv, P, R, V = _dims(ctx.quick)
    g = gen(ctx, salt)
    dev, dt = ctx.device, ctx.dtype
    W_UK, W_UV = _weights(g, Lkv, N, P, V, dt, dev)
    bt, nb = make_block_table(ctx_lens, bs, spare_blocks=2, seed=salt)
    kv_cache = torch.randn(nb, bs, Lkv + R, generator=g).to(dt).to(dev)
    T = sum(new)
    q_nope = torch.randn(T, N, P, generator=g).to(dt).to(dev)
    q_pe = torch.randn(T, N, R, generator=g).to(dt).to(dev)
    kv_c = torch.randn(T, Lkv, generator=g).to(dt).to(dev)
    k_pe = torch.randn(T, R, generator=g).to(dt).to(dev)
    qsl = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32,
                       device=dev)
    plan = plan_context_chunks(ctx_lens, max_context_chunk=mcc)
    scale = (P + R) ** -0.5
    with forced_route(fast_chunked, "varlen_route", route), poisoned_alloc():
        out, lse = fast.chunked_prefill_attention(q_nope, q_pe, kv_c, k_pe, qsl, kv_cache,
                                                  bt.to(dev), plan, W_UK, W_UV, scale)
    r_out, r_lse = ref_chunked(q_nope.double(), q_pe.double(), kv_c.double(), k_pe.double(),
                               qsl, kv_cache.double(), bt.to(dev), plan, W_UK.double(),
                               W_UV.double(), scale)
    _, r_lse_dt = ref_chunked(q_nope, q_pe, kv_c, k_pe, qsl, kv_cache, bt.to(dev), plan, W_UK,
                              W_UV, scale)
    return _metrics(out, lse, r_out, r_lse, r_lse_dt)


@register("chunked_prefill_attention", "chunked_prefill_attention")
def chunked_cases(ctx: Ctx) -> Iterator[Case]:
    """A ragged batch (a request without context, one with a single cached token, context
    lengths off the page and chunk sizes), each route."""
    if ctx.quick:
        grid = [([0, 13, 40, 1], [3, 5, 1, 1], 4, 7, 8, _cpu_route(ctx))]
    else:
        grid = [([0, 1000, 1, 3000], [17, 300, 1, 64], 16, 1024, 64, None),
                ([0, 1000, 1, 3000], [17, 300, 1, 64], 16, 1024, 64, "cudnn"),
                ([0, 1000, 1, 3000], [17, 300, 1, 64], 16, 1024, 64, "triton"),
                ([4097, 64], [128, 1], 128, 2048, 64, None)]
    if ctx.dtype == torch.float32:
        # cuDNN's attention takes 16-bit inputs only; varlen_route never sends float32 there
        grid = [g for g in grid if g[-1] != "cudnn"]
    for i, (ctx_lens, new, N, mcc, bs, route) in enumerate(grid):
        yield Case(f"ctx={ctx_lens} new={new} N={N} MCC={mcc} route={route or 'default'}",
                   lambda a=(300 + i, ctx_lens, new, N, mcc, bs, route): _chunked(ctx, *a))
