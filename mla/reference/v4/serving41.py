"""DeepSeek-V4.1's attention layers as vLLM 0.33 serves them: paged caches shared across
layers, two KV scopes, and FlashMLA's two sparse kernels (their references,
``mla.reference.sparse``), for a stack of layers ``0 .. n-1`` of one model.

Caches (``vllm/models/deepseek_v41/attention.py`` 441-611; ``sparse_mla.py`` 115-116):

    window cache       every layer: every token's key ``k_s`` (equation (3) of ``layer41.py``),
                       pages of ``window_page`` tokens (vLLM: 32);
                       slot(s) = window_table[b, s // P_w] · P_w + s % P_w
    compressed cache   kv-source layers only: entry ``e_j`` (equation (4)), pages of
                       ``compressed_page_tokens`` tokens (vLLM: 128 on SM100, 64 on SM90), i.e.
                       ``P_c = compressed_page_tokens // r`` entries; read by the layers above
                       the source that name it (``config.kv_source_layer``)
    index key cache    kv-source layers with an indexer: the index key ``kappa_j`` (equation
                       (4)), float64 rows of 128, paged as the compressed cache; read by the
                       index sources above (``config.index_source_layer`` -> its kv source)

The attention caches hold ``kv_cache_dtype`` (``layer41.V41_KV_CACHE_DTYPES``): ``"float64"``
rows ``[pages, page, 512]`` (exact), ``"mxfp8"`` the 528-byte MXFP8 records of
``mla.reference.fp8_v41`` in both, or ``"nvfp4"`` (vLLM's ``nvfp4_ds_mla``) MXFP8 in the
window and 288-byte NVFP4 records in the compressed cache, ``uint8 [pages, page, bytes]``
(one record a token, interleaved; vLLM's block-stride padding is not modelled). The index
key cache is float64 (its FP8 / MXFP4 bytes are not modelled). Pages are handed out in a
scrambled order (``serving.scrambled_page_table``), as a block allocator would.

A step (``v41_serving_step``) runs the layers in order, as the model does. Layer ``l`` writes
its new tokens' keys to its window cache; a kv source writes the entries and index keys its
new tokens complete (computed from its hidden states so far, ``V41ServingCache.history``: an
entry depends on its own ``r`` tokens only); an index source reads its kv source's index keys
back from the cache and takes the top-k of its new tokens (``layer41.v41_indexer_topk`` at
their positions), the short-context fill when the batch's longest request has
``max_seq_len // r <= index_topk`` (``attention.py`` 1555-1584); the candidate source's
blocks go to the later index sources of the same step. A compressed layer attends the top-k
of its index source (``nvidia/flashmla.py`` 200-216, 296-310):

Decode (``_forward_decode``): every new token is its own row of ``sparse_mla_decode`` (so
MTP's ``s_q > 1`` tokens each have their own window and top-k):

    scope 1   indices = slots of the window [max(p - W + 1, 0), p], -1 padded to W columns,
              topk_length = its length
    scope 2   extra_indices = the top-k row's ids through the kv source's compressed pages
              (-1 stays -1), extra_topk_length = its count of valid ids
              (``cache_utils.py`` 824-905); none for a window-only layer

Prefill (``_forward_prefill``, ``combine_topk_swa_indices``, ``cache_utils.py`` 1020-1130):
request ``b``'s ``N_b = L_b // r`` compressed entries go to workspace rows ``[M·b, M·b +
N_b)``, its raw tokens from ``g_b = L_b - (n_b + min(L_b - n_b, W - 1))`` on to rows ``M·b + N
+ (s - g_b)`` (``N = max_b N_b``, 0 for a window-only layer, ``M = N + max_b (L_b - g_b)``);
each query's combined row is the first ``t_p = min((p + 1) // r, index_topk)`` ids of its
top-k row (``M·b + j``; -1 where invalid), then its window ``M·b + N + (s - g_b)``,
``topk_length = t_p + window length``, -1 padded to ``round_up(index_topk + W, 128)``
(``round_up(W, 128)`` for a window-only layer); then ``sparse_mla_prefill``.

``sparse_mla_decode`` reads plain rows or V4's fp8 layouts, not the V4.1 records: the byte
caches are decoded to float64 rows by ``fp8_v41``'s dequantizers (as FlashMLA's V41 model
type decodes them in its kernel) before the call, and the prefill workspace is filled the
same way (``dequantize_and_gather_k_cache``). Both paths give the definition's numbers
(``layer41.v41_stack_definition`` with the same ``kv_cache_dtype``: the same keys, read back
from the same bytes, the same masks, one softmax with the sink); in float64 only the order
of the sums differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mla.reference.fp8_v41 import (
    FP8_V41_BYTES,
    NVFP4_V41_BYTES,
    dequantize_fp8_v41,
    dequantize_nvfp4_v41,
    quantize_fp8_v41,
    quantize_nvfp4_v41,
)
from mla.reference.sparse import sparse_mla_decode, sparse_mla_prefill
from mla.reference.v4.layer import v4_output_projection, v4_query_and_key
from mla.reference.v4.layer41 import (
    V41IndexSource,
    V41LayerWeights,
    check_v41_kv_cache_dtype,
    v41_indexer_topk,
    v41_kv_source,
    v41_rope_ratio,
)
from mla.reference.v4.scopes import paged_slots, window_local_ids
from mla.reference.v4.serving import scrambled_page_table
from mla.validation import check_float, check_positive_int

__all__ = ["V41ServingCache", "v41_serving_step", "V41_WINDOW_PAGE",
           "V41_COMPRESSED_PAGE_TOKENS", "V41_PREFILL_PAD"]

D = 512
V41_WINDOW_PAGE = 32  # vLLM's DeepseekV4SWACache block_size for V4.1
V41_COMPRESSED_PAGE_TOKENS = 128  # the main block size on SM100 (64 on SM90)
V41_PREFILL_PAD = 128  # combined prefill rows are padded to a multiple of this
F64 = torch.float64
_CODECS = {"mxfp8": (FP8_V41_BYTES, quantize_fp8_v41, dequantize_fp8_v41),
           "nvfp4": (NVFP4_V41_BYTES, quantize_nvfp4_v41, dequantize_nvfp4_v41)}


@dataclass
class _PagedRecords:
    """One paged cache of one layer: float64 rows ``[pages, page, width]`` (``codec`` None)
    or records ``uint8 [pages, page, bytes]`` of ``codec`` ("mxfp8" / "nvfp4")."""

    codec: str | None
    page: int
    table: torch.Tensor  # int32 [B, pages_each]
    storage: torch.Tensor

    @classmethod
    def empty(cls, codec: str | None, width: int, page: int, batch: int, capacity: int,
              seed: int) -> _PagedRecords:
        pages_each = max(1, -(-capacity // page))
        table = scrambled_page_table(batch, pages_each, seed)
        n = batch * pages_each
        if codec is None:
            storage = torch.zeros(n, page, width, dtype=F64)
        else:
            storage = torch.zeros(n, page, _CODECS[codec][0], dtype=torch.uint8)
        return cls(codec, page, table, storage)

    def slots(self, b: int, ids: torch.Tensor) -> torch.Tensor:
        """Global slots (int32) of request ``b``'s local ids; ``-1`` stays ``-1``."""
        return paged_slots(ids, self.table[b], self.page)

    def write(self, b: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        if ids.numel() == 0:
            return
        flat = self.storage.view(-1, self.storage.shape[-1])
        slots = self.slots(b, ids).long()
        flat[slots] = rows.to(F64) if self.codec is None else _CODECS[self.codec][1](rows)

    def rows(self, stored: torch.Tensor) -> torch.Tensor:
        return stored.to(F64) if self.codec is None else _CODECS[self.codec][2](stored,
                                                                                dtype=F64)

    def read(self, b: int, ids: torch.Tensor) -> torch.Tensor:
        """float64 rows of request ``b``'s local ``ids`` (all valid), as the cache holds them."""
        flat = self.storage.view(-1, self.storage.shape[-1])
        return self.rows(flat[self.slots(b, ids).long()])

    def kernel_view(self) -> torch.Tensor:
        """The cache as float64 rows ``[pages, page, width]``: ``sparse_mla_decode``'s
        ``kv_cache`` / ``extra_k_cache``."""
        return self.rows(self.storage)


@dataclass
class V41ServingCache:
    """The caches of V4.1 layers ``0 .. n-1`` for a batch of requests (the module doc):
    ``window[l]`` per layer, ``compressed[S]`` and ``index_keys[S]`` per kv source ``S``,
    ``history[S][b]`` the kv source's hidden states of request ``b`` so far, ``seq_lens[b]``
    the request's tokens so far; ``step_topk[I][b]`` index source ``I``'s top-k rows (int32
    ``[n_b, index_topk]``) of request ``b``'s tokens of the last step."""

    weights: list[V41LayerWeights]
    kv_cache_dtype: str
    capacity: int
    window: list[_PagedRecords]
    compressed: dict[int, _PagedRecords]
    index_keys: dict[int, _PagedRecords]
    history: dict[int, list[torch.Tensor]]
    seq_lens: list[int] = field(default_factory=list)
    step_topk: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def empty(cls, weights: Sequence[V41LayerWeights], batch: int, capacity: int, *,
              kv_cache_dtype: str = "float64", seed: int = 0,
              window_page: int = V41_WINDOW_PAGE,
              compressed_page_tokens: int = V41_COMPRESSED_PAGE_TOKENS) -> V41ServingCache:
        """Caches for layers ``weights`` (layers ``0 .. n-1`` of one config) and ``batch``
        requests of up to ``capacity`` tokens each."""
        ws = _check_stack(weights)
        check_v41_kv_cache_dtype(kv_cache_dtype)
        check_positive_int("batch", batch)
        check_positive_int("capacity", capacity)
        check_positive_int("window_page", window_page)
        check_positive_int("compressed_page_tokens", compressed_page_tokens)
        c = ws[0].config
        window_codec = None if kv_cache_dtype == "float64" else "mxfp8"
        comp_codec = None if kv_cache_dtype == "float64" else kv_cache_dtype
        window, compressed, index_keys, history = [], {}, {}, {}
        for w in ws:
            l, r = w.layer, w.ratio
            window.append(_PagedRecords.empty(window_codec, D, window_page, batch, capacity,
                                              seed + 3 * l))
            if r == 0 or not c.owns_compressor(l):
                continue
            if compressed_page_tokens % r:
                raise ValueError(f"compressed_page_tokens must be a multiple of every ratio, "
                                 f"got {compressed_page_tokens} for layer {l} of ratio {r}")
            page, n = compressed_page_tokens // r, max(1, capacity // r)
            compressed[l] = _PagedRecords.empty(comp_codec, D, page, batch, n, seed + 3 * l + 1)
            if c.owns_indexer(l):
                index_keys[l] = _PagedRecords.empty(None, c.index_head_dim, page, batch, n,
                                                    seed + 3 * l + 2)
            history[l] = [torch.zeros(0, c.hidden_size, dtype=F64) for _ in range(batch)]
        return cls(ws, kv_cache_dtype, capacity, window, compressed, index_keys, history,
                   [0] * batch)


def _check_stack(weights: object) -> list[V41LayerWeights]:
    if not isinstance(weights, (list, tuple)) or not weights:
        raise TypeError(f"weights must be a non-empty list of V41LayerWeights, got "
                        f"{type(weights).__name__}")
    for i, w in enumerate(weights):
        if not isinstance(w, V41LayerWeights):
            raise TypeError(f"weights[{i}] must be a V41LayerWeights, got {type(w).__name__}")
        if w.layer != i or w.config != weights[0].config:
            raise ValueError(f"weights[{i}] must be layer {i} of weights[0]'s config, got "
                             f"layer {w.layer}")
    return list(weights)


@dataclass
class _LayerStep:
    """One layer's new tokens in a step, per request."""

    q: list[torch.Tensor]           # [n_b, H, d]
    positions: list[torch.Tensor]   # [n_b]
    topk: list[torch.Tensor] | None  # int32 [n_b, index_topk] (compressed layers)


def _decode_attention(step: _LayerStep, cache: V41ServingCache, layer: int) -> torch.Tensor:
    w = cache.weights[layer]
    c, r = w.config, w.ratio
    W = c.sliding_window
    window = cache.window[layer]
    idx, lens, extra = [], [], []
    for b, p in enumerate(step.positions):
        local, length = window_local_ids(p, W)
        idx.append(window.slots(b, local))
        lens.append(length)
        if r > 0:
            assert step.topk is not None
            comp = cache.compressed[c.kv_source_layer(layer)]  # type: ignore[index]
            extra.append(comp.slots(b, step.topk[b]))
    q = torch.cat(step.q)[:, None]  # each token its own row
    kwargs = {}
    if r > 0:
        ex = torch.cat(extra)
        kwargs = dict(extra_k_cache=comp.kernel_view(), extra_indices_in_kvcache=ex[:, None],
                      extra_topk_length=(ex >= 0).sum(1).to(torch.int32))
    out, _ = sparse_mla_decode(q, window.kernel_view(), torch.cat(idx)[:, None],
                               c.softmax_scale, False, torch.cat(lens), head_dim_v=D,
                               attn_sink=w["attn_sink"].float(), **kwargs)
    return out[:, 0]


def _prefill_attention(step: _LayerStep, cache: V41ServingCache, layer: int
                       ) -> torch.Tensor:
    w = cache.weights[layer]
    c, r = w.config, w.ratio
    W, K = c.sliding_window, c.index_topk
    B = len(step.q)
    lens = cache.seq_lens
    n_new = [p.shape[0] for p in step.positions]
    n_comp = [L // r if r > 0 else 0 for L in lens]
    gather = [n + min(L - n, W - 1) for L, n in zip(lens, n_new)]
    N = max(n_comp)
    M = N + max(gather)
    workspace = torch.zeros(B * M, D, dtype=F64)
    comp = cache.compressed[c.kv_source_layer(layer)] if r > 0 else None  # type: ignore[index]
    width = -(-((K if r > 0 else 0) + W) // V41_PREFILL_PAD) * V41_PREFILL_PAD
    rows, lengths = [], []
    for b, p in enumerate(step.positions):
        if n_comp[b]:
            assert comp is not None
            workspace[M * b:M * b + n_comp[b]] = comp.read(b, torch.arange(n_comp[b]))
        g = lens[b] - gather[b]
        workspace[M * b + N:M * b + N + gather[b]] = cache.window[layer].read(
            b, torch.arange(g, lens[b]))
        for i, pos in enumerate(p.tolist()):
            row = torch.full((width,), -1, dtype=torch.int32)
            t = min((pos + 1) // r, K) if r > 0 else 0
            if t:
                assert step.topk is not None
                ids = step.topk[b][i, :t].long()
                row[:t] = torch.where((ids >= 0) & (ids < N), M * b + ids, -1)
            start = max(pos - W + 1, 0)
            row[t:t + pos - start + 1] = M * b + N + torch.arange(start - g, pos - g + 1)
            rows.append(row)
            lengths.append(t + pos - start + 1)
    indices = torch.stack(rows)
    out, _, _ = sparse_mla_prefill(torch.cat(step.q), workspace, indices, c.softmax_scale,
                                   d_v=D, topk_length=torch.tensor(lengths, dtype=torch.int32),
                                   attn_sink=w["attn_sink"].float())
    return out


def _check_inputs(xs: object, cache: V41ServingCache, path: str) -> list[list[torch.Tensor]]:
    if path not in ("decode", "prefill"):
        raise ValueError(f"path must be 'decode' or 'prefill', got {path!r}")
    n, B = len(cache.weights), len(cache.seq_lens)
    if not isinstance(xs, (list, tuple)) or len(xs) != n:
        raise ValueError(f"xs must be a list of {n} lists (one per layer), got "
                         f"{type(xs).__name__}" + (f" of length {len(xs)}"
                                                   if isinstance(xs, (list, tuple)) else ""))
    hidden = cache.weights[0].config.hidden_size
    counts = None
    for i, xi in enumerate(xs):
        if not isinstance(xi, (list, tuple)) or len(xi) != B:
            raise ValueError(f"xs[{i}] must be a list of {B} tensors (one per request)")
        for b, x in enumerate(xi):
            check_float(f"xs[{i}][{b}]", x, shape=[None, hidden])
        mine = [x.shape[0] for x in xi]
        if counts is None:
            counts = mine
        elif mine != counts:
            raise ValueError(f"xs[{i}] must hold as many new tokens per request as xs[0] "
                             f"({counts}), got {mine}")
    assert counts is not None
    for b, k in enumerate(counts):
        if cache.seq_lens[b] + k > cache.capacity:
            raise ValueError(f"xs: request {b} would hold {cache.seq_lens[b] + k} tokens, "
                             f"past the cache's capacity {cache.capacity}")
    return [[x.to(F64) for x in xi] for xi in xs]  # type: ignore[union-attr]


def v41_serving_step(xs: Sequence[Sequence[torch.Tensor]], cache: V41ServingCache, *,
                     path: str = "decode") -> list[list[torch.Tensor]]:
    """One step of layers ``0 .. n-1`` for a batch: ``xs[l][b] [n_b, hidden]`` (float64) are
    layer ``l``'s hidden states of request ``b``'s new tokens, at positions ``L_b .. L_b + n_b
    - 1`` (``L_b = cache.seq_lens[b]``; ``n_b`` the same at every layer, 0 allowed).

    Writes each layer's new keys, each kv source's completed entries and index keys into
    ``cache``, runs the index sources' top-k, and attends through ``sparse_mla_decode``
    (``path="decode"``, each token its own row) or ``sparse_mla_prefill`` over a gathered
    workspace (``path="prefill"``). Returns ``out[l][b] [n_b, hidden]``."""
    if not isinstance(cache, V41ServingCache):
        raise TypeError(f"cache must be a V41ServingCache, got {type(cache).__name__}")
    xs = _check_inputs(xs, cache, path)
    B = len(cache.seq_lens)
    start = list(cache.seq_lens)
    cache.seq_lens = [L + x.shape[0] for L, x in zip(start, xs[0])]
    max_len = max(cache.seq_lens)
    if sum(x.shape[0] for x in xs[0]) == 0:
        return [[x.new_zeros(0, w.config.hidden_size) for x in xl]
                for w, xl in zip(cache.weights, xs)]
    published: dict[int, list[V41IndexSource]] = {}
    candidates: list[torch.Tensor | None] = [None] * B
    outs = []
    for w, xl in zip(cache.weights, xs):
        c, r, l = w.config, w.ratio, w.layer
        rope = v41_rope_ratio(r)
        qs, positions, q_latents = [], [], []
        for b, x in enumerate(xl):
            p = torch.arange(start[b], cache.seq_lens[b])
            q_latent, _, q, k = v4_query_and_key(x, p, w, "float64",  # type: ignore[arg-type]
                                                 rope_ratio=rope)
            cache.window[l].write(b, p, k)
            qs.append(q)
            positions.append(p)
            q_latents.append(q_latent)
        if r > 0 and c.owns_compressor(l):
            for b, x in enumerate(xl):
                hist = torch.cat([cache.history[l][b], x])
                cache.history[l][b] = hist
                src = v41_kv_source(hist, w)  # exact entries: the cache's bytes round them
                new = torch.arange(start[b] // r, hist.shape[0] // r)
                cache.compressed[l].write(b, new, src.entries[new])
                if src.index_keys is not None:
                    cache.index_keys[l].write(b, new, src.index_keys[new])
        topk = None
        if r > 0 and c.owns_indexer(l):
            keys = cache.index_keys[c.kv_source_layer(l)]  # type: ignore[index]
            role = c.candidate_role(l)
            mine = []
            for b, x in enumerate(xl):
                stored = keys.read(b, torch.arange(cache.seq_lens[b] // r))
                src = v41_indexer_topk(x, q_latents[b], stored, w,
                                       candidates[b] if role == "mask" else None,
                                       positions=positions[b],
                                       short_context=max_len // r <= c.index_topk)
                mine.append(src)
                if role == "write":
                    candidates[b] = src.candidates
            published[l] = mine
        if r > 0:
            topk = [s.topk for s in published[c.index_source_layer(l)]]  # type: ignore[index]
        step = _LayerStep(qs, positions, topk)
        attend = _decode_attention if path == "decode" else _prefill_attention
        attn = attend(step, cache, l).split([p.shape[0] for p in positions])
        outs.append([v4_output_projection(a, p, w, "float64",  # type: ignore[arg-type]
                                          rope_ratio=rope)[2]
                     for a, p in zip(attn, positions)])
    cache.step_topk = {i: [s.topk for s in srcs] for i, srcs in published.items()}
    return outs
