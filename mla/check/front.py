"""``python -m mla.check`` cases for DeepSeek-V3.2's fused front (``mla.fast.sparse.front``,
run by ``mla.fast.sparse_decode_forward`` and ``sparse_prefill_forward``): five GEMMs and the
two kernels of ``mla.fast.sparse.front_kernels`` against the reference's front
(``mla.reference.sparse_model.reference_front``) on the same inputs and device.

The reference computes in the same dtype (the front's output is the model dtype, the indexer's
float32): every value is the same float32 expression up to sum order, sqrt and FMAs, rounded
once. ``model_rel``, the largest difference of a model-dtype output over its largest value, is
then one unit in the last place at most (2^-7 in bf16 for an element just above a power of two
at the tensor's maximum). ``f32_rel``, the same for the float32 outputs: the indexer's query
is a float32 GEMM over ``q_c``, a model-dtype intermediate, and cuBLAS sums ``h [W_DQ;
W_DKV]^T`` in another order than the reference's two GEMMs at more than a few tokens, so some
``q_c`` elements differ by one unit in the last place and carry that into the float32 sums
(measured on an H100: 1.9e-4 at 37-300 tokens, 2.0e-6 at one).
Shapes: DeepSeek-V3.2's widths at 128 heads, 0, 1, 37 and 300 tokens, positions up to
163,839 (RoPE's angles in float64); one token's hidden row NaN: NaN in that token's outputs
only (``mismatches``: tokens wrong either way).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mla.check.registry import Case, Ctx, Metrics, gen, register
from mla.config import get_config
from mla.fast.sparse.front import sparse_front
from mla.reference.indexer import IndexerWeights
from mla.reference.sparse_model import reference_front
from mla.weights import MLAWeights

__all__ = ["front_cases"]

_NAMES = ("q_nope", "q_pe", "kv_c", "k_pe", "q_index", "k_index", "weights")


def _front(ctx: Ctx, salt: int, S: int, heads: int, nan_row: int | None = None) -> Metrics:
    g = gen(ctx, salt)
    cfg = get_config("deepseek-v3.2").replace(num_heads=heads)
    dev, dt = ctx.device, ctx.dtype
    w = MLAWeights.random(cfg, seed=salt, dtype=dt, device=dev)
    iw = IndexerWeights.random(cfg, seed=salt + 1, dtype=dt, device=dev)
    h = torch.randn(S, cfg.hidden_size, generator=g).to(dt).to(dev)
    pos = torch.randint(0, cfg.max_seq_len, (S,), generator=g).to(dev)
    if S:
        pos[0] = cfg.max_seq_len - 1
    if nan_row is not None:
        h[nan_row, 11] = float("nan")
    got = sparse_front(w, iw, h, pos)
    want = reference_front(w, iw, h, pos)
    metrics: Metrics = {"model_rel": 0.0, "f32_rel": 0.0}
    if not S:  # every output empty, of the reference's shapes and dtypes
        same = all(a.shape == b.shape and a.dtype == b.dtype
                   for a, b in zip((*got[0], *got[1]), (*want[0], *want[1])))
        return {"mismatches": 0.0 if same else 1.0}
    bad = 0.0
    for name, a, b in zip(_NAMES, (*got[0], *got[1]), (*want[0], *want[1])):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise AssertionError(f"{name}: {a.dtype} {list(a.shape)} against the reference's "
                                 f"{b.dtype} {list(b.shape)}")
        a, b = a.double().reshape(S, -1), b.double().reshape(S, -1)
        if nan_row is not None:
            nan_a = torch.isnan(a).any(-1)
            keep = torch.ones(S, dtype=torch.bool, device=a.device)
            keep[nan_row] = False
            bad += float((nan_a != ~keep).sum().item())
            a, b = a[keep], b[keep]
        if not b.numel():
            continue
        err = float(((a - b).abs().max() / b.abs().max()).item())
        key = "f32_rel" if got[0].q_nope.dtype != torch.float32 and name in _NAMES[4:] \
            else "model_rel"
        metrics[key] = max(metrics[key], err)
    if nan_row is not None:
        metrics["mismatches"] = bad
    return metrics


@register("sparse_front", "sparse_decode_forward")
def front_cases(ctx: Ctx) -> Iterator[Case]:
    if ctx.quick:
        shapes = [("S=1 N=4", 801, 1, 4, None), ("S=5 N=4, token 2 NaN", 802, 5, 4, 2)]
    else:
        shapes = [("S=1 N=128", 801, 1, 128, None), ("S=37 N=128", 803, 37, 128, None),
                  ("S=300 N=128", 804, 300, 128, None), ("S=0 N=128", 805, 0, 128, None),
                  ("S=9 N=128, token 4 NaN", 806, 9, 128, 4)]
    for name, salt, S, heads, nan_row in shapes:
        yield Case(f"V3.2 widths {name}", lambda s=salt, S=S, n=heads, r=nan_row:
                   _front(ctx, s, S, n, r))
