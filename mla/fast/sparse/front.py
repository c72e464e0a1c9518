"""DeepSeek-V3.2's front and output projection on the fast path: the reference's arithmetic,
with the weights prepared once instead of on every step.

The reference front (``mla.reference.front.mla_front``, ``indexer.q_latent``,
``indexer.indexer_qk``, ``decode.absorb_q``, ``sparse_model.project_output``) recomputes on every
call what depends only on the weights: the indexer's float32 copies of ``wq_b``, ``wk`` and
``weights_proj`` (a 50 MB conversion at DeepSeek-V3.2's widths), the contiguous ``W_UK`` and
``W_UV`` that its einsums copy out of ``kv_b_proj``, and the q latent twice (once inside
``mla_front``, once for the indexer). Here they are prepared at the first step of a weight
tensor and kept (keyed by the weight tensors and their version counters: an in-place update of
a weight prepares again). Each operation is the reference's in the same dtype, in the same
order: the results are the reference's bit for bit, except the absorbed query and the output
projection, batched matrix products over the prepared layouts, whose sums may be ordered
differently than the reference's einsums (bf16 results, within one rounding).

    q_c  = RMSNorm(h W_DQ^T)                      once, shared with the indexer
    q    = q_c W_UQR^T;  kv = h W_DKV^T;  kv_c = RMSNorm(kv[:Lkv]);  RoPE(q_pe), RoPE(k_pe)
    indexer (float32): q_I = q_c W_Iq^T, k_I = LayerNorm(h W_Ik^T), w = h W_Iw^T / sqrt(n_I d_I)
    absorbed q  = [q_nope W_UK^T  ‖  q_pe]        a bmm over the heads
    output      = (o_lat W_UV) W_O                a bmm over the heads, then a GEMM
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from mla.reference.front import Front, front_and_latent
from mla.reference.indexer import LAYER_NORM_EPS, IndexerQK, IndexerWeights
from mla.reference.rope import apply_rope
from mla.validation import acc_dtype
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


def sparse_front(weights: MLAWeights, indexer_weights: IndexerWeights, hidden: torch.Tensor,
                 positions: torch.Tensor) -> tuple[Front, IndexerQK]:
    """The front and the indexer's float query side of ``hidden [S, H]`` at ``positions``:
    ``mla_front(weights, hidden, positions)`` and ``indexer_qk(indexer_weights, hidden,
    q_latent(weights, hidden), positions)``, bit for bit, once the weights are prepared."""
    if weights.q_a_proj is None:
        raise ValueError("sparse_front needs a model with a q latent (q_a_proj): the indexer "
                         "reads it; got weights with q_proj")
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


def absorb_query(weights: MLAWeights, q_nope: torch.Tensor) -> torch.Tensor:
    """``q_nope [S, N, P]`` -> ``q_nope · W_UK^T`` ``[S, N, Lkv]``: ``absorb_q`` as one bmm."""
    return torch.bmm(q_nope.transpose(0, 1), _mla(weights).W_UK_T).transpose(0, 1)


def output_projection(weights: MLAWeights, o_lat: torch.Tensor) -> torch.Tensor:
    """``o_lat [..., N, Lkv]`` -> ``(o_lat · W_UV).flatten(-2) · W_O`` ``[..., H]``:
    ``project_output`` with the per-head product as one bmm."""
    lead = o_lat.shape[:-2]
    N, L = o_lat.shape[-2:]
    o = torch.bmm(o_lat.reshape(-1, N, L).transpose(0, 1), _mla(weights).W_UV)  # [N, S, V]
    return (o.transpose(0, 1).reshape(*lead, -1)) @ weights.W_O
