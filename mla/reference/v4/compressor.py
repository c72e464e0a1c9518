"""DeepSeek-V4's KV compressor: every ``r`` tokens, one softmax-pooled, normed, rotated entry.

A layer of ratio ``r`` in {4, 128} (and, for ``r = 4``, the indexer, with ``d = 128``) owns a
compressor of width ``d``. With ``coff = 2`` when ``r = 4`` ("overlap"), else 1, and the
checkpoint's ``wkv``, ``wgate`` ``[coff·d, hidden]``, ``ape`` ``[r, coff·d]``, ``norm`` ``[d]``,
per token ``x_p`` at position ``p``:

    kv_p    = x_p @ wkv^T                                   [coff·d]
    s_p     = x_p @ wgate^T + ape[p mod r]                  [coff·d]

An entry is emitted at every position ``p`` with ``(p + 1) mod r = 0``: entry ``j = p // r``
pools the window ``W_j`` of the ``coff·r`` positions ``[p - coff·r + 1, p]``. Window slot ``i``
(position ``q = p - coff·r + 1 + i``) reads the channel slice ``[c·d, (c+1)·d)`` with
``c = i // r``: with overlap the previous block's 4 tokens read ``[0, d)`` and the entry's own
block ``[d, 2d)``; without, the block reads ``[0, d)``. Positions ``q < 0`` are masked (score
``-inf``, kv 0, and never read: their values cannot leak). Per channel ``e``:

    a_{q,e} = exp(s_{q,e}) / Σ_{q' ∈ W_j, q' >= 0} exp(s_{q',e})
    c_j     = Σ_{q ∈ W_j, q >= 0} a_q ⊙ kv_q                 [d]
    n_j     = RMSNorm(c_j; norm, rms_norm_eps)
    entry_j = RoPE_gptj(n_j, position j·r)                   the last 64 dims, the layer's rope

The entry's own block is never masked (its first position is ``j·r >= 0``), so no window is
empty; entry 0 of an overlapping compressor pools its own 4 tokens only. A request of ``T``
tokens has ``T // r`` entries (``compress``: stateless, from the whole history).

The serving form (``CompressorState``, ``compressor_step``) keeps, per request, the last
``coff·r`` tokens' ``kv`` and ``s`` (``ape`` added) and emits the entries whose window closes
inside the new tokens; any split of a sequence into steps gives ``compress``'s entries.

Storage (``round_compressed_entries``), as the cache holds an entry:

- ``d = 512`` (FlashMLA's MODEL1 row): nope = ``bf16(n)[0:448]``, then e4m3 with one UE8M0
  scale per 64 values; rope = ``bf16`` of the rotation of the unrounded ``n[448:512]``. The
  scale's floor is ``scale_floor="flashmla"`` (the default), ``2^ceil(log2(max(amax/448,
  1e-4)))``: what vLLM runs on CUDA (an H100/H200) for ``d = 512``, its CuTe-DSL kernels, and
  FlashMLA's ``quantize_k_cache``; or ``"vllm"``, ``2^ceil(log2(max(amax, 1e-4)/448))``, vLLM's
  Triton kernel (ROCm and other platforms). Their scales differ only for tiles with ``amax <=
  448·2^-14 ≈ 0.027`` (``mla.reference.fp8_model1.ue8m0_exponent``).
- ``d = 128`` (the indexer's 132-byte key cache): ``bf16`` of the rotated entry, then e4m3 with
  one scale per entry ``2^ceil(log2(max(amax, 1e-4)/448))`` (``quantize_indexer_k``).

Everything here is float64 (bf16 weights are exact in it); vLLM computes the GEMMs with fp32
output, the pooling, norm and rotation in fp32.

Follows vLLM 0.33: ``vllm/models/deepseek_v4/compressor.py`` (``DeepseekCompressor``),
``common/ops/save_partial_states.py`` (the state: kv and score + ape),
``common/ops/fused_compress_quant_cache.py`` (the Triton compress, norm, rope and store kernels),
``nvidia/ops/sparse_attn_compress_cutedsl.py`` (the CUDA ``d = 512`` kernels),
``attention.py`` (the fp32 ``fused_wkv_wgate`` GEMM) and ``nvidia/model.py`` (checkpoint names).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla.reference.fp8_model1 import D_NOPE as MODEL1_D_NOPE
from mla.reference.fp8_model1 import D_QK as MODEL1_D_QK
from mla.reference.fp8_model1 import quantize_fp8_model1, round_fp8_model1
from mla.reference.front import rms_norm
from mla.reference.indexer_cache import INDEX_DIM, quantize_indexer_k
from mla.reference.v4.config import V4Config
from mla.reference.v4.rope import rope_gptj
from mla.reference.v4.weights import V4LayerWeights
from mla.validation import check_float, check_positive_int, check_tensor

__all__ = ["CompressorWeights", "CompressorState", "COMPRESS_RATIOS", "compressor_kv_score",
           "compress_pool", "compress", "compressor_init_state", "compressor_step",
           "round_compressed_entries", "compressed_entries_model1_pages",
           "quantize_compressed_indexer_entries", "compressor_weights_of",
           "compressed_cache_entries", "V41_COMPRESS_RATIOS", "V41CompressorWeights",
           "v41_compress_latent", "v41_compress", "v41_index_key"]

COMPRESS_RATIOS = (4, 128)
_KV_CACHE_DTYPES = ("float64", "bfloat16", "fp8_ds_mla")  # the layer's (mla.reference.v4.layer)
_F64 = torch.float64


def _check_ratio(ratio: object) -> int:
    if isinstance(ratio, bool) or ratio not in COMPRESS_RATIOS:
        raise ValueError(f"ratio must be one of {COMPRESS_RATIOS}, got {ratio!r}")
    return int(ratio)  # type: ignore[call-overload]


def _coff(ratio: int) -> int:
    return 2 if ratio == 4 else 1


class _CompressorWidths:
    """``head_dim`` (the entry's width, ``norm``'s) and ``hidden_size`` (``wkv``'s input)."""

    norm: torch.Tensor
    wkv: torch.Tensor

    @property
    def head_dim(self) -> int:
        return self.norm.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.wkv.shape[1]


@dataclass(frozen=True)
class CompressorWeights(_CompressorWidths):
    """One compressor's parameters, named as the checkpoint names them
    (``layers.N.attn.compressor.*``, ``layers.N.attn.indexer.compressor.*``): ``wkv`` and
    ``wgate`` ``[coff·d, hidden]``, ``ape`` ``[r, coff·d]``, ``norm`` ``[d]``. The ratio is
    ``ape``'s row count and ``coff = 2`` exactly when it is 4."""

    wkv: torch.Tensor
    wgate: torch.Tensor
    ape: torch.Tensor
    norm: torch.Tensor

    def __post_init__(self) -> None:
        check_float("norm", self.norm, ndim=1)
        check_float("ape", self.ape, ndim=2)
        ratio = _check_ratio(self.ape.shape[0])
        d = self.norm.shape[0]
        width = _coff(ratio) * d
        check_float("ape", self.ape, shape=[ratio, width])
        check_float("wkv", self.wkv, shape=[width, None])
        check_float("wgate", self.wgate, shape=[width, self.wkv.shape[1]])

    @property
    def ratio(self) -> int:
        return self.ape.shape[0]

    @property
    def coff(self) -> int:
        return _coff(self.ratio)


    @staticmethod
    def random(hidden_size: int, head_dim: int, ratio: int, *, seed: int = 0,
               dtype: torch.dtype = _F64) -> CompressorWeights:
        """Seeded random weights: projections of unit-variance outputs, ``ape`` of scale 1 (so
        that the softmax is neither flat nor one-hot), ``norm`` around 1."""
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("head_dim", head_dim)
        width = _coff(_check_ratio(ratio)) * head_dim
        g = torch.Generator().manual_seed(seed)

        def draw(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, dtype=_F64) * scale).to(dtype)

        return CompressorWeights(
            wkv=draw(width, hidden_size, scale=hidden_size ** -0.5),
            wgate=draw(width, hidden_size, scale=hidden_size ** -0.5),
            ape=draw(ratio, width, scale=1.0),
            norm=(1.0 + 0.1 * torch.randn(head_dim, generator=g, dtype=_F64)).to(dtype))


def compressor_kv_score(x: torch.Tensor, weights: CompressorWeights, positions: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, hidden]`` at ``positions [T]`` -> float64 ``(kv, score)``, each ``[T, coff·d]``:
    ``kv = x @ wkv^T``, ``score = x @ wgate^T + ape[positions mod r]``."""
    check_float("x", x, shape=[None, weights.hidden_size])
    check_tensor("positions", positions, shape=[x.shape[0]], dtype=(torch.int32, torch.int64),
                 device=x.device)
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0, got minimum {int(positions.min())}")
    xw = x.to(_F64)
    kv = xw @ weights.wkv.to(device=x.device, dtype=_F64).T
    score = xw @ weights.wgate.to(device=x.device, dtype=_F64).T
    ape = weights.ape.to(device=x.device, dtype=_F64)
    return kv, score + ape[positions.long() % weights.ratio]


def pool_windows(kv: torch.Tensor, score: torch.Tensor, first: int, ends: torch.Tensor,
                 ratio: int, coff: int, *, d: int | None = None,
                 read_masked: bool = False) -> torch.Tensor:
    """Pool the windows closing at positions ``ends [n]``; ``kv``, ``score`` ``[L, coff·d]``
    hold positions ``first .. first + L - 1`` (every window position >= 0 among them). ``d``:
    the entry width (default ``kv``'s width over ``coff``); ``read_masked``: a known wrong
    variant for the catalogue, positions ``< 0`` read instead of masked."""
    d = kv.shape[1] // coff if d is None else d
    W = coff * ratio
    slot = torch.arange(W, device=kv.device)
    pos = ends[:, None] - W + 1 + slot[None, :]  # [n, W]
    valid = (pos >= 0) | read_masked
    rows = (pos - first).clamp_min(0)
    cols = (slot // ratio)[:, None] * d + torch.arange(d, device=kv.device)[None, :]  # [W, d]
    take_kv = kv[rows[:, :, None], cols[None, :, :]]  # [n, W, d]
    take_s = score[rows[:, :, None], cols[None, :, :]]
    # masked slots are replaced, not multiplied, so that nothing stored there is read
    s = torch.where(valid[:, :, None], take_s, float("-inf"))
    v = torch.where(valid[:, :, None], take_kv, 0.0)
    return (torch.softmax(s, dim=1) * v).sum(dim=1)


def _check_kv_score(kv: torch.Tensor, score: torch.Tensor, coff: int) -> None:
    check_float("kv", kv, ndim=2)
    check_float("score", score, shape=list(kv.shape), device=kv.device)
    if kv.shape[1] % coff or kv.shape[1] == 0:
        raise ValueError(f"kv's width must be a positive multiple of coff={coff} (coff·d), "
                         f"got shape {list(kv.shape)}")


def compress_pool(kv: torch.Tensor, score: torch.Tensor, ratio: int, overlap: bool
                  ) -> torch.Tensor:
    """The pooled entries ``c [T // r, d]`` (float64) of one request's tokens at positions
    ``0 .. T-1``: ``kv``, ``score [T, coff·d]`` (``score`` with ``ape`` added), ``coff = 2``
    with ``overlap``. ``overlap`` must be ``ratio == 4``, as DeepSeek-V4 builds it."""
    ratio = _check_ratio(ratio)
    if not isinstance(overlap, bool) or overlap != (ratio == 4):
        raise ValueError(f"overlap must be {ratio == 4} for ratio {ratio} (DeepSeek-V4 "
                         f"overlaps exactly the ratio-4 compressors), got {overlap!r}")
    coff = 2 if overlap else 1
    _check_kv_score(kv, score, coff)
    n = kv.shape[0] // ratio
    ends = torch.arange(n, device=kv.device) * ratio + ratio - 1
    return pool_windows(kv.to(_F64), score.to(_F64), 0, ends, ratio, coff)


def _finish(pooled: torch.Tensor, entry_ids: torch.Tensor, weights: CompressorWeights,
            config: V4Config) -> torch.Tensor:
    """RMSNorm, then RoPE at the block's first position ``j·r``."""
    normed = rms_norm(pooled, weights.norm.to(device=pooled.device, dtype=_F64),
                      config.rms_norm_eps)
    if normed.shape[0] == 0:
        return normed
    return rope_gptj(normed, entry_ids * weights.ratio, config, weights.ratio)


def _check_width(weights: CompressorWeights, config: V4Config) -> None:
    if weights.head_dim < config.rope_head_dim:
        raise ValueError(f"weights.norm must have at least rope_head_dim="
                         f"{config.rope_head_dim} entries, got {weights.head_dim}")


def compress(x: torch.Tensor, weights: CompressorWeights, config: V4Config) -> torch.Tensor:
    """The compressed entries ``[T // r, d]`` (float64, not rounded for storage) of one
    request's hidden states ``x [T, hidden]`` at positions ``0 .. T-1``."""
    _check_width(weights, config)
    check_float("x", x, shape=[None, weights.hidden_size])
    positions = torch.arange(x.shape[0], device=x.device)
    kv, score = compressor_kv_score(x, weights, positions)
    pooled = compress_pool(kv, score, weights.ratio, weights.ratio == 4)
    return _finish(pooled, torch.arange(pooled.shape[0], device=x.device), weights, config)


# ---- the serving form: a state of the last coff·r tokens ----------------------------------


@dataclass(frozen=True)
class CompressorState:
    """One request's compressor state: ``length`` tokens seen; ``kv`` and ``score`` ``[coff·r,
    coff·d]`` float64 hold positions ``length - coff·r .. length - 1`` (``score`` with ``ape``
    added), as vLLM's state cache (a sliding window of ``coff·r`` tokens) does. Rows of
    positions < 0 are never read, whatever they hold."""

    kv: torch.Tensor
    score: torch.Tensor
    length: int


def compressor_init_state(weights: CompressorWeights, *, fill: float = float("nan"),
                          device: torch.device | str = "cpu") -> CompressorState:
    """The state of a request with no tokens; its rows hold ``fill`` (NaN by default: a
    position < 0 must never be read)."""
    W, width = weights.coff * weights.ratio, weights.coff * weights.head_dim
    rows = torch.full((W, width), float(fill), dtype=_F64, device=device)
    return CompressorState(kv=rows, score=rows.clone(), length=0)


def compressor_step(state: CompressorState, x: torch.Tensor, weights: CompressorWeights,
                    config: V4Config) -> tuple[torch.Tensor, CompressorState]:
    """Feed the next ``x [n, hidden]`` tokens (positions ``length .. length + n - 1``) ->
    ``(entries [m, d], new state)``: the ``m`` entries whose window closes among them (ids
    ``(length // r) ..``), float64, as ``compress`` gives them."""
    _check_width(weights, config)
    if not isinstance(state, CompressorState):
        raise TypeError(f"state must be a CompressorState, got {type(state).__name__}")
    W, width = weights.coff * weights.ratio, weights.coff * weights.head_dim
    check_tensor("state.kv", state.kv, shape=[W, width], dtype=_F64)
    check_tensor("state.score", state.score, shape=[W, width], dtype=_F64,
                 device=state.kv.device)
    if isinstance(state.length, bool) or not isinstance(state.length, int) or state.length < 0:
        raise ValueError(f"state.length must be an int >= 0, got {state.length!r}")
    check_float("x", x, shape=[None, weights.hidden_size], device=state.kv.device)
    L, n, r = state.length, x.shape[0], weights.ratio
    kv_new, score_new = compressor_kv_score(x, weights, torch.arange(L, L + n, device=x.device))
    kv = torch.cat([state.kv, kv_new])  # positions L - W .. L + n - 1
    score = torch.cat([state.score, score_new])
    first_id, last_id = L // r, (L + n) // r  # entries whose last position lies in [L, L+n)
    ids = torch.arange(first_id, last_id, device=x.device)
    pooled = pool_windows(kv, score, L - W, ids * r + r - 1, r, weights.coff)
    entries = _finish(pooled, ids, weights, config)
    return entries, CompressorState(kv=kv[-W:].clone(), score=score[-W:].clone(), length=L + n)


# ---- storage rounding ---------------------------------------------------------------------


def _check_entries(entries: torch.Tensor) -> torch.Tensor:
    check_float("entries", entries, ndim=2)
    if entries.shape[1] not in (MODEL1_D_QK, INDEX_DIM):
        raise ValueError(f"entries must have shape [n, {MODEL1_D_QK}] (the attention's "
                         f"compressor) or [n, {INDEX_DIM}] (the indexer's), got "
                         f"{list(entries.shape)}")
    return entries


def _model1_rows(entries: torch.Tensor) -> torch.Tensor:
    """float64 rows whose MODEL1 quantization is the compressor's: the nope half rounded to
    bf16 first (the kernels quantize ``bf16(n)``), the rope half as is (rounded once, to bf16,
    by the quantizer)."""
    return torch.cat([entries[:, :MODEL1_D_NOPE].to(torch.bfloat16).to(_F64),
                      entries[:, MODEL1_D_NOPE:].to(_F64)], dim=1)


def compressed_entries_model1_pages(entries: torch.Tensor, block_size: int = 1, *,
                                    scale_floor: str = "flashmla") -> torch.Tensor:
    """The MODEL1 pages (``mla.reference.fp8_model1``) of ``entries [n, 512]``, ``n`` a positive
    multiple of ``block_size``, as the compressor writes them (``quantize_fp8_model1`` of
    ``bf16(nope) ‖ rope``). ``scale_floor``: ``"flashmla"`` (CUDA's CuTe kernels) or ``"vllm"``
    (the Triton kernel), see the module doc."""
    _check_entries(entries)
    check_positive_int("block_size", block_size)
    n = entries.shape[0]
    if entries.shape[1] != MODEL1_D_QK or n % block_size or n == 0:
        raise ValueError(f"entries must have shape [n, {MODEL1_D_QK}] with n a positive "
                         f"multiple of block_size={block_size}, got {list(entries.shape)}")
    rows = _model1_rows(entries).view(n // block_size, block_size, MODEL1_D_QK)
    return quantize_fp8_model1(rows, scale_floor=scale_floor)


def quantize_compressed_indexer_entries(entries: torch.Tensor
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``entries [n, 128]`` (the indexer compressor's) -> ``(codes uint8 [n, 128], scales
    float32 [n])`` as the indexer key cache holds them: ``quantize_indexer_k`` (ue8m0) of the
    bf16-rounded entries."""
    _check_entries(entries)
    if entries.shape[1] != INDEX_DIM:
        raise ValueError(f"entries must have shape [n, {INDEX_DIM}], got {list(entries.shape)}")
    return quantize_indexer_k(entries.to(torch.bfloat16), scale_fmt="ue8m0")


def round_compressed_entries(entries: torch.Tensor, *, scale_floor: str = "flashmla"
                             ) -> torch.Tensor:
    """The float64 values the cache holds for ``entries``: ``[n, 512]`` (MODEL1: e4m3 nope
    tiles of 64 with UE8M0 scales, bf16 rope; ``scale_floor`` as in
    ``compressed_entries_model1_pages``) or ``[n, 128]`` (the indexer's e4m3 with one
    power-of-two scale per entry; ``scale_floor`` does not apply). A NaN makes its whole tile
    NaN for ``d = 512`` (``round_fp8_model1``), only itself for ``d = 128`` (that amax ignores
    NaN)."""
    _check_entries(entries)
    if entries.shape[1] == INDEX_DIM:
        codes, scale = quantize_compressed_indexer_entries(entries)
        return codes.view(torch.float8_e4m3fn).to(_F64) * scale.to(_F64)[:, None]
    return round_fp8_model1(_model1_rows(entries), scale_floor=scale_floor).to(_F64)


# ---- a layer's compressor -------------------------------------------------------------------


def compressor_weights_of(weights: V4LayerWeights, prefix: str = "compressor."
                          ) -> CompressorWeights:
    """The compressor under ``prefix`` of a layer's checkpoint tensors (``"compressor."``, or
    ``"indexer.compressor."`` for the indexer's)."""
    if not isinstance(weights, V4LayerWeights):
        raise TypeError(f"weights must be a V4LayerWeights, got {type(weights).__name__}")
    t = weights.sub(prefix)
    missing = [n for n in ("wkv.weight", "wgate.weight", "ape", "norm.weight") if n not in t]
    if missing:
        raise ValueError(f"weights has no {prefix}{missing[0]} (a layer of ratio "
                         f"{weights.ratio}: only ratios 4 and 128 have a compressor)")
    return CompressorWeights(wkv=t["wkv.weight"], wgate=t["wgate.weight"], ape=t["ape"],
                             norm=t["norm.weight"])


def compressed_cache_entries(x: torch.Tensor, weights: V4LayerWeights,
                             kv_cache_dtype: str = "fp8_ds_mla", *,
                             scale_floor: str = "flashmla") -> torch.Tensor:
    """A layer's compressed entries ``[T // r, 512]`` (float64) for one request's ``x [T,
    hidden]`` (positions ``0 .. T-1``), as a cache of ``kv_cache_dtype`` holds them:
    ``"float64"`` exact, ``"bfloat16"`` the entry in bf16 (vLLM's full-row cache),
    ``"fp8_ds_mla"`` MODEL1 (``round_compressed_entries`` with ``scale_floor``)."""
    if kv_cache_dtype not in _KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES}, got "
                         f"{kv_cache_dtype!r}")
    entries = compress(x, compressor_weights_of(weights), weights.config)
    if kv_cache_dtype == "float64":
        return entries
    if kv_cache_dtype == "bfloat16":
        return entries.to(torch.bfloat16).to(_F64)
    return round_compressed_entries(entries, scale_floor=scale_floor)


# ---- DeepSeek-V4.1's compressor: ratios 1 and 2, no ape, no overlap -------------------------
#
# vLLM 0.33 ``vllm/models/deepseek_v41/compressor.py`` (``DeepseekCompressor``) and
# ``common/ops/fused_compress_quant_cache.py``. A V4.1 compressor lives only on a kv-source
# layer, is 512 wide, and has ``wkv`` ``[d, hidden]``, ``norm`` ``[d]`` and, for ratio 2 only,
# ``wgate`` ``[d, hidden]`` (ratio 1 has no gate); no ``ape``, no overlap. With
# ``kv_p = x_p @ wkv^T`` and ``s_p = x_p @ wgate^T``, entry ``j`` (emitted at ``p = j·r + r - 1``):
#
#     r = 1:  latent_j = bf16(RMSNorm(kv_j; norm))
#     r = 2:  a_{q,e}  = exp(s_{q,e}) / (exp(s_{2j,e}) + exp(s_{2j+1,e}))     q in {2j, 2j+1}
#             latent_j = bf16(RMSNorm(a_{2j} ⊙ kv_{2j} + a_{2j+1} ⊙ kv_{2j+1}; norm))
#     entry_j = RoPE_gptj(latent_j, position j·r)      the compressed layers' rotary, last 64 dims
#     key_j   = bf16(RoPE_gptj(bf16(RMSNorm(bf16(latent_j @ wk^T); k_norm)), j·r))   [128]
#
# The latent is rounded to bf16 once (the kernels store it so) and both the cache entry and
# the index key are made from that rounded latent; the entry's storage rounding is
# ``mla.reference.fp8_v41`` (MXFP8 or NVFP4, RoPE dims included) or bf16.

V41_COMPRESS_RATIOS = (1, 2)
# ``rope_gptj`` picks the rotary by a V4 ratio: any ratio > 1 names the compressed layers' one
# (compress_rope_theta, YaRN), which every V4.1 compressed layer (ratio 1 included) uses.
_COMPRESSED_ROPE = 4


@dataclass(frozen=True)
class V41CompressorWeights(_CompressorWidths):
    """A DeepSeek-V4.1 compressor's parameters, as the checkpoint names them
    (``layers.N.attn.compressor.wkv.weight``, ``.wgate.weight``, ``.norm.weight``): ``wkv``
    ``[d, hidden]``, ``norm`` ``[d]``, ``wgate`` ``[d, hidden]`` for ratio 2 and ``None`` for
    ratio 1. The ratio is 2 exactly when there is a gate. There is no ``ape``."""

    wkv: torch.Tensor
    norm: torch.Tensor
    wgate: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_float("norm", self.norm, ndim=1)
        check_float("wkv", self.wkv, shape=[self.norm.shape[0], None])
        if self.wgate is not None:
            check_float("wgate", self.wgate, shape=list(self.wkv.shape))

    @property
    def ratio(self) -> int:
        return 1 if self.wgate is None else 2


    @staticmethod
    def random(hidden_size: int, head_dim: int, ratio: int, *, seed: int = 0
               ) -> V41CompressorWeights:
        """Seeded random float64 weights (unit-variance projections, ``norm`` around 1)."""
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("head_dim", head_dim)
        if isinstance(ratio, bool) or ratio not in V41_COMPRESS_RATIOS:
            raise ValueError(f"ratio must be one of {V41_COMPRESS_RATIOS}, got {ratio!r}")
        g = torch.Generator().manual_seed(seed)

        def draw() -> torch.Tensor:
            return torch.randn(head_dim, hidden_size, generator=g, dtype=_F64) \
                * hidden_size ** -0.5

        wkv = draw()
        return V41CompressorWeights(
            wkv=wkv, norm=1.0 + 0.1 * torch.randn(head_dim, generator=g, dtype=_F64),
            wgate=draw() if ratio == 2 else None)


def v41_compress_latent(x: torch.Tensor, weights: V41CompressorWeights, eps: float, *,
                        bf16: bool = True) -> torch.Tensor:
    """The latents ``[T // r, d]`` (float64; rounded to bf16 with ``bf16``, as vLLM stores
    them) of one request's ``x [T, hidden]`` at positions ``0 .. T-1``."""
    if not isinstance(weights, V41CompressorWeights):
        raise TypeError(f"weights must be a V41CompressorWeights, got {type(weights).__name__}")
    check_float("x", x, shape=[None, weights.hidden_size])
    xw = x.to(_F64)
    kv = xw @ weights.wkv.to(device=x.device, dtype=_F64).T
    r = weights.ratio
    n = x.shape[0] // r
    if weights.wgate is None:
        pooled = kv[:n]
    else:
        score = xw @ weights.wgate.to(device=x.device, dtype=_F64).T
        ends = torch.arange(n, device=x.device) * r + r - 1
        pooled = pool_windows(kv, score, 0, ends, r, 1)
    latent = rms_norm(pooled, weights.norm.to(device=x.device, dtype=_F64), eps)
    return latent.to(torch.bfloat16).to(_F64) if bf16 else latent


def v41_compress(x: torch.Tensor, weights: V41CompressorWeights, config: V4Config, *,
                 bf16: bool = True) -> torch.Tensor:
    """The compressed entries ``[T // r, d]`` (float64, before the cache's rounding): the
    latents (``v41_compress_latent``) rotated at ``j·r`` by the compressed layers' RoPE."""
    if weights.head_dim < config.rope_head_dim:
        raise ValueError(f"weights.norm must have at least rope_head_dim="
                         f"{config.rope_head_dim} entries, got {weights.head_dim}")
    latent = v41_compress_latent(x, weights, config.rms_norm_eps, bf16=bf16)
    if latent.shape[0] == 0:
        return latent
    ids = torch.arange(latent.shape[0], device=x.device)
    return rope_gptj(latent, ids * weights.ratio, config, _COMPRESSED_ROPE)


def v41_index_key(latent: torch.Tensor, wk: torch.Tensor, k_norm: torch.Tensor,
                  ratio: int, config: V4Config, *, bf16: bool = True) -> torch.Tensor:
    """The index keys ``[n, index_head_dim]`` (float64 holding bf16 values, before the key
    cache's quantization) of the latents ``[n, d]`` of entries ``0 .. n-1``:
    ``bf16(RoPE(bf16(RMSNorm(bf16(latent @ wk^T); k_norm)), j·r))`` (vLLM 0.33
    ``deepseek_v41/attention.py`` ``_produce_k``, ``common/ops/indexer_k_store.py``);
    ``bf16=False``: the same without the three roundings (the exact math)."""
    check_float("latent", latent, ndim=2)
    check_float("wk", wk, shape=[None, latent.shape[1]], device=latent.device)
    check_float("k_norm", k_norm, shape=[wk.shape[0]], device=latent.device)
    if isinstance(ratio, bool) or ratio not in V41_COMPRESS_RATIOS:
        raise ValueError(f"ratio must be one of {V41_COMPRESS_RATIOS}, got {ratio!r}")

    if not isinstance(bf16, bool):
        raise TypeError(f"bf16 must be a bool, got {type(bf16).__name__}")

    def rnd(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).to(_F64) if bf16 else t

    k = rnd(latent.to(_F64) @ wk.to(_F64).T)
    k = rnd(rms_norm(k, k_norm.to(_F64), config.rms_norm_eps))
    if k.shape[0] == 0:
        return k
    ids = torch.arange(k.shape[0], device=latent.device)
    return rnd(rope_gptj(k, ids * ratio, config, _COMPRESSED_ROPE))
