"""The untrusted side of tools/sandbox.py: a zygote that forks one worker per probe call.

    python tools/sandbox_child.py FD [MODULE ...]   # started by sandbox.py, never by hand

Starting a Python that imports torch costs about 1.7 s of CPU, a whole grading a few hundred of
them. The zygote pays it once: it imports torch (and MODULE ..., what the graded files import) in a
clean single-threaded process that never imports a submitted file, then forks a worker for each
request that arrives on the socket FD. The worker leaves the zygote's session, takes its output
and result pipes, drops to the sandbox user (when the grader runs as root), limits itself
(processes, file size, no core dumps, first in line for the kernel's out-of-memory killer, no new
privileges), and only then puts the staged folder on sys.path and runs the probe. It writes one
framed ``torch.save`` record (MAGIC, length, payload) to its result pipe: {"ok": True, "value"}
or {"ok": False, "kind", "message", "traceback", "stubs"}; an import check writes JSON. Nothing a
worker does is trusted.

The result pipe sits at a descriptor drawn per worker; descriptor 3 is a decoy pipe. What the
grader then enforces (tools/sandbox.py): any byte on the decoy fails the call; the result pipe
must hold exactly one whole frame and the worker must exit 0, so a record the submission writes
beside the probe's makes two and fails the call. What it cannot enforce: the submission shares
this process, its memory and its descriptors, so no secret can be kept from it. Code that finds
the real descriptor (/proc/self/fd), writes one well-formed record and exits 0 before the probe
writes, or that rewrites the probe's values in memory where bind_probe's checks do not look, is
indistinguishable from an honest worker. A value only the worker can measure (bytes alive,
peaks, FLOPs, call counts) is therefore never graded alone: each such test also compares values
the test process recomputes on the same call (outputs, gradients, recomputed tensors). Where those
equal what plain code gives (tensor_ckpt's checkpointed model is bitwise the plain one), a record
that imitates a correct worker's still passes: docs/grading.md says so.

Messages on the socket are JSON, one per packet: "spawn" (with the two pipes' write ends) answered
by "started" and, when the worker ends, "exited"; "kill" (every process below the zygote, and
every process of the sandbox user) answered by "killed".
"""

import ast
import ctypes
import dataclasses
import errno
import faulthandler
import functools
import gc
import importlib
import importlib.abc
import importlib.util
import io
import json
import os
import platform
import random
import re
import resource
import select
import signal
import socket
import sys
import time
import traceback
import types

STUB = re.compile(r"^([A-Za-z_][\w.]*): ")
TRACEBACK_LINES = 12
DECOY_FD = 3  # where a result pipe would be expected: the grader rejects a call with a byte on it
MAGIC = b"SANDBOX-RECORD\n"  # a frame: MAGIC, the payload's length (8 bytes), the payload
_RESULT = {"fd": None}  # the record's descriptor, drawn per worker
_INPUTS = {}  # "data": the probe's inputs, read from the descriptor only this worker was handed
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38


def _prctl(option, value):
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0)


# ---- a sibling file that could not be imported: a placeholder that says so when used ----


class _Missing:
    """Stands for anything taken from a file that could not be imported; using it raises."""

    def __init__(self, name, reason):
        self._name, self._reason = name, reason

    def _fail(self, *args, **kwargs):
        raise ImportError(self._reason)

    __call__ = _fail

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._name}.{name}", self._reason)

    def __mro_entries__(self, bases):
        raise ImportError(self._reason)

    def __repr__(self):
        return f"<{self._name}: {self._reason}>"


class _PlaceholderModule(types.ModuleType):
    def __init__(self, name, reason):
        super().__init__(name)
        self.__reason = reason

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__name__}.{name}", self.__reason)


class _Placeholders(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of the named modules give a module whose every attribute is a _Missing."""

    def __init__(self, broken):
        self.broken = broken  # module name -> "muon_zero.py could not be imported: ..."

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in self.broken else None

    def create_module(self, spec):
        return _PlaceholderModule(spec.name, self.broken[spec.name])

    def exec_module(self, module):
        pass


def install_placeholders(broken=None):
    """Put the placeholders for GRADE_BROKEN's modules (a JSON object) in front of every import."""
    broken = broken if broken is not None else json.loads(os.environ.get("GRADE_BROKEN") or "{}")
    if broken:
        sys.meta_path.insert(0, _Placeholders(broken))


# ---- what a worker sends back ----


def plain(value, where="the value"):
    """``value`` as tensors, numbers, strings, None and lists/tuples/dicts of them (a dataclass
    becomes a dict, a named tuple a tuple, a Parameter its data); anything else raises TypeError."""
    import torch

    if value is None or type(value) in (bool, int, float, complex, str, bytes):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().as_subclass(torch.Tensor)
    if isinstance(value, (torch.Size, torch.dtype, torch.device)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {plain(k, where): plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    for kind in (bool, int, float, str):  # a subclass (an enum, a numpy float): the plain value
        if isinstance(value, kind):
            return kind(value)
    raise TypeError(
        f"{where} is a {type(value).__name__}: a probe returns tensors, numbers, strings, None "
        "and lists, tuples and dicts of them"
    )


def failure(error):
    """The record of an exception: its first line in the student's terms, a short traceback."""
    if isinstance(error, SystemExit):
        message = f"the code called sys.exit({error.code!r}) instead of returning"
    else:
        first = (str(error).splitlines() or [""])[0]
        message = f"{type(error).__name__}: {first}" if first else type(error).__name__
    stubs = []
    if isinstance(error, NotImplementedError):
        found = STUB.match(str(error))
        if found:
            stubs.append(found.group(1))
    lines = traceback.format_exception(error)
    short = "".join(lines[-TRACEBACK_LINES:]).rstrip()
    kind = "stub" if stubs else "raised"
    record = {"ok": False, "kind": kind, "message": message, "traceback": short, "stubs": stubs}
    return {**record, "at": time.time()}


def import_failure(error, filename):
    """Why importing ``filename`` failed, in one line: "SyntaxError at line 3: ..."."""
    if isinstance(error, SystemExit):
        return f"it called sys.exit({error.code!r}) while being imported"
    line = getattr(error, "lineno", None) if isinstance(error, SyntaxError) else None
    for frame in traceback.extract_tb(error.__traceback__):
        if frame.filename.endswith(os.sep + filename) or frame.filename == filename:
            line = frame.lineno
    first = (str(error).splitlines() or [""])[0]
    return f"{type(error).__name__}" + (f" at line {line}" if line else "") + f": {first}"


# ---- the probe, bound before the submitted code runs ----


class Tampered(Exception):
    """The submitted code changed the probe, the models and meters beside it, or torch."""


GUARDED_TORCH = (
    "torch",
    "torch.Tensor",
    "torch.nn.Module",
    "torch.autograd",
    "torch.autograd.graph",
    "torch.UntypedStorage",
    "torch.utils.flop_counter",
    "torch.distributed",
    "torch.serialization",  # what the record is saved with
    "pickle",
)


def _resolve(dotted):
    """ "torch.nn.Module" -> the class: the longest importable prefix, then attributes."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for name in parts[k:]:
            value = getattr(value, name)
        return value
    raise ImportError(dotted)


# rebound by torch itself: torch._dynamo wraps manual_seed when it is first imported (by fx)
REBOUND = {("torch", "manual_seed")}


def _snapshot(owners):
    """{(owner name, attribute): id} of every attribute of ``owners`` ({name: module or class}),
    of the classes a module defines, and of the items of its module-level dicts."""
    seen = {}
    for label, owner in owners.items():
        for name, value in list(vars(owner).items()):
            if name.startswith("__") or (label, name) in REBOUND:
                continue
            seen[(label, name)] = (id(value), value)
            home = getattr(owner, "__name__", None) if isinstance(owner, types.ModuleType) else None
            if isinstance(value, type) and home and value.__module__ == home:
                for attr, member in list(vars(value).items()):
                    seen[(f"{label}.{name}", attr)] = (id(member), member)
            if isinstance(value, dict) and home:
                for key, item in list(value.items()):
                    seen[(f"{label}.{name}", repr(key))] = (id(item), item)
    return seen


def _changed(before, owners):
    after = _snapshot(owners)
    return sorted(f"{o}.{n}" for (o, n), (ident, _) in before.items()
                  if after.get((o, n), (None,))[0] != ident)  # fmt: skip


def _trusted(module):
    top = module.split(".")[0]
    return top == "torch" or top.startswith("models_") or top in sys.stdlib_module_names


def _trusted_bindings(tree):
    """{name: object} that the probe's top-level imports of torch, the standard library and the
    grader's models_* bind, imported here before any submitted file is."""
    bound = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _trusted(alias.name):
                    module = importlib.import_module(alias.name)
                    if alias.asname:
                        bound[alias.asname] = module
                    else:
                        top = alias.name.split(".")[0]
                        bound[top] = sys.modules[top]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _trusted(node.module):
            module = importlib.import_module(node.module)
            for alias in node.names:
                bound[alias.asname or alias.name] = getattr(module, alias.name)
    return bound


def bind_probe(stem, function):
    """``probes.<stem>.<function>`` loaded from its own file, and a check to run after the call.

    The grader's modules the probe imports (models_*: the models and the meters) and the torch
    the probes measure with are imported and recorded before the probe imports the submission;
    the probe's functions are compiled from their source first. The check raises Tampered when
    any of them is no longer what was recorded (a module swapped in sys.modules, a meter or a spy
    patched), so the values the probe returns came from the probe's code."""
    spec = importlib.util.find_spec(f"probes.{stem}")
    with open(spec.origin, "rb") as f:
        source = f.read()
    tree = ast.parse(source, spec.origin)
    graders = sorted({n.module for n in tree.body if isinstance(n, ast.ImportFrom)
                      and (n.module or "").startswith("models_")})  # fmt: skip
    owners = {name: importlib.import_module(name) for name in graders}
    owners.update({name: _resolve(name) for name in GUARDED_TORCH})
    owners["sandbox_child"] = sys.modules[__name__]
    bound = _trusted_bindings(tree)
    before = _snapshot(owners)
    code = compile(tree, spec.origin, "exec")
    pristine = {c.co_name: c for c in code.co_consts if isinstance(c, types.CodeType)}
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    exec(code, vars(module))  # the functions' code objects are the ones compiled above
    defined = {name: vars(module).get(name) for name in pristine}

    def intact():
        wrong = _changed(before, owners)
        wrong += sorted(
            f"probes.{stem}.{name}"
            for name, code in pristine.items()
            if vars(module).get(name) is not defined[name]
            or getattr(defined[name], "__code__", code) is not code
        )
        wrong += sorted(f"probes.{stem}.{name}" for name, value in bound.items()
                        if vars(module).get(name) is not value)  # fmt: skip
        if sys.modules.get(spec.name) is not module:
            wrong.append(f"sys.modules[{spec.name!r}]")
        if wrong:
            raise Tampered(
                f"the submitted code changed the grader's {wrong[0]}"
                + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else "")
                + ": a graded value counts only when the probe's own code measured it"
            )

    return defined[function], intact


def frame(data):
    """The one record a worker writes: MAGIC, len(data) as 8 bytes, data."""
    return MAGIC + len(data).to_bytes(8, "big") + data


_JSON, _WRITE = json.dumps, os.write  # bound before any submitted file is imported


def _send(data, check=None, fd=None, write=_WRITE, dumps=None):
    """Write the one framed record with ``write`` to ``fd`` (bound by the caller before the
    submission was imported). ``check`` (the probe's intact) runs right before the write: a
    change made to the grader while the record was built still fails the call."""
    if check is not None:
        try:
            check()
        except BaseException as error:
            data = b"\x00" + dumps(failure(error))
    view = memoryview(frame(data))
    while view:
        view = view[write(fd, view) :]


def _dumps(record, save=None, bytes_io=None):
    """``record`` as torch.save's bytes, with the save and BytesIO bound when the zygote starts."""
    buffer = bytes_io()
    save(record, buffer)
    return buffer.getvalue()


_DUMPS = None  # _dumps with torch.save bound: set by serve(), before any worker forks


def _run_probe(request):
    import torch

    send, dumps, write, fd = _send, _DUMPS, _WRITE, _RESULT["fd"]  # before any submitted import
    intact = None
    stem, function = request["probe"].split(":", 1)
    try:
        data = io.BytesIO(_INPUTS.pop("data"))
        inputs = torch.load(data, weights_only=False)  # written by the grader
        probe, intact = bind_probe(stem, function)
        world = os.environ.get("WORLD_SIZE")
        if world is None:
            record = {"ok": True, "value": plain(probe(*inputs["args"], **inputs["kwargs"]))}
        else:
            record = _on_rank(probe, int(world), inputs)
    except BaseException as error:  # everything goes back as a record; nothing is trusted
        record, intact = failure(error), None
    try:
        data = (b"\x01" if record["ok"] else b"\x00") + dumps(record)  # the flag is read first
    except Exception as error:  # a value torch cannot save
        data = b"\x00" + dumps(failure(error))
    send(data, intact if record["ok"] else None, fd, write, dumps)


def _on_rank(probe, world, inputs):
    """The probe on this rank, in a gloo group; a failure is recorded before the group closes
    (closing it fails the other ranks, and the first failure is the one to report)."""
    import datetime

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    seconds = float(os.environ.get("SANDBOX_GROUP_TIMEOUT_S", "60"))
    timeout = datetime.timedelta(seconds=seconds)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        record = {
            "ok": True,
            "value": plain(probe(rank, world, *inputs["args"], **inputs["kwargs"])),
        }
    except BaseException as error:
        record = failure(error)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return record


def _run_script(path, args):
    """``python path args`` in this process, as one of torchrun's ranks would run it (the
    rendezvous is in the environment): its exit status is the worker's."""
    import runpy

    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
        if not isinstance(error.code, (int, type(None))):
            print(error.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_import(request):
    module = request["import"]
    filename = module.replace(".", os.sep) + ".py"
    try:
        importlib.import_module(module)
        record = {"ok": True}
    except BaseException as error:
        record = {"ok": False, "message": import_failure(error, filename)}
    _send(_JSON(record).encode(), fd=_RESULT["fd"])


def _read_inputs(fd):
    """The whole memory file ``fd`` (shared by every rank of a call: read by position)."""
    size, parts, done = os.fstat(fd).st_size, [], 0
    while done < size:
        part = os.pread(fd, size - done, done)
        if not part:  # the file shrank under us: a truncated pickle would fail later, less clearly
            raise OSError(f"the inputs ended at {done} of {size} bytes")
        parts.append(part)
        done += len(part)
    os.close(fd)
    return b"".join(parts)


def _worker(request, out_fd, result_fd, decoy_fd, inputs_fd=None):
    """In the forked child: become the sandboxed worker, run the request, exit. ``inputs_fd``:
    the probe's inputs, this worker's alone."""
    if inputs_fd is not None:
        _INPUTS["data"] = _read_inputs(inputs_fd)
    os.setsid()  # its own session and process group: killed as one
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    taken = {out_fd, result_fd, decoy_fd}
    draw = random.SystemRandom()
    real = next(n for n in iter(lambda: draw.randrange(64, 1000), None) if n not in taken)
    os.dup2(result_fd, real)  # a record written to descriptor 3 lands on the decoy instead
    _RESULT["fd"] = real
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.dup2(decoy_fd, DECOY_FD)
    os.closerange(DECOY_FD + 1, real)  # the socket, the zygote's pipes, anything inherited
    os.closerange(real + 1, 65536)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # the kernel kills a worker first, never the grader
    except OSError:
        pass
    limits = request.get("limits", {})
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))  # a POSIX queue outlives it, unlisted
    if limits.get("fsize"):
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["fsize"], limits["fsize"]))
    uid, gid = request.get("uid"), request.get("gid")
    if uid is not None:
        if limits.get("nproc"):  # counted per user: a fork bomb stops here
            resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"], limits["nproc"]))
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_SET_DUMPABLE, 0)  # another rank, the same user, cannot read this one's memory
    os.umask(0o077)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="replace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="replace")
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.dump_traceback_later(request["timeout"], exit=True)  # where it hung, then exit
    sys.path[:] = [*request["sys_path"], *SITE_PATH]
    importlib.invalidate_caches()
    install_placeholders(request.get("broken") or {})
    if request.get("script"):
        _run_script(request["script"], request.get("script_args", []))
    elif request.get("import"):
        _run_import(request)
    else:
        _run_probe(request)


# ---- the zygote ----

SITE_PATH = []  # the zygote's sys.path without its own folder: the interpreter's and the venv's


def descendants(pid):
    """Every process below ``pid`` (Linux /proc); tools/sandbox.py and tools/spawn.py kill with
    it too."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


KEYCTL = {"x86_64": 250, "aarch64": 219}.get(platform.machine())  # the keyctl syscall's number
KEYCTL_CLEAR, USER_KEYRINGS = 7, (-4, -5)  # KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING


def clear_keyrings():
    """Empty this user's keyrings: what a worker keeps there outlives its processes, and the
    next call's workers, the same user, could read it."""
    if KEYCTL is not None:
        libc = ctypes.CDLL(None, use_errno=True)
        for ring in USER_KEYRINGS:
            libc.syscall(KEYCTL, KEYCTL_CLEAR, ring)


def kill_user(uid):
    """SIGKILL every process of ``uid`` (from a forked child that becomes ``uid``: kill(-1) then
    reaches exactly that user's processes), and empty its keyrings. Returns once none is left."""
    for _ in range(50):
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setresuid(uid, uid, uid)
                for _ in range(20):
                    try:
                        os.kill(-1, signal.SIGKILL)
                    except OSError as error:
                        if error.errno == errno.ESRCH:
                            break
                clear_keyrings()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        if not _processes_of(uid):
            return


def _processes_of(uid):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def _kill_all(uid):
    for _ in range(20):
        below = descendants(os.getpid())
        if uid is not None:
            kill_user(uid)
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        _reap({}, None)
        if not descendants(os.getpid()):
            return 0
    return len(descendants(os.getpid()))


def _reap(workers, sock):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        tag = workers.pop(pid, None)
        if tag is not None and sock is not None:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            _say(sock, {"op": "exited", "pid": pid, "tag": tag, "status": code})


def _say(sock, message):
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        pass


def serve(sock, preload):
    """The zygote: import torch and ``preload``, then serve ``sock``: one grader's connection, or
    a listening socket whose connections (one pytest session after another) it serves in turn.
    When a connection closes, everything started for it is killed."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # a worker's orphans come here, where "kill" finds them
    import torch

    torch.set_num_threads(1)
    import io

    global _DUMPS
    _DUMPS = functools.partial(_dumps, save=torch.save, bytes_io=io.BytesIO)
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # a module this torch lacks: the worker imports it or says why
            pass
    gc.freeze()  # the collector never writes to what is here: the workers share these pages
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        _serve_one(sock, wake_r)
        return
    while True:
        conn, _ = sock.accept()
        _serve_one(conn, wake_r)
        conn.close()


def _serve_one(sock, wake_r):
    workers, uid = {}, None
    _say(sock, {"op": "ready", "pid": os.getpid()})
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [], 1.0)
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        _reap(workers, sock)
        if sock not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)  # output, result, decoy, inputs
        except OSError:
            data, fds = b"", []
        if not data:  # this grader is gone: so is everything started for it
            _kill_all(uid)
            return
        request = json.loads(data)
        uid = request.get("uid", uid)
        if request["op"] == "kill":
            left = _kill_all(uid)
            _say(sock, {"op": "killed", "left": left})
        elif request["op"] == "spawn":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 70
                try:
                    sock.close()
                    _worker(request, *fds)
                    code = 0
                except BaseException:  # the worker's own set-up failed: say so on its output
                    traceback.print_exc()
                finally:
                    os._exit(code)
            for fd in fds:
                os.close(fd)
            workers[pid] = request.get("tag", "")
            _say(sock, {"op": "started", "pid": pid, "tag": request.get("tag", "")})


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if p and os.path.abspath(p) != here]  # nothing of tools/
    SITE_PATH[:] = sys.path
    sock = socket.socket(fileno=int(sys.argv[1]))
    serve(sock, sys.argv[2:])


if __name__ == "__main__":
    main()
