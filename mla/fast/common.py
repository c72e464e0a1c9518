"""What the fast path's modules share on the host: where kernels run, and how calls validate.

- ``interpreting()``: Triton's interpreter (``TRITON_INTERPRET=1``) runs the kernels on the
  CPU; read from the environment once, when this package is imported, as Triton decides it
  then for every kernel it decorates (setting the variable later changes nothing).
- ``num_sms``, ``capability``: the GPU's SM count (launch plans) and compute capability
  (routes), cached per device because each call asks.
- ``ensure_allocator``: the scratch allocator that in-kernel tensor descriptors need.
- ``should_validate``, ``set_validation``, ``validation``, ``validation_enabled``: whether a
  call runs the value checks that read device tensors on the host. An explicit
  ``validate=True/False`` decides; ``validate=None`` follows the global setting, off unless
  ``MLA_FAST_VALIDATE=1`` was set when ``mla.fast`` was imported (a host read per call would
  cost more than a small kernel: the default call must cost what its kernel costs).
- ``check_kernel_input``: the dtype and device the Triton kernels accept.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
import triton
from triton.runtime import _allocation

__all__ = ["LOG2E", "TRITON_VERSION", "capability", "check_kernel_input", "ensure_allocator",
           "interpreting", "next_pow2", "num_sms", "set_validation", "should_validate",
           "validation", "validation_enabled"]

LOG2E = 1.4426950408889634  # kernels work in base 2: exp(x) = exp2(x · LOG2E)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Triton's (major, minor): a few launch plans follow what its compiler makes of them (4-warp
# programs that fit 255 registers under 3.6 spill under 3.7's allocator, as ptxas reports)
TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
_validate_by_default = os.environ.get("MLA_FAST_VALIDATE", "0") not in ("", "0")


def interpreting() -> bool:
    """Whether this package's Triton kernels run under the interpreter (on the CPU): the
    environment as it was when ``mla.fast`` was imported and its kernels decorated."""
    return _INTERPRETING


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=16)
def num_sms(device: torch.device) -> int:
    """The SM count of a CUDA device; 4 under the interpreter (a small machine, so that the
    tests' launch plans split their work)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@functools.lru_cache(maxsize=16)
def capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability``, cached per device: the routes ask on every call,
    and uncached it is a noticeable share of a small decode call's host time."""
    return torch.cuda.get_device_capability(device)


def _torch_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """In-kernel tensor descriptors live in a small global scratch that Triton asks its
    allocator for at launch; install a torch one unless the caller installed their own.
    (Descriptors built on the host instead cost far more launch overhead:
    benchmarks/notes/indexer.md.)
    Called before every such launch (the allocator is a context variable), so kept cheap."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


def validation_enabled() -> bool:
    """The global setting that ``validate=None`` follows (off unless turned on)."""
    return _validate_by_default


def set_validation(enabled: bool) -> None:
    """Turn the value checks of every ``validate=None`` call on or off (a test run, a debugging
    process); an explicit ``validate=True/False`` still decides for its own call."""
    global _validate_by_default
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _validate_by_default = enabled


@contextlib.contextmanager
def validation(enabled: bool = True) -> Iterator[None]:
    """``with mla.fast.validation():`` the global setting for a block, restored after it."""
    saved = _validate_by_default
    set_validation(enabled)
    try:
        yield
    finally:
        set_validation(saved)


def should_validate(validate: bool | None, t: torch.Tensor) -> bool:
    """Resolve a ``validate`` argument. Value checks read device memory on the host, which a
    CUDA graph capture forbids: ``True`` while capturing raises, ``None`` follows the global
    setting (``validation_enabled()``) and never validates while capturing."""
    if validate is None:
        if not _validate_by_default:
            return False
        return not (t.is_cuda and torch.cuda.is_current_stream_capturing())
    if validate and t.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError("validate=True reads device values on the host, which a CUDA graph "
                         "capture forbids; pass validate=False while capturing")
    return bool(validate)


def check_kernel_input(q: torch.Tensor) -> None:
    """What the Triton kernels add to the reference's checks: a 16/32-bit float ``q`` on a CUDA
    device (any device under the interpreter)."""
    if q.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"q must have dtype float16, bfloat16 or float32 for the fast path, "
                        f"got {q.dtype}")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(f"q must be on a CUDA device (or TRITON_INTERPRET=1 set before "
                         f"mla.fast is imported), got {q.device}")


def check_out(out: object, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """``out=``, a preallocated output (FlashMLA's): a contiguous tensor of ``shape`` with
    ``like``'s dtype and device (the kernels write it with the strides of a fresh one)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"out must be a {like.dtype} tensor of shape {tuple(shape)} on "
                         f"{like.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out.stride()}")
    return out


def check_batch_invariant(batch_invariant: object, plan: object) -> None:
    """``batch_invariant`` a bool, and not beside a plan whose splits follow the batch: with it
    a given plan (``DecodePlan`` or ``SparsePlan``) must split by a fixed length
    (``split_keys`` / ``split_entries`` > 0) or not at all (``num_splits = 1``)."""
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__}")
    if not batch_invariant or plan is None:
        return
    fixed = getattr(plan, "split_keys", 0) or getattr(plan, "split_entries", 0)
    num_splits = getattr(plan, "num_splits", 1)
    if not fixed and num_splits > 1:
        raise ValueError(f"batch_invariant=True needs a plan with num_splits = 1 or with "
                         f"fixed-length splits (a split of equal shares follows the batch), "
                         f"got a plan with num_splits = {num_splits}")


def _fix_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a scalar into a 1-element array and calls ``int()`` on it
    in ``range(lo, hi)`` loop bounds, which numpy >= 2.4 refuses ("only 0-dimensional arrays
    can be converted to Python scalars"; triton-lang/triton#9171, fixed upstream by #9172).
    Re-register ``__index__`` with an explicit squeeze. Interpreter only; kernels unchanged."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_mla_fixed", False):
        return

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._mla_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if interpreting():
    _fix_interpreter_index()
