"""RoPE, YaRN, the softmax scale, and the shared front (conventions §1), each against a form
built independently here.

Interleaved RoPE is a complex multiplication of the pairs ``(x[2i], x[2i+1])`` by
``exp(i·p·f_i)``; neox is rotate-half. Both preserve norms and make ``q·k`` depend on positions
only through ``p - p'``. YaRN keeps the dims that turn more than ``beta_fast`` times over the
original context and divides by the factor those that turn less than ``beta_slow`` times.
"""

from __future__ import annotations

import math

import pytest
import torch
from _util import CONFIGS, SMALL, hidden, randn, weights

from mla import MLAConfig, get_config
from mla.compare import assert_close, rel_err
from mla.reference import apply_rope, mla_front, rms_norm, rope_frequencies


def _plain_config(R: int, style: str = "interleaved") -> MLAConfig:
    """A config whose RoPE has no YaRN (tiny's other shapes, rope dim R)."""
    return get_config("tiny").replace(name=f"rope{R}", qk_rope_head_dim=R, rope_style=style)


def _base_freqs(R: int, theta: float = 10000.0) -> torch.Tensor:
    return torch.tensor([theta ** (-2 * i / R) for i in range(R // 2)], dtype=torch.float64)


def _rope_complex(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE as DeepSeek writes it: pairs as complex numbers times exp(i p f)."""
    S, R = x.shape[0], x.shape[-1]
    cis = torch.polar(torch.ones(S, R // 2, dtype=torch.float64),
                      positions.double()[:, None] * freqs[None])
    cis = cis.view([S] + [1] * (x.dim() - 2) + [R // 2])
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], R // 2, 2).contiguous())
    return torch.view_as_real(xc * cis).flatten(-2)


def _rope_rotate_half(x: torch.Tensor, positions: torch.Tensor,
                      freqs: torch.Tensor) -> torch.Tensor:
    """neox RoPE: x·cos + rotate_half(x)·sin with the angles repeated over both halves."""
    S, R = x.shape[0], x.shape[-1]
    angles = positions.double()[:, None] * freqs[None]
    angles = torch.cat([angles, angles], dim=-1).view([S] + [1] * (x.dim() - 2) + [R])
    x1, x2 = x.double()[..., : R // 2], x.double()[..., R // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x.double() * angles.cos() + rotated * angles.sin()


POSITIONS = torch.tensor([0, 1, 2, 7, 100, 4095, 4096, 70000])


@pytest.mark.parametrize("R", [8, 64])
@pytest.mark.parametrize("shape", [(8, 3), (8,)], ids=["q_pe", "k_pe"])
def test_interleaved_is_complex_multiplication(R: int, shape: tuple[int, ...]) -> None:
    cfg = _plain_config(R)
    freqs = rope_frequencies(cfg)
    assert freqs.dtype == torch.float64 and freqs.shape == (R // 2,)
    assert_close(rope_frequencies(cfg), _base_freqs(R), name="base frequencies")
    x = randn(*shape, R, seed=R)
    out = apply_rope(x, POSITIONS, cfg)
    assert out.dtype == torch.float64 and out.shape == x.shape
    assert_close(out, _rope_complex(x, POSITIONS, _base_freqs(R)), name="interleaved")
    # the two pairings differ: a neox implementation would not pass the check above
    assert rel_err(_rope_rotate_half(x, POSITIONS, _base_freqs(R)), out) > 1e-2


@pytest.mark.parametrize("R", [8, 64])
def test_neox_is_rotate_half(R: int) -> None:
    cfg = _plain_config(R, "neox")
    x = randn(8, 3, R, seed=R + 1)
    out = apply_rope(x, POSITIONS, cfg)
    assert_close(out, _rope_rotate_half(x, POSITIONS, _base_freqs(R)), name="neox")
    assert rel_err(_rope_complex(x, POSITIONS, _base_freqs(R)), out) > 1e-2


@pytest.mark.parametrize("name", ["tiny", "tiny-neox", "tiny-yarn", "deepseek-v2-lite"])
def test_rope_with_config_frequencies(name: str) -> None:
    """With the config's own (maybe YaRN) frequencies the independent forms still hold, and
    float32 / bfloat16 inputs land within conventions §11 of the float64 rotation."""
    cfg = CONFIGS[name]
    R = cfg.qk_rope_head_dim
    x = randn(8, 2, R, seed=5)
    form = _rope_rotate_half if cfg.rope_style == "neox" else _rope_complex
    ref = form(x, POSITIONS, rope_frequencies(cfg))
    assert_close(apply_rope(x, POSITIONS, cfg), ref, name=f"rope {name}")
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        out = apply_rope(xd, POSITIONS, cfg)
        assert out.dtype == dtype
        assert_close(out, form(xd.double(), POSITIONS, rope_frequencies(cfg)),
                     name=f"rope {name} {dtype}")


@pytest.mark.parametrize("name", ["tiny", "tiny-neox", "tiny-yarn", "deepseek-v2-lite"])
def test_rope_preserves_norms(name: str) -> None:
    cfg = CONFIGS[name]
    x = randn(8, 4, cfg.qk_rope_head_dim, seed=6)
    out = apply_rope(x, POSITIONS, cfg)
    assert_close(torch.linalg.vector_norm(out, dim=-1), torch.linalg.vector_norm(x, dim=-1))
    assert rel_err(out[1:], x[1:]) > 1e-2  # and it does rotate (position 0 is the identity)
    assert torch.equal(out[0], x[0])


@pytest.mark.parametrize("name", ["tiny", "tiny-neox", "tiny-yarn", "deepseek-v2-lite"])
def test_rope_relative_position(name: str) -> None:
    """rope(q, p) · rope(k, p') depends on p - p' only."""
    cfg = CONFIGS[name]
    R = cfg.qk_rope_head_dim
    q, k = randn(1, R, seed=7), randn(1, R, seed=8)

    def dot(p: int, pk: int) -> float:
        return float(apply_rope(q, torch.tensor([p]), cfg)[0]
                     @ apply_rope(k, torch.tensor([pk]), cfg)[0])

    for p, pk in [(5, 2), (0, 9), (40, 40), (3000, 17)]:
        base = dot(p, pk)
        for shift in (1, 13, 1000, 100000):
            assert math.isclose(dot(p + shift, pk + shift), base, rel_tol=1e-9, abs_tol=1e-9)
    assert not math.isclose(dot(5, 2), dot(6, 2), rel_tol=1e-3)  # the offset does matter


# ---------------------------------------------------------------------------------------------
# YaRN and the softmax scale
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("changes", [
    dict(rope_factor=1.0, max_seq_len=163840),  # factor 1: nothing to scale
    dict(rope_factor=40.0, max_seq_len=4096),  # max_seq_len <= original: YaRN off
    dict(rope_factor=40.0, max_seq_len=1024),
])
def test_yarn_off_leaves_frequencies(changes: dict) -> None:
    cfg = get_config("deepseek-v3").replace(**changes)
    assert not cfg.yarn_active and cfg.mscale == 1.0
    assert torch.equal(rope_frequencies(cfg), rope_frequencies(cfg.replace(rope_factor=1.0)))
    assert_close(rope_frequencies(cfg), _base_freqs(cfg.qk_rope_head_dim, cfg.rope_theta))
    assert cfg.softmax_scale == pytest.approx(cfg.qk_head_dim ** -0.5, rel=1e-15)


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2", "tiny-yarn"])
def test_yarn_frequencies(name: str) -> None:
    """By the number of turns a dim makes over the original context, ``L·f/(2π)``: more than
    beta_fast, unchanged; fewer than beta_slow, divided by the factor; between, a blend."""
    cfg = CONFIGS.get(name) or get_config(name)
    assert cfg.yarn_active
    base = _base_freqs(cfg.qk_rope_head_dim, cfg.rope_theta)
    got = rope_frequencies(cfg)
    turns = cfg.original_seq_len * base / (2 * math.pi)
    fast, slow = turns > cfg.beta_fast, turns < cfg.beta_slow
    middle = ~fast & ~slow
    assert fast.any() and slow.any() and middle.any(), "each regime should have dims"
    unscaled = rope_frequencies(cfg.replace(rope_factor=1.0))
    assert_close(unscaled, base)
    assert torch.equal(got[fast], unscaled[fast])
    assert_close(got[slow], base[slow] / cfg.rope_factor)
    lo, hi = base[middle] / cfg.rope_factor, base[middle]
    assert ((got[middle] > lo) & (got[middle] < hi)).all()
    # the blend weight of the factor rises with the dim index
    ramp = (base - got) / (base - base / cfg.rope_factor)
    assert (ramp.diff() >= -1e-12).all()


@pytest.mark.parametrize("name,rope_mscale", [("deepseek-v3", 1.0), ("deepseek-v2", 0.707),
                                              ("deepseek-v2-lite", 0.707)])
def test_mscale_and_softmax_scale(name: str, rope_mscale: float) -> None:
    cfg = get_config(name)
    assert cfg.rope_mscale == rope_mscale and cfg.rope_factor == 40.0
    mscale = 0.1 * rope_mscale * math.log(40.0) + 1.0
    assert cfg.mscale == pytest.approx(mscale, rel=1e-15)
    P, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    assert cfg.softmax_scale == pytest.approx((P + R) ** -0.5 * mscale ** 2, rel=1e-15)
    # 1/sqrt(Lkv + R), the classic bug, is a different number
    assert abs(cfg.softmax_scale - (cfg.kv_lora_rank + R) ** -0.5 * mscale ** 2) > 0.01


def test_deepseek_v3_softmax_scale_is_the_hand_worked_number() -> None:
    """The formula above, written out once by hand, so that it and the code cannot share a slip.

    DeepSeek-V3: rope_factor 40, rope_mscale 1.0, P + R = 128 + 64 = 192.
      ln 40             = 3.688879454
      mscale            = 0.1 * 3.688879454 + 1 = 1.368887945
      mscale²           = 1.873854207
      sqrt(192)         = 13.856406461
      mscale² / sqrt(192) = 0.135233779
    (Without YaRN it would be 1/sqrt(192) = 0.0722; with the classic bug 1/sqrt(512 + 64):
    0.0781 before mscale².)
    """
    assert get_config("deepseek-v3").softmax_scale == pytest.approx(0.135233779, abs=1e-9)


def test_softmax_scale_without_yarn() -> None:
    cfg = get_config("tiny")
    assert cfg.softmax_scale == pytest.approx((16 + 8) ** -0.5, rel=1e-15)


# ---------------------------------------------------------------------------------------------
# the front, from the checkpoint layout by hand
# ---------------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("name", [*SMALL, "deepseek-v2-lite"])
def test_front_from_checkpoint_layout(name: str) -> None:
    """Head n owns rows n·(P+R) .. (n+1)·(P+R) of the q projection, P nope rows first;
    kv_a_proj_with_mqa is [W_DKV; W_KR]."""
    cfg = CONFIGS[name]
    w = weights(name)
    S, N, P, R, L = 6, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    h = hidden(cfg, S, seed=70)
    positions = torch.tensor([0, 3, 4, 9, 5000, 17])
    f = mla_front(w, h, positions)
    if cfg.q_lora_rank is None:
        q_in, W_q = h, w.q_proj
    else:
        q_in = _rms(h @ w.q_a_proj.T, w.q_a_layernorm, cfg.rms_norm_eps)
        W_q = w.q_b_proj
    rope = _rope_rotate_half if cfg.rope_style == "neox" else _rope_complex
    freqs = rope_frequencies(cfg) if cfg.yarn_active else _base_freqs(R)
    for n in range(N):
        rows = W_q[n * (P + R): (n + 1) * (P + R)]
        assert_close(f.q_nope[:, n], q_in @ rows[:P].T, name=f"q_nope head {n}")
        assert_close(f.q_pe[:, n], rope(q_in @ rows[P:].T, positions, freqs),
                     name=f"q_pe head {n}")
    kv = h @ w.kv_a_proj_with_mqa.T
    assert_close(f.kv_c, _rms(kv[:, :L], w.kv_a_layernorm, cfg.rms_norm_eps), name="kv_c")
    assert_close(f.k_pe, rope(kv[:, L:], positions, freqs), name="k_pe")
    assert f.q_nope.shape == (S, N, P) and f.q_pe.shape == (S, N, R)
    assert f.kv_c.shape == (S, L) and f.k_pe.shape == (S, R)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm(dtype: torch.dtype) -> None:
    x, wt = randn(5, 32, seed=80, scale=7.0), 1 + 0.1 * randn(32, seed=81)
    out = rms_norm(x.to(dtype), wt.to(dtype), 1e-6)
    assert out.dtype == dtype
    assert_close(out, _rms(x.to(dtype).double(), wt.to(dtype).double(), 1e-6))
    assert_close(rms_norm(x, wt, 1e-6), _rms(x, wt, 1e-6))
