"""What ``mla.conformance.fuzz`` draws: per kernel, a hypothesis strategy over the fields of
its case family's parameter dataclass (``DecodeSpec``, ``SparseDecodeSpec``,
``SparsePrefillSpec``, ``MergeSpec``, ``DcpSpec``; the indexer's ``TopkSpec``, ``RaggedSpec``
and ``LogitsSpec``) and a seed.

An ``Example`` names the family's trial builder, those parameters, the seed and the dtype; the
trial builds the inputs from the seed, runs the float64 reference and holds the outputs to the
catalogue's budgets, exactly as a named case does. The strategies reach the corners the
catalogue pins one at a time and their combinations: odd head counts, page sizes 1 to 256,
ragged lengths with 0, 1 and page edges, ``s_q`` with and without ``causal``, top-k widths,
``-1`` and other invalid indices anywhere, ``topk_length`` (with NaN rows past it), lonely
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

__all__ = ["Example", "STRATEGIES", "FUZZED", "examples_of", "trial_of"]

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


def _pick(*values: Any) -> st.SearchStrategy:
    """One of ``values``, shrinking towards the first."""
    return st.sampled_from(values)


def _page(small: bool) -> st.SearchStrategy[int]:
    return _pick(64, 1, 16, 2, 128, 256) | st.integers(1, 256)


def _heads(small: bool) -> st.SearchStrategy[int]:
    return _pick(1, 3, 5, 16, 33) if small else _pick(1, 3, 5, 16, 33, 64, 127, 128)


# ---- mla_decode_paged -----------------------------------------------------------------------

@st.composite
def _decode(draw: st.DrawFn, small: bool) -> tuple[str, Any, dict]:
    page = draw(_page(small))
    cap = 300 if small else 4133
    edge = _pick(1, 0, page - 1 if page > 1 else 2, page, page + 1, 2 * page + 1)
    lens = draw(st.lists(edge.map(lambda n: min(n, cap)) | st.integers(0, cap),
                         min_size=1, max_size=4))
    s_q = draw(st.integers(1, 4))
    scale, gain = draw(_scale_gain())
    spec = DecodeSpec(
        tuple(lens), heads=draw(_heads(small)), s_q=s_q, causal=draw(st.booleans()), page=page,
        scale=scale, q_gain=gain,
        # a dominant key under a sharp softmax: logits in the thousands, past what the lse's
        # absolute budget holds in float32
        dominant=gain == 1.0 and scale == DEFAULT_SCALE and draw(st.booleans()),
        unused_entry=draw(_pick("nan_page", "-1")), sink=draw(_pick(*SINKS)))
    return "mla.conformance.cases.decode:decode_trial", spec, {}


# ---- sparse_mla_decode ----------------------------------------------------------------------

@st.composite
def _scope(draw: st.DrawFn, batch: int, s_q: int, small: bool) -> dict[str, Any]:
    """The fields one KV scope of a sparse decode draws: page, slots, top-k, -1 entries,
    lonely queries, topk_length. ``split_rows`` writes about 2/3 of the slots, and a query's
    entries are distinct: topk <= 2/3 of them."""
    page = draw(_page(small))
    topk = draw(_pick(64, 1, 2, 16, 63, 65, 128) | st.integers(1, 128))
    # at least 12 slots: some left unwritten (NaN) for the entries past topk_length
    slots = draw(st.integers(max(3 * topk // 2 + 2, 12), max(3 * topk // 2 + 2, 12) + 300))
    pairs = [(b, s) for b in range(batch) for s in range(s_q)]
    lonely = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=len(pairs)))
    lengths = draw(st.none() | st.lists(st.integers(0, topk) | _pick(topk, 0, 1),
                                        min_size=batch, max_size=batch).map(tuple))
    return {"page": page, "slots": slots, "topk": topk,
            "minus_one": draw(_pick(0.0, 0.3, 0.9)) if topk > 1 else 0.0,
            "lonely": tuple(sorted(lonely)),
            "topk_length": lengths}


@st.composite
def _sparse_decode(draw: st.DrawFn, small: bool) -> tuple[str, Any, dict]:
    batch, s_q = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    first = draw(_scope(batch, s_q, small))
    d = draw(_pick(576, 512))
    extra = None
    if draw(st.booleans()):
        extra = SparseDecodeSpec(**draw(_scope(batch, s_q, small)))
    fp8 = d == 576 and extra is None and draw(st.booleans())
    model1 = d == 512 and draw(st.booleans())
    if model1:  # the MODEL1 view of a single page has no padding to stride over: two or more
        first["slots"] = max(first["slots"], 2 * first["page"])
        if extra is not None:
            extra = dataclasses.replace(extra, slots=max(extra.slots, 2 * extra.page))
    scale, gain = draw(_scale_gain())
    spec = SparseDecodeSpec(
        batch=batch, s_q=s_q, heads=draw(_heads(small)), fp8=fp8, model1=model1, d=d,
        scale=scale, q_gain=gain,
        past_length=draw(_pick("rows", "nan")) if first["topk_length"] is not None else "rows",
        repeats=draw(_pick(0, 1, 5)), sink=draw(_pick(*SINKS)), extra=extra, **first)
    return "mla.conformance.cases.sparse_decode:sparse_decode_trial", spec, {}


# ---- sparse_mla_prefill ---------------------------------------------------------------------

@st.composite
def _sparse_prefill(draw: st.DrawFn, small: bool) -> tuple[str, Any, dict]:
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
        s_q=s_q, heads=draw(_heads(small)), topk=topk, s_kv=s_kv, scale=scale,
        sentinels=tuple(sentinels),
        lonely=tuple(sorted(draw(st.lists(st.integers(0, s_q - 1), unique=True)))),
        topk_length=lengths,
        past_length=draw(_pick("rows", "nan")) if lengths is not None else "rows",
        repeats=draw(_pick(0, 1, 5)), q_gain=gain, d=draw(_pick(576, 512)),
        sink=draw(_pick(*SINKS)))
    return "mla.conformance.cases.sparse_prefill:sparse_prefill_trial", spec, {}


# ---- merge_attn_states ----------------------------------------------------------------------

@st.composite
def _merge(draw: st.DrawFn, small: bool) -> tuple[str, Any, dict]:
    markers = draw(_pick((INF,), (-INF,), (INF, -INF)))
    spec = MergeSpec(
        draw(_pick(1, 0, 2, 9) | st.integers(0, 64 if small else 1031)),
        heads=draw(_heads(small)), d=draw(_pick(512, 128, 64, 576, 65)),
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
def _dcp(draw: st.DrawFn, small: bool) -> tuple[str, Any, dict]:
    world = draw(_pick(2, 1, 4, 8))
    heads = world * draw(_pick(1, 2, 3, 16))
    spec = DcpSpec(
        world, draw(_pick(1, 2, 8) | st.integers(1, 16)), heads=heads,
        d=draw(_pick(512, 128, 64, 65)), lse_spread=draw(_pick(2.0, 0.0, 6.0)),
        gap=draw(_pick(0.0, 30.0, 120.0)), empty=draw(_pick(0.0, 0.4, 0.9)),
        all_empty=draw(_pick(0.0, 0.5, 1.0)), markers=draw(_pick((INF,), (-INF,), (INF, -INF))),
        garbage=draw(_pick("nan", "zero", "random")), short=draw(st.booleans()),
        nan=draw(st.booleans()))
    # the NaN trials hold the lse too (dcp_trial's NaN rule needs it)
    spec = dataclasses.replace(spec, return_lse=spec.nan or draw(st.booleans()))
    return "mla.conformance.cases.dcp:dcp_trial", spec, {}


# ---- top_k_per_row --------------------------------------------------------------------------

@st.composite
def _topk(draw: st.DrawFn, small: bool) -> tuple[str, Any, dict]:
    """Rows of 0, 1, k - 1, k, k + 1 keys and any length (to 128K on a GPU), from column 0 or
    past it, NaN past each row's end; ties down to a handful of values, NaN / ±inf / signed
    zeros at the k-th place, rows mostly -inf, magnitudes near 2^-90 and 2^100; many rows."""
    k = draw(_pick(1, 2, 7, 64, 512, 2048) | st.integers(1, 2048))
    cap = 5000 if small else 131072
    edge = _pick(1, 0, k - 1, k, k + 1, 2 * k + 1)
    long = _pick(8193) if small else _pick(131072, 8193, 32769, 65537, 100003)
    lens = draw(st.lists(edge | st.integers(0, cap) | long, min_size=1,
                         max_size=4 if small else 6))
    start = draw(_pick(0, 90, 1) if small else _pick(0, 90, 1, 100000))
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

def _index_heads(small: bool) -> st.SearchStrategy[int]:
    return _pick(1, 3, 5, 16, 33, 64) if small else _pick(1, 3, 5, 16, 33, 64, 127, 128)


@st.composite
def _ragged(draw: st.DrawFn, small: bool) -> tuple[str, Any, dict]:
    """Requests of 0, 1, tile edges and any length, their last queries' windows whole or cut
    to the last few keys (windows of 1), empty windows, unseen NaN keys between requests, a
    NaN code within the windows, key scales over 2^±12, weights times 2^-80 or 2^100, odd
    head counts, compressed rows; a few thousand queries on a GPU."""
    cap = 300 if small else 4133
    edge = _pick(1, 0, 2, 63, 64, 65, 127, 129)
    lens = draw(st.lists(edge | st.integers(0, cap), min_size=1, max_size=3 if small else 5)
                .filter(any))
    heads = draw(_index_heads(small))
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
def _paged_logits(draw: st.DrawFn, small: bool) -> tuple[str, Any, dict]:
    """Decode rows over the paged key cache: pages 1 to 256, lengths 0, 1 and page edges
    (to 33K on a GPU), next_n 1 to 4 (rows seeing no key), odd head counts, unused
    block-table entries a NaN page or -1, a NaN code in a key."""
    page = draw(_page(small))
    cap = 300 if small else 33000
    edge = _pick(1, 0, page - 1 if page > 1 else 2, page, page + 1, 2 * page + 1)
    lens = draw(st.lists(edge.map(lambda n: min(n, cap)) | st.integers(0, cap),
                         min_size=1, max_size=4))
    spec = LogitsSpec(tuple(lens), next_n=draw(st.integers(1, 4)), page=page,
                      heads=draw(_index_heads(small)), unused_entry=draw(_pick("nan_page", "-1")),
                      nan_key=lens[0] > 0 and draw(st.booleans()))
    return "mla.conformance.cases.indexer:paged_trial", spec, {}


STRATEGIES: dict[str, Callable[[bool], st.SearchStrategy]] = {
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


def examples_of(kernel: str, dtypes: tuple[torch.dtype, ...], small: bool = True
                ) -> st.SearchStrategy[Example]:
    """The strategy of ``kernel``'s examples (``small``: shapes for Triton's interpreter)."""
    if kernel not in STRATEGIES:
        raise ValueError(f"no fuzz strategy for {kernel!r}; fuzzed kernels: {list(FUZZED)}")

    @st.composite
    def example(draw: st.DrawFn) -> Example:
        trial, spec, options = draw(STRATEGIES[kernel](small))
        return Example(kernel, trial, spec, draw(st.integers(0, 2 ** 16 - 1)),
                       draw(st.sampled_from(dtypes)), tuple(sorted(options.items())))

    return example()
