"""``python -m mla.check`` cases for the fast prefill with LSE, the chunked prefill and the
``fp8_ds_mla`` cache write (registered by ``mla.check``; the functions take its helpers as
arguments so that this module imports nothing from it).

DeepSeek shapes on a GPU (QK 128 + 64, V 128, latent 512, bf16), tiny ones with ``quick``.
The reference runs in float64 on upcast copies on the same device; outputs the fast path
allocates are NaN-poisoned while it runs. The prefill paths materialize the up-projected keys
``kv_c · W_UK`` in the input dtype (so does the reference run in bf16), which moves a bf16 lse
by about 3e-3 from the float64 one: ``lse_abs`` (limit 1e-3) is measured against the reference
run in the input dtype, ``lse_abs_f64`` (no limit) against float64; ``out_rel`` against float64.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from mla.compare import LSE_ABS_TOL, max_abs_err, rel_err

__all__ = ["prefill_cases", "chunked_cases", "fp8_cache_cases"]

Metrics = dict[str, float]


def _dims(quick: bool) -> tuple[int, int, int, int]:
    """``(Lkv, P, R, V)``."""
    return (32, 16, 8, 16) if quick else (512, 128, 64, 128)


def _limits(dtype: torch.dtype) -> Metrics:
    return {"out_rel": 1e-5 if dtype == torch.float32 else 1e-2, "lse_abs": LSE_ABS_TOL}


def _weights(g: torch.Generator, Lkv: int, N: int, P: int, V: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # scaled so that the up-projected keys and the logits are O(1)
    W_UK = (torch.randn(Lkv, N, P, generator=g) * Lkv ** -0.5).to(dtype).to(device)
    W_UV = (torch.randn(Lkv, N, V, generator=g) * Lkv ** -0.5).to(dtype).to(device)
    return W_UK, W_UV


def prefill_cases(ctx: Any, Case: Callable, poisoned_alloc: Callable,  # noqa: N803
                  gen: Callable) -> Iterator[Any]:
    """``mla.fast.prefill_attention``: the cuDNN route (square causal) and the Triton route
    (context before the queries, explicit positions), with a length-1 and a lonely-query case."""
    Lkv, P, R, V = _dims(ctx.quick)

    def run(salt: int, Sq: int, Skv: int, N: int, positions: bool) -> tuple[Metrics, Metrics]:
        from mla.fast.prefill import prefill_attention
        from mla.reference.prefill import prefill_attention as ref

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
        with poisoned_alloc():
            out, lse = prefill_attention(q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, scale, True,
                                         **pos)
        r_out, r_lse = ref(q_nope.double(), q_pe.double(), kv_c.double(), k_pe.double(),
                           W_UK.double(), W_UV.double(), scale, True, **pos)
        _, r_lse_dt = ref(q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, scale, True, **pos)
        return ({"out_rel": rel_err(out, r_out), "lse_abs": max_abs_err(lse, r_lse_dt),
                 "lse_abs_f64": max_abs_err(lse, r_lse)}, _limits(dt))

    cases = ([(37, 37, 4, False), (11, 30, 4, False), (9, 9, 2, True), (1, 1, 2, False)]
             if ctx.quick else
             [(2048, 2048, 16, False), (1000, 1000, 128, False), (1, 1, 128, False),
              (777, 1300, 16, False), (500, 500, 16, True)])
    for i, (Sq, Skv, N, positions) in enumerate(cases):
        what = ("square causal" if Sq == Skv and not positions else
                "positions" if positions else "context first")
        yield Case(f"Sq={Sq} Skv={Skv} N={N} ({what})",
                   lambda a=(200 + i, Sq, Skv, N, positions): run(*a))


def chunked_cases(ctx: Any, Case: Callable, poisoned_alloc: Callable,  # noqa: N803
                  gen: Callable) -> Iterator[Any]:
    """``mla.fast.chunked_prefill_attention`` on a ragged batch (a request without context, one
    with a single cached token, context lengths off the page and chunk sizes), each route."""
    from mla.reference.chunked import plan_context_chunks
    from mla.reference.paged_cache import make_block_table

    Lkv, P, R, V = _dims(ctx.quick)

    def run(salt: int, ctx_lens: list[int], new: list[int], N: int, mcc: int, bs: int,
            route: str | None) -> tuple[Metrics, Metrics]:
        import mla.fast.chunked as fast_chunked
        from mla.reference.chunked import chunked_prefill_attention as ref

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
        picked = fast_chunked.varlen_route
        if route is not None:
            fast_chunked.varlen_route = lambda *args: route
        try:
            with poisoned_alloc():
                out, lse = fast_chunked.chunked_prefill_attention(
                    q_nope, q_pe, kv_c, k_pe, qsl, kv_cache, bt.to(dev), plan, W_UK, W_UV,
                    scale)
        finally:
            fast_chunked.varlen_route = picked
        r_out, r_lse = ref(q_nope.double(), q_pe.double(), kv_c.double(), k_pe.double(), qsl,
                           kv_cache.double(), bt.to(dev), plan, W_UK.double(), W_UV.double(),
                           scale)
        _, r_lse_dt = ref(q_nope, q_pe, kv_c, k_pe, qsl, kv_cache, bt.to(dev), plan, W_UK, W_UV,
                          scale)
        return ({"out_rel": rel_err(out, r_out), "lse_abs": max_abs_err(lse, r_lse_dt),
                 "lse_abs_f64": max_abs_err(lse, r_lse)}, _limits(dt))

    if ctx.quick:
        grid = [([0, 13, 40, 1], [3, 5, 1, 1], 4, 7, 8, None)]
    else:
        grid = [([0, 1000, 1, 3000], [17, 300, 1, 64], 16, 1024, 64, None),
                ([0, 1000, 1, 3000], [17, 300, 1, 64], 16, 1024, 64, "cudnn"),
                ([0, 1000, 1, 3000], [17, 300, 1, 64], 16, 1024, 64, "triton"),
                ([4097, 64], [128, 1], 128, 2048, 64, None)]
    for i, (ctx_lens, new, N, mcc, bs, route) in enumerate(grid):
        yield Case(f"ctx={ctx_lens} new={new} N={N} MCC={mcc} route={route or 'default'}",
                   lambda a=(300 + i, ctx_lens, new, N, mcc, bs, route): run(*a))


def fp8_cache_cases(ctx: Any, Case: Callable, poisoned_alloc: Callable,  # noqa: N803
                    gen: Callable) -> Iterator[Any]:
    """``mla.fast.concat_and_cache_fp8_ds_mla``: every byte of the cache as the reference's
    (rows of magnitudes 1e-6 to 1e3, an all-zero tile, padding slots)."""
    def run(salt: int, T: int, bs: int) -> tuple[Metrics, Metrics]:
        from mla.fast.fp8 import concat_and_cache_fp8_ds_mla
        from mla.reference.fp8 import concat_and_cache_fp8_ds_mla as ref

        g = gen(ctx, salt)
        nb = -(-T // bs) + 2
        mags = torch.logspace(-6, 3, T)[:, None]
        kv_c = (torch.randn(T, 512, generator=g) * mags)
        kv_c[0, :128] = 0.0
        kv_c = kv_c.to(torch.bfloat16)
        k_pe = torch.randn(T, 64, generator=g).to(torch.bfloat16)
        slots = torch.randperm(nb * bs, generator=g)[:T].to(torch.int32)
        slots[::7] = -1
        cache = torch.randint(0, 256, (nb, bs, 656), generator=g, dtype=torch.uint8)
        fast_cache = cache.clone().to(ctx.device)  # on the CPU .to() alone would alias cache
        concat_and_cache_fp8_ds_mla(kv_c.to(ctx.device), k_pe.to(ctx.device), fast_cache,
                                    slots.to(ctx.device))
        ref(kv_c, k_pe, cache, slots)
        return {"mismatches": float((fast_cache.cpu() != cache).sum())}, {"mismatches": 0.0}

    for i, (T, bs) in enumerate([(5, 16)] if ctx.quick else [(1, 64), (1000, 64), (333, 16)]):
        yield Case(f"T={T} page={bs} bf16 (slot -1 skipped)",
                   lambda a=(400 + i, T, bs): run(*a))
