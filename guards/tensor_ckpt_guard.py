"""tensor_ckpt's refusals, each naming the tensor and the fix. The chapter makes one ``Refusals``
per checkpointed module, at its door (checkpoint_tensors), and hands it the planning's steps: around
the trace, what the trace would freeze (``SideEffects``: a draw from Python's random, a tensor
changed by code the trace ran instead of recording); around the example run, no hook and the
generators put back; after it, ``check`` of the finished plan, before any process group or backward
sees it, so a mark that cannot be honoured is one clear ValueError instead of wrong gradients.
"""

import contextlib
import operator
import os
import random
import sys

import torch
import torch.fx as fx


class Refusals:
    """The guard of one checkpointed ``module``, made at checkpoint_tensors' door and consulted at
    each planning (TensorCheckpoint.plan_for); it reads what it is shown and returns no tensor."""

    def __init__(self, module):
        self.module = module

    def key(self):  # hooks added or removed after tracing: part of the plan's key
        return hooked(self.module)

    def tracing(self, tracer):  # around the trace: what it would freeze is refused
        return tracing(tracer, self.module)

    def example_run(self):  # around the example run: yields drew(), did Python's generator move
        return example_run(self.module)

    def check(self, plan, infos):  # the finished plan: what cannot be recomputed exactly
        check(plan, infos)


def check(plan, infos):
    """Refuse an empty example input, a mark that cannot be forgotten (``plan.marked``: the nodes
    forget() marked or ``names=`` named, an unknown name as a string) and a recompute that cannot
    reproduce the forward's value. ``infos``: what the example run learned per node."""
    marked = plan.marked
    if empty := [n.name for n in plan.placeholders if infos[n].is_tensor and not infos[n].nbytes]:
        raise ValueError(
            f"tensor_ckpt: the example input '{empty[0]}' is empty: it allocates no "
            "storage, so nothing can be planned. Trace with a batch of at least one "
            "sample."
        )
    check_marks(marked, plan.nodes, infos)
    for unit in plan.units:
        check_replayed_once(unit, plan.gm, infos)
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
        return [  # a norm's running statistics: its recompute neither reads nor updates them
            w.name
            for w in nodes[start:]
            if infos[n].is_tensor
            and infos[n].key in infos[w].mutates
            and not (infos[w].statistics and all(infos[u].statistics for u in n.users if u in sub))
        ]

    start = nodes.index(sub[0])  # FX records an in-place op, not that later readers see its effect
    whys = [
        f"its recompute subgraph contains '{n.name}', which modifies a tensor in place "
        "(running it again would apply it twice)"
        if infos[n].mutates and not infos[n].statistics
        else f"it is computed from '{n.name}', which the in-place op '{writers(n)[0]}' modifies, "
        "an order the traced graph does not record"
        for n in sub
        if (infos[n].mutates and not infos[n].statistics) or writers(n)
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


def check_replayed_once(unit, gm, infos):
    """Refuse a recompute that would change a buffer or parameter again (an EMA, a counter, a
    norm's statistics inside a module run whole) or run a module's hooks again."""
    named = {(t.device, t.untyped_storage().data_ptr()): name for name, t in tensors_of(gm)}
    for n in unit.nodes:
        changed = [named[k] for k in infos[n].mutates if k in named and not infos[n].statistics]
        called = gm.get_submodule(n.target).named_modules() if n.op == "call_module" else []
        hooked = [f"{n.target}.{name}".rstrip(".") for name, m in called if hooks_of(m)]
        if changed or hooked or infos[n].draws_python:
            what = (
                f"updates '{changed[0]}' in place"
                if changed
                else f"runs the hooks of '{hooked[0]}'"
                if hooked
                else "draws from Python's or NumPy's generator, which no recompute replays"
            )
            norm = " (a torch.nn norm in trace_into=(...) updates its statistics once)"
            raise ValueError(
                f"tensor_ckpt: cannot forget '{unit.name}': its recompute re-runs '{n.name}', "
                f"which {what}; backward would do it a second time. Fix: forget a tensor "
                f"computed after it, or keep this one{norm if changed else ''}."
            )


# ---- side effects: what a trace would freeze, what a recompute would do twice --------------------
HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
PYTHON_RANDOM = {  # module -> functions a forward may draw from (numpy's only if it is loaded)
    "random": "random uniform randint randrange choice choices shuffle sample gauss "
    "normalvariate betavariate expovariate triangular getrandbits".split(),
    "numpy.random": "random rand randn randint uniform normal choice shuffle permutation "
    "binomial random_sample".split(),
}


@contextlib.contextmanager
def tracing(tracer, module):
    """Around a trace of ``module``: refused first, a module with hooks the trace runs through;
    after it, what the trace froze instead of recording (SideEffects)."""
    refuse_hooks_traced_into(tracer, module)
    effects = SideEffects(module)
    with effects.watching():
        yield
    effects.check()


@contextlib.contextmanager
def example_run(module):
    """Around planning's example run: no hook runs, and Python's and NumPy's generators are put
    back after it. Yields ``drew()``: whether either moved since it was last asked."""
    states = random_states()
    last = comparable(states)

    def drew():
        nonlocal last
        now = comparable(random_states())
        moved, last = now != last, now
        return moved

    try:
        with hooks_off(module):
            yield drew
    finally:
        set_random_states(states)


@contextlib.contextmanager
def hooks_off(module):
    """No hook runs in the example runs of planning: a hook's effects belong to real calls."""
    kinds = (*HOOKS, "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")
    held = [(m, k, getattr(m, k)) for m in module.modules() for k in kinds if getattr(m, k, None)]
    for m, k, _ in held:
        setattr(m, k, type(getattr(m, k))())
    try:
        yield
    finally:
        for m, k, hooks in held:
            setattr(m, k, hooks)


def hooks_of(m):  # the ids of a module's forward and backward hooks, one tuple
    return tuple(k for d in HOOKS for k in getattr(m, d, {}))


def hooked(module):
    """(name, hook ids) of every submodule with hooks, the root left out (its hooks run around the
    call): part of the plan's key, so a hook added or removed after tracing is seen."""
    return tuple((name, ids) for name, m in module.named_modules() if name and (ids := hooks_of(m)))


def refuse_hooks_traced_into(tracer, module):
    """A module the trace runs through calls its hooks once, with proxies, and never again."""
    stack = list(module.named_children())
    while stack:
        name, m = stack.pop()
        if tracer.is_leaf_module(m, name):
            continue  # runs whole, hooks included, in every forward
        if hooks_of(m):
            cls = type(m).__name__
            raise ValueError(
                f"tensor_ckpt: '{name}' ({cls}) has forward or backward hooks, and the trace runs "
                "through it: they would run once, at trace time, never per call. Fix: pass "
                f"leaf_modules=({cls},) so it runs whole with its hooks (nothing inside it can "
                "then be forgotten), or register the hook on the module you checkpoint, whose "
                "hooks run around every call."
            )
        stack += [(f"{name}.{n}", c) for n, c in m.named_children()]


def tensors_of(module):  # (name, tensor): parameters, buffers, tensors held as plain attributes
    named = dict(module.named_parameters()) | dict(module.named_buffers())
    for name, m in module.named_modules():
        for k, v in vars(m).items():
            if isinstance(v, torch.Tensor):
                named.setdefault(f"{name}.{k}".lstrip("."), v)
    return list(named.items())


class SideEffects:
    """Watches a trace for what it would freeze into the graph: a draw from Python's or NumPy's
    generator, a tensor of the module changed in place by code the trace ran instead of recording.
    ``excused()`` wraps the example run of recorded nodes (fx_models' shape-aware trace)."""

    current = None

    def __init__(self, module):
        self.module, self.drawn, self.excuse = module, [], 0
        self.tensors = tensors_of(module)
        self.versions = [t._version for _, t in self.tensors]
        self.states = random_states()

    @contextlib.contextmanager
    def excused(self):
        versions, states = [t._version for _, t in self.tensors], random_states()
        self.excuse += 1
        try:
            with hooks_off(self.module):
                yield
        finally:
            self.excuse -= 1
            after = [t._version for _, t in self.tensors]  # its own changes are no freeze
            self.versions = [v + a - b for v, a, b in zip(self.versions, after, versions)]
            set_random_states(states)

    def patched(self, where, name, fn):
        def watched(*args, **kwargs):
            if not self.excuse:
                caller = sys._getframe(1)
                at = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
                self.drawn.append(f"{where}.{name}() at {at}")
            return fn(*args, **kwargs)

        return watched

    @contextlib.contextmanager
    def watching(self):
        patches = [
            (mod, name, getattr(mod, name))
            for where, names in PYTHON_RANDOM.items()
            if (mod := sys.modules.get(where)) is not None
            for name in names
            if hasattr(mod, name)
        ]
        SideEffects.current = self
        for mod, name, fn in patches:
            setattr(mod, name, self.patched(mod.__name__, name, fn))
        try:
            yield self
        finally:  # the generators and the module's tensors put back, whether the trace failed
            for mod, name, fn in patches:
                setattr(mod, name, fn)
            SideEffects.current = None
            self.moved = comparable(random_states()) != comparable(self.states)
            set_random_states(self.states)
            self.assigned = self.put_back()

    def put_back(self):  # the tensors of the module that the trace replaced by a proxy
        assigned = []
        for name, t in self.tensors:  # `self.x = x + 1` replaced it by a proxy at trace time
            path, _, attr = name.rpartition(".")
            slots = [d for d in attribute_dicts(self.module.get_submodule(path)) if attr in d]
            if slots and isinstance(now := slots[0][attr], fx.Proxy):  # a tensor: a cache, left
                slots[0][attr] = t
                node = now.node  # `+=`: recorded as the in-place op on it
                if not (node.target in IN_PLACE and getattr(node.args[0], "target", 0) == name):
                    assigned.append(name)
        return assigned

    def check(self):
        """Refuse what the trace froze (after ``watching``, which put it back)."""
        cls, assigned = type(self.module).__name__, self.assigned
        if self.drawn or self.moved:
            call = self.drawn[0] if self.drawn else "Python's or NumPy's global generator"
            raise ValueError(
                f"tensor_ckpt: {cls}.forward draws from {call} while it is traced: the trace "
                "records the branch that draw took once, and every later call would repeat it "
                "(a LayerDrop would always keep or always drop). Fix: decide with torch's "
                "generator, as a tensor op (keep = torch.rand(()) >= p; out = torch.where(keep, "
                "layer(x), x)), which the graph records and the recompute replays."
            )
        if assigned:
            raise ValueError(
                f"tensor_ckpt: {cls}.forward assigns a new tensor to '{assigned[0]}': the trace "
                "cannot record an assignment, so later calls would not change it. Fix: update "
                f"it in place ({assigned[0].rsplit('.', 1)[-1]}.copy_(new), +=, mul_), which the "
                "graph records and each forward runs once."
            )
        for (name, t), v in zip(self.tensors, self.versions):
            if t._version != v:
                raise ValueError(
                    f"tensor_ckpt: {cls}.forward changes '{name}' in place by code the trace "
                    "runs once instead of recording (a tensor reached other than as a parameter "
                    "or registered buffer), so later calls would not change it. Fix: register "
                    f"it as a buffer (self.register_buffer('{name.rsplit('.', 1)[-1]}', ...)) "
                    "and update it in place through its attribute, or move the update out of "
                    "forward."
                )


IN_PLACE = (operator.iadd, operator.isub, operator.imul, operator.itruediv)


def attribute_dicts(m):  # where nn.Module keeps an attribute
    return m._parameters, m._buffers, vars(m)


def random_states():  # Python's generator, and NumPy's when it is loaded
    numpy = sys.modules.get("numpy")
    return random.getstate(), numpy.random.get_state() if numpy else None


def comparable(states):  # NumPy's state holds an array: compared by its bytes
    py, np = states
    return py, np and (np[0], np[1].tobytes(), *np[2:])


def set_random_states(states):
    random.setstate(states[0])
    if states[1] is not None:
        sys.modules["numpy"].random.set_state(states[1])


def excused():
    """The example run of a node the trace records: its side effects happen in every call."""
    watch = SideEffects.current
    return watch.excused() if watch is not None else contextlib.nullcontext()
