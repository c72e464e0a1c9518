"""DeepSeek-V4's RoPE: one per layer, GPT-J pairs on the last 64 dims, and its inverse.

A layer has one rotary embedding, chosen by its kind (vLLM 0.33
``vllm/models/deepseek_v4/common/rope.py``, ``build_deepseek_v4_rope``):

    window-only layers (r = 1)   f_i = rope_theta^(-2i/R)                    plain RoPE
    compressed layers (r > 1)    f_i = compress_rope_theta^(-2i/R), YaRN-blended with
                                 rope_factor over original_max_position (beta_fast, beta_slow)

and the YaRN magnitude factor ``mscale`` is 1 (vLLM sets ``mscale = mscale_all_dim = 0``). The
same embedding rotates the query, the window's keys, the compressor's entries, the indexer's
query and keys, and, inverted, the attention output.

A position ``p`` rotates the pair ``(x[D-R+2i], x[D-R+2i+1])`` of a ``D``-wide row (the last
``R = 64`` dims; the first ``D - R`` pass through) by the angle ``p · f_i``:

    forward   (a, b) -> (a cos - b sin,  a sin + b cos)
    inverse   (a, b) -> (a cos + b sin,  b cos - a sin)          the rotation by -p · f_i

(``DeepseekV4ScalingRotaryEmbedding.forward_native(inverse=True)`` negates the sine.) vLLM
tabulates cos and sin in float32; here the angles and the rotation are float64.
"""

from __future__ import annotations

import torch

from mla.reference.rope import yarn_frequencies
from mla.reference.v4.config import V4Config
from mla.validation import acc_dtype, check_float, check_index

__all__ = ["v4_rope_frequencies", "rope_gptj"]


def v4_rope_frequencies(config: V4Config, ratio: int) -> torch.Tensor:
    """``[R/2]`` float64 angular frequencies of a layer of compression ratio ``ratio``."""
    if ratio not in (1, 2, 4, 128):
        raise ValueError(f"ratio must be one of 1, 2, 4, 128, got {ratio!r}")
    if ratio == 1:
        return yarn_frequencies(config.rope_head_dim, config.rope_theta, 1.0,
                                config.original_max_position, config.beta_fast,
                                config.beta_slow)
    return yarn_frequencies(config.rope_head_dim, config.compress_rope_theta,
                            config.rope_factor, config.original_max_position,
                            config.beta_fast, config.beta_slow)


def rope_gptj(x: torch.Tensor, positions: torch.Tensor, config: V4Config, ratio: int,
              inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``rope_head_dim`` dims of ``x [S, ..., D]`` by ``positions [S]``.

    GPT-J (interleaved) pairs; ``inverse=True`` rotates by ``-p``. Computed in float32 or wider;
    the result has ``x``'s dtype.
    """
    check_float("x", x)
    R = config.rope_head_dim
    if x.dim() < 2 or x.shape[-1] < R:
        raise ValueError(f"x must have shape [S, ..., D] with D >= {R}, got {list(x.shape)}")
    check_index("positions", positions, shape=[x.shape[0]], device=x.device)
    work = acc_dtype(x.dtype)
    freqs = v4_rope_frequencies(config, ratio).to(x.device)
    angles = positions.to(torch.float64)[:, None] * freqs
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [R // 2]
    cos = angles.cos().to(work).view(shape)
    sin = angles.sin().to(work).view(shape)
    if inverse:
        sin = -sin
    rot = x[..., x.shape[-1] - R:].to(work)
    a, b = rot[..., 0::2], rot[..., 1::2]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :x.shape[-1] - R], rotated.to(x.dtype)), dim=-1)
