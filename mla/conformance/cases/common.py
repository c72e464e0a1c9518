"""What the case families share: DeepSeek's widths and scales, and calling a kernel with
poisoned allocations."""

from __future__ import annotations

from collections.abc import Callable

from mla.compare import poisoned_alloc
from mla.config import PRESETS

__all__ = ["D", "DV", "DEFAULT_SCALE", "DEEPSEEK_SCALE", "YARN_SCALE", "call_poisoned",
           "long_length"]

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
