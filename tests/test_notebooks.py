"""Every notebook runs top to bottom in a real kernel, with small step counts, and says what it should."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def run_notebook(path: Path, parameters: dict, home: Path) -> str:
    """Execute with `parameters` replacing the cell tagged "parameters"; return all printed text."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if "parameters" in cell.metadata.get("tags", []):
            cell.source = "\n".join(f"{k} = {v!r}" for k, v in parameters.items())
    previous = os.environ.get("STEPWISE_HOME")
    os.environ["STEPWISE_HOME"] = str(home)  # the kernel inherits it: its own embedded backend's home
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(home)}}).execute()
    finally:
        if previous is None:
            os.environ.pop("STEPWISE_HOME")
        else:
            os.environ["STEPWISE_HOME"] = previous
    return "\n".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
    )


@pytest.fixture
def notebook_home(tmp_path, stepwise_home):
    (tmp_path / "models").symlink_to(stepwise_home / "models")
    return tmp_path


def test_quickstart(notebook_home):
    printed = run_notebook(NOTEBOOKS / "00_quickstart.ipynb", {"steps": 6}, notebook_home)
    assert "Quibbleton" in printed
    losses = eval(printed.split("loss per step:")[1].splitlines()[0])
    assert len(losses) == 6 and losses[-1] < losses[0] / 4
    assert "cost $" in printed
