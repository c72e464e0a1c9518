"""``python -m benchmarks.topk_held_radix --out DIR``: a probe of the one top-k design the
notes left untried, a row held on chip by a group of co-resident programs and selected by
radix rounds exchanged between them (the design of vLLM's ``persistent_topk``), in plain
Triton: timed beside ``mla.fast.top_k_per_row`` on the H200. A probe, not a route.

The kernel (``_held_radix_kernel``), launched cooperatively (every program resident, so a
wait on another program cannot hang): a grid of ``groups * G`` programs; group ``g`` takes
rows ``g, g + groups, ...``; member ``m`` of a group loads columns ``[m * CHUNK, (m + 1) *
CHUNK)`` of its row into registers once, as 32-bit keys ordered as the floats (NaN above every
number, ``-0`` equal to ``+0``), then up to four rounds of 8 bits from the top: a 256-bin
``tl.histogram`` of the held keys whose higher bits equal the prefix chosen so far, added
into the row's histogram in global memory (an atomic a non-empty bin), an arrival counted
and a spin until all ``G`` arrived, then every member reads the merged histogram and picks the
same digit. A round whose chosen bin holds exactly the keys still needed ends the search
(the rows of random floats need two or three rounds). Where four rounds leave a tie at the
boundary, members exchange their tied counts and the lowest columns are taken. Each member
writes its chosen columns (column order within the member, members in the order they reserve
places). The last member to finish a row zeroes its scratch, so that a CUDA graph can replay
the launch. ``PREFETCH``: after loading its chunk, a member asks the L2 for the chunk of its
next row (``prefetch.global.L2``), so that HBM streams it while the rounds run.

Timed as ``benchmarks.topk_routes`` times the routes (graph replays, L2 flushed by a read,
median of three runs) at rows of 128K; every timed set compared with ``torch.topk``'s after a
replay. Writes ``topk_held_radix.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from benchmarks.common import capture, ceilings, log, time_replays
from benchmarks.topk_sweep import TOPK, _full, _pct, replayed
from mla.conformance.cases.indexer import as_sets
from mla.environment import environment
from mla.fast.topk import TopkPlan
from mla.reference.indexer_logits import top_k_per_row

SCRATCH = tl.constexpr(4 * 256 + 8 + 64)  # per row: four rounds' histograms, counters, tied counts


@triton.jit
def _arrive_and_wait(counter, target):
    """Every thread's earlier stores and atomics, then an arrival on ``counter``
    (release), then a spin until it reaches ``target`` (acquire)."""
    tl.debug_barrier()
    tl.atomic_add(counter, 1, sem="release")
    while tl.atomic_add(counter, 0, sem="acquire") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _stamp_after(dep):
    """``globaltimer`` read once ``dep`` (an int32 scalar) is known."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _keys(x):
    """uint32 keys ordered as the floats ``x``, NaN above every number, ``-0`` as ``+0``: the
    order of ``mla.fast.topk_kernels._order_keys`` then ``topk_search._unsigned``, computed
    here without their ``-0`` select before the sign test (with it, ptxas spilled 16 B at 128
    registers in this kernel)."""
    b = x.to(tl.int32, bitcast=True)
    key = b ^ ((b >> 31) & 0x7FFFFFFF)  # signed, ordered as the floats
    u = (key ^ -2147483648).to(tl.uint32, bitcast=True)
    u = tl.where(x == 0.0, 0x80000000, u)
    return tl.where(x != x, 0xFFFFFFFF, u)


@triton.jit
def _ties_before(sc, cnt, m, n_eq, G: tl.constexpr):
    """The boundary key's equals held by the members before ``m`` (each member stores its
    count ``n_eq``, then the group waits for all of them)."""
    tl.store(sc + 4 * 256 + 8 + m, n_eq)
    _arrive_and_wait(cnt + 4, G)
    gm = tl.arange(0, 64)
    return tl.sum(tl.load(sc + 4 * 256 + 8 + gm, mask=gm < m, other=0, volatile=True), 0)


@triton.jit
def _held_radix_kernel(logits, out, scratch, stamps, R, N, s_l_r, s_o_r, topk,
                       G: tl.constexpr, CHUNK: tl.constexpr, PREFETCH: tl.constexpr,
                       RELOAD: tl.constexpr, TILE: tl.constexpr, EVEN: tl.constexpr,
                       STAMP: tl.constexpr, EXCHANGE_ONLY: tl.constexpr):
    pid = tl.program_id(0)
    groups = tl.num_programs(0) // G
    grp = pid // G
    m = pid % G
    offs = tl.arange(0, CHUNK)
    cols = m * CHUNK + offs
    if EVEN:  # the group's chunks cover the row exactly: no mask
        valid = offs < CHUNK
    else:
        valid = cols < N
    bins = tl.arange(0, 256)
    it = 0
    for row in range(grp, R, groups):
        row64 = row + tl.zeros((), tl.int64)
        at = stamps + (pid * 64 + it) * 8  # (STAMP) start, loaded, rounds' ends, end
        if STAMP:
            tl.store(at, globaltimer())
        src = logits + row64 * s_l_r
        x = tl.load(src + cols, mask=valid, other=0.0)
        if PREFETCH:
            nxt = row + groups
            if nxt < R:
                lines = m * CHUNK + tl.arange(0, CHUNK // 32) * 32
                lines = tl.where(lines < N, lines, 0)
                tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                          [src + groups * s_l_r + lines],
                                          dtype=tl.int32, is_pure=False, pack=1)
        u = _keys(x)
        if STAMP:
            tl.store(at + 1, _stamp_after(tl.max(u, 0).to(tl.int32, bitcast=True)))
        sc = scratch + row64 * SCRATCH
        cnt = sc + 4 * 256
        need = topk
        # ``pa``: the digits chosen so far, in place; a round's keys are those whose bits
        # above its digit equal them (a runtime loop: unrolled, the compiler held every
        # round's shifted keys at once)
        pa = tl.zeros((), tl.uint32)
        done = tl.zeros((), tl.int32)
        rnd = 0
        while (rnd < 4) & (done == 0):
            shift = 24 - 8 * rnd
            hi = (tl.full((), 0xFFFFFFFF, tl.uint32) << (shift + 7)) << 1
            d = ((u >> shift) & 255).to(tl.int32)
            match = valid & ((u & hi) == pa)
            if EXCHANGE_ONLY:  # (timing) a histogram of no key: the rounds' other costs
                h = (bins == 0).to(tl.int32)
            else:
                h = tl.histogram(d, 256, mask=match)
            hp = sc + rnd * 256 + bins
            tl.atomic_add(hp, h, mask=h > 0, sem="relaxed")
            _arrive_and_wait(cnt + rnd, G)
            gh = tl.load(hp, volatile=True)
            total = tl.sum(gh, 0)
            ge = total - tl.cumsum(gh, 0) + gh
            dsel = tl.max(tl.where(ge >= need, bins, -1), 0)
            above = tl.sum(tl.where(bins > dsel, gh, 0), 0)
            inbin = tl.sum(tl.where(bins == dsel, gh, 0), 0)
            need = need - above
            pa = pa | (dsel.to(tl.uint32) << shift)
            if inbin == need:
                done = 1
            if STAMP:
                tl.store(at + 2 + rnd, _stamp_after(need))
            rnd += 1
        # exact (``done``): the keys at or above ``prefix`` are the ``topk``; else ``prefix``
        # is the boundary key, those above it taken and ``need`` of its ties, lowest columns
        # first
        prefix = pa
        if EXCHANGE_ONLY:
            pass
        elif RELOAD:
            # counts from the held keys, then the columns written tile by tile from the
            # chunk read again (from the L2): fewer registers live across the rounds' end
            gt = tl.where(done != 0, u >= prefix, u > prefix) & valid
            n_gt = tl.sum(gt.to(tl.int32), 0)
            before = 0
            n_eq = 0
            if done == 0:
                n_eq = tl.sum((valid & (u == prefix)).to(tl.int32), 0)
                before = _ties_before(sc, cnt, m, n_eq, G)
            n_tie = tl.minimum(tl.maximum(need - before, 0), n_eq)
            base = tl.atomic_add(cnt + 5, n_gt + n_tie, sem="relaxed")
            run = base
            eq_run = before
            for t in range(CHUNK // TILE):
                tc = m * CHUNK + t * TILE + tl.arange(0, TILE)
                tv = tc < N
                ut = _keys(tl.load(src + tc, mask=tv, other=0.0))
                gt_t = tl.where(done != 0, ut >= prefix, ut > prefix) & tv
                eq_t = (tv & (ut == prefix) & (done == 0)).to(tl.int32)
                take = gt_t | ((eq_t != 0) & (eq_run + tl.cumsum(eq_t, 0) - 1 < need))
                st = take.to(tl.int32)
                tl.store(out + row64 * s_o_r + run + tl.cumsum(st, 0) - 1, tc, mask=take)
                run += tl.sum(st, 0)
                eq_run += tl.sum(eq_t, 0)
        else:
            if done != 0:
                sel = valid & (u >= prefix)
            else:
                eq = valid & (u == prefix)
                before = _ties_before(sc, cnt, m, tl.sum(eq.to(tl.int32), 0), G)
                rank = before + tl.cumsum(eq.to(tl.int32), 0) - 1
                sel = (valid & (u > prefix)) | (eq & (rank < need))
            s = sel.to(tl.int32)
            base = tl.atomic_add(cnt + 5, tl.sum(s, 0), sem="relaxed")
            pos = base + tl.cumsum(s, 0) - 1
            tl.store(out + row64 * s_o_r + pos, cols, mask=sel)
        # the last member out zeroes the row's scratch (a graph replays the launch)
        tl.debug_barrier()
        if STAMP:
            tl.store(at + 7, globaltimer())
        it += 1
        if tl.atomic_add(cnt + 6, 1, sem="acq_rel") == G - 1:
            z = tl.arange(0, 2048)
            tl.store(sc + z, tl.zeros((2048,), tl.int32), mask=z < 4 * 256 + 8)


class HeldRadix:
    """The probe's launch for ``x [R, N]`` float32 (full rows, ``N <= G * CHUNK``)."""

    def __init__(self, x: torch.Tensor, out: torch.Tensor, topk: int, G: int, warps: int,
                 maxnreg: int | None, prefetch: bool, reload: bool = False,
                 exchange_only: bool = False, max_per_sm: int = 0):
        R, N = x.shape
        if not 1 <= G <= 64:  # the tied counts' places a row
            raise ValueError(f"G must be in [1, 64], got {G}")
        self.chunk = triton.next_power_of_2(-(-N // G))
        self.scratch = torch.zeros(R, SCRATCH.value, dtype=torch.int32, device=x.device)
        self.stamps = torch.zeros(1, dtype=torch.int64, device=x.device)
        self.args = (x, out, self.scratch, self.stamps, R, N, x.stride(0), out.stride(0), topk)
        self.meta = dict(G=G, CHUNK=self.chunk, PREFETCH=prefetch, RELOAD=reload,
                         TILE=min(2048, self.chunk), EVEN=G * self.chunk == N,
                         STAMP=False, EXCHANGE_ONLY=exchange_only, num_warps=warps,
                         launch_cooperative_grid=True)
        if maxnreg:
            self.meta["maxnreg"] = maxnreg
        k = _held_radix_kernel.warmup(*self.args, grid=(G,), **self.meta)
        k._init_handles()
        self.regs, self.spills = k.n_regs, k.n_spills
        props = torch.cuda.get_device_properties(x.device)
        per_sm = min(65536 // (-(-self.regs // 8) * 8 * 32 * warps), 2048 // (32 * warps))
        if k.metadata.shared:
            per_sm = min(per_sm, props.shared_memory_per_multiprocessor // k.metadata.shared)
        self.per_sm = min(per_sm, max_per_sm) if max_per_sm else per_sm
        self.groups = min(R, props.multi_processor_count * self.per_sm // G)
        self.G = G

    def __call__(self) -> None:
        _held_radix_kernel[(self.groups * self.G,)](*self.args, **self.meta)

    def phases(self) -> dict:
        """One launch stamping ``globaltimer`` (L2 flushed by a read first): per program and
        row taken, the row's start, its chunk loaded, each round's end, its end (ns, from the
        first start); the means by wave."""
        progs = self.groups * self.G
        R = self.args[4]
        if -(-R // self.groups) > 64:  # the stamps' places a program
            raise ValueError(f"phases stamp at most 64 rows a group, got {R} rows over "
                             f"{self.groups} groups")
        stamps = torch.zeros(progs * 64 * 8, dtype=torch.int64, device=self.stamps.device)
        args = list(self.args)
        args[3] = stamps
        torch.ones(256 << 20, dtype=torch.int8, device=stamps.device).sum(dtype=torch.int64)
        _held_radix_kernel[(progs,)](*args, **dict(self.meta, STAMP=True))
        torch.cuda.synchronize()
        st = stamps.view(progs, 64, 8).cpu()
        used = st[:, :, 0] > 0
        t0 = int(st[:, :, 0][used].min())
        waves = []
        for w in range(64):
            rows = st[:, w][used[:, w]]
            if not len(rows):
                break
            rel = (rows - t0).double() / 1e3
            start, loaded, end = rel[:, 0], rel[:, 1], rel[:, 7]
            rounds = []
            prev = loaded
            for r in range(4):
                got = rows[:, 2 + r] > 0
                if not bool(got.any()):
                    break
                rounds.append(float((rel[got, 2 + r] - prev[got]).mean()))
                prev = torch.where(got, rel[:, 2 + r], prev)
            waves.append({"start_us": float(start.mean()),
                          "load_us": float((loaded - start).mean()), "rounds_us": rounds,
                          "write_us": float((end - prev).mean()),
                          "end_us": float(end.max())})
        return {"waves": waves}


def _variant(v: str) -> dict:
    """``G:warps:maxnreg:prefetch[:reload[:exchange_only[:max_per_sm]]]`` -> ``HeldRadix``'s
    keyword arguments (the fields left out 0)."""
    G, warps, nreg, pf, rl, xo, cap = (int(t) for t in (v + ":0:0:0").split(":")[:7])
    return dict(G=G, warps=warps, maxnreg=nreg or None, prefetch=bool(pf), reload=bool(rl),
                exchange_only=bool(xo), max_per_sm=cap)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.topk_held_radix",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, nargs="*", default=[1, 32, 128, 256, 512, 1024])
    p.add_argument("--keys", type=int, default=131072)
    p.add_argument("--phases", type=int, nargs="*", default=[128, 512],
                   help="rows at which each variant also runs once stamping its phases")
    p.add_argument("--variants", nargs="*", default=["8:8:128:1:1", "8:8:128:1:0", "16:8:128:1:1"],
                   help="G:warps:maxnreg:prefetch[:reload[:exchange_only[:max_per_sm]]] ...")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    copy = ceilings()["copy_TBps"]
    log(f"copy {copy:.2f} TB/s")
    rows = []
    for R in args.rows:
        W = args.keys
        torch.manual_seed(R + W)
        x = torch.randn(R, W, device="cuda")
        st, en = _full(R, W)
        want = as_sets(torch.topk(x, TOPK, dim=1).indices.int())
        runs = [replayed(x, st, en, TopkPlan(), reps=20) for _ in range(3)]
        ms = statistics.median(r[0] for r in runs)
        rows.append({"R": R, "L": W, "variant": "mla.fast auto", "us": ms * 1e3,
                     "pct_copy": _pct(R, W, ms, copy),
                     "same_set": bool(torch.equal(as_sets(runs[-1][2]), want))})
        log(str(rows[-1]))
        for v in args.variants:
            out = torch.full((R, TOPK), -7, dtype=torch.int32, device="cuda")
            try:
                probe = HeldRadix(x, out, TOPK, **_variant(v))
                g = capture(probe)
                times = [time_replays(g, reps=20, read_flush=True) for _ in range(3)]
                out.fill_(-7)
                g.replay()
                torch.cuda.synchronize()
                ms = statistics.median(times)
                rows.append({"R": R, "L": W, "variant": v, "us": ms * 1e3,
                             "pct_copy": _pct(R, W, ms, copy),
                             "same_set": bool(torch.equal(as_sets(out), want)),
                             "regs": probe.regs, "spills": probe.spills,
                             "programs_per_sm": probe.per_sm, "groups": probe.groups})
                if R in args.phases:
                    rows[-1]["phases"] = probe.phases()
            except Exception as e:  # noqa: BLE001 - a variant that fails is recorded
                rows.append({"R": R, "L": W, "variant": v, "error": repr(e)[:400]})
            log(str(rows[-1]))
            _write(args.out, {"copy_TBps": copy, "rows": rows, "partial": True})
    # adversarial sets at one shape: ties at the boundary, signed zeros and NaN
    checks = []
    R, W = 64, args.keys
    for name in ("ties", "zeros_nan"):
        torch.manual_seed(7)
        if name == "ties":
            x = torch.randint(0, 40, (R, W), device="cuda").float()
        else:
            x = torch.randn(R, W, device="cuda")
            x[:, ::97] = 0.0
            x[:, 1::97] = -0.0
            x[:, 5::40001] = float("nan")
        st, en = _full(R, W)
        want = as_sets(top_k_per_row(x.double().cpu(), st.cpu(), en.cpu(), TOPK))
        for v in args.variants:
            if _variant(v)["exchange_only"]:  # selects nothing
                continue
            out = torch.full((R, TOPK), -7, dtype=torch.int32, device="cuda")
            probe = HeldRadix(x, out, TOPK, **_variant(v))
            probe()
            probe()  # twice: the scratch zeroed by the first
            torch.cuda.synchronize()
            checks.append({"set": name, "variant": v,
                           "same_set": bool(torch.equal(as_sets(out), want))})
            log(str(checks[-1]))
    res = {"what": __doc__.split("\n")[0], "environment": environment(), "copy_TBps": copy,
           "k": TOPK, "rows": rows, "checks": checks}
    _write(args.out, res)
    return 0


def _write(out: str, res: dict) -> None:
    with open(os.path.join(out, "topk_held_radix.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
