"""Muon under ZeRO, as DeepSeek-V4 shards it (V4 §3.4.1; the optimizer itself is V4 §2.4, Algorithm 1).

What the standard tool assumes. ZeRO shards optimizer state by cutting the flat parameter vector into
equal pieces, one per data-parallel rank. That is exact for AdamW: the update of element i depends only
on the gradient history of element i, so any cut gives the same result.

What V4's design violates. Muon's update is a property of the whole matrix: Newton-Schulz
orthogonalises the momentum, mixing every row with every column. A rank holding a third of a matrix
holds no third of its update; it must see the whole matrix or nothing.

The fix (V4 §3.4.1), one section each below:
  1. the optimizer math: Nesterov momentum, Newton-Schulz in BF16 on the Frobenius-normalised matrix,
     update RMS rescaling, decoupled weight decay; AdamW only for embeddings, head and non-matrices.
  2. dense matrices: whole matrices are packed largest-first into `zero_width` buckets (the width
     cap), balanced on Newton-Schulz cost and elements, and padded to the largest so the sync inside
     a replica group is a plain reduce-scatter. Data parallelism wider than the cap makes replica
     groups that sum each bucket across groups and then compute the same updates redundantly.
  3. MoE experts: every expert is its own matrix; all down-projections of all layers, then all ups,
     then all gates form one vector, split over every rank without cutting a matrix. Gradients go
     through BF16 stochastic rounding, an all-to-all, and an FP32 local sum.
  4. same-shape neighbours on a rank form one stacked momentum buffer and one batched NS call.

Run it:
    torchrun --nproc_per_node=4 muon_zero.py      # CPU: gloo, 4 ranks (zero width 2 -> 2 replica groups)
    torchrun --nproc_per_node=8 muon_zero.py      # GPUs: NCCL is picked when CUDA is available
    python muon_zero.py                           # one process, no process group
"""
import argparse
import bisect
import datetime
import gc
import hashlib
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------
# 1. The optimizer math (V4 Algorithm 1)
# ---------------------------------------------------------------------------------------------------

# One (a, b, c) triple per Newton-Schulz iteration. V4's hybrid schedule: 8 fast steps that push every
# singular value into a band around 1, then 2 steps of the classic polynomial that converges to 1 (in fp32
# the result lands within ~3e-4 of U V^T). The standard schedule (KellerJordan/Muon, torch.optim.Muon)
# stops after the 5 fast steps, leaving singular values anywhere in ~[0.7, 1.2].
V4_NS_COEFFICIENTS = ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2
STANDARD_NS_COEFFICIENTS = ((3.4445, -4.7750, 2.0315),) * 5

BF16_MAX = torch.finfo(torch.bfloat16).max


def newton_schulz(X, coefficients, dtype=torch.bfloat16, eps=1e-7):
    """Approximate the orthogonal factor U V^T of X = U S V^T.  X: [n, m] or [b, n, m] -> same shape, `dtype`.

    Each matrix is divided by its Frobenius norm (so every singular value is <= 1), tall matrices are
    transposed so the Gram matrix X X^T is the small one, then X <- aX + b(XX^T)X + c(XX^T)^2 X per triple.
    """
    if X.ndim not in (2, 3):
        raise ValueError(f"newton_schulz takes [n, m] or [b, n, m], got shape {tuple(X.shape)}")
    Y = X.to(dtype) if X.ndim == 3 else X.to(dtype).unsqueeze(0)
    tall = Y.size(-2) > Y.size(-1)
    if tall:
        Y = Y.mT
    Y = Y / Y.norm(dim=(-2, -1), keepdim=True).clamp_min(eps)
    for a, b, c in coefficients:
        gram = Y @ Y.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b·A + c·A²
        Y = torch.baddbmm(Y, poly, Y, beta=a)                     # a·X + (b·A + c·A²)·X
    if tall:
        Y = Y.mT
    return Y if X.ndim == 3 else Y.squeeze(0)


def muon_update(grad, momentum_buffer, *, momentum=0.95, nesterov=True, coefficients=V4_NS_COEFFICIENTS,
                ns_dtype=torch.bfloat16, update_rms=0.18):
    """Advance the momentum in place and return the fp32 update O.  grad, buffer: [n, m] or [b, n, m].

    V4 writes M <- mu·M + G and X = mu·M + G (Nesterov) or M. We keep the buffer as an average,
    M' = (1 - mu)·M, i.e. M' <- lerp(M', G, 1 - mu) and X' = lerp(G, M', mu) = (1 - mu)·X: the same
    direction, and NS divides by the Frobenius norm first, so the update is the same. The average has
    the gradient's scale (not 1/(1 - mu) = 20x it), and it is exactly torch.optim.Muon's buffer, so a
    checkpoint's momentum means the same thing in both.
    O = NS(X) · sqrt(max(n, m)) · update_rms: NS(X) has singular values ~1, so its RMS is
    ~1/sqrt(max(n, m)); the factor makes every matrix's update RMS equal update_rms whatever its shape
    (0.2 is torch's "match_rms_adamw").
    """
    momentum_buffer.lerp_(grad, 1 - momentum)
    X = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    n, m = X.shape[-2:]
    return newton_schulz(X, coefficients, ns_dtype).float() * (update_rms * math.sqrt(max(n, m)))


def apply_update(param, update, lr, weight_decay):
    """Decoupled weight decay then the step: W <- W·(1 - lr·wd) - lr·O.  In place; any matching shapes."""
    param.mul_(1 - lr * weight_decay).add_(update, alpha=-lr)


def adamw_update(param, grad, exp_avg, exp_avg_sq, step, *, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
    """One AdamW step (V4 keeps it for embeddings, head, norms, biases).  In place; `step` counts from 1."""
    beta1, beta2 = betas
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq / (1 - beta2 ** step)).sqrt_().add_(eps)
    param.mul_(1 - lr * weight_decay).addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))


def stochastic_round_to_bf16(x, generator=None):
    """Round fp32 to bf16 up or down at random, with E[round(x)] = x.  x: any shape fp32 -> bf16.

    bf16 is the top 16 bits of fp32. Adding a uniform random integer in [0, 2^16) to the bit pattern
    and zeroing the low 16 bits carries into the kept bits with probability (dropped bits) / 2^16,
    which is exactly the fraction of the gap x has covered: unbiased. The integer add acts on the
    magnitude bits, so negative numbers round symmetrically. NaN and ±Inf pass through unchanged;
    finite values saturate at ±bf16 max instead of carrying into Inf.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"stochastic_round_to_bf16 expects float32, got {x.dtype}")
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    rounded = ((x.view(torch.int32) + noise) & -65536).view(torch.float32)  # -65536 == 0xFFFF0000
    rounded = torch.where(torch.isfinite(x), rounded.clamp(-BF16_MAX, BF16_MAX), x)
    return rounded.to(torch.bfloat16)  # exact: the low 16 bits are already zero


# ---------------------------------------------------------------------------------------------------
# Parameter roles: which tensor V4 gives to which optimizer
# ---------------------------------------------------------------------------------------------------

EXPERT_ROLES = ("expert_down", "expert_up", "expert_gate")  # the order of V4's flattened expert vector
ROLES = ("dense",) + EXPERT_ROLES + ("adamw",)


def muon_param_groups(model, adamw_names=("head",), expert_roles=None):
    """Split `model`'s parameters into MuonZeRO param groups, one per role.

    AdamW: nn.Embedding weights, parameters whose name starts with one of `adamw_names` (the output
    head), and every tensor with fewer than 2 dims (norm weights, biases, gating scalars).
    Muon: every other matrix. 3-D tensors are expert stacks [E, n, m]; their role (down/up/gate) comes
    from `expert_roles[name]` or from a name token ("w_down", "up_proj", "gate"). A 3-D tensor whose role
    cannot be told raises instead of falling silently to AdamW.
    """
    expert_roles = dict(expert_roles or {})
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    by_role = {role: [] for role in ROLES}
    for name, p in model.named_parameters():
        if id(p) in embeddings or name.startswith(tuple(adamw_names)) or p.ndim < 2:
            by_role["adamw"].append(p)
        elif p.ndim == 2:
            by_role["dense"].append(p)
        elif p.ndim == 3:
            role = expert_roles.get(name)
            if role is None:
                tokens = set(name.replace(".", "_").split("_"))
                found = [r for r in EXPERT_ROLES if r.split("_")[1] in tokens]
                if len(found) != 1:
                    raise ValueError(f"expert stack {name!r} {tuple(p.shape)}: cannot tell whether it is a "
                                     f"down, up or gate projection from its name; pass "
                                     f"expert_roles={{{name!r}: 'expert_down'}} (or _up / _gate)")
                role = found[0]
            if role not in EXPERT_ROLES:
                raise ValueError(f"expert_roles[{name!r}] = {role!r}; use one of {EXPERT_ROLES}")
            by_role[role].append(p)
        else:
            raise ValueError(f"parameter {name!r} has {p.ndim} dims; Muon handles matrices [n, m] and "
                             f"expert stacks [E, n, m] only")
    return [{"params": ps, "role": role} for role, ps in by_role.items() if ps]


# ---------------------------------------------------------------------------------------------------
# 2. Dense matrices: hybrid ZeRO buckets
# ---------------------------------------------------------------------------------------------------

def ns_cost(shape):
    """Multiply-adds of one Newton-Schulz iteration on an [n, m] matrix (the cost model for packing).

    With s = min(n, m), l = max(n, m): X X^T is s·s·l, A·A is s³, (bA + cA²)·X is s·s·l  ->  2·s²·l + s³.
    The iteration count is the same for every matrix, so per-iteration cost ranks them correctly.
    """
    s, l = sorted(shape[-2:])
    return 2 * s * s * l + s ** 3


def pack_dense(shapes, zero_width, balance="both"):
    """Assign whole matrices to `zero_width` buckets.  shapes: list of (n, m) -> list of index lists.

    Largest-first greedy (LPT): take matrices in decreasing weight, each to the bucket where it raises
    the load least. Two loads matter: NS cost (compute: the slowest rank sets the step time) and element
    count (memory: every bucket is padded to the largest). balance="ns_cost" or "numel" balances one;
    "both" (default) balances the larger of the two, each as a fraction of its total, which keeps NS
    cost balanced without the padding a cost-only packing pays (benchmark table 1). LPT's worst case
    on one load is 4/3 of the optimum and close to optimal when matrices outnumber buckets. Within a
    bucket matrices are ordered by shape, so identical shapes sit together and share one batched NS call.
    """
    if balance not in ("ns_cost", "numel", "both"):
        raise ValueError(f"balance must be 'ns_cost', 'numel' or 'both', got {balance!r}")
    costs = [ns_cost(s) for s in shapes]
    numels = [s[0] * s[1] for s in shapes]
    total_cost, total_numel = max(sum(costs), 1), max(sum(numels), 1)
    use_cost, use_numel = balance in ("ns_cost", "both"), balance in ("numel", "both")

    def load(c, n):
        return max(c / total_cost if use_cost else 0, n / total_numel if use_numel else 0)

    order = sorted(range(len(shapes)), key=lambda i: (-load(costs[i], numels[i]), i))
    buckets, cost, numel = [[] for _ in range(zero_width)], [0] * zero_width, [0] * zero_width
    for i in order:
        b = min(range(zero_width), key=lambda k: (load(cost[k] + costs[i], numel[k] + numels[i]), k))
        buckets[b].append(i)
        cost[b] += costs[i]
        numel[b] += numels[i]
    return [sorted(b, key=lambda i: (tuple(shapes[i]), i)) for b in buckets]


# ---------------------------------------------------------------------------------------------------
# 3. MoE expert matrices: one flat vector, split without cutting a matrix
# ---------------------------------------------------------------------------------------------------

def split_experts(numels, world_size):
    """Cut a flat run of matrices into `world_size` contiguous pieces.  numels: list -> list of (start, end).

    Piece k ends at the matrix boundary nearest to k/W of the total, so no matrix is ever cut; each piece
    is then padded to the largest. With equal-size experts this gives ceil/floor(N / W) matrices per
    rank: padding is at most one matrix per rank, zero when W divides N.
    """
    total, prefix = sum(numels), [0]
    for n in numels:
        prefix.append(prefix[-1] + n)
    cuts = [0]
    for k in range(1, world_size):
        target = total * k / world_size
        j = bisect.bisect_left(prefix, target)  # first boundary at or past the target; the one before may be nearer
        if j > 0 and (j > len(numels) or target - prefix[j - 1] <= prefix[j] - target):
            j -= 1
        cuts.append(max(j, cuts[-1]))
    cuts.append(len(numels))
    return [(cuts[k], cuts[k + 1]) for k in range(world_size)]


# ---------------------------------------------------------------------------------------------------
# The plan: who owns what (pure: usable at V4 scale without processes)
# ---------------------------------------------------------------------------------------------------

@dataclass
class MuonPlan:
    world_size: int
    zero_width: int
    dense_shapes: list    # [(n, m)] in parameter order
    dense_buckets: list   # zero_width lists of dense indices; bucket q belongs to every rank at position q
    expert_shapes: list   # [(n, m)] in V4's flat order: all downs, then ups, then gates
    expert_ranges: list   # world_size (start, end) runs of expert indices

    def position(self, rank):
        """Rank r sits at position r % zero_width of replica group r // zero_width."""
        return rank % self.zero_width

    @property
    def dense_bucket_numel(self):
        return max([sum(self.dense_shapes[i][0] * self.dense_shapes[i][1] for i in b) for b in self.dense_buckets],
                   default=0)

    @property
    def expert_chunk_numel(self):
        return max([sum(s[0] * s[1] for s in self.expert_shapes[a:b]) for a, b in self.expert_ranges], default=0)

    def owned(self, rank):
        """(dense indices, expert indices) whose Muon update `rank` computes."""
        a, b = self.expert_ranges[rank] if self.expert_shapes else (0, 0)
        return self.dense_buckets[self.position(rank)], list(range(a, b))

    def rows(self):
        """One dict per rank: matrices, elements, padding and NS cost of what it owns, and its shape runs
        (runs of identical shape: one batched NS call each, split further if they span param groups)."""
        rows, bucket_numel, chunk_numel = [], self.dense_bucket_numel, self.expert_chunk_numel
        for r in range(self.world_size):
            dense, experts = self.owned(r)
            shapes = [self.dense_shapes[i] for i in dense] + [self.expert_shapes[i] for i in experts]
            dense_numel = sum(self.dense_shapes[i][0] * self.dense_shapes[i][1] for i in dense)
            expert_numel = sum(self.expert_shapes[i][0] * self.expert_shapes[i][1] for i in experts)
            rows.append(dict(rank=r, replica=r // self.zero_width, position=self.position(r),
                             dense=len(dense), experts=len(experts),
                             numel=dense_numel + expert_numel,
                             dense_padding=bucket_numel - dense_numel,
                             expert_padding=chunk_numel - expert_numel,
                             ns_cost=sum(ns_cost(s) for s in shapes),
                             shape_runs=len(shape_runs(shapes))))
        return rows

    def summary(self):
        """Whole-plan figures: max matrices per rank, padding fractions, NS-cost imbalance (max / mean)."""
        rows = self.rows()
        dense_total = sum(n * m for n, m in self.dense_shapes)
        expert_total = sum(n * m for n, m in self.expert_shapes)
        dense_costs = [sum(ns_cost(self.dense_shapes[i]) for i in b) for b in self.dense_buckets]
        return dict(max_dense_per_rank=max(r["dense"] for r in rows),
                    max_experts_per_rank=max(r["experts"] for r in rows),
                    dense_padding=(self.zero_width * self.dense_bucket_numel - dense_total) / max(dense_total, 1),
                    expert_padding=(self.world_size * self.expert_chunk_numel - expert_total) / max(expert_total, 1),
                    dense_imbalance=max(dense_costs) / max(sum(dense_costs) / len(dense_costs), 1))

    def format(self):
        """A printable table, one line per rank."""
        head = f"{'rank':>4} {'replica':>7} {'pos':>3} {'dense':>5} {'experts':>7} {'elements':>10} " \
               f"{'dense pad':>9} {'expert pad':>10} {'NS cost/iter':>12} {'shape runs':>10}"
        lines = [head]
        for r in self.rows():
            lines.append(f"{r['rank']:>4} {r['replica']:>7} {r['position']:>3} {r['dense']:>5} {r['experts']:>7} "
                         f"{r['numel']:>10,} {r['dense_padding']:>9,} {r['expert_padding']:>10,} "
                         f"{r['ns_cost']:>12.3g} {r['shape_runs']:>10}")
        return "\n".join(lines)


def shape_runs(shapes, keys=None):
    """Group consecutive identical (shape, key) entries.  -> list of (start, count, shape)."""
    runs = []
    for i, s in enumerate(shapes):
        key = (tuple(s), keys[i] if keys else None)
        if runs and runs[-1][3] == key:
            runs[-1][1] += 1
        else:
            runs.append([i, 1, tuple(s), key])
    return [(a, c, s) for a, c, s, _ in runs]


def plan_muon(dense_shapes, expert_shapes, world_size, zero_width=None, balance="both"):
    """Build the ownership plan.  dense_shapes / expert_shapes: lists of (n, m); expert_shapes in flat order."""
    zero_width = world_size if zero_width is None else zero_width
    if zero_width < 1 or world_size % zero_width:
        raise ValueError(f"zero_width={zero_width} must divide the data-parallel size {world_size}: ranks form "
                         f"{world_size}/zero_width replica groups; pick a divisor such as "
                         f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}")
    return MuonPlan(world_size, zero_width, [tuple(s) for s in dense_shapes],
                    pack_dense(dense_shapes, zero_width, balance), [tuple(s) for s in expert_shapes],
                    split_experts([n * m for n, m in expert_shapes], world_size))


# ---------------------------------------------------------------------------------------------------
# 4. MuonZeRO: sync, update owned stacks, gather
# ---------------------------------------------------------------------------------------------------

def _reduce_scatter_sum(chunks, group, grad_sync, generator):
    """chunks [P, S] fp32 (chunk q goes to peer q) -> [S] fp32: every peer's chunk for me, summed.

    Written as an all-to-all plus a local sum (V4's MoE recipe): with grad_sync="bf16_sr" each
    gradient is rounded once, stochastically, and the sum is in FP32. A bf16 ring reduce-scatter
    instead rounds the running sum at every hop, so its error grows with the number of ranks.
    """
    if chunks.size(0) == 1:
        return chunks[0]
    payload = stochastic_round_to_bf16(chunks, generator) if grad_sync == "bf16_sr" else chunks
    received = torch.empty_like(payload)
    dist.all_to_all_single(received, payload, group=group)
    return received.float().sum(0)


def _all_gather(chunk, group, size):
    """[S] -> [size, S], chunk q from peer q."""
    if size == 1:
        return chunk.unsqueeze(0)
    out = chunk.new_empty(size * chunk.numel())
    # all_gather_single is the current name; older torch only has the now-deprecated all_gather_into_tensor
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, chunk, group=group)
    return out.view(size, -1)


class MuonZeRO(torch.optim.Optimizer):
    """Muon for matrices and expert stacks, AdamW for the rest, ZeRO-sharded the way V4 does it.

    Param groups carry a `role`: "dense" (2-D matrices), "expert_down" / "expert_up" / "expert_gate"
    (3-D stacks [E, n, m], each expert its own matrix) or "adamw" (see muon_param_groups). Every rank
    calls backward() on its own micro-batch and then step(): the optimizer averages gradients over the
    process group, updates the matrices this rank owns, and gathers the results, so every rank ends
    with identical parameters. step() is a collective: all ranks must call it.

    lr, momentum, weight_decay, nesterov: as torch.optim.Muon (momentum kept in its lerp form).
    ns_coefficients: one (a, b, c) per Newton-Schulz iteration; ns_dtype: NS precision (bf16, as V4).
    update_rms: target RMS of each matrix's update (V4: 0.18; torch's "match_rms_adamw": 0.2).
    betas, eps: AdamW's, for role="adamw" groups (which can set their own lr and weight_decay).
    zero_width: ranks that share the dense matrices (default: all); must divide the world size.
    grad_sync: "bf16_sr" (V4: stochastic rounding to bf16, all-to-all, fp32 sum) or "fp32" (exact).
        It applies to every all-to-all; the cross-replica sum of dense buckets is an fp32 all-reduce.
    process_group: the data-parallel group (default: the world; no group at all runs single-process).
    balance: dense packing objective, see pack_dense. seed: base seed of the rounding noise.
    """

    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=True,
                 ns_coefficients=V4_NS_COEFFICIENTS, ns_dtype=torch.bfloat16, update_rms=0.18,
                 betas=(0.9, 0.95), eps=1e-8, zero_width=None, grad_sync="bf16_sr", process_group=None,
                 balance="both", seed=0):
        if grad_sync not in ("fp32", "bf16_sr"):
            raise ValueError(f"grad_sync must be 'fp32' (exact) or 'bf16_sr' (V4's), got {grad_sync!r}")
        if not (isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point):
            raise ValueError(f"ns_dtype must be a floating torch dtype, got {ns_dtype!r}")
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1:
            raise ValueError(f"need lr >= 0, weight_decay >= 0, 0 <= momentum < 1; "
                             f"got {lr}, {weight_decay}, {momentum}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                        ns_coefficients=tuple(map(tuple, ns_coefficients)), ns_dtype=ns_dtype,
                        update_rms=update_rms, betas=betas, eps=eps, role="dense")
        super().__init__(params, defaults)
        self._check_roles()
        self.group = process_group if process_group is not None or not dist.is_initialized() else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.grad_sync = grad_sync

        # The flat list of Muon matrices: (param index, expert index or None, param-group index).
        self.params = [p for g in self.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(self.params)}
        group_of = {id(p): k for k, g in enumerate(self.param_groups) for p in g["params"]}
        dense = [p for g in self.param_groups if g["role"] == "dense" for p in g["params"]]
        experts = [p for role in EXPERT_ROLES for g in self.param_groups if g["role"] == role for p in g["params"]]
        self.dense = [(index[id(p)], None, group_of[id(p)]) for p in dense]
        self.experts = [(index[id(p)], e, group_of[id(p)]) for p in experts for e in range(p.size(0))]
        plan = plan_muon([tuple(p.shape) for p in dense], [tuple(p.shape[1:]) for p in experts for _ in range(p.size(0))],
                         self.world_size, zero_width, balance)
        self._check_same_everywhere(zero_width, balance)  # the one collective of __init__, after local checks
        self.plan = plan
        self.zero_width = plan.zero_width
        self._build_groups()
        self._build_layout()
        self._momentum = None  # created lazily in the first step(), like torch's optimizers
        self._sr_generator = torch.Generator(device=self.params[0].device).manual_seed(seed * 65537 + self.rank)

    # -- validation: every check that can fail runs on every rank before any collective -------------

    def _check_roles(self):
        for k, g in enumerate(self.param_groups):
            if g["role"] not in ROLES:
                raise ValueError(f"param group {k}: role {g['role']!r} is not one of {ROLES}")
            for p in g["params"]:
                shape = tuple(p.shape)
                if g["role"] == "dense" and p.ndim == 3:
                    raise ValueError(f"param group {k}: a 3-D stack {shape} was declared 'dense' (expert role "
                                     f"missing); give it role 'expert_down', 'expert_up' or 'expert_gate' so each "
                                     f"expert is its own Muon matrix (muon_param_groups does this by name)")
                if g["role"] == "dense" and p.ndim != 2:
                    raise ValueError(f"param group {k}: a {p.ndim}-D tensor {shape} was declared a Muon matrix; "
                                     f"Muon needs [n, m]. Put it in a role='adamw' group (muon_param_groups does)")
                if g["role"] in EXPERT_ROLES and p.ndim != 3:
                    raise ValueError(f"param group {k}: role {g['role']!r} needs an expert stack [E, n, m], got "
                                     f"{shape}; a single matrix belongs in a 'dense' group")

    def _check_same_everywhere(self, zero_width, balance):
        """All ranks must hold the same parameter shapes and settings, or the layouts would disagree
        and the first collective would deadlock. One fixed-size all_gather of a fingerprint tells every
        rank at once, so all of them raise together."""
        if self.world_size == 1:
            return
        layout = [(g["role"], [tuple(p.shape) for p in g["params"]]) for g in self.param_groups]
        text = repr((layout, zero_width, balance, self.grad_sync))
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
        device = self.params[0].device
        mine = torch.tensor([digest], dtype=torch.int64, device=device)
        everyone = _all_gather(mine, self.group, self.world_size).flatten().tolist()
        if len(set(everyone)) > 1:
            odd = [r for r, d in enumerate(everyone) if d != everyone[0]]
            raise ValueError(f"parameter shapes, roles or optimizer settings differ across ranks (ranks {odd} "
                             f"disagree with rank 0); every rank must build the same model and MuonZeRO")

    def add_param_group(self, param_group):
        if getattr(self, "plan", None) is not None:
            raise ValueError("MuonZeRO plans ownership once, at construction; pass every param group then")
        super().add_param_group(param_group)

    # -- layout -------------------------------------------------------------------------------------

    def _build_groups(self):
        """Ranks r // zero_width share a replica; ranks r % zero_width share a position (and its bucket)."""
        W, Z = self.world_size, self.zero_width
        self.shard_group, self.replica_group = self.group, None
        if 1 < Z < W:  # every rank must create every subgroup, in the same order
            for start in range(0, W, Z):
                g = self._new_group([start + q for q in range(Z)])
                if self.rank // Z == start // Z:
                    self.shard_group = g
        if Z < W:
            for q in range(Z):
                g = self._new_group(list(range(q, W, Z)))
                if self.rank % Z == q:
                    self.replica_group = g

    def _new_group(self, ranks):
        if self.group is not dist.group.WORLD and self.group is not None:
            ranks = [dist.get_global_rank(self.group, r) for r in ranks]
        return dist.new_group(ranks)

    def _slots(self, matrices, ids):
        """[(param index, expert, offset, shape)] for matrices[ids] laid out back to back."""
        slots, offset = [], 0
        for i in ids:
            p, e, _ = matrices[i]
            shape = tuple(self.params[p].shape[-2:])
            slots.append((p, e, offset, shape))
            offset += shape[0] * shape[1]
        return slots

    def _build_layout(self):
        plan, me = self.plan, self.rank
        self.dense_slots = [self._slots(self.dense, b) for b in plan.dense_buckets]
        self.expert_slots = [self._slots(self.experts, range(a, b)) for a, b in plan.expert_ranges]
        dense_ids, expert_ids = plan.owned(me)
        # My matrices, grouped into runs of identical shape and param group: one stacked momentum
        # buffer and one batched NS call per run; each run is a contiguous view of the reduced chunk.
        self.dense_runs = self._runs(self.dense, dense_ids)
        self.expert_runs = self._runs(self.experts, expert_ids) if self.experts else []

    def _runs(self, matrices, ids):
        ids = list(ids)
        shapes = [tuple(self.params[matrices[i][0]].shape[-2:]) for i in ids]
        groups = [matrices[i][2] for i in ids]
        runs, offset = [], 0
        for start, count, shape in shape_runs(shapes, groups):
            members = [matrices[i] for i in ids[start:start + count]]
            runs.append(dict(offset=offset, count=count, shape=shape, group=groups[start], members=members))
            offset += count * shape[0] * shape[1]
        return runs

    # -- packing between parameters and flat chunks -----------------------------------------------

    def _matrix(self, tensors, p, e):
        t = tensors[p]
        return t if e is None else t[e]

    def _pack(self, slots_per_chunk, numel, tensors, out=None):
        """Copy each slot's matrix from tensors[param] into a [chunks, numel] buffer (padding zero)."""
        device = self.params[0].device
        out = torch.zeros(len(slots_per_chunk), numel, device=device) if out is None else out
        for q, slots in enumerate(slots_per_chunk):
            for p, e, off, (n, m) in slots:
                t = tensors[p]
                if t is not None:
                    out[q, off:off + n * m].view(n, m).copy_(self._matrix(tensors, p, e))
        return out

    def _unpack(self, chunks, slots_per_chunk, tensors):
        for q, slots in enumerate(slots_per_chunk):
            for p, e, off, (n, m) in slots:
                self._matrix(tensors, p, e).copy_(chunks[q, off:off + n * m].view(n, m))

    # -- the step -----------------------------------------------------------------------------------

    def _global_grad_mask(self):
        """Which parameters have a gradient on at least one rank (one small all_reduce). A gradient that
        is None on some ranks counts as zero there; None everywhere skips the parameter on every rank."""
        mask = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32,
                            device=self.params[0].device)
        if self.world_size > 1:
            dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=self.group)
        return mask.bool().tolist()

    def _init_momentum(self):
        device = self.params[0].device
        self._momentum = {kind: [torch.zeros(r["count"], *r["shape"], device=device) for r in runs]
                          for kind, runs in (("dense", self.dense_runs), ("experts", self.expert_runs))}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        has_grad = self._global_grad_mask()
        if not any(has_grad):
            return loss
        if self._momentum is None:
            self._init_momentum()
        self._step_adamw(has_grad)
        grads = [p.grad for p in self.params]
        params = [p.detach() for p in self.params]
        if self.dense:
            # Stage 1: reduce-scatter inside my replica group (zero_width peers, one bucket each);
            # stage 2: sum that bucket across replica groups, so it holds every rank's gradient.
            chunks = self._pack(self.dense_slots, self.plan.dense_bucket_numel, grads)
            mine = _reduce_scatter_sum(chunks, self.shard_group, self.grad_sync, self._sr_generator)
            if self.replica_group is not None:
                dist.all_reduce(mine, group=self.replica_group)
            updated = self._update_runs(mine, self.dense_runs, self._momentum["dense"],
                                        self.dense_slots[self.plan.position(self.rank)], params, has_grad)
            self._unpack(_all_gather(updated, self.shard_group, self.zero_width), self.dense_slots, params)
        if self.experts:
            # No width cap for experts: one all-to-all over every rank, each owning a run of whole experts.
            chunks = self._pack(self.expert_slots, self.plan.expert_chunk_numel, grads)
            mine = _reduce_scatter_sum(chunks, self.group, self.grad_sync, self._sr_generator)
            updated = self._update_runs(mine, self.expert_runs, self._momentum["experts"],
                                        self.expert_slots[self.rank], params, has_grad)
            self._unpack(_all_gather(updated, self.group, self.world_size), self.expert_slots, params)
        return loss

    def _update_runs(self, grad_sum, runs, momenta, my_slots, params, has_grad):
        """Muon on my matrices.  grad_sum: [S] summed over ranks -> [S] of updated parameter values."""
        mean_grad = grad_sum.div_(self.world_size)  # in place: the receive buffer is ours to reuse
        values = self._pack([my_slots], grad_sum.numel(), params)[0]
        for run, M in zip(runs, momenta):
            g = self.param_groups[run["group"]]
            n, m = run["shape"]
            span = slice(run["offset"], run["offset"] + run["count"] * n * m)
            G, W = mean_grad[span].view(-1, n, m), values[span].view(-1, n, m)
            active = torch.tensor([has_grad[p] for p, _, _ in run["members"]])
            kwargs = dict(momentum=g["momentum"], nesterov=g["nesterov"], coefficients=g["ns_coefficients"],
                          ns_dtype=g["ns_dtype"], update_rms=g["update_rms"])
            if active.all():  # the common case: the stacked buffer is updated in place, no restacking
                apply_update(W, muon_update(G, M, **kwargs), g["lr"], g["weight_decay"])
            elif active.any():
                idx = active.nonzero().flatten().to(M.device)
                M_sub, W_sub = M[idx], W[idx]
                apply_update(W_sub, muon_update(G[idx], M_sub, **kwargs), g["lr"], g["weight_decay"])
                M[idx], W[idx] = M_sub, W_sub
        return values

    def _step_adamw(self, has_grad):
        """AdamW is element-wise, so plain data parallelism is exact: all-reduce, then every rank steps."""
        todo = [(i, p, g) for g in self.param_groups if g["role"] == "adamw" for p in g["params"]
                for i in [self._index(p)] if has_grad[i]]
        if not todo:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for _, p, _ in todo])
        if self.world_size > 1:
            dist.all_reduce(flat, group=self.group)
        flat /= self.world_size
        offset = 0
        for i, p, g in todo:
            grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            state = self.state[p]
            if not state:
                state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state["step"] += 1
            adamw_update(p.detach(), grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr=g["lr"],
                         betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"])

    def _index(self, p):
        if not hasattr(self, "_index_of"):
            self._index_of = {id(q): i for i, q in enumerate(self.params)}
        return self._index_of[id(p)]

    # -- memory and checkpoints ---------------------------------------------------------------------

    def local_state_tensors(self):
        """The state tensors this rank holds: its stacked Muon momenta and the AdamW moments."""
        muon = [M for ms in (self._momentum or {}).values() for M in ms]
        return muon + [t for s in self.state.values() for t in s.values() if torch.is_tensor(t)]

    def state_bytes(self):
        """Optimizer-state bytes held by this rank."""
        return sum(t.numel() * t.element_size() for t in self.local_state_tensors())

    def _full_momentum(self):
        """Every Muon parameter's momentum, full shape, on every rank (collective)."""
        full = [torch.zeros_like(p) for p in self.params]
        for kind, runs, slots, numel, group, size, mine in (
                ("dense", self.dense_runs, self.dense_slots, self.plan.dense_bucket_numel, self.shard_group,
                 self.zero_width, self.plan.position(self.rank)),
                ("experts", self.expert_runs, self.expert_slots, self.plan.expert_chunk_numel, self.group,
                 self.world_size, self.rank)):
            if not slots or numel == 0:
                continue
            chunk = torch.zeros(numel, device=self.params[0].device)
            for run, M in zip(runs, self._momentum[kind]):
                chunk[run["offset"]:run["offset"] + M.numel()] = M.flatten()
            self._unpack(_all_gather(chunk, group, size), slots, full)
        return full

    def state_dict(self):
        """World-size-independent: full per-parameter momentum (gathered) and AdamW moments, keyed by
        parameter index, in torch's usual layout. A collective when momentum exists: call on all ranks."""
        full = self._full_momentum() if self._momentum is not None else None
        state = {}
        for i, p in enumerate(self.params):
            if p in self.state and self.state[p]:
                state[i] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.state[p].items()}
            elif full is not None and self._role(i) != "adamw":
                state[i] = {"momentum_buffer": full[i]}
        groups, start = [], 0
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return {"state": state, "param_groups": groups}

    def _role(self, i):
        return next(g["role"] for g in self.param_groups for p in g["params"] if p is self.params[i])

    def load_state_dict(self, state_dict):
        """Load a state_dict saved at any world size and zero width; each rank keeps what it now owns."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("state_dict has a different number of param groups or parameters per group")
        for g, s in zip(self.param_groups, saved):
            if g["role"] != s["role"]:
                raise ValueError(f"state_dict group role {s['role']!r} does not match {g['role']!r}")
            g.update({k: v for k, v in s.items() if k != "params"})
        state = state_dict["state"]
        self.state.clear()
        self._momentum = None
        for i, p in enumerate(self.params):
            s = state.get(i, state.get(str(i)))
            if s and "exp_avg" in s:
                self.state[p] = {k: (v.to(p.device).clone() if torch.is_tensor(v) else v) for k, v in s.items()}
        if any("momentum_buffer" in s for s in state.values()):
            self._init_momentum()
            full = [state.get(i, {}).get("momentum_buffer") for i in range(len(self.params))]
            for kind, runs in (("dense", self.dense_runs), ("experts", self.expert_runs)):
                for run, M in zip(runs, self._momentum[kind]):
                    for k, (p, e, _) in enumerate(run["members"]):
                        if full[p] is not None:
                            M[k].copy_(full[p] if e is None else full[p][e])


# ---------------------------------------------------------------------------------------------------
# Demo: a small MoE transformer trained on every rank's slice of the batch
# ---------------------------------------------------------------------------------------------------

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
            layer.wq = nn.Parameter(torch.randn(heads * kv_dim, dim) / dim ** 0.5)   # tall  [64, 48]
            layer.wkv = nn.Parameter(torch.randn(2 * kv_dim, dim) / dim ** 0.5)      # wide  [32, 48]
            layer.wo = nn.Parameter(torch.randn(dim, heads * kv_dim) / dim ** 0.5)   # wide  [48, 64]
            layer.router = nn.Parameter(torch.randn(experts, dim) / dim ** 0.5)
            layer.w_gate = nn.Parameter(torch.randn(experts, ffn, dim) / dim ** 0.5)
            layer.w_up = nn.Parameter(torch.randn(experts, ffn, dim) / dim ** 0.5)
            layer.w_down = nn.Parameter(torch.randn(experts, dim, ffn) / ffn ** 0.5)
            self.layers.append(layer)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        B, T, D = x.shape
        for L in self.layers:
            h = L.attn_norm(x)
            q = (h @ L.wq.T).view(B, T, self.heads, self.kv_dim).transpose(1, 2)    # [B, H, T, kv]
            k, v = (h @ L.wkv.T).split(self.kv_dim, dim=-1)                         # one shared KV head
            att = F.scaled_dot_product_attention(q, k.unsqueeze(1).expand(-1, self.heads, -1, -1),
                                                 v.unsqueeze(1).expand(-1, self.heads, -1, -1), is_causal=True)
            x = x + att.transpose(1, 2).reshape(B, T, -1) @ L.wo.T
            h = L.ffn_norm(x)
            weights, chosen = (h @ L.router.T).softmax(-1).topk(self.top_k, dim=-1)
            gates = torch.zeros(B, T, L.router.size(0), device=x.device).scatter(-1, chosen, weights)  # 0 for unchosen experts
            hidden = F.silu(torch.einsum("btd,efd->btef", h, L.w_gate)) * torch.einsum("btd,efd->btef", h, L.w_up)
            x = x + torch.einsum("btef,edf,bte->btd", hidden, L.w_down, gates)
        return self.head(self.norm(x))


def demo_batch(batch, seq, vocab, generator):
    """Sequences that follow t_{i+1} = (5 t_i + 3) mod vocab from a random start: learnable next-token data."""
    tokens = torch.randint(0, vocab, (batch, 1), generator=generator, device="cpu")
    for _ in range(seq):
        tokens = torch.cat([tokens, (5 * tokens[:, -1:] + 3) % vocab], dim=1)
    return tokens[:, :-1], tokens[:, 1:]


def main():
    parser = argparse.ArgumentParser(description="Train a small MoE model with MuonZeRO on every rank.")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if torchrun:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, world = (dist.get_rank(), dist.get_world_size()) if torchrun else (0, 1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.set_default_device(device)
    say = print if rank == 0 else (lambda *a, **k: None)

    torch.manual_seed(0)  # the same initial model everywhere
    model = TinyMoE()
    zero_width = world // 2 if world % 2 == 0 and world > 2 else world
    opt = MuonZeRO(muon_param_groups(model), lr=0.02, zero_width=zero_width, grad_sync="bf16_sr")
    for g in opt.param_groups:
        if g["role"] == "adamw":
            g["lr"] = 3e-3
    say(f"MuonZeRO on {world} rank(s), zero width {zero_width} -> {world // zero_width} replica group(s), "
        f"backend {dist.get_backend() if torchrun else 'none'}")
    say(f"{len(opt.dense)} dense matrices, {len(opt.experts)} expert matrices; the plan:")
    say(opt.plan.format())

    global_batch, seq = 24, 16
    data = torch.Generator(device="cpu").manual_seed(1)
    per_rank = global_batch // world
    for step in range(args.steps):
        x, y = demo_batch(global_batch, seq, 64, data)
        x, y = x[rank * per_rank:(rank + 1) * per_rank].to(device), y[rank * per_rank:(rank + 1) * per_rank].to(device)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean_loss = loss.detach().clone()
        if torchrun:
            dist.all_reduce(mean_loss)
            mean_loss /= world
        if step % 5 == 0 or step == args.steps - 1:
            say(f"step {step:3d}  loss {mean_loss.item():.4f}")

    muon_bytes = 4 * sum(p.numel() for g in opt.param_groups if g["role"] != "adamw" for p in g["params"])
    adam_bytes = 8 * sum(p.numel() for g in opt.param_groups if g["role"] == "adamw" for p in g["params"])
    mine = torch.tensor([float(opt.state_bytes())], device=device)
    per_rank_bytes = _all_gather(mine, None, world).flatten().tolist() if torchrun else [mine.item()]
    say(f"optimizer state per rank (bytes): {[int(b) for b in per_rank_bytes]}  vs unsharded "
        f"{muon_bytes + adam_bytes:,} (Muon momentum {muon_bytes:,} + AdamW moments {adam_bytes:,})")
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    if torchrun:
        everyone = _all_gather(flat, None, world)
        same = all(torch.equal(everyone[0], everyone[r]) for r in range(world))
        say(f"parameters bitwise identical on all {world} ranks: {same}")
        if not same:
            raise SystemExit("replicas diverged")
        # The optimizer holds its process groups, and the first optimizer of a process sits in a reference
        # cycle inside torch; free it now, or gloo groups die during interpreter shutdown and may abort.
        del opt
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
