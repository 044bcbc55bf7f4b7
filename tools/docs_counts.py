"""The counts the docs state, computed from the tree, and the marked spans that carry them.

A count in README.md, ASSIGNMENTS.md or docs/*.md is written between two markers,
`<!-- count:regions -->28<!-- /count -->`, and this file fills it: nobody types a count.

    python tools/docs_counts.py            # rewrite every marked span with the current counts
    python tools/docs_counts.py --check    # exit 1, naming each stale span, if one is out of date
    python tools/docs_counts.py --tests    # also the counts that need pytest's collection (~15 s)

Cheap counts read the tree (regions, mistakes, alternatives, notebooks, exercises, graded tests
and points from ASSIGNMENTS.md's generated table, which tests/test_assignments.py keeps current);
the test counts (`tests-default`, `tests-slow`, `replays-default`, `replays`) collect the suite.
Timings (`time:ci`, `time:make-test`, `time:grade-check`, ...) are read from docs/ci_timings.txt,
the "took N s" lines of a saved `.ci/run` output on a clean clone:

    CI=true bash .ci/run 2>&1 | tee ci.log; grep -E 'took [0-9]+ s' ci.log > docs/ci_timings.txt
"""

import argparse
import ast
import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import assignments  # noqa: E402

SPAN = re.compile(r"<!-- count:([\w:.-]+) -->(.*?)<!-- /count -->")
TEST_COUNTS = ("tests-default", "tests-slow", "tests", "replays-default", "replays")
DOCS = ("README.md", "ASSIGNMENTS.md", *sorted(glob.glob("docs/*.md", root_dir=ROOT)))


def _catalogue(kind):
    """How many entries tests/mistakes or tests/alternatives catalogue (grade.py's own loader)."""
    import grade

    return len(grade.load_mistakes(ROOT) if kind == "mistakes" else grade.load_alternatives(ROOT))


def exercises(source):
    """The exercises of one notebook source: its check cells (`# check: answer_x`)."""
    with open(source) as f:
        return sum(1 for line in f if line.startswith("# check: answer_"))


def notebook_sources():
    return sorted(glob.glob(os.path.join(ROOT, "notebooks", "src", "*.py")))


def graded_totals():
    """(graded tests, points) from the total row of ASSIGNMENTS.md's generated table."""
    with open(os.path.join(ROOT, "ASSIGNMENTS.md")) as f:
        row = re.search(
            r"\| \*\*total\*\* \| \d+ regions \| (\d+) graded tests \| (\d+) \|", f.read()
        )
    return (int(row.group(1)), int(row.group(2))) if row else (None, None)


TIMINGS = os.path.join(ROOT, "docs", "ci_timings.txt")
# a line of .ci/run's output -> the name of its timing; the slow tier prints its line twice, once
# per stream: the first is the stream of the rest of the tier, the second the checks' stream
TIMING_LINES = (
    (r"^make test: the default tier took (\d+) s", "make-test"),
    (r"^make test-slow: the slow tier took (\d+) s", "slow-rest"),
    (r"^make test-slow: the slow tier took (\d+) s", "slow-beside"),
    (r"^\.ci/run: make (grade-[\w-]+) took (\d+) s", None),
    (r"^\.ci/run: lint, both tiers and the grading checks took (\d+) s", "ci"),
)


def timings(path=TIMINGS):
    """Seconds of each part of the saved .ci/run output: name -> value (empty without the file)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        lines = f.read().splitlines()
    found, used = {}, set()
    for pattern, name in TIMING_LINES:
        for i, line in enumerate(lines):
            m = re.match(pattern, line)
            if m and i not in used:
                used.add(i)
                key = name or m.group(1)
                found["time:" + key] = int(m.group(m.lastindex))
                if name:
                    break
    return found


def cheap_counts():
    """Every count that reads the tree without running anything: name -> value."""
    sources = notebook_sources()
    graded, points = graded_totals()
    counts = {
        "regions": len(assignments.all_regions(ROOT)),
        "assignment-files": len(assignments.ASSIGNMENT_FILES),
        "graded-tests": graded,
        "points": points,
        "mistakes": _catalogue("mistakes"),
        "alternatives": _catalogue("alternatives"),
        "notebooks": len(sources),
        "exercises": sum(exercises(s) for s in sources),
    }
    for s in sources:  # exercises:00, exercises:02b, ...
        counts["exercises:" + os.path.basename(s).split("_", 1)[0]] = exercises(s)
    return counts | timings()


class _Collector:
    """A pytest plugin that keeps each collected test's id and whether it is in the slow tier."""

    def __init__(self):
        self.items = []

    def pytest_collection_modifyitems(self, items):
        self.items = [(i.nodeid, i.get_closest_marker("slow") is not None) for i in items]


def collected_counts():
    """The suite's test counts, from one `pytest --collect-only` in a fresh process."""
    out = (
        subprocess.run(
            [sys.executable, __file__, "--collect-json"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    items = ast.literal_eval(out)
    replays = [(n, s) for n, s in items if "replays_under_nccl_rules" in n]
    return {
        "tests": len(items),
        "tests-default": sum(not s for _, s in items),
        "tests-slow": sum(s for _, s in items),
        "replays": len(replays),
        "replays-default": sum(not s for _, s in replays),
    }


def _collect_json():
    import pytest

    plugin = _Collector()
    pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[plugin])
    print(repr(plugin.items))


def spans(text):
    """(name, stated value) of every marked span in ``text``."""
    return SPAN.findall(text)


def fill(text, counts):
    """``text`` with every span whose name ``counts`` knows set to its value."""

    def one(m):
        name = m.group(1)
        value = f"{counts[name]:,}" if name in counts else m.group(2)
        return f"<!-- count:{name} -->{value}<!-- /count -->"

    return SPAN.sub(one, text)


def stale(counts, docs=DOCS):
    """'file: name says X, the tree says Y' for each span out of date (or naming no count)."""
    found = []
    for doc in docs:
        with open(os.path.join(ROOT, doc)) as f:
            for name, value in spans(f.read()):
                if name in TEST_COUNTS and name not in counts:
                    continue  # needs --tests
                if name not in counts:
                    found.append(f"{doc}: count:{name} names no count tools/docs_counts.py knows")
                elif value != f"{counts[name]:,}":
                    found.append(
                        f"{doc}: count:{name} says {value}, the tree says {counts[name]:,}"
                    )
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale spans")
    parser.add_argument("--tests", action="store_true", help="also count the suite's tests")
    parser.add_argument("--collect-json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.collect_json:
        return _collect_json()
    counts = cheap_counts() | (collected_counts() if args.tests else {})
    if args.check:
        problems = stale(counts)
        print("\n".join(problems) or "every count is current")
        return 1 if problems else 0
    for doc in DOCS:
        path = os.path.join(ROOT, doc)
        with open(path) as f:
            text = f.read()
        new = fill(text, counts)
        if new != text:
            with open(path, "w") as f:
                f.write(new)
            print(f"updated {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
