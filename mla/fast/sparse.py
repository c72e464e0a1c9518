"""Sparse top-k MLA in Triton: ``mla.reference.sparse``'s ``sparse_mla_decode`` and
``sparse_mla_prefill``, fast (DeepSeek-V3.2's DSA; FlashMLA's ``flash_mla_with_kvcache`` with
indices and ``flash_mla_sparse_fwd``).

Same signatures, shapes and conventions as the reference (conventions §10 and §12): per query,

    s_j        = sm_scale · q · kv[indices[j]]          j < topk_length, index valid
    max_logits = max_j s_j
    lse        = log Σ_j exp(s_j)
    out        = Σ_j exp(s_j - lse) · kv[indices[j], :d_v]

a repeated index counts once per appearance; a lonely query (no valid index) gets ``out = 0``,
``lse = +inf``, ``max_logits = -inf``. DeepSeek-V4's conventions (§14) too: ``attn_sink``
(decode and prefill), the MODEL1 cache, a second KV scope (decode), rows of ``d_qk = 512``
with V the whole row, ``topk_length`` on every path.

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
- MODEL1 pages (DeepSeek-V4): the page is found by the block stride, the token's 576-byte
  data row and its 7 UE8M0 scale bytes inside it (``mla.fast.sparse_kernels``); the row is
  read as 8 tiles of 64 (7 scaled e4m3 tiles, then the bf16 rope tile) into one 512-wide K
  that is also V.
- A second KV scope (``extra_k_cache``): the kernel walks the second list after the first,
  in the same online softmax (the same ``(m, l, acc)``), with its own cache, page layout,
  indices and ``extra_topk_length``; the splits cut the two lists as one list of tiles.
- ``attn_sink``: applied once, where the softmax ends: in the kernel's epilogue, or, with
  splits, in the combine kernel after the merge (never per split: it would count twice).
  The output is multiplied by ``1 / (1 + 2^(sink·log2 e − lse₂))`` in float32 (``lse₂`` the
  base-2 lse), which is ``σ(lse − sink)``: exactly 1 for ``-inf``, 0 for ``+inf``, NaN for
  NaN; ``lse`` and ``max_logits`` are left alone.
- Split-``topk`` (Flash-Decoding): when ``queries × head groups`` is below the SMs' worth of
  programs, each query's list is cut into ``num_splits`` runs of whole tiles; partial
  ``(o, lse, max)`` go to float32 scratch and a second kernel merges them by lse (conventions §6).
  ``num_splits`` comes from shapes only, so a call never synchronizes (CUDA graphs).
- The Gluon sm_90 kernel (``mla.fast.sm90.sparse``) takes the 64-head programs over
  DeepSeek-V3.2's rows (bf16/fp16 or ``fp8_ds_mla``), DeepSeek-V4's rows of 512 (in q's
  dtype, or MODEL1 pages with bf16 q), one or two scopes, sinks included.

``convert_req_index_to_global_index``: the indexer's request-local top-k positions to the cache
slots these kernels read, as ``mla.reference.sparse``'s (conventions §10; vLLM 0.14's
``triton_convert_req_index_to_global_index``). One program converts ``BLOCK_N`` indices of one
token: a load of the indices, a gather of at most ``BLOCK_N / bs + 1`` distinct block-table
entries (cached), a store.

Validation: shape/dtype/device checks (host metadata) always run. The value checks read device
tensors on the host (a sync): ``topk_length``'s range, for decode the indices' range
``[-1, num_slots)`` (both scopes), for the conversion the ranges of ``req_id`` and the
workspace ids. They run with ``validate=True``, or with ``validate=None`` when the global
setting is on (``mla.fast.set_validation``; off by default), never while a CUDA graph is being
captured. Without them the kernels still never read outside their tensors and never return a
plausible wrong answer:

- a query whose ``topk_length`` (or ``extra_topk_length``) lies outside ``[0, topk]`` gets NaN
  ``out``, ``lse`` and ``max_logits`` (its reads stay inside the index row);
- decode: a query that uses an entry (before its length) outside ``[-1, num_slots)`` of its
  scope gets NaN ``out`` and ``lse``: the entry is a NaN logit, its row is never read. Entries
  past a query's length are not read at all, so their values do not matter;
- prefill: an index outside ``[0, s_kv)`` is simply invalid, as the reference's contract says
  (dropped, like ``-1``);
- the conversion: a token whose request or workspace entry is out of range converts to ``-1``
  everywhere.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from mla.fast import sm90
from mla.fast.common import (
    LOG2E,
    TRITON_VERSION,
    check_kernel_input,
    interpreting,
    next_pow2,
    num_sms,
    should_validate,
)
from mla.fast.sparse_kernels import DS_MLA, MODEL1, PLAIN, combine_kernel, sparse_kernel
from mla.reference.fp8 import D_NOPE, FP8_DS_MLA_BYTES, ROPE_OFFSET
from mla.reference.fp8_model1 import FP8_MODEL1_BYTES, fp8_model1_pages
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
                num_sms: int, *, model1: bool = False) -> SparsePlan:
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
    - MODEL1 (``model1``) under 64 heads: 16-head programs with tiles of 32 (the 8-tile rows
      of 64 gathered rows need 246 KB of shared memory at 16 heads and 262 KB at 32; tiles of
      32 at 16 heads: 131 KB, no spill; 64-head programs go to the Gluon kernel).
    - Splits only when the grid is short of the SMs' worth of programs, each split keeping at
      least two tiles of ``topk``.
    """
    block_m = min(64, max(16, next_pow2(num_heads)))
    if model1 and block_m < 64:
        block_m = 16
    # 4 warps compile without spills under Triton 3.6 (239-248 registers, sm_90 ptxas); 3.7
    # spills 224-272 bytes there, so 8 warps (175 registers) under it
    four = block_m == 16 and not fp8 and TRITON_VERSION < (3, 7)
    num_warps, per_sm = (4, 2) if four else (8, 1)
    block_n, num_stages = (16, 1) if dtype == torch.float32 else (64, 2)
    if model1 and block_m < 64 and dtype != torch.float32:
        block_n = 32
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


@dataclasses.dataclass(frozen=True)
class _Scope:
    """One KV scope as the kernel reads it: the cache (and its float32 / bfloat16 views for
    the fp8 formats), the index rows ``[Q, topk]``, the lengths, the rows' count and layout."""

    kv: torch.Tensor
    kv_f32: torch.Tensor
    kv_bf16: torch.Tensor
    idx: torch.Tensor
    topk_length: torch.Tensor | None
    n_rows: int
    stride_row: int = 0  # PLAIN: elements per row
    page_size: int = 1  # MODEL1: tokens per page
    page_stride: int = 0  # MODEL1: bytes from one page to the next

    def args(self) -> tuple:
        return (self.kv, self.kv_f32, self.kv_bf16, self.idx,
                self.topk_length if self.topk_length is not None else self.idx)


def _plain_scope(kv: torch.Tensor, idx: torch.Tensor,
                 topk_length: torch.Tensor | None) -> _Scope:
    """``kv [rows, D]`` with unit column stride."""
    return _Scope(kv, kv, kv, idx, _contiguous(topk_length), kv.shape[0], kv.stride(0))


def _decode_scope(name: str, kv_cache: torch.Tensor, indices: torch.Tensor,
                  topk_length: torch.Tensor | None, fp8: bool) -> tuple[_Scope, int]:
    """A decode cache and its ``indices [B, s_q, topk]`` as a ``_Scope`` and its ``FORMAT``."""
    nb, bs = kv_cache.shape[:2]
    n_slots = nb * bs
    idx = _unit_stride(indices.reshape(-1, indices.shape[2]))
    lens = _contiguous(topk_length)
    if fp8 and kv_cache.shape[-1] == FP8_MODEL1_BYTES:
        pages = fp8_model1_pages(kv_cache, name=name)
        if pages.data_ptr() % 2 or (nb > 1 and pages.stride(0) % 2):
            raise ValueError(f"{name}'s MODEL1 pages must start at even byte addresses (their "
                             f"bf16 rope values are read as bf16), got block stride "
                             f"{pages.stride(0)} at address {pages.data_ptr()}")
        return _Scope(pages, pages, pages.view(torch.bfloat16), idx, lens, n_slots,
                      page_size=bs, page_stride=pages.stride(0) if nb > 1 else 0), MODEL1
    if fp8:
        kv = kv_cache.view(torch.uint8).reshape(n_slots, FP8_DS_MLA_BYTES).contiguous()
        return _Scope(kv, kv.view(torch.float32), kv.view(torch.bfloat16), idx, lens,
                      n_slots), DS_MLA
    kv = _unit_stride(kv_cache.reshape(n_slots, kv_cache.shape[-1]))
    return _plain_scope(kv, idx, lens), PLAIN


def _launch(q: torch.Tensor, scopes: list[_Scope], fmt: int, attn_sink: torch.Tensor | None,
            out: torch.Tensor, lse: torch.Tensor, lse_strides: tuple[int, int, int], S: int,
            max_logits: torch.Tensor | None, sm_scale: float, dv: int,
            plan: SparsePlan | None) -> None:
    """``q [Q, N, D]`` over one or two scopes into ``out [Q, N, dv]``, ``lse`` (strides
    ``lse_strides`` for ``(qi // S, qi % S, head)``) and, when given, ``max_logits [Q, N]``.
    Decode (``S = s_q``) also turns an entry outside ``[-1, rows)`` into a NaN query."""
    Q, N, D = q.shape
    first = scopes[0]
    extra = scopes[1] if len(scopes) > 1 else first
    has_extra = len(scopes) > 1
    topk, topk2 = first.idx.shape[1], extra.idx.shape[1] if has_extra else 0
    if plan is None:
        plan = plan_sparse(Q, N, topk + topk2, q.dtype, fmt != PLAIN, num_sms(q.device),
                           model1=fmt == MODEL1)
    DV, DR = dv, D - dv
    block_dv = max(16, next_pow2(DV))
    block_dr = max(16, next_pow2(DR)) if DR else 16
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
    sink = attn_sink.contiguous() if attn_sink is not None else lse  # unused when None
    check_range = max_logits is None  # decode: its indices' contract is [-1, rows)
    launched = False
    if _sm90_route(plan, q, first.kv, dv, fmt, extra.kv if has_extra else None):
        from mla.fast.sm90.sparse import sparse_kernel as sm90_kernel

        def layout(sc: _Scope) -> tuple[int, int]:  # (row or page stride, page size)
            return (sc.page_stride if fmt == MODEL1 else sc.kv.stride(0), sc.page_size)
        launched = sm90.launch(
            sm90_kernel, (Q * groups, plan.num_splits),
            q, first.kv, first.idx, first.args()[4], extra.kv, extra.idx, extra.args()[4],
            sink, out, lse, maxl, o_part, lse_part, max_part,
            q.stride(0), q.stride(1), first.idx.stride(0), *layout(first),
            extra.idx.stride(0), *layout(extra),
            out.stride(0), out.stride(1), *lse_strides, *m_strides,
            first.n_rows, topk, extra.n_rows, topk2, sm_scale * LOG2E, plan.num_splits,
            N=N, S=S, GROUPS=groups, FP8=fmt == DS_MLA, MODEL1=fmt == MODEL1, HAS_PE=DR > 0,
            HAS_EXTRA=has_extra, HAS_TOPK_LEN2=has_extra and extra.topk_length is not None,
            HAS_TOPK_LEN=first.topk_length is not None, HAS_SINK=attn_sink is not None,
            CHECK_RANGE=check_range, HAS_MAXL=has_maxl, SPLIT=split,
            SCALE_OFFSET=D_NOPE if fmt == DS_MLA else 0, ROPE_OFFSET=ROPE_OFFSET, num_warps=8,
        )
    if not launched:
        sparse_kernel[(Q * groups, plan.num_splits)](
            q, *first.args(), *extra.args(), sink,
            out, lse, maxl, o_part, lse_part, max_part,
            q.stride(0), q.stride(1), first.idx.stride(0), first.stride_row, first.page_size,
            first.page_stride, extra.idx.stride(0), extra.stride_row, extra.page_size,
            extra.page_stride, out.stride(0), out.stride(1), *lse_strides, *m_strides,
            first.n_rows, topk, extra.n_rows, topk2, sm_scale * LOG2E, plan.num_splits,
            N=N, S=S, GROUPS=groups, DV=DV, DR=DR, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
            BLOCK_DV=block_dv, BLOCK_DR=block_dr, HAS_PE=DR > 0, FORMAT=fmt,
            HAS_TOPK_LEN=first.topk_length is not None, HAS_EXTRA=has_extra,
            HAS_TOPK_LEN2=has_extra and extra.topk_length is not None,
            HAS_SINK=attn_sink is not None, CHECK_RANGE=check_range, HAS_MAXL=has_maxl,
            SPLIT=split, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=plan.num_warps, num_stages=plan.num_stages,
        )
    if split:
        combine_kernel[(Q * N,)](
            o_part, lse_part, max_part, sink, out, lse, maxl, plan.num_splits,
            out.stride(0), out.stride(1), *lse_strides, *m_strides,
            N=N, S=S, DV=DV, BLOCK_DV=block_dv, BLOCK_S=max(2, next_pow2(plan.num_splits)),
            HAS_SINK=attn_sink is not None, HAS_MAXL=has_maxl, num_warps=4,
        )


def _sm90_route(plan: SparsePlan, q: torch.Tensor, kv: torch.Tensor, dv: int, fmt: int,
                extra_kv: torch.Tensor | None = None) -> bool:
    """Whether this call goes to the Gluon sm_90 kernel (``mla.fast.sm90.sparse``): a plan
    that allows it, on a Hopper GPU whose Triton can build the Gluon kernels, DeepSeek-V3.2's
    rows (a bf16/fp16 or ``fp8_ds_mla`` cache) or MODEL1 pages, in ``kv`` and in the second
    scope's ``extra_kv`` if any. ``fmt``: ``PLAIN``, ``DS_MLA`` or ``MODEL1``."""
    if not plan.sm90 or q.device.type != "cuda" or interpreting() or not sm90.usable():
        return False
    from mla.fast.sm90.sparse import supported

    caches = [kv] if extra_kv is None else [kv, extra_kv]
    return all(supported(q, c, dv, fmt == DS_MLA, plan.block_m, model1=fmt == MODEL1)
               for c in caches)


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    is_fp8_kvcache: bool,
    topk_length: torch.Tensor | None = None,
    head_dim_v: int = 512,
    *,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    validate: bool | None = None,
    plan: SparsePlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode of ``q [B, s_q, N, D]`` over the paged cache, rows named by
    ``indices [B, s_q, topk]`` (global slots ``block · block_size + offset``, ``-1`` for none).

    ``kv_cache [nb, bs, D]`` in q's dtype, or with ``is_fp8_kvcache`` ``[nb, bs, 656]`` uint8
    ``fp8_ds_mla`` rows (``D = 576``) or the ``[nb, bs, 584]`` view of MODEL1 pages
    (``fp8_model1_cache``; ``D = 512``) (``[nb, bs, 1, ·]`` accepted too); ``topk_length [B]``
    int32. DeepSeek-V4's keywords as the reference's: ``attn_sink [N]`` float32, and a second
    scope ``extra_k_cache`` (the first cache's format, its own page size),
    ``extra_indices_in_kvcache [B, s_q, extra_topk]``, ``extra_topk_length [B]``, attended in
    the same softmax. Returns ``out [B, s_q, N, head_dim_v]`` (q's dtype) and
    ``lse [B, N, s_q]`` float32, ``+inf`` for a lonely query, as
    ``mla.reference.sparse_mla_decode``.

    ``validate``: check ``indices`` and ``topk_length`` ranges on the host (a sync); without
    the checks a query whose length lies outside ``[0, topk]`` or that uses an entry outside
    ``[-1, slots)`` gets NaN ``out`` and ``lse``. ``plan``: default ``plan_sparse(...)``.
    """
    extras = dict(extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices_in_kvcache,
                  extra_topk_length=extra_topk_length)
    check_sparse_decode_shapes(q, kv_cache, indices, softmax_scale, is_fp8_kvcache,
                               topk_length, head_dim_v, attn_sink=attn_sink,
                               fp8_layouts=("fp8_ds_mla", "MODEL1"), **extras)
    check_kernel_input(q)
    if should_validate(validate, q):
        check_sparse_decode_values(kv_cache, indices, topk_length, **extras)
    B, s_q, N, D = q.shape
    out = torch.empty(B, s_q, N, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, N, s_q, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    first, fmt = _decode_scope("kv_cache", kv_cache, indices, topk_length, is_fp8_kvcache)
    scopes = [first]
    if extra_k_cache is not None:
        assert extra_indices_in_kvcache is not None
        scopes.append(_decode_scope("extra_k_cache", extra_k_cache, extra_indices_in_kvcache,
                                    extra_topk_length, is_fp8_kvcache)[0])
    Q = B * s_q
    _launch(_unit_stride(q.reshape(Q, N, D)), scopes, fmt, attn_sink,
            out.view(Q, N, head_dim_v), lse, (lse.stride(0), lse.stride(2), lse.stride(1)),
            s_q, None, softmax_scale, head_dim_v, plan)
    return out, lse


def sparse_mla_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    *,
    attn_sink: torch.Tensor | None = None,
    validate: bool | None = None,
    plan: SparsePlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill: ``q [s_q, h_q, d_qk]`` over ``kv [s_kv, d_qk]`` (or ``[s_kv, 1, d_qk]``),
    rows named by ``indices [s_q, topk]`` (or ``[s_q, 1, topk]``), ``topk_length [s_q]``,
    ``attn_sink [h_q]`` float32.

    Returns ``out [s_q, h_q, d_v]`` (q's dtype), ``max_logits [s_q, h_q]`` and
    ``lse [s_q, h_q]`` (float32), as ``mla.reference.sparse_mla_prefill``: indices ``< 0`` or
    ``>= s_kv`` are masked; a lonely query gets ``out = 0``, ``lse = +inf``,
    ``max_logits = -inf``. ``validate``: check ``topk_length``'s range on the host (a sync);
    without the check a query whose length lies outside ``[0, topk]`` gets NaN out, lse and
    max_logits.
    """
    check_sparse_prefill_shapes(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)
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
    _launch(_unit_stride(q), [_plain_scope(kv, idx, topk_length)], PLAIN, attn_sink, out, lse,
            (lse.stride(0), 0, lse.stride(1)), 1, max_logits, sm_scale, d_v, plan)
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
