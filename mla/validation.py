"""Input validation shared by the reference and the fast path.

Every public function checks its arguments before any arithmetic and raises a ``ValueError``
(wrong shape, rank, device, value) or ``TypeError`` (wrong type or dtype) that names the
argument and gives the expected and the actual value. Nothing is silently broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | Sequence[int] | None = None,
    shape: Sequence[int | None] | None = None,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check one tensor argument; ``None`` entries of ``shape`` match any size."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{name} must have {want} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(
            s is not None and s != a for s, a in zip(shape, t.shape)
        ):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if dtype is not None:
        allowed_dt = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed_dt:
            want = " or ".join(str(d) for d in allowed_dt)
            raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} must be on device {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    return t


def check_float(name: str, t: object, **kw: object) -> torch.Tensor:
    """``check_tensor`` for a floating-point tensor (float64/32/16, bfloat16)."""
    return check_tensor(name, t, dtype=FLOAT_DTYPES, **kw)  # type: ignore[arg-type]


def check_index(name: str, t: object, dtype: Sequence[torch.dtype] = INDEX_DTYPES,
                **kw: object) -> torch.Tensor:
    """``check_tensor`` for an integer tensor (int32/int64 unless ``dtype`` narrows it)."""
    return check_tensor(name, t, dtype=dtype, **kw)  # type: ignore[arg-type]


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """All given tensors on one device; names the first one that differs."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    if not items:
        return
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                "all tensors must be on one device")


def check_same_dtype(**tensors: torch.Tensor | None) -> None:
    """All given tensors of one dtype; names the first one that differs (a ``TypeError``)."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    if not items:
        return
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; they must match")


def check_positive_int(name: str, value: object) -> int:
    """A Python int > 0 (a bool is refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def check_scale(name: str, value: object) -> float:
    """A positive finite number, e.g. a softmax scale; returned as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    return float(value)


def check_nonnegative(name: str, t: torch.Tensor) -> None:
    """No negative entry in ``t`` (reads ``t``'s minimum on the host)."""
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got minimum {int(t.min())}")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
