"""Tensor-level activation checkpointing: say what to forget, not how to recompute it (V4 §3.4.4).

What the standard tool assumes. `torch.utils.checkpoint` works on whole functions: a region is
dropped after forward and runs again in backward. Selective activation checkpointing (SAC) refines
that per operator type, but the unit is still a region you wrap and an op-level policy you write.

What V4 violates. In every V4 layer the expensive and the cheap sit side by side: matmul outputs
are worth keeping, while norm outputs, activation outputs and reshaped copies are large and nearly
free to redo. Which *tensor* to keep is the decision, and it cuts across module boundaries.

The fix. Mark tensors inside an ordinary forward with `forget(x)`. A TorchFX trace, run once on
example inputs so storage identities are known, finds for each forgotten storage the minimal
subgraph that recomputes it from what autograd keeps anyway (a view and its base are one storage).
At run time saved-tensor hooks store a handle instead of the storage; the first gradient that needs
it reruns the subgraph (with the forward's generator state) and rebuilds every saved alias as a
view of the one recomputed storage. What cannot be recomputed exactly is refused, with the fix.
What a forward does besides computing happens once per call, as in the plain model: buffer updates
(a norm's statistics, an EMA) are graph nodes the recompute never re-applies, the module's hooks run
around the graph; what a trace would freeze (a draw from Python's random, a hook inside a traced
module) is refused.
Under torch.compile the same plan becomes the compiler's recompute policy.

    model = checkpoint_tensors(MarkedLayer(dim, heads), (x,))  # its forward calls forget(...)
    print(model.plan)  # per forgotten tensor: recompute ops, their cost, bytes freed
    torch.compile(model)  # forgets the same tensors: the partitioner recomputes them

    python tensor_ckpt.py                                          # one process
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 tensor_ckpt.py   # data parallel, CPU/gloo
    torchrun --nproc_per_node=8 tensor_ckpt.py     # GPUs: NCCL, one GPU per rank, chosen for you
"""

import argparse
import contextlib
import contextvars
import functools
import inspect
import operator
import os
import random
import sys
import time
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree  # torch has no public pytree (flatten nested arguments)
from torch.utils import flop_counter
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import interop.fx_models as fx_models  # forwards FX cannot take as they are
import launch


# ---- 1. Mark a tensor, trace the forward, run it once on examples --------------------------------
def forget(x):
    """Mark ``x`` to be freed after forward and recomputed in backward. Identity when run eagerly.

    Under the FX trace it records a ``forget`` node, whichever module calls it (so it checks for a
    Proxy rather than relying on ``torch.fx.wrap``'s per-module name patching)."""
    # hint: under tracing x is an fx.Proxy; its tracer can create a call_function node
    ### BEGIN SOLUTION
    if isinstance(x, fx.Proxy):
        return x.tracer.create_proxy("call_function", forget, (x,), {})
    return x
    ### END SOLUTION


class Tracer(fx.Tracer):
    """FX's tracer: ``leaf_modules`` run as one node, ``trace_into`` torch.nn classes opened."""

    proxy_buffer_attributes = True  # a buffer updated in place (a running mean) becomes a node

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        value = super().getattr(attr, attr_val, parameter_proxy_cache)
        if isinstance(value, fx.Proxy) and not isinstance(attr_val, nn.Parameter):
            value.__class__ = in_place(type(value))  # `self.count += 1` stays in place
        return value

    def __init__(self, leaf_modules=(), trace_into=()):
        super().__init__()
        self.leaf_modules, self.trace_into = tuple(leaf_modules), tuple(trace_into)

    def is_leaf_module(self, m, qualname):
        if isinstance(m, self.leaf_modules) or isinstance(m, self.trace_into):
            return isinstance(m, self.leaf_modules)
        return super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as err:
            err.inside = getattr(err, "inside", None) or (self.path_of_module(m), type(m))
            raise


@functools.cache
def in_place(proxy_class):
    """``proxy_class`` recording ``+=`` and its kin as the in-place op a tensor runs (FX records
    ``x = x + y``, which would update a buffer at trace time only)."""
    ops = {
        f"__i{name}__": getattr(operator, f"i{name}") for name in ("add", "sub", "mul", "truediv")
    }
    methods = {
        name: lambda self, other, op=op: self.tracer.create_proxy(
            "call_function", op, (self, other), {}
        )
        for name, op in ops.items()
    }
    return type("InPlace" + proxy_class.__name__, (proxy_class,), methods)


def trace(module, tracer=None, root=None):
    """Trace ``module`` into a GraphModule sharing its parameters. ``tracer``: an fx.Tracer
    (default ``Tracer()``); ``root``: what it traces in the module's place (checkpoint_tensors'
    adapter: the module with a forward that takes one tensor per placeholder). A tracer with
    ``knows_shapes`` set ran Python on shapes knowing the examples': ``gm.meta["shapes"]`` says
    the graph then holds for those shapes only. checkpoint_tensors hands it a RefusingTracer,
    which refuses what the trace would freeze (a draw from Python's random, a hook run once)."""
    tracer = tracer or Tracer()
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # attention's inference path branches on shapes
    try:
        graph = tracer.trace(module if root is None else root)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    gm = fx.GraphModule(module, graph, class_name=type(module).__name__ + "Traced")
    gm.meta["shapes"] = getattr(tracer, "knows_shapes", False)
    return gm


def run_node(root, node, env):
    """Execute one FX node: inputs from ``env`` (node -> value), attributes from ``root``."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
    if node.meta.get("statistics") and RECOMPUTING.get():  # updated once, in the forward
        args, kwargs = (), {**inspect.signature(node.target).bind(*args, **kwargs).arguments}
        kwargs.update(running_mean=None, running_var=None)  # training: the batch's statistics
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    value = functools.reduce(getattr, node.target.split("."), root)  # read now: replacements seen
    return value(*args, **kwargs) if node.op == "call_module" else value  # else get_attr


RECOMPUTING = contextvars.ContextVar("recomputing", default=False)  # see LiveStorage.as_in_forward
NORMS = (F.batch_norm, F.instance_norm)  # in training their output ignores the running statistics


@contextlib.contextmanager
def recomputing():
    token = RECOMPUTING.set(True)
    try:
        yield
    finally:
        RECOMPUTING.reset(token)


def tensors_in(value):  # the tensors in a (nested) tuple, list or dict
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def storage_key(t):  # the memory a tensor lives in, shared by its views
    return (t.device, t.untyped_storage().data_ptr())


def geometry_of(t):  # where a tensor sits in its storage
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())


def count_flops():
    """A FlopCounterMode (matmul, attention, conv FLOPs), with CPU attention counted as on GPUs."""

    def forward(q, k, v, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_flop_count(q, k, v)

    def backward(grad, q, k, v, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_backward_flop_count(grad, q, k, v)

    aten = torch.ops.aten
    cpu = {  # the CPU kernels SDPA dispatches to: FlopCounterMode maps only the CUDA ones
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
    }
    return flop_counter.FlopCounterMode(display=False, custom_mapping=cpu)


def rng_snapshot(where):
    """Copies of (CPU state, CUDA state or None, device), for a device or ``where``'s tensors."""
    first = next((t.device for t in tensors_in(where)), torch.device("cpu"))
    device = where if isinstance(where, torch.device) else first
    cuda = torch.cuda.get_rng_state(device).clone() if device.type == "cuda" else None
    return torch.get_rng_state().clone(), cuda, device


def random_states():  # Python's generator, and NumPy's when it is loaded: no recompute replays them
    numpy = sys.modules.get("numpy")
    return random.getstate(), numpy.random.get_state() if numpy else None


def comparable(states):  # NumPy's state holds an array: compared by its bytes
    py, np = states
    return py, np and (np[0], np[1].tobytes(), *np[2:])


def set_random_states(states):
    random.setstate(states[0])
    if states[1] is not None:
        sys.modules["numpy"].random.set_state(states[1])


@contextlib.contextmanager
def put_back(states):  # Python's and NumPy's generators set back after the block, as fork_rng's
    try:
        yield
    finally:
        set_random_states(states)


_RANDOM = set(
    "bernoulli bernoulli_ rand randn randint rand_like randn_like randint_like normal normal_ "
    "uniform_ multinomial poisson randperm rrelu random_ exponential_ geometric_ cauchy_ "
    "log_normal_".split()
)


def is_statistics(node, env, changed):
    """Whether ``node`` is a norm whose in-place changes (``changed``) are its running statistics
    only: recomputed, it runs without them (run_node), so they are updated once."""
    if node.op != "call_function" or node.target not in NORMS:
        return False
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
    arguments = inspect.signature(node.target).bind(*args, **kwargs).arguments
    stats = {arguments.get("running_mean"), arguments.get("running_var")} - {None}
    return all(any(t is v for v in stats) for t in changed)


def can_draw(root, node):
    """Whether ``node`` may draw random numbers, read from the graph: a dropout traced at p = 0
    draws nothing in the example run, yet must replay its mask once p is raised."""
    if node.op == "call_module":  # a dropout or RReLU anywhere inside the module
        modules = functools.reduce(getattr, node.target.split("."), root).modules()
        dropout = nn.modules.dropout._DropoutNd  # every dropout's base: torch exports no public one
        return any(isinstance(m, (dropout, nn.RReLU)) for m in modules)
    if node.target is F.scaled_dot_product_attention:
        return node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0) != 0.0
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    random = node.op in ("call_function", "call_method") and ("dropout" in name or name in _RANDOM)
    return random and node.kwargs.get("training", (node.args + (1, 1, 1))[2]) is not False


@dataclass
class NodeInfo:
    """What the example run learned about one node."""

    is_tensor: bool = False
    key: tuple = None  # storage identity (tensors only)
    nbytes: int = 0  # bytes of the whole storage
    geometry: tuple = None  # (dtype, size, stride, storage_offset)
    flops: int = 0  # matmul / attention / conv FLOPs of this op (FlopCounterMode)
    random: bool = False  # it moved the generator, or the graph says it can draw
    mutates: tuple = ()  # storage keys it modified in place (args, module params/buffers)
    statistics: bool = False  # a norm whose only in-place change is to its running statistics
    draws_python: bool = False  # it drew from Python's or NumPy's generator: no replay
    holds_tensors: bool = False  # a tuple/list with tensors in it (split, unbind, module outputs)


def profile(gm, example_inputs):
    """Run ``gm`` once, node by node: a NodeInfo per node, and the storage keys autograd saved.
    Every value stays alive during the run, so one address means one storage. Every generator
    (torch's, Python's, NumPy's) is put back after it."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    device, saved, host = rng_snapshot(example_inputs)[2], [], random_states()
    last = comparable(host)
    buffers = {storage_key(b) for b in gm.buffers()}  # kernels may change them unversioned
    infos, env = {nodes[-1]: NodeInfo()}, dict(zip(placeholders, example_inputs))

    pack = lambda t: saved.append(t.detach()) or saved[-1]  # noqa: E731 (learns what is saved)
    fork = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
    with fork, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), put_back(host):
        for n in nodes[:-1]:  # the last node is the output
            info = infos[n] = NodeInfo()
            if n.op != "placeholder":
                touched = tensors_in(fx.node.map_arg((n.args, n.kwargs), env.__getitem__))
                called = gm.get_submodule(n.target) if n.op == "call_module" else nn.Module()
                touched += [*called.parameters(), *called.buffers()]
                # _version, autograd's in-place counter: torch has no public way to read it
                versions, rng = [t._version for t in touched], rng_snapshot(device)
                values = [t.clone() if storage_key(t) in buffers else t for t in touched]
                with count_flops() as flops:
                    env[n] = run_node(gm, n, env)
                info.flops, moved = flops.get_total_flops(), zip(rng[:2], rng_snapshot(device)[:2])
                info.random = can_draw(gm, n) or any(
                    a is not None and not torch.equal(a, b) for a, b in moved
                )
                info.draws_python, last = (now := comparable(random_states())) != last, now
                changed = [  # batch_norm updates its running statistics without a version bump
                    t
                    for t, v, c in zip(touched, versions, values)
                    if t._version != v or (c is not t and not torch.equal(c, t))
                ]
                info.mutates = tuple({storage_key(t) for t in changed})
                info.statistics = n.meta["statistics"] = bool(changed) and is_statistics(
                    n, env, changed
                )
            if isinstance(env[n], torch.Tensor):
                info.is_tensor, info.key = True, storage_key(env[n])
                info.geometry = geometry_of(env[n])
                info.nbytes = env[n].untyped_storage().nbytes()
            else:
                info.holds_tensors = bool(tensors_in(env[n]))
    return infos, {storage_key(t) for t in saved}


# ---- 2. The plan: one minimal recompute subgraph per forgotten storage ---------------------------
def storage_units(nodes, infos):
    """Group tensor nodes by the storage they live in: {key: [nodes in execution order]}.

    A view, its base, an unbind/split of it, a reshape that did not copy: one unit, one recompute.
    Empty tensors (no bytes) belong to no unit: they all share the null address."""
    ### BEGIN SOLUTION
    units = {}
    for n in nodes:
        if infos[n].is_tensor and infos[n].nbytes > 0:  # empty tensors share the null pointer
            units.setdefault(infos[n].key, []).append(n)
    return units
    ### END SOLUTION


def recompute_subgraph(root, is_kept):
    """The minimal set of nodes that recomputes ``root`` from kept values.

    Walks inputs backward from ``root`` (through every node on the way, not only root's direct
    inputs) and stops at every node for which ``is_kept(node)`` holds. Returns ``(nodes,
    frontier)``: the nodes to re-run (``root`` included) and the kept nodes they read, both as
    sets; order them by graph position to execute."""
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
    members: list  # names of every node living in this storage (views, reshapes)
    root: fx.Node
    nodes: list  # recompute subgraph, in execution order (root last)
    frontier: list  # kept nodes the subgraph reads (their values are stashed)
    deps: list  # roots of other forgotten storages it reads (recomputed once, shared)
    shape: tuple
    nbytes: int  # bytes of the storage
    saved: bool  # autograd saves it (otherwise forgetting it frees nothing)
    op_flops: list  # [(node name, matmul/attention FLOPs in the example run)] per recomputed op
    random_nodes: list  # ops whose generator state is replayed

    bytes_freed = property(lambda self: self.nbytes if self.saved else 0)
    flops = property(lambda self: sum(f for _, f in self.op_flops))


@dataclass(eq=False)
class Plan:
    """What to forget, and what the runtime reads per node of the traced graph ``gm``."""

    units: list
    held_bytes: int  # frontier tensors autograd would not keep: held for the recompute
    rng_bytes: int  # generator snapshots kept per random node and forward, for the replay
    gm: fx.GraphModule
    marked: list  # the nodes forget() marked or names= named (an unknown name as a string)

    def __post_init__(self):
        self.nodes = list(self.gm.graph.nodes)
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.frontier = {f for u in self.units for f in u.frontier}  # read by some recompute
        self.random = {n for u in self.units for n in u.nodes if n.name in u.random_nodes}
        self.drop_after, seen = {}, set()  # node -> the values whose last reader it is
        for n in reversed(self.nodes):
            self.drop_after[n] = [m for m in n.all_input_nodes if m not in seen]
            seen.update(self.drop_after[n])
        members = {name for u in self.units for name in u.members}
        recomputed = {n for u in self.units for n in u.nodes} | {
            n for n in self.nodes if n.name in members
        }  # what torch.compile recomputes: every op re-run, every alias
        self.tagged = tagged_graph(self.gm, recomputed) if self.units else None

    bytes_freed = property(lambda self: sum(u.bytes_freed for u in self.units) - self.rng_bytes)
    recompute_flops = property(lambda self: sum(u.flops for u in self.units))

    def __str__(self):  # the table: see plan_table
        return plan_table(self)


def make_plan(gm, infos, saved_keys, names=None):
    """What to forget (the ``forget()`` marks, or the nodes ``names``) and how to bring each
    storage back. A recompute reads another forgotten storage's recomputed value, not its ops.
    What cannot be recomputed exactly is refused by the door's guard, shown the plan in plan_for."""
    nodes = list(gm.graph.nodes)
    position, by_storage = {n: i for i, n in enumerate(nodes)}, storage_units(nodes, infos)
    by_name = {n.name: n for n in nodes}  # an unknown name stays a string, for check() to refuse
    marked = (
        [n.args[0] for n in nodes if n.op == "call_function" and n.target is forget]
        if names is None
        else [by_name.get(name, name) for name in names]
    )
    forgotten = {}  # storage key -> the first name marked in it (no storage: check() refuses it)
    for m in marked:
        if isinstance(m, fx.Node) and infos[m].key in by_storage:
            forgotten.setdefault(infos[m].key, m.name)
    params = {k for k, ms in by_storage.items() if any(m.op == "get_attr" for m in ms)}
    kept_keys = saved_keys | params | {k for k, m in by_storage.items() if m[0].op == "placeholder"}

    def is_kept(n):  # inputs, parameters, what autograd saves; Python values cost nothing to stash
        if n.op in ("placeholder", "get_attr") or not infos[n].is_tensor:
            return n.op in ("placeholder", "get_attr") or not infos[n].holds_tensors
        return infos[n].key not in forgotten and infos[n].key in kept_keys

    roots, unit_of, held = {by_storage[key][0] for key in forgotten}, {}, {}
    for key in forgotten:
        root = by_storage[key][0]
        others = roots - {root}  # forgotten too: their recomputed value is read, once
        sub, frontier = recompute_subgraph(root, lambda m: is_kept(m) or m in others)
        saved = key in saved_keys
        unit = forgotten_unit(root, by_storage[key], sub, frontier, roots, position, infos, saved)
        unit_of[key] = unit
        for f in unit.frontier:  # a tensor autograd would not keep: held for this recompute alone
            if infos[f].is_tensor and infos[f].key not in saved_keys | params:
                held[infos[f].key] = infos[f].nbytes
    units = sorted(unit_of.values(), key=lambda u: position[u.root])  # dependencies first
    snapshots = [
        rng_snapshot(infos[n].key[0] if infos[n].is_tensor else torch.device("cpu"))
        for n in {n for u in units for n in u.nodes if infos[n].random}
    ]
    rng_bytes = sum(s.nbytes for snap in snapshots for s in snap[:2] if s is not None)
    plan = Plan(units, sum(held.values()), rng_bytes, gm, marked)
    warn_costly(unit_of, forgotten, infos)
    return plan


def forgotten_unit(root, members, sub, frontier, roots, position, infos, saved):
    """One forgotten storage's recompute: the subgraph ``sub`` in graph order, the frontier it
    reads split into other forgotten roots (deps) and kept values; ``saved``: autograd saves it."""
    deps, frontier = (
        sorted((f for f in frontier if (f in roots) == dep), key=position.get)
        for dep in (True, False)
    )
    sub = sorted(sub, key=position.get)
    return ForgottenUnit(
        name=root.name,
        members=[n.name for n in members if n.target is not forget],
        root=root,
        nodes=sub,
        frontier=frontier,
        deps=deps,
        shape=infos[root].geometry[1],
        nbytes=infos[root].nbytes,
        saved=saved,
        op_flops=[(n.name, infos[n].flops) for n in sub],
        random_nodes=[n.name for n in sub if infos[n].random],
    )


def warn_costly(unit_of, forgotten, infos):
    """Allowed, but worth a line: a forget that pulls a matmul into every backward."""
    for key, name in forgotten.items():  # storage key -> the name marked in it
        if matmuls := [n for n in unit_of[key].nodes if infos[n].flops and n.name != name]:
            ops = ", ".join(f"'{n.name}' ({flops_text(infos[n].flops)})" for n in matmuls)
            warnings.warn(
                f"tensor_ckpt: forgetting '{name}' recomputes {ops} in every backward: its "
                "storage, or a tensor its recompute needs, is not kept by autograd (a view of "
                "an op's output shares that output's storage). Forget a tensor computed after "
                "it, or keep it.",
                stacklevel=6,
            )


# ---- 3. The runtime: one forward that frees as it goes, two saved-tensor hooks -------------------
def run_forgetting(plan, inputs, owner):
    """One forward with the plan's storages forgotten: the runtime, end to end. Each value dies
    after its last use, as in FX's generated code, so autograd holds only handles to forgotten
    storages; then each LiveStorage gets what its recompute reads."""
    autocast = autocast_state()  # the recompute re-enters it
    call = ForwardCall({u.root: LiveStorage(u, owner, autocast) for u in plan.units})
    env = dict(zip(plan.placeholders, inputs))
    with torch.autograd.graph.saved_tensors_hooks(functools.partial(pack_hook, call), unpack_hook):
        for n in plan.nodes[:-1]:  # the last node is the output
            if n.op != "placeholder":
                if n in plan.random:  # the generator as this op finds it, replayed in backward
                    call.rng[n] = rng_snapshot([env[m] for m in n.all_input_nodes])
                if n in call.storages:
                    call.opening = []  # its own op may save its output: see register_root
                env[n] = run_node(owner.module, n, env)
            if n in plan.frontier:  # kept anyway (autograd saves it): a reference costs nothing
                call.frontier[n] = env[n].detach() if isinstance(env[n], torch.Tensor) else env[n]
            if n in call.storages:
                call.register_root(call.storages[n], env[n])
            for m in plan.drop_after[n]:
                del env[m]
    out = fx.node.map_arg(plan.nodes[-1].args[0], env.__getitem__)
    # Hand over: latest storage first, so a storage's uses are complete before its deps are counted.
    for live in reversed(list(call.storages.values())):
        u = live.unit
        live.inputs = {f: call.frontier[f] for f in u.frontier}
        live.versions = {
            f: v._version for f, v in live.inputs.items() if isinstance(v, torch.Tensor)
        }
        live.rng = {n: call.rng[n] for n in u.nodes if n in call.rng}
        live.pending = live.uses = live.uses + live.handles
        live.deps = {d: call.storages[d] for d in u.deps} if live.uses else {}
        for dep in live.deps.values():
            dep.uses += 1
    # Every saved tensor references the hooks, hence `call`: empty it, so that each storage's state
    # (and what its recompute reads) dies with the last gradient that needs it.
    call.storages, call.by_key, call.frontier, call.rng = {}, {}, {}, {}
    return out


def autocast_state():  # (device type, enabled, dtype) per device, as torch.utils.checkpoint keeps
    devices = ("cpu", "cuda")
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices)


@dataclass(eq=False)
class ForwardCall:
    """One forward's bookkeeping, shared by the two hooks."""

    storages: dict  # root node -> LiveStorage, one per forgotten storage
    by_key: dict = field(default_factory=dict)  # storage_key -> (weakref(storage), LiveStorage)
    frontier: dict = field(default_factory=dict)  # kept node -> its value, read by a recompute
    rng: dict = field(default_factory=dict)  # random node -> rng_snapshot
    opening: list = None  # Packed made while a forgotten root's own op runs

    def live_storage(self, t):  # the LiveStorage t lives in, or None: t is kept
        if not self.by_key or t.layout != torch.strided:
            return None
        entry = self.by_key.get(storage_key(t))  # is it still alive, or a new one at its address?
        return entry[1] if entry is not None and entry[0]() is t.untyped_storage() else None

    def register_root(self, live, v):
        """``v`` is a forgotten storage's first tensor: from now on saving it saves a handle."""
        live.geometry = (*geometry_of(v), v.untyped_storage().nbytes())
        self.by_key[storage_key(v)] = (weakref.ref(v.untyped_storage()), live)
        for packed in self.opening:  # saved by v's own op before we knew v was forgotten
            if self.live_storage(packed.tensor) is live:
                packed.to_handle(live)
        self.opening = None


@dataclass(eq=False, slots=True)
class Packed:
    """What autograd stores per saved tensor: the tensor, or a handle into a forgotten storage."""

    tensor: torch.Tensor  # kept: the tensor, detached; None once it is a handle
    version: int  # its _version when saved (autograd's in-place check, which hooks switch off)
    storage: "LiveStorage" = None  # a handle: the forgotten storage it lives in...
    geometry: tuple = None  # ...and where in it: (dtype, size, stride, storage offset)

    def to_handle(self, storage):
        t, self.tensor, self.storage = self.tensor, None, storage
        self.geometry = (t.dtype, t.size(), t.stride(), t.storage_offset())
        storage.handles += 1
        return self

    def kept(self):  # after autograd's own check that nothing changed it in place
        if (t := self.tensor)._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: shape {tuple(t.shape)}, version {t._version}, expected "
                f"{self.version} (autograd's check, kept)"
            )
        return t


def pack_hook(call, t):
    """Saved-tensor pack hook: a handle for a tensor in a forgotten storage, else the tensor."""
    # hint: call.live_storage(t) says which; an op that saves its own output (softmax) packs it
    # before its root is registered, so keep those in call.opening to turn into handles later
    ### BEGIN SOLUTION
    packed = Packed(t.detach(), t._version)  # detached: a pack result must not reference its input
    storage = call.live_storage(t)
    if storage is not None:
        return packed.to_handle(storage)
    if call.opening is not None:
        call.opening.append(packed)
    return packed
    ### END SOLUTION


def unpack_hook(packed):
    """Saved-tensor unpack hook: the kept tensor, or the saved alias rebuilt as a view of the one
    recomputed storage (no copy); then release the handle."""
    # hint: no copy: torch.empty(0).set_(storage, offset, size, stride) builds a view of a storage
    ### BEGIN SOLUTION
    if packed.storage is None:
        return packed.kept()
    root = packed.storage.recompute()
    dtype, size, stride, offset = packed.geometry
    view = torch.empty(0, dtype=dtype, device=root.device)
    view.set_(root.untyped_storage(), offset, size, stride)  # view, base, transpose: same storage
    packed.storage.release()
    return view
    ### END SOLUTION


@contextlib.contextmanager
def replayed_rng(snapshot):
    """Run the body with the generators as in ``snapshot`` (None: as they are), then restore."""
    cpu, cuda, device = snapshot or (None, None, None)
    with torch.random.fork_rng([device] if cuda is not None else [], enabled=snapshot is not None):
        if snapshot is not None:
            torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


@dataclass(eq=False)
class LiveStorage:
    """One forgotten storage in one forward: what its recompute reads, and the recomputed value."""

    unit: ForgottenUnit
    owner: nn.Module  # the TensorCheckpoint: its module runs the ops, it counts recomputations
    autocast: tuple  # (device type, enabled, dtype) of the forward, re-entered by the recompute
    geometry: tuple = None  # (dtype, shape, stride, offset, storage bytes) of the root in forward
    inputs: dict = field(default_factory=dict)  # frontier node -> value kept for the recompute
    versions: dict = field(default_factory=dict)  # frontier node -> its _version after forward
    rng: dict = field(default_factory=dict)  # random node -> rng_snapshot before it ran
    deps: dict = field(default_factory=dict)  # root -> LiveStorage of a forgotten storage it reads
    handles: int = 0  # saved tensors autograd holds on this storage
    uses: int = 0  # handles, plus recomputes of other forgotten storages that read it
    pending: int = 0  # uses still to come in this backward
    value: torch.Tensor = None  # the recomputed root, alive while a gradient still needs it

    def check_inputs(self):
        if changed := [n for n, v in self.versions.items() if self.inputs[n]._version != v]:
            raise RuntimeError(
                f"tensor_ckpt: '{changed[0].name}', read to recompute forgotten "
                f"'{self.unit.name}', was modified in place after forward; its gradient would be "
                "wrong. Do not modify it before backward."
            )

    def check_geometry(self, v):  # a recompute that ran otherwise than the forward did
        if (geometry := (*geometry_of(v), v.untyped_storage().nbytes())) != self.geometry:
            raise RuntimeError(
                f"tensor_ckpt: recomputed '{self.unit.name}' has geometry {geometry}, forward had "
                f"{self.geometry}"
            )

    def as_in_forward(self):  # no_grad, autocast as in forward (torch.utils.checkpoint does too)
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(recomputing())  # a norm's running statistics are not updated again
        for device, enabled, dtype in self.autocast:
            stack.enter_context(torch.autocast(device, dtype, enabled=enabled))
        return stack

    def recompute(self):
        """The root of this storage: recomputed on first use, then the cached value."""
        # hint: dependencies first (their recompute()), ops under self.as_in_forward() and with
        # the forward's generator state; count self.owner.recomputations; release what you read
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
            self.check_geometry(self.value)
            self.owner.recomputations += 1
            for dep in self.deps.values():
                dep.release()
        return self.value
        ### END SOLUTION

    def release(self):
        self.pending -= 1
        if self.pending <= 0:  # the last gradient that needs it has it: let the storage go
            self.value, self.pending = None, self.uses  # (a retained graph recomputes once more)


# ---- 4. The module: one plan per frozen state, and data-parallel replicas ------------------------
def frozen_values(module):
    """What a trace may have frozen into the graph: the plain attributes of every submodule
    (``training``, a dropout's ``p``) and of the objects they hold (a config)."""
    plain = (bool, int, float, str, type(None), torch.dtype, torch.device)

    def is_plain(v):
        return isinstance(v, plain) or (isinstance(v, (tuple, list)) and all(map(is_plain, v)))

    state, seen = [], set()
    for name, m in module.named_modules():
        held = [v for v in vars(m).values() if hasattr(v, "__dict__") and not callable(v)]
        for obj in [m, *(v for v in held if not isinstance(v, (nn.Module, torch.Tensor)))]:
            if id(obj) not in seen:
                seen.add(id(obj))
                state += [(name, k, repr(v)) for k, v in vars(obj).items() if is_plain(v)]
    return tuple(state)


# nn.Module's own hook dicts: no public API lists a module's hooks or pauses them
HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def hooks_of(m):  # the ids of a module's forward and backward hooks, one tuple
    return tuple(k for d in HOOKS for k in getattr(m, d, {}))


def hooked(module):
    """(name, hook ids) of every submodule with hooks, the root left out (its hooks run around the
    call): part of the plan's key, so a hook added or removed after tracing is seen."""
    return tuple((name, ids) for name, m in module.named_modules() if name and (ids := hooks_of(m)))


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


NOT_FULLGRAPH = (
    "tensor_ckpt looks up the plan for each call in Python, one graph break before the compiled "
    "forgetting: compile it without fullgraph=True"
)
GRAPH_BREAKS = {}  # function -> the same, run in Python (a graph break) under torch.compile


def eagerly(fn):  # torch.compiler.disable loads Dynamo: made when first asked, not at import
    if fn not in GRAPH_BREAKS:
        GRAPH_BREAKS[fn] = torch.compiler.disable(fn, reason=NOT_FULLGRAPH)
    return GRAPH_BREAKS[fn]


class TensorCheckpoint(nn.Module):
    """``module`` with its plan's tensors forgotten; one plan per key (the values a trace may have
    frozen, the autocast state, and the input shapes where the trace read them), traced on the
    first call with that key, so a stale graph never runs. Without gradients the module runs."""

    def __init__(self, module, root, flatten, tracer, names):
        super().__init__()
        self.module, self.recomputations = module, 0  # recompute subgraphs run, over all backwards
        self.root, self.flatten, self.tracer = root, flatten, tracer  # checkpoint_tensors' door
        self.names, self.plans, self.knows_shapes = names, {}, False  # plan key -> Plan

    def plan_key(self, inputs):
        shapes = [(t.shape, t.dtype, t.device) for t in inputs] if self.knows_shapes else None
        hooks = hooked(self.module)  # a hook added or removed: planned anew
        return frozen_values(self.module), autocast_state(), shapes and tuple(shapes), hooks

    def plan_for(self, inputs):
        """The plan (``self.plan``) for this call's traced tensors ``inputs``, one per placeholder;
        traced now (``self.tracer(inputs)``) if none fits."""
        if (key := self.plan_key(inputs)) not in self.plans:
            buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
            try:
                gm = trace(self.module, self.tracer(inputs), self.root)
                with hooks_off(self.module):  # a hook's effects belong to real calls
                    infos, saved_keys = profile(gm, tuple(inputs))
            finally:  # the trace and the example run must not move BatchNorm's statistics
                for b, copy in buffers:
                    b.detach().copy_(copy)
            self.knows_shapes |= gm.meta["shapes"]
            plan = make_plan(gm, infos, saved_keys, self.names)
            check_plan(plan, infos)  # what cannot be recomputed exactly: one clear ValueError
            self.plans[key := self.plan_key(inputs)] = plan
        self.plan = self.plans[key]
        return self.plan

    def placed(self, args, kwargs):
        """A call's arguments as the trace's placeholders take them (``self.flatten``, the
        adapter's, entered here once per call), and their plan."""
        inputs = self.flatten(args, kwargs)
        return self.plan_for(inputs), inputs

    gm = property(lambda self: self.plan.gm)

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        plain = self.module.forward  # the module's hooks run around the traced graph, as its own
        run = functools.partial(self.forgetting, plain)
        return with_forward(self.module, lambda *args, **kwargs: run(args, kwargs), args, kwargs)

    def forgetting(self, plain, args, kwargs):  # the call, with the plan's tensors forgotten
        lookup = TensorCheckpoint.placed  # Python: under torch.compile, one graph break
        if torch.compiler.is_compiling():  # (so compile without fullgraph=True)
            lookup = eagerly(lookup)
        plan, inputs = lookup(self, args, kwargs)
        if not plan.units:
            return plain(*args, **kwargs)
        if torch.compiler.is_compiling():  # the compiler frees and recomputes: hand it the plan
            return compiled_forgetting(plan, inputs)
        return run_forgetting(plan, inputs, self)


def with_forward(module, forward, args, kwargs):
    """``module(*args, **kwargs)`` running ``forward`` instead of its own: its forward and
    backward hooks (and torch's global ones) run around it as on the plain module."""
    own = vars(module).get("forward")
    module.forward = forward
    try:
        return module(*args, **kwargs)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def checkpoint_tensors(
    module, example_inputs, names=None, leaf_modules=(), trace_into=(), concrete_args=None
):
    """Trace ``module`` on ``example_inputs``: forward's first arguments, or {argument name:
    value}, each a tensor or a tuple, list or dict of tensors. Return it with its marked tensors
    forgotten, or the FX nodes ``names`` (a model you cannot edit). ``leaf_modules`` run as one
    node, ``trace_into`` torch.nn classes are traced inside, ``concrete_args`` {name: value} fixes
    other arguments for every call. ``.plan`` says what happens."""
    # the FX adapter, settled here once: the path sees a plain root, flat tensors and a tracer
    # that refuses what a trace would freeze
    arguments = fx_models.Arguments(module, example_inputs, concrete_args)
    adapted = arguments.tracers(Tracer, leaf_modules, trace_into)  # examples -> a tracer

    def tracer(examples):  # one per trace, refusing what it would freeze
        return RefusingTracer(adapted(examples), module)

    ckpt = TensorCheckpoint(module, arguments.root(), arguments.flatten, tracer, names)
    ckpt.plan_for(arguments.examples)
    eagerly(TensorCheckpoint.placed)  # made here, not inside a Dynamo trace, which skips it
    return ckpt


def checkpoint_data_parallel(module, example_inputs, settings, group=None, **kwargs):
    """checkpoint_tensors on every rank, the agreement guard (``settings`` too; a refused rank
    joins it with its error, so every rank raises it), then DDP when world > 1. Agreed once, here:
    every later call checks only what is local (its arguments against the trace's)."""
    ckpt, error, tensors = None, None, tensors_in(example_inputs)
    try:
        ckpt = checkpoint_tensors(module, example_inputs, **kwargs)
    except ValueError as err:
        error = str(err).removeprefix("tensor_ckpt: ")
    digest = launch.weights_digest(module.named_parameters())
    agreed = {
        "example input shapes": [tuple(t.shape) for t in tensors],
        "example input dtypes": [str(t.dtype) for t in tensors],
        "initial parameter values (sha256 of names, shapes, dtypes, bytes)": digest,
        "train/eval mode": module.training,
        **settings,
        "forgotten tensors": [u.name for u in ckpt.plan.units] if ckpt is not None else None,
    }
    launch.agree(agreed, error, group, who="tensor_ckpt")
    if dist.get_world_size(group) == 1:
        return ckpt
    device = tensors[0].device  # from the data, never from the backend's name
    ids = [device] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(ckpt, device_ids=ids, process_group=group)


# ---- 5. Under torch.compile: the plan as the compiler's recompute policy -------------------------
def tagged_graph(gm, recomputed):
    """A copy of ``gm`` whose ``recomputed`` nodes run under ``fx.traceback.annotate``: under
    torch.compile the tag follows each of them to the aten ops it becomes."""
    graph, env = fx.Graph(), {}
    for n in gm.graph.nodes:
        if n not in recomputed or n.op not in ("call_function", "call_method", "call_module"):
            env[n] = graph.node_copy(n, env.__getitem__)
            continue
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
        if n.op == "call_module":  # the module itself, read when the graph runs
            args = (graph.get_attr(n.target), *args)
        env[n] = graph.call_function(tagged(n.op, n.target), args, kwargs)
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__ + "Tagged")


def tagged(op, target):  # one node's op, run under the tag recompute_policy reads
    def tagged_op(*args, **kwargs):
        with fx_traceback.annotate({"tensor_ckpt": "forget"}):
            if op == "call_function":
                return target(*args, **kwargs)
            if op == "call_method":
                return getattr(args[0], target)(*args[1:], **kwargs)
            return args[0](*args[1:], **kwargs)  # call_module

    return tagged_op


def recompute_policy(ctx, op, *args, **kwargs):
    """Selective checkpointing's choice per aten op: recompute what the plan forgets, save the
    rest. The compiler replays a recomputed random op's generator state itself."""
    tag = fx_traceback.current_meta.get("custom", {}).get("tensor_ckpt")
    return CheckpointPolicy.MUST_RECOMPUTE if tag == "forget" else CheckpointPolicy.MUST_SAVE


def compiled_forgetting(plan, inputs):
    """The plan as torch.compile runs it: the traced graph in one non-reentrant checkpoint whose
    policy marks the forgotten ops recompute; the partitioner then saves none of their storages
    and reruns them in the compiled backward."""
    policy = functools.partial(create_selective_checkpoint_contexts, recompute_policy)
    return checkpoint(plan.tagged, *inputs, use_reentrant=False, context_fn=policy)


# ---- appendix: the refusals, reading a plan (print(model.plan)), then the demo -------------------
#
# What cannot be recomputed exactly is refused, each refusal naming the tensor and the fix: the
# trace's own (RefusingTracer, which checkpoint_tensors hands the path), and the finished plan's
# (check_plan, after each planning), before any process group or backward sees it, so a mark that
# cannot be honoured is one clear ValueError instead of wrong gradients.


def check_plan(plan, infos):
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
        with_hooks = [f"{n.target}.{name}".rstrip(".") for name, m in called if hooks_of(m)]
        if changed or with_hooks or infos[n].draws_python:
            what = (
                f"updates '{changed[0]}' in place"
                if changed
                else f"runs the hooks of '{with_hooks[0]}'"
                if with_hooks
                else "draws from Python's or NumPy's generator, which no recompute replays"
            )
            norm = " (a torch.nn norm in trace_into=(...) updates its statistics once)"
            raise ValueError(
                f"tensor_ckpt: cannot forget '{unit.name}': its recompute re-runs '{n.name}', "
                f"which {what}; backward would do it a second time. Fix: forget a tensor "
                f"computed after it, or keep this one{norm if changed else ''}."
            )


# ---- what a trace would freeze, what a recompute would do twice ----------------------------------
PYTHON_RANDOM = {  # module -> functions a forward may draw from (numpy's only if it is loaded)
    "random": "random uniform randint randrange choice choices shuffle sample gauss "
    "normalvariate betavariate expovariate triangular getrandbits".split(),
    "numpy.random": "random rand randn randint uniform normal choice shuffle permutation "
    "binomial random_sample".split(),
}


class RefusingTracer:
    """A tracer (``tracer``: the adapter's) refusing what its trace of ``module`` would freeze:
    before it, a hook inside a module it runs through; after it, a draw from Python's or NumPy's
    generator, or a tensor of the module changed by code it ran instead of recording."""

    def __init__(self, tracer, module):
        self.tracer, self.module = tracer, module

    knows_shapes = property(lambda self: self.tracer.knows_shapes)  # ShapeFallback's

    def trace(self, root, concrete_args=None):
        refuse_hooks_traced_into(self.tracer, self.module)
        effects = SideEffects(self.module)
        self.tracer.excused = effects.excused  # a node the trace records runs in every call
        with effects.watching():
            graph = self.tracer.trace(root, concrete_args)
        effects.check()
        return graph


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

    def __init__(self, module):
        self.module, self.drawn, self.excuse = module, [], 0
        self.tensors = tensors_of(module)
        self.versions = [t._version for _, t in self.tensors]
        self.states = random_states()

    @contextlib.contextmanager
    def excused(self):
        versions = [t._version for _, t in self.tensors]
        self.excuse += 1
        try:
            with hooks_off(self.module), put_back(random_states()):
                yield
        finally:
            self.excuse -= 1
            after = [t._version for _, t in self.tensors]  # its own changes are no freeze
            self.versions = [v + a - b for v, a, b in zip(self.versions, after, versions)]

    def patched(self, where, name, fn):
        def watched(*args, **kwargs):
            if not self.excuse:
                caller = inspect.currentframe().f_back
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
        for mod, name, fn in patches:
            setattr(mod, name, self.patched(mod.__name__, name, fn))
        try:
            yield self
        finally:  # the generators and the module's tensors put back, whether the trace failed
            for mod, name, fn in patches:
                setattr(mod, name, fn)
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


def attribute_dicts(m):  # where nn.Module keeps an attribute (no public API says which)
    return m._parameters, m._buffers, vars(m)


# ---- reading a plan ------------------------------------------------------------------------------
def plan_table(plan):
    """The plan as a table: per forgotten storage, what is freed and what backward runs again."""
    rng_mib, held_mib = mib_text(plan.rng_bytes), mib_text(plan.held_bytes)
    snapshots = f", generator snapshots of {rng_mib} deducted" if plan.rng_bytes else ""
    held = f"; {held_mib} held for recompute" if plan.held_bytes else ""
    shapes = "; traced for these input shapes only" if plan.gm.meta.get("shapes") else ""
    lines = [
        f"tensor_ckpt plan: {len(plan.units)} forgotten storages, {mib_text(plan.bytes_freed)} "
        f"freed per forward{snapshots}{held}; recomputed per backward: "
        f"{flops_text(plan.recompute_flops)} in matmul/attention{shapes}",
        f"  {'forgotten (aliases)':<30} {'shape':<16} {'freed':>10} {'matmul FLOP':>11}  "
        "recompute ops <- from kept (* = forgotten, shared)",
    ]
    for u in plan.units:
        aliases = ", ".join(m for m in u.members if m != u.name)
        label = u.name + (f" ({aliases})" if aliases else "")
        freed = mib_text(u.bytes_freed) if u.saved else "0 (unsaved)"
        ops = ", ".join(
            name + (f"[{flops_text(fl)}]" if fl else "")
            for name, fl in u.op_flops
            if not name.startswith("forget")
        )
        kept = ", ".join([f.name for f in u.frontier] + [d.name + "*" for d in u.deps])
        replayed = f"  [generator replayed: {', '.join(u.random_nodes)}]" if u.random_nodes else ""
        lines.append(
            f"  {label[:30]:<30} {str(tuple(u.shape)):<16} {freed:>10} "
            f"{flops_text(u.flops):>11}  {ops} <- {kept}{replayed}"
        )
    return "\n".join(lines)


def flops_text(flops):  # a unit that keeps small counts visible (3.1 kFLOP, not 0.0 MFLOP)
    scale, unit = next(p for p in ((1e9, "G"), (1e6, "M"), (1e3, "k"), (0, "")) if flops >= p[0])
    return f"{flops / scale:.1f} {unit}FLOP" if scale else f"{flops:.0f} FLOP"


def mib_text(nbytes):  # MiB, or KiB below one MiB
    mib = nbytes >= 2**20 or nbytes == 0
    return f"{nbytes / 2**20:.2f} MiB" if mib else f"{nbytes / 2**10:.1f} KiB"


# ---- the demo: a transformer block stack with V4-style marks, trained data-parallel --------------
class MarkedLayer(nn.Module):
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
        # not forgotten: a view of attention's output (shared storage), so it would redo attention
        y = y.transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        h = forget(self.norm2(x))
        h = forget(F.gelu(self.fc1(h)))  # 4x wide; GELU is redone from fc1's output
        return x + self.fc2(h)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] + " The plan, gradients against the plain model, data-"
        "parallel training of a small LM. Measured: benchmarks/bench_tensor_ckpt.py",
    )
    one = launch.at_least(1)
    for name, kind, default, what in (
        ("steps", one, 30, "training steps"),
        ("batch", one, 8, "sequences per rank and step"),
        ("seq", one, 64, "tokens per sequence"),
        ("heads", one, 4, "attention heads"),
        ("dim", one, 128, "model width, a multiple of --heads"),
        ("layers", one, 4, "transformer layers"),
        ("vocab", launch.at_least(2), 64, "vocabulary"),
        ("lr", launch.positive, 3e-3, "AdamW learning rate"),
    ):
        parser.add_argument(
            f"--{name}", type=kind, default=default, help=f"{what} (default: {default})"
        )
    launch.add_launch_options(parser)
    args = parser.parse_args(argv)
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim} is not a multiple of --heads {args.heads}")
    return launch.check_launch_options(parser, args)


def demo(args, rank, world, device):
    blocks = nn.Sequential(*[MarkedLayer(args.dim, args.heads) for _ in range(args.layers)])
    model = nn.Sequential(
        OrderedDict(
            embed=nn.Embedding(args.vocab, args.dim),
            blocks=blocks,
            norm=nn.LayerNorm(args.dim),
            head=nn.Linear(args.dim, args.vocab),
        )
    ).to(device)
    agreed = {k: vars(args)[k] for k in "steps batch seq dim heads layers vocab lr".split()}
    gen = torch.Generator().manual_seed(1 + rank)

    def loss_of(fn):  # a shard per rank, following a fixed rule so the loss can fall
        first = torch.randint(0, args.vocab, (args.batch, 1), generator=gen)
        tokens = ((first + 7 * torch.arange(args.seq + 1)) % args.vocab).to(device)
        return F.cross_entropy(fn(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

    example = (torch.zeros(args.batch, args.seq, dtype=torch.long, device=device),)
    train = checkpoint_data_parallel(model, example, agreed)
    ckpt = train.module if world > 1 else train  # the guard agreed, then DDP wrapped it
    launch.say(f"[plan] all ranks agree on it\n{ckpt.plan}")
    math = torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)
    grads = []  # one batch through both; CUDA's fused attention backward is not deterministic
    with math if device.type == "cuda" else contextlib.nullcontext():
        for fn in (model, ckpt):
            gen.manual_seed(1 + rank)
            model.zero_grad(set_to_none=True)
            loss_of(fn).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
    launch.say(
        "[exactness] gradients bitwise equal to the plain model: "
        f"{all(torch.equal(a, b) for a, b in zip(*grads))}\n[memory] activation bytes saved "
        f"per forward: {ckpt.plan.bytes_freed / 2**20:.2f} MiB"
    )
    opt, start = torch.optim.AdamW(model.parameters(), lr=args.lr), time.perf_counter()
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        (loss := loss_of(train)).backward()
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:  # steps counted from 1, as everywhere
            launch.say(f"[train] step {step + 1:3d}  loss on rank 0's batch {loss.item():.4f}")
    launch.say(
        f"[done] {args.steps} steps on {world} rank(s), {device.type}: "
        f"{time.perf_counter() - start:.2f} s, {ckpt.recomputations} recompute subgraphs "
        "run in backward"
    )
    del train, ckpt, opt  # DDP holds gloo state: free it before the group goes


if __name__ == "__main__":
    launch.run(demo, parse_args())  # every argument checked before any process group
