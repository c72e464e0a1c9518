"""The lightning indexer's fast path (``mla.fast.indexer_k_quant_and_cache``,
``fp8_mqa_logits``, ``fp8_paged_mqa_logits``, ``top_k_per_row``) against the reference.

Under ``TRITON_INTERPRET=1`` on the CPU (conftest sets it without a GPU) with small shapes; the
same tests run compiled on a GPU. The cache write is held to the reference byte for byte on a
cache poisoned with ``0xFF`` (NaN as e4m3 and as float32 scale); the logits to the float64
reference within the budget of the device's accumulation (``logits_budget``); the top-k sets
exactly.
"""

from __future__ import annotations

import pytest
import torch

import mla.reference as ref
from mla.compare import poison_like
from mla.fast import indexer_k_quant_and_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D = 128


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- the cache write --------------------------------------------------------------------------

def _keys(g: torch.Generator, n: int, dtype: torch.dtype = torch.bfloat16,
          spread: int = 6) -> torch.Tensor:
    gain = 2.0 ** torch.randint(-spread, spread + 1, (n, 1), generator=g)
    return (torch.randn(n, D, generator=g, dtype=torch.float64) * gain).to(dtype)


def _both_writes(k: torch.Tensor, slots: torch.Tensor, blocks: int, page: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fast, reference) caches after writing ``k`` at ``slots`` into the same poisoned cache
    (the reference's run on the CPU)."""
    cache = poison_like(torch.empty(blocks, page, 132, dtype=torch.uint8))
    want = cache.clone()
    ref.indexer_k_quant_and_cache(k, want, slots)
    got = cache.to(DEVICE)
    indexer_k_quant_and_cache(k.to(DEVICE), got, slots.to(DEVICE))
    return got.cpu(), want


def _assert_same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    bad = torch.nonzero(got != want)
    assert len(bad) == 0, (f"{len(bad)} bytes differ, first at {bad[0].tolist()}: "
                           f"{int(got[tuple(bad[0])])} vs {int(want[tuple(bad[0])])}")


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("tokens", [1, 17, 40])
def test_cache_write_bytes(page: int, tokens: int):
    """Scattered slots, tokens not a multiple of the program's 16, keys over 2^±6 (bf16, as
    vLLM passes them)."""
    g = _gen(page * 100 + tokens)
    blocks = -(-tokens // page) + 2
    slots = torch.randperm(blocks * page, generator=g)[:tokens]
    _assert_same_bytes(*_both_writes(_keys(g, tokens), slots, blocks, page))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_cache_write_bytes_other_dtypes(dtype: torch.dtype):
    g = _gen(3)
    slots = torch.randperm(48, generator=g)[:33]
    _assert_same_bytes(*_both_writes(_keys(g, 33, dtype), slots, 3, 16))


def test_cache_write_adversarial_values():
    """Rows at the scale's boundary (amax = 448·2^j exactly, and one bf16 step either side),
    e4m3 rounding ties, zeros, the 1e-4 floor, subnormal codes, huge values, NaN elements and
    whole NaN rows, infinities."""
    rows = []
    for j in (-20, -3, 0, 5, 100):
        for f in (1.75, 1.7421875, 1.7578125):  # 448·2^j, and the bf16 neighbours of 1.75
            r = torch.linspace(-1, 1, D, dtype=torch.float64) * f * 2.0 ** (j + 8)
            rows.append(r)
    tie = torch.zeros(D, dtype=torch.float64)
    tie[0] = 448.0  # scale 1: the rest are e4m3 values and midpoints between them
    tie[1:64] = torch.tensor([1.0625, 1.1875, 0.0029296875, 0.0009765625, -0.0048828125,
                              17.0, 19.0, 240.0, 232.0, 0.013671875] * 6 + [3.0, 5.0, 7.0],
                             dtype=torch.float64)
    rows.append(tie)
    rows.append(torch.zeros(D, dtype=torch.float64))
    rows.append(torch.full((D,), 3e-5, dtype=torch.float64))  # below the floor on amax
    rows.append(torch.full((D,), -2.0 ** -130, dtype=torch.float64))  # subnormal in float32
    huge = torch.linspace(-3e38, 3e38, D, dtype=torch.float64)
    rows.append(huge)
    nan_some = torch.linspace(-5, 5, D, dtype=torch.float64)
    nan_some[[0, 7, 127]] = float("nan")
    rows.append(nan_some)
    rows.append(torch.full((D,), float("nan"), dtype=torch.float64))
    inf_row = torch.linspace(-5, 5, D, dtype=torch.float64)
    inf_row[9] = float("inf")
    rows.append(inf_row)
    k = torch.stack(rows).float()
    n = k.shape[0]
    slots = torch.randperm(64, generator=_gen(5))[:n]
    _assert_same_bytes(*_both_writes(k, slots, 4, 16))


def test_cache_write_skips_padding_and_empty():
    g = _gen(7)
    k = _keys(g, 20)
    slots = torch.randperm(32, generator=g)[:20]
    slots[[0, 9, 19]] = -1
    got, want = _both_writes(k, slots, 2, 16)
    _assert_same_bytes(got, want)
    untouched = poison_like(torch.empty(2, 16, 132, dtype=torch.uint8))
    written = torch.zeros(2 * 16 * 132, dtype=torch.bool)
    for s in slots[slots >= 0].tolist():
        p, o = divmod(s, 16)
        written[p * 16 * 132 + o * 128: p * 16 * 132 + o * 128 + 128] = True
        written[p * 16 * 132 + 16 * 128 + 4 * o: p * 16 * 132 + 16 * 128 + 4 * o + 4] = True
    assert torch.equal(got.view(-1)[~written], untouched.view(-1)[~written])
    empty, _ = _both_writes(k[:0], slots[:0], 2, 16)
    _assert_same_bytes(empty, untouched)


def test_cache_write_a_broken_twin_fails():
    """The byte comparison bites: the reference with scales not rounded to a power of two."""
    g = _gen(8)
    k = _keys(g, 5)
    slots = torch.arange(5)
    got, want = _both_writes(k, slots, 1, 16)
    twin = poison_like(torch.empty(1, 16, 132, dtype=torch.uint8))
    ref.indexer_k_quant_and_cache(k, twin, slots, scale_fmt=None)
    _assert_same_bytes(got, want)
    with pytest.raises(AssertionError, match="bytes differ"):
        _assert_same_bytes(got, twin)


def test_cache_write_refuses_bad_input():
    cache = torch.zeros(2, 16, 132, dtype=torch.uint8, device=DEVICE)
    k = torch.zeros(3, D, device=DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping must lie in"):
        indexer_k_quant_and_cache(k, cache, torch.tensor([0, 32, 1], device=DEVICE),
                                  validate=True)
    with pytest.raises(ValueError, match="slot_mapping must lie in"):
        indexer_k_quant_and_cache(k, cache, torch.tensor([0, -2, 1], device=DEVICE),
                                  validate=True)
    # unvalidated, a slot outside the cache is never written (nor is anything else)
    indexer_k_quant_and_cache(k, cache, torch.tensor([-2, 32, 10**9], device=DEVICE),
                              validate=False)
    assert int(cache.count_nonzero()) == 0
    with pytest.raises(ValueError, match=r"\[num_blocks, block_size, 132\]"):
        indexer_k_quant_and_cache(k, torch.zeros(2, 16, 656, dtype=torch.uint8,
                                                 device=DEVICE), slots)
    with pytest.raises(ValueError, match="k"):
        indexer_k_quant_and_cache(torch.zeros(3, 64, device=DEVICE), cache, slots)
    with pytest.raises(ValueError, match="quant_block_size"):
        indexer_k_quant_and_cache(k, cache, slots, quant_block_size=64)
    with pytest.raises(ValueError, match="scale_fmt"):
        indexer_k_quant_and_cache(k, cache, slots, scale_fmt=None)
    with pytest.raises((TypeError, ValueError), match="kv_cache"):
        indexer_k_quant_and_cache(k, cache.float(), slots)
