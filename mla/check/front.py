"""``python -m mla.check`` cases for DeepSeek-V3.2's fused front (``mla.fast.sparse.front``,
run by ``mla.fast.sparse_decode_forward`` and ``sparse_prefill_forward``): five GEMMs and the
two kernels of ``mla.fast.sparse.front_kernels`` against the reference's front
(``mla.reference.sparse_model.reference_front``).

Every output against the reference computed in float64 on the CPU from the same inputs
(``out_rel``: the largest ``mla.compare.rel_err`` of the seven). The fast front rounds where a
serving front does: the GEMMs' outputs, the normed latents and the rotated query to the model
dtype (the indexer's outputs stay float32, but its query is a GEMM over the model-dtype
``q_c``), so its error is a few roundings of the model dtype.
Shapes: DeepSeek-V3.2's widths at 128 heads, 0, 1, 37 and 300 tokens, positions up to
163,839 (RoPE's angles in float64); one token's hidden row NaN: NaN in that token's outputs
only (``mismatches``: tokens wrong either way).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

import mla.fast as fast
from mla.check.registry import Case, Ctx, Metrics, gen, register
from mla.compare import rel_err
from mla.config import get_config
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
    got = fast.sparse_front(w, iw, h, pos)
    f64, cpu = torch.float64, torch.device("cpu")
    want = reference_front(w.to(f64, cpu), iw.to(f64, cpu), h.to(f64).cpu(), pos.cpu())
    metrics: Metrics = {"out_rel": 0.0}
    if not S:  # every output empty, of the reference's shapes and dtypes
        same = all(a.shape == b.shape for a, b in zip((*got[0], *got[1]), (*want[0], *want[1])))
        return {"mismatches": 0.0 if same else 1.0}
    keep = torch.ones(S, dtype=torch.bool)
    if nan_row is not None:
        keep[nan_row] = False
    bad = 0.0
    for i, (name, a, b) in enumerate(zip(_NAMES, (*got[0], *got[1]), (*want[0], *want[1]))):
        if a.shape != b.shape or a.dtype != (dt if i < 4 else torch.float32):
            raise AssertionError(f"{name}: {a.dtype} {list(a.shape)} against the reference's "
                                 f"{b.dtype} {list(b.shape)}")
        a, b = a.double().cpu().reshape(S, -1), b.reshape(S, -1)
        bad += float((torch.isnan(a).any(-1) != ~keep).sum().item())
        metrics["out_rel"] = max(metrics["out_rel"], rel_err(a[keep], b[keep]))
    if nan_row is not None:
        metrics["mismatches"] = bad
    return metrics


@register("sparse_front", "sparse_front")
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
