"""The ``vllm-v4`` target's ``v4_scope_indices``: vLLM 0.33's scope-index Triton kernels
(``benchmarks.peers --v4``) on the catalogue's 11 cases, on the CPU under Triton's interpreter.

Nine pass. Two fail, both where vLLM assumes what its indexer's top-k writes (a row's valid ids
first, exactly ``min((p + 1) // 4, K)`` of them) and the cases scatter ``-1`` among the ids:
``decode_c4_minus_one``, named "the top-k's -1 left in place", and ``prefill_c4``, named
"the combined row takes the top-k row's first min((p + 1) // 4, K) ids as they are":
``combine_topk_swa_indices`` takes them so (the catalogue's
``prefill_first_k_as_they_are``, which the adapter's output equals exactly). The refusals
need no kernel.

Needs the extracted kernels (``python -m benchmarks.peers --v4``, in ``<repo>/peers`` or
``$MLA_PEERS``) and the interpreter (``tests/conftest.py`` sets it where there is no GPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from mla.conformance import CATALOGUE, Setting, Unsupported, cases_of
from mla.conformance.adapters import vllm_v4
from mla.conformance.cases.deepseek_v4_layer import (
    ScopeSpec,
    prefill_first_k_as_they_are,
    scope_trial,
)
from mla.conformance.runner import run_case
from tests._interpreter import needs_interpreter

SETTING = Setting(torch.device("cpu"), torch.float32, 0, True)
FAILS = {"decode_c4_minus_one": "the top-k's -1 left in place",
         "prefill_c4": "the combined row takes the top-k row's first min((p + 1) // 4, K) ids"}


def _kernels_or_skip() -> None:
    try:
        vllm_v4._scope_kernels()
    except Unsupported as e:
        pytest.skip(f"vLLM's V4 scope kernels are not unpacked: {e}"[:300])


def _recording(seen: dict) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The adapter, its last inputs and outputs kept in ``seen``."""
    def adapter(**kw: object) -> tuple[torch.Tensor, ...]:
        got = vllm_v4.v4_scope_indices(**kw)  # type: ignore[arg-type]
        seen.update(x=kw, got=got)
        return got
    return adapter


@functools.cache
def _runs() -> dict[str, tuple[Any, dict, tuple]]:
    """Each case's row, the adapter's inputs and outputs."""
    out = {}
    for c in cases_of(["v4_scope_indices"]):
        seen: dict = {}
        row = run_case(_recording(seen), c, SETTING)
        out[c.name] = (row, seen.get("x", {}), seen.get("got", ()))
    return out


@needs_interpreter
def test_the_cases_pass_but_where_vllm_assumes_its_indexer_rows() -> None:
    _kernels_or_skip()
    runs = _runs()
    assert len(runs) == 11
    for name, (row, _, _) in runs.items():
        if name in FAILS:
            assert row.status == "fail", (name, row.status, row.detail)
            assert row.convention == FAILS[name] or FAILS[name] in row.convention, (
                name, row.convention)
        else:
            assert row.status == "pass", (name, row.status, row.detail)


@needs_interpreter
def test_prefill_c4_is_vllms_first_k_ids_as_they_are() -> None:
    """The named difference is vLLM's rule exactly: its rows equal the catalogue's model, a
    ``-1`` among a row's first ``k`` ids becomes ``M·b - 1`` (``-1`` for request 0, counted),
    and with the indexer's rows as vLLM's top-k writes them the reference's are vLLM's."""
    _kernels_or_skip()
    _, x, (idx, lens) = _runs()["prefill_c4"]
    want_idx, want_lens = prefill_first_k_as_they_are(x)
    assert torch.equal(idx, want_idx) and torch.equal(lens, want_lens)
    in_length = torch.arange(idx.shape[1])[None, :] < lens[:, None]
    assert bool(((idx < 0) & in_length).any())  # request 0's -1 ids, counted
    spec = ScopeSpec(4, ((300, 37), (40, 40)), path="prefill", topk=16)  # no -1 scattered
    trial = scope_trial(SETTING, spec, 1410)
    got = trial.invoke(vllm_v4.v4_scope_indices)
    assert all(torch.equal(got[k], trial.expected[k]) for k in ("indices", "lengths"))


@pytest.mark.parametrize("change,words", [
    (dict(token_to_req=torch.tensor([0, 1, 0])), "request by request"),
    (dict(seq_lens=torch.tensor([5, 3, 7])), "request by request"),
    (dict(seq_lens=torch.tensor([5, 3, 2, 2, 2]), token_to_req=torch.tensor([0, 1, 2, 3, 4]),
          positions=torch.tensor([4, 2, 1, 1, 1]), path="prefill"), "at most 4"),
    (dict(window=96, path="prefill"), "power-of-2 window"),
    (dict(positions=torch.zeros(0, dtype=torch.long),
          token_to_req=torch.zeros(0, dtype=torch.long)), "empty batch"),
    (dict(ratio=2), "compress ratios 1, 4 and 128"),
    (dict(window=0), "positive int window"),
])
def test_it_refuses_what_vllms_path_cannot_take(change: dict, words: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # refused before any kernel is imported
    x = dict(positions=torch.tensor([4, 2, 3]), token_to_req=torch.tensor([0, 1, 1]),
             seq_lens=torch.tensor([5, 4]), window_table=torch.zeros(2, 1, dtype=torch.int32),
             compressed_table=None, topk=None, ratio=1, window=128, path="decode")
    with pytest.raises(Unsupported, match=words):
        vllm_v4.v4_scope_indices(**{**x, **change})  # type: ignore[arg-type]


def test_the_target_holds_the_scope_kernel() -> None:
    assert vllm_v4.target()["v4_scope_indices"] is vllm_v4.v4_scope_indices
    assert set(FAILS) <= {c.name for c in CATALOGUE.values() if c.kernel == "v4_scope_indices"}
