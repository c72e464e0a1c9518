"""Bad input across the API: a ``ValueError`` or ``TypeError`` that names the argument and
gives the expected and the actual shape, dtype, device or value (conventions §12), raised
before any arithmetic (in-place functions leave their outputs untouched).

Each case is ``(call, exception, pattern)``; ``pattern`` is a regular expression that contains
the argument's name and, where there is one, the expected and the actual value.
"""

from __future__ import annotations

import re

import pytest
import torch

from mla import MLAConfig, MLAWeights, get_config
from mla.reference import (
    absorbed_attention,
    apply_rope,
    attention_with_lse,
    concat_and_cache_mla,
    decode_forward,
    gather_cache,
    make_block_table,
    merge_attn_states,
    merge_attn_states_list,
    mla_decode_paged,
    mla_front,
    naive_forward,
    plan_context_chunks,
    prefill_attention,
    prefill_forward,
    slot_mapping_from_block_table,
)
from mla.reference.naive import naive_attention

E = re.escape
CFG = get_config("tiny")  # H 64, N 4, Lkv 32, P 16, R 8, V 16
W32 = MLAWeights.random(CFG, seed=0)
GEN = torch.Generator().manual_seed(0)


def rnd(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=GEN, dtype=torch.float64).to(dtype=dtype, device=device)


def i32(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# paged decode: B 2, s_q 1, N 4, D = Lkv + R = 40, 6 blocks of 4 tokens, 3 per request
D = CFG.latent_dim
Q = rnd(2, 1, 4, D)
KV = rnd(6, 4, D)
BT = i32([[0, 1, 2], [3, 4, 5]])
LENS = i32([5, 7])


def decode(q=Q, kv_cache=KV, block_table=BT, cache_seqlens=LENS, softmax_scale=0.2,
           causal=False, head_dim_v=CFG.kv_lora_rank):
    return mla_decode_paged(q, kv_cache, block_table, cache_seqlens, softmax_scale,
                            causal=causal, head_dim_v=head_dim_v)


# merge: T 5, N 3, D 8
O5, L5 = rnd(5, 3, 8), rnd(3, 5)

# front and the forwards: 5 tokens
H5, POS5 = rnd(5, CFG.hidden_size), torch.arange(5)

# paged cache write / gather: 24 slots
KV_C, K_PE, SLOTS = rnd(3, CFG.kv_lora_rank), rnd(3, CFG.qk_rope_head_dim), i32([0, 5, 23])
DST, CU = rnd(20, D), i32([0, 5, 9])

# attention: Sq 3, N 4, Skv 5
QA, KA, VA = rnd(3, 4, 8), rnd(5, 2, 8), rnd(5, 2, 6)

CASES = [
    # --- mla_decode_paged -------------------------------------------------------------------
    ("decode q rank 3", lambda: decode(q=Q[:, 0]),
     ValueError, r"q must have 4 dims, got shape \(2, 4, 40\)"),
    ("decode q rank 5", lambda: decode(q=Q[None]),
     ValueError, r"q must have 4 dims, got shape \(1, 2, 1, 4, 40\)"),
    ("decode head dim q vs kv_cache", lambda: decode(kv_cache=KV[..., :36]),
     ValueError, E("kv_cache must have shape [*, *, 40], got [6, 4, 36]")),
    ("decode kv_cache with 2 kv heads", lambda: decode(kv_cache=rnd(6, 4, 2, D)),
     ValueError, E("kv_cache must have shape [*, *, 40], got [6, 4, 2, 40]")),
    ("decode kv_cache dtype", lambda: decode(kv_cache=KV.double()),
     TypeError, "kv_cache has dtype torch.float64 but q has torch.float32"),
    ("decode kv_cache int8", lambda: decode(kv_cache=KV.to(torch.int8)),
     TypeError, "kv_cache must have dtype .*, got torch.int8"),
    ("decode block_table int64", lambda: decode(block_table=BT.long()),
     TypeError, "block_table must have dtype torch.int32, got torch.int64"),
    ("decode block_table float", lambda: decode(block_table=BT.float()),
     TypeError, "block_table must have dtype torch.int32, got torch.float32"),
    ("decode block_table rows", lambda: decode(block_table=BT[:1]),
     ValueError, E("block_table must have shape [2, *] (one row per request), got [1, 3]")),
    ("decode cache_seqlens int64", lambda: decode(cache_seqlens=LENS.long()),
     TypeError, "cache_seqlens must have dtype torch.int32, got torch.int64"),
    ("decode cache_seqlens shape", lambda: decode(cache_seqlens=i32([5, 7, 1])),
     ValueError, E("cache_seqlens must have shape [2], got [3]")),
    ("decode cache_seqlens beyond capacity", lambda: decode(cache_seqlens=i32([5, 13])),
     ValueError, E("cache_seqlens[1] = 13 exceeds the block table's capacity 3 blocks x 4 = 12")),
    ("decode negative cache_seqlens", lambda: decode(cache_seqlens=i32([-1, 7])),
     ValueError, "cache_seqlens must be >= 0, got -1 for request 0"),
    ("decode block_table past num_blocks", lambda: decode(block_table=i32([[0, 1, 2], [3, 6, 5]])),
     ValueError, E("block_table[1] points outside kv_cache's 6 blocks") + r".*\[3, 6\]"),
    ("decode negative block_table entry", lambda: decode(block_table=i32([[0, -1, 2], [3, 4, 5]])),
     ValueError, E("block_table[0] points outside kv_cache's 6 blocks") + r".*\[-1, 0\]"),
    ("decode block_table on meta", lambda: decode(block_table=BT.to("meta")),
     ValueError, "block_table is on meta but q is on cpu"),
    ("decode q on meta", lambda: decode(q=Q.to("meta")),
     ValueError, "kv_cache is on cpu but q is on meta"),
    ("decode q is a list", lambda: decode(q=Q.tolist()),
     TypeError, "q must be a torch.Tensor, got list"),
    ("decode cache_seqlens is a list", lambda: decode(cache_seqlens=[5, 7]),
     TypeError, "cache_seqlens must be a torch.Tensor, got list"),
    ("decode softmax_scale 0", lambda: decode(softmax_scale=0.0),
     ValueError, "softmax_scale must be a positive finite number, got 0.0"),
    ("decode softmax_scale negative", lambda: decode(softmax_scale=-0.2),
     ValueError, "softmax_scale must be a positive finite number, got -0.2"),
    ("decode softmax_scale nan", lambda: decode(softmax_scale=float("nan")),
     ValueError, "softmax_scale must be a positive finite number, got nan"),
    ("decode softmax_scale inf", lambda: decode(softmax_scale=float("inf")),
     ValueError, "softmax_scale must be a positive finite number, got inf"),
    ("decode softmax_scale tensor", lambda: decode(softmax_scale=torch.tensor(0.2)),
     TypeError, "softmax_scale must be a float, got Tensor"),
    ("decode head_dim_v > D", lambda: decode(head_dim_v=D + 1),
     ValueError, f"head_dim_v must be <= q's head dim {D}, got {D + 1}"),
    ("decode head_dim_v 0", lambda: decode(head_dim_v=0),
     ValueError, "head_dim_v must be positive, got 0"),
    ("decode s_q 0", lambda: decode(q=Q[:, :0]),
     ValueError, E("q must have s_q >= 1, got shape [2, 0, 4, 40]")),
    # --- front and the model-level forwards ---------------------------------------------------
    ("front hidden size", lambda: mla_front(W32, rnd(5, 32), POS5),
     ValueError, E("hidden must have shape [*, 64], got [5, 32]")),
    ("naive_forward hidden size", lambda: naive_forward(W32, rnd(5, 65)),
     ValueError, E("hidden must have shape [*, 64], got [5, 65]")),
    ("prefill_forward hidden rank", lambda: prefill_forward(W32, rnd(1, 5, 64)),
     ValueError, E("hidden must have shape [*, 64], got [1, 5, 64]")),
    ("front weights dtype vs hidden", lambda: mla_front(W32, H5.double(), POS5),
     TypeError, "weights has dtype torch.float32 but hidden has torch.float64"),
    ("naive_forward weights dtype vs hidden", lambda: naive_forward(W32, H5.bfloat16()),
     TypeError, "weights has dtype torch.float32 but hidden has torch.bfloat16"),
    ("front positions float", lambda: mla_front(W32, H5, POS5.float()),
     TypeError, "positions must have dtype .*, got torch.float32"),
    ("front positions length", lambda: mla_front(W32, H5, POS5[:4]),
     ValueError, E("positions must have shape [5], got [4]")),
    ("front hidden on meta", lambda: mla_front(W32, H5.to("meta"), POS5.to("meta")),
     ValueError, "weights is on cpu but hidden is on meta"),
    ("decode_forward kv_cache width",
     lambda: decode_forward(W32, rnd(2, 1, 64), rnd(6, 4, D + 1), BT, LENS),
     ValueError, E(f"kv_cache must have shape [*, *, {D}], got [6, 4, {D + 1}]")),
    ("decode_forward negative cache_seqlens",
     lambda: decode_forward(W32, rnd(2, 1, 64), KV.clone(), BT, i32([3, -2])),
     ValueError, "cache_seqlens must be >= 0, got minimum -2"),
    # --- paged cache --------------------------------------------------------------------------
    ("concat slot past the cache", lambda: concat_and_cache_mla(KV_C, K_PE, KV.clone(),
                                                                i32([0, 5, 24])),
     ValueError, E("slot_mapping must lie in [-1, 24) (-1 = padding), got range [0, 24]")),
    ("concat slot below -1", lambda: concat_and_cache_mla(KV_C, K_PE, KV.clone(),
                                                          i32([0, -2, 3])),
     ValueError, E("slot_mapping must lie in [-1, 24) (-1 = padding), got range [-2, 3]")),
    ("concat k_pe width", lambda: concat_and_cache_mla(KV_C, rnd(3, 9), KV.clone(), SLOTS),
     ValueError, E("k_pe must have shape [3, 8], got [3, 9]")),
    ("concat kv_c as wide as the row", lambda: concat_and_cache_mla(rnd(3, D), K_PE, KV.clone(),
                                                                    SLOTS),
     ValueError, E(f"kv_c must have fewer than kv_cache's {D} columns") + r".*\[3, 40\]"),
    ("concat slot_mapping float", lambda: concat_and_cache_mla(KV_C, K_PE, KV.clone(),
                                                               SLOTS.float()),
     TypeError, "slot_mapping must have dtype .*, got torch.float32"),
    ("concat slot_mapping length", lambda: concat_and_cache_mla(KV_C, K_PE, KV.clone(),
                                                                SLOTS[:2]),
     ValueError, E("slot_mapping must have shape [3], got [2]")),
    ("gather cu_seq_lens length", lambda: gather_cache(KV, DST.clone(), BT, i32([0, 5]), 2),
     ValueError, E("cu_seq_lens must have shape [3], got [2]")),
    ("gather cu_seq_lens decreasing", lambda: gather_cache(KV, DST.clone(), BT, i32([0, 5, 4]), 2),
     ValueError, E("cu_seq_lens must start at 0 and not decrease, got [0, 5, 4]")),
    ("gather dst dtype", lambda: gather_cache(KV, DST.double(), BT, CU, 2),
     TypeError, "dst must have dtype torch.float32, got torch.float64"),
    ("gather dst too small", lambda: gather_cache(KV, DST[:8].clone(), BT, CU, 2),
     ValueError, "dst has 8 rows but cu_seq_lens asks for 9"),
    ("gather block_table -1", lambda: gather_cache(KV, DST.clone(), i32([[0, 1, 2], [-1, 4, 5]]),
                                                   CU, 2),
     ValueError, E("block_table[1] points outside src_cache's 6 blocks") + r".*\[-1, -1\]"),
    ("gather block_table past num_blocks",
     lambda: gather_cache(KV, DST.clone(), i32([[0, 9, 2], [3, 4, 5]]), CU, 2),
     ValueError, E("block_table[0] points outside src_cache's 6 blocks") + r".*\[0, 9\]"),
    ("slot mapping past the block table",
     lambda: slot_mapping_from_block_table(BT, i32([0, 1]), i32([3, 12]), 4),
     ValueError, "positions need block index 3 but block_table has 3 columns"),
    ("make_block_table block_size 0", lambda: make_block_table([3, 5], 0),
     ValueError, "block_size must be positive, got 0"),
    # --- merge --------------------------------------------------------------------------------
    ("merge lse in [T, N] layout", lambda: merge_attn_states(O5, L5.T, O5, L5),
     ValueError, E("prefix_lse must have shape [3, 5], got [5, 3]")),
    ("merge T mismatch", lambda: merge_attn_states(O5, L5, O5[:4], L5[:, :4]),
     ValueError, E("suffix_output must have prefix_output's shape [5, 3, 8], got [4, 3, 8]")),
    ("merge N mismatch", lambda: merge_attn_states(O5, L5, O5[:, :2], L5[:2]),
     ValueError, E("suffix_output must have prefix_output's shape [5, 3, 8], got [5, 2, 8]")),
    ("merge suffix_lse vs suffix_output", lambda: merge_attn_states(O5, L5, O5, L5[:, :4]),
     ValueError, E("suffix_lse must have shape [3, 5], got [3, 4]")),
    ("merge dtype mismatch", lambda: merge_attn_states(O5, L5, O5.bfloat16(), L5),
     TypeError, "suffix_output has dtype torch.bfloat16 but prefix_output has torch.float32"),
    ("merge integer lse", lambda: merge_attn_states(O5, L5.long(), O5, L5),
     TypeError, "prefix_lse must have dtype .*, got torch.int64"),
    ("merge lse on meta", lambda: merge_attn_states(O5, L5, O5, L5.to("meta")),
     ValueError, "suffix_lse is on meta but suffix_output is on cpu"),
    ("merge list empty", lambda: merge_attn_states_list([], []),
     ValueError, "outputs and lses must be non-empty lists of one length, got 0 and 0"),
    ("merge list lengths", lambda: merge_attn_states_list([O5, O5], [L5]),
     ValueError, "outputs and lses must be non-empty lists of one length, got 2 and 1"),
    ("merge list lse layout", lambda: merge_attn_states_list([O5, O5], [L5, L5.T]),
     ValueError, E("lses[1] must have shape [3, 5], got [5, 3]")),
    ("merge list devices", lambda: merge_attn_states_list([O5, O5.to("meta")],
                                                          [L5, L5.to("meta")]),
     ValueError, E("outputs[1] is on meta but outputs[0] is on cpu")),
    ("merge list dtypes", lambda: merge_attn_states_list([O5, O5.double()], [L5, L5]),
     TypeError, E("outputs[1] has dtype torch.float64 but outputs[0] has torch.float32")),
    # --- chunk plan ---------------------------------------------------------------------------
    ("plan negative context", lambda: plan_context_chunks([3, -1], max_context_chunk=4),
     ValueError, E("context_lens must be >= 0, got [3, -1]")),
    ("plan MCC 0", lambda: plan_context_chunks([3, 4], max_context_chunk=0),
     ValueError, "max_context_chunk must be positive, got 0"),
    ("plan MCC fractional", lambda: plan_context_chunks([3, 4], max_context_chunk=2.5),
     TypeError, "max_context_chunk must be an int, got 2.5"),
    ("plan workspace too small",
     lambda: plan_context_chunks([5, 6, 0], workspace_size=10, block_size=8),
     ValueError, "workspace_size=10 leaves less than one block of 8 for each of the 2 requests"),
    ("plan no size", lambda: plan_context_chunks([5, 6]),
     ValueError, "give max_context_chunk, or workspace_size and block_size"),
    # --- attention ----------------------------------------------------------------------------
    ("attention N not a multiple of Nk", lambda: attention_with_lse(QA, rnd(5, 3, 8),
                                                                    rnd(5, 3, 6), 0.3),
     ValueError, E("q's heads (4) must be a multiple of k's heads (3)")),
    ("attention k head dim", lambda: attention_with_lse(QA, KA[..., :7], VA, 0.3),
     ValueError, E("k must have head dim 8 (q's), got shape [5, 2, 7]")),
    ("attention v tokens", lambda: attention_with_lse(QA, KA, VA[:4], 0.3),
     ValueError, E("v must have shape [5, 2, *] (k's tokens and heads), got [4, 2, 6]")),
    ("attention dtype", lambda: attention_with_lse(QA, KA.double(), VA, 0.3),
     TypeError, "k has dtype torch.float64 but q has torch.float32"),
    ("attention softmax_scale nan", lambda: attention_with_lse(QA, KA, VA, float("nan")),
     ValueError, "softmax_scale must be a positive finite number, got nan"),
    ("attention softmax_scale negative", lambda: attention_with_lse(QA, KA, VA, -0.3),
     ValueError, "softmax_scale must be a positive finite number, got -0.3"),
    ("attention q_positions length",
     lambda: attention_with_lse(QA, KA, VA, 0.3, causal=True, q_positions=torch.arange(2)),
     ValueError, E("q_positions must have shape [3], got [2]")),
    ("naive_attention k heads",
     lambda: naive_attention(QA, KA, VA, 0.3, torch.arange(3), torch.arange(5)),
     ValueError, E("k must have shape [*, 4, 8], got [5, 2, 8]")),
    ("prefill_attention softmax_scale 0",
     lambda: prefill_attention(rnd(3, 4, 16), rnd(3, 4, 8), rnd(5, 32), rnd(5, 8), W32.W_UK,
                               W32.W_UV, 0.0),
     ValueError, "softmax_scale must be a positive finite number, got 0.0"),
    ("absorbed_attention q_nope heads",
     lambda: absorbed_attention(rnd(3, 2, 16), rnd(3, 2, 8), rnd(5, 32), rnd(5, 8), W32.W_UK,
                                W32.W_UV, 0.2),
     ValueError, E("q_nope must have shape [*, 4, 16], got [3, 2, 16]")),
    ("rope width", lambda: apply_rope(rnd(3, 4, 7), torch.arange(3), CFG),
     ValueError, E("x must have shape [S, ..., 8], got [3, 4, 7]")),
    # --- config and weights -------------------------------------------------------------------
    ("config odd rope dim", lambda: CFG.replace(qk_rope_head_dim=7),
     ValueError, "qk_rope_head_dim must be even .*got 7"),
    ("config zero heads", lambda: CFG.replace(num_heads=0),
     ValueError, "num_heads must be a positive int, got 0"),
    ("config float kv_lora_rank", lambda: CFG.replace(kv_lora_rank=32.0),
     ValueError, "kv_lora_rank must be a positive int, got 32.0"),
    ("config rope_style", lambda: CFG.replace(rope_style="gptj"),
     ValueError, "rope_style must be 'interleaved' or 'neox', got 'gptj'"),
    ("config rope_factor", lambda: CFG.replace(rope_factor=0.5),
     ValueError, "rope_factor must be >= 1, got 0.5"),
    ("weights mixed dtypes", lambda: MLAWeights(**{**vars(W32), "o_proj": W32.o_proj.double()}),
     ValueError, "weight 'o_proj' is torch.float64 on cpu, but the others are torch.float32"),
    ("weights q_proj with q_lora_rank",
     lambda: MLAWeights(**{**vars(W32), "q_proj": rnd(4 * CFG.qk_head_dim, 64)}),
     ValueError, "weight 'q_proj' is not used by config 'tiny'"),
    ("state dict entry not a tensor",
     lambda: MLAWeights.from_state_dict(CFG, {**W32.state_dict(), "o_proj.weight": [1.0]}),
     TypeError, "state dict entry 'o_proj.weight' must be a tensor, got"),
]


@pytest.mark.parametrize(("call", "exc", "pattern"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_with_a_clear_message(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_cases_are_many_and_distinct():
    names = [c[0] for c in CASES]
    assert len(set(names)) == len(names) >= 20


def test_good_inputs_of_the_cases_pass():
    """The shared fixtures are valid: each case fails because of its one change."""
    out, lse = decode()
    assert out.shape == (2, 1, 4, CFG.kv_lora_rank) and lse.shape == (2, 4, 1)
    mla_front(W32, H5, POS5)
    cache = KV.clone()
    concat_and_cache_mla(KV_C, K_PE, cache, SLOTS)
    assert gather_cache(cache, DST.clone(), BT, CU, 2).shape == (9, D)
    merge_attn_states(O5, L5, O5, L5)
    merge_attn_states_list([O5, O5], [L5, L5])
    attention_with_lse(QA, KA, VA, 0.3, causal=True, q_positions=torch.arange(3))
    naive_attention(QA, KA.repeat(1, 2, 1), VA.repeat(1, 2, 1), 0.3, torch.arange(3),
                    torch.arange(5))
    plan_context_chunks([5, 6, 0], workspace_size=16, block_size=8)
    decode_forward(W32, rnd(2, 1, 64), KV.clone(), BT, i32([3, 5]))
    MLAConfig(**{**vars(CFG), "qk_rope_head_dim": 6})


def test_rejected_write_leaves_the_cache_untouched():
    cache = KV.clone()
    with pytest.raises(ValueError, match="slot_mapping"):
        concat_and_cache_mla(KV_C, K_PE, cache, i32([0, 5, 24]))
    assert torch.equal(cache, KV)


def test_rejected_gather_leaves_the_workspace_untouched():
    """The second request's bad block is found before the first request's rows are copied."""
    dst = DST.clone()
    with pytest.raises(ValueError, match=E("block_table[1]")):
        gather_cache(KV, dst, i32([[0, 1, 2], [3, -1, 5]]), i32([0, 5, 11]), 2)
    assert torch.equal(dst, DST)


def test_rejected_decode_forward_leaves_the_cache_untouched():
    cache = KV.clone()
    with pytest.raises(ValueError, match="cache_seqlens"):
        decode_forward(W32, rnd(2, 1, 64), cache, BT, i32([3, -2]))
    assert torch.equal(cache, KV)


def test_chunked_prefill_rejects_a_cache_of_another_dtype():
    """A float32 cache under float64 queries would be rounded silently; it is refused."""
    from mla.reference import chunked_prefill_attention

    c = CFG
    T, ctx = 3, [5]
    q_nope = torch.randn(T, c.num_heads, c.qk_nope_head_dim, dtype=torch.float64)
    q_pe = torch.randn(T, c.num_heads, c.qk_rope_head_dim, dtype=torch.float64)
    kv_c = torch.randn(T, c.kv_lora_rank, dtype=torch.float64)
    k_pe = torch.randn(T, c.qk_rope_head_dim, dtype=torch.float64)
    table, nb = make_block_table([ctx[0] + T], 4)
    cache = torch.randn(nb, 4, c.latent_dim, dtype=torch.float32)
    w = W32.to(torch.float64)
    args = (q_nope, q_pe, kv_c, k_pe, torch.tensor([0, T]), cache, table,
            plan_context_chunks(ctx, max_context_chunk=2), w.W_UK, w.W_UV, c.softmax_scale)
    with pytest.raises(TypeError, match=E("kv_cache has dtype torch.float32 but q_nope has "
                                          "torch.float64")):
        chunked_prefill_attention(*args)
    o, _ = chunked_prefill_attention(*args[:5], cache.double(), *args[6:])
    assert o.shape == (T, c.num_heads, c.v_head_dim)


def test_late_checks_now_come_first():
    """A bool is not a size; write_context and up_project_kv check what they index with."""
    from mla.reference import up_project_kv, write_context

    with pytest.raises(ValueError, match=E("MLAConfig.num_heads must be a positive int, got True")):
        CFG.replace(num_heads=True)
    table, nb = make_block_table([8], 4)
    cache = torch.zeros(nb, 4, CFG.latent_dim)
    hidden = torch.randn(3, CFG.hidden_size)
    with pytest.raises(ValueError, match=E("start must be a non-negative int, got -1")):
        write_context(W32, hidden, cache, table[0], start=-1)
    with pytest.raises(ValueError, match=E("block_table_row must have 1 dims")):
        write_context(W32, hidden, cache, table)
    kv_c, k_pe = torch.randn(5, CFG.kv_lora_rank), torch.randn(5, CFG.qk_rope_head_dim)
    with pytest.raises(ValueError, match=E("W_UV must have shape [32, 4, *], got [32, 3, 16]")):
        up_project_kv(kv_c, k_pe, W32.W_UK, W32.W_UV[:, :3])
    write_context(W32, hidden, cache, table[0], start=2)  # the good call passes
    assert not torch.isnan(cache).any()
