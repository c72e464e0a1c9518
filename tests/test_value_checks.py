"""The value checks that read device tensors on the host (the reference's, which the fast path
shares): one transfer when the values pass, whatever the batch, and a message per failure that
names the argument, the allowed range and the actual one. Reads are counted by wrapping the
ways a check can read a tensor on the host (``tolist``, ``bool``, ``int``, ``item``).
"""

from __future__ import annotations

import pytest
import torch

from mla.reference import sparse as ref_sparse
from mla.reference.paged_cache import make_block_table


def _count_host_reads(monkeypatch) -> list[int]:
    """Counts ``tolist``/``bool``/``int`` reads of tensors (the ways a check reads the device)."""
    reads = [0]
    for name in ("tolist", "__bool__", "__int__", "item"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, **k):
            reads[0] += 1
            return _original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def test_sparse_decode_value_checks_one_read(monkeypatch):
    """Both scopes' topk_length and indices ranges in one transfer when they pass; each
    failure names its argument, the allowed range and the actual one."""
    cache = torch.zeros(3, 4, 8)
    extra = torch.zeros(2, 4, 8)
    idx = torch.tensor([[[0, 11, -1]]], dtype=torch.int32).expand(2, 1, 3).contiguous()
    eidx = torch.tensor([[[7, -1]]], dtype=torch.int32).expand(2, 1, 2).contiguous()
    lens = torch.tensor([3, 0], dtype=torch.int32)
    elens = torch.tensor([2, 1], dtype=torch.int32)
    check = ref_sparse.check_sparse_decode_values
    scopes = dict(extra_k_cache=extra, extra_indices_in_kvcache=eidx, extra_topk_length=elens)
    reads = _count_host_reads(monkeypatch)
    check(cache, idx, lens, **scopes)
    assert reads[0] == 1
    cases = [
        (dict(topk_length=torch.tensor([4, 0], dtype=torch.int32)),
         r"topk_length must lie in \[0, topk=3\] \(one per request\), got range \[0, 4\]"),
        (dict(indices=idx.clone().index_fill_(2, torch.tensor([1]), 12)),
         r"indices must lie in \[-1, 12\) \(-1 = none; kv_cache has 12 slots\), got range "
         r"\[-1, 12\]"),
        (dict(indices=idx.clone().index_fill_(2, torch.tensor([2]), -2)),
         r"indices must lie in \[-1, 12\).*got range \[-2, 11\]"),
        (dict(extra_topk_length=torch.tensor([-1, 1], dtype=torch.int32)),
         r"extra_topk_length must lie in \[0, topk=2\].*got range \[-1, 1\]"),
        (dict(extra_indices_in_kvcache=eidx + 1),
         r"extra_indices_in_kvcache must lie in \[-1, 8\) \(-1 = none; extra_k_cache has 8 "
         r"slots\), got range \[0, 8\]"),
    ]
    for change, message in cases:
        args = dict(kv_cache=cache, indices=idx, topk_length=lens, **scopes)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            check(**args)
    check(cache, idx[:0], None)  # nothing to read: no read, no error
    check(cache, idx, None)  # one scope, no lengths


def test_topk_length_and_index_conversion_checks_one_read(monkeypatch):
    reads = _count_host_reads(monkeypatch)
    ref_sparse._check_topk_length_values(torch.tensor([0, 5], dtype=torch.int32), 5, "x")
    assert reads[0] == 1
    with pytest.raises(ValueError, match=r"topk_length must lie in \[0, topk=4\] \(one per "
                                         r"query\), got range \[0, 5\]"):
        ref_sparse._check_topk_length_values(torch.tensor([0, 5], dtype=torch.int32), 4,
                                             "one per query")
    bt = torch.zeros(2, 3, dtype=torch.int32)
    reads[0] = 0
    ref_sparse.check_index_conversion_values(torch.tensor([0, 1], dtype=torch.int32), bt,
                                             torch.tensor([-1, 0], dtype=torch.int32),
                                             torch.tensor([0], dtype=torch.int32))
    assert reads[0] == 1
    with pytest.raises(ValueError, match=r"req_id must lie in \[0, 2\) \(block_table rows\), "
                                         r"got range \[0, 2\]"):
        ref_sparse.check_index_conversion_values(torch.tensor([0, 2], dtype=torch.int32), bt,
                                                 None, None)
    with pytest.raises(ValueError, match=r"prefill_workspace_request_ids must lie in \[-1, 1\)"
                                         r".*got range \[-2, 0\]"):
        ref_sparse.check_index_conversion_values(torch.tensor([0, 1], dtype=torch.int32), bt,
                                                 torch.tensor([-2, 0], dtype=torch.int32),
                                                 torch.tensor([0], dtype=torch.int32))


def test_paged_decode_value_check_one_read(monkeypatch):
    """A passing check reads the device once, whatever the batch; float64 inputs (the
    reference's) and int32 tables alike."""
    from mla.reference.decode import check_paged_decode_values

    bt, nb = make_block_table([37, 0, 1, 80, 5], 16, spare_blocks=1, seed=4)
    kv = torch.zeros(nb, 16, 8, dtype=torch.float64)
    lens = torch.tensor([37, 0, 1, 80, 5], dtype=torch.int32)
    bt[1, :] = -1  # an empty request's entries are never read
    bt[2, 1:] = nb + 5  # nor those past a request's pages
    reads = _count_host_reads(monkeypatch)
    check_paged_decode_values(kv, bt, lens)
    assert reads[0] == 1
    check_paged_decode_values(kv, bt[:0], lens[:0])
    assert reads[0] == 1  # an empty batch reads nothing
