"""Check cells for the notebooks' exercises: right or wrong and why, never the answer first.

An exercise is two cells. The student writes a prediction into a variable; the check cell, whose
first line names that variable, runs what the exercise is about and judges the answer:

    answer_sgd_jump = None  # your prediction, in bytes

    # check: answer_sgd_jump
    measured = ...  # run the experiment
    check("answer_sgd_jump", answer_sgd_jump, number(measured, unit="B", hint="count buffers"))

`check` prints one line, starting with "right:", "wrong:" or "fill in" (the answer is still None);
it never raises, so a notebook executed with its answers unfilled still builds. A judge is any
callable answer -> (ok, why); `number` and `one_of` cover most exercises. A wrong answer's "why"
says which way it is off and what to reconsider, not the expected value.

tests/notebook_answers.py keeps each notebook's reference answers and a wrong one per exercise;
tests/test_notebooks.py executes the notebook with the reference answers filled in and each check
cell re-run with the wrong answer and with None, so the checks cannot rot.
"""

RIGHT, WRONG, TODO = "right:", "wrong:", "fill in"


def check(name, answer, judge):
    """Prints the verdict on `answer` (a variable called `name`); returns True, False or None."""
    if answer is None:
        print(f"{TODO} `{name}` first (replace None with your prediction), then run this cell")
        return None
    try:
        ok, why = judge(answer)
    except (TypeError, ValueError) as error:
        ok, why = False, f"{name} = {answer!r} is not the kind of answer asked for ({error})"
    print(f"{RIGHT if ok else WRONG} {why}")
    return ok


def number(expected, rel=0.0, unit="", hint=""):
    """A judge for a number: right within a relative tolerance `rel` of `expected`.

    Wrong answers hear only whether they are too high or too low, and the hint."""

    def judge(answer):
        value = float(answer)
        if abs(value - expected) <= rel * abs(expected):
            return True, f"{_show(answer, unit)} matches the measured {_show(expected, unit)}"
        side = "too high" if value > expected else "too low"
        return False, f"{_show(answer, unit)} is {side}. {hint}".strip()

    return judge


def one_of(accepted, hint=""):
    """A judge for a choice: right when the answer is in `accepted` (strings compare lowercased)."""
    normal = {a.lower() if isinstance(a, str) else a for a in accepted}

    def judge(answer):
        key = answer.lower().strip() if isinstance(answer, str) else answer
        if key in normal:
            return True, f"{answer!r} is right"
        return False, f"{answer!r} is not it. {hint}".strip()

    return judge


def _show(value, unit):
    text = f"{value:,}" if isinstance(value, int) else f"{value:,.6g}"
    return f"{text} {unit}".strip()
