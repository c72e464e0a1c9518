"""Sparse top-k MLA over rows in q's dtype (bf16/fp16) for Hopper (sm_90) in Gluon,
warp-specialized: a producer warp group gathers the rows by ``cp.async`` while two consumer
warp groups run the dots (``mla.fast.sm90.sparse_ws_ds``'s arrangement, without the
dequantization). DeepSeek-V3.2's prefill and bf16 decode (rows of 576, V the first 512
columns) and DeepSeek-V4's rows of 512 (K = V, no rope dot).

The coupled kernel of ``mla.fast.sm90.sparse`` issues a tile's gathers from the same 8 warps
that run its dots, between the wait for the tile's copies and the dots (1.44-1.55x FlashMLA's
time on the prefill and bf16 decode shapes, benchmarks/notes/sparse.md). Here:

- the consumers (``sparse_ws_ds.consumer``, the program's 8 warps): q's 64 heads by ``cp.async``
  (rows of 576: 512 into ``q_nope``, the 64 rope values into ``q_pe``), then per tile: wait for
  ``ready[s]``, a proxy fence (the rows came by ``cp.async``, the generic proxy; ``wgmma`` reads
  through the async one), ``S = q_nope · k_nopeᵀ (+ q_pe · k_peᵀ)`` split by keys (each group 64
  × 32), the softmax statistics across both groups, ``P`` through shared memory, ``O += P · V``
  split by columns (``softmax_pv``), a CTA barrier of the 8 warps, ``free[s]``; out goes through
  q's buffer in 16-byte stores;
- the producer (4 more warps, ``setmaxnreg`` to ``_PRODUCER_REGS``): per tile, the entries
  loaded a tile ahead, it waits for ``free[s]``, issues the 64 rows' 16-byte ``cp.async``
  copies (the whole row: 576 or 512 columns, 36 or 32 copies a thread; an entry ``-1``, out
  of range or past the length is a masked copy, zeros) straight into K buffer s, and ends
  with ``cp.async.mbarrier.arrive.noinc`` on ``ready[s]`` (initialized to the producer's 128
  threads): each thread's arrival fires once its copies have landed, so the producer never
  waits for its copies and goes on to the next buffer as soon as it is free. With two
  buffers the copies of tile i+1 are in flight while the consumers run tile i.
- Shared memory: q 72 KB + K 2 × 72 KB + P 8 KB = 229,376 B (+ 32 B of barriers) of the
  232,448 for rows of 576; 64 + 128 + 8 KB = 204,800 B for rows of 512.

Semantics are the coupled kernel's for rows in q's dtype: prefill (``max_logits``, an index
outside ``[0, s_kv)`` is no key, ``topk_length``, sinks) and decode over the paged cache (one
or two scopes, ``topk_length``, sinks, splits, the fixed-length ``SPLIT_TILES`` splits, the
NaN rules: a length outside ``[0, topk]``, or with ``CHECK_RANGE`` an entry outside ``[-1,
rows)``, makes the query NaN). ``mla.fast.sparse`` launches it for 64-head plans over rows in
q's dtype that name it (``SparsePlan.bf16_kernel = "warp_specialized"``, the default since
2026-12-06: checked on an H100 in ``mla.check``'s 309 cases, then timed there at B=64 N=128
top-k 2048 bf16 decode in 97.5 us against the coupled kernel's 118.6, and at sparse prefill
s_q 4096 s_kv 32K N=128 top-k 2048 in 5.54 ms against 6.17, CUDA graphs,
``benchmarks/results/sparse/sparse_sweep_2026-12-06.md``), and for plans naming the seesaw
kernel over two scopes (``mla.fast.sm90.sparse_seesaw`` takes one; it is the prefill's
default).

Compiled for sm_90 with Triton 3.7.1's ptxas (``benchmarks.sm90_compile``,
``tests/test_sm90_compile.py``): 229,924 B of shared memory for rows of
576 and 205,348 B for rows of 512 (the buffers above, the barriers and the
warp-specialization state); 168 registers a thread at launch, then ``setmaxnreg`` 224 for the
consumers and 56 for the producer; no stack and no local memory in any variant compiled
(prefill, split prefill with lengths and a sink, rows of 512, decode with the range check, a
second scope, fp16, fixed-length splits); ``wgmma m64n32k16`` x36 (x32 for rows of 512) and
``m64n256k16`` x4; only 16-byte ``cp.async``; one ``cp.async.mbarrier.arrive.noinc``
(benchmarks/notes/sparse.md, 2026-12-06, "a warp-specialized kernel for rows in q's dtype").
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
)

from mla.fast.sm90.softmax import barrier
from mla.fast.sm90.sparse import _source, runs
from mla.fast.sm90.sparse_ws_ds import consumer

__all__ = ["plain_ws_kernel"]

# a producer thread's registers (setmaxnreg; the consumers keep (65536 - 128 · this) / 256)
_PRODUCER_REGS = gl.constexpr(56)
_PRODUCER_THREADS = gl.constexpr(128)  # ready[s]'s arrivals: one per producer thread


@gluon.jit
def plain_ws_kernel(
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
    """Grid ``(queries · GROUPS, splits)``, 8 warps (and the producer's 4); the arguments of
    ``mla.fast.sm90.sparse.sparse_kernel`` over rows in q's dtype (``KV``, ``KV2``: rows
    ``stride_row`` elements apart; ``page_size`` unused). ``HAS_PE``: rows of 576 (the last 64
    columns the rope part, V the first 512); else rows of 512, V the whole row."""
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
    k_nope = gl.allocate_shared_memory(dtype, [2, BN, DV], smem)
    if HAS_PE:
        q_pe = gl.allocate_shared_memory(dtype, [BM, DR], smem)
        k_pe = gl.allocate_shared_memory(dtype, [2, BN, DR], smem)
    else:  # rows of 512: no rope part (unused)
        q_pe = q_nope
        k_pe = k_nope
    p_smem = gl.allocate_shared_memory(dtype, [BM, BN], smem)
    bl: gl.constexpr = mbarrier.MBarrierLayout()
    # ready[s]: K buffer s holds the next tile (each producer thread's copies have landed);
    # free[s]: the consumers are done with it
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], bl)
    free = gl.allocate_shared_memory(gl.int64, [2, 1], bl)
    for k in gl.static_range(2):
        mbarrier.init(ready.index(k), count=_PRODUCER_THREADS)
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
                     stride_mh, num_splits, N, S, HAS_PE, True, HAS_EXTRA, HAS_TOPK_LEN,
                     HAS_TOPK_LEN2, HAS_SINK, CHECK_RANGE, HAS_MAXL, SPLIT)),
        (_producer, (k_nope, k_pe, ready, free, t_lo, t_hi, tiles1, idx1, idx2, n1, n2, KV,
                     KV2, n_rows, n_rows2, stride_row, stride_row2, page_size, page_size2,
                     HAS_PE, HAS_EXTRA)),
    ], [4], [_PRODUCER_REGS])


# the producer's [64, 64] copies: 16 bytes a thread and row, a warp's 4 rows of 128 bytes at
# once (whole lines), 4 rows a thread
_LC = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                    warps_per_cta=[4, 1], order=[1, 0]))


@gluon.jit
def _producer(k_nope, k_pe, ready, free, t_lo, t_hi, tiles1, idx1, idx2, n1, n2, KV, KV2,
              n_rows, n_rows2, stride_row, stride_row2, page_size, page_size2,
              HAS_PE: gl.constexpr, HAS_EXTRA: gl.constexpr):
    """The producer warp group: per tile, once the consumers have freed its K buffer, the 64
    rows' copies into it and an arrival on ``ready[s]`` that fires when they have landed
    (no wait here: the next tile's copies go out as soon as its buffer is free). A tile's
    entries are loaded a tile before its copies."""
    lists = (tiles1, idx1, idx2, n1, n2, KV, KV2, n_rows, n_rows2, stride_row, stride_row2,
             page_size, page_size2)
    entries = _entries(t_lo, lists, HAS_EXTRA)
    for i in range(t_lo, t_hi):
        s = (i - t_lo) % 2
        ph = ((i - t_lo) // 2) & 1
        e_next = _entries(i + 1, lists, HAS_EXTRA)  # its latency overlaps this tile's wait
        _, _, _, kv_, rows_, sr_, _ = _source(i, *lists, HAS_EXTRA)
        ok = (entries >= 0) & (entries < rows_)
        row = kv_ + gl.where(ok, entries, 0).to(gl.int64) * sr_
        mbarrier.wait(free.index(s), ph)  # the consumers are done with the tile before last
        _gather(row, ok, k_nope.index(s), k_pe.index(s), HAS_PE)
        # noinc: each producer thread's arrival is one of the barrier's 128, fired once that
        # thread's copies (all issued before it) have landed
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
        entries = e_next


@gluon.jit
def _entries(t, lists, HAS_EXTRA: gl.constexpr):
    """Tile ``t``'s 64 entries (``-1`` past its scope's length) in the copies' rows."""
    BN: gl.constexpr = 64
    ir, st, hi, _, _, _, _ = _source(t, *lists, HAS_EXTRA)
    c = st + gl.arange(0, BN, layout=gl.SliceLayout(1, _LC))
    return gl.load(ir + c, mask=c < hi, other=-1)


@gluon.jit
def _gather(row, ok, kn, kp, HAS_PE: gl.constexpr):
    """``cp.async`` of the rows at ``row`` (a masked row: zeros) into ``kn`` (the first 512
    columns) and, with ``HAS_PE``, ``kp`` (the 64 rope columns)."""
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, _LC))
    for j in gl.static_range(8):
        async_copy.async_copy_global_to_shared(kn.slice(j * 64, 64, dim=1),
                                               row[:, None] + (j * 64 + c)[None, :],
                                               mask=ok[:, None])
    if HAS_PE:
        async_copy.async_copy_global_to_shared(kp, row[:, None] + (512 + c)[None, :],
                                               mask=ok[:, None])
