"""A rank stopped (SIGSTOP) in the middle of a step, inside each kind of collective each file runs:
every other rank exits non-zero with launch's one-line message within the timeout plus a margin.

The stop comes from tests/stop_inside.py: the last rank stops itself just before it issues its
first call of the named operation inside the training step, on a group that file made (the
pipeline's sends, the CP all-gather, MuonZeRO's sync), so the others wait inside that call.
A group that forgot the launch's timeout would wait torch's default instead (30 minutes on gloo).
"""

import os
import re
import subprocess
import sys
import time

import pytest

import launch
from tools.spawn import ROOT, free_port, kill_tree

TIMEOUT_S = 4
# after its timeout a rank waits for the ranks still answering until none has come for
# STOP_GRACE_S (launch.stop_together); the rest is for a loaded machine
MARGIN_S = launch.STOP_GRACE_S + 12
SMALL = {
    "mhc.py": ["--steps", "2", "--layers", "4", "--dim", "32", "--seq-len", "8"],
    "cp_compress.py": ["--seq-per-rank", "64", "--m-hca", "16"],
    "muon_zero.py": ["--steps", "2", "--seq", "8"],
    "compose.py": ["--steps", "2", "--layers", "4", "--seq-len", "64"],
}
CASES = {  # id: (file, extra arguments, the operation the last rank stops in[, ranks (2)])
    "compose --pp 2, in the pipeline's sends": (
        "compose.py", ["--pp", "2"], "isend@group/layout_step"),
    "compose --cp 2, in the CP all-gather": (
        "compose.py", ["--cp", "2"], "all_gather_single@group/layout_step"),
    "compose --dp 2, in MuonZeRO's sync": (
        "compose.py", ["--dp", "2"], "all_to_all_single@group/layout_step"),
    "mhc, in the pipeline's sends": ("mhc.py", [], "isend@group/pipeline_step"),
    "cp_compress, in the CP all-gather": ("cp_compress.py", [], "all_gather_single/demo"),
    "muon_zero --zero-width 1, in the replica sync": (
        "muon_zero.py", ["--zero-width", "1"], "all_reduce@group/sharded_step"),
    "mhc on 4 stages, in the pipeline's sends": ("mhc.py", [], "isend@group/pipeline_step", 4),
    "compose --pp 2 --cp 2, in the CP all-gather": (
        "compose.py", ["--pp", "2", "--cp", "2"], "all_gather_single@group/layout_step", 4),
}  # fmt: skip
DEFAULT_TIER = "cp_compress, in the CP all-gather"  # the quickest launch; the rest run slow


def stop_one_rank(file, args, op, world=2):
    """torchrun FILE on `world` ranks, the last stopped in its first `op`. -> (seconds from the
    stop to each other rank's line {rank: s}, the output)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           os.path.join(ROOT, "tests", "stop_inside.py"), str(world - 1), op, "1",
           os.path.join(ROOT, file), *SMALL[file], *args, "--timeout", str(TIMEOUT_S)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    log = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"stopped-{os.getpid()}-{file}.log")
    said = re.compile(rf"^rank (\d+): a peer did not answer within the {TIMEOUT_S} s", re.M)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        began, stopped, took = time.monotonic(), None, {}
        while time.monotonic() < began + 240 and len(took) < world - 1:
            text = open(log).read()
            if stopped is None and "[stopped]" in text:
                stopped = time.monotonic()
            for rank in said.findall(text) if stopped else ():
                took.setdefault(int(rank), time.monotonic() - stopped)
            if stopped and time.monotonic() > stopped + TIMEOUT_S + 60:
                break
            if stopped is None and proc.poll() is not None:
                break
            time.sleep(0.1)
        return took, open(log).read()
    finally:
        kill_tree(proc.pid)
        proc.wait()
        os.remove(log)


def ranks_said(out):
    """What the ranks said: the output less torchrun's own log lines, its last 3000 characters."""
    kept = [line for line in out.splitlines() if "torch/distributed/elastic" not in line]
    return "\n".join(kept)[-3000:]


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=() if c == DEFAULT_TIER else pytest.mark.slow) for c in CASES]
)
def test_a_rank_stopped_mid_step_ends_the_others_within_the_timeout(case):
    file, args, op, *ranks = CASES[case]
    world = ranks[0] if ranks else 2
    took, out = stop_one_rank(file, args, op, world)
    assert "[stopped]" in out, (
        f"{case}: the last rank never reached {op}; output:\n{ranks_said(out)}"
    )
    silent = sorted(set(range(world - 1)) - took.keys())
    assert not silent, (
        f"{case}: ranks {silent} did not say a peer stopped; output:\n{ranks_said(out)}"
    )
    slowest = max(took.values())
    assert slowest < TIMEOUT_S + MARGIN_S, (
        f"{case}: the others took {slowest:.1f} s to stop, timeout {TIMEOUT_S} s + {MARGIN_S:g} s"
    )
    print(f"{case}: the others stopped {', '.join(f'{t:.1f}' for t in took.values())} s after it")
