"""The notebooks: committed without outputs, equal to their sources, and executing top to bottom.

Each notebook is executed with nbclient on the current interpreter's ``python3`` kernel, its
figures written to a temporary directory; it must finish without error (its cells assert their
own checks with ``mla.compare``), inside the time budget of the issue (60 s on 2 CPU cores),
and leave readable PNG files behind. The budget is checked on the kernel's CPU seconds, which
bound its wall time on an idle machine and, unlike wall time, do not grow when other processes
share the cores.
"""

from __future__ import annotations

import importlib.util
import os
import resource
from pathlib import Path

import pytest

# the dev extra installs both (README); a bare environment skips the module, saying why
nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BUDGET_S = 60.0


def _load_builder():
    spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOKS / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_builder()
SOURCES = build.sources()
IDS = [s.stem for s in SOURCES]


EXPECTED = ["01_mha_to_mla", "02_prefill_or_decode", "03_chunked_context",
            "04_decode_context_parallel", "05_sparse_topk", "06_differential_testing",
            "07_deepseek_v4", "08_v3_2_to_v4"]


def test_there_are_notebooks():
    assert IDS == EXPECTED
    committed = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    assert committed == IDS, "every notebook has a source in notebooks/src/ and vice versa"


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_committed_notebook_has_no_outputs(source: Path):
    nb = nbformat.read(build.notebook_path(source), as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {i} has outputs: strip them (rebuild)"
            assert cell.execution_count is None, f"cell {i} has an execution count"
            assert "execution" not in cell.metadata, f"cell {i} has execution timing"


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_committed_notebook_matches_its_source(source: Path):
    built = build.render(build.build_notebook(source))
    assert build.notebook_path(source).read_text() == built, (
        f"{source.stem}.ipynb is stale: run python notebooks/build.py")


def test_parse_cells_splits_and_strips():
    text = ("# lint directive, not a cell\n# %% [markdown]\n# # Title\n#\n# text\n\n"
            "# %%\nx = 1\n\n\n# %%\n\n# %% [markdown]\n#\n")
    assert build.parse_cells(text) == [("markdown", "# Title\n\ntext"), ("code", "x = 1")]
    with pytest.raises(ValueError, match="does not start with '#'"):
        build.parse_cells("# %% [markdown]\nnot a comment\n")


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_notebook_executes(source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MLA_FIGURES_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    nb = build.build_notebook(source)
    client = NotebookClient(nb, kernel_name="python3", timeout=BUDGET_S * 2,
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    client.execute()  # shuts the kernel down and reaps it: its CPU time lands in RUSAGE_CHILDREN
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert 0 < cpu_s < BUDGET_S, f"{source.stem} used {cpu_s:.0f} CPU s (budget {BUDGET_S:.0f} s)"
    figures = sorted((tmp_path / source.stem).glob("*.png"))
    assert figures, f"{source.stem} wrote no figure"
    for fig in figures:
        data = fig.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, f"{fig.name} is not a PNG plot"


def test_figure_saver_refuses_axes_without_units(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setenv("MLA_FIGURES_DIR", str(tmp_path))
    spec = importlib.util.spec_from_file_location("nbhelp", NOTEBOOKS / "nbhelp.py")
    nbhelp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nbhelp)
    save = nbhelp.figure_saver("t")
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    ax.set_xlabel("context length")
    ax.set_ylabel("time (s)")
    with pytest.raises(ValueError, match="needs its unit"):
        save(fig, "bad")
    ax.set_xlabel("context length (tokens)")
    image = ax.imshow([[0, 1], [1, 0]])
    cbar = fig.colorbar(image)
    with pytest.raises(ValueError, match="needs its unit"):
        save(fig, "bad_colorbar")
    cbar.set_label("score (1)")
    assert save(fig, "good").read_bytes().startswith(PNG_MAGIC)
    assert not (tmp_path / "t" / "bad.png").exists()
    plt.close(fig)
