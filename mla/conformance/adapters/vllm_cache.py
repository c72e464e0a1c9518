"""vLLM 0.33.0's CUDA kernels of the paged caches as a conformance target: the writes of the
MLA latent cache (bf16 and ``fp8_ds_mla``) and of the indexer's key cache, and the gather of
the latent cache for chunked prefill.

They are in the wheel's ``vllm/_C_stable_libtorch.abi3.so`` (``vllm_library.load_library``;
``python -m benchmarks.peers --topk`` unpacks it), registered as ``torch.ops._C_cache_ops``,
and called as vLLM 0.33 calls them (its ``_custom_ops.py``, ``v1/attention/backend.py``,
``model_executor/layers/attention/mla_attention.py``, ``sparse_attn_indexer.py``):

- ``concat_and_cache_mla`` -> ``concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping,
  "auto", scale, skip_scale=False)``, ``k_pe [T, 1, R]`` squeezed to ``[T, R]`` as vLLM's
  backend does, ``scale`` a float32 one (unused by ``"auto"``);
- ``concat_and_cache_fp8_ds_mla`` -> the same kernel with ``kv_cache_dtype = "fp8_ds_mla"``
  (the DeepSeek-V3.2 sparse cache: 512 e4m3 values, four float32 tile scales, 64 bf16 rope
  values a token);
- ``indexer_k_quant_and_cache`` -> ``indexer_k_quant_and_cache(k, kv_cache, slot_mapping,
  128, "ue8m0")``: quantization blocks of 128 (one a token) and power-of-two scales, as
  DeepSeek-V3.2's config (``scale_fmt``) asks;
- ``gather_cache`` -> ``cp_gather_cache(src_cache, dst, block_table, cu_seq_lens,
  batch_size, seq_starts)``, returning ``dst[:cu_seq_lens[-1]]`` as the catalogue's contract
  does.

The adapter converts only dtypes of indices (``slot_mapping`` int64, tables and lengths
int32, as vLLM builds them) and the shape of ``k_pe``; every byte the kernels write is
compared. What they do not take is "unsupported": tensors off CUDA.
``tests/test_conformance_vllm_cache.py`` runs the calls on the CPU with stand-ins.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mla.conformance.adapters import require_device
from mla.conformance.adapters.vllm_library import load_library

__all__ = ["target", "write_latent", "write_indexer_keys", "gather_latent",
           "INDEXER_QUANT_BLOCK", "INDEXER_SCALE_FMT"]

PEER = "vLLM's cache kernels (vllm/_C_stable_libtorch.abi3.so)"
INDEXER_QUANT_BLOCK = 128  # one block a token of 128 values
INDEXER_SCALE_FMT = "ue8m0"  # DeepSeek-V3.2's scale_fmt: power-of-two scales


def _ops() -> object:
    """``torch.ops._C_cache_ops`` with vLLM's kernels registered (``load_library``)."""
    load_library()
    return torch.ops._C_cache_ops


def _takes_skip_scale(op: object) -> bool:
    schema = getattr(getattr(op, "default", None), "_schema", None)
    return schema is None or any(a.name == "skip_scale" for a in schema.arguments)


def write_latent(ops: object, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_cache_dtype: str) -> None:
    """``ops.concat_and_cache_mla`` as vLLM's attention backend calls it: ``k_pe [T, 1, R]``
    squeezed, slots int64 and flat, a unit float32 scale."""
    op = ops.concat_and_cache_mla  # type: ignore[attr-defined]
    if k_pe.dim() == 3:
        k_pe = k_pe.squeeze(1)
    scale = torch.ones(1, dtype=torch.float32, device=kv_c.device)
    extra = (False,) if _takes_skip_scale(op) else ()
    op(kv_c, k_pe, kv_cache, slot_mapping.flatten().long(), kv_cache_dtype, scale, *extra)


def write_indexer_keys(ops: object, k: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """``ops.indexer_k_quant_and_cache`` as vLLM's sparse indexer calls it for V3.2."""
    ops.indexer_k_quant_and_cache(k, kv_cache, slot_mapping.long(),  # type: ignore[attr-defined]
                                  INDEXER_QUANT_BLOCK, INDEXER_SCALE_FMT)


def gather_latent(ops: object, src_cache: torch.Tensor, dst: torch.Tensor,
                  block_table: torch.Tensor, cu_seq_lens: torch.Tensor, batch_size: int,
                  seq_starts: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.cp_gather_cache`` as vLLM's chunked MLA prefill calls it; ``dst``'s filled
    rows."""
    cu = cu_seq_lens.to(torch.int32).contiguous()
    starts = None if seq_starts is None else seq_starts.to(torch.int32).contiguous()
    ops.cp_gather_cache(src_cache, dst, block_table.to(torch.int32).contiguous(), cu,  # type: ignore[attr-defined]
                        batch_size, starts)
    return dst[:int(cu[-1])] if cu.numel() else dst[:0]


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """vLLM's ``concat_and_cache_mla`` (``"auto"``) with ``mla.reference``'s signature."""
    require_device(PEER, "cuda", kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache,
                   slot_mapping=slot_mapping)
    write_latent(_ops(), kv_c, k_pe, kv_cache, slot_mapping, "auto")


def concat_and_cache_fp8_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                                slot_mapping: torch.Tensor) -> None:
    """vLLM's ``concat_and_cache_mla`` (``"fp8_ds_mla"``) with ``mla.reference``'s
    signature."""
    require_device(PEER, "cuda", kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache,
                   slot_mapping=slot_mapping)
    write_latent(_ops(), kv_c, k_pe, kv_cache, slot_mapping, "fp8_ds_mla")


def indexer_k_quant_and_cache(k: torch.Tensor, kv_cache: torch.Tensor,
                              slot_mapping: torch.Tensor) -> None:
    """vLLM's ``indexer_k_quant_and_cache`` with ``mla.reference``'s signature."""
    require_device(PEER, "cuda", k=k, kv_cache=kv_cache, slot_mapping=slot_mapping)
    write_indexer_keys(_ops(), k, kv_cache, slot_mapping)


def gather_cache(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                 cu_seq_lens: torch.Tensor, batch_size: int,
                 seq_starts: torch.Tensor | None = None) -> torch.Tensor:
    """vLLM's ``cp_gather_cache`` with ``mla.reference.gather_cache``'s signature."""
    require_device(PEER, "cuda", src_cache=src_cache, dst=dst, block_table=block_table,
                   cu_seq_lens=cu_seq_lens, seq_starts=seq_starts)
    return gather_latent(_ops(), src_cache, dst, block_table, cu_seq_lens, batch_size,
                         seq_starts)


def target() -> dict[str, Callable]:
    """vLLM's cache writes and gather."""
    return {"concat_and_cache_mla": concat_and_cache_mla,
            "concat_and_cache_fp8_ds_mla": concat_and_cache_fp8_ds_mla,
            "indexer_k_quant_and_cache": indexer_k_quant_and_cache,
            "gather_cache": gather_cache}
