"""Build the notebooks from their reviewable sources: ``python notebooks/build.py``.

Each notebook is written as a plain Python file in ``notebooks/src/`` in the *percent* format
(the one jupytext and VS Code read): a line ``# %%`` starts a code cell, ``# %% [markdown]`` a
markdown cell whose lines are comments (``# `` is stripped). Lines before the first marker
(a lint directive, say) are not part of the notebook. The built ``.ipynb`` files carry no
outputs, so what is committed is exactly what was reviewed; ``tests/test_notebooks.py``
executes them and checks that they match their sources.

    python notebooks/build.py            write notebooks/*.ipynb
    python notebooks/build.py --check    exit 1 if any committed notebook is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "src"

JUPYTER_KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}


def parse_cells(text: str) -> list[tuple[str, str]]:
    """``[(kind, source), ...]`` of a percent-format script (kind: ``"code"``/``"markdown"``)."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# %%"):
            kind = "markdown" if "[markdown]" in line else "code"
            cells.append((kind, []))
        elif cells:
            kind, lines = cells[-1]
            if kind == "markdown":
                if line and not line.startswith("#"):
                    raise ValueError(f"markdown cell line does not start with '#': {line!r}")
                line = line[2:] if line.startswith("# ") else line[1:]
            lines.append(line)
    out = []
    for kind, lines in cells:
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        if lines:
            out.append((kind, "\n".join(lines)))
    return out


def build_notebook(source: Path) -> nbformat.NotebookNode:
    """The output-free notebook of one source file."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = dict(JUPYTER_KERNEL)
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, text) in enumerate(parse_cells(source.read_text())):
        cell = (nbformat.v4.new_markdown_cell(text) if kind == "markdown"
                else nbformat.v4.new_code_cell(text))
        cell["id"] = f"{source.stem[:2]}-{i:02d}"  # stable ids: rebuilding gives the same bytes
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def notebook_path(source: Path) -> Path:
    return HERE / f"{source.stem}.ipynb"


def render(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def sources() -> list[Path]:
    return sorted(SOURCES.glob("[0-9][0-9]_*.py"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if a committed notebook differs")
    args = parser.parse_args(argv)
    stale = []
    for src in sources():
        text = render(build_notebook(src))
        path = notebook_path(src)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(HERE.parent)}")
    if stale:
        print(f"stale notebooks (run python notebooks/build.py): {', '.join(stale)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
