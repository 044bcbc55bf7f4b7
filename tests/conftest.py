import os
import sys

# The suite runs on gloo and the CPU, also on a machine with GPUs (the one-GPU check is
# `make gpu-check`): hide CUDA before anything imports torch, for this process and its children.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# The technique files live at the repository root and the harness beside this file; both import by name.
HERE = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.dirname(HERE), HERE):
    if path not in sys.path:
        sys.path.insert(0, path)
