"""Sparse top-k MLA for Hopper (sm_90) in Gluon: the 64-head programs of ``mla.fast.sparse``.

The Triton kernel of ``mla.fast.sparse`` pays twice at 64 heads per program: Triton makes both
warp groups compute the same 64 × 64 logits (the dot feeds a dot, benchmarks/notes/sparse.md),
and the gathered rows are loaded and, for ``fp8_ds_mla``, dequantized in registers in series
with the dots. Here, as in ``mla.fast.sm90.decode``:

- one program = one query (decode: one ``(b, t)``; prefill: one token), 64 of its heads as the
  M of the dots, one run of its top-k list in tiles of 64 entries; 8 warps = two warp groups;
- ``S = q · Kᵀ`` split by keys (each warp group 64 × 32, ``wgmma m64n32k16``), the softmax
  statistics reduced across the groups, ``P`` through shared memory, ``O += P · V`` split by
  columns (each group 64 × 256 of the float32 accumulator). No wgmma is issued twice.
- The rows named by a tile's indices are gathered with ``cp.async`` (16 bytes a thread per
  copy; an invalid entry, ``-1``, out of range or past ``topk_length``, is a masked copy that
  writes zeros), the next tile's copies in flight while this tile's dots run.
  - bf16/fp16 cache: straight into two stages of K (``k_nope`` 64 × 512, ``k_pe`` 64 × 64);
    224 KB of shared memory. DeepSeek-V4's rows of 512 (``HAS_PE`` off): ``k_nope`` alone,
    which is the whole row and V, and no rope dot.
  - ``fp8_ds_mla`` (656-byte rows): the 512 e4m3 bytes and the four float32 scales of each row
    go into a staging buffer, the 64 bf16 rope values into two ``k_pe`` stages; at the top of
    each tile the warps dequantize the staged bytes (e4m3 → float32 × the tile's scale → q's
    dtype) into the single ``k_nope`` buffer, then issue the next tile's copies, then run the
    dots. About 194 KB of shared memory.
  - MODEL1 pages (DeepSeek-V4, bf16 q of 512): a token's 7 × 64 e4m3 bytes (at ``576 · t`` of
    its page) go into a staging buffer and its 64 bf16 rope values into the ``k_pe``
    stages; its 7 UE8M0 scale bytes (at ``576 · page_size + 8 · t``) are loaded into
    registers with the copies, a tile ahead. At the top of each tile the warps write the
    whole 512-wide row into the single K buffer: ``e4m3 · 2^(byte − 127)`` per tile (0xFF:
    NaN), then the rope values. K is also V; ``S`` has no rope part. Two staging buffers
    (the plan's ``num_stages`` 2; about 221 KB; measured slower): the copies run two tiles ahead,
    tile i+2's issued into tile i's buffers right after tile i's ``P · V`` is issued (so
    the issuing overlaps that wgmma, and the copies land during two tiles of work); one
    (about 189 KB; the default plan's): the next tile's copies after this tile's
    dequantization.
- A second KV scope: its tiles follow the first scope's in one list of tiles, split as one;
  each tile's scope (index row, length, cache, rows, stride, page size) is chosen on the
  device (``_source``), so the prefetching and the online softmax run as for one scope.
- ``attn_sink``: the unsplit epilogue multiplies ``out`` by ``σ(lse − sink)``; split partials
  are left to the Triton combine kernel, which applies it once after the merge.
- Without value checks, a ``topk_length`` outside ``[0, topk]`` or (decode) an entry outside
  ``[-1, rows)`` makes the query NaN: the first a flag, the second a NaN logit.

``mla.fast.sparse`` routes 64-head programs here on an sm_90 GPU (``supported``); this kernel
writes exactly what the Triton sparse kernel of ``mla.fast.sparse`` writes (result, or split
partials for its combine kernel). The Triton interpreter does not run Gluon: the CPU tests
compile it for sm_90 (``tests/test_sm90_compile.py``) and ``python -m mla.check`` checks it on
the GPU.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mla.fast.common import capability
from mla.fast.sm90.softmax import barrier, softmax_pv

__all__ = ["epilogue", "load_q", "sparse_kernel", "supported"]

_DV = 512
_DR = 64


def supported(q: torch.Tensor, kv: torch.Tensor, head_dim_v: int, fp8: bool,
              block_m: int, model1: bool = False) -> bool:
    """Whether the sm_90 kernel handles this call: a Hopper GPU, 64-head programs, bf16/fp16
    q, DeepSeek-V3.2's 576/512 head dims with a cache in q's dtype (or ``fp8_ds_mla`` bytes
    with bf16 q), DeepSeek-V4's rows of 512 (V the whole row) in q's dtype, or (``model1``)
    MODEL1 pages (``kv``: ``[num_blocks, 584 · bs]`` bytes) with bf16 q of 512; rows (pages)
    16-byte aligned."""
    if q.device.type != "cuda" or capability(q.device) != (9, 0):
        return False
    D = q.shape[-1]
    if block_m != 64 or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    # rows of 576 (V3.2: 512 + rope 64) or 512 (V4: V the whole row; MODEL1 pages or q's dtype)
    if D not in (_DV, _DV + _DR) or (model1 and D != _DV):
        return False
    if head_dim_v != _DV or q.stride(-1) != 1 or kv.stride(-1) != 1:
        return False
    if kv.data_ptr() % 16 or (kv.stride(0) * kv.element_size()) % 16:
        return False
    return (q.dtype == torch.bfloat16) if fp8 or model1 else (kv.dtype == q.dtype)


@gluon.jit
def sparse_kernel(
    Q, KV, IDX, TOPK_LEN, KV2, IDX2, TOPK_LEN2, SINK, O, LSE, MAXL, OP, LSEP, MAXP,
    stride_qq, stride_qh, stride_iq, stride_row, page_size,
    stride_iq2, stride_row2, page_size2,
    stride_oq, stride_oh, stride_lb, stride_lt, stride_lh, stride_mq, stride_mh,
    n_rows, topk, n_rows2, topk2, qk_scale, num_splits,
    N: gl.constexpr, S: gl.constexpr, GROUPS: gl.constexpr, FP8: gl.constexpr,
    MODEL1: gl.constexpr, HAS_PE: gl.constexpr, HAS_EXTRA: gl.constexpr,
    HAS_TOPK_LEN2: gl.constexpr,
    HAS_TOPK_LEN: gl.constexpr, HAS_SINK: gl.constexpr, CHECK_RANGE: gl.constexpr,
    HAS_MAXL: gl.constexpr, SPLIT: gl.constexpr,
    SCALE_OFFSET: gl.constexpr, ROPE_OFFSET: gl.constexpr, RAW_STAGES: gl.constexpr,
    SPLIT_TILES: gl.constexpr, SPLIT_CAP: gl.constexpr,
):
    """Grid ``(queries · GROUPS, splits)``, 8 warps. ``KV`` is the cache as rows of
    ``stride_row`` elements (q's dtype) or bytes (``FP8``: uint8, 656-byte rows), or
    (``MODEL1``) pages of ``page_size`` tokens ``stride_row`` bytes apart. ``HAS_PE``: rows of
    576 with a rope part (else 512, V the whole row, no rope dot). ``HAS_EXTRA``: a
    second scope (``KV2``, ``IDX2``, ``TOPK_LEN2``, its own layout numbers) whose tiles follow
    the first scope's in one list of tiles and one online softmax. A query
    whose ``topk_length`` lies outside ``[0, topk]``, or (``CHECK_RANGE``, decode) that uses an
    entry outside ``[-1, n_rows)``, gets NaN results; ``SINK [N]`` (``HAS_SINK``) scales the
    unsplit output by ``σ(lse − sink)`` (split partials get it in the combine kernel).
    ``RAW_STAGES`` (MODEL1): 2 staging buffers, the copies two tiles ahead (issued while a
    tile's ``P · V`` runs); 1: one buffer, the next tile's copies after the dequantization.
    ``SPLIT_TILES > 0``: the list cut into runs of ``max(SPLIT_TILES, ceil(tiles /
    SPLIT_CAP))`` tiles (the batch-invariant plans); 0: ``num_splits`` equal shares."""
    BM: gl.constexpr = 64
    BN: gl.constexpr = 64
    DV: gl.constexpr = 512
    DR: gl.constexpr = 64
    F8: gl.constexpr = 128  # e4m3 values per scale
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
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    # 16-byte vectors: 8 × 16-bit or 16 × 8-bit values a thread
    ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                        warps_per_cta=[8, 1], order=[1, 0])
    ld8: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8],
                                         warps_per_cta=[8, 1], order=[1, 0])
    row_8: gl.constexpr = gl.SliceLayout(1, ld8)
    lds: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[8, 4],
                                         warps_per_cta=[8, 1], order=[1, 0])  # [64, 4] scales
    # MODEL1: 64-byte e4m3 tiles (16 bytes a thread) and the [64, 8] UE8M0 scale bytes
    ld8m: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[8, 4],
                                          warps_per_cta=[8, 1], order=[1, 0])
    lds8: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[8, 4],
                                          warps_per_cta=[8, 1], order=[1, 0])
    if MODEL1:
        lb: gl.constexpr = ld8m
        lc: gl.constexpr = lds8
    else:
        lb: gl.constexpr = ld8
        lc: gl.constexpr = lds
    STAGED: gl.constexpr = FP8 or MODEL1  # the gathered bytes are dequantized in shared memory
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                              rank=2)
    plain: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1,
                                                  order=[1, 0])

    q_nope = gl.allocate_shared_memory(dtype, [BM, DV], smem)
    q_pe = gl.allocate_shared_memory(dtype, [BM, DR], smem)
    k_pe = gl.allocate_shared_memory(dtype, [2, BN, DR], smem)
    p_smem = gl.allocate_shared_memory(dtype, [BM, BN], smem)
    if FP8:
        k_nope = gl.allocate_shared_memory(dtype, [1, BN, DV], smem)
        raw = gl.allocate_shared_memory(gl.uint8, [BN, DV], plain)
        raw_sc = gl.allocate_shared_memory(gl.float32, [BN, 4], plain)
    elif MODEL1:
        k_nope = gl.allocate_shared_memory(dtype, [1, BN, DV], smem)
        # 448 of 512 columns used
        raw = gl.allocate_shared_memory(gl.uint8, [RAW_STAGES, BN, DV], plain)
        raw_sc = raw  # unused: the scale bytes travel in registers
    else:
        k_nope = gl.allocate_shared_memory(dtype, [2, BN, DV], smem)
        raw = k_nope  # unused
        raw_sc = k_nope

    load_q(Q, qi64, g, stride_qq, stride_qh, q_nope, q_pe, N, HAS_PE, ld)

    # this program's entries: an equal share of whole tiles of the query's list, or a run of
    # fixed length
    c_s = gl.arange(0, BN, layout=col_s)
    # a topk_length outside [0, topk]: NaN results, reads clamped to the row
    n1, n2, tiles1, bad, t_lo, t_hi, idx1, idx2 = runs(
        TOPK_LEN, TOPK_LEN2, IDX, IDX2, qi, split, topk, topk2, num_splits, stride_iq,
        stride_iq2, S, HAS_EXTRA, HAS_TOPK_LEN, HAS_TOPK_LEN2, SPLIT_TILES, SPLIT_CAP)

    # a tile's indices are loaded a tile ahead of its gather, so that issuing the copies
    # never waits for an index load. _source(t): tile t's scope (index row, first entry,
    # length, cache, rows, row stride, page size)
    ir, st, hi, kv_, rows_, sr_, ps_ = _source(t_lo, tiles1, idx1, idx2, n1, n2, KV, KV2, n_rows,
                                               n_rows2, stride_row, stride_row2, page_size,
                                               page_size2, HAS_EXTRA)
    i_ld, i_8, i_s = _load_idx(ir, st, hi, ld, lb, lc, STAGED)
    codes = _gather(kv_, i_ld, i_8, i_s, t_lo < t_hi, rows_, sr_, ps_, k_nope,
                    k_pe, raw, raw_sc, 0, FP8, MODEL1, HAS_PE, SCALE_OFFSET, ROPE_OFFSET,
                    RAW_STAGES, ld, lb, lc)
    async_copy.commit_group()
    ir, st, hi, kv_, rows_, sr_, ps_ = _source(t_lo + 1, tiles1, idx1, idx2, n1, n2, KV, KV2,
                                               n_rows, n_rows2, stride_row, stride_row2,
                                               page_size, page_size2, HAS_EXTRA)
    i_ld, i_8, i_s = _load_idx(ir, st, hi, ld, lb, lc, STAGED)
    # MODEL1 with two staging buffers: copies run two tiles ahead. Tile i+2's copies go into
    # tile i's buffers once tile i is dequantized, issued while tile i's P · V runs
    AHEAD2: gl.constexpr = MODEL1 and RAW_STAGES == 2
    codes2 = codes  # AHEAD2: the scale bytes of the tile after the next
    if AHEAD2:
        codes2 = _gather(kv_, i_ld, i_8, i_s, t_lo + 1 < t_hi, rows_, sr_, ps_, k_nope, k_pe,
                         raw, raw_sc, 1, FP8, MODEL1, HAS_PE, SCALE_OFFSET, ROPE_OFFSET,
                         RAW_STAGES, ld, lb, lc)
        async_copy.commit_group()
        ir, st, hi, kv_, rows_, sr_, ps_ = _source(t_lo + 2, tiles1, idx1, idx2, n1, n2, KV,
                                                   KV2, n_rows, n_rows2, stride_row,
                                                   stride_row2, page_size, page_size2,
                                                   HAS_EXTRA)
        i_ld, i_8, i_s = _load_idx(ir, st, hi, ld, lb, lc, STAGED)

    acc = gl.zeros([BM, DV], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BM, BN], gl.float32, layout=s_layout)
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BM], gl.float32, layout=row_s)
    for i in range(t_lo, t_hi):
        s = (i - t_lo) % 2
        ir_i, st_i, hi_i, _, rows_i, _, _ = _source(i, tiles1, idx1, idx2, n1, n2, KV, KV2,
                                                    n_rows, n_rows2, stride_row, stride_row2,
                                                    page_size, page_size2, HAS_EXTRA)
        cols = st_i + c_s
        idx = gl.load(ir_i + cols, mask=cols < hi_i, other=-1)  # for the logits' mask
        if AHEAD2:
            async_copy.wait_group(1)  # tile i's copies have landed (tile i+1's may not)
        else:
            async_copy.wait_group(0)  # this thread's copies of tile i have landed
        fence_async_shared()
        barrier()  # everyone's have; everyone is done with tile i-1
        if FP8:
            kn = k_nope.index(0)
            sc = raw_sc.load(lds)  # [BN, 4] float32
            col4 = gl.arange(0, 4, layout=gl.SliceLayout(0, lds))
            for c in gl.static_range(DV // F8):
                scale = gl.sum(gl.where(col4[None, :] == c, sc, 0.0), axis=1)
                scale = gl.convert_layout(scale, row_8)
                b8 = raw.slice(c * F8, F8, dim=1).load(ld8)
                v = b8.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, None]
                kn.slice(c * F8, F8, dim=1).store(v.to(dtype))
            fence_async_shared()
            barrier()  # the staged bytes are consumed, K is written
        elif MODEL1:
            kn = k_nope.index(0)
            _dequant_model1(raw.index(s % RAW_STAGES), codes, k_pe.index(s), kn, ld, ld8m,
                            lds8)
            fence_async_shared()
            barrier()  # the staged bytes are consumed, K (rope included) is written
        else:
            kn = k_nope.index(s)
        if not AHEAD2:
            # tile i+1's copies (its source: the (kv_, rows_, sr_, ps_) of the last _source)
            codes = _gather(kv_, i_ld, i_8, i_s, i + 1 < t_hi, rows_, sr_, ps_,
                            k_nope, k_pe, raw, raw_sc, 1 - s, FP8, MODEL1, HAS_PE,
                            SCALE_OFFSET, ROPE_OFFSET, RAW_STAGES, ld, lb, lc)
            async_copy.commit_group()
            ir, st, hi, kv_, rows_, sr_, ps_ = _source(i + 2, tiles1, idx1, idx2, n1, n2, KV,
                                                       KV2, n_rows, n_rows2, stride_row,
                                                       stride_row2, page_size, page_size2,
                                                       HAS_EXTRA)
            i_ld, i_8, i_s = _load_idx(ir, st, hi, ld, lb, lc, STAGED)

        valid = (cols < hi_i) & (idx >= 0) & (idx < rows_i)
        sc_ = warpgroup_mma(q_nope, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if HAS_PE:
            sc_ = warpgroup_mma(q_pe, k_pe.index(s).permute((1, 0)), sc_, is_async=True)
        sc_ = warpgroup_mma_wait(num_outstanding=0, deps=(sc_,))
        qk = gl.where(valid[None, :], sc_ * qk_scale, float("-inf"))  # log2 domain
        if CHECK_RANGE:  # an entry outside [-1, n_rows) is a NaN logit: a NaN query
            qk = gl.where(((cols < hi_i) & ((idx < -1) | (idx >= rows_i)))[None, :],
                          float("nan"), qk)
        if AHEAD2:
            acc, m_i, l_i = softmax_pv(qk, m_i, l_i, acc, p_smem, kn, row_o, WAIT=False)
            # tile i+2's copies into tile i's staging buffers (dequantized before the last
            # barrier) while P · V runs
            codes = codes2
            codes2 = _gather(kv_, i_ld, i_8, i_s, i + 2 < t_hi, rows_, sr_, ps_, k_nope, k_pe,
                             raw, raw_sc, s, FP8, MODEL1, HAS_PE, SCALE_OFFSET, ROPE_OFFSET,
                             RAW_STAGES, ld, lb, lc)
            async_copy.commit_group()
            ir, st, hi, kv_, rows_, sr_, ps_ = _source(i + 3, tiles1, idx1, idx2, n1, n2, KV,
                                                       KV2, n_rows, n_rows2, stride_row,
                                                       stride_row2, page_size, page_size2,
                                                       HAS_EXTRA)
            i_ld, i_8, i_s = _load_idx(ir, st, hi, ld, lb, lc, STAGED)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        else:
            acc, m_i, l_i = softmax_pv(qk, m_i, l_i, acc, p_smem, kn, row_o)
    async_copy.wait_group(0)

    epilogue(acc, m_i, l_i, bad, qi64, g, split, SINK, O, LSE, MAXL, OP, LSEP, MAXP,
             stride_oq, stride_oh, stride_lb, stride_lt, stride_lh, stride_mq, stride_mh,
             num_splits, N, S, HAS_SINK, HAS_MAXL, SPLIT, s_layout, o_layout)


@gluon.jit
def load_q(Q, qi64, g, stride_qq, stride_qh, q_nope, q_pe, N: gl.constexpr,
           HAS_PE: gl.constexpr, ld: gl.constexpr):
    """Heads ``[64 g, 64 g + 64)`` of query ``qi64`` into shared memory (heads past ``N`` read
    as zeros and are never stored): ``q_nope`` the first 512 columns, ``q_pe`` the 64 rope
    columns of rows of 576 (``HAS_PE``)."""
    BM: gl.constexpr = 64
    DV: gl.constexpr = 512
    CH: gl.constexpr = 64
    h_ld = g * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
    q_row = Q + qi64 * stride_qq + h_ld.to(gl.int64) * stride_qh
    c_ld = gl.arange(0, CH, layout=gl.SliceLayout(0, ld))
    for c in gl.static_range(DV // CH):
        x = gl.load(q_row[:, None] + (c * CH + c_ld)[None, :], mask=(h_ld < N)[:, None],
                    other=0.0)
        q_nope.slice(c * CH, CH, dim=1).store(x)
    if HAS_PE:  # rows of 512: the rope values are in q_nope's columns
        x = gl.load(q_row[:, None] + (DV + c_ld)[None, :], mask=(h_ld < N)[:, None],
                    other=0.0)
        q_pe.store(x)


@gluon.jit
def epilogue(acc, m_i, l_i, bad, qi64, g, split, SINK, O, LSE, MAXL, OP, LSEP, MAXP,
             stride_oq, stride_oh, stride_lb, stride_lt, stride_lh, stride_mq, stride_mh,
             num_splits, N: gl.constexpr, S: gl.constexpr, HAS_SINK: gl.constexpr,
             HAS_MAXL: gl.constexpr, SPLIT: gl.constexpr, s_layout: gl.constexpr,
             o_layout: gl.constexpr, o_smem=None):
    """The 64 heads' results from the online softmax's ``acc``, ``m_i``, ``l_i``: ``out``,
    ``lse`` and (``HAS_MAXL``) the max logits, the sink applied; or (``SPLIT``) this split's
    partials for the combine kernel. ``bad``: the query's lengths were out of range (NaN).
    ``o_smem``: a ``[64, 512]`` shared buffer of O's dtype no thread reads any more, through
    which ``out`` is stored in 16-byte pieces (else from the dots' layout, 4 bytes a store)."""
    BM: gl.constexpr = 64
    DV: gl.constexpr = 512
    dtype: gl.constexpr = O.dtype.element_ty
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    seen = l_i != 0.0  # l = 0: nothing seen; a NaN l (a NaN logit) stays NaN, never "nothing"
    l_safe = gl.where(seen, l_i, 1.0)
    lse2 = m_i + gl.log2(l_safe)
    lse = gl.where(bad, float("nan"), lse2 * 0.6931471805599453)
    # -inf where nothing was seen; NaN with the lse (gl.max may skip a NaN logit)
    mx = gl.where((l_i == l_i) & ~bad, m_i, float("nan")) * 0.6931471805599453
    o = gl.where(bad, float("nan"), acc / gl.convert_layout(l_safe, row_o)[:, None])
    h_s = g * BM + gl.arange(0, BM, layout=row_s)
    hs_ok = h_s < N
    if HAS_SINK and not SPLIT:
        sink = gl.load(SINK + h_s, mask=hs_ok, other=0.0)
        f = 1.0 / (1.0 + gl.exp2(sink * 1.4426950408889634 - lse2))
        f = gl.where(seen, f, 1.0)  # a query that saw nothing keeps out = 0
        f = gl.where(sink == sink, f, float("nan"))
        o = o * gl.convert_layout(f, row_o)[:, None]
    h_o = g * BM + gl.arange(0, BM, layout=row_o)
    ho_ok = h_o < N
    c_o = gl.arange(0, DV, layout=col_o)
    if SPLIT:
        # partials [queries, splits, N, DV] and [queries, splits, N]; "nothing" is lse -inf
        part_s = (qi64 * num_splits + split) * N + h_s
        gl.store(LSEP + part_s, gl.where(seen | bad, lse, float("-inf")), mask=hs_ok)
        gl.store(MAXP + part_s, mx, mask=hs_ok)
        part_o = (qi64 * num_splits + split) * N + h_o
        gl.store(OP + part_o[:, None] * DV + c_o[None, :], o,
                 mask=(ho_ok & gl.convert_layout(seen, row_o))[:, None])
    elif o_smem is None:
        gl.store(O + qi64 * stride_oq + h_o.to(gl.int64)[:, None] * stride_oh + c_o[None, :],
                 o.to(dtype), mask=ho_ok[:, None])
    else:
        o_smem.store(o.to(dtype))
        barrier()
        ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                            warps_per_cta=[8, 1], order=[1, 0])
        h_l = g * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
        c_l = gl.arange(0, DV, layout=gl.SliceLayout(0, ld))
        gl.store(O + qi64 * stride_oq + h_l.to(gl.int64)[:, None] * stride_oh + c_l[None, :],
                 o_smem.load(ld), mask=(h_l < N)[:, None])
    if not SPLIT:
        gl.store(LSE + (qi64 // S) * stride_lb + (qi64 % S) * stride_lt + h_s * stride_lh,
                 gl.where(seen | bad, lse, float("inf")), mask=hs_ok)
        if HAS_MAXL:
            gl.store(MAXL + qi64 * stride_mq + h_s * stride_mh, mx, mask=hs_ok)


@gluon.jit
def runs(TOPK_LEN, TOPK_LEN2, IDX, IDX2, qi, split, topk, topk2, num_splits, stride_iq,
         stride_iq2, S: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
         HAS_TOPK_LEN2: gl.constexpr, SPLIT_TILES: gl.constexpr, SPLIT_CAP: gl.constexpr):
    """Query ``qi``'s entries and this program's run of their 64-entry tiles: each scope's
    length (``n1``, ``n2``), the first scope's tiles, whether a length lies outside
    ``[0, topk]`` (``bad``), the run ``[t_lo, t_hi)`` (an equal share of the tiles among
    ``num_splits``, or with ``SPLIT_TILES`` a run of fixed length, batch invariant:
    ``mla.fast.sparse.plan``) and each scope's index row."""
    BN: gl.constexpr = 64
    n1, bad = _length(TOPK_LEN, qi // S, topk, HAS_TOPK_LEN)
    tiles1 = gl.cdiv(n1, BN)
    n2 = n1
    tiles = tiles1
    if HAS_EXTRA:
        n2, bad2 = _length(TOPK_LEN2, qi // S, topk2, HAS_TOPK_LEN2)
        bad = bad | bad2
        tiles = tiles1 + gl.cdiv(n2, BN)
    if SPLIT_TILES > 0:
        per_split = gl.maximum(gl.cdiv(tiles, SPLIT_CAP), SPLIT_TILES)
    else:
        per_split = gl.cdiv(tiles, num_splits)
    t_lo = split * per_split
    t_hi = gl.minimum(t_lo + per_split, tiles)
    qi64 = qi.to(gl.int64)
    idx1 = IDX + qi64 * stride_iq
    idx2 = idx1
    if HAS_EXTRA:
        idx2 = IDX2 + qi64 * stride_iq2
    return n1, n2, tiles1, bad, t_lo, t_hi, idx1, idx2


@gluon.jit
def _length(TOPK_LEN, r, topk, HAS_TOPK_LEN: gl.constexpr):
    """``(entries used, whether topk_length[r] lies outside [0, topk])``, the count clamped so
    that no read leaves the index row."""
    n = topk + 0 * r  # a tensor even where topk is specialized to a constant
    bad = n < 0
    if HAS_TOPK_LEN:
        length = gl.load(TOPK_LEN + r)
        bad = (length < 0) | (length > topk)
        n = gl.minimum(gl.maximum(length, 0), topk)
    return n, bad


@gluon.jit
def _source(t, tiles1, idx1, idx2, n1, n2, KV1, KV2, rows1, rows2, sr1, sr2, ps1, ps2,
            HAS_EXTRA: gl.constexpr):
    """Tile ``t`` of the list of tiles (the first scope's, then the second's): its scope's
    index row, the tile's first entry, the scope's length, cache, rows, row stride and page
    size (numbers as tensors, so that a value Triton specialized to a constant still yields
    the same type in both branches)."""
    BN: gl.constexpr = 64
    zero = 0 * t
    start = t * BN
    ir = idx1
    hi = n1 + zero
    kv = KV1
    rows = (rows1 + zero).to(gl.int64)
    sr = (sr1 + zero).to(gl.int64)
    ps = ps1 + zero
    if HAS_EXTRA:
        if t >= tiles1:
            start = (t - tiles1) * BN
            ir = idx2
            hi = n2 + zero
            kv = KV2
            rows = (rows2 + zero).to(gl.int64)
            sr = (sr2 + zero).to(gl.int64)
            ps = ps2 + zero
    return ir, start, hi, kv, rows, sr, ps


@gluon.jit
def _load_idx(idx_row, start, hi, ld: gl.constexpr, lb: gl.constexpr, lc: gl.constexpr,
              STAGED: gl.constexpr):
    """Entries ``[start, start + 64)`` of the list (``-1`` past ``hi``) in the row layouts of
    the copies: ``ld`` (16-bit rows), and for a staged (fp8) cache also ``lb`` (the e4m3
    bytes) and ``lc`` (the scales)."""
    BN: gl.constexpr = 64
    c1 = start + gl.arange(0, BN, layout=gl.SliceLayout(1, ld))
    i_ld = gl.load(idx_row + c1, mask=c1 < hi, other=-1)
    if STAGED:
        c2 = start + gl.arange(0, BN, layout=gl.SliceLayout(1, lb))
        i_8 = gl.load(idx_row + c2, mask=c2 < hi, other=-1)
        c3 = start + gl.arange(0, BN, layout=gl.SliceLayout(1, lc))
        i_s = gl.load(idx_row + c3, mask=c3 < hi, other=-1)
    else:
        i_8 = i_ld  # unused
        i_s = i_ld
    return i_ld, i_8, i_s


@gluon.jit
def _model1_row(i, n_rows, page_size, page_stride):
    """``(valid, byte offset of the page, token within the page)`` of MODEL1 slots ``i``: the
    entries are int32, so the division by the page size is a 32-bit one (a 64-bit division
    is a long software sequence); the byte offsets are 64-bit."""
    ok = (i >= 0) & (i < n_rows)
    slot = gl.where(ok, i, 0)
    page = slot // page_size
    return ok, page.to(gl.int64) * page_stride, (slot - page * page_size).to(gl.int64)


@gluon.jit
def _gather(KV, i_ld, i_8, i_s, issue, n_rows, stride_row, page_size, k_nope, k_pe, raw,
            raw_sc, stage, FP8: gl.constexpr, MODEL1: gl.constexpr, HAS_PE: gl.constexpr,
            SCALE_OFFSET: gl.constexpr, ROPE_OFFSET: gl.constexpr, RAW_STAGES: gl.constexpr,
            ld: gl.constexpr, lb: gl.constexpr, lc: gl.constexpr):
    """When ``issue``, the ``cp.async`` copies of the 64 rows named by the entries ``i_*``
    (``-1`` or out of range: a masked copy, zeros) into ``stage`` (k_pe, and k_nope or the fp8
    staging buffers). Returns MODEL1's ``[64, 8]`` UE8M0 scale bytes of those rows, loaded
    into registers a tile before their use (``i_s`` otherwise, unused)."""
    DV: gl.constexpr = 512
    CH: gl.constexpr = 64
    F8: gl.constexpr = 128
    dtype: gl.constexpr = k_pe.dtype
    codes = i_s
    c16 = gl.arange(0, CH, layout=gl.SliceLayout(0, ld))
    if MODEL1:
        # page p at p · stride_row; token t's 448 e4m3 + 64 bf16 at 576 · t of it, its scale
        # bytes at 576 · page_size + 8 · t
        ok, pg, tok = _model1_row(i_ld, n_rows, page_size, stride_row)
        pe_ptr = (KV + pg + tok * 576 + 448).to(gl.pointer_type(dtype), bitcast=True)
        ok = ok & issue
        async_copy.async_copy_global_to_shared(k_pe.index(stage),
                                               pe_ptr[:, None] + c16[None, :],
                                               mask=ok[:, None])
        ok8, pg8, tok8 = _model1_row(i_8, n_rows, page_size, stride_row)
        data8 = pg8 + tok8 * 576
        ok8 = ok8 & issue
        c64 = gl.arange(0, CH, layout=gl.SliceLayout(0, lb))
        staged = raw.index(stage % RAW_STAGES)
        for c in gl.static_range(7):
            async_copy.async_copy_global_to_shared(staged.slice(c * CH, CH, dim=1),
                                                   KV + data8[:, None] + (c * CH + c64)[None, :],
                                                   mask=ok8[:, None])
        oks, pgs, toks = _model1_row(i_s, n_rows, page_size, stride_row)
        oks = oks & issue
        c8 = gl.arange(0, 8, layout=gl.SliceLayout(0, lc))
        sc_off = pgs + page_size * 576 + toks * 8
        codes = gl.load(KV + sc_off[:, None] + c8[None, :],
                        mask=oks[:, None] & (c8 < 7)[None, :], other=0)
    elif FP8:
        ok = (i_ld >= 0) & (i_ld < n_rows) & issue
        row = gl.where(ok, i_ld, 0).to(gl.int64) * stride_row
        # rope: bf16 values at byte ROPE_OFFSET of each row
        pe_ptr = (KV + row + ROPE_OFFSET).to(gl.pointer_type(dtype), bitcast=True)
        async_copy.async_copy_global_to_shared(k_pe.index(stage),
                                               pe_ptr[:, None] + c16[None, :],
                                               mask=ok[:, None])
        ok8 = (i_8 >= 0) & (i_8 < n_rows) & issue
        row8 = gl.where(ok8, i_8, 0).to(gl.int64) * stride_row
        c8 = gl.arange(0, F8, layout=gl.SliceLayout(0, lb))
        for c in gl.static_range(DV // F8):
            async_copy.async_copy_global_to_shared(raw.slice(c * F8, F8, dim=1),
                                                   KV + row8[:, None] + (c * F8 + c8)[None, :],
                                                   mask=ok8[:, None])
        oks = (i_s >= 0) & (i_s < n_rows) & issue
        rows_ = gl.where(oks, i_s, 0).to(gl.int64) * stride_row
        sc_ptr = (KV + rows_ + SCALE_OFFSET).to(gl.pointer_type(gl.float32), bitcast=True)
        c4 = gl.arange(0, 4, layout=gl.SliceLayout(0, lc))
        async_copy.async_copy_global_to_shared(raw_sc, sc_ptr[:, None] + c4[None, :],
                                               mask=oks[:, None])
    else:
        ok = (i_ld >= 0) & (i_ld < n_rows) & issue
        row = gl.where(ok, i_ld, 0).to(gl.int64) * stride_row
        base = KV + row
        kn = k_nope.index(stage)
        for c in gl.static_range(DV // CH):
            async_copy.async_copy_global_to_shared(kn.slice(c * CH, CH, dim=1),
                                                   base[:, None] + (c * CH + c16)[None, :],
                                                   mask=ok[:, None])
        if HAS_PE:
            async_copy.async_copy_global_to_shared(k_pe.index(stage),
                                                   base[:, None] + (DV + c16)[None, :],
                                                   mask=ok[:, None])
    return codes


@gluon.jit
def _dequant_model1(raw, codes, pe, kn, ld: gl.constexpr, ld8m: gl.constexpr,
                    lds8: gl.constexpr):
    """MODEL1's staged row bytes into K (q's dtype): 7 tiles of 64 e4m3 values times
    ``2^(byte − 127)`` (the byte 0xFF: NaN; built from the exponent bits, exact for the bytes
    1-254; 0 reads as 0), then the 64 rope values from ``pe``: K is the whole 512-wide row."""
    dtype: gl.constexpr = kn.dtype
    code = codes.to(gl.int32)
    c8 = gl.arange(0, 8, layout=gl.SliceLayout(0, lds8))
    for c in gl.static_range(7):
        byte = gl.sum(gl.where(c8[None, :] == c, code, 0), axis=1)
        scale = gl.where(byte == 255, float("nan"), (byte << 23).to(gl.float32, bitcast=True))
        scale = gl.convert_layout(scale, gl.SliceLayout(1, ld8m))
        b8 = raw.slice(c * 64, 64, dim=1).load(ld8m)
        v = b8.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, None]
        kn.slice(c * 64, 64, dim=1).store(v.to(dtype))
    kn.slice(448, 64, dim=1).store(pe.load(ld))
