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
it runs the subgraph (with the forward's generator state), every saved alias is rebuilt as a view
of the one recomputed storage, dropped after the last gradient that needs it. What cannot be
recomputed exactly (an input or output, a tensor an in-place op touches, untraceable code) is
refused with the tensor's name and the fix.

Reading order: forget -> trace -> profile -> make_plan (`recompute_subgraph`) -> `run_forgetting`
(with `pack_hook`, `unpack_hook`) -> `checkpoint_tensors` -> the demo. Below the fence: the
refusals and the plan table. Measured memory and recompute work: benchmarks/bench_tensor_ckpt.py.

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
import functools
import inspect
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

import launch

# ---- 1. Mark a tensor, trace the forward, run it once on examples -------------------------------


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
    """FX's tracer with two switches: ``leaf_modules`` run as one opaque node, ``trace_into`` opens
    torch.nn classes (FX keeps every torch.nn module a leaf). A failure records where it was."""

    def __init__(self, leaf_modules=(), trace_into=()):
        super().__init__()
        self.leaf_modules, self.trace_into = tuple(leaf_modules), tuple(trace_into)

    def is_leaf_module(self, m, qualname):
        return isinstance(m, self.leaf_modules) or (
            not isinstance(m, self.trace_into) and super().is_leaf_module(m, qualname)
        )

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as err:
            if not hasattr(err, "inside"):  # the innermost module is the one to name
                err.inside = (self.path_of_module(m), type(m))
            raise


def traced_arguments(module, concrete_args, n_inputs=None):
    """The names of forward's arguments a trace takes: the first ``n_inputs`` (default: those
    without a default) not fixed by ``concrete_args``; the rest keep their defaults."""
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.name not in concrete_args and p.kind in (p.POSITIONAL_ONLY,
                                                            p.POSITIONAL_OR_KEYWORD)]  # fmt: skip
    return [p.name for p in params if n_inputs is not None or p.default is p.empty][:n_inputs]


def trace(module, leaf_modules=(), trace_into=(), concrete_args=None, n_inputs=None):
    """Symbolically trace ``module`` into a GraphModule that shares its parameters.

    A forward FX cannot take as it is (``**kwargs``, a decorator, optional arguments that would
    become proxies, ``concrete_args`` {name: value} to fix) is traced through a generated forward
    of the same class and attributes, taking only ``traced_arguments`` and passing the fixed ones
    by keyword. The attention fast path (inference only, branching on shapes) is off meanwhile."""
    root, concrete_args, forward = module, dict(concrete_args or {}), type(module).forward
    code = forward.__code__
    varargs = code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)
    wrapped, arity = hasattr(forward, "__wrapped__"), code.co_argcount - 1
    if concrete_args or varargs or wrapped or n_inputs not in (None, arity):
        names = traced_arguments(module, concrete_args, n_inputs)
        scope = {"forward": forward, "fixed": concrete_args}
        call = ", ".join(f"{n}={n}" for n in names)
        exec(f"def bound(self, {', '.join(names)}):\n return forward(self, {call}, **fixed)", scope)
        cls = type(type(module).__name__, (type(module),), {"forward": scope["bound"]})
        root = object.__new__(cls)
        root.__dict__ = module.__dict__  # the same submodules, parameters, buffers and names
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        graph = Tracer(leaf_modules, trace_into).trace(root)
    except Exception as err:  # TraceError, or what a Proxy raises in len(), bool()...
        raise untraceable(module, err) from err
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    return fx.GraphModule(module, graph, class_name=type(module).__name__ + "Traced")


def run_node(root, node, env):
    """Execute one FX node: inputs from ``env`` (node -> value), attributes from ``root``."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op in ("call_module", "get_attr"):  # read now: a replaced attribute is seen
        value = functools.reduce(getattr, node.target.split("."), root)
        return value(*args, **kwargs) if node.op == "call_module" else value
    raise RuntimeError(f"run_node: unexpected node {node.op} {node.name}")


def storage_key(t):
    """Identity of the memory a tensor lives in: (device, data pointer), shared by views."""
    return (t.device, t.untyped_storage().data_ptr())


def layout_of(t):
    """Where ``t`` sits in its storage: (dtype, size, stride, storage offset)."""
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())


def _tensors_in(value):
    found = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


def count_flops():
    """A FlopCounterMode (matmul, attention, conv FLOPs), with CPU attention counted as on GPUs."""
    fwd, bwd = flop_counter.sdpa_flop_count, flop_counter.sdpa_backward_flop_count
    cpu = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
           lambda q, k, v, *a, out_shape=None, **kw: fwd(q, k, v),
           torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
           lambda g, q, k, v, *a, out_shape=None, **kw: bwd(g, q, k, v)}  # fmt: skip
    return flop_counter.FlopCounterMode(display=False, custom_mapping=cpu)


def rng_snapshot(device):
    """(CPU state, CUDA state or None, device): what a random op draws from, copied."""
    # .clone(): get_rng_state allocates outside the dispatcher, so a memory meter sees the copy
    cuda = torch.cuda.get_rng_state(device).clone() if device.type == "cuda" else None
    return torch.get_rng_state().clone(), cuda, device


_RANDOM = {"bernoulli", "bernoulli_", "rand", "randn", "randint", "rand_like", "randn_like",
           "randint_like", "normal", "normal_", "uniform_", "multinomial", "poisson", "randperm",
           "rrelu", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_"}  # fmt: skip


def can_draw(root, node):
    """Whether ``node`` may draw random numbers, read from the graph: a dropout traced at p = 0
    draws nothing in the example run, yet must replay its mask once p is raised."""
    if node.op == "call_module":
        module = functools.reduce(getattr, node.target.split("."), root)
        return any(
            isinstance(m, (nn.modules.dropout._DropoutNd, nn.RReLU)) for m in module.modules()
        )
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
    layout: tuple = None  # (dtype, size, stride, storage_offset)
    flops: int = 0  # matmul / attention / conv FLOPs of this op (FlopCounterMode)
    random: bool = False  # it moved the generator, or the graph says it can draw
    mutates: tuple = ()  # storage keys it modified in place (args, module params/buffers)
    holds_tensors: bool = False  # a tuple/list with tensors in it (split, unbind, module outputs)


def profile(gm, example_inputs):
    """Run ``gm`` once on ``example_inputs``, node by node, and record what the plan needs.

    Returns ``(infos, saved_keys)``: {node: NodeInfo} and the storage keys autograd saved for
    backward. Every value stays alive during the run, so one address means one storage."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    check_arity(placeholders, example_inputs)
    empty = [tuple(t.shape) for t in _tensors_in(example_inputs) if t.numel() == 0]
    if empty:
        raise ValueError(f"tensor_ckpt: an example input is empty (shape {empty[0]}): it allocates "
                         "no storage, so nothing can be planned. Trace with a batch of at least "
                         "one sample.")  # fmt: skip
    device = next((t.device for t in _tensors_in(example_inputs)), torch.device("cpu"))
    saved, infos, env = [], {}, dict(zip(placeholders, example_inputs))

    def pack(t):  # only to learn which storages autograd saves
        saved.append(t.detach())
        return t.detach()

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for n in nodes[:-1]:  # the last node is the output
                info = infos[n] = NodeInfo()
                if n.op != "placeholder":
                    touched = _tensors_in(fx.node.map_arg((n.args, n.kwargs), env.__getitem__))
                    if n.op == "call_module":
                        sub = gm.get_submodule(n.target)
                        touched += [*sub.parameters(), *sub.buffers()]
                    versions, rng = [t._version for t in touched], rng_snapshot(device)
                    with count_flops() as flops:
                        env[n] = run_node(gm, n, env)
                    info.flops = flops.get_total_flops()
                    moved = zip(rng[:2], rng_snapshot(device)[:2])
                    info.random = can_draw(gm, n) or any(
                        a is not None and not torch.equal(a, b) for a, b in moved)  # fmt: skip
                    info.mutates = tuple({storage_key(t) for t, v in zip(touched, versions)
                                          if t._version != v})  # fmt: skip
                value = env[n]
                if isinstance(value, torch.Tensor):
                    info.is_tensor, info.key = True, storage_key(value)
                    info.nbytes = value.untyped_storage().nbytes()
                    info.layout = layout_of(value)
                else:
                    info.holds_tensors = bool(_tensors_in(value))
    infos[nodes[-1]] = NodeInfo()
    return infos, {storage_key(t) for t in saved}


# ---- 2. The plan: one minimal recompute subgraph per forgotten storage --------------------------


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
    members: list  # every node living in this storage (views, reshapes)
    root: fx.Node
    nodes: list  # recompute subgraph, in execution order (root last)
    frontier: list  # kept nodes the subgraph reads (their values are stashed)
    deps: list  # roots of other forgotten storages it reads (recomputed once, shared)
    shape: tuple
    nbytes: int  # bytes of the storage
    saved: bool  # autograd saves it (otherwise forgetting it frees nothing)
    flops: int  # recompute matmul/attention FLOPs (from the example run)
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


def make_plan(gm, infos, saved_keys, names=None):
    """Decide what to forget and how to bring each storage back.

    ``names``: None to use the ``forget()`` marks in the forward, or node names to forget instead.
    A recompute that reads another forgotten storage reads its recomputed value, not its ops again:
    forgetting fc1's output and the GELU of it runs fc1 once, not once per storage."""
    nodes = list(gm.graph.nodes)
    position, units = {n: i for i, n in enumerate(nodes)}, storage_units(nodes, infos)
    by_name = {n.name: n for n in nodes}
    marked = ([n.args[0] for n in nodes if n.op == "call_function" and n.target is forget]
              if names is None else [by_name.get(name, name) for name in names])  # fmt: skip
    forgotten = check_marks(marked, nodes, infos, units)  # storage key -> first marked name

    def is_kept(n):  # inputs, parameters, what autograd saves; Python values cost nothing to stash
        info, source = infos[n], n.op in ("placeholder", "get_attr")
        if source or not info.is_tensor:
            return source or not info.holds_tensors
        return info.key not in forgotten and (info.key in saved_keys or any(
            m.op in ("placeholder", "get_attr") for m in units[info.key]))  # fmt: skip

    roots, plan_units, held = {units[key][0] for key in forgotten}, [], {}
    for key, name in forgotten.items():
        root = units[key][0]
        sub, frontier = recompute_subgraph(
            root, lambda m: is_kept(m) or (m in roots and m is not root)
        )
        sub = sorted(sub, key=position.get)
        deps, frontier = (sorted((f for f in frontier if (f in roots) == dep), key=position.get)
                          for dep in (True, False))  # fmt: skip
        check_recomputable(name, sub, frontier, deps, nodes, infos)
        for f in frontier:  # read by the recompute, but autograd would not have kept it
            info = infos[f]
            if info.is_tensor and info.key not in saved_keys and not any(
                    m.op == "get_attr" for m in units.get(info.key, ())):  # fmt: skip
                held[info.key] = info.nbytes
        plan_units.append(ForgottenUnit(
            name=root.name, members=[n.name for n in units[key] if n.target is not forget],
            root=root, nodes=sub, frontier=frontier, deps=deps, shape=infos[root].layout[1],
            nbytes=infos[root].nbytes, saved=key in saved_keys,
            flops=sum(infos[n].flops for n in sub), op_flops=[(n.name, infos[n].flops) for n in
            sub], random_nodes=[n.name for n in sub if infos[n].random]))  # fmt: skip
    plan_units.sort(key=lambda u: position[u.root])  # dependencies first
    random = {n for u in plan_units for n in u.nodes if infos[n].random}
    rng_bytes = sum(s.nbytes for n in random for s in rng_snapshot(infos[n].key[0] if
                    infos[n].is_tensor else torch.device("cpu"))[:2] if s is not None)  # fmt: skip
    return Plan(plan_units, held_bytes=sum(held.values()), rng_bytes=rng_bytes)


# ---- 3. The runtime: one forward that frees as it goes, two saved-tensor hooks ------------------


def run_forgetting(traced, inputs, owner):
    """One forward with the plan's storages forgotten: the runtime, end to end.

    Runs the traced graph node by node under the two hooks and drops each value after its last use,
    as FX's generated code does: a forgotten storage dies in forward once its last reader ran, and
    autograd holds only handles to it. Then each LiveStorage gets what its recompute reads."""
    autocast = python_state(torch.nn.Module())[1]  # the recompute re-enters it
    call = ForwardCall({u.root: LiveStorage(u, owner, autocast) for u in traced.plan.units})
    env = dict(zip(traced.placeholders, inputs))
    with torch.autograd.graph.saved_tensors_hooks(functools.partial(pack_hook, call), unpack_hook):
        for n in traced.nodes:
            if n.op == "output":
                out = fx.node.map_arg(n.args[0], env.__getitem__)
                break
            if n.op != "placeholder":
                if n in traced.random:  # the generator as this op finds it, replayed in backward
                    device = next((t.device for t in _tensors_in([env[m] for m in
                                   n.all_input_nodes])), torch.device("cpu"))  # fmt: skip
                    call.rng[n] = rng_snapshot(device)
                if n in call.storages:
                    call.opening = []  # its own op may save its output: see register_root
                env[n] = run_node(owner.module, n, env)
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


def register_root(call, live, v):
    """``v`` is the first tensor of a forgotten storage: from now on saving it saves a handle."""
    live.layout = (*layout_of(v), v.untyped_storage().nbytes())
    call.by_key[storage_key(v)] = (weakref.ref(v.untyped_storage()), live)
    for packed in call.opening:  # saved by v's own op before we knew v was forgotten
        if call.live_storage(packed.tensor) is live:
            packed.to_handle(live)
    call.opening = None


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

    def kept(self):
        """The kept tensor, after autograd's own check that nothing changed it in place."""
        t = self.tensor
        if t._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a tensor of shape {tuple(t.shape)} is at version {t._version}"
                f"; expected version {self.version} (tensor_ckpt keeps autograd's check)"
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
    owner: nn.Module  # the TensorCheckpoint: its module runs the ops, it counts recomputations
    autocast: tuple  # (device type, enabled, dtype) of the forward, re-entered by the recompute
    layout: tuple = None  # (dtype, shape, stride, offset, storage bytes) of the root in forward
    inputs: dict = field(default_factory=dict)  # frontier node -> value kept for the recompute
    versions: dict = field(default_factory=dict)  # frontier node -> its _version after forward
    rng: dict = field(default_factory=dict)  # random node -> rng_snapshot before it ran
    deps: dict = field(default_factory=dict)  # root -> LiveStorage of a forgotten storage it reads
    handles: int = 0  # saved tensors autograd holds on this storage
    uses: int = 0  # handles, plus recomputes of other forgotten storages that read it
    pending: int = 0  # uses still to come in this backward
    value: torch.Tensor = None  # the recomputed root, alive while a gradient still needs it

    def check_inputs(self):
        changed = [n.name for n, v in self.inputs.items()
                   if isinstance(v, torch.Tensor) and v._version != self.versions[n]]  # fmt: skip
        if changed:
            raise RuntimeError(
                f"tensor_ckpt: '{changed[0]}', read to recompute forgotten '{self.unit.name}', was "
                "modified in place after forward; its gradient would be wrong. Do not modify it "
                "before backward."
            )

    def check_layout(self, v):
        layout = (*layout_of(v), v.untyped_storage().nbytes())
        if layout != self.layout:  # a recompute that ran otherwise than the forward did
            raise RuntimeError(f"tensor_ckpt: recomputed '{self.unit.name}' has layout {layout}, "
                               f"forward had {self.layout}")  # fmt: skip

    def as_in_forward(self):
        """no_grad, with autocast as the forward ran (as torch.utils.checkpoint re-enters it)."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
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
            self.check_layout(self.value)
            self.owner.recomputations += 1
            for dep in self.deps.values():
                dep.release()
        return self.value
        ### END SOLUTION

    def release(self):
        self.pending -= 1
        if self.pending <= 0:  # the last gradient that needs it has it: let the storage go
            self.value, self.pending = None, self.uses  # (a retained graph recomputes once more)


# ---- 4. The module: one plan per train/eval mode, and data-parallel replicas --------------------


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


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _plain(v):
    return isinstance(v, _PLAIN) or (isinstance(v, (tuple, list)) and all(map(_plain, v)))


def python_state(module):
    """What a trace may have read as Python values and frozen into the graph: every plain
    attribute of every submodule (``training``, a dropout's ``p``, a ``use_*`` flag), of the
    objects they hold (a config), and the autocast state. A change means a new plan."""
    state, seen = [], set()
    for name, m in module.named_modules():
        held = [v for v in vars(m).values() if hasattr(v, "__dict__") and not callable(v)]
        for obj in [m, *(v for v in held if not isinstance(v, (nn.Module, torch.Tensor)))]:
            if id(obj) not in seen:
                seen.add(id(obj))
                state += [(name, k, repr(v)) for k, v in vars(obj).items() if _plain(v)]
    autocast = [
        (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
    ]
    return tuple(state), tuple(autocast)


def _same(a, b):
    try:
        return a is b or bool(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)
    except Exception:  # a tensor against a non-tensor, a value with no truth value for ==
        return False


class TensorCheckpoint(nn.Module):
    """``module`` with its plan's tensors forgotten after forward. A plan is kept per
    ``python_state`` of the module, traced on the first call in that state (a flag flipped after
    tracing re-plans, it never runs a stale graph). Without gradients the module itself runs."""

    def __init__(self, module, trace_and_plan, arguments, concrete_args):
        super().__init__()
        self.module = module
        self.recomputations = 0  # recompute subgraphs run (one per forgotten storage per backward)
        self._trace_and_plan = trace_and_plan  # inputs -> Traced, for the module's current state
        self._traced, self._last = {}, None  # python_state(module) -> Traced; the last one used
        self.arguments, self.concrete_args = arguments, concrete_args  # traced names; fixed ones

    def traced_for(self, inputs):
        state = python_state(self.module)
        if state not in self._traced:
            self._traced[state] = self._trace_and_plan(inputs)
        self._last = self._traced[state]
        return self._last

    @property
    def plan(self):
        return self._last.plan

    @property
    def gm(self):
        return self._last.gm

    def bind(self, args, kwargs):
        """The traced arguments of a call, in order; every other one must be as it was traced."""
        signature = inspect.signature(self.module.forward)
        given = signature.bind(*args, **kwargs).arguments
        for p in signature.parameters.values():
            if p.kind is p.VAR_KEYWORD:
                given.update(given.pop(p.name, {}))
        inputs = tuple(given.pop(name) for name in self.arguments if name in given)
        for name, value in given.items():
            p = signature.parameters.get(name)
            traced = self.concrete_args.get(name, p.default if p is not None else "not passed")
            if not _same(value, traced):
                raise ValueError(
                    f"tensor_ckpt: argument '{name}' is {type(value).__name__} {value!r:.60}, "
                    f"but the trace fixed it at {traced!r:.60}. Fix: pass it in concrete_args="
                    f"{{'{name}': ...}} with this value, or trace it as an example input."
                )
        return inputs

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        inputs = self.bind(args, kwargs) if kwargs or self.concrete_args else args
        traced = self.traced_for(inputs)
        if not traced.plan.units:
            return self.module(*args, **kwargs)
        check_arity(traced.placeholders, inputs)
        return run_forgetting(traced, inputs, self)


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


def checkpoint_tensors(
    module, example_inputs, names=None, leaf_modules=(), trace_into=(), concrete_args=None
):
    """Trace ``module`` on ``example_inputs``; return it with its marked tensors forgotten.

    ``names``: None to use the ``forget()`` marks in the forward, or FX node names to forget
    instead (for a model you cannot edit). ``leaf_modules``: classes run as one node;
    ``trace_into``: torch.nn classes to trace inside. ``example_inputs`` are forward's first
    arguments; ``concrete_args`` {name: value} fixes others (None, flags) for every call. The
    result shares ``module``'s parameters; ``.plan`` says what happens."""
    concrete_args = dict(concrete_args or {})
    arguments = traced_arguments(module, concrete_args, len(example_inputs))
    odd = [(n, v) for n, v in zip(arguments, example_inputs) if not isinstance(v, torch.Tensor)]
    if odd:
        raise ValueError(
            f"tensor_ckpt: example input '{odd[0][0]}' is {odd[0][1]!r}, not a tensor: a traced "
            f"argument becomes a proxy, so `if {odd[0][0]} is None` would take the wrong branch. "
            f"Fix: concrete_args={{'{odd[0][0]}': {odd[0][1]!r}}}."
        )

    def trace_and_plan(inputs):
        gm = trace(module, leaf_modules, trace_into, concrete_args, len(inputs))
        with buffers_kept(module):  # the example run must not move BatchNorm's statistics
            infos, saved_keys = profile(gm, tuple(inputs))
        return Traced(gm, make_plan(gm, infos, saved_keys, names))

    ckpt = TensorCheckpoint(module, trace_and_plan, arguments, concrete_args)
    ckpt.traced_for(tuple(example_inputs))
    return ckpt


def checkpoint_data_parallel(module, example_inputs, settings, group=None, **kwargs):
    """checkpoint_tensors on every rank, then the agreement guard, then DDP (when world > 1).

    ``settings``: hyperparameters that must agree (lr, steps...). A rank whose plan is refused still
    joins the guard carrying its error, so every rank raises it."""
    ckpt, error = None, None
    try:
        ckpt = checkpoint_tensors(module, example_inputs, **kwargs)
    except ValueError as err:
        error = str(err).removeprefix("tensor_ckpt: ")
    tensors = _tensors_in(example_inputs)
    fields = {
        "example input shapes": [tuple(t.shape) for t in tensors],
        "example input dtypes": [str(t.dtype) for t in tensors],
        "initial parameter values (sha256 of names, shapes, dtypes, bytes)": (
            launch.weights_digest(module.named_parameters())
        ),
        "train/eval mode": module.training,
        **settings,
        "forgotten tensors": [u.name for u in ckpt.plan.units] if ckpt is not None else None,
    }
    launch.agree(fields, error, group, who="tensor_ckpt")
    if dist.get_world_size(group) == 1:
        return ckpt
    device = tensors[0].device  # from the data, never from the backend's name
    ids = [device] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(ckpt, device_ids=ids, process_group=group)


# ---- 5. Demo: a transformer block stack with V4-style marks, trained data-parallel --------------


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
        description="Tensor-level activation checkpointing (V4 §3.4.4): the plan, gradients "
        "checked bitwise against the plain model, then data-parallel training of a small LM with "
        "V4-style forget() marks. Measured memory and recompute work: "
        "benchmarks/bench_tensor_ckpt.py.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    one = launch.at_least(1)
    parser.add_argument("--steps", type=one, default=30, help="training steps")
    parser.add_argument("--batch", type=one, default=8, help="sequences per rank and step")
    parser.add_argument("--seq", type=one, default=64, help="tokens per sequence")
    parser.add_argument("--dim", type=one, default=128, help="model width, a multiple of --heads")
    parser.add_argument("--heads", type=one, default=4, help="attention heads")
    parser.add_argument("--layers", type=one, default=4, help="transformer layers")
    parser.add_argument("--vocab", type=launch.at_least(2), default=64, help="vocabulary size")
    parser.add_argument("--lr", type=launch.positive, default=3e-3, help="AdamW learning rate")
    launch.add_launch_options(parser)
    args = parser.parse_args(argv)
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim} is not a multiple of --heads {args.heads}")
    return launch.check_launch_options(parser, args)


def demo(args, rank, world, device):
    start = time.perf_counter()

    def say(stage, text):
        launch.say(f"[{stage}, {time.perf_counter() - start:.1f} s] {text}")

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
    grads = []
    with math if device.type == "cuda" else contextlib.nullcontext():
        for fn in (model, ckpt):
            model.zero_grad(set_to_none=True)
            loss_of(fn, tokens).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
    exact = all(torch.equal(a, b) for a, b in zip(*grads))
    say("exactness", f"gradients bitwise equal to the plain model: {exact}")
    say("memory", f"activation bytes saved per forward (plan): {_mib(ckpt.plan.bytes_freed)}; "
        "measured bytes and recompute work: benchmarks/bench_tensor_ckpt.py")  # fmt: skip

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


def main(argv=None):
    launch.run(demo, parse_args(argv))  # every argument checked before any process group


# ---- appendix: the refusals, each naming the tensor and the fix; the plan table -----------------


def untraceable(module, err):
    path, cls = getattr(err, "inside", ("", type(module)))
    where = f"inside '{path}' ({cls.__name__})" if path else type(module).__name__
    return ValueError(
        f"tensor_ckpt: torch.fx cannot trace {where}: {str(err).splitlines()[0]}\n"
        "Python control flow on a traced value (an `if`/`while` on a tensor, len() of a tensor) "
        f"has no graph form. Fix: pass leaf_modules=({cls.__name__},) so it runs as one opaque "
        "node (nothing inside it can then be forgotten), fix the arguments that steer it with "
        "concrete_args={name: value}, or express the branch with tensor ops (torch.where)."
    )


def check_marks(marked, nodes, infos, units):
    """{storage key: first marked name} of the marked nodes, refusing what cannot be forgotten:
    an unknown name, a non-tensor, an empty tensor, an input/parameter alias, a module output, a
    tensor changed in place."""
    unknown = [m for m in marked if isinstance(m, str)]
    if unknown:
        leaves = [n.target for n in nodes if n.op == "call_module" and
                  any(u.startswith(n.target + ".") for u in unknown)]  # fmt: skip
        inside = (f" '{unknown[0]}' is inside the leaf module '{leaves[0]}': FX keeps torch.nn "
                  "modules whole; pass its class in trace_into=(...) to trace inside it."
                  if leaves else "")  # fmt: skip
        raise ValueError(f"tensor_ckpt: no node named {unknown} in the traced graph.{inside} "
                         f"Pick from: {[n.name for n in nodes if infos[n].is_tensor]}")  # fmt: skip
    forgotten = {}
    output_keys = {infos[a].key for a in nodes[-1].all_input_nodes if infos[a].is_tensor}
    for m in marked:
        if not isinstance(m, fx.Node) or not infos[m].is_tensor:
            raise ValueError(f"tensor_ckpt: forget() needs a tensor, got {m!r}. Mark a tensor.")
        key, name = infos[m].key, m.name
        source = [n.name for n in units.get(key, ()) if n.op in ("placeholder", "get_attr")]
        writers = [n.name for n in nodes if key in infos[n].mutates]
        if infos[m].nbytes == 0:
            why = "it was empty in the example run, so its storage cannot be told apart"
            fix = "Trace with a non-empty batch."
        elif source:
            why = f"it shares storage with the input/parameter '{source[0]}', which stays alive"
            fix = "Forget a tensor computed in forward."
        elif key in output_keys:
            why = "it is (or shares storage with) an output of the module, which the caller holds"
            fix = "Remove forget() there; forget it where it is consumed instead."
        elif writers:
            why = f"the in-place op '{writers[0]}' modifies it: no single value to recompute"
            fix = "Use the out-of-place op (x = x + y, not x.add_(y); no inplace=True)."
        else:
            forgotten.setdefault(key, name)
            continue
        raise ValueError(f"tensor_ckpt: cannot forget '{name}': {why}. {fix}")
    return forgotten


def check_recomputable(name, sub, frontier, deps, nodes, infos):
    """Refuse a recompute that reads a node it neither re-runs nor keeps, would apply an in-place
    op twice or reads a value changed later; warn when it re-runs a matmul or attention."""
    missing = {m.name for n in sub for m in n.all_input_nodes} - {
        n.name for n in [*sub, *frontier, *deps]
    }
    if missing:  # a student's recompute_subgraph that stopped early; the run would KeyError
        raise ValueError(
            f"tensor_ckpt: the recompute of '{name}' reads {sorted(missing)}, neither re-run "
            "nor kept: recompute_subgraph must walk back through every node that is not "
            "kept, not only root's direct inputs"
        )
    start, why = nodes.index(sub[0]), None
    for n in sub:
        writers = [w.name for w in nodes if infos[n].is_tensor and infos[n].key in infos[w].mutates]
        if infos[n].mutates:
            why = (f"its recompute subgraph contains '{n.name}', which modifies a tensor in place "
                   "(running it again would apply it twice)")  # fmt: skip
        elif writers:  # FX records the op but not that later readers see its effect
            why = (f"it is computed from '{n.name}', which the in-place op '{writers[0]}' "
                   "modifies, an order the traced graph does not record")  # fmt: skip
        if why:
            break
    for f in frontier if why is None else ():
        late = [n.name for n in nodes[start:] if infos[f].is_tensor and infos[f].key in
                infos[n].mutates]  # fmt: skip
        if late:
            why = (f"it reads '{f.name}', which the in-place op '{late[0]}' modifies later in "
                   "forward, so backward would see the modified value")  # fmt: skip
            break
    if why:
        raise ValueError(f"tensor_ckpt: cannot recompute '{name}': {why}. Make that op "
                         "out-of-place, or forget a tensor after it.")  # fmt: skip
    costly = [f"'{n.name}' ({flops_text(infos[n].flops)})" for n in sub
              if infos[n].flops and n.name != name]  # fmt: skip
    if costly:
        warnings.warn(
            f"tensor_ckpt: forgetting '{name}' recomputes {', '.join(costly)} in every "
            "backward: its storage, or a tensor its recompute needs, is not kept by autograd "
            "(a view of an op's output shares that output's storage). Forget a tensor "
            "computed after it, or keep it.",
            stacklevel=5,
        )


def format_plan(plan):
    """The plan as a table: per forgotten storage, what is freed and what backward runs again."""
    rng = f", generator snapshots of {_mib(plan.rng_bytes)} deducted" if plan.rng_bytes else ""
    held = f"; {_mib(plan.held_bytes)} held for recompute" if plan.held_bytes else ""
    lines = [f"tensor_ckpt plan: {len(plan.units)} forgotten storages, {_mib(plan.bytes_freed)} "
             f"freed per forward{rng}{held}; recomputed per backward: "
             f"{flops_text(plan.recompute_flops)} in matmul/attention",
             f"  {'forgotten (aliases)':<30} {'shape':<16} {'freed':>10} {'matmul FLOP':>11}  "
             "recompute ops <- from kept (* = forgotten, shared)"]  # fmt: skip
    for u in plan.units:
        aliases = ", ".join(m for m in u.members if m != u.name)
        label = u.name + (f" ({aliases})" if aliases else "")
        freed = _mib(u.bytes_freed) if u.saved else "0 (unsaved)"
        ops = ", ".join(name + (f"[{flops_text(fl)}]" if fl else "") for name, fl in u.op_flops
                        if not name.startswith("forget"))  # fmt: skip
        kept = ", ".join([f.name for f in u.frontier] + [d.name + "*" for d in u.deps])
        rng = f"  [generator replayed: {', '.join(u.random_nodes)}]" if u.random_nodes else ""
        lines.append(f"  {label[:30]:<30} {str(tuple(u.shape)):<16} {freed:>10} "
                     f"{flops_text(u.flops):>11}  {ops} <- {kept}{rng}")  # fmt: skip
    return "\n".join(lines)


def flops_text(flops):
    """FLOPs with a unit that keeps small counts visible (3.1 kFLOP, not 0.0 MFLOP)."""
    for unit, scale in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.1f} {unit}"
    return f"{flops:.0f} FLOP"


def _mib(b):
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 or b == 0 else f"{b / 2**10:.1f} KiB"


def check_arity(placeholders, inputs):
    if len(inputs) != len(placeholders):
        names = [n.name for n in placeholders]
        raise ValueError(f"tensor_ckpt: expected {len(placeholders)} inputs ({names}), got "
                         f"{len(inputs)}. Pass one value per argument of forward.")  # fmt: skip


if __name__ == "__main__":
    main()
