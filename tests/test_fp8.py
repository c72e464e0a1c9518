"""The fp8_ds_mla cache format (conventions §10) and the indexer's act_quant, checked byte by byte.

The bytes are decoded here independently of the package: scales and rope values with numpy's
little-endian ``<f4`` / ``<u2``, the e4m3 values with a 256-entry table built from the format's
definition (1 sign bit, 4 exponent bits of bias 7, 3 mantissa bits, subnormals at exponent 0,
``0x7F``/``0xFF`` NaN).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from mla.reference import (
    act_quant,
    concat_and_cache_fp8_ds_mla,
    dequantize_fp8_ds_mla,
    fp8_ds_mla_scales,
    gather_and_upconvert_fp8_ds_mla,
    make_block_table,
    quantize_fp8_ds_mla,
)


def _e4m3(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return float("nan")
    if exp == 0:
        return sign * man * 2.0 ** -9  # subnormal: man/8 · 2^(1-7)
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


E4M3 = np.array([_e4m3(c) for c in range(256)])
FINITE = np.isfinite(E4M3)


def _rows(n: int, seed: int, magnitudes: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0),
          dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of kv_c [n, 512] (tile i scaled by magnitudes[i]) and k_pe [n, 64]."""
    gen = torch.Generator().manual_seed(seed)
    kv_c = torch.randn(n, 4, 128, generator=gen, dtype=torch.float64)
    kv_c = (kv_c * torch.tensor(magnitudes, dtype=torch.float64)[:, None]).flatten(1)
    k_pe = torch.randn(n, 64, generator=gen, dtype=torch.float64)
    return kv_c.to(dtype), k_pe.to(dtype)


def _decode_bytes(packed: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(e4m3 values [n, 512], scales [n, 4], rope [n, 64]) as float64, by numpy alone."""
    raw = packed.reshape(-1, 656).numpy()
    values = E4M3[raw[:, :512]]
    scales = np.frombuffer(raw[:, 512:528].tobytes(), dtype="<f4").reshape(-1, 4)
    rope_bits = np.frombuffer(raw[:, 528:656].tobytes(), dtype="<u2").reshape(-1, 64)
    rope = (rope_bits.astype(np.uint32) << 16).view(np.float32)  # bf16 = top half of fp32
    return values, scales.astype(np.float64), rope.astype(np.float64)


def test_layout_byte_offsets_and_nearest_rounding() -> None:
    kv_c, k_pe = _rows(7, seed=1, magnitudes=(0.01, 1.0, 30.0, 1e3))
    packed = quantize_fp8_ds_mla(kv_c, k_pe)
    assert packed.dtype == torch.uint8 and list(packed.shape) == [7, 656]
    values, scales, rope = _decode_bytes(packed)
    x = kv_c.double().numpy().reshape(7, 4, 128)

    # [512, 528): four float32 inverse scales, the smallest power of two >= max(amax/448, 1e-4)
    for r in range(7):
        for t in range(4):
            amax_over = float(np.float32(np.abs(x[r, t]).max()) / np.float32(448.0))
            want = 2.0 ** math.ceil(math.log2(max(amax_over, 1e-4)))
            assert scales[r, t] == want
    # [0, 512): each byte is an e4m3 value nearest to x / scale (round to nearest)
    v = x / scales[:, :, None]
    got = values.reshape(7, 4, 128)
    dist = np.abs(v[..., None] - E4M3[FINITE][None, None, None, :]).min(axis=-1)
    assert np.all(np.abs(v - got) <= dist)
    # [528, 656): k_pe as bf16, bit for bit
    assert np.array_equal(rope, k_pe.double().numpy())
    assert torch.equal(packed[:, 528:], k_pe.to(torch.bfloat16).view(torch.uint8))


def test_dequantize_matches_the_byte_decoding() -> None:
    kv_c, k_pe = _rows(5, seed=2, magnitudes=(3e-3, 0.2, 5.0, 70.0), dtype=torch.float32)
    packed = quantize_fp8_ds_mla(kv_c, k_pe)
    deq_c, deq_pe = dequantize_fp8_ds_mla(packed)
    assert deq_c.dtype == torch.bfloat16 and deq_pe.dtype == torch.bfloat16
    values, scales, rope = _decode_bytes(packed)
    want = (values.reshape(5, 4, 128) * scales[:, :, None]).reshape(5, 512)
    assert np.array_equal(deq_c.double().numpy(), want)  # exact: e4m3 · 2^k fits bf16
    assert np.array_equal(deq_pe.double().numpy(), rope)
    # FlashMLA's tests hold the same bytes in a float8_e4m3fn tensor
    again = dequantize_fp8_ds_mla(packed.view(torch.float8_e4m3fn))
    assert torch.equal(again[0], deq_c) and torch.equal(again[1], deq_pe)
    # leading dims are kept
    packed3 = quantize_fp8_ds_mla(kv_c.view(1, 5, 512), k_pe.view(1, 5, 64))
    assert torch.equal(packed3.view(5, 656), packed)


@pytest.mark.parametrize("magnitude", [1e-6, 1e-3, 0.05, 1.0, 37.0, 1e4])
def test_round_trip_error_bound_per_magnitude(magnitude: float) -> None:
    """``|x - deq| <= max(2^-4·|x|, 2^-10·scale)``; ``<= 2^-4·|x|`` where x/scale is normal."""
    kv_c, k_pe = _rows(16, seed=3, magnitudes=(magnitude,) * 4, dtype=torch.float32)
    deq_c, deq_pe = dequantize_fp8_ds_mla(quantize_fp8_ds_mla(kv_c, k_pe))
    scale = fp8_ds_mla_scales(kv_c).double().repeat_interleave(128, dim=-1)
    x, err = kv_c.double(), (deq_c.double() - kv_c.double()).abs()
    normal = x.abs() / scale >= 2.0 ** -6
    assert torch.all(err[normal] <= 2.0 ** -4 * x.abs()[normal])
    assert torch.all(err <= torch.maximum(2.0 ** -4 * x.abs(), 2.0 ** -10 * scale))
    # in norm: the same bound summed (2^-4 once every value is normal, more under the floor)
    rel = (err.norm() / x.norm()).item()
    bound = (torch.maximum(2.0 ** -4 * x.abs(), 2.0 ** -10 * scale).norm() / x.norm()).item()
    print(f"magnitude {magnitude:g}: relative Frobenius error {rel:.3e} (bound {bound:.3e}), "
          f"normal fraction {normal.double().mean().item():.3f}")
    assert rel <= bound
    assert torch.equal(deq_pe, k_pe.to(torch.bfloat16))  # rope: only the bf16 rounding


def test_scale_floor_and_subnormals() -> None:
    """Below amax = 448e-4 the scale stays at 2^-13: tiny values go subnormal, then to zero."""
    gen = torch.Generator().manual_seed(4)
    sign = torch.where(torch.rand(128, generator=gen) < 0.5, -1.0, 1.0)
    exps = torch.linspace(-27.0, -5.0, 128)  # 2^-27 .. 2^-5 < 448e-4
    tile = (sign * 2.0 ** exps * (1 + 0.5 * torch.rand(128, generator=gen))).float()
    tile[0] = 2.0 ** -24  # under half the smallest subnormal step: rounds to zero
    kv_c = torch.cat([tile, torch.randn(384, generator=gen)])[None]
    k_pe = torch.randn(1, 64, generator=gen)
    scales = fp8_ds_mla_scales(kv_c)
    assert scales[0, 0].item() == 2.0 ** -13
    deq = dequantize_fp8_ds_mla(quantize_fp8_ds_mla(kv_c, k_pe))[0][0, :128].double()
    x = tile.double()
    err = (deq - x).abs()
    assert torch.all(err <= torch.clamp(2.0 ** -4 * x.abs(), min=2.0 ** -23))
    flushed = x.abs() < 2.0 ** -23
    assert flushed.any() and torch.all(deq[flushed] == 0)
    sub = (x.abs() >= 2.0 ** -23) & (x.abs() < 2.0 ** -19)  # e4m3 subnormals times 2^-13
    assert sub.any() and torch.all(err[sub] <= 2.0 ** -23)


def test_all_zero_tile() -> None:
    kv_c, k_pe = _rows(3, seed=5, dtype=torch.float32)
    kv_c[1, 128:256] = 0.0
    packed = quantize_fp8_ds_mla(kv_c, k_pe)
    assert torch.all(packed[1, 128:256] == 0)
    assert fp8_ds_mla_scales(kv_c)[1, 1].item() == 2.0 ** -13  # the floor
    deq_c, _ = dequantize_fp8_ds_mla(packed)
    assert torch.all(deq_c[1, 128:256] == 0)
    # the other tiles of that row are unaffected by the zero tile
    alone = quantize_fp8_ds_mla(kv_c[1:2], k_pe[1:2])
    assert torch.equal(alone[0], packed[1])
    assert deq_c[1, :128].abs().max() > 0


def test_scales_are_tight_powers_of_two() -> None:
    kv_c, _ = _rows(32, seed=6, magnitudes=(1e-4, 0.3, 8.0, 2e3), dtype=torch.float32)
    scales = fp8_ds_mla_scales(kv_c).double()
    mantissa, _ = torch.frexp(scales)
    assert torch.all(mantissa == 0.5)
    amax = kv_c.double().view(32, 4, 128).abs().amax(-1)
    assert torch.all(amax / scales <= 448)
    above_floor = amax / 448 > 2.0 ** -13
    assert above_floor.any()
    assert torch.all((amax / scales)[above_floor] > 224)  # half the scale would overflow


def test_cache_write_by_slot_mapping_and_gather() -> None:
    block_size = 4
    block_table, num_blocks = make_block_table([7, 5], block_size, spare_blocks=1, seed=3)
    cache = torch.full((num_blocks, block_size, 656), 0xAB, dtype=torch.uint8)
    kv_c, k_pe = _rows(12, seed=7, magnitudes=(0.1, 1.0, 10.0, 100.0), dtype=torch.float32)
    req = torch.tensor([0] * 7 + [1] * 5)
    pos = torch.tensor(list(range(7)) + list(range(5)))
    slots = (block_table.long()[req, pos // block_size] * block_size + pos % block_size)
    slots[3] = -1  # padding: skipped
    concat_and_cache_fp8_ds_mla(kv_c, k_pe[:, None, :], cache, slots)
    flat = cache.view(-1, 656)
    want = quantize_fp8_ds_mla(kv_c, k_pe)
    for t in range(12):
        if t != 3:
            assert torch.equal(flat[slots[t]], want[t])
    written = set(slots[slots >= 0].tolist())
    for s in range(flat.shape[0]):
        if s not in written:
            assert torch.all(flat[s] == 0xAB)

    # gather request 1 (5 rows) and request 0's first 3 rows into a float64 workspace
    dst = torch.full((9, 576), float("nan"), dtype=torch.float64)
    gather_and_upconvert_fp8_ds_mla(cache, dst, block_table, torch.tensor([3, 5]),
                                    torch.tensor([6, 0]), 2)
    deq_c, deq_pe = dequantize_fp8_ds_mla(want)
    rows = torch.cat([deq_c, deq_pe], dim=-1).double()
    assert torch.equal(dst[0:5], rows[7:12])
    assert torch.equal(dst[6:9], rows[0:3])
    assert torch.isnan(dst[5]).all()  # untouched

    # a -1 block-table entry inside request 1's tokens: refused, and dst left as it was
    bad_table = block_table.clone()
    bad_table[1, 1] = -1
    before = dst.clone()
    with pytest.raises(ValueError, match=re.escape("block_table[1] points outside")):
        gather_and_upconvert_fp8_ds_mla(cache, dst, bad_table, torch.tensor([3, 5]),
                                        torch.tensor([6, 0]), 2)
    assert torch.equal(dst.view(torch.int64), before.view(torch.int64))  # bit for bit


def test_bad_input_names_the_argument() -> None:
    kv_c, k_pe = _rows(2, seed=8)
    with pytest.raises(ValueError, match="kv_c"):
        quantize_fp8_ds_mla(kv_c[:, :500], k_pe)
    with pytest.raises(ValueError, match="k_pe"):
        quantize_fp8_ds_mla(kv_c, k_pe[:, :32])
    with pytest.raises(TypeError, match="kv_c"):
        quantize_fp8_ds_mla(kv_c.to(torch.int32), k_pe)
    with pytest.raises(ValueError, match="packed"):
        dequantize_fp8_ds_mla(torch.zeros(2, 576, dtype=torch.uint8))
    with pytest.raises(TypeError, match="packed"):
        dequantize_fp8_ds_mla(torch.zeros(2, 656, dtype=torch.bfloat16))
    cache = torch.zeros(2, 4, 656, dtype=torch.uint8)
    with pytest.raises(ValueError, match="kv_cache"):
        concat_and_cache_fp8_ds_mla(kv_c, k_pe, torch.zeros(2, 4, 576, dtype=torch.uint8),
                                    torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="kv_cache"):
        concat_and_cache_fp8_ds_mla(kv_c, k_pe, torch.zeros(2, 4, 656), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot_mapping"):
        concat_and_cache_fp8_ds_mla(kv_c, k_pe, cache, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="slot_mapping"):
        concat_and_cache_fp8_ds_mla(kv_c, k_pe, cache, torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_act_quant(scale_fmt: str | None) -> None:
    gen = torch.Generator().manual_seed(9)
    magnitudes = torch.tensor([5e-10, 1e-6, 1.0, 3.0, 50.0, 1e3])
    x = torch.randn(6, 256, generator=gen) * magnitudes[:, None]
    y, s = act_quant(x, block_size=128, scale_fmt=scale_fmt)
    assert y.dtype == torch.float8_e4m3fn and list(s.shape) == [6, 2]
    amax = x.double().view(6, 2, 128).abs().amax(-1).clamp_min(1e-4)  # floor on amax itself
    if scale_fmt == "ue8m0":
        assert torch.all(torch.frexp(s.double())[0] == 0.5)
        assert torch.all(amax / s.double() <= 448) and torch.all(amax / s.double() > 224)
    else:
        assert torch.equal(s, (amax.float() / 448.0))
    deq = (y.double().view(6, 2, 128) * s.double()[..., None]).view(6, 256)
    sc = s.double().repeat_interleave(128, dim=-1)
    err = (deq - x.double()).abs()
    assert torch.all(err <= torch.maximum(2.0 ** -4 * x.double().abs(), 2.0 ** -10 * sc))
    # row 0 sits far under the amax floor 1e-4 (scale 2^-22 with ue8m0): x / s < 2^-6, the
    # e4m3 subnormals; row 1 is under the floor too, but 1e-6 / 2^-22 is still normal
    assert torch.all(y.double()[0].abs() < 2.0 ** -6)
    with pytest.raises(ValueError, match="block_size"):
        act_quant(x[:, :100], block_size=128)
    with pytest.raises(ValueError, match="scale_fmt"):
        act_quant(x, scale_fmt="e5m2")
