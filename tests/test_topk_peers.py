"""The parts of the top-k peer benchmark that decide what it reports, on the CPU: the check
that accepts a peer's answer (``benchmarks.topk_peers.check``) and the trimming of vLLM's
library to one GPU's cubins (``benchmarks.peers.keep_one_arch``, ``elf_section``); and the
``--plan`` option of the routes benchmark (``benchmarks.topk_routes``)."""

from __future__ import annotations

import struct
import sys

import pytest
import torch

from benchmarks.peers import FATBIN_MAGIC, elf_section, keep_one_arch
from benchmarks.topk_peers import check


def _answer(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    vals, idx = torch.topk(x, k, dim=1)
    return idx.to(torch.int32), vals


def test_check_accepts_any_correct_top_k_and_names_each_fault():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 500, generator=g)
    x[1, 10:20] = 5.0  # ten tied keys at the top: any 4 of them are a correct top-4
    idx, best = _answer(x, 4)
    assert check(x, idx, best) is None
    other = idx.clone()
    other[1] = torch.tensor([19, 12, 15, 10])  # other tied columns, the same values
    assert check(x, other, best) is None
    assert check(x, idx.flip(1), best) is None  # the order does not matter
    bad = idx.clone()
    bad[0, 0] = 500
    assert "outside [0, 500)" in check(x, bad, best)
    bad = idx.clone()
    bad[2, 1] = bad[2, 0]
    assert "repeated" in check(x, bad, best)
    bad = idx.clone()
    worst = int(x[2].argmin())
    bad[2, 3] = worst  # a column that is no top-4 key
    assert check(x, bad, best) == "1 of 3 rows pick other values than torch.topk"
    bad = idx.clone()
    bad[0, 0] = -1  # a -1 where a full row has k keys
    assert "outside" in check(x, bad, best)


def _fatbin(entries: list[tuple[int, int, bytes]]) -> bytes:
    """A fat binary: its header, then per (kind, sm, payload) a 64-byte entry header."""
    body = b""
    for kind, sm, payload in entries:
        head = bytearray(64)
        struct.pack_into("<HHIQ", head, 0, kind, 0x0101, 64, len(payload))
        struct.pack_into("<I", head, 28, sm)
        body += bytes(head) + payload
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def test_keep_one_arch_zeroes_the_other_cubins_only():
    entries = [(2, 80, b"A" * 40), (2, 90, b"B" * 24), (1, 80, b"ptx80"), (2, 100, b"C" * 8),
               (1, 90, b"ptx90")]
    blob = bytearray(b"\0" * 8 + _fatbin(entries[:3]) + _fatbin(entries[3:]) + b"\0" * 16)
    before = bytes(blob)
    assert keep_one_arch(blob, 0, len(blob), 90) == 48
    assert len(blob) == len(before)
    assert blob.count(b"A") == 0 and blob.count(b"C") == 0
    assert b"B" * 24 in blob and b"ptx80" in blob and b"ptx90" in blob
    changed = [i for i in range(len(blob)) if blob[i] != before[i]]
    assert len(changed) == 48  # the two payloads, nothing else (headers kept)


def test_elf_section_finds_a_section_of_a_real_file():
    data = open(sys.executable, "rb").read()
    if data[:4] != b"\x7fELF":
        pytest.skip("the interpreter is not an ELF file here")
    text = elf_section(data, ".text")
    assert text is not None and 0 < text[0] < len(data) and text[1] > 0
    assert elf_section(data, ".nv_fatbin") is None
    with pytest.raises(ValueError, match="ELF64"):
        elf_section(b"not an elf file at all", ".text")


def test_topk_routes_plan_option_types_each_field_and_names_unknown_ones():
    from benchmarks.topk_routes import _plan
    from mla.fast.topk import TopkPlan

    name, plan = _plan("w16=route=one,fused_warps=16,fused_part_lists=false,oversample=1.2")
    assert name == "w16" and plan == TopkPlan(route="one", fused_warps=16,
                                              fused_part_lists=False, oversample=1.2)
    assert _plan("same=") == ("same", TopkPlan())
    with pytest.raises(SystemExit, match="no field 'warps'"):
        _plan("bad=warps=16")
    with pytest.raises(ValueError, match="power of two"):
        _plan("bad=fused_warps=12")
