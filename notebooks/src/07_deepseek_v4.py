# ruff: noqa: E402
# Source of notebooks/07_deepseek_v4.ipynb (build: python notebooks/build.py).

# %% [markdown]
# # DeepSeek-V4: the attention sink and the MODEL1 cache
#
# DeepSeek-V4 keeps DeepSeek-V3.2's sparse attention (notebook 05) and changes two things the
# kernels see: an *attention sink*, one extra logit per head that enters the softmax's
# normaliser and nothing else, and the MODEL1 FP8 cache, 584 bytes a token laid out by page.
# This notebook shows what the sink does to the output and to a merge of partial states, and
# opens up a MODEL1 page byte by byte beside notebook 05's `fp8_ds_mla` row.

# %%
import math

import matplotlib.pyplot as plt
import torch
from nbhelp import figure_saver  # puts the repository root on sys.path, before `import mla`

from mla.compare import TOLERANCES, assert_close, rel_err
from mla.reference import (
    dequantize_fp8_model1,
    fp8_model1_cache,
    fp8_model1_page_bytes,
    merge_attn_states,
    quantize_fp8_model1,
    sparse_mla_decode,
    sparse_mla_prefill,
)
from mla.reference.fp8 import dequantize_fp8_ds_mla, quantize_fp8_ds_mla
from mla.reference.fp8_model1 import FP8_MODEL1_BYTES, fp8_model1_rows
from mla.reference.sink import apply_attn_sink

save = figure_saver("07_deepseek_v4")
torch.manual_seed(0)
TOL = TOLERANCES[torch.float64]

# %% [markdown]
# The setup: six queries of four heads, each attending to 16 of 50 latent rows through
# `sparse_mla_prefill` (FlashMLA's `flash_mla_sparse_fwd`), and the same keys split in two
# halves attended on their own, the partial states a merge combines (notebook 03).

# %%
s_q, heads, d, dv, s_kv, topk = 6, 4, 40, 32, 50, 16
q = torch.randn(s_q, heads, d, dtype=torch.float64) * 3  # logits of a few units
kv = torch.randn(s_kv, d, dtype=torch.float64)
idx = torch.stack([torch.randperm(s_kv)[:topk] for _ in range(s_q)]).to(torch.int32)
scale = d ** -0.5
o_a, _, lse_a = sparse_mla_prefill(q, kv, idx[:, : topk // 2], scale, d_v=dv)
o_b, _, lse_b = sparse_mla_prefill(q, kv, idx[:, topk // 2:], scale, d_v=dv)

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
o_ref, _, lse_ref = sparse_mla_prefill(q, kv, idx, scale, d_v=dv)  # the setup's inputs
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
# `sigmoid(lse − ζ_n)` since `lse_a < lse`. The setup's halves again: merged then sunk
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
