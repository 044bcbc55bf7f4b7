"""Every committed notebook is executed, in step with its source, and re-runs as a student runs it.

The re-run fills in the exercises' reference answers (tests/notebook_answers.py): every check cell
must say "right:", and, run again with a wrong answer and with None, "wrong:" and "fill in".

A student opens a notebook with `jupyter lab` in notebooks/ (or `make lab`): the kernel starts in
notebooks/, with no PYTHONPATH. So the re-execution here starts a fresh kernel in notebooks/ too;
the files import because the venv's .pth (written by `make`) puts the repository root on sys.path.
"""

import os
import subprocess
import sys

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
sys.path.insert(0, NOTEBOOKS)
from build import execute, read_source, sources  # noqa: E402

from tests.notebook_answers import assert_verdicts, fill_in_answers  # noqa: E402

SOURCES = sources()
CELL_TIMEOUT_S = 600  # a hang guard per cell, not a speed check: wall time is never asserted


def _names(paths):
    return [os.path.splitext(os.path.basename(p))[0] for p in paths]


def test_repository_importable_from_notebooks_folder():
    """What a kernel started in notebooks/ sees: the venv must know the repository root."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = "import mhc, tools.spawn; print(mhc.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=NOTEBOOKS, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, (
        "a kernel started in notebooks/ cannot import the repository's files; run `make` once "
        f"(it writes a .pth into the venv pointing at the root):\n{out.stderr}"
    )
    assert os.path.dirname(out.stdout.strip()) == ROOT, f"imports another copy: {out.stdout}"


def test_every_source_has_a_notebook_and_back():
    committed = sorted(f[:-6] for f in os.listdir(NOTEBOOKS) if f.endswith(".ipynb"))
    assert committed == _names(SOURCES), "each notebooks/src/NN_*.py has one notebooks/NN_*.ipynb"


# every notebook but 00, the quickest, re-executes in the slow tier
@pytest.mark.parametrize(
    "source",
    [
        pytest.param(s, marks=() if os.path.basename(s).startswith("00_") else pytest.mark.slow)
        for s in SOURCES
    ],
    ids=_names(SOURCES),
)
def test_notebook_reexecutes(source):
    path = os.path.join(NOTEBOOKS, _names([source])[0] + ".ipynb")
    nb = nbformat.read(path, as_version=4)
    expected = [(c.cell_type, c.source) for c in read_source(source).cells]
    assert [(c.cell_type, c.source) for c in nb.cells] == expected, (
        f"{os.path.basename(path)} is stale: rebuild it with `python notebooks/build.py`"
    )
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "commit the notebook executed, every cell"
    assert any(
        o.get("output_type") == "display_data" for c in code for o in c.get("outputs", [])
    ), "the committed notebook must be committed executed, with its plots"
    verdicts = fill_in_answers(nb, _names([source])[0])
    # a fresh kernel started in notebooks/; raises CellExecutionError with the failing cell
    execute(nb, timeout=CELL_TIMEOUT_S, cwd=NOTEBOOKS)
    assert_verdicts(verdicts)
