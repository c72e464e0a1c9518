"""vLLM 0.33.0's CUDA kernels on torch's stable C ABI (``vllm/_C_stable_libtorch.abi3.so``),
loaded once for the adapters that call them (``vllm_topk``: the indexer's top-k;
``vllm_cache``: the paged caches' writes and gathers).

The library registers ``torch.ops._C`` (the top-k kernels among others) and
``torch.ops._C_cache_ops`` (``concat_and_cache_mla``, ``cp_gather_cache``,
``indexer_k_quant_and_cache``, ...). Built on the stable ABI, it loads under a torch other than
the wheel's 2.14 (2.11 on our H200). ``python -m benchmarks.peers --topk`` writes it for sm_90
alone, compressed (``COMPRESSED``, 26 MB, against 92 MB: small enough to travel to a GPU
machine whose uploads are capped); ``load_library`` unpacks it beside itself once.
"""

from __future__ import annotations

import ctypes
import lzma
import threading
from pathlib import Path

import torch

from mla.conformance.adapters import peers_dir, unpacked
from mla.conformance.catalogue import Unsupported

__all__ = ["load_library", "LIBRARY", "COMPRESSED", "OPS"]

PEER = "vLLM's CUDA kernels (vllm/_C_stable_libtorch.abi3.so)"
LIBRARY = "vllm/_C_stable_libtorch.abi3.so"
COMPRESSED = "vllm/_C_stable_libtorch.sm90.abi3.so.xz"  # benchmarks.peers --topk
# the kernels the adapters call, by namespace (``load_library`` reports which registered)
OPS = {"_C": ("top_k_per_row_prefill", "top_k_per_row_decode", "persistent_topk",
              "cooperative_topk"),
       "_C_cache_ops": ("concat_and_cache_mla", "cp_gather_cache",
                        "indexer_k_quant_and_cache")}
_RTLD_LAZY, _RTLD_GLOBAL = 0x1, 0x100
_loaded: dict[str, dict] = {}
_lock = threading.Lock()


def load_library(path: Path | None = None) -> dict:
    """Loads vLLM's library once (``path``: the .so or its .xz; default: the peers
    directory's, compressed or plain). Returns how: ``{"path", "how", "ops"}`` (``ops``:
    ``"namespace.name"`` -> registered, for ``OPS``); an undefined symbol under the loader's
    immediate binding (a stable-ABI function newer than this torch) falls back to lazy
    binding, so that only a kernel whose wrapper calls it fails. ``Unsupported`` where there
    is no library or it cannot be loaded."""
    if path is None:
        root = peers_dir()
        found = [root / p for p in (COMPRESSED, LIBRARY) if (root / p).is_file()]
        if not found:
            raise Unsupported(f"{PEER} is not unpacked in {root} (python -m benchmarks.peers "
                              "--topk writes it)")
        path = found[0]
    with _lock:
        key = str(Path(path).resolve())
        if key not in _loaded:
            try:
                so = unpacked(Path(path))
            except (OSError, EOFError, lzma.LZMAError) as e:  # read-only, truncated, not xz
                raise Unsupported(f"{PEER}: cannot unpack {path} ({e})"[:500]) from e
            try:
                torch.ops.load_library(str(so))
                how = "torch.ops.load_library"
            except OSError as e:
                libc = ctypes.CDLL(None)
                libc.dlopen.restype = ctypes.c_void_p
                libc.dlerror.restype = ctypes.c_char_p
                if not libc.dlopen(str(so).encode(), _RTLD_LAZY | _RTLD_GLOBAL):
                    raise Unsupported(f"{PEER} does not load from {so} ({e}; lazy binding: "
                                      f"{libc.dlerror()})"[:500]) from e
                how = f"dlopen(RTLD_LAZY) after: {e}"[:300]
            ops = {f"{ns}.{n}": hasattr(getattr(torch.ops, ns), n)
                   for ns, names in OPS.items() for n in names}
            _loaded[key] = {"path": str(so), "how": how, "ops": ops}
        return dict(_loaded[key])
