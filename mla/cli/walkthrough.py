"""The walkthrough: every MLA path on one embedded example, checked against the definition.

The example is ``mla.cli.case.Case``: random weights of a preset and a batch of requests.
The model-level rows here run a path from hidden states to the attention's output and compare
it with the definition (``mla.reference.naive_forward``) run in float64 on the CPU on the same
inputs upcast (conventions §11). The kernel-level rows (``mla.cli.kernel_rows``: the
reference's and ``mla.fast``'s kernels on the example's latents) follow them in the table.

A row is a function registered with ``@register_row``: it gets the ``Case`` and returns a
``Measurement`` (the path's output, the reference it must equal, the seconds the path took),
or raises ``CannotRunError`` with the reason it cannot run here, which the table prints in its
place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mla.cli import kernel_rows
from mla.cli.case import (
    DTYPES,
    REFERENCE,
    CannotRunError,
    Case,
    DeviceUnavailableError,
    Measurement,
    Row,
    RowSpec,
    check_device,
    make_registrar,
    timed,
)
from mla.compare import max_abs_err, rel_err, tolerance
from mla.reference import (
    chunked_prefill_forward,
    decode_forward,
    naive_forward,
    plan_context_chunks,
    prefill_forward,
    write_context,
)
from mla.reference.dcp import (
    dcp_chunked_prefill_forward_rank,
    dcp_decode_forward_rank,
    plan_dcp_context_chunks,
    run_simulated,
    same_on_all_ranks,
)

__all__ = ["Case", "DeviceUnavailableError", "DTYPES", "Measurement", "Row", "RowSpec", "ROWS",
           "CannotRunError", "register_row", "run_walkthrough", "format_table"]

ROWS: list[RowSpec] = []  # the table, in order: the model-level rows, then the kernel-level
register_row = make_registrar(ROWS)


# --- the rows ----------------------------------------------------------------------------

@register_row("naive (definition)")
def _naive(case: Case) -> Measurement:
    """The definition itself in the case's dtype: shows the dtype's own rounding."""
    if case.dtype == REFERENCE and case.device.type == "cpu":
        raise CannotRunError("in float64 on the CPU the definition is the reference itself")
    out, sec = timed(lambda: torch.cat([naive_forward(case.weights, h) for h in case.hidden]),
                     case.device)
    return Measurement(out, torch.cat(case.reference), sec)


@register_row("prefill one-shot (compute-friendly)")
def _prefill(case: Case) -> Measurement:
    out, sec = timed(
        lambda: torch.cat([prefill_forward(case.weights, h) for h in case.hidden]), case.device)
    return Measurement(out, torch.cat(case.reference), sec)


@register_row("chunked prefill with context")
def _chunked_prefill(case: Case) -> Measurement:
    """All requests in one batch: context already cached, the new tokens prefilled."""
    ctx, new = case.context_lens, case.new_tokens
    kv_cache, block_table = case.empty_cache(case.seq_lens)
    for i, h in enumerate(case.hidden):
        write_context(case.weights, h[: ctx[i]], kv_cache, block_table[i])
    plan = plan_context_chunks(ctx, max_context_chunk=case.max_context_chunk)
    new_hidden = torch.cat([h[ctx[i]:] for i, h in enumerate(case.hidden)])
    qsl = torch.arange(0, new * (len(ctx) + 1), new, dtype=torch.int32, device=case.device)
    out, sec = timed(lambda: chunked_prefill_forward(case.weights, new_hidden, qsl, list(ctx),
                                                     kv_cache, block_table, plan=plan),
                     case.device)
    return Measurement(out, case.last_rows(new).flatten(0, 1), sec)


def _decode(case: Case, s_q: int) -> Measurement:
    """Cache all but the last ``s_q`` tokens of every request, then decode those together."""
    seq_lens = case.seq_lens
    kv_cache, block_table = case.empty_cache(seq_lens)
    for i, h in enumerate(case.hidden):
        write_context(case.weights, h[:-s_q], kv_cache, block_table[i])
    cache_seqlens = torch.tensor([n - s_q for n in seq_lens], dtype=torch.int32,
                                 device=case.device)
    hidden = torch.stack([h[-s_q:] for h in case.hidden])  # [B, s_q, H]
    out, sec = timed(lambda: decode_forward(case.weights, hidden, kv_cache, block_table,
                                            cache_seqlens), case.device)
    return Measurement(out, case.last_rows(s_q), sec)


@register_row("absorbed decode s_q=1 (paged)")
def _decode_1(case: Case) -> Measurement:
    return _decode(case, 1)


@register_row("absorbed decode s_q=2 (MTP, paged)")
def _decode_2(case: Case) -> Measurement:
    return _decode(case, 2)


DCP_DECODE_RANKS, DCP_PREFILL_RANKS = 4, 2  # divide the heads of every preset


@register_row(f"DCP decode s_q=2 ({DCP_DECODE_RANKS} simulated ranks)")
def _dcp_decode(case: Case) -> Measurement:
    """The cache of ``_decode`` sharded over the ranks (short requests leave ranks idle)."""
    s_q, seq_lens = 2, case.seq_lens
    kv_cache, block_table = case.empty_cache(seq_lens)
    for i, h in enumerate(case.hidden):
        write_context(case.weights, h[:-s_q], kv_cache, block_table[i])
    cache_seqlens = torch.tensor([n - s_q for n in seq_lens], dtype=torch.int32,
                                 device=case.device)
    hidden = torch.stack([h[-s_q:] for h in case.hidden])
    out, sec = timed(lambda: same_on_all_ranks(run_simulated(
        DCP_DECODE_RANKS, lambda comm: dcp_decode_forward_rank(
            comm, case.weights, hidden, kv_cache, block_table, cache_seqlens))),
        case.device)
    return Measurement(out, case.last_rows(s_q), sec)


@register_row(f"DCP chunked prefill ({DCP_PREFILL_RANKS} simulated ranks)")
def _dcp_chunked_prefill(case: Case) -> Measurement:
    """``_chunked_prefill`` with the context sharded; the chunk size is the case's, rounded up
    to a multiple of the ranks (DCP needs it divisible)."""
    W, ctx, new = DCP_PREFILL_RANKS, case.context_lens, case.new_tokens
    kv_cache, block_table = case.empty_cache(case.seq_lens)
    for i, h in enumerate(case.hidden):
        write_context(case.weights, h[: ctx[i]], kv_cache, block_table[i])
    plan = plan_dcp_context_chunks(ctx, W, max_context_chunk=-(-case.max_context_chunk // W) * W)
    new_hidden = torch.cat([h[ctx[i]:] for i, h in enumerate(case.hidden)])
    qsl = torch.arange(0, new * (len(ctx) + 1), new, dtype=torch.int32, device=case.device)
    out, sec = timed(lambda: same_on_all_ranks(run_simulated(
        W, lambda comm: dcp_chunked_prefill_forward_rank(
            comm, case.weights, new_hidden, qsl, list(ctx), kv_cache, block_table, plan=plan))),
        case.device)
    return Measurement(out, case.last_rows(new).flatten(0, 1), sec)


# --- running and printing ----------------------------------------------------------------

ROWS.extend(kernel_rows.ROWS)  # after the model-level rows above; a later register_row appends
DEFAULT_CONTEXT_LENS = (0, 1, 17, 40, 70)  # an empty and a length-1 context; 70 spans 2 pages


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise TypeError(f"dtype must be one of {list(DTYPES)}, got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def run_walkthrough(
    preset: str = "deepseek-v2-lite",
    dtype: str | torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
    context_lens: Sequence[int] = DEFAULT_CONTEXT_LENS,
    new_tokens: int = 3,
    block_size: int = 64,
    max_context_chunk: int = 16,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    fast: bool = True,
) -> list[Row]:
    """Run every row on the embedded example and return the table's rows.

    ``new_tokens >= 2`` so that the MTP decode (``s_q = 2``) has two tokens in every request.
    ``progress`` is called with a line before each row runs (the CLI prints it to stderr).
    ``fast``: run the ``mla.fast`` rows where they can run (on the CPU only with
    ``TRITON_INTERPRET=1`` set before triton is imported); otherwise they are skipped.
    Raises ``ValueError``/``TypeError`` for bad arguments and ``DeviceUnavailableError`` for a
    device this machine does not have.
    """
    torch_dtype = _dtype(dtype)
    context_lens = tuple(context_lens)
    if not context_lens:
        raise ValueError("context_lens must name at least one request, got []")
    for name, value in (("new_tokens", new_tokens), ("block_size", block_size),
                        ("max_context_chunk", max_context_chunk)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in context_lens):
        raise ValueError(f"context_lens must be ints >= 0, got {list(context_lens)}")
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (the MTP decode row decodes 2), "
                         f"got {new_tokens}")
    if block_size <= 0 or max_context_chunk <= 0:
        raise ValueError(f"block_size and max_context_chunk must be positive, got "
                         f"{block_size} and {max_context_chunk}")
    case = Case.build(preset, torch_dtype, check_device(device), context_lens, new_tokens,
                      block_size, max_context_chunk, seed, fast)
    rows = []
    for k, spec in enumerate(ROWS):
        if progress is not None:
            progress(f"[{k + 1}/{len(ROWS)}] {spec.path} ...")
        try:
            m = spec.fn(case)
        except CannotRunError as why:
            nan = float("nan")
            rows.append(Row(spec.path, spec.reference, "-", nan, nan, nan, nan, skipped=str(why)))
            continue
        run_dtype = case.dtype if m.dtype is None else m.dtype
        tol = tolerance(run_dtype) if m.tolerance is None else m.tolerance
        rows.append(Row(spec.path, spec.reference, _dtype_name(run_dtype),
                        rel_err(m.out, m.ref), max_abs_err(m.out, m.ref), m.seconds, tol,
                        m.metric))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width text table; a skipped row gives its reason in place of
    the numbers."""
    head = ("path", "against", "dtype", "rel err", "max abs err", "limit", "time", "ok")
    lines: list[tuple[str, ...] | str] = []
    for r in rows:
        if r.skipped is not None:
            lines.append(f"{r.path}  skipped: {r.skipped}")
        else:
            lines.append((r.path, r.reference, r.dtype, f"{r.rel_err:.2e}",
                          f"{r.max_abs_err:.2e}", f"{r.metric} {r.tolerance:.1e}",
                          f"{r.seconds * 1e3:.1f} ms", "yes" if r.passed else "NO"))
    cells = [line for line in lines if isinstance(line, tuple)]
    widths = [max(len(line[i]) for line in (head, *cells)) for i in range(len(head))]
    left = (True, True, True, False, False, False, False, True)

    def fmt(line: tuple[str, ...] | str) -> str:
        if isinstance(line, str):  # a skipped row: its path, then why
            path, _, why = line.partition("  skipped: ")
            return f"{path.ljust(widths[0])}  skipped: {why}"
        out = [c.ljust(wd) if lft else c.rjust(wd) for c, wd, lft in zip(line, widths, left)]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * wd for wd in widths)
    return "\n".join([fmt(head), rule, *(fmt(line) for line in lines)])
