"""Optimized GPU kernels (Triton) with the kernel-level API of ``mla.reference``.

Each kernel here mirrors the reference function of the same name and is checked against it
tensor by tensor (``python -m mla.check`` on a GPU; the tests under ``TRITON_INTERPRET=1``).
"""
