"""Cases of the sparse_prefill family (being written)."""
