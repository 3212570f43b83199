"""The notebooks run top to bottom, headless, on the CPU, and are committed with outputs.

Notebooks 1 and 2 compute everything they show (each checks its fused results against the
naive ones with asserts, so a wrong result fails here); notebook 3 only reads the committed
benchmark results; notebook 4 trains in bf16 and FP8 (asserting the accuracies agree) and
reads the FP8 benchmark's results where they are committed; notebook 5 reads the GPT example's
committed comparison (`examples/gpt/results/`). The kernel is the `python3` kernelspec, which
jupyter_client starts with this interpreter.
"""

from pathlib import Path

import pytest

# Part of the test extras (CI has them); a GPU machine's image may not.
nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ["01_epilogs.ipynb", "02_flax_mlp.ipynb", "03_performance.ipynb", "04_fp8.ipynb",
         "05_gpt.ipynb"]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_without_errors(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    errors = [output for cell in notebook.cells for output in cell.get("outputs", [])
              if output.output_type == "error"]
    assert not errors


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_with_outputs(name):
    """A reader on GitHub sees the results without running anything."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code_cells and all(cell.execution_count for cell in code_cells)
    assert any(cell.outputs for cell in code_cells)
    assert not any(output.output_type == "error" for cell in code_cells
                   for output in cell.outputs)
