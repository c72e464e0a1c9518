"""The walkthrough's kernel-level rows: the attention kernels under the model, on its latents.

Each kernel gets the example's latents (the float64 front, ``Case.fronts_ref``, rounded to the
kernel's dtype). Its ``o`` is compared with the dense absorbed attention
(``mla.reference.absorbed_attention``) run in float64 on the CPU on the same numbers upcast;
its ``lse`` with a log-sum-exp written out here (the kernel's own absorbed queries against
the cached latent rows, in float64: code neither path shares). Two sets of rows:

- ``reference <kernel>``: ``mla.reference``'s kernel-level functions, in the run's dtype and
  device: the paged / sparse / fp8 data paths of the reference against its dense math;
- ``fast <kernel>``: ``mla.fast``'s kernels, on a CUDA device in the run's dtype (float16,
  bfloat16 or float32), on the CPU in float32 under Triton's interpreter (``TRITON_INTERPRET=1``
  set before triton is imported: the ``mla`` command does it). Where a kernel cannot run,
  the row says why (``CannotRunError``) instead of passing.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from types import ModuleType

import torch
import torch.nn.functional as F  # noqa: N812

import mla.reference
from mla.cli.case import (
    REFERENCE,
    CannotRunError,
    Case,
    Measurement,
    RowSpec,
    make_registrar,
    timed,
)
from mla.compare import budget
from mla.reference import (
    Front,
    absorb_q,
    absorbed_attention,
    concat_and_cache_fp8_ds_mla,
    concat_and_cache_mla,
    convert_req_index_to_global_index,
    dequantize_fp8_ds_mla,
    make_block_table,
    plan_context_chunks,
    slot_mapping_from_block_table,
)

__all__ = ["ROWS", "FAST_DTYPES", "fast_target", "interpreter_requests"]

ROWS: list[RowSpec] = []
register_row = make_registrar(ROWS)

FAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the Triton kernels take
DENSE = "absorbed_attention (dense)"
SCORES_LSE = "logsumexp of the kernel query's scores"
DECODE_S_Q = 2  # MTP decode: two queries per request, causal among themselves


# --- where the fast kernels run --------------------------------------------------------------

def fast_target(case: Case) -> tuple[torch.dtype, torch.device]:
    """The dtype and device the ``mla.fast`` rows run in here; ``CannotRunError`` (with the
    reason) where they cannot run."""
    if not case.fast:
        raise CannotRunError("not asked for (--no-fast)")
    if importlib.util.find_spec("triton") is None:
        raise CannotRunError("triton is not installed (the project's 'triton' extra has it)")
    if case.device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise CannotRunError("on the CPU the Triton kernels need TRITON_INTERPRET=1 set "
                                 "before triton is imported")
        return torch.float32, case.device
    if case.device.type != "cuda":
        raise CannotRunError(f"the fast kernels run on CUDA (or on the CPU under Triton's "
                             f"interpreter), not on {case.device.type}")
    if case.dtype not in FAST_DTYPES:
        raise CannotRunError(f"the fast kernels take float16, bfloat16 or float32, the run is "
                             f"{str(case.dtype).removeprefix('torch.')}")
    return case.dtype, case.device


def _fast() -> ModuleType:
    import mla.fast  # imported only once fast_target has passed: it imports triton

    return mla.fast


def interpreter_requests(context_lens: Sequence[int]) -> list[int]:
    """The requests the fast rows take under Triton's interpreter, which is slow: those with
    the shortest and the longest context (an empty context; the most pages and chunks)."""
    order = sorted(range(len(context_lens)), key=lambda i: context_lens[i])
    return sorted({order[0], order[-1]})


def _fast_run(case: Case) -> tuple[Case, ModuleType, torch.dtype, torch.device]:
    """The example, ``mla.fast`` and the dtype and device the fast rows run in."""
    dtype, device = fast_target(case)
    if "fast_case" not in case.memo:
        case.memo["fast_case"] = (case if device.type == "cuda" else
                                  case.subset(interpreter_requests(case.context_lens)))
    return case.memo["fast_case"], _fast(), dtype, device  # type: ignore[return-value]


# --- references (float64, CPU) ---------------------------------------------------------------

def _upcast(f: Front) -> Front:
    return Front(*(t.to(dtype=REFERENCE, device="cpu") for t in f))


def dense_ref(case: Case, fronts: Sequence[Front], dtype: torch.dtype, s_q: int | None,
              latent: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
              ) -> torch.Tensor:
    """``absorbed_attention`` in float64 on the latents and weights of a path run in ``dtype``
    (upcast), causal by position: the last ``s_q`` queries of every request
    ``[B, s_q, N, V]``, or all of them concatenated ``[sum L, N, V]`` (``s_q=None``).
    ``latent``: per request ``(kv_c, k_pe)`` to use instead."""
    w, c, outs = case.up_proj_ref(dtype), case.config, []
    for i, f in enumerate(fronts):
        q_nope, q_pe, kv_c, k_pe = _upcast(f)
        if latent is not None:
            kv_c, k_pe = latent[i]
        L = kv_c.shape[0]
        n = L if s_q is None else s_q
        pos = torch.arange(L)
        o, _ = absorbed_attention(q_nope[-n:], q_pe[-n:], kv_c, k_pe, w.W_UK, w.W_UV,
                                  c.softmax_scale, causal=True, q_positions=pos[-n:],
                                  k_positions=pos)
        outs.append(o)
    return torch.cat(outs) if s_q is None else torch.stack(outs)


def scores_lse(q: torch.Tensor, fronts: Sequence[Front], scale: float) -> torch.Tensor:
    """``lse [B, N, s_q]`` of the kernel's own absorbed queries ``q [B, s_q, N, Lkv+R]`` over
    each request's cached latent rows ``[kv_c, k_pe]``: ``logsumexp((q · rowᵀ) · scale)`` in
    float64, causal by position, written out here rather than taken from either path. The
    queries are the ones the kernel was given (``ql_nope`` already rounded to the run's
    dtype), so the row measures the kernel's lse, not the rounding of ``ql_nope``, which moves
    a bf16 lse by about ``2^-9·|s|`` (conventions §11, "The prefill lse")."""
    out = []
    for qb, f in zip(q.to(dtype=REFERENCE, device="cpu"), fronts):
        rows = torch.cat([f.kv_c, f.k_pe], dim=-1).to(dtype=REFERENCE, device="cpu")
        s_q, L = qb.shape[0], rows.shape[0]
        scores = torch.einsum("qnd,sd->nqs", qb, rows) * scale
        visible = torch.arange(L)[None, :] <= torch.arange(L - s_q, L)[:, None]
        out.append(torch.logsumexp(scores.masked_fill(~visible, float("-inf")), dim=-1))
    return torch.stack(out)


def _limits(impl: ModuleType, kernel: str, dtype: torch.dtype, quantity: str
            ) -> dict[str, object]:
    """A ``Measurement``'s ``dtype``, ``tolerance`` and ``metric``: a fast kernel's error budget
    (``mla.compare.budget``; ``lse_abs`` is a max absolute error); the reference's functions
    get the relative tolerance of their dtype."""
    if impl is mla.reference:
        return {"dtype": dtype}
    return {"dtype": dtype, "tolerance": budget(kernel, dtype, quantity),
            "metric": "abs" if quantity == "lse_abs" else "rel"}


def causal_topk(q_pos: Sequence[int], topk: int, device: torch.device,
                offset: int = 0) -> torch.Tensor:
    """Index rows naming every key up to the query's position (plus ``offset``), then -1."""
    rows = torch.full((len(q_pos), topk), -1, dtype=torch.int32, device=device)
    for r, p in enumerate(q_pos):
        rows[r, : p + 1] = offset + torch.arange(p, -1, -1, dtype=torch.int32, device=device)
    return rows


def _write_latents(case: Case, fronts: Sequence[Front], kv_cache: torch.Tensor,
                   block_table: torch.Tensor, lens: Sequence[int]) -> None:
    """Request ``i``'s first ``lens[i]`` latents into the paged cache."""
    for i, (f, n) in enumerate(zip(fronts, lens)):
        pos = torch.arange(n, device=kv_cache.device)
        slots = slot_mapping_from_block_table(block_table, torch.full_like(pos, i), pos,
                                              case.block_size)
        concat_and_cache_mla(f.kv_c[:n], f.k_pe[:n], kv_cache, slots)


# --- paged decode ----------------------------------------------------------------------------

def _paged_decode(case: Case, impl: ModuleType, dtype: torch.dtype, device: torch.device
                  ) -> tuple[Measurement, Measurement]:
    """``mla_decode_paged`` of the last ``DECODE_S_Q`` tokens of every request over its whole
    sequence in a paged cache: the ``o`` and ``lse`` measurements of one call."""
    key = ("paged_decode", impl.__name__)
    if key in case.memo:
        return case.memo[key]  # type: ignore[return-value]
    c, s_q = case.config, DECODE_S_Q
    w, fronts = case.up_proj(dtype, device), case.fronts(dtype, device)
    kv_cache, block_table = case.empty_cache(case.seq_lens, dtype, device)
    _write_latents(case, fronts, kv_cache, block_table, case.seq_lens)
    cache_seqlens = torch.tensor(case.seq_lens, dtype=torch.int32, device=device)

    q = torch.stack([torch.cat([absorb_q(f.q_nope[-s_q:], w.W_UK), f.q_pe[-s_q:]], dim=-1)
                     for f in fronts])  # [B, s_q, N, Lkv+R]

    def path() -> tuple[torch.Tensor, torch.Tensor]:
        o_lat, lse = impl.mla_decode_paged(q, kv_cache, block_table, cache_seqlens,
                                           c.softmax_scale, causal=True,
                                           head_dim_v=c.kv_lora_rank)
        return torch.einsum("bsnl,lnv->bsnv", o_lat, w.W_UV), lse

    (out, lse), sec = timed(path, device)
    case.memo[key] = (
        Measurement(out, dense_ref(case, fronts, dtype, s_q), sec,
                    **_limits(impl, "mla_decode_paged", dtype, "out_rel")),
        Measurement(lse, scores_lse(q, fronts, c.softmax_scale), sec,
                    **_limits(impl, "mla_decode_paged", dtype, "lse_abs")))
    return case.memo[key]  # type: ignore[return-value]


# --- sparse (DeepSeek-V3.2) ------------------------------------------------------------------
# A top-k that covers every visible key: the sparse kernels must then be the dense absorbed
# attention (conventions §10).

def _sparse_prefill(case: Case, impl: ModuleType, dtype: torch.dtype, device: torch.device
                    ) -> Measurement:
    """Every request's new tokens in one call over one flat ``kv`` of all requests' latents
    (request i's rows at its offset), as vLLM calls the kernel on a gathered workspace."""
    c, n = case.config, case.new_tokens
    w, fronts = case.up_proj(dtype, device), case.fronts(dtype, device)
    kv = torch.cat([torch.cat([f.kv_c, f.k_pe], dim=-1) for f in fronts])
    topk = max(case.seq_lens) + 5  # wider than any request: padded with -1
    indices = torch.cat([causal_topk(range(L - n, L), topk, device,
                                     offset=sum(case.seq_lens[:i]))
                         for i, L in enumerate(case.seq_lens)])

    def path() -> torch.Tensor:
        q = torch.cat([torch.cat([absorb_q(f.q_nope[-n:], w.W_UK), f.q_pe[-n:]], dim=-1)
                       for f in fronts])
        o_lat, _, _ = impl.sparse_mla_prefill(q, kv, indices, c.softmax_scale,
                                              d_v=c.kv_lora_rank)
        return torch.einsum("snl,lnv->snv", o_lat, w.W_UV)

    out, sec = timed(path, device)
    return Measurement(out, dense_ref(case, fronts, dtype, n).flatten(0, 1), sec,
                       **_limits(impl, "sparse_mla_prefill", dtype, "out_rel"))


def _sparse_decode(case: Case, impl: ModuleType, dtype: torch.dtype, device: torch.device,
                   fp8: bool) -> Measurement:
    """The last ``DECODE_S_Q`` tokens of every request on the paged cache, their
    request-local top-k converted to global slots. ``fp8``: the cache is ``fp8_ds_mla``; a
    latent smaller than 512 + 64 is zero-padded into the format (zeros add nothing to any dot
    product), and the reference reads the latent as the cache rounded it."""
    c, bs, s_q = case.config, case.block_size, DECODE_S_Q
    w, fronts = case.up_proj(dtype, device), case.fronts(dtype, device)
    Lkv, R = c.kv_lora_rank, c.qk_rope_head_dim
    if fp8 and (Lkv > 512 or R > 64):
        raise CannotRunError(f"fp8_ds_mla holds at most 512 + 64 latent values, preset "
                             f"{c.name!r} has {Lkv} + {R}")
    pad_c, pad_r = (512 - Lkv, 64 - R) if fp8 else (0, 0)
    if fp8:
        block_table, num_blocks = make_block_table(case.seq_lens, bs, spare_blocks=1,
                                                   device=device)
        kv_cache = torch.full((num_blocks, bs, 656), 0xFF, dtype=torch.uint8, device=device)
        for i, f in enumerate(fronts):
            pos = torch.arange(f.kv_c.shape[0], device=device)
            slots = slot_mapping_from_block_table(block_table, torch.full_like(pos, i), pos, bs)
            concat_and_cache_fp8_ds_mla(F.pad(f.kv_c, (0, pad_c)), F.pad(f.k_pe, (0, pad_r)),
                                        kv_cache, slots)
    else:
        kv_cache, block_table = case.empty_cache(case.seq_lens, dtype, device)
        _write_latents(case, fronts, kv_cache, block_table, case.seq_lens)
    topk = max(case.seq_lens) + 3
    local = torch.cat([causal_topk(range(L - s_q, L), topk, device) for L in case.seq_lens])
    req = torch.arange(len(fronts), dtype=torch.int32, device=device).repeat_interleave(s_q)
    slots = convert_req_index_to_global_index(req, block_table.to(torch.int32), local, bs)
    slots = slots.view(len(fronts), s_q, topk)

    def path() -> torch.Tensor:
        q = torch.stack([torch.cat([F.pad(absorb_q(f.q_nope[-s_q:], w.W_UK), (0, pad_c)),
                                    F.pad(f.q_pe[-s_q:], (0, pad_r))], dim=-1)
                         for f in fronts])  # [B, s_q, N, row width]
        o_lat, _ = impl.sparse_mla_decode(q, kv_cache, slots, c.softmax_scale, fp8,
                                          head_dim_v=Lkv + pad_c)
        return torch.einsum("bsnl,lnv->bsnv", o_lat[..., :Lkv], w.W_UV)

    out, sec = timed(path, device)
    latent = None
    if fp8:  # what the cache holds, read back (exact in float64)
        latent = []
        for i, L in enumerate(case.seq_lens):
            pos = torch.arange(L, device=device)
            rows = kv_cache.view(-1, 656)[block_table[i].long()[pos // bs] * bs + pos % bs]
            kv_c, k_pe = dequantize_fp8_ds_mla(rows.cpu())
            latent.append((kv_c[:, :Lkv].to(REFERENCE), k_pe[:, :R].to(REFERENCE)))
    return Measurement(out, dense_ref(case, fronts, dtype, s_q, latent), sec,
                       **_limits(impl, "sparse_mla_decode", dtype, "out_rel"))


# --- chunked prefill pieces (fast only; the model-level rows run the reference's) ------------

def _merge(case: Case, impl: ModuleType, dtype: torch.dtype, device: torch.device
           ) -> Measurement:
    """The new tokens' attention over their context (non-causal: all of it is earlier) and
    over themselves (causal), each worked in float64 and rounded to ``dtype``, then merged.
    Against the reference merge in float64 on those inputs upcast (the dense rows above show
    the merge of the exact partial states is the whole attention). An empty context is an
    empty partial state (``o = 0``, ``lse = -inf``)."""
    c, n, w = case.config, case.new_tokens, case.up_proj_ref(dtype)
    fronts = case.fronts(dtype, device)
    parts: dict[str, list[torch.Tensor]] = {"o_p": [], "lse_p": [], "o_s": [], "lse_s": []}
    for f, ctx in zip(fronts, case.context_lens):
        q_nope, q_pe, kv_c, k_pe = _upcast(f)
        pos = torch.arange(ctx + n)
        for side, keys in (("p", slice(0, ctx)), ("s", slice(ctx, ctx + n))):
            o, lse = absorbed_attention(q_nope[ctx:], q_pe[ctx:], kv_c[keys], k_pe[keys],
                                        w.W_UK, w.W_UV, c.softmax_scale, causal=True,
                                        q_positions=pos[ctx:], k_positions=pos[keys])
            parts["o_" + side].append(o.to(dtype=dtype, device=device))
            parts["lse_" + side].append(lse.to(dtype=torch.float32, device=device))
    o_p, o_s = torch.cat(parts["o_p"]), torch.cat(parts["o_s"])
    lse_p, lse_s = torch.cat(parts["lse_p"], dim=1), torch.cat(parts["lse_s"], dim=1)
    (out, _), sec = timed(lambda: impl.merge_attn_states(o_p, lse_p, o_s, lse_s), device)
    ref, _ = mla.reference.merge_attn_states(*(t.to(dtype=REFERENCE, device="cpu")
                                               for t in (o_p, lse_p, o_s, lse_s)))
    return Measurement(out, ref, sec, **_limits(impl, "merge_attn_states", dtype, "out_rel"))


def _chunked_prefill(case: Case, impl: ModuleType, dtype: torch.dtype, device: torch.device
                     ) -> Measurement:
    """All requests' new tokens in one call, their contexts in the paged cache, in chunks of
    at most the case's MCC. On the CPU the gathers and merges are the Triton kernels and the
    attention is torch's (``mla.fast.chunked``'s route there)."""
    c, n, ctx = case.config, case.new_tokens, case.context_lens
    w, fronts = case.up_proj(dtype, device), case.fronts(dtype, device)
    kv_cache, block_table = case.empty_cache(case.seq_lens, dtype, device)
    _write_latents(case, fronts, kv_cache, block_table, ctx)
    plan = plan_context_chunks(ctx, max_context_chunk=case.max_context_chunk)
    new = Front(*(torch.cat([t[k:] for t, k in zip(parts, ctx)]) for parts in zip(*fronts)))
    qsl = torch.arange(0, n * (len(ctx) + 1), n, dtype=torch.int32, device=device)
    (out, _), sec = timed(lambda: impl.chunked_prefill_attention(
        new.q_nope, new.q_pe, new.kv_c, new.k_pe, qsl, kv_cache, block_table, plan,
        w.W_UK, w.W_UV, c.softmax_scale), device)
    return Measurement(out, dense_ref(case, fronts, dtype, n).flatten(0, 1), sec,
                       **_limits(impl, "chunked_prefill_attention", dtype, "out_rel"))


def _prefill(case: Case, impl: ModuleType, dtype: torch.dtype, device: torch.device
             ) -> Measurement:
    """Every request's whole sequence, causal (a call per request, as the API takes one)."""
    if device.type != "cuda":
        raise CannotRunError("on the CPU mla.fast.prefill_attention is the reference's own "
                             "math (its kernels are cuDNN and a Triton kernel on CUDA)")
    c = case.config
    w, fronts = case.up_proj(dtype, device), case.fronts(dtype, device)
    out, sec = timed(lambda: torch.cat([
        impl.prefill_attention(f.q_nope, f.q_pe, f.kv_c, f.k_pe, w.W_UK, w.W_UV,
                               c.softmax_scale, causal=True)[0] for f in fronts]), device)
    return Measurement(out, dense_ref(case, fronts, dtype, None), sec,
                       **_limits(impl, "prefill_attention", dtype, "out_rel"))


# --- the rows, in table order ----------------------------------------------------------------

@register_row(f"reference mla_decode_paged s_q={DECODE_S_Q}: o", reference=DENSE)
def _ref_decode_o(case: Case) -> Measurement:
    return _paged_decode(case, mla.reference, case.dtype, case.device)[0]


@register_row(f"reference mla_decode_paged s_q={DECODE_S_Q}: lse", reference=SCORES_LSE)
def _ref_decode_lse(case: Case) -> Measurement:
    return _paged_decode(case, mla.reference, case.dtype, case.device)[1]


@register_row("reference sparse_mla_prefill, new tokens, top-k covers all: o", reference=DENSE)
def _ref_sparse_prefill(case: Case) -> Measurement:
    return _sparse_prefill(case, mla.reference, case.dtype, case.device)


@register_row(f"reference sparse_mla_decode s_q={DECODE_S_Q}, latent cache: o",
              reference=DENSE)
def _ref_sparse_decode(case: Case) -> Measurement:
    return _sparse_decode(case, mla.reference, case.dtype, case.device, fp8=False)


@register_row(f"reference sparse_mla_decode s_q={DECODE_S_Q}, fp8_ds_mla cache: o",
              reference=DENSE + ", cached fp8 latent")
def _ref_sparse_decode_fp8(case: Case) -> Measurement:
    return _sparse_decode(case, mla.reference, case.dtype, case.device, fp8=True)


@register_row(f"fast mla_decode_paged s_q={DECODE_S_Q}: o", reference=DENSE)
def _fast_decode_o(case: Case) -> Measurement:
    return _paged_decode(*_fast_run(case))[0]


@register_row(f"fast mla_decode_paged s_q={DECODE_S_Q}: lse", reference=SCORES_LSE)
def _fast_decode_lse(case: Case) -> Measurement:
    return _paged_decode(*_fast_run(case))[1]


@register_row("fast sparse_mla_prefill, new tokens, top-k covers all: o", reference=DENSE)
def _fast_sparse_prefill(case: Case) -> Measurement:
    return _sparse_prefill(*_fast_run(case))


@register_row(f"fast sparse_mla_decode s_q={DECODE_S_Q}, latent cache: o", reference=DENSE)
def _fast_sparse_decode(case: Case) -> Measurement:
    return _sparse_decode(*_fast_run(case), fp8=False)


@register_row(f"fast sparse_mla_decode s_q={DECODE_S_Q}, fp8_ds_mla cache: o",
              reference=DENSE + ", cached fp8 latent")
def _fast_sparse_decode_fp8(case: Case) -> Measurement:
    return _sparse_decode(*_fast_run(case), fp8=True)


@register_row("fast merge_attn_states, context | new tokens: o",
              reference="merge_attn_states (float64)")
def _fast_merge(case: Case) -> Measurement:
    return _merge(*_fast_run(case))


@register_row("fast chunked_prefill_attention: o", reference=DENSE)
def _fast_chunked_prefill(case: Case) -> Measurement:
    return _chunked_prefill(*_fast_run(case))


@register_row("fast prefill_attention: o", reference=DENSE)
def _fast_prefill(case: Case) -> Measurement:
    return _prefill(*_fast_run(case))
