"""``PYTHONPATH=. python -m benchmarks.v4_layer --out-dir DIR [--quick]``: DeepSeek-V4's layer on
the fast path (``mla.fast.v4``) against the reference, stage by stage, and its decode step timed.

(a) Checks, DeepSeek-V4-Flash's widths (``deepseek-v4``: hidden 4096, 64 heads, window 128,
top-k 512), bf16 activations, each layer kind (ratio 1, 4, 128), a ragged batch prefilled in
one step then decoded (``s_q = 1``, then ``s_q = 2``). Each stage is held to the reference
applied to the fast path's own inputs of that stage (so that a stage's error is its own), and
the whole step to ``v4_layer_definition`` (float64, ``fp8_ds_mla``) of each request's whole
history, fed the fast path's top-k (so that both attend the same keys):

- ``q_latent``, ``kv``: bf16 results of the same bf16 inputs, float32 (here) against float64
  (there) sums: >= 99 % of the elements equal or one bf16 step apart (``<= 2^-7`` relative),
  relative (Frobenius) ``<= 6e-3`` (one bf16 rounding each side, measured about 3e-3 on an
  H100); ``q``: ``q_latent``'s difference carried through ``wq_b`` and one more rounding,
  ``<= 8e-3`` (measured 4e-3; elementwise it is not held to one step: the GEMM's cancellation
  makes small elements' relative differences large);
- the window cache: the nope bytes equal to the MODEL1 quantization (``"vllm"`` floor) of the
  fast path's own ``kv`` (exact: integer roundings of the same bf16 values), the RoPE values
  within one bf16 step (a float32 against a float64 rotation) for >= 99.9 %;
- the compressed cache (``d = 512``) and the indexer's keys (``d = 128``) read back: within one
  e4m3 step (``2^-3`` relative, the projections' float32 vs float64 can flip a rounding) for
  >= 99 % of the values;
- the indexer's top-k: recall of the reference's sets (the reference indexer on the same
  history; near-ties may swap) >= 0.95 per step;
- ``attn_own``: the attention against ``attend_with_sink`` (float64) over the keys the fast
  caches hold, the fast query and the fast top-k: relative (Frobenius) ``<= 5e-3`` (bf16
  probabilities in the kernel and a bf16 output; measured 2.0-2.1e-3 on an H100);
- ``out_own``: the output projection against the reference's (``v4_output_projection``) on the
  fast attention output: ``<= 2e-3`` (bf16 GEMMs and roundings; measured 0.7-0.9e-3);
- ``attn``, ``out`` against the definition: ``<= 3e-2``. Not tighter, and why: a key's nope
  value that differs from the definition's by one bf16 step (the projection's float32 sum)
  lands on the neighbouring e4m3 code about once in 16 (``2^-8 / 2^-4``), an error of up to
  ``2^-4`` of that value, so the attention output moves by about ``sqrt(1/16) · 2^-4 / 2 ≈
  1.6e-2`` relative (measured 1.2-1.6e-2). The stage checks above are the tight ones.

(b) Timing of one decode step (``s_q = 1``) of a ratio-4 and a ratio-128 layer, ``B`` in
{1, 32, 128} requests of ``L`` in {8K, 32K} tokens, CUDA graphs where they capture (else
eager, marked): the fast path (``v4_decode_step``, its indices built on the device, in a
graph; and ``v4_layer_step``, the ragged step); the same step with its attention, indexer
(logits, top-k) and front (q norm, rope, window key store) replaced by the reference's torch
functions on CUDA (``mla.reference.sparse.sparse_mla_decode``, ``fp8_paged_mqa_logits``,
``top_k_per_row``, ``write_fp8_model1``), the projections and the compressor shared; and the
same step on vLLM 0.33's own V4 kernels where they load here (``vllm_composition``:
FlashMLA's MODEL1 decode, vLLM's Triton compressors and indexer query, DeepGEMM's logits,
vLLM's top-k). Each shape in try/except. Writes ``DIR/v4_layer_<date>.json`` and ``.md``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
import traceback
from contextlib import contextmanager
from datetime import date

import torch

from benchmarks.common import ceilings, log, report_heading, time_graph

RATIOS = (1, 4, 128)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _ulp_frac(a: torch.Tensor, b: torch.Tensor, rel: float) -> float:
    a, b = a.double(), b.double()
    return float(((a - b).abs() <= rel * b.abs() + 1e-12).float().mean())


def check_kind(ratio: int, lens: list[int], quick: bool, *, device: str = "cuda",
               preset: str = "deepseek-v4", dtype: torch.dtype = torch.bfloat16) -> dict:
    """The stage checks of one layer kind on one ragged batch (module doc, (a)); ``device``,
    ``preset`` and ``dtype`` let the CPU run them under Triton's interpreter (float32)."""
    from mla.fast.v4 import V4FastCache, v4_layer_step
    from mla.reference.fp8_model1 import fp8_model1_rows, write_fp8_model1
    from mla.reference.indexer_cache import read_indexer_k_cache
    from mla.reference.v4 import V4LayerWeights, get_v4_config, rope_gptj, v4_layer_definition
    from mla.reference.v4.compressor import (
        compress,
        compressor_weights_of,
        quantize_compressed_indexer_entries,
    )
    from mla.reference.v4.indexer import indexer_topk_for_layer
    from mla.reference.v4.layer import (
        attend_with_sink,
        compressed_mask,
        v4_output_projection,
        window_mask,
    )
    c = get_v4_config(preset)
    dev = torch.device(device)
    # bf16 weights (what the fast path multiplies by), held in float64 by the reference
    w64 = V4LayerWeights.random(c, ratio, seed=ratio).to(dtype=torch.bfloat16).to(
        dtype=torch.float64, device=dev)
    B = len(lens)
    fc = V4FastCache.empty(w64, B, max(lens) + 8, dtype=dtype, device=dev)
    g = torch.Generator(device=dev).manual_seed(ratio)
    hist = [torch.zeros(0, c.hidden_size, dtype=torch.float64, device=dev) for _ in lens]
    steps = [("prefill", lens), ("decode", [1] * B), ("decode", [2] * B)]
    res: dict = {"ratio": ratio, "lens": lens, "steps": []}
    for path, st in steps:
        xs = [torch.randn(n, c.hidden_size, generator=g, device=dev, dtype=torch.float64)
              .bfloat16().double() for n in st]
        outs, tr = v4_layer_step([x.to(dtype) for x in xs], fc, path=path, trace=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        row: dict = {"path": path, "new": st}
        offs = [0]
        for n in st:
            offs.append(offs[-1] + n)
        m: dict[str, list[float]] = {}
        for b, x in enumerate(xs):
            hist[b] = torch.cat([hist[b], x])
            L = hist[b].shape[0]
            sl = slice(offs[b], offs[b + 1])
            n = st[b]
            full_tk = None
            if ratio == 4:
                full_tk = torch.full((L, c.index_topk), -1, dtype=torch.int32, device=dev)
                full_tk[L - n:] = tr.topk[sl]
            ref = v4_layer_definition(hist[b], w64, topk=full_tk)
            new = slice(L - n, L)
            for name, fa, rb in (("q_latent", tr.q_latent[sl], ref.q_latent[new]),
                                 ("kv", tr.kv[sl], ref.kv[new]), ("q", tr.q[sl], ref.q[new])):
                m.setdefault(f"{name}_rel", []).append(_rel(fa, rb))
                m.setdefault(f"{name}_ulp_frac", []).append(_ulp_frac(fa, rb, 2 ** -7))
            m.setdefault("attn_rel", []).append(_rel(tr.attn[sl], ref.attn[new]))
            m.setdefault("out_rel", []).append(_rel(outs[b], ref.out[new]))
            pos = tr.positions[sl]
            # the attention over the fast caches' own keys, the fast q and top-k
            win_slots = fc.window_table[b].long()[torch.arange(L, device=dev) // 64] * 64 \
                + torch.arange(L, device=dev) % 64
            keys = [fp8_model1_rows(fc.window_pages, 64, win_slots).double()]
            nc = L // ratio if ratio > 1 else 0
            if nc:
                bs = fc.compressed_block
                ids = torch.arange(nc, device=dev)
                keys.append(fp8_model1_rows(fc.compressed_pages, bs, fc.compressed_table[b].long()
                                            [ids // bs] * bs + ids % bs).double())
            mask = torch.cat([window_mask(pos, torch.arange(L, device=dev), c.sliding_window),
                              compressed_mask(pos, nc, ratio, tr.topk[sl] if ratio == 4
                                              else None)], dim=1)
            own, _ = attend_with_sink(tr.q[sl].double(), torch.cat(keys), mask,
                                      w64["attn_sink"].float(), c.softmax_scale)
            m.setdefault("attn_own_rel", []).append(_rel(tr.attn[sl], own))
            own_out = v4_output_projection(tr.attn[sl].double(), pos, w64, "fp8_ds_mla")[2]
            m.setdefault("out_own_rel", []).append(_rel(outs[b], own_out))
            # the window cache: the MODEL1 bytes of the fast path's own kv
            slots = fc.window_table[b].long()[pos // 64] * 64 + pos % 64
            got = fp8_model1_rows(fc.window_pages, 64, slots)
            one = torch.zeros(n, fc.window_pages.shape[1], dtype=torch.uint8, device=dev)
            k = rope_gptj(tr.kv[sl].double(), pos, c, ratio).bfloat16()
            write_fp8_model1(one, 64, torch.arange(n, device=dev) * 64, k, scale_floor="vllm")
            want = fp8_model1_rows(one, 64, torch.arange(n, device=dev) * 64)
            m.setdefault("window_nope_equal", []).append(
                float(torch.equal(got[:, :448], want[:, :448])))
            m.setdefault("window_rope_ulp_frac", []).append(
                _ulp_frac(got[:, 448:], want[:, 448:], 2 ** -7))
            if ratio > 1:
                if nc:
                    bs = fc.compressed_block
                    ids = torch.arange(nc, device=dev)
                    cs = fc.compressed_table[b].long()[ids // bs] * bs + ids % bs
                    got = fp8_model1_rows(fc.compressed_pages, bs, cs)
                    m.setdefault("compressed_within_e4m3_step", []).append(
                        _ulp_frac(got, ref.k_compressed, 2 ** -3))
                    if ratio == 4:
                        ent = compress(hist[b], compressor_weights_of(w64, "indexer.compressor."),
                                       c)
                        rc, rs = quantize_compressed_indexer_entries(ent)
                        codes, scale = read_indexer_k_cache(fc.index_cache, cs)
                        m.setdefault("indexer_keys_within_e4m3_step", []).append(_ulp_frac(
                            codes.double() * scale.double()[:, None],
                            rc.view(torch.float8_e4m3fn).double() * rs.double()[:, None],
                            2 ** -3))
            if ratio == 4:
                rtk = indexer_topk_for_layer(hist[b], ref.q_latent, w64)[new]
                hit = tot = 0
                for ft, rt in zip(tr.topk[sl].tolist(), rtk.tolist()):
                    rs_ = {i for i in rt if i >= 0}
                    hit += len(rs_ & {i for i in ft if i >= 0})
                    tot += len(rs_)
                m.setdefault("topk_recall", []).append(hit / tot if tot else 1.0)
            del ref
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        worst = {k: (max(v) if k.endswith("_rel") else min(v)) for k, v in m.items()}
        budgets = {"q_latent_rel": 6e-3, "kv_rel": 6e-3, "q_rel": 8e-3,
                   "attn_own_rel": 5e-3, "out_own_rel": 2e-3, "attn_rel": 3e-2,
                   "out_rel": 3e-2}
        ok = all(worst[k] <= v for k, v in budgets.items())
        ok &= all(worst[k] >= 0.99 for k in worst if k.endswith(("_frac", "_step"))
                  and not k.startswith("q_ulp"))
        ok &= worst["window_nope_equal"] == 1.0 and worst["window_rope_ulp_frac"] >= 0.999
        ok &= worst.get("topk_recall", 1.0) >= 0.95
        row.update(worst=worst, passed=bool(ok))
        res["steps"].append(row)
        log(f"check r={ratio} {path} {st}: {'PASS' if ok else 'FAIL'} {worst}")
    return res


@contextmanager
def torch_composition():
    """The fast step with its attention, indexer and front replaced by the reference's torch
    functions (module doc)."""
    import mla.fast.v4.layer as layer
    from mla.fast.v4.common import rope_torch
    from mla.reference import sparse as ref_sparse
    from mla.reference.fp8_model1 import fp8_model1_pages, write_fp8_model1
    from mla.reference.indexer_logits import fp8_paged_mqa_logits, top_k_per_row
    saved = {n: getattr(layer, n) for n in ("sparse_mla_decode", "v4_indexer_topk_paged",
                                            "v4_q_rope_kv_insert")}

    def decode(*a, validate=None, plan=None, **k):  # noqa: ANN001, ANN202, ARG001
        return ref_sparse.sparse_mla_decode(*a, **k)

    def topk(codes, weights, k_cache, tables, visible, max_entries, n, *, fill=False,  # noqa
             validate=None):
        logits = fp8_paged_mqa_logits(codes[:, None], k_cache, weights, visible, tables,
                                      max_entries)
        return top_k_per_row(logits, torch.zeros_like(visible), visible, n)

    def front(q, kv, positions, cos_sin, window_cache, slot_mapping, *, rms_norm_eps,  # noqa
              head_norm=True, padded_heads=None, out_dtype=torch.bfloat16, validate=None):
        qf = q.float()
        if head_norm:
            qf = qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + rms_norm_eps)
        k = rope_torch(kv.float(), positions, cos_sin).bfloat16()
        bs = window_cache.shape[1]
        write_fp8_model1(fp8_model1_pages(window_cache), bs, slot_mapping, k,
                         scale_floor="vllm")
        return rope_torch(qf, positions, cos_sin).to(out_dtype)

    layer.sparse_mla_decode, layer.v4_indexer_topk_paged = decode, topk
    layer.v4_q_rope_kv_insert = front
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(layer, n, f)


def vllm_compress(capacity: int | None = None):  # noqa: ANN201
    """The fast step's ``_compress`` on vLLM's Triton compressor kernels (``vllm_composition``).

    The state cache holds, per request, a ring of pages enough for the window of a decode step
    (one token a request), or with ``capacity`` every position below it (prefill: a call's
    tokens are all saved before any is compressed)."""
    from mla.conformance.adapters import vllm_v4
    states: dict[int, torch.Tensor] = {}
    kernels = vllm_v4._kernels()

    def compress(comp, X, pos, req, lens0, n_new, cache, table, cos_sin, eps,  # noqa: ANN001
                 scale_floor):  # noqa: ANN001, ARG001
        B, _, width = comp.kv.shape
        r = comp.ape.shape[0]
        bs = vllm_v4.STATE_BLOCK[r]
        ring = (4 if r == 4 else 32) if capacity is None else capacity // bs + 2
        dev = X.device
        if id(comp) not in states:  # block 0: the null block
            states[id(comp)] = torch.zeros(1 + B * ring, bs, 2 * width, device=dev)
        state = states[id(comp)]
        n_blocks = int(pos.max()) // bs + 2
        bt = (1 + torch.arange(B, device=dev)[:, None] * ring
              + torch.arange(n_blocks, device=dev)[None, :] % ring).int()
        p64 = pos.long()
        slots = bt[req, p64 // bs].long() * bs + p64 % bs
        proj = X.float() @ comp.w.T
        kv, score = proj[:, :width].contiguous(), proj[:, width:].contiguous()
        ent = p64 // r
        closing = (p64 + 1) % r == 0
        page = table[req, torch.where(closing, ent // cache.shape[1], 0)].long()
        kv_slots = torch.where(closing, page * cache.shape[1] + ent % cache.shape[1], -1)
        vllm_v4.launch_compress(kernels, kv, score, comp.ape, p64, state, slots, bs, req.int(),
                                bt, comp.norm, eps, cos_sin, cache, kv_slots, r)

    return compress


def _masked(idx: torch.Tensor, length: torch.Tensor | None) -> torch.Tensor:
    """``idx`` with the entries past each row's ``length`` made ``-1`` (FlashMLA's sm_90
    sparse decode takes no ``topk_length``, so vLLM passes its indices so there)."""
    if length is None:
        return idx
    cols = torch.arange(idx.shape[-1], device=idx.device)
    return torch.where(cols < length.view(-1, *[1] * (idx.dim() - 1)), idx, -1)


def _flashmla_decode(q, kv, idx, scale, fp8, length=None, dv=512, *, validate=None,  # noqa
                     plan=None, extra_k_cache=None, extra_indices_in_kvcache=None,
                     extra_topk_length=None, **k):
    """FlashMLA's MODEL1 sparse decode with ``mla.fast.sparse_mla_decode``'s signature."""
    from mla.conformance.adapters import flashmla
    extra = {}
    if extra_k_cache is not None:
        extra = dict(extra_k_cache=extra_k_cache,
                     extra_indices_in_kvcache=_masked(extra_indices_in_kvcache,
                                                      extra_topk_length))
    return flashmla.sparse_mla_decode(q, kv, _masked(idx, length), scale, fp8, None, dv,
                                      **extra, **k)


def _vllm_q_prep(q, w, positions, cos_sin):  # noqa: ANN001, ANN202
    """vLLM's Triton indexer query with ``v4_indexer_q_prep``'s signature."""
    from mla.conformance.adapters import vllm_v4
    codes, wq = vllm_v4.v4_indexer_q(q, w, positions, cos_sin, q.shape[-1] ** -0.5,
                                     q.shape[1] ** -0.5)
    return codes.view(torch.float8_e4m3fn), wq


@contextmanager
def _patched(changes: dict[tuple[object, str], object]):  # noqa: ANN202
    """Each ``(module, name)`` set to its value for the block, then restored."""
    saved = {key: getattr(*key) for key in changes}
    for (m, n), f in changes.items():
        setattr(m, n, f)
    try:
        yield saved
    finally:
        for (m, n), f in saved.items():
            setattr(m, n, f)


@contextmanager
def vllm_composition():
    """The fast step with its attention, indexer query and indexer (logits, top-k) replaced by
    the kernels vLLM 0.33 serves DeepSeek-V4 with, through the conformance adapters (the same
    contracts): FlashMLA's MODEL1 sparse decode (its sm_90 kernel takes no ``topk_length``, so
    the entries past a length become ``-1``, as vLLM passes them there), vLLM's Triton
    ``fused_indexer_q_rope_quant_kernel``, DeepGEMM's paged logits and vLLM's
    ``persistent_topk``; and both compressors by vLLM's Triton kernels
    (``save_partial_states_kernel``, then the fused compress, norm, RoPE, quantize and store
    kernel of each width), their state in vLLM's fp32 state cache (pages of 4 tokens at ratio
    4, 8 at ratio 128; per request a ring of pages enough for the window, behind a block
    table). The projections and the front stay the fast path's: vLLM's front
    (``fused_qnorm_rope_kv_insert``) is in its main CUDA library, which the wheel's pieces run
    here do not load."""
    import mla.fast.v4.layer as layer
    from mla.conformance.adapters import deepgemm, vllm_topk
    fast_topk = layer.v4_indexer_topk_paged

    def topk(codes, weights, k_cache, tables, visible, max_entries, n, *, fill=False,  # noqa
             validate=None):
        if fill:
            return fast_topk(codes, weights, k_cache, tables, visible, max_entries, n,
                             fill=True)
        logits = deepgemm.fp8_paged_mqa_logits(codes[:, None], k_cache, weights, visible,
                                               tables, max_entries)
        return vllm_topk.persistent_top_k_per_row(logits, torch.zeros_like(visible), visible,
                                                  n)

    with _patched({(layer, "sparse_mla_decode"): _flashmla_decode,
                   (layer, "v4_indexer_topk_paged"): topk,
                   (layer, "v4_indexer_q_prep"): _vllm_q_prep,
                   (layer, "_compress"): vllm_compress()}):
        yield


@contextmanager
def vllm_device_composition():
    """``v4_decode_step`` (every index on the device, capturable) with FlashMLA's MODEL1 sparse
    decode, vLLM's Triton indexer query, DeepGEMM's paged logits and vLLM's ``persistent_topk``
    in place of ours, each called as vLLM's decode calls it: no host read of a device value
    (``persistent_topk`` is given the host's bound on a row, the indexer's entry count, as
    vLLM gives it ``max_seq_len``), so the step can be captured in a CUDA graph. The
    compressors stay ours: vLLM's keep their state in its paged state cache, which the
    one-row-a-request step does not use (``vllm_composition`` runs them eagerly)."""
    import mla.fast.v4.decode_step as step
    import mla.fast.v4.layer as layer
    from mla.conformance.adapters import deepgemm, vllm_topk
    ops = vllm_topk._ops()

    def topk(codes, weights, k_cache, tables, visible, max_entries, n, *, fill=False,  # noqa
             validate=None):
        logits = deepgemm.fp8_paged_mqa_logits(codes[:, None], k_cache, weights, visible,
                                               tables, max_entries)
        return vllm_topk.persistent_indices(ops, logits, visible, n, longest=max_entries)

    with _patched({(step, "sparse_mla_decode"): _flashmla_decode,
                   (step, "v4_indexer_topk_paged"): topk,
                   (layer, "v4_indexer_q_prep"): _vllm_q_prep}):
        yield


@functools.lru_cache(maxsize=2)
def _weights(ratio: int):  # noqa: ANN202
    from mla.reference.v4 import V4LayerWeights, get_v4_config
    return V4LayerWeights.random(get_v4_config("deepseek-v4"), ratio, seed=1,
                                 dtype=torch.bfloat16)


def time_step(ratio: int, B: int, L: int) -> dict:
    from mla.fast.v4 import V4FastCache, v4_decode_step, v4_layer_step
    from mla.reference.v4 import get_v4_config
    c = get_v4_config("deepseek-v4")
    dev = torch.device("cuda")
    w = _weights(ratio)
    fc = V4FastCache.empty(w, B, L + 1, dtype=torch.bfloat16, device=dev)
    for comp in (fc.compressor, fc.index_compressor):
        if comp is not None:
            comp.kv.zero_()
            comp.score.zero_()
    x = [torch.randn(1, c.hidden_size, device=dev, dtype=torch.bfloat16) for _ in range(B)]

    def step() -> None:
        fc.lengths[:] = [L] * B
        v4_layer_step(x, fc, path="decode")

    xt = torch.cat(x)
    start = torch.full((B,), L, dtype=torch.int32, device=dev)
    lengths = start.clone()

    def device_step() -> None:  # v4_decode_step: capturable, the lengths reset each replay
        lengths.copy_(start)
        v4_decode_step(xt, fc, lengths)

    out: dict = {"ratio": ratio, "B": B, "L": L}
    for name, ctx, fn in (("device", contextlib.nullcontext, device_step),
                          ("vllm_device", vllm_device_composition, device_step),
                          ("fast", contextlib.nullcontext, step),
                          ("torch", torch_composition, step), ("vllm", vllm_composition, step)):
        try:
            with ctx():
                out[f"{name}_ms"], out[f"{name}_graph"] = _time(fn)
        except Exception as e:  # noqa: BLE001
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
        torch.cuda.empty_cache()
    log(f"time r={ratio} B={B} L={L}: {out}")
    return out


def _time(fn) -> tuple[float, bool]:  # noqa: ANN001
    try:
        return time_graph(fn, reps=20), True
    except Exception:  # noqa: BLE001
        torch.cuda.synchronize()
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2], False


STEP_COLUMNS = """One decode step (`s_q = 1`) of a C4A (ratio 4) and a C128A (ratio 128) layer at
DeepSeek-V4's widths, each of `B` requests at `L` tokens. The columns share the projections;
they differ in the attention, the indexer (query, logits, top-k), for the torch composition
the front, and for the eager vLLM column the compressors (vLLM's Triton kernels and state
cache; every other column runs ours):

- fast, device indices: `mla.fast.v4.v4_decode_step` (lengths and indices built on the
  device, no host read), replayed in a CUDA graph (median of 20 replays, L2 not flushed);
- vLLM's kernels, device indices: the same step with FlashMLA's MODEL1 sparse decode, vLLM's
  Triton indexer query, DeepGEMM's paged logits and vLLM's `persistent_topk` in place of ours
  (`vllm_device_composition`; the compressors stay ours), in a CUDA graph the same way;
- fast: `mla.fast.v4.v4_layer_step` (its index tensors built from host lists; eager);
- torch composition: the reference's torch functions on CUDA for those stages (eager);
- vLLM's kernels: FlashMLA's MODEL1 sparse decode, vLLM's Triton indexer query, DeepGEMM's
  paged logits and vLLM's `persistent_topk` (`vllm_composition`; eager: the adapters of
  vLLM's top-k and FlashMLA read device values on the host).

Eager columns report the median of 5 calls and at these sizes are mostly host time (a few
dozen launches and host tensor builds): read them against each other, and the graph column
as the step's GPU time."""


def write_report(res: dict, stem: str) -> None:
    """``stem``.md from a run's results (``res``: environment, ceilings, checks, timings)."""
    lines = report_heading("DeepSeek-V4 layer on mla.fast.v4", res)
    if res["checks"]:
        lines += ["## Stage checks (worst over requests; budgets in benchmarks/v4_layer.py)",
                  "", "| ratio | lens | step | pass | worst |", "|---|---|---|---|---|"]
    for ck in res["checks"]:
        if "error" in ck:
            lines.append(f"| {ck['ratio']} | {ck['lens']} | - | ERROR | {ck['error']} |")
            continue
        for s in ck["steps"]:
            worst = ", ".join(f"{k} {v:.3g}" for k, v in s["worst"].items())
            lines.append(f"| {ck['ratio']} | {ck['lens']} | {s['path']} {s['new'][0]} | "
                         f"{s['passed']} | {worst} |")
    lines += ["", "## Decode step (s_q = 1), ms", "", STEP_COLUMNS, "",
              "| ratio | B | L | fast, device indices | graph | vLLM's kernels, device indices | "
              "graph | fast | graph | torch composition | graph | vLLM's kernels | graph |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in res["timings"]:
        def cell(k: str, t: dict = t) -> str:
            return (f"{t[k + '_ms']:.3f}" if k + "_ms" in t
                    else t.get(k + "_error", t.get("error", "-"))[:60])
        lines.append(f"| {t['ratio']} | {t['B']} | {t['L']} | {cell('device')} | "
                     f"{t.get('device_graph', '-')} | {cell('vllm_device')} | "
                     f"{t.get('vllm_device_graph', '-')} | {cell('fast')} | "
                     f"{t.get('fast_graph', '-')} | {cell('torch')} | "
                     f"{t.get('torch_graph', '-')} | {cell('vllm')} | "
                     f"{t.get('vllm_graph', '-')} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Check the fast DeepSeek-V4 layer stage by stage and time its decode step."""
    import argparse

    from mla.check.registry import environment
    p = argparse.ArgumentParser(prog="python -m benchmarks.v4_layer", description=main.__doc__)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--quick", action="store_true", help="one ragged batch, B <= 32, L = 8K")
    p.add_argument("--timing-only", action="store_true", help="no stage checks")
    a = p.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    res = {"environment": environment(), "ceilings": ceilings(), "checks": [], "timings": []}
    batches = [[2305, 700, 1]] if a.quick else [[2305, 700, 1], [130, 4, 3, 129]]
    for ratio in () if a.timing_only else RATIOS:
        for lens in batches:
            try:
                res["checks"].append(check_kind(ratio, lens, a.quick))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                res["checks"].append({"ratio": ratio, "lens": lens,
                                      "error": f"{type(e).__name__}: {e}"[:300]})
            torch.cuda.empty_cache()
    for ratio in (4, 128):
        for B in ((1, 32) if a.quick else (1, 32, 128)):
            for L in ((8192,) if a.quick else (8192, 32768)):
                try:
                    res["timings"].append(time_step(ratio, B, L))
                except Exception as e:  # noqa: BLE001
                    res["timings"].append({"ratio": ratio, "B": B, "L": L,
                                           "error": f"{type(e).__name__}: {e}"[:300]})
                torch.cuda.empty_cache()
    stem = os.path.join(a.out_dir, f"v4_layer_{date.today().isoformat()}")
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    write_report(res, stem)
    log(f"wrote {stem}.json and .md")
    failed = [s for ck in res["checks"] for s in ck.get("steps", []) if not s["passed"]]
    return 1 if failed or any("error" in ck for ck in res["checks"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
