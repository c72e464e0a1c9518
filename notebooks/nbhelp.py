"""What every notebook here needs before its first line of MLA: the package and a figure saver.

Importing this module puts the repository root on ``sys.path`` when the notebook runs from a
checkout without ``pip install -e .``, so ``import mla`` finds the package next door.

Figures go to ``$MLA_FIGURES_DIR/<notebook>/`` (default ``notebooks/figures/``, which git
ignores). ``save`` refuses a figure whose axes do not say what they show and in what unit: every
axis label must carry its unit in parentheses, e.g. ``"context length (tokens)"``.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent
if (_ROOT / "mla" / "__init__.py").exists() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

__all__ = ["figure_saver", "check_axis_labels"]

_UNIT = re.compile(r"\(.+\)")


def check_axis_labels(fig: object, name: str) -> None:
    """Raise ``ValueError`` unless every axis of ``fig`` has a label with a unit in parentheses.

    A colorbar has one labelled axis (its long one); a plain axes has two.
    """
    for ax in fig.axes:  # type: ignore[attr-defined]
        if ax.get_label() == "<colorbar>":
            labels = [ax.get_ylabel() or ax.get_xlabel()]
        else:
            labels = [ax.get_xlabel(), ax.get_ylabel()]
        for label in labels:
            if not _UNIT.search(label):
                raise ValueError(f"figure {name!r}: axis label {label!r} needs its unit in "
                                 f"parentheses, e.g. 'context length (tokens)'")


def figure_saver(notebook: str) -> Callable[[object, str], Path]:
    """``save(fig, name)`` writing ``<figures dir>/<notebook>/<name>.png`` after the label check."""
    out = Path(os.environ.get("MLA_FIGURES_DIR", _HERE / "figures")) / notebook
    out.mkdir(parents=True, exist_ok=True)

    def save(fig: object, name: str) -> Path:
        check_axis_labels(fig, name)
        path = out / f"{name}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")  # type: ignore[attr-defined]
        print(f"saved {path}")
        return path

    return save
