"""The indexer's ``top_k_per_row`` and ``fp8_mqa_logits`` trials from parameter dataclasses,
as ``mla.conformance.fuzz`` draws them (``TopkSpec``, ``RaggedSpec``); the catalogue's named
cases of these kernels are ``indexer``'s, whose inputs, reference and alternatives these
share (``topk_judged``, ``ragged_judged``). ``fp8_paged_mqa_logits``' spec is ``indexer``'s
``LogitsSpec``. This module registers no case.

``TopkSpec``: rows of any length (0, 1, ``topk - 1``, ``topk``, ``topk + 1``, ...) starting at
column 0 or past it (the ragged prefill form, indices relative to the start), NaN in every
column outside a row's range, ties (values rounded to a grid, down to a handful of values),
NaN, ``±inf`` and signed zeros at the ``topk``-th place (``indexer._specials``), rows mostly
``-inf``, magnitudes near the float32 range's ends, many rows.

``RaggedSpec``: requests in one flat key array, each asking with its last ``queries``
positions (``indexer.ragged_trial``'s form), and beside it: query windows cut to their last
``window`` keys (windows of 1 and starts inside a request), empty windows (``ks = ke``, at the
query's end), NaN keys (code and scale) after each request that no query sees, a NaN code
inside the windows, keys' scales over ``2^±spread``, the weights scaled by ``2^exponent``
(logits near ``1e-25`` or ``1e31``), any head count, rows compressed to ``max_seqlen_k``.
"""

from __future__ import annotations

import dataclasses

import torch

from mla.conformance.cases.indexer import (
    HEADS,
    NAN_CODE,
    NAN_DIM,
    TOPK,
    _bf16_keys,
    _fp8_q,
    _specials,
    ragged_judged,
    topk_judged,
)
from mla.conformance.catalogue import Setting, Trial, generator
from mla.reference.indexer_cache import INDEX_DIM, quantize_indexer_k

__all__ = ["TopkSpec", "topk_spec_trial", "RaggedSpec", "ragged_spec_trial", "ragged_windows"]


@dataclasses.dataclass(frozen=True)
class TopkSpec:
    """``top_k_per_row``'s input: rows of ``lens`` keys (repeated ``repeat`` times), each
    starting at a random column in ``[0, start]``, ``pad`` NaN columns after the furthest
    end; values ``randn`` rounded to multiples of ``1 / ties`` (``0``: not rounded), with
    ``specials`` NaN, ``±inf`` and signed zeros at the ``topk``-th place and ``-inf`` at one
    column in ``neg_inf_every``; all times ``2^exponent``."""
    lens: tuple[int, ...]
    topk: int = TOPK
    start: int = 0
    pad: int = 5
    repeat: int = 1
    ties: float = 0.0
    specials: bool = False
    neg_inf_every: int = 20
    exponent: int = 0


def topk_spec_trial(setting: Setting, spec: TopkSpec, salt: int) -> Trial:
    """The trial of ``spec`` (inputs from the setting's seed and ``salt``; the logits float32
    whatever the setting's dtype, as the catalogue's)."""
    g = generator(setting, salt)
    lens = tuple(spec.lens) * spec.repeat
    R = len(lens)
    starts = torch.randint(0, spec.start + 1, (R,), generator=g)
    stop = starts + torch.tensor(lens, dtype=torch.int64)
    width = int(stop.max()) + spec.pad
    logits = torch.randn(R, width, generator=g)
    if spec.ties:
        logits = (logits * spec.ties).round() / spec.ties
    if spec.specials:
        logits = _specials(logits, lens, g, spec.topk, starts, spec.neg_inf_every)
    logits = logits * 2.0 ** spec.exponent  # exact: the values stay normal or 0
    cols = torch.arange(width)[None, :]
    seen = logits[(cols >= starts[:, None]) & (cols < stop[:, None])]
    return topk_judged(setting, logits, starts, stop, spec.topk,
                       nan_low=bool(torch.isnan(seen).any()),
                       neg_zero_low=bool(((seen == 0) & torch.signbit(seen)).any()),
                       absolute=bool((starts > 0).any()))


@dataclasses.dataclass(frozen=True)
class RaggedSpec:
    """``fp8_mqa_logits``' input: requests of ``lens`` keys in one flat array, each asking
    with its last ``queries`` positions (query ``p`` seeing its request's keys ``0..p``, or
    the last ``window`` of them), the queries numbered in ``empty`` seeing none (``ks = ke``
    at the query's end); ``gap`` keys of NaN (code and scale) after each request, seen by no
    query; ``nan_key``: the last request with keys has a NaN code in its first key; keys'
    gains ``2^-spread .. 2^spread``, weights times ``2^exponent``; ``compressed``: rows
    compressed to ``max_seqlen_k`` = the longest window plus this many columns."""
    lens: tuple[int, ...]
    queries: int = 8
    heads: int = HEADS
    window: int = 0
    empty: tuple[int, ...] = ()
    gap: int = 0
    nan_key: bool = False
    spread: int = 4
    exponent: int = 0
    compressed: int | None = None


def ragged_windows(spec: RaggedSpec) -> tuple[list[int], list[int]]:
    """Each query's ``(ks, ke)`` over the flat keys (the requests' keys, each followed by
    ``gap`` NaN keys): ``spec``'s queries in request order."""
    ks, ke, first = [], [], 0
    for n in spec.lens:
        for p in range(max(0, n - spec.queries), n):
            ke.append(first + p + 1)
            ks.append(max(first, ke[-1] - spec.window) if spec.window else first)
        first += n + spec.gap
    for t in spec.empty:
        if t < len(ks):
            ks[t] = ke[t]
    return ks, ke


def ragged_spec_trial(setting: Setting, spec: RaggedSpec, salt: int) -> Trial:
    """The trial of ``spec`` (inputs from the setting's seed and ``salt``: fp8 and float32
    whatever the setting's dtype, as the catalogue's)."""
    g = generator(setting, salt)
    real, scale_r = quantize_indexer_k(_bf16_keys(g, sum(spec.lens), spec.spread))
    n_keys = sum(spec.lens) + spec.gap * len(spec.lens)
    codes = torch.full((n_keys, INDEX_DIM), NAN_CODE, dtype=torch.uint8)
    scale = torch.full((n_keys,), float("nan"), dtype=scale_r.dtype)
    first, at, last = 0, 0, -1
    for n in spec.lens:
        codes[first:first + n], scale[first:first + n] = real[at:at + n], scale_r[at:at + n]
        last = first if n else last
        first, at = first + n + spec.gap, at + n
    if spec.nan_key and last >= 0:
        codes[last, NAN_DIM] = NAN_CODE
    ks, ke = ragged_windows(spec)
    q8, w = _fp8_q(g, len(ks), spec.heads)
    w = w * 2.0 ** spec.exponent  # exact: the weights stay normal
    return ragged_judged(setting, q8, w, codes, scale, torch.tensor(ks, dtype=torch.int32),
                         torch.tensor(ke, dtype=torch.int32), spec.nan_key and last >= 0,
                         spec.compressed)
