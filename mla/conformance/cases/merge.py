"""Cases of the merge family (being written)."""
