"""Launching a compiled kernel again without Triton's per-call JIT dispatch.

``kernel[grid](*args)`` binds the arguments, specializes every one of them (dtype and 16-byte
alignment of each pointer; each integer's width, ``== 1`` and ``% 16``), builds a cache key
string from the options and looks the compiled kernel up: tens of microseconds of Python per
launch, more than a small decode kernel runs (benchmarks/notes/decode.md, host time). The caller
already knows whether anything of that can have changed: it keys its own cache on the shapes,
strides, dtypes, devices and pointer alignments of its arguments, which determine every
integer argument and every specialization. So the first launch of a key goes through the JIT
(compiling if needed) and keeps the ``CompiledKernel`` it returns; later launches of that key
call the compiled kernel's launcher directly, with the current stream.

The JIT path is always taken under the interpreter (no compiled kernel exists), and while a
launch hook is installed (profilers such as proton read its launch metadata). Should a direct
launch be refused where the JIT's is accepted (a Triton whose launcher takes other arguments
than 3.6's), the launcher warns once and goes through the JIT from then on.

``launch_kept`` is the cheapest launch: the kept kernel of a key, its pointer arguments any
objects holding the right addresses (plain integers, or a tensor in place of its other-dtype
view: the compiled kernel's pointer types are fixed), so that a caller need not rebuild the
views the JIT needed to type its arguments. Where nothing is kept it launches nothing and
says so; the caller then launches through the JIT with the typed arguments.

A caller's key must determine Triton's specialization of every non-constexpr argument:
``int_spec`` gives an integer's class under Triton 3.6's rule and ``ptr_spec`` a pointer's,
for callers whose integers do not all follow from the shapes in their key
(``tests/test_fast_decode.py`` checks both against Triton's own specializer).

``check_grid`` is the launch sites' guard against grids no GPU runs (a ``ValueError`` before
launching, instead of a CUDA error, or no launch at all).
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from triton import knobs

from mla.fast.common import interpreting

__all__ = ["CompiledLauncher", "check_grid", "int_spec", "ptr_spec"]

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_GRID_YZ_MAX = 65535  # CUDA's gridDim.y and gridDim.z
_HOOK_CHAIN = getattr(knobs, "HookChain", ())  # Triton 3.6's hook container


def int_spec(x: int) -> int:
    """An integer argument's specialization class: 1 (a constant), the width (i32 or wider) and
    divisibility by 16, each of which compiles differently."""
    if x == 1:
        return 1
    return (2 if x % 16 == 0 else 0) + (0 if _I32_MIN <= x <= _I32_MAX else 4 + (x >= 2**63))


def ptr_spec(t: torch.Tensor) -> bool:
    """A pointer argument's specialization: 16-byte aligned or not."""
    return t.data_ptr() % 16 == 0


def check_grid(name: str, grid: tuple[int, ...]) -> None:
    """Raise ``ValueError`` where the launch grid ``grid`` (1 to 3 dims) of ``name`` (the
    function or kernel, for the message) would not run as asked; nothing otherwise.

    Two limits. CUDA's: grid y and z at most 65535, x at most 2^31 - 1 (a larger grid is
    refused at launch with a ``RuntimeError`` "invalid argument" that names no size).
    Triton's: its launcher computes ``gridX * gridY * gridZ`` in a C ``int`` and launches only
    if that is positive, so a grid of 2^31 programs or more (the product wrapped modulo 2^32)
    is silently not launched at all, the outputs left as allocated; the programs must number
    less than 2^31. A few integer compares, cheap enough for every launch; sites that keep
    their grid with their launch check it once, when they build it."""
    x = grid[0]
    y = grid[1] if len(grid) > 1 else 1
    z = grid[2] if len(grid) > 2 else 1
    if x * y * z <= _I32_MAX and y <= _GRID_YZ_MAX and z <= _GRID_YZ_MAX and x <= _I32_MAX:
        return
    for axis, n, limit in (("x", x, _I32_MAX), ("y", y, _GRID_YZ_MAX), ("z", z, _GRID_YZ_MAX)):
        if n > limit:
            raise ValueError(f"{name}: launch grid {tuple(grid)} has {n} programs along "
                             f"{axis}, above CUDA's limit of {limit} for grid {axis} (the "
                             f"inputs are too large for one launch)")
    raise ValueError(f"{name}: launch grid {tuple(grid)} has {x * y * z} programs in all, "
                     f"above Triton's limit of {_I32_MAX} (2^31 - 1: its launcher multiplies "
                     f"the grid in a 32-bit int and would silently launch nothing; the inputs "
                     f"are too large for one launch)")


def _hooked() -> bool:
    """Whether a launch hook is installed: Triton 3.6 keeps an empty ``HookChain`` in each
    knob (never None), so a hook is a chain with calls, or anything set in its place."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and not (isinstance(hook, _HOOK_CHAIN) and not hook.calls):
            return True
    return False


class CompiledLauncher:
    """Launches of one ``@triton.jit`` / ``@gluon.jit`` function, the compiled kernel of each
    caller key kept after its first launch.

    ``args`` are all of the kernel's parameters in order, constexprs included (the compiled
    launcher skips them); ``options`` (``num_warps``, ``num_stages``) must be determined by the
    key, as must every specialization of ``args``.
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.compiled: dict[Hashable, Any] = {}
        self.direct = True  # False once a direct launch failed where the JIT's succeeded

    def __call__(self, key: Hashable | None, grid: tuple[int, int, int], args: Sequence[Any],
                 **options: Any) -> None:
        """Launch; ``key=None``: through the JIT, nothing kept."""
        if key is None or interpreting() or not self.direct:
            self.fn[grid](*args, **options)
            return
        device = torch.cuda.current_device()
        compiled = self.compiled.get((device, key))
        if compiled is None or _hooked():
            compiled = self.fn[grid](*args, **options)
            if hasattr(compiled, "result"):  # an asynchronous compile's future
                compiled = compiled.result()
            if compiled is not None:
                self.compiled[(device, key)] = compiled
            return
        try:
            compiled.run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(device),
                         compiled.function, compiled.packed_metadata, None, None, None, *args)
        except Exception as e:  # the launcher refused the arguments before launching
            self.fn[grid](*args, **options)  # the JIT's own error, if the arguments are bad
            # the JIT took them: this Triton's launcher differs from 3.6's; stay on the JIT
            self._give_up(e)

    def launch_kept(self, key: Hashable, grid: tuple[int, int, int], args: Sequence[Any]
                    ) -> bool:
        """Launch the kept compiled kernel of ``key`` with ``args`` (pointers: tensors or
        integer addresses, constexprs included as in ``__call__``); False, launching nothing,
        when none is kept or may be used (first launch of the key, interpreter, launch hook,
        direct launches off) or this Triton's launcher refuses the call (then never again):
        the caller launches through ``__call__`` with arguments the JIT can type."""
        if interpreting() or not self.direct:
            return False
        device = torch.cuda.current_device()
        compiled = self.compiled.get((device, key))
        if compiled is None or _hooked():
            return False
        try:
            compiled.run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(device),
                         compiled.function, compiled.packed_metadata, None, None, None, *args)
        except Exception as e:  # refused before launching: the caller's JIT launch follows
            self._give_up(e)
            return False
        return True

    def _give_up(self, error: Exception) -> None:
        self.direct = False
        warnings.warn(f"mla.fast: launching {getattr(self.fn, '__name__', self.fn)} "
                      f"directly failed ({type(error).__name__}: {error}); Triton's JIT "
                      "launches it from now on (slower on the host, same results)",
                      RuntimeWarning, stacklevel=4)
