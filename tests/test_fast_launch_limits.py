"""Host-side size guards of ``mla.fast``: inputs too large for one launch raise a
``ValueError`` that names the limit, before anything is launched (integer-limit audit of
2026-12-02, §3, §4, §7, §8).

``check_grid`` at its boundaries; then each guarded entry with inputs that reach a limit at no
memory cost (zero-stride ``expand`` views, ``meta`` tensors, small tensors with a large
declared bound or a plan). The kernels are replaced by ``NoLaunch``, which records launches:
without the guard the call would launch (or, unguarded on a GPU, fail with a CUDA error, or
silently launch nothing), and the test would fail on the missing ``ValueError``, never hang
in the interpreter.

The inputs are CPU and ``meta`` tensors, which the fast path takes only under Triton's
interpreter (``needs_interpreter``: skipped on a GPU machine; the guards are host code, the
same on both).
"""

from __future__ import annotations

import pytest
import torch
from _interpreter import needs_interpreter

from mla.fast import attention, decode, fp8, merge, paged_cache, sparse, topk
from mla.fast import sm90 as sm90_package
from mla.fast.dcp import correction
from mla.fast.indexer import cache as indexer_cache
from mla.fast.indexer import logits as indexer_logits
from mla.fast.indexer import logits_paged as indexer_logits_paged
from mla.fast.indexer.logits_tile import LogitsPlan
from mla.fast.launch import check_grid
from mla.fast.sparse import index as sparse_index

I32 = torch.int32
Y_LIMIT = "above CUDA's limit of 65535 for grid y"
Z_LIMIT = "above CUDA's limit of 65535 for grid z"
X_LIMIT = "above CUDA's limit of 2147483647 for grid x"
PRODUCT_LIMIT = "above Triton's limit of 2147483647"

pytestmark = needs_interpreter


class NoLaunch:
    """Stands in for a ``@triton.jit`` kernel (``kernel[grid](...)``) or a
    ``CompiledLauncher`` (``launcher(key, grid, args)``): records each launch's grid."""

    def __init__(self) -> None:
        self.grids: list[tuple] = []
        self.direct = True

    def __getitem__(self, grid: tuple):
        return lambda *args, **kwargs: self.grids.append(grid)

    def __call__(self, key, grid, args, **options) -> None:
        self.grids.append(grid)

    def launch_kept(self, key, grid, args) -> bool:
        self.grids.append(grid)
        return True


@pytest.fixture
def no_launch(monkeypatch):
    """``no_launch(module, *names)``: those kernels of ``module`` replaced by one ``NoLaunch``;
    after the test, it must have recorded no launch."""
    recorders: list[NoLaunch] = []

    def patch(module, *names: str) -> NoLaunch:
        rec = NoLaunch()
        for name in names:
            assert hasattr(module, name), name
            monkeypatch.setattr(module, name, rec)
        recorders.append(rec)
        return rec

    yield patch
    for rec in recorders:
        assert rec.grids == [], f"launched {rec.grids}"


def expanded(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of ``shape`` holding one element (stride 0 everywhere; no memory)."""
    return torch.zeros((1,) * len(shape), dtype=dtype).expand(*shape)


def same_rows(n: int, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[n, width]``, every row the same one (unit column stride, row stride 0)."""
    return torch.zeros(1, width, dtype=dtype).expand(n, width)


# --------------------------------------------------------------------------------------------
# check_grid
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("grid", [(1,), (2**31 - 1,), (2**31 - 1, 1), (2**31 - 1, 1, 1),
                                  (1, 65535), (1, 65535, 32768), (1, 1, 65535),
                                  (65535, 32768, 1), (32767, 65535, 1), (0, 65535, 65535),
                                  (0, 0, 0)])
def test_check_grid_accepts_up_to_the_limits(grid):
    check_grid("k", grid)


@pytest.mark.parametrize("grid, match", [
    ((1, 65536), Y_LIMIT), ((1, 65536, 1), Y_LIMIT), ((0, 65536, 1), Y_LIMIT),
    ((1, 1, 65536), Z_LIMIT), ((1, 65535, 65536), Z_LIMIT),
    ((2**31,), X_LIMIT), ((2**31, 1, 1), X_LIMIT), ((2**31, 0, 1), X_LIMIT),
    ((65536, 32768, 1), PRODUCT_LIMIT), ((32768, 32768, 2), PRODUCT_LIMIT),
    ((2**16, 2**15), PRODUCT_LIMIT), ((2, 65535, 65535), PRODUCT_LIMIT),
])
def test_check_grid_rejects_past_the_limits(grid, match):
    with pytest.raises(ValueError, match=match) as info:
        check_grid("my_kernel", grid)
    assert str(info.value).startswith(f"my_kernel: launch grid {grid}")


def test_check_grid_names_the_program_count():
    with pytest.raises(ValueError, match=r"has 2147483648 programs in all"):
        check_grid("k", (65536, 32768, 1))
    with pytest.raises(ValueError, match=r"has 65536 programs along y"):
        check_grid("k", (3, 65536, 1))


def test_sm90_launch_checks_the_grid(no_launch):
    kernel = no_launch(sm90_package, "TritonError")  # any attribute: the kernel is passed in
    with pytest.raises(ValueError, match=Y_LIMIT):
        sm90_package.launch(kernel, (1, 65536, 1))


# --------------------------------------------------------------------------------------------
# attention (§3, §4, §8)
# --------------------------------------------------------------------------------------------

def _attn_args(Tq: int, N: int, B: int, Tk: int = 1, D: int = 16):
    q = expanded(Tq, N, D)
    k = expanded(Tk, 1, D)
    v = expanded(Tk, 1, D)
    cu = torch.zeros(B + 1, dtype=torch.int64)
    return q, None, k, None, v, cu, cu.clone()


@pytest.mark.parametrize("Tq, Tk, name", [(2**31, 1, "q_a"), (1, 2**31, "k_a")])
def test_flash_attention_rejects_2_31_rows(no_launch, Tq, Tk, name):
    no_launch(attention, "_attn_fwd_kernel")
    args = _attn_args(Tq, 1, 1, Tk=Tk)
    with pytest.raises(ValueError, match=rf"{name} must have at most 2147483647 rows.*got "
                                         rf"2147483648"):
        attention.flash_attention_with_lse(*args, 1, 0.25)


@pytest.mark.parametrize("N, B, match", [(65536, 1, Y_LIMIT), (1, 65536, Z_LIMIT),
                                         (4096, 4096, PRODUCT_LIMIT)])
def test_flash_attention_grid(no_launch, N, B, match):
    no_launch(attention, "_attn_fwd_kernel")
    Tq = 16 * 128  # 128 query blocks of the interpreter's 16 rows
    args = _attn_args(Tq, N, B)
    with pytest.raises(ValueError, match=r"flash_attention_with_lse.*" + match):
        attention.flash_attention_with_lse(*args, Tq, 0.25)


def test_flash_attention_loose_max_seqlen_q_is_clamped_to_the_rows():
    """``max_seqlen_q`` is an upper bound: one far past anything a grid holds sizes the grid
    as ``Tq`` would, and the results are those of the exact bound."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, 2, 16, generator=g) for s in (8, 10, 10))
    cu_q = torch.tensor([0, 3, 8], dtype=I32)
    cu_k = torch.tensor([0, 4, 10], dtype=I32)
    exact = attention.flash_attention_with_lse(q, None, k, None, v, cu_q, cu_k, 5, 0.25, True)
    loose = attention.flash_attention_with_lse(q, None, k, None, v, cu_q, cu_k, 2**40, 0.25,
                                               True)
    for a, b in zip(exact, loose, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# top-k (§4, §8)
# --------------------------------------------------------------------------------------------

def _topk_args(R: int, W: int):
    return (torch.empty(R, W, device="meta"), torch.empty(R, dtype=I32, device="meta"),
            torch.empty(R, dtype=I32, device="meta"))


def test_top_k_rejects_topk_past_the_tiles(no_launch):
    no_launch(topk, "launches")
    with pytest.raises(ValueError, match=r"topk must be at most 2147482623.*got 2147482624"):
        topk.top_k_per_row(*_topk_args(1, 64), topk.MAX_TOPK + 1, validate=False)


def test_top_k_accepts_the_largest_topk(monkeypatch):
    monkeypatch.setattr(topk, "launches", lambda *args: (None, []))
    out = topk.top_k_per_row(*_topk_args(1, 64), topk.MAX_TOPK, validate=False)
    assert out.shape == (1, topk.MAX_TOPK)


def test_top_k_rejects_2_31_columns(no_launch):
    no_launch(topk, "launches")
    with pytest.raises(ValueError, match=r"logits must have at most 2147483647 columns.*"
                                         r"got 2147483648"):
        topk.top_k_per_row(*_topk_args(1, 2**31), 16, validate=False)


@pytest.mark.parametrize("R, W, plan", [
    (2**31, 64, topk.TopkPlan()),  # rows held whole, a program a row: grid x
    (32768, 2**31 - 1, topk.TopkPlan(route="two")),  # 65536 parts a row: (parts * R, 1, 1)
    (2**31, 2**14, topk.TopkPlan(route="one")),
    (2**31, 2**14, topk.TopkPlan(route="three")),
])
def test_top_k_grid(no_launch, R, W, plan):
    no_launch(topk, "_held", "_estimate", "_mask", "_select", "_fused", "_mark_select")
    with pytest.raises(ValueError, match=r"top_k_per_row.*(" + X_LIMIT + "|" + PRODUCT_LIMIT
                       + ")"):
        topk.top_k_per_row(*_topk_args(R, W), 16, validate=False, plan=plan)


# --------------------------------------------------------------------------------------------
# decode (§4, §7)
# --------------------------------------------------------------------------------------------

def _decode_args(B: int, max_blocks: int, bs: int = 16, N: int = 2, D: int = 64):
    return (expanded(B, 1, N, D), torch.zeros(1, bs, D), expanded(B, max_blocks, dtype=I32),
            expanded(B, dtype=I32))


def test_decode_splits_on_grid_y(no_launch):
    no_launch(decode, "_triton_decode", "_triton_combine")
    plan = decode.DecodePlan(block_m=16, block_n=16, num_splits=65536, num_warps=4,
                             num_stages=1, use_tma=False)
    with pytest.raises(ValueError, match=r"mla_decode_paged.*" + Y_LIMIT):
        decode.mla_decode_paged(*_decode_args(1, 4), 0.125, head_dim_v=48, validate=False,
                                plan=plan)


def test_decode_requests_on_grid_z(no_launch):
    no_launch(decode, "_triton_decode", "_triton_combine")
    with pytest.raises(ValueError, match=r"mla_decode_paged.*" + Z_LIMIT):
        decode.mla_decode_paged(*_decode_args(65536, 4), 0.125, head_dim_v=48,
                                validate=False)


def test_decode_block_table_capacity(no_launch):
    """A table addressing more than 2^31 - 2^16 tokens: rejected by the fast path's checks of
    host metadata, before any launch (the reference has no such limit)."""
    no_launch(decode, "_triton_decode", "_triton_combine")
    bs = 64
    at_limit = _decode_args(1, decode.MAX_TABLE_TOKENS // bs, bs=bs)
    decode._prepare(*at_limit, 0.125, False, 48, None, None, False)  # the checks, no launch
    over = _decode_args(1, decode.MAX_TABLE_TOKENS // bs + 1, bs=bs)
    match = (r"block_table's capacity must be at most 2147418112 tokens.*got 33553409 blocks "
             r"x 64 = 2147418176")
    with pytest.raises(ValueError, match=match):
        decode.mla_decode_paged(*over, 0.125, head_dim_v=48, validate=False)


# --------------------------------------------------------------------------------------------
# sparse attention (§4)
# --------------------------------------------------------------------------------------------

_SPARSE_SPLITS = sparse.SparsePlan(block_m=16, block_n=16, num_splits=65536, num_warps=4,
                                   num_stages=1)


def test_sparse_decode_splits_on_grid_y(no_launch):
    no_launch(sparse, "_triton_sparse", "_triton_combine")
    q = torch.zeros(1, 1, 2, 64)
    cache = torch.zeros(2, 16, 64)
    idx = torch.zeros(1, 1, 8, dtype=I32)
    with pytest.raises(ValueError, match=r"sparse_mla_decode.*" + Y_LIMIT):
        sparse.sparse_mla_decode(q, cache, idx, 0.125, False, head_dim_v=48, validate=False,
                                 plan=_SPARSE_SPLITS)


def test_sparse_prefill_splits_on_grid_y(no_launch):
    no_launch(sparse, "_triton_sparse", "_triton_combine")
    q = torch.zeros(1, 2, 64)
    kv = torch.zeros(32, 64)
    idx = torch.zeros(1, 8, dtype=I32)
    with pytest.raises(ValueError, match=r"sparse_mla_prefill.*" + Y_LIMIT):
        sparse.sparse_mla_prefill(q, kv, idx, 0.125, 48, validate=False, plan=_SPARSE_SPLITS)


def test_index_conversion_topk_on_grid_y(no_launch):
    no_launch(sparse_index, "_convert_kernel")
    topk_ = 512 * 65535 + 1
    with pytest.raises(ValueError, match=r"convert_req_index_to_global_index.*" + Y_LIMIT):
        sparse_index.convert_req_index_to_global_index(
            torch.zeros(1, dtype=I32), torch.zeros(1, 1, dtype=I32),
            expanded(1, topk_, dtype=I32), 64, validate=False)


# --------------------------------------------------------------------------------------------
# merge and the DCP correction (§4)
# --------------------------------------------------------------------------------------------

# column blocks of 512: 65536 of them on grid y
WIDE_D = 512 * 65535 + 1


def test_merge_columns_on_grid_y(no_launch):
    no_launch(merge, "_merge_kernel")
    o = expanded(1, 1, WIDE_D, dtype=torch.float16)
    lse = torch.zeros(1, 1)
    with pytest.raises(ValueError, match=r"merge_attn_states.*" + Y_LIMIT):
        merge.merge_attn_states(o, lse, o, lse)


def test_correction_columns_on_grid_y(no_launch):
    no_launch(correction, "_correct_kernel")
    with pytest.raises(ValueError, match=r"correct_attn_out.*" + Y_LIMIT):
        correction.correct_attn_out(expanded(1, 1, WIDE_D, dtype=torch.float16),
                                    torch.zeros(2, 1, 1), 0)


# --------------------------------------------------------------------------------------------
# paged cache writes and gathers (§3, §4)
# --------------------------------------------------------------------------------------------

def test_gather_cache_long_request_on_grid_y(no_launch):
    """One request of 65536 tiles of 32 rows, checked values and all."""
    no_launch(paged_cache, "_gather_cache_kernel")
    n, bs = 32 * 65535 + 1, 64
    src = torch.zeros(1, bs, 8)
    table = torch.zeros(1, -(-n // bs), dtype=I32)
    cu = torch.tensor([0, n], dtype=I32)
    with pytest.raises(ValueError, match=r"gather_cache.*" + Y_LIMIT):
        paged_cache.gather_cache(src, expanded(n, 8), table, cu, 1)


def test_gather_cache_known_grid_product(no_launch):
    no_launch(paged_cache, "_gather_cache_kernel")
    batch = 32769
    with pytest.raises(ValueError, match=r"gather_cache.*" + PRODUCT_LIMIT):
        paged_cache.gather_cache_known(torch.zeros(1, 64, 8), torch.zeros(1, 8),
                                       expanded(batch, 1, dtype=I32),
                                       expanded(batch + 1, dtype=I32), batch, None, 0,
                                       32 * 65535)


def test_concat_and_cache_tokens_on_grid_x(no_launch):
    no_launch(paged_cache, "_concat_and_cache_kernel")
    T = 2**31
    with pytest.raises(ValueError, match=r"concat_and_cache_mla.*" + X_LIMIT):
        paged_cache.concat_and_cache_mla(expanded(T, 4), expanded(T, 2), torch.zeros(1, 4, 6),
                                         expanded(T, dtype=torch.int64), validate=False)


def test_concat_and_cache_fp8_tokens_on_grid_x(no_launch):
    no_launch(fp8, "_quant_cache_kernel")
    T = 2**31
    with pytest.raises(ValueError, match=r"concat_and_cache_fp8_ds_mla.*" + X_LIMIT):
        fp8.concat_and_cache_fp8_ds_mla(
            expanded(T, 512, dtype=torch.bfloat16), expanded(T, 64, dtype=torch.bfloat16),
            torch.zeros(1, 4, 656, dtype=torch.uint8), expanded(T, dtype=torch.int64),
            validate=False)


def test_indexer_cache_tokens_on_grid_x(no_launch):
    no_launch(indexer_cache, "_indexer_k_cache_kernel")
    T = 2**31 * indexer_cache.BLOCK_T
    with pytest.raises(ValueError, match=r"indexer_k_quant_and_cache.*" + X_LIMIT):
        indexer_cache.indexer_k_quant_and_cache(
            expanded(T, 128), torch.zeros(1, 4, 132, dtype=torch.uint8),
            expanded(T, dtype=torch.int64), 128, "ue8m0", validate=False)


# --------------------------------------------------------------------------------------------
# indexer logits (§4)
# --------------------------------------------------------------------------------------------

# one tile of 16 keys a program: more than 65535 programs along the keys from 2^20 keys
_ONE_TILE = LogitsPlan(block_n=16, max_tiles=1)


def test_fp8_mqa_logits_key_splits_on_grid_y(no_launch):
    no_launch(indexer_logits, "_ragged_kernel")
    N, e4m3 = 2**20, torch.float8_e4m3fn
    kv = (same_rows(N, 128, dtype=e4m3), expanded(N))
    ends = torch.full((1,), N, dtype=I32)
    with pytest.raises(ValueError, match=r"fp8_mqa_logits.*" + Y_LIMIT):
        indexer_logits.fp8_mqa_logits(torch.zeros(1, 4, 128, dtype=e4m3), kv,
                                      torch.zeros(1, 4), torch.zeros(1, dtype=I32), ends,
                                      validate=False, plan=_ONE_TILE)


def test_fp8_paged_mqa_logits_key_splits_on_grid_y(no_launch):
    no_launch(indexer_logits_paged, "_paged_gather_kernel", "_paged_page_kernel")
    L, bs = 2**20, 64
    with pytest.raises(ValueError, match=r"fp8_paged_mqa_logits.*" + Y_LIMIT):
        indexer_logits_paged.fp8_paged_mqa_logits(
            torch.zeros(1, 1, 4, 128, dtype=torch.float8_e4m3fn),
            torch.zeros(1, bs, 1, 132, dtype=torch.uint8), torch.zeros(1, 4),
            torch.ones(1, dtype=I32), torch.zeros(1, L // bs, dtype=I32), L, validate=False,
            plan=_ONE_TILE)
