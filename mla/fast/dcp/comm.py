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

from mla.reference.dcp.comm import ProcessGroupCommunicator, check_divisible, normalize_dim

__all__ = ["CapturableCommunicator"]


class CapturableCommunicator(ProcessGroupCommunicator):
    """A ``Communicator`` over a ``torch.distributed`` group (default: the world) for the hot
    path: the caller guarantees that every rank passes the same shape and dtype. The set-up
    (group, rank, world size, the collectives of this torch) is the reference's."""

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        dim = normalize_dim("all_gather", x, dim)
        W = self.world_size
        xm = x.movedim(dim, 0).contiguous()  # the collective concatenates along dim 0
        out = xm.new_empty((W * xm.shape[0], *xm.shape[1:]))
        self._all_gather_single(out, xm, group=self.group)
        if dim == 0:
            return out
        # [W·n, ...] -> [..., W·n at dim, ...]: rank-major along dim, as the reference
        return out.movedim(0, dim).contiguous()

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        dim = normalize_dim("reduce_scatter", x, dim)
        W = self.world_size
        check_divisible("reduce_scatter", x, dim, W)
        xm = x.movedim(dim, 0).contiguous()  # free when x is laid out with dim leading
        out = xm.new_empty((xm.shape[0] // W, *xm.shape[1:]))
        self._reduce_scatter_single(out, xm, group=self.group)
        return out.movedim(0, dim)
