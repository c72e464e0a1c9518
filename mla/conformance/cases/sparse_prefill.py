"""Cases of ``sparse_mla_prefill``: DeepSeek-V3.2's sparse prefill (FlashMLA's
``flash_mla_sparse_fwd``).

``q [s_q, h_q, D]``; query ``t`` attends to the rows ``kv[indices[t, j]]`` of
``kv [s_kv, D]`` for ``j < topk_length[t]``; any index outside ``[0, s_kv)`` (``-1``,
``INT_MIN``, other negatives, ``s_kv`` and past it) is dropped, and a repeated index counts
once per appearance. ``out [s_q, h_q, d_v]`` in q's dtype, ``max_logits [s_q, h_q]`` (the
largest scaled logit) and ``lse [s_q, h_q]`` in the natural log; a lonely query (no valid
entry) gets ``out = 0``, ``lse = +inf`` and ``max_logits = -inf`` (conventions §10, §12). A
``topk_length`` past ``topk`` is an error of the reference, not a case.

Every case fills the rows no index names with NaN (row 0 and the last row always hold data, so
that a kernel clamping an invalid index instead of dropping it gives finite outputs the report
can name) and poisons the buffers the kernel allocates. A query's entries are distinct (as the
indexer's top-k are) except in the "repeats" topic; only the "sentinels" and "empty" topics
have invalid entries, only "empty" and "topk_length" have lonely queries, only "topk_length"
passes ``topk_length`` and only "scale" passes a scale other than ``1/sqrt(D)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from mla.conformance.cases.common import (
    DEEPSEEK_SCALE,
    DEFAULT_SCALE,
    DV,
    YARN_SCALE,
    D,
    call_v4,
    draw_sink,
    sink_alternatives,
)
from mla.conformance.cases.sparse_decode import (
    draw_any,
    draw_indices,
    once_each,
    scale_alternatives,
    split_rows,
)
from mla.conformance.catalogue import Setting, Trial, generator, spec_cases
from mla.conformance.diagnose import LOG2E
from mla.reference.sparse import sparse_mla_prefill

__all__ = ["SparsePrefillSpec", "sparse_prefill_trial", "INT_MIN", "INT_MAX"]

KERNEL = "sparse_mla_prefill"
Outputs = dict[str, torch.Tensor]
INT_MIN, INT_MAX = -(2 ** 31), 2 ** 31 - 1
S_KV = 300  # the rows of every case but the DeepSeek shapes


@dataclasses.dataclass(frozen=True)
class SparsePrefillSpec:
    s_q: int = 6
    heads: int = 16
    topk: int = 64
    s_kv: int = S_KV  # a quarter of the rows left unwritten (NaN)
    scale: float = DEFAULT_SCALE
    sentinels: tuple[int, ...] = ()  # invalid values put in about a quarter of the entries
    lonely: tuple[int, ...] = ()  # queries whose entries are all invalid
    topk_length: tuple[int, ...] | None = None  # per query
    past_length: str = "rows"  # entries past topk_length name "rows" (written) or "nan" rows
    repeats: int = 0  # > 0: every query's entries drawn from this many rows
    q_gain: float = 1.0
    refused: bool = False  # invalid inputs: the kernel must raise a ValueError
    # DeepSeek-V4 (conventions §14; the cases in deepseek_v4.py), drawn after the rest
    d: int = D  # a row's width: 576 (DeepSeek-V3.2) or 512 (DeepSeek-V4, V the whole row)
    sink: str = ""  # attn_sink: "" (none) or a kind of common.draw_sink


def _kv(spec: SparsePrefillSpec, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor]:
    """float64 ``kv [s_kv, D]``, its written rows and its unwritten (NaN) ones."""
    n = spec.s_kv
    written, unwritten = split_rows(g, n, (3 * n) // 4)
    kv = torch.full((n, spec.d), float("nan"), dtype=torch.float64)
    kv[written] = torch.randn(len(written), spec.d, generator=g, dtype=torch.float64)
    return kv, written, unwritten


def _indices(spec: SparsePrefillSpec, g: torch.Generator, written: torch.Tensor,
             unwritten: torch.Tensor) -> torch.Tensor:
    S, K = spec.s_q, spec.topk
    idx = draw_indices(g, (S, K), written, spec.repeats)
    bad = torch.tensor(spec.sentinels or (-1,), dtype=torch.int32)
    pick = bad[torch.randint(len(bad), (S, K), generator=g)]
    if spec.sentinels:
        idx = torch.where(torch.rand(S, K, generator=g) < 0.25, pick, idx)
    if spec.topk_length is not None and spec.past_length == "nan":
        past = torch.arange(K)[None, :] >= torch.tensor(spec.topk_length)[:, None]
        idx = torch.where(past, draw_any(g, (S, K), unwritten), idx)
    for t in spec.lonely:
        idx[t] = pick[t]
    return idx


def sparse_prefill_trial(setting: Setting, spec: SparsePrefillSpec, salt: int) -> Trial:
    """A trial of ``spec``: inputs in the setting's dtype, the reference on upcast copies."""
    g = generator(setting, salt)
    kv64, written, unwritten = _kv(spec, g)
    q = (torch.randn(spec.s_q, spec.heads, spec.d, generator=g, dtype=torch.float64)
         * spec.q_gain).to(setting.dtype)
    kv = kv64.to(setting.dtype)
    idx = _indices(spec, g, written, unwritten)
    lens = (None if spec.topk_length is None
            else torch.tensor(spec.topk_length, dtype=torch.int32))
    q64, kv64 = q.double(), kv.double()  # the reference sees exactly the kernel's inputs
    sink = draw_sink(g, spec.sink, spec.heads, spec.topk) if spec.sink else None
    dev = setting.device
    args = (q.to(dev), kv.to(dev), idx.to(dev))
    dev_lens = None if lens is None else lens.to(dev)
    dev_sink = {} if sink is None else {"attn_sink": sink.to(dev)}

    def invoke(fn: Callable) -> Outputs:
        out, max_logits, lse = call_v4(fn, *args, spec.scale, DV, dev_lens, **dev_sink)
        return {"out": out, "max_logits": max_logits, "lse": lse}

    def ref(scale: float = spec.scale, indices: torch.Tensor = idx,
            topk_length: torch.Tensor | None = lens,
            attn_sink: torch.Tensor | None = sink) -> Outputs:
        out, max_logits, lse = sparse_mla_prefill(q64, kv64, indices, scale, DV, topk_length,
                                                  attn_sink=attn_sink)
        return {"out": out, "max_logits": max_logits, "lse": lse}

    if spec.refused:
        return Trial(invoke, {}, {}, refuses=(ValueError,))
    expected = ref()
    lonely = torch.isposinf(expected["lse"])
    alts = scale_alternatives(lambda sc: ref(scale=sc), spec.d, DV)
    alts.update({
        "max_logits in base 2 (logits times log2 e); the reference's is the scaled logit":
            lambda: {**expected, "max_logits": expected["max_logits"] * LOG2E},
        "lse and max_logits in base 2 (log2); the reference's are natural-log / scaled "
        "logits": lambda: {**expected, "max_logits": expected["max_logits"] * LOG2E,
                           "lse": expected["lse"] * LOG2E},
        "max_logits without the softmax scale (the raw q·k maximum)":
            lambda: {**expected, "max_logits": expected["max_logits"] / spec.scale}})
    if bool(lonely.any()):
        alts["max_logits is 0 for a query with no valid index; the reference's (FlashMLA's) "
             "is -inf"] = lambda: {**expected, "max_logits": torch.where(
                 lonely, 0.0, expected["max_logits"])}
    outside = (idx < 0) | (idx >= spec.s_kv)
    if bool(outside.any()):
        clamped = idx.clamp(0, spec.s_kv - 1)
        alts["indices outside [0, s_kv) clamped to the nearest row instead of dropped"] = (
            lambda: ref(indices=clamped))
        alts["only -1 dropped (the decode kernel's rule); other indices outside [0, s_kv) "
             "clamped to the nearest row"] = (
            lambda: ref(indices=torch.where(idx == -1, idx, clamped)))
    if lens is not None:
        alts["topk_length ignored: all topk entries used"] = lambda: ref(topk_length=None)
    if spec.repeats:
        alts["a repeated index counted once; the reference counts every appearance"] = (
            lambda: ref(indices=once_each(idx)))
    if sink is not None:
        alts.update(sink_alternatives(lambda: ref(attn_sink=None), expected, sink,
                                      lambda lse: lse))
    return Trial(invoke, expected,
                 {"out": "out_rel", "max_logits": "max_abs", "lse": "lse_abs"}, alts)


_register = spec_cases(KERNEL, sparse_prefill_trial)

def _big(small: bool) -> dict[str, int]:
    """DeepSeek-V3.2's top-k 2048 over a 4096-token prompt; shorter under the interpreter."""
    return {"topk": 128, "s_kv": S_KV} if small else {"topk": 2048, "s_kv": 4096}


# ---- DeepSeek-V3.2 shapes -------------------------------------------------------------------
_register("deepseek_v32_tp1", "shapes",
          "DeepSeek-V3.2 prefill at tensor parallel 1: 128 heads, rows of 576 (V 512), "
          "top-k 2048.",
          lambda s: SparsePrefillSpec(s_q=4 if s.small else 32, heads=128, **_big(s.small)),
          200)
_register("deepseek_v32_tp8", "shapes",
          "DeepSeek-V3.2 prefill at tensor parallel 8: 16 heads, top-k 2048, many queries.",
          lambda s: SparsePrefillSpec(s_q=8 if s.small else 257, heads=16, **_big(s.small)),
          201)
# ---- head counts ----------------------------------------------------------------------------
for _i, _n in enumerate((1, 5, 64)):
    _register(f"heads_{_n}", "heads",
              f"{_n} query heads{' (an odd count: a partly filled head tile)' if _n % 2 else ''}"
              " share one latent row per index.",
              lambda s, n=_n: SparsePrefillSpec(heads=n), 210 + _i)
# ---- index sentinels ------------------------------------------------------------------------
_register("minus_one", "sentinels",
          "-1 entries (vLLM's and FlashMLA's padding) name no row: dropped.",
          lambda s: SparsePrefillSpec(sentinels=(-1,)), 220)
_register("negative_indices", "sentinels",
          "INT_MIN, -2 and -s_kv entries: any negative index is dropped, not only -1.",
          lambda s: SparsePrefillSpec(sentinels=(INT_MIN, -2, -S_KV)), 221)
_register("past_s_kv", "sentinels",
          "Entries s_kv, s_kv + 1 and INT_MAX: an index at or past s_kv is dropped.",
          lambda s: SparsePrefillSpec(sentinels=(S_KV, S_KV + 1, INT_MAX)), 222)
# ---- lonely queries -------------------------------------------------------------------------
_register("lonely_queries", "empty",
          "Queries whose entries are all invalid (-1, INT_MIN, s_kv): out = 0, lse = +inf, "
          "max_logits = -inf.",
          lambda s: SparsePrefillSpec(heads=64, sentinels=(-1, INT_MIN, S_KV), lonely=(0, 3)),
          230)
# ---- repeated indices -----------------------------------------------------------------------
_register("repeated_indices", "repeats",
          "Each query's entries name only 5 rows: a repeated index counts once per appearance.",
          lambda s: SparsePrefillSpec(repeats=5), 240)
# ---- topk_length ----------------------------------------------------------------------------
_register("topk_length_ragged", "topk_length",
          "topk_length per query (topk, 1, 17, 63, 64, 40): entries past it name written rows "
          "and must be ignored.",
          lambda s: SparsePrefillSpec(topk_length=(64, 1, 17, 63, 64, 40)), 250)
_register("topk_length_past_topk", "topk_length",
          "topk_length past topk (topk + 1) is refused with a ValueError: a kernel that runs "
          "reads past the index array.",
          lambda s: SparsePrefillSpec(topk_length=(64, 65, 3, 0, 64, 1), refused=True), 252)
_register("topk_length_zero", "topk_length",
          "topk_length 0 makes a query lonely (out 0, lse +inf, max_logits -inf); entries past "
          "every length name NaN rows.",
          lambda s: SparsePrefillSpec(topk_length=(0, 5, 0, 64, 1, 30), past_length="nan"),
          251)
# ---- the lse base ---------------------------------------------------------------------------
_register("lse_natural_log", "lse",
          "lse is the natural log of the sum of exp(scaled logits) and max_logits the largest "
          "scaled logit (FlashMLA's README once said base 2).",
          lambda s: SparsePrefillSpec(heads=64, q_gain=3.0), 260)
# ---- the softmax scale ----------------------------------------------------------------------
_register("scale_deepseek", "scale",
          "DeepSeek's scale 1/sqrt(P+R) = 1/sqrt(192), not 1/sqrt(576): the scale passed is "
          "the one used.",
          lambda s: SparsePrefillSpec(scale=DEEPSEEK_SCALE), 270)
_register("scale_yarn_v32", "scale",
          "DeepSeek-V3.2's YaRN scale mscale²/sqrt(192) with 128 heads.",
          lambda s: SparsePrefillSpec(heads=128, scale=YARN_SCALE), 271)
