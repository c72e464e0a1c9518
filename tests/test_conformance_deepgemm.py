"""The DeepGEMM adapter (``mla.conformance.adapters.deepgemm``) on the CPU: where its peer cannot
run, its rows are "unsupported" with the way to get it; its calls, given stand-ins for
DeepGEMM's functions that keep DeepGEMM's conventions (compressed ragged rows, per-row lengths,
columns past a length left undefined), pass the catalogue's logits cases, and a stand-in with
another convention fails the cases that name it; the package's unpacking."""

from __future__ import annotations

import io
import lzma
import tarfile
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from mla.conformance.adapters import deepgemm, unpacked_tree
from mla.conformance.catalogue import Unsupported
from mla.conformance.runner import run
from mla.conformance.targets import load_target
from mla.reference.indexer_cache import read_indexer_k_cache

RAGGED = ["ragged_requests", "chunk_of_a_long_request", "compressed_rows",
          "compressed_rows_of_one_column", "nan_key_propagates"]
PAGED = ["page_1", "page_16_edges", "page_64_long", "next_n_2_causal", "next_n_4_page_edge",
         "rows_without_keys", "unused_entries_minus_one", "nan_key_propagates"]
UNDEFINED = 1234.5  # what the stand-ins leave where DeepGEMM leaves a value undefined


def _logits(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, w: torch.Tensor,
            scale_k: bool = True) -> torch.Tensor:
    """``[H, 128]`` x keys ``[n, 128]`` -> ``[n]``: k_scale · Σ_h w_h · ReLU(q_h · k)."""
    dots = (q.double() @ codes.double().T).clamp_min(0.0)
    out = (w.double()[:, None] * dots).sum(0)
    return (out * scale.double() if scale_k else out).float()


def _stand_in(scale_k: bool = True) -> SimpleNamespace:
    """DeepGEMM's three functions in torch, with its conventions: ragged rows compressed from
    column 0, paged rows of their own lengths ``[B, next_n]``, the rest undefined
    (``UNDEFINED``); ``scale_k=False``: the key scale left out (another convention)."""
    def ragged(q, kv, w, ks, ke, max_k):
        (q8, q_scale), (codes, scale) = q, kv
        assert q_scale is None and ks.dtype == ke.dtype == torch.int32
        assert max_k >= int((ke - ks).max())
        out = torch.full((q8.shape[0], max_k), UNDEFINED)
        for i in range(q8.shape[0]):
            a, b = int(ks[i]), int(ke[i])
            out[i, :b - a] = _logits(q8[i].float(), codes[a:b].float(), scale[a:b], w[i],
                                     scale_k)
        return out

    def metadata(rows, page, slots):
        assert rows.dim() == 2 and rows.dtype == torch.int32
        return torch.zeros(slots + 1, 2, dtype=torch.int32)

    def paged(q, cache4, w, rows, table, meta, width):
        q8, q_scale = q
        assert q_scale is None and cache4.dim() == 4 and cache4.shape[2] == 1
        B, next_n = q8.shape[:2]
        page = cache4.shape[1]
        cache = cache4.reshape(cache4.shape[0], page, -1)
        out = torch.full((B * next_n, width), UNDEFINED)
        for b in range(B):
            for n in range(next_n):
                L = int(rows[b, n])
                pos = torch.arange(L)
                slots = table[b].long()[pos // page] * page + pos % page
                codes, scale = read_indexer_k_cache(cache, slots)
                out[b * next_n + n, :L] = _logits(q8[b, n].float(), codes.float(), scale,
                                                  w[b * next_n + n], scale_k)
        return out

    return SimpleNamespace(fp8_fp4_mqa_logits=ragged, get_paged_mqa_logits_metadata=metadata,
                           fp8_fp4_paged_mqa_logits=paged)


def _target(dg: SimpleNamespace) -> dict:
    return {"fp8_mqa_logits": partial(deepgemm.ragged_logits, dg),
            "fp8_paged_mqa_logits": lambda *a: deepgemm.paged_logits(dg, *a, num_sms=132)}


@pytest.fixture
def no_peers(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLA_PEERS", str(tmp_path / "no_peers"))


def test_on_the_cpu_every_case_is_unsupported(no_peers: None) -> None:
    report = run(load_target("deepgemm")[1], kernels=["fp8_mqa_logits", "fp8_paged_mqa_logits"],
                 device="cpu")
    assert sorted(r.case for r in report.rows) == sorted(RAGGED + PAGED)
    assert all(r.status == "unsupported" and "runs on cuda tensors only" in r.detail
               for r in report.rows), report.to_text()


def test_a_missing_package_says_how_to_get_it(no_peers: None) -> None:
    with pytest.raises(Unsupported, match="not unpacked in .*no_peers.*peers --deepgemm"):
        deepgemm.load()


def test_calls_pass_the_catalogue_with_a_faithful_stand_in() -> None:
    """The compressed ragged rows back at their columns, the paged rows' own lengths, every
    undefined column cleaned: every logits case passes."""
    report = run(_target(_stand_in()), kernels=["fp8_mqa_logits", "fp8_paged_mqa_logits"],
                 device="cpu", dtype=torch.float32)
    assert [r.status for r in report.rows] == ["pass"] * len(RAGGED + PAGED), report.to_text()


def test_another_convention_fails_and_is_named() -> None:
    """A key scale left out fails every case, each naming that convention."""
    report = run(_target(_stand_in(scale_k=False)),
                 kernels=["fp8_mqa_logits", "fp8_paged_mqa_logits"], device="cpu",
                 dtype=torch.float32)
    assert all(r.status == "fail" for r in report.rows), report.to_text()
    assert all("scale" in r.convention for r in report.rows), [r.convention for r in report.rows]


def test_the_paged_call_gives_each_query_row_its_own_length() -> None:
    """next_n = 3 over lengths 0, 1, 5: rows of max(0, L - 2 + n) keys, n = 0, 1, 2."""
    seen = {}
    dg = _stand_in()
    inner = dg.get_paged_mqa_logits_metadata

    def metadata(rows, page, slots):
        seen["rows"], seen["slots"] = rows.clone(), slots
        return inner(rows, page, slots)

    dg.get_paged_mqa_logits_metadata = metadata
    q = torch.zeros(3, 3, 64, 128, dtype=torch.float8_e4m3fn)
    cache = torch.zeros(4, 16, 132, dtype=torch.uint8)
    table = torch.tensor([[0], [1], [2]], dtype=torch.int32)
    out = deepgemm.paged_logits(dg, q, cache, torch.zeros(9, 64), torch.tensor([0, 1, 5]),
                                table, 7, num_sms=132)
    assert seen["rows"].tolist() == [[0, 0, 0], [0, 0, 1], [3, 4, 5]]
    assert seen["slots"] == 132
    assert out.shape == (9, 7)
    assert torch.equal(torch.isinf(out).sum(1), torch.tensor([7, 7, 7, 7, 7, 6, 4, 3, 2]))
    deepgemm.paged_logits(dg, torch.zeros(1, 4, 64, 128, dtype=torch.float8_e4m3fn), cache,
                          torch.zeros(4, 64), torch.tensor([4]), table[:1], 4, num_sms=132)
    assert seen["slots"] == 66  # next_n = 4: a cluster of two CTAs a slot on sm_90


def test_what_it_does_not_take_is_unsupported() -> None:
    q = torch.zeros(2, 48, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(Unsupported, match="cuda"):
        deepgemm.fp8_mqa_logits(q, (torch.zeros(3, 128), torch.ones(3)), torch.zeros(2, 48),
                                torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32))


def test_the_headers_unpack_once_and_whole(tmp_path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, data in {"cute/a.hpp": b"a" * 100, "deep_gemm/b.cuh": b"b" * 50}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    archive = tmp_path / "include.tar.xz"
    archive.write_bytes(buf.getvalue())
    dest = unpacked_tree(archive)
    assert dest == tmp_path / "include"
    assert (dest / "cute/a.hpp").read_bytes() == b"a" * 100
    assert (dest / "deep_gemm/b.cuh").read_bytes() == b"b" * 50
    stamp = dest.stat().st_mtime_ns
    assert unpacked_tree(archive) == dest and dest.stat().st_mtime_ns == stamp
    bad = tmp_path / "broken.tar.xz"
    bad.write_bytes(lzma.compress(b"not a tar"))
    with pytest.raises(tarfile.TarError):
        unpacked_tree(bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.tar.xz", "include",
                                                          "include.tar.xz"]


def test_pages_and_next_n_it_does_not_take_are_unsupported(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """Checked before DeepGEMM is loaded: pages of 16 keys (its block_kv is 32 or 64) and
    next_n = 3 (not among sm_90's 1, 2, 4)."""
    monkeypatch.setattr(deepgemm, "_checked", lambda *a, **k: None)
    monkeypatch.setattr(deepgemm, "load", lambda: pytest.fail("loaded past a refusal"))
    w, lens, table = torch.zeros(4, 64), torch.tensor([5, 7]), torch.zeros(2, 1, dtype=torch.int32)
    q2 = torch.zeros(2, 2, 64, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(Unsupported, match=r"pages of \(32, 64\) keys, got 16"):
        deepgemm.fp8_paged_mqa_logits(q2, torch.zeros(3, 16, 132, dtype=torch.uint8), w, lens,
                                      table, 8)
    q3 = torch.zeros(2, 3, 64, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(Unsupported, match=r"next_n in \(1, 2, 4\) on sm_90, got 3"):
        deepgemm.fp8_paged_mqa_logits(q3, torch.zeros(3, 64, 132, dtype=torch.uint8),
                                      torch.zeros(6, 64), lens, table, 8)
