"""Cases of DeepSeek-V4.1's cache codecs: ``quantize_fp8_v41`` / ``dequantize_fp8_v41`` (MXFP8,
528 bytes a token) and ``quantize_nvfp4_v41`` / ``dequantize_nvfp4_v41`` (NVFP4, 288 bytes).

``quantize_*(k [T, 512]) -> uint8 [T, width]`` and ``dequantize_*(records) -> bf16 [T, 512]``,
the layouts and rounding of ``mla.reference.fp8_v41`` (vLLM 0.33's Triton kernels'): every
output is held byte for byte (quantity "mismatches"; NaN equal to NaN), so a kernel that
floors the scale the other way, swaps the nibbles, puts the scales first or turns a NaN into a
number fails, and the report names which. Inputs are bfloat16 numbers held in the setting's
dtype; the reference quantizes the same tensor, so no byte depends on the dtype.

The kernel names join ``catalogue.KERNELS`` there; until they do, ``CASES`` is not registered
(``registered()`` says whether it is) and ``v41_case`` builds the cases for a direct run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from mla.conformance.catalogue import KERNELS, Case, Setting, Trial, generator, spec_cases
from mla.reference.fp8_v41 import (
    dequantize_fp8_v41,
    dequantize_nvfp4_v41,
    quantize_fp8_v41,
    quantize_nvfp4_v41,
)

__all__ = ["CASES", "V41_KERNELS", "V41Spec", "registered", "v41_case", "v41_trial"]

V41_KERNELS = ("quantize_fp8_v41", "dequantize_fp8_v41", "quantize_nvfp4_v41",
               "dequantize_nvfp4_v41")
_QUANT = {"fp8": quantize_fp8_v41, "nvfp4": quantize_nvfp4_v41}
_DEQUANT = {"fp8": dequantize_fp8_v41, "nvfp4": dequantize_nvfp4_v41}
_VALUE_BYTES = {"fp8": 512, "nvfp4": 256}

Outputs = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class V41Spec:
    codec: str  # "fp8" or "nvfp4"
    values: str  # a key of _VALUES
    tokens: int = 9
    dequant: bool = False  # the case's kernel: dequantize_* on the reference's records


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def _random(g: torch.Generator, t: int) -> torch.Tensor:
    """Normal rows, each block of 16 its own size 2^-12 .. 2^8."""
    gain = 2.0 ** torch.randint(-12, 9, (t, 32, 1), generator=g).double()
    return _bf16((torch.randn(t, 32, 16, generator=g, dtype=torch.float64) * gain).flatten(1))


def _floors(g: torch.Generator, t: int) -> torch.Tensor:
    """Blocks with amax around 1e-4 (the MXFP8 floor on amax) and 0.0448 (the floor on
    amax/448, the other convention), and at 6·2^-9 and below (the NVFP4 scale's floor)."""
    x = torch.randn(t, 16, 32, generator=g, dtype=torch.float64).clamp(-3, 3) / 3
    peak = torch.tensor([5e-5, 1e-4, 2e-4, 1e-3, 0.01, 0.03, 0.0447, 0.0449, 6 * 2.0 ** -9,
                         3 * 2.0 ** -9, 1e-5, 0.1, 1.0, 0.04, 4e-4, 0.02], dtype=torch.float64)
    return _bf16((x * peak[torch.randperm(16, generator=g)][None, :, None]).flatten(1))


def _ties(g: torch.Generator, t: int) -> torch.Tensor:
    """Per block of 16, values at e2m1 ties and e4m3 midpoints times a power of two, the
    block's peak fixing the scale (6·2^k for NVFP4, which is also 448·2^(k-...) rounding)."""
    k = 2.0 ** torch.randint(-6, 6, (t, 32, 1), generator=g).double()
    units = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 1.0625, 1.1875, 2.125, 0.5,
                          1.5, 3.0, 4.0, 5.5, 0.125], dtype=torch.float64)
    sign = torch.randint(0, 2, (t, 32, 16), generator=g) * 2.0 - 1.0
    x = sign * units[torch.randint(0, 16, (t, 32, 16), generator=g)]
    x[:, :, 0] = 6.0
    return _bf16((x * k).flatten(1))


def _zeros(g: torch.Generator, t: int) -> torch.Tensor:
    """All-zero and all -0 blocks, and values that round to signed zeros."""
    x = _random(g, t).view(t, 32, 16).clone()
    x[:, 0] = 0.0
    x[:, 1] = -0.0
    x[:, 2] = torch.where(torch.rand(t, 16, generator=g) < 0.5, -1.0, 1.0) * 2.0 ** -12
    x[:, 2, 0] = 8.0
    return x.flatten(1)


def _nonfinite(g: torch.Generator, t: int) -> torch.Tensor:
    """NaN, +inf and -inf at random dims: NaN must come back NaN, never a number."""
    x = _random(g, t)
    for v in (float("nan"), float("inf"), -float("inf")):
        x[torch.arange(t), torch.randint(0, 512, (t,), generator=g)] = v
    return x


_VALUES: dict[str, Callable[[torch.Generator, int], torch.Tensor]] = {
    "random": _random, "floors": _floors, "ties": _ties, "zeros": _zeros,
    "nonfinite": _nonfinite}


def _alternatives(spec: V41Spec, k: torch.Tensor, rec: torch.Tensor
                  ) -> dict[str, Callable[[], Outputs]]:
    n = _VALUE_BYTES[spec.codec]
    alts: dict[str, Callable[[], Outputs]] = {
        "the scale bytes before the values": lambda: {
            "records": torch.cat([rec[:, n:], rec[:, :n]], dim=1)}}
    if spec.codec == "fp8":
        alts["the floor on amax/448 (FlashMLA's tests/quant.py), not on amax"] = lambda: {
            "records": quantize_fp8_v41(k, scale_floor="flashmla")}
    else:
        alts["dim 2i in the high nibble, 2i+1 in the low"] = lambda: {
            "records": torch.cat([(rec[:, :n] >> 4) | (rec[:, :n] << 4), rec[:, n:]], dim=1)}
    return alts


def v41_trial(setting: Setting, spec: V41Spec, salt: int) -> Trial:
    """A trial of ``spec`` (see the module doc)."""
    g = generator(setting, salt)
    k = _VALUES[spec.values](g, spec.tokens).to(setting.dtype)
    rec = _QUANT[spec.codec](k)
    dev = setting.device
    if not spec.dequant:
        return Trial(lambda fn: {"records": fn(k.to(dev))}, {"records": rec},
                     {"records": "mismatches"}, _alternatives(spec, k, rec))
    deq = _DEQUANT[spec.codec]
    alts = {why: (lambda make=make: {"values": deq(make()["records"])})
            for why, make in _alternatives(spec, k, rec).items()}
    return Trial(lambda fn: {"values": fn(rec.to(dev))}, {"values": deq(rec)},
                 {"values": "mismatches"}, alts)


_DOCS = {
    "random": "Blocks of sizes 2^-12 to 2^8: the values, then one scale per block, in order.",
    "floors": "Blocks with amax near 1e-4, near 0.0448 and at NVFP4's scale floor 6·2^-9: "
              "the floor is the one on amax (vLLM's Triton kernels).",
    "ties": "Values at e4m3 midpoints and e2m1 ties (0.25, 0.75, ..., 5 times the scale): "
            "ties go to the even code.",
    "zeros": "All-zero and all -0 blocks and values rounding to zero: zeros keep their sign.",
    "nonfinite": "NaN and ±inf in: NaN out (never a number), the other blocks unchanged.",
}

# (kernel, name, topic, doc, spec, salt)
CASES: list[tuple[str, str, str, str, V41Spec, int]] = []
for _i, (_codec, _values) in enumerate(
        [(c, v) for c in ("fp8", "nvfp4") for v in _VALUES]):
    for _deq in (False, True):
        if _deq and _values not in ("random", "nonfinite"):
            continue
        _kernel = f"{'dequantize' if _deq else 'quantize'}_{_codec}_v41"
        CASES.append((_kernel, _values, "v41_bytes" if not _deq else "v41_dequant",
                      _DOCS[_values], V41Spec(_codec, _values, dequant=_deq), 1100 + 2 * _i + _deq))


def v41_case(kernel: str, name: str, topic: str, doc: str, spec: V41Spec, salt: int) -> Case:
    """The ``Case`` of one ``CASES`` entry, registered or not."""
    return Case(kernel, name, topic, doc, lambda s: v41_trial(s, spec, salt))


def registered() -> bool:
    """Whether the catalogue knows the four kernel names (and so holds ``CASES``)."""
    return all(k in KERNELS for k in V41_KERNELS)


if registered():
    for _kernel, _name, _topic, _doc, _spec, _salt in CASES:
        spec_cases(_kernel, v41_trial)(_name, _topic, _doc, _spec, _salt)
