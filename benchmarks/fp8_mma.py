"""A float64 model of the FP8 tensor cores' accumulation, for the indexer logits' error budget.

Hopper's e4m3 MMA (``wgmma ... .e4m3.e4m3.f32``, ``k = 32`` a step) does not accumulate in
float32: DeepSeek-V3's report (§3.3.2) measures about 14 bits kept on H800s and promotes
partial sums to CUDA cores every 128 elements; on the H200 the low 10 bits of every float32
result come out zero (13 mantissa bits kept). The indexer's dot has ``d = 128``: four MMA steps
in the tensor cores' accumulator, never promoted (DeepGEMM's ``fp8_mqa_logits`` and ours alike).

``emulated_logits`` computes ``k_scale · Σ_h w_h · ReLU(q_h · k)`` with each dot summed that
way: products exact (two e4m3 numbers make at most 8 significant bits), ``step`` of them added
to the running sum per MMA step, and
- ``mode="sum"``: the step's exact sum, truncated toward zero to ``bits`` mantissa bits;
- ``mode="align"``: each addend (the running sum and the step's products) first truncated to
  the multiple of ``2^(e - bits)``, ``2^e`` the largest one's leading bit, as an adder aligned
  to the largest exponent does, then the sum truncated to ``bits`` as above (the H200's);
- ``mode="align_products"``: the step's products aligned so among themselves, their sum then
  added to the running sum and truncated as in "sum".
The weighted sum over heads and the scale are exact (float64): their float32 roundings are
10^3 times smaller.

``fp8_mqa_logits`` and ``fp8_paged_mqa_logits`` are the reference's kernels with their dots so
emulated (same signatures and checks: ``mla conform --target benchmarks.fp8_mma`` runs the
catalogue on them, where the float32 limits of a CPU setting fail them, as they should).
"""

from __future__ import annotations

import torch

from mla.reference.indexer_cache import read_indexer_k_cache
from mla.reference.indexer_logits import (
    check_paged_logits_args,
    check_ragged_logits_args,
    check_ragged_logits_ranges,
    decode_row_ends,
)

__all__ = ["MODES", "BITS", "STEP", "MODE", "truncate_bits", "emulated_dots", "emulated_logits",
           "fp8_mqa_logits", "fp8_paged_mqa_logits"]

MODES = ("sum", "align", "align_products")
# the H200's: its single-head dots equal this model's bit for bit in 57-89% of cases (more than
# the other modes, 14 bits or steps of 16), its logits' errors within 5% (conventions §11)
BITS, STEP, MODE = 13, 32, "align"


def truncate_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` (float64) truncated toward zero to ``bits`` bits after the leading one."""
    m, e = torch.frexp(x)  # x = m·2^e, 0.5 <= |m| < 1
    return torch.ldexp(torch.trunc(torch.ldexp(m, torch.full_like(e, bits + 1))), e - bits - 1)


def _aligned_sum(terms: torch.Tensor, bits: int) -> torch.Tensor:
    """Σ of ``terms [..., n]`` after truncating each to the largest one's ``bits``-bit grid."""
    _, e = torch.frexp(terms)
    e = torch.where(terms == 0, torch.iinfo(e.dtype).min // 2, e)
    top = e.amax(dim=-1, keepdim=True)
    lsb = (top - bits - 1).clamp_min(-1074)
    return torch.ldexp(torch.trunc(torch.ldexp(terms, -lsb)), lsb).sum(-1)


def emulated_dots(q: torch.Tensor, k: torch.Tensor, *, bits: int = BITS, step: int = STEP,
                  mode: str = MODE) -> torch.Tensor:
    """``q [..., D] · k [..., D]`` (broadcast, float64 values of e4m3 numbers) summed as the
    module doc's accumulator: ``D / step`` steps, each truncating to ``bits`` bits."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    p = q * k
    D = p.shape[-1]
    if D % step:
        raise ValueError(f"step {step} must divide the dot's length {D}")
    acc = torch.zeros(p.shape[:-1], dtype=torch.float64, device=p.device)
    for i in range(0, D, step):
        block = p[..., i:i + step]
        if mode == "sum":
            acc = truncate_bits(acc + block.sum(-1), bits)
        elif mode == "align_products":
            acc = truncate_bits(acc + _aligned_sum(block, bits), bits)
        else:
            acc = truncate_bits(_aligned_sum(torch.cat([acc[..., None], block], -1), bits), bits)
    return acc


def emulated_logits(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                    weights: torch.Tensor, *, bits: int = BITS, step: int = STEP,
                    mode: str = MODE) -> torch.Tensor:
    """float64 ``[T, N]`` logits of ``q [T, H, 128]`` (e4m3) over ``codes [N, 128]`` (e4m3)
    with ``scale [N]`` and ``weights [T, H]``, every key seen (the caller masks), each dot as
    ``emulated_dots``."""
    qd = q.view(torch.float8_e4m3fn).double()
    kd = codes.view(torch.float8_e4m3fn).double()
    w = weights.double()
    out = torch.empty(q.shape[0], kd.shape[0], dtype=torch.float64, device=qd.device)
    per_key = max(1, qd[..., 0].numel() * qd.shape[-1])
    chunk = max(1, (1 << (26 if qd.is_cuda else 22)) // per_key)  # products held at once
    for n0 in range(0, kd.shape[0], chunk):
        kc = kd[n0:n0 + chunk]
        dots = emulated_dots(qd[:, :, None, :], kc[None, None], bits=bits, step=step,
                             mode=mode)  # [T, H, n]
        out[:, n0:n0 + kc.shape[0]] = torch.einsum("th,thn->tn", w, dots.clamp_min(0.0))
    return out * scale.double()[None, :]


def fp8_mqa_logits(q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                   weights: torch.Tensor, cu_seqlen_ks: torch.Tensor,
                   cu_seqlen_ke: torch.Tensor) -> torch.Tensor:
    """``mla.reference.fp8_mqa_logits`` with the dots of ``emulated_logits`` (float64)."""
    q, codes, scale = check_ragged_logits_args(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke)
    check_ragged_logits_ranges(cu_seqlen_ks, cu_seqlen_ke, codes.shape[0])
    out = emulated_logits(q, codes, scale, weights)
    cols = torch.arange(codes.shape[0], device=q.device)[None, :]
    return out.masked_fill((cols < cu_seqlen_ks.long()[:, None])
                           | (cols >= cu_seqlen_ke.long()[:, None]), float("-inf"))


def fp8_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_tables: torch.Tensor,
                         max_model_len: int) -> torch.Tensor:
    """``mla.reference.fp8_paged_mqa_logits`` with the dots of ``emulated_logits`` (float64;
    lengths and tables as the reference checks them)."""
    q, kv_cache = check_paged_logits_args(q, kv_cache, weights, context_lens, block_tables,
                                          max_model_len)
    B, next_n = q.shape[:2]
    bs = kv_cache.shape[1]
    out = torch.full((B * next_n, max_model_len), float("-inf"), dtype=torch.float64,
                     device=q.device)
    ends = decode_row_ends(context_lens, next_n).long().view(B, next_n)
    for b, n in enumerate(context_lens.tolist()):
        if n <= 0:
            continue
        pos = torch.arange(n, device=q.device)
        codes, scale = read_indexer_k_cache(kv_cache.view(torch.uint8),
                                            block_tables[b].long()[pos // bs] * bs + pos % bs)
        rows = emulated_logits(q[b], codes, scale, weights[b * next_n:(b + 1) * next_n])
        out[b * next_n:(b + 1) * next_n, :n] = rows.masked_fill(
            pos[None, :] >= ends[b][:, None], float("-inf"))
    return out
