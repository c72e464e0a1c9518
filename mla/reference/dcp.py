"""Decode context parallelism (DCP): one request's latent cache spread over ``W`` ranks.

conventions §9 (vLLM 0.11 ``v1/attention/backends/mla/common.py``: the DCP branch of the metadata
builder, ``reorg_kvcache`` and
``_context_parallel_compute_prefill_context``; vLLM's ``cp_lse_ag_out_rs``).

Placement is *interleaved*: the token at position ``t`` lives on rank ``t mod W`` at local
position ``t // W``, so rank ``r`` of a request of length ``L`` holds

    n_r = L // W + (r < L mod W)                 (= ceil((L - r) / W))

(The seed's decode ``seq_lens`` update writes ``L // W + (r <= (L - 1) mod W)``, which is the
same for ``L mod W != 0`` but gives every rank one token too many when ``W`` divides ``L``;
vLLM fixed it upstream in vllm-project/vllm#27518. This module follows the fix.)

Decode. Rank ``r`` holds the query of its own ``N/W`` heads (its tensor-parallel slice); the
heads are all-gathered, every rank attends with all ``N`` heads over its local tokens only,
and the partial results are combined exactly through their log-sum-exp (conventions §6):

    q                = all_gather_heads(q_r)                      [B, s_q, N, Lkv+R]
    (o_r, lse_r)     = absorbed MQA of q over rank r's tokens      ranks with none: lse_r = -inf
    lse              = logsumexp_r lse_r                           (all-gather of lse)
    o                = reduce_scatter_heads(exp(lse_r - lse) · o_r)   each rank keeps N/W heads

Prefill context. The context of a request is cut into global chunks of ``MCC`` tokens
(``MCC`` divisible by ``W``); chunk ``c`` covers local positions ``[c·MCC/W, ...)`` on every
rank. Each rank gathers ``cp_chunk_seq_lens = ceil(chunk_len / W)`` rows per request (one row
too many on ranks past ``(chunk_len - 1) mod W``: a *padding* row), the gathers are
all-gathered into one ``[W·toks]`` buffer (rank-major), and ``reorg_kvcache`` rebuilds the
chunk request by request, rank 0's rows first, dropping the padding rows. The context
attention is non-causal, so this rank-major order of the keys is as good as position order.

The math is written once against ``Communicator`` (``rank``, ``world_size``, ``all_gather``,
``reduce_scatter``). ``run_simulated`` runs it in one process on a list of ``W`` shards (a
thread per rank meeting at a barrier; no communication library), ``mla.check.dcp`` on a real
``torch.distributed`` process group (gloo on CPU, NCCL on GPUs), with the same functions.

Conventions kept from the single-rank kernels: a decode ``lse`` is ``[B, N, s_q]`` with
``+inf`` for a query that saw no key (FlashMLA's); ``cp_lse_ag_out_rs`` takes vLLM's layout
``out [T, N, D]``, ``lse [T, N]``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

import torch

from mla.reference.chunked import (
    ChunkPlan,
    check_chunked_prefill_args,
    context_chunk_attention,
    plan_context_chunks,
    suffix_attention,
)
from mla.reference.decode import absorb_q, check_paged_decode_args, paged_mqa
from mla.reference.front import mla_front
from mla.reference.merge import merge_attn_states
from mla.reference.paged_cache import (
    cache_rows,
    concat_and_cache_mla,
    gather_cache,
    make_block_table,
    slot_mapping_from_block_table,
)
from mla.reference.prefill import up_project_kv
from mla.validation import (
    acc_dtype,
    check_float,
    check_index,
    check_nonnegative,
    check_positive_int,
    check_same_device,
)
from mla.weights import MLAWeights

__all__ = [
    "Communicator", "SimulatedCommunicator", "run_simulated",
    "check_rank", "dcp_local_seq_lens", "head_slice", "DCPSharding", "LocalKVCache",
    "shard_kv_cache", "dcp_slot_mapping",
    "dcp_local_decode", "cp_lse_ag_out_rs", "dcp_decode", "dcp_decode_rank",
    "dcp_decode_simulated",
    "DCPChunkPlan", "plan_dcp_context_chunks", "reorg_kvcache", "dcp_gather_context_chunk",
    "dcp_chunked_prefill_attention", "dcp_chunked_prefill_rank",
    "dcp_chunked_prefill_simulated",
    "dcp_decode_forward", "dcp_chunked_prefill_forward", "dcp_decode_forward_rank",
    "dcp_chunked_prefill_forward_rank", "dcp_decode_forward_simulated",
    "dcp_chunked_prefill_forward_simulated",
]

Result = TypeVar("Result")


# --- the communicator ----------------------------------------------------------------------

@runtime_checkable
class Communicator(Protocol):
    """The four things the DCP math needs from a group of ranks.

    ``all_gather(x, dim)``: every rank passes a tensor of one shape; every rank gets them
    concatenated along ``dim`` in rank order. ``reduce_scatter(x, dim)``: every rank passes a
    tensor of one shape whose ``dim`` is divisible by ``world_size``; rank ``r`` gets the
    ``r``-th slice along ``dim`` of their sum.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor: ...

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor: ...


def check_rank(rank: object, world_size: object) -> tuple[int, int]:
    """``world_size`` a positive int and ``0 <= rank < world_size``."""
    check_positive_int("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int, got {type(rank).__name__}")
    if not 0 <= rank < world_size:  # type: ignore[operator]
        raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
    return rank, world_size  # type: ignore[return-value]


def check_same_shapes(op: str, shapes: Sequence[tuple[int, ...]],
                      dtypes: Sequence[torch.dtype] = ()) -> None:
    """A collective needs one shape (and dtype) on every rank; name the first rank that differs."""
    for r, shape in enumerate(shapes):
        if tuple(shape) != tuple(shapes[0]):
            raise ValueError(f"{op}: rank {r} passed shape {list(shape)} but rank 0 passed "
                             f"{list(shapes[0])}; every rank must pass the same shape")
    for r, dt in enumerate(dtypes):
        if dt != dtypes[0]:
            raise TypeError(f"{op}: rank {r} passed dtype {dt} but rank 0 passed "
                            f"{dtypes[0]}; every rank must pass the same dtype")


def _normalize_dim(op: str, x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{op}: dim must lie in [-{x.dim()}, {x.dim()}) for a tensor of shape "
                         f"{list(x.shape)}, got {dim}")
    return dim % x.dim()


def all_gather_parts(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The all-gather of per-rank tensors: checked, then concatenated in rank order."""
    check_same_shapes("all_gather", [tuple(p.shape) for p in parts], [p.dtype for p in parts])
    return torch.cat(list(parts), dim=_normalize_dim("all_gather", parts[0], dim))


def reduce_scatter_parts(parts: Sequence[torch.Tensor], dim: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s slice of the sum of per-rank tensors, summed in rank order."""
    check_same_shapes("reduce_scatter", [tuple(p.shape) for p in parts],
                      [p.dtype for p in parts])
    W = len(parts)
    dim = _normalize_dim("reduce_scatter", parts[0], dim)
    size = parts[0].shape[dim]
    if size % W:
        raise ValueError(f"reduce_scatter: dim {dim} of shape {list(parts[0].shape)} must be "
                         f"divisible by world_size={W}")
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total.narrow(dim, rank * (size // W), size // W).contiguous()


class _Rendezvous:
    """Where the simulated ranks meet: each collective is one exchange of a tensor per rank.

    Two barriers per exchange: after the first every rank's tensor is posted; each rank then
    computes its own result from all of them; the second keeps a fast rank from posting its
    next tensor before the slow ones have read this one.
    """

    def __init__(self, world_size: int, timeout: float) -> None:
        self.barrier = threading.Barrier(world_size, timeout=timeout)
        self.slots: list[torch.Tensor | None] = [None] * world_size

    def exchange(self, rank: int, x: torch.Tensor,
                 combine: Callable[[list[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        self.slots[rank] = x
        self.barrier.wait()
        try:
            result = combine(list(self.slots))  # type: ignore[arg-type]
        except (ValueError, TypeError) as e:  # the same error on every rank: raise after
            result, error = None, e
        else:
            error = None
        self.barrier.wait()
        if error is not None:
            raise error
        return result  # type: ignore[return-value]


class SimulatedCommunicator:
    """Rank ``rank`` of a group simulated in one process (see ``run_simulated``)."""

    def __init__(self, rank: int, world_size: int, rendezvous: _Rendezvous | None = None
                 ) -> None:
        check_rank(rank, world_size)
        if rendezvous is None:
            if world_size != 1:
                raise ValueError(f"a SimulatedCommunicator of world_size={world_size} needs "
                                 "the group's rendezvous; build the group with run_simulated")
            rendezvous = _Rendezvous(1, timeout=1.0)
        self._rank, self._world_size, self._rv = rank, world_size, rendezvous

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._rv.exchange(self._rank, x, lambda parts: all_gather_parts(parts, dim))

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._rv.exchange(self._rank, x,
                                 lambda parts: reduce_scatter_parts(parts, dim, self._rank))

    def __repr__(self) -> str:
        return f"SimulatedCommunicator(rank={self._rank}, world_size={self._world_size})"


def run_simulated(world_size: int, fn: Callable[[Communicator], Result],
                  timeout: float = 120.0) -> list[Result]:
    """Run ``fn(comm)`` as every rank of a simulated group; return the results in rank order.

    One thread per rank, meeting at a barrier for each collective. An exception on any rank
    breaks the barrier for the others and is re-raised here; a rank that never arrives makes
    the others fail after ``timeout`` seconds instead of hanging.
    """
    check_positive_int("world_size", world_size)
    rv = _Rendezvous(world_size, timeout)
    comms = [SimulatedCommunicator(r, world_size, rv) for r in range(world_size)]
    if world_size == 1:
        return [fn(comms[0])]
    results: list[Result | None] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(r: int) -> None:
        try:
            results[r] = fn(comms[r])
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            errors[r] = e
            rv.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"dcp-rank-{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the first rank's own error, not the BrokenBarrierError it caused on the others
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        raise real[0]
    broken = [r for r, e in enumerate(errors) if e is not None]
    if broken:
        raise TimeoutError(f"simulated ranks {broken} waited more than {timeout} s at a "
                           "collective that not every rank reached") from errors[broken[0]]
    return results  # type: ignore[return-value]


# --- sharding as a value -------------------------------------------------------------------

def dcp_local_seq_lens(seq_lens: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Tokens of each request held by ``rank``: ``L // W + (rank < L mod W)``.

    The positions ``t < L`` with ``t mod W = rank``. The seed's expression
    ``L // W + (rank <= (L - 1) mod W)`` agrees except when ``W`` divides ``L`` (``L >= 1``),
    where it counts one token too many on every rank (fixed upstream, vllm#27518).
    Same dtype as ``seq_lens``.
    """
    check_rank(rank, world_size)
    check_index("seq_lens", seq_lens, ndim=1)
    check_nonnegative("seq_lens", seq_lens)
    extra = (rank < seq_lens % world_size).to(seq_lens.dtype)
    return seq_lens // world_size + extra


def head_slice(num_heads: int, world_size: int, rank: int) -> slice:
    """The heads rank ``rank`` keeps after the reduce-scatter: ``N/W`` contiguous heads."""
    check_rank(rank, world_size)
    if num_heads % world_size:
        raise ValueError(f"the number of heads ({num_heads}) must be divisible by "
                         f"world_size={world_size}: the output is reduce-scattered along heads")
    n = num_heads // world_size
    return slice(rank * n, (rank + 1) * n)


@dataclass(frozen=True)
class DCPSharding:
    """Who holds which token: position ``t`` of every request on rank ``t mod W``.

    ``str()`` prints the owner of each position and the count per rank; ``plot()`` draws it.
    """

    seq_lens: tuple[int, ...]
    world_size: int

    def __post_init__(self) -> None:
        check_positive_int("world_size", self.world_size)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.seq_lens):
            raise ValueError(f"seq_lens must be ints >= 0, got {list(self.seq_lens)}")

    @classmethod
    def of(cls, seq_lens: Sequence[int] | torch.Tensor, world_size: int) -> DCPSharding:
        lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
        return cls(tuple(int(n) for n in lens), world_size)

    def owner(self, position: int) -> int:
        return position % self.world_size

    def local_position(self, position: int) -> int:
        return position // self.world_size

    def local_seq_lens(self, rank: int) -> tuple[int, ...]:
        lens = torch.tensor(self.seq_lens, dtype=torch.int64)
        return tuple(dcp_local_seq_lens(lens, self.world_size, rank).tolist())

    def positions(self, request: int, rank: int) -> torch.Tensor:
        """Global positions of request ``request`` held by ``rank``, in local order."""
        check_rank(rank, self.world_size)
        n = self.local_seq_lens(rank)[request]
        return torch.arange(n) * self.world_size + rank

    def counts(self) -> list[list[int]]:
        """``counts()[r][i]``: tokens of request ``i`` on rank ``r``."""
        return [list(self.local_seq_lens(r)) for r in range(self.world_size)]

    def __str__(self) -> str:
        return self.describe()

    def describe(self, max_positions: int = 32) -> str:
        """The table ``str()`` prints, showing the owners of the first ``max_positions``."""
        W = self.world_size
        counts = self.counts()
        lines = [f"DCPSharding: {W} ranks, {len(self.seq_lens)} requests; "
                 f"position t of a request lives on rank t mod {W} at local slot t // {W}",
                 f"{'req':>4} {'L':>6}  tokens per rank {'':<{3 * W}}owner of positions 0, 1, ..."]
        for i, L in enumerate(self.seq_lens):
            per_rank = " ".join(f"{counts[r][i]:>3}" for r in range(W))
            owners = " ".join(str(t % W) for t in range(min(L, max_positions)))
            more = " ..." if L > max_positions else ""
            lines.append(f"{i:>4} {L:>6}  {per_rank:<{4 * W + 15}}{owners}{more}")
        return "\n".join(lines)

    def plot(self, ax: object = None, max_positions: int = 64) -> object:
        """One row per request, one cell per position coloured by its rank (needs matplotlib)."""
        import matplotlib.pyplot as plt

        width = min(max(self.seq_lens, default=1), max_positions)
        grid = torch.full((len(self.seq_lens), width), float("nan"))
        for i, L in enumerate(self.seq_lens):
            n = min(L, width)
            grid[i, :n] = torch.arange(n) % self.world_size
        if ax is None:
            _, ax = plt.subplots(figsize=(8, 0.6 + 0.35 * len(self.seq_lens)))
        im = ax.imshow(grid.numpy(), aspect="auto", cmap="tab10", vmin=0, vmax=9,
                       interpolation="nearest")
        ax.set_xlabel("position in request")
        ax.set_ylabel("request")
        ax.set_title(f"DCP interleaved placement over {self.world_size} ranks (colour = rank)")
        ax.figure.colorbar(im, ax=ax, ticks=range(self.world_size))
        return ax


@dataclass
class LocalKVCache:
    """One rank's paged cache: its own ``block_table`` over its own ``kv_cache``.

    ``seq_lens`` counts the tokens of each request this rank holds (``dcp_local_seq_lens``).
    """

    rank: int
    world_size: int
    kv_cache: torch.Tensor  # [num_blocks, block_size, Lkv + R]
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, local

    def __str__(self) -> str:
        nb, bs, D = self.kv_cache.shape
        return (f"LocalKVCache(rank {self.rank}/{self.world_size}: {nb} blocks x {bs} x {D}, "
                f"local seq_lens {self.seq_lens.tolist()})")


def shard_kv_cache(kv_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, world_size: int, *,
                   capacities: Sequence[int] | None = None, seed: int | None = 0
                   ) -> list[LocalKVCache]:
    """Split a global paged cache into ``world_size`` interleaved local caches.

    Request ``i``'s first ``seq_lens[i]`` rows are read from the global cache; rank ``r``
    stores position ``t ≡ r (mod W)`` at local position ``t // W`` in a cache of its own
    (same block size, its own scattered block table). Every rank gets room for
    ``ceil(capacities[i] / W)`` tokens (default ``capacities = seq_lens``): rank 0's share,
    which also covers the one padding row a shorter rank reads in the DCP context gather.
    Slots nobody wrote hold NaN, so a path that reads one cannot pass a comparison.
    """
    check_positive_int("world_size", world_size)
    check_float("kv_cache", kv_cache, ndim=3)
    check_index("block_table", block_table, ndim=2)
    B = block_table.shape[0]
    check_index("seq_lens", seq_lens, shape=[B])
    check_same_device(kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens)
    check_nonnegative("seq_lens", seq_lens)
    lens = seq_lens.tolist()
    caps = lens if capacities is None else [int(c) for c in capacities]
    if len(caps) != B or any(c < n for c, n in zip(caps, lens)):
        raise ValueError(f"capacities must give one value >= seq_lens per request, got "
                         f"{caps} for seq_lens {lens}")
    _, bs, D = kv_cache.shape
    if max(lens, default=0) > block_table.shape[1] * bs:
        raise ValueError(f"seq_lens {lens} exceed the block table's capacity "
                         f"{block_table.shape[1]} x {bs}")
    local_caps = [-(-c // world_size) for c in caps]
    shards = []
    for r in range(world_size):
        table, num_blocks = make_block_table(local_caps, bs, spare_blocks=1,
                                             seed=None if seed is None else seed + r,
                                             device=kv_cache.device)
        local = torch.full((num_blocks, bs, D), float("nan"), dtype=kv_cache.dtype,
                           device=kv_cache.device)
        local_lens = dcp_local_seq_lens(seq_lens.to(torch.int32), world_size, r)
        for i, L in enumerate(lens):
            rows = cache_rows(kv_cache, block_table[i], 0, L)[r::world_size]  # t ≡ r (mod W)
            pos = torch.arange(rows.shape[0], device=kv_cache.device)
            slots = slot_mapping_from_block_table(table, torch.full_like(pos, i), pos, bs)
            local.view(-1, D)[slots] = rows
        shards.append(LocalKVCache(r, world_size, local, table, local_lens))
    return shards


def dcp_slot_mapping(block_table: torch.Tensor, req_indices: torch.Tensor,
                     positions: torch.Tensor, block_size: int, world_size: int,
                     rank: int) -> torch.Tensor:
    """Local slots of the tokens ``rank`` owns, ``-1`` (padding: not written) for the others.

    Feed it to ``concat_and_cache_mla`` on the local cache: each new token lands on exactly
    one rank, at local position ``position // W``.
    """
    check_rank(rank, world_size)
    check_index("positions", positions, ndim=1)
    check_nonnegative("positions", positions)
    mine = positions % world_size == rank
    local = slot_mapping_from_block_table(block_table, req_indices[mine],
                                          positions[mine] // world_size, block_size)
    slots = torch.full(positions.shape, -1, dtype=torch.int64, device=positions.device)
    slots[mine] = local
    return slots


# --- decode --------------------------------------------------------------------------------

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
    """Combine the ranks' partial attentions exactly (vLLM's ``cp_lse_ag_out_rs``).

    ``cp_attn_out [T, N, D]`` and ``cp_attn_lse [T, N]`` are this rank's result over its own
    keys, all ``N`` heads. The lse are all-gathered, each rank scales its output by
    ``exp(lse_r - lse)`` and the scaled outputs are reduce-scattered along heads: rank ``r``
    returns ``out [T, N/W, D]`` (heads ``head_slice(N, W, r)``) and, with ``return_lse``,
    ``lse [T, N/W]``. ``±inf`` and NaN in ``cp_attn_lse`` mean "no keys" and weigh 0; a query
    no rank saw gets ``out = 0``, ``lse = -inf``. The scaling and the sum run in float32 (or
    float64), so that adding ``W`` partials costs no extra rounding in bf16.
    """
    check_float("cp_attn_out", cp_attn_out, ndim=3)
    Tq, N, _ = cp_attn_out.shape
    check_float("cp_attn_lse", cp_attn_lse, shape=[Tq, N])
    check_same_device(cp_attn_out=cp_attn_out, cp_attn_lse=cp_attn_lse)
    heads = head_slice(N, comm.world_size, comm.rank)
    work = acc_dtype(cp_attn_out.dtype)
    lses = comm.all_gather(cp_attn_lse.to(work)[None], dim=0)  # [W, T, N]
    lses = torch.where(torch.isinf(lses) | torch.isnan(lses), float("-inf"), lses)
    m = lses.max(dim=0).values
    m_safe = torch.where(torch.isneginf(m), 0.0, m)
    lse = m_safe + torch.log(torch.exp(lses - m_safe).sum(dim=0))  # -inf where no rank saw keys
    mine = lses[comm.rank]
    factor = torch.where(torch.isneginf(mine), 0.0, torch.exp(mine - lse))[..., None]
    # a rank without keys contributes exactly nothing, whatever its output holds
    scaled = torch.where(factor > 0, cp_attn_out.to(work) * factor, 0.0)
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
    """What rank ``comm.rank`` does, given the *global* inputs of ``mla_decode_paged``.

    It keeps its shard of the cache and its heads of ``q`` and runs ``dcp_decode``: the one
    program both backends run (``run_simulated`` here, a process group in ``mla.check.dcp``).
    """
    check_float("q", q, ndim=4)
    heads = head_slice(q.shape[2], comm.world_size, comm.rank)
    shard = shard_kv_cache(kv_cache, block_table, cache_seqlens, comm.world_size,
                           seed=shard_seed)[comm.rank]
    return dcp_decode(q[:, :, heads], shard.kv_cache, shard.block_table, cache_seqlens,
                      softmax_scale, comm, causal=causal, head_dim_v=head_dim_v)


def dcp_decode_simulated(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    world_size: int,
    causal: bool = False,
    head_dim_v: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_decode_paged``'s signature and result, computed by ``world_size`` simulated ranks."""
    check_paged_decode_args(q, kv_cache, block_table, cache_seqlens, softmax_scale, head_dim_v)
    head_slice(q.shape[2], world_size, 0)  # divisibility, before any thread starts
    parts = run_simulated(world_size, functools.partial(
        dcp_decode_rank, q=q, kv_cache=kv_cache, block_table=block_table,
        cache_seqlens=cache_seqlens, softmax_scale=softmax_scale, causal=causal,
        head_dim_v=head_dim_v))
    return (torch.cat([o for o, _ in parts], dim=2), torch.cat([lse for _, lse in parts], dim=1))


# --- prefill context: the chunk plan and reorg_kvcache -------------------------------------

@dataclass(frozen=True)
class DCPChunkPlan:
    """The seed's DCP chunk metadata: a global ``ChunkPlan`` and each rank's share of it.

    ``plan`` is the ordinary plan (its ``cu_seq_lens`` index the rebuilt chunk, its
    ``max_context_chunk`` is vLLM's ``chunk_size``). Per chunk ``c`` and request ``i``,
    every rank gathers ``cp_chunk_seq_lens[c][i]`` local rows from local position
    ``cp_chunk_starts[c][i] = c·MCC/W``; ``cp_cu_seq_lens[c]`` are their prefix sums and
    ``seq_tot[c]`` (vLLM's ``toks``) their sum.
    """

    plan: ChunkPlan
    world_size: int
    cp_chunk_starts: tuple[tuple[int, ...], ...]
    cp_chunk_seq_lens: tuple[tuple[int, ...], ...]
    cp_cu_seq_lens: tuple[tuple[int, ...], ...]

    @classmethod
    def from_plan(cls, plan: ChunkPlan, world_size: int) -> DCPChunkPlan:
        check_positive_int("world_size", world_size)
        mcc = plan.max_context_chunk
        if mcc % world_size:
            raise ValueError(f"the chunk size (max_context_chunk) must be divisible by "
                             f"world_size={world_size}, got {mcc}")
        cp_mcc = mcc // world_size
        cp_context_lens = [-(-n // world_size) for n in plan.context_lens]  # rank 0's share
        starts, lens, cu = [], [], []
        for c in range(plan.num_chunks):
            s = tuple(c * cp_mcc for _ in cp_context_lens)
            n = tuple(max(min(ctx, c * cp_mcc + cp_mcc) - c * cp_mcc, 0)
                      for ctx in cp_context_lens)
            prefix = [0]
            for x in n:
                prefix.append(prefix[-1] + x)
            starts.append(s)
            lens.append(n)
            cu.append(tuple(prefix))
        return cls(plan, world_size, tuple(starts), tuple(lens), tuple(cu))

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
    def cu_seq_lens_lst(self) -> tuple[tuple[int, ...], ...]:
        return self.plan.cu_seq_lens

    @property
    def max_seq_lens(self) -> tuple[int, ...]:
        return self.plan.max_seq_lens

    @property
    def seq_tot(self) -> tuple[int, ...]:
        """Rows each rank gathers per chunk (vLLM's ``toks``)."""
        return tuple(cu[-1] for cu in self.cp_cu_seq_lens)

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
    """The seed's plan (``plan_context_chunks``) and its DCP share; the chunk size must be
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
    """Rebuild one context chunk from the all-gathered local gathers (vLLM's function).

    ``allgatered_*`` hold ``cp_world_size`` blocks of ``toks`` rows, rank-major; inside rank
    ``r``'s block, request ``i``'s ``cp_chunk_seq_lens_lst[i]`` rows follow those of the
    requests before it. The output is request by request, and within a request rank 0's rows,
    then rank 1's, ...; a rank past ``(chunk_len - 1) mod W`` contributes one row less (its
    last, a padding row). ``chunk_len`` is ``min(chunk_size, origin_context_lens[i] -
    chunk_size·chunk_idx)``. Checks, as vLLM's asserts: the output has ``sum_seq_len`` rows
    (the sum of the *global* chunk lengths) and the longest request has ``max_seq_len``;
    they raise ``ValueError`` here. An all-empty chunk gives empty tensors.
    """
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

    index: list[int] = []  # rows of the gathered buffer, in output order
    longest = 0
    first = 0  # request's first row inside every rank's block
    for cp_len, ctx in zip(cp_chunk_seq_lens_lst, origin_context_lens):
        # an empty part keeps chunk_len = chunk_size: every rank then takes its 0 rows
        chunk_len = min(chunk_size, ctx - chunk_size * chunk_idx) if cp_len else chunk_size
        last_full_rank = (chunk_len - 1) % cp_world_size
        taken = 0
        for rank in range(cp_world_size):
            n = cp_len - 1 if (cp_len and rank > last_full_rank) else cp_len
            begin = rank * toks + first
            index.extend(range(begin, begin + n))
            taken += n
        longest = max(longest, taken)
        first += cp_len
    idx = torch.tensor(index, dtype=torch.long, device=allgatered_kv_c_normed.device)
    kv_c = allgatered_kv_c_normed.index_select(0, idx)
    k_pe = allgatered_k_pe.index_select(0, idx)
    if kv_c.shape[0] != sum_seq_len or k_pe.shape[0] != sum_seq_len:
        raise ValueError(f"reorg_kvcache rebuilt {kv_c.shape[0]} rows but sum_seq_len is "
                         f"{sum_seq_len}: the chunk lengths do not match the context lengths")
    if longest != max_seq_len:
        raise ValueError(f"reorg_kvcache rebuilt a longest request of {longest} rows but "
                         f"max_seq_len is {max_seq_len}")
    return kv_c, k_pe


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
    if comm.world_size != plan.world_size:
        raise ValueError(f"plan is for world_size={plan.world_size}, the communicator has "
                         f"{comm.world_size}")
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
    whole by ``dcp_gather_context_chunk`` and merged as in the single-rank path.
    Returns ``o [T, N', V]`` and ``lse [N', T]``.
    """
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
    """Rank ``comm.rank``'s part, given the *global* inputs of ``chunked_prefill_attention``:
    its shard of the context, its heads; returns its heads' ``(o, lse)``."""
    heads = head_slice(q_nope.shape[1], comm.world_size, comm.rank)
    ctx = torch.tensor(plan.origin_context_lens, dtype=torch.int32, device=kv_cache.device)
    shard = shard_kv_cache(kv_cache, block_table, ctx, comm.world_size,
                           seed=shard_seed)[comm.rank]
    return dcp_chunked_prefill_attention(
        q_nope[:, heads], q_pe[:, heads], kv_c, k_pe, query_start_loc, shard.kv_cache,
        shard.block_table, plan, W_UK[:, heads], W_UV[:, heads], softmax_scale, comm)


def dcp_chunked_prefill_simulated(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunked_prefill_attention``'s arguments and result (with a ``DCPChunkPlan``),
    computed by ``plan.world_size`` simulated ranks, each with ``N/W`` heads."""
    head_slice(q_nope.shape[1], plan.world_size, 0)
    parts = run_simulated(plan.world_size, functools.partial(
        dcp_chunked_prefill_rank, q_nope=q_nope, q_pe=q_pe, kv_c=kv_c, k_pe=k_pe,
        query_start_loc=query_start_loc, kv_cache=kv_cache, block_table=block_table,
        plan=plan, W_UK=W_UK, W_UV=W_UV, softmax_scale=softmax_scale))
    return torch.cat([o for o, _ in parts], dim=1), torch.cat([lse for _, lse in parts], dim=0)


# --- model level: hidden states in, hidden states out --------------------------------------

def _own_heads_out(o: torch.Tensor, weights: MLAWeights, comm: Communicator) -> torch.Tensor:
    """``o [..., N/W, V]`` of this rank's heads -> ``[..., H]`` on every rank.

    Under tensor parallelism ``o_proj`` is row-parallel and followed by an all-reduce; here
    the head slices are all-gathered instead and multiplied by the whole ``W_O``, which gives
    every rank the single-rank path's numbers, in the same order of operations.
    """
    o_all = comm.all_gather(o, dim=-2)
    return o_all.flatten(-2) @ weights.W_O


def dcp_decode_forward(weights: MLAWeights, hidden: torch.Tensor, kv_cache: torch.Tensor,
                       block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                       comm: Communicator) -> torch.Tensor:
    """``decode_forward`` on one rank of a DCP group: ``hidden [B, s_q, H] -> [B, s_q, H]``.

    ``kv_cache``/``block_table`` are this rank's local cache; ``cache_seqlens [B]`` the
    *global* number of tokens cached before this step. Every rank runs the front (the latent
    of a new token is needed by its owner only, which writes it), keeps the query of its
    ``N/W`` heads, and runs ``dcp_decode``; all ranks return the same output.
    """
    c = weights.config
    check_float("hidden", hidden, shape=[None, None, c.hidden_size])
    B, s_q, _ = hidden.shape
    check_index("cache_seqlens", cache_seqlens, shape=[B])
    check_index("block_table", block_table, shape=[B, None])
    check_same_device(hidden=hidden, kv_cache=kv_cache, block_table=block_table,
                      cache_seqlens=cache_seqlens)
    heads = head_slice(c.num_heads, comm.world_size, comm.rank)
    dev = hidden.device
    positions = (cache_seqlens.long()[:, None] + torch.arange(s_q, device=dev)).flatten()
    req = torch.arange(B, device=dev).repeat_interleave(s_q)
    f = mla_front(weights, hidden.reshape(B * s_q, -1), positions)
    slots = dcp_slot_mapping(block_table, req, positions, kv_cache.shape[1], comm.world_size,
                             comm.rank)
    concat_and_cache_mla(f.kv_c, f.k_pe, kv_cache, slots)
    ql_nope = absorb_q(f.q_nope[:, heads], weights.W_UK[:, heads])
    q = torch.cat([ql_nope, f.q_pe[:, heads]], dim=-1).view(B, s_q, -1, c.latent_dim)
    o_lat, _ = dcp_decode(q, kv_cache, block_table.to(torch.int32),
                          (cache_seqlens + s_q).to(torch.int32), c.softmax_scale, comm,
                          causal=True, head_dim_v=c.kv_lora_rank)
    o = torch.einsum("bsnl,lnv->bsnv", o_lat, weights.W_UV[:, heads])
    return _own_heads_out(o, weights, comm)


def dcp_chunked_prefill_forward(
    weights: MLAWeights,
    hidden: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: list[int],
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    comm: Communicator,
    plan: DCPChunkPlan | None = None,
    workspace_size: int = 64 * 1024,
) -> torch.Tensor:
    """``chunked_prefill_forward`` on one rank of a DCP group: ``hidden [T, H] -> [T, H]``.

    ``kv_cache``/``block_table`` are this rank's local cache holding its share of the
    context; the new tokens are written by their owners. Without ``plan`` vLLM's plan for
    ``workspace_size`` is used (its chunk size must be divisible by ``W``).
    """
    c = weights.config
    check_float("hidden", hidden, shape=[None, c.hidden_size])
    B = len(context_lens)
    check_index("query_start_loc", query_start_loc, shape=[B + 1])
    check_index("block_table", block_table, shape=[B, None])
    check_same_device(hidden=hidden, kv_cache=kv_cache, block_table=block_table,
                      query_start_loc=query_start_loc)
    if plan is None:
        plan = plan_dcp_context_chunks(context_lens, comm.world_size,
                                       block_size=kv_cache.shape[1],
                                       workspace_size=workspace_size)
    elif list(plan.origin_context_lens) != list(context_lens):
        raise ValueError(f"plan is for context lens {list(plan.origin_context_lens)}, "
                         f"got context_lens {list(context_lens)}")
    heads = head_slice(c.num_heads, comm.world_size, comm.rank)
    qsl = query_start_loc.tolist()
    dev = hidden.device
    req = torch.cat([torch.full((qsl[i + 1] - qsl[i],), i) for i in range(B)]).to(dev)
    positions = torch.cat([torch.arange(context_lens[i], context_lens[i] + qsl[i + 1] - qsl[i])
                           for i in range(B)]).to(dev)
    f = mla_front(weights, hidden, positions)
    slots = dcp_slot_mapping(block_table, req, positions, kv_cache.shape[1], comm.world_size,
                             comm.rank)
    concat_and_cache_mla(f.kv_c, f.k_pe, kv_cache, slots)
    o, _ = dcp_chunked_prefill_attention(f.q_nope[:, heads], f.q_pe[:, heads], f.kv_c, f.k_pe,
                                         query_start_loc, kv_cache, block_table, plan,
                                         weights.W_UK[:, heads], weights.W_UV[:, heads],
                                         c.softmax_scale, comm)
    return _own_heads_out(o, weights, comm)


def dcp_decode_forward_rank(comm: Communicator, weights: MLAWeights, hidden: torch.Tensor,
                            kv_cache: torch.Tensor, block_table: torch.Tensor,
                            cache_seqlens: torch.Tensor, shard_seed: int | None = 0
                            ) -> torch.Tensor:
    """Rank ``comm.rank``'s part given the *global* inputs of ``decode_forward`` (the global
    cache is read, not written: the new tokens go to the shards)."""
    s_q = hidden.shape[1]
    shard = shard_kv_cache(kv_cache, block_table, cache_seqlens, comm.world_size,
                           capacities=(cache_seqlens + s_q).tolist(), seed=shard_seed)
    mine = shard[comm.rank]
    return dcp_decode_forward(weights, hidden, mine.kv_cache, mine.block_table, cache_seqlens,
                              comm)


def dcp_chunked_prefill_forward_rank(comm: Communicator, weights: MLAWeights,
                                     hidden: torch.Tensor, query_start_loc: torch.Tensor,
                                     context_lens: list[int], kv_cache: torch.Tensor,
                                     block_table: torch.Tensor, plan: DCPChunkPlan | None = None,
                                     workspace_size: int = 64 * 1024,
                                     shard_seed: int | None = 0) -> torch.Tensor:
    """Rank ``comm.rank``'s part given the *global* inputs of ``chunked_prefill_forward``."""
    qsl = query_start_loc.tolist()
    caps = [n + qsl[i + 1] - qsl[i] for i, n in enumerate(context_lens)]
    ctx = torch.tensor(list(context_lens), dtype=torch.int32, device=kv_cache.device)
    mine = shard_kv_cache(kv_cache, block_table, ctx, comm.world_size, capacities=caps,
                          seed=shard_seed)[comm.rank]
    return dcp_chunked_prefill_forward(weights, hidden, query_start_loc, context_lens,
                                       mine.kv_cache, mine.block_table, comm, plan=plan,
                                       workspace_size=workspace_size)


def _same_on_all_ranks(outs: list[torch.Tensor]) -> torch.Tensor:
    for r, o in enumerate(outs):
        if not torch.equal(o, outs[0]):
            raise AssertionError(f"rank {r}'s output differs from rank 0's: the all-gathered "
                                 "output must be the same tensor on every rank")
    return outs[0]


def dcp_decode_forward_simulated(weights: MLAWeights, hidden: torch.Tensor,
                                 kv_cache: torch.Tensor, block_table: torch.Tensor,
                                 cache_seqlens: torch.Tensor, world_size: int) -> torch.Tensor:
    """``decode_forward``'s arguments and result, by ``world_size`` simulated ranks.

    The global ``kv_cache`` is sharded and left as it was (the new tokens go to the shards).
    """
    head_slice(weights.config.num_heads, world_size, 0)
    return _same_on_all_ranks(run_simulated(world_size, functools.partial(
        dcp_decode_forward_rank, weights=weights, hidden=hidden, kv_cache=kv_cache,
        block_table=block_table, cache_seqlens=cache_seqlens)))


def dcp_chunked_prefill_forward_simulated(
    weights: MLAWeights,
    hidden: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: list[int],
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    world_size: int,
    plan: DCPChunkPlan | None = None,
    workspace_size: int = 64 * 1024,
) -> torch.Tensor:
    """``chunked_prefill_forward``'s arguments and result, by ``world_size`` simulated ranks."""
    head_slice(weights.config.num_heads, world_size, 0)
    if plan is not None and plan.world_size != world_size:
        raise ValueError(f"plan is for world_size={plan.world_size}, got {world_size}")
    return _same_on_all_ranks(run_simulated(world_size, functools.partial(
        dcp_chunked_prefill_forward_rank, weights=weights, hidden=hidden,
        query_start_loc=query_start_loc, context_lens=context_lens, kv_cache=kv_cache,
        block_table=block_table, plan=plan, workspace_size=workspace_size)))
