"""Rotary position embedding as DeepSeek uses it, with YaRN long-context scaling.

Frequencies (DeepSeek-V2 appendix; DeepSeek-V3 ``precompute_freqs_cis``), for a rope dim R:

    f_i = theta^(-2i/R),                          i = 0 .. R/2 - 1
    YaRN (when max_seq_len > original_seq_len):
        low, high = correction range of (beta_fast, beta_slow) at original_seq_len
        ramp_i    = clamp((i - low) / (high - low), 0, 1)
        f_i      <- f_i / factor · ramp_i + f_i · (1 - ramp_i)

A token at position ``p`` rotates pair ``i`` by the angle ``p · f_i``. DeepSeek's released code
pairs *interleaved* elements ``(x[2i], x[2i+1])`` (GPT-J style, a complex multiplication);
``style="neox"`` pairs ``(x[i], x[i + R/2])`` (rotate-half). The softmax scale correction
(``mscale²``) lives in ``MLAConfig.softmax_scale``.
"""

from __future__ import annotations

import functools
import math

import torch

from mla.config import MLAConfig
from mla.validation import acc_dtype, check_float, check_index

__all__ = ["rope_frequencies", "apply_rope", "yarn_frequencies"]


def _correction_dim(num_rotations: float, dim: int, base: float, seq_len: int) -> float:
    return dim * math.log(seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_frequencies(dim: int, base: float, factor: float, original_seq_len: int,
                     beta_fast: float, beta_slow: float) -> torch.Tensor:
    """``[dim/2]`` float64 frequencies ``base^(-2i/dim)``, YaRN-blended when ``factor > 1``."""
    freqs = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if factor > 1.0:
        low = max(math.floor(_correction_dim(beta_fast, dim, base, original_seq_len)), 0)
        high = min(math.ceil(_correction_dim(beta_slow, dim, base, original_seq_len)), dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp, as the released code does
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    return freqs


def rope_frequencies(config: MLAConfig) -> torch.Tensor:
    """``[R/2]`` float64 angular frequencies, YaRN-blended when the config says so."""
    return yarn_frequencies(config.qk_rope_head_dim, config.rope_theta,
                            config.rope_factor if config.yarn_active else 1.0,
                            config.original_seq_len, config.beta_fast, config.beta_slow)


@functools.lru_cache(maxsize=64)
def _frequencies_on(config: MLAConfig, device: torch.device) -> torch.Tensor:
    """``rope_frequencies`` on ``device``, copied there once: a copy per call would stall the
    host on every step and cannot be captured in a CUDA graph."""
    return rope_frequencies(config).to(device)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, config: MLAConfig) -> torch.Tensor:
    """Rotate the last dim (``R``) of ``x [S, ..., R]`` by the positions ``[S]``.

    The angles are computed in float64 and the rotation in float32 or wider; the result has
    ``x``'s dtype.
    """
    check_float("x", x)
    R = config.qk_rope_head_dim
    if x.dim() < 2 or x.shape[-1] != R:
        raise ValueError(f"x must have shape [S, ..., {R}], got {list(x.shape)}")
    check_index("positions", positions, shape=[x.shape[0]], device=x.device)
    work = acc_dtype(x.dtype)
    angles = positions.to(torch.float64)[:, None] * _frequencies_on(config, x.device)
    # broadcast [S, R/2] over the middle dims of x
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [R // 2]
    cos = angles.cos().to(work).view(shape)
    sin = angles.sin().to(work).view(shape)
    xw = x.to(work)
    if config.rope_style == "interleaved":
        a, b = xw[..., 0::2], xw[..., 1::2]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    else:
        a, b = xw[..., : R // 2], xw[..., R // 2:]
        out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.to(x.dtype)
