"""Sparse top-k MLA in Triton: ``mla.reference.sparse``'s ``sparse_mla_decode`` and
``sparse_mla_prefill``, fast (DeepSeek-V3.2's DSA; FlashMLA's ``flash_mla_with_kvcache`` with
indices and ``flash_mla_sparse_fwd``).

Same signatures, shapes and conventions as the reference (conventions §10 and §12): per query,

    s_j        = sm_scale · q · kv[indices[j]]          j < topk_length, index valid
    max_logits = max_j s_j
    lse        = log Σ_j exp(s_j)
    out        = Σ_j exp(s_j - lse) · kv[indices[j], :d_v]

a repeated index counts once per appearance; a lonely query (no valid index) gets ``out = 0``,
``lse = +inf``, ``max_logits = -inf``. DeepSeek-V4's conventions (§14) too: ``attn_sink``
(decode and prefill), the MODEL1 cache, a second KV scope (decode), rows of ``d_qk = 512``
with V the whole row, ``topk_length`` on every path.

How (docs/kernels.md, "Sparse"):

- One program takes all heads of one query (up to ``BLOCK_M = 64`` of them) as the M dimension
  of its dots: the query's ``topk`` rows are gathered once per head group (128 heads: two
  neighbouring programs, the second gather mostly hits L2) and serve every head.
- The ``topk`` list is walked in tiles of ``BLOCK_N`` entries: load the indices, gather those
  cache rows by index (int64 row offsets: ``n_slots · 656`` bytes passes 2^31 at 3.3M slots),
  ``qk = q_nope · k_nopeᵀ + q_pe · k_peᵀ``, online softmax in base 2, ``acc += p · k_nope``.
  K and V are the same rows: the gathered ``k_nope`` tile is V. Invalid entries (``-1``, or at
  least the number of rows, or past ``topk_length``) load zeros and get ``-inf`` logits.
- ``fp8_ds_mla`` cache (656-byte rows): the kernel loads the 512 e4m3 bytes, bitcasts them to
  ``float8e4nv``, converts to float32 and multiplies by the row's four float32 scales (one per
  128 values; a power of two, so the product is exact in bf16), and loads the 64 bf16 rope
  values as they are; the dequantized tile goes straight into the dots in q's dtype. The cache
  is read through uint8, float32 and bfloat16 views of the same bytes (656 = 4 · 164).
- MODEL1 pages (DeepSeek-V4): the page is found by the block stride, the token's 576-byte
  data row and its 7 UE8M0 scale bytes inside it (``mla.fast.sparse.kernels``); the row is
  read as 8 tiles of 64 (7 scaled e4m3 tiles, then the bf16 rope tile) into one 512-wide K
  that is also V.
- A second KV scope (``extra_k_cache``): the kernel walks the second list after the first,
  in the same online softmax (the same ``(m, l, acc)``), with its own cache, page layout,
  indices and ``extra_topk_length``; the splits cut the two lists as one list of tiles.
- ``attn_sink``: applied once, where the softmax ends: in the kernel's epilogue, or, with
  splits, in the combine kernel after the merge (never per split: it would count twice).
  The output is multiplied by ``1 / (1 + 2^(sink·log2 e − lse₂))`` in float32 (``lse₂`` the
  base-2 lse), which is ``σ(lse − sink)``: exactly 1 for ``-inf``, 0 for ``+inf``, NaN for
  NaN; ``lse`` and ``max_logits`` are left alone.
- Split-``topk`` (Flash-Decoding): when ``queries × head groups`` is below the SMs' worth of
  programs, each query's list is cut into ``num_splits`` runs of whole tiles; partial
  ``(o, lse, max)`` go to float32 scratch and a second kernel merges them by lse (conventions §6).
  ``num_splits`` comes from shapes only, so a call never synchronizes (CUDA graphs). With
  ``batch_invariant=True`` the runs have a fixed length instead, whatever the batch
  (``mla.fast.sparse.plan``).
- The Gluon sm_90 kernel (``mla.fast.sm90.sparse``) takes the 64-head programs over
  DeepSeek-V3.2's rows (bf16/fp16 or ``fp8_ds_mla``), DeepSeek-V4's rows of 512 (in q's
  dtype, or MODEL1 pages with bf16 q), one or two scopes, sinks included; over MODEL1 pages
  the plan's ``model1_kernel`` picks it or (the default) the warp-specialized kernel of
  ``mla.fast.sm90.sparse_ws``; over ``fp8_ds_mla`` rows (decode) the plan's ``ds_mla_kernel``
  picks it or (the default) the warp-specialized kernel of ``mla.fast.sm90.sparse_ws_ds``;
  over rows in q's dtype the plan's ``bf16_kernel`` picks it, the warp-specialized kernel of
  ``mla.fast.sm90.sparse_ws_bf16`` (the default in decode) or the seesaw kernel of
  ``mla.fast.sm90.sparse_seesaw`` (the default in prefill; one scope, else the
  warp-specialized one).

``convert_req_index_to_global_index`` (``mla.fast.sparse.index``, re-exported here): the
indexer's request-local top-k positions to the cache slots these kernels read.

Host: a call's key (every tensor's shape, strides, dtype, device and address modulo 16; the
scalars; the plan) fixes everything it derives: the checks that read host metadata, the plan,
the views, every integer and constexpr argument, the route. The first call of a key does all
that and launches through Triton's JIT; later calls allocate the outputs and launch the kept
compiled kernels directly (``mla.fast.launch``), the arguments' addresses in place of their
views (as ``mla.fast.decode`` does): the host cost of a call is then a few tens of µs, under
what its kernel runs.

Validation: shape/dtype/device checks (host metadata) run at a key's first call (an equal key
passes them again). The value checks read device tensors on the host (a sync):
``topk_length``'s range, for decode the indices' range ``[-1, num_slots)`` (both scopes).
They run with ``validate=True``, or with ``validate=None`` when the global setting is on
(``mla.fast.set_validation``; off by default), never while a CUDA graph is being captured.
Without them the kernels still never read outside their tensors and never return a plausible
wrong answer:

- a query whose ``topk_length`` (or ``extra_topk_length``) lies outside ``[0, topk]`` gets NaN
  ``out``, ``lse`` and ``max_logits`` (its reads stay inside the index row);
- decode: a query that uses an entry (before its length) outside ``[-1, num_slots)`` of its
  scope gets NaN ``out`` and ``lse``: the entry is a NaN logit, its row is never read. Entries
  past a query's length are not read at all, so their values do not matter;
- prefill: an index outside ``[0, s_kv)`` is simply invalid, as the reference's contract says
  (dropped, like ``-1``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import torch
import triton

from mla.fast import sm90
from mla.fast.common import (
    LOG2E,
    check_batch_invariant,
    check_kernel_input,
    check_out,
    interpreting,
    next_pow2,
    num_sms,
    should_validate,
)
from mla.fast.launch import CompiledLauncher, check_grid
from mla.fast.sparse.index import convert_req_index_to_global_index
from mla.fast.sparse.kernels import DS_MLA, MODEL1, PLAIN, combine_kernel, sparse_kernel
from mla.fast.sparse.plan import SparsePlan, plan_sparse, split_grid
from mla.fast.sparse.scope import (
    Scope,
    View,
    contiguous_view,
    decode_scope,
    plain_scope,
    unit_stride,
)
from mla.reference.fp8 import D_NOPE, ROPE_OFFSET
from mla.reference.sparse import (
    _check_topk_length_values,
    check_sparse_decode_shapes,
    check_sparse_decode_values,
    check_sparse_prefill_shapes,
)
from mla.validation import check_scale

__all__ = ["SparsePlan", "convert_req_index_to_global_index", "plan_sparse",
           "sparse_mla_decode", "sparse_mla_prefill"]


# ------------------------------------------------------------------ the host side of a call
#
# A call's sources, in this order: q, the cache (decode) or kv (prefill), the indices, the
# lengths, the second scope's cache, indices and lengths (decode), the sink. The kernels'
# pointer inputs are views of them ("slots", in this order):
_Q, _KV, _KV_F32, _KV_BF16, _IDX, _LEN, _KV2, _KV2_F32, _KV2_BF16, _IDX2, _LEN2, _SINK = range(12)
# then the outputs and the split partials
_OUT, _LSE, _MAXL, _OP, _LSEP, _MAXP = range(12, 18)
# the slots each kernel takes, in its parameter order
_TRITON_SLOTS = tuple(range(18))
_SM90_SLOTS = (_Q, _KV, _IDX, _LEN, _KV2, _IDX2, _LEN2, _SINK, _OUT, _LSE, _MAXL, _OP, _LSEP,
               _MAXP)
_COMBINE_SLOTS = (_OP, _LSEP, _MAXP, _SINK, _OUT, _LSE, _MAXL)

@dataclasses.dataclass(frozen=True)
class _Launch:
    """What a call derives from its arguments' shapes, strides, dtypes, devices and pointer
    alignments (the cache key): the checks passed, the plan, the views, every integer and
    constexpr argument, which kernels run. Per call only the tensors and the scale remain."""

    out_shapes: tuple[tuple[int, ...], ...]  # out, lse (decode) / out, max_logits, lse
    grid: tuple[int, int, int] | None = None  # None: nothing to compute
    sm90: bool = False
    # the Gluon kernel: mla.fast.sm90.sparse's (""), or a warp-specialized one: "model1"
    # (mla.fast.sm90.sparse_ws's), "ds_mla" (mla.fast.sm90.sparse_ws_ds's) or "bf16"
    # (mla.fast.sm90.sparse_ws_bf16's, rows in q's dtype)
    sm90_ws: str = ""
    # per input slot: (source, view) for the JIT, which types each pointer by its view's dtype
    jit_inputs: tuple[tuple[int, View] | None, ...] = ()
    # per input slot: (source, view or None where the view starts at the source's address)
    # for a direct launch (the compiled kernel's pointer types are fixed)
    direct_inputs: tuple[tuple[int, View | None] | None, ...] = ()
    # the slot each kernel pointer reads (absent inputs replaced by an unused present one)
    ptr_map: tuple[int, ...] = ()
    # split partials, one float32 buffer: o from 0, lse from part_lse, max from part_max
    part_size: int = 0
    part_lse: int = 0
    part_max: int = 0
    ints: tuple[int, ...] = ()  # strides, rows and list lengths (before the scale)
    tail: tuple[object, ...] = ()  # num_splits and the constexprs (after the scale)
    options: dict[str, int] = dataclasses.field(default_factory=dict)
    combine_map: tuple[int, ...] = ()
    combine_args: tuple[object, ...] = ()  # num_splits, strides, constexprs; () no combine
    combine_grid: tuple[int, int, int] = (1, 1, 1)


_launches: dict[object, _Launch] = {}
_MAX_LAUNCHES = 4096  # distinct keys kept (a serving engine sees a few hundred)
_triton_sparse = CompiledLauncher(sparse_kernel)
_triton_combine = CompiledLauncher(combine_kernel)
_sm90_sparse: CompiledLauncher | None = None  # built at the first sm_90 launch
_sm90_ws: dict[str, CompiledLauncher] = {}  # per warp-specialized kernel, built at its launch
# the Gluon kernels (``_Launch.sm90_ws``; "": the coupled kernel): module of mla.fast.sm90, name
_SM90_KERNELS = {"": ("sparse", "sparse_kernel"), "model1": ("sparse_ws", "model1_ws_kernel"),
                 "ds_mla": ("sparse_ws_ds", "ds_mla_ws_kernel"),
                 "bf16": ("sparse_ws_bf16", "plain_ws_kernel"),
                 "seesaw": ("sparse_seesaw", "plain_seesaw_kernel")}
_INF = float("inf")


def _tkey(t: torch.Tensor | None) -> tuple | None:
    """A tensor's part of a key: all the argument checks, views and Triton's specializations
    read (the address only modulo 16: alignment and the MODEL1 pages' even address)."""
    if t is None:
        return None
    return (type(t), t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def _prepare(q_view: View, sources: tuple, scopes: list[Scope], fmt: int, S: int,
             has_maxl: bool, dv: int, plan: SparsePlan | None,
             out_shapes: tuple[tuple[int, ...], ...],
             batch_invariant: bool = False) -> _Launch:
    """The launch of checked arguments: ``q_view(q)`` ``[Q, N, D]`` over one or two scopes into
    ``out [Q, N, dv]``, lse (decode ``[B, N, s_q]``, ``S = s_q``; prefill ``[s_q, N]``,
    ``S = 1``) and, with ``has_maxl`` (prefill), ``max_logits [Q, N]``. Decode (no max
    logits) also turns an entry outside ``[-1, rows)`` into a NaN query. ``batch_invariant``:
    the default plan is ``plan_sparse(..., batch_invariant=True)``'s."""
    q = q_view(sources[0])
    Q, N, D = q.shape
    first = scopes[0]
    has_extra = len(scopes) > 1
    extra = scopes[1] if has_extra else first
    topk, topk2 = first.idx.shape[1], extra.idx.shape[1] if has_extra else 0
    if plan is None:
        plan = plan_sparse(Q, N, topk + topk2, q.dtype, fmt != PLAIN, num_sms(q.device),
                           model1=fmt == MODEL1, batch_invariant=batch_invariant,
                           prefill=has_maxl)
    # the input slots: q, the first scope's views (sources 1-3), the second's (4-6), the sink
    jit: list[tuple[int, View] | None] = [(0, q_view)]
    for base, sc, present in ((1, first, True), (4, extra, has_extra)):
        kv_v, f32_v, bf16_v, idx_v, len_v = sc.views
        jit += [(base, kv_v), (base, f32_v), (base, bf16_v), (base + 1, idx_v)]
        jit.append((base + 2, len_v) if sc.has_length else None)
        if not present:
            jit[-5:] = [None] * 5
    jit.append((7, contiguous_view) if sources[7] is not None else None)
    direct = tuple(None if e is None else
                   (e[0], None if e[1](sources[e[0]]).data_ptr() == sources[e[0]].data_ptr()
                    else e[1])
                   for e in jit)
    # absent inputs read an unused present tensor in their place
    slot = list(range(18))
    if not first.has_length:
        slot[_LEN] = _IDX
    if not has_extra:
        slot[_KV2:_LEN2 + 1] = slot[_KV:_LEN + 1]
    elif not extra.has_length:
        slot[_LEN2] = _IDX2
    # the Gluon kernel the plan names (``_SM90_KERNELS``), where the call goes to one
    ws = ("model1" if fmt == MODEL1 and plan.model1_kernel == "warp_specialized" else
          "ds_mla" if fmt == DS_MLA and plan.ds_mla_kernel == "warp_specialized" else
          "seesaw" if (fmt == PLAIN and plan.bf16_kernel == "seesaw_producer"
                       and not has_extra) else
          "bf16" if fmt == PLAIN and plan.bf16_kernel != "staged" else "")
    sm90_route = (_sm90_route(plan, q, first.kv, dv, fmt, extra.kv if has_extra else None)
                  and sm90.usable(_SM90_KERNELS[ws][1]))
    tile = 64 if sm90_route else plan.block_n  # the kernel's entries per tile
    if plan.split_entries % tile:
        raise ValueError(f"plan.split_entries ({plan.split_entries}) must be a multiple of the "
                         f"kernel's tile ({tile} entries)")
    splits = split_grid(plan, -(-topk // tile) + -(-topk2 // tile), tile)
    # fixed-length splits always end in the (ordered) combine, one split too
    split = splits > 1 or plan.split_entries > 0
    # fixed-length splits: tiles per split, most splits per query (0, 0: equal shares)
    fixed = (plan.split_entries // tile, plan.num_splits) if plan.split_entries else (0, 0)
    for s, present in ((_SINK, sources[7] is not None), (_MAXL, has_maxl), (_OP, split),
                       (_LSEP, split), (_MAXP, split)):
        if not present:
            slot[s] = _LSE
    DV, DR = dv, D - dv
    block_dv = max(16, next_pow2(DV))
    groups = triton.cdiv(N, plan.block_m)
    # the outputs' strides, as torch.empty lays them out
    out_s = (N * dv, dv)
    if has_maxl:  # prefill: lse [s_q, N]; max_logits [s_q, N]
        lse_s, m_s = (N, 0, 1), (N, 1)
    else:  # decode: lse [B, N, s_q] read as (b, t, head)
        lse_s, m_s = (N * S, 1, S), (0, 0)
    o_size = -(-Q * splits * N * DV // 4) * 4
    l_size = -(-Q * splits * N // 4) * 4
    flags = dict(has_sink=sources[7] is not None, check_range=not has_maxl)
    if sm90_route:
        def layout(sc: Scope) -> tuple[int, int]:  # (row or page stride, page size)
            return (sc.page_stride if fmt == MODEL1 else sc.kv.stride(0), sc.page_size)
        ints = (q.stride(0), q.stride(1), first.idx.stride(0), *layout(first),
                extra.idx.stride(0), *layout(extra), *out_s, *lse_s, *m_s,
                first.n_rows, topk, extra.n_rows, topk2)
        if ws:
            # the bf16 kernel also takes HAS_PE (rows of 576, or of 512 with V the whole row)
            tail = (splits, N, S, groups, *((DR > 0,) if ws in ("bf16", "seesaw") else ()),
                    has_extra,
                    has_extra and extra.has_length, first.has_length, flags["has_sink"],
                    flags["check_range"], has_maxl, split, *fixed)
        else:
            tail = (splits, N, S, groups, fmt == DS_MLA, fmt == MODEL1, DR > 0,
                    has_extra, has_extra and extra.has_length, first.has_length,
                    flags["has_sink"], flags["check_range"], has_maxl, split,
                    D_NOPE if fmt == DS_MLA else 0, ROPE_OFFSET,
                    2 if fmt == MODEL1 and plan.num_stages >= 2 else 1, *fixed)
        # the seesaw kernel: group 0 in the launch's 4 warps, group 1 and the producer in 4
        # more each
        ptr_map = tuple(slot[s] for s in _SM90_SLOTS)
        options = {"num_warps": 4 if ws == "seesaw" else 8}
    else:
        ints = (q.stride(0), q.stride(1), first.idx.stride(0), first.stride_row,
                first.page_size, first.page_stride, extra.idx.stride(0), extra.stride_row,
                extra.page_size, extra.page_stride, *out_s, *lse_s, *m_s,
                first.n_rows, topk, extra.n_rows, topk2)
        tail = (splits, N, S, groups, DV, DR, plan.block_m, plan.block_n, block_dv,
                max(16, next_pow2(DR)) if DR else 16, DR > 0, fmt, first.has_length,
                has_extra, has_extra and extra.has_length, flags["has_sink"],
                flags["check_range"], has_maxl, split,
                "ieee" if q.dtype == torch.float32 else "tf32", *fixed)
        ptr_map = tuple(slot[s] for s in _TRITON_SLOTS)
        options = {"num_warps": plan.num_warps, "num_stages": plan.num_stages}
    grid, combine_grid = (Q * groups, splits, 1), (Q * N, 1, 1)
    name = "sparse_mla_prefill" if has_maxl else "sparse_mla_decode"
    check_grid(f"{name} (grid: queries x head groups, splits)", grid)
    combine_args: tuple = ()
    if split:
        check_grid(f"{name} (combine grid: queries x heads)", combine_grid)
        combine_args = (splits, *out_s, *lse_s, *m_s, N, S, DV, block_dv,
                        max(2, next_pow2(splits)), flags["has_sink"], has_maxl,
                        plan.split_entries > 0)
    return _Launch(out_shapes, grid, sm90_route,
                   ws if sm90_route else "", tuple(jit),
                   direct, ptr_map, o_size + 2 * l_size if split else 0, o_size,
                   o_size + l_size, ints, tail, options,
                   tuple(slot[s] for s in _COMBINE_SLOTS), combine_args, combine_grid)


def _run(key: object, launch: _Launch, sources: tuple, sm_scale: float,
         prepare: Callable[[], _Launch], out: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, ...]:
    """Allocate the outputs (``out``: the caller's, checked) and launch: directly (kept
    compiled kernels, the sources in place of their views) when possible, else through the JIT
    with the typed views."""
    global _sm90_sparse
    q = sources[0]
    outs = [torch.empty(launch.out_shapes[0], dtype=q.dtype, device=q.device) if out is None
            else check_out(out, launch.out_shapes[0], q)]
    outs += [torch.empty(s, dtype=torch.float32, device=q.device) for s in launch.out_shapes[1:]]
    if launch.grid is None:
        return tuple(outs)
    out, lse = outs[0], outs[-1]
    maxl = outs[1] if len(outs) == 3 else lse
    part = (torch.empty(launch.part_size, dtype=torch.float32, device=q.device)
            if launch.part_size else None)
    scale = sm_scale * LOG2E
    if launch.sm90:
        module, name = _SM90_KERNELS[launch.sm90_ws]
        kernel = getattr(importlib.import_module(f"mla.fast.sm90.{module}"), name)
        if launch.sm90_ws:
            ws_launcher = _sm90_ws.get(launch.sm90_ws)
            if ws_launcher is None or ws_launcher.fn is not kernel:
                ws_launcher = _sm90_ws[launch.sm90_ws] = CompiledLauncher(kernel)
            launcher = ws_launcher
        else:
            if _sm90_sparse is None or _sm90_sparse.fn is not kernel:
                _sm90_sparse = CompiledLauncher(kernel)
            launcher = _sm90_sparse
    else:
        launcher = _triton_sparse
    if key is not None and launcher.direct and not interpreting():
        vals = [None if e is None else sources[e[0]] if e[1] is None else e[1](sources[e[0]])
                for e in launch.direct_inputs]
        if part is not None:
            p = part.data_ptr()
            vals += [out, lse, maxl, p, p + 4 * launch.part_lse, p + 4 * launch.part_max]
        else:
            vals += [out, lse, maxl, None, None, None]
        args = (*[vals[i] for i in launch.ptr_map], *launch.ints, scale, *launch.tail)
        if launcher.launch_kept(key, launch.grid, args):
            if launch.combine_args and not _triton_combine.launch_kept(
                    key, launch.combine_grid,
                    (*[vals[i] for i in launch.combine_map], *launch.combine_args)):
                _combine(key, launch, sources, out, lse, maxl, part)
            return tuple(outs)
    vals = [None if e is None else e[1](sources[e[0]]) for e in launch.jit_inputs]
    vals += [out, lse, maxl, *_parts(launch, part, lse)]
    args = (*[vals[i] for i in launch.ptr_map], *launch.ints, scale, *launch.tail)
    if launch.sm90:
        if not sm90.launch_compiled(launcher, key, launch.grid, args, **launch.options):
            # the Gluon kernel cannot be built here: this key and every later one naming it
            # take the Triton route (``sm90.usable(name)`` is False from now on)
            launch = prepare()
            if key is not None:
                _launches[key] = launch
            return _run(key, launch, sources, sm_scale, prepare, out)
    else:
        launcher(key, launch.grid, args, **launch.options)
    if launch.combine_args:
        _combine(key, launch, sources, out, lse, maxl, part)
    return tuple(outs)


def _parts(launch: _Launch, part: torch.Tensor | None, lse: torch.Tensor) -> list:
    if part is None:
        return [lse, lse, lse]  # unused
    return [part, part[launch.part_lse:], part[launch.part_max:]]


def _combine(key: object, launch: _Launch, sources: tuple, out: torch.Tensor,
             lse: torch.Tensor, maxl: torch.Tensor, part: torch.Tensor | None) -> None:
    sink = sources[7].contiguous() if sources[7] is not None else None
    vals = [None] * _SINK + [sink, out, lse, maxl, *_parts(launch, part, lse)]
    _triton_combine(key, launch.combine_grid,
                    (*[vals[i] for i in launch.combine_map], *launch.combine_args),
                    num_warps=4)


def _cached(key: tuple | None, prepare: Callable[[], _Launch], scale_name: str,
            scale: object) -> tuple[tuple | None, _Launch]:
    """``(key, launch)``: the launch of ``key``, prepared (the argument checks included) at its
    first call; on a hit the scale (which keys leave out) is checked. The key comes back None
    where it cannot be one (an unhashable argument: the checks then say why)."""
    try:
        launch = _launches.get(key) if key is not None else None
    except TypeError:
        key, launch = None, None
    if launch is not None:
        if not (type(scale) is float and 0.0 < scale < _INF):
            check_scale(scale_name, scale)
        return key, launch
    launch = prepare()
    if key is not None:
        if len(_launches) >= _MAX_LAUNCHES:  # shape churn: start again, kernels too
            _launches.clear()
            for launcher in (_triton_sparse, _triton_combine, _sm90_sparse,
                             *_sm90_ws.values()):
                if launcher is not None:
                    launcher.compiled.clear()
        _launches[key] = launch
    return key, launch


def _check_plan(plan: object) -> None:
    if plan is not None and not isinstance(plan, SparsePlan):
        raise TypeError(f"plan must be a SparsePlan or None, got {type(plan).__name__}")


def _sm90_route(plan: SparsePlan, q: torch.Tensor, kv: torch.Tensor, dv: int, fmt: int,
                extra_kv: torch.Tensor | None = None) -> bool:
    """Whether this call goes to the Gluon sm_90 kernel (``mla.fast.sm90.sparse``): a plan
    that allows it, on a Hopper GPU whose Triton can build the Gluon kernels, DeepSeek-V3.2's
    rows (a bf16/fp16 or ``fp8_ds_mla`` cache) or MODEL1 pages, in ``kv`` and in the second
    scope's ``extra_kv`` if any. ``fmt``: ``PLAIN``, ``DS_MLA`` or ``MODEL1``."""
    if not plan.sm90 or q.device.type != "cuda" or interpreting() or not sm90.usable():
        return False
    from mla.fast.sm90.sparse import supported

    caches = [kv] if extra_kv is None else [kv, extra_kv]
    return all(supported(q, c, dv, fmt == DS_MLA, plan.block_m, model1=fmt == MODEL1)
               for c in caches)


def _key(kind: str, sources: tuple, *scalars: object) -> tuple | None:
    """The cache key of a call (None when an argument is not what the checks accept: the slow
    path's checks then say why): every tensor's ``_tkey``, the scalars with their types."""
    try:
        return (kind, *map(_tkey, sources), *((v, type(v)) for v in scalars))
    except (AttributeError, RuntimeError, TypeError):  # e.g. a sparse tensor has no strides
        return None


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    is_fp8_kvcache: bool,
    topk_length: torch.Tensor | None = None,
    head_dim_v: int = 512,
    *,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    validate: bool | None = None,
    plan: SparsePlan | None = None,
    batch_invariant: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode of ``q [B, s_q, N, D]`` over the paged cache, rows named by
    ``indices [B, s_q, topk]`` (global slots ``block · block_size + offset``, ``-1`` for none).

    ``kv_cache [nb, bs, D]`` in q's dtype, or with ``is_fp8_kvcache`` ``[nb, bs, 656]`` uint8
    ``fp8_ds_mla`` rows (``D = 576``) or the ``[nb, bs, 584]`` view of MODEL1 pages
    (``fp8_model1_cache``; ``D = 512``) (``[nb, bs, 1, ·]`` accepted too); ``topk_length [B]``
    int32. DeepSeek-V4's keywords as the reference's: ``attn_sink [N]`` float32, and a second
    scope ``extra_k_cache`` (the first cache's format, its own page size),
    ``extra_indices_in_kvcache [B, s_q, extra_topk]``, ``extra_topk_length [B]``, attended in
    the same softmax. Returns ``out [B, s_q, N, head_dim_v]`` (q's dtype) and
    ``lse [B, N, s_q]`` float32, ``+inf`` for a lonely query, as
    ``mla.reference.sparse_mla_decode``.

    ``validate``: check ``indices`` and ``topk_length`` ranges on the host (a sync); without
    the checks a query whose length lies outside ``[0, topk]`` or that uses an entry outside
    ``[-1, slots)`` gets NaN ``out`` and ``lse``. ``plan``: default ``plan_sparse(...)``.
    ``batch_invariant``: a query's result is the same bits alone or in any batch (FlashMLA's
    ``enable_batch_invariant``): the plan (``plan_sparse(..., batch_invariant=True)``) cuts
    each query's list into runs of a fixed length, which do not depend on the batch, merged
    in a fixed order (``mla.fast.sparse.plan``); a given ``plan`` must split so
    (``split_entries > 0``) or not at all. ``out``: a preallocated contiguous
    ``[B, s_q, N, head_dim_v]`` tensor of q's dtype to write and return.
    """
    extras = dict(extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices_in_kvcache,
                  extra_topk_length=extra_topk_length)
    sources = (q, kv_cache, indices, topk_length, extra_k_cache, extra_indices_in_kvcache,
               extra_topk_length, attn_sink)

    def prepare() -> _Launch:
        check_sparse_decode_shapes(q, kv_cache, indices, softmax_scale, is_fp8_kvcache,
                                   topk_length, head_dim_v, attn_sink=attn_sink,
                                   fp8_layouts=("fp8_ds_mla", "MODEL1"), **extras)
        check_kernel_input(q)
        _check_plan(plan)
        check_batch_invariant(batch_invariant, plan)
        B, s_q, N, D = q.shape
        shapes = ((B, s_q, N, head_dim_v), (B, N, s_q))
        if B * s_q * N * head_dim_v == 0:
            return _Launch(shapes)
        first, fmt = decode_scope("kv_cache", kv_cache, indices, topk_length, is_fp8_kvcache)
        scopes = [first]
        if extra_k_cache is not None:
            assert extra_indices_in_kvcache is not None
            scopes.append(decode_scope("extra_k_cache", extra_k_cache,
                                        extra_indices_in_kvcache, extra_topk_length,
                                        is_fp8_kvcache)[0])
        return _prepare(lambda t: unit_stride(t.reshape(B * s_q, N, D)), sources, scopes, fmt,
                        s_q, False, head_dim_v, plan, shapes, batch_invariant)

    key, launch = _cached(_key("decode", sources, is_fp8_kvcache, head_dim_v, plan,
                               batch_invariant), prepare, "softmax_scale", softmax_scale)
    if should_validate(validate, q):
        check_sparse_decode_values(kv_cache, indices, topk_length, **extras)
    out, lse = _run(key, launch, sources, softmax_scale, prepare, out)
    return out, lse


def sparse_mla_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    *,
    attn_sink: torch.Tensor | None = None,
    validate: bool | None = None,
    plan: SparsePlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill: ``q [s_q, h_q, d_qk]`` over ``kv [s_kv, d_qk]`` (or ``[s_kv, 1, d_qk]``),
    rows named by ``indices [s_q, topk]`` (or ``[s_q, 1, topk]``), ``topk_length [s_q]``,
    ``attn_sink [h_q]`` float32.

    Returns ``out [s_q, h_q, d_v]`` (q's dtype), ``max_logits [s_q, h_q]`` and
    ``lse [s_q, h_q]`` (float32), as ``mla.reference.sparse_mla_prefill``: indices ``< 0`` or
    ``>= s_kv`` are masked; a lonely query gets ``out = 0``, ``lse = +inf``,
    ``max_logits = -inf``. ``validate``: check ``topk_length``'s range on the host (a sync);
    without the check a query whose length lies outside ``[0, topk]`` gets NaN out, lse and
    max_logits.
    """
    sources = (q, kv, indices, topk_length, None, None, None, attn_sink)

    def prepare() -> _Launch:
        check_sparse_prefill_shapes(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)
        check_kernel_input(q)
        _check_plan(plan)
        s_q, h_q, _ = q.shape
        shapes = ((s_q, h_q, d_v), (s_q, h_q), (s_q, h_q))
        if s_q * h_q * d_v == 0:
            return _Launch(shapes)
        scope = plain_scope(kv, indices, topk_length, kv.shape[0], s_q)
        return _prepare(unit_stride, sources, [scope], PLAIN, 1, True, d_v, plan, shapes)

    key, launch = _cached(_key("prefill", sources, d_v, plan), prepare, "sm_scale", sm_scale)
    if should_validate(validate, q):
        _check_topk_length_values(topk_length, indices.shape[-1], "one per query")
    out, max_logits, lse = _run(key, launch, sources, sm_scale, prepare)
    return out, max_logits, lse
