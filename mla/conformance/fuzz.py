"""Property-based search over a kernel's inputs, judged like the catalogue's cases.

``fuzz(target, kernel)`` draws specs of the kernel's case family (``fuzz_strategies``: batch,
odd head counts, page sizes 1 to 256, ragged lengths with 0, 1 and page edges, ``s_q`` and
``causal``, top-k widths, invalid indices anywhere, ``topk_length``, both KV scopes and sinks,
NaN in unused rows, sharp and flat softmaxes, lse near ±1000, empty merge sides and ranks; for
the indexer, ``top_k_per_row`` rows of 0, 1, k - 1, k, k + 1 keys with ties, NaN and ±inf,
ragged ``fp8_mqa_logits`` windows with empty ones and ones of 1, unseen NaN keys, far
magnitudes, and ``fp8_paged_mqa_logits`` over pages 1 to 256 with ``next_n`` 1 to 4) and
a seed; the family's trial builds the inputs, runs the float64 reference and holds the
kernel's outputs to the catalogue's budgets, and a failure is diagnosed as a case's is
(``diagnose.explain`` names the convention). Hypothesis shrinks a failure to a minimal spec,
reported as a runnable snippet, and keeps it in an example database (``database``, the
environment variable ``MLA_FUZZ_DB``, default ``.hypothesis/mla-fuzz``) that a later run
replays first. Inputs the target's adapter refuses (``Unsupported``) are skipped; where a
target states what its kernels take (``fuzz_strategies.accepts_for``: a peer's adapter, a
signature without ``attn_sink``), the draws stay within it (``accepts``), so that most of a
search is judged rather than skipped.

    report = fuzz(my_kernels, "sparse_mla_decode", seconds=60)
    assert report.passed, report.to_markdown()

``properties`` (names of ``mla.conformance.properties.PROPERTIES``, or ``"all"``) checks
metamorphic properties beside the budgets on every example of ``mla_decode_paged`` and
``sparse_mla_decode``: batch invariance, page placement and batch permutation, bit for bit. A
property that fails is shrunk and reported as a budget failure is, its ``convention`` saying
which (``"not batch invariant: ..."``); ``budgets=False`` checks the properties alone.

``mla conform --target T --kernels K --fuzz 300s`` (or ``--fuzz 200``, examples) runs it;
``--properties all`` adds the properties.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import NoSuchExample

from mla.conformance.catalogue import Case, Setting, Trial, Unsupported
from mla.conformance.fuzz_strategies import (
    FUZZED,
    Accepts,
    Example,
    accepts_for,
    examples_of,
    trial_of,
)
from mla.conformance.properties import PROPERTY_KERNELS, check, properties_of
from mla.conformance.runner import kernels_of, run_case
from mla.environment import environment

__all__ = ["fuzz", "FuzzReport", "Failure", "KernelRun", "judge", "snippet", "FUZZED",
           "Accepts", "DEFAULT_DATABASE", "DATABASE_ENV"]

DEFAULT_DATABASE = ".hypothesis/mla-fuzz"
DATABASE_ENV = "MLA_FUZZ_DB"
CHUNK = 25  # examples a search round when the search is bounded by time


def judge(kernel: str, fn: Callable, trial: Trial, setting: Setting):  # noqa: ANN201
    """``fn`` on ``trial``'s inputs, judged as a catalogue case is (``runner.run_case``: the
    budgets of the setting's dtype, ``describe`` and ``explain``): a ``Row``."""
    c = Case(kernel, "fuzz", "fuzz", "a spec drawn by mla.conformance.fuzz", lambda s: trial)
    return run_case(fn, c, setting)


@dataclasses.dataclass
class Failure:
    """A failing example shrunk by hypothesis: its case parameters (``example.spec``), the
    seed, what is wrong and the convention the diagnosis names; ``snippet`` rebuilds the
    inputs and calls the kernel."""
    kernel: str
    example: Example
    status: str  # "fail" or "error"
    errors: dict[str, float]
    limits: dict[str, float]
    detail: str
    convention: str
    snippet: str
    property_name: str = ""  # the metamorphic property broken ("" for a budget failure)

    @property
    def spec(self) -> object:
        return self.example.spec


@dataclasses.dataclass
class KernelRun:
    """One kernel's search: examples judged, skipped as unsupported, seconds; its shrunk
    failures, one a failure mode (``failure_mode``; more than one only with ``keep_going``),
    and ``repeats``, the examples that failed again in a mode already found."""
    kernel: str
    examples: int = 0
    unsupported: int = 0
    seconds: float = 0.0
    failures: list[Failure] = dataclasses.field(default_factory=list)
    missing: bool = False  # the target has no such kernel
    repeats: int = 0
    accepts: str = ""  # the limits the draws kept within (Accepts.describe; "": none)

    @property
    def failure(self) -> Failure | None:
        """The first failure found (None: the kernel passed)."""
        return self.failures[0] if self.failures else None


def failure_mode(status: str, what: dict) -> tuple[str, ...]:
    """What makes two failures the same: the property broken and the convention named, or,
    where no convention is known, the status and the outputs over their budgets."""
    if what.get("convention"):
        return (what.get("property", ""), what["convention"].split(":")[0])
    over = sorted(k for k, v in what.get("errors", {}).items()
                  if not v <= what.get("limits", {}).get(k, math.inf))
    return (what.get("property", ""), status, *over)


@dataclasses.dataclass
class FuzzReport:
    target: str
    device: str
    dtypes: list[str]
    seed: int
    database: str
    runs: list[KernelRun]
    environment: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def failures(self) -> list[Failure]:
        return [f for r in self.runs for f in r.failures]

    @property
    def passed(self) -> bool:
        """No failure, and at least one example judged."""
        return not self.failures and any(r.examples > r.unsupported for r in self.runs)

    def summary(self) -> str:
        judged = sum(r.examples - r.unsupported for r in self.runs)
        skipped = sum(r.unsupported for r in self.runs)
        return (f"fuzz of {self.target} on {self.device} ({', '.join(self.dtypes)}), seed "
                f"{self.seed}: {judged} examples judged, {skipped} unsupported (skipped), "
                f"{sum(bool(r.failures) for r in self.runs)} failing kernels"
                + (f", {len(self.failures)} failure modes" if len(self.failures) > 1 else ""))

    def to_text(self) -> str:
        lines = []
        for r in self.runs:
            if r.missing:
                lines.append(f"unsupported {r.kernel}: the target has no such kernel")
                continue
            state = "fail" if r.failure else "pass"
            lines.append(f"{state:11s} {r.kernel}  {r.examples - r.unsupported} judged, "
                         f"{r.unsupported} unsupported, {r.seconds:.1f} s"
                         + (f" (drawn within: {r.accepts})" if r.accepts else ""))
            for f in r.failures:
                lines.append(f"            shrunk to {f.example.spec!r}, seed {f.example.seed}, "
                             f"{_dtype(f.example.dtype)}")
                lines.append("            " + (f.convention + ". " if f.convention else "")
                             + f.detail[:400])
        return "\n".join(lines + [self.summary()])

    def to_markdown(self) -> str:
        env = ", ".join(f"{k} {v}" for k, v in self.environment.items())
        lines = [f"# Fuzz of `{self.target}`", "", f"{self.summary()}.", "",
                 f"Environment: {env}." if env else "", "",
                 f"Example database: `{self.database}` (a re-run replays its failures first).",
                 "", "| kernel | status | examples | unsupported | failure modes | seconds |",
                 "|---|---|---|---|---|---|"]
        for r in self.runs:
            state = "no such kernel" if r.missing else "fail" if r.failure else "pass"
            modes = f"{len(r.failures)}" + (f" (+{r.repeats} repeats)" if r.repeats else "")
            lines.append(f"| {r.kernel} | {state} | {r.examples - r.unsupported} | "
                         f"{r.unsupported} | {modes} | {r.seconds:.1f} |")
        within = [f"`{r.kernel}`: {r.accepts}" for r in self.runs if r.accepts]
        if within:
            lines += ["", "Drawn within what the kernels take (their adapters' statements, "
                      "their signatures): " + "; ".join(within) + "."]
        for f in self.failures:
            errs = ", ".join(f"{k} {v:.2e} ({f.limits.get(k, math.nan):.1e})"
                             for k, v in f.errors.items())
            lines += ["", f"## `{f.kernel}`: {f.status}", "",
                      f"Shrunk to `{f.example.spec!r}`, seed {f.example.seed}, "
                      f"{_dtype(f.example.dtype)}.", "",
                      f"Convention: {f.convention or '(none known)'}.", "",
                      f"Errors (budget): {errs or '-'}. {f.detail}", "",
                      "```python", f.snippet.rstrip(), "```"]
        return "\n".join(lines) + "\n"

    def to_json(self) -> str:
        def run(r: KernelRun) -> dict:
            fs = [{"status": f.status, "spec": repr(f.example.spec), "trial": f.example.trial,
                   "seed": f.example.seed, "dtype": _dtype(f.example.dtype),
                   "options": dict(f.example.options),
                   "errors": {k: _num(v) for k, v in f.errors.items()},
                   "limits": {k: _num(v) for k, v in f.limits.items()},
                   "detail": f.detail, "convention": f.convention,
                   "property": f.property_name, "snippet": f.snippet} for f in r.failures]
            return {"kernel": r.kernel, "examples": r.examples, "unsupported": r.unsupported,
                    "seconds": r.seconds, "missing": r.missing, "repeats": r.repeats,
                    "drawn_within": r.accepts,
                    "failure": fs[0] if fs else None, "failures": fs}
        return json.dumps({"target": self.target, "device": self.device, "dtypes": self.dtypes,
                           "seed": self.seed, "database": self.database, "passed": self.passed,
                           "environment": self.environment,
                           "kernels": [run(r) for r in self.runs]}, indent=1) + "\n"


def _num(v: float) -> float | str:
    return v if math.isfinite(v) else str(v)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def snippet(example: Example, device: torch.device | str, target: str | None = None,
            prop: str = "") -> str:
    """Python source that rebuilds ``example``'s inputs from its seed and spec, calls the
    kernel and judges it (``prop``: checks that property instead of the budgets); ``target``
    (a spec ``mla conform --target`` takes) loads the kernel, else the source reads it from
    the name ``KERNEL``."""
    module, _, build = example.trial.partition(":")
    spec_cls = type(example.spec).__name__
    opts = "".join(f", {k}={v!r}" for k, v in example.options)
    load = (f"kernel = kernels_of(load_target({target!r}, [{example.kernel!r}])[1])"
            f"[{example.kernel!r}]" if target else
            f"kernel = KERNEL  # the {example.kernel} under test (set KERNEL first)")
    lines = [f"# {example.kernel}: a failing input found by mla.conformance.fuzz",
             "import torch", "",
             f"from {module} import {build}",
             f"from {module} import *  # noqa: F403 ({spec_cls} and what its repr names)",
             "from mla.conformance.catalogue import Setting",
             "from mla.conformance.fuzz import judge",
             "from mla.conformance.runner import kernels_of",
             "from mla.conformance.targets import load_target", "",
             "inf, nan = float('inf'), float('nan')",
             f"spec = {example.spec!r}",
             f"setting = Setting(torch.device({str(torch.device(device))!r}), "
             f"torch.{_dtype(example.dtype)}, seed={example.seed}, small=True)",
             f"trial = {build}(setting, spec, 0{opts})  # the inputs and the float64 reference",
             load,
             "outputs = trial.invoke(kernel)  # the kernel on those inputs"]
    if prop:
        lines[4:4] = ["from mla.conformance.properties import check"]
        lines += [f"result = check({prop!r}, {example.kernel!r}, kernel, trial, spec, "
                  f"{example.seed})  # the property, bit for bit",
                  "print(result)",
                  "assert result.passed, (result.convention, result.where)", ""]
    else:
        lines += [f"row = judge({example.kernel!r}, kernel, trial, setting)  # held to the "
                  "budgets",
                  "print(row.status, row.errors, row.convention or row.detail)",
                  "assert row.status == 'pass', (row.convention, row.detail)", ""]
    return "\n".join(lines)


def _database_path(database: str | os.PathLike | None) -> str:
    return str(database if database is not None
               else os.environ.get(DATABASE_ENV, DEFAULT_DATABASE))


def fuzz(target: object, kernel: str | Sequence[str] | None = None, *,
         examples: int | None = None, seconds: float | None = None, seed: int = 0,
         device: str | torch.device | None = None,
         dtype: torch.dtype | Sequence[torch.dtype] | None = None,
         database: str | os.PathLike | None = None, name: str | None = None,
         small: bool | None = None,
         progress: Callable[[KernelRun], None] | None = None,
         properties: str | Sequence[str] | None = None, budgets: bool = True,
         keep_going: bool = False,
         accepts: Mapping[str, Accepts | None] | None = None) -> FuzzReport:
    """Search ``kernel``'s inputs (one name, several, or ``None``: every fuzzed kernel the
    target has) on ``target`` (a mapping or module, as ``run`` takes, or a target spec
    ``mla conform --target`` takes) for a failure, and shrink it.

    ``examples`` bounds the examples judged per kernel, ``seconds`` the wall time of the whole
    search (split evenly among the kernels; a failure found is still shrunk); neither given:
    100 examples. ``dtype`` (one or several to draw from) defaults to bfloat16 on CUDA and
    float32 on the CPU; ``small`` (default: on the CPU) keeps shapes small enough for
    Triton's interpreter. ``seed`` seeds the search; the same seed and database give the same
    run. ``properties`` (``"all"`` or names of ``mla.conformance.properties.PROPERTIES``;
    default none) are checked beside the budgets on the kernels that have them
    (``PROPERTY_KERNELS``: the decodes); ``budgets=False`` checks the properties alone.
    ``keep_going``: after a failure is shrunk, go on searching the rest of the budget for
    failures of other modes (``failure_mode``: another convention, property or output), each
    shrunk in turn; examples failing again in a mode already found are counted
    (``KernelRun.repeats``), not reported. Default: stop at a kernel's first failure.
    ``accepts`` (kernel -> ``Accepts``): draw each kernel's inputs within what it takes;
    default (``None``): what its named target's adapter states and its signature takes
    (``fuzz_strategies.accepts_for``: FlashMLA's pages of 64, DeepGEMM's heads, no sinks for a
    kernel without ``attn_sink``, ...), nothing for a kernel that takes anything; ``{}``:
    the whole space for every kernel (what an adapter refuses is skipped).
    """
    label = name
    if isinstance(target, str):
        from mla.conformance.targets import load_target
        label, target = load_target(target, [kernel] if isinstance(kernel, str) else
                                    list(kernel) if kernel else None)
        target_spec: str | None = label
    else:
        target_spec = None
    label = label or getattr(target, "__name__", None) or type(target).__name__
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        dtypes: tuple[torch.dtype, ...] = (torch.bfloat16 if dev.type == "cuda"
                                           else torch.float32,)
    elif isinstance(dtype, torch.dtype):
        dtypes = (dtype,)
    else:
        dtypes = tuple(dtype)
    if not dtypes or not all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes):
        raise TypeError(f"dtype must be a floating torch.dtype or several, got {dtype!r}")
    fns = kernels_of(target)
    if kernel is None:
        names = [k for k in FUZZED if k in fns]
    else:
        names = [kernel] if isinstance(kernel, str) else list(kernel)
    unknown = [k for k in names if k not in FUZZED]
    if unknown:
        raise ValueError(f"no fuzz strategy for {unknown}; fuzzed kernels: {list(FUZZED)}")
    if examples is None and seconds is None:
        examples = 100
    props = properties_of(properties)
    if not budgets and not props:
        raise ValueError("budgets=False checks the properties alone: name some")
    if examples is not None and examples < 1:
        raise ValueError(f"examples must be positive, got {examples}")
    if accepts is not None:
        if not isinstance(accepts, Mapping):
            raise TypeError(f"accepts must be a mapping of kernel names to Accepts, got "
                            f"{type(accepts).__name__}")
        bad = sorted(k for k in accepts if k not in FUZZED)
        if bad:
            raise ValueError(f"accepts names kernels without a fuzz strategy: {bad}; fuzzed "
                             f"kernels: {list(FUZZED)}")
        wrong = {k: type(v).__name__ for k, v in accepts.items()
                 if v is not None and not isinstance(v, Accepts)}
        if wrong:
            raise TypeError(f"accepts must map kernels to Accepts or None, got {wrong}")
    small = dev.type == "cpu" if small is None else small
    db_path = _database_path(database)
    db = DirectoryBasedExampleDatabase(db_path)
    runs = []
    share = None if seconds is None else seconds / max(len(names), 1)
    for k in names:
        if k not in fns:
            runs.append(KernelRun(k, missing=True))
            continue
        mine = props if k in PROPERTY_KERNELS else ()
        if not budgets and not mine:
            continue
        within = (accepts_for(k, fns[k], str(label), dev) if accepts is None
                  else accepts.get(k))
        run = _search(k, fns[k], examples_of(k, dtypes, small, within), dev, examples, share,
                      seed, db,
                      f"{label}/{k}" + "".join(f"+{p}" for p in mine) + ("" if budgets else
                                                                         "-budgets")
                      + (f"@{within.describe()}" if within else ""),
                      target_spec, mine, budgets, keep_going)
        run.accepts = within.describe() if within else ""
        runs.append(run)
        if progress:
            progress(run)
    return FuzzReport(str(label), str(dev), [_dtype(d) for d in dtypes], seed, db_path, runs,
                      environment(dev))


class _Invalid(Exception):  # noqa: N818
    """A drawn spec its trial refuses to build (a bug of a strategy, not of the kernel)."""


def _verdict(kernel: str, fn: Callable, example: Example, trial: Trial,
             device: torch.device, props: tuple[str, ...], budgets: bool
             ) -> tuple[str, dict | None]:
    """``("pass" | "unsupported" | "fail" | "error", what a Failure holds)``: the budgets
    (``judge``), then each property."""
    if budgets:
        row = judge(kernel, fn, trial, example.setting(device))
        if row.status == "unsupported":
            return "unsupported", None
        if row.status in ("fail", "error"):
            return row.status, {"errors": dict(row.errors), "limits": dict(row.limits),
                                "detail": row.detail, "convention": row.convention}
    for prop in props:
        try:
            result = check(prop, kernel, fn, trial, example.spec, example.seed)
        except Unsupported:
            return "unsupported", None
        if not result.passed:
            return "fail", {"errors": {prop: result.ulps}, "limits": {prop: 0.0},
                            "detail": f"the worst difference: {result.ulps:g} ulps, at "
                                      f"{result.where}", "convention": result.convention,
                            "property": prop}
    return "pass", None


class _Found(Exception):  # noqa: N818
    """Raised by ``_find``'s test on the first example that meets the condition."""


def _find(strategy: object, condition: Callable[[Example], bool], config: settings,
          seed: int, key: bytes) -> Example:
    """``hypothesis.find`` with a seed that keeps the example database: the smallest example
    of ``strategy`` meeting ``condition`` (``NoSuchExample`` if none within ``config``).

    ``find(..., random=...)`` seeds the search with ``@seed``, and a seeded test neither
    reads nor writes the database: its failures would not be kept. Here the random seed is applied
    first and ``config`` (with the database) over it, under ``key`` as ``find`` sets it."""
    last: list[Example] = []

    @given(strategy)  # type: ignore[arg-type]
    def test(example: Example) -> None:
        if condition(example):
            last[:] = [example]
            raise _Found

    wrapped = settings(config, report_multiple_bugs=False)(hypothesis_seed(seed)(test))
    wrapped._hypothesis_internal_database_key = key  # type: ignore[attr-defined]
    try:
        wrapped()
    except _Found:
        return last[0]
    raise NoSuchExample(key.decode(errors="replace"))


def _search(kernel: str, fn: Callable, strategy: object, device: torch.device,
            examples: int | None, seconds: float | None, seed: int,
            db: DirectoryBasedExampleDatabase, key: str, target_spec: str | None,
            props: tuple[str, ...] = (), budgets: bool = True,
            keep_going: bool = False) -> KernelRun:
    run = KernelRun(kernel)
    t0 = time.perf_counter()
    deadline = math.inf if seconds is None else t0 + seconds
    found: list[tuple[str, dict]] = []
    known: set[tuple[str, ...]] = set()  # the failure modes already reported

    def fails(example: Example) -> bool:
        if found == [] and time.perf_counter() > deadline:
            return False  # out of time: the rest of the round is not run
        try:
            trial = trial_of(example, device)
        except Exception as e:
            raise _Invalid(f"{example!r}: {type(e).__name__}: {e}") from e
        status, what = _verdict(kernel, fn, example, trial, device, props, budgets)
        run.examples += 1
        run.unsupported += status == "unsupported"
        if status in ("fail", "error"):
            assert what is not None
            if failure_mode(status, what) in known:
                if not found:
                    run.repeats += 1
                return False
            found[:] = [(status, what)]
            return True
        return False

    rng = random.Random(seed)
    rounds = 0
    left = examples if examples is not None else math.inf
    while left > 0 and time.perf_counter() < deadline:
        n = int(min(left, CHUNK if seconds is not None else left))
        # after a failure the database holds it: replayed now it would pass (its mode known)
        # and be dropped, so later rounds only generate
        reuse = (Phase.reuse,) if not known else ()
        config = settings(max_examples=n, database=db, deadline=None,
                          verbosity=Verbosity.quiet,
                          phases=(Phase.explicit, *reuse, Phase.generate, Phase.shrink),
                          suppress_health_check=list(HealthCheck))
        before = run.examples
        found.clear()
        try:
            # the random seed hypothesis.find(random=Random(x)) would draw
            example = _find(strategy, fails, config,
                            random.Random(rng.getrandbits(64)).getrandbits(64),
                            f"mla-fuzz:{key}".encode())
        except NoSuchExample:
            left -= max(run.examples - before, 1)
            rounds += 1
            continue
        status, what = _verdict(kernel, fn, example, trial_of(example, device), device, props,
                                budgets)
        if status not in ("fail", "error"):  # flaky: keep the last failing verdict
            status, what = found[0]
        assert what is not None
        prop = what.get("property", "")
        run.failures.append(Failure(kernel, example, status, what["errors"], what["limits"],
                                    what["detail"], what["convention"],
                                    snippet(example, device, target_spec, prop), prop))
        if not keep_going:
            break
        known.add(failure_mode(status, what))
        left -= max(run.examples - before, 1)
    run.seconds = time.perf_counter() - t0
    return run


def database_path(database: str | os.PathLike | None = None) -> Path:
    """Where the example database is: ``database``, else ``$MLA_FUZZ_DB``, else
    ``.hypothesis/mla-fuzz``."""
    return Path(_database_path(database))
