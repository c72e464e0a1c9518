"""DeepSeek-V4's lightning indexer (C4A layers): the top-k compressed entries per query.

A C4A layer (ratio ``r = 4``) picks, per query token at position ``p``, ``index_topk`` of the
``n_p = (p + 1) // 4`` compressed entries it may see. With ``H = index_n_heads`` heads of
``D = index_head_dim = 128``, ``qr`` the layer's normed query latent (``q_norm`` applied), ``x``
the hidden state, and the indexer's own compressor (``d = 128``, ``mla.reference.v4.compressor``)
giving the keys ``k_j``:

    q[t, h]  = RoPE_gptj((qr_t @ wq_b^T).view(H, D), p_t)        the last 64 of 128 dims
    w[t, h]  = x_t @ weights_proj^T
    w'[t, h] = w[t, h] · q_scale[t, h] · D^-0.5 · H^-0.5
    L[t, j]  = Σ_h w'[t, h] · ReLU(q[t, h] · k_j) · k_scale[j]   j < n_{p_t};  -inf otherwise
    top-k    = the index_topk largest L[t, :] as local entry ids, then -1

The rope is the layer's (compressed-layer frequencies and YaRN). Roundings, as vLLM's kernels
make them (``quantize=True``), each switched off together by ``quantize=False`` (exact float64,
both scales 1):

- ``q``: ``wq_b``'s output in bf16, the rotation of its rope half rounded to bf16, then e4m3
  per (token, head) with ``q_scale = 2^ceil(log2(max(amax, 1e-4) / 448))`` (``act_quant``);
  the codes enter the logits, ``q_scale`` the weight (``v4_indexer_q``);
- ``w``: ``weights_proj``'s output in bf16 (``v4_indexer_weights``);
- ``k``: the compressor's entry rounded to bf16, then e4m3 with one power-of-two scale per
  entry (``quantize_compressed_indexer_entries``, the 132-byte indexer cache) (``v4_indexer_k``).

The logits are computed in float64 on those values (with ``quantize=True`` by
``fp8_mqa_logits``, the V3.2 kernels' contract). Skip rule: when ``seq_len // 4 <= index_topk``
for the longest sequence of the batch (here: the request's ``L`` tokens), vLLM computes no
logits and returns, per row, ``[0, 1, .., n_p - 1, -1, ..]``. Otherwise the row is the
``top_k_per_row`` of its visible entries: highest first, ties to the lower entry id, ``-1``
after ``n_p``. A row with ``n_p <= index_topk`` holds every visible entry either way: the
selection is a set, and its order is not part of the contract (vLLM's CUDA top-k kernels do
not sort); compare sets.

Follows vLLM 0.33: ``vllm/models/deepseek_v4/attention.py`` (``DeepseekV4Indexer``,
``_fill_short_context_topk_indices``, the ``q_norm`` before ``wq_b``),
``common/ops/fused_indexer_q.py`` and ``nvidia/ops/fused_indexer_q_cutedsl.py`` (q's rope,
rounding and the weight fold), ``common/ops/fused_compress_quant_cache.py`` (the keys' store),
``vllm/model_executor/layers/sparse_attn_indexer.py`` and ``indexer_topk.py`` (logits, top-k),
``vllm/v1/attention/ops/rocm_aiter_mla_sparse.py`` (the logits' torch oracles) and
``vllm/v1/attention/backends/mla/indexer.py`` (``max_seq_len``, the visible counts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla.reference.fp8 import act_quant
from mla.reference.indexer_logits import fp8_mqa_logits, top_k_per_row
from mla.reference.v4.compressor import (
    CompressorWeights,
    compress,
    compressor_weights_of,
    quantize_compressed_indexer_entries,
)
from mla.reference.v4.config import V4Config
from mla.reference.v4.rope import rope_gptj
from mla.reference.v4.weights import V4LayerWeights
from mla.validation import check_float, check_index, check_same_device, check_tensor

__all__ = ["IndexerV4Weights", "v4_indexer_q", "v4_indexer_weights", "v4_indexer_k",
           "v4_indexer_logits", "v4_indexer_topk", "v4_visible_entries", "indexer_weights_of",
           "indexer_topk_for_layer"]

INDEXER_RATIO = 4  # only C4A layers have an indexer
_F64 = torch.float64
_E4M3 = torch.float8_e4m3fn


def _check_config(config: object) -> V4Config:
    if not isinstance(config, V4Config):
        raise TypeError(f"config must be a V4Config, got {type(config).__name__}")
    return config


def _check_ratio(ratio: object) -> None:
    if ratio != INDEXER_RATIO or isinstance(ratio, bool):
        raise ValueError(f"ratio must be {INDEXER_RATIO} (only C4A layers have an indexer), "
                         f"got {ratio!r}")


def _check_quantize(quantize: object) -> bool:
    if not isinstance(quantize, bool):
        raise TypeError(f"quantize must be a bool, got {type(quantize).__name__}")
    return quantize


@dataclass(frozen=True)
class IndexerV4Weights:
    """The indexer's parameters, as the checkpoint names them (``layers.N.attn.indexer.*``):
    ``wq_b [H·128, q_lora_rank]``, ``weights_proj [H, hidden]`` and its ratio-4 compressor of
    width 128."""

    wq_b: torch.Tensor
    weights_proj: torch.Tensor
    compressor: CompressorWeights

    def __post_init__(self) -> None:
        check_float("wq_b", self.wq_b, ndim=2)
        check_float("weights_proj", self.weights_proj, ndim=2)
        if not isinstance(self.compressor, CompressorWeights):
            raise TypeError(f"compressor must be a CompressorWeights, got "
                            f"{type(self.compressor).__name__}")
        if self.compressor.ratio != INDEXER_RATIO:
            raise ValueError(f"compressor must have ratio {INDEXER_RATIO}, got "
                             f"{self.compressor.ratio}")
        H, D = self.weights_proj.shape[0], self.compressor.head_dim
        check_float("wq_b", self.wq_b, shape=[H * D, None])
        check_float("weights_proj", self.weights_proj,
                    shape=[H, self.compressor.hidden_size])

    def check(self, config: V4Config) -> None:
        """Shapes against ``config``: ``H = index_n_heads``, ``128 = index_head_dim``."""
        H, D = config.index_n_heads, config.index_head_dim
        check_float("wq_b", self.wq_b, shape=[H * D, config.q_lora_rank])
        check_float("weights_proj", self.weights_proj, shape=[H, config.hidden_size])
        check_float("compressor.norm", self.compressor.norm, shape=[D])

    @staticmethod
    def random(config: V4Config, *, seed: int = 0, dtype: torch.dtype = _F64
               ) -> IndexerV4Weights:
        """Seeded random weights of ``config``'s shapes (unit-variance projections)."""
        _check_config(config)
        g = torch.Generator().manual_seed(seed)
        H, D = config.index_n_heads, config.index_head_dim

        def draw(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, dtype=_F64) * shape[1] ** -0.5).to(dtype)

        return IndexerV4Weights(
            wq_b=draw(H * D, config.q_lora_rank), weights_proj=draw(H, config.hidden_size),
            compressor=CompressorWeights.random(config.hidden_size, D, INDEXER_RATIO,
                                                seed=seed + 1, dtype=dtype))


def v4_visible_entries(positions: torch.Tensor, ratio: int = INDEXER_RATIO) -> torch.Tensor:
    """int64 ``[T]``: the compressed entries a query at each position sees, ``(p + 1) // r``."""
    check_index("positions", positions, ndim=1)
    return (positions.long() + 1) // ratio


def v4_indexer_q(qr: torch.Tensor, weights: IndexerV4Weights, positions: torch.Tensor,
                 config: V4Config, ratio: int = INDEXER_RATIO, *, quantize: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``qr [T, q_lora_rank]`` (normed) at ``positions [T]`` -> ``(q [T, H, 128], q_scale [T,
    H])``, float64. ``quantize``: ``q`` holds e4m3 codes (their values) and ``q_scale`` the
    power-of-two scales (``q ≈ codes · q_scale``); otherwise the exact rotated ``q`` and
    ones."""
    _check_config(config)
    _check_ratio(ratio)
    quantize = _check_quantize(quantize)
    weights.check(config)
    check_float("qr", qr, shape=[None, config.q_lora_rank])
    check_index("positions", positions, shape=[qr.shape[0]], device=qr.device)
    T, H, D = qr.shape[0], config.index_n_heads, config.index_head_dim
    q = (qr.to(_F64) @ weights.wq_b.to(device=qr.device, dtype=_F64).T).view(T, H, D)
    if not quantize:
        return rope_gptj(q, positions, config, ratio), torch.ones(T, H, dtype=_F64,
                                                                  device=qr.device)
    # bf16 GEMM output; the rope half rotated (float64 here, fp32 in vLLM) and rounded again
    q = rope_gptj(q.to(torch.bfloat16).to(_F64), positions, config, ratio)
    codes, scale = act_quant(q.to(torch.bfloat16), block_size=D, scale_fmt="ue8m0")
    return codes.to(_F64), scale[..., 0].to(_F64)


def v4_indexer_weights(x: torch.Tensor, weights: IndexerV4Weights, config: V4Config,
                       q_scale: torch.Tensor, *, quantize: bool = True) -> torch.Tensor:
    """``x [T, hidden]`` -> ``w' [T, H]`` float64: ``(x @ weights_proj^T) · q_scale ·
    index_head_dim^-0.5 · index_n_heads^-0.5`` (``x @ weights_proj^T`` rounded to bf16 with
    ``quantize``, as vLLM's bf16 linear gives it)."""
    _check_config(config)
    quantize = _check_quantize(quantize)
    weights.check(config)
    check_float("x", x, shape=[None, config.hidden_size])
    check_float("q_scale", q_scale, shape=[x.shape[0], config.index_n_heads], device=x.device)
    w = x.to(_F64) @ weights.weights_proj.to(device=x.device, dtype=_F64).T
    if quantize:
        w = w.to(torch.bfloat16).to(_F64)
    return w * q_scale.to(_F64) * config.index_head_dim ** -0.5 * config.index_n_heads ** -0.5


def v4_indexer_k(x: torch.Tensor, weights: IndexerV4Weights, config: V4Config, *,
                 quantize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys of one request's tokens ``x [L, hidden]`` (positions ``0 .. L-1``): ``(k [L //
    4, 128], k_scale [L // 4])`` float64; with ``quantize`` the indexer cache's e4m3 codes
    (their values) and scales, otherwise the exact entries and ones."""
    _check_config(config)
    quantize = _check_quantize(quantize)
    weights.check(config)
    entries = compress(x, weights.compressor, config)
    if not quantize:
        return entries, torch.ones(entries.shape[0], dtype=_F64, device=x.device)
    codes, scale = quantize_compressed_indexer_entries(entries)
    return codes.view(_E4M3).to(_F64), scale.to(_F64)


def v4_indexer_logits(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                      positions: torch.Tensor, ratio: int = INDEXER_RATIO) -> torch.Tensor:
    """``L [T, n_c]`` float64: ``Σ_h w[t, h] · ReLU(q[t, h] · k[j]) · k_scale[j]`` for the
    visible ``j < (p_t + 1) // ratio``, ``-inf`` for the others. ``q [T, H, 128]``, ``w [T,
    H]`` (the folded weights), ``k [n_c, 128]``, ``k_scale [n_c]``, ``positions [T]``. Values
    that are all e4m3 numbers with power-of-two scales (``quantize=True``) go through
    ``fp8_mqa_logits``; others through the same sum, in float64."""
    _check_ratio(ratio)
    check_float("q", q, ndim=3)
    T, H, D = q.shape
    check_float("w", w, shape=[T, H], device=q.device)
    check_float("k", k, shape=[None, D], device=q.device)
    check_float("k_scale", k_scale, shape=[k.shape[0]], device=q.device)
    check_index("positions", positions, shape=[T], device=q.device)
    check_same_device(q=q, w=w, k=k, k_scale=k_scale, positions=positions)
    n_c = k.shape[0]
    ends = v4_visible_entries(positions, ratio)
    if T and int(ends.max()) > n_c:
        raise ValueError(f"k must hold every visible entry: positions up to "
                         f"{int(positions.max())} see {int(ends.max())} entries, k has {n_c}")
    q64, k64 = q.to(_F64), k.to(_F64)
    if D == 128 and _is_e4m3(q64) and _is_e4m3(k64):
        starts = torch.zeros(T, dtype=torch.int32, device=q.device)
        return fp8_mqa_logits(q64.to(_E4M3), (k64.to(_E4M3), k_scale.to(_F64)), w.to(_F64),
                              starts, ends.to(torch.int32))
    dots = torch.einsum("thd,nd->thn", q64, k64).clamp_min(0.0)
    out = torch.einsum("th,thn->tn", w.to(_F64), dots) * k_scale.to(_F64)[None, :]
    cols = torch.arange(n_c, device=q.device)[None, :]
    return out.masked_fill(cols >= ends[:, None], float("-inf"))


def _is_e4m3(t: torch.Tensor) -> bool:
    """Every value an e4m3 number (so the fp8 kernels' contract applies exactly)."""
    return bool(torch.equal(t.to(_E4M3).to(_F64), t))


def v4_indexer_topk(x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor,
                    weights: IndexerV4Weights, config: V4Config, *, quantize: bool = True,
                    ratio: int = INDEXER_RATIO) -> torch.Tensor:
    """int32 ``[T, index_topk]``: per query the selected compressed entries (local ids), then
    ``-1``.

    ``x [L, hidden]``: the request's hidden states at positions ``0 .. L-1`` (the keys are its
    compressor's entries; query ``t``'s weight row is ``x[positions[t]]``); ``qr [T,
    q_lora_rank]`` the normed query latents of the queries at ``positions [T]`` (each < L).
    The skip rule (``L // 4 <= index_topk``: every row ``[0 .. n_p - 1, -1, ..]``) and the tie
    rule are the module doc's."""
    _check_config(config)
    _check_ratio(ratio)
    quantize = _check_quantize(quantize)
    weights.check(config)
    check_float("x", x, shape=[None, config.hidden_size])
    check_float("qr", qr, shape=[None, config.q_lora_rank], device=x.device)
    check_tensor("positions", positions, shape=[qr.shape[0]], dtype=(torch.int32, torch.int64),
                 device=x.device)
    L, T, topk = x.shape[0], qr.shape[0], config.index_topk
    if T and (int(positions.min()) < 0 or int(positions.max()) >= L):
        raise ValueError(f"positions must lie in [0, {L}) (x's tokens), got range "
                         f"[{int(positions.min())}, {int(positions.max())}]")
    n_visible = v4_visible_entries(positions, ratio)
    if L // ratio <= topk:  # vLLM's short-context fill: no logits
        cols = torch.arange(topk, device=x.device)[None, :]
        return torch.where(cols < n_visible[:, None], cols, -1).to(torch.int32)
    q, q_scale = v4_indexer_q(qr, weights, positions, config, ratio, quantize=quantize)
    w = v4_indexer_weights(x[positions.long()], weights, config, q_scale, quantize=quantize)
    k, k_scale = v4_indexer_k(x, weights, config, quantize=quantize)
    logits = v4_indexer_logits(q, w, k, k_scale, positions, ratio)
    starts = torch.zeros(T, dtype=torch.int64, device=x.device)
    return top_k_per_row(logits, starts, n_visible, topk)


def indexer_weights_of(weights: V4LayerWeights) -> IndexerV4Weights:
    """The indexer of a ratio-4 layer's checkpoint tensors (``indexer.*``)."""
    if not isinstance(weights, V4LayerWeights):
        raise TypeError(f"weights must be a V4LayerWeights, got {type(weights).__name__}")
    if weights.ratio != INDEXER_RATIO:
        raise ValueError(f"weights must be a ratio-{INDEXER_RATIO} layer's (only C4A layers "
                         f"have an indexer), got ratio {weights.ratio}")
    return IndexerV4Weights(wq_b=weights["indexer.wq_b.weight"],
                            weights_proj=weights["indexer.weights_proj.weight"],
                            compressor=compressor_weights_of(weights, "indexer.compressor."))


def indexer_topk_for_layer(x: torch.Tensor, q_latent: torch.Tensor, weights: V4LayerWeights,
                           kv_cache_dtype: str = "fp8_ds_mla",
                           positions: torch.Tensor | None = None) -> torch.Tensor:
    """``v4_indexer_topk`` of a ratio-4 layer for one request: ``x [L, hidden]`` its hidden
    states so far and ``q_latent`` the normed query latents of the queries at ``positions``
    (default: every token, ``0 .. L-1``). The indexer's fp8 roundings are vLLM's whatever the
    attention cache holds, except with ``kv_cache_dtype = "float64"`` (every rounding off:
    ``quantize=False``)."""
    if kv_cache_dtype not in ("float64", "bfloat16", "fp8_ds_mla"):
        raise ValueError(f"kv_cache_dtype must be one of ('float64', 'bfloat16', 'fp8_ds_mla')"
                         f", got {kv_cache_dtype!r}")
    check_float("x", x, ndim=2)
    if positions is None:
        positions = torch.arange(x.shape[0], device=x.device)
    return v4_indexer_topk(x, q_latent, positions, indexer_weights_of(weights), weights.config,
                           quantize=kv_cache_dtype != "float64")
