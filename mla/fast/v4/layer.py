"""One DeepSeek-V4 attention layer's step on the fast path: decode and prefill over paged caches.

``mla.reference.v4.serving.v4_layer_step`` with the Triton kernels, stage by stage the equations
of ``mla.reference.v4.layer``:

    (1)-(2)  c_Q, c_KV, q: torch matmuls and RMSNorms, each rounded to bf16
    (3)-(4)  ``v4_q_rope_kv_insert``: the query's head norm and rope; the window keys into
             their MODEL1 pages (64 tokens a page)
    (5)      ``v4_compress_store``: the entries the new tokens close, into the compressed
             MODEL1 pages (``256 / r`` entries a page) and, ratio 4, the indexer's key cache;
             fed by a state of each request's last ``coff·r`` projections (float32 ``kv`` and
             ``score`` with ``ape``; vLLM's state cache), so a step costs its new tokens only
    (6)      ratio 4: ``v4_indexer_q_prep`` then ``v4_indexer_topk_paged``; ratio 128: every
             visible entry; ratio 1: none
    (7)      decode: ``mla.fast.sparse_mla_decode``, each token its own row, the window as
             the first scope and the compressed entries as the second, with the sinks;
             prefill: ``mla.fast.sparse_mla_prefill`` over a workspace of each request's
             compressed entries and window tokens read back from the caches (the reference's
             layout, ``serving._prefill_attention``)
    (8)-(9)  inverse rope, grouped ``wo_a`` and ``wo_b`` in torch, each rounded to bf16

The caches (``V4FastCache``) are laid out as the reference's ``V4Cache`` with
``kv_cache_dtype="fp8_ds_mla"``, page tables drawn alike from the same seed, so that their bytes
compare one for one. ``dtype`` is the activations' (bf16 on a GPU; float32 under Triton's
interpreter, whose bf16 dots are wrong): every value the reference rounds to bf16 is rounded to
bf16 here too, whatever ``dtype``. ``trace=True`` returns the stages (``V4FastTrace``) beside
the output, to compare with ``v4_layer_definition``'s ``V4LayerTrace``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla.fast.sparse import sparse_mla_decode, sparse_mla_prefill
from mla.fast.v4.common import rope_torch, v4_cos_sin_cache
from mla.fast.v4.compressor import v4_compress_store
from mla.fast.v4.front import v4_q_rope_kv_insert
from mla.fast.v4.indexer import v4_indexer_q_prep, v4_indexer_topk_paged
from mla.reference.fp8_model1 import fp8_model1_cache, fp8_model1_page_bytes, fp8_model1_rows
from mla.reference.indexer_cache import INDEX_K_BYTES
from mla.reference.v4.serving import (
    COMPRESSED_PAGE_TOKENS,
    PREFILL_PAD,
    WINDOW_PAGE,
    scrambled_page_table,
)
from mla.reference.v4.weights import V4LayerWeights
from mla.validation import check_float, check_positive_int

__all__ = ["V4FastCache", "V4FastTrace", "v4_layer_step"]

D = 512
INDEX_PAGE = COMPRESSED_PAGE_TOKENS // 4  # the indexer's key cache: the ratio-4 pages


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16).to(t.dtype)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


@dataclass
class CompressorState:
    """One compressor's weights (``[wkv; wgate]`` float32 for the fp32 GEMM) and state: the
    last ``coff·r`` positions' ``kv`` and ``score`` (with ``ape``) per request, float32."""

    w: torch.Tensor       # [2·coff·d, hidden] float32
    ape: torch.Tensor     # [r, coff·d] float32
    norm: torch.Tensor    # [d] float32
    kv: torch.Tensor      # [B, coff·r, coff·d]
    score: torch.Tensor   # [B, coff·r, coff·d]

    @classmethod
    def of(cls, t: dict[str, torch.Tensor], batch: int, device: torch.device) -> CompressorState:
        ape = t["ape"].to(device=device, dtype=torch.float32)
        r, width = ape.shape
        W = (2 if r == 4 else 1) * r
        nan = torch.full((batch, W, width), float("nan"), device=device)
        w = torch.cat([t["wkv.weight"], t["wgate.weight"]]).to(device=device,
                                                               dtype=torch.float32)
        return cls(w, ape, t["norm.weight"].to(device=device, dtype=torch.float32), nan,
                   nan.clone())


@dataclass
class V4FastCache:
    """One layer's caches for a batch (``V4Cache``'s layout, ``fp8_ds_mla``) and its weights in
    the activations' ``dtype`` on ``device``. ``lengths[b]``: request ``b``'s tokens so far."""

    weights: V4LayerWeights
    dtype: torch.dtype
    window_pages: torch.Tensor            # uint8 [pages, fp8_model1_page_bytes(64)]
    window_table: torch.Tensor            # int32 [B, pages_each]
    compressed_pages: torch.Tensor | None  # uint8 [pages, fp8_model1_page_bytes(256 / r)]
    compressed_table: torch.Tensor | None
    index_cache: torch.Tensor | None      # uint8 [pages, 64, 132] (ratio 4, compressed_table)
    compressor: CompressorState | None
    index_compressor: CompressorState | None
    cos_sin: torch.Tensor                 # float32 [capacity, 64]
    capacity: int
    lengths: list[int]

    @classmethod
    def empty(cls, weights: V4LayerWeights, batch: int, capacity: int, *,
              dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda",
              seed: int = 0) -> V4FastCache:
        """Caches for ``batch`` requests of up to ``capacity`` tokens (pages as
        ``V4Cache.empty(weights, batch, capacity, seed=seed)`` draws them)."""
        if not isinstance(weights, V4LayerWeights):
            raise TypeError(f"weights must be a V4LayerWeights, got {type(weights).__name__}")
        check_positive_int("batch", batch)
        check_positive_int("capacity", capacity)
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
        device = torch.device(device)
        c, r = weights.config, weights.ratio
        keep32 = ("attn_sink",)
        w = V4LayerWeights(c, r, {n: t.to(device=device, dtype=torch.float32 if n in keep32
                                          or n.startswith(("compressor.", "indexer.compressor."))
                                          else dtype)
                                  for n, t in weights.tensors.items()})
        pages_each = max(1, -(-capacity // WINDOW_PAGE))
        window_table = scrambled_page_table(batch, pages_each, seed).to(device)
        window_pages = torch.zeros(batch * pages_each, fp8_model1_page_bytes(WINDOW_PAGE),
                                   dtype=torch.uint8, device=device)
        comp_pages = comp_table = index_cache = comp = icomp = None
        if r > 1:
            bs = COMPRESSED_PAGE_TOKENS // r
            each = max(1, -(-max(1, capacity // r) // bs))
            comp_table = scrambled_page_table(batch, each, seed + 1).to(device)
            comp_pages = torch.zeros(batch * each, fp8_model1_page_bytes(bs), dtype=torch.uint8,
                                     device=device)
            comp = CompressorState.of(w.sub("compressor."), batch, device)
        if r == 4:
            index_cache = torch.zeros(comp_pages.shape[0], INDEX_PAGE, INDEX_K_BYTES,
                                      dtype=torch.uint8, device=device)
            icomp = CompressorState.of(w.sub("indexer.compressor."), batch, device)
        cos_sin = v4_cos_sin_cache(c, r, capacity, device)
        return cls(w, dtype, window_pages, window_table, comp_pages, comp_table, index_cache,
                   comp, icomp, cos_sin, capacity, [0] * batch)

    @property
    def window_view(self) -> torch.Tensor:
        return fp8_model1_cache(self.window_pages, WINDOW_PAGE)

    @property
    def compressed_block(self) -> int:
        return COMPRESSED_PAGE_TOKENS // self.weights.ratio

    @property
    def compressed_view(self) -> torch.Tensor:
        assert self.compressed_pages is not None
        return fp8_model1_cache(self.compressed_pages, self.compressed_block)


@dataclass
class V4FastTrace:
    """The stages of one step, the batch's new tokens concatenated (request order)."""

    positions: torch.Tensor        # int64 [T]
    q_latent: torch.Tensor         # c_Q [T, q_lora_rank] (bf16 values)
    kv: torch.Tensor               # c_KV [T, 512] normed, before rope
    q: torch.Tensor                # [T, H, 512] after the head norm and rope
    topk: torch.Tensor | None      # int32 [T, index_topk] local entry ids (ratio 4)
    attn: torch.Tensor             # [T, H, 512] the attention's output
    lse: torch.Tensor              # [T, H] float32
    o: torch.Tensor                # [T, H, 512] after the inverse rope
    z: torch.Tensor                # [T, G, o_lora_rank]
    out: torch.Tensor              # [T, hidden]


def _compress(comp: CompressorState, X: torch.Tensor, pos: torch.Tensor, req: torch.Tensor,
              lens0: list[int], n_new: list[int], cache: torch.Tensor, table: torch.Tensor,
              cos_sin: torch.Tensor, eps: float, scale_floor: str) -> None:
    """Project the new tokens, prepend each request's state, store the closed entries, keep
    the last ``coff·r`` rows as the new state."""
    B, W, width = comp.kv.shape
    r = comp.ape.shape[0]
    proj = X.float() @ comp.w.T  # [T, 2·width] float32 (vLLM's fp32 GEMM)
    kv_new, sc_new = proj[:, :width], proj[:, width:] + comp.ape[pos % r]
    n_max = max(n_new)
    dev = X.device
    L0 = torch.tensor(lens0, device=dev)
    n = torch.tensor(n_new, device=dev)
    col = W + pos - L0[req]  # the token's row after the state's W rows
    both = []
    for state, new in ((comp.kv, kv_new), (comp.score, sc_new)):
        comb = torch.empty(B, W + n_max, width, device=dev)
        comb[:, :W] = state
        comb[req, col] = new
        both.append(comb)
    kv, score = both
    v4_compress_store(
        kv.view(-1, width), score.view(-1, width),
        torch.arange(B, device=dev, dtype=torch.int32) * (W + n_max),
        (L0 + n).to(torch.int32), n.to(torch.int32), n_max, comp.norm, cos_sin,
        cache, table, ratio=r, rms_norm_eps=eps, history_start=(L0 - W).to(torch.int32),
        scale_floor=scale_floor, validate=False)
    keep = n[:, None] + torch.arange(W, device=dev)[None, :]  # rows of positions L-W .. L-1
    comp.kv.copy_(kv.gather(1, keep[:, :, None].expand(B, W, width)))
    comp.score.copy_(score.gather(1, keep[:, :, None].expand(B, W, width)))


def global_slots(table: torch.Tensor, req: torch.Tensor, ids: torch.Tensor, bs: int
                 ) -> torch.Tensor:
    """Global slots of local ids ``ids [T, k]`` of each row's request (``-1`` stays)."""
    safe = ids.clamp(min=0).long()
    slot = table[req[:, None], safe // bs].long() * bs + safe % bs
    return torch.where(ids < 0, -1, slot).to(torch.int32)


def window_ids(pos: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    start = (pos - window + 1).clamp(min=0)
    local = start[:, None] + torch.arange(window, device=pos.device)[None, :]
    return torch.where(local <= pos[:, None], local, -1), (pos - start + 1).to(torch.int32)


def _valid_first(ids: torch.Tensor) -> torch.Tensor:
    """Each row's valid ids (``>= 0``) first, in their order, then its ``-1``s: the second
    scope's ``extra_topk_length`` counts the valid ids, so a valid id after a ``-1`` would
    never be read (a top-k handed in, ``v4_layer_step(topk=...)``; the indexer's own rows are
    already so)."""
    order = torch.sort((ids < 0).to(torch.int8), dim=1, stable=True).indices
    return torch.gather(ids, 1, order)


def _compressed_ids(pos: torch.Tensor, ratio: int, topk: torch.Tensor | None,
                    lens: list[int]) -> torch.Tensor:
    if ratio == 4:
        assert topk is not None
        return _valid_first(topk)
    width = max(1, max(lens) // ratio)
    ids = torch.arange(width, device=pos.device)[None, :].expand(pos.shape[0], width)
    return torch.where(ids < ((pos + 1) // ratio)[:, None], ids, -1)


def project(X: torch.Tensor, w: V4LayerWeights
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(1)-(2): ``q_latent`` (bf16 values), the normed ``kv`` and the heads' ``q [T, H, 512]``
    before their norm and rope."""
    c, eps = w.config, w.config.rms_norm_eps
    q_latent = _bf16(_rms_norm(X @ w["wq_a.weight"].T, w["q_norm.weight"], eps))
    kv = _bf16(_rms_norm(X @ w["wkv.weight"].T, w["kv_norm.weight"], eps))
    qb = _bf16(q_latent @ w["wq_b.weight"].T).view(X.shape[0], c.num_heads, D)
    return q_latent, kv, qb


def indexer_query(q_latent: torch.Tensor, X: torch.Tensor, pos: torch.Tensor,
                  cache: V4FastCache) -> tuple[torch.Tensor, torch.Tensor]:
    """(6), the C4A indexer's query: its e4m3 codes and folded weights."""
    w, c = cache.weights, cache.weights.config
    qi = _bf16(q_latent @ w["indexer.wq_b.weight"].T).view(X.shape[0], c.index_n_heads,
                                                           c.index_head_dim)
    wi = _bf16(X @ w["indexer.weights_proj.weight"].T)
    return v4_indexer_q_prep(qi, wi, pos, cache.cos_sin)


def output_projection(attn: torch.Tensor, pos: torch.Tensor, cache: V4FastCache
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(8)-(9): the inverse rope ``o``, the grouped ``z = wo_a(o)`` and ``out = wo_b(z)``."""
    w, c = cache.weights, cache.weights.config
    T = attn.shape[0]
    o = _bf16(rope_torch(_bf16(attn), pos, cache.cos_sin, inverse=True))
    y = o.reshape(T, c.o_groups, c.heads_per_group * D)
    w_a = w["wo_a.weight"].view(c.o_groups, c.o_lora_rank, -1)
    z = _bf16(torch.bmm(y.transpose(0, 1), w_a.transpose(1, 2)).transpose(0, 1))
    return o, z, _bf16(z.flatten(1) @ w["wo_b.weight"].T)


def v4_layer_step(x: list[torch.Tensor], cache: V4FastCache, *, path: str = "decode",
                  topk: list[torch.Tensor | None] | None = None, trace: bool = False,
                  scale_floor: str = "flashmla"
                  ) -> list[torch.Tensor] | tuple[list[torch.Tensor], V4FastTrace]:
    """One step for a batch: request ``b``'s new tokens ``x[b] [n_b, hidden]`` at positions
    ``L_b .. L_b + n_b - 1`` (``L_b = cache.lengths[b]``), as the reference's
    ``v4_layer_step``: writes the keys and the entries they close, attends through
    ``sparse_mla_decode`` (``path="decode"``) or ``sparse_mla_prefill`` (``"prefill"``),
    returns each request's output ``[n_b, hidden]`` in ``cache.dtype`` (and the
    ``V4FastTrace`` with ``trace``). ``topk[b]`` (ratio 4): the new tokens' entry ids instead
    of the indexer's. ``scale_floor``: the compressed entries' (``"flashmla"``, the
    reference's default)."""
    if not isinstance(cache, V4FastCache):
        raise TypeError(f"cache must be a V4FastCache, got {type(cache).__name__}")
    w, c, r = cache.weights, cache.weights.config, cache.weights.ratio
    if path not in ("decode", "prefill"):
        raise ValueError(f"path must be 'decode' or 'prefill', got {path!r}")
    B = len(cache.lengths)
    if not isinstance(x, (list, tuple)) or len(x) != B:
        raise ValueError(f"x must be a list of {B} tensors (one per request), got "
                         f"{type(x).__name__}")
    dev = cache.window_pages.device
    for b, xb in enumerate(x):
        check_float(f"x[{b}]", xb, shape=[None, c.hidden_size], device=dev)
        if xb.shape[0] == 0:
            raise ValueError(f"x[{b}] must hold at least one token, got shape {list(xb.shape)}")
        if cache.lengths[b] + xb.shape[0] > cache.capacity:
            raise ValueError(f"x[{b}]: request {b} would hold {cache.lengths[b] + xb.shape[0]} "
                             f"tokens, past the cache's capacity {cache.capacity}")
    if topk is not None and (r != 4 or len(topk) != B):
        raise ValueError(f"topk is a list of {B} id tensors, for ratio-4 layers only")
    lens0 = list(cache.lengths)
    n_new = [xb.shape[0] for xb in x]
    lens = [a + n for a, n in zip(lens0, n_new)]
    dt, eps = cache.dtype, c.rms_norm_eps
    X = torch.cat([xb.to(dt) for xb in x])
    pos = torch.cat([torch.arange(a, a + n, device=dev) for a, n in zip(lens0, n_new)])
    req = torch.repeat_interleave(torch.arange(B, device=dev),
                                  torch.tensor(n_new, device=dev))
    # (1)-(2)
    q_latent, kv, qb = project(X, w)
    # (3)-(4)
    win_slots = global_slots(cache.window_table, req, pos[:, None], WINDOW_PAGE)[:, 0]
    q = v4_q_rope_kv_insert(qb, kv, pos, cache.cos_sin, cache.window_view, win_slots,
                            rms_norm_eps=eps, head_norm=c.q_head_norm, out_dtype=dt,
                            validate=False)
    # (5)
    if r > 1:
        assert cache.compressor is not None and cache.compressed_table is not None
        _compress(cache.compressor, X, pos, req, lens0, n_new, cache.compressed_view,
                  cache.compressed_table, cache.cos_sin, eps, scale_floor)
    if r == 4:
        assert cache.index_compressor is not None and cache.index_cache is not None
        _compress(cache.index_compressor, X, pos, req, lens0, n_new, cache.index_cache,
                  cache.compressed_table, cache.cos_sin, eps, "vllm")
    # (6)
    tk = None
    if r == 4:
        if topk is not None:
            tk = torch.cat([t.to(device=dev, dtype=torch.int32) for t in topk])
        else:
            codes, wq = indexer_query(q_latent, X, pos, cache)
            visible = ((pos + 1) // 4).to(torch.int32)
            assert cache.compressed_table is not None and cache.index_cache is not None
            tk = v4_indexer_topk_paged(
                codes, wq, cache.index_cache, cache.compressed_table[req].contiguous(), visible,
                max(1, cache.capacity // 4), c.index_topk,
                fill=max(lens) // 4 <= c.index_topk, validate=False)
    # (7)
    sink = w["attn_sink"].float()
    if path == "decode":
        win_ids, win_len = window_ids(pos, c.sliding_window)
        win_idx = global_slots(cache.window_table, req, win_ids, WINDOW_PAGE)
        extra = {}
        if r > 1:
            assert cache.compressed_table is not None
            ids = _compressed_ids(pos, r, tk, lens)
            extra = dict(extra_k_cache=cache.compressed_view,
                         extra_indices_in_kvcache=global_slots(cache.compressed_table, req, ids,
                                                         cache.compressed_block)[:, None],
                         extra_topk_length=(ids >= 0).sum(1).to(torch.int32))
        attn, lse = sparse_mla_decode(q[:, None], cache.window_view, win_idx[:, None],
                                      c.softmax_scale, True, win_len, D, attn_sink=sink,
                                      validate=False, **extra)
        attn, lse = attn[:, 0], lse[:, :, 0]
    else:
        attn, lse = _prefill(cache, q, pos, req, tk, lens0, n_new, lens, sink)
    # (8)-(9)
    o, z, out = output_projection(attn, pos, cache)
    cache.lengths[:] = lens
    outs = list(out.split(n_new))
    if not trace:
        return outs
    return outs, V4FastTrace(pos, q_latent, kv, q, tk, attn, lse, o, z, out)


def _prefill(cache: V4FastCache, q: torch.Tensor, pos: torch.Tensor, req: torch.Tensor,
             tk: torch.Tensor | None, lens0: list[int], n_new: list[int], lens: list[int],
             sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's workspace (``serving._prefill_attention``): request ``b``'s compressed
    entries at rows ``[M·b, M·b + N_b)``, its last window tokens from row ``M·b + N`` on, read
    back from the caches in the activations' dtype; then ``sparse_mla_prefill``."""
    c, r = cache.weights.config, cache.weights.ratio
    W, dev, B = c.sliding_window, q.device, len(lens)
    n_comp = [L // r if r > 1 else 0 for L in lens]
    gather = [n + min(L - n, W - 1) for L, n in zip(lens, n_new)]
    N = max(n_comp)
    M = N + max(gather)
    ws = torch.zeros(B * M, D, dtype=q.dtype, device=dev)
    rows = []
    tks = list(tk.split(n_new)) if tk is not None else [None] * B
    offs = [0]
    for n in n_new:
        offs.append(offs[-1] + n)
    for b in range(B):
        if n_comp[b]:
            assert cache.compressed_pages is not None and cache.compressed_table is not None
            ids = torch.arange(n_comp[b], device=dev)
            bs = cache.compressed_block
            slots = cache.compressed_table[b].long()[ids // bs] * bs + ids % bs
            ws[M * b:M * b + n_comp[b]] = fp8_model1_rows(cache.compressed_pages, bs,
                                                          slots).to(q.dtype)
        g = lens[b] - gather[b]
        ids = torch.arange(g, lens[b], device=dev)
        slots = cache.window_table[b].long()[ids // WINDOW_PAGE] * WINDOW_PAGE + ids % WINDOW_PAGE
        ws[M * b + N:M * b + N + gather[b]] = fp8_model1_rows(cache.window_pages, WINDOW_PAGE,
                                                              slots).to(q.dtype)
        p = pos[offs[b]:offs[b + 1]]
        comp = (_compressed_ids(p, r, tks[b], [lens[b]]).long() if r > 1
                else torch.full((p.shape[0], 0), -1, dtype=torch.long, device=dev))
        comp = torch.where(comp >= 0, M * b + comp, -1)
        local, _ = window_ids(p, W)
        swa = torch.where(local >= 0, M * b + N + (local - g), -1)
        rows.append(_valid_first(torch.cat([comp, swa], dim=1)))
    width = max(t.shape[1] for t in rows)
    width = -(-width // PREFILL_PAD) * PREFILL_PAD
    indices = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1)
                         for t in rows]).to(torch.int32)
    length = (indices >= 0).sum(1).to(torch.int32)
    attn, _, lse = sparse_mla_prefill(q, ws, indices, c.softmax_scale, d_v=D,
                                      topk_length=length, attn_sink=sink, validate=False)
    return attn, lse
