"""GPU benchmarks of the fast kernels: ``python -m benchmarks.run`` (see benchmarks/README.md)."""
