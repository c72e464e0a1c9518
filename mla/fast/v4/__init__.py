"""DeepSeek-V4's attention layer on the fast path (``mla.reference.v4``'s kernels in Triton).

- ``compressor``: ``v4_compress_store``, the compressor's pooling, norm, rope and cache store;
- ``front``: ``v4_q_rope_kv_insert``, the query's head norm and rope, the window key's store;
- ``indexer``: ``v4_indexer_q_prep`` and ``v4_indexer_topk_paged``, the C4A indexer;
- ``layer``: ``V4FastCache`` and ``v4_layer_step`` (decode and prefill), with a stage trace;
- ``decode_step``: ``v4_decode_step``, one token a request, every index built on the device
  (capturable in a CUDA graph);
- ``common``: the RoPE table and the bit-exact roundings they share.
"""

from mla.fast.v4.common import v4_cos_sin_cache
from mla.fast.v4.compressor import v4_compress_store
from mla.fast.v4.decode_step import v4_decode_step
from mla.fast.v4.front import v4_q_rope_kv_insert
from mla.fast.v4.indexer import v4_indexer_q_prep, v4_indexer_topk_paged
from mla.fast.v4.layer import V4FastCache, V4FastTrace, v4_layer_step

__all__ = ["V4FastCache", "V4FastTrace", "v4_compress_store", "v4_cos_sin_cache",
           "v4_decode_step", "v4_indexer_q_prep", "v4_indexer_topk_paged", "v4_layer_step",
           "v4_q_rope_kv_insert"]
