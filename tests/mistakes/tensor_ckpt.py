"""Plausible wrong bodies for tensor_ckpt.py's regions, each with the message a student must see."""

from tests.mistakes import Mistake

MISTAKES = [
    Mistake(
        region="tensor_ckpt.forget",
        name="no node under tracing",
        message="under tracing forget(proxy) must record one call_function node",
        edits=(
            (
                (
                    "if isinstance(x, fx.Proxy):\n"
                    '    return x.tracer.create_proxy("call_function", forget, (x,), {})\n'
                ),
                "",
            ),
        ),
    ),
    Mistake(
        region="tensor_ckpt.forget",
        name="a copy when run eagerly",
        message="forget(x) must return x itself when run eagerly",
        edits=((("return x\n### END SOLUTION"), ("return x.clone()\n### END SOLUTION")),),
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
        edits=(("is_tensor and infos[n].nbytes > 0:", "is_tensor:"),),
    ),
    Mistake(
        region="tensor_ckpt.storage_units",
        name="nodes not in execution order",
        message="each unit lists its nodes in execution order",
        edits=(("n in nodes:", "n in reversed(list(nodes)):"),),
    ),
    Mistake(
        region="tensor_ckpt.recompute_subgraph",
        name="direct inputs only",
        message="not only root's direct inputs",
        edits=(
            (
                (
                    "nodes, frontier, stack = {root}, set(), [root]\n"
                    "while stack:\n"
                    "    for m in stack.pop().all_input_nodes:\n"
                    "        if is_kept(m):\n"
                    "            frontier.add(m)\n"
                    "        elif m not in nodes:\n"
                    "            nodes.add(m)\n"
                    "            stack.append(m)"
                ),
                (
                    "nodes, frontier = {root}, set()\n"
                    "for m in root.all_input_nodes:\n"
                    "    (frontier if is_kept(m) else nodes).add(m)"
                ),
            ),
        ),
    ),
    Mistake(
        region="tensor_ckpt.recompute_subgraph",
        name="recomputing a kept tensor",
        message="a kept node ends the walk",
        edits=(("        elif m not in nodes:", "        if m not in nodes:"),),
    ),
    Mistake(
        region="tensor_ckpt.LiveStorage.recompute",
        name="random ops not replayed",
        message="the recompute must run each random op with the forward's generator state",
        edits=(
            (
                (
                    "            with replayed_rng(self.rng.get(n)):\n"
                    "                env[n] = run_node(self.owner.module, n, env)"
                ),
                "            env[n] = run_node(self.owner.module, n, env)",
            ),
        ),
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
        edits=(
            (
                "    env.update({root: dep.recompute() for root, dep in self.deps.items()})",
                (
                    "    for root, dep in self.deps.items():  # re-runs the dependency's"
                    " ops instead of its value\n"
                    "        for n in dep.unit.nodes:\n"
                    "            env[n] = run_node(self.owner.module, n, {**dep.inputs, **env})"
                ),
            ),
            ("    for dep in self.deps.values():\n        dep.release()\n", ""),
        ),
    ),
    Mistake(
        region="tensor_ckpt.LiveStorage.recompute",
        name="dependencies kept alive (never released)",
        message="must release each dependency it read",
        edits=((("    for dep in self.deps.values():\n        dep.release()\n"), ""),),
    ),
    Mistake(
        region="tensor_ckpt.LiveStorage.recompute",
        name="run with grad mode on",
        message="must run the ops under self.as_in_forward()",
        edits=(
            (
                (
                    "    with self.as_in_forward():\n"
                    "        for n in self.unit.nodes:\n"
                    "            with replayed_rng(self.rng.get(n)):\n"
                    "                env[n] = run_node(self.owner.module, n, env)"
                ),
                (
                    "    for n in self.unit.nodes:\n"
                    "        with replayed_rng(self.rng.get(n)):\n"
                    "            env[n] = run_node(self.owner.module, n, env)"
                ),
            ),
        ),
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
        edits=(
            (
                (
                    "if storage is not None:\n"
                    "    return packed.to_handle(storage)\n"
                    "if call.opening is not None:\n"
                    "    call.opening.append(packed)\n"
                    "return packed"
                ),
                "return packed.to_handle(storage) if storage is not None else packed",
            ),
        ),
    ),
    Mistake(
        region="tensor_ckpt.pack_hook",
        name="queued for the opening op before deciding it is a handle",
        message="a tensor already packed as a handle must not be queued in call.opening",
        body="""
### BEGIN SOLUTION
packed = Packed(t.detach(), t._version)
if call.opening is not None:
    call.opening.append(packed)
storage = call.live_storage(t)
if storage is not None:
    return packed.to_handle(storage)
return packed
### END SOLUTION
""",
    ),
    Mistake(
        region="tensor_ckpt.pack_hook",
        name="handles for the opening op's inputs",
        message="pack_hook handed out a handle for a tensor outside every forgotten storage",
        edits=(
            (
                "    call.opening.append(packed)",
                (
                    "    opening = next(s for s in call.storages.values() if"
                    " s.geometry is None)\n"
                    "    return packed.to_handle(opening)"
                ),
            ),
        ),
    ),
    Mistake(
        region="tensor_ckpt.unpack_hook",
        name="a copy instead of the recomputed storage",
        message="not a copy of it",
        edits=(
            (
                (
                    "view = torch.empty(0, dtype=dtype, device=root.device)\n"
                    "view.set_(root.untyped_storage(), offset, size, stride)  #"
                    " view, base, transpose: same storage"
                ),
                "view = root.as_strided(size, stride, offset).clone()",
            ),
        ),
    ),
    Mistake(
        region="tensor_ckpt.unpack_hook",
        name="the root instead of the saved alias",
        message="the saved alias has its own size, stride and offset",
        edits=(
            (
                (
                    "dtype, size, stride, offset = packed.geometry\n"
                    "view = torch.empty(0, dtype=dtype, device=root.device)\n"
                    "view.set_(root.untyped_storage(), offset, size, stride)  #"
                    " view, base, transpose: same storage\n"
                ),
                "",
            ),
            ("return view", "return root"),
        ),
    ),
    Mistake(
        region="tensor_ckpt.unpack_hook",
        name="the handle never released",
        message="unpack_hook must release the handle",
        edits=(("packed.storage.release()\n", ""),),
    ),
    Mistake(
        region="tensor_ckpt.unpack_hook",
        name="no version check on kept tensors",
        message="an in-place change of a kept saved tensor must be refused",
        edits=(("packed.kept()", "packed.tensor"),),
    ),
]
