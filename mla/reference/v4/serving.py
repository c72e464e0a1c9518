"""DeepSeek-V4's attention layer as vLLM 0.33 serves it: paged caches, two KV scopes, and
FlashMLA's two sparse kernels (their references, ``mla.reference.sparse``).

Caches, per layer (``vllm/v1/attention/backends/mla/sparse_swa.py``, ``.../deepseek_v4/
sparse_mla.py``):

    window cache       every token's key ``k_s`` (equation (4) of ``layer.py``), pages of 64
                       tokens; slot(s) = window_table[b, s // 64] · 64 + s % 64
    compressed cache   entry ``e_j`` (equation (5)), pages of 256 tokens, i.e. 256 / r
                       entries; slot(j) = compressed_table[b, j // (256/r)] · (256/r) + j % (256/r)

each in the layer's ``kv_cache_dtype``: ``fp8_ds_mla`` MODEL1 pages (584 bytes a token,
``mla.reference.fp8_model1``), or rows of ``[pages, page_size, 512]`` (``bfloat16`` or
``float64``). Pages are handed out in a scrambled order, as a block allocator would.

Decode (``nvidia/flashmla.py``, ``_forward_decode``): every new token is its own row of
``flash_mla_with_kvcache`` (``q [T_d, 1, H, 512]``), so MTP's ``s_q > 1`` tokens of a request
each have their own window and top-k:

    scope 1   indices = slots of the window [max(p - W + 1, 0), p], -1 padded to W columns,
              topk_length = its length
    scope 2   extra_indices = slots of C(p) (the top-k ids, or every j < (p+1)//128), -1
              padded, extra_topk_length = their count (none for a window-only layer)

Prefill (``_forward_prefill``; ``common/ops/cache_utils.py``, ``combine_topk_swa_indices``):
request ``b``'s caches are read back into a workspace ``[B·M, 512]``: its ``N_b = L_b // r``
compressed entries at rows ``[M·b, M·b + N_b)``, then its raw tokens from ``g_b = L_b -
(n_b + min(L_b - n_b, W - 1))`` on at rows ``M·b + N + (s - g_b)``; each query's combined
indices are its compressed ids ``M·b + j`` then its window ``M·b + N + (s - g_b)``, -1 padded
to a multiple of 128, with ``topk_length`` their count; then ``flash_mla_sparse_fwd``.

Both paths give the same numbers as the definition (``layer.v4_layer_definition``): the same
keys (read back from the same bytes), the same masks, one softmax with the sink. Only the
order of the sums differs, so in float64 the two agree to about 1e-15 relative.

The compressor and the indexer are computed from the request's hidden states so far
(``V4Cache.history``): vLLM keeps the compressor's last ``coff · r`` tokens in a state
cache and the indexer's keys in a paged FP8 cache; the entries they give are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mla.reference.fp8_model1 import (
    fp8_model1_cache,
    fp8_model1_page_bytes,
    fp8_model1_rows,
    write_fp8_model1,
)
from mla.reference.sparse import sparse_mla_decode, sparse_mla_prefill
from mla.reference.v4.layer import (
    check_kv_cache_dtype,
    v4_output_projection,
    v4_query_and_key,
)
from mla.reference.v4.scopes import (
    COMPRESSED_PAGE_TOKENS,
    PREFILL_PAD,
    WINDOW_PAGE,
    compressed_local_ids,
    decode_scope_indices,
    paged_slots,
    prefill_combined_indices,
    window_local_ids,
)
from mla.reference.v4.weights import V4LayerWeights
from mla.validation import check_float, check_positive_int

__all__ = ["V4Cache", "v4_layer_step", "scrambled_page_table", "WINDOW_PAGE",
           "COMPRESSED_PAGE_TOKENS", "PREFILL_PAD", "window_indices", "compressed_ids"]

D = 512


def scrambled_page_table(batch: int, pages_each: int, seed: int) -> torch.Tensor:
    """int32 ``[batch, pages_each]``: every page of a pool of ``batch · pages_each`` given out
    once, in a seeded random order (as a block allocator hands them out)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(batch * pages_each, generator=gen).to(torch.int32)
    return perm.view(batch, pages_each)


@dataclass
class _PagedRows:
    """One paged cache: ``storage`` (MODEL1 pages, or rows ``[pages, page, 512]``)."""

    kv_cache_dtype: str
    page: int
    table: torch.Tensor  # int32 [B, pages_each]
    storage: torch.Tensor

    @classmethod
    def empty(cls, kv_cache_dtype: str, page: int, batch: int, capacity: int, seed: int
              ) -> _PagedRows:
        pages_each = max(1, -(-capacity // page))
        table = scrambled_page_table(batch, pages_each, seed)
        n = batch * pages_each
        if kv_cache_dtype == "fp8_ds_mla":
            storage = torch.zeros(n, fp8_model1_page_bytes(page), dtype=torch.uint8)
        else:
            dtype = torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.float64
            storage = torch.zeros(n, page, D, dtype=dtype)
        return cls(kv_cache_dtype, page, table, storage)

    def slots(self, b: int, ids: torch.Tensor) -> torch.Tensor:
        """Global slots of request ``b``'s local ids (``-1`` stays ``-1``), int32."""
        return paged_slots(ids, self.table[b], self.page)

    def write(self, b: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        slots = self.slots(b, ids).long()
        if self.kv_cache_dtype == "fp8_ds_mla":
            write_fp8_model1(self.storage, self.page, slots, rows.to(torch.bfloat16),
                             scale_floor="vllm")
        else:
            flat = self.storage.view(-1, D)
            flat[slots] = rows.to(flat.dtype)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """float64 rows at global ``slots`` (all valid)."""
        if self.kv_cache_dtype == "fp8_ds_mla":
            return fp8_model1_rows(self.storage, self.page, slots).double()
        return self.storage.view(-1, D)[slots.long()].double()

    def kernel_view(self) -> torch.Tensor:
        """The ``kv_cache`` argument of ``sparse_mla_decode``."""
        if self.kv_cache_dtype == "fp8_ds_mla":
            return fp8_model1_cache(self.storage, self.page)
        return self.storage.double()


@dataclass
class V4Cache:
    """One layer's caches for a batch of requests, and each request's hidden states so far."""

    weights: V4LayerWeights
    kv_cache_dtype: str
    window: _PagedRows
    compressed: _PagedRows | None
    history: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def empty(cls, weights: V4LayerWeights, batch: int, capacity: int, *,
              kv_cache_dtype: str = "fp8_ds_mla", seed: int = 0) -> V4Cache:
        """Caches for ``batch`` requests of up to ``capacity`` tokens each."""
        check_kv_cache_dtype(kv_cache_dtype)
        check_positive_int("batch", batch)
        check_positive_int("capacity", capacity)
        r = weights.ratio
        window = _PagedRows.empty(kv_cache_dtype, WINDOW_PAGE, batch, capacity, seed)
        compressed = None
        if r > 1:
            compressed = _PagedRows.empty(kv_cache_dtype, COMPRESSED_PAGE_TOKENS // r, batch,
                                          max(1, capacity // r), seed + 1)
        hidden = weights.config.hidden_size
        return cls(weights, kv_cache_dtype, window, compressed,
                   [torch.zeros(0, hidden, dtype=torch.float64) for _ in range(batch)])

    def seq_len(self, b: int) -> int:
        return self.history[b].shape[0]


def window_indices(cache: _PagedRows, b: int, positions: torch.Tensor, window: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scope 1 of request ``b``'s tokens at ``positions [n]``: slots ``[n, W]`` (-1 padded)
    and lengths ``[n]`` (``scopes.window_local_ids`` through the request's pages)."""
    local, length = window_local_ids(positions, window)
    return cache.slots(b, local), length


compressed_ids = compressed_local_ids  # scope 2's local entry ids (``mla.reference.v4.scopes``)


def _batch(positions: list[torch.Tensor], topk: list[torch.Tensor | None]
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The step's tokens flattened: positions, their requests and (ratio 4) their top-k."""
    token_to_req = torch.cat([torch.full((p.shape[0],), b, dtype=torch.int32)
                              for b, p in enumerate(positions)])
    tk = None if any(t is None for t in topk) else torch.cat(topk)  # type: ignore[arg-type]
    return torch.cat(positions), token_to_req, tk


def _decode_attention(q: list[torch.Tensor], positions: list[torch.Tensor],
                      topk: list[torch.Tensor | None], cache: V4Cache) -> list[torch.Tensor]:
    c, r = cache.weights.config, cache.weights.ratio
    pos, token_to_req, tk = _batch(positions, topk)
    comp = cache.compressed
    idx, lens, extra, extra_lens = decode_scope_indices(
        pos, token_to_req, cache.window.table, None if comp is None else comp.table, tk, r,
        c.sliding_window)
    kwargs = {}
    if comp is not None:
        kwargs = dict(extra_k_cache=comp.kernel_view(), extra_indices_in_kvcache=extra[:, None],
                      extra_topk_length=extra_lens)
    out, _ = sparse_mla_decode(
        torch.cat(q)[:, None], cache.window.kernel_view(), idx[:, None], c.softmax_scale,
        cache.kv_cache_dtype == "fp8_ds_mla", lens, head_dim_v=D,
        attn_sink=cache.weights["attn_sink"].float(), **kwargs)  # each token its own row
    return list(out[:, 0].split([p.shape[0] for p in positions]))


def _prefill_attention(q: list[torch.Tensor], positions: list[torch.Tensor],
                       topk: list[torch.Tensor | None], cache: V4Cache) -> list[torch.Tensor]:
    c, r = cache.weights.config, cache.weights.ratio
    W = c.sliding_window
    B = len(q)
    lens = [cache.seq_len(b) for b in range(B)]
    n_new = [p.shape[0] for p in positions]
    n_comp = [L // r if r > 1 else 0 for L in lens]
    gather = [n + min(L - n, W - 1) for L, n in zip(lens, n_new)]
    N = max(n_comp)
    M = N + max(gather)
    workspace = torch.zeros(B * M, D, dtype=torch.float64)
    for b in range(B):
        if n_comp[b]:
            assert cache.compressed is not None
            slots = cache.compressed.slots(b, torch.arange(n_comp[b]))
            workspace[M * b:M * b + n_comp[b]] = cache.compressed.read(slots)
        slots = cache.window.slots(b, torch.arange(lens[b] - gather[b], lens[b]))
        workspace[M * b + N:M * b + N + gather[b]] = cache.window.read(slots)
    pos, token_to_req, tk = _batch(positions, topk)
    indices, length = prefill_combined_indices(pos, token_to_req,
                                               torch.tensor(lens, dtype=torch.int32), tk, r, W)
    out, _, _ = sparse_mla_prefill(torch.cat(q), workspace, indices, c.softmax_scale, d_v=D,
                                   topk_length=length,
                                   attn_sink=cache.weights["attn_sink"].float())
    return list(out.split(n_new))


def v4_layer_step(x: list[torch.Tensor], cache: V4Cache, *, path: str = "decode",
                  topk: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """One step of the layer for a batch: request ``b``'s new tokens ``x[b] [n_b, hidden]``
    (float64) at positions ``L_b .. L_b + n_b - 1``, ``L_b`` its tokens so far.

    Writes the new tokens' keys and the compressed entries they complete into ``cache``, then
    attends through ``sparse_mla_decode`` (``path="decode"``, each token its own row) or
    ``sparse_mla_prefill`` over a gathered workspace (``path="prefill"``). ``topk[b]`` (ratio
    4): the new tokens' compressed ids, by default the reference indexer's. Returns the layer's
    output ``[n_b, hidden]`` per request."""
    w, c, r = cache.weights, cache.weights.config, cache.weights.ratio
    if r > 1:
        from mla.reference.v4.compressor import compressed_cache_entries
    if r == 4:
        from mla.reference.v4.indexer import indexer_topk_for_layer
    if path not in ("decode", "prefill"):
        raise ValueError(f"path must be 'decode' or 'prefill', got {path!r}")
    if not isinstance(x, (list, tuple)) or len(x) != len(cache.history):
        got = f"a {type(x).__name__}" + (f" of length {len(x)}" if isinstance(x, (list, tuple))
                                         else "")
        raise ValueError(f"x must be a list of {len(cache.history)} tensors (one per request), "
                         f"got {got}")
    for b, xb in enumerate(x):
        check_float(f"x[{b}]", xb, shape=[None, c.hidden_size])
    qs, positions, tks = [], [], []
    for b, xb in enumerate(x):
        L0 = cache.seq_len(b)
        p = torch.arange(L0, L0 + xb.shape[0])
        hist = torch.cat([cache.history[b], xb.double()])
        cache.history[b] = hist
        q_latent, _, q, k = v4_query_and_key(xb.double(), p, w, cache.kv_cache_dtype)
        cache.window.write(b, p, k)
        if r > 1:
            assert cache.compressed is not None
            entries = compressed_cache_entries(hist, w, cache.kv_cache_dtype)
            done = L0 // r
            cache.compressed.write(b, torch.arange(done, entries.shape[0]), entries[done:])
        tk = None
        if r == 4:
            if topk is not None and topk[b] is not None:
                tk = topk[b]
            else:  # the new tokens' rows only: the keys are the whole history's entries
                tk = indexer_topk_for_layer(hist, q_latent, w, cache.kv_cache_dtype, p)
        qs.append(q)
        positions.append(p)
        tks.append(tk)
    attend = _decode_attention if path == "decode" else _prefill_attention
    attn = attend(qs, positions, tks, cache)
    return [v4_output_projection(a, p, w, cache.kv_cache_dtype)[2]
            for a, p in zip(attn, positions)]
