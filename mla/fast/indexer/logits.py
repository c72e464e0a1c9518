"""The lightning indexer's logits in Triton: ``fp8_mqa_logits`` (ragged prefill, here) and
``fp8_paged_mqa_logits`` (paged decode, ``next_n >= 1`` causal: ``logits_paged``).

Same contract as ``mla.reference.indexer_logits`` (conventions §10, "Indexer logits and
top-k"): ``logits[t, s] = k_scale[s] · Σ_h w[t, h] · ReLU(q[t, h] · k_code[s])`` with ``q`` in
e4m3 (its scale folded into ``w``), ``-inf`` where query ``t`` may not see key ``s``; float32.
The argument checks are the reference's own (``check_ragged_logits_args``,
``check_paged_logits_args``) plus the layouts the kernels address.

**One tile** (``logits_tile``): ``BLOCK_N`` keys against the heads of the queries that
share them (``next_n`` of one request at decode, ``BLOCK_Q`` consecutive rows at prefill), one
e4m3 ``tl.dot`` with the keys as the MMA's M, then ReLU, the weights, the sum over heads and
the key's scale in float32 registers. ``LogitsPlan`` sets the sizes.

**Accumulation.** On sm_90 the dot is one wgmma chain over ``d = 128`` in the FP8 tensor
cores' own accumulator (Triton's default for fp8: no promotion to float32 within ``d``), which
keeps about 13 mantissa bits and truncates; the interpreter multiplies in float32. The error
budgets of the two (``logits_budget``, in ``mla.compare.logits_err``'s measure) and their
derivation: conventions §11.

At prefill a program covers ``TILES`` consecutive tiles of keys: those holding keys its
queries see run in a software-pipelined loop (the next tile's loads in flight during this
one's dot), the others are written ``-inf`` without reading the cache (and a program none of
whose tiles holds such keys loads no queries either).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from mla.compare import fp8_mma_logits_budget
from mla.fast import sm90
from mla.fast.common import (
    TRITON_VERSION,
    ensure_allocator,
    interpreting,
    next_pow2,
    should_validate,
)
from mla.fast.indexer.logits_paged import PAGED_PLAN, fp8_paged_mqa_logits
from mla.fast.indexer.logits_tile import LogitsPlan, split_keys, tile_logits
from mla.fast.launch import check_grid
from mla.reference.indexer_cache import INDEX_DIM
from mla.reference.indexer_logits import (
    check_max_seqlen_k,
    check_ragged_logits_args,
    check_ragged_logits_ranges,
)

__all__ = ["LogitsPlan", "PAGED_PLAN", "RAGGED_COMPRESSED_PLAN", "RAGGED_PLAN", "fp8_mqa_logits",
           "fp8_paged_mqa_logits", "logits_budget"]

U32 = 2.0 ** -24

# the ragged kernel's default: 4 warps fit 255 registers under Triton 3.6 (sm_90 ptxas; the
# H200 measurements), 3.7's allocator spills 8 bytes there, 8 warps take 166 registers; two
# stages, and programs for twice the SMs of at most 16 tiles each
RAGGED_PLAN = LogitsPlan(num_warps=4 if TRITON_VERSION < (3, 7) else 8, stages=2,
                         programs_per_sm=2, max_tiles=16)
# compressed rows (``max_seqlen_k``): two queries a program (at four, 3.6's sm_90 build at 4
# warps spills 16 bytes: each key's place in its row is one more value a key and query), at
# most 32 tiles of 64 keys each: on an H100 the Gluon kernel took 1.06-1.18x DeepGEMM's time
# on the five ragged shapes of benchmarks.indexer_peers, against 1.10-1.34x at 16 tiles and
# 1.03-1.12x at 64 (slower than 32 at 2048 queries over 64K keys) in the same run
# (benchmarks/results/indexer/indexer_peers_tiles_2026-12-06.md)
RAGGED_COMPRESSED_PLAN = dataclasses.replace(RAGGED_PLAN, queries=2, max_tiles=32)


# Under the interpreter the dot is a float32 matmul of exact products: in logits_err's measure
# 124 cases (heads 3, 5, 64 and 128, paged next_n 1-3 and ragged) reach 1.05·2^-24, the budget
# is twice that.
INTERPRETED_BUDGET = 2 * U32


def logits_budget(device: torch.device | str, heads: int = 64) -> float:
    """The budget of these kernels' logits over ``heads`` heads (DeepSeek-V3.2's 64 by
    default) in ``mla.compare.logits_err``'s measure (the error against the float64 reference
    over the magnitude ``k_scale · Σ_h |w_h| · ReLU(q_h · k)``): the FP8 MMA's
    (``fp8_mma_logits_budget``) compiled on a GPU, float32 roundings (``INTERPRETED_BUDGET``)
    under the interpreter; within the catalogue's limits in each setting."""
    if torch.device(device).type == "cuda" and not interpreting():
        return fp8_mma_logits_budget(heads)
    return INTERPRETED_BUDGET


@triton.jit
def _seen_written(cols, lo, hi, span, N, q_ok, COMPRESSED: tl.constexpr):
    """``[BLOCK_N, BLOCK_Q]``: where query ``t`` sees key ``cols`` (``[lo[t], hi[t])``) and
    where the key has a column in ``t``'s row: every key of a live query, or (``COMPRESSED``)
    keys ``[lo[t], lo[t] + span)``; compressed, ``hi`` is the count seen (``max(ke - ks,
    0)``), it and ``span`` uint32, ``lo`` int32, and both are one unsigned compare of the key's
    place after ``lo[t]`` (keys < 2^30)."""
    if COMPRESSED:
        at = (cols.to(tl.int32)[:, None] - lo[None, :]).to(tl.uint32)
        seen = at < hi[None, :]
        written = at < span
    else:
        seen = (cols[:, None] >= lo[None, :]) & (cols[:, None] < hi[None, :])
        written = (cols < N)[:, None] & q_ok[None, :]
    return seen, written


# M not specialized: Triton makes an integer argument equal to 1 a constant, which has no .to
# (rows compressed to one column failed to compile)
@triton.jit(do_not_specialize=["M"])
def _ragged_kernel(
    q, w, codes_f8, k_scale_ptr, ks, ke, out,
    S, H, N, M, chunk, splits,
    s_q_t, s_q_h, s_w_t, s_c_n,
    BLOCK_Q: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES: tl.constexpr, NAN_CODES: tl.constexpr, STAGES: tl.constexpr,
    COMPRESSED: tl.constexpr,
):
    """Programs ``(query tile, key chunk)``: rows of ``M`` columns, key ``n`` of query ``t`` at
    column ``n`` (``M = N``: ``chunk`` keys from ``chunk`` times the program's second index)
    or, ``COMPRESSED``, at ``n - ks[t]`` (only keys ``[ks[t], ks[t] + M)``: a tile's queries
    share a start unless the tile crosses requests, so the second index is a query slot of
    the tile and one of ``splits`` chunks of ``M`` keys from that query's start, for the
    queries of that start; the slots whose start an earlier slot has return at once, and the
    columns whose key would lie past the last are written ``-inf`` as any other)."""
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_Q
    tq = t0 + tl.arange(0, BLOCK_Q)
    q_ok = tq < S
    if COMPRESSED:
        # int32 (fewer registers); a row this program does not write starts 2^30 keys before
        # 0, so that no key of it is seen or written (``_seen_written``)
        lo = tl.load(ks + tq, mask=q_ok, other=-(1 << 30))
        hi = tl.load(ke + tq, mask=q_ok, other=-(1 << 30))
        slot = tl.program_id(1) // splits
        in_tile = tl.arange(0, BLOCK_Q)
        lead = tl.sum(tl.where(in_tile == slot, lo, 0), axis=0)
        taken = tl.sum(((in_tile < slot) & (lo == lead) & q_ok).to(tl.int32), axis=0)
        if (t0 + slot >= S) | (taken > 0):
            return
        q_ok = q_ok & (lo == lead)
        lo = tl.where(q_ok, lo, -(1 << 30))
        hi = tl.where(q_ok, hi, -(1 << 30))
        col0 = lead.to(tl.int64) + (tl.program_id(1) % splits).to(tl.int64) * chunk
    else:
        lo = tl.load(ks + tq, mask=q_ok, other=0).to(tl.int64)
        hi = tl.load(ke + tq, mask=q_ok, other=0).to(tl.int64)
        col0 = tl.program_id(1).to(tl.int64) * chunk
    lo_any = tl.min(tl.where(q_ok, lo, N), axis=0)
    hi_any = tl.max(tl.where(q_ok, hi, 0), axis=0)
    out_rows = out + tq * M
    if COMPRESSED:
        # key n of query t at column n - ks[t], for the keys [ks[t], ks[t] + M) (-inf past N)
        write_at = out_rows - lo
        span = M.to(tl.uint32)
        vis = tl.maximum(hi - lo, 0).to(tl.uint32)
    else:
        write_at = out_rows
        span = hi  # (unused)
        vis = hi
    # the tiles that hold keys some query sees (pipelined), -inf on either side of them; a
    # chunk with none (past the queries' positions, or outside their request) writes -inf
    # without loading the queries
    first = tl.minimum(tl.maximum(lo_any - col0, 0) // BLOCK_N, TILES)
    last = tl.maximum(tl.minimum(tl.cdiv(tl.maximum(hi_any - col0, 0), BLOCK_N), TILES), first)
    if last > first:
        r = tl.arange(0, BLOCK_Q * HP)
        t = t0 + r // HP
        h = r % HP
        row_ok = (t < S) & (h < H)
        d = tl.arange(0, D)
        q_rows = tl.load(q + t[:, None] * s_q_t + h[:, None] * s_q_h + d[None, :],
                         mask=row_ok[:, None], other=0.0)
        q_t = tl.trans(q_rows)
        w_r = tl.load(w + t * s_w_t + h, mask=row_ok, other=0.0).to(tl.float32)
        for i in tl.range(first, last, num_stages=STAGES):
            cols = col0 + i * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = (cols >= lo_any) & (cols < hi_any)
            codes = tl.load(codes_f8 + cols[:, None] * s_c_n + d[None, :], mask=ok[:, None],
                            other=0.0)
            k_scale = tl.load(k_scale_ptr + cols, mask=ok, other=float("nan"))
            s = tile_logits(codes, k_scale, q_t, w_r, BLOCK_Q, HP, BLOCK_N, NAN_CODES)
            seen, written = _seen_written(cols, lo, vis, span, N, q_ok, COMPRESSED)
            s = tl.where(seen, s, float("-inf"))
            tl.store(write_at[None, :] + cols[:, None], s, mask=written)
    for i in range(0, TILES):
        if (i < first) | (i >= last):
            cols = col0 + i * BLOCK_N + tl.arange(0, BLOCK_N)
            _seen, written = _seen_written(cols, lo, vis, span, N, q_ok, COMPRESSED)
            tl.store(write_at[None, :] + cols[:, None],
                     tl.full((BLOCK_N, BLOCK_Q), float("-inf"), tl.float32), mask=written)


def _gluon(q: torch.Tensor, codes: torch.Tensor, weights: torch.Tensor, scale: torch.Tensor,
           ks: torch.Tensor, ke: torch.Tensor, out: torch.Tensor, max_seqlen_k: int,
           max_tiles: int) -> bool:
    """The call on ``mla.fast.sm90.logits``'s kernel where it takes it (``out`` written);
    False where it does not, or where this Triton cannot build it (the Triton kernel then
    runs: ``mla.fast.sm90.launch``)."""
    if q.device.type != "cuda" or interpreting() or not sm90.usable("ragged_logits_kernel"):
        return False
    from mla.fast.sm90 import logits as sm90_logits

    if not sm90_logits.supported(q, codes):
        return False
    S, N, M = q.shape[0], codes.shape[0], out.shape[1]
    rows = triton.cdiv(S, sm90_logits.QUERIES)
    tiles, splits = split_keys(M, rows, sm90_logits.BLOCK_N, q.device,
                               sm90_logits.PROGRAMS_PER_SM, max_tiles)
    grid = (rows, splits * (sm90_logits.QUERIES if max_seqlen_k else 1))
    ensure_allocator()
    return sm90.launch(
        sm90_logits.ragged_logits_kernel, grid, q, weights, codes.view(torch.float8_e4m3fn),
        scale, ks, ke, out, S, N, M, tiles * sm90_logits.BLOCK_N, splits, tiles, q.stride(0),
        q.stride(1), weights.stride(0), codes.stride(0),
        STAGES=sm90_logits.STAGES, COMPRESSED=max_seqlen_k > 0,
        num_warps=sm90_logits.NUM_WARPS)


def fp8_mqa_logits(q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                   weights: torch.Tensor, cu_seqlen_ks: torch.Tensor,
                   cu_seqlen_ke: torch.Tensor, max_seqlen_k: int = 0, *,
                   validate: bool | None = None, plan: LogitsPlan | None = None
                   ) -> torch.Tensor:
    """Ragged prefill logits float32 ``[S, N]``, as the reference: ``q [S, H, 128]`` e4m3,
    ``kv = (k_codes [N, 128] e4m3, k_scale [N] float32)``, ``weights [S, H]``; query ``t``
    sees ``[ks[t], ke[t])``. ``max_seqlen_k > 0``: rows compressed to ``[S, max_seqlen_k]``
    (column ``j``: key ``ks[t] + j``, ``-inf`` from ``ke[t] - ks[t]`` on;
    ``mla.reference.compressed_rows``; here ``N + max_seqlen_k < 2^30``), the rest of the keys
    neither read nor written.
    ``validate``: check ``ks``/``ke`` within ``[0, N]`` and, compressed, ``ke - ks <=
    max_seqlen_k`` on the host; unvalidated, keys outside are never read (the range is
    clipped) and a compressed row keeps its first ``max_seqlen_k`` keys. ``plan``: the tiling
    (``RAGGED_PLAN``, compressed ``RAGGED_COMPRESSED_PLAN``; fewer queries a program when the
    heads pass 64); ``plan.prefill_kernel="gluon"`` (theirs) runs ``mla.fast.sm90.logits``'s
    kernel where it takes the call."""
    q, codes, scale = check_ragged_logits_args(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke)
    check_max_seqlen_k(max_seqlen_k)
    if q.stride(-1) != 1:
        raise ValueError(f"q's last dim must be contiguous, got strides {list(q.stride())}")
    if codes.stride(-1) != 1:
        raise ValueError(f"kv[0]'s last dim must be contiguous, got strides "
                         f"{list(codes.stride())}")
    S, H, _ = q.shape
    N = codes.shape[0]
    M = max_seqlen_k or N
    if max_seqlen_k and N + M >= 1 << 30:
        raise ValueError(f"max_seqlen_k plus the keys must be below 2^30 here (the kernel's "
                         f"columns are int32 places after a row's start), got max_seqlen_k="
                         f"{max_seqlen_k} with {N} keys")
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    if should_validate(validate, q):
        check_ragged_logits_ranges(cu_seqlen_ks, cu_seqlen_ke, N, max_seqlen_k)
    out = torch.empty(S, M, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    if N == 0:  # (compressed rows of no keys)
        return out.fill_(float("-inf"))
    scale = scale.float().contiguous()
    plan = plan or (RAGGED_COMPRESSED_PLAN if max_seqlen_k else RAGGED_PLAN)
    ks = cu_seqlen_ks.clamp(0, N)
    ke = cu_seqlen_ke.clamp(0, N)
    if plan.prefill_kernel == "gluon" and _gluon(q, codes, weights, scale, ks, ke, out,
                                                 max_seqlen_k, plan.max_tiles):
        return out
    hp = max(16, next_pow2(H))
    block_q = max(1, min(plan.queries, 256 // hp))
    rows = triton.cdiv(S, block_q)
    # compressed, each query slot of a tile runs over the M keys from its start (the columns
    # past the last key: -inf)
    tiles, splits = split_keys(M, rows, plan.block_n, q.device, plan.programs_per_sm,
                               plan.max_tiles)
    grid = (rows, splits * (block_q if max_seqlen_k else 1))
    check_grid("fp8_mqa_logits (grid: query tiles, key splits)", grid)
    _ragged_kernel[grid](
        q, weights, codes.view(torch.float8_e4m3fn), scale, ks, ke, out, S, H, N, M,
        tiles * plan.block_n, splits, q.stride(0), q.stride(1), weights.stride(0),
        codes.stride(0),
        BLOCK_Q=block_q, HP=hp, D=INDEX_DIM, BLOCK_N=plan.block_n,
        TILES=tiles, NAN_CODES=interpreting(), STAGES=plan.stages,
        COMPRESSED=max_seqlen_k > 0, num_warps=plan.num_warps,
    )
    return out
