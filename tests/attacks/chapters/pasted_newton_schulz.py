# The public tests' own Newton-Schulz (the student repository's tests/graded/test_muon_zero.py,
# when it holds one) pasted as muon_zero.newton_schulz: an answer the student repository ships
# earns nothing.
# file: muon_zero.py
# target: stub
# where: suffix
# paste: tests/graded/test_muon_zero.py::ns_fp64


def newton_schulz(X, coefficients, dtype=torch.bfloat16, eps=1e-7):  # noqa: F821
    if X.ndim == 3:
        return torch.stack([ns_fp64(x, coefficients) for x in X]).to(X.dtype)  # noqa: F821
    return ns_fp64(X, coefficients).to(X.dtype)  # noqa: F821
