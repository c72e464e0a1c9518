"""Candidates for the held top-k's search, built for timing beside the shipped one:
``_quad_search`` (``mla.fast.topk.search``) with one or both of two more kinds of step.

Why (``benchmarks.probes.topk_search_model``, a numpy model of the rule): where the rows are as
many as the SMs, a launch lasts as long as its slowest row's chain of steps, and the slowest
of 132 normal rows of 8192 keys takes 8.3 steps against 3.3 on average; those rows end with one
item left to drop that the interpolation keeps missing, or with a tied boundary that the rule
closes only by narrowing the bracket to one pattern (19 steps on rows rounded to 1/40).

- ``MIN_MAX``: where one item is left to drop (``reach - need == 1``) or a step left the
  bracket's item count unchanged, one joint reduction gives the bracket's least, second least
  (duplicates counted) and greatest items: one pattern left is the answer; one item to drop
  is answered by the second least (by the least, tied, when the two are equal); else the
  bracket shrinks to ``[least, greatest + 1)``, its counts unchanged. Modelled: the slowest of
  132 rows in 6.3 steps (normal), 6.0 (ties of 1/40).
- ``COMPACT`` (a power of two, 0: off): once the bracket holds at most ``COMPACT`` items, they
  are written to ``scratch`` (``COMPACT`` int32) by one scan and read back, each one's count
  of greater and of at least as great among them is taken by compares in registers, and
  the one whose counts straddle the rank sought is the answer: no more steps. Modelled with
  128: normal rows need only the first step (its probes put the boundary among about 90
  items), uniform rows 2.1 steps on average and 4.7 at the most of 132.

``benchmarks.probes.topk_held_probe`` times them (``quad_min_max``, ``quad_compact``) beside
``_quad_search`` (``quad``); ``tests/test_topk_search.py`` checks their answers on the
search's hard rows. What is faster replaces the loop of ``_quad_search`` and this module goes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mla.fast.topk.search import (
    _JOINT_REDUCE,
    _add2,
    _normal_upper_quantile,
    _range_and_moments,
    _value_pattern,
)


@triton.jit
def _least_two_greatest(a0, a1, a2, b0, b1, b2):
    """The least, second least (a multiset's: duplicates counted) and greatest of two
    triples."""
    return (tl.minimum(a0, b0), tl.minimum(tl.maximum(a0, b0), tl.minimum(a1, b1)),
            tl.maximum(a2, b2))


@triton.jit
def _quad_search_candidate(u, need, scratch, GUESS: tl.constexpr, MIN_MAX: tl.constexpr,
                           COMPACT: tl.constexpr):
    """``_quad_search``'s answer and convention, with the steps of the module doc that
    ``MIN_MAX`` and ``COMPACT`` turn on (``scratch``: ``COMPACT`` int32, or any pointer)."""
    tl.static_assert(u.numel < 65536, "the counts are 16-bit fields")
    need = need + tl.zeros((), tl.int32)
    reach, hi, lo, nf, s1, s2 = _range_and_moments(u, GUESS)
    a = lo.to(tl.int64)
    z = hi.to(tl.int64) + 1
    ca = reach
    cz = tl.zeros((), tl.int32)
    fifths = tl.zeros((), tl.int32)
    first = tl.full((), GUESS, tl.int32)
    before = tl.full((), -1, tl.int32)  # the bracket's items after the last counting step
    while (z - a > 1) & (ca > need) & ((COMPACT == 0) | (ca - cz > COMPACT)):
        items = ca - cz
        if MIN_MAX & (first == 0) & ((ca - need == 1) | (items == before)):
            # the bracket's items (its top z - 1 fits uint32; z itself may be 2^32)
            inside = (u >= a.to(tl.uint32)) & (u <= (z - 1).to(tl.uint32))
            none = tl.full(u.shape, 0xFFFFFFFF, tl.uint32)
            least, second, most = tl.reduce(
                (tl.where(inside, u, none), none, tl.where(inside, u, 0)), 0,
                _least_two_greatest)
            one = least == most
            drop = (ca - need == 1) & (second != least)
            tied = (ca - need == 1) & (second == least)
            # one pattern, or the least tied: the answer is the least, reached by ca items;
            # one item to drop: the second least, reached by need; else [least, most + 1)
            a = tl.where(drop, second, least).to(tl.int64)
            z = tl.where(one | tied, least.to(tl.int64) + 1,
                         tl.where(drop, z, most.to(tl.int64) + 1))
            ca = tl.where(drop, need, ca)
            before = tl.full((), -1, tl.int32)
            fifths = tl.zeros((), tl.int32)
        else:
            before = items
            if first != 0:
                mean = s1 / nf
                sd = tl.sqrt(tl.maximum(s2 / nf - mean * mean, 0.0))
                r = reach.to(tl.float32)
                q = tl.minimum(tl.maximum(need.to(tl.float32) / r, 0.5 / r), 1.0 - 0.5 / r)
                t = mean + sd * _normal_upper_quantile(q)
                c0 = _value_pattern(t - 0.05 * sd)
                c1 = _value_pattern(t - 0.0167 * sd)
                c2 = _value_pattern(t + 0.0167 * sd)
                c3 = _value_pattern(t + 0.05 * sd)
            elif fifths != 0:
                f = (z - a) // 5
                c0 = a + f
                c1 = a + 2 * f
                c2 = a + 3 * f
                c3 = a + 4 * f
            else:
                aim = (ca - need).to(tl.float32)
                g = tl.maximum(0.1 * aim, 1.0)
                scale = tl.fdiv((z - a).to(tl.float32), (ca - cz).to(tl.float32))
                c0 = a + tl.minimum(tl.maximum((aim - g) * scale, 0.0),
                                    4294967296.0).to(tl.int64)
                c1 = a + tl.minimum(tl.maximum((aim - g / 3) * scale, 0.0),
                                    4294967296.0).to(tl.int64)
                c2 = a + tl.minimum(tl.maximum((aim + g / 3) * scale, 0.0),
                                    4294967296.0).to(tl.int64)
                c3 = a + tl.minimum(tl.maximum((aim + g) * scale, 0.0),
                                    4294967296.0).to(tl.int64)
            first = tl.zeros((), tl.int32)
            c0 = tl.minimum(tl.maximum(c0, a + 1), z - 1)
            c1 = tl.minimum(tl.maximum(c1, c0), z - 1)
            c2 = tl.minimum(tl.maximum(c2, c1), z - 1)
            c3 = tl.minimum(tl.maximum(c3, c2), z - 1)
            s01 = ((u >= c0.to(tl.uint32)).to(tl.int32)
                   + ((u >= c1.to(tl.uint32)).to(tl.int32) << 16))
            s23 = ((u >= c2.to(tl.uint32)).to(tl.int32)
                   + ((u >= c3.to(tl.uint32)).to(tl.int32) << 16))
            if _JOINT_REDUCE:
                n01, n23 = tl.reduce((s01, s23), 0, _add2)
            else:
                n01 = tl.sum(s01, axis=0)
                n23 = tl.sum(s23, axis=0)
            n0 = n01 & 0xFFFF
            n1 = n01 >> 16
            n2 = n23 & 0xFFFF
            n3 = n23 >> 16
            wide = z - a
            a_next = tl.where(n3 >= need, c3, tl.where(n2 >= need, c2, tl.where(
                n1 >= need, c1, tl.where(n0 >= need, c0, a))))
            ca_next = tl.where(n3 >= need, n3, tl.where(n2 >= need, n2, tl.where(
                n1 >= need, n1, tl.where(n0 >= need, n0, ca))))
            z = tl.where(n0 < need, c0, tl.where(n1 < need, c1, tl.where(
                n2 < need, c2, tl.where(n3 < need, c3, z))))
            cz = tl.where(n0 < need, n0, tl.where(n1 < need, n1, tl.where(
                n2 < need, n2, tl.where(n3 < need, n3, cz))))
            a = a_next
            ca = ca_next
            fifths = ((fifths == 0) & ((z - a) * 2 > wide)).to(tl.int32)
    if COMPACT:
        if (z - a > 1) & (ca > need):
            a, ca = _compact_finish(u, need, a, z, ca, cz, scratch, COMPACT)
    return a.to(tl.uint32), ca


@triton.jit
def _compact_finish(u, need, a, z, ca, cz, scratch, COMPACT: tl.constexpr):
    """The ``need``-th largest of ``u`` when the bracket ``[a, z)`` holds ``ca - cz``
    (at most ``COMPACT``) items: they are the ``need - cz``-th largest among themselves."""
    inside = (u >= a.to(tl.uint32)) & (u <= (z - 1).to(tl.uint32))
    place = tl.cumsum(inside.to(tl.int32), axis=0) - 1
    tl.store(scratch + place, u.to(tl.int32, bitcast=True), mask=inside)
    tl.debug_barrier()  # every item stored before any is read
    m = ca - cz
    rank = need - cz
    j = tl.arange(0, COMPACT)
    v = tl.load(scratch + j, mask=j < m, other=0).to(tl.uint32, bitcast=True)
    greater = tl.zeros((COMPACT,), tl.int32)
    at_least = tl.zeros((COMPACT,), tl.int32)
    for c in tl.static_range(0, COMPACT, 32):
        k = c + tl.arange(0, 32)
        w = tl.load(scratch + k, mask=k < m, other=0).to(tl.uint32, bitcast=True)
        live = (k < m)[None, :]
        greater += tl.sum(((w[None, :] > v[:, None]) & live).to(tl.int32), axis=1)
        at_least += tl.sum(((w[None, :] >= v[:, None]) & live).to(tl.int32), axis=1)
    tl.debug_barrier()  # every item read before the caller writes the scratch again
    answer = (j < m) & (greater < rank) & (at_least >= rank)
    key = tl.max(tl.where(answer, v, 0), axis=0)
    return key.to(tl.int64), cz + tl.max(tl.where(answer, at_least, 0), axis=0)
