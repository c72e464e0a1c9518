"""The Triton kernels of ``mla.fast.sparse``: one pass over a query's selected rows, in one or
two KV scopes, and the combine of split-``topk`` partials.

``mla.fast.sparse`` says what they compute and how they are launched; here is how a row is
read, per cache format (``FORMAT``):

- ``PLAIN``: rows of ``stride_row`` elements in q's dtype, ``k_nope = row[:DV]``,
  ``k_pe = row[DV:DV + DR]``.
- ``DS_MLA`` (``fp8_ds_mla``, 656-byte rows): 512 e4m3 bytes, four float32 scales (one per 128
  values), 64 bf16 rope values; read through uint8, float32 and bfloat16 views of the bytes.
- ``MODEL1`` (DeepSeek-V4's pages, ``mla.reference.fp8_model1``): slot ``i`` is token
  ``i % bs`` of page ``i // bs``, the page ``page_stride`` bytes from the previous one; the
  token's 576-byte data row (448 e4m3 + 64 bf16 rope) sits at ``576 · (i % bs)`` of its page,
  its 7 UE8M0 scale bytes at ``576 · bs + 8 · (i % bs)``. The row is read as 8 tiles of 64:
  seven e4m3 tiles times ``2^(byte − 127)`` (the byte ``0xFF``: NaN) and the rope tile, giving
  one 512-wide ``k_nope`` that is also V (``DR = 0``). A scale is built from its exponent bits
  (``byte << 23``), exact for the bytes 1-254 the quantizer writes (its floor is ``2^-13``);
  the byte 0 reads as 0 instead of ``2^-127``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mla.fast.softmax import load_2d, softmax_pv

__all__ = ["DS_MLA", "MODEL1", "PLAIN", "combine_kernel", "sparse_kernel"]

PLAIN, DS_MLA, MODEL1 = 0, 1, 2
_LN2 = tl.constexpr(0.6931471805599453)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _gather_rows(Q, KV, KV_F32, KV_BF16, idx, valid, stride_row, page_size, page_stride,
                 DV: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr, HAS_PE: tl.constexpr,
                 FORMAT: tl.constexpr):
    """The ``BLOCK_N`` cache rows named by ``idx`` as ``(k_nope [BLOCK_N, BLOCK_DV],
    k_pe [BLOCK_N, BLOCK_DR])`` in q's dtype (the dots'); rows where ``valid`` is False are
    zeros (no load, so a poisoned or absent row cannot leak in)."""
    row = tl.where(valid, idx, 0).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    if FORMAT == 1:  # fp8_ds_mla
        # bytes [0, 512): e4m3; floats [128, 132): the scales; bf16 [264, 328): k_pe. The
        # e4m3 bytes as [rows, tile, 128] so each tile's scale broadcasts over its values
        offs_t = tl.arange(0, 4)
        offs_c = tl.arange(0, 128)
        cols = offs_t[:, None] * 128 + offs_c[None, :]
        raw = tl.load(KV + (row * 656)[:, None, None] + cols[None, :, :],
                      mask=valid[:, None, None], other=0)
        scale = tl.load(KV_F32 + (row * 164 + 128)[:, None] + offs_t[None, :],
                        mask=valid[:, None], other=0.0)
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
        k_nope = tl.reshape(x, (BLOCK_N, BLOCK_DV)).to(Q.dtype.element_ty)
        k_pe = tl.load(KV_BF16 + (row * 328 + 264)[:, None] + offs_dr[None, :],
                       mask=valid[:, None], other=0.0).to(Q.dtype.element_ty)
    elif FORMAT == 2:  # MODEL1 pages: 8 tiles of 64, the last one the bf16 rope values
        page = row // page_size
        tok = row % page_size
        data = page * page_stride + tok * 576
        offs_t = tl.arange(0, 8)
        offs_c = tl.arange(0, 64)
        nope_t = offs_t < 7
        raw = tl.load(KV + data[:, None, None] + (offs_t * 64)[None, :, None]
                      + offs_c[None, None, :],
                      mask=valid[:, None, None] & nope_t[None, :, None], other=0)
        code = tl.load(KV + (page * page_stride + page_size * 576 + tok * 8)[:, None]
                       + offs_t[None, :], mask=valid[:, None] & nope_t[None, :], other=0)
        code = code.to(tl.int32)
        scale = tl.where(code == 255, float("nan"), (code << 23).to(tl.float32, bitcast=True))
        rope = tl.load(KV_BF16 + (data // 2 + 224)[:, None, None] + offs_c[None, None, :]
                       + (offs_t * 0)[None, :, None],
                       mask=valid[:, None, None] & (offs_t == 7)[None, :, None], other=0.0)
        x = tl.where(nope_t[None, :, None],
                     raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None],
                     rope.to(tl.float32))
        k_nope = tl.reshape(x, (BLOCK_N, BLOCK_DV)).to(Q.dtype.element_ty)
        k_pe = k_nope  # unused: V is the whole row
    else:
        row_off = row * stride_row
        k_nope = load_2d(KV + row_off[:, None] + offs_dv[None, :], valid, offs_dv < DV,
                          True, BLOCK_DV != DV)
        if HAS_PE:
            k_pe = load_2d(KV + row_off[:, None] + DV + offs_dr[None, :], valid,
                            offs_dr < DR, True, BLOCK_DR != DR)
        else:
            k_pe = k_nope  # unused
    return k_nope, k_pe


@triton.jit
def _scope_tiles(Q, KV, KV_F32, KV_BF16, idx_row, lo, hi, n_rows, stride_row, page_size,
                 page_stride, q_nope, q_pe, acc, m_i, l_i, qk_scale,
                 DV: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr, HAS_PE: tl.constexpr,
                 FORMAT: tl.constexpr, CHECK_RANGE: tl.constexpr, DOT_PREC: tl.constexpr):
    """Entries ``[lo, hi)`` of one scope's list folded into the running softmax. With
    ``CHECK_RANGE`` (decode) an entry outside ``[-1, n_rows)`` is a NaN logit, which makes the
    query NaN through the softmax's own NaN path (no state carried for it)."""
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        c_ok = cols < hi
        idx = tl.load(idx_row + cols, mask=c_ok, other=-1)
        valid = c_ok & (idx >= 0) & (idx < n_rows)
        k_nope, k_pe = _gather_rows(Q, KV, KV_F32, KV_BF16, idx, valid, stride_row, page_size,
                                    page_stride, DV, DR, BLOCK_N, BLOCK_DV, BLOCK_DR, HAS_PE,
                                    FORMAT)
        qk = tl.dot(q_nope, tl.trans(k_nope), input_precision=DOT_PREC)
        if HAS_PE:
            qk = tl.dot(q_pe, tl.trans(k_pe), qk, input_precision=DOT_PREC)
        qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))  # log2 domain
        if CHECK_RANGE:
            qk = tl.where((c_ok & ((idx < -1) | (idx >= n_rows)))[None, :], float("nan"), qk)
        acc, m_i, l_i = softmax_pv(qk, m_i, l_i, acc, k_nope, DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def _scope_length(TOPK_LEN, r, topk, HAS_TOPK_LEN: tl.constexpr):
    """``(entries used, whether topk_length[r] lies outside [0, topk])``: the count is
    clamped so that no read leaves the index row; the flag makes the query NaN."""
    n = topk + 0 * r  # a tensor even where Triton specialized topk = 1 to a constant
    bad = n < 0
    if HAS_TOPK_LEN:
        length = tl.load(TOPK_LEN + r)
        bad = (length < 0) | (length > topk)
        n = tl.minimum(tl.maximum(length, 0), topk)
    return n, bad


@triton.jit
def _sink_factor(SINK, heads, h_ok, lse2, seen):
    """``σ(lse − sink)`` per head from the log2-domain ``lse2``: 0 for a ``+inf`` sink, exactly
    1 for ``-inf``, 1 for a query that saw nothing (its out is 0), NaN for a NaN sink."""
    sink = tl.load(SINK + heads, mask=h_ok, other=0.0)
    f = 1.0 / (1.0 + tl.math.exp2(sink * _LOG2E - lse2))
    f = tl.where(seen, f, 1.0)
    return tl.where(sink == sink, f, float("nan"))


@triton.jit
def sparse_kernel(
    Q, KV, KV_F32, KV_BF16, IDX, TOPK_LEN,
    KV2, KV2_F32, KV2_BF16, IDX2, TOPK_LEN2, SINK,
    O, LSE, MAXL, OP, LSEP, MAXP,
    stride_qq, stride_qh, stride_iq, stride_row, page_size, page_stride,
    stride_iq2, stride_row2, page_size2, page_stride2,
    stride_oq, stride_oh, stride_lb, stride_lt, stride_lh, stride_mq, stride_mh,
    n_rows, topk, n_rows2, topk2, qk_scale, num_splits,
    N: tl.constexpr, S: tl.constexpr, GROUPS: tl.constexpr, DV: tl.constexpr,
    DR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr, HAS_PE: tl.constexpr, FORMAT: tl.constexpr,
    HAS_TOPK_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_TOPK_LEN2: tl.constexpr,
    HAS_SINK: tl.constexpr, CHECK_RANGE: tl.constexpr, HAS_MAXL: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, SPLIT_TILES: tl.constexpr,
    SPLIT_CAP: tl.constexpr,
):
    """Grid ``(queries · GROUPS, splits)``: the head groups of one query are neighbours.

    Query ``qi`` is ``(qi // S, qi % S)`` for the lse layout and the ``topk_length`` entries
    (decode: ``S = s_q``, per request; prefill: ``S = 1``, per query). The two scopes' lists
    are one list of tiles (the first scope's, then the second's) cut into ``num_splits`` runs,
    or (``SPLIT_TILES > 0``, the batch-invariant plans) into runs of ``max(SPLIT_TILES,
    ceil(tiles / SPLIT_CAP))`` tiles, a function of the query's own list lengths alone.
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    qi = pid // GROUPS
    g = pid % GROUPS
    qi64 = qi.to(tl.int64)

    heads = g * BLOCK_M + tl.arange(0, BLOCK_M)
    h_ok = heads < N
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    dv_mask = offs_dv < DV
    q_row = Q + qi64 * stride_qq + heads * stride_qh
    q_nope = load_2d(q_row[:, None] + offs_dv[None, :], h_ok, dv_mask, True, BLOCK_DV != DV)
    if HAS_PE:
        q_pe = load_2d(q_row[:, None] + DV + offs_dr[None, :], h_ok, offs_dr < DR, True,
                        BLOCK_DR != DR)
    else:
        q_pe = q_nope  # unused

    # a length outside [0, topk] makes the query NaN, never a guess (and so does a decode
    # entry outside [-1, rows), in _scope_tiles)
    n1, bad = _scope_length(TOPK_LEN, qi // S, topk, HAS_TOPK_LEN)
    tiles1 = tl.cdiv(n1, BLOCK_N)
    n2 = 0
    if HAS_EXTRA:
        n2, bad2 = _scope_length(TOPK_LEN2, qi // S, topk2, HAS_TOPK_LEN2)
        bad = bad | bad2
    tiles = tiles1 + tl.cdiv(n2, BLOCK_N)
    # this program's tiles: an equal share of the whole list, or a run of fixed length
    if SPLIT_TILES > 0:
        per_split = tl.maximum(tl.cdiv(tiles, SPLIT_CAP), SPLIT_TILES)
    else:
        per_split = tl.cdiv(tiles, num_splits)
    t_lo = split * per_split
    t_hi = tl.minimum(t_lo + per_split, tiles)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, m_i, l_i = _scope_tiles(
        Q, KV, KV_F32, KV_BF16, IDX + qi64 * stride_iq, t_lo * BLOCK_N,
        tl.minimum(tl.minimum(t_hi, tiles1) * BLOCK_N, n1), n_rows, stride_row, page_size,
        page_stride, q_nope, q_pe, acc, m_i, l_i, qk_scale, DV, DR, BLOCK_N, BLOCK_DV,
        BLOCK_DR, HAS_PE, FORMAT, CHECK_RANGE, DOT_PREC)
    if HAS_EXTRA:
        acc, m_i, l_i = _scope_tiles(
            Q, KV2, KV2_F32, KV2_BF16, IDX2 + qi64 * stride_iq2,
            tl.maximum(t_lo - tiles1, 0) * BLOCK_N,
            tl.minimum(tl.maximum(t_hi - tiles1, 0) * BLOCK_N, n2), n_rows2, stride_row2,
            page_size2, page_stride2, q_nope, q_pe, acc, m_i, l_i, qk_scale, DV, DR,
            BLOCK_N, BLOCK_DV, BLOCK_DR, HAS_PE, FORMAT, CHECK_RANGE, DOT_PREC)

    seen = l_i != 0.0  # l = 0: nothing seen; a NaN l (a NaN logit) stays NaN, never "nothing"
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse2 = m_i + tl.math.log2(l_safe)
    lse = tl.where(bad, float("nan"), lse2 * _LN2)
    # -inf where nothing was seen; NaN with the lse (tl.max may skip a NaN logit)
    mx = tl.where((l_i == l_i) & ~bad, m_i, float("nan")) * _LN2
    o = tl.where(bad, float("nan"), o)
    if SPLIT:
        # partials [queries, splits, N, DV] and [queries, splits, N]; "nothing" is lse -inf
        part = (qi64 * num_splits + split) * N + heads
        tl.store(LSEP + part, tl.where(seen | bad, lse, float("-inf")), mask=h_ok)
        tl.store(MAXP + part, mx, mask=h_ok)
        tl.store(OP + part[:, None] * DV + offs_dv[None, :], o,
                 mask=(h_ok & seen)[:, None] & dv_mask[None, :])
    else:
        if HAS_SINK:
            o = o * _sink_factor(SINK, heads, h_ok, lse2, seen)[:, None]
        tl.store(O + qi64 * stride_oq + heads[:, None] * stride_oh + offs_dv[None, :],
                 o.to(O.dtype.element_ty), mask=h_ok[:, None] & dv_mask[None, :])
        tl.store(LSE + (qi64 // S) * stride_lb + (qi64 % S) * stride_lt + heads * stride_lh,
                 tl.where(seen | bad, lse, float("inf")), mask=h_ok)
        if HAS_MAXL:
            tl.store(MAXL + qi64 * stride_mq + heads * stride_mh, mx, mask=h_ok)


@triton.jit
def combine_kernel(
    OP, LSEP, MAXP, SINK, O, LSE, MAXL, num_splits,
    stride_oq, stride_oh, stride_lb, stride_lt, stride_lh, stride_mq, stride_mh,
    N: tl.constexpr, S: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr, HAS_SINK: tl.constexpr, HAS_MAXL: tl.constexpr,
    ORDERED: tl.constexpr,
):
    """Grid ``(queries · N,)``: merge one (query, head)'s partials by their lse (conventions
    §6), then apply the sink once, to the whole. ``ORDERED`` (fixed-length splits): the max
    and the sum of the weights in a sequential loop in split order, so that trailing empty
    splits add exact zeros and a row's bits do not depend on the grid's number of splits (a
    ``tl.sum`` over a padded power-of-two block may pair its elements otherwise when the
    block's size changes; ``mla.fast.decode.combine``)."""
    r = tl.program_id(0).to(tl.int64)
    qi = r // N
    h = r % N
    offs_s = tl.arange(0, BLOCK_S)
    part = (qi * num_splits + offs_s) * N + h
    s_ok = offs_s < num_splits
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    if ORDERED:
        m = tl.load(LSEP + qi * num_splits * N + h)
        for s in range(1, num_splits):
            m = tl.maximum(m, tl.load(LSEP + (qi * num_splits + s) * N + h))
        m_use = tl.where(m == float("-inf"), 0.0, m)
        w_sum = tl.zeros_like(m)
        for s in range(num_splits):
            p = (qi * num_splits + s) * N + h
            lse_s = tl.load(LSEP + p)
            w = tl.exp(lse_s - m_use)
            w_sum += w  # in split order; a NaN partial lse: NaN
            if lse_s > float("-inf"):  # an empty split wrote no o
                o_s = tl.load(OP + p * DV + offs_dv, mask=dv_mask, other=0.0)
                acc += w * o_s
    else:
        lses = tl.load(LSEP + part, mask=s_ok, other=float("-inf"))
        m = tl.max(lses, 0)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        w_sum = tl.sum(tl.exp(lses - m_use), 0)
        for s in range(num_splits):
            p = (qi * num_splits + s) * N + h
            lse_s = tl.load(LSEP + p)
            if lse_s > float("-inf"):  # an empty split wrote no o
                o_s = tl.load(OP + p * DV + offs_dv, mask=dv_mask, other=0.0)
                acc += tl.exp(lse_s - m_use) * o_s
    seen = w_sum != 0.0  # a NaN partial lse makes w_sum NaN: NaN out, not "nothing"
    o = acc / tl.where(seen, w_sum, 1.0)
    lse = m_use + tl.log(tl.where(seen, w_sum, 1.0))
    if HAS_SINK:
        o = o * _sink_factor(SINK, h, h < N, lse * _LOG2E, seen)
    tl.store(O + qi * stride_oq + h * stride_oh + offs_dv, o.to(O.dtype.element_ty),
             mask=dv_mask)
    tl.store(LSE + (qi // S) * stride_lb + (qi % S) * stride_lt + h * stride_lh,
             tl.where(seen, lse, float("inf")))
    if HAS_MAXL:
        mx = tl.max(tl.load(MAXP + part, mask=s_ok, other=float("-inf")), 0)
        mx = tl.where(w_sum == w_sum, mx, float("nan"))  # NaN with the lse
        tl.store(MAXL + qi * stride_mq + h * stride_mh, mx)
