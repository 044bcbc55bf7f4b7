"""The mistakes catalogue: plausible wrong bodies for each solution region, one file per assignment.

Each `tests/mistakes/<stem>.py` holds `MISTAKES = [Mistake(...), ...]`. Most mistakes are the
reference with a local change, written as `edits`: (old, new) pairs applied to the reference's own
region body at check time, each `old` found exactly once, so the catalogue shows only what is
wrong and follows the reference as it changes (an `old` no longer there is reported as a defect).
A mistake that rewrites the whole region (another algorithm) gives its `body` instead.
A check splices one mistake at a time into the reference (as `make grade-check` splices stubs) and
grades it: the mistake must lose points, and the first line of a failing graded test must contain
`message`, so a student is told what is wrong in their own terms.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Mistake:
    region: str  # "FILESTEM.qualname" of the solution region the mistake replaces
    name: str  # the mistake, in a few words ("tall matrices not transposed")
    message: str  # text the first line of the failing graded test must contain
    body: str | None = None  # replaces the region, markers included, written at indentation 0
    edits: tuple = ()  # (old, new) pairs on the reference's body, dedented to indentation 0

    def __post_init__(self):
        if (self.body is None) == (not self.edits):
            raise ValueError(
                f"Mistake {self.region} / {self.name}: give exactly one of `body` (a whole "
                f"rewrite) or `edits` ((old, new) pairs on the reference's body)"
            )
        bad = [e for e in self.edits if not (isinstance(e, tuple) and len(e) == 2)]
        if bad:
            raise ValueError(
                f"Mistake {self.region} / {self.name}: each edit must be an (old, new) pair, "
                f"got {bad[0]!r}"
            )
