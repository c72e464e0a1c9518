"""DeepSeek-V3.2's lightning indexer: which earlier tokens each query attends to.

conventions §10 (DeepSeek-V3.2-Exp, "DeepSeek Sparse Attention"; its ``inference/model.py``
``Indexer``). With ``n_I`` index heads of dim ``d_I`` (64 and 128 in DeepSeek-V3.2), for a query
token ``t`` and a key token ``s`` at or before it:

    q_index  = (q_c @ wq_b.T).view(S, n_I, d_I)        q_c: the MLA's normed q latent ("qr")
    k_index  = LayerNorm(h @ wk.T)                      [S, d_I], one key shared by all heads
    RoPE on the first R = qk_rope_head_dim dims of q_index and k_index (the rest is "nope")
    w        = (h @ weights_proj.T) · n_I^-1/2 · d_I^-1/2       [S, n_I]
    I[t, s]  = Σ_j w[t, j] · ReLU(q_index[t, j] · k_index[s])
    top-k    = the min(topk, #visible) highest I[t, ·]; the rest of the row is -1

RoPE layout: the indexer rotates *non-interleaved* pairs ``(x[i], x[i + R/2])`` (rotate-half),
while the MLA itself rotates interleaved pairs. DeepSeek's released code used the interleaved
form here until its 2025-11 fix, which made the indexer's RoPE non-interleaved;
``IndexerWeights.rope_style`` selects it ("neox" by default).

FP8 option (``use_fp8=True``), the official inference path: q_index and k_index are rotated by a
normalized Hadamard matrix (``H/sqrt(d_I)``, orthogonal, so it changes no dot product in exact
arithmetic; it spreads outliers before quantization) and then quantize-dequantized by
``act_quant`` (e4m3, one power-of-two scale per 128 values, ``scale_fmt="ue8m0"``). The official
kernel folds q's scale into ``w`` and multiplies by k's scale after the ReLU; both scales are
positive, so that equals the dot of the dequantized vectors, which is what is computed here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mla.config import MLAConfig
from mla.reference.fp8 import act_quant
from mla.reference.front import rms_norm
from mla.reference.rope import apply_rope
from mla.validation import acc_dtype, check_float, check_index, check_same_device
from mla.weights import MLAWeights

__all__ = ["IndexerWeights", "IndexerQK", "q_latent", "hadamard_rotate", "indexer_qk",
           "index_scores", "select_topk", "indexer_topk", "check_indexer_config"]

LAYER_NORM_EPS = 1e-6  # the official LayerNorm's default
_CHUNK_ELEMENTS = 1 << 24


def check_indexer_config(config: MLAConfig) -> None:
    """The config must describe an indexer (the ``deepseek-v3.2`` preset does)."""
    for field in ("index_n_heads", "index_head_dim", "index_topk"):
        if getattr(config, field) <= 0:
            raise ValueError(f"config {config.name!r} has no indexer: {field} = "
                             f"{getattr(config, field)} (must be positive; e.g. the "
                             f"'deepseek-v3.2' preset, or config.replace({field}=...))")
    if config.q_lora_rank is None:
        raise ValueError(f"the indexer reads the MLA's q latent: config {config.name!r} needs "
                         f"q_lora_rank, got None")
    if config.index_head_dim < config.qk_rope_head_dim:
        raise ValueError(f"index_head_dim ({config.index_head_dim}) must be >= "
                         f"qk_rope_head_dim ({config.qk_rope_head_dim}): RoPE rotates its "
                         f"first qk_rope_head_dim dims")


def _shapes(config: MLAConfig) -> dict[str, tuple[int, ...]]:
    c = config
    return {
        "wq_b": (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
        "wk": (c.index_head_dim, c.hidden_size),
        "k_norm_weight": (c.index_head_dim,),
        "k_norm_bias": (c.index_head_dim,),
        "weights_proj": (c.index_n_heads, c.hidden_size),
    }


# checkpoint names of the official code (``...self_attn.indexer.<name>``)
_CHECKPOINT = {"wq_b": "wq_b.weight", "wk": "wk.weight", "k_norm_weight": "k_norm.weight",
               "k_norm_bias": "k_norm.bias", "weights_proj": "weights_proj.weight"}


@dataclass
class IndexerWeights:
    """One layer's indexer weights (PyTorch ``Linear`` layout ``[out, in]``) and its config."""

    config: MLAConfig
    wq_b: torch.Tensor  # [n_I·d_I, Lq]
    wk: torch.Tensor  # [d_I, H]
    k_norm_weight: torch.Tensor  # [d_I]
    k_norm_bias: torch.Tensor  # [d_I]
    weights_proj: torch.Tensor  # [n_I, H]
    rope_style: str = "neox"  # the official indexer's RoPE is non-interleaved

    def __post_init__(self) -> None:
        check_indexer_config(self.config)
        if self.rope_style not in ("neox", "interleaved"):
            raise ValueError(f"rope_style must be 'neox' or 'interleaved', "
                             f"got {self.rope_style!r}")
        first = self.wq_b
        for name, shape in _shapes(self.config).items():
            t = getattr(self, name)
            check_float(f"IndexerWeights.{name}", t, shape=list(shape))
            if t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"IndexerWeights.{name} is {t.dtype} on {t.device}, but wq_b "
                                 f"is {first.dtype} on {first.device}")

    @classmethod
    def random(cls, config: MLAConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> IndexerWeights:
        """Seeded: projections ~ N(0, 1/in_features), LayerNorm weight ~ 1 + N(0, 0.1²) and
        bias ~ N(0, 0.1²); drawn in float64 on the CPU, then cast."""
        check_indexer_config(config)
        gen = torch.Generator().manual_seed(seed)
        tensors = {}
        for name, shape in _shapes(config).items():
            t = torch.randn(shape, generator=gen, dtype=torch.float64)
            if name == "k_norm_weight":
                t = 1.0 + 0.1 * t
            elif name == "k_norm_bias":
                t = 0.1 * t
            else:
                t = t * shape[1] ** -0.5
            tensors[name] = t.to(dtype=dtype, device=device)
        return cls(config=config, **tensors)

    @classmethod
    def from_state_dict(cls, config: MLAConfig, state_dict: dict[str, torch.Tensor],
                        prefix: str = "") -> IndexerWeights:
        """Read ``{prefix}wq_b.weight``, ``wk.weight``, ``k_norm.weight``, ``k_norm.bias``,
        ``weights_proj.weight`` (e.g. ``prefix="model.layers.0.self_attn.indexer."``)."""
        tensors = {}
        for name, key in _CHECKPOINT.items():
            if prefix + key not in state_dict:
                raise ValueError(f"state dict has no {prefix + key!r} (expected shape "
                                 f"{list(_shapes(config)[name])})")
            tensors[name] = state_dict[prefix + key]
        return cls(config=config, **tensors)

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        return {prefix + key: getattr(self, name) for name, key in _CHECKPOINT.items()}

    def to(self, dtype: torch.dtype | None = None,
           device: str | torch.device | None = None) -> IndexerWeights:
        moved = {n: getattr(self, n).to(dtype=dtype, device=device) for n in _CHECKPOINT}
        return dataclasses.replace(self, **moved)


class IndexerQK(NamedTuple):
    q_index: torch.Tensor  # [S, n_I, d_I], rotated
    k_index: torch.Tensor  # [S, d_I], normed and rotated: what the indexer caches per token
    weights: torch.Tensor  # [S, n_I], with n_I^-1/2 · d_I^-1/2 folded in


def q_latent(weights: MLAWeights, hidden: torch.Tensor) -> torch.Tensor:
    """The MLA's normed q latent ``q_c = RMSNorm(h @ W_DQ)`` ``[S, Lq]`` (``qr`` officially)."""
    c = weights.config
    if weights.q_a_proj is None:
        raise ValueError(f"config {c.name!r} has no q latent (q_lora_rank=None); the indexer "
                         f"needs one")
    check_float("hidden", hidden, shape=[None, c.hidden_size])
    return rms_norm(hidden @ weights.q_a_proj.T, weights.q_a_layernorm, c.rms_norm_eps)


def _hadamard(d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:  # Sylvester: H_2n = [[H, H], [H, -H]], fast_hadamard_transform's order
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(dtype=dtype, device=device)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H_d / sqrt(d)`` over the last dim ``d`` (a power of two): orthonormal, symmetric."""
    check_float("x", x)
    d = x.shape[-1] if x.dim() else 0
    if d < 1 or d & (d - 1):
        raise ValueError(f"x's last dim must be a power of two, got shape {list(x.shape)}")
    return x @ _hadamard(d, x.dtype, x.device)


def _fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    block = min(128, d)
    if d % block:
        raise ValueError(f"use_fp8 quantizes blocks of 128: index_head_dim must be <= 128 or a "
                         f"multiple of 128, got {d}")
    y, s = act_quant(hadamard_rotate(x), block_size=block, scale_fmt="ue8m0")
    deq = y.float().unflatten(-1, (d // block, block)) * s[..., None]
    return deq.flatten(-2).to(x.dtype)


def indexer_qk(indexer_weights: IndexerWeights, hidden: torch.Tensor, q_c: torch.Tensor,
               positions: torch.Tensor, use_fp8: bool = False) -> IndexerQK:
    """``hidden [S, H]`` and ``q_c [S, Lq]`` at ``positions [S]`` -> ``IndexerQK``.

    Computed in float32 (float64 for float64 inputs); with ``use_fp8`` q_index and k_index are the
    Hadamard-rotated, e4m3 quantize-dequantized vectors of the official inference path.
    """
    iw = indexer_weights
    c = iw.config
    check_float("hidden", hidden, shape=[None, c.hidden_size])
    S = hidden.shape[0]
    check_float("q_c", q_c, shape=[S, c.q_lora_rank])
    check_index("positions", positions, shape=[S])
    check_same_device(hidden=hidden, q_c=q_c, positions=positions, indexer_weights=iw.wq_b)
    work = acc_dtype(hidden.dtype)
    n_I, d_I, R = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim
    rope_config = c.replace(rope_style=iw.rope_style)

    q = (q_c.to(work) @ iw.wq_b.to(work).T).view(S, n_I, d_I)
    k = hidden.to(work) @ iw.wk.to(work).T
    k = torch.nn.functional.layer_norm(k, (d_I,), iw.k_norm_weight.to(work),
                                       iw.k_norm_bias.to(work), LAYER_NORM_EPS)
    # RoPE on the first R dims: [pe, nope], the reverse of the MLA's [nope, pe]
    q = torch.cat([apply_rope(q[..., :R], positions, rope_config), q[..., R:]], dim=-1)
    k = torch.cat([apply_rope(k[..., :R], positions, rope_config), k[..., R:]], dim=-1)
    if use_fp8:
        q, k = _fp8_round_trip(q), _fp8_round_trip(k)
    w = (hidden.to(work) @ iw.weights_proj.to(work).T) * (n_I ** -0.5 * d_I ** -0.5)
    return IndexerQK(q_index=q, k_index=k, weights=w)


def index_scores(q_index: torch.Tensor, weights: torch.Tensor, k_index: torch.Tensor,
                 q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """``I [Sq, Skv] = Σ_j w[t, j]·ReLU(q_index[t, j]·k_index[s])``; ``-inf`` where
    ``k_pos > q_pos`` (keys after the query)."""
    check_float("q_index", q_index, ndim=3)
    Sq, n_I, d_I = q_index.shape
    check_float("weights", weights, shape=[Sq, n_I])
    check_float("k_index", k_index, shape=[None, d_I])
    Skv = k_index.shape[0]
    check_index("q_positions", q_positions, shape=[Sq])
    check_index("k_positions", k_positions, shape=[Skv])
    check_same_device(q_index=q_index, weights=weights, k_index=k_index, q_positions=q_positions,
                      k_positions=k_positions)
    work = acc_dtype(q_index.dtype)
    out = torch.empty(Sq, Skv, dtype=work, device=q_index.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, n_I * Skv))
    for a in range(0, Sq, step):
        b = min(a + step, Sq)
        logits = torch.einsum("tjd,sd->tjs", q_index[a:b].to(work), k_index.to(work)).clamp_min(0.0)
        out[a:b] = torch.einsum("tj,tjs->ts", weights[a:b].to(work), logits)
    visible = k_positions[None, :] <= q_positions[:, None]
    return out.masked_fill(~visible, float("-inf"))


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 ``[Sq, topk]``: each row's finite entries, highest score first, then ``-1``.

    Ties go to the earlier key (lower index)."""
    check_float("scores", scores, ndim=2)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    Sq, Skv = scores.shape
    k = min(topk, Skv)
    # a stable sort: equal scores (ReLU makes exact zeros common) go to the earlier key, so
    # that every path picks the same set
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    vals, idx = vals[:, :k], idx[:, :k]
    idx = torch.where(torch.isneginf(vals), -1, idx)
    out = torch.full((Sq, topk), -1, dtype=torch.int32, device=scores.device)
    out[:, :k] = idx.to(torch.int32)
    return out


def indexer_topk(indexer_weights: IndexerWeights, weights: MLAWeights, hidden: torch.Tensor,
                 positions: torch.Tensor | None = None, use_fp8: bool = False) -> torch.Tensor:
    """One request attending causally to its own tokens: request-local ``int32 [S, topk]``."""
    check_float("hidden", hidden, ndim=2)
    if positions is None:
        positions = torch.arange(hidden.shape[0], device=hidden.device)
    qk = indexer_qk(indexer_weights, hidden, q_latent(weights, hidden), positions, use_fp8)
    scores = index_scores(qk.q_index, qk.weights, qk.k_index, positions, positions)
    return select_topk(scores, indexer_weights.config.index_topk)
