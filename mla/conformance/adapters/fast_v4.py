"""``mla.fast.v4``'s DeepSeek-V4 kernels with the catalogue's kernel-level contracts (the
``mla.fast`` target's ``v4_*`` kernels; ``mla.reference.v4.kernels`` and ``.scopes`` state the
contracts):

- ``v4_compress`` -> ``v4_compress_store`` for one request: the state's ``coff·r`` rows and the
  new tokens' as one history (``history_start`` the state's first position, which may be
  negative: rows of positions below 0 are never read), the entries stored into a poisoned
  (``0xA5``) paged cache behind a scrambled block table (MODEL1 pages of ``256 / r`` entries for
  ``d = 512``, with the contract's ``scale_floor="vllm"``; the indexer's 132-byte pages of 64
  for ``d = 128``) and each closed entry's record read back: its data bytes, then its scale
  bytes;
- ``v4_indexer_q`` -> ``v4_indexer_q_prep`` (the codes returned as their bytes). It folds
  ``128^-0.5 · H^-0.5`` into the weights; other scales are unsupported (rescaling would round);
- ``v4_scope_indices`` -> the decode path's index builders of ``mla.fast.v4.layer``
  (``window_ids``, ``global_slots`` and the compressed ids ``v4_layer_step`` hands the sparse
  decode), which ``v4_decode_step`` shares. The prefill path builds its indices inside
  ``v4_layer_step``'s workspace gather, not as a function: unsupported;
- ``v4_output`` -> ``output_projection``, on a stand-in for the ``V4FastCache`` it reads
  (``weights`` with ``wo_a`` / ``wo_b`` and their config, ``cos_sin``), in float32 on the CPU
  (the interpreter's activations, as ``V4FastCache`` takes them there) and in ``attn``'s dtype
  on CUDA; it rounds to bf16 at each stage whatever the dtype;
- ``v4_indexer_topk`` -> ``v4_indexer_topk_paged`` with ``visible = (p + 1) // 4``, the logits'
  width the widest row, and the short-context fill where every row's entries fit (the rule
  ``v4_layer_step`` applies to the batch).

Inputs are converted exactly (dtypes that hold the same values, layouts); outputs are passed
through. Each call runs under ``mla.fast.validation(True)``, as the target's other kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mla.conformance.catalogue import Unsupported

__all__ = ["target", "v4_compress", "v4_indexer_q", "v4_scope_indices", "v4_output",
           "v4_indexer_topk", "FILL"]

FILL = 0xA5  # cache bytes never written
_RECORD = {512: (576, 8), 128: (128, 4)}  # data bytes, scale bytes a record
_INDEX_PAGE = 64  # the indexer key cache's entries a page (mla.fast.v4.layer's)


def _scrambled(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).int()


def v4_compress(kv: torch.Tensor, score: torch.Tensor, state_kv: torch.Tensor,
                state_score: torch.Tensor, positions: torch.Tensor, norm_weight: torch.Tensor,
                cos_sin: torch.Tensor, ratio: int, rms_norm_eps: float = 1e-6) -> torch.Tensor:
    """``v4_compress_store`` with the catalogue's ``v4_compress`` contract (module doc)."""
    from mla.fast.v4 import v4_compress_store
    from mla.reference.fp8_model1 import fp8_model1_cache, fp8_model1_page_bytes
    d = norm_weight.shape[0]
    if d not in _RECORD or ratio not in (4, 128) or isinstance(ratio, bool):
        raise ValueError(f"v4_compress stores d = 512 or 128 at ratio 4 or 128, got d = {d}, "
                         f"ratio {ratio!r}")
    T, dev = kv.shape[0], kv.device
    data, scale = _RECORD[d]
    if T == 0:
        return torch.empty(0, data + scale, dtype=torch.uint8, device=dev)
    start = int(positions[0])
    rows = state_kv.shape[0]
    hist_kv = torch.cat([state_kv, kv]).float().contiguous()
    hist_score = torch.cat([state_score, score]).float().contiguous()
    end = (start + T) // ratio  # the entries after the step
    bs = 256 // ratio if d == 512 else _INDEX_PAGE
    pages = max(1, -(-end // bs))
    table = _scrambled(pages, start * 7919 + T).view(1, pages).to(dev)
    if d == 512:
        buf = torch.full((pages, fp8_model1_page_bytes(bs)), FILL, dtype=torch.uint8, device=dev)
        cache = fp8_model1_cache(buf, bs)
    else:
        cache = torch.full((pages, bs, 132), FILL, dtype=torch.uint8, device=dev)
        buf = cache.view(pages, -1)
    i32 = dict(dtype=torch.int32, device=dev)
    v4_compress_store(hist_kv, hist_score, torch.zeros(1, **i32),
                      torch.tensor([start + T], **i32), torch.tensor([T], **i32), T,
                      norm_weight, cos_sin.float().contiguous(), cache, table, ratio=ratio,
                      rms_norm_eps=rms_norm_eps, history_start=torch.tensor([start - rows], **i32),
                      scale_floor="vllm")
    ids = torch.arange(start // ratio, end, device=dev)
    page, o = table[0].long()[ids // bs], ids % bs
    at = page[:, None] * buf.shape[1]
    data_at = at + o[:, None] * data + torch.arange(data, device=dev)[None, :]
    scale_at = at + bs * data + o[:, None] * scale + torch.arange(scale, device=dev)[None, :]
    flat = buf.reshape(-1)
    return torch.cat([flat[data_at], flat[scale_at]], dim=1)


def v4_indexer_q(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                 cos_sin: torch.Tensor, softmax_scale: float, head_scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``v4_indexer_q_prep`` with the catalogue's ``v4_indexer_q`` contract (module doc)."""
    from mla.fast.v4 import v4_indexer_q_prep
    H = q.shape[1] if q.dim() == 3 else 0
    if H and (softmax_scale != 128 ** -0.5 or head_scale != H ** -0.5):
        raise Unsupported(f"mla.fast's v4_indexer_q_prep folds 128^-0.5 · H^-0.5 (H = {H}) "
                          f"into the weights, got softmax_scale {softmax_scale}, head_scale "
                          f"{head_scale}")
    codes, w = v4_indexer_q_prep(q, weights, positions, cos_sin.float().contiguous())
    return codes.view(torch.uint8), w


def v4_scope_indices(positions: torch.Tensor, token_to_req: torch.Tensor,
                     seq_lens: torch.Tensor, window_table: torch.Tensor,
                     compressed_table: torch.Tensor | None, topk: torch.Tensor | None,
                     ratio: int, window: int, path: str = "decode"
                     ) -> tuple[torch.Tensor, ...]:
    """The decode path's scope indices of ``mla.fast.v4.layer`` (module doc)."""
    from mla.fast.v4.layer import WINDOW_PAGE, _compressed_ids, global_slots, window_ids
    if path == "prefill":
        raise Unsupported("mla.fast builds the prefill indices inside v4_layer_step's "
                          "workspace gather (_prefill), not as a function of their own")
    if path != "decode" or ratio not in (1, 4, 128) or isinstance(ratio, bool):
        raise ValueError(f"path must be 'decode' or 'prefill' and ratio 1, 4 or 128, got "
                         f"{path!r}, {ratio!r}")
    pos, req = positions.long(), token_to_req.long()
    ids, lengths = window_ids(pos, window)
    indices = global_slots(window_table, req, ids, WINDOW_PAGE)
    if ratio == 1:
        T = pos.shape[0]
        return (indices, lengths, torch.full((T, 0), -1, dtype=torch.int32, device=pos.device),
                torch.zeros(T, dtype=torch.int32, device=pos.device))
    if compressed_table is None or (ratio == 4 and topk is None):
        raise ValueError(f"a ratio-{ratio} layer needs compressed_table (and, ratio 4, topk)")
    local = _compressed_ids(pos, ratio, None if topk is None else topk.int(),
                            [int(n) for n in seq_lens.tolist()])
    extra = global_slots(compressed_table, req, local, 256 // ratio)
    return indices, lengths, extra, (local >= 0).sum(1).to(torch.int32)


class _OutputWeights:
    """What ``output_projection`` reads of a ``V4FastCache``'s weights: the config and
    ``wo_a`` / ``wo_b`` by name."""

    def __init__(self, config: object, tensors: dict[str, torch.Tensor]) -> None:
        self.config, self._tensors = config, tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]


class _OutputCache:
    def __init__(self, weights: _OutputWeights, cos_sin: torch.Tensor) -> None:
        self.weights, self.cos_sin = weights, cos_sin


def v4_output(attn: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
              wo_a: torch.Tensor, wo_b: torch.Tensor) -> torch.Tensor:
    """``output_projection`` with the catalogue's ``v4_output`` contract (module doc)."""
    from mla.fast.v4.layer import output_projection
    from mla.reference.v4.config import get_v4_config
    from mla.reference.v4.kernels import check_output_args
    G = check_output_args(attn, positions, cos_sin, wo_a, wo_b)
    H = attn.shape[1]
    config = get_v4_config("deepseek-v4").replace(
        num_heads=H, o_groups=G, o_lora_rank=wo_a.shape[0] // G, hidden_size=wo_b.shape[0])
    dtype = torch.float32 if attn.device.type == "cpu" else attn.dtype
    weights = _OutputWeights(config, {"wo_a.weight": wo_a.to(dtype),
                                      "wo_b.weight": wo_b.to(dtype)})
    cache = _OutputCache(weights, cos_sin.float().contiguous())
    return output_projection(attn.to(dtype), positions.long(), cache)[2]  # type: ignore[arg-type]


def v4_indexer_topk(q_fp8: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                    block_table: torch.Tensor, positions: torch.Tensor, topk: int
                    ) -> torch.Tensor:
    """``v4_indexer_topk_paged`` with the catalogue's ``v4_indexer_topk`` contract (module
    doc)."""
    from mla.fast.v4 import v4_indexer_topk_paged
    from mla.reference.v4.kernels import check_indexer_topk_args
    check_indexer_topk_args(q_fp8, weights, k_cache, block_table, positions)
    visible = ((positions.long() + 1) // 4).to(torch.int32)
    widest = int(visible.max()) if visible.numel() else 0
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    return v4_indexer_topk_paged(q_fp8.view(torch.float8_e4m3fn), weights.float(), k_cache,
                                 block_table, visible, max(1, widest), topk,
                                 fill=widest <= topk)


def target() -> dict[str, Callable]:
    """``{kernel name: callable}``: the five V4 kernels above (the ``mla.fast`` target wraps
    each in its value checks)."""
    return {"v4_compress": v4_compress, "v4_indexer_q": v4_indexer_q,
            "v4_scope_indices": v4_scope_indices, "v4_output": v4_output,
            "v4_indexer_topk": v4_indexer_topk}
