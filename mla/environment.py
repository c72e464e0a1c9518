"""Date, versions and GPU of a run: the heading of every results file."""

from __future__ import annotations

import datetime
import os
import platform

import torch

__all__ = ["environment"]


def environment(device: torch.device | None = None) -> dict[str, str]:
    """The UTC date, torch/triton/python versions, ``TRITON_INTERPRET`` and, when CUDA is
    there (or ``device`` is a CUDA device), the GPU's name and CUDA version."""
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "python": platform.python_version(),
           "triton_interpret": os.environ.get("TRITON_INTERPRET", "0")}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "not installed"
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = str(torch.version.cuda)
    return env
