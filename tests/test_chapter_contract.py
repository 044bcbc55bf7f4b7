"""docs/CHAPTERS.md's table is what tools/chapters.py measures in the chapters now."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import chapters  # noqa: E402


def doc_table():
    with open(os.path.join(ROOT, "docs", "CHAPTERS.md")) as f:
        text = f.read()
    assert chapters.BEGIN in text and chapters.END in text, (
        f"docs/CHAPTERS.md lost its table markers {chapters.BEGIN} ... {chapters.END}"
    )
    return text.split(chapters.BEGIN, 1)[1].split(chapters.END, 1)[0].strip()


def test_chapters_table_matches_the_files():
    measured = chapters.contract_table()
    written = doc_table()
    stale = sorted(set(written.splitlines()) ^ set(measured.splitlines()))
    assert written == measured, (
        "docs/CHAPTERS.md's chapter table is stale; paste `python tools/chapters.py --contract` "
        "between its markers. Rows that differ:\n" + "\n".join(stale)
    )


def test_the_measure_sees_a_call_back_and_a_reach_back():
    # the two breaches the contract names must show up, or the table could say 0 for anything
    rows = {name: chapters.contract(name) for name in ("muon_zero.py", "mhc.py")}
    assert "plan_muon" in rows["muon_zero.py"][5], "muon_zero hands plan_muon to its guard: unseen"
    assert rows["mhc.py"][4] >= 1, "mhc reaches back through sys.modules: unseen"
