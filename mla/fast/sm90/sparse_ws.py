"""MODEL1 sparse decode for Hopper (sm_90) in Gluon, warp-specialized: a producer warp group
gathers and dequantizes while two consumer warp groups run the dots.

The coupled kernel of ``mla.fast.sm90.sparse`` runs four phases of about the same length in
series per 64-entry tile (wait for the staged bytes, dequantize them into K, ``S = q · Kᵀ``,
softmax and ``P · V``; benchmarks/notes/sparse.md). FlashMLA's MODEL1 decode gives the gathers and
the dequantization their own warp group; so does this kernel, for the same 64-head programs
and the same results:

- the consumers (the program's 8 warps, 200 registers a thread): q's 64 heads by ``cp.async``
  first (one load latency, while the producer gathers the first tile), then per tile
  ``S = q · Kᵀ`` split by keys, the softmax statistics across both groups, ``P`` through
  shared memory, ``O += P · V`` split by columns, as the coupled kernel; they wait for
  ``ready[s]`` before a tile in K buffer s and arrive at ``free[s]`` once both groups'
  ``P · V`` have read it; out goes through q's buffer, in 16-byte stores;
- the producer (4 more warps, 104 registers a thread): per tile it loads the entries of the
  next tile's rope and of the tile after it (a tile before their use), waits for ``free[s]``,
  copies the rope values (``cp.async``) into K's last 64 columns, dequantizes the tile's e4m3
  bytes gathered a tile ahead (6 of 7 tiles of 64 bytes staged by ``cp.async``, the 7th and
  the 7 UE8M0 scale bytes in registers) into K, copying each staged tile of the next tile's
  as soon as this tile's is read, arrives at ``ready[s]``, then prefetches into the L2 the
  rows of the tile two ahead (so the next copies wait on the L2, not on the memory);
- two K buffers, so the producer works a tile ahead of the consumers: q 64 KB + K 128 KB +
  P 8 KB + staging 24 KB = 229,924 B of shared memory with the barriers.

``mla.fast.sparse`` launches it for 64-head MODEL1 plans (``model1_kernel`` "warp_specialized",
the default).
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
from mla.fast.sm90.sparse import _length, _model1_row, _source, epilogue, runs

__all__ = ["model1_ws_kernel"]

_PRODUCER_REGS = gl.constexpr(104)  # a producer thread's registers (setmaxnreg; 88 spilled)


@gluon.jit
def model1_ws_kernel(
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
    ``mla.fast.sm90.sparse.sparse_kernel`` over MODEL1 pages (``KV``, ``KV2``: uint8 pages
    ``stride_row`` bytes apart of ``page_size`` tokens; q bf16 rows of 512)."""
    BM: gl.constexpr = 64
    BN: gl.constexpr = 64
    DV: gl.constexpr = 512
    dtype: gl.constexpr = Q.dtype.element_ty

    pid = gl.program_id(0)
    split = gl.program_id(1)
    qi = pid // GROUPS
    g = pid % GROUPS
    qi64 = qi.to(gl.int64)

    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                              rank=2)
    q_nope = gl.allocate_shared_memory(dtype, [BM, DV], smem)
    k_buf = gl.allocate_shared_memory(dtype, [2, BN, DV], smem)
    p_smem = gl.allocate_shared_memory(dtype, [BM, BN], smem)
    rl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    # six allocations: Triton's barrier analysis tells allocations apart, not slices (one
    # allocation: a CTA barrier before every read of the staging too, 21 against 11 a tile)
    raw = (gl.allocate_shared_memory(gl.uint8, [BN, 64], rl),
           gl.allocate_shared_memory(gl.uint8, [BN, 64], rl),
           gl.allocate_shared_memory(gl.uint8, [BN, 64], rl),
           gl.allocate_shared_memory(gl.uint8, [BN, 64], rl),
           gl.allocate_shared_memory(gl.uint8, [BN, 64], rl),
           gl.allocate_shared_memory(gl.uint8, [BN, 64], rl))
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
        (_consumer, (Q, qi64, stride_qq, stride_qh, q_nope, k_buf, p_smem, ready, free, t_lo,
                     t_hi, tiles1, idx1, idx2, n1, n2, KV, KV2, n_rows, n_rows2, stride_row,
                     stride_row2, page_size, page_size2, qk_scale, qi, g, split, TOPK_LEN,
                     TOPK_LEN2, topk, topk2, SINK, O, LSE, MAXL, OP, LSEP, MAXP, stride_oq,
                     stride_oh, stride_lb, stride_lt, stride_lh, stride_mq, stride_mh,
                     num_splits, N, S, HAS_EXTRA, HAS_TOPK_LEN, HAS_TOPK_LEN2, HAS_SINK,
                     CHECK_RANGE, HAS_MAXL, SPLIT)),
        (_producer, (k_buf, raw, ready, free, t_lo, t_hi, tiles1, idx1, idx2, n1, n2, KV, KV2,
                     n_rows, n_rows2, stride_row, stride_row2, page_size, page_size2,
                     HAS_EXTRA)),
    ], [4], [_PRODUCER_REGS])


@gluon.jit
def _consumer(Q, qi64, stride_qq, stride_qh, q_nope, k_buf, p_smem, ready, free, t_lo, t_hi,
              tiles1, idx1, idx2, n1, n2, KV, KV2, n_rows, n_rows2, stride_row, stride_row2,
              page_size, page_size2, qk_scale, qi, g, split, TOPK_LEN, TOPK_LEN2, topk, topk2,
              SINK, O, LSE, MAXL, OP, LSEP, MAXP, stride_oq, stride_oh, stride_lb, stride_lt,
              stride_lh, stride_mq, stride_mh, num_splits, N: gl.constexpr, S: gl.constexpr,
              HAS_EXTRA: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
              HAS_TOPK_LEN2: gl.constexpr, HAS_SINK: gl.constexpr, CHECK_RANGE: gl.constexpr,
              HAS_MAXL: gl.constexpr, SPLIT: gl.constexpr):
    """The two consumer warp groups: q into shared memory, each tile's dots and online-softmax
    step, then the epilogue (out through q's shared memory)."""
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
    async_copy.commit_group()
    async_copy.wait_group(0)
    fence_async_shared()
    barrier()  # every consumer thread's part of q is in
    for i in range(t_lo, t_hi):
        s = (i - t_lo) % 2
        ph = ((i - t_lo) // 2) & 1
        kn = k_buf.index(s)
        ir_i, st_i, hi_i, _, rows_i, _, _ = _source(i, tiles1, idx1, idx2, n1, n2, KV, KV2,
                                                    n_rows, n_rows2, stride_row, stride_row2,
                                                    page_size, page_size2, HAS_EXTRA)
        cols = st_i + c_s
        idx = gl.load(ir_i + cols, mask=cols < hi_i, other=-1)  # for the logits' mask
        mbarrier.wait(ready.index(s), ph)
        sc_ = warpgroup_mma(q_nope, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
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
    # (measured 3-10% faster at N=128, benchmarks/notes/sparse.md)
    epilogue(acc, m_i, l_i, bad, qi.to(gl.int64), g, split, SINK, O, LSE, MAXL, OP, LSEP,
             MAXP, stride_oq, stride_oh, stride_lb, stride_lt, stride_lh, stride_mq, stride_mh,
             num_splits, N, S, HAS_SINK, HAS_MAXL, SPLIT, s_layout, o_layout, q_nope)


@gluon.jit
def _producer(k_buf, raw, ready, free, t_lo, t_hi, tiles1, idx1, idx2, n1, n2, KV, KV2,
              n_rows, n_rows2, stride_row, stride_row2, page_size, page_size2,
              HAS_EXTRA: gl.constexpr):
    """The producer warp group: each tile's rope copies and dequantization into its K buffer
    once the consumers have freed it, the next tile's gather, ``ready``, then the L2 prefetch
    of the tile after the next. Each thread reads back only the staged bytes its own copies
    wrote (the same layout), so a wait for its copies needs no barrier (Triton still puts one
    before each copy into a staging buffer it has read: six allocations, not six slices of
    one, keep it to that one)."""
    ld8p: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[8, 4],
                                          warps_per_cta=[4, 1], order=[1, 0])
    lists = (tiles1, idx1, idx2, n1, n2, KV, KV2, n_rows, n_rows2, stride_row, stride_row2,
             page_size, page_size2)
    # tile t_lo's bytes; the entries of a tile, loaded a tile before its gather, name its
    # rope values too (the same rows)
    i_8 = _entries(t_lo, lists, HAS_EXTRA, ld8p)
    row, ok, sc_off = _rows(t_lo, t_hi, i_8, lists, HAS_EXTRA)
    for c in gl.static_range(6):
        _stage(raw, row, ok, c, ld8p)
    async_copy.commit_group()
    e6, codes = _in_registers(row, ok, sc_off, ld8p)
    i_next = _entries(t_lo + 1, lists, HAS_EXTRA, ld8p)
    # the rows of the tiles after it into the L2: their copies then wait on the L2, not on
    # the memory (the staging holds one tile, so a copy is issued only a tile before its use)
    for t in gl.static_range(1, _PREFETCH + 1):
        _prefetch(t_lo + t, t_hi, lists, HAS_EXTRA)
    for i in range(t_lo, t_hi):
        s = (i - t_lo) % 2
        ph = ((i - t_lo) // 2) & 1
        kn = k_buf.index(s)
        # the entries of the tile after the next and of the one to prefetch, loaded a tile
        # before they are used (their latency overlaps this tile's work)
        i_after = _entries(i + 2, lists, HAS_EXTRA, ld8p)
        i_pf = _entries(i + _PREFETCH + 1, lists, HAS_EXTRA, _PF)
        _, _, _, kv_, rows_, sr_, ps_ = _source(i, *lists, HAS_EXTRA)
        mbarrier.wait(free.index(s), ph)  # the consumers are done with the tile before last
        _copy_rope(kv_, i_8, rows_, sr_, ps_, kn, ld8p)
        async_copy.commit_group()
        # tile i+1's rows: each of its staged e4m3 tiles is copied as soon as this tile's
        # is read (measured 3-5% faster than after the whole dequantization)
        row, ok, sc_off = _rows(i + 1, t_hi, i_next, lists, HAS_EXTRA)
        async_copy.wait_group(1)  # tile i's staged bytes (its rope copies may not land)
        for c in gl.static_range(6):
            _store_scaled(kn.slice(c * 64, 64, dim=1), raw[c].load(ld8p),
                          _scale(codes, c))
            _stage(raw, row, ok, c, ld8p)
        async_copy.commit_group()
        _store_scaled(kn.slice(384, 64, dim=1), e6, _scale(codes, 6))
        e6, codes = _in_registers(row, ok, sc_off, ld8p)
        async_copy.wait_group(1)  # tile i's rope copies (tile i+1's bytes may not land)
        fence_async_shared()
        barrier()  # every producer thread's part of K[s] is written
        mbarrier.arrive(ready.index(s))
        _prefetch_rows(i + _PREFETCH + 1, t_hi, i_pf, lists, HAS_EXTRA)
        i_8 = i_next
        i_next = i_after
    async_copy.wait_group(0)  # the copies issued past the last tile (masked: zeros) land


# tiles past the next one whose rows are prefetched into the L2 (1: measured faster than 2 at
# six of the eight B=64 shapes, benchmarks/notes/sparse.md)
_PREFETCH = gl.constexpr(1)
# [64, 8] addresses a tile: 8 bytes of each row's 576, at most 82 apart, so one in every line
# of 128 the row touches; 4 a thread of the producer's 128 (the scale bytes are loaded into
# registers a tile before their use: not prefetched)
_PF = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[8, 4],
                                    warps_per_cta=[4, 1], order=[1, 0]))


@gluon.jit
def _prefetch(t, t_hi, lists, HAS_EXTRA: gl.constexpr):
    """``_prefetch_rows`` of tile ``t``, its entries loaded here."""
    _prefetch_rows(t, t_hi, _entries(t, lists, HAS_EXTRA, _PF), lists, HAS_EXTRA)


@gluon.jit
def _prefetch_rows(t, t_hi, i_pf, lists, HAS_EXTRA: gl.constexpr):
    """``prefetch.global.L2`` of the lines of tile ``t``'s data rows named by ``i_pf`` (a row
    or tile not read prefetches the cache's first byte instead)."""
    _, _, _, kv_, rows_, sr_, ps_ = _source(t, *lists, HAS_EXTRA)
    ok, pg, tok = _model1_row(i_pf, rows_, ps_, sr_)
    off = gl.where((ok & (t < t_hi))[:, None],
                   pg[:, None] + tok[:, None] * 576
                   + 82 * gl.arange(0, 8, layout=gl.SliceLayout(0, _PF))[None, :], 0)
    gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [kv_ + off],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _entries(t, lists, HAS_EXTRA: gl.constexpr, layout: gl.constexpr):
    """Tile ``t``'s 64 entries (``-1`` past its scope's length) in the rows of ``layout``."""
    BN: gl.constexpr = 64
    ir, st, hi, _, _, _, _ = _source(t, *lists, HAS_EXTRA)
    c = st + gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
    return gl.load(ir + c, mask=c < hi, other=-1)


@gluon.jit
def _rows(t, t_hi, i_8, lists, HAS_EXTRA: gl.constexpr):
    """Tile ``t``'s 64 data rows named by its entries ``i_8`` (uint8 pointers), whether each
    is read (a valid entry of a tile before ``t_hi``), and the offset of each row's scale
    bytes from it."""
    _, _, _, kv_, rows_, sr_, ps_ = _source(t, *lists, HAS_EXTRA)
    ok, pg, tok = _model1_row(i_8, rows_, ps_, sr_)
    # a token's scale bytes are at 576 · page_size + 8 · token of its page, so at
    # 576 · page_size − 568 · token of its data row
    return (kv_ + pg + tok * 576, ok & (t < t_hi), (ps_ * 576).to(gl.int64) - 568 * tok)


@gluon.jit
def _stage(raw, row, ok, c: gl.constexpr, ld8p: gl.constexpr):
    """``cp.async`` of the rows' e4m3 tile ``c`` (64 bytes at ``64 c``) into ``raw[c]``
    (masked rows: zeros)."""
    col = gl.arange(0, 64, layout=gl.SliceLayout(0, ld8p))
    async_copy.async_copy_global_to_shared(raw[c], row[:, None] + (c * 64 + col)[None, :],
                                           mask=ok[:, None])


@gluon.jit
def _in_registers(row, ok, sc_off, ld8p: gl.constexpr):
    """The rows' 7th e4m3 tile (``[64, 64]`` uint8) and their 8 scale bytes (one int64 a row:
    byte c is tile c's UE8M0 scale; at ``576 · page_size + 8 · token`` of the page, i.e.
    ``row + sc_off``), loaded into registers; masked rows read zeros (value 0, scale 0)."""
    col = gl.arange(0, 64, layout=gl.SliceLayout(0, ld8p))
    e6 = gl.load(row[:, None] + (384 + col)[None, :], mask=ok[:, None], other=0)
    # 8-byte aligned: the page starts 16-byte aligned, 576 · page_size and 8 · token too
    sc_ptr = (row + sc_off).to(gl.pointer_type(gl.int64), bitcast=True)
    return e6, gl.load(sc_ptr, mask=ok, other=0)


@gluon.jit
def _copy_rope(KV, entries, n_rows, page_stride, page_size, kn, layout: gl.constexpr):
    """``cp.async`` copies of the named tokens' 64 bf16 rope values (at byte 448 of a token's
    576) into K's columns 448-511; an invalid entry copies zeros."""
    ok, pg, tok = _model1_row(entries, n_rows, page_size, page_stride)
    ptr = (KV + pg + tok * 576 + 448).to(gl.pointer_type(kn.dtype), bitcast=True)
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    async_copy.async_copy_global_to_shared(kn.slice(448, 64, dim=1), ptr[:, None] + c[None, :],
                                           mask=ok[:, None])


@gluon.jit
def _scale(codes, c: gl.constexpr):
    """Tile c's scale ``2^(byte − 127)`` from its UE8M0 byte in ``codes`` as a bfloat16, built
    from its bits (``byte << 7``; the byte 0: 2^-127, the subnormal 0x0040; 0xFF: NaN), exact
    for every byte."""
    byte = ((codes >> (8 * c)) & 255).to(gl.int32)
    bits = gl.where(byte == 255, 0x7FC0, gl.where(byte == 0, 0x0040, byte << 7)).to(gl.int16)
    return bits.to(gl.bfloat16, bitcast=True)


@gluon.jit
def _store_scaled(dst, b8, scale):
    """``e4m3(b8) · scale`` (a row's bfloat16 scale) into ``dst`` (bf16): each pair of bytes
    converted by the hardware to f16x2, widened to f32 and packed to bf16x2 (exact: every
    e4m3 value is a bf16), then one ``mul.rn.bf16x2`` by the power of two: one rounding, the
    bf16 of the exact product, as the reference's float32 product rounded to bf16 (NaN codes
    and subnormals through the hardware conversions; 16 fewer float32 multiplies a thread and
    tile of 64 than converting to float32 and multiplying there)."""
    v = gl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi, a0, a1, a2, a3;
        .reg .b32 h0, h1;
        .reg .f32 f0, f1, f2, f3;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 h0, lo;
        cvt.rn.f16x2.e4m3x2 h1, hi;
        mov.b32 {a0, a1}, h0;
        mov.b32 {a2, a3}, h1;
        cvt.f32.f16 f0, a0;
        cvt.f32.f16 f1, a1;
        cvt.f32.f16 f2, a2;
        cvt.f32.f16 f3, a3;
        cvt.rn.bf16x2.f32 $0, f1, f0;
        cvt.rn.bf16x2.f32 $1, f3, f2;
        mul.rn.bf16x2 $0, $0, $3;
        mul.rn.bf16x2 $1, $1, $4;
        }""",
        "=r,=r,r,r,r", [b8, scale[:, None]], dtype=gl.bfloat16, is_pure=True, pack=4)
    dst.store(v)
