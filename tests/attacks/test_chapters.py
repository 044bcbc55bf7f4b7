"""Hostile versions of the seven real assignment files, graded through the released autograder zip
as Gradescope grades them: as root, with the venv its setup.sh made (conftest.py), in a container of
Gradescope's default size (768 MB, half a CPU: a cgroup).

A case is a file with a `# file:` line (tests/attacks/chapters/*.py, or tests/attacks/*.py):
hostile code put after (`# where: suffix`) or before (`# where: prefix`) that assignment file's
stub or reference (`# target:`). `# paste: PATH::NAME` puts the function NAME of the released
student repository's PATH in front of the code, when the repository holds it (an answer a student
could paste); `# generated: NAME` puts GENERATED[NAME]() there; `# include: PATH` puts the file
PATH (under tests/attacks/) after the code, shared by several cases. Last round's attacks on the
two-file course (test_attacks.py) that try to raise a score join as one case, in front of a stub.

Cases are graded together, at most one per file in a grading, and a grading with a case on a
reference keeps a witness (a file without a case that imports none with one); a case that finds
no room opens another grading (about two to three minutes each on half a CPU). In each: the
grading writes results.json listing every graded test with its points; a file with hostile code
scores no more than the same file without it (a stub scores zero: test_release's student
repository test grades the stubs); every witness scores what it scores alone (the reference:
every point); nothing of the sandbox user is left (a process, System V IPC, a file in
/dev/shm); no hidden file's text reaches the feedback. The other engineers' cases of forged probe
values are in chapters/ (mhc, muon_zero, cp_compress: they share the one grading) and forged/
(tensor_ckpt and memory_timeline: they would open a second grading, so they run with
ATTACKS_ALL=1). Answers pasted from the student repository are the release's leak search's
(tests/test_release.py): the repository holds no reference to paste.
"""

import ast
import json
import os
import pwd
import re
import shutil
import sys
import tempfile
from collections import namedtuple

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import assignments  # noqa: E402
import measure_grading  # noqa: E402
import sandbox  # noqa: E402
from grade_plugin import collect  # noqa: E402

MEMORY, CPUS = 768 * 2**20, 0.5  # Gradescope's default container
SECRET = "HIDDEN-REFERENCE-TEXT-2718"
# last round's attacks on the two-file course that try to raise a score from a worker, put
# together in front of one stub (each ends without raising: the next one runs)
LAST_ROUND = ("report_patch", "plugin_writer", "forged_events", "detached_rewrite")
LAST_ROUND_FILE = "compose.py"
GENERATED = {"deep_expression": lambda: "x = " + " + ".join(["1"] * 20_000) + "\n"}

Case = namedtuple("Case", "name file target where text")


def _header(text, key):
    return re.findall(rf"^# {key}: (.+)$", text, re.M)


def _cases():
    """Every case with a `# file:` line, then last round's attacks as one case."""
    found = []
    folders = ["chapters"] + (["forged"] if os.environ.get("ATTACKS_ALL") else [])
    paths = [os.path.join(HERE, d, f) for d in folders for f in os.listdir(os.path.join(HERE, d))]
    paths += [os.path.join(HERE, f) for f in os.listdir(HERE) if not f.startswith("test_")]
    for path in sorted(p for p in paths if p.endswith(".py") and "conftest" not in p):
        with open(path) as f:
            text = f.read()
        if _header(text, "file"):
            name = os.path.splitext(os.path.basename(path))[0]
            target, where = _header(text, "target")[0], _header(text, "where")[0]
            found.append(Case(name, _header(text, "file")[0], target, where, text))
    texts = []
    for name in LAST_ROUND:
        with open(os.path.join(HERE, f"{name}.py")) as f:
            texts.append(f.read())
    found.append(Case("last_round", LAST_ROUND_FILE, "stub", "prefix", "\n".join(texts)))
    return found


def _witnesses(group, importers):
    """The files of a grading that hold no case and import none that does: they must score in
    full, whatever the cases did (a leak that outlived its call would sink them)."""
    hostile = {_stem(n) for n in group}
    return {
        s for s in importers if s not in hostile and not any(s in importers[h] for h in hostile)
    }


def _gradings(cases, importers):
    """The cases packed into gradings, at most one per file in each, and a grading that holds a
    case on a reference keeps a witness."""
    out = []
    for case in cases:
        for group in out:
            joined = {**group, case.file: case}
            sinking = any(c.target == "reference" for c in joined.values())
            if case.file not in group and (_witnesses(joined, importers) or not sinking):
                group[case.file] = case
                break
        else:
            out.append({case.file: case})
    return out


def _importers(files):
    """stem -> the stems of the assignment files that import it, directly or not."""
    stems = {_stem(f) for f in files}
    imports = {}
    for f in files:
        with open(os.path.join(ROOT, f)) as handle:
            tree = ast.parse(handle.read())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imports[_stem(f)] = {m.split(".")[-1] for m in names} & stems - {_stem(f)}
    closure = {s: set(i) for s, i in imports.items()}
    for _ in stems:
        for s in closure:
            closure[s] |= {k for i in closure[s] for k in closure.get(i, ())}
    return {s: {t for t in stems if s in closure[t]} for s in stems}


def _stem(name):
    return os.path.splitext(os.path.basename(name))[0]


IMPORTERS = _importers(assignments.assignment_files(ROOT))
GRADINGS = _gradings(_cases(), IMPORTERS)
NAMES = ["+".join(c.name for c in g.values()) for g in GRADINGS]


def _function(path, name):
    """The source of the top-level function ``name`` in ``path``, or "" when there is none."""
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        text = f.read()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(text, node) + "\n"
    return ""


def _hostile(case, base, student):
    """``base`` (the file's stub or reference text) with the case's code added."""
    code = "".join(GENERATED[n]() for n in _header(case.text, "generated"))
    for where in _header(case.text, "paste"):
        path, name = where.split("::")
        code += "\n\n" + _function(os.path.join(student, path), name)
    code += "\n\n" + case.text
    for shared in _header(case.text, "include"):  # code several cases share, after their own
        with open(os.path.join(HERE, shared)) as f:
            code += "\n\n" + f.read()
    return code + "\n" + base if case.where == "prefix" else base + "\n\n" + code


@pytest.fixture(scope="module")
def graded_tests(chapters_kit):
    """nodeid -> points of every graded test the zip holds."""
    return {g["nodeid"]: g["points"] for g in collect(ROOT)}


def _grade(source, venv, files):
    """run_autograder on the submission ``files`` (name -> text) as root in the container;
    returns (results, processes left in the cgroup, output)."""
    root = tempfile.mkdtemp(prefix="autograder-")
    os.chmod(root, 0o755)
    shutil.copytree(source, os.path.join(root, "source"), symlinks=True)
    with open(os.path.join(root, "source", "hidden_reference.txt"), "w") as f:
        f.write(SECRET + "\n")
    os.makedirs(os.path.join(root, "submission"))
    for name, text in files.items():
        with open(os.path.join(root, "submission", os.path.basename(name)), "w") as f:
            f.write(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADE_", "PYTHON"))}
    env.update(AUTOGRADER_ROOT=root, AUTOGRADER_VENV=venv, GRADE_SANDBOX_USER=sandbox.USER)
    try:
        code, out, peaks, _ = measure_grading.run_limited(
            ["bash", os.path.join(root, "source", "run_autograder")], MEMORY, CPUS, env=env
        )
        assert code == 0, out[-3000:]
        with open(os.path.join(root, "results", "results.json")) as f:
            return json.load(f), peaks["left"], out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _left_of(uid):
    """What the sandbox user still holds: processes, System V IPC, files in /dev/shm."""
    left = [f"process {p}" for p in sandbox._pids() if sandbox._owner(p) == uid]
    left += [f"{kind} {ident}" for kind, ident in sandbox.ipc_of(uid)]
    for entry in os.scandir("/dev/shm"):
        if entry.stat(follow_symlinks=False).st_uid == uid:
            left.append(entry.path)
    return left


@pytest.mark.slow  # a whole grading of the seven files in Gradescope's container
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    "cases", GRADINGS, ids=["+".join(c.name for c in g.values()) for g in GRADINGS]
)
def test_hostile_chapters_score_no_more_than_the_honest_files(
    chapters_kit, autograder_venv, graded_tests, cases
):
    student, source = chapters_kit
    files = assignments.assignment_files(ROOT)
    submitted = {}
    for name in files:
        case = cases.get(name)
        with open(os.path.join(student if case and case.target == "stub" else ROOT, name)) as f:
            submitted[name] = f.read()
        if case:
            submitted[name] = _hostile(case, submitted[name], student)
    results, left, out = _grade(source, autograder_venv, submitted)
    label = ", ".join(f"{c.name} in {c.target} {n}" for n, c in cases.items())
    assert not left, f"processes outlived run_autograder (one could rewrite results.json): {left}"
    listed = {t["name"].split(": ", 1)[-1]: t for t in results["tests"]}
    missing = sorted(set(graded_tests) - set(listed))
    assert not missing, f"results.json lacks graded tests ({label}): {missing[:5]}\n{out[-3000:]}"
    wrong = [n for n, p in graded_tests.items() if listed[n]["max_score"] != p]
    assert not wrong, f"results.json gives graded tests other points: {wrong[:5]}"
    scores = {}
    for t in results["tests"]:
        stem = t["name"].split(".", 1)[0]
        got, most = scores.get(stem, (0, 0))
        scores[stem] = (got + t["score"], most + t["max_score"])
    stems = {_stem(n): c for n, c in cases.items()}
    witnesses = _witnesses(cases, IMPORTERS)
    wrong = []
    for stem, (got, most) in scores.items():
        if stem in stems and stems[stem].target == "stub" and got:  # a stub scores zero
            wrong.append(f"{stem}.py earned {got} of {most} with {stems[stem].name}")
        elif stem in witnesses and got < most:
            wrong.append(f"{stem}.py lost points to the others: {got} of {most}")
    assert not wrong, f"{'; '.join(wrong)} ({label})\n{out[-3000:]}"
    assert SECRET not in json.dumps(results) and SECRET not in out, "a hidden file was read"
    uid = pwd.getpwnam(sandbox.USER).pw_uid
    assert not _left_of(uid), f"{sandbox.USER} left behind: {_left_of(uid)}"
