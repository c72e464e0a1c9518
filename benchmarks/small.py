"""``python -m benchmarks.small``: the memory-bound helper kernels against the copy ceiling.

Each kernel moves bytes and does almost no arithmetic, so the one number that matters is the
achieved bandwidth (bytes read + written per second) as a fraction of a device-to-device copy
measured in the same run (``benchmarks.common.ceilings``):

    concat_and_cache_mla          T rows of kv_c ‖ k_pe (bf16, 576) scattered into a paged cache
    concat_and_cache_fp8_ds_mla   the same rows quantized into 656-byte fp8_ds_mla rows
    gather_cache_known            rows of ragged requests gathered by block table (no host sync)
    convert_req_index_to_global_index   int32 [T, 2048] request-local indices -> global slots

Every timed output is first compared with the reference on the same inputs (bitwise for the
cache writes, the gathers and the index conversion). Random data, page size 64, slots and pages
in random order. Writes ``small_<date>.json`` and ``.md`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton.testing

from benchmarks.common import ceilings, log, report_heading
from mla import reference as ref
from mla.check.runner import environment
from mla.fast.fp8 import concat_and_cache_fp8_ds_mla
from mla.fast.paged_cache import concat_and_cache_mla, gather_cache_known
from mla.fast.sparse import convert_req_index_to_global_index
from mla.reference.fp8 import concat_and_cache_fp8_ds_mla as ref_concat_fp8

BS, LKV, R = 64, 512, 64
D = LKV + R


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_concat(T: int, fp8: bool, gen: torch.Generator) -> dict:
    num_blocks = 4 * T // BS
    kv_c = torch.randn(T, LKV, generator=gen).to("cuda", torch.bfloat16)
    k_pe = torch.randn(T, R, generator=gen).to("cuda", torch.bfloat16)
    slots = torch.randperm(num_blocks * BS, generator=gen)[:T].to("cuda")
    if fp8:
        cache = torch.zeros(num_blocks, BS, 656, dtype=torch.uint8, device="cuda")
        fast, refn, row_bytes = concat_and_cache_fp8_ds_mla, ref_concat_fp8, 656
    else:
        cache = torch.zeros(num_blocks, BS, D, dtype=torch.bfloat16, device="cuda")
        fast, refn, row_bytes = concat_and_cache_mla, ref.concat_and_cache_mla, 2 * D
    expect = cache.clone()
    refn(kv_c, k_pe, expect, slots)
    fast(kv_c, k_pe, cache, slots, validate=False)
    exact = bool(torch.equal(cache, expect))
    ms = _ms(lambda: fast(kv_c, k_pe, cache, slots, validate=False))
    nbytes = T * (2 * D + row_bytes + 8)  # rows read, rows written, slot ids
    name = "concat_and_cache_fp8_ds_mla" if fp8 else "concat_and_cache_mla"
    return {"kernel": name, "shape": f"T={T} page={BS}", "ms": ms, "bytes": nbytes,
            "exact": exact}


def bench_gather(lens: list[int], gen: torch.Generator) -> dict:
    table, num_blocks = ref.make_block_table(lens, BS, seed=int(torch.randint(1 << 30, (1,),
                                                                            generator=gen)))
    cache = torch.randn(num_blocks, BS, D, generator=gen).to("cuda", torch.bfloat16)
    table = table.to("cuda")
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    total = int(cu[-1])
    dst = torch.empty(total, D, dtype=torch.bfloat16, device="cuda")
    expect = ref.gather_cache(cache, torch.empty_like(dst), table, cu.cuda(), len(lens))
    cu_d = cu.cuda()

    def fn() -> torch.Tensor:
        return gather_cache_known(cache, dst, table, cu_d, len(lens), None, total, max(lens))

    exact = bool(torch.equal(fn(), expect))
    ms = _ms(fn)
    return {"kernel": "gather_cache_known", "shape": f"{len(lens)} requests, {total} rows",
            "ms": ms, "bytes": total * 2 * D * 2, "exact": exact}


def bench_convert(T: int, topk: int, gen: torch.Generator) -> dict:
    B, max_blocks = 64, 2048
    table = torch.randint(0, 1 << 20, (B, max_blocks), generator=gen, dtype=torch.int32)
    req = torch.randint(0, B, (T,), generator=gen, dtype=torch.int32)
    idx = torch.randint(-1, max_blocks * BS, (T, topk), generator=gen, dtype=torch.int32)
    table, req, idx = table.cuda(), req.cuda(), idx.cuda()
    expect = ref.convert_req_index_to_global_index(req, table, idx, BS)

    def fn() -> torch.Tensor:
        return convert_req_index_to_global_index(req, table, idx, BS, validate=False)

    exact = bool(torch.equal(fn(), expect))
    ms = _ms(fn)
    # indices read and slots written; block-table reads mostly hit in L2 and are not counted
    return {"kernel": "convert_req_index_to_global_index", "shape": f"T={T} topk={topk}",
            "ms": ms, "bytes": T * topk * 8, "exact": exact}


def markdown(res: dict) -> str:
    lines = report_heading("Small kernels", res) + [
             "| kernel | shape | µs | TB/s | % copy | output equals reference |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in res["results"]:
        lines.append(f"| {r['kernel']} | {r['shape']} | {1e3 * r['ms']:.1f} | "
                     f"{r['TBps']:.2f} | {100 * r['frac_copy']:.0f}% | "
                     f"{'bitwise' if r['exact'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.small", description=__doc__.split(
        "\n")[0])
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results", "small"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(args.seed)
    log("ceilings ...")
    ceil = ceilings()
    results = []
    jobs = [("concat bf16", lambda: bench_concat(65536, False, gen)),
            ("concat fp8", lambda: bench_concat(65536, True, gen)),
            ("gather", lambda: bench_gather([16384, 1, 40000, 777, 65536], gen)),
            ("convert", lambda: bench_convert(4096, 2048, gen))]
    for label, job in jobs:
        log(f"{label} ...")
        r = job()
        r["TBps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e12
        r["frac_copy"] = r["TBps"] / ceil["copy_TBps"]
        log(f"  {r['kernel']} {r['shape']}: {1e3 * r['ms']:.1f} us, {r['TBps']:.2f} TB/s "
            f"({100 * r['frac_copy']:.0f}% of copy), exact={r['exact']}")
        results.append(r)
    res = {"environment": environment(), "ceilings": ceil, "results": results}
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"small_{time.strftime('%Y-%m-%d')}")
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(markdown(res))
    print(markdown(res))
    return 0 if all(r["exact"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
