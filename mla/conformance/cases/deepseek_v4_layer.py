"""Cases of DeepSeek-V4's layer kernels (conventions §15): the compressor's cache records
(``v4_compress``), the indexer's q (``v4_indexer_q``) and the scopes' indices
(``v4_scope_indices``), with the kernel-level contracts of ``mla.reference.v4.kernels`` and
``mla.reference.v4.scopes`` (their module docs say every rule):

    v4_compress(kv, score, state_kv, state_score, positions, norm_weight, cos_sin, ratio,
                rms_norm_eps) -> uint8 [m, 584] (d = 512, MODEL1) | [m, 132] (d = 128)
    v4_indexer_q(q, weights, positions, cos_sin, softmax_scale, head_scale)
                -> (q_fp8 uint8 [T, H, 128], weights_out float32 [T, H])
    v4_scope_indices(positions, token_to_req, seq_lens, window_table, compressed_table, topk,
                     ratio, window, path) -> decode: (indices, lengths, extra_indices,
                     extra_lengths); prefill: (indices, lengths), int32

Inputs have fixed dtypes whatever the setting's (``kv``, ``score``, the state and ``cos_sin``
float32; ``q``, the weights and ``norm_weight`` bf16), as the serving path hands them over.

``v4_compress``: one request's tokens at positions ``0 .. L-1`` fed in the case's steps (one
prefill, uneven chunks, or token by token); each call gets the new tokens' fp32 ``kv`` and
``score`` (``ape`` added) and the state of the ``coff·r`` positions before them (rows of
positions below 0 hold NaN, or NaN and ``+inf`` scores: they are masked, never read), and
returns the records of the entries whose window closes among them; the records of all steps,
in order, are compared with the reference's of one prefill. Inputs are bf16 numbers (their fp32
sums exact), the norm weight bf16, the RoPE table fp32 (DeepSeek-V4's compressed layers').

Budgets. The records' layout, scales' floor, pad byte and roundings are fixed by the conventions:
every byte is held exactly, except where the kernel's fp32 arithmetic may legitimately land on
the other side of a rounding boundary. For those, the case computes the records of the exact
entries moved by ``±ε`` toward and away from zero (``ε = (coff·r + 8)·2^-22 · amax`` of the
entry: an fp32 rounding of ``2^-24`` per term of the window's softmax-weighted sum and of the
norm and rotation, four times over for the norm's gain), and a byte equal to one of those two
records where they differ from the reference's counts as the reference's. Everything else, a
single byte included, is a mismatch. ``v4_indexer_q``: the codes likewise (``ε = 2^-21 ·
amax`` of the head's rotated half: one product and one sum in fp32; the unrotated half is
exact), the folded weights within ``2^-22`` relative (Frobenius): two fp32 roundings of
``2^-24`` each, doubled. ``v4_scope_indices``: every index exact, order included.

The named differences (``alternatives``): a ratio-4 compressor without the overlap (its own 4
tokens only), RoPE at the block's last position, the other UE8M0 floor, masked positions read;
q's rope on NeoX pairs, not rounded to bf16 before quantizing, weights without q's scale; the
window one token short, the top-k ids not put valid first, ``p // 128`` visible entries instead
of ``(p + 1) // 128``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from mla.conformance.cases.common import call_poisoned
from mla.conformance.catalogue import Setting, Trial, generator, spec_cases
from mla.reference.v4.config import get_v4_config
from mla.reference.v4.kernels import (
    compress_entries,
    compress_records,
    indexer_q_records,
    indexer_q_values,
    v4_indexer_q,
)
from mla.reference.v4.rope import v4_rope_frequencies
from mla.reference.v4.scopes import (
    COMPRESSED_PAGE_TOKENS,
    decode_scope_indices,
    paged_slots,
    v4_scope_indices,
)

__all__ = ["CompressSpec", "IndexerQSpec", "ScopeSpec", "compress_trial", "indexer_q_trial",
           "scope_trial", "cos_sin_table", "TOPICS", "WEIGHTS_LIMIT"]

TOPICS = ("compress_lengths", "compress_steps", "compress_sharp", "ue8m0_floor", "masked_nan",
          "indexer_q", "q_scale_floor", "window", "mtp", "compressed_scope", "pages", "prefill")
_CONFIG = get_v4_config("deepseek-v4")
WINDOW = _CONFIG.sliding_window  # 128
EPS = _CONFIG.rms_norm_eps
WEIGHTS_LIMIT = 2.0 ** -22  # the folded weights: two fp32 roundings, doubled
Outputs = dict[str, torch.Tensor]


def cos_sin_table(rows: int, ratio: int = 4) -> torch.Tensor:
    """fp32 ``[rows, 64]``: the cosines of DeepSeek-V4's compressed layers' 32 angles at each
    position, then their sines (vLLM's ``cos_sin_cache``)."""
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * v4_rope_frequencies(_CONFIG,
                                                                                    ratio)
    return torch.cat([angles.cos(), angles.sin()], dim=1).float()


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _accept_boundary(got: object, ref: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
                     ) -> object:
    """``got`` with the bytes equal to ``lo``'s or ``hi``'s where those differ from ``ref``
    replaced by ``ref``'s (the module doc's budget); anything not a comparable byte tensor is
    returned as it is."""
    if not isinstance(got, torch.Tensor) or got.shape != ref.shape or got.dtype != ref.dtype:
        return got
    g = got.detach().cpu()
    edge = ((lo != ref) & (g == lo)) | ((hi != ref) & (g == hi))
    return torch.where(edge, ref, g)


def _nudged(x: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` moved by ``eps`` toward zero and away from it."""
    s = torch.sign(x)
    return x - s * eps, x + s * eps


# ---- v4_compress ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CompressSpec:
    d: int  # 512 (MODEL1 records) or 128 (the indexer's)
    ratio: int  # 4 (overlapping) or 128
    steps: tuple[int, ...]  # the step sizes feeding positions 0 .. sum - 1
    values: str = "random"  # random, sharp, floors, floor_1e-4
    masked: str = "nan"  # rows of positions < 0: "nan", or "nan_inf" (kv NaN, score +inf)


def _compress_inputs(g: torch.Generator, spec: CompressSpec
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, r = spec.d, spec.ratio
    coff = 2 if r == 4 else 1
    L, width = sum(spec.steps), coff * spec.d
    kv = _bf16(torch.randn(L, width, generator=g))
    ape = _bf16(torch.randn(r, width, generator=g))
    score = _bf16(torch.randn(L, width, generator=g)) + ape[torch.arange(L) % r]
    norm = 1.0 + 0.1 * torch.randn(d, generator=g)
    if spec.values == "sharp":  # one winner per (entry, channel) among its window's slots
        score = torch.full((L, width), -100.0)
        W = coff * r
        for j in range(L // r):
            slots = torch.arange(W) + j * r + r - W  # window positions
            allowed = slots >= 0
            for e in range(d):
                choice = torch.nonzero(allowed).flatten()
                w = int(choice[torch.randint(0, choice.numel(), (1,), generator=g)])
                col = e + (d if coff == 2 and w >= r else 0)
                score[int(slots[w]), col] = 0.0
    elif spec.values == "floors" and d == 512:  # tiles whose amax lies below both floors
        for tile, f in ((4, 2.0 ** -16), (5, 2.0 ** -7), (6, 2.0 ** -12)):
            norm[tile * 64:(tile + 1) * 64] *= f
    elif spec.values == "floors":
        norm *= 2.0 ** -9
    elif spec.values == "floor_1e-4":
        norm *= 2.0 ** -16
    return kv, score, norm.to(torch.bfloat16)


def _state(kv: torch.Tensor, score: torch.Tensor, start: int, rows: int, masked: str
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``rows`` positions before ``start``; those below 0 hold the masked fill."""
    pos = torch.arange(start - rows, start)
    ok = pos >= 0
    fill_s = float("inf") if masked == "nan_inf" else float("nan")
    skv = torch.full((rows, kv.shape[1]), float("nan"))
    ss = torch.full((rows, kv.shape[1]), fill_s)
    skv[ok], ss[ok] = kv[pos[ok]], score[pos[ok]]
    return skv, ss


def compress_trial(setting: Setting, spec: CompressSpec, salt: int) -> Trial:
    """A trial of ``spec`` (see the module doc)."""
    g = generator(setting, salt)
    kv, score, norm = _compress_inputs(g, spec)
    r, L = spec.ratio, sum(spec.steps)
    coff = 2 if r == 4 else 1
    cos_sin = cos_sin_table(L + r)
    dev = setting.device

    def entries(**variant: object) -> torch.Tensor:
        skv, ss = _state(kv, score, 0, coff * r, spec.masked)
        return compress_entries(kv, score, skv, ss, torch.arange(L), norm, cos_sin, r, EPS,
                                **variant)  # type: ignore[arg-type]

    exact = entries()
    ref = compress_records(exact)
    amax = exact.abs().amax(dim=1, keepdim=True) if exact.numel() else exact[:, :1]
    lo, hi = (compress_records(e) for e in _nudged(exact, (coff * r + 8) * 2.0 ** -22 * amax))

    def invoke(fn: Callable) -> Outputs:
        out, start = [], 0
        for n in spec.steps:
            skv, ss = _state(kv, score, start, coff * r, spec.masked)
            rec = call_poisoned(fn, kv[start:start + n].to(dev), score[start:start + n].to(dev),
                                skv.to(dev), ss.to(dev), torch.arange(start, start + n,
                                                                      device=dev),
                                norm.to(dev), cos_sin.to(dev), r, EPS)
            if not isinstance(rec, torch.Tensor):
                return {"entries": rec}
            out.append(rec.detach().cpu())
            start += n
        got = torch.cat(out) if out else ref[:0]
        return {"entries": _accept_boundary(got, ref, lo, hi)}

    alts: dict[str, Callable[[], Outputs]] = {
        "RoPE at the block's last position j·r + r - 1; the reference rotates an entry at its "
        "block's first position j·r": lambda: {"entries": compress_records(
            entries(rope_at="last"))},
        "window positions below 0 read (their NaN leaks into the entry) instead of masked: "
        "masked slots must be replaced (score -inf, kv 0), never multiplied by 0":
            lambda: {"entries": compress_records(entries(read_masked=True))},
    }
    if spec.d == 512:
        alts["the other UE8M0 floor, 2^ceil(log2(max(amax/448, 1e-4))) (vLLM's CuTe-DSL "
             "kernels, FlashMLA); vLLM's Triton kernels' is 2^ceil(log2(max(amax, 1e-4)/448))"
             ] = lambda: {"entries": compress_records(exact, scale_floor="flashmla")}
    else:
        alts["the scale floored at 1e-4 after dividing by 448 (max(amax/448, 1e-4)); the "
             "indexer cache's is max(amax, 1e-4)/448"] = lambda: {
                 "entries": compress_records(exact, scale_floor="flashmla")}
    if r == 4:
        alts["no overlap: a ratio-4 entry pooled its own 4 tokens only (channels [0, d)); "
             "the reference pools the previous block through [0, d) and its own through "
             "[d, 2d)"] = lambda: {"entries": compress_records(entries(overlap=False))}
    # an alternative is seen through the same budget as the kernel's output
    seen = {why: (lambda make=make: {"entries": _accept_boundary(make()["entries"], ref, lo,
                                                                 hi)})
            for why, make in alts.items()}
    return Trial(invoke, {"entries": ref}, {"entries": "mismatches"}, seen)


def _steps(kind: str, length: int, ratio: int) -> tuple[int, ...]:
    if kind == "prefill":
        return (length,)
    if kind == "tokens":
        return (1,) * length
    if kind == "tail":  # a prefill, then token by token across the next boundary
        head = max(0, length - ratio // 2 - 3)
        return ((head,) if head else ()) + (1,) * (length - head)
    sizes, left = [], length  # uneven chunks
    for s in (5, 1, 6, 3, 2, 9, 7, 1, 11):
        if left <= 0:
            break
        sizes.append(min(s, left))
        left -= sizes[-1]
    while left > 0:
        sizes.append(min(13, left))
        left -= sizes[-1]
    return tuple(sizes)


_compress = spec_cases("v4_compress", compress_trial)
_C_DOC = {512: "MODEL1 records (584 bytes)", 128: "the indexer's records (132 bytes)"}
for _d, _r, _length, _kind, _salt in (
        (512, 4, 0, "prefill", 1200), (512, 4, 1, "prefill", 1201), (512, 4, 3, "prefill", 1202),
        (512, 4, 4, "prefill", 1203), (512, 4, 5, "prefill", 1204),
        (512, 128, 127, "prefill", 1205), (512, 128, 128, "prefill", 1206),
        (512, 128, 129, "prefill", 1207), (128, 4, 3, "prefill", 1208),
        (128, 4, 4, "prefill", 1209), (128, 4, 5, "prefill", 1210)):
    _compress(f"c{_r}_d{_d}_length_{_length}", "compress_lengths",
              f"A request of {_length} tokens (ratio {_r}, d = {_d}, one prefill): "
              f"{_length // _r} entries as {_C_DOC[_d]}, none before a window closes.",
              CompressSpec(_d, _r, _steps(_kind, _length, _r)), _salt)
for _d, _r, _length, _kind, _salt, _what in (
        (512, 4, 37, "prefill", 1220, "in one prefill"),
        (512, 4, 37, "chunks", 1221, "in uneven chunks (5, 1, 6, 3, ...)"),
        (512, 4, 14, "tokens", 1222, "token by token, each window closing on the state"),
        (512, 128, 300, "prefill", 1223, "in one prefill"),
        (512, 128, 260, "tail", 1224, "a prefill, then token by token across a boundary"),
        (128, 4, 37, "prefill", 1225, "in one prefill"),
        (128, 4, 37, "chunks", 1226, "in uneven chunks"),
        (128, 4, 14, "tokens", 1227, "token by token")):
    _compress(f"c{_r}_d{_d}_{_kind}", "compress_steps",
              f"{_length} tokens (ratio {_r}, d = {_d}) fed {_what}: the same {_C_DOC[_d]} as "
              "one prefill gives.",
              CompressSpec(_d, _r, _steps(_kind, _length, _r)), _salt)
for _d, _r, _length, _salt in ((512, 4, 12, 1230), (512, 128, 256, 1231), (128, 4, 12, 1232)):
    _compress(f"c{_r}_d{_d}_sharp", "compress_sharp",
              f"One-hot softmax scores (ratio {_r}, d = {_d}): each channel of an entry is one "
              "token's kv exactly, so the window's slots and channel halves are pinned.",
              CompressSpec(_d, _r, (_length,), values="sharp"), _salt)
_compress("c4_d512_ue8m0_floors", "ue8m0_floor",
          "MODEL1 tiles with amax near 4.6e-5, 0.023 and 7e-4 (below 448·2^-14): the scale is "
          "2^ceil(log2(max(amax, 1e-4)/448)), the Triton kernels' floor.",
          CompressSpec(512, 4, (24,), values="floors"), 1240)
_compress("c128_d512_ue8m0_floors", "ue8m0_floor",
          "Ratio 128 with small MODEL1 tiles: the same floor on amax, 1e-4, then / 448.",
          CompressSpec(512, 128, (256,), values="floors"), 1241)
_compress("c4_d128_ue8m0_floor", "ue8m0_floor",
          "Indexer entries with amax near 0.006: the scale 2^ceil(log2(max(amax, 1e-4)/448)), "
          "not floored at 1e-4 after the division.",
          CompressSpec(128, 4, (24,), values="floors"), 1242)
_compress("c4_d128_floor_1e_4", "ue8m0_floor",
          "Indexer entries with amax below 1e-4: the scale is 2^ceil(log2(1e-4/448)) = 2^-22.",
          CompressSpec(128, 4, (24,), values="floor_1e-4"), 1243)
_compress("c4_d512_masked_nan", "masked_nan",
          "Window positions below 0 hold NaN kv and +inf scores in the state: masked, never "
          "read, so entry 0 is its own block's alone (token by token).",
          CompressSpec(512, 4, (1,) * 9, masked="nan_inf"), 1250)
_compress("c4_d128_masked_nan", "masked_nan",
          "The indexer's compressor with NaN kv and +inf scores below position 0: nothing "
          "leaks.",
          CompressSpec(128, 4, (2, 3, 4), masked="nan_inf"), 1251)


# ---- v4_indexer_q -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class IndexerQSpec:
    tokens: int = 12
    heads: int = 64
    values: str = "random"  # random, floor, ties, zeros


_MAX_POS = 8192
_E4M3_MID = torch.tensor([0.5625, 1.0625, 1.1875, 2.125, 3.25, 6.5, 13.0, 26.0, 52.0, 104.0,
                          208.0, 416.0, 0.017578125, 0.0009765625, 1.125, 5.5])


def _indexer_q_inputs(g: torch.Generator, spec: IndexerQSpec
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, H, D = spec.tokens, spec.heads, 128
    gain = 2.0 ** torch.randint(-6, 4, (T, H, 1), generator=g).float()
    q = torch.randn(T, H, D, generator=g) * gain
    positions = torch.randint(0, _MAX_POS, (T,), generator=g)
    positions[:2] = torch.tensor([0, _MAX_POS - 1])[:T]
    if spec.values == "floor":  # below 1e-4, at 448·2^k exactly, just above it
        q[:, 0::4] *= 2.0 ** -20
        peak = 448.0 * 2.0 ** torch.randint(-12, 2, (T, H), generator=g).float()
        q[:, 1::4, :64] = q[:, 1::4, :64].clamp(-1, 1) * peak[:, 1::4, None] / 8
        q[:, 1::4, 64:] = 0.0
        q[:, 1::4, 5] = peak[:, 1::4]
        q[:, 2::4, :64] = q[:, 2::4, :64].clamp(-1, 1) * peak[:, 2::4, None] / 8
        q[:, 2::4, 64:] = 0.0
        q[:, 2::4, 9] = -peak[:, 2::4] * (1 + 2.0 ** -7)
    elif spec.values == "ties":  # e4m3 midpoints, rotation at position 0 the identity
        positions[:] = 0
        pick = torch.randint(0, _E4M3_MID.numel(), (T, H, D), generator=g)
        sign = torch.randint(0, 2, (T, H, D), generator=g) * 2.0 - 1.0
        unit = 2.0 ** torch.randint(-8, 1, (T, H, 1), generator=g).float()
        q = sign * _E4M3_MID[pick] * unit
        q[..., :1] = 448.0 * unit  # amax 448·unit: the scale is unit exactly
    elif spec.values == "zeros":
        q[:, ::3] = 0.0
        q[:, 1::3, :64] = -0.0
    weights = torch.randn(T, H, generator=g)
    return q.to(torch.bfloat16), weights.to(torch.bfloat16), positions


def indexer_q_trial(setting: Setting, spec: IndexerQSpec, salt: int) -> Trial:
    """A trial of ``spec`` (see the module doc)."""
    g = generator(setting, salt)
    q, weights, positions = _indexer_q_inputs(g, spec)
    H = spec.heads
    cos_sin = cos_sin_table(_MAX_POS)
    sm, hs = 128 ** -0.5, H ** -0.5
    codes, w_ref = v4_indexer_q(q, weights, positions, cos_sin, sm, hs)
    rotated = indexer_q_values(q, positions, cos_sin)
    eps = torch.zeros_like(rotated)
    eps[..., 64:] = 2.0 ** -21 * rotated[..., 64:].abs().amax(dim=-1, keepdim=True)
    lo, hi = (indexer_q_records(x)[0] for x in _nudged(rotated, eps))
    dev = setting.device

    def invoke(fn: Callable) -> Outputs:
        got = call_poisoned(fn, q.to(dev), weights.to(dev), positions.to(dev), cos_sin.to(dev),
                            sm, hs)
        if not isinstance(got, tuple) or len(got) != 2:
            return {"q_fp8": got}
        return {"q_fp8": _accept_boundary(got[0], codes, lo, hi), "weights": got[1]}

    def neox() -> Outputs:
        x = q.double()
        rows = cos_sin.double()[positions][:, None]
        c, s = rows[..., :32], rows[..., 32:]
        a, b = x[..., 64:96], x[..., 96:]  # rotate-half: dim i pairs with dim i + 32
        cds, sc = indexer_q_records(torch.cat([x[..., :64], a * c - b * s, a * s + b * c],
                                              dim=-1))
        return {"q_fp8": cds, "weights": weights.double() * sc.double() * sm * hs}

    def unrounded() -> Outputs:
        from mla.reference.fp8 import act_quant
        cds, sc = act_quant(rotated.float(), block_size=128, scale_fmt="ue8m0")
        return {"q_fp8": cds.view(torch.uint8), "weights": weights.double() * sc[..., 0] * sm
                * hs}

    alts: dict[str, Callable[[], Outputs]] = {
        "RoPE on NeoX (rotate-half) pairs; DeepSeek-V4's indexer q uses GPT-J (interleaved) "
        "pairs on the last 64 dims": neox,
        "the rotated half quantized from fp32, not rounded to bf16 first": unrounded,
        "weights without q's scale folded in (weights · softmax_scale · head_scale only)":
            lambda: {"q_fp8": codes, "weights": weights.double() * sm * hs},
    }
    seen = {why: (lambda make=make: (lambda o: {**o, "q_fp8": _accept_boundary(
        o["q_fp8"], codes, lo, hi)})(make())) for why, make in alts.items()}
    return Trial(invoke, {"q_fp8": codes, "weights": w_ref.double()},
                 {"q_fp8": "mismatches", "weights": "out_rel"}, seen,
                 limits={"weights": WEIGHTS_LIMIT})


_indexer_q = spec_cases("v4_indexer_q", indexer_q_trial)
_indexer_q("random_64_heads", "indexer_q",
           "64 heads of 128, positions 0 to 8191: the last 64 dims rotated (GPT-J pairs), "
           "rounded to bf16, e4m3 per (token, head), the weights times q's scale, 128^-0.5 "
           "and 64^-0.5.", IndexerQSpec(), 1300)
_indexer_q("heads_32", "indexer_q",
           "32 heads: the head scale passed (32^-0.5, not a power of two) is the one folded.",
           IndexerQSpec(tokens=6, heads=32), 1301)
_indexer_q("one_token", "indexer_q",
           "One token at position 0 (cos 1, sin 0): q's codes and weights of a single row.",
           IndexerQSpec(tokens=1), 1302)
_indexer_q("scale_floor", "q_scale_floor",
           "Heads with amax below 1e-4 (scale 2^-22), exactly 448·2^k (scale 2^k, the largest "
           "code 448) and just above it (scale 2^(k+1)).", IndexerQSpec(values="floor"), 1303)
_indexer_q("ties", "q_scale_floor",
           "Values at e4m3 midpoints (positions 0: the rotation is the identity): ties go to "
           "the even code.", IndexerQSpec(values="ties"), 1304)
_indexer_q("zero_heads", "q_scale_floor",
           "All-zero heads and a -0 rope half: codes zero with their sign, the scale at the "
           "1e-4 floor folded into the weights.", IndexerQSpec(values="zeros"), 1305)


# ---- v4_scope_indices -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ScopeSpec:
    ratio: int  # 1, 4 or 128
    requests: tuple[tuple[int, int], ...]  # (seq_len after the step, new tokens)
    path: str = "decode"
    topk: int = 16  # ratio 4: the indexer's width
    minus_one: float = 0.0  # ratio 4: the fraction of -1 scattered among the top-k ids
    window: int = WINDOW


def _scope_inputs(g: torch.Generator, spec: ScopeSpec) -> dict[str, torch.Tensor | None]:
    B = len(spec.requests)
    positions = torch.cat([torch.arange(L - n, L) for L, n in spec.requests])
    token_to_req = torch.cat([torch.full((n,), b) for b, (_, n) in enumerate(spec.requests)])
    seq_lens = torch.tensor([L for L, _ in spec.requests])
    cap = max(L for L, _ in spec.requests)
    pages = -(-cap // 64)
    window_table = torch.randperm(B * pages, generator=g).view(B, pages).int()
    out: dict[str, torch.Tensor | None] = {
        "positions": positions, "token_to_req": token_to_req.long(), "seq_lens": seq_lens,
        "window_table": window_table, "compressed_table": None, "topk": None}
    if spec.ratio > 1:
        per = COMPRESSED_PAGE_TOKENS // spec.ratio
        cpages = max(1, -(-max(1, cap // spec.ratio) // per))
        out["compressed_table"] = torch.randperm(B * cpages, generator=g).view(B, cpages).int()
    if spec.ratio == 4:
        K = spec.topk
        rows = []
        for p in positions.tolist():
            n = (p + 1) // 4
            ids = torch.randperm(n, generator=g)[:K] if n > K else torch.arange(n)
            row = torch.full((K,), -1)
            row[:ids.numel()] = ids
            if spec.minus_one:
                drop = torch.rand(K, generator=g) < spec.minus_one
                row = torch.where(drop, -1, row)
                row = row[torch.randperm(K, generator=g)]
            rows.append(row)
        out["topk"] = torch.stack(rows).int() if rows else torch.zeros(0, K, dtype=torch.int32)
    return out


def _names(path: str) -> tuple[str, ...]:
    return (("indices", "lengths", "extra_indices", "extra_lengths") if path == "decode"
            else ("indices", "lengths"))


def _scope_alternatives(spec: ScopeSpec, x: dict, ref: Outputs
                        ) -> dict[str, Callable[[], Outputs]]:
    names = _names(spec.path)

    def call(**change: object) -> Outputs:
        args = {**x, "ratio": spec.ratio, "window": spec.window, "path": spec.path, **change}
        return dict(zip(names, v4_scope_indices(**args)))

    def short() -> Outputs:
        out = call(window=spec.window - 1)
        if spec.path == "decode":
            out["indices"] = torch.nn.functional.pad(out["indices"], (0, 1), value=-1)
        return out

    alts = {"the window one token short: [p - W + 2, p], W - 1 keys; the reference's is "
            "[max(p - W + 1, 0), p], W keys with the query's own": short}
    if spec.ratio == 4 and spec.path == "decode":
        def in_place() -> Outputs:
            extra = torch.stack([
                paged_slots(x["topk"][t], x["compressed_table"][int(x["token_to_req"][t])],
                            COMPRESSED_PAGE_TOKENS // 4) for t in range(x["topk"].shape[0])])
            return {**ref, "extra_indices": extra}
        alts["the top-k's -1 left in place; the reference puts the valid ids first, in their "
             "order"] = in_place
    if spec.ratio == 4 and spec.path == "prefill":
        def first_k_as_they_are() -> Outputs:
            idx, lens = prefill_first_k_as_they_are({**x, "window": spec.window})
            width = ref["indices"].shape[1]
            idx = torch.nn.functional.pad(idx, (0, max(0, width - idx.shape[1])),
                                          value=-1)[:, :width]
            return {"indices": idx, "lengths": lens}
        alts["the combined row takes the top-k row's first min((p + 1) // 4, K) ids as they "
             "are, -1 in place and counted (read as workspace row M·b - 1, the request "
             "before's last); the reference takes the valid ids"] = first_k_as_they_are
    if spec.ratio == 128 and spec.path == "decode":
        def visible_floor() -> Outputs:
            _, _, extra, extra_len = decode_scope_indices(
                x["positions"] - 1, x["token_to_req"], x["window_table"],
                x["compressed_table"], None, 128, spec.window)
            width = ref["extra_indices"].shape[1]
            extra = torch.nn.functional.pad(extra, (0, max(0, width - extra.shape[1])),
                                            value=-1)[:, :width]
            return {**ref, "extra_indices": extra, "extra_lengths": extra_len}
        alts["p // 128 visible compressed entries; the reference's is (p + 1) // 128 (an "
             "entry is visible from its block's last token on)"] = visible_floor
    return alts


def prefill_first_k_as_they_are(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill rows at ratio 4 as ``combine_topk_swa_indices`` builds them from a top-k row
    it trusts to hold its valid ids first (vLLM 0.33): the row's first ``k = min((p + 1) // 4,
    K)`` ids as they are, plus ``M·b``, then the window's workspace rows; the length ``k`` plus
    the window's, ``-1`` padded to a multiple of 128."""
    pos, req = x["positions"].long(), x["token_to_req"].long()
    lens, topk, window = x["seq_lens"].long(), x["topk"].long(), int(x["window"])
    n = torch.bincount(req, minlength=lens.shape[0])
    gather = n + torch.clamp(lens - n, max=window - 1)
    N = int((lens // 4).max())
    M = N + int(gather.max())
    rows = []
    for t in range(pos.shape[0]):
        b, p = int(req[t]), int(pos[t])
        k = min((p + 1) // 4, topk.shape[1])
        first = int(lens[b] - gather[b])
        swa = [M * b + N + s - first for s in range(max(p - window + 1, 0), p + 1)]
        rows.append([int(i) + M * b for i in topk[t, :k]] + swa)
    width = -(-(topk.shape[1] + window) // 128) * 128
    idx = torch.full((len(rows), width), -1, dtype=torch.int32)
    for t, r in enumerate(rows):
        idx[t, :len(r)] = torch.tensor(r, dtype=torch.int32)
    return idx, torch.tensor([len(r) for r in rows], dtype=torch.int32)


def scope_trial(setting: Setting, spec: ScopeSpec, salt: int) -> Trial:
    """A trial of ``spec`` (see the module doc)."""
    g = generator(setting, salt)
    x = _scope_inputs(g, spec)
    names = _names(spec.path)
    ref = dict(zip(names, v4_scope_indices(**x, ratio=spec.ratio, window=spec.window,
                                           path=spec.path)))
    dev = setting.device

    def invoke(fn: Callable) -> Outputs:
        args = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in x.items()}
        got = call_poisoned(fn, **args, ratio=spec.ratio, window=spec.window, path=spec.path)
        if not isinstance(got, tuple) or len(got) != len(names):
            return {"indices": got}
        return dict(zip(names, got))

    return Trial(invoke, ref, {n: "mismatches" for n in names},
                 _scope_alternatives(spec, x, ref))


_scope = spec_cases("v4_scope_indices", scope_trial)
_scope("decode_window_from_0", "window",
       "Decode at positions 0, 4, 99 and 127 (window 128): the window starts at 0, its length "
       "p + 1, -1 after it.",
       ScopeSpec(1, ((1, 1), (5, 1), (100, 1), (128, 1))), 1400)
_scope("decode_window_sliding", "window",
       "Decode at positions 128, 299 and 999: the window [p - 127, p] slides over pages of 64 "
       "handed out scrambled.",
       ScopeSpec(1, ((129, 1), (300, 1), (1000, 1))), 1401)
_scope("decode_mtp_rows", "mtp",
       "MTP: three tokens a request, each its own row with its own window and top-k (ratio "
       "4).",
       ScopeSpec(4, ((40, 3), (301, 3)), topk=16), 1402)
_scope("decode_c4_minus_one", "compressed_scope",
       "Ratio 4: -1 scattered among the top-k ids: the valid ids first in their order, then "
       "-1; extra_topk_length their count.",
       ScopeSpec(4, ((200, 2), (600, 1), (9, 1)), topk=32, minus_one=0.3), 1403)
_scope("decode_c4_short_context", "compressed_scope",
       "Ratio 4 with fewer visible entries than the top-k (0, 1 and 7): every visible entry, "
       "then -1.",
       ScopeSpec(4, ((3, 1), (4, 1), (31, 2)), topk=16), 1404)
_scope("decode_c128_widths", "compressed_scope",
       "Ratio 128 at positions 126, 127, 128 and 699: 0, 1, 1 and 5 visible entries, the "
       "extra indices 5 wide (at least 1), -1 padded.",
       ScopeSpec(128, ((127, 1), (128, 1), (129, 1), (700, 1))), 1405)
_scope("decode_page_boundaries", "pages",
       "Windows ending at the 64-token page boundaries (63, 64, 127, 128, 255, 256) and "
       "compressed ids crossing pages of 64 entries (ratio 4) through scrambled tables.",
       ScopeSpec(4, ((64, 1), (65, 1), (128, 1), (129, 1), (256, 1), (257, 1)), topk=70),
       1406)
_scope("decode_c128_page_boundaries", "pages",
       "Ratio 128's compressed pages of 2 entries: ids 0 .. 4 over three scrambled pages.",
       ScopeSpec(128, ((256, 1), (383, 2), (640, 1))), 1407)
_scope("prefill_c4", "prefill",
       "Prefill, ratio 4: two requests (300 tokens, 37 new; 40, all new) in a workspace of "
       "compressed entries then raw tokens; compressed ids first, then the window, -1 padded "
       "to a multiple of 128.",
       ScopeSpec(4, ((300, 37), (40, 40)), path="prefill", topk=16, minus_one=0.2), 1410)
_scope("prefill_c128", "prefill",
       "Prefill, ratio 128: every visible entry (per request, at least 1 wide) then the "
       "window; requests of 700 (50 new) and 129 tokens.",
       ScopeSpec(128, ((700, 50), (129, 129)), path="prefill"), 1411)
_scope("prefill_window_only", "prefill",
       "Prefill of a window-only layer: the window alone, the workspace's raw tokens from "
       "L - n - min(L - n, 127) on.",
       ScopeSpec(1, ((500, 20), (60, 60), (1, 1)), path="prefill"), 1412)
