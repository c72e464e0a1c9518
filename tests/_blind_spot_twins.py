"""Broken twins of the reference for the judge's former blind spots, shared by
``test_conformance_blind_spots.py`` (the catalogue catches them) and ``test_fuzz.py`` (the
fuzzer finds and shrinks them)."""

from __future__ import annotations

import torch

import mla.reference as ref

INF = float("inf")


def merge_times_zero(o_p, lse_p, o_s, lse_s):
    """Present sides weighed ``w · o`` even where ``w`` underflowed to 0 (0 · inf = NaN)."""
    out, lse = ref.merge_attn_states(o_p, lse_p, o_s, lse_s)
    m = torch.maximum(lse_p, lse_s).double()
    for o, side in ((o_p, lse_p), (o_s, lse_s)):
        zero = torch.isfinite(side) & (torch.exp(side.double() - m) == 0)
        out = out + 0 * torch.where(zero.transpose(0, 1)[..., None], o, 0.0)
    return out, lse


def dcp_nan_lost_beside_empty(out, lse, comm, return_lse=False):
    """A NaN lse taken as "no keys" where every other rank is empty (a NaN-ignoring max)."""
    lses = comm.all_gather(lse[None].double(), dim=0)
    alone = torch.isnan(lses).any(0) & (torch.isinf(lses) | torch.isnan(lses)).all(0)
    mine = torch.where(alone, -INF, lse.double()).to(lse.dtype)
    return ref.cp_lse_ag_out_rs(out, mine, comm, return_lse=return_lse)
