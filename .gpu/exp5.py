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
    plans = {"one": TopkPlan(), "three": TopkPlan(route="three"),
             "two16k": TopkPlan(route="two"), "two8k": TopkPlan(route="two", two_chunk=8192),
             "two32k": TopkPlan(route="two", two_chunk=32768), "two64k": TopkPlan(route="two", two_chunk=65536),
             "two16k_w4": TopkPlan(route="two", fused_warps=4), "two16k_nopdl": TopkPlan(route="two", pdl=False)}
    shapes = [(128, 131072), (256, 131072), (1024, 131072), (512, 131072), (32, 131072), (1, 131072),
              (128, 32768), (256, 32768), (2048, 32768)]
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
    json.dump({"environment": environment(), "ceilings": ceil, "rows": rows}, open(os.path.join(outdir, "exp5.json"), "w"), indent=1)

main()
