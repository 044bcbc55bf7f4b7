# Leaves memory that outlives every process at each import: a System V shared memory segment and a
# POSIX shared memory file of 96 MB each, written (charged to the container), a semaphore set and
# a message queue. Unless each call removes them, every other file runs out of memory (each file
# is imported alone, this one among them, before any is graded).
# file: tensor_ckpt.py
# target: reference
# where: suffix
import ctypes as _ctypes
import os as _os

_SIZE = 96 * 2**20
try:
    _libc = _ctypes.CDLL(None, use_errno=True)
    _libc.shmat.restype = _ctypes.c_void_p
    _segment = _libc.shmget(0, _SIZE, 0o1000 | 0o600)  # IPC_PRIVATE: a new one at each import
    _at = _libc.shmat(_segment, None, 0)
    _ctypes.memset(_at, 1, _SIZE)
    _libc.shmdt(_ctypes.c_void_p(_at))
    _libc.semget(0, 1, 0o1000 | 0o600)
    _libc.msgget(0, 0o1000 | 0o600)
    with open(f"/dev/shm/left-{_os.getpid()}", "wb") as _f:
        for _ in range(_SIZE >> 20):
            _f.write(b"\1" * 2**20)
except Exception:
    pass
