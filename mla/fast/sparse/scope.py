"""How ``mla.fast.sparse``'s kernels read a KV scope: a cache and its index rows as the views
the kernels take (rows in q's dtype, ``fp8_ds_mla`` rows read in place even in FlashMLA's
block-padded form, MODEL1 pages), the integers of its layout and its format."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from mla.fast.sparse.kernels import DS_MLA, MODEL1, PLAIN
from mla.reference.fp8 import FP8_DS_MLA_BYTES
from mla.reference.fp8_model1 import FP8_MODEL1_BYTES, fp8_model1_pages

__all__ = ["Scope", "View", "contiguous_view", "decode_scope", "padded_rows", "plain_scope",
           "rows_view", "unit_stride"]

View = Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Scope:
    """One KV scope as the kernels read it: its views per slot (cache, float32 and bfloat16
    views of the same bytes for the fp8 formats, index rows ``[Q, topk]``, lengths) and the
    integers of its layout."""

    views: tuple[View, View, View, View, View | None]
    kv: torch.Tensor  # the cache view, for the route and the layout
    idx: torch.Tensor
    has_length: bool
    n_rows: int
    stride_row: int = 0  # PLAIN: elements per row
    page_size: int = 1  # MODEL1: tokens per page
    page_stride: int = 0  # MODEL1: bytes from one page to the next


def rows_view(n: int, width: int | None = None) -> View:
    """``t`` as ``[n, width]`` rows (``width``: t's last dim) with unit column stride."""
    return lambda t: unit_stride(t.reshape(n, t.shape[-1] if width is None else width))


def plain_scope(kv: torch.Tensor, indices: torch.Tensor, lens: torch.Tensor | None,
                 rows: int, queries: int) -> Scope:
    """Rows in q's dtype: ``kv`` as ``[rows, D]``, ``indices`` as ``[queries, topk]``."""
    view, idx_view = rows_view(rows), rows_view(queries)
    kv2 = view(kv)
    return Scope((view, view, view, idx_view, contiguous_view), kv2, idx_view(indices),
                  lens is not None, rows, kv2.stride(0))


def decode_scope(name: str, kv_cache: torch.Tensor, indices: torch.Tensor,
                  lens: torch.Tensor | None, fp8: bool) -> tuple[Scope, int]:
    """A decode cache and its ``indices [B, s_q, topk]`` as a ``Scope`` and its ``FORMAT``."""
    nb, bs = kv_cache.shape[:2]
    n_slots = nb * bs
    queries = indices.shape[0] * indices.shape[1]
    if not fp8:
        return plain_scope(kv_cache, indices, lens, n_slots, queries), PLAIN
    idx_view = rows_view(queries)
    if kv_cache.shape[-1] == FP8_MODEL1_BYTES:
        def pages(t: torch.Tensor) -> torch.Tensor:
            return fp8_model1_pages(t, name=name)
        p = pages(kv_cache)
        if p.data_ptr() % 2 or (nb > 1 and p.stride(0) % 2):
            raise ValueError(f"{name}'s MODEL1 pages must start at even byte addresses (their "
                             f"bf16 rope values are read as bf16), got block stride "
                             f"{p.stride(0)} at address {p.data_ptr()}")
        views = (pages, pages, lambda t: pages(t).view(torch.bfloat16), idx_view,
                 contiguous_view)
        return Scope(views, p, idx_view(indices), lens is not None, n_slots, page_size=bs,
                      page_stride=p.stride(0) if nb > 1 else 0), MODEL1

    padded = padded_rows(kv_cache, bs)
    if padded is None:  # rows one after another, or a layout read only through a copy
        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.view(torch.uint8).reshape(n_slots, FP8_DS_MLA_BYTES).contiguous()
        n_rows = n_slots
    else:
        # block b's rows start ``pitch`` rows apart (FlashMLA's ``[nb, bs + 1, 656]`` sliced to
        # ``bs``): read the rows in place, slot s at row s + (s // bs)·(pitch − bs)
        pitch, n_rows = padded

        def rows(t: torch.Tensor) -> torch.Tensor:
            return torch.as_strided(t.view(torch.uint8), (n_rows, FP8_DS_MLA_BYTES),
                                    (FP8_DS_MLA_BYTES, 1))

        def idx_view(t: torch.Tensor, _flat: View = idx_view) -> torch.Tensor:
            i = _flat(t)
            return torch.where(i >= 0, i + torch.div(i, bs, rounding_mode="floor")
                               * (pitch - bs), i)
    views = (rows, lambda t: rows(t).view(torch.float32), lambda t: rows(t).view(torch.bfloat16),
             idx_view, contiguous_view)
    return Scope(views, rows(kv_cache), idx_view(indices), lens is not None, n_rows), DS_MLA


def padded_rows(kv_cache: torch.Tensor, bs: int) -> tuple[int, int] | None:
    """``(pitch, rows)`` when an ``fp8_ds_mla`` cache's blocks are ``pitch > bs`` whole rows
    apart (its rows then lie in place as ``rows`` rows of 656 bytes, the last block's padding
    left out); ``None`` when its rows are contiguous or not in whole rows."""
    st = kv_cache.stride()
    nb = kv_cache.shape[0]
    if (nb < 2 or st[-1] != 1 or st[1] != FP8_DS_MLA_BYTES or st[0] % FP8_DS_MLA_BYTES
            or (kv_cache.dim() == 4 and kv_cache.shape[2] != 1)):
        return None
    pitch = st[0] // FP8_DS_MLA_BYTES
    if pitch <= bs:
        return None
    return pitch, (nb - 1) * pitch + bs


def contiguous_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()



def unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
