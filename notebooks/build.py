"""Build the companion notebooks from their sources and execute them.

Each notebook's source of truth is a plain script in notebooks/src/ in jupytext's "percent"
format (`# %%` starts a code cell, `# %% [markdown]` a markdown cell of `# `-commented lines).
Scripts diff and review well; the executed .ipynb beside them is what a reader opens on the web.
jupytext reads the script, nbclient runs it in a fresh kernel whose working directory is
notebooks/, as when a student opens it in Jupyter (the venv's .pth makes the files importable).

    python notebooks/build.py                 # every notebook
    python notebooks/build.py 00_first_step   # the ones whose name contains this
"""

import os
import sys
import time

import jupytext
import nbformat
from nbclient import NotebookClient

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SOURCES = os.path.join(HERE, "src")
KERNEL = {"name": "python3", "display_name": "Python 3", "language": "python"}


def read_source(path):
    """The notebook a percent-format script describes (cells only, not yet executed)."""
    nb = jupytext.read(path, fmt="py:percent")
    nb.metadata["kernelspec"] = KERNEL
    nb.metadata.pop("jupytext", None)  # the pairing lives here, not in every notebook
    return nb


def execute(nb, timeout=600, cwd=HERE):
    """Run every cell in a fresh kernel started in ``cwd`` (notebooks/, as Jupyter does)."""
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": cwd}}
    )
    client.execute()
    return nb


def sources():
    """Every notebook source, sorted by name."""
    return sorted(os.path.join(SOURCES, f) for f in os.listdir(SOURCES) if f.endswith(".py"))


def build(source):
    name = os.path.splitext(os.path.basename(source))[0]
    start = time.monotonic()
    nb = execute(read_source(source))
    target = os.path.join(HERE, name + ".ipynb")
    nbformat.write(nb, target)
    took = time.monotonic() - start
    print(f"built {os.path.relpath(target, ROOT)} in {took:.0f} s", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    wanted = sys.argv[1:]
    for path in sources():
        if not wanted or any(w in os.path.basename(path) for w in wanted):
            build(path)
