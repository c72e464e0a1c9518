"""The front's element-wise work in two Triton kernels (``mla.fast.sparse.front`` calls them).

The reference front (``mla.reference.front``, ``mla.reference.indexer``) is about seventy
kernels a step in torch: every RMSNorm, LayerNorm and RoPE is a chain of casts and
element-wise kernels, and RoPE's angles are recomputed in float64 for each of its four calls.
At decode sizes each is a launch of a few microseconds, so the front took 270-490 us of a
V3.2 decode step in a CUDA graph on an H100 (``benchmarks/results/layers/step_peers_*``),
where its weights need about 50. Here everything between the GEMMs is two launches:

- ``latent_kernel``, one program a token, after ``Y = h · [W_DQ; W_DKV]^T`` and the indexer's
  ``Z = h · [W_Ik; W_Iw]^T`` (float32):

      q_c  = RMSNorm(Y[:, :Lq]) · g_q                 model dtype (the indexer's input too)
      kv_c = RMSNorm(Y[:, Lq:Lq+L]) · g_kv;  k_pe = RoPE(Y[:, Lq+L:])      model dtype
      k_I  = RoPE_I(LayerNorm(Z[:, :d_I]; γ, β));  w = Z[:, d_I:] · (n_I d_I)^-1/2    float32

- ``rope_heads_kernel``, one program a (token, head): RoPE on ``R`` dims of each head of a
  ``[S, heads, width]`` tensor, the rotated part written to one tensor and (optionally) the
  rest copied to another: the query's ``q_pe`` and contiguous ``q_nope``, and the indexer's
  query in place.

The arithmetic is the reference's: norms in float32 (the model dtype rounded once at the
end), RoPE's angles ``p · f_i`` and their cosine and sine in float64 (exact for the positions
of a 128K context, as ``mla.reference.rope`` does), the rotation in float32. Sums are ordered
differently (a tree instead of torch's reductions) and the rotation may be fused into FMAs, so
results differ from the reference's by at most about one rounding of the output dtype
(``tests/test_fast_sparse_model.py``). Inputs in float64 keep the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.fast.launch import CompiledLauncher, check_grid

__all__ = ["latent_kernel", "rope_heads_kernel", "front_latent", "rope_heads"]


@triton.jit
def _rope_store(src, dst, pos, freqs, R: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Rotate the ``R`` values at ``src`` by position ``pos`` into ``dst`` (unit strides),
    pairs ``(2i, 2i+1)`` (interleaved) or ``(i, i + R/2)``, in float32, stored in ``dst``'s
    dtype. The angles and their cosine and sine in float64."""
    i = tl.arange(0, R // 2)
    if INTERLEAVED:
        ia, ib = 2 * i, 2 * i + 1
    else:
        ia, ib = i, i + R // 2
    a = tl.load(src + ia).to(tl.float32)
    b = tl.load(src + ib).to(tl.float32)
    ang = pos.to(tl.float64) * tl.load(freqs + i)
    c = tl.cos(ang).to(tl.float32)
    s = tl.sin(ang).to(tl.float32)
    tl.store(dst + ia, (a * c - b * s).to(dst.dtype.element_ty))
    tl.store(dst + ib, (a * s + b * c).to(dst.dtype.element_ty))


@triton.jit
def _rms_norm_store(src, gain, dst, n, eps, BLOCK: tl.constexpr):
    """``dst = (x · rsqrt(mean(x²) + eps)) · gain`` over ``n`` values, float32 inside."""
    j = tl.arange(0, BLOCK)
    m = j < n
    x = tl.load(src + j, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / n + eps)
    g = tl.load(gain + j, mask=m, other=0.0).to(tl.float32)
    tl.store(dst + j, ((x * inv) * g).to(dst.dtype.element_ty), mask=m)


@triton.jit
def latent_kernel(
    y, sy, z, sz, positions, freqs, freqs_i,
    q_gain, kv_gain, k_gamma, k_beta,
    q_c, sq, kv_c, skv, k_pe, skp, k_i, ski, w, sw,
    LQ, L, eps, ln_eps, w_scale,
    R: tl.constexpr, D_I: tl.constexpr, N_I: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_L: tl.constexpr,
    INTERLEAVED: tl.constexpr, INTERLEAVED_I: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t)
    yt = y + t * sy
    _rms_norm_store(yt, q_gain, q_c + t * sq, LQ, eps, BLOCK_Q)
    _rms_norm_store(yt + LQ, kv_gain, kv_c + t * skv, L, eps, BLOCK_L)
    _rope_store(yt + LQ + L, k_pe + t * skp, pos, freqs, R, INTERLEAVED)
    # the indexer's key: LayerNorm over d_I (biased variance), then RoPE on its first R dims
    zt = z + t * sz
    j = tl.arange(0, D_I)
    x = tl.load(zt + j)
    mean = tl.sum(x, axis=0) / D_I
    xc = x - mean
    var = tl.sum(xc * xc, axis=0) / D_I
    kn = xc * (1.0 / tl.sqrt_rn(var + ln_eps)) * tl.load(k_gamma + j) + tl.load(k_beta + j)
    kt = k_i + t * ski
    tl.store(kt + j, kn)
    tl.debug_barrier()  # the normed key is read back by the rotation below
    _rope_store(kt, kt, pos, freqs_i, R, INTERLEAVED_I)
    h = tl.arange(0, N_I)
    tl.store(w + t * sw + h, tl.load(zt + D_I + h) * w_scale)


@triton.jit
def rope_heads_kernel(
    src, s_t, s_h, rot, r_t, r_h, rest, x_t, x_h, positions, freqs,
    ROT_OFF, REST_OFF, REST_N,
    R: tl.constexpr, BLOCK_REST: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_REST: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1).to(tl.int64)
    pos = tl.load(positions + t)
    base = src + t * s_t + hd * s_h
    if HAS_REST:
        j = tl.arange(0, BLOCK_REST)
        m = j < REST_N
        tl.store(rest + t * x_t + hd * x_h + j, tl.load(base + REST_OFF + j, mask=m), mask=m)
    _rope_store(base + ROT_OFF, rot + t * r_t + hd * r_h, pos, freqs, R, INTERLEAVED)


_latent = CompiledLauncher(latent_kernel)
_rope = CompiledLauncher(rope_heads_kernel)


def _key(*tensors: torch.Tensor) -> tuple:
    """What Triton specializes the tensors' pointers and strides on, and the strides' values
    (the kernels' other integers follow from them and from the constexprs)."""
    return tuple((t.dtype, t.device, t.data_ptr() % 16 == 0, tuple(t.stride()))
                 for t in tensors)


def _unit_last(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit last stride, got strides {list(t.stride())}")


def front_latent(y: torch.Tensor, z: torch.Tensor, positions: torch.Tensor,
                 freqs: torch.Tensor, freqs_i: torch.Tensor, q_gain: torch.Tensor,
                 kv_gain: torch.Tensor, k_gamma: torch.Tensor, k_beta: torch.Tensor,
                 lq: int, eps: float, ln_eps: float, w_scale: float,
                 interleaved: bool, interleaved_i: bool
                 ) -> tuple[torch.Tensor, ...]:
    """``latent_kernel`` over ``y [S, lq + L + R]`` (model dtype) and ``z [S, d_I + n_I]``
    (float32): ``(q_c [S, lq], kv_c [S, L], k_pe [S, R], k_I [S, d_I], w [S, n_I])``."""
    S, width = y.shape
    R = freqs.shape[0] * 2
    L = width - lq - R
    d_i = k_gamma.shape[0]
    n_i = z.shape[1] - d_i
    for name, t in (("y", y), ("z", z)):
        _unit_last(name, t)
    dev, dt = y.device, y.dtype
    q_c = torch.empty(S, lq, device=dev, dtype=dt)
    kv_c = torch.empty(S, L, device=dev, dtype=dt)
    k_pe = torch.empty(S, R, device=dev, dtype=dt)
    k_i = torch.empty(S, d_i, device=dev, dtype=z.dtype)
    w = torch.empty(S, n_i, device=dev, dtype=z.dtype)
    if S:
        check_grid("front_latent", (S,))
        tensors = (y, z, positions, freqs, freqs_i, q_gain, kv_gain, k_gamma, k_beta, q_c,
                   kv_c, k_pe, k_i, w)
        key = _key(*tensors) + (lq, L, interleaved, interleaved_i)
        _latent(key, (S, 1, 1), (
            y, y.stride(0), z, z.stride(0), positions, freqs, freqs_i,
            q_gain, kv_gain, k_gamma, k_beta,
            q_c, q_c.stride(0), kv_c, kv_c.stride(0), k_pe, k_pe.stride(0),
            k_i, k_i.stride(0), w, w.stride(0),
            lq, L, eps, ln_eps, w_scale,
            R, d_i, n_i, triton.next_power_of_2(lq), triton.next_power_of_2(L), interleaved,
            interleaved_i), num_warps=4)
    return q_c, kv_c, k_pe, k_i, w


def rope_heads(src: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, rot_off: int,
               interleaved: bool, rot: torch.Tensor, rest: torch.Tensor | None = None,
               rest_off: int = 0) -> None:
    """``rope_heads_kernel`` over ``src [S, heads, width]``: ``rot[t, h] = RoPE(src[t, h,
    rot_off : rot_off + R])`` (``rot`` may be a view of ``src``: in place) and, with ``rest``,
    ``rest[t, h] = src[t, h, rest_off : rest_off + rest.shape[-1]]``."""
    S, heads, _ = src.shape
    R = freqs.shape[0] * 2
    for name, t in (("src", src), ("rot", rot)) + ((("rest", rest),) if rest is not None
                                                    else ()):
        _unit_last(name, t)
    if not S or not heads:
        return
    rest_t = rest if rest is not None else rot
    n_rest = rest.shape[-1] if rest is not None else 1
    check_grid("rope_heads", (S, heads))
    key = _key(src, rot, rest_t, positions, freqs) + (rot_off, rest_off, n_rest, interleaved,
                                                      rest is not None)
    _rope(key, (S, heads, 1), (
        src, src.stride(0), src.stride(1), rot, rot.stride(0), rot.stride(1),
        rest_t, rest_t.stride(0), rest_t.stride(1), positions, freqs,
        rot_off, rest_off, n_rest, R, triton.next_power_of_2(n_rest), interleaved,
        rest is not None), num_warps=2)
