"""One kernel call at a time across the threads of simulated ranks.

``run_simulated`` runs the ranks as threads of one process. Triton's interpreter patches
``triton.language`` while it runs a kernel, and a first launch compiles and caches, so two
threads launching at once can break each other. The rank programs therefore hold
``KERNEL_LOCK`` around their kernel calls, and never across a collective (a rank waiting at a
barrier while holding it would deadlock the others). Uncontended, on a process group with one
thread per rank, it costs a fraction of a microsecond.
"""

from __future__ import annotations

import threading

__all__ = ["KERNEL_LOCK"]

KERNEL_LOCK = threading.RLock()
