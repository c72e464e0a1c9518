"""``python -m benchmarks.prefill_routes``: the routes to attention with LSE for the prefill, and
the merge's bandwidth, measured against the machine's ceilings in the same run.

1. Ceilings: a device-to-device copy of the merge's size (bytes read + written) and an 8192³
   bf16 matmul, medians of ``triton.testing.do_bench``.
2. ``mla.fast.merge_attn_states`` at T=16384, N=128, D=512 bf16 (target: at least 75% of the
   copy bandwidth), the default launch and a few others. Bytes = 2 inputs read + 1 output written
   (+ the lse), each once.
3. Prefill attention, causal, QK 192 / V 128, bf16, (B, S, H) = (1, 4096, 128) and (1, 16384, 16):
   cuDNN (``_scaled_dot_product_cudnn_attention`` with its LSE), our Triton kernel (a few tile
   configs), the Flash backend with V zero-padded to 192 (``_scaled_dot_product_flash_attention``,
   the padding timed with it), the memory-efficient backend, FlexAttention (``return_lse``,
   compiled, causal block mask). FLOPs = ``H · S(S+1)/2 · 2 · (192 + 128)``. Every route's output
   and LSE are compared with cuDNN's, and cuDNN's with the float64 reference on two heads.
4. Ragged batches (the chunked prefill's shapes): one Triton launch against one cuDNN call per
   request, for the causal suffix and for a non-causal context chunk.

Writes ``prefill_routes.json`` and ``prefill_routes.md`` into ``--out-dir``; progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch
import triton
import triton.testing

from benchmarks.common import log
from mla.check.runner import environment
from mla.compare import max_abs_err, rel_err
from mla.fast import merge as fast_merge
from mla.fast.attention import AttnConfig, cudnn_attention_with_lse, flash_attention_with_lse
from mla.fast.chunked import _ragged_attention
from mla.reference.attention import attention_with_lse as ref_attention
from mla.reference.merge import merge_attn_states as ref_merge

DQK, DNOPE, DV = 192, 128, 128
SCALE = DQK ** -0.5
OURS_CONFIGS = [AttnConfig(128, 64, 8, 3), AttnConfig(128, 128, 8, 2), AttnConfig(128, 64, 8, 2)]
MERGE_CONFIGS = [(8, 512, 4), (4, 512, 4), (16, 512, 8), (2, 512, 4), (16, 256, 4), (32, 128, 8)]


def bench(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _copy_ms(n_elems: int) -> float:
    x = torch.randn(n_elems, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return bench(lambda: y.copy_(x))


def ceilings(n_elems: int) -> dict[str, float]:
    copy_gbs = 2 * n_elems * 2 / _copy_ms(n_elems) / 1e6
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = bench(lambda: a @ b)
    return {"copy_GBps": copy_gbs, "copy_bytes": 4 * n_elems,
            "matmul_TFLOPs": 2 * 8192 ** 3 / mm_ms / 1e9}


def merge_bench(T: int, N: int, D: int, copy_gbs: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    o_p = torch.randn(T, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    o_s = torch.randn(T, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    lse_p = torch.randn(N, T, device="cuda", generator=g) * 3
    lse_s = torch.randn(N, T, device="cuda", generator=g) * 3
    lse_p[:, ::97] = float("inf")  # a few empty sides, as a real chunk plan has
    lse_s[:, 5::89] = float("-inf")
    nbytes = 3 * T * N * D * 2 + 3 * N * T * 4
    out, out_lse = fast_merge.merge_attn_states(o_p, lse_p, o_s, lse_s)
    sl = slice(0, 64)
    r_o, r_l = ref_merge(o_p[sl].double(), lse_p[:, sl].double(), o_s[sl].double(),
                         lse_s[:, sl].double())
    res = {"shape": [T, N, D], "bytes": nbytes, "default": fast_merge._config(D, 2),
           "out_rel_first64": rel_err(out[sl], r_o),
           "lse_abs_first64": max_abs_err(out_lse[:, sl], r_l), "configs": []}
    for block_r, block_d, warps in MERGE_CONFIGS:
        def fn(block_r=block_r, block_d=block_d, warps=warps):
            return fast_merge._launch(o_p, lse_p, o_s, lse_s, block_r, block_d, warps)
        o2, _ = fn()
        same = torch.equal(o2, out)
        ms = bench(fn)
        gbs = nbytes / ms / 1e6
        res["configs"].append({"block_r": block_r, "block_d": block_d, "num_warps": warps,
                               "ms": ms, "GBps": gbs, "frac_copy": gbs / copy_gbs,
                               "same_as_default": same})
        log(f"merge r={block_r} d={block_d} w={warps}: {ms:.3f} ms {gbs:.0f} GB/s "
            f"({gbs / copy_gbs:.0%} of copy) same={same}")
    ms = bench(lambda: fast_merge.merge_attn_states(o_p, lse_p, o_s, lse_s))
    res["default_ms"] = ms
    res["default_GBps"] = nbytes / ms / 1e6
    res["default_frac_copy"] = res["default_GBps"] / copy_gbs
    return res


def _flex_fn(S: int, H: int) -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, None, S, S, device="cuda")

    def run(q, k, v):
        o, lse = compiled(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                          v.transpose(0, 1)[None], block_mask=mask, scale=SCALE,
                          return_lse=True)
        return o[0].transpose(0, 1), lse[0]
    return run


def _flash_padded(q, k, v):
    vp = torch.nn.functional.pad(v, (0, DQK - DV))
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], vp.transpose(0, 1)[None], 0.0, True,
        False, scale=SCALE)
    return res[0][0, :, :, :DV].transpose(0, 1), res[1][0]


def _efficient(q, k, v):
    res = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, True,
        0.0, True, scale=SCALE)
    S = q.shape[0]
    return res[0][0].transpose(0, 1), res[1][0, :, :S]


def prefill_bench(S: int, H: int, mm_tflops: float, flex_deadline: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(S + H)
    q = torch.randn(S, H, DQK, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(S, H, DQK, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(S, H, DV, device="cuda", dtype=torch.bfloat16, generator=g)
    flops = H * S * (S + 1) / 2 * 2 * (DQK + DV)
    cu = torch.tensor([0, S], dtype=torch.int32, device="cuda")
    o_c, lse_c = cudnn_attention_with_lse(q, k, v, SCALE, True)
    r_o, r_l = ref_attention(q[:, :2].double(), k[:, :2].double(), v[:, :2].double(), SCALE,
                             True)
    res = {"S": S, "H": H, "flops": flops,
           "cudnn_vs_reference_2heads": {"out_rel": rel_err(o_c[:, :2], r_o),
                                         "lse_abs": max_abs_err(lse_c[:2], r_l)},
           "routes": []}
    routes: list[tuple[str, Callable]] = [("cudnn", lambda: cudnn_attention_with_lse(
        q, k, v, SCALE, True))]
    for cfg in OURS_CONFIGS:
        routes.append((f"triton (ours) m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} "
                       f"s{cfg.num_stages}",
                       lambda cfg=cfg: flash_attention_with_lse(
                           q[..., :DNOPE], q[..., DNOPE:], k[..., :DNOPE], k[..., DNOPE:], v,
                           cu, cu, S, SCALE, True, config=cfg)))
    routes.append(("flash, V padded to 192", lambda: _flash_padded(q, k, v)))
    routes.append(("mem-efficient", lambda: _efficient(q, k, v)))
    routes.append(("flex (compiled)", None))
    for name, fn in routes:
        entry: dict = {"route": name}
        try:
            if fn is None:
                if time.time() > flex_deadline:
                    raise RuntimeError("skipped: out of this run's time for compiling Flex")
                t0 = time.time()
                flex = _flex_fn(S, H)
                fn = lambda flex=flex: flex(q, k, v)  # noqa: E731
                fn()
                entry["compile_s"] = time.time() - t0
            o, lse = fn()
            entry["out_rel_vs_cudnn"] = rel_err(o, o_c)
            entry["lse_abs_vs_cudnn"] = max_abs_err(lse.reshape(lse_c.shape), lse_c)
            ms = bench(fn)
            entry.update(ms=ms, TFLOPs=flops / ms / 1e9, frac_matmul=flops / ms / 1e9 / mm_tflops)
            log(f"S={S} H={H} {name}: {ms:.3f} ms {entry['TFLOPs']:.0f} TFLOP/s (err vs cuDNN "
                f"{entry['out_rel_vs_cudnn']:.1e}, lse {entry['lse_abs_vs_cudnn']:.1e})")
        except Exception as e:  # a route that does not run here is a result, not a stop
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"S={S} H={H} {name}: {entry['error']}")
        res["routes"].append(entry)
    base = next(r for r in res["routes"] if r["route"] == "cudnn").get("TFLOPs")
    for r in res["routes"]:
        if base and "TFLOPs" in r:
            r["frac_cudnn"] = r["TFLOPs"] / base
    return res


def ragged_bench(N: int, q_lens: list[int], k_lens: list[int], causal: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(N)
    Tq, Tk = sum(q_lens), sum(k_lens)
    q_nope = torch.randn(Tq, N, DNOPE, device="cuda", dtype=torch.bfloat16, generator=g)
    q_pe = torch.randn(Tq, N, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k_nope = torch.randn(Tk, N, DNOPE, device="cuda", dtype=torch.bfloat16, generator=g)
    k_pe = torch.randn(Tk, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(Tk, N, DV, device="cuda", dtype=torch.bfloat16, generator=g)
    qsl = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    ksl = [0] + torch.tensor(k_lens).cumsum(0).tolist()
    qd = torch.tensor(qsl, dtype=torch.int32, device="cuda")
    kd = torch.tensor(ksl, dtype=torch.int32, device="cuda")
    pairs = zip(q_lens, k_lens)
    flops = sum(N * 2 * (DQK + DV) * (q * k - (q * (q - 1) // 2 if causal else 0))
                for q, k in pairs)
    res = {"N": N, "q_lens": q_lens, "k_lens": k_lens, "causal": causal, "flops": flops}
    outs = {}
    for route in ("triton", "cudnn"):
        fn = lambda route=route: _ragged_attention(  # noqa: E731
            route, q_nope, q_pe, k_nope, k_pe, v, qsl, ksl, qd, kd, SCALE, causal)
        outs[route] = fn()
        ms = bench(fn)
        res[route] = {"ms": ms, "TFLOPs": flops / ms / 1e9}
        log(f"ragged N={N} causal={causal} {route}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
    res["out_rel_triton_vs_cudnn"] = rel_err(outs["triton"][0], outs["cudnn"][0])
    res["lse_abs_triton_vs_cudnn"] = max_abs_err(outs["triton"][1], outs["cudnn"][1])
    return res


def markdown(r: dict) -> str:
    env, c = r["environment"], r["ceilings"]
    lines = [f"# Prefill routes and merge bandwidth ({env.get('gpu', '?')}, {env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}, CUDA {env.get('cuda', '?')}. "
             "Medians of `triton.testing.do_bench`; bf16, random inputs.", "",
             f"Ceilings, same run: copy {c['copy_GBps']:.0f} GB/s (read + write), "
             f"bf16 matmul 8192³ {c['matmul_TFLOPs']:.0f} TFLOP/s.", "",
             "## merge_attn_states, T=16384 N=128 D=512 (target: 75% of copy)", "",
             "| BLOCK_R | BLOCK_D | warps | ms | GB/s | of copy |", "|---|---|---|---|---|---|"]
    m = r["merge"]
    for x in m["configs"]:
        lines.append(f"| {x['block_r']} | {x['block_d']} | {x['num_warps']} | {x['ms']:.3f} | "
                     f"{x['GBps']:.0f} | {x['frac_copy']:.0%} |")
    lines += ["", f"Default launch {tuple(m['default'])}: {m['default_GBps']:.0f} GB/s, "
              f"{m['default_frac_copy']:.0%} of copy.", ""]
    for p in r["prefill"]:
        lines += [f"## Prefill attention with LSE, causal QK 192 / V 128, (1, {p['S']}, {p['H']})",
                  "", "| route | ms | TFLOP/s | of cuDNN | of matmul | out err vs cuDNN | "
                  "lse err |", "|---|---|---|---|---|---|---|"]
        for x in p["routes"]:
            if "error" in x:
                lines.append(f"| {x['route']} | - | - | - | - | {x['error'][:80]} | |")
                continue
            lines.append(f"| {x['route']} | {x['ms']:.3f} | {x['TFLOPs']:.0f} | "
                         f"{x.get('frac_cudnn', 0):.0%} | {x['frac_matmul']:.0%} | "
                         f"{x['out_rel_vs_cudnn']:.1e} | {x['lse_abs_vs_cudnn']:.1e} |")
        cr = p["cudnn_vs_reference_2heads"]
        lines += ["", f"cuDNN against the float64 reference (2 heads): out {cr['out_rel']:.1e}, "
                  f"lse {cr['lse_abs']:.1e}.", ""]
    lines += ["## Ragged batches: one Triton launch vs one cuDNN call per request", "",
              "| N | q lens | k lens | causal | Triton ms (TFLOP/s) | cuDNN loop ms (TFLOP/s) |",
              "|---|---|---|---|---|---|"]
    for x in r["ragged"]:
        lines.append(f"| {x['N']} | {x['q_lens']} | {x['k_lens']} | {x['causal']} | "
                     f"{x['triton']['ms']:.3f} ({x['triton']['TFLOPs']:.0f}) | "
                     f"{x['cudnn']['ms']:.3f} ({x['cudnn']['TFLOPs']:.0f}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefill_routes")
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--flex-budget-s", type=float, default=75.0,
                   help="stop compiling FlexAttention this many seconds after the start")
    args = p.parse_args(argv)
    t_start = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    T, N, D = 16384, 128, 512
    log("ceilings")
    r: dict = {"environment": environment(), "ceilings": ceilings(T * N * D)}
    log(f"copy {r['ceilings']['copy_GBps']:.0f} GB/s, matmul {r['ceilings']['matmul_TFLOPs']:.0f}"
        " TFLOP/s")
    r["merge"] = merge_bench(T, N, D, r["ceilings"]["copy_GBps"])
    torch.cuda.empty_cache()
    deadline = t_start + args.flex_budget_s
    r["prefill"] = [prefill_bench(S, H, r["ceilings"]["matmul_TFLOPs"], deadline)
                    for S, H in ((4096, 128), (16384, 16))]
    ragged = [(16, [3000, 17, 1500, 1, 700, 4096, 250, 2048], None, True),
              (128, [3000, 17, 1500, 1, 700, 4096, 250, 2048], None, True),
              (16, [17, 300, 1, 64, 512, 2000], [4096, 4096, 1, 4096, 4096, 4096], False),
              (128, [17, 300, 1, 64, 512, 2000], [4096, 4096, 1, 4096, 4096, 4096], False)]
    r["ragged"] = [ragged_bench(n, ql, kl or ql, causal) for n, ql, kl, causal in ragged]
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "prefill_routes.json"), "w") as f:
        json.dump(r, f, indent=1)
    md = markdown(r)
    with open(os.path.join(args.out_dir, "prefill_routes.md"), "w") as f:
        f.write(md)
    print(md)
    log(f"done in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
