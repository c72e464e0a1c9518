"""The conformance catalogue's cases as ``python -m mla.check`` cases of ``mla.fast``.

``mla.conformance`` holds the one catalogue of named cases for every kernel anyone may check;
the GPU check runs it on ``mla.fast`` first, then only what our kernels alone have (forced
plans and routes, CUDA-graph capture, the prefill paths). A catalogue row becomes a check
result: its errors by quantity (``out_rel``, ``lse_abs``, ..., ``mismatches``) with the same
budgets, so ``--seeds`` measures the catalogue's worst errors as well.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import mla.fast as fast
from mla.check.registry import Case, Ctx, Measured, register
from mla.conformance.catalogue import Setting, cases_of
from mla.conformance.runner import run_case
from mla.conformance.targets import load_target

__all__ = ["catalogue_cases"]


def _measure(kernel: str, name: str, ctx: Ctx) -> Measured:
    (c,) = [c for c in cases_of([kernel]) if c.name == name]
    # the conformance target "mla.fast": its kernels with the value checks on, which the
    # catalogue's "refused" cases need whatever the global setting
    row = run_case(load_target("mla.fast")[1][kernel], c,
                   Setting(ctx.device, ctx.dtype, ctx.seed, small=ctx.quick))
    if row.status in ("error", "unsupported"):
        raise RuntimeError(f"{row.status}: {row.detail}")
    if row.status == "fail" and not row.errors:  # an invalid input the kernel did not refuse
        raise RuntimeError(row.detail)
    if not row.errors:  # refused as it must be: one exact "error" of 0
        return Measured({"mismatches[refusal]": 0.0}, {"mismatches[refusal]": 0.0})
    # keyed "<quantity>[<output>]": outputs may share a quantity (out and dst both exact)
    metrics = {f"{row.quantities[n]}[{n}]": v for n, v in row.errors.items()}
    limits = {f"{row.quantities[n]}[{n}]": v for n, v in row.limits.items()}
    return Measured(metrics, limits)


# DeepSeek-V4's topics (conventions §14) and the keyword a kernel takes once it implements
# the topic. The check holds mla.fast to what it implements: a kernel that does not take a
# topic's keyword leaves that topic's cases out (the catalogue reports them "unsupported" for
# it). The MODEL1 cache needs no keyword: mla.fast's sparse decode reads it.
V4_KEYWORDS = {"sink": "attn_sink", "second_scope": "extra_k_cache"}


def not_in_fast(kernel: str) -> frozenset[str]:
    """The DeepSeek-V4 topics ``mla.fast``'s ``kernel`` does not take yet."""
    fn = getattr(fast, kernel, None)
    if fn is None:
        return frozenset(V4_KEYWORDS)
    params = inspect.signature(fn).parameters
    return frozenset(t for t, kw in V4_KEYWORDS.items() if kw not in params)


def catalogue_cases(ctx: Ctx, kernel: str) -> Iterator[Case]:
    """Every catalogue case of ``kernel`` (but the topics ``not_in_fast(kernel)``), run on
    ``mla.fast`` in the context's dtype."""
    skip = not_in_fast(kernel)
    for c in cases_of([kernel]):
        if c.topic not in skip:
            yield Case(f"catalogue {c.name}", lambda n=c.name: _measure(kernel, n, ctx))


# kernels whose check is the catalogue alone (the others add their own cases after it)
for _kernel in ("merge_attn_states", "concat_and_cache_mla", "gather_cache",
                "concat_and_cache_fp8_ds_mla", "convert_req_index_to_global_index",
                "cp_lse_ag_out_rs", "indexer_k_quant_and_cache",
                "fp8_paged_mqa_logits", "top_k_per_row"):
    register(_kernel, _kernel)(lambda ctx, k=_kernel: catalogue_cases(ctx, k))
