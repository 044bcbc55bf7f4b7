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
# The default tier keeps one representative of each slow part; the cases that move to the slow
# tier are named here, by test name (in any file) and by the parameters of the case, so the test
# files stay as their owners wrote them. A rule that matched no test is named at the end of a
# whole-suite run, so a renamed test cannot slip back into the default tier unseen.
RANKS = ("world_size", "world")
SLOW = [
    # (test name glob, the slow cases: {parameter: values}, (case id globs,) or None for all)
    # every notebook but 00, the quickest, which stays in the default tier
    ("test_notebook_reexecutes", ("01_*", "02a_*", "02b_*", "03_*", "04_*", "05_*")),
    ("test_demo_replays_under_nccl_rules", {"world_size": (3, 4)}),  # one replay per file: 2
    ("test_*fault_matrix*", {r: (3, 4) for r in RANKS}),  # every fault at 2 ranks
    # muon_zero's guard at 2 ranks: lr, init and shape stay; its other fields are slow cases
    (
        "test_every_rank_refuses_a_mismatch",
        {"world": (3, 4), "field": ("adamw_lr", "dtype")},
    ),
    ("test_*raises_mid_step*", {r: (3, 4) for r in RANKS}),
    # MuonZeRO through torch.distributed.checkpoint: saved at 2 and resumed at 3 stays
    ("test_dcp_resumes_at_any_world_size", ("1-*", "3-*", "4-*", "2-1", "2-2", "2-4")),
    ("test_dcp_check_fails_without_the_optimizer_state", None),
    ("test_dcp_save_writes_what_each_rank_owns", {"world": (1, 3, 4)}),
    ("test_dcp_save_memory_is_this_ranks_state_plus_a_bounded_buffer", {"world": (4,)}),
    ("test_*rank_with_different_input*", {r: (3, 4) for r in RANKS}),
    ("test_guard_every_rank_raises_*", {r: (3, 4) for r in RANKS}),
    ("test_cp_equals_single_device_reference", {"world_size": (1, 4)}),  # 2 and 3 ranks stay
    ("test_cp_matches_plain_sdpa_attention", {"world_size": (1, 4)}),
    ("test_pipeline_equals_single_process", {"world_size": (1, 4)}),
    ("test_pipeline_is_safe_under_nccls_rules", {"world_size": (4,)}),
    ("test_collective_across_ranks", {"world_size": (4, 6)}),
    ("test_every_layout_equals_one_process", None),  # compose: every factorisation of 1-4
    ("test_one_rank_raises_mid_step_every_rank_says_so", None),  # compose: waits out an abort
    ("test_compose_replays_under_nccl_rules_at_every_four_rank_layout", None),  # 6 launches
    ("test_cli_saves_at_four_ranks_and_resumes_on_one_with_check", None),  # compose, 2 launches
    ("test_saved_at_2x2x1_resumed_at_1x1x4", None),  # compose: 4 ranks twice
    ("test_a_save_stopped_half_way_leaves_the_previous_checkpoint", ("dies",)),  # a timeout
    ("test_full_student_build_fails_every_graded_test", None),  # the all-stubs grading
    ("test_compiled_*", ("inductor",)),  # Inductor's C++ build (also marked in its file)
    # the budget against MuonZeRO on gloo ranks: 2 x 2 stays, the pipeline and cp = 4 cases move
    ("test_optimizer_and_gradient_bytes_equal_muonzeros", {"pp": (2,), "cp": (4,)}),
]


def _is_slow(number, item):
    import fnmatch

    pattern, cases = SLOW[number]
    if not fnmatch.fnmatchcase(getattr(item, "originalname", None) or item.name, pattern):
        return False
    callspec = getattr(item, "callspec", None)
    if cases is None:
        return True
    if callspec is None:
        return False
    if isinstance(cases, dict):
        return any(callspec.params.get(k, object()) in v for k, v in cases.items())
    return any(fnmatch.fnmatchcase(callspec.id, case) for case in cases)


def pytest_collection_modifyitems(session, config, items):
    import pytest

    matched = set()
    for item in items:
        hits = [n for n in range(len(SLOW)) if _is_slow(n, item)]
        matched.update(hits)
        if hits:
            item.add_marker(pytest.mark.slow)
    files = {item.nodeid.split("::")[0] for item in items}
    if len(files) >= 10 and not config.getoption("keyword"):  # the whole suite, or most of it
        config._slow_rules_unmatched = [SLOW[n][0] for n in range(len(SLOW)) if n not in matched]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    unmatched = getattr(config, "_slow_rules_unmatched", None)
    if unmatched:
        terminalreporter.write_line(
            f"tests/conftest.py: slow-tier rules that matched no test (renamed?): {unmatched}"
        )
