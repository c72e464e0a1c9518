"""The sparse prefill's gathers in Triton (``mla.fast.sparse.gather``) against the reference's,
bit for bit: the fp8_ds_mla latent rows dequantized into a workspace, and the index keys of
vLLM's 132-byte cache concatenated per request.

Runs under ``TRITON_INTERPRET=1`` on the CPU (conftest sets it without a GPU), small sizes.
Block tables are scrambled, lengths ragged (0, 1, not multiples of the block or of the
kernels' tiles), workspaces have gaps; every output starts as NaN (the reference's and the
kernel's alike), so a row written where it should not be, or not written, differs. Besides
real caches, "foreign" bytes: random e4m3 codes (NaN codes included) and scales that are not
powers of two, where the bf16 rounding of the product decides the result.
"""

from __future__ import annotations

import pytest
import torch

from mla.fast.sparse.gather import gather_and_upconvert_fp8_ds_mla, gather_indexer_k_cache
from mla.reference.fp8 import FP8_DS_MLA_BYTES, quantize_fp8_ds_mla
from mla.reference.fp8 import gather_and_upconvert_fp8_ds_mla as ref_latent
from mla.reference.indexer_cache import gather_indexer_k_cache as ref_keys
from mla.reference.indexer_cache import indexer_k_quant_and_cache
from mla.reference.paged_cache import make_block_table

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
I32 = torch.int32
NAN = float("nan")
# lengths: empty, one, ragged (several requests), and enough requests that a program of the
# latent gather walks more than one tile (the interpreter counts 4 SMs)
LENS = [[0], [1], [5, 0, 1, 37, 16], [3, 40, 0, 17, 33, 1, 29, 12, 8, 36, 21, 2]]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (the sign of a zero included), NaN where NaN."""
    nan = a.isnan()
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(nan, b.isnan()):
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(ints)[~nan], b.view(ints)[~nan])


def _table(lens: list[int], bs: int, seed: int) -> tuple[torch.Tensor, int]:
    """A scrambled block table with spare blocks, so that not every block is someone's."""
    return make_block_table(lens, bs, spare_blocks=3, seed=seed)


def _latent_cache(nb: int, bs: int, seed: int, foreign: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv_c = torch.randn(nb * bs, 512, generator=g) * 10.0 ** torch.randint(-4, 3, (nb * bs, 1),
                                                                          generator=g)
    k_pe = torch.randn(nb * bs, 64, generator=g)
    rows = quantize_fp8_ds_mla(kv_c, k_pe)
    if foreign:  # any e4m3 byte, scales of 24 significant bits
        rows[:, :512] = torch.randint(0, 256, (nb * bs, 512), generator=g, dtype=torch.uint8)
        scales = torch.rand(nb * bs, 4, generator=g) * 2.0 ** torch.randint(-20, 20, (1,),
                                                                             generator=g)
        rows[:, 512:528] = scales.view(torch.uint8)
    return rows.view(nb, bs, FP8_DS_MLA_BYTES)


def _starts(lens: list[int], seed: int) -> tuple[torch.Tensor, int]:
    """Workspace starts in a shuffled request order with gaps; the workspace's rows."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(lens), generator=g).tolist()
    starts, at = [0] * len(lens), 2
    for b in order:
        starts[b] = at
        at += lens[b] + int(torch.randint(0, 3, (1,), generator=g))
    return torch.tensor(starts, dtype=I32), at + 1


def _latent_case(lens, bs, seed, foreign=False, layout="uint8"):
    table, nb = _table(lens, bs, seed)
    cache = _latent_cache(nb, bs, seed, foreign)
    if layout == "e4m3":
        cache = cache.view(torch.float8_e4m3fn)
    elif layout == "strided":  # every other block of a cache with padded rows
        big = torch.zeros(2 * nb, bs, FP8_DS_MLA_BYTES + 16, dtype=torch.uint8)
        big[::2, :, :FP8_DS_MLA_BYTES] = cache
        cache = big[::2, :, :FP8_DS_MLA_BYTES]
    starts, W = _starts(lens, seed)
    return cache, table, torch.tensor(lens, dtype=I32), starts, W


def _on(*ts):
    return [t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize("bs", [16, 5])
def test_latent_gather_is_the_reference_bit_for_bit(lens, bs):
    cache, table, seq_lens, starts, W = _latent_case(lens, bs, seed=len(lens) + bs)
    want = ref_latent(cache, torch.full((W, 576), NAN, dtype=torch.bfloat16), table, seq_lens,
                      starts, len(lens))
    dst = torch.full((W, 576), NAN, dtype=torch.bfloat16, device=DEVICE)
    got = gather_and_upconvert_fp8_ds_mla(*_on(cache), dst, *_on(table, seq_lens, starts),
                                          len(lens), validate=False)
    assert got is dst and _bits_equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["uint8", "e4m3", "strided"])
def test_latent_gather_dtypes_layouts_and_foreign_bytes(dtype, layout):
    lens = LENS[2]
    cache, table, seq_lens, starts, W = _latent_case(lens, 16, seed=7, foreign=True,
                                                     layout=layout)
    want = ref_latent(cache, torch.full((W, 576), NAN, dtype=dtype), table.long(), seq_lens,
                      starts.long(), len(lens))
    got = gather_and_upconvert_fp8_ds_mla(
        *_on(cache), torch.full((W, 576), NAN, dtype=dtype, device=DEVICE),
        *_on(table.long(), seq_lens, starts.long()), len(lens), validate=True)
    assert _bits_equal(got.cpu(), want)


@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize("bs", [16, 5])
def test_index_key_gather_is_the_reference_bit_for_bit(lens, bs):
    g = torch.Generator().manual_seed(bs)
    table, nb = _table(lens, bs, seed=bs + len(lens))
    cache = torch.zeros(nb, bs, 132, dtype=torch.uint8)
    k = torch.randn(nb * bs, 128, generator=g) * 10.0 ** torch.randint(-5, 3, (nb * bs, 1),
                                                                      generator=g)
    indexer_k_quant_and_cache(k, cache, torch.arange(nb * bs))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=I32)
    want = ref_keys(cache, table, cu)
    for num_tokens, validate in ((None, True), (None, False), (int(cu[-1]), False)):
        got = gather_indexer_k_cache(*_on(cache, table, cu), num_tokens=num_tokens,
                                     validate=validate)
        assert got[0].dtype == torch.float8_e4m3fn and got[1].dtype == torch.float32
        assert _bits_equal(got[0].cpu().view(torch.uint8), want[0].view(torch.uint8))
        assert _bits_equal(got[1].cpu(), want[1])


def test_index_key_gather_foreign_bytes_offset_counts_and_block_stride():
    """Any bytes (NaN scales too), ``cu_seq_lens`` not starting at 0, int64 indices, a cache
    whose blocks are every other one of a larger buffer."""
    lens, bs = LENS[3], 16
    g = torch.Generator().manual_seed(3)
    table, nb = _table(lens, bs, seed=3)
    big = torch.randint(0, 256, (2 * nb, bs, 132), generator=g, dtype=torch.uint8)
    cache = big[::2]
    cu = torch.tensor([7] + (7 + torch.tensor(lens).cumsum(0)).tolist(), dtype=torch.int64)
    want = ref_keys(cache, table.long(), cu)
    got = gather_indexer_k_cache(*_on(cache, table.long(), cu), num_tokens=sum(lens))
    assert _bits_equal(got[0].cpu().view(torch.uint8), want[0].view(torch.uint8))
    assert _bits_equal(got[1].cpu(), want[1])


def test_empty_calls_launch_nothing_and_return_the_right_shapes():
    cache = torch.zeros(2, 16, FP8_DS_MLA_BYTES, dtype=torch.uint8, device=DEVICE)
    none = torch.zeros(0, dtype=I32, device=DEVICE)
    table = torch.zeros(0, 1, dtype=I32, device=DEVICE)
    dst = torch.full((4, 576), NAN, device=DEVICE)
    assert gather_and_upconvert_fp8_ds_mla(cache, dst, table, none, none, 0) is dst
    assert dst.isnan().all()
    empty = torch.zeros(0, 576, device=DEVICE)
    one = torch.zeros(1, dtype=I32, device=DEVICE)
    one_row = torch.zeros(1, 1, dtype=I32, device=DEVICE)
    assert gather_and_upconvert_fp8_ds_mla(cache, empty, one_row, one, one, 1) is empty
    ik = torch.zeros(2, 16, 132, dtype=torch.uint8, device=DEVICE)
    for cu, n in ((torch.zeros(1, dtype=I32, device=DEVICE), None),
                  (torch.zeros(1, dtype=I32, device=DEVICE), 0)):
        codes, scales = gather_indexer_k_cache(ik, table, cu, num_tokens=n)
        assert codes.shape == (0, 128) and scales.shape == (0,)
    codes, scales = gather_indexer_k_cache(ik, torch.zeros(2, 1, dtype=I32, device=DEVICE),
                                           torch.tensor([4, 4, 4], device=DEVICE))
    assert codes.shape == (0, 128) and codes.dtype == torch.float8_e4m3fn


# ---- bad input -----------------------------------------------------------------------------

def _small_latent():
    cache, table, seq_lens, starts, W = _latent_case([5, 9], 4, seed=2)
    W += 10  # room for a longer request
    dst = torch.full((W, 576), NAN, device=DEVICE)
    return [*_on(cache), dst, *_on(table, seq_lens, starts)], W


@pytest.mark.parametrize("change, error, match", [
    (lambda a: a.__setitem__(0, a[0].float()), TypeError, "src_cache must have dtype"),
    (lambda a: a.__setitem__(0, a[0][..., :600]), ValueError, "src_cache must have shape"),
    (lambda a: a.__setitem__(1, a[1][:, :512]), ValueError, r"dst must have shape \[\*, 576\]"),
    (lambda a: a.__setitem__(1, a[1].int()), TypeError, "dst must have dtype"),
    (lambda a: a.__setitem__(3, a[3].float()), TypeError, "seq_lens must have dtype"),
    (lambda a: a.__setitem__(4, a[4][:1]), ValueError, r"workspace_starts must have shape \[2\]"),
    (lambda a: a.__setitem__(2, a[2][:1]), ValueError, "block_table must have at least"),
    (lambda a: a[2].__setitem__((1, 1), -1), ValueError, r"block_table\[1\] points outside"),
    (lambda a: a[4].__setitem__(0, 10**6), ValueError, r"request 0: rows \[1000000"),
    (lambda a: a[3].__setitem__(1, 13), ValueError, "request 1: seq_lens 13 needs more"),
])
def test_latent_gather_refuses_bad_input_and_leaves_dst(change, error, match):
    args, _ = _small_latent()
    change(args)
    before = args[1].clone()
    with pytest.raises(error, match=match):
        gather_and_upconvert_fp8_ds_mla(*args, 2, validate=True)
    assert _bits_equal(args[1], before)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        gather_and_upconvert_fp8_ds_mla(*_small_latent()[0], 2.0)


def test_latent_gather_unvalidated_bad_values_stay_inside_and_show_as_nan():
    (cache, dst, table, seq_lens, starts), W = _small_latent()
    good = gather_and_upconvert_fp8_ds_mla(cache, dst.clone(), table, seq_lens, starts, 2)
    good_table, table = table, table.clone()
    table[1, 1] = -1  # request 1's tokens 4..7: NaN rows
    table[0, 0] = 10**6  # request 0's tokens 0..3: NaN rows
    got = gather_and_upconvert_fp8_ds_mla(cache, dst.clone(), table, seq_lens, starts, 2,
                                          validate=False)
    s0, s1 = starts.tolist()
    bad = list(range(s0, s0 + 4)) + list(range(s1 + 4, s1 + 8))
    keep = [r for r in range(W) if r not in bad]
    assert got[bad].isnan().all() and _bits_equal(got[keep], good[keep])
    # rows outside dst are skipped; a negative length writes nothing; a huge one is bounded
    for lens, first in (([5, -3], [W - 2, 0]), ([10**9, 0], [-3, 0])):
        out = gather_and_upconvert_fp8_ds_mla(cache, dst.clone(), good_table,
                                              torch.tensor(lens, dtype=I32, device=DEVICE),
                                              torch.tensor(first, dtype=I32, device=DEVICE),
                                              2, validate=False)
        written = ~out.isnan().all(dim=1)
        if lens[0] == 5:
            assert written.nonzero().flatten().tolist() == [W - 2, W - 1]
        else:  # request 0's tokens 3.. land in rows 0..; past its 2 blocks of 4: NaN rows
            assert _bits_equal(out[:1], good[s0 + 3:s0 + 4])


def test_index_key_gather_refuses_bad_input():
    table, nb = _table([5, 9], 4, seed=1)
    cache = torch.zeros(nb, 4, 132, dtype=torch.uint8, device=DEVICE)
    table, cu = table.to(DEVICE), torch.tensor([0, 5, 14], device=DEVICE)
    cases = [
        (dict(kv_cache=cache.float()), TypeError, "kv_cache must have dtype"),
        (dict(kv_cache=torch.zeros(nb, 4, 656, dtype=torch.uint8, device=DEVICE)), ValueError,
         "132"),
        (dict(kv_cache=cache.transpose(0, 1)), ValueError, "kv_cache's pages must be contig"),
        (dict(cu_seq_lens=cu[:2]), ValueError, r"cu_seq_lens must have shape \[3\]"),
        (dict(cu_seq_lens=cu.float()), TypeError, "cu_seq_lens must have dtype"),
        (dict(cu_seq_lens=torch.tensor([0, 5, 3], device=DEVICE)), ValueError,
         "request 1: length -2"),
        (dict(block_table=table.clone().index_fill_(1, torch.tensor([0], device=DEVICE), -1)),
         ValueError, r"block_table\[0\] points outside kv_cache's"),
        (dict(num_tokens=13), ValueError, "num_tokens must be cu_seq_lens.* = 14, got 13"),
        (dict(num_tokens=14.0), TypeError, "num_tokens must be an int"),
        (dict(num_tokens=-1, validate=False), ValueError, "num_tokens must be >= 0"),
    ]
    for change, error, match in cases:
        args = dict(kv_cache=cache, block_table=table, cu_seq_lens=cu, validate=True)
        args.update(change)
        with pytest.raises(error, match=match):
            gather_indexer_k_cache(**args)


def test_index_key_gather_unvalidated_bad_values_give_nan_tokens():
    lens, bs = [5, 9], 4
    table, nb = _table(lens, bs, seed=4)
    g = torch.Generator().manual_seed(4)
    cache = torch.zeros(nb, bs, 132, dtype=torch.uint8)
    indexer_k_quant_and_cache(torch.randn(nb * bs, 128, generator=g), cache,
                              torch.arange(nb * bs))
    cu = torch.tensor([0, 5, 14], dtype=I32)
    codes, scales = ref_keys(cache, table, cu)
    table[1, 0] = -1  # request 1's tokens 0..3 (outputs 5..8)
    # two tokens more than cu_seq_lens covers: NaN
    got_c, got_s = gather_indexer_k_cache(*_on(cache, table, cu), num_tokens=16,
                                          validate=False)
    got_c, got_s = got_c.cpu().view(torch.uint8), got_s.cpu()
    bad = [5, 6, 7, 8, 14, 15]
    keep = [t for t in range(14) if t not in bad]
    assert got_s[bad].isnan().all() and (got_c[bad] == 0x7F).all()
    assert torch.equal(got_c[keep], codes.view(torch.uint8)[keep])
    assert torch.equal(got_s[keep], scales[keep])
    # cu_seq_lens decreasing: each token's request is what the search finds; reads in bounds
    c, s = gather_indexer_k_cache(*_on(cache, table, torch.tensor([0, 9, 3], dtype=I32)),
                                  num_tokens=5, validate=False)
    assert c.shape == (5, 128) and s.shape == (5,)
