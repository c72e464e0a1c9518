"""``python -m benchmarks.probes.topk_code_size``: where the top-k kernels' sm_90 code goes,
instruction by instruction, by the source function each SASS instruction came from (no GPU).

After the benchmark's L2 flush, a kernel of 4,096 straight-line SASS instructions cost its
compute alone on an H200 and one of 8,192 about 24 µs more (``code_fetch_probe``): code past
the SM's instruction caches is fetched from memory again at each replay. The top-k's kernels
sit around that edge. This compiles them for sm_90 as a row of 8193 keys launches them (the
held rows' kernel at 8192 for comparison) and counts each kernel's SASS instructions by the
innermost source function of their line info (``nvdisasm -g``; a helper inlined at several
places counts once for each place). Which functions run on a given row is the reader's to
say: the scan's functions (``_stream_select``, ``_digits``, ``_tile_composites``) run only
where the threshold failed.

Prints one block a kernel; ``--json`` prints the same as JSON; ``--plan
estimate_search=quad,select_search=quad`` compiles a plan other than the default. Run without
``TRITON_INTERPRET`` (an interpreting process cannot compile for a GPU).
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import triton

_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s")


@functools.cache
def _functions(path: str) -> tuple[tuple[int, int, str], ...]:
    """``(first line, last line, name)`` of every function defined in ``path``."""
    if not os.path.exists(path):
        return ()
    tree = ast.parse(open(path).read())
    return tuple((n.lineno, n.end_lineno or n.lineno, n.name) for n in ast.walk(tree)
                 if isinstance(n, ast.FunctionDef))


def _function_at(path: str, line: int) -> str:
    """``file:function`` of the innermost function of ``path`` holding ``line``."""
    inner = max((f for f in _functions(path) if f[0] <= line <= f[1]), default=None)
    return f"{os.path.basename(path)}:{inner[2] if inner else '?'}"


def sass_by_function(cubin: bytes) -> Counter:
    """The SASS instructions of ``cubin`` counted by the source function of their line info
    (``?`` before the first line mark)."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, "-g", "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    counts: Counter = Counter()
    where = "?"
    for line in text.splitlines():
        mark = _LINE.search(line)
        if mark:
            where = _function_at(mark.group(1), int(mark.group(2)))
        elif _INSTRUCTION.match(line):
            counts[where] += 1
    return counts


def kernels(changes: dict | None = None) -> dict[str, bytes]:
    """The cubins of the held rows' kernel (8192 keys), the one-launch kernel (a program a row,
    a row split over programs) and the two launches' second (8 warps, one part a row), as a
    row of 8193 keys launches them with the default plan (``changes``: its fields changed)."""
    import mla.fast.topk as fast_topk
    from benchmarks.indexer_compile import _compile
    from benchmarks.topk_sweep import (
        PTRS,
        fused_constants,
        held_constants,
        mark_select_constants,
    )
    from mla.fast.topk import CANDIDATES, TopkPlan
    from mla.fast.topk.fused import _fused_kernel, _mark_select_kernel
    from mla.fast.topk.kernels import _held_kernel

    plan = TopkPlan(**(changes or {}))
    ints = dict(W=8193, topk=2048, s_l_r=8208, s_o_r=2048, s_w_r=8208 // 32, chunk=8208,
                parts=1)
    found = {"held rows of 8192": _compile(_held_kernel, held_constants(plan, CANDIDATES), PTRS,
                                           dict(ints, W=CANDIDATES), plan.select_warps)}
    for split in (False, True):
        found["one launch" + (", a row split" if split else "")] = _compile(
            _fused_kernel, fused_constants(plan, split), PTRS, ints, plan.fused_warps,
            **fast_topk.uncapped(plan.fused_warps))
    found["two launches' second"] = _compile(
        _mark_select_kernel, mark_select_constants(plan), PTRS, dict(ints, chunk=plan.two_chunk),
        plan.fused_warps, **fast_topk.uncapped(plan.fused_warps))
    return {name: k.asm["cubin"] for name, k in found.items()}


def _changes(argv: list[str]) -> dict:
    """``--plan field=value,...`` (``TopkPlan`` fields; values as Python literals or words)."""
    if "--plan" not in argv:
        return {}
    out = {}
    for item in argv[argv.index("--plan") + 1].split(","):
        name, _, value = item.partition("=")
        try:
            out[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[name] = value
    return out


def main(argv: list[str]) -> int:
    res = {}
    changes = _changes(argv)
    for name, cubin in kernels(changes).items():
        counts = sass_by_function(cubin)
        res[name] = {"total": sum(counts.values()), "by_function": dict(counts.most_common())}
    if "--json" in argv:
        from mla.environment import environment

        print(json.dumps({"environment": environment(), "target": "sm_90", "plan": changes,
                          "kernels": res}, indent=1))
        return 0
    for name, r in res.items():
        print(f"{name}: {r['total']} SASS instructions")
        for where, n in list(r["by_function"].items())[:12]:
            print(f"  {n:6d}  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
