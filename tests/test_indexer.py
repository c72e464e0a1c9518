"""DeepSeek-V3.2's lightning indexer (conventions §10): projections, scores, top-k, FP8 option.

The projections are checked against the official inference code's steps written out here
(its complex-number RoPE with the non-interleaved layout, ``F.layer_norm``, the weights
scaling); the scores against the formula one term at a time; the top-k by its defining
properties; the FP8 option against an error bound derived from e4m3's 3 mantissa bits.
"""

from __future__ import annotations

import pytest
import torch

from mla import MLAWeights, get_config
from mla.compare import assert_close
from mla.reference import (
    IndexerWeights,
    act_quant,
    hadamard_rotate,
    index_scores,
    indexer_qk,
    indexer_topk,
    q_latent,
    rope_frequencies,
    select_topk,
)

F64 = torch.float64
TINY = get_config("tiny")
SPARSE = TINY.replace(name="tiny-sparse", index_n_heads=4, index_head_dim=16, index_topk=5)
YARN = SPARSE.replace(name="tiny-sparse-yarn", rope_factor=40.0, max_seq_len=163840)


def _randn(*shape: int, seed: int, dtype: torch.dtype = F64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def _official_rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor,
                   interleaved: bool) -> torch.Tensor:
    """DeepSeek-V3.2-Exp's ``apply_rotary_emb``: complex multiplication; with
    ``interleaved=False`` the halves are paired first and unpaired after."""
    shape = x.shape
    if not interleaved:
        x = x.view(*shape[:-1], 2, -1).transpose(-1, -2).contiguous()
    z = torch.view_as_complex(x.reshape(*shape[:-1], -1, 2).contiguous())
    cis = torch.polar(torch.ones_like(freqs), positions.to(F64)[:, None] * freqs)
    cis = cis.view(shape[0], *([1] * (len(shape) - 2)), -1)
    y = torch.view_as_real(z * cis).flatten(-2)
    if not interleaved:
        y = torch.cat([y[..., 0::2], y[..., 1::2]], dim=-1)
    return y


@pytest.mark.parametrize("rope_style", ["neox", "interleaved"])
@pytest.mark.parametrize("config", [SPARSE, YARN], ids=["plain", "yarn"])
def test_indexer_qk_follows_the_official_steps(config, rope_style: str) -> None:
    iw = IndexerWeights.random(config, seed=1, dtype=F64)
    iw = IndexerWeights(config, iw.wq_b, iw.wk, iw.k_norm_weight, iw.k_norm_bias,
                        iw.weights_proj, rope_style=rope_style)
    S, R = 7, config.qk_rope_head_dim
    n, d = config.index_n_heads, config.index_head_dim
    hidden = _randn(S, config.hidden_size, seed=2)
    q_c = _randn(S, config.q_lora_rank, seed=3)
    positions = torch.tensor([0, 3, 4, 9, 10, 11, 40])
    got = indexer_qk(iw, hidden, q_c, positions)

    freqs = rope_frequencies(config)
    inter = rope_style == "interleaved"
    q = (q_c @ iw.wq_b.T).view(S, n, d)
    q = torch.cat([_official_rope(q[..., :R], positions, freqs, inter), q[..., R:]], dim=-1)
    k = torch.nn.functional.layer_norm(hidden @ iw.wk.T, (d,), iw.k_norm_weight,
                                       iw.k_norm_bias, 1e-6)
    k = torch.cat([_official_rope(k[..., :R], positions, freqs, inter), k[..., R:]], dim=-1)
    w = (hidden @ iw.weights_proj.T) * n ** -0.5 * d ** -0.5
    assert_close(got.q_index, q, 1e-12, name="q_index")
    assert_close(got.k_index, k, 1e-12, name="k_index")
    assert_close(got.weights, w, 1e-12, name="weights")


def test_rope_touches_the_first_dims_only_and_is_relative() -> None:
    iw = IndexerWeights.random(YARN, seed=4, dtype=F64)
    S, R = 6, YARN.qk_rope_head_dim
    hidden = _randn(S, YARN.hidden_size, seed=5)
    q_c = _randn(S, YARN.q_lora_rank, seed=6)
    pos = torch.arange(S)
    a = indexer_qk(iw, hidden, q_c, pos)
    b = indexer_qk(iw, hidden, q_c, pos + 37)
    assert torch.equal(a.q_index[..., R:], b.q_index[..., R:])  # nope part: no position
    assert torch.equal(a.k_index[..., R:], b.k_index[..., R:])
    assert (a.q_index[..., :R] - b.q_index[..., :R]).abs().max() > 1e-3
    # a rotation by position: the scores depend on position differences only
    sa = index_scores(a.q_index, a.weights, a.k_index, pos, pos)
    sb = index_scores(b.q_index, b.weights, b.k_index, pos + 37, pos + 37)
    assert_close(sb, sa, 1e-12)


def test_index_scores_formula_and_causal_mask() -> None:
    Sq, Skv, n, d = 4, 6, 3, 5
    q = _randn(Sq, n, d, seed=7)
    k = _randn(Skv, d, seed=8)
    w = _randn(Sq, n, seed=9)
    q_pos, k_pos = torch.tensor([2, 3, 4, 5]), torch.arange(Skv)
    got = index_scores(q, w, k, q_pos, k_pos)
    for t in range(Sq):
        for s in range(Skv):
            if s > q_pos[t]:
                assert got[t, s] == float("-inf")
                continue
            want = sum(float(w[t, j]) * max(float(q[t, j] @ k[s]), 0.0) for j in range(n))
            assert abs(float(got[t, s]) - want) <= 1e-12 * (1 + abs(want))


def test_select_topk_pads_short_prefixes_with_minus_one() -> None:
    S, topk = 11, 5
    scores = _randn(S, S, seed=10)
    pos = torch.arange(S)
    scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    got = select_topk(scores, topk)
    assert got.dtype == torch.int32 and list(got.shape) == [S, topk]
    for t in range(S):
        row = got[t].tolist()
        k = min(topk, t + 1)
        valid, pad = row[:k], row[k:]
        assert pad == [-1] * (topk - k)
        assert len(set(valid)) == k and all(0 <= i <= t for i in valid)
        vals = scores[t, valid]
        assert torch.all(vals[:-1] >= vals[1:])  # highest first
        rest = [i for i in range(t + 1) if i not in valid]
        if rest:
            assert vals.min() >= scores[t, rest].max()
    # equal scores (ReLU gives exact zeros) go to the earlier key, whatever their order
    tied = torch.tensor([[0.0, 2.0, 0.0, 0.0, 1.0, float("-inf")]], dtype=F64)
    assert select_topk(tied, 4)[0].tolist() == [1, 4, 0, 2]
    assert select_topk(tied.flip(-1), 4)[0].tolist() == [4, 1, 2, 3]
    # topk larger than the keys: the whole prefix, then -1
    assert select_topk(scores[:, :3], 8)[0].tolist() == [0] + [-1] * 7


def test_selection_is_causal() -> None:
    """Future tokens change no earlier query's selection."""
    w = MLAWeights.random(SPARSE, seed=11, dtype=F64)
    iw = IndexerWeights.random(SPARSE, seed=12, dtype=F64)
    hidden = _randn(14, SPARSE.hidden_size, seed=13)
    full = indexer_topk(iw, w, hidden)
    changed = hidden.clone()
    changed[9:] = _randn(5, SPARSE.hidden_size, seed=14)
    assert torch.equal(indexer_topk(iw, w, changed)[:9], full[:9])
    assert torch.equal(indexer_topk(iw, w, hidden[:9]), full[:9])
    assert not torch.equal(indexer_topk(iw, w, changed)[9:], full[9:])


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """The butterfly of fast_hadamard_transform, unnormalized."""
    x = x.clone()
    h, n = 1, x.shape[-1]
    while h < n:
        for i in range(0, n, 2 * h):
            a, b = x[..., i:i + h].clone(), x[..., i + h:i + 2 * h].clone()
            x[..., i:i + h], x[..., i + h:i + 2 * h] = a + b, a - b
        h *= 2
    return x


@pytest.mark.parametrize("d", [1, 2, 16, 128])
def test_hadamard_rotation(d: int) -> None:
    x = _randn(5, d, seed=d)
    y = hadamard_rotate(x)
    assert_close(y, _fwht(x) * d ** -0.5, 1e-12)
    eye = hadamard_rotate(torch.eye(d, dtype=F64))
    assert_close(eye @ eye.T, torch.eye(d, dtype=F64), 1e-12)  # orthonormal
    assert_close(y @ y.T, x @ x.T, 1e-12)  # dot products kept
    with pytest.raises(ValueError, match="power of two"):
        hadamard_rotate(_randn(2, 12, seed=0))


def _quant_error_bound(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-value bound of e4m3 with a power-of-two scale: ``2^-4·|x| + 2^-10·s``, where the
    ue8m0 scale is at most twice ``max(amax, 1e-4) / 448``."""
    blocks = x.unflatten(-1, (x.shape[-1] // block, block))
    s_max = 2 * blocks.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448
    return (2.0 ** -4 * blocks.abs() + 2.0 ** -10 * s_max).flatten(-2)


def test_fp8_option_within_the_e4m3_bound() -> None:
    config = SPARSE.replace(index_head_dim=32, index_topk=6)  # one 32-value block per vector
    w = MLAWeights.random(config, seed=15, dtype=F64)
    iw = IndexerWeights.random(config, seed=16, dtype=F64)
    S = 40
    hidden = _randn(S, config.hidden_size, seed=17)
    pos = torch.arange(S)
    q_c = q_latent(w, hidden)
    exact = indexer_qk(iw, hidden, q_c, pos)
    fp8 = indexer_qk(iw, hidden, q_c, pos, use_fp8=True)
    q_rot, k_rot = hadamard_rotate(exact.q_index), hadamard_rotate(exact.k_index)
    dq, dk = _quant_error_bound(q_rot, 32), _quant_error_bound(k_rot, 32)
    assert torch.all((fp8.q_index - q_rot).abs() <= dq)
    assert torch.all((fp8.k_index - k_rot).abs() <= dk)
    # the stored values are e4m3 numbers times one power of two per block
    y, s = act_quant(k_rot, block_size=32)
    assert torch.equal(fp8.k_index, y.double() * s.double())
    # the scores: ReLU is 1-Lipschitz, so |ΔI| <= Σ_j |w_j| Σ_i (|q||Δk| + |Δq||k| + |Δq||Δk|)
    s_exact = index_scores(exact.q_index, exact.weights, exact.k_index, pos, pos)
    s_fp8 = index_scores(fp8.q_index, fp8.weights, fp8.k_index, pos, pos)
    per_head = (torch.einsum("tjd,sd->tjs", q_rot.abs(), dk)
                + torch.einsum("tjd,sd->tjs", dq, k_rot.abs())
                + torch.einsum("tjd,sd->tjs", dq, dk))
    bound = torch.einsum("tj,tjs->ts", exact.weights.abs(), per_head)
    visible = pos[None, :] <= pos[:, None]
    assert torch.all((s_fp8 - s_exact).abs()[visible] <= bound[visible])
    assert torch.equal(torch.isinf(s_fp8), ~visible)
    top_exact = indexer_topk(iw, w, hidden)
    top_fp8 = indexer_topk(iw, w, hidden, use_fp8=True)
    overlap = sum(len((set(a) & set(b)) - {-1})
                  for a, b in zip(top_exact.tolist(), top_fp8.tolist()))
    kept = sum(min(6, t + 1) for t in range(S))
    rel = ((s_fp8 - s_exact)[visible].norm() / s_exact[visible].norm()).item()
    print(f"fp8 indexer: score relative error {rel:.2e}, top-k overlap {overlap}/{kept}")


def test_deepseek_v32_preset_shapes() -> None:
    config = get_config("deepseek-v3.2")
    iw = IndexerWeights.random(config, seed=0, dtype=torch.float32)
    assert list(iw.wq_b.shape) == [64 * 128, 1536]
    assert list(iw.wk.shape) == [128, 7168] and list(iw.weights_proj.shape) == [64, 7168]
    S = 5
    hidden = _randn(S, 7168, seed=1, dtype=torch.float32)
    q_c = _randn(S, 1536, seed=2, dtype=torch.float32)
    pos = torch.arange(S)
    for use_fp8 in (False, True):
        qk = indexer_qk(iw, hidden, q_c, pos, use_fp8=use_fp8)
        assert list(qk.q_index.shape) == [S, 64, 128] and list(qk.k_index.shape) == [S, 128]
        top = select_topk(index_scores(qk.q_index, qk.weights, qk.k_index, pos, pos), 2048)
        assert list(top.shape) == [S, 2048]
        assert (top >= 0).sum(-1).tolist() == [1, 2, 3, 4, 5]


def test_weights_state_dict_and_validation() -> None:
    iw = IndexerWeights.random(SPARSE, seed=3, dtype=torch.float32)
    assert iw.rope_style == "neox"  # the official indexer's RoPE is not interleaved
    again = IndexerWeights.random(SPARSE, seed=3, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(iw.state_dict().values(),
                                                 again.state_dict().values()))
    sd = iw.state_dict("model.layers.0.self_attn.indexer.")
    assert set(sd) == {f"model.layers.0.self_attn.indexer.{k}" for k in
                       ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias",
                        "weights_proj.weight")}
    back = IndexerWeights.from_state_dict(SPARSE, sd, "model.layers.0.self_attn.indexer.")
    assert torch.equal(back.wq_b, iw.wq_b) and torch.equal(back.k_norm_bias, iw.k_norm_bias)
    with pytest.raises(ValueError, match="wk.weight"):
        IndexerWeights.from_state_dict(SPARSE, {k: v for k, v in sd.items() if "wk" not in k},
                                       "model.layers.0.self_attn.indexer.")
    with pytest.raises(ValueError, match="wq_b"):
        IndexerWeights(SPARSE, iw.wq_b[:-1], iw.wk, iw.k_norm_weight, iw.k_norm_bias,
                       iw.weights_proj)
    with pytest.raises(ValueError, match="index_n_heads"):
        IndexerWeights.random(TINY)  # no indexer in the tiny preset
    with pytest.raises(ValueError, match="q_lora_rank"):
        IndexerWeights.random(SPARSE.replace(q_lora_rank=None))
    with pytest.raises(ValueError, match="index_head_dim"):
        IndexerWeights.random(SPARSE.replace(index_head_dim=4))
    with pytest.raises(ValueError, match="rope_style"):
        IndexerWeights(SPARSE, iw.wq_b, iw.wk, iw.k_norm_weight, iw.k_norm_bias,
                       iw.weights_proj, rope_style="gptj")


def test_bad_input() -> None:
    iw = IndexerWeights.random(SPARSE, seed=5, dtype=F64)
    hidden = _randn(3, SPARSE.hidden_size, seed=6)
    q_c = _randn(3, SPARSE.q_lora_rank, seed=7)
    pos = torch.arange(3)
    with pytest.raises(ValueError, match="q_c"):
        indexer_qk(iw, hidden, q_c[:2], pos)
    with pytest.raises(ValueError, match="positions"):
        indexer_qk(iw, hidden, q_c, pos[:2])
    with pytest.raises(TypeError, match="hidden"):
        indexer_qk(iw, hidden.long(), q_c, pos)
    qk = indexer_qk(iw, hidden, q_c, pos)
    with pytest.raises(ValueError, match="k_index"):
        index_scores(qk.q_index, qk.weights, qk.k_index[:, :8], pos, pos)
    with pytest.raises(ValueError, match="k_positions"):
        index_scores(qk.q_index, qk.weights, qk.k_index, pos, pos[:2])
    with pytest.raises(ValueError, match="topk"):
        select_topk(torch.zeros(2, 2, dtype=F64), 0)
    with pytest.raises(ValueError, match="q latent"):
        q_latent(MLAWeights.random(TINY.replace(q_lora_rank=None), dtype=F64), hidden)
