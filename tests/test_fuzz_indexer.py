"""``mla.conformance.fuzz`` on the indexer's kernels: ``top_k_per_row``, ``fp8_mqa_logits``
and ``fp8_paged_mqa_logits``.

The strategies reach the corners they claim (rows of 0, 1, k - 1, k, k + 1 keys, ties, NaN and
±inf, rows past column 0; empty windows and windows of 1, unseen NaN keys, magnitudes far from
1). Broken twins of the reference are found and shrunk with their convention named; under
Triton's interpreter a short fuzz of ``mla.fast``'s kernels passes (``test_fuzz.py``: each
fuzzed kernel) and its broken twins (a top-k that never sees a row's last key, logits scaled
by 1.01) are found, shrunk, and reproduced by the snippet.
"""

from __future__ import annotations

import pytest
import torch
from _interpreter import needs_interpreter
from hypothesis import HealthCheck, given, settings

import mla.reference as ref
from mla.conformance.cases.indexer import NAN_LOW, NO_RELU
from mla.conformance.cases.indexer_specs import ragged_windows
from mla.conformance.fuzz import FUZZED, fuzz
from mla.conformance.fuzz_strategies import examples_of

INF = float("inf")
INDEXER = ("top_k_per_row", "fp8_mqa_logits", "fp8_paged_mqa_logits")


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "fuzz-db")


def _specs(kernel: str, n: int, small: bool = True) -> list:
    found = []

    @settings(max_examples=n, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(examples_of(kernel, (torch.float32,), small))
    def draw(example):  # noqa: ANN001, ANN202
        found.append(example.spec)

    draw()
    return found


def test_the_indexer_kernels_are_fuzzed():
    assert set(INDEXER) <= set(FUZZED)


def test_the_top_k_strategy_reaches_its_corners():
    specs = _specs("top_k_per_row", 150)
    rows = [(n, s.topk) for s in specs for n in s.lens]
    assert {0, 1} <= {n for n, _ in rows}
    assert {-1, 0, 1} <= {n - k for n, k in rows if k > 2}  # k - 1, k, k + 1 keys
    assert any(n > 8192 for n, _ in rows) and any(s.topk == 2048 for s in specs)
    assert any(s.start > 0 for s in specs) and any(s.pad == 0 for s in specs)
    assert {0.0, 1.0, 40.0} <= {s.ties for s in specs}
    assert any(s.specials and s.neg_inf_every == 1 for s in specs)
    assert {-90, 100} <= {s.exponent for s in specs}
    assert any(len(s.lens) * s.repeat > 4 for s in specs)
    big = _specs("top_k_per_row", 60, small=False)
    assert any(n >= 100000 for s in big for n in s.lens)


def test_the_logits_strategy_reaches_its_corners():
    specs = _specs("fp8_mqa_logits", 150)
    windows = [ragged_windows(s) for s in specs]
    spans = [e - s for ks, ke in windows for s, e in zip(ks, ke)]
    assert 0 in spans and 1 in spans
    assert any(s.gap for s in specs) and any(s.nan_key for s in specs)
    assert {1, 3, 64} <= {s.heads for s in specs}
    assert {-80, 100} <= {s.exponent for s in specs}
    assert any(s.compressed is not None for s in specs)
    assert any(0 in s.lens for s in specs) and any(s.window == 1 for s in specs)
    big = _specs("fp8_mqa_logits", 60, small=False)
    assert max(sum(min(n, s.queries) for n in s.lens) for s in big) >= 1000


# ---- broken twins of the reference ----------------------------------------------------------

def topk_nan_lowest(logits, row_starts, row_ends, topk):
    """NaN ranked below every number (a NaN-unaware max)."""
    return ref.top_k_per_row(torch.nan_to_num(logits, nan=-torch.inf), row_starts, row_ends,
                             topk)


def logits_without_relu(q, kv, weights, ks, ke, max_seqlen_k=0):
    """Negative head dots summed too."""
    codes, scale = kv
    dots = torch.einsum("thd,nd->thn", q.double(), codes.double())
    full = torch.einsum("th,thn->tn", weights.double(), dots) * scale.double()
    cols = torch.arange(codes.shape[0])[None, :]
    full = full.masked_fill((cols < ks.long()[:, None]) | (cols >= ke.long()[:, None]), -INF)
    return (ref.compressed_rows(full, ks, ke, max_seqlen_k) if max_seqlen_k else full).float()


REFERENCE_TWINS = [
    ("top_k_per_row", topk_nan_lowest, 40,
     lambda s: len(s.lens) == 1 and s.repeat == 1 and s.specials, NAN_LOW),
    ("fp8_mqa_logits", logits_without_relu, 20,
     lambda s: s.heads == 1 and len(s.lens) == 1, NO_RELU),
]


@pytest.mark.parametrize("kernel, twin, examples, small, convention", REFERENCE_TWINS,
                         ids=[t[1].__name__ for t in REFERENCE_TWINS])
def test_the_fuzz_finds_a_twin_and_names_it(kernel, twin, examples, small, convention, db):
    report = fuzz({kernel: twin}, kernel, examples=examples, database=db, dtype=torch.float64)
    (failure,) = report.failures
    assert small(failure.spec), failure.spec
    assert failure.convention.startswith(convention), (failure.convention, failure.detail)


# ---- mla.fast under the interpreter: its broken twins are found, shrunk and reproduced --------

def _fast_twins():  # noqa: ANN202
    import mla.fast as fast

    def topk_misses_the_last_key(logits, row_starts, row_ends, topk):
        """Each row's range read one key short (an off-by-one end)."""
        return fast.top_k_per_row(logits, row_starts, torch.maximum(row_ends - 1, row_starts),
                                  topk)

    def ragged_one_percent(*args, **kwargs):
        return fast.fp8_mqa_logits(*args, **kwargs) * 1.01

    def paged_one_percent(*args, **kwargs):
        return fast.fp8_paged_mqa_logits(*args, **kwargs) * 1.01

    return {"top_k_per_row": (topk_misses_the_last_key, "indices",
                              lambda s: s.lens == (1,) and s.repeat == 1),
            "fp8_mqa_logits": (ragged_one_percent, "logits",
                               lambda s: len(s.lens) == 1 and s.heads == 1),
            "fp8_paged_mqa_logits": (paged_one_percent, "logits",
                                     lambda s: len(s.lens) == 1 and s.heads == 1)}


@needs_interpreter
@pytest.mark.parametrize("kernel", INDEXER)
def test_the_fuzz_finds_a_broken_twin_of_mla_fast(kernel, db):
    import mla.fast as fast
    twin, output, small = _fast_twins()[kernel]
    report = fuzz({kernel: twin}, kernel, examples=10, database=db, seed=1)
    (failure,) = report.failures
    assert failure.status == "fail" and failure.errors[output] > failure.limits[output]
    assert small(failure.spec), failure.spec
    with pytest.raises(AssertionError):  # the snippet reproduces it
        exec(compile(failure.snippet, "<snippet>", "exec"), {"KERNEL": twin})
    exec(compile(failure.snippet, "<snippet>", "exec"), {"KERNEL": getattr(fast, kernel)})
