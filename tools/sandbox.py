"""Run a submission's code where it cannot touch the grade.

The process that decides pass/fail (pytest running tests/graded/, and tools/grade.py, which writes
results.json) never imports a file of the submission. A graded test builds its inputs, hands them to
a *probe* (a function in tests/graded/probes/<stem>.py) that runs in child processes over the
staged files, and receives plain values back: tensors, numbers, strings, and lists, tuples and
dicts of them, read with ``torch.load(weights_only=True)`` so nothing the child sends can run code
here. The test then computes its verdict here, against references the child never sees.

    from sandbox import call, on_ranks, torchrun, StudentCodeError
    Y = call("muon_zero:newton_schulz", X, coefficients)         # one child process
    outs = on_ranks("muon_zero:sharded_steps", 2, seed, steps=3)  # probe(rank, world, ...) per rank
    out = torchrun("mhc.py", 2, ["--steps", "2"]).stdout         # the file's own demo

The staged folder is GRADE_STAGE (the repository root when unset: `make test` runs the graded tests
against the reference by the same path). Anything that goes wrong inside the child (an exception, a
stub's NotImplementedError, a hang, an exit, a crash, running out of memory) raises
StudentCodeError here, an AssertionError whose first line says what happened in the student's terms.
"""

import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
GRADED = os.path.join(ROOT, "tests", "graded")  # holds the probes package
CHILD = os.path.join(TOOLS, "sandbox_child.py")
MAX_RESULT_BYTES = 256 * 2**20
OUTPUT_TAIL = 4000  # characters of a child's output kept for a failure's message


def stage():
    """The folder whose files are graded."""
    return os.path.abspath(os.environ.get("GRADE_STAGE") or ROOT)


class StudentCodeError(AssertionError):
    """The submission's code failed inside the sandbox.

    ``kind``: "raised", "stub", "timeout", "died" or "oom"; ``stubs``: the regions whose
    NotImplementedError stub was reached; ``output``: the tail of what the child printed."""

    def __init__(self, message, kind="raised", stubs=(), output=""):
        super().__init__(message)
        self.kind, self.stubs, self.output = kind, tuple(stubs), output


def free_port():
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra=None):
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": tempfile.gettempdir(),
        "PYTHONPATH": os.pathsep.join([stage(), GRADED]),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "LANG": "C.UTF-8",
    }
    env.update(extra or {})
    return env


def _kill(proc):
    """SIGKILL a child's whole session (it and everything it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _load(data):
    if len(data) > MAX_RESULT_BYTES:
        raise StudentCodeError(f"the probe returned {len(data)} bytes, over the limit", "died")
    return torch.load(io.BytesIO(data), weights_only=True)


def _launch(probe, rank, world_size, port, args, kwargs, timeout, group_timeout):
    """Start one child; return (Popen, read end of its result pipe, args file)."""
    r, w = os.pipe()
    tmp = tempfile.NamedTemporaryFile(prefix="probe-args-", suffix=".pt", delete=False)
    torch.save({"args": args, "kwargs": kwargs}, tmp)
    tmp.close()
    os.chmod(tmp.name, 0o644)
    env = _env({"SANDBOX_RESULT_FD": str(w), "SANDBOX_TIMEOUT_S": str(timeout)})
    if world_size:
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            SANDBOX_GROUP_TIMEOUT_S=str(group_timeout),
        )
    proc = subprocess.Popen(
        [sys.executable, CHILD, probe, tmp.name],
        cwd=stage(),
        env=env,
        pass_fds=(w,),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    os.close(w)
    return proc, r, tmp.name


def _run(probe, world_size, args, kwargs, timeout, group_timeout):
    """Run ``probe`` in 1 child (world_size 0) or ``world_size`` rank children; list of values."""
    port = free_port()
    n = max(1, world_size)
    children = [
        _launch(probe, rank, world_size, port, args, kwargs, timeout, group_timeout)
        for rank in range(n)
    ]
    deadline = time.monotonic() + timeout + 5  # the child dumps its stack at `timeout` itself
    values, errors, outputs = [None] * n, {}, [""] * n
    try:
        for rank, (proc, r, _) in enumerate(children):
            with os.fdopen(r, "rb") as pipe:
                data = _read_until(pipe, proc, deadline)
            try:
                out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(proc)
                out = proc.stdout.read() if proc.stdout else b""
            outputs[rank] = out.decode(errors="replace")[-OUTPUT_TAIL:]
            if data is None:
                errors[rank] = {"kind": "timeout", "message": f"did not finish in {timeout:.0f} s"}
                continue
            if not data:
                code = proc.returncode
                if outputs[rank].lstrip().startswith("Timeout (") or "\nTimeout (" in outputs[rank]:
                    message = f"did not finish in {timeout:.0f} s"
                    errors[rank] = {"kind": "timeout", "message": message}
                    continue
                how = f"signal {-code}" if code and code < 0 else f"exit code {code}"
                kind = "oom" if code == -signal.SIGKILL else "died"
                errors[rank] = {"kind": kind, "message": f"died ({how}) before returning"}
                continue
            record = _load(data)
            if record.get("ok"):
                values[rank] = record["value"]
            else:
                errors[rank] = record
    finally:
        for proc, _, name in children:
            if proc.poll() is None:
                _kill(proc)
            os.unlink(name)
    if errors:
        rank, first = next(iter(sorted(errors.items())))
        where = f" (rank {rank} of {world_size})" if world_size else ""
        stubs = sorted({s for e in errors.values() for s in e.get("stubs", ())})
        message = f"{first['message']}{where}"
        if first.get("traceback"):
            message += "\n" + first["traceback"]
        if outputs[rank].strip():
            message += "\n--- output ---\n" + outputs[rank]
        raise StudentCodeError(message, first["kind"], stubs, outputs[rank])
    return values


def _read_until(pipe, proc, deadline):
    """Everything the child wrote to its result pipe; None past ``deadline`` (it is killed)."""
    import select

    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            _kill(proc)
            return None
        ready, _, _ = select.select([pipe], [], [], min(left, 1.0))
        if not ready:
            continue
        chunk = os.read(pipe.fileno(), 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def call(probe, *args, timeout=120.0, **kwargs):
    """``probe(*args, **kwargs)`` in one sandboxed child; its return value.

    ``probe`` is "STEM:function", a function of tests/graded/probes/STEM.py."""
    return _run(probe, 0, args, kwargs, timeout, timeout)[0]


def on_ranks(probe, world_size, *args, timeout=120.0, **kwargs):
    """``probe(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; values by rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return _run(probe, world_size, args, kwargs, timeout, max(5, int(timeout)))


def torchrun(file, nproc, args=(), timeout=300.0, check=True):
    """The staged ``file`` under torchrun at ``nproc`` gloo ranks; CompletedProcess with the text
    of stdout and stderr together in ``.stdout``. With ``check`` a non-zero exit raises."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        os.path.join(stage(), file),
        *map(str, args),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=stage(),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise StudentCodeError(
            f"{file} at {nproc} ranks did not finish in {timeout:.0f} s", "timeout"
        )
    text = out.decode(errors="replace")
    if check and proc.returncode != 0:
        raise StudentCodeError(
            f"{file} at {nproc} ranks exited {proc.returncode}\n{text[-OUTPUT_TAIL:]}", "raised"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, text)
