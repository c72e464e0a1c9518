"""Cases of DeepSeek-V4's layer stages around the attention (conventions §15): the output stage
(``v4_output``) and the indexer's top-k over the compressed entries (``v4_indexer_topk``), with
the kernel-level contracts of ``mla.reference.v4.kernels`` (its module doc says every rule):

    v4_output(attn, positions, cos_sin, wo_a, wo_b) -> out bf16 [T, hidden]
    v4_indexer_topk(q_fp8, weights, k_cache, block_table, positions, topk) -> int32 [T, topk]

Inputs have fixed dtypes whatever the setting's, as the serving path hands them over: ``attn``
and the weights bf16, ``cos_sin`` float32 (DeepSeek-V4's compressed layers' table over 8192
positions); the indexer's q as e4m3 codes with float32 folded weights, its keys the 132-byte
records ``v4_compress`` stores for ``d = 128`` (bf16 keys, e4m3 with a power-of-two scale),
pages of 64 entries (256 tokens) handed out scrambled.

**v4_output** (``out_rel`` against the reference's bf16 ``out``; widths narrowed from
DeepSeek-V4-Flash's ``R = 1024``, hidden 4096 to ``R = 64``, hidden 256; its 64 heads in 8
groups kept, so ``wo_a``'s dot is 4096 long). A correct kernel rounds ``o``, ``z`` and ``out`` to
bf16 where the reference does, but from its own float32 sums: where one of those lay within its
float32 error (``~2^-24·sqrt(K)`` relative) of a bf16 rounding boundary, the stored value is one
ulp (``2^-8`` to ``2^-7`` relative) away from the reference's, and a flipped ``z`` moves ``out``
before its own rounding. So the error is a count of one-ulp flips of ``out``'s elements (about
one in 4000 here), not a smooth rounding error, and its size is set by the largest elements:
the limit is ``output_limit``, ``2·sqrt(1 + n/4096)·ulp(max|out|) / ‖out‖`` for ``n`` elements
(two ulps of the largest element over the output's norm, the flips growing as the square root
of their count): 1.4e-3 on the cases of 2048 elements, 3.4e-3 on the one token's 256. Measured
over 30 seeds of the 7 cases: ``mla.fast`` (float32 under the interpreter) reaches 0.30 of it,
a float32 emulation of a GPU GEMM's k-loop (16 or 64 products a step into a float32
accumulator) 0.49 and 0.63. A 1 % error is 7 times over it at 2048 elements (3 times on one
token); a kernel keeping ``o`` and ``z`` in float32 (no bf16 between the stages) measures 2.4e-3
to 2.9e-3 and fails the cases of 2048 elements.

**v4_indexer_topk** (``mismatches`` of the selected sets, compared as sets: each row sorted, ``-1``
last). A kernel computes the logits in float32 (or on FP8 tensor cores): where two visible
entries' logits lie within that error of each other at the ``k``-th place, either may be
selected. The case accepts a row that differs from the reference's only there: its set must be
the top-k of some logits within ``TOPK_BAND`` times the logits' budget (``logits_budget_of``, in
the magnitude's measure, ``Σ_h |w_h| · ReLU(q_h · k_j) · k_scale_j``) of the reference's, with
entries whose reference logits are exactly equal (the same key bytes) taken lowest id first. So
the tie rule is held exactly, the ``k``-th place to within the kernels' error, and everything
else (the visible count, a NaN key, the unused entries) exactly. ``TOPK_BAND = 4``: ``mla.fast``
under the interpreter errs by at most 0.014 budgets on any logit of these cases (float32); on a
GPU the FP8 tensor cores' logits measure 0.2 to 0.55 of their budget in the norm (the indexer
cases, ``cases/indexer.py``) and one element a few times that, so 4 budgets is about twice the
worst element expected there (not measured on these cases, for want of a GPU). A wider band
tolerates more swaps at the ``k``-th place but no other difference. Unused cache entries, the entry
still being pooled and the pages past each request hold NaN codes and scales (``0xFF``): a read
past ``(p + 1) // 4`` selects a NaN.

The named differences (``alternatives``): the output without the inverse RoPE, with the forward
one, on NeoX pairs, the heads grouped round-robin, ``o`` and ``z`` not rounded; the lowest logits
chosen, ties to the higher id, ``p // 4 + 1`` or ``p // 4`` visible entries, a NaN key's logit
ranked lowest or 0, the ReLU or the key scales left out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from mla.compare import poison_like
from mla.conformance.cases.common import call_poisoned
from mla.conformance.cases.deepseek_v4_layer import cos_sin_table
from mla.conformance.cases.indexer import as_sets, logits_budget_of
from mla.conformance.catalogue import Setting, Trial, generator, spec_cases
from mla.reference.indexer_cache import (
    INDEX_DIM,
    INDEX_K_BYTES,
    indexer_k_quant_and_cache,
    read_indexer_k_cache,
)
from mla.reference.indexer_logits import quantize_indexer_q, top_k_per_row
from mla.reference.v4.kernels import (
    INDEXER_RATIO,
    v4_indexer_topk_logits,
    v4_output_values,
)

__all__ = ["OutputSpec", "TopkSpec", "output_trial", "topk_trial", "output_limit",
           "accept_near_ties", "TOPICS", "TOPK_BAND", "MAX_POSITION", "PAGE"]

TOPICS = ("output", "output_groups", "output_edges", "indexer_topk", "visible", "skip", "ties",
          "nan_input")
MAX_POSITION = 8192
PAGE = 64  # the indexer key cache's entries a page: 256 tokens at ratio 4
TOPK_BAND = 4.0  # the logits' error per element within TOPK_BAND budgets of the magnitude
_ROPE = 64
Outputs = dict[str, torch.Tensor]


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16)


# ---- v4_output --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OutputSpec:
    tokens: int = 8
    heads: int = 64
    groups: int = 8
    rank: int = 64  # o_lora_rank (DeepSeek-V4's 1024, narrowed)
    hidden: int = 256  # (4096)
    positions: str = "random"  # random (0 and 8191 among them), "zero", "last"
    nan_row: bool = False  # token 1's attention holds a NaN in one head


def output_limit(out: torch.Tensor) -> float:
    """The limit on ``v4_output``'s ``out_rel`` (module doc): ``2·sqrt(1 + n/4096)`` bf16 ulps
    of ``out``'s largest finite element over its norm."""
    x = out.detach().double().cpu()
    x = x[torch.isfinite(x)]
    peak = float(x.abs().max()) if x.numel() else 0.0
    norm = float(torch.linalg.vector_norm(x)) if x.numel() else 0.0
    if peak == 0.0 or norm == 0.0:
        return 2.0 ** -7  # nothing to round: any error is infinite relative to 0
    ulp = 2.0 ** (math.floor(math.log2(peak)) - 7)
    return 2.0 * math.sqrt(1.0 + x.numel() / 4096) * ulp / norm


def _output_inputs(g: torch.Generator, spec: OutputSpec
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    T, H, G, R = spec.tokens, spec.heads, spec.groups, spec.rank
    K = H // G * 512
    attn = torch.randn(T, H, 512, generator=g) * 0.3
    if spec.nan_row and T > 1:
        attn[1, H // 2, 7] = float("nan")
    positions = torch.randint(0, MAX_POSITION, (T,), generator=g)
    positions[:2] = torch.tensor([0, MAX_POSITION - 1])[:T]
    if spec.positions == "zero":
        positions.zero_()
    elif spec.positions == "last":
        positions.fill_(MAX_POSITION - 1)
    wo_a = torch.randn(G * R, K, generator=g) * K ** -0.5
    wo_b = torch.randn(spec.hidden, G * R, generator=g) * (G * R) ** -0.5
    return _bf16(attn), positions, _bf16(wo_a), _bf16(wo_b)


def _rope_as_gptj(x: torch.Tensor, heads_dim: int) -> torch.Tensor:
    """The last 64 of each 512-wide head of ``x`` (``heads_dim`` the head axis' last dim):
    NeoX's rotate-half layout ``(i, i + 32)`` reordered into GPT-J's interleaved pairs."""
    head = x.unflatten(-1, (x.shape[-1] // heads_dim, heads_dim)) if heads_dim != x.shape[-1] \
        else x[..., None, :]
    rope = head[..., heads_dim - _ROPE:]
    inter = torch.stack((rope[..., :_ROPE // 2], rope[..., _ROPE // 2:]), dim=-1).flatten(-2)
    out = torch.cat((head[..., :heads_dim - _ROPE], inter), dim=-1)
    return out.flatten(-2) if heads_dim != x.shape[-1] else out[..., 0, :]


def output_trial(setting: Setting, spec: OutputSpec, salt: int) -> Trial:
    """A trial of ``spec`` (see the module doc)."""
    g = generator(setting, salt)
    attn, positions, wo_a, wo_b = _output_inputs(g, spec)
    cos_sin = cos_sin_table(MAX_POSITION)
    want = v4_output_values(attn, positions, cos_sin, wo_a, wo_b)[2]
    dev = setting.device

    def invoke(fn: Callable) -> Outputs:
        return {"out": call_poisoned(fn, attn.to(dev), positions.to(dev), cos_sin.to(dev),
                                     wo_a.to(dev), wo_b.to(dev))}

    def out(a: torch.Tensor = attn, table: torch.Tensor = cos_sin, w_a: torch.Tensor = wo_a,
            rounded: bool = True) -> Outputs:
        o = v4_output_values(a, positions, table, w_a, wo_b, rounded=rounded)[2]
        return {"out": o if rounded else o.to(torch.bfloat16).double()}

    identity = torch.cat([torch.ones(MAX_POSITION, _ROPE // 2),
                          torch.zeros(MAX_POSITION, _ROPE // 2)], dim=1)
    forward = torch.cat([cos_sin[:, :_ROPE // 2], -cos_sin[:, _ROPE // 2:]], dim=1)
    H, G = spec.heads, spec.groups
    robin = torch.tensor([h for grp in range(G) for h in range(grp, H, G)])
    alts: dict[str, Callable[[], Outputs]] = {
        "no inverse RoPE: the attention's 64 rope dims enter wo_a as they are; the reference "
        "rotates them back by -p at the query's position": lambda: out(table=identity),
        "RoPE applied forward (by +p) to the output; the reference's is the inverse (by -p: "
        "(a, b) -> (a cos + b sin, b cos - a sin))": lambda: out(table=forward),
        "inverse RoPE on NeoX (rotate-half) pairs (i, i + 32); DeepSeek-V4's are GPT-J "
        "(interleaved) pairs": lambda: out(a=_rope_as_gptj(attn, 512),
                                           w_a=_rope_as_gptj(wo_a, 512)),
        "heads grouped round-robin (head h in group h mod G); the reference's group g is the "
        "heads [g·H/G, (g+1)·H/G)": lambda: out(a=attn[:, robin]),
        "o and z kept in float32 (not rounded to bf16 between the stages); the reference "
        "rounds o, z and out as vLLM stores them": lambda: out(rounded=False),
    }
    return Trial(invoke, {"out": want}, {"out": "out_rel"}, alts,
                 limits={"out": output_limit(want)})


_output = spec_cases("v4_output", output_trial)
_output("flash_groups", "output",
        "64 heads in 8 groups of 8 (DeepSeek-V4-Flash's grouping), 8 tokens at positions 0 to "
        "8191: the inverse RoPE at each query's position, wo_a per group over its 8 heads' "
        "4096 values, then wo_b, each rounded to bf16.", OutputSpec(), 1500)
_output("one_head_a_group", "output_groups",
        "Four heads in four groups: each group's wo_a reads one head's 512 values.",
        OutputSpec(heads=4, groups=4), 1501)
_output("one_group", "output_groups",
        "Eight heads in one group: wo_a reads all 4096 values of a token at once.",
        OutputSpec(heads=8, groups=1), 1502)
_output("position_zero", "output_edges",
        "Every token at position 0 (cos 1, sin 0): the inverse RoPE is the identity, the rest "
        "as usual.", OutputSpec(heads=16, groups=2, positions="zero"), 1503)
_output("one_token_last_position", "output_edges",
        "One token at position 8191, the table's last row.",
        OutputSpec(tokens=1, positions="last"), 1504)
_output("no_tokens", "output_edges",
        "No tokens: out is [0, hidden], nothing read.", OutputSpec(tokens=0, heads=8, groups=2),
        1505)
_output("nan_row_stays_in_its_row", "output_edges",
        "A NaN in one head of token 1's attention: that token's out row is NaN, every other "
        "token's is untouched.", OutputSpec(heads=16, groups=2, nan_row=True), 1506)


# ---- v4_indexer_topk --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TopkSpec:
    requests: tuple[tuple[int, int], ...]  # (seq_len after the step, new tokens: the queries)
    topk: int = 16
    heads: int = 64
    values: str = "random"  # random, ties (four distinct keys), nan_key (a visible NaN code)
    unused: str = "nan_page"  # unused block-table entries: a page of NaN, or "-1"


def _topk_inputs(g: torch.Generator, spec: TopkSpec) -> dict[str, torch.Tensor]:
    B = len(spec.requests)
    positions = torch.cat([torch.arange(L - n, L) for L, n in spec.requests]).long()
    req = torch.cat([torch.full((n,), b) for b, (_, n) in enumerate(spec.requests)]).long()
    entries = [L // INDEXER_RATIO for L, _ in spec.requests]  # the entries stored so far
    pages = max(1, max(-(-(e + 1) // PAGE) for e in entries))  # room for the unclosed entry
    nb = B * pages + 1  # the last page: never handed out
    perm = torch.randperm(B * pages, generator=g).view(B, pages).int()
    cache = poison_like(torch.empty(nb, PAGE, INDEX_K_BYTES, dtype=torch.uint8))  # NaN
    for b, e in enumerate(entries):
        if not e:
            continue
        if spec.values == "ties":  # four distinct keys: the k-th place among equal logits
            pool = torch.randn(4, INDEX_DIM, generator=g)
            keys = pool[torch.randint(0, 4, (e,), generator=g)]
        else:
            gain = 2.0 ** torch.randint(-3, 4, (e, 1), generator=g).float()
            keys = torch.randn(e, INDEX_DIM, generator=g) * gain
        ids = torch.arange(e)
        slots = perm[b].long()[ids // PAGE] * PAGE + ids % PAGE
        indexer_k_quant_and_cache(_bf16(keys).float(), cache, slots)
    if spec.values == "nan_key":  # entry 5 of request 0 (seen by all its queries): a NaN code
        cache[int(perm[0, 0])].view(-1)[5 * INDEX_DIM + 17] = 0x7F
    used = [-(-e // PAGE) for e in entries]
    table = perm.clone()
    for b, u in enumerate(used):
        table[b, u:] = -1 if spec.unused == "-1" else nb - 1
    q = torch.randn(positions.shape[0], spec.heads, INDEX_DIM, generator=g)
    w = torch.randn(positions.shape[0], spec.heads, generator=g) * spec.heads ** -0.5
    q8, w8 = quantize_indexer_q(q, w)
    return {"q_fp8": q8.view(torch.uint8), "weights": w8.float(), "k_cache": cache,
            "block_table": table[req].contiguous(), "positions": positions}


def _visible_logits(x: dict[str, torch.Tensor], visible: torch.Tensor, *, relu: bool = True,
                    k_scale: bool = True, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float64 logits ``[T, W]`` of the entries ``j < visible[t]`` (``-inf`` after; an id past
    the stored entries reads the NaN the cache holds there), with the ReLU, the key scales or
    the weights changed as asked."""
    T = visible.shape[0]
    width = max(1, int(visible.max())) if T else 1
    out = torch.full((T, width), float("-inf"), dtype=torch.float64)
    w = (x["weights"] if weights is None else weights).double()
    for t in range(T):
        n = int(visible[t])
        if n == 0:
            continue
        ids = torch.arange(n)
        table = x["block_table"][t].long()
        slots = table[ids // PAGE].clamp(min=0) * PAGE + ids % PAGE
        codes, scale = read_indexer_k_cache(x["k_cache"], slots)
        dots = torch.einsum("hd,nd->hn", x["q_fp8"][t].view(torch.float8_e4m3fn).double(),
                            codes.double())
        if relu:
            dots = torch.where(dots > 0, dots, torch.where(torch.isnan(dots), dots, 0.0))
        row = torch.einsum("h,hn->n", w[t], dots)
        out[t, :n] = row * (scale.double() if k_scale else 1.0)
    return out


def _pick(logits: torch.Tensor, visible: torch.Tensor, topk: int, *, high_ties: bool = False,
          nan_low: bool = False, lowest: bool = False) -> torch.Tensor:
    """``top_k_per_row`` of ``logits`` over ``[0, visible)`` under a tie / NaN / order rule."""
    x = logits.clone()
    cols = torch.arange(x.shape[1])[None, :]
    inside = cols < visible[:, None]
    if nan_low:
        x = torch.where(torch.isnan(x) & inside, float("-inf"), x)
    if lowest:
        x = torch.where(inside, -x, x)
    if high_ties:  # reversed columns: the lower reversed index is the higher id
        flipped = torch.full_like(x, float("-inf"))
        for t in range(x.shape[0]):
            n = int(visible[t])
            flipped[t, :n] = x[t, :n].flip(0)
        ids = top_k_per_row(flipped, torch.zeros_like(visible), visible, topk).long()
        ids = torch.where(ids >= 0, visible[:, None] - 1 - ids, -1)
        return ids.to(torch.int32)
    return top_k_per_row(x, torch.zeros_like(visible), visible, topk)


def accept_near_ties(got: object, want: torch.Tensor, logits: torch.Tensor, band: torch.Tensor,
                     visible: torch.Tensor) -> object:
    """``got`` (sets) with each row that is a top-k of logits within ``band`` of ``logits``
    (exactly equal logits taken lowest id first) replaced by ``want``'s row (the module doc's
    budget); anything not a comparable id tensor is returned as it is."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return got
    out = got.detach().cpu().clone()
    for t in range(out.shape[0]):
        if torch.equal(out[t], want[t]):
            continue
        n, chosen = int(visible[t]), out[t][out[t] >= 0].long()
        k = int((want[t] >= 0).sum())
        if (chosen.numel() != k or chosen.unique().numel() != k
                or (k and (int(chosen.min()) < 0 or int(chosen.max()) >= n))):
            continue
        rest = torch.ones(n, dtype=torch.bool)
        rest[chosen] = False
        left = torch.nonzero(rest).flatten()
        v = torch.nan_to_num(logits[t, :n], nan=math.inf)
        tau = band[t, :n]
        a, b = v[chosen][:, None], v[left][None, :]  # chosen against left out
        tied = (a == b) & (chosen[:, None] > left[None, :])  # an equal, lower id left out
        swapped = (a < b) & (b - a > tau[chosen][:, None] + tau[left][None, :])
        if not (tied.any() or swapped.any()):
            out[t] = want[t]
    return out


def topk_trial(setting: Setting, spec: TopkSpec, salt: int) -> Trial:
    """A trial of ``spec`` (see the module doc)."""
    g = generator(setting, salt)
    x = _topk_inputs(g, spec)
    K = spec.topk
    visible = (x["positions"] + 1) // INDEXER_RATIO
    logits = v4_indexer_topk_logits(x["q_fp8"], x["weights"], x["k_cache"], x["block_table"],
                                    x["positions"])
    want = as_sets(top_k_per_row(logits, torch.zeros_like(visible), visible, K))
    dev = setting.device
    mag = _visible_logits(x, visible, weights=x["weights"].abs())
    band = TOPK_BAND * logits_budget_of(spec.heads, dev) * torch.nan_to_num(mag, nan=0.0,
                                                                            neginf=0.0)

    def invoke(fn: Callable) -> Outputs:
        got = call_poisoned(fn, *(x[k].to(dev) for k in ("q_fp8", "weights", "k_cache",
                                                          "block_table", "positions")), K)
        return {"indices": accept_near_ties(as_sets(got), want, logits, band, visible)}

    def picked(**rule: bool) -> Callable[[], Outputs]:
        return lambda: {"indices": as_sets(_pick(logits, visible, K, **rule))}

    def seen(shift: int, **kw: bool) -> Callable[[], Outputs]:
        def make() -> Outputs:
            vis = (x["positions"] + shift) // INDEXER_RATIO
            return {"indices": as_sets(_pick(_visible_logits(x, vis, **kw), vis, K))}
        return make

    alts: dict[str, Callable[[], Outputs]] = {
        "the lowest logits chosen (the top-k's order inverted)": picked(lowest=True),
        "ties to the higher entry id; the reference's go to the lower id":
            picked(high_ties=True),
        "p // 4 + 1 entries visible (an entry from its block's first token on, reading the "
        "entry still being pooled); the reference's (p + 1) // 4": seen(4),
        "p // 4 entries visible (one short at a block's last token); the reference's "
        "(p + 1) // 4": seen(0),
        "NaN ranked below every number (a NaN key never chosen); the reference ranks it above "
        "+inf": picked(nan_low=True),
        "a NaN key's logit 0 (ReLU as max(x, 0) drops the NaN)": lambda: {
            "indices": as_sets(_pick(torch.nan_to_num(logits, nan=0.0, neginf=-math.inf),
                                     visible, K))},
        "ReLU missing (negative head dots summed)": seen(1, relu=False),
        "k scale ignored (logits of the e4m3 codes)": seen(1, k_scale=False),
    }
    return Trial(invoke, {"indices": want}, {"indices": "mismatches"}, alts)


_topk = spec_cases("v4_indexer_topk", topk_trial)
_topk("decode_rows", "indexer_topk",
      "Three requests decoding at positions 202, 96 and 129 (50, 24 and 32 visible entries, 64 "
      "heads): each row's 16 highest Σ_h w_h · ReLU(q_h · k_j) · k_scale_j, local ids.",
      TopkSpec(((203, 1), (97, 1), (130, 1))), 1600)
_topk("length_not_a_multiple_of_4", "visible",
      "Six queries at positions 66 to 71 (16, 17, 17, 17, 17 and 18 entries): an entry is "
      "visible from its block's last token on, (p + 1) // 4; the entry still being pooled is "
      "NaN in the cache.", TopkSpec(((72, 6),)), 1601)
_topk("single_visible_entry", "visible",
      "Positions 0 to 6: no entry before position 3 (rows all -1), then the single entry 0; "
      "the next is NaN in the cache until position 7.", TopkSpec(((7, 7),)), 1602)
_topk("all_entries_fit", "skip",
      "Every row sees at most top-k entries (vLLM skips the logits and fills 0 .. n - 1): "
      "every visible entry is selected, whatever its logit.",
      TopkSpec(((40, 2), (64, 1), (9, 1))), 1603)
_topk("fit_beside_select", "skip",
      "A row of 5 entries beside rows of 75 that need the top-k: the short row holds all 5, "
      "then -1.", TopkSpec(((300, 1), (20, 1), (301, 2))), 1604)
_topk("ties_to_lower_ids", "ties",
      "Four distinct keys over 40 entries: the k-th place falls among equal logits, which go "
      "to the lowest entry ids.", TopkSpec(((160, 2),), values="ties"), 1605)
_topk("nan_key_is_chosen", "nan_input",
      "A NaN code in a visible key: its logit is NaN, ranked above every number, so every row "
      "that sees it selects it.", TopkSpec(((203, 2), (97, 1)), values="nan_key"), 1606)
_topk("unused_table_entries_minus_one", "nan_input",
      "Block-table entries past each request's entries hold -1: only the visible entries' "
      "pages are read.", TopkSpec(((203, 1), (130, 2)), unused="-1"), 1607)
_topk("v4_widths", "indexer_topk",
      "DeepSeek-V4's top-k 512 over 524 and 525 visible entries (128 of 130 and 131 under "
      "the interpreter), 64 heads.",
      lambda s: TopkSpec(((524, 2),), topk=128) if s.small else TopkSpec(((2100, 2),),
                                                                          topk=512), 1608)
