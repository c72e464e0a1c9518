"""One DeepSeek-V4 attention layer's weights, in the checkpoint's names.

Names relative to the layer's prefix (``layers.{i}.attn.`` in DeepSeek's checkpoint,
``model.layers.{i}.attn.`` in vLLM; the MTP layers ``mtp.{k}.attn.``), as vLLM 0.33 loads
them (``vllm/models/deepseek_v4/nvidia/model.py``, ``load_weights``: ``wq_a`` and ``wkv``
fused into ``fused_wqa_wkv``, ``compressor.wkv`` and ``compressor.wgate`` into
``compressor.fused_wkv_wgate``). PyTorch ``Linear`` layout, ``y = x @ W.T``; ``d = 512``,
``coff = 2`` at ratio 4 and 1 at ratio 128, ``n_I`` / ``d_I`` the indexer's heads and width:

    name                              shape                 ratios
    wq_a.weight                       [q_lora_rank, hidden]  all
    q_norm.weight                     [q_lora_rank]          all
    wq_b.weight                       [H·d, q_lora_rank]     all     head h: rows [h·d, h·d+d)
    wkv.weight                        [d, hidden]            all
    kv_norm.weight                    [d]                    all
    attn_sink                         [H] float32            all
    wo_a.weight                       [G·o_rank, (H/G)·d]    all     group g: rows [g·o_rank, ...)
    wo_b.weight                       [hidden, G·o_rank]     all
    compressor.wkv.weight             [coff·d, hidden]       4, 128
    compressor.wgate.weight           [coff·d, hidden]       4, 128
    compressor.ape                    [r, coff·d] float32    4, 128
    compressor.norm.weight            [d]                    4, 128
    indexer.wq_b.weight               [n_I·d_I, q_lora_rank] 4
    indexer.weights_proj.weight       [n_I, hidden]          4
    indexer.compressor.*              as above with d_I      4

A checkpoint's FP8 linear weights come with ``{name}.scale`` (one per 128x128 block, float32
or UE8M0); ``V4LayerWeights.from_state_dict`` multiplies them out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla.reference.v4.config import V4Config

__all__ = ["V4LayerWeights", "check_weights", "random_weights", "v4_weight_shapes"]

WEIGHT_BLOCK = 128  # DeepSeek's FP8 block-quantized weights: one scale per 128x128 block


def _compressor_shapes(prefix: str, d: int, ratio: int, hidden: int
                       ) -> dict[str, tuple[int, ...]]:
    coff = 2 if ratio == 4 else 1
    return {f"{prefix}wkv.weight": (coff * d, hidden),
            f"{prefix}wgate.weight": (coff * d, hidden),
            f"{prefix}ape": (ratio, coff * d),
            f"{prefix}norm.weight": (d,)}


def v4_weight_shapes(config: V4Config, ratio: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of a layer of compression ratio ``ratio``."""
    if ratio not in (1, 4, 128):
        raise ValueError(f"ratio must be 1, 4 or 128, got {ratio!r}")
    c, d = config, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "wq_a.weight": (c.q_lora_rank, c.hidden_size),
        "q_norm.weight": (c.q_lora_rank,),
        "wq_b.weight": (c.num_heads * d, c.q_lora_rank),
        "wkv.weight": (d, c.hidden_size),
        "kv_norm.weight": (d,),
        "attn_sink": (c.num_heads,),
        "wo_a.weight": (c.o_groups * c.o_lora_rank, c.heads_per_group * d),
        "wo_b.weight": (c.hidden_size, c.o_groups * c.o_lora_rank),
    }
    if ratio > 1:
        shapes.update(_compressor_shapes("compressor.", d, ratio, c.hidden_size))
    if ratio == 4:
        shapes["indexer.wq_b.weight"] = (c.index_n_heads * c.index_head_dim, c.q_lora_rank)
        shapes["indexer.weights_proj.weight"] = (c.index_n_heads, c.hidden_size)
        shapes.update(_compressor_shapes("indexer.compressor.", c.index_head_dim, ratio,
                                         c.hidden_size))
    return shapes


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _dequantize_block_fp8(weight: torch.Tensor, scale: torch.Tensor, key: str) -> torch.Tensor:
    """``weight`` (FP8) times its per-128x128-block ``scale``, in float64."""
    rows, cols = weight.shape
    blocks = (-(-rows // WEIGHT_BLOCK), -(-cols // WEIGHT_BLOCK))
    if tuple(scale.shape) != blocks:
        raise ValueError(f"state dict entry {key!r}.scale must have shape {list(blocks)} (one "
                         f"per {WEIGHT_BLOCK}x{WEIGHT_BLOCK} block of {list(weight.shape)}), "
                         f"got {list(scale.shape)}")
    full = scale.double().repeat_interleave(WEIGHT_BLOCK, 0).repeat_interleave(WEIGHT_BLOCK, 1)
    return weight.double() * full[:rows, :cols]


def check_weights(tensors: object, want: dict[str, tuple[int, ...]], owner: str) -> None:
    """``tensors`` holds exactly the names of ``want``, each a float tensor of its shape;
    ``owner`` says whose they are in the messages ("a layer of ratio 4")."""
    if not isinstance(tensors, dict):
        raise TypeError(f"tensors must be a dict, got {type(tensors).__name__}")
    extra = sorted(set(tensors) - set(want))
    if extra:
        raise ValueError(f"weight {extra[0]!r} is not used by {owner}; "
                         f"expected only {sorted(want)}")
    for name, shape in want.items():
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"weight {name!r} is missing; expected shape {list(shape)}")
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"weight {name!r} must be a float tensor, got "
                            f"{getattr(t, 'dtype', type(t))}")
        if tuple(t.shape) != shape:
            raise ValueError(f"weight {name!r} must have shape {list(shape)}, "
                             f"got {list(t.shape)}")


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Seeded float64 weights of ``shapes`` on the CPU: projections ~ N(0, 1/in), norm weights
    ~ 1 + N(0, 0.1²), ``ape`` ~ N(0, 0.5²), sinks ~ N(0, 1); ``ape`` and the sinks are float32
    numbers, as the checkpoint holds them."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen, dtype=torch.float64)
        if _is_norm(name):
            t = 1.0 + 0.1 * t
        elif name.endswith("ape"):
            t = 0.5 * t
        elif name != "attn_sink":
            t = t * shape[1] ** -0.5
        if name.endswith("ape") or name == "attn_sink":
            t = t.float().double()  # float32 parameters in the checkpoint
        tensors[name] = t
    return tensors


@dataclass
class V4LayerWeights:
    """A layer's attention weights by checkpoint name (``tensors``) and its ratio."""

    config: V4Config
    ratio: int
    tensors: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        check_weights(self.tensors, v4_weight_shapes(self.config, self.ratio),
                      f"a layer of ratio {self.ratio}")

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @classmethod
    def random(cls, config: V4Config, ratio: int, seed: int = 0,
               dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu"
               ) -> V4LayerWeights:
        """Seeded random weights (``random_weights``) in ``dtype`` on ``device``."""
        tensors = {n: t.to(dtype=dtype, device=device)
                   for n, t in random_weights(v4_weight_shapes(config, ratio), seed).items()}
        return cls(config, ratio, tensors)

    @classmethod
    def from_state_dict(cls, config: V4Config, ratio: int, state_dict: dict[str, torch.Tensor],
                        prefix: str = "") -> V4LayerWeights:
        """Take ``{prefix}{name}`` for each name a layer of ``ratio`` uses, e.g. ``prefix =
        "layers.2.attn."``; an FP8 weight is multiplied by its ``{name}.scale`` blocks (the
        ``.scale`` of ``wq_a.weight`` is ``wq_a.scale``). Missing or misshapen entries raise a
        ``ValueError`` naming them."""
        tensors = {}
        for name, shape in v4_weight_shapes(config, ratio).items():
            key = prefix + name
            if key not in state_dict:
                raise ValueError(f"state dict has no {key!r} (expected shape {list(shape)})")
            t = state_dict[key]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"state dict entry {key!r} must be a tensor, got {type(t)}")
            if tuple(t.shape) != shape:
                raise ValueError(f"state dict entry {key!r} must have shape {list(shape)}, "
                                 f"got {list(t.shape)}")
            scale_key = key.removesuffix(".weight") + ".scale"
            if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                if scale_key not in state_dict:
                    raise ValueError(f"state dict entry {key!r} is {t.dtype} but has no "
                                     f"{scale_key!r}")
                t = _dequantize_block_fp8(t, state_dict[scale_key], key)
            tensors[name] = t
        return cls(config, ratio, tensors)

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        return {prefix + name: t for name, t in self.tensors.items()}

    def to(self, dtype: torch.dtype | None = None, device: str | torch.device | None = None
           ) -> V4LayerWeights:
        """A copy in ``dtype`` (the float32 ``ape`` and ``attn_sink`` keep at least float32)."""
        out = {}
        for name, t in self.tensors.items():
            keep32 = name.endswith("ape") or name == "attn_sink"
            want = dtype if dtype is None or not keep32 or dtype == torch.float64 \
                else torch.float32
            out[name] = t.to(dtype=want, device=device)
        return V4LayerWeights(self.config, self.ratio, out)

    def sub(self, prefix: str) -> dict[str, torch.Tensor]:
        """The tensors under ``prefix`` (e.g. ``"compressor."``), with the prefix removed."""
        return {n[len(prefix):]: t for n, t in self.tensors.items() if n.startswith(prefix)}
