"""The mistakes catalogue: plausible wrong bodies for each solution region, one file per assignment.

Each `tests/mistakes/<stem>.py` holds `MISTAKES = [Mistake(...), ...]`. A check splices one body at
a time into the reference (as `make grade-check` splices stubs) and grades it: the mistake must
lose points, and the first line of a failing graded test must contain `message`, so a student is
told what is wrong in their own terms.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Mistake:
    region: str  # "FILESTEM.qualname" of the solution region the body replaces
    name: str  # the mistake, in a few words ("tall matrices not transposed")
    message: str  # text the first line of the failing graded test must contain
    body: str  # replaces the region, markers included, written at indentation 0
