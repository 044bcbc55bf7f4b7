"""Assignments and grading are honest: stubs are exact, graded tests fail on them, shadowing holds.

Two layers. On a small fake repository built here (one technique file with two regions, graded
tests in tests/graded/ that run it through the sandbox's probes: in one worker, on two gloo ranks
and under torchrun), the grader's mechanics: full marks for the reference, zero for the stubs, the
submission's file is the one that runs, a hang scores zero after its timeout and names where it
hung, and the region check finds an ungraded region and a graded test that passes on its stub. On
this repository: the student files import, every region has a graded test naming it, and the
full student build fails every graded test. The per-region check (each region stubbed alone) is
`make grade-check`, run by CI after `make test`.
"""

import ast
import json
import os
import re
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

from tests.mistakes import Mistake  # noqa: E402

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

from sandbox import call, on_ranks, torchrun


@pytest.mark.grade(points=2, solution="fake.double")
def test_double():
    assert call("fake:double", 3) == 6


@pytest.mark.grade(points=3, solution="fake.Summer.total")
def test_total_on_ranks():
    assert on_ranks("fake:total", 2, timeout=10) == [1.0, 1.0]


@pytest.mark.grade(points=1, solution=["fake.Summer.total"])
def test_total_under_torchrun():
    assert "total 2.0" in torchrun("fake.py", 2, timeout=40).stdout


def test_not_graded():
    assert call("fake:helper") == 1


@pytest.mark.grade(points=5, solution="fake.double")
@pytest.mark.parametrize("x", [pytest.param(4, marks=pytest.mark.ungraded)])
def test_beyond_the_container(x):
    assert call("fake:double", x) == 8
"""

FAKE_PROBES = """\
import torch

import fake


def double(x):
    return fake.double(x)


def total(rank, world_size):
    return fake.Summer().total(torch.tensor([float(rank)])).item()


def helper():
    return fake.helper()
"""


# pure functions only, so the feedback and mistakes checks run in seconds: `quadruple` needs
# `double`, and `ramp`'s tests share a module-scoped fixture
PURE = '''\
"""A fake technique file of pure functions."""

import torch


def double(x):
    """Twice x."""
    ### BEGIN SOLUTION
    return 2 * x
    ### END SOLUTION


def quadruple(x):
    """Four times x, by doubling twice."""
    ### BEGIN SOLUTION
    return double(double(x))
    ### END SOLUTION


def ramp(n):
    """0, 1, ..., n - 1 as a float tensor."""
    ### BEGIN SOLUTION
    return torch.arange(n, dtype=torch.float32)
    ### END SOLUTION
'''

PURE_TESTS = """\
import pytest
import torch

from sandbox import call


@pytest.mark.grade(points=2, solution="pure.double")
def test_double():
    got = call("pure:double", 3)
    assert got == 6, f"double(3) must be 6, got {got}"


@pytest.mark.grade(points=1, solution="pure.quadruple", needs=("pure.double",))
def test_quadruple():
    assert call("pure:quadruple", 1) == 4, "quadruple(1) must be 4"


@pytest.mark.grade(points=1, solution="pure.ramp")
def test_ramp():
    assert torch.equal(call("pure:ramp", 1000), torch.arange(1000.0))


@pytest.fixture(scope="module")
def checked_ramp():
    got = call("pure:ramp", 500)
    assert (got == torch.arange(500.0)).all(), "ramp(500) must count up from 0"
    return got


@pytest.mark.grade(points=1, solution="pure.ramp")
@pytest.mark.parametrize("i", [0, 1, 2])
def test_ramp_entries(checked_ramp, i):
    assert checked_ramp[i] == i
"""

PURE_PROBES = """\
import pure


def double(x):
    return pure.double(x)


def quadruple(x):
    return pure.quadruple(x)


def ramp(n):
    return pure.ramp(n)
"""


def _fake_repo(path, source=FAKE, tests=FAKE_TESTS, stem="fake", probes=FAKE_PROBES):
    """A repository shaped like this one: a root file, tests/graded/ with our conftest, the
    graded tests and their probes (the grader comes from this repository's tools/)."""
    graded = path / "tests" / "graded"
    os.makedirs(graded / "probes")
    os.makedirs(path / "tests" / "mistakes")
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), path / "pyproject.toml")
    shutil.copy(os.path.join(ROOT, "tests", "graded", "conftest.py"), graded / "conftest.py")
    shutil.copy(os.path.join(ROOT, "tests", "mistakes", "__init__.py"), path / "tests" / "mistakes")
    (graded / "probes" / "__init__.py").write_text("")
    (graded / "probes" / f"{stem}.py").write_text(probes)
    (path / f"{stem}.py").write_text(source)
    (graded / f"test_{stem}.py").write_text(tests)
    os.chmod(path, 0o755)  # the sandbox user (as root) reads the staged copy, never this
    return str(path)


def _grade(*args, **env):
    proc = subprocess.run(
        [sys.executable, os.path.join(TOOLS, "grade.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, **env),
    )
    return proc.returncode, proc.stdout + proc.stderr


def _submission(path, **files):
    path.mkdir()
    for name, text in files.items():
        (path / f"{name}.py").write_text(text)
    return str(path)


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
    assert len(results["tests"]) == 3  # neither the test without a grade nor an ungraded case
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


def test_a_file_the_grader_cannot_parse_loses_only_its_own_line_numbers(tmp_path):
    """The function table maps each graded file's functions to lines: a 20,000-term expression
    (ast.parse raises RecursionError), a file that is not UTF-8, a binary one and one too big to
    read are each left out, and every other file is still mapped."""
    good = b"def f():\n    pass\n"
    files = {
        "deep.py": b"x = " + b"+".join([b"1"] * 20_000) + b"\n" + good,
        "latin1.py": "# caf\u00e9\n".encode("latin-1") + good,
        "binary.py": bytes(range(256)) * 64,
        "big.py": good + b"#" * grade.MAX_MAPPED_BYTES,
        "good.py": good,
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    lines = grade.function_lines(str(tmp_path), [*files, "missing.py"])
    assert lines == {"good.f": 1}, lines


# slow: two gradings and a hang waited out; graded/test_sandbox.py's hang test stays
@pytest.mark.slow
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
    # right double, total that hangs: on the ranks and under torchrun the student's file runs
    # (the reference's total would pass), each hang ends at its call's timeout, nothing blocks
    hangs = tmp_path / "hangs"
    hangs.mkdir()
    (hangs / "fake.py").write_text(
        FAKE.replace("dist.all_reduce(x)", "while True:\n            pass")
    )
    code, out = _grade(
        "--root", repo, "--submission", str(hangs), "--out", str(tmp_path / "h.json"),
        GRADE_NOTICE_S="3",
    )  # fmt: skip
    results = json.loads((tmp_path / "h.json").read_text())
    scores = {t["name"].split("::")[-1]: t["score"] for t in results["tests"]}
    assert scores == {"test_double": 2, "test_total_on_ranks": 0, "test_total_under_torchrun": 0}
    hung = next(t["output"] for t in results["tests"] if "on_ranks" in t["name"])
    # the loop has two lines (while, pass): the stack is sampled on either
    hung_at = re.match(r"did not finish in 10 s; it was at fake.py line (23|24) in total", hung)
    assert hung_at, hung
    assert "still running: test_total_on_ranks (3 s)" in out  # the grader names a slow test
    # and nothing of it runs on: torchrun starts each worker in a session of its own, which a
    # process-group kill misses (its two spinning workers once outlived the suite)
    deadline = time.monotonic() + 60  # a killed process can take many seconds to go when loaded
    while _processes_running(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _processes_running(str(tmp_path))
    assert not left, f"the hung submission's processes outlived it: {_cmdlines(left)}"


def _cmdlines(pids):
    lines = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                lines.append(f.read().replace(b"\0", b" ").decode(errors="replace")[:200])
        except OSError:
            pass
    return lines


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


@pytest.mark.slow  # the grading tools: CI runs them in full (grade-check, -mistakes, -fit)
def test_region_check_finds_ungraded_regions_and_weak_tests(tmp_path):
    source = FAKE.replace("def helper():\n    return 1", "def helper():\n    ### BEGIN SOLUTION\n"
                          "    return 1\n    ### END SOLUTION")  # fmt: skip
    weak = FAKE_TESTS.replace('assert call("fake:double", 3) == 6', 'assert call("fake:helper")')
    repo = _fake_repo(tmp_path / "repo", source, weak)
    code, out = _grade("--root", repo, "--check-regions")
    assert code == 1, out
    assert "fake.helper: no graded test names it" in out
    assert "test_double passes against the stub" in out
    assert "ok   fake.Summer.total: 2 of 2 graded tests fail" in out


@pytest.mark.slow  # the grading tools: CI runs them in full (grade-check, -mistakes, -fit)
def test_feedback_leads_with_the_message_and_blames_the_needed_region(tmp_path):
    repo = _fake_repo(tmp_path / "repo", PURE, PURE_TESTS, "pure", PURE_PROBES)
    wrong = PURE.replace("return 2 * x", "return 3 * x").replace(
        "torch.arange(n, dtype=torch.float32)", "torch.arange(n, dtype=torch.float32) + 1"
    )
    submission = _submission(tmp_path / "wrong", pure=wrong)
    code, out = _grade(
        "--root", repo, "--submission", submission, "--out", str(tmp_path / "w.json")
    )
    tests = {
        t["name"].split("::")[-1]: t["output"]
        for t in json.loads((tmp_path / "w.json").read_text())["tests"]
    }
    assert tests["test_double"].startswith("AssertionError: double(3) must be 6, got 9"), out
    assert tests["test_quadruple"] == "blocked by `double` (fails its own tests)", out
    # a tensor comparison: shapes and where they differ, never a thousand values
    assert "shape=[1000]" in tests["test_ramp"] and len(tests["test_ramp"]) < 2000, out
    assert "tensor([" not in tests["test_ramp"], out
    # a module-scoped fixture's failure: written out once, then pointed to
    first = tests["test_ramp_entries[0]"]
    assert first.startswith("AssertionError: ramp(500) must count up from 0"), out
    for i in (1, 2):
        assert "the same failure as" in tests[f"test_ramp_entries[{i}]"], out
    assert out.count("in checked_ramp") == 1, out  # its traceback on the console once
    assert out.count("tests/graded/test_pure.py:") <= 3 * 6, out  # a few traceback lines each
    # the per-function table, with the lines of the student's own file
    assert "double (pure.py:6)" in out and "quadruple (pure.py:13)" in out, out
    assert "blocked by `double` (fails its own tests)" in out, out
    # quadruple written, double left as its stub: quadruple's test runs into double's stub
    assignments.write_student(str(tmp_path / "stub"), repo)
    text = (
        (tmp_path / "stub" / "pure.py")
        .read_text()
        .replace(
            "raise NotImplementedError('pure.quadruple: Four times x, by doubling twice.')",
            "return double(double(x))",
        )
    )
    only_quadruple = _submission(tmp_path / "quad", pure=text)
    code, out = _grade(
        "--root", repo, "--submission", only_quadruple, "--out", str(tmp_path / "q.json")
    )
    tests = json.loads((tmp_path / "q.json").read_text())["tests"]
    outputs = {t["name"].split("::")[-1]: t["output"] for t in tests}
    assert outputs["test_quadruple"] == "blocked by `double` (not implemented)", out
    assert "double (pure.py:6)" in out and "not implemented" in out, out


def test_blocked_by_names_the_root_cause_and_never_a_tests_own_region():
    def test(name, solution, needs=()):
        return {"nodeid": name, "points": 1, "solutions": [solution], "needs": list(needs)}

    fail = grade.Outcome(False, "AssertionError: wrong")
    graded = [
        test("t_a", "f.a"),
        test("t_b", "f.b", needs=["f.a"]),
        test("t_c", "f.c", needs=["f.b"]),
        test("t_d", "f.d", needs=["f.e"]),
        test("t_e", "f.e", needs=["f.d"]),  # d and e need each other, both fail
        test("t_s", "f.s", needs=["f.stub"]),
        test("t_x", "f.x"),  # ran into f.stub's NotImplementedError without saying it needs it
    ]
    results = {g["nodeid"]: fail for g in graded}
    results["t_x"] = grade.Outcome(False, "NotImplementedError: f.stub: ...", ("f.stub",))
    assert grade.blocked_by(graded, results) == {
        "t_b": "blocked by `a` (fails its own tests)",
        "t_c": "blocked by `a` (fails its own tests)",  # b fails only because a does
        "t_e": "blocked by `d` (fails its own tests)",  # t_d, asked first, shows its failure
        "t_s": "blocked by `stub` (not implemented)",
        "t_x": "blocked by `stub` (not implemented)",
    }


@pytest.mark.slow  # the grading tools: CI runs them in full (grade-check, -mistakes, -fit)
def test_an_ungraded_case_is_not_collected_as_graded(tmp_path):
    tests = (
        PURE_TESTS
        + """

@pytest.mark.grade(points=1, solution="pure.double")
@pytest.mark.parametrize("n", [1, pytest.param(4, marks=pytest.mark.ungraded)])
def test_double_cases(n):
    assert call("pure:double", n) == 2 * n
"""
    )
    repo = _fake_repo(tmp_path / "repo", PURE, tests, "pure", PURE_PROBES)
    nodeids = [g["nodeid"] for g in grade.collect(repo)]
    assert any(n.endswith("test_double_cases[1]") for n in nodeids), nodeids
    assert not any(n.endswith("test_double_cases[4]") for n in nodeids), nodeids


@pytest.mark.slow  # the grading tools: CI runs them in full (grade-check, -mistakes, -fit)
def test_blocked_by_asks_a_regions_test_run_alone_first():
    # p is wrong and fails its test run alone; the whole-pipeline tests of p and q need each
    # other: q's is blocked by p, p's shows its own failure, in whichever order they are asked
    def test(name, solution, needs=()):
        return {"nodeid": name, "points": 1, "solutions": [solution], "needs": list(needs)}

    fail = grade.Outcome(False, "AssertionError: wrong")
    tests = [
        test("t_q_all", "f.q", needs=["f.p"]),
        test("t_p_all", "f.p", needs=["f.q"]),
        test("t_q_alone", "f.q"),
        test("t_p_alone", "f.p"),
    ]
    for graded in (tests, tests[::-1]):
        results = {g["nodeid"]: fail for g in graded}
        results["t_q_alone"] = grade.Outcome(True, "")
        assert grade.blocked_by(graded, results) == {
            "t_q_all": "blocked by `p` (fails its own tests)"
        }


@pytest.mark.slow  # the grading tools: CI runs them in full (grade-check, -mistakes, -fit)
def test_only_one_region_and_an_import_failure(tmp_path):
    repo = _fake_repo(tmp_path / "repo", PURE, PURE_TESTS, "pure", PURE_PROBES)
    broken = PURE.replace("import torch", "import torch\ndef broken(:")
    submission = _submission(tmp_path / "broken", pure=broken)
    out_json = str(tmp_path / "o.json")
    code, out = _grade(
        "--root", repo, "--submission", submission, "--out", out_json, "--only", "pure.quadruple"
    )
    results = json.loads(open(out_json).read())
    names = sorted(t["name"].split("::")[-1] for t in results["tests"])
    assert names == ["test_double", "test_quadruple"], out  # and the tests of what it needs
    for t in results["tests"]:
        assert t["output"].startswith("could not import pure.py: SyntaxError at line 4"), out
    assert "could not import pure.py: SyntaxError at line 4" in out.split("assignment")[-1], out
    code, out = _grade("--root", repo, "--only", "pure.nosuch")
    assert code != 0 and "no such region or file" in out, out


MISTAKES = """\
from tests.mistakes import Mistake

MISTAKES = [
    Mistake(region="pure.double", name="triples", message="double(3) must be 6",
            body="### BEGIN SOLUTION\\nreturn 3 * x\\n### END SOLUTION\\n"),
    Mistake(region="pure.double", name="adds instead", message="double(3) must be 6",
            body="return x + x\\n"),
    Mistake(region="pure.double", name="off by one", message="twice",
            body="return 2 * x + 1\\n"),
]
"""


@pytest.mark.slow  # the grading tools: CI runs them in full (grade-check, -mistakes, -fit)
def test_mistakes_check_splices_each_body_and_matches_its_message(tmp_path):
    repo = _fake_repo(tmp_path / "repo", PURE, PURE_TESTS, "pure", PURE_PROBES)
    (tmp_path / "repo" / "tests" / "mistakes" / "pure.py").write_text(MISTAKES)
    code, out = _grade("--root", repo, "--check-mistakes")
    assert code == 1, out
    lines = [line for line in out.splitlines() if " / " in line]
    assert len(lines) == 3, out
    assert lines[0].startswith("ok     pure.double / triples: 1 of 1 tests fail"), out
    assert "double(3) must be 6, got 9" in lines[0], out
    assert lines[1].startswith("DEFECT pure.double / adds instead: 0 of 2"), out
    assert "keeps its points" in lines[1], out
    assert lines[2].startswith("DEFECT pure.double / off by one"), out
    assert "no first line contains 'twice'" in lines[2] and "got 7" in lines[2], out
    code, out = _grade("--root", repo, "--check-mistakes", "pure.ramp")
    assert code == 1 and "no mistakes catalogued" in out, out


EDITED_MISTAKES = """\
from tests.mistakes import Mistake

MISTAKES = [
    Mistake(region="pure.double", name="triples", message="double(3) must be 6",
            edits=(("2 * x", "3 * x"),)),
    Mistake(region="pure.double", name="stale", message="double(3) must be 6",
            edits=(("return 5 * x", "return x"),)),
]
"""


def test_mistakes_check_applies_edits_and_names_an_edit_that_no_longer_applies(tmp_path):
    repo = _fake_repo(tmp_path / "repo", PURE, PURE_TESTS, "pure", PURE_PROBES)
    (tmp_path / "repo" / "tests" / "mistakes" / "pure.py").write_text(EDITED_MISTAKES)
    code, out = _grade("--root", repo, "--check-mistakes", "pure.double")
    assert code == 1, out
    lines = [line for line in out.splitlines() if " / " in line]
    assert len(lines) == 2, out
    assert lines[0].startswith("ok     pure.double / triples: 1 of 1 tests fail"), out
    assert lines[1].startswith("DEFECT pure.double / stale: the mistake no longer applies"), out
    assert "'return 5 * x' not found in the reference" in lines[1], out


def test_a_mistake_takes_a_body_or_edits_not_both():
    with pytest.raises(ValueError, match="exactly one of `body`"):
        Mistake(region="pure.double", name="both", message="m", body="x", edits=(("a", "b"),))
    with pytest.raises(ValueError, match="exactly one of `body`"):
        Mistake(region="pure.double", name="neither", message="m")


@pytest.mark.slow  # the grading tools: CI runs them in full (grade-check, -mistakes, -fit)
def test_assignments_never_overwrites_a_students_edits(tmp_path, capsys):
    repo = _fake_repo(tmp_path / "repo", PURE, PURE_TESTS, "pure", PURE_PROBES)
    out = tmp_path / "student"
    assert assignments.main(["--root", repo, "--out", str(out)]) == 0
    assert assignments.main(["--root", repo, "--out", str(out)]) == 0  # unchanged: rewritten
    work = (out / "pure.py").read_text().replace("raise NotImplementedError('pure.double", "#", 1)
    (out / "pure.py").write_text(work)
    capsys.readouterr()
    assert assignments.main(["--root", repo, "--out", str(out)]) == 1
    assert "holds edits (pure.py differ" in capsys.readouterr().out
    assert (out / "pure.py").read_text() == work


def test_table_gives_the_student_files_lines_and_each_regions_needs(tmp_path):
    (tmp_path / "pure.py").write_text(PURE)
    regions = assignments.find_regions(str(tmp_path / "pure.py"))
    student = assignments.stub_text(PURE, regions).splitlines()
    for r in regions:
        assert student[r.student_line - 1].strip().startswith("raise NotImplementedError"), r
    graded = [
        {"nodeid": "t::test_q", "points": 1, "solutions": ["pure.quadruple"],
         "needs": ["pure.double"]},
        {"nodeid": "t::test_d", "points": 2, "solutions": ["pure.double"], "needs": []},
        {"nodeid": "t::test_r", "points": 1, "solutions": ["pure.ramp"], "needs": []},
    ]  # fmt: skip
    text = assignments.table(regions, graded)
    assert "| `pure.py` | `quadruple` (line 13) | `test_q` | 1 | `double` |" in text, text
    reordered = list(reversed(regions))
    assert assignments.implementation_order(reordered, graded) == [
        "pure.ramp", "pure.double", "pure.quadruple"
    ]  # fmt: skip


# ---- this repository's assignments ----

REGIONS = assignments.all_regions(ROOT)
needs_regions = pytest.mark.skipif(
    not REGIONS, reason="no ### BEGIN SOLUTION regions in the assignment files yet"
)


@pytest.mark.slow  # collects every graded test (8 s): CI runs it
def test_the_assignments_page_carries_the_region_table_of_the_files_as_they_are():
    """ASSIGNMENTS.md gives each region's line in the student file: a graded file whose lines
    move must have its table pasted again, or students look in the wrong place."""
    made = subprocess.run(
        [sys.executable, os.path.join("tools", "assignments.py"), "--table"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    rows = [line for line in made.stdout.splitlines() if line.startswith("| `")]
    with open(os.path.join(ROOT, "ASSIGNMENTS.md")) as f:
        page = f.read()
    stale = [row[:120] for row in rows if row not in page]
    assert rows and not stale, (
        "ASSIGNMENTS.md's region table is stale: paste the rows of `python tools/assignments.py "
        f"--table` over it. Rows it lacks: {stale[:3]}"
    )


def test_student_files_import(tmp_path):
    names = assignments.write_student(str(tmp_path), ROOT)
    assert names, "no assignment files found"
    assert assignments.check_imports(str(tmp_path), names) == {}


@pytest.fixture(scope="module")
def graded():
    found = grade.collect(ROOT)
    assert found, "no graded test under tests/graded/: the grader would grade nothing"
    return found


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
def test_assignments_md_lists_the_current_regions(graded):
    with open(os.path.join(ROOT, "ASSIGNMENTS.md")) as f:
        text = f.read()
    assert assignments.table(REGIONS, graded) in text, (
        "ASSIGNMENTS.md's table of regions is stale (a line number or a graded test moved): "
        "replace it with what `python tools/assignments.py --table` prints"
    )


def test_no_import_cycle_between_the_grading_tools_and_no_import_of_tests():
    """tools/assignments.py and tools/grade.py do not import each other (grade_plugin holds
    what both need), and no tool imports from tests/ (the graded tests' helpers stay there)."""
    imports = {}
    for name in os.listdir(TOOLS):
        if name.endswith(".py"):
            with open(os.path.join(TOOLS, name)) as f:
                tree = ast.parse(f.read())
            found = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module:
                    found.add(node.module.split(".")[0])
            imports[name[:-3]] = found
    assert "grade" not in imports["assignments"] and "assignments" in imports["grade"]
    for tool, found in imports.items():
        assert not found & {"spawn", "tests", "oracles"}, tool


ALTERNATIVES = """\
from tests.alternatives import Alternative

ALTERNATIVES = [
    Alternative(region="pure.double", name="adds", body="return x + x\\n"),
    Alternative(region="pure.ramp", name="list comprehension",
                body="return torch.tensor([float(i) for i in range(n)])\\n"),
    Alternative(region="pure.ramp", name="starts at one",
                body="return torch.arange(1, n + 1, dtype=torch.float32)\\n"),
    Alternative(region="pure.ramp", name="a copy",
                body="return torch.arange(n, dtype=torch.float32)  # the same\\n"),
]
"""


# slow: the mistakes check's test stays, and CI runs make grade-alternatives
@pytest.mark.slow
def test_alternatives_check_keeps_correct_bodies_and_names_a_wrong_one(tmp_path):
    repo = _fake_repo(tmp_path / "repo", PURE, PURE_TESTS, "pure", PURE_PROBES)
    os.makedirs(tmp_path / "repo" / "tests" / "alternatives")
    init = os.path.join(ROOT, "tests", "alternatives", "__init__.py")
    shutil.copy(init, tmp_path / "repo" / "tests" / "alternatives")
    (tmp_path / "repo" / "tests" / "alternatives" / "pure.py").write_text(ALTERNATIVES)
    code, out = _grade("--root", repo, "--check-alternatives")
    assert code == 1, out
    assert "ok   pure.double / adds: 2 graded tests pass" in out, out  # its own and quadruple's
    assert "ok   pure.ramp / list comprehension: 4 graded tests pass" in out, out
    assert "FAIL pure.ramp / starts at one: 4 of 4 tests fail" in out, out  # blamed alone
    assert "pass 2: 1 alternatives, 0 of 4 graded tests pass" in out, out
    assert "DEFECT pure.quadruple: no alternative catalogued" in out, out
    assert "DEFECT pure.ramp / starts at one" in out and "ok   pure.ramp / starts" not in out, out
    assert "DEFECT pure.ramp / a copy: the reference's own body" in out, out
    code, out = _grade("--root", repo, "--check-alternatives", "pure.double")
    assert code == 0 and "1 alternatives, 0 defects" in out, out


def test_the_checks_import_only_what_a_splice_can_break(tmp_path):
    """A check splices bodies into some files: the import check covers those, the files that
    import them (directly or not) and any file it cannot read; no other file can break."""
    files = {
        "a.py": "import math\n",
        "b.py": "import a\n",
        "c.py": "from b import x\n",
        "d.py": "import os\n",
        "e.py": "def f(:\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    names = list(files)
    assert grade.affected(str(tmp_path), names, {"a.py"}) == ["a.py", "b.py", "c.py", "e.py"]
    assert grade.affected(str(tmp_path), names, {"d.py"}) == ["d.py", "e.py"]
