"""Paged MLA decode for Hopper (sm_90) with a "seesaw" schedule of two warp groups (Gluon).

The kernel of ``mla.fast.sm90.decode`` splits every 64-key tile between its two warp groups
(the logits by keys, the output by columns), so the groups meet at every tile (shared P, the
cross-group max, CTA barriers) and a softmax never runs under a matrix product
(benchmarks/notes/decode.md). Here, as FlashMLA schedules its dense decode (docs/kernels.md), the
groups are two warp-specialized partitions that each own whole tiles:

- keys come in pairs of 64-key tiles, ``K0`` (stage 0) and ``K1`` (stage 1). Group 0 computes
  the logits of ``K0`` and group 1 those of ``K1``, each a 64 × 64 tile of its own.
- the output is split by columns: group 0 holds ``O[:, :256]``, group 1 ``O[:, 256:]`` (128
  float32 registers a thread). Each group multiplies its own probabilities from registers
  into its half (``P0 · V0[:, :256]``, ``P1 · V1[:, 256:]``) and the other group's from
  shared memory into its half.
- the running max is shared. Group 0 publishes ``m0 = max(m, rowmax S0)`` with ``P0`` (at
  ``m0``); group 1 adds ``P0 · V0`` into its half at once, under its own softmax, and publishes
  ``m1 = max(m0, rowmax S1)`` with ``P1``; both then rescale their halves to ``m1`` and add
  ``P1 · V1``: exactly the online softmax over the pair. Group 0's ``P0 · V0`` runs while group
  1 does its exponentials, group 1's products while group 0 computes the next pair's logits.
- each half of a stage (columns 0-255; 256-511 with the 64 rope columns) is refilled by TMA
  from the group that reads it last, as soon as its last product has completed, and a tile's
  logits start on its first half as soon as that has landed; the parent region loads q and
  issues the first pair. The groups meet through five mbarriers (``m0``
  and ``P0`` stored, ``m1`` stored, ``P1`` stored, ``P0``'s buffer read, the final row sums),
  never a CTA barrier.

Shared memory: q 64 KB (the 64 rope columns of q live in registers, as FlashMLA keeps them,
to make room for the second P), two stages of 72 KB, two P tiles of 8 KB.

Inputs, outputs and bad-input behaviour are those of ``mla.fast.sm90.decode.decode_kernel``
(same argument list; launched with ``num_warps=4``: the parent region and group 0 run in 4
warps, group 1 in 4 more). ``mla.fast.decode`` routes to it when the plan asks
(``DecodePlan.seesaw``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mla.fast.sm90.decode import page_row, q_rows, request_tiles, store_result, zero_tail
from mla.fast.sm90.softmax import barrier

__all__ = ["NUM_WARPS", "opaque_zero", "seesaw_buffers", "seesaw_kernel", "use_max"]

NUM_WARPS = 4  # the parent region and group 0; group 1 adds 4 warps
_GROUP1_REGS = gl.constexpr(256)  # registers a thread of group 1 may use (setmaxnreg)
# one 4-warp group's layouts: S (64 × 64 logits), its half of O (64 × 256), the register A
# operands of ``P · V`` and of the rope logits, and plain 2-D loads
_S = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                            instr_shape=[16, 64, 16]))
_O = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                            instr_shape=[16, 256, 16]))
_P_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_O.value, k_width=2))
_Q_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_S.value, k_width=2))
_LD = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                    warps_per_cta=[4, 1], order=[1, 0]))


@gluon.jit
def _load_left(kv_desc, row0, bar, k_left):
    """TMA of a tile's value columns 0-255 (four 128-byte boxes)."""
    mbarrier.expect(bar, k_left.shape[0] * k_left.shape[1] * 2)
    tma.async_copy_global_to_shared(kv_desc, [row0, 0], bar, k_left)


@gluon.jit
def _load_right(kv_desc, pe_desc, row0, bar, k_right, k_pe):
    """TMA of a tile's columns 256-511 and its 64 rope columns."""
    mbarrier.expect(bar, (k_right.shape[0] * k_right.shape[1]
                          + k_pe.shape[0] * k_pe.shape[1]) * 2)
    tma.async_copy_global_to_shared(kv_desc, [row0, k_right.shape[1]], bar, k_right)
    tma.async_copy_global_to_shared(pe_desc, [row0, 0], bar, k_pe)


@gluon.jit
def _logits(q_l, q_r, q_pe, k_l, k_r, k_pe, s_zero, qk_scale, start, end, full_end, limit,
            c_s, ready_l, ready_r, ph):
    """``q · Kᵀ`` of one 64-key tile in the log2 domain, ``-inf`` where masked; the products
    of the value columns 0-255 start as soon as they have landed, before the rest."""
    mbarrier.wait(ready_l, ph)
    s = warpgroup_mma(q_l, k_l.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(ready_r, ph)
    s = warpgroup_mma(q_r, k_r.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma(q_pe, k_pe.permute((1, 0)), s, is_async=True)
    s, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s, q_pe))
    qk = s * qk_scale
    if start + s_zero.shape[1] > full_end:
        kpos = start + c_s
        vis = (kpos[None, :] < end) & (kpos[None, :] <= limit[:, None])
        qk = gl.where(vis, qk, float("-inf"))
    return qk


@gluon.jit
def seesaw_buffers(dtype: gl.constexpr, READY_COUNT: gl.constexpr):
    """The seesaw kernels' shared memory and barriers, initialized (``READY_COUNT`` arrivals
    complete a ``ready`` barrier's phase): q's value columns in halves (``[1, 64, 256]``
    each), two stages of K in halves and their 64 rope columns, P0 and P1 (P1 first holds q's
    rope columns), the maxima and the final row sums, then ``ready`` (stage 0 left, stage 0
    right with the rope, stage 1 left, stage 1 right) and ``sync`` (group 0's max and P0
    stored, group 1's max, P1 stored, P0's buffer free (arrived once: free before the first
    pair), the final row sums (2 arrivals)). Shared memory: 229,376 B of 16-bit values."""
    BM: gl.constexpr = 64
    BN: gl.constexpr = 64
    DH: gl.constexpr = 256
    DR: gl.constexpr = 64
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                              rank=2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    q_l = gl.allocate_shared_memory(dtype, [1, BM, DH], smem)
    q_r = gl.allocate_shared_memory(dtype, [1, BM, DH], smem)
    k_l = gl.allocate_shared_memory(dtype, [2, BN, DH], smem)
    k_r = gl.allocate_shared_memory(dtype, [2, BN, DH], smem)
    k_pe = gl.allocate_shared_memory(dtype, [2, BN, DR], smem)
    # separate allocations, so that Triton's barrier analysis tells them apart
    p_smem = (gl.allocate_shared_memory(dtype, [BM, BN], smem),  # P0
              gl.allocate_shared_memory(dtype, [BM, BN], smem))  # P1 (first: q's rope)
    m_smem = (gl.allocate_shared_memory(gl.float32, [BM], flat),  # max after group 0
              gl.allocate_shared_memory(gl.float32, [BM], flat))  # max after group 1
    l_smem = (gl.allocate_shared_memory(gl.float32, [BM], flat),  # final row sums
              gl.allocate_shared_memory(gl.float32, [BM], flat))
    bl: gl.constexpr = mbarrier.MBarrierLayout()
    # ready: stage 0 left, stage 0 right (+ rope), stage 1 left, stage 1 right (+ rope)
    ready = (gl.allocate_shared_memory(gl.int64, [1], bl),
             gl.allocate_shared_memory(gl.int64, [1], bl),
             gl.allocate_shared_memory(gl.int64, [1], bl),
             gl.allocate_shared_memory(gl.int64, [1], bl))
    # sync: group 0's max and P0 stored, group 1's max, P1 stored, P0's buffer free (arrived
    # once here: free before the first pair), the final row sums (2 arrivals)
    sync = (gl.allocate_shared_memory(gl.int64, [1], bl),
            gl.allocate_shared_memory(gl.int64, [1], bl),
            gl.allocate_shared_memory(gl.int64, [1], bl),
            gl.allocate_shared_memory(gl.int64, [1], bl),
            gl.allocate_shared_memory(gl.int64, [1], bl))
    for k in gl.static_range(4):
        mbarrier.init(ready[k], count=READY_COUNT)
    for k in gl.static_range(4):
        mbarrier.init(sync[k], count=1)
    mbarrier.init(sync[4], count=2)
    mbarrier.arrive(sync[3])
    return q_l, q_r, k_l, k_r, k_pe, p_smem, m_smem, l_smem, ready, sync


@gluon.jit
def opaque_zero(x):
    """0, computed by an instruction the compiler may not move out of the loop: the shared
    memory addresses indexed with it (the wgmma descriptors) are then rebuilt in every
    iteration instead of being hoisted, 72 loop-invariant 64-bit values that spill."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def use_max(m):
    """The shift of the exponentials: a row that has seen no key keeps ``m = -inf`` and is
    shifted by 0, so that ``exp2`` gives 0 rather than NaN."""
    return gl.where(m == float("-inf"), 0.0, m)


@gluon.jit
def _g0_step(i0, ph, acc, m_i, l_i, bad, q_pe, bufs, kv_desc, bt_row, t_hi, L, end, full_end,
             limit, num_blocks, qk_scale, PAGE_SIZE: gl.constexpr, CAUSAL: gl.constexpr,
             PAIR: gl.constexpr):
    """Group 0's share of the pair starting at tile ``i0`` (``PAIR``: tile ``i0 + 1`` too)."""
    q_l, q_r, k_l, k_r, k_pe, p_smem, m_smem, l_smem, ready, sync = bufs
    s_layout: gl.constexpr = _S
    o_layout: gl.constexpr = _O
    p_op: gl.constexpr = _P_OP
    ld: gl.constexpr = _LD
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    BM: gl.constexpr = 64
    BN: gl.constexpr = 64
    dtype: gl.constexpr = q_l.dtype
    # the pages of the next pair, loaded now so that the refills do not wait for them
    row_a, out_a = page_row(bt_row, i0 + 2, t_hi, num_blocks, PAGE_SIZE, BN)
    row_b, out_b = page_row(bt_row, i0 + 3, t_hi, num_blocks, PAGE_SIZE, BN)
    start = i0 * BN
    c_s = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([BM, BN], gl.float32, layout=s_layout)
    z = opaque_zero(i0)
    qk = _logits(q_l.index(z), q_r.index(z), q_pe, k_l.index(z), k_r.index(z), k_pe.index(z),
                 s_zero, qk_scale, start, end, full_end, limit, c_s, ready[0], ready[1], ph)
    m0 = gl.maximum(m_i, gl.max(qk, axis=1))
    m0_use = use_max(m0)
    alpha0 = gl.exp2(m_i - m0_use)
    p = gl.exp2(qk - m0_use[:, None])
    # the row sum of the float32 P: the sum of its bf16 rounding would be off by up to 1e-3
    # in lse, the rounding of the largest few terms not averaging out (H200, 2026-11-30)
    l_i = l_i * alpha0 + gl.sum(p, axis=1)
    p = p.to(dtype)
    # hand m0 and P0 (at m0) over: group 1 takes P0 into its half before its own softmax
    mbarrier.wait(sync[3], ph)  # group 1's previous P0 · V0 has read the buffer
    p_smem[0].store(p)
    m_smem[0].store(m0)
    fence_async_shared()
    barrier()  # all of P0 and m0 is written before group 1 is told
    mbarrier.arrive(sync[0])
    acc = acc * gl.convert_layout(alpha0, row_o)[:, None]
    if start + BN > L:
        zero_tail(k_l.index(0), start, L, ld)
    p_reg = gl.convert_layout(p, p_op)
    acc = warpgroup_mma(p_reg, k_l.index(0), acc, is_async=True)
    acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_reg))
    if i0 + 2 < t_hi:  # stage 0's columns 0-255 are free: the tile after next
        bad = bad | out_a
        _load_left(kv_desc, row_a, ready[0], k_l.index(0))

    # group 1's max: the pair's
    mbarrier.wait(sync[1], ph)
    m1 = m_smem[1].load(row_s)
    alpha1 = gl.exp2(m0 - use_max(m1))
    acc = acc * gl.convert_layout(alpha1, row_o)[:, None]
    l_i = l_i * alpha1
    mbarrier.wait(sync[2], ph)  # P1 stored (or no second tile)
    if PAIR:
        i1 = i0 + 1
        if i1 * BN + BN > L:
            zero_tail(k_l.index(1), i1 * BN, L, ld)
        acc = warpgroup_mma(p_smem[1], k_l.index(1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if i1 + 2 < t_hi:
            bad = bad | out_b
            _load_left(kv_desc, row_b, ready[2], k_l.index(1))
    return acc, m1, l_i, bad


@gluon.jit
def _g1_step(i0, ph, acc, m_i, l_i, bad, q_pe, bufs, kv_desc, pe_desc, bt_row, t_hi, L, end,
             full_end, limit, num_blocks, qk_scale, PAGE_SIZE: gl.constexpr,
             CAUSAL: gl.constexpr, PAIR: gl.constexpr):
    """Group 1's share of the pair starting at tile ``i0`` (``PAIR``: tile ``i0 + 1`` exists
    and is group 1's; without it group 1 only takes ``P0`` into its half)."""
    q_l, q_r, k_l, k_r, k_pe, p_smem, m_smem, l_smem, ready, sync = bufs
    s_layout: gl.constexpr = _S
    o_layout: gl.constexpr = _O
    p_op: gl.constexpr = _P_OP
    ld: gl.constexpr = _LD
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    BM: gl.constexpr = 64
    BN: gl.constexpr = 64
    dtype: gl.constexpr = q_l.dtype
    i1 = i0 + 1
    row_a, out_a = page_row(bt_row, i0 + 2, t_hi, num_blocks, PAGE_SIZE, BN)
    row_b, out_b = page_row(bt_row, i1 + 2, t_hi, num_blocks, PAGE_SIZE, BN)
    if PAIR:
        c_s = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([BM, BN], gl.float32, layout=s_layout)
        z = opaque_zero(i0)
        qk = _logits(q_l.index(z), q_r.index(z), q_pe, k_l.index(z + 1), k_r.index(z + 1),
                     k_pe.index(z + 1), s_zero, qk_scale, i1 * BN, end, full_end, limit, c_s,
                     ready[2], ready[3], ph)
    mbarrier.wait(sync[0], ph)  # group 0's max and P0
    m0 = m_smem[0].load(row_s)
    alpha0 = gl.exp2(m_i - use_max(m0))
    # P0 · V0 into this half at m0, under this group's softmax
    acc = acc * gl.convert_layout(alpha0, row_o)[:, None]
    if i0 * BN + BN > L:
        zero_tail(k_r.index(0), i0 * BN, L, ld)
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
    if i0 + 2 < t_hi:  # stage 0's columns 256-575 are free
        bad = bad | out_a
        _load_right(kv_desc, pe_desc, row_a, ready[1], k_r.index(0), k_pe.index(0))
    acc = acc * gl.convert_layout(alpha1, row_o)[:, None]
    if PAIR:
        if i1 * BN + BN > L:
            zero_tail(k_r.index(1), i1 * BN, L, ld)
        p_reg = gl.convert_layout(p, p_op)
        acc = warpgroup_mma(p_reg, k_r.index(1), acc, is_async=True)
        acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_reg))
        if i1 + 2 < t_hi:  # stage 1's columns 256-575 are free
            bad = bad | out_b
            _load_right(kv_desc, pe_desc, row_b, ready[3], k_r.index(1), k_pe.index(1))
    return acc, m1, l_i, bad


@gluon.jit
def _group(bufs, kv_desc, pe_desc, bt_row, bad, g, b, split, t_lo, t_hi, L, end, full_end,
           num_blocks, qk_scale, num_splits, O, LSE, OP, LSEP, SINK,
           stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
           N: gl.constexpr, S_Q: gl.constexpr, PAGE_SIZE: gl.constexpr,
           CAUSAL: gl.constexpr, SPLIT: gl.constexpr, HAS_SINK: gl.constexpr,
           GROUP: gl.constexpr):
    """One warp group's whole program: the pairs of tiles, then its half of the epilogue.
    Group 0 takes the even tiles' logits, output columns 0-255 and the refills of the value
    columns 0-255; group 1 the odd tiles, columns 256-511 and the rope columns."""
    q_l, q_r, k_l, k_r, k_pe, p_smem, m_smem, l_smem, ready, sync = bufs
    s_layout: gl.constexpr = _S
    o_layout: gl.constexpr = _O
    q_op: gl.constexpr = _Q_OP
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    BM: gl.constexpr = 64
    DH: gl.constexpr = 256
    # q's rope columns: the parent left them in P1's buffer, which group 1 overwrites only
    # after group 0's first max (sync 0), published after group 0's own load
    q_pe = p_smem[1].load(q_op)
    r_s = g * BM + gl.arange(0, BM, layout=row_s)
    # the last key each query row sees
    if CAUSAL:
        limit = L - S_Q + r_s // N
    else:
        limit = gl.zeros_like(r_s) + L - 1
    acc = gl.zeros([BM, DH], gl.float32, layout=o_layout)
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BM], gl.float32, layout=row_s)
    n_here = gl.maximum(t_hi - t_lo, 0)  # a split past the request's last tile has none
    n_pairs = n_here // 2
    for j in range(n_pairs):
        i0 = t_lo + 2 * j
        if GROUP == 0:
            acc, m_i, l_i, bad = _g0_step(i0, j & 1, acc, m_i, l_i, bad, q_pe, bufs, kv_desc,
                                          bt_row, t_hi, L, end, full_end, limit, num_blocks,
                                          qk_scale, PAGE_SIZE, CAUSAL, True)
        else:
            acc, m_i, l_i, bad = _g1_step(i0, j & 1, acc, m_i, l_i, bad, q_pe, bufs, kv_desc,
                                          pe_desc, bt_row, t_hi, L, end, full_end, limit,
                                          num_blocks, qk_scale, PAGE_SIZE, CAUSAL, True)
    if n_here % 2 == 1:  # a last tile alone
        i0 = t_lo + 2 * n_pairs
        if GROUP == 0:
            acc, m_i, l_i, bad = _g0_step(i0, n_pairs & 1, acc, m_i, l_i, bad, q_pe, bufs,
                                          kv_desc, bt_row, t_hi, L, end, full_end, limit,
                                          num_blocks, qk_scale, PAGE_SIZE, CAUSAL, False)
        else:
            acc, m_i, l_i, bad = _g1_step(i0, n_pairs & 1, acc, m_i, l_i, bad, q_pe, bufs,
                                          kv_desc, pe_desc, bt_row, t_hi, L, end, full_end,
                                          limit, num_blocks, qk_scale, PAGE_SIZE, CAUSAL,
                                          False)

    # the row sums of both groups
    l_smem[GROUP].store(l_i)
    barrier()
    mbarrier.arrive(sync[4])
    mbarrier.wait(sync[4], 0)
    l_i = l_i + l_smem[1 - GROUP].load(row_s)
    store_result(acc, m_i, l_i, bad, g, b, split, num_splits, O, LSE, OP, LSEP, SINK,
                 stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
                 GROUP * DH, GROUP == 0, 2 * DH, N, S_Q, SPLIT, HAS_SINK, s_layout, o_layout)


@gluon.jit
def _group0(bufs, kv_desc, pe_desc, bt_row, bad, g, b, split, t_lo, t_hi, L, end, full_end,
            num_blocks, qk_scale, num_splits, O, LSE, OP, LSEP, SINK,
            stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
            N: gl.constexpr, S_Q: gl.constexpr, PAGE_SIZE: gl.constexpr,
            CAUSAL: gl.constexpr, SPLIT: gl.constexpr, HAS_SINK: gl.constexpr):
    _group(bufs, kv_desc, pe_desc, bt_row, bad, g, b, split, t_lo, t_hi, L, end, full_end,
           num_blocks, qk_scale, num_splits, O, LSE, OP, LSEP, SINK,
           stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
           N, S_Q, PAGE_SIZE, CAUSAL, SPLIT, HAS_SINK, 0)


@gluon.jit
def _group1(bufs, kv_desc, pe_desc, bt_row, bad, g, b, split, t_lo, t_hi, L, end, full_end,
            num_blocks, qk_scale, num_splits, O, LSE, OP, LSEP, SINK,
            stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
            N: gl.constexpr, S_Q: gl.constexpr, PAGE_SIZE: gl.constexpr,
            CAUSAL: gl.constexpr, SPLIT: gl.constexpr, HAS_SINK: gl.constexpr):
    _group(bufs, kv_desc, pe_desc, bt_row, bad, g, b, split, t_lo, t_hi, L, end, full_end,
           num_blocks, qk_scale, num_splits, O, LSE, OP, LSEP, SINK,
           stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
           N, S_Q, PAGE_SIZE, CAUSAL, SPLIT, HAS_SINK, 1)


@gluon.jit
def seesaw_kernel(
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
    """Grid ``(head groups, splits, B)``, ``num_warps=4`` (+4 for group 1). Bad lengths and
    table entries give NaN for the request, and ``SPLIT_TILES``/``SPLIT_CAP`` (fixed-length
    splits) mean what they mean, as in ``mla.fast.sm90.decode.decode_kernel``."""
    BM: gl.constexpr = 64
    BN: gl.constexpr = 64
    DV: gl.constexpr = 512
    DH: gl.constexpr = 256
    DR: gl.constexpr = 64
    CH: gl.constexpr = 64  # columns per 128-byte swizzle box
    dtype: gl.constexpr = Q.dtype.element_ty

    g = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)

    ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                        warps_per_cta=[4, 1], order=[1, 0])
    col_ld: gl.constexpr = gl.SliceLayout(0, ld)
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                              rank=2)

    q_l, q_r, k_l, k_r, k_pe, p_smem, m_smem, l_smem, ready, sync = seesaw_buffers(dtype, 1)

    # q rows -> shared memory
    q_row, ok_ld = q_rows(Q, b, g, stride_qb, stride_qt, stride_qh, N, S_Q, BM, ld)
    c_ld = gl.arange(0, CH, layout=col_ld)
    for c in gl.static_range(DH // CH):
        x = gl.load(q_row[:, None] + (c * CH + c_ld)[None, :], mask=ok_ld[:, None], other=0.0)
        q_l.index(0).slice(c * CH, CH, dim=1).store(x)
        x = gl.load(q_row[:, None] + (DH + c * CH + c_ld)[None, :], mask=ok_ld[:, None],
                    other=0.0)
        q_r.index(0).slice(c * CH, CH, dim=1).store(x)
    x = gl.load(q_row[:, None] + (DV + c_ld)[None, :], mask=ok_ld[:, None], other=0.0)
    p_smem[1].store(x)  # each group takes q's rope columns into registers from here

    L, bad, t_lo, t_hi, end, full_end = request_tiles(SEQLENS, b, split, num_splits,
                                                      max_blocks, PAGE_SIZE, BN, S_Q, CAUSAL,
                                                      SPLIT_TILES, SPLIT_CAP)

    kv_desc = tma.make_tensor_descriptor(KV, shape=[kv_rows, DV], strides=[stride_kvr, 1],
                                         block_shape=[BN, DH], layout=smem)
    pe_desc = tma.make_tensor_descriptor(KV + DV, shape=[kv_rows, DR], strides=[stride_kvr, 1],
                                         block_shape=[BN, DR], layout=smem)
    bt_row = BT + b.to(gl.int64) * stride_btb

    fence_async_shared()
    barrier()

    # the first pair
    row0, out0 = page_row(bt_row, t_lo, t_hi, num_blocks, PAGE_SIZE, BN)
    row1, out1 = page_row(bt_row, t_lo + 1, t_hi, num_blocks, PAGE_SIZE, BN)
    if t_lo < t_hi:
        bad = bad | out0
        _load_left(kv_desc, row0, ready[0], k_l.index(0))
        _load_right(kv_desc, pe_desc, row0, ready[1], k_r.index(0), k_pe.index(0))
    if t_lo + 1 < t_hi:
        bad = bad | out1
        _load_left(kv_desc, row1, ready[2], k_l.index(1))
        _load_right(kv_desc, pe_desc, row1, ready[3], k_r.index(1), k_pe.index(1))

    bufs = (q_l, q_r, k_l, k_r, k_pe, p_smem, m_smem, l_smem, ready, sync)
    # the argument tuples are written out in the call: a tuple built first would turn the
    # constexprs into run-time values in the worker partition (Triton 3.6)
    gl.warp_specialize([
        (_group0, (bufs, kv_desc, pe_desc, bt_row, bad, g, b, split, t_lo, t_hi, L, end,
                   full_end, num_blocks, qk_scale, num_splits, O, LSE, OP, LSEP, SINK,
                   stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
                   N, S_Q, PAGE_SIZE, CAUSAL, SPLIT, HAS_SINK)),
        (_group1, (bufs, kv_desc, pe_desc, bt_row, bad, g, b, split, t_lo, t_hi, L, end,
                   full_end, num_blocks, qk_scale, num_splits, O, LSE, OP, LSEP, SINK,
                   stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
                   N, S_Q, PAGE_SIZE, CAUSAL, SPLIT, HAS_SINK)),
    ], [4], [_GROUP1_REGS])
