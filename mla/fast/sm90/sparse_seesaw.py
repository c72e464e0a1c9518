"""Sparse top-k MLA over rows in q's dtype (bf16/fp16) for Hopper (sm_90) in Gluon, with the
"seesaw" schedule of ``mla.fast.sm90.decode_seesaw``: each warp group owns whole tiles.

``mla.fast.sm90.sparse_ws_bf16`` splits every 64-entry tile's logits between its two consumer
groups by keys (64 × 32 each): both read all of q from shared memory for 32 keys, 2 × 72 KB a
tile for the logits alone, and the groups meet at every tile (the cross-group max, shared P,
CTA barriers). Its sparse prefill ran at 1.32-1.38x FlashMLA's time, 55% of the matmul
ceiling (benchmarks/notes/sparse.md). Here, as FlashMLA schedules its sparse prefill:

- the entries come in pairs of 64-entry tiles, stage 0 and stage 1. Group 0 computes the
  logits of stage 0's tile and group 1 those of stage 1's, each a 64 × 64 tile of its own
  (``wgmma m64n64k16``: q read once per 64 keys).
- the output is split by columns: group 0 holds ``O[:, :256]``, group 1 ``O[:, 256:]``. Each
  multiplies its own probabilities from registers into its half and the other group's from
  shared memory; the running max is handed over as in the dense seesaw (group 0 publishes
  ``m0`` with ``P0``, group 1 ``m1``, the pair's max).
- the rows are gathered by 16-byte ``cp.async`` (a row whose entry is ``-1``, out of range
  or past the length: zeros) in a third, producer warp group (4 warps, 48 registers a
  thread): each half of a stage (the value columns 0-255; the columns 256-511 with the 64
  rope columns) is refilled as soon as the group that reads it last has freed it (its
  ``free`` barrier: group 0 frees the left halves, group 1 the right). Each producer thread
  arrives on the half's ``ready`` barrier with ``cp.async.mbarrier.arrive.noinc`` (128
  arrivals: the half has landed), and a group reading a half waits for it and fences (the
  copies are generic proxy writes, the ``wgmma`` reads through the async proxy). An earlier
  form issued the copies from the consumer groups themselves; it was slower at every shape
  timed (benchmarks/notes/sparse.md) and is gone.

Shared memory: q 64 KB (its 64 rope columns in registers), K two stages of 64 KB + 8 KB of
rope columns, two P tiles of 8 KB: 229,376 B of the 232,448.

Semantics are ``sparse_ws_bf16``'s for one scope: splits (equal or fixed-length, the
partials for the combine kernel), ``topk_length``,
``max_logits``, sinks, the range check (an entry outside ``[-1, rows)`` makes the query NaN),
a length outside ``[0, topk]`` NaN, a query with no key ``out = 0``, ``lse = +inf``. Same
arguments as ``plain_ws_kernel``; launched with ``num_warps=4`` (group 0 and the parent
region), group 1 and the producer in 4 more warps each. ``mla.fast.sparse`` routes to it for
plans naming ``bf16_kernel="seesaw_producer"`` over one scope (a second scope takes
``plain_ws_kernel``).
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

from mla.fast.sm90.decode_seesaw import opaque_zero, seesaw_buffers, use_max
from mla.fast.sm90.softmax import barrier
from mla.fast.sm90.sparse import _length, _source, runs

__all__ = ["NUM_WARPS", "plain_seesaw_kernel"]

NUM_WARPS = 4  # the parent region and group 0; group 1 and the producer add 4 warps each
# group 1's and the producer's registers a thread; group 0 keeps the rest of the 512 a
# thread of each of the three groups shares
_GROUP1_REGS = gl.constexpr(232)
_PRODUCER_REGS = gl.constexpr(48)
_ISSUERS = gl.constexpr(128)  # a ready barrier's arrivals: the producer group's threads
_S = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                            instr_shape=[16, 64, 16]))
_O = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                            instr_shape=[16, 256, 16]))
_P_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_O.value, k_width=2))
_Q_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_S.value, k_width=2))
# a group's [64, 64] copies and loads: 16 bytes a thread and row, 4 rows a thread
_LC = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                    warps_per_cta=[4, 1], order=[1, 0]))


@gluon.jit
def _rows(t, lists, HAS_EXTRA: gl.constexpr):
    """Tile ``t``'s 64 row pointers in the copies' layout and which hold a key."""
    ir, st, hi, kv, rows, sr, _ = _source(t, *lists, HAS_EXTRA)
    c = st + gl.arange(0, 64, layout=gl.SliceLayout(1, _LC))
    e = gl.load(ir + c, mask=c < hi, other=-1)
    ok = (e >= 0) & (e < rows)
    return kv + gl.where(ok, e, 0).to(gl.int64) * sr, ok


@gluon.jit
def _copy(row, ok, dst, col0: gl.constexpr, bar):
    """``cp.async`` of columns ``col0 ..`` (``dst``'s width) of the rows (a row without a key:
    zeros) into ``dst``, then this thread's arrival on ``bar`` once they have landed."""
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, _LC))
    for j in gl.static_range(dst.shape[1] // 64):
        async_copy.async_copy_global_to_shared(dst.slice(j * 64, 64, dim=1),
                                               row[:, None] + (col0 + j * 64 + c)[None, :],
                                               mask=ok[:, None])
    async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _copy_right(row, ok, k_r, k_pe, bar, HAS_PE: gl.constexpr):
    """Columns 256-511 (and with ``HAS_PE`` the rope columns 512-575) into ``k_r``, ``k_pe``."""
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, _LC))
    for j in gl.static_range(4):
        async_copy.async_copy_global_to_shared(k_r.slice(j * 64, 64, dim=1),
                                               row[:, None] + (256 + j * 64 + c)[None, :],
                                               mask=ok[:, None])
    if HAS_PE:
        async_copy.async_copy_global_to_shared(k_pe, row[:, None] + (512 + c)[None, :],
                                               mask=ok[:, None])
    async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _landed(bar, ph):
    """Wait for a half's copies, then make them visible to the ``wgmma`` (async proxy)."""
    mbarrier.wait(bar, ph)
    fence_async_shared()


@gluon.jit
def _logits(t, q_l, q_r, q_pe, k_l, k_r, k_pe, ready_l, ready_r, ph, lists, qk_scale,
            HAS_PE: gl.constexpr, HAS_EXTRA: gl.constexpr, CHECK_RANGE: gl.constexpr):
    """Tile ``t``'s ``q · Kᵀ`` in the log2 domain: ``-inf`` where no key (past the length, an
    entry ``-1`` or out of range), NaN with ``CHECK_RANGE`` where an entry lies outside
    ``[-1, rows)``. The value columns 0-255 start as soon as they have landed."""
    ir, st, hi, _, rows, _, _ = _source(t, *lists, HAS_EXTRA)
    cols = st + gl.arange(0, 64, layout=gl.SliceLayout(0, _S))
    idx = gl.load(ir + cols, mask=cols < hi, other=-1)  # its latency overlaps the waits
    s_zero = gl.zeros([64, 64], gl.float32, layout=_S)
    _landed(ready_l, ph)
    s = warpgroup_mma(q_l, k_l.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    _landed(ready_r, ph)
    s = warpgroup_mma(q_r, k_r.permute((1, 0)), s, is_async=True)
    if HAS_PE:
        s = warpgroup_mma(q_pe, k_pe.permute((1, 0)), s, is_async=True)
    s, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s, q_pe))
    valid = (cols < hi) & (idx >= 0) & (idx < rows)
    qk = gl.where(valid[None, :], s * qk_scale, float("-inf"))
    if CHECK_RANGE:
        qk = gl.where(((cols < hi) & ((idx < -1) | (idx >= rows)))[None, :], float("nan"), qk)
    return qk


@gluon.jit
def _g0_step(i0, ph, acc, m_i, l_i, q_pe, bufs, lists, qk_scale, HAS_PE: gl.constexpr,
             HAS_EXTRA: gl.constexpr, CHECK_RANGE: gl.constexpr, PAIR: gl.constexpr):
    """Group 0's share of the pair starting at tile ``i0`` (``PAIR``: tile ``i0 + 1`` too).
    The halves it reads last go back to the producer group (``free``)."""
    q_l, q_r, k_l, k_r, k_pe, p_smem, m_smem, l_smem, ready, sync, free = bufs
    row_s: gl.constexpr = gl.SliceLayout(1, _S)
    row_o: gl.constexpr = gl.SliceLayout(1, _O)
    dtype: gl.constexpr = q_l.dtype
    z = opaque_zero(i0)
    qk = _logits(i0, q_l.index(z), q_r.index(z), q_pe, k_l.index(z), k_r.index(z),
                 k_pe.index(z), ready[0], ready[1], ph, lists, qk_scale, HAS_PE, HAS_EXTRA,
                 CHECK_RANGE)
    m0 = gl.maximum(m_i, gl.max(qk, axis=1))
    m0_use = use_max(m0)
    alpha0 = gl.exp2(m_i - m0_use)
    p = gl.exp2(qk - m0_use[:, None])
    l_i = l_i * alpha0 + gl.sum(p, axis=1)  # the float32 P's sum, not its bf16 rounding's
    p = p.to(dtype)
    # hand m0 and P0 (at m0) over: group 1 takes P0 into its half before its own softmax
    mbarrier.wait(sync[3], ph)  # group 1's previous P0 · V0 has read the buffer
    p_smem[0].store(p)
    m_smem[0].store(m0)
    fence_async_shared()
    barrier()  # all of P0 and m0 is written before group 1 is told
    mbarrier.arrive(sync[0])
    acc = acc * gl.convert_layout(alpha0, row_o)[:, None]
    p_reg = gl.convert_layout(p, _P_OP)
    acc = warpgroup_mma(p_reg, k_l.index(0), acc, is_async=True)
    acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_reg))
    barrier()  # the group's product has read stage 0's columns 0-255
    mbarrier.arrive(free[0])

    # group 1's max: the pair's
    mbarrier.wait(sync[1], ph)
    m1 = m_smem[1].load(row_s)
    alpha1 = gl.exp2(m0 - use_max(m1))
    acc = acc * gl.convert_layout(alpha1, row_o)[:, None]
    l_i = l_i * alpha1
    mbarrier.wait(sync[2], ph)  # P1 stored (or no second tile)
    if PAIR:
        _landed(ready[2], ph)  # stage 1's columns 0-255 (group 1 waited too; this fences)
        acc = warpgroup_mma(p_smem[1], k_l.index(1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        barrier()
        mbarrier.arrive(free[2])
    return acc, m1, l_i


@gluon.jit
def _g1_step(i0, ph, acc, m_i, l_i, q_pe, bufs, lists, qk_scale, HAS_PE: gl.constexpr,
             HAS_EXTRA: gl.constexpr, CHECK_RANGE: gl.constexpr, PAIR: gl.constexpr):
    """Group 1's share of the pair starting at tile ``i0`` (``PAIR``: tile ``i0 + 1`` exists
    and is group 1's; without it group 1 only takes ``P0`` into its half)."""
    q_l, q_r, k_l, k_r, k_pe, p_smem, m_smem, l_smem, ready, sync, free = bufs
    row_s: gl.constexpr = gl.SliceLayout(1, _S)
    row_o: gl.constexpr = gl.SliceLayout(1, _O)
    dtype: gl.constexpr = q_l.dtype
    if PAIR:
        z = opaque_zero(i0)
        qk = _logits(i0 + 1, q_l.index(z), q_r.index(z), q_pe, k_l.index(z + 1),
                     k_r.index(z + 1), k_pe.index(z + 1), ready[2], ready[3], ph, lists,
                     qk_scale, HAS_PE, HAS_EXTRA, CHECK_RANGE)
    mbarrier.wait(sync[0], ph)  # group 0's max and P0
    m0 = m_smem[0].load(row_s)
    alpha0 = gl.exp2(m_i - use_max(m0))
    # P0 · V0 into this half at m0, under this group's softmax
    acc = acc * gl.convert_layout(alpha0, row_o)[:, None]
    _landed(ready[1], ph)  # stage 0's columns 256-511 (group 0 waited too; this fences)
    acc = warpgroup_mma(p_smem[0], k_r.index(0), acc, is_async=True)
    if PAIR:
        m1 = gl.maximum(m0, gl.max(qk, axis=1))
    else:
        m1 = m0
    m1_use = use_max(m1)
    alpha1 = gl.exp2(m0 - m1_use)
    m_smem[1].store(m1)
    barrier()
    mbarrier.arrive(sync[1])
    if PAIR:
        p = gl.exp2(qk - m1_use[:, None])
        l_i = l_i * (alpha0 * alpha1) + gl.sum(p, axis=1)
        p = p.to(dtype)
        p_smem[1].store(p)
        fence_async_shared()
        barrier()  # all of P1 is written before group 0 is told
        mbarrier.arrive(sync[2])
    else:
        l_i = l_i * (alpha0 * alpha1)
        mbarrier.arrive(sync[2])
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(sync[3])  # P0's buffer is free
    barrier()  # this group's P0 · V0 has read stage 0's columns 256-575
    mbarrier.arrive(free[1])
    acc = acc * gl.convert_layout(alpha1, row_o)[:, None]
    if PAIR:
        p_reg = gl.convert_layout(p, _P_OP)
        acc = warpgroup_mma(p_reg, k_r.index(1), acc, is_async=True)
        acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_reg))
        barrier()
        mbarrier.arrive(free[3])
    return acc, m1, l_i


@gluon.jit
def _group(bufs, lists, outs, strides, qi, g, split, num_splits, t_lo, t_hi, qk_scale,
           TOPK_LEN, TOPK_LEN2, topk, topk2, SINK, N: gl.constexpr, S: gl.constexpr,
           HAS_PE: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
           HAS_TOPK_LEN2: gl.constexpr, HAS_SINK: gl.constexpr, CHECK_RANGE: gl.constexpr,
           HAS_MAXL: gl.constexpr, SPLIT: gl.constexpr, GROUP: gl.constexpr):
    """One warp group's whole program: the pairs of tiles, then its half of the epilogue.
    Group 0 takes the even tiles' logits and output columns 0-255, group 1 the odd tiles'
    and columns 256-511 (and writes lse and max_logits)."""
    q_l, q_r, k_l, k_r, k_pe, p_smem, m_smem, l_smem, ready, sync, free = bufs
    row_s: gl.constexpr = gl.SliceLayout(1, _S)
    BM: gl.constexpr = 64
    DH: gl.constexpr = 256
    if HAS_PE:
        # q's rope columns: the parent left them in P1's buffer, which group 1 overwrites
        # only after group 0's first max (sync 0), published after group 0's own load
        q_pe = p_smem[1].load(_Q_OP)
    else:
        q_pe = gl.zeros([BM, 64], q_l.dtype, layout=_Q_OP)  # unused
    acc = gl.zeros([BM, DH], gl.float32, layout=_O)
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BM], gl.float32, layout=row_s)
    n_here = gl.maximum(t_hi - t_lo, 0)
    n_pairs = n_here // 2
    for j in range(n_pairs):
        i0 = t_lo + 2 * j
        if GROUP == 0:
            acc, m_i, l_i = _g0_step(i0, j & 1, acc, m_i, l_i, q_pe, bufs, lists, qk_scale,
                                     HAS_PE, HAS_EXTRA, CHECK_RANGE, True)
        else:
            acc, m_i, l_i = _g1_step(i0, j & 1, acc, m_i, l_i, q_pe, bufs, lists, qk_scale,
                                     HAS_PE, HAS_EXTRA, CHECK_RANGE, True)
    if n_here % 2 == 1:  # a last tile alone
        i0 = t_lo + 2 * n_pairs
        if GROUP == 0:
            acc, m_i, l_i = _g0_step(i0, n_pairs & 1, acc, m_i, l_i, q_pe, bufs, lists,
                                     qk_scale, HAS_PE, HAS_EXTRA, CHECK_RANGE, False)
        else:
            acc, m_i, l_i = _g1_step(i0, n_pairs & 1, acc, m_i, l_i, q_pe, bufs, lists,
                                     qk_scale, HAS_PE, HAS_EXTRA, CHECK_RANGE, False)

    # the row sums of both groups
    l_smem[GROUP].store(l_i)
    barrier()
    mbarrier.arrive(sync[4])
    mbarrier.wait(sync[4], 0)
    l_i = l_i + l_smem[1 - GROUP].load(row_s)
    # whether a length lies outside [0, topk], read again here (not held across the loop)
    _, bad = _length(TOPK_LEN, qi // S, topk, HAS_TOPK_LEN)
    if HAS_EXTRA:
        _, bad2 = _length(TOPK_LEN2, qi // S, topk2, HAS_TOPK_LEN2)
        bad = bad | bad2
    # out through this group's half of q's buffer (no dot reads q after the row sums' barrier)
    if GROUP == 0:
        o_smem = q_l.index(0)
    else:
        o_smem = q_r.index(0)
    _store(acc, m_i, l_i, bad, qi.to(gl.int64), g, split, num_splits, SINK, outs, strides,
           N, S, HAS_SINK, HAS_MAXL, SPLIT, GROUP, o_smem)


@gluon.jit
def _store(acc, m_i, l_i, bad, qi64, g, split, num_splits, SINK, outs, strides,
           N: gl.constexpr, S: gl.constexpr, HAS_SINK: gl.constexpr, HAS_MAXL: gl.constexpr,
           SPLIT: gl.constexpr, GROUP: gl.constexpr, o_smem):
    """A group's columns of ``out`` (and, group 1, ``lse`` and the max logits), as
    ``mla.fast.sm90.sparse.epilogue`` writes them: NaN where ``bad``; a query that saw no key
    gets ``out = 0``, ``lse = +inf``, ``max_logits = -inf``; a NaN logit makes them NaN; or
    (``SPLIT``) this split's partials for the combine kernel (float32, "nothing" an lse of
    ``-inf``, no sink). ``out`` goes through ``o_smem`` (``[64, 256]``, no longer read) in
    16-byte stores of whole 128-byte lines, not from the dots' layout (4 bytes a thread,
    half-used sectors)."""
    O, LSE, MAXL, OP, LSEP, MAXP = outs
    stride_oq, stride_oh, stride_lb, stride_lt, stride_lh, stride_mq, stride_mh = strides
    BM: gl.constexpr = 64
    DH: gl.constexpr = 256
    DV: gl.constexpr = 512
    dtype: gl.constexpr = O.dtype.element_ty
    row_s: gl.constexpr = gl.SliceLayout(1, _S)
    row_o: gl.constexpr = gl.SliceLayout(1, _O)
    seen = l_i != 0.0  # l = 0: nothing seen; a NaN l stays NaN, never "nothing"
    l_safe = gl.where(seen, l_i, 1.0)
    lse2 = m_i + gl.log2(l_safe)
    lse = gl.where(bad, float("nan"), lse2 * 0.6931471805599453)
    mx = gl.where((l_i == l_i) & ~bad, m_i, float("nan")) * 0.6931471805599453
    o = gl.where(bad, float("nan"), acc / gl.convert_layout(l_safe, row_o)[:, None])
    h_s = g * BM + gl.arange(0, BM, layout=row_s)
    hs_ok = h_s < N
    if SPLIT:
        # partials [queries, splits, N, DV] and [queries, splits, N]
        part = qi64 * num_splits + split
        if GROUP == 1:
            gl.store(LSEP + part * N + h_s, gl.where(seen | bad, lse, float("-inf")),
                     mask=hs_ok)
            gl.store(MAXP + part * N + h_s, mx, mask=hs_ok)
        h_o = g * BM + gl.arange(0, BM, layout=row_o)
        c_o = GROUP * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, _O))
        gl.store(OP + (part * N + h_o)[:, None] * DV + c_o[None, :], o,
                 mask=((h_o < N) & gl.convert_layout(seen, row_o))[:, None])
    else:
        if HAS_SINK:
            sink = gl.load(SINK + h_s, mask=hs_ok, other=0.0)
            f = 1.0 / (1.0 + gl.exp2(sink * 1.4426950408889634 - lse2))
            f = gl.where(seen, f, 1.0)  # a query that saw nothing keeps out = 0
            f = gl.where(sink == sink, f, float("nan"))
            o = o * gl.convert_layout(f, row_o)[:, None]
        o_smem.store(o.to(dtype))
        barrier()  # this group's half of out is in shared memory
        h_l = g * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, _LC))
        c_l = GROUP * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, _LC))
        gl.store(O + qi64 * stride_oq + h_l.to(gl.int64)[:, None] * stride_oh + c_l[None, :],
                 o_smem.load(_LC), mask=(h_l < N)[:, None])
        if GROUP == 1:
            gl.store(LSE + (qi64 // S) * stride_lb + (qi64 % S) * stride_lt + h_s * stride_lh,
                     gl.where(seen | bad, lse, float("inf")), mask=hs_ok)
            if HAS_MAXL:
                gl.store(MAXL + qi64 * stride_mq + h_s * stride_mh, mx, mask=hs_ok)


@gluon.jit
def _group0(bufs, lists, outs, strides, qi, g, split, num_splits, t_lo, t_hi, qk_scale,
            TOPK_LEN, TOPK_LEN2, topk, topk2, SINK, N: gl.constexpr, S: gl.constexpr,
            HAS_PE: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
            HAS_TOPK_LEN2: gl.constexpr, HAS_SINK: gl.constexpr, CHECK_RANGE: gl.constexpr,
            HAS_MAXL: gl.constexpr, SPLIT: gl.constexpr):
    _group(bufs, lists, outs, strides, qi, g, split, num_splits, t_lo, t_hi, qk_scale,
           TOPK_LEN, TOPK_LEN2, topk, topk2, SINK, N, S, HAS_PE, HAS_EXTRA, HAS_TOPK_LEN,
           HAS_TOPK_LEN2, HAS_SINK, CHECK_RANGE, HAS_MAXL, SPLIT, 0)


@gluon.jit
def _group1(bufs, lists, outs, strides, qi, g, split, num_splits, t_lo, t_hi, qk_scale,
            TOPK_LEN, TOPK_LEN2, topk, topk2, SINK, N: gl.constexpr, S: gl.constexpr,
            HAS_PE: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
            HAS_TOPK_LEN2: gl.constexpr, HAS_SINK: gl.constexpr, CHECK_RANGE: gl.constexpr,
            HAS_MAXL: gl.constexpr, SPLIT: gl.constexpr):
    _group(bufs, lists, outs, strides, qi, g, split, num_splits, t_lo, t_hi, qk_scale,
           TOPK_LEN, TOPK_LEN2, topk, topk2, SINK, N, S, HAS_PE, HAS_EXTRA, HAS_TOPK_LEN,
           HAS_TOPK_LEN2, HAS_SINK, CHECK_RANGE, HAS_MAXL, SPLIT, 1)


@gluon.jit
def _producer(bufs, lists, t_lo, t_hi, HAS_PE: gl.constexpr, HAS_EXTRA: gl.constexpr):
    """The producer group: per pair, each half as soon as the group that read
    it last has freed it (stage 0 left, stage 0 right with the rope, stage 1 left, stage 1
    right), its rows' copies and this thread's arrival on the half's ``ready`` once they
    land (it never waits for its own copies)."""
    q_l, q_r, k_l, k_r, k_pe, p_smem, m_smem, l_smem, ready, sync, free = bufs
    n_pairs = (gl.maximum(t_hi - t_lo, 0) + 1) // 2
    for j in range(n_pairs):
        ph = j & 1
        t0 = t_lo + 2 * j
        row0, ok0 = _rows(t0, lists, HAS_EXTRA)
        row1, ok1 = _rows(t0 + 1, lists, HAS_EXTRA)
        mbarrier.wait(free[0], ph)
        _copy(row0, ok0, k_l.index(0), 0, ready[0])
        mbarrier.wait(free[1], ph)
        _copy_right(row0, ok0, k_r.index(0), k_pe.index(0), ready[1], HAS_PE)
        if t0 + 1 < t_hi:
            mbarrier.wait(free[2], ph)
            _copy(row1, ok1, k_l.index(1), 0, ready[2])
            mbarrier.wait(free[3], ph)
            _copy_right(row1, ok1, k_r.index(1), k_pe.index(1), ready[3], HAS_PE)


@gluon.jit
def plain_seesaw_kernel(
    Q, KV, IDX, TOPK_LEN, KV2, IDX2, TOPK_LEN2, SINK, O, LSE, MAXL, OP, LSEP, MAXP,
    stride_qq, stride_qh, stride_iq, stride_row, page_size,
    stride_iq2, stride_row2, page_size2,
    stride_oq, stride_oh, stride_lb, stride_lt, stride_lh, stride_mq, stride_mh,
    n_rows, topk, n_rows2, topk2, qk_scale, num_splits,
    N: gl.constexpr, S: gl.constexpr, GROUPS: gl.constexpr, HAS_PE: gl.constexpr,
    HAS_EXTRA: gl.constexpr, HAS_TOPK_LEN2: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
    HAS_SINK: gl.constexpr, CHECK_RANGE: gl.constexpr, HAS_MAXL: gl.constexpr,
    SPLIT: gl.constexpr, SPLIT_TILES: gl.constexpr, SPLIT_CAP: gl.constexpr,
):
    """Grid ``(queries · GROUPS, splits)``, ``num_warps=4`` (+4 for group 1, +4 for the
    producer);
    ``plain_ws_kernel``'s arguments, one scope (``HAS_EXTRA`` false: with a second scope
    ptxas spills)."""
    gl.static_assert(not HAS_EXTRA, "the seesaw kernel reads one scope")
    BM: gl.constexpr = 64
    DH: gl.constexpr = 256
    dtype: gl.constexpr = Q.dtype.element_ty

    pid = gl.program_id(0)
    split = gl.program_id(1)
    qi = pid // GROUPS
    g = pid % GROUPS
    qi64 = qi.to(gl.int64)

    q_l, q_r, k_l, k_r, k_pe, p_smem, m_smem, l_smem, ready, sync = seesaw_buffers(
        dtype, _ISSUERS)
    # free[k]: half k read by the group that reads it last (arrived once here, so that the
    # producer's first copies wait for nothing)
    bl: gl.constexpr = mbarrier.MBarrierLayout()
    free = (gl.allocate_shared_memory(gl.int64, [1], bl),
            gl.allocate_shared_memory(gl.int64, [1], bl),
            gl.allocate_shared_memory(gl.int64, [1], bl),
            gl.allocate_shared_memory(gl.int64, [1], bl))
    for k in gl.static_range(4):
        mbarrier.init(free[k], count=1)
        mbarrier.arrive(free[k])

    # q's 64 heads -> shared memory (heads past N: zeros); its rope columns into P1's buffer
    h_ld = g * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, _LC))
    q_row = Q + qi64 * stride_qq + h_ld.to(gl.int64) * stride_qh
    c_ld = gl.arange(0, 64, layout=gl.SliceLayout(0, _LC))
    for c in gl.static_range(DH // 64):
        x = gl.load(q_row[:, None] + (c * 64 + c_ld)[None, :], mask=(h_ld < N)[:, None],
                    other=0.0)
        q_l.index(0).slice(c * 64, 64, dim=1).store(x)
        x = gl.load(q_row[:, None] + (DH + c * 64 + c_ld)[None, :], mask=(h_ld < N)[:, None],
                    other=0.0)
        q_r.index(0).slice(c * 64, 64, dim=1).store(x)
    if HAS_PE:
        x = gl.load(q_row[:, None] + (2 * DH + c_ld)[None, :], mask=(h_ld < N)[:, None],
                    other=0.0)
        p_smem[1].store(x)

    n1, n2, tiles1, _, t_lo, t_hi, idx1, idx2 = runs(
        TOPK_LEN, TOPK_LEN2, IDX, IDX2, qi, split, topk, topk2, num_splits, stride_iq,
        stride_iq2, S, HAS_EXTRA, HAS_TOPK_LEN, HAS_TOPK_LEN2, SPLIT_TILES, SPLIT_CAP)
    lists = (tiles1, idx1, idx2, n1, n2, KV, KV2, n_rows, n_rows2, stride_row, stride_row2,
             page_size, page_size2)
    fence_async_shared()
    barrier()

    bufs = (q_l, q_r, k_l, k_r, k_pe, p_smem, m_smem, l_smem, ready, sync, free)
    outs = (O, LSE, MAXL, OP, LSEP, MAXP)
    strides = (stride_oq, stride_oh, stride_lb, stride_lt, stride_lh, stride_mq, stride_mh)
    # the argument tuples are written out in the call: a tuple built first would turn the
    # constexprs into run-time values in the worker partition (Triton 3.6)
    gl.warp_specialize([
        (_group0, (bufs, lists, outs, strides, qi, g, split, num_splits, t_lo, t_hi,
                   qk_scale, TOPK_LEN, TOPK_LEN2, topk, topk2, SINK, N, S, HAS_PE,
                   HAS_EXTRA, HAS_TOPK_LEN, HAS_TOPK_LEN2, HAS_SINK, CHECK_RANGE,
                   HAS_MAXL, SPLIT)),
        (_group1, (bufs, lists, outs, strides, qi, g, split, num_splits, t_lo, t_hi,
                   qk_scale, TOPK_LEN, TOPK_LEN2, topk, topk2, SINK, N, S, HAS_PE,
                   HAS_EXTRA, HAS_TOPK_LEN, HAS_TOPK_LEN2, HAS_SINK, CHECK_RANGE,
                   HAS_MAXL, SPLIT)),
        (_producer, (bufs, lists, t_lo, t_hi, HAS_PE, HAS_EXTRA)),
    ], [4, 4], [_GROUP1_REGS, _PRODUCER_REGS])
