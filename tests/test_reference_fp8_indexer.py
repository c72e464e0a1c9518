"""The reference's sparse layers on vLLM's fp8 index key cache against the definition.

With a uint8 ``[nb, bs, 132]`` index cache, ``sparse_prefill_forward`` and
``sparse_decode_forward`` select keys as vLLM serves them (Hadamard-rotated keys quantized into
the cache, e4m3 q with its scale in the weights, fp8 logits, ``top_k_per_row``). The definition
is the official code's fp8 indexer (``use_fp8_indexer=True`` on a float index cache: the same
rotations and quantizations, applied as quantize-dequantize): the same keys must be selected,
so the layers agree to float64 rounding, and the selection must bite (topk < context).
"""

from __future__ import annotations

import pytest
import torch

from mla.compare import assert_close, rel_err
from mla.config import get_config
from mla.reference import naive_forward
from mla.reference.indexer import IndexerWeights
from mla.reference.paged_cache import make_block_table
from mla.reference.sparse_model import (
    sparse_decode_forward,
    sparse_masked_dense_forward,
    sparse_prefill_forward,
)
from mla.weights import MLAWeights

F64 = torch.float64
FIRST, SECOND, DECODE_STEPS = [9, 1], [4, 0], [1, 2]
LENGTHS = [f + s + sum(DECODE_STEPS) for f, s in zip(FIRST, SECOND)]


def _model(topk: int, fp8_sized: bool):
    c = get_config("tiny").replace(name="tiny-fp8-index", index_n_heads=4, index_head_dim=128,
                                   index_topk=topk)
    if fp8_sized:
        c = c.replace(kv_lora_rank=512, qk_rope_head_dim=64, num_heads=2)
    w = MLAWeights.random(c, seed=31, dtype=F64)
    iw = IndexerWeights.random(c, seed=32, dtype=F64)
    gen = torch.Generator().manual_seed(33)
    hidden = [torch.randn(n, c.hidden_size, generator=gen, dtype=F64) for n in LENGTHS]
    return w, iw, hidden


def _serve(w, iw, hidden, fp8_index: bool, fp8_kv: bool, bs: int = 4):
    """Both requests prefilled in two steps, then decoded (s_q 1 and 2); outputs per request."""
    c = w.config
    bt, nb = make_block_table(LENGTHS, bs, spare_blocks=2, seed=5)
    if fp8_kv:
        kv = torch.full((nb, bs, 656), 0xFF, dtype=torch.uint8)
    else:
        kv = torch.full((nb, bs, c.latent_dim), float("nan"), dtype=F64)
    if fp8_index:
        ik = torch.full((nb, bs, 132), 0xFF, dtype=torch.uint8)
        use_fp8 = None
    else:
        ik = torch.full((nb, bs, c.index_head_dim), float("nan"), dtype=F64)
        use_fp8 = True
    outs: list[list[torch.Tensor]] = [[], []]
    done = [0, 0]
    for step in (FIRST, SECOND):
        parts = [hidden[i][done[i]: done[i] + step[i]] for i in range(2)]
        qsl = torch.tensor([0, step[0], step[0] + step[1]])
        out = sparse_prefill_forward(w, iw, torch.cat(parts), qsl, list(done), kv, ik, bt,
                                     use_fp8)
        outs[0].append(out[: step[0]])
        outs[1].append(out[step[0]:])
        done = [done[i] + step[i] for i in range(2)]
    for s_q in DECODE_STEPS:
        h = torch.stack([hidden[i][done[i]: done[i] + s_q] for i in range(2)])
        out = sparse_decode_forward(w, iw, h, kv, ik, bt, torch.tensor(done), use_fp8)
        for i in range(2):
            outs[i].append(out[i])
        done = [d + s_q for d in done]
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("fp8_kv", [False, True])
def test_fp8_index_cache_selects_as_the_definition(fp8_kv: bool) -> None:
    w, iw, hidden = _model(topk=3, fp8_sized=fp8_kv)
    served = _serve(w, iw, hidden, fp8_index=True, fp8_kv=fp8_kv)
    definition = _serve(w, iw, hidden, fp8_index=False, fp8_kv=fp8_kv)
    for i, h in enumerate(hidden):
        assert_close(served[i], definition[i], 1e-10, name=f"request {i}")
        masked = sparse_masked_dense_forward(w, iw, h, use_fp8_indexer=True,
                                             fp8_kv_cache=fp8_kv)
        assert_close(served[i], masked, 1e-10, name=f"request {i} vs masked dense")
    # the selection bites: the first request's 16 tokens are more than topk = 3
    assert rel_err(served[0], naive_forward(w, hidden[0])) > 1e-2


def test_fp8_index_cache_differs_from_the_float_indexer() -> None:
    """The fp8 path is not the float one: with 3 of 16 keys kept, some selection moves."""
    w, iw, hidden = _model(topk=3, fp8_sized=False)
    served = _serve(w, iw, hidden, fp8_index=True, fp8_kv=False)
    plain = [sparse_masked_dense_forward(w, iw, h, use_fp8_indexer=False) for h in hidden]
    assert max(rel_err(s, p) for s, p in zip(served, plain)) > 1e-6


def test_fp8_index_cache_refuses_the_float_indexer() -> None:
    w, iw, hidden = _model(topk=3, fp8_sized=False)
    bt, nb = make_block_table([4], 4, seed=1)
    kv = torch.zeros(nb, 4, w.config.latent_dim, dtype=F64)
    ik = torch.zeros(nb, 4, 132, dtype=torch.uint8)
    with pytest.raises(ValueError, match="use_fp8_indexer"):
        sparse_decode_forward(w, iw, hidden[0][:1][None], kv, ik, bt, torch.tensor([2]), False)
    with pytest.raises(ValueError, match="132"):
        sparse_decode_forward(w, iw, hidden[0][:1][None], kv, ik[..., :130], bt,
                              torch.tensor([2]))
    small = w.config.replace(index_head_dim=64)
    with pytest.raises(ValueError, match="index_head_dim"):
        sparse_decode_forward(MLAWeights.random(small, dtype=F64),
                              IndexerWeights.random(small, dtype=F64), hidden[0][:1][None],
                              kv, ik, bt, torch.tensor([2]))
