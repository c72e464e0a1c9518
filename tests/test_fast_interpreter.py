"""``mla.fast.interpreter``: under Triton's interpreter a ``@triton.jit`` helper's call inside a
launch no longer patches the language again, launches from threads take turns, and results
are those of the kernels as written."""

from __future__ import annotations

import threading

import pytest
import torch
import triton
import triton.language as tl

from mla.fast.common import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="Triton's interpreter only (no GPU)")


@triton.jit
def _twice_plus(x, k):
    return x * 2 + k


@triton.jit
def _helpers_in_a_loop(x_ptr, out_ptr, STEPS: tl.constexpr):
    i = tl.arange(0, 64)
    v = tl.load(x_ptr + tl.program_id(0) * 64 + i)
    for k in range(STEPS):
        v = _twice_plus(v, k) - v  # v + k each step
    tl.store(out_ptr + tl.program_id(0) * 64 + i, v)


def _launch(x: torch.Tensor, steps: int) -> torch.Tensor:
    out = torch.empty_like(x)
    _helpers_in_a_loop[(x.shape[0],)](x, out, STEPS=steps)
    return out


def _expected(x: torch.Tensor, steps: int) -> torch.Tensor:
    return x + steps * (steps - 1) / 2


def test_the_language_is_patched_once_a_launch(monkeypatch):
    """Three programs, each calling the helper 5 times: Triton's patch runs once, for the
    launch (without the skip, 16 times: the launch's and each helper call's); the answer is
    the kernel's."""
    from mla.fast import interpreter

    assert interpreter.skip_helper_repatching()
    calls = []
    patch = interpreter._triton_patch

    def counting(fn):  # type: ignore[no-untyped-def]
        calls.append(fn.__name__)
        return patch(fn)

    monkeypatch.setattr(interpreter, "_triton_patch", counting)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    got = _launch(x, 5)
    assert calls == ["_helpers_in_a_loop"], calls
    torch.testing.assert_close(got, _expected(x, 5), rtol=0, atol=1e-6)


def test_the_builtins_are_put_back_after_a_launch():
    """After a launch ``tl.load`` is Triton's builtin again, not an interpreted stand-in."""
    _launch(torch.zeros(1, 64), 2)
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.arange)


def test_launches_from_threads_take_turns_and_are_right():
    """Eight threads launching at once (as the DCP simulation's ranks do): every result is
    its kernel's, and the builtins are put back after the last."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 64, generator=g) for _ in range(8)]
    got: list[torch.Tensor | None] = [None] * 8
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def body(r: int) -> None:
        try:
            start.wait()
            for _ in range(3):
                got[r] = _launch(xs[r], 3 + r)
        except BaseException as e:  # reported below, on the main thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for r in range(8):
        torch.testing.assert_close(got[r], _expected(xs[r], 3 + r), rtol=0, atol=1e-5)
    assert tl.core.is_builtin(tl.load)
