"""``python -m mla.check``: every fast kernel against the float64 reference, on a GPU.

``registry`` (contexts, cases, results, running); ``catalogue`` (the conformance catalogue of
``mla.conformance`` run on ``mla.fast``: the cases every kernel is held to); one module per
kernel family for what only our kernels have (``decode``, ``sparse``, ``attention``:
forced plans and routes, CUDA-graph capture; ``prefill``: the prefill paths); ``runner`` (the
command); ``dcp`` (the decode context parallelism check on a process group).
"""
