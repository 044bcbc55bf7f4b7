"""The alternatives catalogue: correct bodies for each solution region, written differently from
the reference, one file per assignment.

Each `tests/alternatives/<stem>.py` holds `ALTERNATIVES = [Alternative(...), ...]`. A check
splices them into the reference (`make grade-alternatives`) and grades it: every graded test
that names or needs the region must still pass, so a test holds only what the docstring asks and
not the reference's incidental choices (an op order, a tie-break, a loop).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Alternative:
    region: str  # "FILESTEM.qualname" of the solution region the body replaces
    name: str  # how it differs from the reference, in a few words ("loop over experts")
    body: str  # replaces the region, markers included, written at indentation 0
