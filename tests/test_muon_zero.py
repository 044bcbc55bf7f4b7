"""Tests for muon_zero.py that are not graded (the graded ones: tests/graded/test_muon_zero.py):
parameter routing, bad input refused on every rank, failures that must not hang, state dicts and
exact resume, clipping's small-gradient seam, the demo.

Tolerance of a resumed run against the uninterrupted one (relative error of the parameter change,
||Δ_test - Δ_ref|| / ||Δ_ref||), fp32 NS and fp32 gradient sync: 1e-5, fp32 reassociation only.
"""

import math
import time

import pytest
import torch
import torch.distributed as dist
from graded.models_muon_zero import (
    ADAMW,
    DENSE,
    DIM,
    EXPERT,
    GLOBAL_BATCH,
    batch,
    forward_loss,
    make_params,
)

import muon_zero as mz
from benchmarks import bench_muon_zero as bench
from tools.spawn import RankFailure, run_ranks, run_torchrun

STEPS = 5
LR_MUON, LR_ADAM = 0.05, 0.01
FP32_TOL = 1e-5


def leaves(P):
    return {k: v.clone().requires_grad_() for k, v in P.items()}


def groups(L, roles=True):
    out = [{"params": [L[k] for k in DENSE], "role": "dense"}]
    out += [{"params": [L[k]], "role": "expert_" + k} for k in ("down", "up", "gate")]
    out += [{"params": [L[k] for k in ADAMW], "role": "adamw", "lr": LR_ADAM}]
    return out


def run_muon_zero(P, rank, world, steps=STEPS, start=0, state=None, **kw):
    """Every rank: its slice of each global batch, backward, MuonZeRO.step(). -> (params, opt)."""
    L = leaves(P)
    opt = mz.MuonZeRO(groups(L), lr=LR_MUON, **kw)
    if state is not None:
        opt.load_state_dict(state)
    per = GLOBAL_BATCH // world
    for s in range(start, start + steps):
        x, y = batch(s)
        forward_loss(
            L, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        ).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in L.items()}, opt


def rel_change_error(P0, got, ref):
    """max over parameters of ||Δgot - Δref|| / ||Δref||: the updates, not the (larger) weights."""
    return max(((got[k] - ref[k]).norm() / (ref[k] - P0[k]).norm()).item() for k in P0)


def all_equal_across_ranks(tensors):
    flat = torch.cat([t.flatten() for t in tensors])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], e) for e in everyone)


# --------------------------------------------------------------------------------------------------
# Checkpoints across layouts (the graded checks of the step are in tests/graded/test_muon_zero.py)
# --------------------------------------------------------------------------------------------------


# AdamW blocks of 3 rows of the [VOCAB, DIM] embedding and head: each is cut, and its blocks dealt
# over the ranks, as V4's vocabulary-sized tensors are at scale
BLOCK_NUMEL = 3 * DIM


def check_checkpoint(rank, world, checkpoint=None):
    """Without a checkpoint: save after 3 of 5 steps (and run all 5); with one: resume it here at
    zero width 1 for the last 2 steps. AdamW's tensors in blocks of BLOCK_NUMEL elements."""
    mz.ADAMW_BLOCK_NUMEL = BLOCK_NUMEL
    P0, kw = make_params(), dict(ns_dtype=torch.float32, grad_sync="exact")
    if checkpoint is None:
        mid, opt = run_muon_zero(P0, rank, world, steps=3, zero_width=2, **kw)
        state = opt.gather_state_dict()
        share = opt.state_dict()["state"]  # AdamW's moments {block: rows} of the blocks I own
        blocks = {
            (i, b): m.numel() for i, s in share.items() for b, m in s.get("exp_avg", {}).items()
        }
        end, _ = run_muon_zero(P0, rank, world, steps=5, zero_width=2, **kw)
        return dict(mid=mid, state=state, end=end, blocks=blocks, chunk=opt.plan.adamw_chunk_numel)
    mid, state, end = checkpoint["mid"], checkpoint["state"], checkpoint["end"]
    keys = [set(state["state"].get(i, {})) for i in range(len(P0))]
    out = {
        "state_complete": keys
        == [{"momentum_buffer"}] * (len(DENSE) + len(EXPERT))
        + [{"step", "exp_avg", "exp_avg_sq"}] * len(ADAMW)
    }
    got, _ = run_muon_zero(mid, rank, world, steps=2, start=3, state=state, zero_width=1, **kw)
    out["resume_err"] = rel_change_error(mid, got, end)
    fresh = mz.MuonZeRO(groups(leaves(mid)), lr=LR_MUON, zero_width=1, **kw)
    fresh.load_state_dict(state)
    again = fresh.gather_state_dict()
    out["roundtrip_exact"] = all(
        torch.equal(state["state"][i][k], again["state"][i][k])
        for i in state["state"]
        for k in state["state"][i]
        if torch.is_tensor(state["state"][i][k])
    )
    return out


def test_checkpoint_saved_at_4_ranks_resumes_at_2(monkeypatch):
    """Saved at W=4 / zero width 2 after 3 of 5 steps, resumed at W=2 / width 1: the
    uninterrupted run, to fp32 reassociation. At W=4 AdamW's state is sharded as ZeRO-1 shards
    it: each block's moments on one rank, no rank past an equal share by more than a block."""
    ranks = run_ranks(check_checkpoint, 4)
    held = [out["blocks"] for out in ranks]
    owners = [key for blocks in held for key in blocks]
    assert len(owners) == len(set(owners)), f"an AdamW block's moments on two ranks: {held}"
    total = sum(math.prod(shape) for shape in ADAMW.values())
    assert sum(n for blocks in held for n in blocks.values()) == total, (
        f"the ranks' AdamW blocks {held} do not cover the {total} AdamW elements once"
    )
    monkeypatch.setattr(mz, "ADAMW_BLOCK_NUMEL", BLOCK_NUMEL)
    cut = sum(len(mz.adamw_blocks(shape)) > 1 for shape in ADAMW.values())
    assert cut == 2, f"BLOCK_NUMEL cuts {cut} AdamW tensors, the embedding and head expected"
    for r, (blocks, out) in enumerate(zip(held, ranks, strict=True)):
        assert sum(blocks.values()) <= out["chunk"] <= total / 4 + BLOCK_NUMEL, (
            f"rank {r} holds {sum(blocks.values())} AdamW elements; the plan's bucket is "
            f"{out['chunk']}, an equal share {total / 4} plus a block {BLOCK_NUMEL} at most"
        )
    saved = ranks[0]
    for r in run_ranks(check_checkpoint, 2, args=(saved,)):
        assert r["resume_err"] < FP32_TOL, r["resume_err"]
        assert r["state_complete"] and r["roundtrip_exact"], r


def test_ns_coefficients():
    assert mz.V4_NS_COEFFICIENTS == ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2
    assert mz.STANDARD_NS_COEFFICIENTS == ((3.4445, -4.7750, 2.0315),) * 5


def test_param_groups_send_every_matrix_to_muon():
    model = mz.TinyMoE(layers=2)
    groups_ = mz.muon_param_groups(model)
    role = {id(p): g["role"] for g in groups_ for p in g["params"]}
    names = dict(model.named_parameters())
    assert len(role) == len(names)
    for name, p in names.items():
        if name.startswith(("embed", "head")) or p.ndim < 2:
            assert role[id(p)] == "adamw", name
        elif p.ndim == 2:
            assert role[id(p)] == "dense", name
        else:
            assert role[id(p)] == "expert_" + name.split("_")[-1], name
    assert sum(p.ndim == 3 for g in groups_ if g["role"] == "adamw" for p in g["params"]) == 0
    assert (
        sum(1 for g in groups_ if g["role"] == "adamw" for p in g["params"] if p.ndim >= 2) == 2
    )  # embed, head
    # A 3-D stack whose role cannot be told must not fall silently to AdamW (or Muon as one).
    weird = torch.nn.Module()
    weird.stack = torch.nn.Parameter(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="expert_roles"):
        mz.muon_param_groups(weird)
    assert (
        mz.muon_param_groups(weird, expert_roles={"stack": "expert_up"})[0]["role"] == "expert_up"
    )


def test_plan_muon():
    plan = mz.plan_muon(
        [(64, 48)] * 5 + [(32, 48)], [(48, 32)] * 6 + [(32, 48)] * 12, world_size=4, zero_width=2
    )
    rows = bench.rank_rows(plan)
    assert [r["dense"] for r in rows] == [
        len(plan.dense_buckets[0]),
        len(plan.dense_buckets[1]),
    ] * 2
    assert sum(r["experts"] for r in rows) == 18 and sum(len(b) for b in plan.dense_buckets) == 6
    assert [r["replica"] for r in rows] == [0, 0, 1, 1] and plan.owned(0)[0] == plan.owned(2)[0]
    s = bench.plan_summary(plan)
    assert s["expert_padding"] == (4 * 5 - 18) / 18 and 0 <= s["dense_padding"]
    assert s["dense_imbalance"] >= 1
    assert "rank" in mz.format_plan(plan) and len(mz.format_plan(plan).splitlines()) == 5
    with_adamw = mz.format_plan(mz.plan_muon([(4, 4)], [], 2, adamw_shapes=[(8, 4), (3,)]))
    held = [int(line.split()[-2].replace(",", "")) for line in with_adamw.splitlines()[1:]]
    assert "AdamW pad elems" in with_adamw and sorted(held) == [3, 32], with_adamw
    with pytest.raises(ValueError, match="zero_width=3 must divide"):
        mz.plan_muon([(4, 4)], [], world_size=4, zero_width=3)


def test_bad_input_single_process():
    m = torch.zeros(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="empty"):
        mz.MuonZeRO([])
    with pytest.raises(ValueError, match="Muon needs"):
        mz.MuonZeRO([m, torch.zeros(4, requires_grad=True)])
    with pytest.raises(ValueError, match="expert role"):
        mz.MuonZeRO([torch.zeros(2, 4, 4, requires_grad=True)])
    with pytest.raises(ValueError, match="expert stack"):
        mz.MuonZeRO([{"params": [m], "role": "expert_up"}])
    with pytest.raises(ValueError, match="role"):
        mz.MuonZeRO([{"params": [m], "role": "sgd"}])
    with pytest.raises(ValueError, match="grad_sync"):
        mz.MuonZeRO([m], grad_sync="bf16")
    with pytest.raises(ValueError, match="zero_width"):
        mz.MuonZeRO([m], zero_width=2)
    opt = mz.MuonZeRO([m])
    with pytest.raises(ValueError, match="construction"):
        opt.add_param_group({"params": [torch.zeros(3, 3, requires_grad=True)]})
    opt.step()  # no gradient anywhere: a no-op, not an error
    assert torch.equal(m, torch.zeros(4, 4))


def test_adamw_update_matches_torch():
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(5, 3, generator=g)
    ref = p0.clone().requires_grad_()
    torch_opt = torch.optim.AdamW([ref], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    mine, m, v = p0.clone(), torch.zeros(5, 3), torch.zeros(5, 3)
    for step in range(1, 6):
        grad = torch.randn(5, 3, generator=g)
        ref.grad = grad.clone()
        torch_opt.step()
        mz.adamw_update(mine, grad, m, v, step, lr=0.01)
    assert torch.allclose(mine, ref.detach(), atol=1e-6)


def test_demo_under_torchrun():
    out = run_torchrun("muon_zero.py", nproc=2, args=("--steps", "11"), timeout=120).stdout
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < 0.7 * losses[0], out
    assert "parameters bitwise identical on all 2 ranks: True" in out, out
    assert "optimizer state held per rank (bytes)" in out and "rank replica" in out, out


class _HFStyle(torch.nn.Module):
    """An HF-style causal LM: model.embed_tokens, an mHC-like block, lm_head (not tied)."""

    def __init__(self, tie=False):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(16, 8)
        self.model.proj = torch.nn.Linear(8, 8, bias=False)
        hc = torch.nn.Module()
        hc.proj = torch.nn.Parameter(torch.zeros(32, 24))  # a matrix: Muon
        hc.bias_res = torch.nn.Parameter(torch.eye(4))  # a 2-D static bias: AdamW
        hc.gate = torch.nn.Parameter(torch.zeros(3))
        hc.mixing = torch.nn.Parameter(torch.zeros(4, 4))  # declared non-Muon by its module
        hc.no_muon = {"mixing"}
        self.model.hcs = torch.nn.ModuleList([hc])
        self.marked = torch.nn.Parameter(torch.zeros(5, 5))
        self.marked.no_muon = True  # declared non-Muon on the tensor
        self.lm_head = torch.nn.Linear(8, 16, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight


@pytest.mark.parametrize("tie", [False, True])
def test_param_groups_route_by_what_a_tensor_is(tie):
    model = _HFStyle(tie)
    role = {id(p): g["role"] for g in mz.muon_param_groups(model) for p in g["params"]}
    hc = model.model.hcs[0]
    assert role[id(model.lm_head.weight)] == "adamw"  # HF output head
    assert role[id(model.model.embed_tokens.weight)] == "adamw"
    assert role[id(hc.bias_res)] == "adamw" and role[id(hc.gate)] == "adamw"
    assert role[id(hc.mixing)] == "adamw" and role[id(model.marked)] == "adamw"
    assert role[id(hc.proj)] == "dense" and role[id(model.model.proj.weight)] == "dense"
    # the name override still sends a matrix to AdamW
    role = {
        id(p): g["role"]
        for g in mz.muon_param_groups(model, adamw_names=("model.proj",))
        for p in g["params"]
    }
    assert role[id(model.model.proj.weight)] == "adamw"


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(lr=float("nan")), "lr"),
        (dict(lr=float("inf")), "lr"),
        (dict(lr=-0.1), "lr"),
        (dict(momentum=1.0), "momentum"),
        (dict(weight_decay=float("nan")), "weight_decay"),
        (dict(update_rms=0.0), "update_rms"),
        (dict(eps=0.0), "eps"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(ns_coefficients=()), "ns_coefficients"),
    ],
)
def test_bad_hyperparameters_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        mz.MuonZeRO([torch.zeros(4, 4, requires_grad=True)], **bad)
    with pytest.raises(ValueError, match=f"param group 1.*{match}"):  # per group, too
        mz.MuonZeRO(
            [
                {"params": [torch.zeros(4, 4, requires_grad=True)]},
                {"params": [torch.zeros(3, 3, requires_grad=True)], **bad},
            ]
        )


def test_bad_tensors_refused():
    with pytest.raises(ValueError, match="float32"):
        mz.MuonZeRO([torch.zeros(4, 4, dtype=torch.float64, requires_grad=True)])
    with pytest.raises(ValueError, match="float32"):
        mz.MuonZeRO([torch.zeros(4, 4, dtype=torch.bfloat16, requires_grad=True)])
    with pytest.raises(ValueError, match="empty"):
        mz.MuonZeRO([torch.zeros(0, 4, requires_grad=True)])
    with pytest.raises(ValueError, match="empty"):
        mz.MuonZeRO([{"params": [torch.zeros(2, 0, 4, requires_grad=True)], "role": "expert_up"}])


def check_mismatch(rank, world, field):
    """Rank 1 differs from the others in one thing; every rank must raise the same ValueError."""
    P0 = make_params()
    kw = dict(lr=LR_MUON)
    odd = rank == 1
    if field == "lr" and odd:
        kw["lr"] = 2 * LR_MUON
    if field == "adamw_lr":
        pass
    if field == "init" and odd:
        P0["w_in"] = P0["w_in"] + 1e-3
    if field == "shape" and odd:
        P0["w_sq1"] = torch.zeros(DIM, DIM + 1)
    if field == "dtype" and odd:
        P0["head"] = P0["head"].double()
    L = leaves(P0)
    gs = groups(L)
    if field == "adamw_lr" and odd:
        gs[-1]["lr"] = 0.5
    try:
        mz.MuonZeRO(gs, **kw)
    except ValueError as e:
        return str(e)
    return None


# at 2 ranks: lr, init and shape stay in the default tier; the other fields are slow cases
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "field, words",
    [
        ("lr", "lr"),
        pytest.param("adamw_lr", "lr", marks=pytest.mark.slow),
        ("init", "initial values"),
        ("shape", "shape"),
        pytest.param("dtype", "float32", marks=pytest.mark.slow),
    ],
)
def test_every_rank_refuses_a_mismatch(field, words, world):
    """Fault matrix (b): one rank gets different input; every rank raises the same ValueError."""
    msgs = run_ranks(check_mismatch, world, args=(field,), timeout=60)
    assert msgs[0] is not None and all(m == msgs[0] for m in msgs), msgs
    assert words in msgs[0] and "rank 1" in msgs[0], msgs[0]


def check_state_dict_is_local(rank, world):
    P0 = make_params()
    got, opt = run_muon_zero(P0, rank, world, steps=2, ns_dtype=torch.float32, grad_sync="exact")
    if rank == 0:  # the usual pattern: only rank 0 saves
        local = opt.state_dict()
        assert local["state"]
    full = opt.gather_state_dict()  # the explicit collective: every rank gets every momentum
    # string keys, as after a JSON round trip of the keys: momentum must load, not vanish
    stringly = {
        "state": {str(k): v for k, v in full["state"].items()},
        "param_groups": full["param_groups"],
    }
    L = leaves(got)
    fresh = mz.MuonZeRO(groups(L), lr=LR_MUON, ns_dtype=torch.float32, grad_sync="exact")
    fresh.load_state_dict(stringly)
    again = fresh.gather_state_dict()
    same = all(
        torch.equal(full["state"][i][k], again["state"][i][k])
        for i in full["state"]
        for k in full["state"][i]
        if torch.is_tensor(full["state"][i][k])
    )
    return dict(same=same, **check_copies_and_sparse_gradients(fresh, rank))


def check_copies_and_sparse_gradients(opt, rank):
    """Over 2 ranks: a deep copy shares the process groups and steps alike on every rank; pickle
    is refused; a sparse gradient on rank 1 alone is refused on every rank with one message."""
    import copy
    import pickle

    out, twin = {}, copy.deepcopy(opt)
    step_with_grads(twin, seed=rank)  # each rank its own gradients: averaged inside the step
    out["copy replicas equal"] = all_equal_across_ranks(twin.params)
    try:
        pickle.dumps(opt)
    except TypeError as e:
        out["pickle refused"] = "cannot be pickled" in str(e)
    for p in twin.params:
        p.grad = torch.ones_like(p)
    if rank == 1:
        twin.params[-1].grad = twin.params[-1].grad.to_sparse()
    try:
        twin.step()
    except ValueError as e:
        out["sparse"] = str(e)
    return out


def test_state_dict_on_rank_zero_alone_does_not_hang():
    results = run_ranks(check_state_dict_is_local, 2, timeout=60)
    for rank, r in enumerate(results):
        assert r["same"] and r["copy replicas equal"] and r.get("pickle refused"), (rank, r)
    assert "sparse gradients" in results[0].get("sparse", ""), results  # rank 0's were dense
    assert results[0]["sparse"] == results[1]["sparse"], results


def test_load_state_dict_never_drops_momentum_silently():
    P0 = make_params()
    got, opt = run_muon_zero(P0, 0, 1, steps=1)
    sd = opt.state_dict()
    first = next(i for i, s in sd["state"].items() if "momentum_buffer" in s)
    del sd["state"][first]
    fresh = mz.MuonZeRO(groups(leaves(got)), lr=LR_MUON)
    with pytest.raises(ValueError, match="momentum"):
        fresh.load_state_dict(sd)
    sd["state"]["not a number"] = {}
    with pytest.raises(ValueError, match="key"):
        fresh.load_state_dict(sd)


@pytest.mark.slow  # a three-rank launch for one refusal: bad options refuse in the default tier
def test_demo_never_drops_samples():
    out = run_torchrun(
        "muon_zero.py", nproc=3, args=("--steps", "1", "--batch", "25"), timeout=120, check=False
    )
    assert out.returncode != 0 and "--batch 25 does not split" in out.stdout, out.stdout


def check_one_rank_raises_mid_step(rank, world):
    L = leaves(make_params())
    opt = mz.MuonZeRO(groups(L), lr=LR_MUON)
    if rank == 1:  # after the reduce-scatter, before the all-gather: the peers are left waiting

        def broken(*args, **kwargs):
            raise RuntimeError("injected failure on rank 1 inside the update")

        mz.update_run = broken
    forward_loss(L, *batch(0)).backward()
    opt.step()


@pytest.mark.parametrize(
    "world", [2, pytest.param(3, marks=pytest.mark.slow)]
)  # every fault at 2 ranks stays
def test_one_rank_raising_mid_step_fails_fast(world):
    """Fault matrix (a): a failure is reported as that rank's error, well within the timeout."""
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(check_one_rank_raises_mid_step, world, timeout=60)
    assert time.monotonic() - start < 45
    assert "injected failure on rank 1" in info.value.errors[1], info.value.errors


def check_round_robin(rank, world):
    P0 = make_params()
    mats = [P0[k].clone() for k in DENSE]
    grads = [
        torch.randn(m.shape, generator=torch.Generator().manual_seed(i)) for i, m in enumerate(mats)
    ]
    for m, g in zip(mats, grads):
        m.grad = g
    momenta = [torch.zeros_like(m) for m in mats]
    mz.round_robin_step(mats, momenta, lr=0.1, ns_dtype=torch.float32)
    return mats


def test_round_robin_baseline_matches_single_process():
    """KellerJordan's round-robin layout gives every rank the single-process update."""
    one = run_ranks(check_round_robin, 1, timeout=60)[0]
    for got in run_ranks(check_round_robin, 3, timeout=60):
        for a, b in zip(got, one):
            assert torch.allclose(a, b, rtol=0, atol=1e-6)  # the same fp32 ops on one matrix


def test_head_names_match_whole_module_names_only():
    """`output` names an output head; `output_gate` or `heads` is a matrix like any other."""
    model = torch.nn.Module()
    model.output_gate = torch.nn.Linear(4, 4, bias=False)
    model.heads = torch.nn.Linear(4, 4, bias=False)
    model.output = torch.nn.Linear(4, 16, bias=False)
    role = {id(p): g["role"] for g in mz.muon_param_groups(model) for p in g["params"]}
    assert role[id(model.output_gate.weight)] == "dense" and role[id(model.heads.weight)] == "dense"
    assert role[id(model.output.weight)] == "adamw"


def test_mhc_static_biases_and_gates_go_to_adamw():
    """mHC's HyperConnection: the projection is a Muon matrix; biases and gating factors AdamW."""
    import mhc

    hc = mhc.HyperConnection(4, 8)
    role = {id(p): g["role"] for g in mz.muon_param_groups(hc) for p in g["params"]}
    for name, p in hc.named_parameters():
        want = "adamw" if name.startswith(("bias", "gate")) or p.ndim < 2 else "dense"
        assert role[id(p)] == want, (name, tuple(p.shape), role[id(p)])
    assert any(p.ndim == 2 and role[id(p)] == "adamw" for p in hc.parameters())  # bias_res


def test_a_model_converted_after_construction_is_refused():
    """dtype and device are captured at construction: a later .double() must not round silently."""
    m = torch.nn.Linear(4, 4, bias=False)
    opt = mz.MuonZeRO(mz.muon_param_groups(m))
    m.double()
    m(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    with pytest.raises(ValueError, match="float64"):
        opt.step()


# --------------------------------------------------------------------------------------------------
# Seams: clipping under ZeRO, exact resume with stochastic rounding, demo data and options
# --------------------------------------------------------------------------------------------------


def test_per_matrix_newton_schulz_equals_the_batched_call(monkeypatch):
    """The plan batches runs of small matrices and gives large ones one NS call each (addmm, as
    torch.optim.Muon); both paths give the same parameters: bitwise with bf16 NS, to fp32
    rounding with fp32 NS (addmm and baddbmm may sum in another order; float64 against
    torch.optim.Muon: tests/test_muon_zero_interop.py)."""
    assert mz.batch_newton_schulz((64, 128)), "small matrices must share one NS call"
    assert not mz.batch_newton_schulz((512, 512)), "large matrices must take one call each"
    assert mz.batch_newton_schulz((512, 512), "cuda"), "a GPU batches what a CPU core cannot"
    P0 = make_params()
    for ns_dtype in (torch.bfloat16, torch.float32):
        batched, opt = run_muon_zero(P0, 0, 1, steps=1, ns_dtype=ns_dtype)
        runs = [r for shards in opt.shards for r in shards.runs]
        assert any(r.batched for r in runs), "the test model's small runs must be batched"
        with monkeypatch.context() as patch:
            patch.setattr(mz, "NS_BATCH_MAX_COST", 0)  # every run: one NS call per matrix
            each, opt = run_muon_zero(P0, 0, 1, steps=1, ns_dtype=ns_dtype)
        assert not any(r.batched for shards in opt.shards for r in shards.runs)
        if ns_dtype == torch.bfloat16:
            for k in P0:
                assert torch.equal(batched[k], each[k]), (
                    f"{k} (bf16 NS): per-matrix NS differs from the batched call by "
                    f"{(batched[k] - each[k]).abs().max():.2e}"
                )
        err = rel_change_error(P0, each, batched)
        assert err < FP32_TOL, f"per-matrix NS ({ns_dtype}) is {err:.2e} from the batched call"


def test_tiny_gradients_do_not_stall_newton_schulz():
    """A gradient scaled to 1e-30 (clipping can do that) still gets a full, unit-RMS-ish update."""
    g = torch.Generator().manual_seed(4)
    G = torch.randn(12, 20, generator=g)
    big = mz.muon_update(G, torch.zeros(12, 20), coefficients=mz.STANDARD_NS_COEFFICIENTS)
    tiny = mz.muon_update(G * 1e-30, torch.zeros(12, 20), coefficients=mz.STANDARD_NS_COEFFICIENTS)
    rms = tiny.pow(2).mean().sqrt().item()
    assert 0.1 < rms < 0.3, f"update RMS {rms:.3g} for a 1e-30 gradient: NS stalled under eps"
    # in fp32 NS the two agree to fp32 rounding (the 1e-30 scale itself is inexact in fp32)
    kw = dict(coefficients=mz.STANDARD_NS_COEFFICIENTS, ns_dtype=torch.float32)
    big, tiny = (mz.muon_update(G * s, torch.zeros(12, 20), **kw) for s in (1.0, 1e-30))
    assert (tiny - big).norm() / big.norm() < 1e-4, "NS must be scale-invariant down to 1e-30"
    L = leaves(make_params())
    opt = mz.MuonZeRO(groups(L), lr=LR_MUON, max_grad_norm=1e-30, grad_sync="exact")
    before = L["w_in"].detach().clone()
    forward_loss(L, *batch(0)).backward()
    opt.step()
    moved = (L["w_in"].detach() - before * (1 - LR_MUON * 0.1)).norm() / before.norm()
    assert moved > 1e-3, f"a clipped step moved w_in by {moved:.2e} of its norm: stalled"


def check_resume(rank, world):
    """3 steps, save, a fresh optimizer loads, 3 more == 6 uninterrupted steps, bitwise."""
    P0, out = make_params(), {}
    per = GLOBAL_BATCH // world
    for sync in ("exact", "bf16_sr"):
        end, _ = run_muon_zero(P0, rank, world, steps=6, grad_sync=sync)
        mid, opt = run_muon_zero(P0, rank, world, steps=3, grad_sync=sync)
        for how, state in (("local", opt.state_dict()), ("gathered", opt.gather_state_dict())):
            got, _ = run_muon_zero(mid, rank, world, steps=3, start=3, state=state, grad_sync=sync)
            out[f"{sync} {how}"] = all(torch.equal(got[k], end[k]) for k in end)
    # resharding (another zero width): momenta load, the rounding generator is reseeded
    L = leaves(mid)
    other = mz.MuonZeRO(groups(L), lr=LR_MUON, zero_width=1 if world > 1 else None)
    full = opt.gather_state_dict()
    other.load_state_dict(full)
    again = other.gather_state_dict()
    out["reshard momenta"] = all(
        torch.equal(full["state"][i][k], again["state"][i][k])
        for i in full["state"] for k in full["state"][i] if torch.is_tensor(full["state"][i][k])
    )  # fmt: skip
    out["reshard keeps the step count"] = other.steps == 3  # the rounding noise's seed
    x, y = batch(3)
    forward_loss(L, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
    other.step()
    out["reshard replicas equal"] = all_equal_across_ranks([L[k] for k in L])
    return out


@pytest.mark.parametrize(
    "world", [1, 2, pytest.param(3, marks=pytest.mark.slow)]
)  # 2 ranks: 5 dense matrices split unevenly
def test_resume_is_exact_in_every_sync_mode(world):
    for rank, r in enumerate(run_ranks(check_resume, world, timeout=120)):
        bad = [k for k, ok in r.items() if not ok]
        assert not bad, f"rank {rank} of {world}: {bad}"


def test_demo_batch_is_linear_in_seq():
    g = torch.Generator().manual_seed(1)
    x, y = mz.demo_batch(3, 7, 64, g)
    start = torch.randint(0, 64, (3, 1), generator=torch.Generator().manual_seed(1))
    expect = [start]
    for _ in range(7):
        expect.append((5 * expect[-1] + 3) % 64)
    expect = torch.cat(expect, dim=1)
    assert torch.equal(x, expect[:, :-1]) and torch.equal(y, expect[:, 1:])
    # linear in seq: the torch calls grow with log(seq) (the maps double), not with each token
    calls = []

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        x, _ = mz.demo_batch(2, 2_000_000, 64, g)
    assert x.shape == (2, 2_000_000) and len(calls) < 1000, f"{len(calls)} torch calls for 2M"


@pytest.mark.parametrize(
    "args, words",
    [
        (("--seq", "10000000"), "--seq 10000000"),
        *(
            pytest.param(a, w, marks=pytest.mark.slow)
            for a, w in [  # one launch each
                (("--steps", "0"), "--steps"),
                (("--zero-width", "0"), "--zero-width"),
                (("--lr", "nan"), "--lr"),
                (("--max-grad-norm", "0"), "--max-grad-norm"),
            ]
        ),
        (("--timeout", "-1"), "--timeout"),
    ],
)
def test_demo_refuses_bad_options_in_one_line(args, words):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "muon_zero.py", *args], capture_output=True, text=True,
                         timeout=60, cwd=mz.__file__.rsplit("/", 1)[0])  # fmt: skip
    assert out.returncode == 2 and words in out.stderr.splitlines()[-1], out.stderr


# --------------------------------------------------------------------------------------------------
# torch.optim's contract: copies, hooks, a parameter listed twice, sparse gradients, routing
# --------------------------------------------------------------------------------------------------


def stepped_optimizer(steps=2):
    """A small MuonZeRO (one process) with momentum and AdamW state after `steps` steps."""
    L = leaves(make_params())
    opt = mz.MuonZeRO(groups(L), lr=LR_MUON)
    for s in range(steps):
        forward_loss(L, *batch(s)).backward()
        opt.step()
        opt.zero_grad()
    return opt


def step_with_grads(opt, seed):
    """One step of `opt` on fixed gradients (the same for every copy of it)."""
    g = torch.Generator().manual_seed(seed)
    for p in opt.params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_is_a_working_optimizer(how):
    """copy.deepcopy and pickle keep every attribute: the copy steps as the original does, on
    its own parameters and state, and the original is left alone."""
    import copy
    import pickle

    opt = stepped_optimizer()
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert {k for k in vars(opt) if not k.startswith("_")} == {
        k for k in vars(twin) if not k.startswith("_")
    }
    before = [p.detach().clone() for p in opt.params]
    step_with_grads(twin, seed=7)
    assert all(torch.equal(p, b) for p, b in zip(opt.params, before)), "the copy moved the original"
    step_with_grads(opt, seed=7)
    assert all(torch.equal(p, q) for p, q in zip(opt.params, twin.params)), "the copy stepped apart"
    mine, its = opt.state_dict(), twin.state_dict()
    torch.testing.assert_close(mine["state"], its["state"], rtol=0, atol=0)  # bitwise
    assert mine["param_groups"] == its["param_groups"]


def test_state_dict_hooks_run_as_on_torch_optimizers():
    """register_state_dict_pre/post_hook and register_load_state_dict_pre/post_hook run in
    state_dict(), gather_state_dict() and load_state_dict(); returned dicts are used."""
    opt, ran = stepped_optimizer(1), []
    opt.register_state_dict_pre_hook(lambda o: ran.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": ran.append("post") or 1})
    assert opt.state_dict()["extra"] == 1 and opt.gather_state_dict()["extra"] == 1
    assert ran == ["pre", "post"] * 2, ran
    saved = opt.state_dict()

    def halve_lr(o, sd):
        sd = {**sd, "param_groups": [{**g, "lr": g["lr"] / 2} for g in sd["param_groups"]]}
        ran.append("load pre")
        return sd

    opt.register_load_state_dict_pre_hook(halve_lr)
    opt.register_load_state_dict_post_hook(lambda o: ran.append("load post"))
    opt.load_state_dict(saved)
    assert ran[-2:] == ["load pre", "load post"], ran
    assert opt.param_groups[0]["lr"] == LR_MUON / 2, "the pre hook's returned dict was not loaded"
    assert saved["param_groups"][0]["lr"] == LR_MUON, "loading changed the caller's dict"


def test_a_parameter_listed_twice_is_numbered_once():
    """param_groups.extend(param_groups) (pytorch issue 36831): numbered as torch numbers it;
    a step on the changed groups, or a group listing a parameter twice, is refused."""
    opt = stepped_optimizer(1)
    ref = torch.optim.AdamW([{"params": g["params"]} for g in opt.param_groups])
    opt.param_groups.extend(opt.param_groups)
    ref.param_groups.extend(ref.param_groups)
    numbers = [g["params"] for g in opt.state_dict()["param_groups"]]
    assert numbers == [g["params"] for g in ref.state_dict()["param_groups"]], numbers
    with pytest.raises(ValueError, match="param_groups changed"):
        step_with_grads(opt, seed=1)
    w = torch.zeros(4, 4, requires_grad=True)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="lists a parameter twice"):
        mz.MuonZeRO([w, w])


def test_sparse_gradients_are_refused_clearly():
    emb, w = torch.nn.Embedding(8, 4, sparse=True), torch.zeros(4, 4, requires_grad=True)
    opt = mz.MuonZeRO([{"params": [w]}, {"params": [emb.weight], "role": "adamw"}])
    (emb(torch.tensor([1, 2])) @ w).sum().backward()
    with pytest.raises(ValueError, match="sparse gradients.*sparse=False"):
        opt.step()


class _NanoGPT(torch.nn.Module):
    """nanoGPT's tied embedding held bare: F.embedding(idx, wte) in, x @ wte.T out."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Parameter(torch.randn(16, 8))
        self.proj = torch.nn.Linear(8, 8, bias=False)

    def forward(self, idx):
        return self.proj(torch.nn.functional.embedding(idx, self.wte)) @ self.wte.T


def test_a_bare_tied_embedding_goes_to_adamw():
    model = _NanoGPT()
    model(torch.tensor([[1, 2]])).sum().backward()  # it is the embedding and the head
    role = {id(p): g["role"] for g in mz.muon_param_groups(model) for p in g["params"]}
    assert role[id(model.wte)] == "adamw", "a tied embedding went to Muon"
    assert role[id(model.proj.weight)] == "dense"


def test_a_convolution_is_never_an_expert_stack():
    """A Conv1d named gate_conv is not an expert gate; the error's advice gives AdamW's update."""
    model = torch.nn.Module()
    model.gate_conv = torch.nn.Conv1d(4, 8, 3, bias=False)
    model.proj = torch.nn.Linear(4, 4, bias=False)
    with pytest.raises(ValueError, match=r"Conv1d's weight.*no_muon = True") as info:
        mz.muon_param_groups(model)
    assert "expert_roles" not in str(info.value), info.value
    with pytest.raises(ValueError, match=r"Conv2d's weight.*no_muon = True"):
        mz.muon_param_groups(torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3)))
    with pytest.raises(ValueError, match="role='adamw'"):  # a conv weight passed as 'dense'
        mz.MuonZeRO([model.gate_conv.weight])
    model.get_parameter("gate_conv.weight").no_muon = True  # the advice, followed
    groups_ = mz.muon_param_groups(model)
    assert [g["role"] for g in groups_] == ["dense", "adamw"], groups_
    w0 = model.gate_conv.weight.detach().clone().requires_grad_()
    ref = torch.optim.AdamW([w0], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = mz.MuonZeRO([{**g, "lr": 0.01} for g in groups_])
    for seed in range(3):
        g = torch.randn(8, 4, 3, generator=torch.Generator().manual_seed(seed))
        model.gate_conv.weight.grad, w0.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert torch.allclose(model.gate_conv.weight, w0, rtol=0, atol=1e-6)  # fp32 op order
