"""Broken twins of every check in ``python -m mla.check``: the same cases with each fast kernel
wrapped so that its result is off by 1% (outputs and lse scaled by 1.01; caches and index maps,
whose checks are exact, off by one bit or one row). Every family's check must fail them, while
the unwrapped kernels pass: the budgets are tight enough to catch a 1% bug.

CPU, ``TRITON_INTERPRET=1`` (conftest), the ``quick`` cases in float16.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import mla.fast as fast
from mla.check.runner import REGISTRY, Ctx, run_checks  # runner registers every family

CTX = Ctx(device=torch.device("cpu"), dtype=torch.float16, quick=True)


def _scaled_outputs(*which: int) -> Callable:
    """A wrapper of a kernel returning a tuple: the outputs at ``which`` scaled by 1.01."""
    def wrap(f: Callable) -> Callable:
        def g(*args, **kwargs):  # type: ignore[no-untyped-def]
            res = list(f(*args, **kwargs))
            for i in which:
                res[i] = res[i] * 1.01
            return tuple(res)
        return g
    return wrap


def _scaled_return(f: Callable) -> Callable:
    def g(*args, **kwargs):  # type: ignore[no-untyped-def]
        return f(*args, **kwargs) * 1.01
    return g


def _scaled_cache_rows(f: Callable) -> Callable:
    """concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping): the rows written, x 1.01."""
    def g(kv_c, k_pe, kv_cache, slot_mapping, *args, **kwargs):  # type: ignore[no-untyped-def]
        f(kv_c, k_pe, kv_cache, slot_mapping, *args, **kwargs)
        rows = kv_cache.view(-1, kv_cache.shape[-1])
        slots = slot_mapping[slot_mapping >= 0].long()
        rows[slots] = rows[slots] * 1.01
    return g


def _flipped_fp8_bit(f: Callable) -> Callable:
    """The fp8_ds_mla write with the lowest bit of one written byte flipped."""
    def g(kv_c, k_pe, kv_cache, slot_mapping, *args, **kwargs):  # type: ignore[no-untyped-def]
        f(kv_c, k_pe, kv_cache, slot_mapping, *args, **kwargs)
        slot = int(slot_mapping[slot_mapping >= 0][0])
        kv_cache.view(-1, kv_cache.shape[-1])[slot, 0] ^= 1
    return g


def _index_off_by_one(f: Callable) -> Callable:
    def g(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = f(*args, **kwargs)
        return torch.where(out >= 0, out + 1, out)
    return g


# kernel -> (name in mla.fast, broken twins: label -> wrapper)
TWINS: dict[str, dict[str, Callable]] = {
    "attention_with_lse": {"out": _scaled_outputs(0), "lse": _scaled_outputs(1)},
    "mla_decode_paged": {"out": _scaled_outputs(0), "lse": _scaled_outputs(1)},
    "merge_attn_states": {"out": _scaled_outputs(0), "lse": _scaled_outputs(1)},
    "prefill_attention": {"out": _scaled_outputs(0), "lse": _scaled_outputs(1)},
    "chunked_prefill_attention": {"out": _scaled_outputs(0), "lse": _scaled_outputs(1)},
    "sparse_mla_decode": {"out": _scaled_outputs(0), "lse": _scaled_outputs(1)},
    "sparse_mla_prefill": {"out": _scaled_outputs(0), "max_logits": _scaled_outputs(1),
                           "lse": _scaled_outputs(2)},
    "concat_and_cache_mla": {"cache": _scaled_cache_rows},
    "gather_cache": {"rows": _scaled_return},
    "concat_and_cache_fp8_ds_mla": {"cache": _flipped_fp8_bit},
    "convert_req_index_to_global_index": {"index": _index_off_by_one},
}


def test_every_family_has_a_twin():
    assert set(TWINS) == set(REGISTRY)


def test_the_unbroken_kernels_pass():
    results = run_checks(CTX)
    assert {r.kernel for r in results} == set(REGISTRY)
    assert all(r.passed for r in results), [(r.kernel, r.case, r.metrics, r.error)
                                            for r in results if not r.passed]


@pytest.mark.parametrize("kernel,label", [(k, lab) for k, t in TWINS.items() for lab in t])
def test_a_one_percent_bug_fails(kernel, label, monkeypatch):
    fast_name = REGISTRY[kernel][0]
    broken = TWINS[kernel][label](getattr(fast, fast_name))
    monkeypatch.setattr(fast, fast_name, broken)
    results = run_checks(CTX, [kernel])
    assert results
    failed = [r for r in results if not r.passed]
    assert failed
    # every case catches it but those the change cannot touch: outputs all empty, zero or
    # infinite (every query of the case sees no key), which then match exactly; and the fp8
    # write's dequantization-error bound (1.5x the reference's own quantization error), which
    # bounds quality, not bytes: one flipped low bit stays within it by design, and the same
    # family's byte-exact cases catch it
    missed = [(r.case, r.metrics) for r in results if r.passed
              and any(v for k, v in r.metrics.items() if not k.startswith("dequant_rel"))]
    assert not missed, missed
    for r in failed:
        assert not r.error, r.error  # failed by the comparison, not by a crash
