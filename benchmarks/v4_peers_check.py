"""``python -m benchmarks.v4_peers_check --out-dir DIR [--device cuda|cpu] [--tokens N]``:
vLLM 0.33's DeepSeek-V4 Triton compressor and indexer-q kernels against ``mla.reference.v4``.

Needs ``peers/`` from ``python -m benchmarks.peers --v4`` (or ``$MLA_PEERS``): the kernels,
copied verbatim from the wheel into one module. Checks, each on its own:

1. ``compressor-d512-r{4,128}-{prefill,chunked,decode}``: the main compressor (``d = 512``,
   ratio 4 with overlap, ratio 128). vLLM's ``save_partial_states`` kernel writes ``kv`` and
   ``score + ape`` of a request's tokens into the fp32 state cache (``[blocks, block_size,
   2·coff·d]``, block size 4 for C4 and 8 for C128, blocks scattered by a block table, pages
   padded), then ``_fused_kv_compress_norm_rope_insert_sparse_attn`` (the Triton path: on CUDA
   vLLM runs CuTe-DSL kernels for ``d = 512`` instead, which are not in this check) pools,
   norms, rotates, quantizes and stores each entry into the MODEL1 (584-byte) compressed cache
   (pages of ``256 / r`` entries). The tokens come in one prefill step, in uneven chunks, and
   one by one (decode). The entries' bytes are compared with ``compressed_entries_model1_pages
   (compress(...), scale_floor="vllm")`` (the Triton floor); also counted: the scale bytes
   that differ from the ``"flashmla"`` floor (the norm weight of tiles 5 and 6 is made small so
   that those tiles' amax falls below ``448·2^-14``, where the floors differ).
2. ``indexer-compressor-d128-r4-*``: the indexer's compressor (``d = 128``, ratio 4,
   ``_fused_kv_compress_norm_rope_insert_indexer_attn``, the fp8 132-byte key cache with an
   fp32 scale) against ``quantize_compressed_indexer_entries``.
3. ``indexer-q``: ``FusedIndexerQRopeQuantTritonKernel.kernel`` (the FP8 Triton path; CUDA
   runs a CuTe-DSL kernel where ``cutlass`` is installed): q's rope, e4m3 per (token, head)
   and the weight fold, against ``v4_indexer_q`` / ``v4_indexer_weights`` (``quantize=True``),
   64 heads of 128 and ``q_lora_rank = 1024`` (DeepSeek-V4-Flash's widths).

Inputs are chosen so that both sides start from the same numbers: ``kv``, ``score`` and
``ape`` are bf16 values (their fp32 sum is exact; vLLM's GEMM gives fp32), fed to the reference
through a compressor whose ``wkv`` and ``wgate`` select them from ``x = [kv ‖ score]``; the
indexer's ``q`` is the reference's own bf16 GEMM output. The RoPE table is the reference's
float64 cos and sin rounded to fp32 (vLLM tabulates in fp32). Byte differences are listed with
a few examples (entry or token, channel, ours, theirs, and the exact value over the scale) so
that each can be named: a tie, a rounding of the fp32 arithmetic, or a rule.

Writes ``DIR/v4_peers_check.json`` (GPU, versions, date, a row per check: counts, maxima,
examples, errors with traceback) and prints a table. ``--device cpu`` runs the kernels under
Triton's interpreter (``TRITON_INTERPRET=1``, set here), whose fp8 conversions round ties away
from zero: byte differences there may be the interpreter's; the GPU decides.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODULE = "vllm.models.deepseek_v4.common.ops.v4_kernels"
OUT_NAME = "v4_peers_check.json"
N_EXAMPLES = 8
STATE_BLOCK = {4: 4, 128: 8}  # the compressor state cache's block size (vLLM's)
KV_PAGE_TOKENS = 256  # a KV block's tokens: 256 / r compressed entries a page
PAGE_ALIGN = 576  # fp8_ds_mla pages are padded to a multiple of this
FILL = 0xA5  # unwritten cache bytes
SMALL_TILES = {5: 2.0 ** -7, 6: 2.0 ** -12}  # d = 512: norm weight factors of these tiles


# ---- what is written: a row per check ---------------------------------------------------------

def check_row(name: str, *, kind: str, counts: dict[str, int] | None = None,
              maxima: dict[str, float] | None = None, examples: list[dict] | None = None,
              notes: list[str] | None = None, error: BaseException | None = None,
              tb: str | None = None) -> dict[str, Any]:
    """One check's JSON row. ``status``: ``"error"`` with ``error``, else ``"exact"`` when every
    count whose name starts with ``"bytes_diff"`` is 0, else ``"differs"``."""
    counts = {k: int(v) for k, v in (counts or {}).items()}
    maxima = {k: (None if v is None else float(v)) for k, v in (maxima or {}).items()}
    if error is not None:
        status = "error"
    elif any(v for k, v in counts.items() if k.startswith("bytes_diff")):
        status = "differs"
    else:
        status = "exact"
    row: dict[str, Any] = {"check": name, "kind": kind, "status": status, "counts": counts,
                           "maxima": maxima, "examples": list(examples or [])[:N_EXAMPLES],
                           "notes": list(notes or [])}
    if error is not None:
        row["error"] = f"{type(error).__name__}: {error}"
        row["traceback"] = tb or "".join(traceback.format_exception(error))
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The printed summary: a line per row."""
    lines = [f"{'check':<36} {'status':<8} {'compared':>9} {'bytes diff':>10}  maxima"]
    for r in rows:
        c = r["counts"]
        diff = sum(v for k, v in c.items() if k.startswith("bytes_diff"))
        compared = c.get("bytes_compared", 0)
        mx = ", ".join(f"{k}={v:.3g}" for k, v in r["maxima"].items() if v is not None)
        if r["status"] == "error":
            mx = r["error"][:80]
        lines.append(f"{r['check']:<36} {r['status']:<8} {compared:>9} {diff:>10}  {mx}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.v4_peers_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, required=True, help=f"where {OUT_NAME} goes")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: Triton's interpreter (TRITON_INTERPRET=1, set here)")
    p.add_argument("--tokens", type=int, default=300,
                   help="the request's tokens for the compressor checks (default 300)")
    p.add_argument("--q-tokens", type=int, default=64,
                   help="tokens for the indexer-q check (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="",
                   help="comma-separated prefixes of the checks to run (default: all)")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.q_tokens < 1:
        p.error("--tokens and --q-tokens must be positive")
    return args


def schedules(tokens: int) -> dict[str, list[int]]:
    """Step sizes feeding ``tokens`` tokens: all at once, uneven chunks, one at a time."""
    chunks, left, k = [], tokens, 0
    for size in (37, 1, 131, 3, 64):
        if left <= 0:
            break
        chunks.append(min(size, left))
        left -= chunks[-1]
        k += 1
    while left > 0:
        chunks.append(min(53, left))
        left -= chunks[-1]
    return {"prefill": [tokens], "chunked": chunks, "decode": [1] * tokens}


# ---- the peer's module ------------------------------------------------------------------------

def _peers() -> Path:
    root = Path(os.environ.get("MLA_PEERS", REPO / "peers"))
    if not (root / (MODULE.replace(".", "/") + ".py")).is_file():
        raise SystemExit(f"{root} has no {MODULE}: run python -m benchmarks.peers --v4 and "
                         "carry peers/ over (or set MLA_PEERS)")
    return root


def _load(root: Path):  # noqa: ANN202 (a module)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location(
        "v4_peer_kernels", root / (MODULE.replace(".", "/") + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- inputs -----------------------------------------------------------------------------------

def _bf16_randn(g, *shape: int, scale: float = 1.0):  # noqa: ANN001, ANN202
    import torch
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(
        torch.bfloat16).to(torch.float64)


def cos_sin_table(config, ratio: int, rows: int):  # noqa: ANN001, ANN202
    """fp32 ``[rows, R]``: cos of the R/2 angles, then sin (vLLM's cos_sin_cache layout)."""
    import torch

    from mla.reference.v4.rope import v4_rope_frequencies
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * v4_rope_frequencies(config, ratio)
    return torch.cat([angles.cos(), angles.sin()], dim=1).float()


def selecting_compressor(d: int, ratio: int, ape, norm):  # noqa: ANN001, ANN202
    """A ``CompressorWeights`` of hidden ``2·coff·d`` whose ``kv`` is ``x[:, :coff·d]`` and
    whose score is ``x[:, coff·d:] + ape``."""
    import torch

    from mla.reference.v4.compressor import CompressorWeights
    W = (2 if ratio == 4 else 1) * d
    eye = torch.eye(W, dtype=torch.float64)
    zero = torch.zeros(W, W, dtype=torch.float64)
    return CompressorWeights(wkv=torch.cat([eye, zero], 1), wgate=torch.cat([zero, eye], 1),
                             ape=ape, norm=norm)


# ---- the compressor ---------------------------------------------------------------------------

def run_peer_compressor(mod, x, ape, norm, cos_sin, *, d: int, ratio: int,  # noqa: ANN001
                        steps: list[int], device: str, seed: int, eps: float):
    """Feed ``x [T, 2W]`` (``[kv ‖ score]``) step by step through ``save_partial_states`` and
    the compress kernel; returns the cache's bytes of each entry: ``uint8 [n, 584]`` (d = 512)
    or ``uint8 [n, 132]`` (d = 128: 128 codes, then the fp32 scale's 4 bytes)."""
    import torch

    from mla.conformance.adapters.vllm_v4 import launch_compress

    T = x.shape[0]
    coff = 2 if ratio == 4 else 1
    W = coff * d
    bs = STATE_BLOCK[ratio]
    g = torch.Generator().manual_seed(seed + 17)
    n_state = -(-T // bs)
    phys = torch.randperm(n_state, generator=g) + 1  # 0 is vLLM's null block
    state_buf = torch.full((n_state + 1, bs + 1, 2 * W), float("nan"), dtype=torch.float32)
    state = state_buf.to(device)[:, :bs]  # padded pages: stride(0) > bs · 2W
    block_table = torch.zeros(2, n_state + 3, dtype=torch.int32)
    block_table[1, :n_state] = phys.int()
    block_table = block_table.to(device)
    pos_all = torch.arange(T)
    state_slots = (phys[pos_all // bs] * bs + pos_all % bs).long()

    n_entries = T // ratio
    kv_bs = max(KV_PAGE_TOKENS // ratio, 1)
    row = 584 if d == 512 else 132
    data_bytes, scale_bytes = (576, 8) if d == 512 else (128, 4)
    page = -(-kv_bs * row // PAGE_ALIGN) * PAGE_ALIGN
    n_kv = max(-(-n_entries // kv_bs), 1)
    kv_phys = torch.randperm(n_kv, generator=g) + 1
    kv_buf = torch.full((n_kv + 1, page), FILL, dtype=torch.uint8, device=device)
    kv_cache = kv_buf.as_strided((n_kv + 1, kv_bs, row), (page, row, 1))
    ent = pos_all // ratio
    kv_slots = torch.where((pos_all + 1) % ratio == 0,
                           kv_phys[(ent // kv_bs).clamp_max(n_kv - 1)] * kv_bs + ent % kv_bs, -1)

    xs = x.float().to(device)
    ape_d = ape.float().to(device)
    norm_d = norm.to(torch.bfloat16).to(device)
    cos_sin_d = cos_sin.to(device)
    start = 0
    for n in steps:
        sl = slice(start, start + n)
        kv, score = xs[sl, :W], xs[sl, W:]  # views of one row, as vLLM splits kv_score
        positions = pos_all[sl].to(device)
        slots = state_slots[sl].to(device)
        launch_compress(mod, kv, score, ape_d, positions, state, slots, bs,
                        torch.ones(n, dtype=torch.int32, device=device), block_table, norm_d,
                        eps, cos_sin_d, kv_cache, kv_slots[sl].to(device), ratio)
        start += n
    buf = kv_buf.cpu()
    j = torch.arange(n_entries)
    blk, off = kv_phys[j // kv_bs], j % kv_bs
    data = buf[blk[:, None], off[:, None] * data_bytes + torch.arange(data_bytes)]
    scales = buf[blk[:, None], kv_bs * data_bytes + off[:, None] * scale_bytes
                 + torch.arange(scale_bytes)]
    written = torch.zeros_like(buf, dtype=torch.bool)
    written[blk[:, None], off[:, None] * data_bytes + torch.arange(data_bytes)] = True
    written[blk[:, None], kv_bs * data_bytes + off[:, None] * scale_bytes
            + torch.arange(scale_bytes)] = True
    stray = int(((buf != FILL) & ~written).sum())
    return torch.cat([data, scales], dim=1), stray


def _e4m3(b):  # noqa: ANN001, ANN202
    import torch
    return b.contiguous().view(torch.float8_e4m3fn).double()


def compare_model1(ours, theirs, exact, flashmla_scales) -> dict[str, Any]:  # noqa: ANN001
    """``ours``, ``theirs`` ``uint8 [n, 584]`` (the reference's, the peer's entries),
    ``exact [n, 512]`` float64 (the unrounded entries), ``flashmla_scales uint8 [n, 7]``."""
    import torch
    n = ours.shape[0]
    diff = ours != theirs
    nope_d, rope_d, scale_d = diff[:, :448], diff[:, 448:576], diff[:, 576:584]
    o_exp = ours[:, 576:583].double() - 127
    t_exp = theirs[:, 576:583].double() - 127
    o_scale, t_scale = torch.pow(2.0, o_exp), torch.pow(2.0, t_exp)
    o_nope = (_e4m3(ours[:, :448]).view(n, 7, 64) * o_scale[..., None]).view(n, 448)
    t_nope = (_e4m3(theirs[:, :448]).view(n, 7, 64) * t_scale[..., None]).view(n, 448)
    tile_scale = o_scale.repeat_interleave(64, dim=1)
    o_rope = ours[:, 448:576].contiguous().view(torch.bfloat16).double()
    t_rope = theirs[:, 448:576].contiguous().view(torch.bfloat16).double()
    rope_amax = o_rope.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    examples = []
    ex_idx = diff.nonzero().tolist()
    for e, b in ex_idx[:N_EXAMPLES]:
        if b < 448:
            t = b // 64
            examples.append({"entry": e, "region": "nope", "channel": b, "ours": int(ours[e, b]),
                             "theirs": int(theirs[e, b]),
                             "ours_value": float(o_nope[e, b]), "theirs_value": float(t_nope[e, b]),
                             "exact_over_scale": float(exact[e, b] / o_scale[e, t]),
                             "bf16_over_scale": float(exact[e, b].to(torch.bfloat16).double()
                                                      / o_scale[e, t])})
        elif b < 576:
            c = 448 + (b - 448) // 2
            examples.append({"entry": e, "region": "rope", "channel": c, "byte": b,
                             "ours": int(ours[e, b]), "theirs": int(theirs[e, b]),
                             "ours_value": float(o_rope[e, c - 448]),
                             "theirs_value": float(t_rope[e, c - 448]),
                             "exact": float(exact[e, c])})
        else:
            examples.append({"entry": e, "region": "scale", "tile": b - 576,
                             "ours": int(ours[e, b]), "theirs": int(theirs[e, b])})
    finite = torch.isfinite(t_nope).all() and torch.isfinite(t_rope).all()
    return {
        "counts": {"entries": n, "bytes_compared": diff.numel(),
                   "bytes_diff_nope": int(nope_d.sum()), "bytes_diff_rope": int(rope_d.sum()),
                   "bytes_diff_scale": int(scale_d.sum()),
                   "entries_differing": int(diff.any(dim=1).sum()),
                   "scale_bytes_diff_vs_flashmla_floor": int(
                       (theirs[:, 576:583] != flashmla_scales).sum()),
                   "ref_scale_bytes_diff_vs_flashmla_floor": int(
                       (ours[:, 576:583] != flashmla_scales).sum())},
        "maxima": {"nope_dequant_diff_in_scales": float(
                       ((o_nope - t_nope).abs() / tile_scale).max()) if n else 0.0,
                   "rope_diff_rel_entry_amax": float(
                       ((o_rope - t_rope).abs() / rope_amax).max()) if n else 0.0,
                   "nope_err_vs_exact_in_scales": float(
                       ((t_nope - exact[:, :448]).abs() / tile_scale).max()) if n else 0.0},
        "examples": examples, "finite": bool(finite)}


def compare_indexer_k(ours_codes, ours_scale, theirs, exact) -> dict[str, Any]:  # noqa: ANN001
    """``ours_codes uint8 [n, 128]``, ``ours_scale`` float32 ``[n]``, ``theirs uint8 [n, 132]``
    (codes, fp32 scale bytes), ``exact [n, 128]`` float64."""
    import torch
    n = ours_codes.shape[0]
    t_codes = theirs[:, :128]
    t_scale = theirs[:, 128:132].contiguous().view(torch.float32)[:, 0]
    o_bytes = torch.cat([ours_codes, ours_scale.float()[:, None].view(torch.uint8)], dim=1)
    diff = o_bytes != theirs
    o_val = _e4m3(ours_codes) * ours_scale.double()[:, None]
    t_val = _e4m3(t_codes) * t_scale.double()[:, None]
    examples = []
    for e, b in diff.nonzero().tolist()[:N_EXAMPLES]:
        if b < 128:
            examples.append({"entry": e, "channel": b, "ours": int(ours_codes[e, b]),
                             "theirs": int(t_codes[e, b]), "ours_value": float(o_val[e, b]),
                             "theirs_value": float(t_val[e, b]),
                             "bf16_over_scale": float(exact[e, b].to(torch.bfloat16).double()
                                                      / float(ours_scale[e]))})
        else:
            examples.append({"entry": e, "region": "scale", "ours": float(ours_scale[e]),
                             "theirs": float(t_scale[e])})
    scale = ours_scale.double()[:, None]
    return {
        "counts": {"entries": n, "bytes_compared": diff.numel(),
                   "bytes_diff_codes": int(diff[:, :128].sum()),
                   "bytes_diff_scale": int(diff[:, 128:].sum()),
                   "entries_differing": int(diff.any(dim=1).sum())},
        "maxima": {"dequant_diff_in_scales": float(((o_val - t_val).abs() / scale).max())
                   if n else 0.0,
                   "err_vs_exact_in_scales": float(((t_val - exact).abs() / scale).max())
                   if n else 0.0},
        "examples": examples}


def compressor_inputs(d: int, ratio: int, tokens: int, seed: int):  # noqa: ANN202
    """``x [T, 2W]`` (bf16 values), ``ape [r, W]`` (bf16 values), ``norm [d]`` (bf16 values;
    for d = 512 the tiles of ``SMALL_TILES`` scaled down)."""
    import torch
    W = (2 if ratio == 4 else 1) * d
    g = torch.Generator().manual_seed(seed * 1000 + d + ratio)
    x = _bf16_randn(g, tokens, 2 * W)
    ape = _bf16_randn(g, ratio, W)
    norm = (1.0 + 0.1 * torch.randn(d, generator=g, dtype=torch.float64))
    if d == 512:
        for t, f in SMALL_TILES.items():
            norm[t * 64:(t + 1) * 64] *= f
    return x, ape, norm.to(torch.bfloat16).to(torch.float64)


def compressor_checks(mod, args, config) -> list[tuple[str, Callable[[], dict]]]:  # noqa: ANN001
    """(name, thunk) per compressor check; a thunk returns the row's fields."""
    import torch

    from mla.reference.fp8_model1 import quantize_fp8_model1  # noqa: F401 (named in the doc)
    from mla.reference.v4.compressor import (
        compress,
        compressed_entries_model1_pages,
        quantize_compressed_indexer_entries,
    )
    cos_sin = cos_sin_table(config, 4, args.tokens + 1)
    out = []
    for d, ratio in ((512, 4), (512, 128), (128, 4)):
        if args.tokens < ratio:
            continue
        x, ape, norm = compressor_inputs(d, ratio, args.tokens, args.seed)
        cache: dict[str, Any] = {}

        def reference(d: int = d, ratio: int = ratio, x=x, ape=ape, norm=norm,  # noqa: ANN001
                      cache: dict = cache) -> dict:
            if not cache:
                w = selecting_compressor(d, ratio, ape, norm)
                cache["exact"] = compress(x, w, config)
                if d == 512:
                    pages = compressed_entries_model1_pages(cache["exact"], 1, scale_floor="vllm")
                    cache["bytes"] = pages[:, :584]
                    cache["flashmla_scales"] = compressed_entries_model1_pages(
                        cache["exact"], 1, scale_floor="flashmla")[:, 576:583]
                else:
                    cache["codes"], cache["scale"] = quantize_compressed_indexer_entries(
                        cache["exact"])
            return cache

        for mode, steps in schedules(args.tokens).items():
            prefix = "compressor" if d == 512 else "indexer-compressor"
            name = f"{prefix}-d{d}-r{ratio}-{mode}"

            def thunk(d: int = d, ratio: int = ratio, x=x, ape=ape, norm=norm,  # noqa: ANN001
                      steps: list[int] = steps, reference=reference) -> dict:
                ref = reference()
                theirs, stray = run_peer_compressor(
                    mod, x, ape, norm, cos_sin, d=d, ratio=ratio, steps=steps,
                    device=args.device, seed=args.seed, eps=config.rms_norm_eps)
                if d == 512:
                    res = compare_model1(ref["bytes"], theirs, ref["exact"],
                                         ref["flashmla_scales"])
                else:
                    res = compare_indexer_k(ref["codes"], ref["scale"], theirs, ref["exact"])
                res["counts"]["bytes_written_outside_entries"] = stray
                res["notes"] = [f"{len(steps)} steps", f"{args.tokens} tokens"]
                return res
            out.append((name, thunk))
    del torch
    return out


# ---- the indexer's q --------------------------------------------------------------------------

def indexer_q_check(mod, args, config) -> dict:  # noqa: ANN001
    import torch

    from mla.reference.v4.indexer import IndexerV4Weights, v4_indexer_q, v4_indexer_weights
    from mla.reference.v4.rope import rope_gptj
    T, H, D = args.q_tokens, config.index_n_heads, config.index_head_dim
    g = torch.Generator().manual_seed(args.seed + 5)
    weights = IndexerV4Weights.random(config, seed=args.seed, dtype=torch.bfloat16)
    qr = _bf16_randn(g, T, config.q_lora_rank)
    x = _bf16_randn(g, T, config.hidden_size)
    max_pos = 8192
    positions = torch.randint(0, max_pos, (T,), generator=g)
    positions[:4] = torch.tensor([0, 1, 4095, max_pos - 1])[:T]
    # the reference's own roundings of its GEMMs: the peer's inputs
    q_bf16 = (qr @ weights.wq_b.double().T).view(T, H, D).to(torch.bfloat16)
    w_bf16 = (x @ weights.weights_proj.double().T).to(torch.bfloat16)
    codes, q_scale = v4_indexer_q(qr, weights, positions, config, quantize=True)
    w_ref = v4_indexer_weights(x, weights, config, q_scale, quantize=True)
    rotated = rope_gptj(q_bf16.double(), positions, config, 4).to(torch.bfloat16).double()

    dev = args.device
    cos_sin = cos_sin_table(config, 4, max_pos).to(dev)
    q_in = q_bf16.to(dev)
    w_in = w_bf16.to(dev)
    q_fp8 = torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=dev)
    w_out = torch.empty(T, H, dtype=torch.float32, device=dev)
    extra = {} if dev == "cpu" else {"enable_fp_fusion": True}
    mod.fused_indexer_q_rope_quant_kernel[(T, H)](
        positions.to(dev), q_in, q_in.stride(0), q_in.stride(1), cos_sin, cos_sin.stride(0),
        cos_sin.shape[-1] // 2, q_fp8, q_fp8.stride(0), q_fp8.stride(1), D,
        w_in, w_in.stride(0), D ** -0.5, H ** -0.5, w_out, w_out.stride(0),
        FP8_MAX=448.0, USE_FNUZ=False, USE_EXPLICIT_FMA=False, num_warps=1, **extra)
    theirs = q_fp8.cpu().view(torch.uint8)
    ours = codes.to(torch.float8_e4m3fn).view(torch.uint8)
    w_t = w_out.cpu().double()
    # the peer's q scale, recovered from its weight fold
    fold = w_bf16.double() * D ** -0.5 * H ** -0.5
    nz = fold != 0
    their_log2 = torch.where(nz, torch.log2((w_t / fold).abs()).round(), float("nan"))
    scale_diff = nz & (their_log2 != torch.log2(q_scale))
    diff = ours != theirs
    examples = []
    for t, h, c in diff.nonzero().tolist()[:N_EXAMPLES]:
        examples.append({"token": t, "head": h, "channel": c, "position": int(positions[t]),
                         "ours": int(ours[t, h, c]), "theirs": int(theirs[t, h, c]),
                         "ours_value": float(codes[t, h, c]),
                         "theirs_value": float(theirs[t, h, c:c + 1].view(
                             torch.float8_e4m3fn).double()),
                         "bf16_over_scale": float(rotated[t, h, c] / q_scale[t, h])})
    rel = ((w_t - w_ref).abs() / w_ref.abs().clamp_min(1e-300))
    return {"counts": {"tokens": T, "heads": H, "bytes_compared": diff.numel(),
                       "bytes_diff_q": int(diff.sum()),
                       "bytes_diff_q_rope_half": int(diff[..., D - 64:].sum()),
                       "heads_differing": int(diff.any(dim=2).sum()),
                       "q_scales_diff": int(scale_diff.sum())},
            "maxima": {"weights_rel_diff": float(rel[w_ref != 0].max()) if T else 0.0,
                       "q_dequant_diff_in_scales": float(
                           (codes - theirs.view(torch.float8_e4m3fn).double()).abs().max())},
            "examples": examples,
            "notes": ["positions in [0, 8192)", "scale recovered from the weight fold"]}


# ---- main -------------------------------------------------------------------------------------

def environment(device: str) -> dict[str, Any]:
    import torch
    import triton
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton": triton.__version__, "device": device,
           "interpreter": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")}
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = list(torch.cuda.get_device_capability())
    else:
        env["gpu"] = None
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    from mla.reference.v4.config import get_v4_config
    root = _peers()
    mod = _load(root)
    config = get_v4_config("deepseek-v4")  # d = 512 + indexer 64 × 128, q_lora_rank 1024
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU here (use --device cpu for the interpreter)")
    only = [s for s in args.only.split(",") if s]
    checks: list[tuple[str, str, Callable[[], dict]]] = [
        (n, "compressor", f) for n, f in compressor_checks(mod, args, config)]
    checks.append(("indexer-q", "indexer_q", lambda: indexer_q_check(mod, args, config)))
    rows = []
    for name, kind, fn in checks:
        if only and not any(name.startswith(p) for p in only):
            continue
        print(f"running {name}", file=sys.stderr, flush=True)
        try:
            res = fn()
            rows.append(check_row(name, kind=kind, counts=res["counts"], maxima=res["maxima"],
                                  examples=res["examples"], notes=res.get("notes")))
        except Exception as e:  # noqa: BLE001 (recorded in the row)
            rows.append(check_row(name, kind=kind, error=e, tb=traceback.format_exc()))
    result = {"environment": environment(args.device),
              "args": {"tokens": args.tokens, "q_tokens": args.q_tokens, "seed": args.seed},
              "peers": str(root), "notes": [
                  "d = 512: vLLM's CUDA path runs CuTe-DSL kernels (sparse_attn_compress_cutedsl),"
                  " not checked here; the Triton kernel is what other platforms run",
                  "reference floor for d = 512: scale_floor='vllm' (the Triton kernel's)"],
              "checks": rows}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / OUT_NAME).write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))
    for r in rows:
        for ex in r["examples"][:3]:
            print(f"  {r['check']}: {ex}")
    print(f"wrote {args.out_dir / OUT_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
