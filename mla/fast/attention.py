"""Attention that returns its log-sum-exp, fast: cuDNN where it applies, else a Triton kernel.

Same contract as ``mla.reference.attention.attention_with_lse`` (conventions §5):

    s_j = scale · q_i · k_j;   lse = log Σ_j exp(s_j);   o_i = Σ_j exp(s_j - lse) · v_j

``q [Sq, N, D]``, ``k [Skv, Nk, D]``, ``v [Skv, Nk, Dv]`` -> ``o [Sq, N, Dv]``, ``lse [N, Sq]``
(float32); causal visibility is bottom-right aligned (query ``i`` sees key ``j`` iff
``j <= i + Skv - Sq``) unless positions are given; a query with no visible key gets ``o = 0``,
``lse = -inf``.

Routes (``pick_route``), measured on the H200 in benchmarks/results/prefill/prefill_routes.md:
- ``"cudnn"``: ``torch.ops.aten._scaled_dot_product_cudnn_attention`` with
  ``compute_log_sumexp=True``. bf16/fp16 on CUDA, ``Nk = N``, no explicit positions, and
  ``Sq = Skv`` when causal (cuDNN's causal mask is top-left aligned, which equals ours only
  then). The fastest route measured for causal QK 192 / V 128, ahead of the Triton kernel
  below.
- ``"triton"``: the kernel below (FlashAttention-2 style online softmax in base 2). Any case
  on CUDA: fp16/bf16/fp32, grouped heads, explicit positions, ``Sq != Skv``, ragged batches in
  one launch (``flash_attention_with_lse``), QK dims that are not powers of two (the query and
  key come in two parts, e.g. 128 nope + 64 rope columns, so nothing is padded or concatenated).
  Tiles come through tensor descriptors (TMA) when the layout allows it (16-byte aligned rows,
  heads and widths, as DeepSeek's 128 + 64 / 128 are): the per-element pointer tiles need so
  many address registers that the kernel spills at 128×64 tiles, 8 warps, 3 stages (ptxas),
  the descriptor tiles do not. Other layouts take the pointer loads.
- ``"reference"``: the reference's math, on the CPU and for float64. (The Triton kernel runs on
  the CPU too under ``TRITON_INTERPRET=1``: the tests force the ``"triton"`` route.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mla.fast.common import LOG2E, capability, ensure_allocator, interpreting
from mla.fast.launch import check_grid
from mla.reference.attention import attention_with_lse as _reference_attention
from mla.reference.attention import default_positions
from mla.validation import check_float, check_index, check_same_device, check_same_dtype

__all__ = ["AttnConfig", "attention_with_lse", "cudnn_attention_with_lse",
           "flash_attention_with_lse", "pick_config", "pick_route", "tile_bytes"]


@dataclass(frozen=True)
class AttnConfig:
    """Tile sizes and launch parameters of the Triton kernel."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


_INTERPRETER_CONFIG = AttnConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
# Tiles in order of preference; the first whose shared memory fits is taken. The default
# suits the prefill widths (q/k 192, v 128) in 16 bits; float32 tiles take twice the bytes;
# the absorbed widths (q/k 576, v 512) need smaller tiles and fewer stages.
_CONFIGS_16BIT = (AttnConfig(), AttnConfig(block_m=64, block_n=32, num_warps=8, num_stages=2),
                  AttnConfig(block_m=32, block_n=32, num_warps=4, num_stages=1))
_CONFIGS_FLOAT32 = (AttnConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
                    AttnConfig(block_m=32, block_n=32, num_warps=4, num_stages=1),
                    AttnConfig(block_m=16, block_n=16, num_warps=4, num_stages=1))
_MAX_ROWS = 2**31 - 1  # q and k rows (one request's count is int32 in the kernel)
# an SM90 block may use 227 KB of shared memory; the kernel needs about 1 KB beyond its tiles
_SHARED_MEMORY_BYTES = 227 * 1024 - 4096


def tile_bytes(config: AttnConfig, block_qk: int, block_v: int, elem: int) -> int:
    """Shared memory of the kernel's tiles: the q tile and ``num_stages`` k/v tiles."""
    return elem * (config.block_m * block_qk
                   + config.num_stages * config.block_n * (block_qk + block_v))


def pick_config(dtype: torch.dtype, block_qk: int, block_v: int) -> AttnConfig:
    """The first tiles of the dtype's list that fit shared memory (``block_*``: the padded
    widths of q/k and v)."""
    configs = _CONFIGS_FLOAT32 if dtype == torch.float32 else _CONFIGS_16BIT
    elem = 4 if dtype == torch.float32 else 2
    for config in configs:
        if tile_bytes(config, block_qk, block_v, elem) <= _SHARED_MEMORY_BYTES:
            return config
    raise ValueError(f"head dims too wide for the Triton kernel: q/k {block_qk}, v {block_v} "
                     f"in {dtype} do not fit shared memory even at the smallest tiles")


@triton.jit
def _attn_tiles(
    acc, l_i, m_i, q_a, q_b, qpos, ka_ptrs, kb_ptrs, v_ptrs, ka_desc, kb_desc, v_desc,
    kpos_ptr, s_ka_t, s_kb_t, s_v_t, offs_m, lo, hi, k_len, diag, qk_scale,
    BLOCK_N: tl.constexpr, DA: tl.constexpr, BLOCK_DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DB: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, USE_TMA: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Fold key tiles ``[lo, hi)`` into the running ``(acc, l_i, m_i)``.

    ``MASKED=False`` is the hot loop over tiles every query of the block sees in full: no
    per-element masks. ``MASKED=True`` handles the diagonal and the ragged tail.
    ``USE_TMA``: tiles come through tensor descriptors bounded by this request's rows, so rows
    past the end arrive as zeros with no mask and no per-thread address registers (the
    pointer tiles need so many of those that the kernel spills, measured with ptxas).
    """
    d_a = tl.arange(0, BLOCK_DA)
    d_b = tl.arange(0, BLOCK_DB)
    d_v = tl.arange(0, BLOCK_DV)
    n0 = tl.arange(0, BLOCK_N)
    # pointers advance tile by tile: 64-bit pointer sums, no 32-bit row-times-stride overflow
    lo64 = tl.cast(lo, tl.int64)
    ka_ptrs += lo64 * s_ka_t
    kb_ptrs += lo64 * s_kb_t
    v_ptrs += lo64 * s_v_t
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + n0
        col_ok = offs_n < k_len
        if MASKED:
            ka_mask = col_ok[None, :] & (d_a < DA)[:, None]
            kb_mask = col_ok[None, :] & (d_b < DB)[:, None]
            v_mask = col_ok[:, None] & (d_v < DV)[None, :]
        else:
            ka_mask = (d_a < DA)[:, None]
            kb_mask = (d_b < DB)[:, None]
            v_mask = (d_v < DV)[None, :]
        if USE_TMA:
            k_a = tl.trans(ka_desc.load([start_n, 0]))
        else:
            k_a = tl.load(ka_ptrs, mask=ka_mask, other=0.0)
        s = tl.dot(q_a, k_a, input_precision=DOT_PREC)
        if DB > 0:
            if USE_TMA:
                k_b = tl.trans(kb_desc.load([start_n, 0]))
            else:
                k_b = tl.load(kb_ptrs, mask=kb_mask, other=0.0)
            s = tl.dot(q_b, k_b, acc=s, input_precision=DOT_PREC)
        s = s * qk_scale
        if MASKED:
            visible = col_ok[None, :]
            if CAUSAL:
                if HAS_POS:
                    kpos = tl.load(kpos_ptr + offs_n, mask=col_ok, other=0)
                    visible = visible & (kpos[None, :] <= qpos[:, None])
                else:
                    visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if USE_TMA:
            v = v_desc.load([start_n, 0])
        else:
            v = tl.load(v_ptrs, mask=v_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
        if not USE_TMA:
            ka_ptrs += BLOCK_N * s_ka_t
            kb_ptrs += BLOCK_N * s_kb_t
            v_ptrs += BLOCK_N * s_v_t
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    qa, qb, ka, kb, v, out, lse, q_pos, k_pos, cu_q, cu_k,
    qk_scale, GROUP,
    s_qa_t, s_qa_h, s_qa_d, s_qb_t, s_qb_h, s_qb_d,
    s_ka_t, s_ka_h, s_ka_d, s_kb_t, s_kb_h, s_kb_d,
    s_v_t, s_v_h, s_v_d, s_o_t, s_o_h, s_lse_h,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DA: tl.constexpr, BLOCK_DA: tl.constexpr, DB: tl.constexpr, BLOCK_DB: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, USE_TMA: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_POS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q0 = tl.load(cu_q + b).to(tl.int64)
    q_len = (tl.load(cu_q + b + 1) - tl.load(cu_q + b)).to(tl.int32)
    k0 = tl.load(cu_k + b).to(tl.int64)
    k_len = (tl.load(cu_k + b + 1) - tl.load(cu_k + b)).to(tl.int32)
    kh = (h // GROUP).to(tl.int64)
    h64 = h.to(tl.int64)

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < q_len
    d_a = tl.arange(0, BLOCK_DA)
    d_b = tl.arange(0, BLOCK_DB)
    d_v = tl.arange(0, BLOCK_DV)
    n0 = tl.arange(0, BLOCK_N)

    rows = q0 + offs_m
    ka_base = ka + k0 * s_ka_t + kh * s_ka_h
    kb_base = kb + k0 * s_kb_t + kh * s_kb_h
    v_base = v + k0 * s_v_t + kh * s_v_h
    if USE_TMA:  # descriptors over this request's rows of this head: zeros past the end
        q_rows = tl.maximum(q_len, 1)
        k_rows = tl.maximum(k_len, 1)
        qa_desc = tl.make_tensor_descriptor(qa + q0 * s_qa_t + h64 * s_qa_h,
                                            shape=[q_rows, DA], strides=[s_qa_t, 1],
                                            block_shape=[BLOCK_M, BLOCK_DA])
        q_a = qa_desc.load([m0, 0])
        ka_desc = tl.make_tensor_descriptor(ka_base, shape=[k_rows, DA], strides=[s_ka_t, 1],
                                            block_shape=[BLOCK_N, BLOCK_DA])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[k_rows, DV], strides=[s_v_t, 1],
                                           block_shape=[BLOCK_N, BLOCK_DV])
        q_b = q_a
        kb_desc = ka_desc
        if DB > 0:
            qb_desc = tl.make_tensor_descriptor(qb + q0 * s_qb_t + h64 * s_qb_h,
                                                shape=[q_rows, DB], strides=[s_qb_t, 1],
                                                block_shape=[BLOCK_M, BLOCK_DB])
            q_b = qb_desc.load([m0, 0])
            kb_desc = tl.make_tensor_descriptor(kb_base, shape=[k_rows, DB],
                                                strides=[s_kb_t, 1],
                                                block_shape=[BLOCK_N, BLOCK_DB])
    else:
        q_a = tl.load(qa + rows[:, None] * s_qa_t + h64 * s_qa_h + d_a[None, :] * s_qa_d,
                      mask=row_ok[:, None] & (d_a < DA)[None, :], other=0.0)
        q_b = q_a
        if DB > 0:
            q_b = tl.load(qb + rows[:, None] * s_qb_t + h64 * s_qb_h + d_b[None, :] * s_qb_d,
                          mask=row_ok[:, None] & (d_b < DB)[None, :], other=0.0)
        ka_desc = ka  # unused
        kb_desc = ka
        v_desc = ka
    qpos = offs_m
    kpos_ptr = k_pos
    if HAS_POS:
        qpos = tl.load(q_pos + rows, mask=row_ok, other=-1)
        kpos_ptr = k_pos + k0

    if USE_TMA:
        ka_ptrs = ka_base  # unused
        kb_ptrs = kb_base
        v_ptrs = v_base
    else:
        ka_ptrs = ka_base + n0[None, :] * s_ka_t + d_a[:, None] * s_ka_d
        kb_ptrs = kb_base + n0[None, :] * s_kb_t + d_b[:, None] * s_kb_d
        v_ptrs = v_base + n0[:, None] * s_v_t + d_v[None, :] * s_v_d

    # key tiles: [0, lo) seen in full by every row of the block, [lo, hi) need masks
    diag = k_len - q_len  # bottom-right alignment: row i sees keys j <= i + diag
    full_tiles = (k_len // BLOCK_N) * BLOCK_N
    if CAUSAL and not HAS_POS:
        # (C division truncates a negative numerator towards 0; the max covers it)
        lo = tl.minimum(tl.maximum(((m0 + diag + 1) // BLOCK_N) * BLOCK_N, 0), full_tiles)
        hi = tl.minimum(m0 + BLOCK_M + diag, k_len)
    elif HAS_POS and CAUSAL:
        lo = 0
        hi = k_len
    else:
        lo = full_tiles
        hi = k_len
    # a block past this request's queries: nothing to do
    lo = tl.where(m0 < q_len, lo, 0)
    hi = tl.where(m0 < q_len, hi, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    acc, l_i, m_i = _attn_tiles(
        acc, l_i, m_i, q_a, q_b, qpos, ka_ptrs, kb_ptrs, v_ptrs, ka_desc, kb_desc, v_desc,
        kpos_ptr, s_ka_t, s_kb_t, s_v_t, offs_m, 0, lo, k_len, diag, qk_scale,
        BLOCK_N, DA, BLOCK_DA, DB, BLOCK_DB, DV, BLOCK_DV, USE_TMA, False, CAUSAL, HAS_POS,
        DOT_PREC)
    acc, l_i, m_i = _attn_tiles(
        acc, l_i, m_i, q_a, q_b, qpos, ka_ptrs, kb_ptrs, v_ptrs, ka_desc, kb_desc, v_desc,
        kpos_ptr, s_ka_t, s_kb_t, s_v_t, offs_m, lo, hi, k_len, diag, qk_scale,
        BLOCK_N, DA, BLOCK_DA, DB, BLOCK_DB, DV, BLOCK_DV, USE_TMA, True, CAUSAL, HAS_POS,
        DOT_PREC)

    seen = l_i != 0.0  # l = 0: no key; a NaN l (a NaN logit) stays NaN, never "no key"
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    row_lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453,
                       float("-inf"))
    tl.store(out + rows[:, None] * s_o_t + h64 * s_o_h + d_v[None, :],
             o.to(out.dtype.element_ty), mask=row_ok[:, None] & (d_v < DV)[None, :])
    tl.store(lse + h64 * s_lse_h + rows, row_lse, mask=row_ok)


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need Hopper or newer (or the interpreter), a unit last stride and
    16-byte aligned bases, rows, heads and row widths (a view of a contiguous [T, N, 192]
    split at 128 qualifies; a k_pe broadcast over heads by a zero stride too)."""
    t0 = tensors[0]
    if t0.device.type == "cuda":
        if capability(t0.device)[0] < 9:
            return False
    elif not interpreting():
        return False
    for t in tensors:
        e = t.element_size()
        if (t.stride(2) != 1 or t.data_ptr() % 16 or (t.stride(0) * e) % 16
                or (t.stride(1) * e) % 16 or (t.shape[2] * e) % 16 or t.shape[0] >= 2**31):
            return False
    return True


def _split_dim(d: int) -> tuple[int, int]:
    """Split a QK dim into a power-of-two part and a rest (192 -> 128 + 64); 0 rest if a power."""
    if d <= 16:
        return d, 0
    a = 1 << (d.bit_length() - 1)
    return a, d - a


def _block(d: int) -> int:
    return max(16, triton.next_power_of_2(d)) if d > 0 else 16


def flash_attention_with_lse(
    q_a: torch.Tensor, q_b: torch.Tensor | None,
    k_a: torch.Tensor, k_b: torch.Tensor | None,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
    softmax_scale: float, causal: bool = False,
    q_positions: torch.Tensor | None = None, k_positions: torch.Tensor | None = None,
    config: AttnConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel over a ragged batch: ``B = len(cu_seqlens_q) - 1`` requests in one launch.

    The query is ``[q_a ‖ q_b]`` (``[Tq, N, Da]`` and ``[Tq, N, Db]``), the key ``[k_a ‖ k_b]``
    (``[Tk, Nk, Da]``, ``[Tk, Nk, Db]``; any strides, so a ``k_pe`` broadcast over heads by
    ``expand`` costs nothing), ``v [Tk, Nk, Dv]``. Request ``b`` owns query rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key rows likewise; ``max_seqlen_q`` (a host int,
    an upper bound is fine; taken as at most ``Tq``) sizes the grid. Positions, if given, are
    per row ``[Tq]``/``[Tk]``. ``Tq`` and ``Tk`` must be below 2^31, and the grid (query blocks,
    heads ``N`` and requests ``B`` each at most 65535) below 2^31 programs (``ValueError``).
    Returns ``o [Tq, N, Dv]`` and ``lse [N, Tq]`` float32. Reads no device value on the host.
    """
    check_float("q_a", q_a, ndim=3)
    Tq, N, Da = q_a.shape
    check_float("k_a", k_a, shape=[None, None, Da])
    Tk, Nk, _ = k_a.shape
    check_float("v", v, shape=[Tk, Nk, None])
    if (q_b is None) != (k_b is None):
        raise ValueError("q_b and k_b must be given together or both be None")
    if q_b is not None and k_b is not None:
        check_float("q_b", q_b, shape=[Tq, N, None])
        check_float("k_b", k_b, shape=[Tk, Nk, q_b.shape[2]])
    check_same_dtype(q_a=q_a, q_b=q_b, k_a=k_a, k_b=k_b, v=v)
    if q_a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q_a must be float16, bfloat16 or float32 for the Triton kernel, "
                        f"got {q_a.dtype}")
    check_index("cu_seqlens_q", cu_seqlens_q, ndim=1)
    B = cu_seqlens_q.shape[0] - 1
    check_index("cu_seqlens_k", cu_seqlens_k, shape=[B + 1])
    if Nk == 0 or N % Nk:
        raise ValueError(f"q's heads ({N}) must be a positive multiple of k's heads ({Nk})")
    if (q_positions is None) != (k_positions is None):
        raise ValueError("q_positions and k_positions must be given together")
    if q_positions is not None:
        check_index("q_positions", q_positions, shape=[Tq])
        check_index("k_positions", k_positions, shape=[Tk])
    check_same_device(q_a=q_a, q_b=q_b, k_a=k_a, k_b=k_b, v=v, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k, q_positions=q_positions,
                      k_positions=k_positions)
    for name, rows in (("q_a", Tq), ("k_a", Tk)):
        if rows > _MAX_ROWS:  # no request can be longer than all rows together
            raise ValueError(f"{name} must have at most {_MAX_ROWS} rows (2^31 - 1: the kernel "
                             f"counts a request's rows in 32 bits), got {rows}")
    Dv = v.shape[2]
    Db = 0 if q_b is None else q_b.shape[2]
    empty = Tq == 0 or N == 0 or B <= 0 or max_seqlen_q <= 0
    if not empty:
        if config is None:
            config = (_INTERPRETER_CONFIG if q_a.device.type == "cpu" else
                      pick_config(q_a.dtype, _block(Da) + (_block(Db) if Db else 0),
                                  _block(Dv)))
        # no request has more rows than q: a loose bound costs no more programs than that
        grid = (triton.cdiv(min(max_seqlen_q, Tq), config.block_m), N, B)
        check_grid("flash_attention_with_lse (grid: query blocks of max_seqlen_q, heads, "
                   "requests)", grid)
    out = torch.empty((Tq, N, Dv), dtype=q_a.dtype, device=q_a.device)
    lse = torch.empty((N, Tq), dtype=torch.float32, device=q_a.device)
    if empty:
        if Tq:
            out.zero_()
            lse.fill_(float("-inf"))
        return out, lse
    qb_t = q_a if q_b is None else q_b
    kb_t = k_a if k_b is None else k_b
    use_tma = _tma_ok(q_a, qb_t, k_a, kb_t, v)
    if use_tma and q_a.device.type == "cuda":
        ensure_allocator()
    pos_q = cu_seqlens_q if q_positions is None else q_positions
    pos_k = cu_seqlens_k if k_positions is None else k_positions
    _attn_fwd_kernel[grid](
        q_a, qb_t, k_a, kb_t, v, out, lse, pos_q, pos_k, cu_seqlens_q, cu_seqlens_k,
        softmax_scale * LOG2E, N // Nk,
        *q_a.stride(), *qb_t.stride(), *k_a.stride(), *kb_t.stride(), *v.stride(),
        out.stride(0), out.stride(1), lse.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        DA=Da, BLOCK_DA=_block(Da), DB=Db, BLOCK_DB=_block(Db), DV=Dv, BLOCK_DV=_block(Dv),
        USE_TMA=use_tma, CAUSAL=bool(causal), HAS_POS=q_positions is not None,
        # float32 stays float32 (conventions §11's 1e-5 rules out tf32); 16-bit dots need no choice
        DOT_PREC="ieee" if q_a.dtype == torch.float32 else None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out, lse


def cudnn_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             softmax_scale: float, causal: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's cuDNN attention with its LSE: ``q [Sq,N,D]``, ``k [Skv,N,D]``, ``v [Skv,N,Dv]``.

    ``causal`` needs ``Sq = Skv`` (cuDNN aligns the mask top-left). ``o`` comes back as a
    ``[Sq, N, Dv]`` view of cuDNN's output.
    """
    Sq, N, _ = q.shape
    Skv = k.shape[0]
    if causal and Sq != Skv:
        raise ValueError(f"the cuDNN route's causal mask needs Sq == Skv, got {Sq} and {Skv}")
    if Sq == 0 or Skv == 0:
        o = q.new_zeros(Sq, N, v.shape[2])
        return o, torch.full((N, Sq), float("-inf"), dtype=torch.float32, device=q.device)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, True,
        0.0, bool(causal), False, scale=softmax_scale)
    o, lse = res[0], res[1]
    return o[0].transpose(0, 1), lse.reshape(N, Sq)


def pick_route(device: torch.device, dtype: torch.dtype, Sq: int, Skv: int, N: int, Nk: int,
               D: int, Dv: int, causal: bool, has_positions: bool) -> str:
    """``"cudnn"``, ``"triton"`` or ``"reference"`` for one attention call (see the module doc)."""
    if device.type != "cuda" or dtype == torch.float64:
        return "reference"
    cudnn_ok = (dtype in (torch.float16, torch.bfloat16) and Nk == N and not has_positions
                and (not causal or Sq == Skv) and D % 8 == 0 and D <= 256
                and Dv % 8 == 0 and Dv <= 256
                and torch.backends.cudnn.is_available())
    return "cudnn" if cudnn_ok else "triton"


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool = False,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [Sq,N,D]``, ``k [Skv,Nk,D]``, ``v [Skv,Nk,Dv]`` -> ``(o [Sq,N,Dv], lse [N,Sq])``.

    As the reference, by the route ``pick_route`` chooses; on the CPU that is the reference's
    own math. ``lse`` is float32 on the GPU routes.
    """
    check_float("q", q, ndim=3)
    check_float("k", k, ndim=3)
    check_float("v", v, ndim=3)
    check_same_dtype(q=q, k=k, v=v)
    check_same_device(q=q, k=k, v=v)
    Sq, N, D = q.shape
    Skv, Nk, _ = k.shape
    if k.shape[2] != D:
        raise ValueError(f"k must have head dim {D} (q's), got shape {list(k.shape)}")
    if v.shape[0] != Skv or v.shape[1] != Nk:
        raise ValueError(f"v must have shape [{Skv}, {Nk}, *] (k's tokens and heads), "
                         f"got {list(v.shape)}")
    if Nk == 0 or N % Nk:
        raise ValueError(f"q's heads ({N}) must be a multiple of k's heads ({Nk})")
    has_pos = q_positions is not None or k_positions is not None
    route = pick_route(q.device, q.dtype, Sq, Skv, N, Nk, D, v.shape[2], causal, has_pos)
    if route == "reference":
        return _reference_attention(q, k, v, softmax_scale, causal, q_positions, k_positions)
    if route == "cudnn":
        return cudnn_attention_with_lse(q, k, v, softmax_scale, causal)
    if has_pos:
        dq, dk = default_positions(Sq, Skv, q.device)
        q_positions = dq if q_positions is None else q_positions
        k_positions = dk if k_positions is None else k_positions
    da, _ = _split_dim(D)
    cu_q = torch.tensor([0, Sq], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, Skv], dtype=torch.int32, device=q.device)
    return flash_attention_with_lse(
        q[..., :da], q[..., da:] if da < D else None, k[..., :da], k[..., da:] if da < D else None,
        v, cu_q, cu_k, Sq, softmax_scale, causal, q_positions, k_positions)

