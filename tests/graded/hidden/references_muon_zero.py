"""The independent references for tests/graded/test_muon_zero.py: V4 Algorithm 1 written out per
matrix in fp32, the Newton-Schulz iteration in fp64, torch.optim.Muon's update rule with it. They
ship only in the autograder zip: in the student repository each would be an answer (the
iteration with its transposes, the whole optimizer step per matrix); there the tests read the
values they gave, stored by `make expected` (tests/graded/expected.py)."""

import math

import torch

from graded.models_muon_zero import ADAMW, DENSE, EXPERT, forward_loss

STEPS = 5
LR_MUON, LR_ADAM = 0.05, 0.01
V4_NS = ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2  # V4 Algorithm 1
# helpers whose code the released files hold too (a probe draws the same batches): the
# release's leak search leaves them out
SHARED = ("muon_steps",)


def reference_fp32(P, batches, steps=STEPS, rms=0.18):
    """V4 Algorithm 1 written out per matrix in fp32, plus torch.optim.AdamW, on the test's
    ``batches`` (each (tokens, targets), one per step)."""
    L = {k: v.clone().requires_grad_() for k, v in P.items()}
    adam = torch.optim.AdamW(
        [L[k] for k in ADAMW], lr=LR_ADAM, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
    )
    momentum = {k: torch.zeros_like(P[k]) for k in (*DENSE, *EXPERT)}
    for s in range(steps):
        forward_loss(L, *batches[s]).backward()
        with torch.no_grad():
            for k in (*DENSE, *EXPERT):
                pairs = [(L[k], L[k].grad, momentum[k])]
                for W, G, M in pairs if k in DENSE else zip(L[k], L[k].grad, momentum[k]):
                    M.mul_(0.95).add_(G)
                    X = G + 0.95 * M
                    X = X.T if X.shape[0] > X.shape[1] else X
                    X = X / X.norm()
                    for a, b, c in V4_NS:
                        A = X @ X.T
                        X = a * X + (b * A + c * A @ A) @ X
                    X = X.T if W.shape[0] > W.shape[1] else X
                    W.mul_(1 - LR_MUON * 0.1).sub_(LR_MUON * rms * math.sqrt(max(W.shape)) * X)
                L[k].grad = None
        adam.step(), adam.zero_grad()
    return {k: v.detach() for k, v in L.items()}


def ns_fp64(X, coefficients):
    """The iteration of V4 Algorithm 1 in fp64, wide orientation, one matrix."""
    Y = X.double().T if X.shape[0] > X.shape[1] else X.double()
    Y = Y / Y.norm()
    for a, b, c in coefficients:
        A = Y @ Y.T
        Y = a * Y + (b * A + c * A @ A) @ Y
    return (Y.T if X.shape[0] > X.shape[1] else Y).float()


def muon_fp64(grad, buf, momentum, nesterov, coefficients, rms):
    """torch.optim.Muon's update rule (lerp momentum, Nesterov look-ahead) with fp64 NS."""
    buf.lerp_(grad, 1 - momentum)
    X = grad.lerp(buf, momentum) if nesterov else buf
    return ns_fp64(X, coefficients) * rms * math.sqrt(max(X.shape))


def muon_steps(grads, momentum, nesterov, coefficients, rms):
    """(update, buffer after) of each gradient in turn, from a zero buffer."""
    buf, out = torch.zeros_like(grads[0]), []
    for grad in grads:
        want = muon_fp64(grad, buf, momentum, nesterov, coefficients, rms)
        out.append((want, buf.clone()))
    return out


def single_rank_gradient_step(B, G, world):
    """A [7, 4] matrix whose gradient G is on rank 0 only: one fp32 step (the mean G / world,
    momentum from zero, Nesterov, V4's iteration on the wide transpose, update RMS 0.18)."""
    X = (G / world) * 1.95  # first step: M = G, Nesterov X = G + 0.95 M
    X = X.T / X.norm()
    for ca, cb, cc in V4_NS:
        S = X @ X.T
        X = ca * X + (cb * S + cc * S @ S) @ X
    return B * (1 - 0.1 * 0.1) - 0.1 * 0.18 * math.sqrt(7) * X.T
