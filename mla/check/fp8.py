"""``python -m mla.check`` cases for ``mla.fast.concat_and_cache_fp8_ds_mla``: every byte of
the ``fp8_ds_mla`` cache as the reference's (rows of magnitudes 1e-6 to 1e3, an all-zero tile,
padding slots)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

import mla.fast as fast
from mla.check.paged_cache import bit_mismatches
from mla.check.registry import Case, Ctx, Metrics, gen, register
from mla.reference.fp8 import concat_and_cache_fp8_ds_mla as ref_fp8_write

__all__ = ["fp8_cache_cases"]


def _write(ctx: Ctx, salt: int, T: int, bs: int) -> Metrics:
    g = gen(ctx, salt)
    nb = -(-T // bs) + 2
    mags = torch.logspace(-6, 3, T)[:, None]
    kv_c = torch.randn(T, 512, generator=g) * mags
    kv_c[0, :128] = 0.0
    kv_c = kv_c.to(torch.bfloat16)
    k_pe = torch.randn(T, 64, generator=g).to(torch.bfloat16)
    slots = torch.randperm(nb * bs, generator=g)[:T].to(torch.int32)
    slots[::7] = -1
    cache = torch.randint(0, 256, (nb, bs, 656), generator=g, dtype=torch.uint8)
    fast_cache = cache.clone().to(ctx.device)  # on the CPU .to() alone would alias cache
    fast.concat_and_cache_fp8_ds_mla(kv_c.to(ctx.device), k_pe.to(ctx.device), fast_cache,
                                     slots.to(ctx.device))
    ref_fp8_write(kv_c, k_pe, cache, slots)
    return {"mismatches": bit_mismatches(fast_cache, cache)}


@register("concat_and_cache_fp8_ds_mla", "concat_and_cache_fp8_ds_mla")
def fp8_cache_cases(ctx: Ctx) -> Iterator[Case]:
    for i, (T, bs) in enumerate([(5, 16)] if ctx.quick else [(1, 64), (1000, 64), (333, 16)]):
        yield Case(f"T={T} page={bs} bf16 (slot -1 skipped)",
                   lambda a=(400 + i, T, bs): _write(ctx, *a), torch.bfloat16)
