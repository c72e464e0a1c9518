"""Cases of the indices family (being written)."""
