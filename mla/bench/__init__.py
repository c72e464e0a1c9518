"""Time any target's kernels on named DeepSeek shapes (``mla bench``).

    mla.bench.shapes    the presets (deepseek-v2, -v3, -v3.2, -v4 × decode/prefill ×
                        memory/compute-bound; DeepSeek-V3.2's indexer: top-k and the fp8
                        logits), their bytes and FLOPs formulas
    mla.bench.inputs    the random inputs of a shape, built once and shared by every target
    mla.bench.timing    CUDA-graph replays (median, L2 flushed or warm), eager fallback, and
                        the ceilings (copy GB/s, bf16 and fp8 matmul TFLOP/s) measured in the
                        same run
    mla.bench.runner    a target beside mla.fast and FlashMLA on the shapes
    mla.bench.report    the table, markdown, JSON and plot
"""

from mla.bench.runner import BESIDE, Result, Target, resolve_targets, run_bench
from mla.bench.shapes import PRESETS, SHAPES, Shape, select_shapes, work

__all__ = ["BESIDE", "PRESETS", "SHAPES", "Result", "Shape", "Target", "resolve_targets",
           "run_bench", "select_shapes", "work"]
