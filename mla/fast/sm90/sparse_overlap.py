"""MODEL1 sparse decode for Hopper (sm_90) in Gluon, the dequantization overlapped with the dots.

``mla.fast.sm90.sparse``'s MODEL1 path runs four phases of about the same length in series per
64-entry tile (wait for the staged bytes, dequantize them into K, ``S = q · Kᵀ``, softmax and
``P · V``; benchmarks/NOTES.md). Here, for the same 64-head programs and the same results:

- two bf16 K buffers (``K[i % 2]`` holds tile i): q 64 KB + K 128 KB + P 8 KB = 200 KB of
  shared memory, so the staging buffer holds 6 of a row's 7 tiles of 64 e4m3 bytes (24 KB, one
  ``[64, 64]`` slab per tile, rows 64 bytes apart: a quarter warp's 16-byte reads are
  conflict-free); the 7th tile (16 bytes a thread) and the 7 UE8M0 scale bytes (one 8-byte
  load a row) go into registers (holding all 7 tiles there spills: the accumulator and the
  dots' operands already fill the 255 registers);
- a tile's bytes are gathered a tile ahead, issued right after the previous tile's bytes are
  dequantized, so that a tile's dots and softmax cover their latency; each thread reads back
  only the bytes its own ``cp.async`` copies wrote (the same layout), so their wait needs no
  barrier; its 64 bf16 rope values go by ``cp.async`` straight into the K buffer's last 64
  columns;
- tile i+1's registers are dequantized into ``K[(i + 1) % 2]`` while tile i's ``wgmma``s run:
  the first ``QK_CHUNKS`` of the 7 e4m3 tiles while ``S = q · Kᵀ`` runs, the others while
  ``P · V`` runs (``K[(i + 1) % 2]`` was last read by tile i-1's ``P · V``, which every warp
  waited for before the barrier that ends tile i-1); one CTA barrier a tile, at its end.
- ``BF16_DEQUANT``: ``e4m3 → bf16`` times the power-of-two scale in bf16 (exact, as in
  float32: a power of two only moves the exponent, and bf16 has float32's exponent range),
  instead of through float32.

The rest (the list of tiles over one or two scopes, lengths, the NaN policy, sinks, split
partials, the epilogue) is ``mla.fast.sm90.sparse``'s. ``mla.fast.sparse`` launches this kernel
for plans whose ``model1_kernel`` names an overlap variant (``mla.fast.sparse_plan``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mla.fast.sm90.softmax import barrier, softmax_pv
from mla.fast.sm90.sparse import _length, _model1_row, _source, epilogue, load_q

__all__ = ["model1_overlap_kernel"]


@gluon.jit
def model1_overlap_kernel(
    Q, KV, IDX, TOPK_LEN, KV2, IDX2, TOPK_LEN2, SINK, O, LSE, MAXL, OP, LSEP, MAXP,
    stride_qq, stride_qh, stride_iq, stride_row, page_size,
    stride_iq2, stride_row2, page_size2,
    stride_oq, stride_oh, stride_lb, stride_lt, stride_lh, stride_mq, stride_mh,
    n_rows, topk, n_rows2, topk2, qk_scale, num_splits,
    N: gl.constexpr, S: gl.constexpr, GROUPS: gl.constexpr, HAS_EXTRA: gl.constexpr,
    HAS_TOPK_LEN2: gl.constexpr, HAS_TOPK_LEN: gl.constexpr, HAS_SINK: gl.constexpr,
    CHECK_RANGE: gl.constexpr, HAS_MAXL: gl.constexpr, SPLIT: gl.constexpr,
    QK_CHUNKS: gl.constexpr, BF16_DEQUANT: gl.constexpr, PAIRED: gl.constexpr,
    WIDE: gl.constexpr,
):
    """Grid ``(queries · GROUPS, splits)``, 8 warps; the arguments of
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

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 32, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 256, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    # 16-byte vectors a thread: 8 bf16 (q, rope) or 16 e4m3 bytes (one row's 64-byte tile)
    ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                        warps_per_cta=[8, 1], order=[1, 0])
    ld8m: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[8, 4],
                                          warps_per_cta=[8, 1], order=[1, 0])
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                              rank=2)

    q_nope = gl.allocate_shared_memory(dtype, [BM, DV], smem)
    k_buf = gl.allocate_shared_memory(dtype, [2, BN, DV], smem)
    p_smem = gl.allocate_shared_memory(dtype, [BM, BN], smem)
    if WIDE:  # e4m3 tiles in pairs: rows 128 bytes apart, 16-byte chunks swizzled by row
        raw = gl.allocate_shared_memory(gl.uint8, [3, BN, 128],
                                        gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8,
                                                                order=[1, 0]))
    else:
        raw = gl.allocate_shared_memory(gl.uint8, [6, BN, 64],
                                        gl.SwizzledSharedLayout(vec=1, per_phase=1,
                                                                max_phase=1, order=[1, 0]))
    load_q(Q, qi64, g, stride_qq, stride_qh, q_nope, q_nope, N, False, ld)

    # this program's entries: an equal share of whole tiles of the query's list
    n1, _ = _length(TOPK_LEN, qi // S, topk, HAS_TOPK_LEN)
    tiles1 = gl.cdiv(n1, BN)
    n2 = n1
    tiles = tiles1
    if HAS_EXTRA:
        n2, _ = _length(TOPK_LEN2, qi // S, topk2, HAS_TOPK_LEN2)
        tiles = tiles1 + gl.cdiv(n2, BN)
    per_split = gl.cdiv(tiles, num_splits)
    t_lo = split * per_split
    t_hi = gl.minimum(t_lo + per_split, tiles)
    idx1 = IDX + qi64 * stride_iq
    idx2 = idx1
    if HAS_EXTRA:
        idx2 = IDX2 + qi64 * stride_iq2

    # tile t_lo into K[0]; tile t_lo + 1's bytes into registers
    ir, st, hi, kv_, rows_, sr_, ps_ = _source(t_lo, tiles1, idx1, idx2, n1, n2, KV, KV2,
                                               n_rows, n_rows2, stride_row, stride_row2,
                                               page_size, page_size2, HAS_EXTRA)
    i_ld, i_8 = _entries(ir, st, hi, ld, ld8m)
    _copy_rope(kv_, i_ld, t_lo < t_hi, rows_, sr_, ps_, k_buf.index(0), ld)
    e6, codes = _fetch(kv_, i_8, t_lo < t_hi, rows_, sr_, ps_, raw, WIDE, ld8m)
    async_copy.commit_group()
    async_copy.wait_group(0)
    _dequant(k_buf.index(0), raw, e6, codes, 0, 7, BF16_DEQUANT, WIDE, ld8m)
    ir, st, hi, kv_, rows_, sr_, ps_ = _source(t_lo + 1, tiles1, idx1, idx2, n1, n2, KV, KV2,
                                               n_rows, n_rows2, stride_row, stride_row2,
                                               page_size, page_size2, HAS_EXTRA)
    i_ld, i_8 = _entries(ir, st, hi, ld, ld8m)
    e6, codes = _fetch(kv_, i_8, t_lo + 1 < t_hi, rows_, sr_, ps_, raw, WIDE, ld8m)
    async_copy.commit_group()
    fence_async_shared()
    barrier()  # K[0] is written
    _copy_rope(kv_, i_ld, t_lo + 1 < t_hi, rows_, sr_, ps_, k_buf.index(1), ld)
    async_copy.commit_group()

    acc = gl.zeros([BM, DV], gl.float32, layout=o_layout)
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BM], gl.float32, layout=row_s)
    lists = (tiles1, idx1, idx2, n1, n2, KV, KV2, n_rows, n_rows2, stride_row, stride_row2,
             page_size, page_size2)
    if PAIRED:  # K[0] and K[1] named by constants: the compiler sees them apart
        for j in range(t_lo, t_hi, 2):
            acc, m_i, l_i, e6, codes = _tile(
                j, t_hi, k_buf.index(0), k_buf.index(1), raw, q_nope, p_smem, acc, m_i, l_i,
                e6, codes, lists, qk_scale, HAS_EXTRA, CHECK_RANGE, QK_CHUNKS,
                BF16_DEQUANT, WIDE, ld, ld8m, s_layout, o_layout)
            if j + 1 < t_hi:
                acc, m_i, l_i, e6, codes = _tile(
                    j + 1, t_hi, k_buf.index(1), k_buf.index(0), raw, q_nope, p_smem, acc, m_i,
                    l_i, e6, codes, lists, qk_scale, HAS_EXTRA, CHECK_RANGE,
                    QK_CHUNKS, BF16_DEQUANT, WIDE, ld, ld8m, s_layout, o_layout)
    else:
        for i in range(t_lo, t_hi):
            s = (i - t_lo) % 2
            acc, m_i, l_i, e6, codes = _tile(
                i, t_hi, k_buf.index(s), k_buf.index(1 - s), raw, q_nope, p_smem, acc, m_i,
                l_i, e6, codes, lists, qk_scale, HAS_EXTRA, CHECK_RANGE, QK_CHUNKS,
                BF16_DEQUANT, WIDE, ld, ld8m, s_layout, o_layout)
    async_copy.wait_group(0)  # the copies issued past the last tile (masked: zeros) land

    # whether a length lies outside [0, topk]: read again here rather than held across the
    # loop (Triton 3.7's registers spilled it)
    _, bad = _length(TOPK_LEN, qi // S, topk, HAS_TOPK_LEN)
    if HAS_EXTRA:
        _, bad2 = _length(TOPK_LEN2, qi // S, topk2, HAS_TOPK_LEN2)
        bad = bad | bad2
    epilogue(acc, m_i, l_i, bad, qi64, g, split, SINK, O, LSE, MAXL, OP, LSEP, MAXP,
             stride_oq, stride_oh, stride_lb, stride_lt, stride_lh, stride_mq, stride_mh,
             num_splits, N, S, HAS_SINK, HAS_MAXL, SPLIT, s_layout, o_layout)


@gluon.jit
def _tile(i, t_hi, kn, nxt, raw, q_nope, p_smem, acc, m_i, l_i, e6, codes, lists, qk_scale,
          HAS_EXTRA: gl.constexpr, CHECK_RANGE: gl.constexpr, QK_CHUNKS: gl.constexpr,
          BF16_DEQUANT: gl.constexpr, WIDE: gl.constexpr, ld: gl.constexpr,
          ld8m: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Tile i (in ``kn``): its dots and online-softmax step, while tile i+1 (e4m3 bytes staged
    in ``raw`` and ``e6``, scales ``codes``; its rope values already copied into ``nxt``) is
    dequantized into ``nxt``, then tile i+2 gathered (its rope values into ``kn`` once every
    warp is done with tile i). Returns the softmax state and tile i+2's registers."""
    BN: gl.constexpr = 64
    (tiles1, idx1, idx2, n1, n2, KV, KV2, n_rows, n_rows2, stride_row, stride_row2, page_size,
     page_size2) = lists
    ir_i, st_i, hi_i, _, rows_i, _, _ = _source(i, tiles1, idx1, idx2, n1, n2, KV, KV2,
                                                n_rows, n_rows2, stride_row, stride_row2,
                                                page_size, page_size2, HAS_EXTRA)
    cols = st_i + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    idx = gl.load(ir_i + cols, mask=cols < hi_i, other=-1)  # for the logits' mask
    s_zero = gl.zeros([64, BN], gl.float32, layout=s_layout)
    sc_ = warpgroup_mma(q_nope, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if QK_CHUNKS > 0:
        async_copy.wait_group(1)  # tile i+1's staged bytes (its rope copies may not land)
        _dequant(nxt, raw, e6, codes, 0, QK_CHUNKS, BF16_DEQUANT, WIDE, ld8m)
    if QK_CHUNKS == 7:  # tile i+1's bytes all consumed: gather tile i+2's
        ir, st, hi, kv_, rows_, sr_, ps_ = _source(i + 2, tiles1, idx1, idx2, n1, n2, KV,
                                                   KV2, n_rows, n_rows2, stride_row,
                                                   stride_row2, page_size, page_size2,
                                                   HAS_EXTRA)
        i_ld, i_8 = _entries(ir, st, hi, ld, ld8m)
        e6, codes = _fetch(kv_, i_8, i + 2 < t_hi, rows_, sr_, ps_, raw, WIDE, ld8m)
        async_copy.commit_group()
    sc_ = warpgroup_mma_wait(num_outstanding=0, deps=(sc_,))
    valid = (cols < hi_i) & (idx >= 0) & (idx < rows_i)
    qk = gl.where(valid[None, :], sc_ * qk_scale, float("-inf"))  # log2 domain
    if CHECK_RANGE:  # an entry outside [-1, n_rows) is a NaN logit: a NaN query
        qk = gl.where(((cols < hi_i) & ((idx < -1) | (idx >= rows_i)))[None, :],
                      float("nan"), qk)
    acc, m_i, l_i = softmax_pv(qk, m_i, l_i, acc, p_smem, kn, gl.SliceLayout(1, o_layout),
                               WAIT=False)
    if QK_CHUNKS < 7:
        async_copy.wait_group(1)  # tile i+1's staged bytes (its rope copies may not land)
        _dequant(nxt, raw, e6, codes, QK_CHUNKS, 7, BF16_DEQUANT, WIDE, ld8m)
        ir, st, hi, kv_, rows_, sr_, ps_ = _source(i + 2, tiles1, idx1, idx2, n1, n2, KV,
                                                   KV2, n_rows, n_rows2, stride_row,
                                                   stride_row2, page_size, page_size2,
                                                   HAS_EXTRA)
        i_ld, i_8 = _entries(ir, st, hi, ld, ld8m)
        e6, codes = _fetch(kv_, i_8, i + 2 < t_hi, rows_, sr_, ps_, raw, WIDE, ld8m)
        async_copy.commit_group()
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(1)  # tile i+1's rope copies (tile i+2's bytes may not land)
    fence_async_shared()
    barrier()  # K[(i + 1) % 2] is written; every warp is done with K[i % 2] and P
    # tile i+2's rope values into K[i % 2], now free (so no entry is held across the tile)
    _copy_rope(kv_, i_ld, i + 2 < t_hi, rows_, sr_, ps_, kn, ld)
    async_copy.commit_group()
    return acc, m_i, l_i, e6, codes


@gluon.jit
def _entries(idx_row, start, hi, ld: gl.constexpr, ld8m: gl.constexpr):
    """Entries ``[start, start + 64)`` of the list (``-1`` past ``hi``) in the row layouts of
    the rope copies (``ld``) and of the e4m3 and scale loads (``ld8m``)."""
    BN: gl.constexpr = 64
    c1 = start + gl.arange(0, BN, layout=gl.SliceLayout(1, ld))
    c2 = start + gl.arange(0, BN, layout=gl.SliceLayout(1, ld8m))
    return (gl.load(idx_row + c1, mask=c1 < hi, other=-1),
            gl.load(idx_row + c2, mask=c2 < hi, other=-1))


@gluon.jit
def _copy_rope(KV, i_ld, issue, n_rows, page_stride, page_size, kn, ld: gl.constexpr):
    """When ``issue``, ``cp.async`` copies of the named tokens' 64 bf16 rope values (at byte
    448 of a token's 576) into K's columns 448-511; an invalid entry copies zeros."""
    ok, pg, tok = _model1_row(i_ld, n_rows, page_size, page_stride)
    ptr = (KV + pg + tok * 576 + 448).to(gl.pointer_type(kn.dtype), bitcast=True)
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, ld))
    async_copy.async_copy_global_to_shared(kn.slice(448, 64, dim=1), ptr[:, None] + c[None, :],
                                           mask=(ok & issue)[:, None])


@gluon.jit
def _fetch(KV, i_8, issue, n_rows, page_stride, page_size, raw, WIDE: gl.constexpr,
           ld8m: gl.constexpr):
    """When ``issue``, the named tokens' first 6 tiles of 64 e4m3 bytes copied by ``cp.async``
    into ``raw`` (not committed), and their 7th tile (``[64, 64]`` uint8) and their scale
    bytes (one int64 a row: byte c is tile c's UE8M0 scale) loaded into registers, both
    returned; an invalid entry reads zeros (value 0 at scale 0)."""
    ok, pg, tok = _model1_row(i_8, n_rows, page_size, page_stride)
    ok = ok & issue
    row = KV + pg + tok * 576
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, ld8m))
    m = ok[:, None]
    if WIDE:  # tiles 2t and 2t + 1 side by side
        c2 = gl.arange(0, 128, layout=gl.SliceLayout(0, ld8m))
        for t in gl.static_range(3):
            async_copy.async_copy_global_to_shared(raw.index(t),
                                                   row[:, None] + (t * 128 + c2)[None, :],
                                                   mask=m)
    else:
        for t in gl.static_range(6):
            async_copy.async_copy_global_to_shared(raw.index(t),
                                                   row[:, None] + (t * 64 + c)[None, :], mask=m)
    e6 = gl.load(row[:, None] + (384 + c)[None, :], mask=m, other=0)
    # the page's scales follow its page_size data rows of 576 bytes, 8 bytes a token (the
    # page starts 16-byte aligned: the 8-byte load is aligned)
    sc_ptr = (KV + pg + page_size * 576 + tok * 8).to(gl.pointer_type(gl.int64), bitcast=True)
    codes = gl.load(sc_ptr, mask=ok, other=0)
    return e6, codes


@gluon.jit
def _dequant(kn, raw, e6, codes, LO: gl.constexpr, HI: gl.constexpr,
             BF16_DEQUANT: gl.constexpr, WIDE: gl.constexpr, ld8m: gl.constexpr):
    """e4m3 tiles ``[LO, HI)`` (0-5 from ``raw``, 6 from ``e6``) into K's columns
    ``[64 LO, 64 HI)`` (``WIDE``: two tiles a store, ``LO`` and ``HI`` even or 7)."""
    if WIDE:
        gl.static_assert(LO % 2 == 0 and (HI % 2 == 0 or HI == 7), "WIDE: pairs of tiles")
        col = gl.arange(0, 128, layout=gl.SliceLayout(0, ld8m))
        for t in gl.static_range(LO // 2, (HI - HI // 7) // 2):
            scale = gl.where(col[None, :] < 64, _scale(codes, 2 * t)[:, None],
                             _scale(codes, 2 * t + 1)[:, None])
            _store_scaled(kn.slice(t * 128, 128, dim=1), raw.index(t).load(ld8m), scale,
                          BF16_DEQUANT)
    else:
        for c in gl.static_range(LO, HI - HI // 7):
            _store_scaled(kn.slice(c * 64, 64, dim=1), raw.index(c).load(ld8m),
                          _scale(codes, c)[:, None], BF16_DEQUANT)
    if HI == 7:
        _store_scaled(kn.slice(384, 64, dim=1), e6, _scale(codes, 6)[:, None], BF16_DEQUANT)


@gluon.jit
def _scale(codes, c: gl.constexpr):
    """Tile c's scale ``2^(byte − 127)`` from its UE8M0 byte in ``codes`` (the byte 0xFF: NaN;
    built from the exponent bits, exact for the bytes 1-254; 0 reads as 0)."""
    byte = ((codes >> (8 * c)) & 255).to(gl.int32)
    return gl.where(byte == 255, float("nan"), (byte << 23).to(gl.float32, bitcast=True))


@gluon.jit
def _store_scaled(dst, b8, scale, BF16_DEQUANT: gl.constexpr):
    """``e4m3(b8) · scale`` into ``dst`` in its dtype (``BF16_DEQUANT``: the product in bf16,
    exact as in float32 for a power-of-two scale)."""
    f8 = b8.to(gl.float8e4nv, bitcast=True)
    if BF16_DEQUANT:
        v = f8.to(dst.dtype) * scale.to(dst.dtype)
    else:
        v = (f8.to(gl.float32) * scale).to(dst.dtype)
    dst.store(v)
