"""``python -m mla.check`` cases for the paged cache kernels ``mla.fast.concat_and_cache_mla``
and ``mla.fast.gather_cache``: the cache (or the gathered rows) bit for bit as the
reference's, padding slots (-1) skipped, rows past a request's range untouched."""

from __future__ import annotations

from collections.abc import Iterator

import torch

import mla.fast as fast
from mla.check.registry import Case, Ctx, Metrics, gen, register
from mla.reference.paged_cache import concat_and_cache_mla as ref_concat
from mla.reference.paged_cache import gather_cache as ref_gather
from mla.reference.paged_cache import make_block_table

__all__ = ["concat_cases", "gather_cases", "bit_mismatches"]


def bit_mismatches(got: torch.Tensor, want: torch.Tensor) -> float:
    """How many elements differ bit for bit (NaN patterns included); inf on a shape or dtype
    mismatch."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return float("inf")
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
    return float((got.cpu().contiguous().view(ints) != want.cpu().contiguous().view(ints)).sum())


def _concat(ctx: Ctx, T: int, bs: int, salt: int) -> Metrics:
    g = gen(ctx, salt)
    nb = -(-T // bs) + 2
    slots = torch.randperm(nb * bs, generator=g)[:T].to(torch.int32)
    slots[::7] = -1  # padding tokens
    kv_c = torch.randn(T, 512, generator=g).to(ctx.dtype)
    k_pe = torch.randn(T, 64, generator=g).to(ctx.dtype)
    cache = torch.randn(nb, bs, 576, generator=g).to(ctx.dtype)
    fast_cache = cache.clone().to(ctx.device)  # on the CPU .to() alone would alias cache
    fast.concat_and_cache_mla(kv_c.to(ctx.device), k_pe.to(ctx.device), fast_cache,
                              slots.to(ctx.device))
    ref_concat(kv_c, k_pe, cache, slots)
    return {"mismatches": bit_mismatches(fast_cache, cache)}


@register("concat_and_cache_mla", "concat_and_cache_mla")
def concat_cases(ctx: Ctx) -> Iterator[Case]:
    for i, (T, bs) in enumerate([(5, 16)] if ctx.quick else [(1, 64), (1000, 64), (333, 16)]):
        yield Case(f"T={T} page={bs} (slot -1 skipped)",
                   lambda T=T, bs=bs, i=i: _concat(ctx, T, bs, 60 + i))


def _gather(ctx: Ctx, lens: list[int], starts: list[int], bs: int, salt: int) -> Metrics:
    g = gen(ctx, salt)
    bt, nb = make_block_table([s + n for s, n in zip(starts, lens)], bs, seed=salt)
    cache = torch.randn(nb, bs, 576, generator=g).to(ctx.dtype)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    st = torch.tensor(starts, dtype=torch.int32)
    dst = torch.full((sum(lens) + 3, 576), float("nan"), dtype=ctx.dtype)
    expect = ref_gather(cache, dst.clone(), bt, cu, len(lens), st)
    got = fast.gather_cache(cache.to(ctx.device), dst.to(ctx.device), bt.to(ctx.device),
                            cu.to(ctx.device), len(lens), st.to(ctx.device))
    return {"mismatches": bit_mismatches(got, expect)}


@register("gather_cache", "gather_cache")
def gather_cases(ctx: Ctx) -> Iterator[Case]:
    cases = [([3, 0, 17], [0, 5, 1], 16)] if ctx.quick else [
        ([1000, 0, 1, 65], [0, 7, 0, 63], 64), ([300, 129], [16, 0], 16)]
    for i, (lens, starts, bs) in enumerate(cases):
        yield Case(f"lens={lens} starts={starts} page={bs}",
                   lambda a=(lens, starts, bs, 70 + i): _gather(ctx, *a))
