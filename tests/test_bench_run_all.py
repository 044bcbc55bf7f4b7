"""benchmarks/run_all.py (make bench): its door refuses an unknown chapter before any work, and
the generated tables carry every chapter's rows, a failed chapter's reason and the machine."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import run_all  # noqa: E402


def test_an_unknown_chapter_is_refused_by_name():
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "run_all.py"), "--only", "muon,mhc"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "muon" in last and "muon_zero" in last, last


def test_markdown_has_every_row_the_machine_and_failures():
    machine = dict(date="d", cores=2, cpu="x", threads_per_process=1, python="3", torch="t")
    chapters = {
        "mhc": dict(title="T", columns=["a", "ratio"], rows=[["C=128", 0.5], ["C=256", 1.25]]),
        "compose": {"error": "exit 1"},
    }
    text = run_all.markdown(dict(machine=machine, full=False, seconds=1.0, chapters=chapters))
    assert "| C=128 | 0.50 |" in text and "| C=256 | 1.25 |" in text, text
    assert "## compose" in text and "failed: exit 1" in text, text
    assert "torch t" in text and "1 thread per process" in text, text
