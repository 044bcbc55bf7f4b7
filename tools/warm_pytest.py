"""A warm parent for the grading checks' many pytest sessions (one per stubbed region, mistake and
alternative): torch and pytest are imported once, and each session is a fork of this process,
run as ``python -m pytest ARGS`` would run in its folder with its environment.

Only the grader's own modules are imported here, never a submitted file: a session forked from it
is the grader's process, as a freshly started one would be. The autograder does not use it (it
grades once, inside a memory limit a second copy of torch would eat into)."""

import json
import os
import runpy
import signal
import socket
import subprocess
import sys

PRELOAD = ("torch", "torch.distributed", "numpy", "pytest", "pytest_timeout")


class Session:
    """A forked session, waited on as a Popen: ``pid``, ``wait(timeout)``, ``returncode``."""

    def __init__(self, server, pid):
        self.server, self.pid, self.returncode = server, pid, None

    def wait(self, timeout=None):
        if self.returncode is None:
            self.server.sock.settimeout(timeout)
            try:
                said = self.server.sock.recv(4096)
            except TimeoutError:
                raise subprocess.TimeoutExpired("pytest", timeout) from None
            finally:
                self.server.sock.settimeout(None)
            if not said:  # the warm parent died: its session is ended, and counts as killed
                try:
                    os.killpg(self.pid, signal.SIGKILL)  # the session leads its own group
                except OSError:  # gone already
                    pass
                self.returncode = -signal.SIGKILL
            else:
                self.returncode = os.waitstatus_to_exitcode(json.loads(said))
        return self.returncode


class Server:
    """The warm parent, started with ``env`` (a session's, less what changes per session: the
    ``GRADE_`` variables). ``start`` forks one session; a session whose other variables differ
    (torch reads some at import) is started afresh instead, as a plain process."""

    def __init__(self, env):
        self.env = {k: v for k, v in env.items() if not k.startswith("GRADE_")}
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
            env=self.env,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.busy = None

    def start(self, argv, cwd, env, log=None):
        """``argv`` for pytest, run in ``cwd`` with ``env``; its output to the file ``log`` (else
        this process's standard output). Returns a Popen-like Session, or a Popen."""
        same = {k: v for k, v in env.items() if not k.startswith("GRADE_")} == self.env
        idle = self.busy is None or self.busy.returncode is not None
        if not (same and idle and self.proc.poll() is None):
            return subprocess.Popen(
                [sys.executable, "-m", "pytest", *argv],
                cwd=cwd,
                env=env,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        request = json.dumps({"argv": argv, "cwd": cwd, "env": env}).encode()
        socket.send_fds(self.sock, [request], [log.fileno()] if log is not None else [])
        self.busy = Session(self, json.loads(self.sock.recv(4096)))
        return self.busy

    def close(self):
        self.sock.close()  # the server reads the end of its socket and exits
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _session(request, fds):
    """In the forked child: become ``python -m pytest ARGV`` in its folder; never returns."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if fds:
            os.dup2(fds[0], 1)
        os.dup2(1, 2)
        for fd in fds:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.getcwd(), *extra, *BASE_PATH]
        sys.argv = ["pytest", *request["argv"]]
        runpy.run_module("pytest", run_name="__main__", alter_sys=True)  # python -m pytest
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException as error:  # the session's own failure, said where its output goes
        print(f"warm_pytest: the session failed: {type(error).__name__}: {error}", file=sys.stderr)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve(fd):
    """Fork a session per request on the socket ``fd``; send its pid, then its wait status."""
    sock = socket.socket(fileno=fd)
    while True:
        request, fds, _, _ = socket.recv_fds(sock, 1 << 22, 1)
        if not request:
            return
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            _session(json.loads(request), fds)
        for f in fds:
            os.close(f)
        sock.send(json.dumps(pid).encode())
        _, status = os.waitpid(pid, 0)
        try:
            sock.send(json.dumps(status).encode())
        except OSError:  # the grader went away
            return


if __name__ == "__main__":
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    BASE_PATH = [p for p in sys.path[1:] if p not in pythonpath]  # without this file's folder
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    serve(int(sys.argv[1]))
