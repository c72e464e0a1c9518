"""Cases of ``concat_and_cache_mla`` and ``gather_cache``: the paged latent cache (conventions §8).

``concat_and_cache_mla(kv_c [T, Lkv], k_pe [T, R] or [T, 1, R], kv_cache, slot_mapping [T])``
writes row ``kv_c[t] ‖ k_pe[t]`` to ``kv_cache.view(-1, Lkv + R)[slot_mapping[t]]`` in place;
slot ``-1`` is padding and is skipped (the row at index ``-1`` keeps its bytes).
``gather_cache(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts)`` copies
request ``b``'s rows ``[seq_starts[b], seq_starts[b] + len_b)`` to
``dst[cu_seq_lens[b] : cu_seq_lens[b+1]]`` and returns ``dst[:cu_seq_lens[-1]]``.

Both are copies, so every output is compared exactly (quantity "mismatches", in the setting's
dtype; NaN equals NaN only where both hold one) against the reference run on CPU copies of
exactly the kernel's inputs. The outputs are whole buffers after the call, so a row the kernel
must not touch has to keep its contents bit for bit:

- the write's cache already holds earlier tokens (finite rows) and never-written rows (NaN),
  and the cache's last row always holds an earlier token (where a ``-1`` slot lands if a kernel
  lets it wrap); the slots scatter over the pages in a seeded order and one is the last row of
  a page;
- the gather's ``dst`` is poisoned (NaN) and has rows past the filled part (their NaN must
  stay); the outputs are the returned part (``out``) and the whole buffer (``dst``). Each
  request's source rows go on past its chunk (the next chunk's rows: a kernel that reads or
  writes past the chunk shows), rows no request holds are NaN and block-table entries no
  request uses point at a page of NaN; a request with no context has a block-table row of
  ``-1``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from mla.compare import poison_like
from mla.conformance.cases.common import DV, D, call_poisoned
from mla.conformance.catalogue import Setting, Trial, generator, spec_cases
from mla.reference.paged_cache import (
    cache_rows,
    concat_and_cache_mla,
    gather_cache,
    make_block_table,
)

__all__ = ["WriteSpec", "GatherSpec", "write_trial", "gather_trial", "scattered_slots",
           "WRAP_MINUS_ONE"]

Outputs = dict[str, torch.Tensor]

WRAP_MINUS_ONE = "slot -1 written to the cache's last row (index -1 wraps); -1 is padding"


def scattered_slots(g: torch.Generator, n_slots: int, page: int, tokens: int,
                    last_slot: bool = False) -> list[int]:
    """``tokens`` distinct slots of a cache of ``n_slots`` rows in a seeded random order (so
    they scatter over the pages); the first is the last row of a page, and with
    ``last_slot`` the last one is the cache's very last row."""
    if tokens == 0:
        return []
    perm = torch.randperm(n_slots, generator=g).tolist()
    edge = next(s for s in perm if s % page == page - 1 and not (last_slot and s == n_slots - 1))
    rest = [s for s in perm if s not in (edge, n_slots - 1)]
    slots = [edge, *rest[: tokens - 1]]
    if last_slot:
        slots[-1] = n_slots - 1
    return slots


# ---- concat_and_cache_mla ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class WriteSpec:
    tokens: int
    page: int = 64
    blocks: int = 3
    lkv: int = DV
    r: int = D - DV
    padding: tuple[int, ...] = ()  # tokens whose slot is -1 (they share one row of values)
    k_pe_3d: bool = False  # k_pe as [T, 1, R]
    views: bool = False  # kv_c, k_pe as column slices of one [T, Lkv + R] tensor (vLLM's split)
    last_slot: bool = False  # one token goes to the cache's very last row


def _write_rows(cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                slots: torch.Tensor, *, wrap: bool = False, pe_first: bool = False,
                write_pe: bool = True) -> torch.Tensor:
    """A copy of ``cache`` after a write that breaks one convention: ``wrap`` writes slot -1
    to the last row, ``pe_first`` stores ``k_pe ‖ kv_c``, ``write_pe=False`` leaves the
    rope columns as they were."""
    out = cache.clone()
    flat = out.view(-1, out.shape[-1])
    k_pe = k_pe.reshape(k_pe.shape[0], k_pe.shape[-1])
    keep = torch.ones_like(slots, dtype=torch.bool) if wrap else slots >= 0
    rows = torch.cat([k_pe, kv_c] if pe_first else [kv_c, k_pe], dim=-1)[keep]
    if write_pe:
        flat[slots[keep]] = rows
    else:
        flat[slots[keep], : kv_c.shape[1]] = rows[:, : kv_c.shape[1]]
    return out


def _packed(view: torch.Tensor) -> torch.Tensor:
    """What a kernel that ignores ``view``'s strides reads: its storage from the view's offset
    on, as if contiguous."""
    strides = [1]
    for n in reversed(view.shape[1:]):
        strides.insert(0, strides[0] * n)
    return torch.as_strided(view, view.shape, strides, view.storage_offset())


def write_trial(setting: Setting, spec: WriteSpec, salt: int) -> Trial:
    """A trial of ``spec`` (see the module doc): inputs in the setting's dtype."""
    g = generator(setting, salt)
    n_slots, width = spec.blocks * spec.page, spec.lkv + spec.r
    slots = torch.tensor(scattered_slots(g, n_slots, spec.page, spec.tokens, spec.last_slot),
                         dtype=torch.int64).reshape(spec.tokens)
    slots[list(spec.padding)] = -1
    rows = torch.randn(spec.tokens, width, generator=g, dtype=torch.float64)
    # padding tokens share one row, so a kernel that wraps -1 writes it whichever token wins
    rows[list(spec.padding)] = rows[list(spec.padding[:1])]
    rows = rows.to(setting.dtype)
    cache = torch.randn(spec.blocks, spec.page, width, generator=g, dtype=torch.float64)
    never_written = torch.rand(n_slots, generator=g) < 0.5
    never_written[-1] = False  # an earlier token: where a wrapped -1 slot would land
    cache.view(n_slots, width)[never_written] = float("nan")
    cache = cache.to(setting.dtype)

    def split(full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv_c, k_pe = full[:, : spec.lkv], full[:, spec.lkv:]
        if not spec.views:
            kv_c, k_pe = kv_c.contiguous(), k_pe.contiguous()
        return kv_c, k_pe.unsqueeze(1) if spec.k_pe_3d else k_pe

    dev = setting.device
    dev_rows, dev_slots = rows.to(dev), slots.to(dev)

    def invoke(fn: Callable) -> Outputs:
        out = cache.to(dev, copy=True)
        call_poisoned(fn, *split(dev_rows), out, dev_slots)
        return {"kv_cache": out}

    kv_c, k_pe = split(rows)
    want = cache.clone()
    concat_and_cache_mla(kv_c, k_pe, want, slots)
    alts: dict[str, Callable[[], Outputs]] = {
        "rows stored as k_pe ‖ kv_c (k_pe written before kv_c)":
            lambda: {"kv_cache": _write_rows(cache, kv_c, k_pe, slots, pe_first=True)},
        "k_pe not written (the rope columns keep their earlier contents)":
            lambda: {"kv_cache": _write_rows(cache, kv_c, k_pe, slots, write_pe=False)}}
    if spec.views:
        alts["kv_c and k_pe read as contiguous (their row strides ignored)"] = (
            lambda: {"kv_cache": _write_rows(cache, _packed(kv_c), _packed(k_pe), slots)})
    if spec.padding:
        alts[WRAP_MINUS_ONE] = lambda: {"kv_cache": _write_rows(cache, kv_c, k_pe, slots,
                                                                 wrap=True)}
    return Trial(invoke, {"kv_cache": want}, {"kv_cache": "mismatches"}, alts)


_register_write = spec_cases("concat_and_cache_mla", write_trial)


_register_write("deepseek_scattered", "shapes",
                "DeepSeek rows of 576 = kv_c 512 ‖ k_pe 64 at page 64, written to slots "
                "scattered over the pages in no order, one at the last row of a page.",
                WriteSpec(tokens=37), 700)
_register_write("small_width", "shapes",
                "A small width (kv_c 32 ‖ k_pe 16) at page 16: nothing assumes DeepSeek's 576.",
                WriteSpec(tokens=29, page=16, lkv=32, r=16), 701)
_register_write("page_1", "pages",
                "Page size 1: every token is its own page (slot = block).",
                WriteSpec(tokens=19, page=1, blocks=40), 702)
_register_write("padding_slots", "padding",
                "Slot -1 is padding (first, middle and last token): skipped, so the cache's last "
                "row keeps the earlier token it holds.",
                WriteSpec(tokens=12, page=16, padding=(0, 5, 11)), 703)
_register_write("k_pe_3d", "k_pe_shape",
                "k_pe given as [T, 1, R] (vLLM's shape, one rope head) instead of [T, R].",
                WriteSpec(tokens=21, k_pe_3d=True), 704)
_register_write("strided_views", "strides",
                "kv_c [T, 512] and k_pe [T, 1, 64] as column slices of one [T, 576] tensor "
                "(vLLM splits kv_a's output): row strides of 576, not their widths.",
                WriteSpec(tokens=21, k_pe_3d=True, views=True), 705)
_register_write("no_tokens", "edges",
                "T = 0 (an empty step): nothing is written and the cache keeps every byte.",
                WriteSpec(tokens=0), 706)
_register_write("one_token_last_row", "edges",
                "T = 1 into the very last row of a page-256 cache: the write's bounds include "
                "the last slot.",
                WriteSpec(tokens=1, page=256, blocks=2, last_slot=True), 707)


# ---- gather_cache -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GatherSpec:
    lens: tuple[int, ...]  # each request's chunk length
    starts: tuple[int, ...] | None = None  # seq_starts (None: not passed, chunks from 0)
    page: int = 64
    d: int = D
    tail: int = 5  # rows a request holds past its chunk (the next chunk's)
    spare: int = 7  # dst rows past the filled part


def _gather_rows(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, cu: list[int],
                 starts: list[int], *, page_aligned: bool = False, overrun: bool = False,
                 zero_tail: bool = False) -> torch.Tensor:
    """A copy of ``dst`` after a gather that breaks one convention: ``starts`` as given (all 0:
    seq_starts ignored), ``page_aligned`` rounds each start down to its page, ``overrun``
    writes each chunk's rows on to the end of its last page (in request order, as far as
    ``dst`` and the request's pages reach), ``zero_tail`` zeroes dst past the filled part."""
    out = dst.clone()
    bs = src.shape[1]
    if zero_tail:
        out[cu[-1]:] = 0
    for b, start in enumerate(starts):
        n = cu[b + 1] - cu[b]
        if not n:
            continue
        if page_aligned:
            start -= start % bs
        if overrun:
            n = min(-(-(start + n) // bs) * bs - start, out.shape[0] - cu[b])
        out[cu[b]: cu[b] + n] = cache_rows(src, table[b], start, n)
    return out


def gather_trial(setting: Setting, spec: GatherSpec, salt: int) -> Trial:
    """A trial of ``spec`` (see the module doc): the source cache and dst in the setting's
    dtype."""
    g = generator(setting, salt)
    starts = list(spec.starts) if spec.starts is not None else [0] * len(spec.lens)
    context = [s + n + spec.tail if s + n else 0 for s, n in zip(starts, spec.lens)]
    table, nb = make_block_table(context, spec.page, spare_blocks=1,
                                 seed=int(torch.randint(1 << 30, (1,), generator=g)))
    src = torch.full((nb, spec.page, spec.d), float("nan"), dtype=torch.float64)
    for b, ctx in enumerate(context):
        pos = torch.arange(ctx)
        rows = table[b].long()[pos // spec.page] * spec.page + pos % spec.page
        src.view(-1, spec.d)[rows] = torch.randn(ctx, spec.d, generator=g, dtype=torch.float64)
    has_pages = torch.tensor([c > 0 for c in context])[:, None]
    table = torch.where((table < 0) & has_pages, nb - 1, table)  # nb - 1: the page of NaN
    src = src.to(setting.dtype)
    cu = [0]
    for n in spec.lens:
        cu.append(cu[-1] + n)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    starts_t = None if spec.starts is None else torch.tensor(starts, dtype=torch.int32)
    dst0 = poison_like(torch.empty(cu[-1] + spec.spare, spec.d, dtype=setting.dtype))
    extra = () if starts_t is None else (starts_t,)
    batch = len(spec.lens)

    dev = setting.device
    dev_args = [t.to(dev) for t in (src, table, cu_t)]
    dev_extra = tuple(t.to(dev) for t in extra)

    def invoke(fn: Callable) -> Outputs:
        dst = dst0.to(dev, copy=True)
        out = call_poisoned(fn, dev_args[0], dst, dev_args[1], dev_args[2], batch, *dev_extra)
        return {"out": out, "dst": dst}

    want_dst = dst0.clone()
    want_out = gather_cache(src, want_dst, table, cu_t, batch, *extra)
    total = cu[-1]

    def outs(dst: torch.Tensor) -> Outputs:
        return {"out": dst[:total], "dst": dst}

    alts: dict[str, Callable[[], Outputs]] = {
        "returned all of dst, not its filled part dst[:cu_seq_lens[-1]]":
            lambda: {"out": want_dst, "dst": want_dst},
        "dst rows past the filled part zeroed (they must keep their contents)":
            lambda: outs(_gather_rows(src, dst0, table, cu, starts, zero_tail=True)),
        "rows written past each chunk's end, to the end of its last page":
            lambda: outs(_gather_rows(src, dst0, table, cu, starts, overrun=True))}
    if any(starts):
        alts["gather ignores seq_starts (each chunk read from its request's position 0)"] = (
            lambda: outs(_gather_rows(src, dst0, table, cu, [0] * batch)))
    if any(s % spec.page for s in starts):
        alts["seq_starts rounded down to a page boundary (vLLM's CUDA gather takes "
             "page-aligned starts only)"] = (
            lambda: outs(_gather_rows(src, dst0, table, cu, starts, page_aligned=True)))
    return Trial(invoke, {"out": want_out, "dst": want_dst},
                 {"out": "mismatches", "dst": "mismatches"}, alts)


_register_gather = spec_cases("gather_cache", gather_trial)


_register_gather("deepseek_chunks", "shapes",
                 "DeepSeek rows of 576 at page 64: context chunks starting on page boundaries "
                 "(seq_starts 0, 128, 64) and ending mid-page, with rows after them.",
                 GatherSpec((64, 100, 37), starts=(0, 128, 64)), 750)
_register_gather("small_width_page_128", "pages",
                 "A small width (48) at page 128, lengths 127, 128, 129 and 1, seq_starts not "
                 "passed: every chunk starts at position 0.",
                 GatherSpec((127, 128, 129, 1), page=128, d=48), 751)
_register_gather("seq_starts_mid_page", "seq_starts",
                 "seq_starts inside a page (3, 15, 17, 40 at page 16): each chunk starts "
                 "mid-page and crosses page edges.",
                 GatherSpec((20, 5, 16, 1), starts=(3, 15, 17, 40), page=16), 752)
_register_gather("empty_requests", "empty",
                 "Empty chunks in cu_seq_lens (first, middle, last; with and without context): "
                 "they take no dst rows and their block-table rows are never read.",
                 GatherSpec((0, 40, 0, 0, 25, 0), starts=(0, 64, 0, 128, 0, 64)), 753)
_register_gather("no_rows", "empty",
                 "Every chunk empty: the filled part is [0, D] and dst keeps every element.",
                 GatherSpec((0, 0, 0), starts=(0, 64, 0)), 754)
_register_gather("dst_spare_rows", "dst",
                 "dst 200 rows longer than the chunks need, the last chunk ending mid-page: rows "
                 "past the filled part keep their contents, the return value is the filled part.",
                 GatherSpec((33, 70), starts=(64, 0), spare=200), 755)
