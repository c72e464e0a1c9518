"""Measuring a kernel's outputs against the reference's, and saying why they differ.

``measure`` gives one error per output (conventions §11: relative Frobenius error for
``*_rel``, max absolute error for ``*_abs``, the number of unequal elements for
``mismatches``); NaN, a misplaced infinity, a wrong shape or a wrong dtype is an infinite
error, except NaN exactly where the reference has NaN (a NaN input it propagates: the error
is then over the other elements; NaN missing there is an infinite error too). ``describe``
says where a failing output is wrong: the worst element's index (for NaN or a misplaced
infinity, the first such element), where NaN or infinities appeared that the reference does
not have (or are missing, or have the other sign: "-inf where the reference has +inf"), and
``explain`` gives one line naming a known convention difference when one explains the output
(base-2 lse, ``-inf`` for a query with no key, an output left unwritten or a NaN read, in the
kernel's own terms, or a case's own alternatives: a ``1/sqrt(576)`` scale, the causal mask off
by one, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from mla.compare import max_abs_err, rel_err

__all__ = ["measure", "describe", "explain", "LOG2E"]

LOG2E = 1.0 / math.log(2.0)

Outputs = dict[str, torch.Tensor]


def _mismatches(got: torch.Tensor, want: torch.Tensor) -> float:
    """Elements that differ; NaN equals NaN only where both hold one (float outputs)."""
    g, w = got.detach().cpu(), want.detach().cpu()
    if g.is_floating_point():
        g, w = g.double(), w.double()
        same = (g == w) | (torch.isnan(g) & torch.isnan(w))
        return float((~same).sum())
    return float((g != w).sum())


def _form_error(got: object, want: torch.Tensor, quantity: str) -> str:
    """Why ``got`` cannot be compared with ``want``, or ""."""
    if not isinstance(got, torch.Tensor):
        return f"returned {type(got).__name__}, expected a tensor"
    if list(got.shape) != list(want.shape):
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    if quantity == "mismatches" and got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if quantity != "mismatches" and not got.is_floating_point():
        return f"dtype {got.dtype}, expected a floating dtype"
    return ""


def measure(quantity: str, got: object, want: torch.Tensor) -> float:
    """The error of ``got`` against ``want`` for ``quantity`` (``inf`` when not comparable)."""
    if _form_error(got, want, quantity):
        return math.inf
    assert isinstance(got, torch.Tensor)
    if quantity == "mismatches":
        return _mismatches(got, want)
    nan = torch.isnan(want.detach().cpu())
    if nan.any():  # the reference propagates a NaN input: NaN there and only there
        got_nan = torch.isnan(got.detach().cpu())
        if not torch.equal(got_nan, nan):
            return math.inf
        got, want = got.detach().cpu().masked_fill(got_nan, 0.0), want.cpu().masked_fill(nan, 0.0)
    if quantity.endswith("_rel"):
        return rel_err(got, want)
    if quantity.endswith("_abs"):
        return max_abs_err(got, want)
    raise ValueError(f"unknown quantity {quantity!r} (expected *_rel, *_abs or mismatches)")


def _where(mask: torch.Tensor, limit: int = 4) -> str:
    """The first few indices where ``mask`` holds, and per dimension the indices it covers
    when those are not all of them (e.g. "heads 64..127")."""
    idx = mask.nonzero()
    first = ", ".join(str(tuple(i.tolist())) for i in idx[:limit])
    parts = [f"{len(idx)} of {mask.numel()} elements, first at {first}"]
    for d in range(mask.dim()):
        hit = sorted(set(idx[:, d].tolist()))
        if 0 < len(hit) < mask.shape[d]:
            span = (str(hit[0]) if len(hit) == 1
                    else f"{hit[0]}..{hit[-1]}" if hit == list(range(hit[0], hit[-1] + 1))
                    else ",".join(map(str, hit[:8])) + ("..." if len(hit) > 8 else ""))
            parts.append(f"dim {d} only at {span}")
    return "; ".join(parts)


def _one_output(name: str, got: object, want: torch.Tensor, quantity: str) -> list[str]:
    form = _form_error(got, want, quantity)
    if form:
        return [f"{name}: {form}"]
    assert isinstance(got, torch.Tensor)
    g, w = got.detach().cpu(), want.detach().cpu()
    if quantity == "mismatches":
        diff = g != w if not g.is_floating_point() else ~((g == w) | (g.isnan() & w.isnan()))
        return [f"{name}: differs at {_where(diff)}"] if diff.any() else []
    g, w = g.double(), w.double()
    lines = []
    nan = torch.isnan(g) & ~torch.isnan(w)
    if nan.any():
        lines.append(f"{name}: NaN at {_where(nan)}")
    gone = torch.isnan(w) & ~torch.isnan(g)
    if gone.any():
        i = tuple(gone.nonzero()[0].tolist())
        lines.append(f"{name}: reference has NaN (a NaN input propagated) at {_where(gone)}; "
                     f"got {_num(g[i].item())} at {i}")
    for sign in (1.0, -1.0):  # an infinity of the other sign: the message says which
        flipped = torch.isinf(g) & (torch.sign(g) == sign) & torch.isinf(w) & (torch.sign(w)
                                                                              == -sign)
        if flipped.any():
            lines.append(f"{name}: {_inf(sign)} where the reference has {_inf(-sign)} at "
                         f"{_where(flipped)}")
        extra = torch.isinf(g) & (torch.sign(g) == sign) & ~torch.isinf(w)
        if extra.any():
            i = tuple(extra.nonzero()[0].tolist())
            lines.append(f"{name}: unexpected {_inf(sign)} at {_where(extra)}; the reference "
                         f"has {_num(w[i].item())} at {i}")
        lost = torch.isinf(w) & (torch.sign(w) == sign) & ~torch.isinf(g)
        if lost.any():
            i = tuple(lost.nonzero()[0].tolist())
            lines.append(f"{name}: reference has {_inf(sign)} at {_where(lost)}; got "
                         f"{_num(g[i].item())} at {i}")
    lines += _worst(name, g, w)
    return lines


def _inf(sign: float) -> str:
    return "+inf" if sign > 0 else "-inf"


def _num(x: float) -> str:
    """``x`` as the report writes it: 6 digits, infinities with their sign."""
    return _inf(x) if math.isinf(x) else f"{x:.6g}"


def _worst(name: str, g: torch.Tensor, w: torch.Tensor) -> list[str]:
    """The worst element: where a non-finite value differs from the reference (NaN, or an
    infinity the reference lacks or has with the other sign), the first such element, with
    the largest finite difference beside it when there is one; else the largest finite
    difference. Nothing when every element is equal."""
    same = (g == w) | (torch.isnan(g) & torch.isnan(w))
    odd = ~same & ~(torch.isfinite(g) & torch.isfinite(w))
    ok = torch.isfinite(g) & torch.isfinite(w)
    err = torch.where(ok, (g - w).abs(), 0.0)
    j = tuple(int(v) for v in torch.unravel_index(err.argmax(), err.shape)) if ok.any() else ()
    finite = (f"got {_num(g[j].item())}, reference {_num(w[j].item())}"
              if ok.any() and err[j] > 0 else "")
    if odd.any():
        i = tuple(odd.nonzero()[0].tolist())
        return [f"{name}: worst element {i}, the first non-finite mismatch: got "
                f"{_num(g[i].item())}, reference {_num(w[i].item())}"
                + (f"; the largest finite difference at {j}: {finite}" if finite else "")]
    return [f"{name}: worst element {j}: {finite}"] if finite else []


def describe(outputs: Mapping[str, object], expected: Outputs,
             quantities: Mapping[str, str]) -> list[str]:
    """Where each output differs from the reference (one line per finding)."""
    lines = []
    for name, want in expected.items():
        if name not in outputs:
            lines.append(f"{name}: not returned")
            continue
        lines += _one_output(name, outputs[name], want, quantities[name])
    return lines


def _agrees(quantity: str, got: object, want: torch.Tensor, limit: float) -> bool:
    """``got`` within ``limit`` of an alternative's ``want``. An alternative may hold NaN (a
    convention that yields NaN: ``+inf`` taken for a real lse, an empty side's garbage read):
    ``got`` then matches where it holds NaN at exactly those places and the rest is close."""
    if (quantity != "mismatches" and isinstance(got, torch.Tensor) and want.is_floating_point()
            and got.shape == want.shape and got.is_floating_point()
            and bool(torch.isnan(want).any())):
        g, w = got.detach().cpu().double(), want.detach().cpu().double()
        nan = torch.isnan(w)
        return torch.equal(torch.isnan(g), nan) and measure(quantity, g[~nan], w[~nan]) <= limit
    return measure(quantity, got, want) <= limit


def _matches(outputs: Mapping[str, object], other: Outputs, quantities: Mapping[str, str],
             limits: Mapping[str, float]) -> bool:
    return all(name in outputs and _agrees(quantities[name], outputs[name], want, limits[name])
               for name, want in other.items())


def _generic(expected: Outputs) -> dict[str, Callable[[], Outputs]]:
    """Conventions any kernel with an lse can differ in."""
    alts: dict[str, Callable[[], Outputs]] = {}
    lse_names = [n for n in expected if n.endswith("lse")]
    for n in lse_names:
        want = expected[n]
        alts[f"{n} in base 2 (log2); the reference's lse is the natural log"] = (
            lambda n=n, want=want: {**expected, n: want * LOG2E})
        alts[f"{n} is -inf for a query that sees no key; the reference's (FlashMLA's) is "
             "+inf"] = (lambda n=n, want=want: {**expected, n: torch.where(
                 torch.isposinf(want), float("-inf"), want)})
        alts[f"{n} is 0 for a query that sees no key; the reference's (FlashMLA's) is +inf"] = (
            lambda n=n, want=want: {**expected, n: torch.where(torch.isposinf(want), 0.0, want)})
    return alts


# where a NaN the reference lacks can come from, besides an unwritten (poisoned) output, by
# kernel: what the kernel reads that holds NaN or has weight 0
_EMPTY_PART_READ = ("a {} with no keys (lse = -inf or +inf, weight 0) was read: its output "
                    "must be dropped, not multiplied by 0 (0 · NaN = NaN)")
_NAN_READ = {
    "merge_attn_states": _EMPTY_PART_READ.format("side"),
    "cp_lse_ag_out_rs": _EMPTY_PART_READ.format("rank"),
    "attention_with_lse": "a query that sees no key computed as 0/0 (its out must be 0, its "
                          "lse -inf)",
}
_NAN_READ_DEFAULT = ("read from an unused cache row or block-table entry (they hold NaN or "
                     "poison)")


def explain(outputs: Mapping[str, object], expected: Outputs, quantities: Mapping[str, str],
            limits: Mapping[str, float], alternatives: Mapping[str, Callable[[], Outputs]],
            kernel: str | None = None) -> str:
    """The known convention difference that explains ``outputs``, or "". ``kernel`` (the
    case's) names, for NaN where the reference has values, what that kernel may have read."""
    candidates = {**alternatives, **_generic(expected)}
    for why, make in candidates.items():
        try:
            if _matches(outputs, make(), quantities, limits):
                return why
        except Exception:  # noqa: BLE001 (an alternative that cannot be built explains nothing)
            continue
    # NaN only where a value was expected, finite elsewhere: the poisoned buffer shows
    for name, want in expected.items():
        got = outputs.get(name)
        if (isinstance(got, torch.Tensor) and got.shape == want.shape
                and got.is_floating_point()):
            g = got.detach().cpu().double()
            nan = torch.isnan(g) & ~torch.isnan(want.cpu())
            if nan.any():
                return (f"{name} holds NaN where the reference has values: left unwritten "
                        "(outputs are poisoned with NaN before the call) or "
                        + _NAN_READ.get(kernel or "", _NAN_READ_DEFAULT))
    return ""
