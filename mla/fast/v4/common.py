"""What DeepSeek-V4's fast kernels share: the RoPE table and the MODEL1 row writer (the
roundings done bit by bit are ``mla.fast.bits``').

- ``v4_cos_sin_cache(config, ratio, max_position)``: float32 ``[max_position, 64]``, the cosines
  of the ``R/2 = 32`` angles ``p · f_i`` then their sines, as vLLM tabulates them
  (``mla.reference.v4.rope``: the angles in float64, rounded once to float32). Every kernel of
  ``mla.fast.v4`` rotates with it: GPT-J pairs ``(x[D-64+2i], x[D-64+2i+1])``, in float32.
- ``store_model1``: one token's MODEL1 row (``mla.reference.fp8_model1``) into its page: the 448
  nope values as e4m3 in 7 tiles of 64 with UE8M0 scale bytes, the 64 rope values as bf16.
- ``rope_torch``: the same rotation in torch (the layer's inverse rope of the output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.fast.bits import bf16_round, e4m3_bits, pow2, ue8m0_exponent
from mla.reference.v4.config import V4Config
from mla.reference.v4.rope import v4_rope_frequencies

__all__ = ["v4_cos_sin_cache", "rope_torch", "store_model1", "FLOORS"]

FLOORS = {"flashmla": -13, "vllm": -22}  # the smallest scale exponent of each floor


def v4_cos_sin_cache(config: V4Config, ratio: int, max_position: int,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 ``[max_position, rope_head_dim]``: ``cos(p · f_i)`` then ``sin(p · f_i)``."""
    if isinstance(max_position, bool) or not isinstance(max_position, int) or max_position <= 0:
        raise ValueError(f"max_position must be a positive int, got {max_position!r}")
    freqs = v4_rope_frequencies(config, ratio)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * freqs[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).float().to(device)


def rope_torch(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
               inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``R`` dims of ``x [T, ..., D]`` (GPT-J pairs) by ``positions [T]`` with
    the table ``cos_sin``, in float32; the result in ``x``'s dtype."""
    R = cos_sin.shape[1]
    cs = cos_sin[positions.long()]
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [R // 2]
    cos, sin = cs[:, :R // 2].view(shape), cs[:, R // 2:].view(shape)
    if inverse:
        sin = -sin
    rot = x[..., x.shape[-1] - R:].float()
    a, b = rot[..., 0::2], rot[..., 1::2]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :x.shape[-1] - R], out.to(x.dtype)), dim=-1)


@triton.jit
def store_model1(pages_u8, pages_i16, page_off, o, block_size, nope, even, odd,
                 NOPE_P: tl.constexpr, HALF: tl.constexpr, FLOOR: tl.constexpr, ok):
    """Write one token's MODEL1 row at token ``o`` of the page at byte ``page_off``.

    ``nope [NOPE_P]`` float32 (bf16 values; columns >= 448 ignored), ``even``, ``odd``
    ``[HALF]`` float32 the rope pairs (rounded to bf16 here)."""
    TILE: tl.constexpr = 64
    NT: tl.constexpr = NOPE_P // TILE
    x = tl.reshape(nope, (NT, TILE))
    tile = tl.arange(0, NT)
    real = tile < 7
    amax = tl.max(tl.abs(x), axis=1)
    j = ue8m0_exponent(amax, FLOOR)
    code = e4m3_bits(x * pow2(-j)[:, None])  # exact: a power of two
    nan = amax != amax
    code = tl.where(nan[:, None], 0x7F, code)
    sbyte = tl.where(nan, 0xFF, j + 127)
    data = page_off + o * 576
    cols = tile[:, None] * TILE + tl.arange(0, TILE)[None, :]
    tl.store(pages_u8 + data + cols, code.to(tl.uint8), mask=ok & real[:, None])
    sc = page_off + block_size * 576 + o * 8
    tl.store(pages_u8 + sc + tile, tl.where(real, sbyte, 0).to(tl.uint8), mask=ok)
    i = tl.arange(0, HALF)
    ev = (bf16_round(even).to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    od = (bf16_round(odd).to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    r16 = (data + 448) // 2
    tl.store(pages_i16 + r16 + 2 * i, ev.to(tl.int16), mask=ok)
    tl.store(pages_i16 + r16 + 2 * i + 1, od.to(tl.int16), mask=ok)
