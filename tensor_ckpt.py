"""Tensor-level activation checkpointing: declare what to forget, not how to recompute it (V4 §3.4.4).

What the standard tool assumes. `torch.utils.checkpoint` works on whole functions: everything inside
a checkpointed region is dropped after forward and the whole region runs again in backward. Selective
activation checkpointing (SAC) refines that per *operator type* (save every matmul, recompute the rest),
but the unit is still a region you wrap and an op-level policy you write.

What V4's design violates. In V4 the expensive and the cheap live side by side in every layer: the
matmuls are worth keeping, while norm outputs, activation-function outputs and reshaped copies are large
and nearly free to redo. Which *tensor* to keep is the real decision, and it cuts across module
boundaries; neither "keep the module" nor "recompute the module" expresses it.

The fix. The author marks individual tensors inside an ordinary forward with `forget(x)`. A concrete
TorchFX trace (run once on example inputs, so storage identities are known) finds, for each forgotten
tensor, the minimal subgraph that recomputes it from tensors autograd keeps anyway; tensors that share
storage (a view, its base, a reshape) form one unit, recomputed once. At run time saved-tensor hooks
store a small handle instead of the forgotten storage, and the first gradient that needs it runs the
recompute subgraph; every saved alias is rebuilt as a view over that one recomputed storage (no copy),
and the storage is dropped when the last gradient that needs it has run.

Choices the report leaves open, made here:
- "Reuses storage (no copies)": the forgotten storage is released after forward, so the recompute
  allocates the root once (the GPU caching allocator hands back the block just freed) and every saved
  alias is rebuilt over that same storage with `set_` (view, base, transposes: no copy, one recompute).
- "Kept anyway" means: an input, a parameter, or a storage autograd saves and nobody forgets; a Python
  value (a size) is kept by value. The walk stops there; everything else on the way is recomputed.
- Recomputed once per backward and cached until the last saved alias is unpacked; a retained graph
  recomputes again on the next backward. A recompute that reads another forgotten storage takes that
  storage's recomputed value instead of re-running its ops, so each forgotten storage runs once.
  Double backward works: autograd re-attaches the graph to what the unpack hook returns. Dropout in a
  recompute subgraph replays the forward RNG state.
- Refused with a ValueError that names the tensor and the fix: forgetting an input/parameter alias or
  a module output, in-place ops on a forgotten tensor or on anything its recompute reads, and code FX
  cannot trace (fix: `leaf_modules`). Changing a kept tensor in place after forward raises in backward,
  as autograd itself does (saved-tensor hooks would otherwise skip that check).

    torchrun --nproc_per_node=4 tensor_ckpt.py   # CPU (gloo) data parallel, each rank its own replica
    torchrun --nproc_per_node=8 tensor_ckpt.py   # GPUs: NCCL and cuda:LOCAL_RANK are picked automatically
    python tensor_ckpt.py                        # one process

Usage:
    class Block(nn.Module):
        def forward(self, x):
            h = forget(self.norm(x))             # the only change to the model
            return x + self.fc2(forget(F.gelu(self.fc1(h))))

    model = checkpoint_tensors(Block(), example_inputs=(x,))
    print(model.plan)                            # per forgotten tensor: recompute ops, FLOPs, bytes freed
    model(x).sum().backward()                    # gradients bitwise equal to the plain model's
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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils import flop_counter


# ---------------------------------------------------------------------------------------------------
# 1. The programming model: mark a tensor, change nothing else
# ---------------------------------------------------------------------------------------------------

def forget(x):
    """Mark ``x`` to be freed after forward and recomputed in backward. Identity when run eagerly.

    Under the FX trace it records a ``forget`` node (whatever module it is called from, which is why it
    checks for a Proxy rather than relying on ``torch.fx.wrap``'s per-module name patching).
    """
    if isinstance(x, fx.Proxy):
        return x.tracer.create_proxy("call_function", forget, (x,), {})
    return x


class _Tracer(fx.Tracer):
    def __init__(self, leaf_modules=()):
        super().__init__()
        self.leaf_modules = tuple(leaf_modules)

    def is_leaf_module(self, m, qualname):
        return isinstance(m, self.leaf_modules) or super().is_leaf_module(m, qualname)


def trace(module, leaf_modules=()):
    """Symbolically trace ``module`` into a GraphModule that shares its parameters.

    ``leaf_modules``: module classes kept as single opaque nodes (the way out for code FX cannot trace).
    """
    try:
        graph = _Tracer(leaf_modules).trace(module)
    except Exception as err:  # TraceError, or the RuntimeError/TypeError a Proxy raises in len(), bool()...
        raise ValueError(
            f"tensor_ckpt: torch.fx cannot trace {type(module).__name__}: {err}\n"
            "Data-dependent Python control flow (an `if`/`while` on tensor values, len() of a tensor) has "
            "no graph form. Fix: move that code into its own nn.Module and pass its class in "
            "leaf_modules=(ThatModule,) so it runs as one opaque node, or express the branch with "
            "tensor ops (torch.where).") from err
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


# FlopCounterMode has no formula for the CPU flash-attention kernel; it is the same math as the GPU ones.
def _cpu_attention_flops(q, k, v, *args, out_shape=None, **kwargs):
    return flop_counter.sdpa_flop_count(q, k, v)


def _cpu_attention_backward_flops(grad_out, q, k, v, *args, out_shape=None, **kwargs):
    return flop_counter.sdpa_backward_flop_count(grad_out, q, k, v)


_CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
}


def count_flops():
    """A FlopCounterMode (matmul, attention, conv FLOPs) that also counts attention on CPU."""
    return flop_counter.FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION_FLOPS)


def storage_key(t):
    """Identity of the memory a tensor lives in: (device, data pointer). Views share it with their base."""
    return (t.device, t.untyped_storage().data_ptr())


def _tensors_in(value):
    found = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


def _rng_state(device):
    """CPU generator state, plus the CUDA one when the graph runs on a GPU (dropout draws from it)."""
    # .clone(): get_rng_state allocates outside the dispatcher, so memory meters would not see the
    # snapshot a forward keeps per random node; the copy they do see (and the plan counts it)
    cuda = torch.cuda.get_rng_state(device).clone() if device.type == "cuda" else None
    return torch.get_rng_state().clone(), cuda


@contextlib.contextmanager
def _replayed_rng(cpu_state, cuda_state, device):
    """Run the body with the generators as they were in forward, then restore them (as checkpoint does)."""
    with torch.random.fork_rng(devices=[device] if cuda_state is not None else []):
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
        yield


# Ops that draw from the generator when they run. A node is random if the example run saw the
# generator move OR the graph says it can draw: a dropout whose p or flag changes after tracing
# (p = 0 draws nothing) must still replay its mask.
_RANDOM_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                     F.feature_alpha_dropout, F.rrelu, torch.dropout, torch.bernoulli, torch.rand,
                     torch.randn, torch.randint, torch.rand_like, torch.randn_like,
                     torch.randint_like, torch.normal, torch.multinomial, torch.randperm,
                     torch.poisson, F.scaled_dot_product_attention}
_RANDOM_METHODS = {"bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_",
                   "geometric_", "cauchy_", "log_normal_"}
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


@dataclass
class NodeInfo:
    """What the concrete example run learned about one node."""
    is_tensor: bool = False
    key: tuple = None             # storage identity (tensors only)
    nbytes: int = 0               # bytes of the whole storage
    layout: tuple = None          # (dtype, size, stride, storage_offset)
    flops: int = 0                # FlopCounterMode: matmul / attention FLOPs of this op
    random: bool = False          # it advanced the RNG (dropout, rand...)
    mutates: tuple = ()           # storage keys it modified in place (args, module params/buffers)
    holds_tensors: bool = False   # a tuple/list with tensors in it (split, unbind, a module's outputs)


def profile(gm, example_inputs):
    """Run ``gm`` once on ``example_inputs``, node by node, and record per node what the plan needs.

    Returns ``(infos, saved_keys)``: {node: NodeInfo} and the set of storage keys autograd saved for
    backward. Every value is kept alive during the run so a storage address means one storage.
    """
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(example_inputs) != len(placeholders):
        raise ValueError(f"tensor_ckpt: {type(gm).__name__} takes {len(placeholders)} inputs "
                         f"({[n.name for n in placeholders]}), got {len(example_inputs)} example inputs")
    device = next((t.device for t in _tensors_in(example_inputs)), torch.device("cpu"))
    saved, infos, env = [], {}, dict(zip(placeholders, example_inputs))

    def pack(t):
        saved.append(t.detach())
        return t.detach()

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for n in nodes:
            info = infos[n] = NodeInfo()
            if n.op == "output":
                break
            if n.op != "placeholder":
                touched = _tensors_in(fx.node.map_arg((n.args, n.kwargs), env.__getitem__))
                if n.op == "call_module":
                    touched += list(gm.get_submodule(n.target).parameters())
                    touched += list(gm.get_submodule(n.target).buffers())
                versions = [t._version for t in touched]
                rng_before = _rng_state(device)
                with count_flops() as counter:
                    env[n] = run_node(gm, n, env)
                info.flops = counter.get_total_flops()
                info.random = any(a is not None and not torch.equal(a, b)
                                  for a, b in zip(rng_before, _rng_state(device)))
                info.mutates = tuple({storage_key(t) for t, v in zip(touched, versions) if t._version != v})
            value = env[n]
            if isinstance(value, torch.Tensor):
                info.is_tensor, info.key = True, storage_key(value)
                info.nbytes = value.untyped_storage().nbytes()
                info.layout = (value.dtype, tuple(value.shape), value.stride(), value.storage_offset())
            else:
                info.holds_tensors = bool(_tensors_in(value))
    return infos, {storage_key(t) for t in saved}


# ---------------------------------------------------------------------------------------------------
# 2. The plan: one recompute subgraph per storage unit
# ---------------------------------------------------------------------------------------------------

def storage_units(nodes, infos):
    """Group tensor nodes by the storage they live in: {key: [nodes in execution order]}.

    A view, its base, an unbind/split of it, a reshape that did not copy: one unit, one recompute.
    """
    units = {}
    for n in nodes:
        if infos[n].is_tensor and infos[n].nbytes > 0:  # empty tensors share the null pointer
            units.setdefault(infos[n].key, []).append(n)
    return units


def recompute_subgraph(root, is_kept):
    """The minimal set of nodes that recomputes ``root`` from kept values.

    Walks inputs backward from ``root`` and stops at every node for which ``is_kept(node)`` holds.
    Returns ``(nodes, frontier)``: the nodes to re-run (``root`` included) and the kept nodes they read,
    both as sets; order them by graph position to execute.
    """
    nodes, frontier, stack = {root}, set(), [root]
    while stack:
        for m in stack.pop().all_input_nodes:
            if is_kept(m):
                frontier.add(m)
            elif m not in nodes:
                nodes.add(m)
                stack.append(m)
    return nodes, frontier


@dataclass
class ForgottenUnit:
    """One storage to forget: its aliases, and the subgraph that brings it back."""
    name: str                      # the tensor that owns the storage (first node writing it)
    members: list                  # every node living in this storage (views, reshapes, forget marks)
    root: fx.Node
    nodes: list                    # recompute subgraph, in execution order (root last)
    frontier: list                 # kept nodes the subgraph reads (their values are stashed)
    deps: list                     # roots of other forgotten storages it reads (recomputed, shared)
    shape: tuple
    nbytes: int                    # bytes of the storage
    saved: bool                    # autograd saves it (otherwise forgetting it frees nothing)
    flops: int                     # recompute FLOPs (FlopCounterMode, from the example run)
    op_flops: list = field(default_factory=list)  # [(node name, FLOPs)] per recomputed op
    random_nodes: list = field(default_factory=list)  # ops whose RNG state is replayed

    @property
    def bytes_freed(self):
        return self.nbytes if self.saved else 0


@dataclass
class Plan:
    units: list
    held_bytes: int = 0            # frontier tensors autograd would not keep: held for recompute
    rng_bytes: int = 0             # generator snapshots kept per random node, for the replay

    @property
    def bytes_freed(self):
        return sum(u.bytes_freed for u in self.units) - self.rng_bytes

    @property
    def recompute_flops(self):
        return sum(u.flops for u in self.units)

    def __str__(self):
        lines = [f"tensor_ckpt plan: {len(self.units)} forgotten storages, {_mib(self.bytes_freed)} freed, "
                 f"{self.recompute_flops / 1e6:.1f} MFLOP recomputed per backward"
                 + (f", {_mib(self.held_bytes)} held for recompute" if self.held_bytes else "")]
        lines.append(f"  {'forgotten (aliases)':<34} {'shape':<18} {'freed':>10} {'MFLOP':>8}  "
                     "recompute ops <- from kept (* = another forgotten storage, recomputed first)")
        for u in self.units:
            aliases = ", ".join(m for m in u.members if m != u.name)
            label = u.name + (f" ({aliases})" if aliases else "")
            freed = _mib(u.bytes_freed) if u.saved else "0 (unsaved)"
            ops = ", ".join(f"{name}" + (f"[{fl / 1e6:.1f}M]" if fl else "") for name, fl in u.op_flops
                            if not name.startswith("forget"))  # the marks are identities
            rng = f"  [RNG replayed: {', '.join(u.random_nodes)}]" if u.random_nodes else ""
            lines.append(f"  {label[:34]:<34} {str(tuple(u.shape)):<18} {freed:>10} {u.flops / 1e6:>8.1f}  "
                         f"{ops} <- {', '.join([f.name for f in u.frontier] + [d.name + '*' for d in u.deps])}"
                         f"{rng}")
        return "\n".join(lines)


def flops_text(flops):
    """FLOPs with a unit that keeps small counts visible (3.1 kFLOP, not 0.0 MFLOP)."""
    for unit, scale in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.1f} {unit}"
    return f"{flops:.0f} FLOP"


def _mib(b):
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 or b == 0 else f"{b / 2**10:.1f} KiB"


def make_plan(gm, infos, saved_keys, forget_names=None):
    """Decide what to forget and how to bring it back; refuse what cannot be done exactly.

    ``forget_names``: None to use the ``forget()`` marks in the forward, or node names to forget instead.
    Returns a Plan whose units each carry their recompute subgraph. Raises ValueError naming the tensor
    and the fix for: a forgotten input/parameter/output, an in-place op on a forgotten tensor or on what
    its recompute reads, and recompute subgraphs with side effects.
    """
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    units = storage_units(nodes, infos)
    if forget_names is None:
        marked = [n.args[0] for n in nodes if n.op == "call_function" and n.target is forget]
    else:
        unknown = [name for name in forget_names if name not in by_name]
        if unknown:
            raise ValueError(f"tensor_ckpt: no node named {unknown} in the traced graph; "
                             f"names are: {[n.name for n in nodes if infos[n].is_tensor]}")
        marked = [by_name[name] for name in forget_names]
    forgotten = {}
    for m in marked:
        if not isinstance(m, fx.Node) or not infos[m].is_tensor:
            raise ValueError(f"tensor_ckpt: forget() needs a tensor, got {m!r}")
        if infos[m].nbytes == 0:
            raise ValueError(f"tensor_ckpt: cannot forget '{m.name}': it was empty in the example "
                             "run, so its storage cannot be told apart. Trace with a non-empty batch.")
        forgotten.setdefault(infos[m].key, m.name)

    output_keys = {infos[a].key for a in nodes[-1].all_input_nodes if infos[a].is_tensor}
    for key, name in forgotten.items():
        source = [n.name for n in units[key] if n.op in ("placeholder", "get_attr")]
        if source:
            raise ValueError(f"tensor_ckpt: cannot forget '{name}': it shares storage with the input/"
                             f"parameter '{source[0]}', which stays alive anyway. Forget a tensor "
                             "computed in forward.")
        if key in output_keys:
            raise ValueError(f"tensor_ckpt: cannot forget '{name}': it is (or shares storage with) an output "
                             "of the module, which the caller holds. Remove forget() there; forget it where "
                             "it is consumed instead.")
        writers = [n.name for n in nodes if key in infos[n].mutates]
        if writers:
            raise ValueError(f"tensor_ckpt: cannot forget '{name}': the in-place op '{writers[0]}' modifies "
                             "it, so no single value can be recomputed. Use the out-of-place op "
                             "(e.g. x = x + y, F.relu(x) instead of x.add_(y), F.relu(x, inplace=True)).")

    def is_kept(n):
        info = infos[n]
        if n.op in ("placeholder", "get_attr"):
            return True
        if not info.is_tensor:  # sizes, ints, None: stashing the Python value costs nothing
            return not info.holds_tensors
        if info.key in forgotten:
            return False
        return info.key in saved_keys or any(m.op in ("placeholder", "get_attr") for m in units[info.key])

    # A recompute that reads another forgotten storage reads its recomputed value (not its ops again):
    # forgetting fc1's output and the GELU of it runs fc1 once, not once per forgotten storage.
    roots = {units[key][0] for key in forgotten}
    plan_units, held = [], {}
    for key, name in forgotten.items():
        root = units[key][0]
        sub, frontier = recompute_subgraph(root, lambda m: is_kept(m) or (m in roots and m is not root))
        sub = sorted(sub, key=position.get)
        deps = sorted((f for f in frontier if f in roots), key=position.get)
        frontier = sorted((f for f in frontier if f not in roots), key=position.get)
        for n in sub:
            if infos[n].mutates:
                raise ValueError(f"tensor_ckpt: cannot recompute '{name}': its recompute subgraph contains "
                                 f"'{n.name}', which modifies a tensor in place (running it again would apply "
                                 "it twice). Make that op out-of-place, or forget a tensor after it.")
            writers = [w.name for w in nodes if infos[n].is_tensor and infos[n].key in infos[w].mutates]
            if writers:  # FX records the op but not that later readers see its effect
                raise ValueError(f"tensor_ckpt: cannot recompute '{name}': it is computed from '{n.name}', "
                                 f"which the in-place op '{writers[0]}' modifies, an order the traced graph does "
                                 "not record. Make that op out-of-place.")
        start = position[sub[0]]
        for f in frontier:
            if infos[f].is_tensor:
                late = [n.name for n in nodes[start:] if infos[f].key in infos[n].mutates]
                if late:
                    raise ValueError(f"tensor_ckpt: cannot recompute '{name}': it reads '{f.name}', which the "
                                     f"in-place op '{late[0]}' modifies later in forward, so backward would "
                                     "see the modified value. Make that op out-of-place.")
                if infos[f].key not in saved_keys and not any(m.op == "get_attr" for m in units[infos[f].key]):
                    held[infos[f].key] = infos[f].nbytes
        plan_units.append(ForgottenUnit(
            name=root.name, members=[n.name for n in units[key] if n.target is not forget],
            root=root, nodes=sub, frontier=frontier, deps=deps, shape=infos[root].layout[1],
            nbytes=infos[root].nbytes, saved=key in saved_keys, flops=sum(infos[n].flops for n in sub),
            op_flops=[(n.name, infos[n].flops) for n in sub],
            random_nodes=[n.name for n in sub if infos[n].random or graph_random(gm, n)]))
        _warn_if_expensive(plan_units[-1], name, infos)
    # the generator state kept per random node and forward, so that backward draws the same mask
    random = {n for u in plan_units for n in u.nodes if n.name in u.random_nodes}
    rng_bytes = sum(_rng_snapshot_bytes(infos[n].key[0] if infos[n].is_tensor else None)
                    for n in random)
    return Plan(plan_units, held_bytes=sum(held.values()), rng_bytes=rng_bytes)


def _rng_snapshot_bytes(device):
    device = device if device is not None else torch.device("cpu")
    return sum(s.nbytes for s in _rng_state(device) if s is not None)


def _warn_if_expensive(unit, marked, infos):
    """Forgetting a cheap tensor can pull a matmul or attention into backward: say which, and its cost."""
    costly = [(n.name, infos[n].flops) for n in unit.nodes if infos[n].flops and n.name != marked]
    if costly:
        ops = ", ".join(f"'{op}' ({flops_text(fl)})" for op, fl in costly)
        warnings.warn(
            f"tensor_ckpt: forgetting '{marked}' recomputes {ops} in every backward: its storage, or "
            "a tensor its recompute needs, is not kept by autograd (a view of an op's output shares "
            "that output's storage). Forget a tensor computed after it, or keep it.", stacklevel=3)


# ---------------------------------------------------------------------------------------------------
# 3. Execution: saved-tensor hooks store handles; the first gradient that needs one recomputes
# ---------------------------------------------------------------------------------------------------

class _UnitState:
    """One forgotten storage of one forward call: what its recompute reads, and the recomputed value."""

    def __init__(self, module, traced, unit):
        self.module, self.traced, self.unit = module, traced, unit
        self.inputs, self.versions, self.rng, self.deps = {}, {}, {}, {}
        self.layout = None
        self.handles = 0          # saved tensors autograd holds on this storage
        self.uses = 0             # handles, plus recomputes of other forgotten storages that read it
        self.pending = 0          # uses still to come in this backward
        self.value = None         # the recomputed root, alive while some gradient still needs it

    def materialize(self):
        if self.value is None:
            for n, v in self.inputs.items():
                if isinstance(v, torch.Tensor) and v._version != self.versions[n]:
                    raise RuntimeError(f"tensor_ckpt: '{n.name}', read to recompute forgotten "
                                       f"'{self.unit.name}', was modified in place after forward; "
                                       "its gradient would be wrong. Do not modify it before backward.")
            env = dict(self.inputs)
            env.update({root: dep.materialize() for root, dep in self.deps.items()})
            with torch.no_grad():
                for n in self.unit.nodes:
                    if n in self.rng:
                        with _replayed_rng(*self.rng[n]):
                            env[n] = run_node(self.traced.gm, n, env)
                    else:
                        env[n] = run_node(self.traced.gm, n, env)
            value = env[self.unit.root]
            layout = (value.dtype, tuple(value.shape), value.stride(), value.storage_offset(),
                      value.untyped_storage().nbytes())
            if layout != self.layout:
                raise RuntimeError(f"tensor_ckpt: recomputed '{self.unit.name}' has layout {layout}, "
                                   f"forward had {self.layout}")
            self.value = value
            self.module.recomputations += 1
            for dep in self.deps.values():
                dep.release()
        return self.value

    def release(self):
        self.pending -= 1
        if self.pending <= 0:       # the last gradient that needs it has it: let the storage go
            self.value, self.pending = None, self.uses  # (a retained graph recomputes once more)


class _Saved:
    """What autograd stores for each saved tensor: the tensor itself, or, for a tensor that lives in a
    forgotten storage, a handle to that storage plus where the tensor sat in it.

    Ops that save their own output (softmax, attention) pack it before the op returns, i.e. before we
    know its storage is forgotten; those start as a reference and become a handle when the op returns.
    """
    __slots__ = ("tensor", "version", "state", "dtype", "size", "stride", "offset")

    def __init__(self, t):
        self.tensor, self.version, self.state = t.detach(), t._version, None

    def forget(self, state):
        t, self.tensor, self.state = self.tensor, None, state
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()
        state.handles += 1
        return self


def _unpack(saved):
    if saved.state is None:
        # Saved-tensor hooks switch off autograd's own check for in-place changes; keep it.
        if saved.tensor._version != saved.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a tensor of shape {tuple(saved.tensor.shape)} is at version "
                f"{saved.tensor._version}; expected version {saved.version} (tensor_ckpt keeps autograd's check)")
        return saved.tensor
    root = saved.state.materialize()
    # Reuse the storage, no copy: every alias autograd saved (view, base, transpose) is rebuilt over
    # the one recomputed storage with its own geometry.
    view = torch.empty(0, dtype=saved.dtype, device=root.device).set_(
        root.untyped_storage(), saved.offset, saved.size, saved.stride)
    saved.state.release()
    return view


class _ForwardCall:
    """State of one forward: which live storages are forgotten, and what their recomputes read."""

    def __init__(self, module, traced):
        self.states = {u.root: _UnitState(module, traced, u) for u in traced.plan.units}
        self.by_key, self.frontier, self.rng = {}, {}, {}
        self.packed_in_root = None  # tensors packed while a forgotten storage's first op is running

    def forgotten_state(self, t):
        """The _UnitState of the forgotten storage ``t`` lives in, or None."""
        if not self.by_key or t.layout != torch.strided:
            return None
        storage = t.untyped_storage()
        entry = self.by_key.get((t.device, storage.data_ptr()))
        # A forgotten storage is freed at its last use in forward; a later tensor may reuse its address.
        return entry[1] if entry is not None and entry[0]() is storage else None

    def pack(self, t):
        state = self.forgotten_state(t)
        if state is not None:
            return _Saved(t).forget(state)
        saved = _Saved(t)  # kept as usual (detached: a pack result must not reference its input)
        if self.packed_in_root is not None:
            self.packed_in_root.append(saved)
        return saved

    def register(self, state, v):
        """``v`` is the first tensor of a forgotten storage: from now on saving it saves a handle."""
        state.layout = (v.dtype, tuple(v.shape), v.stride(), v.storage_offset(), v.untyped_storage().nbytes())
        self.by_key[storage_key(v)] = (weakref.ref(v.untyped_storage()), state)
        for saved in self.packed_in_root:
            if self.forgotten_state(saved.tensor) is state:
                saved.forget(state)
        self.packed_in_root = None


class _Traced:
    """One mode's trace: the graph, its plan, and what the runtime precomputes from them."""

    def __init__(self, gm, plan):
        self.gm, self.plan = gm, plan
        self.nodes = list(gm.graph.nodes)
        self._frontier = {f for u in plan.units for f in u.frontier}
        self._random = {n for u in plan.units for n in u.nodes if n.name in u.random_nodes}
        self._drop_after = {}      # free each value after its last use, as FX's generated code does
        seen = set()
        for n in reversed(self.nodes):
            for m in n.all_input_nodes:
                if m not in seen:
                    seen.add(m)
                    self._drop_after.setdefault(n, []).append(m)


def mode_of(module):
    """Every submodule's ``training`` flag: FX freezes Python values read from them at trace time."""
    return tuple(m.training for m in module.modules())


class TensorCheckpoint(nn.Module):
    """``module`` run through its traced graph, with the tensors of ``plan`` forgotten after forward.

    A trace holds the train/eval flags it was made under as constants (``F.dropout(h, p,
    self.training)``, ``dropout_p = p if self.training else 0``), so one plan is kept per mode of the
    module and its submodules; a mode first met in forward is traced on that call's inputs.
    """

    def __init__(self, module, trace_fn):
        super().__init__()
        self.module = module
        self.recomputations = 0    # recompute subgraphs run so far (one per forgotten storage per backward)
        self._trace_fn = trace_fn  # inputs -> _Traced, for the module's current mode
        self._traced = {}          # mode_of(module) -> _Traced
        self._last = None

    def _for_mode(self, inputs):
        mode = mode_of(self.module)
        if mode not in self._traced:
            self._traced[mode] = self._trace_fn(inputs)
        self._last = self._traced[mode]
        return self._last

    @property
    def plan(self):
        return self._last.plan

    @property
    def gm(self):
        return self._last.gm

    @property
    def nodes(self):
        return self._last.nodes

    def forward(self, *inputs):
        if not torch.is_grad_enabled():  # nothing is saved: the model itself, in its current mode
            return self.module(*inputs)
        traced = self._for_mode(inputs)
        if not traced.plan.units:
            return self.module(*inputs)
        call = _ForwardCall(self, traced)
        with torch.autograd.graph.saved_tensors_hooks(call.pack, _unpack):
            out = self._run(traced, inputs, call)
        for state in call.states.values():
            u = state.unit
            state.inputs = {f: call.frontier[f] for f in u.frontier}
            state.versions = {f: v._version for f, v in state.inputs.items() if isinstance(v, torch.Tensor)}
            state.rng = {n: call.rng[n] for n in u.nodes if n in call.rng}
            state.uses += state.handles
            if state.handles:
                state.deps = {d: call.states[d] for d in u.deps}
                for dep in state.deps.values():
                    dep.uses += 1
        for state in call.states.values():
            state.pending = state.uses
        # Every saved tensor keeps a reference to the hook pair, hence to `call`: empty it, so that each
        # unit's state (and what its recompute reads) dies with the last gradient that needs it.
        call.states, call.by_key, call.frontier, call.rng = {}, {}, {}, {}
        return out  # each forgotten storage died at its last use in forward: autograd holds only handles

    def _run(self, traced, inputs, call):
        placeholders = [n for n in traced.nodes if n.op == "placeholder"]
        if len(inputs) != len(placeholders):
            raise ValueError(f"tensor_ckpt: expected {len(placeholders)} inputs "
                             f"({[n.name for n in placeholders]}), got {len(inputs)}")
        env = dict(zip(placeholders, inputs))
        for n in traced.nodes:
            if n.op == "output":
                return fx.node.map_arg(n.args[0], env.__getitem__)
            if n.op != "placeholder":
                if n in traced._random:  # remember the generator so the recompute draws the same mask
                    device = _device_of(n, env)
                    call.rng[n] = (*_rng_state(device), device)
                if n in call.states:
                    call.packed_in_root = []
                env[n] = run_node(traced.gm, n, env)
            v = env[n]
            if n in traced._frontier:  # kept anyway (autograd saves it): this reference costs no memory
                call.frontier[n] = v.detach() if isinstance(v, torch.Tensor) else v
            if n in call.states:
                call.register(call.states[n], v)
            for m in traced._drop_after.get(n, ()):
                del env[m]


def _device_of(n, env):
    t = next(iter(_tensors_in([env[m] for m in n.all_input_nodes])), None)
    return t.device if t is not None else torch.device("cpu")


def checkpoint_tensors(module, example_inputs, forget=None, leaf_modules=()):
    """Trace ``module`` concretely on ``example_inputs`` and return it with its marked tensors forgotten.

    ``forget``: None to use the ``forget()`` marks in the forward, or a list of FX node names to forget
    instead (try annotations without editing the model). ``leaf_modules``: module classes FX should not
    trace into. The returned module shares ``module``'s parameters; ``.plan`` says what will happen.
    """
    def trace_and_plan(inputs):
        empty = [tuple(t.shape) for t in _tensors_in(inputs) if t.numel() == 0]
        if empty:
            raise ValueError(f"tensor_ckpt: an example input is empty (shape {empty[0]}): an empty "
                             "batch allocates no storage, so nothing can be planned. Trace with a "
                             "batch of at least one sample.")
        gm = trace(module, leaf_modules)
        with _state_kept(module):  # the example run must not move BatchNorm's statistics
            infos, saved_keys = profile(gm, tuple(inputs))
        return _Traced(gm, make_plan(gm, infos, saved_keys, forget))

    ckpt = TensorCheckpoint(module, trace_and_plan)
    ckpt._for_mode(tuple(example_inputs))
    return ckpt


@contextlib.contextmanager
def _state_kept(module):
    """Run the body, then put every buffer back (running statistics, num_batches_tracked)."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


# ---------------------------------------------------------------------------------------------------
# 4. Demo: a transformer block stack with V4-style marks, trained data-parallel
# ---------------------------------------------------------------------------------------------------

class Block(nn.Module):
    """Pre-norm transformer layer, marked V4-style: forget what is large and cheap, keep the matmuls."""

    def __init__(self, dim, n_heads, mlp_ratio=4):
        super().__init__()
        self.n_heads = n_heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, mlp_ratio * dim), nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        h = forget(self.norm1(x))                    # one pass over x to redo; x is kept by the norm
        q, k, v = self.qkv(h).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # Not forgotten: this reshape is a view of the attention output (the kernels lay it out so), and a
        # view shares its base's storage, so forgetting it would mean recomputing attention itself.
        y = y.transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        h = forget(self.norm2(x))
        h = forget(F.gelu(self.fc1(h)))              # 4x wide; GELU is redone from fc1's output
        return x + self.fc2(h)


class TinyLM(nn.Module):
    def __init__(self, vocab=64, dim=128, n_heads=4, n_layers=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*[Block(dim, n_heads) for _ in range(n_layers)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.norm(self.blocks(self.embed(tokens))))


class LiveStorages(TorchDispatchMode):
    """Measure, not model: remember every storage an op creates; ``live_bytes()`` sums those still alive."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors_in((args, kwargs))}
        self.refs += [weakref.ref(t.untyped_storage()) for t in _tensors_in(out)  # views allocate nothing
                      if t.untyped_storage().data_ptr() not in inputs]
        return out

    def live_bytes(self):
        alive = {id(s): s.nbytes() for s in (r() for r in self.refs) if s is not None}
        return sum(alive.values())


def activation_bytes(model, *inputs):
    """Bytes created by one forward and still alive after it: what the autograd graph holds for backward."""
    with LiveStorages() as live:
        out = model(*inputs)
    held = live.live_bytes() - sum(t.untyped_storage().nbytes() for t in _tensors_in(out))
    return held, out


def agree_across_ranks(fields, error=None, group=None):
    """All ranks run this before their first collective: every rank must hold the same ``fields``.

    ``fields``: {name: value} of what must agree (shapes, dtypes, hyperparameters, a digest of the
    initial parameters). ``error``: this rank's failed local validation, if any; it travels in the
    same gather, so every rank raises it and none is left waiting in a collective. On a mismatch every
    rank raises the same ValueError naming the field and which ranks hold which value.
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
            parts = [f"rank {','.join(map(str, rs))} {'have' if len(rs) > 1 else 'has'} "
                     f"{v if len(v) <= 80 else v[:77] + '...'}" for v, rs in holders.items()]
            problems.append(f"{key} differs across ranks: " + ", ".join(parts))
    raise ValueError("tensor_ckpt: " + "; ".join(problems))


def replica_fields(module, example_inputs, settings):
    """What data-parallel replicas must share: inputs' layout, parameters and their initial values."""
    params = [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    values = hashlib.sha256()
    for p in module.parameters():  # exact, unlike a sum: any differing bit changes the digest
        values.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return {
        "example input shapes": [tuple(t.shape) for t in _tensors_in(example_inputs)],
        "example input dtypes": [str(t.dtype) for t in _tensors_in(example_inputs)],
        "parameter shapes and dtypes": hashlib.sha256(repr(params).encode()).hexdigest()[:16],
        "initial parameter values (sha256)": values.hexdigest()[:16],
        "training mode": module.training,
        **settings,
    }


def checkpoint_data_parallel(module, example_inputs, settings, group=None, **kwargs):
    """checkpoint_tensors on every rank, then the agreement guard, then DDP (world > 1).

    A rank whose plan is refused still joins the guard carrying its error, so all ranks raise it.
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
    device = next(iter(_tensors_in(example_inputs))).device
    ids = [device] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(ckpt, device_ids=ids, process_group=group)


def _setup():
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def main(steps=30, batch=8, seq=64, vocab=64):
    rank, world, device = _setup()
    torch.manual_seed(0)
    model = TinyLM(vocab).to(device)
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own data shard

    def batch_of_tokens():  # a sequence that follows a fixed rule, so the loss has something to learn
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        return ((start + 7 * torch.arange(seq + 1)) % vocab).to(device)

    tokens = batch_of_tokens()
    settings = dict(steps=steps, batch=batch, seq=seq, vocab=vocab, lr=3e-3)
    if world > 1:  # the agreement guard runs before DDP's first broadcast
        train = checkpoint_data_parallel(model, (tokens[:, :-1],), settings)
        ckpt = train.module
    else:
        ckpt = train = checkpoint_tensors(model, example_inputs=(tokens[:, :-1],))
    if rank == 0:
        print(ckpt.plan)

    # exactness: the same batch through the plain model and the checkpointed one
    grads = []
    for m in (model, ckpt):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    exact = all(torch.equal(a, b) for a, b in zip(*grads))
    plain_bytes, _ = activation_bytes(model, tokens[:, :-1])
    ckpt_bytes, _ = activation_bytes(ckpt, tokens[:, :-1])
    if rank == 0:
        print(f"gradients bitwise equal to the plain model: {exact}")
        print(f"activation memory after forward (measured): plain {_mib(plain_bytes)}, tensor_ckpt "
              f"{_mib(ckpt_bytes)}, saved {_mib(plain_bytes - ckpt_bytes)} (plan: {_mib(ckpt.plan.bytes_freed)})")

    opt = torch.optim.AdamW(model.parameters(), lr=settings["lr"])
    start = time.perf_counter()
    for step in range(steps):
        tokens = batch_of_tokens()
        loss = F.cross_entropy(train(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}")
    if rank == 0:
        print(f"{steps} steps on {world} rank(s), {device.type}: {time.perf_counter() - start:.2f}s, "
              f"{ckpt.recomputations} recompute subgraphs run in backward")
    if world > 1:
        gc.collect()  # drop cycles that still reach gloo state now, not during interpreter shutdown (it can abort)
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    main(parser.parse_args().steps)
