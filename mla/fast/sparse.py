"""Sparse top-k MLA in Triton: ``mla.reference.sparse``'s ``sparse_mla_decode`` and
``sparse_mla_prefill``, fast (DeepSeek-V3.2's DSA; FlashMLA's ``flash_mla_with_kvcache`` with
indices and ``flash_mla_sparse_fwd``).

Same signatures, shapes and conventions as the reference (conventions §10 and §12): per query,

    s_j        = sm_scale · q · kv[indices[j]]          j < topk_length, index valid
    max_logits = max_j s_j
    lse        = log Σ_j exp(s_j)
    out        = Σ_j exp(s_j - lse) · kv[indices[j], :d_v]

a repeated index counts once per appearance; a lonely query (no valid index) gets ``out = 0``,
``lse = +inf``, ``max_logits = -inf``.

How (docs/kernels.md, "Sparse"):

- One program takes all heads of one query (up to ``BLOCK_M = 64`` of them) as the M dimension
  of its dots: the query's ``topk`` rows are gathered once per head group (128 heads: two
  neighbouring programs, the second gather mostly hits L2) and serve every head.
- The ``topk`` list is walked in tiles of ``BLOCK_N`` entries: load the indices, gather those
  cache rows by index (int64 row offsets: ``n_slots · 656`` bytes passes 2^31 at 3.3M slots),
  ``qk = q_nope · k_nopeᵀ + q_pe · k_peᵀ``, online softmax in base 2, ``acc += p · k_nope``.
  K and V are the same rows: the gathered ``k_nope`` tile is V. Invalid entries (``-1``, or at
  least the number of rows, or past ``topk_length``) load zeros and get ``-inf`` logits.
- ``fp8_ds_mla`` cache (656-byte rows): the kernel loads the 512 e4m3 bytes, bitcasts them to
  ``float8e4nv``, converts to float32 and multiplies by the row's four float32 scales (one per
  128 values; a power of two, so the product is exact in bf16), and loads the 64 bf16 rope
  values as they are; the dequantized tile goes straight into the dots in q's dtype. The cache
  is read through uint8, float32 and bfloat16 views of the same bytes (656 = 4 · 164).
- Split-``topk`` (Flash-Decoding): when ``queries × head groups`` is below the SMs' worth of
  programs, each query's list is cut into ``num_splits`` runs of whole tiles; partial
  ``(o, lse, max)`` go to float32 scratch and a second kernel merges them by lse (conventions §6).
  ``num_splits`` comes from shapes only, so a call never synchronizes (CUDA graphs).

``convert_req_index_to_global_index``: the indexer's request-local top-k positions to the cache
slots these kernels read, as ``mla.reference.sparse``'s (conventions §10; vLLM 0.14's
``triton_convert_req_index_to_global_index``). One program converts ``BLOCK_N`` indices of one
token: a load of the indices, a gather of at most ``BLOCK_N / bs + 1`` distinct block-table
entries (cached), a store.

Validation: shape/dtype/device checks (host metadata) always run. The value checks read device
tensors on the host (a sync): ``topk_length``'s range, for decode the indices' range
``[-1, num_slots)``, for the conversion the ranges of ``req_id`` and the workspace ids. They run
with ``validate=True`` or, by default (``None``), when no CUDA graph is being captured. Without
them the kernels still never read outside their tensors: an index outside ``[0, rows)`` is
masked (as the prefill's contract says), ``topk_length`` is clamped to ``[0, topk]``, and a
token whose request or workspace entry is out of range converts to ``-1`` everywhere.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from mla.fast import sm90
from mla.fast.common import (
    LOG2E,
    check_kernel_input,
    interpreting,
    next_pow2,
    num_sms,
    should_validate,
)
from mla.fast.softmax import load_2d, softmax_pv
from mla.reference.fp8 import D_NOPE, D_ROPE, FP8_DS_MLA_BYTES, NUM_TILES, ROPE_OFFSET, TILE
from mla.reference.sparse import (
    _check_topk_length_values,
    check_index_conversion_shapes,
    check_index_conversion_values,
    check_sparse_decode_shapes,
    check_sparse_decode_values,
    check_sparse_prefill_shapes,
)

__all__ = ["SparsePlan", "convert_req_index_to_global_index", "plan_sparse",
           "sparse_mla_decode", "sparse_mla_prefill"]


@dataclasses.dataclass(frozen=True)
class SparsePlan:
    """Launch parameters of one sparse call, chosen from shapes alone (no device values)."""

    block_m: int  # heads per program: the M of the dots
    block_n: int  # top-k entries (gathered rows) per tile
    num_splits: int  # programs per query along its top-k list (1: no combine kernel)
    num_warps: int
    num_stages: int
    # 64-head programs on Hopper: the Gluon kernel of ``mla.fast.sm90.sparse`` where it
    # applies (its own 64-entry tiles and 8 warps; the other fields then describe only the
    # Triton fallback)
    sm90: bool = True


def plan_sparse(queries: int, num_heads: int, topk: int, dtype: torch.dtype, fp8: bool,
                num_sms: int) -> SparsePlan:
    """The default plan from shapes: ``queries`` is ``B · s_q`` (decode) or ``s_q`` (prefill).

    - Heads: one program holds ``min(64, N)`` heads (rounded up to a power of two, at least
      16, the smallest dot); a 64 × 512 float32 accumulator takes half the register file.
    - Tiles of 64 gathered rows, two pipeline stages: the row gathers become ``cp.async``
      copies into shared memory. float32 (a correctness path on a GPU, not a fast one): tiles
      of 16, one stage, else the tiles overflow the 227 KB of shared memory.
    - Warps: 8, except 16-head programs over a 16-bit cache (4): the fewest warps that
      compile without spills (fp8 with 4 warps spills: ``python -m benchmarks.sparse_compile``
      reads it off ptxas without a GPU; benchmarks/NOTES.md). So one 64-head program per SM,
      two of the 16-head bf16 ones.
    - Splits only when the grid is short of the SMs' worth of programs, each split keeping at
      least two tiles of ``topk``.
    """
    block_m = min(64, max(16, next_pow2(num_heads)))
    num_warps, per_sm = (4, 2) if block_m == 16 and not fp8 else (8, 1)
    block_n, num_stages = (16, 1) if dtype == torch.float32 else (64, 2)
    if dtype == torch.float32:
        num_warps = 8
    groups = -(-num_heads // block_m)
    tiles = max(1, -(-topk // block_n))
    base = max(1, queries * groups)
    target = per_sm * num_sms
    splits = 1
    if base < target:
        splits = max(1, min(round(target / base), tiles // 2, 64))
        splits = -(-tiles // -(-tiles // splits))  # no empty trailing splits at full topk
    return SparsePlan(block_m=block_m, block_n=block_n, num_splits=splits,
                      num_warps=num_warps, num_stages=num_stages)


@triton.jit
def _gather_rows(Q, KV, KV_F32, KV_BF16, idx, valid, stride_row,
                 DV: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr, HAS_PE: tl.constexpr,
                 FP8: tl.constexpr,
                 ROW_BYTES: tl.constexpr, NUM_TILES: tl.constexpr, TILE: tl.constexpr,
                 ROPE_OFFSET: tl.constexpr):
    """The ``BLOCK_N`` cache rows named by ``idx`` as ``(k_nope [BLOCK_N, BLOCK_DV],
    k_pe [BLOCK_N, BLOCK_DR])`` in q's dtype (the dots'); rows where ``valid`` is False are
    zeros (no load, so a poisoned or absent row cannot leak in)."""
    row = idx.to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    if FP8:
        # bytes [0, 512): e4m3; floats [128, 132): the inverse scales; bf16 [264, 328): k_pe
        # the e4m3 bytes as [rows, tile, 128] so each tile's scale broadcasts over its 128
        # values (a [rows, 512] scale gather would cost a load per element)
        offs_t = tl.arange(0, NUM_TILES)
        offs_c = tl.arange(0, TILE)
        cols = offs_t[:, None] * TILE + offs_c[None, :]  # [NUM_TILES, TILE]
        raw = tl.load(KV + (row * ROW_BYTES)[:, None, None] + cols[None, :, :],
                      mask=valid[:, None, None], other=0)
        scale = tl.load(KV_F32 + (row * (ROW_BYTES // 4) + DV // 4)[:, None]
                        + offs_t[None, :], mask=valid[:, None], other=0.0)
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
        k_nope = tl.reshape(x, (BLOCK_N, BLOCK_DV)).to(Q.dtype.element_ty)
        k_pe = tl.load(KV_BF16 + (row * (ROW_BYTES // 2) + ROPE_OFFSET // 2)[:, None]
                       + offs_dr[None, :], mask=valid[:, None], other=0.0).to(Q.dtype.element_ty)
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
def _sparse_kernel(
    Q, KV, KV_F32, KV_BF16, IDX, TOPK_LEN, O, LSE, MAXL, OP, LSEP, MAXP,
    stride_qq, stride_qh, stride_iq, stride_row,
    stride_oq, stride_oh, stride_lb, stride_lt, stride_lh, stride_mq, stride_mh,
    n_rows, topk, qk_scale, num_splits,
    N: tl.constexpr, S: tl.constexpr, GROUPS: tl.constexpr, DV: tl.constexpr,
    DR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr, HAS_PE: tl.constexpr, FP8: tl.constexpr,
    HAS_TOPK_LEN: tl.constexpr, HAS_MAXL: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
    ROW_BYTES: tl.constexpr, NUM_TILES: tl.constexpr, TILE: tl.constexpr,
    ROPE_OFFSET: tl.constexpr,
):
    """Grid ``(queries · GROUPS, splits)``: the head groups of one query are neighbours.

    Query ``qi`` is ``(qi // S, qi % S)`` for the lse layout and the ``topk_length`` entry
    (decode: ``S = s_q``, per request; prefill: ``S = 1``, per query)."""
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

    # this program's entries: an equal share of whole tiles of the query's list
    n = topk
    if HAS_TOPK_LEN:
        n = tl.minimum(tl.maximum(tl.load(TOPK_LEN + qi // S), 0), topk)
    n_tiles = tl.cdiv(n, BLOCK_N)
    per_split = tl.cdiv(n_tiles, num_splits)
    lo = split * per_split * BLOCK_N
    hi = tl.minimum(lo + per_split * BLOCK_N, n)
    idx_row = IDX + qi64 * stride_iq

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        c_ok = cols < hi
        idx = tl.load(idx_row + cols, mask=c_ok, other=-1)
        valid = c_ok & (idx >= 0) & (idx < n_rows)
        k_nope, k_pe = _gather_rows(Q, KV, KV_F32, KV_BF16, idx, valid, stride_row, DV, DR,
                                    BLOCK_N, BLOCK_DV, BLOCK_DR, HAS_PE, FP8, ROW_BYTES,
                                    NUM_TILES, TILE, ROPE_OFFSET)
        qk = tl.dot(q_nope, tl.trans(k_nope), input_precision=DOT_PREC)
        if HAS_PE:
            qk = tl.dot(q_pe, tl.trans(k_pe), qk, input_precision=DOT_PREC)
        qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))  # log2 domain
        acc, m_i, l_i = softmax_pv(qk, m_i, l_i, acc, k_nope, DOT_PREC)

    seen = l_i != 0.0  # l = 0: nothing seen; a NaN l (a NaN logit) stays NaN, never "nothing"
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453
    # -inf where nothing was seen; NaN with the lse (tl.max may skip a NaN logit)
    mx = tl.where(l_i == l_i, m_i, float("nan")) * 0.6931471805599453
    if SPLIT:
        # partials [queries, splits, N, DV] and [queries, splits, N]; "nothing" is lse -inf
        part = (qi64 * num_splits + split) * N + heads
        tl.store(LSEP + part, tl.where(seen, lse, float("-inf")), mask=h_ok)
        tl.store(MAXP + part, mx, mask=h_ok)
        tl.store(OP + part[:, None] * DV + offs_dv[None, :], o,
                 mask=(h_ok & seen)[:, None] & dv_mask[None, :])
    else:
        tl.store(O + qi64 * stride_oq + heads[:, None] * stride_oh + offs_dv[None, :],
                 o.to(O.dtype.element_ty), mask=h_ok[:, None] & dv_mask[None, :])
        tl.store(LSE + (qi64 // S) * stride_lb + (qi64 % S) * stride_lt + heads * stride_lh,
                 tl.where(seen, lse, float("inf")), mask=h_ok)
        if HAS_MAXL:
            tl.store(MAXL + qi64 * stride_mq + heads * stride_mh, mx, mask=h_ok)


@triton.jit
def _combine_kernel(
    OP, LSEP, MAXP, O, LSE, MAXL, num_splits,
    stride_oq, stride_oh, stride_lb, stride_lt, stride_lh, stride_mq, stride_mh,
    N: tl.constexpr, S: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr, HAS_MAXL: tl.constexpr,
):
    """Grid ``(queries · N,)``: merge one (query, head)'s partials by their lse (conventions §6)."""
    r = tl.program_id(0).to(tl.int64)
    qi = r // N
    h = r % N
    offs_s = tl.arange(0, BLOCK_S)
    part = (qi * num_splits + offs_s) * N + h
    s_ok = offs_s < num_splits
    lses = tl.load(LSEP + part, mask=s_ok, other=float("-inf"))
    m = tl.max(lses, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w_sum = tl.sum(tl.exp(lses - m_use), 0)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s in range(num_splits):
        p = (qi * num_splits + s) * N + h
        lse_s = tl.load(LSEP + p)
        if lse_s > float("-inf"):  # an empty split wrote no o
            o_s = tl.load(OP + p * DV + offs_dv, mask=dv_mask, other=0.0)
            acc += tl.exp(lse_s - m_use) * o_s
    seen = w_sum != 0.0  # a NaN partial lse makes w_sum NaN: NaN out, not "nothing"
    o = acc / tl.where(seen, w_sum, 1.0)
    tl.store(O + qi * stride_oq + h * stride_oh + offs_dv, o.to(O.dtype.element_ty),
             mask=dv_mask)
    tl.store(LSE + (qi // S) * stride_lb + (qi % S) * stride_lt + h * stride_lh,
             tl.where(seen, m_use + tl.log(tl.where(seen, w_sum, 1.0)), float("inf")))
    if HAS_MAXL:
        mx = tl.max(tl.load(MAXP + part, mask=s_ok, other=float("-inf")), 0)
        mx = tl.where(w_sum == w_sum, mx, float("nan"))  # NaN with the lse
        tl.store(MAXL + qi * stride_mq + h * stride_mh, mx)


def _launch(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor,
            topk_length: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
            lse_strides: tuple[int, int, int], S: int, max_logits: torch.Tensor | None,
            sm_scale: float, dv: int, fp8: bool, plan: SparsePlan | None) -> None:
    """``q [Q, N, D]``, ``kv [rows, D]`` (or ``[rows, 656]`` uint8 with ``fp8``),
    ``idx [Q, topk]`` into ``out [Q, N, dv]``, ``lse`` (strides ``lse_strides`` for
    ``(qi // S, qi % S, head)``) and, when given, ``max_logits [Q, N]``."""
    Q, N, D = q.shape
    topk = idx.shape[1]
    if topk_length is not None:
        topk_length = topk_length.contiguous()
    if plan is None:
        plan = plan_sparse(Q, N, topk, q.dtype, fp8, num_sms(q.device))
    DV, DR = dv, D - dv
    block_dv = max(16, next_pow2(DV))
    block_dr = max(16, next_pow2(DR)) if DR else 16
    if fp8:
        kv_f32, kv_bf16 = kv.view(torch.float32), kv.view(torch.bfloat16)
    else:
        kv_f32 = kv_bf16 = kv  # unused
    groups = triton.cdiv(N, plan.block_m)
    split = plan.num_splits > 1
    if split:
        o_part = torch.empty(Q, plan.num_splits, N, DV, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(Q, plan.num_splits, N, dtype=torch.float32, device=q.device)
        max_part = torch.empty(Q, plan.num_splits, N, dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = max_part = lse  # unused
    has_maxl = max_logits is not None
    maxl = max_logits if has_maxl else lse
    m_strides = (maxl.stride(0), maxl.stride(1)) if has_maxl else (0, 0)
    launched = False
    if _sm90_route(plan, q, kv, dv, fp8):
        from mla.fast.sm90.sparse import sparse_kernel

        launched = sm90.launch(
            sparse_kernel, (Q * groups, plan.num_splits),
            q, kv, idx, topk_length if topk_length is not None else idx,
            out, lse, maxl, o_part, lse_part, max_part,
            q.stride(0), q.stride(1), idx.stride(0), kv.stride(0),
            out.stride(0), out.stride(1), *lse_strides, *m_strides,
            kv.shape[0], topk, sm_scale * LOG2E, plan.num_splits,
            N=N, S=S, GROUPS=groups, FP8=fp8, HAS_TOPK_LEN=topk_length is not None,
            HAS_MAXL=has_maxl, SPLIT=split, SCALE_OFFSET=DV if fp8 else 0,
            ROPE_OFFSET=ROPE_OFFSET, num_warps=8,
        )
    if not launched:
        _sparse_kernel[(Q * groups, plan.num_splits)](
            q, kv, kv_f32, kv_bf16, idx, topk_length if topk_length is not None else idx,
            out, lse, maxl, o_part, lse_part, max_part,
            q.stride(0), q.stride(1), idx.stride(0), kv.stride(0),
            out.stride(0), out.stride(1), *lse_strides, *m_strides,
            kv.shape[0], topk, sm_scale * LOG2E, plan.num_splits,
            N=N, S=S, GROUPS=groups, DV=DV, DR=DR, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
            BLOCK_DV=block_dv, BLOCK_DR=block_dr, HAS_PE=DR > 0, FP8=fp8,
            HAS_TOPK_LEN=topk_length is not None,
            HAS_MAXL=has_maxl, SPLIT=split,
            DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
            ROW_BYTES=FP8_DS_MLA_BYTES, NUM_TILES=NUM_TILES, TILE=TILE, ROPE_OFFSET=ROPE_OFFSET,
            num_warps=plan.num_warps, num_stages=plan.num_stages,
        )
    if split:
        _combine_kernel[(Q * N,)](
            o_part, lse_part, max_part, out, lse, maxl, plan.num_splits,
            out.stride(0), out.stride(1), *lse_strides, *m_strides,
            N=N, S=S, DV=DV, BLOCK_DV=block_dv, BLOCK_S=max(2, next_pow2(plan.num_splits)),
            HAS_MAXL=has_maxl, num_warps=4,
        )


def _sm90_route(plan: SparsePlan, q: torch.Tensor, kv: torch.Tensor, dv: int,
                fp8: bool) -> bool:
    """Whether this call goes to the Gluon sm_90 kernel (``mla.fast.sm90.sparse``): a plan
    that allows it, on a Hopper GPU whose Triton can build the Gluon kernels."""
    if not plan.sm90 or q.device.type != "cuda" or interpreting() or not sm90.usable():
        return False
    from mla.fast.sm90.sparse import supported

    return supported(q, kv, dv, fp8, plan.block_m)


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    is_fp8_kvcache: bool,
    topk_length: torch.Tensor | None = None,
    head_dim_v: int = 512,
    *,
    validate: bool | None = None,
    plan: SparsePlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode of ``q [B, s_q, N, D]`` over the paged cache, rows named by
    ``indices [B, s_q, topk]`` (global slots ``block · block_size + offset``, ``-1`` for none).

    ``kv_cache [nb, bs, D]`` in q's dtype, or ``[nb, bs, 656]`` uint8 ``fp8_ds_mla`` rows with
    ``is_fp8_kvcache`` (``[nb, bs, 1, ·]`` accepted too); ``topk_length [B]`` int32. Returns
    ``out [B, s_q, N, head_dim_v]`` (q's dtype) and ``lse [B, N, s_q]`` float32, ``+inf`` for a
    lonely query, as ``mla.reference.sparse_mla_decode``.

    ``validate``: check ``indices`` and ``topk_length`` ranges on the host (a sync); ``None``:
    only when no CUDA graph is being captured. ``plan``: default ``plan_sparse(...)``.
    """
    check_sparse_decode_shapes(q, kv_cache, indices, softmax_scale, is_fp8_kvcache,
                               topk_length, head_dim_v)
    check_kernel_input(q)
    if should_validate(validate, q):
        check_sparse_decode_values(kv_cache, indices, topk_length)
    B, s_q, N, D = q.shape
    n_slots = kv_cache.shape[0] * kv_cache.shape[1]
    out = torch.empty(B, s_q, N, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, N, s_q, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if is_fp8_kvcache:
        kv = kv_cache.view(torch.uint8).reshape(n_slots, FP8_DS_MLA_BYTES).contiguous()
        if D != D_NOPE + D_ROPE:  # the shape checks guarantee it
            raise AssertionError(D)
    else:
        kv = _unit_stride(kv_cache.reshape(n_slots, D))
    Q = B * s_q
    q_flat = _unit_stride(q.reshape(Q, N, D))
    idx = _unit_stride(indices.reshape(Q, indices.shape[2]))
    _launch(q_flat, kv, idx, topk_length, out.view(Q, N, head_dim_v), lse,
            (lse.stride(0), lse.stride(2), lse.stride(1)), s_q, None, softmax_scale,
            head_dim_v, is_fp8_kvcache, plan)
    return out, lse


def sparse_mla_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    *,
    validate: bool | None = None,
    plan: SparsePlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill: ``q [s_q, h_q, d_qk]`` over ``kv [s_kv, d_qk]`` (or ``[s_kv, 1, d_qk]``),
    rows named by ``indices [s_q, topk]`` (or ``[s_q, 1, topk]``), ``topk_length [s_q]``.

    Returns ``out [s_q, h_q, d_v]`` (q's dtype), ``max_logits [s_q, h_q]`` and
    ``lse [s_q, h_q]`` (float32), as ``mla.reference.sparse_mla_prefill``: indices ``< 0`` or
    ``>= s_kv`` are masked; a lonely query gets ``out = 0``, ``lse = +inf``,
    ``max_logits = -inf``. ``validate``: check ``topk_length``'s range on the host (a sync);
    ``None``: only when no CUDA graph is being captured.
    """
    check_sparse_prefill_shapes(q, kv, indices, sm_scale, d_v, topk_length)
    check_kernel_input(q)
    s_q, h_q, d_qk = q.shape
    topk = indices.shape[-1]
    if should_validate(validate, q):
        _check_topk_length_values(topk_length, topk, "one per query")
    out = torch.empty(s_q, h_q, d_v, dtype=q.dtype, device=q.device)
    max_logits = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    lse = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, max_logits, lse
    kv = _unit_stride(kv.reshape(kv.shape[0], d_qk))
    idx = _unit_stride(indices.reshape(s_q, topk))
    _launch(_unit_stride(q), kv, idx, topk_length, out, lse, (lse.stride(0), 0, lse.stride(1)),
            1, max_logits, sm_scale, d_v, False, plan)
    return out, max_logits, lse


# ------------------------------------------------------------------ top-k index conversion

@triton.jit
def _convert_kernel(
    req_id, block_table, token_indices, out, ws_req, ws_starts,
    topk, num_reqs, max_blocks, num_prefills,
    s_bt_r, s_bt_b, s_ti_t, s_ti_k,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WORKSPACE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < topk
    req = tl.load(req_id + t).to(tl.int64)
    req_ok = (req >= 0) & (req < num_reqs)
    tok = tl.load(token_indices + t * s_ti_t + cols * s_ti_k, mask=col_ok, other=-1)
    tok = tok.to(tl.int64)
    block = tok // BLOCK_SIZE  # tok >= 0 wherever the result is used
    invalid = (tok < 0) | (block >= max_blocks) | ~req_ok
    use_table = col_ok & ~invalid
    if HAS_WORKSPACE:
        p = tl.load(ws_req + t).to(tl.int64)
        invalid = invalid | (p >= num_prefills) | (p < -1)
        use_table = use_table & (p < 0)  # prefill tokens read the workspace, not the table
    base = tl.load(block_table + req * s_bt_r + block * s_bt_b, mask=use_table,
                   other=0).to(tl.int64)
    slot = base * BLOCK_SIZE + tok % BLOCK_SIZE
    if HAS_WORKSPACE:
        start = tl.load(ws_starts + p, mask=(p >= 0) & (p < num_prefills), other=0).to(tl.int64)
        slot = tl.where(p >= 0, start + tok, slot)
    slot = tl.where(invalid, -1, slot)
    tl.store(out + t * topk + cols, slot.to(tl.int32), mask=col_ok)


def convert_req_index_to_global_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    block_size: int,
    prefill_workspace_request_ids: torch.Tensor | None = None,
    prefill_workspace_starts: torch.Tensor | None = None,
    *,
    validate: bool | None = None,
) -> torch.Tensor:
    """Request-local ``token_indices [T, topk]`` -> global cache slots (or workspace rows).

    As the reference (all int32; returns int32 ``[T, topk]``). ``validate``: run the range
    checks on the host (a sync); ``None``: only when no CUDA graph is being captured.
    """
    has_workspace = check_index_conversion_shapes(
        req_id, block_table, token_indices, block_size, prefill_workspace_request_ids,
        prefill_workspace_starts)
    T = req_id.shape[0]
    topk = token_indices.shape[1]
    out = torch.empty((T, topk), dtype=torch.int32, device=token_indices.device)
    if T == 0 or topk == 0:
        return out
    if should_validate(validate, token_indices):
        check_index_conversion_values(req_id, block_table, prefill_workspace_request_ids,
                                      prefill_workspace_starts)
    block_n = min(triton.next_power_of_2(topk), 512)
    ws_req = prefill_workspace_request_ids if has_workspace else req_id
    ws_starts = prefill_workspace_starts if has_workspace else req_id
    num_prefills = prefill_workspace_starts.shape[0] if has_workspace else 0
    _convert_kernel[(T, triton.cdiv(topk, block_n))](
        req_id, block_table, token_indices, out, ws_req, ws_starts,
        topk, block_table.shape[0], block_table.shape[1], num_prefills,
        *block_table.stride(), *token_indices.stride(),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, HAS_WORKSPACE=has_workspace, num_warps=4,
    )
    return out
