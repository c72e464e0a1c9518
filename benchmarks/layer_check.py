"""Whole attention layers of ``mla.fast`` against the float64 reference, stage by stage.

``python -m benchmarks.layer_check --out DIR`` runs the dense layers (DeepSeek-V2-Lite and V3)
and the sparse layers (DeepSeek-V3.2, bf16 and fp8_ds_mla caches) at the presets' full shapes
on a GPU; the tests (tests/test_fast_model.py, test_fast_sparse_model.py) call the same
functions with fewer heads and shorter lengths under Triton's interpreter.

Each stage is held to its own budget, on the fast layer's own inputs to that stage (upcast to
float64 for the reference), so an error cannot hide behind the roundings of an earlier stage:

    front        the reference's own front (it is the fast path's too) against float64:
                 conventions §11's tolerance of the dtype
    cache        bytes equal to the reference's write of the same front outputs
    attention    the kernel's budget (``mla.compare.ERROR_BUDGETS``) on the same q and cache
    projection   ``gemm_budget``: the GEMMs' own roundings (q absorption, o_lat·W_UV, ·W_O)
    layer        the whole layer against the float64 reference layer: the dtype's tolerance

The sparse stages are in ``benchmarks.sparse_layer_check``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict

import torch

from benchmarks.layer_stages import (
    Stage,
    abs_stage,
    bytes_stage,
    front_stages,
    gemm_budget,
    rel_stage,
)
from benchmarks.sparse_layer_check import sparse_runs
from mla.compare import TOLERANCES, budget
from mla.config import MLAConfig, get_config
from mla.reference import model as ref_model
from mla.reference.chunked import chunked_prefill_attention as ref_chunked
from mla.reference.chunked import plan_context_chunks
from mla.reference.decode import absorb_q
from mla.reference.decode import mla_decode_paged as ref_decode
from mla.reference.front import mla_front
from mla.reference.paged_cache import concat_and_cache_mla as ref_cache_write
from mla.reference.paged_cache import make_block_table, slot_mapping_from_block_table
from mla.weights import MLAWeights

__all__ = ["build_dense", "dense_decode_check", "layer_runs",
           "dense_prefill_check", "main"]


def build_dense(config: MLAConfig, dtype: torch.dtype, device: str, context_lens: list[int],
                new_lens: list[int], block_size: int, seed: int
                ) -> tuple[MLAWeights, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights in ``dtype`` on ``device`` (drawn in float64), a NaN-poisoned paged cache with
    each request's context written by the fast path (hidden states ~ N(0, 1)), a scattered
    block table with room for the new tokens, and the new tokens' hidden states."""
    from mla.fast.model import write_context

    w = MLAWeights.random(config, seed=seed, dtype=dtype, device=device)
    caps = [c + n for c, n in zip(context_lens, new_lens)]
    bt, nb = make_block_table(caps, block_size, spare_blocks=1, seed=seed, device=device)
    cache = torch.full((nb, block_size, config.latent_dim), float("nan"), dtype=dtype,
                       device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    for i, n in enumerate(context_lens):
        if n:
            h = torch.randn(n, config.hidden_size, generator=gen, dtype=torch.float64)
            write_context(w, h.to(dtype=dtype, device=device), cache, bt[i])
    hidden = torch.randn(sum(new_lens), config.hidden_size, generator=gen,
                         dtype=torch.float64).to(dtype=dtype, device=device)
    return w, cache, bt, hidden


def dense_decode_check(config: MLAConfig, dtype: torch.dtype, device: str, lens: list[int],
                       s_q: int, block_size: int = 64, seed: int = 0,
                       decode: Callable | None = None) -> list[Stage]:
    """One decode step of ``s_q`` tokens per request after ``lens`` cached tokens.

    ``decode`` replaces ``mla.fast.model.decode_layer`` (a broken twin in the tests)."""
    from mla.fast.model import decode_layer

    decode = decode_layer if decode is None else decode
    layer = f"decode {config.name} {str(dtype)[6:]} s_q={s_q}"
    B = len(lens)
    w, cache, bt, hidden = build_dense(config, dtype, device, lens, [s_q] * B, block_size,
                                       seed)
    hidden = hidden.view(B, s_q, -1)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    before = cache.cpu().clone()
    tr = decode(w, hidden, cache, bt, seqlens)

    w64, h64 = w.to(torch.float64, "cpu"), hidden.double().cpu()
    bt_c, sl_c = bt.cpu(), seqlens.cpu()
    positions = (sl_c.long()[:, None] + torch.arange(s_q)).flatten()
    f_ref = mla_front(w64, h64.reshape(B * s_q, -1), positions)
    stages = front_stages(layer, tr.front, f_ref, dtype)

    written = before.clone()
    slots = slot_mapping_from_block_table(bt_c, torch.arange(B).repeat_interleave(s_q),
                                                    positions, block_size)
    ref_cache_write(tr.front.kv_c.cpu(), tr.front.k_pe.cpu(), written, slots)
    stages.append(bytes_stage(layer, "cache", cache, written))

    c = config
    q_ref = torch.cat([absorb_q(tr.front.q_nope.double().cpu(), w64.W_UK),
                       tr.front.q_pe.double().cpu()], dim=-1).view(B, s_q, c.num_heads, -1)
    stages.append(rel_stage(layer, "q absorbed", tr.q, q_ref,
                            gemm_budget(dtype, [c.qk_nope_head_dim])))
    o_ref, lse_ref = ref_decode(tr.q.double().cpu(), cache.double().cpu(), bt_c, sl_c + s_q,
                                c.softmax_scale, causal=True, head_dim_v=c.kv_lora_rank)
    stages.append(rel_stage(layer, "attention.o_lat", tr.o_lat, o_ref,
                            budget("mla_decode_paged", dtype, "out_rel")))
    stages.append(abs_stage(layer, "attention.lse", tr.lse, lse_ref,
                            budget("mla_decode_paged", dtype, "lse_abs")))
    o = torch.einsum("bsnl,lnv->bsnv", tr.o_lat.double().cpu(), w64.W_UV)
    stages.append(rel_stage(layer, "projection", tr.out, o.flatten(-2) @ w64.W_O,
                            gemm_budget(dtype, [c.kv_lora_rank, c.num_heads * c.v_head_dim])))
    out_ref = ref_model.decode_forward(w64, h64, before.double(), bt_c, sl_c)
    stages.append(rel_stage(layer, "layer", tr.out, out_ref, TOLERANCES[dtype]))
    return stages


def dense_prefill_check(config: MLAConfig, dtype: torch.dtype, device: str,
                        context_lens: list[int], new_lens: list[int], block_size: int = 64,
                        workspace_size: int = 64 * 1024, seed: int = 0,
                        prefill: Callable | None = None) -> list[Stage]:
    """One chunked prefill: request ``i`` has ``context_lens[i]`` cached tokens and
    ``new_lens[i]`` new ones; ``workspace_size`` small enough forces several context chunks.
    ``prefill`` replaces ``mla.fast.model.chunked_prefill_layer`` (a broken twin in the tests)."""
    from mla.fast.model import chunked_prefill_layer

    prefill = chunked_prefill_layer if prefill is None else prefill
    layer = f"prefill {config.name} {str(dtype)[6:]}"
    B = len(context_lens)
    w, cache, bt, hidden = build_dense(config, dtype, device, context_lens, new_lens,
                                       block_size, seed)
    qsl = torch.tensor([0] + list(torch.tensor(new_lens).cumsum(0).tolist()),
                       dtype=torch.int32, device=device)
    plan = plan_context_chunks(context_lens, block_size=block_size,
                               workspace_size=workspace_size)
    before = cache.cpu().clone()
    tr = prefill(w, hidden, qsl, context_lens, cache, bt, plan)

    w64, h64, bt_c, qsl_c = w.to(torch.float64, "cpu"), hidden.double().cpu(), bt.cpu(), qsl.cpu()
    req = torch.repeat_interleave(torch.arange(B), torch.tensor(new_lens))
    positions = torch.cat([torch.arange(context_lens[i], context_lens[i] + new_lens[i])
                           for i in range(B)])
    f_ref = mla_front(w64, h64, positions)
    stages = front_stages(layer, tr.front, f_ref, dtype)
    written = before.clone()
    slots = slot_mapping_from_block_table(bt_c, req, positions, block_size)
    ref_cache_write(tr.front.kv_c.cpu(), tr.front.k_pe.cpu(), written, slots)
    stages.append(bytes_stage(layer, "cache", cache, written))

    c = config
    f64 = [t.double().cpu() for t in tr.front]
    o_ref, lse_ref = ref_chunked(*f64, qsl_c, cache.double().cpu(), bt_c, plan, w64.W_UK,
                                 w64.W_UV, c.softmax_scale)
    stages.append(rel_stage(layer, "attention.o", tr.o, o_ref,
                            budget("chunked_prefill_attention", dtype, "out_rel")))
    stages.append(abs_stage(layer, "attention.lse", tr.lse, lse_ref,
                            budget("chunked_prefill_attention", dtype, "lse_abs_f64")))
    stages.append(rel_stage(layer, "projection", tr.out, tr.o.double().cpu().flatten(-2) @ w64.W_O,
                            gemm_budget(dtype, [c.num_heads * c.v_head_dim])))
    out_ref = ref_model.chunked_prefill_forward(w64, h64, qsl_c, context_lens, before.double(),
                                                bt_c, plan)
    stages.append(rel_stage(layer, "layer", tr.out, out_ref, TOLERANCES[dtype]))
    return stages


def layer_runs(device: str, small: bool = False) -> list[Callable[[], list[Stage]]]:
    """The dense runs (DeepSeek-V2-Lite and V3: decode s_q 1 and 2, chunked prefill over
    several context chunks) and the sparse ones, bf16; ``small``: 4 heads and short lengths,
    float32 on the CPU (the interpreter), the presets' head dims kept."""
    dtype = torch.float32 if small and device == "cpu" else torch.bfloat16
    lens1, lens2 = ([96, 1, 37, 0], [70, 9]) if small else ([4096, 1, 777, 0], [2048, 300])
    ctx, new, ws = ([60, 0, 17], [9, 4, 1], 32) if small else ([3000, 0, 700], [200, 64, 1], 2048)
    block = 16 if small else 64  # several context chunks either way
    runs: list[Callable[[], list[Stage]]] = []
    for name in ("deepseek-v2-lite", "deepseek-v3"):
        cfg = get_config(name).replace(num_heads=4) if small else get_config(name)
        runs.append(lambda c=cfg: dense_decode_check(c, dtype, device, lens1, 1, seed=1))
        runs.append(lambda c=cfg: dense_decode_check(c, dtype, device, lens2, 2, seed=2))
        runs.append(lambda c=cfg: dense_prefill_check(c, dtype, device, ctx, new, block,
                                                      workspace_size=ws, seed=3))
    return runs + sparse_runs(device, dtype, small)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="folder for layer_check.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true",
                   help="4 heads and short lengths (the tests' shapes; float32 on the CPU)")
    args = p.parse_args(argv)
    stages: list[Stage] = []
    failed_runs = []
    for run in layer_runs(args.device, args.small):
        try:
            got = run()
        except Exception as e:  # noqa: BLE001 (report and go on with the other layers)
            failed_runs.append(repr(e))
            traceback.print_exc()
            print(f"ERROR {e!r}", flush=True)
            continue
        for s in got:
            print(s.line(), flush=True)
        stages += got
    bad = [s for s in stages if not s.passed]
    print(f"layer check: {len(stages) - len(bad)}/{len(stages)} stages within budget, "
          f"{len(failed_runs)} runs raised", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "layer_check.json"), "w") as fh:
            json.dump({"stages": [asdict(s) | {"passed": s.passed} for s in stages],
                       "errors": failed_runs, "torch": torch.__version__}, fh, indent=1)
    return 1 if bad or failed_runs else 0


if __name__ == "__main__":
    sys.exit(main())
