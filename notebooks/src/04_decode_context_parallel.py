# ruff: noqa: E402
# Source of notebooks/04_decode_context_parallel.ipynb (build: python notebooks/build.py).

# %% [markdown]
# # Decode context parallelism: one request's cache on several GPUs
#
# A 128K-token context of DeepSeek-V3 caches `128K × 576 × 2 bytes ≈ 151 MB` per layer, 9 GB over
# 61 layers, for one request. Decode context parallelism (DCP) spreads each request's latent
# cache over the `D` ranks of a group (the symbols are those of the table at the top of
# `papers/derivation.md`), so that long contexts fit and each rank reads only `1/D` of the
# cache per step. This notebook draws the placement, counts each rank's share,
# derives the exact combination of the ranks' partial attentions through their log-sum-exp,
# and follows the rows of a context chunk through the gather, the all-gather and
# `reorg_kvcache`. The ranks are simulated in one process (`mla.reference.dcp.run_simulated`);
# `mla.check.dcp` runs the same functions on a `torch.distributed` process group.

# %%
import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Patch
from nbhelp import figure_saver  # puts the repository root on sys.path, before `import mla`

from mla import MLAWeights, get_config
from mla.compare import TOLERANCES, assert_close
from mla.reference import (
    attention_with_lse,
    chunked_prefill_forward,
    decode_forward,
    gather_cache,
    make_block_table,
    merge_attn_states_list,
    mla_decode_paged,
    write_context,
)
from mla.reference.dcp import (
    DCPSharding,
    dcp_chunked_prefill_forward_rank,
    dcp_decode_forward_rank,
    dcp_decode_rank,
    dcp_local_decode,
    dcp_local_seq_lens,
    plan_dcp_context_chunks,
    reorg_kvcache,
    run_simulated,
    same_on_all_ranks,
    shard_kv_cache,
)

save = figure_saver("04_decode_context_parallel")
torch.manual_seed(0)
TOL = TOLERANCES[torch.float64]

# %% [markdown]
# ## Interleaved placement
#
# The token at position `s` lives on rank `s mod D`, at local position `⌊s/D⌋`. Consecutive
# tokens land on different ranks, so every rank holds an almost equal share of every request
# whatever its length, and a new decode token is written by exactly one rank.

# %%
D = 4
seq_lens = [13, 4, 8, 1, 0, 9]
sharding = DCPSharding.of(seq_lens, D)
print(sharding)
ax = sharding.plot()
ax.set_xlabel("position in the request (tokens)")
ax.set_ylabel("request (index)")
ax.figure.axes[-1].set_ylabel("rank holding the token (index)")
save(ax.figure, "interleaved_placement")

# %% [markdown]
# Rank `ρ` of a request of `Skv` tokens holds the positions `s < Skv` with `s ≡ ρ (mod D)`:
#
# $$n_\rho = \lfloor S_{kv} / D \rfloor + [\, \rho < S_{kv} \bmod D \,].$$
#
# (`mla.reference.dcp.dcp_local_seq_lens`.) vLLM 0.11's decode metadata
# (`v1/attention/backends/mla/common.py`) writes
# `⌊Skv/D⌋ + [ρ ≤ (Skv−1) mod D]`, which agrees except when `D` divides `Skv`: then it gives every
# rank one token too many (vLLM fixed it upstream, vllm-project/vllm#27518). Both, next to a
# count of the positions:

# %%
lens = torch.tensor(seq_lens, dtype=torch.int32)
print(f"{'Skv':>4} | {'n_rho (package)':<16} | {'vLLM 0.11':<16} | counted")
for i, L in enumerate(seq_lens):
    package = [int(dcp_local_seq_lens(lens, D, r)[i]) for r in range(D)]
    vllm_011 = [L // D + int(r <= (L - 1) % D) for r in range(D)]
    counted = [sum(1 for t in range(L) if t % D == r) for r in range(D)]
    assert package == counted and sum(package) == L
    print(f"{L:>4} | {str(package):<16} | {str(vllm_011):<16} | {counted}"
          + ("   <- vLLM 0.11 over-counts" if vllm_011 != counted else ""))

# %% [markdown]
# ## Decode: partial attentions and the LSE correction
#
# All `N` query heads are all-gathered onto every rank; rank `ρ` runs the absorbed MQA over its
# own tokens only, giving `(o_ρ, lse_ρ)` per query and head. The ranks' key sets are disjoint
# and cover the request, so the merge of notebook 03 recombines them exactly:
#
# $$\mathrm{lse} = \ln \sum_\rho e^{\mathrm{lse}_\rho}, \qquad
#   o = \sum_\rho e^{\mathrm{lse}_\rho - \mathrm{lse}}\, o_\rho ,$$
#
# with the merge's rules: a rank with no visible key of a request reports `lse_ρ = +∞`
# (FlashMLA's convention) or `−∞`, mapped to `−∞` before the sum, so its weight is 0 and its
# `o_ρ` is never read; a query no rank saw gets `o = 0` (and the decode reports its `lse` as
# `+∞`). In vLLM (`cp_lse_ag_out_rs`) the lse are all-gathered, each rank scales its own `o_ρ`,
# and a reduce-scatter along heads sums the scaled outputs and leaves each rank its `N/D`
# heads. Below, with DeepSeek's widths (576/512) and 8 heads.

# %%
D_QK, D_V, HEADS, BLOCK, S_Q = 576, 512, 8, 16, 2
table, num_blocks = make_block_table(seq_lens, BLOCK, seed=0)
kv_cache = torch.randn(num_blocks, BLOCK, D_QK, dtype=torch.float64)
q = torch.randn(len(seq_lens), S_Q, HEADS, D_QK, dtype=torch.float64)
scale = 192 ** -0.5
out_ref, lse_ref = mla_decode_paged(q, kv_cache, table, lens, scale, causal=True, head_dim_v=D_V)

shards = shard_kv_cache(kv_cache, table, lens, D)
print(shards[1])
partials = [dcp_local_decode(q, s.kv_cache, s.block_table, lens, scale, s.rank, D,
                             causal=True, head_dim_v=D_V) for s in shards]
# the merge works in vLLM's layout: o [tokens, N, head_dim_v], lse [N, tokens]
B = len(seq_lens)
o_m, lse_m = merge_attn_states_list(
    [o.reshape(B * S_Q, HEADS, D_V) for o, _ in partials],
    [lse.transpose(1, 2).reshape(B * S_Q, HEADS).T for _, lse in partials])
lse_m = lse_m.T.reshape(B, S_Q, HEADS).transpose(1, 2)
out_m = o_m.reshape(B, S_Q, HEADS, D_V)
has_keys = torch.isfinite(lse_ref)
print(f"partials merged vs single-rank decode: out rel err "
      f"{assert_close(out_m, out_ref, TOL):.1e}, lse rel err "
      f"{assert_close(lse_m[has_keys], lse_ref[has_keys], TOL):.1e}")

# the rank program: shard, all-gather q, local decode, correction, reduce-scatter
ranks = run_simulated(D, lambda comm: dcp_decode_rank(comm, q, kv_cache, table, lens, scale,
                                                      causal=True, head_dim_v=D_V))
out_dcp = torch.cat([o for o, _ in ranks], dim=2)  # each rank returns its N/D heads
lse_dcp = torch.cat([lse for _, lse in ranks], dim=1)
print(f"dcp_decode_rank on {D} simulated ranks, their heads joined: out rel err "
      f"{assert_close(out_dcp, out_ref, TOL):.1e}, lse rel err "
      f"{assert_close(lse_dcp, lse_ref, TOL):.1e}")
print("request of length 1, its lse per rank:",
      [p[1][3, 0, -1].item() for p in partials], "(+inf: no visible key on that rank)")

# %%
req, query = 0, S_Q - 1
weights = torch.stack([torch.where(torch.isinf(lse[req, :, query]), 0.0,
                                   torch.exp(lse[req, :, query] - lse_ref[req, :, query]))
                       for _, lse in partials])  # [D, N]
assert torch.allclose(weights.sum(0), torch.ones(HEADS, dtype=torch.float64))
fig, ax = plt.subplots(figsize=(7, 3))
im = ax.imshow(weights.numpy(), cmap="viridis", vmin=0, aspect="auto")
ax.set_xlabel("query head (index)")
ax.set_ylabel("rank (index)")
ax.set_yticks(range(D))
ax.set_title(f"request {req} (Skv = {seq_lens[req]}), last query: exp(lse_rho - lse)")
fig.colorbar(im, ax=ax).set_label("correction weight (fraction)")
save(fig, "lse_correction_weights")
print("each head's weights sum to 1 over the ranks")

# %% [markdown]
# ## Prefill context under DCP: what `reorg_kvcache` does to the rows
#
# A prefill with cached context (notebook 03) needs the context chunk *whole* on every rank to
# up-project it. Under DCP every rank gathers its share of the chunk: `ceil(chunk_len / D)`
# local rows per request from local position `ν·MCC/D` for chunk `ν` (`cp_chunk_seq_lens`,
# `cp_chunk_starts`; the chunk size must be divisible by `D`). The ranks whose share is one
# token short gather one row past their last token: a *padding* row. The gathers are
# all-gathered into one buffer of `D·toks` rows, rank-major, and `reorg_kvcache` (vLLM's
# function, same arguments) rebuilds the chunk request by request, rank 0's rows first, then
# rank 1's, ..., dropping the padding rows. To see it, each cached row below carries its
# request and position in its first two numbers.

# %%
ctx_lens = [21, 6, 0, 11]
dplan = plan_dcp_context_chunks(ctx_lens, D, max_context_chunk=16)
print(dplan)
ax = dplan.plot(0)
ax.set_xlabel("row of the all-gathered buffer (index; colour = request, grey = padding)")
ax.set_ylabel("rank that gathered it (index)")
colors = plt.get_cmap("tab10")  # the plot colours request i with colors(i)
ax.legend(handles=[Patch(color=colors(i), label=f"request {i}")
                   for i, n in enumerate(dplan.plan.chunk_seq_lens[0]) if n]
          + [Patch(color="lightgrey", label="padding")],
          loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
save(ax.figure, "reorg_buffer_chunk0")

# %%
LKV, R = 3, 1  # small rows: [request, position, 0] ‖ [0]
tab, nblk = make_block_table(ctx_lens, 4, seed=2)
labelled = torch.zeros(nblk, 4, LKV + R, dtype=torch.float64)
for i, n in enumerate(ctx_lens):
    for t in range(n):
        labelled[tab[i, t // 4], t % 4, :2] = torch.tensor([i, t], dtype=torch.float64)
local = shard_kv_cache(labelled, tab, torch.tensor(ctx_lens, dtype=torch.int32), D)

for c in range(dplan.num_chunks):
    toks = dplan.seq_tot[c]
    gathers = [gather_cache(s.kv_cache, s.kv_cache.new_empty(toks, LKV + R), s.block_table,
                            torch.tensor(dplan.cp_cu_seq_lens[c], dtype=torch.int32),
                            len(ctx_lens),
                            seq_starts=torch.tensor(dplan.cp_chunk_starts[c], dtype=torch.int32))
               for s in local]
    allgathered = torch.cat(gathers)  # what the all-gather returns: rank-major
    kv_c, k_pe = reorg_kvcache(
        allgathered[:, None, :LKV], allgathered[:, None, LKV:],
        cp_chunk_seq_lens_lst=list(dplan.cp_chunk_seq_lens[c]),
        origin_context_lens=ctx_lens, cp_world_size=D,
        sum_seq_len=dplan.cu_seq_lens_lst[c][-1], max_seq_len=dplan.max_seq_lens[c],
        chunk_size=dplan.chunk_size, chunk_idx=c, toks=toks)
    nan_rows = torch.isnan(allgathered[:, 0]).nonzero().flatten().tolist()
    assert nan_rows == dplan.padding_rows(c) and not torch.isnan(kv_c).any()
    print(f"chunk {c}: gathered {D} x {toks} rows, padding rows {nan_rows} (NaN: slots no "
          f"token wrote), reorg keeps {kv_c.shape[0]}")
    cu = dplan.cu_seq_lens_lst[c]
    for i in range(len(ctx_lens)):
        rows = kv_c[cu[i]: cu[i + 1], 0]
        assert (rows[:, 0] == i).all()
        positions = rows[:, 1].long().tolist()
        start, n = dplan.plan.chunk_starts[c][i], dplan.plan.chunk_seq_lens[c][i]
        assert sorted(positions) == list(range(start, start + n))  # exactly the chunk
        if positions:
            print(f"   request {i}: positions {positions}")

# %% [markdown]
# The rebuilt chunk holds exactly the chunk's tokens, but in rank-major order
# (`0, 4, 8, ..., 1, 5, ...`), not in position order. That is enough because the context part
# of a prefill is attended without a mask: attention is a sum over keys, so any permutation of
# the keys (with their values) gives the same output and log-sum-exp.

# %%
keys = torch.randn(11, 1, 40, dtype=torch.float64)
qq = torch.randn(3, 4, 40, dtype=torch.float64)
perm = torch.tensor([0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7])  # request 3's rank-major order
o_pos, lse_pos = attention_with_lse(qq, keys, keys[..., :32], 40 ** -0.5)
o_perm, lse_perm = attention_with_lse(qq, keys[perm], keys[perm][..., :32], 40 ** -0.5)
print(f"keys in rank-major order vs position order: o rel err "
      f"{assert_close(o_perm, o_pos, TOL):.1e}, "
      f"lse rel err {assert_close(lse_perm, lse_pos, TOL):.1e}")

# %% [markdown]
# ## Hidden states in, hidden states out
#
# The model-level functions run the front, write each new token on its owner rank, and run DCP
# decode or DCP chunked prefill; with `D` simulated ranks (each keeping `N/D` of the `tiny`
# preset's 4 heads) they must equal the single-rank paths.

# %%
cfg = get_config("tiny")
w = MLAWeights.random(cfg, seed=0, dtype=torch.float64)
ctx, new = [23, 5, 0], [2, 2, 2]
tab, nblk = make_block_table([c + n for c, n in zip(ctx, new)], 8, seed=3)
cache = torch.randn(nblk, 8, cfg.latent_dim, dtype=torch.float64)
for i, n in enumerate(ctx):
    if n:
        write_context(w, torch.randn(n, cfg.hidden_size, dtype=torch.float64), cache, tab[i])
hidden = torch.randn(len(ctx), 2, cfg.hidden_size, dtype=torch.float64)
seqlens = torch.tensor(ctx, dtype=torch.int32)
qsl = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
for world in [1, 2, 4]:
    # every rank returns the whole output (the heads are all-gathered before W_O)
    dec = same_on_all_ranks(run_simulated(world, lambda comm: dcp_decode_forward_rank(
        comm, w, hidden, cache, tab, seqlens)))
    pre = same_on_all_ranks(run_simulated(world, lambda comm: dcp_chunked_prefill_forward_rank(
        comm, w, hidden.reshape(-1, cfg.hidden_size), qsl, ctx, cache, tab, workspace_size=16)))
    dec_ref = decode_forward(w, hidden, cache.clone(), tab, seqlens)
    pre_ref = chunked_prefill_forward(w, hidden.reshape(-1, cfg.hidden_size), qsl, ctx,
                                      cache.clone(), tab, workspace_size=16)
    print(f"D = {world}: decode rel err {assert_close(dec, dec_ref, TOL):.1e}, "
          f"chunked prefill rel err {assert_close(pre, pre_ref, TOL):.1e}")
