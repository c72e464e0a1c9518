"""The lightning indexer's logits from fp8 inputs, and the top-k per row (DeepSeek-V3.2).

conventions §10 ("Indexer logits and top-k"). The kernels' contract, as DeepGEMM's
``fp8_mqa_logits`` / ``fp8_paged_mqa_logits`` (``sm90_fp8_paged_mqa_logits.cuh``) and DeepSeek's
``inference/kernel.py`` ``fp8_index`` compute it: ``q`` in e4m3 *without* a scale (the caller
folds each head's q scale into its weight: ``weights = w · q_scale``, see
``quantize_indexer_q``), ``k`` as e4m3 codes and one float32 scale per token:

    logits[t, s] = k_scale[s] · Σ_h weights[t, h] · ReLU(q[t, h] · k_code[s])

(the scale after the weighted sum, as the kernels apply it; it is positive, so this equals
``Σ_h w·ReLU(q·k)`` on the dequantized keys, which is ``index_scores``). Keys a query may not
see are ``-inf``. Computed in float32 (float64 when ``weights`` is float64): the products of
two e4m3 numbers are exact there, so the only roundings are the sums, the products with the
weights and with a scale that is not a power of two.

- ``fp8_mqa_logits`` (prefill, ragged): query ``t`` sees the keys ``[ks[t], ke[t])`` of one
  flat key array; a request's query at position ``p`` has ``ks`` = its first key's row and
  ``ke = ks + p + 1``. Rows ``[S, N]``, or compressed to ``[S, max_seqlen_k]`` (column ``j``:
  key ``ks[t] + j``), as DeepGEMM's ``max_seqlen_k`` and vLLM's prefill indexer use them.
- ``fp8_paged_mqa_logits`` (decode over the paged cache of ``mla.reference.indexer_cache``):
  request ``b`` has ``L = context_lens[b]`` keys, the ``next_n`` new tokens included; query
  ``n`` of ``next_n`` sees keys ``0 .. L - next_n + n`` (FlashMLA's causal rule); output
  ``[B · next_n, max_model_len]``.
- ``top_k_per_row``: per row the ``min(topk, end - start)`` highest logits of columns
  ``[start, end)``, as indices relative to ``start`` (request-local), highest first, **ties to
  the lower index**, the rest ``-1``. Columns outside ``[start, end)`` are never read. A NaN
  logit inside the range ranks above every number (``torch.sort``'s order), so its key is
  selected and its NaN reaches the attention.
"""

from __future__ import annotations

import torch

from mla.reference.fp8 import act_quant
from mla.reference.indexer_cache import INDEX_DIM, INDEX_K_BYTES, read_indexer_k_cache
from mla.validation import acc_dtype, check_float, check_index, check_same_device, check_tensor

__all__ = ["quantize_indexer_q", "check_indexer_q_args", "fp8_mqa_logits",
           "fp8_paged_mqa_logits", "decode_row_ends", "top_k_per_row", "compressed_rows",
           "check_logits_q", "check_ragged_logits_args", "check_ragged_logits_ranges",
           "check_max_seqlen_k", "check_paged_logits_args"]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)
_CHUNK_ELEMENTS = 1 << 24


def quantize_indexer_q(q_index: torch.Tensor, weights: torch.Tensor,
                       scale_fmt: str | None = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """``q_index [..., H, 128]``, ``weights [..., H]`` -> ``(q e4m3, weights · q_scale)`` float32:
    DeepSeek's ``act_quant`` per head (one scale per 128 values), the scale folded into the
    head's weight as its inference code does (vLLM's fused kernel floors amax at 1e-10, not
    1e-4: they differ only for a head whose values all lie below 1e-4)."""
    check_indexer_q_args(q_index, weights)
    q_fp8, q_scale = act_quant(q_index, block_size=INDEX_DIM, scale_fmt=scale_fmt)
    return q_fp8, weights.float() * q_scale[..., 0]


def check_indexer_q_args(q_index: torch.Tensor, weights: torch.Tensor) -> None:
    """``quantize_indexer_q``'s arguments: float ``q_index [..., H, 128]``, ``weights [..., H]``."""
    check_float("q_index", q_index)
    if q_index.dim() < 2 or q_index.shape[-1] != INDEX_DIM:
        raise ValueError(f"q_index must have shape [..., H, {INDEX_DIM}], got "
                         f"{list(q_index.shape)}")
    check_float("weights", weights, shape=list(q_index.shape[:-1]))


def check_logits_q(q: torch.Tensor, ndim: int) -> torch.Tensor:
    """``q [..., 128]`` as e4m3 codes (``uint8`` is read as e4m3)."""
    check_tensor("q", q, ndim=ndim, dtype=_FP8_DTYPES)
    if q.shape[-1] != INDEX_DIM:
        raise ValueError(f"q's last dim must be {INDEX_DIM}, got shape {list(q.shape)}")
    return q.view(torch.float8_e4m3fn)


def check_ragged_logits_args(q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                             weights: torch.Tensor, cu_seqlen_ks: torch.Tensor,
                             cu_seqlen_ke: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fp8_mqa_logits``' shape, dtype and device checks (host metadata only, no device
    read), shared with ``mla.fast``: ``(q, k_codes, k_scale)`` with ``q`` as e4m3."""
    q = check_logits_q(q, 3)
    S, H, _ = q.shape
    if not isinstance(kv, tuple) or len(kv) != 2:
        raise TypeError(f"kv must be a tuple (k_codes [N, {INDEX_DIM}], k_scale [N]), got "
                        f"{type(kv).__name__}")
    codes, scale = kv
    check_tensor("kv[0]", codes, shape=[None, INDEX_DIM], dtype=_FP8_DTYPES)
    check_float("kv[1]", scale, shape=[codes.shape[0]])
    check_float("weights", weights, shape=[S, H])
    check_index("cu_seqlen_ks", cu_seqlen_ks, shape=[S])
    check_index("cu_seqlen_ke", cu_seqlen_ke, shape=[S])
    check_same_device(q=q, k_codes=codes, k_scale=scale, weights=weights,
                      cu_seqlen_ks=cu_seqlen_ks, cu_seqlen_ke=cu_seqlen_ke)
    return q, codes, scale


def check_ragged_logits_ranges(cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor,
                               n_keys: int, max_seqlen_k: int = 0) -> None:
    """Every query's key range within ``[0, n_keys]`` and, for compressed rows
    (``max_seqlen_k > 0``), no longer than ``max_seqlen_k``: three reductions, one
    transfer."""
    if cu_seqlen_ks.numel() == 0:
        return
    ks, ke = cu_seqlen_ks.long(), cu_seqlen_ke.long()
    lo, hi, span = torch.stack([ks.min(), ke.max(), (ke - ks).max()]).tolist()
    if lo < 0 or hi > n_keys:
        raise ValueError(f"cu_seqlen_ks / cu_seqlen_ke must lie in [0, {n_keys}] (the keys), "
                         f"got ks >= {lo}, ke <= {hi}")
    if max_seqlen_k and span > max_seqlen_k:
        raise ValueError(f"max_seqlen_k must hold every query's keys (ke - ks), got "
                         f"max_seqlen_k = {max_seqlen_k} for a query of {span} keys")


def check_paged_logits_args(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                            context_lens: torch.Tensor, block_tables: torch.Tensor,
                            max_model_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_paged_mqa_logits``' shape, dtype, device and scalar checks (host metadata only,
    no device read), shared with ``mla.fast``: ``(q as e4m3, kv_cache as [num_blocks,
    block_size, 132])``, DeepGEMM's ``[num_blocks, block_size, 1, 132]`` view accepted."""
    q = check_logits_q(q, 4)
    B, next_n, H, _ = q.shape
    if kv_cache.dim() == 4 and kv_cache.shape[2] == 1:
        kv_cache = kv_cache[:, :, 0]
    check_tensor("kv_cache", kv_cache, ndim=3, dtype=_FP8_DTYPES)
    if kv_cache.shape[2] != INDEX_K_BYTES:
        raise ValueError(f"kv_cache must have shape [num_blocks, block_size, {INDEX_K_BYTES}], "
                         f"got {list(kv_cache.shape)}")
    check_float("weights", weights, shape=[B * next_n, H])
    check_index("context_lens", context_lens, shape=[B])
    check_index("block_tables", block_tables, ndim=2)
    check_same_device(q=q, kv_cache=kv_cache, weights=weights, context_lens=context_lens,
                      block_tables=block_tables)
    if block_tables.shape[0] < B:
        raise ValueError(f"block_tables must have at least B={B} rows, got "
                         f"{block_tables.shape[0]}")
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or \
            max_model_len < 0:
        raise ValueError(f"max_model_len must be a non-negative int, got {max_model_len!r}")
    return q, kv_cache


def _logits(q: torch.Tensor, weights: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor
            ) -> torch.Tensor:
    """``[S, H, D]`` e4m3, ``[S, H]``, ``[N, D]`` e4m3, ``[N]`` -> ``[S, N]`` in the weights'
    accumulation dtype."""
    work = acc_dtype(weights.dtype)
    S, H, _ = q.shape
    N = codes.shape[0]
    out = torch.empty(S, N, dtype=work, device=q.device)
    k = codes.to(work)
    step = max(1, _CHUNK_ELEMENTS // max(1, H * N))
    for a in range(0, S, step):
        b = min(a + step, S)
        dots = torch.einsum("thd,nd->thn", q[a:b].to(work), k).clamp_min(0.0)
        out[a:b] = torch.einsum("th,thn->tn", weights[a:b].to(work), dots)
    return out * scale.to(work)[None, :]


def fp8_mqa_logits(q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                   weights: torch.Tensor, cu_seqlen_ks: torch.Tensor,
                   cu_seqlen_ke: torch.Tensor, max_seqlen_k: int = 0) -> torch.Tensor:
    """Ragged prefill logits ``[S, N]``: ``q [S, H, 128]`` e4m3, ``kv = (k_codes [N, 128]
    e4m3, k_scale [N] float32)``, ``weights [S, H]``; query ``t`` sees ``[ks[t], ke[t])``.

    ``max_seqlen_k > 0``: the rows compressed as DeepGEMM's ``max_seqlen_k`` asks
    (``compressed_rows``): ``[S, max_seqlen_k]``, column ``j`` of row ``t`` the logit of key
    ``ks[t] + j``, ``-inf`` from ``ke[t] - ks[t]`` on; every row's range must fit
    (``ke - ks <= max_seqlen_k``). ``top_k_per_row`` over them with starts 0 and ends
    ``ke - ks`` gives the same request-local indices as over the full rows with ``ks``,
    ``ke``."""
    q, codes, scale = check_ragged_logits_args(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke)
    N = codes.shape[0]
    check_max_seqlen_k(max_seqlen_k)
    check_ragged_logits_ranges(cu_seqlen_ks, cu_seqlen_ke, N, max_seqlen_k)
    ks, ke = cu_seqlen_ks.long(), cu_seqlen_ke.long()
    out = _logits(q, weights, codes.view(torch.float8_e4m3fn), scale)
    cols = torch.arange(N, device=q.device)[None, :]
    out = out.masked_fill((cols < ks[:, None]) | (cols >= ke[:, None]), float("-inf"))
    return compressed_rows(out, ks, ke, max_seqlen_k) if max_seqlen_k else out


def check_max_seqlen_k(max_seqlen_k: int) -> None:
    """``max_seqlen_k``: a non-negative int (0: full rows)."""
    if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int) or max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_k must be a non-negative int (0: full rows), got "
                         f"{max_seqlen_k!r}")


def compressed_rows(logits: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, width: int
                    ) -> torch.Tensor:
    """Ragged logits ``[S, N]`` (row ``t`` seeing columns ``[ks[t], ke[t])``) compressed to
    ``[S, width]``: column ``j`` of row ``t`` is column ``ks[t] + j`` for ``j < ke[t] -
    ks[t]``, ``-inf`` after (keys past ``width`` are dropped: the callers check they are
    none)."""
    S, N = logits.shape
    j = torch.arange(width, device=logits.device)[None, :]
    cols = ks.long()[:, None] + j
    live = (j < (ke.long() - ks.long())[:, None]) & (cols < N)
    got = logits.gather(1, cols.clamp(0, max(N - 1, 0))) if N else \
        torch.zeros(S, width, dtype=logits.dtype, device=logits.device)
    return torch.where(live, got, torch.full((), float("-inf"), dtype=logits.dtype,
                                             device=logits.device))


def decode_row_ends(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """int32 ``[B · next_n]``: row ``b · next_n + n`` sees keys ``[0, L_b - next_n + n + 1)``
    (0 keys where that is negative)."""
    check_index("context_lens", context_lens, ndim=1)
    n = torch.arange(next_n, device=context_lens.device)
    ends = context_lens.long()[:, None] - next_n + n[None, :] + 1
    return ends.clamp_min(0).flatten().to(torch.int32)


def fp8_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_tables: torch.Tensor,
                         max_model_len: int) -> torch.Tensor:
    """Paged decode logits ``[B · next_n, max_model_len]``.

    ``q [B, next_n, H, 128]`` e4m3; ``kv_cache uint8 [num_blocks, block_size, 132]`` (or
    DeepGEMM's view ``[num_blocks, block_size, 1, 132]``) in ``indexer_cache``'s page layout;
    ``weights [B · next_n, H]``; ``context_lens [B]``; ``block_tables [B, max_blocks]``.
    Row ``b · next_n + n`` holds query ``n``'s logits over request ``b``'s keys
    ``0 .. L - next_n + n``, ``-inf`` elsewhere. DeepGEMM's ``schedule_metadata`` is a
    scheduling detail of its kernel, not an input here.
    """
    q, kv_cache = check_paged_logits_args(q, kv_cache, weights, context_lens, block_tables,
                                          max_model_len)
    B, next_n = q.shape[:2]
    nb, bs, _ = kv_cache.shape
    lens = context_lens.tolist()
    for b, n in enumerate(lens):
        if n < 0 or n > max_model_len:
            raise ValueError(f"context_lens[{b}] = {n} must lie in [0, max_model_len = "
                             f"{max_model_len}]")
        used = -(-n // bs)
        if used > block_tables.shape[1]:
            raise ValueError(f"context_lens[{b}] = {n} needs {used} blocks of {bs}, "
                             f"block_tables has {block_tables.shape[1]}")
        pages = block_tables[b, :used]
        # a -1 page within the length would read the last block
        if used and (int(pages.min()) < 0 or int(pages.max()) >= nb):
            raise ValueError(f"block_tables[{b}] points outside the cache's {nb} blocks within "
                             f"its first {n} keys: range [{int(pages.min())}, "
                             f"{int(pages.max())}]")
    work = acc_dtype(weights.dtype)
    out = torch.full((B * next_n, max_model_len), float("-inf"), dtype=work, device=q.device)
    ends = decode_row_ends(context_lens, next_n).long().view(B, next_n)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        slots = block_tables[b].long()[pos // bs] * bs + pos % bs
        codes, scale = read_indexer_k_cache(kv_cache.view(torch.uint8), slots)
        rows = _logits(q[b], weights[b * next_n:(b + 1) * next_n], codes, scale)
        seen = pos[None, :] < ends[b][:, None]
        out[b * next_n:(b + 1) * next_n, :n] = rows.masked_fill(~seen, float("-inf"))
    return out


def top_k_per_row(logits: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor,
                  topk: int) -> torch.Tensor:
    """int32 ``[R, topk]``: per row the highest logits of columns ``[start, end)`` as indices
    ``j - start``, highest first, ties to the lower index, then ``-1``."""
    check_float("logits", logits, ndim=2)
    R, W = logits.shape
    check_index("row_starts", row_starts, shape=[R])
    check_index("row_ends", row_ends, shape=[R])
    check_same_device(logits=logits, row_starts=row_starts, row_ends=row_ends)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    starts, ends = row_starts.long(), row_ends.long()
    if R and (int(starts.min()) < 0 or int(ends.max()) > W):
        raise ValueError(f"row_starts / row_ends must lie in [0, {W}] (logits' columns), got "
                         f"starts >= {int(starts.min())}, ends <= {int(ends.max())}")
    cols = torch.arange(W, device=logits.device)[None, :]
    inside = (cols >= starts[:, None]) & (cols < ends[:, None])
    # two stable sorts: by value (NaN first, equal values in column order), then the columns
    # inside the range ahead of the rest; what lies outside is never looked at
    values = torch.where(inside, logits, float("-inf"))
    order = torch.sort(values, dim=1, descending=True, stable=True).indices
    order = order.gather(1, torch.sort(inside.gather(1, order).to(torch.int8), dim=1,
                                       descending=True, stable=True).indices)
    k = min(topk, W)
    count = (ends - starts).clamp_min(0)
    idx = order[:, :k] - starts[:, None]
    idx = torch.where(torch.arange(k, device=logits.device)[None, :] < count[:, None], idx, -1)
    out = torch.full((R, topk), -1, dtype=torch.int32, device=logits.device)
    out[:, :k] = idx.to(torch.int32)
    return out
