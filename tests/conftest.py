import os
import sys

# The suite runs on gloo and the CPU, also on a machine with GPUs (the one-GPU check is
# `make gpu-check`): hide CUDA before anything imports torch, for this process and its children.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# The technique files and spawn.py live at the repository root, the tests' helpers beside this
# file; both import by name. Children (spawn's fork server, run_torchrun) inherit this sys.path.
HERE = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.dirname(HERE), HERE):
    if path in sys.path:
        sys.path.remove(path)
    sys.path.insert(0, path)


# ---- the two tiers: `make test` runs `-m "not slow"`, `make test-slow` runs `-m slow` ----
# Each file marks its slow tests (`@pytest.mark.slow`, `pytest.param(..., marks=pytest.mark.slow)`)
# and keeps one representative of each in the default tier. These cases' files are marked here.
SLOW_CASES = {
    # the budget against MuonZeRO on gloo ranks: 2 x 2 stays, the pipeline and cp = 4 cases move
    "test_compose_budget.py::test_optimizer_and_gradient_bytes_equal_muonzeros": (
        "2-1-2-fp32",
        "1-4-1-bf16_sr",
    ),
    "test_compose_resume.py::test_cli_saves_at_four_ranks_and_resumes_on_one_with_check": None,
    "test_compose_resume.py::test_saved_at_2x2x1_resumed_at_1x1x4": None,  # 4 ranks twice
    "test_compose_resume.py::test_a_save_stopped_half_way_leaves_the_previous_checkpoint": (
        "dies",  # waits out the process-group timeout
    ),
}


def pytest_collection_modifyitems(items):
    import pytest

    for item in items:
        name = f"{os.path.basename(item.path)}::{item.originalname}"
        if name not in SLOW_CASES:
            continue
        cases = SLOW_CASES[name]
        if cases is None or item.callspec.id in cases:
            item.add_marker(pytest.mark.slow)
