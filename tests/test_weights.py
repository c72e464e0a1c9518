"""Configs, derived sizes, DeepSeek-V2's Table 1, and the weights of one layer.

The checkpoint names and layouts are DeepSeek's (``model.layers.{i}.self_attn.{name}.weight``);
``W_UK [Lkv, N, P]`` and ``W_UV [Lkv, N, V]`` must be vLLM's views of ``kv_b_proj``
(``kv_b_proj.T.view(Lkv, N, P+V).split([P, V], -1)``).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mla import PRESETS, MLAConfig, MLAWeights, get_config, kv_cache_comparison
from mla.compare import assert_close
from mla.weights import expected_shapes

PREFIX = "model.layers.0.self_attn."
DEEPSEEK = [name for name in PRESETS if name.startswith("deepseek")]


def _lite(config: MLAConfig) -> MLAConfig:
    """The V2-Lite structure (no q compression) at ``config``'s sizes."""
    return config.replace(name=f"{config.name}-lite", q_lora_rank=None)


def _assert_bitwise_equal(a: MLAWeights, b: MLAWeights) -> None:
    ta, tb = a.tensors(), b.tensors()
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert torch.equal(ta[name], tb[name]), name


# --- configs and derived sizes ---------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_constructs(name):
    c = get_config(name)
    assert c is PRESETS[name] and c.name == name
    # the weights of every preset construct too; on the meta device, so V3's ~200M numbers
    # cost no memory
    meta = {n: torch.empty(s, device="meta") for n, s in expected_shapes(c).items()}
    w = MLAWeights(config=c, **meta)
    assert w.W_UK.shape == (c.kv_lora_rank, c.num_heads, c.qk_nope_head_dim)
    assert w.W_UV.shape == (c.kv_lora_rank, c.num_heads, c.v_head_dim)
    assert w.W_O.shape == (c.num_heads * c.v_head_dim, c.hidden_size)
    assert (w.q_proj is None) == (c.q_lora_rank is not None)
    assert c.softmax_scale > 0


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_derived_sizes(name):
    c = get_config(name)
    assert c.qk_head_dim == c.qk_nope_head_dim + c.qk_rope_head_dim
    assert c.latent_dim == c.kv_lora_rank + c.qk_rope_head_dim
    assert c.cache_numbers_per_token_per_layer() == c.latent_dim
    bf16_bytes = torch.finfo(torch.bfloat16).bits // 8
    assert c.cache_bytes_per_token_per_layer() == c.latent_dim * bf16_bytes
    assert c.cache_bytes_per_token() == c.latent_dim * bf16_bytes * c.num_layers
    if c.yarn_active:
        mscale = 0.1 * c.rope_mscale * torch.log(torch.tensor(c.rope_factor)).item() + 1
        assert c.softmax_scale == pytest.approx(c.qk_head_dim ** -0.5 * mscale ** 2, rel=1e-6)
    else:
        assert c.softmax_scale == c.qk_head_dim ** -0.5


@pytest.mark.parametrize("name", DEEPSEEK)
def test_deepseek_cache_row_is_576_numbers_1152_bytes(name):
    # conventions §0: Lkv + R = 512 + 64 for every DeepSeek model; 2 bytes each in bf16
    c = get_config(name)
    assert (c.kv_lora_rank, c.qk_rope_head_dim) == (512, 64)
    assert c.latent_dim == 512 + 64 == 576
    assert c.cache_bytes_per_token_per_layer() == 576 * torch.bfloat16.itemsize == 1152
    assert c.qk_head_dim == 128 + 64


def test_deepseek_v2_lite_has_no_q_compression():
    c = get_config("deepseek-v2-lite")
    assert c.q_lora_rank is None
    assert "q_proj" in expected_shapes(c) and "q_a_proj" not in expected_shapes(c)


def test_unknown_preset_is_rejected():
    with pytest.raises(ValueError, match="deepseek-v9.*expected one of"):
        get_config("deepseek-v9")


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("num_groups", [1, 8])
def test_kv_cache_table_formulas(name, num_groups):
    """DeepSeek-V2 Table 1, row by row, from the formulas."""
    c = get_config(name)
    n_h, d_h, l_ = c.num_heads, c.qk_nope_head_dim, c.num_layers
    d_c, d_hR = c.kv_lora_rank, c.qk_rope_head_dim
    want = {"MHA": 2 * n_h * d_h * l_, "GQA": 2 * num_groups * d_h * l_, "MQA": 2 * d_h * l_,
            "MLA": (d_c + d_hR) * l_}
    rows = kv_cache_comparison(c, num_groups=num_groups)
    assert [r["attention"] for r in rows] == list(want)
    for r in rows:
        assert r["numbers_per_token"] == want[r["attention"]]
        assert r["in_units_of_d_h_l"] == pytest.approx(want[r["attention"]] / (d_h * l_))


def test_deepseek_v2_table1_mla_is_4_5_dh_l():
    """The paper's reading: d_c = 4·d_h and d_h^R = d_h/2, so MLA caches (4 + 1/2)·d_h·l,
    as much as GQA with 2.25 groups, and far less than MHA's 2·n_h·d_h·l."""
    c = get_config("deepseek-v2")
    d_h, l_ = c.qk_nope_head_dim, c.num_layers
    assert c.kv_lora_rank == 4 * d_h and 2 * c.qk_rope_head_dim == d_h
    rows = {r["attention"]: r for r in kv_cache_comparison(c)}
    mla = rows["MLA"]
    assert mla["numbers_per_token"] == (c.kv_lora_rank + c.qk_rope_head_dim) * l_
    assert mla["numbers_per_token"] == (4 * d_h + d_h // 2) * l_
    assert mla["in_units_of_d_h_l"] == pytest.approx(4 + 1 / 2)
    assert mla["numbers_per_token"] / (2 * d_h * l_) == pytest.approx(2.25)  # GQA groups
    assert rows["MHA"]["numbers_per_token"] / mla["numbers_per_token"] == pytest.approx(
        2 * c.num_heads / (4 + 1 / 2))
    assert (rows["MQA"]["numbers_per_token"] < mla["numbers_per_token"]
            < rows["GQA"]["numbers_per_token"] < rows["MHA"]["numbers_per_token"])


# --- random weights --------------------------------------------------------------------------

@pytest.mark.parametrize("config", [get_config("tiny"), _lite(get_config("tiny"))],
                         ids=["tiny", "tiny-lite"])
def test_random_is_deterministic_per_seed(config):
    _assert_bitwise_equal(MLAWeights.random(config, seed=3), MLAWeights.random(config, seed=3))
    a, b = MLAWeights.random(config, seed=3), MLAWeights.random(config, seed=4)
    for name, t in a.tensors().items():
        assert not torch.equal(t, b.tensors()[name]), name
    # no tensor is all zeros, and the norms sit near 1
    for name, t in a.tensors().items():
        assert (t != 0).all(), name
    assert (a.kv_a_layernorm - 1).abs().max() < 1


def test_random_is_identical_across_dtypes():
    """Drawn in float64: the float32 weights are the float64 ones rounded once."""
    c = get_config("tiny")
    w64 = MLAWeights.random(c, seed=7, dtype=torch.float64)
    w32 = MLAWeights.random(c, seed=7, dtype=torch.float32)
    wbf = MLAWeights.random(c, seed=7, dtype=torch.bfloat16)
    assert w64.dtype == torch.float64 and w32.dtype == torch.float32
    assert wbf.dtype == torch.bfloat16
    for name, t64 in w64.tensors().items():
        t32 = w32.tensors()[name]
        assert torch.equal(t32, t64.to(torch.float32)), name
        assert torch.equal(wbf.tensors()[name], t64.to(torch.bfloat16)), name
        assert_close(t32.to(torch.float64), t64, 1e-7, name=name)


# --- checkpoints -----------------------------------------------------------------------------

@pytest.mark.parametrize("config", [get_config("tiny"), _lite(get_config("tiny"))],
                         ids=["tiny", "tiny-lite"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safetensors_round_trip(tmp_path, config, dtype):
    w = MLAWeights.random(config, seed=11, dtype=dtype)
    path = tmp_path / "layer.safetensors"
    w.save_safetensors(path, prefix=PREFIX)
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
    assert keys == {f"{PREFIX}{n}.weight" for n in expected_shapes(config)}
    if config.q_lora_rank is None:  # V2-Lite's names
        assert f"{PREFIX}q_proj.weight" in keys and f"{PREFIX}q_a_proj.weight" not in keys
    else:
        assert {f"{PREFIX}q_a_proj.weight", f"{PREFIX}q_b_proj.weight"} <= keys
    back = MLAWeights.load_safetensors(config, path, prefix=PREFIX)
    _assert_bitwise_equal(back, w)
    assert back.q_proj is None if config.q_lora_rank is not None else back.q_a_proj is None


def test_extra_keys_and_other_layers_are_ignored(tmp_path):
    """A whole-model file: other layers (same names, other prefix) and unrelated tensors."""
    c = get_config("tiny")
    w0, w1 = MLAWeights.random(c, seed=1), MLAWeights.random(c, seed=2)
    state = {**w1.state_dict("model.layers.1.self_attn."), **w0.state_dict(PREFIX),
             "model.embed_tokens.weight": torch.randn(10, c.hidden_size),
             f"{PREFIX}rotary_emb.inv_freq": torch.randn(4),
             "model.layers.0.mlp.gate_proj.weight": torch.randn(3, c.hidden_size)}
    _assert_bitwise_equal(MLAWeights.from_state_dict(c, state, prefix=PREFIX), w0)
    _assert_bitwise_equal(
        MLAWeights.from_state_dict(c, state, prefix="model.layers.1.self_attn."), w1)
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    _assert_bitwise_equal(MLAWeights.load_safetensors(c, path, prefix=PREFIX), w0)


def test_wrong_shape_in_file_names_key_and_shapes(tmp_path):
    c = get_config("tiny")
    state = MLAWeights.random(c, seed=0).state_dict(PREFIX)
    key = f"{PREFIX}kv_b_proj.weight"
    want = list(state[key].shape)
    bad = [want[0], want[1] + 1]
    state[key] = torch.randn(bad)
    path = tmp_path / "bad.safetensors"
    save_file(state, str(path))
    pattern = rf"{re.escape(key)}.*{re.escape(str(want))}.*{re.escape(str(bad))}"
    with pytest.raises(ValueError, match=pattern):
        MLAWeights.load_safetensors(c, path, prefix=PREFIX)
    with pytest.raises(ValueError, match=pattern):
        MLAWeights.from_state_dict(c, state, prefix=PREFIX)


@pytest.mark.parametrize("config", [get_config("tiny"), _lite(get_config("tiny"))],
                         ids=["tiny", "tiny-lite"])
def test_missing_key_is_named(tmp_path, config):
    state = MLAWeights.random(config, seed=0).state_dict(PREFIX)
    for name in expected_shapes(config):
        key = f"{PREFIX}{name}.weight"
        partial = {k: v for k, v in state.items() if k != key}
        path = tmp_path / f"no_{name}.safetensors"
        save_file(partial, str(path))
        with pytest.raises(ValueError, match=re.escape(key)):
            MLAWeights.load_safetensors(config, path, prefix=PREFIX)


def test_wrong_prefix_is_a_missing_key(tmp_path):
    c = get_config("tiny")
    path = tmp_path / "layer.safetensors"
    MLAWeights.random(c, seed=0).save_safetensors(path, prefix=PREFIX)
    with pytest.raises(ValueError, match=re.escape("model.layers.1.self_attn.")):
        MLAWeights.load_safetensors(c, path, prefix="model.layers.1.self_attn.")


# --- vLLM's views of kv_b_proj -------------------------------------------------------------

def test_W_UK_W_UV_orientation():  # noqa: N802
    """Build ``kv_b_proj`` from known per-head blocks: head ``n`` owns rows
    ``n·(P+V) .. (n+1)·(P+V)``, ``P`` key rows then ``V`` value rows, each ``[*, Lkv]``."""
    c = get_config("tiny").replace(v_head_dim=12)  # V != P, so a mix-up cannot pass
    N, P, V, Lkv = c.num_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    gen = torch.Generator().manual_seed(5)
    blocks = [torch.randn(P + V, Lkv, generator=gen, dtype=torch.float64) for _ in range(N)]
    kv_b_proj = torch.cat(blocks, dim=0)
    w = dataclasses.replace(MLAWeights.random(c, seed=0, dtype=torch.float64),
                            kv_b_proj=kv_b_proj)
    assert w.W_UK.shape == (Lkv, N, P) and w.W_UV.shape == (Lkv, N, V)
    for n, block in enumerate(blocks):
        assert torch.equal(w.W_UK[:, n, :], block[:P].T)
        assert torch.equal(w.W_UV[:, n, :], block[P:].T)
    # vLLM's process_weights_after_loading, written out
    seed_uk, seed_uv = kv_b_proj.T.reshape(Lkv, N, P + V).split([P, V], dim=-1)
    assert torch.equal(w.W_UK, seed_uk) and torch.equal(w.W_UV, seed_uv)
    # the bmm layouts: W_UK_T [N, P, Lkv] = W_UK.permute(1, 2, 0), W_UV [N, Lkv, V]
    assert w.W_UK_T.shape == (N, P, Lkv) and w.W_UV_bmm.shape == (N, Lkv, V)
    for n, block in enumerate(blocks):
        assert torch.equal(w.W_UK_T[n], block[:P])
        assert torch.equal(w.W_UV_bmm[n], block[P:].T)
    # what the checkpoint's Linear computes, split per head, is what the einsums compute
    kv_c = torch.randn(7, Lkv, generator=gen, dtype=torch.float64)
    k_nope_lin, v_lin = (kv_c @ kv_b_proj.T).view(7, N, P + V).split([P, V], dim=-1)
    assert_close(torch.einsum("sl,lnp->snp", kv_c, w.W_UK), k_nope_lin, 1e-14)
    assert_close(torch.einsum("sl,lnv->snv", kv_c, w.W_UV), v_lin, 1e-14)
    # and the bmm forms: q_nope [N, S, P] @ W_UK_T -> ql_nope; o_lat [N, S, Lkv] @ W_UV_bmm
    q_nope = torch.randn(N, 7, P, generator=gen, dtype=torch.float64)
    assert_close(torch.bmm(q_nope, w.W_UK_T),
                 torch.einsum("nsp,lnp->nsl", q_nope, w.W_UK), 1e-14)
    assert torch.equal(w.W_O, w.o_proj.T)


def test_to_dtype():
    c = get_config("tiny")
    w = MLAWeights.random(c, seed=2, dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        w2 = w.to(dtype)
        assert w2.dtype == dtype and w2.config is c and w2.device == w.device
        for name, t in w2.tensors().items():
            assert t.dtype == dtype and torch.equal(t, w.tensors()[name].to(dtype)), name
        assert w2.W_UK.dtype == dtype
    assert w.dtype == torch.float64  # the original is untouched
    _assert_bitwise_equal(w.to(torch.float32).to(torch.float64).to(torch.float32),
                   w.to(torch.float32))
