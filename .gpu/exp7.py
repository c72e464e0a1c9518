import json, os, sys, functools, statistics, time
import torch
from benchmarks.common import ceilings, log
from benchmarks.topk_sweep import _full, _pct, _run, TOPK
from mla.fast.topk import TopkPlan, launches, survivors
from mla.environment import environment

def graph_time(x, st, en, plan, reps=20):
    out = torch.empty(x.shape[0], TOPK, dtype=torch.int32, device="cuda")
    work, steps = launches(x, st, en, out, TOPK, plan)
    fn = functools.partial(_run, steps)
    flush = torch.ones(256 << 20, dtype=torch.int8, device="cuda")
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps + 5):
        flush.sum(dtype=torch.int64)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b))
    out.fill_(-7)
    g.replay(); torch.cuda.synchronize()
    return statistics.median(times[5:]), out, work

def main():
    outdir = sys.argv[1]
    ceil = ceilings(); copy = ceil["copy_TBps"]
    log(f"copy {copy:.2f}")
    w4 = dict(route="two", fused_warps=4)
    plans = {"one": TopkPlan(route="one"), "two_w4": TopkPlan(**w4),
             "w4_c64k": TopkPlan(**w4, two_chunk=65536), "w4_c128k": TopkPlan(**w4, two_chunk=131072),
             "w4_c16k": TopkPlan(**w4, two_chunk=16384), "w4_s4": TopkPlan(**w4, fused_stages=4),
             "w4_s2": TopkPlan(**w4, fused_stages=2), "w4_b2048": TopkPlan(**w4, fused_block=2048),
             "w4_r96": TopkPlan(**w4, select_maxnreg=96), "w4_r168": TopkPlan(**w4, select_maxnreg=168),
             "w2": TopkPlan(route="two", fused_warps=2), "w4_est4": TopkPlan(**w4, estimate_warps=4)}
    shapes = [(1024, 131072), (512, 131072), (2048, 32768)]
    rows = []
    for R, W in shapes:
        torch.manual_seed(R + W)
        x = torch.randn(R, W, device="cuda")
        st, en = _full(R, W)
        want = torch.topk(x, TOPK, dim=1).indices.sort(dim=1).values
        names = list(plans)
        for name in names:
            ms = [graph_time(x, st, en, plans[name]) for _ in range(3)]
            t = statistics.median(m[0] for m in ms)
            out, work = ms[-1][1], ms[-1][2]
            same = bool(torch.equal(out.sort(dim=1).values, want))
            surv = survivors(work).float()
            r = {"R": R, "L": W, "plan": name, "us": t * 1e3, "pct_copy": _pct(R, W, t, copy),
                 "same_set_after_replay": same, "survivors_mean": float(surv.mean()), "survivors_max": float(surv.max())}
            rows.append(r)
            log(json.dumps(r))
        del x
        torch.cuda.empty_cache()
    json.dump({"environment": environment(), "ceilings": ceil, "rows": rows}, open(os.path.join(outdir, "exp7.json"), "w"), indent=1)

main()
