"""DeepSeek-V4's attention hyper-parameters, its layer kinds, and the presets.

DeepSeek-V4's attention is not MLA with absorbed weights: every layer is multi-query attention
over one 512-wide latent row (448 "nope" values and 64 RoPE values) that is both the key and the
value, with no ``kv_b`` up-projection. A layer is of one of three kinds, by its compression
ratio ``r``:

    r = 1     window only (SWA)   a query at position p sees the raw tokens [max(p-W+1, 0), p]
    r = 4     C4A (CSA)           ... and the indexer's top-k of the compressed entries j with
                                  j < (p+1) // 4
    r = 128   C128A (HCA)         ... and every compressed entry j < (p+1) // 128

The multi-token-prediction (MTP) layers are window-only. Names and defaults follow vLLM 0.33's
``DeepseekV4Attention`` (``vllm/models/deepseek_v4/attention.py``): ``compress_ratio =
max(1, compress_rates[layer_type])``, and 1 for the MTP layers.

Where the numbers come from (none of DeepSeek-V4-Flash's values are in vLLM's wheel):

- ``deepseek-v4-pro``: the widths vLLM 0.33 hard-codes for its AMD single-kernel decode
  (``vllm/models/deepseek_v4/amd/mono/dims.py``: hidden 7168, 128 heads, q rank 1536, 16
  output groups, output rank 1024, window 128, index top-k 1024, eps 1e-6). Its layer list
  (61 layers: two of ratio 128, then 4 and 128 alternating, as Hugging Face transformers'
  ``DeepseekV4Config`` describes Pro's default) is not in the wheel: check it against the
  checkpoint.
- ``deepseek-v4``: DeepSeek-V4-Flash's widths as NVIDIA NeMo's ``DeepseekV4Config`` states them
  (hidden 4096, 64 heads, q rank 1024, 8 groups, output rank 1024, window 128, indexer 64 heads
  of 128 and top-k 512, 43 layers, ``compress_rope_theta`` 160000); its layer kinds as the
  model card gives them: layers 0 and 1 window-only, then ratio 4 on even and 128 on odd
  layers.
- The YaRN factor of the compressed layers' RoPE (16 over an original 65536 positions, for
  the 1M-token context) is this package's assumption, not a published number: take
  ``rope_factor`` and ``original_max_position`` from the checkpoint's ``config.json``.
- ``tiny-v4``: one layer of each kind, DeepSeek-V4's rows (512 = 448 + 64, the indexer's 128)
  so that every cache layout applies, narrow elsewhere (4 heads in 2 groups, hidden 64) and a
  window of 8 and top-k of 3, so that sequences of tens of tokens reach every case: a window
  that slides, several compressed entries, a top-k smaller than the visible entries.
- ``tiny-v41``: DeepSeek-V4.1's layer kinds at ``tiny-v4``'s widths: seven layers, window-only
  at both ends, ratios 2 and 1 between them; layers 1 and 3 keep the compressed cache, 1, 3
  and 4 the index keys, layer 3 the candidate blocks (2 blocks of 2); a window of 4.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["V4Config", "V4_PRESETS", "get_v4_config", "LAYER_KINDS", "V41_RATIOS", "VERSIONS"]

# compression ratio -> the name vLLM and the papers give the layer kind
LAYER_KINDS = {1: "SWA", 4: "C4A", 128: "C128A"}
# DeepSeek-V4.1's ratios: 0 window only, 1 full-length compressed, 2 compressed by 2
V41_RATIOS = (0, 1, 2)
VERSIONS = ("v4", "v4.1")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"V4Config.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class V4Config:
    """One DeepSeek-V4 model's attention hyper-parameters.

    ``compress_ratios[i]`` is layer ``i``'s ratio (1, 4 or 128); the ``num_mtp_layers`` MTP
    layers come after and are window-only. ``q_head_norm`` is V4's weightless per-head RMSNorm
    of the query (DeepSeek-V4.1 drops it).

    ``version="v4.1"``: ratios in {0, 1, 2}, the source-layer fields set (see the module doc);
    ``mtp_compress_ratios``: the MTP layers' ratios where the config lists them (V4.1's
    ``compress_ratios`` may run past the backbone), else window-only.
    """

    name: str
    hidden_size: int
    num_heads: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    head_dim: int = 512
    rope_head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_max_position: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    num_mtp_layers: int = 1
    q_head_norm: bool = True
    version: str = "v4"
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    mtp_compress_ratios: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for field in ("hidden_size", "num_heads", "q_lora_rank", "o_lora_rank", "o_groups",
                      "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
                      "head_dim", "rope_head_dim", "original_max_position"):
            _positive(field, getattr(self, field))
        if isinstance(self.num_mtp_layers, bool) or not isinstance(self.num_mtp_layers, int) \
                or self.num_mtp_layers < 0:
            raise ValueError(
                f"V4Config.num_mtp_layers must be an int >= 0, got {self.num_mtp_layers!r}")
        if not isinstance(self.compress_ratios, tuple) or not self.compress_ratios:
            raise ValueError("V4Config.compress_ratios must be a non-empty tuple, got "
                             f"{self.compress_ratios!r}")
        if self.version not in VERSIONS:
            raise ValueError(f"V4Config.version must be one of {VERSIONS}, got "
                             f"{self.version!r}")
        allowed = sorted(LAYER_KINDS) if self.version == "v4" else list(V41_RATIOS)
        if not isinstance(self.mtp_compress_ratios, tuple):
            raise ValueError("V4Config.mtp_compress_ratios must be a tuple, got "
                             f"{self.mtp_compress_ratios!r}")
        bad = [r for r in self.compress_ratios + self.mtp_compress_ratios
               if isinstance(r, bool) or r not in allowed]
        if bad:
            raise ValueError(f"V4Config.compress_ratios: each ratio must be one of "
                             f"{allowed}, got {bad[0]!r}")
        self._check_sources()
        if self.num_heads % self.o_groups:
            raise ValueError(f"V4Config.num_heads ({self.num_heads}) must be a multiple of "
                             f"o_groups ({self.o_groups})")
        if self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            raise ValueError(f"V4Config.rope_head_dim must be even and <= head_dim "
                             f"({self.head_dim}), got {self.rope_head_dim}")
        if self.index_head_dim < self.rope_head_dim:
            raise ValueError(f"V4Config.index_head_dim must be >= rope_head_dim "
                             f"({self.rope_head_dim}), got {self.index_head_dim}")
        if self.rope_factor < 1.0:
            raise ValueError(f"V4Config.rope_factor must be >= 1, got {self.rope_factor}")

    def _check_sources(self) -> None:
        n = self.num_layers
        for field in ("kv_source_layer_ids", "index_source_layer_ids"):
            ids = getattr(self, field)
            if not isinstance(ids, tuple) or any(
                    isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in ids):
                raise ValueError(f"V4Config.{field} must be a tuple of backbone layer ids in "
                                 f"[0, {n}), got {ids!r}")
        if self.version == "v4":
            if (self.kv_source_layer_ids or self.index_source_layer_ids
                    or self.candidate_source_layer_id != -1 or self.mtp_compress_ratios):
                raise ValueError("V4Config: the source layers, candidates and "
                                 "mtp_compress_ratios are DeepSeek-V4.1's (version='v4.1')")
            return
        if self.num_mtp_layers < len(self.mtp_compress_ratios):
            raise ValueError("V4Config.mtp_compress_ratios is longer than num_mtp_layers")
        for layer in range(n + self.num_mtp_layers):
            if self.layer_ratio(layer) and not (
                    any(s <= layer for s in self.kv_source_layer_ids)
                    and any(s <= layer for s in self.index_source_layer_ids)):
                raise ValueError(f"V4Config: compressed layer {layer} has no kv and index "
                                 f"source layer at or below it")
        c = self.candidate_source_layer_id
        if isinstance(c, bool) or not isinstance(c, int) or (
                c != -1 and c not in self.index_source_layer_ids):
            raise ValueError(f"V4Config.candidate_source_layer_id must be -1 or an index "
                             f"source layer, got {c!r}")
        for field in ("candidate_topk_blocks", "candidate_block_size"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (c != -1 and v == 0):
                raise ValueError(f"V4Config.{field} must be an int >= 0, > 0 with a "
                                 f"candidate source, got {v!r}")

    # --- derived -----------------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``head_dim^-0.5`` over the whole 512-wide row (no YaRN mscale: it is 1 in V4)."""
        return self.head_dim ** -0.5

    @property
    def num_layers(self) -> int:
        return len(self.compress_ratios)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.o_groups

    def layer_ratio(self, layer: int) -> int:
        """Layer ``layer``'s compression ratio; the MTP layers (``num_layers`` on) are
        window-only (1 in V4, 0 in V4.1) unless ``mtp_compress_ratios`` lists them."""
        self._check_layer(layer)
        if layer < self.num_layers:
            return self.compress_ratios[layer]
        mtp = layer - self.num_layers
        if mtp < len(self.mtp_compress_ratios):
            return self.mtp_compress_ratios[mtp]
        return 1 if self.version == "v4" else 0

    def _check_layer(self, layer: object) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not (
                0 <= layer < self.num_layers + self.num_mtp_layers):
            raise ValueError(f"layer must be an int in [0, {self.num_layers + self.num_mtp_layers})"
                             f", got {layer!r}")

    def _source(self, layer: int, ids: tuple[int, ...]) -> int | None:
        if self.version != "v4.1":
            raise ValueError("source layers are DeepSeek-V4.1's (version='v4.1')")
        if self.layer_ratio(layer) == 0:
            return None
        return max(s for s in ids if s <= layer)

    def kv_source_layer(self, layer: int) -> int | None:
        """V4.1: the layer whose compressor and compressed cache ``layer`` reads (the nearest
        kv source at or below it); ``None`` for a window-only layer."""
        return self._source(layer, self.kv_source_layer_ids)

    def index_source_layer(self, layer: int) -> int | None:
        """V4.1: the layer whose indexer's top-k ``layer`` uses (the nearest index source at
        or below it); ``None`` for a window-only layer."""
        return self._source(layer, self.index_source_layer_ids)

    def owns_compressor(self, layer: int) -> bool:
        """V4.1: a backbone kv-source layer (its compressor, compressed cache, ``wk`` and
        ``k_norm`` and the index key cache)."""
        self._check_layer(layer)
        return layer < self.num_layers and layer in self.kv_source_layer_ids

    def owns_indexer(self, layer: int) -> bool:
        """V4.1: a backbone index-source layer (an indexer of its own)."""
        self._check_layer(layer)
        return layer < self.num_layers and layer in self.index_source_layer_ids

    def candidate_role(self, layer: int) -> str | None:
        """V4.1, for an indexer-owning layer: ``"write"`` (the candidate source), ``"mask"``
        (an indexer after it), else ``None`` (no candidates)."""
        c = self.candidate_source_layer_id
        if not self.owns_indexer(layer) or c < 0 or layer < c:
            return None
        return "write" if layer == c else "mask"

    def compressor_overlap(self, ratio: int) -> bool:
        """Ratio 4 pools two overlapping blocks (``coff = 2``); ratio 128 one block; no V4.1
        ratio overlaps."""
        return self.version == "v4" and ratio == 4

    def replace(self, **changes: object) -> V4Config:
        return dataclasses.replace(self, **changes)


def _flash_ratios(num_layers: int) -> tuple[int, ...]:
    return tuple(1 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(num_layers))


def _pro_ratios(num_layers: int) -> tuple[int, ...]:
    return tuple(128 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(num_layers))


def _v41_flash_ratios(num_layers: int) -> tuple[int, ...]:
    """An assumption (the ratios are not in the wheel), kept consistent with what vLLM 0.33
    states of them: its later indexers (layers 24, 28, 32, 36) are ratio-1 ones
    (``models/deepseek_v41/nvidia/model.py:766-768``), the last KV source (layer 20) has ratio
    at most 1 (``:867``), and a layer reads its source's cache at its own ratio: window only
    below layer 2, ratio 2 from the first source (2), ratio 1 from the last (20)."""
    return tuple(0 if i < 2 else 2 if i < 20 else 1 for i in range(num_layers))


V4_PRESETS: dict[str, V4Config] = {
    "deepseek-v4.1-flash": V4Config(
        name="deepseek-v4.1-flash", hidden_size=5120, num_heads=64, q_lora_rank=1280,
        o_lora_rank=1024, o_groups=8, sliding_window=128, compress_ratios=_v41_flash_ratios(40),
        index_topk=512, q_head_norm=False, version="v4.1", kv_source_layer_ids=(2, 8, 14, 20),
        index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36)),
    "deepseek-v4": V4Config(
        name="deepseek-v4", hidden_size=4096, num_heads=64, q_lora_rank=1024, o_lora_rank=1024,
        o_groups=8, sliding_window=128, compress_ratios=_flash_ratios(43), index_topk=512),
    "deepseek-v4-pro": V4Config(
        name="deepseek-v4-pro", hidden_size=7168, num_heads=128, q_lora_rank=1536,
        o_lora_rank=1024, o_groups=16, sliding_window=128, compress_ratios=_pro_ratios(61),
        index_topk=1024),
    "tiny-v4": V4Config(
        name="tiny-v4", hidden_size=64, num_heads=4, q_lora_rank=32, o_lora_rank=16, o_groups=2,
        sliding_window=8, compress_ratios=(1, 4, 128), index_n_heads=4, index_topk=3,
        rope_factor=4.0, original_max_position=256),
    "tiny-v41": V4Config(
        name="tiny-v41", hidden_size=64, num_heads=4, q_lora_rank=32, o_lora_rank=16,
        o_groups=2, sliding_window=4, compress_ratios=(0, 2, 2, 1, 1, 1, 0), index_n_heads=4,
        index_topk=3, q_head_norm=False, version="v4.1", kv_source_layer_ids=(1, 3),
        index_source_layer_ids=(1, 3, 4), candidate_source_layer_id=3, candidate_topk_blocks=2,
        candidate_block_size=2, rope_factor=4.0, original_max_position=256),
}


def get_v4_config(name: str) -> V4Config:
    """A preset by name (``deepseek-v4``, ``deepseek-v4-pro``, ``deepseek-v4.1-flash``,
    ``tiny-v4``, ``tiny-v41``)."""
    try:
        return V4_PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown DeepSeek-V4 preset {name!r}; known: {sorted(V4_PRESETS)}") from None
