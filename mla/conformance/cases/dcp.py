"""Cases of the dcp family (being written)."""
