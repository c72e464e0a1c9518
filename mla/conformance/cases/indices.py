"""Cases of ``convert_req_index_to_global_index``: the indexer's request-local top-k positions to
the cache slots the sparse kernels read (conventions §10; vLLM's
``triton_convert_req_index_to_global_index``).

Token ``t`` of request ``r = req_id[t]`` names position ``i`` of its request; the slot is
``block_table[r, i // page] · page + i % page``, and ``-1`` when ``i < 0`` (any negative, not
only ``-1``) or when the block ``i // page`` is past the row (``>= max_blocks``). With the
prefill workspace pair, a token with ``prefill_workspace_request_ids[t] = p >= 0`` maps to
``prefill_workspace_starts[p] + i`` instead (the same two rules still give ``-1``). The result is
exact: int32 ``[T, topk]``, compared element by element, and the output is poisoned before
the call. The reference reads no sequence lengths, so a position past a request's length
inside its last page maps like any other. The reference's function has no DCP mapping: there
is no DCP case.

Request-local positions are drawn inside each request's length, with the indexer's ``-1``
padding for a context shorter than ``topk``; only the "sentinels" topic has other negatives,
only "lengths" and "empty" have positions past a request's length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from mla.conformance.cases.common import call_poisoned
from mla.conformance.catalogue import Setting, Trial, generator, spec_cases
from mla.reference.paged_cache import make_block_table
from mla.reference.sparse import convert_req_index_to_global_index

__all__ = ["ConvertSpec", "convert_trial"]

KERNEL = "convert_req_index_to_global_index"
Outputs = dict[str, torch.Tensor]
INT_MIN, INT_MAX = -(2 ** 31), 2 ** 31 - 1


@dataclasses.dataclass(frozen=True)
class ConvertSpec:
    lens: tuple[int, ...]  # each request's length: its row holds ceil(len / page) pages
    page: int = 64
    tokens: int = 8
    topk: int = 64
    sentinels: tuple[int, ...] = ()  # negatives put in about a fifth of the entries
    past_length: bool = False  # a fifth of the entries past the length (last page, past row)
    prefill: tuple[int, ...] = ()  # requests whose tokens read the prefill workspace


def _positions(spec: ConvertSpec, g: torch.Generator, req: torch.Tensor,
               max_blocks: int) -> torch.Tensor:
    """int32 ``[T, topk]`` request-local positions (see the module doc)."""
    T, K = spec.tokens, spec.topk
    lens = torch.tensor(spec.lens)[req]
    u = torch.rand(T, K, generator=g, dtype=torch.float64)
    pos = (u * lens[:, None]).long()  # uniform in [0, len)
    pos = torch.where(torch.arange(K)[None, :] < lens[:, None], pos, -1)  # the -1 padding
    if spec.sentinels:
        bad = torch.tensor(spec.sentinels)[torch.randint(len(spec.sentinels), (T, K),
                                                         generator=g)]
        pos = torch.where(torch.rand(T, K, generator=g) < 0.2, bad, pos)
    if spec.past_length:
        end = (-(-lens // spec.page) * spec.page)[:, None]  # the end of the last page
        tail = lens[:, None] + (torch.rand(T, K, generator=g, dtype=torch.float64)
                                * (end - lens[:, None])).long()
        row_end = max_blocks * spec.page
        beyond = torch.tensor([row_end, row_end + spec.page - 1, row_end + 1000, INT_MAX])
        past_row = beyond[torch.randint(len(beyond), (T, K), generator=g)]
        in_tail = (torch.rand(T, K, generator=g) < 0.5) & (end > lens[:, None])
        pick = torch.rand(T, K, generator=g) < 0.2
        pos = torch.where(pick, torch.where(in_tail, tail, past_row), pos)
    return pos.to(torch.int32)


def convert_trial(setting: Setting, spec: ConvertSpec, salt: int) -> Trial:
    """A trial of ``spec``: int32 inputs on the setting's device, the reference on the CPU."""
    g = generator(setting, salt)
    table, _ = make_block_table(list(spec.lens), spec.page,
                                seed=int(torch.randint(1 << 30, (1,), generator=g)))
    R = len(spec.lens)
    req = torch.randint(R, (spec.tokens,), generator=g)
    req[:R] = torch.arange(R)[: spec.tokens]  # every request has a token
    pos = _positions(spec, g, req, table.shape[1])
    req = req.to(torch.int32)
    extra: tuple[torch.Tensor, ...] = ()
    if spec.prefill:
        # the prefill requests' rows lie one after another in the workspace
        number = {r: p for p, r in enumerate(spec.prefill)}
        ids = torch.tensor([number.get(int(r), -1) for r in req], dtype=torch.int32)
        starts = torch.tensor([0] + [spec.lens[r] for r in spec.prefill[:-1]]).cumsum(0)
        extra = (ids, starts.to(torch.int32))
    dev = setting.device
    args = tuple(t.to(dev) for t in (req, table, pos))
    dev_extra = tuple(t.to(dev) for t in extra)

    def invoke(fn: Callable) -> Outputs:
        return {"slots": call_poisoned(fn, *args, spec.page, *dev_extra)}

    def ref(workspace: bool = True) -> Outputs:
        return {"slots": convert_req_index_to_global_index(
            req, table, pos, spec.page, *(extra if workspace else ()))}

    alts: dict[str, Callable[[], Outputs]] = {}
    if spec.prefill:
        alts["the prefill workspace pair ignored: prefill tokens mapped through the block "
             "table"] = lambda: ref(workspace=False)
    return Trial(invoke, ref(), {"slots": "mismatches"}, alts)


_register = spec_cases(KERNEL, convert_trial)

_register("deepseek_v32", "shapes",
          "DeepSeek-V3.2: page 64, top-k 2048, contexts longer and shorter than top-k (-1 "
          "padding kept).",
          lambda s: ConvertSpec((300, 100, 17, 200) if s.small else (3000, 100, 2048, 5000),
                                tokens=12 if s.small else 64, topk=128 if s.small else 2048),
          300)
for _i, _p in enumerate((1, 16)):
    _register(f"page_{_p}", "pages",
              f"Page size {_p}: slot = block_table[r, i // {_p}] · {_p} + i % {_p}.",
              lambda s, p=_p: ConvertSpec((40, 7, 100, 33), page=p, tokens=10, topk=48),
              310 + _i)
_register("negative_positions", "sentinels",
          "-1, -2, -page and INT_MIN positions all convert to -1 (any negative is invalid).",
          lambda s: ConvertSpec((150, 70, 9), page=16, sentinels=(-1, -2, -16, INT_MIN)), 320)
_register("past_length", "lengths",
          "Positions past a request's length in its last page map through the table; past "
          "the block-table row (up to INT_MAX) they are -1.",
          lambda s: ConvertSpec((150, 70, 9, 64), page=16, past_length=True, tokens=12), 330)
_register("prefill_workspace", "workspace",
          "With the workspace pair, prefill tokens map to prefill_workspace_starts[p] + i, "
          "decode tokens through the block table.",
          lambda s: ConvertSpec((150, 70, 90, 40), page=16, prefill=(1, 3), tokens=12), 340)
_register("empty_row", "empty",
          "A request with no pages (its block-table row all -1) beside others: its tokens' "
          "entries, -1 and past the row, convert to -1.",
          lambda s: ConvertSpec((0, 70, 150), page=16, past_length=True, tokens=9), 341)
