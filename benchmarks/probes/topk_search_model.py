"""``python -m benchmarks.probes.topk_search_model [--rows N] [--long WIDTH] [--out FILE]``: how
many steps the top-k's searches take, row by row, in a numpy model (no GPU).

``mla.fast.topk.search._quad_search`` narrows a bracket ``[a, z)`` of uint32 patterns with four
probes a step, each step one block-wide exchange of two int32. One program holds one row, so
where the rows are as many as the SMs the launch lasts as long as its slowest row's chain of
steps: the held kernel's search took 3.4 us at one row of 8192 and 10.0 at 132 rows on an
H100 (``topk_held_probe_column_order_2026-12-07.json``). This model replays the search's
rule in numpy (its float32 guess, its interpolation, its fifths) on rows of 8192 keys with
``need`` 2048 and counts the steps of each row, for

- ``plain``: the rule without the exchange below (``_quad_search`` before 2026-12-07);
- ``min_max``: the same, plus one exchange of the bracket's least, second least and greatest
  items (one joint reduction, as a step's counts are) where one item is left to drop
  (``reach - need == 1``: the second least is the answer, or the least if it is tied) or
  where a step left the bracket's item count unchanged (all equal: the answer; else the
  bracket shrinks to ``[least, greatest + 1)`` and the interpolation aims on the items' own
  range), each such exchange counted as a step: the rule ``_quad_search`` runs;
- ``compact``: the plain rule until the bracket holds at most 128 items, which are then
  ranked among themselves (built and timed, slower on the GPU: ``benchmarks/notes/topk.md``);
  the steps counted are those before that finish (a scan, a store and a read of the items,
  compares in registers and one block-wide maximum).

``--long WIDTH``: rows longer than the list instead (``run_long``), the general route's two
searches: the estimate's on the sample (``_bisect``'s rule or the quad rule, each stopping
within the estimate's slack) and the select's on the survivors (``_bracket_search``'s rule or
the quad rule), as ``TopkPlan.estimate_search`` and ``select_search`` choose them.

Every answer is checked against a sort (the search's convention: exactly ``need`` items
reach ``a``, or the ``need``-th is tied and ``a`` is its value). Prints, for each family of
rows, the mean and the 99th percentile of the steps and the mean over groups of 132 rows of
the group's most; ``--out``: the same as JSON. The model's float32 sums are numpy's, not the
GPU's reduction order: its step counts are the rule's, not a replay of a kernel's run.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

WIDTH, NEED, SMS = 8192, 2048, 132
FAMILIES = ("normal", "ties of 1/40", "ties of 1/2000", "uniform", "two clusters")


def patterns(x: np.ndarray) -> np.ndarray:
    """float32 values as the search's uint32 patterns (``_unsigned(_order_keys(x))``), int64."""
    b = x.astype(np.float32).view(np.int32).astype(np.int64)
    b = np.where(b == -(2 ** 31), 0, b)
    k = np.where(b < 0, b ^ 0x7FFFFFFF, b)
    k = np.where(np.isnan(x), 0x7FFFFFFF, k)
    return (k ^ -(2 ** 31)) & 0xFFFFFFFF


def _f32(v: float) -> float:
    return float(np.float32(v))


def _pattern(v: float) -> int:
    return int(patterns(np.array([v], dtype=np.float32))[0])


def _normal_upper_quantile(q: float) -> float:
    p = min(q, 1 - q)
    t = math.sqrt(-2 * math.log(p))
    z = t - (2.515517 + t * (0.802853 + t * 0.010328)) / (
        1 + t * (1.432788 + t * (0.189269 + t * 0.001308)))
    return z if q <= 0.5 else -z


def search(u: np.ndarray, x: np.ndarray, need: int, min_max: bool, compact: int = 0,
           slack: int = 0) -> tuple[int, int, int]:
    """``(a, reach, steps)`` of the rule (``min_max``: with the exchange of the bracket's least
    and greatest items; ``compact``: ranking the bracket's items once they are this few;
    ``slack``: stopping once at most ``need + slack`` items reach ``a``)."""
    reach, hi, lo = int((u != 0).sum()), int(u.max()), int(u[u != 0].min())
    fin = np.isfinite(x)
    xf = x[fin].astype(np.float32)
    nf, s1, s2 = _f32(fin.sum()), _f32(xf.sum(dtype=np.float32)), _f32((xf * xf).sum(
        dtype=np.float32))
    a, z, ca, cz, fifths, first, steps, before = lo, hi + 1, reach, 0, False, True, 0, -1
    while z - a > 1 and ca > need + slack:
        if compact and ca - cz <= compact:
            inside = np.sort(u[(u >= a) & (u < z)])[::-1]
            key = int(inside[need - cz - 1])
            return key, cz + int((inside >= key).sum()), steps
        steps += 1
        if min_max and not first and (ca - need == 1 or ca - cz == before):
            inside = u[(u >= a) & (u < z)]
            least, most = int(inside.min()), int(inside.max())
            if least == most:
                return least, ca, steps
            if ca - need == 1:
                if int((inside == least).sum()) > 1:
                    return least, ca, steps
                return int(inside[inside > least].min()), ca - 1, steps
            a, z, before = least, most + 1, -1  # the counts at both ends stay
            continue
        before = ca - cz
        if first:
            mean = _f32(s1 / nf)
            sd = _f32(math.sqrt(max(_f32(s2 / nf) - mean * mean, 0.0)))
            q = min(max(need / reach, 0.5 / reach), 1 - 0.5 / reach)
            t = _f32(mean + sd * _normal_upper_quantile(q))
            c = [_pattern(_f32(t + d * sd)) for d in (-0.05, -0.0167, 0.0167, 0.05)]
        elif fifths:
            f = (z - a) // 5
            c = [a + f, a + 2 * f, a + 3 * f, a + 4 * f]
        else:
            aim = _f32(ca - need)
            g = max(_f32(0.1 * aim), 1.0)
            scale = _f32((z - a) / (ca - cz))
            c = [a + int(min(max(_f32((aim + d) * scale), 0.0), 2.0 ** 32))
                 for d in (-g, -g / 3, g / 3, g)]
        first = False
        c[0] = min(max(c[0], a + 1), z - 1)
        for i in (1, 2, 3):
            c[i] = min(max(c[i], c[i - 1]), z - 1)
        n = [int((u >= ci).sum()) for ci in c]
        wide = z - a
        a_next, ca_next = a, ca
        for ci, ni in zip(c, n):
            if ni >= need:
                a_next, ca_next = ci, ni
        for ci, ni in zip(c, n):
            if ni < need:
                z, cz = ci, ni
                break
        a, ca = a_next, ca_next
        fifths = not fifths and (z - a) * 2 > wide
    return a, ca, steps


def bisect(u: np.ndarray, need: int, slack: int) -> tuple[int, int, int]:
    """``(p, reach, steps)`` of ``mla.fast.topk.search._bisect``'s rule: a bit a step from the
    highest in which the items differ, stopping once at most ``need + slack`` reach ``p``."""
    live = u[u != 0]
    reach, lo, hi = len(live), int(live.min()), int(live.max())
    b = (lo ^ hi).bit_length() - 1
    p = lo & ~((1 << (b + 1)) - 1)
    steps = 0
    while b >= 0 and reach > need + slack:
        c = p | (1 << b)
        n = int((u >= c).sum())
        steps += 1
        if n >= need:
            p, reach = c, n
        b -= 1
    return p, reach, steps


def bracket(u: np.ndarray, need: int) -> tuple[int, int, int]:
    """``(a, reach, steps)`` of ``_bracket_search``'s rule: two interpolated probes a step, a
    tenth of the distance to the aim either side, at the thirds after a step that did not
    halve the bracket."""
    live = u[u != 0]
    a, z, ca, cz, thirds, steps = int(live.min()), int(live.max()) + 1, len(live), 0, False, 0
    while z - a > 1 and ca > need:
        steps += 1
        if thirds:
            c1, c2 = a + (z - a) // 3, a + 2 * ((z - a) // 3)
        else:
            aim = _f32(ca - need)
            g = max(_f32(0.1 * aim), 1.0)
            scale = _f32((z - a) / (ca - cz))
            c1 = a + int(max(_f32((aim - g) * scale), 0.0))
            c2 = a + int(min(_f32((aim + g) * scale), 2.0 ** 32))
        c1 = min(max(c1, a + 1), z - 1)
        c2 = min(max(c2, c1), z - 1)
        n1, n2, wide = int((u >= c1).sum()), int((u >= c2).sum()), z - a
        if n2 >= need:
            a, ca = c2, n2
        elif n1 >= need:
            a, ca, z, cz = c1, n1, c2, n2
        else:
            z, cz = c1, n1
        thirds = not thirds and (z - a) * 2 > wide
    return a, ca, steps


def run_long(rows: int, width: int = 8193, seed: int = 1) -> dict:
    """Rows longer than the list (``width`` keys, k = ``NEED``), the default plan's estimate
    and select: the sample (``TopkPlan.sample_runs_for`` runs of 8, the rank ``_sample`` aims
    at), searched by bisection or by the quad rule, each stopping within the estimate's slack;
    then the keys reaching the bisection's threshold (the survivors) searched exactly for the
    ``NEED``-th by the bracket rule or the quad rule. Steps a row, as ``run`` reports them."""
    from mla.fast.topk import TopkPlan

    plan = TopkPlan()
    runs = plan.sample_runs_for(width, NEED)
    cols = (np.arange(runs)[:, None] * ((width - 8) // (runs - 1)) + np.arange(8)).ravel()
    expect = NEED * runs * 8 / width
    aim = int(min(math.ceil(plan.oversample * expect + 3 * math.sqrt(expect) + 8),
                  0.5 * (expect + 8192 * runs * 8 / width), runs * 8))
    slack = aim // 16 + 2
    out = {}
    for family in FAMILIES:
        rng = np.random.default_rng(seed)
        steps: dict[str, list[int]] = {k: [] for k in (
            "estimate, bisect", "estimate, quad", "select, bracket", "select, quad")}
        kept = []
        for _ in range(rows):
            x = row(family, rng, width)
            u = patterns(x)
            t, _r, n = bisect(u[cols], aim, slack)
            steps["estimate, bisect"].append(n)
            steps["estimate, quad"].append(search(u[cols], x[cols], aim, True, slack=slack)[2])
            live = u >= t
            kept.append(int(live.sum()))
            if not NEED <= kept[-1] <= 8192:
                continue  # (scanned: no select among candidates)
            for name, (a, reach, n) in (("select, bracket", bracket(u[live], NEED)),
                                        ("select, quad", search(u[live], x[live], NEED, True))):
                check(u[live], NEED, a, reach)
                steps[name].append(n)
        for name, st in steps.items():
            st = np.array(st)
            out[f"{family}, {name}"] = {"mean": round(float(st.mean()), 2),
                                        "p99": round(float(np.percentile(st, 99)), 1),
                                        "max": int(st.max())}
        out[f"{family}, survivors"] = {"mean": round(float(np.mean(kept)), 1),
                                       "max": int(np.max(kept))}
    return out


def row(family: str, rng: np.random.Generator, width: int = WIDTH) -> np.ndarray:
    x = rng.standard_normal(width)
    if family == "ties of 1/40":
        x = np.round(x * 40) / 40
    elif family == "ties of 1/2000":
        x = np.round(x * 2000) / 2000
    elif family == "uniform":
        x = rng.random(width)
    elif family == "two clusters":
        x = x + np.where(rng.random(width) < 0.5, -6.0, 6.0)
    return x.astype(np.float32)


def check(u: np.ndarray, need: int, a: int, reach: int) -> None:
    desc = np.sort(u[u != 0])[::-1]
    assert reach == int((u >= a).sum()), "the count returned is not the count at a"
    assert reach == need or (reach > need and a == int(desc[need - 1])), (a, reach)


def run(rows: int, seed: int = 1) -> dict:
    out = {}
    for family in FAMILIES:
        for rule in ("plain", "min_max", "compact"):
            rng = np.random.default_rng(seed)
            steps = []
            for _ in range(rows):
                x = row(family, rng)
                u = patterns(x)
                a, reach, s = search(u, x, NEED, rule == "min_max",
                                     128 if rule == "compact" else 0)
                check(u, NEED, a, reach)
                steps.append(s)
            st = np.array(steps)
            groups = [int(st[i:i + SMS].max()) for i in range(0, rows - SMS + 1, SMS)]
            out[f"{family}, {rule}"] = {
                "mean": round(float(st.mean()), 2), "p99": float(np.percentile(st, 99)),
                f"mean_max_of_{SMS}": round(float(np.mean(groups)), 2) if groups else None,
                "histogram": np.bincount(st).tolist()}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1320, help="rows a family (groups of 132)")
    p.add_argument("--out", type=Path, help="the numbers as JSON")
    p.add_argument("--long", type=int, default=0, metavar="WIDTH",
                   help="rows of WIDTH keys (longer than the list): the estimate's and the "
                        "select's rules (run_long)")
    args = p.parse_args(argv)
    if args.long:
        res = run_long(args.rows, args.long)
        for name, r in res.items():
            print(f"{name:36s} " + "  ".join(f"{k} {v}" for k, v in r.items()))
        if args.out:
            args.out.write_text(json.dumps({
                "what": f"steps of the estimate's and the select's searches on rows of "
                        f"{args.long} keys, need {NEED}, {args.rows} rows a family, seed 1 "
                        "(numpy models of _bisect, _bracket_search and _quad_search; "
                        "benchmarks.probes.topk_search_model --long)", "rows": res}, indent=1))
        return 0
    res = run(args.rows)
    for name, r in res.items():
        print(f"{name:28s} mean {r['mean']:5.2f}  p99 {r['p99']:4.0f}  "
              f"max of {SMS} {r[f'mean_max_of_{SMS}']}")
    if args.out:
        args.out.write_text(json.dumps({
            "what": "steps of the held top-k's search a row (numpy model of _quad_search, "
                    f"rows of {WIDTH} keys, need {NEED}, {args.rows} rows a family, seed 1), "
                    "plain, with an exchange of the bracket's least and greatest items (the rule "
                    "shipped from 2026-12-07), and "
                    "with the bracket's last 128 items ranked among themselves (steps before "
                    "that finish) (benchmarks.probes.topk_search_model)", "rows": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
