"""Cases of the fp8 family (being written)."""
