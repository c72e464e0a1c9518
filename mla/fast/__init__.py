"""Optimized GPU kernels (Triton) with the kernel-level API of ``mla.reference``.

Each kernel here mirrors the reference function of the same name and is checked against it
tensor by tensor (``python -m mla.check`` on a GPU; the tests under ``TRITON_INTERPRET=1``).
Modules mirror the reference's (``mla.fast.decode`` ↔ ``mla.reference.decode``, ...). The
dense path's pieces are modules here (``attention``, ``prefill``, ``chunked``, ``merge``,
``paged_cache``, ``fp8``, ``model``); each kernel family with several modules is a subpackage
whose ``__init__`` holds its public calls:

- ``decode``: paged absorbed decode (``combine``: the end of a split);
- ``sparse``: sparse top-k attention (``kernels``, ``plan``, ``index``: the index conversion,
  ``gather``: the prefill's latent and index-key gathers, ``model``: whole V3.2 layers);
- ``indexer``: the lightning indexer's key cache and logits;
- ``topk``: ``top_k_per_row`` (``kernels``, ``fused``: the one-launch kernel, ``search``);
- ``sm90``: the Gluon kernels for Hopper that decode and sparse route their 64-row programs to;
- ``dcp``: decode context parallelism.

``common``, ``launch`` and ``softmax`` hold what the others share.
"""

try:
    import triton  # noqa: F401
except ModuleNotFoundError as e:
    if e.name != "triton":
        raise
    raise ImportError(
        'mla.fast needs Triton, which is not installed: pip install "triton>=3.6,<3.8" (a '
        "CUDA build of torch brings the matching one; in a checkout of this repository, "
        'pip install -e ".[triton]"). mla.reference needs only torch.') from e

from mla.fast.attention import attention_with_lse, flash_attention_with_lse
from mla.fast.chunked import chunked_prefill_attention
from mla.fast.common import set_validation, validation, validation_enabled
from mla.fast.dcp.correction import cp_lse_ag_out_rs
from mla.fast.decode import DecodePlan, mla_decode_paged, plan_decode
from mla.fast.fp8 import concat_and_cache_fp8_ds_mla
from mla.fast.indexer.cache import indexer_k_quant_and_cache
from mla.fast.indexer.logits import fp8_mqa_logits, fp8_paged_mqa_logits
from mla.fast.indexer.query import quantize_indexer_q
from mla.fast.merge import merge_attn_states
from mla.fast.model import chunked_prefill_forward, decode_forward, write_context
from mla.fast.paged_cache import concat_and_cache_mla, gather_cache
from mla.fast.prefill import prefill_attention
from mla.fast.sparse import (
    SparsePlan,
    convert_req_index_to_global_index,
    plan_sparse,
    sparse_mla_decode,
    sparse_mla_prefill,
)
from mla.fast.sparse.front import sparse_front
from mla.fast.sparse.gather import gather_and_upconvert_fp8_ds_mla, gather_indexer_k_cache
from mla.fast.sparse.model import sparse_decode_forward, sparse_prefill_forward
from mla.fast.topk import top_k_per_row

__all__ = ["DecodePlan", "SparsePlan", "attention_with_lse", "chunked_prefill_attention",
           "chunked_prefill_forward", "decode_forward", "sparse_decode_forward", "sparse_front",
           "sparse_prefill_forward", "write_context",
           "concat_and_cache_fp8_ds_mla", "concat_and_cache_mla", "cp_lse_ag_out_rs",
           "convert_req_index_to_global_index", "flash_attention_with_lse", "gather_cache",
           "fp8_mqa_logits", "fp8_paged_mqa_logits", "gather_and_upconvert_fp8_ds_mla",
           "gather_indexer_k_cache", "indexer_k_quant_and_cache",
           "merge_attn_states", "mla_decode_paged", "plan_decode", "plan_sparse",
           "prefill_attention", "quantize_indexer_q", "set_validation", "sparse_mla_decode",
           "sparse_mla_prefill", "top_k_per_row", "validation", "validation_enabled"]
