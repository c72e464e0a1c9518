"""A conformance run's result: one row per (kernel, case), as a table, markdown or JSON."""

from __future__ import annotations

import dataclasses
import json
import math

__all__ = ["Row", "Report", "STATUSES", "missing_kernel_detail"]

STATUSES = ("pass", "fail", "unsupported", "error")


@dataclasses.dataclass
class Row:
    """One case run on one target.

    ``status``: "pass" (every error within its budget), "fail" (an error over it),
    "unsupported" (the target lacks the kernel or its adapter refused the inputs) or "error"
    (the kernel raised). ``errors`` and ``limits`` are by output (``out``, ``lse``, ...) and
    ``detail`` says where a failing output is wrong and, when a known convention difference
    explains it, names it (also in ``convention``).
    """
    kernel: str
    case: str
    topic: str
    doc: str
    status: str
    errors: dict[str, float] = dataclasses.field(default_factory=dict)
    limits: dict[str, float] = dataclasses.field(default_factory=dict)
    quantities: dict[str, str] = dataclasses.field(default_factory=dict)
    detail: str = ""
    convention: str = ""
    seconds: float = 0.0


def missing_kernel_detail(kernel: str) -> str:
    """The detail of a case whose kernel the target lacks ("unsupported")."""
    return f"the target has no {kernel}"


def _num(v: float) -> float | str:
    return v if math.isfinite(v) else str(v)


@dataclasses.dataclass
class Report:
    target: str
    device: str
    dtype: str
    rows: list[Row]
    environment: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """No case failed or raised, and at least one ran."""
        return (any(r.status == "pass" for r in self.rows)
                and not any(r.status in ("fail", "error") for r in self.rows))

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.rows) for s in STATUSES}

    def summary(self) -> str:
        c = self.counts()
        return (f"{self.target} on {self.device} ({self.dtype}): " +
                ", ".join(f"{v} {k}" for k, v in c.items()) + f" of {len(self.rows)} cases")

    def to_json(self) -> str:
        rows = [{**dataclasses.asdict(r),
                 "errors": {k: _num(v) for k, v in r.errors.items()},
                 "limits": {k: _num(v) for k, v in r.limits.items()}} for r in self.rows]
        return json.dumps({"target": self.target, "device": self.device, "dtype": self.dtype,
                           "passed": self.passed, "counts": self.counts(),
                           "environment": self.environment, "rows": rows}, indent=1) + "\n"

    def missing_kernels(self) -> dict[str, int]:
        """The kernels the target lacks, each with the number of its cases (rows
        "unsupported" because the target has no such kernel), in the catalogue's order."""
        missing: dict[str, int] = {}
        for r in self.rows:
            if _lacks_kernel(r):
                missing[r.kernel] = missing.get(r.kernel, 0) + 1
        return missing

    def _missing_line(self) -> str:
        """One line for the rows of kernels the target lacks ("" when none)."""
        missing = self.missing_kernels()
        if not missing:
            return ""
        n = sum(missing.values())
        return (f"{n} unsupported cases not listed: the target has no "
                + ", ".join(f"{k} ({v})" for k, v in missing.items())
                + " (pass kernels=[...], or --kernels to mla conform, to run only the kernels "
                "it has; the JSON report holds every row)")

    def to_markdown(self) -> str:
        """The summary, then a table of the cases, less those of kernels the target lacks
        (one line says which kernels and how many cases; ``to_json`` holds every row)."""
        env = ", ".join(f"{k} {v}" for k, v in self.environment.items())
        missing = self._missing_line()
        lines = [f"# Conformance of `{self.target}`", "",
                 f"{self.summary()}.", "", f"Environment: {env}." if env else "", "",
                 *([f"{missing}.", ""] if missing else []),
                 "| kernel | case | status | errors (budget) | detail |",
                 "|---|---|---|---|---|"]
        for r in self.rows:
            if _lacks_kernel(r):
                continue
            errs = ", ".join(f"{k} {_error(r.quantities.get(k, ''), r.errors[k])} "
                             f"({r.limits.get(k, math.nan):.1e})" for k in r.errors)
            detail = (r.convention + ". " if r.convention else "") + r.detail
            cells = [r.kernel, r.case, r.status, errs, detail]
            lines.append("| " + " | ".join(c.replace("|", "/").replace("\n", " ")
                                           for c in cells) + " |")
        return "\n".join(lines) + "\n"

    def to_text(self) -> str:
        """A fixed-width table for a terminal: failures with their detail; the cases of
        kernels the target lacks as one line."""
        out = []
        for r in self.rows:
            if _lacks_kernel(r):
                continue
            errs = " ".join(f"{k}={r.errors[k]:.1e}/{r.limits.get(k, math.nan):.0e}"
                            for k in r.errors)
            out.append(f"{r.status:11s} {r.kernel}/{r.case}  {errs}")
            if r.status != "pass" and (r.convention or r.detail):
                out.append("            " + (r.convention + ". " if r.convention else "")
                           + r.detail[:400])
        missing = self._missing_line()
        return "\n".join(out + ([missing] if missing else []) + [self.summary()])


def _lacks_kernel(r: Row) -> bool:
    """The row of a kernel the target does not have (``missing_kernel_detail``)."""
    return r.status == "unsupported" and r.detail == missing_kernel_detail(r.kernel)


def _error(quantity: str, value: float) -> str:
    """An error with the kind of its quantity (conventions §11): "rel 1.23e-04" for
    ``out_rel``, "abs ..." for ``lse_abs``, "3 mismatches" for ``mismatches``, "275 ulps" for a
    property's ``ulps``."""
    if quantity == "mismatches":
        return f"{int(value)} mismatches" if math.isfinite(value) else f"{value} mismatches"
    if quantity == "ulps":  # a metamorphic property's worst difference
        return f"{value:g} ulps"
    kind = quantity.rsplit("_", 1)[-1]
    return f"{kind} {value:.2e}" if kind else f"{value:.2e}"
