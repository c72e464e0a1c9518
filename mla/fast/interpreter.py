"""Triton's interpreter, made cheaper for kernels that call ``@triton.jit`` helpers.

Under ``TRITON_INTERPRET=1`` (a machine without a GPU: the tests, the walkthrough, the
notebooks, ``mla conform --device cpu``) each launch replaces ``triton.language``'s builtins
with interpreted ones (``_patch_lang``) and puts them back after the grid has run. Every call
of a ``@triton.jit`` helper inside the launch patches the language again, walking its modules
with ``inspect.getmembers`` each time, though the launch's patch is still in place. The
package's kernels call helpers inside their loops, so that walk was about a quarter of their
interpreted time (``tests/test_fast_sparse_model.py``, one process on this package's CI
machine: 83 s, 62 s without it).

``skip_helper_repatching`` (run by ``mla.fast.common`` when the package is imported under the
interpreter) lets a helper's call inside a launch skip the patch where the launch has already
patched every language module the helper sees: the modules' attributes are then what that
patch would set again. Outside a launch, or where a helper sees a language module the launch
did not patch, Triton's own patch runs. Launches from several threads (the DCP simulation
runs a thread a rank) take turns, one whole launch at a time: the language modules are one
object for every thread, so a launch ending in one thread would otherwise put the builtins
back under a launch still running in another. Compiled kernels are untouched. Triton 3.6 and
3.7 have these internals (``triton.runtime.interpreter``: ``_patch_lang``, ``GridExecutor``);
where either is missing nothing is replaced.
"""

from __future__ import annotations

import inspect
import threading

__all__ = ["skip_helper_repatching"]

_INSTALLED = False
_LOCK = threading.Lock()
_triton_patch = None  # Triton's own ``_patch_lang``, once installed


class _Unchanged:
    """The scope of a patch that was skipped: nothing to put back."""

    def restore(self) -> None:
        pass


def skip_helper_repatching() -> bool:
    """Install the skip (once a process); whether it is installed."""
    global _INSTALLED, _triton_patch
    with _LOCK:
        if _INSTALLED:
            return True
        import triton.language as tl
        from triton.runtime import interpreter

        patch = getattr(interpreter, "_patch_lang", None)
        grid = getattr(interpreter, "GridExecutor", None)
        if patch is None or grid is None or "__call__" not in vars(grid):
            return False
        launch_call = grid.__call__
        # one launch at a time across threads; the launches running in this one, and the
        # language modules the innermost patched (None before its own patch)
        turn = threading.RLock()
        local = threading.local()

        def languages(fn: object) -> frozenset[int]:
            return frozenset(id(v) for v in getattr(fn, "__globals__", {}).values()
                             if inspect.ismodule(v) and v in (tl, tl.core))

        def patch_lang(fn: object) -> object:
            depth, patched = getattr(local, "depth", 0), getattr(local, "patched", None)
            seen = languages(fn)
            if depth and patched is not None and seen <= patched:
                return _Unchanged()
            scope = _triton_patch(fn)
            if depth and patched is None:
                local.patched = seen
            return scope

        def run_launch(self: object, *args: object, **kwargs: object) -> object:
            with turn:
                outer = getattr(local, "patched", None)
                local.patched = None
                local.depth = getattr(local, "depth", 0) + 1
                try:
                    return launch_call(self, *args, **kwargs)
                finally:
                    local.depth -= 1
                    local.patched = outer

        _triton_patch = patch
        interpreter._patch_lang = patch_lang
        grid.__call__ = run_launch
        _INSTALLED = True
        return True
