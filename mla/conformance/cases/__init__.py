"""The catalogue's case families, one module per kernel family; importing registers them."""

from mla.conformance.cases import (  # noqa: F401
    attention,
    dcp,
    decode,
    fp8,
    indices,
    merge,
    paged_cache,
    sparse_decode,
    sparse_prefill,
)
