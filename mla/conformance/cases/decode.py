"""Cases of ``mla_decode_paged``: the absorbed decode over a paged latent cache.

``q [B, s_q, N, D]`` attends to request ``b``'s first ``cache_seqlens[b]`` rows of
``kv_cache [num_blocks, page, D]`` through ``block_table``; V is a row's first ``head_dim_v``
columns; ``out [B, s_q, N, head_dim_v]`` in q's dtype and ``lse [B, N, s_q]`` float32 in the
natural log, ``+inf`` and ``out = 0`` for a query that sees no key. With ``causal``, query
``i`` of ``s_q`` sees keys ``0 .. L - s_q + i``: ``L`` counts the ``s_q`` new tokens, which
are already in the cache (FlashMLA's multi-token-prediction mask; conventions §4, §12).

Every case scatters the pages (a seeded permutation), fills the rows no request uses with NaN
and points the block table's unused entries at a page of NaN (so a read past a length shows
as NaN), and poisons the buffers the kernel allocates. Only the "empty" topic has queries
that see no key, only the "causal" topic sets ``causal`` with ``s_q > 1``, only the "scale"
topic passes a scale other than ``1/sqrt(D)``.
"""

from __future__ import annotations

import dataclasses
import math
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
    long_length,
    sink_alternatives,
)
from mla.conformance.catalogue import Setting, Trial, generator, spec_cases
from mla.reference.decode import mla_decode_paged, paged_mqa
from mla.reference.paged_cache import cache_rows, make_block_table

__all__ = ["DecodeSpec", "decode_trial", "half_sum_scores"]

KERNEL = "mla_decode_paged"


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    lens: tuple[int, ...]
    heads: int = 16
    s_q: int = 1
    causal: bool = False
    page: int = 64
    scale: float = DEFAULT_SCALE
    d: int = D
    dv: int = DV
    q_gain: float = 1.0  # >1: sharper softmax
    dominant: bool = False  # one key per request aligned with its queries
    unused_entry: str = "nan_page"  # what unused block-table entries hold: "nan_page" or "-1"
    sink: str = ""  # attn_sink (DeepSeek-V4, deepseek_v4.py): "" or a kind of common.draw_sink


def _inputs(spec: DecodeSpec, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """float64 q, cache, block table, lengths on the CPU (see the module doc)."""
    lens = list(spec.lens)
    table, nb = make_block_table(lens, spec.page, spare_blocks=1,
                                 seed=int(torch.randint(1 << 30, (1,), generator=g)))
    nan_page = nb - 1  # the spare page no request uses
    cache = torch.full((nb, spec.page, spec.d), float("nan"), dtype=torch.float64)
    flat = cache.view(-1, spec.d)
    q = torch.randn(len(lens), spec.s_q, spec.heads, spec.d, generator=g,
                    dtype=torch.float64) * spec.q_gain
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        rows = table[b].long()[pos // spec.page] * spec.page + pos % spec.page
        flat[rows] = torch.randn(n, spec.d, generator=g, dtype=torch.float64)
        if spec.dominant and n:
            flat[rows[n // 2]] = 6.0 * q[b].mean(dim=(0, 1)) / q[b].mean(dim=(0, 1)).norm() * (
                spec.d ** 0.5)
    if spec.unused_entry == "nan_page":
        table = torch.where(table < 0, nan_page, table)
    return q, cache, table, torch.tensor(lens, dtype=torch.int32)


def _ref(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
         spec: DecodeSpec, *, scale: float | None = None, causal: bool | None = None,
         shift: int = 0, attn_sink: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The float64 reference; ``shift`` moves the causal diagonal (an off-by-one kernel,
    never with a sink)."""
    scale = spec.scale if scale is None else scale
    causal = spec.causal if causal is None else causal
    if shift == 0:
        out, lse = mla_decode_paged(q, cache, table, lens, scale, causal, spec.dv,
                                    attn_sink=attn_sink)
    else:
        out, lse = paged_mqa(q, cache, table, [n + shift for n in lens.tolist()],
                             lens.tolist(), scale, causal, spec.dv)
    return {"out": out, "lse": lse}


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``x`` rounded to ``dtype`` (through float32: exact for the sums below), back
    in float64."""
    return x.float().to(dtype).double()


def _butterfly(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The last dim (a power of two) summed as an xor-shuffle butterfly does (lane ``l``
    adds lane ``l ^ n/2``, then ``l ^ n/4``, ...), every add rounded to ``dtype``."""
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = _round(x[..., :h] + x[..., h:], dtype)
    return x[..., 0]


def half_sum_scores(q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q [R, D] @ k[n, D]ᵀ`` as vLLM's non-grouped Triton decode computes it:
    ``tl.sum(q[None, :] * k, 1)`` over ``dtype`` (bf16 or fp16) tiles, so every product and
    every partial sum is rounded to ``dtype``. float64 in (values of ``dtype``), float64 out.

    The order is Triton's lowering for sm_90 of vLLM's ``[BLOCK_N, BLOCK_DMODEL]`` tile,
    ``BLOCK_DMODEL = next_power_of_2(D)`` zero-padded, 4 warps (read in the PTX that Triton
    3.7 emits for ``_fwd_kernel_stage1``, layout ``sizePerThread [1, 8]``, ``threadsPerWarp
    [1, 32]``, ``warpsPerCTA [1, 4]``): each thread sums its 8 contiguous products in order,
    the even ones fused into the add (``fma.rn``, unrounded), the odd ones rounded first; then
    an xor butterfly over the 32 lanes (``shfl.sync.bfly`` 16, 8, 4, 2, 1) and one over the 4
    warps. At D = 576 it gives the H100's numbers exactly
    (tests/test_conformance_vllm_triton.py)."""
    width = 1 << (q.shape[-1] - 1).bit_length()
    chunks = width // 8
    lanes = min(32, chunks)
    warps = min(4, chunks // lanes)
    qp = torch.nn.functional.pad(q, (0, width - q.shape[-1]))
    kp = torch.nn.functional.pad(k, (0, width - k.shape[-1]))
    out = torch.empty(q.shape[0], k.shape[0], dtype=torch.float64)
    step = max(1, (1 << 22) // (width * max(1, q.shape[0])))  # keys a pass: 32 MiB at most
    for j in range(0, k.shape[0], step):
        exact = (qp[:, None, :] * kp[None, j:j + step, :])  # [R, n, width], exact products
        R, n = exact.shape[:2]
        # [R, n, warp·lane, a thread's products in its order (8 a chunk, chunk after chunk)]
        exact = exact.view(R, n, -1, warps * lanes, 8).transpose(2, 3).reshape(
            R, n, warps * lanes, -1)
        rounded = _round(exact, dtype)
        acc = _round(exact[..., 0] + rounded[..., 1], dtype)
        for i in range(2, exact.shape[-1]):
            acc = _round(acc + (exact if i % 2 == 0 else rounded)[..., i], dtype)
        out[:, j:j + step] = _butterfly(_butterfly(acc.view(R, n, warps, lanes), dtype), dtype)
    return out


def _half_scores_ref(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                     lens: torch.Tensor, spec: DecodeSpec, dtype: torch.dtype
                     ) -> dict[str, torch.Tensor]:
    """The reference with every score ``q · k`` from ``half_sum_scores`` (then times the
    scale in float32, as ``qk *= sm_scale`` on a bf16 ``qk``); the rest in float64."""
    B, s_q, N, _ = q.shape
    out = torch.zeros(B, s_q, N, spec.dv, dtype=torch.float64)
    lse = torch.full((B, N, s_q), math.inf, dtype=torch.float64)
    scale = torch.tensor(spec.scale, dtype=torch.float32)
    for b, L in enumerate(lens.tolist()):
        rows = cache_rows(cache, table[b], 0, L)  # [L, D]
        s = half_sum_scores(q[b].reshape(s_q * N, -1), rows, dtype).view(s_q, N, L)
        s = (s.float() * scale).double()
        if spec.causal:
            seen = torch.arange(L)[None, :] <= torch.arange(L - s_q, L)[:, None]  # [s_q, L]
            s = s.masked_fill(~seen[:, None, :], -math.inf)
        lse_b = torch.logsumexp(s, dim=-1)  # [s_q, N]
        some = torch.isfinite(lse_b)
        p = torch.exp(s - torch.where(some, lse_b, 0.0)[..., None])
        out[b] = torch.where(some[..., None], p @ rows[:, :spec.dv], 0.0)
        lse[b] = torch.where(some, lse_b, math.inf).transpose(0, 1)
    return {"out": out, "lse": lse}


def _half_scores_alternatives(q64: torch.Tensor, c64: torch.Tensor, table: torch.Tensor,
                              lens: torch.Tensor, spec: DecodeSpec, dtype: torch.dtype,
                              expected_lse: torch.Tensor
                              ) -> dict[str, Callable[[], dict[str, torch.Tensor]]]:
    """vLLM's Triton decode with one query head per KV head (``kv_group_num == 1``, the
    non-grouped kernel): its scores summed in ``dtype``; alone, and with its empty query's
    ``out = NaN``, ``lse = -inf`` (both show on a batch with a request of length 0)."""
    name = str(dtype).removeprefix("torch.")
    why = (f"each score q·k summed in {name} (one query head per KV head: tl.sum over "
           f"{name} products, each product and partial sum rounded to {name}, as vLLM's "
           "non-grouped Triton decode does); the scores should accumulate in float32")
    cached: dict[str, dict[str, torch.Tensor]] = {}

    def half() -> dict[str, torch.Tensor]:
        if "half" not in cached:
            cached["half"] = _half_scores_ref(q64, c64, table, lens, spec, dtype)
        return cached["half"]

    alts = {why: half}
    if bool(torch.isposinf(expected_lse).any()):
        def nan_empty() -> dict[str, torch.Tensor]:
            h = half()
            empty = torch.isposinf(h["lse"])  # [B, N, s_q]
            return {"out": h["out"].masked_fill(empty.transpose(1, 2)[..., None], math.nan),
                    "lse": h["lse"].masked_fill(empty, -math.inf)}
        alts[why + "; and a query that sees no key gets out = NaN (0/0) and lse = -inf"] = (
            nan_empty)
    return alts


def decode_trial(setting: Setting, spec: DecodeSpec, salt: int) -> Trial:
    """A trial of ``spec``: inputs in the setting's dtype, the reference on upcast copies."""
    g = generator(setting, salt)
    q64, c64, table, lens = _inputs(spec, g)
    q, cache = q64.to(setting.dtype), c64.to(setting.dtype)
    q64, c64 = q.double(), cache.double()  # the reference sees exactly the kernel's inputs
    # drawn last, so that the cases without a sink keep their inputs
    sink = draw_sink(g, spec.sink, spec.heads, max(spec.lens)) if spec.sink else None
    dev = setting.device
    args = (q.to(dev), cache.to(dev), table.to(dev), lens.to(dev))
    dev_sink = {} if sink is None else {"attn_sink": sink.to(dev)}

    def invoke(fn: Callable) -> dict[str, torch.Tensor]:
        out, lse = call_v4(fn, *args, spec.scale, spec.causal, spec.dv, **dev_sink)
        return {"out": out, "lse": lse}

    alts: dict[str, Callable[[], dict[str, torch.Tensor]]] = {
        f"softmax scale 1/sqrt({spec.d}) used instead of the scale passed":
            lambda: _ref(q64, c64, table, lens, spec, scale=spec.d ** -0.5, attn_sink=sink),
        "softmax scale 1/sqrt(head_dim_v) used instead of the scale passed":
            lambda: _ref(q64, c64, table, lens, spec, scale=spec.dv ** -0.5, attn_sink=sink)}
    if spec.causal and spec.s_q > 1:
        alts.update({
            "causal mask ignored (every query sees all L keys)":
                lambda: _ref(q64, c64, table, lens, spec, causal=False, attn_sink=sink),
            "causal mask off by one: query i sees keys 0..L-s_q+i-1 (one too few)":
                lambda: _ref(q64, c64, table, lens, spec, shift=-1),
            "causal mask off by one: query i sees keys 0..L-s_q+i+1 (one too many)":
                lambda: _ref(q64, c64, table, lens, spec, shift=1)})
    elif spec.s_q > 1:
        alts["causal mask applied although causal=False"] = (
            lambda: _ref(q64, c64, table, lens, spec, causal=True,
                         attn_sink=sink))
    expected = _ref(q64, c64, table, lens, spec, attn_sink=sink)
    alts.update(_empty_query_alternatives(expected))
    if spec.heads == 1 and sink is None and setting.dtype in (torch.bfloat16, torch.float16):
        alts.update(_half_scores_alternatives(q64, c64, table, lens, spec, setting.dtype,
                                               expected["lse"]))
    if sink is not None:
        alts.update(sink_alternatives(lambda: _ref(q64, c64, table, lens, spec), expected, sink,
                                      lambda lse: lse.transpose(1, 2)))
    return Trial(invoke, expected, {"out": "out_rel", "lse": "lse_abs"}, alts, spec=spec)


def _empty_query_alternatives(expected: dict[str, torch.Tensor]
                              ) -> dict[str, Callable[[], dict[str, torch.Tensor]]]:
    """Other answers for a query that sees no key (``lse = +inf`` in the reference): the
    softmax's 0/0 left in the output, with either infinity."""
    empty = torch.isposinf(expected["lse"]).transpose(1, 2)[..., None]  # [B, s_q, N, 1]
    if not empty.any():
        return {}

    def nan_out(lse_value: float) -> dict[str, torch.Tensor]:
        return {"out": torch.where(empty, float("nan"), expected["out"]),
                "lse": torch.where(torch.isposinf(expected["lse"]), lse_value,
                                   expected["lse"])}

    return {"a query that sees no key gets out = NaN (0/0) and lse = -inf; the reference "
            "(FlashMLA's convention) gives out = 0 and lse = +inf": lambda: nan_out(-math.inf),
            "a query that sees no key gets out = NaN (0/0); the reference gives out = 0 "
            "(its lse, +inf, agrees)": lambda: nan_out(math.inf)}


_register = spec_cases(KERNEL, decode_trial)

def _edges(page: int) -> tuple[int, ...]:
    return (1, page - 1 if page > 1 else 2, page, page + 1)


# ---- DeepSeek shapes ------------------------------------------------------------------------
_register("deepseek_v2_lite", "shapes",
          "DeepSeek-V2-Lite: 16 heads, rows of 576 (512 latent + 64 rope), V of 512, page 64.",
          lambda s: DecodeSpec((1, 63, 64, 65, long_length(s.small)), heads=16), 1)
_register("deepseek_v2", "shapes",
          "DeepSeek-V2 at tensor parallel 1: 128 heads share one latent KV head.",
          lambda s: DecodeSpec((1, 65, long_length(s.small)), heads=128), 2)
_register("deepseek_v3_tp8", "shapes",
          "DeepSeek-V3 at tensor parallel 8: 16 heads, ragged lengths around the page size.",
          lambda s: DecodeSpec((63, 64, 65, 130, 1037 if not s.small else 200), heads=16), 3)
_register("deepseek_v3_batch", "shapes",
          "DeepSeek-V3, 128 heads, a batch of 9 requests with different lengths.",
          lambda s: DecodeSpec(tuple(1 + 37 * i for i in range(9)), heads=128), 4)
# ---- head counts ----------------------------------------------------------------------------
for _i, _n in enumerate((1, 64, 3, 33, 127)):
    _register(f"heads_{_n}", "heads",
              f"{_n} query heads{' (an odd count: a partly filled head tile)' if _n % 2 else ''}"
              " attend to one latent KV head.",
              lambda s, n=_n: DecodeSpec((1, 65, 130), heads=n), 10 + _i)
_register("heads_1_single_keys", "heads",
          "One query head (one per KV head) over contexts of one key and a few longer: each "
          "single-key lse is that key's scaled score, so a score summed in bf16 (vLLM's "
          "non-grouped Triton decode) shows; scores accumulate in float32.",
          lambda s: DecodeSpec((1,) * 6 + (63,), heads=1), 15)
# ---- page sizes -----------------------------------------------------------------------------
for _i, _p in enumerate((1, 16, 128, 256)):
    _register(f"page_{_p}", "pages",
              f"Page size {_p} with lengths page-1, page and page+1: the last page partly full.",
              lambda s, p=_p: DecodeSpec(_edges(p) + ((300,) if p == 1 else ()), page=p), 20 + _i)
# ---- lengths --------------------------------------------------------------------------------
_register("length_1", "lengths",
          "Contexts of one token: the output is that token's value row, the lse its logit.",
          lambda s: DecodeSpec((1, 1, 1)), 30)
_register("length_page_edges", "lengths",
          "Lengths 63, 64, 65, 127, 128, 129 at page 64: rows at both ends of a page.",
          lambda s: DecodeSpec((63, 64, 65, 127, 128, 129)), 31)
_register("length_long_single", "lengths",
          "One long request alone (batch 1): split-KV kernels split it and merge the parts.",
          lambda s: DecodeSpec((long_length(s.small) * 2 + 7,), heads=16), 32)
_register("length_long_ragged", "lengths",
          "A long request beside short ones: the split of the long one must not leak.",
          lambda s: DecodeSpec((2, long_length(s.small), 5), heads=16), 33)
# ---- multi-token prediction and the causal rule ---------------------------------------------
for _i, _sq in enumerate((2, 3, 4)):
    _register(f"causal_s_q_{_sq}", "causal",
              f"s_q = {_sq} causal: query i sees keys 0..L-{_sq}+i, L counting the new tokens.",
              lambda s, sq=_sq: DecodeSpec((sq, 64, 65, 200), s_q=sq, causal=True), 40 + _i)
_register("causal_diagonal_page_edge", "causal",
          "s_q = 4 causal with the diagonal crossing a page edge (L = 66, 130 at page 64).",
          lambda s: DecodeSpec((66, 130, 4), s_q=4, causal=True, heads=32), 43)
_register("causal_128_heads", "causal",
          "s_q = 2 causal with 128 heads (DeepSeek-V3's speculative decoding).",
          lambda s: DecodeSpec((2, 65, 300), s_q=2, causal=True, heads=128), 44)
for _i, _sq in enumerate((2, 4)):
    _register(f"non_causal_s_q_{_sq}", "non_causal",
              f"s_q = {_sq} without causal: every query sees all L keys.",
              lambda s, sq=_sq: DecodeSpec((1, 64, 65, 200), s_q=sq), 45 + _i)
# ---- queries that see no key ----------------------------------------------------------------
_register("empty_request", "empty",
          "A request of length 0 beside others: its queries get out = 0 and lse = +inf.",
          lambda s: DecodeSpec((0, 65, 0, 3)), 50)
_register("all_empty", "empty",
          "Every request of length 0: all outputs 0, all lse +inf, nothing read.",
          lambda s: DecodeSpec((0, 0)), 51)
_register("empty_causal_queries", "empty",
          "Causal s_q = 3 with L = 1 and 2: the first queries see no key (out 0, lse +inf).",
          lambda s: DecodeSpec((1, 2, 3, 70), s_q=3, causal=True), 52)
# ---- NaN where nothing may be read ----------------------------------------------------------
_register("unused_entries_minus_one", "nan",
          "Unused block-table entries hold -1 (vLLM's padding) instead of a NaN page.",
          lambda s: DecodeSpec((1, 65, 130), unused_entry="-1"), 60)
_register("nan_tail_of_last_page", "nan",
          "NaN fills every row past a request's length in its last page: none may be read.",
          lambda s: DecodeSpec((1, 2, 33, 127), page=128, heads=64), 61)
# ---- the softmax scale ----------------------------------------------------------------------
_register("scale_deepseek", "scale",
          "DeepSeek's scale 1/sqrt(P+R) = 1/sqrt(192), not 1/sqrt(576): the scale passed "
          "is the one used.",
          lambda s: DecodeSpec((1, 65, 200), scale=DEEPSEEK_SCALE), 70)
_register("scale_yarn_v3", "scale",
          "DeepSeek-V3's YaRN scale mscale²/sqrt(192) = 0.1352 with 128 heads.",
          lambda s: DecodeSpec((1, 65, 200), heads=128, scale=YARN_SCALE), 71)
# ---- numerics -------------------------------------------------------------------------------
_register("sharp_softmax", "numerics",
          "Logits 30 times larger: a softmax without the running maximum overflows.",
          lambda s: DecodeSpec((1, 65, 300), q_gain=30.0), 80)
_register("dominant_key", "numerics",
          "One key per request aligned with its queries: a near one-hot softmax.",
          lambda s: DecodeSpec((5, 65, 300), dominant=True), 81)
