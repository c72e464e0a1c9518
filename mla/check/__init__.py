"""``python -m mla.check``: every fast kernel against the float64 reference, on a GPU.

``registry`` (contexts, cases, results, running), one module of cases per kernel family
(``decode``, ``merge``, ``paged_cache``, ``fp8``, ``prefill``, ``sparse``), ``runner`` (the
command), and ``dcp`` (the decode context parallelism check on a process group).
"""
