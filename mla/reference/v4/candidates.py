"""DeepSeek-V4.1's two-level candidate blocks: one indexer chooses blocks, later ones mask.

The indexer of ``candidate_source_layer_id`` (the source) scores a query row's visible
compressed entries ``[0, n)`` (logits ``l [n]``), cuts them into blocks of ``B =
candidate_block_size`` entries and publishes the ``K = candidate_topk_blocks`` best blocks,
before its own top-k:

    score_b  = max_{c in block b} l_c           (NaN if any l_c is NaN)
    score_b  = +inf for the newest block b = (n - 1) // B            (always pinned)
    C        = the K blocks of largest score_b; a block of score -inf is not published (-1)

Every later index-source indexer (layer > the source) keeps only the logits of entries in
``C`` before its top-k:

    l'_c = l_c  if c // B in C,   else -inf

The row top-k then runs over ``l'``. Only indexers on index-source layers take part; layers
before the source, and the source itself for its own top-k, are unmasked. Ties among block
scores at the K-th place are not specified (vLLM's DeepSelect and ``torch.topk`` may pick
different blocks); NaN blocks rank first, as ``torch.topk`` ranks NaN.

Follows vLLM 0.33: ``vllm/model_executor/kernels/attention/dsa/candidate_blocks.py``
(``_block_scores_kernel``, ``_store_candidates_kernel``, ``_mask_candidates_kernel``),
``vllm/model_executor/layers/sparse_attn_indexer.py`` (the source selects, later layers mask,
both before the row top-k) and ``vllm/models/deepseek_v41/attention.py`` (``is_candidate_source
= layer_id == candidate_source_layer``, ``uses_candidates = 0 <= candidate_source_layer <
layer_id``).
"""

from __future__ import annotations

import torch

from mla.validation import check_float, check_positive_int, check_tensor

__all__ = ["candidate_block_scores", "select_candidate_blocks", "mask_to_candidates"]

_F64 = torch.float64


def _check(logits: torch.Tensor, lengths: torch.Tensor, block_size: int) -> None:
    check_float("logits", logits, ndim=2)
    check_tensor("lengths", lengths, shape=[logits.shape[0]], dtype=(torch.int32, torch.int64),
                 device=logits.device)
    check_positive_int("block_size", block_size)
    if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > logits.shape[1]):
        raise ValueError(f"lengths must lie in [0, {logits.shape[1]}] (logits' width)")


def candidate_block_scores(logits: torch.Tensor, lengths: torch.Tensor, block_size: int
                           ) -> torch.Tensor:
    """``logits [rows, N]``, row ``i`` valid on ``[0, lengths[i])`` -> float64 block scores
    ``[rows, ceil(N / B)]``: the max of the block's valid logits (NaN if one is NaN, ``-inf``
    for a block with none), ``+inf`` for the row's newest block."""
    _check(logits, lengths, block_size)
    rows, N = logits.shape
    nblocks = -(-N // block_size)
    cols = torch.arange(nblocks * block_size, device=logits.device)
    padded = torch.full((rows, nblocks * block_size), float("-inf"), dtype=_F64,
                        device=logits.device)
    padded[:, :N] = logits.to(_F64)
    valid = cols[None, :] < lengths[:, None]
    padded = torch.where(valid, padded, float("-inf")).view(rows, nblocks, block_size)
    scores = padded.amax(dim=2)  # torch's amax propagates NaN
    newest = (lengths - 1).div(block_size, rounding_mode="floor")
    pin = (lengths > 0)[:, None] & (torch.arange(nblocks, device=logits.device)[None, :]
                                    == newest[:, None])
    return torch.where(pin, float("inf"), scores)


def select_candidate_blocks(logits: torch.Tensor, lengths: torch.Tensor, block_size: int,
                            topk_blocks: int) -> torch.Tensor:
    """The candidate source's blocks: int64 ``[rows, topk_blocks]``, the ids of the
    ``topk_blocks`` best blocks (``candidate_block_scores``) in descending score, ``-1`` for a
    slot past the row's blocks or of score ``-inf``."""
    check_positive_int("topk_blocks", topk_blocks)
    scores = candidate_block_scores(logits, lengths, block_size)
    rows, nblocks = scores.shape
    k = min(topk_blocks, nblocks)
    out = torch.full((rows, topk_blocks), -1, dtype=torch.int64, device=logits.device)
    if k == 0:
        return out
    values, ids = scores.topk(k, dim=1)
    out[:, :k] = torch.where(values == float("-inf"), -1, ids)
    return out


def mask_to_candidates(logits: torch.Tensor, lengths: torch.Tensor, candidates: torch.Tensor,
                       block_size: int) -> torch.Tensor:
    """A later indexer's logits restricted to the candidate blocks: float64 ``[rows, N]``,
    ``l_c`` where ``c < lengths[i]`` and block ``c // B`` is among ``candidates[i]`` (``-1``
    entries ignored), ``-inf`` elsewhere."""
    _check(logits, lengths, block_size)
    check_tensor("candidates", candidates, ndim=2, dtype=(torch.int32, torch.int64),
                 device=logits.device)
    if candidates.shape[0] != logits.shape[0]:
        raise ValueError(f"candidates must have {logits.shape[0]} rows, got "
                         f"{candidates.shape[0]}")
    rows, N = logits.shape
    block = torch.arange(N, device=logits.device) // block_size  # [N]
    keep = (block[None, :, None] == candidates[:, None, :].long()).any(dim=2)
    keep &= torch.arange(N, device=logits.device)[None, :] < lengths[:, None]
    return torch.where(keep, logits.to(_F64), float("-inf"))
