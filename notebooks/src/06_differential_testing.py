# ruff: noqa: E402
# Source of notebooks/06_differential_testing.ipynb (build: python notebooks/build.py).

# %% [markdown]
# # Differential testing: checking a kernel against the reference
#
# A fast attention kernel is trusted when it computes the same tensors as a slow one that is
# obviously right, on inputs chosen to break it. This notebook shows the recipe the package
# uses (conventions §11), runs it on our Triton decode kernel (`mla.fast.mla_decode_paged`,
# executed by Triton's interpreter on the CPU here), looks at the error distributions on
# adversarial inputs, and ends with a checker for *any* kernel that follows FlashMLA's calling
# convention (`flash_mla_with_kvcache`), with deliberately broken kernels to show it catches
# them.

# %%
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # run Triton kernels on the CPU

# %%
import matplotlib.pyplot as plt
from nbhelp import figure_saver  # puts the repository root on sys.path, before `import mla`

from mla import fast
from mla.compare import LSE_ABS_TOL, TOLERANCES, max_abs_err, poison_like, rel_err
from mla.reference import make_block_table, mla_decode_paged

save = figure_saver("06_differential_testing")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
print(f"device {DEVICE}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}")

# %% [markdown]
# ## The recipe
#
# 1. Draw fresh random inputs (never zeros: a kernel that forgets to write returns zeros, and
#    zeros times anything agree).
# 2. Run the kernel in its own dtype; run the reference in **float64** on the same inputs
#    upcast, so that the reference's rounding is negligible next to the kernel's.
# 3. Compare by the relative Frobenius error `‖out − ref‖ / ‖ref‖` (`mla.compare.rel_err`), with
#    a tolerance per input dtype; the log-sum-exp by its largest absolute error.
# 4. NaN never passes, and an infinity must sit where the reference has the same infinity
#    (an empty query's `lse`).
# 5. Where a kernel writes into a buffer it is given, fill the buffer with NaN first
#    (`poison_like`): an element it forgot to write cannot pass for a right one.

# %%
print("tolerances (relative Frobenius, against float64):",
      {str(k).removeprefix("torch."): v for k, v in TOLERANCES.items()},
      f"lse: {LSE_ABS_TOL} absolute")
ref = torch.randn(4, 8, dtype=torch.float64)
print("a NaN anywhere:", rel_err(torch.where(ref > 2, float("nan"), ref), ref))
print("an lse of +inf where the reference has -inf:",
      rel_err(torch.tensor([float("inf"), 1.0]), torch.tensor([float("-inf"), 1.0])))
buffer = poison_like(torch.empty(3, 4))
buffer[:2] = 1.0  # a "kernel" that forgot the last row
print("partly written output vs what it should be:", rel_err(buffer, torch.ones(3, 4)))

# %% [markdown]
# ## Our decode kernel under the interpreter
#
# `mla.fast.mla_decode_paged` has the reference's signature. Inputs with DeepSeek's widths
# (`D = Lkv + R = 576`, `V = Lkv = 512`), 16 heads (DeepSeek-V3 at tensor parallel 8), a page
# size of 64, ragged lengths that are not multiples of the page size (an empty one included),
# two query tokens per request with the causal mask of multi-token prediction. On the CPU the
# interpreter runs float32 and float16; bfloat16 is checked on the GPU, because the
# interpreter's `tl.dot` on bfloat16 is wrong (triton-lang/triton#11584).

# %%
D, DV, HEADS, BLOCK = 576, 512, 16, 64
SCALE = 192 ** -0.5  # DeepSeek's 1/sqrt(P + R): not 1/sqrt(576)


def decode_inputs(lens, s_q, *, q_scale=1.0, dominant=False, seed=0):
    """q [B, s_q, N, D], a paged cache holding len_b rows per request, its block table."""
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = make_block_table(lens, BLOCK, seed=seed)
    q = torch.randn(len(lens), s_q, HEADS, D, generator=gen, dtype=torch.float64) * q_scale
    kv_cache = torch.randn(num_blocks, BLOCK, D, generator=gen, dtype=torch.float64)
    if dominant:  # one key per request aligned with its queries: a near one-hot softmax
        for b, n in enumerate(lens):
            if n:
                j = n // 2
                kv_cache[table[b, j // BLOCK], j % BLOCK] = 8 * q[b].mean(dim=(0, 1))
    return q, kv_cache, table, torch.tensor(lens, dtype=torch.int32)


def check_kernel(kernel, dtype, q, kv_cache, table, seqlens, causal):
    """Errors of ``kernel`` in ``dtype`` against the float64 reference on the upcast inputs."""
    q_k, kv_k = q.to(dtype), kv_cache.to(dtype)
    out, lse = kernel(q_k.to(DEVICE), kv_k.to(DEVICE), table.to(DEVICE), seqlens.to(DEVICE),
                      SCALE, causal=causal, head_dim_v=DV)
    out_ref, lse_ref = mla_decode_paged(q_k.double(), kv_k.double(), table, seqlens, SCALE,
                                        causal=causal, head_dim_v=DV)
    return out.cpu(), out_ref, rel_err(out, out_ref), max_abs_err(lse.cpu(), lse_ref)


inputs = decode_inputs([37, 0, 64, 130, 1], s_q=2)
for dtype in [torch.float32, torch.float16]:
    _, _, err, lse_err = check_kernel(fast.mla_decode_paged, dtype, *inputs, causal=True)
    print(f"fast kernel, {str(dtype):>13}: out rel err {err:.1e} (tol {TOLERANCES[dtype]:.0e}),"
          f" lse max abs err {lse_err:.1e}")
    assert err <= TOLERANCES[dtype] and lse_err <= LSE_ABS_TOL

# %% [markdown]
# ## Error distributions on adversarial inputs
#
# One number per tensor hides where the error sits. Below, the relative error of every output
# row (one per request, query and head) for inputs built to be hard: logits scaled ×30 (a
# sharp softmax, where a missing running-max subtraction overflows), one dominant key, length-1
# contexts, and ragged lengths around the page and tile sizes. For comparison, the reference
# itself run in bfloat16 shows what bf16 rounding of the inputs and output alone costs. Rows
# whose softmax is (numerically) one-hot copy one value row and are exact in every dtype: they
# sit at the plot's floor.

# %%
CASES = {
    "random": dict(lens=[37, 70, 5], s_q=1),
    "logits x30": dict(lens=[37, 70, 5], s_q=1, q_scale=30.0),
    "dominant key": dict(lens=[37, 70, 5], s_q=1, dominant=True),
    "length 1": dict(lens=[1, 1, 1], s_q=1),
    "ragged MTP": dict(lens=[63, 65, 129, 2], s_q=3, causal=True),
}
KERNELS = {
    "fast float32": (fast.mla_decode_paged, torch.float32),
    "fast float16": (fast.mla_decode_paged, torch.float16),
    "reference bfloat16": (mla_decode_paged, torch.bfloat16),
}


def row_errors(out, out_ref):
    diff = (out.double() - out_ref).norm(dim=-1).flatten()
    norm = out_ref.norm(dim=-1).flatten()
    keep = norm > 0  # rows of queries that see no key are zero in both
    return (diff[keep] / norm[keep]).clamp_min(1e-12)


results = {}
for c, (case, spec) in enumerate(CASES.items()):
    spec = dict(spec)
    causal = spec.pop("causal", False)
    data = decode_inputs(**spec, seed=c)
    for name, (kernel, dtype) in KERNELS.items():
        out, out_ref, err, lse_err = check_kernel(kernel, dtype, *data, causal=causal)
        results[(case, name)] = row_errors(out, out_ref)
        assert err <= TOLERANCES[dtype] and lse_err <= LSE_ABS_TOL, (case, name, err, lse_err)
        print(f"{case:>13} | {name:>18}: out rel err {err:.1e}, lse abs err {lse_err:.1e}, "
              f"worst row {results[(case, name)].max():.1e}")

# %%
fig, ax = plt.subplots(figsize=(10, 4.5))
width = 0.25
for k, (name, (_, dtype)) in enumerate(KERNELS.items()):
    data = [results[(case, name)].numpy() for case in CASES]
    pos = [i + (k - 1) * width for i in range(len(CASES))]
    parts = ax.boxplot(data, positions=pos, widths=width * 0.9, patch_artist=True,
                       showfliers=True, flierprops=dict(markersize=2),
                       medianprops=dict(color="black"))
    for box in parts["boxes"]:
        box.set_facecolor(f"C{k}")
    ax.axhline(TOLERANCES[dtype], color=f"C{k}", ls=":", lw=1)
    ax.plot([], [], color=f"C{k}", lw=6, label=f"{name} (dotted line: its tolerance)")
ax.set_xticks(range(len(CASES)), list(CASES))
ax.set_yscale("log")
ax.set_xlabel("input case (DeepSeek widths 576/512, 16 heads, page size 64)")
ax.set_ylabel("relative error per output row (ratio, floor 1e-12)")
ax.set_title("Decode output error against the float64 reference")
ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
save(fig, "error_distributions")

# %% [markdown]
# ## Checking someone else's kernel: FlashMLA's convention
#
# FlashMLA's decode entry point is
#
# ```python
# flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
#                        tile_scheduler_metadata, num_splits, softmax_scale=None, causal=False)
# -> (out [B, s_q, h_q, head_dim_v], softmax_lse [B, h_q, s_q] float32)
# ```
#
# with `k_cache [num_blocks, page_block_size, h_kv = 1, 576]`, `block_table` and
# `cache_seqlens` int32, the metadata from `get_mla_metadata(cache_seqlens, s_q·h_q/h_kv, h_kv)`
# (newer versions take no arguments and fill it on the first call), and a query that sees no
# key returning `out = 0`, `lse = +inf`. `check_flash_mla_kernel` below drives any callable with
# that signature over edge cases, compares with `mla.reference.mla_decode_paged` in float64 and
# returns one row per case. On a GPU machine with FlashMLA installed:
#
# ```python
# from flash_mla import flash_mla_with_kvcache, get_mla_metadata
# rows = check_flash_mla_kernel(flash_mla_with_kvcache, get_mla_metadata, device="cuda")
# ```

# %%
FLASH_CASES = {
    "decode, ragged": dict(lens=[1, 63, 64, 200], s_q=1, causal=False),
    "MTP, causal": dict(lens=[5, 130, 67], s_q=2, causal=True),
    "lonely queries": dict(lens=[0, 1, 9], s_q=2, causal=True),
    "sharp softmax": dict(lens=[100, 3], s_q=1, causal=False, q_scale=30.0),
}


def check_flash_mla_kernel(flash_mla_with_kvcache, get_mla_metadata=None, *, device="cpu",
                           dtype=torch.bfloat16, seed=0):
    """Run ``flash_mla_with_kvcache`` (FlashMLA's signature) on edge cases; one dict per case.

    The reference runs in float64 on the same inputs upcast. A case passes when the output is
    within the dtype's tolerance, the finite lse within ``LSE_ABS_TOL``, and every ``+inf``
    lse (a query that sees no key) is where the reference has one.
    """
    rows = []
    for c, (case, spec) in enumerate(FLASH_CASES.items()):
        spec = dict(spec)
        causal = spec.pop("causal")
        q, kv_cache, table, seqlens = decode_inputs(**spec, seed=seed + c)
        q, kv_cache = q.to(dtype), kv_cache.to(dtype)
        h_kv = 1
        k_cache = kv_cache[:, :, None, :]  # FlashMLA's [num_blocks, page, h_kv, D]
        dev = [t.to(device) for t in (q, k_cache, table, seqlens)]
        meta, splits = (get_mla_metadata(dev[3], q.shape[1] * HEADS // h_kv, h_kv)
                        if get_mla_metadata is not None else (None, None))
        out, lse = flash_mla_with_kvcache(*dev, DV, meta, splits, softmax_scale=SCALE,
                                          causal=causal)
        out_ref, lse_ref = mla_decode_paged(q.double(), kv_cache.double(), table, seqlens,
                                            SCALE, causal=causal, head_dim_v=DV)
        out_err = rel_err(out.cpu(), out_ref)
        lse_err = max_abs_err(lse.cpu(), lse_ref)
        rows.append(dict(case=case, out_rel_err=out_err, lse_abs_err=lse_err,
                         passed=out_err <= TOLERANCES[dtype] and lse_err <= LSE_ABS_TOL))
    return rows


def report(name, rows):
    for r in rows:
        print(f"{name:>22} | {r['case']:>15}: out {r['out_rel_err']:9.1e}  "
              f"lse {r['lse_abs_err']:9.1e}  {'pass' if r['passed'] else 'FAIL'}")
    return all(r["passed"] for r in rows)

# %% [markdown]
# Two kernels that pass: the reference and our Triton kernel behind FlashMLA's signature
# (adapters that drop the `h_kv` axis and ignore the scheduling metadata), and three broken
# ones, each with a classic bug: the default scale `1/sqrt(576)` instead of the one passed,
# FlashAttention's `-inf` for an empty query instead of FlashMLA's `+inf`, and the causal flag
# ignored.

# %%
def as_flash_mla(kernel):
    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                               tile_scheduler_metadata, num_splits, softmax_scale=None,
                               causal=False):
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        return kernel(q, k_cache[:, :, 0], block_table, cache_seqlens, scale, causal=causal,
                      head_dim_v=head_dim_v)
    return flash_mla_with_kvcache


def ignores_scale(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, splits,
                  softmax_scale=None, causal=False):
    return mla_decode_paged(q, k_cache[:, :, 0], block_table, cache_seqlens,
                            q.shape[-1] ** -0.5, causal=causal, head_dim_v=head_dim_v)


def empty_is_minus_inf(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, splits,
                       softmax_scale=None, causal=False):
    out, lse = mla_decode_paged(q, k_cache[:, :, 0], block_table, cache_seqlens, softmax_scale,
                                causal=causal, head_dim_v=head_dim_v)
    return out, torch.where(torch.isposinf(lse), float("-inf"), lse)


def ignores_causal(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, splits,
                   softmax_scale=None, causal=False):
    return mla_decode_paged(q, k_cache[:, :, 0], block_table, cache_seqlens, softmax_scale,
                            causal=False, head_dim_v=head_dim_v)


good = {
    "reference (bfloat16)": check_flash_mla_kernel(as_flash_mla(mla_decode_paged)),
    "fast (float16)": check_flash_mla_kernel(as_flash_mla(fast.mla_decode_paged),
                                             device=DEVICE, dtype=torch.float16),
}
bad = {
    "ignores softmax_scale": check_flash_mla_kernel(ignores_scale),
    "empty lse = -inf": check_flash_mla_kernel(empty_is_minus_inf),
    "ignores causal": check_flash_mla_kernel(ignores_causal),
}
for name, rows in good.items():
    assert report(name, rows), name
for name, rows in bad.items():
    assert not report(name, rows), f"the checker missed the bug of {name!r}"
