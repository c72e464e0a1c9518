"""Paged absorbed-MLA decode in Triton: ``mla.reference.decode.mla_decode_paged``, fast.

Same signature, shapes and conventions as the reference (FlashMLA's ``flash_mla_with_kvcache``):
``q [B, s_q, N, D]`` over ``kv_cache [num_blocks, block_size, D]`` (``D = Lkv + R = 576`` for
DeepSeek), V = the first ``head_dim_v`` columns of K; ``out [B, s_q, N, head_dim_v]`` in q's
dtype, ``lse [B, N, s_q]`` float32, ``+inf`` lse and 0 out for a query that sees no key; with
``causal`` query ``i`` sees keys ``0 .. L - s_q + i``.

How it is fast (docs/kernels.md):

- One KV "head" serves all query heads, so a program stacks up to ``BLOCK_M`` (16 or 64) of
  the request's ``s_q · N`` query rows as the M dimension of its dots. Each ``BLOCK_N × D`` KV
  tile is loaded once and serves them all; only when ``s_q · N > BLOCK_M`` do several head
  groups read the same tile (neighbouring programs, so the second read mostly hits L2).
- K and V are the same rows: the tile's first ``head_dim_v`` columns are loaded once and used
  for ``q_nope · k_nopeᵀ`` and for ``P · V``; the last ``D - head_dim_v`` (rope) columns only
  for the logits. The dims need not be powers of two (masked), e.g. the tiny preset's 32 + 8.
- Split-KV (Flash-Decoding): each request's keys are cut into runs of whole tiles, one
  program each, writing a partial ``(o, lse)``; a second small kernel merges them (conventions
  §6; ``mla.fast.decode.combine``). The default plans cut ``num_splits`` equal runs, with
  ``num_splits`` from host-known shapes only (batch, head groups, the block table's capacity,
  the SM count), never from device values, so a call never synchronizes and can be captured
  in a CUDA graph; with one split the first kernel writes the result directly. The
  batch-invariant plans (``batch_invariant=True``) cut runs of a fixed length instead, so the
  partition depends on the request's length alone (``mla.fast.decode.plan``).
- Online softmax in base 2 with the scale folded into one multiply; full tiles run without
  masks, only the tail (length end, causal diagonal) pays for them.

Validation: the shape/dtype/device checks (host metadata) run on the first call of each
combination of shapes, strides, dtypes, devices and pointer alignments, whose launch (plan,
route, grids, integer and constexpr arguments) is then kept; later calls look it up and launch
the compiled kernels directly (``mla.fast.launch``). The value checks of ``cache_seqlens`` and
``block_table`` (one host read) run with ``validate=True``, or with ``validate=None`` when the
global setting is on (``mla.fast.set_validation``; off by default) and no CUDA graph is being
captured. Without them the kernels still never read outside their tensors: a request whose
length is negative or beyond the block table's capacity, or whose used table entries leave
``[0, num_blocks)``, gets NaN out and NaN lse for every query (NaN here means "invalid input").

Sink: ``attn_sink [N]`` float32 scales out by ``exp(lse) / (exp(lse) + exp(sink))`` in the
epilogue of the kernel that writes out (the decode kernel, or the combine after a split).
"""

from __future__ import annotations

import dataclasses
import types

import torch
import triton
import triton.language as tl

from mla.fast import sm90
from mla.fast.common import (
    LOG2E,
    capability,
    check_batch_invariant,
    check_kernel_input,
    check_out,
    ensure_allocator,
    interpreting,
    next_pow2,
    num_sms,
    should_validate,
)
from mla.fast.decode.combine import combine_kernel, sink_factor
from mla.fast.decode.plan import DecodePlan, plan_decode, split_grid
from mla.fast.launch import CompiledLauncher, check_grid
from mla.fast.softmax import load_2d, softmax_pv
from mla.reference.decode import check_paged_decode_shapes, check_paged_decode_values
from mla.reference.sink import check_attn_sink
from mla.validation import check_scale

__all__ = ["DecodePlan", "plan_decode", "mla_decode_paged"]


# the longest cache a block table may address (its blocks x the block size): the kernels count
# key positions in int32, with room for a tile and a split past the last one
MAX_TABLE_TOKENS = 2**31 - 2**16


@triton.jit
def _attend(acc, l_i, m_i, bad, q_nope, q_pe, KV, kv_desc, pe_desc, bt_row, lo, hi, end, limit,
            qk_scale, stride_kvb, stride_kvr, num_blocks,
            DV: tl.constexpr, DR: tl.constexpr, PAGE_SIZE: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
            HAS_PE: tl.constexpr, PAGE_TILE: tl.constexpr, USE_TMA: tl.constexpr,
            MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr):
    """Online softmax over the key tiles ``[lo, hi)``; ``MASKED`` tiles also check
    ``key < end`` and, with ``CAUSAL``, ``key <= limit`` per query row.

    Full tiles of a page-aligned cache come through the tensor descriptors (TMA: one bulk
    copy per 128-byte column box, no per-thread addresses); the masked tail and other page
    sizes through pointer loads, which zero the rows past ``end`` (a TMA tile would carry
    whatever the cache holds there, NaN included, into ``P · V``).

    A block-table entry outside ``[0, num_blocks)`` is never followed: it reads page 0 instead
    and sets ``bad``, which the epilogue turns into NaN (one scalar compare per page tile)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    dv_mask = offs_dv < DV
    dr_mask = offs_dr < DR
    for start in range(lo, hi, BLOCK_N):
        kpos = start + offs_n
        kmask = kpos < end
        if USE_TMA and not MASKED:  # the tile is BLOCK_N consecutive rows of one page
            page = tl.load(bt_row + start // PAGE_SIZE)
            outside = (page < 0) | (page >= num_blocks)
            bad = bad | outside
            page = tl.where(outside, 0, page)
            row0 = page * PAGE_SIZE + start % PAGE_SIZE
            kv_nope = kv_desc.load([row0, 0])
            if HAS_PE:
                k_pe = pe_desc.load([row0, 0])
        else:
            if PAGE_TILE:  # the whole tile lies in one page: one table lookup
                page = tl.load(bt_row + start // PAGE_SIZE)
                outside = (page < 0) | (page >= num_blocks)
                bad = bad | outside
            else:
                if MASKED:
                    page = tl.load(bt_row + kpos // PAGE_SIZE, mask=kmask, other=0)
                else:
                    page = tl.load(bt_row + kpos // PAGE_SIZE)
                outside = (page < 0) | (page >= num_blocks)
                bad = bad | (tl.max(outside.to(tl.int32), 0) != 0)
            page = tl.where(outside, 0, page).to(tl.int64)
            row_off = page * stride_kvb + (kpos % PAGE_SIZE).to(tl.int64) * stride_kvr
            kv_nope = load_2d(KV + row_off[:, None] + offs_dv[None, :], kmask, dv_mask,
                               MASKED, BLOCK_DV != DV)
            if HAS_PE:
                k_pe = load_2d(KV + row_off[:, None] + DV + offs_dr[None, :], kmask, dr_mask,
                                MASKED, BLOCK_DR != DR)
        qk = tl.dot(q_nope, tl.trans(kv_nope), input_precision=DOT_PREC)
        if HAS_PE:
            qk = tl.dot(q_pe, tl.trans(k_pe), qk, input_precision=DOT_PREC)
        qk = qk * qk_scale  # log2 domain
        if MASKED:
            vis = kmask[None, :]
            if CAUSAL:
                vis = vis & (kpos[None, :] <= limit[:, None])
            qk = tl.where(vis, qk, float("-inf"))
        acc, m_i, l_i = softmax_pv(qk, m_i, l_i, acc, kv_nope, DOT_PREC)
    return acc, l_i, m_i, bad


@triton.jit
def _decode_kernel(
    Q, KV, BT, SEQLENS, O, LSE, OP, LSEP, SINK,
    stride_qb, stride_qt, stride_qh,
    stride_kvb, stride_kvr, stride_btb,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lh,
    qk_scale, num_splits, kv_rows, num_blocks, max_blocks,
    N: tl.constexpr, S_Q: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr, HAS_PE: tl.constexpr,
    PAGE_TILE: tl.constexpr, USE_TMA: tl.constexpr, CAUSAL: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SINK: tl.constexpr,
    DOT_PREC: tl.constexpr, SPLIT_TILES: tl.constexpr, SPLIT_CAP: tl.constexpr,
):
    """Grid ``(head groups, splits, B)``: the head groups of one key run are neighbours.
    ``SPLIT_TILES > 0``: fixed-length splits of at least that many tiles, at most
    ``SPLIT_CAP`` per request (``mla.fast.decode.plan``); 0: ``num_splits`` equal shares.

    A request whose length is negative or beyond the block table's ``max_blocks`` pages, or
    whose used table entries leave ``[0, num_blocks)``, reads nothing outside the tensors and
    gets NaN for every query (out and lse): the unvalidated path's "invalid input"."""
    ROWS: tl.constexpr = S_Q * N
    g = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)

    rows = g * BLOCK_M + tl.arange(0, BLOCK_M)  # flattened (t, h) query rows
    row_ok = rows < ROWS
    t = rows // N
    h = rows % N
    # addresses in int64: s_q·N·D passes 2^31 while q still fits in memory
    t64 = t.to(tl.int64)
    h64 = h.to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    dv_mask = offs_dv < DV

    q_row = Q + b.to(tl.int64) * stride_qb + t64 * stride_qt + h64 * stride_qh
    q_nope = load_2d(q_row[:, None] + offs_dv[None, :], row_ok, dv_mask, True, BLOCK_DV != DV)
    if HAS_PE:
        q_pe = load_2d(q_row[:, None] + DV + offs_dr[None, :], row_ok, offs_dr < DR, True,
                        BLOCK_DR != DR)
    else:
        q_pe = q_nope  # unused

    # this program's keys: an equal share of whole tiles of the request's length, or a run of
    # fixed length (a function of the request's length alone: batch invariant)
    L = tl.load(SEQLENS + b)
    # (L - 1) // PAGE_SIZE >= max_blocks: past the capacity, without overflowing L + PAGE_SIZE
    bad = (L < 0) | ((L > 0) & ((L - 1) // PAGE_SIZE >= max_blocks))
    L = tl.where(bad, 0, L)
    n_tiles = tl.cdiv(L, BLOCK_N)
    if SPLIT_TILES > 0:
        per_split = tl.maximum(tl.cdiv(n_tiles, SPLIT_CAP), SPLIT_TILES)
    else:
        per_split = tl.cdiv(n_tiles, num_splits)
    lo = split * per_split * BLOCK_N
    end = tl.minimum(lo + per_split * BLOCK_N, L)
    limit = L - S_Q + t  # last key query t sees (causal)
    if CAUSAL:
        full_end = tl.minimum(end, L - S_Q + 1)  # keys every query row sees
    else:
        full_end = end
    mid = lo + tl.maximum(full_end - lo, 0) // BLOCK_N * BLOCK_N  # end of the unmasked tiles

    # The tail (at most a tile plus the causal diagonal) goes in 16-key steps through masked
    # pointer loads: a 64-row masked gather needs enough address registers to make the whole
    # kernel spill, while 16 rows do not (ptxas for sm_90; benchmarks/notes/decode.md, v1).
    TAIL_N: tl.constexpr = 16
    bt_row = BT + b.to(tl.int64) * stride_btb
    if USE_TMA:  # descriptors over the cache as [num_blocks · block_size, D] rows
        kv_desc = tl.make_tensor_descriptor(KV, shape=[kv_rows, DV], strides=[stride_kvr, 1],
                                            block_shape=[BLOCK_N, BLOCK_DV])
        if HAS_PE:
            pe_desc = tl.make_tensor_descriptor(KV + DV, shape=[kv_rows, DR],
                                                strides=[stride_kvr, 1],
                                                block_shape=[BLOCK_N, BLOCK_DR])
        else:
            pe_desc = kv_desc  # unused
    else:
        kv_desc = KV  # unused
        pe_desc = KV
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i, bad = _attend(acc, l_i, m_i, bad, q_nope, q_pe, KV, kv_desc, pe_desc,
                                 bt_row, lo, mid, end, limit, qk_scale, stride_kvb,
                                 stride_kvr, num_blocks, DV, DR, PAGE_SIZE, BLOCK_N, BLOCK_DV,
                                 BLOCK_DR, HAS_PE, PAGE_TILE, USE_TMA, False, CAUSAL, DOT_PREC)
    acc, l_i, m_i, bad = _attend(acc, l_i, m_i, bad, q_nope, q_pe, KV, kv_desc, pe_desc,
                                 bt_row, mid, end, end, limit, qk_scale, stride_kvb,
                                 stride_kvr, num_blocks, DV, DR, PAGE_SIZE, TAIL_N, BLOCK_DV,
                                 BLOCK_DR, HAS_PE, PAGE_TILE, USE_TMA, True, CAUSAL, DOT_PREC)

    # l = 0 exactly when no key was seen; a NaN l (a NaN logit) is "seen" and stays NaN
    seen = l_i != 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453
    if SPLIT:
        # partials [B, splits, ROWS, DV] and [B, splits, ROWS]; "no key" is lse = -inf, and
        # a NaN lse (bad input) makes the combine's row NaN
        part = (b * num_splits + split).to(tl.int64) * ROWS + rows
        lse = tl.where(bad, float("nan"), tl.where(seen, lse, float("-inf")))
        tl.store(LSEP + part, lse, mask=row_ok)
        tl.store(OP + part[:, None] * DV + offs_dv[None, :], o,
                 mask=(row_ok & seen)[:, None] & dv_mask[None, :])
    else:
        if HAS_SINK:
            o = o * sink_factor(lse, seen, SINK, h, row_ok)[:, None]
        o = tl.where(bad, float("nan"), o)
        lse = tl.where(bad, float("nan"), tl.where(seen, lse, float("inf")))
        o_ptr = O + b.to(tl.int64) * stride_ob + t64 * stride_ot + h64 * stride_oh
        tl.store(o_ptr[:, None] + offs_dv[None, :], o.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & dv_mask[None, :])
        tl.store(LSE + b.to(tl.int64) * stride_lb + h64 * stride_lh + t64, lse, mask=row_ok)


def _tma_ok(kv_cache: torch.Tensor, DV: int, DR: int) -> bool:
    """Tensor descriptors need a Hopper-or-newer GPU (or the interpreter), blocks back to back
    (one 2-D ``[num_blocks · block_size, D]`` view) and 16-byte aligned rows and columns."""
    if kv_cache.device.type == "cuda":
        if capability(kv_cache.device)[0] < 9:
            return False
    elif not interpreting():
        return False
    nb, bs, _ = kv_cache.shape
    esize = kv_cache.element_size()
    return (nb * bs < 2**31 and (nb == 1 or kv_cache.stride(0) == bs * kv_cache.stride(1))
            and kv_cache.data_ptr() % 16 == 0 and (kv_cache.stride(1) * esize) % 16 == 0
            and (DR == 0 or (DV * esize) % 16 == 0))


def _sm90_route(plan: DecodePlan, q: torch.Tensor, kv_cache: torch.Tensor, DV: int) -> bool:
    """Whether this call goes to the Gluon sm_90 kernel (``mla.fast.sm90.decode``): a 64-row
    plan that allows it, on a Hopper GPU whose Triton can build the Gluon kernels."""
    if not (plan.sm90 and plan.block_m == 64) or q.device.type != "cuda" or interpreting():
        return False
    if not sm90.usable():
        return False
    from mla.fast.sm90.decode import supported

    return supported(q, kv_cache, DV)


@dataclasses.dataclass(frozen=True)
class _Launch:
    """What a call derives from its arguments' shapes, strides, dtypes, devices and pointer
    alignments (the cache key): the plan's grids, the integer and constexpr arguments, which
    kernel runs. Per call only the tensors and the scale remain to be passed."""

    out_shape: tuple[int, ...]
    lse_shape: tuple[int, ...]
    grid: tuple[int, int, int] | None  # None: nothing to compute (B = 0 or N = 0)
    sm90: bool = False
    seesaw: bool = False  # with sm90: the seesaw kernel
    copy: tuple[bool, bool, bool] = (False, False, False)  # q, kv_cache, block_table
    # split partials, one float32 buffer: o [B, splits, rows, DV] from 0, lse [B, splits, rows]
    # from part_lse (16-byte aligned); 0: no split
    part_size: int = 0
    part_lse: int = 0
    ints: tuple[int, ...] = ()  # strides of the decode kernel
    tail: tuple[int, ...] = ()  # num_splits, kv_rows, num_blocks, max_blocks
    constexprs: tuple[object, ...] = ()
    allocator: bool = False  # in-kernel tensor descriptors: the scratch allocator is needed
    options: dict[str, int] = dataclasses.field(default_factory=dict)
    combine_grid: tuple[int, int, int] | None = None  # None: no combine launch
    combine_ints: tuple[int, ...] = ()
    combine_constexprs: tuple[object, ...] = ()


_INF = float("inf")
_launches: dict[object, _Launch] = {}
_MAX_LAUNCHES = 4096  # distinct shapes kept (a serving engine sees a few hundred)
_triton_decode = CompiledLauncher(_decode_kernel)
_triton_combine = CompiledLauncher(combine_kernel)
# built at the first sm_90 call (importing Gluon), again if the module's kernel is replaced
_sm90_module: types.ModuleType | None = None
_sm90_decode: CompiledLauncher | None = None
_sm90_seesaw: CompiledLauncher | None = None


def _key(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
         cache_seqlens: torch.Tensor, causal: bool, head_dim_v: int,
         attn_sink: torch.Tensor | None, plan: DecodePlan | None,
         batch_invariant: bool) -> tuple:
    """Everything the argument checks and ``_prepare`` read, and every specialization Triton
    gives the kernels' arguments: two calls with equal keys pass the same checks and launch
    the same compiled kernels with the same integer arguments."""
    sink = None if attn_sink is None else (
        attn_sink.shape, attn_sink.stride(), attn_sink.dtype, attn_sink.device,
        attn_sink.data_ptr() % 16 == 0)
    return (q.shape, q.stride(), q.dtype, q.device, q.data_ptr() % 16 == 0,
            kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device,
            kv_cache.data_ptr() % 16 == 0,
            block_table.shape, block_table.stride(), block_table.dtype, block_table.device,
            block_table.data_ptr() % 16 == 0,
            cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype,
            cache_seqlens.device, cache_seqlens.data_ptr() % 16 == 0,
            causal, type(causal), head_dim_v, type(head_dim_v), sink, plan,
            batch_invariant, type(batch_invariant))


def _prepare(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
             cache_seqlens: torch.Tensor, softmax_scale: float, causal: bool, head_dim_v: int,
             attn_sink: torch.Tensor | None, plan: DecodePlan | None,
             batch_invariant: bool) -> _Launch:
    """The argument checks that read host metadata, then the launch: once per key."""
    check_paged_decode_shapes(q, kv_cache, block_table, cache_seqlens, softmax_scale,
                              head_dim_v)
    capacity = block_table.shape[1] * kv_cache.shape[1]
    if capacity > MAX_TABLE_TOKENS:
        raise ValueError(f"block_table's capacity must be at most {MAX_TABLE_TOKENS} tokens "
                         f"(2^31 - 2^16: the kernels count key positions in int32), got "
                         f"{block_table.shape[1]} blocks x {kv_cache.shape[1]} = {capacity}")
    check_kernel_input(q)
    check_attn_sink(attn_sink, q.shape[2], q.device)
    if plan is not None and not isinstance(plan, DecodePlan):
        raise TypeError(f"plan must be a DecodePlan or None, got {type(plan).__name__}")
    check_batch_invariant(batch_invariant, plan)
    B, s_q, N, D = q.shape
    num_blocks, block_size, _ = kv_cache.shape
    DV, DR = head_dim_v, D - head_dim_v
    out_shape, lse_shape = (B, s_q, N, DV), (B, N, s_q)
    if B == 0 or N == 0:
        return _Launch(out_shape, lse_shape, None)
    if plan is None:
        plan = plan_decode(B, s_q, N, D, DV, block_table.shape[1], block_size, q.dtype,
                           num_sms(q.device), batch_invariant=batch_invariant)
    rows = s_q * N
    sm90_route = (_sm90_route(plan, q, kv_cache, DV)  # and the plan's kernel not given up
                  and sm90.usable("seesaw_kernel" if plan.seesaw else "decode_kernel"))
    tile = 64 if sm90_route else plan.block_n  # the kernel's keys per tile
    if plan.split_keys % tile:
        raise ValueError(f"plan.split_keys ({plan.split_keys}) must be a multiple of the "
                         f"kernel's tile ({tile} keys)")
    splits = split_grid(plan, capacity, tile)
    # fixed-length splits always end in the combine, one split too (the same kernels, so the
    # same bits, whatever the grid: mla.fast.decode.plan)
    split = splits > 1 or plan.split_keys > 0
    grid = (triton.cdiv(rows, plan.block_m), splits, B)
    check_grid("mla_decode_paged (grid: row groups of s_q x heads, splits, requests)", grid)
    if split:
        check_grid("mla_decode_paged (combine grid: s_q x heads, requests)", (rows, B, 1))
    # the kernels need unit stride along the head dim (vectorized rows); copy only if not
    copy = (q.stride(3) != 1, kv_cache.stride(2) != 1, block_table.stride(1) != 1)
    q = q.contiguous() if copy[0] else q
    kv_cache = kv_cache.contiguous() if copy[1] else kv_cache
    block_table = block_table.contiguous() if copy[2] else block_table
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    has_sink = attn_sink is not None
    ints = (q.stride(0), q.stride(1), q.stride(2),
            kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1))
    tail = (splits, num_blocks * block_size, num_blocks, block_table.shape[1])
    block_dv = max(16, next_pow2(DV))
    # fixed-length splits: tiles per split, most splits per request (0, 0: equal shares)
    fixed = (plan.split_keys // tile, plan.num_splits) if plan.split_keys else (0, 0)
    o_size = -(-B * splits * rows * DV // 4) * 4
    common = dict(
        out_shape=out_shape, lse_shape=lse_shape,
        grid=grid, copy=copy,
        part_size=o_size + B * splits * rows if split else 0,
        part_lse=o_size,
        ints=ints, tail=tail,
        combine_grid=(rows, B, 1) if split else None,
        combine_ints=(out.stride(0), out.stride(1), out.stride(2), lse.stride(0),
                      lse.stride(1)),
        combine_constexprs=(N, s_q, DV, block_dv, max(2, next_pow2(splits)), has_sink,
                            plan.split_keys > 0))
    if sm90_route:
        return _Launch(sm90=True, seesaw=plan.seesaw, allocator=True,
                       constexprs=(N, s_q, block_size, bool(causal), split, has_sink, *fixed),
                       options={"num_warps": 4 if plan.seesaw else 8}, **common)
    page_tile = block_size % plan.block_n == 0
    use_tma = plan.use_tma and page_tile and _tma_ok(kv_cache, DV, DR)
    constexprs = (N, s_q, DV, DR, block_size, plan.block_m, plan.block_n, block_dv,
                  max(16, next_pow2(DR)) if DR else 16, DR > 0, page_tile, use_tma,
                  bool(causal), split, has_sink,
                  "ieee" if q.dtype == torch.float32 else "tf32", *fixed)
    return _Launch(constexprs=constexprs, allocator=use_tma,
                   options={"num_warps": plan.num_warps, "num_stages": plan.num_stages},
                   **common)


def mla_decode_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool = False,
    head_dim_v: int = 512,
    *,
    attn_sink: torch.Tensor | None = None,
    validate: bool | None = None,
    plan: DecodePlan | None = None,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MQA of ``q [B, s_q, N, D]`` over the paged latent cache ``kv_cache [nb, bs, D]``.

    Returns ``out [B, s_q, N, head_dim_v]`` (q's dtype) and ``lse [B, N, s_q]`` (float32,
    ``+inf`` for a query with no visible key), as ``mla.reference.mla_decode_paged``.

    ``attn_sink [N]`` float32: the reference's sink (``mla.reference.sink``), applied in the
    kernels' epilogue: out scaled by ``exp(lse) / (exp(lse) + exp(sink))``, lse unchanged.
    ``validate``: run the value checks of ``cache_seqlens``/``block_table`` (one host read);
    ``None`` (default): as ``mla.fast.set_validation`` says (off unless turned on), never while
    a CUDA graph is being captured. Unvalidated bad values give NaN for their request.
    ``plan``: launch parameters; default ``plan_decode(...)`` from the shapes.
    ``batch_invariant``: a request's result is the same bits alone or in any batch (FlashMLA's
    ``enable_batch_invariant``): the plan (``plan_decode(..., batch_invariant=True)``) splits
    each request's keys into runs of a fixed length, which do not depend on the batch, and
    merges them in a fixed order (``mla.fast.decode.plan``); a given ``plan`` must split so
    (``split_keys > 0``) or not at all. ``out``: a preallocated contiguous
    ``[B, s_q, N, head_dim_v]`` tensor of q's dtype to write and return.
    """
    global _sm90_decode, _sm90_module, _sm90_seesaw
    try:
        key = _key(q, kv_cache, block_table, cache_seqlens, causal, head_dim_v, attn_sink,
                   plan, batch_invariant)
        launch = _launches.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks say why
        key, launch = None, None
    if launch is None:
        launch = _prepare(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal,
                          head_dim_v, attn_sink, plan, batch_invariant)
        if key is not None:
            if len(_launches) >= _MAX_LAUNCHES:  # shape churn: start again, kernels too
                _launches.clear()
                for launcher in (_triton_decode, _triton_combine, _sm90_decode, _sm90_seesaw):
                    if launcher is not None:
                        launcher.compiled.clear()
            _launches[key] = launch
    elif not (type(softmax_scale) is float and 0.0 < softmax_scale < _INF):
        check_scale("softmax_scale", softmax_scale)  # the one argument the key leaves out
    if should_validate(validate, q):
        check_paged_decode_values(kv_cache, block_table, cache_seqlens)

    device = q.device
    out = (torch.empty(launch.out_shape, dtype=q.dtype, device=device) if out is None
           else check_out(out, launch.out_shape, q))
    lse = torch.empty(launch.lse_shape, dtype=torch.float32, device=device)
    if launch.grid is None:
        return out, lse
    copy_q, copy_kv, copy_bt = launch.copy
    q = q.contiguous() if copy_q else q
    kv_cache = kv_cache.contiguous() if copy_kv else kv_cache
    block_table = block_table.contiguous() if copy_bt else block_table
    if launch.part_size:
        o_part = torch.empty(launch.part_size, dtype=torch.float32, device=device)
        lse_part = o_part[launch.part_lse:]
    else:
        o_part, lse_part = out, lse  # unused
    if attn_sink is None:
        sink = lse  # an unused pointer
    else:
        sink = attn_sink if attn_sink.stride(0) == 1 else attn_sink.contiguous()
    ptrs = (q, kv_cache, block_table, cache_seqlens, out, lse, o_part, lse_part, sink)
    rest = (*launch.ints, softmax_scale * LOG2E, *launch.tail, *launch.constexprs)
    if launch.sm90:
        if _sm90_module is None:
            from mla.fast.sm90 import decode as _sm90_module
        if _sm90_decode is None or _sm90_decode.fn is not _sm90_module.decode_kernel:
            _sm90_decode = CompiledLauncher(_sm90_module.decode_kernel)
        launcher = _sm90_decode
        if launch.seesaw:
            if _sm90_seesaw is None:
                from mla.fast.sm90.decode_seesaw import seesaw_kernel

                _sm90_seesaw = CompiledLauncher(seesaw_kernel)
            launcher = _sm90_seesaw
        ensure_allocator()  # the Gluon kernel's tensor descriptors
        if not sm90.launch_compiled(launcher, key, launch.grid, ptrs + rest,
                                    **launch.options):
            # the Gluon kernel cannot be built here: this call and every later one of its
            # plan take the Triton route (``sm90.usable(name)`` is False from now on)
            _launches.pop(key, None)
            return mla_decode_paged(q, kv_cache, block_table, cache_seqlens, softmax_scale,
                                    causal, head_dim_v, attn_sink=attn_sink, validate=False,
                                    plan=plan, batch_invariant=batch_invariant, out=out)
    else:
        if launch.allocator:
            ensure_allocator()
        _triton_decode(key, launch.grid, ptrs + rest, **launch.options)
    if launch.combine_grid is not None:
        _triton_combine(key, launch.combine_grid,
                        (o_part, lse_part, out, lse, sink, launch.tail[0],
                         *launch.combine_ints, *launch.combine_constexprs), num_warps=4)
    return out, lse
