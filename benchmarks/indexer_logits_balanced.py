"""An experiment beside ``mla.fast.indexer_logits_paged``: the page kernel as a one-wave
persistent grid (``python -m benchmarks.indexer_logits`` times it as the variant "balanced").

The library kernel runs programs ``(row, split)`` of up to ``max_tiles`` tiles; when their
count is not a multiple of what the GPU holds at once, the last wave runs part-empty (B = 32,
L = 32K: 1024 programs of 16 tiles on 132 SMs x 5 resident = 1.55 waves). Here the grid is
exactly the resident programs (registers, shared memory and threads of the compiled kernel),
each takes an equal share of all rows' tiles, row-major, in chunks of at most ``max_tiles``
tiles of one row. The cost: the loop over chunks raises the registers (ptxas: 123 at
next_n = 1, 184 at next_n = 2 against 72 and 128), so fewer programs fit a SM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.fast.common import ensure_allocator, interpreting, next_pow2, num_sms
from mla.fast.indexer_logits_paged import (
    _load_q,
    _store_dead,
    _store_tile,
    paged_loads,
    resident_programs,
)
from mla.fast.indexer_logits_tile import LogitsPlan, tile_logits
from mla.reference.indexer_cache import INDEX_DIM

__all__ = ["balanced_paged_logits"]


@triton.jit
def _page_chunk(q, w, codes_desc, scale_desc, cache_f8, cache_f32, lens, table, out, b, col0,
                tiles, H, next_n, n_blocks, max_blocks, width,
                s_q_b, s_q_n, s_q_h, s_w_r, s_t_b,
                NP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                PAGE: tl.constexpr, MAX_TILES: tl.constexpr, NAN_CODES: tl.constexpr,
                STAGES: tl.constexpr, TMA: tl.constexpr):
    """Tiles ``col0 / BLOCK_N ..`` (``tiles`` of them, at most ``MAX_TILES``) of row ``b``."""
    L = tl.minimum(tl.load(lens + b).to(tl.int64), width)  # never write past the row
    q_t, w_r = _load_q(q, w, b, next_n, H, s_q_b, s_q_n, s_q_h, s_w_r, NP, HP, D)
    nq = tl.arange(0, NP)
    ends = L - next_n + nq + 1  # query n sees keys [0, L - next_n + n]
    out_rows = out + (b * next_n + nq.to(tl.int64)) * width
    live_tiles = tl.minimum(tl.cdiv(tl.maximum(L - col0, 0), BLOCK_N), tiles)
    # the chunk's pages, a tile each (a page holds whole tiles), in one read that does not
    # wait for the length (entries past it are read, never used): a page past the table's
    # row or outside the cache is -1, read as page 0 and its keys made NaN
    j = tl.arange(0, MAX_TILES)
    blk = (col0 + j * BLOCK_N) // PAGE
    pages = tl.load(table + b * s_t_b + blk, mask=(j < tiles) & (blk < max_blocks),
                    other=-1).to(tl.int64)
    pages = tl.where((pages >= 0) & (pages < n_blocks), pages, -1)
    ROWS: tl.constexpr = PAGE * (D + 4) // D  # 128-byte rows a page (codes, then scales)
    SCALES: tl.constexpr = PAGE * (D // 4)  # a page's scales, in float32 from its start
    d = tl.arange(0, D)
    o = tl.arange(0, BLOCK_N)
    for i in tl.range(0, live_tiles, num_stages=STAGES):
        page = tl.sum(tl.where(j == i, pages, 0), axis=0)
        outside = page < 0
        page = tl.maximum(page, 0)
        first = col0 + i * BLOCK_N
        o0 = first % PAGE
        if TMA:
            codes = codes_desc.load([(page * ROWS + o0).to(tl.int32), 0])
            k_scale = tl.reshape(scale_desc.load([page.to(tl.int32), o0.to(tl.int32)]),
                                 (BLOCK_N,))
        else:
            codes = tl.load(cache_f8 + (page * (PAGE * (D + 4)) + (o0 + o) * D)[:, None]
                            + d[None, :])
            k_scale = tl.load(cache_f32 + page * (PAGE * (D // 4 + 1)) + SCALES + o0 + o)
        k_scale = tl.where(outside, float("nan"), k_scale)
        s = tile_logits(codes, k_scale, q_t, w_r, NP, HP, BLOCK_N, NAN_CODES)
        _store_tile(out_rows, s, first + o, ends, width, next_n, NP)
    _store_dead(out_rows, col0, live_tiles, tiles, width, next_n, NP, BLOCK_N)


@triton.jit
def _paged_page_kernel(
    q, w, cache_f8, cache_f32, lens, table, out,
    H, next_n, n_blocks, max_blocks, width, row_tiles, total_tiles,
    s_q_b, s_q_n, s_q_h, s_w_r, s_t_b,
    NP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, MAX_TILES: tl.constexpr, NAN_CODES: tl.constexpr,
    STAGES: tl.constexpr, TMA: tl.constexpr,
):
    # an equal share of all rows' tiles (row-major), taken in chunks of at most MAX_TILES
    # tiles of one row: every program does the same work, whatever the rows and the grid
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0).to(tl.int64)
    t = pid * total_tiles // programs
    hi = (pid + 1) * total_tiles // programs
    ROWS: tl.constexpr = PAGE * (D + 4) // D  # 128-byte rows a page (codes, then scales)
    if TMA:
        codes_desc = tl.make_tensor_descriptor(cache_f8, shape=[n_blocks * ROWS, D],
                                               strides=[D, 1], block_shape=[BLOCK_N, D])
        scale_desc = tl.make_tensor_descriptor(cache_f32 + PAGE * (D // 4),
                                               shape=[n_blocks, PAGE],
                                               strides=[PAGE * (D // 4 + 1), 1],
                                               block_shape=[1, BLOCK_N])
    else:
        codes_desc = cache_f8  # unused
        scale_desc = cache_f32
    while t < hi:
        b = t // row_tiles
        i0 = t - b * row_tiles
        n = tl.minimum(tl.minimum(hi - t, row_tiles - i0), MAX_TILES)
        _page_chunk(q, w, codes_desc, scale_desc, cache_f8, cache_f32, lens, table, out, b,
                    i0 * BLOCK_N, n, H, next_n, n_blocks, max_blocks, width,
                    s_q_b, s_q_n, s_q_h, s_w_r, s_t_b, NP, HP, D, BLOCK_N, PAGE, MAX_TILES,
                    NAN_CODES, STAGES, TMA)
        t += n


def balanced_paged_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                          context_lens: torch.Tensor, block_tables: torch.Tensor,
                          max_model_len: int, plan: LogitsPlan) -> torch.Tensor:
    """``fp8_paged_mqa_logits`` (valid, contiguous inputs: no checks) on the one-wave grid."""
    B, next_n, H, _ = q.shape
    nb, bs, _ = kv_cache.shape
    out = torch.empty(B * next_n, max_model_len, dtype=torch.float32, device=q.device)
    loads = paged_loads(plan, kv_cache)
    if loads == "gather":
        raise ValueError("the balanced grid needs whole tiles in a page")
    if loads == "tma_host":  # this kernel builds its descriptors itself
        loads = "tma"
    if loads == "tma":
        ensure_allocator()
    u8 = kv_cache.reshape(-1).view(torch.uint8)
    row_tiles = triton.cdiv(max_model_len, plan.block_n)
    args = (q, weights, u8.view(torch.float8_e4m3fn), u8.view(torch.float32), context_lens,
            block_tables, out, H, next_n, nb, block_tables.shape[1], max_model_len, row_tiles,
            B * row_tiles, q.stride(0), q.stride(1), q.stride(2), weights.stride(0),
            block_tables.stride(0))
    kw = dict(NP=next_pow2(next_n), HP=max(16, next_pow2(H)), D=INDEX_DIM,
              BLOCK_N=plan.block_n, NAN_CODES=interpreting(), STAGES=plan.stages,
              num_warps=plan.num_warps, PAGE=bs, MAX_TILES=plan.max_tiles, TMA=loads == "tma")
    per_sm = (plan.programs_per_sm if interpreting() else
              resident_programs(_paged_page_kernel, q.device, args, kw))
    programs = max(1, min(num_sms(q.device) * per_sm, B * row_tiles))
    _paged_page_kernel[(programs,)](*args, **kw)
    return out
