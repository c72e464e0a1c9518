"""``concat_and_cache_fp8_ds_mla`` in Triton: quantize and write ``fp8_ds_mla`` rows in one pass.

Same contract as ``mla.reference.fp8.concat_and_cache_fp8_ds_mla`` (conventions §10): row
``slot`` of ``kv_cache [num_blocks, block_size, 656]`` (uint8) receives

    bytes [  0, 512)   e4m3(kv_c / scale_tile), 4 tiles of 128
    bytes [512, 528)   scale_tile = 2^ceil(log2(max(amax_tile / 448, 1e-4)))  (float32)
    bytes [528, 656)   k_pe as bfloat16

One program quantizes one token; byte for byte the reference's output. Both roundings that
decide the bytes are done on float32 bit patterns (``mla.fast.bits``): the scale exponent
``ue8m0_exponent`` with the floor ``2^-13`` (the smallest power of two above ``1e-4``), and the
codes ``e4m3_bits``, round to nearest even (``|v| <= 448`` by construction; a NaN value gives
``0x7F`` with its sign, as torch's cast).

The scales and ``k_pe`` are stored through float32 and bfloat16 views of the same bytes
(656 is a multiple of 4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.fast.bits import e4m3_bits, pow2, ue8m0_exponent
from mla.fast.common import should_validate
from mla.fast.launch import CompiledLauncher, check_grid, int_spec, ptr_spec
from mla.fast.paged_cache import check_slot_range
from mla.reference.fp8 import (
    D_NOPE,
    D_ROPE,
    FP8_DS_MLA_BYTES,
    NUM_TILES,
    TILE,
    check_fp8_write_args,
)

__all__ = ["concat_and_cache_fp8_ds_mla"]


@triton.jit
def _quant_cache_kernel(
    kv_c, k_pe, cache_u8, cache_f32, cache_bf16, slot_mapping,
    n_slots, s_kv_t, s_kv_d, s_pe_t, s_pe_d,
    D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, NUM_TILES: tl.constexpr, TILE: tl.constexpr,
    ROW_BYTES: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    ok = (slot >= 0) & (slot < n_slots)
    d = tl.arange(0, D_NOPE)
    x = tl.load(kv_c + t * s_kv_t + d * s_kv_d, mask=ok, other=0.0)
    x = tl.reshape(x.to(tl.float32), (NUM_TILES, TILE))
    amax = tl.max(tl.abs(x), axis=1)  # [NUM_TILES]

    j = ue8m0_exponent(amax, -13)  # 2^-13 is the first power of two >= 1e-4
    scale = pow2(j)
    v = x * pow2(-j)[:, None]  # exact: a power of two (the reference divides by scale)
    code = e4m3_bits(v)

    row = slot * ROW_BYTES
    cols = tl.arange(0, NUM_TILES)[:, None] * TILE + tl.arange(0, TILE)[None, :]
    tl.store(cache_u8 + row + cols, code.to(tl.uint8), mask=ok)
    tl.store(cache_f32 + slot * (ROW_BYTES // 4) + D_NOPE // 4 + tl.arange(0, NUM_TILES), scale,
             mask=ok)
    r = tl.arange(0, D_ROPE)
    pe = tl.load(k_pe + t * s_pe_t + r * s_pe_d, mask=ok, other=0.0)
    tl.store(cache_bf16 + slot * (ROW_BYTES // 2) + (D_NOPE + 4 * NUM_TILES) // 2 + r,
             pe.to(tl.bfloat16), mask=ok)


_quant_cache = CompiledLauncher(_quant_cache_kernel)


def concat_and_cache_fp8_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                                slot_mapping: torch.Tensor, *,
                                validate: bool | None = None) -> None:
    """Quantize ``kv_c [T, 512]``, ``k_pe [T, 64]`` (or ``[T, 1, 64]``) into ``kv_cache`` in place.

    As the reference; ``kv_cache [num_blocks, block_size, 656]`` uint8 (or float8_e4m3fn bytes),
    contiguous. ``validate``: check ``slot_mapping``'s range on the host (a sync); ``None``: as
    ``mla.fast.set_validation`` says (off unless turned on), never while a graph is captured.
    Slots outside the cache are never written (unchecked, a bad slot's row is skipped).
    """
    k_pe = check_fp8_write_args(kv_c, k_pe, kv_cache, slot_mapping, contiguous=True)
    T = kv_c.shape[0]
    n_slots = kv_cache.shape[0] * kv_cache.shape[1]
    if T == 0:
        return
    check_grid("concat_and_cache_fp8_ds_mla (grid: tokens)", (T,))
    if should_validate(validate, kv_cache):
        check_slot_range(slot_mapping, n_slots)
    if k_pe.dtype != torch.bfloat16:
        # stored as bf16: torch rounds to nearest even from any dtype, as the reference does
        # (Triton's interpreter truncates, and its float64 -> bf16 cast is wrong)
        k_pe = k_pe.to(torch.bfloat16)
    u8 = kv_cache.view(torch.uint8)
    strides = (*kv_c.stride(), *k_pe.stride())
    # what fixes the compiled kernel's specialization (the constexprs are the module's)
    key = (kv_c.dtype, slot_mapping.dtype,
           *(ptr_spec(t) for t in (kv_c, k_pe, u8, slot_mapping)),
           *(int_spec(x) for x in (n_slots, *strides)))
    _quant_cache(key, (T, 1, 1), (
        kv_c, k_pe, u8, u8.view(torch.float32), u8.view(torch.bfloat16), slot_mapping,
        n_slots, *strides, D_NOPE, D_ROPE, NUM_TILES, TILE, FP8_DS_MLA_BYTES), num_warps=4)
