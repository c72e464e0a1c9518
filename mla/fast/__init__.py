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

# small kernels, prefill with LSE, chunked prefill (mirrors of the reference modules)
from mla.fast.attention import attention_with_lse, flash_attention_with_lse  # noqa: E402
from mla.fast.chunked import chunked_prefill_attention  # noqa: E402
from mla.fast.fp8 import concat_and_cache_fp8_ds_mla  # noqa: E402
from mla.fast.merge import merge_attn_states  # noqa: E402
from mla.fast.paged_cache import concat_and_cache_mla, gather_cache  # noqa: E402
from mla.fast.prefill import prefill_attention  # noqa: E402
from mla.fast.sparse_index import convert_req_index_to_global_index  # noqa: E402

__all__ += ["attention_with_lse", "chunked_prefill_attention", "concat_and_cache_fp8_ds_mla",
            "concat_and_cache_mla", "convert_req_index_to_global_index",
            "flash_attention_with_lse", "gather_cache", "merge_attn_states", "prefill_attention"]

# sparse top-k attention (DeepSeek-V3.2): decode over bf16 / fp8_ds_mla caches, prefill
from mla.fast.sparse import (  # noqa: E402
    SparsePlan,
    plan_sparse,
    sparse_mla_decode,
    sparse_mla_prefill,
)

__all__ += ["SparsePlan", "plan_sparse", "sparse_mla_decode", "sparse_mla_prefill"]
