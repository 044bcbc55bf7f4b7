"""Grade the reference, or a student's files, with the graded tests; prove the grading honest.

    python tools/grade.py                   # the reference: exits 1 unless it scores full marks
    python tools/grade.py --submission DIR  # a student's folder (make grade SUBMISSION=DIR)
    python tools/grade.py --submission DIR --only muon_zero.newton_schulz  # a region, or a file
    python tools/grade.py --check-regions   # each region stubbed alone fails every test naming it
    python tools/grade.py --check-regions --only compose  # the same for one file's regions
    python tools/grade.py --check-mistakes  # each catalogued mistake loses points, with its message

Only tests marked `@pytest.mark.grade(points=N, solution="FILESTEM.qualname", needs=(...))` run. A
submission is staged in build/grading/: the student version of every assignment file
(tools/assignments.py), overwritten by the submission's own copies, and nothing else; the tests'
conftest puts that folder first on sys.path and PYTHONPATH, so the tests, run_ranks' children and
run_torchrun all use the student's code, and a file the student did not hand in is graded as its
stub, never as the reference. `--only` grades the tests naming the given regions (and those of the
regions they need) on the same staged folder, by the same code path. Each test has a timeout
(pytest-timeout, `--per-test-timeout`) and the whole run another: a hang scores zero, the grader
says which test is still running, and it still finishes. A failing test whose `needs` region is
unwritten or fails its own tests is reported as blocked by it. Writes build/results.json in
Gradescope's autograder format.
"""

import argparse
import ast
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import defaultdict
from typing import NamedTuple

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)
from assignments import ROOT, all_regions, assignment_files, write_student  # noqa: E402

sys.path.append(os.path.join(ROOT, "tests"))  # the test harness: stdlib only until a rank starts
from harness import kill_tree  # noqa: E402

NOTICE_S = float(os.environ.get("GRADE_NOTICE_S", 30))  # how often to say a test still runs
CONSOLE_LINES = 6  # traceback lines under each failure on the console (results.json has more)


class Outcome(NamedTuple):
    passed: bool
    output: str  # for a failure: the assertion message's line first, then a short traceback
    stubs: tuple = ()  # regions whose stub raised NotImplementedError in this test


def _pytest(
    root, args, report, submission=None, timeout=1800.0, quiet=False, only=None, stop_on=None
):
    """Run pytest in ``root`` with the grade plugin; return (exit code, seconds, timed out).

    ``quiet`` keeps pytest's own output back unless it fails (for collection and the checks).
    While it runs, a test that takes long is named every NOTICE_S seconds."""
    env = dict(os.environ, GRADE_REPORT=report, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TOOLS, env.get("PYTHONPATH")) if p)
    env.pop("GRADE_SUBMISSION", None)
    env.pop("GRADE_ONLY", None)
    env.pop("GRADE_STOP_ON", None)
    if stop_on:
        env["GRADE_STOP_ON"] = stop_on
    if submission:
        env["GRADE_SUBMISSION"] = os.path.abspath(submission)
    if only:
        env["GRADE_ONLY"] = ",".join(only)
    cmd = [sys.executable, "-m", "pytest", "-p", "grade_plugin", "-p", "no:cacheprovider", *args]
    start = time.monotonic()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            cmd,
            cwd=root,
            env=env,
            start_new_session=True,
            stdout=log if quiet else None,
            stderr=subprocess.STDOUT,
        )
        timed_out = _wait_and_tell(proc, report, start + timeout)
        code = proc.returncode
        if quiet and code not in (0, 1, 5):  # 1: tests failed, 5: none collected
            log.seek(0)
            print(log.read().decode(errors="replace"), file=sys.stderr)
    return code, time.monotonic() - start, timed_out


def _wait_and_tell(proc, report, deadline):
    """Wait for ``proc``; print "still running: TEST (N s)" for a test that takes long; kill it
    (pytest and every rank it started, torchrun's workers included) at ``deadline``."""
    offset, running, told = 0, None, 0
    while True:
        try:
            proc.wait(timeout=0.25)
            return False
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() > deadline:
            kill_tree(proc.pid)
            proc.wait()
            return True
        with open(report) as f:
            f.seek(offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        offset += len(complete.encode())
        for line in complete.splitlines():
            event = json.loads(line)
            if event["event"] == "start":
                running, since, told = event["nodeid"], time.monotonic(), 0
            elif event["event"] == "result" and event["nodeid"] == running:
                running = None
        if running and time.monotonic() - since >= (told + 1) * NOTICE_S:
            told += 1
            name = running.split("::", 1)[-1]
            print(f"still running: {name} ({told * NOTICE_S:.0f} s)", flush=True)


def _events(report):
    with open(report) as f:
        return [json.loads(line) for line in f if line.strip()]


def collect(root=ROOT, only=None):
    """Every graded test: dicts with ``nodeid``, ``points``, ``solutions`` and ``needs``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.jsonl")
        open(report, "w").close()
        args = ["--collect-only", "-q", "-m", "grade"]
        code, _, _ = _pytest(root, args, report, timeout=600, quiet=True, only=only)
        graded = [e for e in _events(report) if e["event"] == "collected"]
    if code not in (0, 5):  # 5: nothing collected
        raise RuntimeError(f"collecting the graded tests failed (pytest exit code {code})")
    return graded


def outcomes(events):
    """nodeid -> Outcome from the plugin's result events (set-up, call and teardown)."""
    out = {}
    for e in (e for e in events if e["event"] == "result"):
        now = out.get(e["nodeid"], Outcome(True, ""))
        if e["outcome"] != "passed" and now.passed:  # the first failure is the one to read
            now = Outcome(False, e["output"], tuple(e.get("stubs", ())))
        out[e["nodeid"]] = now
    return out


def run_graded(
    root,
    submission=None,
    nodeids=None,
    per_test_s=180,
    overall_s=1800,
    quiet=False,
    only=None,
    stop_on=None,
):
    """Run the graded tests (or just ``nodeids``); return (graded, outcomes, seconds, timed out).

    A test file that cannot be collected (the submission fails on import) leaves its tests out
    of ``graded`` but not of ``outcomes``: each of its tests that the reference has (from
    ``collect()``) is entered there as failed, with the collection error as its output."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.jsonl")
        open(report, "w").close()
        args = ["-m", "grade", f"--timeout={per_test_s}", "-q" if quiet else "-v"]
        args += ["--continue-on-collection-errors", "--tb=short", "-rN", "--disable-warnings"]
        args += ["--no-header"]
        args += list(nodeids or ["tests"])
        _, seconds, timed_out = _pytest(
            root, args, report, submission, overall_s, quiet, only, stop_on
        )
        events = _events(report)
    graded = [e for e in events if e["event"] == "collected"]
    results = outcomes(events)
    for e in (e for e in events if e["event"] == "collect_error"):
        results[("collect_error", e["nodeid"])] = Outcome(
            False, "could not be collected:\n" + e["output"]
        )
    return graded, results, seconds, timed_out


def result_of(results, nodeid):
    """The Outcome of a test; a test never run scores zero and says why."""
    if nodeid in results:
        return results[nodeid]
    for key, value in results.items():
        if isinstance(key, tuple) and nodeid.startswith(key[1]):
            return value
    return Outcome(False, "not run: the grader's time ran out")


def first_line(output):
    """A failure's first line: its assertion message (what the mistakes check matches)."""
    return (output.strip().splitlines() or [""])[0]


def blocked_by(graded, results):
    """nodeid -> "blocked by `X` (why)" for each failing test a region it needs explains.

    A needed region is "not implemented" when its stub raised NotImplementedError in any test,
    and "fails its own tests" when a test naming it fails on its own account (not blocked
    itself); when all its failing tests are blocked, by what blocks them. A test that ran into
    another region's stub is blocked by it, whether or not its marker names it. A test is never
    blocked by its own region: in a cycle of needs the test asked about first shows its failure."""
    stubbed = {s for r in results.values() for s in r.stubs}
    tests = {g["nodeid"]: g for g in graded}
    memo = {}  # nodeid -> (region, why) or None: fails on its own account

    def why(nodeid):
        if nodeid in memo:
            return memo[nodeid]
        memo[nodeid] = None
        mine, raised = tests[nodeid]["solutions"], result_of(results, nodeid).stubs
        if any(s in mine for s in raised):
            return None  # its own region is the stub: not implemented, nothing else to blame
        others = [s for s in raised if s not in mine]  # the stub it ran into says it needs it
        for need in [*others, *tests[nodeid].get("needs", ())]:
            if need in mine:
                continue
            if need in stubbed:
                memo[nodeid] = (need, "not implemented")
                break
            own = [
                t
                for t in tests
                if t != nodeid and need in tests[t]["solutions"] and not result_of(results, t)[0]
            ]
            causes = [why(t) for t in own]
            if any(c is None for c in causes):
                memo[nodeid] = (need, "fails its own tests")
                break
            upstream = [c for c in causes if c[0] not in mine]
            if upstream:
                memo[nodeid] = upstream[0]
                break
        return memo[nodeid]

    failing = [t for t in tests if not result_of(results, t)[0]]
    blocked = {t: why(t) for t in failing}
    return {
        t: f"blocked by `{region.split('.', 1)[-1]}` ({reason})"
        for t, (region, reason) in ((t, b) for t, b in blocked.items() if b)
    }


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


_IMPORT_CHECK = """
import importlib, json, sys, traceback
out = {}
for name, module in json.loads(sys.argv[1]).items():
    try:
        importlib.import_module(module)
    except BaseException as e:
        line = getattr(e, "lineno", None) if isinstance(e, SyntaxError) else None
        for frame in traceback.extract_tb(e.__traceback__):
            if frame.filename.endswith(name):
                line = frame.lineno
        first = (str(e).splitlines() or [""])[0]
        out[name] = f"{type(e).__name__}" + (f" at line {line}" if line else "") + f": {first}"
print(json.dumps(out))
"""


def import_errors(staged, names):
    """{file: "SyntaxError at line 118: ..."} for each of ``names`` that fails to import."""
    modules = {n: os.path.splitext(n)[0].replace(os.sep, ".") for n in names}
    if not modules:
        return {}
    env = dict(os.environ, PYTHONPATH=os.path.abspath(staged), CUDA_VISIBLE_DEVICES="")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _IMPORT_CHECK, json.dumps(modules)],
            cwd=staged,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return {n: "importing it did not finish within 120 s" for n in names}


def file_of(test, files):
    """The assignment file a graded test's first solution lives in (by its stem)."""
    stem = test["solutions"][0].split(".", 1)[0] if test["solutions"] else "?"
    return next((f for f in files if os.path.splitext(os.path.basename(f))[0] == stem), stem)


def results_json(graded, results, timed_out, note="", broken=None, files=()):
    """Gradescope's autograder format: top-level score, and one entry per graded test.

    ``broken`` maps a file that could not be imported to why: its tests say so first."""
    tests, blocked = [], blocked_by(graded, results)
    for g in graded:
        passed, output = result_of(results, g["nodeid"])[:2]
        name = file_of(g, files)
        if not passed and name in (broken or {}):
            output = f"could not import {os.path.basename(name)}: {broken[name]}\n\n{output}"
        elif not passed and g["nodeid"] in blocked:
            output = blocked[g["nodeid"]]
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


def _solutions(test):
    return test["name"].split(": ", 1)[0].split(", ")


def score_table(results, broken=None):
    """Per assignment file: graded tests, passed, points earned and maximum (and why not)."""
    rows = defaultdict(lambda: [0, 0, 0, 0])
    for t in results["tests"]:
        row = rows[_solutions(t)[0].split(".", 1)[0] + ".py"]
        row[0] += 1
        row[1] += t["score"] == t["max_score"]
        row[2] += t["score"]
        row[3] += t["max_score"]
    why = {os.path.basename(f): error for f, error in (broken or {}).items()}
    lines = [f"{'assignment':<22}{'tests':>7}{'passed':>8}{'points':>12}"]
    for name, (n, ok, got, most) in sorted(rows.items()):
        line = f"{name:<22}{n:>7}{ok:>8}{f'{got}/{most}':>12}"
        lines.append(line + (f"   could not import {name}: {why[name]}" if name in why else ""))
    lines.append(f"{'total':<22}{len(results['tests']):>7}")
    lines[-1] += f"{sum(r[1] for r in rows.values()):>8}"
    earned = f"{results['score']}/{results['max_score']}"
    lines[-1] += f"{earned:>12}"
    return "\n".join(lines)


def function_lines(staged, files):
    """qualname -> the line its function starts on, in the files being graded (the student's)."""
    lines = {}
    for name in files:
        stem = os.path.splitext(os.path.basename(name))[0]
        try:
            with open(os.path.join(staged, name)) as f:
                tree = ast.parse(f.read())
        except (OSError, SyntaxError, ValueError):
            continue

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines.setdefault(f"{prefix}.{child.name}", child.lineno)
                    visit(child, f"{prefix}.{child.name}")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}.{child.name}")

        visit(tree, stem)
    return lines


def function_table(results, regions, lines, width=64):
    """Per region: its line in the graded file, tests passed, points, the first failing line."""
    rows = ["", f"{'function (line)':<52}{'tests':>7}{'points':>9}   first failing line"]
    for r in regions:
        mine = [t for t in results["tests"] if r.qualname in _solutions(t)]
        if not mine:
            continue
        ok = sum(t["score"] == t["max_score"] for t in mine)
        got, most = sum(t["score"] for t in mine), sum(t["max_score"] for t in mine)
        failing = [t for t in mine if t["score"] != t["max_score"]]
        first = first_line(failing[0]["output"]) if failing else ""
        if first.startswith(f"NotImplementedError: {r.qualname}:"):
            first = "not implemented"
        first = first if len(first) <= width else first[: width - 3] + "..."
        where = f"{r.file}:{lines[r.qualname]}" if r.qualname in lines else r.file
        label = f"{r.qualname.split('.', 1)[1]} ({where})"
        rows.append(f"{label:<52}{f'{ok}/{len(mine)}':>7}{f'{got}/{most}':>9}   {first}")
    return "\n".join(rows)


def failures_text(results):
    """Each failure once, for the console: its first line, and a few lines under it."""
    out = []
    for t in results["tests"]:
        if t["score"] == t["max_score"]:
            continue
        lines = t["output"].strip().splitlines() or [""]
        name = t["name"].split("::", 1)[-1]
        points = f"{t['max_score']} point" + ("s" if t["max_score"] != 1 else "")
        out.append(f"FAILED {name} ({points}): {lines[0]}")
        short = lines[0].startswith("blocked by") or "NotImplementedError:" in lines[0]
        rest = [line for line in lines[1:] if line.strip()]
        if not short and rest:
            out += ["    " + line for line in rest[:CONSOLE_LINES]]
            if len(rest) > CONSOLE_LINES:
                out.append("    ... (the rest in results.json)")
    return "\n".join(out)


def check_only(only, regions):
    """``only`` (comma-separated regions or file stems) as a list; unknown names exit."""
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    names = {r.qualname for r in regions} | {r.qualname.split(".", 1)[0] for r in regions}
    unknown = [w for w in wanted if w not in names]
    if unknown or not wanted:
        sys.exit(
            f"grade: --only {only}: no such region or file; give a file stem "
            f"({', '.join(sorted({r.qualname.split('.', 1)[0] for r in regions}))}) "
            f"or a region, e.g. {regions[0].qualname if regions else 'stem.function'}"
        )
    return wanted


def grade(root, submission, out, per_test_s, overall_s, only=None):
    note = "Reference solution." if submission is None else ""
    regions = all_regions(root)
    wanted = check_only(only, regions) if only else None
    staged, found = None, []
    if submission is not None:
        if not os.path.isdir(submission):
            sys.exit(f"grade: --submission {submission}: no such folder")
        staged, found, missing = stage(submission, root)
        note = f"Graded files: {', '.join(found) or 'none'}."
        if missing:
            note += f" Not handed in (graded as the unfilled stub): {', '.join(missing)}."
    if wanted:
        note += f" Only the tests of {', '.join(wanted)} (and of the regions they need)."
    print(note.strip(), flush=True)
    broken = import_errors(staged, found) if staged else {}
    graded, results, seconds, timed_out = run_graded(
        root, staged, None, per_test_s, overall_s, only=wanted
    )
    if any(isinstance(k, tuple) for k in results):  # a test file failed: the reference's tests
        graded = collect(root, only=wanted)
    if not graded:
        print("grade: no graded tests found (no test carries @pytest.mark.grade)")
        return 1
    files = assignment_files(root)
    report = results_json(graded, results, timed_out, note, broken, files)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    failures = failures_text(report)
    if failures:
        print("\n" + failures)
    print()
    print(score_table(report, broken))
    print(function_table(report, regions, function_lines(staged or root, files)))
    shown = os.path.relpath(out) if out.startswith(os.getcwd() + os.sep) else out
    print(f"\n{shown} written; grading took {seconds:.0f} s")
    full = report["score"] == report["max_score"]
    return 0 if submission is not None or full else 1


def check_regions(root, per_test_s, overall_s, only=None):
    """Stub one region at a time; every graded test that names it must fail. Returns exit code.
    ``only``: the regions or file stems to check (check_only's list; default: every region)."""
    regions = all_regions(root)
    if only:
        regions = [r for r in regions if r.qualname in only or r.qualname.split(".")[0] in only]
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


def load_mistakes(root, which=""):
    """Every catalogued mistake under ``root``/tests/mistakes whose region starts with ``which``."""
    if root not in sys.path:
        sys.path.insert(0, root)  # the catalogues import their record from tests.mistakes
    found = []
    for path in sorted(glob.glob(os.path.join(root, "tests", "mistakes", "*.py"))):
        stem = os.path.splitext(os.path.basename(path))[0]
        if stem.startswith("_") or not (stem.startswith(which) or which.startswith(stem)):
            continue
        spec = importlib.util.spec_from_file_location(f"_grade_mistakes_{stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        found += [m for m in module.MISTAKES if m.region.startswith(which)]
    return found


def splice(text, region, body):
    """``text`` with ``region``'s lines (markers included) replaced by ``body`` at its indent."""
    lines = text.splitlines(keepends=True)
    body = textwrap.indent(textwrap.dedent(body).strip("\n") + "\n", region.indent)
    lines[region.begin - 1 : region.end] = [body]
    return "".join(lines)


def check_mistakes(root, which, per_test_s, overall_s):
    """Splice each catalogued mistake into the reference; it must lose points, and a failing
    test's first line must contain its message. Prints one line per mistake; returns exit code."""
    mistakes = load_mistakes(root, which)
    if not mistakes:
        print(f"check-mistakes: no mistakes catalogued under tests/mistakes/ for {which or 'any'}")
        return 1 if which else 0
    regions = {r.qualname: r for r in all_regions(root)}
    graded = collect(root)
    defects, start = 0, time.monotonic()
    for m in mistakes:
        label = f"{m.region} / {m.name}"
        region = regions.get(m.region)
        tests = [g["nodeid"] for g in graded if m.region in g["solutions"]]  # its own first
        tests += [
            g["nodeid"]
            for g in graded
            if m.region in g.get("needs", ()) and g["nodeid"] not in tests
        ]
        if region is None or not tests:
            defects += 1
            why = "no such region" if region is None else "no graded test names or needs it"
            print(f"DEFECT {label}: {why}", flush=True)
            continue
        with tempfile.TemporaryDirectory() as staged:
            write_student(staged, root, only=set())  # every file, every region filled
            path = os.path.join(staged, region.file)
            with open(path) as f:
                text = splice(f.read(), region, m.body)
            with open(path, "w") as f:
                f.write(text)
            _, results, seconds, _ = run_graded(
                root, staged, tests, per_test_s, overall_s, True, stop_on=m.message
            )  # the run stops at the first failure that shows the message: the rest cannot undo it
        ran = [t for t in tests if t in results]
        firsts = [first_line(results[t].output) for t in ran if not results[t].passed]
        matching = [f for f in firsts if m.message in f]
        shown = (matching or firsts or [""])[0]
        shown = shown if len(shown) <= 160 else shown[:157] + "..."
        if not firsts:
            verdict, seen = "DEFECT", "every test passes: the mistake keeps its points"
        elif not matching:
            verdict, seen = "DEFECT", f"no first line contains {m.message!r}; first: {shown}"
        else:
            verdict, seen = "ok    ", shown
        defects += verdict == "DEFECT"
        print(
            f"{verdict} {label}: {len(firsts)} of {len(ran)} tests fail ({seconds:.0f} s): {seen}",
            flush=True,
        )
    print(
        f"\ncheck-mistakes: {len(mistakes)} mistakes, {defects} defects, "
        f"in {time.monotonic() - start:.0f} s"
    )
    return 1 if defects else 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--submission", help="a student's folder (default: grade the reference)")
    parser.add_argument("--root", default=ROOT, help="the reference repository (default: this one)")
    parser.add_argument("--out", help="results file (default: ROOT/build/results.json)")
    parser.add_argument(
        "--only",
        help="grade only these regions or files, comma-separated (muon_zero.newton_schulz, mhc)",
    )
    parser.add_argument("--check-regions", action="store_true", help="prove each region is graded")
    parser.add_argument(
        "--check-mistakes",
        nargs="?",
        const="",
        metavar="REGION",
        help="prove each catalogued mistake loses points (all, or a file stem or region)",
    )
    parser.add_argument("--per-test-timeout", type=float, default=180, help="seconds per test")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    args = parser.parse_args(argv)
    root = os.path.abspath(args.root)
    if args.per_test_timeout <= 0 or args.timeout <= 0:
        parser.error("--per-test-timeout and --timeout take a number of seconds above 0")
    if args.check_regions:
        only = check_only(args.only, all_regions(root)) if args.only else None
        return check_regions(root, args.per_test_timeout, args.timeout, only)
    if args.check_mistakes is not None:
        return check_mistakes(root, args.check_mistakes, args.per_test_timeout, args.timeout)
    out = args.out or os.path.join(root, "build", "results.json")
    return grade(root, args.submission, out, args.per_test_timeout, args.timeout, args.only)


if __name__ == "__main__":
    sys.exit(main())
