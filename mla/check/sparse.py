"""``python -m mla.check`` cases for the fast sparse kernels ``mla.fast.sparse_mla_decode`` and
``mla.fast.sparse_mla_prefill``: DeepSeek-V4's (``mla.check.sparse_v4``), the conformance
catalogue's cases, then these (the index conversion's check is the catalogue's alone).

DeepSeek-V3.2 shapes on a GPU (rows of 576, V 512, top-k 2048, 16 and 128 heads, bf16 q and
cache or the ``fp8_ds_mla`` cache), small ones with ``quick`` (the interpreter, the sanitizer).
Every case has invalid entries (``-1``; ``>= s_kv`` and other negatives in prefill), repeated
indices and a lonely query (all entries invalid: ``out = 0``, ``lse = +inf``); cache rows no
index names hold NaN (fp8: 0xFF bytes), and outputs and split partials the fast path allocates
start as NaN. The reference runs in float64 on upcast copies on the same device (the fp8 cache
is dequantized by the reference itself).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

import mla.fast as fast
from mla.check.catalogue import catalogue_cases
from mla.check.registry import Case, Ctx, Metrics, gen, graph_replay_metrics, register
from mla.check.sparse_v4 import v4_decode_cases, v4_prefill_cases
from mla.compare import max_abs_err, poisoned_alloc, rel_err
from mla.reference.fp8 import FP8_DS_MLA_BYTES, quantize_fp8_ds_mla
from mla.reference.sparse import sparse_mla_decode as ref_decode
from mla.reference.sparse import sparse_mla_prefill as ref_prefill

__all__ = ["decode_cases", "prefill_cases", "decode_inputs"]

D, DV = 576, 512
SCALE = 192 ** -0.5  # DeepSeek: 1 / sqrt(qk_nope + qk_rope)


def _pick(g: torch.Generator, shape: tuple[int, ...], used: torch.Tensor,
          invalid: tuple[int, ...]) -> torch.Tensor:
    """Indices drawn from ``used`` (with repeats), about a tenth replaced by ``invalid``."""
    idx = used[torch.randint(len(used), shape, generator=g)].to(torch.int32)
    bad = torch.rand(shape, generator=g) < 0.1
    vals = torch.tensor(invalid, dtype=torch.int32)[torch.randint(len(invalid), shape,
                                                                  generator=g)]
    return torch.where(bad, vals, idx)


def decode_inputs(g: torch.Generator, B: int, s_q: int, N: int, topk: int, n_slots: int,
                  fp8: bool, dtype: torch.dtype, device: torch.device, page: int = 64,
                  logit_scale: float = 1.0):
    """q, a cache of ``n_slots`` rows (2/3 of them written, NaN elsewhere), indices with -1s,
    the last query of request 0 lonely (unless it is the only query)."""
    nb = -(-n_slots // page)
    used = torch.randperm(nb * page, generator=g)[: (2 * nb * page) // 3]
    q = (torch.randn(B, s_q, N, D, generator=g) * logit_scale).to(dtype)
    if fp8:
        flat = torch.full((nb * page, FP8_DS_MLA_BYTES), 0xFF, dtype=torch.uint8)
        kv_c = torch.randn(len(used), 512, generator=g)
        kv_c[:, 256:384] *= 1e-3  # one tile of another scale
        flat[used] = quantize_fp8_ds_mla(kv_c, torch.randn(len(used), 64, generator=g))
    else:
        flat = torch.full((nb * page, D), float("nan"), dtype=dtype)
        flat[used] = torch.randn(len(used), D, generator=g).to(dtype)
    idx = _pick(g, (B, s_q, topk), used, (-1,))
    if B * s_q > 1:
        idx[0, -1] = -1
    return (q.to(device), flat.view(nb, page, -1).to(device), idx.to(device))


def _decode_metrics(q, cache, idx, fp8, topk_length, out, lse) -> Metrics:
    r_out, r_lse = ref_decode(q.double(), cache if fp8 else cache.double(), idx, SCALE, fp8,
                       topk_length)
    ok = (out.shape == r_out.shape and lse.shape == r_lse.shape and out.dtype == q.dtype
          and lse.dtype == torch.float32)
    inf = float("inf")
    return {"out_rel": rel_err(out, r_out) if ok else inf,
            "lse_abs": max_abs_err(lse, r_lse) if ok else inf}


def _graph_case(ctx: Ctx) -> Metrics:
    """fp8 cache, 16 heads: one call captured in a CUDA graph (validation skipped while
    capturing), replayed on new q, indices and lengths; also no device-to-host sync with
    ``validate=False`` (``torch.cuda.set_sync_debug_mode('error')``)."""
    B, s_q, N, topk, n_slots = 4, 2, 16, 2048, 20000
    sets = []
    for i in range(3):
        g = gen(ctx, 600 + i)
        q, cache, idx = decode_inputs(g, B, s_q, N, topk, n_slots, True, ctx.dtype, ctx.device)
        lens = torch.tensor([topk, 1 + 97 * i, 0, topk - 5 - i], dtype=torch.int32,
                            device=ctx.device)
        sets.append((q, cache, idx, lens))
    static = [t.clone() for t in sets[0]]
    return graph_replay_metrics(
        static, sets,
        lambda validate: fast.sparse_mla_decode(static[0], static[1], static[2], SCALE, True,
                                                static[3], validate=validate),
        lambda x, out, lse: _decode_metrics(x[0], x[1], x[2], True, x[3], out, lse))


@register("sparse_mla_decode", "sparse_mla_decode")
def decode_cases(ctx: Ctx) -> Iterator[Case]:
    """``mla.fast.sparse_mla_decode``: bf16 and fp8_ds_mla caches, 16/128 heads, top-k 2048 and
    ragged ``topk_length``, all-invalid requests, forced splits, a CUDA graph."""
    yield from v4_decode_cases(ctx)  # first: the newest paths, and every sm_90 route forced
    yield from catalogue_cases(ctx, "sparse_mla_decode")

    def run(salt: int, B: int, s_q: int, N: int, topk: int, n_slots: int, fp8: bool,
            lens: list[int] | None = None, plan: Any = None, dtype: torch.dtype | None = None,
            all_invalid: int | None = None, logit_scale: float = 1.0,
            padded: bool = False) -> Metrics:
        dt = dtype or ctx.dtype
        q, cache, idx = decode_inputs(gen(ctx, salt), B, s_q, N, topk, n_slots, fp8, dt,
                                      ctx.device, logit_scale=logit_scale)
        if padded:  # FlashMLA's quantize_k_cache form: [nb, bs + 1, 656] sliced to bs
            alloc = torch.full((cache.shape[0], cache.shape[1] + 1, cache.shape[2]), 0xFF,
                               dtype=cache.dtype, device=cache.device)
            alloc[:, :-1] = cache
            cache = alloc[:, :-1]
        if all_invalid is not None:
            idx[all_invalid] = -1
        tl_ = None if lens is None else torch.tensor(lens, dtype=torch.int32, device=ctx.device)
        with poisoned_alloc():
            out, lse = fast.sparse_mla_decode(q, cache, idx, SCALE, fp8, tl_, plan=plan)
        return _decode_metrics(q, cache, idx, fp8, tl_, out, lse)

    def case(name: str, *args: Any, **kw: Any) -> Case:
        return Case(name, lambda: run(*args, **kw), kw.get("dtype"))

    SparsePlan = fast.SparsePlan  # noqa: N806

    if ctx.quick:
        yield case("fp8 B=2 s_q=2 N=2 topk=70 lens 70,29", 500, 2, 2, 2, 70, 300, True,
                   [70, 29])
        yield case("latent cache B=3 N=16 topk=100 split=3", 501, 3, 1, 16, 100, 400, False,
                   plan=SparsePlan(16, 64, 3, 4, 1), all_invalid=1)
        yield case("latent cache B=2 N=16 topk=100 logits x30", 504, 2, 1, 16, 100, 400, False,
                   logit_scale=30.0)
        if ctx.device.type == "cuda":  # the sm_90 kernel's fp8 and bf16 paths
            yield case("fp8 B=2 N=128 topk=2048", 502, 2, 1, 128, 2048, 5000, True)
            yield case("bf16 cache B=2 s_q=2 N=64 topk=130 lens 130,1", 503, 2, 2, 64, 130,
                       3000, False, [130, 1])
        return
    for i, (fp8, N) in enumerate([(False, 16), (False, 128), (True, 16), (True, 128)]):
        kind = "fp8" if fp8 else "bf16"
        yield case(f"{kind} cache B=8 s_q=1 N={N} topk=2048 (request 3 all -1)", 510 + i, 8, 1,
                   N, 2048, 40000, fp8, all_invalid=3)
        yield case(f"{kind} cache B=4 s_q=2 N={N} topk=2048 lens 2048,1,0,1000",
                   520 + i, 4, 2, N, 2048, 30000, fp8, [2048, 1, 0, 1000])
    yield case("fp8 cache B=5 N=128 topk=1000 (not a tile multiple)", 530, 5, 1, 128, 1000,
               20000, True)
    yield case("fp8 cache B=1 N=128 topk=2048 (many splits)", 531, 1, 1, 128, 2048, 50000,
               True)
    yield case("bf16 cache B=2 s_q=4 N=64 topk=577", 532, 2, 4, 64, 577, 9000, False)
    yield case("fp8 cache B=4 N=16 topk=2048 logits x30", 533, 4, 1, 16, 2048, 20000, True,
               logit_scale=30.0)
    yield case("fp8 cache B=3 N=96 topk=130 (half-empty head group)", 536, 3, 1, 96, 130,
               4000, True)
    yield case("float16 fp8 cache B=3 N=128 topk=2048", 534, 3, 1, 128, 2048, 20000, True,
               dtype=torch.float16)
    yield case("float32 cache B=2 N=16 topk=300", 535, 2, 1, 16, 300, 5000, False,
               dtype=torch.float32)
    for j, plan in enumerate([SparsePlan(64, 64, 3, 8, 2), SparsePlan(64, 32, 1, 8, 3),
                              SparsePlan(16, 64, 5, 4, 2)]):
        yield case(f"fp8 cache B=3 N=128 topk=2048 lens 2048,7,1500 forced {plan}", 540 + j,
                   3, 1, 128, 2048, 20000, True, [2048, 7, 1500], plan)
    # the batch-invariant plans' fixed-length runs (mla.fast.sparse.plan): the Gluon kernel,
    # a cap of 2 runs stretching them, and the Triton kernel
    for j, plan in enumerate([SparsePlan(64, 64, 16, 8, 2, split_entries=512),
                              SparsePlan(64, 64, 2, 8, 2, split_entries=256),
                              SparsePlan(64, 64, 16, 8, 2, sm90=False, split_entries=512)]):
        yield case(f"fp8 cache B=3 N=128 topk=2048 lens 2048,7,1500 batch-invariant {plan}",
                   550 + j, 3, 1, 128, 2048, 20000, True, [2048, 7, 1500], plan)
    yield case("fp8 block-padded cache [nb, 65, 656] B=4 N=128 topk=2048 lens 2048,7,0,900",
               545, 4, 1, 128, 2048, 20000, True, [2048, 7, 0, 900], padded=True)
    yield case("fp8 block-padded cache B=3 N=128 topk=2048 forced Triton", 546, 3, 1, 128,
               2048, 20000, True, plan=SparsePlan(64, 64, 3, 8, 2, sm90=False), padded=True)
    # the coupled fp8_ds_mla kernel (a plan's choice; the default is the warp-specialized
    # one): unsplit at 128 heads, 3 splits, and over the block-padded cache
    coupled = SparsePlan(64, 64, 1, 8, 2, ds_mla_kernel="staged")
    yield case(f"fp8 cache B=3 N=128 topk=2048 lens 2048,7,1500 forced {coupled}", 547, 3, 1, 128,
               2048, 20000, True, [2048, 7, 1500], coupled)
    coupled3 = SparsePlan(64, 64, 3, 8, 2, ds_mla_kernel="staged")
    yield case(f"fp8 block-padded cache B=4 N=64 topk=2048 lens 2048,7,0,900 forced {coupled3}",
               548, 4, 1, 64, 2048, 20000, True, [2048, 7, 0, 900], coupled3, padded=True)
    # the coupled kernel over a bf16 cache (a plan's choice; the default is the
    # warp-specialized one): unsplit at 128 heads (a lonely request), 3 splits at 64 heads,
    # fixed-length batch-invariant splits
    cp = SparsePlan(64, 64, 1, 8, 2, bf16_kernel="staged")
    yield case(f"bf16 cache B=3 N=128 topk=2048 lens 2048,7,1500 (request 1 all -1) forced {cp}",
               583, 3, 1, 128, 2048, 20000, False, [2048, 7, 1500], cp, all_invalid=1)
    cp3 = SparsePlan(64, 64, 3, 8, 2, bf16_kernel="staged")
    yield case(f"bf16 cache B=4 N=64 topk=2047 lens 2047,7,0,900 forced {cp3}", 584, 4, 1, 64,
               2047, 20000, False, [2047, 7, 0, 900], cp3)
    cp_bi = SparsePlan(64, 64, 16, 8, 2, split_entries=512, bf16_kernel="staged")
    yield case(f"bf16 cache B=3 N=128 topk=2048 lens 2048,7,1500 batch-invariant {cp_bi}", 585,
               3, 1, 128, 2048, 20000, False, [2048, 7, 1500], cp_bi)
    # the seesaw kernel over a bf16 cache (a plan's choice): the same three plans
    seesaw = "seesaw_producer"
    for j, (lens_case, plan) in enumerate((
            ((583, 3, 128, 2048, [2048, 7, 1500], 1), SparsePlan(64, 64, 1, 8, 2,
                                                              bf16_kernel=seesaw)),
            ((584, 4, 64, 2047, [2047, 7, 0, 900], None), SparsePlan(64, 64, 3, 8, 2,
                                                                  bf16_kernel=seesaw)),
            ((585, 3, 128, 2048, [2048, 7, 1500], None),
             SparsePlan(64, 64, 16, 8, 2, split_entries=512, bf16_kernel=seesaw)))):
        _, B, N, topk, lens, empty = lens_case
        extra = {} if empty is None else {"all_invalid": empty}
        yield case(f"bf16 cache B={B} N={N} topk={topk} lens {','.join(map(str, lens))} "
                   f"forced {plan}", 590 + j, B, 1, N, topk, 20000, False, lens, plan, **extra)
    if ctx.device.type == "cuda":
        yield Case("fp8 cuda graph capture + replay, no sync", lambda: _graph_case(ctx))


@register("sparse_mla_prefill", "sparse_mla_prefill")
def prefill_cases(ctx: Ctx) -> Iterator[Case]:
    """``mla.fast.sparse_mla_prefill``: 16/64/128 heads, top-k 2048 and ragged lengths,
    indices ``-1``, ``< -1`` and ``>= s_kv``, a lonely query, few queries (splits)."""
    yield from v4_prefill_cases(ctx)  # first: the newest paths, and every sm_90 route forced
    yield from catalogue_cases(ctx, "sparse_mla_prefill")

    def run(salt: int, s_q: int, N: int, topk: int, s_kv: int, with_lens: bool = False,
            plan: Any = None, logit_scale: float = 1.0) -> Metrics:
        g = gen(ctx, salt)
        dt, dev = ctx.dtype, ctx.device
        q = (torch.randn(s_q, N, D, generator=g) * logit_scale).to(dt).to(dev)
        kv = torch.full((s_kv, D), float("nan"), dtype=dt)
        used = torch.randperm(s_kv, generator=g)[: (3 * s_kv) // 4]
        kv[used] = torch.randn(len(used), D, generator=g).to(dt)
        kv = kv.to(dev)
        idx = _pick(g, (s_q, topk), used, (-1, -3, s_kv, s_kv + 100))
        if s_q > 1:
            idx[1] = -1
        idx = idx.to(dev)
        lens = None
        if with_lens:
            lens = torch.randint(0, topk + 1, (s_q,), generator=g, dtype=torch.int32)
            lens[0] = topk
            lens = lens.to(dev)
        with poisoned_alloc():
            out, max_logits, lse = fast.sparse_mla_prefill(q, kv, idx, SCALE, DV, lens,
                                                           plan=plan)
        r_out, r_max, r_lse = ref_prefill(q.double(), kv.double(), idx, SCALE, DV, lens)
        ok = (out.shape == r_out.shape and lse.shape == r_lse.shape
              and max_logits.shape == r_max.shape and out.dtype == dt
              and lse.dtype == torch.float32 and max_logits.dtype == torch.float32)
        inf = float("inf")
        return ({"out_rel": rel_err(out, r_out) if ok else inf,
                 "lse_abs": max_abs_err(lse, r_lse) if ok else inf,
                 "max_abs": max_abs_err(max_logits, r_max) if ok else inf})

    def case(name: str, *args: Any, **kw: Any) -> Case:
        return Case(name, lambda: run(*args, **kw))

    SparsePlan = fast.SparsePlan  # noqa: N806

    if ctx.quick:
        yield case("s_q=5 N=4 topk=70 s_kv=200 lens", 560, 5, 4, 70, 200, True)
        yield case("s_q=3 N=16 topk=100 s_kv=300 split=2", 561, 3, 16, 100, 300,
                   plan=SparsePlan(16, 64, 2, 4, 1))
        yield case("s_q=4 N=16 topk=70 s_kv=200 logits x30", 563, 4, 16, 70, 200,
                   logit_scale=30.0)
        if ctx.device.type == "cuda":  # the sm_90 kernel
            yield case("s_q=5 N=64 topk=65 s_kv=90 lens", 562, 5, 64, 65, 90, True)
        return
    yield case("s_q=300 N=128 topk=2048 s_kv=5000", 570, 300, 128, 2048, 5000)
    yield case("s_q=257 N=64 topk=2048 s_kv=3000 ragged lens", 571, 257, 64, 2048, 3000, True)
    yield case("s_q=100 N=16 topk=1000 s_kv=70000", 572, 100, 16, 1000, 70000)
    yield case("s_q=2 N=128 topk=2048 s_kv=4096 (splits)", 573, 2, 128, 2048, 4096, True)
    yield case("s_q=64 N=128 topk=2048 s_kv=2048 forced split=4", 574, 64, 128, 2048, 2048,
               plan=SparsePlan(64, 64, 4, 8, 2))
    yield case("s_q=33 N=128 topk=64 s_kv=50 (more picks than rows)", 575, 33, 128, 64, 50)
    yield case("s_q=7 N=128 topk=1 s_kv=10 (one pick)", 576, 7, 128, 1, 10)
    yield case("s_q=64 N=128 topk=2048 s_kv=4096 logits x30", 577, 64, 128, 2048, 4096,
               logit_scale=30.0)
    # the shapes a plan naming a Gluon kernel over rows in q's dtype is forced through: top-k
    # off the tile grid, ragged lengths, indices -1, -3, >= s_kv, a lonely query; 128 heads,
    # 64 heads (unsplit or in 3 splits), one pick, logits x30
    shapes = {"ragged": ("s_q=300 N=128 topk=2047 s_kv=5000 ragged lens", 300, 128, 2047, 5000,
                         True),
              "64 heads": ("s_q=257 N=64 topk=1000 s_kv=3000 ragged lens", 257, 64, 1000, 3000,
                           True),
              "one pick": ("s_q=7 N=128 topk=1 s_kv=10 (one pick)", 7, 128, 1, 10, False),
              "x30": ("s_q=64 N=128 topk=2048 s_kv=4096 logits x30", 64, 128, 2048, 4096,
                      False)}

    def forced(shape: str, salt: int, plan: Any) -> Case:
        name, *args = shapes[shape]
        return case(f"{name} forced {plan}", salt, *args, plan,
                    logit_scale=30.0 if shape == "x30" else 1.0)

    # the coupled kernel (a plan's choice; the default is the warp-specialized one)
    cp = SparsePlan(64, 64, 1, 8, 2, bf16_kernel="staged")
    cp3 = SparsePlan(64, 64, 3, 8, 2, bf16_kernel="staged")
    yield forced("ragged", 580, cp)
    yield forced("64 heads", 581, cp3)
    yield forced("one pick", 582, cp)
    # the seesaw kernel (the default's kernel), unsplit and in 3 splits
    ss = SparsePlan(64, 64, 1, 8, 2, bf16_kernel="seesaw_producer")
    ss3 = SparsePlan(64, 64, 3, 8, 2, bf16_kernel="seesaw_producer")
    yield forced("ragged", 586, ss)
    yield forced("64 heads", 587, ss)
    yield forced("one pick", 588, ss)
    yield forced("x30", 589, ss)
    yield forced("64 heads", 593, ss3)
