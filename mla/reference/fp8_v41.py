"""DeepSeek-V4.1's two KV-cache records, byte for byte as vLLM 0.33's Triton kernels write them.

Both records are per token and interleaved (a token's scales follow its own values; no page
structure), FlashMLA's ``ModelType::V41`` and ``V41_FP4`` (``flash_mla_interface.py``, "For
DeepSeek V4 and DeepSeek V4.1"; vLLM 0.33 ``models/deepseek_v41/common/ops/cache_utils.py``,
the record widths at its head).

MXFP8, 528 bytes a token (``quantize_fp8_v41``): all 512 dims, RoPE dims included,

    bytes [  0, 512)   512 float8_e4m3fn values, 16 blocks of 32 dims, in order
    bytes [512, 528)   16 UE8M0 scale bytes, one per block:   x ≈ e4m3 · 2^(byte − 127)

per block of 32, in float32 as vLLM's ``_rope_quant_insert_mxfp8_kernel``
(``fused_compress_quant_cache.py``) and ``_quantize_and_insert_k_mxfp8_kernel``
(``cache_utils.py``) compute it:

    amax = max(max |x|, 1e-4)                 NaN ignored (a max that prefers numbers)
    e    = ceil(log2(amax · f32(1/448)))       the product rounded to float32, log2 exact
    q    = e4m3_rne(clamp(x · 2^-e, ±448))     byte = clamp(e + 127, 0, 255)

The floor sits on ``amax`` (``scale_floor="vllm"``, the default): a block with ``amax < 1e-4``
gets ``e = ceil(log2(1e-4 / 448)) = -22``. FlashMLA's ``tests/quant.py`` and its CuTe
compressor floor the scale instead, ``max(amax / 448, 1e-4)`` (``scale_floor="flashmla"``: ``e >=
-13``): the two scales differ for blocks with ``amax <= 448 · 2^-14 ≈ 0.0273`` only (between
that and 0.0448 both give 2^-13). Dividing by a power of
two is exact, so the one rounding is e4m3's: ``|x − deq| <= max(2^-4 |x|, 2^-10 · 2^e)``
(half an ulp, normal and subnormal), ``|x · 2^-e| <= 448`` so nothing saturates, and the
dequantized value ``e4m3 · 2^e`` is a bfloat16 number.

NVFP4, 288 bytes a token (``quantize_nvfp4_v41``):

    bytes [  0, 256)   512 e2m1 codes, two a byte: dim 2i in the low nibble, 2i+1 in the high
    bytes [256, 288)   32 float8_e4m3fn scales, one per block of 16 dims:  x ≈ e2m1 · scale

per block of 16, in float32 as vLLM's ``_rope_quant_insert_nvfp4_kernel``:

    amax  = max |x|                                       NaN ignored, no floor
    scale = e4m3_rne(clamp(amax · f32(1/6), 2^-9, 448))   2^-9: e4m3's smallest subnormal
    code  = e2m1_rne_satfinite(x / f32(scale))            division correctly rounded

e2m1 is a sign bit (bit 3) over magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} (codes 0..7); ties go
to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4) and
anything above 6 saturates to 6, which happens when the scale rounds down (at most by the
factor 1 + 2^-4 for a normal scale, up to 1.5 for a subnormal one).

Input: what the kernels quantize, float32 values. vLLM's compressed-cache path loads the bf16
latent as float32 and rotates its RoPE dims in float32 (so those are float32 numbers, not
rounded to bf16) before quantizing; the SWA path quantizes the bf16 ``k`` as float32. A float64
argument is rounded to float32 (nearest even) first, as a cast would.

Signs, NaN and inf. ``-0`` and values rounding to zero keep their sign (e4m3 0x80, e2m1 code
8), as the kernels' conversions do. The kernels' amax skips NaN (Triton's max prefers numbers)
and their clamp turns a NaN into +448 (MXFP8: e4m3 0x7E; NVFP4: a NaN amax clamps to the
scale 2^-9, 0x01), numbers that mean something else. The reference keeps the NaN instead.
MXFP8: a NaN value is stored as e4m3 NaN 0x7F, the block's scale taken from its other values,
so it dequantizes to NaN and its neighbours to themselves; an inf makes ``e = inf``: the
block's scale byte 255 (UE8M0's NaN, as the kernels write it), its finite values ±0 and the
inf itself NaN (``inf · 0``; 0x7E in the kernels), so the whole block dequantizes to NaN.
NVFP4: e2m1 has no NaN, so a block of 16 holding a NaN or an inf gets the e4m3 NaN scale 0x7F
(the kernel: 0x01 or 448) and all its 16 values dequantize to NaN; its codes are the kernel's
(NaN and inf saturate to 6). On finite input the bytes are the kernels' (checked by
``benchmarks/v41_codecs.py``); on non-finite input they differ exactly there.

Dequantizing maps UE8M0 byte 255 and the e4m3 NaN codes 0x7F/0xFF to NaN and computes
``value · scale`` exactly (in float64), rounded once to ``dtype`` (bfloat16 by default, as
vLLM's gathers write: every record the quantizers write dequantizes to bfloat16 numbers
exactly). vLLM's gathers differ on bytes the quantizers never write: byte 255 gives them ±inf
(NaN only for a zero value), byte 0's scale 2^-127 flushes to 0, and their NVFP4 gather
negates as ``0 − x``, so code 8 (-0) comes back +0.
"""

from __future__ import annotations

import torch

from mla.reference.fp8 import FP8_MAX, SCALE_FLOOR
from mla.reference.fp8_model1 import UE8M0_BIAS, UE8M0_NAN
from mla.validation import FLOAT_DTYPES, check_float, check_tensor

__all__ = [
    "FP8_V41_BYTES", "NVFP4_V41_BYTES", "dequantize_fp8_v41", "dequantize_nvfp4_v41",
    "e2m1_rne", "quantize_fp8_v41", "quantize_nvfp4_v41",
]

D = 512  # a token's dims, RoPE included
FP8_BLOCK = 32  # dims per UE8M0 scale
FP8_BLOCKS = D // FP8_BLOCK  # 16
FP8_V41_BYTES = D + FP8_BLOCKS  # 528
NVFP4_BLOCK = 16  # dims per e4m3 scale
NVFP4_BLOCKS = D // NVFP4_BLOCK  # 32
NVFP4_CODE_BYTES = D // 2  # 256
NVFP4_V41_BYTES = NVFP4_CODE_BYTES + NVFP4_BLOCKS  # 288
E2M1_MAX = 6.0
E4M3_MIN_SUBNORMAL = 2.0 ** -9  # the NVFP4 scale's lower clamp
E4M3_NAN = 0x7F  # the NaN the kernels' conversions write (positive)
FLOORS = ("vllm", "flashmla")  # scale_floor: vLLM's Triton kernels, FlashMLA's tests/quant.py

# e2m1 magnitudes by code 0..7; code | 8 is the negative
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

_BYTE_DTYPES = (torch.uint8, torch.float8_e4m3fn)
_F32 = torch.float32


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=_F32)


def _check_k(k: torch.Tensor) -> torch.Tensor:
    check_float("k", k)
    if k.dim() < 1 or k.shape[-1] != D:
        raise ValueError(f"k must have shape [..., {D}] (a DeepSeek-V4.1 latent row, RoPE dims "
                         f"included), got {list(k.shape)}")
    return k.to(_F32)


def _check_records(name: str, records: torch.Tensor, width: int, what: str) -> torch.Tensor:
    check_tensor(name, records, dtype=_BYTE_DTYPES)
    if records.dim() < 1 or records.shape[-1] != width:
        raise ValueError(f"{name} must have shape [..., {width}] ({what} records), got "
                         f"{list(records.shape)}")
    return records.view(torch.uint8)


def _check_dtype(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {list(FLOAT_DTYPES)}, got {dtype!r}")
    return dtype


def _nan_ignoring_amax(blocks: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over the last dim, NaN skipped (0 for an all-NaN block), inf kept."""
    mag = blocks.abs()
    return torch.where(torch.isnan(mag), 0.0, mag).amax(dim=-1)


def _ceil_log2(s: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(s))`` exactly for positive finite float32 ``s`` (as int64), from the
    exponent field: ``s = m · 2^E``, ``m`` in [0.5, 1), so it is ``E`` unless ``m = 0.5``."""
    m, e = torch.frexp(s.double())
    return (e - (m == 0.5).to(e.dtype)).long()


def quantize_fp8_v41(k: torch.Tensor, *, scale_floor: str = "vllm") -> torch.Tensor:
    """``k [..., 512]`` (any float dtype; rounded to float32) -> ``uint8 [..., 528]`` MXFP8
    records (see the module doc). ``scale_floor="vllm"``: vLLM's Triton kernels' floor
    ``max(amax, 1e-4) · (1/448)``; ``"flashmla"``: FlashMLA's ``max(amax / 448, 1e-4)`` (the
    names of ``mla.reference.fp8_model1.ue8m0_exponent``)."""
    if scale_floor not in FLOORS:
        raise ValueError(f"scale_floor must be one of {FLOORS} (floor amax at 1e-4, vLLM's "
                         f"Triton kernels; or amax / 448, FlashMLA's tests/quant.py), got "
                         f"{scale_floor!r}")
    x = _check_k(k)
    blocks = x.unflatten(-1, (FP8_BLOCKS, FP8_BLOCK))
    amax = _nan_ignoring_amax(blocks)
    if scale_floor == "vllm":
        s = torch.maximum(amax, _f32(SCALE_FLOOR)) * _f32(1.0 / FP8_MAX)
    else:
        s = torch.maximum(amax / _f32(FP8_MAX), _f32(SCALE_FLOOR))
    inf = torch.isinf(s)
    e = _ceil_log2(torch.where(inf, 1.0, s))
    code = torch.where(inf, UE8M0_NAN, (e + UE8M0_BIAS).clamp(0, UE8M0_NAN)).to(torch.uint8)
    # 2^-e lies in [2^-120, 2^22] for finite float32 input: a float32 normal, the product exact
    mult = torch.where(inf, 0.0, torch.pow(2.0, -e.double())).to(_F32)
    scaled = (blocks * mult[..., None]).clamp(-FP8_MAX, FP8_MAX).flatten(-2)
    q = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(torch.isnan(scaled), E4M3_NAN, q).to(torch.uint8)
    return torch.cat([q, code], dim=-1)


def dequantize_fp8_v41(records: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16
                       ) -> torch.Tensor:
    """``uint8 [..., 528]`` MXFP8 records (a ``float8_e4m3fn`` tensor of the same bytes too)
    -> ``[..., 512]`` of ``dtype``: ``e4m3 · 2^(byte − 127)``, byte 255 and e4m3 NaN -> NaN."""
    rec = _check_records("records", records, FP8_V41_BYTES, "DeepSeek-V4.1 MXFP8 528-byte")
    dtype = _check_dtype(dtype)
    q = rec[..., :D].contiguous().view(torch.float8_e4m3fn).double()
    code = rec[..., D:].double()
    scale = torch.where(code == UE8M0_NAN, float("nan"), torch.pow(2.0, code - UE8M0_BIAS))
    out = q.unflatten(-1, (FP8_BLOCKS, FP8_BLOCK)) * scale[..., None]
    return out.flatten(-2).to(dtype)


def e2m1_rne(v: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (``uint8``, 0..15) of float ``v``: nearest, ties to the even code, above 6
    saturating to 6, the sign bit from ``v``'s sign (``-0`` -> 8); NaN -> 7, as saturated."""
    m = v.double().abs()
    r = torch.where(m < 2.0, torch.round(m * 2.0) / 2.0,  # steps 0.5, 1, 2; round(): half even
                    torch.where(m < 4.0, torch.round(m), torch.round(m / 2.0) * 2.0))
    r = torch.where(torch.isnan(r), E2M1_MAX, r).clamp_max(E2M1_MAX)
    # value -> code: 0, .5, 1, 1.5 -> 0..3; 2, 3, 4, 6 -> 4, 5, 6, 7
    mag = torch.where(r < 2.0, r * 2.0, torch.where(r < 6.0, r + 2.0, 7.0)).to(torch.uint8)
    sign = (torch.signbit(v) & ~torch.isnan(v)).to(torch.uint8) << 3
    return mag | sign


def quantize_nvfp4_v41(k: torch.Tensor) -> torch.Tensor:
    """``k [..., 512]`` (any float dtype; rounded to float32) -> ``uint8 [..., 288]`` NVFP4
    records (see the module doc): a block of 16 holding NaN or inf gets the NaN scale 0x7F."""
    x = _check_k(k)
    blocks = x.unflatten(-1, (NVFP4_BLOCKS, NVFP4_BLOCK))
    amax = _nan_ignoring_amax(blocks)
    s = (amax * _f32(1.0 / E2M1_MAX)).clamp(E4M3_MIN_SUBNORMAL, FP8_MAX)
    scale = s.to(torch.float8_e4m3fn)
    v = blocks / scale.to(_F32)[..., None]  # float32 division, correctly rounded
    codes = e2m1_rne(v).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    finite = torch.isfinite(blocks).all(dim=-1)
    sbytes = torch.where(finite, scale.view(torch.uint8), E4M3_NAN).to(torch.uint8)
    return torch.cat([packed, sbytes], dim=-1)


def dequantize_nvfp4_v41(records: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16
                         ) -> torch.Tensor:
    """``uint8 [..., 288]`` NVFP4 records (or ``float8_e4m3fn`` of the same bytes) ->
    ``[..., 512]`` of ``dtype``: ``e2m1 · e4m3 scale``, a NaN scale -> its 16 values NaN."""
    rec = _check_records("records", records, NVFP4_V41_BYTES, "DeepSeek-V4.1 NVFP4 288-byte")
    dtype = _check_dtype(dtype)
    packed = rec[..., :NVFP4_CODE_BYTES].long()
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float64,
                         device=rec.device)
    vals = table[codes]
    scale = rec[..., NVFP4_CODE_BYTES:].contiguous().view(torch.float8_e4m3fn).double()
    out = vals.unflatten(-1, (NVFP4_BLOCKS, NVFP4_BLOCK)) * scale[..., None]
    return out.flatten(-2).to(dtype)
