"""DCP decode: each rank attends over its own tokens, the log-sum-exp combines them exactly.

conventions §9 and §6, papers/derivation.md (22). Rank ``r`` holds the query of its own
``N/W`` heads (its tensor-parallel slice); the heads are all-gathered, every rank runs the
absorbed attention (11) of all ``N`` heads over its local tokens only, keeping their global
positions for the causal mask (16), and the partial results are combined through their
log-sum-exp:

    q             = all_gather_heads(q_r)                        [B, s_q, N, Lkv+R]
    (o_r, lse_r)  = absorbed MQA of q over rank r's tokens        ranks with none: lse_r = -inf
    lse           = log sum_r exp(lse_r)                          (all-gather of lse)     (22)
    o             = reduce_scatter_heads(exp(lse_r - lse) · o_r)  each rank keeps N/W heads

The last two lines are vLLM 0.11's ``cp_lse_ag_out_rs`` (``attention/ops/common.py``), called
from ``v1/attention/backends/mla/common.py``. Conventions kept from the single-rank kernels: a
decode ``lse`` is ``[B, N, s_q]`` with ``+inf`` for a query that saw no key (FlashMLA's);
``cp_lse_ag_out_rs`` takes vLLM's layout ``out [T, N, D]``, ``lse [T, N]``.
"""

from __future__ import annotations

import torch

from mla.reference.dcp.comm import Communicator, check_rank
from mla.reference.dcp.sharding import dcp_local_seq_lens, head_slice, shard_kv_cache
from mla.reference.decode import check_paged_decode_args, paged_mqa
from mla.validation import acc_dtype, check_float, check_index, check_nonnegative, check_same_device

__all__ = ["dcp_local_decode", "cp_lse_ag_out_rs", "dcp_decode", "dcp_decode_rank"]


def dcp_local_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    rank: int,
    world_size: int,
    causal: bool = False,
    head_dim_v: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s partial decode: ``q [B, s_q, N, D]`` (all heads) over its local tokens.

    ``seq_lens [B]`` are the *global* lengths; the rank holds ``dcp_local_seq_lens`` of them in
    ``kv_cache`` under ``block_table``. Keys carry their global positions ``j·W + rank``, so
    ``causal`` (query ``i`` sees positions ``<= L - s_q + i``, FlashMLA's MTP mask) is decided
    on the global sequence, not on the shard. Returns ``o_r [B, s_q, N, head_dim_v]`` and
    ``lse_r [B, N, s_q]`` with ``+inf`` where the rank has no visible key (FlashMLA's layout).
    """
    check_rank(rank, world_size)
    check_index("seq_lens", seq_lens, ndim=1, dtype=(torch.int32,))
    check_nonnegative("seq_lens", seq_lens)
    local_lens = dcp_local_seq_lens(seq_lens, world_size, rank)
    check_paged_decode_args(q, kv_cache, block_table, local_lens, softmax_scale, head_dim_v)
    return paged_mqa(q, kv_cache, block_table, seq_lens.tolist(), local_lens.tolist(),
                     softmax_scale, causal, head_dim_v, stride=world_size, offset=rank)


def cp_lse_ag_out_rs(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, comm: Communicator,
                     return_lse: bool = False
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Combine the ranks' partial attentions exactly, (22) (vLLM's ``cp_lse_ag_out_rs``).

    ``cp_attn_out [T, N, D]`` and ``cp_attn_lse [T, N]`` are this rank's result over its own
    keys, all ``N`` heads. The lse are all-gathered, each rank scales its output by
    ``exp(lse_r - lse)`` and the scaled outputs are reduce-scattered along heads: rank ``r``
    returns ``out [T, N/W, D]`` (heads ``head_slice(N, W, r)``) and, with ``return_lse``,
    ``lse [T, N/W]``. ``±inf`` in ``cp_attn_lse`` means "no keys" and weighs 0; a query no
    rank saw gets ``out = 0``, ``lse = -inf``. A NaN lse on any rank makes that query's ``out``
    and ``lse`` NaN (conventions §13: a NaN is never read as "no keys"). The scaling and the
    sum run in float32 (or float64), so that adding ``W`` partials costs no extra rounding in
    bf16.
    """
    check_float("cp_attn_out", cp_attn_out, ndim=3)
    Tq, N, _ = cp_attn_out.shape
    check_float("cp_attn_lse", cp_attn_lse, shape=[Tq, N])
    check_same_device(cp_attn_out=cp_attn_out, cp_attn_lse=cp_attn_lse)
    heads = head_slice(N, comm.world_size, comm.rank)
    work = acc_dtype(cp_attn_out.dtype)
    lses = comm.all_gather(cp_attn_lse.to(work)[None], dim=0)  # [W, T, N]
    poisoned = torch.isnan(lses).any(dim=0)  # [T, N]
    lses = torch.where(torch.isinf(lses) | torch.isnan(lses), float("-inf"), lses)
    m = lses.max(dim=0).values
    m_safe = torch.where(torch.isneginf(m), 0.0, m)
    lse = m_safe + torch.log(torch.exp(lses - m_safe).sum(dim=0))  # -inf where no rank saw keys
    mine = lses[comm.rank]
    factor = torch.where(torch.isneginf(mine), 0.0, torch.exp(mine - lse))[..., None]
    # a rank without keys contributes exactly nothing, whatever its output holds
    scaled = torch.where(factor > 0, cp_attn_out.to(work) * factor, 0.0)
    scaled = torch.where(poisoned[..., None], float("nan"), scaled)
    lse = torch.where(poisoned, float("nan"), lse)
    out = comm.reduce_scatter(scaled, dim=1).to(cp_attn_out.dtype)
    if return_lse:
        return out, lse[:, heads].contiguous()
    return out


def dcp_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    comm: Communicator,
    causal: bool = False,
    head_dim_v: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's DCP decode: ``q [B, s_q, N/W, D]`` holds this rank's heads.

    The local cache (``kv_cache``, ``block_table``) holds this rank's share of the requests
    of *global* lengths ``seq_lens [B]`` int32. Returns this rank's heads of the exact result,
    ``out [B, s_q, N/W, head_dim_v]`` and ``lse [B, N/W, s_q]`` (``+inf``: no key), the same
    numbers ``mla_decode_paged`` gives for those heads on the global cache.
    """
    check_float("q", q, ndim=4)
    B, s_q, n_local, D = q.shape
    q_all = comm.all_gather(q, dim=2)  # [B, s_q, N, D]: every rank attends with all heads
    o_r, lse_r = dcp_local_decode(q_all, kv_cache, block_table, seq_lens, softmax_scale,
                                  comm.rank, comm.world_size, causal=causal,
                                  head_dim_v=head_dim_v)
    N = q_all.shape[2]
    out, lse = cp_lse_ag_out_rs(o_r.reshape(B * s_q, N, head_dim_v),
                                lse_r.transpose(1, 2).reshape(B * s_q, N), comm,
                                return_lse=True)
    out = out.view(B, s_q, n_local, head_dim_v)
    lse = lse.view(B, s_q, n_local).transpose(1, 2)
    return out, torch.where(torch.isneginf(lse), float("inf"), lse).contiguous()


def dcp_decode_rank(comm: Communicator, q: torch.Tensor, kv_cache: torch.Tensor,
                    block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                    softmax_scale: float, causal: bool = False, head_dim_v: int = 512,
                    shard_seed: int | None = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank program of DCP decode, given the *global* inputs of ``mla_decode_paged``.

    Rank ``comm.rank`` keeps its shard of the cache and its heads of ``q`` and runs
    ``dcp_decode``; it returns its heads' ``(out, lse)``, so joining the ranks' results along
    the heads (``dim=2`` and ``dim=1``) gives ``mla_decode_paged``'s. Run it with
    ``run_simulated(W, partial(dcp_decode_rank, q=..., ...))`` or on a process group
    (``mla.check.dcp``).
    """
    check_paged_decode_args(q, kv_cache, block_table, cache_seqlens, softmax_scale, head_dim_v)
    heads = head_slice(q.shape[2], comm.world_size, comm.rank)
    shard = shard_kv_cache(kv_cache, block_table, cache_seqlens, comm.world_size,
                           seed=shard_seed)[comm.rank]
    return dcp_decode(q[:, :, heads], shard.kv_cache, shard.block_table, cache_seqlens,
                      softmax_scale, comm, causal=causal, head_dim_v=head_dim_v)
