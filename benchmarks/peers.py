"""``python -m benchmarks.peers [--wheel PATH] [--dest peers] [--topk] [--deepgemm] [--v4]
[--v41]``: other people's MLA kernels, unpacked for ``mla conform`` without installing vLLM.

The ``vllm==0.33.0`` wheel (about 330 MB) holds FlashMLA's compiled extension and its Python
interface and vLLM's Triton MLA kernels. This script takes only those out of it (about 4 MB)
into ``--dest`` (default ``peers/``, kept out of git), keeping their ``vllm/...`` paths:

    vllm/_flashmla_C.abi3.so, _flashmla_extension_C.abi3.so   FlashMLA (stable ABI, CUDA 13)
    vllm/third_party/flashmla/                    flash_mla_with_kvcache, get_mla_metadata,
                                                  flash_mla_sparse_fwd
    vllm/v1/attention/ops/triton_decode_attention.py   decode_attention_fwd
    vllm/v1/attention/ops/triton_merge_attn_states.py  merge_attn_states (Triton)
    vllm/v1/attention/ops/merge_attn_states.py         vLLM's dispatcher, kept for reading
    vllm/v1/attention/ops/dcp_correct_attn_out.py      the DCP correction kernel, see below

plus empty ``__init__.py`` files and two stubs for what those files import from vLLM:
``vllm/platforms.py`` (``current_platform``) and ``vllm/triton_utils.py`` (``triton``, ``tl``).

The DCP correction kernel (``correct_attn_out``, under ``cp_lse_ag_out_rs``) lives in 0.33's
``vllm/v1/attention/ops/dcp.py`` inside a JIT-warmup class whose module imports a dozen vLLM
subsystems; the script copies the kernel's source (``CorrectAttnCPOutKernel.kernel``, a
``@triton.jit`` function) verbatim into a module of its own; the adapter launches it as
``CorrectAttnCPOutKernel.__call__`` does (``mla.conformance.adapters.vllm_triton``).
``MANIFEST.json`` records the wheel and every written file's sha256.

``--topk`` adds vLLM's CUDA kernels on torch's stable ABI (``vllm/_C_stable_libtorch.abi3.so``:
the indexer's top-k and the paged caches' writes and gathers, for ``mla conform --target
vllm-topk`` / ``vllm-cache`` and ``benchmarks.topk_peers``), for sm_90 alone and compressed
(26 MB); ``--deepgemm`` adds DeepGEMM as vLLM ships it (``vllm/third_party/deep_gemm``: the
indexer's logits kernels, for ``--target deepgemm`` and ``benchmarks.indexer_peers``), its
extension and headers compressed (6 MB).

``--v4`` adds DeepSeek-V4's compressor and indexer-q Triton kernels as vLLM 0.33 runs them off
CUDA's CuTe-DSL paths (for ``benchmarks.v4_peers_check``), and the Triton kernels that build the
two KV scopes' indices (the window's slots, the compressed entries' slots, the prefill's
combined workspace indices; for ``mla conform --target vllm-v4``'s ``v4_scope_indices``): the
``@triton.jit`` functions ``V4_KERNELS`` names (``kernel`` methods of launcher classes are
written under the names ``V4_RENAMES`` gives), copied verbatim by their source lines from
``save_partial_states.py``, ``fused_compress_quant_cache.py``, ``fused_indexer_q.py``,
``v1/attention/ops/common.py``, ``v1/attention/backends/mla/sparse_swa.py``, ``cache_utils.py``
and ``deepseek_v4/sparse_mla.py`` into one module ``V4_MODULE`` that imports only
``vllm.triton_utils``.

``--v41`` adds DeepSeek-V4.1's cache codecs as vLLM 0.33 writes and reads them (for
``benchmarks.v41_codecs``): the ``@triton.jit`` functions ``V41_KERNELS`` names, copied
verbatim by their source lines from three modules whose imports reach most of vLLM
(``fused_compress_quant_cache.py``, ``cache_utils.py``, ``fused_indexer_q.py``), into one module
``V41_MODULE`` that imports only ``vllm.triton_utils`` (the stub below).

FlashInfer is not unpacked here: ``flashinfer-python`` 0.7.2.post1 unpacks to 685 MiB (its
CUDA sources, which it compiles with nvcc at the first ``plan``), and it needs packages of its
own; its adapter runs where ``import flashinfer`` works.

The GPU machine has no network: run this where the registry is reachable, then carry
``peers/`` over; the adapters find it at ``<repo>/peers`` or ``$MLA_PEERS``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import io
import json
import lzma
import os
import py_compile
import shutil
import struct
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from collections.abc import Callable
from pathlib import Path

VLLM = "vllm==0.33.0"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = Path.home() / ".cache" / "mla-peers"

# members taken from the wheel as they are
COPIED = (
    "vllm/_flashmla_C.abi3.so",
    "vllm/_flashmla_extension_C.abi3.so",
    "vllm/v1/attention/ops/triton_decode_attention.py",
    "vllm/v1/attention/ops/triton_merge_attn_states.py",
    "vllm/v1/attention/ops/merge_attn_states.py",
)
COPIED_DIRS = ("vllm/third_party/flashmla/",)
DCP_SOURCE = "vllm/v1/attention/ops/dcp.py"
DCP_CLASS, DCP_KERNEL = "CorrectAttnCPOutKernel", "kernel"
DCP_MODULE = "vllm/v1/attention/ops/dcp_correct_attn_out.py"
PACKAGES = ("vllm", "vllm/third_party", "vllm/v1", "vllm/v1/attention", "vllm/v1/attention/ops")

# --v41: DeepSeek-V4.1's MXFP8 (528 B) and NVFP4 (288 B) writers and readers, by source file
V41_OPS = "vllm/models/deepseek_v41/common/ops/"
V41_KERNELS = {
    V41_OPS + "fused_compress_quant_cache.py": (
        "_rope_quant_insert_mxfp8_kernel", "_rope_quant_insert_nvfp4_kernel"),
    V41_OPS + "cache_utils.py": (
        "_quantize_and_insert_k_mxfp8_kernel", "_dequantize_and_gather_k_mxfp8_kernel",
        "_dequantize_and_gather_k_nvfp4_kernel"),
    # the e2m1 pair conversion the NVFP4 writer calls (inline PTX, sm_100 and later)
    "vllm/models/deepseek_v4/common/ops/fused_indexer_q.py": ("_fp32x2_to_fp4x2",),
}
V41_MODULE = V41_OPS + "v41_codec_kernels.py"
V41_PACKAGES = ("vllm/models", "vllm/models/deepseek_v41", "vllm/models/deepseek_v41/common",
                V41_OPS.rstrip("/"))

# --v4: DeepSeek-V4's compressor (state save; compress, norm, rope, quantize, store) and the
# indexer's q rope + FP8 quantize, by source file; "Class.kernel" names a launcher's method
V4_OPS = "vllm/models/deepseek_v4/common/ops/"
V4_KERNELS = {
    V4_OPS + "save_partial_states.py": ("SavePartialStatesKernel.kernel",),
    V4_OPS + "fused_compress_quant_cache.py": (
        "_fused_kv_compress_norm_rope_insert_sparse_attn",
        "_fused_kv_compress_norm_rope_insert_indexer_attn"),
    V4_OPS + "fused_indexer_q.py": ("_get_cos_sin", "FusedIndexerQRopeQuantTritonKernel.kernel"),
    # the MX scale packing the indexer compressor calls where MX_SCALE (sm_100 and later)
    "vllm/v1/attention/ops/common.py": ("pack_ue8m0_x4",),
    # the scopes' indices: the window's slots (decode) and the prefill's gather lengths, the
    # C4A top-k's slots (decode), the prefill's combined workspace indices, the C128A ids
    "vllm/v1/attention/backends/mla/sparse_swa.py": (
        "_compute_swa_indices_and_lens_kernel", "ComputePrefillMetadataKernel.kernel"),
    V4_OPS + "cache_utils.py": ("ComputeGlobalTopkIndicesAndLensKernel.kernel",
                                "CombineTopkSwaIndicesKernel.kernel"),
    "vllm/models/deepseek_v4/sparse_mla.py": ("BuildC128ATopkMetadataKernel.kernel",),
}
V4_RENAMES = {"SavePartialStatesKernel.kernel": "save_partial_states_kernel",
              "FusedIndexerQRopeQuantTritonKernel.kernel": "fused_indexer_q_rope_quant_kernel",
              "ComputePrefillMetadataKernel.kernel": "compute_prefill_metadata_kernel",
              "ComputeGlobalTopkIndicesAndLensKernel.kernel":
                  "compute_global_topk_indices_and_lens_kernel",
              "CombineTopkSwaIndicesKernel.kernel": "combine_topk_swa_indices_kernel",
              "BuildC128ATopkMetadataKernel.kernel": "build_c128a_topk_metadata_kernel"}
V4_MODULE = V4_OPS + "v4_kernels.py"
V4_PACKAGES = ("vllm/models", "vllm/models/deepseek_v4", "vllm/models/deepseek_v4/common",
               V4_OPS.rstrip("/"))

STUBS = {
    "vllm/platforms.py": '''\
"""Stub of vllm.platforms for the files benchmarks/peers.py extracts: the platform calls they
make at import and in their dispatch (a CUDA build of torch counts as CUDA)."""

import torch


class _Platform:
    def is_cuda(self) -> bool:
        return torch.version.cuda is not None

    def is_rocm(self) -> bool:
        return torch.version.hip is not None

    def is_cpu(self) -> bool:
        return not (self.is_cuda() or self.is_rocm())

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fnuz if self.is_rocm() else torch.float8_e4m3fn


current_platform = _Platform()
''',
    "vllm/triton_utils.py": '''\
"""Stub of vllm.triton_utils: Triton itself."""

import triton
import triton.language as tl

HAS_TRITON = True

__all__ = ["HAS_TRITON", "tl", "triton"]
''',
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def download(spec: str, cache: Path) -> Path:
    """``pip download --no-deps spec`` into ``cache``; the wheel's path."""
    cache.mkdir(parents=True, exist_ok=True)
    name = spec.split("==")[0].replace("-", "_")
    before = set(cache.glob(f"{name}-*.whl"))
    log(f"pip download --no-deps {spec} -> {cache}")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary",
                    ":all:", "-d", str(cache), spec], check=True)
    version = spec.split("==")[1] if "==" in spec else ""
    found = sorted(p for p in cache.glob(f"{name}-{version}*.whl"))
    if not found:
        raise SystemExit(f"pip download left no {name} wheel in {cache} "
                         f"(had {sorted(map(str, before))})")
    return found[-1]


def dcp_kernel_source(dcp_py: str) -> str:
    """The module written to ``DCP_MODULE``: ``CorrectAttnCPOutKernel.kernel``'s source,
    dedented, under its own name (``correct_attn_cp_out_kernel``)."""
    tree = ast.parse(dcp_py)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == DCP_CLASS),
               None)
    fn = cls and next((n for n in cls.body if isinstance(n, ast.FunctionDef)
                       and n.name == DCP_KERNEL), None)
    if fn is None:
        raise SystemExit(f"{DCP_SOURCE} has no {DCP_CLASS}.{DCP_KERNEL}: the wheel's layout "
                         "changed; update benchmarks/peers.py")
    decorators = [ast.unparse(d) for d in fn.decorator_list]
    if "triton.jit" not in decorators:
        raise SystemExit(f"{DCP_CLASS}.{DCP_KERNEL} is decorated {decorators}, expected "
                         "triton.jit")
    lines = dcp_py.splitlines()
    body = textwrap.dedent("\n".join(lines[fn.lineno - 1: fn.end_lineno]))
    body = body.replace(f"def {DCP_KERNEL}(", "def correct_attn_cp_out_kernel(", 1)
    return (f'"""``{DCP_CLASS}.{DCP_KERNEL}`` of vLLM 0.33.0 ``{DCP_SOURCE}`` (lines '
            f'{fn.lineno}-{fn.end_lineno}), copied verbatim by benchmarks/peers.py.\n\n'
            f"vLLM launches it with grid (num_tokens, num_heads, 1) and these keyword "
            f"constants:\nHEAD_DIM, N_ROUNDED (= the number of ranks), IS_BASE_E.\n"
            f'"""\n\nfrom vllm.triton_utils import tl, triton\n\n\n@triton.jit\n{body}\n')


def v41_kernels_source(sources: dict[str, str]) -> str:
    """The module written to ``V41_MODULE``: each function ``V41_KERNELS`` names, with its
    decorator, copied verbatim from its file's source (``sources``: path -> text)."""
    parts = []
    for path, names in V41_KERNELS.items():
        tree = ast.parse(sources[path])
        lines = sources[path].splitlines()
        found = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for name in names:
            fn = found.get(name)
            if fn is None:
                raise SystemExit(f"{path} has no function {name}: the wheel's layout changed; "
                                 "update benchmarks/peers.py")
            decorators = [ast.unparse(d) for d in fn.decorator_list]
            if not any(d.startswith("triton.jit") for d in decorators):
                raise SystemExit(f"{path}: {name} is decorated {decorators}, expected "
                                 "triton.jit")
            first = min(d.lineno for d in fn.decorator_list)
            parts.append(f"# {path}, lines {first}-{fn.end_lineno}\n"
                         + "\n".join(lines[first - 1:fn.end_lineno]))
    names = ", ".join(n for ns in V41_KERNELS.values() for n in ns)
    return (f'"""DeepSeek-V4.1 cache codecs of vLLM 0.33.0, copied verbatim by '
            f'benchmarks/peers.py --v41:\n{names}.\n"""\n\n'
            "from vllm.triton_utils import tl, triton\n\n\n" + "\n\n\n".join(parts) + "\n")


def _jit_function(tree: ast.Module, path: str, name: str) -> ast.FunctionDef:
    """The ``@triton.jit`` function ``name`` (``"f"`` at module level or ``"Class.f"``) of
    ``path``'s syntax tree."""
    body = tree.body
    *outer, leaf = name.split(".")
    for cls_name in outer:
        cls = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == cls_name),
                   None)
        if cls is None:
            raise SystemExit(f"{path} has no class {cls_name}: the wheel's layout changed; "
                             "update benchmarks/peers.py")
        body = cls.body
    fn = next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == leaf), None)
    if fn is None:
        raise SystemExit(f"{path} has no function {name}: the wheel's layout changed; "
                         "update benchmarks/peers.py")
    decorators = [ast.unparse(d) for d in fn.decorator_list]
    if not any(d.startswith("triton.jit") for d in decorators):
        raise SystemExit(f"{path}: {name} is decorated {decorators}, expected triton.jit")
    return fn


def v4_kernels_source(sources: dict[str, str]) -> str:
    """The module written to ``V4_MODULE``: each function ``V4_KERNELS`` names, with its
    ``triton.jit`` decorator (a method's ``staticmethod`` dropped, its body dedented and
    renamed as ``V4_RENAMES`` says), copied verbatim from its file's source (``sources``:
    path -> text)."""
    parts = []
    for path, names in V4_KERNELS.items():
        tree = ast.parse(sources[path])
        lines = sources[path].splitlines()
        for name in names:
            fn = _jit_function(tree, path, name)
            jit = [d for d in fn.decorator_list if ast.unparse(d).startswith("triton.jit")]
            first = min(d.lineno for d in jit)
            text = textwrap.dedent("\n".join(lines[first - 1:fn.end_lineno]))
            if name in V4_RENAMES:
                text = text.replace(f"def {fn.name}(", f"def {V4_RENAMES[name]}(", 1)
            parts.append(f"# {path}, lines {first}-{fn.end_lineno}"
                         + (f" ({name})" if name in V4_RENAMES else "") + "\n" + text)
    names = ", ".join(V4_RENAMES.get(n, n) for ns in V4_KERNELS.values() for n in ns)
    return (f'"""DeepSeek-V4 compressor, indexer-q and scope-index Triton kernels of vLLM '
            f'0.33.0, copied verbatim by benchmarks/peers.py --v4:\n{names}.\n"""\n\n'
            "from vllm.triton_utils import tl, triton\n\n\n" + "\n\n\n".join(parts) + "\n")


def _extract_kernels(wheel: Path, dest: Path, kernels: dict, module: str, packages: tuple,
                     source: Callable[[dict[str, str]], str]) -> dict[str, str]:
    """Write ``module`` (``source`` of the wheel's ``kernels`` files) and its packages'
    ``__init__.py`` into ``dest`` (the stubs come from ``extract_vllm``); returns
    {relative path: sha256}."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        missing = [m for m in kernels if m not in names]
        if missing:
            raise SystemExit(f"{wheel.name} lacks {missing}")
        sources = {m: z.read(m).decode() for m in kernels}
    written = {}
    for rel, data in [(module, source(sources).encode()),
                      *[(f"{pkg}/__init__.py", b"") for pkg in packages]]:
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.write_bytes(data)
        written[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return written


def extract_v4(wheel: Path, dest: Path) -> dict[str, str]:
    """DeepSeek-V4's kernels into ``V4_MODULE`` (``_extract_kernels``)."""
    return _extract_kernels(wheel, dest, V4_KERNELS, V4_MODULE, V4_PACKAGES, v4_kernels_source)


def extract_v41(wheel: Path, dest: Path) -> dict[str, str]:
    """DeepSeek-V4.1's codec kernels into ``V41_MODULE`` (``_extract_kernels``)."""
    return _extract_kernels(wheel, dest, V41_KERNELS, V41_MODULE, V41_PACKAGES,
                            v41_kernels_source)


def extract_vllm(wheel: Path, dest: Path) -> dict[str, str]:
    """Write the members, the stubs and the DCP kernel module into ``dest``; returns
    {relative path: sha256}."""
    written: dict[str, str] = {}

    def write(rel: str, data: bytes) -> None:
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written[rel] = hashlib.sha256(data).hexdigest()

    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        missing = [m for m in COPIED + (DCP_SOURCE,) if m not in names]
        if missing:
            raise SystemExit(f"{wheel.name} lacks {missing}")
        for m in COPIED:
            write(m, z.read(m))
        for d in COPIED_DIRS:
            members = sorted(n for n in names if n.startswith(d) and not n.endswith("/"))
            if not members:
                raise SystemExit(f"{wheel.name} has no {d}")
            for m in members:
                write(m, z.read(m))
        write(DCP_MODULE, dcp_kernel_source(z.read(DCP_SOURCE).decode()).encode())
    for rel, text in STUBS.items():
        write(rel, text.encode())
    for pkg in PACKAGES:
        if f"{pkg}/__init__.py" not in written:
            write(f"{pkg}/__init__.py", b"")
    return written


def elf_section(data: bytes, name: str) -> tuple[int, int] | None:
    """``(offset, size)`` of the ELF64 file ``data``'s section ``name``, or ``None``."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not an ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    names_at, = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)
    for i in range(shnum):
        h = shoff + i * shentsize
        at = names_at + struct.unpack_from("<I", data, h)[0]
        if data[at:data.index(b"\0", at)].decode() == name:
            return struct.unpack_from("<QQ", data, h + 0x18)
    return None


FATBIN_MAGIC = 0xBA55ED50


def keep_one_arch(buf: bytearray, start: int, end: int, arch: int) -> int:
    """Zeroes, in the fat binaries of ``buf[start:end]`` (a ``.nv_fatbin`` section), the
    payload of every cubin built for another SM than ``arch`` (90: the H100 and H200),
    leaving every entry's header and the PTX as they are, so the CUDA runtime still finds
    the ``arch`` cubins (and the PTX) and never reads the rest. Returns the bytes zeroed.
    Layout: a fat binary is a 16-byte header (magic, version, header size, size of what
    follows) and entries, each a header (kind 1 PTX or 2 cubin at byte 0, its header size at
    4, its payload size at 8, its SM at 28) and its payload."""
    zeroed, pos = 0, start
    while pos + 16 <= end:
        magic, _version, header, size = struct.unpack_from("<IHHQ", buf, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # the fat binaries are 8-byte aligned, padding between them
            continue
        p, stop = pos + header, pos + header + size
        while p < stop:
            kind, _v, entry_header, payload = struct.unpack_from("<HHIQ", buf, p)
            sm, = struct.unpack_from("<I", buf, p + 28)
            if kind == 2 and sm != arch:
                buf[p + entry_header:p + entry_header + payload] = bytes(payload)
                zeroed += payload
            p += entry_header + payload
        pos = stop
    return zeroed


def topk_library(wheel: Path) -> tuple[str, bytes]:
    """vLLM's CUDA kernels on torch's stable ABI, the top-k ones among them (``LIBRARY`` of
    ``mla.conformance.adapters.vllm_library``, 92 MB), for sm_90 alone, compressed by xz
    (``COMPRESSED``, 26 MB): the other SMs' cubins zeroed (``keep_one_arch``)."""
    from mla.conformance.adapters.vllm_library import COMPRESSED, LIBRARY  # imports torch

    with zipfile.ZipFile(wheel) as z:
        buf = bytearray(z.read(LIBRARY))
    section = elf_section(bytes(buf), ".nv_fatbin")
    if section is None:
        raise SystemExit(f"{LIBRARY} has no .nv_fatbin section")
    zeroed = keep_one_arch(buf, section[0], section[0] + section[1], 90)
    log(f"{LIBRARY}: {len(buf) / 2**20:.0f} MiB, cubins of other SMs than sm_90 zeroed "
        f"({zeroed / 2**20:.0f} MiB); compressing")
    return COMPRESSED, lzma.compress(bytes(buf), preset=6)


def deepgemm_files(wheel: Path) -> dict[str, bytes]:
    """DeepGEMM as vLLM 0.33.0 ships it (``vllm/third_party/deep_gemm``, 57 MB), for
    ``mla.conformance.adapters.deepgemm``: its Python files as they are, its extension
    compressed by xz (``.so.xz``, 29 -> 5 MB) and the headers its JIT compiles against as
    ``include.tar.xz`` (28 -> 1 MB), which the adapter unpacks beside them."""
    from mla.conformance.adapters.deepgemm import PACKAGE  # imports torch

    root = PACKAGE.replace(".", "/") + "/"
    out: dict[str, bytes] = {}
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith(root) and not n.endswith("/"))
        if not names:
            raise SystemExit(f"{wheel.name} has no {root}")
        tar_buf = io.BytesIO()
        with tarfile.open(fileobj=tar_buf, mode="w:xz", preset=6) as tar:
            for n in names:
                rel = n[len(root):]
                data = z.read(n)
                if rel.startswith("include/"):
                    info = tarfile.TarInfo(rel[len("include/"):])
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                elif rel.endswith(".so"):
                    out[n + ".xz"] = lzma.compress(data, preset=6)
                elif rel.endswith(".py"):
                    out[n] = data
        out[root + "include.tar.xz"] = tar_buf.getvalue()
    log(f"{root}: {len(names)} members -> {len(out)} files, "
        f"{sum(map(len, out.values())) / 2**20:.1f} MiB")
    return out


def check_python(dest: Path, written: dict[str, str]) -> list[str]:
    """Compile every written .py; import the pure-Triton modules. Returns one line per
    module saying whether it imported (the FlashMLA interface needs a CUDA build of torch)."""
    for rel in written:
        if rel.endswith(".py"):
            py_compile.compile(str(dest / rel), doraise=True)
    sys.path.insert(0, str(dest))
    lines = []
    for mod in ("vllm.v1.attention.ops.triton_decode_attention",
                "vllm.v1.attention.ops.triton_merge_attn_states",
                "vllm.v1.attention.ops.dcp_correct_attn_out",
                "vllm.third_party.flashmla.flash_mla_interface",
                *([V41_MODULE[:-3].replace("/", ".")] if V41_MODULE in written else []),
                *([V4_MODULE[:-3].replace("/", ".")] if V4_MODULE in written else [])):
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 (reported, e.g. the .so without CUDA)
            lines.append(f"  {mod}: not importable here ({type(e).__name__}: {e})"[:300])
        else:
            lines.append(f"  {mod}: imports")
    sys.path.remove(str(dest))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--wheel", type=Path, help=f"a downloaded {VLLM} wheel (default: download)")
    p.add_argument("--dest", type=Path, default=REPO / "peers",
                   help="where to unpack (default: <repo>/peers)")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                   help=f"where downloaded wheels go (default: {DEFAULT_CACHE})")
    p.add_argument("--topk", action="store_true",
                   help="also vLLM's top-k kernels for sm_90, xz-compressed (26 MB), for "
                        "benchmarks.topk_peers")
    p.add_argument("--deepgemm", action="store_true",
                   help="also DeepGEMM (vllm/third_party/deep_gemm: the indexer's logits "
                        "kernels), its extension and headers xz-compressed (6 MB), for "
                        "mla conform --target deepgemm")
    p.add_argument("--v4", action="store_true",
                   help="also DeepSeek-V4's compressor, indexer-q and scope-index Triton "
                        "kernels, copied into one module, for benchmarks.v4_peers_check and "
                        "mla conform --target vllm-v4")
    p.add_argument("--v41", action="store_true",
                   help="also DeepSeek-V4.1's cache codec kernels (MXFP8 528 B, NVFP4 288 B), "
                        "copied into one module, for benchmarks.v41_codecs")
    args = p.parse_args(argv)

    wheel = args.wheel or download(VLLM, args.cache)
    if not wheel.is_file():
        p.error(f"--wheel {wheel} is not a file")
    if args.dest.exists():
        shutil.rmtree(args.dest)  # a stale file from another version must not linger
    args.dest.mkdir(parents=True)
    written = extract_vllm(wheel, args.dest)
    if args.v4:
        written.update(extract_v4(wheel, args.dest))
    if args.v41:
        written.update(extract_v41(wheel, args.dest))
    if args.topk:
        rel, data = topk_library(wheel)
        (args.dest / rel).write_bytes(data)
        written[rel] = hashlib.sha256(data).hexdigest()
    if args.deepgemm:
        for rel, data in deepgemm_files(wheel).items():
            (args.dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (args.dest / rel).write_bytes(data)
            written[rel] = hashlib.sha256(data).hexdigest()
    manifest = {"vllm_wheel": wheel.name,
                "vllm_wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
                "files": written}
    (args.dest / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")

    total = sum((args.dest / rel).stat().st_size for rel in manifest["files"])
    print(f"from {wheel.name} into {args.dest}:")
    for rel in sorted(manifest["files"]):
        print(f"  {(args.dest / rel).stat().st_size:>9}  {rel}")
    print(f"{len(manifest['files'])} files, {total / 2**20:.1f} MiB; MANIFEST.json lists "
          "their sha256")
    print("import check (with the extracted files first on sys.path):")
    print("\n".join(check_python(args.dest, manifest["files"])))
    if os.environ.get("MLA_PEERS") and Path(os.environ["MLA_PEERS"]) != args.dest.resolve():
        print(f"note: MLA_PEERS={os.environ['MLA_PEERS']} points elsewhere; the adapters read "
              "that")
    return 0


if __name__ == "__main__":
    sys.exit(main())
