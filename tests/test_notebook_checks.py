"""The check cells' helpers (notebooks/checks.py): a verdict with its reason, never the answer."""

import ast
import functools
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
    assert check("answer_phase", None, judge) is None and said(capsys).startswith(TODO)
    listed = one_of([44], hint="the first depth under the limit")
    assert check("answer_pp", 44, listed) is True and said(capsys).startswith(RIGHT)
    assert check("answer_pp", 22, listed) is False and "first depth" in said(capsys)


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
    for name, answers in ANSWERS.items():  # choices too: a wrong option, not a wrong kind
        for var, (reference, wrong) in answers.items():
            right, other = eval(reference), eval(wrong)  # our own answers file
            assert right is not None and other is not None and right != other, (
                f"{name}: {var} needs a reference and a different wrong answer, got {answers[var]}"
            )
            assert type(right) is type(other) and _is_choice(right) == _is_choice(other), (
                f"{name}: {var}'s wrong answer {wrong} must be of its reference's kind "
                f"({reference}), so that the check judges the choice, not the type"
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
    thousands separators, a float at 1 to 3 decimals, a percentage, a byte count in KiB and MiB,
    a sequence as written. A choice (a string, or a list of strings or tuples) is named, not
    rendered: see `_namings`."""
    value = eval(reference)  # our own answers file, not student input
    if _is_choice(value):
        return set()
    if isinstance(value, (list, tuple)):
        return {str(list(value)), str(tuple(value))}
    forms = {f"{value:,}", str(value)} if isinstance(value, int) else {repr(value)}
    if isinstance(value, float):
        forms |= {f"{value:.{d}f}" for d in (1, 2, 3)}
        if 0 < value < 1:
            forms.add(f"{value:.0%}")
    if isinstance(value, int) and value >= 2**10 and value % 2**8 == 0:  # bytes, said in KiB/MiB
        forms |= {f"{value / 2**10:g} KiB", f"{value / 2**20:.2f} MiB", f"{value / 2**20:g} MiB"}
    return {f for f in forms if len(f.strip("0.")) > 1}  # a single digit is everywhere on a page


def _is_choice(value):
    items = value if isinstance(value, (list, tuple)) else [value]
    return all(isinstance(v, (str, tuple)) for v in items)


def _namings(reference):
    """How a printed line names a choice's reference option: each option as a word, a layout
    tuple as (3, 1, 1), 3x1x1 or 3 x 1 x 1, a number not inside another number."""
    value = eval(reference)  # our own answers file, not student input
    items = value if isinstance(value, list) else [value]
    forms = []
    for item in items:
        if isinstance(item, tuple):
            forms += [re.escape(str(item)), r"\b" + r"\s*x\s*".join(map(str, item)) + r"\b"]
        elif isinstance(item, str):
            forms.append(r"(?<![\w.])" + re.escape(item) + r"(?![\w])")
        else:
            forms.append(r"(?<![\w.,])" + re.escape(str(item)) + r"(?![\d]|[.,]\d)")
    return forms


# a figure printed on the same line: a number with a unit, a decimal, or a percentage
FIGURE = re.compile(r"\d\.\d|\d\s*(?:%|[KMG]iB|B\b|GB|MFLOP|ms\b|s\b)")
# figure text a reader sees in the image: the string literals these calls draw
DRAWN = ("set_title", "suptitle", "text", "annotate", "set_xlabel", "set_ylabel", "legend")


@functools.cache
def _drawn(source):
    """The literal text a code cell draws into its figures (titles, labels, annotations, legend
    labels): an f-string's literal parts only, its values are not known without running it."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    texts = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        args = list(node.args) if name in DRAWN else []
        args += [k.value for k in node.keywords if k.arg in ("label", "title")]
        for arg in args:
            for const in ast.walk(arg):
                if isinstance(const, ast.Constant) and isinstance(const.value, str):
                    texts.append(const.value)
    return "\n".join(texts)


def _shown(cell, markdown=True):
    """What a reader sees of a cell: a markdown cell's text, a code cell's printed outputs and the
    literal text it draws into its figures (``markdown=False``: outputs only)."""
    if cell.cell_type == "markdown":
        return cell.source if markdown else ""
    texts = [o.get("text", "") for o in cell.get("outputs", [])]
    texts += [o.get("data", {}).get("text/plain", "") for o in cell.get("outputs", [])]
    return "\n".join(texts + [_drawn(cell.source)])


LISTED = {  # choices among numbers the page lists by design: judged as choices are
    ("05_compose", "answer_v4_pp"): "the pipeline depths that divide the 88 sublayers",
}


def _window(nb, i):
    """The cells a reader sees before answering at check cell ``i``: all above, two below."""
    return [(j, cell) for j, cell in enumerate(nb.cells[: i + 3]) if j != i]


def answer_on_the_page(name, var, nb, i):
    """Where ``var``'s reference answer shows in the window of its check cell ``i``, else None.

    A number: any rendering of it in markdown, printed output or drawn text, or a printed decimal
    within 1.5% of it. A choice: its options are named on the page by design, so a printed line
    (output, not markdown) that names the reference option beside a figure (a row of a table of
    the options' measured values) gives it away."""
    reference = ANSWERS[name][var][0]
    if (name, var) in LISTED or _is_choice(eval(reference)):
        for j, cell in _window(nb, i):
            for line in _shown(cell, markdown=False).splitlines():
                for form in _namings(reference):
                    if re.search(form, line) and FIGURE.search(re.sub(form, "", line)):
                        return j, line.strip()
        return None
    for form in _renderings(reference):
        pattern = r"(?<![\w.,])" + re.escape(form) + r"(?![\w]|[.,]\d)"
        for j, cell in _window(nb, i):
            if re.search(pattern, _shown(cell)):
                return j, form
    for j, cell in _window(nb, i):
        near = _near(reference, _shown(cell))
        if near is not None:
            return j, f"{near} (a printed figure within 1.5% of it)"
    return None


@pytest.mark.parametrize("name", [os.path.splitext(os.path.basename(p))[0] for p in sources()])
def test_no_answer_is_on_the_page_before_its_check(name):
    """An exercise asks for what the page has not said: its reference answer appears in no
    markdown, printed output (tables included) or figure text above its check cell, nor in the
    two cells after it (what a reader of the executed notebook sees before answering); a
    choice's reference option is printed beside no figure there."""
    import nbformat

    nb = nbformat.read(os.path.join(ROOT, "notebooks", name + ".ipynb"), as_version=4)
    for i, cell in enumerate(nb.cells):
        head = re.match(r"# check: (answer_\w+)", cell.source)
        if cell.cell_type == "code" and head:
            found = answer_on_the_page(name, head.group(1), nb, i)
            assert found is None, (
                f"{name}: {head.group(1)}'s answer is on the page in cell {found[0]} as "
                f"{found[1]!r}, which a reader sees before answering at check cell {i}"
            )


def test_the_page_check_finds_a_number_a_table_row_and_a_drawn_label():
    """The checker on hand-made pages: each give-away found, each honest page passed."""
    import nbformat

    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell

    def page(*cells, check_at=1):
        cells = list(cells)
        cells.insert(check_at, code("# check: answer_x"))
        return nbformat.v4.new_notebook(cells=cells)

    def out(text, source="print()"):
        cell = code(source)
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
        return cell

    def found(reference, nb):
        ANSWERS["fake"] = {"answer_x": (reference, "None")}
        try:
            i = next(i for i, c in enumerate(nb.cells) if c.source == "# check: answer_x")
            return answer_on_the_page("fake", "answer_x", nb, i)
        finally:
            del ANSWERS["fake"]

    assert found("786_432", page(md("Forget qkv: how many bytes?"), out("saved 0.75 MiB")))
    assert found("4.76", page(md("x"), md("y"), out("padded: 4.80 GiB"), check_at=1))
    assert found("4.76", page(md("x"), md("y"), md("z"), out("padded: 4.80 GiB"))) is None
    table = "none    11.29 MiB\nmodule   8.29 MiB\n"
    assert found('"module"', page(md("Which of none, module?"), out(table)))
    assert found('"module"', page(md("Which of none, module, with 8.29 MiB?"), out("done"))) is None
    assert found("[(3, 1, 1)]", page(md("3 x 1 x 1 or 1 x 1 x 3?"), out("3x1x1: 2.0 GiB")))
    drawn = code('ax.set_title("the peak: 5847156 B")')
    assert found("5_847_156", page(md("Predict the jump."), drawn))


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
