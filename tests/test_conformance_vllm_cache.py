"""The vLLM cache kernels' adapter (``mla.conformance.adapters.vllm_cache``) on the CPU: where
its peer cannot run, its rows are "unsupported"; its calls, given stand-ins for vLLM's kernels
with their argument conventions (int64 flat slots, ``k_pe [T, R]``, the cache dtype string, the
indexer's block size and scale format, int32 tables), pass the catalogue's cache cases, and a
stand-in that lets a ``-1`` slot wrap fails the cases that name it."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

import mla.reference as ref
from mla.conformance.adapters import vllm_cache
from mla.conformance.cases.paged_cache import WRAP_MINUS_ONE
from mla.conformance.runner import run
from mla.conformance.targets import load_target
from mla.reference.fp8 import concat_and_cache_fp8_ds_mla

KERNELS = ["concat_and_cache_mla", "concat_and_cache_fp8_ds_mla", "indexer_k_quant_and_cache",
           "gather_cache"]


def _stand_in(wrap: bool = False) -> SimpleNamespace:
    """vLLM's three cache kernels in torch (the reference behind vLLM's calling conventions);
    ``wrap``: a ``-1`` slot of the latent write lands on the cache's last row."""
    def concat(kv_c, k_pe, cache, slots, dtype, scale, *skip):
        assert k_pe.dim() == 2 and slots.dtype == torch.int64 and slots.dim() == 1
        assert scale.dtype == torch.float32 and scale.numel() == 1 and skip in ((), (False,))
        if wrap:
            slots = torch.where(slots < 0, cache.shape[0] * cache.shape[1] - 1, slots)
        write = {"auto": ref.concat_and_cache_mla, "fp8_ds_mla": concat_and_cache_fp8_ds_mla}
        write[dtype](kv_c, k_pe, cache, slots)

    def indexer(k, cache, slots, block, fmt):
        assert slots.dtype == torch.int64 and (block, fmt) == (128, "ue8m0")
        ref.indexer_k_quant_and_cache(k, cache, slots)

    def gather(src, dst, table, cu, batch, starts):
        assert table.dtype == cu.dtype == torch.int32
        assert starts is None or starts.dtype == torch.int32
        ref.gather_cache(src, dst, table, cu, batch, starts)

    return SimpleNamespace(concat_and_cache_mla=concat, indexer_k_quant_and_cache=indexer,
                           cp_gather_cache=gather)


def _target(ops: SimpleNamespace) -> dict:
    return {"concat_and_cache_mla": lambda *a: vllm_cache.write_latent(ops, *a, "auto"),
            "concat_and_cache_fp8_ds_mla":
                lambda *a: vllm_cache.write_latent(ops, *a, "fp8_ds_mla"),
            "indexer_k_quant_and_cache": partial(vllm_cache.write_indexer_keys, ops),
            "gather_cache": partial(vllm_cache.gather_latent, ops)}


@pytest.fixture
def no_peers(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLA_PEERS", str(tmp_path / "no_peers"))


def test_on_the_cpu_every_case_is_unsupported(no_peers: None) -> None:
    report = run(load_target("vllm-cache")[1], kernels=KERNELS, device="cpu")
    assert len(report.rows) >= 20
    assert {r.kernel for r in report.rows} == set(KERNELS)
    assert all(r.status == "unsupported" and "runs on cuda tensors only" in r.detail
               for r in report.rows), report.to_text()


def test_calls_pass_the_catalogue_with_a_faithful_stand_in() -> None:
    report = run(_target(_stand_in()), kernels=KERNELS, device="cpu", dtype=torch.float32)
    assert report.rows and all(r.status == "pass" for r in report.rows), report.to_text()


def test_a_wrapping_slot_fails_and_is_named() -> None:
    report = run(_target(_stand_in(wrap=True)), kernels=["concat_and_cache_mla"], device="cpu",
                 dtype=torch.float32)
    failed = [r for r in report.rows if r.status == "fail"]
    assert failed and all(WRAP_MINUS_ONE in r.convention for r in failed), report.to_text()
    assert any(r.status == "pass" for r in report.rows)  # cases without padding slots


def test_an_older_schema_without_skip_scale_gets_six_arguments() -> None:
    seen = []
    op = SimpleNamespace(default=SimpleNamespace(_schema=SimpleNamespace(arguments=[
        SimpleNamespace(name=n) for n in ("kv_c", "k_pe", "kv_cache", "slot_mapping",
                                          "kv_cache_dtype", "scale")])))
    ops = SimpleNamespace(concat_and_cache_mla=lambda *a: seen.append(len(a)))
    ops.concat_and_cache_mla.default = op.default  # type: ignore[attr-defined]
    vllm_cache.write_latent(ops, torch.zeros(2, 4), torch.zeros(2, 1, 2), torch.zeros(1, 2, 6),
                            torch.tensor([0, 1]), "auto")
    assert seen == [6]
