"""Cases of ``cp_lse_ag_out_rs``: the DCP log-sum-exp correction across ``W`` ranks
(conventions §9, vLLM's name and signature).

Each rank passes its partial attention over its own keys, ``cp_attn_out [T, N, D]`` and
``cp_attn_lse [T, N]`` (all ``N`` heads, natural log), and the communicator; the lse are
all-gathered, each rank scales its output by ``exp(lse_r - lse)`` and the scaled outputs are
reduce-scattered along the heads: rank ``r`` returns heads ``r·N/W .. (r+1)·N/W``,
``out [T, N/W, D]`` and, with ``return_lse=True``, ``lse [T, N/W]``. ``+inf`` and ``-inf``
from a rank mean "no keys" (the decode kernels write ``+inf``, ``attention_with_lse`` writes
``-inf``): that rank weighs 0 and its output is never read; a query no rank saw gets
``out = 0`` and ``lse = -inf``; a NaN lse from any rank makes the query's ``out`` and ``lse``
NaN (§13).

A trial runs the target's kernel on ``W`` simulated ranks (``run_simulated``), each with its
own inputs, and joins the ranks' results along the heads; the expected is the reference's on
the same ranks. Every case but "return_lse" calls with ``return_lse=True``, so the lse is held
to its budget too. The correction has no budget of its own: it does the merge's arithmetic, an
exp-weighted sum in float32 of ``W`` partials and one rounding to the output dtype, so its
trials are held to ``merge_attn_states``' budgets. Only the "empty_*" and "all_empty" topics
and the case "nan_lse_beside_empty_ranks" have ranks without keys, only the "nan" topic a NaN
lse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from mla.compare import budget, rel_err
from mla.conformance.cases.common import DV, call_poisoned
from mla.conformance.cases.merge import LN2, NAN_QUANTITIES, lse_dtype, nan_split
from mla.conformance.catalogue import Setting, Trial, case, generator, spec_cases
from mla.reference.dcp.comm import Communicator, run_simulated
from mla.reference.dcp.decode import cp_lse_ag_out_rs

__all__ = ["DcpSpec", "dcp_trial"]

KERNEL = "cp_lse_ag_out_rs"
INF = float("inf")
Outputs = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class DcpSpec:
    world: int
    tokens: int
    heads: int = 16
    d: int = DV
    lse_spread: float = 2.0  # each rank's lse: 4 + uniform(-spread, spread)
    gap: float = 0.0  # one rank, chosen per (token, head), this much above the others
    empty: float = 0.0  # chance that a rank holds no key of a token (one rank always does)
    all_empty: float = 0.0  # chance that no rank holds a key of a token
    markers: tuple[float, ...] = (INF,)  # the lse of a rank without keys
    garbage: str = "nan"  # what such a rank's output holds: "nan", "zero" (the decode's
    # out = 0) or "random" (anything: finite values 100 times the size of the others)
    short: bool = False  # token t's context has t + 1 keys: ranks r > t hold none
    return_lse: bool = True
    nan: bool = False  # a NaN lse from one rank on a quarter of the (token, head) pairs


def _inputs(spec: DcpSpec, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``outs [W, T, N, D]`` and ``lses [W, T, N]`` on the CPU (see the module doc)."""
    W, T, N = spec.world, spec.tokens, spec.heads
    outs = torch.randn(W, T, N, spec.d, generator=g, dtype=torch.float64)
    lses = 4.0 + spec.lse_spread * (torch.rand(W, T, N, generator=g, dtype=torch.float64) * 2 - 1)
    top = torch.randint(W, (T, N), generator=g)
    lses += spec.gap * (torch.arange(W)[:, None, None] == top)
    # which ranks hold no key of token t (per token: every head sees the same keys)
    empty = torch.rand(W, T, generator=g) < spec.empty
    keeper = torch.randint(W, (T,), generator=g)
    empty[keeper, torch.arange(T)] = False
    empty |= (torch.rand(T, generator=g) < spec.all_empty)[None, :]
    if spec.short:
        empty = torch.arange(W)[:, None] > torch.arange(T)[None, :]
    markers = torch.tensor(spec.markers, dtype=torch.float64)
    pick = markers[torch.randint(len(markers), (W, T, N), generator=g)]
    rows = empty[..., None].expand(W, T, N)
    lses[rows] = pick[rows]
    garbage = {"nan": torch.full_like(outs, float("nan")), "zero": torch.zeros_like(outs),
               "random": 100 * torch.randn(outs.shape, generator=g, dtype=torch.float64)}
    outs = torch.where(rows[..., None], garbage[spec.garbage], outs)
    if spec.nan:
        poisoned = torch.rand(T, N, generator=g) < 0.25
        lses[torch.randint(W, (T, N), generator=g)[poisoned], poisoned] = float("nan")
    return outs, lses


def _join(results: Sequence[object], with_lse: bool) -> Outputs:
    """The ranks' results joined along the heads (rank r returned heads r·N/W..)."""
    if not with_lse:
        if not all(isinstance(x, torch.Tensor) for x in results):
            raise TypeError(f"with return_lse=False each rank must return the out tensor, rank "
                            f"0 returned {type(results[0]).__name__}")
        return {"out": torch.cat(list(results), dim=1)}  # type: ignore[arg-type]
    if not all(isinstance(x, (tuple, list)) and len(x) == 2 for x in results):
        raise TypeError(f"with return_lse=True each rank must return (out, lse), rank 0 "
                        f"returned {type(results[0]).__name__}")
    return {"out": torch.cat([x[0] for x in results], dim=1),  # type: ignore[index]
            "lse": torch.cat([x[1] for x in results], dim=1)}  # type: ignore[index]


def _on_ranks(fn: Callable, outs: torch.Tensor, lses: torch.Tensor, with_lse: bool) -> Outputs:
    """``fn`` on ``W`` simulated ranks, rank ``r`` with ``outs[r]``, ``lses[r]``; joined."""

    def rank(comm: Communicator) -> object:
        return fn(outs[comm.rank], lses[comm.rank], comm, return_lse=with_lse)

    return _join(call_poisoned(run_simulated, outs.shape[0], rank), with_lse)  # type: ignore[arg-type]


def _ref(outs: torch.Tensor, lses: torch.Tensor, with_lse: bool = True) -> Outputs:
    return _on_ranks(cp_lse_ag_out_rs, outs, lses, with_lse)


def _nan_at(expected: Outputs, rows: torch.Tensor, lse: bool = True) -> Outputs:
    """``expected`` with NaN in ``out`` (and ``lse``) at ``rows [T, N]``."""
    alt = {"out": expected["out"].masked_fill(rows[..., None], float("nan"))}
    if "lse" in expected:
        alt["lse"] = expected["lse"].masked_fill(rows, float("nan")) if lse else expected["lse"]
    return alt


def _alternatives(setting: Setting, outs: torch.Tensor, lses: torch.Tensor, expected: Outputs
                  ) -> dict[str, Callable[[], Outputs]]:
    """What a kernel under another known convention returns on these inputs (float64)."""
    with_lse = "lse" in expected
    empty = torch.isinf(lses)  # [W, T, N]
    full = _ref(outs, lses) if not with_lse else expected  # with the combined lse

    def base2() -> Outputs:
        r = _ref(outs, lses * LN2, with_lse)
        return {**r, "lse": r["lse"] / LN2} if with_lse else r

    def weighted_one() -> Outputs:
        unscaled = torch.where(empty[..., None], outs, 0.0).sum(dim=0)
        return {**expected, "out": expected["out"] + unscaled}

    def rounded_partials(nan_dropped: bool = False) -> Outputs:
        """bf16 partials; with ``nan_dropped``, a NaN lse also read as "no keys" (vLLM's
        ``correct_attn_cp_out_kernel`` maps NaN to -inf before it combines)."""
        ls = lses.nan_to_num(nan=-INF, posinf=INF, neginf=-INF) if nan_dropped else lses
        comb = _ref(outs, ls) if nan_dropped else full
        lse = comb["lse"].masked_fill(torch.isneginf(comb["lse"]), 0.0)
        w = torch.where(torch.isinf(ls) | nan_dropped * torch.isnan(ls), 0.0,
                        torch.exp(ls - lse))[..., None]
        parts = torch.where(w > 0, outs * w, 0.0).to(setting.dtype)
        total = parts[0]
        for p in parts[1:]:  # the reduce-scatter adds in that dtype, in rank order
            total = total + p
        if nan_dropped:
            return {"out": total.double(), **({"lse": comb["lse"]} if with_lse else {})}
        return {**expected, "out": total.double()}

    none = empty.all(dim=0)  # [T, N]: no rank saw a key
    alts: dict[str, Callable[[], Outputs]] = {
        "lse read as base 2 (weights 2^(lse_r - lse)); the reference's is the natural log "
        "(vLLM PR #47079)": base2,
        "a rank's +inf lse read as a real lse (only -inf taken for 'no keys'): the query's out "
        "and lse come out NaN": lambda: _nan_at(expected, torch.isposinf(lses).any(dim=0)),
        "a rank without keys weighted 1: its output added unscaled (it must add nothing)":
            weighted_one,
        "a query no rank saw gets lse +inf (the decode's marker); cp_lse_ag_out_rs gives "
        "-inf": lambda: {**expected, "lse": expected["lse"].masked_fill(none, INF)}
        if with_lse else expected,
        "a query no rank saw gets NaN (0/0); the reference gives out 0, lse -inf": (
            lambda: _nan_at(expected, none)),
        "a NaN lse read as 'no keys' (the rank dropped); NaN must stay NaN": lambda: _ref(
            outs, lses.nan_to_num(nan=-INF, posinf=INF, neginf=-INF), with_lse)}
    if setting.dtype not in (torch.float32, torch.float64):
        name = str(setting.dtype).removeprefix("torch.")
        alts[f"each rank's scaled output rounded to {name} and the reduce-scatter summing "
             f"in {name} ({name} partials); the sum should run in float32"] = rounded_partials
        if bool(torch.isnan(lses).any()):  # both at once: vLLM's, where several ranks add
            alts[f"a NaN lse read as 'no keys' (the rank dropped: out and lse finite where "
                 f"they must be NaN), and each rank's scaled output rounded to {name} with "
                 f"the reduce-scatter summing in {name}; NaN must stay NaN and the sum should "
                 "run in float32"] = lambda: rounded_partials(nan_dropped=True)
    return alts


def _float32_out_limit(outs: torch.Tensor, lses: torch.Tensor, expected: Outputs,
                       spec: DcpSpec) -> float:
    """The float32 ``out`` limit: the merge's budget, or twice the reference's own float32
    error on these inputs where that is larger.

    Below float32 the output's one rounding dominates and the merge's budget applies as it is.
    In float32 the correction pays what the merge does not: it scales by ``exp(lse_r - lse)``
    with the combined ``lse`` rounded to float32, so every weight of a query moves by the
    same ``u·|lse|`` (about 3e-7 for an lse of 5), where the merge normalizes by ``w_p + w_s``
    and the rounding cancels; the reference measures 1.3e-7 where the merge's float32 budget
    is 7.5e-8."""
    own = _ref(outs, lses, spec.return_lse)
    keep = ~torch.isnan(lses.double()).any(dim=0)[..., None].expand_as(own["out"])
    err = rel_err(own["out"][keep].double(), expected["out"][keep])
    return max(budget("merge_attn_states", torch.float32, "out_rel"), 2 * err)


def dcp_trial(setting: Setting, spec: DcpSpec, salt: int) -> Trial:
    """A trial of ``spec``: inputs in the setting's dtypes, the reference on upcast copies."""
    return _trial_of(setting, spec, *_inputs(spec, generator(setting, salt)))


def _trial_of(setting: Setting, spec: DcpSpec, outs: torch.Tensor, lses: torch.Tensor
              ) -> Trial:
    """The trial of the float64 inputs ``outs [W, T, N, D]``, ``lses [W, T, N]``."""
    outs, lses = outs.to(setting.dtype), lses.to(lse_dtype(setting))
    outs64, lses64 = outs.double(), lses.double()  # the kernel's inputs, exactly
    dev_outs, dev_lses = outs.to(setting.device), lses.to(setting.device)
    expected = _ref(outs64, lses64, spec.return_lse)
    alts = _alternatives(setting, outs64, lses64, expected)

    def invoke(fn: Callable) -> Outputs:
        return _on_ranks(fn, dev_outs, dev_lses, spec.return_lse)

    quantities = {"out": "out_rel", "lse": "lse_abs"} if spec.return_lse else {"out": "out_rel"}
    limits = {}
    if setting.dtype == torch.float32:
        limits["out"] = _float32_out_limit(outs.cpu(), lses.cpu(), expected, spec)
    if not spec.nan:
        return Trial(invoke, expected, quantities, alts, budget_kernel="merge_attn_states",
                     limits=limits)
    nan_rows = torch.isnan(lses64).any(dim=0)  # [T, N]

    def split(make: Callable[[], Outputs]) -> Callable[[], Outputs]:
        return lambda: nan_split(make(), nan_rows, lse_rows_first=True)

    return Trial(lambda fn: nan_split(invoke(fn), nan_rows, lse_rows_first=True),
                 split(lambda: expected)(), dict(NAN_QUANTITIES),
                 {why: split(make) for why, make in alts.items()},
                 budget_kernel="merge_attn_states", limits=limits)


_register = spec_cases(KERNEL, dcp_trial)

# ---- rank and head counts -------------------------------------------------------------------
_register("ranks_2", "ranks",
          "2 ranks, 16 heads of latent width 512: each rank keeps 8 heads of the exact "
          "combination.",
          lambda s: DcpSpec(2, 5), 600)
_register("ranks_4", "ranks",
          "4 ranks, 16 heads (4 per rank), 9 tokens.",
          lambda s: DcpSpec(4, 9), 601)
_register("ranks_8_heads_128", "ranks",
          "8 ranks with DeepSeek-V3's 128 heads (16 per rank).",
          lambda s: DcpSpec(8, 3, heads=128), 602)
# ---- the lse base ---------------------------------------------------------------------------
_register("lse_base_natural", "lse_base",
          "The lse is the natural log: ranks up to 6 apart weigh exp(lse_r - lse), not "
          "2^(lse_r - lse) (vLLM PR #47079 combined FlashInfer's base-2 lse as natural).",
          lambda s: DcpSpec(4, 8, lse_spread=3.0), 605)
# ---- ranks without keys ---------------------------------------------------------------------
_register("empty_ranks_plus_inf", "empty_plus_inf",
          "Ranks without keys for a token (lse +inf, output NaN) beside ranks with keys: they "
          "weigh 0 and their output is never read.",
          lambda s: DcpSpec(4, 12, empty=0.4, markers=(INF,), garbage="nan"), 610)
_register("short_context_plus_inf", "empty_plus_inf",
          "Contexts of 1..8 tokens on 8 ranks: ranks r >= L hold no key (lse +inf, out 0, as "
          "the decode kernels give them).",
          lambda s: DcpSpec(8, 8, short=True, markers=(INF,), garbage="zero"), 611)
_register("empty_ranks_minus_inf", "empty_minus_inf",
          "Ranks without keys for a token (lse -inf, output finite garbage) beside ranks with "
          "keys: they weigh 0 and add nothing.",
          lambda s: DcpSpec(4, 12, empty=0.4, markers=(-INF,), garbage="random"), 612)
_register("all_ranks_empty", "all_empty",
          "Tokens no rank holds a key of (+inf and -inf mixed): out 0 and lse -inf, never NaN.",
          lambda s: DcpSpec(4, 10, empty=0.3, all_empty=0.4, markers=(INF, -INF)), 620)
# ---- return_lse -----------------------------------------------------------------------------
_register("return_lse_false", "return_lse",
          "return_lse=False: each rank returns its heads' out alone, not a tuple.",
          lambda s: DcpSpec(2, 5, return_lse=False), 630)
# ---- numerics -------------------------------------------------------------------------------
_register("dominant_rank", "numerics",
          "One rank's lse 120 above the others': their weights underflow in float32 and add "
          "nothing, the dominant rank's output passes.",
          lambda s: DcpSpec(4, 8, gap=120.0), 640)
# ---- NaN ------------------------------------------------------------------------------------
_register("nan_lse_is_not_empty", "nan",
          "A NaN lse from one rank makes that (token, head)'s out and lse NaN, never a rank "
          "dropped as if it had no keys (conventions §13).",
          lambda s: DcpSpec(4, 8, nan=True), 650)
_register("nan_lse_beside_ranks_with_keys", "nan",
          "A NaN lse from one rank where all 8 ranks hold keys: out and lse NaN there, never "
          "the other ranks' sum, and elsewhere the 8 partials summed in float32 (vLLM drops the "
          "NaN rank and sums bf16 partials).",
          lambda s: DcpSpec(8, 4, heads=16, d=128, nan=True), 652)


def _nan_beside_empty_trial(setting: Setting) -> Trial:
    """``nan_lse_beside_empty_ranks``: tokens no rank holds a key of, each of their heads with
    a NaN lse on one rank (so that no query is empty on every rank but one holding NaN); and
    the answer of a kernel whose max ignores NaN, which finds no rank with keys there."""
    spec = DcpSpec(4, 12, all_empty=0.5, markers=(INF, -INF), nan=True)
    g = generator(setting, 651)
    outs, lses = _inputs(dataclasses.replace(spec, nan=False), g)
    W, T, N = lses.shape
    alone = torch.isinf(lses).all(dim=0)  # [T, N]
    rank = torch.randint(W, (T, N), generator=g)
    lses[rank[alone], alone] = float("nan")
    trial = _trial_of(setting, spec, outs, lses)
    outs64 = outs.to(setting.dtype).double()
    lses64 = lses.to(lse_dtype(setting)).double()
    lost = torch.where(alone[None], -INF, lses64)
    trial.alternatives = {
        "a NaN lse read as 'no keys' where every other rank is empty (a max that ignores NaN "
        "finds no rank with keys: out 0, lse -inf); NaN must stay NaN": lambda: nan_split(
            _ref(outs64, lost), alone, lse_rows_first=True),
        **trial.alternatives}
    return trial


case(KERNEL, "nan", name="nan_lse_beside_empty_ranks",
     doc="A NaN lse from one rank on tokens no other rank holds a key of (+inf and -inf "
         "mixed): the NaN stays, out and lse NaN, never the empty query's out 0 and lse -inf "
         "(conventions §13).")(_nan_beside_empty_trial)
