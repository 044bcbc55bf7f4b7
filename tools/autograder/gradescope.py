"""Grade one Gradescope submission and always leave a results.json behind (run by run_autograder).

Gradescope gives a student zero and shows nothing when the autograder dies or outlives its limit.
So this finds the student's files wherever the upload put them (a zip of a folder, a GitHub
repository), runs tools/grade.py on them under a time limit below Gradescope's, passing its output
on line by line as it comes (a run killed from outside still shows how far it got), kills every
process left behind (as root: every process of the sandbox user), and then writes results.json
once: the grader's report, with the execution time added, or a zero with the reason. Lives at
tools/gradescope.py in the autograder zip, beside tools/grade.py.

    python tools/gradescope.py --submission DIR --results FILE [--timeout SECONDS]
"""

import argparse
import collections
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = {"__MACOSX", ".git", "__pycache__", ".venv", "build"}


sys.path.insert(0, os.path.join(ROOT, "tools"))
import assignments  # noqa: E402
import sandbox  # noqa: E402


def assignment_names(root=ROOT):
    return [os.path.basename(n) for n in assignments.assignment_files(root)]


def locate(submission, names):
    """The folder of ``submission`` that holds most of the assignment files (itself if tied)."""
    best, best_count = submission, -1
    for folder, dirs, files in os.walk(submission):
        dirs[:] = sorted(d for d in dirs if d not in SKIP)
        depth = os.path.relpath(folder, submission).count(os.sep)
        if depth > 3:
            dirs[:] = []
        here = set(files) | {
            f for d in dirs for f in os.listdir(os.path.join(folder, d)) if d == "memory"
        }
        count = len(set(names) & here)
        if count > best_count:
            best, best_count = folder, count
    return best


def grade(submission, results, timeout_s):
    """Run tools/grade.py on ``submission``, its report to ``results``; return (exit code or
    None on timeout, the output's tail). Its output is passed on line by line as it comes."""
    grade_py = os.path.join(ROOT, "tools", "grade.py")
    # the grader stops itself first and scores what finished
    cmd = [sys.executable, grade_py, "--submission", submission, "--out", results,
           "--timeout", str(max(30, timeout_s - 30))]  # fmt: skip
    # the graded tests' hidden cases: seeds drawn now (tests/graded/expected.py's DRAW), so a
    # submission fitted to the public cases' values earns nothing from it; shown to the instructor.
    # One of 2**50, and every seed a hash of it (expected.case_seed): a seed a worker searches out
    # of its own inputs (torch keeps 32 bits of it) tells nothing of the draw or the other seeds
    env = dict(os.environ)
    env.setdefault("GRADE_DRAW", str(secrets.randbelow(2**50) + 1))
    print(f"graded cases drawn with GRADE_DRAW={env['GRADE_DRAW']}", flush=True)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    tail, deadline = collections.deque(maxlen=60), time.monotonic() + timeout_s
    os.set_blocking(proc.stdout.fileno(), False)
    pending = b""
    while True:
        try:
            chunk = proc.stdout.read()
        except BlockingIOError:
            chunk = None
        if chunk:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                text = line.decode(errors="replace")
                print(text, flush=True)  # Gradescope shows it to the instructor
                tail.append(text)
        if proc.poll() is not None and not chunk:
            break
        if time.monotonic() > deadline:
            sandbox.kill_tree(proc.pid)
            proc.wait()
            break
        time.sleep(0.1)
    if pending:
        print(pending.decode(errors="replace"), flush=True)
    code = proc.returncode if time.monotonic() <= deadline else None
    for pid in sandbox.descendants(os.getpid()):  # anything grade.py left behind
        sandbox.kill_tree(pid)
    sandbox.kill_sandbox_user()
    return code, "\n".join(tail)[-3000:]


def unscored(why, timeout_s=45):
    """Every graded test with its points and a score of zero (a report the grader never wrote
    still shows what was at stake), or [] when they cannot be collected in ``timeout_s``."""
    from grade_plugin import collect

    try:
        graded = collect(ROOT, timeout=timeout_s)
    except Exception:  # the fallback of a fallback: the zero, with its reason
        return []
    return [
        {
            "name": f"{', '.join(g['solutions'])}: {g['nodeid']}",
            "score": 0,
            "max_score": g["points"],
            "output": why,
            "visibility": "visible",
        }
        for g in graded
    ]


def finish(report_path, results, seconds, code, tail, note):
    """Write results.json once, as Gradescope reads it: the grader's report (from
    ``report_path``), or a zero that says why."""
    report = None
    if os.path.exists(report_path):
        try:
            with open(report_path) as f:
                report = json.load(f)
        except ValueError:
            report = None
    if report is None:
        why = "did not finish in time" if code is None else f"stopped (exit code {code})"
        report = {
            "score": 0,
            "output": f"The grader {why}; nothing was scored. Its last output:\n{tail}",
            "tests": unscored(f"not scored: the grader {why}"),
        }
        report["max_score"] = sum(t["max_score"] for t in report["tests"])
    report["execution_time"] = round(seconds, 1)
    report.setdefault("visibility", "visible")
    if note:
        report["output"] = (report.get("output", "") + "\n" + note).strip()
    os.makedirs(os.path.dirname(os.path.abspath(results)), exist_ok=True)
    tmp = results + ".writing"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
    os.replace(tmp, results)
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--submission", required=True, help="the student's upload")
    parser.add_argument("--results", required=True, help="results.json to write")
    parser.add_argument("--timeout", type=float, default=540, help="seconds for the whole grading")
    args = parser.parse_args(argv)
    start = time.monotonic()
    results = os.path.abspath(args.results)
    if os.path.exists(results):
        os.remove(results)
    note = ""
    private = tempfile.mkdtemp(prefix="gradescope-")  # root's alone: the grader's report
    report_path = os.path.join(private, "results.json")
    if not os.path.isdir(args.submission):
        code, tail = 1, f"no submission folder at {args.submission}"
    else:
        folder = locate(os.path.abspath(args.submission), assignment_names())
        if folder != os.path.abspath(args.submission):
            note = f"Graded the files in {os.path.relpath(folder, args.submission)}/."
        code, tail = grade(folder, report_path, args.timeout)
    report = finish(report_path, results, time.monotonic() - start, code, tail, note)
    print(f"results.json: {report['score']} points in {report['execution_time']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
