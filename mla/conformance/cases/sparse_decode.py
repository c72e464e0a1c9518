"""Cases of the sparse_decode family (being written)."""
