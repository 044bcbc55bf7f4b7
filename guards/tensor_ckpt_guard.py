"""tensor_ckpt's refusals, each naming the tensor and the fix. ``check`` runs once per plan, when
it is made, before any process group or backward sees it, so a mark that cannot be honoured is one
clear ValueError instead of wrong gradients. It reads the plan and returns nothing.
"""

import torch.fx as fx


def check(plan, infos, marked):
    """Refuse an empty example input, a mark that cannot be forgotten (``marked``: the nodes
    forget() marked or ``names=`` named, an unknown name as a string) and a recompute that cannot
    reproduce the forward's value. ``infos``: what the example run learned per node."""
    if empty := [n.name for n in plan.placeholders if infos[n].is_tensor and not infos[n].nbytes]:
        raise ValueError(
            f"tensor_ckpt: the example input '{empty[0]}' is empty: it allocates no "
            "storage, so nothing can be planned. Trace with a batch of at least one "
            "sample."
        )
    check_marks(marked, plan.nodes, infos)
    for unit in plan.units:
        check_recomputable(unit, plan.nodes, infos)


def check_marks(marked, nodes, infos):
    """Refused: an unknown name, a non-tensor, an empty tensor, an input/parameter alias, a
    module output, a tensor changed in place."""
    if unknown := [m for m in marked if isinstance(m, str)]:
        refuse_names(unknown, nodes, [n.name for n in nodes if infos[n].is_tensor])
    output_keys = {infos[a].key for a in nodes[-1].all_input_nodes if infos[a].is_tensor}
    for m in marked:
        if not isinstance(m, fx.Node) or not infos[m].is_tensor:
            raise ValueError(f"tensor_ckpt: forget() needs a tensor, got {m!r}. Mark a tensor.")
        key = infos[m].key
        source = [
            n.name
            for n in nodes
            if n.op in ("placeholder", "get_attr")
            and infos[n].is_tensor
            and infos[n].nbytes
            and infos[n].key == key
        ]
        writers = [n.name for n in nodes if key in infos[n].mutates]
        why = (
            "it was empty in the example run, so its storage cannot be told apart. Trace with "
            "a non-empty batch"
            if infos[m].nbytes == 0
            else f"it shares storage with the input/parameter '{source[0]}', which stays alive. "
            "Forget a tensor computed in forward"
            if source
            else "it is (or shares storage with) an output of the module, which the caller holds. "
            "Remove forget() there; forget it where it is consumed instead"
            if key in output_keys
            else f"the in-place op '{writers[0]}' modifies it: no single "
            "value to recompute. Use the out-of-place op (x = x + y, not x.add_(y); no "
            "inplace=True)"
            if writers
            else None
        )
        if why:
            raise ValueError(f"tensor_ckpt: cannot forget '{m.name}': {why}.")


def refuse_names(unknown, nodes, tensor_names):
    """``names=`` that are no node of the graph; a torch.nn module is traced whole unless asked."""
    leaves = [
        n.target
        for n in nodes
        if n.op == "call_module" and any(u.startswith(n.target + ".") for u in unknown)
    ]
    inside = (
        f" '{unknown[0]}' is inside the leaf module '{leaves[0]}': FX keeps torch.nn "
        "modules whole; pass its class in trace_into=(...) to trace inside it."
        if leaves
        else ""
    )
    raise ValueError(
        f"tensor_ckpt: no node named {unknown} in the traced graph.{inside} "
        f"Pick from: {tensor_names}"
    )


def check_recomputable(unit, nodes, infos):
    """Refuse a recompute that reads a node it neither re-runs nor keeps, would apply an in-place
    op twice or reads a value changed later."""
    name, sub = unit.name, unit.nodes
    if missing := {m.name for n in sub for m in n.all_input_nodes} - {
        n.name for n in [*sub, *unit.frontier, *unit.deps]
    }:
        raise ValueError(
            f"tensor_ckpt: the recompute of '{name}' reads {sorted(missing)}, neither "
            "re-run nor kept: recompute_subgraph must walk back through every node "
            "that is not kept, not only root's direct inputs"
        )

    def writers(n, start=0):  # the in-place ops that modify n's storage, from position start on
        return [
            w.name for w in nodes[start:] if infos[n].is_tensor and infos[n].key in infos[w].mutates
        ]

    start = nodes.index(sub[0])  # FX records an in-place op, not that later readers see its effect
    whys = [
        f"its recompute subgraph contains '{n.name}', which modifies a tensor in place "
        "(running it again would apply it twice)"
        if infos[n].mutates
        else f"it is computed from '{n.name}', which the in-place op '{writers(n)[0]}' modifies, "
        "an order the traced graph does not record"
        for n in sub
        if infos[n].mutates or writers(n)
    ] + [
        f"it reads '{f.name}', which the in-place op '{writers(f, start)[0]}' "
        "modifies later in forward, so backward would see the modified value"
        for f in unit.frontier
        if writers(f, start)
    ]
    if whys:
        raise ValueError(
            f"tensor_ckpt: cannot recompute '{name}': {whys[0]}. Make that op "
            "out-of-place, or forget a tensor after it."
        )
