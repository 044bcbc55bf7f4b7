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
  4. the sharded step: pack -> reduce-scatter (bf16 stochastic rounding, all-to-all, fp32 sum)
     -> update owned matrices -> all-gather -> unpack.

Run it:
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 muon_zero.py  # CPU/gloo: width 2, 2 replicas
    torchrun --nproc_per_node=8 muon_zero.py                    # GPUs: NCCL, one per rank
    python muon_zero.py --help                                  # one process; every option
"""

import argparse
import bisect
import datetime
import gc
import hashlib
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# ------------------------------------------------------------------------------------------------
# 1. The optimizer math (V4 Algorithm 1)
# ------------------------------------------------------------------------------------------------

# One (a, b, c) per Newton-Schulz iteration. V4's hybrid schedule: 8 fast steps push every singular
# value into a band around 1, then 2 steps of the classic cubic that converges to 1 (in fp32 the
# result lands within ~3e-4 of U V^T). The standard schedule (KellerJordan/Muon, torch.optim.Muon)
# stops after the 5 fast steps, leaving singular values anywhere in ~[0.7, 1.2].
V4_NS_COEFFICIENTS = ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2
STANDARD_NS_COEFFICIENTS = ((3.4445, -4.7750, 2.0315),) * 5

BF16_MAX = torch.finfo(torch.bfloat16).max


def newton_schulz(X, coefficients, dtype=torch.bfloat16, eps=1e-7):
    """Approximate the orthogonal factor U V^T of X = U S V^T.  X: [n, m] or [b, n, m] -> same.

    Each matrix is divided by its Frobenius norm (so every singular value is <= 1), tall matrices
    are transposed so the Gram matrix X X^T is the small one, then X <- aX + b(XX^T)X + c(XX^T)^2 X.
    """
    if X.ndim not in (2, 3):
        raise ValueError(f"newton_schulz takes [n, m] or [b, n, m], got shape {tuple(X.shape)}")
    # hint: work on a [b, n, m] stack in `dtype`, wide orientation, each matrix of norm 1
    ### BEGIN SOLUTION
    Y = X.to(dtype) if X.ndim == 3 else X.to(dtype).unsqueeze(0)  # [b, n, m]
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

    V4 writes M <- mu·M + G and X = mu·M + G (Nesterov) or M. We keep the buffer as an average,
    M' = (1 - mu)·M, i.e. M' <- lerp(M', G, 1 - mu) and X' = lerp(G, M', mu) = (1 - mu)·X: the same
    direction, and NS divides by the Frobenius norm first, so the update is the same. The average
    has the gradient's scale, and it is exactly torch.optim.Muon's buffer, so a checkpoint's
    momentum means the same thing in both.
    O = NS(X) · sqrt(max(n, m)) · update_rms: NS(X) has singular values ~1, so its RMS is
    ~1/sqrt(max(n, m)); the factor makes every matrix's update RMS equal update_rms whatever its
    shape (0.2 is torch's "match_rms_adamw").
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


def adamw_update(
    param, grad, exp_avg, exp_avg_sq, step, *, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
):
    """One AdamW step (V4 keeps it for embeddings, head, norms, biases).  In place; step from 1."""
    beta1, beta2 = betas
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(eps)
    param.mul_(1 - lr * weight_decay).addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


def stochastic_round_to_bf16(x, generator=None):
    """Round fp32 to bf16 up or down at random, with E[round(x)] = x.  x: any shape fp32 -> bf16.

    bf16 is the top 16 bits of fp32. Adding a uniform random integer in [0, 2^16) to the bit
    pattern and zeroing the low 16 bits carries into the kept bits with probability
    (dropped bits) / 2^16, exactly the fraction of the gap x has covered: unbiased. The integer add
    acts on the magnitude bits, so negative numbers round symmetrically. NaN and ±Inf pass through
    unchanged; finite values saturate at ±bf16 max instead of carrying into Inf.
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


# ------------------------------------------------------------------------------------------------
# 2. The naive baseline: KellerJordan's muon.py deals whole matrices round-robin
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def round_robin_step(params, momenta, group=None, lr=0.02, weight_decay=0.1, **muon_kwargs):
    """Distributed Muon as KellerJordan's muon.py does it, for contrast.  Grads already averaged.

    Rank r updates matrices r, r + W, r + 2W, ... whole, then every matrix travels from its owner to
    everyone (muon.py batches same-size matrices into one all_gather; a broadcast is the same idea).
    What V4 changes: every rank here still holds every gradient (no ZeRO for gradients), the load is
    as uneven as the shapes, experts are not matrices of their own, and there is one collective per
    matrix. V4 packs by cost, reduce-scatters the gradients, and batches same-shape matrices.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for i, (p, M) in enumerate(zip(params, momenta)):
        if i % world == rank:
            apply_update(p, muon_update(p.grad, M, **muon_kwargs), lr, weight_decay)
        dist.broadcast(p, group=group, group_src=i % world)


# ------------------------------------------------------------------------------------------------
# 3. V4's layout: who owns what (pure functions: usable at V4 scale without processes)
# ------------------------------------------------------------------------------------------------


def ns_cost(shape):
    """Multiply-adds of one Newton-Schulz iteration on an [n, m] matrix (the packing cost model).

    With s = min(n, m), L = max(n, m): X X^T is s·s·L, A·A is s³, (bA + cA²)·X is s·s·L.
    The iteration count is the same for every matrix, so per-iteration cost ranks them correctly.
    """
    s, L = sorted(shape[-2:])
    return 2 * s * s * L + s**3


def pack_dense(shapes, zero_width, balance="both"):
    """Assign whole matrices to `zero_width` buckets.  shapes: [(n, m)] -> list of index lists.

    Largest-first greedy (LPT): take matrices in decreasing weight, each to the bucket where it
    raises the load least. Two loads matter: NS cost (compute: the slowest rank sets the step time)
    and element count (memory: every bucket is padded to the largest). balance="ns_cost" or "numel"
    balances one; "both" (default) balances the larger of the two, each as a fraction of its total,
    which keeps NS cost balanced without the padding a cost-only packing pays. LPT's worst case on
    one load is 4/3 of the optimum. Within a bucket matrices are ordered by shape, so identical
    shapes sit together and share one batched NS call.
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

    Piece k ends at the matrix boundary nearest to k/W of the total, so no matrix is ever cut; each
    piece is then padded to the largest. With equal-size experts this gives ceil/floor(N / W)
    matrices per rank: padding is at most one matrix per rank, zero when W divides N.
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
    """Who owns what: dense buckets per position in a replica group, expert runs per rank."""

    world_size: int
    zero_width: int
    dense_shapes: list  # [(n, m)] in parameter order
    dense_buckets: list  # zero_width lists of dense indices; bucket q: every rank at position q
    expert_shapes: list  # [(n, m)] in V4's flat order: all downs, then ups, then gates
    expert_ranges: list  # world_size (start, end) runs of expert indices

    def position(self, rank):
        """Rank r sits at position r % zero_width of replica group r // zero_width."""
        return rank % self.zero_width

    @property
    def dense_bucket_numel(self):
        sizes = [sum(math.prod(self.dense_shapes[i]) for i in b) for b in self.dense_buckets]
        return max(sizes, default=0)

    @property
    def expert_chunk_numel(self):
        sizes = [sum(math.prod(s) for s in self.expert_shapes[a:b]) for a, b in self.expert_ranges]
        return max(sizes, default=0)

    def owned(self, rank):
        """(dense indices, expert indices) whose Muon update `rank` computes."""
        a, b = self.expert_ranges[rank] if self.expert_shapes else (0, 0)
        return self.dense_buckets[self.position(rank)], list(range(a, b))

    def rows(self):  # the printing lives in the appendix
        return plan_rows(self)

    def summary(self):
        return plan_summary(self)

    def format(self):
        return format_plan(self)


def plan_muon(dense_shapes, expert_shapes, world_size, zero_width=None, balance="both"):
    """Build the ownership plan.  dense_shapes, expert_shapes: [(n, m)]; experts in flat order."""
    zero_width = world_size if zero_width is None else zero_width
    if zero_width < 1 or world_size % zero_width:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"zero_width={zero_width} must divide the data-parallel size {world_size}: ranks form "
            f"{world_size}/zero_width replica groups; pick a divisor such as {divisors}"
        )
    dense_shapes = [tuple(s) for s in dense_shapes]
    expert_shapes = [tuple(s) for s in expert_shapes]
    buckets = pack_dense(dense_shapes, zero_width, balance)
    ranges = split_experts([math.prod(s) for s in expert_shapes], world_size)
    return MuonPlan(world_size, zero_width, dense_shapes, buckets, expert_shapes, ranges)


# -- the records the step works on -------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """One Muon matrix inside a flat chunk: params[param], or expert `expert` of that stack."""

    param: int  # index into MuonZeRO.params
    expert: int | None  # index into a stack [E, n, m]; None for a dense matrix
    group: int  # index of its param group
    shape: tuple  # (n, m)
    offset: int = 0  # where it starts inside its chunk

    @property
    def numel(self):
        return self.shape[0] * self.shape[1]

    def of(self, tensors):
        """This matrix inside a per-parameter list of tensors (a view)."""
        t = tensors[self.param]
        return t if self.expert is None else t[self.expert]


@dataclass
class Run:
    """Owned matrices of one shape that sit next to each other: one stacked momentum, one NS call.

    Experts' up and gate matrices of equal shape merge even though they are separate param groups.
    """

    offset: int  # start inside my chunk
    shape: tuple  # (n, m)
    slots: list = field(default_factory=list)

    @property
    def count(self):
        return len(self.slots)

    @property
    def numel(self):
        return self.count * self.shape[0] * self.shape[1]


@dataclass
class Shards:
    """One kind of matrices (dense buckets, or the expert vector) spread over `peers` ranks."""

    chunks: list  # per peer q: the Slots of the matrices peer q owns, back to back
    chunk_numel: int  # every chunk is padded to this many elements
    mine: int  # which chunk is mine
    runs: list  # my chunk as Runs
    group: object  # the peers' process group (None: one process)
    peers: int
    replica_group: object = None  # dense only, DP wider than the cap: my position in every replica


@dataclass(frozen=True)
class MuonSettings:
    """A param group's Muon hyperparameters; equal settings may share one batched NS call."""

    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    coefficients: tuple
    ns_dtype: torch.dtype
    update_rms: float

    @staticmethod
    def of(group):
        g = group
        return MuonSettings(g["lr"], g["weight_decay"], g["momentum"], g["nesterov"],
                            tuple(map(tuple, g["ns_coefficients"])), g["ns_dtype"],
                            g["update_rms"])  # fmt: skip


def lay_out(matrices):
    """Slots back to back from offset 0.  -> (slots with offsets, total elements)."""
    slots, offset = [], 0
    for s in matrices:
        slots.append(Slot(s.param, s.expert, s.group, s.shape, offset))
        offset += s.numel
    return slots, offset


def make_runs(slots):
    """Group consecutive same-shape slots into Runs (whatever their param group)."""
    runs = []
    for s in slots:
        if runs and runs[-1].shape == s.shape:
            runs[-1].slots.append(s)
        else:
            runs.append(Run(s.offset, s.shape, [s]))
    return runs


# ------------------------------------------------------------------------------------------------
# 4. The sharded step: pack -> reduce-scatter -> update my matrices, batched -> all-gather -> unpack
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def sharded_step(shards, grads, params, momenta, settings, has_grad, world_size, grad_sync, gen):
    """One kind of matrices through V4's sharded Muon step; every rank ends with the same params.

    grads, params: per-parameter lists (a grad may be None: zero here); momenta: one stacked
    buffer [count, n, m] per run of mine; settings: a MuonSettings per param group; has_grad: per
    parameter, agreed by every rank; world_size: ranks whose gradients are averaged; gen: the
    rounding noise.
    """
    # hint: pack, reduce_scatter_sum (+ the replica all-reduce), update_run per run, gather, unpack
    ### BEGIN SOLUTION
    device = params[0].device
    # 1. pack: my gradients as one zero-padded chunk per peer, chunk q = what peer q owns
    chunks = pack(shards.chunks, shards.chunk_numel, grads, device)  # [P, S]
    # 2. reduce-scatter: chunk q of every peer lands on peer q and is summed there (V4's MoE recipe:
    #    bf16 stochastic rounding, all-to-all, fp32 sum)
    mine = reduce_scatter_sum(chunks, shards.group, grad_sync, gen)  # [S]
    if shards.replica_group is not None:  # dense, DP wider than the cap: add the other replicas
        dist.all_reduce(mine, group=shards.replica_group)
    mean_grad = mine.div_(world_size)
    # 3. update the matrices I own: one batched Newton-Schulz call per same-shape run
    values = pack([shards.chunks[shards.mine]], shards.chunk_numel, params, device)[0]  # [S]
    for run, M in zip(shards.runs, momenta):
        span = slice(run.offset, run.offset + run.numel)
        G = mean_grad[span].view(run.count, *run.shape)  # [count, n, m]
        W = values[span].view(run.count, *run.shape)
        active = [has_grad[s.param] for s in run.slots]
        update_run(G, W, M, [settings[s.group] for s in run.slots], active)
    # 4. all-gather every peer's updated chunk, 5. unpack it into the parameters, on every rank
    unpack(all_gather_chunks(values, shards.group, shards.peers), shards.chunks, params)
    ### END SOLUTION


def pack(chunks, numel, tensors, device):
    """Copy each slot's matrix from tensors[slot.param] into a zero-padded [len(chunks), numel]."""
    out = torch.zeros(len(chunks), numel, device=device)
    for q, slots in enumerate(chunks):
        for s in slots:
            if tensors[s.param] is not None:  # no gradient here: stays zero
                out[q, s.offset : s.offset + s.numel].view(s.shape).copy_(s.of(tensors))
    return out


def unpack(flat, chunks, tensors):
    """The inverse of pack: flat [len(chunks), numel] back into each slot's matrix, in place."""
    for q, slots in enumerate(chunks):
        for s in slots:
            s.of(tensors).copy_(flat[q, s.offset : s.offset + s.numel].view(s.shape))


def reduce_scatter_sum(chunks, group, grad_sync, generator):
    """chunks [P, S] fp32 (chunk q goes to peer q) -> [S] fp32: every peer's chunk for me, summed.

    An all-to-all plus a local sum (V4's MoE recipe): with grad_sync="bf16_sr" each gradient is
    rounded once, stochastically, and the sum is in FP32. A bf16 ring reduce-scatter instead rounds
    the running sum at every hop, so its error grows with the number of ranks.
    """
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
    """Muon on one run [count, n, m] in place: momentum M, batched NS, decay and step into W.

    Consecutive members with equal settings (the usual case, across param groups too) share one
    muon_update call; members without a gradient on any rank are left alone.
    """
    start = 0
    while start < len(settings):
        end = start + 1
        while end < len(settings) and settings[end] == settings[start]:
            end += 1
        s = settings[start]
        kwargs = dict(momentum=s.momentum, nesterov=s.nesterov, coefficients=s.coefficients,
                      ns_dtype=s.ns_dtype, update_rms=s.update_rms)  # fmt: skip
        idx = [k for k in range(start, end) if active[k]]
        if len(idx) == end - start:  # all active: the stacked buffer is updated in place
            update = muon_update(G[start:end], M[start:end], **kwargs)  # one batched NS
            apply_update(W[start:end], update, s.lr, s.weight_decay)
        elif idx:
            sub = torch.tensor(idx, device=M.device)
            M_sub, W_sub = M[sub], W[sub]
            apply_update(W_sub, muon_update(G[sub], M_sub, **kwargs), s.lr, s.weight_decay)
            M[sub], W[sub] = M_sub, W_sub
        start = end


# -- the optimizer -----------------------------------------------------------------------------

EXPERT_ROLES = ("expert_down", "expert_up", "expert_gate")  # V4's order of the flat expert vector
ROLES = ("dense",) + EXPERT_ROLES + ("adamw",)


class MuonZeRO(torch.optim.Optimizer):
    """Muon for matrices and expert stacks, AdamW for the rest, ZeRO-sharded the way V4 does it.

    Param groups carry a `role`: "dense" (2-D matrices), "expert_down" / "expert_up" /
    "expert_gate" (3-D stacks [E, n, m], each expert its own matrix) or "adamw" (see
    muon_param_groups). Every rank calls backward() on its own micro-batch and then step(): the
    optimizer averages gradients over the process group, updates the matrices this rank owns and
    gathers the results, so every rank ends with identical parameters. The constructor and step()
    are collectives: call them on all ranks. state_dict() is local (this rank's share);
    gather_state_dict() is the collective one.

    lr, momentum, weight_decay, nesterov: as torch.optim.Muon (momentum kept in its lerp form).
    ns_coefficients: one (a, b, c) per Newton-Schulz iteration; ns_dtype: NS precision (V4: bf16).
    update_rms: target RMS of each matrix's update (V4: 0.18; torch's "match_rms_adamw": 0.2).
    betas, eps: AdamW's, for role="adamw" groups (which can set their own lr and weight_decay).
    zero_width: ranks that share the dense matrices (default: all); must divide the group's size.
    grad_sync: "bf16_sr" (V4: stochastic rounding to bf16, all-to-all, fp32 sum) or "fp32"
        (exact), for every all-to-all; the cross-replica sum of dense buckets is an fp32 all-reduce.
    process_group: the data-parallel group (default: the world; no group at all: one process).
    balance: dense packing objective, see pack_dense. seed: base seed of the rounding noise.
    Parameters must be float32 and on one device (mixed precision keeps fp32 master weights).
    """

    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=True,
                 ns_coefficients=V4_NS_COEFFICIENTS, ns_dtype=torch.bfloat16, update_rms=0.18,
                 betas=(0.9, 0.95), eps=1e-8, zero_width=None, grad_sync="bf16_sr",
                 process_group=None, balance="both", seed=0):  # fmt: skip
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, ns_dtype=ns_dtype, update_rms=update_rms,
                        betas=betas, eps=eps, role="dense")  # fmt: skip
        super().__init__(params, defaults)
        if process_group is None and dist.is_initialized():
            process_group = dist.group.WORLD
        self.group = process_group
        self.world_size = dist.get_world_size(process_group) if process_group is not None else 1
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.grad_sync = grad_sync
        self.params = [p for g in self.param_groups for p in g["params"]]
        # Every check runs on every rank, then one agreement collective: all ranks raise together.
        error = validate(self, zero_width, balance)
        agree_across_ranks(self.group, agreement_fields(self, zero_width, balance), error)
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
        self.zero_width = self.plan.zero_width
        shard_group, replica_group = build_groups(self.group, self.world_size, self.zero_width)
        me, position = self.rank, self.plan.position(self.rank)
        dense = [lay_out([self.dense_matrices[i] for i in b]) for b in self.plan.dense_buckets]
        experts = [lay_out(self.expert_matrices[a:b]) for a, b in self.plan.expert_ranges]
        self.shards = {  # dense: a reduce-scatter over my replica; experts: over every rank
            "dense": Shards([c for c, _ in dense], self.plan.dense_bucket_numel, position,
                            make_runs(dense[position][0]), shard_group, self.zero_width,
                            replica_group),
            "experts": Shards([c for c, _ in experts], self.plan.expert_chunk_numel, me,
                              make_runs(experts[me][0]) if experts else [], self.group,
                              self.world_size),
        }  # fmt: skip
        self._momentum = None  # created lazily in the first step(), like torch's optimizers
        self._sr_generator = torch.Generator(device=self.device).manual_seed(seed * 65537 + me)

    def _params_of(self, roles):
        """(index into self.params, parameter, param-group index) of the groups with these roles."""
        index = {id(p): i for i, p in enumerate(self.params)}
        return [(index[id(p)], p, k) for k, g in enumerate(self.param_groups)
                if g["role"] in roles for p in g["params"]]  # fmt: skip

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        has_grad = agreed_grad_mask(self)  # one small all-reduce; re-checks settings across ranks
        if not any(has_grad):
            return loss
        if self._momentum is None:
            self._momentum = {kind: [torch.zeros(r.count, *r.shape, device=self.device)
                                     for r in shards.runs]
                              for kind, shards in self.shards.items()}  # fmt: skip
        adamw_step(self, has_grad)
        grads, params = [p.grad for p in self.params], [p.detach() for p in self.params]
        settings = [MuonSettings.of(g) for g in self.param_groups]
        for kind, matrices in (("dense", self.dense_matrices), ("experts", self.expert_matrices)):
            if matrices:  # the same on every rank: one owning none still joins the collectives
                sharded_step(self.shards[kind], grads, params, self._momentum[kind], settings,
                             has_grad, self.world_size, self.grad_sync,
                             self._sr_generator)  # fmt: skip
        return loss

    def add_param_group(self, param_group):
        if getattr(self, "plan", None) is not None:
            raise ValueError("MuonZeRO plans ownership once, at construction: pass every group")
        super().add_param_group(param_group)

    # checkpoints and memory: see the appendix
    def state_dict(self):
        return local_state_dict(self)

    def gather_state_dict(self):
        return gather_state_dict(self)

    def load_state_dict(self, state_dict):
        load_state_dict(self, state_dict)

    def local_state_tensors(self):
        return local_state_tensors(self)

    def state_bytes(self):
        return sum(t.numel() * t.element_size() for t in local_state_tensors(self))


def adamw_step(opt, has_grad):
    """AdamW is element-wise, so plain data parallelism is exact: all-reduce, every rank steps."""
    index = {id(p): i for i, p in enumerate(opt.params)}
    todo = [(p, g) for g in opt.param_groups if g["role"] == "adamw" for p in g["params"]]
    todo = [(p, g) for p, g in todo if has_grad[index[id(p)]]]
    if not todo:
        return
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p, _ in todo]
    )
    if opt.world_size > 1:
        dist.all_reduce(flat, group=opt.group)
    flat /= opt.world_size
    offset = 0
    for p, g in todo:
        grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
        state = opt.state[p]
        if not state:
            state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state["step"] += 1
        adamw_update(p.detach(), grad, state["exp_avg"], state["exp_avg_sq"], state["step"],
                     lr=g["lr"], betas=g["betas"], eps=g["eps"],
                     weight_decay=g["weight_decay"])  # fmt: skip


# ---- appendix: roles, groups, agreement guard, validation, checkpoints, reporting, demo ----


OUTPUT_HEAD_NAMES = ("head", "lm_head", "output", "output_layer")  # nanoGPT, HF, titan, Megatron


def muon_param_groups(model, adamw_names=OUTPUT_HEAD_NAMES, expert_roles=None):
    """Split `model`'s parameters into MuonZeRO param groups, one per role, by what each tensor is.

    AdamW (V4): embeddings (nn.Embedding weights and anything tied to them), the output head (HF's
    get_output_embeddings(), or a module named as in `adamw_names`: a dotted prefix such as
    "model.proj" or a module name such as "lm_head" anywhere in the path), tensors a module
    declares non-Muon (a `no_muon` or `_adamw_params` set of its parameter names, or
    `tensor.no_muon = True`), static biases (a name starting with "bias", such as mHC's 2-D
    bias_res) and every tensor with fewer than 2 dims (norms, biases, gates).
    Muon: every other matrix. 3-D tensors are expert stacks [E, n, m]; their role (down/up/gate)
    comes from `expert_roles[name]` or a name token ("w_down", "up_proj", "gate"). A 3-D tensor
    whose role cannot be told raises instead of falling silently to AdamW.
    """
    expert_roles = dict(expert_roles or {})
    adamw_ids = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            adamw_ids.add(id(module.weight))
        declared = set(getattr(module, "no_muon", ())) | set(getattr(module, "_adamw_params", ()))
        adamw_ids |= {id(p) for n, p in module.named_parameters(recurse=False) if n in declared}
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if isinstance(head, nn.Module):
        adamw_ids |= {id(p) for p in head.parameters()}

    def named_adamw(name):  # exact module names, never a substring ("output" is not "output_gate")
        modules = name.split(".")[:-1]
        return any(name.startswith(a + ".") or a in modules for a in adamw_names)

    by_role = {role: [] for role in ROLES}
    for name, p in model.named_parameters():
        local = name.rsplit(".", 1)[-1]
        if (
            id(p) in adamw_ids
            or getattr(p, "no_muon", False)
            or named_adamw(name)
            or local.startswith("bias")
            or p.ndim < 2
        ):
            by_role["adamw"].append(p)
        elif p.ndim == 2:
            by_role["dense"].append(p)
        elif p.ndim == 3:
            role = expert_roles.get(name)
            if role is None:
                tokens = set(name.replace(".", "_").split("_"))
                found = [r for r in EXPERT_ROLES if r.split("_")[1] in tokens]
                if len(found) != 1:
                    raise ValueError(
                        f"expert stack {name!r} {tuple(p.shape)}: cannot tell whether it is a "
                        f"down, up or gate projection from its name; pass "
                        f"expert_roles={{{name!r}: 'expert_down'}} (or _up / _gate)"
                    )
                role = found[0]
            if role not in EXPERT_ROLES:
                raise ValueError(f"expert_roles[{name!r}] = {role!r}; use one of {EXPERT_ROLES}")
            by_role[role].append(p)
        else:
            raise ValueError(
                f"parameter {name!r} has {p.ndim} dims; Muon handles matrices [n, m] and expert "
                f"stacks [E, n, m] only"
            )
    return [{"params": ps, "role": role} for role, ps in by_role.items() if ps]


def build_groups(group, world_size, zero_width):
    """(shard group, replica group) of this rank.  Ranks r // Z share a replica (the reduce-scatter
    peers); ranks r % Z share a position (the cross-replica all-reduce). Only members create a
    group (local synchronisation), so a data-parallel subgroup of a wider world works."""
    if zero_width == world_size:
        return group, None
    rank, Z = dist.get_rank(group), zero_width

    def new_group(ranks):
        members = [dist.get_global_rank(group, r) for r in ranks]
        return dist.new_group(members, use_local_synchronization=True)

    start = rank // Z * Z
    shard = group if Z == world_size else (new_group(range(start, start + Z)) if Z > 1 else None)
    replica = new_group(range(rank % Z, world_size, Z))
    return shard, replica


def _describe(value):
    """A canonical, exact text for a hyperparameter (floats by repr: 0.1 is not 0.1000001)."""
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return repr(value)


def agreement_fields(opt, zero_width, balance, values=True):
    """Everything that must agree across ranks, as readable text per field, in a fixed order."""
    fields = {
        "zero_width": repr(zero_width),
        "balance": repr(balance),
        "grad_sync": repr(opt.grad_sync),
        "number of param groups": repr(len(opt.param_groups)),
    }
    for k, g in enumerate(opt.param_groups):
        fields[f"param group {k} parameter shapes"] = repr([tuple(p.shape) for p in g["params"]])
        fields[f"param group {k} dtypes"] = repr([str(p.dtype) for p in g["params"]])
        for key in sorted(g):
            if key != "params":
                fields[f"param group {k} {key}"] = _describe(g[key])
        if values:  # a cheap checksum of the initial values: replicas must start equal
            for j, p in enumerate(g["params"]):
                t = p.detach().double()
                sums = (t.sum().item(), t.abs().sum().item(), (t * t).sum().item())
                fields[f"initial values of param group {k} parameter {j}"] = repr(sums)
    return fields


def agree_across_ranks(group, fields, error=None):
    """The agreement guard: gather every rank's fields and local error; raise the same ValueError
    on every rank if any rank failed its own checks or a field differs (naming it and the ranks)."""
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        if error:
            raise ValueError(error)
        return
    everyone = [None] * world
    dist.all_gather_object(everyone, (error, fields), group=group)
    failed = [(r, e) for r, (e, _) in enumerate(everyone) if e]
    if failed:
        text = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise ValueError(f"MuonZeRO refused on {len(failed)} of {world} rank(s): {text}")
    for name in everyone[0][1]:
        seen = {}
        for r, (_, f) in enumerate(everyone):
            seen.setdefault(f.get(name, "(missing)"), []).append(r)
        if len(seen) > 1:
            parts = [
                f"rank {','.join(map(str, rs))} {'have' if len(rs) > 1 else 'has'} {v}"
                for v, rs in seen.items()
            ]
            raise ValueError(f"{name} differs across ranks: {'; '.join(parts)}")


def _digest(fields):
    """56 bits of sha256 over the fields: fits an int64 and its negation."""
    text = repr(sorted(fields.items()))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def agreed_grad_mask(opt):
    """Which parameters have a gradient on at least one rank, and a re-check of what was agreed.

    One all-reduce (MAX) of [has grad per parameter, digest, -digest, local error]: a gradient that
    is None on some ranks counts as zero there; None everywhere skips the parameter on every rank.
    If the settings' digest differs anywhere (an lr changed on one rank), or a rank's parameters
    changed shape, dtype or device since construction, every rank runs the full guard, which
    raises the same error everywhere."""
    fields = agreement_fields(opt, opt.zero_width, "-", values=False)
    digest = _digest(fields)
    error = None
    for i, (built, p) in enumerate(zip(opt._built_for, opt.params)):
        now = (tuple(p.shape), p.dtype, p.device)
        if now != built:
            error = (f"parameter {i} is now {now[0]} {now[1]} on {now[2]}, but MuonZeRO was built "
                     f"for {built[0]} {built[1]} on {built[2]}: build the optimizer after moving "
                     f"or converting the model")  # fmt: skip
            break
    mask = [p.grad is not None for p in opt.params] + [digest, -digest, error is not None]
    mask = torch.tensor(mask, dtype=torch.int64, device=opt.device)
    if opt.world_size > 1:
        dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=opt.group)
    if mask[-3].item() != -mask[-2].item() or mask[-1].item():
        agree_across_ranks(opt.group, fields, error)
    return mask[:-3].bool().tolist()


def _finite(x, low, high=math.inf, low_open=False, high_open=False):
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return False
    return (x > low if low_open else x >= low) and (x < high if high_open else x <= high)


def _check_group(k, g):
    """The first problem with param group k's role, tensors or hyperparameters, or None."""
    where = f"param group {k}"
    if g["role"] not in ROLES:
        return f"{where}: role {g['role']!r} is not one of {ROLES}"
    if not _finite(g["lr"], 0):
        return f"{where}: lr must be a finite number >= 0, got {g['lr']!r}"
    if not _finite(g["momentum"], 0, 1, high_open=True):
        return f"{where}: momentum must lie in [0, 1), got {g['momentum']!r}"
    if not _finite(g["weight_decay"], 0):
        return f"{where}: weight_decay must be a finite number >= 0, got {g['weight_decay']!r}"
    if not _finite(g["update_rms"], 0, low_open=True):
        return f"{where}: update_rms must be a finite number > 0, got {g['update_rms']!r}"
    if not _finite(g["eps"], 0, low_open=True):
        return f"{where}: eps must be a finite number > 0, got {g['eps']!r}"
    betas = g["betas"]
    if len(betas) != 2 or not all(_finite(b, 0, 1, high_open=True) for b in betas):
        return f"{where}: betas must be two numbers in [0, 1), got {betas!r}"
    coefficients = g["ns_coefficients"]
    if not coefficients or not all(
        len(c) == 3 and all(_finite(x, -math.inf) for x in c) for c in coefficients
    ):
        return (
            f"{where}: ns_coefficients must be one or more finite (a, b, c), got {coefficients!r}"
        )
    if not (isinstance(g["ns_dtype"], torch.dtype) and g["ns_dtype"].is_floating_point):
        return f"{where}: ns_dtype must be a floating torch dtype, got {g['ns_dtype']!r}"
    for p in g["params"]:
        shape = tuple(p.shape)
        if p.dtype != torch.float32:
            return (
                f"{where}: a {p.dtype} tensor {shape}; MuonZeRO updates float32 parameters "
                f"(its buffers are fp32): keep fp32 master weights, e.g. model.float()"
            )
        if p.numel() == 0:
            return f"{where}: an empty tensor {shape}; leave it out of the optimizer"
        if g["role"] == "dense" and p.ndim == 3:
            return (
                f"{where}: a 3-D stack {shape} was declared 'dense' (expert role missing); give "
                f"it role 'expert_down', 'expert_up' or 'expert_gate' so each expert is its own "
                f"Muon matrix (muon_param_groups does this by name)"
            )
        if g["role"] == "dense" and p.ndim != 2:
            return (
                f"{where}: a {p.ndim}-D tensor {shape} was declared a Muon matrix; Muon needs "
                f"[n, m]. Put it in a role='adamw' group (muon_param_groups does)"
            )
        if g["role"] in EXPERT_ROLES and p.ndim != 3:
            return (
                f"{where}: role {g['role']!r} needs an expert stack [E, n, m], got {shape}; "
                f"a single matrix belongs in a 'dense' group"
            )
    return None


def validate(opt, zero_width, balance):
    """Every local check, on this rank alone (no collective).  -> the first error text, or None."""
    if opt.rank < 0:
        return "this rank is not a member of process_group; build MuonZeRO only on its members"
    if opt.grad_sync not in ("fp32", "bf16_sr"):
        return f"grad_sync must be 'fp32' (exact) or 'bf16_sr' (V4's), got {opt.grad_sync!r}"
    if balance not in ("ns_cost", "numel", "both"):
        return f"balance must be 'ns_cost', 'numel' or 'both', got {balance!r}"
    if zero_width is not None and (
        not isinstance(zero_width, int) or zero_width < 1 or opt.world_size % zero_width
    ):
        divisors = [d for d in range(1, opt.world_size + 1) if opt.world_size % d == 0]
        return (
            f"zero_width={zero_width} must divide the data-parallel size {opt.world_size}: "
            f"ranks form {opt.world_size}/zero_width replica groups; pick one of {divisors}"
        )
    for k, g in enumerate(opt.param_groups):
        error = _check_group(k, g)
        if error:
            return error
    devices = {p.device for p in opt.params}
    if len(devices) > 1:
        return f"parameters sit on several devices {sorted(map(str, devices))}; use one device"
    return None


# -- checkpoints: state_dict() is local, gather_state_dict() is the collective -----------------


def _param_group_entries(opt):
    groups, start = [], 0
    for g in opt.param_groups:
        entry = {k: v for k, v in g.items() if k != "params"}
        groups.append({**entry, "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    return groups


def _adamw_state(opt):
    return {
        i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
        for i, p in enumerate(opt.params)
        if opt.state.get(p)
    }


def local_state_dict(opt):
    """This rank's optimizer state, no collective (safe under `if rank == 0`).

    AdamW moments (replicated, so complete) and the momentum of the Muon matrices this rank owns,
    keyed by parameter index: a dense matrix's full buffer; for an expert stack a buffer of the
    stack's shape with the owned experts filled and their indices under "experts". Loading it back
    at the same world size and zero width resumes exactly; to resume elsewhere save
    gather_state_dict() instead.
    """
    state = _adamw_state(opt)
    for kind in ("dense", "experts"):
        for run, M in zip(opt.shards[kind].runs, (opt._momentum or {}).get(kind, [])):
            for k, s in enumerate(run.slots):
                if s.expert is None:
                    state[s.param] = {"momentum_buffer": M[k].clone()}
                else:
                    entry = state.setdefault(
                        s.param,
                        {"momentum_buffer": torch.zeros_like(opt.params[s.param]), "experts": []},
                    )
                    entry["momentum_buffer"][s.expert] = M[k]
                    entry["experts"].append(s.expert)
    return {"state": state, "param_groups": _param_group_entries(opt)}


def gather_state_dict(opt):
    """Every parameter's full state on every rank (a collective: call it on all ranks).
    World-size independent: load it at any world size and zero width."""
    state = _adamw_state(opt)
    if opt._momentum is not None:
        full = [torch.zeros_like(p) for p in opt.params]
        for kind in ("dense", "experts"):
            shards = opt.shards[kind]
            if not (opt.dense_matrices if kind == "dense" else opt.expert_matrices):
                continue
            chunk = torch.zeros(shards.chunk_numel, device=opt.device)
            for run, M in zip(shards.runs, opt._momentum[kind]):
                chunk[run.offset : run.offset + run.numel] = M.flatten()
            gathered = all_gather_chunks(chunk, shards.group, shards.peers)
            unpack(gathered, shards.chunks, full)
        for s in opt.dense_matrices + opt.expert_matrices:
            state[s.param] = {"momentum_buffer": full[s.param]}
    return {"state": state, "param_groups": _param_group_entries(opt)}


def _as_group_value(key, value):
    """Undo what a text round trip does to a hyperparameter (lists for tuples, dtype names)."""
    if key == "ns_dtype" and isinstance(value, str):
        return getattr(torch, value.replace("torch.", ""))
    if key in ("betas", "ns_coefficients") and isinstance(value, list):
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return value


def load_state_dict(opt, state_dict):
    """Load a gathered state_dict (any world size and zero width) or this rank's own local one.
    Keys may be ints or their strings; momentum this rank needs but the dict lacks raises."""
    saved = state_dict["param_groups"]
    if [len(g["params"]) for g in saved] != [len(g["params"]) for g in opt.param_groups]:
        raise ValueError(
            "state_dict has a different number of param groups or parameters per group"
        )
    state = {}
    for key, value in state_dict["state"].items():
        try:
            state[int(key)] = value
        except (TypeError, ValueError):
            raise ValueError(f"state_dict key {key!r} is not a parameter index") from None
    for k, (g, s) in enumerate(zip(opt.param_groups, saved)):
        if g["role"] != s["role"]:
            raise ValueError(
                f"state_dict group {k} role {s['role']!r} does not match {g['role']!r}"
            )
        new = {**g, **{key: _as_group_value(key, v) for key, v in s.items() if key != "params"}}
        error = _check_group(k, new)
        if error:
            raise ValueError(f"state_dict: {error}")
    mine = [s for kind in ("dense", "experts") for run in opt.shards[kind].runs for s in run.slots]
    has_momentum = any("momentum_buffer" in s for s in state.values())
    missing = [
        s
        for s in mine
        if "momentum_buffer" not in state.get(s.param, {})
        or s.expert not in state[s.param].get("experts", [s.expert])
    ]
    if has_momentum and missing:
        names = ", ".join(
            f"parameter {s.param}" + ("" if s.expert is None else f" expert {s.expert}")
            for s in missing[:4]
        )
        raise ValueError(
            f"state_dict holds no momentum for {len(missing)} matrices this rank owns ({names}): "
            f"a state_dict() holds one rank's share; save gather_state_dict() to resume at another "
            f"world size or zero width"
        )
    for g, s in zip(opt.param_groups, saved):
        g.update({key: _as_group_value(key, v) for key, v in s.items() if key != "params"})
    opt.state.clear()
    for i, p in enumerate(opt.params):
        s = state.get(i)
        if s and "exp_avg" in s:
            opt.state[p] = {
                k: torch.as_tensor(v, dtype=p.dtype, device=p.device).clone() if k != "step" else v
                for k, v in s.items()
            }
    opt._momentum = None
    if has_momentum:
        opt._momentum = {}
        for kind in ("dense", "experts"):
            buffers = []
            for run in opt.shards[kind].runs:
                rows = []
                for s in run.slots:
                    full = torch.as_tensor(state[s.param]["momentum_buffer"], dtype=torch.float32)
                    rows.append(full if s.expert is None else full[s.expert])
                buffers.append(torch.stack(rows).to(opt.device))
            opt._momentum[kind] = buffers


def local_state_tensors(opt):
    """The state tensors this rank holds: its stacked Muon momenta and the AdamW moments."""
    muon = [M for ms in (opt._momentum or {}).values() for M in ms]
    return muon + [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]


# -- reporting ---------------------------------------------------------------------------------


def plan_rows(plan):
    """One dict per rank: matrices, elements, padding, NS cost and NS calls (same-shape runs)."""
    rows, bucket_numel, chunk_numel = [], plan.dense_bucket_numel, plan.expert_chunk_numel
    for r in range(plan.world_size):
        dense, experts = plan.owned(r)
        shapes = [plan.dense_shapes[i] for i in dense] + [plan.expert_shapes[i] for i in experts]
        dense_numel = sum(math.prod(plan.dense_shapes[i]) for i in dense)
        expert_numel = sum(math.prod(plan.expert_shapes[i]) for i in experts)
        rows.append(
            dict(
                rank=r,
                replica=r // plan.zero_width,
                position=plan.position(r),
                dense=len(dense),
                experts=len(experts),
                numel=dense_numel + expert_numel,
                dense_padding=bucket_numel - dense_numel,
                expert_padding=chunk_numel - expert_numel,
                ns_cost=sum(ns_cost(s) for s in shapes),
                shape_runs=sum(1 for i, s in enumerate(shapes) if i == 0 or s != shapes[i - 1]),
            )
        )
    return rows


def plan_summary(plan):
    """Whole-plan figures: max matrices per rank, padding fractions, NS-cost imbalance."""
    rows = plan.rows()
    dense_total = sum(n * m for n, m in plan.dense_shapes)
    expert_total = sum(n * m for n, m in plan.expert_shapes)
    dense_costs = [sum(ns_cost(plan.dense_shapes[i]) for i in b) for b in plan.dense_buckets]
    dense_pad = plan.zero_width * plan.dense_bucket_numel - dense_total
    expert_pad = plan.world_size * plan.expert_chunk_numel - expert_total
    return dict(
        max_dense_per_rank=max(r["dense"] for r in rows),
        max_experts_per_rank=max(r["experts"] for r in rows),
        dense_padding=dense_pad / max(dense_total, 1),
        expert_padding=expert_pad / max(expert_total, 1),
        dense_imbalance=max(dense_costs) / max(sum(dense_costs) / len(dense_costs), 1),
    )


PLAN_COLUMNS = (  # (header, key, format): what each column counts
    ("rank", "rank", ""),
    ("replica", "replica", ""),
    ("pos", "position", ""),
    ("dense mats", "dense", ""),
    ("expert mats", "experts", ""),
    ("elements owned", "numel", ","),
    ("dense pad elems", "dense_padding", ","),
    ("expert pad elems", "expert_padding", ","),
    ("NS MACs/iter", "ns_cost", ".3g"),
    ("NS calls", "shape_runs", ""),
)


def format_plan(plan):
    """A printable table, one line per rank (elements and padding in matrix entries, not bytes)."""
    widths = [max(len(h), 6) for h, _, _ in PLAN_COLUMNS]
    lines = [" ".join(h.rjust(w) for (h, _, _), w in zip(PLAN_COLUMNS, widths))]
    for r in plan.rows():
        cells = [format(r[key], fmt) for _, key, fmt in PLAN_COLUMNS]
        lines.append(" ".join(c.rjust(w) for c, w in zip(cells, widths)))
    return "\n".join(lines)


# ---- set-up: the same block in every technique file, copied so each file stands alone ----


def choose_backend(backend=None, device=None):
    """Pick (backend, device type) for this launch and say why, in one line.

    Defaults: NCCL on CUDA when every local rank can have a GPU of its own, else gloo on the CPU.
    gloo with --device cuda lets several ranks share a GPU (a one-GPU machine can run N = 4).
    Refuses combinations that cannot work, before any process group exists.
    """
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"--backend must be gloo or nccl, got {backend!r}")
    if device is None:
        device = "cuda" if backend != "gloo" and 0 < local_ranks <= gpus else "cpu"
        if device == "cuda":
            why = f"{gpus} GPU(s) for {local_ranks} local rank(s)"
        elif backend == "gloo" or gpus == 0:
            why = "--backend gloo" if backend == "gloo" else "no GPU visible"
        else:
            why = f"{gpus} GPU(s) are too few for {local_ranks} local ranks"
    else:
        why = f"--device {device}"
    if device == "cuda" and gpus == 0:
        raise ValueError("--device cuda: no CUDA GPU is visible; pass --device cpu")
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if backend == "nccl" and device != "cuda":
        raise ValueError("--backend nccl moves only CUDA tensors: pass --device cuda, or gloo")
    if backend == "nccl" and local_ranks > gpus:
        raise ValueError(
            f"NCCL needs one GPU per local rank: {local_ranks} ranks, {gpus} GPU(s); "
            "launch fewer ranks, or pass --backend gloo to share GPUs"
        )
    return backend, device, f"backend {backend}, device {device} ({why})"


def setup(backend=None, device=None, seed=0, timeout_s=120):
    """Join torchrun's process group, or make a group of one when run as plain `python FILE`.

    Returns (rank, world_size, device). The CUDA device is set before the group is created, so
    NCCL binds each rank to its own GPU.
    """
    backend, device_type, why = choose_backend(backend, device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count() if device_type == "cuda" else 1
    dev = torch.device("cuda", local_rank % gpus) if device_type == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ:  # launched by torchrun: its environment carries the rendezvous
        dist.init_process_group(
            backend, timeout=timeout, device_id=dev if backend == "nccl" else None
        )
    else:  # plain `python FILE`: a group of one, no network
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    torch.manual_seed(seed)
    if dist.get_rank() == 0:
        print(f"[setup] {dist.get_world_size()} rank(s), {why}", flush=True)
    return dist.get_rank(), dist.get_world_size(), dev


def teardown():
    """Collect cycles that hold communicators, then destroy the group (torch warns otherwise)."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


# -- the demo: a small MoE transformer trained on every rank's slice of the batch --------------


class TinyMoE(nn.Module):
    """Embedding -> [attention + top-2 MoE of SwiGLU experts] x layers -> head. Dense matrices of
    several shapes (square, wide, tall) plus 3-D expert stacks [E, n, m]."""

    def __init__(self, vocab=64, dim=48, heads=4, kv_dim=16, layers=2, experts=6, ffn=32, top_k=2):
        super().__init__()
        self.heads, self.kv_dim, self.top_k = heads, kv_dim, top_k
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            layer.attn_norm, layer.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
            layer.wq = nn.Parameter(torch.randn(heads * kv_dim, dim) / dim**0.5)  # tall [64, 48]
            layer.wkv = nn.Parameter(torch.randn(2 * kv_dim, dim) / dim**0.5)  # wide [32, 48]
            layer.wo = nn.Parameter(torch.randn(dim, heads * kv_dim) / dim**0.5)  # wide [48, 64]
            layer.router = nn.Parameter(torch.randn(experts, dim) / dim**0.5)
            layer.w_gate = nn.Parameter(torch.randn(experts, ffn, dim) / dim**0.5)
            layer.w_up = nn.Parameter(torch.randn(experts, ffn, dim) / dim**0.5)
            layer.w_down = nn.Parameter(torch.randn(experts, dim, ffn) / ffn**0.5)
            self.layers.append(layer)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        B, T, D = x.shape
        for L in self.layers:
            h = L.attn_norm(x)
            q = (h @ L.wq.T).view(B, T, self.heads, self.kv_dim).transpose(1, 2)  # [B, H, T, kv]
            k, v = (h @ L.wkv.T).split(self.kv_dim, dim=-1)  # one shared KV head
            k = k.unsqueeze(1).expand(-1, self.heads, -1, -1)
            v = v.unsqueeze(1).expand(-1, self.heads, -1, -1)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + att.transpose(1, 2).reshape(B, T, -1) @ L.wo.T
            h = L.ffn_norm(x)
            weights, chosen = (h @ L.router.T).softmax(-1).topk(self.top_k, dim=-1)
            gates = torch.zeros(B, T, L.router.size(0), device=x.device)
            gates = gates.scatter(-1, chosen, weights)  # 0 for the experts not chosen
            up = torch.einsum("btd,efd->btef", h, L.w_up)
            hidden = F.silu(torch.einsum("btd,efd->btef", h, L.w_gate)) * up
            x = x + torch.einsum("btef,edf,bte->btd", hidden, L.w_down, gates)
        return self.head(self.norm(x))


def demo_batch(batch, seq, vocab, generator):
    """Sequences t_{i+1} = (5 t_i + 3) mod vocab from a random start: learnable next-token data."""
    tokens = torch.randint(0, vocab, (batch, 1), generator=generator, device="cpu")
    for _ in range(seq):
        tokens = torch.cat([tokens, (5 * tokens[:, -1:] + 3) % vocab], dim=1)
    return tokens[:, :-1], tokens[:, 1:]


def default_zero_width(world):
    """Half the ranks for even N > 2 (so replica groups show), else all of them."""
    return world // 2 if world % 2 == 0 and world > 2 else world


def parse_args(argv=None):
    """The demo's options, every one checked before any work (one-line errors)."""
    parser = argparse.ArgumentParser(
        description="Train a small MoE model with MuonZeRO (V4 §3.4.1) on every rank; print the "
        "ownership plan, the loss, optimizer-state bytes per rank and a replica check.",
    )
    parser.add_argument(
        "--steps", type=int, default=40, help="optimizer steps to train (default: %(default)s)"
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="global batch in sequences, split evenly over the ranks (default: 24, "
        "or the next multiple of the rank count)",
    )
    parser.add_argument(
        "--seq", type=int, default=16, help="tokens per sequence (default: %(default)s)"
    )
    parser.add_argument(
        "--zero-width",
        type=int,
        default=None,
        help="ranks that share the dense matrices; must divide N (default: N/2 "
        "for even N > 2, else N)",
    )
    parser.add_argument(
        "--grad-sync",
        choices=("bf16_sr", "fp32"),
        default="bf16_sr",
        help="gradient exchange: V4's bf16 stochastic rounding, or exact fp32 "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=0.02,
        help="Muon learning rate; AdamW tensors use 3e-3 (default: %(default)s)",
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="collective backend (default: nccl when every rank has a GPU, else gloo)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where tensors live (default: cuda with nccl, else cpu)",
    )
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.seq < 1:
        parser.error(f"--seq must be >= 1, got {args.seq}")
    if args.batch is None:
        args.batch = -(-24 // world) * world  # 24 rounded up to a multiple of N: no sample dropped
    elif args.batch < 1 or args.batch % world:
        parser.error(
            f"--batch {args.batch} does not split evenly over {world} ranks (it would drop "
            f"samples); pass a multiple of {world}, e.g. {-(-max(args.batch, 1) // world) * world}"
        )
    if args.zero_width is None:
        args.zero_width = default_zero_width(world)
    elif args.zero_width < 1 or world % args.zero_width:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        parser.error(
            f"--zero-width {args.zero_width} must divide the {world} ranks: one of {divisors}"
        )
    if not _finite(args.lr, 0, low_open=True):
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    try:
        choose_backend(args.backend, args.device)
    except ValueError as e:
        parser.error(str(e))
    return args


def train(args, rank, world, device):
    say = print if rank == 0 else (lambda *a, **k: None)
    start = time.perf_counter()
    model = TinyMoE().to(device)  # setup() seeded every rank alike: the same initial model
    opt = MuonZeRO(
        muon_param_groups(model), lr=args.lr, zero_width=args.zero_width, grad_sync=args.grad_sync
    )
    for g in opt.param_groups:
        if g["role"] == "adamw":
            g["lr"] = 3e-3
    say(
        f"MuonZeRO on {world} rank(s), zero width {opt.zero_width} -> "
        f"{world // opt.zero_width} replica group(s); {len(opt.dense_matrices)} dense matrices, "
        f"{len(opt.expert_matrices)} expert matrices; the plan (counts in matrix elements):"
    )
    say(opt.plan.format())
    data = torch.Generator(device="cpu").manual_seed(1)
    per_rank = args.batch // world
    say(f"global batch {args.batch} sequences = {per_rank} per rank x {world}, {args.seq} tokens")
    for step in range(1, args.steps + 1):
        x, y = demo_batch(args.batch, args.seq, 64, data)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        x, y = x[mine].to(device), y[mine].to(device)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if step % 5 == 1 or step == args.steps:
            say(
                f"step {step:3d}  loss {mean_loss.item() / world:.4f}  "
                f"({time.perf_counter() - start:.1f} s)"
            )

    muon_bytes = 4 * sum(
        p.numel() for g in opt.param_groups if g["role"] != "adamw" for p in g["params"]
    )
    adam_bytes = 8 * sum(
        p.numel() for g in opt.param_groups if g["role"] == "adamw" for p in g["params"]
    )
    held = torch.tensor([float(opt.state_bytes())], device=device)
    per_rank_bytes = all_gather_chunks(held, None, world).flatten().tolist()
    say(
        f"optimizer state held per rank (bytes): {[int(b) for b in per_rank_bytes]}  vs unsharded "
        f"{muon_bytes + adam_bytes:,} (Muon momentum {muon_bytes:,} + AdamW moments "
        f"{adam_bytes:,})"
    )
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = all_gather_chunks(flat, None, world)
    same = all(torch.equal(everyone[0], everyone[r]) for r in range(world))
    say(f"parameters bitwise identical on all {world} ranks: {same}")
    if not same:
        raise SystemExit("replicas diverged")


def main():
    args = parse_args()
    rank, world, device = setup(args.backend, args.device, seed=0)
    try:
        train(args, rank, world, device)  # returns before teardown: its optimizer and groups die
    finally:
        teardown()


if __name__ == "__main__":
    main()
