"""Gluon kernels for Hopper (sm_90): the 64-row programs of the fast decode and sparse kernels,
and the indexer's prefill logits.

``mla.fast.decode``, ``mla.fast.sparse`` and ``mla.fast.indexer`` route a call here when its
plan and shapes allow it on an sm_90 GPU (each module's ``supported``); everywhere else their
Triton kernels run.

- ``decode``: paged decode (``decode_kernel``), ``sparse``: sparse top-k decode and prefill
  (``sparse_kernel``); ``sparse_ws``: MODEL1 sparse decode with a producer warp group that
  gathers and dequantizes (``model1_ws_kernel``, the default plan's at 64 heads);
  ``sparse_ws_ds``: the same arrangement over ``fp8_ds_mla`` rows (``ds_mla_ws_kernel``, the
  default plan's at 64 heads, ``SparsePlan.ds_mla_kernel``); ``sparse_ws_bf16``: the same
  arrangement over rows in q's dtype, prefill and bf16/fp16 decode (``plain_ws_kernel``, the
  default plan's at 64 heads, ``SparsePlan.bf16_kernel``);
  ``sparse_seesaw``: the dense decode's seesaw schedule over gathered rows, sparse prefill's
  default (``plain_seesaw_kernel``, ``SparsePlan.bf16_kernel``); ``logits``: the indexer's
  ragged prefill logits (``ragged_logits_kernel``, ``LogitsPlan.prefill_kernel``);
  ``softmax``: the online-softmax + ``P · V`` step both share, and the CTA barrier under the
  name this Triton gives it.

Gluon is Triton's experimental layer and its names move between releases (3.6's
``gl.thread_barrier`` is 3.7's ``gl.barrier``). These kernels are built and compile-tested
under Triton 3.6 and 3.7. Under a Triton whose Gluon cannot build them, the first call that
would use them warns once (``RuntimeWarning``) and that call and every later one run the
Triton kernels instead: slower at 64+ rows, same results.

Importing this package imports no Gluon: that happens at the first call on a Hopper GPU.
"""

from __future__ import annotations

import warnings
from typing import Any

import triton
from triton.errors import TritonError

from mla.fast.launch import check_grid

__all__ = ["launch", "launch_compiled", "usable"]

_why_not = ""  # why the Gluon kernels cannot be used with this Triton ("" while not known)
_imported = False


def _give_up(error: BaseException) -> None:
    global _why_not
    _why_not = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"
    warnings.warn(f"mla.fast: the Gluon sm_90 kernels cannot be built with triton "
                  f"{triton.__version__} ({_why_not}); the Triton kernels run instead",
                  RuntimeWarning, stacklevel=3)


def usable() -> bool:
    """Whether the Gluon kernels can be tried: their modules import with this Triton (the first
    call imports them) and no launch has failed to build."""
    global _imported
    if not _imported and not _why_not:
        try:
            from mla.fast.sm90 import decode, sparse  # noqa: F401
        except (ImportError, AttributeError) as e:
            _give_up(e)
        _imported = True
    return not _why_not


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> bool:
    """``kernel[grid](*args, **kwargs)``; False, with the one warning, when Triton cannot build
    or load it (a ``TritonError``: compilation, ptxas or resources; raised before anything
    runs, so the outputs are untouched and the caller runs its Triton kernel instead).
    A grid no GPU runs raises ``ValueError`` (``mla.fast.launch.check_grid``)."""
    check_grid(getattr(kernel, "__name__", str(kernel)), grid)
    try:
        kernel[grid](*args, **kwargs)
    except TritonError as e:
        _give_up(e)
        return False
    return True


def launch_compiled(launcher: Any, key: Any, grid: tuple[int, int, int], args: Any,
                    **options: Any) -> bool:
    """``launch`` through a ``mla.fast.launch.CompiledLauncher`` (the compiled kernel of
    ``key`` launched directly after its first launch), with the same fallback."""
    try:
        launcher(key, grid, args, **options)
    except TritonError as e:
        _give_up(e)
        return False
    return True
