"""``python -m benchmarks.v41_codecs --out-dir DIR [--device cuda|cpu] [--tokens N]``: vLLM
0.33's DeepSeek-V4.1 cache codecs against ``mla.reference.fp8_v41``, byte for byte.

Needs ``peers/`` from ``python -m benchmarks.peers --v41`` (or ``$MLA_PEERS``): the kernels,
copied verbatim from the wheel into one module. For each case (random rows, blocks of very
different sizes, amax at the floors, e4m3 and e2m1 ties, signed zeros, huge values, NaN and
inf) it runs

- ``_rope_quant_insert_mxfp8_kernel`` / ``_rope_quant_insert_nvfp4_kernel`` (the compressed
  cache's writers) with ``cos = 1, sin = 0`` (the rotation is the identity, so the codec's
  input is the latent itself, except that ``x · 0`` makes an inf's pair partner NaN: the
  reference is given the same float32 rows, computed the kernel's way), and on one case a
  real rotation of the RoPE dims (float32 products that a fused multiply-add may round
  differently: differences there are the rotation's, not the codec's);
- ``_quantize_and_insert_k_mxfp8_kernel`` (the SWA cache's writer, the bf16 row as it is);
- ``_dequantize_and_gather_k_mxfp8_kernel`` / ``..._nvfp4_kernel`` on the reference's records
  and on random bytes, against ``dequantize_*_v41`` (bf16 bit patterns, any NaN equal).

and counts records and bytes that differ. The NVFP4 writer's e2m1 conversion is one PTX
instruction of sm_100 and later (``cvt.rn.satfinite.e2m1x2.f32``); where it does not compile
(Hopper, Triton's interpreter) the writer runs a second time with that function replaced by a
comparison ladder written here (``e2m1x2_rne``, marked "substituted" in the results), which
checks the rest of the kernel (scales, division, packing). Records whose input holds NaN or
inf are counted apart: there the reference deliberately writes the NaN scale (NVFP4) where the
kernel writes finite codes.

On an H100 (torch 2.11, Triton 3.6, 2026-12-06, 4096 rows a case): every record of finite
input byte-identical for both MXFP8 writers and the substituted NVFP4 writer (the real one does
not compile for sm_90); on non-finite input the kernels write NaN as +448 (0x7E) and the NVFP4
scale 0x01 or 448 where the reference writes NaN; the gathers agree with the dequantizers on
every record the quantizers write (NVFP4 up to the sign of zero) and on MXFP8 scale bytes
1..254.

Writes ``DIR/v41_codecs.json`` (cases, counts, GPU, versions, date) and prints a table. On the
CPU it needs ``TRITON_INTERPRET=1`` (set here when ``--device cpu``), and is slow: use
``--tokens 64``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULE = "vllm.models.deepseek_v41.common.ops.v41_codec_kernels"
BLOCK = 64  # tokens a page


def _peers() -> Path:
    root = Path(os.environ.get("MLA_PEERS", REPO / "peers"))
    if not (root / (MODULE.replace(".", "/") + ".py")).is_file():
        raise SystemExit(f"{root} has no {MODULE}: run python -m benchmarks.peers --v41 and "
                         "carry peers/ over (or set MLA_PEERS)")
    return root


def _load(root: Path, name: str):  # noqa: ANN202 (a module)
    """A fresh copy of the kernels' module under ``name`` (its own JIT functions)."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location(name, root / (MODULE.replace(".", "/") + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


E2M1_SUBSTITUTE = '''"""e2m1 pairs for benchmarks.v41_codecs where PTX's e2m1x2 cvt is missing."""

from vllm.triton_utils import tl, triton


@triton.jit
def e2m1x2_rne(x_lo, x_hi):
    """e2m1 codes of two float32 tensors, packed lo | hi << 4: nearest, ties to the even
    code, above 6 (inf, NaN) to 6, the sign bit from the float's."""
    out = tl.zeros(x_lo.shape, tl.int32)
    for half in tl.static_range(2):
        bits = x_lo.to(tl.int32, bitcast=True) if half == 0 else x_hi.to(tl.int32, bitcast=True)
        a = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
        code = tl.where(a <= 0.25, 0, tl.where(a < 0.75, 1, tl.where(
            a <= 1.25, 2, tl.where(a < 1.75, 3, tl.where(a <= 2.5, 4, tl.where(
                a < 3.5, 5, tl.where(a <= 5.0, 6, 7)))))))
        code = code | ((bits >> 28) & 8)
        out = out | (code << (4 * half))
    return out.to(tl.uint8)
'''


def _e2m1_substitute(where: Path):  # noqa: ANN202 (a Triton function)
    """``E2M1_SUBSTITUTE``'s function, from a file (Triton reads a JIT function's source)."""
    path = where / "_e2m1x2_rne.py"
    path.write_text(E2M1_SUBSTITUTE)
    spec = importlib.util.spec_from_file_location("_e2m1x2_rne", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.e2m1x2_rne


# ---- inputs -------------------------------------------------------------------------------------

def _cases(torch, t: int) -> dict[str, Callable]:  # noqa: ANN001
    g = torch.Generator().manual_seed(41)
    f64 = torch.float64

    def randn(*shape: int):  # noqa: ANN202
        return torch.randn(*shape, generator=g, dtype=f64)

    def per_block(n: int, lo: int, hi: int):  # noqa: ANN202
        gain = 2.0 ** torch.randint(lo, hi, (t, 512 // n, 1), generator=g).double()
        return (randn(t, 512 // n, n) * gain).flatten(-2)

    def e4m3(codes):  # noqa: ANN001, ANN202
        return codes.to(torch.uint8).view(torch.float8_e4m3fn).double()

    def random():  # noqa: ANN202
        return randn(t, 512) * 2.0 ** torch.randint(-8, 9, (t, 1), generator=g).double()

    def floors():  # noqa: ANN202
        """Blocks with amax around 1e-4 (vLLM's floor) and 0.0448 (FlashMLA's), and below."""
        x = randn(t, 512).clamp(-3, 3) / 3
        peak = torch.tensor([1e-6, 5e-5, 1e-4, 1.1e-4, 0.01, 0.0447, 0.0448, 0.045, 0.0449,
                             3e-4, 1e-3, 0.5, 1.0, 7e-5, 2e-4, 0.04], dtype=f64)
        x = x.view(t, 16, 32) * peak[torch.randperm(16, generator=g)][None, :, None]
        return x.flatten(-2)

    def e4m3_ties():  # noqa: ANN202
        """Per block a power of two s: a peak at 448·s (or -448·s), the rest midpoints between
        neighbouring e4m3 numbers times s (ties to even), one block peaking just above."""
        s = 2.0 ** torch.randint(-20, 20, (t, 16, 1), generator=g).double()
        codes = torch.randint(0, 0x7D, (t, 16, 32), generator=g)
        sign = torch.randint(0, 2, (t, 16, 32), generator=g) * 2.0 - 1.0
        x = sign * (e4m3(codes) + e4m3(codes + 1)) / 2
        x[:, :, 0] = torch.where(torch.rand(t, 16, generator=g) < 0.5, 448.0, -448.0)
        x[:, 3, 0] = 450.0  # the next bf16 above: the scale doubles
        return (x * s).flatten(-2)

    def e2m1_ties():  # noqa: ANN202
        """Per block of 16 an e4m3 scale sc: a peak at 6·sc, the rest e2m1 midpoints and
        values times sc (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, ...)."""
        sc = e4m3(torch.randint(1, 0x7F, (t, 32, 1), generator=g))
        vals = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0,
                             4.0, 6.0, 0.125, 5.5], dtype=f64)
        idx = torch.randint(0, 16, (t, 32, 16), generator=g)
        sign = torch.randint(0, 2, (t, 32, 16), generator=g) * 2.0 - 1.0
        x = sign * vals[idx]
        x[:, :, 0] = 6.0
        return (x * sc).flatten(-2)

    def magnitudes():  # noqa: ANN202
        """Every block of 16 its own size, 2^-40 to 2^40."""
        return per_block(16, -40, 41)

    def huge():  # noqa: ANN202
        """Blocks of 16 up to 2^125 (bf16 holds up to 2^128) and down to 2^-120."""
        return per_block(16, -120, 126)

    def zeros():  # noqa: ANN202
        """All-zero and all -0 blocks, and blocks of values that round to ±0."""
        x = randn(t, 16, 32) * 1e-3
        x[:, 0] = 0.0
        x[:, 1] = -0.0
        x[:, 2] = torch.where(randn(t, 32) < 0, -1.0, 1.0) * 2.0 ** -40
        x[:, 2, 0] = 1.0  # the rest rounds to signed zeros (e4m3) ...
        x[:, 3, :16] = torch.where(randn(t, 16) < 0, -1.0, 1.0) * 1e-3
        x[:, 3, 0] = 64.0  # ... and to signed e2m1 zeros
        return x.flatten(-2)

    def nonfinite():  # noqa: ANN202
        """NaN, +inf, -inf at random places of some rows; one all-NaN block."""
        x = random()
        rows = torch.arange(t)
        for v in (float("nan"), float("inf"), -float("inf")):
            where = torch.randint(0, 512, (t,), generator=g)
            pick = torch.rand(t, generator=g) < 0.3
            x[rows[pick], where[pick]] = v
        x[0, 64:96] = float("nan")
        return x

    return {"random": random, "floors": floors, "e4m3_ties": e4m3_ties,
            "e2m1_ties": e2m1_ties, "magnitudes": magnitudes, "huge": huge, "zeros": zeros,
            "nonfinite": nonfinite}


# ---- runs ---------------------------------------------------------------------------------------

def _rotated(torch, latent, cos, sin):  # noqa: ANN001, ANN202
    """The float32 rows the compressed writers quantize: pairs (even, odd) rotated as the
    kernel writes it, ``(e·c − o·s, o·c + e·s)``, each product and sum rounded to float32."""
    x = latent.float()
    even, odd = x[:, 0::2], x[:, 1::2]
    out = torch.empty_like(x)
    out[:, 0::2] = even * cos - odd * sin
    out[:, 1::2] = odd * cos + even * sin
    return out


def _compare(torch, got, want, nonfinite) -> dict:  # noqa: ANN001
    """Byte counts; ``scale_bytes_differing`` counts the scale bytes (512.. or 256..) alone."""
    diff = got.cpu() != want.cpu()
    values = 512 if got.shape[-1] == 528 else 256
    bad = diff.any(-1)
    nf = nonfinite.cpu()
    first = bad.nonzero().flatten()[:3].tolist()
    return {"records": int(got.shape[0]), "records_differing": int(bad.sum()),
            "bytes_differing": int(diff.sum()),
            "scale_bytes_differing": int(diff[:, values:].sum()),
            "scale_bytes_differing_finite_input": int(diff[~nf][:, values:].sum()),
            "records_nonfinite_input": int(nf.sum()),
            "records_differing_finite_input": int((bad & ~nf).sum()),
            "examples": [{"record": i, "bytes_at": diff[i].nonzero().flatten()[:8].tolist(),
                          "kernel": got[i][diff[i]][:8].tolist(),
                          "reference": want[i][diff[i]][:8].tolist()} for i in first]}


def _bf16_bits_compare(torch, got, want) -> dict:  # noqa: ANN001
    """Values differing as bf16 bit patterns (any two NaN equal); ``zero_sign_only``: of those,
    the ones that are +0 against -0."""
    g, w = got.cpu().view(torch.int16), want.cpu().view(torch.int16)
    both_nan = torch.isnan(got.cpu().float()) & torch.isnan(want.cpu().float())
    diff = (g != w) & ~both_nan
    zero_sign = diff & (got.cpu().float() == 0) & (want.cpu().float() == 0)
    bad = diff.any(-1)
    first = bad.nonzero().flatten()[:3].tolist()
    return {"records": int(got.shape[0]), "records_differing": int(bad.sum()),
            "values_differing": int(diff.sum()), "zero_sign_only": int(zero_sign.sum()),
            "records_differing_beyond_zero_sign": int((diff & ~zero_sign).any(-1).sum()),
            "examples": [{"record": i, "dims": diff[i].nonzero().flatten()[:8].tolist(),
                          "kernel": got[i].float()[diff[i]][:8].tolist(),
                          "reference": want[i].float()[diff[i]][:8].tolist()}
                         for i in first]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.v41_codecs",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: Triton's interpreter (TRITON_INTERPRET=1, set here)")
    p.add_argument("--tokens", type=int, default=4096, help="rows per case (default 4096)")
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch
    import triton

    from mla.reference.fp8_v41 import (
        dequantize_fp8_v41,
        dequantize_nvfp4_v41,
        quantize_fp8_v41,
        quantize_nvfp4_v41,
    )

    root = _peers()
    kern = _load(root, "v41_codec_kernels")
    subst = _load(root, "v41_codec_kernels_substituted")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    subst._fp32x2_to_fp4x2 = _e2m1_substitute(args.out_dir)
    dev = torch.device(args.device)
    t = args.tokens
    nb = -(-t // BLOCK)
    slots = torch.randperm(nb * BLOCK, generator=torch.Generator().manual_seed(7))[:t]
    slots_d = slots.to(dev)
    positions = torch.arange(t, device=dev)
    ident = torch.cat([torch.ones(t, 32), torch.zeros(t, 32)], dim=1).to(dev)

    def rope_cos_sin() -> torch.Tensor:
        ang = torch.arange(t, dtype=torch.float64)[:, None] * 10000.0 ** (
            -torch.arange(32, dtype=torch.float64) / 32)[None]
        return torch.cat([ang.cos(), ang.sin()], dim=1).float().to(dev)

    def run_writer(kernel, width: int, latent, cos_sin) -> torch.Tensor:  # noqa: ANN001
        cache = torch.full((nb, BLOCK, width), 0xAB, dtype=torch.uint8, device=dev)
        kernel[(t,)](latent, positions, cos_sin, cache, slots_d,
                     COS_STRIDE=cos_sin.stride(0), CACHE_STRIDE=cache.stride(0),
                     CACHE_BLOCK=BLOCK, COMPRESS_RATIO=1, SANITIZE_CACHE_NANS=False,
                     num_warps=4)
        return cache.view(-1, width)[slots_d].cpu()

    def run_swa(k) -> torch.Tensor:  # noqa: ANN001
        cache = torch.full((nb, BLOCK * 528), 0xAB, dtype=torch.uint8, device=dev)
        kern._quantize_and_insert_k_mxfp8_kernel[(t,)](
            k, slots_d, cache, t, head_dim=512, scale_dim=16, quant_block=32,
            cache_block_size=BLOCK, block_stride=cache.stride(0), fp8_max=448.0,
            use_fnuz=False)
        return cache.view(-1, 528)[slots_d].cpu()

    def run_gather(kernel, records, width: int, scale_dim: int, quant_block: int
                   ) -> torch.Tensor:  # noqa: ANN001
        cache = torch.zeros(nb * BLOCK, width, dtype=torch.uint8)
        cache[:t] = records
        cache = cache.view(nb, BLOCK, width).to(dev)
        out = torch.full((1, t, 512), float("nan"), dtype=torch.bfloat16, device=dev)
        table = torch.arange(nb, dtype=torch.int32, device=dev)[None]
        lens = torch.tensor([t], dtype=torch.int32, device=dev)
        extra = {"use_fnuz": False} if width == 528 else {}
        kernel[(1, 4)](out, out.stride(0), out.stride(1), cache, lens, table, 0, None,
                       max_blocks_per_seq=nb, head_dim=512, scale_dim=scale_dim,
                       quant_block=quant_block, cache_block_size=BLOCK,
                       block_stride=cache.stride(0), **extra)
        return out[0].cpu()

    results = []

    def record(kernel: str, case: str, fn: Callable[[], dict]) -> None:
        try:
            row = fn()
        except Exception as e:  # noqa: BLE001 (reported: a kernel that does not compile here)
            row = {"error": f"{type(e).__name__}: {e}"[:500]}
        row = {"kernel": kernel, "case": case, **row}
        results.append(row)
        print(f"{kernel:44s} {case:12s} " + (
            f"records {row['records']:6d}  differing {row['records_differing']:6d}"
            + (f" (finite input: {row['records_differing_finite_input']}, scale bytes "
               f"{row['scale_bytes_differing_finite_input']})"
               if "records_differing_finite_input" in row else "")
            + (f" (beyond the sign of 0: {row['records_differing_beyond_zero_sign']})"
               if "zero_sign_only" in row else "")
            if "error" not in row else "ERROR " + row["error"][:90]), flush=True)

    def writers(case: str, k64: torch.Tensor, cos_sin: torch.Tensor) -> None:
        latent = k64.to(torch.bfloat16).to(dev)
        x = _rotated(torch, latent.cpu(), _pairs(torch, cos_sin.cpu(), 0),
                     _pairs(torch, cos_sin.cpu(), 32))
        nf = ~torch.isfinite(x).all(-1)
        record("_rope_quant_insert_mxfp8_kernel", case, lambda: _compare(
            torch, run_writer(kern._rope_quant_insert_mxfp8_kernel, 528, latent, cos_sin),
            quantize_fp8_v41(x), nf))
        want4 = quantize_nvfp4_v41(x)
        record("_rope_quant_insert_nvfp4_kernel", case, lambda: _compare(
            torch, run_writer(kern._rope_quant_insert_nvfp4_kernel, 288, latent, cos_sin),
            want4, nf))
        record("_rope_quant_insert_nvfp4_kernel (substituted e2m1)", case, lambda: _compare(
            torch, run_writer(subst._rope_quant_insert_nvfp4_kernel, 288, latent, cos_sin),
            want4, nf))

    for case, make in _cases(torch, t).items():
        k64 = make()
        writers(case, k64, ident)
        kb = k64.to(torch.bfloat16)
        record("_quantize_and_insert_k_mxfp8_kernel", case, lambda kb=kb: _compare(
            torch, run_swa(kb.to(dev)), quantize_fp8_v41(kb),
            ~torch.isfinite(kb.float()).all(-1)))
    writers("rope_rotated", _cases(torch, t)["random"](), rope_cos_sin())

    g = torch.Generator().manual_seed(5)
    fp8_records = {"reference_records": quantize_fp8_v41(_cases(torch, t)["magnitudes"]()),
                   "random_bytes": torch.randint(0, 256, (t, 528), generator=g,
                                                 dtype=torch.uint8)}
    fp4_records = {"reference_records": quantize_nvfp4_v41(_cases(torch, t)["magnitudes"]()),
                   "random_bytes": torch.randint(0, 256, (t, 288), generator=g,
                                                 dtype=torch.uint8)}
    fp8_sane = fp8_records["random_bytes"].clone()
    fp8_sane[:, 512:] = fp8_sane[:, 512:].clamp(1, 254)  # no byte 255 (NaN here, inf there)
    fp8_records["random_bytes_scale_1_254"] = fp8_sane
    for case, recs in fp8_records.items():
        record("_dequantize_and_gather_k_mxfp8_kernel", case, lambda recs=recs: _bf16_bits_compare(
            torch,
            run_gather(kern._dequantize_and_gather_k_mxfp8_kernel, recs, 528, 16, 32),
            dequantize_fp8_v41(recs)))
    for case, recs in fp4_records.items():
        record("_dequantize_and_gather_k_nvfp4_kernel", case, lambda recs=recs: _bf16_bits_compare(
            torch,
            run_gather(kern._dequantize_and_gather_k_nvfp4_kernel, recs, 288, 32, 16),
            dequantize_nvfp4_v41(recs)))

    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": (torch.cuda.get_device_name() if dev.type == "cuda"
                      else "cpu (Triton interpreter)"),
           "capability": (list(torch.cuda.get_device_capability()) if dev.type == "cuda"
                          else None),
           "torch": torch.__version__, "triton": triton.__version__,
           "tokens_per_case": t, "results": results}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "v41_codecs.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"{out['device']}, torch {out['torch']}, triton {out['triton']}: "
          f"{args.out_dir / 'v41_codecs.json'}")
    return 0


def _pairs(torch, cos_sin, at: int):  # noqa: ANN001, ANN202
    """cos (``at = 0``) or sin (``at = 32``) per pair of dims, as the writers load it: the
    table's 32 entries for the RoPE pairs 224..255, 1 (cos) or 0 (sin) for the others."""
    t = cos_sin.shape[0]
    out = torch.full((t, 256), 1.0 if at == 0 else 0.0)
    out[:, 224:] = cos_sin[:, at:at + 32]
    return out


if __name__ == "__main__":
    sys.exit(main())
