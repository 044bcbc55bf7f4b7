"""Every committed notebook re-executes cleanly, within a time limit, and matches its source script."""
import glob
import os
import sys
import time

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "notebooks"))
from build import execute, script_to_notebook  # noqa: E402

NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
TIME_LIMIT_S = 240


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_reexecutes(path):
    nb = nbformat.read(path, as_version=4)
    source = os.path.join(ROOT, "notebooks", "src", os.path.basename(path)[:-6] + ".py")
    assert os.path.exists(source), f"{path} has no source script at {source}"
    with open(source) as f:
        expected = [c.source for c in script_to_notebook(f.read()).cells]
    assert [c.source for c in nb.cells] == expected, \
        f"{os.path.basename(path)} is stale: rebuild it with `python notebooks/build.py`"
    assert any(o.get("output_type") == "display_data" for c in nb.cells if c.cell_type == "code"
               for o in c.get("outputs", [])), "the committed notebook must be committed executed, with its plots"
    start = time.monotonic()
    execute(nb, timeout=TIME_LIMIT_S)  # raises CellExecutionError with the failing cell's traceback
    assert time.monotonic() - start < TIME_LIMIT_S
