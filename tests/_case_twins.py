"""The V4 layer and stage tests' broken twins: each twin run on its kernel's cases (once per
twin), and the verdicts a twin must get (the cases it fails, with the convention named, and
those it still passes)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

from mla.conformance import Setting, cases_of
from mla.conformance.runner import run_case

SETTING = Setting(torch.device("cpu"), torch.float64, 0, True)


@functools.cache
def twin_rows(twin: Callable, kernel: str) -> dict[str, object]:
    """``kernel``'s cases run on ``twin`` in float64 on the CPU, by case name."""
    return {c.name: run_case(twin, c, SETTING) for c in cases_of([kernel])}


def assert_twin_verdicts(name: str, rows: dict[str, object], words: str,
                         must_fail: Iterable[str], must_pass: Iterable[str]) -> None:
    """Twin ``name`` fails every case of ``must_fail`` and none of ``must_pass``; each case it
    fails is a ``fail`` whose convention holds ``words``."""
    failed = {n for n, r in rows.items() if r.status != "pass"}
    assert set(must_fail) <= failed, (name, sorted(set(must_fail) - failed))
    assert not set(must_pass) & failed, (name, sorted(set(must_pass) & failed))
    for n in failed:
        r = rows[n]
        assert r.status == "fail" and words in r.convention, (name, n, r.convention, r.detail)
