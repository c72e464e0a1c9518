"""The walkthrough: every MLA path on one embedded example, checked against the definition.

One example (``Case``): random weights of a preset, and a batch of requests of
``context_lens[i] + new_tokens`` random hidden states each, at positions ``0 .. L_i - 1``.
Every path computes some of these requests' outputs, and each result is compared with the
definition (``mla.reference.naive_forward``) run in float64 on the CPU on the same inputs
upcast (conventions §11). The kernel-level rows compare ``mla_decode_paged`` with the dense
``absorbed_attention`` instead, on the same latents.

A row is produced by a function registered with ``@register_row``: it gets the ``Case`` and
returns a ``Measurement`` (the path's output, the reference it must equal, the seconds the
path took). Later paths (DCP, sparse, fast kernels) add rows the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property

import torch

from mla.compare import TOLERANCES, max_abs_err, rel_err
from mla.config import MLAConfig, get_config
from mla.reference import (
    absorb_q,
    absorbed_attention,
    chunked_prefill_forward,
    concat_and_cache_fp8_ds_mla,
    concat_and_cache_mla,
    convert_req_index_to_global_index,
    decode_forward,
    dequantize_fp8_ds_mla,
    make_block_table,
    mla_decode_paged,
    mla_front,
    naive_forward,
    plan_context_chunks,
    prefill_forward,
    slot_mapping_from_block_table,
    sparse_mla_decode,
    sparse_mla_prefill,
    write_context,
)
from mla.reference.dcp import (
    dcp_chunked_prefill_forward_simulated,
    dcp_decode_forward_simulated,
    plan_dcp_context_chunks,
)
from mla.weights import MLAWeights

__all__ = ["Case", "Measurement", "Row", "RowSpec", "ROWS", "DTYPES", "register_row",
           "run_walkthrough", "format_table"]

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
}
REFERENCE = torch.float64  # the definition always runs in float64 on the CPU


@dataclass
class Case:
    """The embedded example every row runs on.

    ``weights``/``hidden`` are in the path's dtype and device; ``weights_ref``/``hidden_ref``
    are the same numbers upcast to float64 on the CPU, the inputs of the reference.
    """

    config: MLAConfig
    dtype: torch.dtype
    device: torch.device
    context_lens: tuple[int, ...]
    new_tokens: int
    block_size: int
    max_context_chunk: int
    weights: MLAWeights
    hidden: list[torch.Tensor]  # request i: [context_lens[i] + new_tokens, H]
    weights_ref: MLAWeights = field(init=False)
    hidden_ref: list[torch.Tensor] = field(init=False)
    memo: dict[str, object] = field(default_factory=dict, repr=False)  # results rows share

    def __post_init__(self) -> None:
        self.weights_ref = self.weights.to(dtype=REFERENCE, device="cpu")
        self.hidden_ref = [h.to(dtype=REFERENCE, device="cpu") for h in self.hidden]

    @classmethod
    def build(cls, preset: str, dtype: torch.dtype, device: str | torch.device,
              context_lens: Sequence[int], new_tokens: int, block_size: int,
              max_context_chunk: int, seed: int) -> Case:
        config = get_config(preset)
        device = torch.device(device)
        weights = MLAWeights.random(config, seed=seed, dtype=dtype, device=device)
        gen = torch.Generator().manual_seed(seed + 1)
        hidden = [torch.randn(n + new_tokens, config.hidden_size, generator=gen,
                              dtype=REFERENCE).to(dtype=dtype, device=device)
                  for n in context_lens]
        return cls(config, dtype, device, tuple(context_lens), new_tokens, block_size,
                   max_context_chunk, weights, hidden)

    @property
    def seq_lens(self) -> list[int]:
        return [n + self.new_tokens for n in self.context_lens]

    @cached_property
    def reference(self) -> list[torch.Tensor]:
        """The definition's output ``[L_i, H]`` for every request (float64, CPU)."""
        return [naive_forward(self.weights_ref, h) for h in self.hidden_ref]

    def last_rows(self, n: int) -> torch.Tensor:
        """The reference's last ``n`` rows of every request: ``[B, n, H]``."""
        return torch.stack([ref[-n:] for ref in self.reference])

    def empty_cache(self, capacities: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A NaN-filled paged cache and a scattered block table for ``capacities``.

        NaN, so that a path reading a slot nobody wrote cannot pass.
        """
        block_table, num_blocks = make_block_table(list(capacities), self.block_size,
                                                   spare_blocks=1, device=self.device)
        kv_cache = torch.full((num_blocks, self.block_size, self.config.latent_dim),
                              float("nan"), dtype=self.dtype, device=self.device)
        return kv_cache, block_table


@dataclass
class Measurement:
    """What a row function returns: the path's output and the reference it must equal."""

    out: torch.Tensor
    ref: torch.Tensor
    seconds: float


@dataclass
class Row:
    """One line of the walkthrough table."""

    path: str
    reference: str
    rel_err: float
    max_abs_err: float
    seconds: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.rel_err <= self.tolerance  # False for NaN

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "passed": self.passed}


@dataclass(frozen=True)
class RowSpec:
    path: str
    reference: str
    fn: Callable[[Case], Measurement]


ROWS: list[RowSpec] = []


def register_row(path: str, reference: str = "naive_forward"
                 ) -> Callable[[Callable[[Case], Measurement]], Callable[[Case], Measurement]]:
    """Add a row to the walkthrough (rows run in registration order)."""
    def wrap(fn: Callable[[Case], Measurement]) -> Callable[[Case], Measurement]:
        if any(spec.path == path for spec in ROWS):
            raise ValueError(f"a walkthrough row named {path!r} is already registered")
        ROWS.append(RowSpec(path, reference, fn))
        return fn
    return wrap


def _timed(fn: Callable[[], torch.Tensor], device: torch.device
           ) -> tuple[torch.Tensor, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


# --- the rows ----------------------------------------------------------------------------

@register_row("naive (definition)")
def _naive(case: Case) -> Measurement:
    """The definition itself in the case's dtype: shows the dtype's own rounding."""
    out, sec = _timed(lambda: torch.cat([naive_forward(case.weights, h) for h in case.hidden]),
                      case.device)
    return Measurement(out, torch.cat(case.reference), sec)


@register_row("prefill one-shot (compute-friendly)")
def _prefill(case: Case) -> Measurement:
    out, sec = _timed(
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
    out, sec = _timed(lambda: chunked_prefill_forward(case.weights, new_hidden, qsl, list(ctx),
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
    out, sec = _timed(lambda: decode_forward(case.weights, hidden, kv_cache, block_table,
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
    out, sec = _timed(lambda: dcp_decode_forward_simulated(
        case.weights, hidden, kv_cache, block_table, cache_seqlens, DCP_DECODE_RANKS),
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
    out, sec = _timed(lambda: dcp_chunked_prefill_forward_simulated(
        case.weights, new_hidden, qsl, list(ctx), kv_cache, block_table, W, plan=plan),
        case.device)
    return Measurement(out, case.last_rows(new).flatten(0, 1), sec)


def _kernel(case: Case, s_q: int = 2) -> tuple[Measurement, Measurement]:
    """``mla_decode_paged`` on the paged cache vs ``absorbed_attention`` on dense latents.

    The latents come from the float64 front, rounded to the case's dtype: those are the
    kernel's inputs, and the reference sees them upcast. Returns the ``o`` and ``lse`` checks.
    """
    c, w = case.config, case.weights
    fronts = [mla_front(case.weights_ref, h, torch.arange(h.shape[0])) for h in case.hidden_ref]
    fronts = [type(f)(*(t.to(dtype=case.dtype, device=case.device) for t in f)) for f in fronts]
    kv_cache, block_table = case.empty_cache(case.seq_lens)
    for i, f in enumerate(fronts):
        pos = torch.arange(f.kv_c.shape[0], device=case.device)
        slots = slot_mapping_from_block_table(block_table, torch.full_like(pos, i), pos,
                                              case.block_size)
        concat_and_cache_mla(f.kv_c, f.k_pe, kv_cache, slots)
    cache_seqlens = torch.tensor(case.seq_lens, dtype=torch.int32, device=case.device)

    def path() -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.stack([torch.cat([absorb_q(f.q_nope[-s_q:], w.W_UK), f.q_pe[-s_q:]], dim=-1)
                         for f in fronts])  # [B, s_q, N, Lkv+R]
        o_lat, lse = mla_decode_paged(q, kv_cache, block_table, cache_seqlens,
                                      c.softmax_scale, causal=True, head_dim_v=c.kv_lora_rank)
        return torch.einsum("bsnl,lnv->bsnv", o_lat, w.W_UV), lse

    (out, lse), sec = _timed(path, case.device)
    w_ref, o_ref, lse_ref = case.weights_ref, [], []
    for f, L in zip(fronts, case.seq_lens):
        up = [t.to(dtype=REFERENCE, device="cpu") for t in f]
        q_nope, q_pe, kv_c, k_pe = up
        pos = torch.arange(L)
        o_i, lse_i = absorbed_attention(q_nope[-s_q:], q_pe[-s_q:], kv_c, k_pe, w_ref.W_UK,
                                        w_ref.W_UV, c.softmax_scale, causal=True,
                                        q_positions=pos[-s_q:], k_positions=pos)
        o_ref.append(o_i)
        lse_ref.append(lse_i)
    return (Measurement(out, torch.stack(o_ref), sec),
            Measurement(lse, torch.stack(lse_ref), sec))


def _kernel_memo(case: Case) -> tuple[Measurement, Measurement]:
    # one call gives both o and lse; the two rows report the same run (and its time)
    if "kernel" not in case.memo:
        case.memo["kernel"] = _kernel(case)
    return case.memo["kernel"]  # type: ignore[return-value]


@register_row("kernel mla_decode_paged s_q=2: o", reference="absorbed_attention (dense)")
def _kernel_out(case: Case) -> Measurement:
    return _kernel_memo(case)[0]


@register_row("kernel mla_decode_paged s_q=2: lse", reference="absorbed_attention (dense)")
def _kernel_lse(case: Case) -> Measurement:
    return _kernel_memo(case)[1]


# DeepSeek-V3.2 sparse kernels with a top-k that covers every visible key: they must then be
# the dense absorbed attention (conventions §10). The latents are the float64 front rounded to the
# case's dtype, as in the mla_decode_paged rows.

def _sparse_latents(case: Case) -> list:
    if "sparse_fronts" not in case.memo:
        fronts = [mla_front(case.weights_ref, h, torch.arange(h.shape[0]))
                  for h in case.hidden_ref]
        case.memo["sparse_fronts"] = [
            type(f)(*(t.to(dtype=case.dtype, device=case.device) for t in f)) for f in fronts]
    return case.memo["sparse_fronts"]  # type: ignore[return-value]


def _dense_ref(case: Case, fronts: list, s_q: int | None, latent=None) -> torch.Tensor:
    """absorbed_attention in float64 on the (upcast) latents; the last ``s_q`` queries."""
    w, c, outs = case.weights_ref, case.config, []
    for i, f in enumerate(fronts):
        q_nope, q_pe, kv_c, k_pe = (t.to(dtype=REFERENCE, device="cpu") for t in f)
        if latent is not None:
            kv_c, k_pe = latent[i]
        L = kv_c.shape[0]
        n = L if s_q is None else s_q
        pos = torch.arange(L)
        o, _ = absorbed_attention(q_nope[-n:], q_pe[-n:], kv_c, k_pe, w.W_UK, w.W_UV,
                                  c.softmax_scale, causal=True, q_positions=pos[-n:],
                                  k_positions=pos)
        outs.append(o)
    return torch.cat(outs) if s_q is None else torch.stack(outs)


def _causal_topk(q_pos: Sequence[int], topk: int, device: torch.device,
                 offset: int = 0) -> torch.Tensor:
    """Index rows naming every key up to the query's position (plus ``offset``), then -1."""
    rows = torch.full((len(q_pos), topk), -1, dtype=torch.int32, device=device)
    for r, p in enumerate(q_pos):
        rows[r, : p + 1] = offset + torch.arange(p, -1, -1, dtype=torch.int32, device=device)
    return rows


@register_row("sparse prefill (flash_mla_sparse_fwd), top-k covers context: o",
              reference="absorbed_attention (dense)")
def _sparse_prefill(case: Case) -> Measurement:
    """All requests' queries in one call over one flat ``kv`` (request i's rows at its offset),
    as vLLM calls the kernel on a gathered workspace."""
    c, w, dev = case.config, case.weights, case.device
    fronts = _sparse_latents(case)
    kv = torch.cat([torch.cat([f.kv_c, f.k_pe], dim=-1) for f in fronts])
    topk = max(case.seq_lens) + 5  # wider than any request: padded with -1
    indices = torch.cat([_causal_topk(range(L), topk, dev, offset=sum(case.seq_lens[:i]))
                         for i, L in enumerate(case.seq_lens)])

    def path() -> torch.Tensor:
        q = torch.cat([torch.cat([absorb_q(f.q_nope, w.W_UK), f.q_pe], dim=-1) for f in fronts])
        o_lat, _, _ = sparse_mla_prefill(q, kv, indices, c.softmax_scale, d_v=c.kv_lora_rank)
        return torch.einsum("snl,lnv->snv", o_lat, w.W_UV)

    out, sec = _timed(path, dev)
    return Measurement(out, _dense_ref(case, fronts, None), sec)


def _sparse_decode(case: Case, fp8: bool, s_q: int = 2) -> Measurement:
    """The last ``s_q`` tokens of every request on the paged cache, their request-local
    top-k converted to global slots. ``fp8``: the cache is ``fp8_ds_mla``; a latent smaller
    than 512 + 64 is zero-padded into the format (zeros add nothing to any dot product), and
    the reference reads the latent as the cache rounded it."""
    c, w, dev, bs = case.config, case.weights, case.device, case.block_size
    fronts = _sparse_latents(case)
    Lkv, R = c.kv_lora_rank, c.qk_rope_head_dim
    if fp8 and (Lkv > 512 or R > 64):
        raise ValueError(f"fp8_ds_mla holds at most 512 + 64 latent values, config "
                         f"{c.name!r} has {Lkv} + {R}")
    pad_c, pad_r = (512 - Lkv, 64 - R) if fp8 else (0, 0)
    block_table, num_blocks = make_block_table(case.seq_lens, bs, spare_blocks=1, device=dev)
    if fp8:
        kv_cache = torch.full((num_blocks, bs, 656), 0xFF, dtype=torch.uint8, device=dev)
    else:
        kv_cache, block_table = case.empty_cache(case.seq_lens)
    for i, f in enumerate(fronts):
        pos = torch.arange(f.kv_c.shape[0], device=dev)
        slots = slot_mapping_from_block_table(block_table, torch.full_like(pos, i), pos, bs)
        if fp8:
            kv_c = torch.nn.functional.pad(f.kv_c, (0, pad_c))
            concat_and_cache_fp8_ds_mla(kv_c, torch.nn.functional.pad(f.k_pe, (0, pad_r)),
                                        kv_cache, slots)
        else:
            concat_and_cache_mla(f.kv_c, f.k_pe, kv_cache, slots)
    topk = max(case.seq_lens) + 3
    local = torch.cat([_causal_topk(range(L - s_q, L), topk, dev) for L in case.seq_lens])
    req = torch.arange(len(fronts), dtype=torch.int32, device=dev).repeat_interleave(s_q)
    slots = convert_req_index_to_global_index(req, block_table.to(torch.int32), local, bs)
    slots = slots.view(len(fronts), s_q, topk)

    def path() -> torch.Tensor:
        q = torch.stack([torch.cat([torch.nn.functional.pad(absorb_q(f.q_nope[-s_q:], w.W_UK),
                                                            (0, pad_c)),
                                    torch.nn.functional.pad(f.q_pe[-s_q:], (0, pad_r))], dim=-1)
                         for f in fronts])  # [B, s_q, N, row width]
        o_lat, _ = sparse_mla_decode(q, kv_cache, slots, c.softmax_scale, fp8,
                                     head_dim_v=Lkv + pad_c)
        return torch.einsum("bsnl,lnv->bsnv", o_lat[..., :Lkv], w.W_UV)

    out, sec = _timed(path, dev)
    latent = None
    if fp8:  # what the cache holds, read back (exact in float64)
        latent = []
        for i, L in enumerate(case.seq_lens):
            pos = torch.arange(L, device=dev)
            rows = kv_cache.view(-1, 656)[block_table[i].long()[pos // bs] * bs + pos % bs]
            kv_c, k_pe = dequantize_fp8_ds_mla(rows.cpu())
            latent.append((kv_c[:, :Lkv].to(REFERENCE), k_pe[:, :R].to(REFERENCE)))
    return Measurement(out, _dense_ref(case, fronts, s_q, latent), sec)


@register_row("sparse decode s_q=2, latent cache: o", reference="absorbed_attention (dense)")
def _sparse_decode_latent(case: Case) -> Measurement:
    return _sparse_decode(case, fp8=False)


@register_row("sparse decode s_q=2, fp8_ds_mla cache: o",
              reference="absorbed_attention (dense, cached fp8 latent)")
def _sparse_decode_fp8(case: Case) -> Measurement:
    return _sparse_decode(case, fp8=True)


# --- running and printing ----------------------------------------------------------------

DEFAULT_CONTEXT_LENS = (0, 1, 17, 40, 70)  # an empty and a length-1 context; 70 spans 2 pages


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise TypeError(f"dtype must be one of {list(DTYPES)}, got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


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
) -> list[Row]:
    """Run every registered row on the embedded example and return the table's rows.

    ``new_tokens >= 2`` so that the MTP decode (``s_q = 2``) has two tokens in every request.
    ``progress`` is called with a line before each row runs (the CLI prints it to stderr).
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
    case = Case.build(preset, torch_dtype, device, context_lens, new_tokens, block_size,
                      max_context_chunk, seed)
    tol = TOLERANCES[torch_dtype]
    rows = []
    for k, spec in enumerate(ROWS):
        if progress is not None:
            progress(f"[{k + 1}/{len(ROWS)}] {spec.path} ...")
        m = spec.fn(case)
        rows.append(Row(spec.path, spec.reference, rel_err(m.out, m.ref),
                        max_abs_err(m.out, m.ref), m.seconds, tol))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width text table."""
    head = ("path", "against", "rel err", "max abs err", "time", "ok")
    body = [(r.path, r.reference, f"{r.rel_err:.2e}", f"{r.max_abs_err:.2e}",
             f"{r.seconds * 1e3:.1f} ms", "yes" if r.passed else "NO")
            for r in rows]
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]
    left = (True, True, False, False, False, True)

    def fmt(line: Sequence[str]) -> str:
        cells = [c.ljust(wd) if lft else c.rjust(wd) for c, wd, lft in zip(line, widths, left)]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * wd for wd in widths)
    return "\n".join([fmt(head), rule, *(fmt(line) for line in body)])
