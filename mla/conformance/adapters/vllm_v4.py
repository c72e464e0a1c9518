"""vLLM 0.33.0's DeepSeek-V4 Triton kernels as a conformance target: the compressor
(``v4_compress``), the indexer's q (``v4_indexer_q``) and the scopes' indices
(``v4_scope_indices``).

``python -m benchmarks.peers --v4`` copies them verbatim from the wheel into
``<peers>/vllm/models/deepseek_v4/common/ops/v4_kernels.py``; they are called as vLLM calls them
(``common/ops/save_partial_states.py``, ``common/ops/fused_compress_quant_cache.py``,
``common/ops/fused_indexer_q.py``; ``launch_compress`` makes the compressor's two launches, for
this adapter, ``benchmarks/v4_peers_check.py`` and ``benchmarks/v4_layer.py``):

- ``v4_compress`` -> ``save_partial_states_kernel`` then
  ``_fused_kv_compress_norm_rope_insert_sparse_attn`` (``d = 512``, the MODEL1 cache: pages of
  ``256 / r`` records of 576 data bytes, then their 8 scale bytes, padded to a multiple of 576)
  or ``_fused_kv_compress_norm_rope_insert_indexer_attn`` (``d = 128``, the indexer's 132-byte
  records, ``MX_SCALE=False``: a float32 scale), one program per token. The adapter lays the
  catalogue's state out as vLLM's fp32 state cache (pages of 4 tokens for ratio 4, 8 for 128,
  ``[kv ‖ score]`` a row, pages scrambled behind a block table, block 0 the null block, rows
  never written NaN), writes the new tokens with ``save_partial_states_kernel`` (its ``ape``
  zeros: the catalogue's scores have ``ape`` added already, and ``x + 0`` is exact), runs the
  compress kernel into a poisoned (``0xA5``) paged cache at the entries' slots, and reads each
  entry's record back (data bytes, then scale bytes). With no new tokens nothing is launched
  (vLLM launches nothing for an empty batch). On CUDA vLLM runs CuTe-DSL kernels for ``d =
  512`` instead; they are not in the wheel's importable set: this is its Triton path.
- ``v4_indexer_q`` -> ``fused_indexer_q_rope_quant_kernel[(T, H)]`` (``FP8_MAX=448``, OCP
  e4m3, no explicit FMA), the codes returned as their bytes.
- ``v4_scope_indices`` -> the kernels vLLM's metadata builders and its FlashMLA layer launch
  (``v1/attention/backends/mla/sparse_swa.py``, ``common/ops/cache_utils.py``,
  ``deepseek_v4/sparse_mla.py``; ``nvidia/flashmla.py`` the callers), with their arguments: the
  whole batch goes down the case's path (vLLM sends a request of at most ``1 +
  num_speculative_tokens`` tokens to its decode path; the kernels take either), its tokens laid
  out request by request (``query_start_loc``), none of them padding (``is_valid_token`` all
  true), nothing replayed (``replay_start`` 0), no image spans.
  Decode: ``_compute_swa_indices_and_lens_kernel[(T,)]`` (the window's slots over pages of 64,
  into the builder's zeroed ``[T, 1, window]`` buffer); ratio 4:
  ``compute_global_topk_indices_and_lens_kernel[(T,)]`` (the top-k ids' slots over pages of 64
  entries, each id where the indexer put it, the valid ones counted); ratio 128:
  ``build_c128a_topk_metadata_kernel[(T,)]`` (every visible entry's slot over pages of 2,
  ``active_topk_width`` wide: a power of 2, at least 128; ``max_model_len`` the longest
  request); ratio 1: no second scope (returned as ``[T, 0]``, lengths 0).
  Prefill: ``compute_prefill_metadata_kernel`` (the gather lengths), the chunk plan's ``N`` and
  ``M`` (one chunk: at most 4 requests), the top-k ids (ratio 4: the indexer's; ratio 128:
  ``build_c128a_topk_metadata_kernel``'s local ids; ratio 1: an unread buffer, ``TOP_K = 0``),
  then ``combine_topk_swa_indices_kernel[(B, 256)]`` into a ``-1``-filled ``[T, round_up(top_k
  + window, 128)]``.
  A row wider than the contract's (C128A's widths aligned to 128) is cut to the contract's width
  where every column past it is ``-1`` (vLLM's padding), else returned whole. Refused: an empty
  batch, tokens not grouped by request, a request without tokens, more than 4 prefill requests
  (vLLM prefills them in chunks, each its own workspace), a prefill window not a power of 2.
  Where vLLM differs (tests/test_conformance_vllm_v4_scope.py): it maps a C4A decode row's
  top-k ids in place, ``-1`` where the indexer left it (the catalogue's named "the top-k's -1
  left in place"), and its prefill takes the first ``min((p + 1) // 4, K)`` ids of a row as
  they are (a ``-1`` among them becomes ``M·b - 1`` and counts in the length; a valid id after
  them is dropped): both assume the indexer's rows hold their valid ids first, exactly ``min(n,
  K)`` of them, as vLLM's top-k writes them.

The kernels run on CUDA, or on the CPU under ``TRITON_INTERPRET=1`` (whose fp8 conversions may
round ties differently from the GPU's: a byte difference there may be the interpreter's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mla.conformance.adapters import import_peer, require, require_dtype, triton_runs_on

__all__ = ["target", "launch_compress", "v4_compress", "v4_indexer_q", "v4_scope_indices",
           "MODULE", "STATE_BLOCK", "SCOPE_KERNELS"]

PEER = "vLLM 0.33's DeepSeek-V4 Triton kernels"
MODULE = "vllm.models.deepseek_v4.common.ops.v4_kernels"
STATE_BLOCK = {4: 4, 128: 8}  # the compressor state cache's tokens a page (vLLM's)
KV_PAGE_TOKENS = 256  # a compressed-cache page covers 256 tokens: 256 / r entries
PAGE_ALIGN = 576  # compressed-cache pages are padded to a multiple of this many bytes
FILL = 0xA5  # cache bytes never written
_RECORD = {512: (576, 8), 128: (128, 4)}  # data bytes, scale bytes a record


def _kernels() -> object:
    return import_peer(MODULE, PEER, "unpack it with python -m benchmarks.peers --v4")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_compress(mod: object, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                    positions: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                    state_block: int, token_req: torch.Tensor, block_table: torch.Tensor,
                    norm_weight: torch.Tensor, rms_norm_eps: float, cos_sin: torch.Tensor,
                    kv_cache: torch.Tensor, kv_slots: torch.Tensor, ratio: int) -> None:
    """vLLM's two launches for ``T`` new tokens, as its compressor makes them:
    ``save_partial_states_kernel`` writes each token's ``kv [T, W]`` and ``score + ape`` into
    the state cache at ``slots`` (pages of ``state_block`` rows), then the fused compress,
    norm, RoPE, quantize and store kernel of ``d = norm_weight.shape[0]`` (512: MODEL1
    records; 128: the indexer's) pools the window of each token that closes an entry (its
    request ``token_req``, whose state pages ``block_table`` names) into ``kv_cache`` ``[pages,
    records, bytes]`` at ``kv_slots`` (``-1``: none). ``mod``: the unpacked kernels module."""
    T, W = kv.shape
    d = norm_weight.shape[0]
    mod.save_partial_states_kernel[(T,)](  # type: ignore[attr-defined]
        kv, kv.stride(0), score, score.stride(0), ape, ape.stride(0), positions, state,
        state.stride(0), state.stride(1), slots, state_block, HEAD_SIZE=W,
        TRITON_BLOCK_SIZE=_next_pow2(W), STATE_WIDTH=W, COMPRESS_RATIO=ratio)
    common = (state, state.stride(0), state.stride(1), token_req, positions, slots,
              block_table, block_table.stride(0), state_block, norm_weight, float(rms_norm_eps),
              cos_sin, cos_sin.stride(0), kv_cache, kv_slots, kv_cache.shape[1])
    consts = dict(HEAD_SIZE=d, TRITON_BLOCK_SIZE=_next_pow2(d), STATE_WIDTH=W,
                  COMPRESS_RATIO=ratio, OVERLAP=ratio == 4, ROPE_HEAD_DIM=64, FP8_MAX=448.0,
                  KV_BLOCK_STRIDE=kv_cache.stride(0))
    if d == 512:
        mod._fused_kv_compress_norm_rope_insert_sparse_attn[(T,)](  # type: ignore[attr-defined]
            *common, **consts, QUANT_BLOCK=64, TOKEN_STRIDE=576, SCALE_DIM=8,
            SANITIZE_CACHE_NANS=False, num_warps=4)
    else:
        mod._fused_kv_compress_norm_rope_insert_indexer_attn[(T,)](  # type: ignore[attr-defined]
            *common, **consts, QUANT_BLOCK=128, TOKEN_STRIDE=128, SCALE_DIM=4, MX_SCALE=False,
            num_warps=1)


def v4_compress(kv: torch.Tensor, score: torch.Tensor, state_kv: torch.Tensor,
                state_score: torch.Tensor, positions: torch.Tensor, norm_weight: torch.Tensor,
                cos_sin: torch.Tensor, ratio: int, rms_norm_eps: float = 1e-6) -> torch.Tensor:
    """vLLM's state save and compress+norm+rope+quant+store kernels with the catalogue's
    ``v4_compress`` contract."""
    triton_runs_on(PEER, kv, score, state_kv, state_score, positions, norm_weight, cos_sin)
    require_dtype(PEER, (torch.float32,), kv=kv, score=score, state_kv=state_kv,
                  state_score=state_score, cos_sin=cos_sin)
    d = norm_weight.shape[0]
    require(d in _RECORD and ratio in STATE_BLOCK, PEER,
            f"stores d = 512 or 128 at ratio 4 or 128, got d = {d}, ratio {ratio}")
    dev = kv.device
    data_bytes, scale_bytes = _RECORD[d]
    row = data_bytes + scale_bytes
    T = kv.shape[0]
    coff = 2 if ratio == 4 else 1
    width, rows = coff * d, coff * ratio
    start = int(positions[0]) if T else 0
    ids = torch.arange(start // ratio, (start + T) // ratio)
    if T == 0:
        return torch.empty(0, row, dtype=torch.uint8, device=dev)
    mod = _kernels()

    # the state cache: padded pages of bs rows [kv ‖ score], scrambled, block 0 the null block
    bs = STATE_BLOCK[ratio]
    n_blocks = -(-(start + T) // bs)
    g = torch.Generator().manual_seed(start * 7919 + T)
    phys = torch.randperm(n_blocks, generator=g) + 1
    state_buf = torch.full((n_blocks + 1, bs + 1, 2 * width), float("nan"), dtype=torch.float32,
                           device=dev)
    state = state_buf[:, :bs]
    block_table = torch.zeros(1, n_blocks + 2, dtype=torch.int32)
    block_table[0, :n_blocks] = phys.int()
    block_table = block_table.to(dev)
    old = torch.arange(max(start - rows, 0), start)  # the state's rows of positions >= 0
    if old.numel():
        src = old - (start - rows)
        state[phys[old // bs].to(dev), (old % bs).to(dev)] = torch.cat(
            [state_kv[src.to(dev)], state_score[src.to(dev)]], dim=1)
    pos = torch.arange(start, start + T)
    slots = (phys[pos // bs] * bs + pos % bs).to(dev)
    kv_c, score_c = kv.contiguous(), score.contiguous()
    ape = torch.zeros(ratio, width, dtype=torch.float32, device=dev)
    positions64 = positions.to(device=dev, dtype=torch.int64).contiguous()

    # the compressed cache: pages of 256 / r records, poisoned, scrambled
    kv_bs = max(KV_PAGE_TOKENS // ratio, 1)
    page = -(-kv_bs * row // PAGE_ALIGN) * PAGE_ALIGN
    n_kv = max(-(-int((start + T) // ratio) // kv_bs), 1)
    kv_phys = torch.randperm(n_kv, generator=g) + 1
    kv_buf = torch.full((n_kv + 1, page), FILL, dtype=torch.uint8, device=dev)
    kv_cache = kv_buf.as_strided((n_kv + 1, kv_bs, row), (page, row, 1))
    ent = pos // ratio
    kv_slots = torch.where((pos + 1) % ratio == 0,
                           kv_phys[(ent // kv_bs).clamp_max(n_kv - 1)] * kv_bs + ent % kv_bs,
                           -1).to(dev)
    launch_compress(mod, kv_c, score_c, ape, positions64, state, slots, bs,
                    torch.zeros(T, dtype=torch.int32, device=dev), block_table, norm_weight,
                    rms_norm_eps, cos_sin.contiguous(), kv_cache, kv_slots, ratio)
    blk = kv_phys[ids // kv_bs].to(dev)
    off = (ids % kv_bs).to(dev)
    data = kv_buf[blk[:, None], off[:, None] * data_bytes
                  + torch.arange(data_bytes, device=dev)]
    scales = kv_buf[blk[:, None], kv_bs * data_bytes + off[:, None] * scale_bytes
                    + torch.arange(scale_bytes, device=dev)]
    return torch.cat([data, scales], dim=1)


def v4_indexer_q(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                 cos_sin: torch.Tensor, softmax_scale: float, head_scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``fused_indexer_q_rope_quant_kernel`` with the catalogue's ``v4_indexer_q``
    contract."""
    triton_runs_on(PEER, q, weights, positions, cos_sin)
    require_dtype(PEER, (torch.bfloat16,), q=q, weights=weights)
    require_dtype(PEER, (torch.float32,), cos_sin=cos_sin)
    T, H, D = q.shape
    dev = q.device
    q_fp8 = torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=dev)
    w_out = torch.empty(T, H, dtype=torch.float32, device=dev)
    if T == 0:
        return q_fp8.view(torch.uint8), w_out
    mod = _kernels()
    q, weights, cs = q.contiguous(), weights.contiguous(), cos_sin.contiguous()
    extra = {"enable_fp_fusion": True} if dev.type == "cuda" else {}
    mod.fused_indexer_q_rope_quant_kernel[(T, H)](  # type: ignore[attr-defined]
        positions.to(torch.int64).contiguous(), q, q.stride(0), q.stride(1), cs, cs.stride(0),
        cs.shape[-1] // 2, q_fp8, q_fp8.stride(0), q_fp8.stride(1), D,
        weights, weights.stride(0), float(softmax_scale), float(head_scale), w_out,
        w_out.stride(0), FP8_MAX=448.0, USE_FNUZ=False, USE_EXPLICIT_FMA=False, num_warps=1,
        **extra)
    return q_fp8.view(torch.uint8), w_out


# ---- v4_scope_indices ---------------------------------------------------------------------------

SCOPE_PEER = "vLLM 0.33's DeepSeek-V4 scope-index Triton kernels"
WINDOW_PAGE = 64  # the SWA cache's block_size (tokens a page)
COMPRESSED_PAGE = 256  # the compressed cache's block_size in tokens: 256 / r entries a page
PREFILL_CHUNK_SIZE = 4  # DeepseekV4Attention.PREFILL_CHUNK_SIZE: requests a prefill workspace
INDEX_TOPK = 512  # DeepSeek-V4's index_topk: the top-k buffer's width (read by no window-only row)
TOPK_ALIGN = 128  # _C128A_TOPK_ALIGNMENT and _SPARSE_PREFILL_TOPK_ALIGNMENT
NUM_WORKERS = 256  # CombineTopkSwaIndicesKernel.NUM_WORKERS
BLOCK = 1024  # the TRITON_BLOCK_SIZE / BLOCK_SIZE vLLM's launchers pass
SCOPE_KERNELS = ("_compute_swa_indices_and_lens_kernel", "compute_prefill_metadata_kernel",
                 "compute_global_topk_indices_and_lens_kernel", "combine_topk_swa_indices_kernel",
                 "build_c128a_topk_metadata_kernel")


def _scope_kernels() -> object:
    """The unpacked kernels module, holding the scope kernels (``Unsupported`` if one unpacked
    before ``benchmarks.peers --v4`` copied them)."""
    mod = _kernels()
    missing = [k for k in SCOPE_KERNELS if not hasattr(mod, k)]
    require(not missing, SCOPE_PEER, f"are not in {MODULE} (no {', '.join(missing)}: it "
            "was unpacked before benchmarks.peers --v4 copied them); rerun python -m "
            "benchmarks.peers --v4")
    return mod


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _trimmed(indices: torch.Tensor, width: int) -> torch.Tensor:
    """``indices`` cut to the contract's ``width`` where every column past it is ``-1`` (vLLM's
    padding to FlashMLA's alignment); else as they are, so that what vLLM wrote there shows."""
    if indices.shape[1] > width and bool((indices[:, width:] == -1).all()):
        return indices[:, :width]
    return indices


def _c128a_ids(mod: object, positions: torch.Tensor, num_decode_tokens: int,
               token_to_req: torch.Tensor, table: torch.Tensor, max_seq_len: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``build_c128a_topk_metadata`` as the C128A metadata builder calls it, max_model_len the
    batch's longest request: ``(global decode slots, decode lengths, prefill local ids)``,
    ``active_topk_width`` wide (a power of 2, at least 128)."""
    T, dev = positions.shape[0], positions.device
    widest = _round_up(-(-max_seq_len // 128), TOPK_ALIGN)  # c128a_max_compressed
    active = min(max(_next_pow2(max(max_seq_len // 128, 1)), TOPK_ALIGN), widest)
    decode = torch.empty(T, widest, dtype=torch.int32, device=dev)
    lens = torch.empty(T, dtype=torch.int32, device=dev)
    prefill = torch.empty(T, widest, dtype=torch.int32, device=dev)
    slot_mapping = torch.zeros(T, dtype=torch.int64, device=dev)  # >= 0: no padding token
    mod.build_c128a_topk_metadata_kernel[(T,)](  # type: ignore[attr-defined]
        global_decode_ptr=decode, global_decode_stride=decode.stride(0), decode_lens_ptr=lens,
        prefill_local_ptr=prefill, prefill_local_stride=prefill.stride(0),
        positions_ptr=positions, compress_ratio=128, max_compressed_tokens=active,
        num_decode_tokens=num_decode_tokens, token_to_req_indices_ptr=token_to_req,
        block_table_ptr=table, block_table_stride=table.stride(0),
        block_size=COMPRESSED_PAGE // 128, slot_mapping_ptr=slot_mapping, BLOCK_SIZE=BLOCK)
    n = num_decode_tokens
    return decode[:n, :active], lens[:n], prefill[n:, :active]


def _decode_scopes(mod: object, positions: torch.Tensor, token_to_req: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                   window_table: torch.Tensor, compressed_table: torch.Tensor | None,
                   topk: torch.Tensor | None, ratio: int, window: int
                   ) -> tuple[torch.Tensor, ...]:
    """The decode path's two scopes (``DeepseekSparseSWAMetadataBuilder.build``,
    ``DeepseekV4FlashMLAAttention._forward_decode``), every token a decode token."""
    T, B, dev = positions.shape[0], seq_lens.shape[0], positions.device
    is_valid = torch.ones(T, dtype=torch.bool, device=dev)
    swa = torch.zeros(T, 1, window, dtype=torch.int32, device=dev)  # the builder's buffers
    swa_lens = torch.zeros(T, dtype=torch.int32, device=dev)
    replay_start = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    mod._compute_swa_indices_and_lens_kernel[(T,)](  # type: ignore[attr-defined]
        swa_indices_ptr=swa, swa_indices_stride=swa.stride(0), swa_lens_ptr=swa_lens,
        window_size=window, index_width=swa.shape[-1], left_visible_ptr=swa_lens,
        right_visible_ptr=swa_lens, query_start_loc_ptr=query_start_loc,
        seq_lens_ptr=seq_lens, token_to_req_indices_ptr=token_to_req,
        is_valid_token_ptr=is_valid, block_table_ptr=window_table,
        block_table_stride=window_table.stride(0), block_size=WINDOW_PAGE,
        replay_start_ptr=replay_start, token_offset=0, HAS_IMAGE=False,
        TRITON_BLOCK_SIZE=BLOCK)
    if ratio == 1:  # a window-only layer: no second scope
        extra = torch.full((T, 0), -1, dtype=torch.int32, device=dev)
        return swa[:, 0], swa_lens, extra, torch.zeros(T, dtype=torch.int32, device=dev)
    assert compressed_table is not None
    if ratio == 4:
        assert topk is not None
        extra = torch.empty_like(topk)
        extra_lens = torch.empty(T, dtype=torch.int32, device=dev)
        mod.compute_global_topk_indices_and_lens_kernel[(T,)](  # type: ignore[attr-defined]
            global_topk_indices_ptr=extra, global_topk_indices_stride=extra.stride(0),
            topk_lens_ptr=extra_lens, topk_indices_ptr=topk, topk_indices_stride=topk.stride(0),
            topk=topk.shape[-1], token_to_req_indices_ptr=token_to_req,
            block_table_ptr=compressed_table, block_table_stride=compressed_table.stride(0),
            block_size=COMPRESSED_PAGE // 4, is_valid_token_ptr=is_valid,
            TRITON_BLOCK_SIZE=BLOCK)
        return swa[:, 0], swa_lens, extra, extra_lens
    extra, extra_lens, _ = _c128a_ids(mod, positions, T, token_to_req, compressed_table,
                                      int(seq_lens.max()))
    width = max(1, (int(positions.max()) + 1) // 128)  # the contract's
    return swa[:, 0], swa_lens, _trimmed(extra, width), extra_lens


def _prefill_scopes(mod: object, positions: torch.Tensor, token_to_req: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    compressed_table: torch.Tensor | None, topk: torch.Tensor | None,
                    ratio: int, window: int, counts: list[int], lens: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill path's combined indices (``_build_deepseek_v4_metadata``,
    ``get_prefill_chunk_plan``, ``DeepseekV4FlashMLAAttention._forward_prefill``), every
    request a prefill request, in one chunk."""
    T, B, dev = positions.shape[0], seq_lens.shape[0], positions.device
    replay_start = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    gather_lens = torch.empty(B, dtype=torch.int32, device=dev)
    mod.compute_prefill_metadata_kernel[(1,)](  # type: ignore[attr-defined]
        prefill_gather_lens_ptr=gather_lens, seq_lens_ptr=seq_lens,
        query_start_loc_ptr=query_start_loc, replay_start_ptr=replay_start, num_prefills=B,
        num_decodes=0, window_size=window, BLOCK_SIZE=_next_pow2(B))
    # get_prefill_chunk_plan on the host: at most PREFILL_CHUNK_SIZE requests always fit one
    # chunk (its area bound holds a max_model_len and max_num_batched_tokens the batch fits)
    n_comp = [L // ratio if ratio > 1 else 0 for L in lens]
    gather = [q + min(max(L - q, 0), window - 1) for q, L in zip(counts, lens)]
    chunk_n = max(n_comp)
    chunk_m = chunk_n + max(gather)
    if ratio == 4:
        assert topk is not None
        topk_ids, top_k = topk, topk.shape[-1]
    elif ratio == 128:
        assert compressed_table is not None
        _, _, topk_ids = _c128a_ids(mod, positions, 0, token_to_req, compressed_table[:0],
                                    max(lens))
        top_k = topk_ids.shape[-1]
    else:  # a window-only layer: the indexer's buffer, unread (TOP_K = 0)
        topk_ids, top_k = torch.empty(T, INDEX_TOPK, dtype=torch.int32, device=dev), 0
    combined = torch.full((T, _round_up(top_k + window, TOPK_ALIGN)), -1, dtype=torch.int32,
                          device=dev)
    combined_lens = torch.empty(T, dtype=torch.int32, device=dev)
    mod.combine_topk_swa_indices_kernel[(B, NUM_WORKERS)](  # type: ignore[attr-defined]
        combined_indices_ptr=combined, combined_indices_stride=combined.stride(0),
        combined_lens_ptr=combined_lens, topk_indices_ptr=topk_ids,
        topk_indices_stride=topk_ids.stride(0), query_start_loc_ptr=query_start_loc,
        seq_lens_ptr=seq_lens, gather_lens_ptr=gather_lens, left_visible_ptr=topk_ids,
        right_visible_ptr=topk_ids, M=chunk_m, N=chunk_n, TOP_K=top_k, COMPRESS_RATIO=ratio,
        WINDOW_SIZE=window, IMAGE_WIDTH=0, PADDED_TOP_K=_next_pow2(topk_ids.shape[-1]))
    widest = {1: 0, 4: top_k, 128: max(1, max(lens) // 128)}[ratio]
    return _trimmed(combined, _round_up(widest + window, TOPK_ALIGN)), combined_lens


def v4_scope_indices(positions: torch.Tensor, token_to_req: torch.Tensor,
                     seq_lens: torch.Tensor, window_table: torch.Tensor,
                     compressed_table: torch.Tensor | None, topk: torch.Tensor | None,
                     ratio: int, window: int, path: str = "decode"
                     ) -> tuple[torch.Tensor, ...]:
    """vLLM's scope-index kernels with the catalogue's ``v4_scope_indices`` contract (the
    module doc says which and how)."""
    tensors = [t for t in (positions, token_to_req, seq_lens, window_table, compressed_table,
                           topk) if t is not None]
    triton_runs_on(SCOPE_PEER, *tensors)
    require(path in ("decode", "prefill"), SCOPE_PEER, f"have no path {path!r}")
    require(not isinstance(ratio, bool) and ratio in (1, 4, 128), SCOPE_PEER,
            f"build the scopes of compress ratios 1, 4 and 128, got {ratio!r}")
    require(not isinstance(window, bool) and isinstance(window, int) and window > 0, SCOPE_PEER,
            f"take a positive int window, got {window!r}")
    require(ratio == 1 or compressed_table is not None, SCOPE_PEER,
            f"need the compressed cache's block table at ratio {ratio}")
    require(ratio != 4 or topk is not None, SCOPE_PEER, "need the indexer's top-k at ratio 4")
    T, B, dev = positions.shape[0], seq_lens.shape[0], positions.device
    require(T > 0, SCOPE_PEER, "launch nothing for an empty batch")
    req = token_to_req.long().cpu()
    counts = torch.bincount(req.clamp(0, max(B - 1, 0)), minlength=B).tolist()
    require(bool((req[1:] >= req[:-1]).all()) and int(req[0]) >= 0 and int(req[-1]) < B
            and min(counts) > 0, SCOPE_PEER,
            "lay a batch out request by request, each request's tokens together and in order "
            "(query_start_loc), every request with a token; got token_to_req "
            f"{req.tolist()[:12]} for {B} requests")
    lens = [int(x) for x in seq_lens.tolist()]
    if path == "prefill":
        require(B <= PREFILL_CHUNK_SIZE, SCOPE_PEER,
                f"prefill at most {PREFILL_CHUNK_SIZE} requests a workspace (more are split "
                f"into chunks, each its own workspace), got {B}")
        require(window & (window - 1) == 0, SCOPE_PEER,
                f"combine a power-of-2 window (tl.arange(0, WINDOW_SIZE)), got {window}")
    mod = _scope_kernels()

    def i32(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=dev, dtype=torch.int32).contiguous()

    query_start_loc = i32(torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()]))
    args = (positions.to(device=dev, dtype=torch.int64).contiguous(), i32(token_to_req),
            query_start_loc, i32(seq_lens))
    ctab = None if compressed_table is None else i32(compressed_table)
    ids = None if topk is None or ratio != 4 else i32(topk)
    if path == "decode":
        return _decode_scopes(mod, *args, i32(window_table), ctab, ids, ratio, window)
    return _prefill_scopes(mod, *args, ctab, ids, ratio, window, counts, lens)


def target() -> dict[str, Callable]:
    """vLLM's DeepSeek-V4 compressor, indexer-q and scope-index Triton kernels."""
    return {"v4_compress": v4_compress, "v4_indexer_q": v4_indexer_q,
            "v4_scope_indices": v4_scope_indices}
