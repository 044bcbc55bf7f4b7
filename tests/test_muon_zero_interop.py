"""MuonZeRO with the tools practitioners combine it with, against independent references.

1. torch.distributed.checkpoint (DCP), torchtitan's recipe, unchanged:

       save at W ranks:  dcp.save({"model": get_model_state_dict(model),
                                   "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=d)
       resume at W':     sd = the same dict from the new run (the template); dcp.load(sd, d);
                         set_model_state_dict(model, sd["model"]);
                         set_optimizer_state_dict(model, opt, sd["optim"])  (strict)

   The reference is the run that never stopped, at W ranks: 3 steps, save, 2 more. The resumed run
   loads at W' ranks (the demo's zero width: W'/2 at 4, so replicas too) and takes the same 2 steps.
   Tolerances: W' = W: bitwise, either grad_sync (the same ops in the same order; the rounding noise
   is drawn per (seed, rank, step), so it continues). W' != W, exact fp32 sync and fp32 NS: 1e-5
   of the parameters' change over the 2 resumed steps: the gradients are summed over other
   groupings of the same samples (fp32 reassociation, ~1e-7 per op; measured ~2e-6); a resume
   that lost the optimizer state is ~0.5 off. W' != W, bf16_sr: the noise is reseeded from
   (seed, rank, step), as after gather_state_dict(): the DCP resume equals the gathered one bitwise.
   Each rank writes only the matrices and expert slices it owns (the checkpoint's metadata names the
   file, hence the rank, of every key); a save adds to the rank's state only DCP's staging copies
   of its own stacked views, plus DCP's plans, far below the whole state (memory_timeline measures
   it; gather_state_dict() under the same meter shows that it sees a whole-state copy).
2. float64: MuonZeRO at 1 and 2 ranks equals torch.optim.Muon (its Newton-Schulz run in float64)
   + AdamW on one process to 1e-12 of the parameters' change (float64 reassociation is ~1e-16 per
   op, amplified by the quintic's slope at 0 over 5 iterations, ~500x); a 1% learning-rate error
   is 1e-2 off.
3. Schedulers that cycle momentum (OneCycleLR, CyclicLR): Muon's momentum and AdamW's beta1 cycle
   in MuonZeRO as in torch.optim.Muon + AdamW, each with the same scheduler (float64, 1e-12).
4. Agreement once: step() makes no agreement collective; what a step checks is local.
5. What the step's one all-reduce also agrees: amp's GradScaler overflow on one rank skips the
   step on every rank (float64, equal to DDP + torch.optim.Muon + AdamW under GradScaler, scales
   included); param-group settings drifted apart between ranks (ReduceLROnPlateau on a per-rank
   metric) are refused on every rank. The rounding noise is fresh for every (rank, step), and
   unbiased; compose's flattened checkpoints keep its step counter.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import launch
import muon_zero as mz
from layouts import compose_checkpoint
from memory.memory_timeline import MemoryTimeline
from tools.spawn import run_ranks

VOCAB, EXPERTS = 16, 5
GLOBAL_BATCH, SEQ, SAVED_AT, STEPS = 12, 6, 3, 5  # 12 samples split evenly over 1-4 ranks
LR_MUON, LR_ADAM = 0.05, 0.01
FP32_TOL, FP64_TOL = 1e-5, 1e-12
SYNCS = ("exact", "bf16_sr")


class Net(nn.Module):
    """Dense matrices (tall, wide, a same-shape pair, a router), three stacks of 5 experts (split
    unevenly over 2, 3 and 4 ranks), and AdamW's tensors (embedding, norm, head)."""

    def __init__(self, dim=12, hidden=20, ffn=8, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def weight(*shape):
            w = torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(shape[-1])
            return nn.Parameter(w.to(dtype))

        self.embed = nn.Embedding(VOCAB, dim)
        self.embed.weight = weight(VOCAB, dim)
        self.w_in, self.w_out = weight(hidden, dim), weight(dim, hidden)
        self.w_sq1, self.w_sq2, self.router = (
            weight(dim, dim),
            weight(dim, dim),
            weight(EXPERTS, dim),
        )
        self.w_gate, self.w_up = weight(EXPERTS, ffn, dim), weight(EXPERTS, ffn, dim)
        self.w_down = weight(EXPERTS, dim, ffn)
        self.norm = nn.Parameter((1 + 0.1 * torch.randn(dim, generator=g)).to(dtype))
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = weight(VOCAB, dim)

    def forward(self, tokens, targets):
        x = self.embed(tokens)  # [B, T, D]
        x = x + torch.tanh(x @ self.w_in.T) @ self.w_out.T
        x = x + torch.tanh(x @ self.w_sq1.T) @ self.w_sq2.T
        route = torch.sigmoid(x @ self.router.T)  # [B, T, E]
        gate = F.silu(torch.einsum("btd,efd->btef", x, self.w_gate))
        h = gate * torch.einsum("btd,efd->btef", x, self.w_up)  # [B, T, E, F]
        x = x + torch.einsum("btef,edf,bte->btd", h, self.w_down, route)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def batch(step, rank=0, world=1):
    """This rank's slice of step `step`'s global batch: (tokens, targets), [GLOBAL_BATCH/W, SEQ]."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // world
    mine = tokens[rank * per : (rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def param_groups(model):
    return [
        {**g, "lr": LR_ADAM} if g["role"] == "adamw" else g for g in mz.muon_param_groups(model)
    ]


def train(model, opts, steps, rank=0, world=1, schedulers=()):
    for step in steps:
        model(*batch(step, rank, world)).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for scheduler in schedulers:
            scheduler.step()


def parameters(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def rel_error(got, ref, start):
    """max over parameters of ||got - ref|| / ||ref - start||: relative to the change."""
    return max(((got[k] - ref[k]).norm() / (ref[k] - start[k]).norm()).item() for k in ref)


def replicas_equal(params):
    flat = torch.cat([t.flatten() for t in params.values()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], other) for other in everyone)


# --------------------------------------------------------------------------------------------------
# 1. torch.distributed.checkpoint


def default_width(world):
    return world // 2 if world % 2 == 0 and world > 2 else world  # the demo's: replicas at 4


def build(world, grad_sync, **net):
    model = Net(**net)
    opt = mz.MuonZeRO(
        param_groups(model),
        lr=LR_MUON,
        ns_dtype=torch.float32,
        grad_sync=grad_sync,
        zero_width=default_width(world),
    )
    return model, opt


def template(model, opt):
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def held_keys(model, opt):
    """DCP's names of the momenta in this rank's share of the state."""
    names, keys = {p: n for n, p in model.named_parameters()}, set()
    for i, entry in opt.state_dict()["state"].items():
        held = entry.get("momentum_buffer")
        prefix = f"optim.state.{names[opt.params[i]]}.momentum_buffer"
        keys |= {prefix} if torch.is_tensor(held) else {f"{prefix}.{e}" for e in held or {}}
    return keys


def owned_keys(model, opt, rank):
    """DCP's names of what the plan gives `rank`: its dense bucket's matrices, its experts."""
    names = {p: n for n, p in model.named_parameters()}
    dense, experts = opt.plan.owned(rank)
    slots = [opt.dense_matrices[i] for i in dense] + [opt.expert_matrices[i] for i in experts]
    return {
        f"optim.state.{names[opt.params[s.param]]}.momentum_buffer"
        + ("" if s.expert is None else f".{s.expert}")
        for s in slots
    }


def save_at(rank, world, root):
    """For each grad_sync: 3 steps, dcp.save into root/sync (and a gathered copy), 2 more steps.
    The exact run's save is measured (a larger model: its state dwarfs DCP's own plans)."""
    out = {}
    for sync in SYNCS:
        model, opt = build(world, sync)
        train(model, [opt], range(SAVED_AT), rank, world)
        state = template(model, opt)
        r = out[sync] = dict(mid=parameters(model), held=held_keys(model, opt))
        r.update(owned=owned_keys(model, opt, rank), mine=opt.state_bytes())
        if sync == "bf16_sr":  # the rule a reshard follows: gather_state_dict()'s
            r["gathered"] = {"model": parameters(model), "optim": opt.gather_state_dict()}
        dcp.save(state, checkpoint_id=f"{root}/{sync}")
        train(model, [opt], range(SAVED_AT, STEPS), rank, world)
        r["end"] = parameters(model)
    model, opt = build(world, "exact", dim=128, hidden=192, ffn=64)
    train(model, [opt], range(SAVED_AT), rank, world)
    out["memory"] = measure_save(model, opt, f"{root}/measured")
    return out


def measure_save(model, opt, directory):
    """Bytes a dcp.save allocates at its peak (memory_timeline's temporaries: what the save made
    and still held), and under the same meter gather_state_dict()'s; this rank's state; `staged`:
    its share's tensors that are views of a larger buffer (same-shape matrices stacked for one NS
    call), which DCP's FileSystemWriter copies out, and keeps until the rank's file is written."""
    state = template(model, opt)
    tl = MemoryTimeline(model=model, optimizer=opt)
    with tl.record():
        with tl.phase("save", 1):
            dcp.save(state, checkpoint_id=directory)
        with tl.phase("gather", 1):
            whole = opt.gather_state_dict()
            del whole
    views = [
        t for t in _tensors(state["optim"]["state"]) if t.untyped_storage().nbytes() > t.nbytes
    ]
    return dict(
        save=tl.peak("temporaries", step=1, phase="save"),
        mine=opt.state_bytes(),
        gather=tl.peak("temporaries", step=1, phase="gather"),
        staged=sum(t.nbytes for t in views),
    )


def _tensors(tree):
    if torch.is_tensor(tree):
        yield tree
    for value in tree.values() if isinstance(tree, dict) else ():
        yield from _tensors(value)


def resume_at(rank, world, root, gathered, weights_only=False, regrouped=False):
    """Fresh runs at this layout load the checkpoint, then take the 2 remaining steps: per
    grad_sync through DCP, and (bf16_sr) from gather_state_dict() for the reseeding rule; with
    regrouped, resume_regrouped's too."""
    out = {}
    for sync in SYNCS:
        model, opt = build(world, sync)
        state = template(model, opt) if not weights_only else {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=f"{root}/{sync}")
        set_model_state_dict(model, state["model"])
        if not weights_only:
            set_optimizer_state_dict(model, opt, state["optim"])
        train(model, [opt], range(SAVED_AT, STEPS), rank, world)
        out[sync] = dict(end=parameters(model), replicas=replicas_equal(parameters(model)))
    model, opt = build(world, "bf16_sr")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(gathered["model"][name])
    opt.load_state_dict(gathered["optim"])
    train(model, [opt], range(SAVED_AT, STEPS), rank, world)
    out["bf16_sr gathered"] = parameters(model)
    if regrouped:
        out["regrouped"] = resume_regrouped(rank, world, root)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """world -> (checkpoint folder, each rank's save_at result), saved on first use."""
    cache = {}

    def at(world):
        if world not in cache:
            root = tmp_path_factory.mktemp(f"dcp_w{world}")
            cache[world] = (str(root), run_ranks(save_at, world, args=(str(root),), timeout=240))
        return cache[world]

    return at


@pytest.fixture(scope="module")
def resumed(saved):
    """(saved_at, resumed_at) -> each rank's resume_at result, run on first use (2 -> 3: with the
    param groups laid out otherwise too, in the same launch)."""
    cache = {}

    def at(saved_at, resumed_at):
        if (saved_at, resumed_at) not in cache:
            root, runs = saved(saved_at)
            kwargs = dict(regrouped=(saved_at, resumed_at) == (2, 3))
            args = (root, runs[0]["bf16_sr"]["gathered"])
            got = run_ranks(resume_at, resumed_at, args=args, kwargs=kwargs, timeout=240)
            cache[saved_at, resumed_at] = got
        return cache[saved_at, resumed_at]

    return at


# saved at 2 and resumed at 3 stays in the default tier
@pytest.mark.parametrize(
    "saved_at, resumed_at",
    [
        pytest.param(w, v, marks=() if (w, v) == (2, 3) else pytest.mark.slow)
        for w in (1, 2, 3, 4)
        for v in (1, 2, 3, 4)
    ],
    ids=lambda x: str(x),
)
def test_dcp_resumes_at_any_world_size(saved, resumed, saved_at, resumed_at):
    """torchtitan's recipe at W ranks, then at W' (see the module docstring for the tolerances)."""
    ref = saved(saved_at)[1][0]
    got = resumed(saved_at, resumed_at)
    where = f"saved at {saved_at} ranks, resumed at {resumed_at}"
    for rank, r in enumerate(got):
        assert r["exact"]["replicas"] and r["bf16_sr"]["replicas"], f"{where}: replicas differ"
        err = rel_error(r["exact"]["end"], ref["exact"]["end"], ref["exact"]["mid"])
        if saved_at == resumed_at:
            same = {
                sync: all(
                    torch.equal(r[sync]["end"][k], ref[sync]["end"][k]) for k in r[sync]["end"]
                )
                for sync in SYNCS
            }
            assert all(same.values()), f"{where}, rank {rank}: not bitwise {same} ({err:.2e})"
        else:
            assert err < FP32_TOL, (
                f"{where}, rank {rank}: exact sync resumes {err:.2e} from the run that never "
                f"stopped (tolerance {FP32_TOL:g} of the change)"
            )
            same = all(
                torch.equal(r["bf16_sr"]["end"][k], r["bf16_sr gathered"][k])
                for k in r["bf16_sr gathered"]
            )
            assert same, (
                f"{where}, rank {rank}: bf16_sr resumed through DCP differs from the resume from "
                f"gather_state_dict(): the rounding noise must be reseeded from (seed, rank, step)"
            )


def resume_regrouped(rank, world, root):
    """The README's recipe with the param groups laid out otherwise than at the save: reversed (the
    same groups: matched by their parameters), and the expert gates merged into the ups' group
    (refused alike on every rank). -> (the reversed run's end after 2 more steps, the refusal)."""
    model = Net()
    opt = mz.MuonZeRO(
        param_groups(model)[::-1], lr=LR_MUON, ns_dtype=torch.float32, grad_sync="exact"
    )
    state = template(model, opt)
    dcp.load(state, checkpoint_id=f"{root}/exact")
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    train(model, [opt], range(SAVED_AT, STEPS), rank, world)
    model2 = Net()
    merged = mz.muon_param_groups(model2, expert_roles={"w_gate": "expert_up"})
    opt2 = mz.MuonZeRO(merged, lr=LR_MUON, ns_dtype=torch.float32, grad_sync="exact")
    state = template(model2, opt2)
    dcp.load(state, checkpoint_id=f"{root}/exact")
    try:
        set_optimizer_state_dict(model2, opt2, state["optim"])
        refusal = None
    except ValueError as err:
        refusal = str(err)
    return parameters(model), refusal


def test_dcp_resume_with_param_groups_laid_out_otherwise(saved, resumed):
    """Saved at 2 ranks, resumed at 3: the same param groups in another order resume as the run
    that never stopped did (exact sync, FP32_TOL of the change); groups holding other parameters
    are one clear error on every rank, not DCP's missing key."""
    ref = saved(2)[1][0]["exact"]
    got = [r["regrouped"] for r in resumed(2, 3)]
    for rank, (end, refusal) in enumerate(got):
        err = rel_error(end, ref["end"], ref["mid"])
        assert err < FP32_TOL, f"rank {rank}: reversed param groups resume {err:.2e} off"
        assert refusal == got[0][1] and "laid out otherwise" in (refusal or ""), refusal


@pytest.mark.slow
def test_dcp_check_fails_without_the_optimizer_state(saved):
    """The tolerance above can fail: a resume that loads only the weights is far off."""
    root, runs = saved(2)
    got = run_ranks(
        resume_at,
        3,
        args=(root, runs[0]["bf16_sr"]["gathered"]),
        kwargs=dict(weights_only=True),
        timeout=240,
    )
    ref = runs[0]["exact"]
    err = rel_error(got[0]["exact"]["end"], ref["end"], ref["mid"])
    assert err > 100 * FP32_TOL, f"a resume without momentum and moments is only {err:.2e} off"


@pytest.mark.parametrize(
    "world",
    [
        2,
        pytest.param(1, marks=pytest.mark.slow),
        pytest.param(3, marks=pytest.mark.slow),
        pytest.param(4, marks=pytest.mark.slow),
    ],
)
def test_dcp_save_writes_what_each_rank_owns(saved, world):
    """Each momentum key is written once, by a rank whose plan owns it (dense replicas and AdamW's
    copies deduplicated by DCP); each rank's share holds exactly what the plan gives it."""
    root, runs = saved(world)
    for sync in SYNCS:
        metadata = dcp.FileSystemReader(f"{root}/{sync}").read_metadata()
        writer = {
            index.fqn: int(info.relative_path.lstrip("_").split("_")[0])  # "__{rank}_0..."
            for index, info in metadata.storage_data.items()
        }
        for rank, r in enumerate(runs):
            assert r[sync]["held"] == r[sync]["owned"], (
                f"{sync}, rank {rank} of {world}: its share holds {sorted(r[sync]['held'])[:3]}.., "
                f"the plan gives it {sorted(r[sync]['owned'])[:3]}..."
            )
        momenta = {k: w for k, w in writer.items() if ".momentum_buffer" in k}
        every = set().union(*(r[sync]["owned"] for r in runs))
        assert set(momenta) == every, f"{sync}: saved {len(momenta)} momenta, owned {len(every)}"
        wrong = [k for k, w in momenta.items() if k not in runs[w][sync]["owned"]]
        assert not wrong, f"{sync}: written by a rank that does not own them: {wrong[:3]}"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_dcp_save_memory_is_this_ranks_state_plus_a_bounded_buffer(saved, world):
    """A save adds to this rank's state only DCP's staging copies of its own stacked views (on a
    GPU they go to host memory: the device holds nothing more) and DCP's plans (64 KiB bound here:
    ~30 keys, pickled): never the whole state; under the same meter gather_state_dict() is it."""
    _, runs = saved(world)
    whole = sum(r["memory"]["mine"] for r in runs)  # >= the state: replicas hold copies
    for rank, r in enumerate(runs):
        m = r["memory"]
        assert m["save"] <= m["staged"] + 64 * 2**10 and m["mine"] + m["save"] < whole, (
            f"rank {rank} of {world}: dcp.save allocated {m['save']:,} bytes at its peak on top "
            f"of this rank's state ({m['mine']:,}, of which {m['staged']:,} in stacked views); "
            f"the whole state is {whole:,}: a save must write this rank's share alone"
        )
        assert m["staged"] < m["mine"] and m["gather"] >= whole / 2, (rank, m)


# --------------------------------------------------------------------------------------------------
# 2.-3. float64 against torch.optim.Muon + AdamW; schedulers that cycle momentum


STACKS = ("w_gate", "w_up", "w_down")


def reference_float64(steps, lr_muon=LR_MUON, scheduler=None, scales=None):
    """One process: torch.optim.Muon on every matrix (each expert its own leaf) + AdamW, float64,
    full batch; `scheduler(opt, max_lr)` wraps each optimizer; with a list `scales`, amp's
    GradScaler steps both, the averaged gradient overflowing at step OVERFLOW_AT, and each step's
    scale is appended. -> (params, per-step momenta)."""
    model = Net(dtype=torch.float64)
    leaves = {n: [m.detach().clone().requires_grad_() for m in getattr(model, n)] for n in STACKS}
    matrices = [
        p
        for n, p in model.named_parameters()
        if p.ndim == 2 and n not in ("embed.weight", "head.weight")
    ] + [m for n in STACKS for m in leaves[n]]
    adamw = [model.embed.weight, model.norm, model.head.weight]
    muon = torch.optim.Muon(
        matrices, lr=lr_muon, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw"
    )
    adam = torch.optim.AdamW(adamw, lr=LR_ADAM, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    schedulers = [scheduler(muon, lr_muon), scheduler(adam, LR_ADAM)] if scheduler else []
    scaler = amp_scaler(scales is not None)
    momenta = []
    with mz.torch_muon_newton_schulz_in(torch.float64):
        for step in range(steps):
            stacked = {n: torch.stack(leaves[n]) for n in STACKS}
            params = {**dict(model.named_parameters()), **stacked}
            loss = torch.func.functional_call(model, params, batch(step))
            scaler.scale(loss).backward()
            if scales is not None and step == OVERFLOW_AT:  # one rank's inf, averaged in
                overflow(model)
            momenta.append((muon.param_groups[0]["momentum"], adam.param_groups[0]["betas"][0]))
            (
                scaler.step(muon),
                scaler.step(adam),
                scaler.update(),
                muon.zero_grad(),
                adam.zero_grad(),
            )
            if scales is not None:
                scales.append(scaler.get_scale())
            for s in schedulers:
                s.step()
    out = parameters(model)
    out.update({n: torch.stack(leaves[n]).detach() for n in STACKS})
    return out, momenta


def amp_scaler(enabled):
    """amp's GradScaler, its scale growing every 2 clean steps: a skip shows in every later one."""
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, enabled=enabled)


OVERFLOW_AT = 2  # the step whose gradient overflows (on rank 1 alone in MuonZeRO's run)


def overflow(model):
    """An fp16 overflow in a Muon matrix's gradient and an AdamW tensor's."""
    model.w_in.grad[0, 0] = model.norm.grad[0] = math.inf


def muon_zero_float64(rank, world, steps, lr_muon=LR_MUON, scheduler=None, amp=False):
    """MuonZeRO in float64 (exact sync, float64 NS, torch's 5 steps, RMS 0.2) on `world` ranks;
    amp: under amp's GradScaler, rank 1's gradient overflowing at step OVERFLOW_AT (momenta then
    holds each step's scale)."""
    model = Net(dtype=torch.float64)
    opt = mz.MuonZeRO(
        param_groups(model),
        lr=lr_muon,
        ns_dtype=torch.float64,
        grad_sync="exact",
        ns_coefficients=mz.STANDARD_NS_COEFFICIENTS,
        update_rms=0.2,
    )
    max_lr = [LR_ADAM if g["role"] == "adamw" else lr_muon for g in opt.param_groups]
    schedulers = [scheduler(opt, max_lr)] if scheduler else []
    momenta = []
    if amp:
        scaler = amp_scaler(True)
        for step in range(steps):
            scaler.scale(model(*batch(step, rank, world))).backward()
            if step == OVERFLOW_AT and rank == 1:
                overflow(model)
            scaler.step(opt), scaler.update(), opt.zero_grad()
            momenta.append(scaler.get_scale())
        return parameters(model), momenta
    for step in range(steps):
        muon = next(g for g in opt.param_groups if g["role"] != "adamw")["momentum"]
        adam = next(g for g in opt.param_groups if g["role"] == "adamw")["momentum"]
        momenta.append((muon, adam))
        train(model, [opt], [step], rank, world, schedulers)
    return parameters(model), momenta


def float64_runs(rank, world):
    """muon_zero_float64 for STEPS, and at 2 ranks under amp's GradScaler too: one launch. The
    embedding and head cut into AdamW blocks of 3 rows dealt over the ranks, as at scale."""
    mz.ADAMW_BLOCK_NUMEL = 3 * 12
    amp = muon_zero_float64(rank, world, STEPS, amp=True) if world == 2 else None
    return muon_zero_float64(rank, world, STEPS), amp


@pytest.fixture(scope="module")
def float64_at():
    """world -> each rank's float64_runs, run on first use."""
    cache = {}

    def at(world):
        if world not in cache:
            cache[world] = run_ranks(float64_runs, world)
        return cache[world]

    return at


def test_float64_equals_torch_muon_and_adamw(float64_at, monkeypatch):
    """float64 MuonZeRO at 1 and 2 ranks = torch.optim.Muon + AdamW in float64 to 1e-12 of the
    change, with the plan's batched Newton-Schulz calls and with one call per matrix (the path
    large matrices take); the same check catches a Muon learning rate 1% off."""
    start = parameters(Net(dtype=torch.float64))
    ref, _ = reference_float64(STEPS)
    for world in (1, 2):
        for rank, ((got, _), _) in enumerate(float64_at(world)):
            err = rel_error(got, ref, start)
            assert err < FP64_TOL, f"rank {rank} of {world}: float64 is {err:.2e} off"
    with monkeypatch.context() as patch:
        patch.setattr(mz, "NS_BATCH_MAX_COST", 0)  # every run: one NS call per matrix
        got, _ = muon_zero_float64(0, 1, STEPS)
    err = rel_error(got, ref, start)
    assert err < FP64_TOL, f"per-matrix Newton-Schulz in float64 is {err:.2e} off torch.optim.Muon"
    wrong, _ = muon_zero_float64(0, 1, STEPS, lr_muon=1.01 * LR_MUON)
    err = rel_error(wrong, ref, start)
    assert err > 1e3 * FP64_TOL, f"a learning rate 1% off passes as {err:.2e}: the check is blind"


def test_grad_scaler_overflow_on_one_rank_equals_ddp_with_torch_muon(float64_at):
    """amp's GradScaler, rank 1's gradient overflowing at one step: MuonZeRO at 2 ranks skips it on
    both, as DDP (the average overflows everywhere) + torch.optim.Muon + AdamW under GradScaler
    do; every later scale and the parameters agree (float64, 1e-12)."""
    start, ref_scales = parameters(Net(dtype=torch.float64)), []
    ref, _ = reference_float64(STEPS, scales=ref_scales)
    assert ref_scales[OVERFLOW_AT] < ref_scales[OVERFLOW_AT - 1], "the reference must skip a step"
    for rank, (_, (got, scales)) in enumerate(float64_at(2)):
        assert scales == ref_scales, (
            f"rank {rank}: GradScaler's scale per step {scales}, DDP + torch.optim.Muon's "
            f"{ref_scales}: the ranks must agree on the overflow"
        )
        err = rel_error(got, ref, start)
        assert err < FP64_TOL, f"rank {rank}: {err:.2e} from DDP + torch.optim.Muon + GradScaler"


def one_cycle(opt, max_lr):
    return torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=max_lr, total_steps=8, cycle_momentum=True
    )


def cyclic(opt, max_lr):
    base = [lr / 4 for lr in max_lr] if isinstance(max_lr, list) else max_lr / 4
    return torch.optim.lr_scheduler.CyclicLR(
        opt, base_lr=base, max_lr=max_lr, step_size_up=3, cycle_momentum=True
    )


@pytest.mark.parametrize("scheduler", [one_cycle, cyclic], ids=["OneCycleLR", "CyclicLR"])
def test_schedulers_cycle_muons_momentum_and_adamws_beta1(scheduler):
    """Muon's momentum and AdamW's beta1 follow the scheduler in MuonZeRO's groups, step by step,
    as in torch.optim.Muon and AdamW, and the trained parameters agree (float64, 1e-12)."""
    start = parameters(Net(dtype=torch.float64))
    ref, ref_momenta = reference_float64(STEPS, scheduler=scheduler)
    got, momenta = muon_zero_float64(0, 1, STEPS, scheduler=scheduler)
    assert len({m for m, _ in ref_momenta}) > 1, "the scheduler must move the momentum"
    assert momenta == ref_momenta, (
        f"(Muon's momentum, AdamW's beta1) per step: {momenta}, torch.optim.Muon + AdamW under "
        f"the same scheduler: {ref_momenta}"
    )
    err = rel_error(got, ref, start)
    assert err < FP64_TOL, f"{err:.2e} from torch.optim.Muon + AdamW under the same scheduler"


def test_float64_and_grad_sync_names():
    """grad_sync is spelt one way: 'exact' keeps float64 buffers, 'fp32' (its old name) is
    refused naming both; bf16_sr rounds float32 only, and says so."""
    model = Net(dtype=torch.float64)
    opt = mz.MuonZeRO(param_groups(model), ns_dtype=torch.float64, grad_sync="exact")
    train(model, [opt], range(2))
    assert all(t.dtype == torch.float64 for t in opt.local_state_tensors())
    with pytest.raises(
        ValueError, match="grad_sync must be 'bf16_sr' .V4's. or 'exact', got 'fp32'"
    ):
        mz.MuonZeRO(param_groups(Net(dtype=torch.float64)), grad_sync="fp32")
    with pytest.raises(ValueError, match="bf16_sr.*float64 parameters need grad_sync='exact'"):
        mz.MuonZeRO(param_groups(Net(dtype=torch.float64)))
    with pytest.raises(ValueError, match="several dtypes"):
        mz.MuonZeRO(
            [
                torch.zeros(3, 3, requires_grad=True),
                torch.zeros(3, 3, dtype=torch.float64, requires_grad=True),
            ],
            grad_sync="exact",
        )


# --------------------------------------------------------------------------------------------------
# 4. Agreement once


def steps_without_agreement(rank, world):
    """Construction agrees once; then every agreement path is made to fail, and steps still run."""
    model = Net()
    opt = mz.MuonZeRO(param_groups(model), lr=LR_MUON)

    def refused(*args, **kwargs):
        raise AssertionError("step() ran an agreement collective")

    launch.agree, dist.all_gather_object = refused, refused
    train(model, [opt], range(2), rank, world)
    return replicas_equal(parameters(model))


def test_steps_agree_nothing_across_ranks():
    assert run_ranks(steps_without_agreement, 2) == [True, True]


# --------------------------------------------------------------------------------------------------
# 5. What the step's all-reduce agrees; the rounding noise and its counter


def test_rounding_noise_is_fresh_every_step_and_rank_and_unbiased():
    """The generator step() seeds draws other noise at every step and rank, and the mean of N
    roundings of a value 0.3 of a bf16 gap above 1 converges to it: one rounding's spread is
    sqrt(0.3 * 0.7) gaps, the mean's 0.0143 gaps at N = 1024; tolerance 5 of those, 0.072 gaps.
    A seed a CPU generator truncates to the same 32 bits every step repeats one rounding: 0.3 or
    0.7 gaps off."""

    def generator(rank, step):
        return torch.Generator().manual_seed(mz.rounding_seed(0, rank, step))

    def noise(rank, step):
        return torch.randint(0, 1 << 16, (64,), generator=generator(rank, step))

    assert not torch.equal(noise(0, 5), noise(0, 6)), "steps 5 and 6 draw the same noise"
    assert not torch.equal(noise(0, 5), noise(1, 5)), "ranks 0 and 1 draw the same noise"
    gap, N = 2.0**-7, 1024
    x = torch.tensor([1 + 0.3 * gap])
    for rank in (0, 1):
        mean = sum(mz.stochastic_round_to_bf16(x, generator(rank, k)).item() for k in range(N)) / N
        off = abs(mean - x.item()) / gap
        assert off < 0.072, f"rank {rank}: the mean of {N} roundings is {off:.3f} gaps off"


def agreed_run(rank, world, root):
    """bf16_sr: 3 steps recording the start of each rounding noise step() draws; a save through
    compose_checkpoint (its flattened optimizer state); 2 more steps, and a fresh run that loads
    the save and takes the same 2; then an lr changed alike on every rank (steps), and
    ReduceLROnPlateau stepped on each rank's own metric, which lowers rank 1's lr alone."""
    model, opt = build(world, "bf16_sr")
    noise, draw = [], mz.stochastic_round_to_bf16

    def recording(x, generator=None):
        probe = torch.Generator()
        probe.set_state(generator.get_state())
        noise.append(torch.randint(0, 1 << 16, (16,), dtype=torch.int32, generator=probe))
        return draw(x, generator)

    mz.stochastic_round_to_bf16 = recording
    train(model, [opt], range(SAVED_AT), rank, world)
    mz.stochastic_round_to_bf16 = draw
    dcp.save(compose_checkpoint.checkpoint_state(model, model, opt), checkpoint_id=root)
    train(model, [opt], range(SAVED_AT, STEPS), rank, world)
    resumed, opt2 = build(world, "bf16_sr")
    compose_checkpoint.load_checkpoint(root, resumed, resumed, opt2)
    counter = opt2.steps
    train(resumed, [opt2], range(SAVED_AT, STEPS), rank, world)
    ref, got = parameters(model), parameters(resumed)
    out = dict(noise=noise, counter=counter, same=all(torch.equal(ref[k], got[k]) for k in ref))
    for g in opt.param_groups:
        g["lr"] /= 2
    train(model, [opt], [STEPS], rank, world)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    for metric in (1.0, 0.5 if rank == 0 else 1.0):
        plateau.step(metric)
    before = parameters(model)
    model(*batch(STEPS + 1, rank, world)).backward()
    try:
        opt.step()
    except ValueError as err:
        out["refusal"] = str(err)
    after = parameters(model)
    return dict(out, kept=all(torch.equal(before[k], after[k]) for k in before))


@pytest.fixture(scope="module")
def agreed(tmp_path_factory):
    root = tmp_path_factory.mktemp("compose_counter")
    return run_ranks(agreed_run, 2, args=(str(root),), timeout=120)


def test_noise_differs_per_step_and_rank(agreed):
    """The rounding noise step() draws differs between steps and between ranks."""
    starts = [tuple(n.tolist()) for r in agreed for n in r["noise"]]
    assert len(set(starts)) == len(starts), "two draws of rounding noise (steps, ranks) repeat"


def test_drifted_settings_are_refused_on_every_rank(agreed):
    """Ranks whose lr drifted apart (ReduceLROnPlateau on per-rank metrics) are refused on every
    rank with the same line, before any parameter moves; an lr changed alike steps."""
    refusals = [r.get("refusal") for r in agreed]
    assert refusals[0] and refusals[0] == refusals[1], f"the ranks said {refusals}"
    assert "ReduceLROnPlateau" in refusals[0], refusals[0]
    assert all(r["kept"] for r in agreed), "a refused step moved parameters"


def test_compose_checkpoints_keep_the_step_counter(agreed):
    """Saved at step 3 through compose_checkpoint, the counter comes back as 3 and the next steps'
    rounding noise is the uninterrupted run's: bitwise the same parameters."""
    for rank, r in enumerate(agreed):
        assert r["counter"] == SAVED_AT, f"rank {rank}: step counter {r['counter']} after resume"
        assert r["same"], f"rank {rank}: the resumed run is not bitwise the uninterrupted one"
