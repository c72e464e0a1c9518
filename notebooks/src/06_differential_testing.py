# ruff: noqa: E402
# Source of notebooks/06_differential_testing.ipynb (build: python notebooks/build.py).

# %% [markdown]
# # Differential testing: checking a kernel against the reference
#
# A fast attention kernel is trusted when it computes the same tensors as a slow one that is
# obviously right, on inputs chosen to break it. The package does this for any kernel with
# `mla.conformance`: a catalogue of named cases, each pinning one convention or edge, run
# against the float64 reference. This notebook shows what a case is, runs a few on our Triton
# decode kernel (`mla.fast.mla_decode_paged`, executed by Triton's interpreter on the CPU
# here), looks at the error of every output row on adversarial inputs, and checks a kernel
# written by hand, with three deliberately broken versions of it, each of which the library
# catches and names.

# %%
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # run Triton kernels on the CPU

# %%
import functools
import time

import matplotlib.pyplot as plt
from nbhelp import figure_saver  # puts the repository root on sys.path, before `import mla`

import mla.fast
import mla.reference
from mla.conformance import CATALOGUE, Setting, limit, run
from mla.conformance.cases.decode import DecodeSpec, decode_trial
from mla.conformance.diagnose import measure

save = figure_saver("06_differential_testing")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
print(f"device {DEVICE}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}")

# %% [markdown]
# ## The recipe, and what a case is
#
# 1. Draw fresh random inputs (never zeros: a kernel that forgets to write returns zeros, and
#    zeros times anything agree). Fill every cache row no request uses with NaN, and point
#    unused block-table entries at a page of NaN: a read past a length shows up as NaN.
# 2. Run the kernel in its own dtype; run the reference in **float64** on upcast copies of
#    exactly the kernel's inputs, so that the reference's rounding is negligible.
# 3. Poison what the kernel allocates (NaN): an element it forgot to write cannot pass.
# 4. Compare the output by its relative Frobenius error `‖out − ref‖ / ‖ref‖` and the
#    log-sum-exp by its largest absolute error, each against a budget per kernel and input dtype
#    (about twice the worst error our kernels measure over many seeds; `1e-12` for float64).
#    NaN never passes, and an infinity must sit where the reference has the same infinity.
#
# A **case** packs one such experiment under a name: a function that builds the inputs for a
# device and dtype and returns a `Trial` (a way to call a kernel, the reference's outputs, the
# error each output is held to). Its docstring says which convention or edge it pins; its
# `topic` groups the cases of one convention. `mla.conformance.CATALOGUE` holds them all.

# %%
for key in ["mla_decode_paged/causal_s_q_2", "mla_decode_paged/empty_request",
            "mla_decode_paged/scale_deepseek"]:
    c = CATALOGUE[key]
    print(f"{c.kernel} / {c.name}  (topic {c.topic!r})\n    {c.doc}")
decode_cases = [c for c in CATALOGUE.values() if c.kernel == "mla_decode_paged"]
print(f"\n{len(decode_cases)} cases of mla_decode_paged, topics:",
      sorted({c.topic for c in decode_cases}))

trial = CATALOGUE["mla_decode_paged/causal_s_q_2"].build(
    Setting(torch.device("cpu"), torch.float32, small=True))
print("\nthe trial's reference outputs:",
      {k: (list(v.shape), str(v.dtype)) for k, v in trial.expected.items()})
print("held to:", {k: f"{q} <= {limit('mla_decode_paged', torch.float32, q):.1e}"
                   for k, q in trial.quantities.items()})
print("conventions it can name when a kernel fails:", *trial.alternatives, sep="\n    ")

# %% [markdown]
# The measure itself: a NaN anywhere, or an `lse` of `-inf` where the reference has `+inf`, is
# an infinite error.

# %%
ref = torch.randn(4, 8, dtype=torch.float64)
print("out with a NaN:", measure("out_rel", torch.where(ref > 2, float("nan"), ref), ref))
print("lse -inf for +inf:", measure("lse_abs", torch.tensor([float("-inf"), 1.0]),
                                    torch.tensor([float("inf"), 1.0])))
print("a float32 copy:", measure("out_rel", ref.float(), ref))

# %% [markdown]
# ## Our decode kernel under the interpreter
#
# `mla.fast` has the reference's kernel names and signatures, so the module itself is a
# target. One case per topic, in float32 (on the CPU the interpreter runs float32 and float16;
# bfloat16 is checked on the GPU, because the interpreter's `tl.dot` on bfloat16 multiplies
# bit patterns: triton-lang/triton#11584). Without `cases=` the run takes every case.

# %%
FAST_CASES = ["deepseek_v3_tp8", "heads_3", "page_16", "length_page_edges", "causal_s_q_3",
              "non_causal_s_q_2", "empty_request", "nan_tail_of_last_page", "scale_deepseek",
              "sharp_softmax"]
t0 = time.perf_counter()
report = run(mla.fast, kernels=["mla_decode_paged"], cases=FAST_CASES, device=DEVICE,
             dtype=torch.float32)
print(report.to_text())
print(f"({time.perf_counter() - t0:.1f} s)")
assert report.passed

# %% [markdown]
# The rows are plain objects, so a table needs no library:

# %%
print(f"{'case':24s} {'topic':11s} {'out rel err':>12s} {'budget':>8s} {'lse abs err':>12s}"
      f" {'budget':>8s}")
for r in report.rows:
    print(f"{r.case:24s} {r.topic:11s} {r.errors['out']:12.1e} {r.limits['out']:8.0e} "
          f"{r.errors['lse']:12.1e} {r.limits['lse']:8.0e}")

# %% [markdown]
# ## Error distributions on adversarial inputs
#
# One number per tensor hides where the error sits. Below, the relative error of every output
# row (one per request, query and head) on inputs built to be hard, made by the same function
# the cases use (`decode_trial`): logits scaled ×30 (a sharp softmax, where a missing
# running-max subtraction overflows), one dominant key, length-1 contexts, and ragged lengths
# around the page size with three causal queries. For comparison, the reference itself run in
# bfloat16 shows what bfloat16 arithmetic alone costs. Rows whose softmax is (numerically)
# one-hot copy one value row and are exact in every dtype: they sit at the plot's floor.

# %%
ADVERSARIAL = {
    "random": DecodeSpec((37, 70, 5)),
    "logits x30": DecodeSpec((37, 70, 5), q_gain=30.0),
    "dominant key": DecodeSpec((37, 70, 5), dominant=True),
    "length 1": DecodeSpec((1, 1, 1)),
    "ragged MTP": DecodeSpec((63, 65, 129, 2), s_q=3, causal=True),
}
KERNELS = {
    "fast float32": (mla.fast.mla_decode_paged, torch.float32, DEVICE),
    "fast float16": (mla.fast.mla_decode_paged, torch.float16, DEVICE),
    "reference bfloat16": (mla.reference.mla_decode_paged, torch.bfloat16, "cpu"),
}


def row_errors(out, out_ref):
    diff = (out.cpu().double() - out_ref).norm(dim=-1).flatten()
    norm = out_ref.norm(dim=-1).flatten()
    keep = norm > 0  # rows of queries that see no key are zero in both
    return (diff[keep] / norm[keep]).clamp_min(1e-12)


results = {}
for salt, (case_name, spec) in enumerate(ADVERSARIAL.items(), start=100):
    for name, (kernel, dtype, device) in KERNELS.items():
        trial = decode_trial(Setting(torch.device(device), dtype, small=True), spec, salt)
        got = trial.invoke(kernel)
        err = {k: measure(q, got[k], trial.expected[k]) for k, q in trial.quantities.items()}
        results[(case_name, name)] = row_errors(got["out"], trial.expected["out"])
        print(f"{case_name:>12} | {name:>18}: out rel err {err['out']:.1e}, lse abs err "
              f"{err['lse']:.1e}, worst row {results[(case_name, name)].max():.1e}")
        if kernel is mla.fast.mla_decode_paged:  # the budgets are our kernel's
            assert all(err[k] <= limit("mla_decode_paged", dtype, q)
                       for k, q in trial.quantities.items()), (case_name, name, err)

# %%
fig, ax = plt.subplots(figsize=(10, 4.5))
width = 0.25
for k, (name, (_, dtype, _)) in enumerate(KERNELS.items()):
    data = [results[(case_name, name)].numpy() for case_name in ADVERSARIAL]
    pos = [i + (k - 1) * width for i in range(len(ADVERSARIAL))]
    parts = ax.boxplot(data, positions=pos, widths=width * 0.9, patch_artist=True,
                       showfliers=True, flierprops=dict(markersize=2),
                       medianprops=dict(color="black"))
    for box in parts["boxes"]:
        box.set_facecolor(f"C{k}")
    ax.axhline(limit("mla_decode_paged", dtype, "out_rel"), color=f"C{k}", ls=":", lw=1)
    ax.plot([], [], color=f"C{k}", lw=6,
            label=f"{name} (dotted: the fast kernel's {str(dtype)[6:]} budget)")
ax.set_xticks(range(len(ADVERSARIAL)), list(ADVERSARIAL))
ax.set_yscale("log")
ax.set_xlabel("input case (DeepSeek widths 576/512, 16 heads, page size 64)")
ax.set_ylabel("relative error per output row (ratio, floor 1e-12)")
ax.set_title("Decode output error against the float64 reference")
ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
save(fig, "error_distributions")

# %% [markdown]
# ## Checking your own kernel
#
# A target is anything that maps the reference's kernel names to callables: a module, or a
# plain dict. Here is a paged decode written directly in PyTorch, one loop over requests, with
# the reference's signature and conventions: `out [B, s_q, N, head_dim_v]`, `lse [B, N, s_q]`
# in the natural log, `out = 0` and `lse = +inf` for a query that sees no key, and with
# `causal`, the `Sq` new tokens (`s_q`) are the last of the request's `Skv` keys
# (`cache_seqlens` counts them) and the query at position `t`, one of `Skv − Sq, …, Skv − 1`,
# sees the keys `s ≤ t`.
# A `bug` switch turns it into three classic broken kernels:
#
# - `"scale"`: uses `1/sqrt(576)`, the usual default for a head dimension of 576, instead of the
#   scale passed. DeepSeek's scale `τ` comes from the MHA form: `1/√192` without YaRN,
#   `λ²/√192 = 0.1352` for DeepSeek-V3 (`λ` is YaRN's logit factor, `MLAConfig.mscale`).
# - `"empty_lse"`: returns what `torch.logsumexp` gives over no keys, `-inf`. FlashAttention-3
#   does the same; FlashAttention-2 and FlashMLA write `+inf` (vLLM PR #15492 made
#   `merge_attn_states` accept both). Empty rows a merge does not expect still turned into
#   NaN in vLLM's MLA chunked prefill (issue #27491); PR #49294 marks them before merging.
# - `"causal"`: the causal mask off by one (`<` for `<=`): query `i` sees one key too few.
#
# The run is in float64 on the CPU, where the budget is `1e-12`: a correct float64 kernel
# differs from the reference only in the order of its sums.

# %%
def my_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal=False,
              head_dim_v=512, bug=None):
    B, s_q, N, D = q.shape
    page = kv_cache.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros(B, s_q, N, head_dim_v)
    lse = q.new_full((B, N, s_q), float("inf"), dtype=acc)
    scale = D ** -0.5 if bug == "scale" else softmax_scale
    for b, L in enumerate(cache_seqlens.tolist()):
        pos = torch.arange(L, device=q.device)
        rows = kv_cache[block_table[b, pos // page].long(), pos % page].to(acc)  # [L, D]
        logits = torch.einsum("snd,ld->snl", q[b].to(acc), rows) * scale
        if causal:
            last = L - s_q + torch.arange(s_q, device=q.device)  # query i's last key
            if bug == "causal":
                last = last - 1
            logits = logits.masked_fill(pos > last[:, None, None], float("-inf"))
        m = logits.logsumexp(-1)  # [s_q, N]; -inf for a query that sees no key
        empty = torch.isneginf(m)  # (not ~isfinite: a NaN input must stay NaN)
        p = torch.where(empty[..., None], 0.0, torch.exp(logits - m[..., None]))
        out[b] = torch.einsum("snl,lv->snv", p, rows[:, :head_dim_v]).to(q.dtype)
        lse[b] = (m if bug == "empty_lse" else torch.where(empty, float("inf"), m)).T
    return out, lse


CHECK_CASES = ["length_page_edges", "scale_deepseek", "empty_request", "empty_causal_queries",
               "causal_s_q_2", "non_causal_s_q_2"]


def check(target, name):
    return run(target, kernels=["mla_decode_paged"], cases=CHECK_CASES, device="cpu",
               dtype=torch.float64, name=name)


t0 = time.perf_counter()
for target, name in [(mla.reference, "mla.reference"),
                     ({"mla_decode_paged": my_decode}, "my_decode")]:
    good = check(target, name)
    print(good.summary())
    assert good.passed, good.to_text()

# the cases each bug must fail, and words of the convention the library must name
EXPECTED = {
    "scale": ({"scale_deepseek"}, "1/sqrt(576)"),
    "empty_lse": ({"empty_request", "empty_causal_queries"}, "-inf for a query that sees no key"),
    "causal": ({"causal_s_q_2", "empty_causal_queries"}, "causal mask off by one"),
}
for bug, (cases, words) in EXPECTED.items():
    broken = check({"mla_decode_paged": functools.partial(my_decode, bug=bug)},
                   f"my_decode, bug={bug!r}")
    failed = [r for r in broken.rows if r.status != "pass"]
    print(f"\n{broken.summary()}")
    for r in failed:
        print(f"  {r.case}: {r.convention}")
    assert not broken.passed and {r.case for r in failed} == cases, [r.case for r in failed]
    assert all(words in r.convention for r in failed), [r.convention for r in failed]
print(f"\n({time.perf_counter() - t0:.1f} s)")

# %% [markdown]
# Besides the convention, a failing row says where the output is wrong (the worst element's
# indices, where NaN or infinities appeared); here the last report, the causal bug's.
# `report.to_markdown()` and `report.to_json()` give the same rows for a file.

# %%
print(broken.to_text())

# %% [markdown]
# ## Past the catalogue: a fuzz run that finds and shrinks a planted bug
#
# A catalogue holds the corners its authors thought of. `mla.conformance.fuzz` searches a
# kernel's whole input space with hypothesis (odd head counts, ragged lengths with 0, 1 and
# page edges, `-1` anywhere, sinks, NaN in unused rows, sharp and flat softmaxes), judges every
# example with the catalogue's budgets and diagnosis, and shrinks a failure to a minimal input,
# printed as a runnable snippet. Here the planted bug: a sparse decode that reads a `-1` entry
# as slot 0 instead of dropping it. (`mla conform --target T --kernels K --fuzz 300s` is the
# same from the shell; failures are kept in an example database, so the next run tries them
# first.)

# %%
import tempfile

from mla.conformance import KERNELS
from mla.conformance.fuzz import fuzz


def decode_reads_minus_one(q, kv_cache, indices, *args, **kwargs):
    """sparse_mla_decode with the planted bug: -1 entries read slot 0."""
    return mla.reference.sparse_mla_decode(q, kv_cache, indices.clamp(min=0), *args, **kwargs)


planted = {k: getattr(mla.reference, k) for k in KERNELS}
planted["sparse_mla_decode"] = decode_reads_minus_one
t0 = time.perf_counter()
with tempfile.TemporaryDirectory() as db:
    report = fuzz(planted, "sparse_mla_decode", examples=40, dtype=torch.float64, database=db)
print(f"{report.failures[0].convention}  ({time.perf_counter() - t0:.1f} s)\n")
print(report.failures[0].snippet)
assert not report.passed and "-1" in report.failures[0].convention

# %% [markdown]
# ## Properties a kernel must keep whatever its error
#
# Budgets bound how far a kernel may be from the reference; some promises are exact. A server
# that wants the same answer for a request whatever else is in the batch needs *batch
# invariance*: the request's bits the same alone and in any batch. `run(..., properties=...)`
# (`mla conform --properties batch_invariance`) holds the decodes' cases to it, bit for bit.
# Planted here: a decode within every budget whose last bits follow the batch's size, as a
# kernel's do when its split of the keys follows the batch. It passes the catalogue's cases and
# fails them once held to the property. (On a GPU this found FlashMLA's `enable_batch_invariant`
# dense decode not batch invariant: vLLM 0.33's interface never hands the flag to that kernel.)

# %%
from mla.conformance import run


def decode_follows_batch(q, *args, **kwargs):
    """mla_decode_paged within every budget, its last bits following the batch's size."""
    out, lse = mla.reference.mla_decode_paged(q, *args, **kwargs)
    return out * (1 + 2.0 ** -44 * q.shape[0]), lse


twin = {"mla_decode_paged": decode_follows_batch}
pick = dict(kernels=["mla_decode_paged"], cases=["length_page_edges"], device="cpu",
            dtype=torch.float64)
print("budgets only:        ", run(twin, **pick).rows[0].status)
held = run(twin, properties="batch_invariance", **pick).rows[0]
print("with batch invariance:", held.status, "-", held.convention)
assert held.status == "fail" and held.convention.startswith("not batch invariant")

# %% [markdown]
# ## Other people's kernels, on a GPU
#
# The same catalogue runs on FlashMLA, vLLM's Triton MLA decode, vLLM's CUDA top-k and cache
# kernels, DeepGEMM's indexer logits and FlashInfer through adapters
# (`mla.conformance.adapters`) that only change layouts, never values, so a convention the peer
# does not share shows up as a failing case that names it (on the H200, vLLM's top-k fails the
# tie rule; its cache writes and DeepGEMM's logits pass every case they take). On a GPU
# machine with the peers unpacked (`python -m benchmarks.peers --topk --deepgemm`):
#
# ```bash
# mla conform --target flashmla --out flashmla.md      # exit status 1 on any failure
# ```
#
# or from Python:
#
# ```python
# from mla.conformance import run
# from mla.conformance.targets import load_target
#
# report = run(load_target("flashmla")[1])    # CUDA, bfloat16 by default
# print(report.to_text())
# ```
