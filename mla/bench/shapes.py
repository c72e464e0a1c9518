"""The named shapes of ``mla bench``: four presets × decode/prefill × memory/compute-bound,
and DeepSeek-V3.2's indexer (top-k and the fp8 logits).

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

DeepSeek-V3.2's indexer (its shapes named by ``tag``: ``deepseek-v3.2/topk-decode-8k``, ...;
``H = 64`` index heads of ``D = 128``, e4m3 ``q`` and keys with float32 weights and scales):

    top_k_per_row        R rows of L float32 logits, top-k 2048; rows end at L, or (causal,
                         the last R queries of a prefill chunk) at L - R + 1 .. L
                         FLOPs = 0; bytes = 4·Σ rows + 4·R·topk + 8·R
    fp8_paged_mqa_logits B requests of L keys, next_n (``s_q``) queries each; query n sees
                         L - next_n + n + 1 keys: P = B·Σ_n (L - next_n + n + 1) pairs
                         FLOPs = 2·P·H·D
                         bytes = B·L·132 + B·next_n·(H·D + 4·H) + 4·B·next_n·L + 4·B·(1 + pages)
    fp8_mqa_logits       the last S (``s_q``) queries of one request of L keys, full rows
                         [S, L]: P = Σ_t (L - S + t + 1) pairs, FLOPs = 2·P·H·D
                         bytes = L·132 + S·(H·D + 4·H + 8) + 4·S·L

(132 bytes a key: 128 e4m3 codes and a float32 scale; the logits are written in float32).
Their products are fp8 MMAs: their fraction of the matmul ceiling is of the fp8 rate
(``mla.bench.timing.ceilings``' ``fp8_matmul_TFLOPs``, about twice the bf16 one), against
which the decode logits (120-240 FLOP/byte) are memory-bound and the prefill's compute-bound.
Top-k does no arithmetic worth counting: its rows are the decode's (8K to 128K keys, 32 to
128 rows, 4-17 MB: read cold, the L2 flushed before each run, but small enough that launch
and latency weigh) and a prefill chunk's (1024 rows of 128K, 0.5 GB).
"""

from __future__ import annotations

import dataclasses

__all__ = ["FP8_KERNELS", "PRESETS", "SHAPES", "Shape", "element_size", "row_ends",
           "select_shapes", "tiny", "work"]

PAGE = 64  # tokens per cache page (FlashMLA takes 64 only)
ROW_BYTES = {"fp8_ds_mla": 656, "model1": 584}  # bytes of one cached row in the fp8 formats
INDEX_KEY_BYTES = 132  # an indexer key: 128 e4m3 codes and a float32 scale
FP8_KERNELS = ("fp8_mqa_logits", "fp8_paged_mqa_logits")  # their products are fp8 MMAs
KERNELS = ("mla_decode_paged", "sparse_mla_decode", "sparse_mla_prefill", "merge_attn_states",
           "attention_with_lse", "top_k_per_row", *FP8_KERNELS)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One timed call. ``B`` requests (decode), ``s_q`` query tokens per request (prefill: the
    tokens of one request, or ``T`` rows of a merge), ``N`` query heads, ``L`` context tokens
    per request (decode) or ``s_kv`` (sparse prefill), ``topk`` picked keys, ``window`` keys
    of a second scope, ``D``/``Dv`` head dims, ``cache``: ``"bf16"`` (the input dtype),
    ``"fp8_ds_mla"`` or ``"model1"``. The indexer's: ``top_k_per_row`` has ``B`` rows of
    ``L`` logits (``causal``: ending at ``L - B + 1 .. L``); ``fp8_paged_mqa_logits`` ``B``
    requests of ``L`` keys and ``s_q`` = next_n; ``fp8_mqa_logits`` the last ``s_q`` queries
    of one request of ``L`` keys; ``N`` index heads of ``D``. ``tag`` names a shape beside
    its preset's four (``{preset}/{tag}``)."""

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
    tag: str = ""

    @property
    def name(self) -> str:
        return f"{self.preset}/{self.tag or f'{self.phase}-{self.bound}'}"

    @property
    def precision(self) -> str:
        """The MMA its products take: ``"fp8"`` (the indexer's logits) or ``"bf16"``."""
        return "fp8" if self.kernel in FP8_KERNELS else "bf16"

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
        elif k == "top_k_per_row":
            d = f"R={self.B} L={self.L} k={self.topk}"
        elif k == "fp8_paged_mqa_logits":
            d = f"B={self.B} L={self.L} H={self.N} next_n={self.s_q}"
        elif k == "fp8_mqa_logits":
            d = f"S={self.s_q} L={self.L} H={self.N}"
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
    # DeepSeek-V3.2's indexer: the top-k of decode rows and of a prefill chunk's, the logits
    Shape("deepseek-v3.2", "decode", "memory", "top_k_per_row", N=0, B=128, L=8192,
          topk=2048, tag="topk-decode-8k"),
    Shape("deepseek-v3.2", "decode", "memory", "top_k_per_row", N=0, B=128, L=32768,
          topk=2048, tag="topk-decode-32k"),
    Shape("deepseek-v3.2", "decode", "memory", "top_k_per_row", N=0, B=32, L=131072,
          topk=2048, tag="topk-decode-128k"),
    Shape("deepseek-v3.2", "prefill", "memory", "top_k_per_row", N=0, B=1024, L=131072,
          topk=2048, causal=True, tag="topk-prefill-128k"),
    Shape("deepseek-v3.2", "decode", "memory", "fp8_paged_mqa_logits", N=64, B=128,
          L=32768, D=128, Dv=0, tag="logits-decode-32k"),
    Shape("deepseek-v3.2", "decode", "memory", "fp8_paged_mqa_logits", N=64, B=32, s_q=2,
          L=131072, D=128, Dv=0, tag="logits-decode-128k-mtp"),
    Shape("deepseek-v3.2", "prefill", "compute", "fp8_mqa_logits", N=64, s_q=4096, L=32768,
          D=128, Dv=0, causal=True, tag="logits-prefill-32k"),
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
    elif k == "top_k_per_row":
        flops = 0.0
        nbytes = 4 * sum(row_ends(s)) + 4 * s.B * s.topk + 8 * s.B
    elif k == "fp8_paged_mqa_logits":
        pairs = s.B * (s.s_q * (s.L - s.s_q) + s.s_q * (s.s_q + 1) // 2)
        flops = 2.0 * pairs * s.N * s.D
        nbytes = (s.B * s.L * INDEX_KEY_BYTES + s.B * s.s_q * (s.N * s.D + 4 * s.N)
                  + 4 * s.B * s.s_q * s.L + 4 * s.B * (1 + -(-s.L // PAGE)))
    elif k == "fp8_mqa_logits":
        flops = 2.0 * sum(row_ends(s)) * s.N * s.D
        nbytes = s.L * INDEX_KEY_BYTES + s.s_q * (s.N * s.D + 4 * s.N + 8) + 4 * s.s_q * s.L
    else:
        raise ValueError(f"no formula for kernel {k!r}; known: {list(KERNELS)}")
    return flops, float(nbytes)


def row_ends(s: Shape) -> list[int]:
    """Where each row of a ``top_k_per_row`` or ``fp8_mqa_logits`` shape ends (its rows start
    at 0): at ``L``, or causal (``fp8_mqa_logits`` always: a request's last queries) at
    ``L - R + 1 .. L``."""
    rows = s.B if s.kernel == "top_k_per_row" else s.s_q
    if s.kernel not in ("top_k_per_row", "fp8_mqa_logits"):
        raise ValueError(f"row_ends: {s.kernel!r} has no rows of logits")
    if rows > s.L:
        raise ValueError(f"shape {s.name}: {rows} rows of {s.L} keys (more rows than keys)")
    if s.kernel == "top_k_per_row" and not s.causal:
        return [s.L] * rows
    return list(range(s.L - rows + 1, s.L + 1))


def tiny(s: Shape) -> Shape:
    """``s`` at sizes the CPU runs in a moment (``--dry-run``): few requests, heads, tokens
    and keys; the head dims, cache format, causality and kernel kept."""
    r = dataclasses.replace
    if s.kernel in ("mla_decode_paged", "sparse_mla_decode"):
        return r(s, B=2, N=min(s.N, 2), L=2 * PAGE, topk=min(s.topk, 16),
                 window=min(s.window, 8))
    if s.kernel == "sparse_mla_prefill":
        return r(s, s_q=4, N=min(s.N, 2), L=2 * PAGE, topk=min(s.topk, 16))
    if s.kernel == "top_k_per_row":
        return r(s, B=4, L=2 * PAGE, topk=min(s.topk, 16))
    if s.kernel == "fp8_paged_mqa_logits":
        return r(s, B=2, N=min(s.N, 2), L=2 * PAGE)
    if s.kernel == "fp8_mqa_logits":
        return r(s, s_q=4, N=min(s.N, 2), L=2 * PAGE)
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
