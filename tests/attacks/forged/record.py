# Shared by the cases that forge a whole record (`# include: forged/record.py`): the request
# read from the worker's frames, answered by the case's _forged_value(probe, args), written as one
# framed record on the one pipe in /proc/self/fd besides the output and the decoy at 3, then an
# exit before the probe can write its own.
def _forge_record():
    import io
    import os
    import sys

    import torch

    frame = sys._getframe()
    while frame is not None and frame.f_code.co_name != "_run_probe":
        frame = frame.f_back
    if frame is None:
        return
    request, inputs = frame.f_locals["request"], frame.f_locals["inputs"]
    value = _forged_value(request["probe"], inputs["args"])  # noqa: F821 (the case defines it)
    if value is None:
        return
    pipes = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("pipe:") and int(name) > 3:
            pipes.append(int(name))
    if len(pipes) != 1:
        return
    buffer = io.BytesIO()
    torch.save({"ok": True, "value": value}, buffer)
    data = b"\x01" + buffer.getvalue()
    os.write(pipes[0], b"SANDBOX-RECORD\n" + len(data).to_bytes(8, "big") + data)
    os._exit(0)


_forge_record()
