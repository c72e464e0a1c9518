"""``mla.fast.quantize_indexer_q`` against ``mla.reference.quantize_indexer_q``: the same e4m3
bytes and the same float32 weights, bit for bit, on random heads over a wide range of
magnitudes and on adversarial ones (the scale's boundaries, the 1e-4 floor, e4m3 ties and
subnormals, zeros, NaN and infinite values). Where the reference divides by a NaN or an
infinite scale, the sign of the NaN it gets is the platform's (x86: negative), so NaN codes are
compared as NaN, whatever their sign bit.

Under ``TRITON_INTERPRET=1`` on the CPU (conftest sets it without a GPU); compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import mla.reference as ref
from mla.fast import quantize_indexer_q

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D = 128


def _codes(q: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes, every NaN (0x7F / 0xFF) as 0x7F."""
    b = q.view(torch.uint8).cpu().to(torch.int32)
    return torch.where(b & 0x7F == 0x7F, 0x7F, b)


def _assert_same(q: torch.Tensor, w: torch.Tensor) -> None:
    got_q, got_w = quantize_indexer_q(q.to(DEVICE), w.to(DEVICE))
    want_q, want_w = ref.quantize_indexer_q(q, w)
    assert got_q.dtype == torch.float8_e4m3fn and got_q.shape == q.shape
    assert got_w.dtype == torch.float32 and got_w.shape == w.shape
    diff = (_codes(got_q) != _codes(want_q)).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} codes differ, first at {diff[0].tolist()}"
    assert torch.equal(got_w.cpu().isnan(), want_w.isnan())
    both = ~want_w.isnan()
    assert torch.equal(got_w.cpu()[both], want_w[both]), "weights differ"


def _heads(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gain = 2.0 ** torch.randint(-12, 13, (*shape, 1), generator=g)
    return (torch.randn(*shape, D, generator=g, dtype=torch.float64) * gain).to(dtype)


@pytest.mark.parametrize("shape", [(1, 64), (3, 2, 64), (37, 7), (5, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float64])
def test_random_heads(shape: tuple[int, ...], dtype: torch.dtype):
    g = torch.Generator().manual_seed(sum(shape) + dtype.itemsize)
    q = _heads(g, shape, dtype)
    w = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    _assert_same(q, w)


def test_adversarial_heads():
    heads = []
    for j in (-20, -3, 0, 5, 100):
        for f in (1.75, 1.7421875, 1.7578125):  # amax 448·2^j and its bf16 neighbours
            heads.append(torch.linspace(-1, 1, D, dtype=torch.float64) * f * 2.0 ** (j + 8))
    tie = torch.zeros(D, dtype=torch.float64)
    tie[0] = 448.0  # scale 1: the rest are e4m3 values and midpoints between them
    tie[1:64] = torch.tensor([1.0625, 1.1875, 0.0029296875, 0.0009765625, -0.0048828125,
                              17.0, 19.0, 240.0, 232.0, 0.013671875] * 6 + [3.0, 5.0, 7.0],
                             dtype=torch.float64)
    heads += [tie, torch.zeros(D, dtype=torch.float64),
              torch.full((D,), 3e-5, dtype=torch.float64),  # below the floor on amax
              torch.full((D,), -2.0 ** -130, dtype=torch.float64),  # float32 subnormals
              torch.linspace(-3e38, 3e38, D, dtype=torch.float64)]
    nan_some = torch.linspace(-5, 5, D, dtype=torch.float64)
    nan_some[[0, 7, 127]] = float("nan")
    inf_one = torch.linspace(-5, 5, D, dtype=torch.float64)
    inf_one[9] = float("inf")
    heads += [nan_some, torch.full((D,), float("nan"), dtype=torch.float64), inf_one]
    q = torch.stack(heads).float().view(1, len(heads), D)
    w = torch.linspace(-2, 3, len(heads)).view(1, -1)
    w[0, 3] = 0.0
    _assert_same(q, w)


def test_nan_weight_and_strided_input():
    g = torch.Generator().manual_seed(11)
    base = _heads(g, (4, 64 * 2), torch.float32)
    q = base.view(4, 64, 2, D)[:, :, 1]  # every other head: a row stride of 256
    w = torch.randn(4, 64, generator=g)
    w[2, 5] = float("nan")
    _assert_same(q, w)


def test_empty():
    q, w = quantize_indexer_q(torch.zeros(0, 64, D, device=DEVICE),
                              torch.zeros(0, 64, device=DEVICE))
    assert q.shape == (0, 64, D) and q.dtype == torch.float8_e4m3fn and w.shape == (0, 64)


def test_a_broken_twin_fails():
    """The comparison bites: the reference's scales not rounded to a power of two."""
    g = torch.Generator().manual_seed(5)
    q, w = _heads(g, (3, 8), torch.float32), torch.randn(3, 8, generator=g)
    got_q, _ = quantize_indexer_q(q.to(DEVICE), w.to(DEVICE))
    twin_q, _ = ref.quantize_indexer_q(q, w, scale_fmt=None)
    assert (_codes(got_q) != _codes(twin_q)).any()


def test_refuses_bad_input():
    q, w = torch.zeros(2, 4, D, device=DEVICE), torch.zeros(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="q_index must have shape"):
        quantize_indexer_q(q[..., :64], w)
    with pytest.raises(ValueError, match="weights"):
        quantize_indexer_q(q, w[:, :3])
    with pytest.raises(TypeError, match="q_index"):
        quantize_indexer_q(q.to(torch.int32), w)
    with pytest.raises(ValueError, match="scale_fmt must be 'ue8m0'"):
        quantize_indexer_q(q, w, scale_fmt=None)
