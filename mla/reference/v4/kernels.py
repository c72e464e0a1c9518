"""DeepSeek-V4's compressor and indexer-q as GPU kernels see them: the kernel-level contracts of
``v4_compress`` and ``v4_indexer_q`` (``mla.conformance``'s catalogue kernels of those names).

The model-level functions (``compressor.compressor_step``, ``indexer.v4_indexer_q``) start from
hidden states and weights; a kernel starts after the GEMMs, from fp32 ``kv`` and ``score`` (the
compressor) or bf16 ``q`` and weights (the indexer), with a RoPE table. These take exactly what
vLLM 0.33's Triton kernels (``save_partial_states`` + ``_fused_kv_compress_norm_rope_insert_*``,
``fused_indexer_q_rope_quant_kernel``) and a future ``mla.fast`` kernel take, and return the
bytes they store.

``v4_compress(kv, score, state_kv, state_score, positions, norm_weight, cos_sin, ratio,
rms_norm_eps) -> uint8 [m, 584] | [m, 132]``, one request:

- ``positions [T]`` int: consecutive positions ``start .. start+T-1`` of the new tokens;
  ``kv``, ``score [T, coff·d]`` float32: their ``x @ wkv^T`` and ``x @ wgate^T + ape[p mod r]``
  (``coff = 2`` for ``ratio = 4``, which overlaps; 1 for 128); ``d = norm_weight.shape[0]``,
  512 (the attention's compressor) or 128 (the indexer's);
- ``state_kv``, ``state_score [coff·r, coff·d]`` float32: the same rows of positions
  ``start - coff·r .. start - 1`` (the state vLLM keeps). Rows of positions ``< 0`` hold
  anything (NaN in the catalogue) and must not be read;
- ``cos_sin [P, 64]`` float32: row ``p`` the cosines of the 32 angles at position ``p``, then
  their sines (vLLM's ``cos_sin_cache``); the RoPE uses these values;
- the entries whose window closes among the new tokens, ids ``j = start // r .. (start + T)
  // r - 1`` in order: entry ``j`` pools positions ``[j·r + r - coff·r, j·r + r - 1]``
  (``mla.reference.v4.compressor``), RMSNorm (``norm_weight``, ``rms_norm_eps``), RoPE
  GPT-J on the last 64 dims at position ``j·r`` (the block's first), then stored:
- ``d = 512``: the MODEL1 record of 584 bytes: 448 e4m3 codes of ``bf16(n)[0:448]``, the 64
  rotated values as bf16 (128 bytes), 7 UE8M0 scale bytes (one per 64), one 0 byte. The
  scale is ``2^ceil(log2(max(amax, 1e-4) / 448))`` (``scale_floor="vllm"``: vLLM's Triton
  kernels, the same floor as the indexer's and V4.1's MXFP8); vLLM's CuTe-DSL kernels and
  FlashMLA floor ``amax/448`` at ``1e-4`` instead (``"flashmla"``), which differs for tiles with
  ``amax <= 448·2^-14``;
- ``d = 128``: the indexer key cache's 132 bytes: 128 e4m3 codes of the bf16 rotated entry,
  then its float32 power-of-two scale (little endian), the same floor.

``v4_indexer_q(q, weights, positions, cos_sin, softmax_scale, head_scale) -> (q_fp8 uint8 [T,
H, D], weights_out float32 [T, H])``: ``q [T, H, D]`` bf16 (``wq_b``'s output), ``weights [T,
H]`` bf16 (``weights_proj``'s); per (token, head) the last 64 dims are rotated (GPT-J, row
``positions[t]`` of ``cos_sin``) and rounded to bf16, then all ``D`` are e4m3 codes with
``q_scale = 2^ceil(log2(max(amax, 1e-4) / 448))``; ``weights_out = weights · q_scale ·
softmax_scale · head_scale`` (``D^-0.5`` and ``H^-0.5`` in DeepSeek-V4).

``v4_output(attn, positions, cos_sin, wo_a, wo_b) -> out bf16 [T, hidden]``, equations (8)-(9)
of ``mla.reference.v4.layer`` with the table's values: ``attn [T, H, 512]`` bf16 (the
attention's output, sink applied), ``positions [T]`` the queries' positions, ``wo_a [G·R,
(H/G)·512]`` (the checkpoint's ``wo_a.weight``: group ``g`` its rows ``[g·R, g·R + R)``, ``G``
from the shapes) and ``wo_b [hidden, G·R]``, bf16. ``o = bf16(rope_p^-1(attn))`` (the last 64
dims, GPT-J pairs ``(a, b) -> (a c + b s, b c - a s)`` with row ``p`` of ``cos_sin``), heads
``[g·H/G, (g+1)·H/G)`` concatenated into ``y_g``, ``z_g = bf16(wo_a[g] y_g)``, ``out =
bf16(concat_g z_g · wo_b^T)``: vLLM's bf16 path (the checkpoint's FP8 weights dequantized; the
FP8 quantization of ``y_g`` before an FP8 ``wo_a`` is not emulated).

``v4_indexer_topk(q_fp8, weights, k_cache, block_table, positions, topk) -> int32 [T, topk]``,
the C4A indexer's selection from its prepared query (``v4_indexer_q``'s outputs): ``q_fp8 [T,
H, 128]`` e4m3 codes (``uint8`` read as e4m3), ``weights [T, H]`` float32 (q's scale folded
in), ``k_cache uint8 [nb, bs, 132]`` the compressed indexer keys in ``indexer_cache``'s page
layout (``v4_compress``'s ``d = 128`` records: per page the codes of its ``bs`` entries, then
their float32 scales), ``block_table [T, pages]`` int32 (each query's request's pages),
``positions [T]``. Query ``t`` sees the entries ``j < n_t = (p_t + 1) // 4`` (an entry from its
block's last token on); their logits ``Σ_h w_h · ReLU(q_h · k_j) · k_scale_j`` (float64 here,
``fp8_paged_mqa_logits`` with one query a row), and the row is ``top_k_per_row``'s: the
``min(topk, n_t)`` highest as local entry ids, ties to the lower id, NaN above every number,
then ``-1``. vLLM skips the logits when every row's entries fit (``n_t <= topk``) and fills
``[0 .. n_t - 1, -1, ..]``: the same set, and the selection is a set (its order is free).

Everything here is float64 on the kernels' inputs; ``compress_entries``, ``indexer_q_values``,
``v4_output_values`` and ``v4_indexer_topk_logits`` expose the values before rounding or
selection (and, for the catalogue's named convention differences, the usual wrong variants).
"""

from __future__ import annotations

import torch

from mla.reference.fp8 import act_quant
from mla.reference.front import rms_norm
from mla.reference.indexer_logits import fp8_paged_mqa_logits, top_k_per_row
from mla.reference.v4.compressor import (
    compressed_entries_model1_pages,
    pool_windows,
    quantize_compressed_indexer_entries,
)
from mla.validation import check_float, check_index, check_tensor

__all__ = ["v4_compress", "v4_indexer_q", "v4_output", "v4_indexer_topk", "compress_entries",
           "compress_records", "indexer_q_values", "indexer_q_records", "rotate_with_table",
           "v4_output_values", "v4_indexer_topk_logits", "MODEL1_RECORD", "INDEXER_RECORD",
           "ROPE_DIM", "SCALE_FLOORS", "INDEXER_RATIO", "check_output_args",
           "check_indexer_topk_args"]

MODEL1_RECORD = 584  # 448 e4m3 + 64 bf16 + 7 UE8M0 + 1 pad
INDEXER_RECORD = 132  # 128 e4m3 + one float32 scale
ROPE_DIM = 64
SCALE_FLOORS = ("vllm", "flashmla")
HEAD_DIM = 512
INDEXER_RATIO = 4  # the indexer's keys: one compressed entry per 4 tokens
_F64 = torch.float64


def rotate_with_table(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
                      ) -> torch.Tensor:
    """GPT-J RoPE of the last 64 dims of ``x [S, ..., D]`` (float64) at ``positions [S]``, with
    the table's values (row ``p``: 32 cosines, then 32 sines)."""
    half = ROPE_DIM // 2
    rows = cos_sin.to(_F64)[positions.long().cpu()].to(x.device)
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [half]
    cos, sin = rows[:, :half].reshape(shape), rows[:, half:2 * half].reshape(shape)
    rot = x[..., x.shape[-1] - ROPE_DIM:]
    a, b = rot[..., 0::2], rot[..., 1::2]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :x.shape[-1] - ROPE_DIM], out), dim=-1)


def _check_compress(kv: torch.Tensor, score: torch.Tensor, state_kv: torch.Tensor,
                    state_score: torch.Tensor, positions: torch.Tensor,
                    norm_weight: torch.Tensor, cos_sin: torch.Tensor, ratio: int) -> int:
    if isinstance(ratio, bool) or ratio not in (4, 128):
        raise ValueError(f"ratio must be 4 or 128, got {ratio!r}")
    check_float("norm_weight", norm_weight, ndim=1)
    d = norm_weight.shape[0]
    if d not in (512, 128):
        raise ValueError(f"norm_weight must have 512 (MODEL1) or 128 (the indexer's) entries, "
                         f"got {d}")
    coff = 2 if ratio == 4 else 1
    check_float("kv", kv, shape=[None, coff * d])
    check_float("score", score, shape=list(kv.shape))
    check_float("state_kv", state_kv, shape=[coff * ratio, coff * d])
    check_float("state_score", state_score, shape=[coff * ratio, coff * d])
    check_index("positions", positions, shape=[kv.shape[0]])
    check_float("cos_sin", cos_sin, shape=[None, ROPE_DIM])
    T = kv.shape[0]
    if T:
        start = int(positions[0])
        if start < 0 or not torch.equal(positions.long().cpu(),
                                        torch.arange(start, start + T)):
            raise ValueError("positions must be consecutive and >= 0 (one request's new "
                             "tokens)")
        last = (start + T) // ratio * ratio - ratio
        if last >= cos_sin.shape[0]:
            raise ValueError(f"cos_sin must have a row for position {last}, has "
                             f"{cos_sin.shape[0]}")
    return d


def compress_entries(kv: torch.Tensor, score: torch.Tensor, state_kv: torch.Tensor,
                     state_score: torch.Tensor, positions: torch.Tensor,
                     norm_weight: torch.Tensor, cos_sin: torch.Tensor, ratio: int,
                     rms_norm_eps: float = 1e-6, *, overlap: bool | None = None,
                     rope_at: str = "first", read_masked: bool = False) -> torch.Tensor:
    """The float64 entries ``[m, d]`` (pooled, normed, rotated; not rounded) that
    ``v4_compress`` stores. The keywords give the usual wrong variants: ``overlap=False`` for a
    ratio-4 compressor (its own 4 tokens only, channels ``[0, d)``), ``rope_at="last"`` (the
    block's last position ``j·r + r - 1``), ``read_masked`` (window positions ``< 0`` read from
    the state instead of masked)."""
    d = _check_compress(kv, score, state_kv, state_score, positions, norm_weight, cos_sin,
                        ratio)
    if rope_at not in ("first", "last"):
        raise ValueError(f"rope_at must be 'first' or 'last', got {rope_at!r}")
    coff_state = 2 if ratio == 4 else 1
    coff = coff_state if overlap is None else (2 if overlap else 1)
    T = kv.shape[0]
    start = int(positions[0]) if T else 0
    ids = torch.arange(start // ratio, (start + T) // ratio)
    if ids.numel() == 0:
        return torch.zeros(0, d, dtype=_F64)
    hist_kv = torch.cat([state_kv.to(_F64).cpu(), kv.to(_F64).cpu()])
    hist_s = torch.cat([state_score.to(_F64).cpu(), score.to(_F64).cpu()])
    first = start - state_kv.shape[0]  # the position of hist row 0
    pooled = pool_windows(hist_kv, hist_s, first, ids * ratio + ratio - 1, ratio, coff, d=d,
                          read_masked=read_masked)
    normed = rms_norm(pooled, norm_weight.to(_F64).cpu(), float(rms_norm_eps))
    at = ids * ratio + (ratio - 1 if rope_at == "last" else 0)
    return rotate_with_table(normed, at, cos_sin.cpu())


def compress_records(entries: torch.Tensor, *, scale_floor: str = "vllm") -> torch.Tensor:
    """``entries [m, 512]`` or ``[m, 128]`` (float64) as the cache stores them: uint8 ``[m,
    584]`` (MODEL1 records, ``scale_floor`` ``"vllm"`` or ``"flashmla"``) or ``[m, 132]``
    (codes, then the float32 scale's bytes)."""
    if scale_floor not in SCALE_FLOORS:
        raise ValueError(f"scale_floor must be one of {SCALE_FLOORS}, got {scale_floor!r}")
    m, d = entries.shape
    if d == 512:
        if m == 0:
            return torch.zeros(0, MODEL1_RECORD, dtype=torch.uint8)
        pages = compressed_entries_model1_pages(entries, 1, scale_floor=scale_floor)
        return pages[:, :MODEL1_RECORD].contiguous()
    codes, scale = quantize_compressed_indexer_entries(entries)
    if scale_floor == "flashmla":  # the floor on amax/448: max(amax/448, 1e-4)
        x = entries.to(torch.bfloat16).float()
        amax = x.abs().amax(dim=1)
        scale = torch.pow(2.0, torch.log2(torch.clamp_min(amax / 448.0, 1e-4)).ceil())
        codes = (x / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([codes, scale.float()[:, None].view(torch.uint8)], dim=1)


def v4_compress(kv: torch.Tensor, score: torch.Tensor, state_kv: torch.Tensor,
                state_score: torch.Tensor, positions: torch.Tensor, norm_weight: torch.Tensor,
                cos_sin: torch.Tensor, ratio: int, rms_norm_eps: float = 1e-6) -> torch.Tensor:
    """The compressor's cache records of one request's new tokens (the module doc's
    contract); on ``kv``'s device."""
    entries = compress_entries(kv, score, state_kv, state_score, positions, norm_weight,
                               cos_sin, ratio, rms_norm_eps)
    return compress_records(entries).to(kv.device)


def indexer_q_values(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
                     ) -> torch.Tensor:
    """float64 ``[T, H, D]``: ``q`` with its last 64 dims rotated (the table's values), before
    the bf16 rounding."""
    check_float("q", q, ndim=3)
    check_index("positions", positions, shape=[q.shape[0]])
    check_float("cos_sin", cos_sin, shape=[None, ROPE_DIM])
    return rotate_with_table(q.to(_F64).cpu(), positions.cpu(), cos_sin.cpu())


def indexer_q_records(rotated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotated [T, H, D]`` float64 -> ``(codes uint8 [T, H, D], q_scale float32 [T, H])``:
    bf16, then e4m3 per (token, head) with the power-of-two scale."""
    codes, scale = act_quant(rotated.to(torch.bfloat16), block_size=rotated.shape[-1],
                             scale_fmt="ue8m0")
    return codes.view(torch.uint8), scale[..., 0]


def v4_indexer_q(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                 cos_sin: torch.Tensor, softmax_scale: float, head_scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's q codes and folded weights (the module doc's contract); on ``q``'s
    device."""
    check_float("weights", weights, shape=[q.shape[0], q.shape[1]])
    codes, scale = indexer_q_records(indexer_q_values(q, positions, cos_sin))
    w = (weights.to(_F64).cpu() * scale.to(_F64) * float(softmax_scale) * float(head_scale))
    return codes.to(q.device), w.float().to(q.device)


def check_output_args(attn: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                  wo_a: torch.Tensor, wo_b: torch.Tensor) -> int:
    """``v4_output``'s argument checks (``ValueError`` / ``TypeError`` naming the argument);
    returns ``G``, the output groups."""
    check_float("attn", attn, ndim=3)
    T, H, D = attn.shape
    if D != HEAD_DIM:
        raise ValueError(f"attn must have shape [T, H, {HEAD_DIM}], got {list(attn.shape)}")
    check_index("positions", positions, shape=[T])
    check_float("cos_sin", cos_sin, shape=[None, ROPE_DIM])
    check_float("wo_a", wo_a, ndim=2)
    rows, width = wo_a.shape
    per = width // D  # heads per group
    if width == 0 or width % D or H % per:
        raise ValueError(f"wo_a must have shape [G·R, (H/G)·{D}] for attn's H = {H} heads, got "
                         f"{list(wo_a.shape)}")
    G = H // per
    if rows == 0 or rows % G:
        raise ValueError(f"wo_a must have G·R rows for G = {G} groups, got {rows}")
    check_float("wo_b", wo_b, shape=[None, rows])
    if T and (int(positions.min()) < 0 or int(positions.max()) >= cos_sin.shape[0]):
        raise ValueError(f"positions must lie in [0, {cos_sin.shape[0]}) (cos_sin's rows), got "
                         f"[{int(positions.min())}, {int(positions.max())}]")
    return G


def v4_output_values(attn: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                     wo_a: torch.Tensor, wo_b: torch.Tensor, *, rounded: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 ``(o [T, H, 512], z [T, G, R], out [T, hidden])`` of ``v4_output`` (the module
    doc), on the CPU; ``rounded=False`` keeps ``o`` and ``z`` unrounded (``out`` too)."""
    G = check_output_args(attn, positions, cos_sin, wo_a, wo_b)
    T, H, D = attn.shape
    half = ROPE_DIM // 2
    table = cos_sin.to(_F64).cpu()
    inverse = torch.cat([table[:, :half], -table[:, half:2 * half]], dim=1)

    def bf16(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).to(_F64) if rounded else x

    a = attn.to(torch.bfloat16).to(_F64).cpu()
    o = bf16(rotate_with_table(a, positions.cpu(), inverse))
    y = o.reshape(T, G, H // G * D)
    w_a = wo_a.to(_F64).cpu().view(G, wo_a.shape[0] // G, H // G * D)
    z = bf16(torch.einsum("tgk,grk->tgr", y, w_a))
    out = bf16(z.flatten(1) @ wo_b.to(_F64).cpu().T)
    return o, z, out


def v4_output(attn: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
              wo_a: torch.Tensor, wo_b: torch.Tensor) -> torch.Tensor:
    """The layer's output stage (the module doc's contract): bf16 ``[T, hidden]`` on
    ``attn``'s device."""
    return v4_output_values(attn, positions, cos_sin, wo_a, wo_b)[2].to(
        device=attn.device, dtype=torch.bfloat16)


def check_indexer_topk_args(q_fp8: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                        block_table: torch.Tensor, positions: torch.Tensor) -> None:
    """``v4_indexer_topk``'s argument checks (``ValueError`` / ``TypeError`` naming the
    argument)."""
    check_tensor("q_fp8", q_fp8, ndim=3, dtype=(torch.uint8, torch.float8_e4m3fn))
    T, H, D = q_fp8.shape
    if D != 128:
        raise ValueError(f"q_fp8 must have shape [T, H, 128], got {list(q_fp8.shape)}")
    check_tensor("weights", weights, shape=[T, H], dtype=(torch.float32, _F64))
    check_tensor("k_cache", k_cache, ndim=3, dtype=(torch.uint8,))
    if k_cache.shape[2] != INDEXER_RECORD:
        raise ValueError(f"k_cache must have shape [num_blocks, block_size, {INDEXER_RECORD}], "
                         f"got {list(k_cache.shape)}")
    check_index("block_table", block_table, shape=[T, None], dtype=(torch.int32,))
    check_index("positions", positions, shape=[T])
    if T and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0, got {int(positions.min())}")


def v4_indexer_topk_logits(q_fp8: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                           block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float64 ``[T, max(1, max_t n_t)]``: query ``t``'s logits over its visible entries ``j <
    n_t = (p_t + 1) // 4``, ``-inf`` past them (``v4_indexer_topk``'s, on the CPU)."""
    check_indexer_topk_args(q_fp8, weights, k_cache, block_table, positions)
    visible = ((positions.long().cpu() + 1) // INDEXER_RATIO).to(torch.int32)
    width = max(1, int(visible.max())) if visible.numel() else 1
    return fp8_paged_mqa_logits(q_fp8.cpu()[:, None], k_cache.cpu(), weights.to(_F64).cpu(),
                                visible, block_table.cpu(), width)


def v4_indexer_topk(q_fp8: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                    block_table: torch.Tensor, positions: torch.Tensor, topk: int
                    ) -> torch.Tensor:
    """The indexer's top-k entry ids (the module doc's contract): int32 ``[T, topk]`` on
    ``q_fp8``'s device."""
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    logits = v4_indexer_topk_logits(q_fp8, weights, k_cache, block_table, positions)
    visible = (positions.long().cpu() + 1) // INDEXER_RATIO
    ids = top_k_per_row(logits, torch.zeros_like(visible), visible, topk)
    return ids.to(q_fp8.device)
