"""DeepSeek-V4's attention layer, the float64 reference: configs, RoPE, compressor, indexer,
the layer's definition over dense masks and its serving form over paged caches."""

from mla.reference.v4.config import LAYER_KINDS, V4_PRESETS, V4Config, get_v4_config
from mla.reference.v4.rope import rope_gptj, v4_rope_frequencies

__all__ = ["LAYER_KINDS", "V4Config", "V4_PRESETS", "get_v4_config", "rope_gptj",
           "v4_rope_frequencies"]
