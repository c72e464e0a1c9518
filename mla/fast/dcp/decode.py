"""DCP decode on the fast path: local ``mla.fast.mla_decode_paged``, Triton correction, NCCL.

Same contract as ``mla.reference.dcp.decode`` (conventions §9, derivation (22)):

    q_all         = all_gather_heads(q_r)                          [B, s_q, N, D]
    (o_r, lse_r)  = mla.fast.mla_decode_paged over rank r's tokens
    out, lse      = cp_lse_ag_out_rs(o_r, lse_r)                    mla.fast.dcp.correction

**Global positions under the causal mask.** Rank ``r`` holds global positions ``j·W + r``;
query ``i`` of a request of global length ``L`` sees positions ``<= L - s_q + i``, which on
the rank is the *prefix* of its local rows of length

    n_r(i) = clip(floor((L - s_q + i - r) / W) + 1, 0, n_r)        n_r = ceil((L - r) / W)

The fast kernel's causal mask counts local positions, so for ``s_q > 1`` with ``causal`` every
(request, query) pair runs as its own ``s_q = 1`` request of length ``n_r(i)`` over the same
block-table row (as vLLM expands ``s_q > 1`` for its Triton decode). For ``s_q = 1`` the
query sees every local row and nothing is expanded.

**CUDA graphs.** The lengths, the expansion and the slot mapping of new tokens are device
arithmetic (no ``.item()``/``.tolist()``), the collectives of ``CapturableCommunicator`` read
nothing on the host, and the value checks run only when ``validate`` resolves true
(``mla.fast.common.should_validate``: ``None`` follows ``mla.fast``'s global setting and
never validates while a graph is captured).
"""

from __future__ import annotations

import torch

from mla.fast.common import check_kernel_input, should_validate
from mla.fast.dcp.correction import cp_lse_ag_out_rs
from mla.fast.dcp.threads import KERNEL_LOCK
from mla.fast.decode import mla_decode_paged
from mla.reference.dcp.comm import Communicator, check_rank
from mla.reference.dcp.sharding import head_slice, shard_kv_cache
from mla.reference.decode import check_paged_decode_shapes
from mla.validation import check_float, check_index, check_nonnegative, check_same_device

__all__ = ["local_visible_lens", "dcp_local_decode", "dcp_decode", "dcp_decode_rank",
           "dcp_slot_mapping"]


def local_visible_lens(seq_lens: torch.Tensor, s_q: int, world_size: int, rank: int,
                       causal: bool) -> torch.Tensor:
    """Local rows rank ``rank`` must attend, per (request, query): ``[B, s_q]`` int32.

    Without ``causal`` (or with ``s_q = 1``) every query sees the rank's ``n_r = ceil((L -
    r) / W)`` rows; with it query ``i`` sees the prefix ``n_r(i)`` of the module doc. Device
    arithmetic only (capturable)."""
    L = seq_lens.to(torch.int64)[:, None]
    local = torch.div(L - rank + world_size - 1, world_size, rounding_mode="floor").clamp_(min=0)
    if not causal or s_q == 1:
        return local.expand(-1, s_q).to(torch.int32)
    i = torch.arange(s_q, device=seq_lens.device)[None, :]
    last = L - s_q + i - rank  # the last visible global position, minus the rank's offset
    vis = torch.div(last, world_size, rounding_mode="floor") + 1
    return torch.minimum(vis.clamp_(min=0), local).to(torch.int32)


def _local_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, softmax_scale: float, rank: int, world_size: int,
                     causal: bool, head_dim_v: int, validate: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's partial result flat over (request, query): ``o [B·s_q, N, DV]`` (q's dtype),
    ``lse [B·s_q, N]`` float32, ``+inf`` where the rank has no visible key."""
    B, s_q, N, D = q.shape
    lens = local_visible_lens(seq_lens, s_q, world_size, rank, causal)  # [B, s_q]
    if causal and s_q > 1:  # one s_q = 1 request per (request, query), same table row
        with KERNEL_LOCK:
            o, lse = mla_decode_paged(q.reshape(B * s_q, 1, N, D), kv_cache,
                                      block_table[:, None].expand(B, s_q, -1)
                                      .reshape(B * s_q, -1), lens.reshape(-1),
                                      softmax_scale, causal=False, head_dim_v=head_dim_v,
                                      validate=validate)
        return o.view(B * s_q, N, head_dim_v), lse.view(B * s_q, N)
    with KERNEL_LOCK:
        o, lse = mla_decode_paged(q, kv_cache, block_table, lens[:, 0].contiguous(),
                                  softmax_scale, causal=False, head_dim_v=head_dim_v,
                                  validate=validate)
    return o.view(B * s_q, N, head_dim_v), lse.transpose(1, 2).reshape(B * s_q, N)


def _check_global_lens(seq_lens: torch.Tensor, validate: bool) -> None:
    check_index("seq_lens", seq_lens, ndim=1, dtype=(torch.int32,))
    if validate:
        check_nonnegative("seq_lens", seq_lens)


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
    *,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s partial decode, as ``mla.reference.dcp.dcp_local_decode``:
    ``q [B, s_q, N, D]`` (all heads) over its local tokens of requests of *global* lengths
    ``seq_lens [B]`` int32. Returns ``o_r [B, s_q, N, head_dim_v]`` and ``lse_r [B, N, s_q]``
    float32, ``+inf`` where the rank has no visible key."""
    check_rank(rank, world_size)
    check_paged_decode_shapes(q, kv_cache, block_table, seq_lens, softmax_scale, head_dim_v)
    check_kernel_input(q)
    validate = should_validate(validate, q)
    _check_global_lens(seq_lens, validate)
    B, s_q, N, _ = q.shape
    o, lse = _local_attention(q, kv_cache, block_table, seq_lens, softmax_scale, rank,
                              world_size, causal, head_dim_v, validate)
    return o.view(B, s_q, N, head_dim_v), lse.view(B, s_q, N).transpose(1, 2).contiguous()


def dcp_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    comm: Communicator,
    causal: bool = False,
    head_dim_v: int = 512,
    *,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's DCP decode, as ``mla.reference.dcp.dcp_decode``: ``q [B, s_q, N/W, D]`` holds
    this rank's heads, ``kv_cache``/``block_table`` its local cache, ``seq_lens [B]`` int32 the
    *global* lengths. Returns this rank's heads ``out [B, s_q, N/W, head_dim_v]`` and
    ``lse [B, N/W, s_q]`` float32 (``+inf``: no key).

    With ``validate=False`` (or while a graph is captured) and a ``CapturableCommunicator``
    the call reads nothing on the host and can be captured in a CUDA graph.
    """
    check_float("q", q, ndim=4)
    check_kernel_input(q)
    B, s_q, n_local, D = q.shape
    check_float("kv_cache", kv_cache, shape=[None, None, D])
    check_same_device(q=q, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens)
    validate = should_validate(validate, q)
    _check_global_lens(seq_lens, validate)
    # gathered along the leading dim and viewed back: the kernel takes any head stride
    q_all = comm.all_gather(q.movedim(2, 0), dim=0).movedim(0, 2)  # [B, s_q, N, D]
    check_paged_decode_shapes(q_all, kv_cache, block_table, seq_lens, softmax_scale,
                              head_dim_v)
    o_r, lse_r = _local_attention(q_all, kv_cache, block_table, seq_lens, softmax_scale,
                                  comm.rank, comm.world_size, causal, head_dim_v, validate)
    out, lse = cp_lse_ag_out_rs(o_r, lse_r, comm, return_lse=True)
    lse = lse.view(B, s_q, n_local).transpose(1, 2)
    # FlashMLA's marker for a query that saw no key is +inf (the correction's is -inf)
    lse = torch.where(lse == float("-inf"), float("inf"), lse)
    return out.view(B, s_q, n_local, head_dim_v), lse


def dcp_decode_rank(comm: Communicator, q: torch.Tensor, kv_cache: torch.Tensor,
                    block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                    softmax_scale: float, causal: bool = False, head_dim_v: int = 512,
                    shard_seed: int | None = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank program of fast DCP decode, given the *global* inputs of ``mla_decode_paged``
    (as ``mla.reference.dcp.dcp_decode_rank``): the rank shards the cache with
    ``shard_kv_cache`` (host-side setup), keeps its heads of ``q`` and runs ``dcp_decode``."""
    check_paged_decode_shapes(q, kv_cache, block_table, cache_seqlens, softmax_scale,
                              head_dim_v)
    heads = head_slice(q.shape[2], comm.world_size, comm.rank)
    shard = shard_kv_cache(kv_cache, block_table, cache_seqlens, comm.world_size,
                           seed=shard_seed)[comm.rank]
    return dcp_decode(q[:, :, heads], shard.kv_cache, shard.block_table, cache_seqlens,
                      softmax_scale, comm, causal=causal, head_dim_v=head_dim_v)


def dcp_slot_mapping(block_table: torch.Tensor, req_indices: torch.Tensor,
                     positions: torch.Tensor, block_size: int, world_size: int,
                     rank: int) -> torch.Tensor:
    """``mla.reference.dcp.dcp_slot_mapping`` without a host sync: the local slot of each new
    token ``rank`` owns (local position ``position // W``), ``-1`` for the others.

    The owned tokens' table entries are trusted (``concat_and_cache_mla`` checks the slots'
    range when it validates); another rank's token reads a clamped entry it then discards.
    """
    check_rank(rank, world_size)
    check_index("block_table", block_table, ndim=2)
    check_index("positions", positions, ndim=1)
    check_index("req_indices", req_indices, shape=list(positions.shape))
    check_same_device(block_table=block_table, req_indices=req_indices, positions=positions)
    pos = positions.to(torch.int64)
    local = torch.div(pos, world_size, rounding_mode="floor")
    col = torch.div(local, block_size, rounding_mode="floor").clamp(0, block_table.shape[1] - 1)
    page = block_table[req_indices.to(torch.int64), col].to(torch.int64)
    slot = page * block_size + local % block_size
    return torch.where(pos % world_size == rank, slot, torch.full_like(slot, -1))
