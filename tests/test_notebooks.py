"""Every notebook runs top to bottom, the tables' on the committed sample of rows (results/sample), so none of
them rots."""

from __future__ import annotations

import os

import nbformat
import pytest
from nbclient import NotebookClient

from test_run import ROOT

TRAINING = ROOT / "notebooks" / "train_with_plan.ipynb"  # trains a model with a plan; reads no rows
NOTEBOOKS = sorted(set((ROOT / "notebooks").glob("*.ipynb")) - {TRAINING})


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_on_the_sample_rows(path, monkeypatch):
    monkeypatch.setenv("RESULTS_ROWS", str(ROOT / "results" / "sample"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    errors = [out for cell in code for out in cell.outputs if out.output_type == "error"]
    assert not errors
    figures = [cell for cell in code if any("image/png" in out.get("data", {}) for out in cell.outputs)]
    assert len(figures) == sum("plt.subplots" in cell.source for cell in code) >= 2
    assert "rows from" in "".join(out.get("text", "") for out in code[0].outputs)


def test_notebooks_read_rows_only_through_load_results():
    for path in NOTEBOOKS:
        source = "\n".join(cell.source for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code")
        assert "load_results(" in source and "json" not in source and "read_csv" not in source


def test_a_folder_without_rows_is_said_so(tmp_path, monkeypatch):
    from nbclient.exceptions import CellExecutionError

    monkeypatch.setenv("RESULTS_ROWS", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    path = ROOT / "notebooks" / "tradeoffs.ipynb"
    client = NotebookClient(nbformat.read(path, as_version=4), timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    with pytest.raises(CellExecutionError, match="no result rows under"):
        client.execute()


def test_notebooks_are_committed_with_their_plots():
    """A reader sees the curves on GitHub without running anything (CI still runs them, above)."""
    code = [cell for cell in nbformat.read(TRAINING, as_version=4).cells if cell.cell_type == "code"]
    assert any("image/png" in out.get("data", {}) for cell in code for out in cell.outputs)
    for path in NOTEBOOKS:
        code = [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]
        assert sum("image/png" in out.get("data", {}) for cell in code for out in cell.outputs) >= 2, path.name


def test_the_training_notebook_trains_with_a_plan_as_plain_pytorch_does(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    notebook = nbformat.read(TRAINING, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(TRAINING.parent)}}).execute()
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert not [out for cell in code for out in cell.outputs if out.output_type == "error"]
    assert any("image/png" in out.get("data", {}) for out in code[-1].outputs)
    printed = "".join(out.get("text", "") for cell in code for out in cell.outputs)
    assert printed.count(": loss ") == 20 and "measured peak of one step" in printed
    difference = float(printed.split("largest difference between the two losses: ")[1].split()[0])
    assert difference <= 1e-5
