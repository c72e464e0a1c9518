"""The vLLM top-k adapter (``mla.conformance.adapters.vllm_topk``) on the CPU: where its peer
cannot run, its rows are "unsupported" with the way to get it; its calls, given stand-ins for
vLLM's two kernels, pass the catalogue's top-k cases and show a stand-in's other convention
as failing cases; the library's unpacking."""

from __future__ import annotations

import lzma
import os
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from mla.conformance.adapters import unpacked, vllm_topk
from mla.conformance.catalogue import Unsupported
from mla.conformance.runner import run
from mla.conformance.targets import load_target

TOPK_CASES = ["k_2048_long_rows", "rows_past_8192", "fewer_keys_than_k",
              "ties_at_the_boundary", "nan_infinities_signed_zeros", "ragged_row_starts"]


def _stand_in(absolute: bool = False, shuffled_ties: bool = False) -> SimpleNamespace:
    """The two kernels in torch: each range's ``topk`` best, ties to the lower column (a
    stable sort; ``shuffled_ties``: to columns in a random order), indices from the range's
    start (``absolute``: from column 0), the rest of ``out`` left as found."""
    def prefill(logits, starts, ends, out, R, s0, s1, topk):
        assert out.dtype == torch.int32 and out.shape == (R, topk)
        assert (s0, s1) == logits.stride()
        for r in range(R):
            a, b = int(starts[r]), int(ends[r])
            if shuffled_ties:
                perm = torch.randperm(b - a, generator=torch.Generator().manual_seed(r))
                order = perm[torch.sort(logits[r, a:b][perm], descending=True,
                                        stable=True).indices]
            else:
                order = torch.sort(logits[r, a:b], descending=True, stable=True).indices
            k = min(topk, b - a)
            out[r, :k] = (order[:k] + (a if absolute else 0)).to(torch.int32)

    def persistent(logits, lengths, out, work, topk, longest):
        assert work.numel() == vllm_topk.WORKSPACE_BYTES and longest == int(lengths.max())
        prefill(logits, torch.zeros_like(lengths), lengths, out, logits.shape[0],
                *logits.stride(), topk)

    return SimpleNamespace(top_k_per_row_prefill=prefill, persistent_topk=persistent)


@pytest.fixture
def no_peers(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLA_PEERS", str(tmp_path / "no_peers"))


def test_on_the_cpu_every_case_is_unsupported(no_peers: None) -> None:
    report = run(load_target("vllm-topk")[1], kernels=["top_k_per_row"], device="cpu")
    assert [r.case for r in report.rows] == TOPK_CASES
    assert all(r.status == "unsupported" and "runs on cuda tensors only" in r.detail
               for r in report.rows)


def test_a_missing_library_says_how_to_get_it(no_peers: None) -> None:
    with pytest.raises(Unsupported, match="not unpacked in .*no_peers.*benchmarks.peers --topk"):
        vllm_topk.load_library()


def test_prefill_call_passes_the_catalogue_with_a_faithful_stand_in() -> None:
    fn = partial(vllm_topk.prefill_indices, _stand_in())
    report = run({"top_k_per_row": fn}, kernels=["top_k_per_row"],
                 device="cpu", dtype=torch.float32)
    assert [r.status for r in report.rows] == ["pass"] * len(TOPK_CASES), report.to_text()


def _prefill_report(**convention: bool):
    """The top-k cases on the prefill call over a stand-in with ``convention``; the report and
    each case's status."""
    fn = partial(vllm_topk.prefill_indices, _stand_in(**convention))
    report = run({"top_k_per_row": fn}, kernels=["top_k_per_row"],
                 device="cpu", dtype=torch.float32)
    return report, {r.case: r.status for r in report.rows}


def test_a_convention_passed_through_fails_its_case_and_is_named() -> None:
    """Indices counted from column 0 fail only the ragged-starts case, which names it."""
    report, status = _prefill_report(absolute=True)
    assert status == {"k_2048_long_rows": "pass", "rows_past_8192": "pass",
                      "fewer_keys_than_k": "pass", "ties_at_the_boundary": "pass",
                      "nan_infinities_signed_zeros": "pass", "ragged_row_starts": "fail"}, status
    bad = next(r for r in report.rows if r.case == "ragged_row_starts")
    assert "not relative to row_starts" in bad.convention, bad.convention


def test_another_tie_rule_fails_the_ties_case_and_is_named() -> None:
    """Tied keys taken in a random order: the two cases with ties at the boundary fail, named
    as the same values with other columns (not as ties toward the higher index)."""
    from mla.conformance.cases.indexer import TIES_HIGH, TIES_OTHER

    report, status = _prefill_report(shuffled_ties=True)
    assert status == {"k_2048_long_rows": "pass", "rows_past_8192": "pass",
                      "fewer_keys_than_k": "pass", "ties_at_the_boundary": "fail",
                      "nan_infinities_signed_zeros": "fail", "ragged_row_starts": "pass"}, status
    for bad in (r for r in report.rows if r.status == "fail"):
        assert TIES_OTHER in bad.convention and TIES_HIGH not in bad.convention, bad.convention


def test_picking_other_values_is_not_called_another_tie_rule() -> None:
    """A set off by one key's value (the boundary's next key instead of a tied one) names no
    convention: the values differ."""
    def off_by_one(logits, starts, ends, out, R, s0, s1, topk):
        _stand_in().top_k_per_row_prefill(logits, starts, ends, out, R, s0, s1, topk)
        for r in range(R):
            a, b = int(starts[r]), int(ends[r])
            if b - a > topk:
                order = torch.sort(logits[r, a:b], descending=True, stable=True).indices
                out[r, topk - 1] = order[-1]  # the row's worst key for its last pick

    fn = partial(vllm_topk.prefill_indices, SimpleNamespace(top_k_per_row_prefill=off_by_one))
    report = run({"top_k_per_row": fn}, kernels=["top_k_per_row"], cases=["k_2048_long_rows"],
                 device="cpu", dtype=torch.float32)
    assert [r.status for r in report.rows] == ["fail"]
    assert not report.rows[0].convention, report.rows[0].convention


def test_persistent_call_and_what_it_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows from column 0 pass through the persistent kernel's call; a row starting elsewhere
    and a topk it does not take are unsupported (checked before any kernel runs)."""
    monkeypatch.setattr(vllm_topk, "_checked", lambda *a: None)
    monkeypatch.setattr(vllm_topk, "_ops", _stand_in)
    report = run({"top_k_per_row": vllm_topk.persistent_top_k_per_row},
                 kernels=["top_k_per_row"], device="cpu", dtype=torch.float32)
    status = {r.case: r.status for r in report.rows}
    assert status == {"k_2048_long_rows": "pass", "rows_past_8192": "pass",
                      "fewer_keys_than_k": "pass", "ties_at_the_boundary": "pass",
                      "nan_infinities_signed_zeros": "pass", "ragged_row_starts": "unsupported"
                      }, status
    x = torch.randn(2, 600)
    st, en = torch.zeros(2, dtype=torch.int32), torch.full((2,), 600, dtype=torch.int32)
    with pytest.raises(Unsupported, match="topk in \\(512, 1024, 2048\\), got 100"):
        vllm_topk.persistent_top_k_per_row(x, st, en, 100)
    got = vllm_topk.persistent_top_k_per_row(x, st, en, 512)
    for r in range(2):
        assert set(got[r].tolist()) == set(torch.topk(x[r], 512).indices.tolist())

def test_the_compressed_library_is_unpacked_once(tmp_path) -> None:
    data = os.urandom(1000) * 3
    xz = tmp_path / "lib.abi3.so.xz"
    xz.write_bytes(lzma.compress(data))
    so = unpacked(xz)
    assert so == tmp_path / "lib.abi3.so" and so.read_bytes() == data
    stamp = so.stat().st_mtime_ns
    assert unpacked(xz) == so and so.stat().st_mtime_ns == stamp
    assert unpacked(so) == so  # a plain library is itself


def test_a_library_that_cannot_be_unpacked_is_unsupported(tmp_path) -> None:
    bad = tmp_path / "broken.abi3.so.xz"
    bad.write_bytes(b"not xz data")
    with pytest.raises(Unsupported, match="cannot unpack"):
        vllm_topk.load_library(bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.abi3.so.xz"]  # no leftover
