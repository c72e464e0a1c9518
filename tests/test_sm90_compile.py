"""The Gluon sm_90 kernels, compiled for the H200 on a machine without a GPU.

The Triton interpreter cannot run Gluon, so the CPU tests cannot check what these kernels
compute (``python -m mla.check`` does, on the GPU). They can check what the kernels compile to:
the ``wgmma`` shapes that say how the two warp groups share the work, shared memory that fits one
program per SM, no register spills, and how the keys arrive (TMA, or 16-byte ``cp.async``).

Compiling runs in a child process (``benchmarks/sm90_compile.py`` does the work): a process that
imported ``triton`` with ``TRITON_INTERPRET=1``, as ``conftest.py`` sets it here, has every
``@jit`` function, the language's own helpers included, replaced by an interpreted one and cannot
compile for a GPU ("Unsupported function referenced: InterpretedFunction"); unsetting the
variable afterwards changes nothing. The child gets the environment without it, which affects
nothing else: it only compiles. What it printed for the tree's sources is recorded
(``tests/_compiled.py``), so an unchanged tree reads it instead of compiling again.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from _compiled import compiled
from _interpreter import needs_interpreter

pytest.importorskip("triton.experimental.gluon")

from triton.compiler.errors import CompilationError  # noqa: E402

import mla.fast.decode as fast_decode  # noqa: E402
import mla.fast.sparse as fast_sparse  # noqa: E402
from mla.fast import sm90  # noqa: E402
from mla.fast.decode import DecodePlan, mla_decode_paged  # noqa: E402
from mla.fast.sm90 import decode as sm90_decode  # noqa: E402
from mla.fast.sm90 import sparse as sm90_sparse  # noqa: E402
from mla.fast.sparse import SparsePlan, sparse_mla_prefill  # noqa: E402
from mla.reference.decode import mla_decode_paged as ref_decode  # noqa: E402
from mla.reference.paged_cache import make_block_table  # noqa: E402
from mla.reference.sparse import sparse_mla_prefill as ref_prefill  # noqa: E402

SMEM_LIMIT = 232448  # bytes of shared memory per program on an H200 (227 KB)

# s_q, causal and split: each value of each beside each of the others' (a covering set, not
# the 8 combinations: every flag's code is compiled both ways)
DECODE = [dict(N=128, S_Q=s_q, CAUSAL=causal, SPLIT=split)
          for s_q, causal, split in ((1, False, False), (1, True, True), (2, False, True),
                                     (2, True, False))]
DECODE += [dict(N=16, S_Q=4, CAUSAL=True), dict(N=128, S_Q=1, dtype="fp16"),
           dict(N=128, S_Q=2, CAUSAL=True, HAS_SINK=True)]
# the coupled kernel without flags and with all three (each flag's code is a branch of its
# own; together they hold the most registers)
SPARSE = [dict(FP8=fp8, **flags) for fp8 in (True, False) for flags in (
    {}, {"SPLIT": True, "HAS_TOPK_LEN": True, "HAS_MAXL": True})]
SPARSE += [dict(FP8=False, N=64, S=2, dtype="fp16")]
# DeepSeek-V4: MODEL1 pages and rows of 512 in q's dtype (no rope dot), sinks, the
# unvalidated range check and a second scope
SPARSE += [dict(FP8=False, MODEL1=True, N=64),
           dict(FP8=False, MODEL1=True, HAS_EXTRA=True, HAS_TOPK_LEN=True, HAS_TOPK_LEN2=True,
                HAS_SINK=True, CHECK_RANGE=True, SPLIT=True),
           dict(FP8=True, HAS_EXTRA=True, HAS_SINK=True, CHECK_RANGE=True, HAS_TOPK_LEN=True),
           dict(FP8=False, D=512, N=64, HAS_MAXL=True, HAS_SINK=True, HAS_TOPK_LEN=True)]
# the warp-specialized MODEL1 kernel, the default plan's at 64 heads (a producer group of
# 104 registers: 88 spilled 16 B; the next tile's entries held across the loop spilled 8-40 B),
# unsplit at 128 heads and split at 64
_V4 = dict(FP8=False, MODEL1=True, HAS_EXTRA=True, HAS_TOPK_LEN=True, HAS_TOPK_LEN2=True,
           HAS_SINK=True, CHECK_RANGE=True)
SPARSE += [dict(_V4, MODEL1_KERNEL="warp_specialized", **shape)
           for shape in ({}, {"SPLIT": True, "N": 64})]
# the warp-specialized fp8_ds_mla kernel (``SparsePlan.ds_mla_kernel``; a producer group of 104
# registers, the e4m3 bytes held as int32 words: as uint8 they took a register a byte and
# spilled 840 B): unsplit at 128 heads, split at 64 with the V4 flags, a second scope
_DS = dict(FP8=True, DS_MLA_KERNEL="warp_specialized")
SPARSE += [dict(_DS, **flags) for flags in (
    {}, {"SPLIT": True, "N": 64, "HAS_TOPK_LEN": True, "HAS_SINK": True, "CHECK_RANGE": True},
    {"HAS_EXTRA": True, "HAS_TOPK_LEN": True, "HAS_TOPK_LEN2": True, "HAS_SINK": True,
     "CHECK_RANGE": True})]
# the warp-specialized kernel over rows in q's dtype (``SparsePlan.bf16_kernel``; a producer
# group of 56 registers that only issues cp.async copies, tracked by mbarriers): prefill at 128
# heads, split at 64 with lengths and a sink, DeepSeek-V4's rows of 512, decode with the range
# check, a second scope, fp16
_BF = dict(FP8=False, BF16_KERNEL="warp_specialized")
SPARSE += [dict(_BF, **flags) for flags in (
    {"HAS_MAXL": True},
    {"HAS_MAXL": True, "HAS_TOPK_LEN": True, "HAS_SINK": True, "SPLIT": True, "N": 64},
    {"D": 512, "N": 64, "HAS_MAXL": True, "HAS_SINK": True, "HAS_TOPK_LEN": True},
    {"HAS_TOPK_LEN": True, "CHECK_RANGE": True},
    {"HAS_EXTRA": True, "HAS_TOPK_LEN": True, "HAS_TOPK_LEN2": True, "HAS_SINK": True,
     "CHECK_RANGE": True},
    {"N": 64, "S": 2, "dtype": "fp16"})]
# the seesaw kernel over rows in q's dtype, with its producer warp group
# (``SparsePlan.bf16_kernel="seesaw_producer"``, prefill's default: one scope): 128 heads, 64
# with lengths, a sink and splits, rows of 512, the decode's range check, fp16, equal and
# fixed-length splits
_SS = dict(FP8=False, BF16_KERNEL="seesaw_producer")
SPARSE += [dict(_SS, **flags) for flags in (
    {"HAS_MAXL": True},
    {"HAS_MAXL": True, "HAS_TOPK_LEN": True, "HAS_SINK": True, "SPLIT": True, "N": 64},
    {"HAS_TOPK_LEN": True, "CHECK_RANGE": True, "HAS_SINK": True, "SPLIT": True,
     "SPLIT_TILES": 8, "SPLIT_CAP": 16},
    {"D": 512, "N": 64, "HAS_MAXL": True, "HAS_SINK": True, "HAS_TOPK_LEN": True},
    {"HAS_TOPK_LEN": True, "CHECK_RANGE": True},
    {"N": 64, "S": 2, "dtype": "fp16"})]
# the batch-invariant plans' fixed-length splits (``split_keys``, ``split_entries``): the
# coupled decode kernel split, and each sparse Gluon kernel split
_FIXED = dict(SPLIT=True, SPLIT_TILES=8, SPLIT_CAP=16)
DECODE += [dict(N=128, S_Q=1, **_FIXED), dict(N=128, S_Q=2, CAUSAL=True, HAS_SINK=True,
                                              **_FIXED)]
SPARSE += [dict(FP8=True, HAS_SINK=True, **_FIXED),
           dict(_V4, MODEL1_KERNEL="warp_specialized", N=64, **_FIXED),
           dict(_DS, HAS_SINK=True, **_FIXED),
           dict(_BF, N=64, CHECK_RANGE=True, HAS_SINK=True, **_FIXED)]
VARIANTS = [("decode", a) for a in DECODE] + [("sparse", a) for a in SPARSE]
# the Triton decode kernel with plan_decode's default plans (every float32 call runs it);
# float16's plans are bfloat16's (the same tiles and stages, so the same shared memory)
TRITON_DECODE = [dict(N=n, S_Q=s_q, CAUSAL=s_q > 1, dtype=dt) for dt in ("fp32", "bf16")
                 for n in (16, 128) for s_q in (1, 2)]


def _id(variant: tuple[str, dict]) -> str:
    kernel, args = variant
    return "-".join([kernel] + [f"{k}={v}" for k, v in args.items()])


_CHILD = ("import json, sys\n"
          "from benchmarks.sm90_compile import compile_facts\n"
          "print(json.dumps([compile_facts(k, a) for k, a in json.loads(sys.argv[1])]))\n")


def _compile_in_child(variants: list[tuple[str, dict]]) -> list[dict]:
    return compiled(["-c", _CHILD, json.dumps(variants)], timeout=600)


@functools.cache  # lru_cache without a bound
def _facts() -> dict[str, dict]:
    """Facts of every variant, each compiled once: decode and sparse in two children at once."""
    groups = [[v for v in VARIANTS if v[0] == kernel] for kernel in ("decode", "sparse")]
    with ThreadPoolExecutor(len(groups)) as pool:
        results = list(pool.map(_compile_in_child, groups))
    return {_id(v): f for group, res in zip(groups, results) for v, f in zip(group, res)}


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_each_warp_group_issues_only_its_own_wgmma(variant):
    # Per 64-key tile a warp group computes 64 rows x 32 keys of the logits over the 576 dims
    # of q and K: 576 / 16 = 36 wgmma m64n32k16; and its 64 x 256 half of the output over the
    # tile's 64 keys: 64 / 16 = 4 wgmma m64n256k16. Both groups run the same instructions on
    # their own halves, so the PTX holds 36 and 4 per place a tile is computed (a compiler
    # that copies the loop body doubles both: hence the ratio 9 : 1). Triton's own kernel had
    # both warp groups compute the same 64 x 64 logits (72 n32 per tile): a ratio above 9, or
    # any other shape, means work is issued twice or split differently.
    f = _facts()[_id(variant)]
    dt = {"bf16": "bf16", "fp16": "f16"}[variant[1].get("dtype", "bf16")]  # PTX type names
    d = 512 if variant[1].get("MODEL1") or variant[1].get("D") == 512 else 576
    shapes = {}
    for instr, count in f["wgmma"].items():
        m = re.fullmatch(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.(\w+)\.(\w+)",
                         instr)
        assert m is not None and m.group(2) == m.group(3) == dt, instr
        shapes[m.group(1)] = shapes.get(m.group(1), 0) + count
    if variant[1].get("BF16_KERNEL") == "seesaw_producer":
        # each group computes a whole tile's logits, 64 x 64 over d dims (d / 16 m64n64k16)
        # in three places (group 0's pair and lone tile, group 1's pair), and multiplies its
        # own P and the other group's into its 64 x 256 half (4 m64n256k16 each): 8 in a
        # pair, 4 for a lone tile, in each group
        assert shapes == {"m64n64k16": 3 * d // 16, "m64n256k16": 24}, f["wgmma"]
        return
    assert set(shapes) == {"m64n32k16", "m64n256k16"}, f["wgmma"]
    n32, n256 = shapes["m64n32k16"], shapes["m64n256k16"]
    # DeepSeek-V4's rows (MODEL1 or plain) are 512 wide: 32 n32 per tile
    ratio = 8 if variant[1].get("MODEL1") or variant[1].get("D") == 512 else 9
    assert n256 >= 4 and n256 % 4 == 0 and n32 == ratio * n256, f["wgmma"]


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_one_program_fits_an_sm_without_spills(variant):
    f = _facts()[_id(variant)]
    assert f["shared"] <= SMEM_LIMIT, f"{f['shared']} B of shared memory"
    # 8 warps: 65536 registers / 256 threads allow 255 each; past that ptxas spills to the
    # stack (local memory), which a 64 x 256 float32 accumulator per warp group would not
    # survive at speed
    # the warp-specialized fp8_ds_mla kernel with topk_length: LLVM hoists one thread index
    # (the producer's row in its tiles) out of Triton's worker loop, above the setmaxnreg.dec
    # to 24 registers, and ptxas keeps it on the stack across it: one 4-byte store a program
    # before the producer starts, one load before its loop (read off the SASS; nothing spills
    # in a loop). The other variants rematerialize the same hoisted value.
    # The seesaw kernel with the range check: ptxas keeps four 4-byte values of a consumer
    # group on the stack (two with fixed-length splits), stored before its loop and loaded
    # once after it (read off the SASS), pinned here so that any growth shows.
    args = variant[1]
    hoisted = 8 if args.get("DS_MLA_KERNEL") == "warp_specialized" and (
        args.get("HAS_TOPK_LEN") or args.get("HAS_TOPK_LEN2")) else 0
    if args.get("BF16_KERNEL") == "seesaw_producer" and args.get("CHECK_RANGE"):
        hoisted = 8 if args.get("SPLIT_TILES") else 16
    assert f["reg"] <= 255 and f["stack"] <= hoisted and f["local"] == 0, f
    assert not f["ptx_local"], "the PTX declares local memory"


@functools.cache
def _triton_decode_facts() -> dict[str, dict]:
    variants = [("triton_decode", a) for a in TRITON_DECODE]
    return {_id(v): f for v, f in zip(variants, _compile_in_child(variants))}


@pytest.mark.parametrize("args", TRITON_DECODE, ids=lambda a: _id(("triton_decode", a)))
def test_triton_decode_default_plans_fit_an_sm(args):
    # float32 at 128 heads once asked for 295 KB (64-row programs, two stages of 32-key tiles)
    # and failed to launch on the H200; every default plan must fit
    f = _triton_decode_facts()[_id(("triton_decode", args))]
    assert f["shared"] <= SMEM_LIMIT, f"{f['shared']} B of shared memory"


@pytest.mark.parametrize("args", DECODE, ids=lambda a: _id(("decode", a)))
def test_decode_loads_key_tiles_by_tma(args):
    f = _facts()[_id(("decode", args))]
    assert f["tma"] > 0, "no cp.async.bulk.tensor: key tiles are not loaded by TMA"
    assert f["cp_async_16"] == f["cp_async_other"] == 0, f


@pytest.mark.parametrize("args", SPARSE, ids=lambda a: _id(("sparse", a)))
def test_sparse_gathers_rows_with_16_byte_cp_async(args):
    f = _facts()[_id(("sparse", args))]
    assert f["tma"] == 0 and f["cp_async_16"] > 0, f
    if args["FP8"]:
        # the four float32 scales of a row may go as 4-byte copies; the bulk is 16-byte
        assert f["cp_async_other"] < f["cp_async_16"], f
    else:
        assert f["cp_async_other"] == 0, f"narrower copies than 16 bytes: {f}"


@pytest.mark.parametrize("args", [a for a in SPARSE if a.get("BF16_KERNEL")],
                         ids=lambda a: _id(("sparse", a)))
def test_bf16_producer_arrives_when_its_copies_land(args):
    # the warp-specialized kernel over rows in q's dtype: the producer's copies end in
    # ``cp.async.mbarrier.arrive.noinc`` on ready[s] (it never waits for them); no other
    # kernel tracks copies by mbarrier
    f = _facts()[_id(("sparse", args))]
    assert f["cp_async_mbarrier"] >= 1, f


@functools.cache
def _logits_facts() -> list[dict]:
    # the third: rows compressed to one column (M = 1), which Triton would make a constant
    return _compile_in_child([("logits", {"COMPRESSED": True}), ("logits", {"COMPRESSED": False}),
                              ("logits", {"COMPRESSED": True, "M": 1})])


@pytest.mark.parametrize("compressed", [True, False, "one column"])
def test_logits_kernel_shares_an_sm_four_ways(compressed):
    # mla.fast.sm90.logits: per tile of 64 keys one wgmma chain over the 128 codes for both
    # queries' heads (N = 128), k32 each: 4 m64n128k32 e4m3 a tile, in one place; keys by
    # TMA only.
    # Four programs a SM (what its key split aims at) need at most 128 registers a thread
    # (65536 / (4 x 128)) and a quarter of the shared memory, without spills.
    f = _logits_facts()[{True: 0, False: 1, "one column": 2}[compressed]]
    assert f["wgmma"] == {"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3": 4}, f
    assert f["tma"] >= 1 and f["cp_async_16"] == f["cp_async_other"] == 0, f
    assert f["reg"] <= 128 and f["stack"] == 0 and f["local"] == 0, f
    assert not f["ptx_local"] and 4 * f["shared"] <= SMEM_LIMIT, f


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_supported_is_false_for_cpu_tensors(dtype):
    q = torch.zeros(2, 1, 128, 576, dtype=dtype)
    kv_cache = torch.zeros(4, 64, 576, dtype=dtype)
    assert sm90_decode.supported(q, kv_cache, 512) is False
    q = torch.zeros(3, 128, 576, dtype=dtype)
    assert sm90_sparse.supported(q, kv_cache.view(-1, 576), 512, False, 64) is False
    kv8 = torch.zeros(256, 656, dtype=torch.uint8)
    assert sm90_sparse.supported(q, kv8, 512, True, 64) is False


# ------------------------------------------------------------------------------------------
# A Triton whose Gluon cannot build the kernels: the Triton kernels run instead, one warning
# ------------------------------------------------------------------------------------------

@pytest.fixture
def gluon_state(monkeypatch):
    """``mla.fast.sm90``'s verdict as a fresh process starts with it, restored afterwards."""
    monkeypatch.setattr(sm90, "_why_not", "")
    monkeypatch.setattr(sm90, "_imported", False)
    monkeypatch.setattr(sm90, "_unbuilt", {})


class _Unbuildable:
    """A Gluon kernel as Triton 3.7 treated 3.6's ``gl.thread_barrier``: compiling it raises."""

    def __init__(self, name: str) -> None:
        self.__name__ = name
        self.attempts = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.attempts += 1
            raise CompilationError(None, None, "AttributeError(\"module 'triton.experimental."
                                   "gluon.language' has no attribute 'thread_barrier'\")")
        return launch


def _decode_inputs():
    g = torch.Generator().manual_seed(0)
    bt, nb = make_block_table([37, 20], 16, seed=0)
    kv = torch.randn(nb, 16, 40, generator=g)
    q = torch.randn(2, 1, 4, 40, generator=g)
    return q, kv, bt, torch.tensor([37, 20], dtype=torch.int32)


@needs_interpreter
def test_gluon_kernel_that_cannot_be_built_falls_back_with_one_warning(monkeypatch,
                                                                        gluon_state):
    """The first 64-row call routed to a Gluon kernel that does not compile warns once
    (RuntimeWarning naming the kernel, the Triton version and the error) and returns the
    Triton kernel's result; later calls that would launch it go to Triton without trying or
    warning again. The other Gluon kernels are still tried: one kernel's failure gives up that
    kernel alone."""
    decode_kernel = _Unbuildable("decode_kernel")
    sparse_kernel = _Unbuildable("sparse_kernel")
    monkeypatch.setattr(sm90_decode, "decode_kernel", decode_kernel)
    monkeypatch.setattr(sm90_sparse, "sparse_kernel", sparse_kernel)
    # as on an H200: the route is taken whenever the Gluon kernels are usable
    monkeypatch.setattr(fast_decode, "_sm90_route", lambda *args: sm90.usable())
    monkeypatch.setattr(fast_sparse, "_sm90_route", lambda *args: sm90.usable())
    q, kv, bt, sl = _decode_inputs()
    plan = DecodePlan(64, 16, 2, 4, 1)
    ref_out, ref_lse = ref_decode(q.double(), kv.double(), bt, sl, 0.2, False, 32)
    with pytest.warns(RuntimeWarning, match=r"Gluon sm_90 kernel decode_kernel cannot be built "
                      r"with triton \S+ \(CompilationError: .*thread_barrier") as record:
        out, lse = mla_decode_paged(q, kv, bt, sl, 0.2, False, 32, plan=plan)
    assert len(record) == 1 and decode_kernel.attempts == 1
    assert torch.allclose(out.double(), ref_out, atol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again, _ = mla_decode_paged(q, kv, bt, sl, 0.2, False, 32, plan=plan)
    assert torch.equal(again, out) and decode_kernel.attempts == 1
    assert sm90.usable() and not sm90.usable("decode_kernel")
    # the sparse kernel is still tried (and, unbuildable too, given up in its turn)
    qs, kvs = torch.randn(3, 4, 40), torch.randn(10, 40)
    idx = torch.randint(-1, 10, (3, 16), dtype=torch.int32)
    coupled = SparsePlan(64, 16, 1, 4, 1, bf16_kernel="staged")
    with pytest.warns(RuntimeWarning, match="Gluon sm_90 kernel sparse_kernel cannot") as record:
        got = sparse_mla_prefill(qs, kvs, idx, 0.2, 32, plan=coupled)
    assert len(record) == 1 and sparse_kernel.attempts == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got_again = sparse_mla_prefill(qs, kvs, idx, 0.2, 32, plan=coupled)
    assert sparse_kernel.attempts == 1
    ref = ref_prefill(qs.double(), kvs.double(), idx, 0.2, 32)
    for res in (got, got_again):
        assert all(torch.allclose(a.double(), b, atol=1e-5) for a, b in zip(res, ref))


def test_gluon_that_fails_to_import_falls_back_with_one_warning(monkeypatch, gluon_state):
    """A Triton without the Gluon names the kernels import (their modules fail to import):
    ``usable()`` is False after one warning, and stays False without another."""
    monkeypatch.setitem(sys.modules, "mla.fast.sm90.decode", None)
    monkeypatch.delattr(sm90, "decode")
    with pytest.warns(RuntimeWarning, match="Gluon sm_90 kernels cannot be built"):
        assert sm90.usable() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sm90.usable() is False


def test_the_barrier_is_this_triton_s():
    """3.6 names the CTA barrier ``gl.thread_barrier``, 3.7 ``gl.barrier``: the kernels use
    whichever this Triton has."""
    from triton.experimental.gluon import language as gl

    from mla.fast.sm90.softmax import barrier

    assert barrier is getattr(gl, "barrier", getattr(gl, "thread_barrier", None))
