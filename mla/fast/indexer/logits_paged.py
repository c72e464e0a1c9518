"""The indexer's paged decode logits in Triton: ``fp8_paged_mqa_logits``, as
``mla.reference.fp8_paged_mqa_logits`` (conventions §10): row ``b · next_n + n`` holds query
``n``'s logits over request ``b``'s keys ``0 .. L - next_n + n``, ``-inf`` elsewhere.

Program ``(b, split)`` covers ``tiles`` consecutive tiles of request ``b``'s keys with its
``next_n`` queries' heads stacked on the MMA's N (``indexer_logits_tile``); ``tiles`` is a
runtime argument (at most the plan's ``max_tiles``), so that the batch sizes and lengths of a
server share one compiled kernel. How many tiles: ``split_waves`` (whole waves of the
programs a SM holds, ``resident_programs``; the default) or ``split_keys``. At ``next_n = 1``
the work is ~124 FLOP a byte of cache, so decode is bound by reading the cache: what matters
is how many bytes each SM keeps in flight, and each program's fixed chain (its queries, its
pages, its first copy), which the one-wave grids of small batches do not hide. Two kernels:

- ``_paged_page_kernel`` (a page a tile or more: ``block_size`` a multiple of ``block_n``):
  the program reads its tiles' pages from the block table once, in one vector load, before
  its loop, so that no table read sits between one tile's loads and the next; each tile is
  then one copy of a page's ``[block_n, 128]`` codes and one of its ``block_n`` scales, issued
  ``stages - 1`` tiles ahead of the dot. Through tensor descriptors (TMA) where the page's
  codes start on a 128-byte row (``block_size % 32 == 0``, sm_90), else pointer loads; the
  descriptors built by the host and passed (``"tma_host"``), or by each program
  (``"tma"``: a write to global scratch and a fence before its first copy).
- ``_paged_gather_kernel`` (any page size): a block-table lookup per key inside the loop. The
  lookup feeds the address of the same tile's loads, and Triton's pipeliner then waits for
  every copy in flight before each tile (one tile in flight a program, plus the table's
  latency): the route for pages smaller than a tile only.

A key on a page outside the cache (unvalidated tables) gives NaN, never another key's logit;
nothing is written past a row.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mla.fast.common import (
    capability,
    ensure_allocator,
    interpreting,
    next_pow2,
    num_sms,
    should_validate,
)
from mla.fast.indexer.logits_tile import LogitsPlan, split_keys, split_waves, tile_logits
from mla.fast.launch import check_grid
from mla.reference.indexer_cache import INDEX_DIM
from mla.reference.indexer_logits import check_paged_logits_args
from mla.validation import check_tensor

__all__ = ["PAGED_PLAN", "WIDE_PAGED_PLAN", "fp8_paged_mqa_logits", "launch_plan", "paged_loads",
           "paged_plan", "resident_programs"]

# The decode default, as measured on the H200 (benchmarks/indexer_logits.py, DeepSeek-V3.2's
# 64 heads, pages of 64, B 1-128, L 8K-128K): programs of up to 32 tiles split in whole waves of
# what a SM holds (the spread split's 16-tile programs: 2-8% slower past B = 1, 1.55-1.9 waves
# at B = 32, L = 32K), their tiles copied through descriptors the host builds (the in-kernel
# descriptors' extra step in each program's chain: 3-23% slower at next_n <= 2 but at
# B = 128 L = 128K, within 2% there); at next_n > 2 (4-7% slower with the host's
# descriptors there) the in-kernel descriptors.
PAGED_PLAN = LogitsPlan(paged_loads="tma_host", max_tiles=32, split="waves")
WIDE_PAGED_PLAN = dataclasses.replace(PAGED_PLAN, paged_loads="tma")


def paged_plan(next_n: int) -> LogitsPlan:
    """The default plan for ``next_n`` queries a request (``PAGED_PLAN`` up to 2)."""
    return PAGED_PLAN if next_n <= 2 else WIDE_PAGED_PLAN


@triton.jit
def _load_q(q, w, b, next_n, H, s_q_b, s_q_n, s_q_h, s_w_r, NP: tl.constexpr,
            HP: tl.constexpr, D: tl.constexpr):
    """Request ``b``'s queries as the MMA's B operand ``[D, NP·HP]`` and their weights (read
    first: the queries' copy to shared memory waits for its read where it stands)."""
    r = tl.arange(0, NP * HP)
    n = r // HP
    h = r % HP
    row_ok = (n < next_n) & (h < H)
    d = tl.arange(0, D)
    w_r = tl.load(w + (b * next_n + n) * s_w_r + h, mask=row_ok, other=0.0).to(tl.float32)
    q_rows = tl.load(q + b * s_q_b + n[:, None] * s_q_n + h[:, None] * s_q_h + d[None, :],
                     mask=row_ok[:, None], other=0.0)
    return tl.trans(q_rows), w_r


@triton.jit
def _store_tile(out_rows, s, cols, ends, width, next_n, NP: tl.constexpr):
    """``s [BLOCK_N, NP]`` at columns ``cols``, ``-inf`` past each query's last key."""
    nq = tl.arange(0, NP)
    s = tl.where(cols[:, None] < ends[None, :], s, float("-inf"))
    tl.store(out_rows[None, :] + cols[:, None], s,
             mask=(cols < width)[:, None] & (nq < next_n)[None, :])


@triton.jit
def _store_dead(out_rows, col0, first, tiles, width, next_n, NP: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """``-inf`` over tiles ``first .. tiles`` of the program, without reading the cache."""
    nq = tl.arange(0, NP)
    for i in range(first, tiles):
        cols = col0 + i * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_rows[None, :] + cols[:, None],
                 tl.full((BLOCK_N, NP), float("-inf"), tl.float32),
                 mask=(cols < width)[:, None] & (nq < next_n)[None, :])


@triton.jit
def _paged_page_kernel(
    q, w, cache_f8, cache_f32, codes_desc, scale_desc, lens, table, out,
    H, next_n, n_blocks, max_blocks, width, tiles,
    s_q_b, s_q_n, s_q_h, s_w_r, s_t_b,
    NP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, MAX_TILES: tl.constexpr, NAN_CODES: tl.constexpr,
    STAGES: tl.constexpr, TMA: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1).to(tl.int64) * tiles * BLOCK_N
    L = tl.minimum(tl.load(lens + b).to(tl.int64), width)  # never write past the row
    # the program's pages, a tile each (a page holds whole tiles), in one read that does not
    # wait for the length (entries past it are read, never used): a page past the table's
    # row or outside the cache is -1, read as page 0 and its keys made NaN. Read before the
    # queries, whose copy to shared memory waits for them before the loop's first copies:
    # the two reads' latencies overlap instead of adding up
    j = tl.arange(0, MAX_TILES)
    blk = (col0 + j * BLOCK_N) // PAGE
    pages = tl.load(table + b * s_t_b + blk, mask=(j < tiles) & (blk < max_blocks),
                    other=-1).to(tl.int64)
    pages = tl.where((pages >= 0) & (pages < n_blocks), pages, -1)
    ROWS: tl.constexpr = PAGE * (D + 4) // D  # 128-byte rows a page (codes, then scales)
    SCALES: tl.constexpr = PAGE * (D // 4)  # a page's scales, in float32 from its start
    if TMA == 1:  # built here (else: 2, built by the host and passed; 0: pointer loads)
        codes_desc = tl.make_tensor_descriptor(cache_f8, shape=[n_blocks * ROWS, D],
                                               strides=[D, 1], block_shape=[BLOCK_N, D])
        scale_desc = tl.make_tensor_descriptor(cache_f32 + SCALES, shape=[n_blocks, PAGE],
                                               strides=[PAGE * (D // 4 + 1), 1],
                                               block_shape=[1, BLOCK_N])
    q_t, w_r = _load_q(q, w, b, next_n, H, s_q_b, s_q_n, s_q_h, s_w_r, NP, HP, D)
    nq = tl.arange(0, NP)
    ends = L - next_n + nq + 1  # query n sees keys [0, L - next_n + n]
    out_rows = out + (b * next_n + nq.to(tl.int64)) * width
    live_tiles = tl.minimum(tl.cdiv(tl.maximum(L - col0, 0), BLOCK_N), tiles)
    d = tl.arange(0, D)
    o = tl.arange(0, BLOCK_N)
    for i in tl.range(0, live_tiles, num_stages=STAGES):
        page = tl.sum(tl.where(j == i, pages, 0), axis=0)
        outside = page < 0
        page = tl.maximum(page, 0)
        first = col0 + i * BLOCK_N
        o0 = first % PAGE
        if TMA > 0:
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
def _paged_gather_kernel(
    q, w, cache_f8, cache_f32, lens, table, out,
    H, next_n, n_blocks, block_size, max_blocks, width, tiles,
    s_q_b, s_q_n, s_q_h, s_w_r, s_t_b,
    NP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    NAN_CODES: tl.constexpr, STAGES: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1).to(tl.int64) * tiles * BLOCK_N
    L = tl.minimum(tl.load(lens + b).to(tl.int64), width)  # never write past the row
    q_t, w_r = _load_q(q, w, b, next_n, H, s_q_b, s_q_n, s_q_h, s_w_r, NP, HP, D)
    nq = tl.arange(0, NP)
    ends = L - next_n + nq + 1  # query n sees keys [0, L - next_n + n]
    out_rows = out + (b * next_n + nq.to(tl.int64)) * width
    d = tl.arange(0, D)
    live_tiles = tl.minimum(tl.cdiv(tl.maximum(L - col0, 0), BLOCK_N), tiles)
    for i in tl.range(0, live_tiles, num_stages=STAGES):
        cols = col0 + i * BLOCK_N + tl.arange(0, BLOCK_N)
        live = cols < L
        blk = cols // block_size
        page = tl.load(table + b * s_t_b + blk, mask=live & (blk < max_blocks),
                       other=-1).to(tl.int64)
        ok = live & (page >= 0) & (page < n_blocks)  # else NaN, never another key
        o = cols % block_size
        codes = tl.load(cache_f8 + (page * block_size * (D + 4) + o * D)[:, None]
                        + d[None, :], mask=ok[:, None], other=0.0)
        k_scale = tl.load(cache_f32 + page * block_size * (D // 4 + 1) + block_size
                          * (D // 4) + o, mask=ok, other=float("nan"))
        s = tile_logits(codes, k_scale, q_t, w_r, NP, HP, BLOCK_N, NAN_CODES)
        _store_tile(out_rows, s, cols, ends, width, next_n, NP)
    _store_dead(out_rows, col0, live_tiles, tiles, width, next_n, NP, BLOCK_N)


def paged_loads(plan: LogitsPlan, kv_cache: torch.Tensor) -> str:
    """How the kernel will read this cache under ``plan``: its ``paged_loads``, or the next
    that the cache allows. ``"tma"`` and ``"tma_host"`` need sm_90 (or the interpreter),
    pages whose codes start on 128-byte rows (``block_size % 32 == 0``) in a 16-byte aligned
    cache of fewer than 2^31 such rows; ``"page"`` needs whole tiles in a page."""
    nb, bs, _ = kv_cache.shape
    loads = plan.paged_loads
    if loads in ("tma", "tma_host"):
        hopper = interpreting() if kv_cache.device.type != "cuda" else \
            capability(kv_cache.device)[0] >= 9
        if not (hopper and bs % 32 == 0 and bs % plan.block_n == 0
                and kv_cache.data_ptr() % 16 == 0 and nb * bs * (INDEX_DIM + 4) // 128 < 2**31):
            loads = "page"
    if loads == "page" and bs % plan.block_n:
        loads = "gather"
    return loads


def fp8_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_tables: torch.Tensor,
                         max_model_len: int, *, validate: bool | None = None,
                         plan: LogitsPlan | None = None) -> torch.Tensor:
    """Paged decode logits float32 ``[B · next_n, max_model_len]``, as the reference.

    ``q [B, next_n, H, 128]`` e4m3; ``kv_cache uint8 [num_blocks, block_size, 132]`` (or
    ``[num_blocks, block_size, 1, 132]``); ``weights [B · next_n, H]``; ``context_lens [B]``;
    ``block_tables [B, max_blocks]``. ``validate``: check the lengths against
    ``max_model_len`` and the block tables within each length on the host (a sync); ``None``:
    only when no CUDA graph is being captured. Unvalidated, a key on a page outside the cache
    gives NaN, and nothing is written past a row. ``plan``: the tiling (``paged_plan``).
    """
    q, kv_cache = check_paged_logits_args(q, kv_cache, weights, context_lens, block_tables,
                                          max_model_len)
    if q.stride(-1) != 1:
        raise ValueError(f"q's last dim must be contiguous, got strides {list(q.stride())}")
    check_tensor("kv_cache", kv_cache, contiguous=True)  # addressed as one flat array
    B, next_n, H, _ = q.shape
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    nb, bs, _ = kv_cache.shape
    if should_validate(validate, q):
        _check_paged_values(context_lens, block_tables, nb, bs, max_model_len)
    out = torch.empty(B * next_n, max_model_len, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    kernel, grid, args, sizes = launch_plan(plan or paged_plan(next_n), q, kv_cache, weights,
                                            context_lens, block_tables, out)
    check_grid("fp8_paged_mqa_logits (grid: requests, key splits)", grid)
    kernel[grid](*args, **sizes)
    return out


def launch_plan(plan: LogitsPlan, q: torch.Tensor, kv_cache: torch.Tensor,
                weights: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                out: torch.Tensor) -> tuple:
    """(kernel, grid, arguments, constexprs) of ``fp8_paged_mqa_logits`` for checked inputs:
    the grid is (requests, programs along the keys), the tiles a program after the sizes."""
    B, next_n, H, _ = q.shape
    nb, bs, _ = kv_cache.shape
    max_model_len = out.shape[1]
    u8 = kv_cache.reshape(-1).view(torch.uint8)
    common = (q, weights, u8.view(torch.float8_e4m3fn), u8.view(torch.float32), context_lens,
              block_tables, out)
    strides = (q.stride(0), q.stride(1), q.stride(2), weights.stride(0), block_tables.stride(0))
    sizes = dict(NP=next_pow2(next_n), HP=max(16, next_pow2(H)), D=INDEX_DIM,
                 BLOCK_N=plan.block_n, NAN_CODES=interpreting(), STAGES=plan.stages,
                 num_warps=plan.num_warps)
    loads = paged_loads(plan, kv_cache)
    if loads == "gather":
        kernel = _paged_gather_kernel
        head = (*common, H, next_n, nb, bs, block_tables.shape[1], max_model_len)
    else:
        kernel = _paged_page_kernel
        descs = _host_descriptors(u8, nb, bs, plan.block_n) if loads == "tma_host" else \
            common[2:4]  # unused
        head = (*common[:4], *descs, *common[4:], H, next_n, nb, block_tables.shape[1],
                max_model_len)
        sizes.update(PAGE=bs, MAX_TILES=plan.max_tiles,
                     TMA={"page": 0, "tma": 1, "tma_host": 2}[loads])
        if loads == "tma":
            ensure_allocator()  # the in-kernel tensor descriptors' scratch
    if plan.split == "waves":
        # compiled with 3 tiles for the count (not 1, which Triton would specialize)
        slots = num_sms(q.device) * (plan.programs_per_sm if interpreting() else
                                     resident_programs(kernel, q.device, (*head, 3, *strides),
                                                       sizes))
        tiles, splits = split_waves(max_model_len, B, plan.block_n, slots, plan.max_tiles)
    else:
        tiles, splits = split_keys(max_model_len, B, plan.block_n, q.device,
                                   plan.programs_per_sm, plan.max_tiles)
    return kernel, (B, splits), (*head, tiles, *strides), sizes




def _host_descriptors(u8: torch.Tensor, nb: int, bs: int, block_n: int) -> tuple:
    """The page kernel's two tensor descriptors, as ``_paged_page_kernel`` builds them with
    ``TMA == 1``, built here: a page's codes as ``block_n`` 128-byte rows, its scales as one
    row of a ``[num_blocks, block_size]`` float32 view (scales start ``block_size · 128``
    bytes into a page)."""
    rows = bs * (INDEX_DIM + 4) // INDEX_DIM
    codes = TensorDescriptor(u8.view(torch.float8_e4m3fn), [nb * rows, INDEX_DIM],
                             [INDEX_DIM, 1], [block_n, INDEX_DIM])
    f32 = u8.view(torch.float32)
    scales = TensorDescriptor(f32[bs * INDEX_DIM // 4:], [nb, bs],
                              [bs * (INDEX_DIM // 4 + 1), 1], [1, block_n])
    return codes, scales


_RESIDENT: dict[tuple, int] = {}
REGS_A_SM = 65536  # every CUDA GPU from sm_50 to sm_90


def resident_programs(kernel: triton.runtime.JITFunction, device: torch.device, args: tuple,
                      sizes: dict) -> int:
    """How many programs of ``kernel`` (compiled for ``args`` and the constexprs ``sizes``)
    one SM of ``device`` holds at once: its registers (allocated per warp by 256), shared
    memory (1 KB a program reserved on sm_90) and threads. Compiled and counted once per
    specialization; the launch that follows uses the same compiled kernel."""
    key = (kernel, device.index, tuple(sorted(sizes.items())))
    got = _RESIDENT.get(key)
    if got is None:
        k = kernel.warmup(*args, grid=(1,), **sizes)
        k._init_handles()
        props = torch.cuda.get_device_properties(device)
        warps = k.metadata.num_warps
        regs_a_warp = triton.cdiv(max(k.n_regs, 1) * 32, 256) * 256
        by_regs = REGS_A_SM // (regs_a_warp * warps)
        by_smem = props.shared_memory_per_multiprocessor // (k.metadata.shared + 1024)
        by_threads = props.max_threads_per_multi_processor // (32 * warps)
        got = _RESIDENT[key] = max(1, min(by_regs, by_smem, by_threads, 32))
    return got


def _check_paged_values(context_lens: torch.Tensor, block_tables: torch.Tensor, nb: int,
                        bs: int, max_model_len: int) -> None:
    """The reference's value checks, in a few device-wide reductions and one transfer."""
    lens = context_lens.long()
    used = (lens + bs - 1) // bs
    cols = torch.arange(block_tables.shape[1], device=lens.device)
    within = cols[None, :] < used[:, None]
    table = block_tables[:lens.shape[0]].long()
    bad_page = within & ((table < 0) | (table >= nb))
    facts = torch.stack([lens.min() if lens.numel() else lens.new_zeros(()),
                         lens.max() if lens.numel() else lens.new_zeros(()),
                         used.max() if used.numel() else used.new_zeros(()),
                         bad_page.any(dim=1).long().argmax() if bad_page.numel()
                         else lens.new_zeros(()),
                         bad_page.any().long()]).tolist()
    lo, hi, most_blocks, first_bad, any_bad = facts
    if lo < 0 or hi > max_model_len:
        raise ValueError(f"context_lens must lie in [0, max_model_len = {max_model_len}], got "
                         f"range [{lo}, {hi}]")
    if most_blocks > block_tables.shape[1]:
        raise ValueError(f"context_lens up to {hi} need {most_blocks} blocks of {bs}, "
                         f"block_tables has {block_tables.shape[1]}")
    if any_bad:
        row = table[first_bad][:int(used[first_bad])]
        raise ValueError(f"block_tables[{first_bad}] points outside the cache's {nb} blocks "
                         f"within its first {int(lens[first_bad])} keys: range "
                         f"[{int(row.min())}, {int(row.max())}]")
