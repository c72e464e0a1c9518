"""Cases of ``sparse_mla_decode``: DeepSeek-V3.2's sparse decode over the paged cache.

``q [B, s_q, N, D]``; query ``(b, s)`` attends to the cache rows named by
``indices[b, s, :topk_length[b]]``, global slots ``block · page + offset`` of
``kv_cache [num_blocks, page, D]`` (or ``[num_blocks, page, 656]`` ``fp8_ds_mla`` bytes with
``is_fp8_kvcache=True``, which the reference dequantizes itself); ``-1`` names no row. A repeated
index counts once per appearance. ``out [B, s_q, N, head_dim_v]`` in q's dtype and
``lse [B, N, s_q]`` in the natural log; a lonely query (no valid entry) gets ``out = 0`` and
``lse = +inf`` (conventions §10, §12). The reference rejects any other negative index and any
index past the cache, and a ``topk_length`` past ``topk``: those are errors, not cases.

Every case fills the slots no index names with NaN (the fp8 cache: 0xFF bytes, NaN in the
values, the scales and the rope part) and poisons the buffers the kernel allocates. Slot 0 and
the last slot always hold a written row, so that a kernel reading ``-1`` as slot 0 (an
unmasked gather) or as the last slot (Python's negative indexing) gives finite outputs the
report can name. A query's entries are distinct (as the indexer's top-k are) except in the
"repeats" topic; only the "sentinels" topic has scattered ``-1`` entries, only "empty" and
"topk_length" have lonely queries, only "topk_length" passes ``topk_length`` and only "scale"
passes a scale other than ``1/sqrt(D)``. DeepSeek-V4's cases (``deepseek_v4.py``: a sink, the
MODEL1 cache, a second KV scope, rows of 512) are built here too, under their own topics.
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
    sink_alternatives,
)
from mla.conformance.catalogue import Setting, Trial, generator, spec_cases
from mla.reference.fp8 import (
    D_NOPE,
    D_ROPE,
    FP8_DS_MLA_BYTES,
    NUM_TILES,
    SCALE_OFFSET,
    TILE,
    quantize_fp8_ds_mla,
)
from mla.reference.fp8_model1 import D_NOPE as MODEL1_NOPE
from mla.reference.fp8_model1 import DATA_BYTES as MODEL1_DATA_BYTES
from mla.reference.fp8_model1 import NUM_TILES as MODEL1_TILES
from mla.reference.fp8_model1 import TILE as MODEL1_TILE
from mla.reference.fp8_model1 import fp8_model1_cache, fp8_model1_pages, quantize_fp8_model1
from mla.reference.sparse import sparse_mla_decode

__all__ = ["SparseDecodeSpec", "sparse_decode_trial", "draw_indices", "draw_any", "once_each",
           "scale_alternatives", "split_rows", "unscaled_fp8", "model1_cache",
           "model1_misread", "MODEL1_MISREADS"]

KERNEL = "sparse_mla_decode"
Outputs = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class SparseDecodeSpec:
    batch: int = 3
    s_q: int = 1
    heads: int = 16
    topk: int = 64
    page: int = 64
    slots: int = 600  # at least this many cache slots (whole pages); a third left unwritten
    fp8: bool = False  # the fp8_ds_mla cache (else the cache is in q's dtype)
    scale: float = DEFAULT_SCALE
    minus_one: float = 0.0  # share of entries set to -1 (scattered, plus a -1 tail per query)
    lonely: tuple[tuple[int, int], ...] = ()  # queries (b, s) whose entries are all -1
    topk_length: tuple[int, ...] | None = None  # per request
    past_length: str = "rows"  # entries past topk_length name "rows" (written) or "nan" slots
    refused: bool = False  # invalid inputs: the kernel must raise a ValueError
    repeats: int = 0  # > 0: every query's entries drawn from this many slots
    q_gain: float = 1.0  # > 1: a sharper softmax
    # DeepSeek-V4 (conventions §14; the cases in deepseek_v4.py): every draw for these comes
    # after the ones above, so the other cases' inputs do not depend on them
    d: int = D  # a row's width: 576 (DeepSeek-V3.2) or 512 (DeepSeek-V4)
    model1: bool = False  # the MODEL1 fp8 cache (d = 512) instead of fp8_ds_mla's
    sink: str = ""  # attn_sink: "" (none) or a kind of common.draw_sink
    extra: SparseDecodeSpec | None = None  # the second KV scope: its page, slots, topk,
    # minus_one, lonely and topk_length (its other fields are the first scope's)


def draw_indices(g: torch.Generator, shape: tuple[int, ...], pool: torch.Tensor,
                 repeats: int = 0) -> torch.Tensor:
    """int32 entries from ``pool``, distinct within each row (last dim) as the indexer's top-k
    are; with ``repeats``, drawn with replacement from that many of its members (most repeat).
    """
    if repeats:
        pool = pool[torch.randperm(len(pool), generator=g)[:repeats]]
        return pool[torch.randint(len(pool), shape, generator=g)].to(torch.int32)
    k = shape[-1]
    if k > len(pool):
        raise ValueError(f"cannot draw {k} distinct entries from {len(pool)}")
    rows = torch.rand(math.prod(shape[:-1]), len(pool), generator=g).argsort(dim=1)[:, :k]
    return pool[rows].reshape(shape).to(torch.int32)


def draw_any(g: torch.Generator, shape: tuple[int, ...], pool: torch.Tensor) -> torch.Tensor:
    """int32 entries drawn with replacement from ``pool``."""
    return pool[torch.randint(len(pool), shape, generator=g)].to(torch.int32)


def once_each(idx: torch.Tensor) -> torch.Tensor:
    """``idx`` with every repeat of an entry within its row (last dim) replaced by ``-1``: what
    a kernel that counts each distinct row once reads."""
    flat = idx.reshape(-1, idx.shape[-1])
    ordered, order = torch.sort(flat, dim=-1, stable=True)
    repeat_sorted = torch.zeros_like(ordered, dtype=torch.bool)
    repeat_sorted[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    repeat = torch.zeros_like(repeat_sorted).scatter(1, order, repeat_sorted)
    return torch.where(repeat, -1, flat).reshape(idx.shape)


def split_rows(g: torch.Generator, n: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``0 .. n-1`` split at random into about ``count`` written and the rest unwritten;
    the first and the last row always written (where a kernel that reads an invalid entry as
    row 0 or as row -1 lands)."""
    perm = torch.randperm(n, generator=g)
    inner = (perm != 0) & (perm != n - 1)
    written = torch.cat([torch.tensor([0, n - 1]), perm[:count][inner[:count]]])
    return written, perm[count:][inner[count:]]


def scale_alternatives(make: Callable[[float], Outputs], d: int, dv: int
                       ) -> dict[str, Callable[[], Outputs]]:
    """The reference's outputs under the two usual wrong softmax scales."""
    return {f"softmax scale 1/sqrt({d}) used instead of the scale passed":
            lambda: make(d ** -0.5),
            "softmax scale 1/sqrt(head_dim_v) used instead of the scale passed":
            lambda: make(dv ** -0.5)}


def _cache(spec: SparseDecodeSpec, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor,
                                                                torch.Tensor]:
    """float64 (or fp8_ds_mla bytes) cache ``[nb, page, ·]``, the written slots and the
    unwritten ones."""
    nb = -(-spec.slots // spec.page)
    n = nb * spec.page
    written, unwritten = split_rows(g, n, (2 * n) // 3)
    if spec.model1:
        return model1_cache(g, nb, spec.page, written), written, unwritten
    if spec.fp8:
        flat = torch.full((n, FP8_DS_MLA_BYTES), 0xFF, dtype=torch.uint8)
        kv_c = torch.randn(len(written), D_NOPE, generator=g, dtype=torch.float64)
        kv_c[:, TILE:2 * TILE] *= 1e-3  # tiles of different scales
        k_pe = torch.randn(len(written), D_ROPE, generator=g, dtype=torch.float64)
        flat[written] = quantize_fp8_ds_mla(kv_c, k_pe)
    else:
        flat = torch.full((n, spec.d), float("nan"), dtype=torch.float64)
        flat[written] = torch.randn(len(written), spec.d, generator=g, dtype=torch.float64)
    return flat.view(nb, spec.page, -1), written, unwritten


def _indices(spec: SparseDecodeSpec, g: torch.Generator, written: torch.Tensor,
             unwritten: torch.Tensor) -> torch.Tensor:
    B, S, K = spec.batch, spec.s_q, spec.topk
    idx = draw_indices(g, (B, S, K), written, spec.repeats)
    if spec.minus_one:
        idx[torch.rand(B, S, K, generator=g) < spec.minus_one] = -1
        tail = torch.randint(1, K, (B, S), generator=g)  # a short context: a -1 tail
        idx[torch.arange(K)[None, None, :] >= tail[..., None]] = -1
    if spec.topk_length is not None and spec.past_length == "nan":
        past = torch.arange(K)[None, :] >= torch.tensor(spec.topk_length)[:, None]
        nan_entries = draw_any(g, (B, S, K), unwritten)
        idx = torch.where(past[:, None, :], nan_entries, idx)
    for b, s in spec.lonely:
        idx[b, s] = -1
    return idx


def model1_cache(g: torch.Generator, nb: int, page: int, written: torch.Tensor) -> torch.Tensor:
    """The ``[nb, page, 584]`` view of MODEL1 pages (``fp8_model1_cache``) holding random rows
    at the ``written`` slots and NaN rows elsewhere (NaN scale bytes 0xFF, NaN rope)."""
    rows = torch.full((nb * page, 512), float("nan"), dtype=torch.float64)
    rows[written] = torch.randn(len(written), 512, generator=g, dtype=torch.float64)
    rows[written, MODEL1_TILE:2 * MODEL1_TILE] *= 1e-3  # tiles of different scales
    return fp8_model1_cache(quantize_fp8_model1(rows.view(nb, page, 512)), page)


def _on(cache: torch.Tensor, device: torch.device, model1: bool) -> torch.Tensor:
    """``cache`` on ``device``; a MODEL1 view moves with its pages (the block stride kept)."""
    if not model1:
        return cache.to(device)
    nb, page = cache.shape[:2]
    pages = cache.as_strided((nb, cache.stride(0)), (cache.stride(0), 1)).to(device)
    return fp8_model1_cache(pages, page)


def unscaled_fp8(cache: torch.Tensor) -> torch.Tensor:
    """The bytes with every tile scale set to 1.0: a reader that ignores the scales."""
    out = cache.clone()
    flat = out.view(-1, FP8_DS_MLA_BYTES)
    ones = torch.ones(flat.shape[0], NUM_TILES, dtype=torch.float32)
    flat[:, SCALE_OFFSET:SCALE_OFFSET + 4 * NUM_TILES] = ones.view(torch.uint8)
    return out


def sparse_decode_trial(setting: Setting, spec: SparseDecodeSpec, salt: int) -> Trial:
    """A trial of ``spec``: inputs in the setting's dtype, the reference on upcast copies."""
    g = generator(setting, salt)
    cache64, written, unwritten = _cache(spec, g)
    q = (torch.randn(spec.batch, spec.s_q, spec.heads, spec.d, generator=g, dtype=torch.float64)
         * spec.q_gain).to(setting.dtype)
    idx = _indices(spec, g, written, unwritten)
    lens = (None if spec.topk_length is None
            else torch.tensor(spec.topk_length, dtype=torch.int32))
    fp8 = spec.fp8 or spec.model1
    cache = cache64 if fp8 else cache64.to(setting.dtype)
    q64 = q.double()  # the reference sees exactly the kernel's inputs
    c64 = cache if fp8 else cache.double()
    v4 = _v4_inputs(setting, spec, g)  # DeepSeek-V4's keywords, the reference's (float64) copy
    dev = setting.device
    args = (q.to(dev), _on(cache, dev, spec.model1), idx.to(dev))
    dev_lens = None if lens is None else lens.to(dev)
    dev_v4 = {k: _on(v, dev, spec.model1) if k == "extra_k_cache" else v.to(dev)
              for k, v in v4.items() if k != "extra_k_cache64"}

    def invoke(fn: Callable) -> Outputs:
        out, lse = call_v4(fn, *args, spec.scale, fp8, dev_lens, DV, model1=spec.model1,
                           **dev_v4)
        return {"out": out, "lse": lse}

    def ref(scale: float = spec.scale, indices: torch.Tensor = idx,
            topk_length: torch.Tensor | None = lens, kv: torch.Tensor = c64,
            fp8: bool = fp8, **changed: torch.Tensor | None) -> Outputs:
        kw = {k: v for k, v in v4.items() if k != "extra_k_cache64"}
        if "extra_k_cache" in kw:
            kw["extra_k_cache"] = v4["extra_k_cache64"]
        kw.update(changed)
        out, lse = sparse_mla_decode(q64, kv, indices, scale, fp8, topk_length, DV,
                                     **{k: v for k, v in kw.items() if v is not None})
        return {"out": out, "lse": lse}

    alts = scale_alternatives(lambda sc: ref(scale=sc), spec.d, DV)
    if bool((idx == -1).any()):
        last = cache.shape[0] * cache.shape[1] - 1
        alts["-1 entries read slot 0 instead of being dropped"] = (
            lambda: ref(indices=torch.where(idx == -1, 0, idx)))
        alts["-1 entries read the last slot (negative indexing) instead of being dropped"] = (
            lambda: ref(indices=torch.where(idx == -1, last, idx)))
    if lens is not None:
        alts["topk_length ignored: all topk entries used"] = lambda: ref(topk_length=None)
    if spec.repeats:
        alts["a repeated index counted once; the reference counts every appearance"] = (
            lambda: ref(indices=once_each(idx)))
    if spec.fp8:
        alts["fp8_ds_mla tile scales ignored (the e4m3 values used unscaled)"] = (
            lambda: ref(kv=unscaled_fp8(cache)))
    if spec.refused:
        return Trial(invoke, {}, {}, refuses=(ValueError,))
    expected = ref()
    alts.update(_v4_alternatives(spec, v4, ref, expected, c64))
    return Trial(invoke, expected, {"out": "out_rel", "lse": "lse_abs"}, alts, spec=spec)


def _v4_inputs(setting: Setting, spec: SparseDecodeSpec, g: torch.Generator
               ) -> dict[str, torch.Tensor]:
    """The keywords of DeepSeek-V4's cases (conventions §14), drawn after everything else:
    ``attn_sink`` and the second KV scope, whose float64 cache is ``extra_k_cache64``."""
    v4: dict[str, torch.Tensor] = {}
    if spec.extra is not None:
        extra = dataclasses.replace(spec, page=spec.extra.page, slots=spec.extra.slots,
                                    topk=spec.extra.topk, minus_one=spec.extra.minus_one,
                                    lonely=spec.extra.lonely,
                                    topk_length=spec.extra.topk_length, extra=None)
        cache64, written, unwritten = _cache(extra, g)
        v4["extra_k_cache64"] = cache64 if spec.model1 else cache64.to(setting.dtype).double()
        v4["extra_k_cache"] = cache64 if spec.model1 else cache64.to(setting.dtype)
        v4["extra_indices_in_kvcache"] = _indices(extra, g, written, unwritten)
        if extra.topk_length is not None:
            v4["extra_topk_length"] = torch.tensor(extra.topk_length, dtype=torch.int32)
    if spec.sink:
        keys = spec.topk + (spec.extra.topk if spec.extra is not None else 0)
        v4["attn_sink"] = draw_sink(g, spec.sink, spec.heads, keys)
    return v4


def _v4_alternatives(spec: SparseDecodeSpec, v4: dict[str, torch.Tensor],
                     ref: Callable[..., Outputs], expected: Outputs, kv: torch.Tensor
                     ) -> dict[str, Callable[[], Outputs]]:
    """Other answers under DeepSeek-V4's conventions: a sink taken wrong, the second scope
    ignored, the MODEL1 bytes misread."""
    def heads_last(lse: torch.Tensor) -> torch.Tensor:
        return lse.transpose(1, 2)

    alts: dict[str, Callable[[], Outputs]] = {}
    if "attn_sink" in v4:
        alts.update(sink_alternatives(lambda: ref(attn_sink=None), expected, v4["attn_sink"],
                                      heads_last))
    if "extra_k_cache" in v4:
        alts["second KV scope ignored (extra_k_cache and its indices not read)"] = (
            lambda: ref(extra_k_cache=None, extra_indices_in_kvcache=None,
                        extra_topk_length=None))
        if "extra_topk_length" in v4:
            alts["extra_topk_length ignored: all extra_topk entries used"] = (
                lambda: ref(extra_topk_length=None))
        if "attn_sink" in v4:
            alts["attn_sink applied per scope (each scope's output scaled by its own sink "
                 "factor, then merged) instead of once"] = lambda: _sink_per_scope(ref, v4)
    if spec.model1:
        for how, why in MODEL1_MISREADS.items():
            alts[why] = lambda how=how: _model1_misread_ref(ref, kv, v4, how)
    return alts


def _sink_per_scope(ref: Callable[..., Outputs], v4: dict[str, torch.Tensor]) -> Outputs:
    """Each scope attended alone with the sink, the two states merged by their lse: what a
    kernel that applies the sink before merging its scopes returns."""
    no_extra = {"extra_k_cache": None, "extra_indices_in_kvcache": None,
                "extra_topk_length": None}
    first = ref(**no_extra)
    second = ref(kv=v4["extra_k_cache64"], indices=v4["extra_indices_in_kvcache"],
                 topk_length=v4.get("extra_topk_length"), **no_extra)
    lse1, lse2 = (torch.where(torch.isposinf(s["lse"]), -math.inf, s["lse"])
                  for s in (first, second))
    lse = torch.logaddexp(lse1, lse2)
    seen = torch.isfinite(lse)
    out = sum(torch.where(seen, torch.exp(part - lse), 0.0).transpose(1, 2)[..., None] * s["out"]
              for part, s in ((lse1, first), (lse2, second)))
    return {"out": out, "lse": torch.where(seen, lse, math.inf)}


# misreadings of the MODEL1 bytes: how -> what the report says
MODEL1_MISREADS = {
    "tile128": "MODEL1 scales read as fp8_ds_mla's: one per 128 nope values (tile t of 128 "
               "takes scale byte t) instead of one per 64",
    "rope_e4m3": "MODEL1 rope read as e4m3 (its first 64 bytes, unscaled) instead of 64 "
                 "bfloat16 values",
}


def model1_misread(cache: torch.Tensor, how: str) -> torch.Tensor:
    """The float64 rows ``[nb, page, 512]`` a reader of the MODEL1 view ``cache`` that
    misreads it as ``how`` (``MODEL1_MISREADS``) sees."""
    nb, page = cache.shape[:2]
    pages = fp8_model1_pages(cache)
    data = pages[:, :MODEL1_DATA_BYTES * page].reshape(nb, page, MODEL1_DATA_BYTES)
    codes = pages[:, MODEL1_DATA_BYTES * page:].reshape(nb, page, -1)[..., :MODEL1_TILES]
    if how == "tile128":
        codes = codes[..., [t // 2 for t in range(MODEL1_TILES)]]
    scale = torch.where(codes == 0xFF, math.nan, torch.pow(2.0, codes.double() - 127))
    nope = data[..., :MODEL1_NOPE].contiguous().view(torch.float8_e4m3fn).double()
    nope = (nope.unflatten(-1, (MODEL1_TILES, MODEL1_TILE)) * scale[..., None]).flatten(-2)
    if how == "rope_e4m3":
        rope = data[..., MODEL1_NOPE:MODEL1_NOPE + 64].contiguous().view(torch.float8_e4m3fn)
    else:
        rope = data[..., MODEL1_NOPE:].contiguous().view(torch.bfloat16)
    return torch.cat([nope, rope.double()], dim=-1)


def _model1_misread_ref(ref: Callable[..., Outputs], kv: torch.Tensor,
                        v4: dict[str, torch.Tensor], how: str) -> Outputs:
    extra = ({"extra_k_cache": model1_misread(v4["extra_k_cache64"], how)}
             if "extra_k_cache64" in v4 else {})
    return ref(kv=model1_misread(kv, how), fp8=False, **extra)
_register = spec_cases(KERNEL, sparse_decode_trial)

def _topk(small: bool) -> int:
    """DeepSeek-V3.2's top-k, shorter under the interpreter."""
    return 128 if small else 2048


def _slots(small: bool) -> int:
    return 600 if small else 40000


# ---- DeepSeek-V3.2 shapes -------------------------------------------------------------------
_register("deepseek_v32_tp8", "shapes",
          "DeepSeek-V3.2 at tensor parallel 8: 16 heads, rows of 576 (V 512), the fp8_ds_mla "
          "cache, top-k 2048, page 64.",
          lambda s: SparseDecodeSpec(batch=4, heads=16, topk=_topk(s.small),
                                     slots=_slots(s.small), fp8=True), 100)
_register("deepseek_v32_tp1", "shapes",
          "DeepSeek-V3.2 at tensor parallel 1: 128 heads share one fp8_ds_mla latent row.",
          lambda s: SparseDecodeSpec(batch=2, heads=128, topk=_topk(s.small),
                                     slots=_slots(s.small), fp8=True), 101)
_register("deepseek_v32_latent_cache", "shapes",
          "DeepSeek-V3.2 with the latent cache in q's dtype (bf16 in serving) instead of fp8, "
          "128 heads.",
          lambda s: SparseDecodeSpec(batch=3, heads=128, topk=_topk(s.small),
                                     slots=_slots(s.small)), 102)
# ---- queries per request --------------------------------------------------------------------
_register("s_q_2_mtp", "s_q",
          "s_q = 2 (multi-token prediction), 128 heads, fp8 cache: each query reads its own "
          "index row.",
          lambda s: SparseDecodeSpec(batch=2, s_q=2, heads=128, fp8=True), 110)
for _i, _sq in enumerate((3, 4)):
    _register(f"s_q_{_sq}", "s_q",
              f"s_q = {_sq}: query (b, s) reads indices[b, s], lse is laid out [B, N, s_q].",
              lambda s, sq=_sq: SparseDecodeSpec(batch=2, s_q=sq, heads=16), 111 + _i)
# ---- head counts ----------------------------------------------------------------------------
for _i, _n in enumerate((1, 5, 64)):
    _register(f"heads_{_n}", "heads",
              f"{_n} query heads{' (an odd count: a partly filled head tile)' if _n % 2 else ''}"
              " share one latent row per index.",
              lambda s, n=_n: SparseDecodeSpec(heads=n, fp8=n == 64), 120 + _i)
# ---- page sizes -----------------------------------------------------------------------------
for _i, _p in enumerate((1, 16, 128, 256)):
    _register(f"page_{_p}", "pages",
              f"Page size {_p}: a slot is block · {_p} + offset of a [num_blocks, {_p}, D] "
              "cache.",
              lambda s, p=_p: SparseDecodeSpec(page=p, fp8=p == 16), 130 + _i)
# ---- index sentinels ------------------------------------------------------------------------
_register("minus_one", "sentinels",
          "-1 entries, scattered and as a tail after a short context, name no row: dropped.",
          lambda s: SparseDecodeSpec(batch=3, s_q=2, minus_one=0.3), 140)
_register("minus_one_fp8", "sentinels",
          "-1 entries over the fp8_ds_mla cache: dropped before any byte is dequantized.",
          lambda s: SparseDecodeSpec(batch=2, heads=64, minus_one=0.3, fp8=True), 141)
# ---- lonely queries -------------------------------------------------------------------------
_register("lonely_queries", "empty",
          "Queries whose entries are all -1 beside normal ones: out = 0, lse = +inf.",
          lambda s: SparseDecodeSpec(batch=3, s_q=2, lonely=((0, 1), (2, 0))), 150)
_register("all_lonely", "empty",
          "Every entry of every query -1: all out 0, all lse +inf, no cache row read.",
          lambda s: SparseDecodeSpec(batch=2, s_q=2, heads=128, fp8=True,
                                     lonely=((0, 0), (0, 1), (1, 0), (1, 1))), 151)
# ---- repeated indices -----------------------------------------------------------------------
_register("repeated_indices", "repeats",
          "Each query's entries name only 5 rows: a repeated index counts once per appearance.",
          lambda s: SparseDecodeSpec(batch=2, s_q=2, repeats=5), 160)
# ---- topk_length ----------------------------------------------------------------------------
_register("topk_length_ragged", "topk_length",
          "topk_length per request (topk, 1, 37): the entries past it name written rows and "
          "must be ignored.",
          lambda s: SparseDecodeSpec(batch=3, s_q=2, topk_length=(64, 1, 37)), 170)
_register("topk_length_past_topk", "topk_length",
          "topk_length past topk (topk + 1) is refused with a ValueError: a kernel that "
          "runs reads past the index array.",
          lambda s: SparseDecodeSpec(batch=3, fp8=True, topk_length=(5, 65, 64),
                                     refused=True), 172)
_register("topk_length_zero", "topk_length",
          "topk_length 0 makes a request's queries lonely (out 0, lse +inf); its entries name "
          "0xFF rows of the fp8 cache.",
          lambda s: SparseDecodeSpec(batch=3, fp8=True, topk_length=(5, 0, 64),
                                     past_length="nan"), 171)
# ---- the softmax scale ----------------------------------------------------------------------
_register("scale_deepseek", "scale",
          "DeepSeek's scale 1/sqrt(P+R) = 1/sqrt(192), not 1/sqrt(576): the scale passed is "
          "the one used.",
          lambda s: SparseDecodeSpec(batch=2, scale=DEEPSEEK_SCALE), 180)
_register("scale_yarn_v32", "scale",
          "DeepSeek-V3.2's YaRN scale mscale²/sqrt(192) with 128 heads over the fp8 cache.",
          lambda s: SparseDecodeSpec(batch=2, heads=128, fp8=True, scale=YARN_SCALE), 181)
# ---- numerics -------------------------------------------------------------------------------
_register("sharp_softmax", "numerics",
          "Logits 30 times larger: a softmax without the running maximum overflows.",
          lambda s: SparseDecodeSpec(batch=2, q_gain=30.0), 190)
