"""The budget (layouts/compose_budget.py, link_bytes included) against the chapters' own objects,
never against itself.

Parameters: the nn.Module built here from mhc and cp_compress modules, tensor by tensor. Optimizer
state and gradient traffic: MuonZeRO itself on gloo ranks (its state_bytes and its shards' chunk
sizes). Pipeline sends: mhc.pipeline_step's own byte counters on gloo ranks. CP traffic:
cp_compress.phase_bytes, the chapter's count of what one layer sends. Bytes are integers, so every
comparison is exact.
"""

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn as nn

import compose
import cp_compress as cpc
import mhc
import muon_zero as mz
from layouts import compose_budget
from tools.spawn import run_ranks

CFG = compose.ComposeConfig()
ODD = dataclasses.replace(
    CFG,
    dim=32,
    n_hc=3,
    n_heads=2,
    head_dim=8,
    index_heads=2,
    index_dim=8,
    n_experts=3,
    expert_hidden=48,
    vocab_size=100,
    window=8,
    top_k=8,
)


# ---- the model, built from the chapters' modules -------------------------------------------------
# The budget reads compose's own model (built on the meta device) and compose.stage_parameters; the
# proof is the same modules, built here from mhc and cp_compress under the same names.


class AttentionF(nn.Module):
    """F of an attention sublayer: output projection, RMSNorm, cp_compress.CompressedAttention."""

    def __init__(self, cfg, kind):
        super().__init__()
        ratio = {"csa": cfg.csa_ratio, "hca": cfg.hca_ratio}[kind]
        self.wo = nn.Parameter(torch.randn(cfg.n_heads * cfg.head_dim, cfg.dim))
        self.norm = mhc.RMSNorm(cfg.dim)
        self.core = nn.Module()
        self.core.attention = cpc.CompressedAttention(
            kind, cfg.dim, cfg.n_heads, cfg.head_dim, ratio, cfg.window, cfg.top_k,
            cfg.index_heads, cfg.index_dim,
        )  # fmt: skip
        self.core.attention.ape.no_muon = True  # a positional bias [m, sets, C], not an expert
        for name in ("wq_index", "w_index", "norm_index"):  # top-k is not differentiable
            if hasattr(self.core.attention, name):
                getattr(self.core.attention, name).requires_grad_(False)


class MoEF(nn.Module):
    """F of an MoE sublayer: router, SwiGLU expert stacks (muon_zero.TinyMoE's shapes), RMSNorm."""

    def __init__(self, cfg):
        super().__init__()
        E, h, C = cfg.n_experts, cfg.expert_hidden, cfg.dim
        self.router = nn.Parameter(torch.randn(E, C))
        self.w_gate = nn.Parameter(torch.randn(E, h, C))
        self.w_up = nn.Parameter(torch.randn(E, h, C))
        self.w_down = nn.Parameter(torch.randn(E, C, h))
        self.norm = mhc.RMSNorm(C)


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        kinds = [compose_budget.sublayer_kind(i) for i in range(cfg.n_layers)]
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.sublayers = nn.ModuleList(
            MoEF(cfg) if k == "moe" else AttentionF(cfg, k) for k in kinds
        )
        self.hcs = nn.ModuleList(mhc.HyperConnection(cfg.n_hc, cfg.dim) for _ in kinds)
        self.hyper_head = mhc.HyperHead(cfg.n_hc, cfg.dim)
        self.norm = mhc.RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)


def make_model(cfg):
    torch.manual_seed(0)
    return Model(cfg)


def held_modules(model, pp, stage):
    """What stage `stage` of `pp` trains: its sublayers (mhc.stage_layers), the embedding on the
    first stage, the HyperHead, norm and LM head on the last."""
    first, stop = mhc.stage_layers(len(model.hcs), pp, stage)
    held = nn.ModuleDict({f"layer{i}": nn.ModuleList([model.sublayers[i], model.hcs[i]])
                          for i in range(first, stop)})  # fmt: skip
    if stage == 0:
        held["embed"] = model.embed
    if stage == pp - 1:
        held.update({"hyper_head": model.hyper_head, "norm": model.norm, "lm_head": model.lm_head})
    return held


def optimizer_groups(held):
    """MuonZeRO's param groups for a stage: muon_param_groups' roles, trained tensors only."""
    groups = []
    for g in mz.muon_param_groups(held):
        g["params"] = [p for p in g["params"] if p.requires_grad]
        groups += [g] if g["params"] else []
    return groups


def roles_of(model, held):
    """{parameter name in the model: role} as muon_param_groups assigns them for the stage."""
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)]: g["role"] for g in mz.muon_param_groups(held) for p in g["params"]}


# ---- parameters --------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [CFG, ODD], ids=["default", "odd-sizes"])
def test_model_tensors_are_the_modules_parameters(cfg):
    model = make_model(cfg)
    real = {n: (tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()}
    predicted = {t.name: (t.shape, t.trains) for t in compose_budget.model_tensors(cfg)}
    assert predicted == real, "names, shapes or trained flags differ"
    assert sum(p.numel() for p in model.parameters()) == sum(
        t.numel for t in compose_budget.model_tensors(cfg)
    )


@pytest.mark.parametrize("cfg", [CFG, ODD], ids=["default", "odd-sizes"])
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_stage_tensors_are_what_the_stage_trains(cfg, pp):
    model = make_model(cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    for stage in range(pp):
        held = held_modules(model, pp, stage)
        predicted = compose_budget.stage_tensors(cfg, pp, stage)
        assert [t.name for t in predicted] == [names[id(p)] for p in held.parameters()], (
            f"stage {stage} of {pp}: other tensors, or another order"
        )
        assert {t.name: t.role for t in predicted} == roles_of(model, held)


def test_parameter_bytes_per_rank_are_the_stage_modules():
    model = make_model(CFG)
    for pp, cp, dp in compose_budget.factorisations(4):
        row = compose_budget.layout_budget(CFG, pp, cp, dp, 2**40, 1e9, 1e9, 4)
        for rank, held in enumerate(row.held):
            params = list(held_modules(model, pp, rank // (cp * dp)).parameters())
            assert held["parameters"] == 4 * sum(p.numel() for p in params)
            assert held["gradients"] == 4 * sum(p.numel() for p in params if p.requires_grad)


def test_plan_equals_muonzeros_plan_of_the_module():
    """The budget's plan is MuonZeRO's: the same dense, expert and AdamW tensors, same order."""
    model = make_model(CFG)
    for pp, group in ((1, 4), (2, 2), (4, 1)):
        for stage in range(pp):
            groups = {
                g["role"]: g["params"] for g in optimizer_groups(held_modules(model, pp, stage))
            }
            dense = [tuple(p.shape) for p in groups.get("dense", [])]
            experts = [tuple(p.shape[1:]) for role in mz.EXPERT_ROLES
                       for p in groups.get(role, []) for _ in range(p.shape[0])]  # fmt: skip
            adamw = [tuple(p.shape) for p in groups.get("adamw", [])]
            want = mz.plan_muon(dense, experts, group, adamw_shapes=adamw)
            got = compose_budget.muon_plan(compose_budget.stage_tensors(CFG, pp, stage), group)
            assert got == want


# ---- optimizer state and gradient traffic: MuonZeRO itself, on gloo ranks -----------------------


def check_muonzero(rank, world, pp, stage, grad_sync):
    """Build MuonZeRO over this stage's module on `world` ranks (the stage's cp x dp group), one
    step on random gradients; -> what MuonZeRO holds and the chunks its collectives move."""
    torch.manual_seed(0)
    held = held_modules(make_model(CFG), pp, stage)
    opt = mz.MuonZeRO(optimizer_groups(held), lr=0.01, grad_sync=grad_sync)
    gen = torch.Generator().manual_seed(rank)
    for p in held.parameters():
        p.grad = torch.randn(p.shape, generator=gen) if p.requires_grad else None
    opt.step()
    chunks = {("experts" if s.peers == world and s is opt.shards[-1] and opt.expert_matrices
               else "dense"): (s.chunk_numel, s.peers) for s in opt.shards}  # fmt: skip
    return opt.state_bytes(), chunks, (opt.adamw_shards.chunk_numel, opt.adamw_shards.peers)


SLOW = pytest.mark.slow


# the 2 x 2 case stays in the default tier; the pipeline and cp = 4 cases are slow
@pytest.mark.parametrize(
    "pp,cp,dp,grad_sync",
    [
        (1, 2, 2, "bf16_sr"),
        pytest.param(2, 1, 2, "exact", marks=SLOW),
        pytest.param(1, 4, 1, "bf16_sr", marks=SLOW),
    ],
)
def test_optimizer_and_gradient_bytes_equal_muonzeros(pp, cp, dp, grad_sync):
    group, item = cp * dp, 2 if grad_sync == "bf16_sr" else 4
    row = compose_budget.layout_budget(CFG, pp, cp, dp, 2**40, 1e9, 1e9, 4, grad_sync)
    for stage in range(pp):
        results = run_ranks(check_muonzero, group, args=(pp, stage, grad_sync), timeout=180)
        for group_rank, (state_bytes, chunks, adamw) in enumerate(results):
            rank = stage * group + group_rank  # (p * cp + c) * dp + d, with c * dp + d here
            assert row.held[rank]["optimizer"] == state_bytes, (
                f"rank {rank}: predicted {row.held[rank]['optimizer']} optimizer bytes, "
                f"MuonZeRO holds {state_bytes}"
            )
            sent = sum((peers - 1) * numel for numel, peers in chunks.values())
            adamw_sent = (adamw[1] - 1) * adamw[0] * 4  # AdamW's chunks travel in fp32
            assert row.sent[rank]["grad_reduce_scatter"] == item * sent + adamw_sent
            assert row.sent[rank]["param_all_gather"] == 4 * sent + adamw_sent


# ---- pipeline sends: mhc's own counters ---------------------------------------------------------


def check_pipeline_bytes(rank, world, cfg_fields, batch, n_micro):
    """mhc.pipeline_step over `world` stages; -> (bytes sent forward, backward) on this stage."""
    torch.manual_seed(0)
    cfg = mhc.Config(**cfg_fields)
    model = mhc.Transformer(cfg)
    data = mhc.synthetic_batch(cfg, batch, torch.Generator().manual_seed(1), "cpu")
    _, stats = mhc.pipeline_step(model, data[:, :-1], data[:, 1:], n_micro, "optimised")
    return stats.bytes_sent_forward, stats.bytes_sent_backward


def test_pp_send_equals_what_the_pipeline_sends():
    fields = dict(vocab_size=32, seq_len=8, dim=16, n_heads=2, n_layers=3, n_hc=4)
    batch, n_micro = 6, 3
    counted = run_ranks(check_pipeline_bytes, 3, args=(fields, batch, n_micro), timeout=180)
    cfg = dataclasses.replace(CFG, dim=16, seq_len=8, n_hc=4, n_layers=3, batch=batch,
                              n_micro=n_micro, csa_ratio=4, hca_ratio=8, window=4)  # fmt: skip
    stream = torch.empty(batch // n_micro, cfg.seq_len, cfg.n_hc, cfg.dim)
    row = compose_budget.layout_budget(cfg, 3, 1, 1, 2**40, 1e9, 1e9, 4)
    for stage, (forward, backward) in enumerate(counted):
        assert row.sent[stage]["pp_send"] == forward + backward
    middle = counted[1]
    assert sum(middle) == stream.nbytes * 2 * n_micro  # micro stream x 2 directions x micros


# ---- CP traffic: the chapter's own count ---------------------------------------------------------


def cp_layers(cfg, first, stop):
    """A pipeline stage's attention layers as the chapter's modules (phase_bytes reads sizes)."""
    kinds = [compose_budget.sublayer_kind(i) for i in range(first, stop)]
    return [AttentionF(cfg, kind).core.attention for kind in kinds if kind != "moe"]


@pytest.mark.parametrize("cfg", [CFG, ODD], ids=["default", "odd-sizes"])
@pytest.mark.parametrize("pp,cp", [(1, 2), (1, 4), (2, 2), (3, 1)])
def test_cp_bytes_equal_the_chapters_count(cfg, pp, cp):
    dp = 1
    row = compose_budget.layout_budget(cfg, pp, cp, dp, 2**40, 1e9, 1e9, 4)
    s = cfg.seq_len // cp
    for p, c in itertools.product(range(pp), range(cp)):
        first, stop = mhc.stage_layers(cfg.n_layers, pp, p)
        halo = gather = 0
        for layer in cp_layers(cfg, first, stop):
            sent = cpc.phase_bytes(layer, s, cp, c)  # forward: to the next rank, to every peer
            back = cpc.phase_bytes(layer, s, cp, cp - 1 - c)  # backward runs the line reversed
            halo += sent["phase1_halo"] + sent["window_halo"]
            halo += back["phase1_halo"] + back["window_halo"]
            gather += 2 * sent["phase2_allgather"]  # all-gather, then its reduce-scatter
        rank = (p * cp + c) * dp
        assert row.sent[rank]["cp_halo"] == cfg.batch * halo
        assert row.sent[rank]["cp_gather"] == cfg.batch * gather


def test_cp_halo_is_halo_rows_of_raw_rows():
    """One CSA and one HCA layer per stage at pp = 6: the halo is halo_rows x the row's bytes."""
    cfg = dataclasses.replace(CFG, batch=6, n_micro=6)
    row = compose_budget.layout_budget(cfg, 6, 2, 1, 2**40, 1e9, 1e9, 4)
    rows = {"csa": 2 * cfg.csa_ratio - 1, "hca": cfg.hca_ratio - 1}
    row_bytes = {"csa": 2 * 2 * (cfg.head_dim + cfg.index_dim) * 4, "hca": 2 * cfg.head_dim * 4}
    window = (cfg.window - 1) * cfg.head_dim * 4
    for stage in range(6):
        kind = compose_budget.sublayer_kind(2 * stage)
        expected = cfg.batch * (rows[kind] * row_bytes[kind] + window)
        assert row.sent[2 * stage]["cp_halo"] == expected  # CP rank 0: forward only


# ---- the table ----------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8, 12, 16])
def test_every_factorisation_listed_once(world):
    rows = compose_budget.budget_table(CFG, world, 2**30, 1e10, 1e9, 4)
    got = [(r.pp, r.cp, r.dp) for r in rows]
    want = [t for t in itertools.product(range(1, world + 1), repeat=3) if math.prod(t) == world]
    assert sorted(got) == sorted(want) and len(set(got)) == len(got)


def test_ranking_fits_first_then_time():
    rows = compose_budget.budget_table(CFG, 4, 16 * 2**20, 1e10, 1e9, 2)
    verdicts = [(bool(r.problem), not r.fits) for r in rows]
    assert verdicts == sorted(verdicts), "runnable layouts that fit come first"
    fitting = [r.step_s for r in rows if r.fits and not r.problem]
    assert fitting == sorted(fitting)
    assert any(not r.fits for r in rows) and any(r.fits for r in rows)
    assert all(r.peak_bytes <= 16 * 2**20 for r in rows if r.fits)
    table = compose_budget.format_budget(rows)
    assert len(table.splitlines()) == len(rows) + 1 and "DOES NOT FIT" in table


def test_refused_layouts_say_why():
    rows = {r.name: r for r in compose_budget.budget_table(CFG, 3, 2**30, 1e10, 1e9, 4)}
    assert "cp=3" in rows["1x3x1"].problem  # T = 256 does not split into 3
    long = dataclasses.replace(CFG, n_layers=10)
    rows = {r.name: r for r in compose_budget.budget_table(long, 4, 2**30, 1e10, 1e9, 4)}
    assert "pp=4" in rows["4x1x1"].problem and not rows["2x2x1"].problem


def test_monotonic_sanity():
    def worst(row, key):
        return max(h[key] for h in row.held)

    def at(pp, cp, dp, cfg=CFG):
        return compose_budget.layout_budget(cfg, pp, cp, dp, 2**40, 1e10, 1e9, 4)

    assert (
        worst(at(1, 1, 4), "optimizer")
        < worst(at(1, 1, 2), "optimizer")
        < worst(at(1, 1, 1), "optimizer")
    )  # ZeRO shards the state
    assert (
        worst(at(1, 4, 1), "activations")
        < worst(at(1, 2, 1), "activations")
        < worst(at(1, 1, 1), "activations")
    )  # CP splits the tokens
    assert (
        worst(at(4, 1, 1), "parameters")
        < worst(at(2, 1, 1), "parameters")
        < worst(at(1, 1, 1), "parameters")
    )  # the pipeline splits the layers
    big = dataclasses.replace(CFG, batch=8, n_micro=4)
    assert max(s["pp_send"] for s in at(2, 1, 1, big).sent) == 2 * max(
        s["pp_send"] for s in at(2, 1, 1).sent
    )
    one = at(1, 1, 1)
    assert all(v == 0 for s in one.sent for v in s.values()) and one.step_s == 0
    lanes = dataclasses.replace(CFG, n_hc=8)
    assert worst(at(2, 1, 1, lanes), "activations") > worst(at(2, 1, 1), "activations")
    slow = compose_budget.layout_budget(CFG, 1, 2, 2, 2**40, 1e10, 1e8, 2)
    fast = compose_budget.layout_budget(CFG, 1, 2, 2, 2**40, 1e10, 1e9, 2)
    assert slow.step_s > fast.step_s  # the grad group spans two nodes of 2 ranks


def test_first_stage_holds_the_most_micro_batches():
    """Stages 0 and 2 hold the same kinds of sublayer (CSA, MoE); 1F1B keeps 4 and 2 in flight."""
    row = compose_budget.layout_budget(
        dataclasses.replace(CFG, n_layers=8), 4, 1, 1, 2**40, 1, 1, 4
    )
    acts = [h["activations"] for h in row.held]
    assert acts[0] > acts[2] and acts[1] > acts[3]


def test_bad_input_raises_a_clear_error():
    for kwargs, word in (
        (dict(world=0), "world"),
        (dict(device_bytes=0), "device_bytes"),
        (dict(intra_bw=-1), "intra_bw"),
        (dict(ranks_per_node=1.5), "ranks_per_node"),
    ):
        args = dict(world=4, device_bytes=2**30, intra_bw=1e10, inter_bw=1e9, ranks_per_node=4)
        with pytest.raises(ValueError, match=word):
            compose_budget.budget_table(CFG, **{**args, **kwargs})
