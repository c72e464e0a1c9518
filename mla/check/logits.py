"""``python -m mla.check`` cases for the indexer's ragged prefill logits (``mla.fast``'s
``fp8_mqa_logits``): the catalogue's cases, then shapes that reach what they do not, each
against ``mla.reference.indexer_logits.fp8_mqa_logits`` in float64 on the CPU over the same
e4m3 codes.

What the extra cases reach on a Hopper GPU (``mla.fast.sm90.logits``, two queries and tiles
of 64 keys a program, up to 16 tiles, the rest of a row over more programs): an odd count of
queries (the last pair half empty), keys not a multiple of 64, rows longer than 16 tiles
(several programs a row), pairs of queries across two requests (compressed: two starts, the
pair's second slot), sliding windows (every query its own start), empty windows, one query,
a NaN code in a seen key; full and compressed rows; and the same calls on the Triton kernel
(``LogitsPlan(prefill_kernel="triton")``). Measured: ``mismatches``, the logits NaN where the
reference's are not or the other way round (limit 0), and ``mla.compare.logits_err`` over
the rest (infinities where the reference has none: ``inf``) against ``logits_budget`` on the
device, the limit the catalogue holds the kernel to.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

import mla.fast as fast
from mla.check.catalogue import catalogue_cases
from mla.check.registry import Case, Ctx, Measured, gen, register
from mla.compare import logits_err
from mla.conformance.cases.indexer_specs import RaggedSpec, ragged_windows
from mla.fast.indexer.logits import LogitsPlan, logits_budget
from mla.reference.indexer_cache import INDEX_DIM, quantize_indexer_k
from mla.reference.indexer_logits import fp8_mqa_logits as reference_logits
from mla.reference.indexer_logits import quantize_indexer_q

__all__ = ["logits_cases"]

HEADS = 64
TRITON = LogitsPlan(prefill_kernel="triton")


def _case(ctx: Ctx, salt: int, lens: tuple[int, ...], queries: int, *, window: int = 0,
          empty: tuple[int, ...] = (), nan_key: bool = False, extra: int | None = None,
          plan: LogitsPlan | None = None) -> Measured:
    """One call against the reference; ``extra``: rows compressed to the longest window plus
    this many columns."""
    g = gen(ctx, salt)
    n = sum(lens)
    k = torch.randn(n, INDEX_DIM, generator=g, dtype=torch.float64) * \
        2.0 ** torch.randint(-3, 4, (n, 1), generator=g)
    codes, scale = quantize_indexer_k(k)
    ks_l, ke_l = ragged_windows(RaggedSpec(lens, queries, window=window, empty=empty))
    S = len(ks_l)
    q8, w = quantize_indexer_q(torch.randn(S, HEADS, INDEX_DIM, generator=g, dtype=torch.float64),
                               torch.randn(S, HEADS, generator=g, dtype=torch.float64) / 90.5)
    if nan_key:
        codes[ke_l[-1] - 1, 5] = 0x7F  # the last query's last key: an e4m3 NaN code
    ks = torch.tensor(ks_l, dtype=torch.int32)
    ke = torch.tensor(ke_l, dtype=torch.int32)
    width = max(ke_l[i] - ks_l[i] for i in range(S)) + extra if extra is not None else 0
    dev = ctx.device
    got = fast.fp8_mqa_logits(q8.to(dev), (codes.to(dev), scale.to(dev)), w.to(dev),
                              ks.to(dev), ke.to(dev), width, plan=plan)
    want = reference_logits(q8, (codes, scale), w.double(), ks, ke, width)
    mag = reference_logits(q8, (codes, scale), w.double().abs(), ks, ke, width)
    if list(got.shape) != list(want.shape) or got.dtype != torch.float32:
        raise AssertionError(f"got {got.dtype} {list(got.shape)}, the reference's float32 "
                             f"{list(want.shape)}")
    got = got.cpu().double()
    nan = torch.isnan(want)  # NaN exactly where the reference has it, the rest by logits_err
    wrong = float((torch.isnan(got) != nan).sum())
    mag = torch.where(torch.isfinite(want), mag, 0.0)
    got, want = torch.where(nan, 0.0, got), torch.where(nan, 0.0, want)
    err = logits_err(got, want, mag)
    return Measured({"logits_err": err, "mismatches": wrong},
                    {"logits_err": logits_budget(dev, HEADS), "mismatches": 0.0})


# (name, lens, queries, options): every shape full and compressed, each on the default plan
_SHAPES = [
    ("one request, 129 queries, 3000 keys", (3000,), 129, {}),
    ("rows over 16 tiles: 2 requests of 3000 keys, 5 queries", (3000, 1100, 3000), 5, {}),
    ("pairs across requests: 65, 1, 130, 3 keys", (65, 1, 130, 3), 200, {}),
    ("windows of 100: a start a query", (700,), 257, {"window": 100}),
    ("empty windows", (90, 70), 40, {"empty": (0, 1, 6, 39)}),
    ("one query", (77,), 1, {}),
    ("a seen NaN code", (150, 33), 9, {"nan_key": True}),
]


@register("fp8_mqa_logits", "fp8_mqa_logits")
def logits_cases(ctx: Ctx) -> Iterator[Case]:
    yield from catalogue_cases(ctx, "fp8_mqa_logits")
    # quick (the interpreter, where the Triton kernel is the only route): the small shapes
    for i, (name, lens, queries, opts) in enumerate(_SHAPES):
        if ctx.quick and i < len(_SHAPES) - 3:
            continue
        for extra, kind in ((None, "full rows"), (7, "compressed")):
            yield Case(f"{name}, {kind}",
                       lambda lens=lens, q=queries, o=opts, e=extra, s=940 + i:
                       _case(ctx, s, lens, q, extra=e, **o))
    for name, lens, queries, opts in ((_SHAPES[0], _SHAPES[2]) if not ctx.quick else ()):
        yield Case(f"{name}, compressed, forced Triton",
                   lambda lens=lens, q=queries, o=opts: _case(ctx, 960, lens, q, extra=7,
                                                              plan=TRITON, **o))
