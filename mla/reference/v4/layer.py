"""DeepSeek-V4's attention layer by its definition: dense tensors, explicit masks.

One request of ``T`` tokens at positions ``p = 0 .. T-1``, a layer of compression ratio ``r``
(``mla.reference.v4.config``), ``d = 512`` (``d_R = 64`` RoPE dims last), ``H`` heads in ``G``
groups. With ``round`` the rounding to what the serving path stores (below) and ``rope`` the
layer's RoPE (``mla.reference.v4.rope``):

    (1)  c_Q = round(RMSNorm(x W_qa^T; w_qn)),   c_KV = round(RMSNorm(x W_kv^T; w_kvn))
    (2)  q_h = round(c_Q W_qb^T)[h·d : h·d+d]
    (3)  q_h <- round(rope_p(q_h / rms(q_h)))        the per-head norm has no weight (V4; not
                                                      V4.1, ``q_head_norm = False``)
    (4)  k_s = cache(rope_s(c_KV[s]))                the window's keys, read back from the cache
    (5)  e_j = cache(compressor(x)_j),  j < T // r   the compressed entries (``compressor.py``)
    (6)  visible keys of query p:
           window      W(p) = { s : max(p - W + 1, 0) <= s <= p }
           compressed  C(p) = { j : j < (p + 1) // r }              r = 128
                              top-k of the indexer over C(p)       r = 4   (``indexer.py``)
                              {}                                    r = 1
    (7)  z_{h,k} = q_h · k / sqrt(d) for k in W(p) ∪ C(p)   (a key in both scopes counts twice:
                                                              nothing de-duplicates them)
         o_h = Σ_k e^{z_{h,k}} k / (Σ_k e^{z_{h,k}} + e^{sink_h})      V = K, the whole row
         lse_h = log Σ_k e^{z_{h,k}}                                  the sink not included
    (8)  o_h <- round(rope_p^{-1}(round(o_h)))      inverse RoPE at the query's position
    (9)  y_g = o_{g·H/G} ‖ ... ‖ o_{(g+1)·H/G - 1},  z_g = round(W_oa[g] y_g),
         out = round(concat_g z_g · W_ob^T)

``kv_cache_dtype`` says where ``round`` and ``cache`` round, as vLLM 0.33 stores each value
(``vllm/models/deepseek_v4/attention.py`` and the ops it calls):

    "float64"     nothing is rounded: the math alone
    "bfloat16"    round = bf16 at (1), (2), (3), (8), (9) (each stored bf16); the caches hold
                  bf16 rows (vLLM's plain-row caches)
    "fp8_ds_mla"  as "bfloat16", and the caches are DeepSeek-V4's MODEL1 rows: the 448 nope
                  values e4m3 with a UE8M0 scale per 64, the 64 RoPE values bf16. The window
                  keys use vLLM's Triton floor ``max(amax, 1e-4)/448`` (its window-cache
                  insert); the compressed entries are rounded by ``compressor.py``.

Not emulated: the FP8 block weights (take them dequantized, ``V4LayerWeights.from_state_dict``)
and the FP8 quantization of ``y_g`` before the grouped ``W_oa`` product on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla.reference.fp8_model1 import round_fp8_model1
from mla.reference.front import rms_norm
from mla.reference.v4.rope import rope_gptj
from mla.reference.v4.weights import V4LayerWeights
from mla.validation import check_float, check_index

__all__ = ["KV_CACHE_DTYPES", "V4LayerTrace", "v4_layer_definition", "v4_query_and_key",
           "v4_output_projection", "window_mask", "compressed_mask", "v4_cache_round",
           "attend_with_sink", "topk_entry_mask"]

KV_CACHE_DTYPES = ("float64", "bfloat16", "fp8_ds_mla")
F64 = torch.float64


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                         f"got {kv_cache_dtype!r}")


def _round(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """bf16 where the serving path stores bf16; nothing for "float64"."""
    return x if kv_cache_dtype == "float64" else x.to(torch.bfloat16).to(x.dtype)


def v4_cache_round(k: torch.Tensor, kv_cache_dtype: str, *, scale_floor: str = "vllm"
                   ) -> torch.Tensor:
    """Rows ``k [..., 512]`` as a cache of ``kv_cache_dtype`` gives them back (``k``'s dtype).

    The nope part is taken as bf16 first (the serving path quantizes bf16 values)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "float64":
        return k
    if kv_cache_dtype == "bfloat16":
        return k.to(torch.bfloat16).to(k.dtype)
    return round_fp8_model1(k.to(torch.bfloat16), scale_floor=scale_floor).to(k.dtype)


def window_mask(positions: torch.Tensor, key_positions: torch.Tensor, window: int
                ) -> torch.Tensor:
    """bool ``[T, S]``: key at ``key_positions[s]`` in the window of the query at
    ``positions[t]``: ``max(p - W + 1, 0) <= s <= p``."""
    p = positions.long()[:, None]
    s = key_positions.long()[None, :]
    return (s <= p) & (s >= p - window + 1) & (s >= 0)


def compressed_mask(positions: torch.Tensor, num_entries: int, ratio: int,
                    topk: torch.Tensor | None = None) -> torch.Tensor:
    """bool ``[T, n_c]``: entry ``j`` attended by the query at ``positions[t]``.

    Ratio 1: none. Ratio 128: ``j < (p + 1) // r``. Ratio 4: the valid ids of ``topk [T, k]``
    (local entry ids, ``-1`` for none), each of which must be visible."""
    T = positions.shape[0]
    if ratio == 1:
        return torch.zeros(T, num_entries, dtype=torch.bool, device=positions.device)
    if ratio != 4:
        return torch.arange(num_entries, device=positions.device)[None, :] < (
            (positions.long() + 1) // ratio)[:, None]
    if topk is None:
        raise ValueError("a ratio-4 layer needs the indexer's topk ids")
    return topk_entry_mask(positions, num_entries, ratio, topk)


def topk_entry_mask(positions: torch.Tensor, num_entries: int, ratio: int,
                    topk: torch.Tensor) -> torch.Tensor:
    """bool ``[T, n_c]``: the valid ids of ``topk [T, k]`` (local entry ids, ``-1`` for none),
    each of which must be visible to the query at ``positions[t]`` (``j < (p + 1) // ratio``).
    Shared by V4's ratio-4 layers and every compressed V4.1 layer."""
    visible = torch.arange(num_entries, device=positions.device)[None, :] < (
        (positions.long() + 1) // ratio)[:, None]
    ids = topk.long()
    valid = ids >= 0
    mask = torch.zeros(positions.shape[0], num_entries + 1, dtype=torch.bool,
                       device=positions.device)
    mask.scatter_(1, torch.where(valid, ids, num_entries).clamp(max=num_entries), True)
    mask = mask[:, :num_entries]
    if (mask & ~visible).any():
        t = int((mask & ~visible).any(dim=1).nonzero()[0])
        raise ValueError(f"topk row {t} names an entry the query at position "
                         f"{int(positions[t])} cannot see (j >= (p + 1) // {ratio})")
    return mask


@dataclass
class V4LayerTrace:
    """Every stage of one request through the layer (float64 unless said)."""

    q_latent: torch.Tensor          # c_Q [T, q_lora_rank], normed
    kv: torch.Tensor                # c_KV [T, d], normed, before RoPE
    q: torch.Tensor                 # [T, H, d] after the head norm and RoPE
    k_window: torch.Tensor          # [T, d] the window cache's rows as read back
    k_compressed: torch.Tensor      # [n_c, d] the compressed cache's rows as read back
    topk: torch.Tensor | None       # int32 [T, index_topk] local entry ids (ratio 4)
    window_mask: torch.Tensor       # bool [T, T]
    compressed_mask: torch.Tensor   # bool [T, n_c]
    attn: torch.Tensor              # o [T, H, d], the attention's output (sink applied)
    lse: torch.Tensor               # [T, H] natural log, without the sink
    o: torch.Tensor                 # [T, H, d] after the inverse RoPE
    z: torch.Tensor                 # [T, G, o_lora_rank]
    out: torch.Tensor               # [T, hidden]


def v4_query_and_key(x: torch.Tensor, positions: torch.Tensor, weights: V4LayerWeights,
                     kv_cache_dtype: str, *, rope_ratio: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equations (1)-(4): ``(c_Q, c_KV, q [T, H, d], k [T, d] as cached)``. ``rope_ratio``: the
    ratio ``rope_gptj`` picks the rotary by (default ``weights.ratio``; the V4.1 layer passes
    its own, as its ratios 0/1/2 name the rotaries differently)."""
    c = weights.config
    rope = weights.ratio if rope_ratio is None else rope_ratio
    T = x.shape[0]
    q_latent = _round(rms_norm(x @ weights["wq_a.weight"].T, weights["q_norm.weight"],
                               c.rms_norm_eps), kv_cache_dtype)
    kv = _round(rms_norm(x @ weights["wkv.weight"].T, weights["kv_norm.weight"],
                         c.rms_norm_eps), kv_cache_dtype)
    q = _round(q_latent @ weights["wq_b.weight"].T, kv_cache_dtype).view(T, c.num_heads,
                                                                         c.head_dim)
    if c.q_head_norm:
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)
    q = _round(rope_gptj(q, positions, c, rope), kv_cache_dtype)
    k = v4_cache_round(rope_gptj(kv, positions, c, rope), kv_cache_dtype)
    return q_latent, kv, q, k


def v4_output_projection(attn: torch.Tensor, positions: torch.Tensor, weights: V4LayerWeights,
                         kv_cache_dtype: str, *, rope_ratio: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equations (8)-(9): ``attn [T, H, d]`` -> ``(o, z [T, G, o_lora_rank], out [T, hidden])``;
    ``rope_ratio`` as in ``v4_query_and_key``."""
    c = weights.config
    T = attn.shape[0]
    rope = weights.ratio if rope_ratio is None else rope_ratio
    o = _round(rope_gptj(_round(attn, kv_cache_dtype), positions, c, rope,
                         inverse=True), kv_cache_dtype)
    y = o.reshape(T, c.o_groups, c.heads_per_group * c.head_dim)
    w_a = weights["wo_a.weight"].view(c.o_groups, c.o_lora_rank, -1)
    z = _round(torch.einsum("tgk,grk->tgr", y, w_a), kv_cache_dtype)
    out = _round(z.flatten(1) @ weights["wo_b.weight"].T, kv_cache_dtype)
    return o, z, out


def attend_with_sink(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor,
                     sink: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Equation (7) over dense keys: ``q [T, H, d]``, ``keys [S, d]`` (V = K), ``mask [T, S]``.

    Returns ``o [T, H, d]`` and ``lse [T, H]`` (``+inf`` for a query with no key, whose ``o`` is
    0, FlashMLA's convention)."""
    logits = torch.einsum("thd,sd->ths", q, keys) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    none = ~mask.any(dim=1)
    weights = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("ths,sd->thd", weights, keys)
    o = o * torch.sigmoid(lse - sink.to(lse.dtype))[..., None]
    o = torch.where(none[:, None, None], 0.0, o)
    lse = torch.where(none[:, None], float("inf"), lse)
    return o, lse


def v4_layer_definition(x: torch.Tensor, weights: V4LayerWeights, *,
                        kv_cache_dtype: str = "fp8_ds_mla",
                        topk: torch.Tensor | None = None) -> V4LayerTrace:
    """One request's tokens ``x [T, hidden]`` (positions ``0 .. T-1``) through the layer.

    ``topk [T, index_topk]`` int32 (ratio-4 layers): the compressed entries each query attends,
    e.g. the ids a kernel under test chose; by default the reference indexer's. Returns every
    stage (``V4LayerTrace``)."""
    c = weights.config
    check_kv_cache_dtype(kv_cache_dtype)
    check_float("x", x, shape=[None, c.hidden_size])
    T = x.shape[0]
    positions = torch.arange(T, device=x.device)
    q_latent, kv, q, k_window = v4_query_and_key(x, positions, weights, kv_cache_dtype)
    r = weights.ratio
    if r == 1:
        k_comp = x.new_zeros(0, c.head_dim)
    else:
        from mla.reference.v4.compressor import compressed_cache_entries
        k_comp = compressed_cache_entries(x, weights, kv_cache_dtype)
    if r == 4:
        if topk is None:
            from mla.reference.v4.indexer import indexer_topk_for_layer
            topk = indexer_topk_for_layer(x, q_latent, weights, kv_cache_dtype)
        else:
            check_index("topk", topk, shape=[T, None], dtype=(torch.int32,))
    elif topk is not None:
        raise ValueError(f"topk is only for ratio-4 layers; this layer's ratio is {r}")
    m_window = window_mask(positions, positions, c.sliding_window)
    m_comp = compressed_mask(positions, k_comp.shape[0], r, topk)
    keys = torch.cat([k_window, k_comp])
    mask = torch.cat([m_window, m_comp], dim=1)
    attn, lse = attend_with_sink(q, keys, mask, weights["attn_sink"].float(), c.softmax_scale)
    o, z, out = v4_output_projection(attn, positions, weights, kv_cache_dtype)
    return V4LayerTrace(q_latent, kv, q, k_window, k_comp, topk, m_window, m_comp, attn, lse,
                        o, z, out)
