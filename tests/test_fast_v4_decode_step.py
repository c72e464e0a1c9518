"""``mla.fast.v4.v4_decode_step``: the decode step with its indices built on the device.

Under Triton's interpreter on ``tiny-v4`` (rows of 512, window 8, top-k 3): after a ragged
prefill, decode steps through ``v4_decode_step`` write the same cache bytes and give the same
outputs as ``v4_layer_step`` on the same tokens (to its sums' rounding where the C128A scope's
padding is wider), for every layer kind, steps that close compressed entries included; the
lengths advance on the device. On a GPU the step is captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _interpreter import needs_interpreter

from mla.fast.v4 import V4FastCache, v4_decode_step, v4_layer_step
from mla.reference.v4 import V4LayerWeights, get_v4_config

C = get_v4_config("tiny-v4")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _twins(ratio: int, lens: list[int]):
    w = V4LayerWeights.random(C, ratio, seed=ratio + 1)
    fc = V4FastCache.empty(w, len(lens), 136 if ratio == 128 else 64, dtype=torch.float32,
                           device=DEVICE)
    g = torch.Generator().manual_seed(ratio)
    v4_layer_step([torch.randn(n, C.hidden_size, generator=g).to(DEVICE) for n in lens], fc,
                  path="prefill")
    return fc, copy.deepcopy(fc), g


@needs_interpreter
@pytest.mark.parametrize("ratio, lens", [(1, [9, 3]), (4, [18, 17]), (4, [2, 5]),
                                          (128, [127, 1])])
def test_decode_step_equals_the_ragged_step(ratio: int, lens: list[int]) -> None:
    ragged, fc, g = _twins(ratio, lens)
    lengths = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    for _ in range(3):  # positions 19 close ratio-4 entries, 127 a ratio-128 one
        x = torch.randn(len(lens), C.hidden_size, generator=g).to(DEVICE)
        want = torch.cat(v4_layer_step(list(x[:, None]), ragged, path="decode"))
        got = v4_decode_step(x, fc, lengths)
        tol = 1e-5 if ratio == 128 else 0.0  # a wider C128A scope: another sum order
        assert ((got - want).norm() / want.norm()).item() <= tol
    assert lengths.tolist() == ragged.lengths
    assert torch.equal(fc.window_pages, ragged.window_pages)
    if ratio > 1:
        assert torch.equal(fc.compressed_pages, ragged.compressed_pages)
        torch.testing.assert_close(fc.compressor.kv, ragged.compressor.kv, rtol=0, atol=0,
                                   equal_nan=True)  # NaN: the rows before position 0
    if ratio == 4:
        assert torch.equal(fc.index_cache, ragged.index_cache)


@needs_interpreter
def test_decode_step_checks_its_arguments() -> None:
    fc, _, _ = _twins(4, [5, 6])
    lengths = torch.tensor([5, 6], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="cache must be a V4FastCache"):
        v4_decode_step(torch.zeros(2, C.hidden_size), object(), lengths)
    with pytest.raises(ValueError, match="x"):
        v4_decode_step(torch.zeros(3, C.hidden_size, device=DEVICE), fc, lengths)
    with pytest.raises((TypeError, ValueError), match="lengths"):
        v4_decode_step(torch.zeros(2, C.hidden_size, device=DEVICE), fc, lengths.float())


@needs_interpreter
def test_a_position_outside_the_cache_gives_a_nan_row_only() -> None:
    """No host check in a capturable step: a request at the capacity (64) or before 0 gets a
    NaN output row; the other request's row is the same bits as beside a valid one."""
    fc, _, g = _twins(1, [63, 64])
    x = torch.randn(2, C.hidden_size, generator=g).to(DEVICE)
    valid = v4_decode_step(x, copy.deepcopy(fc), torch.tensor([63, 10], dtype=torch.int32,
                                                              device=DEVICE))
    for bad in (64, -1):
        lengths = torch.tensor([63, bad], dtype=torch.int32, device=DEVICE)
        out = v4_decode_step(x, copy.deepcopy(fc), lengths)
        assert torch.isnan(out[1]).all() and torch.equal(out[0], valid[0])
        assert lengths.tolist() == [64, bad + 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_step_replays_in_a_cuda_graph() -> None:
    ratio, lens = 4, [18, 17]
    ragged, fc, g = _twins(ratio, lens)
    lengths = torch.tensor(lens, dtype=torch.int32, device="cuda")
    x = torch.randn(2, C.hidden_size, generator=g).cuda()
    v4_decode_step(x, copy.deepcopy(fc), lengths.clone())  # compile every kernel
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = v4_decode_step(x, fc, lengths)
    lengths.copy_(torch.tensor(lens, dtype=torch.int32))
    for _ in range(2):
        graph.replay()
        want = torch.cat(v4_layer_step(list(x[:, None]), ragged, path="decode"))
        assert ((out - want).norm() / want.norm()).item() <= 1e-5
    assert lengths.tolist() == ragged.lengths
