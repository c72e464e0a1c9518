"""The host side of the fast sparse calls (``mla.fast.sparse``): the per-key launch cache.

A call's first key prepares the launch (checks, plan, views, integers) and launches through
Triton's JIT; a later call of the key reuses all of it and, on a GPU, launches the kept
compiled kernels directly with the arguments' addresses. What can go wrong there: a later
call that reuses a stale copy or view (the first call's tensors), a key that misses an
argument that changes the launch (strides, alignment, an optional tensor present or not), or
an argument check skipped on a hit. Every call here is held to the float64 reference within
the kernels' budgets (conventions §11), not just to the first call's output. On a GPU the
direct launches are also compared with the JIT's, and a captured CUDA graph with both.
"""

from __future__ import annotations

import pytest
import torch
from test_fast_sparse import check_decode, check_prefill, decode_inputs, prefill_inputs
from test_fast_v4 import D4, _sink, model1_cache, pick
from test_fast_v4 import check_decode as check_decode_v4

import mla.fast.sparse as fast_sparse
from mla.fast import SparsePlan, sparse_mla_decode, sparse_mla_prefill

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
I32 = torch.int32
SPLIT = SparsePlan(16, 16, 3, 4, 1)  # three splits: the combine kernel runs too


def _keys() -> int:
    return len(fast_sparse._launches)


def _offset(t: torch.Tensor, elements: int) -> torch.Tensor:
    """``t``'s values at an address ``elements`` further into a larger buffer."""
    buf = torch.empty(t.numel() + elements, dtype=t.dtype, device=t.device)
    view = buf[elements:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("plan", [None, SPLIT])
def test_decode_same_key_new_values(plan):
    """Calls of one key with new q, cache and index values each match the reference (the
    second reuses the launch: no new key); the same shapes at an address off by 4 bytes are
    another key (pointer alignment is part of Triton's specialization)."""
    q, cache, idx = decode_inputs(2, 2, 3, 40, 3, 16, 37, torch.float32, seed=1)
    check_decode(q, cache, idx, 0.2, False, head_dim_v=32, plan=plan)
    keys = _keys()
    q2, cache2, idx2 = decode_inputs(2, 2, 3, 40, 3, 16, 37, torch.float32, seed=2)
    lens = torch.tensor([37, 5], dtype=I32, device=DEVICE)
    check_decode(q2, cache2, idx2, 0.3, False, head_dim_v=32, plan=plan)
    assert _keys() == keys
    check_decode(q2, cache2, idx2, 0.3, False, lens, head_dim_v=32, plan=plan)
    assert _keys() == keys + 1  # topk_length given: another launch
    check_decode(_offset(q2, 1), cache2, idx2, 0.3, False, head_dim_v=32, plan=plan)
    assert _keys() == keys + 2


def test_copies_are_made_per_call():
    """Arguments the kernels take only as copies (a q whose last dim is strided, indices of
    stride 2, an fp8_ds_mla cache of padded rows) are copied on every call, hits included:
    new values in the same strided tensors give new, right results."""
    def strided_inputs(seed: int):
        q, cache, idx = decode_inputs(2, 1, 2, 576, 2, 16, 20, torch.float16, seed=seed,
                                      fp8=True)
        wide_q = torch.zeros(*q.shape[:-1], 2 * 576, dtype=q.dtype, device=DEVICE)
        wide_q[..., ::2] = q
        wide_c = torch.zeros(*cache.shape[:-1], 700, dtype=cache.dtype, device=DEVICE)
        wide_c[..., :656] = cache
        wide_i = torch.zeros(*idx.shape[:-1], 2 * 20, dtype=I32, device=DEVICE)
        wide_i[..., ::2] = idx
        return wide_q[..., ::2], wide_c[..., :656], wide_i[..., ::2]
    q, cache, idx = strided_inputs(3)
    assert q.stride(-1) == 2 and not cache.is_contiguous() and idx.stride(-1) == 2
    check_decode(q, cache, idx, 0.1, True, plan=SPLIT)
    keys = _keys()
    q2, cache2, idx2 = strided_inputs(4)
    check_decode(q2, cache2, idx2, 0.1, True, plan=SPLIT)
    assert _keys() == keys


@pytest.mark.parametrize("plan", [None, SparsePlan(16, 16, 2, 4, 1)])
def test_prefill_same_key_new_values(plan):
    """Prefill as decode: a second key-equal call with other values and lengths matches the
    reference; strided q and indices are copied per call."""
    q, kv, idx = prefill_inputs(4, 6, 40, 25, 2 * 37, torch.float32, seed=5)
    check_prefill(q[:, ::2], kv, idx[:, ::2], 0.25, 32, plan=plan)
    q2, kv2, idx2 = prefill_inputs(4, 6, 40, 25, 2 * 37, torch.float32, seed=6)
    keys = _keys()
    check_prefill(q2[:, ::2], kv2, idx2[:, ::2], 0.5, 32, plan=plan)
    assert _keys() == keys


def test_model1_second_scope_and_sink_same_key():
    """DeepSeek-V4's call (MODEL1 pages, a second scope of pages of 1, both lengths, sinks)
    twice with new values of every tensor: both match the reference."""
    for seed in (7, 8):
        g = torch.Generator().manual_seed(seed)
        c1, u1 = model1_cache(3, 16, g)
        c2, u2 = model1_cache(40, 1, g)
        q = torch.randn(2, 1, 2, D4, generator=g).to(torch.float32).to(DEVICE)
        v4 = dict(extra_k_cache=c2, extra_indices_in_kvcache=pick(g, (2, 1, 21), u2),
                  extra_topk_length=torch.tensor([5, 21], dtype=I32, device=DEVICE),
                  attn_sink=_sink(2, g, 60))
        lens = torch.tensor([37, 0], dtype=I32, device=DEVICE)
        check_decode_v4(q, c1, pick(g, (2, 1, 37), u1), True, lens, SPLIT, **v4)


def test_argument_errors_on_a_cached_key():
    """A hit checks what its key leaves out (the scale) and a changed argument is a new key
    whose checks run: bad scales, an int64 index tensor, a wrong plan type and a MODEL1 cache
    at an odd address are refused after the same call succeeded."""
    q, cache, idx = decode_inputs(2, 1, 2, 40, 2, 16, 10, torch.float32, seed=9)
    sparse_mla_decode(q, cache, idx, 0.1, False, head_dim_v=32)
    for scale, err in ((0.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                       ("0.1", TypeError), (True, TypeError)):
        with pytest.raises(err, match="softmax_scale"):
            sparse_mla_decode(q, cache, idx, scale, False, head_dim_v=32)
    sparse_mla_decode(q, cache, idx, 1, False, head_dim_v=32)  # an int scale is a scale
    with pytest.raises(TypeError, match="indices"):
        sparse_mla_decode(q, cache, idx.long(), 0.1, False, head_dim_v=32)
    with pytest.raises(TypeError, match="plan"):
        sparse_mla_decode(q, cache, idx, 0.1, False, head_dim_v=32, plan=(16, 16, 1, 4, 1))
    qp, kv, idx_p = prefill_inputs(3, 2, 40, 20, 10, torch.float32, seed=10)
    sparse_mla_prefill(qp, kv, idx_p, 0.1, 32)
    with pytest.raises(ValueError, match="sm_scale"):
        sparse_mla_prefill(qp, kv, idx_p, -0.1, 32)
    with pytest.raises(ValueError, match="d_v"):
        sparse_mla_prefill(qp, kv, idx_p, 0.1, 41)
    g = torch.Generator().manual_seed(11)
    c1, u1 = model1_cache(2, 16, g)
    q4 = torch.randn(1, 1, 2, D4, generator=g).to(DEVICE)
    idx4 = pick(g, (1, 1, 9), u1)
    sparse_mla_decode(q4, c1, idx4, 0.1, True)
    raw = torch.empty(c1.numel() + 1, dtype=torch.uint8, device=DEVICE)
    odd = raw[1:].view(c1.shape)
    odd.copy_(c1)
    with pytest.raises(ValueError, match="even byte addresses"):
        sparse_mla_decode(q4, odd, idx4, 0.1, True)


def test_empty_calls_are_cached_too():
    """B = 0 and N = 0: empty results, no launch, at the first call and at a hit."""
    q, cache, idx = decode_inputs(2, 1, 2, 40, 2, 16, 10, torch.float32, seed=12)
    for _ in range(2):
        out, lse = sparse_mla_decode(q[:0], cache, idx[:0], 0.1, False, head_dim_v=32)
        assert out.shape == (0, 1, 2, 32) and lse.shape == (0, 2, 1)
        out, lse = sparse_mla_decode(q[:, :, :0], cache, idx, 0.1, False, head_dim_v=32)
        assert out.shape == (2, 1, 0, 32) and lse.shape == (2, 0, 1)


def test_launch_kept_protocol(monkeypatch):
    """``CompiledLauncher.launch_kept`` with a stand-in kernel: nothing kept, nothing launched
    (False: the caller goes through the JIT); after the JIT's launch of a key, its compiled
    kernel is called directly with whatever the caller passes as pointers (here integers); a
    launch hook or the interpreter sends the caller back to the JIT; a refused direct launch
    warns once, launches nothing and turns direct launches off for good."""
    from triton import knobs

    import mla.fast.launch as launch

    calls = []

    class Compiled:
        function, packed_metadata, refuse = "fn", "meta", False

        def run(self, *a):
            if self.refuse:
                raise TypeError("launcher signature")
            calls.append(("direct", a))

    compiled = Compiled()

    class Kernel:
        __name__ = "kernel"

        def __getitem__(self, grid):
            def jit(*args, **options):
                calls.append(("jit", args))
                return compiled
            return jit

    interpreting = [False]
    monkeypatch.setattr(launch, "interpreting", lambda: interpreting[0])
    monkeypatch.setattr(launch.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch.torch._C, "_cuda_getCurrentRawStream", lambda d: 77,
                        raising=False)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", knobs.HookChain())
    launcher = launch.CompiledLauncher(Kernel())
    assert not launcher.launch_kept("k", (2, 1, 1), (123, 5)) and calls == []
    launcher("k", (2, 1, 1), ("typed view", 5), num_warps=8)
    assert launcher.launch_kept("k", (2, 1, 1), (123, 5))
    assert calls[-1] == ("direct", (2, 1, 1, 77, "fn", "meta", None, None, None, 123, 5))
    assert not launcher.launch_kept("other key", (2, 1, 1), (123, 5)) and len(calls) == 2
    interpreting[0] = True
    assert not launcher.launch_kept("k", (2, 1, 1), (123, 5)) and len(calls) == 2
    interpreting[0] = False
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    assert not launcher.launch_kept("k", (2, 1, 1), (123, 5)) and len(calls) == 2
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", knobs.HookChain())
    compiled.refuse = True
    with pytest.warns(RuntimeWarning, match="launching kernel directly failed"):
        assert not launcher.launch_kept("k", (2, 1, 1), (123, 5))
    assert not launcher.direct and len(calls) == 2
    compiled.refuse = False
    assert not launcher.launch_kept("k", (2, 1, 1), (123, 5)) and len(calls) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="direct launches need a GPU")
@pytest.mark.parametrize("case", ["fp8_ds_mla", "model1_scope_sink", "prefill"])
def test_direct_launch_and_graph_match_the_jit(case):
    """On a GPU: the first call (JIT), a hit (the kept compiled kernels launched directly
    with the arguments' addresses) and a CUDA-graph replay of the call give the same bits;
    after new values are written into the captured inputs, the replay and a direct call
    agree again (the graph reads the buffers, not copies made at capture)."""
    g = torch.Generator().manual_seed(13)
    if case == "prefill":
        q = torch.randn(70, 64, 576, generator=g).to(torch.bfloat16).to(DEVICE)
        kv = torch.randn(300, 576, generator=g).to(torch.bfloat16).to(DEVICE)
        idx = torch.randint(-1, 300, (70, 200), generator=g, dtype=I32).to(DEVICE)
        inputs = [q, kv, idx]

        def call():
            return sparse_mla_prefill(q, kv, idx, 0.07, 512, validate=False)
    else:
        fp8 = case == "fp8_ds_mla"
        if fp8:
            q, cache, idx = decode_inputs(5, 1, 64, 576, 8, 64, 300, torch.bfloat16, seed=14,
                                          fp8=True)
            v4: dict = {}
        else:
            cache, used = model1_cache(8, 64, g)
            c2, u2 = model1_cache(8, 64, g)
            q = torch.randn(5, 1, 64, D4, generator=g).to(torch.bfloat16).to(DEVICE)
            idx = pick(g, (5, 1, 300), used)
            v4 = dict(extra_k_cache=c2, extra_indices_in_kvcache=pick(g, (5, 1, 128), u2),
                      attn_sink=_sink(64, g, 428))
        inputs = [q, idx]

        def call():
            return sparse_mla_decode(q, cache, idx, 0.07, True, validate=False, **v4)
    first = call()
    second = call()
    torch.cuda.synchronize()
    for a, b in zip(first, second):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(first, captured):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    inputs[0].copy_(torch.randn(inputs[0].shape, generator=g).to(inputs[0].dtype))
    graph.replay()
    direct = call()
    torch.cuda.synchronize()
    for a, b in zip(direct, captured):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert not torch.equal(direct[0], first[0])
