"""DeepSeek-V4's FP8 sparse cache, FlashMLA's "MODEL1" layout: laid out by page, not by token.

conventions §14 (FlashMLA's ``flash_mla_interface.py``, "For DeepSeek V4", and
``tests/quant.py``, ``quantize_k_cache`` / ``dequantize_k_cache`` with ``MODEL1_FP8Sparse``).

A token's row is ``d_qk = 512`` values: 448 "nope" values in 7 tiles of 64, quantized to e4m3
with one power-of-two scale per tile, then 64 rope values kept in bfloat16. A page (one block
of ``block_size`` tokens) holds, in this order,

    bytes [0, 576·bs)           bs data rows of 576 bytes: 448 e4m3 nope bytes, then the
                                64 rope values as bfloat16 (128 bytes, little-endian)
    bytes [576·bs, 584·bs)      bs scale rows of 8 bytes: 7 UE8M0 scales, tile order, then
                                one unused byte (written 0 here; FlashMLA leaves it unset)
    bytes [584·bs, page_bytes)  padding to a multiple of 576 bytes (written 0 here)

so a token costs 584 bytes and ``page_bytes = ceil(584·bs / 576) · 576``. The kernels take
the strided ``[num_blocks, bs, 584]`` view of the pages' first ``584·bs`` bytes
(``fp8_model1_cache``), from which they find the page by the block stride.

Quantization, per tile, in float32 as FlashMLA's (a float64 cache is rounded to float32 first):

    scale = 2^ceil(log2(max(amax / 448, 1e-4)))      stored as UE8M0: the byte log2(scale) + 127
    e4m3  = round_to_e4m3(nope / scale)

the same rule as ``fp8_ds_mla`` (conventions §10), with tiles of 64 instead of 128 and the
scale's exponent byte instead of a float32. So ``|nope − dequant| <= max(2^-4·|nope|,
2^-10·scale)``, ``scale >= 2^-13``, nothing saturates, and the dequantized value
``e4m3 · scale`` is a bfloat16 number exactly. A tile holding NaN or ±inf gets the UE8M0 NaN
byte 0xFF, so its 64 values dequantize to NaN (NaN in, NaN out). The rope values are rounded
to bfloat16 (the cache stores nothing wider).
"""

from __future__ import annotations

import torch

from mla.reference.fp8 import FP8_MAX, SCALE_FLOOR
from mla.validation import check_float, check_positive_int, check_tensor

__all__ = [
    "FP8_MODEL1_BYTES", "dequantize_fp8_model1", "fp8_model1_cache", "fp8_model1_page_bytes",
    "fp8_model1_pages", "fp8_model1_rows", "quantize_fp8_model1", "round_fp8_model1",
    "ue8m0_exponent", "write_fp8_model1",
]

D_QK = 512  # a token's row: nope ‖ rope
D_NOPE = 448
D_ROPE = 64
TILE = 64  # nope values per scale
NUM_TILES = D_NOPE // TILE  # 7
DATA_BYTES = D_NOPE + 2 * D_ROPE  # 576: e4m3 nope ‖ bf16 rope
SCALE_BYTES = NUM_TILES + 1  # 8: 7 UE8M0 scales and one unused byte
FP8_MODEL1_BYTES = DATA_BYTES + SCALE_BYTES  # 584 per token
PAGE_ALIGN = 576  # a page is padded to a multiple of this many bytes
UE8M0_BIAS = 127
UE8M0_NAN = 0xFF

_BYTE_DTYPES = (torch.uint8, torch.float8_e4m3fn)


def fp8_model1_page_bytes(block_size: int) -> int:
    """Bytes of one page of ``block_size`` tokens: ``584 · block_size`` padded to 576."""
    check_positive_int("block_size", block_size)
    return -(-FP8_MODEL1_BYTES * block_size // PAGE_ALIGN) * PAGE_ALIGN


SCALE_FLOORS = ("flashmla", "vllm")


def _check_scale_floor(scale_floor: str) -> None:
    if scale_floor not in SCALE_FLOORS:
        raise ValueError(f"scale_floor must be one of {SCALE_FLOORS}, got {scale_floor!r}")


def ue8m0_exponent(amax: torch.Tensor, scale_floor: str = "flashmla") -> torch.Tensor:
    """``ceil(log2(s))`` of a tile's scale ``s`` (float32 ``amax`` in, float32 out).

    ``scale_floor="flashmla"``: ``s = max(amax / 448, 1e-4)`` (FlashMLA's ``tests/quant.py``
    and vLLM's CuTe compressor); ``"vllm"``: ``s = max(amax, 1e-4) / 448`` (vLLM 0.33's
    Triton cache writers, and its compiled window-cache insert by their comment). The scales
    differ only below ``amax = 448·2^-14 ≈ 0.027``: from there to ``0.0448`` both round up to
    the floor's ``2^-13``."""
    _check_scale_floor(scale_floor)
    if scale_floor == "flashmla":
        return torch.log2((amax / FP8_MAX).clamp_min(SCALE_FLOOR)).ceil()
    return torch.log2(amax.clamp_min(SCALE_FLOOR) / FP8_MAX).ceil()


def _ue8m0_scales(nope: torch.Tensor, scale_floor: str = "flashmla"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``nope [..., 448]`` float32 -> (scales float32 ``[..., 7]``, their UE8M0 bytes)."""
    amax = nope.unflatten(-1, (NUM_TILES, TILE)).abs().amax(dim=-1)
    exponent = ue8m0_exponent(amax, scale_floor)
    finite = torch.isfinite(exponent)
    scale = torch.where(finite, torch.pow(2.0, exponent), float("nan"))
    code = torch.where(finite, exponent + UE8M0_BIAS, UE8M0_NAN).to(torch.uint8)
    return scale, code


def quantize_fp8_model1(k_cache: torch.Tensor, *, scale_floor: str = "flashmla") -> torch.Tensor:
    """``k_cache [num_blocks, block_size, 512]`` (any float dtype) -> ``uint8 [num_blocks,
    fp8_model1_page_bytes(block_size)]`` pages. ``scale_floor``: see ``ue8m0_exponent``."""
    check_float("k_cache", k_cache, ndim=3)
    _check_scale_floor(scale_floor)
    num_blocks, bs, d = k_cache.shape
    if d != D_QK:
        raise ValueError(f"k_cache must have shape [num_blocks, block_size, {D_QK}] "
                         f"({D_NOPE} nope + {D_ROPE} rope), got {list(k_cache.shape)}")
    if bs == 0:
        raise ValueError(f"k_cache must have block_size >= 1, got shape {list(k_cache.shape)}")
    nope = k_cache[..., :D_NOPE].float()
    scale, code = _ue8m0_scales(nope, scale_floor)
    e4m3 = (nope.unflatten(-1, (NUM_TILES, TILE)) / scale[..., None]).flatten(-2)
    data = torch.cat([
        e4m3.to(torch.float8_e4m3fn).view(torch.uint8),
        k_cache[..., D_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8),
    ], dim=-1)  # [num_blocks, bs, 576]
    scales = torch.cat([code, code.new_zeros(num_blocks, bs, SCALE_BYTES - NUM_TILES)], dim=-1)
    pages = torch.zeros(num_blocks, fp8_model1_page_bytes(bs), dtype=torch.uint8,
                        device=k_cache.device)
    pages[:, :DATA_BYTES * bs] = data.reshape(num_blocks, DATA_BYTES * bs)
    pages[:, DATA_BYTES * bs:FP8_MODEL1_BYTES * bs] = scales.reshape(num_blocks, -1)
    return pages


def _check_pages(pages: torch.Tensor, block_size: int, *, unpadded_ok: bool = False
                 ) -> torch.Tensor:
    """``pages`` as uint8 ``[num_blocks, page_bytes]`` (or, ``unpadded_ok``, the ``[num_blocks,
    584 · block_size]`` view ``fp8_model1_pages`` gives)."""
    check_tensor("pages", pages, ndim=2, dtype=_BYTE_DTYPES)
    want = fp8_model1_page_bytes(block_size)
    if pages.shape[1] != want and not (unpadded_ok
                                       and pages.shape[1] == FP8_MODEL1_BYTES * block_size):
        also = f" or [num_blocks, {FP8_MODEL1_BYTES * block_size}]" if unpadded_ok else ""
        raise ValueError(f"pages must have shape [num_blocks, {want}]{also} (block_size="
                         f"{block_size}: {FP8_MODEL1_BYTES}·{block_size} bytes padded to a "
                         f"multiple of {PAGE_ALIGN}), got {list(pages.shape)}")
    if pages.stride(1) != 1:
        raise ValueError(f"pages must have unit stride in its last dim, got strides "
                         f"{pages.stride()}")
    return pages.view(torch.uint8)


def fp8_model1_cache(pages: torch.Tensor, block_size: int) -> torch.Tensor:
    """The ``[num_blocks, block_size, 584]`` view of ``pages`` that FlashMLA's kernel takes
    (``quantize_k_cache``'s result; the block stride is ``page_bytes``). Its bytes are the
    page's, not token ``i``'s row: read them through ``fp8_model1_rows``."""
    pages = _check_pages(pages, block_size)
    return pages[:, :FP8_MODEL1_BYTES * block_size].view(
        pages.shape[0], block_size, FP8_MODEL1_BYTES)


def fp8_model1_pages(kv_cache: torch.Tensor, *, name: str = "kv_cache") -> torch.Tensor:
    """The inverse of ``fp8_model1_cache``: ``uint8 [num_blocks, 584 · block_size]``, each
    row a page's bytes (padding excluded), a view of ``kv_cache [num_blocks, block_size,
    (1,) 584]``'s memory. ``name``: the argument's name in error messages."""
    check_tensor(name, kv_cache, ndim=(3, 4), dtype=_BYTE_DTYPES)
    num_blocks, bs = kv_cache.shape[:2]
    if kv_cache.shape[-1] != FP8_MODEL1_BYTES or (kv_cache.dim() == 4 and kv_cache.shape[2] != 1):
        raise ValueError(f"{name} must have shape [num_blocks, block_size, "
                         f"{FP8_MODEL1_BYTES}] or [num_blocks, block_size, 1, "
                         f"{FP8_MODEL1_BYTES}] (MODEL1), got {list(kv_cache.shape)}")
    strides = kv_cache.stride()
    # a page is one run of bytes: tokens one after another, blocks at least a page apart
    if (strides[-1] != 1 or strides[1] != FP8_MODEL1_BYTES
            or (num_blocks > 1 and strides[0] < FP8_MODEL1_BYTES * bs)):
        raise ValueError(f"{name} must be a view of whole MODEL1 pages (strides [>= "
                         f"{FP8_MODEL1_BYTES * bs}, {FP8_MODEL1_BYTES}, ..., 1], as "
                         f"fp8_model1_cache returns), got strides {list(strides)}")
    return torch.as_strided(kv_cache.view(torch.uint8), (num_blocks, FP8_MODEL1_BYTES * bs),
                            (strides[0], 1))


def _decode(data: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Data rows ``uint8 [..., 576]`` and scale bytes ``uint8 [..., 7]`` -> bf16 ``[..., 512]``."""
    nope = data[..., :D_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    rope = data[..., D_NOPE:].contiguous().view(torch.bfloat16)
    exponent = codes.float() - UE8M0_BIAS
    scale = torch.where(codes == UE8M0_NAN, float("nan"), torch.pow(2.0, exponent))
    nope = (nope.unflatten(-1, (NUM_TILES, TILE)) * scale[..., None]).flatten(-2)
    return torch.cat([nope.to(torch.bfloat16), rope], dim=-1)


def fp8_model1_rows(pages: torch.Tensor, block_size: int, slots: torch.Tensor) -> torch.Tensor:
    """Dequantize the tokens at global ``slots`` (``block · block_size + offset``, any shape,
    all valid) of ``pages [num_blocks, >= 584 · block_size]``: bf16 ``[*slots.shape, 512]``.

    Reads only those tokens' bytes (the pages are not unpacked whole)."""
    slots = slots.long()
    block = torch.div(slots, block_size, rounding_mode="floor")[..., None]
    offset = (slots % block_size)[..., None]
    data_cols = offset * DATA_BYTES + torch.arange(DATA_BYTES, device=pages.device)
    scale_cols = (DATA_BYTES * block_size + offset * SCALE_BYTES
                  + torch.arange(NUM_TILES, device=pages.device))
    return _decode(pages[block, data_cols], pages[block, scale_cols])


def round_fp8_model1(k: torch.Tensor, *, scale_floor: str = "flashmla") -> torch.Tensor:
    """The values a MODEL1 cache gives back for rows ``k [..., 512]``: quantize, dequantize.

    bf16 ``[..., 512]``, equal to ``dequantize_fp8_model1(quantize_fp8_model1(k))`` row by
    row, without building pages."""
    check_float("k", k)
    _check_scale_floor(scale_floor)
    if k.dim() < 1 or k.shape[-1] != D_QK:
        raise ValueError(f"k must have shape [..., {D_QK}] ({D_NOPE} nope + {D_ROPE} rope), "
                         f"got {list(k.shape)}")
    nope = k[..., :D_NOPE].float()
    scale, _ = _ue8m0_scales(nope, scale_floor)
    tiles = nope.unflatten(-1, (NUM_TILES, TILE)) / scale[..., None]
    e4m3 = tiles.to(torch.float8_e4m3fn).float() * scale[..., None]
    return torch.cat([e4m3.flatten(-2).to(torch.bfloat16), k[..., D_NOPE:].to(torch.bfloat16)],
                     dim=-1)


def write_fp8_model1(pages: torch.Tensor, block_size: int, slots: torch.Tensor,
                     rows: torch.Tensor, *, scale_floor: str = "flashmla") -> None:
    """Quantize ``rows [n, 512]`` into ``pages`` at global ``slots [n]`` (``block ·
    block_size + offset``), in place: each token's 576 data bytes and 8 scale bytes, as a
    cache writer does (``scale_floor``: see ``ue8m0_exponent``). ``pages``: whole pages, or
    the ``[num_blocks, 584 · block_size]`` view ``fp8_model1_pages`` gives."""
    pages = _check_pages(pages, block_size, unpadded_ok=True)
    check_float("rows", rows, ndim=2)
    if rows.shape[1] != D_QK:
        raise ValueError(f"rows must have shape [n, {D_QK}], got {list(rows.shape)}")
    if slots.shape != (rows.shape[0],):
        raise ValueError(f"slots must have shape [{rows.shape[0]}] (one per row), got "
                         f"{list(slots.shape)}")
    if rows.shape[0] == 0:
        return
    slots = slots.long().to(pages.device)
    if int(slots.min()) < 0 or int(slots.max()) >= pages.shape[0] * block_size:
        raise ValueError(f"slots must lie in [0, {pages.shape[0] * block_size}), got range "
                         f"[{int(slots.min())}, {int(slots.max())}]")
    one = quantize_fp8_model1(rows[:, None, :], scale_floor=scale_floor)  # pages of 1 token
    block = torch.div(slots, block_size, rounding_mode="floor")[:, None]
    offset = (slots % block_size)[:, None]
    data_cols = offset * DATA_BYTES + torch.arange(DATA_BYTES, device=pages.device)
    scale_cols = (DATA_BYTES * block_size + offset * SCALE_BYTES
                  + torch.arange(SCALE_BYTES, device=pages.device))
    pages[block, data_cols] = one[:, :DATA_BYTES]
    pages[block, scale_cols] = one[:, DATA_BYTES:FP8_MODEL1_BYTES]


def dequantize_fp8_model1(pages: torch.Tensor, block_size: int) -> torch.Tensor:
    """``uint8 [num_blocks, fp8_model1_page_bytes(block_size)]`` pages -> bf16
    ``[num_blocks, block_size, 512]`` (a ``float8_e4m3fn`` tensor of the same bytes is
    accepted too)."""
    pages = _check_pages(pages, block_size)
    num_blocks = pages.shape[0]
    slots = torch.arange(num_blocks * block_size, device=pages.device)
    return fp8_model1_rows(pages, block_size, slots.view(num_blocks, block_size))
