"""Cases of ``attention_with_lse``: attention that also returns the log-sum-exp (conventions §5).

``q [Sq, N, D]``, ``k [Skv, Nk, D]``, ``v [Skv, Nk, Dv]`` (``N % Nk = 0``: query head ``n``
reads KV head ``n // (N / Nk)``) give ``o [Sq, N, Dv]`` in q's dtype and ``lse [N, Sq]`` in
the natural log. With ``causal``, query ``i`` sees key ``j`` iff ``k_positions[j] <=
q_positions[i]``; the default positions align the last query with the last key
(``q_positions = Skv - Sq + i``, ``k_positions = j``: FlashAttention's bottom-right rule, a
prefill whose context precedes the new tokens). A query that sees no key (``Skv = 0``, or all
its keys masked) gets ``o = 0`` and ``lse = -inf``, the log of an empty sum, where the
FlashMLA-style kernels write ``+inf``.

Widths are DeepSeek's: the compute-friendly prefill's q/k of 192 (128 nope + 64 rope) and v
of 128 with ``Nk = N``, and the absorbed path's rows of 576 with V of 512 and one KV head.
Only the "causal" and "empty" topics mask with ``Sq != Skv`` and default positions, only the
"positions" topic passes positions, only the "empty" topic has queries that see no key, only
the "scale" topic passes a scale other than ``1/sqrt(D)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from mla.conformance.cases.common import DEEPSEEK_SCALE, DV, YARN_SCALE, D, call_poisoned
from mla.conformance.catalogue import Setting, Trial, generator, spec_cases
from mla.reference.attention import attention_with_lse, default_positions

__all__ = ["AttentionSpec", "attention_trial"]

KERNEL = "attention_with_lse"
Outputs = dict[str, torch.Tensor]
PREFILL_D, PREFILL_DV = 192, 128  # qk_nope + qk_rope, v_head_dim


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    s_q: int
    s_kv: int
    heads: int = 16
    kv_heads: int = 16
    d: int = PREFILL_D
    dv: int = PREFILL_DV
    causal: bool = False
    scale: float | None = None  # None: 1/sqrt(d)
    positions: bool = False  # explicit positions: keys shuffled and spaced, queries among them
    q_gain: float = 1.0  # >1: sharper softmax

    @property
    def softmax_scale(self) -> float:
        return self.d ** -0.5 if self.scale is None else self.scale


def _inputs(spec: AttentionSpec, g: torch.Generator
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                       torch.Tensor | None]:
    """float64 ``q, k, v`` and the positions (``None``: the defaults) on the CPU."""
    q = torch.randn(spec.s_q, spec.heads, spec.d, generator=g, dtype=torch.float64) * spec.q_gain
    k = torch.randn(spec.s_kv, spec.kv_heads, spec.d, generator=g, dtype=torch.float64)
    v = torch.randn(spec.s_kv, spec.kv_heads, spec.dv, generator=g, dtype=torch.float64)
    if not spec.positions:
        return q, k, v, None, None
    # keys out of order with gaps, queries anywhere from the first key on: every query sees
    # the key at position 0, the rest depends on the positions alone
    k_pos = torch.randperm(spec.s_kv, generator=g) * 3
    q_pos = torch.randint(0, 3 * spec.s_kv, (spec.s_q,), generator=g)
    return q, k, v, q_pos, k_pos


def _ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
         q_pos: torch.Tensor | None, k_pos: torch.Tensor | None) -> Outputs:
    o, lse = attention_with_lse(q, k, v, scale, causal, q_pos, k_pos)
    return {"out": o, "lse": lse}


def _alternatives(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  q_pos: torch.Tensor | None, k_pos: torch.Tensor | None, expected: Outputs
                  ) -> dict[str, Callable[[], Outputs]]:
    """What a kernel under another known convention returns on these inputs."""
    scale, causal = spec.softmax_scale, spec.causal

    def ref(**kw: object) -> Outputs:
        args: dict = dict(scale=scale, causal=causal, q_pos=q_pos, k_pos=k_pos)
        return _ref(q, k, v, **{**args, **kw})

    alts: dict[str, Callable[[], Outputs]] = {}
    for width, what in ((spec.d, "D"), (spec.dv, "Dv")):
        if width ** -0.5 != scale:
            alts[f"softmax scale 1/sqrt({what} = {width}) used instead of the scale passed"] = (
                lambda w=width: ref(scale=w ** -0.5))
    if spec.heads != spec.kv_heads and spec.kv_heads > 1:
        interleaved = torch.arange(spec.heads) % spec.kv_heads  # KV head of each query head
        alts[f"query head n read KV head n % {spec.kv_heads} (interleaved) instead of "
             f"n // {spec.heads // spec.kv_heads}"] = lambda: _ref(
                 q, k[:, interleaved], v[:, interleaved], scale, causal, q_pos, k_pos)
    if causal:
        dq, dk = default_positions(spec.s_q, spec.s_kv, q.device)
        qp = dq if q_pos is None else q_pos
        kp = dk if k_pos is None else k_pos
        alts["causal mask ignored (every query sees every key)"] = lambda: ref(causal=False)
        if q_pos is None and spec.s_q != spec.s_kv:
            alts["causal aligned at the top-left (query i sees keys 0..i); the reference "
                 "aligns the last query with the last key (query i sees keys 0..Skv-Sq+i)"] = (
                lambda: ref(q_pos=torch.arange(spec.s_q), k_pos=kp))
        if q_pos is not None:
            alts["q_positions / k_positions ignored (the default bottom-right alignment "
                 "used)"] = lambda: ref(q_pos=None, k_pos=None)
        alts["causal mask off by one: query i sees one key too few (k_pos < q_pos)"] = (
            lambda: ref(q_pos=qp - 1, k_pos=kp))
        alts["causal mask off by one: query i sees one key too many (k_pos <= q_pos + 1)"] = (
            lambda: ref(q_pos=qp + 1, k_pos=kp))
    elif spec.s_q > 1 and spec.s_kv:
        alts["causal mask applied although causal=False"] = lambda: ref(causal=True)
    lse = expected["lse"]
    empty = torch.isneginf(lse)
    if empty.any():
        rows = empty.transpose(0, 1)[..., None]  # [Sq, N, 1]
        alts["lse is +inf for a query that sees no key (FlashMLA's marker); "
             "attention_with_lse's is -inf"] = lambda: {
                 "out": expected["out"], "lse": lse.masked_fill(empty, float("inf"))}
        alts["lse is 0 for a query that sees no key; attention_with_lse's is -inf"] = lambda: {
            "out": expected["out"], "lse": lse.masked_fill(empty, 0.0)}
        alts["a query that sees no key gets NaN (0/0, a softmax over no keys); the reference "
             "gives out 0 and lse -inf"] = lambda: {
                 "out": expected["out"].masked_fill(rows, float("nan")),
                 "lse": lse.masked_fill(empty, float("nan"))}
    return alts


def attention_trial(setting: Setting, spec: AttentionSpec, salt: int) -> Trial:
    """A trial of ``spec``: inputs in the setting's dtype, the reference on upcast copies."""
    q64, k64, v64, q_pos, k_pos = _inputs(spec, generator(setting, salt))
    q, k, v = (t.to(setting.dtype) for t in (q64, k64, v64))
    q64, k64, v64 = q.double(), k.double(), v.double()  # the kernel's inputs, exactly
    dev = setting.device
    args = tuple(t.to(dev) for t in (q, k, v))
    pos = tuple(None if p is None else p.to(dev) for p in (q_pos, k_pos))

    def invoke(fn: Callable) -> Outputs:
        if spec.positions:
            o, lse = call_poisoned(fn, *args, spec.softmax_scale, spec.causal, *pos)
        else:
            o, lse = call_poisoned(fn, *args, spec.softmax_scale, spec.causal)
        return {"out": o, "lse": lse}

    expected = _ref(q64, k64, v64, spec.softmax_scale, spec.causal, q_pos, k_pos)
    return Trial(invoke, expected, {"out": "out_rel", "lse": "lse_abs"},
                 _alternatives(spec, q64, k64, v64, q_pos, k_pos, expected))


_register = spec_cases(KERNEL, attention_trial)

def _context(small: bool) -> int:
    """A long key set: several tiles on a GPU, short under the interpreter."""
    return 300 if small else 2053


# ---- DeepSeek widths and heads --------------------------------------------------------------
_register("prefill_causal_square", "shapes",
          "DeepSeek's compute-friendly prefill: 16 heads, q/k of 192 (128 nope + 64 rope), v of "
          "128, causal over Sq = Skv = 64.",
          lambda s: AttentionSpec(64, 64, causal=True), 500)
_register("context_128_heads", "shapes",
          "The cached-context part of a chunked prefill: 128 heads, 8 queries over a long "
          "context, no mask.",
          lambda s: AttentionSpec(8, _context(s.small), heads=128, kv_heads=128), 501)
_register("absorbed_mqa_576", "shapes",
          "The absorbed path: 16 query heads share one KV head of 576 (512 latent + 64 rope), "
          "V of 512, no mask.",
          lambda s: AttentionSpec(4, 70, heads=16, kv_heads=1, d=D, dv=DV), 502)
_register("heads_9_grouped", "shapes",
          "9 query heads (an odd count) over 3 KV heads: query head n reads KV head n // 3.",
          lambda s: AttentionSpec(3, 33, heads=9, kv_heads=3), 503)
# ---- the causal rule with Sq != Skv ---------------------------------------------------------
_register("causal_few_queries_long_context", "causal",
          "Causal with 5 queries after a long context: query i sees keys 0..Skv-5+i "
          "(bottom-right), not 0..i.",
          lambda s: AttentionSpec(5, _context(s.small), causal=True), 510)
_register("causal_absorbed_4_new_tokens", "causal",
          "Causal absorbed MQA (576/512, one KV head) with 4 new tokens over 70 keys: the "
          "diagonal at the bottom-right.",
          lambda s: AttentionSpec(4, 70, kv_heads=1, d=D, dv=DV, causal=True), 511)
# ---- explicit positions ---------------------------------------------------------------------
_register("causal_explicit_positions", "positions",
          "Causal with q_positions and k_positions given (keys shuffled and spaced): query i "
          "sees key j iff k_positions[j] <= q_positions[i].",
          lambda s: AttentionSpec(6, 50, causal=True, positions=True), 520)
# ---- queries that see no key ----------------------------------------------------------------
_register("no_keys", "empty",
          "An empty key set (Skv = 0): every query gets out 0 and lse -inf.",
          lambda s: AttentionSpec(4, 0), 530)
_register("causal_queries_before_the_keys", "empty",
          "Causal with Sq = 6 > Skv = 3: queries 0..2 (positions -3..-1) see no key, out 0 and "
          "lse -inf.",
          lambda s: AttentionSpec(6, 3, causal=True), 531)
# ---- the softmax scale ----------------------------------------------------------------------
_register("scale_yarn_v3", "scale",
          "DeepSeek-V3's YaRN scale mscale²/sqrt(192) = 0.1352, not 1/sqrt(192): the scale "
          "passed is the one used.",
          lambda s: AttentionSpec(8, 40, scale=YARN_SCALE), 540)
_register("scale_absorbed_192", "scale",
          "The absorbed path's scale 1/sqrt(P+R) = 1/sqrt(192) on rows of 576, not "
          "1/sqrt(576).",
          lambda s: AttentionSpec(4, 70, kv_heads=1, d=D, dv=DV, scale=DEEPSEEK_SCALE), 541)
# ---- numerics -------------------------------------------------------------------------------
_register("sharp_softmax", "numerics",
          "Logits 30 times larger: a softmax without the running maximum overflows.",
          lambda s: AttentionSpec(8, 64, q_gain=30.0), 550)
