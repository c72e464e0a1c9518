"""Compute-friendly prefill with its LSE, fast: two GEMMs up-project the latent, then attention.

Same contract as ``mla.reference.prefill.prefill_attention`` (conventions §3):

    k_nope = kv_c · W_UK      [Skv, N, P]        v = kv_c · W_UV      [Skv, N, V]
    (o, lse) = attention([q_nope, q_pe], [k_nope, k_pe broadcast], v)   o [Sq,N,V], lse [N,Sq]

QK 192 / V 128 for DeepSeek. The attention goes by ``mla.fast.attention.pick_route``:
- cuDNN (``torch.ops.aten._scaled_dot_product_cudnn_attention`` with its LSE) for bf16/fp16
  on CUDA without explicit positions, ``Sq = Skv`` when causal: the fastest route measured on
  the H200 (benchmarks/results/prefill/prefill_routes.md). It needs whole ``q`` and ``k``
  tensors, so ``q_nope ‖ q_pe`` and ``k_nope ‖ k_pe`` are concatenated (one copy each).
- our Triton kernel otherwise on CUDA (explicit positions, ``Sq != Skv`` causal, fp32): it
  reads ``q_pe`` and a head-broadcast view of ``k_pe`` directly, nothing concatenated.
- on the CPU (and for float64): the reference's math, ``mla.reference.prefill``.
"""

from __future__ import annotations

import torch

from mla.fast.attention import cudnn_attention_with_lse, flash_attention_with_lse, pick_route
from mla.reference.attention import default_positions
from mla.reference.prefill import prefill_attention as _reference_prefill
from mla.validation import check_float, check_same_device, check_same_dtype

__all__ = ["up_project", "prefill_attention"]


def up_project(kv_c: torch.Tensor, W_UK: torch.Tensor,  # noqa: N803
               W_UV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: N803
    """``kv_c [S, Lkv]`` -> ``k_nope [S, N, P]``, ``v [S, N, V]``: one GEMM each, contiguous."""
    S = kv_c.shape[0]
    Lkv, N, P = W_UK.shape
    V = W_UV.shape[2]
    k_nope = (kv_c @ W_UK.reshape(Lkv, N * P)).view(S, N, P)
    v = (kv_c @ W_UV.reshape(Lkv, N * V)).view(S, N, V)
    return k_nope, v


def prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    W_UK: torch.Tensor,  # noqa: N803
    W_UV: torch.Tensor,  # noqa: N803
    softmax_scale: float,
    causal: bool = True,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_nope [Sq,N,P]``, ``q_pe [Sq,N,R]`` over keys ``kv_c [Skv,Lkv]``, ``k_pe [Skv,R]``.

    Returns ``o [Sq, N, V]`` and ``lse [N, Sq]`` (float32 on the GPU routes), as the reference.
    """
    check_float("W_UK", W_UK, ndim=3)
    Lkv, N, P = W_UK.shape
    check_float("W_UV", W_UV, shape=[Lkv, N, None])
    check_float("q_nope", q_nope, shape=[None, N, P])
    Sq = q_nope.shape[0]
    check_float("q_pe", q_pe, shape=[Sq, N, None])
    R = q_pe.shape[2]
    check_float("kv_c", kv_c, shape=[None, Lkv])
    Skv = kv_c.shape[0]
    check_float("k_pe", k_pe, shape=[Skv, R])
    check_same_dtype(q_nope=q_nope, q_pe=q_pe, kv_c=kv_c, k_pe=k_pe, W_UK=W_UK, W_UV=W_UV)
    check_same_device(q_nope=q_nope, q_pe=q_pe, kv_c=kv_c, k_pe=k_pe, W_UK=W_UK, W_UV=W_UV,
                      q_positions=q_positions, k_positions=k_positions)
    has_pos = q_positions is not None or k_positions is not None
    route = pick_route(q_nope.device, q_nope.dtype, Sq, Skv, N, N, P + R, W_UV.shape[2],
                       causal, has_pos)
    if route == "reference":
        return _reference_prefill(q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, softmax_scale,
                                  causal, q_positions, k_positions)
    k_nope, v = up_project(kv_c, W_UK, W_UV)
    k_pe_heads = k_pe[:, None, :].expand(Skv, N, R)
    if route == "cudnn":
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe_heads], dim=-1)
        return cudnn_attention_with_lse(q, k, v, softmax_scale, causal)
    if has_pos:
        dq, dk = default_positions(Sq, Skv, q_nope.device)
        q_positions = dq if q_positions is None else q_positions
        k_positions = dk if k_positions is None else k_positions
    cu_q = torch.tensor([0, Sq], dtype=torch.int32, device=q_nope.device)
    cu_k = torch.tensor([0, Skv], dtype=torch.int32, device=q_nope.device)
    return flash_attention_with_lse(q_nope, q_pe, k_nope, k_pe_heads, v, cu_q, cu_k, Sq,
                                    softmax_scale, causal, q_positions, k_positions)
