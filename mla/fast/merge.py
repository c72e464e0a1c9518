"""``merge_attn_states`` in Triton: one pass over both partial outputs, bandwidth-bound.

Same contract as ``mla.reference.merge`` (conventions §6):

    m   = max(lse_p, lse_s);   w_p = exp(lse_p - m);   w_s = exp(lse_s - m)
    lse = m + log(w_p + w_s)
    o   = (w_p · o_p + w_s · o_s) / (w_p + w_s)

``o [T, N, D]`` (any strides, any ``D``), ``lse [N, T]``. ``±inf`` means "no keys"; one side
empty passes the other through bit for bit (its ``o`` is never read, so garbage there cannot
leak in); both empty gives ``o = 0``, ``lse = -inf``. A NaN ``lse`` is not empty: merged with
a present side it gives NaN ``o`` and ``lse`` (conventions §13).

One program merges ``BLOCK_R`` rows ``(t, n)`` times ``BLOCK_D`` columns. The weights are
per row (a few bytes beside a ``D``-wide row), so the kernel reads ``2·T·N·D`` elements and
writes ``T·N·D``: the copy-bandwidth floor is ``3·T·N·D·itemsize`` bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.fast.launch import check_grid
from mla.validation import check_float, check_same_device, check_same_dtype

__all__ = ["merge_attn_states"]


@triton.jit
def _merge_kernel(
    o_p, lse_p, o_s, lse_s, out, out_lse,
    T, N, D,
    sp_t, sp_n, sp_d, ss_t, ss_n, ss_d, so_t, so_n,
    lp_n, lp_t, ls_n, ls_t,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    # int64: T·N·D passes 2^31 elements at serving sizes, and T·N itself can
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < tl.cast(T, tl.int64) * N
    t = (rows // N).to(tl.int64)
    n = (rows % N).to(tl.int64)

    lp = tl.load(lse_p + n * lp_n + t * lp_t, mask=row_ok, other=float("-inf")).to(ACC)
    ls = tl.load(lse_s + n * ls_n + t * ls_t, mask=row_ok, other=float("-inf")).to(ACC)
    # +inf and -inf both mean "this side saw no keys"; a NaN lse is no such marker: the side
    # counts as present and the NaN reaches o and lse (conventions §13)
    p_ok = tl.abs(lp) != float("inf")
    s_ok = tl.abs(ls) != float("inf")
    any_ok = p_ok | s_ok
    m = tl.maximum(tl.where(p_ok, lp, float("-inf")), tl.where(s_ok, ls, float("-inf")))
    m = tl.where(any_ok, m, 0.0)
    w_p = tl.where(p_ok, tl.exp(lp - m), 0.0)
    w_s = tl.where(s_ok, tl.exp(ls - m), 0.0)
    w_sum = tl.where(any_ok, w_p + w_s, 1.0)
    c_p = w_p / w_sum
    c_s = w_s / w_sum
    only_p = p_ok & ~s_ok
    only_s = s_ok & ~p_ok

    if pid_d == 0:
        lse = tl.where(any_ok, m + tl.log(w_sum), float("-inf"))
        lse = tl.where(only_p, lp, tl.where(only_s, ls, lse))
        # out_lse is a fresh contiguous [N, T]
        tl.store(out_lse + n * T + t, lse.to(out_lse.dtype.element_ty), mask=row_ok)

    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (cols < D)[None, :]
    # an empty side is not read at all: it costs no bandwidth and its garbage cannot leak
    xp = tl.load(o_p + (t * sp_t + n * sp_n)[:, None] + cols[None, :] * sp_d,
                 mask=mask & p_ok[:, None], other=0.0)
    xs = tl.load(o_s + (t * ss_t + n * ss_n)[:, None] + cols[None, :] * ss_d,
                 mask=mask & s_ok[:, None], other=0.0)
    c_p2 = c_p[:, None]
    c_s2 = c_s[:, None]
    # a weight that underflowed to 0 adds nothing (not 0 · inf); a NaN weight adds NaN
    merged = (tl.where(c_p2 != 0, xp.to(ACC) * c_p2, 0.0)
              + tl.where(c_s2 != 0, xs.to(ACC) * c_s2, 0.0)).to(xp.dtype)
    merged = tl.where(only_p[:, None], xp, tl.where(only_s[:, None], xs, merged))
    tl.store(out + (t * so_t + n * so_n)[:, None] + cols[None, :], merged, mask=mask)


def _config(D: int, itemsize: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_D, num_warps)``: about 8 KB of each input per program.

    Measured on the H200 (benchmarks/results/prefill/prefill_routes.md, merge table).
    """
    block_d = min(triton.next_power_of_2(max(D, 1)), 512)
    block_r = max(1, 4096 // (block_d * max(itemsize, 2) // 2))
    return block_r, block_d, 4


def _launch(prefix_output: torch.Tensor, prefix_lse: torch.Tensor, suffix_output: torch.Tensor,
            suffix_lse: torch.Tensor, block_r: int, block_d: int, num_warps: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    T, N, D = prefix_output.shape
    grid = (triton.cdiv(T * N, block_r), max(triton.cdiv(D, block_d), 1))
    if T * N:
        check_grid("merge_attn_states (grid: blocks of T x N rows, blocks of D columns)", grid)
    out = torch.empty((T, N, D), dtype=prefix_output.dtype, device=prefix_output.device)
    out_lse = torch.empty((N, T), dtype=prefix_lse.dtype, device=prefix_lse.device)
    if T * N == 0:
        return out, out_lse
    acc = tl.float64 if prefix_output.dtype == torch.float64 else tl.float32
    _merge_kernel[grid](
        prefix_output, prefix_lse, suffix_output, suffix_lse, out, out_lse,
        T, N, D,
        *prefix_output.stride(), *suffix_output.stride(), out.stride(0), out.stride(1),
        *prefix_lse.stride(), *suffix_lse.stride(),
        BLOCK_R=block_r, BLOCK_D=block_d, ACC=acc, num_warps=num_warps,
    )
    return out, out_lse


def merge_attn_states(
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o_p [T,N,D], lse_p [N,T])`` and ``(o_s, lse_s)`` -> ``(output, output_lse)``.

    As the reference; both outputs must share one dtype, and both lses (the reference would
    promote a mixed pair silently). Reads no device values: safe inside a CUDA graph.
    """
    check_float("prefix_output", prefix_output, ndim=3)
    T, N, _ = prefix_output.shape
    check_float("prefix_lse", prefix_lse, shape=[N, T])
    check_float("suffix_output", suffix_output, shape=list(prefix_output.shape))
    check_float("suffix_lse", suffix_lse, shape=[N, T])
    check_same_dtype(prefix_output=prefix_output, suffix_output=suffix_output)
    check_same_dtype(prefix_lse=prefix_lse, suffix_lse=suffix_lse)
    check_same_device(prefix_output=prefix_output, prefix_lse=prefix_lse,
                      suffix_output=suffix_output, suffix_lse=suffix_lse)
    block_r, block_d, num_warps = _config(prefix_output.shape[2], prefix_output.element_size())
    return _launch(prefix_output, prefix_lse, suffix_output, suffix_lse, block_r, block_d,
                   num_warps)
