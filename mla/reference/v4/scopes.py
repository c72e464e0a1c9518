"""DeepSeek-V4's attention scopes as indices: what a layer hands ``sparse_mla_decode`` and
``sparse_mla_prefill`` (``mla.reference.v4.serving``'s construction, as public functions and
one kernel-level contract, ``v4_scope_indices``).

A batch of ``T`` new tokens: token ``t`` belongs to request ``token_to_req[t]`` and sits at
``positions[t]``; request ``b`` has ``seq_lens[b]`` tokens after this step, its new tokens being
its last ones. The caches are paged by ``window_table [B, P_w]`` (pages of ``WINDOW_PAGE = 64``
tokens) and ``compressed_table [B, P_c]`` (pages of ``256 / r`` entries); ``topk [T, K]`` holds a
ratio-4 layer's indexer ids (local entry ids, ``-1`` for none).

Decode (``path="decode"``), each token its own row:

    indices [T, window]        the global slots of the window [max(p - window + 1, 0), p] in
                               order, then -1;  lengths [T] = its length
    extra_indices [T, E]       the global slots of the compressed entries: the top-k ids,
                               valid ones first in their order (r = 4, E = K), or every
                               j < (p + 1) // 128 (r = 128, E = max(1, max_t (p_t + 1) // 128));
                               -1 padded; none for r = 1 (E = 0);  extra_lengths [T] = count

Prefill (``path="prefill"``): the workspace has ``M = N + max_b g_b`` rows per request,
``N = max_b seq_lens[b] // r`` (0 for r = 1), ``g_b = n_b + min(L_b - n_b, window - 1)``
(``n_b`` the request's new tokens): its compressed entries at ``M·b + j``, then its last
``g_b`` raw tokens from position ``L_b - g_b`` on at ``M·b + N + (s - L_b + g_b)``. Each row is
the token's compressed ids (as in decode, per request for r = 128: ``max(1, max (p + 1) // r)``
wide), then its window, valid first (stable), ``-1`` padded to a multiple of ``PREFILL_PAD =
128`` of the widest request's ``E_b + window``; lengths = the valid count.

Indices are int32 and exact: a kernel building them is held to every element, order included.
"""

from __future__ import annotations

import torch

from mla.validation import check_index, check_positive_int

__all__ = ["WINDOW_PAGE", "COMPRESSED_PAGE_TOKENS", "PREFILL_PAD", "window_local_ids",
           "compressed_local_ids", "paged_slots", "decode_scope_indices",
           "prefill_combined_indices", "v4_scope_indices"]

WINDOW_PAGE = 64
COMPRESSED_PAGE_TOKENS = 256
PREFILL_PAD = 128


def window_local_ids(positions: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids int64 [n, window], lengths int32 [n])``: the window's positions in order, then
    ``-1``."""
    p = positions.long()
    start = (p - window + 1).clamp(min=0)
    local = start[:, None] + torch.arange(window, device=p.device)[None, :]
    return torch.where(local <= p[:, None], local, -1), (p - start + 1).to(torch.int32)


def compressed_local_ids(positions: torch.Tensor, ratio: int, topk: torch.Tensor | None
                         ) -> torch.Tensor:
    """Scope 2's local entry ids ``[n, E]`` of one request's tokens, valid first, ``-1``
    padded: the top-k ids (ratio 4; stable) or every ``j < (p + 1) // 128`` (ratio 128, ``E =
    max(1, max (p + 1) // 128)``); ``[n, 0]`` for ratio 1."""
    p = positions.long()
    if ratio == 1:
        return torch.full((p.shape[0], 0), -1, dtype=torch.long, device=p.device)
    if ratio == 4:
        if topk is None:
            raise ValueError("a ratio-4 layer needs the indexer's topk ids")
        ids = topk.long()
        order = torch.argsort((ids < 0).to(torch.int8), dim=1, stable=True)
        return ids.gather(1, order)
    if ratio != 128:
        raise ValueError(f"ratio must be 1, 4 or 128, got {ratio!r}")
    width = max(1, int(((p.max() + 1) // ratio).item()) if p.numel() else 1)
    ids = torch.arange(width, device=p.device)[None, :].expand(p.shape[0], width)
    return torch.where(ids < ((p + 1) // ratio)[:, None], ids, -1)


def paged_slots(ids: torch.Tensor, table_row: torch.Tensor, page: int) -> torch.Tensor:
    """Global slots (int32) of local ``ids`` through one request's page table; ``-1`` stays
    ``-1``. An id past the table's pages is a ``ValueError``."""
    ids = ids.long()
    if ids.numel() and int(ids.max()) >= table_row.shape[0] * page:
        raise ValueError(f"no page for id {int(ids.max())} (the table covers "
                         f"{table_row.shape[0] * page})")
    safe = ids.clamp(min=0)
    slot = table_row.long()[safe // page] * page + safe % page
    return torch.where(ids < 0, -1, slot).to(torch.int32)


def _pad(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    return torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1]), value=-1)
                      for r in rows]).to(torch.int32)


def _by_request(token_to_req: torch.Tensor, batch: int) -> list[torch.Tensor]:
    return [torch.nonzero(token_to_req.long() == b).flatten() for b in range(batch)]


def decode_scope_indices(positions: torch.Tensor, token_to_req: torch.Tensor,
                         window_table: torch.Tensor, compressed_table: torch.Tensor | None,
                         topk: torch.Tensor | None, ratio: int, window: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indices, lengths, extra_indices, extra_lengths)`` (the module doc's decode)."""
    T = positions.shape[0]
    idx = torch.full((T, window), -1, dtype=torch.int32)
    lens = torch.zeros(T, dtype=torch.int32)
    extra_rows: list[torch.Tensor | None] = [None] * T
    for b, toks in enumerate(_by_request(token_to_req, window_table.shape[0])):
        if toks.numel() == 0:
            continue
        p = positions[toks].long()
        local, length = window_local_ids(p, window)
        idx[toks] = paged_slots(local, window_table[b], WINDOW_PAGE)
        lens[toks] = length
        if ratio > 1:
            assert compressed_table is not None
            ids = compressed_local_ids(p, ratio, None if topk is None else topk[toks])
            slots = paged_slots(ids, compressed_table[b], COMPRESSED_PAGE_TOKENS // ratio)
            for i, t in enumerate(toks.tolist()):
                extra_rows[t] = slots[i:i + 1]
    if ratio == 1:
        width = 0
    elif ratio == 4:
        assert topk is not None
        width = topk.shape[1]
    else:
        width = max(1, int(((positions.long().max() + 1) // ratio).item()) if T else 1)
    rows = [r if r is not None else torch.full((1, width), -1, dtype=torch.int32)
            for r in extra_rows]
    extra = _pad(rows, width) if T else torch.zeros(0, width, dtype=torch.int32)
    return idx, lens, extra, (extra >= 0).sum(1).to(torch.int32)


def prefill_combined_indices(positions: torch.Tensor, token_to_req: torch.Tensor,
                             seq_lens: torch.Tensor, topk: torch.Tensor | None, ratio: int,
                             window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [T, width], lengths [T])`` into the prefill workspace (the module doc's
    prefill)."""
    B, T = seq_lens.shape[0], positions.shape[0]
    lens = [int(x) for x in seq_lens.tolist()]
    groups = _by_request(token_to_req, B)
    n_new = [g.numel() for g in groups]
    n_comp = [L // ratio if ratio > 1 else 0 for L in lens]
    gather = [n + min(L - n, window - 1) for L, n in zip(lens, n_new)]
    N = max(n_comp, default=0)
    M = N + max(gather, default=0)
    rows: list[torch.Tensor | None] = [None] * T
    widest = 0
    for b, toks in enumerate(groups):
        if toks.numel() == 0:
            continue
        p = positions[toks].long()
        comp = compressed_local_ids(p, ratio, None if topk is None else topk[toks])
        comp = torch.where(comp >= 0, M * b + comp, -1)
        g = lens[b] - gather[b]
        local, _ = window_local_ids(p, window)
        swa = torch.where(local >= 0, M * b + N + (local - g), -1)
        row = torch.cat([comp, swa], dim=1)
        order = torch.argsort((row < 0).to(torch.int8), dim=1, stable=True)
        row = row.gather(1, order)
        widest = max(widest, row.shape[1])
        for i, t in enumerate(toks.tolist()):
            rows[t] = row[i:i + 1]
    width = -(-widest // PREFILL_PAD) * PREFILL_PAD
    if T == 0:
        return torch.zeros(0, width, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    indices = _pad([r for r in rows if r is not None], width)
    return indices, (indices >= 0).sum(1).to(torch.int32)


def _check_batch(positions: torch.Tensor, token_to_req: torch.Tensor, seq_lens: torch.Tensor,
                 window_table: torch.Tensor) -> None:
    check_index("positions", positions, ndim=1)
    check_index("token_to_req", token_to_req, shape=[positions.shape[0]])
    check_index("seq_lens", seq_lens, ndim=1)
    check_index("window_table", window_table, shape=[seq_lens.shape[0], None])
    for b, toks in enumerate(_by_request(token_to_req, seq_lens.shape[0])):
        p = positions[toks].long()
        L = int(seq_lens[b])
        want = torch.arange(L - toks.numel(), L)
        if not torch.equal(p.cpu(), want):
            raise ValueError(f"request {b}'s tokens must be its last {toks.numel()} positions "
                             f"{L - toks.numel()} .. {L - 1} in order, got {p.tolist()[:8]}")
    if positions.numel() and (int(token_to_req.min()) < 0
                              or int(token_to_req.max()) >= seq_lens.shape[0]):
        raise ValueError("token_to_req must name requests 0 .. B-1")


def v4_scope_indices(positions: torch.Tensor, token_to_req: torch.Tensor,
                     seq_lens: torch.Tensor, window_table: torch.Tensor,
                     compressed_table: torch.Tensor | None, topk: torch.Tensor | None,
                     ratio: int, window: int, path: str = "decode"
                     ) -> tuple[torch.Tensor, ...]:
    """The scopes' indices of a batch (the module doc's contract): ``path="decode"`` ->
    ``(indices, lengths, extra_indices, extra_lengths)``; ``"prefill"`` -> ``(indices,
    lengths)``. int32, on ``positions``' device."""
    if path not in ("decode", "prefill"):
        raise ValueError(f"path must be 'decode' or 'prefill', got {path!r}")
    if isinstance(ratio, bool) or ratio not in (1, 4, 128):
        raise ValueError(f"ratio must be 1, 4 or 128, got {ratio!r}")
    check_positive_int("window", window)
    dev = positions.device
    positions, token_to_req, seq_lens = positions.cpu(), token_to_req.cpu(), seq_lens.cpu()
    window_table = window_table.cpu()
    _check_batch(positions, token_to_req, seq_lens, window_table)
    if ratio > 1 and compressed_table is None:
        raise ValueError(f"a ratio-{ratio} layer needs compressed_table")
    if ratio == 4:
        if topk is None:
            raise ValueError("a ratio-4 layer needs the indexer's topk ids")
        check_index("topk", topk, shape=[positions.shape[0], None])
    if path == "decode":
        out = decode_scope_indices(positions, token_to_req, window_table,
                                   None if compressed_table is None else compressed_table.cpu(),
                                   None if topk is None else topk.cpu(), ratio, window)
    else:
        out = prefill_combined_indices(positions, token_to_req, seq_lens,
                                       None if topk is None else topk.cpu(), ratio, window)
    return tuple(t.to(dev) for t in out)
