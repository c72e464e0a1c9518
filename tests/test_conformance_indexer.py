"""The indexer family's bite: the reference with one convention changed fails exactly the cases
that pin it, with the convention named, and no other kernel's case."""

from __future__ import annotations

import pytest
import torch

import mla.reference as ref
from mla.conformance import CATALOGUE, KERNELS, run
from mla.conformance.cases.indexer import (
    CAUSAL_IGNORED,
    CAUSAL_SHORT,
    FULL_ROWS,
    INVERTED_SCALE,
    NAN_LOW,
    NAN_ZERO,
    NEG_ZERO_LOW,
    NO_RELU,
    NO_WEIGHTS,
    SCALE_IGNORED,
    TIES_HIGH,
    TOKEN_ROWS,
)
from mla.conformance.cases.paged_cache import WRAP_MINUS_ONE
from mla.reference.indexer_cache import read_indexer_k_cache

F64 = dict(device="cpu", dtype=torch.float64)
REFERENCE = {k: getattr(ref, k) for k in KERNELS}
INDEXER = ["indexer_k_quant_and_cache", "fp8_paged_mqa_logits", "fp8_mqa_logits",
           "top_k_per_row"]


def _topics(kernel: str) -> set[str]:
    return {c.topic for c in CATALOGUE.values() if c.kernel == kernel}


# ---- broken twins of the cache write ----------------------------------------------------------

def _scale_bytes_at(cache: torch.Tensor, slot: int) -> slice:
    bs = cache.shape[1]
    p, o = divmod(slot, bs)
    start = p * bs * 132 + bs * 128 + 4 * o
    return slice(start, start + 4)


def _inverted_scales(k, kv_cache, slot_mapping, *args):
    ref.indexer_k_quant_and_cache(k, kv_cache, slot_mapping, *args)
    flat = kv_cache.view(-1)
    for s in slot_mapping[slot_mapping >= 0].tolist():
        at = _scale_bytes_at(kv_cache, s)
        flat[at] = (1.0 / flat[at].clone().view(torch.float32)).view(torch.uint8)


def _writes_minus_one(k, kv_cache, slot_mapping, *args):
    n = kv_cache.shape[0] * kv_cache.shape[1]
    ref.indexer_k_quant_and_cache(k, kv_cache, torch.where(slot_mapping < 0, n - 1,
                                                           slot_mapping), *args)


def _token_rows(k, kv_cache, slot_mapping, *args):
    keep = slot_mapping >= 0
    codes, scale = ref.quantize_indexer_k(k[keep])
    rows = torch.cat([codes, scale.view(torch.uint8).view(-1, 4)], dim=1)
    kv_cache.view(-1, 132)[slot_mapping[keep].long()] = rows


# ---- broken twins of the logits ---------------------------------------------------------------

def _paged_plain(q, kv_cache, weights, context_lens, block_tables, max_model_len, *,
                 relu=True):
    """The paged logits written out, with the ReLU as a switch."""
    B, nn = q.shape[:2]
    bs = kv_cache.shape[1]
    out = torch.full((B * nn, max_model_len), float("-inf"))
    for b, n in enumerate(context_lens.tolist()):
        pos = torch.arange(n)
        codes, scale = read_indexer_k_cache(kv_cache, block_tables[b].long()[pos // bs] * bs
                                            + pos % bs)
        dots = torch.einsum("thd,nd->thn", q[b].float(), codes.float())
        dots = dots.clamp_min(0) if relu else dots
        rows = torch.einsum("th,thn->tn", weights[b * nn:(b + 1) * nn].float(), dots) * scale
        for i in range(nn):
            end = max(0, n - nn + i + 1)
            out[b * nn + i, :end] = rows[i, :end]
    return out


def _paged_no_relu(*args):
    return _paged_plain(*args, relu=False)


def _paged_scale_ignored(q, kv_cache, *args):
    ones = kv_cache.clone()
    nb, bs, _ = ones.shape
    for p in range(nb):  # every scale byte of every page set to float32 1.0
        ones[p].view(-1)[bs * 128:] = torch.ones(bs).view(torch.uint8)
    return ref.fp8_paged_mqa_logits(q, ones, *args)


def _paged_no_weights(q, kv_cache, weights, *args):
    return ref.fp8_paged_mqa_logits(q, kv_cache, torch.ones_like(weights), *args)


def _paged_causal_short(q, kv_cache, weights, context_lens, *args):
    return ref.fp8_paged_mqa_logits(q, kv_cache, weights, (context_lens - 1).clamp_min(0),
                                    *args)


def _paged_causal_ignored(q, kv_cache, weights, context_lens, block_tables, max_model_len):
    nn = q.shape[1]
    rows = [ref.fp8_paged_mqa_logits(q[:, i:i + 1], kv_cache, weights[i::nn], context_lens,
                                     block_tables, max_model_len) for i in range(nn)]
    return torch.stack(rows, dim=1).flatten(0, 1)


def _ragged_scale_ignored(q, kv, weights, ks, ke, max_seqlen_k=0):
    return ref.fp8_mqa_logits(q, (kv[0], torch.ones_like(kv[1])), weights, ks, ke, max_seqlen_k)


def _paged_nan_to_zero(*args):
    out = ref.fp8_paged_mqa_logits(*args)
    return torch.where(torch.isnan(out), 0.0, out)


def _ragged_nan_to_zero(*args, **kw):
    out = ref.fp8_mqa_logits(*args, **kw)
    return torch.where(torch.isnan(out), 0.0, out)


def _ragged_causal_short(q, kv, weights, ks, ke, max_seqlen_k=0):
    return ref.fp8_mqa_logits(q, kv, weights, ks, torch.maximum(ke - 1, ks), max_seqlen_k)


def _ragged_full_rows(q, kv, weights, ks, ke, max_seqlen_k=0):
    return ref.fp8_mqa_logits(q, kv, weights, ks, ke)


# ---- broken twins of the top-k ----------------------------------------------------------------

def _ties_to_higher(logits, row_starts, row_ends, topk):
    W = logits.shape[1]
    flipped = ref.top_k_per_row(logits.flip(1), W - row_ends, W - row_starts, topk).long()
    col = W - 1 - (flipped + (W - row_ends.long())[:, None])
    return torch.where(flipped >= 0, col - row_starts.long()[:, None], -1).to(torch.int32)


def _absolute(logits, row_starts, row_ends, topk):
    idx = ref.top_k_per_row(logits, row_starts, row_ends, topk)
    return torch.where(idx >= 0, idx + row_starts[:, None], -1).to(torch.int32)


def _nan_low(logits, row_starts, row_ends, topk):
    cols = torch.arange(logits.shape[1])[None, :]
    inside = (cols >= row_starts[:, None]) & (cols < row_ends[:, None])
    return ref.top_k_per_row(torch.where(torch.isnan(logits) & inside, float("-inf"), logits),
                             row_starts, row_ends, topk)


def _neg_zero_low(logits, row_starts, row_ends, topk):
    return ref.top_k_per_row(torch.where((logits == 0) & torch.signbit(logits), -1e-30, logits),
                             row_starts, row_ends, topk)


# twin -> (kernel, the topics that fail: all their cases and nothing else, the words the
# failing rows' convention line holds)
TWINS = {
    _inverted_scales: ("indexer_k_quant_and_cache", None, INVERTED_SCALE),
    _writes_minus_one: ("indexer_k_quant_and_cache", {"padding"}, WRAP_MINUS_ONE),
    # at page 1 the two layouts are the same bytes
    _token_rows: ("indexer_k_quant_and_cache", {"index_cache_bytes", "padding"}, TOKEN_ROWS),
    _paged_no_relu: ("fp8_paged_mqa_logits", None, NO_RELU),
    _paged_scale_ignored: ("fp8_paged_mqa_logits", None, SCALE_IGNORED),
    _paged_no_weights: ("fp8_paged_mqa_logits", None, NO_WEIGHTS),
    _paged_causal_short: ("fp8_paged_mqa_logits", None, CAUSAL_SHORT),
    _paged_causal_ignored: ("fp8_paged_mqa_logits", {"causal", "empty"}, CAUSAL_IGNORED),
    _paged_nan_to_zero: ("fp8_paged_mqa_logits", {"nan_input"}, NAN_ZERO),
    _ragged_nan_to_zero: ("fp8_mqa_logits", {"nan_input"}, NAN_ZERO),
    _ragged_scale_ignored: ("fp8_mqa_logits", None, SCALE_IGNORED),
    _ragged_causal_short: ("fp8_mqa_logits", None, CAUSAL_SHORT),
    _ragged_full_rows: ("fp8_mqa_logits", {"compressed"}, FULL_ROWS),
    _ties_to_higher: ("top_k_per_row", {"ties", "specials"}, TIES_HIGH),
    _nan_low: ("top_k_per_row", {"specials"}, NAN_LOW),
    # the ties case's rounding makes zeros of both signs too
    _neg_zero_low: ("top_k_per_row", {"ties", "specials"}, NEG_ZERO_LOW),
    _absolute: ("top_k_per_row", {"offsets"}, "not relative to row_starts"),
}


@pytest.mark.parametrize("twin", list(TWINS), ids=lambda f: f.__name__.strip("_"))
def test_indexer_broken_twin_fails_exactly_its_cases_and_is_named(twin):
    kernel, topics, words = TWINS[twin]
    report = run({**REFERENCE, kernel: twin}, kernels=INDEXER, **F64)
    failing = [r for r in report.rows if r.status in ("fail", "error")]
    assert failing and {r.kernel for r in failing} == {kernel}, report.to_text()
    assert all(r.status == "fail" for r in failing), [(r.case, r.detail) for r in failing]
    want = _topics(kernel) if topics is None else topics
    assert {r.topic for r in failing} == want
    mine = [r for r in report.rows if r.kernel == kernel and r.topic in want]
    assert all(r.status == "fail" for r in mine), [(r.case, r.status) for r in mine]
    named = [r for r in failing if words in r.convention]
    assert len(named) >= max(1, len(failing) // 2), [(r.case, r.convention) for r in failing]


def test_a_one_percent_logit_error_fails_and_the_reference_in_float32_passes():
    def one_percent(*args):
        return ref.fp8_paged_mqa_logits(*args) * 1.01

    rows = run({"fp8_paged_mqa_logits": one_percent}, kernels=["fp8_paged_mqa_logits"],
               device="cpu", dtype=torch.float32).rows
    assert rows and all(r.status == "fail" for r in rows)
    rows = run(REFERENCE, kernels=INDEXER, device="cpu", dtype=torch.bfloat16).rows
    assert {r.status for r in rows} == {"pass"}
    worst = max(r.errors["logits"] / r.limits["logits"] for r in rows if "logits" in r.errors)
    assert worst < 0.1  # the float32 reference sits far inside the derived limit
