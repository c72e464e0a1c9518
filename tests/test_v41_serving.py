"""DeepSeek-V4.1's attention layers in their serving form (``mla.reference.v4.serving41``:
paged window, compressed and index key caches shared across layers, ``sparse_mla_decode`` with
two scopes, ``sparse_mla_prefill`` on combined indices) against their definition
(``layer41.v41_stack_definition``), on the tiny seven-layer model of
``tests/test_v41_layer_definition.py``: a window-only layer, a ratio-2 kv and index source and
its consumer, a ratio-1 kv source that is the candidate source, a ratio-1 index source that
masks to its candidates, their consumer, and a window-only layer.

Error budget. Both sides compute the same float64 numbers in another order (attention over at
most W + index_topk keys, two projections of width <= 512): a few 1e-16 relative. The bound,
1e-10, is the serving form's contract; a convention error (a window edge, a missing sink, a
misplaced entry or page) moves the output by more than 1e-3. With the MXFP8 / NVFP4 caches
both sides read the same rounded keys (the definition through ``v41_cache_round``, serving
from the cache's bytes), so the same bound holds."""

from __future__ import annotations

import pytest
import torch

from mla.reference.fp8_v41 import FP8_V41_BYTES, NVFP4_V41_BYTES
from mla.reference.v4.config import get_v4_config
from mla.reference.v4.layer41 import (
    V41LayerWeights,
    v41_cache_round,
    v41_indexer_topk,
    v41_kv_source,
    v41_layer_definition,
    v41_stack_definition,
)
from mla.reference.v4.serving41 import V41ServingCache, v41_serving_step

F64 = torch.float64
RTOL = 1e-10
CONFIG = get_v4_config("tiny-v41")
NL = CONFIG.num_layers
WEIGHTS = [V41LayerWeights.random(CONFIG, i, seed=10 + i) for i in range(NL)]
# small pages, so that requests of a dozen tokens span several, none a multiple of a page
PAGES = dict(window_page=4, compressed_page_tokens=6)


def _xs(lengths: list[int], seed: int) -> list[list[torch.Tensor]]:
    """xs[l][b]: layer l's hidden states of request b, all its tokens."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(L, CONFIG.hidden_size, generator=g, dtype=F64) for L in lengths]
            for _ in range(NL)]


def _serve(xs: list[list[torch.Tensor]], steps: list[list[int]], path: str,
           kv_cache_dtype: str = "float64", **pages: int
           ) -> tuple[list[list[torch.Tensor]], list[dict[int, list[torch.Tensor]]]]:
    """Serve ``steps[i][b]`` new tokens a step; every layer's output and each step's top-k."""
    lengths = [x.shape[0] for x in xs[0]]
    assert [sum(s[b] for s in steps) for b in range(len(lengths))] == lengths
    cache = V41ServingCache.empty(WEIGHTS, len(lengths), max(lengths), seed=7,
                                  kv_cache_dtype=kv_cache_dtype, **(pages or PAGES))
    done = [0] * len(lengths)
    outs: list[list[list[torch.Tensor]]] = [[[] for _ in lengths] for _ in range(NL)]
    topks = []
    for step in steps:
        new = [[x[done[b]:done[b] + n] for b, (x, n) in enumerate(zip(xl, step))] for xl in xs]
        got = v41_serving_step(new, cache, path=path)
        for l in range(NL):
            for b in range(len(lengths)):
                outs[l][b].append(got[l][b])
        topks.append(cache.step_topk)
        done = [d + n for d, n in zip(done, step)]
    return [[torch.cat(o) for o in ol] for ol in outs], topks


def _check_equal(xs: list[list[torch.Tensor]], served: list[list[torch.Tensor]],
                 kv_cache_dtype: str = "float64") -> list[list]:
    traces = []
    for b in range(len(xs[0])):
        tr = v41_stack_definition([xl[b] for xl in xs], WEIGHTS, kv_cache_dtype=kv_cache_dtype)
        for l in range(NL):
            want, got = tr[l].out, served[l][b]
            err = float((got - want).abs().max() / want.abs().max())
            assert err <= RTOL, (b, l, err)
        traces.append(tr)
    return traces


@pytest.mark.parametrize("s_q", [1, 2])
def test_decode_equals_definition(s_q: int) -> None:
    """Decode rows (s_q = 1, and MTP's s_q = 2: each token its own window and top-k) of a
    ragged batch, 13, 8 and 1 tokens: ratios 0, 1, 2, sources and consumers, the short-context
    fill in the early steps and logits with candidates later."""
    lengths = [13, 8, 1]
    steps, done = [], [0, 0, 0]
    while done != lengths:
        step = [min(s_q, L - d) for L, d in zip(lengths, done)]
        steps.append(step)
        done = [d + n for d, n in zip(done, step)]
    xs = _xs(lengths, seed=s_q)
    served, topks = _serve(xs, steps, "decode")
    traces = _check_equal(xs, served)
    # the index sources' rows, as sets, are the definition's (order is the logits')
    for b, tr in enumerate(traces):
        for i in (1, 3, 4):
            rows = torch.cat([t[i][b] for t in topks])
            for p in range(lengths[b]):
                assert set(rows[p].tolist()) == set(tr[i].topk[p].tolist()), (b, i, p)


def test_prefill_ragged_batch_equals_definition() -> None:
    """Chunked prefill of a ragged batch (13, 7, 1 tokens; a request idle in the second
    chunk), then a decode step after the prefill: the workspace's gather offsets, the
    compressed region of the widest request, combined rows -1 padded to 128."""
    lengths = [14, 8, 1]
    xs = _xs(lengths, seed=5)
    served, _ = _serve(xs, [[5, 4, 1], [8, 3, 0]] + [[1, 1, 0]], "prefill")
    _check_equal(xs, served)


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("kv_cache_dtype", ["mxfp8", "nvfp4"])
def test_byte_caches_equal_definition_on_the_same_rounded_keys(path: str,
                                                               kv_cache_dtype: str) -> None:
    """528-byte MXFP8 window and compressed caches, or NVFP4 (288 bytes) compressed ones:
    serving reads the keys back from the bytes, the definition rounds them by the same
    codecs; they agree to 1e-10, and differ from the exact layer by the rounding."""
    lengths = [11, 6]
    xs = _xs(lengths, seed=11)
    steps = [[4, 3], [3, 1], [2, 2], [2, 0]]
    served, _ = _serve(xs, steps, path, kv_cache_dtype)
    _check_equal(xs, served, kv_cache_dtype)
    exact = v41_stack_definition([xl[0] for xl in xs], WEIGHTS)
    for l in range(NL):
        gap = float((served[l][0] - exact[l].out).abs().max() / exact[l].out.abs().max())
        assert gap > 1e-6, (l, gap)  # the rounding is really there
    cache = V41ServingCache.empty(WEIGHTS, 1, 8, kv_cache_dtype=kv_cache_dtype)
    comp_bytes = NVFP4_V41_BYTES if kv_cache_dtype == "nvfp4" else FP8_V41_BYTES
    assert cache.window[0].storage.dtype == torch.uint8
    assert cache.window[0].storage.shape[-1] == FP8_V41_BYTES
    assert cache.compressed[1].storage.shape[-1] == comp_bytes
    assert sorted(cache.compressed) == sorted(cache.index_keys) == [1, 3]


def test_short_lengths_and_page_edges() -> None:
    """Requests of 1, 2, 3 and 3 tokens: a single visible compressed entry (p = 1, 2 at ratio
    2; p = 0 at ratio 1), the short-context fill (every entry fits in index_topk = 3: the rows
    are 0 .. n_p - 1 in order) for the whole batch, and pages of 1 and 2 entries."""
    lengths = [1, 2, 3, 3]
    xs = _xs(lengths, seed=21)
    for path in ("decode", "prefill"):
        served, topks = _serve(xs, [[1, 2, 3, 3]], path, window_page=3,
                               compressed_page_tokens=2)
        _check_equal(xs, served)
        # ratio 2 (layer 1): p = 1, 2 see entry 0 only; ratio 1 (layer 3): p = 0 sees entry 0
        assert topks[0][1][1].tolist() == [[-1, -1, -1], [0, -1, -1]]
        assert topks[0][1][2][2].tolist() == [0, -1, -1]
        assert topks[0][3][0].tolist() == [[0, -1, -1]]
        assert topks[0][3][3].tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, 2]]


def test_serving_definition_hook_rounds_only_the_caches() -> None:
    xs = _xs([9], seed=3)
    x = [xl[0] for xl in xs]
    for dtype in ("mxfp8", "nvfp4"):
        tr = v41_stack_definition(x, WEIGHTS, kv_cache_dtype=dtype)
        exact = v41_stack_definition(x, WEIGHTS)
        src = v41_kv_source(x[1], WEIGHTS[1], kv_cache_dtype=dtype)
        assert torch.equal(tr[2].k_compressed, src.entries)
        assert torch.equal(src.entries, v41_cache_round(exact[1].kv_source.entries, dtype,
                                                        compressed=True))
        assert torch.equal(tr[0].k_window, v41_cache_round(exact[0].k_window, dtype))
        assert torch.equal(tr[1].q, exact[1].q)  # q is not rounded
    mx = v41_cache_round(exact[1].kv_source.entries, "mxfp8", compressed=True)
    nv = v41_cache_round(exact[1].kv_source.entries, "nvfp4", compressed=True)
    assert not torch.equal(mx, nv)


def test_bad_inputs_name_the_argument() -> None:
    xs = _xs([3, 2], seed=0)
    cache = V41ServingCache.empty(WEIGHTS, 2, 4, **PAGES)
    step = [[x[:1] for x in xl] for xl in xs]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        V41ServingCache.empty(WEIGHTS, 2, 4, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(TypeError, match="weights"):
        V41ServingCache.empty(WEIGHTS[0], 2, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"weights\[0\] must be layer 0"):
        V41ServingCache.empty(WEIGHTS[1:], 2, 4)
    with pytest.raises(ValueError, match="capacity"):
        V41ServingCache.empty(WEIGHTS, 2, 0)
    with pytest.raises(ValueError, match="compressed_page_tokens"):
        V41ServingCache.empty(WEIGHTS, 2, 4, compressed_page_tokens=3)
    with pytest.raises(ValueError, match="path"):
        v41_serving_step(step, cache, path="chunked")
    with pytest.raises(ValueError, match="xs must be a list of 7"):
        v41_serving_step(step[:3], cache)
    with pytest.raises(ValueError, match=r"xs\[2\] must be a list of 2"):
        v41_serving_step(step[:2] + [step[2][:1]] + step[3:], cache)
    with pytest.raises(ValueError, match=r"xs\[0\]\[1\]"):
        v41_serving_step([[step[0][0], step[0][1][:, :5]]] + step[1:], cache)
    with pytest.raises(ValueError, match="as many new tokens"):
        v41_serving_step(step[:1] + [[x[:2] for x in xl] for xl in xs[1:2]] + step[2:], cache)
    with pytest.raises(ValueError, match="capacity"):
        v41_serving_step([[x, x] for x in (torch.zeros(5, 64, dtype=F64),) * NL], cache)
    with pytest.raises(TypeError, match="cache"):
        v41_serving_step(step, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        v41_cache_round(torch.zeros(1, 512, dtype=F64), "bfloat16")
    x = [xl[0] for xl in xs]
    src = v41_kv_source(x[1], WEIGHTS[1], kv_cache_dtype="mxfp8")
    idx = v41_stack_definition(x, WEIGHTS)[1].index_source
    with pytest.raises(ValueError, match="kv_source"):
        v41_layer_definition(x[2], WEIGHTS[2], kv_source=src, index_source=idx)
    tr = v41_stack_definition(x, WEIGHTS)[1]
    args = (x[1], tr.q_latent, tr.kv_source.index_keys, WEIGHTS[1])
    with pytest.raises(TypeError, match="short_context"):
        v41_indexer_topk(*args, short_context=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positions"):
        v41_indexer_topk(*args, positions=torch.arange(2))
    with pytest.raises(ValueError, match="keys must hold"):  # position 9 sees 5 entries
        v41_indexer_topk(*args, positions=torch.tensor([8, 9, 9]), short_context=False)
    assert cache.seq_lens == [0, 0]  # nothing was served by a refused step
