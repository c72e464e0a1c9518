"""Sparse layers of ``mla.fast`` (DeepSeek-V3.2) against the float64 reference, stage by stage.

The stages of ``benchmarks.layer_check`` plus the indexer's, each on the fast layer's own
inputs to it:

    index cache   bytes equal to the reference's quantization of the same rotated keys
    logits        the reference's fp8 logits in float64 on the same e4m3 q, weights and cache:
                  the fast kernels' ``logits_budget`` in ``logits_err``'s measure (the FP8
                  MMA's accumulator on a GPU)
    top-k         the reference's top_k_per_row on the fast logits: the same sets (exact); and
                  on the float64 logits: any difference only between keys whose float64
                  logits lie within the logits budget of the row's k-th value (a near tie)
    conversion    the reference's index conversion of the same local indices (exact)
    attention     the sparse kernel's budget on the same q, cache and slots
    layer         the float64 reference layer on the keys the fast layer selected
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.layer_stages import (
    Stage,
    abs_stage,
    bytes_stage,
    front_stages,
    gemm_budget,
    rel_stage,
)
from mla.compare import TOLERANCES, budget, logits_err
from mla.config import MLAConfig, get_config
from mla.fast.indexer.logits import logits_budget
from mla.reference.decode import absorb_q
from mla.reference.fp8 import concat_and_cache_fp8_ds_mla as ref_fp8_write
from mla.reference.fp8 import gather_and_upconvert_fp8_ds_mla
from mla.reference.front import mla_front
from mla.reference.indexer import IndexerWeights
from mla.reference.indexer_cache import gather_indexer_k_cache
from mla.reference.indexer_cache import indexer_k_quant_and_cache as ref_index_write
from mla.reference.indexer_logits import fp8_mqa_logits, fp8_paged_mqa_logits, top_k_per_row
from mla.reference.paged_cache import concat_and_cache_mla as ref_cache_write
from mla.reference.paged_cache import make_block_table, slot_mapping_from_block_table
from mla.reference.sparse import convert_req_index_to_global_index as ref_convert
from mla.reference.sparse import sparse_mla_decode as ref_sparse_decode
from mla.reference.sparse import sparse_mla_prefill as ref_sparse_prefill
from mla.weights import MLAWeights

__all__ = ["build_sparse", "sparse_decode_check", "sparse_prefill_check", "sparse_runs"]


def build_sparse(config: MLAConfig, dtype: torch.dtype, device: str, context_lens: list[int],
                 new_lens: list[int], block_size: int, fp8_kv: bool, seed: int
                 ) -> tuple[MLAWeights, IndexerWeights, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor]:
    """Weights and indexer weights in ``dtype``, poisoned caches (the latent's bf16 or
    fp8_ds_mla, the fp8 index keys) holding each request's context written by the fast
    path, a scattered block table, and the new tokens' hidden states."""
    from mla.fast.sparse.model import _front_and_index

    w = MLAWeights.random(config, seed=seed, dtype=dtype, device=device)
    iw = IndexerWeights.random(config, seed=seed + 1, dtype=dtype, device=device)
    caps = [c + n for c, n in zip(context_lens, new_lens)]
    bt, nb = make_block_table(caps, block_size, spare_blocks=1, seed=seed, device=device)
    if fp8_kv:
        kv = torch.full((nb, block_size, 656), 0xFF, dtype=torch.uint8, device=device)
    else:
        kv = torch.full((nb, block_size, config.latent_dim), float("nan"), dtype=dtype,
                        device=device)
    ik = torch.full((nb, block_size, 132), 0xFF, dtype=torch.uint8, device=device)
    gen = torch.Generator().manual_seed(seed + 2)
    for i, n in enumerate(context_lens):
        if n:
            h = torch.randn(n, config.hidden_size, generator=gen, dtype=torch.float64)
            pos = torch.arange(n, device=device)
            slots = slot_mapping_from_block_table(bt[i:i + 1], torch.zeros_like(pos), pos,
                                                  block_size)
            _front_and_index(w, iw, h.to(dtype=dtype, device=device), slots, pos, kv, ik, True)
    hidden = torch.randn(sum(new_lens), config.hidden_size, generator=gen,
                         dtype=torch.float64).to(dtype=dtype, device=device)
    return w, iw, kv, ik, bt, hidden


def _sets(idx: torch.Tensor) -> torch.Tensor:
    """Each row's indices sorted (the -1 padding last), so equal sets compare equal."""
    i = idx.long().cpu()
    return torch.where(i < 0, torch.iinfo(torch.int64).max, i).sort(dim=1).values


def _logits_stage(layer: str, logits: torch.Tensor, logits64: torch.Tensor,
                  mag64: torch.Tensor, heads: int) -> Stage:
    """``logits_err`` (the error over the magnitude, the logits with ``|weights|``) within
    ``logits_budget`` of the layer's index heads."""
    return Stage(layer, "logits", logits_err(logits, logits64, mag64),
                 logits_budget(logits.device, heads), "logits_err")


def _topk_stages(layer: str, tr, logits64: torch.Tensor, topk: int) -> list[Stage]:
    starts, ends = tr.row_starts.cpu(), tr.row_ends.cpu()
    same_logits = top_k_per_row(tr.logits.cpu(), starts, ends, topk)
    stages = [Stage(layer, "top-k", float((_sets(tr.local) != _sets(same_logits)).sum()), 0.0,
                    "count")]
    # against the float64 logits: a key in one set and not the other must be a near tie.
    # If the fast path picks a over b and float64 picks b over a, then ref(b) >= kth >= ref(a)
    # and fast(a) >= fast(b), so both lie within 2·e of the k-th value, e being the row's
    # largest logits error (which the logits stage holds to its budget).
    ref = top_k_per_row(logits64, starts, ends, topk)
    fast = tr.logits.double().cpu()
    not_ties = 0
    for r in range(ref.shape[0]):
        a = set(tr.local[r].tolist()) - {-1}
        b = set(ref[r].tolist()) - {-1}
        if a == b:
            continue
        row, got = logits64[r, starts[r]:ends[r]], fast[r, starts[r]:ends[r]]
        err = (got - row)[torch.isfinite(row)].abs().max().item()
        kth = row.sort(descending=True).values[min(topk, row.numel()) - 1]
        not_ties += sum(1 for j in a ^ b if abs(row[j] - kth) > 2 * err * (1 + 1e-9))
    stages.append(Stage(layer, "top-k vs float64", float(not_ties), 0.0, "count"))
    return stages


def _common(layer: str, tr, w, before_kv, before_ik, kv, ik, h64, positions, req, bt_c,
            dtype) -> tuple[list[Stage], MLAWeights]:
    w64 = w.to(torch.float64, "cpu")
    stages = front_stages(layer, tr.front, mla_front(w64, h64, positions), dtype)
    bs = kv.shape[1]
    slots = slot_mapping_from_block_table(bt_c, req, positions, bs)
    written = before_kv.clone()
    if written.dtype == torch.uint8:
        ref_fp8_write(tr.front.kv_c.cpu(), tr.front.k_pe.cpu(), written, slots)
    else:
        ref_cache_write(tr.front.kv_c.cpu(), tr.front.k_pe.cpu(), written, slots)
    stages.append(bytes_stage(layer, "cache", kv, written))
    written_ik = before_ik.clone()
    ref_index_write(tr.index_k.cpu(), written_ik, slots)
    stages.append(bytes_stage(layer, "index cache", ik, written_ik))
    return stages, w64


def _layer_given_keys(w64: MLAWeights, h64: torch.Tensor, positions: torch.Tensor,
                      req: torch.Tensor, bt: torch.Tensor, before_kv: torch.Tensor,
                      after_kv: torch.Tensor, local: torch.Tensor,
                      decode_shape: tuple[int, int] | None, seq: list[int] | None
                      ) -> torch.Tensor:
    """The float64 reference layer (front, latent cache write, index conversion, sparse
    attention, projections) on the keys the fast layer selected.

    Not the reference's own selection: bf16 rounding of the index keys moves some e4m3 codes,
    hence some keys near the k-th value, so a whole-layer compare against the float64 selection
    would fail or pass by luck. The selection has its own stages (logits, top-k).

    On the fp8_ds_mla cache the attention reads the fast layer's cache (``after_kv``), not a
    float64 write: an e4m3 code is a step function of its input, so the bf16 front's ~2e-3
    difference in ``kv_c`` moves the codes of the values near a rounding boundary by a whole
    step (6%), about ``sqrt(2e-3 · 2^-4) ≈ 1e-2`` relative over the cache, an input rounding
    and no kernel's error (measured on an H200: 1.4-2.2e-2 for the layer). Those bytes equal
    the reference's write of the fast ``kv_c`` exactly (the "cache" stage)."""
    c = w64.config
    bs = before_kv.shape[1]
    fp8_kv = before_kv.dtype == torch.uint8
    f = mla_front(w64, h64, positions)
    slots = slot_mapping_from_block_table(bt, req, positions, bs)
    if fp8_kv:
        kv = after_kv.clone()
    else:
        kv = before_kv.double()
        ref_cache_write(f.kv_c, f.k_pe, kv, slots)
    q = torch.cat([absorb_q(f.q_nope, w64.W_UK), f.q_pe], dim=-1)
    req32 = req.to(torch.int32)
    if decode_shape is not None:
        B, s_q = decode_shape
        rows = ref_convert(req32, bt, local, bs)
        o_lat, _ = ref_sparse_decode(q.view(B, s_q, c.num_heads, -1), kv, rows.view(B, s_q, -1),
                                     c.softmax_scale, fp8_kv, head_dim_v=c.kv_lora_rank)
    else:
        if fp8_kv:
            seq32 = torch.tensor(seq, dtype=torch.int32)
            starts = (seq32.cumsum(0) - seq32).to(torch.int32)
            keys = torch.empty(sum(seq), c.latent_dim, dtype=torch.float64)
            gather_and_upconvert_fp8_ds_mla(kv, keys, bt, seq32, starts, len(seq))
            rows = ref_convert(req32, bt, local, bs, prefill_workspace_request_ids=req32,
                               prefill_workspace_starts=starts)
        else:
            keys = kv.view(-1, c.latent_dim)
            rows = ref_convert(req32, bt, local, bs)
        o_lat, _, _ = ref_sparse_prefill(q, keys, rows, c.softmax_scale, d_v=c.kv_lora_rank)
    o = torch.einsum("...nl,lnv->...nv", o_lat, w64.W_UV)
    return o.flatten(-2) @ w64.W_O


def sparse_decode_check(config: MLAConfig, dtype: torch.dtype, device: str, lens: list[int],
                        s_q: int, block_size: int = 64, fp8_kv: bool = False, seed: int = 0,
                        decode: Callable | None = None) -> list[Stage]:
    """One sparse decode step of ``s_q`` tokens per request after ``lens`` cached tokens.
    ``decode`` replaces ``mla.fast.sparse.model.sparse_decode_layer`` (broken twins)."""
    from mla.fast.sparse.model import sparse_decode_layer

    decode = sparse_decode_layer if decode is None else decode
    layer = f"sparse decode {config.name} {str(dtype)[6:]} {'fp8' if fp8_kv else 'bf16'}kv"
    B = len(lens)
    w, iw, kv, ik, bt, hidden = build_sparse(config, dtype, device, lens, [s_q] * B,
                                             block_size, fp8_kv, seed)
    hidden = hidden.view(B, s_q, -1)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    before_kv, before_ik = kv.cpu().clone(), ik.cpu().clone()
    tr = decode(w, iw, hidden, kv, ik, bt, sl)

    h64, bt_c, sl_c = hidden.double().cpu().reshape(B * s_q, -1), bt.cpu(), sl.cpu()
    positions = (sl_c.long()[:, None] + torch.arange(s_q)).flatten()
    req = torch.arange(B).repeat_interleave(s_q)
    stages, w64 = _common(layer, tr, w, before_kv, before_ik, kv, ik, h64, positions, req,
                          bt_c, dtype)
    ik_c = ik.cpu()
    q_c, w_c = tr.q_index.cpu().view(B, s_q, *tr.q_index.shape[1:]), tr.index_weights.double()
    logits64, mag64 = (fp8_paged_mqa_logits(q_c, ik_c, iw_c.cpu(), sl_c + s_q, bt_c,
                                            tr.logits.shape[1]) for iw_c in (w_c, w_c.abs()))
    stages.append(_logits_stage(layer, tr.logits, logits64, mag64, w_c.shape[1]))
    stages += _topk_stages(layer, tr, logits64, config.index_topk)
    conv = ref_convert(req.to(torch.int32), bt_c, tr.local.cpu(), block_size)
    stages.append(bytes_stage(layer, "conversion", tr.slots, conv))
    kv_ref = kv.cpu() if fp8_kv else kv.double().cpu()
    o_ref, lse_ref = ref_sparse_decode(tr.q.double().cpu(), kv_ref, tr.slots.cpu().view(B, s_q, -1),
                                       config.softmax_scale, fp8_kv,
                                       head_dim_v=config.kv_lora_rank)
    stages.append(rel_stage(layer, "attention.o_lat", tr.o_lat, o_ref,
                            budget("sparse_mla_decode", dtype, "out_rel")))
    stages.append(abs_stage(layer, "attention.lse", tr.lse, lse_ref,
                            budget("sparse_mla_decode", dtype, "lse_abs")))
    o = torch.einsum("bsnl,lnv->bsnv", tr.o_lat.double().cpu(), w64.W_UV)
    stages.append(rel_stage(layer, "projection", tr.out, o.flatten(-2) @ w64.W_O,
                            gemm_budget(dtype, [config.kv_lora_rank,
                                                config.num_heads * config.v_head_dim])))
    out_ref = _layer_given_keys(w64, h64, positions, req, bt_c, before_kv, kv.cpu(),
                                tr.local.cpu(), (B, s_q), None)
    stages.append(rel_stage(layer, "layer (same keys)", tr.out, out_ref, TOLERANCES[dtype]))
    return stages


def sparse_prefill_check(config: MLAConfig, dtype: torch.dtype, device: str,
                         context_lens: list[int], new_lens: list[int], block_size: int = 64,
                         fp8_kv: bool = False, seed: int = 0,
                         prefill: Callable | None = None) -> list[Stage]:
    """One sparse prefill of ``new_lens`` tokens after ``context_lens`` cached ones."""
    from mla.fast.sparse.model import sparse_prefill_layer

    prefill = sparse_prefill_layer if prefill is None else prefill
    layer = f"sparse prefill {config.name} {str(dtype)[6:]} {'fp8' if fp8_kv else 'bf16'}kv"
    B = len(context_lens)
    w, iw, kv, ik, bt, hidden = build_sparse(config, dtype, device, context_lens, new_lens,
                                             block_size, fp8_kv, seed)
    qsl = torch.tensor([0] + torch.tensor(new_lens).cumsum(0).tolist(), dtype=torch.int32,
                       device=device)
    before_kv, before_ik = kv.cpu().clone(), ik.cpu().clone()
    tr = prefill(w, iw, hidden, qsl, context_lens, kv, ik, bt)

    h64, bt_c = hidden.double().cpu(), bt.cpu()
    req = torch.repeat_interleave(torch.arange(B), torch.tensor(new_lens))
    positions = torch.cat([torch.arange(context_lens[i], context_lens[i] + new_lens[i])
                           for i in range(B)])
    stages, w64 = _common(layer, tr, w, before_kv, before_ik, kv, ik, h64, positions, req,
                          bt_c, dtype)
    seq = [c + n for c, n in zip(context_lens, new_lens)]
    cu = torch.tensor([0] + torch.tensor(seq).cumsum(0).tolist(), dtype=torch.int32)
    keys = gather_indexer_k_cache(ik.cpu(), bt_c, cu)
    w_c = tr.index_weights.double().cpu()
    logits64, mag64 = (fp8_mqa_logits(tr.q_index.cpu(), keys, iw_c, tr.row_starts.cpu(),
                                      tr.row_ends.cpu()) for iw_c in (w_c, w_c.abs()))
    stages.append(_logits_stage(layer, tr.logits, logits64, mag64, w_c.shape[1]))
    stages += _topk_stages(layer, tr, logits64, config.index_topk)
    req32 = req.to(torch.int32)
    if fp8_kv:
        starts = cu[:-1].contiguous()
        conv = ref_convert(req32, bt_c, tr.local.cpu(), block_size,
                           prefill_workspace_request_ids=req32, prefill_workspace_starts=starts)
        kv_ref = torch.empty(sum(seq), config.latent_dim, dtype=torch.float64)
        gather_and_upconvert_fp8_ds_mla(kv.cpu(), kv_ref, bt_c, torch.tensor(seq,
                                        dtype=torch.int32), starts, B)
    else:
        conv = ref_convert(req32, bt_c, tr.local.cpu(), block_size)
        kv_ref = kv.double().cpu().view(-1, config.latent_dim)
    stages.append(bytes_stage(layer, "conversion", tr.slots, conv))
    o_ref, _, lse_ref = ref_sparse_prefill(tr.q.double().cpu(), kv_ref, tr.slots.cpu(),
                                           config.softmax_scale, d_v=config.kv_lora_rank)
    stages.append(rel_stage(layer, "attention.o_lat", tr.o_lat, o_ref,
                            budget("sparse_mla_prefill", dtype, "out_rel")))
    stages.append(abs_stage(layer, "attention.lse", tr.lse, lse_ref,
                            budget("sparse_mla_prefill", dtype, "lse_abs")))
    o = torch.einsum("tnl,lnv->tnv", tr.o_lat.double().cpu(), w64.W_UV)
    stages.append(rel_stage(layer, "projection", tr.out, o.flatten(-2) @ w64.W_O,
                            gemm_budget(dtype, [config.kv_lora_rank,
                                                config.num_heads * config.v_head_dim])))
    out_ref = _layer_given_keys(w64, h64, positions, req, bt_c, before_kv, kv.cpu(),
                                tr.local.cpu(), None, seq)
    stages.append(rel_stage(layer, "layer (same keys)", tr.out, out_ref, TOLERANCES[dtype]))
    return stages


def sparse_runs(device: str, dtype: torch.dtype, small: bool = False
                ) -> list[Callable[[], list[Stage]]]:
    """DeepSeek-V3.2: decode (s_q 1 and 2) and prefill on both latent caches, contexts longer
    than topk (2048; ``small``: 16 of 4 heads and 8 index heads) so that the selection bites."""
    cfg = get_config("deepseek-v3.2")
    if small:
        cfg = cfg.replace(num_heads=4, index_n_heads=8, index_topk=16)
    dec1, dec2 = ([4000, 1, 2100, 0], [3000, 500]) if not small else ([80, 1, 21, 0], [50, 9])
    ctx, new = ([2500, 0], [40, 24]) if not small else ([40, 0], [6, 20])
    runs: list[Callable[[], list[Stage]]] = []
    for fp8_kv in (False, True):
        runs.append(lambda f=fp8_kv: sparse_decode_check(cfg, dtype, device, dec1, 1,
                                                         fp8_kv=f, seed=4))
        runs.append(lambda f=fp8_kv: sparse_decode_check(cfg, dtype, device, dec2, 2,
                                                         fp8_kv=f, seed=5))
        runs.append(lambda f=fp8_kv: sparse_prefill_check(cfg, dtype, device, ctx, new,
                                                          fp8_kv=f, seed=6))
    return runs
