"""The check cells' helpers (notebooks/checks.py): a verdict with its reason, never the answer."""

import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "notebooks"))
from build import sources  # noqa: E402
from checks import RIGHT, TODO, WRONG, check, number, one_of  # noqa: E402

from tests.notebook_answers import ANSWERS  # noqa: E402


def said(capsys):
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, f"a check prints exactly one line, got {lines}"
    return lines[0]


def test_unfilled_answer_asks_for_it_and_does_not_raise(capsys):
    assert check("answer_x", None, number(42)) is None
    line = said(capsys)
    assert line.startswith(TODO) and "answer_x" in line and "42" not in line


@pytest.mark.parametrize("answer, side", [(9_000_000, "too high"), (7, "too low")])
def test_wrong_number_says_which_way_without_the_answer(capsys, answer, side):
    assert check("answer_x", answer, number(5_847_040, unit="B", hint="count buffers")) is False
    line = said(capsys)
    assert line.startswith(WRONG) and side in line and "count buffers" in line
    assert "5,847,040" not in line and "5847040" not in line


def test_right_number_within_tolerance_confirms_it(capsys):
    assert check("answer_x", 5_847_040, number(5_847_040, unit="B")) is True
    assert said(capsys).startswith(RIGHT)
    assert check("answer_x", 101.0, number(100.0, rel=0.02)) is True
    assert said(capsys).startswith(RIGHT)
    assert check("answer_x", 103.0, number(100.0, rel=0.02)) is False
    assert said(capsys).startswith(WRONG)


def test_choices_and_answers_of_the_wrong_kind(capsys):
    judge = one_of(["backward"], hint="when are the activations largest?")
    assert check("answer_phase", " Backward", judge) is True and said(capsys).startswith(RIGHT)
    assert check("answer_phase", "forward", judge) is False
    assert "activations largest" in said(capsys)
    assert check("answer_x", "many", number(3)) is False  # float("many") fails: judged wrong
    assert said(capsys).startswith(WRONG)


def test_every_exercise_has_its_answers_and_every_answer_its_exercise():
    """Static: each `answer_x = None` has a `# check: answer_x` cell and an ANSWERS entry."""
    for path in sources():
        name = os.path.splitext(os.path.basename(path))[0]
        text = open(path).read()
        filled = set(re.findall(r"^(answer_\w+) = None\b", text, re.M))
        checked = set(re.findall(r"^# check: (answer_\w+)\s*$", text, re.M))
        assert filled == checked, f"{name}: answers {filled} vs check cells {checked}"
        assert filled == set(ANSWERS.get(name, {})), (
            f"{name}: tests/notebook_answers.py must list exactly {sorted(filled)}"
        )


def test_answers_are_filled_in_and_a_wrong_reference_is_caught():
    """The mechanism test_notebooks uses, on a two-cell notebook in a real kernel."""
    import nbformat
    from build import execute

    from tests.notebook_answers import assert_verdicts, fill_in_answers

    def notebook():
        return nbformat.v4.new_notebook(
            cells=[
                nbformat.v4.new_code_cell("answer_q = None  # your prediction"),
                nbformat.v4.new_code_cell(
                    "# check: answer_q\nfrom notebooks.checks import check, number\n"
                    'check("answer_q", answer_q, number(2 + 2))'
                ),
            ]
        )

    nb = notebook()
    verdicts = fill_in_answers(nb, "fake", {"answer_q": ("4", "5")})
    assert [v for _, v in verdicts] == [RIGHT, WRONG, TODO] and len(nb.cells) == 4
    execute(nb, timeout=60, cwd=ROOT)
    assert_verdicts(verdicts)
    nb = notebook()
    verdicts = fill_in_answers(nb, "fake", {"answer_q": ("5", "4")})  # a reference gone stale
    execute(nb, timeout=60, cwd=ROOT)
    with pytest.raises(AssertionError, match="should say 'right:'"):
        assert_verdicts(verdicts)
    with pytest.raises(AssertionError, match="add answer_q's answers"):
        fill_in_answers(notebook(), "fake", {})


def _renderings(reference):
    """The ways a page could print a reference answer (Python source): digits with and without
    thousands separators, a float at 1 to 3 decimals, a percentage, a sequence as written."""
    value = eval(reference)  # our own answers file, not student input
    if isinstance(value, str):
        return set()  # a choice: its options are named on the page by design
    if isinstance(value, (list, tuple)):
        return {str(list(value)), str(tuple(value))}
    forms = {f"{value:,}", str(value)} if isinstance(value, int) else {repr(value)}
    if isinstance(value, float):
        forms |= {f"{value:.{d}f}" for d in (1, 2, 3)}
        if 0 < value < 1:
            forms.add(f"{value:.0%}")
    return {f for f in forms if len(f.strip("0.")) > 1}  # a single digit is everywhere on a page


def _shown(cell):
    """What a reader sees of a cell: a markdown cell's text, a code cell's printed outputs."""
    if cell.cell_type == "markdown":
        return cell.source
    texts = [o.get("text", "") for o in cell.get("outputs", [])]
    texts += [o.get("data", {}).get("text/plain", "") for o in cell.get("outputs", [])]
    return "\n".join(texts)


LISTED = {  # exercises that ask to choose among options the page lists, by design
    ("05_compose", "answer_v4_pp"): "the pipeline depths that divide the 88 sublayers",
}


@pytest.mark.parametrize("name", [os.path.splitext(os.path.basename(p))[0] for p in sources()])
def test_no_answer_is_on_the_page_before_its_check(name):
    """An exercise asks for what the page has not said: its reference answer appears in no
    markdown or output above its check cell, nor in the two cells after it (what a reader of the
    executed notebook sees before answering)."""
    import nbformat

    nb = nbformat.read(os.path.join(ROOT, "notebooks", name + ".ipynb"), as_version=4)
    for i, cell in enumerate(nb.cells):
        head = re.match(r"# check: (answer_\w+)", cell.source)
        if cell.cell_type != "code" or not head:
            continue
        var = head.group(1)
        if (name, var) in LISTED:
            continue
        for form in _renderings(ANSWERS[name][var][0]):
            pattern = r"(?<![\w.,])" + re.escape(form) + r"(?![\w]|[.,]\d)"
            for j, seen in enumerate(nb.cells[: i + 3]):
                if j != i and re.search(pattern, _shown(seen)):
                    raise AssertionError(
                        f"{name}: {var}'s answer {form!r} is on the page in cell {j}, which a "
                        f"reader sees before answering at check cell {i}"
                    )
        for j, seen in enumerate(nb.cells[: i + 3]):
            near = _near(ANSWERS[name][var][0], _shown(seen)) if j != i else None
            assert near is None, (
                f"{name}: {var}'s answer is on the page in cell {j} as {near!r} (a printed "
                f"figure within 1.5% of it), which a reader sees before answering at check cell {i}"
            )


def _near(reference, text):
    """A decimal figure in ``text`` within 1.5% of a float answer (a table printing it rounded
    another way gives it away as surely as the answer itself), else None."""
    value = eval(reference)  # our own answers file, not student input
    if not isinstance(value, float) or value == 0:
        return None
    for m in re.finditer(r"(?<![\w.])\d[\d,]*\.\d+(?![\w.])", text):
        if abs(float(m.group().replace(",", "")) - value) <= 0.015 * abs(value):
            return m.group()
    return None
