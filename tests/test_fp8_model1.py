"""DeepSeek-V4's MODEL1 fp8 cache (conventions §14): ``quantize_fp8_model1`` and
``dequantize_fp8_model1`` checked byte by byte.

What must hold: the page holds ``block_size`` data rows (448 e4m3 bytes, 64 bf16 rope values),
then ``block_size`` scale rows (7 UE8M0 bytes and one unused), padded to a multiple of 576
bytes (a hand-built page, and its broken twins fail); the bytes equal FlashMLA's
``quantize_k_cache`` as its ``tests/quant.py`` describes it; the round trip is within the
derived bound; NaN and inf tiles come back NaN; the kernel's strided view and its inverse.
"""

from __future__ import annotations

import pytest
import torch

from mla.reference import (
    dequantize_fp8_model1,
    fp8_model1_cache,
    fp8_model1_page_bytes,
    fp8_model1_pages,
    quantize_fp8_model1,
)

F64 = torch.float64
INF = float("inf")
NAN = float("nan")
HAS_E8M0 = hasattr(torch, "float8_e8m0fnu")


def _randn(*shape: int, seed: int, dtype: torch.dtype = F64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def _flashmla_quantize(k: torch.Tensor) -> torch.Tensor:
    """FlashMLA's ``quantize_k_cache`` for ``MODEL1_FP8Sparse`` as its ``tests/quant.py``
    describes it, for a bf16 ``k [nb, bs, 512]``: the page's first ``584·bs`` bytes.

    Per tile of 64: ``inv = 2^ceil(log2(max(amax / 448, 1e-4)))`` (amax of the bf16 values, in
    float32), stored as ``float8_e8m0fnu``; ``(tile.float() / inv)`` cast to e4m3; the rope
    copied as bf16; data rows of 576 bytes, then 8-byte scale rows (7 used).
    """
    nb, bs, _ = k.shape
    page = torch.zeros(nb, bs * 584, dtype=torch.uint8)
    data = page[:, :bs * 576].view(nb, bs, 576)
    scales = page[:, bs * 576:].view(nb, bs, 8)
    data[..., 448:] = k[..., 448:].contiguous().view(torch.uint8)
    for t in range(7):
        tile = k[..., 64 * t:64 * (t + 1)]
        inv = tile.abs().amax(dim=-1).float() / 448.0
        inv = torch.pow(2, inv.clamp_min(1e-4).log2().ceil())
        scales[..., t] = inv.to(torch.float8_e8m0fnu).view(torch.uint8)
        data[..., 64 * t:64 * (t + 1)] = (
            tile.float() / inv[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return page


def _flashmla_dequantize(page: torch.Tensor, bs: int) -> torch.Tensor:
    """FlashMLA's ``dequantize_k_cache`` (MODEL1): e4m3 and scale multiplied in bf16."""
    nb = page.shape[0]
    data = page[:, :bs * 576].reshape(nb, bs, 576)
    scales = page[:, bs * 576:bs * 584].reshape(nb, bs, 8)[..., :7]
    nope = data[..., :448].contiguous().view(torch.float8_e4m3fn).to(torch.bfloat16)
    scale = scales.contiguous().view(torch.float8_e8m0fnu).to(torch.bfloat16)
    nope = (nope.view(nb, bs, 7, 64) * scale[..., None]).view(nb, bs, 448)
    return torch.cat([nope, data[..., 448:].contiguous().view(torch.bfloat16)], dim=-1)


# tile magnitudes from the scale floor up; bf16 inputs, as FlashMLA's cache sees them
MAGNITUDES = torch.tensor([1e-6, 1e-3, 0.05, 1.0, 37.0, 1e4, 3e5], dtype=F64)


def _k_cache(nb: int, bs: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    nope = _randn(nb, bs, 7, 64, seed=seed) * MAGNITUDES[:, None]
    return torch.cat([nope.flatten(-2), _randn(nb, bs, 64, seed=seed + 1)], dim=-1).to(dtype)


def test_page_bytes() -> None:
    # 584 bytes a token, the page padded to a multiple of 576 (72 tokens need no padding)
    assert [fp8_model1_page_bytes(bs) for bs in (1, 2, 64, 72, 256)] == [
        1152, 1728, 37440, 42048, 149760]
    with pytest.raises(ValueError, match="block_size"):
        fp8_model1_page_bytes(0)


def _hand_built_errors(pages: torch.Tensor) -> list[str]:
    """One page of 2 tokens, built by hand: token 0's tile t holds ±2^t, token 1's nope is
    zero; rope 1.5 and -2.0. Returns the parts whose bytes differ."""
    want = torch.zeros(1728, dtype=torch.uint8)
    # token 0, tile t: amax 2^t, scale 2^ceil(log2(2^t / 448)) = 2^(t-8), values ±256
    # (e4m3 0x78, 0xF8 with the sign); UE8M0 byte t - 8 + 127
    want[0:448] = 0x78
    want[torch.arange(7) * 64] = 0xF8
    want[448:576] = torch.tensor([0xC0, 0x3F], dtype=torch.uint8).repeat(64)  # bf16 1.5
    want[576 + 448:1152] = torch.tensor([0x00, 0xC0], dtype=torch.uint8).repeat(64)  # -2.0
    want[1152:1159] = torch.arange(119, 126, dtype=torch.uint8)
    want[1160:1167] = 114  # token 1: the floor, 2^ceil(log2(1e-4)) = 2^-13
    parts = {"token 0 nope": (0, 448), "token 0 rope": (448, 576),
             "token 1 data": (576, 1152), "scales": (1152, 1168), "padding": (1168, 1728)}
    got = pages.reshape(-1)
    if got.numel() != 1728:
        return [f"{got.numel()} bytes, not 1728"]
    return [name for name, (a, b) in parts.items() if not torch.equal(got[a:b], want[a:b])]


def _hand_built_cache() -> torch.Tensor:
    k = torch.zeros(1, 2, 512, dtype=torch.bfloat16)
    k[0, 0, :448] = (2.0 ** torch.arange(7.0)).repeat_interleave(64)
    k[0, 0, torch.arange(7) * 64] *= -1
    k[0, 0, 448:] = 1.5
    k[0, 1, 448:] = -2.0
    return k


def _per_token_layout(pages: torch.Tensor) -> torch.Tensor:
    """Twin: each token's 576 data bytes followed by its own 8 scale bytes (V4.1's order)."""
    data = pages[:, :1152].reshape(-1, 2, 576)
    scales = pages[:, 1152:1168].reshape(-1, 2, 8)
    out = pages.clone()
    out[:, :1168] = torch.cat([data, scales], dim=-1).reshape(-1, 1168)
    return out


def _tiles_reversed(pages: torch.Tensor) -> torch.Tensor:
    out = pages.clone()
    for tok in range(2):
        nope = out[0, tok * 576:tok * 576 + 448].view(7, 64)
        out[0, tok * 576:tok * 576 + 448] = nope.flip(0).reshape(-1)
        out[0, 1152 + 8 * tok:1159 + 8 * tok] = out[0, 1152 + 8 * tok:1159 + 8 * tok].flip(0)
    return out


def _float32_exponent_scales(pages: torch.Tensor) -> torch.Tensor:
    """Twin: the scale byte as the float32 exponent field's top byte instead of UE8M0."""
    out = pages.clone()
    out[0, 1152:1168] = out[0, 1152:1168] >> 1
    return out


def test_hand_built_page_bytes() -> None:
    pages = quantize_fp8_model1(_hand_built_cache())
    assert pages.dtype == torch.uint8 and list(pages.shape) == [1, 1728]
    assert _hand_built_errors(pages) == []


@pytest.mark.parametrize("twin", [_per_token_layout, _tiles_reversed, _float32_exponent_scales])
def test_hand_built_twins_fail(twin) -> None:
    assert _hand_built_errors(twin(quantize_fp8_model1(_hand_built_cache()))) != []


@pytest.mark.skipif(not HAS_E8M0, reason="torch has no float8_e8m0fnu")
@pytest.mark.parametrize("bs", [1, 3, 64])
def test_bytes_equal_flashmla_quantize_k_cache(bs: int) -> None:
    k = _k_cache(2, bs, seed=20 + bs)
    pages = quantize_fp8_model1(k)
    assert torch.equal(pages[:, :584 * bs], _flashmla_quantize(k))
    assert not pages[:, 584 * bs:].any()  # padding: zeros here (FlashMLA leaves it unset)
    deq = dequantize_fp8_model1(pages, bs)
    assert deq.dtype == torch.bfloat16 and list(deq.shape) == [2, bs, 512]
    assert torch.equal(deq, _flashmla_dequantize(pages, bs))
    # a float64 cache holding the same numbers writes the same bytes
    assert torch.equal(quantize_fp8_model1(k.double()), pages)


def test_round_trip_error_bound() -> None:
    """``|x − deq| <= max(2^-4·|x|, 2^-10·scale)`` per value (e4m3's half ulp, normal and
    subnormal); the scale is the smallest power of two >= max(amax/448, 1e-4); rope exact."""
    bs = 5
    k = _k_cache(3, bs, seed=30, dtype=torch.float32)
    pages = quantize_fp8_model1(k)
    deq = dequantize_fp8_model1(pages, bs).double()
    codes = pages[:, 576 * bs:584 * bs].view(3, bs, 8)[..., :7].double()
    scale = 2.0 ** (codes - 127)
    amax = k[..., :448].double().view(3, bs, 7, 64).abs().amax(-1)
    floor = (amax / 448).clamp_min(1e-4)
    assert torch.all(scale >= floor) and torch.all(scale / 2 < floor)
    x = k[..., :448].double()
    err = (deq[..., :448] - x).abs()
    bound = torch.maximum(2.0 ** -4 * x.abs(), 2.0 ** -10 * scale.repeat_interleave(64, -1))
    assert torch.all(err <= bound)
    assert torch.equal(deq[..., 448:], k[..., 448:].to(torch.bfloat16).double())
    rel = (err.norm() / x.norm()).item()
    print(f"MODEL1 round trip: relative Frobenius error {rel:.2e} (bound 2^-4 = {2**-4:.2e})")
    assert 0 < rel <= 2.0 ** -4


@pytest.mark.skipif(not HAS_E8M0, reason="torch has no float8_e8m0fnu")
def test_scale_bytes_are_torch_e8m0() -> None:
    k = _k_cache(1, 4, seed=40)
    pages = quantize_fp8_model1(k)
    codes = pages[:, 4 * 576:4 * 584].view(1, 4, 8)[..., :7]
    amax = k[..., :448].float().view(1, 4, 7, 64).abs().amax(-1)
    scale = torch.pow(2.0, torch.log2((amax / 448).clamp_min(1e-4)).ceil())
    assert torch.equal(codes, scale.to(torch.float8_e8m0fnu).view(torch.uint8))


def test_nan_and_inf_tiles_dequantize_to_nan() -> None:
    k = _k_cache(1, 2, seed=50, dtype=torch.float32)
    k[0, 0, 70] = NAN  # tile 1 of token 0
    k[0, 1, 300] = INF  # tile 4 of token 1
    k[0, 1, 500] = NAN  # rope of token 1
    deq = dequantize_fp8_model1(quantize_fp8_model1(k), 2)
    nan = torch.isnan(deq)
    want = torch.zeros_like(nan)
    want[0, 0, 64:128] = True
    want[0, 1, 256:320] = True
    want[0, 1, 500] = True
    assert torch.equal(nan, want)


def test_kernel_view_and_pages() -> None:
    pages = quantize_fp8_model1(_k_cache(3, 5, seed=60))
    view = fp8_model1_cache(pages, 5)
    assert list(view.shape) == [3, 5, 584] and view.stride() == (fp8_model1_page_bytes(5), 584, 1)
    assert view.data_ptr() == pages.data_ptr()
    assert torch.equal(fp8_model1_pages(view), pages[:, :584 * 5])
    assert torch.equal(fp8_model1_pages(view[:, :, None]), pages[:, :584 * 5])
    with pytest.raises(ValueError, match="kv_cache"):
        fp8_model1_pages(view.transpose(0, 1))  # not a view of pages
    with pytest.raises(ValueError, match="kv_cache"):
        fp8_model1_pages(torch.zeros(3, 5, 656, dtype=torch.uint8))


def test_codec_bad_input() -> None:
    with pytest.raises(ValueError, match="k_cache"):
        quantize_fp8_model1(torch.zeros(2, 4, 576))
    with pytest.raises(ValueError, match="k_cache"):
        quantize_fp8_model1(torch.zeros(8, 512))
    with pytest.raises(TypeError, match="k_cache"):
        quantize_fp8_model1(torch.zeros(2, 4, 512, dtype=torch.int32))
    pages = quantize_fp8_model1(torch.zeros(2, 4, 512))
    with pytest.raises(ValueError, match="pages"):
        dequantize_fp8_model1(pages, 3)
    with pytest.raises(ValueError, match="pages"):
        dequantize_fp8_model1(pages[:, :584 * 4], 4)  # the padding is part of a page
    with pytest.raises(TypeError, match="pages"):
        dequantize_fp8_model1(pages.float(), 4)
    with pytest.raises(TypeError, match="block_size"):
        dequantize_fp8_model1(pages, 4.0)
    again = dequantize_fp8_model1(pages.view(torch.float8_e4m3fn), 4)  # FlashMLA's dtype
    assert torch.equal(again, dequantize_fp8_model1(pages, 4))
