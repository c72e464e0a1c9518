"""vLLM 0.33.0's Triton MLA kernels as a conformance target (unpacked by ``benchmarks.peers``).

``mla_decode_paged`` runs ``decode_attention_fwd`` (``v1/attention/ops/triton_decode_attention.py``)
as ``TritonMLAImpl.forward_mqa`` (``v1/attention/backends/mla/triton_mla.py``) calls it:
``k_buffer = kv_cache.unsqueeze(2)`` (one KV head), ``v_buffer = k_buffer[..., :Lv]``,
``page_size`` the cache's, ``is_mla=True``, a float32 workspace ``attn_logits
[rows, N, num_kv_splits, Lv + 1]`` with ``num_kv_splits = _compute_num_kv_splits(max_seq_len,
sm_count)`` (a power of two, ``max_seq_len // 512`` capped at twice the SMs). The kernel takes
one query row per request; ``s_q > 1`` is the backend's expansion: the block-table rows
repeated ``s_q`` times and, with ``causal``, row ``i`` given the extent ``L - s_q + 1 + i``
(clamped at 0), without it ``L``. One choice is ours: ``lse`` is a float32 buffer, where the
backend allocates it in q's dtype (bf16 in serving, which rounds the lse it hands to DCP).

Conventions found in its source, passed through unchanged: ``lse`` is natural-log (``tl.exp``,
``tl.log``); a request of length 0 gets ``out = 0/0 = NaN`` and ``lse = -inf`` (stage 2 divides
an empty sum; the backend never sends one); there is no causal flag (the extents are the mask);
V is the first ``Lv`` columns of K and the latent is tiled as a power of two (576 is split
512 + 64), so ``head_dim_v`` must be a power of two. It runs on CUDA only: under Triton 3.6's
CPU interpreter its loops over bounds loaded from memory fail (``range`` over a one-element
array), so CPU tensors are "unsupported" (``decode_rows`` holds the plumbing, tested on the
CPU with a stand-in kernel).

``merge_attn_states`` runs the Triton ``merge_attn_states`` (``triton_merge_attn_states.py``;
vLLM's dispatcher sends CUDA float16/bfloat16/float32 to a CUDA kernel instead, which the wheel
keeps in ``_C``, not unpacked). Layouts are ours (``o [T, N, D]``, ``lse [N, T]``). From its
source: ``+inf`` lse reads as ``-inf`` (empty); both empty gives ``out = 0`` and ``lse = -inf``;
one side empty is not a passthrough but ``o_p · 0 + o_s · 1`` (a NaN in the empty side's
output leaks); a NaN lse is not special.

``cp_lse_ag_out_rs`` is built from the DCP correction kernel (``CorrectAttnCPOutKernel.kernel``
of ``v1/attention/ops/dcp.py``, copied by ``benchmarks.peers``) the way ``cp_lse_ag_out_rs`` /
``_cp_lse_common`` / ``correct_attn_out`` run it: all-gather the lse along a new rank dim, the
kernel corrects this rank's output (``IS_BASE_E=True``, the MLA backends' default) and writes
the combined lse, then a reduce-scatter along the heads; ``return_lse`` slices this rank's
heads. From its source: NaN and ``+inf`` lse both read as ``-inf`` (a NaN is taken for "no
keys"); the scaled output stays in the input dtype before the reduce-scatter sums it (bf16
partials); ``tl.arange`` needs a power-of-two rank count and head dim; vLLM's own
``_cp_lse_common`` returns a bare tensor for one rank, which ``cp_lse_ag_out_rs`` then
unpacks (only a multi-rank group is meaningful there). vLLM corrects ``cp_attn_out`` in place;
the adapter corrects a copy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from mla.conformance.adapters import (
    import_peer,
    require,
    require_device,
    require_dtype,
    triton_runs_on,
)

__all__ = ["target", "mla_decode_paged", "decode_rows", "merge_attn_states", "cp_lse_ag_out_rs",
           "num_kv_splits"]

DECODE = "vLLM's Triton decode_attention_fwd"
MERGE = "vLLM's Triton merge_attn_states"
DCP = "vLLM's DCP correct_attn_out"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# triton_mla.py's _MIN_WORK_PER_SPLIT and _SPLIT_OCCUPANCY_MULTIPLIER
_MIN_WORK_PER_SPLIT, _SPLIT_OCCUPANCY_MULTIPLIER = 512, 2
_H200_SMS = 132  # the split count off CUDA (decode_rows in tests): the H200's


# simulated ranks are threads: one kernel launch at a time (Triton's interpreter patches
# triton.language while it runs a kernel, and a first launch compiles); collectives stay outside
_LAUNCH = threading.Lock()


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def num_kv_splits(max_seq_len: int, device: torch.device) -> int:
    """``_compute_num_kv_splits`` of triton_mla.py."""
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else _H200_SMS)
    return min(_next_pow2(max(1, max_seq_len // _MIN_WORK_PER_SPLIT)),
               sms * _SPLIT_OCCUPANCY_MULTIPLIER)


def mla_decode_paged(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     cache_seqlens: torch.Tensor, softmax_scale: float, causal: bool = False,
                     head_dim_v: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_attention_fwd`` with ``mla.reference.mla_decode_paged``'s signature."""
    require_device(DECODE, "cuda", q=q, kv_cache=kv_cache)  # see the module doc
    require_dtype(DECODE, _DTYPES, q=q, kv_cache=kv_cache)
    require(_pow2(head_dim_v), DECODE, f"tiles the latent V as a power of two (vLLM serves "
            f"512); head_dim_v = {head_dim_v} is not one")
    mod = import_peer("vllm.v1.attention.ops.triton_decode_attention", DECODE)
    return decode_rows(mod.decode_attention_fwd, q, kv_cache, block_table, cache_seqlens,
                       softmax_scale, causal, head_dim_v)


def decode_rows(decode_attention_fwd: Callable, q: torch.Tensor, kv_cache: torch.Tensor,
                block_table: torch.Tensor, cache_seqlens: torch.Tensor, softmax_scale: float,
                causal: bool, head_dim_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The call of ``TritonMLAImpl.forward_mqa``: one decode row per query token, the
    results in ``mla_decode_paged``'s layout (see the module doc)."""
    B, s_q, N, D = q.shape
    dev = q.device
    rows = B * s_q
    table, lens = block_table, cache_seqlens
    if s_q > 1:
        table = block_table.repeat_interleave(s_q, dim=0)
        if causal:
            offsets = torch.arange(1 - s_q, 1, device=dev, dtype=cache_seqlens.dtype)
            lens = (cache_seqlens.unsqueeze(1) + offsets).flatten().clamp(min=0)
        else:
            lens = cache_seqlens.repeat_interleave(s_q)
    max_len = int(cache_seqlens.max()) if B else 0
    splits = num_kv_splits(max_len, dev)
    k_buffer = kv_cache.unsqueeze(2)  # [num_blocks, page, 1, D]
    o = torch.empty(rows, N, head_dim_v, dtype=q.dtype, device=dev)
    lse = torch.empty(rows, N, dtype=torch.float32, device=dev)
    attn_logits = torch.empty(rows, N, splits, head_dim_v + 1, dtype=torch.float32, device=dev)
    if rows:
        decode_attention_fwd(q.reshape(rows, N, D), k_buffer, k_buffer[..., :head_dim_v], o,
                             lse, table, lens, attn_logits, splits, softmax_scale,
                             kv_cache.shape[1], is_mla=True)
    return (o.view(B, s_q, N, head_dim_v),
            lse.view(B, s_q, N).permute(0, 2, 1).contiguous())


def merge_attn_states(prefix_output: torch.Tensor, prefix_lse: torch.Tensor,
                      suffix_output: torch.Tensor, suffix_lse: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton ``merge_attn_states`` with ``mla.reference.merge_attn_states``'s signature:
    returns ``(output, output_lse)``, ``output_lse`` in ``prefix_lse``'s dtype."""
    require_dtype(MERGE, _DTYPES, prefix_output=prefix_output, suffix_output=suffix_output)
    triton_runs_on(MERGE, prefix_output, suffix_output)
    mod = import_peer("vllm.v1.attention.ops.triton_merge_attn_states", MERGE)
    # the kernel indexes outputs as contiguous [T, N, D] through prefix_output's head stride
    p, s = prefix_output.contiguous(), suffix_output.contiguous()
    T, N, _ = p.shape
    output = torch.empty_like(p)
    output_lse = torch.empty(N, T, dtype=prefix_lse.dtype, device=p.device)
    if T and N:
        mod.merge_attn_states(output, p, prefix_lse, s, suffix_lse, output_lse)
    return output, output_lse


def cp_lse_ag_out_rs(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, comm: object,
                     return_lse: bool = False
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vLLM's DCP correction with ``mla.reference.cp_lse_ag_out_rs``'s signature (``comm``:
    ``mla.reference.dcp.comm.Communicator``)."""
    require_dtype(DCP, _DTYPES, cp_attn_out=cp_attn_out)
    triton_runs_on(DCP, cp_attn_out, cp_attn_lse)
    T, N, D = cp_attn_out.shape
    W, rank = comm.world_size, comm.rank  # type: ignore[attr-defined]
    require(_pow2(W), DCP, f"spans the ranks with tl.arange: a power-of-two world size only, "
            f"got {W}")
    require(_pow2(D), DCP, f"spans the head dim with tl.arange: a power of two only, got {D}")
    mod = import_peer("vllm.v1.attention.ops.dcp_correct_attn_out", DCP)
    lse_local = cp_attn_lse.contiguous()
    lses = comm.all_gather(lse_local, dim=0).reshape((W, *lse_local.shape))  # type: ignore[attr-defined]
    out = cp_attn_out.clone()  # vLLM corrects its input in place
    _, l_sb, l_sh = lses.stride()
    lse = torch.empty_strided((T, N), (l_sb, l_sh), device=lses.device, dtype=lses.dtype)
    if T and N:
        o_sb, o_sh, o_sd = out.stride()
        with _LAUNCH:
            mod.correct_attn_cp_out_kernel[(T, N, 1)](
                out, out, lses, lse, o_sb, o_sh, o_sd, lses.stride(0), l_sb, l_sh, rank,
                HEAD_DIM=D, N_ROUNDED=W, IS_BASE_E=True)
    out = comm.reduce_scatter(out, dim=1)  # type: ignore[attr-defined]
    if return_lse:
        heads = N // W
        return out, lse[:, heads * rank: heads * (rank + 1)]
    return out


def target() -> dict[str, Callable]:
    """vLLM 0.33.0's Triton MLA decode, merge and DCP correction."""
    return {"mla_decode_paged": mla_decode_paged, "merge_attn_states": merge_attn_states,
            "cp_lse_ag_out_rs": cp_lse_ag_out_rs}
