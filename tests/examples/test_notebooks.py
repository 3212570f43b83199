"""The notebooks run top to bottom, headless, on the CPU, and are committed with outputs that
match what they read now.

Notebooks 1 and 2 compute everything they show (each checks its fused results against the
naive ones with asserts, so a wrong result fails here); notebook 3 only reads the committed
benchmark results; notebook 4 trains in bf16 and FP8 (asserting the accuracies agree) and
reads the FP8 benchmark's results where they are committed; notebook 5 reads the GPT example's
committed comparison (`examples/gpt/results/`); notebook 7 computes everything it shows on
the device it runs on (SwiGLU errors, residual bytes, an outlier sweep, three trainings),
each with an assert; notebook 8 switches stock Flax models (Linen, NNX, the example's stock
GPT) to FP8 training and serving by one line, each checked against the 16-bit model with an
assert. Cells that read the committed
results print the same text on every machine, so their committed outputs must equal a fresh
run's: a result file added, removed or replaced without re-executing the notebook fails here.
The kernel is the `python3` kernelspec, which jupyter_client starts with this interpreter.
"""

import re
from pathlib import Path

import pytest

# Part of the test extras (CI has them); a GPU machine's image may not.
nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
NAMES = sorted(path.name for path in NOTEBOOKS.glob("*.ipynb"))
# A cell that reads the committed benchmark reports (notebook 3's `reports`, notebook 4's
# `report`): its printed text depends on those files only.
READS_RESULTS = re.compile(r"\breports?\b|find_results|find_report")
FIGURE = re.compile(r"^<Figure size .*>$")


def printed(cell) -> list[str]:
    """What a cell printed or displayed as text (figures' reprs left out: their size is all
    they say). Consecutive chunks of one stream are one text: the kernel splits a stream
    where its flushes happen to fall, which differs from run to run."""
    texts, stream = [], None
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            if stream == output.name:
                texts[-1] += output.text
            else:
                texts.append(output.text)
            stream = output.name
            continue
        stream = None
        if "text/plain" in output.get("data", {}) and \
                not FIGURE.match(output.data["text/plain"]):
            texts.append(output.data["text/plain"])
    return texts


def result_cells(notebook) -> list[tuple[int, object]]:
    return [(i, cell) for i, cell in enumerate(notebook.cells)
            if cell.cell_type == "code" and READS_RESULTS.search(cell.source)]


def test_every_notebook_is_tested_and_listed_in_the_readme():
    assert len(NAMES) >= 4
    readme = (ROOT / "README.md").read_text()
    assert [name for name in NAMES if f"notebooks/{name}" not in readme] == []


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_and_its_results_outputs_are_current(name):
    committed = nbformat.read(NOTEBOOKS / name, as_version=4)
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    errors = [output for cell in notebook.cells for output in cell.get("outputs", [])
              if output.output_type == "error"]
    assert not errors
    stale = [f"cell {i}: committed {printed(cell)!r}, now {printed(notebook.cells[i])!r}"
             for i, cell in result_cells(committed)
             if printed(cell) != printed(notebook.cells[i])]
    assert not stale, (f"{name}'s committed outputs are stale: re-execute it (cd notebooks && "
                       f"jupyter execute --inplace {name}, with the test extra installed):\n" +
                       "\n".join(stale))


def test_results_cells_are_found():
    """The comparison above has something to compare where a notebook reads results."""
    cells = {name: result_cells(nbformat.read(NOTEBOOKS / name, as_version=4))
             for name in ("03_performance.ipynb", "04_fp8.ipynb")}
    assert all(len(found) >= 2 and any(printed(cell) for _, cell in found)
               for found in cells.values())


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_with_outputs(name):
    """A reader on GitHub sees the results without running anything."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code_cells and all(cell.execution_count for cell in code_cells)
    assert any(cell.outputs for cell in code_cells)
    assert not any(output.output_type == "error" for cell in code_cells
                   for output in cell.outputs)


def test_a_stream_split_into_chunks_prints_the_same_text():
    """The kernel may flush one print in two chunks; the text compared is the same."""
    def cell(*chunks):
        return nbformat.v4.new_code_cell(outputs=[
            nbformat.v4.new_output("stream", name=name, text=text) for name, text in chunks])
    whole = cell(("stdout", "small\n  variant\n"))
    assert printed(cell(("stdout", "small\n"), ("stdout", "  variant\n"))) == printed(whole)
    assert printed(cell(("stdout", "small\n"), ("stderr", "  variant\n"))) != printed(whole)
    assert printed(cell(("stdout", "small\n  variant\nmore"))) != printed(whole)
