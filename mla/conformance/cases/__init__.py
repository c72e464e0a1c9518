"""The catalogue's case families, one module per kernel family; importing registers them
(``import mla.conformance`` does)."""

from mla.conformance.cases import (
    attention,
    dcp,
    decode,
    deepseek_v4,
    deepseek_v4_layer,
    deepseek_v4_stages,
    fp8,
    indexer,
    indices,
    merge,
    paged_cache,
    sparse_decode,
    sparse_prefill,
    v41_codecs,
)

CASE_FAMILIES = (attention, dcp, decode, deepseek_v4, deepseek_v4_layer, deepseek_v4_stages, fp8,
                 indexer, indices, merge, paged_cache, sparse_decode, sparse_prefill, v41_codecs)
