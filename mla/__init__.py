"""mla: a reference and fast kernels for DeepSeek's Multi-head Latent Attention."""

from mla.config import PRESETS, MLAConfig, get_config, kv_cache_comparison
from mla.weights import MLAWeights

__version__ = "0.1.0"
__all__ = ["MLAConfig", "MLAWeights", "PRESETS", "get_config", "kv_cache_comparison"]
