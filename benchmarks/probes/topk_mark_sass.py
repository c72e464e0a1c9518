"""``python -m benchmarks.probes.topk_mark_sass``: what the top-k's streaming read costs a
key, read off the compiled sm_90 code (no GPU needed).

``mla.fast.topk.kernels._mask_chunk`` (the one read of a row that marks the keys reaching the
threshold) is compiled alone for the H200, as the one-launch kernel runs it by default
(``fused_block`` keys a step, ``fused_stages`` in flight, ``fused_warps``), through a probe
kernel that marks one chunk and stores the count. Its SASS (Triton's bundled ``cuobjdump``) is
split at the labels; the longest block that branches back to its own label is the read's
steady-state loop. Prints that loop's instructions, how many keys a thread marks in one trip
(``fused_block / (32 * fused_warps)``), their quotient, and the loop's most frequent opcodes.

Run without ``TRITON_INTERPRET`` (an interpreting process cannot compile for a GPU).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter

import triton
import triton.language as tl
from triton.tools.disasm import get_sass

from benchmarks.indexer_compile import _compile
from mla.fast.topk import TopkPlan
from mla.fast.topk.kernels import _mask_chunk

_KEYS = 131072


@triton.jit
def _mark_probe(src, dst, out, start, end, chunk, t, W, BLOCK: tl.constexpr,
                STAGES: tl.constexpr):
    tl.store(out, _mask_chunk(src, dst, start, end, 0, chunk, t, W, BLOCK, STAGES))


def loop_facts(sass: str) -> dict:
    """The longest SASS block ``LBBn: ... BRA LBBn`` (a loop's body) of ``sass``: its
    instruction count and its opcodes by frequency."""
    blocks, label, body = {}, None, []
    for line in sass.splitlines():
        head = re.match(r"(LBB\d+):", line)
        if head:
            label, body = head.group(1), []
            continue
        ins = line.split("\t", 1)[-1].strip().rstrip(";")
        if label is None or not ins or ins.startswith(("Function", ".")):
            continue
        body.append(ins)
        if re.search(rf"\bBRA\s+{label}\b", ins):
            blocks[label] = list(body)
    if not blocks:
        raise RuntimeError("no loop found in the SASS")
    loop = max(blocks.values(), key=len)
    ops = Counter(i.split()[1 if i.startswith("@") else 0].split(".")[0] for i in loop)
    return {"instructions": len(loop), "opcodes": dict(ops.most_common(12))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.topk_mark_sass",
                                description=__doc__.split("\n")[0])
    p.parse_args(argv)
    plan = TopkPlan()
    k = _compile(_mark_probe, dict(BLOCK=plan.fused_block, STAGES=plan.fused_stages),
                 dict(src="fp32", dst="i32", out="i32"),
                 dict(start=0, end=_KEYS, chunk=_KEYS, t=5, W=_KEYS), plan.fused_warps)
    facts = loop_facts(get_sass(k.asm["cubin"]))
    keys = plan.fused_block // (32 * plan.fused_warps)
    facts.update(keys_per_thread=keys, per_key=round(facts["instructions"] / keys, 2),
                 block=plan.fused_block, warps=plan.fused_warps, stages=plan.fused_stages)
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
