"""Grade the reference, or a student's files, with the graded tests; prove the grading honest.

    python tools/grade.py                   # the reference: exits 1 unless it scores full marks
    python tools/grade.py --submission DIR  # a student's folder (make grade SUBMISSION=DIR)
    python tools/grade.py --submission DIR --only muon_zero.newton_schulz  # a region, or a file
    python tools/grade.py --check-regions   # each region stubbed alone fails every test naming it
    python tools/grade.py --check-regions --only compose  # the same for one file's regions
    python tools/grade.py --check-mistakes  # each catalogued mistake loses points, with its message
    python tools/grade.py --check-alternatives  # each catalogued correct alternative keeps them

Only tests under tests/graded/ marked `@pytest.mark.grade(points=N, solution="FILESTEM.qualname",
needs=(...))` run (cases marked `ungraded` are left out). A submission is staged in a fresh folder:
the student version of every assignment file (tools/assignments.py), overwritten by the
submission's own copies, and the repository files they import. Neither this process nor the
pytest processes it starts import a staged file: the graded tests hand inputs to probes that run
in sandboxed workers (tools/sandbox.py; as root, as an unprivileged user) and decide here.

Each graded file (tests/graded/test_<stem>.py) runs in a pytest session of its own with its own
share of the overall time (`--timeout`): a hang scores that file's remaining tests zero and names
where it hung, and every other file is graded in full. Before the sessions each assignment file
is imported alone in a worker; one that fails (a syntax error, an exception, sys.exit, a hang) is
reported in each of its tests, and every other file that imports it (compose.py) gets a
placeholder that says so when used. A failing test whose `needs` region is unwritten, or whose
tests ran and failed, is reported as blocked by it. results.json (Gradescope's format) is written
once, at the end, after every process of the grading has been killed.
"""

import argparse
import ast
import contextlib
import ctypes
import functools
import glob
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import defaultdict
from typing import NamedTuple

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)
import sandbox  # noqa: E402  (imports no torch: this process stays small)
from assignments import (  # noqa: E402
    ASSIGNMENT_FILES,
    ROOT,
    all_regions,
    assignment_files,
    assignment_paths,
    graded_regions,
    support_files,
    write_student,
)
from grade_plugin import collect, events  # noqa: E402

NOTICE_S = float(os.environ.get("GRADE_NOTICE_S", 30))  # how often to say a test still runs
CONSOLE_LINES = 6  # traceback lines under each failure on the console (results.json has more)
IMPORT_S = float(os.environ.get("GRADE_IMPORT_S", 60))  # importing one assignment file
MIN_FILE_S = 60.0  # the least time a graded file is given
KILL_GRACE_S = 20.0  # a session past its time is killed this long after (it stops itself first)
MAX_MAPPED_BYTES = 2**22  # a submitted file larger than this is not parsed for its line numbers


class Outcome(NamedTuple):
    passed: bool
    output: str  # for a failure: the assertion message's line first, then a short traceback
    stubs: tuple = ()  # regions whose stub raised NotImplementedError in this test
    ran: bool = True  # False: never run (its file's time ran out), so it tells nothing of a region


class Run(NamedTuple):
    graded: list  # the collected graded tests (dicts: nodeid, points, solutions, needs)
    results: dict  # nodeid -> Outcome
    seconds: float
    notes: list  # lines for results.json's output: a file whose time ran out, out of memory
    broken: dict  # assignment file -> why it could not be imported


def _prctl(option, value):
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, ctypes.c_ulong(value), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _protect_self():
    """Processes orphaned below the grader come back to it (so it can kill them), and the
    kernel's out-of-memory killer takes a worker first, never the grader (as root)."""
    _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000" if os.geteuid() == 0 else "0")
    except OSError:
        pass


def kill_everything(keep=()):
    """Kill every process this grading started that is still alive (but ``keep``, the shared
    zygote, whose workers go all the same), and every process of the sandbox user."""
    for pid in sandbox.descendants(os.getpid()):
        if pid not in keep:
            sandbox.kill_tree(pid)
    sandbox.kill_sandbox_user()
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break


# ---- the staged folder ----


class Stage(NamedTuple):
    work: str  # the grading's folder (removed at the end)
    stage: str  # the staged files (root's, readable by all)
    probes: str  # the folder holding the probes package
    scratch: str  # the workers' writable folder
    private: str  # the grader's own files (reports), root's alone


def make_stage(root, files_dir, names):
    """A fresh grading folder: the repository files the assignment files import, then ``names``
    (assignment files) from ``files_dir``, and a copy of the probes and the models_*.py they share
    with the tests. Only the scratch folder is writable by the sandbox user."""
    work = tempfile.mkdtemp(prefix="grading-")
    os.chmod(work, 0o755)
    stage = os.path.join(work, "stage")
    for name in support_files(root):
        os.makedirs(os.path.join(stage, os.path.dirname(name)), exist_ok=True)
        shutil.copyfile(os.path.join(root, name), os.path.join(stage, name))
    for name in names:
        os.makedirs(os.path.join(stage, os.path.dirname(name)), exist_ok=True)
        shutil.copyfile(os.path.join(files_dir, name), os.path.join(stage, name))
    probes = os.path.join(work, "sandbox")
    graded = os.path.join(root, "tests", "graded")
    shutil.copytree(
        os.path.join(graded, "probes"),
        os.path.join(probes, "probes"),
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for name in os.listdir(graded):  # the models a test and its probes share (plain torch)
        if name.startswith("models_") and name.endswith(".py"):
            shutil.copyfile(os.path.join(graded, name), os.path.join(probes, name))
    for folder in (stage, probes):
        for d, dirs, fs in os.walk(folder):
            os.chmod(d, 0o755)
            for f in fs:
                os.chmod(os.path.join(d, f), 0o644)
    scratch, private = os.path.join(work, "scratch"), os.path.join(work, "private")
    os.makedirs(scratch, mode=0o700)
    os.makedirs(private, mode=0o700)
    uid, gid, _ = sandbox.identity()
    if uid is not None:
        os.chown(scratch, uid, gid)
    return Stage(work, stage, probes, scratch, private)


def stage(submission, root=ROOT, out=None):
    """The assignment files to grade, in ``out``: every stub, then the submission's files on
    top. Returns (out, files found in the submission, files graded as their stub)."""
    out = out or tempfile.mkdtemp(prefix="submission-")
    shutil.rmtree(out, ignore_errors=True)
    names = write_student(out, root)
    found = []
    for name in names:  # memory/memory_timeline.py may also be handed in as memory_timeline.py
        for given in (name, os.path.basename(name)):
            path = os.path.join(submission, given)
            inside = os.path.realpath(path).startswith(os.path.realpath(submission) + os.sep)
            if os.path.isfile(path) and inside:  # a link out of the upload is not its file
                shutil.copyfile(path, os.path.join(out, name))
                found.append(name)
                break
    return out, found, [n for n in names if n not in found]


def _module(name):
    return os.path.splitext(name)[0].replace(os.sep, ".")


def affected(folder, names, changed):
    """Of the assignment files ``names`` in ``folder``, those in ``changed`` and those that import
    one of them, directly or not: the only ones a change to ``changed`` can stop importing."""
    imports = {}
    for name in names:
        try:
            with open(os.path.join(folder, name), "rb") as f:
                tree = ast.parse(f.read())
        except (OSError, SyntaxError, ValueError, RecursionError):
            imports[name] = None  # unreadable here: the import check decides
            continue
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
        imports[name] = found
    out = {n for n in names if n in changed or imports[n] is None}
    while True:
        more = {n for n in names if n not in out and imports[n] & {_module(m) for m in out}}
        if not more:
            return [n for n in names if n in out]
        out |= more


# ---- running the graded test files ----


def graded_files(root):
    """tests/graded/test_*.py, in the order of ASSIGNMENT_FILES' stems (the others after)."""
    found = sorted(glob.glob(os.path.join(root, "tests", "graded", "test_*.py")))
    stems = [os.path.splitext(os.path.basename(f))[0] for f in ASSIGNMENT_FILES]

    def order(path):
        stem = os.path.basename(path)[len("test_") : -len(".py")]
        return (stems.index(stem) if stem in stems else len(stems), path)

    return [os.path.relpath(f, root) for f in sorted(found, key=order)]


def weight(root, test_file):
    """How much of the time a graded file gets: its number of graded test functions."""
    with open(os.path.join(root, test_file)) as f:
        tree = ast.parse(f.read())
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            count += any("grade" in ast.unparse(d) for d in node.decorator_list)
    return max(1, count)


def _session(root, test_file, args, env, deadline, quiet, warm=None):
    """One pytest session over ``test_file``; returns (events, exit code, killed at deadline).
    ``warm``: a warm_pytest.Server to fork the session from (the checks' many sessions)."""
    report = os.path.join(env["GRADE_PRIVATE"], "report.jsonl")
    open(report, "w").close()
    env = dict(env, GRADE_REPORT=report, GRADE_DEADLINE=f"{deadline:.3f}")
    argv = ["-p", "grade_plugin", "-p", "no:cacheprovider"]
    argv += ["--confcutdir", os.path.join(root, "tests", "graded"), *args]
    with tempfile.TemporaryFile() as log:
        if warm is not None:
            proc = warm.start(argv, root, env, log if quiet else None)
        else:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", *argv],
                cwd=root,
                env=env,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=log if quiet else None,
                stderr=subprocess.STDOUT,
            )
        killed = _wait_and_tell(proc, report, deadline + KILL_GRACE_S)
        if quiet and proc.returncode not in (0, 1, 5):  # 1: tests failed, 5: none collected
            log.seek(0)
            print(log.read().decode(errors="replace")[-5000:], file=sys.stderr)
    return events(report), proc.returncode, killed


def _wait_and_tell(proc, report, deadline):
    """Wait for ``proc``; print "still running: TEST (N s)" for a test that takes long; kill it
    and everything below it at ``deadline`` (time.time())."""
    offset, running, told, since = 0, None, 0, 0.0
    while True:
        try:
            proc.wait(timeout=0.25)
            return False
        except subprocess.TimeoutExpired:
            pass
        if time.time() > deadline:
            sandbox.kill_tree(proc.pid)
            proc.wait()
            return True
        with open(report, "rb") as f:
            f.seek(offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event["event"] == "start":
                running, since, told = event["nodeid"], time.monotonic(), 0
            elif event["event"] == "result" and event["nodeid"] == running:
                running = None
        if running and time.monotonic() - since >= (told + 1) * NOTICE_S:
            told += 1
            name = running.split("::", 1)[-1]
            print(f"still running: {name} ({told * NOTICE_S:.0f} s)", flush=True)


def outcomes(events):
    """nodeid -> Outcome from the plugin's result events (set-up, call and teardown)."""
    out = {}
    for e in (e for e in events if e["event"] == "result"):
        now = out.get(e["nodeid"], Outcome(True, ""))
        if e["outcome"] != "passed" and now.passed:  # the first failure is the one to read
            ran = not e["output"].startswith("not run:")
            now = Outcome(False, e["output"], tuple(e.get("stubs", ())), ran)
        out[e["nodeid"]] = now
    return out


def _cut_off(test_file, seconds, events, results, died):
    """Outcomes for the tests of a session that did not finish: the one running, and the rest."""
    running = None
    for e in events:
        if e["event"] == "start":
            running = e["nodeid"]
        elif e["event"] == "result" and e["nodeid"] == running and e["when"] == "teardown":
            running = None
    name = os.path.basename(test_file)
    why = f"{name}'s process died ({died})" if died else f"{name}'s time ({seconds:.0f} s) ran out"
    cut = {}
    for e in (e for e in events if e["event"] == "collected"):
        if e["nodeid"] in results:
            continue
        if e["nodeid"] == running:
            cut[e["nodeid"]] = Outcome(False, f"did not finish: {why} while it ran")
        else:
            cut[e["nodeid"]] = Outcome(False, f"not run: {why}", ran=False)
    return cut, running


def run_graded(
    root,
    files_dir,
    nodeids=None,
    per_test_s=180,
    overall_s=1800,
    quiet=False,
    only=None,
    stop_on=None,
    names=None,
    zygote=None,
    changed=None,
):
    """Stage the assignment files in ``files_dir`` and run the graded tests (or ``nodeids``),
    one pytest session per graded file. ``zygote``: one_zygote's, kept for the next run (else one
    of its own, closed at the end). ``changed``: the only files that differ from the reference
    (the checks' splices): the import check skips the files that neither are one nor import one.
    Returns a Run."""
    start = time.time()
    _protect_self()
    names = names or assignment_files(root)
    where = make_stage(root, files_dir, names)
    env = dict(os.environ, GRADE_STAGE=where.stage, GRADE_PROBES=where.probes)
    env.update(GRADE_SCRATCH=where.scratch, GRADE_PRIVATE=where.private, GRADE_ISOLATED="1")
    env.update(PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = TOOLS
    for key in ("GRADE_SUBMISSION", "GRADE_ONLY", "GRADE_STOP_ON", "GRADE_BROKEN"):
        env.pop(key, None)
    if stop_on:
        env["GRADE_STOP_ON"] = stop_on
    keys = ("GRADE_STAGE", "GRADE_PROBES", "GRADE_SCRATCH", "GRADE_ZYGOTE")
    saved = {k: os.environ.get(k) for k in keys}
    reused = zygote is not None and zygote.alive()
    env["GRADE_ZYGOTE"] = zygote.path if reused else os.path.join(where.private, "zygote.sock")
    os.environ.update({k: env[k] for k in keys})
    graded, results, notes = [], {}, []
    warm = None
    if reused:
        shared = zygote
        if zygote.pytest is None:  # the checks' sessions: forks of one warm pytest
            import warm_pytest

            zygote.pytest = warm_pytest.Server(env)
        warm = zygote.pytest
    else:
        shared = sandbox.shared_zygote(env["GRADE_ZYGOTE"], sandbox.preload_for(root))
    keep = (shared.proc.pid, warm.proc.pid) if warm else (shared.proc.pid,)
    try:
        checked = names if changed is None else affected(where.stage, names, changed)
        broken = sandbox.import_check([_module(n) for n in checked], IMPORT_S)
        sandbox.close()
        kill_everything(keep=keep)
        reasons = {_module(n): f"{n} could not be imported: {why}" for n, why in broken.items()}
        env["GRADE_BROKEN"] = json.dumps(reasons)
        if only:
            env["GRADE_ONLY"] = ",".join(only)
        by_file = defaultdict(list)
        for nodeid in nodeids or []:
            by_file[nodeid.split("::")[0]].append(nodeid)
        files = [f for f in graded_files(root) if not nodeids or f in by_file]
        need = {f: weight(root, f) for f in files}
        total = sum(need.values()) or 1
        overall_end = start + overall_s
        for i, test_file in enumerate(files):
            later = sum(max(MIN_FILE_S, overall_s * need[f] / total) for f in files[i + 1 :])
            left = overall_end - time.time()
            budget = max(min(MIN_FILE_S, left), left - later)
            args = ["-m", "grade and not ungraded", f"--timeout={per_test_s}"]
            args += ["-q" if quiet else "-v", "--tb=short", "-rN", "--disable-warnings"]
            args += ["--no-header", *(by_file[test_file] if nodeids else [test_file])]
            try:
                graded_file = _grade_file(root, test_file, args, env, budget, quiet, only, warm)
            except Exception as error:  # the grader's own failure: this file alone scores zero
                graded_file = _not_graded(root, test_file, only, error)
            finally:
                kill_everything(keep=keep)
            found, mine, cut, note = graded_file
            if note:
                notes.append(note)
            graded += [e for e in found if e["event"] == "collected"]
            results.update(mine)
            results.update(cut)
            if stop_on and any(
                not o.passed and stop_on in first_line(o.output) for o in mine.values()
            ):
                break
    finally:
        sandbox.close()
        if not reused:
            shared.close()
        kill_everything(keep=keep if reused else ())
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(where.work, ignore_errors=True)
    oom = [(g, results[g["nodeid"]]) for g in graded if g["nodeid"] in results]
    oom = [(g, o) for g, o in oom if first_line(o.output).startswith("out of memory")]
    if oom:
        g, o = oom[0]
        notes.insert(0, _oom_line(g["nodeid"], first_line(o.output)))
    return Run(graded, results, time.time() - start, notes, broken)


def _grade_file(root, test_file, args, env, budget, quiet, only, warm=None):
    """One graded file's session: (events, outcomes, outcomes of the tests it did not finish,
    a note when it died or ran out of time)."""
    began = time.time()
    found, code, killed = _session(root, test_file, args, env, began + budget, quiet, warm)
    mine = outcomes(found)
    died = None
    if code is not None and code < 0 and not killed:
        died = f"signal {-code}" + (", out of memory" if -code == signal.SIGKILL else "")
    cut, running = _cut_off(test_file, time.time() - began, found, mine, died)
    if not any(e["event"] == "collected" for e in found):  # it died before collecting
        found += collect(root, [test_file], only)
        cut, running = _cut_off(test_file, time.time() - began, found, mine, died)
    note = ""
    if killed or died or cut:
        what = f"died ({died})" if died else "ran out of time"
        note = (
            f"{os.path.basename(test_file)} {what} after {time.time() - began:.0f} s"
            + (f", in {running.split('::', 1)[-1]}" if running else "")
            + "; its tests not run score zero."
        )
    return found, mine, cut, note


def _not_graded(root, test_file, only, error):
    """What _grade_file returns for a file the grader itself failed on: each of its tests
    listed with its points, none scored."""
    why = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
    try:
        found = collect(root, [test_file], only)
    except Exception:
        found = []
    cut = {
        e["nodeid"]: Outcome(False, f"not run: the grader failed on this file ({why})", ran=False)
        for e in found
    }
    note = f"{os.path.basename(test_file)} could not be graded ({why}); its tests score zero."
    return found, {}, cut, note


@contextlib.contextmanager
def one_zygote(root):
    """A zygote for many run_graded calls (the checks grade once per region or mistake): torch
    is imported once for all of them; a run that finds it dead starts its own."""
    folder = tempfile.mkdtemp(prefix="grade-zygote-")  # this user's alone, as the socket must be
    zygote = sandbox.shared_zygote(os.path.join(folder, "zygote.sock"), sandbox.preload_for(root))
    zygote.path, zygote.pytest = os.path.join(folder, "zygote.sock"), None  # pytest: run_graded's
    try:
        yield zygote
    finally:
        if zygote.pytest is not None:
            zygote.pytest.close()
        zygote.close()
        shutil.rmtree(folder, ignore_errors=True)


def _oom_line(nodeid, first):
    limit = sandbox.memory_limit()
    if limit:
        more = f"{2 * limit / 2**30:.1f} GB (it is {limit / 2**20:.0f} MB)"
    else:
        more = "2 GB or more"
    ranks = first.split(" ranks", 1)[0].rsplit(" ", 1)[-1] if " ranks" in first else "1"
    return (
        f"out of memory in test {nodeid.split('::', 1)[-1]} at {ranks} ranks; raise the "
        f"container's memory to {more}"
    )


def result_of(results, nodeid):
    """The Outcome of a test; a test never run scores zero and says why."""
    return results.get(nodeid, Outcome(False, "not run: the grading stopped before it", ran=False))


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
            own = [  # its tests that ran and failed (one never run tells nothing)
                t
                for t in tests
                if t != nodeid
                and need in tests[t]["solutions"]
                and not result_of(results, t).passed
                and result_of(results, t).ran
            ]
            # the tests needing least first, up to one failing on its own: asking on would ask
            # about tests of `need` that need this one, while this one's answer is not known
            causes = []
            for t in sorted(own, key=lambda t: len(tests[t].get("needs", ()))):
                causes.append(why(t))
                if causes[-1] is None:
                    break
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


def file_of(test, files):
    """The assignment file a graded test's first solution lives in (by its stem)."""
    stem = test["solutions"][0].split(".", 1)[0] if test["solutions"] else "?"
    return next((f for f in files if os.path.splitext(os.path.basename(f))[0] == stem), stem)


def results_json(graded, results, notes=(), note="", broken=None, files=()):
    """Gradescope's autograder format: top-level score, and one entry per graded test.

    ``notes`` lead the output (out of memory first); ``broken`` maps a file that could not be
    imported to why: its tests say so first."""
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
    return {
        "score": total,
        "max_score": sum(t["max_score"] for t in tests),
        "output": "\n".join([*notes, note.strip()]).strip(),
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
    """qualname -> the line its function starts on, in the files being graded (the student's).
    A file that cannot be mapped (too big, not UTF-8, binary, too deep for the parser: a
    RecursionError or MemoryError) is left out: the table then names it without lines."""
    lines = {}
    for name in files:
        try:
            lines.update(_lines_of(os.path.join(staged, name)))
        except Exception:  # the student's file: whatever it holds, only its lines go missing
            continue
    return lines


def _lines_of(path):
    stem, lines = os.path.splitext(os.path.basename(path))[0], {}
    if os.path.getsize(path) > MAX_MAPPED_BYTES:
        return lines
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())

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


def write_results(report, out):
    """Write results.json once, whole (a reader never sees half of it)."""
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(out), prefix=".results-")
    with os.fdopen(fd, "w") as f:
        json.dump(report, f, indent=2)
    os.chmod(tmp, 0o644)
    os.replace(tmp, out)


def grade(root, submission, out, per_test_s, overall_s, only=None):
    note = "Reference solution." if submission is None else ""
    regions = graded_regions(root)
    wanted = check_only(only, regions) if only else None
    files_dir, found = root, []
    if submission is not None:
        if not os.path.isdir(submission):
            sys.exit(f"grade: --submission {submission}: no such folder")
        files_dir, found, missing = stage(submission, root)
        note = f"Graded files: {', '.join(found) or 'none'}."
        if missing:
            note += f" Not handed in (graded as the unfilled stub): {', '.join(missing)}."
    if wanted:
        note += f" Only the tests of {', '.join(wanted)} (and of the regions they need)."
    print(note.strip(), flush=True)
    print(sandbox.mode_line(), flush=True)
    nodeids = [g["nodeid"] for g in collect(root, only=wanted)] if wanted else None
    files = assignment_files(root)
    try:
        run = run_graded(root, files_dir, nodeids, per_test_s, overall_s, only=wanted)
        function_at = function_lines(files_dir, files)
    finally:
        if files_dir != root:
            shutil.rmtree(files_dir, ignore_errors=True)
    if not run.graded:
        print("grade: no graded tests found (none under tests/graded/ carries @pytest.mark.grade)")
        return 1
    report = results_json(run.graded, run.results, run.notes, note, run.broken, files)
    write_results(report, out)  # once, after every process of the grading is gone
    failures = failures_text(report)
    if failures:
        print("\n" + failures)
    print()
    for line in run.notes:
        print(line)
    print(score_table(report, run.broken))
    print(function_table(report, regions, function_at))
    shown = os.path.relpath(out) if out.startswith(os.getcwd() + os.sep) else out
    print(f"\n{shown} written; grading took {run.seconds:.0f} s")
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
    with one_zygote(root) as zygote:  # torch imported once for every grading below
        for qualname in dict.fromkeys(r.qualname for r in regions):
            tests = [g["nodeid"] for g in graded if qualname in g["solutions"]]
            if not tests:
                bad.append(f"{qualname}: no graded test names it")
                print(f"FAIL {qualname}: no graded test names it", flush=True)
                continue
            changed = files_of_regions(root, [r for r in regions if r.qualname == qualname])
            with tempfile.TemporaryDirectory() as staged:
                write_student(staged, root, only={qualname})
                run = run_graded(
                    root, staged, tests, per_test_s, overall_s, True, zygote=zygote, changed=changed
                )
            seconds = run.seconds
            passing = [t for t in tests if result_of(run.results, t).passed]
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


def _catalogue(root, folder, records, which=""):
    """The ``records`` list of every ``root``/tests/``folder``/<stem>.py whose regions start with
    ``which`` (a file stem or a region), in file order."""
    if root not in sys.path:
        sys.path.insert(0, root)  # the catalogues import their record from tests.<folder>
    found = []
    for path in sorted(glob.glob(os.path.join(root, "tests", folder, "*.py"))):
        stem = os.path.splitext(os.path.basename(path))[0]
        if stem.startswith("_") or not (stem.startswith(which) or which.startswith(stem)):
            continue
        spec = importlib.util.spec_from_file_location(f"_grade_{folder}_{stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        found += [m for m in getattr(module, records) if m.region.startswith(which)]
    return found


def load_mistakes(root, which=""):
    """Every catalogued mistake under ``root``/tests/mistakes whose region starts with ``which``."""
    return _catalogue(root, "mistakes", "MISTAKES", which)


def load_alternatives(root, which=""):
    """Every correct alternative under ``root``/tests/alternatives for regions starting with
    ``which``."""
    return _catalogue(root, "alternatives", "ALTERNATIVES", which)


def splice(text, region, body):
    """``text`` with ``region``'s lines (markers included) replaced by ``body`` at its indent."""
    lines = text.splitlines(keepends=True)
    body = textwrap.indent(textwrap.dedent(body).strip("\n") + "\n", region.indent)
    lines[region.begin - 1 : region.end] = [body]
    return "".join(lines)


def files_of_regions(root, regions):
    """The assignment files (as assignment_files names them) that hold ``regions``."""
    paths = assignment_paths(root)
    return {paths.get(r.file, r.file) for r in regions}


def stage_with(staged, root, bodies):
    """The reference in ``staged``, each (Region, body) pair of ``bodies`` spliced in."""
    write_student(staged, root, only=set())  # every file, every region filled
    paths = assignment_paths(root)
    by_file = defaultdict(list)
    for region, body in bodies:
        by_file[region.file].append((region, body))
    for name, pairs in by_file.items():
        path = os.path.join(staged, paths.get(name, name))
        with open(path) as f:
            text = f.read()
        for region, body in sorted(pairs, key=lambda p: -p[0].begin):  # lower lines keep place
            text = splice(text, region, body)
        with open(path, "w") as f:
            f.write(text)


def tests_of(graded, qualname):
    """The graded tests that name ``qualname``, then those that need it."""
    tests = [g["nodeid"] for g in graded if qualname in g["solutions"]]
    return tests + [
        g["nodeid"] for g in graded if qualname in g.get("needs", ()) and g["nodeid"] not in tests
    ]


@functools.cache
def _functions(path):  # a test file's module-level functions by name
    with open(path) as f:
        tree = ast.parse(f.read())
    return {f.name: f for f in tree.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_strings(root, nodeid):
    """The string constants (f-strings' literal parts too) of a test function and of the module
    functions it calls, transitively: where its failure messages are written."""
    path, name = nodeid.split("::")[0], nodeid.split("::")[-1].split("[")[0]
    functions, seen, strings = _functions(os.path.join(root, path)), set(), []
    todo = [name]
    while todo:
        if (current := todo.pop()) in seen or current not in functions:
            continue
        seen.add(current)
        for node in ast.walk(functions[current]):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.append(node.value)
            elif isinstance(node, ast.Name):
                todo.append(node.id)
    return strings


def apply_edits(reference, edits):
    """``reference`` (a region body at indentation 0) with each (old, new) of ``edits`` replaced
    in turn; raises ValueError naming an ``old`` that is missing or occurs more than once."""
    for old, new in edits:
        count = reference.count(old)
        if count != 1:
            where = "not found in" if count == 0 else f"found {count} times in"
            raise ValueError(f"the mistake no longer applies: {old!r} {where} the reference")
        reference = reference.replace(old, new)
    return reference


def mistake_body(root, region, mistake):
    """The body ``mistake`` splices into ``region``: its own, or the reference's with its edits."""
    if mistake.body is not None:
        return mistake.body
    return apply_edits(textwrap.dedent(reference_body(root, region)), mistake.edits)


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
    with one_zygote(root) as zygote:  # torch imported once for every grading below
        for m in mistakes:
            label = f"{m.region} / {m.name}"
            region = regions.get(m.region)
            tests = tests_of(graded, m.region)  # its own first, those that say its message first
            tests.sort(key=lambda t: not any(m.message in s for s in test_strings(root, t)))
            if region is None or not tests:
                defects += 1
                why = "no such region" if region is None else "no graded test names or needs it"
                print(f"DEFECT {label}: {why}", flush=True)
                continue
            try:
                body = mistake_body(root, region, m)
            except ValueError as e:
                defects += 1
                print(f"DEFECT {label}: {e}", flush=True)
                continue
            with tempfile.TemporaryDirectory() as staged:
                stage_with(staged, root, [(region, body)])
                # the run stops at the first failure that shows the message: the rest cannot undo it
                run = run_graded(
                    root,
                    staged,
                    tests,
                    per_test_s,
                    overall_s,
                    True,
                    stop_on=m.message,
                    zygote=zygote,
                    changed=files_of_regions(root, [region]),
                )
            results, seconds = run.results, run.seconds
            ran = [t for t in tests if t in results and results[t].ran]
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
                f"{verdict} {label}: {len(firsts)} of {len(ran)} tests fail "
                f"({seconds:.0f} s): {seen}",
                flush=True,
            )
    print(
        f"\ncheck-mistakes: {len(mistakes)} mistakes, {defects} defects, "
        f"in {time.monotonic() - start:.0f} s"
    )
    return 1 if defects else 0


def _failed(run, tests):
    """'nodeid: first line' of each of ``tests`` that did not pass in ``run``."""
    out = []
    for t in tests:
        outcome = result_of(run.results, t)
        if not outcome.passed:
            line = first_line(outcome.output)
            out.append(f"{t}: {line if len(line) <= 160 else line[:157] + '...'}")
    return out


def _code_lines(body):
    """A body's code lines, stripped, markers and blank lines left out (to compare two bodies)."""
    lines = (line.split("#", 1)[0].strip() for line in body.splitlines())
    return [line for line in lines if line]


def reference_body(root, region):
    """The reference's text of ``region``, markers included."""
    paths = assignment_paths(root)
    with open(os.path.join(root, paths.get(region.file, region.file))) as f:
        return "".join(f.readlines()[region.begin - 1 : region.end])


def check_alternatives(root, which, per_test_s, overall_s):
    """Splice the catalogued correct alternatives into the reference; every graded test that
    names or needs their region must still pass. Pass k splices each region's k-th alternative
    (all regions at once, one grading per pass); a failing pass is graded again region by region
    to blame an alternative. Every region must have one. Prints one line per alternative; returns
    exit code."""
    alternatives = load_alternatives(root, which)
    regions = {r.qualname: r for r in all_regions(root)}
    wanted = [q for q in regions if q.startswith(which)]
    by_region = defaultdict(list)
    for a in alternatives:
        by_region[a.region].append(a)
    defects, start = [], time.monotonic()
    for q in wanted:
        if q not in by_region:
            defects.append(f"{q}: no alternative catalogued under tests/alternatives/")
    graded = collect(root)
    usable = {}
    for q, alts in by_region.items():
        if q not in regions:
            defects += [f"{q} / {a.name}: no such region" for a in alts]
            continue
        reference = _code_lines(reference_body(root, regions[q]))
        copies = [a for a in alts if _code_lines(a.body) == reference]
        defects += [f"{q} / {a.name}: the reference's own body, not an alternative" for a in copies]
        alts = [a for a in alts if a not in copies]
        if not tests_of(graded, q):
            defects += [f"{q} / {a.name}: no graded test names or needs it" for a in alts]
        elif alts:
            usable[q] = alts
    with one_zygote(root) as zygote:  # torch imported once for every grading below
        for k in range(max(map(len, usable.values()), default=0)):
            chosen = {q: alts[k] for q, alts in usable.items() if len(alts) > k}
            tests = list(dict.fromkeys(t for q in chosen for t in tests_of(graded, q)))
            with tempfile.TemporaryDirectory() as staged:
                stage_with(staged, root, [(regions[q], a.body) for q, a in chosen.items()])
                changed = files_of_regions(root, [regions[q] for q in chosen])
                run = run_graded(
                    root, staged, tests, per_test_s, overall_s, True, zygote=zygote, changed=changed
                )
            failed = _failed(run, tests)
            print(
                f"pass {k + 1}: {len(chosen)} alternatives, {len(tests) - len(failed)} of "
                f"{len(tests)} graded tests pass ({run.seconds:.0f} s)",
                flush=True,
            )
            for line in failed:
                print(f"  failed {line}", flush=True)
            for q, a in chosen.items():
                own = tests_of(graded, q)
                if failed:  # blame: this alternative alone in the reference
                    with tempfile.TemporaryDirectory() as staged:
                        stage_with(staged, root, [(regions[q], a.body)])
                        changed = files_of_regions(root, [regions[q]])
                        alone = run_graded(
                            root,
                            staged,
                            own,
                            per_test_s,
                            overall_s,
                            True,
                            zygote=zygote,
                            changed=changed,
                        )
                    bad = _failed(alone, own)
                else:
                    bad = []
                label = f"{q} / {a.name}"
                if bad:
                    defects.append(f"{label}: {len(bad)} of {len(own)} tests fail: {bad[0]}")
                    print(f"FAIL {label}: {len(bad)} of {len(own)} tests fail", flush=True)
                    for line in bad:
                        print(f"  {line}", flush=True)
                else:
                    print(f"ok   {label}: {len(own)} graded tests pass", flush=True)
            if failed and not any(d.startswith(tuple(chosen)) for d in defects):
                defects.append(f"pass {k + 1}: tests fail only with all its alternatives together")
    print(
        f"\ncheck-alternatives: {len(alternatives)} alternatives, {len(defects)} defects, "
        f"in {time.monotonic() - start:.0f} s"
    )
    for line in defects:
        print("DEFECT", line)
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
    parser.add_argument(
        "--check-alternatives",
        nargs="?",
        const="",
        metavar="REGION",
        help="prove each catalogued correct alternative keeps full marks (all, a stem or region)",
    )
    parser.add_argument("--per-test-timeout", type=float, default=180, help="seconds per test")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    args = parser.parse_args(argv)
    root = os.path.abspath(args.root)
    if args.per_test_timeout <= 0 or args.timeout <= 0:
        parser.error("--per-test-timeout and --timeout take a number of seconds above 0")
    if args.check_regions:
        only = check_only(args.only, graded_regions(root)) if args.only else None
        return check_regions(root, args.per_test_timeout, args.timeout, only)
    if args.check_mistakes is not None:
        return check_mistakes(root, args.check_mistakes, args.per_test_timeout, args.timeout)
    if args.check_alternatives is not None:
        which = args.check_alternatives
        return check_alternatives(root, which, args.per_test_timeout, args.timeout)
    out = args.out or os.path.join(root, "build", "results.json")
    return grade(root, args.submission, out, args.per_test_timeout, args.timeout, args.only)


if __name__ == "__main__":
    sys.exit(main())
