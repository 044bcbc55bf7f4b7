"""MuonZeRO's param groups: which optimizer each of a model's tensors gets.

Roles: "dense" (a matrix [n, m]), "expert_down" / "expert_up" / "expert_gate" (an expert stack
[E, n, m], each expert its own matrix) and "adamw" (everything Muon does not update).
"""

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
