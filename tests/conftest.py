import os
import sys

# The suite runs on gloo and the CPU, also on a machine with GPUs (the one-GPU check is
# `make gpu-check`): hide CUDA before anything imports torch, for this process and its children.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# The technique files live at the repository root, the tests' helpers beside this file; both
# import by name (the process spawner as tools.spawn). Children (spawn's fork server,
# run_torchrun) inherit this sys.path.
HERE = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.dirname(HERE), HERE):
    if path in sys.path:
        sys.path.remove(path)
    sys.path.insert(0, path)


# The two tiers: `make test` runs `-m "not slow"`, `make test-slow` runs `-m slow`. Each file
# marks its slow tests (`@pytest.mark.slow`, `pytest.param(..., marks=pytest.mark.slow)`) and keeps
# one representative of each in the default tier.
