"""The sparse prefill's two gathers in Triton: each request's cached tokens, packed densely.

The reference's contracts (conventions §10), bit for bit:

- ``gather_and_upconvert_fp8_ds_mla`` (vLLM's ``cp_gather_and_upconvert_fp8_kv_cache``):
  ``dst[workspace_starts[b] + i] = kv_c ‖ k_pe`` of token ``i < seq_lens[b]`` of request
  ``b``, ``kv_c = e4m3 · scale_tile`` rounded to bf16, ``k_pe`` the row's bf16 values;
- ``gather_indexer_k_cache`` (vLLM's ``cp_gather_indexer_k_quant_cache``): output token
  ``cu[b] - cu[0] + i`` is token ``i < cu[b+1] - cu[b]`` of request ``b`` (codes and scale).

Why this shape. Both are copies whose floor is the bytes moved, called inside a step that
must not synchronize, so no host code maps rows to requests:

- latent: ``(requests, P)`` programs; program ``(b, p)`` walks request ``b``'s row tiles
  ``p, p + P, ...`` up to ``seq_lens[b]``, read on the device. ``P`` comes from shapes (a few
  programs an SM in all), so the work follows the rows written however the lengths spread.
- index keys: a program per tile of output tokens (their total ``N`` host-known through
  ``num_tokens``, or read once from ``cu_seq_lens``); each token finds its request by a binary
  search over ``cu_seq_lens`` (``ceil(log2 B)`` loads; no per-token request ids).

Scales and rope values are assembled from the cache's bytes, so the latent cache may have any
strides (the index key cache's pages must be contiguous: its layout is defined on a page's
flat bytes). ``e4m3 · scale`` is rounded to bf16 in integer arithmetic as torch rounds it
(a power-of-two scale, as a real cache holds, leaves nothing to round).

Validation (``validate``, ``mla.fast.common.should_validate``'s rule): the reference's value
checks, one host transfer each. Without them nothing is read on the host (but ``N`` where
``num_tokens`` is None) and the kernels stay inside their tensors:

- latent: a row outside ``[0, W)`` of ``dst`` is not written (a negative ``seq_lens`` writes
  nothing); a row whose block-table entry lies outside ``[0, num_blocks)`` or past the table's
  width is written as NaN. Requests whose rows overlap race (the reference: the last wins).
- index keys: a token whose block-table entry is bad, or past the tokens ``cu_seq_lens``
  counts (``num_tokens`` too large), gets NaN codes (0x7F) and a NaN scale; with
  ``cu_seq_lens`` decreasing a token belongs to whichever request the search finds, NaN if
  that request's length does not cover it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.fast.bits import bf16_round
from mla.fast.common import interpreting, num_sms, should_validate
from mla.fast.launch import CompiledLauncher, check_grid, int_spec, ptr_spec
from mla.reference.fp8 import (
    D_NOPE,
    D_ROPE,
    NUM_TILES,
    ROPE_OFFSET,
    SCALE_OFFSET,
    TILE,
    check_gather_fp8_ds_mla_shapes,
    check_gather_fp8_ds_mla_values,
)
from mla.reference.indexer_cache import (
    INDEX_DIM,
    INDEX_K_BYTES,
    check_gather_indexer_k_shapes,
    check_gather_indexer_k_values,
)

__all__ = ["gather_and_upconvert_fp8_ds_mla", "gather_indexer_k_cache"]

# the kernels' view of the row layouts (a jit function reads only constexpr globals)
_D_NOPE, _D_ROPE, _TILE = tl.constexpr(D_NOPE), tl.constexpr(D_ROPE), tl.constexpr(TILE)
_NUM_TILES, _SCALE_AT = tl.constexpr(NUM_TILES), tl.constexpr(SCALE_OFFSET)
_ROPE_AT = tl.constexpr(ROPE_OFFSET)
LATENT_ROWS = 16  # rows a latent tile: 16 x 512 float32 values in flight at 4 warps
KEY_TOKENS = 32  # tokens a program of the index-key gather
PROGRAMS_PER_SM = 8  # the latent grid's size, in programs an SM


@triton.jit
def _le_word(at, stride, mask):
    """The little-endian 32-bit word of the 4 bytes at ``at``, ``at + stride``, ... (uint32)."""
    w = tl.load(at, mask=mask, other=0).to(tl.uint32)
    w = w | (tl.load(at + stride, mask=mask, other=0).to(tl.uint32) << 8)
    w = w | (tl.load(at + 2 * stride, mask=mask, other=0).to(tl.uint32) << 16)
    return w | (tl.load(at + 3 * stride, mask=mask, other=0).to(tl.uint32) << 24)


@triton.jit
def _latent_kernel(
    cache, dst, block_table, seq_lens, workspace_starts,
    num_blocks, num_rows, table_width,
    s_c_b, s_c_t, s_c_d, s_d_r, s_d_c, s_bt_b, s_bt_p,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    # rows past dst's never land in it: bounding the length bounds the loop
    n = tl.minimum(tl.maximum(tl.load(seq_lens + b).to(tl.int64), 0), num_rows)
    start = tl.load(workspace_starts + b).to(tl.int64)
    tiles = tl.cdiv(n, BLOCK_T).to(tl.int32)
    for tile in range(tl.program_id(1), tiles, tl.num_programs(1)):
        i = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        row = start + i
        live = i < n
        store_ok = (live & (row >= 0) & (row < num_rows))[:, None]
        col = i // BLOCK_SIZE
        blk = tl.load(block_table + b * s_bt_b + col * s_bt_p, mask=live & (col < table_width),
                      other=-1).to(tl.int64)
        ok = live & (col < table_width) & (blk >= 0) & (blk < num_blocks)
        src = cache + blk * s_c_b + (i % BLOCK_SIZE) * s_c_t
        out = dst + row * s_d_r
        t4 = tl.arange(0, _NUM_TILES)  # kv_c: [BLOCK_T, 4, 128] e4m3 · the tile's scale
        scale_at = src[:, None] + (t4 * 4 + _SCALE_AT)[None, :] * s_c_d
        scale = _le_word(scale_at, s_c_d, ok[:, None]).to(tl.float32, bitcast=True)
        d = t4[:, None] * _TILE + tl.arange(0, _TILE)[None, :]
        raw = tl.load(src[:, None, None] + d[None, :, :] * s_c_d, mask=ok[:, None, None],
                      other=0)
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
        # e4m3's NaN codes: the interpreter's conversion reads them as +-480
        x = tl.where((raw & 0x7F) == 0x7F, float("nan"), x)
        x = bf16_round(x)  # nearest even, as torch rounds (NaN kept)
        x = tl.where(ok[:, None, None], x, float("nan"))
        tl.store(out[:, None, None] + d[None, :, :] * s_d_c, x.to(dst.dtype.element_ty),
                 mask=store_ok[:, :, None])
        # k_pe: 64 bf16 values, each the high half of a float32
        r = tl.arange(0, _D_ROPE)
        pe_at = src[:, None] + (r * 2 + _ROPE_AT)[None, :] * s_c_d
        lo = tl.load(pe_at, mask=ok[:, None], other=0).to(tl.uint32)
        hi = tl.load(pe_at + s_c_d, mask=ok[:, None], other=0).to(tl.uint32)
        pe = ((lo | (hi << 8)) << 16).to(tl.float32, bitcast=True)
        pe = tl.where(ok[:, None], pe, float("nan"))
        tl.store(out[:, None] + (r + _D_NOPE)[None, :] * s_d_c, pe.to(dst.dtype.element_ty),
                 mask=store_ok)


@triton.jit
def _index_key_kernel(
    cache, codes, scales, block_table, cu_seq_lens,
    num_tokens, num_requests, search_steps, num_blocks, table_width, s_c_b, s_bt_b, s_bt_p,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, DIM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < num_tokens
    target = tl.load(cu_seq_lens).to(tl.int64) + t  # the token's place in cu_seq_lens' count
    # the last request b with cu[b] <= target: cu[lo] <= target < cu[hi] (if cu increases)
    lo = tl.zeros((BLOCK_T,), dtype=tl.int32)
    hi = tl.full((BLOCK_T,), num_requests, dtype=tl.int32)
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        go = tl.load(cu_seq_lens + mid).to(tl.int64) <= target
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    begin = tl.load(cu_seq_lens + lo).to(tl.int64)
    end = tl.load(cu_seq_lens + lo + 1).to(tl.int64)
    pos = target - begin
    col = pos // BLOCK_SIZE
    ok = live & (pos >= 0) & (target < end) & (col < table_width)
    blk = tl.load(block_table + lo.to(tl.int64) * s_bt_b + col * s_bt_p, mask=ok,
                  other=-1).to(tl.int64)
    ok = ok & (blk >= 0) & (blk < num_blocks)
    page = cache + blk * s_c_b
    o = pos % BLOCK_SIZE
    v = tl.arange(0, DIM)
    x = tl.load(page[:, None] + o[:, None] * DIM + v[None, :], mask=ok[:, None], other=0x7F)
    tl.store(codes + t[:, None] * DIM + v[None, :], x, mask=live[:, None])
    word = _le_word(page + BLOCK_SIZE * DIM + 4 * o, 1, ok)
    s = tl.where(ok, word.to(tl.float32, bitcast=True), float("nan"))
    tl.store(scales + t, s, mask=live)


_latent = CompiledLauncher(_latent_kernel)
_index_keys = CompiledLauncher(_index_key_kernel)


def _check_device(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not interpreting():
        raise ValueError(f"{name} must be on a CUDA device (or TRITON_INTERPRET=1 set before "
                         f"mla.fast is imported), got {t.device}")


def gather_and_upconvert_fp8_ds_mla(src_cache: torch.Tensor, dst: torch.Tensor,
                                    block_table: torch.Tensor, seq_lens: torch.Tensor,
                                    workspace_starts: torch.Tensor, batch_size: int, *,
                                    validate: bool | None = None) -> torch.Tensor:
    """Dequantize each request's first ``seq_lens[b]`` rows into ``dst`` at ``workspace_starts[b]``.

    As the reference: ``src_cache [num_blocks, block_size, 656]`` fp8_ds_mla bytes (uint8 or
    float8_e4m3fn, any strides), ``dst [W, 576]`` any float dtype, written in place and
    returned. ``validate``: the reference's value checks on the host (a sync); without them
    nothing is read on the host (bad values: the module docstring).
    """
    check_gather_fp8_ds_mla_shapes(src_cache, dst, block_table, seq_lens, workspace_starts,
                                   batch_size)
    _check_device("src_cache", src_cache)
    if should_validate(validate, dst):
        check_gather_fp8_ds_mla_values(src_cache, dst, block_table, seq_lens,
                                       workspace_starts, batch_size)
    if batch_size == 0 or (W := dst.shape[0]) == 0:
        return dst
    cache = src_cache.view(torch.uint8)
    per_request = max(1, PROGRAMS_PER_SM * num_sms(dst.device) // batch_size)
    grid = (batch_size, min(triton.cdiv(W, LATENT_ROWS), per_request, 65535), 1)
    check_grid("gather_and_upconvert_fp8_ds_mla (grid: requests, row tiles)", grid)
    ints = (cache.shape[0], W, block_table.shape[1], *cache.stride(), *dst.stride(),
            *block_table.stride())
    key = (tuple(int_spec(x) for x in ints), dst.dtype, block_table.dtype, seq_lens.dtype,
           workspace_starts.dtype, cache.shape[1],
           *(ptr_spec(t) for t in (cache, dst, block_table, seq_lens, workspace_starts)))
    _latent(key, grid, (cache, dst, block_table, seq_lens, workspace_starts, *ints,
                        cache.shape[1], LATENT_ROWS), num_warps=4)
    return dst


def gather_indexer_k_cache(kv_cache: torch.Tensor, block_table: torch.Tensor,
                           cu_seq_lens: torch.Tensor, *, num_tokens: int | None = None,
                           validate: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's first ``cu_seq_lens[b+1] - cu_seq_lens[b]`` tokens of the index key cache,
    concatenated: ``(codes float8_e4m3fn [N, 128], scales float32 [N])``, as the reference.

    ``N = cu_seq_lens[-1] - cu_seq_lens[0]``: give it as ``num_tokens`` where the host knows it
    (a step's plan does), or ``None`` to read it from ``cu_seq_lens`` (a sync).
    ``kv_cache [num_blocks, block_size, 132]`` with contiguous pages (any block stride).
    ``validate``: the reference's value checks, and ``num_tokens`` against ``cu_seq_lens``,
    on the host (a sync); without them see the module docstring.
    """
    check_gather_indexer_k_shapes(kv_cache, block_table, cu_seq_lens)
    _check_device("kv_cache", kv_cache)
    cache = kv_cache.view(torch.uint8)
    if cache.stride()[1:] != (INDEX_K_BYTES, 1):
        raise ValueError(f"kv_cache's pages must be contiguous (strides [*, {INDEX_K_BYTES}, "
                         f"1]), got strides {list(cache.stride())}")
    if num_tokens is not None and (isinstance(num_tokens, bool) or
                                   not isinstance(num_tokens, int)):
        raise TypeError(f"num_tokens must be an int or None, got {type(num_tokens).__name__}")
    if num_tokens is not None and (num_tokens < 0 or (num_tokens and not block_table.shape[0])):
        raise ValueError(f"num_tokens must be >= 0 (0 without requests), got {num_tokens} "
                         f"for {block_table.shape[0]} requests")
    if should_validate(validate, cu_seq_lens):
        cu = check_gather_indexer_k_values(kv_cache, block_table, cu_seq_lens)
        if num_tokens is not None and num_tokens != cu[-1] - cu[0]:
            raise ValueError(f"num_tokens must be cu_seq_lens[-1] - cu_seq_lens[0] = "
                             f"{cu[-1] - cu[0]}, got {num_tokens}")
        num_tokens = cu[-1] - cu[0]
    elif num_tokens is None:
        num_tokens = max(0, int((cu_seq_lens[-1] - cu_seq_lens[0]).item()))
    codes = torch.empty(num_tokens, INDEX_DIM, dtype=torch.float8_e4m3fn, device=cache.device)
    scales = torch.empty(num_tokens, dtype=torch.float32, device=cache.device)
    if num_tokens == 0:
        return codes, scales
    B = block_table.shape[0]
    grid = (triton.cdiv(num_tokens, KEY_TOKENS), 1, 1)
    check_grid("gather_indexer_k_cache (grid: tiles of 32 tokens)", grid)
    ints = (num_tokens, B, (B - 1).bit_length(), cache.shape[0], block_table.shape[1],
            cache.stride(0), *block_table.stride())
    key = (tuple(int_spec(x) for x in ints), block_table.dtype, cu_seq_lens.dtype, cache.shape[1],
           *(ptr_spec(t) for t in (cache, codes, scales, block_table, cu_seq_lens)))
    _index_keys(key, grid, (cache, codes.view(torch.uint8), scales, block_table, cu_seq_lens,
                            *ints, cache.shape[1], KEY_TOKENS, INDEX_DIM), num_warps=4)
    return codes, scales
