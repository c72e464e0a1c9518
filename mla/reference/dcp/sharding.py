"""DCP sharding: which rank holds which token, and each rank's local paged cache.

conventions §9, papers/derivation.md (21). Placement is *interleaved*: the token at position
``t`` of a request lives on rank ``t mod W`` at local position ``t // W``, so rank ``r`` of a
request of length ``L`` holds

    n_r = L // W + (r < L mod W)                 (= ceil((L - r) / W))            (21)

tokens (vLLM 0.11 ``v1/attention/backends/mla/common.py``, the DCP branch of the metadata
builder). Before vllm-project/vllm#27518, vLLM's decode ``seq_lens`` update wrote
``L // W + (r <= (L - 1) mod W)``, which is the same for ``L mod W != 0`` but gives every rank
one token too many when ``W`` divides ``L``. This module follows the fix.

Under tensor parallelism rank ``r`` also keeps ``N/W`` contiguous query heads,
``head_slice(N, W, r)``: the heads its reduce-scatter leaves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mla.reference.dcp.comm import check_rank
from mla.reference.paged_cache import cache_rows, make_block_table, slot_mapping_from_block_table
from mla.validation import (
    check_float,
    check_index,
    check_nonnegative,
    check_positive_int,
    check_same_device,
)

__all__ = ["dcp_local_seq_lens", "head_slice", "DCPSharding", "LocalKVCache", "shard_kv_cache",
           "dcp_slot_mapping"]


def dcp_local_seq_lens(seq_lens: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Tokens of each request held by ``rank``: ``L // W + (rank < L mod W)``, (21).

    The positions ``t < L`` with ``t mod W = rank``. vLLM's expression before
    vllm-project/vllm#27518, ``L // W + (rank <= (L - 1) mod W)``, agrees except when ``W``
    divides ``L`` (``L >= 1``), where it counts one token too many on every rank.
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
