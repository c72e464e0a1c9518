"""What ``mla.conformance.fuzz`` draws: per kernel, a hypothesis strategy over the fields of
its case family's parameter dataclass (``DecodeSpec``, ``SparseDecodeSpec``,
``SparsePrefillSpec``, ``MergeSpec``, ``DcpSpec``; the indexer's ``TopkSpec``, ``RaggedSpec``
and ``LogitsSpec``) and a seed.

An ``Example`` names the family's trial builder, those parameters, the random seed and the
dtype; the trial builds the inputs from that seed, runs the float64 reference and holds the
outputs to the catalogue's budgets, exactly as a named case does. The strategies reach the
corners the catalogue pins one at a time and their combinations: odd head counts, page sizes
1 to 256, ragged lengths with 0, 1 and page edges, ``s_q`` with and without ``causal``, top-k
widths, ``-1`` and other invalid indices anywhere, ``topk_length`` (with NaN rows past it), lonely
queries, the second KV scope and sinks, sharp and flat softmaxes, lse near ±1000, empty merge
sides and ranks (``±inf`` lse with NaN outputs), a side whose weight underflows to 0 over
``±inf`` / NaN outputs, and NaN lse beside empty ranks. Every field shrinks towards the
simplest value (one request, one head, the first choice listed), so a failure shrinks to the
few parameters that matter. Widths stay at 64 or more, where a relative Frobenius error
averages the output's roundings as the budgets assume, and logits at the catalogue's sizes.

The indexer's: ``top_k_per_row`` rows of 0, 1, ``k - 1``, ``k``, ``k + 1`` keys and any
length (up to 128K keys on a GPU, past 8192 under the interpreter), ``k`` from 1 to 2048 (512
and 2048 among them), rows from column 0 or past it with NaN outside every range, ties down to
a handful of values and rows of ``±0``, NaN / ``±inf`` / signed zeros at the ``k``-th place,
rows mostly ``-inf``, magnitudes near ``2^-90`` and ``2^100``, many rows; ``fp8_mqa_logits``
requests of 0, 1, tile edges and any length, windows whole or cut to their last 1, 2, 64 or
65 keys, empty windows, NaN keys (code and scale) that no query sees, a NaN code inside the
windows, key scales over ``2^±12``, weights times ``2^-80`` or ``2^100``, 1 to 128 heads,
compressed rows, and up to a few thousand queries on a GPU; ``fp8_paged_mqa_logits`` pages
1 to 256, lengths 0, 1 and page edges, ``next_n`` 1 to 4, odd head counts, unused block-table
entries a NaN page or ``-1``, a NaN code within the lengths.

**What a target takes.** A peer's adapter refuses what its kernel does not take (``require``
in ``mla.conformance.adapters``: FlashMLA's dense decode pages of 64 only, DeepGEMM 32 or 64
heads, pages of 32 or 64 and ``next_n`` 1, 2 or 4, ...), and a kernel whose signature has no
``attn_sink`` or ``extra_k_cache`` refuses the inputs that pass them: drawn anyway, most of a
search is skipped (DeepGEMM judged 22 of about 250 examples in 5 minutes). ``Accepts`` states
such limits for one kernel and the strategies draw within them, keeping the corners inside
(lengths at the edges of the pages taken, the fewest heads taken, ...); ``accepts_for`` gives
a kernel's: what its named target's adapter states (``stated_accepts``) and what its
signature takes. A kernel with no limits (``mla.fast``, the reference, a user's kernel that
takes every keyword) draws the whole space as before.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import strategies as st

from mla.conformance.cases.common import DEEPSEEK_SCALE, DEFAULT_SCALE, YARN_SCALE
from mla.conformance.cases.dcp import DcpSpec
from mla.conformance.cases.decode import DecodeSpec
from mla.conformance.cases.indexer import LogitsSpec
from mla.conformance.cases.indexer_specs import RaggedSpec, TopkSpec
from mla.conformance.cases.merge import MergeSpec
from mla.conformance.cases.sparse_decode import SparseDecodeSpec
from mla.conformance.cases.sparse_prefill import INT_MAX, INT_MIN, SparsePrefillSpec
from mla.conformance.catalogue import Setting, Trial

__all__ = ["Example", "STRATEGIES", "FUZZED", "Accepts", "accepts_for", "examples_of",
           "stated_accepts", "trial_of"]

INF = float("inf")
SCALES = (DEFAULT_SCALE, DEEPSEEK_SCALE, YARN_SCALE)
# q's gain: 1 (unit logits), 30 (a sharp softmax, overflows without the running max), 1e-3
# (a flat one: tiny logits, the lse near log(keys))
GAINS = (1.0, 30.0, 1e-3)
SINKS = ("", "finite", "+inf", "-inf", "per_head")


@st.composite
def _scale_gain(draw: st.DrawFn) -> tuple[float, float]:
    """The softmax scale and q's gain. The sharp softmax (gain 30) comes with the scale
    ``1/sqrt(D)`` only, as the catalogue's "sharp_softmax" cases: logits of about 30. With
    ``1/sqrt(192)`` they reach 50 and a float32 kernel's logit rounding alone (the reference's
    own, run in float32) passes the float32 budgets of ``out``, which hold logits of the
    catalogue's sizes."""
    scale = draw(_pick(*SCALES))
    return scale, draw(_pick(*GAINS) if scale == DEFAULT_SCALE else _pick(1.0, 1e-3))


@dataclasses.dataclass(frozen=True)
class Example:
    """One drawn input: ``trial`` ("module:function", a case family's trial builder) called
    as ``trial(Setting(device, dtype, seed), spec, 0, **options)``."""
    kernel: str
    trial: str
    spec: Any
    seed: int
    dtype: torch.dtype
    options: tuple[tuple[str, Any], ...] = ()

    def setting(self, device: torch.device) -> Setting:
        return Setting(torch.device(device), self.dtype, self.seed, True)


def trial_of(example: Example, device: torch.device | str) -> Trial:
    """The example's trial: inputs on ``device`` in its dtype, the reference's outputs."""
    module, _, name = example.trial.partition(":")
    build: Callable[..., Trial] = getattr(importlib.import_module(module), name)
    return build(example.setting(torch.device(device)), example.spec, 0,
                 **dict(example.options))


@dataclasses.dataclass(frozen=True)
class Accepts:
    """What one kernel of a target takes, where narrower than the strategies' space: the
    draws stay within it (``None`` / ``True``: anything). ``pages``, ``heads``, ``next_n``
    (``fp8_paged_mqa_logits``) and ``topk`` (``top_k_per_row``): the values taken;
    ``fp8_cache``: a sparse decode's cache fp8 only (fp8_ds_mla, or MODEL1 at head dim 512);
    ``topk_length``: a sparse decode given ``topk_length``; ``row_starts``: top-k rows
    starting past column 0; ``pow2_dims``: a DCP head dim that is not a power of two;
    ``sinks``: ``attn_sink``; ``extra_scope``: the second KV scope (``extra_k_cache``)."""
    pages: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    next_n: tuple[int, ...] | None = None
    topk: tuple[int, ...] | None = None
    fp8_cache: bool = False
    topk_length: bool = True
    row_starts: bool = True
    pow2_dims: bool = True
    sinks: bool = True
    extra_scope: bool = True

    def __post_init__(self) -> None:
        for name in ("pages", "heads", "next_n", "topk"):
            v = getattr(self, name)
            if v is None:
                continue
            if not isinstance(v, tuple) or not v or not all(
                    isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise TypeError(f"Accepts.{name} must be a non-empty tuple of ints or None, "
                                f"got {v!r}")
            if min(v) < 1:
                raise ValueError(f"Accepts.{name} must hold positive ints, got {v!r}")
        for name in ("fp8_cache", "topk_length", "row_starts", "pow2_dims", "sinks",
                     "extra_scope"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Accepts.{name} must be a bool, got {getattr(self, name)!r}")

    def describe(self) -> str:
        """The limits in a few words (``""``: none)."""
        parts = [f"{n} {', '.join(map(str, getattr(self, n)))}"
                 for n in ("pages", "heads", "next_n", "topk") if getattr(self, n)]
        parts += [what for name, what, on in (
            ("fp8_cache", "fp8 caches only", True), ("topk_length", "no topk_length", False),
            ("row_starts", "rows from column 0", False),
            ("pow2_dims", "power-of-two head dims", False), ("sinks", "no attn_sink", False),
            ("extra_scope", "no second KV scope", False)) if getattr(self, name) is on]
        return "; ".join(parts)


ANYTHING = Accepts()
_SINKS_DRAWN = ("mla_decode_paged", "sparse_mla_decode", "sparse_mla_prefill")


def stated_accepts(target: str | None, device: torch.device | str | None = None
                   ) -> dict[str, Accepts]:
    """Per kernel, what the named target's adapter states it takes (its ``require`` calls,
    the constants read from the adapters); ``{}`` for a target that states nothing (``mla.fast``,
    ``reference``, a user's). ``device``: FlashMLA's sparse decode takes no ``topk_length``
    on sm_90."""
    sm90 = False
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        sm90 = torch.cuda.get_device_capability(torch.device(device))[0] == 9
    if target in ("flashmla", "flashmla-batch-invariant"):
        # dense: pages of 64 (its C++ check); sparse: fp8 caches only (the interface asserts
        # is_fp8_kvcache), no topk_length on sm_90
        return {"mla_decode_paged": Accepts(pages=(64,)),
                "sparse_mla_decode": Accepts(fp8_cache=True, topk_length=not sm90)}
    if target == "deepgemm":
        from mla.conformance.adapters import deepgemm

        return {"fp8_mqa_logits": Accepts(heads=deepgemm.HEADS),
                "fp8_paged_mqa_logits": Accepts(heads=deepgemm.HEADS, pages=deepgemm.PAGES,
                                                next_n=deepgemm.NEXT_N)}
    if target == "vllm-triton":  # the DCP correction spans the head dim with tl.arange
        return {"cp_lse_ag_out_rs": Accepts(pow2_dims=False)}
    if target == "mla.conformance.adapters.vllm_topk:persistent_top_k_per_row":
        from mla.conformance.adapters import vllm_topk

        return {"top_k_per_row": Accepts(topk=vllm_topk.PERSISTENT_TOPK, row_starts=False)}
    return {}


def accepts_for(kernel: str, fn: Callable, target: str | None = None,
                device: torch.device | str | None = None) -> Accepts | None:
    """What ``kernel`` (the callable ``fn`` of the target named ``target``) takes: its
    adapter's statement (``stated_accepts``), no ``attn_sink`` or second scope where ``fn``'s
    signature takes none; ``None``: anything."""
    from mla.conformance.cases.common import takes_keyword

    a = stated_accepts(target, device).get(kernel, ANYTHING)
    if kernel in _SINKS_DRAWN and not takes_keyword(fn, "attn_sink"):
        a = dataclasses.replace(a, sinks=False)
    if kernel == "sparse_mla_decode" and not takes_keyword(fn, "extra_k_cache"):
        a = dataclasses.replace(a, extra_scope=False)
    return None if a == ANYTHING else a


def _pick(*values: Any) -> st.SearchStrategy:
    """One of ``values``, shrinking towards the first."""
    return st.sampled_from(values)


def _page(small: bool, a: Accepts = ANYTHING) -> st.SearchStrategy[int]:
    return _pick(*a.pages) if a.pages else _pick(64, 1, 16, 2, 128, 256) | st.integers(1, 256)


def _heads(small: bool, a: Accepts = ANYTHING) -> st.SearchStrategy[int]:
    if a.heads:
        return _pick(*a.heads)
    return _pick(1, 3, 5, 16, 33) if small else _pick(1, 3, 5, 16, 33, 64, 127, 128)


def _sink(a: Accepts) -> st.SearchStrategy[str]:
    return _pick(*SINKS) if a.sinks else st.just("")


# ---- mla_decode_paged -----------------------------------------------------------------------

@st.composite
def _decode(draw: st.DrawFn, small: bool, a: Accepts = ANYTHING) -> tuple[str, Any, dict]:
    page = draw(_page(small, a))
    cap = 300 if small else 4133
    edge = _pick(1, 0, page - 1 if page > 1 else 2, page, page + 1, 2 * page + 1)
    lens = draw(st.lists(edge.map(lambda n: min(n, cap)) | st.integers(0, cap),
                         min_size=1, max_size=4))
    s_q = draw(st.integers(1, 4))
    scale, gain = draw(_scale_gain())
    spec = DecodeSpec(
        tuple(lens), heads=draw(_heads(small, a)), s_q=s_q, causal=draw(st.booleans()), page=page,
        scale=scale, q_gain=gain,
        # a dominant key under a sharp softmax: logits in the thousands, past what the lse's
        # absolute budget holds in float32
        dominant=gain == 1.0 and scale == DEFAULT_SCALE and draw(st.booleans()),
        unused_entry=draw(_pick("nan_page", "-1")), sink=draw(_sink(a)))
    return "mla.conformance.cases.decode:decode_trial", spec, {}


# ---- sparse_mla_decode ----------------------------------------------------------------------

@st.composite
def _scope(draw: st.DrawFn, batch: int, s_q: int, small: bool, a: Accepts = ANYTHING
           ) -> dict[str, Any]:
    """The fields one KV scope of a sparse decode draws: page, slots, top-k, -1 entries,
    lonely queries, topk_length. ``split_rows`` writes about 2/3 of the slots, and a query's
    entries are distinct: topk <= 2/3 of them."""
    page = draw(_page(small, a))
    topk = draw(_pick(64, 1, 2, 16, 63, 65, 128) | st.integers(1, 128))
    # at least 12 slots: some left unwritten (NaN) for the entries past topk_length
    slots = draw(st.integers(max(3 * topk // 2 + 2, 12), max(3 * topk // 2 + 2, 12) + 300))
    pairs = [(b, s) for b in range(batch) for s in range(s_q)]
    lonely = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=len(pairs)))
    lengths = draw(st.none() | st.lists(st.integers(0, topk) | _pick(topk, 0, 1),
                                        min_size=batch, max_size=batch).map(tuple)
                   ) if a.topk_length else None
    return {"page": page, "slots": slots, "topk": topk,
            "minus_one": draw(_pick(0.0, 0.3, 0.9)) if topk > 1 else 0.0,
            "lonely": tuple(sorted(lonely)),
            "topk_length": lengths}


@st.composite
def _sparse_decode(draw: st.DrawFn, small: bool, a: Accepts = ANYTHING
                   ) -> tuple[str, Any, dict]:
    batch, s_q = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    first = draw(_scope(batch, s_q, small, a))
    d = draw(_pick(576, 512))
    extra = None
    # fp8 caches only: the fp8_ds_mla one (d = 576) has no second scope
    if a.extra_scope and (not a.fp8_cache or d == 512) and draw(st.booleans()):
        extra = SparseDecodeSpec(**draw(_scope(batch, s_q, small, a)))
    fp8 = d == 576 and extra is None and (a.fp8_cache or draw(st.booleans()))
    model1 = d == 512 and (a.fp8_cache or draw(st.booleans()))
    if model1:  # the MODEL1 view of a single page has no padding to stride over: two or more
        first["slots"] = max(first["slots"], 2 * first["page"])
        if extra is not None:
            extra = dataclasses.replace(extra, slots=max(extra.slots, 2 * extra.page))
    scale, gain = draw(_scale_gain())
    spec = SparseDecodeSpec(
        batch=batch, s_q=s_q, heads=draw(_heads(small, a)), fp8=fp8, model1=model1, d=d,
        scale=scale, q_gain=gain,
        past_length=draw(_pick("rows", "nan")) if first["topk_length"] is not None else "rows",
        repeats=draw(_pick(0, 1, 5)), sink=draw(_sink(a)), extra=extra, **first)
    return "mla.conformance.cases.sparse_decode:sparse_decode_trial", spec, {}


# ---- sparse_mla_prefill ---------------------------------------------------------------------

@st.composite
def _sparse_prefill(draw: st.DrawFn, small: bool, a: Accepts = ANYTHING
                    ) -> tuple[str, Any, dict]:
    s_q = draw(st.integers(1, 6))
    topk = draw(_pick(64, 1, 2, 16, 63, 65, 128) | st.integers(1, 128))
    low = max(4 * topk // 3 + 2, 12)  # some rows left unwritten (NaN)
    s_kv = draw(st.integers(low, low + 300))
    bad = (-1, INT_MIN, -2, -s_kv, s_kv, s_kv + 1, INT_MAX)
    sentinels = draw(st.lists(st.sampled_from(bad), unique=True, max_size=3))
    lengths = draw(st.none() | st.lists(st.integers(0, topk) | _pick(topk, 0, 1),
                                        min_size=s_q, max_size=s_q).map(tuple))
    scale, gain = draw(_scale_gain())
    spec = SparsePrefillSpec(
        s_q=s_q, heads=draw(_heads(small, a)), topk=topk, s_kv=s_kv, scale=scale,
        sentinels=tuple(sentinels),
        lonely=tuple(sorted(draw(st.lists(st.integers(0, s_q - 1), unique=True)))),
        topk_length=lengths,
        past_length=draw(_pick("rows", "nan")) if lengths is not None else "rows",
        repeats=draw(_pick(0, 1, 5)), q_gain=gain, d=draw(_pick(576, 512)),
        sink=draw(_sink(a)))
    return "mla.conformance.cases.sparse_prefill:sparse_prefill_trial", spec, {}


# ---- merge_attn_states ----------------------------------------------------------------------

@st.composite
def _merge(draw: st.DrawFn, small: bool, a: Accepts = ANYTHING) -> tuple[str, Any, dict]:
    markers = draw(_pick((INF,), (-INF,), (INF, -INF)))
    spec = MergeSpec(
        draw(_pick(1, 0, 2, 9) | st.integers(0, 64 if small else 1031)),
        heads=draw(_heads(small, a)), d=draw(_pick(512, 128, 64, 576, 65)),
        lse_center=draw(_pick(4.0, 0.0, -30.0, 1000.0)), lse_spread=draw(_pick(2.0, 0.0, 6.0)),
        gap=draw(_pick(0.0, 30.0, 120.0, 2000.0)), equal=draw(st.booleans()),
        signs=draw(st.booleans()), one_empty=draw(_pick(0.0, 0.5, 1.0)),
        both_empty=draw(_pick(0.0, 0.3, 1.0)), markers=markers, nan=draw(st.booleans()))
    # a side whose weight underflows to 0 (gap 2000) holding inf or NaN, or the plain trial
    garbage = draw(_pick("", "inf", "nan", "-inf"))
    if garbage:
        spec = dataclasses.replace(spec, gap=2000.0, nan=False)
        return ("mla.conformance.cases.merge:merge_underflow_trial", spec,
                {"garbage": garbage})
    return "mla.conformance.cases.merge:merge_trial", spec, {}


# ---- cp_lse_ag_out_rs -----------------------------------------------------------------------

@st.composite
def _dcp(draw: st.DrawFn, small: bool, a: Accepts = ANYTHING) -> tuple[str, Any, dict]:
    world = draw(_pick(2, 1, 4, 8))
    heads = world * draw(_pick(1, 2, 3, 16))
    spec = DcpSpec(
        world, draw(_pick(1, 2, 8) | st.integers(1, 16)), heads=heads,
        d=draw(_pick(512, 128, 64, 65) if a.pow2_dims else _pick(512, 128, 64)),
        lse_spread=draw(_pick(2.0, 0.0, 6.0)),
        gap=draw(_pick(0.0, 30.0, 120.0)), empty=draw(_pick(0.0, 0.4, 0.9)),
        all_empty=draw(_pick(0.0, 0.5, 1.0)), markers=draw(_pick((INF,), (-INF,), (INF, -INF))),
        garbage=draw(_pick("nan", "zero", "random")), short=draw(st.booleans()),
        nan=draw(st.booleans()))
    # the NaN trials hold the lse too (dcp_trial's NaN rule needs it)
    spec = dataclasses.replace(spec, return_lse=spec.nan or draw(st.booleans()))
    return "mla.conformance.cases.dcp:dcp_trial", spec, {}


# ---- top_k_per_row --------------------------------------------------------------------------

@st.composite
def _topk(draw: st.DrawFn, small: bool, a: Accepts = ANYTHING) -> tuple[str, Any, dict]:
    """Rows of 0, 1, k - 1, k, k + 1 keys and any length (to 128K on a GPU), from column 0 or
    past it, NaN past each row's end; ties down to a handful of values, NaN / ±inf / signed
    zeros at the k-th place, rows mostly -inf, magnitudes near 2^-90 and 2^100; many rows."""
    k = draw(_pick(*a.topk) if a.topk else _pick(1, 2, 7, 64, 512, 2048) | st.integers(1, 2048))
    cap = 5000 if small else 131072
    edge = _pick(1, 0, k - 1, k, k + 1, 2 * k + 1)
    long = _pick(8193) if small else _pick(131072, 8193, 32769, 65537, 100003)
    lens = draw(st.lists(edge | st.integers(0, cap) | long, min_size=1,
                         max_size=4 if small else 6))
    start = draw(_pick(0, 90, 1) if small else _pick(0, 90, 1, 100000)) if a.row_starts else 0
    pad = draw(_pick(5, 0, 1, 97))
    repeat = draw(_pick(1, 2) if small else _pick(1, 2, 33, 300))
    # at most 2^24 logits a trial (the reference sorts them on the CPU)
    repeat = max(1, min(repeat, 2 ** 24 // (len(lens) * (max(lens) + start + pad + 1))))
    specials = draw(st.booleans())
    spec = TopkSpec(tuple(lens), topk=k, start=start, pad=pad, repeat=repeat,
                    ties=draw(_pick(0.0, 40.0, 1.0, 0.1)), specials=specials,
                    neg_inf_every=draw(_pick(20, 2, 1)) if specials else 20,
                    exponent=draw(_pick(0, -90, 100)))
    return "mla.conformance.cases.indexer_specs:topk_spec_trial", spec, {}


# ---- fp8_mqa_logits and fp8_paged_mqa_logits ------------------------------------------------

def _index_heads(small: bool, a: Accepts = ANYTHING) -> st.SearchStrategy[int]:
    if a.heads:
        return _pick(*a.heads)
    return _pick(1, 3, 5, 16, 33, 64) if small else _pick(1, 3, 5, 16, 33, 64, 127, 128)


@st.composite
def _ragged(draw: st.DrawFn, small: bool, a: Accepts = ANYTHING) -> tuple[str, Any, dict]:
    """Requests of 0, 1, tile edges and any length, their last queries' windows whole or cut
    to the last few keys (windows of 1), empty windows, unseen NaN keys between requests, a
    NaN code within the windows, key scales over 2^±12, weights times 2^-80 or 2^100, odd
    head counts, compressed rows; a few thousand queries on a GPU."""
    cap = 300 if small else 4133
    edge = _pick(1, 0, 2, 63, 64, 65, 127, 129)
    lens = draw(st.lists(edge | st.integers(0, cap), min_size=1, max_size=3 if small else 5)
                .filter(any))
    heads = draw(_index_heads(small, a))
    queries = draw(_pick(8, 1, 2, 16, 65) if small else _pick(8, 1, 2, 16, 65, 257, 2048, 4096))
    gap = draw(_pick(0, 1, 5, 64))
    # at most 2^27 query-head-key triples (the float64 reference's dots on the CPU)
    keys = sum(lens) + gap * len(lens)
    queries = max(1, min(queries, 2 ** 27 // (heads * keys * len(lens))))
    n_queries = sum(min(n, queries) for n in lens)
    empty = draw(st.lists(st.integers(0, n_queries - 1), unique=True,
                          max_size=min(n_queries, 4)))
    spec = RaggedSpec(
        tuple(lens), queries=queries, heads=heads, window=draw(_pick(0, 1, 2, 64, 65)),
        empty=tuple(sorted(empty)), gap=gap, nan_key=draw(st.booleans()),
        spread=draw(_pick(4, 0, 12)), exponent=draw(_pick(0, -80, 100)),
        compressed=draw(st.none() | _pick(5, 0, 1, 64)))
    return "mla.conformance.cases.indexer_specs:ragged_spec_trial", spec, {}


@st.composite
def _paged_logits(draw: st.DrawFn, small: bool, a: Accepts = ANYTHING
                  ) -> tuple[str, Any, dict]:
    """Decode rows over the paged key cache: pages 1 to 256, lengths 0, 1 and page edges
    (to 33K on a GPU), next_n 1 to 4 (rows seeing no key), odd head counts, unused
    block-table entries a NaN page or -1, a NaN code in a key."""
    page = draw(_page(small, a))
    cap = 300 if small else 33000
    edge = _pick(1, 0, page - 1 if page > 1 else 2, page, page + 1, 2 * page + 1)
    lens = draw(st.lists(edge.map(lambda n: min(n, cap)) | st.integers(0, cap),
                         min_size=1, max_size=4))
    spec = LogitsSpec(tuple(lens), next_n=draw(_pick(*a.next_n) if a.next_n else
                                               st.integers(1, 4)), page=page,
                      heads=draw(_index_heads(small, a)),
                      unused_entry=draw(_pick("nan_page", "-1")),
                      nan_key=lens[0] > 0 and draw(st.booleans()))
    return "mla.conformance.cases.indexer:paged_trial", spec, {}


STRATEGIES: dict[str, Callable[[bool, Accepts], st.SearchStrategy]] = {
    "mla_decode_paged": _decode,
    "sparse_mla_decode": _sparse_decode,
    "sparse_mla_prefill": _sparse_prefill,
    "merge_attn_states": _merge,
    "cp_lse_ag_out_rs": _dcp,
    "top_k_per_row": _topk,
    "fp8_mqa_logits": _ragged,
    "fp8_paged_mqa_logits": _paged_logits,
}
FUZZED = tuple(STRATEGIES)


def examples_of(kernel: str, dtypes: tuple[torch.dtype, ...], small: bool = True,
                accepts: Accepts | None = None) -> st.SearchStrategy[Example]:
    """The strategy of ``kernel``'s examples (``small``: shapes for Triton's interpreter;
    ``accepts``: drawn within what the kernel takes, ``None``: anything)."""
    if kernel not in STRATEGIES:
        raise ValueError(f"no fuzz strategy for {kernel!r}; fuzzed kernels: {list(FUZZED)}")
    if accepts is not None and not isinstance(accepts, Accepts):
        raise TypeError(f"accepts must be an Accepts or None, got {type(accepts).__name__}")
    a = accepts or ANYTHING

    @st.composite
    def example(draw: st.DrawFn) -> Example:
        trial, spec, options = draw(STRATEGIES[kernel](small, a))
        return Example(kernel, trial, spec, draw(st.integers(0, 2 ** 16 - 1)),
                       draw(st.sampled_from(dtypes)), tuple(sorted(options.items())))

    return example()
