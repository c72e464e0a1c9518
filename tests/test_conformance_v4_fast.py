"""``mla.fast.v4``'s kernels as the ``mla.fast`` target's DeepSeek-V4 layer kernels
(``mla.conformance.adapters.fast_v4``), run on every case of the five kernels under Triton's
interpreter (about 7 s on two cores; ``test_conformance.py``'s whole-catalogue run leaves these
kernels to this test).

All pass but the prefill cases of ``v4_scope_indices``, unsupported: ``mla.fast`` builds those
indices inside ``v4_layer_step``'s workspace gather, not as a function. The case
``v4_scope_indices/decode_c4_minus_one`` found a bug, fixed: ``v4_layer_step`` handed the
sparse decode a supplied top-k (``topk=``) as it was, ``-1`` in place, with
``extra_topk_length`` its count of valid ids, so a valid id after a ``-1`` was never attended
(the output of a decode step given ``[-1, 2, 5]`` was 34 % off the reference's on
``tiny-v4``); it now puts each row's valid ids first (``_valid_first``), as the reference does.
"""

from __future__ import annotations

import torch
from _interpreter import needs_interpreter

from mla.conformance import cases_of, run
from mla.conformance.targets import load_target

pytestmark = needs_interpreter

V4 = ("v4_compress", "v4_indexer_q", "v4_scope_indices", "v4_output", "v4_indexer_topk")
FOUND = "v4_scope_indices/decode_c4_minus_one"
PREFILL = {"v4_scope_indices/prefill_c4", "v4_scope_indices/prefill_c128",
           "v4_scope_indices/prefill_window_only"}


def test_mla_fast_runs_the_v4_layer_cases() -> None:
    name, target = load_target("mla.fast")
    assert set(V4) <= set(target)
    report = run(target, kernels=list(V4), device="cpu", dtype=torch.float32, name=name)
    rows = {f"{r.kernel}/{r.case}": r for r in report.rows}
    assert len(rows) == len(list(cases_of(list(V4)))) >= 60
    assert rows[FOUND].status == "pass", rows[FOUND]
    for key in PREFILL:
        assert rows[key].status == "unsupported" and "workspace" in rows[key].detail, key
    bad = {k: (r.status, r.detail) for k, r in rows.items()
           if r.status != "pass" and k not in PREFILL}
    assert not bad, bad


def test_the_fast_adapters_refuse_what_they_cannot_run() -> None:
    from mla.conformance import Unsupported
    from mla.conformance.adapters import fast_v4
    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16)
    try:
        fast_v4.v4_indexer_q(q, torch.zeros(1, 4, dtype=torch.bfloat16),
                             torch.zeros(1, dtype=torch.int64), torch.zeros(4, 64), 0.1, 0.5)
    except Unsupported as e:
        assert "folds 128^-0.5" in str(e)
    else:
        raise AssertionError("a softmax scale mla.fast does not fold was taken")
    try:
        fast_v4.v4_output(torch.zeros(2, 8, 256), torch.zeros(2, dtype=torch.int64),
                          torch.zeros(4, 64), torch.zeros(8, 1024), torch.zeros(16, 8))
    except ValueError as e:
        assert "attn must have shape" in str(e)
    else:
        raise AssertionError("attn of 256 columns was taken")
