"""Adapters: other people's MLA kernels presented as conformance targets.

Each module's ``target()`` returns ``{kernel name: callable}`` with ``mla.reference``'s
signatures (``catalogue.KERNELS``). A callable imports its peer when called, converts layouts
exactly (only shapes and strides, never values) and passes the peer's outputs through
unchanged in value, so that a convention the peer does not share (a base-2 lse, ``-inf`` for
an empty query, ...) shows as a failing case that names it. When the peer cannot be imported
(not unpacked, no GPU, a torch it was not built for) or does not take the inputs (a page size,
``s_q > 1``, a dtype), the callable raises ``Unsupported`` with the reason, and the case reads
"unsupported", never "fail".

The peers come from ``python -m benchmarks.peers`` (vLLM 0.33.0's wheel, unpacked into
``<repo>/peers``, or wherever ``$MLA_PEERS`` points); FlashInfer from an installed
``flashinfer`` package.
"""

from __future__ import annotations

import importlib
import lzma
import os
import shutil
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import torch

from mla.conformance.catalogue import Unsupported

__all__ = ["peers_dir", "import_peer", "require", "require_device", "require_dtype",
           "triton_runs_on", "unpacked", "unpacked_tree"]

REPO = Path(__file__).resolve().parents[3]


def peers_dir() -> Path:
    """Where ``benchmarks.peers`` unpacked the peers: ``$MLA_PEERS`` or ``<repo>/peers``."""
    return Path(os.environ.get("MLA_PEERS") or REPO / "peers")


def unpacked(path: Path) -> Path:
    """The file ``path`` names: itself, or for an ``.xz`` the file unpacked beside it (once;
    again when the ``.xz`` is newer). A partial file never stays: unpacking writes
    ``NAME.part``, then renames it."""
    if path.suffix != ".xz":
        return path
    out = path.with_suffix("")
    if not out.is_file() or out.stat().st_mtime < path.stat().st_mtime:
        part = out.with_name(out.name + ".part")
        try:
            with lzma.open(path) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        part.replace(out)
    return out


def unpacked_tree(archive: Path) -> Path:
    """The directory ``X`` that ``X.tar.xz`` holds, unpacked beside it once (again when the
    archive is newer; written as ``X.part`` first, then renamed, so that a directory that
    exists is whole). Members that would land outside it are refused (``tarfile``'s data
    filter)."""
    if not archive.name.endswith(".tar.xz"):
        raise ValueError(f"archive must be a .tar.xz, got {archive.name!r}")
    dest = archive.with_name(archive.name.removesuffix(".tar.xz"))
    if dest.is_dir() and dest.stat().st_mtime >= archive.stat().st_mtime:
        return dest
    part = dest.with_name(dest.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    try:
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(part, filter="data")
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    shutil.rmtree(dest, ignore_errors=True)
    part.replace(dest)
    return dest


def import_peer(module: str, what: str,
                hint: str = "unpack it with python -m benchmarks.peers") -> ModuleType:
    """Import ``module`` with ``peers_dir()`` first on ``sys.path``; ``Unsupported`` naming
    ``what``, the cause and ``hint`` (how to get it) when it cannot be imported."""
    root = peers_dir()
    if root.is_dir() and str(root) not in sys.path:
        sys.path.insert(0, str(root))  # ahead of an installed vllm: the unpacked 0.33.0 files
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 (an .so without CUDA raises OSError or ImportError)
        where = (f"{root} holds no such module" if not root.is_dir() or
                 not (root / module.split(".")[0]).exists() else f"from {root}")
        raise Unsupported(f"{what} is not importable ({type(e).__name__}: {e}; {where}; "
                          f"{hint})"[:500]) from e


def require(condition: bool, peer: str, reason: str) -> None:
    """``Unsupported`` ("``peer`` ``reason``") unless ``condition``."""
    if not condition:
        raise Unsupported(f"{peer} {reason}")


def require_device(peer: str, kind: str, **tensors: torch.Tensor | None) -> None:
    """Every given tensor on a ``kind`` device ("cuda")."""
    for name, t in tensors.items():
        if t is not None and t.device.type != kind:
            raise Unsupported(f"{peer} runs on {kind} tensors only; {name} is on {t.device}")


def require_dtype(peer: str, allowed: tuple[torch.dtype, ...], **tensors: torch.Tensor) -> None:
    """Every given tensor in one of ``allowed``."""
    for name, t in tensors.items():
        if t.dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise Unsupported(f"{peer} takes {names} only; {name} is "
                              f"{str(t.dtype).removeprefix('torch.')}")


def triton_runs_on(peer: str, *tensors: torch.Tensor) -> None:
    """A Triton kernel runs on CUDA tensors, or on CPU ones under ``TRITON_INTERPRET=1``."""
    for t in tensors:
        if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise Unsupported(f"{peer} is a Triton kernel: on the CPU it runs only under "
                              "TRITON_INTERPRET=1 (set before triton is imported)")
        if t.device.type not in ("cpu", "cuda"):
            raise Unsupported(f"{peer} runs on CUDA (or the CPU interpreter), got {t.device}")
