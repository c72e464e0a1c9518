"""``quantize_indexer_q`` in Triton: the lightning indexer's query as e4m3 codes, its scale folded
into the head weights, in one pass.

Same contract as ``mla.reference.quantize_indexer_q`` with ``scale_fmt="ue8m0"`` (conventions
§10, "Indexer logits and top-k"): per head, one scale ``2^ceil(log2(max(amax, 1e-4) / 448))``
for its 128 values, the codes ``e4m3(q / scale)``, the weight ``w · scale`` (float32). The
reference is about fifteen torch kernels (a float copy, a max, a log, a power, a division, a
clamp, a cast, a product...), at decode sizes a few microseconds of GPU and several more of
host each; here one launch. Both roundings are the key cache writer's (``mla.fast.indexer.cache``:
the scale from the exponent, e4m3 round-to-nearest-even on bit patterns), so the bytes are the
reference's, with the same caveat for float32 inputs whose ``amax / 448`` lies within a rounding
above a power of two. A head holding a NaN gets a NaN scale, so NaN codes and a NaN weight, as
the reference's ``amax`` propagates it; an infinite ``amax`` gives an infinite weight, zero codes
for the finite values and NaN for the infinite ones, as the reference's division does.

One program quantizes ``BLOCK_R`` heads (rows of 128 values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.fast.bits import e4m3_bits
from mla.fast.indexer.cache import ue8m0_scale
from mla.fast.launch import CompiledLauncher, check_grid, int_spec, ptr_spec
from mla.reference.indexer_cache import INDEX_DIM
from mla.reference.indexer_logits import check_indexer_q_args
from mla.validation import check_same_device

__all__ = ["quantize_indexer_q"]

BLOCK_R = 16


@triton.jit
def _quantize_q_kernel(q, w, codes, w_out, rows, s_q_r, s_w_r, D: tl.constexpr,
                       BLOCK_R: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < rows
    d = tl.arange(0, D)
    x = tl.load(q + r[:, None] * s_q_r + d[None, :], mask=live[:, None], other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0  # the maximum may drop a NaN
    scale, inv_scale = ue8m0_scale(tl.where(has_nan, float("nan"), amax))
    code = e4m3_bits(x * inv_scale[:, None])  # exact scaling: a power of two
    tl.store(codes + r[:, None] * D + d[None, :], code.to(tl.uint8), mask=live[:, None])
    weight = tl.load(w + r * s_w_r, mask=live, other=0.0).to(tl.float32)
    tl.store(w_out + r, weight * scale, mask=live)


_quantize_q = CompiledLauncher(_quantize_q_kernel)


def quantize_indexer_q(q_index: torch.Tensor, weights: torch.Tensor,
                       scale_fmt: str | None = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """``q_index [..., H, 128]``, ``weights [..., H]`` -> ``(q e4m3 [..., H, 128], weights ·
    q_scale float32 [..., H])``: the reference's bytes and weights (module doc). ``scale_fmt``
    must be ``"ue8m0"`` (DeepSeek-V3.2's power-of-two scales; the reference also takes
    ``None``)."""
    check_indexer_q_args(q_index, weights)
    check_same_device(q_index=q_index, weights=weights)
    if scale_fmt != "ue8m0":
        raise ValueError(f"scale_fmt must be 'ue8m0' for the fast path (power-of-two scales; "
                         f"mla.reference also takes None), got {scale_fmt!r}")
    if q_index.dtype == torch.float64:
        q_index = q_index.float()  # rounded as the reference rounds it (the interpreter truncates)
    if weights.dtype == torch.float64:
        weights = weights.float()
    q2 = q_index.reshape(-1, INDEX_DIM)
    if q2.stride(1) != 1:
        q2 = q2.contiguous()
    w1 = weights.reshape(-1)
    rows = q2.shape[0]
    codes = torch.empty(q_index.shape, dtype=torch.uint8, device=q_index.device)
    w_out = torch.empty(weights.shape, dtype=torch.float32, device=q_index.device)
    if rows:
        grid = (triton.cdiv(rows, BLOCK_R), 1, 1)
        check_grid("quantize_indexer_q (grid: tiles of heads)", grid)
        ints = (rows, q2.stride(0), w1.stride(0))
        key = (q2.dtype, w1.dtype, *(ptr_spec(t) for t in (q2, w1, codes, w_out)),
               *(int_spec(x) for x in ints))
        _quantize_q(key, grid, (q2, w1, codes, w_out, *ints, INDEX_DIM, BLOCK_R), num_warps=4)
    return codes.view(torch.float8_e4m3fn), w_out
