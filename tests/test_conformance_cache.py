"""The paged-cache and fp8 case families of ``mla.conformance`` bite.

The reference passes every case of ``concat_and_cache_mla``, ``gather_cache`` and
``concat_and_cache_fp8_ds_mla`` in every dtype; each broken twin (the reference with one
convention changed) fails every case of the topic that pins that convention, the report names
the convention. No other kernel's case calls them (``test_conformance.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import mla.reference as R  # noqa: N812
from mla.conformance import KERNELS, run
from mla.conformance.cases.paged_cache import WRAP_MINUS_ONE
from mla.reference.fp8 import FP8_DS_MLA_BYTES, quantize_fp8_ds_mla

REFERENCE = {k: getattr(R, k) for k in KERNELS}
MINE = ["concat_and_cache_mla", "gather_cache", "concat_and_cache_fp8_ds_mla"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_reference_passes_every_case(dtype: torch.dtype) -> None:
    report = run(REFERENCE, kernels=MINE, device="cpu", dtype=dtype)
    bad = [(r.case, r.status, r.detail) for r in report.rows if r.status != "pass"]
    assert not bad and len(report.rows) >= 20


# ---- broken twins: concat_and_cache_mla ------------------------------------------------------

def _rows(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    return torch.cat([kv_c, k_pe.reshape(k_pe.shape[0], k_pe.shape[-1])], dim=-1)


def write_wraps_minus_one(kv_c, k_pe, kv_cache, slot_mapping) -> None:
    """Slot -1 indexes the flat cache from its end (no padding check)."""
    kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping.long()] = _rows(kv_c, k_pe)


def write_pe_first(kv_c, k_pe, kv_cache, slot_mapping) -> None:
    """Rows stored as k_pe ‖ kv_c."""
    rows = torch.cat([k_pe.reshape(k_pe.shape[0], k_pe.shape[-1]), kv_c], dim=-1)
    keep = slot_mapping >= 0
    kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping[keep].long()] = rows[keep]


def write_ignores_strides(kv_c, k_pe, kv_cache, slot_mapping) -> None:
    """Reads kv_c and k_pe as if contiguous from where their views start."""
    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(0).set_(x.untyped_storage(), x.storage_offset(), x.shape)
    R.concat_and_cache_mla(flat(kv_c), flat(k_pe), kv_cache, slot_mapping)


# ---- broken twins: gather_cache --------------------------------------------------------------

def _gather_loop(src, dst, block_table, cu_seq_lens, batch_size, starts, extra_rows=None):
    """Row by row through the slot formula; ``extra_rows(b, start, n)`` rows more per chunk."""
    bs, cu = src.shape[1], cu_seq_lens.tolist()
    for b in range(batch_size):
        n = cu[b + 1] - cu[b]
        if not n:
            continue
        n += extra_rows(b, starts[b], n) if extra_rows else 0
        for i in range(min(n, dst.shape[0] - cu[b])):
            pos = starts[b] + i
            dst[cu[b] + i] = src[int(block_table[b, pos // bs]), pos % bs]
    return dst[: cu[-1]]


def _starts(seq_starts, batch_size) -> list[int]:
    return [0] * batch_size if seq_starts is None else seq_starts.tolist()


def gather_ignores_seq_starts(src, dst, block_table, cu_seq_lens, batch_size, seq_starts=None):
    return _gather_loop(src, dst, block_table, cu_seq_lens, batch_size, [0] * batch_size)


def gather_page_aligned_starts(src, dst, block_table, cu_seq_lens, batch_size,
                               seq_starts=None):
    bs = src.shape[1]
    starts = [s // bs * bs for s in _starts(seq_starts, batch_size)]
    return _gather_loop(src, dst, block_table, cu_seq_lens, batch_size, starts)


def gather_zeroes_tail(src, dst, block_table, cu_seq_lens, batch_size, seq_starts=None):
    """Zero-fills the workspace first ("padding rows zeroed")."""
    dst.zero_()
    return R.gather_cache(src, dst, block_table, cu_seq_lens, batch_size, seq_starts)


def gather_past_chunk(src, dst, block_table, cu_seq_lens, batch_size, seq_starts=None):
    """Copies whole pages: each chunk's rows run on to the end of its last page."""
    bs = src.shape[1]
    return _gather_loop(src, dst, block_table, cu_seq_lens, batch_size,
                        _starts(seq_starts, batch_size),
                        lambda b, s, n: -(-(s + n) // bs) * bs - (s + n))


def gather_returns_whole_dst(src, dst, block_table, cu_seq_lens, batch_size, seq_starts=None):
    R.gather_cache(src, dst, block_table, cu_seq_lens, batch_size, seq_starts)
    return dst


# ---- broken twins: concat_and_cache_fp8_ds_mla -----------------------------------------------

def _fp8_writer(transform: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                wrap: bool = False) -> Callable:
    """The reference's write with ``transform(rows, kv_c, k_pe)`` applied to the packed rows
    (``wrap``: slot -1 indexes from the end)."""
    def write(kv_c, k_pe, kv_cache, slot_mapping) -> None:
        k_pe = k_pe.reshape(k_pe.shape[0], k_pe.shape[-1])
        keep = torch.ones_like(slot_mapping, dtype=torch.bool) if wrap else slot_mapping >= 0
        rows = transform(quantize_fp8_ds_mla(kv_c[keep], k_pe[keep]), kv_c[keep], k_pe[keep])
        kv_cache.view(-1, FP8_DS_MLA_BYTES)[slot_mapping[keep].long()] = rows
    return write


def _tiles_reversed(rows, kv_c, k_pe):
    out = rows.clone()
    out[:, :512] = rows[:, :512].reshape(-1, 4, 128).flip(1).reshape(-1, 512)
    return out


def _scales_inverted(rows, kv_c, k_pe):
    out = rows.clone()
    out[:, 512:528] = (1.0 / rows[:, 512:528].contiguous().view(torch.float32)).view(torch.uint8)
    return out


def _rope_float32(rows, kv_c, k_pe):
    out = rows.clone()
    out[:, 528:] = k_pe[:, :32].float().contiguous().view(torch.uint8)
    return out


def fp8_rope_not_written(kv_c, k_pe, kv_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    rows = quantize_fp8_ds_mla(kv_c[keep], k_pe.reshape(k_pe.shape[0], k_pe.shape[-1])[keep])
    kv_cache.view(-1, FP8_DS_MLA_BYTES)[slot_mapping[keep].long(), :528] = rows[:, :528]


def _truncated(rows, kv_c, k_pe):
    """e4m3 codes rounded toward zero: float32 bits cut to 3 mantissa bits (normals), whole
    steps of 2^-9 (subnormals)."""
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    v = (kv_c.float().reshape(-1, 4, 128) / scales[..., None]).reshape(-1, 512)
    cut = (v.view(torch.int32) & ~0xFFFFF).view(torch.float32)
    sub = torch.trunc(v * 512) / 512
    out = rows.clone()
    out[:, :512] = torch.where(v.abs() >= 2.0 ** -6, cut, sub).to(torch.float8_e4m3fn).view(
        torch.uint8)
    return out


# name: (kernel, twin, topic whose every case must fail, words the failing rows' convention
# holds)
TWINS = {
    "write_wraps_minus_one": ("concat_and_cache_mla", write_wraps_minus_one, "padding",
                              WRAP_MINUS_ONE),
    "write_pe_first": ("concat_and_cache_mla", write_pe_first, "shapes",
                       "k_pe written before kv_c"),
    "write_ignores_strides": ("concat_and_cache_mla", write_ignores_strides, "strides",
                              "row strides ignored"),
    "gather_ignores_seq_starts": ("gather_cache", gather_ignores_seq_starts, "seq_starts",
                                  "ignores seq_starts"),
    "gather_page_aligned_starts": ("gather_cache", gather_page_aligned_starts, "seq_starts",
                                   "rounded down to a page"),
    "gather_zeroes_tail": ("gather_cache", gather_zeroes_tail, "dst",
                           "past the filled part zeroed"),
    "gather_past_chunk": ("gather_cache", gather_past_chunk, "dst", "past each chunk's end"),
    "gather_returns_whole_dst": ("gather_cache", gather_returns_whole_dst, "dst",
                                 "returned all of dst"),
    "fp8_tiles_reversed": ("concat_and_cache_fp8_ds_mla", _fp8_writer(_tiles_reversed),
                           "fp8_bytes", "tiles in reverse order (scales in order)"),
    "fp8_scales_inverted": ("concat_and_cache_fp8_ds_mla", _fp8_writer(_scales_inverted),
                            "fp8_bytes", "1/scale"),
    "fp8_rope_float32": ("concat_and_cache_fp8_ds_mla", _fp8_writer(_rope_float32),
                         "fp8_bytes", "k_pe stored as float32"),
    "fp8_rope_not_written": ("concat_and_cache_fp8_ds_mla", fp8_rope_not_written, "fp8_bytes",
                             "k_pe not written"),
    "fp8_wraps_minus_one": ("concat_and_cache_fp8_ds_mla",
                            _fp8_writer(lambda rows, kv_c, k_pe: rows, wrap=True), "padding",
                            WRAP_MINUS_ONE),
    "fp8_truncated": ("concat_and_cache_fp8_ds_mla", _fp8_writer(_truncated), "fp8_dequant",
                      "truncated toward zero"),
}


@pytest.mark.parametrize("name", list(TWINS))
def test_broken_twin_fails_its_topic(name: str) -> None:
    kernel, fn, topic, words = TWINS[name]
    report = run({**REFERENCE, kernel: fn}, kernels=MINE, device="cpu", dtype=torch.float32)
    pinned = [r for r in report.rows if r.kernel == kernel and r.topic == topic]
    assert pinned
    for r in pinned:
        assert r.status == "fail", (r.case, r.status, r.detail)
        assert words in r.convention, (r.case, r.convention, r.detail)
    others = [(r.kernel, r.case, r.status) for r in report.rows
              if r.kernel != kernel and r.status != "pass"]
    assert not others
