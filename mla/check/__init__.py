"""``python -m mla.check``: every fast kernel against the float64 reference, on a GPU."""
