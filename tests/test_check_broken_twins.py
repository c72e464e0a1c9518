"""Broken twins of every check in ``python -m mla.check``: the same cases with each fast kernel
wrapped so that its result is off by 1% (outputs and lse scaled by 1.01; caches and index maps,
whose checks are exact, off by one bit or one row). Every family's check must fail them, while
the unwrapped kernels pass: the budgets are tight enough to catch a 1% bug.

CPU, ``TRITON_INTERPRET=1`` (conftest), the ``quick`` cases in float16. First every kernel
passes its cases unwrapped (``test_the_kernel_passes_its_quick_cases``: the GPU check's own
code, run by CI), then each twin fails them. A kernel's results are computed once a process for
each distinct input (``_memoized``): the unwrapped run and the twins of one kernel read the
same results, and through the interpreter each run of a kernel's cases takes up to half a
minute.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest
import torch
from _interpreter import needs_interpreter

import mla.fast as fast
from mla.check.runner import REGISTRY, Ctx, run_checks  # runner registers every family

CTX = Ctx(device=torch.device("cpu"), dtype=torch.float16, quick=True)
pytestmark = needs_interpreter


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


def _flipped_index_key_bit(f: Callable) -> Callable:
    """The indexer key cache write (``[num_blocks, block_size, 132]`` bytes: per page the
    tokens' 128 e4m3 values, then their float32 scales) with the lowest bit of the first
    written token's first value byte flipped."""
    def g(k, kv_cache, slot_mapping, *args, **kwargs):  # type: ignore[no-untyped-def]
        f(k, kv_cache, slot_mapping, *args, **kwargs)
        slot = int(slot_mapping[slot_mapping >= 0][0])
        bs = kv_cache.shape[1]
        kv_cache.view(kv_cache.shape[0], -1)[slot // bs, (slot % bs) * 128] ^= 1
    return g


def _scaled_dcp_out(f: Callable) -> Callable:
    """``cp_lse_ag_out_rs``: its output (alone, or first with the lse) x 1.01."""
    def g(*args, **kwargs):  # type: ignore[no-untyped-def]
        res = f(*args, **kwargs)
        return (res[0] * 1.01, res[1]) if isinstance(res, tuple) else res * 1.01
    return g


def _index_off_by_one(f: Callable) -> Callable:
    def g(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = f(*args, **kwargs)
        return torch.where(out >= 0, out + 1, out)
    return g


def _scaled_front(f: Callable) -> Callable:
    """``sparse_front``: the absorbed query's input ``q_nope`` x 1.01."""
    def g(*args, **kwargs):  # type: ignore[no-untyped-def]
        front, qk = f(*args, **kwargs)
        return front._replace(q_nope=front.q_nope * 1.01), qk
    return g


def _scaled_index_weights(f: Callable) -> Callable:
    """``sparse_front``: the indexer's head weights x 1.01."""
    def g(*args, **kwargs):  # type: ignore[no-untyped-def]
        front, qk = f(*args, **kwargs)
        return front, qk._replace(weights=qk.weights * 1.01)
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
    "cp_lse_ag_out_rs": {"out": _scaled_dcp_out},
    "indexer_k_quant_and_cache": {"cache": _flipped_index_key_bit},
    "fp8_mqa_logits": {"logits": _scaled_return},
    "fp8_paged_mqa_logits": {"logits": _scaled_return},
    "top_k_per_row": {"index": _index_off_by_one},
    "sparse_front": {"q_nope": _scaled_front, "weights": _scaled_index_weights},
}


# the kernels that return their results (a tuple of tensors) and write nothing they are given:
# their results may be reused for the same inputs
PURE = {"attention_with_lse", "mla_decode_paged", "merge_attn_states", "prefill_attention",
        "chunked_prefill_attention", "sparse_mla_decode", "sparse_mla_prefill"}
_RESULTS: dict[tuple, tuple] = {}


def _digest(x: object) -> object:
    """What identifies an argument: a tensor's dtype, shape, strides and bytes; else its repr."""
    if isinstance(x, torch.Tensor):
        raw = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return (str(x.dtype), tuple(x.shape), x.stride(), hashlib.sha256(raw).hexdigest())
    if isinstance(x, (list, tuple)):
        return tuple(_digest(v) for v in x)
    return repr(x)


def _memoized(name: str, f: Callable) -> Callable:
    """``f`` computed once a process for each distinct input (what it raised, raised again);
    the caller gets copies."""
    def g(*args, **kwargs):  # type: ignore[no-untyped-def]
        key = (name, _digest(args), _digest(sorted(kwargs.items())))
        if key not in _RESULTS:
            try:
                _RESULTS[key] = ("returned", f(*args, **kwargs))
            except Exception as e:  # raised again below, to every caller
                _RESULTS[key] = ("raised", e)
        how, value = _RESULTS[key]
        if how == "raised":
            raise value
        return tuple(t.clone() for t in value)
    return g


def test_every_family_has_a_twin():
    assert set(TWINS) == set(REGISTRY)
    assert PURE <= set(TWINS)


def test_memoized_results_are_the_kernels():
    """The reuse returns what the kernel returns, as copies, for equal inputs only."""
    calls = []

    def kernel(a, scale):
        calls.append(1)
        return a * scale, a.sum()

    g = _memoized("kernel", kernel)
    a = torch.arange(6.0)
    first = g(a, 2.0)
    again = g(a.clone(), 2.0)
    assert len(calls) == 1 and torch.equal(first[0], again[0]) and first[0] is not again[0]
    g(a, 3.0)
    g(a + 1, 2.0)
    assert len(calls) == 3


@pytest.mark.parametrize("kernel", list(TWINS))
def test_the_kernel_passes_its_quick_cases(kernel, monkeypatch):
    """``python -m mla.check``'s quick cases of ``kernel`` pass on the kernel itself (its
    results kept for the twins below, which scale them)."""
    fast_name = REGISTRY[kernel][0]
    real = getattr(fast, fast_name)
    if kernel in PURE:
        monkeypatch.setattr(fast, fast_name, _memoized(kernel, real))
    results = run_checks(CTX, [kernel])
    assert results and {r.kernel for r in results} == {kernel}
    assert all(r.passed for r in results), [(r.case, r.metrics, r.error) for r in results
                                            if not r.passed]


@pytest.mark.parametrize("kernel,label", [(k, lab) for k, t in TWINS.items() for lab in t])
def test_a_one_percent_bug_fails(kernel, label, monkeypatch):
    fast_name = REGISTRY[kernel][0]
    real = getattr(fast, fast_name)
    broken = TWINS[kernel][label](_memoized(kernel, real) if kernel in PURE else real)
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
