"""DeepSeek-V4.1's attention layer by its definition (``mla.reference.v4.layer41``) against a
brute force written from the equations with loops, on a tiny seven-layer model: a window-only
layer, a ratio-2 kv and index source and its consumer, a ratio-1 kv source that is the
candidate source, a ratio-1 index source that masks to its candidates, their consumer, and a
window-only layer. Everything is float64; tolerances are float64 round-off (1e-12)."""

from __future__ import annotations

import math

import pytest
import torch

from mla.reference.v4.config import V4Config, get_v4_config
from mla.reference.v4.layer41 import (
    V41IndexSource,
    V41KVSource,
    V41LayerWeights,
    v41_indexer_logits,
    v41_kv_source,
    v41_layer_definition,
    v41_stack_definition,
)
from mla.reference.v4.rope import v4_rope_frequencies

F64 = torch.float64
TOL = dict(rtol=0.0, atol=1e-12)
CONFIG = get_v4_config("tiny-v41")
L = CONFIG.num_layers


def _weights(config: V4Config = CONFIG) -> list[V41LayerWeights]:
    return [V41LayerWeights.random(config, i, seed=10 + i) for i in range(config.num_layers)]


def _xs(T: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, CONFIG.hidden_size, generator=g, dtype=F64) for _ in range(L)]


# ---- the brute force: the module doc's equations, one row / one key at a time -------------


def _rms(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return v / math.sqrt(float((v * v).mean()) + CONFIG.rms_norm_eps) * w


def _rot(v: torch.Tensor, pos: int, ratio: int, inverse: bool = False) -> torch.Tensor:
    """GPT-J pairs on the last 64 dims, angle pos·f_i (f_i: the layer's rotary)."""
    freqs = v4_rope_frequencies(CONFIG, 1 if ratio == 0 else 4)
    out = v.clone()
    base = v.shape[-1] - CONFIG.rope_head_dim
    for i, f in enumerate(freqs.tolist()):
        a, b = float(v[base + 2 * i]), float(v[base + 2 * i + 1])
        cs, sn = math.cos(pos * f), math.sin(pos * f) * (-1 if inverse else 1)
        out[base + 2 * i], out[base + 2 * i + 1] = a * cs - b * sn, a * sn + b * cs
    return out


def _brute_kv(x: torch.Tensor, w: V41LayerWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """The kv source's entries and index keys."""
    r, entries, keys = w.ratio, [], []
    for j in range(x.shape[0] // r):
        kvs = [w["compressor.wkv.weight"] @ x[t] for t in range(j * r, j * r + r)]
        if r == 1:
            pooled = kvs[0]
        else:
            s = [w["compressor.wgate.weight"] @ x[t] for t in range(j * r, j * r + r)]
            den = sum(torch.exp(si) for si in s)
            pooled = sum(torch.exp(si) / den * kv for si, kv in zip(s, kvs))
        latent = _rms(pooled, w["compressor.norm.weight"])
        entries.append(_rot(latent, j * r, r))
        k = _rms(w["indexer.wk.weight"] @ latent, w["indexer.k_norm.weight"])
        keys.append(_rot(k, j * r, r))
    d = CONFIG.head_dim
    return (torch.stack(entries) if entries else torch.zeros(0, d, dtype=F64),
            torch.stack(keys) if keys else torch.zeros(0, CONFIG.index_head_dim, dtype=F64))


def _brute_index(x: torch.Tensor, w: V41LayerWeights, keys: torch.Tensor,
                 candidates: list[list[int]] | None) -> tuple[list[list[int]], list | None]:
    """Top-k rows (ids, -1 padded) and, for the candidate source, its blocks per row."""
    c, r, K = CONFIG, w.ratio, CONFIG.index_topk
    T, H, D, B = x.shape[0], c.index_n_heads, c.index_head_dim, c.candidate_block_size
    if T // r <= K:
        return [[j if j < (p + 1) // r else -1 for j in range(K)] for p in range(T)], None
    role = c.candidate_role(w.layer)
    rows, published = [], []
    for p in range(T):
        n = (p + 1) // r
        qr = _rms(w["wq_a.weight"] @ x[p], w["q_norm.weight"])
        qi = (w["indexer.wq_b.weight"] @ qr).view(H, D)
        qi = torch.stack([_rot(qi[h], p, r) for h in range(H)])
        wt = w["indexer.weights_proj.weight"] @ x[p] * D ** -0.5 * H ** -0.5
        logit = [sum(float(wt[h]) * max(float(qi[h] @ keys[j]), 0.0) for h in range(H))
                 for j in range(n)]
        if role == "write":
            score = {b: max(logit[b * B:(b + 1) * B]) for b in range(-(-n // B))}
            if n:
                score[(n - 1) // B] = math.inf
            best = sorted(score, key=lambda b: (-score[b], b))[:c.candidate_topk_blocks]
            published.append(best)
        elif role == "mask":
            assert candidates is not None
            logit = [v if j // B in candidates[p] else -math.inf for j, v in enumerate(logit)]
        order = sorted(range(n), key=lambda j: (-logit[j], j))[:K]
        rows.append(order + [-1] * (K - len(order)))
    return rows, (published if role == "write" else None)


def _brute_attend(x: torch.Tensor, w: V41LayerWeights, entries: torch.Tensor,
                  topk: list[list[int]] | None) -> torch.Tensor:
    c, r = CONFIG, w.ratio
    T, H, d, G = x.shape[0], c.num_heads, c.head_dim, c.o_groups
    out = torch.zeros(T, c.hidden_size, dtype=F64)
    kv = [_rot(_rms(w["wkv.weight"] @ x[s], w["kv_norm.weight"]), s, r) for s in range(T)]
    for p in range(T):
        keys = [kv[s] for s in range(max(p - c.sliding_window + 1, 0), p + 1)]
        if r:
            keys += [entries[j] for j in topk[p][:min((p + 1) // r, c.index_topk)] if j >= 0]
        qr = _rms(w["wq_a.weight"] @ x[p], w["q_norm.weight"])
        q = (w["wq_b.weight"] @ qr).view(H, d)
        heads = []
        for h in range(H):
            qh = _rot(q[h], p, r)
            e = [math.exp(float(qh @ k) / math.sqrt(d)) for k in keys]
            den = sum(e) + math.exp(float(w["attn_sink"][h]))
            o = sum(ei * k for ei, k in zip(e, keys)) / den
            heads.append(_rot(o, p, r, inverse=True))
        wa = w["wo_a.weight"].view(G, c.o_lora_rank, -1)
        z = torch.cat([wa[g] @ torch.cat(heads[g * H // G:(g + 1) * H // G]) for g in range(G)])
        out[p] = w["wo_b.weight"] @ z
    return out


def _brute_stack(xs: list[torch.Tensor], ws: list[V41LayerWeights]) -> list:
    kv, idx, cand, outs = {}, {}, None, []
    for i, (x, w) in enumerate(zip(xs, ws)):
        c, r = CONFIG, w.ratio
        topk = None
        if r:
            if c.owns_compressor(i):
                kv[i] = _brute_kv(x, w)
            entries, keys = kv[c.kv_source_layer(i)]
            if c.owns_indexer(i):
                idx[i], pub = _brute_index(x, w, keys, cand)
                if c.candidate_role(i) == "write":
                    cand = pub
            topk = idx[c.index_source_layer(i)]
        else:
            entries = None
        outs.append((_brute_attend(x, w, entries, topk), topk))
    return outs


# ---- the tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 2, 5, 13])
def test_every_layer_equals_the_brute_force(T):
    """Ratios 0, 1, 2, sources and consumers, the candidate source and a masking indexer;
    T = 1, lengths not multiples of 2, the short-context fill (T // r <= 3) and logits."""
    xs, ws = _xs(T), _weights()
    traces = v41_stack_definition(xs, ws)
    for i, (trace, (out, topk)) in enumerate(zip(traces, _brute_stack(xs, ws))):
        torch.testing.assert_close(trace.out, out, **TOL, msg=f"layer {i}")
        if topk is None:
            assert trace.topk is None and trace.k_compressed.shape == (0, 512)
        else:
            assert trace.topk.tolist() == topk, f"layer {i}"
            assert trace.k_compressed.shape[0] == T // ws[i].ratio


def test_short_context_fill_and_logits_regimes():
    t5 = v41_stack_definition(_xs(5), _weights())
    assert t5[1].index_source.logits is None  # 5 // 2 <= 3: the fill
    assert t5[1].topk.tolist() == [[-1] * 3, [0, -1, -1], [0, -1, -1], [0, 1, -1], [0, 1, -1]]
    assert t5[3].index_source.logits is not None  # 5 // 1 > 3: logits, candidates published
    assert t5[3].index_source.candidates is not None


def test_consumer_reads_what_its_source_published():
    xs, ws = _xs(13), _weights()
    traces = v41_stack_definition(xs, ws)
    src = v41_kv_source(xs[1], ws[1])  # recomputed from the source's weights and states
    assert torch.equal(traces[2].k_compressed, src.entries)
    assert traces[2].kv_source.layer == 1 and traces[5].kv_source.layer == 3
    assert torch.equal(traces[2].topk, traces[1].topk)  # the index source's top-k
    assert torch.equal(traces[5].topk, traces[4].topk)
    assert traces[5].index_source.layer == 4
    entries, _ = _brute_kv(xs[1], ws[1])
    torch.testing.assert_close(src.entries, entries, **TOL)
    alone = v41_layer_definition(xs[2], ws[2], kv_source=src, index_source=traces[1].index_source)
    assert torch.equal(alone.out, traces[2].out)
    # the consumer's compressed keys follow the source's hidden states, not its own
    moved = list(xs)
    moved[2] = xs[2] + 1.0
    again = v41_stack_definition(moved, ws)
    assert torch.equal(again[2].k_compressed, traces[2].k_compressed)
    moved = list(xs)
    moved[1] = xs[1] + 1.0
    assert not torch.equal(v41_stack_definition(moved, ws)[2].k_compressed,
                           traces[2].k_compressed)


def test_candidates_pin_the_newest_block_and_mask_only_outside_them():
    T, B = 24, CONFIG.candidate_block_size
    xs, ws = _xs(T, seed=3), _weights()
    traces = v41_stack_definition(xs, ws)
    cand = traces[3].index_source.candidates
    # the source's own top-k is unmasked: the top-k of its plain logits
    plain = v41_indexer_logits(xs[3], traces[3].q_latent, traces[3].kv_source.index_keys, ws[3])
    assert torch.equal(traces[3].index_source.logits, plain)
    free_cfg = CONFIG.replace(candidate_source_layer_id=-1)
    free_ws = [V41LayerWeights(free_cfg, i, w.tensors) for i, w in enumerate(ws)]
    free = v41_stack_definition(xs, free_ws)[4].topk
    masked, changed, same = traces[4].topk, 0, 0
    for p in range(T):
        blocks = set(cand[p].tolist()) - {-1}
        assert p // B in blocks  # n_p - 1 = p (ratio 1): the newest block is pinned
        assert all(j // B in blocks for j in masked[p].tolist() if j >= 0)
        if all(j // B in blocks for j in free[p].tolist() if j >= 0):
            assert masked[p].tolist() == free[p].tolist()
            same += 1
        else:
            assert masked[p].tolist() != free[p].tolist()
            changed += 1
    assert changed and same


def test_window_slides():
    T, W = 13, CONFIG.sliding_window
    xs, ws = _xs(T), _weights()
    base = v41_layer_definition(xs[0], ws[0])
    assert base.window_mask.sum(1).tolist() == [min(p + 1, W) for p in range(T)]
    x = xs[0].clone()
    x[5] += 1.0
    moved = v41_layer_definition(x, ws[0]).out
    changed = [p for p in range(T) if not torch.equal(moved[p], base.out[p])]
    assert changed == list(range(5, 5 + W))


def test_bad_inputs_name_the_argument():
    xs, ws = _xs(6), _weights()
    src = v41_kv_source(xs[1], ws[1])
    idx = v41_stack_definition(xs, ws)[1].index_source
    with pytest.raises(ValueError, match="x"):
        v41_layer_definition(xs[0][:, :10], ws[0])
    with pytest.raises(TypeError, match="weights"):
        v41_layer_definition(xs[0], ws[0].tensors)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="kv_source"):
        v41_layer_definition(xs[2], ws[2], index_source=idx)
    with pytest.raises(ValueError, match="kv_source"):
        v41_layer_definition(xs[1], ws[1], kv_source=src)  # a source computes its own
    with pytest.raises(ValueError, match="kv_source must be layer 3"):
        v41_layer_definition(xs[5], ws[5], kv_source=src, index_source=idx)
    with pytest.raises(ValueError, match="kv_source holds"):
        v41_layer_definition(xs[2][:4], ws[2], kv_source=src, index_source=idx)
    with pytest.raises(ValueError, match="candidates"):
        v41_layer_definition(xs[1], ws[1], candidates=torch.zeros(6, 2, dtype=torch.int64))
    t = v41_stack_definition(xs, ws)
    with pytest.raises(ValueError, match="candidates"):  # layer 4 masks: it needs them
        v41_layer_definition(xs[4], ws[4], kv_source=t[3].kv_source)
    with pytest.raises(ValueError, match="wq_a"):
        V41LayerWeights(CONFIG, 0, {k: v for k, v in ws[0].tensors.items() if k != "wq_a.weight"})
    with pytest.raises(ValueError, match="indexer.wk"):
        V41LayerWeights(CONFIG, 0, {**ws[0].tensors, "indexer.wk.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="config"):
        V41LayerWeights.random(CONFIG.replace(q_head_norm=True), 0)
    with pytest.raises(ValueError, match="must agree"):  # a ratio-1 consumer of a ratio-2 source
        V41LayerWeights.random(CONFIG.replace(compress_ratios=(0, 2, 1, 1, 1, 1, 0)), 2)
    with pytest.raises(ValueError, match="xs and weights"):
        v41_stack_definition(xs[:2], ws)
    assert isinstance(src, V41KVSource) and isinstance(idx, V41IndexSource)


def test_masking_indexer_without_published_candidates_is_refused():
    """A ratio-2 candidate source in the short-context fill publishes nothing; a later ratio-1
    index source computing logits would read a buffer nobody wrote."""
    cfg = CONFIG.replace(compress_ratios=(0, 2, 2, 1, 1, 1, 0), candidate_source_layer_id=1)
    ws = _weights(cfg)
    with pytest.raises(ValueError, match="candidates"):
        v41_stack_definition(_xs(5), ws)  # 5 // 2 <= 3 (fill) but 5 // 1 > 3 (logits)
    assert v41_stack_definition(_xs(13), ws)[3].topk.shape == (13, 3)
