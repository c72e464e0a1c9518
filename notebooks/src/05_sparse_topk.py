# ruff: noqa: E402
# Source of notebooks/05_sparse_topk.ipynb (build: python notebooks/build.py).

# %% [markdown]
# # Sparse top-k attention and the FP8 latent cache (DeepSeek-V3.2, V4)
#
# DeepSeek-V3.2's sparse attention (DSA) keeps MLA's absorbed form but lets each query attend to
# only `topk = 2048` earlier tokens, chosen by a light *indexer*; in serving, the latent rows are
# read from an FP8 cache of 656 bytes per token. This notebook shows the indexer's scores and
# the set it selects, follows the selected indices through a block table to cache slots, checks
# that sparse attention equals the official formulation (dense attention with a `-∞` mask off
# the selected set), and opens up the 656-byte `fp8_ds_mla` row and its rounding error. The
# last two sections are DeepSeek-V4's: what an attention sink does to the softmax, and the
# MODEL1 FP8 cache, laid out by page.

# %%
import dataclasses
import math

import matplotlib.pyplot as plt
import torch
from nbhelp import figure_saver  # puts the repository root on sys.path, before `import mla`

from mla import MLAWeights, get_config
from mla.compare import TOLERANCES, assert_close, rel_err
from mla.reference import (
    cache_rows,
    dequantize_fp8_model1,
    fp8_model1_cache,
    fp8_model1_page_bytes,
    make_block_table,
    merge_attn_states,
    naive_forward,
    quantize_fp8_model1,
    sparse_mla_decode,
    sparse_mla_prefill,
)
from mla.reference.fp8 import dequantize_fp8_ds_mla, fp8_ds_mla_scales, quantize_fp8_ds_mla
from mla.reference.fp8_model1 import FP8_MODEL1_BYTES, fp8_model1_rows
from mla.reference.indexer import (
    IndexerWeights,
    hadamard_rotate,
    index_scores,
    indexer_qk,
    indexer_topk,
    q_latent,
    select_topk,
)
from mla.reference.sink import apply_attn_sink
from mla.reference.sparse import convert_req_index_to_global_index, sparse_index_mask
from mla.reference.sparse_model import (
    sparse_decode_forward,
    sparse_masked_dense_forward,
    sparse_prefill_forward,
)

save = figure_saver("05_sparse_topk")
torch.manual_seed(0)
TOL = TOLERANCES[torch.float64]
v32 = get_config("deepseek-v3.2")
print(f"DeepSeek-V3.2 indexer: {v32.index_n_heads} heads of dim {v32.index_head_dim}, "
      f"top-{v32.index_topk}")

# %% [markdown]
# ## The indexer's scores
#
# For a query token `t` and an earlier key token `s`, with `n_I` index heads (the symbols are
# those of the table at the top of `papers/derivation.md`):
#
# $$I_{t,s} = \sum_{j=1}^{n_I} w_{t,j}\, \mathrm{ReLU}\!\left(q^I_{t,j} \cdot k^I_s\right),$$
#
# `q^I` from the MLA's query latent, one key `k^I` per token (LayerNorm, RoPE on its first `R`
# dims, paired differently from the MLA's: see below), per-head weights `w_{t,j}` from the
# hidden state (`mla.reference.indexer.indexer_qk`, `index_scores`). Each query `t` keeps the
# set `𝒮_t` of its `topk` highest-scoring keys among those at or before it; a row of a query
# with fewer than `topk` visible keys ends in `-1` (`select_topk`). Below, the `tiny` preset
# with a small indexer (4 heads of dim 16, top-8) on 40 tokens.

# %%
cfg = get_config("tiny").replace(name="tiny-sparse", index_n_heads=4, index_head_dim=16,
                                 index_topk=8)
w = MLAWeights.random(cfg, seed=0, dtype=torch.float64)
iw = IndexerWeights.random(cfg, seed=1, dtype=torch.float64)
S = 40
hidden = torch.randn(S, cfg.hidden_size, dtype=torch.float64)
positions = torch.arange(S)
qk = indexer_qk(iw, hidden, q_latent(w, hidden), positions)
scores = index_scores(qk.q_index, qk.weights, qk.k_index, positions, positions)  # [S, S]
local = select_topk(scores, cfg.index_topk)  # request-local key positions, -1 padded
assert torch.equal(local, indexer_topk(iw, w, hidden))
print("selected keys of queries 0, 3 and 39:")
for t in [0, 3, 39]:
    print(f"  t = {t:2d}: {local[t].tolist()}")

# %%
selected = sparse_index_mask(local, S)  # [S, S] bool
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
im = ax1.imshow(scores.masked_fill(torch.isinf(scores), float("nan")).numpy(), cmap="magma")
fig.colorbar(im, ax=ax1).set_label("index score I[t, s] (logit units)")
ax1.set_title("indexer scores (white: future keys)")
ax2.imshow(selected.numpy(), cmap="Greys")
ax2.set_title(f"selected set: top-{cfg.index_topk} per query")
for ax in (ax1, ax2):
    ax.set_xlabel("key position s (tokens)")
    ax.set_ylabel("query position t (tokens)")
save(fig, "indexer_scores_and_selection")
assert (selected.sum(1) == torch.clamp(positions + 1, max=cfg.index_topk)).all()

# %% [markdown]
# The official inference code quantizes `q^I` and `k^I` to FP8 first, after a Hadamard rotation
# (the ±1 Hadamard matrix of the index head's width, divided by the square root of that width:
# orthogonal, so it changes no dot product; it spreads outliers across the dims before
# the per-128 quantization). `use_fp8=True` models it. How many selections does the rounding
# change?

# %%
qh, kh = hadamard_rotate(qk.q_index), hadamard_rotate(qk.k_index)
dots = torch.einsum("tjd,sd->tjs", qk.q_index, qk.k_index)
dots_rotated = torch.einsum("tjd,sd->tjs", qh, kh)
print(f"Hadamard rotation changes the dot products by {rel_err(dots_rotated, dots):.1e} (relative)")
local_fp8 = indexer_topk(iw, w, hidden, use_fp8=True)
same = (sparse_index_mask(local_fp8, S) & selected).sum().item() / selected.sum().item()
print(f"FP8 indexer keeps {same:.1%} of the float64 indexer's selections")

# %% [markdown]
# The indexer's RoPE pairs coordinates differently from the MLA's. The MLA rotates interleaved
# pairs `(x_{2i}, x_{2i+1})` (DeepSeek's code, notebook 01); the indexer rotates the pairs
# `(x_i, x_{i+R/2})`, the first half of the rotary dims against the second ("rotate-half",
# GPT-NeoX style). DeepSeek's released code used the interleaved pairing in the indexer too
# until its fix of November 2025; `IndexerWeights.rope_style` holds the pairing (`"neox"` by
# default). The two pairings give different scores, so a kernel that copies the MLA's RoPE
# into the indexer selects different keys:

# %%
print(f"MLA RoPE pairs: {cfg.rope_style!r}; indexer RoPE pairs: {iw.rope_style!r}")
assert (cfg.rope_style, iw.rope_style) == ("interleaved", "neox")
local_interleaved = indexer_topk(dataclasses.replace(iw, rope_style="interleaved"), w, hidden)
kept = (sparse_index_mask(local_interleaved, S) & selected).sum().item() / selected.sum().item()
print(f"an indexer with the MLA's interleaved pairing keeps {kept:.1%} of the selections")
assert kept < 0.9

# %% [markdown]
# ## From request-local indices to cache slots
#
# The indexer names keys by their position `p` inside the request; the kernels read a flat
# paged cache. `convert_req_index_to_global_index` (vLLM's Triton kernel's semantics) maps the
# position `p` of request `r`, with `b` tokens per cache block (the code's `bs`), to the slot
#
# $$g(p) = \mathrm{block\_table}[r, \lfloor p / b \rfloor]\cdot b + p \bmod b,$$
#
# keeps `-1` as `-1`, and turns a position whose block falls outside the table into `-1`. In the
# workspace variant a prefill token's position maps to `p` plus the start of its request's rows
# in the workspace (`prefill_workspace_starts`) instead.

# %%
bs = 4
table, num_blocks = make_block_table([10, 7], bs, seed=5)
print("block table:", table.tolist())
req_id = torch.tensor([0, 0, 1], dtype=torch.int32)
token_indices = torch.tensor([[0, 5, 9, -1], [3, 4, 12, 2], [6, 0, -1, 1]], dtype=torch.int32)
slots = convert_req_index_to_global_index(req_id, table, token_indices, bs)
for r, tok, sl in zip(req_id.tolist(), token_indices.tolist(), slots.tolist()):
    print(f"request {r}: local {tok} -> slots {sl}")
# the slot holds the request's row at that position: read it back through the cache
cache = torch.randn(num_blocks, bs, 5, dtype=torch.float64)
flat = cache.view(-1, 5)
for r, tok, sl in zip(req_id.tolist(), token_indices.tolist(), slots.tolist()):
    rows = cache_rows(cache, table[r], 0, table.shape[1] * bs)
    for i, s in zip(tok, sl):
        if s >= 0:
            assert torch.equal(flat[s], rows[i])
print("index 12 of request 0 needs block 3 of a 3-block table: -1")

ws = convert_req_index_to_global_index(
    req_id, table, token_indices, bs,
    prefill_workspace_request_ids=torch.tensor([0, 0, -1], dtype=torch.int32),
    prefill_workspace_starts=torch.tensor([100], dtype=torch.int32))
print("workspace variant (tokens 0, 1 are a prefill whose rows start at 100; token 2 decodes):")
print(" ", ws.tolist())

# %% [markdown]
# ## Sparse attention equals the official formulation
#
# The serving path (vLLM's FlashMLA-sparse backend) caches the latent and the index keys,
# selects, converts, and runs the absorbed MQA over the selected rows only
# (`sparse_prefill_forward`, `sparse_decode_forward`). DeepSeek's released code instead runs
# the dense attention of the definition with an extra mask, `0` on the selected keys `𝒮_t` and `−∞`
# elsewhere (`sparse_masked_dense_forward`). Below, one request prefills 30 tokens and then
# decodes 3 more, two of them in one multi-token step; both formulations must agree. With a
# `topk` covering the whole context, both equal dense MLA.

# %%
def serve(w, iw, hidden, steps, fp8=False, block_size=8):
    """Prefill steps[0] tokens, then decode the rest in steps; returns all outputs."""
    c = w.config
    n = hidden.shape[0]
    table, nb = make_block_table([n], block_size, seed=2)
    if fp8:
        kv_cache = torch.zeros(nb, block_size, 656, dtype=torch.uint8)
    else:
        kv_cache = torch.full((nb, block_size, c.latent_dim), float("nan"), dtype=hidden.dtype)
    index_k = torch.full((nb, block_size, c.index_head_dim), float("nan"), dtype=hidden.dtype)
    first = steps[0]
    outs = [sparse_prefill_forward(w, iw, hidden[:first], torch.tensor([0, first]), [0],
                                   kv_cache, index_k, table)]
    done = first
    for s_q in steps[1:]:
        outs.append(sparse_decode_forward(w, iw, hidden[None, done: done + s_q], kv_cache,
                                          index_k, table, torch.tensor([done]))[0])
        done += s_q
    return torch.cat(outs)


h33 = torch.randn(33, cfg.hidden_size, dtype=torch.float64)
out_sparse = serve(w, iw, h33, [30, 1, 2])
out_official = sparse_masked_dense_forward(w, iw, h33)
print(f"sparse serving path vs official masked dense, top-{cfg.index_topk}: rel err "
      f"{assert_close(out_sparse, out_official, TOL):.1e}")
print(f"... and vs dense MLA (the selection bites): rel err "
      f"{rel_err(out_sparse, naive_forward(w, h33)):.2f}")
w_all = MLAWeights.random(cfg.replace(index_topk=64), seed=0, dtype=torch.float64)
iw_all = IndexerWeights.random(cfg.replace(index_topk=64), seed=1, dtype=torch.float64)
print(f"top-64 over 33 tokens vs dense MLA: rel err "
      f"{assert_close(serve(w_all, iw_all, h33, [30, 1, 2]), naive_forward(w_all, h33), TOL):.1e}")

# %% [markdown]
# ## The log-sum-exp of the sparse prefill: natural log, not base 2
#
# `sparse_mla_prefill` (FlashMLA's `flash_mla_sparse_fwd`) returns, besides the output, the
# largest logit and the log-sum-exp of each query and head, so that a caller can merge its
# output with another partial attention over other keys (notebook 03). The merge weighs each
# part by `e^{lse}`, so it needs the natural log. Kernels compute in base 2 (`exp2` is the
# fast instruction); one that returns `lse_2 = log_2 Σ_{s∈𝒮_t} e^{ℓ_s} = log_2(e) · lse`
# unconverted, merged as if it were natural, has every lse off by the factor `log_2 e ≈ 1.44`
# and weighs the parts by `(Σ_s e^{ℓ_s})^{1.44}` instead of `Σ_s e^{ℓ_s}`: a wrong output, not
# a rounding error. FlashMLA's README has documented the sparse prefill's lse in base 2, while
# its own reference (`tests/ref.py`) computes the natural log. This package returns the
# natural log everywhere, and its conformance run on an H200 found FlashMLA's
# `flash_mla_sparse_fwd` (the build in the vLLM 0.33.0 wheel) returning the natural log too
# (`benchmarks/results/conformance_flashmla_2026-11-30.md`, case `lse_natural_log`). Below,
# each query's selected keys split in two halves, each half attended on its own and the two
# merged: with natural logs the merge equals attending to all of them; with base-2 logs read
# as natural it does not; converting (`lse = lse_2 · ln 2`) first repairs it.

# %%
s_q, heads, d, dv, s_kv, topk = 6, 4, 40, 32, 50, 16
q = torch.randn(s_q, heads, d, dtype=torch.float64) * 3  # logits of a few units
kv = torch.randn(s_kv, d, dtype=torch.float64)
idx = torch.stack([torch.randperm(s_kv)[:topk] for _ in range(s_q)]).to(torch.int32)
scale = d ** -0.5
o_all, _, lse_all = sparse_mla_prefill(q, kv, idx, scale, d_v=dv)
o_a, _, lse_a = sparse_mla_prefill(q, kv, idx[:, : topk // 2], scale, d_v=dv)
o_b, _, lse_b = sparse_mla_prefill(q, kv, idx[:, topk // 2:], scale, d_v=dv)
o_m, lse_m = merge_attn_states(o_a, lse_a.T, o_b, lse_b.T)  # the merge takes lse as [heads, s_q]
print(f"halves merged, natural log: o rel err {assert_close(o_m, o_all, TOL):.1e}, "
      f"lse rel err {assert_close(lse_m.T, lse_all, TOL):.1e}")

LOG2E = math.log2(math.e)
lse2_a, lse2_b = lse_a * LOG2E, lse_b * LOG2E  # what a kernel returning base 2 gives
o_wrong, _ = merge_attn_states(o_a, lse2_a.T, o_b, lse2_b.T)
print(f"halves merged, base-2 lse read as natural: o rel err {rel_err(o_wrong, o_all):.2f}")
assert rel_err(o_wrong, o_all) > 100 * TOL
o_fixed, _ = merge_attn_states(o_a, (lse2_a * math.log(2)).T, o_b, (lse2_b * math.log(2)).T)
print(f"halves merged, base-2 lse converted first: o rel err "
      f"{assert_close(o_fixed, o_all, TOL):.1e}")

# %% [markdown]
# ## The `fp8_ds_mla` cache: 656 bytes per token
#
# | bytes | holds |
# | --- | --- |
# | `[0, 512)` | `kv_c`: 512 values as `float8_e4m3fn`, in 4 tiles of 128 |
# | `[512, 528)` | 4 `float32` inverse scales `σ_T`, one per tile `T`: `kv_c ≈ e4m3 · σ_T` |
# | `[528, 656)` | `k_pe`: 64 values as `bfloat16`, not quantized |
#
# For a coordinate `z` of tile `T` the round trip gives `ẑ`:
#
# $$\sigma_T = 2^{\lceil \log_2 \max(\max_{z\in T}|z| / 448,\ 10^{-4})\rceil}, \qquad
#   \hat z = \sigma_T\cdot \mathrm{e4m3}(z/\sigma_T),\qquad
#   |\hat z - z| \le \max(2^{-4}|z|,\ 2^{-10}\sigma_T).$$
#
# `σ_T` is a power of two, so dividing by it is exact and the only rounding is the cast to e4m3
# (3 mantissa bits: a relative error of at most `2^-4` for normal numbers, an absolute
# `2^-10·σ_T` below them). 656 bytes against 1152 for a bf16 row: 1.76 times more tokens per
# GB.

# %%
kv_c = torch.randn(64, 512) * torch.logspace(-3, 1, 64)[:, None]  # magnitudes over 4 decades
k_pe = torch.randn(64, 64)
packed = quantize_fp8_ds_mla(kv_c, k_pe)
print(f"packed rows: {tuple(packed.shape)} {packed.dtype}")
scales = packed[:, 512:528].contiguous().view(torch.float32)
assert torch.equal(scales, fp8_ds_mla_scales(kv_c))
assert torch.equal(torch.log2(scales), torch.log2(scales).round())  # powers of two
deq_c, deq_pe = dequantize_fp8_ds_mla(packed)
assert torch.equal(deq_pe, k_pe.to(torch.bfloat16))  # the rope part is bf16, bit for bit
print("scales of row 0 (values near 1e-3: on the 1e-4 floor, 2^-13) and of row 63 (near 10):",
      scales[0].tolist(), scales[-1].tolist())

err = (deq_c.float() - kv_c).abs()
bound = torch.maximum(2.0 ** -4 * kv_c.abs(), 2.0 ** -10 * scales.repeat_interleave(128, dim=1))
assert (err <= bound).all()
print(f"relative error of the whole latent: {rel_err(deq_c, kv_c):.3f}; worst error / bound: "
      f"{(err / bound).max():.2f}")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw=dict(width_ratios=[1, 1.3]))
for start, end, name, color in [(0, 512, "kv_c\n512 x e4m3\n(4 tiles of 128)", "C0"),
                                (512, 528, "4 x fp32 scales", "C1"),
                                (528, 656, "k_pe\n64 x bf16", "C2")]:
    ax1.barh(0, end - start, left=start, color=color, edgecolor="black")
    ax1.text((start + end) / 2, 0.55 if end - start < 50 else 0, name, ha="center",
             va="center", fontsize=8, color="black" if end - start < 50 else "white")
for t in range(1, 4):
    ax1.axvline(128 * t, color="white", lw=1)
ax1.set_xlim(0, 656)
ax1.set_yticks([])
ax1.set_ylim(-0.6, 0.8)
ax1.set_xlabel("byte offset in the row (bytes)")
ax1.set_ylabel("one token (row)")
ax1.set_title("fp8_ds_mla: 656 bytes per token")
sample = torch.randperm(err.numel())[:4000]
ax2.loglog(kv_c.abs().flatten()[sample], err.flatten()[sample].clamp_min(1e-12), ".",
           ms=2, alpha=0.4, label="|dequantized − kv_c|")
x = torch.logspace(-6, 2, 50)
ax2.loglog(x, 2.0 ** -4 * x, "k--", lw=1, label="2^-4·|kv_c| (normal e4m3)")
ax2.set_xlabel("|kv_c| (latent value units)")
ax2.set_ylabel("absolute rounding error (latent value units)")
ax2.set_title("round-trip error, tiles of magnitude 1e-3 to 10")
ax2.legend(fontsize=8)
save(fig, "fp8_ds_mla_layout_and_error")

# %% [markdown]
# The FP8 cache plugs into the same serving path: prefill dequantizes each request's rows into a
# workspace (read through the workspace variant of the conversion), decode reads the 656-byte
# rows directly. The layout fixes `Lkv = 512` and `R = 64`, so below a config with DeepSeek's
# latent widths but 2 heads and a small hidden size. The sparse path on the FP8 cache equals the
# official formulation on the same rounded latent; against the unrounded latent it differs by
# the FP8 rounding.

# %%
cfg8 = v32.replace(name="v3.2-narrow", hidden_size=256, num_heads=2, q_lora_rank=64,
                   index_n_heads=4, index_head_dim=64, index_topk=16)
w8 = MLAWeights.random(cfg8, seed=3, dtype=torch.float64)
iw8 = IndexerWeights.random(cfg8, seed=4, dtype=torch.float64)
h8 = torch.randn(28, cfg8.hidden_size, dtype=torch.float64)
out_fp8 = serve(w8, iw8, h8, [25, 3], fp8=True, block_size=16)
out_exact = serve(w8, iw8, h8, [25, 3], fp8=False, block_size=16)
ref_fp8 = sparse_masked_dense_forward(w8, iw8, h8, fp8_kv_cache=True)
print(f"fp8 cache, sparse path vs official on the rounded latent: rel err "
      f"{assert_close(out_fp8, ref_fp8, TOL):.1e}")
print(f"fp8 cache vs float cache (the cost of FP8): rel err {rel_err(out_fp8, out_exact):.1e}")
assert 0 < rel_err(out_fp8, out_exact) < 2.0 ** -4

# %% [markdown]
# ## DeepSeek-V4's attention sink
#
# For DeepSeek-V4 FlashMLA's sparse kernels take an *attention sink*, one logit `ζ_n` per head
# (`attn_sink`, float32 `[N]`) that enters the softmax's normaliser and nothing else
# (`papers/derivation.md` (31), `docs/conventions.md` §14). With `(lse, o)` the log-sum-exp
# and output over the real keys `𝒦`,
#
# $$o^{\zeta} = \frac{\sum_{s\in\mathcal K} e^{\ell_s} v_s}
#   {\sum_{s\in\mathcal K} e^{\ell_s} + e^{\zeta_n}}
#   = o\cdot\frac{e^{\mathrm{lse}}}{e^{\mathrm{lse}} + e^{\zeta_n}}
#   = o\cdot\operatorname{sigmoid}(\mathrm{lse} - \zeta_n),$$
#
# and the returned `lse` is the real keys', unchanged. (`sigmoid(x) = 1/(1 + e^{−x})`; `σ` stays
# the FP8 tile's scale.) The sink is a way for a head to attend to *nothing*: softmax weights
# sum to 1, and the weight `e^{ζ_n}/(e^{lse} + e^{ζ_n})` the sink takes goes nowhere. Below, one
# query set against 16 keys each, the sink swept across the logits' range: at `ζ_n = lse` the
# output is halved, far below it nothing changes, far above it the output vanishes.

# %%
o_ref, _, lse_ref = sparse_mla_prefill(q, kv, idx, scale, d_v=dv)  # the lse section's inputs
offsets = torch.linspace(-8, 8, 33)  # ζ_n − lse of query 0, head 0
factors = []
for off in offsets:
    sink = torch.full((heads,), (lse_ref[0, 0] + off).item(), dtype=torch.float32)
    o_z, _, lse_z = sparse_mla_prefill(q, kv, idx, scale, d_v=dv, attn_sink=sink)
    assert torch.equal(lse_z, lse_ref)  # the sink leaves lse alone
    factors.append((o_z[0, 0] @ o_ref[0, 0] / (o_ref[0, 0] @ o_ref[0, 0])).item())
factors = torch.tensor(factors, dtype=torch.float64)
# ζ was rounded to float32, so the offset is the float32 sink's, not the grid's
exact_offsets = torch.tensor([torch.tensor(lse_ref[0, 0] + off, dtype=torch.float32).double()
                              - lse_ref[0, 0] for off in offsets])
assert_close(factors, torch.sigmoid(-exact_offsets), TOL)
print(" ζ − lse | out scaled by")
for off, f in list(zip(offsets.tolist(), factors.tolist()))[::4]:
    print(f"  {off:+5.1f}  | {f:.4f}")

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(offsets, torch.sigmoid(-offsets), "k-", lw=1, label="sigmoid(lse − ζ)")
ax.plot(offsets, factors, "o", ms=4, label="sparse_mla_prefill: o^ζ / o")
ax.set_xlabel("sink logit minus the keys' lse, ζ − lse (logit units)")
ax.set_ylabel("factor on the output (dimensionless)")
ax.set_title("an attention sink scales the output, lse unchanged")
ax.legend(fontsize=8)
save(fig, "attention_sink_factor")

# %% [markdown]
# **A sink is one more key whose value is zero.** Add a key `⊥` with logit `ℓ_⊥ = ζ_n` and
# value `v_⊥ = 0`: (7) over `𝒦 ∪ {⊥}` has `lse' = ln(e^{lse} + e^{ζ_n})` and
# `o' = Σ_s e^{ℓ_s − lse'} v_s + e^{ζ_n − lse'}·0 = e^{lse − lse'}·o`, which is `o^ζ`. The
# package can build that key without a sink: one more coordinate, `ζ_n/scale` in head `n`'s
# query (`scale` the example's softmax scale) and `1` in the extra row only, gives every real
# key its old logit and `⊥` the logit `ζ_n`; the extra row's V columns are zero. Its output
# must equal the sink's; its `lse` is `lse'`, which is why the kernels return the real keys'
# `lse` instead (the merge needs it). The corners: `ζ_n = +∞` zeroes the output, `ζ_n = −∞`
# leaves it bit for bit.

# %%
sink = lse_ref[0].float()  # one per head: query 0's lse, where the sink takes half
o_z, _, lse_z = sparse_mla_prefill(q, kv, idx, scale, d_v=dv, attn_sink=sink)
q_bot = torch.cat([q, (sink.double() / scale)[None, :, None].expand(s_q, heads, 1)], dim=-1)
kv_bot = torch.cat([torch.cat([kv, torch.zeros(s_kv, 1, dtype=kv.dtype)], dim=1),
                    torch.cat([torch.zeros(1, d, dtype=kv.dtype), torch.ones(1, 1,
                               dtype=kv.dtype)], dim=1)])  # row s_kv is ⊥: V part zero
idx_bot = torch.cat([idx, torch.full((s_q, 1), s_kv, dtype=torch.int32)], dim=1)
o_key, _, lse_key = sparse_mla_prefill(q_bot, kv_bot, idx_bot, scale, d_v=dv)
print(f"sink vs one more key of logit ζ and value 0: out rel err "
      f"{assert_close(o_z, o_key, TOL):.1e}")
assert_close(lse_key, torch.logaddexp(lse_ref, sink.double()), TOL, name="lse'")
print(f"the extra key's lse' exceeds the returned lse by up to "
      f"{(lse_key - lse_z).max():.2f} (ln(1 + e^(ζ − lse)))")
inf = float("inf")
assert torch.equal(sparse_mla_prefill(q, kv, idx, scale, d_v=dv,
                                      attn_sink=torch.full((heads,), inf))[0],
                   torch.zeros_like(o_ref))
assert torch.equal(sparse_mla_prefill(q, kv, idx, scale, d_v=dv,
                                      attn_sink=torch.full((heads,), -inf))[0], o_ref)
print("ζ = +inf: out = 0; ζ = -inf: out unchanged, bit for bit")

# %% [markdown]
# **Merging with a sink: the sink once, after the merge** (derivation (32)). `e^{ζ_n}` is one
# term of the normaliser of the whole softmax, not of a part. Partial states merge by their
# real keys' `(lse_a, o_a)` (notebook 03), and the merged state then takes the sink once.
# Applying it to each part instead damps part `a` by `sigmoid(lse_a − ζ_n)`, more than
# `sigmoid(lse − ζ_n)` since `lse_a < lse`. The lse section's halves again: merged then sunk
# equals the sink over all keys; sunk then merged does not. DeepSeek-V4's decode has a second
# KV scope (`extra_k_cache`, its own cache and indices) attended in the same softmax as the
# first: the two scopes are two parts of one key set, and the sink is applied once over both.

# %%
o_whole, _, _ = sparse_mla_prefill(q, kv, idx, scale, d_v=dv, attn_sink=sink)
o_m, lse_m = merge_attn_states(o_a, lse_a.T, o_b, lse_b.T)
once = apply_attn_sink(o_m, lse_m.T, sink)
print(f"merge, then the sink once: rel err {assert_close(once, o_whole, TOL):.1e}")
o_a_z, _, _ = sparse_mla_prefill(q, kv, idx[:, : topk // 2], scale, d_v=dv, attn_sink=sink)
o_b_z, _, _ = sparse_mla_prefill(q, kv, idx[:, topk // 2:], scale, d_v=dv, attn_sink=sink)
twice, _ = merge_attn_states(o_a_z, lse_a.T, o_b_z, lse_b.T)
print(f"the sink on each half, then merged: rel err {rel_err(twice, o_whole):.2f}")
assert rel_err(twice, o_whole) > 100 * TOL

# the second KV scope: the halves as two caches of one decode step (blocks of 4 rows)
def cache_of(rows: torch.Tensor) -> torch.Tensor:
    return rows.view(-1, 4, d)


half = topk // 2
sel_a, sel_b = kv[idx[:, :half]].reshape(-1, d), kv[idx[:, half:]].reshape(-1, d)
slots = torch.arange(s_q * half, dtype=torch.int32).view(1, s_q, half)
o_two, lse_two = sparse_mla_decode(q[None], cache_of(sel_a), slots, scale, False, head_dim_v=dv,
                                   attn_sink=sink, extra_k_cache=cache_of(sel_b),
                                   extra_indices_in_kvcache=slots)
print(f"two KV scopes with one sink vs one set of keys: rel err "
      f"{assert_close(o_two[0], o_whole, TOL):.1e}")

# %% [markdown]
# ## DeepSeek-V4's MODEL1 cache: laid out by page
#
# DeepSeek-V4's cached rows are 512 wide: 448 non-rotary values, quantized to e4m3 in 7 tiles of
# 64 with one power-of-two scale each, then 64 rotary values kept in bf16. The MODEL1 cache
# does not store a 584-byte record per token. A page of `b` tokens holds all its data rows
# first, 576 bytes each (448 e4m3 bytes, then 128 bytes of bf16 rope), then all its scale rows,
# 8 bytes each (7 scales and one unused byte), then padding to a multiple of 576 bytes. The
# token at offset `ω = p mod b` of its page (derivation (33)):
#
# $$\mathrm{data}(\omega) = [576\,\omega,\ 576\,\omega + 576),\qquad
#   \mathrm{scales}(\omega) = [576\,b + 8\,\omega,\ 576\,b + 8\,\omega + 7),\qquad
#   \text{page bytes} = 576\lceil 584\,b/576\rceil.$$
#
# Below, one page of `b = 4` tokens, its byte map read back from `quantize_fp8_model1`'s
# output.

# %%
b4 = 4
k_cache = torch.randn(1, b4, 512) * torch.logspace(-2, 1, b4)[None, :, None]
page = quantize_fp8_model1(k_cache)
page_bytes = fp8_model1_page_bytes(b4)
assert page.shape == (1, page_bytes) == (1, 576 * math.ceil(584 * b4 / 576))
regions = ([(576 * w, 576 * w + 448, f"token {w}: 448 x e4m3 (nope)") for w in range(b4)]
           + [(576 * w + 448, 576 * w + 576, f"token {w}: 64 x bf16 (rope)") for w in range(b4)]
           + [(576 * b4 + 8 * w, 576 * b4 + 8 * w + 8, f"token {w}: 7 x UE8M0 + 1 unused")
              for w in range(b4)]
           + [(584 * b4, page_bytes, "padding to a multiple of 576")])
regions.sort()
print(f"one page of b = {b4} tokens: {page_bytes} bytes = {page_bytes // 576} x 576 "
      f"({FP8_MODEL1_BYTES} x {b4} = {FP8_MODEL1_BYTES * b4} used)")
for start, end, what in regions:
    print(f"  [{start:5d}, {end:5d})  {end - start:4d} B  {what}")
assert sum(end - start for start, end, _ in regions) == page_bytes

deq = dequantize_fp8_model1(page, b4)
for w in range(b4):  # each token read back at the offsets of the byte map
    codes = page[0, 576 * b4 + 8 * w: 576 * b4 + 8 * w + 7]
    scales_w = codes.view(torch.float8_e8m0fnu).float()  # UE8M0: 2^(byte - 127)
    assert torch.equal(scales_w, torch.pow(2.0, codes.float() - 127))
    nope = page[0, 576 * w: 576 * w + 448].view(torch.float8_e4m3fn).float()
    assert torch.equal(deq[0, w, :448], (nope * scales_w.repeat_interleave(64)).bfloat16())
    assert torch.equal(page[0, 576 * w + 448: 576 * w + 576].view(torch.bfloat16),
                       k_cache[0, w, 448:].bfloat16())
    print(f"token {w}: scale bytes {codes.tolist()} -> 2^{(codes.int() - 127).tolist()}")
assert torch.equal(fp8_model1_rows(page, b4, torch.arange(b4)), deq[0])
# what the kernels take: [blocks, b, 584] whose block stride is the page (two pages here)
view = fp8_model1_cache(quantize_fp8_model1(k_cache.repeat(2, 1, 1)), b4)
assert view.stride() == (page_bytes, 584, 1)
print(f"the kernels' view: shape {tuple(view.shape)}, strides {view.stride()}")

# %%
fig, ax = plt.subplots(figsize=(12, 2.6))
colors = {"e4m3": "C0", "bf16": "C2", "UE8M0": "C1", "padding": "0.85"}
for start, end, what in regions:
    color = next(c for key, c in colors.items() if key in what)
    ax.barh(0, end - start, left=start, color=color, edgecolor="black", lw=0.5)
    if end - start > 100:
        ax.text((start + end) / 2, 0, what.split(":")[0] if "token" in what else "padding",
                ha="center", va="center", fontsize=7)
for key, c in colors.items():
    ax.barh(0, 0, color=c, label=key)
for k in range(1, page_bytes // 576):
    ax.axvline(576 * k, color="k", ls=":", lw=0.8)
ax.set_xlim(0, page_bytes)
ax.set_ylim(-0.6, 0.9)
ax.set_yticks([])
ax.set_xlabel("byte offset in the page (bytes; dotted: multiples of 576)")
ax.set_ylabel("page (b = 4 tokens)")
ax.set_title("MODEL1: the data rows, then the scales, then padding")
ax.annotate(f"{b4} scale rows of 8 bytes", xy=(576 * b4 + 4 * b4, 0.4),
            xytext=(576 * b4 - 500, 0.72), fontsize=8, arrowprops=dict(arrowstyle="->"))
ax.legend(ncol=4, fontsize=8, loc="upper left")
save(fig, "model1_page_byte_map")

# %% [markdown]
# **Why by page.** A TMA copy on Hopper, like a 16-byte vector load, needs 16-byte-aligned
# addresses and row strides. A 584-byte per-token record (584 = 8·73) would put token `ω`'s data
# at `584·ω`, 16-byte aligned only for even `ω`; the page's data rows are 576 = 36·16 bytes
# apart, all aligned, and the padding of each page to a multiple of 576 makes the data of the
# whole cache one matrix of 576-byte rows. The scales of a page sit together, 8 bytes (one
# aligned word) per token, instead of 7 bytes scattered at a 584-byte stride. The price is the
# padding, under 576 bytes a page.
#
# **What it saves.** 584 bytes a token against `fp8_ds_mla`'s 656 (DeepSeek-V3.2's 576-wide
# rows) and 1024 for bf16: 64 bytes because 448 values are quantized instead of 512, and 8
# because seven UE8M0 scales, one byte each, fit in 8 bytes where four float32 scales took 16.
# UE8M0 is an exponent alone (no sign, no mantissa), and `σ_T` is a power of two, so the byte
# holds it exactly: `fp8_ds_mla`'s float32 scale held the same number in four bytes, three of
# them always zero in the mantissa.

# %%
print("offset of token ω's data:   ω:", list(range(8)))
print("  per-token record, 584·ω mod 16:", [584 * w % 16 for w in range(8)])
print("  by page,          576·ω mod 16:", [576 * w % 16 for w in range(8)])
assert all(576 * w % 16 == 0 for w in range(8)) and any(584 * w % 16 for w in range(8))
ds_row = quantize_fp8_ds_mla(torch.zeros(1, 512), torch.zeros(1, 64)).shape[-1]
print(f"bytes a token: bf16 {512 * 2}, fp8_ds_mla {ds_row}, MODEL1 {FP8_MODEL1_BYTES}")
for bsz in [1, 4, 16, 64]:
    pb = fp8_model1_page_bytes(bsz)
    print(f"  b = {bsz:2d}: page {pb:6d} bytes, padding {pb - 584 * bsz:3d}, "
          f"{pb / bsz:7.1f} bytes a token")
assert (ds_row, FP8_MODEL1_BYTES) == (656, 584) and fp8_model1_page_bytes(64) == 37440

# %% [markdown]
# **The round trip.** Dividing and multiplying by a power of two is exact, so the cast to e4m3
# is the one rounding and (28)'s bound holds per tile of 64 (derivation (34)):
# `|ẑ − z| ≤ max(2^-4·|z|, 2^-10·σ_T)`. On the same 448 values (padded with 64 zeros to
# `fp8_ds_mla`'s 512, which leaves its last tile's scale alone), MODEL1's tiles of 64 are never
# worse than `fp8_ds_mla`'s tiles of 128, element by element: a finer scale's e4m3 grid contains
# the coarser one's. They are better where a 128-wide tile mixes magnitudes: below, each row's
# tiles of 64 alternate between values near 100 and near 1e-3. In a tile of 128 the small
# values get the large ones' scale and fall into e4m3's subnormal range (the `2^-10·σ_T` term);
# in their own tile of 64 they keep 3 mantissa bits.

# %%
rows = 32
mag = torch.tensor([100.0, 1e-3] * 4)[:7].repeat_interleave(64)  # tile-by-tile magnitudes
nope_vals = torch.randn(rows, 448) * mag
rope_vals = torch.randn(rows, 64)
m1 = dequantize_fp8_model1(quantize_fp8_model1(torch.cat([nope_vals, rope_vals], 1)[None]),
                           rows)[0, :, :448].float()
ds_c, _ = dequantize_fp8_ds_mla(quantize_fp8_ds_mla(
    torch.cat([nope_vals, torch.zeros(rows, 64)], 1), rope_vals))
ds = ds_c[:, :448].float()
err_m1, err_ds = (m1 - nope_vals).abs(), (ds - nope_vals).abs()
sig = torch.pow(2.0, torch.log2((nope_vals.unflatten(1, (7, 64)).abs().amax(-1) / 448)
                                .clamp_min(1e-4)).ceil()).repeat_interleave(64, dim=1)
assert (err_m1 <= torch.maximum(2.0 ** -4 * nope_vals.abs(), 2.0 ** -10 * sig)).all()
assert (err_m1 <= err_ds).all()
small = mag.expand(rows, 448) < 1
print(f"values near 100:  rel err MODEL1 {rel_err(m1[~small], nope_vals[~small]):.4f}, "
      f"fp8_ds_mla {rel_err(ds[~small], nope_vals[~small]):.4f}")
print(f"values near 1e-3: rel err MODEL1 {rel_err(m1[small], nope_vals[small]):.4f}, "
      f"fp8_ds_mla {rel_err(ds[small], nope_vals[small]):.4f}")
assert rel_err(m1[small], nope_vals[small]) < rel_err(ds[small], nope_vals[small]) / 4
