"""DeepSeek-V4's decode step with every index built on the device: capturable in a CUDA graph.

``v4_layer_step`` takes ragged batches (prefill, MTP) and builds its positions, request ids
and scope indices from host lists (the cache's ``lengths``), so a call reads nothing from the
device but cannot be replayed either: its tensors' contents are fixed at capture. This step
takes one new token a request and the requests' lengths as a device tensor, and derives
everything else from them with shapes that depend on the batch and the cache's capacity
alone:

- positions ``pos = lengths``; the window key's slot, the window's ids and length
  (``v4_scope_indices``' first scope) from ``pos``;
- the compressors: each request's state (its last ``coff·r`` rows) followed by the new row,
  compressed where the token closes an entry, the state then shifted by one row on the device;
- the C4A indexer's top-k over ``capacity / 4`` logits per query, and where a query sees no
  more entries than the top-k holds, vLLM's short-context fill instead (``torch.where`` per
  row, where ``v4_layer_step`` decides for the whole batch on the host);
- the C128A scope: every entry ``j < (p + 1) / 128`` among ``capacity / 128`` columns;
- the attention (``sparse_mla_decode``, its value checks off) and the output projection.

``lengths`` is advanced in place (``+1``); ``cache.lengths`` (the host list of the ragged
step) is not: after a run of graph replays set it from ``lengths.tolist()`` before calling
``v4_layer_step`` again. Its results equal ``v4_layer_step``'s on the same tokens to the
rounding of its sums (the C128A scope's padding may pick another split plan).
"""

from __future__ import annotations

import torch

from mla.fast.sparse import sparse_mla_decode
from mla.fast.v4.compressor import v4_compress_store
from mla.fast.v4.front import v4_q_rope_kv_insert
from mla.fast.v4.indexer import short_context_topk, v4_indexer_topk_paged
from mla.fast.v4.layer import (
    WINDOW_PAGE,
    CompressorState,
    D,
    V4FastCache,
    global_slots,
    indexer_query,
    output_projection,
    project,
    window_ids,
)
from mla.validation import check_float, check_index

__all__ = ["v4_decode_step"]


def _compress_one(comp: CompressorState, X: torch.Tensor, pos: torch.Tensor,
                  cache: torch.Tensor, table: torch.Tensor, cos_sin: torch.Tensor, eps: float,
                  scale_floor: str) -> None:
    """One new row a request: store the entries it closes, shift the state by one row."""
    B, W, width = comp.kv.shape
    r = comp.ape.shape[0]
    proj = X.float() @ comp.w.T
    rows = torch.arange(B, device=X.device, dtype=torch.int32) * (W + 1)
    new = (proj[:, :width], proj[:, width:] + comp.ape[pos % r])
    both = []
    for state, row in zip((comp.kv, comp.score), new):
        comb = torch.cat([state, row[:, None]], dim=1)  # [B, W + 1, width]
        both.append(comb)
    kv, score = both
    p32 = pos.to(torch.int32)
    v4_compress_store(kv.view(-1, width), score.view(-1, width), rows, p32 + 1,
                      torch.ones_like(p32), 1, comp.norm, cos_sin, cache, table, ratio=r,
                      rms_norm_eps=eps, history_start=p32 - W, scale_floor=scale_floor,
                      validate=False)
    comp.kv.copy_(kv[:, 1:])
    comp.score.copy_(score[:, 1:])


def v4_decode_step(x: torch.Tensor, cache: V4FastCache, lengths: torch.Tensor, *,
                   scale_floor: str = "flashmla") -> torch.Tensor:
    """One decode token a request: ``x [B, hidden]`` at positions ``lengths [B]`` (int32 or
    int64, on the cache's device; advanced by one in place) -> ``out [B, hidden]`` in
    ``cache.dtype``, as ``v4_layer_step(list(x[:, None]), cache)`` (module doc). No host read:
    capturable in a CUDA graph once every kernel has been compiled by an eager call, so the
    lengths cannot be checked on the host: a request at a position outside ``[0, capacity)``
    gets a NaN output row (it is computed at the position clamped into the cache, so its
    writes land in its own pages; keep the lengths inside)."""
    if not isinstance(cache, V4FastCache):
        raise TypeError(f"cache must be a V4FastCache, got {type(cache).__name__}")
    w, c, r = cache.weights, cache.weights.config, cache.weights.ratio
    B, dev = len(cache.lengths), cache.window_pages.device
    check_float("x", x, shape=[B, c.hidden_size], device=dev)
    check_index("lengths", lengths, shape=[B], device=dev)
    eps = c.rms_norm_eps
    X = x.to(cache.dtype)
    pos = lengths.long()
    # a position outside the cache (no host check: see above) is read and written clamped
    # into it, and its output row made NaN at the end
    outside = (pos < 0) | (pos >= cache.capacity)
    pos = pos.clamp(0, cache.capacity - 1)
    req = torch.arange(B, device=dev)
    q_latent, kv, qb = project(X, w)
    win_slots = global_slots(cache.window_table, req, pos[:, None], WINDOW_PAGE)[:, 0]
    q = v4_q_rope_kv_insert(qb, kv, pos, cache.cos_sin, cache.window_view, win_slots,
                            rms_norm_eps=eps, head_norm=c.q_head_norm, out_dtype=cache.dtype,
                            validate=False)
    extra = {}
    if r > 1:
        assert cache.compressor is not None and cache.compressed_table is not None
        _compress_one(cache.compressor, X, pos, cache.compressed_view,
                      cache.compressed_table, cache.cos_sin, eps, scale_floor)
        visible = (pos + 1) // r
        if r == 4:
            assert cache.index_compressor is not None and cache.index_cache is not None
            _compress_one(cache.index_compressor, X, pos, cache.index_cache,
                          cache.compressed_table, cache.cos_sin, eps, "vllm")
            codes, wq = indexer_query(q_latent, X, pos, cache)
            vis32 = visible.to(torch.int32)
            picked = v4_indexer_topk_paged(codes, wq, cache.index_cache, cache.compressed_table,
                                           vis32, max(1, cache.capacity // 4), c.index_topk,
                                           validate=False)
            ids = torch.where((vis32 <= c.index_topk)[:, None],
                              short_context_topk(vis32, c.index_topk), picked)
        else:
            width = max(1, cache.capacity // r)
            cols = torch.arange(width, device=dev)[None, :]
            ids = torch.where(cols < visible[:, None], cols, -1)
        extra = dict(extra_k_cache=cache.compressed_view,
                     extra_indices_in_kvcache=global_slots(cache.compressed_table, req, ids,
                                                     cache.compressed_block)[:, None],
                     extra_topk_length=(ids >= 0).sum(1).to(torch.int32))
    win_ids, win_len = window_ids(pos, c.sliding_window)
    win_idx = global_slots(cache.window_table, req, win_ids, WINDOW_PAGE)
    attn, _ = sparse_mla_decode(q[:, None], cache.window_view, win_idx[:, None],
                                c.softmax_scale, True, win_len, D,
                                attn_sink=w["attn_sink"].float(), validate=False, **extra)
    out = output_projection(attn[:, 0], pos, cache)[2]
    out = torch.where(outside[:, None], torch.full_like(out, float("nan")), out)
    lengths.add_(1)
    return out
