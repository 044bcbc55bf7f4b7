"""The checks MuonZeRO's constructor makes through one call, `check`, before any other collective:
what a param group of each role must hold (check_group, which load_state_dict runs too), then one
agreement collective, so that bad input is one clear ValueError on every rank instead of a hang.
Agreed once: a step checks only what its own rank can see (muon_zero.MuonZeRO.step).
"""

import math

import torch
import torch.distributed as dist

import launch


def _finite(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _coefficient(v):  # a moving-average coefficient
    return _finite(v) and 0 <= v < 1


GROUP_RULES = {  # setting: (test, what it must be)
    "lr": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "momentum": (_coefficient, "a number in [0, 1) (Muon's momentum, AdamW's beta1)"),
    "beta2": (_coefficient, "a number in [0, 1) (AdamW's betas[1])"),
    "weight_decay": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "update_rms": (lambda v: _finite(v) and v > 0, "a finite number > 0"),
    "eps": (lambda v: _finite(v) and v > 0, "a finite number > 0"),
    "betas": (
        lambda v: False,
        "spelt momentum (beta1) and beta2 in a param group: the key torch's schedulers cycle "
        "is 'momentum' in every group",
    ),
    "ns_coefficients": (
        lambda v: len(v) > 0 and all(len(c) == 3 and all(map(_finite, c)) for c in v),
        "one or more finite (a, b, c)",
    ),
    "ns_dtype": (
        lambda v: isinstance(v, torch.dtype) and v.is_floating_point,
        "a floating torch dtype",
    ),
}
TENSOR_RULES = (  # (test of a tensor in a param group of this role, what is wrong and the fix)
    (
        lambda p, role, experts: p.dtype in (torch.float32, torch.float64),
        "MuonZeRO updates float32 parameters (float64 for exact checks): keep fp32 master "
        "weights, e.g. model.float()",
    ),
    (lambda p, role, experts: p.numel() > 0, "an empty tensor: leave it out of the optimizer"),
    (
        lambda p, role, experts: role != "dense" or p.ndim != 3,
        "a 3-D tensor declared 'dense': an expert stack [E, n, m] needs an expert role, e.g. "
        "'expert_up'; any other (a Conv1d's [out, in, k]) a role='adamw' param group "
        "(muon_param_groups routes both)",
    ),
    (
        lambda p, role, experts: role != "dense" or p.ndim == 2,
        "Muon needs [n, m] matrices: put it in a role='adamw' param group (muon_param_groups does)",
    ),
    (
        lambda p, role, experts: role not in experts or p.ndim == 3,
        "an expert role needs an expert stack [E, n, m]; a single matrix belongs in a 'dense' "
        "param group",
    ),
)


def check_group(k, g, expert_roles):
    """Raise ValueError for the first problem with param group k's role, settings or tensors."""
    roles = ("dense", *expert_roles, "adamw")
    if g["role"] not in roles:
        raise ValueError(f"param group {k}: role must be one of {roles}, got {g['role']!r}")
    if len({id(p) for p in g["params"]}) < len(g["params"]):  # torch warns; we'd plan it twice
        raise ValueError(f"param group {k} lists a parameter twice: list each parameter once")
    if torch.is_tensor(g.get("lr")):  # torch's tests read these words as a refusal
        raise ValueError(f"param group {k}: lr as a Tensor is not supported; pass a number")
    bad = [
        f"{key} must be {what}, got {g[key]!r}"
        for key, (ok, what) in GROUP_RULES.items()
        if key in g and not ok(g[key])
    ] + [
        f"a {p.dtype} tensor {tuple(p.shape)}: {what}"
        for p in g["params"]
        for ok, what in TENSOR_RULES
        if not ok(p, g["role"], expert_roles)
    ]
    if bad:
        raise ValueError(f"param group {k}: {bad[0]}")


def agreement_fields(param_groups, settings):
    """What every rank must hold alike, by name, with a digest of the initial values."""
    fields = dict(settings, param_groups=len(param_groups))
    for k, g in enumerate(param_groups):
        fields[f"param group {k} shapes"] = [tuple(p.shape) for p in g["params"]]
        fields[f"param group {k} dtypes"] = [str(p.dtype) for p in g["params"]]
        fields.update({f"param group {k} {key}": g[key] for key in sorted(g) if key != "params"})
        named = [(str(j), p) for j, p in enumerate(g["params"])]  # replicas start bitwise equal
        fields[f"param group {k} initial values"] = launch.weights_digest(named)
    return fields


def check_and_agree(param_groups, process_group, settings, expert_roles, plan_refused):
    """Every local check on this rank, then one agreement collective: all ranks raise together.
    settings: zero_width, balance, grad_sync, max_grad_norm, betas; plan_refused: why the
    chapter's plan refuses zero_width and balance (its message), or None."""
    if process_group is not None and dist.get_rank(process_group) < 0:
        raise ValueError("this rank is not a member of process_group; build MuonZeRO on members")
    params = [p for g in param_groups for p in g["params"]]
    grad_sync, max_grad_norm, betas = (settings[k] for k in ("grad_sync", "max_grad_norm", "betas"))
    error = None
    try:
        if grad_sync not in ("bf16_sr", "exact", "fp32"):
            raise ValueError(
                f"grad_sync must be 'bf16_sr' (V4's) or 'exact' (alias 'fp32'), got {grad_sync!r}"
            )
        if not (max_grad_norm is None or GROUP_RULES["eps"][0](max_grad_norm)):
            raise ValueError(f"max_grad_norm must be None or > 0, got {max_grad_norm!r}")
        pair = isinstance(betas, (tuple, list)) and len(betas) == 2
        if not (pair and all(map(_coefficient, betas))):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if plan_refused:
            raise ValueError(plan_refused)
        for k, g in enumerate(param_groups):
            check_group(k, g, expert_roles)
        if len(devices := {str(p.device) for p in params}) > 1:
            raise ValueError(f"parameters sit on several devices {sorted(devices)}; use one")
        if len(dtypes := {str(p.dtype) for p in params}) > 1:
            raise ValueError(f"parameters of several dtypes {sorted(dtypes)}; use one")
        if grad_sync == "bf16_sr" and params[0].dtype != torch.float32:
            raise ValueError(
                f"grad_sync='bf16_sr' rounds float32 gradients to bf16 (V4's): "
                f"{params[0].dtype} parameters need grad_sync='exact'"
            )
    except ValueError as err:
        error = str(err)
    launch.agree(agreement_fields(param_groups, settings), error, process_group, "MuonZeRO")
