"""Chunked prefill with cached context, merged through the log-sum-exp (vLLM 0.11
``v1/attention/backends/mla/common.py``,
"Chunked Prefill" and ``_compute_prefill_context``).

conventions §7. New tokens attend causally to themselves (the *suffix*) and, without a mask,
to the cached context (the *prefix*). The context is up-projected in chunks of at most ``MCC``
tokens so the per-head keys ``[MCC, N, P+R]`` never outgrow a fixed workspace:

    (o, lse) = MHA(q, new keys, causal)                           suffix
    for chunk c:                                                  prefix, chunk by chunk
        rows      = gather_cache(kv_cache, chunk c of every request)
        (o_c, l_c) = MHA(q, up_project(rows), non-causal)
        (o, lse)  = merge_attn_states(o_c, l_c, o, lse)

The batched plan, as vLLM's metadata builder computes it:

    workspace  W = max(min(max(8·max_model_len, 4·max_num_seqs·block_size), 64·1024),
                       max_num_seqs·block_size)
    MCC          = round_down(W // num_prefills_with_context, block_size)
    num_chunks   = cdiv(max_context_len, MCC)
    chunk c of request i: context tokens [c·MCC, min(ctx_i, (c+1)·MCC))   (maybe empty)

``ChunkPlan`` is that plan as a value: print it, plot it, or pass your own ``MCC`` (any
positive size, 1 included) to see that the answer does not depend on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mla.reference.attention import attention_with_lse
from mla.reference.merge import merge_attn_states
from mla.reference.paged_cache import gather_cache
from mla.reference.prefill import up_project_kv
from mla.validation import (
    check_float,
    check_index,
    check_same_device,
    check_same_dtype,
    check_scale,
)

__all__ = ["workspace_size", "ChunkPlan", "plan_context_chunks", "chunked_prefill_attention",
           "check_chunked_prefill_args", "suffix_attention", "context_chunk_attention"]


def workspace_size(max_model_len: int, max_num_seqs: int, block_size: int) -> int:
    """Tokens of the chunked-prefill workspace.

    ``determine_chunked_prefill_workspace_size`` of vLLM 0.11
    ``v1/attention/backends/mla/common.py``.
    """
    size = min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 64 * 1024)
    return max(size, max_num_seqs * block_size)


@dataclass(frozen=True)
class ChunkPlan:
    """Which context tokens of which request each chunk covers.

    ``chunk_starts[c][i]`` / ``chunk_seq_lens[c][i]``: start and length of request ``i``'s part
    of chunk ``c``; ``cu_seq_lens[c]`` their prefix sums (``B + 1`` entries, the rows of the
    workspace); ``seq_tot[c]`` the rows chunk ``c`` fills.
    """

    context_lens: tuple[int, ...]
    max_context_chunk: int
    chunk_starts: tuple[tuple[int, ...], ...]
    chunk_seq_lens: tuple[tuple[int, ...], ...]
    cu_seq_lens: tuple[tuple[int, ...], ...]
    seq_tot: tuple[int, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.seq_tot)

    @property
    def max_seq_lens(self) -> tuple[int, ...]:
        return tuple(max(lens, default=0) for lens in self.chunk_seq_lens)

    def __str__(self) -> str:
        lines = [f"ChunkPlan: {len(self.context_lens)} requests, context lens "
                 f"{list(self.context_lens)}, MCC {self.max_context_chunk}, "
                 f"{self.num_chunks} chunks"]
        for c in range(self.num_chunks):
            parts = ", ".join(f"[{s}, {s + n})" if n else "-"
                              for s, n in zip(self.chunk_starts[c], self.chunk_seq_lens[c]))
            lines.append(f"  chunk {c}: {self.seq_tot[c]:>6} rows  {parts}")
        return "\n".join(lines)

    def plot(self, ax: object = None) -> object:
        """A Gantt-like picture: one row per request, one colour per chunk (needs matplotlib)."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(8, 0.5 + 0.4 * len(self.context_lens)))
        colors = plt.get_cmap("tab10")
        for c in range(self.num_chunks):
            label = f"chunk {c} ({self.seq_tot[c]} rows)"
            for i, (s, n) in enumerate(zip(self.chunk_starts[c], self.chunk_seq_lens[c])):
                if n:
                    ax.barh(i, n, left=s, color=colors(c % 10), edgecolor="black", label=label)
                    label = None  # one legend entry per chunk
        ax.set_xlabel("context position (tokens)")
        ax.set_ylabel("request (index)")
        ax.set_yticks(range(len(self.context_lens)))
        ax.invert_yaxis()  # request 0 on top, as the printed plan lists them
        if self.num_chunks:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
        ax.set_title(f"context chunks, MCC = {self.max_context_chunk}")
        return ax


def plan_context_chunks(
    context_lens: list[int] | tuple[int, ...],
    *,
    block_size: int | None = None,
    workspace_size: int | None = None,
    max_context_chunk: int | None = None,
) -> ChunkPlan:
    """vLLM's chunk plan (0.11 ``mla/common.py``). Give either ``max_context_chunk`` (MCC)
    directly, or ``workspace_size`` and ``block_size`` to derive it as vLLM's MLA backend does."""
    lens = tuple(int(n) for n in context_lens)
    if any(n < 0 for n in lens):
        raise ValueError(f"context_lens must be >= 0, got {list(lens)}")
    if max_context_chunk is None:
        if workspace_size is None or block_size is None:
            raise ValueError("give max_context_chunk, or workspace_size and block_size")
        if workspace_size <= 0 or block_size <= 0:
            raise ValueError(f"workspace_size and block_size must be positive, got "
                             f"{workspace_size} and {block_size}")
        with_context = sum(n > 0 for n in lens)
        mcc = workspace_size // max(with_context, 1)
        mcc -= mcc % block_size  # round down to whole pages
        if mcc <= 0:
            raise ValueError(
                f"workspace_size={workspace_size} leaves less than one block of {block_size} "
                f"for each of the {with_context} requests with context")
    else:
        mcc = int(max_context_chunk)
        if mcc != max_context_chunk:  # 2.5 must not become 2 silently
            raise TypeError(f"max_context_chunk must be an int, got {max_context_chunk!r}")
        if mcc <= 0:
            raise ValueError(f"max_context_chunk must be positive, got {max_context_chunk}")
    num_chunks = -(-max(lens, default=0) // mcc)
    starts, seq_lens, cu, tot = [], [], [], []
    for c in range(num_chunks):
        s = tuple(c * mcc for _ in lens)
        n = tuple(max(min(ctx, c * mcc + mcc) - c * mcc, 0) for ctx in lens)
        prefix = [0]
        for x in n:
            prefix.append(prefix[-1] + x)
        starts.append(s)
        seq_lens.append(n)
        cu.append(tuple(prefix))
        tot.append(prefix[-1])
    return ChunkPlan(lens, mcc, tuple(starts), tuple(seq_lens), tuple(cu), tuple(tot))


def check_chunked_prefill_args(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_requests: int,
    W_UK: torch.Tensor,  # noqa: N803
    softmax_scale: float,
) -> list[int]:
    """The argument checks of the chunked-prefill attentions (reference, DCP and fast).

    Returns ``query_start_loc`` read on the host (the per-request loops need it).
    """
    check_float("q_nope", q_nope, shape=[None, W_UK.shape[1], W_UK.shape[2]])
    T = q_nope.shape[0]
    check_float("q_pe", q_pe, shape=[T, q_nope.shape[1], None])
    check_float("kv_c", kv_c, shape=[T, W_UK.shape[0]])
    check_float("k_pe", k_pe, shape=[T, q_pe.shape[2]])
    check_float("kv_cache", kv_cache, shape=[None, None, kv_c.shape[1] + k_pe.shape[1]])
    check_index("query_start_loc", query_start_loc, shape=[num_requests + 1])
    check_index("block_table", block_table, shape=[num_requests, None])
    check_same_device(q_nope=q_nope, kv_cache=kv_cache, block_table=block_table,
                      query_start_loc=query_start_loc)
    # the cached rows meet q and the weights in one dtype: no silent down-cast of the cache
    check_same_dtype(q_nope=q_nope, q_pe=q_pe, kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache,
                     W_UK=W_UK)
    check_scale("softmax_scale", softmax_scale)
    qsl = query_start_loc.tolist()
    if qsl[0] != 0 or qsl[-1] != T or any(b < a for a, b in zip(qsl, qsl[1:])):
        raise ValueError(f"query_start_loc must rise from 0 to T={T}, got {qsl}")
    return qsl


def suffix_attention(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, qsl: list[int],
                     W_UK: torch.Tensor, W_UV: torch.Tensor,  # noqa: N803
                     softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's new tokens ``q [T, N, P+R]`` over their own keys, causal.

    ``qsl`` is ``query_start_loc`` on the host. Returns ``o [T, N, V]`` and ``lse [N, T]``.
    """
    o_parts, lse_parts = [], []
    for i in range(len(qsl) - 1):
        sl = slice(qsl[i], qsl[i + 1])
        k, v = up_project_kv(kv_c[sl], k_pe[sl], W_UK, W_UV)
        o_i, lse_i = attention_with_lse(q[sl], k, v, softmax_scale, causal=True)
        o_parts.append(o_i)
        lse_parts.append(lse_i)
    return torch.cat(o_parts, dim=0), torch.cat(lse_parts, dim=1)


def context_chunk_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                            qsl: list[int], cu: Sequence[int],
                            softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's new tokens over its rows ``cu[i] .. cu[i+1]`` of one context chunk.

    ``k_all [rows, N, P+R]`` and ``v_all [rows, N, V]`` are the chunk's up-projected keys; no
    mask (the whole context precedes the new tokens). Returns ``o [T, N, V]``, ``lse [N, T]``.
    """
    o_parts, lse_parts = [], []
    for i in range(len(qsl) - 1):
        sl, rs = slice(qsl[i], qsl[i + 1]), slice(cu[i], cu[i + 1])
        o_i, lse_i = attention_with_lse(q[sl], k_all[rs], v_all[rs], softmax_scale,
                                        causal=False)
        o_parts.append(o_i)
        lse_parts.append(lse_i)
    return torch.cat(o_parts, dim=0), torch.cat(lse_parts, dim=1)


def chunked_prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    plan: ChunkPlan,
    W_UK: torch.Tensor,  # noqa: N803
    W_UV: torch.Tensor,  # noqa: N803
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched prefill of new tokens ``[T, ...]`` over their own keys and their cached context.

    ``query_start_loc [B+1]`` splits the ``T`` new tokens into requests; request ``i`` has
    ``plan.context_lens[i]`` cached tokens in ``kv_cache`` under ``block_table[i]``, and its
    new tokens sit at positions ``ctx_i, ctx_i + 1, ...``. Returns ``o [T, N, V]`` and
    ``lse [N, T]``.
    """
    B = len(plan.context_lens)
    qsl = check_chunked_prefill_args(q_nope, q_pe, kv_c, k_pe, query_start_loc, kv_cache,
                                     block_table, B, W_UK, softmax_scale)

    q = torch.cat([q_nope, q_pe], dim=-1)
    Lkv = kv_c.shape[1]
    # suffix: each request's new tokens, causal among themselves
    o, lse = suffix_attention(q, kv_c, k_pe, qsl, W_UK, W_UV, softmax_scale)

    # prefix: the cached context, chunk by chunk through a fixed workspace
    workspace = kv_cache.new_empty(max(plan.seq_tot, default=0), kv_cache.shape[2])
    for c in range(plan.num_chunks):
        cu = torch.tensor(plan.cu_seq_lens[c], dtype=torch.int32, device=kv_cache.device)
        starts = torch.tensor(plan.chunk_starts[c], dtype=torch.int32, device=kv_cache.device)
        rows = gather_cache(kv_cache, workspace, block_table, cu, B, seq_starts=starts)
        k_all, v_all = up_project_kv(rows[:, :Lkv], rows[:, Lkv:],
                                     W_UK, W_UV)
        o_c, lse_c = context_chunk_attention(q, k_all, v_all, qsl, plan.cu_seq_lens[c],
                                             softmax_scale)
        o, lse = merge_attn_states(o_c, lse_c, o, lse)
    return o, lse
