"""The notebooks' exercises: reference answers, a wrong answer each, and the code using them.

An exercise (notebooks/checks.py) is an `answer_x = None` line and a check cell whose first line is
`# check: answer_x`. tests/test_notebooks.py re-runs every notebook through `fill_in_answers`: each
answer line gets its reference, each check cell must then say "right:", and is re-run after it
with the wrong answer ("wrong:") and with None ("fill in"). A new exercise needs its entry in
ANSWERS, or the test fails naming it.
"""

import copy
import re

from notebooks.checks import RIGHT, TODO, WRONG

ANSWERS = {  # notebook -> {variable: (reference answer, a wrong answer)}, as Python source
    "00_first_step_anomaly": {
        "answer_rmsprop_jump": ("5_847_156", "5_847_040"),  # 4N + 4T; 4N forgets the counters
        "answer_sgd_limit_mib": ("79", "88"),  # step 1 reserves 78 MiB; under 88 both steps fit
        "answer_segments_mib": ("[2, 20, 14]", "[2, 20, 12.3]"),  # 12.3 MiB rounds up to 14
        "answer_micro_batches": ("8", "4"),  # 4 peaks at 38.6 MiB allocated, yet needs a segment
        "answer_amsgrad_jump": ("17_541_236", "17_541_120"),  # 12N + 4T; 12N forgets counters
    },
    "01_muon_zero": {
        "answer_matrices_per_rank": ("[1, 2, 2, 2]", "[2, 2, 2, 1]"),  # the 64x64 fills rank 0
        "answer_padding_elements": ("2048", "0"),  # padded to the largest bucket, not matrix
        "answer_momentum_gib": ("4.76", "4.12"),  # dense / 32 + experts / 256; all / 256 is wrong
        "answer_widest_under_10": ("96", "64"),  # padding is not monotonic in the width
        "answer_fraction_up": ("0.64", "0.36"),  # 0.01 / 2^-6 above 3; 0.36 is the way down
    },
    "02a_mhc_math": {
        "answer_total": ("4.0", "16.0"),  # n columns, each summing to 1 at any depth
        "answer_rounds": ("56", "20"),  # std 1.5 needs far more than V4's 20
    },
    "02b_mhc_reductions": {
        "answer_kept_numbers": ("161", "129"),  # 2n^2 + 4n + 1; 129 forgets the projection's n^2
        "answer_block": ("5", "4"),  # sqrt(128/6) = 4.62: 5 costs 55.6 lanes, 4 costs 56
        "answer_traffic_mib": ("0.75", "0.125"),  # 6 lanes x d x 4 B x 256 tokens; 0.125 forgets n
        "answer_in_flight": ("4", "8"),  # the stages, not the micro-batches (GPipe holds all 8)
    },
    "03_cp_compress": {
        "answer_rows_used": ("5", "7"),  # rows 11-15; 7 is the whole halo, not what is pooled
        "answer_entries": ("[3, 4]", "[4, 4]"),  # ends 3, 8, 12 | 16, 23, 27, 31; not s/m each
        "answer_empty_rank": ("[0, 16, 19, 22, 25, 28, 31, 48]", "[0, 9, 29, 31, 48]"),  # < m each
        "answer_allgather_bytes": ("473_088", "462_848"),  # 7 x 33 x 512 x 4; 32 slots forget +1
    },
    "04_tensor_ckpt": {
        "answer_qkv_bytes": ("786_432", "0"),  # SDPA saves q, k, v: views of qkv
        "answer_fc2_bytes": ("0", "262_144"),  # nothing saves a sum's inputs; its size is wrong
        "answer_warned": ('["permute"]', '["proj"]'),  # a view of qkv; a named matmul does not warn
        "answer_batch": ("7", "8"),  # 0.57 MiB per sequence: 8 keeps 4.5 MiB
        "answer_lowest_peak": ('"module"', '"tensor_ckpt"'),  # keeps only each layer's input
    },
    "05_compose": {
        "answer_layouts_12": ("18", "9"),  # ordered triples; 9 counts some orders once
        "answer_stage1_bytes": ("1_048_576", "2_097_152"),  # 4x1x1's, halved by cp = 2
        "answer_peak_1x8x1": ("9.18", "6.17"),  # activations and state halve; 6.17 halves all
        "answer_one_node_factor": ("10.0", "2.0"),  # every byte crossed nodes: the bandwidth ratio
        "answer_v4_pp": ("44", "8"),  # 8 bytes x 297.6 B / pp < 80 GB first at 44
        "answer_resume_on_3": ("[(3, 1, 1)]", "[(3, 1, 1), (1, 1, 3)]"),  # 4 sequences, 3 replicas
    },
}
ANSWER_LINE = re.compile(r"^(answer_\w+) = None\b", re.M)
CHECK_LINE = re.compile(r"# check: (answer_\w+)\s*$")


def fill_in_answers(nb, name, answers=None):
    """Fills nb's answers with the references and adds, after each check cell, the same check
    with the wrong answer and with None; returns [(cell, the verdict it must print)]."""
    answers = ANSWERS.get(name, {}) if answers is None else answers
    found, cells, verdicts = set(), [], []
    for cell in nb.cells:
        cells.append(cell)
        if cell.cell_type != "code":
            continue
        for var in ANSWER_LINE.findall(cell.source):
            assert var in answers, f"{name}: add {var}'s answers to tests/notebook_answers.py"
            found.add(var)
            cell.source = cell.source.replace(f"{var} = None", f"{var} = {answers[var][0]}", 1)
        checked = CHECK_LINE.match(cell.source.split("\n", 1)[0])
        if checked:
            var = checked.group(1)
            verdicts.append((cell, RIGHT))
            for value, verdict in ((answers[var][1], WRONG), ("None", TODO)):
                probe = copy.deepcopy(cell)
                probe.source = f"{var} = {value}\n" + cell.source
                cells.append(probe)
                verdicts.append((probe, verdict))
    assert found == set(answers), f"{name}: no exercise for {sorted(set(answers) - found)}"
    nb.cells = cells
    return verdicts


def assert_verdicts(verdicts):
    """Each executed check cell printed exactly one verdict line, the expected one."""
    for cell, verdict in verdicts:
        said = [line for o in cell.outputs for line in o.get("text", "").splitlines()]
        said = [line for line in said if line.startswith((RIGHT, WRONG, TODO))]
        assert len(said) == 1 and said[0].startswith(verdict), (
            f"this check cell should say {verdict!r}, it said {said}:\n{cell.source}"
        )
