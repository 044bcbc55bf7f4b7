# Appends forged "collected" and "result" events to the grader's report file (mechanism 4): from
# its environment, or any report it can find.
# target: stub
# where: prefix
import json as _json
import os as _os

_forged = [
    {
        "event": "collected",
        "nodeid": "tests/graded/test_alpha.py::test_forged",
        "points": 10000,
        "solutions": ["alpha.double"],
        "needs": [],
    },
    {
        "event": "result",
        "nodeid": "tests/graded/test_alpha.py::test_forged",
        "when": "call",
        "outcome": "passed",
        "seconds": 0,
        "output": "",
        "stubs": [],
    },
]
_paths = {_os.environ.get("GRADE_REPORT", "")}
for _top in ("/tmp", "/autograder", _os.getcwd()):
    for _folder, _, _files in _os.walk(_top):
        _paths |= {_os.path.join(_folder, f) for f in _files if f.endswith(".jsonl")}
for _pid in _os.listdir("/proc"):
    try:
        with open(f"/proc/{_pid}/environ", "rb") as f:
            for _item in f.read().split(b"\0"):
                if _item.startswith(b"GRADE_REPORT="):
                    _paths.add(_item.split(b"=", 1)[1].decode())
    except OSError:
        pass
for _path in filter(None, _paths):
    try:
        with open(_path, "a") as f:
            f.write("".join(_json.dumps(e) + "\n" for e in _forged))
    except OSError:
        pass
