"""The child side of tools/sandbox.py: run one probe over the staged files, send back its value.

    python tools/sandbox_child.py STEM:function ARGS_FILE

Started by sandbox.py with the staged folder and tests/graded on PYTHONPATH, the result pipe's
descriptor in SANDBOX_RESULT_FD, and for a rank of a multi-rank probe the usual RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT. Writes one ``torch.save`` record to the pipe: {"ok": True, "value"}
or {"ok": False, "kind", "message", "traceback", "stubs"}. Nothing here is trusted by the grader.
"""

import datetime
import faulthandler
import importlib
import os
import re
import sys
import traceback

STUB = re.compile(r"^([A-Za-z_][\w.]*): ")
TRACEBACK_LINES = 12


def _send(record):
    import torch

    fd = int(os.environ["SANDBOX_RESULT_FD"])
    with os.fdopen(fd, "wb") as pipe:
        torch.save(record, pipe)


def _failure(error):
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
    return {"ok": False, "kind": kind, "message": message, "traceback": short, "stubs": stubs}


def main():
    spec, args_file = sys.argv[1], sys.argv[2]
    timeout = float(os.environ.get("SANDBOX_TIMEOUT_S", "120"))
    faulthandler.dump_traceback_later(timeout, exit=True)  # where it hung, then exit
    stem, function = spec.split(":", 1)
    try:
        import torch

        torch.set_num_threads(1)
        inputs = torch.load(args_file, weights_only=False)
        probe = getattr(importlib.import_module(f"probes.{stem}"), function)
        world = os.environ.get("WORLD_SIZE")
        if world is not None:
            import torch.distributed as dist

            seconds = float(os.environ.get("SANDBOX_GROUP_TIMEOUT_S", timeout))
            dist.init_process_group(
                "gloo",
                rank=int(os.environ["RANK"]),
                world_size=int(world),
                timeout=datetime.timedelta(seconds=seconds),
            )
            try:
                value = probe(
                    int(os.environ["RANK"]), int(world), *inputs["args"], **inputs["kwargs"]
                )
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
        else:
            value = probe(*inputs["args"], **inputs["kwargs"])
        record = {"ok": True, "value": value}
    except BaseException as error:  # everything goes back as a record; nothing is trusted
        record = _failure(error)
    _send(record)


if __name__ == "__main__":
    main()
