"""Sparse top-k MLA (DeepSeek-V3.2's DSA): index conversion and attention over selected rows.

conventions §10 (FlashMLA's ``flash_mla_sparse_fwd`` / ``flash_mla_with_kvcache`` and their
reference in ``tests/ref.py``; ``triton_convert_req_index_to_global_index`` of vLLM 0.14
``v1/attention/backends/mla/flashmla_sparse.py``).

Index conversion. The indexer names keys by their position ``i`` inside request ``req``; the
kernels read a flat cache, so

    global(i) = block_table[req, i // bs] · bs + i % bs
    -1        when i < 0, or when the block i // bs is outside [0, max_blocks_per_req)
    workspace variant: a prefill token (prefill_workspace_request_ids[t] = p >= 0) maps to
              prefill_workspace_starts[p] + i instead (still -1 under the two rules above)

The block table entry itself is not checked (as in vLLM's kernel): an unassigned ``-1`` entry gives
a
negative slot, which the sparse prefill masks and the sparse decode rejects.

Attention. The absorbed MQA of section 4 restricted, per query, to the rows it names:

    s_j        = sm_scale · q · kv[indices[j]]          j < topk, valid
    max_logits = max_j s_j
    lse        = log Σ_j exp(s_j)                       natural log
    out        = Σ_j exp(s_j - lse) · kv[indices[j], :d_v]

Invalid entries are dropped: ``-1`` (any negative, in prefill) or ``>= s_kv`` (prefill), and
the columns ``j >= topk_length[t]``. A repeated index counts once per appearance, as in
FlashMLA's reference. A "lonely" query, whose entries are all invalid, gets ``out = 0``,
``lse = +inf`` (so that merging it with another state keeps the other side) and
``max_logits = -inf`` (the max of an empty set, FlashMLA's reference value).

DeepSeek-V4 (conventions §14): an attention sink (``attn_sink``, applied once by
``mla.reference.sink`` after the softmax, the lse unchanged), ``d_qk = 512`` rows with V the
whole row, the MODEL1 fp8 cache (read by ``fp8_model1_rows``), and, in the decode, a second
KV scope (``extra_k_cache``, its indices and lengths) whose entries join the first scope's in
one softmax, as if both were one selection.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mla.reference.fp8 import FP8_DS_MLA_BYTES, dequantize_fp8_ds_mla
from mla.reference.fp8_model1 import D_QK as FP8_MODEL1_D_QK
from mla.reference.fp8_model1 import FP8_MODEL1_BYTES, fp8_model1_pages, fp8_model1_rows
from mla.reference.sink import apply_attn_sink, check_attn_sink
from mla.validation import (
    acc_dtype,
    check_float,
    check_index,
    check_positive_int,
    check_same_device,
    check_same_dtype,
    check_scale,
    check_tensor,
)

__all__ = ["convert_req_index_to_global_index", "sparse_mla_prefill", "sparse_mla_decode",
           "sparse_index_mask"]

FLASHMLA_D_QK = 576  # DeepSeek's latent row: 512 kv_c + 64 k_pe
FLASHMLA_D_V = 512
_CHUNK_ELEMENTS = 1 << 24  # bound on the gathered rows held at once (s_q chunk × topk × d)


def check_index_conversion_shapes(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    block_size: int,
    prefill_workspace_request_ids: torch.Tensor | None,
    prefill_workspace_starts: torch.Tensor | None,
) -> bool:
    """Shape, dtype and device checks of the index conversion (no device reads).

    Returns whether the prefill-workspace variant is asked for.
    """
    check_index("req_id", req_id, ndim=1, dtype=(torch.int32,))
    T = req_id.shape[0]
    check_index("block_table", block_table, ndim=2, dtype=(torch.int32,))
    check_index("token_indices", token_indices, shape=[T, None], dtype=(torch.int32,))
    check_positive_int("block_size", block_size)
    if (prefill_workspace_request_ids is None) != (prefill_workspace_starts is None):
        raise ValueError("prefill_workspace_request_ids and prefill_workspace_starts must be "
                         "given together (the workspace variant) or both be None")
    has_workspace = prefill_workspace_request_ids is not None
    if has_workspace:
        check_index("prefill_workspace_request_ids", prefill_workspace_request_ids, shape=[T],
                    dtype=(torch.int32,))
        check_index("prefill_workspace_starts", prefill_workspace_starts, ndim=1,
                    dtype=(torch.int32,))
    check_same_device(req_id=req_id, block_table=block_table, token_indices=token_indices,
                      prefill_workspace_request_ids=prefill_workspace_request_ids,
                      prefill_workspace_starts=prefill_workspace_starts)
    return has_workspace


def check_index_conversion_values(req_id: torch.Tensor, block_table: torch.Tensor,
                                  prefill_workspace_request_ids: torch.Tensor | None,
                                  prefill_workspace_starts: torch.Tensor | None) -> None:
    """Range checks of the request ids (one device-to-host transfer)."""
    if req_id.numel() == 0:
        return
    parts = [torch.stack(torch.aminmax(req_id.long()))]
    if prefill_workspace_request_ids is not None:
        parts.append(torch.stack(torch.aminmax(prefill_workspace_request_ids.long())))
    values = torch.cat(parts).tolist()
    R = block_table.shape[0]
    if values[0] < 0 or values[1] >= R:
        raise ValueError(f"req_id must lie in [0, {R}) (block_table rows), got range "
                         f"[{values[0]}, {values[1]}]")
    if prefill_workspace_request_ids is not None:
        assert prefill_workspace_starts is not None
        P = prefill_workspace_starts.shape[0]
        if values[2] < -1 or values[3] >= P:
            raise ValueError(f"prefill_workspace_request_ids must lie in [-1, {P}) "
                             f"(-1 = decode token, else a prefill_workspace_starts entry), "
                             f"got range [{values[2]}, {values[3]}]")


def convert_req_index_to_global_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    block_size: int,
    prefill_workspace_request_ids: torch.Tensor | None = None,
    prefill_workspace_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Request-local ``token_indices [T, topk]`` -> global cache slots (or workspace rows).

    ``req_id [T]`` is each token's request (a row of ``block_table [R, max_blocks]``). With the
    workspace pair, ``prefill_workspace_request_ids [T]`` is ``-1`` for decode tokens and the
    prefill request's number ``p`` otherwise, ``prefill_workspace_starts [P]`` its first
    workspace row. All int32, as vLLM's kernel asserts; returns int32 ``[T, topk]``.
    """
    has_workspace = check_index_conversion_shapes(
        req_id, block_table, token_indices, block_size, prefill_workspace_request_ids,
        prefill_workspace_starts)
    check_index_conversion_values(req_id, block_table, prefill_workspace_request_ids,
                                  prefill_workspace_starts)
    max_blocks = block_table.shape[1]

    tok = token_indices.long()
    block = torch.div(tok, block_size, rounding_mode="floor")
    invalid = (tok < 0) | (block >= max_blocks)
    safe_block = torch.where(invalid, 0, block)
    req = req_id.long()[:, None].expand_as(tok)
    out = block_table.long()[req, safe_block] * block_size + tok % block_size
    if has_workspace:
        p = prefill_workspace_request_ids.long()[:, None].expand_as(tok)
        is_prefill = p >= 0
        starts = prefill_workspace_starts.long()[torch.where(is_prefill, p, 0)]
        out = torch.where(is_prefill, starts + tok, out)
    return torch.where(invalid, -1, out).to(torch.int32)


def _attend_gathered(q: torch.Tensor, rows: torch.Tensor, invalid: torch.Tensor,
                     sm_scale: float, d_v: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q [s, h, d]`` over its own ``rows [s, k, d]`` -> ``(out, max_logits, lse)``, all in
    the accumulation dtype (the caller casts ``out`` once, after the sink).

    ``invalid [s, k]`` rows are dropped (and zeroed first, so garbage in them, NaN included,
    cannot leak through a zero weight).
    """
    work = acc_dtype(q.dtype)
    rows = rows.to(work).masked_fill(invalid[..., None], 0.0)
    s = torch.einsum("shd,skd->shk", q.to(work), rows) * sm_scale
    s = s.masked_fill(invalid[:, None, :], float("-inf"))
    if s.shape[-1]:
        max_logits = s.amax(dim=-1)
        lse = torch.logsumexp(s, dim=-1)
    else:
        max_logits = s.new_full(s.shape[:2], float("-inf"))
        lse = s.new_full(s.shape[:2], float("-inf"))
    lonely = torch.isneginf(lse)
    p = torch.exp(s - torch.where(lonely, 0.0, lse)[..., None])  # masked keys: exp(-inf) = 0
    out = torch.einsum("shk,skv->shv", p, rows[..., :d_v])
    lse = torch.where(lonely, float("inf"), lse)
    return out, max_logits, lse


def _chunk(topk: int, d: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, topk * d))


def _check_topk_length(topk_length: torch.Tensor | None, rows: int, topk: int,
                       what: str, device: torch.device) -> None:
    _check_topk_length_shape(topk_length, rows, device)
    _check_topk_length_values(topk_length, topk, what)


def _check_topk_length_shape(topk_length: torch.Tensor | None, rows: int,
                             device: torch.device, name: str = "topk_length") -> None:
    if topk_length is None:
        return
    check_index(name, topk_length, shape=[rows], dtype=(torch.int32,))
    if topk_length.device != device:
        raise ValueError(f"{name} is on {topk_length.device} but q is on {device}")


def _range(t: torch.Tensor) -> torch.Tensor:
    """``[min, max]`` of a non-empty integer tensor as an int64 tensor, on its device."""
    return torch.stack(torch.aminmax(t.long()))


def _check_topk_length_values(topk_length: torch.Tensor | None, topk: int, what: str,
                              name: str = "topk_length") -> None:
    if topk_length is None or not topk_length.numel():
        return
    _raise_topk_length(_range(topk_length).tolist(), topk, what, name)


def _raise_topk_length(lo_hi: list[int], topk: int, what: str, name: str) -> None:
    lo, hi = lo_hi
    if lo < 0 or hi > topk:
        raise ValueError(f"{name} must lie in [0, topk={topk}] ({what}), got range "
                         f"[{lo}, {hi}]")


def check_sparse_prefill_shapes(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                                sm_scale: float, d_v: int,
                                topk_length: torch.Tensor | None,
                                attn_sink: torch.Tensor | None = None) -> None:
    """Shape, dtype, device and scalar checks of ``sparse_mla_prefill``: no device read."""
    check_float("q", q, ndim=3)
    s_q, h_q, d_qk = q.shape
    check_float("kv", kv, ndim=(2, 3))
    if kv.dim() == 3 and kv.shape[1] != 1:
        raise ValueError(f"kv must have shape [s_kv, {d_qk}] or [s_kv, 1, {d_qk}] (one KV "
                         f"head), got {list(kv.shape)}")
    if kv.shape[-1] != d_qk:
        raise ValueError(f"kv's last dim must be q's head dim {d_qk}, got shape "
                         f"{list(kv.shape)}")
    check_same_dtype(q=q, kv=kv)
    check_index("indices", indices, ndim=(2, 3), dtype=(torch.int32,))
    if indices.shape[0] != s_q or (indices.dim() == 3 and indices.shape[1] != 1):
        raise ValueError(f"indices must have shape [{s_q}, topk] or [{s_q}, 1, topk] (one row "
                         f"per query, one KV head), got {list(indices.shape)}")
    check_same_device(q=q, kv=kv, indices=indices)
    check_scale("sm_scale", sm_scale)
    check_positive_int("d_v", d_v)
    if d_v > d_qk:
        raise ValueError(f"d_v must be <= the head dim {d_qk} (V is kv[:, :d_v]), got {d_v}")
    _check_topk_length_shape(topk_length, s_q, q.device)
    check_attn_sink(attn_sink, h_q, q.device)


def sparse_mla_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    *,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA's ``flash_mla_sparse_fwd``: each query attends to the ``kv`` rows it names.

    ``q [s_q, h_q, d_qk]``, ``kv [s_kv, d_qk]`` or ``[s_kv, 1, d_qk]`` (one shared KV head),
    ``indices [s_q, topk]`` or ``[s_q, 1, topk]`` int32, ``topk_length [s_q]`` int32 (query
    ``t`` uses ``indices[t, :topk_length[t]]``). V is ``kv[:, :d_v]``: DeepSeek-V3.2's rows are
    576 wide with ``d_v = 512``, DeepSeek-V4's 512 wide with ``d_v = 512`` (V is the whole
    row); smaller configs pass ``d_v = Lkv``. ``attn_sink [h_q]`` float32: the sink of
    ``mla.reference.sink`` (keyword-only: FlashMLA passes it before ``topk_length``).

    Returns ``out [s_q, h_q, d_v]`` (``q``'s dtype), ``max_logits [s_q, h_q]`` and
    ``lse [s_q, h_q]`` (float32; float64 for float64 inputs), both over the scaled logits
    and untouched by the sink. A lonely query (no valid index): ``out = 0``, ``lse = +inf``,
    ``max_logits = -inf``.
    """
    check_sparse_prefill_shapes(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)
    s_q, h_q, d_qk = q.shape
    kv = kv.reshape(kv.shape[0], d_qk)
    indices = indices.reshape(s_q, indices.shape[-1])
    topk = indices.shape[1]
    _check_topk_length_values(topk_length, topk, "one per query")

    s_kv = kv.shape[0]
    idx = indices.long()
    invalid = (idx < 0) | (idx >= s_kv)
    if topk_length is not None:
        cols = torch.arange(topk, device=q.device)
        invalid |= cols[None, :] >= topk_length.long()[:, None]
    safe = torch.where(invalid, 0, idx)
    work = acc_dtype(q.dtype)
    out = torch.zeros(s_q, h_q, d_v, dtype=work, device=q.device)
    max_logits = torch.full((s_q, h_q), float("-inf"), dtype=work, device=q.device)
    lse = torch.full((s_q, h_q), float("inf"), dtype=work, device=q.device)
    step = _chunk(topk, d_qk)
    for a in range(0, s_q if s_kv else 0, step):
        b = min(a + step, s_q)
        rows = kv[safe[a:b]]  # [chunk, topk, d_qk]
        out[a:b], max_logits[a:b], lse[a:b] = _attend_gathered(
            q[a:b], rows, invalid[a:b], sm_scale, d_v)
    return apply_attn_sink(out, lse, attn_sink).to(q.dtype), max_logits, lse


def _cache_format(name: str, kv_cache: torch.Tensor, is_fp8_kvcache: bool,
                  q: torch.Tensor, head_dim_v: int, fp8_layouts: tuple[str, ...]) -> None:
    """One sparse-decode cache's checks: a plain cache in ``q``'s dtype with rows of ``D``,
    or, with ``is_fp8_kvcache``, ``fp8_ds_mla`` (656 bytes, ``D = 576``) or MODEL1 pages
    (584 bytes, ``D = 512``), both with ``head_dim_v = 512``."""
    D = q.shape[-1]
    check_tensor(name, kv_cache, ndim=(3, 4))
    if kv_cache.dim() == 4 and kv_cache.shape[2] != 1:
        raise ValueError(f"{name} must have shape [num_blocks, block_size, row] or "
                         f"[num_blocks, block_size, 1, row] (one KV head), "
                         f"got {list(kv_cache.shape)}")
    row = kv_cache.shape[-1]
    if not is_fp8_kvcache:
        check_float(name, kv_cache)
        if row != D:
            raise ValueError(f"{name}'s last dim must be q's head dim {D} "
                             f"({FLASHMLA_D_QK} for DeepSeek-V3.2, {FP8_MODEL1_D_QK} for "
                             f"DeepSeek-V4; {FP8_DS_MLA_BYTES} or {FP8_MODEL1_BYTES} only with "
                             f"is_fp8_kvcache=True), got {row}")
        check_same_dtype(q=q, **{name: kv_cache})
        return
    check_tensor(name, kv_cache, dtype=(torch.uint8, torch.float8_e4m3fn))
    widths = {FP8_DS_MLA_BYTES: (FLASHMLA_D_QK, "fp8_ds_mla"),
              FP8_MODEL1_BYTES: (FP8_MODEL1_D_QK, "MODEL1")}
    if row not in widths:
        raise ValueError(f"{name}'s last dim must be {FP8_DS_MLA_BYTES} (fp8_ds_mla bytes) or "
                         f"{FP8_MODEL1_BYTES} (MODEL1 bytes) with is_fp8_kvcache=True, "
                         f"got {row}")
    d_qk, layout = widths[row]
    if layout not in fp8_layouts:
        raise ValueError(f"{name} is a {layout} cache ({row} bytes a token), which this kernel "
                         f"does not read (it reads {', '.join(fp8_layouts)})")
    if D != d_qk or head_dim_v != FLASHMLA_D_V:
        raise ValueError(f"{name} is a {layout} cache ({row} bytes a token), whose rows are "
                         f"{d_qk} wide with V = {FLASHMLA_D_V}: q must have head dim {d_qk} "
                         f"and head_dim_v must be {FLASHMLA_D_V}, got q {list(q.shape)}, "
                         f"head_dim_v={head_dim_v}")
    if row == FP8_MODEL1_BYTES:
        fp8_model1_pages(kv_cache, name=name)  # the page layout's strides


def _cache_reader(kv_cache: torch.Tensor, is_fp8_kvcache: bool
                  ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Global slots (any shape, all valid) -> their rows ``[*slots.shape, D]``: the cache's
    own rows, or bf16 rows dequantized as FlashMLA does."""
    bs, row = kv_cache.shape[1], kv_cache.shape[-1]
    if is_fp8_kvcache and row == FP8_MODEL1_BYTES:
        pages = fp8_model1_pages(kv_cache)
        return lambda slots: fp8_model1_rows(pages, bs, slots)
    flat = kv_cache.reshape(kv_cache.shape[0] * bs, row)
    if is_fp8_kvcache:
        return lambda slots: torch.cat(dequantize_fp8_ds_mla(flat[slots]), dim=-1)
    return lambda slots: flat[slots]


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's ``flash_mla_with_kvcache`` with ``indices``: sparse decode on the paged cache.

    ``q [B, s_q, N, D]``; ``indices [B, s_q, topk]`` int32 global slots
    (``block · block_size + offset``, from ``convert_req_index_to_global_index``), ``-1`` for
    none; ``topk_length [B]`` int32 (request ``b`` uses its first ``topk_length[b]`` indices).
    The cache is ``[num_blocks, block_size, D]`` in ``q``'s dtype, or, with ``is_fp8_kvcache``,
    uint8 ``fp8_ds_mla`` rows ``[num_blocks, block_size, 656]`` (then ``D = 576``) or the
    ``[num_blocks, block_size, 584]`` view of MODEL1 pages (``fp8_model1_cache``; then
    ``D = 512``), both with ``head_dim_v = 512`` and dequantized to bf16 as FlashMLA does.
    FlashMLA's ``[num_blocks, block_size, 1, ·]`` layout is accepted too. V is the first
    ``head_dim_v`` columns of a row (the whole row for DeepSeek-V4; smaller configs pass
    ``Lkv``).

    Keyword-only, FlashMLA's names: ``attn_sink [N]`` float32 (``mla.reference.sink``); a
    second KV scope ``extra_k_cache`` (the first cache's format, its own block count and
    page size), ``extra_indices_in_kvcache [B, s_q, extra_topk]`` (global slots of that
    cache) and ``extra_topk_length [B]``, attended in the same softmax as the first scope.

    Returns ``out [B, s_q, N, head_dim_v]`` (``q``'s dtype) and ``lse [B, N, s_q]`` (float32;
    float64 for float64 ``q``) over both scopes and untouched by the sink; a lonely query
    (no valid entry in either scope) gets ``out = 0`` and ``lse = +inf``.
    """
    check_sparse_decode_shapes(q, kv_cache, indices, softmax_scale, is_fp8_kvcache,
                               topk_length, head_dim_v, attn_sink=attn_sink,
                               extra_k_cache=extra_k_cache,
                               extra_indices_in_kvcache=extra_indices_in_kvcache,
                               extra_topk_length=extra_topk_length,
                               fp8_layouts=("fp8_ds_mla", "MODEL1"))
    check_sparse_decode_values(kv_cache, indices, topk_length,
                               extra_k_cache=extra_k_cache,
                               extra_indices_in_kvcache=extra_indices_in_kvcache,
                               extra_topk_length=extra_topk_length)
    B, s_q, N, D = q.shape
    scopes = [(kv_cache, indices, topk_length)]
    if extra_k_cache is not None:
        scopes.append((extra_k_cache, extra_indices_in_kvcache, extra_topk_length))
    # (read, safe slots, invalid) per scope that has slots; a scope without any is all -1
    gathered = []
    for cache, idx, length in scopes:
        if cache.shape[0] * cache.shape[1] == 0:
            continue
        idx = idx.long()
        invalid = idx < 0
        if length is not None:
            cols = torch.arange(idx.shape[2], device=q.device)
            invalid |= cols[None, None, :] >= length.long()[:, None, None]
        gathered.append((_cache_reader(cache, is_fp8_kvcache), torch.where(invalid, 0, idx),
                         invalid))
    work = acc_dtype(q.dtype)
    out = torch.zeros(B, s_q, N, head_dim_v, dtype=work, device=q.device)
    lse = torch.full((B, N, s_q), float("inf"), dtype=work, device=q.device)
    step = _chunk(sum(safe.shape[2] for _, safe, _ in gathered), D)
    for b in range(B):
        for a in range(0, s_q if gathered else 0, step):
            e = min(a + step, s_q)
            rows = torch.cat([read(safe[b, a:e]) for read, safe, _ in gathered], dim=1)
            invalid = torch.cat([inv[b, a:e] for _, _, inv in gathered], dim=1)
            o, _, l_ = _attend_gathered(q[b, a:e], rows, invalid, softmax_scale, head_dim_v)
            out[b, a:e] = o
            lse[b, :, a:e] = l_.T
    return apply_attn_sink(out, lse.transpose(1, 2), attn_sink).to(q.dtype), lse


def check_sparse_decode_shapes(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                               softmax_scale: float, is_fp8_kvcache: bool,
                               topk_length: torch.Tensor | None, head_dim_v: int, *,
                               attn_sink: torch.Tensor | None = None,
                               extra_k_cache: torch.Tensor | None = None,
                               extra_indices_in_kvcache: torch.Tensor | None = None,
                               extra_topk_length: torch.Tensor | None = None,
                               fp8_layouts: tuple[str, ...] = ("fp8_ds_mla",)) -> None:
    """Shape, dtype, device and scalar checks of ``sparse_mla_decode``: no device read.
    ``fp8_layouts``: the fp8 caches the caller reads ("fp8_ds_mla", "MODEL1"); another one
    is refused by name."""
    check_float("q", q, ndim=4)
    B, s_q, N, D = q.shape
    if not isinstance(is_fp8_kvcache, bool):
        raise TypeError(f"is_fp8_kvcache must be a bool, got {type(is_fp8_kvcache).__name__}")
    check_scale("softmax_scale", softmax_scale)
    check_positive_int("head_dim_v", head_dim_v)
    if head_dim_v > D:
        raise ValueError(f"head_dim_v must be <= q's head dim {D}, got {head_dim_v}")
    if (extra_k_cache is None) != (extra_indices_in_kvcache is None):
        raise ValueError("extra_k_cache and extra_indices_in_kvcache must be given together "
                         "(the second KV scope) or both be None")
    if extra_topk_length is not None and extra_k_cache is None:
        raise ValueError("extra_topk_length needs the second KV scope (extra_k_cache and "
                         "extra_indices_in_kvcache)")
    scopes = [("kv_cache", kv_cache, "indices", indices, "topk_length", topk_length)]
    if extra_k_cache is not None:
        scopes.append(("extra_k_cache", extra_k_cache, "extra_indices_in_kvcache",
                       extra_indices_in_kvcache, "extra_topk_length", extra_topk_length))
    for cache_name, cache, idx_name, idx, length_name, length in scopes:
        _cache_format(cache_name, cache, is_fp8_kvcache, q, head_dim_v, fp8_layouts)
        check_index(idx_name, idx, ndim=3, dtype=(torch.int32,))
        if list(idx.shape[:2]) != [B, s_q]:
            raise ValueError(f"{idx_name} must have shape [{B}, {s_q}, topk] (q's batch and "
                             f"s_q), got {list(idx.shape)}")
        check_same_device(q=q, **{cache_name: cache, idx_name: idx})
        _check_topk_length_shape(length, B, q.device, length_name)
    if extra_k_cache is not None and extra_k_cache.shape[-1] != kv_cache.shape[-1]:
        raise ValueError(f"extra_k_cache must have kv_cache's format (rows of "
                         f"{kv_cache.shape[-1]}), got {list(extra_k_cache.shape)}")
    check_attn_sink(attn_sink, N, q.device)


def check_sparse_decode_values(kv_cache: torch.Tensor, indices: torch.Tensor,
                               topk_length: torch.Tensor | None, *,
                               extra_k_cache: torch.Tensor | None = None,
                               extra_indices_in_kvcache: torch.Tensor | None = None,
                               extra_topk_length: torch.Tensor | None = None) -> None:
    """Value checks of ``sparse_mla_decode`` (``topk_length`` and ``indices`` ranges, of both
    scopes): every range is reduced on the device and read in one transfer."""
    scopes = [("kv_cache", kv_cache, "indices", indices, "topk_length", topk_length)]
    if extra_k_cache is not None:
        assert extra_indices_in_kvcache is not None
        scopes.append(("extra_k_cache", extra_k_cache, "extra_indices_in_kvcache",
                       extra_indices_in_kvcache, "extra_topk_length", extra_topk_length))
    parts = [_range(t) for _, _, _, idx, _, length in scopes for t in (length, idx)
             if t is not None and t.numel()]
    if not parts:
        return
    values = torch.cat(parts).tolist()
    for cache_name, cache, idx_name, idx, length_name, length in scopes:
        if length is not None and length.numel():
            _raise_topk_length(values[:2], idx.shape[2], "one per request", length_name)
            values = values[2:]
        if idx.numel():
            (lo, hi), values = values[:2], values[2:]
            n_slots = cache.shape[0] * cache.shape[1]
            if lo < -1 or hi >= n_slots:
                raise ValueError(f"{idx_name} must lie in [-1, {n_slots}) (-1 = none; "
                                 f"{cache_name} has {n_slots} slots), got range [{lo}, {hi}]")


def sparse_index_mask(indices: torch.Tensor, s_kv: int,
                      topk_length: torch.Tensor | None = None) -> torch.Tensor:
    """The selected set as a dense mask: bool ``[s_q, s_kv]``, True where a valid index points.

    This is the official DeepSeek-V3.2 formulation's view of the same selection (its dense
    scores get ``-inf`` where the mask is False). Invalid indices, as in
    ``sparse_mla_prefill``, select nothing; a repeated index selects its key once.
    """
    check_index("indices", indices, ndim=2, dtype=(torch.int32, torch.int64))
    if isinstance(s_kv, bool) or not isinstance(s_kv, int) or s_kv < 0:
        raise ValueError(f"s_kv must be a non-negative int, got {s_kv!r}")
    s_q, topk = indices.shape
    _check_topk_length(topk_length, s_q, topk, "one per query", indices.device)
    idx = indices.long()
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid &= torch.arange(topk, device=idx.device)[None, :] < topk_length.long()[:, None]
    mask = torch.zeros(s_q, s_kv + 1, dtype=torch.bool, device=idx.device)
    # invalid entries scatter into a spare column s_kv, dropped below
    mask.scatter_(1, torch.where(valid, idx, s_kv), True)
    return mask[:, :s_kv]
