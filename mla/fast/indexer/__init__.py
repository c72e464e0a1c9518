"""The lightning indexer of DeepSeek-V3.2 in Triton: its fp8 key cache and its logits.

- ``cache``: ``indexer_k_quant_and_cache``, the keys quantized and written to their pages;
- ``logits``: ``fp8_mqa_logits``, the ragged prefill logits (and ``logits_budget``, their
  error budget);
- ``logits_paged``: ``fp8_paged_mqa_logits``, the paged decode logits;
- ``query``: ``quantize_indexer_q``, the query's e4m3 codes with its scale in the weights;
- ``logits_tile``: what both logits kernels share (``LogitsPlan``, the tile, the key splits).

The top-k over the logits is ``mla.fast.topk``; the reference is ``mla.reference.indexer``.
"""

from mla.fast.indexer.cache import indexer_k_quant_and_cache
from mla.fast.indexer.logits import fp8_mqa_logits, fp8_paged_mqa_logits
from mla.fast.indexer.query import quantize_indexer_q

__all__ = ["fp8_mqa_logits", "fp8_paged_mqa_logits", "indexer_k_quant_and_cache",
           "quantize_indexer_q"]
