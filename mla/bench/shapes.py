"""The named shapes of ``mla bench``: four presets × decode/prefill × memory/compute-bound.

A shape is one call of one kernel on realistic sizes. Whether it is memory- or compute-bound
follows from its arithmetic intensity (FLOPs per byte) against the GPU's ridge point, the
bf16 matmul rate over the copy bandwidth: about 990 / 3.35 ≈ 300 FLOP/byte on an H100 and
990 / 4.8 ≈ 200 on an H200. Latent attention reads each cached row once for all ``N`` heads
of a query, so ``N`` (heads per GPU) moves a decode shape across the ridge:

    mla_decode_paged     FLOPs = 2·B·s_q·N·L·(D + Dv)                (FlashMLA's count: causal's
                         bytes = B·L·D·e + B·s_q·N·(D + Dv)·e + 4·B·s_q·N     masked keys kept)
                         intensity ≈ 2·s_q·N·(D + Dv) / (D·e): 30 at N = 16, 235 at N = 128
    sparse_mla_decode    K = topk + window (the second scope's keys, DeepSeek-V4)
                         FLOPs = 2·B·s_q·N·K·(D + Dv)
                         bytes = B·s_q·K·(row + 4) + B·s_q·N·(D + Dv)·e + 4·B·s_q·N
                         row = 656 (fp8_ds_mla), 584 (MODEL1), D·e (bf16); +4: the index
    sparse_mla_prefill   FLOPs = 2·s_q·N·topk·(D + Dv)
                         bytes = s_q·topk·(D·e + 4) + s_q·N·(D + Dv)·e + 8·s_q·N
    merge_attn_states    FLOPs = 0 (a few per element); bytes = 3·T·N·D·e + 12·T·N
    attention_with_lse   P = s_q·(s_q + 1)/2 visible pairs (causal, one request)
                         FLOPs = 2·N·P·(D + Dv); bytes = s_q·N·(2·D + 2·Dv)·e + 4·s_q·N

``e`` is the input dtype's size (2 for bf16); bytes count what must cross memory at least
once (a gathered row once per query, every input and output once), as FlashMLA's reports do.
In sparse prefill the queries share one array, so the L2 serves part of the gathered rows and
its GB/s can pass the copy ceiling: read it by its TFLOP/s.

The presets (``SHAPES``): DeepSeek-V2 and V3 share their attention's dimensions (128 heads,
latent 512 + rope 64, so D = 576 and Dv = 512 absorbed; 192 and 128 in the prefill's
attention). Decode at tensor parallelism 8 has N = 16 heads per GPU (memory-bound); N = 128
(one GPU, or data-parallel attention) is compute-bound. V3's decode carries one
multi-token-prediction draft (s_q = 2, causal) and its prefill chunks are 8192 tokens. Their
prefill is the non-absorbed attention (compute-bound) and the merge of a chunk's prefix and
suffix outputs (memory-bound, no reuse). DeepSeek-V3.2 is sparse: top-k 2048 of an
``fp8_ds_mla`` cache in decode, of a bf16 latent array in prefill. DeepSeek-V4 reads the
MODEL1 fp8 cache (D = Dv = 512, top-k 512 and a sliding window of 128 as a second scope; its
compute-bound shapes take V4-Pro's 128 heads and top-k 1024). Every bandwidth shape's cache
is larger than a Hopper L2 (50-60 MB).
"""

from __future__ import annotations

import dataclasses

__all__ = ["PRESETS", "SHAPES", "Shape", "element_size", "select_shapes", "tiny", "work"]

PAGE = 64  # tokens per cache page (FlashMLA takes 64 only)
ROW_BYTES = {"fp8_ds_mla": 656, "model1": 584}  # bytes of one cached row in the fp8 formats
KERNELS = ("mla_decode_paged", "sparse_mla_decode", "sparse_mla_prefill", "merge_attn_states",
           "attention_with_lse")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One timed call. ``B`` requests (decode), ``s_q`` query tokens per request (prefill: the
    tokens of one request, or ``T`` rows of a merge), ``N`` query heads, ``L`` context tokens
    per request (decode) or ``s_kv`` (sparse prefill), ``topk`` picked keys, ``window`` keys
    of a second scope, ``D``/``Dv`` head dims, ``cache``: ``"bf16"`` (the input dtype),
    ``"fp8_ds_mla"`` or ``"model1"``."""

    preset: str
    phase: str  # "decode" or "prefill"
    bound: str  # "memory" or "compute"
    kernel: str
    N: int
    s_q: int = 1
    B: int = 1
    L: int = 0
    topk: int = 0
    window: int = 0
    D: int = 576
    Dv: int = 512
    cache: str = "bf16"
    causal: bool = False

    @property
    def name(self) -> str:
        return f"{self.preset}/{self.phase}-{self.bound}"

    @property
    def dims(self) -> str:
        """The sizes in a few words, e.g. ``B=128 L=8192 N=16 s_q=1``."""
        k = self.kernel
        if k == "mla_decode_paged":
            d = f"B={self.B} L={self.L} N={self.N} s_q={self.s_q}"
        elif k == "sparse_mla_decode":
            d = f"B={self.B} L={self.L} N={self.N} topk={self.topk}"
            d += f"+{self.window}" if self.window else ""
        elif k == "sparse_mla_prefill":
            d = f"s_q={self.s_q} s_kv={self.L} N={self.N} topk={self.topk} D={self.D}"
        elif k == "merge_attn_states":
            d = f"T={self.s_q} N={self.N} D={self.D}"
        else:
            d = f"s_q={self.s_q} N={self.N} D={self.D}/{self.Dv}"
        extra = [self.cache] if self.cache != "bf16" else []
        extra += ["causal"] if self.causal else []
        return d + (f" {' '.join(extra)}" if extra else "")

    @property
    def scale(self) -> float:
        """The softmax scale: 1/sqrt(192) (V2/V3's qk_nope + qk_rope), 1/sqrt(512) for V4."""
        return (512 if self.D == 512 else 192) ** -0.5


_V2 = dict(D=576, Dv=512)
SHAPES: tuple[Shape, ...] = (
    Shape("deepseek-v2", "decode", "memory", "mla_decode_paged", N=16, B=128, L=8192),
    Shape("deepseek-v2", "decode", "compute", "mla_decode_paged", N=128, B=128, L=8192),
    Shape("deepseek-v2", "prefill", "memory", "merge_attn_states", N=128, s_q=4096, D=128),
    Shape("deepseek-v2", "prefill", "compute", "attention_with_lse", N=128, s_q=4096, D=192,
          Dv=128, causal=True),
    Shape("deepseek-v3", "decode", "memory", "mla_decode_paged", N=16, B=128, L=8192, s_q=2,
          causal=True),
    Shape("deepseek-v3", "decode", "compute", "mla_decode_paged", N=128, B=128, L=8192, s_q=2,
          causal=True),
    Shape("deepseek-v3", "prefill", "memory", "merge_attn_states", N=128, s_q=8192, D=128),
    Shape("deepseek-v3", "prefill", "compute", "attention_with_lse", N=128, s_q=8192, D=192,
          Dv=128, causal=True),
    Shape("deepseek-v3.2", "decode", "memory", "sparse_mla_decode", N=16, B=128, L=8192,
          topk=2048, cache="fp8_ds_mla"),
    Shape("deepseek-v3.2", "decode", "compute", "sparse_mla_decode", N=128, B=128, L=8192,
          topk=2048, cache="fp8_ds_mla"),
    Shape("deepseek-v3.2", "prefill", "memory", "sparse_mla_prefill", N=16, s_q=4096,
          L=131072, topk=2048),
    Shape("deepseek-v3.2", "prefill", "compute", "sparse_mla_prefill", N=128, s_q=4096,
          L=32768, topk=2048),
    Shape("deepseek-v4", "decode", "memory", "sparse_mla_decode", N=16, B=256, L=8192,
          topk=512, window=128, D=512, cache="model1"),
    Shape("deepseek-v4", "decode", "compute", "sparse_mla_decode", N=128, B=128, L=8192,
          topk=1024, window=128, D=512, cache="model1"),
    Shape("deepseek-v4", "prefill", "memory", "sparse_mla_prefill", N=16, s_q=4096, L=131072,
          topk=512, D=512),
    Shape("deepseek-v4", "prefill", "compute", "sparse_mla_prefill", N=128, s_q=4096,
          L=32768, topk=1024, D=512),
)
PRESETS: tuple[str, ...] = tuple(dict.fromkeys(s.preset for s in SHAPES))


def element_size(dtype_name: str) -> int:
    """Bytes of one element of ``"bfloat16"``, ``"float16"``, ``"float32"`` or ``"float64"``."""
    return {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}[dtype_name]


def work(s: Shape, e: int = 2) -> tuple[float, float]:
    """``(FLOPs, bytes)`` of one call of ``s`` with inputs of ``e`` bytes an element (the
    module doc's formulas)."""
    k = s.kernel
    if k == "mla_decode_paged":
        flops = 2.0 * s.B * s.s_q * s.N * s.L * (s.D + s.Dv)
        nbytes = s.B * s.L * s.D * e + s.B * s.s_q * s.N * (s.D + s.Dv) * e + 4 * s.B * s.s_q * s.N
    elif k == "sparse_mla_decode":
        keys = s.topk + s.window
        row = ROW_BYTES.get(s.cache, s.D * e)
        flops = 2.0 * s.B * s.s_q * s.N * keys * (s.D + s.Dv)
        nbytes = (s.B * s.s_q * keys * (row + 4) + s.B * s.s_q * s.N * (s.D + s.Dv) * e
                  + 4 * s.B * s.s_q * s.N)
    elif k == "sparse_mla_prefill":
        flops = 2.0 * s.s_q * s.N * s.topk * (s.D + s.Dv)
        nbytes = s.s_q * s.topk * (s.D * e + 4) + s.s_q * s.N * (s.D + s.Dv) * e + 8 * s.s_q * s.N
    elif k == "merge_attn_states":
        flops = 0.0
        nbytes = 3 * s.s_q * s.N * s.D * e + 12 * s.s_q * s.N
    elif k == "attention_with_lse":
        pairs = s.s_q * (s.s_q + 1) // 2 if s.causal else s.s_q * s.s_q
        flops = 2.0 * s.N * pairs * (s.D + s.Dv)
        nbytes = s.s_q * s.N * (2 * s.D + 2 * s.Dv) * e + 4 * s.s_q * s.N
    else:
        raise ValueError(f"no formula for kernel {k!r}; known: {list(KERNELS)}")
    return flops, float(nbytes)


def tiny(s: Shape) -> Shape:
    """``s`` at sizes the CPU runs in a moment (``--dry-run``): few requests, heads, tokens
    and keys; the head dims, cache format, causality and kernel kept."""
    r = dataclasses.replace
    if s.kernel in ("mla_decode_paged", "sparse_mla_decode"):
        return r(s, B=2, N=min(s.N, 2), L=2 * PAGE, topk=min(s.topk, 16),
                 window=min(s.window, 8))
    if s.kernel == "sparse_mla_prefill":
        return r(s, s_q=4, N=min(s.N, 2), L=2 * PAGE, topk=min(s.topk, 16))
    return r(s, s_q=8, N=min(s.N, 2))


def select_shapes(names: list[str] | None = None, kernels: list[str] | None = None
                  ) -> list[Shape]:
    """The shapes of ``names`` (presets such as ``deepseek-v3.2``, or shape names such as
    ``deepseek-v3.2/decode-memory``; all when empty) whose kernel is in ``kernels`` (all when
    empty). ``ValueError`` for an unknown name or kernel."""
    known = set(PRESETS) | {s.name for s in SHAPES}
    bad = sorted(set(names or ()) - known)
    if bad:
        raise ValueError(f"unknown shapes {bad}; expected a preset ({', '.join(PRESETS)}) or "
                         f"a shape name such as {SHAPES[0].name}")
    bad = sorted(set(kernels or ()) - set(KERNELS))
    if bad:
        raise ValueError(f"no shapes for kernels {bad}; the shapes time {', '.join(KERNELS)}")
    return [s for s in SHAPES if (not names or s.preset in names or s.name in names)
            and (not kernels or s.kernel in kernels)]
