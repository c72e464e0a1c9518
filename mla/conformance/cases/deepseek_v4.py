"""DeepSeek-V4's conventions (conventions §14) as cases of the kernels that gained them.

Three topics, over ``sparse_mla_decode``, ``sparse_mla_prefill`` and ``mla_decode_paged``:

- ``sink``: ``attn_sink [N]`` float32 scales a head's output by ``exp(lse) / (exp(lse) +
  exp(sink))`` and leaves the lse alone; ``+inf`` zeroes the output, ``-inf`` changes
  nothing, a query with no key keeps ``out = 0`` and ``lse = +inf``; sinks differ per head.
  The factor is computed in float32 by the kernels, well inside the kernels' own budgets, so
  a sink case is held to the kernel's ``out_rel`` / ``lse_abs`` budgets.
- ``model1``: ``sparse_mla_decode`` over the MODEL1 fp8 cache (``d_qk = 512``, V the whole
  row, pages of 1 or 64 tokens, ``-1`` entries, lonely queries, ``topk_length``), held to the
  ``fp8_ds_mla`` decode's budgets: the kernel and the reference read the same bytes.
- ``second_scope``: ``extra_k_cache`` with its own page size and indices and
  ``extra_topk_length``, attended in one softmax with the first scope; one scope empty for
  some queries, both for one.

``d_qk = 512`` (DeepSeek-V4's rows, V the whole row) runs through all three. The cases reuse
the families' builders (``SparseDecodeSpec``, ``SparsePrefillSpec``, ``DecodeSpec``) with
their DeepSeek-V4 fields. A kernel that takes no ``attn_sink`` or ``extra_k_cache`` keyword,
or refuses the MODEL1 cache by name, is "unsupported" on these cases (``common.call_v4``);
``mla.check`` leaves out for a fast kernel the topics whose keyword it does not take
(``mla.check.catalogue.not_in_fast``).
"""

from __future__ import annotations

from mla.conformance.cases.decode import DecodeSpec, decode_trial
from mla.conformance.cases.sparse_decode import SparseDecodeSpec, sparse_decode_trial
from mla.conformance.cases.sparse_prefill import (
    INT_MIN,
    S_KV,
    SparsePrefillSpec,
    sparse_prefill_trial,
)
from mla.conformance.catalogue import spec_cases

__all__ = ["TOPICS", "D_V4"]

TOPICS = ("sink", "model1", "second_scope")
D_V4 = 512  # DeepSeek-V4's row: 448 nope + 64 rope, V the whole row


_decode = spec_cases("sparse_mla_decode", sparse_decode_trial)
_prefill = spec_cases("sparse_mla_prefill", sparse_prefill_trial)
_paged = spec_cases("mla_decode_paged", decode_trial)


def _topk(small: bool) -> int:
    """DeepSeek-V4's top-k 512, shorter under the interpreter."""
    return 128 if small else 512


# ---- sparse_mla_decode: attention sinks -----------------------------------------------------
_decode("sink_finite", "sink",
        "A finite attn_sink per head scales out by exp(lse) / (exp(lse) + exp(sink)); the lse "
        "is the real keys' alone.",
        lambda s: SparseDecodeSpec(batch=2, s_q=2, sink="finite"), 400)
_decode("sink_plus_inf", "sink",
        "attn_sink = +inf takes the whole softmax: out = 0, the lse unchanged.",
        lambda s: SparseDecodeSpec(batch=2, sink="+inf"), 401)
_decode("sink_minus_inf", "sink",
        "attn_sink = -inf takes nothing: out and lse as without a sink.",
        lambda s: SparseDecodeSpec(batch=2, sink="-inf"), 402)
_decode("sink_lonely_queries", "sink",
        "A query with no valid entry keeps out = 0 and lse = +inf whatever its sink.",
        lambda s: SparseDecodeSpec(batch=3, s_q=2, lonely=((0, 1), (2, 0)), sink="finite"), 403)
_decode("sink_per_head_fp8", "sink",
        "Sinks differ per head (head 0 +inf, head 1 -inf, the rest finite) over the fp8_ds_mla "
        "cache with 64 heads.",
        lambda s: SparseDecodeSpec(batch=2, heads=64, fp8=True, sink="per_head"), 404)
_decode("sink_d_qk_512", "sink",
        "A sink with DeepSeek-V4's rows of 512 (V the whole row) in q's dtype.",
        lambda s: SparseDecodeSpec(batch=2, d=D_V4, sink="finite"), 405)
_decode("sink_once_over_two_scopes", "sink",
        "With a second KV scope the sink is applied once, to the softmax over both scopes, "
        "not to each scope before they are merged.",
        lambda s: SparseDecodeSpec(batch=2, s_q=2, d=D_V4, sink="per_head",
                                   extra=SparseDecodeSpec(page=16, slots=200, topk=32)), 406)
# ---- sparse_mla_decode: the MODEL1 cache ----------------------------------------------------
_decode("model1_v4_64_heads", "model1",
        "DeepSeek-V4: 64 heads over the MODEL1 cache (448 e4m3 values in 7 UE8M0-scaled tiles "
        "of 64, 64 bf16 rope, pages of 64), d_qk = head_dim_v = 512.",
        lambda s: SparseDecodeSpec(batch=2, heads=64, topk=_topk(s.small), slots=1200,
                                   d=D_V4, model1=True), 410)
_decode("model1_128_heads_mtp", "model1",
        "The MODEL1 cache with 128 heads and s_q = 2: each query reads its own index row.",
        lambda s: SparseDecodeSpec(batch=2, s_q=2, heads=128, d=D_V4, model1=True), 411)
_decode("model1_page_1", "model1",
        "MODEL1 pages of one token: 584 bytes padded to 1152, the scales after the token's "
        "data row.",
        lambda s: SparseDecodeSpec(page=1, slots=300, d=D_V4, model1=True), 412)
_decode("model1_minus_one", "model1",
        "-1 entries over the MODEL1 cache, scattered and as a tail: dropped before any byte "
        "is read.",
        lambda s: SparseDecodeSpec(batch=3, s_q=2, minus_one=0.3, d=D_V4, model1=True), 413)
_decode("model1_lonely_queries", "model1",
        "Queries whose entries are all -1 over the MODEL1 cache: out = 0, lse = +inf.",
        lambda s: SparseDecodeSpec(batch=3, s_q=2, lonely=((0, 1), (2, 0)), d=D_V4,
                                   model1=True), 414)
_decode("model1_topk_length", "model1",
        "topk_length (5, 0, 64) over the MODEL1 cache: entries past it name NaN rows and are "
        "not read; length 0 makes a request's queries lonely.",
        lambda s: SparseDecodeSpec(batch=3, topk_length=(5, 0, 64), past_length="nan",
                                   d=D_V4, model1=True), 415)
_decode("model1_v4_full", "model1",
        "DeepSeek-V4's whole decode: the MODEL1 cache, pages of 64 beside a second scope of "
        "pages of 1, per-head sinks, topk_length and extra_topk_length.",
        lambda s: SparseDecodeSpec(batch=3, heads=64, topk_length=(64, 17, 0), d=D_V4,
                                   model1=True, sink="per_head",
                                   extra=SparseDecodeSpec(page=1, slots=150, topk=32,
                                                          topk_length=(32, 0, 9))), 416)
# ---- sparse_mla_decode: the second KV scope -------------------------------------------------
_decode("second_scope", "second_scope",
        "extra_k_cache (its own page size 16 and block count) and its indices join the first "
        "scope's entries in one softmax.",
        lambda s: SparseDecodeSpec(batch=3, s_q=2, d=D_V4,
                                   extra=SparseDecodeSpec(page=16, slots=200, topk=32)), 420)
_decode("second_scope_576", "second_scope",
        "A second scope with DeepSeek-V3.2's rows of 576 (V 512) and 128 heads.",
        lambda s: SparseDecodeSpec(batch=2, heads=128,
                                   extra=SparseDecodeSpec(page=64, slots=300, topk=64)), 421)
_decode("second_scope_topk_length", "second_scope",
        "extra_topk_length (32, 3, 0) beside topk_length (1, 64, 40): each scope uses its "
        "own first entries.",
        lambda s: SparseDecodeSpec(batch=3, topk_length=(1, 64, 40), d=D_V4,
                                   extra=SparseDecodeSpec(page=16, slots=200, topk=32,
                                                          topk_length=(32, 3, 0))), 422)
_decode("second_scope_one_empty", "second_scope",
        "One scope all -1 for some queries (the first for two, the second for two others, both "
        "for one: out = 0, lse = +inf), -1 entries in both.",
        lambda s: SparseDecodeSpec(batch=3, s_q=2, d=D_V4, minus_one=0.2,
                                   lonely=((0, 0), (1, 1), (2, 1)),
                                   extra=SparseDecodeSpec(page=16, slots=200, topk=32,
                                                          minus_one=0.2,
                                                          lonely=((0, 1), (1, 0), (2, 1)))),
        423)
_decode("second_scope_model1", "second_scope",
        "Two MODEL1 caches, pages of 64 and of 1: each read through its own page layout.",
        lambda s: SparseDecodeSpec(batch=2, s_q=2, heads=64, d=D_V4, model1=True,
                                   extra=SparseDecodeSpec(page=1, slots=150, topk=32)), 424)
# ---- sparse_mla_prefill: attention sinks ----------------------------------------------------
_prefill("sink_finite", "sink",
         "A finite attn_sink per head scales out by exp(lse) / (exp(lse) + exp(sink)); lse and "
         "max_logits are the real keys' alone.",
         lambda s: SparsePrefillSpec(sink="finite"), 430)
_prefill("sink_plus_inf", "sink",
         "attn_sink = +inf takes the whole softmax: out = 0, lse and max_logits unchanged.",
         lambda s: SparsePrefillSpec(sink="+inf"), 431)
_prefill("sink_minus_inf", "sink",
         "attn_sink = -inf takes nothing: out, lse and max_logits as without a sink.",
         lambda s: SparsePrefillSpec(sink="-inf"), 432)
_prefill("sink_lonely_queries", "sink",
         "A query whose entries are all invalid keeps out = 0, lse = +inf and max_logits = "
         "-inf whatever its sink.",
         lambda s: SparsePrefillSpec(heads=64, sentinels=(-1, INT_MIN, S_KV), lonely=(0, 3),
                                     sink="finite"), 433)
_prefill("sink_per_head_d_qk_512", "sink",
         "DeepSeek-V4's prefill: rows of 512 (V the whole row), 64 heads, sinks differing per "
         "head (head 0 +inf, head 1 -inf).",
         lambda s: SparsePrefillSpec(heads=64, d=D_V4, topk_length=(64, 1, 0, 30, 64, 2),
                                     sink="per_head"), 434)
# ---- mla_decode_paged: attention sinks ------------------------------------------------------
_paged("sink_finite", "sink",
       "A finite attn_sink per head scales out by exp(lse) / (exp(lse) + exp(sink)); the lse "
       "is the real keys' alone.",
       lambda s: DecodeSpec((1, 65, 200), sink="finite"), 440)
_paged("sink_plus_inf", "sink",
       "attn_sink = +inf takes the whole softmax: out = 0, the lse unchanged.",
       lambda s: DecodeSpec((1, 65, 200), sink="+inf"), 441)
_paged("sink_minus_inf", "sink",
       "attn_sink = -inf takes nothing: out and lse as without a sink.",
       lambda s: DecodeSpec((1, 65, 200), sink="-inf"), 442)
_paged("sink_empty_request", "sink",
       "A request of length 0 keeps out = 0 and lse = +inf whatever its sink.",
       lambda s: DecodeSpec((0, 65, 0, 3), sink="finite"), 443)
_paged("sink_per_head_causal", "sink",
       "Sinks differing per head (head 0 +inf, head 1 -inf) with 128 heads and s_q = 2 causal.",
       lambda s: DecodeSpec((2, 65, 300), s_q=2, causal=True, heads=128, sink="per_head"), 444)
