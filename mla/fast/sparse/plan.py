"""The launch plan of ``mla.fast.sparse``'s calls, from shapes alone (no device values, so a call
never synchronizes and can be captured in a CUDA graph).

A query's list of tiles (its top-k entries, then the second scope's) is cut over the splits as
``mla.fast.decode.plan`` cuts a request's keys: ``num_splits`` equal shares by default (their
number follows the batch: not batch invariant), or with ``split_entries > 0`` (the
batch-invariant plans) runs of ``p = max(split_entries / tile, ceil(tiles / num_splits))``
tiles, a function of the query's own list lengths (``num_splits`` is then the most splits one
query takes); the grid's split dimension is ``min(num_splits, ceil(max tiles / (split_entries
/ tile)))`` from the index tensors' widths, programs past a query's end write an empty partial,
the combine merges in split order (``ORDERED``), and runs even for one split.
"""

from __future__ import annotations

import dataclasses

import torch

from mla.fast.common import TRITON_VERSION, next_pow2

__all__ = ["BF16_KERNELS", "BI_MAX_SPLITS", "BI_SPLIT_ENTRIES", "DS_MLA_KERNELS",
           "MODEL1_KERNELS",
           "SparsePlan", "plan_sparse", "split_grid"]

# The Gluon kernels a plan may name for 64-head MODEL1 decode (``SparsePlan.model1_kernel``):
# "warp_specialized" (``mla.fast.sm90.sparse_ws``: a producer warp group gathers and
# dequantizes into two K buffers while two consumer groups run the dots) and "staged"
# (``mla.fast.sm90.sparse``, the coupled kernel: cp.async into a staging buffer, dequantized
# by all 8 warps at the top of each tile, then the dots; at B=64 on the H200 1.16-1.36x the
# warp-specialized kernel's time at 64 heads, 1.25-1.43x at 128,
# benchmarks/results/sparse/sparse_v4_ws_2026-12-01.md)
MODEL1_KERNELS = ("warp_specialized", "staged")
# The Gluon kernels a plan may name for 64-head ``fp8_ds_mla`` decode
# (``SparsePlan.ds_mla_kernel``): "warp_specialized" (``mla.fast.sm90.sparse_ws_ds``: a
# producer warp group loads each tile's e4m3 bytes into registers and dequantizes them into
# two K buffers while two consumer groups run the dots; the default: at B=64 N=128 top-k 2048
# on an H100, 116 us against the coupled kernel's 161, CUDA graphs,
# benchmarks/results/sparse/sparse_sweep_2026-12-06.md) and "staged" (the coupled kernel of
# ``mla.fast.sm90.sparse``: cp.async into a staging buffer, dequantized by all 8 warps)
DS_MLA_KERNELS = ("warp_specialized", "staged")
# The Gluon kernels a plan may name for 64-head calls over rows in q's dtype (prefill, bf16/fp16
# decode; rows of 576 or 512) (``SparsePlan.bf16_kernel``): "warp_specialized"
# (``mla.fast.sm90.sparse_ws_bf16``: a producer warp group gathers by cp.async into two K
# buffers while two consumer groups run the dots; the default: on an H100, bf16 decode at B=64
# N=128 top-k 2048 in 97.5 us against the coupled kernel's 118.6, prefill at s_q 4096 s_kv 32K
# N=128 in 5.54 ms against 6.17, CUDA graphs, benchmarks/results/sparse/) and "staged" (the
# coupled kernel of ``mla.fast.sm90.sparse``, whose 8 warps issue a tile's cp.async gathers
# between its dots) and "seesaw_producer" (``mla.fast.sm90.sparse_seesaw``: each warp group owns
# whole tiles, as FlashMLA's sparse prefill, and a third, producer warp group issues the copies;
# the prefill default, 1.03-1.07x FlashMLA's time on an H100, where the same schedule with the
# consumer groups issuing their own copies took 1.14-1.17x,
# benchmarks/results/sparse/seesaw_producer_2026-12-06.json; one scope, a second takes
# "warp_specialized")
BF16_KERNELS = ("warp_specialized", "staged", "seesaw_producer")

# the batch-invariant plans: entries per split (8 tiles of 64: 4 splits at top-k 2048) and the
# most splits a query takes. Not yet measured on a GPU: at B = 1, 4 splits where the default
# takes 16 at 128 heads; at large B each split adds N · 2 KB of partials to write and read
# (1 MB a query at 128 heads, top-k 2048, against 1.3 MB of fp8 rows) where the default does
# not split
BI_SPLIT_ENTRIES = 512
BI_MAX_SPLITS = 16


@dataclasses.dataclass(frozen=True)
class SparsePlan:
    """Launch parameters of one sparse call, chosen from shapes alone (no device values)."""

    block_m: int  # heads per program: the M of the dots
    block_n: int  # top-k entries (gathered rows) per tile
    num_splits: int  # programs per query along its top-k list (1: no combine kernel)
    num_warps: int
    num_stages: int
    # 64-head programs on Hopper: the Gluon kernel of ``mla.fast.sm90.sparse`` where it
    # applies (its own 64-entry tiles and 8 warps; of the other fields it reads the splits,
    # and over MODEL1 pages ``num_stages``: 2 staging buffers, or 1; the rest describe only
    # the Triton fallback)
    sm90: bool = True
    # 64-head MODEL1 decode on Hopper: which Gluon kernel (one of MODEL1_KERNELS)
    model1_kernel: str = "warp_specialized"
    # 64-head fp8_ds_mla decode on Hopper: which Gluon kernel (one of DS_MLA_KERNELS)
    ds_mla_kernel: str = "warp_specialized"
    # 64-head calls over rows in q's dtype on Hopper: which Gluon kernel (one of BF16_KERNELS)
    bf16_kernel: str = "warp_specialized"
    # > 0: fixed-length splits of this many entries (a multiple of 64), batch invariant
    # (module docstring); ``num_splits`` is then the most splits a query takes
    split_entries: int = 0

    def __post_init__(self) -> None:
        if self.model1_kernel not in MODEL1_KERNELS:
            raise ValueError(f"model1_kernel must be one of {MODEL1_KERNELS}, "
                             f"got {self.model1_kernel!r}")
        if self.ds_mla_kernel not in DS_MLA_KERNELS:
            raise ValueError(f"ds_mla_kernel must be one of {DS_MLA_KERNELS}, "
                             f"got {self.ds_mla_kernel!r}")
        if self.bf16_kernel not in BF16_KERNELS:
            raise ValueError(f"bf16_kernel must be one of {BF16_KERNELS}, "
                             f"got {self.bf16_kernel!r}")
        if self.split_entries < 0 or self.split_entries % 64:
            raise ValueError(f"split_entries must be 0 or a positive multiple of 64, got "
                             f"{self.split_entries}")


def split_grid(plan: SparsePlan, tiles: int, tile: int) -> int:
    """The grid's split dimension of ``plan`` for lists of at most ``tiles`` tiles of ``tile``
    entries: ``num_splits``, or with fixed-length splits enough for the longest list (at most
    ``num_splits``)."""
    if not plan.split_entries:
        return plan.num_splits
    return max(1, min(plan.num_splits, -(-tiles // (plan.split_entries // tile))))


def plan_sparse(queries: int, num_heads: int, topk: int, dtype: torch.dtype, fp8: bool,
                num_sms: int, *, model1: bool = False, split: bool = True,
                batch_invariant: bool = False, prefill: bool = False) -> SparsePlan:
    """The default plan from shapes: ``queries`` is ``B · s_q`` (decode) or ``s_q`` (prefill).

    - Heads: one program holds ``min(64, N)`` heads (rounded up to a power of two, at least
      16, the smallest dot); a 64 × 512 float32 accumulator takes half the register file.
    - Tiles of 64 gathered rows, two pipeline stages: the row gathers become ``cp.async``
      copies into shared memory. float32 (a correctness path on a GPU, not a fast one): tiles
      of 16, one stage, else the tiles overflow the 227 KB of shared memory.
    - Warps: 8, except 16-head programs over a 16-bit cache (4): the fewest warps that
      compile without spills (fp8 with 4 warps spills: ``python -m benchmarks.sparse_compile``
      reads it off ptxas without a GPU; benchmarks/notes/sparse.md). So one 64-head program per SM,
      two of the 16-head bf16 ones.
    - MODEL1 (``model1``) under 64 heads: 16-head programs with tiles of 32 (the 8-tile rows
      of 64 gathered rows need 246 KB of shared memory at 16 heads and 262 KB at 32; tiles of
      32 at 16 heads: 131 KB, no spill; 64-head programs go to the Gluon kernel).
    - MODEL1 at 64 heads: the warp-specialized Gluon kernel (``model1_kernel``'s default;
      at B=64 on the H200, N=128, 1.05-1.14x FlashMLA's time where the coupled one takes
      1.52-1.66x: benchmarks/notes/sparse.md, "MODEL1 decode"); one
      stage, for a plan that names the coupled kernel (its single staging buffer, measured
      faster than two).
    - Splits only when the grid is short of the SMs' worth of programs, each split keeping at
      least two tiles of ``topk``; never with ``split=False``.
    - ``batch_invariant=True``: fixed-length splits of ``BI_SPLIT_ENTRIES`` entries, at most
      ``BI_MAX_SPLITS`` per query, whatever ``queries`` and ``num_sms`` (module docstring):
      a query's result is then the same bits alone or in any batch.
    - ``prefill``: the seesaw kernel with its producer warp group over rows in q's dtype
      (``bf16_kernel="seesaw_producer"``; it takes one scope, a second stays
      warp-specialized): on an H100 the V3.2 and V4 prefill shapes of
      ``benchmarks.sparse_peers`` in 1.03-1.07x FlashMLA's time, against 1.14-1.17x without
      the producer group and 1.29-1.39x warp-specialized (benchmarks/notes/sparse.md, "the
      seesaw sparse kernel").
    """
    block_m = min(64, max(16, next_pow2(num_heads)))
    if model1 and block_m < 64:
        block_m = 16
    # 4 warps compile without spills under Triton 3.6 (239-248 registers, sm_90 ptxas); 3.7
    # spills 224-272 bytes there, so 8 warps (175 registers) under it
    four = block_m == 16 and not fp8 and TRITON_VERSION < (3, 7)
    num_warps, per_sm = (4, 2) if four else (8, 1)
    block_n, num_stages = (16, 1) if dtype == torch.float32 else (64, 2)
    if model1 and block_m < 64 and dtype != torch.float32:
        block_n = 32
    if model1 and block_m == 64:
        # the Gluon kernel's one staging buffer: measured faster than two (copies two tiles
        # ahead) at all eight B=64 shapes on the H200 (benchmarks/notes/sparse.md)
        num_stages = 1
    if dtype == torch.float32:
        num_warps = 8
    bf16_kernel = "seesaw_producer" if prefill else "warp_specialized"
    if batch_invariant:
        return SparsePlan(block_m=block_m, block_n=block_n, num_splits=BI_MAX_SPLITS,
                          num_warps=num_warps, num_stages=num_stages,
                          split_entries=BI_SPLIT_ENTRIES, bf16_kernel=bf16_kernel)
    groups = -(-num_heads // block_m)
    tiles = max(1, -(-topk // block_n))
    base = max(1, queries * groups)
    target = per_sm * num_sms
    splits = 1
    if base < target and split:
        splits = max(1, min(round(target / base), tiles // 2, 64))
        splits = -(-tiles // -(-tiles // splits))  # no empty trailing splits at full topk
    return SparsePlan(block_m=block_m, block_n=block_n, num_splits=splits,
                      num_warps=num_warps, num_stages=num_stages, bf16_kernel=bf16_kernel)
