"""tensor_ckpt's refusals, each naming the tensor and the fix: run while planning, before any
process group or backward sees the plan, so a mark that cannot be honoured is one clear ValueError
(and a costly recompute one warning) instead of wrong gradients.
"""

import warnings

import torch
import torch.fx as fx

import interop.fx_models as fx_models


def _tensors_in(value):  # the tensors in a (nested) tuple, list or dict
    return [v for v in torch.utils._pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def check_arity(placeholders, inputs, tracing=False):
    """One value per traced argument; and an example input with no storage cannot be planned."""
    if len(inputs) != len(wanted := [n.name for n in placeholders]):
        raise ValueError(f"tensor_ckpt: expected {len(wanted)} inputs ({wanted}), got "
                         f"{len(inputs)}. Pass one value per argument of forward.")  # fmt: skip
    if empty := [tuple(t.shape) for t in _tensors_in(inputs) if t.numel() == 0] if tracing else []:
        raise ValueError(f"tensor_ckpt: an example input is empty (shape {empty[0]}): it allocates "
                         "no storage, so nothing can be planned. Trace with a batch of at least "
                         "one sample.")  # fmt: skip


def check_marks(marked, nodes, infos, by_storage):
    """{storage key: first marked name}; refused: an unknown name, a non-tensor, an empty tensor,
    an input/parameter alias, a module output, a tensor changed in place."""
    if unknown := [m for m in marked if isinstance(m, str)]:
        fx_models.refuse_names(unknown, nodes, [n.name for n in nodes if infos[n].is_tensor])
    forgotten = {}
    output_keys = {infos[a].key for a in nodes[-1].all_input_nodes if infos[a].is_tensor}
    for m in marked:
        if not isinstance(m, fx.Node) or not infos[m].is_tensor:
            raise ValueError(f"tensor_ckpt: forget() needs a tensor, got {m!r}. Mark a tensor.")
        key = infos[m].key
        source = [n.name for n in by_storage.get(key, ()) if n.op in ("placeholder", "get_attr")]
        writers = [n.name for n in nodes if key in infos[n].mutates]
        why = ("it was empty in the example run, so its storage cannot be told apart. Trace with "
               "a non-empty batch" if infos[m].nbytes == 0 else
               f"it shares storage with the input/parameter '{source[0]}', which stays alive. "
               "Forget a tensor computed in forward" if source else
               "it is (or shares storage with) an output of the module, which the caller holds. "
               "Remove forget() there; forget it where it is consumed instead"
               if key in output_keys else f"the in-place op '{writers[0]}' modifies it: no single "
               "value to recompute. Use the out-of-place op (x = x + y, not x.add_(y); no "
               "inplace=True)" if writers else None)  # fmt: skip
        if why:
            raise ValueError(f"tensor_ckpt: cannot forget '{m.name}': {why}.")
        forgotten.setdefault(key, m.name)
    return forgotten


def check_recomputable(name, sub, frontier, deps, nodes, infos):
    """Refuse a recompute that reads a node it neither re-runs nor keeps, would apply an in-place
    op twice or reads a value changed later; warn when it re-runs a matmul or attention."""
    if missing := {m.name for n in sub for m in n.all_input_nodes} - {
            n.name for n in [*sub, *frontier, *deps]}:  # fmt: skip
        raise ValueError(f"tensor_ckpt: the recompute of '{name}' reads {sorted(missing)}, neither "
                         "re-run nor kept: recompute_subgraph must walk back through every node "
                         "that is not kept, not only root's direct inputs")  # fmt: skip

    def writers(n, start=0):  # the in-place ops that modify n's storage, from position start on
        return [w.name for w in nodes[start:] if infos[n].is_tensor and infos[n].key in
                infos[w].mutates]  # fmt: skip

    start = nodes.index(sub[0])  # FX records an in-place op, not that later readers see its effect
    whys = [f"its recompute subgraph contains '{n.name}', which modifies a tensor in place "
            "(running it again would apply it twice)" if infos[n].mutates else
            f"it is computed from '{n.name}', which the in-place op '{writers(n)[0]}' modifies, "
            "an order the traced graph does not record" for n in sub if infos[n].mutates or
            writers(n)] + [f"it reads '{f.name}', which the in-place op '{writers(f, start)[0]}' "
            "modifies later in forward, so backward would see the modified value"
            for f in frontier if writers(f, start)]  # fmt: skip
    if whys:
        raise ValueError(f"tensor_ckpt: cannot recompute '{name}': {whys[0]}. Make that op "
                         "out-of-place, or forget a tensor after it.")  # fmt: skip
    if costly := [f"'{n.name}' ({flops_text(infos[n].flops)})" for n in sub
                  if infos[n].flops and n.name != name]:  # fmt: skip
        warnings.warn(f"tensor_ckpt: forgetting '{name}' recomputes {', '.join(costly)} in every "
                      "backward: its storage, or a tensor its recompute needs, is not kept by "
                      "autograd (a view of an op's output shares that output's storage). Forget a "
                      "tensor computed after it, or keep it.", stacklevel=4)  # fmt: skip


def flops_text(flops):  # a unit that keeps small counts visible (3.1 kFLOP, not 0.0 MFLOP)
    scale, unit = next(p for p in ((1e9, "G"), (1e6, "M"), (1e3, "k"), (0, "")) if flops >= p[0])
    return f"{flops / scale:.1f} {unit}FLOP" if scale else f"{flops:.0f} FLOP"
