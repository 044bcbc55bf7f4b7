"""Run a submission's code where it cannot touch the grade.

The process that decides pass/fail (pytest running tests/graded/, and tools/grade.py, which writes
results.json) never imports a file of the submission. A graded test builds its inputs, hands them to
a *probe* (a function in tests/graded/probes/<stem>.py) that runs in a worker process over the
staged files, and receives plain values back: tensors, numbers, strings, and lists, tuples and
dicts of them, read with ``torch.load(weights_only=True)`` under a size cap, so nothing a worker
sends can run code here. The test computes its verdict here, against references the worker never
sees. A record the submission writes itself fails the call when it lands on descriptor 3 (a
decoy) or beside the probe's (two records); one written in the probe's place by code that then
exits cannot be told apart (tools/sandbox_child.py says what is and is not guaranteed).

    from sandbox import call, on_ranks, torchrun, StudentCodeError
    Y = call("muon_zero:newton_schulz", X, coefficients)         # one worker
    outs = on_ranks("muon_zero:sharded_steps", 2, seed, steps=3)  # probe(rank, world, ...) per rank
    out = torchrun("mhc.py", 2, ["--steps", "2"]).stdout         # the file's own demo

Workers are forked by a zygote (tools/sandbox_child.py) that imported torch once. When the grader
runs as root they run as the sandbox user (GRADE_SANDBOX_USER, default grade-sandbox; the
autograder's setup.sh creates it), which can read the staged files and write only its scratch
folder; otherwise as this user. After every call every process the call left behind is killed
(as root: every process of the sandbox user), the scratch folder is emptied and, as root, what
the user left behind is removed: its System V shared memory, semaphores and message queues and
its files in /dev/shm, /tmp and /var/tmp (memory held there would stay charged to the container
and sink every later call). Anything that goes wrong in a worker (an exception,
a stub's NotImplementedError, a hang, an exit, a crash, running out of memory) raises
StudentCodeError here, an AssertionError whose first line says what happened in the student's terms.

Set by tools/grade.py, else defaults for `make test`: GRADE_STAGE (the staged files; default the
repository root), GRADE_PROBES (the folder holding the ``probes`` package; default tests/graded),
GRADE_SCRATCH (the workers' writable folder), GRADE_BROKEN (JSON: module -> why it could not be
imported; such a module imports as a placeholder that raises that when used), GRADE_DEADLINE (the
epoch second this test file's time ends: every call's timeout stops there), GRADE_PRELOAD (modules
the zygote imports before forking).
"""

import atexit
import ctypes
import io
import json
import os
import pwd
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

from sandbox_child import MAGIC, descendants, kill_user  # the zygote kills with the same walk

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
CHILD = os.path.join(TOOLS, "sandbox_child.py")
MAX_RESULT_BYTES = 256 * 2**20
OUTPUT_TAIL = 4000  # characters of a worker's output kept for a failure's message
MAX_OUTPUT = 2**20  # bytes of a worker's output kept (a demo's whole output, a flood's tail)
GRACE_S = 5.0  # past a call's timeout (the worker dumps its stack and exits at it itself)
PEERS_S = 3.0  # once a rank has failed, how long the others get before they are stopped
LIMITS = {"nproc": 512, "fsize": 512 * 2**20}
USER = os.environ.get("GRADE_SANDBOX_USER", "grade-sandbox")
PEER_FAILED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
OK = b"\x01"  # a probe's record starts with this byte when it holds a value, else with b"\x00"
PRELOAD = ["torch.distributed", "torch.nn", "torch.nn.functional", "torch.optim"]


class StudentCodeError(AssertionError):
    """The submission's code failed inside the sandbox.

    ``kind``: "raised", "stub", "timeout", "died", "oom" or "budget" (this file's time ran out);
    ``stubs``: the regions whose NotImplementedError stub was reached; ``output``: the tail of what
    the worker printed."""

    def __init__(self, message, kind="raised", stubs=(), output=""):
        super().__init__(message)
        self.kind, self.stubs, self.output = kind, tuple(stubs), output


# ---- where things are ----


def stage():
    """The folder whose files are graded."""
    return os.path.abspath(os.environ.get("GRADE_STAGE") or ROOT)


def probes_dir():
    return os.path.abspath(os.environ.get("GRADE_PROBES") or os.path.join(ROOT, "tests", "graded"))


def broken():
    """{module: why it could not be imported} (tools/grade.py's import check)."""
    return json.loads(os.environ.get("GRADE_BROKEN") or "{}")


def _readable_by_all(path):
    """``path`` and every folder above it can be read (and entered) by any user."""
    path = os.path.realpath(path)
    while True:
        mode = os.stat(path).st_mode
        need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
        if mode & need != need:
            return False
        if path == os.path.dirname(path):
            return True
        path = os.path.dirname(path)


def identity():
    """(uid, gid, why): the sandbox user when this runs as root and it can work, else (None,
    None, why not): the workers then run as this process's user."""
    if os.geteuid() != 0:
        return None, None, "not root: student code runs as this user"
    try:
        user = pwd.getpwnam(USER)
    except KeyError:
        return None, None, f"no user {USER} (setup.sh creates it): student code runs as root"
    python = [sys.base_prefix, sys.prefix, os.path.realpath(sys.executable)]
    private = [p for p in python if not _readable_by_all(p)]
    if private:
        why = f"{private[0]} is not readable by {USER}: student code runs as root"
        return None, None, why
    return user.pw_uid, user.pw_gid, f"student code runs as user {USER}"


def mode_line():
    """One line for the grade output: whom student code runs as."""
    return "sandbox: " + identity()[2]


# ---- killing what a call left ----


def kill_tree(pid):
    """SIGKILL ``pid``, its process group and every process below it (torchrun's workers start
    sessions of their own, which a group kill misses)."""
    for target in [*descendants(pid), pid]:
        try:
            os.kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_sandbox_user():
    """As root with a sandbox user: SIGKILL every process of that user and empty its keyrings
    (kill_user: a forked child becomes the user), then remove what it left (remove_leftovers);
    returns how many processes were left. Elsewhere a no-op returning 0."""
    uid = identity()[0]
    if uid is None:
        return 0
    kill_user(uid)  # its keyrings emptied too
    left = [p for p in _pids() if _owner(p) == uid]
    remove_leftovers(uid)
    return len(left)


def _pids():
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


# ---- removing what a call left in the kernel and on disk ----

IPC_RMID = 0
IPC_ID = {"shm": "shmid", "sem": "semid", "msg": "msqid"}  # /proc/sysvipc/<kind>'s id column
SHARED_DIRS = ("/dev/shm", "/dev/mqueue", "/tmp", "/var/tmp", "/run/lock", "/var/lock")
# where a system keeps other folders any user can write (/var/crash, /run/screen)
WRITABLE_PARENTS = ("/", "/run", "/var", "/dev")


def shared_dirs():
    """The folders any user can create files in: SHARED_DIRS and every world-writable folder
    directly inside WRITABLE_PARENTS, each once (/var/lock is a link to /run/lock)."""
    found = [*SHARED_DIRS, tempfile.gettempdir()]
    for parent in WRITABLE_PARENTS:
        try:
            entries = list(os.scandir(parent))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False) and entry.stat().st_mode & stat.S_IWOTH:
                    found.append(entry.path)
            except OSError:
                continue
    return list(dict.fromkeys(os.path.realpath(f) for f in found))


def ipc_of(uid):
    """[(kind, id)] of the System V shared memory segments, semaphore sets and message queues
    that ``uid`` owns or created (an owner can be changed, a creator cannot)."""
    found = []
    for kind, column in IPC_ID.items():
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header, *rows = f.read().splitlines()
        except (OSError, ValueError):
            continue
        names = header.split()
        for row in rows:
            fields = dict(zip(names, row.split()))
            if str(uid) in (fields.get("uid"), fields.get("cuid")):
                found.append((kind, int(fields[column])))
    return found


def remove_ipc(uid):
    """Remove every System V IPC object of ``uid``; a segment still attached goes once its last
    process is gone (they are killed first). Returns how many are left."""
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, ident in ipc_of(uid):
        if kind == "shm":
            libc.shmctl(ident, IPC_RMID, None)
        elif kind == "sem":
            libc.semctl(ident, 0, IPC_RMID)
        else:
            libc.msgctl(ident, IPC_RMID, None)
    return len([k for k, _ in ipc_of(uid) if k != "shm"])  # a removed segment may linger


def remove_files_of(uid, folders, depth=4):
    """Remove every file, link and folder ``uid`` owns under ``folders``, never following a link:
    it can only have made them in a folder any user can write (those are searched, ``depth``
    deep) or in a folder of its own (removed whole)."""
    for folder in folders:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            directory = stat.S_ISDIR(info.st_mode)
            try:
                if info.st_uid == uid:
                    if directory:
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.unlink(entry.path)
                elif directory and info.st_mode & stat.S_IWOTH and depth > 1:
                    remove_files_of(uid, [entry.path], depth - 1)
            except OSError:
                pass


def empty(folder):
    """Remove everything inside ``folder`` (the workers' scratch) and its extended attributes
    (a worker's note to the next call), the folder itself kept."""
    try:
        for name in os.listxattr(folder):
            os.removexattr(folder, name)
    except OSError:  # a file system without them
        pass
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        except OSError:
            pass


def remove_leftovers(uid=None):
    """As root with a sandbox user, once its processes are killed: its System V IPC objects, and
    its files in every folder any user can write (shared_dirs: POSIX shared memory and message
    queues are files there). Memory a worker left in them stays charged to the container until
    removed."""
    uid = identity()[0] if uid is None else uid
    if uid is None:
        return
    remove_ipc(uid)
    remove_files_of(uid, shared_dirs())


def _owner(pid):
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _oom_kills():
    """The kernel's count of out-of-memory kills in this process's memory cgroup, or None."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            name = f"/sys/fs/cgroup/memory{path}/memory.oom_control"
        elif controllers == "":
            name = f"/sys/fs/cgroup{path}/memory.events"
        else:
            continue
        try:
            with open(name) as f:
                found = re.search(r"^oom_kill (\d+)$", f.read(), re.M)
            if found:
                return int(found.group(1))
        except OSError:
            continue
    return None


def memory_limit():
    """This process's memory cgroup limit in bytes, or None when there is none."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        names = []
        if "memory" in controllers.split(","):
            names.append(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
        elif controllers == "":
            names.append(f"/sys/fs/cgroup{path}/memory.max")
        for name in names:
            try:
                with open(name) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < 2**60:
                return int(text)
    return None


# ---- the zygote ----


def _env(extra=None):
    """The whole environment a worker gets: nothing of the grader's."""
    scratch = _scratch()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": scratch,
        "TMPDIR": scratch,
        "PYTHONPATH": os.pathsep.join([_site(), probes_dir(), stage()]),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "LANG": "C.UTF-8",
        "GRADE_BROKEN": json.dumps(broken()),
    }
    env.update(extra or {})
    return env


_STATE = {}  # the zygote, the scratch and site folders of this process


def _private_dir(name):
    """A folder of this process's sandbox state, readable by all, writable by this user."""
    if "base" not in _STATE:
        _STATE["base"] = tempfile.mkdtemp(prefix="sandbox-")
        os.chmod(_STATE["base"], 0o755)
    path = os.path.join(_STATE["base"], name)
    os.makedirs(path, exist_ok=True)
    return path


def _scratch():
    """The workers' one writable folder (their HOME, TMPDIR and working directory)."""
    if "scratch" not in _STATE:
        path = os.environ.get("GRADE_SCRATCH") or _private_dir("scratch")
        uid, gid, _ = identity()
        if uid is not None:
            os.chown(path, uid, gid)
        os.chmod(path, 0o700)
        _STATE["scratch"] = path
    return _STATE["scratch"]


def _site():
    """A folder with a sitecustomize that gives the GRADE_BROKEN placeholders to every Python a
    worker starts (torchrun's ranks); the forked workers install them themselves."""
    if "site" not in _STATE:
        path = _private_dir("site")
        with open(CHILD) as f:
            child = f.read()
        with open(os.path.join(path, "sandbox_child.py"), "w") as f:
            f.write(child)
        with open(os.path.join(path, "sitecustomize.py"), "w") as f:
            f.write("import sandbox_child\n\nsandbox_child.install_placeholders()\n")
        for name in os.listdir(path):
            os.chmod(os.path.join(path, name), 0o644)
        _STATE["site"] = path
    return _STATE["site"]


class Zygote:
    """A zygote and the socket to it; forks a worker per spawn(). ``path``: connect to the zygote
    listening there (tools/grade.py's, shared by its sessions) instead of starting one."""

    def __init__(self, preload=(), path=None, listener=None):
        self.proc, self.dead = None, False
        if path is not None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.sock.connect(path)
        else:
            if listener is None:
                self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            else:
                self.sock, theirs = None, listener
            self.proc = _start_zygote(theirs, preload)
            if listener is not None:
                return
            theirs.close()
        self.pending = []
        if self._next("ready", 300) is None:
            raise RuntimeError("the sandbox's zygote did not start (see its output above)")

    def alive(self):
        return not self.dead and (self.proc is None or self.proc.poll() is None)

    def _next(self, op, timeout):
        """The next message ``op`` (others are queued); None when the zygote is gone."""
        deadline = time.monotonic() + timeout
        while True:
            for i, message in enumerate(self.pending):
                if message["op"] == op:
                    return self.pending.pop(i)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return None
            data = self.sock.recv(1 << 16)
            if not data:
                self.dead = True
                return None
            self.pending.append(json.loads(data))

    def messages(self):
        """Messages that have arrived, without waiting."""
        while select.select([self.sock], [], [], 0)[0]:
            data = self.sock.recv(1 << 16)
            if not data:
                self.dead = True
                break
            self.pending.append(json.loads(data))
        out, self.pending = self.pending, []
        return out

    def spawn(self, request, fds):
        socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
        started = self._next("started", 60)
        if started is None:
            raise RuntimeError("the sandbox's zygote stopped answering")
        return started["pid"]

    def kill_all(self):
        """Kill every process below the zygote (and, as root, every process of the sandbox
        user); return how many are still alive."""
        try:
            self.sock.send(json.dumps({"op": "kill", "uid": identity()[0]}).encode())
        except (OSError, AttributeError):
            return 0
        answer = self._next("killed", 60)
        return answer["left"] if answer else 0

    def close(self):
        if self.sock is not None:
            self.sock.close()
        if self.proc is not None:
            if self.sock is None:  # a listening zygote: it serves until it is stopped
                self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _start_zygote(sock, preload):
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONDONTWRITEBYTECODE": "1",
        "LANG": "C.UTF-8",
    }
    wanted = [*PRELOAD, *preload, *filter(None, os.environ.get("GRADE_PRELOAD", "").split(","))]
    return subprocess.Popen(
        [sys.executable, CHILD, str(sock.fileno()), *dict.fromkeys(wanted)],
        pass_fds=(sock.fileno(),),
        cwd=TOOLS,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_oom_adjust(500),
    )


def shared_zygote(path, preload=()):
    """Start a zygote listening at ``path`` (in a folder only this user can enter) for the
    sessions of one grading (GRADE_ZYGOTE); returns its Zygote, to close() at the end."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(4)
    z = Zygote(preload, listener=listener)
    listener.close()
    return z


def preload_for(root):
    """The torch and standard-library modules the repository's own files under ``root`` import
    (never a submitted file's: the zygote runs as the grader): imported once in the zygote."""
    import ast

    found = []
    names = [f for f in os.listdir(root) if f.endswith(".py")]
    for sub in ("memory", "models", "interop", "layouts", "optimizer_state"):
        if os.path.isdir(os.path.join(root, sub)):
            names += [os.path.join(sub, f) for f in os.listdir(os.path.join(root, sub))]
    for name in (n for n in names if n.endswith(".py")):
        try:
            with open(os.path.join(root, name)) as f:
                tree = ast.parse(f.read())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.append(node.module)
    keep = [m for m in found if m.split(".")[0] in ("torch", "numpy")]
    keep += [m for m in found if m.split(".")[0] in sys.stdlib_module_names]
    return list(dict.fromkeys(m for m in keep if m.split(".")[0] not in ("antigravity", "this")))


def _oom_adjust(score):
    def adjust():
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write(str(score))
        except OSError:
            pass

    return adjust


def zygote():
    """This process's zygote: the grading's shared one (GRADE_ZYGOTE), else one of its own,
    started on first use (again if it died)."""
    z = _STATE.get("zygote")
    if z is None or not z.alive():
        path = os.environ.get("GRADE_ZYGOTE")
        try:
            z = Zygote(path=path) if path else None
        except OSError:  # the shared one is gone (killed for memory): a zygote of its own
            z = None
        z = _STATE["zygote"] = z or Zygote(preload_for(ROOT) if not path else ())
    return z


# ---- one call ----


class _Worker:
    def __init__(self, pid, out, result, decoy):
        self.pid, self.out, self.result, self.decoy = pid, out, result, decoy
        self.tail, self.data, self.status, self.too_big = b"", bytearray(), None, False
        self.killed, self.forged = False, 0  # forged: bytes that arrived on the decoy

    def fds(self):
        return [fd for fd in (self.out, self.result, self.decoy) if fd is not None]

    def record(self):
        """The payload of the one framed record on the result pipe, or None: nothing, a damaged
        frame, bytes after it (a second record), or any byte on the decoy."""
        head = len(MAGIC) + 8
        data = bytes(self.data)
        if self.forged or len(data) < head or not data.startswith(MAGIC):
            return None
        if int.from_bytes(data[len(MAGIC) : head], "big") != len(data) - head:
            return None
        return data[head:]


def _request(**fields):
    uid, gid, _ = identity()
    return {
        "op": "spawn",
        "uid": uid,
        "gid": gid,
        "cwd": _scratch(),
        "sys_path": [probes_dir(), stage()],
        "broken": broken(),
        "limits": LIMITS,
        **fields,
    }


def _timeout(timeout):
    """``timeout``, cut where this test file's time ends (GRADE_DEADLINE)."""
    deadline = os.environ.get("GRADE_DEADLINE")
    if deadline:
        left = float(deadline) - time.time() - GRACE_S - 2
        if left < 1:
            raise StudentCodeError("not run: the time for this test file ran out", "budget")
        timeout = min(timeout, left)
    return timeout


def run_workers(requests, timeout, inputs=None):
    """Spawn one worker per request (``inputs[i]``: the descriptor of request i's inputs, handed
    to that worker alone); wait for all of them (at most ``timeout`` + GRACE_S); kill whatever
    they left. Returns the _Workers (status None: it never ended by itself)."""
    z = zygote()
    workers = []
    try:
        for i, request in enumerate(requests):
            out_r, out_w = os.pipe()
            res_r, res_w = os.pipe()
            decoy_r, decoy_w = os.pipe()
            given = [inputs[i]] if inputs else []
            try:
                pid = z.spawn({**request, "timeout": timeout}, [out_w, res_w, decoy_w, *given])
            finally:
                for fd in (out_w, res_w, decoy_w):
                    os.close(fd)
            workers.append(_Worker(pid, out_r, res_r, decoy_r))
        _wait(z, workers, time.monotonic() + timeout + GRACE_S)
    finally:  # whatever happened, nothing started for this call outlives it
        for w in workers:
            if w.status is None:
                _kill_worker(w)
        z.kill_all()
        remove_leftovers()  # nor anything it left in the kernel or the shared folders
        empty(_scratch())
        for w in workers:
            _drain(w)
    return workers


def _kill_worker(w):
    w.killed = True
    try:
        os.killpg(w.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(w, fd):
    try:
        chunk = os.read(fd, 1 << 20)
    except BlockingIOError:
        raise
    except OSError:
        chunk = b""
    if not chunk:
        os.close(fd)
        if fd == w.out:
            w.out = None
        elif fd == w.decoy:
            w.decoy = None
        else:
            w.result = None
        return
    if fd == w.out:
        w.tail = (w.tail + chunk)[-MAX_OUTPUT:]
    elif fd == w.decoy:
        w.forged += len(chunk)
    else:
        w.data += chunk
        if len(w.data) > MAX_RESULT_BYTES:
            w.too_big = True
            os.close(fd)
            w.result = None
            _kill_worker(w)


def _drain_result(w):
    for name in ("decoy", "result"):
        if getattr(w, name) is None:
            continue
        os.set_blocking(getattr(w, name), False)
        try:
            while getattr(w, name) is not None:
                _read(w, getattr(w, name))
        except BlockingIOError:
            pass
        if getattr(w, name) is not None:
            os.close(getattr(w, name))
            setattr(w, name, None)


def _drain(w):
    for fd in w.fds():
        os.set_blocking(fd, False)
        try:
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                if fd == w.out:
                    w.tail = (w.tail + chunk)[-MAX_OUTPUT:]
                elif fd == w.decoy:
                    w.forged += len(chunk)
        except (BlockingIOError, OSError):
            pass
        os.close(fd)
    w.out = w.result = w.decoy = None


def _wait(z, workers, deadline):
    by_pid = {w.pid: w for w in workers}
    while True:
        for message in z.messages():
            if message["op"] == "exited" and message["pid"] in by_pid:
                w = by_pid[message["pid"]]
                w.status = message["status"]
                _drain_result(w)  # written before it exited: in the pipes now (a process it
                # left behind may hold them open, never wait for it)
        done = [w for w in workers if w.status is not None and w.result is None]
        if len(done) == len(workers) or not z.alive():
            return
        if any(_failed(w) for w in done):  # the other ranks would wait in a collective
            deadline = min(deadline, time.monotonic() + PEERS_S)
        left = deadline - time.monotonic()
        if left <= 0:
            return
        fds = [fd for w in workers for fd in w.fds()]
        ready, _, _ = select.select([*fds, z.sock], [], [], min(left, 0.5))
        for w in workers:
            for fd in w.fds():
                if fd in ready:
                    _read(w, fd)


def _failed(w):
    """A finished worker that did not return a value (its record's first byte says which)."""
    record = w.record()
    return w.status != 0 or w.too_big or record is None or record[:1] != OK


def printable(value):
    """``value`` with every string in it made valid UTF-8 (a lone surrogate, which an exception
    message can carry, becomes "?"): a report printed or written as JSON cannot fail on it."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(printable(v) for v in value)
    return value


def _load(data):
    import torch

    try:
        return printable(torch.load(io.BytesIO(data[1:]), weights_only=True))
    except Exception as error:  # what a worker wrote is never trusted to be well formed
        return {"ok": False, "kind": "died", "message": f"its result could not be read ({error})"}


def _where_it_hung(output):
    """ "muon_zero.py line 12 in newton_schulz": the innermost staged frame of a stack dump."""
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', output)
    base = stage() + os.sep
    mine = [f for f in frames if f[0].startswith(base)] or frames
    if not mine:
        return ""
    path, line, function = mine[0]
    return f"; it was at {os.path.relpath(path, stage())} line {line} in {function}"


def _outcome(w, timeout, oom_before):
    """The worker's record, or a failure record that says how it ended."""
    output = w.tail.decode(errors="replace")
    if w.too_big:
        message = f"the probe returned more than {MAX_RESULT_BYTES >> 20} MiB"
        return {"ok": False, "kind": "died", "message": message}, output
    if w.forged:
        message = (
            "the submitted code wrote to the grader's result pipe (descriptor 3): a value counts "
            "only when the probe returned it"
        )
        return {"ok": False, "kind": "tampered", "message": message}, output
    if w.data and w.status == 0 and w.record() is None:
        message = (
            "the worker's result pipe held more than one record or a damaged one: a value "
            "counts only when the probe's own return wrote the one record"
        )
        return {"ok": False, "kind": "tampered", "message": message}, output
    if w.data and w.status == 0:
        return _load(w.record()), output
    if "Timeout (" in output or (w.killed and w.status is None):
        message = f"did not finish in {timeout:.0f} s{_where_it_hung(output)}"
        return {"ok": False, "kind": "timeout", "message": message}, output
    if w.record() is not None and w.record()[:1] != OK:  # a failure, then a non-zero exit
        return _load(w.record()), output
    code = w.status
    if code == -signal.SIGKILL and not w.killed:
        now = _oom_kills()
        if now is None or oom_before is None or now > oom_before:
            return {"ok": False, "kind": "oom", "message": "out of memory"}, output
        return {"ok": False, "kind": "died", "message": "was killed (signal 9)"}, output
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        what = "crashed (segmentation fault)" if code == -signal.SIGSEGV else f"died ({name})"
        return {"ok": False, "kind": "died", "message": f"{what} before returning"}, output
    message = f"exited (exit code {code}) before returning: something called os._exit or exit"
    return {"ok": False, "kind": "died", "message": message}, output


def _inputs_fd(args, kwargs):
    """The probe's inputs in an anonymous memory file: a descriptor handed to one worker alone,
    with no name on any file system for another worker to find (not even in the zygote's memory,
    which every worker forked after it inherits)."""
    import torch

    fd = os.memfd_create("probe-inputs", os.MFD_CLOEXEC)
    with os.fdopen(os.dup(fd), "wb") as f:
        torch.save({"args": args, "kwargs": kwargs}, f)
    return fd


def _run(probe, world_size, args, kwargs, timeout, per_rank=None):
    """``probe`` in 1 worker (world_size 0) or ``world_size`` rank workers; their values. Rank r
    also gets ``per_rank[r]`` as keyword arguments, in a file of its own."""
    timeout = _timeout(timeout)
    ranks = max(1, world_size)
    if per_rank is None:
        inputs = [_inputs_fd(args, kwargs)] * ranks
    else:
        inputs = [_inputs_fd(args, {**kwargs, **own}) for own in per_rank]
    port = free_port()
    requests = []
    for rank in range(ranks):
        env = _env()
        if world_size:
            env.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
                SANDBOX_GROUP_TIMEOUT_S=str(max(5, int(timeout))),
            )
        requests.append(_request(probe=probe, env=env, tag=f"{probe}/{rank}"))
    oom_before = _oom_kills()
    try:
        workers = run_workers(requests, timeout, inputs)
    finally:
        for fd in set(inputs):
            os.close(fd)
    outcomes = [_outcome(w, timeout, oom_before) for w in workers]
    errors = {r: o for r, (o, _) in enumerate(outcomes) if not o.get("ok")}
    if errors:
        _raise(errors, outcomes, world_size)
    return [o["value"] for o, _ in outcomes]


def _raise(errors, outcomes, world_size):
    # the first rank that failed on its own, not one stopped because another failed first
    def first_failure(rank):
        error = errors[rank]
        peer = any(p in error.get("message", "") for p in PEER_FAILED)
        return (error.get("kind") == "timeout", peer, error.get("at", float("inf")), rank)

    order = sorted(errors, key=first_failure)
    rank = order[0]
    first, output = errors[rank], outcomes[rank][1]
    where = f" (rank {rank} of {world_size})" if world_size else ""
    stubs = sorted({s for e in errors.values() for s in e.get("stubs", ())})
    kind = first.get("kind", "died")
    if kind == "oom":
        ranks = f"at {world_size} ranks" if world_size else "in one process"
        limit = memory_limit()
        limit = f"; this container's memory limit is {limit / 2**20:.0f} MB" if limit else ""
        message = f"out of memory {ranks}: the kernel killed the worker{where}{limit}"
    else:
        message = f"{first['message']}{where}"
    if first.get("traceback"):
        message += "\n" + first["traceback"]
    if output.strip():
        message += "\n--- output ---\n" + output[-OUTPUT_TAIL:]
    raise StudentCodeError(message, kind, stubs, output[-OUTPUT_TAIL:])


def free_port():
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(probe, *args, timeout=120.0, **kwargs):
    """``probe(*args, **kwargs)`` in one sandboxed worker; its return value.

    ``probe`` is "STEM:function", a function of tests/graded/probes/STEM.py."""
    return _run(probe, 0, args, kwargs, timeout)[0]


def on_ranks(probe, world_size, *args, timeout=120.0, per_rank=None, **kwargs):
    """``probe(rank, world_size, *args, **kwargs, **per_rank[rank])`` on ``world_size`` gloo
    ranks; values by rank. What is in ``per_rank[r]`` reaches rank r alone (its data shard): a
    submission that answers without the collectives cannot see the other ranks' inputs."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if per_rank is not None and len(per_rank) != world_size:
        raise ValueError(f"per_rank has {len(per_rank)} entries for {world_size} ranks")
    return _run(probe, world_size, args, kwargs, timeout, per_rank)


def torchrun(file, nproc, args=(), timeout=300.0, check=True):
    """The staged ``file`` run as ``torchrun --nproc_per_node=nproc file args`` runs it: ``nproc``
    sandboxed workers, each with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, ...) running the file as __main__, forked from the zygote (no fresh interpreter
    of ~150 MB per rank). CompletedProcess: the exit status of the first rank that failed (else
    0), every rank's stdout and stderr in ``.stdout``, rank by rank. With ``check`` a non-zero
    exit raises StudentCodeError."""
    timeout = _timeout(timeout)
    path = os.path.join(stage(), file)
    port = free_port()
    requests = []
    for rank in range(nproc):
        env = _env(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_RANK": "0",
                "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_RUN_ID": "sandbox",
            }
        )
        request = _request(script=path, script_args=[str(a) for a in args], env=env)
        requests.append({**request, "tag": f"{file}/{rank}"})
    workers = run_workers(requests, timeout)
    texts = [w.tail.decode(errors="replace") for w in workers]
    text = "".join(
        t if nproc == 1 else "".join(f"[rank{r}]: {line}\n" for line in t.splitlines())
        for r, t in enumerate(texts)
    )
    argv = ["torchrun", f"--nproc_per_node={nproc}", file, *map(str, args)]
    timed = [r for r, w in enumerate(workers) if "Timeout (" in texts[r] or w.status is None]
    own = [r for r, w in enumerate(workers) if r not in timed and w.status not in (None, 0)]
    if timed and not own:  # nothing failed: something hung
        where = _where_it_hung(texts[timed[0]])
        raise StudentCodeError(
            f"{file} at {nproc} ranks did not finish in {timeout:.0f} s{where}", "timeout", (), text
        )
    codes = [w.status if w.status is not None else -signal.SIGKILL for w in workers]
    rank = own[0] if own else next((r for r, c in enumerate(codes) if c != 0), 0)
    code = codes[rank]
    if check and code != 0:
        first = _first_error(texts[rank]) or f"exit code {code}"
        raise StudentCodeError(
            f"{file} at {nproc} ranks failed on rank {rank}: {first}\n{text[-OUTPUT_TAIL:]}",
            "raised",
            (),
            text,
        )
    return subprocess.CompletedProcess(argv, code, text)


def _first_error(output):
    """The last exception line of a traceback in ``output`` ("ValueError: ..."), or ""."""
    found = re.findall(r"^((?:\w+\.)*\w*(?:Error|Exception|Interrupt)\b.*)$", output, re.M)
    return found[-1][:300] if found else ""


def import_check(modules, timeout=30.0, placeholders=True):
    """{file: why it could not be imported} for each module, each imported alone in a worker, in
    order; with ``placeholders`` a later module that imports one found broken gets a placeholder
    (compose.py keeps its points when muon_zero.py fails). Needs no torch in this process."""
    failed, reasons = {}, {}
    for module in modules:
        filename = module.replace(".", os.sep) + ".py"
        request = _request(
            env=_env({"GRADE_BROKEN": json.dumps(reasons)}),
            tag=f"import {module}",
            broken=dict(reasons) if placeholders else {},
            sys_path=[stage()],
            **{"import": module},
        )
        (w,) = run_workers([request], timeout)
        output = w.tail.decode(errors="replace")
        record = None
        if w.status == 0 and w.record() is not None:
            try:
                record = printable(json.loads(w.record()[:65536]))
            except ValueError:
                record = None
        if record is not None and record.get("ok"):
            continue
        if record is not None:
            why = str(record.get("message", "it failed"))[:500]
        elif "Timeout (" in output or w.status is None:
            why = f"importing it did not finish in {timeout:.0f} s{_where_it_hung(output)}"
        elif w.status is not None and w.status < 0:
            why = f"importing it crashed the process ({signal.Signals(-w.status).name})"
        else:
            why = f"the process exited (exit code {w.status}) while importing it"
        failed[filename] = why
        reasons[module] = f"{filename} could not be imported: {why}"
    return failed


def close():
    """Stop this process's zygote and remove its folders (at exit, or sooner)."""
    z = _STATE.pop("zygote", None)
    if z is not None:
        z.kill_all()
        z.close()
        remove_leftovers()
    base = _STATE.pop("base", None)
    if base is not None:
        shutil.rmtree(base, ignore_errors=True)
    _STATE.clear()


atexit.register(close)
