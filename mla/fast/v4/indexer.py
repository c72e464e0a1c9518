"""DeepSeek-V4's lightning indexer on the fast path: the query's prep in Triton, then the paged
fp8 logits and the top-k (``mla.fast.fp8_paged_mqa_logits``, ``mla.fast.top_k_per_row``).

``mla.reference.v4.indexer``, which selects the compressed entries of equation (6) of
``mla.reference.v4.layer`` for a C4A (ratio 4) layer. ``v4_indexer_q_prep`` computes, per token
``t`` at position ``p`` and indexer head ``h`` (``H`` heads of 128), from ``q = bf16(qr @
wq_b^T)`` and ``w = bf16(x @ weights_proj^T)``:

    q'       = bf16(rope_p(q))                      the last 64 of 128 dims, float32 rotation
    s[t, h]  = 2^ceil(log2(max(amax(q'), 1e-4) / 448))           (``act_quant``, ue8m0)
    codes    = e4m3(q' / s)
    w'[t, h] = w[t, h] · s[t, h] · 128^-0.5 · H^-0.5              float32

(``v4_indexer_q``, ``v4_indexer_weights``): the codes and ``s`` bit for bit the reference's
(the roundings are integer operations, ``mla.fast.v4.common``) up to the float32 rotation, and
``w'`` within one float32 rounding. ``v4_indexer_topk_paged`` then scores every query against
the compressed indexer key cache (the 132-byte pages ``v4_compress_store`` writes for ``d =
128``; each query its own row of ``fp8_paged_mqa_logits`` with ``context_lens = (p + 1) // 4``,
the entries it may see) and keeps the ``index_topk`` best per row (``top_k_per_row``: local entry
ids, ``-1`` after the visible ones).

The short-context fill: when every request's ``L // 4 <= index_topk`` (vLLM's rule, on the
batch's longest), no logits are computed and row ``t`` is ``[0, 1, .., n_t - 1, -1, ..]``. Where
a row has ``n_t <= index_topk`` visible entries the top-k holds all of them either way, so the
selected sets equal the reference's per-request rule whatever the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.fast.bits import bf16_round, e4m3_bits, pow2, ue8m0_exponent
from mla.fast.common import check_kernel_input
from mla.fast.indexer.logits_paged import fp8_paged_mqa_logits
from mla.fast.launch import check_grid
from mla.fast.topk import top_k_per_row
from mla.fast.v4.common import FLOORS
from mla.reference.indexer_cache import INDEX_K_BYTES
from mla.validation import check_float, check_index, check_tensor

__all__ = ["v4_indexer_q_prep", "v4_indexer_topk_paged", "short_context_topk"]

_D = 128
_HALF = 32


@triton.jit
def _indexer_q_kernel(
    q, w, positions, cos_sin, codes, w_out, H, s_qt, s_qh, s_wt, s_ct, s_ch, fold,
    D: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr, FLOOR: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    h_ok = h < H
    NOPE: tl.constexpr = D - 2 * HALF
    cn = tl.arange(0, NOPE)
    ci = tl.arange(0, HALF)
    pos = tl.load(positions + t).to(tl.int64)
    cos = tl.load(cos_sin + pos * 2 * HALF + ci)[None, :]
    sin = tl.load(cos_sin + pos * 2 * HALF + HALF + ci)[None, :]
    src = q + t * s_qt + h[:, None] * s_qh
    x_n = bf16_round(tl.load(src + cn[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32))
    x_e = tl.load(src + NOPE + 2 * ci[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
    x_o = tl.load(src + NOPE + 2 * ci[None, :] + 1, mask=h_ok[:, None],
                  other=0.0).to(tl.float32)
    r_e = bf16_round(x_e * cos - x_o * sin)
    r_o = bf16_round(x_e * sin + x_o * cos)
    amax = tl.maximum(tl.max(tl.abs(x_n), axis=1),
                      tl.maximum(tl.max(tl.abs(r_e), axis=1), tl.max(tl.abs(r_o), axis=1)))
    j = ue8m0_exponent(amax, FLOOR)
    inv = pow2(-j)[:, None]
    dst = codes + t * s_ct + h[:, None] * s_ch
    tl.store(dst + cn[None, :], e4m3_bits(x_n * inv).to(tl.uint8), mask=h_ok[:, None])
    tl.store(dst + NOPE + 2 * ci[None, :], e4m3_bits(r_e * inv).to(tl.uint8), mask=h_ok[:, None])
    tl.store(dst + NOPE + 2 * ci[None, :] + 1, e4m3_bits(r_o * inv).to(tl.uint8),
             mask=h_ok[:, None])
    wt = tl.load(w + t * s_wt + h, mask=h_ok, other=0.0).to(tl.float32)
    tl.store(w_out + t * H + h, wt * pow2(j) * fold, mask=h_ok)


def v4_indexer_q_prep(q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, H, 128]`` (``bf16(qr @ wq_b^T)``), ``w [T, H]`` (``bf16(x @ weights_proj^T)``)
    at ``positions [T]`` -> ``(codes float8_e4m3fn [T, H, 128], w' float32 [T, H])`` (module
    doc); ``cos_sin [P, 64]`` float32, the layer's table."""
    check_float("q", q, ndim=3)
    check_kernel_input(q)
    T, H, D = q.shape
    if D != _D:
        raise ValueError(f"q must have shape [T, H, {_D}], got {list(q.shape)}")
    check_float("w", w, shape=[T, H], device=q.device)
    check_index("positions", positions, shape=[T], device=q.device)
    check_tensor("cos_sin", cos_sin, shape=[None, 64], dtype=(torch.float32,),
                 device=q.device, contiguous=True)
    if q.stride(2) != 1 or w.stride(1) != 1:
        raise ValueError("q and w must have unit stride in their last dim")
    codes = torch.empty(T, H, _D, dtype=torch.uint8, device=q.device)
    w_out = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T * H == 0:
        return codes.view(torch.float8_e4m3fn), w_out
    hb = min(16, triton.next_power_of_2(H))
    grid = (T, triton.cdiv(H, hb))
    check_grid("v4_indexer_q_prep (grid: tokens, head blocks)", grid)
    _indexer_q_kernel[grid](
        q, w, positions, cos_sin, codes, w_out, H, q.stride(0), q.stride(1), w.stride(0),
        codes.stride(0), codes.stride(1), _D ** -0.5 * H ** -0.5,
        D=_D, HALF=_HALF, HB=hb, FLOOR=FLOORS["vllm"], num_warps=4,
    )
    return codes.view(torch.float8_e4m3fn), w_out


def short_context_topk(visible: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 ``[T, topk]``: row ``t`` is ``[0 .. visible[t] - 1, -1, ..]`` (vLLM's fill)."""
    cols = torch.arange(topk, device=visible.device, dtype=torch.int32)[None, :]
    return torch.where(cols < visible[:, None], cols, -1).to(torch.int32)


def v4_indexer_topk_paged(codes: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                          block_tables: torch.Tensor, visible: torch.Tensor,
                          max_entries: int, topk: int, *, fill: bool = False,
                          validate: bool | None = None) -> torch.Tensor:
    """int32 ``[T, topk]`` local entry ids per query, ``-1`` after: the ``topk`` highest
    ``Σ_h w'[t, h] · ReLU(codes[t, h] · k_j) · k_scale_j`` over the visible ``j <
    visible[t]``. ``codes [T, H, 128]`` e4m3 and ``weights [T, H]`` float32
    (``v4_indexer_q_prep``); ``k_cache uint8 [nb, bs, 132]`` the compressed indexer keys;
    ``block_tables [T, pages]`` int32 the page table of each query's request;
    ``visible [T]`` int32 ``(p + 1) // 4``; ``max_entries >= max(visible)`` (the logits'
    width). ``fill``: the short-context rule (no logits; module doc)."""
    check_index("visible", visible, ndim=1)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    if fill:
        return short_context_topk(visible, topk)
    check_tensor("codes", codes, ndim=3, dtype=(torch.float8_e4m3fn,))
    T = codes.shape[0]
    check_index("visible", visible, shape=[T], device=codes.device)
    check_tensor("k_cache", k_cache, ndim=3, dtype=(torch.uint8,), device=codes.device)
    if k_cache.shape[2] != INDEX_K_BYTES:
        raise ValueError(f"k_cache must have shape [num_blocks, block_size, {INDEX_K_BYTES}], "
                         f"got {list(k_cache.shape)}")
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
        raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
    logits = fp8_paged_mqa_logits(codes[:, None], k_cache, weights, visible.to(torch.int32),
                                  block_tables, max_entries, validate=validate)
    starts = torch.zeros_like(visible, dtype=torch.int32)
    return top_k_per_row(logits, starts, visible.to(torch.int32), topk, validate=validate)
