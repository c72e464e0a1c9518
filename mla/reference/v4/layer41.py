"""DeepSeek-V4.1's attention layer by its definition: dense tensors, explicit masks, float64.

One request of ``T`` tokens at positions ``p = 0 .. T-1`` through layer ``l`` of ratio ``r =
config.layer_ratio(l)`` in {0, 1, 2}, ``d = 512`` (``d_R = 64`` RoPE dims last), ``H`` heads in
``G`` groups; ``rope`` is the window rotary for ``r = 0``, the compressed one (YaRN) for ``r >
0`` (``mla.reference.v4.rope``). The core is V4's (``mla.reference.v4.layer``, equations (1),
(2), (4), (7)-(9), reused here), without V4's per-head norm of ``q``:

    (1)  c_Q = RMSNorm(x W_qa^T; w_qn),   c_KV = RMSNorm(x W_kv^T; w_kvn)
    (2)  q_h = rope_p((c_Q W_qb^T)[h·d : h·d+d])           no per-head RMSNorm in V4.1
    (3)  k_s = rope_s(c_KV[s])                              the window's keys
    (4)  the kv source S = kv_source_layer(l) (the nearest kv source <= l) owns the compressor
         (``v41_compress``: r = 1 one latent a token, RMSNorm(x_j wkv^T); r = 2 a per-channel
         softmax pool of tokens 2j, 2j+1 by x wgate^T; no ape, no overlap) over ITS hidden
         states x^S:   latent_j,  e_j = rope_{j·r}(latent_j),  j < T // r
         and, S being an index source too, the index keys
                       kappa_j = rope_{j·r}(RMSNorm(latent_j W_k^T; k_norm))       [128]
    (5)  the index source I = index_source_layer(l) (the nearest index source <= l) scores,
         from ITS c_Q^I and x^I (n_I heads of D = 128):
             qi_h = rope_p((c_Q^I W_Iq^T)[h·D : h·D+D])
             w_h  = (x^I W_proj^T)_h · D^-0.5 · n_I^-0.5
             L[p, j] = Σ_h w_h · ReLU(qi_h · kappa_j)      j < n_p = (p + 1) // r
         two-level candidates (``mla.reference.v4.candidates``): the candidate source publishes
         the best ``candidate_topk_blocks`` blocks of ``candidate_block_size`` entries (block
         score = max logit, the newest block (n_p - 1) // B pinned), before its own top-k; each
         later index source sets L to -inf outside them before its top-k. Then
             topk_p = the index_topk largest L[p, :] over [0, n_p) (ties to the lower id), -1 after;
         when T // r <= index_topk no logits are computed (and no candidates published): every
         row is [0 .. n_p - 1, -1, ..] (vLLM's short-context fill).
    (6)  visible keys:  window W(p) = { s : max(p - W + 1, 0) <= s <= p },
                        compressed C(p) = topk_p (ids of I's top-k, each j < (p + 1) // r),
                        C(p) = {} for r = 0
    (7)  o_h = Σ_{k ∈ W(p) ∪ C(p)} e^{z_{h,k}} k / (Σ_k e^{z_{h,k}} + e^{sink_h}),
         z_{h,k} = q_h · k / sqrt(d)   (V = K, a key in both scopes counts twice; lse without sink)
    (8)  o_h <- rope_p^{-1}(o_h);  z_g = W_oa[g] (o_{g·H/G} ‖ ..),  out = concat_g z_g · W_ob^T

Every layer reads its OWN x for (1)-(3) and (7)-(8); (4) is the kv source's and (5) the index
source's, computed when that layer ran: ``v41_layer_definition`` takes them as inputs
(``V41KVSource``, ``V41IndexSource``, the published candidates) when the layer is not the
source, and ``v41_stack_definition`` runs a stack of layers, threading them through.

Exact float64 by default. ``kv_cache_dtype`` (``V41_KV_CACHE_DTYPES``) emulates one rounding
only, the attention caches' codecs (``mla.reference.fp8_v41``), so that the definition sees the
keys a serving path (``mla.reference.v4.serving41``) reads back from its bytes:

    "float64"   nothing rounded (the default)
    "mxfp8"     k_s of (3) and e_j of (4) each as its 528-byte MXFP8 record gives it back,
                ``dequantize_fp8_v41(quantize_fp8_v41(.))`` (vLLM's V4.1 record on SM100)
    "nvfp4"     k_s as for "mxfp8", e_j as its 288-byte NVFP4 record gives it back (vLLM's
                ``nvfp4_ds_mla``: the window keeps MXFP8, the compressed cache is NVFP4)

The codecs' own float32 cast of their input is part of that rounding. Not emulated in any
mode: the bf16 of c_Q, c_KV, q, the latent and the index key before the codecs (vLLM rounds
them), the index key cache's FP8 / MXFP4 and the indexer's FP8 / MXFP4 q (the top-k is the
exact one), the inverse RoPE's and projections' bf16, the FP8 block weights.

Follows vLLM 0.33 ``vllm/models/deepseek_v41/``: ``attention.py`` 313-361 (ratios
0/1/2, the nearest source at or below), 441-491 (index key cache owned by the kv source,
candidate roles), 584-611 (compressor and compressed cache only on kv sources), 1150 (no q
norm), 1414-1422 and 1476-1508 (``wk``, ``k_norm``, ``_produce_k``), 111-127 and 1555-1584
(the short-context fill); ``common/ops/indexer_k_store.py`` 156-185 (keys at group ends, RoPE at
``(p // r)·r``); ``nvidia/flashmla.py`` 200-216 and 296-310 (every compressed layer, ratio 1
included, attends the shared top-k); ``common/ops/cache_utils.py`` 1078-1097 (the compressed
scope: the first ``min((p + 1) // r, index_topk)`` ids of the row, then the window);
``vllm/v1/attention/backends/mla/indexer.py`` 228-230 (``(p + 1) // r`` visible entries);
``model_executor/layers/sparse_attn_indexer.py`` 739-762 and
``model_executor/kernels/attention/dsa/candidate_blocks.py`` 42-67, 157-225, 228-end
(candidates).

Not verified in the wheel's Python: (a) the CUDA row top-k (``top_k_per_row_prefill``) when a
masked row has fewer finite logits than ``index_topk`` slots: here, as
``mla.reference.indexer_logits.top_k_per_row``, the remaining slots take ``-inf`` entries of
the row, lowest ids first; (b) a consumer whose ratio differs from its source's: vLLM reads the
source's cache with the consumer's ratio, which is not meaningful, so it is refused here; (c)
a masking indexer that computes logits while the candidate source took the short-context fill
(vLLM reads a buffer nobody wrote): refused; (d) checkpoint names ``indexer.wk.weight`` and
``indexer.k_norm.weight`` follow vLLM's module names (no renaming in ``load_weights``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mla.reference.fp8_v41 import (
    dequantize_fp8_v41,
    dequantize_nvfp4_v41,
    quantize_fp8_v41,
    quantize_nvfp4_v41,
)
from mla.reference.indexer_logits import top_k_per_row
from mla.reference.v4.candidates import mask_to_candidates, select_candidate_blocks
from mla.reference.v4.compressor import V41CompressorWeights, v41_compress_latent, v41_index_key
from mla.reference.v4.config import V4Config
from mla.reference.v4.layer import (
    attend_with_sink,
    topk_entry_mask,
    v4_output_projection,
    v4_query_and_key,
    window_mask,
)
from mla.reference.v4.rope import rope_gptj
from mla.reference.v4.weights import check_weights, random_weights
from mla.validation import check_float, check_index

__all__ = ["V41LayerWeights", "V41KVSource", "V41IndexSource", "V41LayerTrace",
           "V41_KV_CACHE_DTYPES", "v41_cache_round", "v41_weight_shapes", "v41_kv_source",
           "v41_indexer_logits", "v41_indexer_topk",
           "v41_layer_definition", "v41_stack_definition", "v41_rope_ratio"]

F64 = torch.float64
_EXACT = "float64"  # V4's kv_cache_dtype for "no rounding"
V41_KV_CACHE_DTYPES = ("float64", "mxfp8", "nvfp4")


def check_v41_kv_cache_dtype(kv_cache_dtype: object) -> str:
    if kv_cache_dtype not in V41_KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {V41_KV_CACHE_DTYPES}, got "
                         f"{kv_cache_dtype!r}")
    return kv_cache_dtype  # type: ignore[return-value]


def v41_cache_round(rows: torch.Tensor, kv_cache_dtype: str, *, compressed: bool = False
                    ) -> torch.Tensor:
    """float64 ``rows [..., 512]`` as a V4.1 attention cache of ``kv_cache_dtype`` gives them
    back (the module doc's table): the window cache (``compressed=False``) or the compressed
    cache (``compressed=True``)."""
    check_v41_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "float64":
        return rows.to(F64)
    if compressed and kv_cache_dtype == "nvfp4":
        return dequantize_nvfp4_v41(quantize_nvfp4_v41(rows), dtype=F64)
    return dequantize_fp8_v41(quantize_fp8_v41(rows), dtype=F64)


def v41_rope_ratio(ratio: int) -> int:
    """The V4 ratio that names a V4.1 layer's rotary in ``rope_gptj``: 1 (window rope) for
    ratio 0, 4 (compressed rope, YaRN) for ratios 1 and 2 (vLLM ``common/rope.py``)."""
    return 1 if ratio == 0 else 4


def _check_config(config: object) -> V4Config:
    if not isinstance(config, V4Config):
        raise TypeError(f"config must be a V4Config, got {type(config).__name__}")
    if config.version != "v4.1":
        raise ValueError(f"config must be a DeepSeek-V4.1 config (version='v4.1'), got "
                         f"version {config.version!r}")
    if config.q_head_norm:
        raise ValueError("config.q_head_norm must be False for V4.1 (vLLM's apply_q_norm=False)")
    return config


def _check_topology(config: V4Config, layer: int) -> None:
    """What vLLM's layer construction needs of ``layer``: sources are compressed, a consumer's
    ratio is its sources', an index source finds the index keys of its kv source."""
    r = config.layer_ratio(layer)
    if (config.owns_compressor(layer) or config.owns_indexer(layer)) and r == 0:
        raise ValueError(f"config: layer {layer} is a source layer of ratio 0 (vLLM builds no "
                         f"compressor or indexer of ratio 0)")
    if r == 0:
        return
    kv, idx = config.kv_source_layer(layer), config.index_source_layer(layer)
    for name, src in (("kv", kv), ("index", idx)):
        if config.layer_ratio(src) != r:
            raise ValueError(f"config: layer {layer} (ratio {r}) reads the {name} source layer "
                             f"{src} of ratio {config.layer_ratio(src)}; they must agree")
    if config.owns_indexer(idx) and not config.owns_indexer(kv):
        raise ValueError(f"config: index source {idx} reads the index keys of kv source {kv}, "
                         f"which has no indexer (only an indexer on a kv source makes them)")


def v41_weight_shapes(config: V4Config, layer: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape for V4.1 layer ``layer`` (names under ``layers.{l}.attn.``):
    V4's core eight; ``compressor.wkv``, ``compressor.norm`` (and ``compressor.wgate`` at
    ratio 2) on a kv source; ``indexer.wq_b``, ``indexer.weights_proj`` on an index source,
    with ``indexer.wk [128, 512]`` and ``indexer.k_norm`` when it is also a kv source."""
    c = _check_config(config)
    _check_topology(c, layer)
    d, hidden = c.head_dim, c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "wq_a.weight": (c.q_lora_rank, hidden), "q_norm.weight": (c.q_lora_rank,),
        "wq_b.weight": (c.num_heads * d, c.q_lora_rank), "wkv.weight": (d, hidden),
        "kv_norm.weight": (d,), "attn_sink": (c.num_heads,),
        "wo_a.weight": (c.o_groups * c.o_lora_rank, c.heads_per_group * d),
        "wo_b.weight": (hidden, c.o_groups * c.o_lora_rank)}
    if c.owns_compressor(layer):
        shapes["compressor.wkv.weight"] = (d, hidden)
        if c.layer_ratio(layer) == 2:
            shapes["compressor.wgate.weight"] = (d, hidden)
        shapes["compressor.norm.weight"] = (d,)
    if c.owns_indexer(layer):
        shapes["indexer.wq_b.weight"] = (c.index_n_heads * c.index_head_dim, c.q_lora_rank)
        shapes["indexer.weights_proj.weight"] = (c.index_n_heads, hidden)
        if c.owns_compressor(layer):
            shapes["indexer.wk.weight"] = (c.index_head_dim, d)
            shapes["indexer.k_norm.weight"] = (c.index_head_dim,)
    return shapes


@dataclass
class V41LayerWeights:
    """One V4.1 layer's attention weights by checkpoint name, with its config and layer id."""

    config: V4Config
    layer: int
    tensors: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        check_weights(self.tensors, v41_weight_shapes(self.config, self.layer),
                      f"V4.1 layer {self.layer}")

    @property
    def ratio(self) -> int:
        return self.config.layer_ratio(self.layer)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def compressor(self) -> V41CompressorWeights:
        if not self.config.owns_compressor(self.layer):
            raise ValueError(f"layer {self.layer} is not a kv source: it has no compressor")
        return V41CompressorWeights(wkv=self["compressor.wkv.weight"],
                                    norm=self["compressor.norm.weight"],
                                    wgate=self.tensors.get("compressor.wgate.weight"))

    @classmethod
    def random(cls, config: V4Config, layer: int, seed: int = 0) -> V41LayerWeights:
        """Seeded float64 weights (``mla.reference.v4.weights.random_weights``)."""
        return cls(config, layer, random_weights(v41_weight_shapes(config, layer), seed))


@dataclass(frozen=True)
class V41KVSource:
    """What kv-source layer ``layer`` publishes for one request: the compressor's latents and
    the compressed cache's rows ``entries = rope(latent)`` ``[T // r, d]``, and the index keys
    ``[T // r, 128]`` (``None`` if the layer has no indexer); ``entries`` as a compressed
    cache of ``kv_cache_dtype`` gives them back (``v41_cache_round``)."""

    layer: int
    ratio: int
    latent: torch.Tensor
    entries: torch.Tensor
    index_keys: torch.Tensor | None
    kv_cache_dtype: str = _EXACT


@dataclass(frozen=True)
class V41IndexSource:
    """What index-source layer ``layer`` publishes: ``topk`` int32 ``[T, index_topk]`` (local
    entry ids, ``-1`` after), the logits it took the top-k of (after the candidate mask;
    ``None`` for the short-context fill) and, for the candidate source, its ``candidates``
    int64 ``[T, candidate_topk_blocks]`` (``None`` otherwise or in the fill)."""

    layer: int
    ratio: int
    topk: torch.Tensor
    logits: torch.Tensor | None
    candidates: torch.Tensor | None


@dataclass
class V41LayerTrace:
    """Every stage of one request through a V4.1 layer (float64 unless said)."""

    q_latent: torch.Tensor          # c_Q [T, q_lora_rank]
    kv: torch.Tensor                # c_KV [T, d], before RoPE
    q: torch.Tensor                 # [T, H, d] after RoPE
    k_window: torch.Tensor          # [T, d]
    k_compressed: torch.Tensor      # [n_c, d] the kv source's entries (n_c = 0 at ratio 0)
    kv_source: V41KVSource | None   # what this layer read (its own if it is the kv source)
    index_source: V41IndexSource | None  # likewise for the top-k
    topk: torch.Tensor | None       # int32 [T, index_topk] (ratio > 0)
    window_mask: torch.Tensor       # bool [T, T]
    compressed_mask: torch.Tensor   # bool [T, n_c]
    attn: torch.Tensor              # [T, H, d], sink applied
    lse: torch.Tensor               # [T, H], without the sink
    o: torch.Tensor                 # [T, H, d] after the inverse RoPE
    z: torch.Tensor                 # [T, G, o_lora_rank]
    out: torch.Tensor               # [T, hidden]


def _check_weights(weights: object) -> V41LayerWeights:
    if not isinstance(weights, V41LayerWeights):
        raise TypeError(f"weights must be a V41LayerWeights, got {type(weights).__name__}")
    return weights


def v41_kv_source(x: torch.Tensor, weights: V41LayerWeights, *,
                  kv_cache_dtype: str = _EXACT) -> V41KVSource:
    """Equation (4) of kv-source layer ``weights.layer`` over its hidden states ``x [T,
    hidden]``: latents, rotated entries (as the compressed cache of ``kv_cache_dtype`` gives
    them back) and (if it has an indexer) the index keys, exact."""
    w = _check_weights(weights)
    check_v41_kv_cache_dtype(kv_cache_dtype)
    c = w.config
    check_float("x", x, shape=[None, c.hidden_size])
    latent = v41_compress_latent(x, w.compressor(), c.rms_norm_eps, bf16=False)
    r = w.ratio
    ids = torch.arange(latent.shape[0], device=x.device)
    entries = rope_gptj(latent, ids * r, c, v41_rope_ratio(r)) if latent.shape[0] else latent
    entries = v41_cache_round(entries, kv_cache_dtype, compressed=True)
    keys = None
    if c.owns_indexer(w.layer):
        keys = v41_index_key(latent, w["indexer.wk.weight"], w["indexer.k_norm.weight"], r, c,
                             bf16=False)
    return V41KVSource(w.layer, r, latent, entries, keys, kv_cache_dtype)


def _positions(name: str, positions: torch.Tensor | None, T: int, device: torch.device
               ) -> torch.Tensor:
    if positions is None:
        return torch.arange(T, device=device)
    check_index(name, positions, shape=[T], device=device)
    if T and int(positions.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {int(positions.min())}")
    return positions.long()


def v41_indexer_logits(x: torch.Tensor, q_latent: torch.Tensor, keys: torch.Tensor,
                       weights: V41LayerWeights, *, positions: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """``L [T, n]`` float64 of index source ``weights.layer`` (equation (5)): its ``x [T,
    hidden]`` and ``q_latent [T, q_lora_rank]`` at ``positions [T]`` (default ``0 .. T-1``)
    against ``keys [n, 128]``; ``-inf`` where ``j >= (p + 1) // r``."""
    w = _check_weights(weights)
    c = w.config
    if not c.owns_indexer(w.layer):
        raise ValueError(f"weights: layer {w.layer} is not an index source")
    check_float("x", x, shape=[None, c.hidden_size])
    T, H, D = x.shape[0], c.index_n_heads, c.index_head_dim
    check_float("q_latent", q_latent, shape=[T, c.q_lora_rank], device=x.device)
    check_float("keys", keys, shape=[None, D], device=x.device)
    r = w.ratio
    positions = _positions("positions", positions, T, x.device)
    n_vis = (positions + 1) // r
    if T and int(n_vis.max()) > keys.shape[0]:
        raise ValueError(f"keys must hold every visible entry: {int(n_vis.max())} needed, "
                         f"got {keys.shape[0]}")
    q = (q_latent.to(F64) @ w["indexer.wq_b.weight"].to(F64).T).view(T, H, D)
    q = rope_gptj(q, positions, c, v41_rope_ratio(r))
    wt = (x.to(F64) @ w["indexer.weights_proj.weight"].to(F64).T) * D ** -0.5 * H ** -0.5
    dots = torch.einsum("thd,nd->thn", q, keys.to(F64)).clamp_min(0.0)
    logits = torch.einsum("th,thn->tn", wt, dots)
    cols = torch.arange(keys.shape[0], device=x.device)[None, :]
    return logits.masked_fill(cols >= n_vis[:, None], float("-inf"))


def v41_indexer_topk(x: torch.Tensor, q_latent: torch.Tensor, keys: torch.Tensor,
                     weights: V41LayerWeights, candidates: torch.Tensor | None = None, *,
                     positions: torch.Tensor | None = None,
                     short_context: bool | None = None) -> V41IndexSource:
    """The top-k of index source ``weights.layer`` (equation (5)), with its candidate role:
    the candidate source publishes its blocks; a later index source needs ``candidates``
    (those blocks) unless it takes the short-context fill; others take none.

    ``positions [T]``: the rows' positions (default ``0 .. T-1``, the whole request);
    ``short_context``: whether the fill is taken (default ``T // r <= index_topk``; a serving
    batch decides by its longest request, ``max_seq_len // r <= index_topk``)."""
    w = _check_weights(weights)
    c = w.config
    check_float("x", x, shape=[None, c.hidden_size])
    T, r, K = x.shape[0], w.ratio, c.index_topk
    positions = _positions("positions", positions, T, x.device)
    n_vis = (positions + 1) // r
    if short_context is None:
        short_context = T // r <= K
    elif not isinstance(short_context, bool):
        raise TypeError(f"short_context must be a bool or None, got "
                        f"{type(short_context).__name__}")
    role = c.candidate_role(w.layer)
    if role != "mask" and candidates is not None:
        raise ValueError(f"candidates are only for index sources after the candidate source "
                         f"{c.candidate_source_layer_id}; layer {w.layer} takes none")
    if short_context:  # vLLM's short-context fill: no logits, no candidates published
        cols = torch.arange(K, device=x.device)[None, :]
        fill = torch.where(cols < n_vis[:, None], cols, -1).to(torch.int32)
        return V41IndexSource(w.layer, r, fill, None, None)
    logits = v41_indexer_logits(x, q_latent, keys, w, positions=positions)
    published = None
    if role == "write":
        published = select_candidate_blocks(logits, n_vis, c.candidate_block_size,
                                            c.candidate_topk_blocks)
    elif role == "mask":
        if candidates is None:
            raise ValueError(f"candidates: layer {w.layer} masks its logits with the candidate "
                             f"source's blocks, but none were given (the source published "
                             f"none: it took the short-context fill)")
        check_index("candidates", candidates, shape=[T, c.candidate_topk_blocks],
                    device=x.device)
        logits = mask_to_candidates(logits, n_vis, candidates, c.candidate_block_size)
    topk = top_k_per_row(logits, torch.zeros_like(n_vis), n_vis, K)
    return V41IndexSource(w.layer, r, topk, logits, published)


def _check_source(name: str, src: object, cls: type, want: int | None, T: int) -> None:
    if want is None:
        if src is not None:
            raise ValueError(f"{name} must be None here (this layer computes its own or has "
                             f"no compressed scope)")
        return
    if not isinstance(src, cls):
        raise TypeError(f"{name} must be a {cls.__name__} of layer {want}, got "
                        f"{type(src).__name__}")
    if src.layer != want:  # type: ignore[attr-defined]
        raise ValueError(f"{name} must be layer {want}'s, got layer {src.layer}'s")  # type: ignore[attr-defined]
    rows = src.entries.shape[0] if isinstance(src, V41KVSource) else src.topk.shape[0]  # type: ignore[attr-defined]
    expect = T // src.ratio if isinstance(src, V41KVSource) else T  # type: ignore[attr-defined]
    if rows != expect:
        raise ValueError(f"{name} holds {rows} rows, but a request of {T} tokens needs "
                         f"{expect}")


def v41_layer_definition(x: torch.Tensor, weights: V41LayerWeights, *,
                         kv_source: V41KVSource | None = None,
                         index_source: V41IndexSource | None = None,
                         candidates: torch.Tensor | None = None,
                         kv_cache_dtype: str = _EXACT) -> V41LayerTrace:
    """One request's tokens ``x [T, hidden]`` (positions ``0 .. T-1``) through V4.1 layer
    ``weights.layer`` (the module doc's equations), exact float64.

    ``kv_source``: for a compressed layer that is not a kv source, what its kv source
    published (``v41_kv_source`` of that layer's hidden states); ``index_source``: for a
    compressed layer that is not an index source, its index source's ``V41IndexSource``;
    ``candidates``: for an index source after the candidate source, the blocks that source
    published. A layer that is its own source takes ``None`` and computes it; a window-only
    layer takes none of them. ``kv_cache_dtype``: the caches' rounding (the module doc), the
    window keys' here and the entries' at the kv source (a given ``kv_source`` must have
    been made with the same)."""
    w = _check_weights(weights)
    check_v41_kv_cache_dtype(kv_cache_dtype)
    c = w.config
    check_float("x", x, shape=[None, c.hidden_size])
    T, r, layer = x.shape[0], w.ratio, w.layer
    positions = torch.arange(T, device=x.device)
    rope = v41_rope_ratio(r)
    q_latent, kv, q, k_window = v4_query_and_key(x, positions, w, _EXACT,  # type: ignore[arg-type]
                                                 rope_ratio=rope)
    kv_layer = None if r == 0 or c.owns_compressor(layer) else c.kv_source_layer(layer)
    idx_layer = None if r == 0 or c.owns_indexer(layer) else c.index_source_layer(layer)
    _check_source("kv_source", kv_source, V41KVSource, kv_layer, T)
    _check_source("index_source", index_source, V41IndexSource, idx_layer, T)
    if kv_source is not None and kv_source.kv_cache_dtype != kv_cache_dtype:
        raise ValueError(f"kv_source was made with kv_cache_dtype "
                         f"{kv_source.kv_cache_dtype!r}, this layer reads {kv_cache_dtype!r}")
    k_window = v41_cache_round(k_window, kv_cache_dtype)
    if r > 0 and c.owns_compressor(layer):
        kv_source = v41_kv_source(x, w, kv_cache_dtype=kv_cache_dtype)
    if r > 0 and c.owns_indexer(layer):
        assert kv_source is not None
        if kv_source.index_keys is None:
            raise ValueError(f"kv_source: layer {kv_source.layer} published no index keys")
        index_source = v41_indexer_topk(x, q_latent, kv_source.index_keys, w, candidates)
    elif candidates is not None:
        raise ValueError(f"candidates are only for index sources after the candidate source; "
                         f"layer {layer} is not one")
    if r == 0:
        k_comp = x.new_zeros(0, c.head_dim, dtype=F64)
        topk = None
        m_comp = torch.zeros(T, 0, dtype=torch.bool, device=x.device)
    else:
        assert kv_source is not None and index_source is not None
        k_comp, topk = kv_source.entries, index_source.topk
        m_comp = topk_entry_mask(positions, k_comp.shape[0], r, topk)
    m_window = window_mask(positions, positions, c.sliding_window)
    keys = torch.cat([k_window, k_comp])
    mask = torch.cat([m_window, m_comp], dim=1)
    attn, lse = attend_with_sink(q, keys, mask, w["attn_sink"].float(), c.softmax_scale)
    o, z, out = v4_output_projection(attn, positions, w, _EXACT,  # type: ignore[arg-type]
                                     rope_ratio=rope)
    return V41LayerTrace(q_latent, kv, q, k_window, k_comp, kv_source, index_source, topk,
                         m_window, m_comp, attn, lse, o, z, out)


def v41_stack_definition(xs: Sequence[torch.Tensor], weights: Sequence[V41LayerWeights], *,
                         kv_cache_dtype: str = _EXACT) -> list[V41LayerTrace]:
    """Layers ``0 .. len(weights) - 1`` of one V4.1 model in order, layer ``i`` on its hidden
    states ``xs[i] [T, hidden]`` (the attention's input; the rest of the block is not
    modelled), each consumer fed what its sources published, as vLLM's shared caches and
    top-k / candidate buffers hand it on; ``kv_cache_dtype`` as in ``v41_layer_definition``."""
    if len(xs) != len(weights):
        raise ValueError(f"xs and weights must have the same length, got {len(xs)} and "
                         f"{len(weights)}")
    kv_pub: dict[int, V41KVSource] = {}
    idx_pub: dict[int, V41IndexSource] = {}
    candidates: torch.Tensor | None = None
    traces = []
    for i, (x, w) in enumerate(zip(xs, weights)):
        w = _check_weights(w)
        if w.layer != i or w.config != weights[0].config:
            raise ValueError(f"weights[{i}] must be layer {i} of weights[0]'s config, got "
                             f"layer {w.layer}")
        c, r = w.config, w.ratio
        kv_src = idx_src = None
        if r > 0 and not c.owns_compressor(i):
            kv_src = kv_pub[c.kv_source_layer(i)]  # type: ignore[index]
        if r > 0 and not c.owns_indexer(i):
            idx_src = idx_pub[c.index_source_layer(i)]  # type: ignore[index]
        role = c.candidate_role(i) if r > 0 else None
        trace = v41_layer_definition(x, w, kv_source=kv_src, index_source=idx_src,
                                     candidates=candidates if role == "mask" else None,
                                     kv_cache_dtype=kv_cache_dtype)
        if r > 0 and c.owns_compressor(i):
            kv_pub[i] = trace.kv_source  # type: ignore[assignment]
        if r > 0 and c.owns_indexer(i):
            idx_pub[i] = trace.index_source  # type: ignore[assignment]
        if role == "write":
            candidates = trace.index_source.candidates  # type: ignore[union-attr]
        traces.append(trace)
    return traces
