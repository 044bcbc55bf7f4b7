"""Cut the course kit from the reference: the student repository and the Gradescope autograder.

The reference holds every solution; what a student clones must hold none. This writes:

    build/release/student/         a repository a student clones: the stubbed technique files
                                   (tools/assignments.py), what they import, the graded tests
                                   (tests/graded/: the tests, their probes, conftest), the
                                   notebooks with every output stripped, the grader and its
                                   sandbox, the regions' table (tools/regions.json), a Makefile
                                   (make demo / test / grade) and a student README
    build/release/autograder.zip   Gradescope's layout: setup.sh and run_autograder at the top,
                                   the same stubs, tests and grader beside them, so a submission
                                   scores the same there as with the student's own `make grade`

Then it searches every released file for the text of each solution region and for the reference's
private answers (the mistakes and alternatives catalogues, tests/notebook_answers.py), and
compares every function it ships with every region, token by token with names left out, so a
helper that re-implements a region under other names is found too: any hit fails the release.

    python tools/release.py               # both, then the leak search (make release)
    python tools/release.py --out DIR     # somewhere else
"""

import argparse
import ast
import functools
import io
import json
import keyword
import os
import re
import shutil
import stat
import sys
import tempfile
import textwrap
import tokenize
import zipfile

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)
import assignments  # noqa: E402
import twins  # noqa: E402

ROOT = assignments.ROOT
TEMPLATES = os.path.join(TOOLS, "student")
AUTOGRADER = os.path.join(TOOLS, "autograder")
TECHNIQUES = ("muon_zero.py", "mhc.py", "cp_compress.py", "tensor_ckpt.py")
# copied as they are; each must hold no solution (the leak search checks)
SUPPORT = (
    "launch.py",
    "requirements.txt",
    "requirements-test.txt",
    "pyproject.toml",
    "tests/graded/__init__.py",
    "tests/graded/conftest.py",
    "tests/graded/expected.py",
    "tests/graded/models_memory_timeline.py",
    "tests/graded/models_muon_zero.py",
    "tests/graded/models_tensor_ckpt.py",
    "tests/graded/references_cp_compress.py",
    "tests/graded/probes/__init__.py",
    "tools/grade.py",
    "tools/grade_plugin.py",
    "tools/assignments.py",
    "tools/sandbox.py",
    "tools/sandbox_child.py",
    "tools/warm_pytest.py",
    "tools/venv.sh",
    "benchmarks/bench_compose.py",  # notebook 05 runs it (a subprocess: no import finds it)
    "docs/GLOSSARY.md",  # the notebooks link to these three
    "docs/EVIDENCE.md",
    "docs/assignments.md",
)
# never released: the reference's private answers, and the V4 oracles (they hold regions' math)
PRIVATE = (
    "tests/mistakes",
    "tests/alternatives",
    "tests/notebook_answers.py",
    "oracles",
)
# only in the autograder zip: the graded tests' independent references (each an answer for the
# region it checks); the student repository's tests read the values they gave, stored beside
AUTOGRADER_ONLY = ("tests/graded/hidden",)
EXPECTED = "tests/graded/stored"  # the values they gave (make expected), released
# what grading on Gradescope does not import (the notebooks' kernel, the linter)
NOT_FOR_GRADING = ("jupyter", "jupytext", "nbclient", "nbformat", "ipykernel", "ruff", "nbstripout")
NOT_FOR_GRADING += ("expecttest",)  # torch.testing's, for an ungraded test file alone
STAMP = ".release"  # marks a folder this script wrote, so it may be written again


# ---- what goes in ----


def _has_grade_mark(path):
    with open(path) as f:
        tree = ast.parse(f.read())
    return any(
        isinstance(n, ast.Attribute)
        and n.attr == "grade"
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == "mark"
        for n in ast.walk(tree)
    )


def graded_test_files(root=ROOT):
    """tests/graded/test_*.py files with a `pytest.mark.grade` in their code (not in a string),
    and the probes each calls (tests/graded/probes/<stem>.py for a test_<stem>.py)."""
    found = []
    graded = os.path.join(root, "tests", "graded")
    for name in sorted(os.listdir(graded)) if os.path.isdir(graded) else []:
        if name.startswith("test_") and name.endswith(".py"):
            if _has_grade_mark(os.path.join(graded, name)):
                found.append(f"tests/graded/{name}")
                probe = f"tests/graded/probes/{name[len('test_') :]}"
                if os.path.exists(os.path.join(root, probe)):
                    found.append(probe)
    return found


def release_sources(root=ROOT):
    """Every reference file the student repository copies (assignment files aside), sorted.

    The support files, the graded tests and their probes, and whatever any of them or the
    notebooks import from the repository (the standard library's modulefinder), followed to its
    end; a private file is never released (the leak search fails on one)."""
    assigned = set(assignments.assignment_files(root))
    wanted = [p for p in SUPPORT if os.path.exists(os.path.join(root, p))]
    wanted += graded_test_files(root)
    scripts = [p for p in wanted if p.endswith(".py")] + sorted(assigned)
    with tempfile.TemporaryDirectory() as tmp:
        for path in notebooks(root):  # a notebook's code cells, as a script modulefinder reads
            script = os.path.join(tmp, os.path.basename(path) + ".py")
            with open(script, "w") as f:
                f.write(ast.unparse(_notebook_tree(os.path.join(root, path))))
            scripts.append((script, os.path.join(root, "notebooks")))  # its kernel starts there
        found = assignments.import_closure(root, scripts)
    files = set(wanted) | set(found)
    package_siblings = {
        os.path.join(os.path.dirname(a), f)
        for a in assigned
        if os.path.dirname(a)
        for f in os.listdir(os.path.join(root, os.path.dirname(a)))
        if f.endswith(".py")
    }
    stored = os.path.join(root, EXPECTED)
    files |= {f"{EXPECTED}/{f}" for f in os.listdir(stored)} if os.path.isdir(stored) else set()
    withheld = PRIVATE + AUTOGRADER_ONLY
    private = {f for f in files if any(f == p or f.startswith(p + "/") for p in withheld)}
    return sorted(files - assigned - package_siblings - private)


def autograder_only_files(root=ROOT):
    """The autograder-only references (AUTOGRADER_ONLY), as relative paths."""
    out = []
    for top in AUTOGRADER_ONLY:
        for folder, _, names in os.walk(os.path.join(root, top)):
            out += [
                os.path.relpath(os.path.join(folder, n), root) for n in names if n.endswith(".py")
            ]
    return sorted(out)


def _notebook_tree(path):
    """A notebook's code cells as one module (IPython's %magic and !shell lines left out)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    code = "\n".join(
        line
        for cell in nb.cells
        if cell.cell_type == "code"
        for line in cell.source.splitlines()
        if not line.lstrip().startswith(("%", "!"))
    )
    return ast.parse(code)


def notebooks(root=ROOT):
    folder = os.path.join(root, "notebooks")
    if not os.path.isdir(folder):
        return []
    return sorted(f"notebooks/{n}" for n in os.listdir(folder) if n.endswith(".ipynb"))


# ---- writing the student repository ----


def strip_notebook(src, dst):
    """Copy a notebook with every output and execution count removed (nbstripout, as a git
    filter would).

    A reference notebook's outputs are the reference solution's results (the numbers a check cell
    expects, the plots a student is asked to predict): none is released."""
    import nbformat
    from nbstripout import strip_output

    nb = nbformat.read(src, as_version=4)
    extra = ["metadata.widgets", "cell.metadata.execution"]
    nbformat.write(strip_output(nb, False, False, True, extra_keys=extra), dst)


def _region_rows(out, regions, root):
    """The student README's table: each region, where its stub sits in the student's file."""
    where = {os.path.basename(f): f for f in assignments.assignment_files(root)}
    rows = ["| file | function | line |", "|---|---|---|"]
    for r in regions:
        with open(os.path.join(out, where[r.file])) as f:
            lines = f.read().splitlines()
        stub = f"raise NotImplementedError({r.message!r})"
        line = next((i for i, text in enumerate(lines, 1) if text.strip() == stub), "?")
        rows.append(f"| `{where[r.file]}` | `{r.qualname.split('.', 1)[1]}` | {line} |")
    return "\n".join(rows)


def _assignment_prose(root):
    """docs/assignments.md's sections (goals, what to implement, hints) under the README's
    heading, without its title, if it exists."""
    path = os.path.join(root, "docs", "assignments.md")
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        text = f.read()
    match = re.search(r"^## .*", text, re.S | re.M)
    return re.sub(r"^## ", "#### ", match.group(0).strip(), flags=re.M) if match else ""


def _prepare(out):
    """An empty ``out``; a folder this script did not write is never emptied."""
    if os.path.isdir(out) and os.listdir(out):
        if not os.path.exists(os.path.join(out, STAMP)):
            sys.exit(
                f"release: {out} exists and was not written by tools/release.py; not touching it"
            )
        shutil.rmtree(out)
    os.makedirs(out)
    with open(os.path.join(out, STAMP), "w") as f:
        f.write(
            "written by tools/release.py from the reference; rerunning it replaces this folder\n"
        )


def write_student_repo(out, root=ROOT):
    """Write the student repository to ``out``; return its files (relative paths), sorted."""
    _prepare(out)
    assignments.write_student(out, root)
    for path in release_sources(root):
        os.makedirs(os.path.join(out, os.path.dirname(path)), exist_ok=True)
        shutil.copy2(os.path.join(root, path), os.path.join(out, path))
    for path in notebooks(root):
        os.makedirs(os.path.join(out, "notebooks"), exist_ok=True)
        strip_notebook(os.path.join(root, path), os.path.join(out, path))
    regions = assignments.all_regions(root)
    with open(os.path.join(out, assignments.REGION_TABLE), "w") as f:
        json.dump(assignments.region_table(regions, root), f, indent=1)
    fill = {
        "{{REGIONS}}": _region_rows(out, regions, root),
        "{{ASSIGNMENTS}}": _assignment_prose(root),
        "{{FILES}}": ", ".join(f"`{f}`" for f in assignments.assignment_files(root)),
    }
    for name in ("README.md", "Makefile", "gitignore"):
        with open(os.path.join(TEMPLATES, name)) as f:
            text = f.read()
        for key, value in fill.items():
            text = text.replace(key, value)
        with open(os.path.join(out, ".gitignore" if name == "gitignore" else name), "w") as f:
            f.write(text)
    return files_of(out)


def files_of(folder):
    """Every file under ``folder``, as sorted relative paths."""
    return sorted(
        os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs
    )


# ---- the Gradescope autograder ----


def grading_requirements(root=ROOT):
    """requirements.txt and requirements-test.txt, pins only, without torch and what grading skips.

    torch comes from the CPU wheel index in setup.sh; the rest from the default index."""
    pins = []
    for name in ("requirements.txt", "requirements-test.txt"):
        with open(os.path.join(root, name)) as f:
            for line in f:
                pin = line.split("#")[0].strip()
                package = re.split(r"[=<>!~\[ ]", pin)[0].lower() if pin else ""
                if pin and package != "torch" and package not in NOT_FOR_GRADING:
                    pins.append(pin)
    return pins


def write_autograder(student, zip_path, root=ROOT):
    """Gradescope's zip: setup.sh and run_autograder at the top, the student repository beside.

    Gradescope unzips it into /autograder/source, runs setup.sh there once when it builds the
    image, and runs /autograder/run_autograder (a copy of ours) for each submission."""
    if os.path.exists(zip_path):
        os.remove(zip_path)
    entries = {}
    for path in files_of(student):
        if path.startswith("notebooks/") or path == STAMP:
            continue
        entries[path] = os.path.join(student, path)
    for name in ("setup.sh", "run_autograder", "gradescope.py"):
        entries[name if name != "gradescope.py" else f"tools/{name}"] = os.path.join(
            AUTOGRADER, name
        )
    for path in autograder_only_files(root):
        entries[path] = os.path.join(root, path)
    requirements = "# installed by setup.sh; torch comes from the CPU wheel index, pinned there\n"
    requirements += "\n".join(grading_requirements(root)) + "\n"
    with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, path in sorted(entries.items()):
            info = zipfile.ZipInfo.from_file(path, name)
            executable = name in ("setup.sh", "run_autograder") or os.access(path, os.X_OK)
            info.external_attr = ((0o755 if executable else 0o644) | stat.S_IFREG) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            with open(path, "rb") as f:
                data = f.read()
            z.writestr(info, data)
        info = zipfile.ZipInfo("requirements-autograder.txt")
        info.external_attr = (0o644 | stat.S_IFREG) << 16
        z.writestr(info, requirements, zipfile.ZIP_DEFLATED)
    return sorted(list(entries) + ["requirements-autograder.txt"])


# ---- the leak search ----

MIN_SIGNATURE = 12  # a line shorter than this (`return x`, `else:`) says nothing of a solution
# a compound statement's header (`for _ in range(iters - 1):`) is a loop any code may hold: the
# lines under it are the solution
HEADER = re.compile(r"^(for|while|if|elif|else|try|except|finally|with|def|class)\b.*:$")


def _significant(line):
    text = line.strip()
    return (
        len(text) >= MIN_SIGNATURE
        and re.search(r"[A-Za-z0-9]", text) is not None
        and not HEADER.match(text)
        and text not in (assignments.BEGIN, assignments.END)  # the markers, not a solution
        and not re.fullmatch(r"return [\w.]+", text)  # `return order`: says nothing
    )


def _given(text, given):
    """A line the student files hold anyway, whole or inside a longer line of theirs."""
    return text in given or any(text in line for line in given)


def solution_signatures(root=ROOT):
    """{stripped line: where it comes from} for every non-trivial line of a solution region, of a
    catalogue's wrong or correct alternative body, and each notebook answer as its filled-in line.
    A line the student files keep outside every region (an argument name, a loop header the stub
    keeps) is given away on purpose and is left out."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        assignments.write_student(tmp, root)
        given = set()
        for name in files_of(tmp):
            with open(os.path.join(tmp, name)) as f:
                given.update(line.strip() for line in f)
    signatures = {}
    where = {os.path.basename(f): f for f in assignments.assignment_files(root)}
    for r in assignments.all_regions(root):
        with open(os.path.join(root, where[r.file])) as f:
            lines = f.read().splitlines()
        for number in range(r.begin, r.end - 1):  # 0-based: the lines between the markers
            text = lines[number].strip()
            if _significant(text) and not _given(text, given):
                signatures.setdefault(text, f"{r.qualname} ({r.file}:{number + 1})")
    for path in private_files(root):
        with open(os.path.join(root, path)) as f:
            tree = ast.parse(f.read())
        for kind, body in catalogued_bodies(tree):  # a catalogue's wrong or correct bodies
            for text in body.splitlines():
                text = text.strip()
                if _significant(text) and not _given(text, given):
                    signatures.setdefault(text, f"{kind} in {path}")
        for variable, answer in notebook_answers(tree):  # the line a filled-in exercise holds
            signatures.setdefault(f"{variable} = {answer}", f"the answer to {variable} ({path})")
    for body in edited_lines(root):
        for text in body.splitlines():
            text = text.strip()
            if _significant(text) and not _given(text, given):
                signatures.setdefault(text, f"{RECORDS['Mistake']} in tests/mistakes")
    return signatures


SHINGLE = 8  # tokens in a shingle
MIN_SHINGLES = 40  # a region with fewer says too little to be recognised by its shape alone
# a withheld reference is an answer however short: a few lines listing every group are enough
MIN_WITHHELD_SHINGLES = 12
OVERLAP = 0.6  # this share of a region's shingles inside one released function: a re-implementation


def shape(source):
    """``source``'s tokens with every name, number and string replaced by its kind (keywords,
    operators and attribute names stay): a body renamed throughout keeps its shape."""
    out, previous = [], None
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type in skip or token.type == tokenize.ENDMARKER:
                continue
            if token.type == tokenize.NAME and not keyword.iskeyword(token.string):
                out.append(token.string if previous == "." else "N")
            elif token.type == tokenize.NUMBER:
                out.append("0")
            elif token.type == tokenize.STRING:
                out.append("S")
            elif token.type == tokenize.NEWLINE:
                out.append(";")
            else:
                out.append(token.string)
            previous = token.string
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return out


def shingles(source):
    tokens = shape(source)
    return {tuple(tokens[i : i + SHINGLE]) for i in range(len(tokens) - SHINGLE + 1)}


def region_shapes(root=ROOT):
    """{qualname: (its shingles, where)} for each region long enough to be known by its shape."""
    where = {os.path.basename(f): f for f in assignments.assignment_files(root)}
    out = {}
    for r in assignments.all_regions(root):
        with open(os.path.join(root, where[r.file])) as f:
            lines = f.read().splitlines()
        body = textwrap.dedent("\n".join(lines[r.begin : r.end - 1]))
        found = shingles(body)
        if len(found) >= MIN_SHINGLES:
            out[r.qualname] = (found, f"{r.file}:{r.begin + 1}")
    return out


def code_units(text):
    """(first line, source) of every function in ``text`` (methods and nested ones included),
    each its whole lines (ast.get_source_segment splits the text again for every node)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, RecursionError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    return [
        (node.lineno, "".join(lines[node.lineno - 1 : node.end_lineno]))
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


@functools.lru_cache(maxsize=1024)
def unit_shingles(text, python):
    """((first line, shingles) of each function of ``text``, or of the whole text unless
    ``python``): kept, since the release is searched with the regions' and the withheld shapes."""
    units = code_units(text) if python else [(1, text)]
    return tuple((line, frozenset(shingles(textwrap.dedent(source)))) for line, source in units)


def reimplementations(folder, shapes):
    """(file, line, what) for each function under ``folder`` that holds most of a region's shape:
    a helper re-implementing a region under other names (or its own copy left in a stub)."""
    hits = []
    for name in files_of(folder):
        if not name.endswith((".py", ".ipynb")):
            continue
        text = searchable_text(os.path.join(folder, name))
        for line, mine in unit_shingles(text, name.endswith(".py")):
            for qualname, (theirs, where) in shapes.items():
                share = len(theirs & mine) / len(theirs)
                if share >= OVERLAP:
                    hits.append(
                        (
                            name,
                            line,
                            f"{qualname} ({where}) re-implemented: {share:.0%} of its shape",
                        )
                    )
    return hits


RECORDS = {"Mistake": "a wrong body", "Alternative": "an alternative body"}


def catalogued_bodies(tree):
    """(kind, text) of the `body=` strings of a module's `Mistake(...)` records (tests/mistakes/)
    and `Alternative(...)` records (tests/alternatives/: a correct body is an answer too)."""
    for node in ast.walk(tree):
        kind = RECORDS.get(getattr(node.func, "id", "")) if isinstance(node, ast.Call) else None
        if kind:
            for keyword in node.keywords:
                if keyword.arg == "body" and isinstance(keyword.value, ast.Constant):
                    yield kind, str(keyword.value.value)


def edited_lines(root):
    """The lines each mistake written as `edits` puts into its region that the reference does not
    hold (its wrong lines), as check-mistakes splices them (tools/grade.py's mistake_body)."""
    import grade

    regions = {r.qualname: r for r in assignments.all_regions(root)}
    for m in grade.load_mistakes(root):
        region = regions.get(m.region)
        if m.body is not None or region is None:
            continue
        kept = {line.strip() for line in grade.reference_body(root, region).splitlines()}
        try:
            body = grade.mistake_body(root, region, m)
        except ValueError:  # an edit that no longer applies: check-mistakes names it
            continue
        yield "\n".join(line for line in body.splitlines() if line.strip() not in kept)


def notebook_answers(tree):
    """(variable, reference answer) of a module's `ANSWERS = {notebook: {variable: (answer,
    wrong answer)}}`, answers written as Python source; none when it has no such table."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "ANSWERS" for t in node.targets
        ):
            try:
                table = ast.literal_eval(node.value)
            except ValueError:
                return
            for exercises in table.values():
                for variable, answers in exercises.items():
                    yield variable, answers[0] if isinstance(answers, (tuple, list)) else answers


def answer_tokens(root=ROOT):
    """{token: where} for each reference answer distinctive enough to search for in prose: a
    number of five digits or more (as written, plainly, with commas) or a literal of 8+ chars."""
    tokens = {}
    for path in private_files(root):
        with open(os.path.join(root, path)) as f:
            tree = ast.parse(f.read())
        for variable, answer in notebook_answers(tree):
            answer, where = str(answer).strip(), f"the answer to {variable} ({path})"
            digits = answer.replace("_", "")
            if digits.isdigit() and len(digits) >= 5:
                for form in {answer, digits, f"{int(digits):,}"}:
                    tokens[form] = where
            elif len(_literal_text(answer)) >= 8:  # "module" is a common word, quotes or not
                tokens[answer] = where
    return tokens


def _literal_text(answer):
    """A string answer's text without its quotes (other answers as written)."""
    try:
        value = ast.literal_eval(answer)
    except (ValueError, SyntaxError):
        return answer
    return value if isinstance(value, str) else answer


def private_files(root=ROOT):
    out = []
    for path in PRIVATE:
        full = os.path.join(root, path)
        if os.path.isfile(full):
            out.append(path)
        elif os.path.isdir(full):
            out += [os.path.join(path, f) for f in sorted(os.listdir(full)) if f.endswith(".py")]
    return out


def searchable_text(path):
    """A released file's text as a reader would see it: a notebook's cells and outputs decoded
    from their JSON, a zip's members one after another."""
    if path.endswith(".zip"):
        with zipfile.ZipFile(path) as z:
            return "\n".join(z.read(n).decode("utf-8", "replace") for n in z.namelist())
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", "replace")
    if path.endswith(".ipynb"):
        import nbformat

        nb = nbformat.reads(text, as_version=4)
        parts = [c.source for c in nb.cells]
        for cell in nb.cells:
            for o in cell.get("outputs", []):
                parts.append(o.get("text", ""))
                parts += [str(v) for v in o.get("data", {}).values()]
        text = "\n".join(parts)
    return text


def _other_code(root):
    """The reference's .py files that are neither assignment files nor withheld ones."""
    skip = {".git", ".venv", "build", "__pycache__", "node_modules"}
    assigned = set(assignments.assignment_files(root))
    withheld = PRIVATE + AUTOGRADER_ONLY
    out = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip and not d.startswith(".")]
        for n in names:
            path = os.path.relpath(os.path.join(folder, n), root)
            if (
                n.endswith(".py")
                and path not in assigned
                and not any(path == p or path.startswith(p + "/") for p in withheld)
            ):
                out.append(path)
    return out


_WITHHELD = {}  # root -> withheld_references' answer: computed once


def withheld_references(root=ROOT):
    """What the student repository must not hold of the autograder-only references: {"names":
    {function name: where}, "lines": {significant line: where}, "shapes": {name: (shingles,
    where)}}. A module's SHARED names (helpers whose code the released files hold too: a probe's
    batch()) are left out, and so are the lines the stubs and the reference's other code hold (an
    optimizer's constructor, a loop header); an independent reference is an answer however
    differently it is written, so its shape is searched for as a region's is (a Sinkhorn pasted
    into sinkhorn_knopp under other names)."""
    if root in _WITHHELD:
        return _WITHHELD[root]
    names, lines, shapes = {}, {}, {}
    _WITHHELD[root] = {"names": names, "lines": lines, "shapes": shapes}
    files = autograder_only_files(root)
    given = set()  # lines the stubs and the reference's other code hold: no answer's own
    if files:
        with tempfile.TemporaryDirectory() as tmp:
            assignments.write_student(tmp, root)
            texts = [searchable_text(os.path.join(tmp, name)) for name in files_of(tmp)]
        texts += [searchable_text(os.path.join(root, path)) for path in _other_code(root)]
        for text in texts:
            given.update(line.strip() for line in text.splitlines())
    for path in files:
        with open(os.path.join(root, path)) as f:
            text = f.read()
        tree = ast.parse(text)
        shared = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "SHARED" for t in node.targets
            ):
                shared = set(ast.literal_eval(node.value))
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.name in shared:
                continue
            where = f"{node.name}, withheld in {path}:{node.lineno}"
            if "_" in node.name.strip("_"):
                names[node.name] = where
            body = [n for n in node.body if not (isinstance(n, ast.Expr) and
                                                 isinstance(n.value, ast.Constant))]  # fmt: skip
            source = textwrap.dedent("\n".join(ast.get_source_segment(text, n) for n in body))
            for line in source.splitlines():
                if _significant(line.strip()) and line.strip() not in given:
                    lines.setdefault(line.strip(), where)
            found = shingles(source)
            if len(found) >= MIN_WITHHELD_SHINGLES:
                shapes[node.name] = (found, where)
    return _WITHHELD[root]


def withheld_leaks(folder, root=ROOT, withheld=None):
    """(file, line, what) for each autograder-only file under ``folder``, each use of a withheld
    reference's name, each line of its body, and each function holding most of its shape."""
    withheld = withheld_references(root) if withheld is None else withheld
    names = withheld["names"]
    # defined or called by name (the tests call them as H.name, which says nothing)
    alternatives = "|".join(map(re.escape, names))
    pattern = re.compile(rf"(?<![.\w])({alternatives})\s*\(" if names else "(?!)")
    hits = []
    for name in files_of(folder):
        if any(name == p or name.startswith(p + "/") for p in AUTOGRADER_ONLY):
            hits.append((name, 0, "an autograder-only reference"))
            continue
        if not name.endswith((".py", ".ipynb", ".md", ".txt", ".json", "Makefile")):
            continue
        content = searchable_text(os.path.join(folder, name))
        anywhere = any(n in content for n in names)  # most name none: the pattern is slow
        for number, line in enumerate(content.splitlines(), 1):
            found = pattern.search(line) if anywhere else None
            if found:
                hits.append((name, number, names[found.group(1)]))
            elif line.strip() in withheld["lines"]:
                hits.append((name, number, withheld["lines"][line.strip()]))
    return hits + reimplementations(folder, withheld["shapes"])


def leaks(folder, root=ROOT, signatures=None, shapes=None, autograder=False):
    """(released file, line, what it reveals) for every solution line found under ``folder``, and
    every function there that re-implements a region (its shape, names aside); unless
    ``autograder`` (the zip, which holds them), every trace of an autograder-only reference."""
    signatures = solution_signatures(root) if signatures is None else signatures
    shapes = region_shapes(root) if shapes is None else shapes
    tokens = answer_tokens(root)
    words = re.compile("|".join(rf"(?<![\w,]){re.escape(t)}(?![\w,])" for t in tokens) or "(?!)")
    long_ones = [s for s in signatures if len(s) >= 2 * MIN_SIGNATURE]
    hits = []
    for name in files_of(folder):
        path = os.path.join(folder, name)
        if "__pycache__" in name.split(os.sep) or name.endswith(".pyc"):
            hits.append((name, 0, "compiled reference code"))
            continue
        if any(name == p or name.startswith(p + "/") for p in PRIVATE):
            hits.append((name, 0, "a private file"))
            continue
        content = searchable_text(path)
        inside = [s for s in long_ones if s in content]  # one search of the file per line known
        anywhere = any(t in content for t in tokens)  # a literal search first: the pattern is slow
        for number, line in enumerate(content.splitlines(), 1):
            text = line.strip()
            word = words.search(text) if anywhere else None
            if text in signatures:
                hits.append((name, number, signatures[text]))
            elif word:
                hits.append((name, number, tokens[word.group(0)]))
            elif len(text) > MIN_SIGNATURE:  # a solution line inside a longer one (a notebook's)
                for sig in (s for s in inside if s in text):
                    hits.append((name, number, signatures[sig]))
                    break
    hits += [] if autograder else withheld_leaks(folder, root)
    return hits + reimplementations(folder, shapes)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "build", "release"), help="where")
    args = parser.parse_args(argv)
    student = os.path.join(args.out, "student")
    os.makedirs(args.out, exist_ok=True)
    files = write_student_repo(student)
    zip_path = os.path.join(args.out, "autograder.zip")
    members = write_autograder(student, zip_path)
    shown = os.path.relpath(args.out)
    print(f"{shown}/student/: {len(files)} files (a repository a student clones)")
    print(f"{shown}/autograder.zip: {len(members)} files (Gradescope: setup.sh, run_autograder)")
    signatures, shapes = solution_signatures(), region_shapes()
    found = leaks(student, signatures=signatures, shapes=shapes)
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(zip_path) as z:
            z.extractall(tmp)
        found += [
            (f"autograder.zip:{n}", line, what)
            for n, line, what in leaks(tmp, ROOT, signatures, shapes, autograder=True)
        ]
    answering = twins.twins(student)  # what answers a region, whatever its text
    found += [(f"{where} (a function)", 0, f"answers {region}") for where, region in answering]
    for name, line, what in found:
        print(f"LEAK {name}:{line}: {what}")
    regions = len(assignments.all_regions())
    print(
        f"leak search: {len(signatures)} solution lines of {regions} regions and the private "
        f"answers, the shapes of {len(shapes)} regions, and every function of the student "
        f"repository called on {len(twins.REGIONS)} pure regions' inputs: {len(found)} found"
    )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
