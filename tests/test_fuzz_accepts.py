"""The fuzz draws within what a target's kernels take (``fuzz_strategies.Accepts``).

A peer's adapter refuses the inputs its kernel does not take, and those examples are skipped:
DeepGEMM judged 22 of about 250 in five minutes. Here the real adapters' checks run on the
CPU (their device check and the peer's kernel replaced by the reference): drawn within what
the adapters state, most examples are judged; drawn over the whole space, most are refused.
A kernel that takes anything still draws the corners (pages of 1, sinks, odd head counts).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import find as hypothesis_find
from hypothesis.errors import NoSuchExample

import mla.reference as ref
from mla.conformance.adapters import deepgemm, flashmla
from mla.conformance.fuzz import fuzz
from mla.conformance.fuzz_strategies import Accepts, accepts_for, examples_of, stated_accepts

SEARCH = settings(max_examples=100, database=None, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "fuzz-db")


@pytest.fixture
def deepgemm_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepGEMM's adapter with every check of its own (heads, pages, next_n, dtypes), its
    device check off and the reference in place of DeepGEMM's kernel."""
    monkeypatch.setattr(deepgemm, "require_device", lambda *a, **kw: None)
    monkeypatch.setattr(deepgemm, "load", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Props", (), {"multi_processor_count": 132}))
    monkeypatch.setattr(deepgemm, "paged_logits",
                        lambda dg, q, cache, w, lens, table, width, sms:
                        ref.fp8_paged_mqa_logits(q, cache, w, lens, table, width))


@pytest.fixture
def flashmla_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashMLA's dense decode adapter (page 64, head dims, dtypes, no attn_sink), its
    device check off and the reference in place of ``flash_mla_with_kvcache``."""
    class Interface:
        @staticmethod
        def get_mla_metadata():  # noqa: ANN205
            return None, None

        @staticmethod
        def flash_mla_with_kvcache(q, k_cache, table, lens, dv, sched, _, scale, causal,  # noqa: ANN001, ANN205
                                   enable_batch_invariant=False):
            out, lse = ref.mla_decode_paged(q.float(), k_cache[:, :, 0].float(), table, lens,
                                            scale, causal, dv)
            return out.to(q.dtype), lse

    monkeypatch.setattr(flashmla, "require_device", lambda *a, **kw: None)
    monkeypatch.setattr(flashmla, "import_peer", lambda *a, **kw: Interface)


@pytest.mark.parametrize("target, kernel, dtype, examples", [
    ("deepgemm", "fp8_paged_mqa_logits", torch.float32, 16),
    ("flashmla", "mla_decode_paged", torch.bfloat16, 16),
])
def test_a_narrow_target_is_drawn_within_what_it_takes(target, kernel, dtype, examples, db,
                                                       deepgemm_on_the_cpu,
                                                       flashmla_on_the_cpu):
    within = fuzz(target, kernel, examples=examples, database=db, dtype=dtype, seed=3)
    (run,) = within.runs
    assert within.passed, within.to_text()
    assert run.examples >= examples and run.unsupported <= run.examples // 8, within.to_text()
    assert run.accepts and f"(drawn within: {run.accepts})" in within.to_text()
    assert f'"drawn_within": "{run.accepts}"' in within.to_json()
    # the whole space (accepts={}): the adapter refuses most of the same budget
    anything = fuzz(target, kernel, examples=examples, database=db, dtype=dtype, seed=3,
                    accepts={})
    (run,) = anything.runs
    assert run.unsupported >= run.examples // 2, anything.to_text()
    assert run.accepts == "" and "drawn within" not in anything.to_text()


def test_what_the_adapters_state():
    paged = stated_accepts("deepgemm")["fp8_paged_mqa_logits"]
    assert (paged.heads, paged.pages, paged.next_n) == (deepgemm.HEADS, deepgemm.PAGES,
                                                        deepgemm.NEXT_N)
    assert stated_accepts("flashmla")["mla_decode_paged"].pages == (64,)
    assert stated_accepts("flashmla")["sparse_mla_decode"].fp8_cache
    assert stated_accepts("mla.fast") == stated_accepts("reference") == stated_accepts(None) == {}
    # a signature without attn_sink or extra_k_cache: no sinks, no second scope drawn
    assert accepts_for("mla_decode_paged", flashmla.mla_decode_paged) == Accepts(sinks=False)
    assert accepts_for("sparse_mla_decode", lambda q, kv, idx, *a: None) == Accepts(
        sinks=False, extra_scope=False)
    # a kernel that takes anything: no limits
    for k in ("mla_decode_paged", "sparse_mla_decode", "top_k_per_row"):
        assert accepts_for(k, getattr(ref, k), "reference") is None


def _never(strategy, condition) -> bool:
    """No example of ``strategy`` among 100 meets ``condition``."""
    try:
        hypothesis_find(strategy, condition, settings=SEARCH)
    except NoSuchExample:
        return True
    return False


def test_draws_stay_within_and_the_corners_stay_reachable():
    f32 = (torch.float32,)
    dense = examples_of("mla_decode_paged", f32, accepts=Accepts(pages=(64,), sinks=False))
    assert _never(dense, lambda e: e.spec.page != 64 or e.spec.sink != "")
    anything = examples_of("mla_decode_paged", f32)
    hypothesis_find(anything, lambda e: e.spec.page == 1 and e.spec.sink, settings=SEARCH)
    hypothesis_find(anything, lambda e: e.spec.heads == 3, settings=SEARCH)
    sparse = examples_of("sparse_mla_decode", f32,
                         accepts=Accepts(fp8_cache=True, topk_length=False))
    assert _never(sparse, lambda e: not (e.spec.fp8 or e.spec.model1)
                  or e.spec.topk_length is not None
                  or (e.spec.extra is not None and e.spec.extra.topk_length is not None))
    hypothesis_find(sparse, lambda e: e.spec.model1 and e.spec.extra is not None,
                    settings=SEARCH)  # MODEL1's second scope is kept
    paged = examples_of("fp8_paged_mqa_logits", f32, accepts=stated_accepts("deepgemm")[
        "fp8_paged_mqa_logits"])
    assert _never(paged, lambda e: e.spec.heads not in (32, 64) or e.spec.page not in (32, 64)
                  or e.spec.next_n == 3)
    # the page edges of the pages taken: a length of page + 1
    hypothesis_find(paged, lambda e: e.spec.page == 32 and 33 in e.spec.lens, settings=SEARCH)
    topk = examples_of("top_k_per_row", f32, accepts=Accepts(topk=(512, 2048),
                                                             row_starts=False))
    assert _never(topk, lambda e: e.spec.topk not in (512, 2048) or e.spec.start != 0)


@pytest.mark.parametrize("kwargs, error, says", [
    ({"pages": 64}, TypeError, "Accepts.pages"),
    ({"heads": ()}, TypeError, "Accepts.heads"),
    ({"next_n": (0, 1)}, ValueError, "Accepts.next_n"),
    ({"topk": (True,)}, TypeError, "Accepts.topk"),
    ({"sinks": 0}, TypeError, "Accepts.sinks"),
])
def test_bad_accepts(kwargs, error, says):
    with pytest.raises(error, match=says):
        Accepts(**kwargs)


@pytest.mark.parametrize("accepts, error, says", [
    ([Accepts()], TypeError, "mapping of kernel names"),
    ({"gather_cache": Accepts()}, ValueError, "without a fuzz strategy"),
    ({"merge_attn_states": {"pages": (64,)}}, TypeError, "Accepts or None"),
])
def test_bad_accepts_arguments(accepts, error, says, db):
    with pytest.raises(error, match=says):
        fuzz(ref, "merge_attn_states", examples=1, database=db, accepts=accepts)
    with pytest.raises(TypeError, match="accepts must be an Accepts"):
        examples_of("merge_attn_states", (torch.float32,), accepts={"pages": (64,)})
