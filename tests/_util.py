"""Builders shared by the equivalence tests: configs, random weights and inputs, paged caches.

Everything is seeded and drawn in float64, then cast, so that a low-precision run and its
float64 reference see the same numbers (the reference runs on the upcast low-precision values).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from mla import MLAConfig, MLAWeights, get_config
from mla.compare import TOLERANCES, assert_close, rel_err
from mla.reference import make_block_table, write_context

_TINY = get_config("tiny")
# YaRN as DeepSeek-V3 sets it; with R = 8 the ramp still has dims on both sides of it
_YARN = dict(rope_factor=40.0, original_seq_len=4096, max_seq_len=163840,
             beta_fast=32.0, beta_slow=1.0, rope_mscale=1.0)

CONFIGS: dict[str, MLAConfig] = {
    "tiny": _TINY,  # q compression, interleaved RoPE, no YaRN
    "tiny-yarn": _TINY.replace(name="tiny-yarn", **_YARN),
    "tiny-neox": _TINY.replace(name="tiny-neox", rope_style="neox"),
    "tiny-noq": _TINY.replace(name="tiny-noq", q_lora_rank=None),
    "deepseek-v2-lite": get_config("deepseek-v2-lite"),  # no q compression, YaRN on
}
SMALL = ("tiny", "tiny-yarn", "tiny-neox", "tiny-noq")
DTYPES = (torch.float64, torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=16)
def _weights64(name: str, seed: int) -> MLAWeights:
    return MLAWeights.random(CONFIGS[name], seed=seed, dtype=torch.float64)


def weights(name: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> MLAWeights:
    """Random weights of ``CONFIGS[name]`` in ``dtype`` (cached in float64, then cast)."""
    return _weights64(name, seed).to(dtype=dtype)


def upcast(w: MLAWeights) -> MLAWeights:
    """The float64 copy of ``w``: the reference runs on exactly the numbers ``w`` holds."""
    return w.to(dtype=torch.float64)


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float64,
          scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)


def hidden(config: MLAConfig, tokens: int, seed: int, dtype: torch.dtype = torch.float64,
           scale: float = 1.0) -> torch.Tensor:
    """Fresh random hidden states ``[tokens, H]``."""
    return randn(tokens, config.hidden_size, seed=seed, dtype=dtype, scale=scale)


def scale_queries(w: MLAWeights, factor: float) -> MLAWeights:
    """``w`` with the last query projection scaled, so every logit is ``factor`` times larger.

    (The hidden states cannot do it when the query is compressed: its RMSNorm undoes a scale.)
    """
    if w.q_proj is not None:
        return dataclasses.replace(w, q_proj=w.q_proj * factor)
    return dataclasses.replace(w, q_b_proj=w.q_b_proj * factor)


def paged_cache(config: MLAConfig, capacities: list[int], block_size: int,
                dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-poisoned cache and a scattered block table holding ``capacities[i]`` tokens each.

    Poison means a read of a row nobody wrote turns the result into NaN, which never passes.
    """
    block_table, num_blocks = make_block_table(capacities, block_size, spare_blocks=2, seed=seed)
    kv_cache = torch.full((num_blocks, block_size, config.latent_dim), float("nan"), dtype=dtype)
    return kv_cache, block_table


def write_contexts(w: MLAWeights, contexts: list[torch.Tensor], kv_cache: torch.Tensor,
                   block_table: torch.Tensor) -> None:
    """Cache each request's context hidden states at positions ``0 .. len - 1``."""
    for i, h in enumerate(contexts):
        if h.shape[0]:
            write_context(w, h, kv_cache, block_table[i])


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    """Assert ``out`` is within conventions §11's tolerance of ``out.dtype``; print the bf16 error.

    bfloat16 is held to the 1e-2 of conventions §11 (measured: about 5e-3 to 8e-3 on these shapes).
    """
    assert ref.dtype == torch.float64, f"{what}: the reference must be float64, got {ref.dtype}"
    if out.dtype == torch.bfloat16:
        print(f"{what}: bfloat16 relative error {rel_err(out, ref):.2e} "
              f"(bound {TOLERANCES[out.dtype]:.0e})")
    return assert_close(out, ref, name=what)
