"""Tests that hand ``mla.fast`` CPU tensors: only Triton's interpreter runs its kernels on them.

``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` on machines without a GPU. On a GPU machine
the kernels run compiled and take CUDA tensors only, so these tests are skipped there; the
kernels are checked on the GPU by ``python -m mla.check`` and by each module's GPU cases.
"""

from __future__ import annotations

import os
from importlib.util import find_spec

import pytest

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_interpreter = pytest.mark.skipif(
    not INTERPRETING or find_spec("triton") is None,
    reason="CPU inputs to mla.fast: Triton's interpreter runs them (conftest sets it where "
           "there is no GPU)")
