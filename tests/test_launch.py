"""launch.py, the plumbing the four chapters share: the agreement guard on real gloo ranks, the
digests, the checked argument types, and the one timeout rule (every group keeps it; a stopped
rank ends the others: here at setup, mid-step in tests/test_stopped_rank.py)."""

import argparse
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import launch
from tools.spawn import ROOT, RankFailure, descendants, free_port, kill_tree, run_ranks


def _agree_case(rank, world, case):
    fields = {"shape": (2, 3), "lr": 0.1}
    error = None
    if case == "field" and rank == world - 1:
        fields["lr"] = 0.2
    if case == "local error" and rank == 0:
        error = "idx must be int64, got float32"
    launch.agree(fields, error, who="demo")
    return "agreed"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_guard_passes_when_every_rank_agrees(world):
    assert run_ranks(_agree_case, world, args=("same",)) == ["agreed"] * world


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", ["field", "local error"])
def test_guard_raises_the_same_error_on_every_rank(world, case):
    with pytest.raises(RankFailure) as failure:
        run_ranks(_agree_case, world, args=(case,))
    errors = failure.value.errors
    assert sorted(errors) == list(range(world)), f"only ranks {sorted(errors)} raised"
    lines = {text.strip().splitlines()[-1] for text in errors.values()}
    assert len(lines) == 1, f"ranks raised different errors: {lines}"
    line = lines.pop()
    expected = (
        "ValueError: demo: lr differs across ranks: "
        + ("rank 0 has 0.1, rank 1 has 0.2" if world == 2 else "ranks 0,1 have 0.1, rank 2 has 0.2")
        if case == "field"
        else "ValueError: demo: rank 0: idx must be int64, got float32"
    )
    assert line == expected, f"the guard said {line!r}, expected {expected!r}"


def test_guard_alone_raises_its_own_error_plainly():
    with pytest.raises(ValueError, match=r"^bad batch$"):
        launch.agree({"x": 1}, "bad batch")


def test_weights_digest_sees_one_bit_and_a_swap():
    a = torch.arange(6, dtype=torch.float32)
    base = launch.weights_digest([("w", a)])
    swapped = a.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    flipped = a.clone()
    flipped.view(torch.int32)[3] ^= 1  # one bit of one value
    assert launch.weights_digest([("w", swapped)]) != base, "a swap of two values went unseen"
    assert launch.weights_digest([("w", flipped)]) != base, "a one-bit change went unseen"
    assert launch.weights_digest([("v", a)]) != base, "the name is part of the digest"
    assert launch.weights_digest([("w", a.clone())]) == base
    assert launch.fields_digest({"a": 1, "b": 2}) == launch.fields_digest({"b": 2, "a": 1})
    assert launch.fields_digest({"a": 1}) != launch.fields_digest({"a": 1.0})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--n", "0"], "argument --n: must be int >= 1, got '0'"),
        (["--n", "two"], "argument --n: must be int >= 1, got 'two'"),
        (["--timeout", "0"], "argument --timeout: must be float > 0.0, got '0'"),
        (["--timeout", "nan"], "argument --timeout: must be float > 0.0, got 'nan'"),
    ],
)
def test_launch_options_refuse_bad_values_in_one_line(argv, message, capsys):
    parser = launch.add_launch_options(argparse.ArgumentParser(prog="demo"))
    parser.add_argument("--n", type=launch.at_least(1), default=1)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"demo: error: {message}"


def test_timeout_rule(monkeypatch):
    monkeypatch.delenv(launch.TIMEOUT_ENV, raising=False)
    assert launch.timeout_seconds() == launch.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(launch.TIMEOUT_ENV, "7.5")
    assert launch.timeout_seconds() == 7.5
    assert launch.timeout_seconds(3) == 3
    with pytest.raises(ValueError, match="timeout must be > 0"):
        launch.timeout_seconds(0)


def test_cuda_without_a_gpu_is_refused_before_any_group():
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        launch.choose_backend(None, "cuda")
    with pytest.raises(ValueError, match="moves only CUDA tensors"):
        launch.choose_backend("nccl", "cpu")
    assert launch.choose_backend(None, None)[:2] == ("gloo", "cpu")


def _workers(torchrun_pid):
    """{RANK: pid} of torchrun's workers, read from their environments."""
    found = {}
    for pid in descendants(torchrun_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env:
            found[int(env[b"RANK"])] = pid
    return found


def _stop_one_rank(file, world=2, timeout_s=4):
    """Run FILE under torchrun, SIGSTOP the last rank once every rank has started, and return
    (seconds from the stop until every other rank has said why it stopped, the output)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           os.path.join(ROOT, file), "--timeout", str(timeout_s)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    log = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"stop-{os.getpid()}-{file}.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "[setup]" not in open(log).read():
            time.sleep(0.2)
        workers = _workers(proc.pid)
        assert len(workers) == world, f"found workers {workers} of {world}"
        os.kill(workers[world - 1], signal.SIGSTOP)
        stopped = time.monotonic()
        said = "did not answer within the"
        while time.monotonic() < stopped + timeout_s + 60:
            text = open(log).read()
            if text.count(said) >= world - 1 or proc.poll() is not None:
                break
            time.sleep(0.2)
        return time.monotonic() - stopped, open(log).read()
    finally:
        kill_tree(proc.pid)
        proc.wait()
        os.remove(log)


@pytest.mark.slow
def test_a_rank_stopped_at_setup_ends_the_others_within_the_timeout():
    """tensor_ckpt's demo (its collectives run inside DDP's C++, out of tests/stop_inside.py's
    reach): the last rank stopped after [setup]. The other files are stopped mid-step, inside each
    kind of collective, in tests/test_stopped_rank.py."""
    took, out = _stop_one_rank("tensor_ckpt.py")
    said = [line for line in out.splitlines() if "did not answer within the 4 s" in line]
    assert said, f"tensor_ckpt.py: no rank said a peer stopped answering; output:\n{out[-3000:]}"
    assert said[0].startswith("rank 0: "), f"tensor_ckpt.py: the message is {said[0]!r}"
    assert took < 4 + 45, f"tensor_ckpt.py: the others took {took:.0f} s to stop, timeout 4 s"


def _group_timeouts(rank, world):
    """The timeout of every kind of group launch makes, in seconds."""
    mesh = launch.device_mesh("cpu", (world, 1), ("a", "b"))
    mine, _ = launch.new_subgroups_by_enumeration([list(range(world))])
    made = {"world": dist.group.WORLD, "new_group": launch.new_group(),
            "by enumeration": mine, "mesh a": mesh["a"].get_group(),
            "mesh b": mesh["b"].get_group()}  # fmt: skip
    cpu = torch.device("cpu")
    return {name: g._get_backend(cpu).options._timeout.total_seconds() for name, g in made.items()}


def test_every_group_launch_makes_keeps_the_world_timeout():
    """tools/spawn.py gives its world max(5, timeout) s: each group launch makes has the same
    (torch's constructors would give a new gloo group 30 minutes)."""
    for rank, timeouts in enumerate(run_ranks(_group_timeouts, 2, timeout=30)):
        assert set(timeouts.values()) == {30.0}, f"rank {rank}: group timeouts {timeouts}"
