"""DeepSeek-V4.1's cache codecs (``mla.reference.fp8_v41``) checked byte by byte.

What must hold: a hand-built MXFP8 record (528 bytes: 512 e4m3, 16 UE8M0) and a hand-built
NVFP4 record (288 bytes: 256 bytes of e2m1 pairs, even dim low, then 32 e4m3 scales) come out
exactly, and their broken twins (the other floor, swapped nibbles, scales before values) do
not; every dequantized value is the nearest grid point (ties hand-built); zeros keep their
sign; NaN and inf come back NaN; bad arguments are refused by name. Byte-exactness against
vLLM's own kernels is ``benchmarks/v41_codecs.py``'s (GPU).
"""

from __future__ import annotations

import pytest
import torch

from mla.reference.fp8_v41 import (
    dequantize_fp8_v41,
    dequantize_nvfp4_v41,
    quantize_fp8_v41,
    quantize_nvfp4_v41,
)

F64 = torch.float64
NAN, INF = float("nan"), float("inf")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _rows(t: int, seed: int) -> torch.Tensor:
    """Rows whose blocks of 16 have sizes 2^-30 .. 2^20 (floors included), as float32."""
    gain = 2.0 ** torch.randint(-30, 21, (t, 32, 1), generator=torch.Generator().manual_seed(
        seed))
    return (_randn(t, 32, 16, seed=seed + 1) * gain).flatten(-2).float()


# ---- MXFP8 ---------------------------------------------------------------------------------------

def _fp8_hand_built() -> tuple[torch.Tensor, torch.Tensor]:
    """Token 0: block b all 2^(b-4), its first value negated: amax 2^(b-4), e = ceil(log2(
    2^(b-4)/448)) = b - 12, values ±256 (e4m3 0x78 / 0xF8), scale byte 115 + b. Token 1: zeros
    (the floor: e = ceil(log2(1e-4/448)) = -22, byte 105) but for -0 at dim 5 (0x80)."""
    k = torch.zeros(2, 512)
    k[0] = (2.0 ** (torch.arange(16.0) - 4)).repeat_interleave(32)
    k[0, ::32] *= -1
    k[1, 5] = -0.0
    want = torch.zeros(2, 528, dtype=torch.uint8)
    want[0, :512] = 0x78
    want[0, :512:32] = 0xF8
    want[0, 512:] = torch.arange(115, 131, dtype=torch.uint8)
    want[1, 5] = 0x80
    want[1, 512:] = 105
    return k, want


def test_fp8_hand_built_record() -> None:
    k, want = _fp8_hand_built()
    got = quantize_fp8_v41(k)
    assert got.dtype == torch.uint8 and list(got.shape) == [2, 528]
    assert torch.equal(got, want)
    # FlashMLA's floor puts the zero token's scale at 2^-13 (byte 114), nothing else changes
    other = quantize_fp8_v41(k, scale_floor="flashmla")
    assert torch.equal(other[0], want[0]) and (other[1, 512:] == 114).all()
    deq = dequantize_fp8_v41(got, dtype=F64)
    assert torch.equal(deq, k.double()) and torch.signbit(deq[1, 5])


@pytest.mark.parametrize("twin", ["scale floor", "scales first", "blocks reversed"])
def test_fp8_hand_built_twins_fail(twin: str) -> None:
    k, want = _fp8_hand_built()
    floor = "flashmla" if twin == "scale floor" else "vllm"
    got = quantize_fp8_v41(k, scale_floor=floor)
    if twin == "scales first":
        got = torch.cat([got[:, 512:], got[:, :512]], dim=-1)
    if twin == "blocks reversed":
        got = torch.cat([got[:, :512].view(2, 16, 32).flip(1).flatten(1), got[:, 512:].flip(1)],
                        dim=-1)
    assert not torch.equal(got, want)


def test_fp8_round_trip_is_nearest() -> None:
    """With ``s = 2^(byte-127)``: ``deq / s`` is an e4m3 number within half an e4m3 ulp of
    ``x / s`` (``2^(max(floor(log2|v|), -6) - 4)``, the spacing 2^(E-3) of [2^E, 2^(E+1)),
    subnormals below 2^-6 spaced 2^-9), and ``s`` is the least power of two >= max(amax,
    1e-4)/448 (so ``|x/s| <= 448``). Together: round to nearest, no slack for a 1% bug (a
    scale off by 1% takes ``deq / s`` off the e4m3 grid)."""
    x = _rows(64, seed=1)
    rec = quantize_fp8_v41(x)
    deq = dequantize_fp8_v41(rec, dtype=F64)
    s = (2.0 ** (rec[:, 512:].double() - 127)).repeat_interleave(32, dim=-1)
    v, q = x.double() / s, deq / s
    assert torch.equal(q.float().to(torch.float8_e4m3fn).double(), q)  # on the grid
    half_ulp = 2.0 ** (torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -6))) - 4)
    assert torch.all((v - q).abs() <= half_ulp)
    amax = x.double().view(64, 16, 32).abs().amax(-1).clamp_min(1e-4)
    scale = 2.0 ** (rec[:, 512:].double() - 127)
    assert torch.all(scale >= amax / 448 * (1 - 2 ** -23)) and torch.all(scale / 2 < amax / 448)
    assert torch.equal(deq.to(torch.bfloat16).double(), deq)  # bf16 numbers exactly
    rel = ((deq - x.double()).norm() / x.double().norm()).item()
    assert 0 < rel <= 2.0 ** -4


def test_fp8_ties_go_to_even() -> None:
    """Block peak 448·2^-3 (e = -3) and midpoints between e4m3 neighbours: the even code."""
    codes = torch.arange(0, 0x7E)
    e4m3 = codes.to(torch.uint8).view(torch.float8_e4m3fn).double()
    mid = (e4m3[:-1] + e4m3[1:]) / 2  # between code c and c + 1
    x = torch.zeros(4, 512, dtype=F64)
    x.view(-1)[:mid.numel()] = mid
    x.view(4, 16, 32)[:, :, 0] = 448.0
    rec = quantize_fp8_v41(x * 2.0 ** -3)
    got = rec[:, :512].reshape(-1)[:mid.numel()].long()
    c = codes[:-1]
    keep = torch.arange(mid.numel()) % 32 != 0  # not the peaks
    assert torch.equal(got[keep], torch.where(c % 2 == 0, c, c + 1)[keep])


def test_fp8_nan_and_inf() -> None:
    """A NaN: its own value NaN (0x7F), the block scaled by the rest; an inf: scale byte 255,
    the whole block NaN on dequantizing (the kernels write 0x7E, +448, for both)."""
    x = _rows(2, seed=3)
    x[0, 40] = NAN  # block 1
    x[0, 96:128] = NAN  # block 3 all NaN: the floor
    x[1, 300] = -INF  # block 9
    rec = quantize_fp8_v41(x)
    assert rec[0, 40] == 0x7F and (rec[0, 96:128] == 0x7F).all() and rec[0, 512 + 3] == 105
    assert rec[1, 512 + 9] == 255 and rec[1, 300] == 0x7F
    clean = x.clone()
    clean[0, 40] = 0.0
    assert torch.equal(rec[0, 512 + 1], quantize_fp8_v41(clean)[0, 512 + 1])
    nan = torch.isnan(dequantize_fp8_v41(rec))
    want = torch.zeros_like(nan)
    want[0, 40] = True
    want[0, 96:128] = True
    want[1, 288:320] = True
    assert torch.equal(nan, want)


# ---- NVFP4 ---------------------------------------------------------------------------------------

# one block of 16, in units of its scale, and the codes RNE/satfinite gives them
NVFP4_UNITS = (6.0, -1.0, 0.5, 1.5, 3.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.5, 4.0,
               2.0)
NVFP4_CODES = (7, 0xA, 1, 3, 5, 8, 0, 2, 2, 4, 4, 6, 6, 0xF, 6, 4)


def _fp4_hand_built() -> tuple[torch.Tensor, torch.Tensor]:
    """Block j: NVFP4_UNITS times sc = 2^(j % 8 - 3) (amax 6·sc, so the scale is sc: e4m3
    byte (j % 8 + 4) << 3); codes in pairs, the even dim's low."""
    sc = 2.0 ** (torch.arange(32) % 8 - 3.0)
    k = (torch.tensor(NVFP4_UNITS)[None, :] * sc[:, None]).flatten()[None]
    codes = torch.tensor(NVFP4_CODES, dtype=torch.uint8).repeat(32)
    want = torch.cat([codes[0::2] | (codes[1::2] << 4),
                      ((torch.arange(32) % 8 + 4) << 3).to(torch.uint8)])[None]
    return k, want


def test_nvfp4_hand_built_record() -> None:
    k, want = _fp4_hand_built()
    got = quantize_nvfp4_v41(k)
    assert got.dtype == torch.uint8 and list(got.shape) == [1, 288]
    assert got[0, 0] == 0xA7 and got[0, 2] == 0x85  # (6, -1), (3, -0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("twin", ["nibbles swapped", "scales first", "no -0"])
def test_nvfp4_hand_built_twins_fail(twin: str) -> None:
    k, want = _fp4_hand_built()
    got = quantize_nvfp4_v41(k)
    if twin == "nibbles swapped":
        got = torch.cat([(got[:, :256] >> 4) | (got[:, :256] << 4), got[:, 256:]], dim=-1)
    if twin == "scales first":
        got = torch.cat([got[:, 256:], got[:, :256]], dim=-1)
    if twin == "no -0":
        got = quantize_nvfp4_v41(k + 0.0)  # -0 + 0 = +0: code 0 instead of 8
    assert not torch.equal(got, want)


def test_nvfp4_round_trip_is_nearest() -> None:
    """``sc = e4m3(clamp(fl32(amax · fl32(1/6)), 2^-9, 448))``; ``deq / sc`` an e2m1 value
    within half its step of ``x / sc`` (0.25 below 2, 0.5 in [2, 4), 1 in [4, 6]), or ±6 when
    ``|x / sc| > 6`` (the scale rounded down)."""
    x = _rows(64, seed=5)
    rec = quantize_nvfp4_v41(x)
    deq = dequantize_nvfp4_v41(rec, dtype=F64)
    amax = x.view(64, 32, 16).abs().amax(-1)
    sc = (amax * torch.tensor(1 / 6, dtype=torch.float32)).clamp(2.0 ** -9, 448.0).to(
        torch.float8_e4m3fn)
    assert torch.equal(rec[:, 256:], sc.view(torch.uint8))
    s = sc.double().repeat_interleave(16, dim=-1)
    v, q = x.double() / s, deq / s
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=F64)
    assert torch.isin(q.abs(), grid).all()
    half_step = torch.where(v.abs() < 2, 0.25, torch.where(v.abs() < 4, 0.5, 1.0))
    ok = ((v - q).abs() <= half_step) | ((v.abs() > 6) & (q.abs() == 6) & (q * v > 0))
    assert ok.all()
    # blocks with a normal scale and no saturation (amax in [6 · 2^-6, 6 · 448]): relative
    # error at most 1/4 (half a step of 2 at 4) per value
    fit = ((amax >= 6 * 2.0 ** -6) & (amax <= 6 * 448.0)).repeat_interleave(16, dim=-1)
    err = (deq - x.double())[fit]
    rel = (err.norm() / x.double()[fit].norm()).item()
    assert fit.sum() > 1000 and 0 < rel <= 0.25


def test_nvfp4_floor_and_zeros() -> None:
    """An all-zero block: scale 2^-9 (e4m3 0x01), codes 0; an all -0 block: codes 8; amax at
    6 · 2^-9 and below keeps the floor scale."""
    x = torch.zeros(1, 512)
    x[0, 16:32] = -0.0
    x[0, 32] = 6 * 2.0 ** -9
    x[0, 48] = 1e-6
    rec = quantize_nvfp4_v41(x)
    assert (rec[0, 256:260] == 0x01).all()
    assert (rec[0, 0:8] == 0).all() and (rec[0, 8:16] == 0x88).all()
    assert rec[0, 16] == 0x07 and rec[0, 24] == 0x00  # 6 · 2^-9 -> code 7; 1e-6 -> 0
    deq = dequantize_nvfp4_v41(rec, dtype=F64)
    assert torch.signbit(deq[0, 16:32]).all() and not torch.signbit(deq[0, :16]).any()


def test_nvfp4_nan_and_inf() -> None:
    x = _rows(2, seed=7)
    x[0, 20] = NAN  # block 1
    x[1, 500] = INF  # block 31
    rec = quantize_nvfp4_v41(x)
    assert rec[0, 256 + 1] == 0x7F and rec[1, 256 + 31] == 0x7F
    nan = torch.isnan(dequantize_nvfp4_v41(rec))
    want = torch.zeros_like(nan)
    want[0, 16:32] = True
    want[1, 496:512] = True
    assert torch.equal(nan, want)


# ---- both ------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [[0, 512], [1, 512], [3, 7, 512], [512]])
def test_shapes_and_input_dtypes(shape: list[int]) -> None:
    x = _randn(*shape, seed=9).to(torch.bfloat16)
    for quant, deq, width in ((quantize_fp8_v41, dequantize_fp8_v41, 528),
                              (quantize_nvfp4_v41, dequantize_nvfp4_v41, 288)):
        rec = quant(x)
        assert list(rec.shape) == [*shape[:-1], width]
        for dt in (torch.float32, torch.float64, torch.float16):
            assert torch.equal(quant(x.to(dt)), rec)  # the same numbers, the same bytes
        out = deq(rec)
        assert out.dtype == torch.bfloat16 and list(out.shape) == shape
        assert torch.equal(deq(rec.view(torch.float8_e4m3fn)), out)
        assert deq(rec, dtype=torch.float32).dtype == torch.float32


def test_float64_input_is_rounded_to_float32() -> None:
    x = _randn(2, 512, seed=11)
    assert torch.equal(quantize_fp8_v41(x), quantize_fp8_v41(x.float()))
    assert torch.equal(quantize_nvfp4_v41(x), quantize_nvfp4_v41(x.float()))


def test_bad_input() -> None:
    for quant in (quantize_fp8_v41, quantize_nvfp4_v41):
        with pytest.raises(ValueError, match="k must have shape"):
            quant(torch.zeros(2, 576))
        with pytest.raises(TypeError, match="k must have dtype"):
            quant(torch.zeros(2, 512, dtype=torch.int32))
        with pytest.raises(TypeError, match="k must be a torch.Tensor"):
            quant([0.0] * 512)
    with pytest.raises(ValueError, match="scale_floor"):
        quantize_fp8_v41(torch.zeros(1, 512), scale_floor="amax/448")
    with pytest.raises(ValueError, match=r"records must have shape \[\.\.\., 528\]"):
        dequantize_fp8_v41(torch.zeros(2, 584, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"records must have shape \[\.\.\., 288\]"):
        dequantize_nvfp4_v41(torch.zeros(2, 528, dtype=torch.uint8))
    with pytest.raises(TypeError, match="records must have dtype"):
        dequantize_fp8_v41(torch.zeros(2, 528))
    with pytest.raises(TypeError, match="dtype must be"):
        dequantize_nvfp4_v41(torch.zeros(2, 288, dtype=torch.uint8), dtype=torch.int8)


# ---- conformance cases --------------------------------------------------------------------

def _run_cases(fns: dict) -> dict[str, str]:
    from mla.conformance.cases.v41_codecs import CASES, v41_case
    from mla.conformance.catalogue import Setting
    from mla.conformance.runner import run_case

    setting = Setting(torch.device("cpu"), torch.float32, seed=0, small=True)
    return {f"{c[0]}/{c[1]}": run_case(fns.get(c[0]), v41_case(*c), setting).status
            for c in CASES}


REFERENCE_FNS = {"quantize_fp8_v41": quantize_fp8_v41, "dequantize_fp8_v41": dequantize_fp8_v41,
                 "quantize_nvfp4_v41": quantize_nvfp4_v41,
                 "dequantize_nvfp4_v41": dequantize_nvfp4_v41}


def test_conformance_cases_pass_on_the_reference() -> None:
    from mla.conformance.cases import v41_codecs

    status = _run_cases(REFERENCE_FNS)
    assert len(status) == 14 and set(status.values()) == {"pass"}, status
    if v41_codecs.registered():  # the catalogue knows the names: the cases are in it
        from mla.conformance import CATALOGUE
        assert set(status) <= set(CATALOGUE)


def _nibbles_swapped(k: torch.Tensor) -> torch.Tensor:
    rec = quantize_nvfp4_v41(k)
    return torch.cat([(rec[..., :256] >> 4) | (rec[..., :256] << 4), rec[..., 256:]], dim=-1)


def _nan_as_448(k: torch.Tensor) -> torch.Tensor:
    """What vLLM's kernels write for a NaN: +448 (0x7E)."""
    rec = quantize_fp8_v41(k)
    rec[..., :512] = torch.where(rec[..., :512] == 0x7F, 0x7E, rec[..., :512])
    return rec


@pytest.mark.parametrize("kernel, twin, failing", [
    ("quantize_fp8_v41", lambda k: quantize_fp8_v41(k, scale_floor="flashmla"),
     {"random", "floors", "zeros", "nonfinite"}),  # blocks with amax < 0.0448
    ("quantize_fp8_v41", _nan_as_448, {"nonfinite"}),
    ("quantize_nvfp4_v41", _nibbles_swapped, {"random", "floors", "ties", "zeros", "nonfinite"}),
    ("dequantize_fp8_v41", lambda r: dequantize_fp8_v41(r).nan_to_num(), {"nonfinite"}),
])
def test_conformance_broken_twins_fail(kernel: str, twin, failing: set[str]) -> None:
    status = _run_cases({**REFERENCE_FNS, kernel: twin})
    failed = {key.split("/")[1] for key, s in status.items()
              if s != "pass" and key.startswith(kernel + "/")}
    assert failed == failing, status
    assert all(s == "pass" for key, s in status.items() if not key.startswith(kernel + "/"))
