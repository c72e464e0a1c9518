"""A process-group communicator whose collectives read nothing on the host.

``mla.reference.dcp.ProcessGroupCommunicator`` exchanges every tensor's shape and dtype before
each collective (so a mismatch raises on every rank instead of hanging); that exchange reads a
device tensor on the host, which a CUDA graph capture forbids. ``CapturableCommunicator`` trusts
the shapes (the DCP programs derive them from host-known sizes, the same on every rank) and
issues the bare NCCL collectives, which a graph captures. Its reduce-scatter also returns the
result as a view (no ``contiguous()`` copy): the fast DCP path writes head-major buffers, and
the one cast that follows lays the result out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["CapturableCommunicator"]


class CapturableCommunicator:
    """A ``Communicator`` over a ``torch.distributed`` group (default: the world) for the hot
    path: the caller guarantees that every rank passes the same shape and dtype."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("CapturableCommunicator needs an initialized process group "
                               "(torch.distributed.init_process_group)")
        self.group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)
        # torch >= 2.12 renames the two single-tensor collectives; 2.11 has the old names
        self._all_gather_single = (getattr(dist, "all_gather_single", None)
                                   or dist.all_gather_into_tensor)
        self._reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                                       or dist.reduce_scatter_tensor)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def _dim(self, op: str, x: torch.Tensor, dim: int) -> int:
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"{op}: dim must lie in [-{x.dim()}, {x.dim()}) for a tensor of "
                             f"shape {list(x.shape)}, got {dim}")
        return dim % x.dim()

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        dim = self._dim("all_gather", x, dim)
        W = self._world_size
        xm = x.movedim(dim, 0).contiguous()  # the collective concatenates along dim 0
        out = xm.new_empty((W * xm.shape[0], *xm.shape[1:]))
        self._all_gather_single(out, xm, group=self.group)
        if dim == 0:
            return out
        # [W·n, ...] -> [..., W·n at dim, ...]: rank-major along dim, as the reference
        return out.movedim(0, dim).contiguous()

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        dim = self._dim("reduce_scatter", x, dim)
        W = self._world_size
        if x.shape[dim] % W:
            raise ValueError(f"reduce_scatter: dim {dim} of shape {list(x.shape)} must be "
                             f"divisible by world_size={W}")
        xm = x.movedim(dim, 0).contiguous()  # free when x is laid out with dim leading
        out = xm.new_empty((xm.shape[0] // W, *xm.shape[1:]))
        self._reduce_scatter_single(out, xm, group=self.group)
        return out.movedim(0, dim)

    def __repr__(self) -> str:
        return f"CapturableCommunicator(rank={self._rank}, world_size={self._world_size})"
