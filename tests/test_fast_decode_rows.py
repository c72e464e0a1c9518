"""``mla.fast.sparse.index.decode_rows`` (one kernel) against the reference's torch version,
``mla.reference.sparse_model.reference_decode_rows``: every field bit for bit, on scrambled
block tables, ragged cached lengths (0, 1, page edges), ``s_q`` 1 to 3 and pages of 1 to 64
tokens; unvalidated, a position past the block table or on a negative page gets slot ``-1``.

Under ``TRITON_INTERPRET=1`` on the CPU (conftest sets it without a GPU); compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from mla.fast.sparse.index import decode_rows
from mla.reference.sparse_model import DecodeRows, reference_decode_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _assert_rows(got: DecodeRows, want: DecodeRows) -> None:
    for name in DecodeRows._fields:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape)
        assert torch.equal(a.cpu(), b.cpu()), f"{name}: {a.tolist()} != {b.tolist()}"


@pytest.mark.parametrize("lens,s_q,block_size", [
    ([0, 1, 15, 16, 17, 200], 1, 16),
    ([63, 64, 0], 2, 64),
    ([5, 9], 3, 1),
    ([130], 1, 64),
])
def test_matches_the_reference(lens: list[int], s_q: int, block_size: int):
    g = torch.Generator().manual_seed(sum(lens) + s_q)
    blocks = max(-(-(n + s_q) // block_size) for n in lens) + 1
    table = torch.randperm(len(lens) * blocks, generator=g).view(len(lens), blocks)
    table = table.to(torch.int32).to(DEVICE)
    cached = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    _assert_rows(decode_rows(cached, table, s_q, block_size, validate=False),
                 reference_decode_rows(cached, table, s_q, block_size))
    _assert_rows(decode_rows(cached.long(), table.long(), s_q, block_size, validate=False),
                 reference_decode_rows(cached.long(), table.long(), s_q, block_size))


def test_strided_block_table_and_empty():
    table = torch.arange(24, dtype=torch.int32, device=DEVICE).view(4, 6)[:, ::2]
    cached = torch.tensor([0, 3, 7, 11], dtype=torch.int32, device=DEVICE)
    _assert_rows(decode_rows(cached, table, 1, 4, validate=False),
                 reference_decode_rows(cached, table, 1, 4))
    none = decode_rows(cached, table, 0, 4, validate=False)
    assert none.positions.shape == (0,) and torch.equal(none.seq_lens.cpu(), cached.cpu())
    empty = decode_rows(cached[:0], table[:0], 2, 4, validate=False)
    assert empty.slots.shape == (0,) and empty.seq_lens.shape == (0,)


def test_unvalidated_positions_outside_the_table_get_no_slot():
    table = torch.tensor([[3, -1], [1, 2]], dtype=torch.int32, device=DEVICE)
    cached = torch.tensor([5, 7], dtype=torch.int32, device=DEVICE)  # pages of 4: 8 tokens
    got = decode_rows(cached, table, 2, 4, validate=False)
    # request 0: positions 5, 6 on page -1; request 1: position 7 on page 2, 8 past the table
    assert got.slots.cpu().tolist() == [-1, -1, 2 * 4 + 3, -1]
    assert got.row_ends.cpu().tolist() == [6, 7, 8, 9]
    with pytest.raises(ValueError, match="block_table"):
        decode_rows(cached, table, 2, 4, validate=True)


def test_refuses_bad_input():
    table = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    cached = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="block_table"):
        decode_rows(cached, table[:1], 1, 16)
    with pytest.raises(TypeError, match="cache_seqlens"):
        decode_rows(cached.float(), table, 1, 16)
    with pytest.raises(ValueError, match="s_q"):
        decode_rows(cached, table, -1, 16)
    with pytest.raises(ValueError, match="block_size"):
        decode_rows(cached, table, 1, 0)
