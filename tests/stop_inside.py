"""Run a file under torchrun with one rank stopped (SIGSTOP) inside a communication call.

    torchrun --nproc_per_node=2 tests/stop_inside.py RANK OP N FILE [ARGS...]

Rank RANK stops itself at its N-th call of torch.distributed.OP, just before issuing it, after
writing "[stopped] rank RANK in OP at FILE:LINE FUNCTION <- ..." to stderr: a peer that stops
answering in the middle of a step, so every other rank runs on into that step's collective and
waits there. OP@group counts only calls on a group other than the world (one a file made);
OP/FUNCTION only calls made inside FUNCTION (e.g. all_gather_single@group/layout_step). Any
other rank runs FILE as it is. For tests/test_stopped_rank.py.
"""

import functools
import os
import runpy
import signal
import sys
import traceback

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stop_at(op, nth):
    """Wrap torch.distributed.OP so that its nth counted call stops this process first."""
    op_group, _, inside = op.partition("/")
    name, _, on_group = op_group.partition("@")
    original, calls = getattr(c10d, name), []

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        stack = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(ROOT)]
        if (not on_group or kwargs.get("group") not in (None, dist.group.WORLD)) and (
            not inside or any(f.name == inside for f in stack)
        ):
            calls.append(name)
            if len(calls) == nth:
                frames = [f for f in reversed(stack) if f.filename != __file__]
                where = " <- ".join(
                    f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames
                )
                print(f"[stopped] rank {dist.get_rank()} in {op} at {where}", file=sys.stderr)
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGSTOP)
        return original(*args, **kwargs)

    for module in (dist, c10d):
        setattr(module, name, wrapper)


def main():
    rank, op, nth, file, *args = sys.argv[1:]
    if int(os.environ["RANK"]) == int(rank):
        stop_at(op, int(nth))
    sys.argv = [file, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(file)))
    runpy.run_path(file, run_name="__main__")


if __name__ == "__main__":
    main()
