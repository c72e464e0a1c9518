# ruff: noqa: E402
# Source of notebooks/02_prefill_or_decode.ipynb (build: python notebooks/build.py).

# %% [markdown]
# # Prefill or decode: which form of MLA to run
#
# MLA has two exact forms (notebook 01):
#
# - **compute-friendly** (`mla.reference.prefill_attention`): up-project every key's latent to
#   per-head `k [Skv, N, P+R]`, `v [Skv, N, V]`, then MHA with QK dim `P + R = 192` and V dim
#   `V = 128`;
# - **absorbed** (`mla.reference.absorbed_attention`, `mla_decode_paged`): fold `W_UK` into the
#   query and `W_UV` into the output, then MQA over the cached rows with QK dim `Lkv + R = 576`
#   and V dim `Lkv = 512`.
#
# They compute the same numbers but cost differently. This notebook counts the FLOPs and the
# bytes of both as functions of the number of queries `Sq`, the number of keys `Skv` and the
# heads `N`, checks the FLOP counts against PyTorch's own count of the reference code, and
# places both on the H200 roofline to see where each wins. The ceilings are those measured on
# this project's H200 by the benchmarks (`benchmarks/results/`: a device-to-device copy at
# 4.22-4.25 TB/s and a dense bf16 matmul at 687-694 TFLOP/s), rounded to 4.25 TB/s and
# 700 TFLOP/s; the datasheet says 4.8 TB/s and about 989 TFLOP/s.

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.lines import Line2D
from nbhelp import figure_saver  # puts the repository root on sys.path, before `import mla`
from torch.utils.flop_counter import FlopCounterMode

from mla import get_config
from mla.reference import absorbed_attention, prefill_attention

save = figure_saver("02_prefill_or_decode")
PEAK_FLOPS = 700e12  # bf16 dense matmul, FLOP/s (H200, measured: benchmarks/results/)
PEAK_BYTES = 4.25e12  # HBM bandwidth, bytes/s (H200, measured: benchmarks/results/)
RIDGE = PEAK_FLOPS / PEAK_BYTES
ELEM = 2  # bytes per number in bf16
print(f"ridge point: {RIDGE:.0f} FLOP/byte")

# %% [markdown]
# ## The cost model
#
# With `pairs` the (query, key) pairs that are computed (`Sq·Skv`; a causal kernel that skips
# masked tiles does about `Sq·Skv − Sq(Sq−1)/2`) and a matmul of `m×k` by `k×n` costing `2mkn`:
#
# | | compute-friendly | absorbed |
# | --- | --- | --- |
# | projections | keys up: `2·Skv·Lkv·N·(P+V)` | queries, outputs: `2·Sq·N·Lkv·(P+V)` |
# | attention | `2·pairs·N·(P+R+V)` | `2·pairs·N·(2·Lkv+R)` |
#
# Bytes, for kernels that read and write each tensor once in bf16: both read the cached rows
# `Skv·(Lkv+R)` of every request and, once per batch of `B` requests, the weights `W_UK`, `W_UV`
# (`Lkv·N·(P+V)`). The compute-friendly form then
# writes the up-projected `k_nope` and `v` (`Skv·N·(P+V)`) and its attention reads `k` and `v`
# back (`Skv·N·(P+R+V)`: the shared `k_pe` is broadcast to every head), plus `q` and `o`. The
# absorbed form moves only per-query tensors besides the cache: `q_nope`, the absorbed query
# (written and read), the latent output (written and read) and `o`.

# %%
def dims(cfg):
    return (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
            cfg.kv_lora_rank)


def pairs(sq, skv, causal):
    return sq * skv - (sq * (sq - 1) // 2 if causal else 0)


def cost(cfg, form, sq, skv, causal=False, batch=1):
    """(FLOPs, bytes) of the attention of ``batch`` requests of equal shape in the given form."""
    N, P, R, V, L = dims(cfg)
    weights = L * N * (P + V)  # read once per batch
    if form == "compute-friendly":
        flops = 2 * skv * L * N * (P + V) + 2 * pairs(sq, skv, causal) * N * (P + R + V)
        numbers = (skv * (L + R) + skv * N * (P + V) + skv * N * (P + R + V)
                   + sq * N * (P + R) + sq * N * V)
    else:
        flops = 2 * sq * N * L * (P + V) + 2 * pairs(sq, skv, causal) * N * (2 * L + R)
        numbers = (skv * (L + R) + sq * N * P + 2 * sq * N * (L + R) + 2 * sq * N * L
                   + sq * N * V)
    return batch * flops, (weights + batch * numbers) * ELEM


def seconds(cfg, form, sq, skv, causal=False, batch=1):
    """Roofline time: the slower of computing and moving bytes."""
    flops, nbytes = cost(cfg, form, sq, skv, causal, batch)
    return max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES)

# %% [markdown]
# ## Checking the FLOP count against the reference code
#
# `torch.utils.flop_counter.FlopCounterMode` counts the matmul FLOPs that PyTorch dispatches.
# Running the package's two functions on `meta` tensors (shapes without data, so even
# DeepSeek-V3's 128 heads cost nothing) gives counts that must equal the model's. The reference
# computes masked logits too, so the count to compare is the one with all `Sq·Skv` pairs.
# (With a single key PyTorch turns the einsums into elementwise products, which it does not
# count, so the shapes below have more than one.)

# %%
def counted_flops(cfg, fn, sq, skv):
    N, P, R, V, L = dims(cfg)
    meta = dict(device="meta", dtype=torch.bfloat16)
    W_UK, W_UV = torch.empty(L, N, P, **meta), torch.empty(L, N, V, **meta)
    args = (torch.empty(sq, N, P, **meta), torch.empty(sq, N, R, **meta),
            torch.empty(skv, L, **meta), torch.empty(skv, R, **meta), W_UK, W_UV)
    with FlopCounterMode(display=False) as counter:
        fn(*args, cfg.softmax_scale, causal=True)
    return counter.get_total_flops()


for name in ["tiny", "deepseek-v2-lite", "deepseek-v3"]:
    cfg = get_config(name)
    for sq, skv in [(1, 37), (3, 1000), (700, 4099)]:
        for form, fn in [("compute-friendly", prefill_attention),
                         ("absorbed", absorbed_attention)]:
            model, counted = cost(cfg, form, sq, skv)[0], counted_flops(cfg, fn, sq, skv)
            assert model == counted, (name, form, sq, skv, model, counted)
print("the FLOP model equals FlopCounterMode's count of the reference for every case")

# %% [markdown]
# ## Arithmetic intensity on the H200 roofline
#
# Intensity is FLOPs per byte moved. A kernel below the ridge (`700e12 / 4.25e12 ≈ 165`
# FLOP/byte) is limited by memory bandwidth, above it by the tensor cores. Below, DeepSeek-V3's
# shapes with 16 heads (tensor parallel 8) and 128 heads (TP 1), a batch of 32 requests of 8192
# keys each, and `Sq` from one decode token to a prefill chunk of 4096: colour is the form,
# marker shape the number of queries `Sq`. The table under the figure gives the same points as
# numbers.

# %%
v3 = get_config("deepseek-v3")
SKV, BATCH = 8192, 32
sqs = [1, 4, 64, 4096]
FORM_COLOR = {"compute-friendly": "tab:blue", "absorbed": "tab:orange"}
SQ_MARKER = dict(zip(sqs, ["o", "s", "^", "D"]))
fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
rows = []
for ax, heads in zip(axes, [16, 128]):
    cfg = v3.replace(num_heads=heads)
    x = np.logspace(0, 4.5, 200)
    ax.loglog(x, np.minimum(PEAK_FLOPS, PEAK_BYTES * x) / 1e12, color="black", lw=1)
    for form, color in FORM_COLOR.items():
        for sq in sqs:
            f, b = cost(cfg, form, sq, SKV, causal=True, batch=BATCH)
            perf = min(PEAK_FLOPS, PEAK_BYTES * f / b) / 1e12
            ax.loglog(f / b, perf, marker=SQ_MARKER[sq], color=color, ls="none", ms=8,
                      alpha=0.8, markeredgecolor="black")
            rows.append((heads, form, sq, f / b, perf))
    ax.axvline(RIDGE, color="gray", ls=":", lw=1)
    ax.text(RIDGE * 1.1, 6, f"ridge {RIDGE:.0f} FLOP/byte", color="gray", fontsize=8)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_title(f"N = {heads} heads, B = {BATCH}, Skv = {SKV}")
for ax in axes:
    ax.set_ylabel("attainable throughput (TFLOP/s)")
handles = ([Line2D([], [], color=c, marker="o", ls="none", label=form)
            for form, c in FORM_COLOR.items()]
           + [Line2D([], [], color="gray", marker=m, ls="none", label=f"Sq = {sq}")
              for sq, m in SQ_MARKER.items()])
axes[1].legend(handles=handles, loc="upper left", fontsize=8)
save(fig, "roofline")
print(f"{'N':>4} | {'form':<16} | {'Sq':>5} | {'FLOP/byte':>9} | attainable TFLOP/s")
for heads, form, sq, inten, perf in rows:
    print(f"{heads:>4} | {form:<16} | {sq:>5} | {inten:>9.0f} | {perf:.0f}")

# %% [markdown]
# For decode (`Sq` of 1 to 4) over long contexts the absorbed form's intensity is about
# `(2·Lkv+R)/(Lkv+R)·N·Sq ≈ 1.9·N·Sq` FLOP/byte (`docs/kernels.md`): memory-bound with 16 heads,
# at the ridge with 128 heads. The compute-friendly form sits on the flat roof at every `Sq`,
# but not because it is efficient: each step it re-up-projects every cached key
# (`2·Lkv·N·(P+V)` FLOPs per key, for one query or four thousand), and it also moves
# `N·(2P+2V+R)` numbers per key instead of `Lkv + R`. The roofline says which resource limits
# a kernel; the time says which kernel to run (next section).

# %%
for heads in [16, 128]:
    cfg = v3.replace(num_heads=heads)
    for sq in [1, 2, 4]:
        f, b = cost(cfg, "absorbed", sq, 65536, batch=BATCH)
        print(f"N = {heads:3d}, Sq = {sq}: absorbed intensity {f / b:6.1f} FLOP/byte "
              f"(1.9·N·Sq = {1.9 * heads * sq:6.1f})")
        assert abs(f / b / (1.9 * heads * sq) - 1) < 0.05
ratio = (v3.num_heads * (2 * v3.qk_nope_head_dim + 2 * v3.v_head_dim + v3.qk_rope_head_dim)
         / v3.latent_dim)
print(f"bytes per cached key, compute-friendly / absorbed at N = 128: {ratio:.0f}x")

# %% [markdown]
# ## Where each form wins
#
# The ratio of roofline times, absorbed over compute-friendly: below 1 the absorbed form is
# faster. Left against the number of queries per request `Sq`, right against `Sq/Skv`. Decode
# and short speculative steps sit far left; a prefill whose queries are a large fraction of the
# keys sits right.

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
crossover = {}
for heads, style in [(16, "--"), (128, "-")]:
    cfg = v3.replace(num_heads=heads)
    for skv in [1024, 8192, 65536]:
        sq_grid = np.unique(np.logspace(0, np.log10(skv), 80).astype(int))
        r = [seconds(cfg, "absorbed", int(s), skv, True, BATCH)
             / seconds(cfg, "compute-friendly", int(s), skv, True, BATCH) for s in sq_grid]
        axes[0].loglog(sq_grid, r, style, label=f"N = {heads}, Skv = {skv}")
        axes[1].loglog(sq_grid / skv, r, style, label=f"N = {heads}, Skv = {skv}")
        above = [int(s) for s, x in zip(sq_grid, r) if x > 1]
        crossover[(heads, skv)] = above[0] if above else None
for ax in axes:
    ax.axhline(1.0, color="black", lw=1)
    ax.legend(fontsize=7)
axes[0].set_xlabel("queries per request, Sq (tokens)")
axes[1].set_xlabel("queries per key, Sq / Skv (ratio)")
axes[0].set_ylabel("time absorbed / time compute-friendly (ratio)")
axes[1].set_ylabel("time absorbed / time compute-friendly (ratio)")
fig.suptitle(f"H200 roofline model, batch of {BATCH}: below 1 the absorbed form wins")
save(fig, "where_each_wins")
for (heads, skv), sq in crossover.items():
    print(f"N = {heads:3d}, Skv = {skv:6d}: compute-friendly wins from Sq ≈ {sq}")

# %% [markdown]
# The crossover hardly moves with `Skv` or `N`. Both forms are compute-bound there, and equating
# their FLOPs per key and head, `Sq·(2·Lkv+R) = Lkv·(P+V) + Sq·(P+R+V)`, gives
#
# $$Sq^* = \frac{L_{kv}(P+V)}{2L_{kv}+R-(P+R+V)} = \frac{512\cdot 256}{768} \approx 171$$
#
# queries, whatever the context length and the head count (causal masking moves it a little).
# Below it, the absorbed form's extra attention FLOPs (`2·Lkv+R = 1088` against `P+R+V = 320`
# per pair and head) cost less than up-projecting every key; above it, they cost more. That is
# why vLLM's MLA backend (vLLM 0.11 `v1/attention/backends/mla/common.py`) runs the new tokens of a
# prefill through the
# compute-friendly form and decode tokens through the absorbed one. What the crossover is on
# real kernels is measured by the benchmarks (`benchmarks/results/`), not by this model.

# %%
N, P, R, V, L = dims(v3)
sq_star = L * (P + V) / (2 * L + R - (P + R + V))
print(f"Sq* = {sq_star:.0f}")
for sq in crossover.values():
    assert abs(sq / sq_star - 1) < 0.2, (sq, sq_star)
for heads in [16, 128]:
    cfg = v3.replace(num_heads=heads)
    f_cf, _ = cost(cfg, "compute-friendly", 4096, 4096, causal=True)
    f_ab, _ = cost(cfg, "absorbed", 4096, 4096, causal=True)
    print(f"N = {heads:3d}, causal prefill of 4096: total FLOPs absorbed / compute-friendly = "
          f"{f_ab / f_cf:.2f}")
