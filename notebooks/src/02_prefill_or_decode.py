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
# heads `N` (the symbols of the table at the top of `papers/derivation.md`), checks the FLOP
# counts against PyTorch's own count of the reference code, and places both on the H200
# roofline to see where each wins. The ceilings are those measured on
# this project's H200 by the benchmarks (`benchmarks/results/`: a device-to-device copy at
# 4.22-4.25 TB/s and a dense bf16 matmul at 673-701 TFLOP/s), rounded to 4.25 TB/s and
# 700 TFLOP/s: a ridge of about 165 FLOP/byte. NVIDIA's datasheet for the H200 SXM says
# 4.8 TB/s and 989 TFLOP/s (dense bf16): a ridge of about 206 FLOP/byte. Both are printed
# below; the figures use the measured one.

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
DATASHEET_RIDGE = 989e12 / 4.8e12  # H200 SXM datasheet: dense bf16 FLOP/s over HBM bytes/s
ELEM = 2  # bytes per number in bf16
print(f"ridge point: {RIDGE:.0f} FLOP/byte from the measured ceilings, "
      f"{DATASHEET_RIDGE:.0f} FLOP/byte from the datasheet's")
assert round(RIDGE) == 165 and round(DATASHEET_RIDGE) == 206  # the numbers the text quotes

# %% [markdown]
# ## The cost model
#
# With `π` the (query, key) pairs that are computed (the code's `pairs`: `Sq·Skv`, or
# `Sq·Skv − Sq(Sq−1)/2` for a causal kernel that skips masked tiles) and two FLOPs per
# multiply-add of a matrix product, the FLOPs `F_cf` and `F_abs` of the two forms are the sums
# of the columns:
#
# | | compute-friendly, `F_cf` | absorbed, `F_abs` |
# | --- | --- | --- |
# | projections | keys up: `2·Skv·Lkv·N·(P+V)` | queries, outputs: `2·Sq·N·Lkv·(P+V)` |
# | attention | `2·π·N·(P+R+V)` | `2·π·N·(2·Lkv+R)` |
#
# Bytes, for kernels that read and write each tensor once in bf16: both read the cached rows
# `Skv·(Lkv+R)` of every request and, once per batch of requests, the weights `W_UK`, `W_UV`
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
# FLOP/byte with the measured ceilings, `989e12 / 4.8e12 ≈ 206` with the datasheet's: the
# dotted and dashed lines) is limited by memory bandwidth, above it by the tensor cores. Below,
# DeepSeek-V3's
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
    ax.axvline(DATASHEET_RIDGE, color="gray", ls="--", lw=1)
    ax.text(RIDGE * 0.9, 6, f"ridge {RIDGE:.0f} (measured)", color="gray", fontsize=8,
            ha="right")
    ax.text(DATASHEET_RIDGE * 1.1, 6, f"{DATASHEET_RIDGE:.0f} (datasheet)", color="gray",
            fontsize=8)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_title(f"N = {heads} heads, batch of {BATCH}, Skv = {SKV}")
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
# `(2·Lkv+R)/(Lkv+R)·N·Sq = 1088/576·N·Sq ≈ 1.89·N·Sq` FLOP/byte (`docs/kernels.md`): with 16
# heads (about 30 at `Sq = 1`) far below either ridge, memory-bound; with 128 heads (about 242)
# above both the measured ridge (165) and the datasheet's (206), compute-bound, and more so at
# larger `Sq` (the figure's point for `Sq = 1`, at 208, is lower than 242 because 8192 keys
# are few enough for the per-query tensors and the weights to count; the cell below uses
# 65536). The compute-friendly form sits on the flat roof at every `Sq`,
# but not because it is efficient: each step it re-up-projects every cached key
# (`2·Lkv·N·(P+V)` FLOPs per key, for one query or four thousand), and it also moves
# `N·(2P+2V+R)` numbers per key instead of `Lkv + R`. The roofline says which resource limits
# a kernel; the time says which kernel to run (next section).

# %%
N, P, R, V, L = dims(v3)
per_head_query = (2 * L + R) / (L + R)  # FLOP per cached byte, per head and query: 1.89
for heads in [16, 128]:
    cfg = v3.replace(num_heads=heads)
    for sq in [1, 2, 4]:
        f, b = cost(cfg, "absorbed", sq, 65536, batch=BATCH)
        bound = "compute" if f / b > max(RIDGE, DATASHEET_RIDGE) else (
            "memory" if f / b < min(RIDGE, DATASHEET_RIDGE) else "depends on the ridge")
        print(f"N = {heads:3d}, Sq = {sq}: absorbed intensity {f / b:6.1f} FLOP/byte "
              f"(1.89·N·Sq = {per_head_query * heads * sq:6.1f}): {bound}-bound")
        assert abs(f / b / (per_head_query * heads * sq) - 1) < 0.05
        assert bound == ("memory" if heads == 16 else "compute")  # as the text says
ratio = (v3.num_heads * (2 * v3.qk_nope_head_dim + 2 * v3.v_head_dim + v3.qk_rope_head_dim)
         / v3.latent_dim)
print(f"bytes per cached key, compute-friendly / absorbed at N = 128: {ratio:.0f}x")

# %% [markdown]
# ## Where each form wins
#
# The ratio of roofline times, absorbed over compute-friendly: below 1 the absorbed form is
# faster. Left against the number of queries per request `Sq`, right against `Sq/Skv`. Decode
# and short speculative steps sit far left; a prefill whose queries are a large fraction of the
# keys sits right. `first_sq` finds where the ratio crosses 1 by bisection on `Sq`.

# %%
def first_sq(absorbed_loses, hi):
    """The smallest integer Sq in [1, hi] where ``absorbed_loses(Sq)`` holds (false, then true)."""
    lo = 1
    assert not absorbed_loses(lo) and absorbed_loses(hi), "no single crossover in [1, hi]"
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if absorbed_loses(mid) else (mid, hi)
    return hi


def time_crossover(cfg, skv):
    return first_sq(lambda sq: seconds(cfg, "absorbed", sq, skv, True, BATCH)
                    > seconds(cfg, "compute-friendly", sq, skv, True, BATCH), skv)


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
        crossover[(heads, skv)] = time_crossover(cfg, skv)
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
    print(f"N = {heads:3d}, Skv = {skv:6d}: compute-friendly wins from Sq = {sq}")

# %% [markdown]
# The crossover does not move with `N` and moves little with `Skv`. Both forms are
# compute-bound there, so it is where their FLOPs are equal. With every pair computed
# (`π = Sq·Skv`), setting `F_cf = F_abs` and dividing by `2·N·Skv` gives
#
# $$L_{kv}(P+V) + S_q(P+R+V) = \frac{S_q}{S_{kv}}\,L_{kv}(P+V) + S_q(2L_{kv}+R),$$
#
# whose solution, the exact crossover `S_q^*`, is a harmonic sum:
#
# $$\frac{1}{S_q^*} = \frac{1}{S_q^\infty} + \frac{1}{S_{kv}}, \qquad
#   S_q^\infty = \frac{L_{kv}(P+V)}{2L_{kv}+R-(P+R+V)} = \frac{512\cdot 256}{768} \approx 171 .$$
#
# The term `1/Skv` comes from the absorbed form's own projections, `2·Sq·N·Lkv·(P+V)` FLOPs for
# the queries and the outputs. Dropping it gives the usual approximation `S_q^* ≈ S_q^∞ ≈ 171`,
# the same for every context length and head count, which the exact crossover approaches from
# below as `Skv` grows: about 146 queries at `Skv = 1024`, 167 at 8192 and 170 at 65536 (the
# approximation is too large by the factor `1 + S_q^∞/Skv`). A causal kernel that skips the
# masked pairs computes fewer of the absorbed form's expensive ones, which moves the crossover
# up a little.
# Below the crossover, the absorbed form's extra attention FLOPs (`2·Lkv+R = 1088` against
# `P+R+V = 320` per pair and head) cost less than up-projecting every key; above it, they cost
# more. That is why vLLM's MLA backend (vLLM 0.11 `v1/attention/backends/mla/common.py`) runs
# the new tokens of a prefill through the compute-friendly form and decode tokens through the
# absorbed one. What the crossover is on real kernels is measured by the benchmarks
# (`benchmarks/results/`), not by this model.
#
# The table below computes the crossover three ways: the formula, bisection on the FLOP model
# (`cost`, checked against PyTorch's count above) with all pairs and with causal pairs, and
# the roofline times of the figure (causal, both head counts).

# %%
N, P, R, V, L = dims(v3)
sq_star_inf = L * (P + V) / (2 * L + R - (P + R + V))


def sq_star_exact(skv):
    """Where the FLOPs of the two forms are equal with every pair computed (real-valued)."""
    return 1 / (1 / sq_star_inf + 1 / skv)


def flop_crossover(cfg, skv, causal):
    return first_sq(lambda sq: cost(cfg, "absorbed", sq, skv, causal)[0]
                    > cost(cfg, "compute-friendly", sq, skv, causal)[0], skv)


print(f"approximation: S_q^inf = {sq_star_inf:.1f}")
print(f"{'Skv':>6} | {'formula':>7} | {'FLOPs, all pairs':>16} | {'FLOPs, causal':>13} | "
      f"{'time N = 16':>11} | {'time N = 128':>12}")
for skv in [1024, 8192, 65536]:
    exact = sq_star_exact(skv)
    all_pairs = flop_crossover(v3, skv, causal=False)
    causal = flop_crossover(v3, skv, causal=True)
    print(f"{skv:>6} | {exact:7.1f} | {all_pairs:>16} | {causal:>13} | "
          f"{crossover[(16, skv)]:>11} | {crossover[(128, skv)]:>12}")
    assert all_pairs == int(np.floor(exact)) + 1  # the first integer past the formula's root
    assert exact < causal < sq_star_inf + 2  # causal masking moves it up a little
    assert crossover[(16, skv)] == crossover[(128, skv)] == causal  # compute-bound: FLOPs decide
assert round(sq_star_inf) == 171
assert [round(sq_star_exact(skv)) for skv in [1024, 8192, 65536]] == [146, 167, 170]

# %%
skv_grid = np.unique(np.logspace(np.log10(256), np.log10(131072), 40).astype(int))
fig, ax = plt.subplots(figsize=(7, 4))
ax.semilogx(skv_grid, [sq_star_exact(int(s)) for s in skv_grid], label="all pairs (exact)")
ax.semilogx(skv_grid, [flop_crossover(v3, int(s), causal=True) for s in skv_grid], "--",
            label="causal pairs (bisection on the FLOP model)")
ax.axhline(sq_star_inf, color="black", lw=1, ls=":",
           label=f"S_q^inf (the approximation), {sq_star_inf:.0f}")
ax.set_xlabel("keys per request, Skv (tokens)")
ax.set_ylabel("crossover S_q* (tokens)")
ax.set_title("Queries per request above which the compute-friendly form is cheaper")
ax.legend(fontsize=8)
save(fig, "crossover_against_context")

# %%
for heads in [16, 128]:
    cfg = v3.replace(num_heads=heads)
    f_cf, _ = cost(cfg, "compute-friendly", 4096, 4096, causal=True)
    f_ab, _ = cost(cfg, "absorbed", 4096, 4096, causal=True)
    print(f"N = {heads:3d}, causal prefill of 4096: total FLOPs absorbed / compute-friendly = "
          f"{f_ab / f_cf:.2f}")
