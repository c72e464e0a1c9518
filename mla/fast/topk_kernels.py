"""The Triton kernels of ``mla.fast.top_k_per_row`` (the plan and the semantics: ``mla.fast.topk``).

Keys: a float32's bits ``b`` map to an int32 ``k`` that orders as the floats do (``b`` for a
positive float, ``b ^ 0x7FFFFFFF`` for a negative one; ``-0`` read as ``+0``, every NaN as
``2^31 - 1``); ``u = k ^ -2^31`` holds the same order as unsigned bits, whose bytes are the radix
digits. Ties go to the lower column: the select orders keys by ``(k, 0x7FFFFFFF - column)``,
unique per row, so "the ``need`` best" is always one exact set.
"""

from __future__ import annotations

import triton
import triton.language as tl

COL_TOP = tl.constexpr(0x7FFFFFFF)  # ic = COL_TOP - column: higher is better (lower column)
WORK_PAD = tl.constexpr(16)  # the threshold and the count, padded: each list 64-byte aligned


def work_columns(cap: int) -> int:
    """int32 a row of the kernels' scratch (``_work_row``)."""
    return 2 * cap + WORK_PAD.value


@triton.jit
def _order_keys(x):
    """float32 -> int32 keys in the floats' order (``-0`` as ``+0``, NaN above all)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit
def _row_range(starts, ends, row, W):
    """The row's ``[start, end)`` clipped to ``[0, W]`` (unvalidated ranges are never read
    outside the row) and its length."""
    start = tl.maximum(tl.load(starts + row).to(tl.int64), 0)
    end = tl.minimum(tl.load(ends + row).to(tl.int64), W)
    return start, end, tl.maximum(end - start, 0)


@triton.jit
def _work_row(work, row, CAP: tl.constexpr):
    """A row's scratch (``WORK_PAD + 2 * CAP`` int32, see ``work_columns``): the candidates'
    keys, their columns, the threshold, the survivor count."""
    base = work + row * (2 * CAP + WORK_PAD)
    return base, base + CAP, base + 2 * CAP, base + 2 * CAP + 1


@triton.jit
def _bucket(h, need, BINS: tl.constexpr):
    """The bucket ``d`` of histogram ``h`` that holds the ``need``-th best (from the top), the
    count strictly above it and in it."""
    bins = tl.arange(0, BINS)
    at_or_above = tl.cumsum(h, axis=0, reverse=True)
    d = tl.sum((at_or_above >= need).to(tl.int32), axis=0) - 1
    above = tl.sum(tl.where(bins > d, h, 0), axis=0)
    inside = tl.sum(tl.where(bins == d, h, 0), axis=0)
    return d, above, inside


@triton.jit
def _level_digit(u, ic, level):
    """Level ``0..3``: bytes of the key from the top; ``4..7``: bytes of ``ic``. The digit and
    its mask (``0xFF`` at its place)."""
    shift = 24 - 8 * (level % 4)
    word = tl.where(level < 4, u, ic)
    return (word >> shift) & 0xFF, shift


@triton.jit
def _matches(u, ic, live, hi_mask, hi_found, lo_mask, lo_found):
    """The keys whose digits fixed so far equal the boundary's."""
    return live & ((u & hi_mask) == hi_found) & ((ic & lo_mask) == lo_found)


@triton.jit
def _fix_digit(level, d, shift, hi_mask, hi_found, lo_mask, lo_found):
    """Record digit ``d`` of ``level`` in the boundary's prefix."""
    m = tl.full((), 0xFF, tl.int32) << shift
    on_hi = level < 4
    hi_mask = tl.where(on_hi, hi_mask | m, hi_mask)
    hi_found = tl.where(on_hi, hi_found | (d << shift), hi_found)
    lo_mask = tl.where(on_hi, lo_mask, lo_mask | m)
    lo_found = tl.where(on_hi, lo_found, lo_found | (d << shift))
    return hi_mask, hi_found, lo_mask, lo_found


@triton.jit
def _taken(u, ic, live, hi_mask, hi_found, lo_mask, lo_found):
    """Keys at or above the boundary's prefix: once the boundary bucket holds exactly the
    keys still needed, these are the selection."""
    mu = (u & hi_mask) ^ -2147483648  # back to signed order for the comparison
    hf = hi_found ^ -2147483648
    return live & ((mu > hf) | ((mu == hf) & ((ic & lo_mask) >= lo_found)))


@triton.jit
def _select_in_registers(u, ic, live, need, BINS: tl.constexpr):
    """Radix select of the ``need`` best of a tensor of candidates (``live``), 8 bits a level,
    stopping as soon as the boundary bucket holds exactly the keys still needed. Returns the
    selection mask. ``need`` must not exceed the live count."""
    need = tl.zeros((), tl.int32) + need
    hi_mask = tl.zeros((), tl.int32)
    hi_found = tl.zeros((), tl.int32)
    lo_mask = tl.zeros((), tl.int32)
    lo_found = tl.zeros((), tl.int32)
    level = tl.zeros((), tl.int32)
    done = tl.zeros((), tl.int32)
    while (level < 8) & (done == 0):
        digit, shift = _level_digit(u, ic, level)
        match = _matches(u, ic, live, hi_mask, hi_found, lo_mask, lo_found)
        h = tl.histogram(digit, BINS, mask=match)
        d, above, inside = _bucket(h, need, BINS)
        need -= above
        hi_mask, hi_found, lo_mask, lo_found = _fix_digit(level, d, shift, hi_mask, hi_found,
                                                          lo_mask, lo_found)
        done = (inside == need).to(tl.int32)
        level += 1
    return _taken(u, ic, live, hi_mask, hi_found, lo_mask, lo_found)


@triton.jit
def _estimate_kernel(logits, starts, ends, work, W, topk, s_l_r,
                     CAP: tl.constexpr, SAMPLE_RUNS: tl.constexpr, RUN: tl.constexpr,
                     BINS: tl.constexpr):
    """Per row a key ``thresh`` that about ``2 * topk`` keys reach (from a sample of
    ``SAMPLE_RUNS`` evenly spaced runs of ``RUN`` keys: every part of the row is seen), and the
    row's survivor count zeroed. Rows of no more than ``CAP`` keys need no threshold."""
    row = tl.program_id(0).to(tl.int64)
    start, end, n = _row_range(starts, ends, row, W)
    _, _, thresh, count = _work_row(work, row, CAP)
    tl.store(count, 0)
    if n > CAP:
        j = tl.arange(0, SAMPLE_RUNS).to(tl.int64)
        first = start + j * (n - RUN) // (SAMPLE_RUNS - 1)
        cols = first[:, None] + tl.arange(0, RUN)[None, :]
        k = _order_keys(tl.load(logits + row * s_l_r + cols))
        u = tl.reshape(k ^ -2147483648, (SAMPLE_RUNS * RUN,))
        # the sample rank that about 1.5x topk keys (plus three deviations) reach in the row
        expect = (topk * 1.0) * (SAMPLE_RUNS * RUN) / n.to(tl.float32)
        rank = tl.minimum(tl.ceil(1.5 * expect + 3.0 * tl.sqrt(expect) + 8.0),
                          SAMPLE_RUNS * RUN).to(tl.int32)
        need = rank
        found = tl.zeros((), tl.int32)
        mask = tl.zeros((), tl.int32)
        level = tl.zeros((), tl.int32)
        done = tl.zeros((), tl.int32)
        while (level < 4) & (done == 0):
            shift = 24 - 8 * level
            h = tl.histogram((u >> shift) & 0xFF, BINS, mask=(u & mask) == found)
            d, above, inside = _bucket(h, need, BINS)
            need -= above
            found = found | (d << shift)
            mask = mask | (tl.full((), 0xFF, tl.int32) << shift)
            done = (inside <= rank // 8 + 4).to(tl.int32)  # the whole bucket costs little
            level += 1
        tl.store(thresh, found ^ -2147483648)  # the bucket's floor, a signed key


@triton.jit
def _filter_kernel(logits, starts, ends, work, W, s_l_r, chunk,
                   CAP: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """One streaming read: chunk ``c`` of a row lists its keys at or above the row's threshold
    (key and request-local column) in the row's candidate list, its place reserved by one
    atomic per block that has any. The count goes on past ``CAP`` (then nothing more is
    written, and the select scans the row instead)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    start, end, n = _row_range(starts, ends, row, W)
    if n > CAP:
        keys_out, cols_out, thresh, count = _work_row(work, row, CAP)
        t = tl.load(thresh)
        # from start rounded down to 16, so that the loads are 16-byte vectors
        lo = tl.multiple_of(start - start % 16 + c * chunk, 16)
        hi = tl.minimum(lo + chunk, end)
        src = logits + row * s_l_r
        for c0 in tl.range(lo, hi, BLOCK, num_stages=STAGES):
            cols = tl.multiple_of(c0, 16) + tl.arange(0, BLOCK)
            x = tl.load(src + cols, mask=cols < W, other=0.0)
            k = _order_keys(x)
            keep = (cols >= start) & (cols < hi) & (k >= t)
            kept = tl.sum(keep.to(tl.int32), axis=0)
            if kept > 0:
                base = tl.atomic_add(count, kept, sem="relaxed")
                pos = base + tl.cumsum(keep.to(tl.int32), axis=0) - 1
                ok = keep & (pos < CAP)
                tl.store(keys_out + pos, k, mask=ok)
                tl.store(cols_out + pos, (cols - start).to(tl.int32), mask=ok)


@triton.jit
def _scan_select(src, dst, n, need, BLOCK: tl.constexpr, BINS: tl.constexpr):
    """The exact select over a whole row by one program, for rows whose threshold failed
    (fewer survivors than ``need``, or more than the list holds: massive ties, adversarial
    rows): the levels of ``_select_in_registers``, each a read of the row, then one more read
    that writes the selection in column order."""
    need = tl.zeros((), tl.int32) + need
    hi_mask = tl.zeros((), tl.int32)
    hi_found = tl.zeros((), tl.int32)
    lo_mask = tl.zeros((), tl.int32)
    lo_found = tl.zeros((), tl.int32)
    level = tl.zeros((), tl.int32)
    done = tl.zeros((), tl.int32)
    while (level < 8) & (done == 0):
        h = tl.zeros((BINS,), tl.int32)
        shift = 24 - 8 * (level % 4)
        for c0 in range(0, n, BLOCK):
            col = c0 + tl.arange(0, BLOCK)
            live = col < n
            u = _order_keys(tl.load(src + col, mask=live, other=0.0)) ^ -2147483648
            ic = COL_TOP - col.to(tl.int32)
            digit = (tl.where(level < 4, u, ic) >> shift) & 0xFF
            match = _matches(u, ic, live, hi_mask, hi_found, lo_mask, lo_found)
            h += tl.histogram(digit, BINS, mask=match)
        d, above, inside = _bucket(h, need, BINS)
        need -= above
        hi_mask, hi_found, lo_mask, lo_found = _fix_digit(level, d, shift, hi_mask, hi_found,
                                                          lo_mask, lo_found)
        done = (inside == need).to(tl.int32)
        level += 1
    written = tl.zeros((), tl.int32)
    for c0 in range(0, n, BLOCK):
        col = c0 + tl.arange(0, BLOCK)
        live = col < n
        u = _order_keys(tl.load(src + col, mask=live, other=0.0)) ^ -2147483648
        take = _taken(u, COL_TOP - col.to(tl.int32), live, hi_mask, hi_found, lo_mask,
                      lo_found)
        pos = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(dst + pos, col.to(tl.int32), mask=take)
        written += tl.sum(take.to(tl.int32), axis=0)


@triton.jit
def _select_kernel(logits, starts, ends, work, out, W, topk, s_l_r, s_o_r,
                   CAP: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr,
                   OUT_BLOCK: tl.constexpr):
    """One program a row: the exact ``topk`` best of the row's candidates, held in registers (a
    row of no more than ``CAP`` keys is its own candidate list, in column order), or of the
    whole row when the threshold failed; then ``-1`` past the row's count."""
    row = tl.program_id(0).to(tl.int64)
    start, end, n = _row_range(starts, ends, row, W)
    src = logits + row * s_l_r + start
    dst = out + row * s_o_r
    direct = n <= CAP
    cand_key, cand_col, _, count = _work_row(work, row, CAP)
    found = tl.load(count)
    if n <= topk:
        for c0 in range(0, n, OUT_BLOCK):
            i = c0 + tl.arange(0, OUT_BLOCK)
            tl.store(dst + i, i, mask=i < n)
    elif direct | ((found >= topk) & (found <= CAP)):
        i = tl.arange(0, CAP)
        live = i < tl.where(direct, n, found)
        k_row = _order_keys(tl.load(src + i, mask=live & direct, other=0.0))
        listed = live & (n > CAP)
        k = tl.where(direct, k_row, tl.load(cand_key + i, mask=listed, other=0))
        col = tl.where(direct, i, tl.load(cand_col + i, mask=listed, other=0))
        take = _select_in_registers(k ^ -2147483648, COL_TOP - col, live, topk, BINS)
        pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(dst + pos, col, mask=take)
    else:
        _scan_select(src, dst, n, topk, BLOCK, BINS)
    kept = tl.minimum(n, topk)
    for c0 in range(0, topk, OUT_BLOCK):
        i = c0 + tl.arange(0, OUT_BLOCK)
        tl.store(dst + i, tl.full((OUT_BLOCK,), -1, tl.int32), mask=(i >= kept) & (i < topk))
