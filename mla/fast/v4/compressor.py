"""DeepSeek-V4's KV compressor in Triton: pool, RMSNorm, RoPE and store the closed entries.

Computes ``mla.reference.v4.compressor`` (equation (5) of ``mla.reference.v4.layer``) from the
projections ``kv`` and ``score`` ``[N, coff·d]`` float32 (``score`` with ``ape`` already added,
``compressor_kv_score``; vLLM's fp32 GEMM output). For request ``b`` whose positions so far are
``0 .. L_b - 1`` and whose last ``n_b`` positions are new, every entry ``j`` whose block closes
among the new tokens (``L_b - n_b <= j·r + r - 1 < L_b``) is computed and stored, one program
an entry:

    a_{q,e}  = softmax over the window's positions q >= 0 of s_{q, c·d + e}   (per channel e,
               c = 0 for the previous block of an overlapping (r = 4) window, else 1 or 0)
    c_j      = Σ_q a_q ⊙ kv_q,   n_j = RMSNorm(c_j; norm),   entry = RoPE_gptj(n_j, j·r)

then, as ``round_compressed_entries`` rounds it: ``d = 512`` into MODEL1 pages (``bf16(nope)``
as e4m3 with UE8M0 scales per 64, ``scale_floor`` ``"flashmla"`` by default; the rope values
bf16), ``d = 128`` into the indexer's 132-byte key cache (``bf16(entry)`` as e4m3, one
power-of-two scale per entry). The entry's slot is ``block_table[b, j // bs] · bs + j % bs``.

The rows of request ``b`` are ``kv[row_offsets[b] + (q - history_start[b])]`` for positions
``history_start[b] <= q < L_b``: the whole history (``history_start = 0``), or only the last
``coff·r - 1`` positions before the new tokens and the new ones (a state of the last tokens,
as vLLM keeps; ``mla.fast.v4.layer`` keeps ``coff·r``; ``history_start`` may be negative, rows
of positions below 0 are never read). A window position below ``history_start[b]`` is never
read, so it must be below 0 as well: ``validate`` checks ``history_start[b] <= max(0, L_b - n_b
- coff·r + 1)``.

Arithmetic: the pooling (an online softmax over the window, read from its last block back so
that the running maximum starts finite), the norm and the rotation are float32 (the reference's
float64); the roundings to bf16 and e4m3 and the scale exponents are integer operations on the
bit patterns, exact (``mla.fast.v4.common``). So a stored byte differs from the reference's only
where the float32 value of the entry lies within its float32 error (a few ulp, ``~2^-21``
relative) of a bf16 or e4m3 rounding boundary: then a code differs by one step (or a scale
exponent by one, for an ``amax`` that close to a power of two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.fast.bits import bf16_round, e4m3_bits, pow2, ue8m0_exponent
from mla.fast.common import interpreting, should_validate
from mla.fast.launch import check_grid
from mla.fast.v4.common import FLOORS, store_model1
from mla.reference.fp8_model1 import FP8_MODEL1_BYTES
from mla.reference.indexer_cache import INDEX_K_BYTES
from mla.validation import check_float, check_index, check_same_device, check_tensor

__all__ = ["v4_compress_store", "compress_entries_bound"]

_HALF = 32  # rope pairs of the 64 rope dims


def compress_entries_bound(max_new_tokens: int, ratio: int) -> int:
    """The most entries a request of ``max_new_tokens`` new tokens can close: the grid's
    second dimension."""
    return max_new_tokens // ratio + 1


@triton.jit
def _pool(s, v, m, l_sum, acc):
    """One window block into a channel-wise online softmax: ``s``/``v`` ``[BLOCK_W, C]``
    scores (``-inf`` where masked) and values; ``m``, ``l_sum``, ``acc`` ``[C]`` the running
    maximum, denominator and weighted sum, returned updated."""
    m_new = tl.maximum(m, tl.max(s, axis=0))
    p = tl.exp(s - m_new[None, :])
    alpha = tl.exp(m - m_new)
    return m_new, l_sum * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p * v, axis=0)


@triton.jit
def _compress_kernel(
    kv, score, row_offsets, history_start, seq_lens, num_new, block_table, norm_w, cos_sin,
    pages_u8, pages_i16, pages_f32, s_row, s_table, block_size, page_bytes, eps,
    RATIO: tl.constexpr, COFF: tl.constexpr, D: tl.constexpr, NOPE_P: tl.constexpr,
    HALF: tl.constexpr, BLOCK_W: tl.constexpr, MODEL1: tl.constexpr, FLOOR: tl.constexpr,
):
    b = tl.program_id(0)
    L = tl.load(seq_lens + b).to(tl.int64)
    start = L - tl.load(num_new + b).to(tl.int64)
    e = start // RATIO + tl.program_id(1)
    end = e * RATIO + RATIO - 1
    if end < L:
        W: tl.constexpr = COFF * RATIO
        NOPE: tl.constexpr = D - 2 * HALF
        lo = tl.load(history_start + b).to(tl.int64)
        row0 = tl.load(row_offsets + b).to(tl.int64) - lo
        first = end - W + 1
        cn = tl.arange(0, NOPE_P)
        cn_ok = cn < NOPE
        ci = tl.arange(0, HALF)
        m_n = tl.full((NOPE_P,), float("-inf"), tl.float32)
        l_n = tl.zeros((NOPE_P,), tl.float32)
        a_n = tl.zeros((NOPE_P,), tl.float32)
        m_e = tl.full((HALF,), float("-inf"), tl.float32)
        l_e = tl.zeros((HALF,), tl.float32)
        a_e = tl.zeros((HALF,), tl.float32)
        m_o = tl.full((HALF,), float("-inf"), tl.float32)
        l_o = tl.zeros((HALF,), tl.float32)
        a_o = tl.zeros((HALF,), tl.float32)
        for i in range(W // BLOCK_W):  # the window's blocks, its last (never masked) first
            w0 = W - (i + 1) * BLOCK_W
            c = w0 // RATIO
            q = first + w0 + tl.arange(0, BLOCK_W)
            ok = (q >= lo) & (q >= 0)
            rows = (row0 + q) * s_row + c * D
            mk = ok[:, None] & cn_ok[None, :]
            s = tl.load(score + rows[:, None] + cn[None, :], mask=mk, other=0.0)
            v = tl.load(kv + rows[:, None] + cn[None, :], mask=mk, other=0.0)
            s = tl.where(ok[:, None], s, float("-inf"))
            m_n, l_n, a_n = _pool(s, v, m_n, l_n, a_n)
            me = ok[:, None]
            ce = rows[:, None] + NOPE + 2 * ci[None, :]
            s = tl.where(me, tl.load(score + ce, mask=me, other=0.0), float("-inf"))
            v = tl.load(kv + ce, mask=me, other=0.0)
            m_e, l_e, a_e = _pool(s, v, m_e, l_e, a_e)
            s = tl.where(me, tl.load(score + ce + 1, mask=me, other=0.0), float("-inf"))
            v = tl.load(kv + ce + 1, mask=me, other=0.0)
            m_o, l_o, a_o = _pool(s, v, m_o, l_o, a_o)
        x_n = tl.where(cn_ok, a_n / l_n, 0.0)
        x_e = a_e / l_e
        x_o = a_o / l_o
        ss = tl.sum(x_n * x_n, axis=0) + tl.sum(x_e * x_e, axis=0) + tl.sum(x_o * x_o, axis=0)
        rstd = 1.0 / tl.sqrt(ss / D + eps)
        x_n = x_n * rstd * tl.load(norm_w + cn, mask=cn_ok, other=0.0)
        x_e = x_e * rstd * tl.load(norm_w + NOPE + 2 * ci)
        x_o = x_o * rstd * tl.load(norm_w + NOPE + 2 * ci + 1)
        pos = e * RATIO
        cos = tl.load(cos_sin + pos * 2 * HALF + ci)
        sin = tl.load(cos_sin + pos * 2 * HALF + HALF + ci)
        r_e = x_e * cos - x_o * sin
        r_o = x_e * sin + x_o * cos
        page = tl.load(block_table + b * s_table + e // block_size).to(tl.int64)
        o = e % block_size
        nope = bf16_round(x_n)
        if MODEL1:
            store_model1(pages_u8, pages_i16, page * page_bytes, o, block_size, nope, r_e, r_o,
                         NOPE_P, HALF, FLOOR, end < L)
        else:
            r_e = bf16_round(r_e)
            r_o = bf16_round(r_o)
            amax = tl.maximum(tl.max(tl.abs(nope), axis=0),
                              tl.maximum(tl.max(tl.abs(r_e), axis=0), tl.max(tl.abs(r_o), axis=0)))
            j = ue8m0_exponent(amax, FLOOR)
            inv = pow2(-j)
            base = page * page_bytes + o * D
            tl.store(pages_u8 + base + cn, e4m3_bits(nope * inv).to(tl.uint8), mask=cn_ok)
            tl.store(pages_u8 + base + NOPE + 2 * ci, e4m3_bits(r_e * inv).to(tl.uint8))
            tl.store(pages_u8 + base + NOPE + 2 * ci + 1, e4m3_bits(r_o * inv).to(tl.uint8))
            tl.store(pages_f32 + (page * page_bytes + block_size * D) // 4 + o, pow2(j))


def _check_requests(name: str, t: torch.Tensor, B: int, device: torch.device) -> None:
    check_index(name, t, shape=[B], device=device)


def v4_compress_store(kv: torch.Tensor, score: torch.Tensor, row_offsets: torch.Tensor,
                      seq_lens: torch.Tensor, num_new: torch.Tensor, max_new_tokens: int,
                      norm_weight: torch.Tensor, cos_sin: torch.Tensor, cache: torch.Tensor,
                      block_table: torch.Tensor, *, ratio: int, rms_norm_eps: float,
                      history_start: torch.Tensor | None = None, scale_floor: str = "flashmla",
                      validate: bool | None = None) -> None:
    """Compute and store the entries the new tokens close (module doc), in place.

    ``kv``, ``score [N, coff·d]`` float32 (``coff = 2`` for ``ratio = 4``; ``score`` with
    ``ape`` added); ``row_offsets``, ``seq_lens``, ``num_new``, ``history_start`` ``[B]`` int
    (``history_start`` default 0); ``max_new_tokens >= max(num_new)``; ``norm_weight [d]``;
    ``cos_sin [P, 64]`` float32 (``v4_cos_sin_cache`` of the layer, ``P`` above every entry's
    position ``j·r``); ``cache``: ``d = 512`` the ``[nb, bs, 584]`` view of MODEL1 pages
    (``fp8_model1_cache``), ``d = 128`` the indexer key cache ``uint8 [nb, bs, 132]``;
    ``block_table [B, pages]`` int32 (entry ``j`` of request ``b`` lives in page
    ``block_table[b, j // bs]``). ``scale_floor`` (``d = 512``): ``"flashmla"`` or ``"vllm"``.
    ``validate``: check the lengths, the history and the block table on the host (a sync)."""
    if ratio not in (4, 128) or isinstance(ratio, bool):
        raise ValueError(f"ratio must be 4 or 128, got {ratio!r}")
    if scale_floor not in FLOORS:
        raise ValueError(f"scale_floor must be one of {tuple(FLOORS)}, got {scale_floor!r}")
    coff = 2 if ratio == 4 else 1
    check_float("norm_weight", norm_weight, ndim=1)
    d = norm_weight.shape[0]
    if d not in (512, 128):
        raise ValueError(f"norm_weight must have 512 (the attention's) or 128 (the indexer's) "
                         f"entries, got {d}")
    check_tensor("kv", kv, shape=[None, coff * d], dtype=(torch.float32,))
    check_tensor("score", score, shape=list(kv.shape), dtype=(torch.float32,), device=kv.device)
    if kv.stride(1) != 1 or score.stride() != kv.stride():
        raise ValueError(f"kv and score must have unit column stride and equal strides, got "
                         f"{list(kv.stride())} and {list(score.stride())}")
    check_tensor("cos_sin", cos_sin, shape=[None, 64], dtype=(torch.float32,),
                 device=kv.device, contiguous=True)
    check_index("block_table", block_table, ndim=2, dtype=(torch.int32,), device=kv.device)
    B = block_table.shape[0]
    for name, t in (("row_offsets", row_offsets), ("seq_lens", seq_lens), ("num_new", num_new)):
        _check_requests(name, t, B, kv.device)
    if history_start is None:
        history_start = torch.zeros(B, dtype=torch.int32, device=kv.device)
    _check_requests("history_start", history_start, B, kv.device)
    check_same_device(kv=kv, norm_weight=norm_weight, cache=cache)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    model1 = d == 512
    width = FP8_MODEL1_BYTES if model1 else INDEX_K_BYTES
    check_tensor("cache", cache, ndim=3, dtype=(torch.uint8, torch.float8_e4m3fn))
    if cache.shape[2] != width:
        raise ValueError(f"cache must have shape [num_blocks, block_size, {width}] for d = {d}, "
                         f"got {list(cache.shape)}")
    nb, bs = cache.shape[:2]
    page_bytes = cache.stride(0)
    if model1:
        # the pages' bytes from the [nb, bs, 584] view: a page starts every stride(0) bytes
        flat = torch.as_strided(cache.view(torch.uint8), (nb * page_bytes,), (1,))
    else:
        check_tensor("cache", cache, contiguous=True)
        flat = cache.view(torch.uint8).view(-1)
    if should_validate(validate, kv):
        _validate(seq_lens, num_new, history_start, row_offsets, block_table, kv.shape[0],
                  max_new_tokens, ratio, coff, bs, nb, cos_sin.shape[0])
    if B == 0:
        return
    grid = (B, compress_entries_bound(max_new_tokens, ratio))
    check_grid("v4_compress_store (grid: requests, entries)", grid)
    norm_weight = norm_weight.float().contiguous()
    _compress_kernel[grid](
        kv, score, row_offsets, history_start, seq_lens, num_new, block_table, norm_weight,
        cos_sin, flat, flat.view(torch.int16) if model1 else flat,
        flat if model1 else flat.view(torch.float32), kv.stride(0), block_table.stride(0), bs,
        page_bytes, float(rms_norm_eps),
        RATIO=ratio, COFF=coff, D=d, NOPE_P=512 if model1 else 64, HALF=_HALF,
        BLOCK_W=min(ratio, 4 if interpreting() else 16), MODEL1=model1,
        FLOOR=FLOORS[scale_floor] if model1 else FLOORS["vllm"], num_warps=4,
    )


def _validate(seq_lens: torch.Tensor, num_new: torch.Tensor, history_start: torch.Tensor,
              row_offsets: torch.Tensor, block_table: torch.Tensor, n_rows: int,
              max_new: int, ratio: int, coff: int, bs: int, nb: int, positions: int) -> None:
    L, n, h, r0 = (t.long().cpu() for t in (seq_lens, num_new, history_start, row_offsets))
    if bool(((n < 0) | (n > L)).any()) or (n.numel() and int(n.max()) > max_new):
        raise ValueError(f"num_new must lie in [0, min(seq_lens, max_new_tokens="
                         f"{max_new})] per request")
    start = L - n
    need = (start - coff * ratio + 1).clamp_min(0)
    if bool((h > need).any()):
        raise ValueError("history_start must be at most max(0, seq_lens - num_new - coff·r + "
                         "1) (every window position >= 0 held)")
    if bool(((r0 < 0) | (r0 + L - h > n_rows)).any()):
        raise ValueError(f"row_offsets: request rows must lie in kv's {n_rows} rows")
    last = L // ratio  # entries of the request after the step
    pages = -(-last // bs)
    top = int(last.max()) if last.numel() else 0
    if pages.numel() and int(pages.max()) > block_table.shape[1]:
        raise ValueError(f"block_table has {block_table.shape[1]} pages a request; a request "
                         f"needs {int(pages.max())}")
    if top and (top - 1) * ratio >= positions:
        raise ValueError(f"cos_sin has {positions} positions; entry positions reach "
                         f"{(top - 1) * ratio}")
    used = torch.arange(block_table.shape[1])[None, :] < pages[:, None]
    t = block_table.long().cpu()
    if bool(((t < 0) | (t >= nb))[used].any()):
        raise ValueError(f"block_table entries must lie in [0, {nb}) (the cache's pages)")
