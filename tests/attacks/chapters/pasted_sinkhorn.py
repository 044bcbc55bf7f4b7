# The public tests' own Sinkhorn (the student repository's tests/graded/test_mhc.py, when it holds
# one) pasted as mhc.sinkhorn_knopp: an answer the student repository ships earns nothing.
# file: mhc.py
# target: stub
# where: suffix
# paste: tests/graded/test_mhc.py::v4_sinkhorn


def sinkhorn_knopp(logits, iters=20, eps=EPS):  # noqa: F821
    return v4_sinkhorn(logits, iters, eps)  # noqa: F821
