"""Sparse MLA at model level: hidden states in, hidden states out (DeepSeek-V3.2).

conventions §10. Two formulations of the same layer, which must agree:

Serving (vLLM's ``FlashMLASparseImpl``), on a paged cache, per step:

    front (section 1) -> kv_c, k_pe written to kv_cache at the tokens' slots
    indexer           -> k_index written to index_k_cache at the same slots;
                         scores of the new queries against every cached k_index of their
                         request; top-k -> request-local indices [T, topk]
    conversion        -> global slots (or workspace rows)
    attention         -> absorbed MQA over the selected rows only (sparse_mla_prefill /
                         sparse_mla_decode), o_lat [T, N, Lkv]
    up-projection     -> o = o_lat W_UV, out = o.flatten(-2) @ W_O

Official (DeepSeek-V3.2-Exp's ``MLA.forward``, prefill branch), one request, no cache: the dense
MHA of section 2 with an extra additive mask, ``0`` on the selected keys and ``-inf`` elsewhere.

With ``index_k_cache`` of dtype uint8 (``[nb, bs, 132]``) the indexer runs vLLM's fp8 path: the
Hadamard-rotated keys are quantized into that cache (``indexer_k_quant_and_cache``), q is e4m3
with its scale folded into the weights (``quantize_indexer_q``), and the logits come from
``fp8_paged_mqa_logits`` at decode and from the requests' keys gathered for ``fp8_mqa_logits``
at prefill, then ``top_k_per_row``; it selects the keys of the official code's fp8 indexer
(``use_fp8_indexer=True`` on a float index cache). ``mla.fast.sparse.model`` mirrors this path.

With ``kv_cache`` of dtype uint8 the cache is ``fp8_ds_mla``: prefill dequantizes each request
into a workspace and reads it through the workspace variant of the index conversion (vLLM's
separate prefill path); decode reads the fp8 cache directly. ``sparse_masked_dense_forward``
with ``fp8_kv_cache=True`` applies the same rounding to kv_c (and k_pe to bf16), so the two
formulations again agree to rounding of the arithmetic.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mla.reference.decode import absorb_q
from mla.reference.fp8 import (
    FP8_DS_MLA_BYTES,
    concat_and_cache_fp8_ds_mla,
    dequantize_fp8_ds_mla,
    gather_and_upconvert_fp8_ds_mla,
    quantize_fp8_ds_mla,
)
from mla.reference.front import Front, mla_front
from mla.reference.indexer import (
    IndexerQK,
    IndexerWeights,
    hadamard_rotate,
    index_scores,
    indexer_qk,
    indexer_topk,
    q_latent,
    select_topk,
)
from mla.reference.indexer_cache import (
    INDEX_DIM,
    INDEX_K_BYTES,
    gather_indexer_k_cache,
    indexer_k_quant_and_cache,
)
from mla.reference.indexer_logits import (
    decode_row_ends,
    fp8_mqa_logits,
    fp8_paged_mqa_logits,
    quantize_indexer_q,
    top_k_per_row,
)
from mla.reference.model import host_ints, new_tokens
from mla.reference.paged_cache import (
    cache_rows,
    concat_and_cache_mla,
    slot_mapping_from_block_table,
)
from mla.reference.sparse import (
    convert_req_index_to_global_index,
    sparse_index_mask,
    sparse_mla_decode,
    sparse_mla_prefill,
)
from mla.validation import (
    acc_dtype,
    check_float,
    check_index,
    check_nonnegative,
    check_same_device,
    check_tensor,
)
from mla.weights import MLAWeights

__all__ = ["sparse_prefill_forward", "sparse_decode_forward", "sparse_masked_dense_forward",
           "is_byte_cache", "check_sparse_caches", "project_output", "SparseOps",
           "REFERENCE_SPARSE_OPS", "SparseTrace", "front_and_index", "run_sparse_decode",
           "DecodeRows", "reference_decode_rows",
           "run_sparse_prefill"]


def is_byte_cache(kv_cache: torch.Tensor) -> bool:
    """Whether a cache holds bytes (fp8_ds_mla rows, or the indexer's fp8 keys), not floats."""
    return kv_cache.dtype in (torch.uint8, torch.float8_e4m3fn)


def check_sparse_caches(weights: MLAWeights, indexer_weights: IndexerWeights,
                        kv_cache: torch.Tensor, index_k_cache: torch.Tensor,
                        use_fp8_indexer: bool | None) -> None:
    """The weights, the latent cache (float or fp8_ds_mla) and the index key cache (float or
    vLLM's fp8) fit together and the config; ``use_fp8_indexer`` fits the index cache."""
    c = weights.config
    if indexer_weights.config.q_lora_rank != c.q_lora_rank or \
            indexer_weights.config.hidden_size != c.hidden_size:
        raise ValueError(f"indexer_weights (config {indexer_weights.config.name!r}) do not fit "
                         f"weights (config {c.name!r}): hidden_size and q_lora_rank must match")
    check_tensor("kv_cache", kv_cache, ndim=3)
    want = FP8_DS_MLA_BYTES if is_byte_cache(kv_cache) else c.latent_dim
    if kv_cache.shape[2] != want:
        raise ValueError(f"kv_cache must have shape [num_blocks, block_size, {want}] "
                         f"({'fp8_ds_mla bytes' if is_byte_cache(kv_cache) else 'Lkv + R'}), "
                         f"got {list(kv_cache.shape)}")
    if is_byte_cache(kv_cache) and (c.kv_lora_rank, c.qk_rope_head_dim) != (512, 64):
        raise ValueError(f"an fp8_ds_mla cache needs kv_lora_rank=512 and qk_rope_head_dim=64, "
                         f"config {c.name!r} has {c.kv_lora_rank} and {c.qk_rope_head_dim}")
    if not is_byte_cache(index_k_cache):
        check_float("index_k_cache", index_k_cache,
                    shape=[kv_cache.shape[0], kv_cache.shape[1], c.index_head_dim])
        return
    # vLLM's fp8 index key cache (indexer_cache.py): read by the fp8 indexer only
    check_tensor("index_k_cache", index_k_cache,
                 shape=[kv_cache.shape[0], kv_cache.shape[1], INDEX_K_BYTES])
    if c.index_head_dim != INDEX_DIM:
        raise ValueError(f"an fp8 index key cache holds {INDEX_DIM} values per token, config "
                         f"{c.name!r} has index_head_dim {c.index_head_dim}")
    if use_fp8_indexer is False:
        raise ValueError("an fp8 index key cache (uint8 [num_blocks, block_size, 132]) is read "
                         "by the fp8 indexer: use_fp8_indexer must be True or None, got False")


def reference_front(weights: MLAWeights, indexer_weights: IndexerWeights,
                    hidden: torch.Tensor, positions: torch.Tensor) -> tuple[Front, IndexerQK]:
    """The front and the indexer's float query side: ``mla_front`` and ``indexer_qk``."""
    f = mla_front(weights, hidden, positions)
    return f, indexer_qk(indexer_weights, hidden, q_latent(weights, hidden), positions,
                         use_fp8=False)


def reference_absorb(weights: MLAWeights, q_nope: torch.Tensor,
                     q_pe: torch.Tensor | None = None) -> torch.Tensor:
    """``q_nope [S, N, P]`` -> ``[S, N, Lkv]`` (``absorb_q``); with ``q_pe [S, N, R]`` the
    query the attention reads, ``[S, N, Lkv + R]`` (``q_pe`` appended)."""
    q = absorb_q(q_nope, weights.W_UK)
    return q if q_pe is None else torch.cat([q, q_pe], dim=-1)


def project_output(weights: MLAWeights, o_lat: torch.Tensor) -> torch.Tensor:
    """``o_lat [..., N, Lkv]`` -> ``(o_lat · W_UV).flatten(-2) · W_O`` ``[..., H]``."""
    o = torch.einsum("...nl,lnv->...nv", o_lat, weights.W_UV)
    return o.flatten(-2) @ weights.W_O


class DecodeRows(NamedTuple):
    """A decode step's per-token metadata, ``T = B · s_q`` new tokens, request-major."""

    positions: torch.Tensor  # int64 [T]: cache_seqlens[b] + n, token n of request b
    req: torch.Tensor  # int32 [T]: b
    slots: torch.Tensor  # int64 [T]: the tokens' cache slots (slot_mapping_from_block_table)
    seq_lens: torch.Tensor  # int32 [B]: cache_seqlens + s_q, the keys after the step
    row_starts: torch.Tensor  # int32 [T]: 0, where each token's logits row starts
    row_ends: torch.Tensor  # int32 [T]: decode_row_ends(seq_lens, s_q), its keys' end


def reference_decode_rows(cache_seqlens: torch.Tensor, block_table: torch.Tensor, s_q: int,
                          block_size: int) -> DecodeRows:
    """``DecodeRows`` of ``s_q`` new tokens a request after ``cache_seqlens`` cached ones,
    their slots through ``block_table`` (which checks them against it on the host)."""
    dev = cache_seqlens.device
    B = cache_seqlens.shape[0]
    positions = (cache_seqlens.long()[:, None] + torch.arange(s_q, device=dev)).flatten()
    req = torch.arange(B, device=dev, dtype=torch.int32).repeat_interleave(s_q)
    seq_lens = (cache_seqlens + s_q).to(torch.int32)
    return DecodeRows(positions=positions, req=req,
                      slots=slot_mapping_from_block_table(block_table, req, positions,
                                                          block_size),
                      seq_lens=seq_lens,
                      row_starts=torch.zeros(B * s_q, dtype=torch.int32, device=dev),
                      row_ends=decode_row_ends(seq_lens, s_q))


@dataclass(frozen=True)
class SparseOps:
    """What a sparse layer step calls, with the reference's signatures; the defaults are the
    reference's own. ``mla.fast.sparse.model`` runs the same orchestration with its kernels.

    ``check_caches``: the cache layouts the path reads (``check_sparse_caches``' arguments);
    ``front``: the projections, norms and RoPE (``reference_front``), ``absorb`` and
    ``project`` the absorbed query and the output projection; ``decode_rows`` a decode
    step's positions, slots and logits rows (``reference_decode_rows``); ``gather_index_keys``
    and ``gather_latent``: the prefill's gathers of each request's cached index keys and of its
    fp8_ds_mla rows into a workspace; ``validate``: the orchestration's own host value checks
    (``cache_seqlens >= 0``), off on a path that must not read the device. A float index key
    cache is the reference's alone: its scores and top-k are the reference's
    ``index_scores``/``select_topk``, whatever the ops.
    """

    front: Callable[..., tuple[Front, IndexerQK]] = reference_front
    absorb: Callable[..., torch.Tensor] = reference_absorb
    project: Callable[[MLAWeights, torch.Tensor], torch.Tensor] = project_output
    check_caches: Callable[..., None] = check_sparse_caches
    slot_mapping: Callable[..., torch.Tensor] = slot_mapping_from_block_table
    decode_rows: Callable[..., DecodeRows] = reference_decode_rows
    cache_write: Callable[..., None] = concat_and_cache_mla
    fp8_cache_write: Callable[..., None] = concat_and_cache_fp8_ds_mla
    rotate: Callable[[torch.Tensor], torch.Tensor] = hadamard_rotate
    index_cache_write: Callable[..., None] = indexer_k_quant_and_cache
    quantize_q: Callable[..., tuple[torch.Tensor, torch.Tensor]] = quantize_indexer_q
    gather_index_keys: Callable[..., tuple[torch.Tensor, torch.Tensor]] = gather_indexer_k_cache
    gather_latent: Callable[..., torch.Tensor] = gather_and_upconvert_fp8_ds_mla
    paged_logits: Callable[..., torch.Tensor] = fp8_paged_mqa_logits
    ragged_logits: Callable[..., torch.Tensor] = fp8_mqa_logits
    top_k: Callable[..., torch.Tensor] = top_k_per_row
    convert: Callable[..., torch.Tensor] = convert_req_index_to_global_index
    decode: Callable[..., tuple[torch.Tensor, torch.Tensor]] = sparse_mla_decode
    prefill: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = sparse_mla_prefill
    validate: bool = True


REFERENCE_SPARSE_OPS = SparseOps()


class SparseTrace(NamedTuple):
    """Every stage of one sparse step, for a stage-by-stage check (``T`` new tokens)."""

    front: Front  # [T, ...]
    index_k: torch.Tensor  # [T, d_I]: the index keys cached (rotated on the fp8 path)
    q_index: torch.Tensor  # [T, n_I, d_I]: the indexer's query (fp8 path: rotated, e4m3)
    index_weights: torch.Tensor  # [T, n_I] (fp8 path: q's scale folded in)
    # the fp8 index path's logits [T, keys] (decode [T, max_model_len], prefill [T, ragged])
    # and each row's visible columns [starts, ends); None on a float index cache
    logits: torch.Tensor | None
    row_starts: torch.Tensor | None
    row_ends: torch.Tensor | None
    local: torch.Tensor  # [T, topk] int32 request-local indices, -1 = none
    slots: torch.Tensor  # [T, topk] int32: global cache slots (or workspace rows)
    q: torch.Tensor  # [T, N, Lkv+R]: absorbed query (decode: [B, s_q, N, Lkv+R])
    o_lat: torch.Tensor  # attention output in the latent space
    lse: torch.Tensor  # decode [B, N, s_q]; prefill [T, N]
    out: torch.Tensor  # [T, H] (decode: [B, s_q, H])


def front_and_index(ops: SparseOps, weights: MLAWeights, indexer_weights: IndexerWeights,
                    hidden: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                    kv_cache: torch.Tensor, index_k_cache: torch.Tensor,
                    use_fp8_indexer: bool | None) -> tuple[Front, IndexerQK]:
    """Cache the new tokens' latent and index key at ``slots``; return the front and the
    indexer's query side.

    With an fp8 index cache (vLLM's path): q_index and k_index are Hadamard-rotated, k_index
    quantized into the cache (``indexer_k_quant_and_cache``), and the returned ``q_index`` is
    e4m3 with its scale folded into ``weights`` (``quantize_indexer_q``).
    """
    write = ops.fp8_cache_write if is_byte_cache(kv_cache) else ops.cache_write
    if not is_byte_cache(index_k_cache):
        f = mla_front(weights, hidden, positions)
        write(f.kv_c, f.k_pe, kv_cache, slots)
        qk = indexer_qk(indexer_weights, hidden, q_latent(weights, hidden), positions,
                        bool(use_fp8_indexer))
        d_index = index_k_cache.shape[2]
        index_k_cache.view(-1, d_index)[slots] = qk.k_index.to(index_k_cache.dtype)
        return f, qk
    f, qk = ops.front(weights, indexer_weights, hidden, positions)
    write(f.kv_c, f.k_pe, kv_cache, slots)
    k_rot = ops.rotate(qk.k_index)
    ops.index_cache_write(k_rot, index_k_cache, slots)
    q_fp8, w_q = ops.quantize_q(ops.rotate(qk.q_index), qk.weights)
    return f, IndexerQK(q_index=q_fp8, k_index=k_rot, weights=w_q)


def _select_float(qk: IndexerQK, index_k_cache: torch.Tensor, block_table: torch.Tensor,
                  req: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Local top-k ``[T, k]`` from float index keys: token ``t`` of request ``req[t]`` at
    ``positions[t]`` sees the request's cached keys at positions ``<= positions[t]``."""
    local = torch.full((req.shape[0], topk), -1, dtype=torch.int32, device=req.device)
    for r in req.unique().tolist():
        rows = (req == r).nonzero().flatten()
        seq_len = int(positions[rows].max()) + 1
        keys = cache_rows(index_k_cache, block_table[r], 0, seq_len)
        scores = index_scores(qk.q_index[rows], qk.weights[rows], keys.to(qk.q_index.dtype),
                              positions[rows], torch.arange(seq_len, device=req.device))
        local[rows] = select_topk(scores, topk)
    return local


def run_sparse_prefill(ops: SparseOps, weights: MLAWeights, indexer_weights: IndexerWeights,
                       hidden: torch.Tensor, query_start_loc: torch.Tensor,
                       context_lens: list[int], kv_cache: torch.Tensor,
                       index_k_cache: torch.Tensor, block_table: torch.Tensor,
                       use_fp8_indexer: bool | None = None) -> SparseTrace:
    """``sparse_prefill_forward`` with ``ops``' kernels, every stage returned."""
    c = weights.config
    check_float("hidden", hidden, shape=[None, c.hidden_size])
    B = len(context_lens)
    check_index("query_start_loc", query_start_loc, shape=[B + 1])
    check_index("block_table", block_table, shape=[B, None])
    check_same_device(hidden=hidden, kv_cache=kv_cache, index_k_cache=index_k_cache,
                      block_table=block_table, query_start_loc=query_start_loc)
    ops.check_caches(weights, indexer_weights, kv_cache, index_k_cache, use_fp8_indexer)
    req, positions, lens = new_tokens(hidden, query_start_loc, context_lens)
    dev, bs = hidden.device, kv_cache.shape[1]
    f, qk = front_and_index(ops, weights, indexer_weights, hidden,
                            ops.slot_mapping(block_table, req, positions, bs), positions,
                            kv_cache, index_k_cache, use_fp8_indexer)
    topk = indexer_weights.config.index_topk
    seq = [context_lens[i] + lens[i] for i in range(B)]
    cu_host = [0, *itertools.accumulate(seq)]  # cu_host[-1]: every request's tokens
    cu = host_ints(cu_host, dev, torch.int32)
    logits = ks = ke = None
    if is_byte_cache(index_k_cache):
        # vLLM's prefill: each request's keys gathered into one ragged array; query t of a
        # request starting at row ks sees rows [ks, ks + position + 1)
        keys = ops.gather_index_keys(index_k_cache, block_table, cu, num_tokens=cu_host[-1])
        ks = cu[req].to(torch.int32)
        ke = (ks + positions + 1).to(torch.int32)
        logits = ops.ragged_logits(qk.q_index, keys, qk.weights, ks, ke)
        local = ops.top_k(logits, ks, ke, topk)
    else:
        local = _select_float(qk, index_k_cache, block_table, req, positions, topk)
    q = ops.absorb(weights, f.q_nope, f.q_pe)  # [T, N, Lkv+R]
    req32, table32 = req.to(torch.int32), block_table.to(torch.int32)
    if is_byte_cache(kv_cache):
        # fp8_ds_mla: each request's rows dequantized into a workspace, read by workspace rows
        starts = cu[:-1].contiguous()
        kv = torch.empty(cu_host[-1], c.latent_dim, dtype=q.dtype, device=dev)
        ops.gather_latent(kv_cache, kv, table32, host_ints(seq, dev, torch.int32), starts, B)
        slots = ops.convert(req32, table32, local, bs, prefill_workspace_request_ids=req32,
                            prefill_workspace_starts=starts)
    else:
        kv = kv_cache.view(-1, c.latent_dim)
        slots = ops.convert(req32, table32, local, bs)
    o_lat, _, lse = ops.prefill(q, kv, slots, c.softmax_scale, d_v=c.kv_lora_rank)
    return SparseTrace(front=f, index_k=qk.k_index, q_index=qk.q_index,
                       index_weights=qk.weights, logits=logits, row_starts=ks, row_ends=ke,
                       local=local, slots=slots, q=q, o_lat=o_lat, lse=lse,
                       out=ops.project(weights, o_lat))


def run_sparse_decode(ops: SparseOps, weights: MLAWeights, indexer_weights: IndexerWeights,
                      hidden: torch.Tensor, kv_cache: torch.Tensor, index_k_cache: torch.Tensor,
                      block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                      use_fp8_indexer: bool | None = None) -> SparseTrace:
    """``sparse_decode_forward`` with ``ops``' kernels, every stage returned. Reads nothing on
    the host itself unless ``ops.validate`` (or the index cache is float)."""
    c = weights.config
    check_float("hidden", hidden, shape=[None, None, c.hidden_size])
    B, s_q, _ = hidden.shape
    check_index("cache_seqlens", cache_seqlens, shape=[B])
    check_index("block_table", block_table, shape=[B, None])
    check_same_device(hidden=hidden, kv_cache=kv_cache, index_k_cache=index_k_cache,
                      block_table=block_table, cache_seqlens=cache_seqlens)
    ops.check_caches(weights, indexer_weights, kv_cache, index_k_cache, use_fp8_indexer)
    if ops.validate:
        check_nonnegative("cache_seqlens", cache_seqlens)
    bs = kv_cache.shape[1]
    rows = ops.decode_rows(cache_seqlens, block_table, s_q, bs)
    positions, req = rows.positions, rows.req
    f, qk = front_and_index(ops, weights, indexer_weights, hidden.reshape(B * s_q, -1),
                            rows.slots, positions, kv_cache, index_k_cache, use_fp8_indexer)
    topk = indexer_weights.config.index_topk
    table32 = block_table.to(torch.int32)
    logits = starts = ends = None
    if is_byte_cache(index_k_cache):
        logits = ops.paged_logits(qk.q_index.view(B, s_q, *qk.q_index.shape[1:]), index_k_cache,
                                  qk.weights, rows.seq_lens, table32, block_table.shape[1] * bs)
        starts, ends = rows.row_starts, rows.row_ends
        local = ops.top_k(logits, starts, ends, topk)
    else:
        local = _select_float(qk, index_k_cache, block_table, req, positions, topk)
    slots = ops.convert(req, table32, local, bs)
    q = ops.absorb(weights, f.q_nope, f.q_pe)
    q = q.view(B, s_q, c.num_heads, c.latent_dim)
    o_lat, lse = ops.decode(q, kv_cache, slots.view(B, s_q, -1), c.softmax_scale,
                            is_byte_cache(kv_cache), head_dim_v=c.kv_lora_rank)
    return SparseTrace(front=f, index_k=qk.k_index, q_index=qk.q_index,
                       index_weights=qk.weights, logits=logits, row_starts=starts,
                       row_ends=ends, local=local, slots=slots, q=q, o_lat=o_lat, lse=lse,
                       out=ops.project(weights, o_lat))


def sparse_prefill_forward(
    weights: MLAWeights,
    indexer_weights: IndexerWeights,
    hidden: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: list[int],
    kv_cache: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    use_fp8_indexer: bool | None = None,
) -> torch.Tensor:
    """Sparse prefill of ``hidden [T, H]`` (requests split by ``query_start_loc``) after context.

    Request ``i`` has ``context_lens[i]`` tokens cached in ``kv_cache [nb, bs, Lkv+R]`` (or
    ``[nb, bs, 656]`` uint8 ``fp8_ds_mla``) and their index keys in
    ``index_k_cache [nb, bs, d_I]`` (or vLLM's fp8 ``[nb, bs, 132]`` uint8, read as vLLM does:
    gathered per request, ``fp8_mqa_logits``, ``top_k_per_row``); the new tokens are cached
    too. ``use_fp8_indexer``: with a float index cache, the official code's fp8
    quantize-dequantize (``None`` = False); an fp8 index cache needs True or None.
    Returns ``[T, H]``.
    """
    return run_sparse_prefill(REFERENCE_SPARSE_OPS, weights, indexer_weights, hidden,
                              query_start_loc, context_lens, kv_cache, index_k_cache,
                              block_table, use_fp8_indexer).out


def sparse_decode_forward(
    weights: MLAWeights,
    indexer_weights: IndexerWeights,
    hidden: torch.Tensor,
    kv_cache: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    use_fp8_indexer: bool | None = None,
) -> torch.Tensor:
    """Sparse decode of ``s_q`` new tokens per request: ``hidden [B, s_q, H] -> [B, s_q, H]``.

    ``cache_seqlens [B]`` counts the tokens cached before this step; new token ``j`` of
    request ``b`` sits at position ``cache_seqlens[b] + j`` and selects among the keys up to
    it (multi-token prediction with ``s_q > 1``). ``kv_cache`` is float or ``fp8_ds_mla``;
    ``index_k_cache`` float, or vLLM's fp8 cache read as vLLM does (``fp8_paged_mqa_logits``
    over the block table, ``top_k_per_row``); ``use_fp8_indexer`` as in the prefill.
    """
    return run_sparse_decode(REFERENCE_SPARSE_OPS, weights, indexer_weights, hidden, kv_cache,
                             index_k_cache, block_table, cache_seqlens, use_fp8_indexer).out


def sparse_masked_dense_forward(
    weights: MLAWeights,
    indexer_weights: IndexerWeights,
    hidden: torch.Tensor,
    positions: torch.Tensor | None = None,
    use_fp8_indexer: bool = False,
    fp8_kv_cache: bool = False,
) -> torch.Tensor:
    """The official formulation for one request, causal over its own tokens: ``[S, H] -> [S, H]``.

    ``scores = q·k (all keys) · scale + index_mask + causal_mask``, ``index_mask`` being ``0``
    on the indexer's selection and ``-inf`` elsewhere; then softmax, ``@ v``, ``@ W_O``. With
    ``fp8_kv_cache`` the latent is first rounded as an ``fp8_ds_mla`` cache would hold it.
    """
    c = weights.config
    check_float("hidden", hidden, shape=[None, c.hidden_size])
    S, N = hidden.shape[0], c.num_heads
    if positions is None:
        positions = torch.arange(S, device=hidden.device)
    check_index("positions", positions, shape=[S], device=hidden.device)
    f = mla_front(weights, hidden, positions)
    kv_c, k_pe = f.kv_c, f.k_pe
    if fp8_kv_cache:
        kv_c_q, k_pe_q = dequantize_fp8_ds_mla(quantize_fp8_ds_mla(kv_c, k_pe))
        kv_c, k_pe = kv_c_q.to(kv_c.dtype), k_pe_q.to(k_pe.dtype)
    local = indexer_topk(indexer_weights, weights, hidden, positions, use_fp8_indexer)
    selected = sparse_index_mask(local, S)
    causal = positions[None, :] <= positions[:, None]
    mask = torch.zeros(S, S, dtype=torch.float64, device=hidden.device)
    mask = mask.masked_fill(~selected, float("-inf")).masked_fill(~causal, float("-inf"))

    work = acc_dtype(hidden.dtype)
    k_nope = torch.einsum("sl,lnp->snp", kv_c, weights.W_UK)
    v = torch.einsum("sl,lnv->snv", kv_c, weights.W_UV)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(S, N, c.qk_rope_head_dim)], dim=-1)
    q = torch.cat([f.q_nope, f.q_pe], dim=-1)
    scores = torch.einsum("qnd,knd->nqk", q.to(work), k.to(work)) * c.softmax_scale
    scores = scores + mask.to(work)[None]
    probs = torch.softmax(scores, dim=-1)
    o = torch.einsum("nqk,knv->qnv", probs, v.to(work)).to(hidden.dtype)
    return o.flatten(-2) @ weights.W_O
