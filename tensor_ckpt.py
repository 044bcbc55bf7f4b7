"""Tensor-level activation checkpointing: say what to forget, not how to recompute it (V4 §3.4.4).

What the standard tool assumes. `torch.utils.checkpoint` works on whole functions: everything inside
a checkpointed region is dropped after forward and the whole region runs again in backward.
Selective activation checkpointing (SAC) refines that per *operator type* (save every matmul,
recompute the rest), but the unit is still a region you wrap and an op-level policy you write.

What V4's design violates. In V4 the expensive and the cheap live side by side in every layer: the
matmuls are worth keeping, while norm outputs, activation-function outputs and reshaped copies are
large and nearly free to redo. Which *tensor* to keep is the real decision, and it cuts across
module boundaries; neither "keep the module" nor "recompute the module" expresses it.

The fix. The author marks individual tensors inside an ordinary forward with `forget(x)`. A concrete
TorchFX trace (run once on example inputs, so storage identities are known) finds, for each
forgotten tensor, the minimal subgraph that recomputes it from tensors autograd keeps anyway;
tensors that share storage (a view, its base, a reshape) form one unit, recomputed once. At run time
saved-tensor hooks store a small handle instead of the forgotten storage, and the first gradient
that needs it runs the recompute subgraph; every saved alias is rebuilt as a view over that one
recomputed storage (no copy), and the storage is dropped when the last gradient that needs it ran.

Reading order: forget -> trace -> profile (the concrete run) -> plan (`recompute_subgraph`) -> the
runtime (`run_forgetting` with `pack_hook` and `unpack_hook`). Below the appendix fence: the
agreement guard for data parallel, the refusals, plan printing, byte/FLOP accounting, the demo.

Choices the report leaves open, made here:
- "Reuses storage (no copies)": the forgotten storage is released after forward, so the recompute
  allocates the root once (the GPU caching allocator hands back the block just freed) and every
  saved alias is rebuilt over that same storage with `set_` (view, base, transposes: no copy).
- "Kept anyway" means: an input, a parameter, or a storage autograd saves and nobody forgets; a
  Python value (a size) is kept by value. The walk stops there; everything else on the way is
  redone.
- Recomputed once per backward and cached until the last saved alias is unpacked; a retained graph
  recomputes again on the next backward. A recompute that reads another forgotten storage takes
  that storage's recomputed value, so each forgotten storage runs once. Double backward works.
- Randomness: an op is random if the example run moved the generator or the graph says it can draw
  (dropout, rand, SDPA with dropout_p); its generator state is kept per forward and replayed.
- A trace freezes Python values such as `self.training` (`F.dropout(h, p, self.training)`), so one
  plan is kept per train/eval mode of the module and its submodules, traced on first use; without
  gradients the module itself runs. The example run leaves the module's buffers (BatchNorm) as
  they were.
- Refused with a ValueError that names the tensor and the fix: forgetting an input/parameter alias
  or a module output, in-place ops on a forgotten tensor or on anything its recompute reads, code
  FX cannot trace (fix: `leaf_modules`), an empty example batch. A forget that pulls a matmul or
  attention into the recompute warns with the op and its FLOPs. Changing a kept tensor in place
  after forward raises in backward, as autograd itself does.

    python tensor_ckpt.py                                          # one process
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 tensor_ckpt.py   # data parallel, CPU/gloo
    torchrun --nproc_per_node=8 tensor_ckpt.py     # GPUs: NCCL, one GPU per rank, chosen for you

Usage:
    class Block(nn.Module):
        def forward(self, x):
            h = forget(self.norm(x))             # the only change to the model
            return x + self.fc2(forget(F.gelu(self.fc1(h))))

    model = checkpoint_tensors(Block(), example_inputs=(x,))
    print(model.plan)             # per forgotten tensor: recompute ops, their cost, bytes freed
    model(x).sum().backward()     # gradients bitwise equal to the plain model's
"""

import argparse
import contextlib
import datetime
import functools
import gc
import hashlib
import json
import os
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

# -------------------------------------------------------------------------------------------------
# 1. Mark a tensor, trace the forward, run it once on examples
# -------------------------------------------------------------------------------------------------


def forget(x):
    """Mark ``x`` to be freed after forward and recomputed in backward. Identity when run eagerly.

    Under the FX trace it records a ``forget`` node (whatever module it is called from, which is why
    it checks for a Proxy rather than relying on ``torch.fx.wrap``'s per-module name patching).
    """
    # hint: under tracing x is an fx.Proxy; its tracer can create a call_function node
    ### BEGIN SOLUTION
    if isinstance(x, fx.Proxy):
        return x.tracer.create_proxy("call_function", forget, (x,), {})
    return x
    ### END SOLUTION


class _Tracer(fx.Tracer):
    def __init__(self, leaf_modules=()):
        super().__init__()
        self.leaf_modules = tuple(leaf_modules)

    def is_leaf_module(self, m, qualname):
        return isinstance(m, self.leaf_modules) or super().is_leaf_module(m, qualname)


def trace(module, leaf_modules=()):
    """Symbolically trace ``module`` into a GraphModule that shares its parameters.

    ``leaf_modules``: module classes kept as single opaque nodes (the way out for code FX cannot
    trace).
    """
    try:
        graph = _Tracer(leaf_modules).trace(module)
    except Exception as err:  # TraceError, or what a Proxy raises in len(), bool()...
        raise untraceable(module, err) from err
    return fx.GraphModule(module, graph, class_name=type(module).__name__ + "Traced")


def run_node(gm, node, env):
    """Execute one FX node, reading its inputs from ``env`` (a dict node -> value)."""
    args = fx.node.map_arg(node.args, env.__getitem__)
    kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    if node.op == "get_attr":
        return functools.reduce(getattr, node.target.split("."), gm)
    raise RuntimeError(f"run_node: unexpected node {node.op} {node.name}")


def storage_key(t):
    """Identity of the memory a tensor lives in: (device, data pointer), shared by views."""
    return (t.device, t.untyped_storage().data_ptr())


def _tensors_in(value):
    found = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


@dataclass
class NodeInfo:
    """What the concrete example run learned about one node."""

    is_tensor: bool = False
    key: tuple = None  # storage identity (tensors only)
    nbytes: int = 0  # bytes of the whole storage
    layout: tuple = None  # (dtype, size, stride, storage_offset)
    flops: int = 0  # FlopCounterMode: matmul / attention / conv FLOPs of this op
    aten_ops: int = 0  # aten ops it ran (elementwise ones too, which have no FLOP formula)
    bytes_written: int = 0  # bytes of the new storages those ops allocated
    random: bool = False  # it advanced the generator (dropout, rand...)
    mutates: tuple = ()  # storage keys it modified in place (args, module params/buffers)
    holds_tensors: bool = False  # a tuple/list with tensors in it (split, unbind, module outputs)


def profile(gm, example_inputs):
    """Run ``gm`` once on ``example_inputs``, node by node, and record per node what the plan needs.

    Returns ``(infos, saved_keys)``: {node: NodeInfo} and the set of storage keys autograd saved
    for backward. Every value is kept alive during the run so a storage address means one storage.
    """
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    check_input_count(placeholders, example_inputs)
    device = next((t.device for t in _tensors_in(example_inputs)), torch.device("cpu"))
    saved, infos, env = [], {}, dict(zip(placeholders, example_inputs))

    def pack(t):  # only to learn which storages autograd saves
        saved.append(t.detach())
        return t.detach()

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for n in nodes:
                info = infos[n] = NodeInfo()
                if n.op == "output":
                    break
                if n.op != "placeholder":
                    env[n] = _profiled_run(gm, n, env, info, device)
                value = env[n]
                if isinstance(value, torch.Tensor):
                    info.is_tensor, info.key = True, storage_key(value)
                    info.nbytes = value.untyped_storage().nbytes()
                    info.layout = (value.dtype, tuple(value.shape), value.stride(),
                                   value.storage_offset())  # fmt: skip
                else:
                    info.holds_tensors = bool(_tensors_in(value))
    return infos, {storage_key(t) for t in saved}


def _profiled_run(gm, n, env, info, device):
    """Run one node and note its cost, whether it drew random numbers, what it changed in place."""
    touched = _tensors_in(fx.node.map_arg((n.args, n.kwargs), env.__getitem__))
    if n.op == "call_module":
        touched += list(gm.get_submodule(n.target).parameters())
        touched += list(gm.get_submodule(n.target).buffers())
    versions = [t._version for t in touched]
    rng_before = rng_snapshot(device)
    with count_flops() as counter, OpCounter() as ops:
        value = run_node(gm, n, env)
    info.flops, info.aten_ops, info.bytes_written = counter.get_total_flops(), ops.ops, ops.bytes
    info.random = any(a is not None and not torch.equal(a, b)
                      for a, b in zip(rng_before[:2], rng_snapshot(device)[:2]))  # fmt: skip
    changed = {storage_key(t) for t, v in zip(touched, versions) if t._version != v}
    info.mutates = tuple(changed)
    return value


# -------------------------------------------------------------------------------------------------
# 2. The plan: one minimal recompute subgraph per forgotten storage
# -------------------------------------------------------------------------------------------------


def storage_units(nodes, infos):
    """Group tensor nodes by the storage they live in: {key: [nodes in execution order]}.

    A view, its base, an unbind/split of it, a reshape that did not copy: one unit, one recompute.
    """
    ### BEGIN SOLUTION
    units = {}
    for n in nodes:
        if infos[n].is_tensor and infos[n].nbytes > 0:  # empty tensors share the null pointer
            units.setdefault(infos[n].key, []).append(n)
    return units
    ### END SOLUTION


def recompute_subgraph(root, is_kept):
    """The minimal set of nodes that recomputes ``root`` from kept values.

    Walks inputs backward from ``root`` and stops at every node for which ``is_kept(node)`` holds.
    Returns ``(nodes, frontier)``: the nodes to re-run (``root`` included) and the kept nodes they
    read, both as sets; order them by graph position to execute.
    """
    # hint: a depth-first walk over node.all_input_nodes; a kept input ends the walk there
    ### BEGIN SOLUTION
    nodes, frontier, stack = {root}, set(), [root]
    while stack:
        for m in stack.pop().all_input_nodes:
            if is_kept(m):
                frontier.add(m)
            elif m not in nodes:
                nodes.add(m)
                stack.append(m)
    return nodes, frontier
    ### END SOLUTION


@dataclass(eq=False)
class ForgottenUnit:
    """One storage to forget: its aliases, and the subgraph that brings it back."""

    name: str  # the tensor that owns the storage (first node writing it)
    members: list  # every node living in this storage (views, reshapes)
    root: fx.Node
    nodes: list  # recompute subgraph, in execution order (root last)
    frontier: list  # kept nodes the subgraph reads (their values are stashed)
    deps: list  # roots of other forgotten storages it reads (recomputed once, shared)
    shape: tuple
    nbytes: int  # bytes of the storage
    saved: bool  # autograd saves it (otherwise forgetting it frees nothing)
    flops: int  # recompute matmul/attention FLOPs (FlopCounterMode, from the example run)
    aten_ops: int = 0  # recompute aten ops, elementwise included
    bytes_written: int = 0  # bytes those ops allocate
    op_flops: list = field(default_factory=list)  # [(node name, FLOPs)] per recomputed op
    random_nodes: list = field(default_factory=list)  # ops whose generator state is replayed

    @property
    def bytes_freed(self):
        return self.nbytes if self.saved else 0


@dataclass(eq=False)
class Plan:
    units: list
    held_bytes: int = 0  # frontier tensors autograd would not keep: held for the recompute
    rng_bytes: int = 0  # generator snapshots kept per random node and forward, for the replay

    @property
    def bytes_freed(self):
        return sum(u.bytes_freed for u in self.units) - self.rng_bytes

    @property
    def recompute_flops(self):
        return sum(u.flops for u in self.units)

    def __str__(self):
        return format_plan(self)


def make_plan(gm, infos, saved_keys, forget_names=None):
    """Decide what to forget and how to bring each storage back.

    ``forget_names``: None to use the ``forget()`` marks in the forward, or node names to forget
    instead. The refusals (inputs, outputs, in-place ops) are raised by the appendix's checks.
    """
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    units = storage_units(nodes, infos)
    marked = marked_nodes(nodes, infos, forget_names)
    forgotten = {}  # storage key -> the first marked name in it
    for m in marked:
        forgotten.setdefault(infos[m].key, m.name)
    check_forgettable(forgotten, nodes, infos, units)

    def is_kept(n):
        info = infos[n]
        if n.op in ("placeholder", "get_attr"):
            return True
        if not info.is_tensor:  # sizes, ints, None: stashing the Python value costs nothing
            return not info.holds_tensors
        if info.key in forgotten:
            return False
        return info.key in saved_keys or any(m.op in ("placeholder", "get_attr")
                                             for m in units[info.key])  # fmt: skip

    # A recompute that reads another forgotten storage reads its recomputed value, not its ops
    # again: forgetting fc1's output and the GELU of it runs fc1 once, not once per storage.
    roots = {units[key][0] for key in forgotten}
    plan_units, held = [], {}
    for key, name in forgotten.items():
        root = units[key][0]
        sub, frontier = recompute_subgraph(
            root, lambda m: is_kept(m) or (m in roots and m is not root)
        )
        sub = sorted(sub, key=position.get)
        deps = sorted((f for f in frontier if f in roots), key=position.get)
        frontier = sorted((f for f in frontier if f not in roots), key=position.get)
        check_recomputable(name, sub, frontier, nodes, infos)
        held.update(held_for_recompute(frontier, infos, saved_keys, units))
        unit = ForgottenUnit(
            name=root.name, members=[n.name for n in units[key] if n.target is not forget],
            root=root, nodes=sub, frontier=frontier, deps=deps, shape=infos[root].layout[1],
            nbytes=infos[root].nbytes, saved=key in saved_keys,
            flops=sum(infos[n].flops for n in sub), aten_ops=sum(infos[n].aten_ops for n in sub),
            bytes_written=sum(infos[n].bytes_written for n in sub),
            op_flops=[(n.name, infos[n].flops) for n in sub],
            random_nodes=[n.name for n in sub if infos[n].random or graph_random(gm, n)],
        )  # fmt: skip
        warn_if_expensive(unit, name, infos)
        plan_units.append(unit)
    plan_units.sort(key=lambda u: position[u.root])  # dependencies first
    return Plan(plan_units, held_bytes=sum(held.values()), rng_bytes=rng_bytes(plan_units, infos))


# -------------------------------------------------------------------------------------------------
# 3. The runtime: two saved-tensor hooks and one forward that frees as it goes
# -------------------------------------------------------------------------------------------------


def rng_snapshot(device):
    """(CPU state, CUDA state or None, device): what a random op draws from, copied."""
    # .clone(): get_rng_state allocates outside the dispatcher, so memory meters would miss the
    # snapshot a forward keeps per random node; they see the copy (and the plan counts it)
    cuda = torch.cuda.get_rng_state(device).clone() if device.type == "cuda" else None
    return torch.get_rng_state().clone(), cuda, device


@contextlib.contextmanager
def replayed_rng(snapshot):
    """Run the body with the generators as in ``snapshot`` (None: as they are), then restore."""
    if snapshot is None:
        yield
        return
    cpu, cuda, device = snapshot
    with torch.random.fork_rng(devices=[device] if cuda is not None else []):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


@dataclass(eq=False)
class LiveStorage:
    """One forgotten storage in one forward: what its recompute reads, and the recomputed value."""

    unit: ForgottenUnit
    gm: fx.GraphModule
    owner: nn.Module  # the TensorCheckpoint, which counts recomputations
    layout: tuple = None  # (dtype, shape, stride, offset, storage bytes) of the root in forward
    inputs: dict = field(default_factory=dict)  # frontier node -> value kept for the recompute
    versions: dict = field(default_factory=dict)  # frontier node -> its _version after forward
    rng: dict = field(default_factory=dict)  # random node -> rng_snapshot before it ran
    deps: dict = field(default_factory=dict)  # root -> LiveStorage of a forgotten storage it reads
    handles: int = 0  # saved tensors autograd holds on this storage
    uses: int = 0  # handles, plus recomputes of other forgotten storages that read it
    pending: int = 0  # uses still to come in this backward
    value: torch.Tensor = None  # the recomputed root, alive while a gradient still needs it

    def recompute(self):
        """The root of this storage: recomputed on first use, then the cached value."""
        # hint: dependencies first (their recompute()), ops under torch.no_grad() and with the
        # forward's generator state; count self.owner.recomputations; release what you read
        ### BEGIN SOLUTION
        if self.value is None:
            check_unchanged(self)
            env = dict(self.inputs)
            env.update({root: dep.recompute() for root, dep in self.deps.items()})
            with torch.no_grad():
                for n in self.unit.nodes:
                    with replayed_rng(self.rng.get(n)):
                        env[n] = run_node(self.gm, n, env)
            self.value = env[self.unit.root]
            check_layout(self)
            self.owner.recomputations += 1
            for dep in self.deps.values():
                dep.release()
        return self.value
        ### END SOLUTION

    def release(self):
        self.pending -= 1
        if self.pending <= 0:  # the last gradient that needs it has it: let the storage go
            self.value, self.pending = None, self.uses  # (a retained graph recomputes once more)


@dataclass(eq=False, slots=True)
class Packed:
    """What autograd stores per saved tensor: the tensor, or a handle into a forgotten storage."""

    tensor: torch.Tensor  # kept: the tensor, detached; None once it is a handle
    version: int  # its _version when saved (autograd's in-place check, which hooks switch off)
    storage: LiveStorage = None  # a handle: the forgotten storage it lives in...
    geometry: tuple = None  # ...and where in it: (dtype, size, stride, storage offset)

    def forget(self, storage):
        t, self.tensor, self.storage = self.tensor, None, storage
        self.geometry = (t.dtype, t.size(), t.stride(), t.storage_offset())
        storage.handles += 1
        return self


@dataclass(eq=False)
class ForwardCall:
    """One forward's bookkeeping, shared by the two hooks."""

    storages: dict  # root node -> LiveStorage, one per forgotten storage
    by_key: dict = field(default_factory=dict)  # storage_key -> (weakref(storage), LiveStorage)
    frontier: dict = field(default_factory=dict)  # kept node -> its value, read by a recompute
    rng: dict = field(default_factory=dict)  # random node -> rng_snapshot
    opening: list = None  # Packed made while a forgotten root's own op runs

    def live_storage(self, t):
        """The LiveStorage that ``t`` lives in, or None if ``t`` is kept."""
        if not self.by_key or t.layout != torch.strided:
            return None
        storage = t.untyped_storage()
        entry = self.by_key.get((t.device, storage.data_ptr()))
        # A forgotten storage dies at its last use in forward; a later tensor may reuse its address.
        return entry[1] if entry is not None and entry[0]() is storage else None


def pack_hook(call, t):
    """Saved-tensor pack hook: a handle for a tensor in a forgotten storage, else the tensor."""
    # hint: call.live_storage(t) says which; an op that saves its own output (softmax) packs it
    # before its root is registered, so keep those in call.opening to turn into handles later
    ### BEGIN SOLUTION
    packed = Packed(t.detach(), t._version)  # detached: a pack result must not reference its input
    storage = call.live_storage(t)
    if storage is not None:
        return packed.forget(storage)
    if call.opening is not None:
        call.opening.append(packed)
    return packed
    ### END SOLUTION


def unpack_hook(packed):
    """Saved-tensor unpack hook: the kept tensor, or the saved alias over the recomputed storage."""
    # hint: no copy: torch.empty(0).set_(storage, offset, size, stride) builds a view of a storage
    ### BEGIN SOLUTION
    if packed.storage is None:
        check_version(packed)
        return packed.tensor
    root = packed.storage.recompute()
    dtype, size, stride, offset = packed.geometry
    view = torch.empty(0, dtype=dtype, device=root.device)
    view.set_(root.untyped_storage(), offset, size, stride)  # view, base, transpose: same storage
    packed.storage.release()
    return view
    ### END SOLUTION


def register_root(call, live, v):
    """``v`` is the first tensor of a forgotten storage: from now on saving it saves a handle."""
    live.layout = (v.dtype, tuple(v.shape), v.stride(), v.storage_offset(),
                   v.untyped_storage().nbytes())  # fmt: skip
    call.by_key[storage_key(v)] = (weakref.ref(v.untyped_storage()), live)
    for packed in call.opening:  # saved by v's own op before we knew v was forgotten
        if call.live_storage(packed.tensor) is live:
            packed.forget(live)
    call.opening = None


def run_forgetting(traced, inputs, owner):
    """One forward with the plan's storages forgotten: the runtime, end to end.

    Runs the traced graph node by node under the two hooks and drops each value after its last use,
    as FX's generated code does: a forgotten storage dies in forward once its last reader ran, and
    autograd holds only handles to it. Then each LiveStorage gets what its recompute reads.
    """
    call = ForwardCall({u.root: LiveStorage(u, traced.gm, owner) for u in traced.plan.units})
    env = dict(zip(traced.placeholders, inputs))
    with torch.autograd.graph.saved_tensors_hooks(functools.partial(pack_hook, call), unpack_hook):
        for n in traced.nodes:
            if n.op == "output":
                out = fx.node.map_arg(n.args[0], env.__getitem__)
                break
            if n.op != "placeholder":
                if n in traced.random:  # the generator as this op finds it, replayed in backward
                    call.rng[n] = rng_snapshot(_device_of(n, env))
                if n in call.storages:
                    call.opening = []  # its own op may save its output: see register_root
                env[n] = run_node(traced.gm, n, env)
            if n in traced.frontier:  # kept anyway (autograd saves it): a reference costs nothing
                v = env[n]
                call.frontier[n] = v.detach() if isinstance(v, torch.Tensor) else v
            if n in call.storages:
                register_root(call, call.storages[n], env[n])
            for m in traced.drop_after.get(n, ()):
                del env[m]
    # Hand over: latest storage first, so a storage's uses are complete before its deps are counted.
    for live in reversed(list(call.storages.values())):
        u = live.unit
        live.inputs = {f: call.frontier[f] for f in u.frontier}
        live.versions = {f: v._version for f, v in live.inputs.items()
                         if isinstance(v, torch.Tensor)}  # fmt: skip
        live.rng = {n: call.rng[n] for n in u.nodes if n in call.rng}
        live.uses += live.handles
        live.pending = live.uses
        live.deps = {d: call.storages[d] for d in u.deps} if live.uses else {}
        for dep in live.deps.values():
            dep.uses += 1
    # Every saved tensor references the hooks, hence `call`: empty it, so that each storage's state
    # (and what its recompute reads) dies with the last gradient that needs it.
    call.storages, call.by_key, call.frontier, call.rng = {}, {}, {}, {}
    return out


def _device_of(n, env):
    t = next(iter(_tensors_in([env[m] for m in n.all_input_nodes])), None)
    return t.device if t is not None else torch.device("cpu")


@dataclass(eq=False)
class Traced:
    """One mode's trace and plan, with what the runtime reads per node precomputed."""

    gm: fx.GraphModule
    plan: Plan
    nodes: list = None
    placeholders: list = None
    frontier: set = None  # nodes some recompute reads
    random: set = None  # random nodes inside some recompute
    drop_after: dict = None  # node -> the values whose last reader it is

    def __post_init__(self):
        self.nodes = list(self.gm.graph.nodes)
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.frontier = {f for u in self.plan.units for f in u.frontier}
        self.random = {n for u in self.plan.units for n in u.nodes if n.name in u.random_nodes}
        self.drop_after, seen = {}, set()
        for n in reversed(self.nodes):
            for m in n.all_input_nodes:
                if m not in seen:
                    seen.add(m)
                    self.drop_after.setdefault(n, []).append(m)


def mode_of(module):
    """Every submodule's ``training`` flag: a trace freezes Python values read from them."""
    return tuple(m.training for m in module.modules())


class TensorCheckpoint(nn.Module):
    """``module`` with its plan's tensors forgotten after forward (one plan per train/eval mode).

    A mode first met in forward is traced on that call's inputs. Without gradients nothing is saved,
    so the module itself runs.
    """

    def __init__(self, module, trace_and_plan):
        super().__init__()
        self.module = module
        self.recomputations = 0  # recompute subgraphs run (one per forgotten storage per backward)
        self._trace_and_plan = trace_and_plan  # inputs -> Traced, for the module's current mode
        self._traced, self._last = {}, None  # mode_of(module) -> Traced; the last one used

    def traced_for(self, inputs):
        mode = mode_of(self.module)
        if mode not in self._traced:
            self._traced[mode] = self._trace_and_plan(inputs)
        self._last = self._traced[mode]
        return self._last

    @property
    def plan(self):
        return self._last.plan

    @property
    def gm(self):
        return self._last.gm

    def forward(self, *inputs):
        if not torch.is_grad_enabled():
            return self.module(*inputs)
        traced = self.traced_for(inputs)
        if not traced.plan.units:
            return self.module(*inputs)
        check_input_count(traced.placeholders, inputs)
        return run_forgetting(traced, inputs, self)


def checkpoint_tensors(module, example_inputs, forget=None, leaf_modules=()):
    """Trace ``module`` on ``example_inputs``; return it with its marked tensors forgotten.

    ``forget``: None to use the ``forget()`` marks in the forward, or a list of FX node names to
    forget instead (try annotations without editing the model). ``leaf_modules``: module classes FX
    should not trace into. The result shares ``module``'s parameters; ``.plan`` says what happens.
    """

    def trace_and_plan(inputs):
        check_example_inputs(inputs)
        gm = trace(module, leaf_modules)
        with buffers_kept(module):  # the example run must not move BatchNorm's statistics
            infos, saved_keys = profile(gm, tuple(inputs))
        return Traced(gm, make_plan(gm, infos, saved_keys, forget))

    ckpt = TensorCheckpoint(module, trace_and_plan)
    ckpt.traced_for(tuple(example_inputs))
    return ckpt


# ---- appendix: agreement guard, validation, plan printing, byte/FLOP accounting, set-up, demo ----


# Agreement guard: data-parallel replicas must start from the same model, inputs and settings.


def agree_across_ranks(fields, error=None, group=None):
    """All ranks run this before their first collective: every rank must hold the same ``fields``.

    ``fields``: {name: value} of what must agree (shapes, dtypes, hyperparameters, a digest of the
    initial parameters). ``error``: this rank's failed local validation, if any; it travels in the
    same gather, so every rank raises it and none is left waiting in a collective. On a mismatch
    every rank raises the same ValueError naming the field and which ranks hold which value.
    """
    canon = {k: repr(v) for k, v in fields.items()}
    digest = hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (digest, canon, error), group=group)
    failed = [f"rank {r}: {e}" for r, (_, _, e) in enumerate(gathered) if e]
    if failed:
        raise ValueError("tensor_ckpt: local checks failed on " + "; ".join(failed))
    if len({d for d, _, _ in gathered}) == 1:
        return digest
    problems = []
    for key in sorted(set().union(*(c for _, c, _ in gathered))):
        holders = {}
        for r, (_, c, _) in enumerate(gathered):
            holders.setdefault(c.get(key, "<missing>"), []).append(r)
        if len(holders) > 1:
            parts = [
                f"rank {','.join(map(str, rs))} {'have' if len(rs) > 1 else 'has'} "
                f"{v if len(v) <= 80 else v[:77] + '...'}"
                for v, rs in holders.items()
            ]
            problems.append(f"{key} differs across ranks: " + ", ".join(parts))
    raise ValueError("tensor_ckpt: " + "; ".join(problems))


def replica_fields(module, example_inputs, settings):
    """What data-parallel replicas must share: input layout, parameters, their initial values."""
    params = [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    values = hashlib.sha256()
    for p in module.parameters():  # exact, unlike a sum: any differing bit changes the digest
        values.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    tensors = _tensors_in(example_inputs)
    return {
        "example input shapes": [tuple(t.shape) for t in tensors],
        "example input dtypes": [str(t.dtype) for t in tensors],
        "parameter shapes and dtypes": hashlib.sha256(repr(params).encode()).hexdigest()[:16],
        "initial parameter values (sha256)": values.hexdigest()[:16],
        "train/eval mode": module.training,
        **settings,
    }


def checkpoint_data_parallel(module, example_inputs, settings, group=None, **kwargs):
    """checkpoint_tensors on every rank, then the agreement guard, then DDP (when world > 1).

    ``settings``: hyperparameters that must agree (lr, steps...). A rank whose plan is refused still
    joins the guard carrying its error, so every rank raises it.
    """
    ckpt, error = None, None
    try:
        ckpt = checkpoint_tensors(module, example_inputs, **kwargs)
    except ValueError as err:
        error = str(err)
    fields = replica_fields(module, example_inputs, settings)
    if ckpt is not None:
        fields["forgotten tensors"] = [u.name for u in ckpt.plan.units]
    agree_across_ranks(fields, error, group)
    if dist.get_world_size(group) == 1:
        return ckpt
    device = _tensors_in(example_inputs)[0].device  # from the data, never from the backend's name
    ids = [device] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(ckpt, device_ids=ids, process_group=group)


# Validation: each refusal names the tensor and the fix.


def untraceable(module, err):
    return ValueError(
        f"tensor_ckpt: torch.fx cannot trace {type(module).__name__}: {err}\n"
        "Data-dependent Python control flow (an `if`/`while` on tensor values, len() of a tensor) "
        "has no graph form. Fix: move that code into its own nn.Module and pass its class in "
        "leaf_modules=(ThatModule,) so it runs as one opaque node, or express the branch with "
        "tensor ops (torch.where)."
    )


def check_input_count(placeholders, inputs):
    if len(inputs) != len(placeholders):
        raise ValueError(
            f"tensor_ckpt: expected {len(placeholders)} inputs "
            f"({[n.name for n in placeholders]}), got {len(inputs)}"
        )


def check_example_inputs(inputs):
    empty = [tuple(t.shape) for t in _tensors_in(inputs) if t.numel() == 0]
    if empty:
        raise ValueError(
            f"tensor_ckpt: an example input is empty (shape {empty[0]}): an empty batch allocates "
            "no storage, so nothing can be planned. Trace with a batch of at least one sample."
        )


def marked_nodes(nodes, infos, forget_names):
    """The nodes to forget: the arguments of the forget() marks, or the nodes named."""
    if forget_names is None:
        marked = [n.args[0] for n in nodes if n.op == "call_function" and n.target is forget]
    else:
        by_name = {n.name: n for n in nodes}
        unknown = [name for name in forget_names if name not in by_name]
        if unknown:
            raise ValueError(
                f"tensor_ckpt: no node named {unknown} in the traced graph; "
                f"names are: {[n.name for n in nodes if infos[n].is_tensor]}"
            )
        marked = [by_name[name] for name in forget_names]
    for m in marked:
        if not isinstance(m, fx.Node) or not infos[m].is_tensor:
            raise ValueError(f"tensor_ckpt: forget() needs a tensor, got {m!r}")
        if infos[m].nbytes == 0:
            raise ValueError(
                f"tensor_ckpt: cannot forget '{m.name}': it was empty in the example run, so its "
                "storage cannot be told apart. Trace with a non-empty batch."
            )
    return marked


def check_forgettable(forgotten, nodes, infos, units):
    """Refuse forgetting an input/parameter alias, a module output, a tensor changed in place."""
    output_keys = {infos[a].key for a in nodes[-1].all_input_nodes if infos[a].is_tensor}
    for key, name in forgotten.items():
        source = [n.name for n in units[key] if n.op in ("placeholder", "get_attr")]
        if source:
            raise ValueError(
                f"tensor_ckpt: cannot forget '{name}': it shares storage with the input/parameter "
                f"'{source[0]}', which stays alive anyway. Forget a tensor computed in forward."
            )
        if key in output_keys:
            raise ValueError(
                f"tensor_ckpt: cannot forget '{name}': it is (or shares storage with) an output of "
                "the module, which the caller holds. Remove forget() there; forget it where it is "
                "consumed instead."
            )
        writers = [n.name for n in nodes if key in infos[n].mutates]
        if writers:
            raise ValueError(
                f"tensor_ckpt: cannot forget '{name}': the in-place op '{writers[0]}' modifies it, "
                "so no single value can be recomputed. Use the out-of-place op (e.g. x = x + y, "
                "F.relu(x) instead of x.add_(y), F.relu(x, inplace=True))."
            )


def check_recomputable(name, sub, frontier, nodes, infos):
    """Refuse a recompute that would apply an in-place op twice or read a value changed later."""
    for n in sub:
        if infos[n].mutates:
            raise ValueError(
                f"tensor_ckpt: cannot recompute '{name}': its recompute subgraph contains "
                f"'{n.name}', which modifies a tensor in place (running it again would apply it "
                "twice). Make that op out-of-place, or forget a tensor after it."
            )
        writers = [w.name for w in nodes if infos[n].is_tensor and infos[n].key in infos[w].mutates]
        if writers:  # FX records the op but not that later readers see its effect
            raise ValueError(
                f"tensor_ckpt: cannot recompute '{name}': it is computed from '{n.name}', which "
                f"the in-place op '{writers[0]}' modifies, an order the traced graph does not "
                "record. Make that op out-of-place."
            )
    start = nodes.index(sub[0])
    for f in frontier:
        if infos[f].is_tensor:
            late = [n.name for n in nodes[start:] if infos[f].key in infos[n].mutates]
            if late:
                raise ValueError(
                    f"tensor_ckpt: cannot recompute '{name}': it reads '{f.name}', which the "
                    f"in-place op '{late[0]}' modifies later in forward, so backward would see "
                    "the modified value. Make that op out-of-place."
                )


def warn_if_expensive(unit, marked, infos):
    """A cheap forget can pull a matmul or attention into backward: say which, and its cost."""
    costly = [(n.name, infos[n].flops) for n in unit.nodes if infos[n].flops and n.name != marked]
    if costly:
        ops = ", ".join(f"'{op}' ({flops_text(fl)})" for op, fl in costly)
        warnings.warn(
            f"tensor_ckpt: forgetting '{marked}' recomputes {ops} in every backward: its storage, "
            "or a tensor its recompute needs, is not kept by autograd (a view of an op's output "
            "shares that output's storage). Forget a tensor computed after it, or keep it.",
            stacklevel=4,
        )


def check_unchanged(live):
    for n, v in live.inputs.items():
        if isinstance(v, torch.Tensor) and v._version != live.versions[n]:
            raise RuntimeError(
                f"tensor_ckpt: '{n.name}', read to recompute forgotten '{live.unit.name}', was "
                "modified in place after forward; its gradient would be wrong. Do not modify it "
                "before backward."
            )


def check_layout(live):
    v = live.value
    layout = (v.dtype, tuple(v.shape), v.stride(), v.storage_offset(), v.untyped_storage().nbytes())
    if layout != live.layout:
        raise RuntimeError(
            f"tensor_ckpt: recomputed '{live.unit.name}' has layout {layout}, "
            f"forward had {live.layout}"
        )


def check_version(packed):
    """Saved-tensor hooks switch off autograd's check for in-place changes; keep it."""
    t = packed.tensor
    if t._version != packed.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: a tensor of shape {tuple(t.shape)} is at version {t._version}; expected "
            f"version {packed.version} (tensor_ckpt keeps autograd's check)"
        )


@contextlib.contextmanager
def buffers_kept(module):
    """Run the body, then put every buffer back (running statistics, num_batches_tracked)."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


# Randomness read from the graph. A node is random if the example run moved the generator OR the
# graph says it can draw: a dropout whose p or flag changes after tracing (p = 0 draws nothing in
# the example run) must still replay its mask. Marking a node random costs one snapshot.
_RANDOM_FUNCTIONS = {
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
    F.rrelu, torch.dropout, torch.bernoulli, torch.rand, torch.randn, torch.randint,
    torch.rand_like, torch.randn_like, torch.randint_like, torch.normal, torch.multinomial,
    torch.randperm, torch.poisson, F.scaled_dot_product_attention,
}  # fmt: skip
_RANDOM_METHODS = {"bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_",
                   "geometric_", "cauchy_", "log_normal_"}  # fmt: skip
_RANDOM_MODULES = (nn.modules.dropout._DropoutNd, nn.RReLU)


def graph_random(gm, node):
    """Whether ``node`` can draw from the generator, read from the graph alone."""
    if node.op == "call_method":
        return node.target in _RANDOM_METHODS
    if node.op == "call_module":
        return any(isinstance(m, _RANDOM_MODULES) for m in gm.get_submodule(node.target).modules())
    if node.op != "call_function" or node.target not in _RANDOM_FUNCTIONS:
        return False
    if node.target is F.scaled_dot_product_attention:
        return node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0) != 0.0
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    return training is not False  # F.dropout(x, p, training=False) is the identity


def rng_bytes(units, infos):
    """Bytes of the generator snapshots one forward keeps: one per random node in a recompute."""
    random = {n for u in units for n in u.nodes if n.name in u.random_nodes}
    cpu = torch.device("cpu")
    total = 0
    for n in random:
        device = infos[n].key[0] if infos[n].is_tensor else cpu
        total += sum(s.nbytes for s in rng_snapshot(device)[:2] if s is not None)
    return total


def held_for_recompute(frontier, infos, saved_keys, units):
    """{storage key: bytes} of frontier tensors autograd would not keep: held for the recompute."""
    held = {}
    for f in frontier:
        info = infos[f]
        if info.is_tensor and info.key not in saved_keys:
            if not any(m.op == "get_attr" for m in units.get(info.key, ())):
                held[info.key] = info.nbytes
    return held


# Plan printing and byte/FLOP accounting.


def format_plan(plan):
    """The plan as a table: per forgotten storage, what is freed and what backward runs again."""
    rng = f", generator snapshots of {_mib(plan.rng_bytes)} deducted" if plan.rng_bytes else ""
    held = f"; {_mib(plan.held_bytes)} held for recompute" if plan.held_bytes else ""
    lines = [
        f"tensor_ckpt plan: {len(plan.units)} forgotten storages, {_mib(plan.bytes_freed)} freed "
        f"per forward{rng}{held}",
        f"  recomputed per backward: {flops_text(plan.recompute_flops)} in matmul/attention, "
        f"{sum(u.aten_ops for u in plan.units)} aten ops writing "
        f"{_mib(sum(u.bytes_written for u in plan.units))}",
    ]
    lines.append(
        f"  {'forgotten (aliases)':<30} {'shape':<16} {'freed':>10} {'matmul FLOP':>11} "
        f"{'aten ops':>8} {'written':>10}  recompute ops <- from kept (* = forgotten, shared)"
    )
    for u in plan.units:
        aliases = ", ".join(m for m in u.members if m != u.name)
        label = u.name + (f" ({aliases})" if aliases else "")
        freed = _mib(u.bytes_freed) if u.saved else "0 (unsaved)"
        ops = ", ".join(
            f"{name}" + (f"[{flops_text(fl)}]" if fl else "")
            for name, fl in u.op_flops
            if not name.startswith("forget")  # the marks are identities
        )
        kept = ", ".join([f.name for f in u.frontier] + [d.name + "*" for d in u.deps])
        rng = f"  [generator replayed: {', '.join(u.random_nodes)}]" if u.random_nodes else ""
        lines.append(
            f"  {label[:30]:<30} {str(tuple(u.shape)):<16} {freed:>10} {flops_text(u.flops):>11} "
            f"{u.aten_ops:>8} {_mib(u.bytes_written):>10}  {ops} <- {kept}{rng}"
        )
    return "\n".join(lines)


def flops_text(flops):
    """FLOPs with a unit that keeps small counts visible (3.1 kFLOP, not 0.0 MFLOP)."""
    for unit, scale in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.1f} {unit}"
    return f"{flops:.0f} FLOP"


def _mib(b):
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 or b == 0 else f"{b / 2**10:.1f} KiB"


# FlopCounterMode has no formula for the CPU flash-attention kernel; it is the GPU kernels' math.
def _cpu_attention_flops(q, k, v, *args, out_shape=None, **kwargs):
    return flop_counter.sdpa_flop_count(q, k, v)


def _cpu_attention_backward_flops(grad_out, q, k, v, *args, out_shape=None, **kwargs):
    return flop_counter.sdpa_backward_flop_count(grad_out, q, k, v)


_CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        _cpu_attention_backward_flops
    ),
}


def count_flops():
    """A FlopCounterMode (matmul, attention, conv FLOPs) that also counts attention on CPU."""
    return flop_counter.FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION_FLOPS)


class OpCounter(TorchDispatchMode):
    """aten ops run, and bytes of the storages they allocate: the work FLOP formulas leave out."""

    def __init__(self):
        super().__init__()
        self.ops = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors_in((args, kwargs))}
        self.ops += 1
        self.bytes += sum(t.untyped_storage().nbytes() for t in _tensors_in(out)
                          if t.untyped_storage().data_ptr() not in inputs)  # fmt: skip
        return out


class LiveStorages(TorchDispatchMode):
    """Measure, not model: remember each storage an op creates; ``live_bytes()`` sums the living."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors_in((args, kwargs))}
        self.refs += [
            weakref.ref(t.untyped_storage())
            for t in _tensors_in(out)
            if t.untyped_storage().data_ptr() not in inputs
        ]  # views allocate nothing
        return out

    def live_bytes(self):
        alive = {id(s): s.nbytes() for s in (r() for r in self.refs) if s is not None}
        return sum(alive.values())


def activation_bytes(model, *inputs):
    """Bytes made by one forward and alive after it: what the autograd graph holds for backward."""
    with LiveStorages() as live:
        out = model(*inputs)
    held = live.live_bytes() - sum(t.untyped_storage().nbytes() for t in _tensors_in(out))
    return held, out


def backward_work(loss):
    """(matmul/attention FLOPs, aten ops, bytes allocated) of ``loss.backward()``."""
    with count_flops() as counter, OpCounter() as ops:
        loss.backward()
    return counter.get_total_flops(), ops.ops, ops.bytes


# ---- set-up: the same block in every technique file, copied so each file stands alone ----


def choose_backend(backend=None, device=None):
    """Pick (backend, device type) for this launch and say why, in one line.

    Defaults: NCCL on CUDA when every local rank can have a GPU of its own, else gloo on the CPU.
    gloo with --device cuda lets several ranks share a GPU (a one-GPU machine can run N = 4).
    Refuses combinations that cannot work, before any process group exists.
    """
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"--backend must be gloo or nccl, got {backend!r}")
    if device is None:
        device = "cuda" if backend != "gloo" and 0 < local_ranks <= gpus else "cpu"
        if device == "cuda":
            why = f"{gpus} GPU(s) for {local_ranks} local rank(s)"
        elif backend == "gloo" or gpus == 0:
            why = "--backend gloo" if backend == "gloo" else "no GPU visible"
        else:
            why = f"{gpus} GPU(s) are too few for {local_ranks} local ranks"
    else:
        why = f"--device {device}"
    if device == "cuda" and gpus == 0:
        raise ValueError("--device cuda: no CUDA GPU is visible; pass --device cpu")
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if backend == "nccl" and device != "cuda":
        raise ValueError("--backend nccl moves only CUDA tensors: pass --device cuda, or gloo")
    if backend == "nccl" and local_ranks > gpus:
        raise ValueError(
            f"NCCL needs one GPU per local rank: {local_ranks} ranks, {gpus} GPU(s); "
            "launch fewer ranks, or pass --backend gloo to share GPUs"
        )
    return backend, device, f"backend {backend}, device {device} ({why})"


def setup(backend=None, device=None, seed=0, timeout_s=120):
    """Join torchrun's process group, or make a group of one when run as plain `python FILE`.

    Returns (rank, world_size, device). The CUDA device is set before the group is created, so
    NCCL binds each rank to its own GPU.
    """
    backend, device_type, why = choose_backend(backend, device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count() if device_type == "cuda" else 1
    dev = torch.device("cuda", local_rank % gpus) if device_type == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ:  # launched by torchrun: its environment carries the rendezvous
        dist.init_process_group(
            backend, timeout=timeout, device_id=dev if backend == "nccl" else None
        )
    else:  # plain `python FILE`: a group of one, no network
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    torch.manual_seed(seed)
    if dist.get_rank() == 0:
        print(f"[setup] {dist.get_world_size()} rank(s), {why}", flush=True)
    return dist.get_rank(), dist.get_world_size(), dev


def teardown():
    """Collect cycles that hold communicators, then destroy the group (torch warns otherwise)."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


# Demo: a transformer block stack with V4-style marks, trained data-parallel.


class Block(nn.Module):
    """Pre-norm transformer layer, marked V4-style: forget what is large and cheap, keep matmuls."""

    def __init__(self, dim, n_heads, mlp_ratio=4):
        super().__init__()
        self.n_heads = n_heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, mlp_ratio * dim), nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        h = forget(self.norm1(x))  # one pass over x to redo; x is kept by the norm
        qkv = self.qkv(h).view(B, T, 3, self.n_heads, C // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, nh, T, hs) each
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # Not forgotten: this reshape is a view of the attention output (the kernels lay it out
        # so), and a view shares its base's storage: forgetting it would recompute attention.
        y = y.transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        h = forget(self.norm2(x))
        h = forget(F.gelu(self.fc1(h)))  # 4x wide; GELU is redone from fc1's output
        return x + self.fc2(h)


class TinyLM(nn.Module):
    def __init__(self, vocab=64, dim=128, n_heads=4, n_layers=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*[Block(dim, n_heads) for _ in range(n_layers)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.norm(self.blocks(self.embed(tokens))))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Tensor-level activation checkpointing (V4 §3.4.4): plan, exactness and "
        "memory checks, then data-parallel training of a small LM with V4-style forget() marks.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--dim", type=int, default=128, help="model width, a multiple of --heads")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers")
    parser.add_argument("--vocab", type=int, default=64, help="vocabulary size")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="process-group backend (default: nccl with one GPU per rank, "
                        "else gloo)")  # fmt: skip
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="device of model and data (default: cuda when the backend is nccl "
                        "or GPUs suffice, else cpu)")  # fmt: skip
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "seq", "dim", "heads", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.vocab < 2:
        parser.error(f"--vocab must be >= 2, got {args.vocab}")
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim} is not a multiple of --heads {args.heads}")
    if not (args.lr > 0 and args.lr < float("inf")):
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    try:
        choose_backend(args.backend, args.device)
    except ValueError as err:
        parser.error(str(err))
    return args


def main(argv=None):
    args = parse_args(argv)  # every argument checked before any work
    rank, world, device = setup(args.backend, args.device, seed=0)
    try:
        demo(args, rank, world, device)
    finally:
        teardown()


def demo(args, rank, world, device):
    start = time.perf_counter()

    def say(stage, text):
        if rank == 0:
            print(f"[{stage}, {time.perf_counter() - start:.1f} s] {text}", flush=True)

    model = TinyLM(args.vocab, args.dim, args.heads, args.layers).to(device)
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own data shard

    def batch_of_tokens():  # a sequence that follows a fixed rule, so the loss can fall
        first = torch.randint(0, args.vocab, (args.batch, 1), generator=gen)
        return ((first + 7 * torch.arange(args.seq + 1)) % args.vocab).to(device)

    def loss_of(fn, tokens):
        logits = fn(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    tokens = batch_of_tokens()
    settings = {k: getattr(args, k) for k in ("steps", "batch", "seq", "dim", "heads", "layers",
                                               "vocab", "lr")}  # fmt: skip
    train = checkpoint_data_parallel(model, (tokens[:, :-1],), settings)  # guard, then DDP
    ckpt = train.module if world > 1 else train
    say("plan", f"traced on each rank's first batch; all ranks agree on it\n{ckpt.plan}")

    # Exactness: the same batch through the plain model and the checkpointed one. CUDA's fused
    # attention backward is not deterministic; the math kernel is.
    math = torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)
    grads, work = [], []
    with math if device.type == "cuda" else contextlib.nullcontext():
        for fn in (model, ckpt):
            model.zero_grad(set_to_none=True)
            work.append(backward_work(loss_of(fn, tokens)))
            grads.append([p.grad.clone() for p in model.parameters()])
    exact = all(torch.equal(a, b) for a, b in zip(*grads))
    say("exactness", f"gradients bitwise equal to the plain model: {exact}")
    plain_bytes, _ = activation_bytes(model, tokens[:, :-1])
    ckpt_bytes, _ = activation_bytes(ckpt, tokens[:, :-1])
    say("memory", f"activations alive after forward (measured): plain {_mib(plain_bytes)}, "
        f"tensor_ckpt {_mib(ckpt_bytes)}, saved {_mib(plain_bytes - ckpt_bytes)} "
        f"(plan: {_mib(ckpt.plan.bytes_freed)})")  # fmt: skip
    (f0, o0, b0), (f1, o1, b1) = work
    added = f"{flops_text(f1 - f0)}, {o1 - o0} more aten ops, {_mib(b1 - b0)} more allocated"
    say("recompute", f"backward work added by tensor_ckpt (measured): matmul/attention {added}")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    t0 = time.perf_counter()
    for step in range(args.steps):
        loss = loss_of(train, batch_of_tokens())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            say("train", f"step {step:3d}  loss on rank 0's batch {loss.item():.4f}")
    say("done", f"{args.steps} steps on {world} rank(s), {device.type}: "
        f"{time.perf_counter() - t0:.2f} s, {ckpt.recomputations} recompute subgraphs run in "
        "backward")  # fmt: skip
    del train, ckpt, opt  # DDP holds gloo state: free it before the group goes


if __name__ == "__main__":
    main()
