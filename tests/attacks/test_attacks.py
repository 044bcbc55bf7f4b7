"""Hostile submissions, each run through the autograder zip the way Gradescope runs it.

Each file beside this one is an attack: hostile code put in front of (`# where: prefix`) or after
(`# where: suffix`) one assignment file, its stub or its reference (`# target:`). A small course of
two assignment files is built here (alpha.py, two graded functions, one on two gloo ranks; beta.py,
which imports alpha as compose.py imports the chapters), released with tools/release.py, and its
zip graded with the virtualenv the release's setup.sh made (its own Python, no development .pth;
the sandbox user made) as root, as Gradescope does (conftest.py). Every attack is then graded by
run_autograder, as root, inside a memory cgroup: its score is at most the honest score of the same
files, beta.py scores in full, results.json is written and no process outlives run_autograder in
the cgroup (none is left to rewrite it), none of the sandbox user's anywhere, and no hidden file's
text reaches the feedback.

test_chapters.py grades the real chapters' hostile versions the same way.
"""

import json
import os
import pwd
import re
import shutil
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import assignments  # noqa: E402
import measure_grading  # noqa: E402
import release  # noqa: E402
import sandbox  # noqa: E402


def _is_attack(name):
    """An attack on this two-file course: a `# target:` line and no `# file:` line (a case of
    test_chapters.py, graded on the real chapters)."""
    if not name.endswith(".py") or name.startswith("test_") or name == "conftest.py":
        return False
    with open(os.path.join(HERE, name)) as f:
        text = f.read()
    return bool(re.search(r"^# target: ", text, re.M)) and not re.search(r"^# file: ", text, re.M)


ATTACKS = sorted(f[:-3] for f in os.listdir(HERE) if _is_attack(f))
SECRET = "HIDDEN-REFERENCE-TEXT-3141"
MEMORY = 1536 * 2**20  # the cgroup every run is graded in (a memory hog stops there)
TIMEOUT_S = 150  # run_autograder's limit, well above the two-file course's honest grading

ALPHA = '''\
"""alpha: two graded functions, one of them on every rank."""

import torch.distributed as dist


def double(x):
    """Twice x."""
    ### BEGIN SOLUTION
    return 2 * x
    ### END SOLUTION


def total(x):
    """The sum of x over the ranks."""
    ### BEGIN SOLUTION
    dist.all_reduce(x)
    return x
    ### END SOLUTION
'''

BETA = '''\
"""beta: imports alpha, as compose.py imports the chapters; its own function needs nothing."""

import alpha  # noqa: F401
from alpha import double  # noqa: F401


def triple(x):
    """Three times x."""
    ### BEGIN SOLUTION
    return 3 * x
    ### END SOLUTION
'''

# each call's timeout is short (an honest call takes well under a second): a hang costs only that
TEST_ALPHA = """\
import pytest
import torch
from sandbox import call, on_ranks


@pytest.mark.grade(points=2, solution="alpha.double")
def test_double():
    x = torch.arange(4.0)
    assert torch.equal(call("alpha:double", x, timeout=20), 2 * x), "double(x) must be 2 x"


@pytest.mark.grade(points=3, solution="alpha.total")
def test_total_on_two_ranks():
    assert on_ranks("alpha:total", 2, timeout=30) == [1.0, 1.0], "total must sum the ranks"
"""

PROBE_ALPHA = """\
import torch

import alpha


def double(x):
    return alpha.double(x)


def total(rank, world_size):
    return alpha.total(torch.tensor([float(rank)])).item()
"""

TEST_BETA = """\
import pytest
import torch
from sandbox import call


@pytest.mark.grade(points=2, solution="beta.triple")
def test_triple():
    assert call("beta:triple", 5, timeout=20) == 15, "triple(5) must be 15"


@pytest.mark.grade(points=1, solution="beta.triple")
def test_triple_of_a_tensor():
    assert torch.equal(call("beta:triple", torch.ones(3), timeout=20), torch.full((3,), 3.0))
"""

PROBE_BETA = """\
import beta


def triple(x):
    return beta.triple(x)
"""


def _course(path):
    """The two-file course: a repository shaped like this one, with this one's tools."""
    os.makedirs(path / "tests" / "graded" / "probes")
    for name in ("pyproject.toml", "requirements.txt", "requirements-test.txt"):
        shutil.copy(os.path.join(ROOT, name), path / name)
    shutil.copytree(os.path.join(ROOT, "tools"), path / "tools", ignore=_no_cache)
    shutil.copy(os.path.join(ROOT, "tests", "graded", "conftest.py"), path / "tests" / "graded")
    (path / "tests" / "graded" / "probes" / "__init__.py").write_text("")
    (path / "alpha.py").write_text(ALPHA)
    (path / "beta.py").write_text(BETA)
    for stem, test, probe in (("alpha", TEST_ALPHA, PROBE_ALPHA), ("beta", TEST_BETA, PROBE_BETA)):
        (path / "tests" / "graded" / f"test_{stem}.py").write_text(test)
        (path / "tests" / "graded" / "probes" / f"{stem}.py").write_text(probe)
    return str(path)


def _no_cache(folder, names):
    return [n for n in names if n == "__pycache__"]


@pytest.fixture(scope="module")
def autograder(tmp_path_factory, autograder_venv, unpacked):
    """(unpacked autograder source, its venv, the course root): the course's zip unpacked as
    Gradescope unpacks it, graded with the venv the release's setup.sh made (conftest.py)."""
    course = _course(tmp_path_factory.mktemp("course"))
    kit = tmp_path_factory.mktemp("kit")
    student = str(kit / "student")
    release.write_student_repo(student, course)
    zip_path = str(kit / "autograder.zip")
    release.write_autograder(student, zip_path, course)
    base = tempfile.mkdtemp(prefix="attacks-")  # pytest's folders are root's alone: this is not
    os.chmod(base, 0o755)
    yield unpacked(zip_path, base), autograder_venv, course
    shutil.rmtree(base, ignore_errors=True)


def _attack(name):
    with open(os.path.join(HERE, f"{name}.py")) as f:
        text = f.read()
    target = re.search(r"^# target: (stub|reference)$", text, re.M).group(1)
    where = re.search(r"^# where: (prefix|suffix)$", text, re.M).group(1)
    return text, target, where


def _alpha(course, target):
    """alpha.py's reference, or its stub (what the student repository holds)."""
    if target == "reference":
        return ALPHA
    return assignments.stub_text(ALPHA, assignments.find_regions(os.path.join(course, "alpha.py")))


def _grade(autograder, alpha_text):
    """run_autograder on alpha.py = ``alpha_text`` and beta.py's reference, as root, in a
    memory cgroup; returns (results, the processes left in the cgroup when run_autograder
    returned, output, seconds)."""
    source, venv, course = autograder
    root = tempfile.mkdtemp(prefix="autograder-")
    os.chmod(root, 0o755)
    shutil.copytree(source, os.path.join(root, "source"), symlinks=True)
    with open(os.path.join(root, "source", "hidden_reference.txt"), "w") as f:
        f.write(SECRET + "\n" + ALPHA)
    os.makedirs(os.path.join(root, "submission"))
    with open(os.path.join(root, "submission", "alpha.py"), "w") as f:
        f.write(alpha_text)
    shutil.copy(os.path.join(course, "beta.py"), os.path.join(root, "submission", "beta.py"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADE_", "PYTHON"))}
    env["GRADE_SANDBOX_USER"] = sandbox.USER  # the user setup.sh made
    env.update(AUTOGRADER_ROOT=root, AUTOGRADER_VENV=venv, AUTOGRADER_TIMEOUT_S=str(TIMEOUT_S))
    env.update(GRADE_IMPORT_S="15")
    try:
        code, out, peaks, seconds = measure_grading.run_limited(
            ["bash", os.path.join(root, "source", "run_autograder")], MEMORY, 2.0, env=env
        )
        assert code == 0, out[-3000:]
        path = os.path.join(root, "results", "results.json")
        with open(path) as f:
            return json.load(f), peaks["left"], out, seconds
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _by_file(results):
    scores = {}
    for t in results["tests"]:
        stem = t["name"].split(".", 1)[0]
        got, most = scores.get(stem, (0, 0))
        scores[stem] = (got + t["score"], most + t["max_score"])
    return scores


@pytest.fixture(scope="module")
def honest(autograder):
    """The honest scores: alpha.py's stub or reference, beta.py's reference."""
    course = autograder[2]
    return {
        target: _grade(autograder, _alpha(course, target))[0]["score"]
        for target in ("stub", "reference")
    }


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_honest_files_score_as_they_should(autograder, honest):
    assert honest == {"stub": 3, "reference": 8}, honest


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ATTACKS)
def test_an_attack_scores_no_more_than_the_honest_files(autograder, honest, name):
    text, target, where = _attack(name)
    alpha = _alpha(autograder[2], target)
    hostile = text + "\n" + alpha if where == "prefix" else alpha + "\n" + text
    results, left, out, seconds = _grade(autograder, hostile)
    assert not left, f"processes outlived run_autograder (one could rewrite results.json): {left}"
    assert results["score"] <= honest[target], (results["score"], honest[target], out[-3000:])
    scores = _by_file(results)
    assert scores.get("beta") == (3, 3), f"beta.py lost points to {name}: {scores}\n{out[-3000:]}"
    assert scores.get("alpha", (0, 5))[1] == 5 and len(results["tests"]) == 4, results
    assert SECRET not in json.dumps(results) and SECRET not in out, "a hidden file was read"
    uid = pwd.getpwnam(sandbox.USER).pw_uid
    left = [p for p in sandbox._pids() if sandbox._owner(p) == uid]
    assert not left, f"processes of {sandbox.USER} outlived the grading: {left}"
    assert seconds < TIMEOUT_S + 60, seconds
