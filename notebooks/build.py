"""Build the companion notebooks from their sources and execute them.

Each notebook's source of truth is a plain script in notebooks/src/ in "percent" format: a line
``# %%`` starts a code cell, ``# %% [markdown]`` starts a markdown cell whose lines are ``# ``-commented.
Plain scripts diff and review well; the executed .ipynb beside them is what a reader opens on the web.

    python notebooks/build.py                 # every notebook
    python notebooks/build.py 00_first_step   # the ones whose name contains this
"""
import os
import sys

import nbformat
from nbclient import NotebookClient

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def script_to_notebook(text):
    cells, kind, lines = [], None, []

    def flush():
        if kind is None:
            return
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(l[2:] if l.startswith("# ") else l.lstrip("#") for l in body.splitlines())
            cells.append(nbformat.v4.new_markdown_cell(body))
        elif body:
            cells.append(nbformat.v4.new_code_cell(body))

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        else:
            lines.append(line)
    flush()
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def execute(nb, timeout=600):
    """Run every cell in a fresh kernel whose working directory is the repository root."""
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": ROOT}}).execute()
    return nb


def build(source):
    name = os.path.splitext(os.path.basename(source))[0]
    with open(source) as f:
        nb = execute(script_to_notebook(f.read()))
    target = os.path.join(HERE, name + ".ipynb")
    nbformat.write(nb, target)
    print(f"built {os.path.relpath(target, ROOT)}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    src = os.path.join(HERE, "src")
    wanted = sys.argv[1:]
    for fname in sorted(os.listdir(src)):
        if fname.endswith(".py") and (not wanted or any(w in fname for w in wanted)):
            build(os.path.join(src, fname))
