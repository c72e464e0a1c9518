"""The ``mla`` command line.

    mla walkthrough   every path on an embedded example, checked against the definition
    mla config        a preset's shapes, derived sizes and DeepSeek-V2's Table 1 comparison
    mla plan          the chunked-prefill chunk plan for some context lengths
    mla conform       the conformance catalogue on a kernel target (exit statuses: its doc)
    mla bench         a kernel target timed on named DeepSeek shapes (mla.bench; its doc)

``main(argv)`` returns the exit status, so tests can call it directly. Exit statuses:

    0  done; for ``walkthrough``: every row that ran is within its tolerance (conventions §11)
    1  ``walkthrough``: a row is over its tolerance
    2  bad arguments (one line from argparse)
    3  ``walkthrough``: the device asked for is not available here (one line on stderr)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence

from mla.cli.bench import add_bench_parser
from mla.cli.conform import add_conform_parser
from mla.config import PRESETS, get_config, kv_cache_comparison

__all__ = ["main", "build_parser"]


def _add_walkthrough(sub: argparse._SubParsersAction) -> None:
    from mla.cli.walkthrough import DEFAULT_CONTEXT_LENS, DTYPES

    p = sub.add_parser(
        "walkthrough", help="run every MLA path on an embedded example and check it",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run every path (definition, prefill, chunked prefill, paged decode, DCP)\n"
                    "on random weights and print each one's error against the float64\n"
                    "definition; then the reference's kernel-level functions and mla.fast's\n"
                    "kernels on the same latents against the dense absorbed attention.",
        epilog="mla.fast rows: on a CUDA device in --dtype (bfloat16, float16 or float32);\n"
               "on the CPU in float32 under Triton's interpreter (this command sets\n"
               "TRITON_INTERPRET=1 unless it is set), on the requests with the shortest and\n"
               "the longest context. A row that cannot run says why instead of passing.\n\n"
               "exit status: 0 every row that ran is within its tolerance, 1 a row is over\n"
               "it, 2 bad arguments, 3 the device is not available.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="deepseek-v2-lite")
    p.add_argument("--dtype", choices=list(DTYPES), default="float64",
                   help="dtype of the paths (the reference is always float64 on the CPU)")
    p.add_argument("--device", default="cpu", help="device of the paths, e.g. cpu or cuda")
    p.add_argument("--context-lens", type=int, nargs="+", default=list(DEFAULT_CONTEXT_LENS),
                   metavar="N", help="cached context length of each request")
    p.add_argument("--new-tokens", type=int, default=3,
                   help="new tokens per request (>= 2, for the s_q=2 decode)")
    p.add_argument("--block-size", type=int, default=64, help="paged cache block size")
    p.add_argument("--max-context-chunk", type=int, default=16,
                   help="MCC of the chunked prefill: small, so there are several chunks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    p.add_argument("--no-fast", dest="fast", action="store_false",
                   help="skip the mla.fast rows (on the CPU, Triton's interpreter is slow)")
    p.set_defaults(run=_walkthrough, parser=p)


def _walkthrough(args: argparse.Namespace) -> int:
    import torch

    from mla.cli.walkthrough import DeviceUnavailableError, format_table, run_walkthrough

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        on_cpu = torch.device(args.device).type == "cpu"
    except RuntimeError:
        on_cpu = False  # run_walkthrough rejects the name
    if args.fast and on_cpu:
        # the interpreter is chosen when triton is imported, which mla.fast does at its first
        # row: set it before. An explicit TRITON_INTERPRET=0 is kept (the rows then say why).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    t0 = time.perf_counter()
    try:
        rows = run_walkthrough(args.preset, args.dtype, args.device, args.context_lens,
                               args.new_tokens, args.block_size, args.max_context_chunk,
                               args.seed, progress=progress, fast=args.fast)
    except DeviceUnavailableError as e:
        print(f"mla walkthrough: {e}", file=sys.stderr)
        return 3
    except (ValueError, TypeError) as e:
        args.parser.error(str(e))
    total = time.perf_counter() - t0
    print(f"mla walkthrough: preset {args.preset}, {args.dtype} on {args.device}, "
          f"context lens {args.context_lens}, {args.new_tokens} new tokens, "
          f"block size {args.block_size}, MCC {args.max_context_chunk}, seed {args.seed}")
    print("reference: float64 on the CPU, same inputs upcast")
    print("limit: on the relative Frobenius (rel) or max absolute (abs) error; the dtype's "
          "tolerance, for mla.fast the kernel's error budget (conventions §11)")
    print()
    print(format_table(rows))
    print()
    ran = [r for r in rows if r.skipped is None]
    failed = [r for r in ran if r.failed]
    if on_cpu and any(r.path.startswith("fast ") for r in ran):
        from mla.cli.kernel_rows import interpreter_requests

        ctx = [args.context_lens[i] for i in interpreter_requests(args.context_lens)]
        print(f"fast rows: Triton's interpreter on the CPU, float32, the requests with "
              f"context {' and '.join(map(str, ctx))}")
    skipped = f"; {len(rows) - len(ran)} skipped" if len(ran) < len(rows) else ""
    if failed:
        print(f"{len(failed)} of {len(ran)} rows exceed their tolerance{skipped}: "
              + ", ".join(r.path for r in failed))
    else:
        print(f"all {len(ran)} rows within their tolerance{skipped}  ({total:.1f} s)")
    if args.json:
        doc = {"preset": args.preset, "dtype": args.dtype, "device": args.device,
               "context_lens": args.context_lens, "new_tokens": args.new_tokens,
               "block_size": args.block_size, "max_context_chunk": args.max_context_chunk,
               "seed": args.seed, "fast": args.fast,
               "rows": [{k: _json_number(v) for k, v in r.to_dict().items()} for r in rows]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2, allow_nan=False)
            f.write("\n")
    return 1 if failed else 0


def _json_number(v: object) -> object:
    # a NaN result has an infinite error; JSON has no inf, so it is written as "inf"
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


def _add_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print a preset, its derived sizes and Table 1",
                       description="Print a preset's fields, the sizes derived from them and "
                                   "DeepSeek-V2's Table 1 (KV cache per token) for it.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="deepseek-v2-lite")
    p.add_argument("--num-groups", type=int, default=8, help="GQA groups for Table 1")
    p.add_argument("--tokens", type=int, default=128 * 1024,
                   help="context length for the cache-size line")
    p.set_defaults(run=_config, parser=p)


def _config(args: argparse.Namespace) -> int:
    c = get_config(args.preset)
    if args.num_groups <= 0 or args.tokens <= 0:
        args.parser.error(f"--num-groups and --tokens must be positive, got "
                          f"{args.num_groups} and {args.tokens}")
    print(f"preset {c.name}")
    width = max(len(f.name) for f in dataclasses.fields(c))
    for f in dataclasses.fields(c):
        print(f"  {f.name:<{width}}  {getattr(c, f.name)}")
    gib = c.cache_bytes_per_token() * args.tokens / 2**30
    print("derived")
    derived = [
        ("qk head dim P + R", c.qk_head_dim),
        ("cached numbers per token per layer Lkv + R", c.cache_numbers_per_token_per_layer()),
        ("cache bytes per token per layer (bf16)", c.cache_bytes_per_token_per_layer()),
        ("cache bytes per token, all layers (bf16)", c.cache_bytes_per_token()),
        (f"cache for {args.tokens} tokens, all layers (bf16)", f"{gib:.2f} GiB"),
        ("YaRN active", c.yarn_active),
        ("mscale", f"{c.mscale:.6f}"),
        ("softmax scale 1/sqrt(P+R) * mscale^2", f"{c.softmax_scale:.6f}"),
    ]
    width = max(len(k) for k, _ in derived)
    for k, v in derived:
        print(f"  {k:<{width}}  {v}")
    print(f"DeepSeek-V2 Table 1: KV cache numbers per token, all {c.num_layers} layers "
          f"(d_h = {c.qk_nope_head_dim}, n_g = {args.num_groups})")
    table = kv_cache_comparison(c, num_groups=args.num_groups)
    print(f"  {'attention':<9}  {'formula':<15}  {'per token':>10}  {'x d_h*l':>7}")
    for r in table:
        print(f"  {r['attention']:<9}  {r['formula']:<15}  {r['numbers_per_token']:>10}  "
              f"{r['in_units_of_d_h_l']:>7.2f}")
    return 0


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="print a chunked-prefill chunk plan",
        description="Print the chunk plan of chunked prefill (conventions §7). Without "
                    "--max-context-chunk, MCC comes from the workspace as vLLM's MLA backend "
                    "derives it.")
    p.add_argument("--context-lens", type=int, nargs="+", metavar="N",
                   default=[0, 1000, 17000, 40000, 70000])
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-context-chunk", type=int, help="MCC; overrides the workspace")
    p.add_argument("--workspace-size", type=int,
                   help="workspace tokens (default: vLLM's formula)")
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="for vLLM's workspace formula")
    p.set_defaults(run=_plan, parser=p)


def _plan(args: argparse.Namespace) -> int:
    from mla.reference import plan_context_chunks, workspace_size

    try:
        if args.max_context_chunk is not None:
            plan = plan_context_chunks(args.context_lens, max_context_chunk=args.max_context_chunk)
            print(f"MCC {args.max_context_chunk} given")
        else:
            ws = args.workspace_size
            if ws is None:
                if args.max_model_len <= 0 or args.block_size <= 0:
                    raise ValueError(f"--max-model-len and --block-size must be positive, got "
                                     f"{args.max_model_len} and {args.block_size}")
                ws = workspace_size(args.max_model_len, len(args.context_lens), args.block_size)
                print(f"workspace {ws} tokens = workspace_size(max_model_len="
                      f"{args.max_model_len}, max_num_seqs={len(args.context_lens)}, "
                      f"block_size={args.block_size})")
            plan = plan_context_chunks(args.context_lens, block_size=args.block_size,
                                       workspace_size=ws)
            with_context = sum(n > 0 for n in args.context_lens)
            print(f"MCC = round_down({ws} // {max(with_context, 1)} requests with context, "
                  f"{args.block_size}) = {plan.max_context_chunk}")
    except ValueError as e:
        args.parser.error(str(e))
    print(plan)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mla", description="Multi-head Latent Attention: reference, checks and tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_walkthrough(sub)
    _add_config(sub)
    _add_plan(sub)
    add_conform_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mla`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
