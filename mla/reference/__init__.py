"""The plain-PyTorch reference of Multi-head Latent Attention: the oracle.

One module per idea, each opening with its equations (see ``docs/conventions.md``). Runs in any
float dtype on any device; in float64 on the CPU it is the ground truth every kernel is
checked against. Nothing here imports from ``mla.fast``.
"""

from mla.reference.attention import attention_with_lse
from mla.reference.chunked import (
    ChunkPlan,
    chunked_prefill_attention,
    plan_context_chunks,
    workspace_size,
)
from mla.reference.dcp import (
    DCPChunkPlan,
    DCPSharding,
    cp_lse_ag_out_rs,
    dcp_chunked_prefill_forward_rank,
    dcp_chunked_prefill_rank,
    dcp_decode_forward_rank,
    dcp_decode_rank,
    dcp_local_seq_lens,
    plan_dcp_context_chunks,
    reorg_kvcache,
    run_simulated,
    same_on_all_ranks,
    shard_kv_cache,
)
from mla.reference.decode import absorb_q, absorbed_attention, mla_decode_paged
from mla.reference.fp8 import (
    act_quant,
    concat_and_cache_fp8_ds_mla,
    dequantize_fp8_ds_mla,
    fp8_ds_mla_scales,
    gather_and_upconvert_fp8_ds_mla,
    quantize_fp8_ds_mla,
)
from mla.reference.fp8_model1 import (
    dequantize_fp8_model1,
    fp8_model1_cache,
    fp8_model1_page_bytes,
    fp8_model1_pages,
    quantize_fp8_model1,
)
from mla.reference.fp8_v41 import (
    dequantize_fp8_v41,
    dequantize_nvfp4_v41,
    quantize_fp8_v41,
    quantize_nvfp4_v41,
)
from mla.reference.front import Front, mla_front, rms_norm
from mla.reference.indexer import (
    IndexerQK,
    IndexerWeights,
    hadamard_rotate,
    index_scores,
    indexer_qk,
    indexer_topk,
    q_latent,
    select_topk,
)
from mla.reference.indexer_cache import (
    dequantize_indexer_k,
    gather_indexer_k_cache,
    indexer_k_quant_and_cache,
    quantize_indexer_k,
    read_indexer_k_cache,
)
from mla.reference.indexer_logits import (
    compressed_rows,
    decode_row_ends,
    fp8_mqa_logits,
    fp8_paged_mqa_logits,
    quantize_indexer_q,
    top_k_per_row,
)
from mla.reference.merge import merge_attn_states, merge_attn_states_list
from mla.reference.model import chunked_prefill_forward, decode_forward, write_context
from mla.reference.naive import naive_attention, naive_forward
from mla.reference.paged_cache import (
    cache_rows,
    concat_and_cache_mla,
    gather_cache,
    make_block_table,
    slot_mapping_from_block_table,
)
from mla.reference.prefill import prefill_attention, prefill_forward, up_project_kv
from mla.reference.rope import apply_rope, rope_frequencies
from mla.reference.sink import apply_attn_sink
from mla.reference.sparse import (
    convert_req_index_to_global_index,
    sparse_index_mask,
    sparse_mla_decode,
    sparse_mla_prefill,
)
from mla.reference.sparse_model import (
    sparse_decode_forward,
    sparse_masked_dense_forward,
    sparse_prefill_forward,
)
from mla.reference.v4.kernels import v4_compress, v4_indexer_q, v4_indexer_topk, v4_output
from mla.reference.v4.scopes import v4_scope_indices

__all__ = [
    "ChunkPlan", "Front", "absorb_q", "absorbed_attention", "apply_rope", "attention_with_lse",
    "cache_rows", "chunked_prefill_attention", "chunked_prefill_forward", "concat_and_cache_mla",
    "decode_forward", "gather_cache", "make_block_table", "merge_attn_states",
    "merge_attn_states_list", "mla_decode_paged", "mla_front", "naive_attention",
    "naive_forward", "plan_context_chunks", "prefill_attention", "prefill_forward", "rms_norm",
    "rope_frequencies", "slot_mapping_from_block_table", "up_project_kv", "workspace_size",
    "write_context",
    # sparse (DeepSeek-V3.2) and fp8_ds_mla
    "IndexerQK", "IndexerWeights", "act_quant", "concat_and_cache_fp8_ds_mla",
    "convert_req_index_to_global_index", "dequantize_fp8_ds_mla", "fp8_ds_mla_scales",
    "gather_and_upconvert_fp8_ds_mla", "hadamard_rotate", "index_scores", "indexer_qk",
    "indexer_topk", "q_latent", "quantize_fp8_ds_mla", "select_topk", "sparse_decode_forward",
    "sparse_index_mask", "sparse_masked_dense_forward", "sparse_mla_decode",
    "sparse_mla_prefill", "sparse_prefill_forward",
    # the indexer's fp8 key cache, logits and top-k
    "compressed_rows", "decode_row_ends", "dequantize_indexer_k", "fp8_mqa_logits",
    "fp8_paged_mqa_logits", "gather_indexer_k_cache", "indexer_k_quant_and_cache",
    "quantize_indexer_k", "quantize_indexer_q", "read_indexer_k_cache", "top_k_per_row",
    # decode context parallelism: rank programs, run by run_simulated or on a process group
    "DCPChunkPlan", "DCPSharding", "cp_lse_ag_out_rs", "dcp_chunked_prefill_forward_rank",
    "dcp_chunked_prefill_rank", "dcp_decode_forward_rank", "dcp_decode_rank",
    "dcp_local_seq_lens", "plan_dcp_context_chunks", "reorg_kvcache", "run_simulated",
    "same_on_all_ranks", "shard_kv_cache",
    # DeepSeek-V4: attention sinks and the MODEL1 fp8 cache
    "apply_attn_sink", "dequantize_fp8_model1", "fp8_model1_cache", "fp8_model1_page_bytes",
    "fp8_model1_pages", "quantize_fp8_model1",
    # DeepSeek-V4.1's caches: 528-byte MXFP8 and 288-byte NVFP4 records
    "dequantize_fp8_v41", "dequantize_nvfp4_v41", "quantize_fp8_v41", "quantize_nvfp4_v41",
    # DeepSeek-V4's layer kernels: the compressor, the indexer's q, the scopes' indices, the
    # indexer's top-k and the output stage
    "v4_compress", "v4_indexer_q", "v4_indexer_topk", "v4_output", "v4_scope_indices",
]
