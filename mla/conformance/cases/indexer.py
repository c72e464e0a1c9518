"""Cases of the lightning indexer's kernels: the fp8 key cache, the logits, the top-k.

Kernel names and signatures are ``mla.reference``'s (conventions §10, "Indexer key cache" and
"Indexer logits and top-k"), named after vLLM's and DeepGEMM's:

- ``indexer_k_quant_and_cache(k [T, 128], kv_cache uint8 [num_blocks, page, 132],
  slot_mapping [T])``: per page the 128 e4m3 values of every token, then every token's float32
  scale ``2^ceil(log2(max(amax, 1e-4) / 448))``; slot ``-1`` skipped. Checked byte for byte
  (quantity "mismatches") on a cache poisoned with ``0xFF`` and holding earlier tokens' bytes.
  Inputs are bf16 numbers in the setting's dtype, so no byte depends on how a kernel rounds a
  wider input.
- ``fp8_paged_mqa_logits(q [B, next_n, H, 128] e4m3, kv_cache, weights [B·next_n, H] float32,
  context_lens [B], block_tables, max_model_len)`` -> ``[B·next_n, max_model_len]``: query
  ``n`` sees keys ``0 .. L - next_n + n``, ``-inf`` elsewhere (DeepGEMM's ``clean_logits``);
  ``logits = k_scale · Σ_h w_h · ReLU(q_h · k_code)``. Rows past each length and unused
  block-table entries hold NaN (e4m3 code and scale), so a read past a length shows; in the
  ``nan_input`` cases a key within the lengths holds a NaN code, and its logits must be NaN
  (exactly there: the measure takes NaN where the reference has it, and only there).
  DeepGEMM's ``schedule_metadata`` is the adapter's business.
- ``fp8_mqa_logits(q [S, H, 128] e4m3, (k_codes [N, 128], k_scale [N]), weights [S, H],
  cu_seqlen_ks [S], cu_seqlen_ke [S], max_seqlen_k=0)`` -> ``[S, N]``: the ragged prefill
  form; with ``max_seqlen_k > 0`` (one case) the rows compressed to ``[S, max_seqlen_k]``,
  column ``j`` holding key ``ks + j``, ``-inf`` from ``ke - ks`` on, as DeepGEMM's
  ``max_seqlen_k`` and vLLM's prefill indexer use them.
- ``top_k_per_row(logits [R, W], row_starts [R], row_ends [R], topk)`` -> int32 ``[R, topk]``:
  the ``min(topk, end - start)`` best columns of ``[start, end)`` as ``j - start``, ties to the
  lower index, ``-1`` after. Columns outside the range hold NaN (never read). The order within
  a row is free (the sparse attention sums over the set): both sides are compared as sets,
  each row sorted ascending with its ``-1`` last. topk = 2048 as DeepSeek-V3.2. One case puts
  NaN (above every number), ``±inf`` and zeros of both signs (equal) at the boundary. A kernel
  that picks the right values but other columns among tied keys is named as such.

**The logits' measure and budget** (``Trial.limits``: no table entry exists for these
kernels). The error is measured against the logits' *magnitude*, not the logits themselves:

    err = ‖got − want‖_F / ‖mag‖_F,   mag = k_scale · Σ_h |w_h| · ReLU(q_h · k_code)

over the entries the reference has finite (``mla.compare.logits_err``); ``mag`` is the
reference's logits with every weight's absolute value. The logits' own norm is the wrong
scale: the weights have both signs, and how much the weighted sum over heads cancels is a
property of the inputs (on the same H200 kernel the relative error is 7e-5 to 4.4e-4 on these
cases, 2.2-2.6e-4 on the benchmark's inputs, 5-7e-5 with positive weights), while every head's
dot goes through the kernel's accumulation whatever its weight's sign. The catalogue reports
the relative error (``logits_rel``) against the equivalent limit, the budget
(``logits_budget_of``) times ``‖mag‖ / ‖want‖`` (``logits_limit``).

The inputs are exact: e4m3 codes, float32 weights (q's scale folded in) and float32 k
scales, and the product of two e4m3 numbers (4 significant bits each) is exact in float32.
What rounds is the accumulation: the dot over ``d = 128`` products, the weighted sum over
``H`` heads and the final scaling (exact for the cases' ue8m0 scales). In float32,
independent roundings add in quadrature, each at most ``u_32 = 2^-24`` of a partial sum: the
budget is ``sqrt(d·H)·u_32`` (``5.4e-6`` for ``H = 64``), room for any summation order; the
reference's own float32 run measures 2-4e-8 on these cases, a 1% error 430 to 630 times the
budget. On a CUDA device the budget is the FP8 tensor cores' instead
(``mla.compare.fp8_mma_logits_budget``): a Hopper kernel's MMA sums the e4m3 products
``k = 32`` at a step into an accumulator of 13 mantissa bits that truncates (DeepSeek-V3's
report, §3.3.2), never promoted to float32 within the 128-dim dot. ``benchmarks/fp8_mma.py``
emulates it (each step's addends truncated to the largest one's 13-bit grid, the sum truncated
to 13 bits; the H200's single-head dots equal it bit for bit in 57-89% of cases, its logits'
errors within 5%). At 64 heads and more the budget is ``2^-13`` (``FP8_MMA_LOGITS_ERR``):
on an H200 mla.fast's kernels measure 2.2e-5 to 4.3e-5 on these cases (27 case-seeds) and up
to 6.7e-5 on the benchmark's uniformly random e4m3 keys, whose few large products lose more
to the aligned truncation (emulated: 3.4e-5 and 7.1e-5). The budget is set by the worst input
distribution, 1.8 times it. With fewer heads, fewer dots' roundings average: ``sqrt(64 /
heads)`` times ``2^-13`` (one head measures 1.4-2.3e-4, the dot's own error; from 8 to 128
heads the worst distribution sits at 0.44-0.59 of the budget). A 1% error is
20 to 28 times over the budget, one head's weight dropped more. The limits do not depend on
the setting's dtype: the kernel's inputs are fp8 and float32 whatever it is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from mla.compare import fp8_mma_logits_budget, poison_like
from mla.conformance.cases.common import call_poisoned, long_length, takes_keyword
from mla.conformance.cases.paged_cache import WRAP_MINUS_ONE, scattered_slots
from mla.conformance.catalogue import Setting, Trial, Unsupported, case, generator
from mla.reference.indexer_cache import (
    INDEX_DIM,
    INDEX_K_BYTES,
    indexer_k_quant_and_cache,
    quantize_indexer_k,
    read_indexer_k_cache,
)
from mla.reference.indexer_logits import (
    compressed_rows,
    decode_row_ends,
    fp8_mqa_logits,
    fp8_paged_mqa_logits,
    quantize_indexer_q,
    top_k_per_row,
)
from mla.reference.paged_cache import make_block_table

__all__ = ["logits_budget_of", "logits_limit", "TOPK", "INVERTED_SCALE", "TOKEN_ROWS",
           "SCALE_IGNORED", "NO_RELU", "NO_WEIGHTS", "CAUSAL_SHORT", "CAUSAL_IGNORED", "TIES_HIGH",
           "TIES_OTHER", "NAN_LOW", "NEG_ZERO_LOW", "NAN_ZERO", "FULL_ROWS", "LogitsSpec",
           "paged_trial", "ragged_judged", "topk_judged"]

TOPK = 2048
HEADS = 64  # DeepSeek-V3.2's index_n_heads
NAN_CODE, NAN_DIM = 0x7F, 5  # an e4m3fn NaN, placed at one dimension of a key
U32 = 2.0 ** -24
Outputs = dict[str, torch.Tensor]

INVERTED_SCALE = ("scales stored as 1/scale (the quantizer's multiplier; the page holds "
                  "k ≈ code·scale)")
TOKEN_ROWS = ("132-byte token rows (each token's values, then its scale) instead of a page's "
              "values of all its tokens, then their scales")
UNROUNDED = "scale max(amax, 1e-4)/448 not rounded up to a power of two (scale_fmt ue8m0)"
FULL_ROWS = "full rows [S, N] where max_seqlen_k asks for rows compressed to [S, max_seqlen_k]"
SCALE_IGNORED = "k scale ignored (logits of the e4m3 codes)"
NO_RELU = "ReLU missing (negative head dots summed)"
NO_WEIGHTS = "per-head weights not applied (a plain sum over heads)"
CAUSAL_SHORT = "causal rule off by one: query n sees keys 0..L-next_n+n-1 (one too few)"
CAUSAL_LONG = "causal rule off by one: query n sees keys 0..L-next_n+n+1 (one too many)"
CAUSAL_IGNORED = "causal rule ignored (every query sees all L keys)"
TIES_HIGH = "ties broken toward the higher index; the reference's go to the lower index"
TIES_OTHER = ("the same values chosen, other columns among the keys tied at the boundary (the "
              "reference takes the lowest)")
ABSOLUTE = "indices are columns of the logits, not relative to row_starts (request-local)"
NAN_ZERO = ("a NaN key's logits 0 (ReLU as max(x, 0) drops NaN); the reference propagates "
            "the NaN")
NAN_LOW = "NaN ranked below every number (never chosen); the reference ranks it above +inf"
NEG_ZERO_LOW = "-0 ranked below +0; the reference has them equal (ties to the lower index)"


def logits_budget_of(heads: int, device: torch.device | str) -> float:
    """The logits' budget in ``mla.compare.logits_err``'s measure (module doc):
    ``sqrt(128·heads)·2^-24`` of float32 accumulation, on a CUDA device at least the FP8
    tensor cores' (``fp8_mma_logits_budget``)."""
    limit = math.sqrt(INDEX_DIM * heads) * U32
    if torch.device(device).type == "cuda":
        limit = max(fp8_mma_logits_budget(heads), limit)
    return limit


def logits_limit(heads: int, device: torch.device | str, want: torch.Tensor,
                 mag: torch.Tensor) -> float:
    """The limit on the logits' relative error (the catalogue's ``logits_rel``) equivalent to
    ``logits_budget_of`` on ``logits_err``: the budget times ``‖mag‖ / ‖want‖`` over the
    entries ``want`` has finite."""
    limit = logits_budget_of(heads, device)
    seen = torch.isfinite(want)
    norm = torch.linalg.vector_norm(want[seen].double()).item()
    if norm == 0.0:  # every seen logit 0 (so is mag): any error is infinite, any limit will do
        return limit
    return limit * torch.linalg.vector_norm(mag[seen].double()).item() / norm


def _bf16_keys(g: torch.Generator, n: int, spread: int = 4) -> torch.Tensor:
    """bf16 numbers ``[n, 128]``, one gain per token between ``2^-spread`` and ``2^spread``."""
    gain = 2.0 ** torch.randint(-spread, spread + 1, (n, 1), generator=g)
    return (torch.randn(n, INDEX_DIM, generator=g, dtype=torch.float64) * gain).to(
        torch.bfloat16).double()


# ---- indexer_k_quant_and_cache -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CacheSpec:
    tokens: int
    page: int
    blocks: int = 3
    padding: tuple[int, ...] = ()
    zero_keys: tuple[int, ...] = ()  # tokens whose key is all zeros (the 1e-4 floor)
    spread: int = 4


def _write(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, *, wrap: bool = False,
           inverted: bool = False, token_rows: bool = False, unrounded: bool = False
           ) -> torch.Tensor:
    """``cache`` after a write under a convention (the reference's with none set)."""
    out = cache.clone()
    s = slots.clone()
    if wrap:
        s[s < 0] = out.shape[0] * out.shape[1] - 1
    keep = s >= 0
    if not (inverted or token_rows or unrounded):
        indexer_k_quant_and_cache(k[keep], out, s[keep])
        return out
    codes, scale = quantize_indexer_k(k[keep], None if unrounded else "ue8m0")
    if inverted:
        scale = 1.0 / scale
    if token_rows:
        rows = torch.cat([codes, scale.contiguous().view(torch.uint8).view(-1, 4)], dim=1)
        out.view(-1, INDEX_K_BYTES)[s[keep]] = rows
        return out
    bs = out.shape[1]
    flat = out.view(out.shape[0], -1)
    scale_bytes = scale.contiguous().view(torch.uint8).view(-1, 4)
    for slot, c, sc in zip(s[keep].tolist(), codes, scale_bytes):
        p, o = divmod(slot, bs)
        flat[p, o * INDEX_DIM:(o + 1) * INDEX_DIM] = c
        flat[p, bs * INDEX_DIM + 4 * o: bs * INDEX_DIM + 4 * o + 4] = sc
    return out


def cache_trial(setting: Setting, spec: CacheSpec, salt: int) -> Trial:
    g = generator(setting, salt)
    n_slots = spec.blocks * spec.page
    slots = torch.tensor(scattered_slots(g, n_slots, spec.page, spec.tokens),
                         dtype=torch.int64).reshape(spec.tokens)
    slots[list(spec.padding)] = -1
    k64 = _bf16_keys(g, spec.tokens, spec.spread)
    k64[list(spec.zero_keys)] = 0.0
    k64[list(spec.padding)] = k64[list(spec.padding[:1])]  # one row whichever wraps
    k = k64.to(setting.dtype)
    cache = poison_like(torch.empty(spec.blocks, spec.page, INDEX_K_BYTES, dtype=torch.uint8))
    earlier = torch.nonzero(torch.rand(n_slots, generator=g) < 0.5).flatten()
    indexer_k_quant_and_cache(_bf16_keys(g, len(earlier)), cache, earlier)
    dev = setting.device
    args = (k.to(dev), slots.to(dev))

    def invoke(fn: Callable) -> Outputs:
        out = cache.to(dev, copy=True)
        call_poisoned(fn, args[0], out, args[1])
        return {"kv_cache": out}

    alts: dict[str, Callable[[], Outputs]] = {
        INVERTED_SCALE: lambda: {"kv_cache": _write(cache, slots, k, inverted=True)},
        TOKEN_ROWS: lambda: {"kv_cache": _write(cache, slots, k, token_rows=True)},
        UNROUNDED: lambda: {"kv_cache": _write(cache, slots, k, unrounded=True)}}
    if spec.padding:
        alts[WRAP_MINUS_ONE] = lambda: {"kv_cache": _write(cache, slots, k, wrap=True)}
    return Trial(invoke, {"kv_cache": _write(cache, slots, k)}, {"kv_cache": "mismatches"},
                 alts)


# ---- fp8_paged_mqa_logits and fp8_mqa_logits ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LogitsSpec:
    lens: tuple[int, ...]
    next_n: int = 1
    page: int = 64
    heads: int = HEADS
    unused_entry: str = "nan_page"  # unused block-table entries: a page of NaN, or "-1"
    nan_key: bool = False  # the first request's first key holds a NaN code (0x7F)


def _fp8_q(g: torch.Generator, rows: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randn(rows, heads, INDEX_DIM, generator=g, dtype=torch.float64)
    w = torch.randn(rows, heads, generator=g, dtype=torch.float64) * (heads * INDEX_DIM) ** -0.5
    return quantize_indexer_q(q, w)


def _variant(q8: torch.Tensor, w: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
             ends: torch.Tensor, width: int, *, relu: bool = True, weights: bool = True,
             k_scale: bool = True, starts: torch.Tensor | None = None) -> torch.Tensor:
    """float64 logits ``[S, width]`` of rows ``q8 [S, H, 128]`` over keys ``codes [N, 128]``
    (``N <= width``), row ``t`` seeing columns ``[starts[t], ends[t])``."""
    dots = torch.einsum("thd,nd->thn", q8.double(), codes.view(torch.float8_e4m3fn).double())
    if relu:
        dots = dots.clamp_min(0.0)
    ww = w.double() if weights else torch.ones_like(w, dtype=torch.float64)
    out = torch.einsum("th,thn->tn", ww, dots) * (scale.double() if k_scale else 1.0)
    full = torch.full((q8.shape[0], width), float("-inf"), dtype=torch.float64)
    cols = torch.arange(codes.shape[0])[None, :]
    lo = torch.zeros_like(ends) if starts is None else starts
    seen = (cols >= lo[:, None]) & (cols < ends[:, None])
    full[:, :codes.shape[0]] = out.masked_fill(~seen, float("-inf"))
    return full


def _paged_inputs(spec: LogitsSpec, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    lens = list(spec.lens)
    table, nb = make_block_table(lens, spec.page, spare_blocks=1,
                                 seed=int(torch.randint(1 << 30, (1,), generator=g)))
    cache = poison_like(torch.empty(nb, spec.page, INDEX_K_BYTES, dtype=torch.uint8))  # NaN
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        indexer_k_quant_and_cache(_bf16_keys(g, n), cache,
                                  table[b].long()[pos // spec.page] * spec.page
                                  + pos % spec.page)
    if spec.nan_key:  # token 0 of request 0, seen by all its queries
        cache[int(table[0, 0])].view(-1)[NAN_DIM] = NAN_CODE
    if spec.unused_entry == "nan_page":
        table = torch.where(table < 0, nb - 1, table)
    q8, w = _fp8_q(g, len(lens) * spec.next_n, spec.heads)
    return q8.view(len(lens), spec.next_n, spec.heads, INDEX_DIM), w, cache, table, \
        torch.tensor(lens, dtype=torch.int32)


def paged_trial(setting: Setting, spec: LogitsSpec, salt: int) -> Trial:
    q8, w, cache, table, lens = _paged_inputs(spec, generator(setting, salt))
    width = max(spec.lens) + 3
    dev = setting.device
    args = tuple(t.to(dev) for t in (q8, cache, w, lens, table))

    def invoke(fn: Callable) -> Outputs:
        return {"logits": call_poisoned(fn, *args, width)}

    nn = spec.next_n
    ends = decode_row_ends(lens, nn).long()

    def variant(shift: int = 0, causal: bool = True, **kw: bool) -> Outputs:
        rows = []
        for b, n in enumerate(spec.lens):
            pos = torch.arange(n)
            codes, scale = read_indexer_k_cache(cache, table[b].long()[pos // spec.page]
                                                * spec.page + pos % spec.page)
            e = ends[b * nn:(b + 1) * nn] + shift if causal else torch.full((nn,), n)
            rows.append(_variant(q8[b], w[b * nn:(b + 1) * nn], codes, scale,
                                 e.clamp(0, n), width, **kw))
        return {"logits": torch.cat(rows)}

    alts = {SCALE_IGNORED: lambda: variant(k_scale=False), NO_RELU: lambda: variant(relu=False),
            NO_WEIGHTS: lambda: variant(weights=False), CAUSAL_SHORT: lambda: variant(shift=-1),
            CAUSAL_LONG: lambda: variant(shift=1)}
    if nn > 1:
        alts[CAUSAL_IGNORED] = lambda: variant(causal=False)
    if spec.nan_key:
        alts[NAN_ZERO] = lambda: _nan_to_zero(expected)
    expected = fp8_paged_mqa_logits(q8, cache, w.double(), lens, table, width)
    mag = fp8_paged_mqa_logits(q8, cache, w.double().abs(), lens, table, width)
    return Trial(invoke, {"logits": expected}, {"logits": "logits_rel"}, alts,
                 limits={"logits": logits_limit(spec.heads, dev, expected, mag)})


def _nan_to_zero(want: torch.Tensor) -> Outputs:
    return {"logits": torch.where(torch.isnan(want), 0.0, want)}


def ragged_trial(setting: Setting, lens: tuple[int, ...], queries: int, salt: int,
                 nan_key: bool = False, compressed: int | None = None) -> Trial:
    """Requests of ``lens`` keys, flat; each asks with its last ``queries`` positions;
    ``nan_key``: the last request's first key holds a NaN code (seen by all its queries);
    ``compressed``: rows compressed to ``max_seqlen_k`` = the longest row plus this many
    columns (a kernel that takes no ``max_seqlen_k`` is unsupported)."""
    g = generator(setting, salt)
    codes, scale = quantize_indexer_k(_bf16_keys(g, sum(lens)))
    if nan_key:
        codes[sum(lens) - lens[-1], NAN_DIM] = NAN_CODE
    ks, ke, first = [], [], 0
    for n in lens:
        for p in range(max(0, n - queries), n):
            ks.append(first)
            ke.append(first + p + 1)
        first += n
    ks_t, ke_t = torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32)
    q8, w = _fp8_q(g, len(ks), HEADS)
    return ragged_judged(setting, q8, w, codes, scale, ks_t, ke_t, nan_key, compressed)


def ragged_judged(setting: Setting, q8: torch.Tensor, w: torch.Tensor, codes: torch.Tensor,
                  scale: torch.Tensor, ks_t: torch.Tensor, ke_t: torch.Tensor,
                  nan_key: bool = False, compressed: int | None = None) -> Trial:
    """The trial of ``fp8_mqa_logits`` on ``q8 [S, H, 128]``, ``w [S, H]``, the keys' codes
    (uint8) and scales, query ``t`` seeing ``[ks_t[t], ke_t[t])`` (``ragged_trial``'s
    arguments; ``nan_key``: a key holds a NaN code, its logits' alternative 0)."""
    codes8 = codes.view(torch.float8_e4m3fn)
    dev = setting.device
    args = (q8.to(dev), (codes8.to(dev), scale.to(dev)), w.to(dev), ks_t.to(dev), ke_t.to(dev))
    span = int((ke_t - ks_t).max()) if len(ks_t) else 0
    width = {} if compressed is None else {"max_seqlen_k": max(span + compressed, 1)}

    def invoke(fn: Callable) -> Outputs:
        if width and not takes_keyword(fn, "max_seqlen_k"):
            raise Unsupported("the kernel takes no max_seqlen_k (compressed rows)")
        return {"logits": call_poisoned(fn, *args, **width)}

    def rows(full: torch.Tensor) -> torch.Tensor:
        return compressed_rows(full, ks_t, ke_t, width["max_seqlen_k"]) if width else full

    def variant(shift: int = 0, **kw: bool) -> Outputs:
        return {"logits": rows(_variant(q8, w, codes, scale, ke_t.long() + shift,
                                        codes.shape[0], starts=ks_t.long(), **kw))}

    alts = {SCALE_IGNORED: lambda: variant(k_scale=False), NO_RELU: lambda: variant(relu=False),
            NO_WEIGHTS: lambda: variant(weights=False), CAUSAL_SHORT: lambda: variant(shift=-1)}
    if nan_key:
        alts[NAN_ZERO] = lambda: _nan_to_zero(expected)
    if width:
        alts[FULL_ROWS] = lambda: {"logits": fp8_mqa_logits(q8, (codes8, scale), w.double(),
                                                           ks_t, ke_t)}
    expected = fp8_mqa_logits(q8, (codes8, scale), w.double(), ks_t, ke_t, **width)
    mag = fp8_mqa_logits(q8, (codes8, scale), w.double().abs(), ks_t, ke_t, **width)
    return Trial(invoke, {"logits": expected}, {"logits": "logits_rel"}, alts,
                 limits={"logits": logits_limit(q8.shape[1], dev, expected, mag)})


# ---- top_k_per_row -----------------------------------------------------------------------------

def as_sets(idx: object) -> object:
    """Each row's indices sorted ascending, ``-1`` last (the comparison is of sets)."""
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.is_floating_point():
        return idx
    v = idx.detach().cpu().long()
    big = torch.iinfo(torch.int64).max
    s = torch.sort(torch.where(v < 0, big, v), dim=1).values
    return torch.where(s == big, -1, s).to(idx.dtype)


def _picks_the_same_values(got: object, want: torch.Tensor, logits: torch.Tensor,
                           starts: torch.Tensor, stop: torch.Tensor) -> bool:
    """Whether ``got`` (sets, ``-1`` last) picks in each row as many distinct columns of its
    range as ``want`` does, whose values, sorted, are ``want``'s (NaN matching NaN, ``-0``
    matching ``+0``)."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return False
    for r in range(want.shape[0]):
        g, w = got[r][got[r] >= 0].long(), want[r][want[r] >= 0].long()
        n = int(stop[r] - starts[r])
        if g.numel() != w.numel() or g.unique().numel() != g.numel() or \
                (g.numel() and (int(g.min()) < 0 or int(g.max()) >= n)):
            return False
        row = logits[r, int(starts[r]):int(stop[r])]
        a, b = row[g].sort().values, row[w].sort().values  # NaN last in both
        if not torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True):
            return False
    return True


def _specials(logits: torch.Tensor, ends: tuple[int, ...], g: torch.Generator,
              topk: int = TOPK, starts: torch.Tensor | None = None, neg_inf_every: int = 20
              ) -> torch.Tensor:
    """Rows (from ``starts``, default column 0, ``ends`` long) whose ``topk``-th place falls
    among zeros of both signs: each row's values shifted to put it at 0, rounded to multiples
    of 1/40, the zeros given random signs; then NaN at 4 columns, ``+inf`` at 3 (fewer in
    rows shorter than 14) and ``-inf`` at one column in ``neg_inf_every``."""
    out = logits.clone()
    for r, n in enumerate(ends):
        at = 0 if starts is None else int(starts[r])
        nan = min(4, n // 2)
        inf = min(3, (n - nan) // 2)
        cols = torch.randperm(n, generator=g)
        plain = cols[nan + inf + n // neg_inf_every:]  # the topk - nan - inf th is the boundary
        row = logits[r, at:at + n]
        q = (row[plain].sort(descending=True).values[
            max(min(topk - nan - inf, plain.numel()), 1) - 1] if plain.numel() else 0.0)
        v = ((row - q) * 40).round() / 40
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
        v = torch.where(v == 0, torch.copysign(torch.zeros(()), sign), v)
        v[cols[:nan]] = float("nan")
        v[cols[nan:nan + inf]] = float("inf")
        v[cols[nan + inf:nan + inf + n // neg_inf_every]] = float("-inf")
        out[r, at:at + n] = v
    return out


def topk_trial(setting: Setting, ends: tuple[int, ...], salt: int, *, offsets: bool = False,
               ties: bool = False, specials: bool = False) -> Trial:
    g = generator(setting, salt)
    width = max(ends) + (97 if offsets else 5)
    R = len(ends)
    starts = (torch.randint(0, 90, (R,), generator=g) if offsets
              else torch.zeros(R, dtype=torch.int64))
    logits = torch.randn(R, width, generator=g)
    if ties:  # a few hundred distinct values: the 2048th place sits inside a run of equals
        logits = (logits * 40).round() / 40
    if specials:  # (rows from column 0)
        logits = _specials(logits, ends, g)
    return topk_judged(setting, logits, starts, starts + torch.tensor(ends), TOPK,
                       nan_low=specials, neg_zero_low=specials, absolute=offsets)


def topk_judged(setting: Setting, logits: torch.Tensor, starts: torch.Tensor,
                stop: torch.Tensor, topk: int, *, nan_low: bool = False,
                neg_zero_low: bool = False, absolute: bool = False) -> Trial:
    """The trial of ``top_k_per_row`` on float32 ``logits [R, W]`` over the ranges ``[starts,
    stop)`` (int64), NaN written outside them; beside the tie rules, the alternatives
    ``nan_low`` (NaN below every number), ``neg_zero_low`` (``-0`` below ``+0``) and
    ``absolute`` (indices as columns, not from the row's start)."""
    width = logits.shape[1]
    cols = torch.arange(width)[None, :]
    logits = logits.masked_fill((cols < starts[:, None]) | (cols >= stop[:, None]),
                                float("nan"))
    st, en = starts.to(torch.int32), stop.to(torch.int32)
    dev = setting.device
    args = (logits.to(dev), st.to(dev), en.to(dev), topk)

    seen: dict[str, torch.Tensor] = {}

    def invoke(fn: Callable) -> Outputs:
        seen["got"] = as_sets(call_poisoned(fn, *args))
        return {"indices": seen["got"]}

    def same_values() -> Outputs:
        """The kernel's own sets where each row picks distinct columns of its range whose
        values are the reference's (another tie rule), else something nothing matches."""
        got = seen.get("got")
        if _picks_the_same_values(got, want, logits, starts, stop):
            return {"indices": got}
        return {"indices": torch.full_like(as_sets(want), -2)}

    def high_ties() -> Outputs:
        flipped = top_k_per_row(logits.flip(1), width - en, width - st, topk).long()
        col = width - 1 - (flipped + (width - stop)[:, None])
        return {"indices": as_sets(torch.where(flipped >= 0, col - starts[:, None], -1)
                                   .to(torch.int32))}

    def recomputed(x: torch.Tensor) -> Outputs:
        return {"indices": as_sets(top_k_per_row(x, st, en, topk))}

    want = top_k_per_row(logits, st, en, topk)
    alts = {TIES_HIGH: high_ties}
    inside = (cols >= starts[:, None]) & (cols < stop[:, None])
    if nan_low:
        alts[NAN_LOW] = lambda: recomputed(torch.where(torch.isnan(logits) & inside,
                                                       float("-inf"), logits))
    if neg_zero_low:  # -0 as the negative number nearest it
        alts[NEG_ZERO_LOW] = lambda: recomputed(torch.where(
            (logits == 0) & torch.signbit(logits), -1e-45, logits))
    if absolute:
        alts[ABSOLUTE] = lambda: {"indices": as_sets(torch.where(
            want >= 0, want + st[:, None], -1).to(torch.int32))}
    alts[TIES_OTHER] = same_values  # last: the more specific rules above are named first
    return Trial(invoke, {"indices": as_sets(want)}, {"indices": "mismatches"}, alts)


# ---- the catalogue -----------------------------------------------------------------------------

def _reg(kernel: str, name: str, topic: str, doc: str, build: Callable[[Setting], Trial]
         ) -> None:
    case(kernel, topic, name=name, doc=doc)(build)


_K, _P, _R, _T = ("indexer_k_quant_and_cache", "fp8_paged_mqa_logits", "fp8_mqa_logits",
                  "top_k_per_row")
_reg(_K, "page_16_bytes", "index_cache_bytes",
     "Page 16: each page holds its tokens' 128 e4m3 values, then their float32 power-of-two "
     "scales, byte for byte, at scattered slots; other bytes untouched.",
     lambda s: cache_trial(s, CacheSpec(tokens=21, page=16), 900))
_reg(_K, "page_1_bytes", "index_cache_page_1",
     "Page 1: a page is one token's 128 value bytes followed by its 4 scale bytes.",
     lambda s: cache_trial(s, CacheSpec(tokens=9, page=1, blocks=16), 901))
_reg(_K, "page_64_magnitudes", "index_cache_bytes",
     "Page 64, keys from 2^-8 to 2^8 and all-zero keys (scale 2^-22 from the 1e-4 floor on "
     "amax): the scale is max(amax, 1e-4)/448 rounded up to a power of two.",
     lambda s: cache_trial(s, CacheSpec(tokens=40, page=64, blocks=2, zero_keys=(3, 17),
                                        spread=8), 902))
_reg(_K, "padding_slots", "padding",
     "Slot -1 (first, middle and last token) is padding: nothing is written for it.",
     lambda s: cache_trial(s, CacheSpec(tokens=8, page=16, padding=(0, 3, 7)), 903))

_reg(_P, "page_1", "pages",
     "Page 1 with 64 heads: k_scale · Σ_h w_h · ReLU(q_h · k) over keys read one page each.",
     lambda s: paged_trial(s, LogitsSpec((1, 2, 17), page=1), 910))
_reg(_P, "page_16_edges", "pages",
     "Page 16 with lengths 15, 16, 17 and 1: the last page partly full, NaN past each length.",
     lambda s: paged_trial(s, LogitsSpec((15, 16, 17, 1), page=16), 911))
_reg(_P, "page_64_long", "lengths",
     "Page 64 with lengths 63, 64, 65 and a long one (DeepSeek-V3.2's 64 heads of 128).",
     lambda s: paged_trial(s, LogitsSpec((63, 64, 65, long_length(s.small))), 912))
_reg(_P, "next_n_2_causal", "causal",
     "next_n = 2 (one draft token): query n sees keys 0..L-2+n, L counting the new tokens.",
     lambda s: paged_trial(s, LogitsSpec((2, 64, 65, 130), next_n=2), 913))
_reg(_P, "next_n_4_page_edge", "causal",
     "next_n = 4 with the diagonal crossing a page edge (L = 66, 130 at page 64).",
     lambda s: paged_trial(s, LogitsSpec((66, 130, 4), next_n=4), 914))
_reg(_P, "rows_without_keys", "empty",
     "next_n = 3 with L = 0, 1, 2: the first queries see no key, their rows all -inf.",
     lambda s: paged_trial(s, LogitsSpec((0, 1, 2, 9), next_n=3, page=16), 915))
_reg(_P, "unused_entries_minus_one", "nan",
     "Unused block-table entries hold -1 (vLLM's padding): only the length's pages are read.",
     lambda s: paged_trial(s, LogitsSpec((1, 65, 130), unused_entry="-1"), 916))

_reg(_P, "nan_key_propagates", "nan_input",
     "A NaN e4m3 code in a key within the lengths: its logit is NaN for every query that sees "
     "it, never 0 or -inf; the other logits as usual.",
     lambda s: paged_trial(s, LogitsSpec((5, 64, 70), nan_key=True), 917))
_reg(_R, "ragged_requests", "ragged",
     "Three requests in one flat key array: each query sees its own request's keys up to its "
     "position, -inf elsewhere.",
     lambda s: ragged_trial(s, (1, 17, 70), queries=8, salt=920))
_reg(_R, "chunk_of_a_long_request", "ragged",
     "The last 16 queries of a long request and a short one: rows of different lengths.",
     lambda s: ragged_trial(s, (long_length(s.small), 3), queries=16, salt=921))
_reg(_R, "compressed_rows", "compressed",
     "max_seqlen_k: each row compressed to the longest row plus 5 columns, column j holding "
     "key ks + j, -inf from ke - ks on (also where ks + j passes the last key).",
     lambda s: ragged_trial(s, (1, 17, 70), queries=8, salt=923, compressed=5))
_reg(_R, "compressed_rows_of_one_column", "one_column",
     "max_seqlen_k = 1 (one request of one key, one query): a row of a single column, that "
     "key's logit.", lambda s: ragged_trial(s, (1,), queries=8, salt=924, compressed=0))
_reg(_R, "nan_key_propagates", "nan_input",
     "A NaN e4m3 code in the last request's first key: NaN for each of its queries, the other "
     "logits as usual.",
     lambda s: ragged_trial(s, (17, 40), queries=8, salt=922, nan_key=True))

_reg(_T, "k_2048_long_rows", "topk",
     "Rows longer than 2048 keys: the 2048 best columns of each row's range, request-local.",
     lambda s: topk_trial(s, (long_length(s.small) + 2100, 2049, 4000), 930))
_reg(_T, "rows_past_8192", "past_8192",
     "Rows of 8193 keys (a decode step's row at 8K of cache), 12001 and 16381: past the 8192 "
     "that one program holds in registers.",
     lambda s: topk_trial(s, (8193, 9001) if s.small else (8193, 12001, 16381), 935))
_reg(_T, "fewer_keys_than_k", "short",
     "Rows of 0, 1, 2047 and 2048 keys: every key is selected and the rest of the row is -1.",
     lambda s: topk_trial(s, (0, 1, 2047, 2048), 931))
_reg(_T, "ties_at_the_boundary", "ties",
     "Logits with many equal values around the 2048th place: ties go to the lower index.",
     lambda s: topk_trial(s, (3000, 2600, 4100), 932, ties=True))
_reg(_T, "nan_infinities_signed_zeros", "specials",
     "NaN ranks above +inf (always chosen), -inf below every number, -0 equals +0: the "
     "2048th place falls among zeros of both signs, which go to the lower columns.",
     lambda s: topk_trial(s, (3000, 2600, 4100), 934, specials=True))
_reg(_T, "ragged_row_starts", "offsets",
     "Rows starting past column 0 (prefill): indices are relative to the row's start; NaN "
     "outside [start, end) is never read.",
     lambda s: topk_trial(s, (2500, 10, 2048), 933, offsets=True))
