"""Communicators: the four collectives the DCP math needs, simulated or on a process group.

conventions §9; papers/derivation.md (22) and (23) are written with exactly these collectives.
A group of ``W`` ranks offers

    all_gather(x_r, dim)        every rank gets  cat(x_0, ..., x_{W-1}, dim)       (rank order)
    reduce_scatter(x_r, dim)    rank r gets      slice r of  sum_s x_s  along dim  (W slices)

vLLM 0.11 issues them on its DCP group (``distributed/parallel_state.py``, the
``GroupCoordinator`` collectives). Here the math is written once against ``Communicator``, and
a rank program ``fn(comm, ...)`` runs unchanged on

- ``run_simulated(W, fn)``: ``W`` threads of one process meeting at a barrier, no library;
- ``ProcessGroupCommunicator``: a ``torch.distributed`` process group (gloo on CPU, NCCL on
  GPUs). Starting the processes is the job of ``mla.check.dcp`` (``run_process_group``, or
  ``torchrun``).

Both raise the same error on every rank when the ranks pass tensors of different shapes or
dtypes, instead of hanging or returning garbage.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar, runtime_checkable

import torch
import torch.distributed as dist

from mla.validation import check_positive_int

__all__ = ["Communicator", "SimulatedCommunicator", "ProcessGroupCommunicator", "run_simulated",
           "same_on_all_ranks", "GroupMember", "check_rank", "check_same_shapes", "normalize_dim",
           "check_divisible"]

Result = TypeVar("Result")


@runtime_checkable
class Communicator(Protocol):
    """The four things the DCP math needs from a group of ranks.

    ``all_gather(x, dim)``: every rank passes a tensor of one shape; every rank gets them
    concatenated along ``dim`` in rank order. ``reduce_scatter(x, dim)``: every rank passes a
    tensor of one shape whose ``dim`` is divisible by ``world_size``; rank ``r`` gets the
    ``r``-th slice along ``dim`` of their sum.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor: ...

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor: ...


class GroupMember:
    """A rank's place in its group, ``Communicator``'s ``rank`` and ``world_size``: what every
    communicator here shares, whatever carries its collectives."""

    _rank: int
    _world_size: int

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self._rank}, world_size={self._world_size})"


def check_rank(rank: object, world_size: object) -> tuple[int, int]:
    """``world_size`` a positive int and ``0 <= rank < world_size``."""
    check_positive_int("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int, got {type(rank).__name__}")
    if not 0 <= rank < world_size:  # type: ignore[operator]
        raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
    return rank, world_size  # type: ignore[return-value]


def check_same_shapes(op: str, shapes: Sequence[tuple[int, ...]],
                      dtypes: Sequence[torch.dtype] = ()) -> None:
    """A collective needs one shape (and dtype) on every rank; name the first rank that differs."""
    for r, shape in enumerate(shapes):
        if tuple(shape) != tuple(shapes[0]):
            raise ValueError(f"{op}: rank {r} passed shape {list(shape)} but rank 0 passed "
                             f"{list(shapes[0])}; every rank must pass the same shape")
    for r, dt in enumerate(dtypes):
        if dt != dtypes[0]:
            raise TypeError(f"{op}: rank {r} passed dtype {dt} but rank 0 passed "
                            f"{dtypes[0]}; every rank must pass the same dtype")


def normalize_dim(op: str, x: torch.Tensor, dim: int) -> int:
    """``dim`` of ``x`` as a non-negative index, or a ``ValueError`` naming the collective."""
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{op}: dim must lie in [-{x.dim()}, {x.dim()}) for a tensor of shape "
                         f"{list(x.shape)}, got {dim}")
    return dim % x.dim()


def check_divisible(op: str, x: torch.Tensor, dim: int, world_size: int) -> None:
    """A reduce-scatter splits ``dim`` of ``x`` into ``world_size`` equal slices."""
    if x.shape[dim] % world_size:
        raise ValueError(f"{op}: dim {dim} of shape {list(x.shape)} must be divisible by "
                         f"world_size={world_size}")


# --- simulated ranks -----------------------------------------------------------------------

def all_gather_parts(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The all-gather of per-rank tensors: checked, then concatenated in rank order."""
    check_same_shapes("all_gather", [tuple(p.shape) for p in parts], [p.dtype for p in parts])
    return torch.cat(list(parts), dim=normalize_dim("all_gather", parts[0], dim))


def reduce_scatter_parts(parts: Sequence[torch.Tensor], dim: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s slice of the sum of per-rank tensors, summed in rank order."""
    check_same_shapes("reduce_scatter", [tuple(p.shape) for p in parts],
                      [p.dtype for p in parts])
    W = len(parts)
    dim = normalize_dim("reduce_scatter", parts[0], dim)
    check_divisible("reduce_scatter", parts[0], dim, W)
    size = parts[0].shape[dim]
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total.narrow(dim, rank * (size // W), size // W).contiguous()


class _Rendezvous:
    """Where the simulated ranks meet: each collective is one exchange of a tensor per rank.

    Two barriers per exchange: after the first every rank's tensor is posted; each rank then
    computes its own result from all of them; the second keeps a fast rank from posting its
    next tensor before the slow ones have read this one.
    """

    def __init__(self, world_size: int, timeout: float) -> None:
        self.barrier = threading.Barrier(world_size, timeout=timeout)
        self.slots: list[torch.Tensor | None] = [None] * world_size

    def exchange(self, rank: int, x: torch.Tensor,
                 combine: Callable[[list[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        self.slots[rank] = x
        self.barrier.wait()
        try:
            result = combine(list(self.slots))  # type: ignore[arg-type]
        except (ValueError, TypeError) as e:  # the same error on every rank: raise after
            result, error = None, e
        else:
            error = None
        self.barrier.wait()
        if error is not None:
            raise error
        return result  # type: ignore[return-value]


class SimulatedCommunicator(GroupMember):
    """Rank ``rank`` of a group simulated in one process (see ``run_simulated``)."""

    def __init__(self, rank: int, world_size: int, rendezvous: _Rendezvous | None = None
                 ) -> None:
        check_rank(rank, world_size)
        if rendezvous is None:
            if world_size != 1:
                raise ValueError(f"a SimulatedCommunicator of world_size={world_size} needs "
                                 "the group's rendezvous; build the group with run_simulated")
            rendezvous = _Rendezvous(1, timeout=1.0)
        self._rank, self._world_size, self._rv = rank, world_size, rendezvous

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._rv.exchange(self._rank, x, lambda parts: all_gather_parts(parts, dim))

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._rv.exchange(self._rank, x,
                                 lambda parts: reduce_scatter_parts(parts, dim, self._rank))



def run_simulated(world_size: int, fn: Callable[[Communicator], Result],
                  timeout: float = 120.0) -> list[Result]:
    """Run the rank program ``fn(comm)`` as every rank of a simulated group; return the
    results in rank order.

    One thread per rank, meeting at a barrier for each collective. An exception on any rank
    breaks the barrier for the others and is re-raised here; a rank that never arrives makes
    the others fail after ``timeout`` seconds instead of hanging.
    """
    check_positive_int("world_size", world_size)
    rv = _Rendezvous(world_size, timeout)
    comms = [SimulatedCommunicator(r, world_size, rv) for r in range(world_size)]
    if world_size == 1:
        return [fn(comms[0])]
    results: list[Result | None] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(r: int) -> None:
        try:
            results[r] = fn(comms[r])
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            errors[r] = e
            rv.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"dcp-rank-{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the first rank's own error, not the BrokenBarrierError it caused on the others
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        raise real[0]
    broken = [r for r, e in enumerate(errors) if e is not None]
    if broken:
        raise TimeoutError(f"simulated ranks {broken} waited more than {timeout} s at a "
                           "collective that not every rank reached") from errors[broken[0]]
    return results  # type: ignore[return-value]


def same_on_all_ranks(results: Sequence[torch.Tensor]) -> torch.Tensor:
    """The one answer of a rank program whose result every rank holds (it was all-gathered):
    ``results[0]``, after checking that every rank's tensor is bitwise the same."""
    if not results:
        raise ValueError("results must hold one tensor per rank, got none")
    for r, x in enumerate(results):
        if not torch.equal(x, results[0]):
            raise ValueError(f"rank {r}'s result differs from rank 0's: a rank program whose "
                             "result is all-gathered must return the same tensor on every rank")
    return results[0]


# --- a torch.distributed process group -----------------------------------------------------

_DTYPE_CODES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                torch.int32, torch.bool)
_MAX_DIMS = 8


class ProcessGroupCommunicator(GroupMember):
    """A ``Communicator`` over a ``torch.distributed`` process group (default: the world).

    Before each collective the ranks exchange their tensor's shape and dtype, so that a
    mismatch raises the same ``ValueError`` on every rank instead of a hang or garbage.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs an initialized process group "
                               "(torch.distributed.init_process_group)")
        self.group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)
        # torch >= 2.12 renames the two single-tensor collectives; 2.11 has the old names
        self._all_gather_single = (getattr(dist, "all_gather_single", None)
                                   or dist.all_gather_into_tensor)
        self._reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                                       or dist.reduce_scatter_tensor)

    def _check_shapes(self, op: str, x: torch.Tensor) -> None:
        if x.dim() > _MAX_DIMS or x.dtype not in _DTYPE_CODES:
            raise ValueError(f"{op}: tensors of at most {_MAX_DIMS} dims and dtype in "
                             f"{_DTYPE_CODES} only, got {x.dtype} of shape {list(x.shape)}")
        desc = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64, device=x.device)
        desc[0], desc[1] = x.dim(), _DTYPE_CODES.index(x.dtype)
        desc[2: 2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
        all_desc = torch.empty(self._world_size * desc.numel(), dtype=torch.int64,
                               device=x.device)
        self._all_gather_single(all_desc, desc, group=self.group)
        rows = all_desc.view(self._world_size, -1).tolist()
        check_same_shapes(op, [tuple(r[2: 2 + r[0]]) for r in rows],
                          [_DTYPE_CODES[r[1]] for r in rows])

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        self._check_shapes("all_gather", x)
        dim = normalize_dim("all_gather", x, dim)
        W = self._world_size
        out = x.new_empty((W * x.shape[0], *x.shape[1:]))
        self._all_gather_single(out, x.contiguous(), group=self.group)
        if dim == 0:
            return out
        return torch.cat(out.view(W, *x.shape).unbind(0), dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        self._check_shapes("reduce_scatter", x)
        dim = normalize_dim("reduce_scatter", x, dim)
        W = self._world_size
        check_divisible("reduce_scatter", x, dim, W)
        xm = x.movedim(dim, 0).contiguous()  # the collective splits dim 0
        out = xm.new_empty((xm.shape[0] // W, *xm.shape[1:]))
        self._reduce_scatter_single(out, xm, group=self.group)
        return out.movedim(0, dim).contiguous()

