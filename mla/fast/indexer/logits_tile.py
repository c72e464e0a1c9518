"""What both indexer logits kernels share: the plan (``LogitsPlan``), the tile they compute
(``tile_logits``), and how they split a row's keys over programs.

A tile holds ``BLOCK_N`` keys ``[BLOCK_N, 128]`` (e4m3) and the queries that share them, their
heads stacked into one operand ``[128, Q·HP]`` (``HP``: the heads padded to a power of two
>= 16 with zero rows and zero weights). One e4m3 x e4m3 -> float32 ``tl.dot`` gives every
(key, query, head) dot at once, keys as the MMA's M so that the sum over heads runs along its
N, within a thread and a few lanes (the transposed product would sum across warps). ReLU, the
weights, the sum over heads and the key's scale follow in float32 registers.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from mla.fast.common import num_sms

__all__ = ["LogitsPlan", "PAGED_LOADS", "PREFILL_KERNELS", "SPLITS", "split_keys", "split_waves",
           "tile_logits"]

# how the paged kernel reads a tile of keys, fastest first (``LogitsPlan.paged_loads``)
PAGED_LOADS = ("tma", "tma_host", "page", "gather")
# how the paged kernel splits a row's keys over programs (``LogitsPlan.split``)
SPLITS = ("spread", "waves")
# which kernel the ragged prefill logits run (``LogitsPlan.prefill_kernel``)
PREFILL_KERNELS = ("gluon", "triton")


def _pow2(v: object, low: int) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and v >= low and not v & (v - 1)


@dataclasses.dataclass(frozen=True)
class LogitsPlan:
    """How the logits kernels tile: ``block_n`` keys a tile (the MMA's M), ``queries`` rows a
    program at prefill (their heads stacked on N: ``queries · 64 <= 256`` for one wgmma),
    ``num_warps``, and ``stages``, the key tiles in flight (software pipelining of the loads).

    The paged (decode) kernel only: ``paged_loads``, how a tile of keys is read where the cache
    allows it (``"tma"``: one tensor-descriptor copy of a page's codes and one of its scales,
    the descriptors built by each program; ``"tma_host"``: the same copies through
    descriptors the host builds and passes; ``"page"``: pointer loads from one page;
    ``"gather"``: a block-table lookup per key, any page size; the TMA routes fall back to
    ``"page"``, and that to ``"gather"``, where the page size or the layout forbids them);
    ``max_tiles``, the most tiles a program covers, and ``programs_per_sm``, how many programs
    the split of a row's keys aims at per SM (fewer requests: more, shorter programs).
    ``split`` (the paged kernel only; the ragged one always spreads): ``"spread"`` splits as
    ``split_keys``; ``"waves"`` as ``split_waves``, for the programs a SM holds of the kernel
    as compiled (``programs_per_sm`` stands for that count under the interpreter).

    The ragged (prefill) kernel only: ``prefill_kernel``, ``"gluon"`` (``mla.fast.sm90.logits``
    on a Hopper GPU where it takes the call, with its own tiling: two queries and 64 keys a
    tile, four stages, programs for four a SM, at most ``max_tiles`` tiles each; the Triton
    kernel elsewhere) or ``"triton"`` (always the Triton kernel).
    ``benchmarks/indexer.py --sweep`` and ``benchmarks/indexer_logits.py`` (the paged routes)
    time the alternatives."""
    block_n: int = 64
    queries: int = 4
    num_warps: int = 4
    stages: int = 4
    paged_loads: str = "tma"
    max_tiles: int = 16
    programs_per_sm: int = 4
    split: str = "spread"
    prefill_kernel: str = "gluon"

    def __post_init__(self) -> None:
        for name, low in (("block_n", 16), ("queries", 1), ("num_warps", 1), ("max_tiles", 1)):
            v = getattr(self, name)
            if not _pow2(v, low):
                raise ValueError(f"LogitsPlan.{name} must be a power of two >= {low}, got {v!r}")
        for name in ("stages", "programs_per_sm"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"LogitsPlan.{name} must be an int >= 1, got {v!r}")
        if self.paged_loads not in PAGED_LOADS:
            raise ValueError(f"LogitsPlan.paged_loads must be one of {PAGED_LOADS}, got "
                             f"{self.paged_loads!r}")
        if self.prefill_kernel not in PREFILL_KERNELS:
            raise ValueError(f"LogitsPlan.prefill_kernel must be one of {PREFILL_KERNELS}, got "
                             f"{self.prefill_kernel!r}")
        if self.split not in SPLITS:
            raise ValueError(f"LogitsPlan.split must be one of {SPLITS}, got {self.split!r}")


def split_keys(keys: int, programs_other: int, block_n: int, device: torch.device,
               programs_per_sm: int, max_tiles: int) -> tuple[int, int]:
    """(tiles per program, at most ``max_tiles``; programs along the keys): enough programs
    for ``programs_per_sm`` a SM across the ``programs_other`` rows, each as long as that
    allows."""
    tiles = max(1, triton.cdiv(keys, block_n))
    want = max(1, triton.cdiv(programs_per_sm * num_sms(device), max(1, programs_other)))
    per = max(1, min(max_tiles, triton.cdiv(tiles, want)))
    return per, triton.cdiv(tiles, per)


# a program's fixed cost (its queries and weights, the pipeline's fill and drain) in tiles of
# streaming: B = 128, L = 128K, next_n = 1 took 1.07x / 1.30x the time of 16-tile programs
# with 8 / 4 tiles a program (H200), which (t + c) / t fits at c ~ 1.7
PROGRAM_COST_TILES = 2


@functools.lru_cache(maxsize=256)
def split_waves(keys: int, rows: int, block_n: int, slots: int, max_tiles: int
                ) -> tuple[int, int]:
    """(tiles per program, at most ``max_tiles``; programs along the keys) for ``rows`` rows
    of ``keys`` keys when the GPU holds ``slots`` programs at once: the split whose programs
    run in the fewest whole waves of ``slots``, each wave as long as its programs' tiles plus
    ``PROGRAM_COST_TILES`` (ties: the longer programs). Where the programs run in one wave
    (few rows) it gives the most, shortest programs that fit it, so that a single request is
    spread over every SM; where a batch needs many waves, programs as long as whole waves
    allow (B = 32, L = 32K: 640 programs of 26 tiles, one wave of 5 a SM, where the spread
    split's 1024 of 16 made 1.55)."""
    tiles = max(1, triton.cdiv(keys, block_n))
    best = (float("inf"), 1)
    for per in range(1, min(max_tiles, tiles) + 1):
        waves = triton.cdiv(rows * triton.cdiv(tiles, per), slots)
        best = min(best, (waves * (per + PROGRAM_COST_TILES), -per))
    per = -best[1]
    return per, triton.cdiv(tiles, per)


@triton.jit
def _nan_rows(x, axis: tl.constexpr):
    """Whether each row (``axis=1``) or column (``axis=0``) of e4m3 ``x`` holds a NaN code."""
    b = x.to(tl.uint8, bitcast=True) & 0x7F
    return tl.max((b == 0x7F).to(tl.int32), axis=axis) > 0


@triton.jit
def tile_logits(codes, k_scale, q_t, w, Q: tl.constexpr, HP: tl.constexpr,
                BLOCK_N: tl.constexpr, NAN_CODES: tl.constexpr):
    """``codes [BLOCK_N, D]`` e4m3, ``k_scale [BLOCK_N]``, ``q_t [D, Q·HP]`` e4m3, ``w [Q·HP]``
    -> ``[BLOCK_N, Q]`` float32. ``NAN_CODES``: carry NaN codes through the scale and the
    weights, for the interpreter, whose e4m3 conversion reads ``0x7F`` as 480."""
    if NAN_CODES:
        k_scale = tl.where(_nan_rows(codes, 1), float("nan"), k_scale)
        w = tl.where(_nan_rows(q_t, 0), float("nan"), w)
    dots = tl.dot(codes, q_t)  # [BLOCK_N, Q·HP], float32
    s = tl.maximum(dots, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :]  # NaN stays
    s = tl.sum(tl.reshape(s, (BLOCK_N, Q, HP)), axis=2)
    return s * k_scale[:, None]
