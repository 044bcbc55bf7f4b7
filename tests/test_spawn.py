"""The harness is itself graded: it must fail when a rank fails and never hang."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tools.spawn import RankFailure, RankTimeout, run_ranks, run_torchrun


def _all_reduce_rank_ids(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, world_size, t.item(), os.getpid()


@pytest.mark.parametrize(
    "world_size",
    [1, 2, 3, pytest.param(4, marks=pytest.mark.slow), pytest.param(6, marks=pytest.mark.slow)],
)
def test_collective_across_ranks(world_size):
    results = run_ranks(_all_reduce_rank_ids, world_size)
    assert [r[0] for r in results] == list(range(world_size))
    assert all(r[1] == world_size for r in results)
    assert all(r[2] == sum(range(world_size)) for r in results)
    assert len({r[3] for r in results}) == world_size  # real, separate processes


def _rank_two_raises(rank, world_size):
    if rank == 2:
        assert 1 + 1 == 3, "rank two is wrong on purpose"
    # the healthy ranks wait here for the dead one: the harness must not hang on them
    dist.barrier()


def test_failing_rank_becomes_the_failure():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank_two_raises, 4, timeout=60)
    message = str(info.value)
    assert "rank 2 of 4" in message and "rank two is wrong on purpose" in message
    assert "Traceback" in message and "_rank_two_raises" in message
    assert time.monotonic() - start < 30


def _rank_one_hangs(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    return rank


def test_hanging_rank_is_killed_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[1\] of 2 did not finish"):
        run_ranks(_rank_one_hangs, 2, timeout=3)
    assert time.monotonic() - start < 15


def _exits_hard(rank, world_size):
    if rank == 0:
        os._exit(7)
    return rank


def test_rank_killed_without_traceback_is_reported():
    with pytest.raises(RankFailure, match="exit code 7"):
        run_ranks(_exits_hard, 2, timeout=30)


def _returns_tensor(rank, world_size, scale, offset=0.0):
    return torch.full((2,), rank * scale + offset)


def test_arguments_and_results_round_trip():
    out = run_ranks(_returns_tensor, 3, args=(10.0,), kwargs={"offset": 1.0})
    assert [o.tolist() for o in out] == [[1.0, 1.0], [11.0, 11.0], [21.0, 21.0]]


@pytest.mark.slow  # the demos' tests run torchrun to the end in the default tier
def test_run_torchrun_returns_output_and_surfaces_failure(tmp_path):
    good = tmp_path / "good.py"
    # one os.write per line: the ranks share a pipe, and print() may split a line into two writes
    good.write_text(
        "import os\nimport torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "os.write(1, f'hello from {dist.get_rank()} of {dist.get_world_size()}\\n'.encode())\n"
        "dist.destroy_process_group()\n"
    )
    out = run_torchrun(str(good), nproc=2, timeout=120).stdout
    assert "hello from 0 of 2" in out and "hello from 1 of 2" in out
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import os\nif os.environ['RANK'] == '1':\n    raise SystemExit('rank one refuses')\n"
    )
    with pytest.raises(AssertionError, match="rank one refuses"):
        run_torchrun(str(bad), nproc=2, timeout=120)


def test_run_torchrun_failure_names_the_error_first(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import os\nif os.environ['RANK'] == '1':\n    raise ValueError('rank one: bad lr')\n"
    )
    with pytest.raises(AssertionError) as failure:
        run_torchrun(str(bad), nproc=2, timeout=120)
    first = str(failure.value).splitlines()[0]
    assert "ValueError: rank one: bad lr" in first, f"the failure's first line is {first!r}"
