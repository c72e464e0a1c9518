"""vLLM 0.33.0's DeepSeek-V4 Triton kernels as a conformance target: the compressor
(``v4_compress``) and the indexer's q (``v4_indexer_q``).

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

``v4_scope_indices`` is not among the unpacked kernels (vLLM builds the indices with other
Triton kernels in ``common/ops/cache_utils.py``): "unsupported". The kernels run on CUDA, or on
the CPU under ``TRITON_INTERPRET=1`` (whose fp8 conversions may round ties differently from the
GPU's: a byte difference there may be the interpreter's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mla.conformance.adapters import import_peer, require, require_dtype, triton_runs_on

__all__ = ["target", "launch_compress", "v4_compress", "v4_indexer_q", "MODULE", "STATE_BLOCK"]

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


def target() -> dict[str, Callable]:
    """vLLM's DeepSeek-V4 compressor and indexer-q Triton kernels."""
    return {"v4_compress": v4_compress, "v4_indexer_q": v4_indexer_q}
