"""DCP prefill context: the chunk plan, the gather of a chunk, ``reorg_kvcache``.

conventions §9 and §7, papers/derivation.md (19), (20) and (23). A prefill with cached context
needs each context chunk *whole* on every rank to up-project it (5). The context is cut into
global chunks of ``MCC`` tokens, (19), with ``MCC`` divisible by ``W``. Rank ``r`` holds the
chunk's positions ``t ≡ r (mod W)``, which sit at local positions ``[c·MCC/W, ...)``; so

    local plan   = plan_context_chunks(ceil(ctx_i / W), MCC/W)       (rank 0's share; every
                   rank gathers cp_chunk_seq_lens = ceil(chunk_len / W) rows per request)
    gathered     = all_gather(local gather)                          [W·toks] rows, rank-major
    chunk_i      = ‖_r rows_{r,i}[0 : n_r(chunk_len_i)]                                    (23)

A rank past ``(chunk_len - 1) mod W`` holds one token less than it gathers: its last row is
*padding*, which ``reorg_kvcache`` drops while it rebuilds the chunk request by request, rank
0's rows first. The context attention is non-causal, so this rank-major order of the keys is
as good as position order, and the chunks merge as in (20).

vLLM 0.11 ``v1/attention/backends/mla/common.py``: the DCP branch of the metadata builder
(``cp_chunk_seq_lens``, ``cp_cu_seq_lens``, ``cp_chunk_starts``), ``reorg_kvcache`` and
``_context_parallel_compute_prefill_context``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mla.reference.chunked import (
    ChunkPlan,
    check_chunked_prefill_args,
    context_chunk_attention,
    plan_context_chunks,
    suffix_attention,
)
from mla.reference.dcp.comm import Communicator
from mla.reference.dcp.sharding import head_slice, shard_kv_cache
from mla.reference.merge import merge_attn_states
from mla.reference.paged_cache import gather_cache
from mla.reference.prefill import up_project_kv
from mla.validation import check_float, check_positive_int, check_same_device

__all__ = ["DCPChunkPlan", "plan_dcp_context_chunks", "reorg_kvcache", "dcp_gather_context_chunk",
           "dcp_chunked_prefill_attention", "dcp_chunked_prefill_rank", "reorg_segments",
           "check_reorg_args", "check_plan_world_size"]


@dataclass(frozen=True)
class DCPChunkPlan:
    """vLLM's DCP chunk metadata: a global ``ChunkPlan`` and each rank's share of it.

    ``plan`` is the ordinary plan (its ``cu_seq_lens`` index the rebuilt chunk, its
    ``max_context_chunk`` is vLLM's ``chunk_size``). ``local`` is the same plan over the local
    positions: the plan of rank 0's share ``ceil(ctx_i / W)`` with chunks of ``MCC/W``. Per
    chunk ``c`` and request ``i``, every rank gathers ``cp_chunk_seq_lens[c][i]`` local rows
    from local position ``cp_chunk_starts[c][i] = c·MCC/W``; ``cp_cu_seq_lens[c]`` are their
    prefix sums and ``seq_tot[c]`` (vLLM's ``toks``) their sum.
    """

    plan: ChunkPlan
    world_size: int
    local: ChunkPlan

    @classmethod
    def from_plan(cls, plan: ChunkPlan, world_size: int) -> DCPChunkPlan:
        check_positive_int("world_size", world_size)
        mcc = plan.max_context_chunk
        if mcc % world_size:
            raise ValueError(f"the chunk size (max_context_chunk) must be divisible by "
                             f"world_size={world_size}, got {mcc}")
        # ceil(ceil(C / W) / (MCC / W)) = ceil(C / MCC): the local plan has the same chunks
        local = plan_context_chunks([-(-n // world_size) for n in plan.context_lens],
                                    max_context_chunk=mcc // world_size)
        return cls(plan, world_size, local)

    @property
    def num_chunks(self) -> int:
        return self.plan.num_chunks

    @property
    def chunk_size(self) -> int:
        return self.plan.max_context_chunk

    @property
    def origin_context_lens(self) -> tuple[int, ...]:
        return self.plan.context_lens

    @property
    def context_lens(self) -> tuple[int, ...]:
        """As ``ChunkPlan.context_lens`` (vLLM's name: ``origin_context_lens``)."""
        return self.plan.context_lens

    @property
    def cu_seq_lens_lst(self) -> tuple[tuple[int, ...], ...]:
        return self.plan.cu_seq_lens

    @property
    def max_seq_lens(self) -> tuple[int, ...]:
        return self.plan.max_seq_lens

    @property
    def cp_chunk_starts(self) -> tuple[tuple[int, ...], ...]:
        return self.local.chunk_starts

    @property
    def cp_chunk_seq_lens(self) -> tuple[tuple[int, ...], ...]:
        return self.local.chunk_seq_lens

    @property
    def cp_cu_seq_lens(self) -> tuple[tuple[int, ...], ...]:
        return self.local.cu_seq_lens

    @property
    def seq_tot(self) -> tuple[int, ...]:
        """Rows each rank gathers per chunk (vLLM's ``toks``)."""
        return self.local.seq_tot

    def padding_rows(self, chunk_idx: int) -> list[int]:
        """Rows of chunk ``chunk_idx``'s all-gathered ``[W·toks]`` buffer that are padding.

        Rank ``r`` holds ``ceil((chunk_len - r) / W)`` tokens of a chunk of ``chunk_len`` but
        gathers ``ceil(chunk_len / W)``; the surplus (0 or 1) row is its last one.
        """
        W, toks = self.world_size, self.seq_tot[chunk_idx]
        rows = []
        for r in range(W):
            for i, cp_len in enumerate(self.cp_chunk_seq_lens[chunk_idx]):
                held = -(-(self.plan.chunk_seq_lens[chunk_idx][i] - r) // W)
                rows += [r * toks + self.cp_cu_seq_lens[chunk_idx][i] + k
                         for k in range(held, cp_len)]
        return sorted(rows)

    def __str__(self) -> str:
        W, mcc = self.world_size, self.chunk_size
        lines = [f"DCPChunkPlan: {W} ranks, context lens {list(self.origin_context_lens)}, "
                 f"chunk size {mcc} ({mcc // W} local positions per rank), "
                 f"{self.num_chunks} chunks"]
        for c in range(self.num_chunks):
            glob = ", ".join(f"[{s}, {s + n})" if n else "-" for s, n in
                             zip(self.plan.chunk_starts[c], self.plan.chunk_seq_lens[c]))
            loc = ", ".join(f"[{s}, {s + n})" if n else "-" for s, n in
                            zip(self.cp_chunk_starts[c], self.cp_chunk_seq_lens[c]))
            toks, pad = self.seq_tot[c], len(self.padding_rows(c))
            lines.append(f"  chunk {c}: context {glob}")
            lines.append(f"    every rank gathers {toks} rows, local {loc}; all-gather -> "
                         f"{W * toks} rows; reorg keeps {self.plan.seq_tot[c]}, "
                         f"drops {pad} padding")
        return "\n".join(lines)

    def plot(self, chunk_idx: int = 0, ax: object = None) -> object:
        """Chunk ``chunk_idx``'s all-gathered buffer: rank segments, requests, padding in grey."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(8, 0.8 + 0.4 * self.world_size))
        colors = plt.get_cmap("tab10")
        toks, pad = self.seq_tot[chunk_idx], set(self.padding_rows(chunk_idx))
        cu = self.cp_cu_seq_lens[chunk_idx]
        for r in range(self.world_size):
            for i in range(len(cu) - 1):
                for k in range(cu[i], cu[i + 1]):
                    row = r * toks + k
                    ax.barh(r, 1, left=row, color="lightgrey" if row in pad else colors(i % 10),
                            edgecolor="black", linewidth=0.3)
        ax.set_xlabel("row of the all-gathered buffer (colour = request, grey = padding)")
        ax.set_ylabel("rank")
        ax.set_title(f"chunk {chunk_idx}: {self.world_size} x {toks} gathered rows")
        return ax


def plan_dcp_context_chunks(
    context_lens: Sequence[int],
    world_size: int,
    *,
    block_size: int | None = None,
    workspace_size: int | None = None,
    max_context_chunk: int | None = None,
) -> DCPChunkPlan:
    """vLLM's chunk plan (``plan_context_chunks``) and its DCP share; the chunk size must be
    divisible by ``world_size``."""
    check_positive_int("world_size", world_size)
    plan = plan_context_chunks(context_lens, block_size=block_size,
                               workspace_size=workspace_size,
                               max_context_chunk=max_context_chunk)
    return DCPChunkPlan.from_plan(plan, world_size)


def reorg_kvcache(
    allgatered_kv_c_normed: torch.Tensor,
    allgatered_k_pe: torch.Tensor,
    cp_chunk_seq_lens_lst: list[int],
    origin_context_lens: list[int],
    cp_world_size: int,
    sum_seq_len: int,
    max_seq_len: int,
    chunk_size: int,
    chunk_idx: int,
    toks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rebuild one context chunk from the all-gathered local gathers, (23) (vLLM's function).

    ``allgatered_*`` hold ``cp_world_size`` blocks of ``toks`` rows, rank-major; inside rank
    ``r``'s block, request ``i``'s ``cp_chunk_seq_lens_lst[i]`` rows follow those of the
    requests before it. The output is request by request, and within a request rank 0's rows,
    then rank 1's, ...; a rank past ``(chunk_len - 1) mod W`` contributes one row less (its
    last, a padding row). ``chunk_len`` is ``min(chunk_size, origin_context_lens[i] -
    chunk_size·chunk_idx)``. Checks, as vLLM's asserts: the output has ``sum_seq_len`` rows
    (the sum of the *global* chunk lengths) and the longest request has ``max_seq_len``;
    they raise ``ValueError`` here. An all-empty chunk gives empty tensors.
    """
    starts, lens, longest = check_reorg_args(
        allgatered_kv_c_normed, allgatered_k_pe, cp_chunk_seq_lens_lst, origin_context_lens,
        cp_world_size, sum_seq_len, max_seq_len, chunk_size, chunk_idx, toks)
    index = [row for s, n in zip(starts, lens) for row in range(s, s + n)]  # output order
    idx = torch.tensor(index, dtype=torch.long, device=allgatered_kv_c_normed.device)
    return (allgatered_kv_c_normed.index_select(0, idx),
            allgatered_k_pe.index_select(0, idx))


def reorg_segments(cp_chunk_seq_lens_lst: Sequence[int], origin_context_lens: Sequence[int],
                   cp_world_size: int, chunk_size: int, chunk_idx: int, toks: int
                   ) -> tuple[list[int], list[int], int]:
    """The rows ``reorg_kvcache`` keeps, as segments in output order (request, then rank):
    their first rows in the gathered buffer, their lengths, and the longest request's rows."""
    starts, lens = [], []
    longest, first = 0, 0  # first: the request's first row inside every rank's block
    for cp_len, ctx in zip(cp_chunk_seq_lens_lst, origin_context_lens):
        # an empty part keeps chunk_len = chunk_size: every rank then takes its 0 rows
        chunk_len = min(chunk_size, ctx - chunk_size * chunk_idx) if cp_len else chunk_size
        last_full_rank = (chunk_len - 1) % cp_world_size
        taken = 0
        for rank in range(cp_world_size):
            n = cp_len - 1 if (cp_len and rank > last_full_rank) else cp_len
            starts.append(rank * toks + first)
            lens.append(n)
            taken += n
        longest = max(longest, taken)
        first += cp_len
    return starts, lens, longest


def check_reorg_args(allgatered_kv_c_normed: torch.Tensor, allgatered_k_pe: torch.Tensor,
                     cp_chunk_seq_lens_lst: Sequence[int], origin_context_lens: Sequence[int],
                     cp_world_size: int, sum_seq_len: int, max_seq_len: int, chunk_size: int,
                     chunk_idx: int, toks: int) -> tuple[list[int], list[int], int]:
    """``reorg_kvcache``'s argument checks and vLLM's asserts (as ``ValueError``); returns
    ``reorg_segments``."""
    check_positive_int("cp_world_size", cp_world_size)
    n_req = len(cp_chunk_seq_lens_lst)
    if len(origin_context_lens) != n_req:
        raise ValueError(f"cp_chunk_seq_lens_lst and origin_context_lens must have one entry "
                         f"per request, got {n_req} and {len(origin_context_lens)}")
    if any(n < 0 for n in cp_chunk_seq_lens_lst) or sum(cp_chunk_seq_lens_lst) > toks:
        raise ValueError(f"cp_chunk_seq_lens_lst must be >= 0 and sum to at most "
                         f"toks={toks}, got {list(cp_chunk_seq_lens_lst)}")
    for name, t in (("allgatered_kv_c_normed", allgatered_kv_c_normed),
                    ("allgatered_k_pe", allgatered_k_pe)):
        check_float(name, t)
        if t.dim() < 1 or t.shape[0] != cp_world_size * toks:
            raise ValueError(f"{name} must have cp_world_size * toks = {cp_world_size} * {toks}"
                             f" rows, got shape {list(t.shape)}")
    check_same_device(allgatered_kv_c_normed=allgatered_kv_c_normed,
                      allgatered_k_pe=allgatered_k_pe)
    starts, lens, longest = reorg_segments(cp_chunk_seq_lens_lst, origin_context_lens,
                                           cp_world_size, chunk_size, chunk_idx, toks)
    if sum(lens) != sum_seq_len:
        raise ValueError(f"reorg_kvcache rebuilt {sum(lens)} rows but sum_seq_len is "
                         f"{sum_seq_len}: the chunk lengths do not match the context lengths")
    if longest != max_seq_len:
        raise ValueError(f"reorg_kvcache rebuilt a longest request of {longest} rows but "
                         f"max_seq_len is {max_seq_len}")
    return starts, lens, longest


def check_plan_world_size(plan: DCPChunkPlan, comm: Communicator) -> None:
    if comm.world_size != plan.world_size:
        raise ValueError(f"plan is for world_size={plan.world_size}, the communicator has "
                         f"{comm.world_size}")


def dcp_gather_context_chunk(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    plan: DCPChunkPlan,
    chunk_idx: int,
    kv_lora_rank: int,
    comm: Communicator,
    workspace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk ``chunk_idx`` of every request's context, whole, on every rank.

    Local gather (``cp_cu_seq_lens``, ``cp_chunk_starts``) into ``workspace``, all-gather into
    the ``[W·toks]`` buffer, ``reorg_kvcache``. Returns ``kv_c [sum, Lkv]`` and
    ``k_pe [sum, R]``, request ``i``'s rows at ``plan.cu_seq_lens_lst[chunk_idx][i]``.
    """
    check_plan_world_size(plan, comm)
    B, c = len(plan.origin_context_lens), chunk_idx
    toks = plan.seq_tot[c]
    if workspace is None:
        workspace = kv_cache.new_empty(toks, kv_cache.shape[2])
    dev = kv_cache.device
    local = gather_cache(kv_cache, workspace, block_table,
                         torch.tensor(plan.cp_cu_seq_lens[c], dtype=torch.int32, device=dev), B,
                         seq_starts=torch.tensor(plan.cp_chunk_starts[c], dtype=torch.int32,
                                                 device=dev))
    gathered = comm.all_gather(local, dim=0)  # [W·toks, Lkv+R], rank-major
    kv_c, k_pe = reorg_kvcache(
        gathered[:, None, :kv_lora_rank], gathered[:, None, kv_lora_rank:],
        cp_chunk_seq_lens_lst=list(plan.cp_chunk_seq_lens[c]),
        origin_context_lens=list(plan.origin_context_lens), cp_world_size=plan.world_size,
        sum_seq_len=plan.cu_seq_lens_lst[c][-1], max_seq_len=plan.max_seq_lens[c],
        chunk_size=plan.chunk_size, chunk_idx=c, toks=toks)
    return kv_c[:, 0], k_pe[:, 0]


def dcp_chunked_prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    plan: DCPChunkPlan,
    W_UK: torch.Tensor,  # noqa: N803
    W_UV: torch.Tensor,  # noqa: N803
    softmax_scale: float,
    comm: Communicator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunked_prefill_attention`` with the context sharded over the ranks of ``comm``.

    Same arguments, except that ``kv_cache``/``block_table`` are this rank's local cache and
    the heads are whatever ``q_nope``, ``W_UK``, ``W_UV`` carry (under tensor parallelism this
    rank's slice). The suffix (new tokens, causal) is local; each context chunk is gathered
    whole by ``dcp_gather_context_chunk`` and merged as in the single-rank path, (20).
    Returns ``o [T, N', V]`` and ``lse [N', T]``.
    """
    check_plan_world_size(plan, comm)
    B = len(plan.origin_context_lens)
    qsl = check_chunked_prefill_args(q_nope, q_pe, kv_c, k_pe, query_start_loc, kv_cache,
                                     block_table, B, W_UK, softmax_scale)

    # suffix: each request's new tokens, causal among themselves
    q = torch.cat([q_nope, q_pe], dim=-1)
    o, lse = suffix_attention(q, kv_c, k_pe, qsl, W_UK, W_UV, softmax_scale)

    # prefix: each chunk rebuilt from all ranks' shards, then attended without a mask
    Lkv = kv_c.shape[1]
    workspace = kv_cache.new_empty(max(plan.seq_tot, default=0), kv_cache.shape[2])
    for c in range(plan.num_chunks):
        ctx_kv_c, ctx_k_pe = dcp_gather_context_chunk(kv_cache, block_table, plan, c, Lkv, comm,
                                                      workspace)
        k_all, v_all = up_project_kv(ctx_kv_c, ctx_k_pe, W_UK, W_UV)
        o_c, lse_c = context_chunk_attention(q, k_all, v_all, qsl, plan.cu_seq_lens_lst[c],
                                             softmax_scale)
        o, lse = merge_attn_states(o_c, lse_c, o, lse)
    return o, lse


def dcp_chunked_prefill_rank(comm: Communicator, q_nope: torch.Tensor, q_pe: torch.Tensor,
                             kv_c: torch.Tensor, k_pe: torch.Tensor,
                             query_start_loc: torch.Tensor, kv_cache: torch.Tensor,
                             block_table: torch.Tensor, plan: DCPChunkPlan,
                             W_UK: torch.Tensor, W_UV: torch.Tensor,  # noqa: N803
                             softmax_scale: float, shard_seed: int | None = 0
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank program of DCP chunked prefill, given the *global* inputs of
    ``chunked_prefill_attention`` (with a ``DCPChunkPlan``).

    Rank ``comm.rank`` keeps its shard of the context and its heads and returns its heads'
    ``o [T, N/W, V]`` and ``lse [N/W, T]``: joined along the heads (``dim=1`` and ``dim=0``)
    the ranks' results are ``chunked_prefill_attention``'s.
    """
    heads = head_slice(q_nope.shape[1], comm.world_size, comm.rank)
    ctx = torch.tensor(plan.origin_context_lens, dtype=torch.int32, device=kv_cache.device)
    shard = shard_kv_cache(kv_cache, block_table, ctx, comm.world_size,
                           seed=shard_seed)[comm.rank]
    return dcp_chunked_prefill_attention(
        q_nope[:, heads], q_pe[:, heads], kv_c, k_pe, query_start_loc, shard.kv_cache,
        shard.block_table, plan, W_UK[:, heads], W_UV[:, heads], softmax_scale, comm)
