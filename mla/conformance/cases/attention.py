"""Cases of the attention family (being written)."""
