"""DeepSeek-V4's query and window-key preparation in one Triton kernel.

Equations (3) and (4) of ``mla.reference.v4.layer``, for ``T`` tokens at ``positions``:

    (3)  q_h <- bf16(rope_p(q_h / rms(q_h)))     per head, no weight (V4; V4.1 has no head
                                                 norm: ``head_norm=False``); ``rms(v) =
                                                 sqrt(mean(v²) + eps)``
    (4)  k   =  cache(rope_p(c_KV))              into the window cache's MODEL1 pages at
                                                 ``slot_mapping`` (``-1``: not stored)

with ``rope_p`` the layer's GPT-J rotation of the last 64 dims (``cos_sin``,
``mla.fast.v4.common.v4_cos_sin_cache``). The key's row is stored as ``v4_cache_round`` gives it
back: the nope values rounded to bf16, then e4m3 in tiles of 64 with UE8M0 scales of vLLM's
Triton floor (``scale_floor="vllm"``), the rope values bf16. Program ``(t, h)`` writes head
``h`` of token ``t`` (heads ``H <= h < padded_heads`` as zeros: the attention kernels' padded
heads), program ``(t, padded_heads)`` the key.

Arithmetic in float32 (the reference's float64); the bf16 and e4m3 roundings and the scale
exponents on bit patterns, exact (``mla.fast.v4.common``). vLLM's counterpart is the fused
``fused_qnorm_rope_kv_insert``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.fast.bits import bf16_round
from mla.fast.common import check_kernel_input, should_validate
from mla.fast.launch import check_grid
from mla.fast.paged_cache import check_slot_range
from mla.fast.v4.common import FLOORS, store_model1
from mla.reference.fp8_model1 import FP8_MODEL1_BYTES
from mla.validation import check_float, check_index, check_same_device, check_tensor

__all__ = ["v4_q_rope_kv_insert"]

_D = 512
_HALF = 32


@triton.jit
def _front_kernel(
    q, kv, positions, cos_sin, slot_mapping, q_out, pages_u8, pages_i16,
    H, HP, s_qt, s_qh, s_kvt, s_ot, s_oh, block_size, page_bytes, eps,
    HEAD_NORM: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, FLOOR: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    NOPE: tl.constexpr = D - 2 * HALF
    cn = tl.arange(0, D)
    cn_ok = cn < NOPE
    ci = tl.arange(0, HALF)
    pos = tl.load(positions + t).to(tl.int64)
    cos = tl.load(cos_sin + pos * 2 * HALF + ci)
    sin = tl.load(cos_sin + pos * 2 * HALF + HALF + ci)
    if h < H:
        src = q + t * s_qt + h * s_qh
        x_n = tl.load(src + cn, mask=cn_ok, other=0.0).to(tl.float32)
        x_e = tl.load(src + NOPE + 2 * ci).to(tl.float32)
        x_o = tl.load(src + NOPE + 2 * ci + 1).to(tl.float32)
        if HEAD_NORM:
            ss = tl.sum(x_n * x_n, axis=0) + tl.sum(x_e * x_e, axis=0) \
                + tl.sum(x_o * x_o, axis=0)
            rstd = 1.0 / tl.sqrt(ss / D + eps)
            x_n = x_n * rstd
            x_e = x_e * rstd
            x_o = x_o * rstd
        dst = q_out + t * s_ot + h * s_oh
        tl.store(dst + cn, bf16_round(x_n).to(q_out.dtype.element_ty), mask=cn_ok)
        tl.store(dst + NOPE + 2 * ci, bf16_round(x_e * cos - x_o * sin).to(q_out.dtype.element_ty))
        tl.store(dst + NOPE + 2 * ci + 1,
                 bf16_round(x_e * sin + x_o * cos).to(q_out.dtype.element_ty))
    elif h < HP:
        dst = q_out + t * s_ot + h * s_oh
        tl.store(dst + tl.arange(0, D), tl.zeros((D,), q_out.dtype.element_ty))
    else:
        slot = tl.load(slot_mapping + t).to(tl.int64)
        src = kv + t * s_kvt
        x_n = bf16_round(tl.load(src + cn, mask=cn_ok, other=0.0).to(tl.float32))
        x_e = tl.load(src + NOPE + 2 * ci).to(tl.float32)
        x_o = tl.load(src + NOPE + 2 * ci + 1).to(tl.float32)
        store_model1(pages_u8, pages_i16, (slot // block_size) * page_bytes, slot % block_size,
                     block_size, x_n, x_e * cos - x_o * sin, x_e * sin + x_o * cos, D, HALF,
                     FLOOR, slot >= 0)


def v4_q_rope_kv_insert(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                        cos_sin: torch.Tensor, window_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, *, rms_norm_eps: float,
                        head_norm: bool = True, padded_heads: int | None = None,
                        out_dtype: torch.dtype = torch.bfloat16,
                        validate: bool | None = None) -> torch.Tensor:
    """``q [T, H, 512]`` (``wq_b``'s output), ``kv [T, 512]`` (the normed ``c_KV``) at
    ``positions [T]`` -> the attention's query ``[T, padded_heads, 512]`` in ``out_dtype``
    (bf16 values; heads from ``H`` on zero), and the keys stored into ``window_cache`` (the
    ``[nb, bs, 584]`` view of MODEL1 pages, ``fp8_model1_cache``) at ``slot_mapping [T]``
    (``-1``: not stored), in place. ``cos_sin [P, 64]`` float32: the layer's table.
    ``validate``: check the slots' range on the host (a sync)."""
    check_float("q", q, ndim=3)
    check_kernel_input(q)
    T, H, D = q.shape
    if D != _D:
        raise ValueError(f"q must have shape [T, H, {_D}], got {list(q.shape)}")
    check_float("kv", kv, shape=[T, _D], device=q.device)
    check_index("positions", positions, shape=[T], device=q.device)
    check_index("slot_mapping", slot_mapping, shape=[T], device=q.device)
    check_tensor("cos_sin", cos_sin, shape=[None, 64], dtype=(torch.float32,),
                 device=q.device, contiguous=True)
    check_tensor("window_cache", window_cache, ndim=3, dtype=(torch.uint8, torch.float8_e4m3fn))
    check_same_device(q=q, window_cache=window_cache)
    if window_cache.shape[2] != FP8_MODEL1_BYTES:
        raise ValueError(f"window_cache must have shape [num_blocks, block_size, "
                         f"{FP8_MODEL1_BYTES}] (MODEL1), got {list(window_cache.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if not isinstance(head_norm, bool):
        raise ValueError(f"head_norm must be a bool, got {head_norm!r}")
    HP = H if padded_heads is None else padded_heads
    if isinstance(HP, bool) or not isinstance(HP, int) or HP < H:
        raise ValueError(f"padded_heads must be an int >= H={H}, got {padded_heads!r}")
    if q.stride(2) != 1 or kv.stride(1) != 1:
        raise ValueError("q and kv must have unit stride in their last dim")
    nb, bs = window_cache.shape[:2]
    page_bytes = window_cache.stride(0)
    if should_validate(validate, q):
        check_slot_range(slot_mapping, nb * bs)
        if T and int(positions.max()) >= cos_sin.shape[0]:
            raise ValueError(f"positions must be below cos_sin's {cos_sin.shape[0]} rows")
    out = torch.empty(T, HP, _D, dtype=out_dtype, device=q.device)
    if T == 0:
        return out
    grid = (T, HP + 1)
    check_grid("v4_q_rope_kv_insert (grid: tokens, heads + the key)", grid)
    flat = torch.as_strided(window_cache.view(torch.uint8), (nb * page_bytes,), (1,))
    _front_kernel[grid](
        q, kv, positions, cos_sin, slot_mapping, out, flat, flat.view(torch.int16),
        H, HP, q.stride(0), q.stride(1), kv.stride(0), out.stride(0), out.stride(1), bs,
        page_bytes, float(rms_norm_eps),
        HEAD_NORM=head_norm, D=_D, HALF=_HALF, FLOOR=FLOORS["vllm"], num_warps=4,
    )
    return out
