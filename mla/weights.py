"""The weights of one MLA layer, in DeepSeek's checkpoint names and layouts.

PyTorch ``Linear`` layout: a weight is ``[out_features, in_features]`` and ``y = x @ W.T``.

    name                     shape                     holds
    q_a_proj                 [Lq, H]                   W_DQ            (absent for V2-Lite)
    q_a_layernorm            [Lq]                      RMSNorm weight  (absent for V2-Lite)
    q_b_proj                 [N·(P+R), Lq]             [W_UQ; W_QR] per head (absent for V2-Lite)
    q_proj                   [N·(P+R), H]              V2-Lite only: q straight from h
    kv_a_proj_with_mqa       [Lkv+R, H]                [W_DKV; W_KR]
    kv_a_layernorm           [Lkv]                     RMSNorm weight
    kv_b_proj                [N·(P+V), Lkv]            [W_UK; W_UV] per head
    o_proj                   [H, N·V]                  W_O

"Per head" means head-major rows: head ``n`` owns rows ``n·(P+R) .. (n+1)·(P+R)``, its ``P``
nope rows first. ``W_UK`` viewed ``[Lkv, N, P]`` and ``W_UV`` viewed ``[Lkv, N, V]`` are the
orientations of vLLM 0.11 ``mla/common.py`` (``process_weights_after_loading``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from mla.config import MLAConfig

__all__ = ["MLAWeights", "expected_shapes"]

_NAMES = ("q_a_proj", "q_a_layernorm", "q_b_proj", "q_proj", "kv_a_proj_with_mqa",
          "kv_a_layernorm", "kv_b_proj", "o_proj")
_NORMS = ("q_a_layernorm", "kv_a_layernorm")


def expected_shapes(config: MLAConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape for ``config`` (only the names the config uses)."""
    c = config
    qk, lat = c.qk_head_dim, c.latent_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if c.q_lora_rank is None:
        shapes["q_proj"] = (c.num_heads * qk, c.hidden_size)
    else:
        shapes["q_a_proj"] = (c.q_lora_rank, c.hidden_size)
        shapes["q_a_layernorm"] = (c.q_lora_rank,)
        shapes["q_b_proj"] = (c.num_heads * qk, c.q_lora_rank)
    shapes["kv_a_proj_with_mqa"] = (lat, c.hidden_size)
    shapes["kv_a_layernorm"] = (c.kv_lora_rank,)
    shapes["kv_b_proj"] = (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    shapes["o_proj"] = (c.hidden_size, c.num_heads * c.v_head_dim)
    return shapes


@dataclass
class MLAWeights:
    """One layer's attention weights (checkpoint layout) and the config they belong to."""

    config: MLAConfig
    kv_a_proj_with_mqa: torch.Tensor
    kv_a_layernorm: torch.Tensor
    kv_b_proj: torch.Tensor
    o_proj: torch.Tensor
    q_a_proj: torch.Tensor | None = None
    q_a_layernorm: torch.Tensor | None = None
    q_b_proj: torch.Tensor | None = None
    q_proj: torch.Tensor | None = None

    def __post_init__(self) -> None:
        want = expected_shapes(self.config)
        tensors = self.tensors()
        for name in _NAMES:
            t = getattr(self, name)
            if name not in want and t is not None:
                raise ValueError(
                    f"weight {name!r} is not used by config {self.config.name!r} "
                    f"(q_lora_rank={self.config.q_lora_rank}); expected only {sorted(want)}")
        for name, shape in want.items():
            t = tensors.get(name)
            if t is None:
                raise ValueError(f"weight {name!r} is missing; expected shape {list(shape)}")
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"weight {name!r} must have shape {list(shape)}, got {list(t.shape)}")
        first = next(iter(tensors.values()))
        for name, t in tensors.items():
            if t.dtype != first.dtype or t.device != first.device:
                raise ValueError(
                    f"weight {name!r} is {t.dtype} on {t.device}, but the others are "
                    f"{first.dtype} on {first.device}")

    # --- construction --------------------------------------------------------------------
    @classmethod
    def random(cls, config: MLAConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> MLAWeights:
        """Seeded random weights: projections ~ N(0, 1/in_features), norms ~ 1 + N(0, 0.1²).

        Drawn in float64 on the CPU so a seed gives the same numbers in every dtype/device.
        """
        gen = torch.Generator().manual_seed(seed)
        tensors: dict[str, torch.Tensor] = {}
        for name, shape in expected_shapes(config).items():
            if name in _NORMS:
                t = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
            else:
                t = torch.randn(shape, generator=gen, dtype=torch.float64) * shape[1] ** -0.5
            tensors[name] = t.to(dtype=dtype, device=device)
        return cls(config=config, **tensors)

    @classmethod
    def from_state_dict(cls, config: MLAConfig, state_dict: dict[str, torch.Tensor],
                        prefix: str = "") -> MLAWeights:
        """Take ``{prefix}{name}.weight`` for each checkpoint name the config uses.

        ``prefix`` is e.g. ``"model.layers.0.self_attn."`` for a DeepSeek checkpoint.
        A missing or wrongly shaped tensor raises a ``ValueError`` naming it.
        """
        want = expected_shapes(config)
        tensors = {}
        for name, shape in want.items():
            key = f"{prefix}{name}.weight"
            if key not in state_dict:
                raise ValueError(f"state dict has no {key!r} (expected shape {list(shape)})")
            t = state_dict[key]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"state dict entry {key!r} must be a tensor, got {type(t)}")
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"state dict entry {key!r} must have shape {list(shape)}, "
                    f"got {list(t.shape)}")
            tensors[name] = t
        return cls(config=config, **tensors)

    @classmethod
    def load_safetensors(cls, config: MLAConfig, path: str | Path, prefix: str = "",
                         device: str = "cpu") -> MLAWeights:
        """Load one layer from a ``.safetensors`` file (only the tensors it needs are read)."""
        from safetensors import safe_open

        wanted = {f"{prefix}{name}.weight" for name in expected_shapes(config)}
        state = {}
        with safe_open(str(path), framework="pt", device=device) as f:
            for key in f.keys():
                if key in wanted:
                    state[key] = f.get_tensor(key)
        return cls.from_state_dict(config, state, prefix)

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        return {f"{prefix}{name}.weight": t for name, t in self.tensors().items()}

    def save_safetensors(self, path: str | Path, prefix: str = "") -> None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in self.state_dict(prefix).items()}, str(path))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in _NAMES if getattr(self, n) is not None}

    def to(self, dtype: torch.dtype | None = None,
           device: str | torch.device | None = None) -> MLAWeights:
        moved = {n: t.to(dtype=dtype, device=device) for n, t in self.tensors().items()}
        return dataclasses.replace(self, **moved)

    @property
    def dtype(self) -> torch.dtype:
        return self.kv_b_proj.dtype

    @property
    def device(self) -> torch.device:
        return self.kv_b_proj.device

    # --- vLLM's views (0.11 mla/common.py)---------------------------------------------------
    def _kv_b(self) -> torch.Tensor:
        c = self.config
        # [N·(P+V), Lkv] -> [Lkv, N, P+V]
        return self.kv_b_proj.T.reshape(c.kv_lora_rank, c.num_heads,
                                        c.qk_nope_head_dim + c.v_head_dim)

    @property
    def W_UK(self) -> torch.Tensor:  # noqa: N802 (the paper's symbol)
        """``[Lkv, N, P]``: k_nope = einsum("sl,lnp->snp", kv_c, W_UK)."""
        return self._kv_b()[..., : self.config.qk_nope_head_dim]

    @property
    def W_UV(self) -> torch.Tensor:  # noqa: N802
        """``[Lkv, N, V]``: v = einsum("sl,lnv->snv", kv_c, W_UV)."""
        return self._kv_b()[..., self.config.qk_nope_head_dim:]

    @property
    def W_UK_T(self) -> torch.Tensor:  # noqa: N802
        """``[N, P, Lkv]``: vLLM's bmm layout for q_nope -> ql_nope."""
        return self.W_UK.permute(1, 2, 0)

    @property
    def W_UV_bmm(self) -> torch.Tensor:  # noqa: N802
        """``[N, Lkv, V]``: vLLM's bmm layout for o_lat -> o."""
        return self.W_UV.transpose(0, 1)

    @property
    def W_O(self) -> torch.Tensor:  # noqa: N802
        """``[N·V, H]``: out = o.flatten(-2) @ W_O."""
        return self.o_proj.T
