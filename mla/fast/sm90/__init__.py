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
under Triton 3.6 and 3.7. Under a Triton whose Gluon the modules cannot import, the first call
that would use them warns once (``RuntimeWarning``) and that call and every later one run the
Triton kernels instead: slower at 64+ rows, same results. A kernel that fails to build (one
specialization of it is enough) is given up alone, with one warning naming it: that call and
every later one that would launch it run the Triton kernel in its place, and the other Gluon
kernels still run (``usable(name)``).

Importing this package imports no Gluon: that happens at the first call on a Hopper GPU.
"""

from __future__ import annotations

import warnings
from typing import Any

import triton
from triton.errors import TritonError

from mla.fast.launch import check_grid

__all__ = ["GIVEN_UP", "launch", "launch_compiled", "usable"]

# how every warning of a Gluon kernel given up begins
GIVEN_UP = "mla.fast: the Gluon sm_90 kernel"
_why_not = ""  # why no Gluon kernel can be used with this Triton ("" while not known)
_imported = False
_unbuilt: dict[str, str] = {}  # a kernel's name -> why it failed to build here


def _reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"


def _give_up(error: BaseException) -> None:
    """Every Gluon kernel given up (their modules do not import with this Triton)."""
    global _why_not
    _why_not = _reason(error)
    warnings.warn(f"{GIVEN_UP}s cannot be built with triton {triton.__version__} "
                  f"({_why_not}); the Triton kernels run instead", RuntimeWarning, stacklevel=3)


def _give_up_kernel(name: str, error: BaseException) -> None:
    """One Gluon kernel given up (a build of it failed)."""
    _unbuilt[name] = _reason(error)
    warnings.warn(f"{GIVEN_UP} {name} cannot be built with triton {triton.__version__} "
                  f"({_unbuilt[name]}); the Triton kernel runs in its place, the other Gluon "
                  f"kernels still run", RuntimeWarning, stacklevel=3)


def _name(kernel: Any) -> str:
    return getattr(kernel, "__name__", None) or type(kernel).__name__


def usable(kernel: str | None = None) -> bool:
    """Whether the Gluon kernels can be tried: their modules import with this Triton (the first
    call imports them) and, given a kernel's name, no build of that kernel has failed."""
    global _imported
    if not _imported and not _why_not:
        try:
            from mla.fast.sm90 import decode, sparse  # noqa: F401
        except (ImportError, AttributeError) as e:
            _give_up(e)
        _imported = True
    return not _why_not and (kernel is None or kernel not in _unbuilt)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> bool:
    """``kernel[grid](*args, **kwargs)``; False, with one warning for the kernel, when Triton
    cannot build or load it (a ``TritonError``: compilation, ptxas or resources; raised before
    anything runs, so the outputs are untouched and the caller runs its Triton kernel instead),
    and at once, trying nothing, for a kernel given up before. A grid no GPU runs raises
    ``ValueError`` (``mla.fast.launch.check_grid``)."""
    name = _name(kernel)
    check_grid(name, grid)
    if name in _unbuilt:
        return False
    try:
        kernel[grid](*args, **kwargs)
    except TritonError as e:
        _give_up_kernel(name, e)
        return False
    return True


def launch_compiled(launcher: Any, key: Any, grid: tuple[int, int, int], args: Any,
                    **options: Any) -> bool:
    """``launch`` through a ``mla.fast.launch.CompiledLauncher`` (the compiled kernel of
    ``key`` launched directly after its first launch), with the same fallback."""
    name = _name(launcher.fn)
    if name in _unbuilt:
        return False
    try:
        launcher(key, grid, args, **options)
    except TritonError as e:
        _give_up_kernel(name, e)
        return False
    return True
