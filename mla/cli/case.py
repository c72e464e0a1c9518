"""The walkthrough's embedded example and the types of its table.

One example (``Case``): random weights of a preset, and a batch of requests of
``context_lens[i] + new_tokens`` random hidden states each, at positions ``0 .. L_i - 1``.
A row of the table is a function registered with ``register_row``: it gets the ``Case`` and
returns a ``Measurement`` (the path's output, the float64 reference it must equal, the seconds
the path took, the dtype it ran in), or raises ``CannotRunError`` with the reason it cannot
run here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import NamedTuple, TypeVar

import torch

from mla.config import MLAConfig, get_config
from mla.reference import Front, make_block_table, mla_front, naive_forward
from mla.weights import MLAWeights

__all__ = ["Case", "DeviceUnavailableError", "DTYPES", "Measurement", "REFERENCE", "Row", "RowSpec",
           "CannotRunError", "UpProj", "check_device", "make_registrar", "timed"]

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
REFERENCE = torch.float64  # the definition always runs in float64 on the CPU


class CannotRunError(Exception):
    """Raised by a row that cannot run here; the message says why (printed in its place)."""


class DeviceUnavailableError(RuntimeError):
    """The requested device does not exist on this machine (the CLI exits with status 3)."""


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``; ``ValueError`` for a malformed name,
    ``DeviceUnavailableError`` for a device this machine or this torch build does not have."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device such as 'cpu', 'cuda' or 'cuda:1', "
                         f"got {device!r}") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            built = torch.version.cuda is not None or torch.version.hip is not None
            why = ("no CUDA device is visible" if built else
                   f"this torch ({torch.__version__}) is built without CUDA")
        elif dev.index is not None and dev.index >= torch.cuda.device_count():
            why = f"this machine has {torch.cuda.device_count()} CUDA device(s)"
        else:
            return dev
        raise DeviceUnavailableError(f"device {str(device)!r} is not available: {why}")
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DeviceUnavailableError(f"device {str(device)!r} is not available: {first}") from None
    return dev


class UpProj(NamedTuple):
    W_UK: torch.Tensor  # [Lkv, N, P]
    W_UV: torch.Tensor  # [Lkv, N, V]


@dataclass
class Case:
    """The embedded example every row runs on.

    ``weights``/``hidden`` are in the run's dtype and device; ``weights_ref``/``hidden_ref``
    are the same numbers upcast to float64 on the CPU, the inputs of the reference.
    """

    config: MLAConfig
    dtype: torch.dtype
    device: torch.device
    context_lens: tuple[int, ...]
    new_tokens: int
    block_size: int
    max_context_chunk: int
    weights: MLAWeights
    hidden: list[torch.Tensor]  # request i: [context_lens[i] + new_tokens, H]
    fast: bool = True  # run the mla.fast rows (where they can run)
    weights_ref: MLAWeights = field(init=False)
    hidden_ref: list[torch.Tensor] = field(init=False)
    memo: dict[object, object] = field(default_factory=dict, repr=False)  # what rows share

    def __post_init__(self) -> None:
        self.weights_ref = self.weights.to(dtype=REFERENCE, device="cpu")
        self.hidden_ref = [h.to(dtype=REFERENCE, device="cpu") for h in self.hidden]

    @classmethod
    def build(cls, preset: str, dtype: torch.dtype, device: str | torch.device,
              context_lens: Sequence[int], new_tokens: int, block_size: int,
              max_context_chunk: int, seed: int, fast: bool = True) -> Case:
        config = get_config(preset)
        device = torch.device(device)
        weights = MLAWeights.random(config, seed=seed, dtype=dtype, device=device)
        gen = torch.Generator().manual_seed(seed + 1)
        hidden = [torch.randn(n + new_tokens, config.hidden_size, generator=gen,
                              dtype=REFERENCE).to(dtype=dtype, device=device)
                  for n in context_lens]
        return cls(config, dtype, device, tuple(context_lens), new_tokens, block_size,
                   max_context_chunk, weights, hidden, fast)

    def subset(self, requests: Sequence[int]) -> Case:
        """The same example restricted to some requests (weights shared)."""
        return Case(self.config, self.dtype, self.device,
                    tuple(self.context_lens[i] for i in requests), self.new_tokens,
                    self.block_size, self.max_context_chunk, self.weights,
                    [self.hidden[i] for i in requests], self.fast)

    @property
    def seq_lens(self) -> list[int]:
        return [n + self.new_tokens for n in self.context_lens]

    @cached_property
    def reference(self) -> list[torch.Tensor]:
        """The definition's output ``[L_i, H]`` for every request (float64, CPU)."""
        return [naive_forward(self.weights_ref, h) for h in self.hidden_ref]

    def last_rows(self, n: int) -> torch.Tensor:
        """The reference's last ``n`` rows of every request: ``[B, n, H]``."""
        return torch.stack([ref[-n:] for ref in self.reference])

    @cached_property
    def fronts_ref(self) -> list[Front]:
        """Every request's latents from the float64 front (CPU): the kernel-level inputs."""
        return [mla_front(self.weights_ref, h, torch.arange(h.shape[0]))
                for h in self.hidden_ref]

    def fronts(self, dtype: torch.dtype, device: torch.device) -> list[Front]:
        """``fronts_ref`` rounded to ``dtype`` on ``device``: what a kernel-level row feeds its
        kernel; its reference sees the same numbers upcast."""
        key = ("fronts", dtype, device)
        if key not in self.memo:
            self.memo[key] = [Front(*(t.to(dtype=dtype, device=device) for t in f))
                              for f in self.fronts_ref]
        return self.memo[key]  # type: ignore[return-value]

    def up_proj(self, dtype: torch.dtype, device: torch.device) -> UpProj:
        """The up-projections of ``weights_ref`` rounded to ``dtype`` on ``device`` (the run's
        own for its dtype): the weights the kernel-level rows use."""
        key = ("up_proj", dtype, device)
        if key not in self.memo:
            w = self.weights_ref
            self.memo[key] = UpProj(w.W_UK.to(dtype=dtype, device=device),
                                    w.W_UV.to(dtype=dtype, device=device))
        return self.memo[key]  # type: ignore[return-value]

    def up_proj_ref(self, dtype: torch.dtype) -> UpProj:
        """``up_proj(dtype)`` upcast back to float64 on the CPU: the reference's weights for a
        kernel run in ``dtype``."""
        w = self.up_proj(dtype, torch.device("cpu"))
        return UpProj(w.W_UK.to(REFERENCE), w.W_UV.to(REFERENCE))

    def empty_cache(self, capacities: Sequence[int], dtype: torch.dtype | None = None,
                    device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A NaN-filled paged cache and a scattered block table for ``capacities`` (default
        dtype and device: the run's).

        NaN, so that a path reading a slot nobody wrote cannot pass.
        """
        dtype = self.dtype if dtype is None else dtype
        device = self.device if device is None else device
        block_table, num_blocks = make_block_table(list(capacities), self.block_size,
                                                   spare_blocks=1, device=device)
        kv_cache = torch.full((num_blocks, self.block_size, self.config.latent_dim),
                              float("nan"), dtype=dtype, device=device)
        return kv_cache, block_table


@dataclass
class Measurement:
    """What a row function returns: the path's output and the reference it must equal.

    ``dtype``: what the path ran in (default: the run's); ``metric``: ``"rel"`` (relative
    Frobenius error) or ``"abs"`` (max absolute error) is held to ``tolerance`` (default: the
    relative tolerance of ``dtype``, ``mla.compare.tolerance``).
    """

    out: torch.Tensor
    ref: torch.Tensor
    seconds: float
    dtype: torch.dtype | None = None
    tolerance: float | None = None
    metric: str = "rel"


@dataclass
class Row:
    """One line of the walkthrough table: ``rel_err`` (``metric="rel"``) or ``max_abs_err``
    (``"abs"``) is held to ``tolerance``. ``skipped``: why the row did not run (None: it ran)."""

    path: str
    reference: str
    dtype: str
    rel_err: float
    max_abs_err: float
    seconds: float
    tolerance: float
    metric: str = "rel"
    skipped: str | None = None

    @property
    def error(self) -> float:
        return self.rel_err if self.metric == "rel" else self.max_abs_err

    @property
    def passed(self) -> bool:
        """Ran and is within its tolerance (False for NaN, and for a skipped row)."""
        return self.skipped is None and self.error <= self.tolerance

    @property
    def failed(self) -> bool:
        """Ran and is over its tolerance (a skipped row has not failed)."""
        return self.skipped is None and not self.error <= self.tolerance

    def to_dict(self) -> dict[str, object]:
        """The fields and ``passed``; a skipped row has no dtype and no numbers (None)."""
        d: dict[str, object] = {**asdict(self), "passed": self.passed}
        if self.skipped is not None:
            d.update(dtype=None, rel_err=None, max_abs_err=None, seconds=None, tolerance=None,
                     metric=None)
        return d


@dataclass(frozen=True)
class RowSpec:
    path: str
    reference: str
    fn: Callable[[Case], Measurement]


RowFn = Callable[[Case], Measurement]
T = TypeVar("T")


def make_registrar(rows: list[RowSpec]) -> Callable[..., Callable[[RowFn], RowFn]]:
    """A ``register_row(path, reference=...)`` decorator that appends to ``rows``."""
    def register_row(path: str, reference: str = "naive_forward") -> Callable[[RowFn], RowFn]:
        """Add a row to the walkthrough (rows run in registration order)."""
        def wrap(fn: RowFn) -> RowFn:
            if any(spec.path == path for spec in rows):
                raise ValueError(f"a walkthrough row named {path!r} is already registered")
            rows.append(RowSpec(path, reference, fn))
            return fn
        return wrap
    return register_row


def timed(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """``fn()`` and the seconds it took (the device synchronized before and after)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0
