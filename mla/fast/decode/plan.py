"""The launch plan of ``mla.fast.decode``'s calls, from shapes alone (no device values, so a call
never synchronizes and can be captured in a CUDA graph), and the split of a request's keys.

Two ways to split a request's keys over ``num_splits`` programs (split-KV):

- equal shares (``split_keys = 0``, the default plans): request ``b``'s ``n`` tiles are cut
  into ``num_splits`` runs of ``ceil(n / num_splits)`` tiles. ``num_splits`` follows the batch
  (more splits where the batch leaves SMs idle), so a request's sums are reduced in another
  order alone than in a crowd: not batch invariant.
- fixed-length splits (``split_keys > 0``, the batch-invariant plans): split ``s`` of a request
  covers its tiles ``[s · p, (s + 1) · p)`` with ``p = max(split_keys / tile,
  ceil(n / num_splits))`` — a function of the request's own length only (``num_splits`` is then
  the most splits one request takes, a constant of the plan, not of the batch). The grid's
  split dimension is ``min(num_splits, ceil(capacity tiles / (split_keys / tile)))``, enough
  for the longest request the block table can hold; programs past a request's end write an
  empty partial (lse ``-inf``), and the combine (``mla.fast.decode.combine``, ``ORDERED``)
  reduces the splits in a sequential loop, where a trailing empty split adds an exact 0. A
  combine always follows (one split too), so a request's bits do not depend on the grid.
  ``p`` grows past ``split_keys`` only for requests over ``num_splits · split_keys`` keys,
  which bounds the partials a request writes (``num_splits · s_q · N · head_dim_v`` floats).
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["BI_MAX_SPLITS", "DecodePlan", "bi_split_keys", "plan_decode", "split_grid"]

# the most splits a request takes under the batch-invariant plans: 16-row programs (memory
# bound: small partials), 64-row programs (2 KB of partial per query row and split)
BI_MAX_SPLITS = {16: 64, 64: 32}


def bi_split_keys(rows: int) -> int:
    """Keys per split of the batch-invariant plans at ``rows = s_q · N`` query rows: 256 at 16
    rows, 512 at 32 (16-row programs; the partials then add about 22% to the key bytes a split
    reads), 1024 over 32 (64-row programs, compute bound: 8 splits at 8192 keys). Not yet
    measured on a GPU (benchmarks/notes/decode.md)."""
    return 256 if rows <= 16 else 512 if rows <= 32 else 1024


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Launch parameters of one decode call, chosen from shapes alone (no device values)."""

    block_m: int  # query rows (s_q · N flattened) per program: the M of the dots
    block_n: int  # keys per tile
    # programs per request along the keys (1: no combine kernel); with ``split_keys``: the
    # most splits one request takes
    num_splits: int
    num_warps: int
    num_stages: int
    use_tma: bool = True  # full page-aligned tiles through tensor descriptors (TMA)
    # 64-row programs on Hopper: the Gluon kernel of ``mla.fast.sm90.decode`` where it applies
    # (it uses its own tiles: 64 × 64, 8 warps, two TMA stages; ``block_n``, ``num_warps``,
    # ``num_stages`` and ``use_tma`` then describe only the Triton fallback)
    sm90: bool = True
    # with ``sm90``: the warp-specialized "seesaw" variant of that kernel
    # (``mla.fast.sm90.decode_seesaw``); ``plan_decode`` takes it for unsplit 16-bit plans
    # and for the batch-invariant 64-row 16-bit plans
    seesaw: bool = False
    # > 0: fixed-length splits of this many keys (a multiple of 64), batch invariant
    # (module docstring); 0: ``num_splits`` equal shares
    split_keys: int = 0

    def __post_init__(self) -> None:
        if self.split_keys < 0 or self.split_keys % 64:
            raise ValueError(f"split_keys must be 0 or a positive multiple of 64, got "
                             f"{self.split_keys}")


def split_grid(plan: DecodePlan, capacity: int, tile: int) -> int:
    """The grid's split dimension of ``plan`` over a block table of ``capacity`` keys in
    ``tile``-key tiles: ``num_splits``, or with fixed-length splits enough of them for the
    longest request the table holds (at most ``num_splits``)."""
    if not plan.split_keys:
        return plan.num_splits
    tiles = -(-capacity // tile)
    return max(1, min(plan.num_splits, -(-tiles // (plan.split_keys // tile))))


def plan_decode(batch: int, s_q: int, num_heads: int, head_dim: int, head_dim_v: int,
                max_blocks: int, block_size: int, dtype: torch.dtype,
                num_sms: int, *, split_kv: bool = True,
                batch_invariant: bool = False) -> DecodePlan:
    """The default plan, from shapes alone (benchmarks/notes/decode.md has the measurements).

    - ``s_q · N <= 32`` rows (memory-bound, e.g. 16 heads): 16-row programs, 4 warps,
      pointer loads (``cp.async``): small enough in registers and shared memory that two
      programs share an SM, and about four programs of work per SM. Faster here than 8 warps
      or TMA tiles (the in-kernel descriptors push the 4-warp kernel into spills).
    - more rows (compute-bound, e.g. 128 heads): 64-row programs, 8 warps, TMA tiles; q and
      two stages of 576-wide key tiles fill the shared memory, one program per SM, so splits
      only to reach one program per SM. Unsplit 16-bit plans (the compute-bound shapes, e.g.
      B = 128 or s_q = 2 at 128 heads) take the seesaw variant of the sm_90 kernel: 478 against
      693 us at B = 128, L = 8192 on the H200 (FlashMLA 505); split plans keep the coupled
      kernel, whose short splits the seesaw variant has not been timed on.
    Splits keep at least 2 tiles each; ``split_kv=False``: none, whatever the batch. The
    block table's capacity (``max_blocks · block_size``) stands in for the lengths: those live
    on the device and reading them would cost a sync.

    ``batch_invariant=True``: the batch-invariant plan (module docstring), the same for a
    request alone and in any batch: fixed-length splits of ``bi_split_keys(s_q · N)`` keys,
    at most ``BI_MAX_SPLITS`` per request, whatever ``batch``, ``max_blocks`` and ``num_sms``;
    64-row 16-bit plans take the seesaw kernel (its splits are checked by ``mla.check``; the
    coupled kernel is a ``seesaw=False`` plan away). Costs against the default, estimated, not
    yet measured on a GPU: at B = 1 fewer splits than the default (8 against 64 at L = 8192,
    128 heads), at large B the partials' traffic (about 22% of the key bytes at 16 rows, 44%
    at 128) where the default does not split.
    """
    rows = s_q * num_heads
    if rows <= 32:
        block_m, num_warps, use_tma, per_sm = 16, 4, False, 4
    else:
        block_m, num_warps, use_tma, per_sm = 64, 8, True, 1
    if dtype == torch.float32:
        # float32 rows are twice as wide: with 64-row programs two stages of 32-key tiles need
        # 295 KB of shared memory on sm_90 (ptxas), over the 227 KB an SM has; 16-key tiles
        # need 221 KB (benchmarks/sm90_compile.py, tests/test_sm90_compile.py)
        block_n = 16 if block_m == 64 else 32
    else:
        block_n = 64
    page_pow2 = block_size & -block_size  # largest power of two dividing the page size
    if block_size % block_n and page_pow2 >= 16:
        block_n = page_pow2  # smaller tiles that stay inside one page (tensor descriptors)
    sixteen = dtype in (torch.bfloat16, torch.float16)
    if batch_invariant:
        return DecodePlan(block_m=block_m, block_n=block_n, num_splits=BI_MAX_SPLITS[block_m],
                          num_warps=num_warps, num_stages=2, use_tma=use_tma,
                          seesaw=block_m == 64 and sixteen, split_keys=bi_split_keys(rows))
    groups = -(-rows // block_m)
    tiles = max(1, -(-(max_blocks * block_size) // block_n))
    base = batch * groups
    target = per_sm * num_sms
    splits = 1
    if base < target and split_kv:
        splits = max(1, min(round(target / base), tiles // 2, 128))
        splits = -(-tiles // -(-tiles // splits))  # no empty trailing splits at capacity
    seesaw = block_m == 64 and splits == 1 and sixteen
    return DecodePlan(block_m=block_m, block_n=block_n, num_splits=splits,
                      num_warps=num_warps, num_stages=2, use_tma=use_tma, seesaw=seesaw)
