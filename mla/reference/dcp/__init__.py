"""Decode context parallelism (DCP): one request's latent cache spread over ``W`` ranks.

conventions §9, papers/derivation.md (21) to (23). One module per idea:

- ``comm``: the ``Communicator`` protocol (all-gather, reduce-scatter), simulated ranks
  (``run_simulated``) and a ``torch.distributed`` process group (``ProcessGroupCommunicator``);
- ``sharding``: the interleaved placement, local lengths, local caches, new-token slots (21);
- ``decode``: local decode and the log-sum-exp combination ``cp_lse_ag_out_rs`` (22);
- ``context``: the DCP chunk plan, the gather of a context chunk, ``reorg_kvcache`` (23);
- ``model``: the model-level forwards, hidden states in, hidden states out.

A *rank program* takes the communicator first and the global inputs, and does one rank's
part; the same function runs on simulated ranks and on a process group::

    parts = run_simulated(W, functools.partial(dcp_decode_rank, q=q, kv_cache=kv_cache, ...))
    out = torch.cat([o for o, _ in parts], dim=2)        # each rank returns its N/W heads
    hidden_out = same_on_all_ranks(run_simulated(W, functools.partial(
        dcp_decode_forward_rank, weights=weights, hidden=hidden, ...)))

``mla.check.dcp`` starts processes and runs them on a ``torch.distributed`` group.
"""

from mla.reference.dcp.comm import (
    Communicator,
    ProcessGroupCommunicator,
    SimulatedCommunicator,
    run_simulated,
    same_on_all_ranks,
)
from mla.reference.dcp.context import (
    DCPChunkPlan,
    dcp_chunked_prefill_attention,
    dcp_chunked_prefill_rank,
    dcp_gather_context_chunk,
    plan_dcp_context_chunks,
    reorg_kvcache,
)
from mla.reference.dcp.decode import cp_lse_ag_out_rs, dcp_decode, dcp_decode_rank, dcp_local_decode
from mla.reference.dcp.model import (
    dcp_chunked_prefill_forward,
    dcp_chunked_prefill_forward_rank,
    dcp_decode_forward,
    dcp_decode_forward_rank,
)
from mla.reference.dcp.sharding import (
    DCPSharding,
    LocalKVCache,
    dcp_local_seq_lens,
    dcp_slot_mapping,
    head_slice,
    shard_kv_cache,
)

__all__ = [
    "Communicator", "SimulatedCommunicator", "ProcessGroupCommunicator", "run_simulated",
    "same_on_all_ranks",
    "dcp_local_seq_lens", "head_slice", "DCPSharding", "LocalKVCache", "shard_kv_cache",
    "dcp_slot_mapping",
    "dcp_local_decode", "cp_lse_ag_out_rs", "dcp_decode", "dcp_decode_rank",
    "DCPChunkPlan", "plan_dcp_context_chunks", "reorg_kvcache", "dcp_gather_context_chunk",
    "dcp_chunked_prefill_attention", "dcp_chunked_prefill_rank",
    "dcp_decode_forward", "dcp_chunked_prefill_forward", "dcp_decode_forward_rank",
    "dcp_chunked_prefill_forward_rank",
]
