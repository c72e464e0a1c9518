"""Cases of ``merge_attn_states``: two partial attentions over disjoint key sets, combined
through their log-sum-exps (conventions §6).

``(prefix_output [T, N, D], prefix_lse [N, T], suffix_output, suffix_lse) -> (output,
output_lse)``. The lse is the natural log; ``+inf`` (FlashMLA's "no key" marker) and ``-inf``
(the log of an empty sum, FA3's and ``attention_with_lse``'s) both mean "this side saw no
keys": the other side passes through and the empty side's output is never read (the cases fill
it with NaN, so a kernel that reads it shows); both sides empty give ``out = 0`` and
``lse = -inf``; a NaN lse is no marker: merged with a present side or an empty one the row
comes out NaN (§13).

Outputs are in the setting's dtype, the lse float32 (float64 in float64 settings: the
reference keeps the lse dtype it is given), and the reference runs in float64 on exactly those
values. Only the "empty_*", "both_empty" and "nan_beside_empty" topics hold infinite lse,
only the "nan" and "nan_beside_empty" topics a NaN lse; only the "underflowed_side_*" cases
infinite or NaN outputs on a present side.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from mla.conformance.cases.common import DV, call_poisoned
from mla.conformance.catalogue import Setting, Trial, case, generator, spec_cases
from mla.reference.merge import merge_attn_states

__all__ = ["MergeSpec", "merge_trial", "merge_underflow_trial", "lse_dtype", "nan_split", "LN2"]

KERNEL = "merge_attn_states"
LN2 = math.log(2.0)
INF = float("inf")
Outputs = dict[str, torch.Tensor]


def lse_dtype(setting: Setting) -> torch.dtype:
    """The dtype lse inputs get: float32, float64 in float64 settings (conventions §5)."""
    return torch.float64 if setting.dtype == torch.float64 else torch.float32


def nan_split(outputs: Outputs, nan_rows: torch.Tensor, lse_rows_first: bool) -> Outputs:
    """Outputs of a trial whose reference holds NaN rows (the NaN rule), in comparable parts.

    ``nan_rows [T, N]`` marks the rows ``(t, n)`` the reference makes NaN; ``out`` is
    ``[T, N, D]`` and ``lse`` ``[N, T]`` (``[T, N]`` with ``lse_rows_first``). ``out`` and
    ``lse`` keep the other rows (held to their budgets); ``out_nan`` and ``lse_nan`` say where
    NaN is, element by element (held exactly: a NaN row must be NaN throughout, no other
    element may be)."""
    out, lse = outputs.get("out"), outputs.get("lse")
    parts: Outputs = {}
    keep = ~nan_rows.cpu()
    if isinstance(out, torch.Tensor) and out.shape[:2] == keep.shape:
        parts["out"], parts["out_nan"] = out.cpu()[keep], torch.isnan(out.cpu())
    if isinstance(lse, torch.Tensor):
        rows = lse.cpu() if lse_rows_first else lse.cpu().transpose(0, 1)
        if rows.shape == keep.shape:
            parts["lse"], parts["lse_nan"] = rows[keep], torch.isnan(rows)
    return parts


NAN_QUANTITIES = {"out": "out_rel", "lse": "lse_abs", "out_nan": "mismatches",
                  "lse_nan": "mismatches"}


@dataclasses.dataclass(frozen=True)
class MergeSpec:
    tokens: int
    heads: int = 16
    d: int = DV
    lse_center: float = 4.0  # the lse of a few hundred unit logits
    lse_spread: float = 2.0  # each side's lse: center + uniform(-spread, spread)
    gap: float = 0.0  # one side, chosen per row, this much above the other
    equal: bool = False  # both sides the same lse
    signs: bool = False  # lse centred at -lse_center or +lse_center, per row
    one_empty: float = 0.0  # the share of rows with one side (either) empty
    both_empty: float = 0.0  # the share of rows with both sides empty
    markers: tuple[float, ...] = (INF,)  # the "no key" markers empty sides hold
    nan: bool = False  # a quarter of the rows: a NaN lse on one side, the other present


def _inputs(spec: MergeSpec, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """float64 ``o_p, lse_p, o_s, lse_s`` on the CPU (see the module doc)."""
    T, N, D = spec.tokens, spec.heads, spec.d

    def uniform(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g, dtype=torch.float64) * 2 - 1

    o_p = torch.randn(T, N, D, generator=g, dtype=torch.float64)
    o_s = torch.randn(T, N, D, generator=g, dtype=torch.float64)
    center = spec.lse_center * (torch.sign(uniform(N, T)) if spec.signs else 1.0)
    lse_p = center + spec.lse_spread * uniform(N, T)
    lse_s = lse_p.clone() if spec.equal else center + spec.lse_spread * uniform(N, T)
    side = torch.sign(uniform(N, T))
    lse_p, lse_s = lse_p + side * spec.gap / 2, lse_s - side * spec.gap / 2

    u = torch.rand(N, T, generator=g, dtype=torch.float64)
    both = u < spec.both_empty
    one = ~both & (u < spec.both_empty + spec.one_empty)
    which = torch.rand(N, T, generator=g) < 0.5  # the prefix (else the suffix) is the one
    markers = torch.tensor(spec.markers, dtype=torch.float64)
    pick = markers[torch.randint(len(markers), (2, N, T), generator=g)]
    sides = ((lse_p, o_p, both | (one & which)), (lse_s, o_s, both | (one & ~which)))
    for k, (lse, o, empty) in enumerate(sides):
        lse[empty] = pick[k][empty]
        o[empty.transpose(0, 1)] = float("nan")  # an empty side's output is never read
    if spec.nan:
        poisoned = torch.rand(N, T, generator=g) < 0.25
        lse_p[poisoned & which] = float("nan")
        lse_s[poisoned & ~which] = float("nan")
    return o_p, lse_p, o_s, lse_s


def _ref(o_p: torch.Tensor, lse_p: torch.Tensor, o_s: torch.Tensor, lse_s: torch.Tensor
         ) -> Outputs:
    out, lse = merge_attn_states(o_p, lse_p, o_s, lse_s)
    return {"out": out, "lse": lse}


def _base2(o_p: torch.Tensor, lse_p: torch.Tensor, o_s: torch.Tensor, lse_s: torch.Tensor
           ) -> Outputs:
    """A kernel that reads and writes the lse in base 2: the natural-log merge of
    ``lse·ln 2``, its lse back in base 2."""
    r = _ref(o_p, lse_p * LN2, o_s, lse_s * LN2)
    return {"out": r["out"], "lse": r["lse"] / LN2}


def _nan_at(expected: Outputs, rows: torch.Tensor, lse: bool = True) -> Outputs:
    """``expected`` with NaN in ``out`` (and ``lse``) at ``rows [N, T]``."""
    out = expected["out"].masked_fill(rows.transpose(0, 1)[..., None], float("nan"))
    return {"out": out, "lse": expected["lse"].masked_fill(rows, float("nan")) if lse
            else expected["lse"]}


def _both_empty_at(expected: Outputs, rows: torch.Tensor) -> Outputs:
    """``expected`` with out 0 and lse -inf (both sides empty) at ``rows [N, T]``."""
    return {"out": expected["out"].masked_fill(rows.transpose(0, 1)[..., None], 0.0),
            "lse": expected["lse"].masked_fill(rows, -INF)}


def _alternatives(o_p: torch.Tensor, lse_p: torch.Tensor, o_s: torch.Tensor,
                  lse_s: torch.Tensor, expected: Outputs) -> dict[str, Callable[[], Outputs]]:
    """What a kernel under another known convention returns on these inputs."""
    lse_out = expected["lse"]
    empty_p, empty_s = torch.isinf(lse_p), torch.isinf(lse_s)
    return {
        "lse read as base 2 (weights 2^(lse - m), lse = m + log2(...)); the reference's is "
        "the natural log": lambda: _base2(o_p, lse_p, o_s, lse_s),
        "+inf read as a real lse (only -inf taken for 'no keys'): m = +inf makes the row NaN; "
        "FlashMLA marks an empty side with +inf": lambda: _nan_at(
            expected, torch.isposinf(lse_p) | torch.isposinf(lse_s)),
        "-inf read as a real lse (only +inf taken for 'no keys'): weight exp(-inf) = 0 times "
        "the empty side's output, or -inf - -inf, makes the row NaN": lambda: _nan_at(
            expected, torch.isneginf(lse_p) | torch.isneginf(lse_s)),
        "the empty side's output is read (0 · its garbage = NaN): one side empty must pass "
        "the other through": lambda: _nan_at(expected, empty_p ^ empty_s, lse=False),
        "both sides empty give lse +inf (FlashMLA's marker); the reference gives -inf": lambda: {
            "out": expected["out"], "lse": lse_out.masked_fill(empty_p & empty_s, INF)},
        "both sides empty give NaN (0/0); the reference gives out 0, lse -inf": lambda: _nan_at(
            expected, empty_p & empty_s),
        "a NaN lse read as 'no keys' (the other side passed through); NaN must stay NaN": (
            lambda: _ref(o_p, lse_p.nan_to_num(nan=-INF, posinf=INF, neginf=-INF), o_s,
                         lse_s.nan_to_num(nan=-INF, posinf=INF, neginf=-INF))),
        "a NaN lse beside an empty side read as 'no keys' (a maximum that drops the NaN meets "
        "the empty side's -inf, and the both-empty rule gives out 0, lse -inf); NaN must stay "
        "NaN": lambda: _both_empty_at(expected, (torch.isnan(lse_p) & empty_s)
                                      | (torch.isnan(lse_s) & empty_p))}


def merge_trial(setting: Setting, spec: MergeSpec, salt: int) -> Trial:
    """A trial of ``spec``: inputs in the setting's dtypes, the reference on upcast copies."""
    o_p, lse_p, o_s, lse_s = _inputs(spec, generator(setting, salt))
    o_p, o_s = o_p.to(setting.dtype), o_s.to(setting.dtype)
    lse_p, lse_s = lse_p.to(lse_dtype(setting)), lse_s.to(lse_dtype(setting))
    exact = tuple(t.double() for t in (o_p, lse_p, o_s, lse_s))  # the kernel's inputs, exactly
    args = tuple(t.to(setting.device) for t in (o_p, lse_p, o_s, lse_s))
    expected = _ref(*exact)
    alts = _alternatives(*exact, expected)
    nan_rows = (torch.isnan(exact[1]) | torch.isnan(exact[3])).transpose(0, 1)  # [T, N]

    def invoke(fn: Callable) -> Outputs:
        out, lse = call_poisoned(fn, *args)
        return {"out": out, "lse": lse}

    if not spec.nan:
        return Trial(invoke, expected, {"out": "out_rel", "lse": "lse_abs"}, alts)

    def split(make: Callable[[], Outputs]) -> Callable[[], Outputs]:
        return lambda: nan_split(make(), nan_rows, lse_rows_first=False)

    return Trial(lambda fn: nan_split(invoke(fn), nan_rows, lse_rows_first=False),
                 split(lambda: expected)(), dict(NAN_QUANTITIES),
                 {why: split(make) for why, make in alts.items()})


# a side this far below the other weighs exp(-gap) = 0 in float64 (and in float32)
UNDERFLOW = 800.0
GARBAGE = {"inf": INF, "-inf": -INF, "nan": float("nan")}


def merge_underflow_trial(setting: Setting, spec: MergeSpec, salt: int,
                          garbage: str = "inf") -> Trial:
    """``merge_trial``'s inputs (``spec.gap`` at least ``UNDERFLOW``) with the output of every
    present side whose weight ``exp(lse - m)`` underflows to 0 set to ``garbage`` ("inf",
    "-inf" or "nan"): the side adds exactly nothing (the reference drops a zero weight), where
    ``0 · inf`` or ``0 · NaN`` would make the row NaN."""
    if spec.gap < UNDERFLOW or spec.nan:
        raise ValueError(f"an underflow trial needs gap >= {UNDERFLOW} and no NaN lse, got "
                         f"gap {spec.gap}, nan {spec.nan}")
    o_p, lse_p, o_s, lse_s = _inputs(spec, generator(setting, salt))
    lse_p, lse_s = lse_p.to(lse_dtype(setting)).double(), lse_s.to(lse_dtype(setting)).double()
    present = torch.isfinite(lse_p) & torch.isfinite(lse_s)
    low_p = present & (lse_p < lse_s - UNDERFLOW)  # [N, T]
    low_s = present & (lse_s < lse_p - UNDERFLOW)
    o_p[low_p.transpose(0, 1)] = GARBAGE[garbage]
    o_s[low_s.transpose(0, 1)] = GARBAGE[garbage]
    o_p, o_s = o_p.to(setting.dtype), o_s.to(setting.dtype)
    lse_p, lse_s = lse_p.to(lse_dtype(setting)), lse_s.to(lse_dtype(setting))
    exact = tuple(t.double() for t in (o_p, lse_p, o_s, lse_s))
    args = tuple(t.to(setting.device) for t in (o_p, lse_p, o_s, lse_s))
    expected = _ref(*exact)
    alts = _alternatives(*exact, expected)
    alts[f"a side whose weight underflowed to 0 multiplied by its output (0 · {garbage} = NaN) "
         "instead of dropped: a zero weight must add nothing"] = (
        lambda: _nan_at(expected, low_p | low_s, lse=False))

    def invoke(fn: Callable) -> Outputs:
        out, lse = call_poisoned(fn, *args)
        return {"out": out, "lse": lse}

    return Trial(invoke, expected, {"out": "out_rel", "lse": "lse_abs"}, alts)


_register = spec_cases(KERNEL, merge_trial)

def _tokens(setting: Setting, small: int, full: int) -> int:
    """T: a few rows a program under the interpreter (every program runs in Python), many
    blocks on a GPU."""
    return small if setting.small else full


# ---- DeepSeek widths, head and token counts -------------------------------------------------
_register("latent_16_heads", "shapes",
          "DeepSeek-V3 at tensor parallel 8: 16 heads of latent width 512 (the absorbed path's "
          "V).",
          lambda s: MergeSpec(_tokens(s, 9, 257), heads=16), 400)
_register("latent_128_heads_one_token", "shapes",
          "128 heads of width 512 for a single token (T = 1): DeepSeek-V3 at tensor parallel 1.",
          lambda s: MergeSpec(1, heads=128), 401)
_register("prefill_v_width_128", "shapes",
          "The chunked prefill's merge: 16 heads of V width 128 (DeepSeek's v_head_dim).",
          lambda s: MergeSpec(_tokens(s, 64, 1031), heads=16, d=128), 402)
_register("heads_1", "heads",
          "One head (N = 1) over 17 tokens: the lse layout [N, T] is one row.",
          lambda s: MergeSpec(17, heads=1), 403)
_register("heads_33", "heads",
          "33 heads (an odd count): rows (t, n) that fill no tile evenly.",
          lambda s: MergeSpec(5, heads=33), 404)
_register("no_tokens", "tokens",
          "T = 0: outputs [0, N, D] and [N, 0], nothing read or written.",
          lambda s: MergeSpec(0, heads=16), 405)
# ---- the lse base ---------------------------------------------------------------------------
_register("lse_base_natural", "lse_base",
          "The lse is the natural log: sides up to 6 apart weigh exp(lse - m), not 2^(lse - m) "
          "(vLLM PR #47079 merged base-2 partials as natural ones).",
          lambda s: MergeSpec(_tokens(s, 8, 64), lse_spread=3.0), 410)
# ---- empty sides ----------------------------------------------------------------------------
_register("empty_side_plus_inf", "empty_plus_inf",
          "One side empty (lse +inf, FlashMLA's marker, output NaN) on half the rows: the other "
          "side's out and lse pass through.",
          lambda s: MergeSpec(_tokens(s, 8, 64), one_empty=0.5, markers=(INF,)), 420)
_register("empty_side_minus_inf", "empty_minus_inf",
          "One side empty (lse -inf, FA3's and attention_with_lse's marker, output NaN) on half "
          "the rows: the other side's out and lse pass through.",
          lambda s: MergeSpec(_tokens(s, 8, 64), one_empty=0.5, markers=(-INF,)), 421)
_register("both_sides_empty", "both_empty",
          "A third of the rows empty on both sides (+inf and -inf mixed): out 0 and lse -inf; "
          "a third empty on one side.",
          lambda s: MergeSpec(_tokens(s, 9, 90), one_empty=1 / 3, both_empty=1 / 3,
                              markers=(INF, -INF)), 422)
_register("all_rows_empty", "both_empty",
          "Every row empty on both sides (+inf and -inf mixed): all out 0, all lse -inf, no NaN.",
          lambda s: MergeSpec(6, heads=16, both_empty=1.0, markers=(INF, -INF)), 423)
# ---- numerics -------------------------------------------------------------------------------
_register("dominant_side", "numerics",
          "One side's lse 120 above the other's: the small weight underflows in float32 and "
          "must add nothing (not 0 · inf), the big side passes through.",
          lambda s: MergeSpec(_tokens(s, 6, 64), gap=120.0), 430)
_register("equal_lse", "numerics",
          "Both sides with the same lse: weights 1/2 each, lse + log 2.",
          lambda s: MergeSpec(_tokens(s, 6, 64), equal=True), 431)
_register("large_lse", "numerics",
          "lse near +1000 and -1000: exp(lse) overflows or underflows in float32 unless the "
          "max is subtracted first.",
          lambda s: MergeSpec(_tokens(s, 6, 64), lse_center=1000.0, signs=True), 432)
# ---- NaN ------------------------------------------------------------------------------------
_register("nan_lse_is_not_empty", "nan",
          "A NaN lse on one side of a quarter of the rows gives a NaN row, never the other side "
          "passed through as if the NaN meant 'no keys' (conventions §13).",
          lambda s: MergeSpec(_tokens(s, 8, 64), nan=True), 440)
_register("nan_lse_beside_empty_side", "nan_beside_empty",
          "Half the rows empty on both sides (+inf and -inf mixed), then a NaN lse on one side "
          "of a quarter of all rows: a NaN beside an empty side gives a NaN row too, never out "
          "0 and lse -inf as if both sides were empty.",
          lambda s: MergeSpec(_tokens(s, 8, 64), both_empty=0.5, markers=(INF, -INF),
                              nan=True), 441)
# ---- a weight that underflows to 0 -----------------------------------------------------------
for _i, _garbage in enumerate(("inf", "nan")):
    case(KERNEL, "numerics", name=f"underflowed_side_holds_{_garbage}",
         doc=f"One side's lse 2000 below the other's (its weight exp(-2000) is 0 even in "
             f"float64) and its output {_garbage}: the side adds nothing (not 0 · {_garbage} = "
             f"NaN), the other passes through.")(
        lambda s, g=_garbage, i=_i: merge_underflow_trial(
            s, MergeSpec(_tokens(s, 8, 64), gap=2000.0),
            450 + i, garbage=g))
