# ruff: noqa: E402
# Source of notebooks/01_mha_to_mla.ipynb (build: python notebooks/build.py).

# %% [markdown]
# # From multi-head attention to MLA
#
# Multi-head Latent Attention (DeepSeek-V2, section 2.1) is ordinary multi-head attention whose
# keys and values are *generated* from one small vector per token, the latent `c^{KV}` (the
# code's `kv_c`). This
# notebook walks from the definition to the absorbed kernel that DeepSeek serves with, one step
# at a time, and checks with `mla.compare` that each step computes the same numbers as the one
# before. Everything runs on the `tiny` preset in float64, so the checks hold to about `1e-12`;
# change the preset, the lengths or the random seed and run it again. The symbols are those of
# the table at the top of `papers/derivation.md`: `N` heads, `P` non-rotary and `R` rotary
# widths of a query and key, `V` the value width, `Lkv` the latent width, `Sq` query tokens,
# `Skv` key tokens, `C = Skv − Sq` cached ones, `τ` the softmax scale.
#
# | step | what changes | package function |
# | --- | --- | --- |
# | 0 | the definition: up-project the latent, causal MHA | `mla.reference.naive_forward` |
# | 1 | low-rank KV: cache `kv_c`, up-project per head | `mla.reference.prefill_forward` |
# | 2 | decoupled RoPE, absorbed weights: MQA | `mla.reference.absorbed_attention` |
# | 3 | the absorbed form over a paged cache, as served | `mla.reference.decode_forward` |

# %%
import matplotlib.pyplot as plt
import torch
from nbhelp import figure_saver  # puts the repository root on sys.path, before `import mla`

from mla import MLAWeights, get_config, kv_cache_comparison
from mla.compare import TOLERANCES, assert_close, rel_err
from mla.reference import (
    absorb_q,
    absorbed_attention,
    apply_rope,
    decode_forward,
    make_block_table,
    mla_front,
    naive_forward,
    prefill_attention,
    prefill_forward,
    up_project_kv,
    write_context,
)

save = figure_saver("01_mha_to_mla")
torch.manual_seed(0)
TOL = TOLERANCES[torch.float64]

cfg = get_config("tiny")
w = MLAWeights.random(cfg, seed=0, dtype=torch.float64)
N, P, R, V, Lkv = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                   cfg.kv_lora_rank)
print(cfg)

# %% [markdown]
# ## Step 0: the definition
#
# One request of 40 tokens (the code's `S`), all of them queries: a prefill, `Sq = Skv = 40`,
# with hidden states `h [40, H]`. The shared front (`docs/conventions.md` §1) computes per token
# `t` the query parts `q^{nope}_{t,n}` (`q_nope [N, P]`) and `q^{pe}_{t,n}` (`q_pe [N, R]`,
# rotated), the normed latent `c^{KV}_t` (`kv_c [Lkv]`) and one rotary key `k^{pe}_t`
# (`k_pe [R]`) shared by all heads. The definition then up-projects the latent to ordinary
# per-head keys and values,
#
# $$k^{nope}_{s,n} = c^{KV}_s W^{UK}_n, \qquad v_{s,n} = c^{KV}_s W^{UV}_n,$$
#
# appends the shared `k^{pe}` to every head's key and runs causal MHA with head dim `P + R` and
# softmax scale `τ` (`cfg.softmax_scale`: `1/√(P+R)`, times YaRN's `λ²` for the presets that
# extend the context; `tiny` has no YaRN).

# %%
S = 40
hidden = torch.randn(S, cfg.hidden_size, dtype=torch.float64)
positions = torch.arange(S)
out_naive = naive_forward(w, hidden)
print("out", tuple(out_naive.shape), "norm", out_naive.norm().item())

# %% [markdown]
# ## Step 1: low-rank KV
#
# What MHA would cache is `k` and `v` for every head: `2·N·P` numbers per token (plus the rope
# part). Here they are all linear images of `c^{KV}`, so the stacked keys of all heads have rank
# at most `Lkv` whatever `N·P` is, and caching `c^{KV}` (and `k^{pe}`) loses nothing.

# %%
f = mla_front(w, hidden, positions)
k, v = up_project_kv(f.kv_c, f.k_pe, w.W_UK, w.W_UV)  # [S, N, P+R], [S, N, V]
k_nope_all = k[..., :P].reshape(S, N * P)
print(f"keys of all heads: {S} x {N * P}, rank {torch.linalg.matrix_rank(k_nope_all).item()}"
      f" (Lkv = {Lkv})")
assert torch.linalg.matrix_rank(k_nope_all).item() <= Lkv

out_prefill = prefill_forward(w, hidden)
err_1 = assert_close(out_prefill, out_naive, TOL, name="prefill_forward vs naive_forward")
print(f"step 1 (compute-friendly MHA over up-projected keys): rel err {err_1:.1e}")

# %% [markdown]
# ## Step 2: why RoPE blocks absorption, and the decoupled fix
#
# Without position information a logit is a bilinear form, and associativity moves `W_UK` from
# the key side to the query side:
#
# $$q^{nope}_{t,n} \cdot (c^{KV}_s W^{UK}_n) = (q^{nope}_{t,n} {W^{UK}_n}^\top) \cdot c^{KV}_s
# = ql^{nope}_{t,n} \cdot c^{KV}_s.$$
#
# The absorbed query `ql^{nope}` (`ql_nope`) is computed once per query (`absorb_q`), and the
# keys never leave the latent space.

# %%
k_nope = torch.einsum("sl,lnp->snp", f.kv_c, w.W_UK)
logits_mha = torch.einsum("tnp,snp->nts", f.q_nope, k_nope)
ql_nope = absorb_q(f.q_nope, w.W_UK)  # [S, N, Lkv]
logits_absorbed = torch.einsum("tnl,sl->nts", ql_nope, f.kv_c)
print(f"no RoPE: absorbed logits vs MHA logits, rel err "
      f"{rel_err(logits_absorbed, logits_mha):.1e}")
assert rel_err(logits_absorbed, logits_mha) <= TOL

# %% [markdown]
# Now rotate the per-head keys and queries by their positions, as standard RoPE attention does
# (RoFormer). With `Rot_p` the rotation at position `p` (the block-diagonal matrix of RoPE's
# 2×2 rotations) and the query's non-rotary part `q` as a column vector,
#
# $$(\mathrm{Rot}_t\, q) \cdot (\mathrm{Rot}_s W^{UK\top} c^{KV}_s)
# = q^\top \mathrm{Rot}_{s-t} W^{UK\top} c^{KV}_s,$$
#
# and the matrix between query and latent, `Rot_{s−t} W^{UK⊤}`, depends on the *pair* of
# positions: there is no single absorbed query that serves every key. Folding `W_UK` into the
# rotated query anyway gives the wrong logits:

# %%
rope_on_p = cfg.replace(qk_rope_head_dim=P)  # the package's RoPE, applied to P-dim vectors
q_rot = apply_rope(f.q_nope, positions, rope_on_p)
k_rot = apply_rope(k_nope, positions, rope_on_p)
logits_rope = torch.einsum("tnp,snp->nts", q_rot, k_rot)
logits_try = torch.einsum("tnl,sl->nts", absorb_q(q_rot, w.W_UK), f.kv_c)
err_rope = rel_err(logits_try, logits_rope)
print(f"RoPE on the nope part: 'absorbed' logits vs true logits, rel err {err_rope:.2f}")
assert err_rope > 0.1

# RoPE logits depend only on the relative position: shifting every position keeps them
shifted = torch.einsum("tnp,snp->nts", apply_rope(f.q_nope, positions + 1000, rope_on_p),
                       apply_rope(k_nope, positions + 1000, rope_on_p))
print(f"RoPE logits after shifting all positions by 1000: rel change "
      f"{rel_err(shifted, logits_rope):.1e}")

# %% [markdown]
# MLA's fix (DeepSeek-V2, section 2.1.3) is to *decouple* position from content: the nope part
# carries no rotation (so it absorbs), and a separate small part of `R` dims per head carries
# RoPE, with one rotary key `k^{pe}` shared by all heads and cached next to `c^{KV}`. The scaled
# logit is the sum of the two parts,
#
# $$\ell_{t,s,n} = \tau\left(q^{nope}_{t,n}\cdot k^{nope}_{s,n} + q^{pe}_{t,n}\cdot k^{pe}_s\right)
# = \tau\,[ql^{nope}_{t,n}, q^{pe}_{t,n}] \cdot [c^{KV}_s, k^{pe}_s],$$
#
# a dot product over `Lkv + R` dims between a per-head query and one key shared by all heads:
# multi-query attention (MQA) whose value is `c^{KV}` itself (the first `Lkv` columns of the
# key). The output is mapped back per head with `W^{UV}` after the attention. The softmax scale
# is the MHA form's `τ`, not `1/√(Lkv + R)` although the dot runs over `Lkv + R` dims: the
# logits are the same numbers as step 1's. With YaRN `τ = λ²/√(P+R)`: 0.1147 for the
# DeepSeek-V2 presets, 0.1352 for DeepSeek-V3, against `1/√192 = 0.0722` without it and
# `1/√576 = 0.0417` for the classic bug (printed below).

# %%
o_mha, lse_mha = prefill_attention(f.q_nope, f.q_pe, f.kv_c, f.k_pe, w.W_UK, w.W_UV,
                                   cfg.softmax_scale, causal=True)
o_abs, lse_abs = absorbed_attention(f.q_nope, f.q_pe, f.kv_c, f.k_pe, w.W_UK, w.W_UV,
                                    cfg.softmax_scale, causal=True)
err_2 = assert_close(o_abs, o_mha, TOL, name="absorbed o vs MHA o")
assert_close(lse_abs, lse_mha, TOL, name="absorbed lse vs MHA lse")
out_absorbed = o_abs.flatten(-2) @ w.W_O
err_2_out = assert_close(out_absorbed, out_naive, TOL, name="absorbed layer vs naive")
print(f"step 2 (absorbed MQA over [kv_c, k_pe]): o rel err {err_2:.1e}, "
      f"layer output rel err {err_2_out:.1e}")

# the classic bug: scaling by the absorbed dot's width instead of P + R
o_bug, _ = absorbed_attention(f.q_nope, f.q_pe, f.kv_c, f.k_pe, w.W_UK, w.W_UV,
                              cfg.latent_dim ** -0.5, causal=True)
print(f"with scale 1/sqrt(Lkv + R) instead of the MHA form's: rel err "
      f"{rel_err(o_bug, o_mha):.2f}")
assert rel_err(o_bug, o_mha) > 10 * TOL

for name in ["tiny", "deepseek-v2", "deepseek-v3"]:
    c = get_config(name)
    print(f"{name:>12}: tau = {c.softmax_scale:.4f} (lambda = {c.mscale:.4f}); "
          f"1/sqrt(P + R) = {c.qk_head_dim ** -0.5:.4f}, 1/sqrt(Lkv + R) = "
          f"{c.latent_dim ** -0.5:.4f}")
assert [round(get_config(n).softmax_scale, 4) for n in ["deepseek-v2", "deepseek-v3"]] == [
    0.1147, 0.1352]

# %% [markdown]
# ## Step 3: the absorbed form over a paged cache
#
# In serving, the first `C` tokens' latents sit in a paged cache (`kv_cache [blocks, block_size,
# Lkv + R]`, one row per token) and the next `Sq` tokens (the code's `s_q`) are decoded against
# it. `decode_forward` runs the front, writes the new rows, and calls `mla_decode_paged`, the
# kernel-level function with FlashMLA's conventions, over the `Skv = C + Sq` keys. Its output
# for those tokens must equal the definition's last `Sq` rows.

# %%
block_size, s_q = 16, 3
C = S - s_q  # 37 cached tokens: not a multiple of the block size
table, num_blocks = make_block_table([S], block_size, seed=1)
kv_cache = torch.randn(num_blocks, block_size, cfg.latent_dim, dtype=torch.float64)  # garbage
write_context(w, hidden[:C], kv_cache, table[0])
out_decode = decode_forward(w, hidden[C:][None], kv_cache, table,
                            torch.tensor([C], dtype=torch.int32))[0]
err_3 = assert_close(out_decode, out_naive[C:], TOL, name="paged decode vs naive")
print(f"step 3 (paged absorbed decode of {s_q} tokens after {C}): rel err {err_3:.1e}")
print(f"block table {table.tolist()}")

# %% [markdown]
# ## What it buys: the KV cache per token (DeepSeek-V2, Table 1)
#
# In the paper's names (`n_h = N` heads, `d_h = P`, `d_c = Lkv`, `d_h^R = R`, `l` layers), per
# token and layer MHA caches `2·n_h·d_h` numbers, GQA with `n_g` groups `2·n_g·d_h`, MQA
# `2·d_h`, and MLA `d_c + d_h^R` (= `Lkv + R`). `mla.kv_cache_comparison` computes the table
# from a config; for DeepSeek-V2 (`d_c = 4·d_h`, `d_h^R = d_h/2`) the MLA row is `4.5·d_h·l`,
# the paper's "about 9/2·d_h·l" (equal to GQA with 2.25 groups), against `256·d_h·l` for its
# 128-head MHA. The paper's table gives the formulas; the GQA row below, with 8 groups, is our
# choice of `n_g`.

# %%
presets = ["deepseek-v2-lite", "deepseek-v2", "deepseek-v3"]
kinds = ["MHA", "GQA", "MQA", "MLA"]
table1 = {name: kv_cache_comparison(get_config(name)) for name in presets}
print(f"{'preset':<18}" + "".join(f"{k:>12}" for k in kinds) + "    (numbers per token, all "
      "layers; in units of d_h·l)")
for name, rows in table1.items():
    print(f"{name:<18}" + "".join(f"{r['numbers_per_token']:>12,}" for r in rows))
    print(f"{'':<18}" + "".join(f"{r['in_units_of_d_h_l']:>12g}" for r in rows))
v2 = get_config("deepseek-v2")
mla_row = table1["deepseek-v2"][3]
assert mla_row["in_units_of_d_h_l"] == (v2.kv_lora_rank + v2.qk_rope_head_dim) / v2.qk_nope_head_dim
print(f"DeepSeek-V2: MLA caches {mla_row['in_units_of_d_h_l']}·d_h·l, "
      f"{table1['deepseek-v2'][0]['numbers_per_token'] / mla_row['numbers_per_token']:.0f}x "
      f"less than MHA")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
width = 0.2
for j, kind in enumerate(kinds):
    kib = [table1[name][j]["numbers_per_token"] * 2 / 1024 for name in presets]  # bf16: 2 bytes
    bars = ax.bar([i + (j - 1.5) * width for i in range(len(presets))], kib, width, label=kind)
    ax.bar_label(bars, fmt="%.0f", fontsize=7)
ax.set_xticks(range(len(presets)), presets)
ax.set_yscale("log")
ax.set_xlabel("model preset (all layers, GQA with 8 groups)")
ax.set_ylabel("KV cache per token (KiB, bf16)")
ax.set_title("KV cache per token: MHA, GQA, MQA and MLA")
ax.legend()
save(fig, "kv_cache_per_token")

# %% [markdown]
# ## Summary
#
# Each step computed the same numbers as the one before:

# %%
for step, err in [("1 prefill_forward (low-rank KV, MHA)", err_1),
                  ("2 absorbed_attention (decoupled RoPE, MQA)", err_2_out),
                  ("3 decode_forward (paged cache)", err_3)]:
    print(f"step {step:<45} rel err vs definition {err:.1e}  (tolerance {TOL:.0e})")
