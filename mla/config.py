"""Model shapes of Multi-head Latent Attention, and what they imply for the KV cache.

One flat dataclass holds the attention hyper-parameters of a DeepSeek model (the names are
those of conventions §0 and of the module docstring of vLLM 0.11
``v1/attention/backends/mla/common.py``):

    H    hidden_size           N    num_heads
    Lq   q_lora_rank           Lkv  kv_lora_rank
    P    qk_nope_head_dim      R    qk_rope_head_dim      V   v_head_dim

The cache of MLA holds, per token and layer, the normed latent ``kv_c`` (Lkv numbers) and the
shared rope key ``k_pe`` (R numbers): 576 numbers for DeepSeek, against ``2·N·d_h`` for MHA.
``kv_cache_comparison`` prints DeepSeek-V2's Table 1 from these formulas (DeepSeek-V2,
arXiv 2405.04434, section 2.1.4):

    MHA  2·n_h·d_h·l      GQA  2·n_g·d_h·l      MQA  2·d_h·l      MLA  (d_c + d_h^R)·l
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = ["MLAConfig", "PRESETS", "get_config", "kv_cache_comparison"]


@dataclass(frozen=True)
class MLAConfig:
    """Attention hyper-parameters of one MLA layer (and the layer count, for cache sizes).

    ``q_lora_rank=None`` means no query compression (DeepSeek-V2-Lite): ``q = h @ W_Q``.
    RoPE is YaRN-scaled when ``rope_factor > 1`` and ``max_seq_len > original_seq_len``
    (the rule of DeepSeek's released inference code); the softmax scale then gains the
    factor ``mscale**2`` with ``mscale = 0.1 * rope_mscale * ln(rope_factor) + 1``.
    """

    name: str
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_style: str = "interleaved"  # DeepSeek's code: pairs (x[2i], x[2i+1]); or "neox"
    rope_factor: float = 1.0
    original_seq_len: int = 4096
    max_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    rope_mscale: float = 1.0
    # DeepSeek-V3.2 lightning indexer (0 when the model has none)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0

    def __post_init__(self) -> None:
        positive = ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim",
                    "qk_rope_head_dim", "v_head_dim", "num_layers")
        for field in positive:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MLAConfig.{field} must be a positive int, got {value!r}")
        if self.q_lora_rank is not None and (isinstance(self.q_lora_rank, bool)
                                             or not isinstance(self.q_lora_rank, int)
                                             or self.q_lora_rank <= 0):
            raise ValueError(
                f"MLAConfig.q_lora_rank must be None or a positive int, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"MLAConfig.qk_rope_head_dim must be even (RoPE rotates pairs), "
                f"got {self.qk_rope_head_dim}")
        if self.rope_style not in ("interleaved", "neox"):
            raise ValueError(
                f"MLAConfig.rope_style must be 'interleaved' or 'neox', got {self.rope_style!r}")
        if self.rope_factor < 1.0:
            raise ValueError(f"MLAConfig.rope_factor must be >= 1, got {self.rope_factor}")

    # --- derived sizes -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """P + R: the head dim of the compute-friendly (MHA) path."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Lkv + R: the width of one cached row and of the absorbed (MQA) path's q and k."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def yarn_active(self) -> bool:
        return self.rope_factor > 1.0 and self.max_seq_len > self.original_seq_len

    @property
    def mscale(self) -> float:
        if not self.yarn_active:
            return 1.0
        return 0.1 * self.rope_mscale * math.log(self.rope_factor) + 1.0

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(P + R), times mscale² under YaRN. The absorbed path keeps this scale too."""
        return self.qk_head_dim ** -0.5 * self.mscale ** 2

    def cache_numbers_per_token_per_layer(self) -> int:
        """Numbers cached per token and layer: Lkv + R (576 for DeepSeek)."""
        return self.latent_dim

    def cache_bytes_per_token_per_layer(self, bytes_per_number: int = 2) -> int:
        return self.latent_dim * bytes_per_number

    def cache_bytes_per_token(self, bytes_per_number: int = 2) -> int:
        """All layers together."""
        return self.cache_bytes_per_token_per_layer(bytes_per_number) * self.num_layers

    def replace(self, **changes: object) -> MLAConfig:
        return dataclasses.replace(self, **changes)


_YARN_V2 = dict(rope_factor=40.0, original_seq_len=4096, max_seq_len=163840,
                beta_fast=32.0, beta_slow=1.0, rope_mscale=0.707)
_YARN_V3 = dict(rope_factor=40.0, original_seq_len=4096, max_seq_len=163840,
                beta_fast=32.0, beta_slow=1.0, rope_mscale=1.0)

PRESETS: dict[str, MLAConfig] = {
    "deepseek-v2": MLAConfig("deepseek-v2", 5120, 128, 1536, 512, 128, 64, 128, 60, **_YARN_V2),
    "deepseek-v2-lite": MLAConfig("deepseek-v2-lite", 2048, 16, None, 512, 128, 64, 128, 27,
                                  **_YARN_V2),
    "deepseek-v3": MLAConfig("deepseek-v3", 7168, 128, 1536, 512, 128, 64, 128, 61, **_YARN_V3),
    "deepseek-v3.2": MLAConfig("deepseek-v3.2", 7168, 128, 1536, 512, 128, 64, 128, 61,
                               index_n_heads=64, index_head_dim=128, index_topk=2048,
                               **_YARN_V3),
    "tiny": MLAConfig("tiny", 64, 4, 48, 32, 16, 8, 16, 2),
}


def get_config(name: str) -> MLAConfig:
    """A preset by name: one of ``PRESETS``."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}") from None


def kv_cache_comparison(config: MLAConfig, num_groups: int = 8) -> list[dict[str, object]]:
    """DeepSeek-V2 Table 1 for ``config``: KV cache numbers per token, all layers.

    ``d_h`` is the per-head dim of an equivalent MHA (``qk_nope_head_dim``, 128 for DeepSeek),
    ``n_g`` the number of GQA groups. The MLA row is ``(d_c + d_h^R)·l``, which the paper writes
    as about ``4.5·d_h·l`` for DeepSeek-V2 (``d_c = 4·d_h``, ``d_h^R = d_h / 2``).
    """
    n_h, d_h, layers = config.num_heads, config.qk_nope_head_dim, config.num_layers
    rows = [
        ("MHA", "2·n_h·d_h·l", 2 * n_h * d_h * layers),
        ("GQA", "2·n_g·d_h·l", 2 * num_groups * d_h * layers),
        ("MQA", "2·d_h·l", 2 * d_h * layers),
        ("MLA", "(d_c + d_h^R)·l", config.latent_dim * layers),
    ]
    return [
        {"attention": name, "formula": formula, "numbers_per_token": value,
         "in_units_of_d_h_l": value / (d_h * layers)}
        for name, formula, value in rows
    ]
