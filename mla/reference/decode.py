"""Absorbed-weight decode: MQA over the 576-wide latent (``_forward_decode`` of vLLM 0.11
``v1/attention/backends/mla/common.py``).

conventions §4 (DeepSeek-V2 appendix, "weight absorption"). ``W_UK`` folds into the query and
``W_UV`` into the output, so the keys and values stay in the latent space:

    ql_nope = einsum("snp,lnp->snl", q_nope, W_UK)                      [Sq, N, Lkv]
    o_lat   = MQA(q = [ql_nope, q_pe], k = [kv_c, k_pe], v = kv_c)       [Sq, N, Lkv]
    o       = einsum("snl,lnv->snv", o_lat, W_UV)                       [Sq, N, V]

One KV "head" of width ``Lkv + R`` serves all ``N`` query heads, and V is the first ``Lkv``
columns of K. The logits are the same numbers as the compute-friendly path's,
``q_nope · (kv_c W_UK) = (q_nope W_UKᵀ) · kv_c``, so the softmax scale stays the
compute-friendly path's, ``MLAConfig.softmax_scale``: ``1/sqrt(P+R)``, times ``mscale²`` under
YaRN, although the dot runs over ``Lkv + R`` dims. (Using ``1/sqrt(Lkv+R)`` is the classic bug.)

``mla_decode_paged`` is the kernel-level form over the paged cache, with FlashMLA's conventions
(``flash_mla_with_kvcache``): ``q [B, s_q, N, Lkv+R]``, ``lse [B, N, s_q]``, and with ``causal``
query ``i`` of ``s_q`` sees the cached keys ``0 .. L - s_q + i`` (multi-token prediction).
A query with no key gets ``out = 0`` and ``lse = +inf``, FlashMLA's "lonely q" convention.
"""

from __future__ import annotations

import torch

from mla.reference.attention import attention_with_lse
from mla.reference.paged_cache import cache_rows
from mla.reference.sink import apply_attn_sink, check_attn_sink
from mla.validation import (
    acc_dtype,
    check_float,
    check_index,
    check_positive_int,
    check_same_device,
    check_same_dtype,
    check_scale,
)

__all__ = ["absorb_q", "absorbed_attention", "mla_decode_paged", "check_paged_decode_args",
           "check_paged_decode_shapes", "check_paged_decode_values", "paged_mqa"]


def absorb_q(q_nope: torch.Tensor, W_UK: torch.Tensor) -> torch.Tensor:  # noqa: N803
    """``q_nope [S, N, P]`` -> ``ql_nope [S, N, Lkv]``."""
    return torch.einsum("snp,lnp->snl", q_nope, W_UK)


def absorbed_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    W_UK: torch.Tensor,  # noqa: N803
    W_UV: torch.Tensor,  # noqa: N803
    softmax_scale: float,
    causal: bool = True,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The absorbed path on dense latents: returns ``o [Sq, N, V]`` and ``lse [N, Sq]``."""
    check_float("q_nope", q_nope, shape=[None, W_UK.shape[1], W_UK.shape[2]])
    check_float("q_pe", q_pe, shape=[q_nope.shape[0], q_nope.shape[1], None])
    check_float("kv_c", kv_c, shape=[None, W_UK.shape[0]])
    check_float("k_pe", k_pe, shape=[kv_c.shape[0], q_pe.shape[2]])
    ql_nope = absorb_q(q_nope, W_UK)
    q = torch.cat([ql_nope, q_pe], dim=-1)  # [Sq, N, Lkv+R]
    k = torch.cat([kv_c, k_pe], dim=-1)[:, None, :]  # [Skv, 1, Lkv+R]
    o_lat, lse = attention_with_lse(q, k, kv_c[:, None, :], softmax_scale, causal=causal,
                                    q_positions=q_positions, k_positions=k_positions)
    return torch.einsum("snl,lnv->snv", o_lat, W_UV), lse


def check_paged_decode_args(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                            cache_seqlens: torch.Tensor, softmax_scale: float,
                            head_dim_v: int) -> None:
    """The argument checks of ``mla_decode_paged`` (shared with the fast path)."""
    check_paged_decode_shapes(q, kv_cache, block_table, cache_seqlens, softmax_scale, head_dim_v)
    check_paged_decode_values(kv_cache, block_table, cache_seqlens)


def check_paged_decode_shapes(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                              cache_seqlens: torch.Tensor, softmax_scale: float,
                              head_dim_v: int) -> None:
    """Shape, dtype, device and scalar checks: host metadata only, no device read."""
    check_float("q", q, ndim=4)
    B, s_q, N, D = q.shape
    check_float("kv_cache", kv_cache, shape=[None, None, D])
    check_same_dtype(q=q, kv_cache=kv_cache)
    check_index("block_table", block_table, ndim=2, dtype=(torch.int32,))
    if block_table.shape[0] != B:
        raise ValueError(f"block_table must have shape [{B}, *] (one row per request), "
                         f"got {list(block_table.shape)}")
    check_index("cache_seqlens", cache_seqlens, shape=[B], dtype=(torch.int32,))
    check_same_device(q=q, kv_cache=kv_cache, block_table=block_table,
                      cache_seqlens=cache_seqlens)
    check_scale("softmax_scale", softmax_scale)
    check_positive_int("head_dim_v", head_dim_v)
    if head_dim_v > D:
        raise ValueError(f"head_dim_v must be <= q's head dim {D}, got {head_dim_v}")
    if s_q == 0:
        raise ValueError(f"q must have s_q >= 1, got shape {list(q.shape)}")


def check_paged_decode_values(kv_cache: torch.Tensor, block_table: torch.Tensor,
                              cache_seqlens: torch.Tensor) -> None:
    """Value checks of the lengths and the used block-table entries, with one device-to-host
    transfer: the reductions run where the tensors are, and only a failure reads again, to
    name the first offending request."""
    B = cache_seqlens.shape[0]
    if B == 0:
        return
    num_blocks, bs, _ = kv_cache.shape
    max_blocks = block_table.shape[1]
    capacity = max_blocks * bs
    lens = cache_seqlens.long()
    bad_len = (lens < 0) | (lens > capacity)
    used_pages = (lens.clamp(0, capacity) + bs - 1) // bs
    used = torch.arange(max_blocks, device=lens.device)[None, :] < used_pages[:, None]
    bad_page = used & ((block_table < 0) | (block_table >= num_blocks))
    bad = bad_len | bad_page.any(1)
    if not bool(bad.any()):  # the one transfer of a call that passes
        return
    b = int(bad.nonzero()[0, 0])
    n = int(lens[b])
    if n < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {n} for request {b}")
    if n > capacity:
        raise ValueError(
            f"cache_seqlens[{b}] = {n} exceeds the block table's capacity "
            f"{max_blocks} blocks x {bs} = {capacity}")
    lo, hi = block_table[b, : -(-n // bs)].aminmax()
    raise ValueError(
        f"block_table[{b}] points outside kv_cache's {num_blocks} blocks "
        f"within its first {n} tokens: range [{int(lo)}, {int(hi)}]")


def mla_decode_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool = False,
    head_dim_v: int = 512,
    *,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MQA of ``q [B, s_q, N, D]`` over the paged latent cache ``kv_cache [nb, bs, D]``.

    V is ``kv_cache[..., :head_dim_v]``. Returns ``out [B, s_q, N, head_dim_v]`` (``q``'s dtype)
    and ``lse [B, N, s_q]`` (float32; float64 for float64 inputs), ``+inf`` for a query with
    no visible key. ``attn_sink [N]`` float32: the sink of ``mla.reference.sink`` (the output
    scaled, the lse unchanged; FlashMLA's dense decode refuses a sink, its sparse paths take it).
    """
    check_paged_decode_args(q, kv_cache, block_table, cache_seqlens, softmax_scale, head_dim_v)
    check_attn_sink(attn_sink, q.shape[2], q.device)
    lens = cache_seqlens.tolist()
    if attn_sink is None:
        return paged_mqa(q, kv_cache, block_table, lens, lens, softmax_scale, causal, head_dim_v)
    # in the accumulation dtype, so that out is rounded to q's dtype once, after the sink
    work = acc_dtype(q.dtype)
    out, lse = paged_mqa(q.to(work), kv_cache.to(work), block_table, lens, lens, softmax_scale,
                         causal, head_dim_v)
    return apply_attn_sink(out, lse.transpose(1, 2), attn_sink).to(q.dtype), lse


def paged_mqa(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
              seq_lens: list[int], local_lens: list[int], softmax_scale: float, causal: bool,
              head_dim_v: int, stride: int = 1, offset: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The loop under ``mla_decode_paged`` (arguments already checked).

    Request ``b`` holds ``local_lens[b]`` rows whose global positions are
    ``j·stride + offset`` (``stride = 1``: the whole sequence; DCP: ``stride = W``,
    ``offset = rank``); its ``s_q`` queries sit at ``seq_lens[b] - s_q ..``, so ``causal`` is
    decided on global positions. Empty rows get ``out = 0`` and ``lse = +inf``.
    """
    B, s_q, N, _ = q.shape
    out = q.new_zeros(B, s_q, N, head_dim_v)
    lse = torch.full((B, N, s_q), float("inf"), dtype=acc_dtype(q.dtype), device=q.device)
    for b, (L, n) in enumerate(zip(seq_lens, local_lens)):
        rows = cache_rows(kv_cache, block_table[b], 0, n)  # [n, D]
        k_pos = torch.arange(n, device=q.device) * stride + offset
        q_pos = torch.arange(L - s_q, L, device=q.device)
        o_b, lse_b = attention_with_lse(q[b], rows[:, None, :], rows[:, None, :head_dim_v],
                                        softmax_scale, causal=causal, q_positions=q_pos,
                                        k_positions=k_pos)
        out[b] = o_b
        lse[b] = torch.where(torch.isneginf(lse_b), float("inf"), lse_b)
    return out, lse
