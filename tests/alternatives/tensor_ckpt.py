"""Correct bodies for tensor_ckpt.py's regions, each written unlike the reference."""

from tests.alternatives import Alternative

ALTERNATIVES = [
    Alternative(
        region="tensor_ckpt.forget",
        name="create_node on the proxy's node, wrapped by the tracer",
        body="""
### BEGIN SOLUTION
if not isinstance(x, fx.Proxy):
    return x
node = x.tracer.create_node("call_function", forget, (x.node,), {})
return x.tracer.proxy(node)
### END SOLUTION
""",
    ),
    Alternative(
        region="tensor_ckpt.storage_units",
        name="keys in first-seen order, then each key's nodes filtered",
        body="""
### BEGIN SOLUTION
tensors = [n for n in nodes if infos[n].is_tensor and infos[n].nbytes]
keys = dict.fromkeys(infos[n].key for n in tensors)
return {k: [n for n in tensors if infos[n].key == k] for k in keys}
### END SOLUTION
""",
    ),
    Alternative(
        region="tensor_ckpt.recompute_subgraph",
        name="breadth-first over a growing list",
        body="""
### BEGIN SOLUTION
nodes, frontier, queue = {root}, set(), [root]
i = 0
while i < len(queue):
    current, i = queue[i], i + 1
    for m in current.all_input_nodes:
        if m in nodes or m in frontier:
            continue
        if is_kept(m):
            frontier.add(m)
        else:
            nodes.add(m)
            queue.append(m)
return nodes, frontier
### END SOLUTION
""",
    ),
    Alternative(
        region="tensor_ckpt.pack_hook",
        name="the handle decided first, the detached tensor packed after",
        body="""
### BEGIN SOLUTION
live = call.live_storage(t)
packed = Packed(tensor=t.detach(), version=t._version)
if live is not None:
    packed.to_handle(live)
elif call.opening is not None:
    call.opening.append(packed)
return packed
### END SOLUTION
""",
    ),
    Alternative(
        region="tensor_ckpt.unpack_hook",
        name="as_strided on a flat view of the recomputed storage",
        body="""
### BEGIN SOLUTION
if packed.storage is not None:
    live = packed.storage
    dtype, size, stride, offset = packed.geometry
    base = live.recompute()
    flat = torch.tensor([], dtype=dtype, device=base.device).set_(base.untyped_storage())
    out = flat.as_strided(size, stride, offset)
    live.release()
    return out
return packed.kept()
### END SOLUTION
""",
    ),
    Alternative(
        region="tensor_ckpt.LiveStorage.recompute",
        name="early return when cached, dependencies recomputed in a loop",
        body="""
### BEGIN SOLUTION
if self.value is not None:
    return self.value
self.check_inputs()
env = {}
env.update(self.inputs)
for root, dep in self.deps.items():
    env[root] = dep.recompute()
for n in self.unit.nodes:
    with self.as_in_forward(), replayed_rng(self.rng.get(n)):
        env[n] = run_node(self.owner.module, n, env)
value = env[self.unit.root]
self.check_geometry(value)
self.value = value
self.owner.recomputations += 1
for dep in self.deps.values():
    dep.release()
return value
### END SOLUTION
""",
    ),
]
