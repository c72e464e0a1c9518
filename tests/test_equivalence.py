"""Every path equals the definition (conventions §2-§5 and §11).

Model level: ``prefill_forward`` and ``decode_forward`` against ``naive_forward`` (float64, on the
upcast same weights and inputs), in float64 to 1e-10, float32 to 1e-5, bfloat16 to 1e-2 (the
error is printed). Attention level: ``attention_with_lse`` against a softmax written out here,
``absorbed_attention`` against ``prefill_attention``, the edge cases of conventions §5 (all-masked
rows,
no keys), adversarial logits, and a check that the classic softmax-scale bug cannot pass.
Chunked prefill is in ``test_chunked.py``, the paged kernel in ``test_paged_cache.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from _util import (
    CONFIGS,
    DTYPES,
    SMALL,
    check,
    hidden,
    paged_cache,
    randn,
    scale_queries,
    upcast,
    weights,
    write_contexts,
)

from mla.compare import LSE_ABS_TOL, assert_close, rel_err
from mla.reference import (
    absorbed_attention,
    attention_with_lse,
    decode_forward,
    mla_decode_paged,
    mla_front,
    naive_attention,
    naive_forward,
    prefill_attention,
    prefill_forward,
)

# ---------------------------------------------------------------------------------------------
# model level: hidden states in, hidden states out
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("tokens,start", [(1, 0), (13, 0), (9, 1000)])
def test_prefill_forward_equals_naive(name: str, dtype: torch.dtype, tokens: int,
                                      start: int) -> None:
    cfg = CONFIGS[name]
    w = weights(name, dtype)
    h = hidden(cfg, tokens, seed=tokens + start, dtype=dtype)
    positions = torch.arange(start, start + tokens)  # far positions make YaRN's blend matter
    out = prefill_forward(w, h, positions)
    assert out.dtype == dtype and out.shape == h.shape
    check(out, naive_forward(upcast(w), h.double(), positions), f"prefill {name} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_forward_equals_naive_v2_lite(dtype: torch.dtype) -> None:
    cfg = CONFIGS["deepseek-v2-lite"]
    w = weights(cfg.name, dtype)
    h = hidden(cfg, 7, seed=7, dtype=dtype)
    check(prefill_forward(w, h), naive_forward(upcast(w), h.double()),
          f"prefill deepseek-v2-lite {dtype}")


def _decode_case(name: str, dtype: torch.dtype, lens: list[int], s_q: int, block_size: int,
                 w=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache ``lens[i]`` context tokens per request, decode ``s_q`` more; (out, float64 ref)."""
    cfg = CONFIGS[name]
    w = weights(name, dtype) if w is None else w
    full = [hidden(cfg, n + s_q, seed=100 + i, dtype=dtype) for i, n in enumerate(lens)]
    kv_cache, block_table = paged_cache(cfg, [n + s_q for n in lens], block_size, dtype)
    write_contexts(w, [h[:n] for h, n in zip(full, lens)], kv_cache, block_table)
    new = torch.stack([h[n:] for h, n in zip(full, lens)])
    out = decode_forward(w, new, kv_cache, block_table, torch.tensor(lens, dtype=torch.int32))
    assert out.dtype == dtype and out.shape == new.shape
    w64 = upcast(w)
    ref = torch.stack([naive_forward(w64, h.double())[n:] for h, n in zip(full, lens)])
    return out, ref


# cached lengths before the step: empty, one token, and lengths that are not page multiples
DECODE_LENS = [0, 1, 17, 70, 5]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("s_q", [1, 3])
def test_decode_forward_equals_naive(name: str, dtype: torch.dtype, block_size: int,
                                     s_q: int) -> None:
    out, ref = _decode_case(name, dtype, DECODE_LENS, s_q, block_size)
    check(out, ref, f"decode {name} {dtype} bs={block_size} s_q={s_q}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("s_q", [1, 2])
def test_decode_forward_equals_naive_v2_lite(dtype: torch.dtype, s_q: int) -> None:
    out, ref = _decode_case("deepseek-v2-lite", dtype, [0, 1, 37], s_q, 64)
    check(out, ref, f"decode deepseek-v2-lite {dtype} s_q={s_q}")


# ---------------------------------------------------------------------------------------------
# adversarial logits
# ---------------------------------------------------------------------------------------------


def _max_logit(w, h: torch.Tensor) -> float:
    """max |scaled logit| of the layer on ``h``, computed by hand from the front's outputs."""
    w64, cfg = upcast(w), w.config
    f = mla_front(w64, h.double(), torch.arange(h.shape[0]))
    k_nope = torch.einsum("tl,lnp->tnp", f.kv_c, w64.W_UK)
    s = (torch.einsum("snp,tnp->nst", f.q_nope, k_nope)
         + torch.einsum("snr,tr->nst", f.q_pe, f.k_pe)) * cfg.softmax_scale
    return s.abs().max().item()


# bfloat16 with logits x30: its 8-bit mantissa on q and k gives a logit of ~100 an absolute error
# of ~0.4, so the softmax weights themselves move. Measured on 13 tokens over 12 seeds (tiny,
# tiny-noq, V2-Lite): median 1.2e-2 to 1.5e-2, max 2.3e-2, against 4.8e-3 max for the same
# inputs unscaled. So bf16 is legitimately above conventions §11's 1e-2 here, and even above 2e-2
# for
# some seeds; hidden states x sqrt(30) measured median 7.5e-3 to 9.6e-3, max 2.0e-2. These
# scaled-logit cases alone are bounded by 3e-2 (and the value is printed).
BF16_X30_TOL = 3e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["tiny", "tiny-noq", "deepseek-v2-lite"])
def test_logits_x30(name: str, dtype: torch.dtype) -> None:
    """The query projection times 30 multiplies every logit by 30 (the hidden states cannot:
    the query's RMSNorm would undo it); prefill and decode still equal the definition."""
    cfg = CONFIGS[name]
    w = scale_queries(weights(name, dtype), 30.0)
    h = hidden(cfg, 13, seed=11, dtype=dtype)
    big = _max_logit(w, h)
    assert big > 30 * 2, f"logits are not adversarial: max |s| = {big:.1f}"
    ref = naive_forward(upcast(w), h.double())
    out_p = prefill_forward(w, h)
    out_d, ref_d = _decode_case(name, dtype, [0, 6, 21], 2, 16, w=w)
    if dtype == torch.bfloat16:
        for what, o, r in (("prefill", out_p, ref), ("decode", out_d, ref_d)):
            err = rel_err(o, r)
            print(f"logits x30 (max |s| {big:.0f}) {name} {what}: bfloat16 relative error "
                  f"{err:.2e} (bound {BF16_X30_TOL:.0e} for scaled logits, see BF16_X30_TOL)")
            assert err <= BF16_X30_TOL, f"{what}: {err:.3e} > {BF16_X30_TOL}"
    else:
        check(out_p, ref, f"prefill logits x30 {name} {dtype}")
        check(out_d, ref_d, f"decode logits x30 {name} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["tiny-noq", "deepseek-v2-lite"])
def test_hidden_states_scaled(name: str, dtype: torch.dtype) -> None:
    """Large hidden states without q compression: hidden x sqrt(30) makes q and the un-normed
    k_pe sqrt(30) times larger, so the rope logits grow x30 (the nope ones x5.5; kv_c is normed).
    """
    cfg = CONFIGS[name]
    w = weights(name, dtype)
    small = hidden(cfg, 9, seed=12)
    h = (small * 30 ** 0.5).to(dtype)
    assert _max_logit(w, h) > 3 * _max_logit(w, small.to(dtype))
    out, ref = prefill_forward(w, h), naive_forward(upcast(w), h.double())
    if dtype == torch.bfloat16:
        err = rel_err(out, ref)
        print(f"hidden x sqrt(30) {name}: bfloat16 relative error {err:.2e} "
              f"(bound {BF16_X30_TOL:.0e} for scaled logits, see BF16_X30_TOL)")
        assert err <= BF16_X30_TOL
    else:
        check(out, ref, f"prefill hidden x sqrt(30) {name} {dtype}")


# ---------------------------------------------------------------------------------------------
# attention with log-sum-exp, against a softmax written out here
# ---------------------------------------------------------------------------------------------


def _direct(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """o and lse by the textbook formula, float64; ``visible [Sq, Skv]``; k, v already per head."""
    s = torch.einsum("ind,jnd->nij", q.double(), k.double()) * scale
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - s.amax(-1, keepdim=True).clamp(min=-1e300))
    p = (p / p.sum(-1, keepdim=True)).nan_to_num(0.0)
    return torch.einsum("nij,jnd->ind", p, v.double()), lse


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1), (6, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,skv", [(1, 1), (5, 5), (3, 11), (7, 2)])
def test_attention_with_lse_matches_softmax(dtype: torch.dtype, heads: int, kv_heads: int,
                                            causal: bool, sq: int, skv: int) -> None:
    q = randn(sq, heads, 12, seed=1, dtype=dtype)
    k = randn(skv, kv_heads, 12, seed=2, dtype=dtype)
    v = randn(skv, kv_heads, 5, seed=3, dtype=dtype)
    scale = 12 ** -0.5
    o, lse = attention_with_lse(q, k, v, scale, causal=causal)
    assert o.dtype == dtype and o.shape == (sq, heads, 5) and lse.shape == (heads, sq)
    q_pos, k_pos = torch.arange(skv - sq, skv), torch.arange(skv)  # bottom-right aligned
    visible = (k_pos[None] <= q_pos[:, None]) if causal else torch.ones(sq, skv, dtype=bool)
    group = heads // kv_heads
    o_ref, lse_ref = _direct(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                             scale, visible)
    check(o, o_ref, "attention_with_lse o")
    if dtype == torch.float64:
        assert_close(lse, lse_ref, name="lse")
    else:
        assert_close(lse, lse_ref, abs_tol=LSE_ABS_TOL, name="lse")


def test_attention_with_lse_all_masked_rows() -> None:
    """Queries placed before every key see nothing: o = 0 exactly, lse = -inf; the others are
    untouched by them."""
    q = randn(4, 3, 8, seed=4)
    k, v = randn(6, 1, 8, seed=5), randn(6, 1, 8, seed=6)
    q_pos = torch.tensor([0, 1, 10, 12])
    k_pos = torch.arange(6) + 10  # keys at 10..15: queries 0 and 1 see none, query 2 sees one
    o, lse = attention_with_lse(q, k, v, 0.3, causal=True, q_positions=q_pos, k_positions=k_pos)
    assert torch.equal(o[:2], torch.zeros_like(o[:2]))
    assert torch.isneginf(lse[:, :2]).all()
    assert torch.isfinite(lse[:, 2:]).all() and not torch.isnan(o).any()
    assert torch.equal(o[2], v[0].expand(3, 8))  # one visible key: its value, exactly
    o_ref, lse_ref = _direct(q, k.expand(6, 3, 8), v.expand(6, 3, 8), 0.3,
                             k_pos[None] <= q_pos[:, None])
    assert_close(o, o_ref, name="o")
    assert_close(lse, lse_ref, name="lse")  # -inf at the same places, equal elsewhere


@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_lse_no_keys(causal: bool) -> None:
    q = randn(3, 2, 8, seed=7)
    o, lse = attention_with_lse(q, q.new_empty(0, 1, 8), q.new_empty(0, 1, 5), 0.3, causal=causal)
    assert o.shape == (3, 2, 5) and torch.equal(o, torch.zeros_like(o))
    assert lse.shape == (2, 3) and torch.isneginf(lse).all()


def test_naive_attention_lonely_rows_and_nan() -> None:
    """The definition: a query that sees no key gets exactly 0, and a NaN in a key reaches
    every query that sees it (zeroing the empty rows must not hide NaN)."""
    q, k, v = randn(4, 2, 8, seed=12), randn(6, 2, 8, seed=13), randn(6, 2, 5, seed=14)
    q_pos, k_pos = torch.tensor([0, 1, 10, 12]), torch.arange(6) + 10
    o = naive_attention(q, k, v, 0.3, q_pos, k_pos)
    assert torch.equal(o[:2], torch.zeros_like(o[:2]))
    assert_close(o, attention_with_lse(q, k, v, 0.3, causal=True, q_positions=q_pos,
                                       k_positions=k_pos)[0], name="naive o")
    k[1, 0, 3] = float("nan")  # key at position 11: seen by query 3 only
    o = naive_attention(q, k, v, 0.3, q_pos, k_pos)
    assert torch.isnan(o[3, 0]).all() and not torch.isnan(o[:3]).any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_attention_one_dominant_key(dtype: torch.dtype) -> None:
    """One key aligned with every query, far above the rest: o is (almost) its value."""
    sq, skv, n, d = 5, 40, 4, 40
    u = torch.nn.functional.normalize(randn(d, seed=8), dim=0)
    q = randn(sq, n, d, seed=9) + 12 * u
    k = randn(skv, 1, d, seed=10)
    k = k - (k @ u)[..., None] * u  # the other keys are orthogonal to u
    k[17, 0] += 12 * u
    v = randn(skv, 1, 7, seed=11)
    scale = 24 ** -0.5
    o, lse = attention_with_lse(q.to(dtype), k.to(dtype), v.to(dtype), scale)
    o_ref, lse_ref = _direct(q, k.expand(skv, n, d), v.expand(skv, n, 7), scale,
                             torch.ones(sq, skv, dtype=bool))
    p17 = torch.exp(torch.einsum("ind,d->ni", q, k[17, 0]) * scale - lse_ref)
    assert p17.min() > 0.999, "the key is not dominant"
    check(o, o_ref, "o, dominant key")
    assert_close(lse, lse_ref, abs_tol=LSE_ABS_TOL if dtype != torch.float64 else 1e-10)


# ---------------------------------------------------------------------------------------------
# absorbed = compute-friendly, and the classic scale bug
# ---------------------------------------------------------------------------------------------


def _front_tensors(name: str, sq: int, skv: int, seed: int, dtype: torch.dtype = torch.float64):
    cfg = CONFIGS[name]
    N, P, R, L = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    return (randn(sq, N, P, seed=seed, dtype=dtype), randn(sq, N, R, seed=seed + 1, dtype=dtype),
            randn(skv, L, seed=seed + 2, dtype=dtype), randn(skv, R, seed=seed + 3, dtype=dtype))


def _logits(q_nope, q_pe, kv_c, k_pe, w, scale, q_pos, k_pos) -> torch.Tensor:
    """Scaled, masked logits [N, Sq, Skv] of the definition, float64."""
    k_nope = torch.einsum("tl,lnp->tnp", kv_c.double(), w.W_UK.double())
    s = (torch.einsum("snp,tnp->nst", q_nope.double(), k_nope)
         + torch.einsum("snr,tr->nst", q_pe.double(), k_pe.double())) * scale
    return s.masked_fill(~(k_pos[None] <= q_pos[:, None]), float("-inf"))


@pytest.mark.parametrize("name", ["tiny", "tiny-yarn", "deepseek-v2-lite"])
@pytest.mark.parametrize("sq,ctx", [(1, 0), (1, 9), (4, 0), (6, 11)])
def test_absorbed_equals_prefill_attention(name: str, sq: int, ctx: int) -> None:
    """Same o and lse from both paths (float64), and lse = logsumexp of the logits."""
    cfg = CONFIGS[name]
    w = weights(name)
    q_nope, q_pe, kv_c, k_pe = _front_tensors(name, sq, ctx + sq, seed=20)
    q_pos, k_pos = torch.arange(ctx, ctx + sq), torch.arange(ctx + sq)
    args = (q_nope, q_pe, kv_c, k_pe, w.W_UK, w.W_UV, cfg.softmax_scale)
    kw = dict(causal=True, q_positions=q_pos, k_positions=k_pos)
    o_a, lse_a = absorbed_attention(*args, **kw)
    o_p, lse_p = prefill_attention(*args, **kw)
    assert o_a.shape == (sq, cfg.num_heads, cfg.v_head_dim) and lse_a.shape == (cfg.num_heads, sq)
    assert_close(o_a, o_p, name="absorbed o vs prefill o")
    assert_close(lse_a, lse_p, name="absorbed lse vs prefill lse")
    lse_ref = torch.logsumexp(_logits(q_nope, q_pe, kv_c, k_pe, w, cfg.softmax_scale,
                                      q_pos, k_pos), dim=-1)
    assert_close(lse_a, lse_ref, name="lse vs logsumexp")


@pytest.mark.parametrize("name", ["tiny", "deepseek-v2-lite"])
def test_wrong_softmax_scale_is_caught(name: str) -> None:
    """1/sqrt(Lkv + R), the scale the absorbed dot's width suggests, must fail the comparison:
    this proves the equivalence tests can fail on the classic bug."""
    cfg = CONFIGS[name]
    w = weights(name)
    lens, s_q = [3, 20], 2
    out, ref = _decode_case(name, torch.float64, lens, s_q, 16)
    assert_close(out, ref)
    # the same decode, by hand, with the wrong scale
    full = [hidden(cfg, n + s_q, seed=100 + i) for i, n in enumerate(lens)]
    kv_cache, block_table = paged_cache(cfg, [n + s_q for n in lens], 16, torch.float64)
    write_contexts(w, full, kv_cache, block_table)
    f = [mla_front(w, h[n:], torch.arange(n, n + s_q)) for h, n in zip(full, lens)]
    q = torch.stack([torch.cat([torch.einsum("snp,lnp->snl", x.q_nope, w.W_UK), x.q_pe], -1)
                     for x in f])
    wrong = cfg.latent_dim ** -0.5
    assert not math.isclose(wrong, cfg.softmax_scale)
    o_lat, _ = mla_decode_paged(q, kv_cache, block_table,
                                torch.tensor([n + s_q for n in lens], dtype=torch.int32),
                                wrong, causal=True, head_dim_v=cfg.kv_lora_rank)
    bad = torch.einsum("bsnl,lnv->bsnv", o_lat, w.W_UV).flatten(-2) @ w.W_O
    err = rel_err(bad, ref)
    assert err > 1e-2, f"the wrong scale gives only {err:.2e}"
    with pytest.raises(AssertionError):
        assert_close(bad, ref)
