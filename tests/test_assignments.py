"""Assignments and grading are honest: stubs are exact, graded tests fail on them, shadowing holds.

Two layers. On a small fake repository built here (one technique file with two regions, graded
tests in-process, on run_ranks children and under run_torchrun), the grader's mechanics: full
marks for the reference, zero for the stubs, a submission shadows the reference everywhere, a hang
scores zero after its timeout, and the region check finds an ungraded region and a graded test
that passes on its stub. On this repository: the student files import, every region has a graded
test naming it, and the full student build fails every graded test. The per-region check (each
region stubbed alone) is `make grade-check`, run by CI after `make test`.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")
sys.path.insert(0, TOOLS)
import assignments  # noqa: E402
import grade  # noqa: E402

FAKE = '''\
"""A fake technique file."""

import torch
import torch.distributed as dist


def double(x):
    """Twice x."""
    # hint: one multiplication
    ### BEGIN SOLUTION
    y = 2 * x
    return y
    ### END SOLUTION


class Summer:
    def total(self, x):
        """Sum across ranks.

        More text.
        """
        ### BEGIN SOLUTION
        dist.all_reduce(x)
        return x
        ### END SOLUTION


def helper():
    return 1


if __name__ == "__main__":
    dist.init_process_group("gloo")
    total = Summer().total(torch.ones(1)).item()  # a collective: every rank computes it
    if dist.get_rank() == 0:  # one printer: two ranks' lines can interleave mid-line
        print("total", total, flush=True)
    dist.destroy_process_group()
'''

FAKE_TESTS = """\
import pytest
import torch

import fake
from harness import run_ranks, run_torchrun


@pytest.mark.grade(points=2, solution="fake.double")
def test_double():
    assert fake.double(3) == 6


def _total(rank, world_size):
    import fake

    return fake.Summer().total(torch.tensor([float(rank)])).item()


@pytest.mark.grade(points=3, solution="fake.Summer.total")
def test_total_on_ranks():
    assert run_ranks(_total, 2, timeout=60) == [1.0, 1.0]


@pytest.mark.grade(points=1, solution=["fake.Summer.total"])
def test_total_under_torchrun():
    assert "total 2.0" in run_torchrun("fake.py", nproc=2, timeout=120).stdout


def test_not_graded():
    assert fake.helper() == 1
"""


def _fake_repo(path, source=FAKE, tests=FAKE_TESTS):
    """A repository shaped like this one: a root file, tests/ with our conftest and harness."""
    os.makedirs(path / "tests")
    shutil.copy(os.path.join(ROOT, "pytest.ini"), path / "pytest.ini")
    for name in ("conftest.py", "harness.py"):
        shutil.copy(os.path.join(ROOT, "tests", name), path / "tests" / name)
    (path / "fake.py").write_text(source)
    (path / "tests" / "test_fake.py").write_text(tests)
    return str(path)


def _grade(*args):
    proc = subprocess.run(
        [sys.executable, os.path.join(TOOLS, "grade.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc.returncode, proc.stdout + proc.stderr


# ---- the stubber, on text ----


def test_stub_replaces_each_region_and_keeps_every_other_byte(tmp_path):
    (tmp_path / "fake.py").write_text(FAKE)
    regions = assignments.find_regions(str(tmp_path / "fake.py"))
    assert [r.qualname for r in regions] == ["fake.double", "fake.Summer.total"]
    assert regions[0].message == "fake.double: one multiplication"  # the hint wins
    assert regions[1].message == "fake.Summer.total: Sum across ranks."  # else the docstring
    student = assignments.stub_text(FAKE, regions)
    expected = FAKE.replace(
        "    ### BEGIN SOLUTION\n    y = 2 * x\n    return y\n    ### END SOLUTION\n",
        "    raise NotImplementedError('fake.double: one multiplication')\n",
    ).replace(
        "        ### BEGIN SOLUTION\n        dist.all_reduce(x)\n        return x\n"
        "        ### END SOLUTION\n",
        "        raise NotImplementedError('fake.Summer.total: Sum across ranks.')\n",
    )
    assert student == expected
    only = assignments.stub_text(FAKE, regions, only={"fake.Summer.total"})
    assert "y = 2 * x" in only and "dist.all_reduce(x)" not in only


@pytest.mark.parametrize(
    "body, error",
    [
        (
            "def f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n    pass\n",
            "inside the region",
        ),
        ("def f():\n    ### BEGIN SOLUTION\n    return 1\n", "never closed"),
        ("def f():\n    ### BEGIN SOLUTION\n    return 1\n### END SOLUTION\n", "indentation"),
        ("def f():\n    return 1\n    ### END SOLUTION\n", "without a BEGIN"),
        ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n", "inside a function body"),
    ],
)
def test_malformed_markings_are_refused(tmp_path, body, error):
    (tmp_path / "bad.py").write_text(body)
    with pytest.raises(ValueError, match=error):
        assignments.find_regions(str(tmp_path / "bad.py"))


# ---- the grader, on a fake repository ----


def test_grader_on_a_fake_repository(tmp_path):
    repo = _fake_repo(tmp_path / "repo")
    # the reference: full marks, Gradescope JSON whose totals match
    code, out = _grade("--root", repo)
    assert code == 0, out
    results = json.loads((tmp_path / "repo" / "build" / "results.json").read_text())
    assert results["score"] == results["max_score"] == 6, out
    assert len(results["tests"]) == 3  # the ungraded test is not run
    for t in results["tests"]:
        assert set(t) >= {"name", "score", "max_score", "output", "visibility"}
    assert "fake.py" in out and "6/6" in out
    # the generated student version: zero, every graded test failing
    student = str(tmp_path / "student")
    assignments.write_student(student, repo)
    assert assignments.check_imports(student, ["fake.py"]) == {}
    code, out = _grade("--root", repo, "--submission", student, "--out", str(tmp_path / "s.json"))
    results = json.loads((tmp_path / "s.json").read_text())
    assert code == 0 and results["score"] == 0 and len(results["tests"]) == 3, out
    assert all("NotImplementedError" in t["output"] for t in results["tests"]), out


def test_submission_shadows_the_reference_and_a_hang_scores_zero(tmp_path):
    repo = _fake_repo(tmp_path / "repo")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "fake.py").write_text("raise ImportError('the student file, not the reference')\n")
    code, out = _grade(
        "--root", repo, "--submission", str(broken), "--out", str(tmp_path / "b.json")
    )
    results = json.loads((tmp_path / "b.json").read_text())
    assert results["score"] == 0 and len(results["tests"]) == 3, out
    assert all("the student file, not the reference" in t["output"] for t in results["tests"])
    # right double, total that hangs: in the test process, on run_ranks' children and under
    # torchrun the student's file runs (the reference's total would pass), and nothing blocks
    hangs = tmp_path / "hangs"
    hangs.mkdir()
    (hangs / "fake.py").write_text(
        FAKE.replace("dist.all_reduce(x)", "while True:\n            pass")
    )
    code, out = _grade(
        "--root", repo, "--submission", str(hangs), "--out", str(tmp_path / "h.json"),
        "--per-test-timeout", "8",
    )  # fmt: skip
    results = json.loads((tmp_path / "h.json").read_text())
    scores = {t["name"].split("::")[-1]: t["score"] for t in results["tests"]}
    assert scores == {"test_double": 2, "test_total_on_ranks": 0, "test_total_under_torchrun": 0}
    assert "Timeout" in " ".join(t["output"] for t in results["tests"]), out
    # and nothing of it runs on: torchrun starts each worker in a session of its own, which a
    # process-group kill misses (its two spinning workers once outlived the suite)
    time.sleep(1)
    assert not _processes_running(str(tmp_path)), "the hung submission's processes outlived it"


def _processes_running(text):
    """Pids whose command line contains ``text`` (Linux /proc; elsewhere none are found)."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if entry.isdigit() and text.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            pass
    return found


def test_region_check_finds_ungraded_regions_and_weak_tests(tmp_path):
    source = FAKE.replace("def helper():\n    return 1", "def helper():\n    ### BEGIN SOLUTION\n"
                          "    return 1\n    ### END SOLUTION")  # fmt: skip
    weak = FAKE_TESTS.replace("assert fake.double(3) == 6", "assert callable(fake.double)")
    repo = _fake_repo(tmp_path / "repo", source, weak)
    code, out = _grade("--root", repo, "--check-regions")
    assert code == 1, out
    assert "fake.helper: no graded test names it" in out
    assert "test_double passes against the stub" in out
    assert "ok   fake.Summer.total: 2 of 2 graded tests fail" in out


# ---- this repository's assignments ----

REGIONS = assignments.all_regions(ROOT)
needs_regions = pytest.mark.skipif(
    not REGIONS, reason="no ### BEGIN SOLUTION regions in the assignment files yet"
)


def test_student_files_import(tmp_path):
    names = assignments.write_student(str(tmp_path), ROOT)
    assert names, "no assignment files found"
    assert assignments.check_imports(str(tmp_path), names) == {}


@pytest.fixture(scope="module")
def graded():
    return grade.collect(ROOT)


@needs_regions
def test_every_region_has_a_graded_test(graded):
    ungraded = [
        r.qualname for r in REGIONS if not any(r.qualname in g["solutions"] for g in graded)
    ]
    assert not ungraded, f"regions no graded test names: {ungraded}"
    names = {r.qualname for r in REGIONS}
    unknown = {s for g in graded for s in g["solutions"] if s not in names}
    assert not unknown, f"graded tests name regions that do not exist: {unknown}"


@needs_regions
def test_full_student_build_fails_every_graded_test(tmp_path, graded):
    staged, _, _ = grade.stage(str(tmp_path / "empty"), ROOT, str(tmp_path / "student"))
    _, results, seconds, timed_out = grade.run_graded(ROOT, staged, quiet=True)
    assert not timed_out
    passing = [g["nodeid"] for g in graded if grade.result_of(results, g["nodeid"])[0]]
    assert not passing, f"graded tests that pass against the stubs: {passing}"
    print(f"all-stubs grading: {len(graded)} graded tests, all failing, in {seconds:.0f} s")


@needs_regions
def test_assignments_md_lists_the_current_regions(graded):
    with open(os.path.join(ROOT, "ASSIGNMENTS.md")) as f:
        text = f.read()
    assert assignments.table(REGIONS, graded) in text, (
        "ASSIGNMENTS.md's table of regions is stale (a line number or a graded test moved): "
        "replace it with what `python tools/assignments.py --table` prints"
    )
