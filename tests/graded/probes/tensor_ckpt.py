"""Probes for tests/graded/test_tensor_ckpt.py: they run tensor_ckpt's code in the sandbox and
return what it did (tensors, counts, names). The verdicts and the references (the plain models,
autograd without checkpointing) live in the test.

The models are the test's (models_tensor_ckpt), with forget() marks; ``marks=False`` builds them
unmarked, so a probe of one region does not run forget(). Each region's probe builds the others'
effects by hand (a LiveStorage, a ForwardCall, a stand-in storage) and reports what the region did
to them.
"""

import types
import warnings

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from models_tensor_ckpt import (
    Chain,
    Gate,
    LiveBytes,
    OpCount,
    build,
    measured_run,
    unmarked,
)
from torch.utils.flop_counter import FlopCounterMode

import tensor_ckpt as tc


def model_of(name, state, marks=True):
    model = build(name, mark=tc.forget if marks else unmarked)
    model.load_state_dict(state)
    return model


def plan_summary(plan):
    names = lambda nodes: [n.name for n in nodes]  # noqa: E731
    return {
        "units": [
            {
                "name": u.name,
                "members": list(u.members),
                "nodes": names(u.nodes),
                "frontier": names(u.frontier),
                "deps": names(u.deps),
                "random_nodes": list(u.random_nodes),
            }
            for u in plan.units
        ],
        "bytes_freed": plan.bytes_freed,
        "recompute_flops": plan.recompute_flops,
        "held_bytes": plan.held_bytes,
        "table": str(plan),
    }


# ---- forget ----
def forget_marks(ops, marked, state, x):
    """forget() run eagerly, the forget nodes a trace of the Chain marked at ``marked`` records,
    and the outputs of that Chain run eagerly and of its trace."""
    model = Chain(ops, marked, mark=tc.forget)
    model.load_state_dict(state)
    gm = tc.trace(model)
    marks = [n for n in gm.graph.nodes if n.target is tc.forget]
    with torch.no_grad():
        eager, traced = model(x), gm(x)
    return {
        "eager_is_x": tc.forget(x) is x,
        "marked": [[a.name if isinstance(a, fx.Node) else repr(a) for a in m.args] for m in marks],
        "ops": [m.op for m in marks],
        "eager": eager,
        "traced": traced,
    }


# ---- storage_units ----
def storage_units_of(infos):
    """storage_units on made-up nodes: ``infos`` is [(name, is_tensor, key, nbytes)]."""
    made = {
        name: tc.NodeInfo(is_tensor=is_tensor, key=("cpu", key), nbytes=nbytes)
        for name, is_tensor, key, nbytes in infos
    }
    return [[list(key), list(nodes)] for key, nodes in tc.storage_units(list(made), made).items()]


def attention_units(state, x):
    """storage_units on the traced, profiled Attention: the units (names), and per tensor node
    its storage (numbered in order of first appearance) and bytes, read from the example run."""
    gm = tc.trace(model_of("attention", state, marks=False))
    infos, _ = tc.profile(gm, (x,))
    keys = {}
    storages = {
        n.name: [keys.setdefault(infos[n].key, len(keys)), infos[n].nbytes]
        for n in gm.graph.nodes
        if infos[n].is_tensor
    }
    units = tc.storage_units(list(gm.graph.nodes), infos)
    return {"units": [[n.name for n in nodes] for nodes in units.values()], "storages": storages}


# ---- recompute_subgraph ----
def subgraphs(state, x):
    """recompute_subgraph on x -> relu -> sin -> cos -> add(cos, x), and on the traced Attention's
    softmax with x, qkv and buffers kept: [(nodes, frontier)] as names."""
    g = fx.Graph()
    px = g.placeholder("x")
    a = g.call_function(torch.relu, (px,))
    b = g.call_function(torch.sin, (a,))
    c = g.call_function(torch.cos, (b,))
    d = g.call_function(torch.add, (c, px))
    g.output(d)
    names = lambda nodes: sorted(n.name for n in nodes)  # noqa: E731
    out = {}
    for label, kept in (("kept x", {px}), ("kept x, sin", {px, b})):
        nodes, frontier = tc.recompute_subgraph(d, kept.__contains__)
        out[label] = [names(nodes), names(frontier)]
    gm = tc.trace(model_of("attention", state, marks=False))
    softmax = next(n for n in gm.graph.nodes if n.name == "softmax")
    nodes, frontier = tc.recompute_subgraph(
        softmax, lambda n: n.name in ("x", "qkv") or n.op == "get_attr"
    )
    out["softmax"] = [names(nodes), names(frontier), sorted(n.op for n in frontier)]
    return out


def plan_of(name, state, x, names=None, leaf_gate=False):
    """The plan checkpoint_tensors makes (no forward or backward runs)."""
    leaf = (Gate,) if leaf_gate else ()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a forget that recomputes a matmul says so
        ckpt = tc.checkpoint_tensors(model_of(name, state), (x,), names=names, leaf_modules=leaf)
    return plan_summary(ckpt.plan)


def geometry(dtype, size, stride, offset):
    return [str(dtype), list(size), list(stride), offset]


# ---- pack_hook: a ForwardCall and a LiveStorage made by hand, no plan ----
def pack_cases():
    """What pack_hook makes of each tensor one forgotten op's forward saves: the op's input x
    (before and while the op runs), its output y (while it runs, before it is registered), a
    transposed view of y and an unrelated tensor (after it is registered)."""
    owner = types.SimpleNamespace(module=nn.Identity(), recomputations=0)
    live = tc.LiveStorage(None, owner, tc.autocast_state())
    call = tc.ForwardCall({"root": live})
    x, w = torch.randn(4, 6, requires_grad=True), torch.randn(6, 8)
    packed = {"input, before": (tc.pack_hook(call, x), x)}
    call.opening = []  # the forgotten op runs: it saves its input, then its own output
    packed["input, while the op runs"] = (tc.pack_hook(call, x), x)
    y = torch.softmax(x @ w, dim=-1)
    packed["output, before it is registered"] = (tc.pack_hook(call, y), y)
    call.register_root(live, y)
    yt, other = y.t(), torch.randn(3, requires_grad=True)
    packed["transposed view of the output"] = (tc.pack_hook(call, yt), yt)
    packed["input, after"] = (tc.pack_hook(call, x), x)
    packed["unrelated tensor"] = (tc.pack_hook(call, other), other)
    out = {}
    for label, (p, t) in packed.items():
        kept = p.tensor is not None
        out[label] = {
            "type": type(p).__name__,
            "handle": p.storage is live,
            "kept": kept,
            "geometry": geometry(*p.geometry) if p.geometry is not None else None,
            "version": p.version,
            "same_data": kept and p.tensor.data_ptr() == t.data_ptr(),
            "requires_grad": kept and p.tensor.requires_grad,
        }
        out[label]["its_geometry"] = geometry(t.dtype, t.size(), t.stride(), t.storage_offset())
    out["handles"] = live.handles
    # a second forgotten op reads y (a forgotten storage: a handle at once) and saves its output
    second = tc.LiveStorage(None, owner, tc.autocast_state())
    call.storages["second"] = second
    call.opening, read, made, error = [], None, None, None
    try:
        read = tc.pack_hook(call, y)
        z = torch.exp(y)
        made = tc.pack_hook(call, z)
        call.register_root(second, z)
    except Exception as e:  # a handle queued as if it were a kept tensor
        error = f"{type(e).__name__}: {e}"
    out["second op"] = {
        "read_handle": read is not None and read.storage is live,
        "made_handle": made is not None and made.storage is second,
        "handles": [live.handles, second.handles],
        "error": error,
    }
    return out


# ---- unpack_hook: a stand-in storage, no recompute ----
class StandIn:
    """Stands in for a LiveStorage: a recomputed value and a count of recomputes and releases."""

    def __init__(self):
        self.value, self.recomputes, self.releases = torch.arange(12.0).view(3, 4), 0, 0

    def recompute(self):
        self.recomputes += 1
        return self.value

    def release(self):
        self.releases += 1


def unpack_cases():
    """unpack_hook on a handle (a transposed slice of the stand-in's value), on a kept tensor, and
    on a kept tensor modified in place after it was saved."""
    storage = StandIn()
    geometry = (torch.float32, torch.Size([4, 2]), (1, 4), 1)
    alias = tc.unpack_hook(tc.Packed(None, 0, storage=storage, geometry=geometry))
    kept = torch.randn(3)
    back = tc.unpack_hook(tc.Packed(kept, kept._version))
    changed = torch.randn(3)
    packed = tc.Packed(changed, changed._version)
    changed.add_(1)
    try:
        tc.unpack_hook(packed)
        refused = None
    except RuntimeError as err:
        refused = str(err)
    return {
        "alias": alias,
        "alias_layout": [list(alias.shape), list(alias.stride()), alias.storage_offset()],
        "alias_shares_storage": alias.untyped_storage().data_ptr()
        == storage.value.untyped_storage().data_ptr(),
        "value": storage.value,
        "recomputes": storage.recomputes,
        "releases": storage.releases,
        "kept": kept,
        "kept_back": back,
        "kept_same_data": back.data_ptr() == kept.data_ptr(),
        "in_place_refused": refused,
    }


# ---- LiveStorage.recompute: units and LiveStorages made by hand, no hooks ----
def live_storages(model, x_name_values, specs):
    """A LiveStorage per spec (name, its nodes, frontier, deps, uses) on ``model``'s trace, as
    run_forgetting leaves them after forward; the owner counts recomputations."""
    gm = tc.trace(model)
    node = {n.name: n for n in gm.graph.nodes}
    owner = types.SimpleNamespace(module=model, recomputations=0)
    made = {}
    for name, nodes, frontier, deps, uses, geo in specs:
        unit = tc.ForgottenUnit(
            name=name,
            members=[name],
            root=node[name],
            nodes=[node[n] for n in nodes],
            frontier=[node[f] for f in frontier],
            deps=[node[d] for d in deps],
            shape=geo[1],
            nbytes=geo[4],
            saved=True,
            op_flops=[],
            random_nodes=[],
        )
        live = made[name] = tc.LiveStorage(unit, owner, tc.autocast_state(), geometry=geo)
        live.inputs = {node[f]: x_name_values[f] for f in frontier}
        live.versions = {node[f]: x_name_values[f]._version for f in frontier}
        live.deps = {node[d]: made[d] for d in deps}
        live.uses = live.pending = uses
    return made, owner, node


def storage_geometry(t):
    return (*tc.geometry_of(t), t.untyped_storage().nbytes())


def recompute_cases(state, x):
    """The MLP with fc1's and the GELU's storages forgotten: the GELU's recompute reads fc1's
    (a dependency), fc1's is also read by a gradient. Two backwards run by hand (the graph
    retained): unpack the GELU, then fc1, releasing each."""
    model = model_of("mlp", state, marks=False)
    with torch.no_grad():
        h = model.fc1(x)
        g = F.gelu(h)
    made, owner, _ = live_storages(
        model,
        {"x": x},
        [
            ("fc1", ["fc1"], ["x"], [], 2, storage_geometry(h)),
            ("gelu", ["gelu"], [], ["fc1"], 1, storage_geometry(g)),
        ],
    )
    fc1, gelu = made["fc1"], made["gelu"]
    rounds = []
    for _ in range(2):
        with FlopCounterMode(display=False) as flops:
            g1 = gelu.recompute()
            dep_pending = fc1.pending
            g2 = gelu.recompute()  # a second saved alias of the same storage
            gelu.release()
            h1 = fc1.recompute()
            fc1.release()
        rounds.append(
            {
                "gelu": g1.detach().clone(),
                "fc1": h1.detach().clone(),
                "cached": g2 is g1,
                "requires_grad": g1.requires_grad or h1.requires_grad,
                "has_graph": g1.grad_fn is not None or h1.grad_fn is not None,
                "dep_pending_after_read": dep_pending,
                "held_after": [fc1.value is not None, gelu.value is not None],
                "flops": flops.get_total_flops(),
                "recomputations": owner.recomputations,
            }
        )
    return rounds


def dropout_case(state, h, seed):
    """DropoutMLP's dropout output forgotten, recomputed from fc1's output ``h``: the generator
    is seeded, snapshotted as the forward would, then moved on before the recompute."""
    model = model_of("dropout_mlp", state, marks=False).train()
    with torch.no_grad():
        torch.manual_seed(seed)
        d = model.drop(F.gelu(h))
    made, owner, node = live_storages(
        model, {"fc1": h}, [("drop", ["gelu", "drop"], ["fc1"], [], 1, storage_geometry(d))]
    )
    live = made["drop"]
    torch.manual_seed(seed)
    live.rng = {node["drop"]: tc.rng_snapshot(torch.device("cpu"))}
    torch.rand(100)  # the rest of forward draws on
    before = torch.get_rng_state()
    value = live.recompute().clone()
    return {"value": value, "generator_restored": torch.equal(torch.get_rng_state(), before)}


# ---- the whole checkpoint ----
def checkpointed(name, state, x, weights, names=None):
    """checkpoint_tensors(model) run forward and backward, measured as measured_run does."""
    model = model_of(name, state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt = tc.checkpoint_tensors(model, (x.detach().requires_grad_(),), names=names)
    out = measured_run(model, ckpt, x, weights)  # its ops in backward count the recomputes
    out["plan"] = plan_summary(ckpt.plan)
    return out


def forward_bytes(cases, x, weights):
    """Per model name: bytes the checkpointed forward leaves alive (output included), what its
    plan says it frees, the output, and the ops the backward of sum(out * weights) then runs
    (the recomputes of what was freed). ``cases``: [(name, state)]."""
    out = {}
    for name, state in cases:
        model = model_of(name, state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt = tc.checkpoint_tensors(model, (x.detach().requires_grad_(),))
        x = x.detach().clone().requires_grad_()
        with LiveBytes([x, *model.parameters(), *model.buffers()]) as meter:
            y = ckpt(x)
            out[name] = {"fwd_bytes": meter.now, "bytes_freed": ckpt.plan.bytes_freed}
        out[name]["out"] = y.detach().clone()
        with OpCount() as ops:
            torch.autograd.grad((y * weights).sum(), [*model.parameters(), x])
        out[name]["bwd_ops"] = dict(ops.counts)
        del y
    return out


def data_parallel(rank, world_size, state, shard):
    """Each rank checkpoints its replica of the Block on its shard (handed to it alone): gradients
    averaged by all_reduce over the first n ranks for every n, and through DDP over all ranks."""
    import torch.distributed as dist

    model = model_of("block", state)
    x = shard.clone().requires_grad_()
    try:  # a bad annotation is refused on every rank before any collective, so nobody waits
        tc.checkpoint_tensors(model, (x,), names=["no_such_tensor"])
        refused = False
    except ValueError:
        refused = True
    ckpt = tc.checkpoint_tensors(model, (x,))
    model.zero_grad(set_to_none=True)
    ckpt(x).square().sum().backward()
    local = [p.grad.clone() for p in model.parameters()]
    reduced = {}
    for n in range(1, world_size + 1):
        group = dist.new_group(list(range(n)))  # every rank joins every new_group call
        if rank < n:
            reduced[n] = [g.clone() for g in local]
            for g in reduced[n]:
                dist.all_reduce(g, group=group)
                g /= n
    model.zero_grad(set_to_none=True)
    ddp = nn.parallel.DistributedDataParallel(ckpt)
    ddp(x).square().sum().backward()
    return {
        "refused": refused,
        "reduced": [[n, grads] for n, grads in reduced.items()],
        "ddp": [p.grad.clone() for p in model.parameters()],
    }
