"""DeepSeek-V4's layer on the fast path (``mla.fast.v4``) against the float64 reference.

Under Triton's interpreter (conftest), on ``tiny-v4`` (4 heads, rows of 512, window 8, top-k 3):

- the compressor's stores, byte for byte the reference's (``compress`` then
  ``compressed_entries_model1_pages`` / ``quantize_compressed_indexer_entries``) from the same
  float32 ``kv`` and ``score``: ratios 4 and 128, ``d = 512`` (both scale floors) and the
  indexer's 128, lengths 0, 1, r - 1, r, r + 1 and more, whole histories and steps fed by a
  short history that starts before position 0;
- the front's query (bf16 values, padded heads zero) and window key bytes, and the indexer's q
  codes and folded weights, from the same inputs;
- whole steps, decode and prefill, ratios 1, 4 and 128: the window cache's bytes are the
  quantization of the fast path's own ``c_KV`` (exact), the compressed cache's bytes the
  reference's but for rare codes next to a rounding boundary (float32 projections here, float64
  there), the output within bf16 budgets of the reference's step fed the same top-k;
- bad input raises ``ValueError`` naming the argument.
"""

from __future__ import annotations

import pytest
import torch
from _interpreter import needs_interpreter

pytestmark = needs_interpreter

from mla.fast.v4 import (  # noqa: E402
    V4FastCache,
    v4_compress_store,
    v4_cos_sin_cache,
    v4_indexer_q_prep,
    v4_layer_step,
    v4_q_rope_kv_insert,
)
from mla.reference.fp8_model1 import (  # noqa: E402
    fp8_model1_cache,
    fp8_model1_page_bytes,
    write_fp8_model1,
)
from mla.reference.indexer_cache import read_indexer_k_cache  # noqa: E402
from mla.reference.v4 import V4Cache, V4LayerWeights, get_v4_config, rope_gptj  # noqa: E402
from mla.reference.v4 import v4_layer_step as ref_step  # noqa: E402
from mla.reference.v4.compressor import (  # noqa: E402
    CompressorWeights,
    compress_pool,
    compressed_entries_model1_pages,
    compressor_kv_score,
    quantize_compressed_indexer_entries,
    round_compressed_entries,
)
from mla.reference.v4.indexer import (  # noqa: E402
    IndexerV4Weights,
    v4_indexer_q,
    v4_indexer_weights,
)
from mla.reference.v4.rope import rope_gptj as rope  # noqa: E402

C = get_v4_config("tiny-v4")
F64 = torch.float64


def _entries(kv: torch.Tensor, score: torch.Tensor, w: CompressorWeights) -> torch.Tensor:
    """The reference's entries of one request from float32 kv / score (positions 0 ..)."""
    pooled = compress_pool(kv.double(), score.double(), w.ratio, w.ratio == 4)
    from mla.reference.front import rms_norm
    n = rms_norm(pooled, w.norm.double(), C.rms_norm_eps)
    return rope(n, torch.arange(n.shape[0]) * w.ratio, C, w.ratio)


def _model1_token(pages: torch.Tensor, bs: int, slot: int) -> torch.Tensor:
    pg, o = slot // bs, slot % bs
    return torch.cat([pages[pg, o * 576:(o + 1) * 576],
                      pages[pg, 576 * bs + o * 8:576 * bs + o * 8 + 8]])


@pytest.mark.parametrize("ratio,d,floor", [(4, 512, "flashmla"), (128, 512, "flashmla"),
                                           (4, 512, "vllm"), (4, 128, "vllm")])
def test_compressor_bytes(ratio: int, d: int, floor: str) -> None:
    w = CompressorWeights.random(C.hidden_size, d, ratio, seed=ratio + d)
    lens = [0, 1, 3, 4, 5, 13] if ratio == 4 else [1, 127, 128, 129]
    g = torch.Generator().manual_seed(1)
    kvs, scs = zip(*[compressor_kv_score(torch.randn(L, C.hidden_size, generator=g, dtype=F64),
                                         w, torch.arange(L)) for L in lens])
    kv, sc = torch.cat(kvs).float(), torch.cat(scs).float()
    B = len(lens)
    offs = torch.tensor([sum(lens[:b]) for b in range(B)], dtype=torch.int32)
    L = torch.tensor(lens, dtype=torch.int32)
    bs = 256 // ratio if d == 512 else 64
    table = torch.randperm(B * 2, generator=g).to(torch.int32).view(B, 2)
    if d == 512:
        pages = torch.zeros(B * 2, fp8_model1_page_bytes(bs), dtype=torch.uint8)
        cache = fp8_model1_cache(pages, bs)
    else:
        cache = torch.zeros(B * 2, bs, 132, dtype=torch.uint8)
    cs = v4_cos_sin_cache(C, ratio, 256)
    v4_compress_store(kv, sc, offs, L, L, max(lens), w.norm, cs, cache, table, ratio=ratio,
                      rms_norm_eps=C.rms_norm_eps, scale_floor=floor, validate=True)
    for b, n in enumerate(lens):
        ent = _entries(kv[offs[b]:offs[b] + n], sc[offs[b]:offs[b] + n], w)
        if ent.shape[0] == 0:
            continue
        ids = torch.arange(ent.shape[0])
        slots = table[b].long()[ids // bs] * bs + ids % bs
        if d == 512:
            want = compressed_entries_model1_pages(ent, 1, scale_floor=floor)[:, :584]
            got = torch.stack([_model1_token(pages, bs, int(s)) for s in slots])
            assert torch.equal(got, want), (b, (got != want).sum())
        else:
            codes, scale = read_indexer_k_cache(cache, slots)
            rc, rs = quantize_compressed_indexer_entries(ent)
            assert torch.equal(codes.view(torch.uint8), rc) and torch.equal(scale, rs)


def test_compressor_steps_from_a_short_history() -> None:
    """Token by token and in chunks, each step given only the last coff·r positions before it
    (history_start below 0 at first): the same bytes as the whole history at once."""
    ratio, d, bs = 4, 512, 64
    w = CompressorWeights.random(C.hidden_size, d, ratio, seed=5)
    total = 14
    kv, sc = (t.float() for t in compressor_kv_score(
        torch.randn(total, C.hidden_size, dtype=F64, generator=torch.Generator().manual_seed(2)),
        w, torch.arange(total)))
    table = torch.tensor([[1]], dtype=torch.int32)
    cs = v4_cos_sin_cache(C, ratio, 64)
    whole = torch.zeros(2, fp8_model1_page_bytes(bs), dtype=torch.uint8)
    one = torch.tensor([total], dtype=torch.int32)
    v4_compress_store(kv, sc, torch.tensor([0], dtype=torch.int32), one, one, total, w.norm,
                      cs, fp8_model1_cache(whole, bs), table, ratio=ratio,
                      rms_norm_eps=C.rms_norm_eps, validate=True)
    steps = torch.zeros_like(whole)
    done, W = 0, 2 * ratio
    for n in (1, 1, 3, 4, 5):
        lo = done - W
        rows = torch.arange(max(lo, 0), done + n)
        v4_compress_store(kv[rows], sc[rows], torch.tensor([0], dtype=torch.int32),
                          torch.tensor([done + n], dtype=torch.int32),
                          torch.tensor([n], dtype=torch.int32), n, w.norm, cs,
                          fp8_model1_cache(steps, bs), table, ratio=ratio,
                          rms_norm_eps=C.rms_norm_eps,
                          history_start=torch.tensor([max(lo, 0)], dtype=torch.int32),
                          validate=True)
        done += n
    assert done == total and torch.equal(steps, whole)


@pytest.mark.parametrize("ratio", [1, 4])
def test_front(ratio: int) -> None:
    g = torch.Generator().manual_seed(ratio)
    T, H = 5, 3
    q = torch.randn(T, H, 512, generator=g).bfloat16().float()
    kv = (torch.randn(T, 512, generator=g) * 0.3).bfloat16().float()
    kv[1, :64] *= 1e-3  # a tile under both floors' limits
    pos = torch.tensor([0, 3, 7, 100, 33])
    pages = torch.zeros(3, fp8_model1_page_bytes(64), dtype=torch.uint8)
    want = pages.clone()
    slots = torch.tensor([5, 70, -1, 130, 64])
    out = v4_q_rope_kv_insert(q, kv, pos, v4_cos_sin_cache(C, ratio, 128),
                              fp8_model1_cache(pages, 64), slots, rms_norm_eps=C.rms_norm_eps,
                              padded_heads=4, out_dtype=torch.float32, validate=True)
    qd = q.double() * torch.rsqrt(q.double().pow(2).mean(-1, keepdim=True) + C.rms_norm_eps)
    assert torch.equal(out[:, :H], rope_gptj(qd, pos, C, ratio).bfloat16().float())
    assert torch.equal(out[:, H:], torch.zeros(T, 1, 512))
    keep = slots >= 0
    k = rope_gptj(kv.double(), pos, C, ratio)
    write_fp8_model1(want, 64, slots[keep], k[keep].bfloat16(), scale_floor="vllm")
    assert torch.equal(pages, want)


def test_indexer_q_prep() -> None:
    c = C.replace(index_n_heads=5)  # a head count that is not a power of two
    w = IndexerV4Weights.random(c, seed=3)
    g = torch.Generator().manual_seed(3)
    T = 6
    qr = torch.randn(T, c.q_lora_rank, generator=g, dtype=F64)
    x = torch.randn(T, c.hidden_size, generator=g, dtype=F64)
    pos = torch.tensor([0, 1, 5, 9, 40, 77])
    rq, rs = v4_indexer_q(qr, w, pos, c)
    rw = v4_indexer_weights(x, w, c, rs)
    qi = (qr @ w.wq_b.T).view(T, 5, 128).bfloat16().float()
    wi = (x @ w.weights_proj.T).bfloat16().float()
    codes, wq = v4_indexer_q_prep(qi, wi, pos, v4_cos_sin_cache(c, 4, 128))
    assert torch.equal(codes.double(), rq)
    assert ((wq.double() - rw).abs() <= 2 ** -23 * rw.abs()).all()


def _model1_of_own_kv(fc: V4FastCache, kv: torch.Tensor, pos: torch.Tensor,
                      req: torch.Tensor) -> torch.Tensor:
    slots = fc.window_table[req, pos // 64].long() * 64 + pos % 64
    pages = torch.zeros_like(fc.window_pages)
    k = rope_gptj(kv.double(), pos, C, fc.weights.ratio)
    write_fp8_model1(pages, 64, slots, k.bfloat16(), scale_floor="vllm")
    return pages


STEPS = {"decode": [[5, 3], [1, 2], [4, 1]], "prefill": [[13, 4], [3, 9]]}


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_layer_step(ratio: int, path: str) -> None:
    w = V4LayerWeights.random(C, ratio, seed=ratio)
    B, cap = 2, 40
    fc = V4FastCache.empty(w, B, cap, dtype=torch.float32, device="cpu")
    rc = V4Cache.empty(w, B, cap)
    g = torch.Generator().manual_seed(ratio)
    own = torch.zeros_like(fc.window_pages)
    for st in STEPS[path]:
        xs = [torch.randn(n, C.hidden_size, generator=g, dtype=F64) for n in st]
        req = torch.repeat_interleave(torch.arange(B), torch.tensor(st))
        outs, tr = v4_layer_step([x.float() for x in xs], fc, path=path, trace=True)
        tk = list(tr.topk.split(st)) if ratio == 4 else None
        if ratio == 4:  # every id visible, valid ids first, then -1
            vis = (tr.positions + 1) // 4
            ok = tr.topk >= 0
            assert (tr.topk < vis[:, None]).all()
            assert torch.equal(ok.sum(1), vis.clamp(max=C.index_topk))
        routs = ref_step(xs, rc, path=path, topk=tk)
        for o, ro in zip(outs, routs):
            assert ((o.double() - ro).norm() / ro.norm()) < 1e-2
        own |= _model1_of_own_kv(fc, tr.kv, tr.positions, req)
        if ratio > 1:
            diff = (fc.compressed_pages != rc.compressed.storage).float().mean()
            assert diff < 0.02
    assert torch.equal(fc.window_pages, own)


def test_compressed_entries_in_the_layer_round_like_the_reference() -> None:
    """The compressed cache read back equals ``round_compressed_entries`` of the reference's
    entries to within one e4m3 step on all but a few values (float32 projections)."""
    w = V4LayerWeights.random(C, 128, seed=7)
    fc = V4FastCache.empty(w, 1, 300, dtype=torch.float32, device="cpu")
    x = torch.randn(257, C.hidden_size, dtype=F64, generator=torch.Generator().manual_seed(7))
    v4_layer_step([x.float()], fc, path="prefill")
    from mla.reference.fp8_model1 import fp8_model1_rows
    from mla.reference.v4.compressor import compress, compressor_weights_of
    ent = round_compressed_entries(compress(x, compressor_weights_of(w), C))
    slots = fc.compressed_table[0].long()[torch.arange(2) // 2] * 2 + torch.arange(2) % 2
    got = fp8_model1_rows(fc.compressed_pages, 2, slots).double()
    assert ((got - ent).abs() <= 2 ** -3 * ent.abs() + 1e-6).float().mean() > 0.99


def test_bad_input() -> None:
    w = V4LayerWeights.random(C, 4, seed=0)
    fc = V4FastCache.empty(w, 1, 16, dtype=torch.float32, device="cpu")
    x = torch.randn(2, C.hidden_size)
    with pytest.raises(ValueError, match="path"):
        v4_layer_step([x], fc, path="both")
    with pytest.raises(ValueError, match="x"):
        v4_layer_step([x, x], fc)
    with pytest.raises(ValueError, match="x\\[0\\]"):
        v4_layer_step([torch.randn(2, 3)], fc)
    with pytest.raises(ValueError, match="capacity"):
        v4_layer_step([torch.randn(17, C.hidden_size)], fc)
    with pytest.raises(ValueError, match="capacity"):
        V4FastCache.empty(w, 1, 0, device="cpu")
    kv = torch.zeros(4, 1024)
    one = torch.ones(1, dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    cache = fp8_model1_cache(torch.zeros(1, fp8_model1_page_bytes(64), dtype=torch.uint8), 64)
    cs = v4_cos_sin_cache(C, 4, 16)
    norm = torch.ones(512)
    with pytest.raises(ValueError, match="ratio"):
        v4_compress_store(kv, kv, one * 0, one, one, 1, norm, cs, cache, table, ratio=2,
                          rms_norm_eps=1e-6)
    with pytest.raises(ValueError, match="norm_weight"):
        v4_compress_store(kv, kv, one * 0, one, one, 1, torch.ones(100), cs, cache, table,
                          ratio=4, rms_norm_eps=1e-6)
    with pytest.raises(ValueError, match="score"):
        v4_compress_store(kv, kv[:, :512], one * 0, one, one, 1, norm, cs, cache, table,
                          ratio=4, rms_norm_eps=1e-6)
    with pytest.raises(ValueError, match="scale_floor"):
        v4_compress_store(kv, kv, one * 0, one, one, 1, norm, cs, cache, table, ratio=4,
                          rms_norm_eps=1e-6, scale_floor="none")
    with pytest.raises(ValueError, match="history_start"):
        v4_compress_store(kv, kv, one * 0, one * 4, one * 4, 4, norm, cs, cache, table,
                          ratio=4, rms_norm_eps=1e-6, history_start=one, validate=True)
    with pytest.raises(ValueError, match="q"):
        v4_q_rope_kv_insert(torch.zeros(1, 2, 256), torch.zeros(1, 512), one, cs, cache, one,
                            rms_norm_eps=1e-6)
    with pytest.raises(ValueError, match="padded_heads"):
        v4_q_rope_kv_insert(torch.zeros(1, 2, 512), torch.zeros(1, 512), one, cs, cache, one,
                            rms_norm_eps=1e-6, padded_heads=1)
    with pytest.raises(ValueError, match="slot_mapping"):
        v4_q_rope_kv_insert(torch.zeros(1, 2, 512), torch.zeros(1, 512), one, cs, cache,
                            one * 64, rms_norm_eps=1e-6, validate=True)
    with pytest.raises(ValueError, match="w"):
        v4_indexer_q_prep(torch.zeros(1, 2, 128), torch.zeros(1, 3), one, cs)
