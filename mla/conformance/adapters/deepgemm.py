"""DeepGEMM's indexer logits kernels (the ones vLLM runs for DeepSeek-V3.2) as a conformance
target.

vLLM 0.33.0's wheel ships DeepGEMM 2.8.1 as ``vllm/third_party/deep_gemm``: Python wrappers,
an extension on torch's stable C ABI (``_C_extension.abi3.so``) and the CUDA headers its JIT
compiles each kernel against at the first call (with the machine's ``nvcc``).
``python -m benchmarks.peers --deepgemm`` unpacks it, the extension and the headers
xz-compressed; ``load`` unpacks those beside the wrappers once and imports the package.

Two kernels, with ``mla.reference``'s signatures (the catalogue's, ``mla.conformance.cases.
indexer``), called as vLLM's indexer calls them on sm_90 (its
``model_executor/layers/sparse_attn_indexer.py`` and ``utils/deep_gemm.py``):

- ``fp8_mqa_logits`` -> ``fp8_fp4_mqa_logits((q, None), (k_codes, k_scale), weights,
  cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k)``: q's scale is already in the weights (sm_90
  takes no q scale), ``max_seqlen_k`` the longest row. DeepGEMM returns each row *compressed*:
  row ``i`` holds keys ``[ks[i], ke[i])`` from column 0 and leaves the rest undefined; the
  adapter puts them back at columns ``ks[i] ..`` of an ``[S, N]`` array of ``-inf`` (a move of
  values, never a change of one). Asked for compressed rows (the reference's
  ``max_seqlen_k``), it passes that width and sets the undefined columns to ``-inf``.
- ``fp8_paged_mqa_logits`` -> ``get_paged_mqa_logits_metadata(context_lens, page, slots)``
  then ``fp8_fp4_paged_mqa_logits((q, None), kv_cache [blocks, page, 1, 132], weights,
  context_lens, block_table, metadata, max_model_len)``. As vLLM, ``context_lens`` is
  ``[B, next_n]``: each query row's own length (query ``n`` of a request of ``L`` sees
  ``L - next_n + n + 1`` keys, our convention, which vLLM computes the same way), and the
  scheduler slots are the SMs, halved for ``next_n = 4`` on sm_90 (a cluster of two CTAs).
  Columns past a row's length are left undefined by DeepGEMM ("not cleaned"); the adapter
  sets them to ``-inf``, as the reference has them (vLLM's top-k reads only up to the
  length). Every value inside a row's length is DeepGEMM's.

What DeepGEMM does not take is "unsupported", checked before it runs: devices other than
CUDA, other head counts than 32 or 64 (its sm_90 kernels), pages other than 32 or 64 keys
(its ``block_kv`` assertion), ``next_n`` other than 1, 2 or 4 (vLLM's
``native_next_n_supported`` on sm_90). ``q`` must be e4m3, ``weights`` float32.
``tests/test_conformance_deepgemm.py`` runs the calls on the CPU with stand-ins for
DeepGEMM's functions.
"""

from __future__ import annotations

import lzma
import tarfile
import threading
from collections.abc import Callable
from types import ModuleType

import torch

from mla.conformance.adapters import (
    import_peer,
    peers_dir,
    require,
    require_device,
    require_dtype,
    unpacked,
    unpacked_tree,
)
from mla.conformance.catalogue import Unsupported
from mla.reference.indexer_logits import (
    check_max_seqlen_k,
    check_ragged_logits_ranges,
    decode_row_ends,
)

__all__ = ["target", "fp8_mqa_logits", "fp8_paged_mqa_logits", "ragged_logits",
           "paged_logits", "load", "PACKAGE", "HEADS", "NEXT_N", "PAGES"]

PEER = "DeepGEMM (vLLM 0.33.0's vllm/third_party/deep_gemm)"
PACKAGE = "vllm.third_party.deep_gemm"
HEADS = (32, 64)  # the sm_90 kernels' head counts
NEXT_N = (1, 2, 4)  # vLLM's native_next_n_supported on sm_90
PAGES = (32, 64)  # the paged kernel's block_kv
_HINT = "python -m benchmarks.peers --deepgemm unpacks it"
_lock = threading.Lock()
_module: list[ModuleType] = []


def load() -> ModuleType:
    """DeepGEMM's package, imported once, after its extension (``_C_extension.abi3.so.xz``)
    and headers (``include.tar.xz``) are unpacked beside it. ``Unsupported`` where it is not
    unpacked or does not import (no CUDA build of torch, a torch whose stable ABI lacks what
    the extension calls)."""
    with _lock:
        if _module:
            return _module[0]
        root = peers_dir() / PACKAGE.replace(".", "/")
        if not (root / "__init__.py").is_file():
            raise Unsupported(f"{PEER} is not unpacked in {peers_dir()} ({_HINT})")
        try:
            for xz in root.glob("*.so.xz"):
                unpacked(xz)
            if (root / "include.tar.xz").is_file():
                unpacked_tree(root / "include.tar.xz")
        except (OSError, EOFError, lzma.LZMAError, tarfile.TarError) as e:
            raise Unsupported(f"{PEER}: cannot unpack it in {root} ({e})"[:500]) from e
        _module.append(import_peer(PACKAGE, PEER, _HINT))
        return _module[0]


def _checked(q: torch.Tensor, weights: torch.Tensor, **tensors: torch.Tensor) -> None:
    require_device(PEER, "cuda", q=q, weights=weights, **tensors)
    require_dtype(PEER, (torch.float8_e4m3fn,), q=q)
    require_dtype(PEER, (torch.float32,), weights=weights)
    require(q.shape[-2] in HEADS, PEER, f"takes {HEADS} heads on sm_90, got {q.shape[-2]}")


def ragged_logits(dg: object, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                  weights: torch.Tensor, cu_seqlen_ks: torch.Tensor,
                  cu_seqlen_ke: torch.Tensor, max_seqlen_k: int = 0) -> torch.Tensor:
    """``dg.fp8_fp4_mqa_logits`` as vLLM's prefill indexer calls it: its compressed rows put
    back at their columns, float32 ``[S, N]`` with ``-inf`` outside each row's ``[ks, ke)``;
    or, ``max_seqlen_k > 0``, kept compressed ``[S, max_seqlen_k]`` with ``-inf`` from
    ``ke - ks`` on (DeepGEMM leaves those columns undefined)."""
    codes, scale = kv
    S, N = q.shape[0], codes.shape[0]
    ks = cu_seqlen_ks.to(torch.int32).contiguous()
    ke = cu_seqlen_ke.to(torch.int32).contiguous()
    span = (ke - ks).clamp_min(0)
    width = max_seqlen_k or max(int(span.max()) if S else 0, 1)
    got = dg.fp8_fp4_mqa_logits((q, None), (codes, scale.float().reshape(N)),  # type: ignore[attr-defined]
                                weights, ks, ke, width)
    j = torch.arange(width, device=q.device)
    inside = j[None, :] < span[:, None]
    if max_seqlen_k:
        return torch.where(inside, got[:, :width].float(), float("-inf"))
    out = torch.full((S, N), float("-inf"), dtype=torch.float32, device=q.device)
    rows = torch.arange(S, device=q.device)[:, None].expand_as(inside)
    cols = (ks[:, None].long() + j[None, :])[inside]
    out[rows[inside], cols] = got[:, :width][inside].float()
    return out


def paged_logits(dg: object, q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                 context_lens: torch.Tensor, block_tables: torch.Tensor, max_model_len: int,
                 num_sms: int) -> torch.Tensor:
    """``dg.fp8_fp4_paged_mqa_logits`` as vLLM's decode indexer calls it (per-row lengths
    ``[B, next_n]``, the scheduler's metadata for ``num_sms`` SMs), columns past each row's
    length set to ``-inf``: float32 ``[B * next_n, max_model_len]``."""
    B, next_n = q.shape[0], q.shape[1]
    rows = decode_row_ends(context_lens, next_n).view(B, next_n)
    page = kv_cache.shape[1]
    slots = num_sms // (2 if next_n == 4 else 1)
    meta = dg.get_paged_mqa_logits_metadata(rows, page, slots)  # type: ignore[attr-defined]
    table = block_tables.to(torch.int32).contiguous()
    got = dg.fp8_fp4_paged_mqa_logits((q, None),  # type: ignore[attr-defined]
                                      kv_cache.reshape(kv_cache.shape[0], page, 1, -1),
                                      weights, rows, table, meta, max_model_len)
    cols = torch.arange(max_model_len, device=q.device)
    seen = cols[None, :] < rows.reshape(-1, 1)
    return torch.where(seen, got[:, :max_model_len].float(), float("-inf"))


def fp8_mqa_logits(q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                   weights: torch.Tensor, cu_seqlen_ks: torch.Tensor,
                   cu_seqlen_ke: torch.Tensor, max_seqlen_k: int = 0) -> torch.Tensor:
    """DeepGEMM's ``fp8_fp4_mqa_logits`` with ``mla.reference.fp8_mqa_logits``' signature
    (``max_seqlen_k``: DeepGEMM's own compressed rows, checked to hold every row as the
    reference checks them)."""
    _checked(q, weights, k_codes=kv[0], k_scale=kv[1])
    require_dtype(PEER, (torch.float8_e4m3fn,), k_codes=kv[0])
    check_max_seqlen_k(max_seqlen_k)
    if not torch.cuda.is_current_stream_capturing():  # (mla bench captures: no host read)
        check_ragged_logits_ranges(cu_seqlen_ks, cu_seqlen_ke, kv[0].shape[0], max_seqlen_k)
    return ragged_logits(load(), q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k)


def fp8_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_tables: torch.Tensor,
                         max_model_len: int) -> torch.Tensor:
    """DeepGEMM's ``fp8_fp4_paged_mqa_logits`` with ``mla.reference.fp8_paged_mqa_logits``'
    signature."""
    _checked(q, weights, kv_cache=kv_cache)
    require(q.shape[1] in NEXT_N, PEER, f"takes next_n in {NEXT_N} on sm_90, got {q.shape[1]}")
    require(kv_cache.dim() == 3, PEER, f"takes a cache [blocks, page, 132], got "
            f"{tuple(kv_cache.shape)}")
    require(kv_cache.shape[1] in PAGES, PEER, f"takes pages of {PAGES} keys, got "
            f"{kv_cache.shape[1]}")
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return paged_logits(load(), q, kv_cache, weights, context_lens, block_tables,
                        max_model_len, sms)


def target() -> dict[str, Callable]:
    """DeepGEMM's ragged and paged indexer logits."""
    return {"fp8_mqa_logits": fp8_mqa_logits, "fp8_paged_mqa_logits": fp8_paged_mqa_logits}
