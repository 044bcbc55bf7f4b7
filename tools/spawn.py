"""Multi-rank harness for the tests, notebooks and benchmarks: run one function on W real gloo
processes.

    from tools.spawn import run_ranks, run_torchrun
    results = run_ranks(my_check, world_size=4, args=(seed,))   # my_check(rank, world_size, seed)

Each rank is a real process with its own gloo process group (free TCP port per run, a timeout on the
group and on the whole run). A rank that raises turns into a pytest failure carrying that rank's
traceback; a rank that hangs past the timeout is killed with every other rank, so nothing is
orphaned and nothing hangs the suite. The function must live at module level (it is pickled to the
children).

Processes come from a fork server that has already imported torch, so a 4-rank run starts in tens of
milliseconds rather than seconds; the children still get a fresh interpreter state of their own.
"""

import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import re
import signal
import socket
import subprocess
import sys
import time
import traceback

from tools.sandbox_child import descendants  # the zygote's walk of /proc, written once

_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed"])
    return _CONTEXT


def free_port():
    """A TCP port that was free a moment ago (the OS picks it; released for the store to bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailure(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback.

    ``errors`` maps rank -> that rank's traceback text, for tests that check what each rank saw.
    """

    def __init__(self, message, errors=None):
        super().__init__(message)
        self.errors = dict(errors or {})


class RankTimeout(AssertionError):
    """The run outlived its timeout; every rank was killed."""


def _rank_main(fn, rank, world_size, port, pg_timeout_s, args, kwargs, results):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # W ranks share 2 cores: oversubscription only makes tests slower
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        try:
            out = fn(rank, world_size, *args, **kwargs)
        finally:
            if dist.is_initialized():  # a rank that stops its peers leaves the group itself
                dist.destroy_process_group()
        # plain pickle copies tensor data; the queue's pickler would share memory that dies with us
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # the traceback is the whole point: ship it to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size, args=(), kwargs=None, timeout=120.0):
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return results.

    Returns a list indexed by rank of what each ``fn`` returned (it must be picklable).
    Raises RankFailure with every failing rank's traceback, or RankTimeout after ``timeout`` s.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    pg_timeout_s = max(5, int(timeout))
    procs = [
        ctx.Process(
            target=_rank_main,
            daemon=True,
            args=(fn, r, world_size, port, pg_timeout_s, args, kwargs or {}, results),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes, deadline = {}, time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, payload = results.get(timeout=min(left, 0.5))
                outcomes[rank] = (status, payload)
                if (
                    status == "error"
                ):  # peers of a dead rank would only wait for it: stop soon after
                    deadline = min(deadline, time.monotonic() + 2.0)
            except queue_module.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in outcomes
                ]
                for r in dead:
                    outcomes[r] = (
                        "error",
                        f"rank {r} died with exit code {procs[r].exitcode} "
                        "(killed by a signal, or os._exit) before reporting",
                    )
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
    errors = {r: msg for r, (status, msg) in sorted(outcomes.items()) if status == "error"}
    if errors:
        body = "\n".join(
            f"----- rank {r} of {world_size} -----\n{msg}" for r, msg in errors.items()
        )
        raise RankFailure(
            f"{len(errors)} of {world_size} ranks failed running {fn.__name__}:\n{body}", errors
        )
    missing = [r for r in range(world_size) if r not in outcomes]
    if missing:
        raise RankTimeout(
            f"ranks {missing} of {world_size} did not finish {fn.__name__} "
            f"within {timeout:.0f}s; all ranks were killed"
        )
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


def kill_tree(pid):
    """SIGKILL ``pid``, its process group and every process below it. torchrun starts each
    worker in a session of its own, so killing torchrun's group alone leaves the workers running
    (a hung worker then spins on after the test has failed)."""
    for target in [*descendants(pid), pid]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_torchrun(file, nproc=4, args=(), timeout=300.0, env=None, check=True):
    """Run ``torchrun --nproc_per_node=nproc file args`` as a subprocess; return CompletedProcess.

    ``file`` is relative to the repository root.

    stdout and stderr come back together in ``.stdout``. With ``check`` a non-zero exit raises an
    AssertionError that carries the whole output, so the failing rank's traceback shows in pytest.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        os.path.join(ROOT, file),
        *map(str, args),
    ]
    # CUDA_VISIBLE_DEVICES="" pins the suite to gloo on the CPU even where GPUs exist
    full_env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        CUDA_VISIBLE_DEVICES="",
        **(env or {}),
    )
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException as error:  # also pytest-timeout's, or Ctrl-C: never leave ranks behind
        kill_tree(proc.pid)  # torchrun and every worker it started
        if not isinstance(error, subprocess.TimeoutExpired):
            raise
        out, _ = proc.communicate()
        raise AssertionError(
            f"{' '.join(cmd)} did not finish within {timeout:.0f}s:\n{out}"
        ) from None
    result = subprocess.CompletedProcess(cmd, proc.returncode, out)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{file} at {nproc} rank(s) failed: {first_error(out)}\n"
            f"{' '.join(cmd)} exited {proc.returncode}:\n{out}"
        )
    return result


ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:\w+\.)*\w*(?:Error|Exception|Interrupt)\b.*)$")


def first_error(out):
    """The first exception line a rank printed (what a failing test should say first), else the
    last line of the output."""
    for line in out.splitlines():
        found = ERROR_LINE.match(line.strip())
        if found and "ChildFailedError" not in line:
            return found.group(1)[:300]
    lines = [line for line in out.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"
