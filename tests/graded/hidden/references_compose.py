"""The independent reference for tests/graded/test_compose.py's layouts: every rank's coordinates
and groups, listed from the mesh's coordinates. It ships only in the autograder zip: in the
student repository it would be an answer for compose.layout_groups (each list made a group);
there the tests check the groups' properties alone."""

import itertools


def expected_view(shape, rank):
    """Rank `rank`'s coordinates and groups, from the mesh's coordinates listed dp innermost."""
    at = list(itertools.product(*(range(n) for n in shape)))  # at[rank] = (p, c, d)
    p, c, d = at[rank]
    return {
        "coords": (p, c, d),
        "pipeline": [r for r, (_, c2, d2) in enumerate(at) if (c2, d2) == (c, d)],
        "cp": [r for r, (p2, _, d2) in enumerate(at) if (p2, d2) == (p, d)],
        "stage": [r for r, (p2, _, _) in enumerate(at) if p2 == p],
    }
