"""Order statistics of a top-k's keys (``mla.fast.topk.kernels`` runs them): the radix levels
of a scanned row's composites, and the searches among keys held in registers.

Three searches find the ``need``-th largest of held uint32 patterns (``_unsigned``; 0 marks an
empty place). ``_bisect`` fixes the answer's bits from the top, one a step (a compare and a
block-wide count of every item; about 20 steps on a top-k's candidates); the estimate, which
wants any key within a slack of a rank, uses it by default. ``_bracket_search`` narrows a
bracket with two interpolated probes a step, their counts in one block-wide sum (about 7 steps
on a row's ~3000 candidates); the exact select of the candidates uses it by default. On the
H200 the bracket search in the select took the top-k 1-4% faster than the bisection (2048 x 32K
235 us against 245, 256 x 128K 78.6 against 80.1, 1024 x 128K 245.6 against 247.9) and in the
estimate 1-4% slower, where the slack lets the bisection stop early
(``benchmarks/results/topk/topk_bisect_interpolated_2026-12-02.json``). ``_quad_search`` (four
probes a step, the first from a normal guess) selects rows held whole, and is the plan's
alternative for the other two (``TopkPlan.estimate_search``, ``select_search``).
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
def _count_max_min_sums(a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5):
    return a0 + b0, tl.maximum(a1, b1), tl.minimum(a2, b2), a3 + b3, a4 + b4, a5 + b5


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _pattern_value(u):
    """The float32 an ``_unsigned`` pattern stands for (NaN for 0, the empty place)."""
    k = (u ^ 0x80000000).to(tl.int32, bitcast=True)
    return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _value_pattern(v):
    """A float32's ``_unsigned`` pattern, as int64 (any bits for a NaN: a probe is clamped
    into the bracket, so its pattern only has to be a number)."""
    b = v.to(tl.int32, bitcast=True)
    k = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
    return (k ^ -2147483648).to(tl.uint32, bitcast=True).to(tl.int64)


@triton.jit
def _normal_upper_quantile(q):
    """``z`` with ``P(Z > z) = q`` for a standard normal ``Z``, ``q`` in ``(0, 1)``
    (Abramowitz and Stegun 26.2.23, error below 4.5e-4: a guess, nothing rests on it)."""
    p = tl.minimum(q, 1.0 - q)
    t = tl.sqrt(-2.0 * tl.log(p))
    z = t - (2.515517 + t * (0.802853 + t * 0.010328)) / (
        1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308)))
    return tl.where(q <= 0.5, z, -z)


@triton.jit
def _range_and_moments(u, MOMENTS: tl.constexpr):
    """How many of ``u`` are items (nonzero), their largest and least, and with ``MOMENTS``
    how many stand for finite values, their sum and their sum of squares (float32; else
    zeros), in one block-wide exchange on the GPU."""
    if MOMENTS:
        v = _pattern_value(u)
        fin = tl.abs(v) < float("inf")  # (empty places and NaN keys are not finite)
        vf = tl.where(fin, v, 0.0)
        if _JOINT_REDUCE:
            return tl.reduce(((u != 0).to(tl.int32), u, tl.where(u != 0, u, 0xFFFFFFFF),
                              fin.to(tl.float32), vf, vf * vf), 0, _count_max_min_sums)
        return (tl.sum((u != 0).to(tl.int32), axis=0), tl.max(u, axis=0),
                tl.min(tl.where(u != 0, u, 0xFFFFFFFF), axis=0),
                tl.sum(fin.to(tl.float32), axis=0), tl.sum(vf, axis=0),
                tl.sum(vf * vf, axis=0))
    zero = tl.zeros((), tl.float32)
    if _JOINT_REDUCE:
        reach, hi, lo = tl.reduce(((u != 0).to(tl.int32), u, tl.where(u != 0, u, 0xFFFFFFFF)),
                                  0, _count_max_min)
        return reach, hi, lo, zero, zero, zero
    return (tl.sum((u != 0).to(tl.int32), axis=0), tl.max(u, axis=0),
            tl.min(tl.where(u != 0, u, 0xFFFFFFFF), axis=0), zero, zero, zero)


@triton.jit
def _least_two_greatest(a0, a1, a2, b0, b1, b2):
    """The least, second least (a multiset's: duplicates counted) and greatest of two
    triples."""
    return (tl.minimum(a0, b0), tl.minimum(tl.maximum(a0, b0), tl.minimum(a1, b1)),
            tl.maximum(a2, b2))


@triton.jit
def _bracket_extremes(u, a, z):
    """The least, second least (duplicates counted) and greatest of the items of ``u`` in
    ``[a, z)`` (at least two; ``z - 1`` fits uint32, ``z`` itself may be ``2^32``)."""
    inside = (u >= a.to(tl.uint32)) & (u <= (z - 1).to(tl.uint32))
    none = tl.full(u.shape, 0xFFFFFFFF, tl.uint32)
    x = tl.where(inside, u, none)
    if _JOINT_REDUCE:
        return tl.reduce((x, none, tl.where(inside, u, 0)), 0, _least_two_greatest)
    least = tl.min(x, axis=0)
    twice = tl.sum((x == least).to(tl.int32), axis=0) > 1
    second = tl.where(twice, least, tl.min(tl.where(x == least, none, x), axis=0))
    return least, second, tl.max(tl.where(inside, u, 0), axis=0)


@triton.jit
def _quad_search(u, need, GUESS: tl.constexpr, slack):
    """``_bracket_search`` (its bracket, its convention, its answer) with four probes a step,
    their counts in one joint block-wide sum of two int32 (two 16-bit counts each), and with
    ``GUESS`` the first four placed where a normal distribution of the items' finite values
    (their mean and deviation, summed in the same exchange as their count and range) puts
    the ``need``-th, +- 0.05 deviations. The guess only places probes inside the bracket, so
    the answer never depends on it; on random rows it halves the steps (a numpy model: 10.5
    to 3.4 on 8192 normal keys, need 2048; 17.7 to 8.0 on two far clusters). After it, the
    probes go where the counts at the bracket's ends, interpolated, put the ``need``-th, a
    tenth of the distance to it either side (at the fifths after a step that did not halve
    the bracket: a bracket of ``2^32`` closes within 64 steps, whatever the keys).

    Where one item is left to drop (``reach - need == 1``) or a step left the bracket's items
    as many as before, a step of another kind takes the bracket's least, second least and
    greatest items (``_bracket_extremes``): one item to drop, the answer is the second least
    (the least itself when the two are tied); else the bracket shrinks to ``[least, greatest
    + 1)``, its counts unchanged (the answer, where it holds one pattern). Those are the rows
    the interpolation keeps missing: with it the slowest of 132 normal rows of 8192 keys takes
    6.3 steps, not 8.3 (``benchmarks.probes.topk_search_model``); on an H100, 132 such rows
    loaded and searched took 13.0 us, not 16.2 (``topk_held_probe``, 2026-12-07).

    ``slack`` (``_bisect``'s): stops once at most ``need + slack`` items reach ``a`` (0: the
    exact answer); the estimate, which wants any key within a slack of a rank, passes it."""
    tl.static_assert(u.numel < 65536, "the counts are 16-bit fields")
    need = need + tl.zeros((), tl.int32)  # a tensor, also where it is specialized (k = 1)
    reach, hi, lo, nf, s1, s2 = _range_and_moments(u, GUESS)
    a = lo.to(tl.int64)
    z = hi.to(tl.int64) + 1
    ca = reach
    cz = tl.zeros((), tl.int32)
    fifths = tl.zeros((), tl.int32)
    first = tl.full((), GUESS, tl.int32)
    before = tl.full((), -1, tl.int32)  # the bracket's items before the last counting step
    while (z - a > 1) & (ca > need + slack):
        items = ca - cz
        if (first == 0) & ((ca - need == 1) | (items == before)):
            least, second, most = _bracket_extremes(u, a, z)
            drop = (ca - need == 1) & (second != least)
            tied = (ca - need == 1) & (second == least)
            # one item to drop: the second least, reached by need; the least tied with one to
            # drop: the least, reached by ca; else the bracket [least, most + 1), which is
            # the answer when it holds one pattern
            a = tl.where(drop, second, least).to(tl.int64)
            z = tl.where(tied, least.to(tl.int64) + 1,
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
            # counts fall as the probes rise: a is the highest probe that keeps need items,
            # z the lowest that does not
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
def _search(u, need, QUAD: tl.constexpr):
    """The ``need``-th largest of the held ``u`` and how many reach it (``_bracket_search``'s
    convention): by ``_quad_search`` with its normal guess (``QUAD``; keys that are floats'
    patterns) or by ``_bracket_search``."""
    if QUAD:
        return _quad_search(u, need, True, 0)
    return _bracket_search(u, need)


@triton.jit
def _boundary(u, cols, need, QUAD: tl.constexpr):
    """Where the ``need`` best of the held keys ``u`` (``_search``) end: the key ``p`` and the
    least inverted column ``last`` taken among the items equal to ``p`` (1 when every item at
    or above ``p`` is taken). When the ``need``-th key is tied, a second search among its
    equals, on the inverted column, takes the lowest columns (``cols``: the items' columns,
    read only where equal to ``p``, in any order)."""
    p, reach = _search(u, need, QUAD)
    last = tl.full((), 1, tl.uint32)
    if reach > need:
        v = tl.where(u == p, _inverted(cols), 0)
        last, _reach = _bracket_search(v, need - tl.sum((u > p).to(tl.int32), axis=0))
    return p, last
