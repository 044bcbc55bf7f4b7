"""Tests for muon_zero.py, against independent references:

- torch.optim.Muon (bf16 NS, 5 standard steps, adjust_lr_fn="match_rms_adamw" <=> update_rms=0.2)
  and torch.optim.AdamW, stepping one process on the full batch;
- a short per-matrix fp32 Muon loop written here from V4 Algorithm 1, independent of muon_zero's
  code.

Tolerances (relative error of the parameter change after 5 steps, ||Δ_test - Δ_ref|| / ||Δ_ref||):
- fp32 NS and fp32 gradient sync: 1e-5. The only differences are summation order (per-rank gradients
  summed vs. one full-batch gradient) and batched vs. single matmuls: fp32 reassociation, ~1e-7
  per op.
- bf16 NS against torch.optim.Muon: 1e-2. Both round the NS input and every NS matmul to bf16 (2^-8
  ≈ 4e-3 relative). Our momentum is torch's lerp form, so the NS inputs agree up to fp32 summation
  order and a bf16 rounding only flips near a tie (measured: ~1e-6); 1e-2 allows a few flips.
"""

import itertools
import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import RankFailure, run_ranks, run_torchrun

import muon_zero as mz
from benchmarks import bench_muon_zero as bench

VOCAB, DIM, HIDDEN, EXPERTS, FFN = 16, 12, 20, 5, 8
GLOBAL_BATCH, SEQ, STEPS = 12, 6, 5  # 12 samples split evenly over 1, 2, 3 and 4 ranks
LR_MUON, LR_ADAM = 0.05, 0.01
FP32_TOL, BF16_TOL = 1e-5, 1e-2
# bf16 Newton-Schulz (V4's 10 iterations) against the same iteration in fp64, on matrices with
# singular values in [0.5, 1]: 8 mantissa bits (2^-8 = 3.9e-3 per rounding) through ~30 matmuls
# whose roundings the converging cubic damps; any op order lands within a few ulps.
NS_BF16_TOL = 5e-2
TORCH_BF16_TOL = 0.15  # see assert_world
# the optimizer calls every other region of the file
SHARDED_NEEDS = tuple(
    f"muon_zero.{r}"
    for r in (
        "newton_schulz",
        "muon_update",
        "stochastic_round_to_bf16",
        "pack_dense",
        "split_experts",
    )
)

# Dense matrices: tall, wide, square twice (a same-shape pair for batched NS), the router; 5 of
# them, which divides neither 2, 3 nor 4. Expert stacks of 5 experts: 15 matrices, divides 3 only.
DENSE = {
    "w_in": (HIDDEN, DIM),
    "w_out": (DIM, HIDDEN),
    "w_sq1": (DIM, DIM),
    "w_sq2": (DIM, DIM),
    "router": (EXPERTS, DIM),
}
EXPERT = {"gate": (EXPERTS, FFN, DIM), "up": (EXPERTS, FFN, DIM), "down": (EXPERTS, DIM, FFN)}
ADAMW = {"embed": (VOCAB, DIM), "norm": (DIM,), "head": (VOCAB, DIM)}


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {**DENSE, **EXPERT, **ADAMW}
    P = {k: torch.randn(s, generator=g) / math.sqrt(s[-1]) for k, s in shapes.items()}
    P["norm"] = 1 + 0.1 * torch.randn(DIM, generator=g)
    return P


def forward_loss(P, tokens, targets):
    """A small MoE block; P's expert entries: 3-D tensors or lists of 2-D leaves (the reference)."""
    E = {k: (torch.stack(P[k]) if isinstance(P[k], list) else P[k]) for k in EXPERT}
    x = P["embed"][tokens]  # [B, T, D]
    x = x + torch.tanh(x @ P["w_in"].T) @ P["w_out"].T
    x = x + torch.tanh(x @ P["w_sq1"].T) @ P["w_sq2"].T
    route = torch.sigmoid(
        x @ P["router"].T
    )  # [B, T, E]; softmax would leave the router gradient rank-deficient
    h = F.silu(torch.einsum("btd,efd->btef", x, E["gate"])) * torch.einsum(
        "btd,efd->btef", x, E["up"]
    )
    x = x + torch.einsum("btef,edf,bte->btd", h, E["down"], route)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * P["norm"]
    return F.cross_entropy((x @ P["head"].T).flatten(0, 1), targets.flatten())


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def leaves(P):
    return {k: v.clone().requires_grad_() for k, v in P.items()}


def groups(L, roles=True):
    out = [{"params": [L[k] for k in DENSE], "role": "dense"}]
    out += [{"params": [L[k]], "role": "expert_" + k} for k in ("down", "up", "gate")]
    out += [{"params": [L[k] for k in ADAMW], "role": "adamw", "lr": LR_ADAM}]
    return out


# --------------------------------------------------------------------------------------------------
# References


def reference_torch(P, steps=STEPS):
    """torch.optim.Muon on every 2-D matrix (each expert a leaf) + torch.optim.AdamW, full batch."""
    L = {k: v.clone().requires_grad_() for k, v in P.items() if k not in EXPERT}
    for k in EXPERT:
        L[k] = [m.clone().requires_grad_() for m in P[k]]
    mats = [L[k] for k in DENSE] + [m for k in EXPERT for m in L[k]]
    muon = torch.optim.Muon(
        mats,
        lr=LR_MUON,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        adjust_lr_fn="match_rms_adamw",
    )
    adam = torch.optim.AdamW(
        [L[k] for k in ADAMW], lr=LR_ADAM, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
    )
    for s in range(steps):
        forward_loss(L, *batch(s)).backward()
        muon.step(), adam.step(), muon.zero_grad(), adam.zero_grad()
    return {k: (torch.stack(v) if isinstance(v, list) else v).detach() for k, v in L.items()}


def reference_fp32(P, steps=STEPS, coefficients=mz.V4_NS_COEFFICIENTS, rms=0.18):
    """V4 Algorithm 1 written out per matrix in fp32, plus torch.optim.AdamW."""
    L = {k: v.clone().requires_grad_() for k, v in P.items()}
    adam = torch.optim.AdamW(
        [L[k] for k in ADAMW], lr=LR_ADAM, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
    )
    momentum = {k: torch.zeros_like(P[k]) for k in (*DENSE, *EXPERT)}
    for s in range(steps):
        forward_loss(L, *batch(s)).backward()
        with torch.no_grad():
            for k in (*DENSE, *EXPERT):
                for W, G, M in (
                    [(L[k], L[k].grad, momentum[k])]
                    if k in DENSE
                    else zip(L[k], L[k].grad, momentum[k])
                ):
                    M.mul_(0.95).add_(G)
                    X = G + 0.95 * M
                    X = X.T if X.shape[0] > X.shape[1] else X
                    X = X / X.norm()
                    for a, b, c in coefficients:
                        A = X @ X.T
                        X = a * X + (b * A + c * A @ A) @ X
                    X = X.T if W.shape[0] > W.shape[1] else X
                    W.mul_(1 - LR_MUON * 0.1).sub_(LR_MUON * rms * math.sqrt(max(W.shape)) * X)
                L[k].grad = None
        adam.step(), adam.zero_grad()
    return {k: v.detach() for k, v in L.items()}


def polar(G):
    """The exact orthogonal factor U V^T of G (what Newton-Schulz approximates), by fp64 SVD."""
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return (U @ Vh).float()


def well_conditioned(shape, generator, low=0.5):
    """A matrix [n, m] (or a stack [b, n, m]) with singular values uniform in [low, 1]."""
    if len(shape) == 3:
        return torch.stack([well_conditioned(shape[1:], generator, low) for _ in range(shape[0])])
    n, m = shape
    U, _ = torch.linalg.qr(torch.randn(n, min(n, m), generator=generator, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(m, min(n, m), generator=generator, dtype=torch.float64))
    s = low + (1 - low) * torch.rand(min(n, m), generator=generator, dtype=torch.float64)
    return ((U * s) @ V.T).float()


def split_mean(shape, world, seed):
    """[world, *shape] per-rank gradients whose mean is well conditioned, each rank's different."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((world,) + tuple(shape), generator=g, dtype=torch.float64)
    noise -= noise.mean(0)
    return (well_conditioned(shape, g).double() + noise).float()


def run_muon_zero(P, rank, world, steps=STEPS, start=0, state=None, **kw):
    """Every rank: its slice of each global batch, backward, MuonZeRO.step(). -> (params, opt)."""
    L = leaves(P)
    opt = mz.MuonZeRO(groups(L), lr=LR_MUON, **kw)
    if state is not None:
        opt.load_state_dict(state)
    per = GLOBAL_BATCH // world
    for s in range(start, start + steps):
        x, y = batch(s)
        forward_loss(
            L, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        ).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in L.items()}, opt


def rel_change_error(P0, got, ref):
    """max over parameters of ||Δgot - Δref|| / ||Δref||: the updates, not the (larger) weights."""
    return max(((got[k] - ref[k]).norm() / (ref[k] - P0[k]).norm()).item() for k in P0)


def all_equal_across_ranks(tensors):
    flat = torch.cat([t.flatten() for t in tensors])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], e) for e in everyone)


# --------------------------------------------------------------------------------------------------
# The multi-rank check: one process launch per world size, many checks inside
# --------------------------------------------------------------------------------------------------


def check_world(rank, world, checkpoint=None):
    torch.manual_seed(
        1234 + rank
    )  # different per rank: nothing may depend on rank-local randomness
    P0 = make_params()
    out = {}

    # 1. Against torch.optim.Muon: bf16 NS, 5 standard steps, update_rms 0.2, exact fp32 sync.
    got, _ = run_muon_zero(
        P0,
        rank,
        world,
        ns_coefficients=mz.STANDARD_NS_COEFFICIENTS,
        update_rms=0.2,
        grad_sync="fp32",
    )
    out["bf16_vs_torch"] = rel_change_error(P0, got, reference_torch(P0))

    # 2. V4's math in fp32 against the per-matrix loop, for every zero width that divides the world.
    ref = reference_fp32(P0)
    widths = [z for z in (1, 2, 3, 4) if world % z == 0]
    results = {}
    for z in widths:
        got, opt = run_muon_zero(
            P0, rank, world, ns_dtype=torch.float32, grad_sync="fp32", zero_width=z
        )
        results[z] = got
        out[f"fp32_vs_loop_width{z}"] = rel_change_error(P0, got, ref)
        out[f"replicas_equal_width{z}"] = all_equal_across_ranks(list(got.values()))
    out["width_invariance"] = max(
        rel_change_error(P0, results[z], results[widths[0]]) for z in widths
    )

    # 3. V4's numerics: bf16 stochastic-rounding sync (+ bf16 NS), one step against the exact polar
    #    factor of the mean gradient. The mean is well conditioned (singular values in [0.5, 1]):
    #    rounding noise in a direction the dtype cannot resolve would decide the answer otherwise.
    #    Tolerance per matrix: the NS error of its dtype plus the SR bound, each gradient element
    #    moved by under one bf16 ulp (2^-7 relative), through the polar factor's sensitivity
    #    ||d(UV^T)|| <= 2 ||dG|| / sigma_min, relative to ||UV^T|| = sqrt(min(n, m)).
    got, opt = run_muon_zero(
        P0, rank, world, grad_sync="bf16_sr", zero_width=widths[-2] if world > 1 else 1
    )
    out["replicas_equal_bf16_sr"] = all_equal_across_ranks(list(got.values()))
    out["state_bytes"] = opt.state_bytes()
    for ns_dtype, ns_tol in ((torch.float32, 1e-3), (torch.bfloat16, NS_BF16_TOL)):
        L = leaves(P0)
        opt = mz.MuonZeRO(groups(L), lr=LR_MUON, grad_sync="bf16_sr", ns_dtype=ns_dtype)
        grads = {k: split_mean(P0[k].shape, world, 50 + i) for i, k in enumerate((*DENSE, *EXPERT))}
        for k in grads:
            L[k].grad = grads[k][rank].clone()
        opt.step()
        worst = 0.0
        for k in grads:
            G = grads[k].double().mean(0).float()
            for W0, W1, g, Gr in ([(P0[k], L[k], G, grads[k])] if k in DENSE else
                                  zip(P0[k], L[k], G, grads[k].transpose(0, 1))):  # fmt: skip
                expect = W0 * (1 - LR_MUON * 0.1) - LR_MUON * 0.18 * math.sqrt(
                    max(W0.shape)
                ) * polar(g)
                sigma_min = torch.linalg.svdvals(g.double())[-1].item()
                sr = 2 * 2**-7 * Gr.norm(dim=(-2, -1)).max().item() / sigma_min
                tol = ns_tol + sr / math.sqrt(min(W0.shape))
                err = ((W1.detach() - expect).norm() / (expect - W0).norm()).item()
                worst = max(worst, err / tol)
        out[f"bf16_sr_one_step_ns_{str(ns_dtype)[6:]}"] = worst  # in units of its tolerance

    # 4. Gradients that are None: everywhere -> skipped on every rank; on some ranks -> zero there.
    A = torch.randn(6, 10, generator=torch.Generator().manual_seed(5))
    B = torch.randn(7, 4, generator=torch.Generator().manual_seed(6))
    G = torch.randn(7, 4, generator=torch.Generator().manual_seed(7))
    a, b = A.clone().requires_grad_(), B.clone().requires_grad_()
    opt = mz.MuonZeRO([a, b], lr=0.1, ns_dtype=torch.float32, grad_sync="fp32")
    b.grad = G.clone() if rank == 0 else None
    opt.step()
    out["none_everywhere_unchanged"] = torch.equal(a.detach(), A)
    expect = B.clone()
    X = (G / world) * 1.95  # first step: M = G, Nesterov X = G + 0.95 M
    X = X.T / X.norm()
    for ca, cb, cc in mz.V4_NS_COEFFICIENTS:
        S = X @ X.T
        X = ca * X + (cb * S + cc * S @ S) @ X
    expect = expect * (1 - 0.1 * 0.1) - 0.1 * 0.18 * math.sqrt(7) * X.T
    out["none_somewhere_err"] = ((b.detach() - expect).norm() / (expect - B).norm()).item()

    # 5. Bad input: every rank raises the same ValueError, and nobody is left waiting.
    def error_of(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return None

    if world > 1:
        out["bad_width"] = error_of(
            lambda: mz.MuonZeRO([torch.zeros(3, 3, requires_grad=True)], zero_width=world + 1)
        )
        shape = (3, 3) if rank == 0 else (3, 4)
        out["mismatch"] = error_of(lambda: mz.MuonZeRO([torch.zeros(shape, requires_grad=True)]))
        out["vector_as_matrix"] = error_of(
            lambda: mz.MuonZeRO([torch.zeros(3, requires_grad=True)])
        )
        out["alive_after_errors"] = all_equal_across_ranks([torch.ones(2)])

    # 6. Checkpoints: save after 3 of 5 steps at W=4 / width 2; resume at W=2 / width 1 (the
    #    world-2 run); compare with the uninterrupted 5-step run.
    if checkpoint is None and world == 4:
        mid, opt = run_muon_zero(
            P0, rank, world, steps=3, ns_dtype=torch.float32, grad_sync="fp32", zero_width=2
        )
        state = opt.gather_state_dict()
        end, _ = run_muon_zero(
            P0, rank, world, steps=5, ns_dtype=torch.float32, grad_sync="fp32", zero_width=2
        )
        out["checkpoint"] = dict(mid=mid, state=state, end=end)
    elif checkpoint is not None:
        mid, state, end = checkpoint["mid"], checkpoint["state"], checkpoint["end"]
        keys = [set(state["state"].get(i, {})) for i in range(len(P0))]
        out["state_complete"] = keys == [{"momentum_buffer"}] * (len(DENSE) + len(EXPERT)) + [
            {"step", "exp_avg", "exp_avg_sq"}
        ] * len(ADAMW)
        got, opt = run_muon_zero(
            mid,
            rank,
            world,
            steps=2,
            start=3,
            state=state,
            ns_dtype=torch.float32,
            grad_sync="fp32",
            zero_width=1,
        )
        out["resume_err"] = rel_change_error(mid, got, end)
        L = leaves(mid)
        fresh = mz.MuonZeRO(
            groups(L), lr=LR_MUON, ns_dtype=torch.float32, grad_sync="fp32", zero_width=1
        )
        fresh.load_state_dict(state)
        again = fresh.gather_state_dict()
        out["roundtrip_exact"] = all(
            torch.equal(state["state"][i][k], again["state"][i][k])
            for i in state["state"]
            for k in state["state"][i]
            if torch.is_tensor(state["state"][i][k])
        )
    return out


def assert_world(results, world):
    """Each check's first line says what is wrong in the student's terms, with the numbers."""
    for rank, r in enumerate(results):
        where = f"rank {rank} of {world}"
        assert r["none_everywhere_unchanged"], (
            f"{where}: a parameter with no gradient on any rank must not move (no momentum step, "
            f"no weight decay)"
        )
        widths = sorted(
            (int(k.rsplit("width", 1)[1]) for k in r if "fp32_vs_loop" in k), reverse=True
        )
        for z in widths:  # the full width first: no replica groups involved
            err, same = r[f"fp32_vs_loop_width{z}"], r[f"replicas_equal_width{z}"]
            replicas = f"; with {world // z} replica groups each dense bucket must also be summed"
            gather = "; ranks end with different parameters: is every updated chunk all-gathered?"
            hint = f"{replicas} across the replicas" if z < world else ("" if same else gather)
            assert err < FP32_TOL and same, (
                f"{where}, zero_width {z}: fp32 MuonZeRO is {err:.2e} from the per-matrix fp32 "
                f"reference (tolerance {FP32_TOL:g}){hint}"
            )
        assert r["replicas_equal_bf16_sr"], f"{where}: replicas differ after a bf16_sr step"
        assert r["width_invariance"] < FP32_TOL, (
            f"{where}: zero widths disagree by {r['width_invariance']:.2e}"
        )
        # torch's 5-step quintic does not converge, so bf16 rounding stays amplified in its output:
        # two correct op orders differ by ~5e-2 after 5 steps on this model; a wrong rule by > 0.2.
        assert r["bf16_vs_torch"] < TORCH_BF16_TOL, (
            f"{where}: 5 steps differ from torch.optim.Muon + AdamW by {r['bf16_vs_torch']:.2e} "
            f"(tolerance {TORCH_BF16_TOL:g}, bf16 NS)"
        )
        for dtype in ("float32", "bfloat16"):
            ratio = r[f"bf16_sr_one_step_ns_{dtype}"]
            assert ratio < 1, (
                f"{where}: one bf16_sr step with {dtype} NS is {ratio:.2f}x its tolerance from the "
                f"exact polar factor of the mean gradient (tolerance from its conditioning)"
            )
        assert r["none_somewhere_err"] < FP32_TOL, (
            f"{where}: a gradient present on rank 0 only must count as zero elsewhere: "
            f"{r['none_somewhere_err']:.2e} off"
        )
        if world > 1:
            assert r["bad_width"] and "zero_width" in r["bad_width"], (where, r["bad_width"])
            assert r["mismatch"] and "differs across ranks" in r["mismatch"], (where, r["mismatch"])
            assert r["vector_as_matrix"] and "Muon needs" in r["vector_as_matrix"], (
                where,
                r["vector_as_matrix"],
            )
            assert r["alive_after_errors"], where
    # Momentum for every Muon element, sharded: each rank holds about 1/world of it (plus padding).
    total = 4 * (
        sum(math.prod(s) for s in DENSE.values()) + sum(math.prod(s) for s in EXPERT.values())
    ) + 8 * sum(math.prod(s) for s in ADAMW.values())
    state = sum(r["state_bytes"] for r in results)
    assert state >= total and (world == 1 or max(r["state_bytes"] for r in results) < total), (
        state,
        total,
    )


@pytest.fixture(scope="module")
def world4():
    return run_ranks(check_world, 4)


@pytest.mark.grade(points=3, solution="muon_zero.sharded_step", needs=SHARDED_NEEDS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_matches_single_process_references(world, world4):
    checkpoint = world4[0]["checkpoint"] if world == 2 else None
    results = run_ranks(check_world, world, args=(checkpoint,))
    assert_world(results, world)
    if world == 2:
        for r in results:
            # W=4, width 2 checkpoint resumed at W=2, width 1: the uninterrupted run, to fp32
            # reassociation
            assert r["resume_err"] < FP32_TOL, r["resume_err"]
            assert r["state_complete"] and r["roundtrip_exact"]


@pytest.mark.grade(points=3, solution="muon_zero.sharded_step", needs=SHARDED_NEEDS)
def test_matches_single_process_references_world4(world4):
    assert_world(world4, 4)


# --------------------------------------------------------------------------------------------------
# Single-process checks of the pure functions
# --------------------------------------------------------------------------------------------------


def test_ns_coefficients():
    assert mz.V4_NS_COEFFICIENTS == ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2
    assert mz.STANDARD_NS_COEFFICIENTS == ((3.4445, -4.7750, 2.0315),) * 5


def ns_fp64(X, coefficients):
    """The iteration of V4 Algorithm 1 in fp64, wide orientation, one matrix."""
    Y = X.double().T if X.shape[0] > X.shape[1] else X.double()
    Y = Y / Y.norm()
    for a, b, c in coefficients:
        A = Y @ Y.T
        Y = a * Y + (b * A + c * A @ A) @ Y
    return (Y.T if X.shape[0] > X.shape[1] else Y).float()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.grade(points=3, solution="muon_zero.newton_schulz")
def test_newton_schulz():
    """Behaviour, any op order: fp32 lands on the polar factor, bf16 within its precision of the
    same iteration in fp64, shapes and dtype kept, every matrix of a batch normalised alone."""
    g = torch.Generator().manual_seed(0)
    for shape in [(20, 12), (12, 20), (16, 16)]:
        X = torch.randn(shape, generator=g)
        Y = mz.newton_schulz(X, mz.V4_NS_COEFFICIENTS, torch.float32)
        assert Y.shape == X.shape, (
            f"newton_schulz must return X's shape {shape}, got {tuple(Y.shape)}"
        )
        # V4's schedule in fp32 converges (its last two steps are the classic cubic): U V^T
        err = rel(Y, polar(X))
        assert err < 1e-3, (
            f"fp32 newton_schulz of a {shape} matrix is {err:.3g} from U V^T (tolerance 1e-3): "
            f"is X divided by its Frobenius norm and X <- aX + (bA + cA^2)X with A = X X^T?"
        )
        W = well_conditioned(shape, g)  # bf16 resolves every direction of these
        Y = mz.newton_schulz(W, mz.V4_NS_COEFFICIENTS)
        assert Y.dtype == torch.bfloat16, (
            f"newton_schulz must compute in `dtype` (bf16), got {Y.dtype}"
        )
        err = rel(Y, ns_fp64(W, mz.V4_NS_COEFFICIENTS))
        assert err < NS_BF16_TOL, (
            f"bf16 newton_schulz of a {shape} matrix is {err:.3g} from the same iteration in fp64 "
            f"(tolerance {NS_BF16_TOL:g}, bf16's precision)"
        )
        err = rel(mz.newton_schulz(X * 50, mz.STANDARD_NS_COEFFICIENTS, torch.float32),
                  ns_fp64(X, mz.STANDARD_NS_COEFFICIENTS))  # fmt: skip
        assert err < 1e-4, (
            f"newton_schulz(50·X) is {err:.3g} from the fp64 iteration on X: each matrix must be "
            f"divided by its own Frobenius norm first"
        )
    # A batch [b, n, m] is b independent matrices, each normalised by its own norm.
    stack = torch.randn(3, 12, 20, generator=g) * torch.tensor([1e-3, 1.0, 50.0]).view(3, 1, 1)
    batched = mz.newton_schulz(stack, mz.V4_NS_COEFFICIENTS, torch.float32)
    worst = max(rel(batched[i], ns_fp64(stack[i], mz.V4_NS_COEFFICIENTS)) for i in range(3))
    assert worst < 1e-4, (
        f"a batch [3, 12, 20] is {worst:.3g} from its matrices done one by one: each matrix of a "
        f"batch must be normalised by its own norm"
    )
    with pytest.raises(ValueError, match="newton_schulz takes"):
        mz.newton_schulz(torch.zeros(5), mz.V4_NS_COEFFICIENTS)


@pytest.mark.grade(points=1, solution="muon_zero.newton_schulz")
def test_newton_schulz_orthogonalises_tall_matrices_wide():
    """The cost V4's packing assumes: the Gram matrix is min(n, m) square, so a tall [L, s]
    matrix is iterated as its transpose (the math is the same; the work is (L/s)^2 smaller)."""

    class Shapes(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.seen.append(tuple(out.shape))
            return out

    X = torch.randn(40, 8, generator=torch.Generator().manual_seed(1))
    with Shapes() as spy:
        Y = mz.newton_schulz(X, mz.STANDARD_NS_COEFFICIENTS)
    big = [s for s in spy.seen if len(s) >= 2 and s[-2:] == (40, 40)]
    assert not big, (
        f"tall matrices must be orthogonalised in their wide orientation: a [40, 8] input made "
        f"{len(big)} [40, 40] Gram-sized tensors, expected [8, 8] ones"
    )
    assert Y.shape == X.shape, f"newton_schulz must return X's shape (40, 8), got {tuple(Y.shape)}"


@pytest.mark.grade(points=2, solution="muon_zero.stochastic_round_to_bf16")
def test_stochastic_rounding_is_unbiased():
    g = torch.Generator().manual_seed(0)
    # 1) A fixed value between two bf16 neighbours: the mean of many roundings converges to it.
    #    Each rounding is lo or hi; with p = (x - lo) / ulp the mean has std ulp·sqrt(p(1-p)/N), so
    #    a 5-sigma bound fails by chance with probability < 1e-6. Round-to-nearest is off by p·ulp.
    N = 200_000
    for x0 in (-3.0 - 0.9 * 2**-6, 1.0 + 0.3 * 2**-7, 1e-30 * 1.37):
        x = torch.full((N,), x0, dtype=torch.float32)
        r = mz.stochastic_round_to_bf16(x, generator=g).double()
        lo, hi = r.min().item(), r.max().item()
        values = set(r.tolist())
        nearest = x[:1].to(torch.bfloat16).double().item()
        assert len(values) > 1, (
            f"rounding must be stochastic: all {N} draws of {x0!r} landed on {lo!r}"
            + (" (its nearest neighbour)" if lo == nearest else "")
        )
        assert len(values) == 2 and lo <= x0 <= hi, (
            f"each draw must be one of the two bf16 neighbours of {x0!r}, got {sorted(values)[:4]}"
        )
        p = (x0 - lo) / (hi - lo)
        sigma = (hi - lo) * math.sqrt(p * (1 - p) / N)
        assert abs(r.mean().item() - x0) < 5 * sigma, (
            f"rounding is biased: the mean of {N} draws of {x0!r} is {r.mean().item()!r}, "
            f"{abs(r.mean().item() - x0) / sigma:.0f} sigma off; P(up) must be (x - lo) / ulp"
        )
        assert abs(nearest - x0) > 20 * sigma  # the bias stochastic rounding removes is real
    # 2) Many values of every sign and magnitude: the mean error over the population is ~0 relative.
    x = torch.randn(N, generator=g) * torch.exp(torch.randn(N, generator=g) * 5)
    err = (mz.stochastic_round_to_bf16(x, generator=g).double() - x.double()) / x.double().abs()
    assert abs(err.mean().item()) < 5 * err.std().item() / math.sqrt(N), (
        f"rounding is biased over values of every sign and size: mean relative error "
        f"{err.mean().item():.2e}"
    )
    assert err.abs().max().item() < 2**-7, "never more than one bf16 ulp away"
    # 3) the noise comes from `generator`: the same seed, the same draws; another seed, others
    x = torch.full((1000,), 1.0 + 0.5 * 2**-7)
    a, b, c = (mz.stochastic_round_to_bf16(x, torch.Generator().manual_seed(k)) for k in (7, 7, 8))
    assert torch.equal(a, b) and not torch.equal(a, c), (
        "the rounding noise must come from `generator`: equal seeds must give equal draws"
    )


@pytest.mark.grade(points=1, solution="muon_zero.stochastic_round_to_bf16")
def test_stochastic_rounding_special_values():
    bf16_max = torch.finfo(torch.bfloat16).max
    fp32_max = torch.finfo(torch.float32).max
    x = torch.tensor(
        [
            float("nan"),
            float("inf"),
            -float("inf"),
            0.0,
            -0.0,
            1.0,
            -2.5,
            bf16_max,
            -bf16_max,
            fp32_max,
            -fp32_max,
            3.3961e38,
            1e-45,
        ]
    )
    for seed in range(20):
        r = mz.stochastic_round_to_bf16(
            x.repeat(50), generator=torch.Generator().manual_seed(seed)
        ).view(50, -1)
        assert r.dtype == torch.bfloat16
        assert (
            r[:, 0].isnan().all()
            and (r[:, 1] == float("inf")).all()
            and (r[:, 2] == -float("inf")).all()
        )
        assert torch.equal(r[:, 3:7].float(), x[3:7].expand(50, 4))  # bf16-exact values never move
        assert r[:, 7:].isfinite().all(), "finite inputs near the bf16 maximum must not become Inf"
        assert (r[:, 7:9].float().abs() == bf16_max).all()
    with pytest.raises(ValueError, match="float32"):
        mz.stochastic_round_to_bf16(torch.zeros(3, dtype=torch.float64))


def test_param_groups_send_every_matrix_to_muon():
    model = mz.TinyMoE(layers=2)
    groups_ = mz.muon_param_groups(model)
    role = {id(p): g["role"] for g in groups_ for p in g["params"]}
    names = dict(model.named_parameters())
    assert len(role) == len(names)
    for name, p in names.items():
        if name.startswith(("embed", "head")) or p.ndim < 2:
            assert role[id(p)] == "adamw", name
        elif p.ndim == 2:
            assert role[id(p)] == "dense", name
        else:
            assert role[id(p)] == "expert_" + name.split("_")[-1], name
    assert sum(p.ndim == 3 for g in groups_ if g["role"] == "adamw" for p in g["params"]) == 0
    assert (
        sum(1 for g in groups_ if g["role"] == "adamw" for p in g["params"] if p.ndim >= 2) == 2
    )  # embed, head
    # A 3-D stack whose role cannot be told must not fall silently to AdamW (or Muon as one).
    weird = torch.nn.Module()
    weird.stack = torch.nn.Parameter(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="expert_roles"):
        mz.muon_param_groups(weird)
    assert (
        mz.muon_param_groups(weird, expert_roles={"stack": "expert_up"})[0]["role"] == "expert_up"
    )


def _max_load(buckets, shapes, weight):
    return max(sum(weight(shapes[i]) for i in b) for b in buckets)


@pytest.mark.grade(points=3, solution="muon_zero.pack_dense")
def test_pack_dense():
    """Each matrix once and whole; the load `balance` names within LPT's 4/3 of the optimum
    (brute force on instances where the loads conflict); identical shapes next to each other in
    a bucket, in any order of the shapes."""
    numel = lambda s: s[0] * s[1]  # noqa: E731
    shapes = [
        (64, 48),
        (48, 64),
        (32, 48),
        (48, 48),
        (48, 48),
        (6, 48),
        (128, 16),
        (16, 16),
        (48, 48),
    ]
    for shapes, width, balance in [(shapes, 3, b) for b in ("ns_cost", "numel", "both")] + [
        ([(8, 8), (16, 16), (8, 8)], 1, "both")
    ]:
        buckets = mz.pack_dense(shapes, width, balance=balance)
        assert sorted(i for b in buckets for i in b) == list(range(len(shapes))), (
            f"balance={balance!r}: every matrix must land in exactly one bucket, got {buckets}"
        )
        for b in buckets:
            runs = [shapes[i] for k, i in enumerate(b) if k == 0 or shapes[i] != shapes[b[k - 1]]]
            assert len(runs) == len(set(runs)), (
                f"identical shapes must sit together in a bucket (one batched NS call): "
                f"{[shapes[i] for i in b]}"
            )
    # Two loads that conflict: (64, 64) costs 6x what (8, 1024) does, with half its elements.
    # Eight small squares and one 8x costlier: smallest first would stack it on a full bucket.
    conflict = [(64, 64), (64, 64), (8, 1024)]
    few_big = [(16, 16)] * 8 + [(32, 32)]
    for case, balance, weight in ((conflict, "ns_cost", mz.ns_cost), (conflict, "numel", numel),
                                  (few_big, "ns_cost", mz.ns_cost)):  # fmt: skip
        best = min(
            max(sum(weight(case[i]) for i in range(len(case)) if side[i] == q) for q in (0, 1))
            for side in itertools.product((0, 1), repeat=len(case))
        )
        got = _max_load(mz.pack_dense(case, 2, balance=balance), case, weight)
        assert got <= 4 / 3 * best, (
            f"pack_dense must balance what `balance` names, heaviest matrices first: "
            f"balance={balance!r} packed a heaviest bucket of {got:,}, the optimum is {best:,} "
            f"(LPT stays within 4/3 of it)"
        )
    big = [(256, 256), (128, 128)] + [(32, 32)] * 12
    for balance, weight in (("ns_cost", mz.ns_cost), ("numel", numel)):
        got = _max_load(mz.pack_dense(big, 4, balance=balance), big, weight)
        bound = sum(map(weight, big)) / 4 + max(map(weight, big))
        assert got <= bound, (
            f"largest first: balance={balance!r} packed a heaviest bucket of {got:,}, above the "
            f"mean + largest item {bound:,.0f} that LPT guarantees"
        )
    assert mz.ns_cost((48, 64)) == 2 * 48 * 48 * 64 + 48**3 == mz.ns_cost((64, 48))
    with pytest.raises(ValueError, match="balance"):
        mz.pack_dense(shapes, 3, balance="random")


@pytest.mark.grade(points=2, solution="muon_zero.split_experts")
def test_split_experts():
    """Runs cover every expert once, in order; piece k ends at the boundary nearest to k/W of the
    total elements (either one on a tie), so unequal expert sizes are split by size, not count."""
    cases = [([10] * 15, 4), ([6] * 33024, 256), ([6] * 7, 7), ([6] * 3, 5), ([1, 9] * 6, 4),
             ([5, 1, 1, 1, 1, 5, 1, 1], 3), ([100, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2)]  # fmt: skip
    for numels, w in cases:
        ranges = mz.split_experts(numels, w)
        assert len(ranges) == w and ranges[0][0] == 0 and ranges[-1][1] == len(numels), (
            f"split_experts({len(numels)} experts, {w}) must give {w} runs covering "
            f"0..{len(numels)}, "
            f"got {ranges[:3]}...{ranges[-1:]}"
        )
        assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(ranges, ranges[1:])), (
            f"the runs must follow each other without gaps or overlaps, got {ranges}"
        )
        prefix = [0] + list(itertools.accumulate(numels))
        total = prefix[-1]
        for k, (_, end) in enumerate(ranges[:-1], 1):
            target = total * k / w
            nearest = min(abs(p - target) for p in prefix)
            assert abs(prefix[end] - target) <= nearest, (
                f"piece {k} must end at the matrix boundary nearest to {k}/{w} of the total: sizes "
                f"{numels[:12]}, it ends at element {prefix[end]}, {abs(prefix[end] - target):g} "
                f"from {target:g}; the nearest boundary is {nearest:g} away"
            )
    sizes = [b - a for a, b in mz.split_experts([10] * 15, 4)]
    assert sorted(sizes) == [3, 4, 4, 4], f"15 equal experts over 4 ranks: {sizes}"


def test_plan_muon():
    plan = mz.plan_muon(
        [(64, 48)] * 5 + [(32, 48)], [(48, 32)] * 6 + [(32, 48)] * 12, world_size=4, zero_width=2
    )
    rows = bench.rank_rows(plan)
    assert [r["dense"] for r in rows] == [
        len(plan.dense_buckets[0]),
        len(plan.dense_buckets[1]),
    ] * 2
    assert sum(r["experts"] for r in rows) == 18 and sum(len(b) for b in plan.dense_buckets) == 6
    assert [r["replica"] for r in rows] == [0, 0, 1, 1] and plan.owned(0)[0] == plan.owned(2)[0]
    s = bench.plan_summary(plan)
    assert s["expert_padding"] == (4 * 5 - 18) / 18 and 0 <= s["dense_padding"]
    assert s["dense_imbalance"] >= 1
    assert "rank" in mz.format_plan(plan) and len(mz.format_plan(plan).splitlines()) == 5
    with pytest.raises(ValueError, match="zero_width=3 must divide"):
        mz.plan_muon([(4, 4)], [], world_size=4, zero_width=3)


def test_bad_input_single_process():
    m = torch.zeros(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="empty"):
        mz.MuonZeRO([])
    with pytest.raises(ValueError, match="Muon needs"):
        mz.MuonZeRO([m, torch.zeros(4, requires_grad=True)])
    with pytest.raises(ValueError, match="expert role"):
        mz.MuonZeRO([torch.zeros(2, 4, 4, requires_grad=True)])
    with pytest.raises(ValueError, match="expert stack"):
        mz.MuonZeRO([{"params": [m], "role": "expert_up"}])
    with pytest.raises(ValueError, match="role"):
        mz.MuonZeRO([{"params": [m], "role": "sgd"}])
    with pytest.raises(ValueError, match="grad_sync"):
        mz.MuonZeRO([m], grad_sync="bf16")
    with pytest.raises(ValueError, match="zero_width"):
        mz.MuonZeRO([m], zero_width=2)
    opt = mz.MuonZeRO([m])
    with pytest.raises(ValueError, match="construction"):
        opt.add_param_group({"params": [torch.zeros(3, 3, requires_grad=True)]})
    opt.step()  # no gradient anywhere: a no-op, not an error
    assert torch.equal(m, torch.zeros(4, 4))


def test_adamw_update_matches_torch():
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(5, 3, generator=g)
    ref = p0.clone().requires_grad_()
    torch_opt = torch.optim.AdamW([ref], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    mine, m, v = p0.clone(), torch.zeros(5, 3), torch.zeros(5, 3)
    for step in range(1, 6):
        grad = torch.randn(5, 3, generator=g)
        ref.grad = grad.clone()
        torch_opt.step()
        mz.adamw_update(mine, grad, m, v, step, lr=0.01)
    assert torch.allclose(mine, ref.detach(), atol=1e-6)


def test_demo_under_torchrun():
    out = run_torchrun("muon_zero.py", nproc=2, args=("--steps", "11"), timeout=120).stdout
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < 0.7 * losses[0], out
    assert "parameters bitwise identical on all 2 ranks: True" in out, out
    assert "optimizer state held per rank (bytes)" in out and "rank replica" in out, out


@pytest.mark.grade(points=2, solution="muon_zero.sharded_step", needs=SHARDED_NEEDS)
def test_same_shape_matrices_share_one_stack_and_one_ns_call(monkeypatch):
    L = leaves(make_params())
    opt = mz.MuonZeRO(groups(L), lr=LR_MUON, grad_sync="fp32")
    calls = []
    real = mz.newton_schulz
    monkeypatch.setattr(
        mz, "newton_schulz", lambda X, *a, **k: calls.append(tuple(X.shape)) or real(X, *a, **k)
    )
    x, y = batch(0)
    pointers = None
    for _ in range(2):
        forward_loss(L, x, y).backward()
        opt.step()
        opt.zero_grad()
        stacks = [t for t in opt.local_state_tensors() if t.ndim == 3]
        if pointers is not None:  # updated in place: the stacked buffers are the resting layout
            assert [t.data_ptr() for t in stacks] == pointers
        pointers = [t.data_ptr() for t in stacks]
    # One rank owns everything: dense runs (5,12) (12,12)x2 (12,20) (20,12); experts: the downs,
    # then ups and gates of one shape in one run although they are separate param groups (issue 11).
    expect = [(1, 5, 12), (2, 12, 12), (1, 12, 20), (1, 20, 12), (5, 12, 8), (10, 8, 12)]
    got = sorted(tuple(t.shape) for t in stacks)
    assert got == sorted(expect), (
        f"same-shape neighbours must share one stacked momentum [count, n, m]: got {got}, "
        f"expected {sorted(expect)}"
    )
    assert sorted(calls) == sorted(expect * 2), (
        f"one batched newton_schulz call per stack and step, not one per matrix: {len(calls)} "
        f"calls in 2 steps, expected {2 * len(expect)}"
    )


# --------------------------------------------------------------------------------------------------
# No hang, no silent wrong answer (each case reproduced before it was fixed)
# --------------------------------------------------------------------------------------------------


def check_data_parallel_subgroups(rank, world):
    """Pipeline x data parallelism on 4 ranks: stages {0, 1} and {2, 3}, each its own MuonZeRO."""
    stages = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both, same order
    stage = rank // 2
    P0 = make_params(seed=stage)  # each stage holds different parameters
    L = leaves(P0)
    # different widths per stage: the stages make different subgroup calls (only members take part)
    opt = mz.MuonZeRO(
        groups(L),
        lr=LR_MUON,
        ns_dtype=torch.float32,
        grad_sync="fp32",
        process_group=stages[stage],
        zero_width=1 if stage == 0 else 2,
    )
    dp_rank, per = rank % 2, GLOBAL_BATCH // 2
    for s in range(STEPS):
        x, y = batch(s)
        forward_loss(
            L, x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per]
        ).backward()
        opt.step()
        opt.zero_grad()
    got = {k: v.detach() for k, v in L.items()}
    return rel_change_error(P0, got, reference_fp32(P0))


@pytest.mark.grade(points=2, solution="muon_zero.sharded_step", needs=SHARDED_NEEDS)
def test_data_parallel_subgroups_of_a_wider_world():
    errs = run_ranks(check_data_parallel_subgroups, 4, timeout=90)
    worst = max(range(4), key=lambda r: errs[r])
    assert errs[worst] < FP32_TOL, (
        f"two pipeline stages, each a data-parallel subgroup of 2 ranks: rank "
        f"{worst} is {errs[worst]:.2e} from the fp32 reference (tolerance {FP32_TOL:g})"
    )


class _HFStyle(torch.nn.Module):
    """An HF-style causal LM: model.embed_tokens, an mHC-like block, lm_head (not tied)."""

    def __init__(self, tie=False):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(16, 8)
        self.model.proj = torch.nn.Linear(8, 8, bias=False)
        hc = torch.nn.Module()
        hc.proj = torch.nn.Parameter(torch.zeros(32, 24))  # a matrix: Muon
        hc.bias_res = torch.nn.Parameter(torch.eye(4))  # a 2-D static bias: AdamW
        hc.gate = torch.nn.Parameter(torch.zeros(3))
        hc.mixing = torch.nn.Parameter(torch.zeros(4, 4))  # declared non-Muon by its module
        hc.no_muon = {"mixing"}
        self.model.hcs = torch.nn.ModuleList([hc])
        self.marked = torch.nn.Parameter(torch.zeros(5, 5))
        self.marked.no_muon = True  # declared non-Muon on the tensor
        self.lm_head = torch.nn.Linear(8, 16, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight


@pytest.mark.parametrize("tie", [False, True])
def test_param_groups_route_by_what_a_tensor_is(tie):
    model = _HFStyle(tie)
    role = {id(p): g["role"] for g in mz.muon_param_groups(model) for p in g["params"]}
    hc = model.model.hcs[0]
    assert role[id(model.lm_head.weight)] == "adamw"  # HF output head
    assert role[id(model.model.embed_tokens.weight)] == "adamw"
    assert role[id(hc.bias_res)] == "adamw" and role[id(hc.gate)] == "adamw"
    assert role[id(hc.mixing)] == "adamw" and role[id(model.marked)] == "adamw"
    assert role[id(hc.proj)] == "dense" and role[id(model.model.proj.weight)] == "dense"
    # the name override still sends a matrix to AdamW
    role = {
        id(p): g["role"]
        for g in mz.muon_param_groups(model, adamw_names=("model.proj",))
        for p in g["params"]
    }
    assert role[id(model.model.proj.weight)] == "adamw"


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(lr=float("nan")), "lr"),
        (dict(lr=float("inf")), "lr"),
        (dict(lr=-0.1), "lr"),
        (dict(momentum=1.0), "momentum"),
        (dict(weight_decay=float("nan")), "weight_decay"),
        (dict(update_rms=0.0), "update_rms"),
        (dict(eps=0.0), "eps"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(ns_coefficients=()), "ns_coefficients"),
    ],
)
def test_bad_hyperparameters_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        mz.MuonZeRO([torch.zeros(4, 4, requires_grad=True)], **bad)
    with pytest.raises(ValueError, match=f"param group 1.*{match}"):  # per group, too
        mz.MuonZeRO(
            [
                {"params": [torch.zeros(4, 4, requires_grad=True)]},
                {"params": [torch.zeros(3, 3, requires_grad=True)], **bad},
            ]
        )


def test_bad_tensors_refused():
    with pytest.raises(ValueError, match="float32"):
        mz.MuonZeRO([torch.zeros(4, 4, dtype=torch.float64, requires_grad=True)])
    with pytest.raises(ValueError, match="float32"):
        mz.MuonZeRO([torch.zeros(4, 4, dtype=torch.bfloat16, requires_grad=True)])
    with pytest.raises(ValueError, match="empty"):
        mz.MuonZeRO([torch.zeros(0, 4, requires_grad=True)])
    with pytest.raises(ValueError, match="empty"):
        mz.MuonZeRO([{"params": [torch.zeros(2, 0, 4, requires_grad=True)], "role": "expert_up"}])


def check_mismatch(rank, world, field):
    """Rank 1 differs from the others in one thing; every rank must raise the same ValueError."""
    P0 = make_params()
    kw = dict(lr=LR_MUON)
    odd = rank == 1
    if field == "lr" and odd:
        kw["lr"] = 2 * LR_MUON
    if field == "adamw_lr":
        pass
    if field == "init" and odd:
        P0["w_in"] = P0["w_in"] + 1e-3
    if field == "shape" and odd:
        P0["w_sq1"] = torch.zeros(DIM, DIM + 1)
    if field == "dtype" and odd:
        P0["head"] = P0["head"].double()
    L = leaves(P0)
    gs = groups(L)
    if field == "adamw_lr" and odd:
        gs[-1]["lr"] = 0.5
    try:
        mz.MuonZeRO(gs, **kw)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "field, words",
    [
        ("lr", "lr"),
        ("adamw_lr", "lr"),
        ("init", "initial values"),
        ("shape", "shape"),
        ("dtype", "float32"),
    ],
)
def test_every_rank_refuses_a_mismatch(field, words, world):
    """Fault matrix (b): one rank gets different input; every rank raises the same ValueError."""
    msgs = run_ranks(check_mismatch, world, args=(field,), timeout=60)
    assert msgs[0] is not None and all(m == msgs[0] for m in msgs), msgs
    assert words in msgs[0] and "rank 1" in msgs[0], msgs[0]


def check_state_dict_is_local(rank, world):
    P0 = make_params()
    got, opt = run_muon_zero(P0, rank, world, steps=2, ns_dtype=torch.float32, grad_sync="fp32")
    if rank == 0:  # the usual pattern: only rank 0 saves
        local = opt.state_dict()
        assert local["state"]
    full = opt.gather_state_dict()  # the explicit collective: every rank gets every momentum
    # string keys, as after a JSON round trip of the keys: momentum must load, not vanish
    stringly = {
        "state": {str(k): v for k, v in full["state"].items()},
        "param_groups": full["param_groups"],
    }
    L = leaves(got)
    fresh = mz.MuonZeRO(groups(L), lr=LR_MUON, ns_dtype=torch.float32, grad_sync="fp32")
    fresh.load_state_dict(stringly)
    again = fresh.gather_state_dict()
    same = all(
        torch.equal(full["state"][i][k], again["state"][i][k])
        for i in full["state"]
        for k in full["state"][i]
        if torch.is_tensor(full["state"][i][k])
    )
    return same


def test_state_dict_on_rank_zero_alone_does_not_hang():
    assert run_ranks(check_state_dict_is_local, 2, timeout=60) == [True, True]


def test_load_state_dict_never_drops_momentum_silently():
    P0 = make_params()
    got, opt = run_muon_zero(P0, 0, 1, steps=1)
    sd = opt.state_dict()
    first = next(i for i, s in sd["state"].items() if "momentum_buffer" in s)
    del sd["state"][first]
    fresh = mz.MuonZeRO(groups(leaves(got)), lr=LR_MUON)
    with pytest.raises(ValueError, match="momentum"):
        fresh.load_state_dict(sd)
    sd["state"]["not a number"] = {}
    with pytest.raises(ValueError, match="key"):
        fresh.load_state_dict(sd)


def test_demo_never_drops_samples():
    out = run_torchrun(
        "muon_zero.py", nproc=3, args=("--steps", "1", "--batch", "25"), timeout=120, check=False
    )
    assert out.returncode != 0 and "--batch 25 does not split" in out.stdout, out.stdout


def check_one_rank_raises_mid_step(rank, world):
    L = leaves(make_params())
    opt = mz.MuonZeRO(groups(L), lr=LR_MUON)
    if rank == 1:  # after the reduce-scatter, before the all-gather: the peers are left waiting

        def broken(*args, **kwargs):
            raise RuntimeError("injected failure on rank 1 inside the update")

        mz.update_run = broken
    forward_loss(L, *batch(0)).backward()
    opt.step()


@pytest.mark.parametrize("world", [2, 3])
def test_one_rank_raising_mid_step_fails_fast(world):
    """Fault matrix (a): a failure is reported as that rank's error, well within the timeout."""
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(check_one_rank_raises_mid_step, world, timeout=60)
    assert time.monotonic() - start < 45
    assert "injected failure on rank 1" in info.value.errors[1], info.value.errors


def check_round_robin(rank, world):
    P0 = make_params()
    mats = [P0[k].clone() for k in DENSE]
    grads = [
        torch.randn(m.shape, generator=torch.Generator().manual_seed(i)) for i, m in enumerate(mats)
    ]
    for m, g in zip(mats, grads):
        m.grad = g
    momenta = [torch.zeros_like(m) for m in mats]
    mz.round_robin_step(mats, momenta, lr=0.1, ns_dtype=torch.float32)
    return mats


def test_round_robin_baseline_matches_single_process():
    """KellerJordan's round-robin layout gives every rank the single-process update."""
    one = run_ranks(check_round_robin, 1, timeout=60)[0]
    for got in run_ranks(check_round_robin, 3, timeout=60):
        for a, b in zip(got, one):
            assert torch.allclose(a, b, rtol=0, atol=1e-6)  # the same fp32 ops on one matrix


def muon_fp64(grad, buf, momentum, nesterov, coefficients, rms):
    """torch.optim.Muon's update rule (lerp momentum, Nesterov look-ahead) with fp64 NS."""
    buf.lerp_(grad, 1 - momentum)
    X = grad.lerp(buf, momentum) if nesterov else buf
    return ns_fp64(X, coefficients) * rms * math.sqrt(max(X.shape))


@pytest.mark.grade(points=2, solution="muon_zero.muon_update", needs=("muon_zero.newton_schulz",))
def test_muon_update_matches_torch_muon_rule():
    """Three steps of one matrix: the buffer is torch.optim.Muon's (fp32 exact), the update its
    rule (compared with fp32 NS against fp64 math, so any NS op order passes), Nesterov or not,
    and the default bf16 path against torch.optim.Muon itself within bf16's precision."""
    for shape, momentum, nesterov in (((12, 20), 0.95, True), ((20, 12), 0.9, True),
                                      ((12, 20), 0.95, False)):  # fmt: skip
        g = torch.Generator().manual_seed(3)
        buf, ref_buf = torch.zeros(shape), torch.zeros(shape)
        for step in range(3):
            grad = well_conditioned(shape, g)
            got = mz.muon_update(grad, buf, momentum=momentum, nesterov=nesterov, update_rms=0.2,
                                 coefficients=mz.STANDARD_NS_COEFFICIENTS,
                                 ns_dtype=torch.float32)  # fmt: skip
            want = muon_fp64(grad, ref_buf, momentum, nesterov, mz.STANDARD_NS_COEFFICIENTS, 0.2)
            what = f"{shape}, momentum {momentum}, nesterov={nesterov}, step {step + 1}"
            assert torch.allclose(buf, ref_buf, atol=1e-6), (
                f"{what}: the momentum buffer is {(buf - ref_buf).abs().max():.3g} from "
                f"torch.optim.Muon's average form lerp(M, G, 1 - momentum)"
            )
            rms, want_rms = got.pow(2).mean().sqrt().item(), want.pow(2).mean().sqrt().item()
            assert abs(rms / want_rms - 1) < 2e-2, (  # NS(X) is not exactly orthogonal
                f"{what}: update RMS {rms:.4f}, expected {want_rms:.4f}: the update must be "
                f"NS(X)·sqrt(max(n, m))·update_rms"
            )
            err = rel(got, want)
            assert err < 1e-4, (
                f"{what}: the update is {err:.3g} from torch.optim.Muon's rule "
                f"(X = lerp(G, M, momentum) with Nesterov, else M)"
            )
    # the default path: bf16 NS, against torch.optim.Muon itself (one step, bf16 tolerance)
    W0 = torch.randn(12, 20, generator=g)
    G = well_conditioned((12, 20), g)
    w = W0.clone().requires_grad_()
    w.grad = G.clone()
    torch.optim.Muon([w], lr=0.1, adjust_lr_fn="match_rms_adamw").step()
    update = mz.muon_update(G, torch.zeros(12, 20), coefficients=mz.STANDARD_NS_COEFFICIENTS,
                            update_rms=0.2)  # fmt: skip
    mine = W0 * (1 - 0.1 * 0.1) - 0.1 * update
    err = rel(mine - W0, w.detach() - W0)
    assert err < TORCH_BF16_TOL, f"one default (bf16) step is {err:.3g} from torch.optim.Muon's"


def test_head_names_match_whole_module_names_only():
    """`output` names an output head; `output_gate` or `heads` is a matrix like any other."""
    model = torch.nn.Module()
    model.output_gate = torch.nn.Linear(4, 4, bias=False)
    model.heads = torch.nn.Linear(4, 4, bias=False)
    model.output = torch.nn.Linear(4, 16, bias=False)
    role = {id(p): g["role"] for g in mz.muon_param_groups(model) for p in g["params"]}
    assert role[id(model.output_gate.weight)] == "dense" and role[id(model.heads.weight)] == "dense"
    assert role[id(model.output.weight)] == "adamw"


def test_mhc_static_biases_and_gates_go_to_adamw():
    """mHC's HyperConnection: the projection is a Muon matrix; biases and gating factors AdamW."""
    import mhc

    hc = mhc.HyperConnection(4, 8)
    role = {id(p): g["role"] for g in mz.muon_param_groups(hc) for p in g["params"]}
    for name, p in hc.named_parameters():
        want = "adamw" if name.startswith(("bias", "gate")) or p.ndim < 2 else "dense"
        assert role[id(p)] == want, (name, tuple(p.shape), role[id(p)])
    assert any(p.ndim == 2 and role[id(p)] == "adamw" for p in hc.parameters())  # bias_res


def test_a_model_converted_after_construction_is_refused():
    """dtype and device are captured at construction: a later .double() must not round silently."""
    m = torch.nn.Linear(4, 4, bias=False)
    opt = mz.MuonZeRO(mz.muon_param_groups(m))
    m.double()
    m(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    with pytest.raises(ValueError, match="float64"):
        opt.step()


# --------------------------------------------------------------------------------------------------
# Seams: clipping under ZeRO, exact resume with stochastic rounding, demo data and options
# --------------------------------------------------------------------------------------------------

MAX_NORM = 0.05  # below the test model's gradient norm on every step: clipping is active


def reference_torch_clipped(P, steps=STEPS, max_norm=MAX_NORM):
    """torch.optim.Muon + AdamW on one process, clip_grad_norm_ over every parameter first."""
    L = {k: v.clone().requires_grad_() for k, v in P.items() if k not in EXPERT}
    for k in EXPERT:
        L[k] = [m.clone().requires_grad_() for m in P[k]]
    mats = [L[k] for k in DENSE] + [m for k in EXPERT for m in L[k]]
    muon = torch.optim.Muon(mats, lr=LR_MUON, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adam = torch.optim.AdamW([L[k] for k in ADAMW], lr=LR_ADAM, betas=(0.9, 0.95), weight_decay=0.1)
    norms = []
    for s in range(steps):
        forward_loss(L, *batch(s)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(mats + [L[k] for k in ADAMW], max_norm).item())
        muon.step(), adam.step(), muon.zero_grad(), adam.zero_grad()
    return {k: (torch.stack(v) if isinstance(v, list) else v).detach() for k, v in L.items()}, norms


def check_clipping(rank, world):
    P0 = make_params()
    ref, norms = reference_torch_clipped(P0)
    out = {"min_norm": min(norms)}
    for z in [z for z in (1, 2, 3, 4) if world % z == 0]:  # replica groups must not count twice
        got, _ = run_muon_zero(P0, rank, world, ns_coefficients=mz.STANDARD_NS_COEFFICIENTS,
                               update_rms=0.2, grad_sync="fp32", zero_width=z,
                               max_grad_norm=MAX_NORM)  # fmt: skip
        out[z] = rel_change_error(P0, got, ref)
    return out


@pytest.mark.grade(points=2, solution="muon_zero.sharded_step", needs=SHARDED_NEEDS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_clipping_inside_step_matches_clip_grad_norm_on_one_process(world):
    """max_grad_norm clips the averaged gradient by its global norm, each matrix counted once
    (dense buckets are replicated across replica groups): equal to torch.optim.Muon + AdamW with
    clip_grad_norm_ on the full batch. Tolerance: bf16 NS, as the unclipped comparison."""
    for r in run_ranks(check_clipping, world, timeout=120):
        assert r["min_norm"] > 2 * MAX_NORM, f"clipping never bit: norms down to {r['min_norm']}"
        for z, err in r.items():
            if z != "min_norm":
                assert err < TORCH_BF16_TOL, (
                    f"max_grad_norm must clip the averaged gradient by its norm over the whole "
                    f"model, each matrix counted once: at zero_width {z} of {world} ranks 5 steps "
                    f"are {err:.2e} from clip_grad_norm_ + torch.optim.Muon (tolerance "
                    f"{TORCH_BF16_TOL:g})"
                )


def test_tiny_gradients_do_not_stall_newton_schulz():
    """A gradient scaled to 1e-30 (clipping can do that) still gets a full, unit-RMS-ish update."""
    g = torch.Generator().manual_seed(4)
    G = torch.randn(12, 20, generator=g)
    big = mz.muon_update(G, torch.zeros(12, 20), coefficients=mz.STANDARD_NS_COEFFICIENTS)
    tiny = mz.muon_update(G * 1e-30, torch.zeros(12, 20), coefficients=mz.STANDARD_NS_COEFFICIENTS)
    rms = tiny.pow(2).mean().sqrt().item()
    assert 0.1 < rms < 0.3, f"update RMS {rms:.3g} for a 1e-30 gradient: NS stalled under eps"
    # in fp32 NS the two agree to fp32 rounding (the 1e-30 scale itself is inexact in fp32)
    kw = dict(coefficients=mz.STANDARD_NS_COEFFICIENTS, ns_dtype=torch.float32)
    big, tiny = (mz.muon_update(G * s, torch.zeros(12, 20), **kw) for s in (1.0, 1e-30))
    assert (tiny - big).norm() / big.norm() < 1e-4, "NS must be scale-invariant down to 1e-30"
    L = leaves(make_params())
    opt = mz.MuonZeRO(groups(L), lr=LR_MUON, max_grad_norm=1e-30, grad_sync="fp32")
    before = L["w_in"].detach().clone()
    forward_loss(L, *batch(0)).backward()
    opt.step()
    moved = (L["w_in"].detach() - before * (1 - LR_MUON * 0.1)).norm() / before.norm()
    assert moved > 1e-3, f"a clipped step moved w_in by {moved:.2e} of its norm: stalled"


def check_resume(rank, world):
    """3 steps, save, a fresh optimizer loads, 3 more == 6 uninterrupted steps, bitwise."""
    P0, out = make_params(), {}
    per = GLOBAL_BATCH // world
    for sync in ("fp32", "bf16_sr"):
        end, _ = run_muon_zero(P0, rank, world, steps=6, grad_sync=sync)
        mid, opt = run_muon_zero(P0, rank, world, steps=3, grad_sync=sync)
        for how, state in (("local", opt.state_dict()), ("gathered", opt.gather_state_dict())):
            got, _ = run_muon_zero(mid, rank, world, steps=3, start=3, state=state, grad_sync=sync)
            out[f"{sync} {how}"] = all(torch.equal(got[k], end[k]) for k in end)
    # resharding (another zero width): momenta load, the rounding generator is reseeded
    L = leaves(mid)
    other = mz.MuonZeRO(groups(L), lr=LR_MUON, zero_width=1 if world > 1 else None)
    full = opt.gather_state_dict()
    other.load_state_dict(full)
    again = other.gather_state_dict()
    out["reshard momenta"] = all(
        torch.equal(full["state"][i][k], again["state"][i][k])
        for i in full["state"] for k in full["state"][i] if torch.is_tensor(full["state"][i][k])
    )  # fmt: skip
    out["reshard keeps the step count"] = other.steps == 3  # the rounding noise's seed
    x, y = batch(3)
    forward_loss(L, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
    other.step()
    out["reshard replicas equal"] = all_equal_across_ranks([L[k] for k in L])
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_resume_is_exact_in_every_sync_mode(world):
    for rank, r in enumerate(run_ranks(check_resume, world, timeout=120)):
        bad = [k for k, ok in r.items() if not ok]
        assert not bad, f"rank {rank} of {world}: {bad}"


def test_demo_batch_is_linear_in_seq():
    g = torch.Generator().manual_seed(1)
    x, y = mz.demo_batch(3, 7, 64, g)
    start = torch.randint(0, 64, (3, 1), generator=torch.Generator().manual_seed(1))
    expect = [start]
    for _ in range(7):
        expect.append((5 * expect[-1] + 3) % 64)
    expect = torch.cat(expect, dim=1)
    assert torch.equal(x, expect[:, :-1]) and torch.equal(y, expect[:, 1:])
    t = time.perf_counter()
    x, _ = mz.demo_batch(2, 2_000_000, 64, g)
    assert x.shape == (2, 2_000_000) and time.perf_counter() - t < 5


@pytest.mark.parametrize(
    "args, words",
    [
        (("--seq", "10000000"), "--seq 10000000"),
        (("--steps", "0"), "--steps"),
        (("--zero-width", "0"), "--zero-width"),
        (("--lr", "nan"), "--lr"),
        (("--max-grad-norm", "0"), "--max-grad-norm"),
        (("--timeout", "-1"), "--timeout"),
    ],
)
def test_demo_refuses_bad_options_in_one_line(args, words):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "muon_zero.py", *args], capture_output=True, text=True,
                         timeout=60, cwd=mz.__file__.rsplit("/", 1)[0])  # fmt: skip
    assert out.returncode == 2 and words in out.stderr.splitlines()[-1], out.stderr
