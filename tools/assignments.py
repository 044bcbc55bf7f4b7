"""Turn the reference files into assignments: the student versions, and the table of what is graded.

In a reference file, the body a student writes sits between two marker lines inside a function,
as nbgrader marks them; an optional `# hint: ...` line directly above BEGIN stays in the student
version:

    def sinkhorn_knopp(logits, iters):
        \"\"\"Project onto doubly stochastic matrices by alternating row and column scaling.\"\"\"
        # hint: exp first, then normalise rows and columns in turn, `iters` times
        ### BEGIN SOLUTION
        ...
        ### END SOLUTION

The student version replaces each region, markers included, by one line at the region's indentation,
`raise NotImplementedError("<qualname>: <hint, or the docstring's first line>")`; every other byte
is the reference's. Usage:

    python tools/assignments.py            # write build/student/, check each file imports
    python tools/assignments.py --table    # markdown table: regions, graded tests, points
"""

import argparse
import ast
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSIGNMENT_FILES = (
    "muon_zero.py",
    "mhc.py",
    "cp_compress.py",
    "tensor_ckpt.py",
    "memory/memory_timeline.py",
)
BEGIN, END, HINT = "### BEGIN SOLUTION", "### END SOLUTION", "# hint:"


@dataclass
class Region:
    """One marked body: lines ``begin``..``end`` (1-based, the marker lines) of ``file``."""

    file: str  # file name, e.g. "mhc.py"
    qualname: str  # "FILESTEM.qualname", what a graded test's `solution=` names
    begin: int
    end: int
    indent: str
    message: str  # what the student's NotImplementedError says


def _functions(tree, stem):
    """(first line, last line, qualname, docstring) of every function, methods included."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                out.append((child.lineno, child.end_lineno, name, ast.get_docstring(child)))
                visit(child, name)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}.{child.name}")
            else:
                visit(child, prefix)

    visit(tree, stem)
    return out


def find_regions(path):
    """Every marked region of the file at ``path``, in order; a malformed marking raises."""
    with open(path) as f:
        text = f.read()
    lines = text.splitlines()
    name, stem = os.path.basename(path), os.path.splitext(os.path.basename(path))[0]
    functions = _functions(ast.parse(text, filename=path), stem)
    regions, begin = [], None
    for number, line in enumerate(lines, 1):
        marker = line.strip()
        if marker == BEGIN:
            if begin is not None:
                raise ValueError(
                    f"{name}:{number}: BEGIN SOLUTION inside the region of line {begin}"
                )
            begin = number
        elif marker == END:
            if begin is None:
                raise ValueError(f"{name}:{number}: END SOLUTION without a BEGIN SOLUTION")
            regions.append(_region(name, lines, functions, begin, number))
            begin = None
    if begin is not None:
        raise ValueError(f"{name}:{begin}: BEGIN SOLUTION is never closed")
    return regions


def _region(name, lines, functions, begin, end):
    inside = [f for f in functions if f[0] < begin <= f[1]]  # END may trail the last statement
    if not inside:
        raise ValueError(f"{name}:{begin}: a solution region must sit inside a function body")
    _, _, qualname, doc = max(inside, key=lambda f: f[0])  # the innermost function
    indent = lines[begin - 1][: len(lines[begin - 1]) - len(lines[begin - 1].lstrip())]
    if lines[end - 1][: len(indent)] != indent or lines[end - 1].strip() != END:
        raise ValueError(f"{name}:{end}: END SOLUTION must have its BEGIN's indentation")
    hints, above = [], begin - 2
    while above >= 0 and lines[above].strip().startswith(HINT):
        hints.insert(0, lines[above].strip()[len(HINT) :].strip())
        above -= 1
    first_doc_line = (doc or "").strip().splitlines()[0] if (doc or "").strip() else ""
    message = " ".join(hints) or first_doc_line or "write this part"
    return Region(name, qualname, begin, end, indent, f"{qualname}: {message}")


def stub_text(text, regions, only=None):
    """``text`` with each region (or each whose qualname is in ``only``) replaced by its raise."""
    lines = text.splitlines(keepends=True)
    for r in sorted(regions, key=lambda r: r.begin, reverse=True):
        if only is None or r.qualname in only:
            newline = "\n" if lines[r.end - 1].endswith("\n") else ""
            lines[r.begin - 1 : r.end] = [
                f"{r.indent}raise NotImplementedError({r.message!r}){newline}"
            ]
    return "".join(lines)


def assignment_files(root=ROOT, files=None):
    """The assignment files under ``root``: ASSIGNMENT_FILES, and any root file with a region."""
    if files:
        return [f for f in files if os.path.exists(os.path.join(root, f))]
    found = [f for f in ASSIGNMENT_FILES if os.path.exists(os.path.join(root, f))]
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and name not in found:
            with open(os.path.join(root, name)) as f:
                if any(line.strip() == BEGIN for line in f):
                    found.append(name)
    return found


def all_regions(root=ROOT, files=None):
    return [r for f in assignment_files(root, files) for r in find_regions(os.path.join(root, f))]


def write_student(out, root=ROOT, files=None, only=None):
    """Write each assignment file to ``out``: all regions stubbed, or only those in ``only``.

    ``only`` is a set of qualnames; files without one of them are copied unchanged.
    Returns the file names written.
    """
    os.makedirs(out, exist_ok=True)
    written = []
    for name in assignment_files(root, files):
        path = os.path.join(root, name)
        package = os.path.dirname(name)
        if package:  # the package's other modules come along, so it imports from ``out`` alone
            os.makedirs(os.path.join(out, package), exist_ok=True)
            for other in os.listdir(os.path.join(root, package)):
                if other.endswith(".py") and os.path.join(package, other) != name:
                    shutil.copy(os.path.join(root, package, other), os.path.join(out, package))
        with open(path) as f:
            text = f.read()
        with open(os.path.join(out, name), "w") as f:
            f.write(stub_text(text, find_regions(path), only))
        written.append(name)
    return written


def check_imports(out, names):
    """Import each student file in a fresh interpreter started in ``out``; return the failures."""
    failures = {}
    for name in names:
        module = os.path.splitext(name)[0].replace(os.sep, ".")
        env = dict(os.environ, PYTHONPATH=os.path.abspath(out), CUDA_VISIBLE_DEVICES="")
        proc = subprocess.run(
            [sys.executable, "-c", f"import {module}; assert {module}.__file__"],
            cwd=out,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            failures[name] = proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"
    return failures


def table(regions, graded):
    """Markdown table of regions with the graded tests naming each and their points.

    ``graded`` is a list of dicts with ``nodeid``, ``points``, ``solutions`` (grade.collect()).
    """
    rows = ["| file | function (region) | graded tests | points |", "|---|---|---|---|"]
    total = 0
    for r in regions:
        tests = [g for g in graded if r.qualname in g["solutions"]]
        points = sum(g["points"] for g in tests)
        total += points
        names = "<br>".join(f"`{g['nodeid'].split('::', 1)[-1]}`" for g in tests) or "**none**"
        short = r.qualname.split(".", 1)[1]
        rows.append(f"| `{r.file}` | `{short}` (line {r.begin}) | {names} | {points} |")
    rows.append(f"| **total** | {len(regions)} regions | {len(graded)} graded tests | {total} |")
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", default=os.path.join(ROOT, "build", "student"), help="where to write"
    )
    parser.add_argument("--root", default=ROOT, help="the reference repository (default: this one)")
    parser.add_argument("--table", action="store_true", help="print the markdown table and stop")
    args = parser.parse_args(argv)
    regions = all_regions(args.root)
    if args.table:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from grade import collect

        print(table(regions, collect(args.root)))
        return 0
    names = write_student(args.out, args.root)
    for name in names:
        count = sum(r.file == name for r in regions)
        where = os.path.join(os.path.relpath(args.out, os.getcwd()), name)
        print(f"{where}: {count} region(s) stubbed")
    failures = check_imports(args.out, names)
    for name, error in failures.items():
        print(f"FAILED to import {name}: {error}")
    if not regions:
        print("no solution regions found: the student files are copies of the reference")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
