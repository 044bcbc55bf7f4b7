"""Plausible wrong bodies for tensor_ckpt.py's regions, each with the message a student must see."""

from tests.mistakes import Mistake

MISTAKES = [
    Mistake(
        region="tensor_ckpt.forget",
        name="no node under tracing",
        message="under tracing forget(proxy) must record one call_function node",
        body="""
### BEGIN SOLUTION
return x
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.forget",
        name="a copy when run eagerly",
        message="forget(x) must return x itself when run eagerly",
        body="""
### BEGIN SOLUTION
if isinstance(x, fx.Proxy):
    return x.tracer.create_proxy("call_function", forget, (x,), {})
return x.clone()
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.storage_units",
        name="one unit per node, not per storage",
        message="a view and its base (one storage key) must be one unit",
        body="""
### BEGIN SOLUTION
return {(infos[n].key, n): [n] for n in nodes if infos[n].is_tensor and infos[n].nbytes > 0}
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.storage_units",
        name="empty tensors grouped into one unit",
        message="empty tensors (0 bytes) share the null address",
        body="""
### BEGIN SOLUTION
units = {}
for n in nodes:
    if infos[n].is_tensor:
        units.setdefault(infos[n].key, []).append(n)
return units
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.storage_units",
        name="nodes not in execution order",
        message="each unit lists its nodes in execution order",
        body="""
### BEGIN SOLUTION
units = {}
for n in reversed(list(nodes)):
    if infos[n].is_tensor and infos[n].nbytes > 0:
        units.setdefault(infos[n].key, []).append(n)
return units
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.recompute_subgraph",
        name="direct inputs only",
        message="not only root's direct inputs",
        body="""
### BEGIN SOLUTION
nodes, frontier = {root}, set()
for m in root.all_input_nodes:
    (frontier if is_kept(m) else nodes).add(m)
return nodes, frontier
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.recompute_subgraph",
        name="recomputing a kept tensor",
        message="a kept node ends the walk",
        body="""
### BEGIN SOLUTION
nodes, frontier, stack = {root}, set(), [root]
while stack:
    for m in stack.pop().all_input_nodes:
        if is_kept(m):
            frontier.add(m)
        if m not in nodes:
            nodes.add(m)
            stack.append(m)
return nodes, frontier
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.LiveStorage.recompute",
        name="random ops not replayed",
        message="the recompute must run each random op with the forward's generator state",
        body="""
### BEGIN SOLUTION
if self.value is None:
    self.check_inputs()
    env = dict(self.inputs)
    env.update({root: dep.recompute() for root, dep in self.deps.items()})
    with self.as_in_forward():
        for n in self.unit.nodes:
            env[n] = run_node(self.owner.module, n, env)
    self.value = env[self.unit.root]
    self.owner.recomputations += 1
    for dep in self.deps.values():
        dep.release()
return self.value
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.LiveStorage.recompute",
        name="recomputed on every unpack (no cache)",
        message="must be recomputed once per backward",
        body="""
### BEGIN SOLUTION
env = dict(self.inputs)
env.update({root: dep.recompute() for root, dep in self.deps.items()})
with self.as_in_forward():
    for n in self.unit.nodes:
        with replayed_rng(self.rng.get(n)):
            env[n] = run_node(self.owner.module, n, env)
self.owner.recomputations += 1
for dep in self.deps.values():
    dep.release()
return env[self.unit.root]
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.LiveStorage.recompute",
        name="a forgotten dependency's ops run again",
        message="must take its dep.recompute() value, not run its ops again",
        body="""
### BEGIN SOLUTION
if self.value is None:
    env = dict(self.inputs)
    for root, dep in self.deps.items():  # re-runs the dependency's ops instead of its value
        for n in dep.unit.nodes:
            env[n] = run_node(self.owner.module, n, {**dep.inputs, **env})
    with self.as_in_forward():
        for n in self.unit.nodes:
            with replayed_rng(self.rng.get(n)):
                env[n] = run_node(self.owner.module, n, env)
    self.value = env[self.unit.root]
    self.owner.recomputations += 1
return self.value
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.LiveStorage.recompute",
        name="dependencies kept alive (never released)",
        message="must release each dependency it read",
        body="""
### BEGIN SOLUTION
if self.value is None:
    self.check_inputs()
    env = dict(self.inputs)
    env.update({root: dep.recompute() for root, dep in self.deps.items()})
    with self.as_in_forward():
        for n in self.unit.nodes:
            with replayed_rng(self.rng.get(n)):
                env[n] = run_node(self.owner.module, n, env)
    self.value = env[self.unit.root]
    self.check_layout(self.value)
    self.owner.recomputations += 1
return self.value
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.LiveStorage.recompute",
        name="run with grad mode on",
        message="must run the ops under self.as_in_forward()",
        body="""
### BEGIN SOLUTION
if self.value is None:
    self.check_inputs()
    env = dict(self.inputs)
    env.update({root: dep.recompute() for root, dep in self.deps.items()})
    for n in self.unit.nodes:
        with replayed_rng(self.rng.get(n)):
            env[n] = run_node(self.owner.module, n, env)
    self.value = env[self.unit.root]
    self.check_layout(self.value)
    self.owner.recomputations += 1
    for dep in self.deps.values():
        dep.release()
return self.value
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.pack_hook",
        name="every tensor kept (never a handle)",
        message="a tensor in a forgotten storage must be packed as a handle",
        body="""
### BEGIN SOLUTION
return Packed(t.detach(), t._version)
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.pack_hook",
        name="tensors saved by their own op not kept for register_root",
        message="keep it in call.opening",
        body="""
### BEGIN SOLUTION
packed = Packed(t.detach(), t._version)
storage = call.live_storage(t)
return packed.to_handle(storage) if storage is not None else packed
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.pack_hook",
        name="handles for the opening op's inputs",
        message="pack_hook handed out a handle for a tensor outside every forgotten storage",
        body="""
### BEGIN SOLUTION
packed = Packed(t.detach(), t._version)
storage = call.live_storage(t)
if storage is not None:
    return packed.to_handle(storage)
if call.opening is not None:  # the forgotten op runs: what it saves is taken for its output
    opening = next(s for s in call.storages.values() if s.layout is None)
    return packed.to_handle(opening)
return packed
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.unpack_hook",
        name="a copy instead of the recomputed storage",
        message="not a copy of it",
        body="""
### BEGIN SOLUTION
if packed.storage is None:
    return packed.kept()
root = packed.storage.recompute()
dtype, size, stride, offset = packed.geometry
view = root.as_strided(size, stride, offset).clone()
packed.storage.release()
return view
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.unpack_hook",
        name="the root instead of the saved alias",
        message="the saved alias has its own size, stride and offset",
        body="""
### BEGIN SOLUTION
if packed.storage is None:
    return packed.kept()
root = packed.storage.recompute()
packed.storage.release()
return root
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.unpack_hook",
        name="the handle never released",
        message="unpack_hook must release the handle",
        body="""
### BEGIN SOLUTION
if packed.storage is None:
    return packed.kept()
root = packed.storage.recompute()
dtype, size, stride, offset = packed.geometry
view = torch.empty(0, dtype=dtype, device=root.device)
view.set_(root.untyped_storage(), offset, size, stride)
return view
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.unpack_hook",
        name="no version check on kept tensors",
        message="an in-place change of a kept saved tensor must be refused",
        body="""
### BEGIN SOLUTION
if packed.storage is None:
    return packed.tensor
root = packed.storage.recompute()
dtype, size, stride, offset = packed.geometry
view = torch.empty(0, dtype=dtype, device=root.device)
view.set_(root.untyped_storage(), offset, size, stride)
packed.storage.release()
return view
### END SOLUTION
""",
    ),
]
