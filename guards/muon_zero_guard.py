"""The checks MuonZeRO runs before any collective, so that bad input is one clear ValueError on
every rank instead of a hang: what a param group of each role must hold (check_group), one
agreement collective at construction (check_and_agree) and its cheap re-check in every step
(agreed_grad_mask).
"""

import math

import torch
import torch.distributed as dist

import launch
from models.param_roles import EXPERT_ROLES, ROLES


def _finite(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


GROUP_RULES = {  # setting: (test, what it must be)
    "lr": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "momentum": (lambda v: _finite(v) and 0 <= v < 1, "a number in [0, 1)"),
    "weight_decay": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "update_rms": (lambda v: _finite(v) and v > 0, "a finite number > 0"),
    "eps": (lambda v: _finite(v) and v > 0, "a finite number > 0"),
    "betas": (lambda v: len(v) == 2 and all(_finite(b) and 0 <= b < 1 for b in v),
              "two numbers in [0, 1)"),
    "ns_coefficients": (lambda v: len(v) > 0 and all(len(c) == 3 and all(map(_finite, c))
                                                     for c in v), "one or more finite (a, b, c)"),
    "ns_dtype": (lambda v: isinstance(v, torch.dtype) and v.is_floating_point,
                 "a floating torch dtype"),
}  # fmt: skip
TENSOR_RULES = (  # (test of a tensor in a param group of this role, what is wrong and the fix)
    (lambda p, role: p.dtype == torch.float32, "MuonZeRO updates float32 parameters (its buffers "
     "are fp32): keep fp32 master weights, e.g. model.float()"),
    (lambda p, role: p.numel() > 0, "an empty tensor: leave it out of the optimizer"),
    (lambda p, role: role != "dense" or p.ndim != 3, "a 3-D stack declared 'dense' (expert role "
     "missing): give it role 'expert_down', 'expert_up' or 'expert_gate' (muon_param_groups does)"),
    (lambda p, role: role != "dense" or p.ndim == 2, "Muon needs [n, m] matrices: put it in a "
     "role='adamw' param group (muon_param_groups does)"),
    (lambda p, role: role not in EXPERT_ROLES or p.ndim == 3, "an expert role needs an expert "
     "stack [E, n, m]; a single matrix belongs in a 'dense' param group"),
)  # fmt: skip


def check_group(k, g):
    """Raise ValueError for the first problem with param group k's role, settings or tensors."""
    if g["role"] not in ROLES:
        raise ValueError(f"param group {k}: role must be one of {ROLES}, got {g['role']!r}")
    bad = [f"{key} must be {what}, got {g[key]!r}" for key, (ok, what) in GROUP_RULES.items()
           if not ok(g[key])] + [f"a {p.dtype} tensor {tuple(p.shape)}: {what}"
                                 for p in g["params"] for ok, what in TENSOR_RULES
                                 if not ok(p, g["role"])]  # fmt: skip
    if bad:
        raise ValueError(f"param group {k}: {bad[0]}")


def agreement_fields(opt, zero_width, balance, weights=True):
    """What every rank must hold alike, by name; weights: a digest of the initial values."""
    fields = dict(zero_width=zero_width, balance=balance, grad_sync=opt.grad_sync,
                  max_grad_norm=opt.max_grad_norm, param_groups=len(opt.param_groups))  # fmt: skip
    for k, g in enumerate(opt.param_groups):
        fields[f"param group {k} shapes"] = [tuple(p.shape) for p in g["params"]]
        fields[f"param group {k} dtypes"] = [str(p.dtype) for p in g["params"]]
        fields.update({f"param group {k} {key}": g[key] for key in sorted(g) if key != "params"})
        if weights:  # replicas must start bitwise equal
            named = [(str(j), p) for j, p in enumerate(g["params"])]
            fields[f"param group {k} initial values"] = launch.weights_digest(named)
    return fields


def check_and_agree(opt, zero_width, balance, plan):
    """Every local check on this rank, then one agreement collective: all ranks raise together.
    plan: the chapter's plan_muon, which checks zero_width and balance."""
    if opt.rank < 0:
        raise ValueError("this rank is not a member of process_group; build MuonZeRO on members")
    error = None
    try:
        if opt.grad_sync not in ("fp32", "bf16_sr"):
            raise ValueError(f"grad_sync must be 'fp32' (exact) or 'bf16_sr' (V4's), got "
                             f"{opt.grad_sync!r}")  # fmt: skip
        if not (opt.max_grad_norm is None or GROUP_RULES["eps"][0](opt.max_grad_norm)):
            raise ValueError(f"max_grad_norm must be None or > 0, got {opt.max_grad_norm!r}")
        plan([], [], opt.world_size, zero_width, balance)
        for k, g in enumerate(opt.param_groups):
            check_group(k, g)
        if len(devices := {str(p.device) for p in opt.params}) > 1:
            raise ValueError(f"parameters sit on several devices {sorted(devices)}; use one")
    except ValueError as err:
        error = str(err)
    launch.agree(agreement_fields(opt, zero_width, balance), error, opt.process_group, "MuonZeRO")


def agreed_grad_mask(opt):
    """Which parameters have a gradient on some rank (elsewhere zero; on none: skipped), in one
    all-reduce (MAX) that also re-checks the agreed settings and the parameters' shape, dtype and
    device: a change on any rank makes every rank run the full guard."""
    fields = agreement_fields(opt, opt.zero_width, "-", weights=False)
    digest, error = launch.fields_digest(fields), None
    for i, (built, p) in enumerate(zip(opt._built_for, opt.params)):
        if (now := (tuple(p.shape), p.dtype, p.device)) != built and error is None:
            error = (f"parameter {i} is now {now[0]} {now[1]} on {now[2]}, but MuonZeRO was built "
                     f"for {built[0]} {built[1]} on {built[2]}: build the optimizer after moving "
                     f"or converting the model")  # fmt: skip
    mask = [p.grad is not None for p in opt.params] + [digest, -digest, error is not None]
    mask = torch.tensor(mask, dtype=torch.int64, device=opt.device)
    if opt.world_size > 1:
        dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=opt.process_group)
    if mask[-3].item() != -mask[-2].item() or mask[-1].item():
        launch.agree(fields, error, opt.process_group, "MuonZeRO")
    return mask[:-3].bool().tolist()
