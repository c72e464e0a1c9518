"""Metamorphic properties of the decode kernels: what must hold whatever a kernel's error.

A deterministic server needs a request's result to depend on that request only. Three
properties, checked bit for bit (NaN equals NaN) on the inputs a case family's trial builds
(``decode_trial``, ``sparse_decode_trial``), for ``mla_decode_paged`` and
``sparse_mla_decode``:

- ``batch_invariance``: request ``b``'s ``out`` and ``lse`` are the same bits when it runs
  alone, in the drawn batch, and in a crowd (the batch followed by a shorter copy of each
  request, in reverse order: other lengths, a larger batch; a sparse copy drops its last
  index, and its last ``topk_length`` entry).
- ``page_placement``: the same bits when every page moves to another physical block of a
  cache twice as large (the blocks between filled with NaN, or ``0xFF`` bytes for the fp8
  caches) and the block table, or the indices' slots, are rewritten to match.
- ``batch_permutation``: permuting the batch permutes ``out`` and ``lse``, bit for bit.

``check(name, kernel, fn, trial, spec, seed)`` runs the transformed calls and returns a
``PropertyResult`` (passed, the worst difference in units in the last place, where, the
convention broken); ``mla.conformance.fuzz.fuzz(..., properties=...)`` checks them beside the
budgets on every example it draws. The float64 reference keeps all three (it loops over the
requests and gathers a request's rows by value).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mla.conformance.cases.common import call_v4
from mla.conformance.catalogue import Trial, Unsupported
from mla.reference.fp8_model1 import fp8_model1_cache

__all__ = ["PROPERTIES", "PROPERTY_KERNELS", "PropertyResult", "check", "properties_of",
           "inputs_of", "ulps"]

PROPERTIES = ("batch_invariance", "page_placement", "batch_permutation")
PROPERTY_KERNELS = ("mla_decode_paged", "sparse_mla_decode")
OUTPUTS = ("out", "lse")

# per kernel: the positional arguments and keywords that carry the batch in dim 0
_BATCHED = {"mla_decode_paged": ((0, 2, 3), ()),
            "sparse_mla_decode": ((0, 2, 5), ("extra_indices_in_kvcache",
                                               "extra_topk_length"))}


@dataclasses.dataclass
class PropertyResult:
    """One property on one input: ``ulps`` is the worst difference (0: the same bits, inf: a
    NaN against a number or a shape that changed), ``where`` the element and its two values,
    ``convention`` what a failure means; ``calls`` the kernel calls made. ``applicable`` is
    False where the input cannot show the property (a batch of one cannot be permuted)."""
    name: str
    passed: bool
    ulps: float = 0.0
    where: str = ""
    convention: str = ""
    calls: int = 0
    applicable: bool = True


@dataclasses.dataclass
class _Inputs:
    args: list[Any]
    kwargs: dict[str, Any]


def properties_of(names: str | Sequence[str] | None) -> tuple[str, ...]:
    """``names`` checked: ``None`` -> none, ``"all"`` -> every property, else the names."""
    if names is None:
        return ()
    if isinstance(names, str):
        names = PROPERTIES if names == "all" else (names,)
    if "all" in names:
        return PROPERTIES
    unknown = [n for n in names if n not in PROPERTIES]
    if unknown:
        raise ValueError(f"unknown properties {unknown}; known: {list(PROPERTIES)} or 'all'")
    return tuple(dict.fromkeys(names))


def inputs_of(trial: Trial) -> _Inputs:
    """The arguments ``trial.invoke`` hands a kernel (recorded by a stand-in kernel)."""
    seen: list[_Inputs] = []

    def record(*args: Any, **kwargs: Any) -> tuple[None, None]:
        seen.append(_Inputs(list(args), dict(kwargs)))
        return None, None

    trial.invoke(record)
    return seen[0]


def _call(fn: Callable, x: _Inputs, model1: bool) -> dict[str, torch.Tensor]:
    out, lse = call_v4(fn, *x.args, model1=model1, **x.kwargs)
    return {"out": out, "lse": lse}


def _rows(kernel: str, x: _Inputs, rows: torch.Tensor,
          edit: Callable[[int, torch.Tensor], torch.Tensor] | None = None) -> _Inputs:
    """``x`` with the batched tensors' dim 0 indexed by ``rows``; ``edit(i, t)`` may rewrite
    the selected tensor of batched argument ``i`` (a keyword: its name's position)."""
    positions, keywords = _BATCHED[kernel]
    args, kwargs = list(x.args), dict(x.kwargs)
    for i in positions:
        if args[i] is not None:
            args[i] = args[i][rows.to(args[i].device)]
            if edit is not None:
                args[i] = edit(i, args[i])
    for k in keywords:
        if kwargs.get(k) is not None:
            kwargs[k] = kwargs[k][rows.to(kwargs[k].device)]
            if edit is not None:
                kwargs[k] = edit(-1 - keywords.index(k), kwargs[k])
    return _Inputs(args, kwargs)


# ---- comparing bits ---------------------------------------------------------------------------

_INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
        torch.float16: torch.int16}


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """Integers in the order of the floats ``x`` (adjacent floats differ by 1)."""
    width = x.element_size() * 8
    bits = x.contiguous().view(_INT[x.dtype]).long()
    mag = bits & ((1 << (width - 1)) - 1)
    return torch.where(bits < 0, -mag, mag)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many floats of their dtype lie between ``a`` and ``b`` (float64):
    0 for the same bits or two NaNs (or ±0), inf for a NaN against a number."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    d = (_ordered(a).double() - _ordered(b).double()).abs()
    d = torch.where(nan_a | nan_b, math.inf, d)
    return torch.where(nan_a & nan_b, 0.0, d)


def _worst(base: dict[str, torch.Tensor], other: dict[str, torch.Tensor],
           pick: Callable[[str, torch.Tensor], torch.Tensor] | None = None
           ) -> tuple[float, str, str]:
    """The worst ulps between ``pick(name, base[name])`` (default: all of it) and ``other``,
    the output it lies in and where."""
    worst, where, name_of = 0.0, "", ""
    for name in OUTPUTS:
        a = base[name] if pick is None else pick(name, base[name])
        b = other[name]
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            got = (tuple(b.shape), b.dtype) if isinstance(b, torch.Tensor) else type(b)
            return math.inf, name, f"{name}: {tuple(a.shape)} {a.dtype} against {got}"
        if a.numel() == 0:
            continue
        d = ulps(a.cpu(), b.cpu())
        m = float(d.max())
        if m > worst:
            i = tuple(int(j) for j in torch.unravel_index(d.argmax(), d.shape))
            worst, name_of = m, name
            where = f"{name}{list(i)}: {float(a.cpu()[i])!r} against {float(b.cpu()[i])!r}"
    return worst, name_of, where


# ---- the properties ---------------------------------------------------------------------------

def _batch_invariance(kernel: str, fn: Callable, x: _Inputs, model1: bool, seed: int
                      ) -> PropertyResult:
    full = _call(fn, x, model1)
    B = x.args[0].shape[0]
    r = PropertyResult("batch_invariance", True, calls=1)

    def keep(worst: float, name: str, where: str, how: str) -> None:
        if worst > r.ulps:
            r.ulps, r.where, r.passed = worst, where, False
            r.convention = f"not batch invariant: {how.format(name=name or 'output')}"

    for b in range(B):
        alone = _call(fn, _rows(kernel, x, torch.tensor([b])), model1)
        r.calls += 1
        w, name, where = _worst(alone, {n: full[n][b:b + 1] for n in OUTPUTS})
        keep(w, name, where, f"request {b}'s {{name}} changes bits when {B - 1} other "
                             f"request{'s' if B != 2 else ''} join{'s' if B == 2 else ''} "
                             f"the batch (alone vs. in the batch of {B})"
             if B > 1 else "request 0's {name} changes bits between two identical calls")
    order = torch.cat([torch.arange(B), torch.arange(B - 1, -1, -1)])
    crowd = _call(fn, _rows(kernel, x, order, lambda i, t: _shorter(kernel, i, t, B)), model1)
    r.calls += 1
    w, name, where = _worst(full, {n: crowd[n][:B] for n in OUTPUTS})
    keep(w, name, where, f"a request's {{name}} changes bits when {B} more request"
                         f"{'s' if B > 1 else ''} of other lengths join the batch of {B}")
    return r


def _shorter(kernel: str, i: int, t: torch.Tensor, B: int) -> torch.Tensor:
    """The crowd's copies (rows ``B..``) made one key shorter: a decode length minus one, a
    sparse query's last index ``-1`` and its ``topk_length`` minus one."""
    t = t.clone()
    if kernel == "mla_decode_paged":
        if i == 3:
            t[B:] = (t[B:] - 1).clamp_min(0)
    elif i in (2, -1):  # the indices (and the second scope's)
        t[B:, ..., -1] = -1
    elif i in (5, -2):  # topk_length (and extra_topk_length)
        t[B:] = (t[B:] - 1).clamp_min(0)
    return t


def _moved(cache: torch.Tensor, where: torch.Tensor, model1: bool) -> torch.Tensor:
    """``cache``'s pages at blocks ``where`` of a cache with ``len(where) * 2 + 1`` blocks, the
    others NaN (0xFF bytes)."""
    nb, page = cache.shape[:2]
    total = 2 * nb + 1
    # a MODEL1 view's pages with their padding (the block stride kept)
    pages = cache.as_strided((nb, cache.stride(0)), (cache.stride(0), 1)) if model1 else cache
    fill = 0xFF if pages.dtype == torch.uint8 else math.nan
    new = torch.full((total, *pages.shape[1:]), fill, dtype=pages.dtype, device=pages.device)
    new[where.to(pages.device)] = pages
    return fp8_model1_cache(new, page) if model1 else new


def _placement(g: torch.Generator, nb: int) -> torch.Tensor:
    """Where each of ``nb`` pages goes among ``2 nb + 1`` blocks (never all in place)."""
    where = torch.randperm(2 * nb + 1, generator=g)[:nb]
    if bool((where == torch.arange(nb)).all()):
        where = where + 1
    return where


def _slots(idx: torch.Tensor, where: torch.Tensor, page: int) -> torch.Tensor:
    w = where.to(idx.device)
    valid = idx >= 0
    safe = torch.where(valid, idx, 0).long()
    return torch.where(valid, w[safe // page] * page + safe % page, idx).to(idx.dtype)


def _page_placement(kernel: str, fn: Callable, x: _Inputs, model1: bool, seed: int
                    ) -> PropertyResult:
    g = torch.Generator().manual_seed(seed * 7919 + 17)
    args, kwargs = list(x.args), dict(x.kwargs)
    cache = args[1]
    where = _placement(g, cache.shape[0])
    args[1] = _moved(cache, where, model1)
    if kernel == "mla_decode_paged":
        table = args[2]
        w = where.to(table.device)
        args[2] = torch.where(table >= 0, w[table.clamp_min(0).long()], table).to(table.dtype)
    else:
        args[2] = _slots(args[2], where, cache.shape[1])
        if kwargs.get("extra_k_cache") is not None:
            extra = kwargs["extra_k_cache"]
            ew = _placement(g, extra.shape[0])
            kwargs["extra_k_cache"] = _moved(extra, ew, model1)
            kwargs["extra_indices_in_kvcache"] = _slots(kwargs["extra_indices_in_kvcache"], ew,
                                                        extra.shape[1])
    base = _call(fn, x, model1)
    moved = _call(fn, _Inputs(args, kwargs), model1)
    w, name, at = _worst(base, moved)
    r = PropertyResult("page_placement", w == 0, w, at, calls=2)
    if not r.passed:
        r.convention = (f"not page-placement invariant: the {name or 'output'} changes bits "
                        f"when the pages move to other physical blocks (the "
                        f"{'block table' if kernel == 'mla_decode_paged' else 'indices'} "
                        f"rewritten to match)")
    return r


def _batch_permutation(kernel: str, fn: Callable, x: _Inputs, model1: bool, seed: int
                       ) -> PropertyResult:
    B = x.args[0].shape[0]
    if B < 2:
        return PropertyResult("batch_permutation", True, applicable=False)
    g = torch.Generator().manual_seed(seed * 7919 + 29)
    perm = torch.randperm(B, generator=g)
    if bool((perm == torch.arange(B)).all()):
        perm = perm.roll(1)
    base = _call(fn, x, model1)
    permuted = _call(fn, _rows(kernel, x, perm), model1)
    w, name, at = _worst(base, permuted, lambda n, t: t[perm.to(t.device)])
    r = PropertyResult("batch_permutation", w == 0, w, at, calls=2)
    if not r.passed:
        i = int(at[len(name) + 1:].split(",")[0].rstrip("]")) if at.startswith(name + "[") else 0
        r.convention = (f"not batch-permutation invariant: with the batch permuted "
                        f"({perm.tolist()}), request {int(perm[i])}'s {name or 'output'} "
                        f"changes bits (at position {i} instead of {int(perm[i])})")
    return r


_CHECKS = {"batch_invariance": _batch_invariance, "page_placement": _page_placement,
           "batch_permutation": _batch_permutation}


def check(name: str, kernel: str, fn: Callable, trial: Trial, spec: Any = None, seed: int = 0
          ) -> PropertyResult:
    """Property ``name`` of ``fn`` (a ``kernel`` of ``PROPERTY_KERNELS``) on ``trial``'s
    inputs; ``spec`` (the trial's) says whether the cache is MODEL1's, ``seed`` draws the
    placement and the permutation. ``Unsupported`` from the kernel propagates; any other
    exception of a transformed call is a failure naming it."""
    if name not in _CHECKS:
        raise ValueError(f"unknown property {name!r}; known: {list(PROPERTIES)}")
    if kernel not in PROPERTY_KERNELS:
        raise ValueError(f"no properties for {kernel!r}; they hold for {list(PROPERTY_KERNELS)}")
    x = inputs_of(trial)
    try:
        return _CHECKS[name](kernel, fn, x, bool(getattr(spec, "model1", False)), seed)
    except Unsupported:
        raise
    except Exception as e:  # a call the batch or placement change broke
        return PropertyResult(name, False, math.inf, f"{type(e).__name__}: {e}"[:400],
                              f"{name.replace('_', ' ')}: a transformed call raised "
                              f"{type(e).__name__}")
