"""The NCCL-rules check (tools/nccl_rules.py): its replay on synthetic logs, then every demo.

gloo buffers sends and matches messages by tag; NCCL does neither. The replay must find a
deadlock that gloo hides, accept the same exchange batched, and catch size/dtype mismatches.
Then each technique file's demo is recorded on gloo at 2, 3 and 4 ranks and replayed: no
deadlock, no mismatch. A static check finds devices chosen from the backend's name.
"""

import os
import sys

import pytest

from tools.spawn import run_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import nccl_rules  # noqa: E402

TECHNIQUES = ("muon_zero.py", "mhc.py", "cp_compress.py", "tensor_ckpt.py")


def _p2p(seq, op, peer, numel=4, dtype="float32", batch=None, group=(0, 1)):
    direction = "send" if op in ("send", "isend") else "recv"
    return dict(
        seq=seq, kind="p2p", op=op, dir=direction, peer=peer, group=list(group), batch=batch,
        numel=numel, dtype=dtype, devices=["cpu"],
    )  # fmt: skip


def _wait(*seqs):
    return dict(kind="wait", on=list(seqs))


def _coll(seq, op, group, numel=4, dtype="float32"):
    return dict(
        seq=seq, kind="coll", op=op, group=group, size=[numel, dtype], numel=numel,
        dtype=dtype, devices=["cpu"],
    )  # fmt: skip


def test_receives_posted_first_deadlock():
    """Each rank receives before it sends: gloo is happy, NCCL waits forever."""
    logs = {
        0: [_p2p(0, "irecv", 1), _p2p(1, "isend", 1)],
        1: [_p2p(0, "irecv", 0), _p2p(1, "isend", 0)],
    }
    problems = nccl_rules.replay(logs)
    assert len(problems) == 1 and problems[0].startswith("deadlock")
    assert "rank 0 waits in irecv from rank 1" in problems[0]
    assert "rank 1 waits in irecv from rank 0" in problems[0]


def test_blocking_sends_first_deadlock_without_buffering():
    logs = {
        0: [_p2p(0, "send", 1), _p2p(1, "recv", 1)],
        1: [_p2p(0, "send", 0), _p2p(1, "recv", 0)],
    }
    assert nccl_rules.replay(logs)[0].startswith("deadlock")


def test_the_same_exchange_batched_is_fine():
    logs = {
        0: [_p2p(0, "irecv", 1, batch=1), _p2p(1, "isend", 1, batch=1)],
        1: [_p2p(0, "irecv", 0, batch=1), _p2p(1, "isend", 0, batch=1)],
    }
    assert nccl_rules.replay(logs) == []


def test_matched_order_and_collectives_run():
    logs = {
        0: [_p2p(0, "send", 1), _coll(1, "all_reduce", [0, 1]), _p2p(2, "recv", 1)],
        1: [_p2p(0, "recv", 0), _coll(1, "all_reduce", [0, 1]), _p2p(2, "send", 0)],
    }
    assert nccl_rules.replay(logs) == []


def test_size_and_dtype_mismatches_are_found():
    logs = {0: [_p2p(0, "send", 1, numel=4)], 1: [_p2p(0, "recv", 0, numel=8)]}
    assert any("sent 4 x float32" in p and "8 x float32" in p for p in nccl_rules.replay(logs))
    logs = {
        0: [_coll(0, "all_reduce", [0, 1], dtype="float32")],
        1: [_coll(0, "all_reduce", [0, 1], dtype="bfloat16")],
    }
    assert any("collective 0 on group [0, 1] differs" in p for p in nccl_rules.replay(logs))


def test_collective_order_across_groups_deadlocks():
    """Rank 0 enters group A then B, rank 1 B then A: each waits for the other."""
    logs = {
        0: [_coll(0, "all_reduce", [0, 1]), _wait(0), _coll(1, "barrier", [0, 1, 2]), _wait(1)],
        1: [_coll(0, "barrier", [0, 1, 2]), _wait(0), _coll(1, "all_reduce", [0, 1]), _wait(1)],
        2: [_coll(0, "barrier", [0, 1, 2]), _wait(0)],
    }
    assert nccl_rules.replay(logs)[-1].startswith("deadlock")
    # without the waits (async collectives), each group's stream runs on its own: no deadlock
    assert (
        nccl_rules.replay({r: [e for e in ops if e["kind"] != "wait"] for r, ops in logs.items()})
        == []
    )


def test_separate_groups_are_separate_streams_unless_a_wait_orders_them():
    """Activations on one group, gradients on another (issue 14's other fix) are safe as
    issued; a wait on the receive before the send ties the two streams together again."""

    def grad(op):  # the same ranks, another process group: another NCCL communicator
        return dict(op, gid="grad")

    ahead = {
        0: [grad(_p2p(0, "irecv", 1)), _p2p(1, "isend", 1)],
        1: [_p2p(0, "irecv", 0), grad(_p2p(1, "isend", 0))],
    }
    assert nccl_rules.replay(ahead) == []
    waited = {
        0: [grad(_p2p(0, "irecv", 1)), _wait(0), _p2p(1, "isend", 1)],
        1: [_p2p(0, "irecv", 0), _wait(0), grad(_p2p(1, "isend", 0))],
    }
    problem = nccl_rules.replay(waited)[-1]
    assert problem.startswith("deadlock") and "first waited on op #0" in problem, problem


def test_wrong_device_is_flagged():
    logs = {0: [_p2p(0, "send", 1)], 1: [_p2p(0, "recv", 0)]}
    assert nccl_rules.replay(logs, device="cpu") == []
    assert "is given a cpu tensor; this run computes on cuda" in nccl_rules.replay(logs, "cuda")[0]


def test_static_check_finds_a_device_chosen_from_the_backend(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch.distributed as dist\n\n\ndef f():\n"
        "    return 'cuda' if dist.get_backend() == 'nccl' else 'cpu'\n\n\n"
        "def choose_backend(backend):\n    return backend == 'nccl'\n"
    )
    problems = nccl_rules.static_check(str(bad))
    assert len(problems) == 1 and "bad.py:5" in problems[0], problems


@pytest.mark.parametrize(
    "name", (*TECHNIQUES, "launch.py", "compose.py", "compiled/mhc_compiled.py")
)
def test_no_technique_chooses_devices_from_the_backend_name(name):
    assert nccl_rules.static_check(os.path.join(ROOT, name)) == []


# at 2 ranks mhc.py (sends) and cp_compress.py (sends and collectives) stay in the default tier;
# one replay in the default tier; muon_zero.py's demo runs under torchrun in its own tests
@pytest.mark.parametrize(
    "world_size",
    [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)],
)
@pytest.mark.parametrize(
    "name",
    [n if n == "cp_compress.py" else pytest.param(n, marks=pytest.mark.slow) for n in TECHNIQUES],
)
def test_demo_replays_under_nccl_rules(name, world_size, tmp_path):
    out = str(tmp_path / "log")
    cmd = ["record", "--out", out, "--", os.path.join(ROOT, name), *nccl_rules.demo_args(name)]
    run_torchrun(os.path.join("tools", "nccl_rules.py"), nproc=world_size, args=cmd, timeout=240)
    logs = nccl_rules.load(out)
    assert sorted(logs) == list(range(world_size)), "every rank must write its log"
    problems = nccl_rules.replay(logs, device="cpu")
    assert problems == [], "\n".join(problems)


FOUR = [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)]  # pp, cp, dp


@pytest.mark.slow  # six launches of four ranks
@pytest.mark.parametrize("layout", FOUR, ids=[f"pp{p}_cp{c}_dp{d}" for p, c, d in FOUR])
def test_compose_replays_under_nccl_rules_at_every_four_rank_layout(layout, tmp_path):
    """gloo buffers sends and matches by tag; NCCL does neither: the recorded demo must replay."""
    out, (pp, cp, dp) = str(tmp_path / "log"), layout
    demo = [*nccl_rules.demo_args("compose.py"), "--pp", str(pp), "--cp", str(cp), "--dp", str(dp)]
    cmd = ["record", "--out", out, "--", os.path.join(ROOT, "compose.py"), *demo]
    run_torchrun(os.path.join("tools", "nccl_rules.py"), nproc=4, args=cmd, timeout=300)
    logs = nccl_rules.load(out)
    assert sorted(logs) == list(range(4)), "every rank must write its log"
    problems = nccl_rules.replay(logs, device="cpu")
    assert problems == [], "\n".join(problems)
