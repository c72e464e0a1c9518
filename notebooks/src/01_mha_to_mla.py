# ruff: noqa: E402
# Source of notebooks/01_mha_to_mla.ipynb (build: python notebooks/build.py).

# %% [markdown]
# # From multi-head attention to MLA
#
# Multi-head Latent Attention (DeepSeek-V2, section 2.1) is ordinary multi-head attention whose
# keys and values are *generated* from one small vector per token, the latent `kv_c`. This
# notebook walks from the definition to the absorbed kernel that DeepSeek serves with, one step
# at a time, and checks with `mla.compare` that each step computes the same numbers as the one
# before. Everything runs on the `tiny` preset in float64, so the checks hold to about `1e-12`;
# change the preset, the lengths or the random seed and run it again.
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
# One request of `S` tokens with hidden states `h [S, H]`. The shared front (conventions §1)
# computes per token the query parts `q_nope [N, P]`, `q_pe [N, R]` (rotated), the normed
# latent `kv_c [Lkv]` and one rotary key `k_pe [R]` shared by all heads. The definition then
# up-projects the latent to ordinary per-head keys and values,
#
# $$k^{nope}_{s,n} = kv_{c,s} W^{UK}_n, \qquad v_{s,n} = kv_{c,s} W^{UV}_n,$$
#
# appends the shared `k_pe` to every head's key and runs causal MHA with head dim `P + R` and
# softmax scale `1/sqrt(P + R)`.

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
# part). Here they are all linear images of `kv_c`, so the stacked keys of all heads have rank
# at most `Lkv` whatever `N·P` is, and caching `kv_c` (and `k_pe`) loses nothing.

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
# $$q^{nope}_{t,n} \cdot (kv_{c,s} W^{UK}_n) = (q^{nope}_{t,n} {W^{UK}_n}^\top) \cdot kv_{c,s}
# = ql^{nope}_{t,n} \cdot kv_{c,s}.$$
#
# `ql_nope` is computed once per query (`absorb_q`), and the keys never leave the latent space.

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
# (RoFormer). With `R_p` the rotation at position `p`,
#
# $$(R_t q_t) \cdot (R_s W^{UK\top} kv_{c,s}) = q_t^\top R_{s-t} W^{UK\top} kv_{c,s},$$
#
# and the matrix between query and latent, `R_{s-t} W^{UK⊤}`, depends on the *pair* of
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
# RoPE, with one rotary key `k_pe` shared by all heads and cached next to `kv_c`. The logit is
# the sum of the two parts,
#
# $$\ell_{t,s,n} = q^{nope}_{t,n}\cdot k^{nope}_{s,n} + q^{pe}_{t,n}\cdot k^{pe}_s
# = [ql^{nope}_{t,n}, q^{pe}_{t,n}] \cdot [kv_{c,s}, k^{pe}_s],$$
#
# a dot product over `Lkv + R` dims between a per-head query and one key shared by all heads:
# multi-query attention (MQA) whose value is `kv_c` itself (the first `Lkv` columns of the key).
# The output is mapped back per head with `W_UV` after the attention. The softmax scale stays
# `1/sqrt(P + R)`: the logits are the same numbers as step 1's.

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
print(f"with scale 1/sqrt(Lkv + R) instead of 1/sqrt(P + R): rel err "
      f"{rel_err(o_bug, o_mha):.2f}")
assert rel_err(o_bug, o_mha) > 10 * TOL

# %% [markdown]
# ## Step 3: the absorbed form over a paged cache
#
# In serving, the first `C` tokens' latents sit in a paged cache (`kv_cache [blocks, block_size,
# Lkv + R]`, one row per token) and the next `s_q` tokens are decoded against it.
# `decode_forward` runs the front, writes the new rows, and calls `mla_decode_paged`, the
# kernel-level function with FlashMLA's conventions. Its output for those tokens must equal the
# definition's last `s_q` rows.

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
# Per token and layer, MHA caches `2·n_h·d_h` numbers, GQA with `n_g` groups `2·n_g·d_h`,
# MQA `2·d_h`, and MLA `d_c + d_h^R` (= `Lkv + R`). `mla.kv_cache_comparison` computes the table
# from a config; for DeepSeek-V2 (`d_c = 4·d_h`, `d_h^R = d_h/2`) the MLA row is `4.5·d_h·l`,
# as the paper says, against `256·d_h·l` for its 128-head MHA.

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
