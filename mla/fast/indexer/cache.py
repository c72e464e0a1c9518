"""``indexer_k_quant_and_cache`` in Triton: the lightning indexer's fp8 key cache, one pass.

Same contract as ``mla.reference.indexer_cache`` (conventions §10, "Indexer key cache"): token
``o`` of page ``b`` gets its 128 e4m3 values at bytes ``[o·128, o·128 + 128)`` of the page and
its float32 scale at bytes ``[block_size·128 + 4·o, +4)``; slot ``-1`` is padding. Byte for byte
the reference's output: the scale ``2^ceil(log2(max(amax, 1e-4) / 448))`` from ``amax``'s bits
(``mla.fast.bits.ue8m0_exponent``, floored at ``-22``, where ``1e-4 / 448`` lands; an infinite
``amax`` gives an infinite scale, as the reference's does), the codes by
``mla.fast.bits.e4m3_bits`` (``|k / scale| <= 448`` by construction; NaN stays NaN).

One program writes ``BLOCK_T`` tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.fast.bits import e4m3_bits, pow2, ue8m0_exponent
from mla.fast.common import should_validate
from mla.fast.launch import CompiledLauncher, check_grid, int_spec, ptr_spec
from mla.fast.paged_cache import check_slot_range
from mla.reference.indexer_cache import INDEX_DIM, INDEX_K_BYTES
from mla.validation import check_float, check_index, check_same_device, check_tensor

__all__ = ["indexer_k_quant_and_cache", "ue8m0_scale"]

BLOCK_T = 16
_BYTE_DTYPES = (torch.uint8, torch.float8_e4m3fn)


@triton.jit
def ue8m0_scale(amax):
    """``(scale, 1 / scale)`` for float32 ``amax >= 0``: ``scale = 2^ceil(log2(max(amax, 1e-4)
    / 448))`` by its exponent (module doc); an infinite ``amax`` gives ``(inf, 0)``, a NaN
    ``(NaN, NaN)``."""
    j = ue8m0_exponent(amax, -22)
    finite = amax.to(tl.int32, bitcast=True) < 0x7F800000
    scale = tl.where(finite, pow2(j), amax)
    inv_scale = tl.where(finite, pow2(-j), tl.where(amax == amax, 0.0, amax))
    return scale, inv_scale


@triton.jit
def _indexer_k_cache_kernel(
    k, cache_u8, cache_f32, slot_mapping, T, n_slots, block_size, s_k_t, s_k_d,
    D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_mapping + t, mask=t < T, other=-1).to(tl.int64)
    ok = (slot >= 0) & (slot < n_slots)  # -1 is padding; nothing outside the cache is written
    d = tl.arange(0, D)
    x = tl.load(k + t[:, None] * s_k_t + d[None, :] * s_k_d, mask=ok[:, None],
                other=0.0).to(tl.float32)
    a = tl.abs(x)
    amax = tl.max(tl.where(a == a, a, 0.0), axis=1)  # NaN ignored, as CUDA's fmaxf
    scale, inv_scale = ue8m0_scale(amax)
    code = e4m3_bits(x * inv_scale[:, None])  # exact scaling: a power of two

    page = slot // block_size
    o = slot % block_size
    base = page * block_size * (D + 4)
    tl.store(cache_u8 + base[:, None] + o[:, None] * D + d[None, :], code.to(tl.uint8),
             mask=ok[:, None])
    tl.store(cache_f32 + (base + block_size * D) // 4 + o, scale, mask=ok)


_indexer_k_cache = CompiledLauncher(_indexer_k_cache_kernel)


def indexer_k_quant_and_cache(k: torch.Tensor, kv_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, quant_block_size: int = INDEX_DIM,
                              scale_fmt: str | None = "ue8m0", *,
                              validate: bool | None = None) -> None:
    """Quantize ``k [T, 128]`` into ``kv_cache uint8 [num_blocks, block_size, 132]`` in place.

    As the reference (vLLM's signature); ``scale_fmt`` must be ``"ue8m0"`` (DeepSeek-V3.2's
    power-of-two scales: the only form this kernel writes). ``validate``: check
    ``slot_mapping``'s range on the host (a sync); ``None``: only when no CUDA graph is being
    captured. Slots outside the cache are never written.
    """
    check_tensor("kv_cache", kv_cache, ndim=3, dtype=_BYTE_DTYPES, contiguous=True)
    if kv_cache.shape[2] != INDEX_K_BYTES:
        raise ValueError(f"kv_cache must have shape [num_blocks, block_size, {INDEX_K_BYTES}] "
                         f"(the indexer key cache), got {list(kv_cache.shape)}")
    check_float("k", k, shape=[None, INDEX_DIM])
    check_index("slot_mapping", slot_mapping, shape=[k.shape[0]])
    check_same_device(k=k, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if quant_block_size != INDEX_DIM:
        raise ValueError(f"quant_block_size must be {INDEX_DIM} (one float32 scale per token "
                         f"in 132 bytes), got {quant_block_size!r}")
    if scale_fmt != "ue8m0":
        raise ValueError(f"scale_fmt must be 'ue8m0' for the fast path (power-of-two scales; "
                         f"mla.reference also writes None), got {scale_fmt!r}")
    T = k.shape[0]
    nb, bs, _ = kv_cache.shape
    if T == 0:
        return
    grid = (triton.cdiv(T, BLOCK_T),)
    check_grid("indexer_k_quant_and_cache (grid: tiles of tokens)", grid)
    if should_validate(validate, kv_cache):
        check_slot_range(slot_mapping, nb * bs)
    if k.dtype == torch.float64:
        k = k.float()  # rounded as the reference rounds it (the interpreter's cast truncates)
    u8 = kv_cache.view(torch.uint8)
    ints = (T, nb * bs, bs, *k.stride())
    key = (k.dtype, slot_mapping.dtype, *(ptr_spec(t) for t in (k, u8, slot_mapping)),
           *(int_spec(x) for x in ints))
    _indexer_k_cache(key, (grid[0], 1, 1), (
        k, u8, u8.view(-1).view(torch.float32), slot_mapping, *ints, INDEX_DIM, BLOCK_T),
        num_warps=4)
