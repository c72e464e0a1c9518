"""What the case families share: DeepSeek's widths and scales, and calling a kernel with
poisoned allocations."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch

from mla.compare import poisoned_alloc
from mla.config import PRESETS
from mla.conformance.catalogue import Unsupported

__all__ = ["D", "DV", "DEFAULT_SCALE", "DEEPSEEK_SCALE", "YARN_SCALE", "call_poisoned",
           "call_v4", "draw_sink", "long_length", "sink_alternatives", "takes_keyword"]

D, DV = 576, 512  # DeepSeek-V2/V3/V3.2: latent 512 + rope 64 per key row; V is the latent
# Cases outside the "scale" topic pass D ** -0.5, a kernel's usual default: a kernel that
# ignores the scale it is given then fails the scale topic alone (conventions §1).
DEFAULT_SCALE = D ** -0.5
DEEPSEEK_SCALE = 192 ** -0.5  # 1/sqrt(qk_nope + qk_rope) = 1/sqrt(128 + 64)
YARN_SCALE = PRESETS["deepseek-v3"].softmax_scale  # mscale² / sqrt(192) with YaRN


def long_length(setting_small: bool) -> int:
    """A "long" context: past several tiles and splits on a GPU; shorter under the
    interpreter, where every program runs in Python."""
    return 300 if setting_small else 4133


def call_poisoned(fn: Callable, *args: object, **kwargs: object) -> object:
    """``fn(*args, **kwargs)`` with every buffer it allocates starting as NaN / poison."""
    with poisoned_alloc():
        return fn(*args, **kwargs)


def takes_keyword(fn: Callable, keyword: str) -> bool:
    """Whether ``fn`` accepts ``keyword`` (a ``**kwargs`` parameter takes any); a callable
    whose signature cannot be read is given the benefit of the doubt."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is p.VAR_KEYWORD or (p.name == keyword and p.kind is not p.POSITIONAL_ONLY)
               for p in params)


def call_v4(fn: Callable, *args: object, model1: bool = False, **kwargs: object) -> object:
    """``call_poisoned`` for DeepSeek-V4's inputs (conventions §14): "unsupported", not an
    error, when ``fn`` takes no keyword a case passes (``attn_sink``, ``extra_k_cache``, ...)
    or, with ``model1``, refuses the MODEL1 cache with a ``ValueError`` naming it."""
    missing = [k for k in kwargs if not takes_keyword(fn, k)]
    if missing:
        raise Unsupported(f"the kernel takes no {', '.join(missing)}")
    try:
        return call_poisoned(fn, *args, **kwargs)
    except ValueError as e:
        if model1 and "MODEL1" in str(e):
            raise Unsupported(f"the kernel refuses the MODEL1 cache: {e}"[:300]) from e
        raise


# attn_sink kinds: "finite" (one draw per head near the lse), "+inf" (zeroes the output),
# "-inf" (changes nothing), "per_head" (finite draws, head 0 +inf, head 1 -inf)
SINK_KINDS = ("finite", "+inf", "-inf", "per_head")


def draw_sink(g: torch.Generator, kind: str, heads: int, keys: int) -> torch.Tensor:
    """float32 ``attn_sink [heads]`` of ``kind``; finite sinks lie near ``log(keys)``, the
    lse of ``keys`` logits of unit size, so that the factor ``σ(lse − sink)`` is far from 0
    and 1."""
    if kind not in SINK_KINDS:
        raise ValueError(f"sink kind must be one of {SINK_KINDS}, got {kind!r}")
    sink = torch.randn(heads, generator=g, dtype=torch.float64) * 1.5 + math.log(max(keys, 1))
    if kind in ("+inf", "-inf"):
        sink.fill_(float(kind))
    elif kind == "per_head":
        sink[:2] = torch.tensor([math.inf, -math.inf])[:heads]
    return sink.float()


Outputs = dict[str, torch.Tensor]


def sink_alternatives(unsunk: Callable[[], Outputs], expected: Outputs, sink: torch.Tensor,
                      heads_last: Callable[[torch.Tensor], torch.Tensor]
                      ) -> dict[str, Callable[[], Outputs]]:
    """The reference's outputs under the usual wrong sinks. ``unsunk()``: its outputs without
    the sink; ``heads_last`` lays ``lse`` out as ``out[..., 0]`` is (and back: a transpose or
    the identity)."""
    s = sink.double()

    def factor_inverted() -> Outputs:
        plain = unsunk()
        lse = heads_last(plain["lse"])
        factor = torch.where(torch.isposinf(lse), 1.0, torch.sigmoid(s - lse))
        return {**plain, "out": plain["out"] * factor[..., None]}

    def lse_too() -> Outputs:
        lse = heads_last(expected["lse"])
        return {**expected, "lse": heads_last(torch.where(
            torch.isposinf(lse), lse, torch.logaddexp(lse, s.to(lse.dtype))))}

    return {"attn_sink ignored (out not scaled by exp(lse) / (exp(lse) + exp(sink)))": unsunk,
            "attn_sink applied to the lse too (log(exp(lse) + exp(sink)) returned); the "
            "reference's lse is the real keys' alone": lse_too,
            "attn_sink factor inverted: out scaled by exp(sink) / (exp(lse) + exp(sink)) "
            "instead of exp(lse) / (exp(lse) + exp(sink))": factor_inverted}
