"""Grade the reference, or a student's files, with the graded tests; prove the grading honest.

    python tools/grade.py                   # the reference: exits 1 unless it scores full marks
    python tools/grade.py --submission DIR  # a student's folder (make grade SUBMISSION=DIR)
    python tools/grade.py --check-regions   # each region stubbed alone fails every test naming it

Only tests marked `@pytest.mark.grade(points=N, solution="FILESTEM.qualname")` run. A submission is
staged in build/grading/: the student version of every assignment file (tools/assignments.py),
overwritten by the submission's own copies, and nothing else; the tests' conftest puts that folder
first on sys.path and PYTHONPATH, so the tests, run_ranks' children and run_torchrun all use the
student's code, and a file the student did not hand in is graded as its stub, never as the
reference. Each test has a timeout (pytest-timeout) and the whole run another: a hang scores zero
and the grader still finishes. Writes build/results.json in Gradescope's autograder format.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)
from assignments import ROOT, all_regions, write_student  # noqa: E402

sys.path.append(os.path.join(ROOT, "tests"))  # the test harness: stdlib only until a rank starts
from harness import kill_tree  # noqa: E402


def _pytest(root, args, report, submission=None, timeout=1800.0, quiet=False):
    """Run pytest in ``root`` with the grade plugin; return (exit code, seconds, timed out).

    ``quiet`` keeps pytest's own output back unless it fails (for collection)."""
    env = dict(os.environ, GRADE_REPORT=report, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TOOLS, env.get("PYTHONPATH")) if p)
    env.pop("GRADE_SUBMISSION", None)
    if submission:
        env["GRADE_SUBMISSION"] = os.path.abspath(submission)
    cmd = [sys.executable, "-m", "pytest", "-p", "grade_plugin", "-p", "no:cacheprovider", *args]
    start = time.monotonic()
    pipe = subprocess.PIPE if quiet else None
    proc = subprocess.Popen(
        cmd, cwd=root, env=env, start_new_session=True, stdout=pipe, stderr=subprocess.STDOUT
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        code, timed_out = proc.returncode, False
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # pytest and every rank it started, torchrun's workers included
        output, _ = proc.communicate()
        code, timed_out = proc.returncode, True
    if quiet and code not in (0, 1, 5):  # 1: tests failed, 5: none collected
        print(output.decode(errors="replace"), file=sys.stderr)
    return code, time.monotonic() - start, timed_out


def _events(report):
    with open(report) as f:
        return [json.loads(line) for line in f if line.strip()]


def collect(root=ROOT):
    """Every graded test: a list of dicts with ``nodeid``, ``points`` and ``solutions``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.jsonl")
        open(report, "w").close()
        args = ["--collect-only", "-q", "-m", "grade"]
        code, _, _ = _pytest(root, args, report, timeout=600, quiet=True)
        graded = [e for e in _events(report) if e["event"] == "collected"]
    if code not in (0, 5):  # 5: nothing collected
        raise RuntimeError(f"collecting the graded tests failed (pytest exit code {code})")
    return graded


def outcomes(events):
    """nodeid -> (passed, output) from the plugin's result events."""
    out = {}
    for e in (e for e in events if e["event"] == "result"):
        passed, text = out.get(e["nodeid"], (True, ""))
        if e["outcome"] != "passed":
            passed = False
            reason = "skipped: " if e["outcome"] == "skipped" else f"failed in {e['when']}: "
            text = (text + "\n" + reason + e["output"]).strip()
        out[e["nodeid"]] = (passed, text)
    return out


def run_graded(root, submission=None, nodeids=None, per_test_s=180, overall_s=1800, quiet=False):
    """Run the graded tests (or just ``nodeids``); return (graded, outcomes, seconds, timed out).

    A test file that cannot be collected (the submission fails on import) leaves its tests out
    of ``graded`` but not of ``outcomes``: each of its tests that the reference has (from
    ``collect()``) is entered there as failed, with the collection error as its output."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.jsonl")
        open(report, "w").close()
        args = ["-m", "grade", f"--timeout={per_test_s}", "-q" if quiet else "-v"]
        args += ["--continue-on-collection-errors"]
        args += ["--no-header", "-rN", "--tb=no"] if quiet else []
        args += list(nodeids or ["tests"])
        _, seconds, timed_out = _pytest(root, args, report, submission, overall_s, quiet)
        events = _events(report)
    graded = [e for e in events if e["event"] == "collected"]
    results = outcomes(events)
    for e in (e for e in events if e["event"] == "collect_error"):
        results[("collect_error", e["nodeid"])] = (False, "could not be collected:\n" + e["output"])
    return graded, results, seconds, timed_out


def result_of(results, nodeid):
    """(passed, output) of a test; a test never run scores zero and says why."""
    if nodeid in results:
        return results[nodeid]
    for key, value in results.items():
        if isinstance(key, tuple) and nodeid.startswith(key[1]):
            return value
    return False, "not run: the grader's time ran out"


def stage(submission, root=ROOT, out=None):
    """The folder to grade: every stub from the reference, then the submission's files on top."""
    out = out or os.path.join(root, "build", "grading", "submission")
    shutil.rmtree(out, ignore_errors=True)
    names = write_student(out, root)
    found = []
    for name in names:  # memory/memory_timeline.py may also be handed in as memory_timeline.py
        for given in (name, os.path.basename(name)):
            if os.path.isfile(os.path.join(submission, given)):
                shutil.copyfile(os.path.join(submission, given), os.path.join(out, name))
                found.append(name)
                break
    return out, found, [n for n in names if n not in found]


def results_json(graded, results, timed_out, note=""):
    """Gradescope's autograder format: top-level score, and one entry per graded test."""
    tests = []
    for g in graded:
        passed, output = result_of(results, g["nodeid"])
        tests.append(
            {
                "name": f"{', '.join(g['solutions'])}: {g['nodeid']}",
                "score": g["points"] if passed else 0,
                "max_score": g["points"],
                "output": "passed" if passed else output,
                "visibility": "visible",
            }
        )
    total = sum(t["score"] for t in tests)
    if timed_out:
        note += " The grader's overall time limit stopped the run; tests not run score zero."
    return {
        "score": total,
        "max_score": sum(t["max_score"] for t in tests),
        "output": note.strip(),
        "visibility": "visible",
        "tests": tests,
    }


def score_table(results):
    """Per assignment file: graded tests, passed, points earned and maximum."""
    rows = defaultdict(lambda: [0, 0, 0, 0])
    for t in results["tests"]:
        stem = t["name"].split(".", 1)[0]
        row = rows[stem + ".py"]
        row[0] += 1
        row[1] += t["score"] == t["max_score"]
        row[2] += t["score"]
        row[3] += t["max_score"]
    lines = [f"{'assignment':<22}{'tests':>7}{'passed':>8}{'points':>12}"]
    for name, (n, ok, got, most) in sorted(rows.items()):
        lines.append(f"{name:<22}{n:>7}{ok:>8}{f'{got}/{most}':>12}")
    lines.append(f"{'total':<22}{len(results['tests']):>7}")
    lines[-1] += f"{sum(r[1] for r in rows.values()):>8}"
    earned = f"{results['score']}/{results['max_score']}"
    lines[-1] += f"{earned:>12}"
    return "\n".join(lines)


def grade(root, submission, out, per_test_s, overall_s):
    note = "Reference solution." if submission is None else ""
    staged = None
    if submission is not None:
        if not os.path.isdir(submission):
            sys.exit(f"grade: --submission {submission}: no such folder")
        staged, found, missing = stage(submission, root)
        note = f"Graded files: {', '.join(found) or 'none'}."
        if missing:
            note += f" Not handed in (graded as the unfilled stub): {', '.join(missing)}."
        print(note, flush=True)
    graded, results, seconds, timed_out = run_graded(root, staged, None, per_test_s, overall_s)
    if submission is not None:  # every student is scored on the reference's graded tests
        graded = collect(root)
    if not graded:
        print("grade: no graded tests found (no test carries @pytest.mark.grade)")
        return 1
    report = results_json(graded, results, timed_out, note)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print()
    print(score_table(report))
    shown = os.path.relpath(out) if out.startswith(os.getcwd() + os.sep) else out
    print(f"\n{shown} written; grading took {seconds:.0f} s")
    full = report["score"] == report["max_score"]
    return 0 if submission is not None or full else 1


def check_regions(root, per_test_s, overall_s):
    """Stub one region at a time; every graded test that names it must fail. Returns exit code."""
    regions = all_regions(root)
    if not regions:
        print("check-regions: no solution regions in the assignment files; nothing to check")
        return 0
    graded = collect(root)
    bad, start = [], time.monotonic()
    for qualname in dict.fromkeys(r.qualname for r in regions):
        tests = [g["nodeid"] for g in graded if qualname in g["solutions"]]
        if not tests:
            bad.append(f"{qualname}: no graded test names it")
            print(f"FAIL {qualname}: no graded test names it", flush=True)
            continue
        with tempfile.TemporaryDirectory() as staged:
            write_student(staged, root, only={qualname})
            _, results, seconds, _ = run_graded(root, staged, tests, per_test_s, overall_s, True)
        passing = [t for t in tests if result_of(results, t)[0]]
        verdict = "FAIL" if passing else "ok  "
        print(
            f"{verdict} {qualname}: {len(tests) - len(passing)} of {len(tests)} graded tests "
            f"fail against its stub ({seconds:.0f} s)",
            flush=True,
        )
        bad += [f"{qualname}: {t} passes against the stub" for t in passing]
    print(f"\ncheck-regions: {len(regions)} regions in {time.monotonic() - start:.0f} s")
    for line in bad:
        print("DEFECT", line)
    return 1 if bad else 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--submission", help="a student's folder (default: grade the reference)")
    parser.add_argument("--root", default=ROOT, help="the reference repository (default: this one)")
    parser.add_argument("--out", help="results file (default: ROOT/build/results.json)")
    parser.add_argument("--check-regions", action="store_true", help="prove each region is graded")
    parser.add_argument("--per-test-timeout", type=float, default=180, help="seconds per test")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    args = parser.parse_args(argv)
    root = os.path.abspath(args.root)
    if args.check_regions:
        return check_regions(root, args.per_test_timeout, args.timeout)
    out = args.out or os.path.join(root, "build", "results.json")
    return grade(root, args.submission, out, args.per_test_timeout, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
