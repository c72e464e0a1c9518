"""Targets by name: what ``mla conform --target TARGET`` runs.

    mla.fast          this package's Triton kernels (needs triton; on the CPU, its interpreter),
                      run with their value checks on; DeepSeek-V4's layer kernels through
                      mla.conformance.adapters.fast_v4 (mla.fast.v4's functions, whose
                      signatures differ from the catalogue's)
    mla.fast-batch-invariant  its two decodes with batch_invariant=True: each request's keys cut
                      into splits of a fixed length whatever the batch (the sparse decode's
                      BI_SPLIT_ENTRIES = 512 entries, mla.fast.sparse.plan; the dense
                      decode's bi_split_keys, mla.fast.decode.plan), merged in split order
    reference         mla.reference itself (passes every case by construction)
    flashmla          FlashMLA, vLLM's Triton and CUDA kernels, DeepGEMM, FlashInfer: the
    vllm-triton       adapters of mla.conformance.adapters (their peers are imported when a
    vllm-topk         case runs; missing ones make the rows "unsupported")
    vllm-cache
    vllm-v4
    deepgemm
    flashinfer
    flashmla-batch-invariant  FlashMLA's two decodes with enable_batch_invariant=True
    pkg.module        a module whose attributes named like mla.reference's kernels are the kernels
    pkg.module:attr   a mapping or object holding kernels, or one function: the kernel named in
                      ``kernels`` (exactly one), else the kernel its ``__name__`` names

A user's module is found as ``python -m`` finds it: from the working directory first, then
``sys.path`` (the ``mla`` console script, unlike ``python -m mla``, does not put the working
directory on ``sys.path``; it is put first for the import of the target's module only).
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import sys
from collections.abc import Callable, Mapping

from mla.conformance.catalogue import KERNELS
from mla.conformance.runner import kernels_of

__all__ = ["TARGETS", "load_target"]

TARGETS = {
    "mla.fast": "this package's Triton kernels (mla.fast, DeepSeek-V4's through "
                "mla.conformance.adapters.fast_v4; on the CPU under Triton's interpreter), "
                "value checks on",
    "mla.fast-batch-invariant": "mla.fast's mla_decode_paged and sparse_mla_decode with "
                                "batch_invariant=True (fixed-length key splits, whatever the "
                                "batch), value checks on",
    "reference": "mla.reference, the float64 oracle itself (passes every case)",
    "flashmla": "FlashMLA from vLLM 0.33.0's wheel: dense and sparse decode, sparse prefill",
    "flashmla-batch-invariant": "FlashMLA's dense and sparse decode with "
                                "enable_batch_invariant=True",
    "vllm-triton": "vLLM 0.33.0's Triton MLA decode, merge_attn_states and DCP correction",
    "vllm-topk": "vLLM 0.33.0's CUDA top_k_per_row_prefill (the indexer's top-k over row "
                 "ranges)",
    "vllm-cache": "vLLM 0.33.0's CUDA cache kernels: concat_and_cache_mla (bf16, fp8_ds_mla), "
                  "indexer_k_quant_and_cache, cp_gather_cache",
    "vllm-v4": "vLLM 0.33.0's DeepSeek-V4 Triton kernels: the compressor (state save, then "
               "compress, norm, RoPE, quantize and store; d = 512 and 128), the indexer's q "
               "and the scopes' indices (the window's and compressed entries' slots, the "
               "prefill's combined workspace indices)",
    "deepgemm": "DeepGEMM 2.8.1 from vLLM 0.33.0's wheel: the indexer's fp8_mqa_logits and "
                "fp8_paged_mqa_logits",
    "flashinfer": "FlashInfer's BatchMLAPagedAttentionWrapper (paged decode), if importable",
}

_ADAPTERS = {"flashmla": "flashmla", "vllm-triton": "vllm_triton", "vllm-topk": "vllm_topk",
             "vllm-cache": "vllm_cache", "vllm-v4": "vllm_v4", "deepgemm": "deepgemm",
             "flashinfer": "flashinfer"}
_DECODES = ("mla_decode_paged", "sparse_mla_decode")  # what the batch-invariant modes change
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
_EXPECTED = (f"expected one of {sorted(TARGETS)}, a module 'pkg.module' or "
             "'pkg.module:attr'")


def _import(spec: str, module: str, from_cwd: bool = False) -> object:
    """``import module``; with ``from_cwd``, the working directory first on ``sys.path`` for
    this import only (where it is not on it already: ``python -m`` puts it there, a console
    script does not)."""
    cwd = os.getcwd()
    added = from_cwd and not any(isinstance(p, str) and os.path.abspath(p or os.curdir) == cwd
                                 for p in sys.path)
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        where = f", searched from the working directory {cwd} and sys.path" if from_cwd else ""
        raise ValueError(f"target {spec!r}: cannot import {module!r} ({e}{where}); "
                         f"{_EXPECTED}") from e
    finally:
        if added:
            for i, p in enumerate(sys.path):  # the entry added, wherever the import moved it
                if p is cwd:
                    del sys.path[i]
                    break


def _named(spec: str) -> object:
    if spec == "reference":
        return _import(spec, "mla.reference")
    if spec == "mla.fast":
        fast = _import(spec, "mla.fast")
        v4 = _import(spec, "mla.conformance.adapters.fast_v4")
        kernels = {k: getattr(fast, k) for k in KERNELS if callable(getattr(fast, k, None))}
        return _validating(fast, {**kernels, **v4.target()})  # type: ignore[attr-defined]
    if spec == "mla.fast-batch-invariant":
        fast = _import(spec, "mla.fast")
        on = _validating(fast, {k: getattr(fast, k) for k in _DECODES})
        return {k: functools.partial(on[k], batch_invariant=True) for k in _DECODES}
    if spec == "flashmla-batch-invariant":
        adapter = _import(spec, "mla.conformance.adapters.flashmla")
        return adapter.target(batch_invariant=True)  # type: ignore[attr-defined]
    adapter = _import(spec, f"mla.conformance.adapters.{_ADAPTERS[spec]}")
    return adapter.target()  # type: ignore[attr-defined]


def _validating(fast: object, kernels: dict[str, Callable]) -> dict[str, Callable]:
    """mla.fast's ``kernels``, each run with its value checks on: the catalogue holds a kernel
    to the reference's contract, which refuses invalid input (its "refused" cases), and
    mla.fast checks values only when asked (off by default: a check reads the device on the
    host)."""
    def on(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: object, **kwargs: object) -> object:
            with fast.validation(True):  # type: ignore[attr-defined]
                return fn(*args, **kwargs)
        return call
    return {k: on(fn) for k, fn in kernels.items()}


def _from_function(spec: str, fn: Callable, kernels: list[str] | None) -> dict[str, Callable]:
    if kernels:
        if len(kernels) != 1:
            raise ValueError(f"target {spec!r} is one function: give the one kernel it "
                             f"implements with kernels, got {kernels}")
        return {kernels[0]: fn}
    name = getattr(fn, "__name__", "")
    if name not in KERNELS:
        raise ValueError(f"target {spec!r} is a function named {name!r}, not a kernel name; "
                         f"name the kernel it implements (--kernels K, one of {list(KERNELS)})")
    return {name: fn}


def load_target(spec: str, kernels: list[str] | None = None) -> tuple[str, object]:
    """``(name, target)`` for ``spec`` (see the module doc); ``kernels`` narrows a run and
    names the kernel a single function implements.

    ``ValueError`` for a malformed or unknown spec, a module or attribute that cannot be
    found, or a target that holds none of the kernels; ``TypeError`` for a non-string spec or
    an attribute that is neither a mapping, an object with kernels nor a function."""
    if not isinstance(spec, str):
        raise TypeError(f"target must be a str, got {type(spec).__name__}")
    if kernels is not None:
        unknown = sorted(set(kernels) - set(KERNELS))
        if unknown:
            raise ValueError(f"unknown kernels {unknown}; known: {list(KERNELS)}")
    if spec in TARGETS:
        return spec, _named(spec)
    module, sep, attr = spec.partition(":")
    if not _DOTTED.match(module) or (sep and not _DOTTED.match(attr)):
        raise ValueError(f"target {spec!r} is not a name; {_EXPECTED}")
    obj = _import(spec, module, from_cwd=True)
    if sep:
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise ValueError(f"target {spec!r}: {module!r} has no attribute {attr!r}")
            obj = getattr(obj, part)
        if (not isinstance(obj, Mapping) and callable(obj)
                and not any(callable(getattr(obj, k, None)) for k in KERNELS)):
            obj = _from_function(spec, obj, kernels)
        elif not isinstance(obj, Mapping) and not hasattr(obj, "__dict__"):
            raise TypeError(f"target {spec!r} is a {type(obj).__name__}; expected a mapping of "
                            "kernels, an object or module with kernel attributes, or a function")
    try:
        found = kernels_of(obj)
    except (ValueError, TypeError) as e:
        raise type(e)(f"target {spec!r}: {e}") from e
    if not found:
        raise ValueError(f"target {spec!r} holds none of the kernels {list(KERNELS)}")
    return spec, obj
