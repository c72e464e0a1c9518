"""``python -m mla.check`` cases for ``mla.fast.mla_decode_paged`` (the paged absorbed decode).

The conformance catalogue's decode cases first (shapes, heads, pages, lengths, the causal
rule, empty queries, NaN where nothing may be read, the scale, sharp softmaxes), then what
only our kernel has: forced plans (splits, TMA or not), the sm_90 route's tile edges,
float16/float32 inputs, a small latent, and on CUDA one call captured in a CUDA graph and
replayed on new inputs without a device-to-host sync.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

import mla.fast as fast
from mla.check.catalogue import catalogue_cases
from mla.check.registry import Case, Ctx, Metrics, gen, graph_replay_metrics, register
from mla.compare import max_abs_err, poisoned_alloc, rel_err
from mla.reference.decode import mla_decode_paged as ref_decode
from mla.reference.paged_cache import make_block_table

__all__ = ["decode_cases", "paged_decode_inputs"]


def paged_decode_inputs(lens: list[int], s_q: int, N: int, D: int, block_size: int,
                        dtype: torch.dtype, device: torch.device, g: torch.Generator,
                        spare_blocks: int = 2
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q and cache (scattered pages); unused cache rows hold NaN."""
    bt, nb = make_block_table([max(n, 1) for n in lens], block_size, spare_blocks=spare_blocks,
                              seed=int(torch.randint(1 << 30, (1,), generator=g)))
    kv = torch.full((nb * block_size, D), float("nan"), dtype=dtype)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        rows = bt[b].long()[pos // block_size] * block_size + pos % block_size
        kv[rows] = torch.randn(n, D, generator=g).to(dtype)
    q = torch.randn(len(lens), s_q, N, D, generator=g).to(dtype)
    sl = torch.tensor(lens, dtype=torch.int32)
    return (q.to(device), kv.view(nb, block_size, D).to(device), bt.to(device), sl.to(device))


def decode_metrics(q: torch.Tensor, kv: torch.Tensor, bt: torch.Tensor, sl: torch.Tensor,
                   scale: float, causal: bool, dv: int, out: torch.Tensor,
                   lse: torch.Tensor) -> Metrics:
    """``out_rel`` and ``lse_abs`` against the float64 reference (infinite on a wrong shape or
    dtype)."""
    ref_out, ref_lse = ref_decode(q.double(), kv.double(), bt, sl, scale, causal, dv)
    ok = (out.shape == ref_out.shape and lse.shape == ref_lse.shape
          and out.dtype == q.dtype and lse.dtype == torch.float32)
    return {"out_rel": rel_err(out, ref_out) if ok else math.inf,
            "lse_abs": max_abs_err(lse, ref_lse) if ok else math.inf}


def _case(ctx: Ctx, salt: int, lens: list[int], s_q: int, N: int, causal: bool,
          block_size: int = 64, D: int = 576, dv: int = 512, plan: fast.DecodePlan | None = None,
          dtype: torch.dtype | None = None, logit_scale: float = 1.0) -> Callable[[], Metrics]:
    def run() -> Metrics:
        q, kv, bt, sl = paged_decode_inputs(lens, s_q, N, D, block_size, dtype or ctx.dtype,
                                            ctx.device, gen(ctx, salt))
        scale = logit_scale * (192 if D == 576 else D) ** -0.5
        with poisoned_alloc():
            out, lse = fast.mla_decode_paged(q, kv, bt, sl, scale, causal, dv, plan=plan)
        return decode_metrics(q, kv, bt, sl, scale, causal, dv, out, lse)
    return run


def _graph_case(ctx: Ctx) -> Metrics:
    """Capture one call in a CUDA graph, replay it on two new input sets (new lengths, new
    pages, new values, same shapes) and compare each with the reference. Also: the call makes
    no device-to-host sync (``torch.cuda.set_sync_debug_mode('error')``)."""
    lens_sets = [[1000, 0, 65, 1], [7, 1100, 0, 64], [1200, 1200, 3, 500]]
    s_q, N, causal, scale = 2, 16, True, 192 ** -0.5
    inputs = [paged_decode_inputs(lens, s_q, N, 576, 64, ctx.dtype, ctx.device,
                                  gen(ctx, 900 + i), spare_blocks=0)
              for i, lens in enumerate(lens_sets)]
    # one static set of buffers big enough for every set: same shapes across sets
    nb = max(x[1].shape[0] for x in inputs)
    mb = max(x[2].shape[1] for x in inputs)

    def fit(x: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        q, kv, bt, sl = x
        kv_full = torch.full((nb, 64, 576), float("nan"), dtype=kv.dtype, device=kv.device)
        kv_full[: kv.shape[0]] = kv
        bt_full = torch.full((bt.shape[0], mb), -1, dtype=torch.int32, device=bt.device)
        bt_full[:, : bt.shape[1]] = bt
        return q, kv_full, bt_full, sl

    inputs = [fit(x) for x in inputs]
    static = [t.clone() for t in inputs[0]]
    return graph_replay_metrics(
        static, inputs,
        lambda validate: fast.mla_decode_paged(*static, scale, causal, validate=validate),
        lambda x, out, lse: decode_metrics(*x, scale, causal, 512, out, lse))


@register("mla_decode_paged", "mla_decode_paged")
def decode_cases(ctx: Ctx) -> Iterator[Case]:
    """The catalogue's decode cases, then what only our kernel has: forced plans (splits,
    TMA or not, pipeline depths), the Gluon sm_90 route's tile edges, other input dtypes than
    the context's, a small latent, and CUDA-graph capture."""
    yield from catalogue_cases(ctx, "mla_decode_paged")
    DecodePlan = fast.DecodePlan  # noqa: N806
    edge = [0, 1, 63, 64, 65, 1037]
    if ctx.quick:  # interpreter / sanitizer: tiny latent, few heads, short lengths
        edge_small = [0, 1, 17, 64, 65, 130]
        for i, (N, s_q, causal, bs) in enumerate([(4, 1, False, 64), (4, 2, True, 64),
                                                 (3, 3, True, 16), (20, 1, False, 16)]):
            yield Case(f"D=40/32 N={N} s_q={s_q} causal={int(causal)} page={bs}",
                       _case(ctx, i, edge_small, s_q, N, causal, bs, D=40, dv=32))
        yield Case("D=576/512 N=2 split=3 no-TMA",
                   _case(ctx, 11, [0, 1, 65, 200], 1, 2, False,
                         plan=DecodePlan(16, 64, 3, 4, 1, use_tma=False)))
        yield Case("D=40/32 N=4 logits x30", _case(ctx, 14, edge_small, 1, 4, False, 16, D=40,
                                                   dv=32, logit_scale=30.0))
        yield Case("D=576/512 N=64 s_q=2 causal TMA split=2",
                   _case(ctx, 12, [0, 1, 65, 200], 2, 64, True,
                         plan=DecodePlan(64, 32, 2, 8, 2, use_tma=True)))
        if ctx.device.type == "cuda":
            yield Case("cuda graph capture + replay, no sync", lambda: _graph_case(ctx))
        return
    for j, plan in enumerate([DecodePlan(64, 64, 5, 8, 2, use_tma=False),
                              DecodePlan(16, 64, 3, 4, 2, use_tma=True),
                              DecodePlan(16, 64, 2, 4, 3, use_tma=False),
                              DecodePlan(32, 32, 1, 4, 3, use_tma=True)]):
        yield Case(f"N=16 s_q=2 causal forced {plan}",
                   _case(ctx, 30 + j, edge, 2, 16, True, plan=plan))
    for j, plan in enumerate([DecodePlan(64, 32, 3, 8, 2, use_tma=True),
                              DecodePlan(64, 64, 1, 8, 3, use_tma=True),
                              DecodePlan(64, 64, 2, 8, 2, use_tma=False)]):
        yield Case(f"N=128 s_q=2 causal forced {plan}",
                   _case(ctx, 35 + j, edge + [3000], 2, 128, True, plan=plan))
    # the Gluon sm_90 kernel (64-row programs, page a multiple of 64): several tiles per page,
    # a partly filled last head group, s_q = 4 with the causal diagonal across a tile edge
    yield Case("N=128 s_q=4 causal page=128 lens 0,1,63,64,65,1037,4097",
               _case(ctx, 43, edge + [4097], 4, 128, True, block_size=128))
    yield Case("N=96 s_q=1 page=256 lens 0,1,63,64,65,1037 (half-empty group)",
               _case(ctx, 44, edge, 1, 96, False, block_size=256))
    # its warp-specialized seesaw variant (mla.fast.sm90.decode_seesaw), taken when asked
    for j, (s_q, causal, splits) in enumerate([(1, False, 1), (2, True, 3)]):
        yield Case(f"N=128 s_q={s_q} causal={int(causal)} seesaw split={splits}",
                   _case(ctx, 45 + j, edge + [3000], s_q, 128, causal,
                         plan=DecodePlan(64, 64, splits, 8, 2, seesaw=True)))
    # the batch-invariant plans' fixed-length splits (mla.fast.decode.plan): the seesaw and the
    # coupled Gluon kernels and the Triton kernel; a cap of 2 splits stretches the long runs
    for j, plan in enumerate([DecodePlan(64, 64, 32, 8, 2, seesaw=True, split_keys=1024),
                              DecodePlan(64, 64, 32, 8, 2, seesaw=False, split_keys=1024),
                              DecodePlan(64, 64, 2, 8, 2, seesaw=True, split_keys=256),
                              DecodePlan(16, 64, 64, 4, 2, use_tma=False, split_keys=256)]):
        N = 16 if plan.block_m == 16 else 128
        yield Case(f"N={N} s_q=2 causal batch-invariant {plan}",
                   _case(ctx, 50 + j, edge + [3000, 9000], 2, N, True, plan=plan))
    yield Case("float16 N=128 s_q=2 causal",
               _case(ctx, 40, edge, 2, 128, True, dtype=torch.float16), torch.float16)
    yield Case("float32 N=16 s_q=1 lens 0,1,65,300",
               _case(ctx, 41, [0, 1, 65, 300], 1, 16, False, dtype=torch.float32),
               torch.float32)
    yield Case("tiny preset D=40/32 N=4 s_q=2 causal page=16",
               _case(ctx, 42, edge, 2, 4, True, 16, D=40, dv=32))
    yield Case("cuda graph capture + replay, no sync", lambda: _graph_case(ctx))
