"""The DCP log-sum-exp correction in Triton, and ``cp_lse_ag_out_rs`` around it.

Same contract as ``mla.reference.dcp.cp_lse_ag_out_rs`` (conventions §9, derivation (22)):
each rank passes its partial attention over its own keys, ``cp_attn_out [T, N, D]`` and
``cp_attn_lse [T, N]`` (all ``N`` heads), and gets back its ``N/W`` heads of the exact result.

    lses   = all_gather(cp_attn_lse)                           [W, T, N] float32
    lse    = log Σ_r exp(lses[r])                              per (t, n), in the kernel
    scaled = exp(lses[rank] − lse) · cp_attn_out               float32, in the kernel
    out    = reduce_scatter(scaled, heads)                     float32 sum over the ranks

One kernel pass reads the rank's output once and writes the float32 scaled copy, head-major
(``[N, T, D]`` in memory, seen as ``[T, N, D]``) so that a process group's reduce-scatter along
heads splits the buffer's leading dim without a copy. Conventions the kernel keeps, as the
reference does and vLLM's ``correct_attn_out`` does not:

- the sum runs in float32, not in the output dtype (vLLM reduce-scatters bf16 partials: one
  bf16 rounding per rank on top of the final one);
- ``±inf`` means "no keys": that rank weighs exactly 0 and its output is never read (NaN or
  garbage there cannot leak); a query no rank saw gets ``out = 0``, ``lse = -inf``;
- a NaN lse on any rank makes the query's ``out`` and ``lse`` NaN (conventions §13; vLLM reads
  it as "no keys" and drops the rank).

Nothing is read on the host: the correction sits in a CUDA graph with the collectives of a
capturable communicator (``mla.fast.dcp.comm``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.fast.common import check_kernel_input, next_pow2
from mla.fast.dcp.threads import KERNEL_LOCK
from mla.fast.launch import check_grid
from mla.reference.dcp.comm import Communicator
from mla.reference.dcp.sharding import head_slice
from mla.validation import check_float, check_same_device

__all__ = ["correct_attn_out", "cp_lse_ag_out_rs"]


@triton.jit
def _correct_kernel(
    OUT, LSES, SCALED, LSE,
    T, N, D, rank,
    so_t, so_n, so_d, sl_w, sl_t, sl_n,
    W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid ``(cdiv(T·N, BLOCK_R), cdiv(D, BLOCK_D))``: ``BLOCK_R`` rows ``(t, n)`` times
    ``BLOCK_D`` columns. ``SCALED`` is a fresh ``[N, T, D]`` float32 buffer, ``LSE`` ``[T, N]``."""
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # int64: T·N can pass 2^31
    row_ok = rows < tl.cast(T, tl.int64) * N
    t = (rows // N).to(tl.int64)  # int64: T·N·D passes 2^31 at serving sizes
    n = (rows % N).to(tl.int64)

    w = tl.arange(0, BLOCK_W)
    lses = tl.load(LSES + w.to(tl.int64)[:, None] * sl_w + (t * sl_t + n * sl_n)[None, :],
                   mask=(w < W)[:, None] & row_ok[None, :], other=float("-inf"))
    lses = lses.to(tl.float32)
    poisoned = tl.max((lses != lses).to(tl.int32), 0) > 0  # a NaN lse on some rank
    present = (tl.abs(lses) != float("inf")) & (lses == lses)  # ±inf: that rank has no key
    lv = tl.where(present, lses, float("-inf"))
    m = tl.max(lv, 0)
    seen = m != float("-inf")  # some rank saw a key
    m_use = tl.where(seen, m, 0.0)
    total = tl.sum(tl.exp(lv - m_use[None, :]), 0)
    lse = tl.where(seen, m_use + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    lse = tl.where(poisoned, float("nan"), lse)

    mine = tl.load(LSES + tl.cast(rank, tl.int64) * sl_w + t * sl_t + n * sl_n, mask=row_ok,
                   other=float("-inf")).to(tl.float32)
    mine_ok = (tl.abs(mine) != float("inf")) & (mine == mine)
    factor = tl.where(mine_ok, tl.exp(mine - lse), 0.0)  # a NaN lse makes it NaN
    factor = tl.where(poisoned, float("nan"), factor)

    if pid_d == 0:
        tl.store(LSE + t * N + n, lse, mask=row_ok)

    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (cols < D)[None, :]
    # a weight of 0 (no key, or underflow) reads nothing and adds exactly 0; NaN != 0 reads
    used = (factor != 0.0)[:, None]
    x = tl.load(OUT + (t * so_t + n * so_n)[:, None] + cols[None, :] * so_d, mask=mask & used,
                other=0.0)
    y = tl.where(used, x.to(tl.float32) * factor[:, None], 0.0)
    tl.store(SCALED + (n * T + t)[:, None] * D + cols[None, :], y, mask=mask)


def _config(D: int) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_D)``: about 4K elements per program, as ``mla.fast.merge``."""
    block_d = min(next_pow2(max(D, 1)), 512)
    return max(1, 4096 // block_d), block_d


def correct_attn_out(cp_attn_out: torch.Tensor, lses: torch.Tensor, rank: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale this rank's ``cp_attn_out [T, N, D]`` by ``exp(lses[rank] − lse)``.

    ``lses [W, T, N]`` are every rank's lse (the all-gather). Returns ``scaled [T, N, D]``
    float32 (stored head-major: ``scaled.movedim(1, 0)`` is contiguous) and the combined
    ``lse [T, N]`` float32 (``-inf``: no rank saw a key; NaN: a rank's lse was NaN).
    """
    check_float("cp_attn_out", cp_attn_out, ndim=3)
    check_kernel_input(cp_attn_out)
    Tq, N, D = cp_attn_out.shape
    check_float("lses", lses, shape=[None, Tq, N])
    check_same_device(cp_attn_out=cp_attn_out, lses=lses)
    W = lses.shape[0]
    if W == 0 or not 0 <= rank < W:
        raise ValueError(f"rank must lie in [0, {W}) (lses holds {W} ranks), got {rank}")
    block_r, block_d = _config(D)
    # at least one column program: it writes the lse even when D = 0
    grid = (triton.cdiv(Tq * N, block_r), max(1, triton.cdiv(D, block_d)))
    if Tq * N:
        check_grid("correct_attn_out (grid: blocks of T x N rows, blocks of D columns)", grid)
    scaled = torch.empty(N, Tq, D, dtype=torch.float32, device=cp_attn_out.device)
    lse = torch.empty(Tq, N, dtype=torch.float32, device=cp_attn_out.device)
    if Tq * N:
        with KERNEL_LOCK:
            _correct_kernel[grid](
                cp_attn_out, lses, scaled, lse, Tq, N, D, rank,
                *cp_attn_out.stride(), *lses.stride(),
                W=W, BLOCK_W=max(2, next_pow2(W)), BLOCK_R=block_r, BLOCK_D=block_d,
                num_warps=4,
            )
    return scaled.movedim(0, 1), lse


def cp_lse_ag_out_rs(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, comm: Communicator,
                     return_lse: bool = False
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Combine the ranks' partial attentions exactly, (22) (vLLM's ``cp_lse_ag_out_rs``).

    As ``mla.reference.dcp.cp_lse_ag_out_rs``: rank ``r`` returns ``out [T, N/W, D]`` in
    ``cp_attn_out``'s dtype (heads ``head_slice(N, W, r)``) and, with ``return_lse``,
    ``lse [T, N/W]`` float32. Two collectives (the lse all-gather, the float32 reduce-scatter)
    and one correction kernel; no host sync.
    """
    check_float("cp_attn_out", cp_attn_out, ndim=3)
    check_kernel_input(cp_attn_out)
    Tq, N, D = cp_attn_out.shape
    check_float("cp_attn_lse", cp_attn_lse, shape=[Tq, N])
    check_same_device(cp_attn_out=cp_attn_out, cp_attn_lse=cp_attn_lse)
    heads = head_slice(N, comm.world_size, comm.rank)
    lses = comm.all_gather(cp_attn_lse.to(torch.float32)[None], dim=0)  # [W, T, N]
    scaled, lse = correct_attn_out(cp_attn_out, lses, comm.rank)
    summed = comm.reduce_scatter(scaled, dim=1)  # [T, N/W, D] float32
    out = torch.empty(Tq, heads.stop - heads.start, D, dtype=cp_attn_out.dtype,
                      device=cp_attn_out.device)
    out.copy_(summed)  # one pass: the cast and, after a head-major collective, the layout
    if return_lse:
        return out, lse[:, heads].contiguous()
    return out
