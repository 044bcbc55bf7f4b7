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
    python tools/assignments.py --out DIR  # elsewhere
    python tools/assignments.py --table    # markdown table: regions, tests, points, needs, order

A student's repository has no markers: tools/release.py ships the regions as a table
(tools/regions.json) that `graded_regions` reads there, so `make grade ONLY=<region>` and the
per-function table work on the stubbed files.

A folder that already holds edited student files is never overwritten: the command says so and
exits 1.
"""

import argparse
import ast
import filecmp
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSIGNMENT_FILES = (  # the notebooks' order: memory_timeline is assignment 1, the others use it
    "memory/memory_timeline.py",
    "muon_zero.py",
    "mhc.py",
    "cp_compress.py",
    "tensor_ckpt.py",
    "compose.py",
    "layouts/compose_budget.py",
)
BEGIN, END, HINT = "### BEGIN SOLUTION", "### END SOLUTION", "# hint:"
REGION_TABLE = os.path.join("tools", "regions.json")  # the student repository's, written by release


@dataclass
class Region:
    """One marked body: lines ``begin``..``end`` (1-based, the marker lines) of ``file``."""

    file: str  # file name, e.g. "mhc.py"
    qualname: str  # "FILESTEM.qualname", what a graded test's `solution=` names
    begin: int
    end: int
    indent: str
    message: str  # what the student's NotImplementedError says
    student_line: int = 0  # the line of its `raise NotImplementedError` in the student file


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
    removed = 0  # each region above this one shrank to its one-line raise
    for r in regions:
        r.student_line = r.begin - removed
        removed += r.end - r.begin
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
    table = os.path.join(root, REGION_TABLE)
    if os.path.exists(table):  # a student's repository: the files are stubs, without markers
        with open(table) as f:
            found += [r["path"] for r in json.load(f) if r["path"] not in found]
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and name not in found:
            with open(os.path.join(root, name)) as f:
                if any(line.strip() == BEGIN for line in f):
                    found.append(name)
    return found


def all_regions(root=ROOT, files=None):
    return [r for f in assignment_files(root, files) for r in find_regions(os.path.join(root, f))]


def graded_regions(root=ROOT):
    """The regions: from the markers (the reference), else from the shipped table (a student's
    repository and the autograder, whose files are stubs)."""
    found = all_regions(root)
    table = os.path.join(root, REGION_TABLE)
    if found or not os.path.exists(table):
        return found
    with open(table) as f:
        rows = json.load(f)
    return [
        Region(r["file"], r["qualname"], r["line"], r["line"], "", r["message"], r["line"])
        for r in rows
    ]


def assignment_paths(root=ROOT):
    """{base name: path as assignment_files gives it}: a region names its file by base name
    (memory_timeline.py), the tree holds memory/memory_timeline.py."""
    return {os.path.basename(f): f for f in assignment_files(root)}


def region_table(regions, root=ROOT):
    """What tools/regions.json holds: each region's file (and its path), name, stub line and
    message."""
    paths = assignment_paths(root)
    return [
        {
            "file": r.file,
            "path": paths.get(r.file, r.file),
            "qualname": r.qualname,
            "line": r.student_line,
            "message": r.message,
        }
        for r in regions
    ]


def _finder(path):
    """The standard library's ModuleFinder, also for a folder without __init__.py (which it
    cannot read: a namespace package)."""
    import modulefinder

    class Finder(modulefinder.ModuleFinder):
        def find_module(self, name, path, parent=None):
            try:
                return super().find_module(name, path, parent)
            except AttributeError:
                for base in path if path is not None else self.path:
                    if os.path.isdir(os.path.join(base, name)):
                        return None, os.path.join(base, name), ("", "", modulefinder._PKG_DIRECTORY)
                raise ImportError(name) from None

        def load_package(self, fqname, pathname):
            if os.path.exists(os.path.join(pathname, "__init__.py")):
                return super().load_package(fqname, pathname)
            module = self.add_module(fqname)
            module.__path__ = [pathname]
            return module

    return Finder(path=path)


def import_closure(root, scripts):
    """The repository files that ``scripts`` import, followed to the end: the standard library's
    modulefinder, searching the repository alone (torch and the standard library are not
    followed). A script is a path relative to ``root`` (its folder is searched first, as Python
    does), or (path, the folder it runs in). Paths relative to ``root``, the scripts included."""
    root, found = os.path.abspath(root), set()
    for script in scripts:
        path, folder = script if isinstance(script, tuple) else (script, None)
        path = os.path.join(root, path)
        finder = _finder([folder or os.path.dirname(path), root])
        finder.run_script(path)
        for module in finder.modules.values():
            name = getattr(module, "__file__", None)
            if name and os.path.abspath(name).startswith(root + os.sep):
                found.add(os.path.relpath(os.path.abspath(name), root))
    return sorted(found)


def support_files(root=ROOT):
    """The repository files the assignment files import (launch.py, models/, interop/, ...): what a
    grading stages beside them. Never a test or a tool."""
    names = assignment_files(root)
    return [
        f
        for f in import_closure(root, names)
        if f not in names and not f.startswith(("tests" + os.sep, "tools" + os.sep))
    ]


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


def edited(out, root=ROOT, files=None):
    """The assignment files in ``out`` that differ from what write_student would write there."""
    with tempfile.TemporaryDirectory() as fresh:
        names = write_student(fresh, root, files)
        return [
            n
            for n in names
            if os.path.exists(os.path.join(out, n))
            and not filecmp.cmp(os.path.join(out, n), os.path.join(fresh, n), shallow=False)
        ]


IMPORT_EACH = r"""
import json, os, sys
import torch  # imported once: each file is then imported in a forked child of its own
failures = {}
for name, module in json.loads(sys.argv[1]).items():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            assert __import__(module, fromlist=["_"]).__file__
            code, why = 0, ""
        except BaseException as error:
            code, why = 1, f"{type(error).__name__}: {error}".strip().splitlines()[-1]
        os.write(write, why.encode("utf-8", "replace"))
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        why = f.read().decode("utf-8", "replace")
    _, status = os.waitpid(pid, 0)
    if status:
        failures[name] = why or f"the import ended with status {status}"
print("\n" + json.dumps(failures))  # on a line of its own, whatever a file printed
"""


def check_imports(out, names):
    """Import each student file in an interpreter started in ``out`` (each in a forked child of
    one that imported torch, so no file sees another's); return {name: why} of the failures."""
    modules = {name: os.path.splitext(name)[0].replace(os.sep, ".") for name in names}
    env = dict(os.environ, PYTHONPATH=os.path.abspath(out), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, json.dumps(modules)],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=120 + 30 * len(names),
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or ["the import check itself failed"])[-1]
        return {name: last for name in names}
    return json.loads(lines[-1])


def dependencies(regions, graded):
    """qualname -> the other regions its graded tests need (their markers' `needs=`), in order."""
    known = [r.qualname for r in regions]
    deps = {}
    for r in regions:
        needed = {n for g in graded if r.qualname in g["solutions"] for n in g.get("needs", ())}
        deps[r.qualname] = [q for q in known if q in needed and q != r.qualname]
    return deps


def implementation_order(regions, graded):
    """The regions in an order that puts each after every region it needs (else file order)."""
    deps, done, order = dependencies(regions, graded), set(), []

    def visit(qualname, path):
        if qualname in done or qualname in path:  # a cycle: file order decides
            return
        for need in deps.get(qualname, ()):
            visit(need, path | {qualname})
        done.add(qualname)
        order.append(qualname)

    for r in regions:
        visit(r.qualname, set())
    return order


def _short(qualname, file_stem):
    stem, rest = qualname.split(".", 1)
    return rest if stem == file_stem else qualname


def table(regions, graded):
    """Markdown table of regions, the graded tests naming each, their points and dependencies,
    then the order to implement them in; line numbers are the student file's.

    ``graded`` is a list of dicts with ``nodeid``, ``points``, ``solutions``, ``needs``
    (grade.collect()).
    """
    deps = dependencies(regions, graded)
    rows = [
        "| file | function (line in the student file) | graded tests | points | needs |",
        "|---|---|---|---|---|",
    ]
    total = 0
    for r in regions:
        tests = [g for g in graded if r.qualname in g["solutions"]]
        points = sum(g["points"] for g in tests)
        total += points
        names = "<br>".join(f"`{g['nodeid'].split('::', 1)[-1]}`" for g in tests) or "**none**"
        stem = r.qualname.split(".", 1)[0]
        needs = ", ".join(f"`{_short(q, stem)}`" for q in deps[r.qualname]) or "-"
        rows.append(
            f"| `{r.file}` | `{_short(r.qualname, stem)}` (line {r.student_line}) | {names} "
            f"| {points} | {needs} |"
        )
    rows.append(f"| **total** | {len(regions)} regions | {len(graded)} graded tests | {total} | |")
    rows += [
        "",
        "Order to implement them in (each region after the regions it needs, where one can be):",
        "",
    ]
    order = implementation_order(regions, graded)
    for name in dict.fromkeys(r.file for r in regions):
        stem = os.path.splitext(name)[0]
        mine = [q for q in order if next(r for r in regions if r.qualname == q).file == name]
        line = f"- `{name}`: " + " → ".join(f"`{_short(q, stem)}`" for q in mine)
        mutual = [(a, b) for i, a in enumerate(mine) for b in mine[i + 1 :] if _mutual(deps, a, b)]
        for a, b in mutual:  # no order puts each after the other: say so instead
            line += f" (`{_short(a, stem)}` and `{_short(b, stem)}` need each other: write both)"
        rows.append(line)
    return "\n".join(rows)


def _mutual(deps, a, b):
    return b in deps.get(a, ()) and a in deps.get(b, ())


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
        from grade_plugin import collect  # runs pytest over tests/graded; imports no grade.py

        print(table(regions, collect(args.root)))
        return 0
    changed = edited(args.out, args.root)
    if changed:  # a student's work: never overwrite it
        shown = os.path.relpath(args.out, os.getcwd())
        print(
            f"{shown}/ holds edits ({', '.join(changed)} differ from the stubs): left as it is.\n"
            f"Grade it with `make grade SUBMISSION={shown}`; for fresh stubs, write them "
            f"elsewhere (`make assignments OUT={shown}-new`) or move {shown}/ away first."
        )
        return 1
    names = write_student(args.out, args.root)
    for name in names:
        count = sum(r.file == os.path.basename(name) for r in regions)
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
