"""The conformance catalogue: named cases, each pinning one convention or edge of one kernel.

A case is a function ``(Setting) -> Trial`` registered with ``@case(kernel, topic)``; its
docstring's first sentence says what it pins. A ``Trial`` holds the inputs in the setting's
device and dtype (built on the CPU from a random seed, so every target sees the same numbers), a
way to call a kernel on them, the float64 reference's outputs and the error quantity each
output is held to. ``alternatives`` are the outputs a kernel would give under a known
different convention (a ``1/sqrt(576)`` scale, the causal mask off by one, ...): when a
failing kernel matches one, the report names it.

Kernel names are ``mla.reference``'s (``KERNELS``); a target supplies callables under those
names with the reference's signature and conventions (docs/conventions.md §12).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["KERNELS", "Setting", "Trial", "Case", "CATALOGUE", "case", "cases_of",
           "spec_cases", "Unsupported", "generator"]

# the kernels a target can supply, by mla.reference's names (cp_lse_ag_out_rs: the DCP
# correction, run once per rank over a simulated communicator; the last four: the lightning
# indexer's fp8 key cache, logits and top-k, named after vLLM's and DeepGEMM's; then
# DeepSeek-V4.1's 528- and 288-byte cache codecs; then DeepSeek-V4's layer kernels: the
# compressor's cache records, the indexer's q, the scopes' indices, the indexer's top-k over
# the compressed entries and the output stage)
KERNELS = ("mla_decode_paged", "sparse_mla_decode", "sparse_mla_prefill", "merge_attn_states",
           "concat_and_cache_mla", "gather_cache", "convert_req_index_to_global_index",
           "concat_and_cache_fp8_ds_mla", "attention_with_lse", "cp_lse_ag_out_rs",
           "indexer_k_quant_and_cache", "fp8_paged_mqa_logits", "fp8_mqa_logits",
           "top_k_per_row", "quantize_fp8_v41", "dequantize_fp8_v41", "quantize_nvfp4_v41",
           "dequantize_nvfp4_v41", "v4_compress", "v4_indexer_q", "v4_scope_indices",
           "v4_indexer_topk", "v4_output")


class Unsupported(Exception):  # noqa: N818 (a status, not an error)
    """Raised by an adapter for inputs its kernel does not take (a page size, ``s_q > 1``,
    a dtype): the case is reported "unsupported", never "fail"."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """Where and in what dtype a case runs; ``seed`` makes its inputs."""
    device: torch.device
    dtype: torch.dtype
    seed: int = 0
    small: bool = False  # "long" lengths shrink (the interpreter, compute-sanitizer)


Outputs = dict[str, torch.Tensor]


@dataclasses.dataclass
class Trial:
    """One case's inputs, made for one setting.

    ``invoke(kernel)`` calls the kernel on the inputs and returns its outputs by name (for an
    in-place kernel, the buffers it wrote). ``expected`` holds the float64 reference's outputs
    under the same names and ``quantities`` the error each is held to: ``<name> -> out_rel``
    (relative Frobenius), ``lse_abs`` / ``max_abs`` (max absolute) or ``mismatches`` (exact).
    ``budget_kernel`` names the kernel whose budgets apply (default: the case's kernel);
    ``limits`` sets an output's limit from the trial itself where no table applies (the fp8
    dequantization error, held to the reference's own on the same inputs). ``refuses``: the
    inputs are invalid, and the case passes when the kernel raises one of these.
    """
    invoke: Callable[[Callable], Outputs]
    expected: Outputs
    quantities: dict[str, str]
    alternatives: Mapping[str, Callable[[], Outputs]] = dataclasses.field(default_factory=dict)
    budget_kernel: str | None = None
    limits: dict[str, float] = dataclasses.field(default_factory=dict)
    # inputs the reference refuses (a ValueError naming them): the kernel must raise one of
    # these rather than return, so that it never reads past what it was given
    refuses: tuple[type[Exception], ...] = ()
    # the spec a family built the inputs from, where it builds from specs (the decodes): what
    # ``mla.conformance.properties.check`` reads (a MODEL1 cache)
    spec: Any = None


@dataclasses.dataclass(frozen=True)
class Case:
    """``kernel/name``; ``topic`` groups the cases of a kernel that pin one convention
    (``causal``, ``empty``, ``scale``, ...); the cases of one kernel are its family."""
    kernel: str
    name: str
    topic: str
    doc: str
    build: Callable[[Setting], Trial]


CATALOGUE: dict[str, Case] = {}  # by "kernel/name"


def case(kernel: str, topic: str, name: str | None = None,
         doc: str | None = None) -> Callable[[Callable[[Setting], Trial]],
                                             Callable[[Setting], Trial]]:
    """Register ``fn`` as the case ``kernel/name`` (default name: the function's) on ``topic``.

    ``doc`` (default: the docstring's first sentence) says what the case pins; a case without
    one is refused, and so is a repeated name."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")

    def deco(fn: Callable[[Setting], Trial]) -> Callable[[Setting], Trial]:
        key = f"{kernel}/{name or fn.__name__}"
        text = (doc or (fn.__doc__ or "")).strip().split("\n\n")[0]
        text = " ".join(text.split())
        if not text:
            raise ValueError(f"case {key} has no docstring saying what it pins")
        if key in CATALOGUE:
            raise ValueError(f"case {key} is registered twice")
        CATALOGUE[key] = Case(kernel, name or fn.__name__, topic, text, fn)
        return fn
    return deco


def spec_cases(kernel: str, trial: Callable[[Setting, Any, int], Trial]
               ) -> Callable[[str, str, str, Any, int], None]:
    """How a family registers cases built from specs: ``register(name, topic, doc, spec,
    salt)`` adds ``kernel/name`` whose trial is ``trial(setting, spec, salt)``; ``spec`` is a
    spec, or a function of the setting giving one (lengths that shrink under the
    interpreter)."""
    def register(name: str, topic: str, doc: str, spec: Any, salt: int) -> None:
        case(kernel, topic, name=name, doc=doc)(
            lambda s: trial(s, spec(s) if callable(spec) else spec, salt))
    return register


def cases_of(kernels: list[str] | None = None, names: list[str] | None = None) -> Iterator[Case]:
    """The catalogue's cases, of ``kernels`` and with ``names`` (``kernel/name``, ``name``
    or a topic) when given; an unknown name is a ``ValueError``."""
    if kernels:
        unknown = sorted(set(kernels) - set(KERNELS))
        if unknown:
            raise ValueError(f"unknown kernels {unknown}; known: {list(KERNELS)}")
    wanted = set(names or ())
    if wanted:
        known = ({k for k in CATALOGUE} | {c.name for c in CATALOGUE.values()}
                 | {c.topic for c in CATALOGUE.values()})
        unknown = sorted(wanted - known)
        if unknown:
            raise ValueError(_unknown_cases(unknown, kernels))
    for key, c in CATALOGUE.items():
        if kernels and c.kernel not in kernels:
            continue
        if wanted and not wanted & {key, c.name, c.topic}:
            continue
        yield c


def _unknown_cases(unknown: list[str], kernels: list[str] | None) -> str:
    """The error for ``unknown`` case names: the values given, what is expected (the topics,
    of ``kernels`` when given, and the names close to each unknown one)."""
    of = [c for c in CATALOGUE.values() if not kernels or c.kernel in kernels]
    topics = sorted({c.topic for c in of})
    keys = [f"{c.kernel}/{c.name}" for c in of]
    names = sorted({c.name for c in of})
    close = sorted({m for u in unknown
                    for m in difflib.get_close_matches(u, [*topics, *names, *keys], n=3)})
    scope = f" of {', '.join(kernels)}" if kernels else ""
    return (f"unknown cases {unknown}: expected kernel/name, a case name or a topic; "
            + (f"did you mean {', '.join(close)}? " if close else "")
            + f"the topics{scope}: {', '.join(topics)} "
            f"({len(of)} cases: mla.conformance.CATALOGUE lists them by kernel/name)")


def generator(setting: Setting, salt: int) -> torch.Generator:
    """The CPU generator of one case: its inputs depend on the random seed and the salt only."""
    return torch.Generator().manual_seed(setting.seed * 1000003 + salt)
