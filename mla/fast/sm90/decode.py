"""Compute-bound paged MLA decode for Hopper (sm_90), written in Gluon.

The Triton kernel of ``mla.fast.decode`` loses a third of the tensor-core work at 128 heads:
Triton lays a dot that feeds another dot out with all warps along M, so with 64 query rows and
two warp groups both groups compute the same 64 × 64 logits (benchmarks/notes/decode.md). Gluon lets
the kernel choose its layouts, so here the work is split as FlashMLA splits it
(docs/kernels.md):

- One program = one request, 64 query rows (``s_q · N`` flattened), one run of key tiles,
  8 warps = two warp groups. The logits ``S = q · Kᵀ`` of a 64-key tile are split by keys:
  each warp group computes 64 rows × 32 keys (``wgmma m64n32k16``, q and K from shared memory).
- The softmax statistics are reduced across the two groups, ``P`` (bf16, 64 × 64) goes to
  shared memory, and the output ``O += P · V`` is split by columns: each warp group owns
  64 × 256 of the 64 × 512 float32 accumulator (``wgmma m64n256k16``, 128 registers a thread).
  No wgmma is issued twice.
- Key tiles are 64 consecutive rows of one page, brought in by TMA (one bulk copy per
  128-byte column box) into two stages; the next tile's copy is issued before this tile's math.
  Shared memory: q 72 KB + 2 × 72 KB K + 8 KB P = 224 KB, one program per SM.
- The tile that holds the request's last key may run past it into rows of the page the cache
  never wrote (NaN, in our tests): its value rows past the length are zeroed in shared memory
  after the copy lands, as ``0 · NaN`` would poison ``P · V``. Key masks (length, split end,
  causal diagonal) are applied to the logits only on tiles that need them.

It writes what the Triton decode kernel of ``mla.fast.decode`` writes (the result, or the split
partials that its combine kernel merges), so ``mla.fast.decode.mla_decode_paged`` routes to it
when ``supported(...)`` holds. The Triton interpreter does not run Gluon: this kernel is compiled
for sm_90 in the CPU tests (``tests/test_sm90_compile.py``) and checked against the reference
on the GPU by ``python -m mla.check``.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mla.fast.common import capability
from mla.fast.sm90.softmax import barrier, softmax_pv

__all__ = ["BLOCK_M", "BLOCK_N", "NUM_WARPS", "decode_kernel", "page_row", "q_rows",
           "request_tiles", "store_result", "supported", "zero_tail"]

BLOCK_M = 64  # query rows per program
BLOCK_N = 64  # keys per tile
NUM_WARPS = 8  # two warp groups
_DV = 512
_DR = 64


def supported(q: torch.Tensor, kv_cache: torch.Tensor, head_dim_v: int) -> bool:
    """Whether the sm_90 kernel handles this call: a Hopper GPU, bf16/fp16 q and cache of the
    same dtype, DeepSeek's 576/512 head dims, pages of a multiple of 64 rows stored back to
    back with 16-byte aligned rows, and at least 64 query rows (``s_q · N``)."""
    if q.device.type != "cuda" or capability(q.device) != (9, 0):
        return False
    B, s_q, N, D = q.shape
    nb, bs, _ = kv_cache.shape
    return (q.dtype in (torch.bfloat16, torch.float16) and kv_cache.dtype == q.dtype
            and D == _DV + _DR and head_dim_v == _DV and bs % BLOCK_N == 0
            and s_q * N >= BLOCK_M and nb * bs < 2**31
            and (nb == 1 or kv_cache.stride(0) == bs * kv_cache.stride(1))
            and kv_cache.stride(2) == 1 and q.stride(3) == 1
            and kv_cache.data_ptr() % 16 == 0
            and (kv_cache.stride(1) * kv_cache.element_size()) % 16 == 0)


@gluon.jit
def request_tiles(SEQLENS, b, split, num_splits, max_blocks, PAGE_SIZE: gl.constexpr,
                  BN: gl.constexpr, S_Q: gl.constexpr, CAUSAL: gl.constexpr,
                  SPLIT_TILES: gl.constexpr, SPLIT_CAP: gl.constexpr):
    """Request ``b``'s length ``L`` (0 when bad), whether it is bad (negative, or past the
    table's capacity: NaN results), and this split's keys: an equal share ``[t_lo, t_hi)`` of
    whole tiles, or (``SPLIT_TILES > 0``, the batch-invariant plans) a run of
    ``max(SPLIT_TILES, ceil(tiles / SPLIT_CAP))`` tiles, a function of ``L`` alone
    (``mla.fast.decode.plan``); its last key ``end`` and ``full_end``, the keys every query
    row sees."""
    L = gl.load(SEQLENS + b)
    # written so that L + PAGE_SIZE cannot overflow
    bad = (L < 0) | ((L > 0) & ((L - 1) // PAGE_SIZE >= max_blocks))
    L = gl.where(bad, 0, L)
    n_tiles = gl.cdiv(L, BN)
    if SPLIT_TILES > 0:
        per_split = gl.maximum(gl.cdiv(n_tiles, SPLIT_CAP), SPLIT_TILES)
    else:
        per_split = gl.cdiv(n_tiles, num_splits)
    t_lo = split * per_split
    t_hi = gl.minimum(t_lo + per_split, n_tiles)
    end = gl.minimum(t_hi * BN, L)
    if CAUSAL:
        full_end = gl.minimum(end, L - S_Q + 1)
    else:
        full_end = end
    return L, bad, t_lo, t_hi, end, full_end


@gluon.jit
def q_rows(Q, b, g, stride_qb, stride_qt, stride_qh, N: gl.constexpr, S_Q: gl.constexpr,
           BM: gl.constexpr, ld: gl.constexpr):
    """Pointers to the 64 query rows of head group ``g`` (``s_q · N`` flattened) and which
    exist: rows past ``s_q · N`` read as zeros and are never stored."""
    r = g * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
    row = (Q + b.to(gl.int64) * stride_qb + (r // N).to(gl.int64) * stride_qt
           + (r % N).to(gl.int64) * stride_qh)
    return row, r < S_Q * N


@gluon.jit
def page_row(bt_row, i, t_hi, num_blocks, PAGE_SIZE: gl.constexpr, BN: gl.constexpr):
    """First cache row of tile ``i`` (0 past ``t_hi``) and whether its table entry is
    outside ``[0, num_blocks)`` (never followed: page 0 is read and the request is NaN)."""
    page = gl.load(bt_row + (i * BN) // PAGE_SIZE, mask=i < t_hi, other=0)
    outside = (page < 0) | (page >= num_blocks)
    page = gl.where(outside, 0, page)
    return page * PAGE_SIZE + (i * BN) % PAGE_SIZE, outside


@gluon.jit
def zero_tail(k, start, L, ld: gl.constexpr):
    """Zero the rows at or past ``L`` of a K tile in shared memory (its value columns): the
    request's last tile may run into rows of the page the cache never wrote (NaN, in the
    tests), and ``0 · NaN`` would poison ``P · V``."""
    BN: gl.constexpr = k.shape[0]
    CH: gl.constexpr = 64
    keep = (start + gl.arange(0, BN, layout=gl.SliceLayout(1, ld))) < L
    for c in gl.static_range(k.shape[1] // CH):
        part = k.slice(c * CH, CH, dim=1)
        v = part.load(ld)
        part.store(gl.where(keep[:, None], v, gl.zeros_like(v)))
    fence_async_shared()
    barrier()


@gluon.jit
def store_result(acc, m_i, l_i, bad, g, b, split, num_splits, O, LSE, OP, LSEP, SINK,
                 stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
                 COL0: gl.constexpr, WRITE_LSE: gl.constexpr, DV: gl.constexpr,
                 N: gl.constexpr, S_Q: gl.constexpr, SPLIT: gl.constexpr,
                 HAS_SINK: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """The epilogue: ``acc`` holds output columns ``COL0 ..`` (all ``DV``, or a warp group's
    share) of 64 query rows with the full row sums ``l_i``; stores them (and, ``WRITE_LSE``,
    the lse) as the result, with the sink factor, or as the split partials that the combine
    kernel of ``mla.fast.decode`` merges. Bad requests are NaN."""
    BM: gl.constexpr = acc.type.shape[0]
    DH: gl.constexpr = acc.type.shape[1]
    ROWS: gl.constexpr = S_Q * N
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    seen = l_i != 0.0  # l = 0: no key; a NaN l (a NaN logit) stays NaN, never "no key"
    l_safe = gl.where(seen, l_i, 1.0)
    lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453
    o = acc / gl.convert_layout(l_safe, row_o)[:, None]
    r_s = g * BM + gl.arange(0, BM, layout=row_s)
    r_ok_s = r_s < ROWS
    r_o = g * BM + gl.arange(0, BM, layout=row_o)
    ok_o = r_o < ROWS
    c_o = COL0 + gl.arange(0, DH, layout=col_o)
    if SPLIT:
        # partials [B, splits, ROWS, DV] and [B, splits, ROWS]; "no key" is lse = -inf
        if WRITE_LSE:
            part_s = (b * num_splits + split).to(gl.int64) * ROWS + r_s
            gl.store(LSEP + part_s,
                     gl.where(bad, float("nan"), gl.where(seen, lse, float("-inf"))),
                     mask=r_ok_s)
        part_o = (b * num_splits + split).to(gl.int64) * ROWS + r_o
        seen_o = gl.convert_layout(seen, row_o)
        gl.store(OP + part_o[:, None] * DV + c_o[None, :], o, mask=(ok_o & seen_o)[:, None])
    else:
        if HAS_SINK:  # exp(lse) / (exp(lse) + exp(sink)), as mla.fast.decode._sink_factor
            sink = gl.load(SINK + r_s % N, mask=r_ok_s, other=0.0)
            factor = gl.where(seen, 1.0 / (1.0 + gl.exp(sink - gl.where(seen, lse, 0.0))), 1.0)
            factor = gl.where(sink != sink, float("nan"), factor)
            o = o * gl.convert_layout(factor, row_o)[:, None]
        o = gl.where(bad, float("nan"), o)
        o_row = (O + b.to(gl.int64) * stride_ob + (r_o // N).to(gl.int64) * stride_ot
                 + (r_o % N).to(gl.int64) * stride_oh)
        gl.store(o_row[:, None] + c_o[None, :], o.to(O.dtype.element_ty), mask=ok_o[:, None])
        if WRITE_LSE:
            gl.store(LSE + b.to(gl.int64) * stride_lb + (r_s % N).to(gl.int64) * stride_lh
                     + r_s // N, gl.where(bad, float("nan"), gl.where(seen, lse, float("inf"))),
                     mask=r_ok_s)


@gluon.jit
def decode_kernel(
    Q, KV, BT, SEQLENS, O, LSE, OP, LSEP, SINK,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvr, stride_btb,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lh,
    qk_scale, num_splits, kv_rows, num_blocks, max_blocks,
    N: gl.constexpr, S_Q: gl.constexpr, PAGE_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr, SPLIT: gl.constexpr, HAS_SINK: gl.constexpr,
    SPLIT_TILES: gl.constexpr, SPLIT_CAP: gl.constexpr,
):
    """Grid ``(head groups, splits, B)``, 8 warps. Bad lengths and table entries give NaN
    for the request, as the Triton kernel's (``mla.fast.decode``); ``HAS_SINK``: the sink
    factor in the unsplit epilogue (the combine kernel applies it after a split);
    ``SPLIT_TILES``, ``SPLIT_CAP``: fixed-length splits (``request_tiles``; 0: equal shares)."""
    BM: gl.constexpr = 64
    BN: gl.constexpr = 64
    DV: gl.constexpr = 512
    DR: gl.constexpr = 64
    CH: gl.constexpr = 64  # columns per 128-byte swizzle box
    dtype: gl.constexpr = Q.dtype.element_ty

    g = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)

    # S: warp groups side by side along the keys; O: side by side along the 512 columns.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 32, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 256, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                        warps_per_cta=[8, 1], order=[1, 0])
    col_ld: gl.constexpr = gl.SliceLayout(0, ld)
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                              rank=2)

    q_nope = gl.allocate_shared_memory(dtype, [BM, DV], smem)
    q_pe = gl.allocate_shared_memory(dtype, [BM, DR], smem)
    k_nope = gl.allocate_shared_memory(dtype, [2, BN, DV], smem)
    k_pe = gl.allocate_shared_memory(dtype, [2, BN, DR], smem)
    p_smem = gl.allocate_shared_memory(dtype, [BM, BN], smem)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)

    # q rows -> shared memory
    q_row, ok_ld = q_rows(Q, b, g, stride_qb, stride_qt, stride_qh, N, S_Q, BM, ld)
    c_ld = gl.arange(0, CH, layout=col_ld)
    for c in gl.static_range(DV // CH):
        x = gl.load(q_row[:, None] + (c * CH + c_ld)[None, :], mask=ok_ld[:, None], other=0.0)
        q_nope.slice(c * CH, CH, dim=1).store(x)
    x = gl.load(q_row[:, None] + (DV + c_ld)[None, :], mask=ok_ld[:, None], other=0.0)
    q_pe.store(x)

    L, bad, t_lo, t_hi, end, full_end = request_tiles(SEQLENS, b, split, num_splits,
                                                      max_blocks, PAGE_SIZE, BN, S_Q, CAUSAL,
                                                      SPLIT_TILES, SPLIT_CAP)

    kv_desc = tma.make_tensor_descriptor(KV, shape=[kv_rows, DV], strides=[stride_kvr, 1],
                                         block_shape=[BN, DV], layout=smem)
    pe_desc = tma.make_tensor_descriptor(KV + DV, shape=[kv_rows, DR], strides=[stride_kvr, 1],
                                         block_shape=[BN, DR], layout=smem)
    bt_row = BT + b.to(gl.int64) * stride_btb
    TILE_BYTES: gl.constexpr = BN * (DV + DR) * 2

    fence_async_shared()
    barrier()

    if t_lo < t_hi:  # first tile -> stage 0
        row0, outside = page_row(bt_row, t_lo, t_hi, num_blocks, PAGE_SIZE, BN)
        bad = bad | outside
        mbarrier.expect(bars.index(0), TILE_BYTES)
        tma.async_copy_global_to_shared(kv_desc, [row0, 0], bars.index(0), k_nope.index(0))
        tma.async_copy_global_to_shared(pe_desc, [row0, 0], bars.index(0), k_pe.index(0))

    r_s = g * BM + gl.arange(0, BM, layout=row_s)
    limit = L - S_Q + r_s // N  # last key query row r sees (causal)
    c_s = gl.arange(0, BN, layout=col_s)

    acc = gl.zeros([BM, DV], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BM, BN], gl.float32, layout=s_layout)
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BM], gl.float32, layout=row_s)

    # each tile's page is looked up a tile ahead of its TMA issue, so that the issue never
    # waits for a block-table load (the same idea for the sparse kernel's indices paid off
    # on the GPU: benchmarks/notes/decode.md)
    nxt_row, nxt_out = page_row(bt_row, t_lo + 1, t_hi, num_blocks, PAGE_SIZE, BN)
    for i in range(t_lo, t_hi):
        it = i - t_lo
        s = it % 2
        # every warp has finished tile i-1 (its P · V read stage 1-s and P): refill them
        barrier()
        if i + 1 < t_hi:
            bad = bad | nxt_out
            mbarrier.expect(bars.index(1 - s), TILE_BYTES)
            tma.async_copy_global_to_shared(kv_desc, [nxt_row, 0], bars.index(1 - s),
                                            k_nope.index(1 - s))
            tma.async_copy_global_to_shared(pe_desc, [nxt_row, 0], bars.index(1 - s),
                                            k_pe.index(1 - s))
        nxt_row, nxt_out = page_row(bt_row, i + 2, t_hi, num_blocks, PAGE_SIZE, BN)
        mbarrier.wait(bars.index(s), (it // 2) & 1)
        kn = k_nope.index(s)
        start = i * BN
        if start + BN > L:
            zero_tail(kn, start, L, ld)

        sc = warpgroup_mma(q_nope, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        sc = warpgroup_mma(q_pe, k_pe.index(s).permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
        qk = sc * qk_scale  # log2 domain
        if start + BN > full_end:
            kpos = start + c_s
            vis = kpos[None, :] < end
            if CAUSAL:
                vis = vis & (kpos[None, :] <= limit[:, None])
            qk = gl.where(vis, qk, float("-inf"))
        acc, m_i, l_i = softmax_pv(qk, m_i, l_i, acc, p_smem, kn, row_o)

    mbarrier.invalidate(bars.index(0))
    mbarrier.invalidate(bars.index(1))

    store_result(acc, m_i, l_i, bad, g, b, split, num_splits, O, LSE, OP, LSEP, SINK,
                 stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
                 0, True, DV, N, S_Q, SPLIT, HAS_SINK, s_layout, o_layout)
