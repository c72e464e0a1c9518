"""vLLM 0.33.0's CUDA top-k kernels for the DeepSeek-V3.2 indexer as a conformance target.

They live in the wheel's ``vllm/_C_stable_libtorch.abi3.so`` (``vllm_library.load_library``
loads it) and register ``torch.ops._C.top_k_per_row_prefill``, ``top_k_per_row_decode``,
``persistent_topk`` and ``cooperative_topk``.

``top_k_per_row`` (the target's kernel, ``mla.reference.top_k_per_row``'s signature) runs
``top_k_per_row_prefill(logits, row_starts, row_ends, indices, R, stride0, stride1, topk)``,
the one that takes each row's ``[start, end)`` as our API does (vLLM's prefill indexer calls
it with the requests' ``cu_seqlen_ks`` / ``cu_seqlen_ke``). ``persistent_top_k_per_row`` runs
``persistent_topk(logits, lengths, indices, workspace, topk, max_seq_len)``, vLLM's default
for decode past 64 rows, which reads each row from column 0 (``lengths = row_ends``): rows
that start elsewhere are "unsupported", and so is a ``topk`` other than 512, 1024 or 2048
(its ``RuntimeCheck``). Use it as ``mla conform --target
mla.conformance.adapters.vllm_topk:persistent_top_k_per_row --kernels top_k_per_row``.

What the adapter decides: ``row_starts`` / ``row_ends`` are passed as int32, the logits as
float32 with their strides, the workspace is vLLM's 1 MiB, and the output starts filled with
``-1`` (our "no index"; a kernel that writes its own padding overwrites it). Everything the
kernels return passes through unchanged, so a convention of theirs shows as failing cases
that name it: whether indices count from the row's start or from column 0, and which of tied
keys are taken (ours: the lower columns; their radix selects take them in the order their
threads' atomics come, ``benchmarks/notes/topk.md``). On the H200 (2026-12-02,
``benchmarks/results/conformance_topk_cases_*_2026-12-02.md``) both kernels fail
``ties_at_the_boundary`` and ``nan_infinities_signed_zeros`` only by their tie rule (other
columns among the keys tied at the boundary; NaN and signed zeros rank as ours) and pass the
others they take. ``benchmarks.topk_peers`` times these kernels and checks the values they
pick. ``prefill_indices`` and ``persistent_indices`` hold the calls, tested on the CPU with
stand-ins for the kernels (``tests/test_conformance_vllm_topk.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mla.conformance.adapters import require, require_device, require_dtype
from mla.conformance.adapters.vllm_library import COMPRESSED, LIBRARY, load_library

__all__ = ["target", "top_k_per_row", "persistent_top_k_per_row", "prefill_indices",
           "persistent_indices", "load_library", "LIBRARY", "COMPRESSED",
           "WORKSPACE_BYTES", "COOPERATIVE_MAX_ROWS"]

PEER = "vLLM's top-k kernels (vllm/_C_stable_libtorch.abi3.so)"
WORKSPACE_BYTES = 1 << 20  # vLLM's RADIX_TOPK_WORKSPACE_SIZE
COOPERATIVE_MAX_ROWS = 64  # vLLM's AUTO_COOPERATIVE_MAX_ROWS: cooperative_topk up to this
PERSISTENT_TOPK = (512, 1024, 2048)


def _ops() -> object:
    """``torch.ops._C`` with vLLM's kernels registered (``load_library``)."""
    load_library()
    return torch.ops._C


def prefill_indices(ops: object, logits: torch.Tensor, row_starts: torch.Tensor,
                    row_ends: torch.Tensor, topk: int) -> torch.Tensor:
    """``ops.top_k_per_row_prefill`` as vLLM's prefill indexer calls it: int32 ranges, the
    logits' strides, an int32 ``[R, topk]`` output filled with ``-1`` first."""
    R = logits.shape[0]
    out = torch.full((R, topk), -1, dtype=torch.int32, device=logits.device)
    ops.top_k_per_row_prefill(logits, row_starts.to(torch.int32).contiguous(),  # type: ignore[attr-defined]
                              row_ends.to(torch.int32).contiguous(), out, R,
                              logits.stride(0), logits.stride(1), topk)
    return out


def persistent_indices(ops: object, logits: torch.Tensor, row_ends: torch.Tensor,
                       topk: int, longest: int | None = None) -> torch.Tensor:
    """``ops.persistent_topk`` as vLLM's decode indexer calls it: each row read from column
    0 to its length, vLLM's 1 MiB workspace, ``max_seq_len`` the longest row (its host-side
    bound: ``longest`` where the caller knows one, so that nothing is read from the device,
    else the rows' longest), an int32 ``[R, topk]`` output filled with ``-1`` first."""
    R = logits.shape[0]
    out = torch.full((R, topk), -1, dtype=torch.int32, device=logits.device)
    lengths = row_ends.to(torch.int32).contiguous()
    if longest is None:
        longest = int(lengths.max()) if R else 0
    work = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=logits.device)
    ops.persistent_topk(logits, lengths, out, work, topk, max(longest, 1))  # type: ignore[attr-defined]
    return out


def _checked(logits: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor) -> None:
    require_device(PEER, "cuda", logits=logits, row_starts=row_starts, row_ends=row_ends)
    require_dtype(PEER, (torch.float32,), logits=logits)
    require(logits.dim() == 2, PEER, f"takes 2-d logits, got {logits.dim()}-d")


def top_k_per_row(logits: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor,
                  topk: int) -> torch.Tensor:
    """vLLM's ``top_k_per_row_prefill`` with ``mla.reference.top_k_per_row``'s signature."""
    _checked(logits, row_starts, row_ends)
    return prefill_indices(_ops(), logits, row_starts, row_ends, topk)


def persistent_top_k_per_row(logits: torch.Tensor, row_starts: torch.Tensor,
                             row_ends: torch.Tensor, topk: int) -> torch.Tensor:
    """vLLM's ``persistent_topk`` with ``mla.reference.top_k_per_row``'s signature: rows
    from column 0 only, ``topk`` 512, 1024 or 2048."""
    _checked(logits, row_starts, row_ends)
    require(topk in PERSISTENT_TOPK, PEER, f"persistent_topk takes topk in {PERSISTENT_TOPK}, "
            f"got {topk}")
    require(not bool((row_starts != 0).any()), PEER,
            "persistent_topk reads every row from column 0; row_starts holds others")
    return persistent_indices(_ops(), logits, row_ends, topk)


def target() -> dict[str, Callable]:
    """vLLM's prefill top-k (the kernel that takes row ranges)."""
    return {"top_k_per_row": top_k_per_row}

