"""benchmarks/bench_compose.py: its door refuses what would fail late, and what it counts per link
on real gloo ranks is what compose_budget predicts, byte for byte."""

import json
import os
import sys

import pytest

import compose
from layouts import compose_budget
from tools.spawn import run_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_compose  # noqa: E402

SMALL = ["--steps", "2", "--record", "1", "--layers", "4", "--seq-len", "64"]


@pytest.mark.parametrize("argv", [["--seq-len", "100000000"], ["--json", "/missing/dir/o.json"]])
def test_options_that_would_fail_late_are_refused_first(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_compose.parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and "error:" in err, f"exit {stop.value.code}: {err}"
    assert argv[1] in err, f"the error does not name {argv[1]}: {err}"


def test_every_link_of_every_rank_is_counted_as_predicted(tmp_path):
    path = str(tmp_path / "run.json")
    out = run_torchrun(os.path.join("benchmarks", "bench_compose.py"), 2,
                       SMALL + ["--cp", "2", "--json", path], timeout=240).stdout  # fmt: skip
    assert "measured / predicted by the budget" in out, out
    with open(path) as f:
        run = json.load(f)
    cfg = compose.ComposeConfig(**run["config"])
    predicted = compose_budget.layout_budget(cfg, 1, 2, 1, 2**40, 1e10, 1e9, 2, "exact")
    for r in run["ranks"]:
        for link in compose_budget.SENT:
            got, want = r["sent_bytes"][link], predicted.sent[r["rank"]][link]
            assert got == want, f"rank {r['rank']} {link}: counted {got} bytes, predicted {want}"
        assert os.path.exists(r["timeline"]), f"rank {r['rank']}: no timeline beside the JSON"
