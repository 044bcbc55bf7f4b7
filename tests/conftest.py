import os
import sys

# The suite runs on gloo and the CPU, also on a machine with GPUs (the one-GPU check is
# `make gpu-check`): hide CUDA before anything imports torch, for this process and its children.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# The technique files live at the repository root and the harness beside this file; both import
# by name. When grading (tools/grade.py), GRADE_SUBMISSION names a folder of a student's files:
# it goes first, so `import mhc` finds the student's mhc.py, never the reference's. Children
# (run_ranks' fork server, run_torchrun) inherit this sys.path and PYTHONPATH.
HERE = os.path.dirname(os.path.abspath(__file__))
SUBMISSION = os.environ.get("GRADE_SUBMISSION")
for path in (os.path.dirname(HERE), HERE, SUBMISSION):
    if path:
        path = os.path.abspath(path)
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)
if SUBMISSION:
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.abspath(SUBMISSION), os.environ.get("PYTHONPATH")) if p
    )
    # Import the student's files now, before any test module or benchmark can reorder sys.path:
    # from here on `import mhc` anywhere in this process is the student's (or its stub's) mhc.
    import importlib

    for name in ("muon_zero", "mhc", "cp_compress", "tensor_ckpt", "memory.memory_timeline"):
        if os.path.exists(os.path.join(SUBMISSION, name.replace(".", os.sep) + ".py")):
            try:
                importlib.import_module(name)
            except Exception:  # a file that fails to import fails its own tests, with the error
                pass
