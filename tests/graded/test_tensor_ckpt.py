"""Graded tests of tensor_ckpt.py. The student's code runs in the sandbox (probes/tensor_ckpt.py);
every reference is computed here: the same models without forget() marks, run by plain autograd,
and torch.utils.checkpoint. Gradients are compared with torch.equal: recomputation re-runs the
same fp32 kernels on the same inputs, so anything short of bitwise equality is a bug, not rounding.
Memory is counted here and in the probe by the same meter (the storages ops create that are still
alive), FLOPs by FlopCounterMode, recomputes by the ops backward runs (OpCount: a forgotten
storage's op runs again there), never by a count the checkpoint keeps. The one tolerance:
data-parallel gradients against one process on the whole batch, where the batch sum is split
differently (fp32, rtol 1e-5).

Each region has tests that run it alone: the probe builds what the other regions would have made
(a LiveStorage, a ForwardCall, a stand-in storage), so a wrong region fails its own tests and the
others' tests name it as the cause. `needs` lists the regions a test runs besides its own.
"""

import functools

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from sandbox import call, on_ranks

from graded.expected import DRAW, case_seed, generator, hidden, stored
from graded.models_tensor_ckpt import CHAIN_OPS, B, C, Chain, H, T, build, measured_run

# The private suite runs these in its slow tier: CI grades the reference with every graded
# test (make grade-fit); test_sandbox.py and test_memory_timeline.py stay in its default tier.
pytestmark = pytest.mark.slow

F32 = 4  # bytes
# the models' weights and inputs move with the draw at grading time, a hash per seed
GEN = torch.Generator().manual_seed(case_seed(0, "tensor_ckpt"))
REGIONS = ("forget", "storage_units", "recompute_subgraph", "LiveStorage.recompute", "pack_hook",
           "unpack_hook")  # fmt: skip
PLAN = ("tensor_ckpt.forget", "tensor_ckpt.storage_units")  # what checkpoint_tensors' plan runs
FORWARD = (*PLAN, "tensor_ckpt.recompute_subgraph")  # and what a forward runs besides pack_hook


def ALL_BUT(region):
    """A graded test that runs the whole checkpoint needs every other region."""
    return tuple(f"tensor_ckpt.{r}" for r in REGIONS if r != region)


# ---- the models, unmarked (the probe passes forget() as their mark), and their references ----
def plain(name, seed=0):
    """The unmarked model, its state (what the probe loads), and an input."""
    torch.manual_seed(case_seed(seed, "tensor_ckpt"))
    model = build(name)
    return model, model.state_dict(), torch.randn(B, T, C)


def gradients(model, fn, x, weights):
    """Output and gradients of sum(fn(x) * weights), unmeasured (torch.utils.checkpoint)."""
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    grads = torch.autograd.grad((out * weights).sum(), [*model.parameters(), x])
    return {"out": out.detach(), "grads": list(grads)}


def weights_for(x):  # not all-ones: each output element its own weight
    return torch.linspace(-1, 1, x.numel()).view_as(x)


def assert_finite_tensor(got, ref, what):
    """``got`` is a finite tensor of ``ref``'s dtype and shape (a worker's value is checked here
    before it is compared)."""
    assert isinstance(got, torch.Tensor), f"{what} is a {type(got).__name__}, not a tensor"
    assert got.dtype == ref.dtype and got.shape == ref.shape, (
        f"{what} is {got.dtype} {tuple(got.shape)}, expected {ref.dtype} {tuple(ref.shape)}"
    )
    assert torch.isfinite(got).all(), f"{what} holds NaN or inf"


def assert_bitwise(ours, ref, model, what):
    names = [n for n, _ in model.named_parameters()] + ["the input x"]
    assert_finite_tensor(ours["out"], ref["out"], f"{what}: the output")
    diff = (ours["out"] - ref["out"]).abs().max()
    assert torch.equal(ours["out"], ref["out"]), f"{what}: the output differs by {diff:.3g}"
    for name, a, b in zip(names, ours["grads"], ref["grads"], strict=True):
        assert torch.equal(a, b), (
            f"{what}: the gradient of {name} differs by {(a - b).abs().max():.3g}"
        )


# per model, the op that makes each forgotten storage: a recompute runs it in backward, where the
# plain model's backward never does (counted by the meter, not read off the checkpoint)
ROOT_OPS = {
    "mlp": {"aten.gelu.default": 1},
    "attention": {"aten._softmax.default": 1},
    "block": {"aten.native_layer_norm.default": 2, "aten.gelu.default": 1},
    "view_and_base": {"aten.addmm.default": 1},  # fc: h and the views of it, one storage
    "attention_qkv": {"aten.addmm.default": 0},  # qkv is never saved: nothing to recompute
    "stack": {"aten.native_layer_norm.default": 8, "aten.gelu.default": 4},
}


# ---- a chain drawn at grading time: what its checkpoint must cost comes from the zip ----
# Bytes, FLOPs and op counts are measured in the worker, so each test that scores them also
# checkpoints this chain, whose costs a reference that traces and recomputes nothing found here
# (tests/graded/hidden/, only in the autograder zip; the public chain's costs are stored).
HIDDEN = hidden("tensor_ckpt")


def chain_case():
    """build()'s name of the chain: the public one, or at grading time drawn ops and marks
    (never the last op: the model's output is not forgotten)."""
    ops, marked = ("tanh", "gelu", "sin", "relu", "cos"), (0, 1, 3)
    if DRAW:
        gen, names = torch.Generator().manual_seed(case_seed(13, "tensor_ckpt")), sorted(CHAIN_OPS)
        n = 4 + int(torch.randint(3, (1,), generator=gen))
        ops = [names[i] for i in torch.randint(len(names), (n,), generator=gen).tolist()]
        many = 1 + int(torch.randint(n - 1, (1,), generator=gen))
        marked = sorted(torch.randperm(n - 1, generator=gen)[:many].tolist())
    return f"chain:{','.join(ops)}:{','.join(map(str, marked))}"


CHAIN = chain_case()


@functools.cache  # the zip's reference runs the chain once for every test that reads it
def chain_costs():
    """{"freed": bytes, "extra_ops": {aten op: runs}} of checkpointing CHAIN."""
    _, ops, marked = CHAIN.split(":")
    _, state, x = plain(CHAIN)
    ops, marked = ops.split(","), [int(i) for i in marked.split(",")]
    costs = lambda: HIDDEN.chain_checkpoint_costs(ops, marked, state, x)  # noqa: E731
    return stored("tensor_ckpt", "chain", costs)


def expected_recomputes(name):
    """{aten op: how many more times one backward runs it than the plain model's}."""
    if name != CHAIN:
        return ROOT_OPS[name]
    extra = chain_costs()["extra_ops"]  # every op of the chain is counted: none runs more
    ops = {f"aten.{op}.default" for op in CHAIN.split(":")[1].split(",")} | {"aten.addmm.default"}
    return {op: extra.get(op, 0) for op in sorted(ops | set(extra))}


def assert_recomputed_once(ours, ref, name):
    """Each forgotten storage's op ran once more in backward than in the plain model's (and the
    ops its recompute needs that nothing kept, with it)."""
    assert isinstance(ours.get("bwd_ops"), dict), "the op counts of backward are missing"
    for op, times in expected_recomputes(name).items():
        extra = ours["bwd_ops"].get(op, 0) - ref["bwd_ops"].get(op, 0)
        assert extra == times, (
            f"each forgotten storage is recomputed once per backward: {name}'s backward ran "
            f"{op} {extra} more times than the plain model's, expected {times}"
            + (" (nothing was recomputed: was anything forgotten?)" if extra == 0 else "")
        )


def assert_the_chain_costs_what_it_must():
    """The checkpointed CHAIN: its values, and the bytes, FLOPs and ops the zip's reference
    says forgetting its marks frees and adds."""
    ours, ref, model, *_ = checkpointed(CHAIN)
    assert_bitwise(ours, ref, model, f"the checkpointed {CHAIN} against the plain model")
    costs = chain_costs()
    for key in ("fwd_bytes", "bwd_flops"):
        assert type(ours.get(key)) is int, f"{CHAIN}: the measured {key} is not an int"
    freed = ref["fwd_bytes"] - ours["fwd_bytes"]
    assert freed == costs["freed"], (
        f"a marked output that autograd saves is freed in forward, one it does not save frees "
        f"nothing: {CHAIN} freed {freed} bytes, expected {costs['freed']}"
    )
    assert_recomputed_once(ours, ref, CHAIN)
    fc = costs["extra_ops"].get("aten.addmm.default", 0) * 2 * B * T * C * C
    extra = ours["bwd_flops"] - ref["bwd_flops"]
    assert extra == fc and ours["plan"]["recompute_flops"] == fc, (
        f"{CHAIN}'s backward ran {extra} FLOPs more than the plain model's and its plan says "
        f"{ours['plan']['recompute_flops']}, expected {fc} (the linear layer re-run when its "
        "output is needed and not kept)"
    )


_RUNS = {}


def checkpointed(name):
    """The probe's checkpointed run of model ``name`` and the plain run here, once per session."""
    if name not in _RUNS:
        model, state, x = plain(name)
        weights = weights_for(model(x))
        ours = call("tensor_ckpt:checkpointed", name, state, x, weights)
        _RUNS[name] = ours, measured_run(model, model, x, weights), model, x, weights
    return _RUNS[name]


# ---- forget ----
@pytest.mark.grade(points=1, solution="tensor_ckpt.forget")
def test_forget_is_the_identity_eagerly_and_a_node_under_tracing():
    # a linear layer and elementwise ops, some outputs marked; at grading time the ops, which of
    # them are marked, the weights and the input are drawn
    ops, marked = ("gelu",), (0,)
    if DRAW:
        gen, names = torch.Generator().manual_seed(case_seed(11, "tensor_ckpt")), sorted(CHAIN_OPS)
        ops = [names[i] for i in torch.randint(len(names), (3,), generator=gen).tolist()]
        many = 1 + int(torch.randint(3, (1,), generator=gen))
        marked = sorted(torch.randperm(3, generator=gen)[:many].tolist())
    torch.manual_seed(case_seed(11, "tensor_ckpt"))
    model, x = Chain(ops, marked), torch.randn(B, T, C)
    nodes = [n.name for n in fx.symbolic_trace(model).graph.nodes if n.op == "call_function"]
    with torch.no_grad():
        want = model(x)
    got = call("tensor_ckpt:forget_marks", ops, marked, model.state_dict(), x)
    assert got["eager_is_x"] is True, (
        "forget(x) must return x itself when run eagerly (the identity, no copy)"
    )
    expected = [[nodes[i]] for i in marked]
    assert got["marked"] == expected and got["ops"] == ["call_function"] * len(marked), (
        "under tracing forget(proxy) must record one call_function node with target forget and "
        f"the marked tensor as its argument; the trace of {' -> '.join(ops)} marked at {marked} "
        f"has {got['marked']} ({got['ops']}), expected {expected}"
    )
    for label in ("eager", "traced"):
        assert_finite_tensor(got[label], want, f"the marked model's {label} output")
        assert torch.equal(got[label], want), (
            f"forget must not change the value it marks: the marked model's {label} output "
            f"differs from the unmarked one by {(got[label] - want).abs().max():.3g}"
        )


# ---- storage_units ----
@pytest.mark.grade(points=1, solution="tensor_ckpt.storage_units")
def test_storage_units_are_one_per_storage_in_execution_order():
    # made-up nodes: a base and its view share a key; empty tensors share the null address but
    # nothing else, so they belong to no unit
    # at grading time the names and addresses are drawn
    one, two = (1, 2) if DRAW == 0 else torch.randperm(2**20, generator=GEN)[:2].add(1).tolist()
    base, other, view = (f"{n}{DRAW or ''}" for n in ("base", "other", "view"))
    infos = [
        (base, True, one, 8),
        (other, True, two, 8),
        (view, True, one, 8),
        ("size", False, None, 0),
        ("empty", True, 0, 0),
        ("empty_too", True, 0, 0),
    ]
    units = {tuple(key): nodes for key, nodes in call("tensor_ckpt:storage_units_of", infos)}
    assert sorted(map(sorted, units.values())) == sorted([sorted([base, view]), [other]]) or (
        ("cpu", 0) in units
    ), f"a view and its base (one storage key) must be one unit, one per storage: got {units}"
    assert ("cpu", 0) not in units, (
        f"empty tensors (0 bytes) share the null address, not a storage: no unit for them: {units}"
    )
    assert units[("cpu", one)] == [base, view], (
        "each unit lists its nodes in execution order, the one that wrote the storage first: got "
        f"{units[('cpu', one)]}"
    )


@pytest.mark.grade(points=2, solution="tensor_ckpt.storage_units")
def test_storage_units_group_views_of_the_traced_attention():
    _, state, x = plain("attention")
    got = call("tensor_ckpt:attention_units", state, x)
    units, storages = got["units"], got["storages"]
    qkv = next((u for u in units if "qkv" in u), [])
    assert {"qkv", "getitem", "getitem_1", "getitem_2"} <= set(qkv), (
        "a view and its base (one storage key) must be one unit: qkv and its split live in one "
        f"storage, got the unit {qkv}"
    )
    assert not any("reshape" in u and "matmul_1" in u for u in units), (
        "the reshape after a transpose copies: it is a storage of its own, not matmul_1's unit"
    )
    for u in units:
        assert len({storages[n][0] for n in u}) == 1, f"a unit holds one storage, {u} holds more"
        assert all(storages[n][1] > 0 for n in u), f"empty tensors (0 bytes) belong to no unit: {u}"
    listed = [n for u in units for n in u]
    expected = [n for n, (_, nbytes) in storages.items() if nbytes > 0]  # in execution order
    assert sorted(listed) == sorted(expected), (
        f"every tensor node with bytes belongs to one unit: missing "
        f"{sorted(set(expected) - set(listed))}, twice or extra "
        f"{sorted(n for n in set(listed) if listed.count(n) > 1 or n not in expected)}"
    )
    assert len({storages[u[0]][0] for u in units}) == len(units), "one unit per storage"
    for u in units:
        assert u == [n for n in expected if n in u], (
            f"each unit lists its nodes in execution order: got {u}"
        )


# ---- recompute_subgraph ----
@pytest.mark.grade(points=1, solution="tensor_ckpt.recompute_subgraph")
def test_recompute_subgraph_walks_back_to_kept_nodes():
    _, state, x = plain("attention")
    got = call("tensor_ckpt:subgraphs", state, x)
    # x -> relu -> sin -> cos -> add(cos, x); nodes to re-run and the kept nodes they read
    for label, nodes, frontier in [
        ("kept x", ["add", "cos", "relu", "sin"], ["x"]),
        ("kept x, sin", ["add", "cos"], ["sin", "x"]),
    ]:
        got_nodes, got_frontier = got[label]
        missing = sorted(set(nodes + frontier) - set(got_nodes) - set(got_frontier))
        assert not missing, (
            "recompute_subgraph must walk back through every node that is not kept, not only "
            f"root's direct inputs: missing {missing} ({label})"
        )
        rerun = sorted(set(got_nodes) & set(label.removeprefix("kept ").split(", ")))
        assert not rerun, (
            "a kept node ends the walk: it belongs in the frontier, not among the nodes to re-run "
            f"(recomputing a kept tensor): {rerun}"
        )
        assert "add" in got_nodes, "root itself is one of the nodes to re-run"
        assert [got_nodes, got_frontier] == [nodes, frontier], (
            f"{label}: nodes {got_nodes}, frontier {got_frontier}; expected {nodes}, {frontier}"
        )
    nodes, frontier, ops = got["softmax"]  # the attention's probabilities, x and qkv kept
    assert {"softmax", "masked_fill", "mul", "matmul", "transpose_3"} <= set(nodes), (
        "recompute_subgraph must walk back through every node that is not kept, not only root's "
        f"direct inputs: softmax's subgraph is {nodes}"
    )
    assert "qkv" not in nodes and "qkv" in frontier and "get_attr" in ops, (
        f"a kept node ends the walk: qkv and the mask buffer are the frontier, got {frontier}"
    )


@pytest.mark.grade(points=2, solution="tensor_ckpt.recompute_subgraph", needs=PLAN)
def test_plan_for_the_block_keeps_matmuls_and_forgets_cheap_tensors():
    _, state, x = plain("block")
    plan = call("tensor_ckpt:plan_of", "block", state, x)
    units = plan["units"]
    assert [u["name"] for u in units] == ["norm1", "norm2", "gelu"], units
    assert [u["nodes"] for u in units] == [["norm1"], ["norm2"], ["gelu"]], (
        "each forgotten norm or GELU is recomputed by its own op alone, from what autograd keeps: "
        f"got {[u['nodes'] for u in units]}"
    )
    assert [u["frontier"] for u in units] == [["x"], ["add"], ["fc1"]], (
        f"the frontier is the kept nodes the subgraph reads: got {[u['frontier'] for u in units]}"
    )
    assert plan["recompute_flops"] == 0 and plan["held_bytes"] == 0, plan
    assert plan["bytes_freed"] == (2 * B * T * C + B * T * 4 * C) * F32, plan["bytes_freed"]
    assert "gelu" in plan["table"] and "fc1" in plan["table"] and "KiB" in plan["table"]


@pytest.mark.grade(points=1, solution="tensor_ckpt.recompute_subgraph", needs=PLAN)
def test_leaf_modules_is_the_fix_for_untraceable_code_and_names_override_marks():
    _, state, x = plain("branch_in_leaf")
    plan = call("tensor_ckpt:plan_of", "branch_in_leaf", state, x, leaf_gate=True)
    # the opaque gate is re-run whole, and the GELU before it too: nothing saves the GELU's output
    assert [u["nodes"] for u in plan["units"]] == [["gelu", "gate"]], plan["units"]
    plan = call("tensor_ckpt:plan_of", "branch_in_leaf", state, x, ["gelu"], leaf_gate=True)
    assert [u["name"] for u in plan["units"]] == ["gelu"], plan["units"]
    assert [u["nodes"] for u in plan["units"]] == [["gelu"]], plan["units"]


# ---- pack_hook ----
@pytest.mark.grade(points=1, solution="tensor_ckpt.pack_hook")
def test_pack_hook_hands_out_handles_for_forgotten_storages_only():
    got = call("tensor_ckpt:pack_cases")
    for label in ("transposed view of the output",):
        assert got[label]["handle"] and not got[label]["kept"], (
            "a tensor in a forgotten storage must be packed as a handle (call.live_storage(t)), "
            f"not kept: the {label}"
        )
        assert got[label]["geometry"] == got[label]["its_geometry"], (
            f"a handle records where the saved tensor sits in the storage: {got[label]}"
        )
    assert got["output, before it is registered"]["handle"], (
        "a tensor its own op saves (softmax saves its output) is packed before its root is "
        "registered: keep it in call.opening so register_root turns it into a handle"
    )
    for label in ("input, before", "input, while the op runs", "input, after", "unrelated tensor"):
        p = got[label]
        assert not p["handle"] and p["kept"], (
            "pack_hook handed out a handle for a tensor outside every forgotten storage (the "
            f"{label}): only a tensor call.live_storage(t) finds becomes a handle, even while "
            "call.opening is open"
        )
        assert p["same_data"] and not p["requires_grad"] and p["version"] == 0, (
            f"a kept tensor is packed detached, as it is, with its _version: the {label}: {p}"
        )
    assert got["handles"] == 2, f"one handle per saved alias: the storage counts {got['handles']}"
    # a forgotten op that reads another forgotten storage (autocast's casts do): its input is a
    # handle at once, and only what is still a tensor waits in call.opening for register_root
    second = got["second op"]
    assert second["error"] is None and second["handles"] == [3, 1], (
        "a tensor already packed as a handle must not be queued in call.opening (decide first, "
        "queue only a kept tensor): a forgotten op reading a forgotten storage, then registering "
        f"its own output, gave handles {second['handles']} (expected [3, 1])"
        + (f" and raised {second['error']}" if second["error"] else "")
    )
    assert second["read_handle"] and second["made_handle"], (
        f"a forgotten op's input in a forgotten storage is a handle at once, its output one after "
        f"register_root: {second}"
    )


@pytest.mark.grade(points=2, solution="tensor_ckpt.pack_hook", needs=FORWARD)
def test_activation_memory_drops_by_the_forgotten_bytes():
    cases = {  # model: bytes its forget() marks should free, counted by hand from the shapes
        "mlp": B * T * 4 * C * F32,  # the GELU output
        "block": (2 * B * T * C + B * T * 4 * C) * F32,  # two norm outputs + GELU
        "view_and_base": B * T * 2 * C * F32,  # a base and its view: once
        "attention": (B * H * T * T + B * T * C) * F32,  # softmax probs + merged heads
        "attention_qkv": 0,  # batched matmul saves copies of q, k: qkv is never saved
        CHAIN: chain_costs()["freed"],  # drawn at grading time: the zip's reference counts it
    }
    plains = {name: plain(name) for name in cases}
    x = plains["mlp"][2]
    got = call(
        "tensor_ckpt:forward_bytes", [(n, p[1]) for n, p in plains.items()], x, weights_for(x)
    )
    for name, expected in cases.items():
        model = plains[name][0]
        ref = measured_run(model, model, x, weights_for(x))
        # a byte count is measured in the worker: it counts only beside an output recomputed here
        assert_finite_tensor(got[name]["out"], ref["out"], f"{name}'s checkpointed output")
        assert torch.equal(got[name]["out"], ref["out"]), (
            f"the checkpointed {name} must compute the model's output: it differs by "
            f"{(got[name]['out'] - ref['out']).abs().max():.3g}"
        )
        freed = ref["fwd_bytes"] - got[name]["fwd_bytes"]
        how = (
            "a tensor in a forgotten storage must be packed as a handle (call.live_storage(t))"
            if freed <= 0
            else "a tensor its own op saves (softmax saves its output) is packed before its root "
            "is registered: keep it in call.opening so register_root turns it into a handle"
        )
        assert freed == expected, f"{how}: {name} freed {freed} bytes, expected {expected}"
        # the bytes count only beside the recomputes the freed storages cost in backward
        assert_recomputed_once(got[name], ref, name)
        assert got[name]["bytes_freed"] == expected, (
            f"the plan must predict what was measured: {name}'s plan says "
            f"{got[name]['bytes_freed']}, {expected} were freed"
        )


@pytest.mark.grade(points=2, solution="tensor_ckpt.pack_hook", needs=ALL_BUT("pack_hook"))
def test_peaks_drop_in_forward_and_in_backward():
    # Forward: each forgotten tensor dies at its last use in forward, not at the end of forward
    # (else forward's own peak would be the plain model's). Backward: a recomputed tensor, and the
    # kept tensors its recompute reads, die with the last gradient that needs them.
    ours, ref, model, _, _ = checkpointed("stack")
    # the peaks are measured in the worker: they count only beside outputs and gradients
    # recomputed here
    assert_bitwise(ours, ref, model, "the checkpointed stack against the plain model")
    assert_recomputed_once(ours, ref, "stack")
    assert ref["fwd_peak"] - ours["fwd_peak"] >= 2 * B * T * C * F32, (
        "a forgotten tensor must not outlive its last use in forward (pack it as a handle): "
        f"forward's peak {ours['fwd_peak']} bytes, the plain model's {ref['fwd_peak']}"
    )
    largest = B * T * 4 * C * F32  # one layer's GELU output
    assert ref["bwd_peak"] - ours["bwd_peak"] >= largest, (
        "a recomputed tensor must be freed once the last gradient that needs it has it: "
        f"backward's peak {ours['bwd_peak']} bytes, the plain model's {ref['bwd_peak']}"
    )
    assert_the_chain_costs_what_it_must()


@pytest.mark.parametrize(
    "world_size", [2, pytest.param(4, marks=pytest.mark.ungraded)], ids=["2 ranks", "4 ranks"]
)
@pytest.mark.grade(points=2, solution="tensor_ckpt.pack_hook", needs=ALL_BUT("pack_hook"))
def test_data_parallel_replicas_match_single_process(world_size):
    model, state, _ = plain("block")
    shards = [
        torch.randn(B, T, C, generator=generator("tensor_ckpt", r)) for r in range(world_size)
    ]
    x_all = torch.cat(shards)  # each rank's from a generator of its own, moving with the draw
    own = [{"shard": t} for t in shards]
    results = on_ranks("tensor_ckpt:data_parallel", world_size, state, per_rank=own)
    assert all(r["refused"] for r in results), "a bad annotation must be refused on every rank"
    for n in range(1, world_size + 1):
        model.zero_grad(set_to_none=True)
        model(x_all[: n * B]).square().sum().backward()
        reference = [p.grad / n for p in model.parameters()]  # data parallel averages over ranks
        for rank in range(n):
            reduced = dict((k, v) for k, v in results[rank]["reduced"])[n]
            pairs = list(zip(reduced, reference, strict=True))  # one gradient per parameter
            if n == world_size:
                pairs += zip(results[rank]["ddp"], reference, strict=True)
            for ours, ref in pairs:
                # vs one process on the whole batch: the batch sum is split differently; fp32
                # rounding of gradients of size ~10 gives ~1e-6 absolute differences
                torch.testing.assert_close(
                    ours, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} of {n}: {m}"
                )


# ---- unpack_hook ----
@pytest.mark.grade(points=1, solution="tensor_ckpt.unpack_hook")
def test_unpack_hook_rebuilds_the_saved_alias_as_a_view_of_the_recomputed_storage():
    got = call("tensor_ckpt:unpack_cases")
    assert got["alias_shares_storage"], (
        "unpack_hook must return a view of the recomputed storage, not a copy of it"
    )
    expected = got["value"].as_strided((4, 2), (1, 4), 1)  # a transposed slice of the root
    assert got["alias_layout"] == [[4, 2], [1, 4], 1] and torch.equal(got["alias"], expected), (
        "the saved alias has its own size, stride and offset (packed.geometry); got shape, "
        f"stride, offset {got['alias_layout']}, expected [[4, 2], [1, 4], 1]"
    )
    assert got["releases"] == 1, (
        f"unpack_hook must release the handle once it has the value: released {got['releases']}x"
    )
    assert got["kept_same_data"] and torch.equal(got["kept_back"], got["kept"]), (
        "a kept (not forgotten) saved tensor comes back as it was packed"
    )
    assert got["in_place_refused"] is not None, (
        "an in-place change of a kept saved tensor must be refused, as autograd refuses it "
        "(packed.kept() checks its _version); unpack_hook returned the changed tensor"
    )


@pytest.mark.parametrize("name", ["mlp", "attention", "block"])
@pytest.mark.grade(points=3, solution="tensor_ckpt.unpack_hook", needs=ALL_BUT("unpack_hook"))
def test_gradients_bitwise_equal_plain_and_torch_checkpoint(name):
    ours, ref, model, x, weights = checkpointed(name)
    assert_bitwise(ours, ref, model, f"the checkpointed {name} against the plain model")
    theirs = gradients(
        model, lambda x: torch_checkpoint.checkpoint(model, x, use_reentrant=False), x, weights
    )
    assert_bitwise(ours, theirs, model, f"the checkpointed {name} against torch.utils.checkpoint")
    # what only real checkpointing gives, measured by the probe's meters: less alive after
    # forward, and backward running the plan's recompute FLOPs on top of the plain backward
    assert ours["fwd_bytes"] < ref["fwd_bytes"], (
        f"the checkpointed {name} keeps {ours['fwd_bytes']} bytes alive after forward, the plain "
        f"model {ref['fwd_bytes']}: forgotten storages must be freed"
    )
    extra, planned = ours["bwd_flops"] - ref["bwd_flops"], ours["plan"]["recompute_flops"]
    assert extra == planned, (
        f"backward ran {extra} FLOPs more than the plain model's, the plan recomputes {planned}"
    )
    assert_recomputed_once(ours, ref, name)
    assert_the_chain_costs_what_it_must()


@pytest.mark.grade(points=2, solution="tensor_ckpt.unpack_hook", needs=ALL_BUT("unpack_hook"))
def test_forgetting_gelu_recomputes_no_matmul_and_view_plus_base_recomputes_once():
    ours, ref, model, *_ = checkpointed("mlp")
    assert_bitwise(ours, ref, model, "the checkpointed mlp against the plain model")
    assert ours["bwd_flops"] == ref["bwd_flops"] > 0, (
        f"forgetting the GELU adds no matmul to backward: {ours['bwd_flops']} FLOPs, "
        f"plain {ref['bwd_flops']}"
    )
    ours, ref, model, *_ = checkpointed("view_and_base")
    (unit,) = ours["plan"]["units"]  # h and its views share a storage: one unit
    assert {"fc", "getitem", "getitem_1"} <= set(unit["members"]), unit
    assert_bitwise(ours, ref, model, "the checkpointed view_and_base against the plain model")
    extra, one_fc = ours["bwd_flops"] - ref["bwd_flops"], 2 * B * T * C * 2 * C
    assert extra == one_fc, (
        "a base and its saved views are one storage, recomputed once per backward: "
        f"{extra} extra FLOPs in backward (one fc: {one_fc})"
    )
    assert_recomputed_once(ours, ref, "view_and_base")
    assert_the_chain_costs_what_it_must()


# ---- LiveStorage.recompute ----
@pytest.mark.grade(points=2, solution="tensor_ckpt.LiveStorage.recompute")
def test_dropout_in_recompute_subgraph_replays_the_rng():
    model, state, x = plain("dropout_mlp")
    model.train()
    with torch.no_grad():
        h = model.fc1(x)
        torch.manual_seed(dropout_seed := case_seed(5, "tensor_ckpt"))
        expected = model.drop(F.gelu(h))
    got = call("tensor_ckpt:dropout_case", state, h, dropout_seed)
    assert torch.equal(got["value"], expected), (
        "the recompute must run each random op with the forward's generator state (self.rng): "
        "the dropout mask drawn in backward differs from forward's"
    )
    assert got["generator_restored"], (
        "the replay must leave the generator as it was (replayed_rng restores it)"
    )


@pytest.fixture(scope="module")
def recomputes():
    model, state, x = plain("mlp")
    with torch.no_grad():
        h = model.fc1(x)
    return call("tensor_ckpt:recompute_cases", state, x), h, F.gelu(h)


@pytest.mark.grade(points=2, solution="tensor_ckpt.LiveStorage.recompute")
def test_a_recompute_reading_another_forgotten_tensor_reuses_its_recompute(recomputes):
    # fc1's output and the GELU of it forgotten: the GELU's recompute reads fc1's recomputed value,
    # so fc1 runs once per backward, not once for itself and once more inside the GELU's subgraph.
    rounds, h, g = recomputes
    first = rounds[0]
    assert torch.equal(first["gelu"], g) and torch.equal(first["fc1"], h), (
        "the recomputed values differ from forward's: run the unit's nodes on self.inputs and "
        "each dependency's dep.recompute()"
    )
    one_fc1 = 2 * B * T * C * 4 * C
    assert first["flops"] == one_fc1, (
        "a recompute reading another forgotten storage must take its dep.recompute() value, not "
        f"run its ops again: the backward ran {first['flops']} FLOPs, fc1 once is {one_fc1}"
    )
    assert not first["requires_grad"] and not first["has_graph"], (
        "LiveStorage.recompute must run the ops under self.as_in_forward() (no_grad, the "
        "forward's autocast): the recomputed value carries an autograd graph"
    )
    assert first["dep_pending_after_read"] == 1, (
        "LiveStorage.recompute must release each dependency it read (dep.release()), else the "
        "dependency's storage stays alive until the end of backward: fc1's pending uses are "
        f"{first['dep_pending_after_read']} after the GELU's recompute read it, expected 1"
    )


@pytest.mark.grade(points=2, solution="tensor_ckpt.LiveStorage.recompute")
def test_tensor_needed_by_several_gradients_is_recomputed_once_per_backward(recomputes):
    rounds, h, g = recomputes
    # the counts are measured in the worker: they count only beside values recomputed here
    assert torch.equal(rounds[0]["gelu"], g) and torch.equal(rounds[0]["fc1"], h), (
        "the recomputed values differ from forward's: run the unit's nodes on self.inputs and "
        "each dependency's dep.recompute()"
    )
    assert rounds[0]["cached"] and rounds[0]["recomputations"] == 2, (
        "a storage needed by several gradients must be recomputed once per backward (cache "
        f"self.value until the last release): {rounds[0]['recomputations']} recomputes for two "
        "storages, the second read of the GELU " + ("cached" if rounds[0]["cached"] else "not")
    )
    assert rounds[0]["held_after"] == [False, False], (
        "LiveStorage.recompute must release each dependency it read (dep.release()), else the "
        "dependency's storage stays alive: after backward [fc1, gelu] held "
        f"{rounds[0]['held_after']}"
    )
    assert rounds[1]["recomputations"] == 4 and torch.equal(rounds[1]["gelu"], rounds[0]["gelu"]), (
        "a retained graph's second backward recomputes each storage once more: "
        f"{rounds[1]['recomputations'] - rounds[0]['recomputations']} recomputes in it, expected 2"
    )
