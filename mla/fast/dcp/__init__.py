"""Decode context parallelism (DCP) on the fast path: ``mla.reference.dcp``'s rank programs
with the fast kernels (conventions §9; docs/kernels.md, "DCP").

- ``correction``: the Triton log-sum-exp correction and ``cp_lse_ag_out_rs`` (float32 sum,
  NaN propagates, ranks without keys add exactly nothing);
- ``comm``: ``CapturableCommunicator``, a process-group communicator whose collectives read
  nothing on the host (CUDA-graph capturable under NCCL);
- ``decode``: local ``mla.fast.mla_decode_paged`` with global causal positions, the
  correction, the sync-free ``dcp_slot_mapping``;
- ``context``: chunked prefill with the context gathered by ``gather_cache_known``,
  all-gathered, rebuilt by a device-indexed ``reorg_kvcache`` and merged;
- ``model``: the forwards from hidden states.

Rank programs take the communicator first, as the reference's, and run on ``run_simulated``
or on a process group (``mla.check.dcp.run_process_group``, ``torchrun``).
"""

from mla.fast.dcp.comm import CapturableCommunicator
from mla.fast.dcp.context import (
    dcp_chunked_prefill_attention,
    dcp_chunked_prefill_rank,
    dcp_gather_context_chunk,
    reorg_index,
    reorg_kvcache,
)
from mla.fast.dcp.correction import correct_attn_out, cp_lse_ag_out_rs
from mla.fast.dcp.decode import (
    dcp_decode,
    dcp_decode_rank,
    dcp_local_decode,
    dcp_slot_mapping,
    local_visible_lens,
)
from mla.fast.dcp.model import (
    dcp_chunked_prefill_forward,
    dcp_chunked_prefill_forward_rank,
    dcp_decode_forward,
    dcp_decode_forward_rank,
)

__all__ = [
    "CapturableCommunicator", "correct_attn_out", "cp_lse_ag_out_rs",
    "local_visible_lens", "dcp_local_decode", "dcp_decode", "dcp_decode_rank",
    "dcp_slot_mapping", "reorg_index", "reorg_kvcache", "dcp_gather_context_chunk",
    "dcp_chunked_prefill_attention", "dcp_chunked_prefill_rank", "dcp_decode_forward",
    "dcp_chunked_prefill_forward", "dcp_decode_forward_rank", "dcp_chunked_prefill_forward_rank",
]
