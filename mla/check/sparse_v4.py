"""``python -m mla.check`` cases of DeepSeek-V4's conventions (conventions §14) on the fast
sparse kernels, beside the catalogue's: GPU shapes, each route forced.

- MODEL1 decode at DeepSeek-V4-like shapes (64 and 128 heads, top-k 512 and 2048, pages of
  64) with ragged lengths, per-head sinks (``+inf``, ``-inf``, finite) and a second scope of
  its own page size (1), on the Gluon sm_90 kernel (unsplit and split) and the Triton one
  forced; one request (splits, the sink applied after the combine); a second scope over the
  ``fp8_ds_mla`` cache too.
- Rows of 512 on a bf16 cache (decode with a second scope, prefill), with sinks, on the
  sm_90 kernel (unsplit and split) and the Triton one forced.
- The sink on DeepSeek-V3.2's shapes through each route: the Gluon sm_90 kernel unsplit (its
  epilogue) and split (the Triton combine), and the Triton kernel forced (``sm90=False``).
- A CUDA graph of the whole DeepSeek-V4 decode (MODEL1, second scope, sinks, lengths): no
  host sync without value checks, replays on new inputs against the reference.
- Without value checks (``validate=False``), on each route: a request whose ``topk_length``
  lies outside ``[0, topk]``, a query that uses a slot outside ``[-1, slots)``: exactly those
  queries are NaN (``mismatches``: the entries whose NaN-ness differs from that), the others
  within budget.

Cache rows no index names hold NaN (MODEL1: scale bytes 0xFF); outputs start as NaN.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch

import mla.fast as fast
from mla.check.registry import Case, Ctx, Metrics, gen, graph_replay_metrics
from mla.compare import max_abs_err, poisoned_alloc, rel_err
from mla.reference.fp8 import quantize_fp8_ds_mla
from mla.reference.fp8_model1 import fp8_model1_cache, quantize_fp8_model1
from mla.reference.sparse import sparse_mla_decode as ref_decode
from mla.reference.sparse import sparse_mla_prefill as ref_prefill

__all__ = ["v4_decode_cases", "v4_prefill_cases"]

SCALE = 192 ** -0.5


def _sink(g: torch.Generator, N: int, keys: int, device: torch.device) -> torch.Tensor:
    """Finite sinks near the lse of ``keys`` unit logits; head 0 ``+inf``, head 1 ``-inf``."""
    s = torch.randn(N, generator=g) * 1.5 + math.log(max(keys, 1))
    s[:2] = torch.tensor([math.inf, -math.inf])
    return s.float().to(device)


def _cache(g: torch.Generator, kind: str, n_slots: int, page: int, dtype: torch.dtype,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache of ``kind`` ("model1", "fp8", "bf16_576", "bf16_512") with 2/3 of its slots
    written (NaN elsewhere) and the written slots."""
    nb = -(-n_slots // page)
    n = nb * page
    used = torch.randperm(n, generator=g)[: (2 * n) // 3]
    if kind == "model1":
        rows = torch.full((n, 512), float("nan"))
        rows[used] = torch.randn(len(used), 512, generator=g)
        rows[used, 64:128] *= 1e-3
        pages = quantize_fp8_model1(rows.view(nb, page, 512)).to(device)
        return fp8_model1_cache(pages, page), used
    if kind == "fp8":
        flat = torch.full((n, 656), 0xFF, dtype=torch.uint8)
        flat[used] = quantize_fp8_ds_mla(torch.randn(len(used), 512, generator=g),
                                         torch.randn(len(used), 64, generator=g))
        return flat.view(nb, page, 656).to(device), used
    D = 576 if kind == "bf16_576" else 512
    flat = torch.full((n, D), float("nan"), dtype=dtype)
    flat[used] = torch.randn(len(used), D, generator=g).to(dtype)
    return flat.view(nb, page, D).to(device), used


def _pick(g: torch.Generator, shape: tuple[int, ...], used: torch.Tensor) -> torch.Tensor:
    idx = used[torch.randint(len(used), shape, generator=g)].to(torch.int32)
    idx[torch.rand(shape, generator=g) < 0.1] = -1
    return idx


@dataclasses.dataclass(frozen=True)
class V4Decode:
    kind: str  # the cache: "model1", "fp8" (fp8_ds_mla), "bf16_576", "bf16_512"
    B: int
    N: int
    topk: int
    lens: tuple[int, ...] | None = None
    extra_topk: int = 0  # a second scope of pages of 1 (0: none)
    extra_lens: tuple[int, ...] | None = None
    sink: bool = True
    plan: Any = None
    bad: bool = False  # validate=False with a bad length and a bad slot: those queries NaN


def _decode_case(ctx: Ctx, spec: V4Decode, salt: int) -> Metrics:
    g = gen(ctx, salt)
    dev, dt = ctx.device, ctx.dtype
    fp8 = spec.kind in ("model1", "fp8")
    D = 576 if spec.kind in ("fp8", "bf16_576") else 512
    cache, used = _cache(g, spec.kind, 20000 + 2 * spec.B * spec.topk, 64, dt, dev)
    q = torch.randn(spec.B, 1, spec.N, D, generator=g).to(dt).to(dev)
    idx = _pick(g, (spec.B, 1, spec.topk), used)
    if spec.B > 2:
        idx[2] = -1  # a lonely request
    lens = None if spec.lens is None else torch.tensor(spec.lens, dtype=torch.int32)
    v4: dict[str, torch.Tensor] = {}
    if spec.extra_topk:
        extra, used2 = _cache(g, spec.kind, 3000, 1, dt, dev)
        v4["extra_k_cache"] = extra
        v4["extra_indices_in_kvcache"] = _pick(g, (spec.B, 1, spec.extra_topk), used2).to(dev)
        if spec.extra_lens is not None:
            v4["extra_topk_length"] = torch.tensor(spec.extra_lens, dtype=torch.int32).to(dev)
    if spec.sink:
        v4["attn_sink"] = _sink(g, spec.N, spec.topk + spec.extra_topk, dev)
    nan_q = torch.zeros(spec.B, dtype=torch.bool)
    call_idx, call_lens = idx.clone(), lens
    if spec.bad:  # request 0: a slot past the cache; request 1: a length past topk
        call_idx[0, 0, 5] = cache.shape[0] * cache.shape[1]
        call_lens = (torch.full((spec.B,), spec.topk, dtype=torch.int32) if lens is None
                     else lens.clone())
        call_lens[1] = spec.topk + 1
        nan_q[:2] = True
    with poisoned_alloc():
        out, lse = fast.sparse_mla_decode(
            q, cache, call_idx.to(dev), SCALE, fp8, None if call_lens is None else
            call_lens.to(dev), 512, plan=spec.plan, validate=not spec.bad, **v4)
    ref_v4 = {k: (v.double() if k == "extra_k_cache" and not fp8 else v) for k, v in v4.items()}
    ref_lens = None if lens is None else lens.to(dev)
    r_out, r_lse = ref_decode(q.double(), cache if fp8 else cache.double(), idx.to(dev), SCALE,
                              fp8, ref_lens, 512, **ref_v4)
    keep = (~nan_q).to(dev)
    metrics = {"out_rel": rel_err(out[keep], r_out[keep]),
               "lse_abs": max_abs_err(lse[keep], r_lse[keep])}
    if spec.bad:
        want = nan_q.to(dev)[:, None, None, None].expand_as(out)
        metrics["mismatches"] = float((torch.isnan(out) != want).sum().item()
                                      + (torch.isnan(lse[~keep]) == 0).sum().item())
    return metrics


def _graph_case(ctx: Ctx) -> Metrics:
    """MODEL1 with a second scope, sinks and both lengths (the sm_90 route at 64 heads): no
    device-to-host sync with ``validate=False``, then captured in a CUDA graph and replayed on
    new q, indices and lengths, each replay against the reference."""
    g = gen(ctx, 790)
    B, N, topk, extra_topk, dev = 4, 64, 512, 64, ctx.device
    cache, used = _cache(g, "model1", 20000, 64, ctx.dtype, dev)
    extra, used2 = _cache(g, "model1", 600, 1, ctx.dtype, dev)
    sink = _sink(g, N, topk + extra_topk, dev)
    sets = []
    for i in range(3):
        q = torch.randn(B, 1, N, 512, generator=g).to(ctx.dtype)
        lens = torch.tensor([topk, 1 + 97 * i, 0, topk - 5 - i], dtype=torch.int32)
        lens2 = torch.tensor([extra_topk - i, 0, 7 + i, extra_topk], dtype=torch.int32)
        sets.append(tuple(t.to(dev) for t in (q, _pick(g, (B, 1, topk), used), lens,
                                              _pick(g, (B, 1, extra_topk), used2), lens2)))
    static = [t.clone() for t in sets[0]]

    def call(validate: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
        q, idx, lens, idx2, lens2 = static
        return fast.sparse_mla_decode(q, cache, idx, SCALE, True, lens, 512, attn_sink=sink,
                                      extra_k_cache=extra, extra_indices_in_kvcache=idx2,
                                      extra_topk_length=lens2, validate=validate)

    def metrics(x: tuple[torch.Tensor, ...], out: torch.Tensor, lse: torch.Tensor) -> Metrics:
        q, idx, lens, idx2, lens2 = x
        r_out, r_lse = ref_decode(q.double(), cache, idx, SCALE, True, lens, 512,
                                  attn_sink=sink, extra_k_cache=extra,
                                  extra_indices_in_kvcache=idx2, extra_topk_length=lens2)
        return {"out_rel": rel_err(out, r_out), "lse_abs": max_abs_err(lse, r_lse)}
    return graph_replay_metrics(static, sets, call, metrics)


def v4_decode_cases(ctx: Ctx) -> Iterator[Case]:
    """The fast sparse decode on DeepSeek-V4's inputs, and the sink on each sm_90 route."""
    Plan = fast.SparsePlan  # noqa: N806
    gluon_split = Plan(64, 64, 4, 8, 2)
    coupled = Plan(64, 64, 1, 8, 1, model1_kernel="staged")  # MODEL1's other Gluon kernel
    triton_64 = Plan(64, 64, 1, 8, 2, sm90=False)
    # the coupled kernel over rows in q's dtype (a plan's choice; the default is the
    # warp-specialized one), unsplit and split
    cp_bf16 = Plan(64, 64, 1, 8, 2, bf16_kernel="staged")
    cp_bf16_3 = Plan(64, 64, 3, 8, 2, bf16_kernel="staged")
    specs: list[tuple[str, V4Decode]]
    if ctx.quick:
        specs = [
            ("MODEL1 B=3 N=16 topk=70 lens, second scope, sinks",
             V4Decode("model1", 3, 16, 70, (70, 9, 0), 20, (20, 0, 5))),
            ("fp8_ds_mla B=4 N=16 topk=70 bad length and slot, validate=False",
             V4Decode("fp8", 4, 16, 70, sink=False, bad=True)),
        ]
        if ctx.device.type == "cuda":
            specs += [
                ("fp8_ds_mla B=3 N=64 topk=130 sinks (sm_90 epilogue)",
                 V4Decode("fp8", 3, 64, 130)),
                ("MODEL1 B=3 N=64 topk=130 lens, sinks (sm_90)",
                 V4Decode("model1", 3, 64, 130, (130, 1, 64))),
                ("MODEL1 B=4 N=64 topk=130 bad length and slot (sm_90), validate=False",
                 V4Decode("model1", 4, 64, 130, bad=True)),
                ("fp8_ds_mla B=4 N=64 topk=130 bad length and slot (sm_90), validate=False",
                 V4Decode("fp8", 4, 64, 130, bad=True)),
            ]
    else:
        specs = [
            ("MODEL1 B=8 N=64 topk=512 lens, second scope 128, sinks",
             V4Decode("model1", 8, 64, 512, (512, 1, 0, 300, 512, 65, 64, 511), 128,
                      (128, 0, 7, 128, 64, 1, 0, 100))),
            ("MODEL1 B=8 N=128 topk=2048, sinks (sm_90)", V4Decode("model1", 8, 128, 2048)),
            ("MODEL1 B=8 N=64 topk=512 lens, sinks (sm_90)",
             V4Decode("model1", 8, 64, 512, (512, 1, 0, 300, 512, 65, 64, 511))),
            ("MODEL1 B=2 N=128 topk=2048 lens, sinks, forced 4 splits (sm_90 + combine)",
             V4Decode("model1", 2, 128, 2048, (2048, 100), plan=gluon_split)),
            ("MODEL1 B=4 N=128 topk=2048 lens, second scope 128, sinks, the coupled kernel",
             V4Decode("model1", 4, 128, 2048, (2048, 100, 0, 1000), 128, (128, 0, 7, 64),
                      plan=coupled)),
            ("MODEL1 B=8 N=128 topk=2048 sinks, forced Triton",
             V4Decode("model1", 8, 128, 2048, plan=triton_64)),
            ("MODEL1 B=4 N=128 topk=2048 bad length and slot (sm_90), validate=False",
             V4Decode("model1", 4, 128, 2048, bad=True)),
            ("MODEL1 B=8 N=128 topk=2048 no sink, second scope 512",
             V4Decode("model1", 8, 128, 2048, extra_topk=512, sink=False)),
            ("MODEL1 B=8 N=64 topk=512 lens, second scope 128 lens, sinks, forced Triton",
             V4Decode("model1", 8, 64, 512, (512, 1, 0, 300, 512, 65, 64, 511), 128,
                      (128, 0, 7, 128, 64, 1, 0, 100), plan=triton_64)),
            ("fp8_ds_mla B=4 N=128 topk=2048 lens, second scope 128 lens, sinks (sm_90)",
             V4Decode("fp8", 4, 128, 2048, (2048, 1, 0, 999), 128, (0, 128, 5, 64))),
            ("fp8_ds_mla B=2 N=128 topk=2048, second scope 256, forced 4 splits (sm_90)",
             V4Decode("fp8", 2, 128, 2048, extra_topk=256, plan=gluon_split)),
            ("MODEL1 B=1 N=128 topk=2048 (splits), second scope 64, sinks",
             V4Decode("model1", 1, 128, 2048, extra_topk=64)),
            ("MODEL1 B=4 N=64 topk=512 bad length and slot, validate=False",
             V4Decode("model1", 4, 64, 512, extra_topk=32, bad=True)),
            ("bf16 rows of 512 B=4 N=64 topk=1000 second scope 100, sinks (sm_90)",
             V4Decode("bf16_512", 4, 64, 1000, (1000, 3, 0, 999), 100)),
            ("bf16 rows of 512 B=4 N=128 topk=1000 second scope 100, sinks, forced Triton",
             V4Decode("bf16_512", 4, 128, 1000, (1000, 3, 0, 999), 100, plan=triton_64)),
            ("fp8_ds_mla B=8 N=128 topk=2048 sinks (sm_90 epilogue)",
             V4Decode("fp8", 8, 128, 2048)),
            ("fp8_ds_mla B=2 N=128 topk=2048 sinks, forced 4 splits (sm_90 + combine)",
             V4Decode("fp8", 2, 128, 2048, (2048, 77), plan=gluon_split)),
            ("fp8_ds_mla B=8 N=128 topk=2048 sinks, forced Triton",
             V4Decode("fp8", 8, 128, 2048, plan=triton_64)),
            ("bf16 576 B=4 N=64 topk=777 sinks (sm_90 epilogue)",
             V4Decode("bf16_576", 4, 64, 777, (777, 1, 0, 500))),
            ("fp8_ds_mla B=4 N=128 topk=2048 bad length and slot (sm_90), validate=False",
             V4Decode("fp8", 4, 128, 2048, bad=True)),
            ("fp8_ds_mla B=4 N=128 topk=2048 bad length and slot (sm_90, 4 splits)",
             V4Decode("fp8", 4, 128, 2048, bad=True, plan=gluon_split)),
            ("fp8_ds_mla B=4 N=128 topk=2048 bad length and slot, forced Triton",
             V4Decode("fp8", 4, 128, 2048, bad=True, plan=triton_64)),
            ("bf16 576 B=4 N=64 topk=777 lens, second scope 100 lens, sinks, forced "
             f"{cp_bf16}", V4Decode("bf16_576", 4, 64, 777, (777, 1, 0, 500), 100,
                                    (100, 0, 7, 64), plan=cp_bf16)),
            (f"bf16 rows of 512 B=4 N=64 topk=1000 second scope 100, sinks, forced {cp_bf16_3}",
             V4Decode("bf16_512", 4, 64, 1000, (1000, 3, 0, 999), 100, plan=cp_bf16_3)),
            (f"bf16 576 B=4 N=128 topk=2048 bad length and slot, forced {cp_bf16}",
             V4Decode("bf16_576", 4, 128, 2048, bad=True, plan=cp_bf16)),
        ]
    for i, (name, spec) in enumerate(specs):
        yield Case(f"v4 {name}", lambda s=spec, i=i: _decode_case(ctx, s, 700 + i))
    if ctx.device.type == "cuda":
        yield Case("v4 MODEL1 + second scope + sinks: cuda graph capture + replay, no sync",
                   lambda: _graph_case(ctx))


def _prefill_case(ctx: Ctx, D: int, s_q: int, N: int, topk: int, s_kv: int, plan: Any,
                  bad: bool, salt: int) -> Metrics:
    g = gen(ctx, salt)
    dev, dt = ctx.device, ctx.dtype
    q = torch.randn(s_q, N, D, generator=g).to(dt).to(dev)
    kv = torch.randn(s_kv, D, generator=g).to(dt).to(dev)
    idx = torch.randint(-1, s_kv + 10, (s_q, topk), generator=g, dtype=torch.int32)
    idx[1] = -1  # a lonely query
    lens = torch.randint(0, topk + 1, (s_q,), generator=g, dtype=torch.int32)
    sink = _sink(g, N, topk, dev)
    call_lens = lens.clone()
    nan_q = torch.zeros(s_q, dtype=torch.bool)
    if bad:
        call_lens[0], call_lens[2] = topk + 3, -1
        nan_q[[0, 2]] = True
    with poisoned_alloc():
        got = fast.sparse_mla_prefill(q, kv, idx.to(dev), SCALE, 512, call_lens.to(dev),
                                      attn_sink=sink, plan=plan, validate=not bad)
    ref = ref_prefill(q.double(), kv.double(), idx.to(dev), SCALE, 512, lens.to(dev),
                      attn_sink=sink)
    keep = (~nan_q).to(dev)
    metrics = {"out_rel": rel_err(got[0][keep], ref[0][keep]),
               "max_abs": max_abs_err(got[1][keep], ref[1][keep]),
               "lse_abs": max_abs_err(got[2][keep], ref[2][keep])}
    if bad:
        metrics["mismatches"] = float(sum((torch.isnan(t[~keep]) == 0).sum().item()
                                          for t in got))
    return metrics


def v4_prefill_cases(ctx: Ctx) -> Iterator[Case]:
    """The fast sparse prefill with sinks (each route) and rows of 512."""
    Plan = fast.SparsePlan  # noqa: N806
    cp = Plan(64, 64, 1, 8, 2, bf16_kernel="staged")
    cp3 = Plan(64, 64, 3, 8, 2, bf16_kernel="staged")
    ss = Plan(64, 64, 1, 8, 2, bf16_kernel="seesaw_producer")
    ss3 = Plan(64, 64, 3, 8, 2, bf16_kernel="seesaw_producer")
    if ctx.quick:
        shapes = [("576 s_q=5 N=16 topk=70 s_kv=200", 576, 5, 16, 70, 200, None, False),
                  ("576 s_q=5 N=16 topk=70 bad lengths", 576, 5, 16, 70, 200, None, True)]
        if ctx.device.type == "cuda":
            shapes += [("576 s_q=5 N=64 topk=65 s_kv=90 (sm_90)", 576, 5, 64, 65, 90, None,
                        False),
                       ("576 s_q=5 N=64 topk=65 bad lengths (sm_90)", 576, 5, 64, 65, 90, None,
                        True)]
    else:
        shapes = [
            ("576 s_q=256 N=128 topk=2048 s_kv=8192 (sm_90)", 576, 256, 128, 2048, 8192, None,
             False),
            ("576 s_q=4 N=128 topk=2048 s_kv=8192 (sm_90, splits + combine)", 576, 4, 128,
             2048, 8192, None, False),
            ("576 s_q=256 N=128 topk=2048 s_kv=8192 forced Triton", 576, 256, 128, 2048, 8192,
             Plan(64, 64, 1, 8, 2, sm90=False), False),
            ("512 s_q=256 N=64 topk=512 s_kv=4096 (sm_90)", 512, 256, 64, 512, 4096, None,
             False),
            ("512 s_q=64 N=128 topk=512 s_kv=4096 (sm_90, splits + combine)", 512, 64, 128,
             512, 4096, Plan(64, 64, 3, 8, 2), False),
            ("512 s_q=256 N=64 topk=512 s_kv=4096 forced Triton", 512, 256, 64, 512, 4096,
             Plan(64, 64, 1, 8, 2, sm90=False), False),
            ("576 s_q=64 N=128 topk=2048 bad lengths (sm_90)", 576, 64, 128, 2048, 8192, None,
             True),
            ("512 s_q=64 N=64 topk=512 bad lengths (sm_90)", 512, 64, 64, 512, 4096, None,
             True),
            # the coupled kernel over rows in q's dtype (a plan's choice)
            ("576 s_q=256 N=128 topk=2048 s_kv=8192 forced coupled bf16 (sm_90)", 576,
             256, 128, 2048, 8192, cp, False),
            ("512 s_q=256 N=64 topk=512 s_kv=4096 forced coupled bf16 (sm_90)", 512,
             256, 64, 512, 4096, cp, False),
            ("512 s_q=64 N=128 topk=512 s_kv=4096 forced coupled bf16 (sm_90, 3 "
             "splits + combine)", 512, 64, 128, 512, 4096, cp3, False),
            ("576 s_q=64 N=128 topk=2048 bad lengths forced coupled bf16 (sm_90)", 576,
             64, 128, 2048, 8192, cp, True),
            # the seesaw kernel (the default's kernel, forced unsplit and split)
            ("576 s_q=256 N=128 topk=2048 s_kv=8192 forced seesaw (sm_90)", 576, 256, 128,
             2048, 8192, ss, False),
            ("512 s_q=256 N=64 topk=512 s_kv=4096 forced seesaw (sm_90)", 512, 256, 64, 512,
             4096, ss, False),
            ("576 s_q=64 N=128 topk=2048 bad lengths forced seesaw (sm_90)", 576, 64, 128,
             2048, 8192, ss, True),
            ("512 s_q=64 N=128 topk=512 s_kv=4096 forced seesaw (sm_90, 3 splits + combine)",
             512, 64, 128, 512, 4096, ss3, False),
        ]
    for i, (name, *args) in enumerate(shapes):
        yield Case(f"v4 sinks {name}", lambda a=args, i=i: _prefill_case(ctx, *a, 760 + i))
