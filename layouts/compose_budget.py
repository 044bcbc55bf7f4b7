"""The budget of compose.py: which layout pp x cp x dp fits, what each rank holds, what each link
carries, before anything runs.

A pure function of the configuration and the machine: no process, no tensor. Every byte below is
derived from a tensor the chapters make (named in each docstring), so the peaks and bytes
benchmarks/bench_compose.py measures can be set beside it rank by rank: link_bytes says what
each link carries per step, the rest what each rank holds, and budget_table ranks the layouts.

    python -c "import compose; from layouts import compose_budget as b; print(b.format_budget(
        b.budget_table(compose.ComposeConfig(), 4, 80 * 2**30, 100e9, 25e9)))"
"""

import math
from dataclasses import dataclass

import torch

import compose
import cp_compress
import launch
import mhc
import muon_zero

HELD = ("parameters", "gradients", "optimizer", "activations")  # bytes a rank holds
FP32, BF16, INT64, BOOL = 4, 2, 8, 1  # bytes per element


# ---- What each link carries per step --------------------------------------------------------
# A pure function of the configuration, a rank's place and MuonZeRO's plan: no process, no tensor.

SENT = ("pp_send", "cp_halo", "cp_gather", "grad_reduce_scatter", "param_all_gather")


def sublayer_kind(i):
    """Sublayer i's F: CSA attention when i % 4 == 0, HCA when i % 4 == 2, an MoE MLP when odd."""
    return "moe" if i % 2 else ("csa" if i % 4 == 0 else "hca")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the budget sees it: its name in ComposeModel, shape, MuonZeRO role (as
    muon_param_groups assigns it) and whether it trains (CSA's indexer does not)."""

    name: str
    shape: tuple
    role: str  # "dense", "expert_down", "expert_up", "expert_gate" or "adamw"
    trains: bool = True

    @property
    def numel(self):
        return math.prod(self.shape)


@dataclass(frozen=True)
class Rank:
    """Where a rank sits in the (pp, cp, dp) mesh; global rank = (p * cp + c) * dp + d."""

    p: int
    c: int
    d: int
    pp: int
    cp: int
    dp: int

    @property
    def rank(self):
        return (self.p * self.cp + self.c) * self.dp + self.d

    @property
    def group_rank(self):
        """Its rank in the stage's MuonZeRO group, the flattened ("cp", "dp") sub-mesh."""
        return self.c * self.dp + self.d


def micro_stream_bytes(cfg, cp):
    """One micro-batch's n-lane stream on one CP rank, [B/n_micro, T/cp, n_hc, C] fp32: what a
    stage sends the next (mhc.StageLinks) and the gradient it gets back."""
    return cfg.batch // cfg.n_micro * (cfg.seq_len // cp) * cfg.n_hc * cfg.dim * FP32


def halo_bytes(cfg, kind):
    """Bytes one attention layer sends the next CP rank per sequence in forward: the compressor's
    halo (cp_compress.halo_rows raw rows of kv and gate logits, [rows, 2, sets, channels]) and the
    sliding window's window - 1 raw K/V rows [D] (CompressedAttention.context_parallel)."""
    csa = kind == "csa"
    sets, ch = (2, cfg.head_dim + cfg.index_dim) if csa else (1, cfg.head_dim)
    ratio = cfg.csa_ratio if csa else cfg.hca_ratio
    rows = cp_compress.halo_rows(ratio, csa)
    return (rows * 2 * sets * ch + (cfg.window - 1) * cfg.head_dim) * FP32


def gather_buffer_bytes(cfg, kind, cp):
    """One rank's stage-2 buffer per attention layer and sequence: s/m + 1 entries of the
    compressor's channels (D, plus the indexer's Di under CSA), fp32."""
    csa = kind == "csa"
    ch = cfg.head_dim + (cfg.index_dim if csa else 0)
    ratio = cfg.csa_ratio if csa else cfg.hca_ratio
    return (cfg.seq_len // cp // ratio + 1) * ch * FP32


def link_bytes(cfg, where, plan, grad_sync="bf16_sr"):
    """Bytes rank `where` (a Rank) sends per training step on each link, {link: bytes}.

    pp_send: n_micro micro-batch streams to the next stage (forward) and as many gradients to the
        previous one (backward); an end stage sends in one direction only.
    cp_halo: per attention layer of the stage and per sequence of every micro-batch, halo_bytes to
        the next CP rank in forward (not from the last) and their gradient back in backward (not
        from CP rank 0).
    cp_gather: the stage-2 all-gather of the buffer to the cp - 1 others in forward, and its
        reduce-scatter in backward (the same bytes).
    grad_reduce_scatter: MuonZeRO's all-to-all of the packed gradient chunks, one to each of the
        other G - 1 peers (dense buckets over the zero width, expert runs over the group), in
        bf16 under grad_sync "bf16_sr" (fp32 under "exact"); plus AdamW's chunks (its tensors
        dealt whole over the group, ZeRO-1), always in fp32.
    param_all_gather: every updated fp32 chunk to the other peers, AdamW's too.
    """
    # hint: count each collective from the sender's side; a pipeline end has one neighbour, CP's
    # ends one halo direction; the gradient's payload dtype follows grad_sync
    ### BEGIN SOLUTION
    pp, cp, G = where.pp, where.cp, where.cp * where.dp
    micro = micro_stream_bytes(cfg, cp)
    directions = (where.p < pp - 1) + (where.p > 0)
    sent = dict.fromkeys(SENT, 0)
    sent["pp_send"] = directions * cfg.n_micro * micro

    sequences = cfg.n_micro * (cfg.batch // cfg.n_micro)
    first, stop = mhc.stage_layers(cfg.n_layers, pp, where.p)
    for kind in (sublayer_kind(i) for i in range(first, stop)):
        if kind == "moe" or cp == 1:
            continue
        halo_directions = (where.c < cp - 1) + (where.c > 0)
        sent["cp_halo"] += sequences * halo_directions * halo_bytes(cfg, kind)
        sent["cp_gather"] += sequences * 2 * (cp - 1) * gather_buffer_bytes(cfg, kind, cp)

    grad_item = BF16 if grad_sync == "bf16_sr" else FP32
    Z = plan.zero_width
    dense, experts = plan.dense_bucket_numel, plan.expert_chunk_numel
    adamw = (G - 1) * plan.adamw_chunk_numel * FP32
    sent["grad_reduce_scatter"] = ((Z - 1) * dense + (G - 1) * experts) * grad_item + adamw
    sent["param_all_gather"] = ((Z - 1) * dense + (G - 1) * experts) * FP32 + adamw
    return sent
    ### END SOLUTION


@dataclass(frozen=True)
class PlanSizes:
    """The sizes link_bytes reads from MuonZeRO's plan (muon_zero.MuonPlan), and the elements each
    group rank owns (its momentum, its AdamW moments); plan_sizes reads them from plan_muon's."""

    zero_width: int
    dense_bucket_numel: int  # the largest dense bucket: every bucket is padded to it
    expert_chunk_numel: int  # the largest expert run: every run is padded to it
    adamw_chunk_numel: int  # the largest AdamW bucket: every bucket is padded to it
    owned_numel: tuple = ()  # per group rank: elements of the matrices it owns
    owned_adamw_numel: tuple = ()  # per group rank: elements of the AdamW tensors it owns


def meta_model(cfg):
    """compose's model on the meta device: every parameter's shape, name and requires_grad, no
    memory and no arithmetic (torchtitan sizes its models the same way)."""
    with torch.device("meta"):
        return compose.ComposeModel(cfg)


def stage_tensors(cfg, pp, stage, model=None):
    """The parameters pipeline stage `stage` of `pp` holds (compose.stage_parameters), in the
    order its optimizer sees them, each with the role muon_zero.muon_param_groups gives it.
    model: meta_model(cfg), if already built."""
    model = meta_model(cfg) if model is None else model
    where = compose.Layout(pp, 1, 1, (stage, 0, 0), None, None, None)  # stage_parameters: p, pp
    held, _ = compose.stage_parameters(model, where)
    names = {id(p): n for n, p in model.named_parameters()}
    roles = {id(p): g["role"] for g in muon_zero.muon_param_groups(held) for p in g["params"]}
    return [
        ParamSpec(names[id(p)], tuple(p.shape), roles[id(p)], p.requires_grad)
        for p in held.parameters()
    ]


def model_tensors(cfg):
    """Every parameter of the model (one stage holds them all)."""
    return stage_tensors(cfg, 1, 0)


def muon_plan(tensors, group_size):
    """MuonZeRO's own plan (muon_zero.plan_muon) over the ranks that hold one stage: the trained
    dense matrices in parameter order, experts flattened as V4 does (all downs, ups, gates), the
    trained AdamW tensors in parameter order."""
    trained = [t for t in tensors if t.trains]
    dense = [t.shape for t in trained if t.role == "dense"]
    experts = [
        t.shape[1:]
        for role in muon_zero.EXPERT_ROLES
        for t in trained
        if t.role == role
        for _ in range(t.shape[0])
    ]
    adamw = [t.shape for t in trained if t.role == "adamw"]
    return muon_zero.plan_muon(dense, experts, group_size, adamw_shapes=adamw)


def plan_sizes(plan):
    """What link_bytes and the optimizer's bytes read from MuonZeRO's plan (PlanSizes): its
    padded buckets and chunk, and per group rank the elements of the matrices and the AdamW
    tensors it owns."""
    owned = []
    for rank in range(plan.world_size):
        dense, experts = plan.owned(rank)
        owned.append(
            sum(math.prod(plan.dense_shapes[i]) for i in dense)
            + sum(math.prod(plan.expert_shapes[i]) for i in experts)
        )
    adamw = [plan.adamw_numel(rank) for rank in range(plan.world_size)]
    sizes = plan.dense_bucket_numel, plan.expert_chunk_numel, plan.adamw_chunk_numel
    return PlanSizes(plan.zero_width, *sizes, tuple(owned), tuple(adamw))


def optimizer_bytes(plan, group_rank):
    """MuonZeRO's fp32 state on a group rank: the momentum of its matrices, AdamW's two moments
    of its tensors."""
    return (plan.owned_numel[group_rank] + 2 * plan.owned_adamw_numel[group_rank]) * FP32


def f_saved_elements(cfg, kind, cp):
    """Elements F's autograd graph keeps per sequence of s = T/cp tokens on one rank (fp32 unless
    noted; bytes returned), with tensor_ckpt forgetting the normalised input and the MoE's
    activation outputs. The F input h is counted with the mHC terms (layer_saved_bytes).

    MoE (every expert applied densely, as muon_zero.TinyMoE): the router softmax and the gate
    weights [E], the gate pre-activation (silu's input), the up projection and their product
    [E, hidden], the three-operand einsum's intermediate (product x w_down) [E, C], the top-k's
    and the scatter's int64 indices; the forgotten silu output is rebuilt in backward.
    Attention (cp_compress, the CP path): q [H, D]; the window K/V before its norm [D] and
    1/rms; the compressor's pooling windows and their softmax [entries, rows, channels] (rows =
    2m with CSA's overlap, m for HCA; at most s/m entries); the pooled buffer [s/m + 1,
    channels] before the entry norm; the gathered entries [T/m, channels]; keys = selected
    entries + window rows [K, D] per query and the softmax [H, K + 1] (K = min(top_k, T/m) +
    window for CSA, T/m + window for HCA) with its bool mask; the attention output [H, D] the
    output projection keeps. CSA's indexer adds q_index [Hi, Di], w_index [Hi], relu(scores)
    [Hi, T/m], the sort's int64 order [T/m] and the top-k's int64 indices."""
    s, T, D, H = cfg.seq_len // cp, cfg.seq_len, cfg.head_dim, cfg.n_heads
    if kind == "moe":
        E, h = cfg.n_experts, cfg.expert_hidden
        return s * ((2 * E + 3 * E * h + E * cfg.dim) * FP32 + 2 * cfg.experts_per_token * INT64)
    csa = kind == "csa"
    ratio = cfg.csa_ratio if csa else cfg.hca_ratio
    ch = D + (cfg.index_dim if csa else 0)
    rows = 2 * ratio if csa else ratio
    N = T // ratio
    K = (min(cfg.top_k, N) if csa else N) + cfg.window
    fp32 = s * (H * D + D + 1) + 2 * (s // ratio) * rows * ch + (s // ratio + 1) * (ch + 2)
    fp32 += N * ch + s * (K * D + H * (K + 1) + H * D)
    other = s * K * BOOL
    if csa:
        Hi, Di = cfg.index_heads, cfg.index_dim
        fp32 += s * (Hi * Di + Hi + Hi * N)
        other += s * (N + min(cfg.top_k, N)) * INT64
    return fp32 * FP32 + other


def layer_saved_bytes(cfg, cp):
    """Per sublayer i, bytes one micro-batch keeps on one CP rank besides the block inputs: mHC's
    per-layer share (RecomputedBlock: F's output f and input h [C], and mix_in's kept A, B, C,
    x W and 1/rms, 2 n^2 + 4 n + 1 numbers per token) plus F's graph (f_saved_elements)."""
    n, b, s = cfg.n_hc, cfg.batch // cfg.n_micro, cfg.seq_len // cp
    mixing = s * (2 * cfg.dim + 2 * n * n + 4 * n + 1) * FP32
    return {
        i: b * (mixing + f_saved_elements(cfg, sublayer_kind(i), cp)) for i in range(cfg.n_layers)
    }


def activation_bytes(cfg, where, saved=None):
    """Peak bytes of activations on rank `where`, in the middle of its last forward.

    One micro-batch keeps: every recompute block's input (the n-lane stream, [b, s, n, C]; on the
    first stage the first block's input is the embedding, C per token, as mhc.embed_stream makes
    a stride-0 view), layer_saved_bytes per sublayer, on the last stage the HyperHead's kept
    (2n + 1 per token), the final norm's input, 1/rms and output and the log-softmax [vocab], on
    a stage that sends forward its output stream. 1F1B keeps min(pp - p, n_micro) micro-batches
    in flight (mhc.one_f_one_b); StageLinks keeps each sent tensor until the step ends, so the
    streams (and gradients) sent for the micro-batches already finished stay too, and one
    receive per direction is posted ahead. On top, the temporaries of the F running at the peak
    (what the recorder counts with activations): an MoE's forgotten silu output [b, s, E,
    hidden], alive until its forward ends. saved: layer_saved_bytes(cfg, cp), if computed."""
    pp, p, cp = where.pp, where.p, where.cp
    b, s, n, C = cfg.batch // cfg.n_micro, cfg.seq_len // cp, cfg.n_hc, cfg.dim
    stream = micro_stream_bytes(cfg, cp)
    first, stop = mhc.stage_layers(cfg.n_layers, pp, p)
    blocks = len(
        mhc.recompute_blocks(first, stop, mhc.default_recompute_block(cfg.n_hc, stop - first))
    )
    per_micro = blocks * stream - (p == 0) * (stream - b * s * C * FP32)
    saved = layer_saved_bytes(cfg, cp) if saved is None else saved
    per_micro += sum(v for i, v in saved.items() if first <= i < stop)
    if p == pp - 1:
        per_micro += b * s * (2 * n + 1 + 3 * C + 1 + cfg.vocab_size) * FP32
    else:
        per_micro += stream  # held_out, and the send's reference
    in_flight = min(pp - p, cfg.n_micro)
    finished = cfg.n_micro - in_flight
    sent_held = finished * stream * ((p < pp - 1) + (p > 0))
    posted = stream * ((p > 0) + (p < pp - 1))
    moe = any(sublayer_kind(i) == "moe" for i in range(first, stop))
    transient = moe * b * s * cfg.n_experts * cfg.expert_hidden * FP32
    return in_flight * per_micro + sent_held + posted + transient


@dataclass
class LayoutBudget:
    """One factorisation pp x cp x dp of the world: what each rank holds and sends, the peak, an
    estimated step time, whether it fits, and why it cannot run at all (problem)."""

    pp: int
    cp: int
    dp: int
    held: list = None  # per global rank: {memory category: bytes}
    sent: list = None  # per global rank: {link: bytes per step}
    peak_bytes: int = 0  # the largest rank's sum of held bytes
    step_s: float = math.inf  # communication time alone (see link_seconds)
    fits: bool = False
    problem: str = ""

    @property
    def name(self):
        return f"{self.pp}x{self.cp}x{self.dp}"


def layout_problem(cfg, pp, cp):
    """Why the chapters refuse this pipeline or CP size for cfg ("" when they accept it)."""
    if cfg.n_layers % pp:
        return f"pp={pp} does not divide {cfg.n_layers} sublayers"
    if cfg.n_micro < pp:
        return f"1F1B needs n_micro >= pp ({cfg.n_micro} < {pp})"
    if cfg.batch % cfg.n_micro:
        return f"batch {cfg.batch} does not split into {cfg.n_micro} micro-batches"
    s = cfg.seq_len // cp
    if cfg.seq_len % cp:
        return f"cp={cp} does not divide T={cfg.seq_len}"
    for ratio, overlap in ((cfg.csa_ratio, True), (cfg.hca_ratio, False)):
        if s % ratio:
            return f"T/cp={s} is not a multiple of m={ratio}"
        if cp > 1 and cp_compress.halo_rows(ratio, overlap) > s:
            return f"T/cp={s} is shorter than the halo for m={ratio}"
    if cp > 1 and cfg.window - 1 > s:
        return f"T/cp={s} is shorter than the window's {cfg.window - 1} rows"
    return ""


def link_seconds(sent, where, ranks_per_node, intra_bw, inter_bw):
    """Seconds rank `where` spends sending sent[link] bytes, one link after another at its
    bandwidth: intra-node when every peer of that link's group shares its node, else inter-node.
    Leaves out compute, overlap of communication with compute, per-message latency, the pipeline
    bubble and ranks of one node contending for one inter-node link."""
    pp, cp, dp = where.pp, where.cp, where.dp

    def node(p, c, d):
        return Rank(p, c, d, pp, cp, dp).rank // ranks_per_node

    me = node(where.p, where.c, where.d)
    # nodes hold consecutive ranks: a group is on one node when its first and last ranks are
    ends = {
        "pp_send": [node(q, where.c, where.d) for q in (where.p - 1, where.p + 1) if 0 <= q < pp],
        "cp_halo": [node(where.p, 0, where.d), node(where.p, cp - 1, where.d)],
        "grad_reduce_scatter": [node(where.p, 0, 0), node(where.p, cp - 1, dp - 1)],
    }
    ends["cp_gather"], ends["param_all_gather"] = ends["cp_halo"], ends["grad_reduce_scatter"]
    return sum(
        sent[link] / (intra_bw if all(n == me for n in ends[link]) else inter_bw) for link in SENT
    )


def factorisations(world):
    """Every (pp, cp, dp) with pp * cp * dp = world, each once, pp first then cp ascending."""
    return [
        (p, c, world // (p * c))
        for p in range(1, world + 1)
        if world % p == 0
        for c in range(1, world // p + 1)
        if (world // p) % c == 0
    ]


def check_budget_inputs(world, device_bytes, intra_bw, inter_bw, ranks_per_node, grad_sync):
    if grad_sync not in ("bf16_sr", "exact"):
        raise ValueError(f"grad_sync must be 'bf16_sr' or 'exact' (MuonZeRO's), got {grad_sync!r}")
    for name, value in (("world", world), ("ranks_per_node", ranks_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    for name, value in (
        ("device_bytes", device_bytes),
        ("intra_bw", intra_bw),
        ("inter_bw", inter_bw),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(
                f"{name} must be a number > 0 (bytes, bytes per second), got {value!r}"
            )


def layout_budget(
    cfg, pp, cp, dp, device_bytes, intra_bw, inter_bw, ranks_per_node, grad_sync="bf16_sr"
):
    """The prediction for one layout (LayoutBudget); a layout the chapters refuse keeps its
    problem and no numbers."""
    out = LayoutBudget(pp, cp, dp, problem=layout_problem(cfg, pp, cp))
    if out.problem:
        return out
    out.held, out.sent = [None] * (pp * cp * dp), [None] * (pp * cp * dp)
    seconds, saved, model = [], layer_saved_bytes(cfg, cp), meta_model(cfg)
    for p in range(pp):
        tensors = stage_tensors(cfg, pp, p, model)
        plan = plan_sizes(muon_plan(tensors, cp * dp))
        numel = sum(t.numel for t in tensors)
        trained = sum(t.numel for t in tensors if t.trains)
        activations = activation_bytes(cfg, Rank(p, 0, 0, pp, cp, dp), saved)
        for c in range(cp):
            sent = link_bytes(cfg, Rank(p, c, 0, pp, cp, dp), plan, grad_sync)
            for d in range(dp):
                where = Rank(p, c, d, pp, cp, dp)
                out.held[where.rank] = {
                    "parameters": numel * FP32,
                    "gradients": trained * FP32,  # every .grad, fp32, kept through the step
                    "optimizer": optimizer_bytes(plan, where.group_rank),
                    "activations": activations,  # the same on every rank of a stage
                }
                out.sent[where.rank] = dict(sent)  # link_bytes does not depend on d
                seconds.append(link_seconds(sent, where, ranks_per_node, intra_bw, inter_bw))
    out.peak_bytes = max(sum(h.values()) for h in out.held)
    out.step_s, out.fits = max(seconds), out.peak_bytes <= device_bytes
    return out


def budget_table(
    cfg, world, device_bytes, intra_bw, inter_bw, ranks_per_node=8, grad_sync="bf16_sr"
):
    """Every factorisation of `world` ranks, predicted and ranked: the layouts that fit first,
    fastest first (communication time), then those that do not fit (smallest peak first), then
    those the chapters refuse. device_bytes per device; bandwidths in bytes per second;
    grad_sync: MuonZeRO's ("bf16_sr", V4's, or "exact")."""
    check_budget_inputs(world, device_bytes, intra_bw, inter_bw, ranks_per_node, grad_sync)
    rows = [
        layout_budget(cfg, pp, cp, dp, device_bytes, intra_bw, inter_bw, ranks_per_node, grad_sync)
        for pp, cp, dp in factorisations(world)
    ]
    return sorted(
        rows,
        key=lambda r: (
            bool(r.problem),
            not r.fits,
            r.step_s if r.fits else 0,
            r.peak_bytes,
            r.pp,
            r.cp,
        ),
    )


def human_bytes(n):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def format_budget(rows):
    """The ranked table, one line per layout: the largest rank's bytes by category, the busiest
    rank's bytes per link, the communication time and the verdict."""
    head = [
        "pp x cp x dp",
        "params",
        "grads",
        "optim",
        "activ",
        "peak",
        *SENT,
        "comm ms",
        "verdict",
    ]
    lines = [head]
    for r in rows:
        if r.problem:
            lines.append([r.name] + ["-"] * (len(head) - 2) + [f"cannot run: {r.problem}"])
            continue
        held = [human_bytes(max(h[k] for h in r.held)) for k in HELD]
        sent = [human_bytes(max(s[k] for s in r.sent)) for k in SENT]
        verdict = "fits" if r.fits else "DOES NOT FIT"
        lines.append(
            [r.name, *held, human_bytes(r.peak_bytes), *sent, f"{1e3 * r.step_s:.3g}", verdict]
        )
    widths = [max(len(row[k]) for row in lines if len(row) > k) for k in range(len(head) - 1)]
    return "\n".join(
        "  ".join(cell.rjust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in lines
    )


def check_layout_fits(parser, args, world):
    """benchmarks/bench_compose.py's door: a layout whose predicted peak cannot fit this machine
    is a one-line usage error before any work (launch.check_fits)."""
    grad_sync = "bf16_sr" if args.v4 else "exact"
    budget = layout_budget(
        args.cfg,
        args.pp,
        args.cp,
        args.dp,
        args.device_bytes,
        args.intra_bw,
        args.inter_bw,
        world,
        grad_sync,
    )
    scale = 2 if args.float64 else 1  # every tensor the budget counts doubles in float64
    where = f"compose at {args.pp}x{args.cp}x{args.dp}, T={args.cfg.seq_len}"
    launch.check_fits(parser, args, scale * budget.peak_bytes, where)
