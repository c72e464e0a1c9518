"""The indexer's ragged prefill logits (``fp8_mqa_logits``) for Hopper (sm_90) in Gluon.

Same grid as the Triton kernel of ``mla.fast.indexer.logits`` (a program: two consecutive
queries and up to ``TILES`` tiles of 64 keys), with what Triton 3.6 does
not let that kernel control:

- the two queries' 64 heads of 128 e4m3 codes go to shared memory once, ``[128, 128]``, the
  MMA's B operands (K-major, as FP8 ``wgmma`` requires of both operands);
- each tile of keys ``[64, 128]`` arrives by one TMA copy into a ring of ``STAGES`` buffers;
  the buffer a tile was read from is refilled with the tile ``STAGES`` later as soon as the
  tile's ``wgmma`` has completed, before its epilogue, so the copies run under the epilogues;
- a program takes two queries; per tile, ``S = K · qᵀ`` for both is one ``wgmma m64n128k32``
  chain over the 128 codes, into float32 registers, keys as M and the two queries' heads
  interleaved as N (column ``2h + query``), so that the sum over heads is a sum along N
  within a thread and across the four lanes that share a row, and ``gl.split`` parts the
  queries (a column pair sits in one thread's register pair: no data moves). Each FP8
  ``wgmma`` reads its keys (2 KB) and its ``N x 32`` codes from shared memory: at N = 64,
  4 KB for 262K FLOPs, 128 bytes a clock at the tensor cores' rate, all of the shared
  memory's bandwidth; at N = 128, 96 bytes a clock. The epilogue (ReLU, the weights, the sum
  over heads, the key's scale, the masks, the stores) follows the chain;
- one warp group a program and few registers a thread (111 on sm_90), so several programs
  share an SM and one's epilogues run under another's ``wgmma``. Two chains of N = 64 a tile,
  the first query's epilogue under the second's chain, took 1-6% longer on an H100
  (``benchmarks/results/indexer/logits_pair_mma_2026-12-07.json``); two accumulators of
  N = 128, the next tile's chain under this one's epilogue, 179 registers and 30-60% longer.

``mla.fast.indexer.fp8_mqa_logits`` launches it on sm_90 for 64 heads of 128 codes whose key
codes a TMA descriptor can address (rows 16-byte aligned); the Triton kernel takes the rest.
"""

from __future__ import annotations

import torch
import triton.language as tl
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
from mla.fast.sm90.softmax import barrier

__all__ = ["BLOCK_N", "HEADS", "NUM_WARPS", "PROGRAMS_PER_SM", "QUERIES", "STAGES",
           "ragged_logits_kernel", "supported"]

HEADS = 64  # the heads a query has here (DeepSeek-V3.2's and V4's indexer)
NUM_WARPS = 4  # one warp group a program
QUERIES = 2  # queries a program
BLOCK_N = 64  # keys a tile
STAGES = 4  # tiles of keys in flight (shared memory: 16 KB of queries + 8 KB a stage)
PROGRAMS_PER_SM = 4  # what the key split aims at: 111 registers, 4 programs fit a SM


def supported(q: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether this kernel takes the call: a Hopper GPU, 64 heads of 128 codes with the last
    dim contiguous, and key codes a TMA descriptor can address (16-byte aligned rows)."""
    if q.device.type != "cuda" or capability(q.device) != (9, 0):
        return False
    _, H, D = q.shape
    return (H == HEADS and D == 128 and q.stride(-1) == 1 and codes.stride(-1) == 1
            and codes.stride(0) % 16 == 0 and codes.data_ptr() % 16 == 0
            and codes.shape[0] < 2**30)


@gluon.jit
def _seen_written(keys, lo, vis, span, N, ok, COMPRESSED: gl.constexpr):
    """``[BN]``: where a query sees key ``keys`` and where the key has a column in its row
    (``mla.fast.indexer.logits._seen_written``'s convention for one query: compressed, ``vis``
    is the count seen and the key's place after ``lo`` is one unsigned compare)."""
    if COMPRESSED:
        at = (keys.to(gl.int32) - lo).to(gl.uint32)
        seen = at < vis
        written = at < span
    else:
        seen = (keys >= lo) & (keys < vis)
        written = (keys < N) & ok
    return seen, written


@gluon.jit
def _pair_out(acc, w2, k_scale, keys, out0, out1, lo0, vis0, lo1, vis1, span, N, ok0, ok1,
              row_layout: gl.constexpr, COMPRESSED: gl.constexpr):
    """Both queries' logits of a tile from their dots ``acc [64 keys, 128]`` (column ``2h +
    query``): ReLU (NaN kept), the weights ``w2`` (interleaved likewise), the sum over heads,
    the keys' scales; ``-inf`` where unseen; stored where written. Returns the products,
    whose registers the next tile's ``wgmma`` takes."""
    p = gl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL) * w2[None, :]
    p0, p1 = gl.split(gl.reshape(p, [acc.shape[0], acc.shape[1] // 2, 2]))
    v0 = gl.convert_layout(gl.sum(p0, axis=1), row_layout) * k_scale
    v1 = gl.convert_layout(gl.sum(p1, axis=1), row_layout) * k_scale
    seen, written = _seen_written(keys, lo0, vis0, span, N, ok0, COMPRESSED)
    gl.store(out0 + keys, gl.where(seen, v0, float("-inf")), mask=written)
    seen, written = _seen_written(keys, lo1, vis1, span, N, ok1, COMPRESSED)
    gl.store(out1 + keys, gl.where(seen, v1, float("-inf")), mask=written)
    return p


@gluon.jit
def _query_range(KS, KE, t, ok, COMPRESSED: gl.constexpr):
    """Query ``t``'s keys ``[lo, hi)`` (compressed, int32; a row not written starts 2^30 keys
    before 0, as in ``mla.fast.indexer.logits``)."""
    if COMPRESSED:
        lo = gl.load(KS + t, mask=ok, other=-(1 << 30))
        hi = gl.load(KE + t, mask=ok, other=-(1 << 30))
    else:
        lo = gl.load(KS + t, mask=ok, other=0).to(gl.int64)
        hi = gl.load(KE + t, mask=ok, other=0).to(gl.int64)
    return lo, hi


# M not specialized, as in the Triton kernel: Triton makes an integer argument equal to 1 a
# constant, which has no .to (rows compressed to one column failed to compile)
@gluon.jit(do_not_specialize=["M"])
def ragged_logits_kernel(
    Q, W, CODES, K_SCALE, KS, KE, OUT,
    S, N, M, chunk, splits, TILES,
    s_q_t, s_q_h, s_w_t, s_c_n,
    STAGES: gl.constexpr, COMPRESSED: gl.constexpr,
):
    """Programs ``(query pair, key chunk)`` as ``mla.fast.indexer.logits._ragged_kernel``:
    ``Q [S, 64, 128]`` e4m3, ``W [S, 64]`` float32, ``CODES [N, 128]`` e4m3 rows ``s_c_n``
    bytes apart (a multiple of 16), ``K_SCALE [N]`` float32, ``OUT [S, M]`` float32;
    compressed (``M`` columns from each query's start), the second index is a query slot of
    the pair and one of ``splits`` chunks of its start's keys: slot 1 runs only where the
    second query starts elsewhere than the first. ``TILES`` (the tiles a program, ``chunk /
    64``) is a run-time argument, so that every split compiles once."""
    H: gl.constexpr = 64
    D: gl.constexpr = 128
    BN: gl.constexpr = 64
    TILE_BYTES: gl.constexpr = BN * D

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 2 * H, 32])
    ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8],
                                        warps_per_cta=[4, 1], order=[1, 0])
    fill: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                          warps_per_cta=[4], order=[0])
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8,
                                              rank=2)
    fp8: gl.constexpr = CODES.dtype.element_ty

    t0 = gl.program_id(0).to(gl.int64) * 2
    ok0 = t0 < S
    ok1 = t0 + 1 < S
    lo0, hi0 = _query_range(KS, KE, t0, ok0, COMPRESSED)
    lo1, hi1 = _query_range(KS, KE, t0 + 1, ok1, COMPRESSED)
    if COMPRESSED:
        slot = gl.program_id(1) // splits
        if (slot == 1) & ((not ok1) | (lo1 == lo0)):
            return
        lead = gl.where(slot == 0, lo0, lo1)
        ok0 = ok0 & (lo0 == lead)
        ok1 = ok1 & (lo1 == lead)
        lo0 = gl.where(ok0, lo0, -(1 << 30))
        hi0 = gl.where(ok0, hi0, -(1 << 30))
        lo1 = gl.where(ok1, lo1, -(1 << 30))
        hi1 = gl.where(ok1, hi1, -(1 << 30))
        col0 = lead.to(gl.int64) + (gl.program_id(1) % splits).to(gl.int64) * chunk
        span = M.to(gl.uint32)
        vis0 = gl.maximum(hi0 - lo0, 0).to(gl.uint32)
        vis1 = gl.maximum(hi1 - lo1, 0).to(gl.uint32)
        out0 = OUT + t0 * M - lo0
        out1 = OUT + (t0 + 1) * M - lo1
    else:
        col0 = gl.program_id(1).to(gl.int64) * chunk
        span = hi0  # (unused)
        vis0 = hi0
        vis1 = hi1
        out0 = OUT + t0 * M
        out1 = OUT + (t0 + 1) * M
    lo_any = gl.minimum(gl.where(ok0, lo0, N), gl.where(ok1, lo1, N))
    hi_any = gl.maximum(gl.where(ok0, hi0, 0), gl.where(ok1, hi1, 0))
    first = gl.minimum(gl.maximum(lo_any - col0, 0) // BN, TILES).to(gl.int32)
    last = gl.maximum(gl.minimum(gl.cdiv(gl.maximum(hi_any - col0, 0), BN), TILES),
                      first).to(gl.int32)

    if last > first:
        q_smem = gl.allocate_shared_memory(fp8, [2 * H, D], smem)
        k_buf = gl.allocate_shared_memory(fp8, [STAGES, BN, D], smem)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
        k_desc = tma.make_tensor_descriptor(CODES, shape=[N, D], strides=[s_c_n, 1],
                                            block_shape=[BN, D], layout=smem)
        # both queries' heads -> shared memory, row r of the B operand query r % 2's head
        # r // 2 (zeros past S); the weights interleaved likewise
        r = gl.arange(0, 2 * H, layout=gl.SliceLayout(1, ld))
        t = t0 + r % 2
        d = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        x = gl.load(Q + t[:, None] * s_q_t + (r // 2)[:, None] * s_q_h + d[None, :],
                    mask=(t < S)[:, None], other=0.0)
        q_smem.store(x)
        c = gl.arange(0, 2 * H, layout=gl.SliceLayout(0, mma))
        w2 = gl.load(W + (t0 + c % 2) * s_w_t + c // 2,
                     mask=((c % 2 == 0) & ok0) | ((c % 2 == 1) & ok1), other=0.0)
        fence_async_shared()
        barrier()
        for j in gl.static_range(STAGES):
            if first + j < last:
                mbarrier.expect(ready.index(j), TILE_BYTES)
                tma.async_copy_global_to_shared(k_desc, [(col0 + (first + j) * BN).to(gl.int32),
                                                         0], ready.index(j), k_buf.index(j))
        qt = q_smem.permute((1, 0))
        row_layout: gl.constexpr = gl.SliceLayout(1, mma)
        rows = gl.arange(0, BN, layout=row_layout)
        p = gl.zeros([BN, 2 * H], gl.float32, layout=mma)
        for i in range(first, last):
            it = i - first
            s = it % STAGES
            start = col0 + i * BN
            keys = start + rows
            k_scale = gl.load(K_SCALE + keys, mask=keys < N, other=0.0)
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            k_s = k_buf.index(s)
            # use_acc=False: the registers passed in (the last tile's products, not a tensor
            # of zeros that would stay live) are only overwritten
            a = warpgroup_mma(k_s, qt, p, use_acc=False, is_async=True)
            a = warpgroup_mma_wait(num_outstanding=0, deps=(a,))
            barrier()  # every warp's share of the dot has read buffer s
            if i + STAGES < last:
                mbarrier.expect(ready.index(s), TILE_BYTES)
                tma.async_copy_global_to_shared(k_desc, [(start + STAGES * BN).to(gl.int32), 0],
                                                ready.index(s), k_s)
            p = _pair_out(a, w2, k_scale, keys, out0, out1, lo0, vis0, lo1, vis1, span, N,
                          ok0, ok1, row_layout, COMPRESSED)
        for j in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(j))
    for i in range(0, TILES):
        if (i < first) | (i >= last):
            keys = col0 + i * BN + gl.arange(0, BN, layout=fill)
            minus = gl.full([BN], float("-inf"), gl.float32, layout=fill)
            _seen, written = _seen_written(keys, lo0, vis0, span, N, ok0, COMPRESSED)
            gl.store(out0 + keys, minus, mask=written)
            _seen, written = _seen_written(keys, lo1, vis1, span, N, ok1, COMPRESSED)
            gl.store(out1 + keys, minus, mask=written)
