"""Probes for tests/graded/test_muon_zero.py: they run muon_zero.py's functions on the inputs the
test gives and return plain values (tensors, numbers, strings). The verdicts are the test's.

The model is the test's small MoE block (models_muon_zero, which the test's reference runs too):
dense matrices, expert stacks, and AdamW tensors. Each rank is handed its own slice of every
global batch and its own gradients (on_ranks' per_rank), never another rank's: the mean over the
ranks exists only through the optimizer's collectives."""

import torch
import torch.distributed as dist
from models_muon_zero import ADAMW, DENSE, forward_loss

import muon_zero as mz

NAMES = (*DENSE, "down", "up", "gate", *ADAMW)  # the optimizer's parameter order (see groups)
LR_MUON, LR_ADAM = 0.05, 0.01


def leaves(P):
    return {k: v.clone().requires_grad_() for k, v in P.items()}


def groups(L):
    out = [{"params": [L[k] for k in DENSE], "role": "dense"}]
    out += [{"params": [L[k]], "role": "expert_" + k} for k in ("down", "up", "gate")]
    out += [{"params": [L[k] for k in ADAMW], "role": "adamw", "lr": LR_ADAM}]
    return out


def coefficients(name):
    return {"v4": mz.V4_NS_COEFFICIENTS, "standard": mz.STANDARD_NS_COEFFICIENTS}[name]


def train(P, slices, **kw):
    """Every rank: its slice of each global batch, backward, MuonZeRO.step(). -> (params, opt)."""
    if "ns_coefficients" in kw:
        kw["ns_coefficients"] = coefficients(kw["ns_coefficients"])
    L = leaves(P)
    opt = mz.MuonZeRO(groups(L), lr=LR_MUON, **kw)
    for x, y in slices:
        forward_loss(L, x, y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in L.items()}, opt


def error_of(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def check_world(rank, world, P0, A, B, slices, grads, G):
    """Everything test_matches_single_process_references compares, from one launch. slices: this
    rank's slice of each batch; grads: its gradient of each matrix; G: rank 0's only (else None)."""
    torch.manual_seed(1234 + rank)  # different per rank: nothing may depend on rank-local noise
    out = {}
    out["bf16_vs_torch"], _ = train(P0, slices, ns_coefficients="standard",
                                    update_rms=0.2, grad_sync="exact")  # fmt: skip
    for z in (z for z in (1, 2, 3, 4) if world % z == 0):
        out[f"fp32_width{z}"], _ = train(
            P0, slices, ns_dtype=torch.float32, grad_sync="exact", zero_width=z
        )
    width = max(z for z in (1, 2, 3) if world % z == 0 and (z < world or world == 1))
    out["bf16_sr"], opt = train(P0, slices, grad_sync="bf16_sr", zero_width=width)
    out["state_bytes"] = opt.state_bytes()
    for ns_dtype in (torch.float32, torch.bfloat16):  # one step on the given per-rank gradients
        L = leaves(P0)
        opt = mz.MuonZeRO(groups(L), lr=LR_MUON, grad_sync="bf16_sr", ns_dtype=ns_dtype)
        for k, grad in grads.items():
            L[k].grad = grad.clone()
        opt.step()
        out[f"sr_one_step_{str(ns_dtype)[6:]}"] = {k: L[k].detach() for k in grads}
    # a gradient nowhere (a) and on rank 0 only (b)
    a, b = A.clone().requires_grad_(), B.clone().requires_grad_()
    opt = mz.MuonZeRO([a, b], lr=0.1, ns_dtype=torch.float32, grad_sync="exact")
    b.grad = None if G is None else G.clone()
    opt.step()
    out["none_a"], out["none_b"] = a.detach(), b.detach()
    if world > 1:  # bad input: every rank raises the same ValueError, and nobody is left waiting
        out["bad_width"] = error_of(
            lambda: mz.MuonZeRO([torch.zeros(3, 3, requires_grad=True)], zero_width=world + 1)
        )
        shape = (3, 3) if rank == 0 else (3, 4)
        out["mismatch"] = error_of(lambda: mz.MuonZeRO([torch.zeros(shape, requires_grad=True)]))
        out["vector_as_matrix"] = error_of(
            lambda: mz.MuonZeRO([torch.zeros(3, requires_grad=True)])
        )
        alive = torch.ones(1)
        dist.all_reduce(alive)
        out["alive_after_errors"] = alive.item()
    return out


def one_step_reading(P0, x, y, process_group=None, **kw):
    """One step from zero state on this rank's slice x, y: what sharded_step returned (the clip
    factor) and the state it left, whole (the momentum is (1 - 0.95) x the reduced gradient)."""
    returned = []
    real = mz.sharded_step

    def spy(*args, **kwargs):
        returned.append(real(*args, **kwargs))
        return returned[-1]

    mz.sharded_step = spy
    try:
        L = leaves(P0)
        opt = mz.MuonZeRO(groups(L), lr=LR_MUON, grad_sync="exact", process_group=process_group,
                          ns_dtype=torch.float32, **kw)  # fmt: skip
        forward_loss(L, x, y).backward()
        opt.step()
    finally:
        mz.sharded_step = real
    state = opt.gather_state_dict()["state"]
    return {
        "scale": float(returned[0]) if returned else None,
        "momentum": {NAMES[i]: s["momentum_buffer"] for i, s in state.items() if i < 8},
        "exp_avg": {NAMES[i]: s["exp_avg"] for i, s in state.items() if i >= 8},
    }


def clipping(rank, world, P0, max_norm, slices):
    """Per zero width: 5 clipped steps, and one step's reading with and without clipping."""
    out = {}
    for z in (z for z in (1, 2, 3, 4) if world % z == 0):
        out[f"steps_width{z}"], _ = train(P0, slices, ns_coefficients="standard",
                                          update_rms=0.2, grad_sync="exact", zero_width=z,
                                          max_grad_norm=max_norm)  # fmt: skip
        for clip in (None, max_norm):
            out[f"reading_width{z}_clip{clip}"] = one_step_reading(
                P0, *slices[0], zero_width=z, max_grad_norm=clip
            )
    return out


def data_parallel_stages(rank, world, max_norm, P0, slices):
    """Two pipeline stages, ranks [0, world/2) and [world/2, world), each its own MuonZeRO over
    its data-parallel subgroup, with its own parameters P0 (its stage's: the other stage's never
    reach this rank): 5 steps on its slices, and one clipped step's reading."""
    dp = world // 2
    stages = [dist.new_group(list(range(s * dp, (s + 1) * dp))) for s in (0, 1)]  # every rank
    stage = rank // dp
    width = 1 if stage == 0 or dp == 1 else 2  # the stages make different subgroup calls
    L = leaves(P0)
    opt = mz.MuonZeRO(groups(L), lr=LR_MUON, ns_dtype=torch.float32, grad_sync="exact",
                      process_group=stages[stage], zero_width=width)  # fmt: skip
    for x, y in slices:
        forward_loss(L, x, y).backward()
        opt.step()
        opt.zero_grad()
    reading = one_step_reading(P0, *slices[0], stages[stage],
                               zero_width=width, max_grad_norm=max_norm)  # fmt: skip
    return {"stage": stage, "params": {k: v.detach() for k, v in L.items()}, "reading": reading}


def newton_schulz_batch(calls):
    """[(X, coefficients' name, dtype)] -> newton_schulz of each."""
    return [mz.newton_schulz(X, coefficients(name), dtype) for X, name, dtype in calls]


def newton_schulz_refuses(X):
    return error_of(lambda: mz.newton_schulz(X, mz.V4_NS_COEFFICIENTS))


def newton_schulz_shapes(X):
    """The shapes of every tensor newton_schulz makes on a tall X, and its output's shape."""

    class Shapes(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.seen.append(list(out.shape))
            return out

    with Shapes() as spy:
        Y = mz.newton_schulz(X, mz.STANDARD_NS_COEFFICIENTS)
    return {"seen": spy.seen, "shape": list(Y.shape), "out": Y}


def muon_update(grads, momentum, nesterov, ns_dtype=torch.float32):
    """muon_update on successive gradients of one matrix: (update, buffer after) per step."""
    buf, out = torch.zeros_like(grads[0]), []
    for grad in grads:
        got = mz.muon_update(grad, buf, momentum=momentum, nesterov=nesterov, update_rms=0.2,
                             coefficients=mz.STANDARD_NS_COEFFICIENTS,
                             ns_dtype=ns_dtype)  # fmt: skip
        out.append((got, buf.clone()))
    return out


def muon_update_default(G):
    return mz.muon_update(G, torch.zeros_like(G), coefficients=mz.STANDARD_NS_COEFFICIENTS,
                          update_rms=0.2)  # fmt: skip


def stochastic_round(x, seed):
    return mz.stochastic_round_to_bf16(x, generator=torch.Generator().manual_seed(seed))


def stochastic_round_seeded(xs_seeds):
    """[(x, seed)] -> roundings, each with a fresh generator of that seed (one worker)."""
    return [stochastic_round(x, seed) for x, seed in xs_seeds]


def stochastic_round_refuses(x):
    return error_of(lambda: mz.stochastic_round_to_bf16(x))


def pack_dense(cases):
    """[(shapes, width, balance)] -> buckets per case; a bad balance's error; two ns_costs."""
    out = [mz.pack_dense([tuple(s) for s in shapes], w, balance=b) for shapes, w, b in cases]
    bad = error_of(lambda: mz.pack_dense([(4, 4)], 1, balance="random"))
    return {"buckets": out, "bad": bad, "ns_cost": [mz.ns_cost((48, 64)), mz.ns_cost((64, 48))]}


def split_experts(cases):
    return [[list(r) for r in mz.split_experts(numels, w)] for numels, w in cases]


def stacks_and_calls(P0, batches):
    """Full-batch fp32 steps on one process, one per batch: the stacked momentum shapes, whether
    they stayed the same buffers, the shapes newton_schulz was called with, and the parameters."""
    L = leaves(P0)
    opt = mz.MuonZeRO(groups(L), lr=LR_MUON, grad_sync="exact", ns_dtype=torch.float32)
    calls, real = [], mz.newton_schulz
    mz.newton_schulz = lambda X, *a, **k: calls.append(list(X.shape)) or real(X, *a, **k)
    pointers, stable = None, True
    try:
        for batch in batches:
            forward_loss(L, *batch).backward()
            opt.step()
            opt.zero_grad()
            stacks = [t for t in opt.local_state_tensors() if t.ndim == 3]
            now = [t.data_ptr() for t in stacks]
            stable = stable and (pointers is None or now == pointers)
            pointers = now
    finally:
        mz.newton_schulz = real
    params = {k: v.detach() for k, v in L.items()}
    return {"stacks": [list(t.shape) for t in stacks], "stable": stable, "calls": calls,
            "params": params}  # fmt: skip
