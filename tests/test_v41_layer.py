"""DeepSeek-V4.1's layer topology (``V4Config`` with ``version="v4.1"``) and its two-level
candidate blocks (``mla.reference.v4.candidates``) against definitions written as loops.

Everything is exact (indices and maxima), so the tests compare with equality.
"""

from __future__ import annotations

import math

import pytest
import torch

from mla.reference.v4.candidates import (
    candidate_block_scores,
    mask_to_candidates,
    select_candidate_blocks,
)
from mla.reference.v4.config import V4Config, get_v4_config

INF = float("inf")


def _v41(**kw: object) -> V4Config:
    base = dict(name="tiny-v41", hidden_size=64, num_heads=4, q_lora_rank=32, o_lora_rank=16,
                o_groups=2, sliding_window=8, compress_ratios=(0, 2, 1, 2, 2, 1),
                index_n_heads=4, index_topk=3, q_head_norm=False, version="v4.1",
                kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 2, 4),
                candidate_source_layer_id=2, candidate_topk_blocks=2, candidate_block_size=4,
                mtp_compress_ratios=(2,))
    base.update(kw)
    return V4Config(**base)  # type: ignore[arg-type]


def test_flash_preset_as_the_wheel_states_it():
    c = get_v4_config("deepseek-v4.1-flash")
    assert (c.hidden_size, c.num_heads, c.q_lora_rank, c.o_groups, c.o_lora_rank,
            c.sliding_window, c.index_topk, c.num_layers) == (5120, 64, 1280, 8, 1024, 128,
                                                              512, 40)
    assert not c.q_head_norm and c.version == "v4.1"
    assert c.kv_source_layer_ids == (2, 8, 14, 20)
    assert c.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert [c.layer_ratio(i) for i in (0, 1)] == [0, 0]
    assert c.layer_ratio(40) == 0  # the MTP layer: window only
    assert c.kv_source_layer(39) == 20 and c.index_source_layer(39) == 36
    assert c.kv_source_layer(0) is None and c.index_source_layer(40) is None
    assert not c.compressor_overlap(2) and not c.compressor_overlap(4)
    # every compressed layer reads its KV source's cache at its own ratio; the last source
    # and the later indexers are ratio-1 (nvidia/model.py:766-768, 867)
    assert all(c.layer_ratio(c.kv_source_layer(i)) == c.layer_ratio(i)
               for i in range(c.num_layers) if c.layer_ratio(i) > 0)
    assert [c.layer_ratio(i) for i in (20, 24, 28, 32, 36)] == [1] * 5


def test_source_layers_are_the_nearest_at_or_below():
    c = _v41()
    for layer in range(c.num_layers + c.num_mtp_layers):
        r = c.layer_ratio(layer)
        if r == 0:
            assert c.kv_source_layer(layer) is None and c.index_source_layer(layer) is None
            continue
        kv = max(s for s in c.kv_source_layer_ids if s <= layer)
        ix = max(s for s in c.index_source_layer_ids if s <= layer)
        assert (c.kv_source_layer(layer), c.index_source_layer(layer)) == (kv, ix)
    assert [c.layer_ratio(i) for i in range(7)] == [0, 2, 1, 2, 2, 1, 2]
    # the MTP layer (6) is compressed here and reads the last backbone sources; it owns none
    assert (c.kv_source_layer(6), c.index_source_layer(6)) == (3, 4)
    assert not c.owns_compressor(6) and not c.owns_indexer(6)
    assert [c.owns_compressor(i) for i in range(6)] == [False, True, False, True, False, False]
    assert [c.candidate_role(i) for i in range(7)] == [None, None, "write", None, "mask",
                                                       None, None]


def test_v4_configs_are_unchanged():
    v4 = get_v4_config("deepseek-v4")
    assert v4.version == "v4" and v4.layer_ratio(v4.num_layers) == 1
    assert v4.compressor_overlap(4) and not v4.compressor_overlap(128)
    with pytest.raises(ValueError):
        v4.kv_source_layer(2)


@pytest.mark.parametrize("kw", [
    dict(compress_ratios=(0, 4)),  # V4's ratio in a V4.1 config
    dict(compress_ratios=(2, 2), kv_source_layer_ids=(1,), index_source_layer_ids=(1,),
         candidate_source_layer_id=-1),  # layer 0 compressed below every source
    dict(kv_source_layer_ids=(1, 9)),  # not a backbone layer
    dict(candidate_source_layer_id=3),  # not an index source
    dict(candidate_block_size=0),
    dict(mtp_compress_ratios=(2, 2)),  # more than num_mtp_layers
    dict(version="v5"),
])
def test_bad_v41_configs(kw):
    with pytest.raises(ValueError):
        _v41(**kw)


def test_v4_rejects_v41_fields():
    with pytest.raises(ValueError):
        get_v4_config("tiny-v4").replace(kv_source_layer_ids=(1,))
    with pytest.raises(ValueError):
        get_v4_config("tiny-v4").replace(compress_ratios=(0, 2, 4))


# ---- candidate blocks ---------------------------------------------------------------------

def _scores_loop(logits: list[float], n: int, B: int) -> list[float]:
    nb = math.ceil(len(logits) / B)
    out = []
    for b in range(nb):
        vals = [logits[c] for c in range(b * B, min((b + 1) * B, n))]
        s = -INF if not vals else (math.nan if any(math.isnan(v) for v in vals) else max(vals))
        out.append(INF if n > 0 and b == (n - 1) // B else s)
    return out


def _rows(seed: int, rows: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, N, generator=g, dtype=torch.float64),
            torch.randint(0, N + 1, (rows,), generator=g))


@pytest.mark.parametrize("N,B", [(1, 4), (10, 4), (16, 4), (17, 1), (9, 16)])
def test_block_scores_are_the_loop(N, B):
    logits, lengths = _rows(N * B, 6, N)
    lengths[0], lengths[1] = 0, N
    got = candidate_block_scores(logits, lengths, B)
    for i in range(6):
        want = torch.tensor(_scores_loop(logits[i].tolist(), int(lengths[i]), B),
                            dtype=torch.float64)
        assert torch.equal(got[i], want)


def test_select_pins_the_newest_block_and_takes_the_best():
    logits = torch.tensor([[5.0, 0.0, -1.0, 9.0, 2.0, 1.0, -3.0, -2.0, 0.5, 0.0]])
    # blocks of 2: maxima 5, 9, 2, -2, 0.5; 7 valid -> newest block 3 (entries 6, 7 -> 6 only)
    sel = select_candidate_blocks(logits, torch.tensor([7]), 2, 3)
    assert sel.tolist() == [[3, 1, 0]]
    sel = select_candidate_blocks(logits, torch.tensor([7]), 2, 6)
    assert sel.tolist() == [[3, 1, 0, 2, -1, -1]]  # blocks 4 (past the row) is -inf: -1
    assert select_candidate_blocks(logits, torch.tensor([0]), 2, 2).tolist() == [[-1, -1]]


def test_nan_block_ranks_first():
    logits = torch.tensor([[1.0, math.nan, 3.0, 4.0, 0.0, 0.0]])
    # blocks: NaN, 4, the newest (+inf): the NaN block outranks 4
    assert set(select_candidate_blocks(logits, torch.tensor([6]), 2, 2)[0].tolist()) == {0, 2}


@pytest.mark.parametrize("seed", range(4))
def test_mask_is_the_loop_and_the_topk_stays_inside(seed):
    B, K, N = 4, 2, 23
    logits, lengths = _rows(seed, 5, N)
    source_logits = _rows(seed + 100, 5, N)[0]
    cand = select_candidate_blocks(source_logits, lengths, B, K)
    masked = mask_to_candidates(logits, lengths, cand, B)
    for i in range(5):
        keep = set(cand[i].tolist()) - {-1}
        n = int(lengths[i])
        if n:
            assert (n - 1) // B in keep  # the newest block is always a candidate
        for c in range(N):
            want = logits[i, c].item() if c < n and c // B in keep else -INF
            assert masked[i, c].item() == want
        top = masked[i].topk(min(3, n)).indices.tolist() if n else []
        assert all(c // B in keep and c < n for c in top if masked[i, c] > -INF)


def test_bad_candidate_input():
    logits, lengths = _rows(0, 2, 8)
    with pytest.raises(ValueError):
        candidate_block_scores(logits, torch.tensor([0, 9]), 4)
    with pytest.raises(ValueError):
        select_candidate_blocks(logits, lengths, 4, 0)
    with pytest.raises(ValueError):
        mask_to_candidates(logits, lengths, torch.zeros(3, 2, dtype=torch.int64), 4)
