"""The layer steps written once (``mla.reference.model.run_decode``, ``run_sparse_decode``, and
the DCP forwards on top of them): the fast paths are those steps with the fast kernels, so the
fast path's own rule has to hold through the shared code.

- a fast decode step (dense, sparse, DCP) with ``validate=False`` calls none of the tensor
  methods that copy a device value to the host, and returns what the validating step returns;
  the validating twin does read (so the check can fail);
- the reference's DCP forwards are the single-rank steps with ``dcp_layer_ops``: one rank of
  one gives the single-rank output bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

import mla.fast.dcp as fdcp
import mla.fast.model as fast_model
import mla.fast.sparse.model as fast_sparse
from benchmarks.layer_check import build_dense
from benchmarks.sparse_layer_check import build_sparse
from mla.config import get_config
from mla.reference import dcp as rdcp
from mla.reference.model import decode_forward, write_context
from mla.reference.paged_cache import make_block_table
from mla.weights import MLAWeights

T = TypeVar("T")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # the interpreter's bf16 dots
HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__")
DENSE = get_config("deepseek-v3").replace(num_heads=4)
SPARSE = get_config("deepseek-v3.2").replace(num_heads=4, index_n_heads=8, index_topk=16)
TINY = get_config("tiny").replace(name="tiny-8h", num_heads=8)


def _without_host_reads(monkeypatch: pytest.MonkeyPatch, step: Callable[[], T]) -> T:
    """``step()`` with every device-to-host read raising; the patch is undone after."""
    def forbidden(*args: object, **kwargs: object) -> object:
        raise AssertionError("a host read of a device value")

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    try:
        return step()
    finally:
        monkeypatch.undo()


def test_dense_decode_step_reads_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    w, cache, bt, hidden = build_dense(DENSE, DTYPE, DEVICE, [10, 3], [2, 2], 16, 0)
    sl = torch.tensor([10, 3], dtype=torch.int32, device=DEVICE)
    h = hidden.view(2, 2, -1)
    want = fast_model.decode_forward(w, h, cache.clone(), bt, sl, validate=True)
    got = _without_host_reads(monkeypatch, lambda: fast_model.decode_forward(
        w, h, cache.clone(), bt, sl, validate=False))
    assert torch.equal(got, want)
    with pytest.raises(AssertionError, match="host read"):
        _without_host_reads(monkeypatch, lambda: fast_model.decode_forward(
            w, h, cache.clone(), bt, sl, validate=True))


def test_sparse_decode_step_reads_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    w, iw, kv, ik, bt, hidden = build_sparse(SPARSE, DTYPE, DEVICE, [30, 9], [1, 1], 16, True,
                                             0)
    sl = torch.tensor([30, 9], dtype=torch.int32, device=DEVICE)
    h = hidden.view(2, 1, -1)

    def step(validate: bool) -> torch.Tensor:
        return fast_sparse.sparse_decode_forward(w, iw, h, kv.clone(), ik.clone(), bt, sl,
                                                 validate=validate)

    want = step(True)
    assert torch.equal(_without_host_reads(monkeypatch, lambda: step(False)), want)
    with pytest.raises(AssertionError, match="host read"):
        _without_host_reads(monkeypatch, lambda: step(True))


def _tiny_dcp_inputs(device: str = "cpu", dtype: torch.dtype = torch.float32
                     ) -> tuple[MLAWeights, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor]:
    w = MLAWeights.random(TINY, seed=0, dtype=torch.float32)
    contexts, s_q = [5, 13], 2
    table, nb = make_block_table([n + s_q for n in contexts], 16, spare_blocks=1, seed=1)
    kv = torch.full((nb, 16, TINY.latent_dim), float("nan"))
    g = torch.Generator().manual_seed(2)
    for i, n in enumerate(contexts):
        write_context(w, torch.randn(n, TINY.hidden_size, generator=g), kv, table[i])
    hidden = torch.randn(2, s_q, TINY.hidden_size, generator=g)
    sl = torch.tensor(contexts, dtype=torch.int32)
    return (w.to(dtype=dtype, device=device), hidden.to(device, dtype), kv.to(device, dtype),
            table.to(device), sl.to(device))


def test_dcp_decode_step_reads_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank shards its cache first (host-side set-up), then runs the step unvalidated."""
    w, hidden, kv, table, sl = _tiny_dcp_inputs(DEVICE, DTYPE)
    W = 2
    shards = rdcp.shard_kv_cache(kv, table, sl, W, capacities=(sl + 2).tolist())

    def step(comm: rdcp.Communicator, validate: bool) -> torch.Tensor:
        s = shards[comm.rank]
        return fdcp.dcp_decode_forward(w, hidden, s.kv_cache.clone(), s.block_table, sl, comm,
                                       validate=validate)

    want = rdcp.same_on_all_ranks(rdcp.run_simulated(W, functools.partial(step,
                                                                          validate=True)))
    got = _without_host_reads(monkeypatch, lambda: rdcp.run_simulated(
        W, functools.partial(step, validate=False)))
    assert torch.equal(rdcp.same_on_all_ranks(got), want)
    with pytest.raises(AssertionError, match="host read"):
        _without_host_reads(monkeypatch, lambda: rdcp.run_simulated(
            W, functools.partial(step, validate=True)))


def test_reference_dcp_on_one_rank_is_the_single_rank_step() -> None:
    """``dcp_layer_ops`` on a group of one: the same heads, the same kernels' arithmetic."""
    w, hidden, kv, table, sl = _tiny_dcp_inputs()
    w64 = w.to(dtype=torch.float64)
    want = decode_forward(w64, hidden.double(), kv.double(), table, sl)
    got = rdcp.run_simulated(1, functools.partial(
        rdcp.dcp_decode_forward_rank, weights=w64, hidden=hidden.double(),
        kv_cache=kv.double(), block_table=table, cache_seqlens=sl))[0]
    assert torch.equal(got, want)
