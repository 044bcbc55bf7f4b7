"""Muon under ZeRO, as DeepSeek-V4 shards it (V4 §3.4.1; the optimizer: V4 §2.4, Algorithm 1).

What the standard tool assumes. ZeRO shards optimizer state by cutting the flat parameter vector
into equal pieces, one per data-parallel rank. That is exact for AdamW: the update of element i
depends only on the gradient history of element i, so any cut gives the same result.

What V4's design violates. Muon's update is a property of the whole matrix: Newton-Schulz
orthogonalises the momentum, mixing every row with every column. A rank holding a third of a matrix
holds no third of its update; it must see the whole matrix or nothing.

The fix (V4 §3.4.1), in the order of this file:
  1. the optimizer math: Nesterov momentum, Newton-Schulz in BF16 on the Frobenius-normalised
     matrix, update RMS rescaling, decoupled weight decay; AdamW for embeddings, head, norms.
  2. the naive baseline (KellerJordan's muon.py): whole matrices dealt round-robin, then gathered.
  3. V4's layout: dense matrices packed whole, largest first, into `zero_width` buckets padded to
     the largest (a plain reduce-scatter); MoE experts flattened (all downs, ups, gates) into one
     vector split over every rank without cutting a matrix; same-shape neighbours form one stacked
     momentum and one batched Newton-Schulz call.
  4. the sharded step, `sharded_step`: pack -> reduce-scatter (bf16 stochastic rounding,
     all-to-all, fp32 sum) -> clip the averaged gradient -> update owned matrices -> all-gather.

Run it (set-up, the agreement guard and the launch options come from launch.py):
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 muon_zero.py  # CPU/gloo: width 2, 2 replicas
    torchrun --nproc_per_node=8 muon_zero.py                    # GPUs: NCCL, one per rank
    python muon_zero.py --help                                  # one process; every option
"""

import argparse
import bisect
import math
import os
import time
from collections import namedtuple
from dataclasses import dataclass, replace
from itertools import accumulate, groupby

import torch
import torch.distributed as dist
import torch.nn.functional as F

import launch
from guards.muon_zero_guard import agreed_grad_mask, check_and_agree  # checks before collectives
from models.param_roles import EXPERT_ROLES, muon_param_groups  # which tensor gets Muon
from models.tiny_moe import TinyMoE, demo_batch  # the demo's model and data
from optimizer_state import muon_zero_checkpoint as checkpoint  # saving and loading

# ---- 1. The optimizer math (V4 Algorithm 1) ------------------------------------------------------

# One (a, b, c) per Newton-Schulz iteration. V4's hybrid: fast steps push every singular value into
# a band around 1, then the classic cubic settles it on 1. Standard (torch.optim.Muon): fast only.
V4_NS_COEFFICIENTS = ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2
STANDARD_NS_COEFFICIENTS = ((3.4445, -4.7750, 2.0315),) * 5
BF16_MAX = torch.finfo(torch.bfloat16).max


def newton_schulz(X, coefficients, dtype=torch.bfloat16, eps=1e-7):
    """Approximate the orthogonal factor U V^T of X = U S V^T.  X: [n, m] or [b, n, m] -> same.

    In `dtype`: each matrix divided by its Frobenius norm (every singular value <= 1), tall ones
    transposed so that the Gram matrix A = X X^T is the small one, then per (a, b, c)
    X <- a·X + (b·A + c·A²)·X, in any op order. An exact power-of-two prescale lets a tiny
    (say, clipped) gradient normalise like any other instead of falling under eps.
    """
    if X.ndim not in (2, 3):
        raise ValueError(f"newton_schulz takes [n, m] or [b, n, m], got shape {tuple(X.shape)}")
    # hint: work on a [b, n, m] stack in `dtype`, wide orientation, each matrix of norm 1
    ### BEGIN SOLUTION
    Y = (X if X.ndim == 3 else X.unsqueeze(0)).float()  # [b, n, m]
    _, exponent = torch.frexp(Y.abs().amax(dim=(-2, -1), keepdim=True))
    Y = torch.ldexp(Y, -exponent).to(dtype)  # largest entry in [0.5, 1): nothing underflows
    tall = Y.size(-2) > Y.size(-1)
    if tall:
        Y = Y.mT  # [b, s, l] with s <= l: the Gram matrix is s x s
    Y = Y / Y.norm(dim=(-2, -1), keepdim=True).clamp_min(eps)
    for a, b, c in coefficients:
        gram = Y @ Y.mT  # [b, s, s]
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b·A + c·A²
        Y = torch.baddbmm(Y, poly, Y, beta=a)  # a·X + (b·A + c·A²)·X
    if tall:
        Y = Y.mT
    return Y if X.ndim == 3 else Y.squeeze(0)
    ### END SOLUTION


def muon_update(grad, momentum_buffer, *, momentum=0.95, nesterov=True,
                coefficients=V4_NS_COEFFICIENTS, ns_dtype=torch.bfloat16,
                update_rms=0.18):  # fmt: skip
    """Advance the momentum in place, return the fp32 update O.  grad, buffer: [n, m] or [b, n, m].

    V4 writes M <- mu·M + G and X = mu·M + G (Nesterov) or M. The buffer is torch.optim.Muon's
    average form M' = (1 - mu)·M: M' <- lerp(M', G, 1 - mu), X' = lerp(G, M', mu) = (1 - mu)·X,
    the same direction. O = NS(X)·sqrt(max(n, m))·update_rms: NS(X) has RMS ~1/sqrt(max(n, m)).
    """
    # hint: two lerps (momentum, then the Nesterov look-ahead), then newton_schulz and the RMS scale
    ### BEGIN SOLUTION
    momentum_buffer.lerp_(grad, 1 - momentum)
    X = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    n, m = X.shape[-2:]
    return newton_schulz(X, coefficients, ns_dtype).float() * (update_rms * math.sqrt(max(n, m)))
    ### END SOLUTION


def apply_update(param, update, lr, weight_decay):
    """Decoupled weight decay, then the step: W <- W·(1 - lr·wd) - lr·O.  In place."""
    param.mul_(1 - lr * weight_decay).add_(update, alpha=-lr)


def adamw_update(param, grad, exp_avg, exp_avg_sq, step, *, lr, betas=(0.9, 0.95), eps=1e-8,
                 weight_decay=0.1):  # fmt: skip
    """One AdamW step (V4 keeps it for embeddings, head, norms, biases).  In place; step from 1."""
    exp_avg.lerp_(grad, 1 - betas[0])
    exp_avg_sq.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
    denom = (exp_avg_sq / (1 - betas[1] ** step)).sqrt_().add_(eps)
    param.mul_(1 - lr * weight_decay).addcdiv_(exp_avg, denom, value=-lr / (1 - betas[0] ** step))


def stochastic_round_to_bf16(x, generator=None):
    """Round fp32 to bf16 up or down at random, with E[round(x)] = x.  x: any shape fp32 -> bf16.

    bf16 is the top 16 bits of fp32. Adding a uniform random integer in [0, 2^16) to the bits and
    zeroing the low 16 carries into the kept bits with probability (dropped bits) / 2^16: the
    fraction of the gap x has covered, so unbiased, either sign. NaN and ±Inf pass through; finite
    values saturate at ±bf16 max. `generator` makes a run (and its resume) reproducible.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"stochastic_round_to_bf16 expects float32, got {x.dtype}")
    # hint: view the bits as int32; mind NaN, Inf and values next to the bf16 maximum
    ### BEGIN SOLUTION
    noise = torch.randint(
        0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator
    )
    rounded = ((x.view(torch.int32) + noise) & -65536).view(torch.float32)  # -65536 = 0xFFFF0000
    rounded = torch.where(torch.isfinite(x), rounded.clamp(-BF16_MAX, BF16_MAX), x)
    return rounded.to(torch.bfloat16)  # exact: the low 16 bits are already zero
    ### END SOLUTION


# ---- 2. The naive baseline: KellerJordan's muon.py deals whole matrices round-robin --------------


@torch.no_grad()
def round_robin_step(params, momenta, process_group=None, lr=0.02, weight_decay=0.1, **muon_kw):
    """KellerJordan's distributed Muon, for contrast (grads already averaged): rank r updates
    matrices r, r + W, ... whole and broadcasts each: as uneven as the shapes, one call each."""
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    for i, (p, M) in enumerate(zip(params, momenta)):
        if i % world == rank:
            apply_update(p, muon_update(p.grad, M, **muon_kw), lr, weight_decay)
        dist.broadcast(p, group=process_group, group_src=i % world)


# ---- 3. V4's layout: who owns what (pure functions: usable at V4 scale without processes) --------


def ns_cost(shape):
    """Multiply-adds of one NS iteration on [n, m] (s <= L): X X^T, (bA + cA²)·X and A·A."""
    s, L = sorted(shape[-2:])
    return 2 * s * s * L + s**3


def pack_dense(shapes, zero_width, balance="both"):
    """Assign whole matrices to `zero_width` buckets.  shapes: [(n, m)] -> list of index lists.

    Largest-first greedy (LPT): matrices in decreasing weight, each to the bucket where it raises
    the load least. `balance` names the load: "ns_cost" (the slowest rank sets the step time),
    "numel" (buckets are padded to the largest) or "both": the larger, each as a fraction of its
    total. In a bucket, identical shapes sit next to each other: one batched NS call.
    """
    if balance not in ("ns_cost", "numel", "both"):
        raise ValueError(f"balance must be 'ns_cost', 'numel' or 'both', got {balance!r}")
    # hint: weigh each matrix as a share of the total (cost, elements), heaviest first, then sort
    ### BEGIN SOLUTION
    costs = [ns_cost(s) for s in shapes]
    numels = [s[0] * s[1] for s in shapes]
    total_cost, total_numel = max(sum(costs), 1), max(sum(numels), 1)
    use_cost, use_numel = balance in ("ns_cost", "both"), balance in ("numel", "both")

    def load(c, n):
        return max(c / total_cost if use_cost else 0, n / total_numel if use_numel else 0)

    order = sorted(range(len(shapes)), key=lambda i: (-load(costs[i], numels[i]), i))
    buckets = [[] for _ in range(zero_width)]
    cost, numel = [0] * zero_width, [0] * zero_width
    for i in order:
        q = min(
            range(zero_width), key=lambda k: (load(cost[k] + costs[i], numel[k] + numels[i]), k)
        )
        buckets[q].append(i)
        cost[q] += costs[i]
        numel[q] += numels[i]
    return [sorted(b, key=lambda i: (tuple(shapes[i]), i)) for b in buckets]
    ### END SOLUTION


def split_experts(numels, world_size):
    """Cut V4's flat expert vector into `world_size` runs.  numels: list -> list of (start, end).

    Piece k ends at the matrix boundary nearest to k/W of the total elements (either on a tie):
    no matrix is cut. Equal-size experts: ceil/floor(N / W) each.
    """
    # hint: prefix sums of the sizes; for each k pick the boundary closest to k/W of the total
    ### BEGIN SOLUTION
    total, prefix = sum(numels), [0]
    for n in numels:
        prefix.append(prefix[-1] + n)
    cuts = [0]
    for k in range(1, world_size):
        target = total * k / world_size
        j = bisect.bisect_left(prefix, target)  # first boundary at or past the target
        if j > 0 and (j > len(numels) or target - prefix[j - 1] <= prefix[j] - target):
            j -= 1  # the boundary before it is nearer
        cuts.append(max(j, cuts[-1]))
    cuts.append(len(numels))
    return [(cuts[k], cuts[k + 1]) for k in range(world_size)]
    ### END SOLUTION


@dataclass
class MuonPlan:
    """Who owns what. Rank r sits at position r % zero_width of replica r // zero_width; it owns
    dense bucket r % zero_width (so does every rank at that position) and expert run r."""

    world_size: int
    zero_width: int
    dense_shapes: list  # [(n, m)] in parameter order
    dense_buckets: list  # zero_width lists of dense indices
    expert_shapes: list  # [(n, m)] in V4's flat order: all downs, then ups, then gates
    expert_ranges: list  # world_size (start, end) runs of expert indices
    dense_bucket_numel: int = 0  # the largest bucket: every bucket is padded to it
    expert_chunk_numel: int = 0  # the largest run: every run is padded to it

    def owned(self, rank):
        """(dense indices, expert indices) whose Muon update `rank` computes."""
        a, b = self.expert_ranges[rank] if self.expert_shapes else (0, 0)
        return self.dense_buckets[rank % self.zero_width], list(range(a, b))


def plan_muon(dense_shapes, expert_shapes, world_size, zero_width=None, balance="both"):
    """Build the ownership plan.  dense_shapes, expert_shapes: [(n, m)]; experts in flat order."""
    zero_width = world_size if zero_width is None else zero_width
    if not isinstance(zero_width, int) or zero_width < 1 or world_size % zero_width:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"zero_width={zero_width} must divide the data-parallel size "
                         f"{world_size} (replica groups): pick one of {divisors}")  # fmt: skip
    dense, experts = [tuple(s) for s in dense_shapes], [tuple(s) for s in expert_shapes]
    buckets = pack_dense(dense, zero_width, balance)
    ranges = split_experts([math.prod(s) for s in experts], world_size)
    bucket = max((sum(math.prod(dense[i]) for i in b) for b in buckets), default=0)
    chunk = max((sum(map(math.prod, experts[a:b])) for a, b in ranges), default=0)
    return MuonPlan(world_size, zero_width, dense, buckets, experts, ranges, bucket, chunk)


@dataclass(frozen=True)
class Slot:
    """One Muon matrix inside a flat chunk: params[param], or expert `expert` of that stack."""

    param: int  # index into MuonZeRO.params
    expert: int | None  # index into a stack [E, n, m]; None for a dense matrix
    param_group: int  # index into MuonZeRO.param_groups: its hyperparameters
    shape: tuple  # (n, m)
    offset: int = 0  # where it starts inside its chunk

    def of(self, tensors):
        """This matrix inside a per-parameter list of tensors (a view)."""
        t = tensors[self.param]
        return t if self.expert is None else t[self.expert]


@dataclass
class Run:
    """Owned same-shape matrices side by side: one stacked momentum [count, n, m], one NS call."""

    offset: int  # start inside my chunk
    shape: tuple  # (n, m)
    slots: list  # its Slots, in order (of any param group: expert ups and gates merge)


@dataclass
class Shards:
    """One kind of matrices (dense buckets, or the expert vector) spread over `peers` ranks."""

    chunks: list  # per peer q: the Slots of the matrices peer q owns, back to back
    chunk_numel: int  # every chunk is padded to this many elements
    mine: int  # which chunk is mine
    runs: list  # my chunk as Runs
    group: object  # the peers' process group (None: one process)
    peers: int
    replica_group: object = None  # dense, DP wider than the cap: my position in every replica
    counted: bool = True  # my chunk enters the global gradient norm (dense: replica 0 only)


# A param group's Muon hyperparameters, named as its keys; equal ones share one batched NS call.
MuonSettings = namedtuple(
    "MuonSettings", "lr weight_decay momentum nesterov ns_coefficients ns_dtype update_rms"
)


def make_shards(matrix_lists, mine, process_group, peers, **kw):
    """Each peer's matrices back to back from offset 0; my chunk's same-shape neighbours: Runs."""
    offsets = [accumulate((math.prod(s.shape) for s in c), initial=0) for c in matrix_lists]
    chunks = [[replace(s, offset=o) for s, o in zip(c, at)] for c, at in zip(matrix_lists, offsets)]
    same_shape = [list(slots) for _, slots in groupby(chunks[mine], key=lambda s: s.shape)]
    runs = [Run(slots[0].offset, slots[0].shape, slots) for slots in same_shape]
    numel = max((sum(math.prod(s.shape) for s in c) for c in chunks), default=0)
    return Shards(chunks, numel, mine, runs, process_group, peers, **kw)


# ---- 4. The sharded step: pack -> reduce-scatter -> clip -> update mine -> all-gather ------------


@torch.no_grad()
def sharded_step(kinds, grads, params, momenta, settings, has_grad, world_size, grad_sync, gen,
                 max_norm=None, replicated_sq=0.0, process_group=None):  # fmt: skip
    """V4's sharded Muon step for every kind of matrices; every rank ends with the same params.

    kinds: Shards (dense buckets, the expert vector); grads, params: per-parameter lists (a grad
    may be None: zero here); momenta: per kind, a stacked buffer [count, n, m] per run of mine;
    settings: a MuonSettings per param group; has_grad: per parameter, agreed by every rank;
    world_size: ranks of process_group, whose gradients are averaged; gen: the rounding noise;
    max_norm: clip the averaged gradient to this norm over the whole model (None: don't);
    replicated_sq: squared norm of the gradients every rank holds whole (AdamW's).
    Returns the clip factor (1 without clipping), for the AdamW gradients.
    """
    # hint: per kind: pack, reduce_scatter_sum (+ replicas), mean; clip; update_run per run; gather
    ### BEGIN SOLUTION
    device, means = params[0].device, []
    for shards in kinds:
        # 1. pack: my gradients as one zero-padded chunk per peer, chunk q = what peer q owns
        chunks = pack(shards.chunks, shards.chunk_numel, grads, device)  # [P, S]
        # 2. reduce-scatter: chunk q of every peer lands on peer q and is summed there (V4's MoE
        #    recipe: bf16 stochastic rounding, all-to-all, fp32 sum); then across the replicas
        mine = reduce_scatter_sum(chunks, shards.group, grad_sync, gen)  # [S]
        if shards.replica_group is not None:
            dist.all_reduce(mine, group=shards.replica_group)
        means.append(mine.div_(world_size))
    # 3. clip the averaged gradient: one norm over the whole model, each matrix counted once
    scale = torch.ones((), device=device)
    if max_norm is not None:
        sq = sum((m.square().sum() for m, s in zip(means, kinds) if s.counted), 0 * scale)
        if world_size > 1:
            dist.all_reduce(sq, group=process_group)
        scale = (max_norm / ((sq + replicated_sq).sqrt() + 1e-6)).clamp(max=1.0)
        for mean_grad in means:
            mean_grad.mul_(scale)
    for shards, mean_grad, buffers in zip(kinds, means, momenta):
        # 4. update the matrices I own: one batched Newton-Schulz call per same-shape run
        values = pack([shards.chunks[shards.mine]], shards.chunk_numel, params, device)[0]  # [S]
        for run, M in zip(shards.runs, buffers):
            span = slice(run.offset, run.offset + M.numel())
            update_run(mean_grad[span].view_as(M), values[span].view_as(M), M,
                       [settings[s.param_group] for s in run.slots],
                       [has_grad[s.param] for s in run.slots])  # fmt: skip
        # 5. all-gather every peer's updated chunk and unpack it into the parameters, everywhere
        unpack(all_gather_chunks(values, shards.group, shards.peers), shards.chunks, params)
    return scale
    ### END SOLUTION


def pack(chunks, numel, tensors, device):
    """Copy each slot's matrix from tensors[slot.param] into a zero-padded [len(chunks), numel]."""
    out = torch.zeros(len(chunks), numel, device=device)
    for q, slots in enumerate(chunks):
        for s in slots:
            if tensors[s.param] is not None:  # no gradient here: stays zero
                out[q, s.offset : s.offset + math.prod(s.shape)].view(s.shape).copy_(s.of(tensors))
    return out


def unpack(flat, chunks, tensors):
    """The inverse of pack: flat [len(chunks), numel] back into each slot's matrix, in place."""
    for q, slots in enumerate(chunks):
        for s in slots:
            s.of(tensors).copy_(flat[q, s.offset : s.offset + math.prod(s.shape)].view(s.shape))


def reduce_scatter_sum(chunks, group, grad_sync, generator):
    """chunks [P, S] fp32 (chunk q goes to peer q) -> [S] fp32: every peer's chunk for me, summed.
    All-to-all, then an fp32 sum: each gradient rounded once (a bf16 ring rounds at every hop)."""
    if chunks.size(0) == 1:
        return chunks[0]
    payload = stochastic_round_to_bf16(chunks, generator) if grad_sync == "bf16_sr" else chunks
    received = torch.empty_like(payload)
    dist.all_to_all_single(received, payload, group=group)
    return received.float().sum(0)


def all_gather_chunks(chunk, group, size):
    """[S] -> [size, S], chunk q from peer q."""
    if size == 1:
        return chunk.unsqueeze(0)
    out = chunk.new_empty(size * chunk.numel())
    dist.all_gather_single(out, chunk, group=group)
    return out.view(size, -1)


def update_run(G, W, M, settings, active):
    """Muon on one run [count, n, m] in place, one muon_update per equal-settings neighbours;
    members with no gradient on any rank keep momentum and weights (as torch's optimizers do)."""
    idle = [k for k, a in enumerate(active) if not a]
    saved, start = (M[idle].clone(), W[idle].clone()), 0
    for s, members in groupby(settings):
        end = start + len(list(members))
        update = muon_update(G[start:end], M[start:end], momentum=s.momentum,
                             nesterov=s.nesterov, coefficients=s.ns_coefficients,
                             ns_dtype=s.ns_dtype, update_rms=s.update_rms)  # fmt: skip
        apply_update(W[start:end], update, s.lr, s.weight_decay)
        start = end
    M[idle], W[idle] = saved


def build_groups(process_group, world_size, zero_width):
    """(shard group, replica group): ranks r // Z share a replica (the reduce-scatter peers), ranks
    r % Z a position (the cross-replica all-reduce); only members create one (a DP subgroup)."""
    if zero_width == world_size:
        return process_group, None
    rank, Z = dist.get_rank(process_group), zero_width

    def new_group(ranks):
        members = [dist.get_global_rank(process_group, r) for r in ranks]
        return launch.new_group(members, use_local_synchronization=True)  # the launch's timeout

    start = rank // Z * Z
    shard = new_group(range(start, start + Z)) if Z > 1 else None
    return shard, new_group(range(rank % Z, world_size, Z))


class MuonZeRO(torch.optim.Optimizer):
    """Muon for matrices and expert stacks, AdamW for the rest, ZeRO-sharded the way V4 does it.

    Param groups carry a `role` (see muon_param_groups). Each rank runs backward() on its own
    micro-batch; step() (a collective, like the constructor) averages the gradients, updates the
    matrices this rank owns and gathers them: every rank ends identical. Hyperparameters as
    torch.optim.Muon and AdamW; zero_width: ranks sharing the dense matrices (divides the group);
    grad_sync: "bf16_sr" (V4's) or "fp32"; max_grad_norm: clip the averaged gradient, in step().
    """

    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=True,
                 ns_coefficients=V4_NS_COEFFICIENTS, ns_dtype=torch.bfloat16, update_rms=0.18,
                 betas=(0.9, 0.95), eps=1e-8, zero_width=None, grad_sync="bf16_sr",
                 process_group=None, balance="both", seed=0, max_grad_norm=None):  # fmt: skip
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, ns_dtype=ns_dtype, update_rms=update_rms,
                        betas=betas, eps=eps, role="dense")  # fmt: skip
        super().__init__(params, defaults)
        if process_group is None and dist.is_initialized():
            process_group = dist.group.WORLD
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group) if process_group is not None else 1
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.grad_sync, self.max_grad_norm, self.seed = grad_sync, max_grad_norm, seed
        self.params = [p for g in self.param_groups for p in g["params"]]
        check_and_agree(self, zero_width, balance, plan_muon)  # the same ValueError everywhere
        self.device = self.params[0].device
        self._built_for = [(tuple(p.shape), p.dtype, p.device) for p in self.params]  # re-checked

        # V4's matrices: dense in parameter order; experts flattened, all downs, then ups, gates.
        self.dense_matrices = [Slot(i, None, k, tuple(p.shape))
                               for i, p, k in self._params_of(("dense",))]  # fmt: skip
        self.expert_matrices = [Slot(i, e, k, tuple(p.shape[1:])) for role in EXPERT_ROLES
                                for i, p, k in self._params_of((role,))
                                for e in range(p.size(0))]  # fmt: skip
        self.plan = plan_muon([s.shape for s in self.dense_matrices],
                              [s.shape for s in self.expert_matrices],
                              self.world_size, zero_width, balance)  # fmt: skip
        self.zero_width = Z = self.plan.zero_width
        shard_group, replica_group = build_groups(process_group, self.world_size, Z)
        self.shards = []  # the same kinds on every rank: one owning none still joins
        if self.dense_matrices:  # reduce-scatter over my replica, all-reduce across replicas
            buckets = [[self.dense_matrices[i] for i in b] for b in self.plan.dense_buckets]
            self.shards.append(make_shards(buckets, self.rank % Z, shard_group, Z,
                                           replica_group=replica_group,
                                           counted=self.rank < Z))  # fmt: skip
        if self.expert_matrices:  # reduce-scatter over every rank
            pieces = [self.expert_matrices[a:b] for a, b in self.plan.expert_ranges]
            self.shards.append(make_shards(pieces, self.rank, process_group, self.world_size))
        self._momentum = None  # per kind, a stacked buffer per run; created in the first step
        self.steps = 0
        self._sr_generator = torch.Generator(device=self.device)
        self._sr_generator.manual_seed(rounding_seed(seed, self.rank, 0))

    def _params_of(self, roles):
        """(index into self.params, parameter, param-group index) of the groups with these roles."""
        index = {id(p): i for i, p in enumerate(self.params)}
        return [(index[id(p)], p, k) for k, g in enumerate(self.param_groups)
                if g["role"] in roles for p in g["params"]]  # fmt: skip

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        has_grad = agreed_grad_mask(self)  # one small all-reduce; re-checks settings across ranks
        if not any(has_grad):
            return loss
        if self._momentum is None:
            self._momentum = [[torch.zeros(len(r.slots), *r.shape, device=self.device)
                               for r in shards.runs] for shards in self.shards]  # fmt: skip
        # AdamW is element-wise, so plain data parallelism is exact: one all-reduce, all step
        adamw = [(p, self.param_groups[k]) for i, p, k in self._params_of(("adamw",))
                 if has_grad[i]]  # fmt: skip
        flat = torch.cat([torch.zeros(0, device=self.device)] + [torch.zeros_like(p).flatten()
                          if p.grad is None else p.grad.flatten() for p, _ in adamw])  # fmt: skip
        if self.world_size > 1 and adamw:
            dist.all_reduce(flat, group=self.process_group)
        flat /= self.world_size
        settings = [MuonSettings(*(g[k] for k in MuonSettings._fields)) for g in self.param_groups]
        scale = sharded_step(self.shards, [p.grad for p in self.params],
                             [p.detach() for p in self.params], self._momentum, settings,
                             has_grad, self.world_size, self.grad_sync, self._sr_generator,
                             self.max_grad_norm, flat.square().sum(),
                             self.process_group)  # fmt: skip
        for (p, g), grad in zip(adamw, flat.mul_(scale).split([p.numel() for p, _ in adamw])):
            state = self.state[p]
            if not state:
                state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state["step"] += 1
            adamw_update(p.detach(), grad.view_as(p), state["exp_avg"], state["exp_avg_sq"],
                         state["step"], lr=g["lr"], betas=g["betas"], eps=g["eps"],
                         weight_decay=g["weight_decay"])  # fmt: skip
        self.steps += 1
        return loss

    def add_param_group(self, param_group):
        if getattr(self, "plan", None) is not None:
            raise ValueError("MuonZeRO plans ownership at construction: pass every param group")
        super().add_param_group(param_group)

    def state_dict(self):  # this rank's share: no collective, resumes at the same layout
        return checkpoint.save(self, gather=False)

    def gather_state_dict(self):  # a collective: the whole state, loads at any world size
        return checkpoint.save(self, gather=True)

    def load_state_dict(self, state_dict):  # either of the two; resuming is exact
        checkpoint.load(self, state_dict)

    def local_state_tensors(self):
        """The state tensors this rank holds: its stacked Muon momenta and the AdamW moments."""
        muon = [M for buffers in self._momentum or [] for M in buffers]
        return muon + [t for s in self.state.values() for t in s.values() if torch.is_tensor(t)]

    def state_bytes(self):
        return sum(t.numel() * t.element_size() for t in self.local_state_tensors())


def rounding_seed(seed, rank, steps):
    """The rounding generator's seed: a stream per rank, and per step count after a reseed."""
    return seed * 65537 + rank + steps * 2**32


# ==== appendix, the demo: TinyMoE (models/tiny_moe.py) trained on every rank's slice of the batch


def format_plan(plan):
    """One line per rank: matrices, elements and padding (matrix entries), NS cost, NS calls."""
    rows = [("rank", "replica", "pos", "dense mats", "expert mats", "elements owned",
             "dense pad elems", "expert pad elems", "NS MACs/iter", "NS calls")]  # fmt: skip
    for r in range(plan.world_size):
        dense, experts = plan.owned(r)
        shapes = [plan.dense_shapes[i] for i in dense] + [plan.expert_shapes[i] for i in experts]
        d, e = sum(map(math.prod, shapes[: len(dense)])), sum(map(math.prod, shapes[len(dense) :]))
        rows.append((r, r // plan.zero_width, r % plan.zero_width, len(dense), len(experts),
                     f"{d + e:,}", f"{plan.dense_bucket_numel - d:,}",
                     f"{plan.expert_chunk_numel - e:,}", f"{sum(map(ns_cost, shapes)):.3g}",
                     len([k for k, _ in groupby(shapes)])))  # fmt: skip
    widths = [max(len(h), 6) for h in rows[0]]
    return "\n".join(" ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows)


MAX_DEMO_SEQ = 4096  # the demo's attention costs seq² per sequence and step


def parse_args(argv=None):
    """The demo's options, each checked before any work (a one-line usage error)."""
    world, count = int(os.environ.get("WORLD_SIZE", "1")), launch.at_least(1)
    parser = launch.add_launch_options(argparse.ArgumentParser(
        description="Train a small MoE with MuonZeRO on every rank (V4 §3.4.1)."))  # fmt: skip
    add = parser.add_argument
    add("--steps", type=count, default=40, help="optimizer steps (default: %(default)s)")
    add("--batch", type=count, default=-(-24 // world) * world, help="global batch in sequences "
        "(default: 24, rounded up to a multiple of the ranks)")  # fmt: skip
    add("--seq", type=count, default=16, help=f"tokens per sequence, at most {MAX_DEMO_SEQ} "
        "(default: %(default)s)")  # fmt: skip
    add("--zero-width", type=count, default=world // 2 if world % 2 == 0 and world > 2 else world,
        help="ranks sharing the dense matrices (default: N/2 for even N > 2, else N)")  # fmt: skip
    add("--grad-sync", choices=("bf16_sr", "fp32"), default="bf16_sr", help="gradient exchange: "
        "V4's bf16 stochastic rounding, or exact fp32 (default: %(default)s)")  # fmt: skip
    add("--lr", type=launch.positive, default=0.02, help="Muon's learning rate; AdamW's is 3e-3 "
        "(default: %(default)s)")  # fmt: skip
    add("--max-grad-norm", type=launch.positive, help="clip the averaged gradient to this norm "
        "(default: no clipping)")  # fmt: skip
    args = launch.check_launch_options(parser, parser.parse_args(argv))
    for bad, why in ((args.seq > MAX_DEMO_SEQ, f"--seq {args.seq}: pass at most {MAX_DEMO_SEQ}"),
                     (args.batch % world, f"--batch {args.batch} does not split evenly over "
                      f"{world} ranks; pass a multiple of {world}"),
                     (world % args.zero_width, f"--zero-width {args.zero_width} must divide the "
                      f"{world} ranks")):  # fmt: skip
        if bad:
            parser.error(why)
    return args


def train(args, rank, world, device):
    start, per_rank = time.perf_counter(), args.batch // world
    model = TinyMoE().to(device)  # launch.setup seeded every rank alike: the same initial model
    groups = [{**g, "lr": 3e-3} if g["role"] == "adamw" else g for g in muon_param_groups(model)]
    opt = MuonZeRO(groups, lr=args.lr, zero_width=args.zero_width, grad_sync=args.grad_sync,
                   max_grad_norm=args.max_grad_norm)  # fmt: skip
    Z = opt.zero_width
    launch.say(f"{world} rank(s) = {world // Z} replica(s) x zero width {Z}; the plan (elements):")
    launch.say(format_plan(opt.plan))
    data = torch.Generator().manual_seed(1)
    for step in range(1, args.steps + 1):
        x, y = (t[rank * per_rank : (rank + 1) * per_rank].to(device)
                for t in demo_batch(args.batch, args.seq, 64, data))  # fmt: skip
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        dist.all_reduce(mean_loss := loss.detach() / world)
        if step % 5 == 1 or step == args.steps:
            launch.say(f"step {step:3d}  loss {mean_loss.item():.4f}  "
                       f"({time.perf_counter() - start:.1f} s)")  # fmt: skip
    n_adamw = sum(p.numel() for g in opt.param_groups if g["role"] == "adamw" for p in g["params"])
    muon, adam = 4 * (sum(p.numel() for p in opt.params) - n_adamw), 8 * n_adamw  # fp32 buffers
    held = all_gather_chunks(torch.tensor([float(opt.state_bytes())], device=device), None, world)
    launch.say(f"optimizer state held per rank (bytes): {held.long().flatten().tolist()}  vs "
               f"unsharded {muon + adam:,} (Muon momentum {muon:,} + AdamW moments "
               f"{adam:,})")  # fmt: skip
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    same = all(torch.equal(flat, other) for other in all_gather_chunks(flat, None, world))
    launch.say(f"parameters bitwise identical on all {world} ranks: {same}")
    if not same:
        raise SystemExit("replicas diverged")


if __name__ == "__main__":
    launch.run(train, parse_args())
