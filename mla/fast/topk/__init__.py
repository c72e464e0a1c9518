"""``top_k_per_row`` in Triton: a threshold estimated from a sample, one streaming read that
marks the keys reaching it, and an exact select among those few, held in registers.

Same selection as ``mla.reference.indexer_logits.top_k_per_row`` (conventions §10, "Indexer
logits and top-k"): per row the ``min(topk, end - start)`` highest logits of columns
``[start, end)``, ties to the lower index, NaN above every number, ``-0`` equal to ``+0``, as
``j - start``; the rest of the row ``-1``. Columns outside ``[start, end)`` never count (the
streaming read loads whole 16-byte vectors of the row, so a neighbour may be loaded, then
masked). The set is not sorted by score (the sparse attention sums over it, the catalogue
compares sets): a row held whole, or selected from its candidate list, comes in column order
(or, in the one-launch kernel's split rows, the order in which its parts arrived), a row scanned
as at most two runs in column order (the keys above the boundary's radix bucket, then the
bucket's chosen ones); the set never depends on it.

**Why this shape.** Reading 128K float32 logits a row at the copy bandwidth leaves about 30
instructions a key per thread. A ``tl.histogram`` of every key cannot keep up with the memory;
a compare can: on the H200 a masked 256-bin ``tl.histogram`` of a program's held keys costs
several times what reading them does. That is also why the radix select of vLLM's
``persistent_topk`` (a row held by a group of programs, histogram rounds merged in global
memory) is not used here: rebuilt in Triton it was several times slower (the measurements:
``benchmarks/notes/topk.md``). Three steps:

1. **estimate**: a stratified sample of the row (evenly spaced runs of 8 keys: short runs,
   as neighbouring logits may be alike; as many runs as put the ``topk``-th key at about
   rank 128 of the sample, ``TopkPlan.sample_runs_for``: 1024 runs, 8192 keys, for rows of
   128K and ``topk = 2048``, 256 runs for 32K) gives, by bisection (``_bisect``, stopping
   anywhere within a slack of the rank), a key that about ``1.1 * topk`` (plus three
   standard deviations) of the row's keys reach: on random rows, about 3000 survivors (at
   most 3900 seen) for ``topk = 2048``.
2. **filter**, the one read of the row: a bit a key, set where the key reaches the threshold,
   stored as 32-bit words (no scan, no atomic, nothing the next block waits for). The keys
   are compared as floats, with the threshold turned into the float it stands for
   (``_key_floor``; a NaN always passes), and only a chunk's first and last blocks are
   masked, so a key costs about 13 SASS instructions a thread (26 comparing integer keys;
   ``benchmarks/probes/topk_mark_sass.py`` counts them), and listing the keys as the read
   goes ran at a third of the copy bandwidth.
3. **select**: the candidate list in one pass over the words (each word's set bits at the
   places after the words before it, by running counts of their popcounts, in column order),
   its keys gathered from the row straight into registers, then the exact ``topk`` best by a
   search that narrows a bracket around the boundary key, two interpolated probes a step,
   each step a compare of every held key with both and one block-wide count (no histogram,
   no memory; about 7 steps, ``mla.fast.topk.search``), until exactly ``topk`` keys reach
   it. Up to ``CANDIDATES / 2`` items are held with their columns. Where they are in column
   order (a list from the whole bitmask, a row held whole), one scan writes the columns: of a
   tied boundary key the first ones in that order are the lowest columns
   (``_select_in_column_order``); else (lists in the order the parts arrived) a second
   search among the tied boundary's equals on the inverted column takes the lowest columns.
   A longer list keeps only its keys and writes the columns in tiles. A row of no more
   than ``CANDIDATES`` keys skips 1-2 and is selected whole; where the logits are no wider
   than that, every route runs one kernel that holds only this path (``_held_kernel``:
   faster than the general kernels at every measured row count), by default with four
   probes a step, the first placed by a normal guess, and a step of the bracket's extremes
   where the interpolation stalls (``_quad_search``), the columns written from registers.

Longer logits take one of three routes (``TopkPlan.route``; ``"auto"`` picks one or two launches by
shape, ``TopkPlan.route_for``). **One launch** (``mla.fast.topk.fused``): every program of a row
estimates the threshold and marks its part of the row; rows no more than the SMs are split in at
least two parts (``TopkPlan.fused_min_parts``), each part listing its own marked keys with their
keys before it arrives, the last to arrive selecting; more rows, a program a row. Best where the
rows are few (latency: every row's estimate, read and select in a chain). **Two launches** (the
estimate a program a row, then ``_mark_select_kernel``: parts of ``two_chunk`` keys that mark, list
their shares and the last selects, a row's parts next to each other in the grid so that rows finish
one after another, each waiting for its own row's estimate only): best for rows of up to 32K keys
from more rows than SMs, and for many rows (more than two a SM, then at 4 warps a program: more
programs a SM, one's select overlapping the others' reads). **Three launches**
(``mla.fast.topk.kernels``): estimate and select a program a row, the filter ``R x C`` one-warp
programs; slower at every shape measured, kept as the alternative the tests and the benchmark hold
the others against.

**Correctness never rests on the estimate.** A row whose threshold let fewer than ``topk`` or
more than ``CANDIDATES`` keys through (massive ties, a row that is all ``-inf``, a sample that
misjudged an adversarial row) is selected from the whole row, read again at every radix level
(int64 ``(key, 0x7FFFFFFF - column)`` composites, unique per row): slow, not wrong. Nothing
depends on values at launch: no host sync, fixed grids and allocations, so a CUDA graph can
capture it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import triton

from mla.fast.common import capability, interpreting, next_pow2, num_sms, should_validate
from mla.fast.launch import CompiledLauncher, check_grid, int_spec, ptr_spec
from mla.fast.topk.fused import _fused_kernel, _mark_select_kernel
from mla.fast.topk.kernels import (
    _estimate_kernel,
    _held_kernel,
    _mask_kernel,
    _select_kernel,
    count_column,
    work_columns,
)
from mla.validation import check_float, check_index, check_same_device

__all__ = ["CANDIDATES", "TopkPlan", "launches", "sample_columns", "survivors", "top_k_per_row"]

CANDIDATES = 8192  # a row's candidate list, and the longest row selected directly
SMALL = 1024  # the scan compacts a boundary bucket this small and finishes it in registers
WORD_TILE = 4096  # the select lists a bitmask's words 4096 at a time (128K keys)
MAX_TOPK = 2**31 - 1025  # the output's tiles of 1024 step past it without wrapping int32
MAX_COLUMNS = 2**31 - 1  # logits' columns, int32 in the kernels
_GRID_NAME = "top_k_per_row (grid: rows [x parts of a row])"


def uncapped(warps: int) -> dict:
    """The one- and two-launch kernels' registers where they are not capped: all a thread
    may have with ``warps`` warps a program (left to itself, ptxas allots the split rows'
    kernel 128 registers at 8 warps and spills; with 255, 187 and none)."""
    return {"maxnreg": min(255, 65536 // (32 * warps))}


_estimate = CompiledLauncher(_estimate_kernel)
_held = CompiledLauncher(_held_kernel)
_mask = CompiledLauncher(_mask_kernel)
_select = CompiledLauncher(_select_kernel)
_fused = CompiledLauncher(_fused_kernel)
_mark_select = CompiledLauncher(_mark_select_kernel)


@dataclasses.dataclass(frozen=True)
class TopkPlan:
    """How the kernels run. ``benchmarks/topk_sweep.py`` and ``benchmarks/topk_routes.py`` time
    the alternatives; the defaults are the fastest measured on the H200 (the current numbers:
    ``benchmarks/results/README.md``; each choice's measurement: ``benchmarks/notes/topk.md``).

    Route (``route``: ``"auto"``, ``"one"``, ``"two"``, ``"three"``; ``route_for``):
    ``"auto"`` takes one launch where the rows are few and two launches where they outnumber
    the SMs or are short. One launch:
    ``fused_block`` keys a step, ``fused_stages`` steps in flight,
    ``fused_warps``; a row longer than ``CANDIDATES``, when the rows are no more than the
    SMs, split over ``max(fused_min_parts, SMs // rows)`` programs (at most ``fused_parts``),
    the last to arrive selecting (two parts were faster than one at 128 x 128K);
    ``fused_part_lists``: each part lists its marked keys before it arrives (faster at 1 to
    32 rows of 128K), else the last lists the whole bitmask.
    Two launches: parts of ``two_chunk`` keys (whole ``fused_block`` steps), ``fused_warps``,
    or ``two_warps`` where the rows are more than ``many_rows_per_sm`` a SM (4 warps: more
    programs a SM, one's select overlapping the others' reads).
    Estimate (all routes): runs of ``sample_run`` keys, as many as put the ``topk``-th key at
    about rank ``sample_rank`` of the sample (``sample_runs_for``), at most ``sample_runs``
    (2 to 1024; at most ``CANDIDATES`` keys in all); ``oversample`` (the survivors aimed at,
    in ``topk``, before three standard deviations of the sample's: 1.1 left fewer survivors
    to select than 1.2 and was faster);
    ``estimate_warps`` (two and three launches).
    Three launches' streaming read: ``block`` keys a step, ``stages`` steps in flight,
    ``filter_warps``, ``programs_per_sm`` (the grid aims at that many programs per SM: a row is
    cut into that many chunks over the rows).
    Select (all routes): ``select_maxnreg`` (where the selecting kernel's programs outnumber
    the SMs, the registers a thread capped and tiles of at most 1024 keys, two programs a
    SM), ``select_tile`` keys a step where a select reads in tiles (a list or row past
    ``CANDIDATES / 2``, the scan; at most 1024 in the one-launch kernel), ``select_bits`` a
    radix level of the scan; ``select_warps`` (three launches, and the rows held whole where
    the logits are no wider than ``CANDIDATES``).
    Searches of rows longer than ``CANDIDATES``: ``estimate_search`` (the sample's rank by
    ``"bisect"``, a bit a step, or ``"quad"``, ``_quad_search`` from its normal guess, each
    stopping within the estimate's slack) and ``select_search`` (the candidates' boundary by
    ``"bracket"``, two probes a step, or ``"quad"``; numpy models of the rules on rows of 8193
    keys, ``benchmarks.probes.topk_search_model --long``: the estimate 10.4 steps against 1.1
    on normal rows, the select 6.1 against 3.9, 17.4 against 4.0 on rows rounded to 1/40).
    Rows held whole (logits no wider than ``CANDIDATES``: ``_held_kernel``): ``held_write``
    (the columns written from the held keys, or by a second read in tiles), ``held_search``
    (the boundary key by ``_quad_search`` or ``_bracket_search``), ``held_maxnreg`` (where the
    rows outnumber the SMs, the registers a thread capped: at 8 warps ptxas gives the kernel
    162, one program a SM; 128 fits two, at the cost of 16 bytes of stack: H100, 256 x 8K
    24.2 against 28.6 us), ``held_prefetch`` (the row's columns ``[0, W)`` loaded before its
    range is read, aligned; the keys outside the range dropped).
    ``pdl`` (two and three launches, on sm_90 or later): the second launch (two) or the filter
    (three) launched as the estimate's programmatic dependent (``launch_pdl``), so that it
    starts while the estimate ends, its programs waiting for the thresholds; the select
    launched so too was slower at fewer rows (its programs, resident early, crowd the
    filter's), so it is not; two launches: each program waits for its row's estimate alone
    (a flag a row), so the first rows mark while later rows are still estimated."""
    route: str = "auto"
    fused_block: int = 4096
    fused_stages: int = 3
    fused_warps: int = 8
    fused_parts: int = 64
    fused_min_parts: int = 2
    fused_part_lists: bool = True
    two_chunk: int = 32768
    two_warps: int = 4
    many_rows_per_sm: int = 2
    block: int = 256
    stages: int = 3
    filter_warps: int = 1  # one warp a program: no barriers in a block's chain of reductions
    programs_per_sm: int = 64
    select_bits: int = 6
    select_tile: int = 2048
    select_warps: int = 8
    # rows held whole: their columns written from the held keys ("registers") or, past
    # CANDIDATES // 2 keys, by a second read of the row in tiles ("tiles"); their boundary key
    # found by four probes a step with a normal guess ("quad") or two ("bracket"); more rows
    # than SMs, their kernel's registers a thread capped (0: never), two programs a SM
    held_write: str = "registers"
    held_search: str = "quad"
    # rows longer than CANDIDATES: the estimate's search and the select's
    estimate_search: str = "bisect"
    select_search: str = "bracket"
    held_maxnreg: int = 128
    # rows held whole, written from registers: the row's columns [0, W) loaded before its
    # range is read (False: the range read first, then its keys alone)
    held_prefetch: bool = True
    # more rows than SMs: the selecting kernels' registers a thread capped (0: never) and their
    # tiles of at most 1024 keys, so that two programs of 8 warps share a SM
    select_maxnreg: int = 128
    oversample: float = 1.1
    sample_runs: int = 1024
    sample_run: int = 8
    sample_rank: int = 128
    estimate_warps: int = 8
    # two and three launches: the second launch or the filter launched as the estimate's
    # programmatic dependent (sm_90+)
    pdl: bool = True

    def __post_init__(self) -> None:
        for name in ("block", "filter_warps", "select_tile", "select_warps", "sample_runs",
                     "sample_run", "estimate_warps", "fused_block", "fused_warps", "two_warps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"TopkPlan.{name} must be a power of two, got {v!r}")
        if self.held_write not in ("registers", "tiles"):
            raise ValueError(f"TopkPlan.held_write must be 'registers' or 'tiles', got "
                             f"{self.held_write!r}")
        if self.held_search not in ("quad", "bracket"):
            raise ValueError(f"TopkPlan.held_search must be 'quad' or 'bracket', got "
                             f"{self.held_search!r}")
        for name, rules in (("estimate_search", ("bisect", "quad")),
                            ("select_search", ("bracket", "quad"))):
            if getattr(self, name) not in rules:
                raise ValueError(f"TopkPlan.{name} must be {rules[0]!r} or {rules[1]!r}, got "
                                 f"{getattr(self, name)!r}")
        if self.select_bits not in (5, 6, 7, 8):
            raise ValueError(f"TopkPlan.select_bits must be 5 to 8, got {self.select_bits!r}")
        if not isinstance(self.oversample, (int, float)) or not 1.0 <= self.oversample <= 3.0:
            raise ValueError(f"TopkPlan.oversample must lie in [1, 3], got {self.oversample!r}")
        if not 2 <= self.sample_runs <= 1024:
            raise ValueError(f"TopkPlan.sample_runs must lie in [2, 1024], got "
                             f"{self.sample_runs!r}")
        if self.sample_runs * self.sample_run > CANDIDATES:
            raise ValueError(f"TopkPlan.sample_runs * sample_run must be at most {CANDIDATES} (a "
                             f"sample shorter than every sampled row), got {self.sample_runs} * "
                             f"{self.sample_run}")
        for name in ("pdl", "fused_part_lists", "held_prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TopkPlan.{name} must be a bool, got "
                                f"{type(getattr(self, name)).__name__}")
        if self.route not in ("auto", "one", "two", "three"):
            raise ValueError(f"TopkPlan.route must be 'auto', 'one', 'two' or 'three', got "
                             f"{self.route!r}")
        for name in ("select_maxnreg", "held_maxnreg"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or (v and not 24 <= v <= 255):
                raise ValueError(f"TopkPlan.{name} must be 0 or an int in [24, 255], got {v!r}")
        if self.block < 32:
            raise ValueError(f"TopkPlan.block must be at least 32 (a bitmask word), got "
                             f"{self.block!r}")
        if self.fused_block < 32:
            raise ValueError(f"TopkPlan.fused_block must be at least 32 (a bitmask word), got "
                             f"{self.fused_block!r}")
        for name in ("stages", "programs_per_sm", "fused_stages", "fused_parts",
                     "fused_min_parts", "two_chunk", "many_rows_per_sm", "sample_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TopkPlan.{name} must be an int >= 1, got {v!r}")

    def sample_runs_for(self, W: int, topk: int) -> int:
        """The estimate's runs in rows of up to ``W`` keys: the fewest (a power of two, at
        least 2) at which the ``topk``-th key's expected rank in the sample reaches
        ``sample_rank``, at most ``sample_runs`` (k = 2048: 1024 runs at 128K keys, 256 at 32K;
        H200, oversample 1.1: 2048 x 32K 244 against 277 us with 1024 runs, 256 x 32K 42.3
        against 48.0; at 128K fewer runs were slower)."""
        want = triton.cdiv(self.sample_rank * max(W, 1), topk * self.sample_run)
        return max(2, min(self.sample_runs, next_pow2(want)))

    def route_for(self, R: int, W: int, device: torch.device, topk: int) -> str:
        """The route a call of ``R`` rows of ``W`` keys, ``topk`` of each, takes: ``route``,
        or for ``"auto"`` two launches for rows longer than the list where they fit one part
        of them (``W <= two_chunk``) and outnumber the SMs (H200, 32K keys: 39.7 against 45.8
        us at 192 rows; one launch 31.2 against 32.6 at 128, 29.6 against 30.5 at 80), or
        where they are many (more than ``many_rows_per_sm`` a SM); else one launch."""
        if self.route != "auto":
            return self.route
        sms = num_sms(device)
        if W > CANDIDATES and ((W <= self.two_chunk and R > sms)
                               or R > self.many_rows_per_sm * sms):
            return "two"
        return "one"


DEFAULT_PLAN = TopkPlan()  # built once: its checks are a few microseconds of host a call


def sample_columns(n: int, runs: int = 1024, run: int = 8) -> torch.Tensor:
    """The columns (from the row's start) that the estimate samples in a row of ``n`` keys
    (``TopkPlan.sample_runs_for``, ``sample_run``): ``runs`` runs of ``run``, evenly spaced from 0
    (the last ends less than ``runs - 1`` keys before the row's end)."""
    first = torch.arange(runs) * ((n - run) // (runs - 1))
    return (first[:, None] + torch.arange(run)[None, :]).flatten()


def top_k_per_row(logits: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor,
                  topk: int, *, validate: bool | None = None,
                  plan: TopkPlan | None = None, max_row_len: int | None = None
                  ) -> torch.Tensor:
    """int32 ``[R, topk]``: per row the highest logits of columns ``[start, end)`` as indices
    ``j - start``, ties to the lower index, then ``-1``: the reference's set, not sorted by
    score (module doc).

    ``logits [R, W]`` float32 (other float dtypes are read as float32, exactly);
    ``validate``: check the ranges within ``[0, W]`` on the host (a sync); ``None``: only when
    no CUDA graph is being captured. Unvalidated, a range is clipped to the row.
    ``max_row_len``: a bound on every row's ``end - start`` known on the host (vLLM passes its
    batch's longest sequence: decode logits are ``max_model_len`` wide, the rows shorter); at
    most ``CANDIDATES``, the rows are held whole whatever the width (``launches``). Validated,
    a longer row is a ``ValueError``; unvalidated, it is still selected exactly, by a slow
    scan of the row. ``plan``:
    the kernels' route and tiling (``TopkPlan()`` by default). ``topk`` at most ``MAX_TOPK``
    and ``W`` at most ``MAX_COLUMNS`` (the kernels' int32 columns), else ``ValueError``.
    """
    check_float("logits", logits, ndim=2)
    R, W = logits.shape
    check_index("row_starts", row_starts, shape=[R])
    check_index("row_ends", row_ends, shape=[R])
    check_same_device(logits=logits, row_starts=row_starts, row_ends=row_ends)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    # the kernels' column loops and places are int32: a wider row, or a topk within a tile of
    # 2^31, would leave keys unseen or loop forever
    if topk > MAX_TOPK:
        raise ValueError(f"topk must be at most {MAX_TOPK} (2^31 - 1025: the output is written "
                         f"in int32-indexed tiles of 1024), got {topk}")
    if W > MAX_COLUMNS:
        raise ValueError(f"logits must have at most {MAX_COLUMNS} columns (2^31 - 1: the "
                         f"kernels' columns are int32), got {W}")
    if plan is not None and not isinstance(plan, TopkPlan):
        raise TypeError(f"plan must be a TopkPlan, got {type(plan).__name__}")
    plan = plan or DEFAULT_PLAN
    if max_row_len is not None and (isinstance(max_row_len, bool)
                                    or not isinstance(max_row_len, int) or max_row_len < 0):
        raise ValueError(f"max_row_len must be None or an int >= 0, got {max_row_len!r}")
    if R and should_validate(validate, logits):
        facts = [row_starts.long().min(), row_ends.long().max()]
        if max_row_len is not None:  # the longest row, in the same host sync
            facts.append((row_ends.long() - row_starts.long()).max())
        lo, hi, *longest = torch.stack(facts).tolist()
        if lo < 0 or hi > W:
            raise ValueError(f"row_starts / row_ends must lie in [0, {W}] (logits' columns), "
                             f"got starts >= {lo}, ends <= {hi}")
        if longest and longest[0] > max_row_len:
            raise ValueError(f"max_row_len is {max_row_len}, but a row has {longest[0]} keys "
                             f"(row_ends - row_starts)")
    out = torch.empty(R, topk, dtype=torch.int32, device=logits.device)
    if R == 0:
        return out
    if logits.dtype == torch.float64:
        raise TypeError("logits must be float32, float16 or bfloat16 for the fast path (a "
                        "float64 row rounded to float32 could gain ties), got float64")
    if logits.dtype != torch.float32:
        logits = logits.float()  # exact
    if W and logits.stride(1) != 1:
        logits = logits.contiguous()
    for launch in launches(logits, row_starts, row_ends, out, topk, plan, max_row_len)[1]:
        launch()
    return out


def launches(logits: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor,
             out: torch.Tensor, topk: int, plan: TopkPlan, max_row_len: int | None = None
             ) -> tuple[torch.Tensor, list[Callable[[], None]]]:
    """The scratch (``[R, work_columns(cap, SMALL)]`` int32, per row: ``_work_row``; ``[R, 0]``
    where the logits are no wider than the list) and the launches, in order, on checked
    arguments (``logits`` float32 with unit column stride), by the route ``plan.route_for``
    picks: one, two (estimate; mark and select, each row's parts
    waiting for its flag in ``ready``) or three (estimate, filter, select);
    ``top_k_per_row`` runs them, the tests read the survivor counts, the benchmarks time each.
    A launch after the first of its shapes and plan calls the compiled kernel directly
    (``mla.fast.launch``). Rows are held whole (``_held_kernel``, one launch) where the logits
    are no wider than ``CANDIDATES``, or where ``max_row_len`` (the caller's bound on every
    row's length) is: then ``BOUNDED``, each row read from its start, a row past the bound
    scanned (a scratch of ``2 * SMALL`` int32 a row)."""
    R, W = logits.shape
    cap = CANDIDATES
    bounded = W > cap and max_row_len is not None and max_row_len <= cap
    held = W <= cap or bounded  # every row held whole: no list, no bitmask
    cols = 0 if held else work_columns(cap, SMALL)
    work = torch.empty(R, cols, dtype=torch.int32, device=logits.device)
    rows = (logits, row_starts, row_ends)
    s_l_r, s_o_r = logits.stride(0), out.stride(0)
    # what fixes every compiled kernel's specialization but the plan (which keys its own)
    key = (plan, W, topk, int_spec(s_l_r), int_spec(s_o_r), row_starts.dtype, row_ends.dtype,
           *(ptr_spec(t) for t in (*rows, work, out)))
    out_block = min(1024, next_pow2(topk))
    if held:  # whatever the route
        hold = max(32, next_pow2(max_row_len if bounded else W))
        in_registers = plan.held_write == "registers"
        check_grid(_GRID_NAME, (R, 1, 1))
        few = torch.empty(R, 2 * SMALL, dtype=torch.int32, device=logits.device) if bounded \
            else out
        args = (*rows, out, few, W, topk, s_l_r, s_o_r, cap, hold, min(plan.select_tile, 1024),
                out_block, in_registers, plan.held_search == "quad",
                plan.held_prefetch and (in_registers or 2 * hold <= cap) and not bounded,
                bounded, plan.select_bits, SMALL)
        regs = _held_regs(plan, R, logits.device, bounded)
        return work, [lambda: _held((key, hold, bool(regs), ptr_spec(few)), (R, 1, 1), args,
                                    num_warps=plan.select_warps, **regs)]
    route = plan.route_for(R, W, logits.device, topk)
    if route == "one":
        return work, [_one_launch(logits, row_starts, row_ends, work, out, topk, plan, key)]
    pdl = _pdl(plan, logits.device)
    # two launches: per row a flag the estimate sets and the row's selecting program clears,
    # so that a row's parts wait for its threshold alone (zeroed here, cleared by each launch)
    row_ready = route == "two"
    # three launches: no flags (stream order), ``work`` stands in for the unused pointer
    ready = torch.zeros(R, dtype=torch.int32, device=logits.device) if row_ready else work
    est_args = (*rows, work, ready, W, topk, s_l_r, float(plan.oversample), cap,
                plan.sample_runs_for(W, topk), plan.sample_run, SMALL, bool(pdl), row_ready,
                plan.estimate_search == "quad")

    def estimate() -> None:
        _estimate((key, row_ready, ptr_spec(ready)), (R, 1, 1), est_args,
                  num_warps=plan.estimate_warps)

    if route == "two":
        return work, [estimate, _two_launches(logits, row_starts, row_ends, work, ready, out,
                                              topk, plan, key, pdl)]
    chunks = max(1, triton.cdiv(plan.programs_per_sm * num_sms(logits.device), R))
    chunk = plan.block * max(1, triton.cdiv(triton.cdiv(W, chunks), plan.block))
    chunks = max(1, triton.cdiv(W, chunk))
    check_grid(_GRID_NAME, (R, chunks, 1))  # the estimate's and select's (R, 1, 1) within it
    # per row the bitmask's words (columns rounded up to whole blocks)
    s_w_r = triton.cdiv(W, plan.block) * plan.block // 32
    words = torch.empty(R, s_w_r, dtype=torch.int32, device=logits.device)
    mask_args = (*rows, work, words, W, s_l_r, s_w_r, chunk, cap, SMALL, plan.block,
                 plan.stages, bool(pdl))
    cap_regs, tile = _capped(plan, R, logits.device)
    select_args = (*rows, work, words, out, W, topk, s_l_r, s_o_r, s_w_r, cap, SMALL,
                   tile, plan.select_bits, out_block, WORD_TILE, plan.select_search == "quad")
    return work, [
        estimate,
        lambda: _mask((key, chunk), (R, chunks, 1), mask_args, num_warps=plan.filter_warps,
                      **pdl),
        lambda: _select((key, *cap_regs.items()), (R, 1, 1), select_args,
                        num_warps=plan.select_warps, **cap_regs)]


def _pdl(plan: TopkPlan, device: torch.device) -> dict:
    """The filter's launch option (``TopkPlan.pdl``): on a GPU of compute capability 9.0 or
    later, ``launch_pdl``; none under the interpreter (which takes no compiler option)."""
    if plan.pdl and not interpreting() and capability(device)[0] >= 9:
        return {"launch_pdl": True}
    return {}


def _one_launch(logits: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor,
                work: torch.Tensor, out: torch.Tensor, topk: int, plan: TopkPlan, key: tuple
                ) -> Callable[[], None]:
    """The one-launch kernel's launch: rows longer than the list split into parts when the
    rows are fewer than the SMs (``TopkPlan.fused_parts``), with the bitmask and, for parts,
    the rows' arrival counts."""
    R, W = logits.shape
    cap, block = CANDIDATES, plan.fused_block
    parts, chunk = fused_parts(plan, R, W, logits.device)
    check_grid(_GRID_NAME, (R, parts, 1))
    s_w_r = triton.cdiv(W, block) * block // 32 if W > cap else 1
    words = torch.empty(R, s_w_r, dtype=torch.int32, device=logits.device)
    # per row the parts arrived and the list's places taken (``_fused_kernel``; zeroed again
    # by the kernel, so that the launch can be repeated)
    sync = torch.zeros(R, 2, dtype=torch.int32, device=logits.device) if parts > 1 else words
    cap_regs, tile = _capped(plan, R * parts, logits.device, plan.fused_warps)
    tile = min(tile, 1024)  # a tile of 2048 spills in this kernel (ptxas allots 128 registers)
    args = (logits, row_starts, row_ends, work, words, sync, out, W, topk, logits.stride(0),
            out.stride(0), s_w_r, chunk, float(plan.oversample),
            plan.sample_runs_for(W, topk),
            plan.sample_run, cap, SMALL, tile, plan.select_bits, block, plan.fused_stages,
            parts > 1, parts > 1 and plan.fused_part_lists, min(1024, next_pow2(topk)),
            WORD_TILE, plan.estimate_search == "quad", plan.select_search == "quad")
    key = (key, chunk, parts > 1, ptr_spec(words), ptr_spec(sync), *cap_regs.items())
    return lambda: _fused(key, (R, parts, 1), args, num_warps=plan.fused_warps, **cap_regs)


def _two_launches(logits: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor,
                  work: torch.Tensor, ready: torch.Tensor, out: torch.Tensor, topk: int,
                  plan: TopkPlan, key: tuple, pdl: dict) -> Callable[[], None]:
    """Two launches' second (``_mark_select_kernel``): rows in parts of ``plan.two_chunk``
    keys (whole ``fused_block`` steps), a row's parts next to each other in the grid."""
    R, W = logits.shape
    block = plan.fused_block
    chunk = block * triton.cdiv(min(plan.two_chunk, max(W, 1)), block)
    parts = triton.cdiv(max(W, 1), chunk)
    check_grid(_GRID_NAME, (parts * R, 1, 1))  # the estimate's (R, 1, 1) within it
    s_w_r = triton.cdiv(W, block) * block // 32 if W > CANDIDATES else 1
    words = torch.empty(R, s_w_r, dtype=torch.int32, device=logits.device)
    many = R > plan.many_rows_per_sm * num_sms(logits.device)
    warps = plan.two_warps if many else plan.fused_warps
    cap_regs, tile = _capped(plan, R * parts, logits.device, warps)
    args = (logits, row_starts, row_ends, work, words, ready, out, W, topk, logits.stride(0),
            out.stride(0), s_w_r, chunk, parts, CANDIDATES, SMALL, min(tile, 1024),
            plan.select_bits, block, plan.fused_stages, min(1024, next_pow2(topk)), WORD_TILE,
            plan.select_search == "quad")
    key = (key, chunk, parts, warps, ptr_spec(words), ptr_spec(ready), *cap_regs.items())
    return lambda: _mark_select(key, (parts * R, 1, 1), args, num_warps=warps, **pdl,
                                **cap_regs)


def fused_parts(plan: TopkPlan, R: int, W: int, device: torch.device) -> tuple[int, int]:
    """The one-launch kernel's parts a row and their chunk of columns (a multiple of
    ``plan.fused_block``): rows longer than the list, no more than the SMs, split over
    ``max(fused_min_parts, SMs // R)`` programs (at most ``fused_parts``); more rows than
    SMs, a program a row."""
    parts = 1
    if W > CANDIDATES:
        sms = num_sms(device)
        parts = max(plan.fused_min_parts if R <= sms else 1, sms // R)
        parts = max(1, min(parts, plan.fused_parts, triton.cdiv(W, plan.fused_block)))
    chunk = plan.fused_block * triton.cdiv(triton.cdiv(max(W, 1), parts), plan.fused_block)
    return triton.cdiv(max(W, 1), chunk), chunk


def _held_regs(plan: TopkPlan, programs: int, device: torch.device, bounded: bool = False
               ) -> dict:
    """The launch option of the kernel that holds rows in registers (``_held_kernel``):
    ``maxnreg`` at ``plan.held_maxnreg`` where their programs outnumber the SMs (and the plan
    caps), else none; ``bounded`` (its scan compiled in), all the registers its warps allow
    (``uncapped``: left to itself ptxas allots it 128 and 128 bytes of stack). The
    interpreter takes no compiler option."""
    if interpreting():
        return {}
    if plan.held_maxnreg and programs > num_sms(device):
        return {"maxnreg": plan.held_maxnreg}
    return uncapped(plan.select_warps) if bounded else {}


def _capped(plan: TopkPlan, programs: int, device: torch.device, warps: int = 0
            ) -> tuple[dict, int]:
    """The selecting kernels' launch option and tile: where their programs outnumber the SMs
    (and the plan caps), ``maxnreg`` and tiles of at most 1024 keys (no spill under the cap);
    else, for the one- and two-launch kernels (``warps`` a program), all the registers those
    warps allow (``uncapped``); for the select of three launches (``warps`` 0), no option.
    The interpreter takes no compiler option."""
    if interpreting():
        return {}, plan.select_tile
    if plan.select_maxnreg and programs > num_sms(device):
        return {"maxnreg": plan.select_maxnreg}, min(plan.select_tile, 1024)
    return (uncapped(warps) if warps else {}), plan.select_tile


def survivors(work: torch.Tensor) -> torch.Tensor:
    """The survivor count of each row after the streaming read (``launches``' scratch): more
    than ``topk`` and at most the list's length, the candidates were selected; otherwise the
    row was scanned. Rows of no more than the list's length are never filtered: where every
    row is (no scratch), zeros."""
    if work.shape[1] == 0:
        return torch.zeros(work.shape[0], dtype=torch.int32, device=work.device)
    return work[:, count_column(CANDIDATES, SMALL)]
