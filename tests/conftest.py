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
