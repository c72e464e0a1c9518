"""What the Gluon sm_90 kernels share: one online-softmax + ``P · V`` step, and the CTA barrier.

(The Triton kernels share theirs in ``mla.fast.softmax``.)
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

__all__ = ["barrier", "softmax_pv"]

# The barrier of all threads of a program (CTA): Triton 3.6 names it ``gl.thread_barrier``,
# 3.7 ``gl.barrier`` (same operation). Resolved once here; a Gluon with neither name fails
# this import, which ``mla.fast.sm90.usable`` reports.
barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@gluon.jit
def softmax_pv(qk, m_i, l_i, acc, p_smem, kv, row_o: gl.constexpr, WAIT: gl.constexpr = True):
    """One online-softmax step shared by the sm_90 kernels: the logits ``qk`` (log2 domain,
    ``-inf`` where masked) update the running max ``m_i`` and sum ``l_i``; ``P`` goes through
    ``p_smem`` to both warp groups and ``acc += P · V`` (V = the first 512 columns of ``kv``).
    Returns ``(acc, m_i, l_i)``. A row that has seen no key keeps ``m = -inf``, ``l = 0``; a NaN
    logit makes ``l`` NaN, which the epilogues pass on (``l != 0``: a key was seen).
    ``WAIT`` off: ``acc`` comes back as the in-flight ``P · V``'s token, for the caller to
    issue other work (copies) before its ``warpgroup_mma_wait``; ``p_smem`` and ``kv`` stay
    in use until then."""
    m_new = gl.maximum(m_i, gl.max(qk, axis=1))
    # a row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    barrier()  # all of P is written before either warp group's wgmma reads it
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    acc = warpgroup_mma(p_smem, kv, acc, is_async=True)
    if WAIT:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return acc, m_new, l_i
