"""The lightning indexer's key cache (DeepSeek-V3.2): 128 e4m3 values and one float32 scale.

conventions §10 ("Indexer key cache"). vLLM's ``indexer_k_quant_and_cache`` (csrc
``cache_kernels.cu``) writes it and DeepGEMM's ``fp8_paged_mqa_logits`` reads it. Per token
``k [128]`` (the indexer's normed, rotated key):

    amax   = max_i |k_i|                       (NaN ignored, as CUDA's fmaxf does)
    scale  = max(amax, 1e-4) / 448             float32
    scale  = 2^ceil(log2(scale))               with scale_fmt = "ue8m0" (DeepSeek-V3.2's)
    code_i = e4m3(clamp(k_i / scale, ±448))    round to nearest even; k ≈ code · scale

**Page layout.** The cache is ``uint8 [num_blocks, block_size, 132]`` (``132 = 128 + 4``), but
a page is *not* an array of 132-byte token rows: its ``block_size · 132`` bytes hold first the
128 value bytes of every token of the page, then the 4 scale bytes of every token.
Token ``o`` of page ``b`` (slot ``b · block_size + o``):

    values   bytes [o · 128, o · 128 + 128)                 of page b
    scale    bytes [block_size · 128 + 4·o, ... + 4)        of page b, float32 little-endian

so ``kv_cache[b, o]`` is token ``o``'s row only when ``block_size = 1``. DeepGEMM views the
same bytes as ``[num_blocks, block_size, 1, 132]`` and loads a page's values and its scales with
two copies. A slot of ``-1`` is padding: skipped, nothing written.

The quantizer works in float32: a bf16 ``k`` (what vLLM passes) is exact there, the division by
a power of two is exact, and the one rounding is the cast to e4m3 (relative error ``<= 2^-4``
for normal codes). ``act_quant`` (``mla.reference.fp8``) is the same rule for one block of 128.
"""

from __future__ import annotations

import torch

from mla.reference.fp8 import FP8_MAX
from mla.validation import check_float, check_index, check_same_device, check_tensor

__all__ = ["INDEX_DIM", "INDEX_K_BYTES", "indexer_k_scales", "quantize_indexer_k",
           "indexer_k_quant_and_cache", "read_indexer_k_cache", "dequantize_indexer_k",
           "gather_indexer_k_cache"]

INDEX_DIM = 128  # values per token (DeepSeek-V3.2's index_head_dim), one scale for them all
INDEX_K_BYTES = INDEX_DIM + 4  # 132 bytes of a page per token
AMAX_FLOOR = 1e-4
_BYTE_DTYPES = (torch.uint8, torch.float8_e4m3fn)


def _check_scale_fmt(scale_fmt: str | None) -> None:
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"scale_fmt must be None or 'ue8m0', got {scale_fmt!r}")


def indexer_k_scales(k: torch.Tensor, scale_fmt: str | None = "ue8m0") -> torch.Tensor:
    """float32 ``[T]`` scales of ``k [T, 128]``: ``max(amax, 1e-4) / 448`` (a power of two
    rounded up with ``"ue8m0"``)."""
    check_float("k", k, shape=[None, INDEX_DIM])
    _check_scale_fmt(scale_fmt)
    a = k.float().abs()
    amax = torch.where(torch.isnan(a), 0.0, a).amax(dim=-1)
    scale = amax.clamp_min(AMAX_FLOOR) / FP8_MAX
    if scale_fmt == "ue8m0":
        scale = torch.pow(2.0, torch.log2(scale).ceil())
    return scale


def quantize_indexer_k(k: torch.Tensor, scale_fmt: str | None = "ue8m0"
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``k [T, 128]`` -> ``(codes uint8 [T, 128], scales float32 [T])``, ``k ≈ e4m3(codes)·s``."""
    scale = indexer_k_scales(k, scale_fmt)
    v = (k.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX)  # NaN stays NaN (SATFINITE)
    return v.to(torch.float8_e4m3fn).view(torch.uint8), scale


def _check_cache(name: str, kv_cache: torch.Tensor, contiguous: bool = False) -> torch.Tensor:
    check_tensor(name, kv_cache, ndim=3, dtype=_BYTE_DTYPES, contiguous=contiguous)
    if kv_cache.shape[2] != INDEX_K_BYTES:
        raise ValueError(f"{name} must have shape [num_blocks, block_size, {INDEX_K_BYTES}] "
                         f"(the indexer key cache), got {list(kv_cache.shape)}")
    return kv_cache.view(torch.uint8)


def _byte_offsets(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slot, the offsets into a page-flat byte view of its 128 values and 4 scale bytes."""
    page, o = slots // block_size, slots % block_size
    base = page * (block_size * INDEX_K_BYTES)
    values = base[:, None] + o[:, None] * INDEX_DIM + torch.arange(INDEX_DIM,
                                                                    device=slots.device)
    scale = (base[:, None] + block_size * INDEX_DIM + o[:, None] * 4
             + torch.arange(4, device=slots.device))
    return values, scale


def _check_slots(name: str, slots: torch.Tensor, n_slots: int, padding: bool) -> torch.Tensor:
    s = slots.long()
    low = -1 if padding else 0
    if s.numel() and (int(s.min()) < low or int(s.max()) >= n_slots):
        raise ValueError(f"{name} must lie in [{low}, {n_slots})"
                         f"{' (-1 = padding)' if padding else ''}, got range "
                         f"[{int(s.min())}, {int(s.max())}]")
    return s


def indexer_k_quant_and_cache(k: torch.Tensor, kv_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, quant_block_size: int = INDEX_DIM,
                              scale_fmt: str | None = "ue8m0") -> None:
    """Quantize ``k [T, 128]`` into the indexer key cache in place (vLLM's signature).

    ``kv_cache uint8 [num_blocks, block_size, 132]`` in the page layout of the module doc;
    ``slot_mapping [T]``, ``-1`` = padding (skipped). ``quant_block_size`` must be 128: one
    scale per token, as DeepSeek-V3.2 runs it.
    """
    kv = _check_cache("kv_cache", kv_cache, contiguous=True)  # written through a flat view
    check_float("k", k, shape=[None, INDEX_DIM])
    check_index("slot_mapping", slot_mapping, shape=[k.shape[0]])
    check_same_device(k=k, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if quant_block_size != INDEX_DIM:
        raise ValueError(f"quant_block_size must be {INDEX_DIM} (one float32 scale per token "
                         f"in 132 bytes), got {quant_block_size!r}")
    _check_scale_fmt(scale_fmt)
    nb, bs, _ = kv.shape
    slots = _check_slots("slot_mapping", slot_mapping, nb * bs, padding=True)
    keep = slots >= 0
    codes, scale = quantize_indexer_k(k[keep], scale_fmt)
    values_at, scale_at = _byte_offsets(slots[keep], bs)
    flat = kv.view(-1)
    flat[values_at.reshape(-1)] = codes.reshape(-1)
    flat[scale_at.reshape(-1)] = scale.contiguous().view(torch.uint8).reshape(-1)


def read_indexer_k_cache(kv_cache: torch.Tensor, slots: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens at ``slots [n]``: ``(codes float8_e4m3fn [n, 128], scales float32 [n])``."""
    kv = _check_cache("kv_cache", kv_cache)
    check_index("slots", slots, ndim=1)
    check_same_device(kv_cache=kv_cache, slots=slots)
    nb, bs, _ = kv.shape
    s = _check_slots("slots", slots, nb * bs, padding=False)
    values_at, scale_at = _byte_offsets(s, bs)
    flat = kv.reshape(-1)
    codes = flat[values_at].view(torch.float8_e4m3fn)
    scale = flat[scale_at].contiguous().view(torch.float32).reshape(-1)
    return codes, scale


def dequantize_indexer_k(codes: torch.Tensor, scale: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes [n, 128]`` (e4m3 or its bytes) times ``scale [n]``, in ``dtype`` (exact in
    float32 for power-of-two scales)."""
    check_tensor("codes", codes, ndim=2, dtype=_BYTE_DTYPES)
    check_float("scale", scale, shape=[codes.shape[0]])
    return codes.view(torch.float8_e4m3fn).to(dtype) * scale.to(dtype)[:, None]


def check_gather_indexer_k_shapes(kv_cache: torch.Tensor, block_table: torch.Tensor,
                                  cu_seq_lens: torch.Tensor) -> None:
    """The shape/dtype/device checks of ``gather_indexer_k_cache`` (reference and fast)."""
    _check_cache("kv_cache", kv_cache)
    check_index("block_table", block_table, ndim=2)
    check_index("cu_seq_lens", cu_seq_lens, shape=[block_table.shape[0] + 1])
    check_same_device(kv_cache=kv_cache, block_table=block_table, cu_seq_lens=cu_seq_lens)


def check_gather_indexer_k_values(kv_cache: torch.Tensor, block_table: torch.Tensor,
                                  cu_seq_lens: torch.Tensor) -> list[int]:
    """The value checks of ``gather_indexer_k_cache`` on checked shapes: no request's length
    ``cu_seq_lens[b+1] - cu_seq_lens[b]`` is negative or needs more blocks than the table has,
    and the block-table entries its tokens use name blocks of ``kv_cache``. One
    device-to-host transfer; returns ``cu_seq_lens`` as a list."""
    nb, bs, _ = kv_cache.shape
    B, width = block_table.shape
    values = torch.cat([cu_seq_lens.long(), block_table.long().reshape(-1)]).tolist()
    cu = values[:B + 1]
    for b in range(B):
        n = cu[b + 1] - cu[b]
        if n < 0 or -(-n // bs) > width:
            raise ValueError(f"request {b}: length {n} from cu_seq_lens does not fit "
                             f"block_table's {width} blocks of {bs}")
        used = values[B + 1 + b * width: B + 1 + b * width + -(-n // bs)]
        if used and (min(used) < 0 or max(used) >= nb):
            raise ValueError(f"block_table[{b}] points outside kv_cache's {nb} blocks within "
                             f"its first {n} tokens: range [{min(used)}, {max(used)}]")
    return cu


def gather_indexer_k_cache(kv_cache: torch.Tensor, block_table: torch.Tensor,
                           cu_seq_lens: torch.Tensor, *, num_tokens: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's first ``cu_seq_lens[b+1] - cu_seq_lens[b]`` tokens, concatenated (vLLM's
    ``cp_gather_indexer_k_quant_cache``): ``(codes e4m3 [N, 128], scales float32 [N])``, the
    ragged keys ``fp8_mqa_logits`` reads; ``N = cu_seq_lens[-1] - cu_seq_lens[0]``.
    ``num_tokens``: ``N`` where the caller knows it (the fast gather sizes its output by it
    without reading ``cu_seq_lens``); here it is checked against ``cu_seq_lens``."""
    check_gather_indexer_k_shapes(kv_cache, block_table, cu_seq_lens)
    cu = check_gather_indexer_k_values(kv_cache, block_table, cu_seq_lens)
    if num_tokens is not None and num_tokens != cu[-1] - cu[0]:
        raise ValueError(f"num_tokens must be cu_seq_lens[-1] - cu_seq_lens[0] = "
                         f"{cu[-1] - cu[0]}, got {num_tokens!r}")
    bs = kv_cache.shape[1]
    slots = []
    for b in range(block_table.shape[0]):
        pos = torch.arange(cu[b + 1] - cu[b], device=kv_cache.device)
        slots.append(block_table[b].long()[pos // bs] * bs + pos % bs)
    return read_indexer_k_cache(kv_cache, torch.cat(slots) if slots else
                                torch.zeros(0, dtype=torch.long, device=kv_cache.device))
