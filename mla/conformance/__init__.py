"""Differential testing of anyone's MLA kernel against the float64 reference.

``run(target)`` runs the catalogue of named cases (``CATALOGUE``; each pins one convention or
edge) on a target, a mapping or module of kernels with ``mla.reference``'s names, signatures
and conventions, and returns a ``Report``: per case the errors against the float64 reference,
the budgets they are held to, and for a failure where it is wrong and which known convention
difference explains it. ``mla conform --target ...`` is the command.
"""

from mla.conformance.cases import CASE_FAMILIES
from mla.conformance.catalogue import (
    CATALOGUE,
    KERNELS,
    Case,
    Setting,
    Trial,
    Unsupported,
    case,
    cases_of,
)
from mla.conformance.report import Report, Row
from mla.conformance.runner import FLOAT64_BUDGET, kernels_of, limit, run, run_case

__all__ = ["CASE_FAMILIES", "CATALOGUE", "FLOAT64_BUDGET", "KERNELS", "Case", "Report", "Row",
           "Setting", "Trial", "Unsupported", "case", "cases_of", "kernels_of", "limit", "run",
           "run_case"]
