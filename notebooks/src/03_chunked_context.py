# ruff: noqa: E402
# Source of notebooks/03_chunked_context.ipynb (build: python notebooks/build.py).

# %% [markdown]
# # Chunked context: attention in pieces, merged through the log-sum-exp
#
# A prefill with a long cached context cannot up-project all of the context's keys at once:
# `k [C, N, P+R]` and `v [C, N, V]` for 128K tokens and 128 heads are 10 GB in bf16. The
# compute-friendly path of vLLM (vLLM's "chunked prefill") therefore walks the context in
# chunks of at most `MCC` tokens through a fixed workspace and merges the partial attentions.
# This notebook derives the merge, draws the chunk plan, checks that the chunked prefill equals
# the one-shot one for every chunk size, and plots the workspace size against the context.

# %%
import matplotlib.pyplot as plt
import torch
from nbhelp import figure_saver  # puts the repository root on sys.path, before `import mla`

from mla import MLAWeights, get_config
from mla.compare import TOLERANCES, assert_close, rel_err
from mla.reference import (
    attention_with_lse,
    chunked_prefill_forward,
    make_block_table,
    merge_attn_states,
    merge_attn_states_list,
    naive_forward,
    plan_context_chunks,
    workspace_size,
    write_context,
)

save = figure_saver("03_chunked_context")
torch.manual_seed(0)
TOL = TOLERANCES[torch.float64]

# %% [markdown]
# ## The merge, derived
#
# For one query and head, with scaled logits `ℓ_s` over the keys `𝒦` it sees (the symbols of
# the table at the top of `papers/derivation.md`), attention returns
#
# $$\mathrm{lse} = \ln \sum_{s\in \mathcal{K}} e^{\ell_s}, \qquad
#   o = \sum_{s\in \mathcal{K}} e^{\ell_s - \mathrm{lse}}\, v_s .$$
#
# Split `𝒦` into two disjoint parts `𝒦_1 ∪ 𝒦_2`, with `(o_1, lse_1)` and `(o_2, lse_2)` the
# attention over each. The normaliser is a sum, so it splits: `e^{lse} = e^{lse_1} + e^{lse_2}`.
# The output is a sum weighted by `e^{ℓ_s}`, so
#
# $$o = \frac{e^{\mathrm{lse}_1} o_1 + e^{\mathrm{lse}_2} o_2}{e^{\mathrm{lse}_1} +
#   e^{\mathrm{lse}_2}}, \qquad \mathrm{lse} = \ln\left(e^{\mathrm{lse}_1} +
#   e^{\mathrm{lse}_2}\right).$$
#
# Computed as written this overflows for large logits; subtracting `m = max(lse_1, lse_2)`
# from every exponent changes nothing and keeps every exponential in `(0, 1]`:
#
# $$o = \frac{e^{\mathrm{lse}_1 - m} o_1 + e^{\mathrm{lse}_2 - m} o_2}
#   {e^{\mathrm{lse}_1 - m} + e^{\mathrm{lse}_2 - m}}, \qquad
#   \mathrm{lse} = m + \ln\left(e^{\mathrm{lse}_1 - m} + e^{\mathrm{lse}_2 - m}\right).$$
#
# This is the online softmax of Milakov and Gimelshein (2018) applied to whole blocks, the
# combine step of FlashAttention's split-KV and of Flash-Decoding, and vLLM's
# `merge_attn_states` (`mla.reference.merge_attn_states`). An empty part has `lse = −∞` (the log
# of an empty sum); FlashMLA writes `+∞` for it instead, for which the formula would compute
# `e^{+∞ − (+∞)}`, NaN. So the merge first maps `+∞` to `−∞` (both mean "no keys"): an empty
# part then has weight `e^{−∞} = 0` and its `o` is never read. When both parts are empty there
# is no finite `m` to subtract (`−∞ − (−∞)` is NaN too), and the merge defines the result:
# `o = 0`, `lse = −∞`.

# %%
Sq, Skv, N, head_dim = 5, 50, 3, 16
q, k, v = (torch.randn(Sq, N, head_dim, dtype=torch.float64),
           torch.randn(Skv, N, head_dim, dtype=torch.float64),
           torch.randn(Skv, N, head_dim, dtype=torch.float64))
scale = head_dim ** -0.5
o_all, lse_all = attention_with_lse(q, k, v, scale)

cut = 17
o_a, lse_a = attention_with_lse(q, k[:cut], v[:cut], scale)
o_b, lse_b = attention_with_lse(q, k[cut:], v[cut:], scale)
o_ab, lse_ab = merge_attn_states(o_a, lse_a, o_b, lse_b)
print(f"two halves merged vs all keys at once: o rel err {rel_err(o_ab, o_all):.1e}, "
      f"lse rel err {rel_err(lse_ab, lse_all):.1e}")
assert_close(o_ab, o_all, TOL)
assert_close(lse_ab, lse_all, TOL)

# by hand, the stable formula above (both parts have keys): the package's merge is this
m = torch.maximum(lse_a, lse_b)
w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
o_hand = (w_a.T[..., None] * o_a + w_b.T[..., None] * o_b) / (w_a + w_b).T[..., None]
assert_close(o_hand, o_all, TOL)

# %% [markdown]
# The merge is associative and commutative, so the keys may be cut anywhere, into any number of
# pieces, merged in any order: sequentially as they stream in (the online softmax) or all at
# once (`merge_attn_states_list`). Empty pieces pass through.

# %%
cuts = [0, 3, 3, 20, 21, 44, Skv]  # one empty piece, one of a single key
parts = [attention_with_lse(q, k[a:b], v[a:b], scale) for a, b in zip(cuts, cuts[1:])]
o_run, lse_run = parts[0]
for o_p, lse_p in parts[1:]:
    o_run, lse_run = merge_attn_states(o_run, lse_run, o_p, lse_p)  # streaming
o_one, lse_one = merge_attn_states_list([p[0] for p in parts], [p[1] for p in parts])
o_rev, lse_rev = merge_attn_states_list([p[0] for p in parts[::-1]], [p[1] for p in parts[::-1]])
for name, (o_x, lse_x) in {"streaming": (o_run, lse_run), "one pass": (o_one, lse_one),
                           "reversed": (o_rev, lse_rev)}.items():
    print(f"{name:>10}: o rel err {assert_close(o_x, o_all, TOL):.1e}, "
          f"lse rel err {assert_close(lse_x, lse_all, TOL):.1e}")
print("lse of the empty piece:", parts[1][1][0, 0].item())

# the rules for empty parts: +inf means "no keys" too, and two empty parts give o = 0, lse = -inf
empty_o = torch.full_like(o_a, float("nan"))  # an empty part's output is never read
for empty_lse in [float("inf"), float("-inf")]:
    o_x, lse_x = merge_attn_states(o_a, lse_a, empty_o, torch.full_like(lse_a, empty_lse))
    assert torch.equal(o_x, o_a) and torch.equal(lse_x, lse_a)  # passed through bit for bit
o_none, lse_none = merge_attn_states(empty_o, torch.full_like(lse_a, float("inf")), empty_o,
                                     torch.full_like(lse_a, float("-inf")))
assert (o_none == 0).all() and torch.isneginf(lse_none).all()
print("an empty part (lse +inf or -inf, output NaN) passes the other through; two give o = 0, "
      "lse = -inf")

# %% [markdown]
# Large logits are where the stable form matters: with the queries scaled by 30 the naive
# `e^{lse}` overflows float32, the merge does not.

# %%
q32, k32, v32 = (q * 30).float(), k.float(), v.float()
o_ref, _ = attention_with_lse(q32.double(), k32.double(), v32.double(), scale)
o_1, lse_1 = attention_with_lse(q32, k32[:cut], v32[:cut], scale)
o_2, lse_2 = attention_with_lse(q32, k32[cut:], v32[cut:], scale)
print(f"largest lse: {max(lse_1.max(), lse_2.max()).item():.0f}; "
      f"exp of it in float32: {torch.exp(torch.maximum(lse_1, lse_2).max()).item()}")
o_m, _ = merge_attn_states(o_1, lse_1, o_2, lse_2)
print(f"merged in float32 vs float64 reference: rel err {assert_close(o_m, o_ref):.1e}")

# %% [markdown]
# ## The chunk plan
#
# vLLM 0.11's MLA backend (`v1/attention/backends/mla/common.py`) sizes the workspace from the
# serving limits and cuts every request's context into chunks of `MCC` tokens
# (`docs/conventions.md` §7). With `S_max` the longest sequence (`max_model_len`), `B_max` the
# most sequences in a batch (`max_num_seqs`), `b` the block size, `n_ctx` the prefills of the
# batch that have cached context and `C_r` the context of request `r`:
#
# - the workspace holds `S_ws = max(min(max(8·S_max, 4·B_max·b), 65536), B_max·b)` tokens
#   (`mla.reference.workspace_size`),
# - `MCC = b·⌊(S_ws / n_ctx) / b⌋`,
# - chunk `ν` of request `r` covers the context tokens `[ν·MCC, min(C_r, (ν+1)·MCC))`.
#
# `plan_context_chunks` returns that plan as a value (`ChunkPlan`) that prints and plots itself.
# Below, a small workspace so that the chunks are visible.

# %%
context_lens = [0, 37, 100, 64]
plan = plan_context_chunks(context_lens, block_size=16, workspace_size=96)
print(plan)
ax = plan.plot()
save(ax.figure, "chunk_plan")

# %% [markdown]
# ## Chunked prefill equals one-shot prefill
#
# Four requests of the `tiny` preset with those contexts already cached, each prefilling a few
# new tokens: `chunked_prefill_forward` attends causally to the new tokens, chunk by chunk to
# the cache, and merges. The definition (`naive_forward`) runs each request's context and new
# tokens as one sequence; the new tokens' rows must agree, for every chunk size down to 1.

# %%
cfg = get_config("tiny")
w = MLAWeights.random(cfg, seed=0, dtype=torch.float64)
new_lens = [5, 1, 8, 3]
block_size = 16
hidden = [torch.randn(c + n, cfg.hidden_size, dtype=torch.float64)
          for c, n in zip(context_lens, new_lens)]
expected = torch.cat([naive_forward(w, h)[c:] for h, c in zip(hidden, context_lens)])
query_start_loc = torch.tensor([0] + new_lens).cumsum(0).to(torch.int32)

errors = {}
for mcc in [1, 7, 16, 48, 128]:
    table, num_blocks = make_block_table([c + n for c, n in zip(context_lens, new_lens)],
                                         block_size, seed=mcc)
    kv_cache = torch.randn(num_blocks, block_size, cfg.latent_dim, dtype=torch.float64)
    for i, (h, c) in enumerate(zip(hidden, context_lens)):
        if c:
            write_context(w, h[:c], kv_cache, table[i])
    chunk_plan = plan_context_chunks(context_lens, max_context_chunk=mcc)
    out = chunked_prefill_forward(w, torch.cat([h[c:] for h, c in zip(hidden, context_lens)]),
                                  query_start_loc, context_lens, kv_cache, table, plan=chunk_plan)
    errors[mcc] = assert_close(out, expected, TOL, name=f"chunked prefill, MCC {mcc}")
    print(f"MCC = {mcc:4d}: {chunk_plan.num_chunks:3d} chunks, rel err vs definition "
          f"{errors[mcc]:.1e}")

# %% [markdown]
# ## Workspace size against context length
#
# The workspace holds `S_ws` latent rows (`Lkv + R` numbers each) and, during a chunk, their
# up-projected keys and values (`N·(P+R+V)` numbers per token). `S_ws` grows with `S_max` up
# to a cap of 64K tokens (more only when `B_max` pages need more); past it the memory
# stays fixed and the number of chunks grows instead, the more so the more prefills with
# context share the workspace.

# %%
v3 = get_config("deepseek-v3")
per_token = v3.num_heads * (v3.qk_head_dim + v3.v_head_dim) * 2  # bf16 bytes of k and v
lens = [2 ** e for e in range(10, 18)]  # 1K .. 128K
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
for seqs in [1, 256, 2048]:
    ws = [workspace_size(n, seqs, 64) for n in lens]
    ax1.loglog(lens, [x * per_token / 2 ** 30 for x in ws], marker="o",
               label=f"max_num_seqs {seqs}")
ax1.set_xlabel("max_model_len (tokens)")
ax1.set_ylabel("up-projected k, v of the workspace (GiB)")
ax1.set_title("DeepSeek-V3, bf16, block size 64")
S_ws = workspace_size(131072, 256, 64)
for batch in [1, 4, 16]:
    chunks = [plan_context_chunks([n] * batch, workspace_size=S_ws, block_size=64).num_chunks
              for n in lens]
    ax2.loglog(lens, chunks, marker="o", base=2, label=f"{batch} prefills with context")
ax2.set_xlabel("context length of each request (tokens)")
ax2.set_ylabel("chunks (count)")
ax2.set_title(f"S_ws = {S_ws} tokens shared by the batch")
for ax in (ax1, ax2):
    ax.legend()
save(fig, "workspace")
print(f"S_ws = {S_ws} tokens for DeepSeek-V3: {S_ws * per_token / 2 ** 30:.1f} GiB of "
      f"up-projected k, v; {S_ws * v3.latent_dim * 2 / 2 ** 20:.0f} MiB of latent rows")
