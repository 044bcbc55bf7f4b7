"""Composing the four chapters: one small V4-like decoder on any pp x cp x dp layout.

What the standard tool assumes. A parallelism layout is a product of independent dimensions: data
parallelism averages gradients, a pipeline passes one activation per token, context parallelism
shards a sequence of per-token keys, and each is proven on its own model.

What V4 violates. Its four reshapings meet in one machine. The pipeline carries the n-lane mHC
stream, not d numbers; every attention layer runs the compressed two-stage CP protocol inside the
pipeline's micro-batches; Muon needs whole matrices, so the optimizer is sharded over the ranks that
hold the same stage (cp x dp of them), never over the pipeline; tensor checkpointing plans its
forgetting per stage, inside F, around collectives FX cannot trace. The seams are where bugs live.

The fix: one mesh, the chapters' own functions, one proof. `init_device_mesh` gives the pipeline
its forward link, the CP group and the stage group (the backward link is a second group over the
same pipeline ranks); mhc.pipeline_step runs 1F1B with selective recomputation, cp_compress's
protocol runs in every attention F, MuonZeRO steps each stage, tensor_ckpt forgets normalised
inputs and activation outputs. K steps at every layout equal K steps of `reference_training`: one
process, none of the four techniques, torch.optim.Muon + AdamW.
Beside it, in layouts/: compose_budget.py predicts every layout's bytes per rank and per link
before anything runs, compose_checkpoint.py saves at one layout and resumes at any other; and
benchmarks/bench_compose.py sets what a run measures beside the prediction.

    python compose.py                                                  # one process
    torchrun --nproc_per_node=4 compose.py --pp 2 --cp 2 --dp 1        # any pp*cp*dp = world
    torchrun --nproc_per_node=2 compose.py --pp 2 --check              # against the reference
    torchrun --nproc_per_node=2 compose.py --pp 2 --steps 2 --save ckpt  # a checkpoint ...
    python compose.py --steps 4 --resume ckpt --check                  # ... resumed anywhere
    python compose.py --help
"""

import argparse
import contextlib
import functools
import math
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import cp_compress
import launch
import mhc
import muon_zero
import tensor_ckpt
from layouts import compose_checkpoint
from tensor_ckpt import forget


# fmt: off
@dataclass
class ComposeConfig:
    vocab_size: int = 256
    dim: int = 64            # d, the width of each of the n_hc residual lanes
    n_layers: int = 12       # sublayers F, each inside one mHC hyper-connection (see below)
    seq_len: int = 256       # T tokens of packed documents per sequence; each CP rank holds T/cp
    batch: int = 4           # sequences per data-parallel replica per step
    n_micro: int = 4         # pipeline micro-batches per step (>= pp for 1F1B)
    n_hc: int = 4            # mHC lanes
    n_heads: int = 4
    head_dim: int = 16
    csa_ratio: int = 4       # m of CSA (overlapping windows, indexer + top-k)
    hca_ratio: int = 16      # m of HCA (no overlap, dense over entries)
    window: int = 16         # sliding window of raw rows
    top_k: int = 16          # CSA indexer picks
    index_heads: int = 4
    index_dim: int = 16
    n_experts: int = 4
    experts_per_token: int = 2
    expert_hidden: int = 128
# fmt: on


@dataclass
class Training:
    """The optimizer's settings. Muon's defaults are those torch.optim.Muon can reproduce (its
    5 standard Newton-Schulz steps, match_rms_adamw = update RMS 0.2); V4 uses 10 and 0.18."""

    steps: int = 3
    lr_muon: float = 0.02
    lr_adamw: float = 3e-3
    weight_decay: float = 0.1
    grad_sync: str = "exact"  # V4: "bf16_sr"
    ns_dtype: torch.dtype = torch.float32  # V4: bf16
    seed: int = 0
    dtype: torch.dtype = torch.float32  # the parameters'; float64 (grad_sync "exact"): the proof
    allow_nonfinite: bool = False  # else a non-finite loss or gradient stops the run (Refused)


# ---- 1. The model: F alternates compressed attention and a routed MoE, each inside mHC -------


class AttentionSublayer(nn.Module):
    """F of an even sublayer: RMSNorm -> CSA or HCA (cp_compress) -> output projection.
    [B, s, d] -> [B, s, d]. The normalised input is cheap to redo: forgotten."""

    def __init__(self, cfg, kind, documents):
        super().__init__()
        ratio = cfg.csa_ratio if kind == "csa" else cfg.hca_ratio
        self.norm = mhc.RMSNorm(cfg.dim)
        sizes = (cfg.n_heads, cfg.head_dim, ratio, cfg.window, cfg.top_k, cfg.index_heads)
        core = cp_compress.CompressedAttention(kind, cfg.dim, *sizes, cfg.index_dim)
        self.core = Compressed(core, documents)
        self.wo = nn.Parameter(torch.randn(cfg.n_heads * cfg.head_dim, cfg.dim) / cfg.dim**0.5)

    def forward(self, x):
        return self.core(forget(self.norm(x))) @ self.wo


@dataclass
class Documents:
    """What every attention layer reads besides its input, set once per layout by
    ComposeModel.attend: the documents' boundaries and the CP group (None: the reference)."""

    cu_seqlens: torch.Tensor = None
    group: object = None


class Compressed(nn.Module):
    """The attention proper, one sequence at a time: `.reference` over the whole sequence (group
    None), else `.context_parallel` on this rank's shard. A leaf for tensor_ckpt's FX trace: its
    halo and all-gather depend on data FX cannot see (``documents``, shared by every layer)."""

    def __init__(self, attention, documents):
        super().__init__()
        self.attention, self.documents = attention, documents
        attention.ape.no_muon = True  # a [m, sets, d] positional bias, not an expert stack
        for p in (getattr(attention, n, None) for n in ("wq_index", "w_index", "norm_index")):
            if p is not None:  # top-k is not differentiable: V4 trains the indexer apart
                p.requires_grad_(False)

    def forward(self, x):  # [B, s, d] -> [B, s, n_heads * head_dim]
        cu_seqlens, group = self.documents.cu_seqlens, self.documents.group
        if group is None:
            rows = [self.attention.reference(row, cu_seqlens)[0] for row in x]
        else:
            rows = [self.attention.context_parallel(row, cu_seqlens, group)[0] for row in x]
        return torch.stack(rows).flatten(-2)


class MoE(nn.Module):
    """F of an odd sublayer: RMSNorm -> top-k routing over SwiGLU experts, stacks [E, n, m].
    [B, s, d] -> [B, s, d]. The normalised input and the SiLU output are forgotten."""

    def __init__(self, cfg):
        super().__init__()
        E, d, H = cfg.n_experts, cfg.dim, cfg.expert_hidden
        self.k, self.norm = cfg.experts_per_token, mhc.RMSNorm(d)
        self.router = nn.Parameter(torch.randn(E, d) / d**0.5)
        self.w_gate = nn.Parameter(torch.randn(E, H, d) / d**0.5)
        self.w_up = nn.Parameter(torch.randn(E, H, d) / d**0.5)
        self.w_down = nn.Parameter(torch.randn(E, d, H) / H**0.5)

    def forward(self, x):
        h = forget(self.norm(x))
        probs = (h @ self.router.T).softmax(-1)  # [B, s, E]
        weights, chosen = probs.topk(self.k, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, chosen, weights)  # 0 for unchosen experts
        hidden = forget(F.silu(torch.einsum("bsc,ehc->bseh", h, self.w_gate)))
        hidden = hidden * torch.einsum("bsc,ehc->bseh", h, self.w_up)
        return torch.einsum("bseh,ech,bse->bsc", hidden, self.w_down, gates)


class ComposeModel(mhc.PipelineModel):
    """Embedding -> n_hc lanes -> L mHC layers X' = B X + C F(A X) -> HyperHead -> RMSNorm -> LM
    head. Sublayer i: CSA when i % 4 == 0, HCA when i % 4 == 2, MoE when odd. `cfg` is what one
    rank holds (seq_len = T / cp: mhc.pipeline_step checks shapes against it)."""

    def __init__(self, cfg, cp=1):
        super().__init__()
        self.cfg = replace(cfg, seq_len=cfg.seq_len // cp)
        kinds = {0: "csa", 2: "hca"}
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.documents = Documents()  # read by every attention layer, set by attend()
        self.sublayers = nn.ModuleList(
            AttentionSublayer(cfg, kinds[i % 4], self.documents) if i % 2 == 0 else MoE(cfg)
            for i in range(cfg.n_layers)
        )
        self.hcs = nn.ModuleList(mhc.HyperConnection(cfg.n_hc, cfg.dim) for _ in self.sublayers)
        self.hyper_head = mhc.HyperHead(cfg.n_hc, cfg.dim)
        self.norm = mhc.RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.forgetting = {}  # layer -> its tensor_ckpt wrapper (unregistered: names stay)

    def attend(self, cu_seqlens, group=None):
        """Every attention layer: the documents' boundaries, and the CP group (None: reference)."""
        self.documents.cu_seqlens, self.documents.group = cu_seqlens, group

    def run_layers(self, stream, start, end, variant="naive", block=None, final=False):
        """Layers [start, end) as one of mhc.VARIANTS: "naive" the plain autograd layer; "fused"
        mhc's fused mixing, each layer its own block; "optimised" the same with selective
        recomputation in blocks of L_r. F as tensor_ckpt planned it, but in "naive"."""
        head = self.hyper_head if final else None
        if variant == "naive":
            for f, hc in zip(self.sublayers[start:end], self.hcs[start:end]):
                stream = mhc.mhc_layer_reference(stream, f, hc)
            return head(stream) if final else stream
        layers = [
            (self.forgetting.get(i, self.sublayers[i]), self.hcs[i]) for i in range(start, end)
        ]
        block = (
            1
            if variant == "fused"
            else block or mhc.default_recompute_block(self.cfg.n_hc, end - start)
        )
        return mhc.run_recomputed_layers(stream, layers, block, head=head)

    def head_loss(self, x, targets):
        return F.cross_entropy(self.lm_head(self.norm(x)).flatten(0, -2), targets.flatten())

    def forward(self, idx, targets):  # the reference path: one process, the whole sequence
        return self.head_loss(
            self.run_layers(self.embed_stream(idx), 0, len(self.hcs), final=True), targets
        )


def make_model(cfg, cp=1, seed=0):
    """The same initial weights at every layout (and in the reference): one seed."""
    torch.manual_seed(seed)
    return ComposeModel(cfg, cp)


def batch_tokens(cfg, rows, step, seed=0):
    """Learnable packed data [rows, T + 1]: each row counts up from a random start, stride 1..3."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    start = torch.randint(0, cfg.vocab_size, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    return (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size


def documents(cfg):
    """cu_seqlens of every sequence, the same at every layout: documents start just before the
    boundaries of a 4-way split (blocks straddle ranks), plus a few random cuts."""
    return cp_compress.packed_boundaries(cfg.seq_len, cfg.seq_len // 4, cfg.csa_ratio)


# ---- 2. The layout: one device mesh, four groups ----------------------------------------------


@dataclass
class Layout:
    pp: int
    cp: int
    dp: int
    coords: tuple  # this rank's (p, c, d)
    pipeline: dict  # {"forward": group, "backward": group}: the stage's two links
    cp_group: object  # the ranks sharing this rank's sequence, one shard each
    stage_group: object  # the ranks holding this stage: MuonZeRO's gradients and shards


def layout_groups(pp, cp, dp, device_type="cpu"):
    """The process groups of the layout pp x cp x dp, from torch's device mesh (dp innermost:
    global rank = (p * cp + c) * dp + d). -> Layout."""
    # hint: the pipeline's second link must be a group of its own even where the mesh hands back
    # the world; the stage's ranks are the mesh's ("cp", "dp") dimensions flattened into one; make
    # every group with launch's constructors (they keep the world's timeout)
    ### BEGIN SOLUTION
    mesh = launch.device_mesh(device_type, (pp, cp, dp), ("pp", "cp", "dp"))
    pipelines = mesh.mesh.permute(1, 2, 0).reshape(-1, pp).tolist()  # each (c, d)'s stages
    backward, _ = launch.new_subgroups_by_enumeration(pipelines)
    pipeline = {"forward": mesh["pp"].get_group(), "backward": backward}
    stage, _ = launch.new_subgroups_by_enumeration(mesh.mesh.flatten(1).tolist())  # p's cp x dp
    return Layout(pp, cp, dp, tuple(mesh.get_coordinate()), pipeline, mesh["cp"].get_group(), stage)
    ### END SOLUTION


def stage_parameters(model, layout):
    """The modules this rank's stage trains, under their own names: the embedding on the first
    stage, layers [first, stop), the HyperHead, norm and LM head on the last."""
    p = layout.coords[0]
    first, stop = mhc.stage_layers(len(model.hcs), layout.pp, p)
    held = nn.ModuleDict(
        {f"layer{i}": nn.ModuleList([model.sublayers[i], model.hcs[i]]) for i in range(first, stop)}
    )
    if p == 0:
        held["embed"] = model.embed
    if p == layout.pp - 1:
        held.update({"hyper_head": model.hyper_head, "norm": model.norm, "lm_head": model.lm_head})
    return held, (first, stop)


def build_optimizer(model, layout, train):
    """MuonZeRO over the stage group: Muon for matrices and expert stacks, AdamW for the rest."""
    held, _ = stage_parameters(model, layout)
    groups = []
    for g in muon_zero.muon_param_groups(held):
        g["params"] = [p for p in g["params"] if p.requires_grad]
        if g["role"] == "adamw":
            g["lr"] = train.lr_adamw
        groups += [g] if g["params"] else []
    return muon_zero.MuonZeRO(
        groups,
        lr=train.lr_muon,
        weight_decay=train.weight_decay,
        ns_coefficients=muon_zero.STANDARD_NS_COEFFICIENTS,
        update_rms=0.2,
        ns_dtype=train.ns_dtype,
        grad_sync=train.grad_sync,
        process_group=layout.stage_group,
        seed=train.seed,
    )


def plan_forgetting(model, layout, cfg):
    """tensor_ckpt's FX plan for each F of this stage, traced once on a micro-batch's shape (the
    trace runs F once: every CP rank of the stage does it together)."""
    _, (first, stop) = stage_parameters(model, layout)
    w = model.embed.weight
    example = torch.randn(
        cfg.batch // cfg.n_micro, cfg.seq_len // layout.cp, cfg.dim, device=w.device, dtype=w.dtype
    )
    for i in range(first, stop):
        model.forgetting[i] = tensor_ckpt.checkpoint_tensors(
            model.sublayers[i], (example,), leaf_modules=(Compressed,)
        )


# ---- 3. One training step on the layout, and the run -------------------------------------------


def local_batch(tokens, cfg, layout):
    """This rank's rows (its replica's `batch` sequences) and columns (its CP shard)."""
    _, c, d = layout.coords
    rows = tokens[d * cfg.batch : (d + 1) * cfg.batch]
    idx, targets = (
        cp_compress.shard_sequence(t.T, layout.cp, c).T for t in (rows[:, :-1], rows[:, 1:])
    )
    return idx.contiguous(), targets.contiguous()


def layout_step(model, opt, tokens, cfg, layout, phase=None, step=1, allow_nonfinite=False):
    """1F1B over the stages (CP inside every attention F), then MuonZeRO over the stage group.
    Every rank's loss is its tokens' mean; the optimizer averages over the cp x dp ranks of equal
    token counts: the mean over the whole batch, as one process. Before the update, one all-gather
    of three numbers per rank checks that every rank of a replica trained on the same rows and
    that the loss and gradients are finite (Refused). -> (that mean, PipelineStats)."""
    device, phase = model.embed.weight.device, phase or (lambda name: contextlib.nullcontext())
    idx, targets = (t.to(device) for t in local_batch(tokens, cfg, layout))
    with phase("forward"):  # 1F1B interleaves forwards and backwards: one phase
        loss, stats = mhc.pipeline_step(
            model, idx, targets, cfg.n_micro, "optimised", groups=layout.pipeline
        )
    total = agreed_loss(step, tokens, cfg, layout, model, loss, allow_nonfinite)
    with phase("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return total / (layout.cp * layout.dp), stats


def run_layout(
    cfg, train, pp, cp, dp, device="cpu", on_step=None, save=None, save_every=0, resume=None
):
    """Training steps up to train.steps on the layout, inside a process group of pp * cp * dp
    ranks. on_step(step, layout, model, opt, run) wraps each step (run(phase) trains it). save:
    a folder for checkpoints, written every save_every steps (0: never) and after the last;
    resume: one whose newest checkpoint this run continues (cfg's batch then follows the saved
    global batch; compose_checkpoint). -> (the global losses of the steps run, this stage's
    parameters {name: tensor}, layout, model, optimizer)."""
    start, checkpoint = 0, None
    if resume:
        start, checkpoint, cfg, _ = compose_checkpoint.resume_from(resume, cfg, train, pp, cp, dp)
    device = torch.device(device)
    layout = layout_groups(pp, cp, dp, device.type)
    model = make_model(cfg, cp, train.seed).to(device, train.dtype)
    model.attend(documents(cfg).to(device), layout.cp_group)
    plan_forgetting(model, layout, cfg)
    opt = build_optimizer(model, layout, train)
    held, _ = stage_parameters(model, layout)
    if checkpoint:
        compose_checkpoint.load_checkpoint(checkpoint, model, held, opt)
    losses = []
    for step in range(start, train.steps):
        tokens = batch_tokens(cfg, cfg.batch * dp, step, train.seed)
        settings = dict(step=step + 1, allow_nonfinite=train.allow_nonfinite)
        run = functools.partial(layout_step, model, opt, tokens, cfg, layout, **settings)
        try:
            loss, _ = on_step(step, layout, model, opt, run) if on_step else run()
            if save and (step + 1 == train.steps or save_every and (step + 1) % save_every == 0):
                compose_checkpoint.save_checkpoint(
                    save, step + 1, model, held, opt, cfg, train, layout
                )
        except Refused:  # every rank decided it from the same numbers: none is left waiting
            raise
        except Exception as err:
            launch.stop_together(err, f"compose: step {step + 1}")
        losses.append(loss)
    names = {id(p): n for n, p in model.named_parameters()}
    return losses, {names[id(p)]: p.detach() for p in held.parameters()}, layout, model, opt


# ---- 4. The reference: one process, none of the four techniques --------------------------------


def reference_optimizers(model, train):
    """torch.optim.Muon on every matrix (each expert its own) + torch.optim.AdamW on embeddings,
    the LM head, biases, norms and the attention's positional bias. -> (optimizers, experts):
    experts maps each stack to its per-expert leaves (views into it)."""
    muon, adamw, experts = [], [], {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        plain = (
            name.startswith(("embed.", "lm_head."))
            or name.rsplit(".", 1)[-1].startswith(("bias", "ape"))
            or p.ndim < 2
        )
        if plain:
            adamw.append(p)
        elif p.ndim == 3:
            experts[p] = [p.detach()[e] for e in range(p.shape[0])]
            muon += experts[p]
        else:
            muon.append(p)
    return [
        torch.optim.Muon(
            muon,
            lr=train.lr_muon,
            weight_decay=train.weight_decay,
            momentum=0.95,
            nesterov=True,
            adjust_lr_fn="match_rms_adamw",
        ),
        torch.optim.AdamW(
            adamw, lr=train.lr_adamw, betas=(0.9, 0.95), eps=1e-8, weight_decay=train.weight_decay
        ),
    ], experts


def reference_model(cfg, train, device="cpu"):
    """The reference's model (the layouts' initial weights, attention over whole sequences) and
    its optimizers. -> (model, optimizers, experts), as reference_step takes them."""
    model = make_model(cfg, 1, train.seed).to(device, train.dtype)
    model.attend(documents(cfg).to(device))
    return model, *reference_optimizers(model, train)


def reference_step(model, opts, experts, tokens):
    """One step of the reference on tokens [rows, T + 1]: plain mHC layers, attention over the
    whole sequence, the MoE as written, nothing forgotten; each expert's gradient handed to its
    leaf, then torch.optim.Muon + AdamW (inside torch_muon_newton_schulz_in). -> the loss."""
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    for stack, leaves in experts.items():
        for e, leaf in enumerate(leaves):
            leaf.grad = stack.grad[e]
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)  # the stacks themselves are in no optimizer
    return loss.detach()


def reference_training(cfg, dp, train, device="cpu"):
    """K steps of reference_step on one process of the whole batch (dp replicas' rows).
    -> (losses, parameters)."""
    model, opts, experts = reference_model(cfg, train, device)
    losses = []
    with muon_zero.torch_muon_newton_schulz_in(train.ns_dtype):
        for step in range(train.steps):
            tokens = batch_tokens(cfg, cfg.batch * dp, step, train.seed).to(device)
            losses.append(reference_step(model, opts, experts, tokens).item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- appendix: the agreement of every step, the command line and its validation, the demo --------
#
# The agreement at every step, before the update: one all-gather of three numbers per rank (the
# replica's batch digest, the loss, the first non-finite gradient) gives every rank the same
# verdict, so a run stops with the same one line everywhere (Refused) and no rank is left waiting.


class Refused(ValueError):
    """A run every rank stops with the same one line (a batch that differs where it must agree, a
    loss or gradient that is not finite): each rank decides it from the same gathered numbers."""


def replica_digest(tokens, cfg, layout):
    """48 bits of sha256 over this replica's rows [batch, T + 1]: the same on every stage and CP
    shard of a replica (exact in a float64)."""
    d = layout.coords[2]
    rows = tokens[d * cfg.batch : (d + 1) * cfg.batch].contiguous()
    return float(int(launch.weights_digest([("rows", rows)])[:12], 16))


def first_nonfinite(model, device):
    """The position in model.named_parameters() of the first parameter this rank holds whose
    gradient is not finite, else inf: one tensor, no host copy."""
    flags = [(i, p.grad) for i, (_, p) in enumerate(model.named_parameters()) if p.grad is not None]
    if not flags:
        return torch.tensor(math.inf, device=device, dtype=torch.float64)
    finite = torch.stack([g.isfinite().all() for _, g in flags])
    where = torch.tensor([i for i, _ in flags], device=device, dtype=torch.float64)
    return torch.where(finite, math.inf, where).min()


def check_step(step, gathered, cfg, layout, model, allow_nonfinite):
    """Every rank's (replica digest, loss, first non-finite gradient), gathered: the same verdict
    on every rank. -> the loss summed over the ranks, or Refused."""
    digest, loss, bad = gathered.T.tolist()
    for d in range(layout.dp):  # rank (p * cp + c) * dp + d: stages and CP shards of replica d
        ranks = list(range(d, len(digest), layout.dp))
        values = {digest[r] for r in ranks}
        if len(values) > 1:
            held = ", ".join(f"rank {r} {int(digest[r]):012x}" for r in ranks)
            raise Refused(
                f"compose: step {step}: the stages and CP shards of replica d={d} hold different "
                f"batches ({held}); every rank of a replica must draw the same rows"
            )
    total = sum(loss)
    if allow_nonfinite:
        return total
    if not math.isfinite(total):
        raise Refused(
            f"compose: step {step}: the loss is {total} (not finite); --allow-nonfinite keeps going"
        )
    if math.isfinite(first := min(bad)):
        name = next(n for i, (n, _) in enumerate(model.named_parameters()) if i == first)
        rank = bad.index(first)
        raise Refused(
            f"compose: step {step}: the gradient of {name} is not finite (rank {rank}); "
            f"--allow-nonfinite keeps going"
        )
    return total


def agreed_loss(step, tokens, cfg, layout, model, loss, allow_nonfinite=False):
    """Every rank's (replica digest, loss or 0, first non-finite gradient), all-gathered and
    judged alike on every rank (check_step). -> the loss summed over the ranks, or Refused."""
    device = model.embed.weight.device
    mine = loss.detach() if loss is not None else torch.zeros((), device=device)
    digest = torch.tensor(replica_digest(tokens, cfg, layout), device=device, dtype=torch.float64)
    numbers = torch.stack([digest, mine.double(), first_nonfinite(model, device)])
    gathered = [torch.empty_like(numbers) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, numbers)  # only the last stage's cp x dp ranks add a loss
    return check_step(step, torch.stack(gathered).cpu(), cfg, layout, model, allow_nonfinite)


# ---- the command line ----------------------------------------------------------------------------
def check_layout(cfg, pp, cp, dp, world):
    """The clear ValueError for a layout that cannot run, before any collective."""
    if pp * cp * dp != world:
        raise ValueError(
            f"--pp {pp} x --cp {cp} x --dp {dp} = {pp * cp * dp}, but {world} "
            f"rank(s) run: choose pp, cp, dp whose product is the world size"
        )
    if cfg.n_layers % pp:
        raise ValueError(f"{pp} pipeline stages cannot split n_layers={cfg.n_layers} evenly")
    if cfg.n_micro < pp or cfg.batch % cfg.n_micro:
        raise ValueError(
            f"1F1B needs n_micro={cfg.n_micro} >= pp={pp} micro-batches that split "
            f"batch={cfg.batch} evenly"
        )
    s, m = cfg.seq_len // cp, math.lcm(cfg.csa_ratio, cfg.hca_ratio)
    if cfg.seq_len % cp or s % m or s < cfg.window - 1:
        raise ValueError(
            f"seq_len={cfg.seq_len} over cp={cp} ranks gives {cfg.seq_len / cp:g} "
            f"tokens per rank; it must be a multiple of both ratios m ({m}) and "
            f">= window - 1 = {cfg.window - 1}"
        )


def least_bytes(cfg, pp, cp, item=4):
    """A lower bound of one rank's peak: one micro-batch's n-lane stream [B/n_micro, T/cp, n, d]
    kept for each of the stage's layers, plus the last stage's logits [B/n_micro, T/cp, vocab]."""
    tokens = cfg.batch // cfg.n_micro * (cfg.seq_len // cp)
    return tokens * (cfg.n_layers // pp * cfg.n_hc * cfg.dim + cfg.vocab_size) * item


def parse_args(argv=None, parser=None):
    """The options, checked at the door: the layout, a resume, an output folder and a size this
    machine cannot hold are one-line usage errors. parser: one to extend (a benchmark's)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    count = launch.at_least(1)
    parser = parser or argparse.ArgumentParser(
        description="The four chapters in one V4-like decoder, on the layout --pp x --cp x --dp "
        "of the torchrun ranks."
    )
    add = parser.add_argument
    add("--pp", type=count, default=1, help="pipeline stages (1)")
    add("--cp", type=count, default=1, help="context-parallel ranks per sequence (1)")
    add("--dp", type=count, default=None, help="data-parallel replicas (world / (pp * cp))")
    add("--steps", type=count, default=4, help="training steps (4)")
    add("--layers", type=count, default=12, help="sublayers L; pp must divide it (12)")
    add("--seq-len", type=count, default=None, help="tokens per sequence T (256; 192 at cp=3)")
    flag = functools.partial(add, action="store_true")
    flag("--v4", help="V4's numerics: bf16 stochastic-rounding sync, bf16 Newton-Schulz")
    flag("--float64", help="float64 weights, exact sync and Newton-Schulz: --check to ~1e-12")
    flag("--allow-nonfinite", help="keep going past a non-finite loss or gradient (else stop)")
    flag("--check", help="also train the one-process reference on rank 0; print the differences")
    add("--save", metavar="DIR", help="checkpoint into DIR after the last step, resumable anywhere")
    add("--save-every", type=count, default=None, metavar="K", help="with --save: every K steps")
    add(
        "--resume",
        metavar="DIR",
        help="continue DIR's newest checkpoint (or DIR/step-K, that one) up to --steps in all",
    )
    add("--seed", type=int, default=0, help="seed of weights and data (0)")
    args = launch.check_launch_options(parser, launch.add_launch_options(parser).parse_args(argv))
    args.dp = args.dp or max(1, world // (args.pp * args.cp))
    args.seq_len = args.seq_len or (192 if args.cp == 3 else 256)  # whole blocks per rank
    args.cfg = ComposeConfig(n_layers=args.layers, seq_len=args.seq_len)
    if args.v4 and args.float64:
        parser.error("--v4 (bf16 numerics) and --float64 exclude each other")
    if args.save_every and not args.save:
        parser.error("--save-every K needs --save DIR")
    folder = os.path.dirname(os.path.abspath(args.save)) if args.save else None
    if args.save and (not os.path.isdir(folder) or not os.access(folder, os.W_OK)):
        parser.error(f"--save {args.save}: the folder {folder} is missing or not writable")
    args.start, resumed = 0, None
    try:
        if args.resume:
            args.start, _, args.cfg, resumed = compose_checkpoint.resume_from(
                args.resume, args.cfg, training(args), args.pp, args.cp, args.dp
            )
        check_layout(args.cfg, args.pp, args.cp, args.dp, world)
    except ValueError as err:
        parser.error(str(err))
    need = least_bytes(args.cfg, args.pp, args.cp, 8 if args.float64 else 4)
    where = f"compose at {args.pp}x{args.cp}x{args.dp}, --seq-len {args.cfg.seq_len}"
    launch.check_fits(parser, args, need, where)
    if resumed and int(os.environ.get("RANK", "0")) == 0:  # the run's first line
        pp, cp, dp = resumed
        now = f"{args.pp}x{args.cp}x{args.dp}"
        print(f"resumed step {args.start} saved at {pp}x{cp}x{dp}, now {now}", flush=True)
    return args


def training(args):
    """The Training the options ask for: V4's bf16 numerics, fp32 (default) or float64."""
    sync, ns = ("bf16_sr", torch.bfloat16) if args.v4 else ("exact", torch.float32)
    return Training(
        args.steps,
        grad_sync=sync,
        ns_dtype=torch.float64 if args.float64 else ns,
        seed=args.seed,
        dtype=torch.float64 if args.float64 else torch.float32,
        allow_nonfinite=args.allow_nonfinite,
    )


def describe(args, train):
    """The demo's first line: the layout and the model."""
    cfg = args.cfg
    return (
        f"layout pp={args.pp} x cp={args.cp} x dp={args.dp}: {cfg.n_layers} layers (CSA, MoE, "
        f"HCA, MoE, ...), d={cfg.dim}, n_hc={cfg.n_hc}, T={cfg.seq_len} ({cfg.seq_len // args.cp} "
        f"per CP rank), {cfg.batch} sequences per replica in {cfg.n_micro} micro-batches; "
        f"gradient sync {train.grad_sync}"
    )


def compare_with_reference(cfg, dp, train, losses, params, rank, world):
    """--check: every rank's parameters gathered on rank 0, which trains reference_training and
    prints the largest differences of the losses, the parameters and their change."""
    gathered = [None] * world if rank == 0 else None
    dist.gather_object({n: p.cpu() for n, p in params.items()}, gathered, dst=0)
    if rank != 0:
        return
    ref_losses, ref = reference_training(cfg, dp, train)
    got = {n: t for g in gathered for n, t in g.items()}
    diff = max((got[n] - ref[n]).abs().max().item() for n in got)
    start = dict(make_model(cfg, 1, train.seed).to(dtype=train.dtype).named_parameters())
    change = (
        sum(((got[n] - ref[n]) ** 2).sum() for n in got) ** 0.5
        / sum(((ref[n] - start[n].detach()) ** 2).sum() for n in got) ** 0.5
    )
    loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses[-len(losses) :]))
    print(
        f"\nagainst the one-process reference: losses within {loss:.1e} (relative), "
        f"parameters within {diff:.1e} (largest absolute difference), their change "
        f"within {change:.1e} of its norm",
        flush=True,
    )


def demo(args, rank, world, device):
    train = training(args)
    launch.say(describe(args, train))
    step_s = []

    def timed(step, layout, model, opt, run):
        began = mhc.clock(device)
        out = run()
        step_s.append(mhc.clock(device) - began)
        return out

    saving = dict(save=args.save, save_every=args.save_every or 0, resume=args.resume)
    losses, params, *_ = run_layout(
        args.cfg, train, args.pp, args.cp, args.dp, device, timed, **saving
    )
    for ran, (loss, took) in enumerate(zip(losses, step_s)):
        launch.say(f"step {args.start + ran + 1}: loss {loss:.4f}, {1e3 * took:.0f} ms")
    if args.check:
        compare_with_reference(args.cfg, args.dp, train, losses, params, rank, world)


if __name__ == "__main__":
    try:
        launch.run(demo, parse_args())
    except (Refused, launch.Stopped) as err:  # the same line on every rank, no traceback
        raise SystemExit(str(err)) from None
