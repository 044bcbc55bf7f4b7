"""Probes the sandbox's own tests call (tests/graded/test_sandbox.py): no submission code, only the
ways a worker can behave and misbehave."""

import ctypes
import os
import platform
import re
import sys
import time
from dataclasses import dataclass


@dataclass
class Plan:
    steps: int
    name: str


def double(x):
    return {"y": x * 2, "n": 3, "plan": Plan(2, "p")}


def ranked(rank, world_size, x):
    import torch.distributed as dist

    t = x.clone() + rank
    dist.all_reduce(t)
    return t


def own_memory(block=1 << 23):
    """The bytes of this process's writable memory, in blocks that overlap by 64 bytes (read
    in-process: a non-dumpable worker may not open its own /proc/self/mem)."""
    with open("/proc/self/maps") as f:
        regions = [line.split() for line in f]
    for fields in regions:
        if not fields[1].startswith("rw"):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        for at in range(lo, hi, block):
            start = max(lo, at - 64)
            yield ctypes.string_at(start, min(hi, at + block) - start)


def own_shard(rank, world_size, shard, secret):
    """What this rank was handed, and what of the ranks' inputs it could reach besides: every
    other SECRET-<16 hex> in its own memory (the zygote's, forked, included), the files a path in
    its memory names under the grader's private folders that hold inputs (its own included: a
    name is a way in), and the other workers whose memory it could open."""
    pattern, found, paths, named = re.compile(rb"SECRET-[0-9a-f]{16}"), set(), set(), []
    for chunk in own_memory():
        found |= {m.decode() for m in pattern.findall(chunk)}
        paths |= set(re.findall(rb"/[\w./+-]*sandbox-[\w./+-]+", chunk))
    for path in sorted(paths):
        try:
            with open(path, "rb") as f:
                if pattern.search(f.read(1 << 24)):
                    named.append(path.decode())
        except OSError:
            pass
    readable = []  # processes of this user (the other ranks) whose memory this one can open
    for pid in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        try:
            with open(f"/proc/{pid}/status") as f:
                if f"\nUid:\t{os.getuid()}\t" not in f.read():
                    continue
            with open(f"/proc/{pid}/mem", "rb"):
                readable.append(int(pid))
        except OSError:
            pass
    return {
        "shard": shard,
        "secrets": sorted(found - {secret}),
        "named": named,
        "readable": readable,
    }


def stub():
    raise NotImplementedError("muon_zero.newton_schulz: write it")


def raises(message="the shapes differ: 3 vs 4"):
    print("some output before the error")
    raise ValueError(message)


def fails_on_rank(rank, world_size):
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise RuntimeError("rank 1 went wrong")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that never comes
    return rank


def hang():
    while True:
        pass


def exits(how):
    if how == "sys.exit":
        sys.exit(0)
    if how == "os._exit":
        os._exit(3)
    if how == "segfault":
        ctypes.string_at(0)
    return how


def detach(seconds):
    """Leave a process behind that outlives the call (a double fork into a new session)."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(seconds)
            os._exit(0)
        os._exit(0)
    return os.getpid()


def not_plain():
    return object()


def who():
    """Who the worker runs as, where, and what it can reach."""
    return {"uid": os.getuid(), "cwd": os.getcwd(), "environ": sorted(os.environ)}


def can(path, mode):
    """Whether opening ``path`` for ``mode`` works in the worker."""
    try:
        with open(path, mode):
            pass
        return True
    except OSError:
        return False


def uses(module, name):
    """Calls ``module.name()`` (a broken sibling gives a placeholder that raises)."""
    import importlib

    return getattr(importlib.import_module(module), name)()


def big(n):
    return "x" * n


KEY_SYSCALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}  # add_key, keyctl
USER_KEYRING, KEYCTL_SEARCH = -4, 10


def leave_behind():
    """Leave System V shared memory (one segment still attached by a detached process), a
    semaphore set, a message queue, a POSIX shared memory file and
    files in every folder any user can write (the lock folder too) behind; try a POSIX message
    queue, an extended attribute on the scratch folder and a key in the user's keyring, notes
    that outlive a process for the next call's workers."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    private, create = 0, 0o1000 | 0o600  # IPC_PRIVATE, IPC_CREAT
    shm = [libc.shmget(private, 1 << 20, create) for _ in range(2)]
    ctypes.memset(libc.shmat(shm[0], None, 0), 1, 1 << 20)  # its pages charged, then detached
    ipc = [("shm", shm[0]), ("shm", shm[1])]
    ipc += [("sem", libc.semget(private, 1, create)), ("msg", libc.msgget(private, create))]
    paths = []
    folders = ("/dev/shm", "/tmp", "/var/tmp", "/run/lock", os.getcwd())
    for folder in (f for f in folders if os.access(f, os.W_OK)):
        path = os.path.join(folder, f"left-behind-{os.getpid()}")
        os.makedirs(path)
        with open(os.path.join(path, "data"), "w") as f:
            f.write("x")
        with open(path + ".txt", "w") as f:
            f.write("x")
        paths += [path, path + ".txt"]
    if os.fork() == 0:  # holds the second segment until it is killed
        os.setsid()
        libc.shmat(shm[1], None, 0)
        time.sleep(300)
        os._exit(0)
    mq = libc.mq_open(b"/left-behind", os.O_CREAT | os.O_RDWR, 0o600, None)
    try:
        os.setxattr(os.getcwd(), "user.left-behind", b"a note")
        xattr = True
    except OSError:  # a file system without them
        xattr = False
    add_key, _ = KEY_SYSCALLS.get(platform.machine(), (None, None))
    key = (
        libc.syscall(add_key, b"user", b"left-behind", b"a note", 6, USER_KEYRING)
        if add_key
        else -1
    )
    return {"ipc": ipc, "paths": paths, "mq": mq >= 0, "xattr": xattr, "key": key}


def what_is_left():
    """What the last call's workers left for this one: the scratch folder's extended attributes,
    and the key leave_behind put in the user's keyring (-1: gone)."""
    libc = ctypes.CDLL(None, use_errno=True)
    _, keyctl = KEY_SYSCALLS.get(platform.machine(), (None, None))
    key = (
        libc.syscall(keyctl, KEYCTL_SEARCH, USER_KEYRING, b"user", b"left-behind", 0)
        if keyctl
        else -1
    )
    return {"xattrs": os.listxattr(os.getcwd()), "key": key}


def tamper(how):
    """What a submission's code could do in the worker it shares with the probe: swap the probe
    module in sys.modules, patch what a probe measures with, or rebind one of the probe's
    functions; then hand back a value as if nothing happened."""
    import types

    import torch

    if how == "module":
        sys.modules[__name__] = types.ModuleType(__name__)
    elif how == "meter":
        torch.autograd.graph.saved_tensors_hooks = lambda pack, unpack: None
    elif how == "function":
        sys.modules[__name__].double = lambda x: {"y": x, "n": 3}
    return "forged"


def forge(how):
    """What a submission's code could do to skip the probe: write a record of its own, as the
    worker would, to descriptor 3 (then return, or exit before the probe writes) or to the
    worker's real result descriptor (then return: the probe writes a second record)."""
    import io

    import torch

    buffer = io.BytesIO(b"\x01")
    buffer.seek(1)
    torch.save({"ok": True, "value": "forged"}, buffer)
    data = sys.modules["__main__"].frame(buffer.getvalue())
    if how == "real fd":
        fds = [int(n) for n in os.listdir("/proc/self/fd") if int(n) >= 64]
        fd = next(n for n in fds if os.readlink(f"/proc/self/fd/{n}").startswith("pipe"))
    else:
        fd = 3
    os.write(fd, data)
    if how == "fd 3, then exit":
        os._exit(0)
    return "honest"


def rewrite():
    """What a submission's code could do to the record the probe is about to send: wrap the
    functions a worker writes with (os.fdopen, os.write) so that they write a forged record."""
    import io

    import torch

    buffer = io.BytesIO(b"\x01")
    buffer.seek(1)
    torch.save({"ok": True, "value": "forged"}, buffer)
    forged = sys.modules["__main__"].frame(buffer.getvalue())
    real_fdopen, real_write = os.fdopen, os.write

    class Pipe:
        def __init__(self, fd, *args, **kwargs):
            self.file = real_fdopen(fd, *args, **kwargs)

        def write(self, data):
            return self.file.write(forged)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    os.fdopen = Pipe
    os.write = lambda fd, data: real_write(fd, forged) and len(data)
    return "honest"
