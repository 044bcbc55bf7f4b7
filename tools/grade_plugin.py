"""pytest plugin for tools/grade.py: write each graded test's points and outcome as JSON lines.

Loaded with `-p grade_plugin`; writes to the file named by GRADE_REPORT, one line per event and
flushed at once, so a run killed at its time limit keeps every finished test's score. The file
lives where only the grader can write; the student's code runs in sandboxed workers that never
see this process, its environment or the file.
Events: "collected" (nodeid, points, solutions, needs), "start" (a test began: the grader says
which one is still running), "result" (outcome, and for a failure the output a student reads),
"collect_error". A failure's output leads with its assertion message (pytest's crash line; for a
test on several ranks, the first failing rank's), then a short traceback cut at its end; tensors
in assertion explanations are summarised, never printed whole; a failure shared by several tests
(a module-scoped fixture's) is written out once. GRADE_ONLY (comma-separated regions or file
stems) keeps only the tests naming them and the tests of the regions those need; GRADE_STOP_ON
ends the run at the first failure whose first line contains it (the mistakes check).
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import pytest

TOOLS = os.path.dirname(os.path.abspath(__file__))
# not pytest-reportlog: no event when a test starts (the grader names the test a file's time ran
# out in), no points; measured on two stubbed tests, 16,021 bytes of serialised reports vs 2,437


_FILE = None
MAX_LINES, MAX_CHARS = 30, 2500  # the traceback under the message: enough to find the line
_SEEN = {}  # a failure's text -> the first test that showed it
STUB_RAISED = re.compile(r"NotImplementedError: ([A-Za-z_][\w.]*):")


def _write(record):
    global _FILE
    if _FILE is None:
        _FILE = open(os.environ["GRADE_REPORT"], "a")
    _FILE.write(json.dumps(record) + "\n")
    _FILE.flush()


def solutions_of(marker):
    """The marker's `solution=` as a list of "FILESTEM.qualname" names (one or several)."""
    solution = marker.kwargs.get("solution", "")
    return [solution] if isinstance(solution, str) else list(solution)


def needs_of(marker):
    """The marker's `needs=`: the other regions the test calls, as a list of qualnames."""
    needs = marker.kwargs.get("needs", ())
    return [needs] if isinstance(needs, str) else list(needs)


def selected(graded, only):
    """Nodeids of ``graded`` (dicts with nodeid, solutions, needs) that ``only`` keeps.

    ``only`` holds regions ("muon_zero.pack_dense") or file stems ("muon_zero"): a test is kept
    when it names one, and so is every test of a region a kept test needs (so a blocked test can
    be told apart from a wrong one, as in the full run)."""

    def named(test, wanted):
        return any(s == w or s.split(".", 1)[0] == w for s in test["solutions"] for w in wanted)

    wanted, kept = set(only), set()
    while True:
        now = {g["nodeid"] for g in graded if named(g, wanted)}
        more = {n for g in graded if g["nodeid"] in now for n in g.get("needs", ())} - wanted
        kept |= now
        if not more:
            return kept
        wanted |= more


def pytest_configure(config):
    from _pytest.assertion import rewrite

    plain = rewrite._saferepr

    def summarised(obj):  # a tensor in an assert's explanation: its shape, never its values
        summary = _tensor_summary(obj)
        return summary if summary is not None else plain(obj)

    rewrite._saferepr = summarised


def _tensor_summary(obj):
    torch = __import__("sys").modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    if obj.numel() <= 8:  # a few values say more than a shape
        return " ".join(repr(obj).split())
    return f"tensor(shape={list(obj.shape)}, dtype={str(obj.dtype).replace('torch.', '')})"


def pytest_assertrepr_compare(config, op, left, right):
    """`assert a == b` on tensors: their shapes, and how far apart and where."""
    if op != "==" or (_tensor_summary(left) is None and _tensor_summary(right) is None):
        return None
    import torch

    def shown(value):
        return _tensor_summary(value) or repr(value)[:80]

    line = f"{shown(left)} {op} {shown(right)}"
    try:
        a, b = torch.as_tensor(left), torch.as_tensor(right)
        if a.shape != b.shape:
            line += f": shapes differ, {list(a.shape)} vs {list(b.shape)}"
        elif a.numel():
            diff = (a.double() - b.double()).abs()
            where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
            line += (
                f": max |difference| {diff.max().item():.3g} at {where} "
                f"({a[where].item():.6g} vs {b[where].item():.6g}), "
                f"{int((diff > 0).sum())} of {diff.numel()} elements differ"
            )
    except Exception:  # an explanation must never replace the failure it explains
        pass
    return [line]


@pytest.hookimpl(trylast=True)  # after -m: a case marked ungraded is neither run nor counted
def pytest_collection_modifyitems(session, config, items):
    graded = []
    for item in items:
        marker = item.get_closest_marker("grade")
        if marker is not None:
            points = marker.kwargs.get("points", marker.args[0] if marker.args else 1)
            graded.append(
                {
                    "event": "collected",
                    "nodeid": item.nodeid,
                    "points": points,
                    "solutions": solutions_of(marker),
                    "needs": needs_of(marker),
                }
            )
    only = [w.strip() for w in os.environ.get("GRADE_ONLY", "").split(",") if w.strip()]
    if only:
        keep = selected(graded, only)
        drop = [item for item in items if item.nodeid not in keep]
        items[:] = [item for item in items if item.nodeid in keep]
        graded = [g for g in graded if g["nodeid"] in keep]
        if drop:
            config.hook.pytest_deselected(items=drop)
    for record in graded:
        _write(record)


def pytest_collectreport(report):
    # a test file that cannot be imported (say, the student's module raises): its tests score zero
    if report.failed:
        text = report.longreprtext or ""
        _write({"event": "collect_error", "nodeid": report.nodeid, "output": _cut(text)})


def pytest_runtest_logstart(nodeid, location):
    _write({"event": "start", "nodeid": nodeid, "time": time.time()})


def crash_line(report):
    """pytest's crash message (the exception and its message), or "" where there is none."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    return (crash.message if crash is not None else "").strip()


def exception_of(traceback_text):
    """The exception line(s) that end a Python traceback's text (the last one raised)."""
    lines = traceback_text.rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    start = frames[-1] + 1 if frames else 0
    while start < len(lines) and lines[start].startswith(" "):  # the frame's source and carets
        start += 1
    return "\n".join(lines[start:]).strip() or traceback_text.strip()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    error = getattr(call.excinfo, "value", None)
    if report.failed and type(error).__name__ == "StudentCodeError":  # sandbox.py's
        report.grade_student = (str(error), tuple(getattr(error, "stubs", ())))
    errors = getattr(getattr(call.excinfo, "value", None), "errors", None)
    if report.failed and isinstance(errors, dict) and errors:  # spawn.RankFailure
        rank = min(errors)
        first = exception_of(errors[rank])
        same = [r for r in errors if r != rank and exception_of(errors[r]) == first]
        others = [r for r in errors if r != rank and r not in same]
        where = f"rank {rank}" + (f"; ranks {_ranks(same)} the same" if same else "")
        where += f"; ranks {_ranks(others)} failed otherwise" if others else ""
        report.grade_rank = (first, where, errors[rank])
    wanted = os.environ.get("GRADE_STOP_ON")  # the mistakes check: stop once it is seen
    if report.failed and wanted:
        rank = getattr(report, "grade_rank", None)
        first = (rank[0] if rank else crash_line(report)).splitlines()[:1]
        if first and wanted in first[0]:
            item.session.shouldfail = "the failure the mistakes check looks for was seen"
    return report


def _ranks(ranks):
    return ", ".join(str(r) for r in ranks)


def _cut(text, lines=MAX_LINES, chars=MAX_CHARS):
    """``text`` kept from its start: at most ``lines`` lines and ``chars`` characters."""
    kept = text.rstrip().splitlines()
    more = len(kept) - lines
    kept = "\n".join(kept[:lines])
    if len(kept) > chars:
        kept, more = kept[:chars], max(more, 1)
    return kept + (f"\n... ({more} more lines cut)" if more > 0 else "")


def student_output(report):
    """What a student reads for a failure: the message first, then a short traceback."""
    text = report.longreprtext or ""
    rank = getattr(report, "grade_rank", None)
    student = getattr(report, "grade_student", None)
    if student is not None:  # the sandbox's message says what happened, in the student's terms
        message, _, body = student[0].partition("\n")
        body = "\n".join(
            [body, *(line for line in text.splitlines() if line.startswith(("tests/", "  File")))]
        )
    elif rank is not None:
        first, where, traceback = rank
        lines = first.splitlines() or [""]
        message = "\n".join([f"{lines[0]}   [{where}]", *lines[1:]])
        body = traceback
    elif report.skipped:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else text
        message, body = f"skipped: {str(reason).strip()}", ""
    else:
        message = crash_line(report) or (text.strip().splitlines() or [""])[-1]
        body = text
    if report.when in ("setup", "teardown") and not report.skipped:
        head, _, rest = message.partition("\n")
        message = f"{head}\n(raised in the test's {report.when}: a fixture failed)\n{rest}".strip()
    # the exception's lines are the message above: the traceback keeps only where it was raised
    body = "\n".join(line for line in body.splitlines() if not line.startswith("E   "))
    key = (message, body)
    if report.when == "setup" and key in _SEEN and _SEEN[key] != report.nodeid:
        head = message.splitlines()[0] if message else ""
        return f"{head}\n(the same failure as {_SEEN[key]}: a fixture they share failed)"
    if report.when == "setup":  # a shared fixture's failure repeats in each test that uses it
        _SEEN.setdefault(key, report.nodeid)
    return f"{_cut(message, 20, 2000)}\n\n{_cut(body)}"  # a huge message is cut at its end too


def pytest_runtest_logreport(report):
    # a test passes when its call passed and set-up/teardown did not fail
    if report.when == "call" or report.outcome != "passed":
        output, stubs = "", []
        if not report.passed:
            output = student_output(report)
            student = getattr(report, "grade_student", None)
            if student is not None:
                stubs = sorted(student[1])
            else:
                everything = (report.longreprtext or "") + "".join(c for _, c in report.sections)
                stubs = sorted(set(STUB_RAISED.findall(everything)))
        _write(
            {
                "event": "result",
                "nodeid": report.nodeid,
                "when": report.when,
                "outcome": report.outcome,
                "seconds": round(report.duration, 2),
                "output": output,
                "stubs": stubs,
            }
        )


def pytest_sessionfinish(session):
    # the grader prints each failure itself, summarised: pytest's own failure sections would
    # repeat every traceback in full (thousands of lines for a stubbed file)
    session.config.option.tbstyle = "no"


# ---- the grader's side: running pytest with this plugin, reading what it wrote ----


def events(report):
    """The events in a report file (a last line cut off mid-write is left out)."""
    out = []
    with open(report) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def collect(root, files=None, only=None, timeout=600):
    """Every graded test under ``root``/tests/graded (or in ``files``): dicts with ``nodeid``,
    ``points``, ``solutions`` and ``needs``. Imports no submitted file (the tests never do)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.jsonl")
        open(report, "w").close()
        env = dict(os.environ, GRADE_REPORT=report, GRADE_ISOLATED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (TOOLS, env.get("PYTHONPATH")) if p)
        env.pop("GRADE_ONLY", None)
        if only:
            env["GRADE_ONLY"] = ",".join(only)
        cmd = [sys.executable, "-m", "pytest", "-p", "grade_plugin", "-p", "no:cacheprovider"]
        cmd += ["--confcutdir", os.path.join(root, "tests", "graded"), "--collect-only", "-q"]
        cmd += ["-m", "grade and not ungraded", *(files or [os.path.join("tests", "graded")])]
        proc = subprocess.run(
            cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode not in (0, 5):  # 5: nothing collected
            raise RuntimeError(
                f"collecting the graded tests failed (pytest exit code {proc.returncode}):\n"
                + (proc.stdout + proc.stderr)[-3000:]
            )
        return [e for e in events(report) if e["event"] == "collected"]
