"""Roundings done on float32 bit patterns, shared by the fast kernels that must write the
reference's bytes.

Triton's interpreter truncates in its float casts, and a conversion instruction's rounding is
the hardware's, so the kernels whose output is compared byte for byte (the FP8 caches, the
indexer's keys and queries, DeepSeek-V4's compressor and window cache) round in integer
arithmetic instead:

- ``e4m3_bits(v)``: float32 -> its e4m3 byte (int32), round to nearest even. Normal codes
  (``|v| >= 2^-6``) keep 3 mantissa bits by add-and-shift; subnormals are ``round(|v| · 2^9)``
  steps of ``2^-9`` rounded by the float32 adder (``x + 2^23 - 2^23``); the sign bit is kept,
  also for a value that rounds to zero, and NaN gives ``0x7F`` with its sign (as torch's cast).
  ``|v| <= 448`` by construction in every caller, so nothing saturates.
- ``bf16_round(x)``: float32 -> the float32 holding ``bf16(x)``, round to nearest even (a NaN
  stays a NaN: the rounding would carry it into inf).
- ``ue8m0_exponent(amax, FLOOR)``: ``ceil(log2(s))`` of a power-of-two FP8 scale without a
  division or a log. With ``amax = f · 2^e``, ``f`` in ``[1, 2)``, ``ceil(log2(amax / 448)) =
  e - 8 + (f > 1.75)`` (``448 = 1.75 · 2^8``), floored at ``FLOOR``: ``-13`` for ``s =
  max(amax / 448, 1e-4)`` (``fp8_ds_mla``, FlashMLA's MODEL1) or ``-22`` for ``s = max(amax,
  1e-4) / 448`` (the indexer's keys, vLLM's V4 caches). Exact for bf16 and fp16 ``amax``; for
  float32 ``amax / 448`` within a float32 rounding above a power of two, torch's float32
  ``log2`` can round down where this exact ceiling does not (a set of measure zero).
- ``pow2(j)``: ``2^j`` (float32) of an int32 exponent in the normal range.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["e4m3_bits", "bf16_round", "ue8m0_exponent", "pow2"]


@triton.jit
def e4m3_bits(v):
    """float32 ``v`` (``|v| <= 448`` or NaN) -> its e4m3 byte (int32), round to nearest even
    (module doc)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag_bits = bits & 0x7FFFFFFF
    mag = mag_bits.to(tl.float32, bitcast=True)
    odd = (mag_bits >> 20) & 1
    normal = ((mag_bits + 0x7FFFF + odd) >> 20) - (120 << 3)
    sub = ((mag * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(mag >= 0.015625, normal, sub)
    code = tl.where(mag_bits > 0x7F800000, 0x7F, code)  # NaN
    return code | sign


@triton.jit
def bf16_round(x):
    """float32 ``x`` -> ``bf16(x)`` as a float32, round to nearest even (NaN stays NaN)."""
    bits = x.to(tl.int32, bitcast=True)
    up = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, x, up.to(tl.float32, bitcast=True))


@triton.jit
def ue8m0_exponent(amax, FLOOR: tl.constexpr):
    """``ceil(log2(scale))`` (int32) of the power-of-two scale of a block of max ``amax``,
    floored at ``FLOOR`` (module doc)."""
    a_bits = amax.to(tl.int32, bitcast=True)
    e = ((a_bits >> 23) & 0xFF) - 127
    j = e - 8 + ((a_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.maximum(j, FLOOR)


@triton.jit
def pow2(j):
    """``2^j`` (float32) of an int32 exponent in the normal range."""
    return ((j + 127) << 23).to(tl.float32, bitcast=True)
