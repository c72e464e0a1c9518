"""DeepSeek-V3.2's front and output projection on the fast path.

The reference front (``mla.reference.front.mla_front``, ``indexer.q_latent``,
``indexer.indexer_qk``, ``decode.absorb_q``, ``sparse_model.project_output``) is about seventy
torch kernels a step, and recomputes on every call what depends only on the weights. Here, in
bf16, fp16 or float32, the front is five GEMMs over weights laid out once and the two kernels of
``mla.fast.sparse.front_kernels`` (the norms and RoPE):

    Y    = h [W_DQ; W_DKV]^T                           one GEMM, the model dtype
    Z    = h [W_Ik; W_Iw]^T                            one GEMM, float32 (the indexer's)
    q_c, kv_c, k_pe, k_I, w  from Y and Z              latent_kernel
    q    = q_c W_UQR^T;  q_I = q_c W_Iq^T (float32)    two GEMMs
    q_nope, RoPE(q_pe);  RoPE(q_I)                     rope_heads_kernel, twice
    absorbed q  = [q_nope W_UK^T  ‖  q_pe]             a bmm over the heads
    output      = (o_lat W_UV) W_O                     a bmm over the heads, then a GEMM

The indexer's float32 products of bf16/fp16 values are exact, so on a GPU cuBLAS takes them in
their own dtype and sums into float32 (``_mm_f32``); elsewhere the weights are float32 copies.
Results are within about one rounding of the reference's (``mla.check.front``; the kernels'
docstring says why). In float64 the reference's arithmetic runs op for op (bit for bit) with
the indexer's weights prepared once. Prepared weights are kept per weight tensor and its
version counter: an in-place update prepares again.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from mla.fast.sparse.front_kernels import front_latent, rope_heads
from mla.reference.front import Front, front_and_latent
from mla.reference.indexer import LAYER_NORM_EPS, IndexerQK, IndexerWeights
from mla.reference.rope import _frequencies_on, apply_rope
from mla.validation import acc_dtype, check_float, check_index, check_same_device, check_same_dtype
from mla.weights import MLAWeights

__all__ = ["sparse_front", "absorb_query", "output_projection"]


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """What the front and the projection need of the weights, laid out once."""

    key: tuple[int, ...]  # the version counters it was prepared at
    W_UK_T: torch.Tensor  # [N, P, Lkv] contiguous  # noqa: N815 (the paper's symbol)
    W_UV: torch.Tensor  # [N, Lkv, V] contiguous  # noqa: N815


# id(weight tensor) -> (a weak reference to it, what was prepared); an entry leaves with its
# tensor (tensors compare elementwise, so they cannot be the keys of a WeakKeyDictionary)
_CACHE: dict[int, tuple[weakref.ref, object]] = {}


def _cached(anchor: torch.Tensor, key: tuple, make: object) -> object:
    got = _CACHE.get(id(anchor))
    if got is not None and got[0]() is anchor and got[1][0] == key:
        return got[1][1]
    value = make()
    ident = id(anchor)
    _CACHE[ident] = (weakref.ref(anchor, lambda _, c=_CACHE: c.pop(ident, None)), (key, value))
    return value


def _mla(weights: MLAWeights) -> _Prepared:
    kv_b = weights.kv_b_proj
    key = (kv_b._version,)
    return _cached(kv_b, key, lambda: _Prepared(key, weights.W_UK_T.contiguous(),
                                                weights.W_UV_bmm.contiguous()))


def _index(iw: IndexerWeights, work: torch.dtype) -> tuple[torch.Tensor, ...]:
    names = ("wq_b", "wk", "k_norm_weight", "k_norm_bias", "weights_proj")
    tensors = [getattr(iw, n) for n in names]
    key = (work,) + tuple(t._version for t in tensors) + tuple(id(t) for t in tensors)
    return _cached(iw.wq_b, key, lambda: tuple(t.to(work).contiguous() for t in tensors))


@dataclasses.dataclass(frozen=True)
class _Fused:
    """The fused front's weights: the two GEMMs on ``h`` as one each, the indexer's in float32
    (or in the model dtype where cuBLAS sums them into float32: ``_mm_f32``)."""

    w_a: torch.Tensor  # [Lq + Lkv + R, H]: [W_DQ; W_DKV]
    w_i: torch.Tensor  # [d_I + n_I, H]: [W_Ik; W_Iw]
    wq_b: torch.Tensor  # [n_I·d_I, Lq]
    k_gamma: torch.Tensor  # [d_I] float32
    k_beta: torch.Tensor  # [d_I] float32
    freqs: torch.Tensor  # [R/2] float64, the MLA's RoPE
    freqs_i: torch.Tensor  # [R/2] float64, the indexer's


def _f32_products(a: torch.Tensor) -> bool:
    """Whether ``_mm_f32`` takes ``a`` in its own dtype: bf16/fp16 on a GPU whose torch has
    ``mm(..., out_dtype=float32)``."""
    if not a.is_cuda or a.dtype not in (torch.bfloat16, torch.float16):
        return False
    key = ("out_dtype", a.device.index)
    if key not in _SUPPORT:
        try:
            torch.mm(a[:1], a[:1].T, out_dtype=torch.float32)
            _SUPPORT[key] = True
        except (TypeError, RuntimeError):
            _SUPPORT[key] = False
    return _SUPPORT[key]


_SUPPORT: dict[tuple, bool] = {}


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a.float() @ b.float().T`` in float32: the products of bf16/fp16 values are exact in
    float32, so where cuBLAS can sum them into a float32 output the inputs stay in their dtype
    (half the bytes, tensor cores); otherwise ``b`` is already float32."""
    if b.dtype != torch.float32:
        return torch.mm(a, b.T, out_dtype=torch.float32)
    return a.to(torch.float32) @ b.T


def _fused(weights: MLAWeights, iw: IndexerWeights, hidden: torch.Tensor) -> _Fused:
    mine = _f32_products(hidden)
    tensors = [weights.q_a_proj, weights.kv_a_proj_with_mqa, iw.wq_b, iw.wk,
               iw.weights_proj, iw.k_norm_weight, iw.k_norm_bias]
    key = (mine, hidden.device) + tuple(t._version for t in tensors) + tuple(
        id(t) for t in tensors)

    def make() -> _Fused:
        low = (lambda t: t.contiguous()) if mine else (lambda t: t.to(torch.float32))
        c, ic = weights.config, iw.config
        return _Fused(
            w_a=torch.cat([weights.q_a_proj, weights.kv_a_proj_with_mqa]).contiguous(),
            w_i=low(torch.cat([iw.wk, iw.weights_proj])).contiguous(),
            wq_b=low(iw.wq_b).contiguous(),
            k_gamma=iw.k_norm_weight.to(torch.float32).contiguous(),
            k_beta=iw.k_norm_bias.to(torch.float32).contiguous(),
            freqs=_frequencies_on(c, hidden.device),
            freqs_i=_frequencies_on(ic.replace(rope_style=iw.rope_style), hidden.device))
    return _cached(weights.q_a_proj, key, make)


def sparse_front(weights: MLAWeights, indexer_weights: IndexerWeights, hidden: torch.Tensor,
                 positions: torch.Tensor) -> tuple[Front, IndexerQK]:
    """The front and the indexer's float query side of ``hidden [S, H]`` at ``positions``:
    ``mla_front(weights, hidden, positions)`` and ``indexer_qk(indexer_weights, hidden,
    q_latent(weights, hidden), positions)``. In bf16, fp16 or float32: five GEMMs and the two
    kernels of ``mla.fast.sparse.front_kernels`` (within about one rounding of the reference);
    in float64 the reference's arithmetic with the weights prepared once (bit for bit)."""
    if weights.q_a_proj is None:
        raise ValueError("sparse_front needs a model with a q latent (q_a_proj): the indexer "
                         "reads it; got weights with q_proj")
    if hidden.dtype == torch.float64:
        return _sparse_front_exact(weights, indexer_weights, hidden, positions)
    c, iw = weights.config, indexer_weights
    ic = iw.config
    check_float("hidden", hidden, shape=[None, c.hidden_size])
    check_index("positions", positions, shape=[hidden.shape[0]])
    check_same_device(hidden=hidden, positions=positions, weights=weights.kv_b_proj,
                      indexer_weights=iw.wq_b)
    check_same_dtype(hidden=hidden, weights=weights.kv_b_proj, indexer_weights=iw.wq_b)
    S, N = hidden.shape[0], c.num_heads
    P, R = c.qk_nope_head_dim, c.qk_rope_head_dim
    n_i, d_i = ic.index_n_heads, ic.index_head_dim
    fw = _fused(weights, iw, hidden)
    h = hidden.contiguous()
    y = h @ fw.w_a.T  # [S, Lq + Lkv + R]
    z = _mm_f32(h, fw.w_i)  # [S, d_I + n_I] float32
    q_c, kv_c, k_pe, k_i, w = front_latent(
        y, z, positions, fw.freqs, fw.freqs_i, weights.q_a_layernorm, weights.kv_a_layernorm,
        fw.k_gamma, fw.k_beta, c.q_lora_rank, c.rms_norm_eps, LAYER_NORM_EPS,
        n_i ** -0.5 * d_i ** -0.5, c.rope_style == "interleaved",
        iw.rope_style == "interleaved")
    q = (q_c @ weights.q_b_proj.T).view(S, N, P + R)
    q_nope = torch.empty(S, N, P, device=h.device, dtype=h.dtype)
    q_pe = torch.empty(S, N, R, device=h.device, dtype=h.dtype)
    rope_heads(q, positions, fw.freqs, P, c.rope_style == "interleaved", q_pe, q_nope, 0)
    qi = _mm_f32(q_c, fw.wq_b).view(S, n_i, d_i)
    rope_heads(qi, positions, fw.freqs_i, 0, iw.rope_style == "interleaved", qi[..., :R])
    return (Front(q_nope=q_nope, q_pe=q_pe, kv_c=kv_c, k_pe=k_pe),
            IndexerQK(q_index=qi, k_index=k_i, weights=w))


def _sparse_front_exact(weights: MLAWeights, indexer_weights: IndexerWeights,
                        hidden: torch.Tensor, positions: torch.Tensor
                        ) -> tuple[Front, IndexerQK]:
    """The reference's arithmetic op for op, with the indexer's weights prepared once."""
    front, q_c = front_and_latent(weights, hidden, positions)
    S = hidden.shape[0]
    iw = indexer_weights
    ic = iw.config
    work = acc_dtype(hidden.dtype)
    wq_b, wk, k_w, k_b, w_proj = _index(iw, work)
    n_I, d_I, R = ic.index_n_heads, ic.index_head_dim, ic.qk_rope_head_dim
    rope_config = ic.replace(rope_style=iw.rope_style)
    h = hidden.to(work)
    qi = (q_c.to(work) @ wq_b.T).view(S, n_I, d_I)
    ki = torch.nn.functional.layer_norm(h @ wk.T, (d_I,), k_w, k_b, LAYER_NORM_EPS)
    qi = torch.cat([apply_rope(qi[..., :R], positions, rope_config), qi[..., R:]], dim=-1)
    ki = torch.cat([apply_rope(ki[..., :R], positions, rope_config), ki[..., R:]], dim=-1)
    w = (h @ w_proj.T) * (n_I ** -0.5 * d_I ** -0.5)
    return front, IndexerQK(q_index=qi, k_index=ki, weights=w)


def absorb_query(weights: MLAWeights, q_nope: torch.Tensor,
                 q_pe: torch.Tensor | None = None) -> torch.Tensor:
    """``q_nope [S, N, P]`` -> ``q_nope · W_UK^T`` ``[S, N, Lkv]``: ``absorb_q`` as one bmm;
    with ``q_pe [S, N, R]``, ``[S, N, Lkv + R]``: the bmm writes the first ``Lkv`` columns of
    each row in place (cuBLAS takes the row stride) and ``q_pe`` is copied beside them, where
    a concatenation would write the whole query twice."""
    w_uk = _mla(weights).W_UK_T
    if q_pe is None:
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
    S, N, _ = q_nope.shape
    L = w_uk.shape[-1]
    q = torch.empty(S, N, L + q_pe.shape[-1], device=q_nope.device, dtype=q_nope.dtype)
    torch.bmm(q_nope.transpose(0, 1), w_uk, out=q[..., :L].transpose(0, 1))
    q[..., L:] = q_pe
    return q


def output_projection(weights: MLAWeights, o_lat: torch.Tensor) -> torch.Tensor:
    """``o_lat [..., N, Lkv]`` -> ``(o_lat · W_UV).flatten(-2) · W_O`` ``[..., H]``:
    ``project_output`` with the per-head product as one bmm."""
    lead = o_lat.shape[:-2]
    N, L = o_lat.shape[-2:]
    o = torch.bmm(o_lat.reshape(-1, N, L).transpose(0, 1), _mla(weights).W_UV)  # [N, S, V]
    return (o.transpose(0, 1).reshape(*lead, -1)) @ weights.W_O
