"""Order statistics of a top-k's keys (``mla.fast.topk.kernels`` runs them): the radix levels
of a scanned row's composites, and the searches among keys held in registers.

Two searches find the ``need``-th largest of held uint32 patterns (``_unsigned``; 0 marks an
empty place). ``_bisect`` fixes the answer's bits from the top, one a step (a compare and a
block-wide count of every item; about 20 steps on a top-k's candidates); the estimate, which
wants any key within a slack of a rank, uses it. ``_bracket_search`` narrows a bracket with two
interpolated probes a step, their counts in one block-wide sum (about 7 steps on a row's ~3000
candidates); the exact select uses it. On the H200 the bracket search in the select took the
top-k 1-4% faster than the bisection (2048 x 32K 235 us against 245, 256 x 128K 78.6 against
80.1, 1024 x 128K 245.6 against 247.9) and in the estimate 1-4% slower, where the slack lets
the bisection stop early (``benchmarks/results/topk/topk_bisect_interpolated_2026-12-02.json``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mla.fast.common import interpreting

# a joint reduction of three values on the GPU (one block-wide exchange, not three); the
# interpreter runs a reduction of a combine function one element at a time in Python
_JOINT_REDUCE = tl.constexpr(not interpreting())


@triton.jit
def _count_max_min(a0, a1, a2, b0, b1, b2):
    return a0 + b0, tl.maximum(a1, b1), tl.minimum(a2, b2)


@triton.jit
def _bucket(h, need, BINS: tl.constexpr):
    """The bucket ``d`` of histogram ``h`` that holds the ``need``-th best (from the top), the
    count strictly above it and in it: one joint reduction of the reverse cumulative counts
    (those of buckets at or below ``d`` reach ``need``; the largest of the others is the
    count above ``d``, the smallest of those ``d``'s own plus it)."""
    at_or_above = tl.cumsum(h, axis=0, reverse=True)
    reach = at_or_above >= need
    count, above, at_d = tl.reduce((reach.to(tl.int32), tl.where(reach, 0, at_or_above),
                                    tl.where(reach, at_or_above, 2147483647)), 0,
                                   _count_max_min)
    return count - 1, above, at_d - above


@triton.jit
def _composite(k, col):
    """``(key, 0x7FFFFFFF - column)`` as one non-negative int64 whose order is the selection's
    order (unique per row)."""
    return ((k.to(tl.int64) + 2147483648) << 31) | (0x7FFFFFFF - col.to(tl.int64))


@triton.jit
def _window(c, match, BITS: tl.constexpr):
    """The level's digit place: the ``BITS`` bits that end at the highest bit in which the
    matching ``c`` (non-negative) differ, the bits above it being common to all of them. That
    bit is read off the float64 exponent of ``min ^ max``, which rounding can only raise by
    one. Also returns the smallest matching ``c`` (its bits above the window are the
    common ones)."""
    cmin = tl.min(tl.where(match, c, 9223372036854775807), axis=0)
    cmax = tl.max(tl.where(match, c, 0), axis=0)
    return _place(cmin, cmax, BITS), cmin


@triton.jit
def _place(cmin, cmax, BITS: tl.constexpr):
    x = cmin ^ cmax
    top = (x.to(tl.float64).to(tl.int64, bitcast=True) >> 52) - 1023  # -1023 when x == 0
    return tl.maximum(top + 1 - BITS, 0)


@triton.jit
def _fix(cmin, shift, d, BITS: tl.constexpr):
    """The boundary's prefix after a level (the bits above the window, digit ``d`` in it) and
    the mask of the bits fixed so far."""
    ones = tl.full((), -1, tl.int64)
    above = tl.where(shift + BITS >= 63, 0, ones << tl.minimum(shift + BITS, 62))
    return (cmin & above) | (d.to(tl.int64) << shift), ones << shift


@triton.jit
def _digits(c, shift, match, BITS: tl.constexpr):
    """The histogram of the matching ``c``'s digits at ``shift``."""
    return tl.histogram((c >> shift).to(tl.int32) & ((1 << BITS) - 1), 1 << BITS, mask=match)


@triton.jit
def _level(c, match, need, BITS: tl.constexpr):
    """One radix level over the matching ``c``: the boundary's prefix and mask, the keys still
    needed, the boundary bucket's count (when it equals the keys still needed, the selection
    is every ``c`` at or above the prefix), and the window's place."""
    shift, cmin = _window(c, match, BITS)
    d, above, inside = _bucket(_digits(c, shift, match, BITS), need, 1 << BITS)
    found, mask = _fix(cmin, shift, d, BITS)
    return found, mask, need - above, inside, shift


@triton.jit
def _bisect(u, need, slack):
    """Bisection for the ``need``-th largest of the nonzero ``u`` (uint32; 0 marks an empty
    place; ``need`` at most their count): the least ``p`` whose bits from the top are fixed
    one a step, keeping at least ``need`` items at or above it. Starts below the bits all
    items share (their least and greatest) and stops once at most ``need + slack`` items
    reach ``p``. Returns ``p`` and how many reach it: exactly ``need`` (with ``slack = 0``)
    unless the ``need``-th is tied, then ``p`` is its value. No memory: a step is a compare
    and a count of every held item (about 20 steps on a top-k's candidates; two bits a step,
    three counts, ran slower on the H200)."""
    reach = tl.sum((u != 0).to(tl.int32), axis=0)
    lo = tl.min(tl.where(u != 0, u, 0xFFFFFFFF), axis=0)
    hi = tl.max(u, axis=0)
    # the highest bit in which the items differ (-1: all equal), read off the float64
    # exponent (exact below 2^53); the bits above it are every item's
    x = (lo ^ hi).to(tl.int64)
    b = tl.maximum((x.to(tl.float64).to(tl.int64, bitcast=True) >> 52) - 1023, -1)
    p = (lo.to(tl.int64) & (-1 << (b + 1))).to(tl.uint32)
    b = b.to(tl.int32)
    while (b >= 0) & (reach > need + slack):
        c = p | (tl.full((), 1, tl.uint32) << b.to(tl.uint32))
        count = tl.sum((u >= c).to(tl.int32), axis=0)
        if count >= need:
            p = c
            reach = count
        b -= 1
    return p, reach


@triton.jit
def _bracket_search(u, need):
    """The ``need``-th largest of the nonzero ``u`` (uint32; 0 marks an empty place; ``need``
    at least 1 and at most their count), by narrowing a bracket ``[a, z)``: at least ``need``
    items reach ``a``, fewer reach ``z``. A step counts the items reaching two probes inside
    it in one block-wide sum (two 16-bit counts in an int32: fewer than 65536 items), placed
    where the counts at the bracket's ends, interpolated, put the ``need``-th, a tenth of the
    distance to it either side; a step that did not halve the bracket is followed by one with
    probes at its thirds, so a bracket of ``2^32`` closes within 42 steps, whatever the keys.
    Stops once exactly ``need`` items reach ``a`` or the bracket holds one pattern. Returns
    ``a`` and how many reach it: ``need``, unless the ``need``-th is tied, then ``a`` is its
    value (``_bisect``'s convention with no slack; ``a`` itself need not be an item's)."""
    tl.static_assert(u.numel < 65536, "the counts are 16-bit fields")
    if _JOINT_REDUCE:
        reach, hi, lo = tl.reduce(((u != 0).to(tl.int32), u, tl.where(u != 0, u, 0xFFFFFFFF)),
                                  0, _count_max_min)
    else:
        reach = tl.sum((u != 0).to(tl.int32), axis=0)
        hi = tl.max(u, axis=0)
        lo = tl.min(tl.where(u != 0, u, 0xFFFFFFFF), axis=0)
    a = lo.to(tl.int64)
    z = hi.to(tl.int64) + 1
    ca = reach
    cz = tl.zeros((), tl.int32)
    thirds = tl.zeros((), tl.int32)
    while (z - a > 1) & (ca > need):
        if thirds != 0:
            c1 = a + (z - a) // 3
            c2 = a + 2 * ((z - a) // 3)
        else:
            # counts fall from ca at a to cz at z; interpolated, need is reached at a + aim
            # * scale (float32 is enough: a probe only has to land inside the bracket)
            aim = (ca - need).to(tl.float32)
            g = tl.maximum(0.1 * aim, 1.0)
            scale = tl.fdiv((z - a).to(tl.float32), (ca - cz).to(tl.float32))
            c1 = a + tl.maximum((aim - g) * scale, 0.0).to(tl.int64)
            c2 = a + tl.minimum((aim + g) * scale, 4294967296.0).to(tl.int64)
        c1 = tl.minimum(tl.maximum(c1, a + 1), z - 1)
        c2 = tl.minimum(tl.maximum(c2, c1), z - 1)
        both = tl.sum((u >= c1.to(tl.uint32)).to(tl.int32)
                      + ((u >= c2.to(tl.uint32)).to(tl.int32) << 16), axis=0)
        n1 = both & 0xFFFF
        n2 = both >> 16
        wide = z - a
        if n2 >= need:
            a = c2
            ca = n2
        elif n1 >= need:
            a = c1
            ca = n1
            z = c2
            cz = n2
        else:
            z = c1
            cz = n1
        thirds = ((thirds == 0) & ((z - a) * 2 > wide)).to(tl.int32)
    return a.to(tl.uint32), ca


@triton.jit
def _unsigned(k):
    """int32 keys as uint32 patterns in the same order: never 0 (the least key, ``-inf``'s,
    is ``0x007FFFFF``), so that 0 can mark an empty place."""
    return (k ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def _inverted(cols):
    """``0x7FFFFFFF - column`` as uint32: larger for a lower column, never 0 (columns are
    below ``2^31 - 1``)."""
    return (0x7FFFFFFF - cols).to(tl.uint32, bitcast=True)


@triton.jit
def _boundary(u, cols, need):
    """Where the ``need`` best of the held keys ``u`` (``_bracket_search``'s convention) end: the
    key ``p`` and the least inverted column ``last`` taken among the items equal to ``p``
    (1 when every item at or above ``p`` is taken). When the ``need``-th key is tied, a
    second search among its equals, on the inverted column, takes the lowest columns
    (``cols``: the items' columns, read only where equal to ``p``)."""
    p, reach = _bracket_search(u, need)
    last = tl.full((), 1, tl.uint32)
    if reach > need:
        v = tl.where(u == p, _inverted(cols), 0)
        last, _reach = _bracket_search(v, need - tl.sum((u > p).to(tl.int32), axis=0))
    return p, last
