"""Test-wide settings.

Triton kernels run under the interpreter on machines without a GPU: the variable must be set
before ``triton`` is first imported, so it is set here, at collection time.

The fast path's value checks (``validate=None``) are off by default; the whole test run turns
them on (``MLA_FAST_VALIDATE=1``, read when ``mla.fast`` is imported), so that every test that
does not pass ``validate`` keeps checking the values of its arguments.
"""

import os
import shutil

if os.environ.get("PYTEST_XDIST_WORKER"):
    # ``-n auto`` runs a worker process a core: one thread each (torch, OpenMP, BLAS), set
    # before torch or numpy is imported, or each worker's thread pools would compete for
    # every core (measured here, 2 cores: 2 workers of one thread 75 s, one process of two 107)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["MLA_FAST_VALIDATE"] = "1"

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_triton_interpret():
    """``mla walkthrough`` and ``mla conform`` on the CPU set TRITON_INTERPRET, as they must
    before triton is imported; put it back after each test, absent where it was absent (on a
    GPU machine the kernels run compiled, and a leftover variable would send CPU tensors to
    them). ``monkeypatch.delenv`` would not: it records nothing for a variable not yet set."""
    saved = os.environ.get("TRITON_INTERPRET")
    yield
    if saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = saved

settings.register_profile(
    "ci", deadline=None, max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", deadline=None, max_examples=500,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
