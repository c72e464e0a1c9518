"""Random inputs of a shape (``mla.bench.shapes``), built once and shared by every target.

Decode caches are paged (64 tokens a page) with each request's pages scattered over the
pool, as an allocator leaves them after a while; sparse indices pick distinct tokens of a
request's own pages (decode) or of the whole array (prefill). fp8 caches hold valid bytes:
e4m3 values without the NaN codes, power-of-two scales and bfloat16 rope values. The values
are random: timing does not depend on them, except that NaN or inf would be unrealistic.

The indexer's inputs have fixed dtypes whatever ``dtype`` says: float32 logits for the top-k
(rows from column 0, ending as ``shapes.row_ends`` says), e4m3 ``q`` and keys with float32
weights (``~ 1/sqrt(H·D)``) and power-of-two key scales for the logits, the paged keys in the
indexer cache's page layout (``mla.reference.indexer_cache``: a page's codes, then its
scales) over scattered pages of 64.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mla.bench.shapes import INDEX_KEY_BYTES, PAGE, ROW_BYTES, Shape, row_ends

__all__ = ["Inputs", "build_inputs"]


@dataclasses.dataclass
class Inputs:
    """A call's arguments in ``mla.reference``'s signature of the kernel."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def nbytes(self) -> int:
        """Bytes of the tensors (what the shape keeps on the device)."""
        ts = [a for a in (*self.args, *self.kwargs.values()) if isinstance(a, torch.Tensor)]
        return sum(t.untyped_storage().nbytes() for t in ts)


def _distinct(rows: int, n: int, k: int, gen: torch.Generator, device: torch.device
              ) -> torch.Tensor:
    """``rows × k`` distinct picks in ``[0, n)`` per row, int64 (argsort of random keys, a
    block of rows at a time to bound the memory)."""
    out = torch.empty(rows, k, dtype=torch.long, device=device)
    step = max(1, (1 << 26) // max(n, 1))
    for a in range(0, rows, step):
        b = min(a + step, rows)
        out[a:b] = torch.rand(b - a, n, device=device, generator=gen).argsort(dim=1)[:, :k]
    return out


def _pages(B: int, tokens: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """``[B, pages]`` int64 block table: the pool's pages shuffled among the requests."""
    per = -(-tokens // PAGE)
    return torch.randperm(B * per, device=device, generator=gen).view(B, per)


def _slots(table: torch.Tensor, tokens: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``[B, 1, k]`` int32 global slots of ``k`` distinct tokens of each request's pages."""
    local = _distinct(table.shape[0], tokens, k, gen, table.device)
    slots = table.gather(1, local // PAGE) * PAGE + local % PAGE
    return slots.to(torch.int32).unsqueeze(1)


def _fp8_ds_mla(nb: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """``uint8 [nb, 64, 656]``: 512 e4m3 bytes, 4 float32 scales (2^-10..2^-7), 64 bf16."""
    cache = torch.randint(0, 256, (nb, PAGE, ROW_BYTES["fp8_ds_mla"]), device=device,
                          dtype=torch.uint8, generator=gen)
    cache[..., :512] &= 0xFE  # no NaN codes 0x7F / 0xFF
    scales = torch.pow(2.0, -torch.randint(7, 11, (nb, PAGE, 4), device=device,
                                           generator=gen).float())
    cache[..., 512:528] = scales.view(torch.uint8).view(nb, PAGE, 16)
    pe = torch.randn(nb, PAGE, 64, device=device, generator=gen).to(torch.bfloat16)
    cache[..., 528:] = pe.view(torch.uint8).view(nb, PAGE, 128)
    return cache


def _model1(nb: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """The ``[nb, 64, 584]`` view of random valid MODEL1 pages (DeepSeek-V4)."""
    from mla.reference.fp8_model1 import fp8_model1_cache, fp8_model1_page_bytes

    pages = torch.randint(0, 256, (nb, fp8_model1_page_bytes(PAGE)), device=device,
                          dtype=torch.uint8, generator=gen)
    data = pages[:, :576 * PAGE].view(nb, PAGE, 576)
    data[..., :448] &= 0xFE  # no NaN codes
    rope = torch.randn(nb, PAGE, 64, device=device, generator=gen).to(torch.bfloat16)
    data[..., 448:] = rope.view(torch.uint8)
    scales = pages[:, 576 * PAGE:584 * PAGE].view(nb, PAGE, 8)
    scales.copy_(torch.randint(118, 122, scales.shape, device=device, dtype=torch.uint8,
                               generator=gen))  # UE8M0 2^-9..2^-6
    return fp8_model1_cache(pages, PAGE)


def _e4m3(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Random e4m3 numbers of any sign, never a NaN code (0x7F / 0xFF)."""
    codes = torch.randint(0, 256, shape, device=device, dtype=torch.uint8, generator=gen)
    return (codes & 0xFE).view(torch.float8_e4m3fn)


def _key_scales(n: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """float32 ``[n]`` powers of two 2^-10 .. 2^-7 (UE8M0 scales, as DeepSeek-V3.2's)."""
    return torch.pow(2.0, -torch.randint(7, 11, (n,), device=device, generator=gen).float())


def _index_cache(nb: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """``uint8 [nb, 64, 132]`` indexer key pages: 64 × 128 e4m3 codes, then 64 float32
    scales."""
    cache = torch.empty(nb, PAGE, INDEX_KEY_BYTES, device=device, dtype=torch.uint8)
    flat = cache.view(nb, PAGE * INDEX_KEY_BYTES)
    flat[:, :PAGE * 128] = _e4m3((nb, PAGE * 128), gen, device).view(torch.uint8)
    flat[:, PAGE * 128:] = _key_scales(nb * PAGE, gen, device).view(torch.uint8).view(nb, -1)
    return cache


def _index_q(rows: int, s: Shape, gen: torch.Generator, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 ``q [rows, H, D]`` and float32 ``weights [rows, H]``."""
    w = torch.randn(rows, s.N, device=device, generator=gen) * (s.N * s.D) ** -0.5
    return _e4m3((rows, s.N, s.D), gen, device), w


def _cache(s: Shape, nb: int, dtype: torch.dtype, gen: torch.Generator,
           device: torch.device) -> torch.Tensor:
    if s.cache == "fp8_ds_mla":
        return _fp8_ds_mla(nb, gen, device)
    if s.cache == "model1":
        return _model1(nb, gen, device)
    return torch.randn(nb, PAGE, s.D, device=device, generator=gen).to(dtype)


def build_inputs(s: Shape, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> Inputs:
    """The arguments of one call of ``s.kernel`` (``mla.reference``'s signature) on
    ``device``, float inputs in ``dtype`` (the indexer's: their own dtypes, see the module
    doc); the same ``seed`` gives the same inputs."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    k = s.kernel
    if k == "mla_decode_paged":
        table = _pages(s.B, s.L, gen, device)
        kv = _cache(s, table.numel(), dtype, gen, device)
        lens = torch.full((s.B,), s.L, dtype=torch.int32, device=device)
        return Inputs((randn(s.B, s.s_q, s.N, s.D), kv, table.to(torch.int32), lens, s.scale,
                       s.causal, s.Dv), {})
    if k == "sparse_mla_decode":
        table = _pages(s.B, s.L, gen, device)
        kv = _cache(s, table.numel(), dtype, gen, device)
        idx = _slots(table, s.L, s.topk, gen).expand(s.B, s.s_q, s.topk).contiguous()
        kwargs: dict[str, Any] = {}
        if s.window:
            wtable = _pages(s.B, s.window, gen, device)
            kwargs = {"extra_k_cache": _cache(s, wtable.numel(), dtype, gen, device),
                      "extra_indices_in_kvcache": _slots(wtable, s.window, s.window, gen)
                      .expand(s.B, s.s_q, s.window).contiguous()}
        return Inputs((randn(s.B, s.s_q, s.N, s.D), kv, idx, s.scale, s.cache != "bf16", None,
                       s.Dv), kwargs)
    if k == "sparse_mla_prefill":
        idx = _distinct(s.s_q, s.L, s.topk, gen, device).to(torch.int32)
        return Inputs((randn(s.s_q, s.N, s.D), randn(s.L, s.D), idx, s.scale, s.Dv), {})
    if k == "merge_attn_states":
        def lse() -> torch.Tensor:
            return torch.randn(s.N, s.s_q, device=device, generator=gen) + 5.0
        return Inputs((randn(s.s_q, s.N, s.D), lse(), randn(s.s_q, s.N, s.D), lse()), {})
    if k == "attention_with_lse":
        return Inputs((randn(s.s_q, s.N, s.D), randn(s.s_q, s.N, s.D), randn(s.s_q, s.N, s.Dv),
                       s.scale, s.causal), {})
    if k == "top_k_per_row":
        ends = torch.tensor(row_ends(s), dtype=torch.int32, device=device)
        logits = torch.randn(s.B, s.L, device=device, generator=gen)
        return Inputs((logits, torch.zeros_like(ends), ends, s.topk), {})
    if k == "fp8_paged_mqa_logits":
        table = _pages(s.B, s.L, gen, device)
        cache = _index_cache(table.numel(), gen, device)
        q, w = _index_q(s.B * s.s_q, s, gen, device)
        lens = torch.full((s.B,), s.L, dtype=torch.int32, device=device)
        return Inputs((q.view(s.B, s.s_q, s.N, s.D), cache, w, lens, table.to(torch.int32),
                       s.L), {})
    if k == "fp8_mqa_logits":
        ke = torch.tensor(row_ends(s), dtype=torch.int32, device=device)
        kv = (_e4m3((s.L, s.D), gen, device), _key_scales(s.L, gen, device))
        q, w = _index_q(s.s_q, s, gen, device)
        # rows compressed to max_seqlen_k = L, as vLLM's prefill indexer asks (one request
        # from key 0: column j holds key j, as in full rows)
        return Inputs((q, kv, w, torch.zeros_like(ke), ke), {"max_seqlen_k": s.L})
    raise ValueError(f"no input builder for kernel {k!r}")
