"""The course kit (tools/release.py): the student repository and the Gradescope autograder.

Default tier: the release's file list, the regions' table the stubbed files need, the leak search
(no line of any solution region, no private answer, no function with a region's token shape, in
any released file, notebooks and the zip included; and the search itself finds a line planted in a
file, a notebook output and the zip, and a region's body renamed into a helper), the autograder's
layout, the autograder run as Gradescope runs it on one graded file, and the cgroup run's list of
processes that outlive it. Slow tier: the student repository after `git init`, graded by its own
Makefile's command (zero points; the reference's files copied over it: full marks), and the whole
autograder against an upload nested in a folder.
"""

import json
import keyword
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import assignments  # noqa: E402
import release  # noqa: E402
import twins  # noqa: E402

ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GRADE_SUBMISSION")}


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """The release, written once for the module: (student folder, autograder zip, its files)."""
    out = tmp_path_factory.mktemp("release")
    student = str(out / "student")
    files = release.write_student_repo(student)
    members = release.write_autograder(student, str(out / "autograder.zip"))
    return student, str(out / "autograder.zip"), files, members


@pytest.fixture(scope="module")
def signatures():
    return release.solution_signatures()


def test_student_repository_holds_what_a_student_needs_and_nothing_private(kit):
    student, _, files, _ = kit
    names = set(files)
    for name in assignments.assignment_files(ROOT):
        assert name in names, f"{name}: the student version is missing"
    expected = {"launch.py", "Makefile", "README.md", ".gitignore", "requirements.txt"}
    expected |= {"requirements-test.txt", "pyproject.toml", "tests/graded/conftest.py"}
    expected |= {"tests/graded/probes/__init__.py", "tools/regions.json"}
    expected |= {"tools/grade.py", "tools/grade_plugin.py", "tools/assignments.py", "tools/venv.sh"}
    expected |= {"tools/sandbox.py", "tools/sandbox_child.py"}
    expected |= set(release.graded_test_files(ROOT))
    expected |= {f"notebooks/{n}" for n in os.listdir(os.path.join(ROOT, "notebooks")) if
                 n.endswith(".ipynb")}  # fmt: skip
    assert expected <= names, f"missing from the release: {sorted(expected - names)}"
    assert "memory/memory_timeline.py" in names
    private = ["tests/mistakes/", "tests/test_assignments.py", "tests/test_release.py"]
    private += ["tools/release.py", "notebooks/src/", "ASSIGNMENTS.md", "tests/mistakes"]
    private += ["tests/alternatives"]
    private += ["oracles", "tests/attacks", "tests/graded/test_sandbox.py"]
    for path in private:
        assert not any(n.startswith(path) for n in names), f"{path} must not be released"
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    # every file a released file imports from the repository is released too
    scripts = [n for n in files if n.endswith(".py") and not n.startswith("notebooks/")]
    for imported in assignments.import_closure(student, scripts):
        assert os.path.exists(os.path.join(student, imported)), imported


def test_the_region_table_lets_only_and_the_function_table_work_on_stubs(kit):
    """The stubbed files have no markers: tools/regions.json names each region and its line."""
    student = kit[0]
    regions = assignments.graded_regions(student)
    assert [r.qualname for r in regions] == [r.qualname for r in assignments.all_regions(ROOT)]
    for r in regions:
        name = next(f for f in assignments.assignment_files(student) if f.endswith(r.file))
        with open(os.path.join(student, name)) as f:
            line = f.read().splitlines()[r.student_line - 1]
        assert line.strip() == f"raise NotImplementedError({r.message!r})", (r.qualname, line)


def test_the_student_readme_names_compose_and_only_tools_it_ships(kit):
    student = kit[0]
    with open(os.path.join(student, "README.md")) as f:
        readme = f.read()
    assert "compose.py" in readme
    named = set(re.findall(r"`((?:tools|tests|benchmarks|memory|notebooks)/[\w./-]+)`", readme))
    missing = [n for n in named if not os.path.exists(os.path.join(student, n.rstrip("/")))]
    assert not missing, f"the student README names what it does not ship: {missing}"


def test_student_files_are_stubs_and_the_makefile_has_the_three_commands(kit):
    student, _, files, _ = kit
    for name in assignments.assignment_files(ROOT):
        with open(os.path.join(student, name)) as f:
            text = f.read()
        assert assignments.BEGIN not in text and assignments.END not in text, name
        stem = os.path.splitext(os.path.basename(name))[0]
        regions = [r for r in assignments.all_regions(ROOT) if r.qualname.split(".")[0] == stem]
        for r in regions:
            assert f"raise NotImplementedError({r.message!r})" in text, r.qualname
    with open(os.path.join(student, "Makefile")) as f:
        makefile = f.read()
    for target in ("demo", "test", "grade"):
        assert re.search(rf"^{target}:", makefile, re.M), f"the student Makefile has no {target}"
    with open(os.path.join(student, "README.md")) as f:
        readme = f.read()
    assert "{{" not in readme and "{{" not in makefile, "a template placeholder left unfilled"
    for words in ("make test", "make demo", "make grade", "## Hand in", "Gradescope"):
        assert words in readme, f"the student README does not say {words!r}"


def test_notebooks_are_released_without_outputs(kit):
    student = kit[0]
    for name in sorted(
        n for n in os.listdir(os.path.join(student, "notebooks")) if n.endswith(".ipynb")
    ):
        nb = nbformat.read(os.path.join(student, "notebooks", name), as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code, name
        assert all(not c.outputs and c.execution_count is None for c in code), name


def test_no_solution_line_or_private_answer_is_released(kit, signatures, tmp_path):
    student, zip_path, _, _ = kit
    assert len(signatures) > 100
    found = release.leaks(student, ROOT, signatures)
    with zipfile.ZipFile(zip_path) as z:
        z.extractall(tmp_path / "autograder")
    found += release.leaks(str(tmp_path / "autograder"), ROOT, signatures, autograder=True)
    assert not found, "solution text in the release:\n" + "\n".join(map(str, found))


def test_every_region_is_searched_for_and_a_planted_line_is_found(kit, signatures, tmp_path):
    regions = {r.qualname for r in assignments.all_regions(ROOT)}
    searched = {where.split(" ")[0] for where in signatures.values()}
    assert regions <= searched, f"regions without a line to search for: {regions - searched}"
    # one solution line planted in a test file, a notebook's output and a zip member
    line, where = next((s, w) for s, w in signatures.items() if "sharded_step" in w)
    planted = tmp_path / "planted"
    shutil.copytree(kit[0], planted)
    with open(planted / "tests" / "graded" / "conftest.py", "a") as f:
        f.write(f"\n# {line}\n")
    nb_path = planted / "notebooks" / sorted(os.listdir(planted / "notebooks"))[0]
    nb = nbformat.read(nb_path, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"    {line}\n")]
    nbformat.write(nb, nb_path)
    with zipfile.ZipFile(planted / "extra.zip", "w") as z:
        z.writestr("muon_zero.py", open(os.path.join(ROOT, "muon_zero.py")).read())
    (planted / "memory" / "__pycache__").mkdir()
    (planted / "memory" / "__pycache__" / "plots.cpython-311.pyc").write_bytes(b"\0")
    hits = release.leaks(str(planted), ROOT, signatures)
    files = {name for name, _, _ in hits}
    assert {"tests/graded/conftest.py", f"notebooks/{nb_path.name}", "extra.zip"} <= files, hits
    assert any("__pycache__" in name for name in files), hits
    muon = {r.qualname for r in assignments.all_regions(ROOT, ["muon_zero.py"])}
    assert muon <= {what.split(" ")[0] for name, _, what in hits if name == "extra.zip"}


def test_a_helper_that_renames_a_region_is_found(kit, tmp_path):
    """A region's body copied into a test helper under other names, with other comments: found by
    its token shape, though no line of it is the region's."""
    shapes = release.region_shapes()
    region = next(r for r in assignments.all_regions(ROOT) if r.qualname in shapes)
    where = next(f for f in assignments.assignment_files(ROOT) if f.endswith(region.file))
    with open(os.path.join(ROOT, where)) as f:
        body = "\n".join(f.read().splitlines()[region.begin : region.end - 1])
    renamed, names = textwrap.dedent(body), {}
    for name in sorted(set(re.findall(r"(?<![.\w])([A-Za-z_]\w*)\b", renamed)), key=len)[::-1]:
        if not keyword.iskeyword(name) and name not in ("torch", "range", "len", "self"):
            renamed = re.sub(
                rf"(?<![.\w]){name}\b", names.setdefault(name, f"v{len(names)}"), renamed
            )
    renamed = re.sub(r"#.*", "", renamed)
    helper = "def helper(v0, v1, v2, v3, v4, v5, v6, v7):\n" + textwrap.indent(renamed, "    ")
    folder = tmp_path / "shipped"
    folder.mkdir()
    (folder / "test_helpers.py").write_text(helper + "\n")
    signatures = release.solution_signatures()
    lines = [line.strip() for line in helper.splitlines()]
    assert not any(line in signatures for line in lines), "the renamed copy shares a line"
    hits = release.reimplementations(str(folder), shapes)
    assert any(region.qualname in what for _, _, what in hits), hits


@pytest.mark.slow  # every function of the kit called on ten regions' inputs: about two minutes
def test_no_function_of_the_kit_answers_a_region_and_a_planted_one_is_found(kit, tmp_path):
    """The behavioural search: a Sinkhorn written tokens-last, with none of the region's lines or
    its shape, planted in a helper module of the kit, is the only function found."""
    planted = tmp_path / "planted"
    shutil.copytree(kit[0], planted)
    (planted / "compiled" / "helpers.py").write_text(
        "import torch\n\n\n"
        "def balance(z, n_iter=20, tiny=1e-6):\n"
        "    w = torch.softmax(z.movedim((-2, -1), (0, 1)), 0) + tiny\n"
        "    for axis in [1] + [0, 1] * (n_iter - 1):\n"
        "        w = w / (w.sum(axis, keepdim=True) + tiny)\n"
        "    return w.movedim((0, 1), (-2, -1))\n"
    )
    found = twins.twins(str(planted))
    assert found == [("compiled.helpers.balance", "mhc.sinkhorn_knopp")], found
    assert set(twins.REGIONS) == set(twins.regions(twins.chapters(ROOT), 1))


def test_private_answers_are_searched_for(tmp_path):
    """A catalogue's wrong or correct alternative body and a notebook's reference answer are
    private: found if released."""
    fake = tmp_path / "repo"
    for name in assignments.assignment_files(ROOT):
        os.makedirs(fake / os.path.dirname(name), exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), fake / name)
    os.makedirs(fake / "tests" / "mistakes")
    wrong = "Y = Y / Y.norm(dim=-1, keepdim=True)  # rows, not the whole matrix"
    (fake / "tests" / "mistakes" / "muon_zero.py").write_text(
        "from tests.mistakes import Mistake\n\nMISTAKES = [\n    Mistake(region='muon_zero.x', "
        f"name='n', message='m', body={wrong!r}),\n]\n"
    )
    os.makedirs(fake / "tests" / "alternatives")
    right = "Z = a * Z + b * AZ + c * torch.matmul(A, AZ)"
    (fake / "tests" / "alternatives" / "muon_zero.py").write_text(
        "from tests.alternatives import Alternative\n\nALTERNATIVES = [\n    Alternative("
        f"region='muon_zero.x', name='n', body={right!r}),\n]\n"
    )
    (fake / "tests" / "notebook_answers.py").write_text(
        "ANSWERS = {'00_x': {'answer_jump': ('5_847_040', '11'), 'answer_list': ('[2, 20, 14]', "
        "'[2]'), 'answer_small': ('78', '88')}}\n"
    )
    signatures = release.solution_signatures(str(fake))
    assert signatures[wrong].startswith("a wrong body in tests/mistakes/muon_zero.py")
    assert signatures[right].startswith("an alternative body in tests/alternatives/muon_zero.py")
    assert "answer_jump = 5_847_040" in signatures and "answer_small = 78" in signatures
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "wrong.py").write_text(f"    {wrong}\n")
    (shipped / "right.py").write_text(f"        {right}\n")
    (shipped / "filled.py").write_text("answer_small = 78\n")
    (shipped / "prose.md").write_text("The jump is 5,847,040 B, the segments [2, 20, 14].\n")
    (shipped / "clean.md").write_text("78 MiB and 2,847,040 B and 15847040 say nothing.\n")
    hits = release.leaks(str(shipped), str(fake), signatures)
    assert sorted({h[0] for h in hits}) == ["filled.py", "prose.md", "right.py", "wrong.py"], hits


def test_autograder_zip_is_in_gradescopes_layout(kit):
    _, zip_path, _, members = kit
    with zipfile.ZipFile(zip_path) as z:
        names = set(z.namelist())
        modes = {i.filename: (i.external_attr >> 16) & 0o777 for i in z.infolist()}
        setup = z.read("setup.sh").decode()
        run = z.read("run_autograder").decode()
        pins = z.read("requirements-autograder.txt").decode()
    assert {"setup.sh", "run_autograder", "tools/gradescope.py", "tools/grade.py"} <= names
    assert modes["setup.sh"] & 0o111 and modes["run_autograder"] & 0o111
    assert not any(n.startswith("notebooks/") for n in names)
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        torch_pin = next(line.strip() for line in f if line.startswith("torch=="))
    assert f"{torch_pin} ${{TORCH_INDEX:+--index-url" in setup, (
        "setup.sh: the pinned torch, CPU-only"
    )
    assert "torch" not in pins.split("\n", 1)[1] and "pytest-timeout" in pins
    for text in (setup, run):
        assert not re.search(r"/(work|home|root|tmp)/", text), "a machine path in the autograder"
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def _autograder(tmp_path, zip_path, submission_files, keep_tests=None, timeout=1500):
    """Unpack the zip as Gradescope does, put ``submission_files`` in submission/, run it."""
    root = tmp_path / "autograder"
    with zipfile.ZipFile(zip_path) as z:
        z.extractall(root / "source")
    for name in ("setup.sh", "run_autograder"):
        os.chmod(root / "source" / name, 0o755)
    if keep_tests is not None:  # a smaller assignment: only these graded test files
        for name in release.graded_test_files(str(root / "source")):
            if name not in keep_tests and "/probes/" not in name:
                os.remove(root / "source" / name)
    shutil.copy(root / "source" / "run_autograder", root / "run_autograder")
    for name, source in submission_files.items():
        os.makedirs(os.path.dirname(root / "submission" / name), exist_ok=True)
        shutil.copy(source, root / "submission" / name)
    os.makedirs(root / "submission", exist_ok=True)
    env = dict(ENV, AUTOGRADER_ROOT=str(root), AUTOGRADER_PYTHON=sys.executable)
    env["AUTOGRADER_TIMEOUT_S"] = str(timeout - 60)  # this checks the scores, not the time
    proc = subprocess.run(
        [str(root / "run_autograder")], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(root / "results" / "results.json") as f:
        return json.load(f), proc.stdout


def _check_schema(results):
    """Gradescope's results.json: a score, an execution time, tests with these fields."""
    assert isinstance(results["score"], (int, float))
    assert isinstance(results["execution_time"], (int, float)) and results["execution_time"] > 0
    assert results["tests"], "no tests in results.json"
    for t in results["tests"]:
        assert {"name", "score", "max_score", "output", "visibility"} <= set(t), t
        assert isinstance(t["name"], str) and isinstance(t["output"], str)
        assert 0 <= t["score"] <= t["max_score"], t
        assert t["visibility"] in ("visible", "hidden", "after_due_date", "after_published"), t
    assert results["score"] == sum(t["score"] for t in results["tests"])


@pytest.mark.slow  # the grading tools: CI runs them in full (grade-check, -mistakes, -fit)
def test_autograder_grades_one_assignment_as_gradescope_runs_it(kit, tmp_path):
    """The zip unpacked in a folder standing in for /autograder, one graded file's tests kept:
    the reference's file scores every point of it."""
    tests = [t for t in release.graded_test_files(ROOT) if "/probes/" not in t]
    assert tests, "no graded test under tests/graded/: the grader would grade nothing"
    stem = os.path.basename(tests[-1])[len("test_") : -len(".py")]
    name = next(f for f in assignments.assignment_files(ROOT) if f.endswith(f"{stem}.py"))
    submission = {os.path.basename(name): os.path.join(ROOT, name)}
    results, out = _autograder(tmp_path, kit[1], submission, [tests[-1]])
    _check_schema(results)
    assert results["score"] == results["max_score"] > 0, out
    assert all(stem in t["name"] for t in results["tests"])


@pytest.mark.slow  # the grading tools: CI runs them in full (grade-check, -mistakes, -fit)
def test_autograder_writes_a_result_when_grading_breaks(kit, tmp_path):
    root = tmp_path / "autograder"
    with zipfile.ZipFile(kit[1]) as z:
        z.extractall(root / "source")
    (root / "source" / "tools" / "grade.py").write_text("raise SystemExit('the grader broke')\n")
    env = dict(ENV, AUTOGRADER_ROOT=str(root), AUTOGRADER_PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(root / "source" / "run_autograder")], env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    results = json.loads((root / "results" / "results.json").read_text())
    assert results["score"] == 0 and "nothing was scored" in results["output"]
    assert "execution_time" in results
    tests = results["tests"]  # still every graded test, with what it was worth
    assert tests and all(t["score"] == 0 and t["max_score"] > 0 for t in tests), tests[:3]
    assert results["max_score"] == sum(t["max_score"] for t in tests)


# ---- slow tier: whole gradings ----


def _make_grade_command(folder):
    """The student Makefile's own `make grade` command, with this interpreter for the venv's."""
    # make -n prints a recipe's continued lines as written: join them
    out = subprocess.run(
        ["make", "-s", "-n", "grade", f"PY={sys.executable}"], cwd=folder, capture_output=True,
        text=True, check=True,
    ).stdout.replace("\\\n", " ")  # fmt: skip
    return [line for line in out.splitlines() if "tools/grade.py" in line][-1]


def _student_grade(folder):
    command = _make_grade_command(folder)
    proc = subprocess.run(
        ["bash", "-c", command], cwd=folder, env=ENV, capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(os.path.join(folder, "build", "results.json")) as f:
        return json.load(f), proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(3600)  # two whole gradings, on a loaded machine
def test_student_repository_grades_zero_then_full_marks_with_the_reference(kit, tmp_path):
    clone = tmp_path / "student"
    shutil.copytree(kit[0], clone)
    subprocess.run(["git", "init", "-q"], cwd=clone, check=True)
    results, out = _student_grade(str(clone))  # the stubs: every graded test fails
    passing = [t["name"] for t in results["tests"] if t["score"]]
    assert not passing, f"graded tests that pass against the stubs: {passing}\n{out}"
    assert results["max_score"] > 0 and results["score"] == 0, out
    for name in assignments.assignment_files(ROOT):
        shutil.copy(os.path.join(ROOT, name), clone / name)
    results, out = _student_grade(str(clone))
    assert results["score"] == results["max_score"], out


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_autograder_grades_a_nested_upload_like_the_students_make_grade(kit, tmp_path):
    """Every assignment file of the reference, uploaded inside a folder, memory_timeline.py (which
    lives in memory/) among them: its tests score in full (grade-fit grades every file)."""
    submission = {f"alice/{os.path.basename(n)}": os.path.join(ROOT, n)
                  for n in assignments.assignment_files(ROOT)}  # fmt: skip
    kept = [t for t in release.graded_test_files(ROOT) if t.endswith("test_memory_timeline.py")]
    assert kept, "no graded test of memory_timeline.py to keep"
    results, out = _autograder(tmp_path, kit[1], submission, kept)
    _check_schema(results)
    assert results["score"] == results["max_score"] > 0, out
    assert all("memory_timeline" in t["name"] for t in results["tests"]), results["tests"]
    assert "alice" in results["output"]


def test_make_never_repoints_a_venv_that_belongs_to_another_checkout(tmp_path):
    """tools/venv.sh writes the .pth that puts the checkout on sys.path once; a venv whose .pth
    names another checkout makes it stop with one line, the .pth left as it was."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    script = os.path.join(ROOT, "tools", "venv.sh")

    def run():
        return subprocess.run(
            ["bash", script, sys.executable, str(venv), ""], capture_output=True, text=True
        )

    first = run()
    assert first.returncode == 0, first.stderr
    (pth,) = venv.glob("lib/python*/site-packages/course_repository_root.pth")
    assert pth.read_text().strip() == ROOT
    pth.write_text("/elsewhere/another-checkout\n")
    second = run()
    assert second.returncode == 1 and len(second.stderr.strip().splitlines()) == 1, second
    assert "belongs to the checkout /elsewhere/another-checkout" in second.stderr
    assert pth.read_text() == "/elsewhere/another-checkout\n"


def test_the_grading_figures_in_the_docs_are_the_ones_checked():
    """docs/grading.md and ASSIGNMENTS.md state the container and the margin that `make grade-fit`
    checks (its defaults), and no other grading time or memory figure."""
    import measure_grading

    defaults = {a.dest: a.default for a in measure_grading.argparse_parser()._actions}
    assert (defaults["memory_mb"], defaults["cpus"]) == (768, 0.5)
    assert (defaults["max_mb"], defaults["max_s"]) == (650, 360)
    for name in ("docs/grading.md", "ASSIGNMENTS.md"):
        with open(os.path.join(ROOT, name)) as f:
            text = " ".join(f.read().split())
        assert "768 MB" in text and "half a CPU" in text, name
        assert "650 MB" in text and "6 minutes" in text, name
        stale = re.findall(r"\d+(?:\.\d+)? GB(?: or more)?\)?[^.]*(?:grading|autograder)", text)
        assert not [s for s in stale if "141 GB" not in s and "80 or" not in s], (name, stale)


def test_the_limited_run_names_a_process_that_outlives_its_command():
    """The attacks' proof that nothing is left to rewrite results.json: run_limited lists what is
    still in the cgroup when the command returns (a detached process included), and not the
    processes that ended with it."""
    if os.geteuid() != 0:
        pytest.skip("a cgroup of its own needs root")
    import measure_grading

    detached = ["bash", "-c", "setsid sleep 60 >/dev/null 2>&1 & echo started"]
    code, out, peaks, _ = measure_grading.run_limited(detached, 2**30, 1.0)
    assert code == 0 and "started" in out, out
    assert len(peaks["left"]) == 1, f"the detached sleep was not seen: {peaks['left']}"
    _, _, peaks, _ = measure_grading.run_limited(["bash", "-c", "sleep 0.2 & wait"], 2**30, 1.0)
    assert peaks["left"] == [], f"a process that ended was listed as left: {peaks['left']}"


def test_a_withheld_reference_pasted_into_the_kit_is_found(tmp_path):
    """The autograder-only references never reach the student repository: V4's Sinkhorn from
    tests/graded/hidden/ pasted as sinkhorn_knopp under other names (its shape), a call of a
    withheld reference by name, and the file itself are each found; the kit as released is clean
    of them (test_no_solution_line_or_private_answer_is_released)."""
    withheld = release.withheld_references(ROOT)
    assert {"v4_sinkhorn", "v4_coefficients", "ns_fp64", "reference_fp32", "naive_compress"} <= set(
        withheld["names"]
    )
    pasted = """
def sinkhorn_knopp(z, n_iter=20, tiny=1e-6):
    out = torch.exp(z - z.amax(-2, keepdim=True))
    out = out / out.sum(-2, keepdim=True) + tiny
    for dim in [-1] + [-2, -1] * (n_iter - 1):
        out = out / (out.sum(dim, keepdim=True) + tiny)
    return out
"""
    folder = tmp_path / "kit"
    (folder / "tests" / "graded" / "hidden").mkdir(parents=True)
    (folder / "mhc.py").write_text(pasted)
    (folder / "tests" / "graded" / "test_x.py").write_text("want = ns_fp64(x, steps)\n")
    (folder / "tests" / "graded" / "hidden" / "references_mhc.py").write_text("\n")
    hits = release.withheld_leaks(str(folder), ROOT, withheld)
    found = {(name, what.split(",")[0]) for name, _, what in hits}
    assert ("tests/graded/test_x.py", "ns_fp64") in found, hits
    assert any(name == "mhc.py" and "v4_sinkhorn" in what for name, _, what in hits), hits
    assert any(name.startswith("tests/graded/hidden/") for name, _, _ in hits), hits


def test_a_withheld_layout_listing_in_a_public_test_is_found(tmp_path):
    """compose's expected_view (every rank's coordinates and groups, an answer for layout_groups
    once each list is made a group) ships only in the autograder: left in a public test, renamed,
    its name and its shape are found."""
    withheld = release.withheld_references(ROOT)
    assert "expected_view" in withheld["names"] and "expected_view" in withheld["shapes"]
    pasted = """
def view_of(shape, rank):
    at = list(itertools.product(*(range(n) for n in shape)))
    p, c, d = at[rank]
    return {
        "coords": (p, c, d),
        "pipeline": [q for q, (_, c2, d2) in enumerate(at) if (c2, d2) == (c, d)],
        "cp": [q for q, (p2, _, d2) in enumerate(at) if (p2, d2) == (p, d)],
        "stage": [q for q, (p2, _, _) in enumerate(at) if p2 == p],
    }
"""
    folder = tmp_path / "kit"
    (folder / "tests" / "graded").mkdir(parents=True)
    (folder / "tests" / "graded" / "test_compose.py").write_text(pasted)
    hits = release.withheld_leaks(str(folder), ROOT, withheld)
    assert any("expected_view" in what for _, _, what in hits), hits
