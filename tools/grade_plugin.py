"""pytest plugin for tools/grade.py: write each graded test's points and outcome as JSON lines.

Loaded with `-p grade_plugin`; writes to the file named by GRADE_REPORT, one line per event and
flushed at once, so a run killed by the grader's overall timeout keeps every finished test's score.
"""

import json
import os

_FILE = None


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


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        marker = item.get_closest_marker("grade")
        if marker is not None:
            points = marker.kwargs.get("points", marker.args[0] if marker.args else 1)
            _write(
                {
                    "event": "collected",
                    "nodeid": item.nodeid,
                    "points": points,
                    "solutions": solutions_of(marker),
                }
            )


def pytest_collectreport(report):
    # a test file that cannot be imported (say, the student's module raises): its tests score zero
    if report.failed:
        text = (report.longreprtext or "")[-4000:]
        _write({"event": "collect_error", "nodeid": report.nodeid, "output": text})


def crash_line(report):
    """pytest's crash message (the exception and its message), or "" where there is none."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    return (crash.message if crash is not None else "").strip()


def pytest_runtest_logreport(report):
    # a test passes when its call passed and set-up/teardown did not fail
    if report.when == "call" or report.outcome != "passed":
        output = ""
        if not report.passed:  # the assertion message first, so it survives any truncation
            output = crash_line(report) + "\n\n" + (report.longreprtext or "")[-4000:]
        _write(
            {
                "event": "result",
                "nodeid": report.nodeid,
                "when": report.when,
                "outcome": report.outcome,
                "seconds": round(report.duration, 2),
                "output": output,
            }
        )
