"""FP8 formats of DeepSeek-V3.2: the ``fp8_ds_mla`` latent cache and the indexer's ``act_quant``.

conventions §10 (FlashMLA's interface and ``tests/quant.py``; vLLM's ``flashmla_sparse.py``).

``fp8_ds_mla``: one token's cached row is 656 bytes,

    bytes [  0, 512)   kv_c as 512 float8_e4m3fn, quantized per tile of 128 values
    bytes [512, 528)   4 float32 *inverse* scales, one per tile:   kv_c ≈ fp8 · scale
    bytes [528, 656)   k_pe as 64 bfloat16, not quantized

    scale_tile = 2^ceil(log2(max(amax_tile / 448, 1e-4)))       (a power of two, "ue8m0")
    fp8        = round_to_e4m3(kv_c / scale_tile)

Everything is computed in float32, as FlashMLA's quantizer does (the kernels see bf16, which
float32 holds exactly): a float64 ``kv_c`` is rounded to float32 first. Dividing by a power of
two is exact, so the one rounding is the cast to e4m3, whose 3 mantissa bits give, for
``v = kv_c / scale`` and round-to-nearest:

    |v| >= 2^-6  (normal)      |error| <= 2^-4 · |v|       (half an ulp of 2^(e-3), |v| >= 2^e)
    |v| <  2^-6  (subnormal)   |error| <= 2^-10            (half the subnormal step 2^-9)

and ``|v| <= 448`` by construction of the scale, so nothing saturates. Times ``scale``:
``|kv_c - dequant| <= max(2^-4 · |kv_c|, 2^-10 · scale)``. The 1e-4 floor puts a lower bound
``2^-13`` on the scale: a tile whose ``amax < 448e-4 ≈ 0.045`` keeps ``scale = 2^-13``, so its
values below ``2^-19`` land in e4m3's subnormals (absolute error ``<= 2^-23``), values below
``2^-23`` round to zero, and an all-zero tile stores zeros with ``scale = 2^-13``.
Dequantizing gives bf16 exactly (a 4-bit significand times a power of two fits bf16's 8 bits).

``act_quant`` is the DeepSeek-V3.2 inference code's activation quantizer, used by the indexer on
its rotated q and k: per block of ``block_size`` values, ``amax = max(amax, 1e-4)``,
``s = amax / 448`` (with ``scale_fmt="ue8m0"``: rounded up to a power of two),
``y = e4m3(clamp(x / s, ±448))``. Note the floor sits on ``amax`` there and on ``amax / 448`` in
``fp8_ds_mla``.
"""

from __future__ import annotations

import torch

from mla.reference.paged_cache import cache_rows
from mla.validation import check_float, check_index, check_same_device, check_tensor

__all__ = [
    "FP8_DS_MLA_BYTES", "FP8_MAX", "act_quant", "concat_and_cache_fp8_ds_mla",
    "dequantize_fp8_ds_mla", "fp8_ds_mla_scales", "gather_and_upconvert_fp8_ds_mla",
    "quantize_fp8_ds_mla",
]

D_NOPE = 512  # kv_c values per token
D_ROPE = 64  # k_pe values per token
TILE = 128  # kv_c values per scale
NUM_TILES = D_NOPE // TILE
SCALE_OFFSET = D_NOPE  # bytes [512, 528): the scales
ROPE_OFFSET = D_NOPE + 4 * NUM_TILES  # bytes [528, 656): k_pe
FP8_DS_MLA_BYTES = ROPE_OFFSET + 2 * D_ROPE  # 656
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_FLOOR = 1e-4  # floor of amax / 448 (FlashMLA's, after HFAI's FP8_AMAX_MARGIN)

_BYTE_DTYPES = (torch.uint8, torch.float8_e4m3fn)


def fp8_ds_mla_scales(kv_c: torch.Tensor) -> torch.Tensor:
    """Inverse scales ``[..., 4]`` float32 of ``kv_c [..., 512]``: powers of two, ``>= 2^-13``."""
    check_float("kv_c", kv_c)
    if kv_c.dim() < 1 or kv_c.shape[-1] != D_NOPE:
        raise ValueError(f"kv_c must have shape [..., {D_NOPE}], got {list(kv_c.shape)}")
    amax = kv_c.float().unflatten(-1, (NUM_TILES, TILE)).abs().amax(dim=-1)
    return torch.pow(2.0, torch.log2((amax / FP8_MAX).clamp_min(SCALE_FLOOR)).ceil())


def quantize_fp8_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Pack ``kv_c [..., 512]`` and ``k_pe [..., 64]`` into ``uint8 [..., 656]`` rows."""
    check_float("kv_c", kv_c)
    check_float("k_pe", k_pe)
    if kv_c.dim() < 1 or kv_c.shape[-1] != D_NOPE:
        raise ValueError(f"kv_c must have shape [..., {D_NOPE}] (fp8_ds_mla stores exactly "
                         f"{D_NOPE} latent values), got {list(kv_c.shape)}")
    if list(k_pe.shape) != [*kv_c.shape[:-1], D_ROPE]:
        raise ValueError(f"k_pe must have shape {[*kv_c.shape[:-1], D_ROPE]} (kv_c's leading "
                         f"dims, {D_ROPE} rope values), got {list(k_pe.shape)}")
    check_same_device(kv_c=kv_c, k_pe=k_pe)
    scales = fp8_ds_mla_scales(kv_c)  # [..., 4]
    tiles = kv_c.float().unflatten(-1, (NUM_TILES, TILE)) / scales[..., None]
    nope = tiles.flatten(-2).to(torch.float8_e4m3fn)
    return torch.cat([
        nope.view(torch.uint8),
        scales.contiguous().view(torch.uint8),
        k_pe.to(torch.bfloat16).contiguous().view(torch.uint8),
    ], dim=-1)


def _check_packed(name: str, packed: torch.Tensor) -> torch.Tensor:
    check_tensor(name, packed, dtype=_BYTE_DTYPES)
    if packed.dim() < 1 or packed.shape[-1] != FP8_DS_MLA_BYTES:
        raise ValueError(f"{name} must have shape [..., {FP8_DS_MLA_BYTES}] (fp8_ds_mla rows), "
                         f"got {list(packed.shape)}")
    return packed.view(torch.uint8)


def dequantize_fp8_ds_mla(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``uint8 [..., 656]`` rows -> ``(kv_c [..., 512], k_pe [..., 64])``, both bfloat16.

    A ``float8_e4m3fn`` tensor holding the same bytes (FlashMLA's tests use that dtype) is
    accepted too.
    """
    packed = _check_packed("packed", packed)
    nope = packed[..., :SCALE_OFFSET].contiguous().view(torch.float8_e4m3fn).float()
    scales = packed[..., SCALE_OFFSET:ROPE_OFFSET].contiguous().view(torch.float32)
    k_pe = packed[..., ROPE_OFFSET:].contiguous().view(torch.bfloat16)
    kv_c = (nope.unflatten(-1, (NUM_TILES, TILE)) * scales[..., None]).flatten(-2)
    return kv_c.to(torch.bfloat16), k_pe


def check_fp8_write_args(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, contiguous: bool = False) -> torch.Tensor:
    """The shape/dtype/device checks of an ``fp8_ds_mla`` cache write (reference and fast);
    returns ``k_pe`` as ``[T, 64]`` (a ``[T, 1, 64]`` input is accepted)."""
    check_tensor("kv_cache", kv_cache, ndim=3, dtype=_BYTE_DTYPES, contiguous=contiguous)
    if kv_cache.shape[2] != FP8_DS_MLA_BYTES:
        raise ValueError(f"kv_cache must have shape [num_blocks, block_size, "
                         f"{FP8_DS_MLA_BYTES}] (fp8_ds_mla), got {list(kv_cache.shape)}")
    if k_pe.dim() == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe[:, 0]
    check_float("kv_c", kv_c, shape=[None, D_NOPE])
    T = kv_c.shape[0]
    check_float("k_pe", k_pe, shape=[T, D_ROPE])
    check_index("slot_mapping", slot_mapping, shape=[T])
    check_same_device(kv_cache=kv_cache, kv_c=kv_c, k_pe=k_pe, slot_mapping=slot_mapping)
    return k_pe


def concat_and_cache_fp8_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                                slot_mapping: torch.Tensor) -> None:
    """Quantize ``kv_c [T, 512]``, ``k_pe [T, 64]`` (or ``[T, 1, 64]``) into ``kv_cache`` in place.

    ``kv_cache [num_blocks, block_size, 656]`` uint8; slot ``-1`` is padding and is skipped
    (vLLM's ``concat_and_cache_mla`` with ``kv_cache_dtype="fp8_ds_mla"``).
    """
    k_pe = check_fp8_write_args(kv_c, k_pe, kv_cache, slot_mapping)
    n_slots = kv_cache.shape[0] * kv_cache.shape[1]
    slots = slot_mapping.long()
    if slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= n_slots):
        raise ValueError(f"slot_mapping must lie in [-1, {n_slots}) (-1 = padding), got range "
                         f"[{int(slots.min())}, {int(slots.max())}]")
    keep = slots >= 0
    rows = quantize_fp8_ds_mla(kv_c[keep], k_pe[keep])
    kv_cache.view(torch.uint8).view(n_slots, FP8_DS_MLA_BYTES)[slots[keep]] = rows


def check_gather_fp8_ds_mla_shapes(src_cache: torch.Tensor, dst: torch.Tensor,
                                   block_table: torch.Tensor, seq_lens: torch.Tensor,
                                   workspace_starts: torch.Tensor, batch_size: int) -> None:
    """The shape/dtype/device checks of ``gather_and_upconvert_fp8_ds_mla`` (reference and
    fast): host metadata only."""
    check_tensor("src_cache", src_cache, ndim=3, dtype=_BYTE_DTYPES)
    if src_cache.shape[2] != FP8_DS_MLA_BYTES:
        raise ValueError(f"src_cache must have shape [num_blocks, block_size, "
                         f"{FP8_DS_MLA_BYTES}], got {list(src_cache.shape)}")
    check_float("dst", dst, shape=[None, D_NOPE + D_ROPE])
    check_index("block_table", block_table, ndim=2)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise TypeError(f"batch_size must be an int, got {type(batch_size).__name__}")
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    check_index("seq_lens", seq_lens, shape=[batch_size])
    check_index("workspace_starts", workspace_starts, shape=[batch_size])
    check_same_device(src_cache=src_cache, dst=dst, block_table=block_table, seq_lens=seq_lens,
                      workspace_starts=workspace_starts)
    if block_table.shape[0] < batch_size:
        raise ValueError(f"block_table must have at least batch_size={batch_size} rows, "
                         f"got {block_table.shape[0]}")


def check_gather_fp8_ds_mla_values(src_cache: torch.Tensor, dst: torch.Tensor,
                                   block_table: torch.Tensor, seq_lens: torch.Tensor,
                                   workspace_starts: torch.Tensor, batch_size: int
                                   ) -> list[tuple[int, int]]:
    """The value checks of ``gather_and_upconvert_fp8_ds_mla`` on checked shapes: every
    request's rows fit ``dst`` and the block table, and its used block-table entries name
    blocks of ``src_cache``. One device-to-host transfer; returns ``(seq_len, start)`` per
    request."""
    nb, bs, _ = src_cache.shape
    B, width = batch_size, block_table.shape[1]
    values = torch.cat([seq_lens.long(), workspace_starts.long(),
                        block_table[:B].long().reshape(-1)]).tolist()
    requests = list(zip(values[:B], values[B:2 * B]))
    for b, (n, start) in enumerate(requests):
        if n < 0 or start < 0 or start + n > dst.shape[0]:
            raise ValueError(f"request {b}: rows [{start}, {start + n}) do not fit dst's "
                             f"{dst.shape[0]} rows (seq_lens / workspace_starts)")
        if -(-n // bs) > width:
            raise ValueError(f"request {b}: seq_lens {n} needs more than block_table's "
                             f"{width} blocks of {bs}")
        # a -1 entry would silently read the last block
        used = values[2 * B + b * width: 2 * B + b * width + -(-n // bs)]
        if used and (min(used) < 0 or max(used) >= nb):
            raise ValueError(f"block_table[{b}] points outside src_cache's {nb} blocks within "
                             f"its first {n} tokens: range [{min(used)}, {max(used)}]")
    return requests


def gather_and_upconvert_fp8_ds_mla(src_cache: torch.Tensor, dst: torch.Tensor,
                                    block_table: torch.Tensor, seq_lens: torch.Tensor,
                                    workspace_starts: torch.Tensor, batch_size: int
                                    ) -> torch.Tensor:
    """Dequantize each request's first ``seq_lens[b]`` rows into ``dst`` at ``workspace_starts[b]``.

    vLLM's ``cp_gather_and_upconvert_fp8_kv_cache``: ``dst [W, 576]`` receives
    ``kv_c ‖ k_pe`` of token ``i`` of request ``b`` in row ``workspace_starts[b] + i``
    (the workspace the sparse prefill kernel reads through the converted indices). The values
    are bf16 numbers, exact in any float dtype of ``dst`` at least as wide. Rows of two
    requests that overlap in ``dst`` are written in request order (the last wins).
    """
    check_gather_fp8_ds_mla_shapes(src_cache, dst, block_table, seq_lens, workspace_starts,
                                   batch_size)
    # every request checked before a row is written
    requests = check_gather_fp8_ds_mla_values(src_cache, dst, block_table, seq_lens,
                                              workspace_starts, batch_size)
    for b, (n, start) in enumerate(requests):
        kv_c, k_pe = dequantize_fp8_ds_mla(cache_rows(src_cache.view(torch.uint8),
                                                      block_table[b], 0, n))
        dst[start:start + n] = torch.cat([kv_c, k_pe], dim=-1).to(dst.dtype)
    return dst


def act_quant(x: torch.Tensor, block_size: int = 128,
              scale_fmt: str | None = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise e4m3 quantization of the last dim: ``(y fp8 [..., D], s float32 [..., D/bs])``.

    ``x ≈ y · s`` block by block. ``scale_fmt="ue8m0"`` (DeepSeek-V3.2's setting) rounds ``s``
    up to a power of two; ``None`` keeps ``s = amax / 448``.
    """
    check_float("x", x)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if x.dim() < 1 or x.shape[-1] % block_size:
        raise ValueError(f"x's last dim must be a multiple of block_size={block_size}, "
                         f"got shape {list(x.shape)}")
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"scale_fmt must be None or 'ue8m0', got {scale_fmt!r}")
    blocks = x.float().unflatten(-1, (x.shape[-1] // block_size, block_size))
    s = blocks.abs().amax(dim=-1).clamp_min(1e-4) / FP8_MAX
    if scale_fmt == "ue8m0":
        s = torch.pow(2.0, torch.log2(s).ceil())
    y = (blocks / s[..., None]).clamp(-FP8_MAX, FP8_MAX).flatten(-2).to(torch.float8_e4m3fn)
    return y, s
