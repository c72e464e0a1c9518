"""Optimized GPU kernels (Triton) with the kernel-level API of ``mla.reference``.

Each kernel here mirrors the reference function of the same name and is checked against it
tensor by tensor (``python -m mla.check`` on a GPU; the tests under ``TRITON_INTERPRET=1``).
"""

import os


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


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    _fix_interpreter_index()

from mla.fast.decode import DecodePlan, mla_decode_paged, plan_decode  # noqa: E402

__all__ = ["DecodePlan", "mla_decode_paged", "plan_decode"]
