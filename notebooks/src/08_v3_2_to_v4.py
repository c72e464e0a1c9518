# ruff: noqa: E402
# Source of notebooks/08_v3_2_to_v4.ipynb (build: python notebooks/build.py).

# %% [markdown]
# # From DeepSeek-V3.2's MLA to DeepSeek-V4's compressed and windowed attention
#
# DeepSeek-V3.2 attends with absorbed MLA over every past token, a lightning indexer choosing
# 2048 of them (notebook 05). DeepSeek-V4 replaces the per-token history by two caches: the
# raw keys of a short sliding window, and *compressed entries*, each pooling `r` tokens. This
# notebook states what changed, draws which keys each query sees in each of V4's three layer
# kinds, counts the KV bytes a token costs from DeepSeek-V2 to V4.1, opens up the compressor's
# pooling on a toy sequence, and runs one layer end to end, by its definition and as served,
# in float64. The attention sink and the MODEL1 cache row are notebook 07's.

# %%
import matplotlib.pyplot as plt
import torch
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch
from nbhelp import figure_saver  # puts the repository root on sys.path, before `import mla`

from mla.compare import TOLERANCES, assert_close
from mla.config import get_config
from mla.reference.fp8 import FP8_DS_MLA_BYTES
from mla.reference.fp8_model1 import FP8_MODEL1_BYTES, fp8_model1_page_bytes
from mla.reference.indexer_cache import INDEX_K_BYTES
from mla.reference.v4.compressor import (
    compress,
    compress_pool,
    compressed_cache_entries,
    compressor_init_state,
    compressor_kv_score,
    compressor_step,
    compressor_weights_of,
)
from mla.reference.v4.config import LAYER_KINDS, V4_PRESETS, V4Config, get_v4_config
from mla.reference.v4.layer import compressed_mask, v4_layer_definition, window_mask
from mla.reference.v4.rope import v4_rope_frequencies
from mla.reference.v4.serving import (
    COMPRESSED_PAGE_TOKENS,
    WINDOW_PAGE,
    V4Cache,
    compressed_ids,
    v4_layer_step,
    window_indices,
)
from mla.reference.v4.weights import V4LayerWeights, v4_weight_shapes

save = figure_saver("08_v3_2_to_v4")
TOL = TOLERANCES[torch.float64]
TINY = get_v4_config("tiny-v4")
F64 = torch.float64

# %% [markdown]
# ## 1. What changed from V3.2
#
# Side by side, DeepSeek-V3.2 (absorbed MLA) then DeepSeek-V4:
#
# - **a token's cached row**: 576 values, the 512-wide latent `c_KV` and 64 RoPE values; in V4
#   512 values, 448 "nope" and 64 RoPE.
# - **key and value**: K = the 576-wide row, V = its first 512, with `kv_b`'s up-projection
#   absorbed into the query and the output; in V4 K = V = the whole 512-wide row, and there
#   is no `kv_b`.
# - **heads**: 128 query heads share each row; in V4 64 (V4) or 128 (V4-Pro) heads share each
#   row, multi-query attention.
# - **keys of a query**: the indexer's top-2048 of *every* past token; in V4 a sliding window
#   of raw tokens, plus compressed entries by layer kind.
# - **softmax**: over the keys; in V4 over the keys and a per-head sink `ζ_h` (notebook 07).
# - **output**: `W_UV` (absorbed), then `W_o`; in V4 the inverse RoPE at the query's position,
#   then `wo_a` per group of `H/G` heads, then `wo_b`.
#
# The value is the key's row, RoPE dims included, so the output's last 64 dims carry the keys'
# rotations; the inverse rotation at the query's position `p` leaves them relative to `p`.
# A layer's kind is its compression ratio `r`:
#
# | `r` | name | keys of the query at position `p` |
# | --- | --- | --- |
# | 1 | SWA | the window `𝒲(p) = {s : max(p − W + 1, 0) ≤ s ≤ p}` |
# | 4 | C4A | `𝒲(p)` and the indexer's top-k of the entries `j < ⌊(p + 1)/4⌋` |
# | 128 | C128A | `𝒲(p)` and every entry `j < ⌊(p + 1)/128⌋` |
#
# Entry `j` pools tokens up to position `j·r + r − 1`, so it exists once query `p` has seen its
# last token: `j·r + r − 1 ≤ p ⟺ j < ⌊(p + 1)/r⌋`. DeepSeek-V4 has `W = 128`. Below, the two
# models' widths from the package's presets, and a V4 C4A layer's weights: no `kv_b`, and
# `wo_a` is `G` stacked blocks, one per group.

# %%
v32 = get_config("deepseek-v3.2")
v4 = get_v4_config("deepseek-v4")
print(f"V3.2: row {v32.latent_dim} = {v32.kv_lora_rank} + {v32.qk_rope_head_dim}, "
      f"{v32.num_heads} heads, {v32.num_layers} layers, indexer top-{v32.index_topk}")
for name in ("deepseek-v4", "deepseek-v4-pro"):
    c = V4_PRESETS[name]
    kinds = {LAYER_KINDS[r]: c.compress_ratios.count(r) for r in LAYER_KINDS}
    print(f"{name}: row {c.head_dim} = {c.nope_head_dim} + {c.rope_head_dim}, "
          f"{c.num_heads} heads in {c.o_groups} groups, W = {c.sliding_window}, "
          f"top-{c.index_topk}, {c.num_layers} layers {kinds}")
print("deepseek-v4, a C4A layer's weights:")
for name, shape in v4_weight_shapes(v4, 4).items():
    print(f"  {name:30s} {list(shape)}")
assert not any("kv_b" in n for n in v4_weight_shapes(v4, 4))
assert v4_weight_shapes(v4, 4)["wo_a.weight"] == (
    v4.o_groups * v4.o_lora_rank, v4.heads_per_group * v4.head_dim)

# %% [markdown]
# ## 2. Which keys each query sees, drawn
#
# A toy request of `T = 40` tokens through `tiny-v4` (window `W = 8`, top-k 3). The masks are
# the package's (`window_mask`, `compressed_mask`); the C4A layer's top-k is the one
# `v4_layer_definition` computes with the reference indexer (random weights, float64). At
# `r = 128` a 40-token request has no compressed entry, so that row is drawn with `r = 8`
# instead (5 entries): the rule `j < ⌊(p + 1)/r⌋` is the same for any `r`. Light grey in the
# C4A panel: entries the query may see but the indexer did not pick.

# %%
T, W = 40, TINY.sliding_window
positions = torch.arange(T)
x_toy = torch.randn(T, TINY.hidden_size, dtype=F64, generator=torch.Generator().manual_seed(1))
trace4 = v4_layer_definition(x_toy, V4LayerWeights.random(TINY, 4, seed=4),
                             kv_cache_dtype="float64")
m_win = window_mask(positions, positions, W)
assert torch.equal(m_win, trace4.window_mask)
panels = []  # (title, window part, compressed part: 0 hidden, 1 visible not picked, 2 attended)
panels.append(("SWA, r = 1", m_win, torch.zeros(T, 0)))
n4 = T // 4
visible4 = torch.arange(n4)[None, :] < ((positions + 1) // 4)[:, None]
picked4 = trace4.compressed_mask
assert not (picked4 & ~visible4).any()
panels.append(("C4A, r = 4 (the indexer's top-3)", m_win, visible4.int() + picked4.int()))
r_pic = 8
m_c = compressed_mask(positions, T // r_pic, r_pic)
panels.append((f"C128A drawn with r = {r_pic}", m_win, 2 * m_c.int()))

# the rule, query by query
for p in range(T):
    assert m_win[p].nonzero().flatten().tolist() == list(range(max(p - W + 1, 0), p + 1))
    assert m_c[p].nonzero().flatten().tolist() == list(range((p + 1) // r_pic))
    assert picked4[p].sum() == min(TINY.index_topk, (p + 1) // 4)

cmap = ListedColormap(["white", "0.8", "C0"])
fig, axes = plt.subplots(3, 2, figsize=(9, 11), width_ratios=[T, 12])
for (title, mw, mc), (axw, axc) in zip(panels, axes):
    axw.imshow(2 * mw.int(), cmap=cmap, vmin=0, vmax=2, interpolation="nearest")
    axw.set_title(f"{title}: window, W = {W}", fontsize=9)
    axw.set_xlabel("key position s (tokens)")
    axw.set_ylabel("query position p (tokens)")
    if mc.shape[1]:
        axc.imshow(mc, cmap=cmap, vmin=0, vmax=2, interpolation="nearest", aspect="auto")
        axc.set_xticks(range(mc.shape[1]))
    else:
        axc.text(0.5, 0.5, "no compressed\nentries", ha="center", va="center",
                 transform=axc.transAxes)
        axc.set_xticks([])
        axc.set_ylim(T - 0.5, -0.5)
    axc.set_title("compressed", fontsize=9)
    axc.set_xlabel("entry j (entries)")
    axc.set_ylabel("query position p (tokens)")
fig.legend(handles=[Patch(color="C0", label="attended"),
                    Patch(color="0.8", label="visible, not picked by the indexer")],
           loc="lower center", ncol=2, fontsize=8)
fig.tight_layout(rect=(0, 0.03, 1, 1))
save(fig, "visibility_masks")
for title, mw, mc in panels:
    keys = mw.sum(1) + (mc == 2).sum(1)
    print(f"{title:34s} keys per query: p = 0: {int(keys[0])}, p = {T - 1}: {int(keys[-1])}")

# %% [markdown]
# ## 3. KV bytes a token, from DeepSeek-V2 to V4.1
#
# What is counted: the bytes of the cached rows of one request of `L` tokens, per layer and
# over the model's layers (the multi-token-prediction layers left out, for every model), rows
# only (no page padding, no block-table). `GB` is `10^9` bytes.
#
# - DeepSeek-V2 and V3 (MLA): one row a token and layer, `B = L·ℓ·b_row` over `ℓ` layers:
#   576 values, `b_row = 1152` in bf16; V3's FP8 cache in vLLM, `fp8_ds_mla`, `b_row = 656`
#   (512 e4m3, 4 float32 scales, 64 bf16; notebook 05).
# - DeepSeek-V3.2: the same 656-byte row plus the indexer's key, 132 bytes (128 e4m3 and a
#   float32 scale): `b_row = 656 + 132 = 788`.
# - DeepSeek-V4, a layer of ratio `r`: the window cache needs only the last `W = 128` keys,
#   584 bytes each (MODEL1 `fp8_ds_mla`, notebook 07); the compressed cache one 584-byte
#   entry per `r` tokens; a C4A layer also the indexer's own compressed keys, 132 bytes per 4
#   tokens:
#
# $$B_{\text{layer}}(L) = 584\,\min(L, W) + 584\,\lfloor L/r\rfloor\,[r > 1]
#   + 132\,\lfloor L/4\rfloor\,[r = 4].$$
#
#   Per token and layer, as `L` grows: `584/4 + 132/4 = 179` bytes (C4A), `584/128 = 4.5625`
#   (C128A), 0 (SWA); the window adds a constant `584·W = 74,752` bytes a layer, whatever `L`.
# - DeepSeek-V4.1 (the `deepseek-v4.1-flash` preset: 40 layers of ratio 0, 1 or 2; its ratios
#   are this package's assumption, see `mla.reference.v4.config`): every layer keeps its own
#   window of `W = 128` rows of 528 bytes (MXFP8: 512 e4m3 and 16 UE8M0 scales, one per 32
#   values), but only the kv source layers (2, 8, 14 at ratio 2 and 20 at ratio 1) keep a
#   compressed cache and the indexer's keys, which the layers above them read:
#
# $$B(L) = 528\,\ell\,\min(L, W) + \sum_{s \in \text{kv sources}}
#   (b_c + 132)\,\lfloor L/r_s\rfloor,$$
#
#   `b_c = 528` (MXFP8), or 288 (NVFP4: 512 e2m1 codes two a byte and 32 e4m3 scales, one per
#   16) in the compressed cache only; the index keys 132 bytes (FP8; vLLM's 68-byte MXFP4 keys
#   run on SM100 only).
#
# The per-million column is `B(10^6)` for one request of a million tokens, window included.

# %%
MXFP8_V41 = 512 + 512 // 32  # 528: e4m3 values, one UE8M0 byte per 32
NVFP4_V41 = 512 // 2 + 512 // 16  # 288: e2m1 codes two a byte, one e4m3 scale per 16
assert (FP8_DS_MLA_BYTES, INDEX_K_BYTES, FP8_MODEL1_BYTES) == (656, 132, 584)
assert (MXFP8_V41, NVFP4_V41) == (528, 288)
MILLION = 10 ** 6


def mla_bytes(row: int, layers: int, L: int) -> int:
    """A request of L tokens in an MLA cache: one row a token and layer."""
    return row * layers * L


def v4_layer_bytes(r: int, L: int, W: int, window_row: int, comp_row: int,
                   index_row: int = INDEX_K_BYTES) -> float:
    """B_layer(L) of the formula above."""
    return (window_row * min(L, W) + (comp_row * (L // r) if r > 1 else 0)
            + (index_row * (L // 4) if r == 4 else 0))


def v4_bytes(ratios: tuple[int, ...], L: int, W: int, window_row: int, comp_row: int) -> float:
    return sum(v4_layer_bytes(r, L, W, window_row, comp_row) for r in ratios)


rows = []  # model, rows, layers, per layer per token, all layers per token, window, GB / 1M
for name, label, row in [("deepseek-v2", "V2 (bf16)", 576 * 2),
                         ("deepseek-v3", "V3 (bf16)", 576 * 2),
                         ("deepseek-v3", "V3 (fp8_ds_mla)", FP8_DS_MLA_BYTES),
                         ("deepseek-v3.2", "V3.2 (fp8_ds_mla + indexer)",
                          FP8_DS_MLA_BYTES + INDEX_K_BYTES)]:
    n = get_config(name).num_layers
    rows.append((label, f"{row} B", f"{n}", f"{row}", row * n, 0,
                 mla_bytes(row, n, MILLION) / 1e9))
for label, preset, wrow, crow in [("V4 (MODEL1)", "deepseek-v4", 584, 584),
                                  ("V4-Pro (MODEL1)", "deepseek-v4-pro", 584, 584)]:
    c = V4_PRESETS[preset]
    ratios, W4 = c.compress_ratios, c.sliding_window
    per_kind = {r: (v4_layer_bytes(r, 128 * MILLION, W4, 0, crow) / (128 * MILLION))
                for r in (1, 4, 128)}  # the growing part: no window, L a multiple of 128
    growth = sum(per_kind[r] for r in ratios)
    window = wrow * W4 * len(ratios)
    counts = "/".join(str(ratios.count(r)) for r in (1, 4, 128))
    rows.append((label, f"{wrow}/{crow} B", counts,
                 "/".join(f"{per_kind[r]:g}" for r in (1, 4, 128)), growth, window,
                 v4_bytes(ratios, MILLION, W4, wrow, crow) / 1e9))
    assert abs(v4_bytes(ratios, 128 * MILLION, W4, wrow, crow)
               - (growth * 128 * MILLION + window)) < 1e-6



def v41_bytes(c: V4Config, L: int, comp_row: int, window_row: int = MXFP8_V41) -> int:
    """B(L) of the V4.1 formula: a window a layer, compressed rows and index keys at the kv
    sources only (the layers above read their source's)."""
    window = window_row * c.num_layers * min(L, c.sliding_window)
    return window + sum((comp_row + INDEX_K_BYTES) * (L // c.layer_ratio(s))
                        for s in c.kv_source_layer_ids)


c41 = V4_PRESETS["deepseek-v4.1-flash"]
assert sorted(c41.layer_ratio(s) for s in c41.kv_source_layer_ids) == [1, 2, 2, 2]
for label, crow in [("V4.1-Flash (MXFP8)", MXFP8_V41), ("V4.1-Flash (NVFP4 compr.)", NVFP4_V41)]:
    big = 128 * MILLION  # a multiple of every ratio: the growing part exactly
    window = MXFP8_V41 * c41.sliding_window * c41.num_layers
    growth = (v41_bytes(c41, big, crow) - window) / big
    counts = "/".join(str(c41.compress_ratios.count(r)) for r in (0, 1, 2))
    per_source = "/".join(f"{(crow + INDEX_K_BYTES) / r:g}" for r in (1, 2))
    rows.append((label, f"{MXFP8_V41}/{crow} B", counts, per_source, growth, window,
                 v41_bytes(c41, MILLION, crow) / 1e9))

head = ("model", "row(s)", "layers", "B/token/layer", "B/token, all", "window, all (B)",
        "GB per 1M tokens")
print(f"{head[0]:34s} {head[1]:>10s} {head[2]:>9s} {head[3]:>18s} {head[4]:>13s} "
      f"{head[5]:>16s} {head[6]:>17s}")
for label, rowb, layers, per_layer, per_token, window, gb in rows:
    print(f"{label:34s} {rowb:>10s} {layers:>9s} {per_layer:>18s} {per_token:13,.2f} "
          f"{window:16,d} {gb:17.3f}")
print("V4 rows: row(s) = window/compressed; layers and B/token/layer = SWA/C4A/C128A")
print("V4.1 rows: layers = ratio 0/1/2; B/token/layer = a kv source of ratio 1/2 (the other "
      "layers keep only their window)")
v4_gb = rows[4][6]
print(f"a million tokens: V3.2 {rows[3][6]:.2f} GB, V4 {v4_gb:.2f} GB, "
      f"{rows[3][6] / v4_gb:.1f}x less; V3 bf16 / V4: {rows[1][6] / v4_gb:.1f}x")

# %% [markdown]
# Per million tokens the window is a constant: 43 layers × 128 keys × 584 bytes = 3.2 MB per
# request, whether it holds a thousand tokens or a million; what grows is the compressed
# caches, about 3,850 bytes a token in V4 against 48,068 in V3.2. The C128A layers cost almost
# nothing (4.6 bytes a token each); the 21 C4A layers are 98% of the growth (179 bytes a token
# each, of which the indexer's keys are 33).
#
# Rows are not all a cache allocates. As `mla.reference.v4.serving` lays the caches out (vLLM's
# page sizes: 64 tokens a window page, 256 tokens a compressed page, so `256/r` entries), a
# MODEL1 page is padded to a multiple of 576 bytes (notebook 07). That costs one byte a row at
# 64 rows a page, but a C128A page holds 2 entries, 1168 bytes padded to 1728:

# %%
v4_row = rows[4]
assert v4_row[4] == 3850.25 and rows[3][4] == 48068 and v4_row[5] == 43 * 128 * 584
print(f"V4: the window {v4_row[5] / 1e6:.2f} MB a request; C4A share of the growth "
      f"{21 * 179 / v4_row[4]:.1%}")
assert round(21 * 179 / v4_row[4], 2) == 0.98

for what, per_page in [("window page", WINDOW_PAGE),
                       ("C4A compressed page", COMPRESSED_PAGE_TOKENS // 4),
                       ("C128A compressed page", COMPRESSED_PAGE_TOKENS // 128)]:
    pb = fp8_model1_page_bytes(per_page)
    print(f"{what:22s} {per_page:3d} rows: {pb:6d} B, {pb / per_page:6.1f} B a row "
          f"(584 used)")
assert fp8_model1_page_bytes(2) == 1728

# %% [markdown]
# ## 4. The compressor: which tokens an entry pools, and how
#
# A layer of ratio `r` has a compressor of width `d = 512` (the C4A layer's indexer has its own
# of width 128). Each token `q` gives two rows of `coff·d` values, `coff = 2` at `r = 4`
# ("overlap") and 1 at `r = 128` (`compressor_kv_score`):
#
# $$\mathrm{kv}_q = x_q W_{kv}^\top,\qquad s_q = x_q W_{gate}^\top + \mathrm{ape}[q \bmod r].$$
#
# Entry `j` pools the window of the `coff·r` positions ending at `j·r + r − 1`. With overlap,
# the previous block's 4 tokens `[j·r − 4, j·r)` are read through the first channel half
# `[0, d)` and the entry's own block `[j·r, j·r + 4)` through the second half `[d, 2d)`, so 8
# tokens; at `r = 128` the one block is read through `[0, d)`. Positions below 0 are left out
# (entry 0 of a C4A layer pools its own 4 tokens). Per channel `e`, a softmax over the window:
#
# $$a_{q,e} = \frac{e^{s_{q,e}}}{\sum_{q'} e^{s_{q',e}}},\qquad
#   c_j = \sum_q a_q \odot \mathrm{kv}_q,\qquad
#   \mathrm{entry}_j = \mathrm{RoPE}_{j\cdot r}\big(\mathrm{RMSNorm}(c_j)\big),$$
#
# the rotation at the block's first position `j·r`. Below, a 16-token request through a C4A
# layer's compressor (4 entries) and a 256-token request through a C128A layer's (2 entries):
# which tokens feed each entry, and channel `e = 0`'s softmax weights.

# %%
def pooling_by_hand(kv, score, j, r, coff, e=None):
    """Entry j's window: positions, the softmax weights [slots, d] and c_j, from the equations."""
    d = kv.shape[1] // coff
    pos = torch.arange(j * r + r - coff * r, j * r + r)  # the coff·r positions ending at j·r+r-1
    half = torch.arange(coff * r) // r  # the channel half each slot reads
    keep = pos >= 0
    pos, half = pos[keep], half[keep]
    s = torch.stack([score[q, h * d:(h + 1) * d] for q, h in zip(pos.tolist(), half.tolist())])
    v = torch.stack([kv[q, h * d:(h + 1) * d] for q, h in zip(pos.tolist(), half.tolist())])
    a = torch.exp(s - s.max(0).values)
    a = a / a.sum(0)
    return pos, half, a, (a * v).sum(0)


d = TINY.head_dim
comp = {}
for r, T_r in [(4, 16), (128, 256)]:
    w_r = V4LayerWeights.random(TINY, r, seed=r)
    cw = compressor_weights_of(w_r)  # the layer's compressor.* tensors
    x_r = torch.randn(T_r, TINY.hidden_size, dtype=F64,
                      generator=torch.Generator().manual_seed(10 + r))
    kv, score = compressor_kv_score(x_r, cw, torch.arange(T_r))
    pooled = compress_pool(kv, score, r, overlap=(r == 4))
    entries = compress(x_r, cw, TINY)
    # what the layer caches, in float64: the same entries
    assert torch.equal(entries, compressed_cache_entries(x_r, w_r, "float64"))
    comp[r] = (cw, x_r, kv, score, pooled, entries)
    print(f"r = {r}: {T_r} tokens -> {entries.shape[0]} entries of {entries.shape[1]}")
    for j in range(entries.shape[0]):
        pos, half, _, _ = pooling_by_hand(kv, score, j, r, cw.coff)
        spans = [f"[{int(pos[half == h].min())}, {int(pos[half == h].max())}] "
                 f"through [{h * d}, {h * d + d})" for h in half.unique().tolist()]
        print(f"  entry {j}: {'; '.join(spans)}, RoPE at position {j * r}")

# %% [markdown]
# **One entry by hand.** Entry 2 of the C4A compressor (tokens 4 to 11) and entry 1 of the
# C128A one (tokens 128 to 255), from `kv` and `s` alone: the softmax over the window per
# channel, the weighted sum, RMSNorm with the compressor's `norm` weight, and the GPT-J
# rotation of the last 64 dims (pairs `(2i, 2i+1)` by the angle `j·r·f_i`, `f_i` the layer's
# frequencies, `v4_rope_frequencies`). Against the package's `compress_pool` and `compress`:

# %%
for r, j in [(4, 2), (128, 1)]:
    cw, x_r, kv, score, pooled, entries = comp[r]
    pos, half, a, c_j = pooling_by_hand(kv, score, j, r, cw.coff)
    assert_close(a.sum(0), torch.ones(d, dtype=F64), TOL)  # each channel's weights sum to 1
    n_j = cw.norm * c_j / torch.sqrt(c_j.pow(2).mean() + TINY.rms_norm_eps)
    angle = j * r * v4_rope_frequencies(TINY, r)
    lo, hi = n_j[d - 64::2], n_j[d - 64 + 1::2]
    rotated = torch.stack([lo * angle.cos() - hi * angle.sin(),
                           lo * angle.sin() + hi * angle.cos()], dim=1).flatten()
    entry_j = torch.cat([n_j[:d - 64], rotated])
    err_pool = assert_close(c_j, pooled[j], TOL, name="c_j")
    err_entry = assert_close(entry_j, entries[j], TOL, name="entry_j")
    print(f"r = {r:3d}, entry {j}: pooled {len(pos)} tokens [{int(pos.min())}, "
          f"{int(pos.max())}]; by hand vs compress_pool {err_pool:.1e}, "
          f"vs compress {err_entry:.1e}")

# %%
e = 0  # one channel of the nope part
fig, axes = plt.subplots(3, 1, figsize=(10, 7.5), height_ratios=[4, 4, 2.4])
cw, x_r, kv, score, pooled, entries = comp[4]
half_map = torch.zeros(entries.shape[0], 16)
a_map4 = torch.full((entries.shape[0], 16), float("nan"), dtype=F64)
for j in range(entries.shape[0]):
    pos, half, a, _ = pooling_by_hand(kv, score, j, 4, 2)
    half_map[j, pos] = half.float() + 1
    a_map4[j, pos] = a[:, e]
axes[0].imshow(half_map, cmap=ListedColormap(["white", "C1", "C0"]), vmin=0, vmax=2,
               interpolation="nearest", aspect="auto")
axes[0].set_title("r = 4: the tokens each entry pools", fontsize=9)
axes[0].legend(handles=[Patch(color="C1", label="previous block, channels [0, d)"),
                        Patch(color="C0", label="own block, channels [d, 2d)")],
               fontsize=8, loc="upper right")
im = axes[1].imshow(a_map4, cmap="viridis", vmin=0, interpolation="nearest", aspect="auto")
axes[1].set_title(f"r = 4: softmax weights a of channel e = {e} (each row sums to 1)", fontsize=9)
fig.colorbar(im, ax=axes[1], label="softmax weight (1)")
cw, x_r, kv, score, pooled, entries = comp[128]
a_map128 = torch.full((entries.shape[0], 256), float("nan"), dtype=F64)
for j in range(entries.shape[0]):
    pos, half, a, _ = pooling_by_hand(kv, score, j, 128, 1)
    a_map128[j, pos] = a[:, e]
im = axes[2].imshow(a_map128, cmap="viridis", vmin=0, interpolation="nearest", aspect="auto")
axes[2].set_title(f"r = 128: softmax weights of channel e = {e}, one block each", fontsize=9)
fig.colorbar(im, ax=axes[2], label="softmax weight (1)")
for ax in axes:
    ax.set_xlabel("token position q (tokens)")
    ax.set_ylabel("entry j (entries)")
    ax.set_yticks(range(ax.get_images()[0].get_array().shape[0]))
fig.tight_layout()
save(fig, "compressor_pooling")
assert_close(torch.nansum(a_map4, 1), torch.ones(4, dtype=F64), TOL)

# %% [markdown]
# **The serving form.** A server does not keep the whole history for the compressor: the state
# holds the last `coff·r` tokens' `kv` and `s` (`ape` added), and `compressor_step` emits the
# entries whose window closes among the new tokens. Fed in uneven steps, the C4A compressor
# gives `compress`'s entries.

# %%
cw, x_r, kv, score, pooled, entries = comp[4]
state, emitted, start = compressor_init_state(cw), [], 0
for n in [5, 1, 7, 3]:
    out, state = compressor_step(state, x_r[start:start + n], cw, TINY)
    print(f"tokens [{start}, {start + n}): {out.shape[0]} entries emitted, state holds "
          f"{state.kv.shape[0]} tokens")
    emitted.append(out)
    start += n
print(f"streamed vs compress: rel err {assert_close(torch.cat(emitted), entries, TOL):.1e}")

# %% [markdown]
# ## 5. The layer end to end: the definition and the serving form
#
# `v4_layer_definition` computes a request's layer output from dense masks: the window's keys
# and the compressed entries concatenated, one softmax with the sink. The serving form
# (`mla.reference.v4.serving`) writes the keys into paged caches (pages handed out in a
# scrambled order) and attends through FlashMLA's kernels' references with two KV scopes:
# scope 1 the window's cache slots, scope 2 (`extra_indices_in_kvcache`) the compressed
# cache's; decode runs each new token as its own row, prefill gathers both caches into one
# workspace. Below, each layer kind on a batch of two toy requests of different lengths, in
# float64 (cache dtype `"float64"`): the first tokens as one prefill step, then four decode
# steps of two tokens per request (as with multi-token prediction). At `r = 128` the requests
# have 260 and 257 tokens, so that two entries exist and one completes during decode.

# %%
serving = {}
for r, T_r in [(1, 40), (4, 40), (128, 260)]:
    w_r = V4LayerWeights.random(TINY, r, seed=r)
    gen = torch.Generator().manual_seed(20 + r)
    xs = [torch.randn(n, TINY.hidden_size, dtype=F64, generator=gen) for n in (T_r, T_r - 3)]
    refs = [v4_layer_definition(xb, w_r, kv_cache_dtype="float64") for xb in xs]
    cache = V4Cache.empty(w_r, 2, T_r, kv_cache_dtype="float64")
    starts = [xb.shape[0] - 8 for xb in xs]
    outs = v4_layer_step([xb[:s0] for xb, s0 in zip(xs, starts)], cache, path="prefill")
    for k in range(4):
        step = v4_layer_step([xb[s0 + 2 * k:s0 + 2 * k + 2] for xb, s0 in zip(xs, starts)],
                             cache, path="decode")
        outs = [torch.cat([o, n]) for o, n in zip(outs, step)]
    errs = [assert_close(o, ref.out, TOL) for o, ref in zip(outs, refs)]
    serving[r] = (cache, refs)
    print(f"{LAYER_KINDS[r]:5s} (r = {r:3d}): requests of {[xb.shape[0] for xb in xs]} tokens "
          f"({[ref.k_compressed.shape[0] for ref in refs]} entries), prefill {starts} + decode "
          f"4 x 2; vs the definition: rel err {max(errs):.1e}")
    assert max(errs) < 1e-13

# %% [markdown]
# **The two scopes of one decode row.** The C4A layer's last query of each request: scope 1 is
# its window of `W = 8` positions, scope 2 the indexer's 3 entries, each turned into cache
# slots through the request's page table (`page · page_size + offset`, the pages scrambled).
# Both scopes enter one softmax, with the sink applied once (notebook 07).

# %%
cache, refs = serving[4]
for b, ref in enumerate(refs):
    last = ref.out.shape[0] - 1
    p = torch.tensor([last])
    slots_w, len_w = window_indices(cache.window, b, p, W)
    ids = compressed_ids(p, 4, ref.topk[last:])
    slots_c = cache.compressed.slots(b, ids)
    print(f"request {b}, query at position {last}:")
    print(f"  scope 1: positions {list(range(last - W + 1, last + 1))} -> slots "
          f"{slots_w[0].tolist()} (pages of {cache.window.page} tokens), "
          f"topk_length {int(len_w[0])}")
    print(f"  scope 2: entries {ids[0].tolist()} of {(last + 1) // 4} visible -> slots "
          f"{slots_c[0].tolist()} (pages of {cache.compressed.page} entries)")
    assert int(len_w[0]) == W and set(ids[0].tolist()) == set(
        ref.compressed_mask[last].nonzero().flatten().tolist())
