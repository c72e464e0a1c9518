"""DeepSeek-V4's layer kernels in the catalogue (``mla.conformance.cases.deepseek_v4_layer``):
``v4_compress``, ``v4_indexer_q`` and ``v4_scope_indices`` bite.

The reference passes every case; a twin with one convention broken (no overlap, RoPE at the
block's last position, the other UE8M0 floor, masked positions read; NeoX pairs, q's scale not
folded; the window one token short, top-k ids not put valid first, ``p // 128`` visible
entries) fails the cases that pin it, with the convention named. The kernel-level references
equal the model-level ones (``compress``, ``serving``'s indices) and the ``vllm-v4`` target
(all three kernels) reads "unsupported" where it cannot run. All on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _case_twins import SETTING, assert_twin_verdicts, twin_rows

import mla.reference as ref
from mla.conformance import CATALOGUE, KERNELS, run
from mla.conformance.cases.deepseek_v4_layer import cos_sin_table
from mla.conformance.runner import run_case
from mla.conformance.targets import load_target
from mla.reference.v4 import serving
from mla.reference.v4.compressor import (
    CompressorWeights,
    compress,
    compressor_init_state,
    compressor_step,
)
from mla.reference.v4.config import get_v4_config
from mla.reference.v4.kernels import (
    compress_entries,
    compress_records,
    indexer_q_records,
)
from mla.reference.v4.rope import v4_rope_frequencies
from mla.reference.v4.scopes import (
    COMPRESSED_PAGE_TOKENS,
    decode_scope_indices,
    paged_slots,
    v4_scope_indices,
)
from mla.reference.v4.weights import V4LayerWeights

LAYER = ("v4_compress", "v4_indexer_q", "v4_scope_indices")
CONFIG = get_v4_config("deepseek-v4")


def test_the_cases_are_registered_and_documented() -> None:
    cases = [c for c in CATALOGUE.values() if c.kernel in LAYER]
    assert set(LAYER) <= set(KERNELS)
    assert {c.kernel for c in cases} == set(LAYER) and len(cases) >= 40
    for c in cases:
        assert c.doc.endswith(".") and len(c.doc) > 20, c.name


def test_the_reference_passes_every_case() -> None:
    for dtype in (torch.float64, torch.float32):
        report = run({k: getattr(ref, k) for k in LAYER}, kernels=list(LAYER), device="cpu",
                     dtype=dtype, small=True)
        assert [r.status for r in report.rows] == ["pass"] * len(report.rows), report.to_text()


# ---- broken twins -----------------------------------------------------------------------------

def _compress_twin(floor: str = "vllm", **variant: object) -> Callable:
    def twin(kv, score, state_kv, state_score, positions, norm_weight, cos_sin, ratio,
             rms_norm_eps=1e-6):
        v = dict(variant)
        if v.get("overlap") is False and ratio != 4:
            v.pop("overlap")
        e = compress_entries(kv, score, state_kv, state_score, positions, norm_weight, cos_sin,
                             ratio, rms_norm_eps, **v)
        return compress_records(e, scale_floor=floor)
    return twin


def _q_twin(kind: str) -> Callable:
    def twin(q, weights, positions, cos_sin, softmax_scale, head_scale):
        codes, w = ref.v4_indexer_q(q, weights, positions, cos_sin, softmax_scale, head_scale)
        if kind == "unfolded":
            return codes, (weights.double() * softmax_scale * head_scale).float()
        qq = q.double()  # NeoX: rotate-half pairs (i, i + 32) on the last 64
        a, b = qq[..., 64:96], qq[..., 96:]
        rows = cos_sin.double()[positions.long()][:, None]
        c, s = rows[..., :32], rows[..., 32:]
        x = torch.cat([qq[..., :64], a * c - b * s, a * s + b * c], dim=-1)
        codes, sc = indexer_q_records(x)
        return codes, (weights.double() * sc.double() * softmax_scale * head_scale).float()
    return twin


def _scope_twin(kind: str) -> Callable:
    def twin(positions, token_to_req, seq_lens, window_table, compressed_table, topk, ratio,
             window, path="decode"):
        if kind == "short":
            out = list(v4_scope_indices(positions, token_to_req, seq_lens, window_table,
                                        compressed_table, topk, ratio, window - 1, path))
            if path == "decode":
                out[0] = torch.nn.functional.pad(out[0], (0, 1), value=-1)
            return tuple(out)
        out = list(v4_scope_indices(positions, token_to_req, seq_lens, window_table,
                                    compressed_table, topk, ratio, window, path))
        if path != "decode":
            return tuple(out)
        if kind == "in_place" and ratio == 4:
            out[2] = torch.stack([paged_slots(topk[t], compressed_table[int(token_to_req[t])],
                                              COMPRESSED_PAGE_TOKENS // 4)
                                  for t in range(topk.shape[0])])
        if kind == "floor" and ratio == 128:
            _, _, extra, n = decode_scope_indices(positions - 1, token_to_req, window_table,
                                                  compressed_table, None, 128, window)
            width = out[2].shape[1]
            out[2] = torch.nn.functional.pad(extra, (0, max(0, width - extra.shape[1])),
                                             value=-1)[:, :width]
            out[3] = n
        return tuple(out)
    return twin


TWINS = {
    # name: (kernel, twin, words of the named convention, cases that must fail, must pass)
    "no_overlap": ("v4_compress", _compress_twin(overlap=False), "no overlap",
                   ("c4_d512_length_4", "c4_d512_prefill", "c4_d512_tokens", "c4_d128_chunks",
                    "c4_d512_sharp", "c4_d128_sharp"),
                   ("c4_d512_length_3", "c128_d512_prefill", "c128_d512_sharp")),
    "rope_at_last": ("v4_compress", _compress_twin(rope_at="last"), "block's last position",
                     ("c4_d512_length_4", "c128_d512_length_128", "c4_d128_tokens",
                      "c128_d512_tail"), ("c4_d512_length_0", "c128_d512_length_127")),
    "other_floor": ("v4_compress", _compress_twin(floor="flashmla"), "floor",
                    ("c4_d512_ue8m0_floors", "c128_d512_ue8m0_floors", "c4_d128_ue8m0_floor",
                     "c4_d128_floor_1e_4"), ("c4_d512_prefill", "c4_d128_prefill")),
    "masked_read": ("v4_compress", _compress_twin(read_masked=True), "below 0 read",
                    ("c4_d512_masked_nan", "c4_d128_masked_nan", "c4_d512_length_4"),
                    ("c128_d512_length_128",)),
    "neox_pairs": ("v4_indexer_q", _q_twin("neox"), "NeoX",
                   ("random_64_heads", "heads_32"), ("ties", "one_token")),
    "unfolded": ("v4_indexer_q", _q_twin("unfolded"), "without q's scale",
                 ("random_64_heads", "heads_32", "scale_floor", "ties", "zero_heads"), ()),
    "window_short": ("v4_scope_indices", _scope_twin("short"), "one token short",
                     ("decode_window_from_0", "decode_window_sliding", "decode_mtp_rows",
                      "prefill_c4", "prefill_c128", "prefill_window_only"), ()),
    "topk_in_place": ("v4_scope_indices", _scope_twin("in_place"), "valid ids first",
                      ("decode_c4_minus_one",), ("decode_c128_widths", "prefill_c4")),
    "visible_floor": ("v4_scope_indices", _scope_twin("floor"), "p // 128",
                      ("decode_c128_widths", "decode_c128_page_boundaries"),
                      ("decode_mtp_rows",)),
}


@pytest.mark.parametrize("name", sorted(TWINS))
def test_a_broken_twin_fails_its_cases_with_the_convention_named(name: str) -> None:
    kernel, twin, words, must_fail, must_pass = TWINS[name]
    assert_twin_verdicts(name, twin_rows(twin, kernel), words, must_fail, must_pass)


def test_a_single_wrong_byte_fails() -> None:
    def one_off(*args, **kw):
        out = ref.v4_compress(*args, **kw).clone()
        if out.numel():
            out[-1, 3] ^= 1
        return out
    row = run_case(one_off, CATALOGUE["v4_compress/c4_d512_prefill"], SETTING)
    assert row.status == "fail" and "differs at 1 of" in row.detail


# ---- the kernel-level references equal the model-level ones ----------------------------------

@pytest.mark.parametrize("d,ratio,steps", [(512, 4, (11, 1, 1, 9)), (128, 4, (6, 7)),
                                           (512, 128, (200, 1, 60))])
def test_compress_entries_equal_the_compressor(d: int, ratio: int, steps: tuple) -> None:
    """A selecting compressor (kv = x[:, :W], score = x[:, W:] + ape) fed in steps: the
    kernel-level entries with a float64 RoPE table equal compress's and compressor_step's."""
    g = torch.Generator().manual_seed(d + ratio)
    coff = 2 if ratio == 4 else 1
    W, L = coff * d, sum(steps)
    eye, zero = torch.eye(W, dtype=torch.float64), torch.zeros(W, W, dtype=torch.float64)
    w = CompressorWeights(wkv=torch.cat([eye, zero], 1), wgate=torch.cat([zero, eye], 1),
                          ape=torch.randn(ratio, W, generator=g, dtype=torch.float64),
                          norm=1 + 0.1 * torch.randn(d, generator=g, dtype=torch.float64))
    x = torch.randn(L, 2 * W, generator=g, dtype=torch.float64)
    kv, score = x[:, :W], x[:, W:] + w.ape[torch.arange(L) % ratio]
    angles = torch.arange(L + ratio, dtype=torch.float64)[:, None] * v4_rope_frequencies(CONFIG,
                                                                                         ratio)
    table = torch.cat([angles.cos(), angles.sin()], dim=1)
    want = compress(x, w, CONFIG)
    state, start, got, stepped = compressor_init_state(w), 0, [], []
    for n in steps:
        rows = torch.arange(start - coff * ratio, start)
        skv = torch.where((rows >= 0)[:, None], kv[rows.clamp(min=0)], float("nan"))
        ss = torch.where((rows >= 0)[:, None], score[rows.clamp(min=0)], float("nan"))
        got.append(compress_entries(kv[start:start + n], score[start:start + n], skv, ss,
                                    torch.arange(start, start + n), w.norm, table, ratio,
                                    CONFIG.rms_norm_eps))
        e, state = compressor_step(state, x[start:start + n], w, CONFIG)
        stepped.append(e)
        start += n
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat(stepped), want, rtol=1e-12, atol=1e-12)
    assert compress_records(want).shape == (L // ratio, 584 if d == 512 else 132)


def test_indexer_q_equals_the_model_level_q() -> None:
    from mla.reference.v4.indexer import IndexerV4Weights, v4_indexer_q, v4_indexer_weights
    T, H = 5, CONFIG.index_n_heads
    weights = IndexerV4Weights.random(CONFIG, seed=1, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    qr = torch.randn(T, CONFIG.q_lora_rank, generator=g, dtype=torch.float64)
    qr = qr.to(torch.bfloat16).double()
    x = torch.randn(T, CONFIG.hidden_size, generator=g, dtype=torch.float64)
    x = x.to(torch.bfloat16).double()
    positions = torch.tensor([0, 1, 77, 4095, 8000])
    q = (qr @ weights.wq_b.double().T).view(T, H, 128).to(torch.bfloat16)
    w = (x @ weights.weights_proj.double().T).to(torch.bfloat16)
    codes, scale = v4_indexer_q(qr, weights, positions, CONFIG)
    want_w = v4_indexer_weights(x, weights, CONFIG, scale)
    angles = torch.arange(8192, dtype=torch.float64)[:, None] * v4_rope_frequencies(CONFIG, 4)
    table = torch.cat([angles.cos(), angles.sin()], dim=1)  # float64: the same rotation
    got_codes, got_w = ref.v4_indexer_q(q, w, positions, table, 128 ** -0.5, H ** -0.5)
    assert torch.equal(got_codes, codes.to(torch.float8_e4m3fn).view(torch.uint8))
    torch.testing.assert_close(got_w.double(), want_w, rtol=2 ** -22, atol=0)
    assert cos_sin_table(4).dtype == torch.float32


@pytest.mark.parametrize("ratio", [1, 4, 128])
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_scope_indices_equal_the_serving_path(ratio: int, path: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """v4_layer_step's indices (caught at sparse_mla_decode / sparse_mla_prefill) are
    v4_scope_indices' of the same positions, tables and top-k."""
    config = get_v4_config("tiny-v4")
    w = V4LayerWeights.random(config, ratio, seed=4)
    cache = serving.V4Cache.empty(w, 2, 300, kv_cache_dtype="float64", seed=9)
    g = torch.Generator().manual_seed(ratio)
    seen: dict[str, tuple] = {}

    def catch_decode(q, kv, indices, scale, fp8, topk_length, **kw):
        seen["decode"] = (indices[:, 0], topk_length, kw.get("extra_indices_in_kvcache"),
                          kw.get("extra_topk_length"))
        return torch.zeros(q.shape[0], 1, q.shape[2], 512, dtype=torch.float64), None

    def catch_prefill(q, kv, indices, scale, d_v, topk_length, attn_sink):
        seen["prefill"] = (indices, topk_length)
        return torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.float64), None, None

    monkeypatch.setattr(serving, "sparse_mla_decode", catch_decode)
    monkeypatch.setattr(serving, "sparse_mla_prefill", catch_prefill)
    hidden = config.hidden_size
    first = [torch.randn(n, hidden, generator=g, dtype=torch.float64) for n in (150, 9)]
    serving.v4_layer_step(first, cache, path="prefill")
    new = [torch.randn(n, hidden, generator=g, dtype=torch.float64) for n in (3, 2)]
    lens = [cache.seq_len(b) + x.shape[0] for b, x in enumerate(new)]
    topk = None
    if ratio == 4:
        K = config.index_topk
        topk = [torch.stack([torch.where(torch.rand(K, generator=g) < 0.3, -1,
                                         torch.randint(0, (p + 1) // 4, (K,), generator=g))
                             for p in range(L - x.shape[0], L)]).int()
                for L, x in zip(lens, new)]
    serving.v4_layer_step(new, cache, path=path, topk=topk)
    positions = torch.cat([torch.arange(L - x.shape[0], L) for L, x in zip(lens, new)])
    token_to_req = torch.cat([torch.full((x.shape[0],), b) for b, x in enumerate(new)])
    got = v4_scope_indices(positions, token_to_req, torch.tensor(lens), cache.window.table,
                           None if cache.compressed is None else cache.compressed.table,
                           None if topk is None else torch.cat(topk), ratio,
                           config.sliding_window, path)
    want = seen[path]
    assert torch.equal(got[0], want[0].int()) and torch.equal(got[1], want[1].int())
    if path == "decode" and ratio > 1:
        assert torch.equal(got[2], want[2][:, 0].int()) and torch.equal(got[3], want[3].int())
    if path == "decode" and ratio == 1:
        assert got[2].shape == (positions.shape[0], 0) and not got[3].any()


# ---- the vllm-v4 target -----------------------------------------------------------------------

def test_vllm_v4_target_is_named_and_needs_the_interpreter_on_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its three kernels, each "unsupported" on CPU tensors without Triton's interpreter (their
    runs under it: tests/test_conformance_vllm_v4_scope.py)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    name, target = load_target("vllm-v4")
    assert name == "vllm-v4" and set(target) == set(LAYER)
    report = run(target, kernels=list(LAYER), cases=["c4_d512_length_4", "random_64_heads",
                                                     "decode_mtp_rows", "prefill_c4"],
                 device="cpu", dtype=torch.float32)
    status = {r.case: (r.status, r.detail) for r in report.rows}
    assert len(status) == 4
    for case, (st, detail) in status.items():
        assert st == "unsupported" and "TRITON_INTERPRET" in detail, (case, st, detail)
