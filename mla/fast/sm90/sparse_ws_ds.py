"""DeepSeek-V3.2 sparse decode over the ``fp8_ds_mla`` cache for Hopper (sm_90) in Gluon,
warp-specialized: a producer warp group gathers and dequantizes while two consumer warp groups
run the dots (``mla.fast.sm90.sparse_ws``'s arrangement for MODEL1 pages, on 656-byte rows).

The coupled kernel of ``mla.fast.sm90.sparse`` runs, per 64-entry tile, the wait for the staged
bytes, their dequantization by all 8 warps, ``S = q · Kᵀ``, the softmax and ``P · V`` in
series (1.48x FlashMLA's time at B=64 N=128 top-k 2048, benchmarks/notes/sparse.md). Here:

- the consumers (the program's 8 warps): q's 64 heads by ``cp.async`` (576 columns: 512 into
  ``q_nope``, the 64 rope values into ``q_pe``), then per tile ``S = q_nope · k_nopeᵀ +
  q_pe · k_peᵀ`` split by keys (each group 64 × 32: 36 ``wgmma m64n32k16``), the softmax
  statistics across both groups, ``P`` through shared memory, ``O += P · V`` split by columns
  (``softmax_pv``); they wait for ``ready[s]`` before a tile in K buffer s and arrive at
  ``free[s]`` once both groups' ``P · V`` have read it; out goes through q's buffer;
- the producer (4 more warps, ``setmaxnreg``): the two K buffers (2 × (64 × 512 + 64 × 64)
  bf16) leave no room for a staging buffer (q 72 KB + K 144 KB + P 8 KB = 229,376 B of the
  232,448), so the e4m3 bytes travel through registers, as FlashMLA's kernel loads them
  (16-byte global loads, dequantized in registers, stored to shared memory): a row's 512
  bytes are 8 chunks of 64, four chunks (32 registers a thread) in flight. Per tile: wait for
  ``free[s]``, ``cp.async`` the 64 rows' bf16 rope values into ``k_pe[s]``, then per chunk c
  dequantize it (``e4m3 → float32 × the row's float32 scale of its 128-block → bf16``, the
  reference's product and rounding) into ``k_nope[s]`` and load into its registers the chunk
  four later (this tile's chunks 4-7, then the next tile's 0-3 with its four scales); wait
  for the rope copies, arrive at ``ready[s]``, prefetch into the L2 the rows of the tile two
  ahead (so the register loads wait on the L2, not on the memory).

Semantics are the coupled kernel's for ``fp8_ds_mla`` rows (one or two scopes, ``topk_length``,
sinks, splits, the NaN rules). ``mla.fast.sparse`` launches it for 64-head ``fp8_ds_mla`` plans
that name it (``SparsePlan.ds_mla_kernel = "warp_specialized"``; the default stays "staged",
the coupled kernel, until this one is checked and timed on a GPU).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mla.fast.sm90.softmax import barrier, softmax_pv
from mla.fast.sm90.sparse import _length, _source, epilogue, runs

__all__ = ["ds_mla_ws_kernel"]

# a producer thread's registers (setmaxnreg; the consumers keep (65536 - 128 · this) / 256)
_PRODUCER_REGS = gl.constexpr(104)
_SCALES = gl.constexpr(512)  # byte offset of a row's 4 float32 scales
_ROPE = gl.constexpr(528)  # byte offset of a row's 64 bf16 rope values


@gluon.jit
def ds_mla_ws_kernel(
    Q, KV, IDX, TOPK_LEN, KV2, IDX2, TOPK_LEN2, SINK, O, LSE, MAXL, OP, LSEP, MAXP,
    stride_qq, stride_qh, stride_iq, stride_row, page_size,
    stride_iq2, stride_row2, page_size2,
    stride_oq, stride_oh, stride_lb, stride_lt, stride_lh, stride_mq, stride_mh,
    n_rows, topk, n_rows2, topk2, qk_scale, num_splits,
    N: gl.constexpr, S: gl.constexpr, GROUPS: gl.constexpr, HAS_EXTRA: gl.constexpr,
    HAS_TOPK_LEN2: gl.constexpr, HAS_TOPK_LEN: gl.constexpr, HAS_SINK: gl.constexpr,
    CHECK_RANGE: gl.constexpr, HAS_MAXL: gl.constexpr, SPLIT: gl.constexpr,
    SPLIT_TILES: gl.constexpr, SPLIT_CAP: gl.constexpr,
):
    """Grid ``(queries · GROUPS, splits)``, 8 warps (and the producer's 4); the arguments of
    ``mla.fast.sm90.sparse_ws.model1_ws_kernel`` over ``fp8_ds_mla`` rows (``KV``, ``KV2``:
    uint8 rows ``stride_row`` bytes apart; ``page_size`` unused; q bf16 rows of 576)."""
    BM: gl.constexpr = 64
    BN: gl.constexpr = 64
    DV: gl.constexpr = 512
    DR: gl.constexpr = 64
    dtype: gl.constexpr = Q.dtype.element_ty

    pid = gl.program_id(0)
    split = gl.program_id(1)
    qi = pid // GROUPS
    g = pid % GROUPS
    qi64 = qi.to(gl.int64)

    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                              rank=2)
    q_nope = gl.allocate_shared_memory(dtype, [BM, DV], smem)
    q_pe = gl.allocate_shared_memory(dtype, [BM, DR], smem)
    k_nope = gl.allocate_shared_memory(dtype, [2, BN, DV], smem)
    k_pe = gl.allocate_shared_memory(dtype, [2, BN, DR], smem)
    p_smem = gl.allocate_shared_memory(dtype, [BM, BN], smem)
    bl: gl.constexpr = mbarrier.MBarrierLayout()
    # ready[s]: K buffer s holds the next tile; free[s]: the consumers are done with it
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], bl)
    free = gl.allocate_shared_memory(gl.int64, [2, 1], bl)
    for k in gl.static_range(2):
        mbarrier.init(ready.index(k), count=1)
        mbarrier.init(free.index(k), count=1)
        mbarrier.arrive(free.index(k))  # both buffers start free

    # bad: read again by the consumers after their loop (not held across it)
    n1, n2, tiles1, _, t_lo, t_hi, idx1, idx2 = runs(
        TOPK_LEN, TOPK_LEN2, IDX, IDX2, qi, split, topk, topk2, num_splits, stride_iq,
        stride_iq2, S, HAS_EXTRA, HAS_TOPK_LEN, HAS_TOPK_LEN2, SPLIT_TILES, SPLIT_CAP)
    fence_async_shared()
    barrier()  # the barriers are initialized

    # the argument tuples are written out in the call: a tuple built first would turn the
    # constexprs into run-time values in the worker partition (Triton 3.6)
    gl.warp_specialize([
        (consumer, (Q, qi64, stride_qq, stride_qh, q_nope, q_pe, k_nope, k_pe, p_smem, ready,
                     free, t_lo, t_hi, tiles1, idx1, idx2, n1, n2, KV, KV2, n_rows, n_rows2,
                     stride_row, stride_row2, page_size, page_size2, qk_scale, qi, g, split,
                     TOPK_LEN, TOPK_LEN2, topk, topk2, SINK, O, LSE, MAXL, OP, LSEP, MAXP,
                     stride_oq, stride_oh, stride_lb, stride_lt, stride_lh, stride_mq,
                     stride_mh, num_splits, N, S, True, False, HAS_EXTRA, HAS_TOPK_LEN,
                     HAS_TOPK_LEN2, HAS_SINK, CHECK_RANGE, HAS_MAXL, SPLIT)),
        (_producer, (k_nope, k_pe, ready, free, t_lo, t_hi, tiles1, idx1, idx2, n1, n2, KV,
                     KV2, n_rows, n_rows2, stride_row, stride_row2, page_size, page_size2,
                     HAS_EXTRA)),
    ], [4], [_PRODUCER_REGS])


@gluon.jit
def consumer(Q, qi64, stride_qq, stride_qh, q_nope, q_pe, k_nope, k_pe, p_smem, ready, free,
              t_lo, t_hi, tiles1, idx1, idx2, n1, n2, KV, KV2, n_rows, n_rows2, stride_row,
              stride_row2, page_size, page_size2, qk_scale, qi, g, split, TOPK_LEN, TOPK_LEN2,
              topk, topk2, SINK, O, LSE, MAXL, OP, LSEP, MAXP, stride_oq, stride_oh,
              stride_lb, stride_lt, stride_lh, stride_mq, stride_mh, num_splits,
              N: gl.constexpr, S: gl.constexpr, HAS_PE: gl.constexpr,
              FENCE_READY: gl.constexpr, HAS_EXTRA: gl.constexpr,
              HAS_TOPK_LEN: gl.constexpr, HAS_TOPK_LEN2: gl.constexpr,
              HAS_SINK: gl.constexpr, CHECK_RANGE: gl.constexpr, HAS_MAXL: gl.constexpr,
              SPLIT: gl.constexpr):
    """The two consumer warp groups: q into shared memory, each tile's dots (the rope dot
    with ``HAS_PE``: rows of 576) and online-softmax step, then the epilogue (out through q's
    shared memory). ``FENCE_READY``: a proxy fence after each ``ready`` wait, for a producer
    whose ``cp.async`` writes arrive on ``ready`` unfenced (``mla.fast.sm90.sparse_ws_bf16``;
    this module's producer fences before it arrives)."""
    BM: gl.constexpr = 64
    BN: gl.constexpr = 64
    DV: gl.constexpr = 512
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 32, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 256, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    c_s = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    acc = gl.zeros([BM, DV], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BM, BN], gl.float32, layout=s_layout)
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BM], gl.float32, layout=row_s)
    # q's 64 heads by cp.async, all in flight at once: one load latency, while the producer
    # gathers the first tile (heads past N: zeros)
    ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                        warps_per_cta=[8, 1], order=[1, 0])
    h_ld = g * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
    q_row = Q + qi64 * stride_qq + h_ld.to(gl.int64) * stride_qh
    c_ld = gl.arange(0, 64, layout=gl.SliceLayout(0, ld))
    for c in gl.static_range(DV // 64):
        async_copy.async_copy_global_to_shared(q_nope.slice(c * 64, 64, dim=1),
                                               q_row[:, None] + (c * 64 + c_ld)[None, :],
                                               mask=(h_ld < N)[:, None])
    if HAS_PE:
        async_copy.async_copy_global_to_shared(q_pe, q_row[:, None] + (DV + c_ld)[None, :],
                                               mask=(h_ld < N)[:, None])
    async_copy.commit_group()
    async_copy.wait_group(0)
    fence_async_shared()
    barrier()  # every consumer thread's part of q is in
    for i in range(t_lo, t_hi):
        s = (i - t_lo) % 2
        ph = ((i - t_lo) // 2) & 1
        kn = k_nope.index(s)
        ir_i, st_i, hi_i, _, rows_i, _, _ = _source(i, tiles1, idx1, idx2, n1, n2, KV, KV2,
                                                    n_rows, n_rows2, stride_row, stride_row2,
                                                    page_size, page_size2, HAS_EXTRA)
        cols = st_i + c_s
        idx = gl.load(ir_i + cols, mask=cols < hi_i, other=-1)  # for the logits' mask
        mbarrier.wait(ready.index(s), ph)
        if FENCE_READY:  # the producer's copies landed unfenced: the wgmma (async proxy)
            fence_async_shared()  # sees them after this
        sc_ = warpgroup_mma(q_nope, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if HAS_PE:
            sc_ = warpgroup_mma(q_pe, k_pe.index(s).permute((1, 0)), sc_, is_async=True)
        sc_ = warpgroup_mma_wait(num_outstanding=0, deps=(sc_,))
        valid = (cols < hi_i) & (idx >= 0) & (idx < rows_i)
        qk = gl.where(valid[None, :], sc_ * qk_scale, float("-inf"))  # log2 domain
        if CHECK_RANGE:  # an entry outside [-1, n_rows) is a NaN logit: a NaN query
            qk = gl.where(((cols < hi_i) & ((idx < -1) | (idx >= rows_i)))[None, :],
                          float("nan"), qk)
        acc, m_i, l_i = softmax_pv(qk, m_i, l_i, acc, p_smem, kn, gl.SliceLayout(1, o_layout))
        barrier()  # both groups' P · V have read K[s] and P
        mbarrier.arrive(free.index(s))

    # whether a length lies outside [0, topk], read again here (not held across the loop)
    _, bad = _length(TOPK_LEN, qi // S, topk, HAS_TOPK_LEN)
    if HAS_EXTRA:
        _, bad2 = _length(TOPK_LEN2, qi // S, topk2, HAS_TOPK_LEN2)
        bad = bad | bad2
    # out through q's buffer (no dot reads it after the loop's last barrier): 16-byte stores
    epilogue(acc, m_i, l_i, bad, qi.to(gl.int64), g, split, SINK, O, LSE, MAXL, OP, LSEP,
             MAXP, stride_oq, stride_oh, stride_lb, stride_lt, stride_lh, stride_mq, stride_mh,
             num_splits, N, S, HAS_SINK, HAS_MAXL, SPLIT, s_layout, o_layout, q_nope)


@gluon.jit
def _producer(k_nope, k_pe, ready, free, t_lo, t_hi, tiles1, idx1, idx2, n1, n2, KV, KV2,
              n_rows, n_rows2, stride_row, stride_row2, page_size, page_size2,
              HAS_EXTRA: gl.constexpr):
    """The producer warp group: per tile, once the consumers have freed its K buffer, the
    rope copies, the 8 chunks' dequantization (each followed by the load of the chunk four
    later into its registers: this tile's 4-7, then the next tile's 0-3), ``ready``, then
    the L2 prefetch of the tile after the next. The chunks travel as int32 words (4 e4m3
    bytes each): a uint8 tensor held across the loop would take a register a byte."""
    lw: gl.constexpr = _LW
    lists = (tiles1, idx1, idx2, n1, n2, KV, KV2, n_rows, n_rows2, stride_row, stride_row2,
             page_size, page_size2)
    # tile t_lo's first four chunks and its scales; the entries of the next tile (loaded a
    # tile before its rows are needed)
    row, ok = _rows(t_lo, t_hi, _entries(t_lo, lists, HAS_EXTRA, lw), lists, HAS_EXTRA)
    r0 = _chunk(row, ok, 0)
    r1 = _chunk(row, ok, 1)
    r2 = _chunk(row, ok, 2)
    r3 = _chunk(row, ok, 3)
    s0 = _scale(row, ok, 0)
    s1 = _scale(row, ok, 1)
    s2 = _scale(row, ok, 2)
    s3 = _scale(row, ok, 3)
    i_next = _entries(t_lo + 1, lists, HAS_EXTRA, lw)
    _prefetch_rows(t_lo + 1, t_hi, _entries(t_lo + 1, lists, HAS_EXTRA, _PF), lists,
                   HAS_EXTRA)
    for i in range(t_lo, t_hi):
        s = (i - t_lo) % 2
        ph = ((i - t_lo) // 2) & 1
        kn = k_nope.index(s)
        # the entries of the tile after the next (its rows' loads start in the next tile) and
        # of the one to prefetch, loaded a tile before they are used
        i_after = _entries(i + 2, lists, HAS_EXTRA, lw)
        i_pf = _entries(i + 2, lists, HAS_EXTRA, _PF)
        mbarrier.wait(free.index(s), ph)  # the consumers are done with the tile before last
        _copy_rope(row, ok, k_pe.index(s))
        async_copy.commit_group()
        row_n, ok_n = _rows(i + 1, t_hi, i_next, lists, HAS_EXTRA)
        # chunk c (64 bytes of each row) scaled by its 128-block's scale, then the chunk four
        # later into the registers it leaves
        _store_scaled(kn, 0, r0, s0)
        r0 = _chunk(row, ok, 4)
        _store_scaled(kn, 1, r1, s0)
        r1 = _chunk(row, ok, 5)
        s0 = _scale(row_n, ok_n, 0)
        _store_scaled(kn, 2, r2, s1)
        r2 = _chunk(row, ok, 6)
        _store_scaled(kn, 3, r3, s1)
        r3 = _chunk(row, ok, 7)
        s1 = _scale(row_n, ok_n, 1)
        _store_scaled(kn, 4, r0, s2)
        r0 = _chunk(row_n, ok_n, 0)
        _store_scaled(kn, 5, r1, s2)
        r1 = _chunk(row_n, ok_n, 1)
        s2 = _scale(row_n, ok_n, 2)
        _store_scaled(kn, 6, r2, s3)
        r2 = _chunk(row_n, ok_n, 2)
        _store_scaled(kn, 7, r3, s3)
        r3 = _chunk(row_n, ok_n, 3)
        s3 = _scale(row_n, ok_n, 3)
        async_copy.wait_group(0)  # this thread's rope copies have landed
        fence_async_shared()
        barrier()  # every producer thread's part of K[s] is written
        mbarrier.arrive(ready.index(s))
        _prefetch_rows(i + 2, t_hi, i_pf, lists, HAS_EXTRA)
        row = row_n
        ok = ok_n
        i_next = i_after


# the producer's [64, 16] int32 words of a chunk (16 bytes a thread and row: 16-byte loads;
# two rows a thread) and, with the same rows a thread, the [64, 64] bf16 rope values
_LW = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[8, 4],
                                    warps_per_cta=[4, 1], order=[1, 0]))
_LR = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[8, 4],
                                    warps_per_cta=[4, 1], order=[1, 0]))
# [64, 8] addresses a tile: 8 bytes of each row's 656 at most 94 apart (0 to 655), so one in
# every line of 128 the row touches; 4 a thread of the producer's 128
_PF = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[8, 4],
                                    warps_per_cta=[4, 1], order=[1, 0]))


@gluon.jit
def _entries(t, lists, HAS_EXTRA: gl.constexpr, layout: gl.constexpr):
    """Tile ``t``'s 64 entries (``-1`` past its scope's length) in the rows of ``layout``."""
    BN: gl.constexpr = 64
    ir, st, hi, _, _, _, _ = _source(t, *lists, HAS_EXTRA)
    c = st + gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
    return gl.load(ir + c, mask=c < hi, other=-1)


@gluon.jit
def _rows(t, t_hi, entries, lists, HAS_EXTRA: gl.constexpr):
    """Tile ``t``'s 64 rows named by ``entries`` (uint8 pointers) and whether each is read
    (a valid entry of a tile before ``t_hi``; a row not read points at the cache's start)."""
    _, _, _, kv_, rows_, sr_, _ = _source(t, *lists, HAS_EXTRA)
    ok = (entries >= 0) & (entries < rows_) & (t < t_hi)
    return kv_ + gl.where(ok, entries, 0).to(gl.int64) * sr_, ok


@gluon.jit
def _prefetch_rows(t, t_hi, i_pf, lists, HAS_EXTRA: gl.constexpr):
    """``prefetch.global.L2`` of the lines of tile ``t``'s rows named by ``i_pf`` (a row or
    tile not read prefetches the cache's first byte instead)."""
    row, ok = _rows(t, t_hi, i_pf, lists, HAS_EXTRA)
    off = (655 * gl.arange(0, 8, layout=gl.SliceLayout(0, _PF))) // 7
    ptr = row[:, None] + gl.where(ok[:, None], off[None, :], 0)
    gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptr],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _chunk(row, ok, c: gl.constexpr):
    """The rows' e4m3 bytes ``[64 c, 64 c + 64)`` as ``[64, 16]`` int32 words (16-byte loads)
    into registers; rows not read give zeros."""
    ptr = (row + c * 64).to(gl.pointer_type(gl.int32), bitcast=True)
    col = gl.arange(0, 16, layout=gl.SliceLayout(0, _LW))
    return gl.load(ptr[:, None] + col[None, :], mask=ok[:, None], other=0)


@gluon.jit
def _scale(row, ok, b: gl.constexpr):
    """The rows' float32 scale of their 128-block ``b`` (rows not read: 0, so their zero bytes
    stay finite zeros in K)."""
    ptr = (row + _SCALES + 4 * b).to(gl.pointer_type(gl.float32), bitcast=True)
    return gl.load(ptr, mask=ok, other=0.0)


@gluon.jit
def _store_scaled(kn, c: gl.constexpr, w, scale):
    """``e4m3 · scale`` of the words ``w`` (4 e4m3 bytes each, the first the lowest) into K's
    columns ``[64 c, 64 c + 64)``: each pair of bytes converted by the hardware to f16x2,
    widened to float32, multiplied by the row's float32 scale and rounded to bf16 (the
    reference's and the coupled kernel's product and rounding: scales need not be powers of
    two; NaN codes stay NaN)."""
    v0, v1, v2, v3 = gl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi, a0, a1, a2, a3;
        .reg .b32 h0, h1;
        .reg .f32 f0, f1, f2, f3;
        mov.b32 {lo, hi}, $4;
        cvt.rn.f16x2.e4m3x2 h0, lo;
        cvt.rn.f16x2.e4m3x2 h1, hi;
        mov.b32 {a0, a1}, h0;
        mov.b32 {a2, a3}, h1;
        cvt.f32.f16 f0, a0;
        cvt.f32.f16 f1, a1;
        cvt.f32.f16 f2, a2;
        cvt.f32.f16 f3, a3;
        mul.rn.f32 f0, f0, $5;
        mul.rn.f32 f1, f1, $5;
        mul.rn.f32 f2, f2, $5;
        mul.rn.f32 f3, f3, $5;
        cvt.rn.bf16.f32 $0, f0;
        cvt.rn.bf16.f32 $1, f1;
        cvt.rn.bf16.f32 $2, f2;
        cvt.rn.bf16.f32 $3, f3;
        }""",
        "=h,=h,=h,=h,r,f", [w, scale[:, None]],
        dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
    # [64, 16, 2, 2] -> [64, 64]: byte 4 j + k of a row at column 4 j + k (join's new axis is
    # the last: [..., a, b] holds byte 2 a + b, so the inner joins pair bytes 0, 2 and 1, 3)
    v = gl.reshape(gl.join(gl.join(v0, v2), gl.join(v1, v3)), [64, 64])
    kn.slice(c * 64, 64, dim=1).store(v)


@gluon.jit
def _copy_rope(row, ok, kp):
    """``cp.async`` copies of the rows' 64 bf16 rope values into ``kp``; a row not read
    copies zeros."""
    rows: gl.constexpr = gl.SliceLayout(1, _LR)  # the words' rows: no data moves
    ptr = gl.convert_layout((row + _ROPE).to(gl.pointer_type(kp.dtype), bitcast=True), rows)
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, _LR))
    async_copy.async_copy_global_to_shared(kp, ptr[:, None] + c[None, :],
                                           mask=gl.convert_layout(ok, rows)[:, None])
