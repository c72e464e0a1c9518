"""Probes: tools that measure one property of a kernel in isolation (see benchmarks/README.md)."""
