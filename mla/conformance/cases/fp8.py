"""Cases of ``concat_and_cache_fp8_ds_mla``: quantizing rows into the ``fp8_ds_mla`` cache.

``concat_and_cache_fp8_ds_mla(kv_c [T, 512], k_pe [T, 64], kv_cache, slot_mapping [T])``
writes token ``t``'s 656-byte row to ``kv_cache.view(-1, 656)[slot_mapping[t]]`` (``uint8
[num_blocks, page, 656]``; slot ``-1`` is padding and is skipped), conventions §10:

    bytes [  0, 512)   e4m3(kv_c / scale_tile), 4 tiles of 128 values, in order
    bytes [512, 528)   4 float32 inverse scales: kv_c ≈ fp8 · scale,
                       scale_tile = 2^ceil(log2(max(amax_tile / 448, 1e-4)))
    bytes [528, 656)   k_pe as 64 bfloat16, not quantized

Three kinds of check:

- "fp8_bytes", "fp8_range", "padding": the cache after the call, byte for byte against the
  reference's (quantity "mismatches"). The cache starts poisoned (0xFF: NaN in e4m3 and as a
  float32 scale) with earlier tokens' rows in a random half of it and in its last row, so rows
  the kernel must not touch keep their bytes. "fp8_bytes" pins the layout on inputs that make
  one part of it matter (tiles of very different sizes: the scale order; rope values of
  distinct bit patterns: the rope bytes), "fp8_range" the ends of the range (all-zero and
  tiny tiles, values at 448·scale and just above, ties of the e4m3 rounding).
- "fp8_dequant": the kernel's bytes dequantized by the reference's ``dequantize_fp8_ds_mla``
  against the values it was given (quantity "dequant_rel", relative Frobenius error with each
  tile of 128 divided by its own largest magnitude, so small tiles weigh as much as large
  ones). Its limit is derived in the trial: 1.5 times the reference's own dequantization error
  on the same inputs, nothing else. That error is the format's: the reference rounds each
  value once, to the nearest e4m3 number under the smallest power-of-two scale that holds its
  tile, which is the least error the 656-byte row can give for these inputs (e4m3's relative
  spacing does not depend on the scale, so no table of budgets is needed: the inputs decide).
  A kernel that quantizes differently but soundly (another tie rule, a scale of amax/448 not
  rounded to a power of two: 0.95 times the reference's error) passes; one that truncates
  (1.8 times) or takes one scale per row (15 times on tiles of different sizes) fails.
  ``k_pe`` is stored exactly, so its limit is 0.

Inputs are bfloat16 numbers (vLLM and FlashMLA pass bf16) held in the setting's dtype: the
row stores ``k_pe`` as bf16 and the quantizer works in float32, so then no byte depends on
how a kernel rounds a wider input to bf16 or float32 (a rule §10 leaves to float32's
``log2``). Their magnitudes stay inside float16's range.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from mla.compare import poison_like, rel_err
from mla.conformance.cases.common import call_poisoned
from mla.conformance.cases.paged_cache import WRAP_MINUS_ONE, scattered_slots
from mla.conformance.catalogue import Setting, Trial, generator, spec_cases
from mla.reference.fp8 import (
    FP8_DS_MLA_BYTES,
    FP8_MAX,
    concat_and_cache_fp8_ds_mla,
    dequantize_fp8_ds_mla,
    fp8_ds_mla_scales,
    quantize_fp8_ds_mla,
)

__all__ = ["Fp8Spec", "fp8_trial", "DEQUANT_MARGIN"]

KERNEL = "concat_and_cache_fp8_ds_mla"
NOPE, ROPE, TILE, TILES = 512, 64, 128, 4
SCALES_AT, ROPE_AT = 512, 528  # byte offsets in a row
DEQUANT_MARGIN = 1.5  # the fp8_dequant limit: this times the reference's own error
UNROUNDED = "scale amax/448 not rounded up to a power of two"

Outputs = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Fp8Spec:
    values: str  # how kv_c and k_pe are made: a key of _VALUES
    tokens: int = 9
    page: int = 64
    blocks: int = 2
    padding: tuple[int, ...] = ()  # tokens whose slot is -1 (they share one row of values)
    dequant: bool = False  # outputs: the dequantized rows (fp8_dequant), not the bytes


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def _tiles(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (TILES, TILE))


def _e4m3(codes: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.uint8).view(torch.float8_e4m3fn).double()


def _random(g: torch.Generator, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Normal values, one gain per token between 2^-4 and 2^4."""
    gain = 2.0 ** torch.randint(-4, 5, (t, 1), generator=g)
    return (_bf16(torch.randn(t, NOPE, generator=g, dtype=torch.float64) * gain),
            _bf16(torch.randn(t, ROPE, generator=g, dtype=torch.float64)))


def _tile_scales(g: torch.Generator, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles of sizes 2^-6, 2^0, 2^5, 2^12 in a different order per token: four distinct
    scales whose order shows."""
    gains = torch.tensor([2.0 ** -6, 1.0, 2.0 ** 5, 2.0 ** 12], dtype=torch.float64)
    order = torch.stack([torch.randperm(TILES, generator=g) for _ in range(t)])
    kv = _tiles(torch.randn(t, NOPE, generator=g, dtype=torch.float64)) * gains[order][..., None]
    return _bf16(kv.flatten(-2)), _random(g, t)[1]


def _rope_patterns(g: torch.Generator, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k_pe's bf16 bit patterns all distinct within a token: both signs, 30 exponents,
    mantissas spread over all 7 bits (so either byte order or a float32 store shows)."""
    i = torch.arange(ROPE)[None, :]
    tok = torch.arange(t)[:, None]
    sign = (i + tok) % 2
    exponent = 113 + (7 * i + 3 * tok) % 30  # 2^-14 .. 2^15: normal in float16 too
    mantissa = (37 * i + 11 * tok) % 128
    bits = (sign << 15) | (exponent << 7) | mantissa
    k_pe = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16)
    return _random(g, t)[0], k_pe.view(torch.bfloat16).double()


def _zeros_tiny(g: torch.Generator, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile 0 all zeros (scale 2^-13, zero bytes); tile 1 ±k·2^-24 (e4m3 subnormals under the
    floor scale 2^-13; k ≤ 2 rounds to a signed zero); tile 2 below the floor's amax 0.0448
    (normal codes under scale 2^-13); tile 3 normal values."""
    kv = _tiles(torch.randn(t, NOPE, generator=g, dtype=torch.float64)).clone()
    kv[:, 0] = 0.0
    k = torch.randint(1, 256, (t, TILE), generator=g).double()
    sign = torch.randint(0, 2, (t, TILE), generator=g) * 2.0 - 1.0
    kv[:, 1] = sign * k * 2.0 ** -24
    kv[:, 2] = (kv[:, 2] * 0.01).clamp(-0.044, 0.044)
    return _bf16(kv.flatten(-2)), _random(g, t)[1]


def _e4m3_max(g: torch.Generator, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token a power of two s: tile 0 peaks at exactly 448·s (scale s, code 0x7E), tile 1
    at 450·s, the next bf16 above (scale 2s), tile 2 at -448·s (0xFE), and tile 3 holds
    448·s and midpoints between neighbouring e4m3 numbers times s (round to nearest even)."""
    s = 2.0 ** torch.randint(-6, 5, (t, 1, 1), generator=g).double()
    kv = _tiles(torch.randn(t, NOPE, generator=g, dtype=torch.float64)).clamp(-3, 3) * 100.0
    codes = torch.randint(0, 0x7D, (t, TILE), generator=g)
    sign = torch.randint(0, 2, (t, TILE), generator=g) * 2.0 - 1.0
    kv[:, 3] = sign * (_e4m3(codes) + _e4m3(codes + 1)) / 2
    peak = torch.randint(0, TILE, (t, TILES), generator=g)
    rows = torch.arange(t)
    for tile, top in enumerate((FP8_MAX, 450.0, -FP8_MAX, FP8_MAX)):
        kv[rows, tile, peak[:, tile]] = top
    return _bf16((kv * s).flatten(-2)), _random(g, t)[1]


def _tile_magnitudes(g: torch.Generator, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every tile its own size, 2^-16 to 2^10 (the small ones at the scale floor)."""
    gain = 2.0 ** torch.randint(-16, 11, (t, TILES, 1), generator=g)
    kv = _tiles(torch.randn(t, NOPE, generator=g, dtype=torch.float64)) * gain
    return _bf16(kv.flatten(-2)), _random(g, t)[1]


_VALUES: dict[str, Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]] = {
    "random": _random, "tile_scales": _tile_scales, "rope_patterns": _rope_patterns,
    "zeros_tiny": _zeros_tiny, "e4m3_max": _e4m3_max, "tile_magnitudes": _tile_magnitudes}


# ---- rows under other conventions (the alternatives a failing kernel is matched against) -------

def _pack(kv_c: torch.Tensor, k_pe: torch.Tensor, scales: torch.Tensor,
          toward_zero: bool = False) -> torch.Tensor:
    """Rows in the fp8_ds_mla layout with the given scales ``[n, 4]`` (float32)."""
    v = (_tiles(kv_c.float()) / scales[..., None]).flatten(-2)
    codes = v.to(torch.float8_e4m3fn).view(torch.uint8)
    if toward_zero:  # one code down in magnitude where rounding went up (codes are monotonic)
        codes = torch.where(codes.view(torch.float8_e4m3fn).float().abs() > v.abs(), codes - 1,
                            codes)
    return torch.cat([codes, scales.float().contiguous().view(torch.uint8),
                      k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)], dim=-1)


def _reorder(rows: torch.Tensor, *, tiles: bool = False, scales: bool = False) -> torch.Tensor:
    out = rows.clone()
    if tiles:
        out[:, :SCALES_AT] = rows[:, :SCALES_AT].unflatten(1, (TILES, TILE)).flip(1).flatten(1)
    if scales:
        out[:, SCALES_AT:ROPE_AT] = rows[:, SCALES_AT:ROPE_AT].unflatten(1, (TILES, 4)).flip(
            1).flatten(1)
    return out


def _inverted_scales(rows: torch.Tensor) -> torch.Tensor:
    out = rows.clone()
    s = rows[:, SCALES_AT:ROPE_AT].contiguous().view(torch.float32)
    out[:, SCALES_AT:ROPE_AT] = (1.0 / s).view(torch.uint8)
    return out


def _rope_float32(rows: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    out = rows.clone()
    out[:, ROPE_AT:] = k_pe[:, : ROPE // 2].float().contiguous().view(torch.uint8)
    return out


def _rope_before_scales(rows: torch.Tensor) -> torch.Tensor:
    return torch.cat([rows[:, :SCALES_AT], rows[:, ROPE_AT:], rows[:, SCALES_AT:ROPE_AT]], dim=1)


def _written(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, *,
             wrap: bool = False, rope: bool = True) -> torch.Tensor:
    """A copy of ``cache`` with ``rows`` (one per token) at ``slots``: ``wrap`` writes slot -1
    to the last row, ``rope=False`` leaves the rope bytes as they were."""
    out = cache.clone()
    flat = out.view(-1, FP8_DS_MLA_BYTES)
    keep = torch.ones_like(slots, dtype=torch.bool) if wrap else slots >= 0
    width = FP8_DS_MLA_BYTES if rope else ROPE_AT
    flat[slots[keep], :width] = rows[keep, :width]
    return out


def _alternatives(cache: torch.Tensor, slots: torch.Tensor, kv_c: torch.Tensor,
                  k_pe: torch.Tensor) -> dict[str, Callable[[], Outputs]]:
    rows = quantize_fp8_ds_mla(kv_c, k_pe)
    tile_scales = fp8_ds_mla_scales(kv_c)
    unrounded = (_tiles(kv_c.float()).abs().amax(-1) / FP8_MAX).clamp_min(1e-4)
    row_amax = kv_c.float().abs().amax(-1, keepdim=True)
    row_scale = torch.pow(2.0, torch.log2((row_amax / FP8_MAX).clamp_min(1e-4)).ceil())

    def at(r: torch.Tensor, **kw: bool) -> Callable[[], Outputs]:
        return lambda: {"kv_cache": _written(cache, slots, r, **kw)}

    alts = {
        "kv_c tiles in reverse order (scales in order)": at(_reorder(rows, tiles=True)),
        "kv_c tiles and their scales in reverse order": at(_reorder(rows, tiles=True,
                                                                    scales=True)),
        "scales in reverse order": at(_reorder(rows, scales=True)),
        "scales stored as 1/scale (the quantizer's multiplier; the row holds the "
        "dequantizer's kv_c ≈ fp8 · scale)": at(_inverted_scales(rows)),
        "values truncated toward zero instead of rounded to nearest (even)":
            at(_pack(kv_c, k_pe, tile_scales, toward_zero=True)),
        "one scale per row (its amax) instead of one per tile of 128":
            at(_pack(kv_c, k_pe, row_scale.expand(-1, TILES))),
        UNROUNDED: at(_pack(kv_c, k_pe, unrounded)),
        "k_pe stored as float32 (its first 32 values fill the rope bytes)":
            at(_rope_float32(rows, k_pe)),
        "k_pe stored before the scales (rope at bytes 512..640, scales after)":
            at(_rope_before_scales(rows)),
        "k_pe not written (the rope bytes keep their earlier contents)": at(rows, rope=False)}
    if bool((slots < 0).any()):
        alts[WRAP_MINUS_ONE] = at(rows, wrap=True)
    return alts


# ---- the trial ----------------------------------------------------------------------------------

def _tile_weights(kv_c: torch.Tensor) -> torch.Tensor:
    """Per element 1 / its tile's largest magnitude (1 for an all-zero tile)."""
    amax = _tiles(kv_c).abs().amax(-1, keepdim=True)
    return (1.0 / torch.where(amax > 0, amax, 1.0)).expand(-1, -1, TILE).flatten(-2)


def _dequantized(cache: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> Outputs:
    """The rows at ``slots`` (none of them -1), dequantized, ``kv_c`` weighted per tile."""
    kv_c, k_pe = dequantize_fp8_ds_mla(cache.cpu().view(-1, FP8_DS_MLA_BYTES)[slots])
    return {"kv_c": kv_c.double() * weights, "k_pe": k_pe.double()}


def fp8_trial(setting: Setting, spec: Fp8Spec, salt: int) -> Trial:
    """A trial of ``spec`` (see the module doc): kv_c and k_pe in the setting's dtype."""
    g = generator(setting, salt)
    n_slots = spec.blocks * spec.page
    slots = torch.tensor(scattered_slots(g, n_slots, spec.page, spec.tokens),
                         dtype=torch.int64).reshape(spec.tokens)
    slots[list(spec.padding)] = -1
    kv64, pe64 = _VALUES[spec.values](g, spec.tokens)
    for x in (kv64, pe64):  # as paged_cache's padding: one row whichever wrapped token wins
        x[list(spec.padding)] = x[list(spec.padding[:1])]
    kv_c, k_pe = kv64.to(setting.dtype), pe64.to(setting.dtype)
    cache = poison_like(torch.empty(spec.blocks, spec.page, FP8_DS_MLA_BYTES, dtype=torch.uint8))
    earlier = torch.rand(n_slots, generator=g) < 0.5
    earlier[-1] = True  # where a wrapped -1 slot would land
    prior_kv, prior_pe = _random(g, int(earlier.sum()))
    cache.view(n_slots, FP8_DS_MLA_BYTES)[earlier] = quantize_fp8_ds_mla(prior_kv, prior_pe)

    dev = setting.device
    dev_args = (kv_c.to(dev), k_pe.to(dev))
    dev_slots = slots.to(dev)

    def write(fn: Callable) -> torch.Tensor:
        out = cache.to(dev, copy=True)
        call_poisoned(fn, *dev_args, out, dev_slots)
        return out

    want = cache.clone()
    concat_and_cache_fp8_ds_mla(kv_c, k_pe, want, slots)
    if not spec.dequant:
        return Trial(lambda fn: {"kv_cache": write(fn)}, {"kv_cache": want},
                     {"kv_cache": "mismatches"}, _alternatives(cache, slots, kv_c, k_pe))
    kept = slots[slots >= 0]
    given = {"kv_c": kv_c[slots >= 0].double(), "k_pe": k_pe[slots >= 0].double()}
    weights = _tile_weights(given["kv_c"])
    expected = {"kv_c": given["kv_c"] * weights, "k_pe": given["k_pe"]}
    own = _dequantized(want, kept, weights)
    limits = {n: DEQUANT_MARGIN * rel_err(own[n], expected[n]) for n in expected}
    # the byte layouts' alternatives, dequantized; not the unrounded scale, which is sound
    # (it passes) and lies within the limit of other roundings
    alts = {why: (lambda make=make: _dequantized(make()["kv_cache"], kept, weights))
            for why, make in _alternatives(cache, slots, kv_c, k_pe).items()
            if why != UNROUNDED}
    return Trial(lambda fn: _dequantized(write(fn), kept, weights), expected,
                 {"kv_c": "dequant_rel", "k_pe": "dequant_rel"}, alts, limits=limits)


_register = spec_cases(KERNEL, fp8_trial)

_register("bytes_random", "fp8_bytes",
          "The 656 bytes of each row (4 e4m3 tiles, 4 float32 inverse scales, 64 bf16 rope "
          "values) equal the reference's, at slots scattered over page-64 blocks.",
          Fp8Spec("random", tokens=17), 800)
_register("bytes_tile_scales", "fp8_bytes",
          "Tiles of sizes 2^-6, 1, 2^5, 2^12 in a different order per token: each scale "
          "belongs to its own tile, in tile order, and is the inverse (kv_c ≈ fp8 · scale).",
          Fp8Spec("tile_scales"), 801)
_register("bytes_rope_patterns", "fp8_bytes",
          "Rope values of distinct bf16 bit patterns: k_pe lands as bf16, in order, at bytes "
          "528..656 after the scales.",
          Fp8Spec("rope_patterns"), 802)
_register("zeros_and_tiny", "fp8_range",
          "An all-zero tile (scale 2^-13, zero bytes), tiny values in e4m3 subnormals or "
          "rounding to a signed zero, and a tile under the scale floor's amax 0.0448.",
          Fp8Spec("zeros_tiny"), 803)
_register("e4m3_max", "fp8_range",
          "Tile peaks at exactly 448·scale (code 0x7E, no overflow), at -448·scale, at the next "
          "bf16 above (the scale doubles), and midpoints rounding to the even e4m3 code.",
          Fp8Spec("e4m3_max"), 804)
_register("padding_slots", "padding",
          "Slot -1 (first, middle and last token) is padding: skipped, so the cache's last row "
          "keeps the earlier token's bytes it holds.",
          Fp8Spec("random", tokens=8, padding=(0, 3, 7)), 805)
_register("dequant_random", "fp8_dequant",
          "Dequantized by the reference, the kernel's rows hold the values it was given within "
          "1.5 times the reference's own fp8 error on the same values.",
          Fp8Spec("random", tokens=17, dequant=True), 806)
_register("dequant_tile_magnitudes", "fp8_dequant",
          "Tiles of sizes 2^-16 to 2^10 within a row, each tile's error weighed alike: one "
          "scale per tile of 128, not per row, within 1.5 times the reference's error.",
          Fp8Spec("tile_magnitudes", tokens=17, dequant=True), 807)
