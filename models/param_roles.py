"""MuonZeRO's param groups: which optimizer each of a model's tensors gets, and what a group of
each role must hold (the checks MuonZeRO's constructor and load_state_dict run).

Roles: "dense" (a matrix [n, m]), "expert_down" / "expert_up" / "expert_gate" (an expert stack
[E, n, m], each expert its own matrix) and "adamw" (everything Muon does not update).
"""

import math

import torch
import torch.nn as nn

EXPERT_ROLES = ("expert_down", "expert_up", "expert_gate")  # V4's order of the flat expert vector
ROLES = ("dense",) + EXPERT_ROLES + ("adamw",)
OUTPUT_HEAD_NAMES = ("head", "lm_head", "output", "output_layer")  # nanoGPT, HF, titan, Megatron


def muon_param_groups(model, adamw_names=OUTPUT_HEAD_NAMES, expert_roles=None):
    """Split `model`'s parameters into MuonZeRO param groups, one per role, by what each tensor is.

    AdamW (V4): embeddings and what is tied to them; the output head (HF's
    get_output_embeddings(), or a module in `adamw_names`: a dotted prefix such as "model.proj" or
    a module name anywhere in the path); tensors declared non-Muon (a module's `no_muon` or
    `_adamw_params` set of names, or `tensor.no_muon = True`); static biases (names starting
    "bias", such as mHC's 2-D bias_res); tensors below 2-D. Muon: every other matrix. 3-D tensors
    are expert stacks [E, n, m], their role from `expert_roles[name]` or a name token ("w_down",
    "up_proj", "gate"), else a ValueError.
    """
    expert_roles, adamw_ids = dict(expert_roles or {}), set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            adamw_ids.add(id(module.weight))
        declared = set(getattr(module, "no_muon", ())) | set(getattr(module, "_adamw_params", ()))
        adamw_ids |= {id(p) for n, p in module.named_parameters(recurse=False) if n in declared}
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if isinstance(head, nn.Module):
        adamw_ids |= {id(p) for p in head.parameters()}
    by_role = {role: [] for role in ROLES}
    for name, p in model.named_parameters():
        modules = name.split(".")[:-1]  # whole module names: "output" is not "output_gate"
        named = any(name.startswith(a + ".") or a in modules for a in adamw_names)
        bias = name.rsplit(".", 1)[-1].startswith("bias")
        if id(p) in adamw_ids or getattr(p, "no_muon", False) or named or bias or p.ndim < 2:
            by_role["adamw"].append(p)
        elif p.ndim == 2:
            by_role["dense"].append(p)
        elif p.ndim == 3:
            tokens = set(name.replace(".", "_").split("_"))
            found = [r for r in EXPERT_ROLES if r.split("_")[1] in tokens]
            role = expert_roles.get(name, found[0] if len(found) == 1 else None)
            if role not in EXPERT_ROLES:
                raise ValueError(f"expert stack {name!r} {tuple(p.shape)}: cannot tell a down, up "
                                 f"or gate projection (role {role!r}); pass expert_roles="
                                 f"{{{name!r}: 'expert_down'}} (or _up / _gate)")  # fmt: skip
            by_role[role].append(p)
        else:
            raise ValueError(f"parameter {name!r} has {p.ndim} dims; Muon handles matrices "
                             f"[n, m] and expert stacks [E, n, m] only")  # fmt: skip
    return [{"params": ps, "role": role} for role, ps in by_role.items() if ps]


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
