"""DeepSeek-V4's attention layer, the float64 reference: configs, RoPE, compressor, indexer,
the layer's definition over dense masks and its serving form over paged caches.

``docs/conventions.md`` §15 states the conventions; ``papers/derivation.md`` §10.2 derives them.
"""

from mla.reference.v4.compressor import (
    CompressorState,
    CompressorWeights,
    compress,
    compress_pool,
    compressed_cache_entries,
    compressor_init_state,
    compressor_kv_score,
    compressor_step,
    round_compressed_entries,
)
from mla.reference.v4.config import LAYER_KINDS, V4_PRESETS, V4Config, get_v4_config
from mla.reference.v4.indexer import (
    IndexerV4Weights,
    indexer_topk_for_layer,
    v4_indexer_k,
    v4_indexer_logits,
    v4_indexer_q,
    v4_indexer_topk,
    v4_indexer_weights,
)
from mla.reference.v4.layer import (
    KV_CACHE_DTYPES,
    V4LayerTrace,
    compressed_mask,
    v4_cache_round,
    v4_layer_definition,
    window_mask,
)
from mla.reference.v4.layer41 import (
    V41_KV_CACHE_DTYPES,
    V41IndexSource,
    V41KVSource,
    V41LayerTrace,
    V41LayerWeights,
    v41_cache_round,
    v41_layer_definition,
    v41_stack_definition,
)
from mla.reference.v4.rope import rope_gptj, v4_rope_frequencies
from mla.reference.v4.serving import V4Cache, v4_layer_step
from mla.reference.v4.serving41 import V41ServingCache, v41_serving_step
from mla.reference.v4.weights import V4LayerWeights, v4_weight_shapes

__all__ = [
    "CompressorState", "CompressorWeights", "IndexerV4Weights", "KV_CACHE_DTYPES", "LAYER_KINDS",
    "V41IndexSource", "V41KVSource", "V41LayerTrace", "V41LayerWeights", "V41ServingCache",
    "V41_KV_CACHE_DTYPES",
    "V4Cache", "V4Config", "V4LayerTrace", "V4LayerWeights", "V4_PRESETS", "compress",
    "compress_pool", "compressed_cache_entries", "compressed_mask", "compressor_init_state",
    "compressor_kv_score", "compressor_step", "get_v4_config", "indexer_topk_for_layer",
    "rope_gptj", "round_compressed_entries", "v4_cache_round", "v4_indexer_k",
    "v4_indexer_logits", "v4_indexer_q", "v4_indexer_topk", "v4_indexer_weights",
    "v41_cache_round", "v41_layer_definition", "v41_serving_step", "v41_stack_definition",
    "v4_layer_definition", "v4_layer_step",
    "v4_rope_frequencies", "v4_weight_shapes", "window_mask",
]
