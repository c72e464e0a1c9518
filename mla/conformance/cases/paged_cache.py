"""Cases of the paged_cache family (being written)."""
