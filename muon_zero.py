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
  3. V4's placement: which tensors Muon updates (`muon_param_groups`); dense matrices packed whole,
     largest first, into `zero_width` buckets padded to the largest (a plain reduce-scatter); MoE
     experts flattened (all downs, ups, gates) into one vector split over every rank without
     cutting a matrix; same-shape neighbours form one stacked momentum and one batched
     Newton-Schulz call.
  4. the sharded step, `sharded_step`: pack -> reduce-scatter (bf16 stochastic rounding,
     all-to-all, fp32 sum) -> clip the averaged gradient -> update owned matrices -> all-gather;
     then `MuonZeRO`, the torch.optim.Optimizer around it, which shards AdamW's tensors as
     ZeRO-1 does (element-wise, so exact), in blocks of whole rows dealt largest first.
Below the fence: the checks before any collective (`check_and_agree`), checkpoints (a rank's share,
the gathered whole, torch.distributed.checkpoint at any world size) and the demo.

Run it (set-up, the agreement guard and the launch options come from launch.py):
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 muon_zero.py  # CPU/gloo: width 2, 2 replicas
    torchrun --nproc_per_node=8 muon_zero.py                    # GPUs: NCCL, one per rank
    python muon_zero.py --help                                  # one process; every option
"""

import argparse
import bisect
import contextlib
import hashlib
import math
import os
import time
from collections import namedtuple
from copy import deepcopy
from dataclasses import dataclass, field, replace
from itertools import accumulate, groupby

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.amp.grad_scaler import OptState

import launch
from models.tiny_moe import TinyMoE, demo_batch  # the demo's model and data

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
    Y = X.to(torch.promote_types(X.dtype, torch.float32))  # fp32 or wider: the scaling is exact
    _, exponent = torch.frexp(Y.abs().amax(dim=(-2, -1), keepdim=True))
    Y = torch.ldexp(Y, -exponent).to(dtype)  # largest entry in [0.5, 1): nothing underflows
    tall = Y.size(-2) > Y.size(-1)
    if tall:
        Y = Y.mT.contiguous()  # [..., s, l] with s <= l: the Gram matrix is s x s
    Y = Y / Y.norm(dim=(-2, -1), keepdim=True).clamp_min(eps)
    multiply_add = torch.baddbmm if Y.ndim == 3 else torch.addmm  # one matrix: torch's addmm
    for a, b, c in coefficients:
        # every right operand a transposed row-major matrix (A is symmetric: A = A^T): CPU bf16
        # kernels run that memory order several times faster than a plain row-major one
        gram = Y @ Y.mT  # [..., s, s]
        poly = multiply_add(gram, gram, gram.mT, beta=b, alpha=c)  # b·A + c·A²
        Y = multiply_add(Y, poly, Y.mT.contiguous().mT, beta=a)  # a·X + (b·A + c·A²)·X
    return Y.mT if tall else Y
    ### END SOLUTION


def muon_update(
    grad,
    momentum_buffer,
    *,
    momentum=0.95,
    nesterov=True,
    coefficients=V4_NS_COEFFICIENTS,
    ns_dtype=torch.bfloat16,
    update_rms=0.18,
):
    """Advance the momentum in place, return the update O in grad's dtype.  grad, buffer: [n, m]
    or [b, n, m].

    V4 writes M <- mu·M + G and X = mu·M + G (Nesterov) or M. The buffer is torch.optim.Muon's
    average form M' = (1 - mu)·M: M' <- lerp(M', G, 1 - mu), X' = lerp(G, M', mu) = (1 - mu)·X,
    the same direction. O = NS(X)·sqrt(max(n, m))·update_rms: NS(X) has RMS ~1/sqrt(max(n, m)).
    """
    # hint: two lerps (momentum, then the Nesterov look-ahead), then newton_schulz and the RMS scale
    ### BEGIN SOLUTION
    momentum_buffer.lerp_(grad, 1 - momentum)
    X = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    scale = update_rms * math.sqrt(max(X.shape[-2:]))
    return newton_schulz(X, coefficients, ns_dtype).to(X.dtype) * scale
    ### END SOLUTION


def apply_update(param, update, lr, weight_decay):
    """Decoupled weight decay, then the step: W <- W·(1 - lr·wd) - lr·O.  In place."""
    param.mul_(1 - lr * weight_decay).add_(update, alpha=-lr)


def adamw_update(
    param, grad, exp_avg, exp_avg_sq, step, *, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
):
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


# ---- 3. V4's placement: who owns what (pure functions: usable at V4 scale without processes) -----

# A param group's role: which rule updates its tensors, and how Muon cuts them into matrices.
EXPERT_ROLES = ("expert_down", "expert_up", "expert_gate")  # V4's order of the flat expert vector
ROLES = ("dense", *EXPERT_ROLES, "adamw")  # dense: a matrix [n, m]; experts: a stack [E, n, m]
OUTPUT_HEAD_NAMES = ("head", "lm_head", "output", "output_layer")  # nanoGPT, HF, titan, Megatron
# A table held bare (nanoGPT's F.embedding(idx, wte), tied as x @ wte.T) is known by its name alone
EMBEDDING_TOKENS = {"wte", "wpe", "emb", "embed", "embeds", "embedding", "embeddings", "unembed"}


def muon_param_groups(model, adamw_names=OUTPUT_HEAD_NAMES, expert_roles=None):
    """Split `model`'s parameters into MuonZeRO param groups, one per role, by what each tensor is.

    AdamW (V4): embeddings and what is tied to them (an nn.Embedding's weight, HF's
    get_input_embeddings(), or a tensor held bare whose name has a token of EMBEDDING_TOKENS, such
    as nanoGPT's "wte"); the output head (HF's get_output_embeddings(), or a module in
    `adamw_names`: a dotted prefix such as "model.proj" or a module name anywhere in the path);
    tensors declared non-Muon (a module's `no_muon` or `_adamw_params` set of names, or
    `tensor.no_muon = True`); static biases (names starting "bias", such as mHC's 2-D bias_res);
    tensors below 2-D. Muon: every other matrix. 3-D tensors held bare are expert stacks
    [E, n, m], their role from `expert_roles[name]` or a name token ("w_down", "up_proj",
    "gate"), else a ValueError; a torch.nn layer's 3-D or 4-D weight (a convolution's) or one
    named "conv" is none: a ValueError says to send it to AdamW.
    """
    adamw_ids, owner = declared_adamw(model)
    by_role = {role: [] for role in ROLES}
    for name, p in model.named_parameters():
        declared = id(p) in adamw_ids
        by_role[role_of(name, p, owner[id(p)], declared, adamw_names, expert_roles or {})].append(p)
    return [{"params": ps, "role": role} for role, ps in by_role.items() if ps]


def declared_adamw(model):
    """(ids of the tensors their holder sends to AdamW, {tensor id: the module holding it}): an
    nn.Embedding's weight, HF's input and output embeddings, a module's `no_muon` or
    `_adamw_params` names."""
    adamw_ids, owner = set(), {}
    for module in model.modules():
        owner.update((id(p), module) for p in module.parameters(recurse=False))
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            adamw_ids.add(id(module.weight))
        declared = set(getattr(module, "no_muon", ())) | set(getattr(module, "_adamw_params", ()))
        adamw_ids |= {id(p) for n, p in module.named_parameters(recurse=False) if n in declared}
    for ends in ("get_output_embeddings", "get_input_embeddings"):  # HF's head and embedding
        found = getattr(model, ends, lambda: None)()
        if isinstance(found, nn.Module):
            adamw_ids |= {id(p) for p in found.parameters()}
    return adamw_ids, owner


def role_of(name, p, module, declared, adamw_names, expert_roles):
    """The role (ROLES) of parameter ``name`` held by ``module`` (``declared``: sent to AdamW by
    its holder), by muon_param_groups' rules; a ValueError for a tensor Muon cannot take."""
    modules = name.split(".")[:-1]  # whole module names: "output" is not "output_gate"
    named = any(name.startswith(a + ".") or a in modules for a in adamw_names)
    bias = name.rsplit(".", 1)[-1].startswith("bias")
    tokens = set(name.lower().replace(".", "_").split("_"))
    layer = is_torch_layer(module)  # Linear, Conv1d, ... or a subclass
    table = not layer and bool(tokens & EMBEDDING_TOKENS)  # a bare embedding table
    if declared or getattr(p, "no_muon", False) or named or bias or p.ndim < 2 or table:
        return "adamw"
    if p.ndim == 2:
        return "dense"
    if (p.ndim == 3 and not layer and "conv" not in tokens) or name in expert_roles:
        found = [r for r in EXPERT_ROLES if r.split("_")[1] in tokens]
        role = expert_roles.get(name, found[0] if len(found) == 1 else None)
        if role not in EXPERT_ROLES:
            raise ValueError(
                f"expert stack {name!r} {tuple(p.shape)}: cannot tell a down, up "
                f"or gate projection (role {role!r}); pass expert_roles="
                f"{{{name!r}: 'expert_down'}} (or _up / _gate)"
            )
        return role
    what = f"a {type(module).__name__}'s weight" if layer else f"a {p.ndim}-D tensor"
    raise ValueError(
        f"parameter {name!r} {tuple(p.shape)} is {what}, not a matrix [n, m] or an "
        f"expert stack [E, n, m] (MuonZeRO does not flatten a filter to [out, in*k]): "
        f"send it to AdamW with model.get_parameter({name!r}).no_muon = True"
    )


def is_torch_layer(module):
    """A torch.nn layer (Linear, Conv1d, Bilinear, ...) or a subclass: its weight's shape says
    what the layer makes of it. Containers and plain Modules hold bare tensors."""
    kinds = [c.__module__ for c in type(module).__mro__]
    return any(
        k.startswith("torch.nn.modules.") and k.rsplit(".", 1)[1] not in ("module", "container")
        for k in kinds
    )


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


# AdamW's tensors are dealt in blocks of whole rows of about this many elements: the fullest rank
# then holds at most one block more than an equal share (an embedding is not one rank's alone),
# and a block's key in a state dict (its index in its tensor) is the same at any world size.
ADAMW_BLOCK_NUMEL = 1 << 20


def adamw_blocks(shape):
    """Cut a tensor of `shape` into blocks of whole rows.  -> [(start row, end row)], [None]
    for a 0-d tensor. Rows of dim 0, about ADAMW_BLOCK_NUMEL elements each."""
    if len(shape) == 0:
        return [None]
    per = max(1, ADAMW_BLOCK_NUMEL // max(1, math.prod(shape[1:])))
    return [(a, min(a + per, shape[0])) for a in range(0, shape[0], per)] or [(0, 0)]


def deal_whole(numels, peers):
    """Items, whole, to `peers` buckets.  numels: list -> list of index lists.

    Largest first, each to the lightest bucket, as torch's ZeroRedundancyOptimizer deals its
    parameters: ZeRO-1 for AdamW, cut at block boundaries so that each block's moments live
    whole on one rank."""
    buckets, load = [[] for _ in range(peers)], [0] * peers
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        q = min(range(peers), key=lambda k: (load[k], k))
        buckets[q].append(i)
        load[q] += numels[i]
    return [sorted(b) for b in buckets]


AdamWBlock = namedtuple("AdamWBlock", "tensor block rows numel")  # rows: (first, end), or ()


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
    adamw_shapes: list = field(default_factory=list)  # AdamW's tensors, in parameter order
    adamw_blocks: list = field(default_factory=list)  # AdamWBlock each
    adamw_buckets: list = field(default_factory=list)  # world_size lists of block indices
    adamw_chunk_numel: int = 0  # the largest AdamW bucket: every one is padded to it

    def owned(self, rank):
        """(dense indices, expert indices) whose Muon update `rank` computes."""
        a, b = self.expert_ranges[rank] if self.expert_shapes else (0, 0)
        return self.dense_buckets[rank % self.zero_width], list(range(a, b))

    def owned_adamw(self, rank):
        """AdamW blocks (indices into adamw_blocks) whose moments `rank` holds and updates."""
        return self.adamw_buckets[rank]

    def adamw_numel(self, rank):
        """Elements of the AdamW blocks `rank` owns."""
        return sum(self.adamw_blocks[i].numel for i in self.adamw_buckets[rank])


def plan_muon(
    dense_shapes, expert_shapes, world_size, zero_width=None, balance="both", adamw_shapes=()
):
    """Build the ownership plan.  dense_shapes, expert_shapes: [(n, m)]; experts in flat order;
    adamw_shapes: AdamW's tensors, any shape, dealt over every rank in blocks of rows."""
    zero_width = world_size if zero_width is None else zero_width
    if not isinstance(zero_width, int) or zero_width < 1 or world_size % zero_width:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"zero_width={zero_width} must divide the data-parallel size "
            f"{world_size} (replica groups): pick one of {divisors}"
        )
    dense, experts = [tuple(s) for s in dense_shapes], [tuple(s) for s in expert_shapes]
    buckets = pack_dense(dense, zero_width, balance)
    ranges = split_experts([math.prod(s) for s in experts], world_size)
    bucket = max((sum(math.prod(dense[i]) for i in b) for b in buckets), default=0)
    chunk = max((sum(map(math.prod, experts[a:b])) for a, b in ranges), default=0)
    adamw = [tuple(s) for s in adamw_shapes]
    blocks = [
        AdamWBlock(t, j, rows, math.prod(shape[1:]) * (rows[1] - rows[0]) if rows else 1)
        for t, shape in enumerate(adamw)
        for j, rows in enumerate(adamw_blocks(shape))
    ]
    dealt = deal_whole([b.numel for b in blocks], world_size)
    adamw_chunk = max((sum(blocks[i].numel for i in b) for b in dealt), default=0)
    plan = MuonPlan(world_size, zero_width, dense, buckets, experts, ranges, bucket, chunk)
    return replace(
        plan,
        adamw_shapes=adamw,
        adamw_blocks=blocks,
        adamw_buckets=dealt,
        adamw_chunk_numel=adamw_chunk,
    )


def plan_refusal(world_size, zero_width, balance):
    """Why plan_muon refuses these settings (its message), or None: the guard raises it with its
    own checks, on every rank, before any collective."""
    try:
        plan_muon([], [], world_size, zero_width, balance)
    except ValueError as err:
        return str(err)
    return None


@dataclass(frozen=True)
class Slot:
    """One tensor inside a flat chunk: params[param] (a Muon matrix), expert `expert` of that
    stack, or rows `rows` of an AdamW tensor (its block `block`)."""

    param: int  # index into MuonZeRO.params
    expert: int | None  # index into a stack [E, n, m]; None for a dense matrix
    param_group: int  # index into MuonZeRO.param_groups: its hyperparameters
    shape: tuple  # (n, m); an AdamW block's own shape
    offset: int = 0  # where it starts inside its chunk
    rows: tuple | None = None  # an AdamW block's (start, end) rows of its tensor
    block: int | None = None  # an AdamW block's index in its tensor: its key in a state dict

    def of(self, tensors):
        """This tensor inside a per-parameter list of tensors (a view)."""
        t = tensors[self.param]
        if self.expert is not None:
            return t[self.expert]
        return t if self.rows is None else t[self.rows[0] : self.rows[1]]


@dataclass
class Run:
    """Owned same-shape matrices side by side: one stacked momentum [count, n, m], and one
    batched NS call (small matrices) or one per matrix (large ones), as `batched` says."""

    offset: int  # start inside my chunk
    shape: tuple  # (n, m)
    slots: list  # its Slots, in order (of any param group: expert ups and gates merge)
    batched: bool = True  # one NS call on the stack; False: one per matrix


# From this NS cost up one matrix fills a matmul alone: a batched call gains nothing over a loop
# (on CPUs it loses), while smaller ones leave the kernel idle between calls. A GPU needs far
# larger matrices to fill it.
NS_BATCH_MAX_COST = ns_cost((128, 128))
NS_BATCH_MAX_COST_GPU = ns_cost((1024, 1024))


def batch_newton_schulz(shape, device_type="cpu"):
    """The plan's choice for a run of [n, m] matrices: one batched Newton-Schulz call (True) or
    one per matrix. A rule on sizes and the device alone, so every rank decides alike."""
    limit = NS_BATCH_MAX_COST if device_type == "cpu" else NS_BATCH_MAX_COST_GPU
    return ns_cost(shape) < limit


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


def block_shape(shape, rows):
    """The shape of rows (start, end) of a tensor of `shape` (the tensor's, for rows None)."""
    return tuple(shape) if rows is None else (rows[1] - rows[0], *shape[1:])


def back_to_back(slot_lists):
    """Each list's slots back to back from offset 0 (their offsets set)."""
    offsets = [accumulate((math.prod(s.shape) for s in c), initial=0) for c in slot_lists]
    return [[replace(s, offset=o) for s, o in zip(c, at)] for c, at in zip(slot_lists, offsets)]


def make_shards(matrix_lists, mine, process_group, peers, device_type="cpu", **kw):
    """Each peer's matrices back to back from offset 0; my chunk's same-shape neighbours: Runs,
    batched or not as batch_newton_schulz decides for `device_type`."""
    chunks = back_to_back(matrix_lists)
    same_shape = [list(slots) for _, slots in groupby(chunks[mine], key=lambda s: s.shape)]
    runs = [
        Run(
            slots[0].offset, slots[0].shape, slots, batch_newton_schulz(slots[0].shape, device_type)
        )
        for slots in same_shape
    ]
    numel = max((sum(math.prod(s.shape) for s in c) for c in chunks), default=0)
    return Shards(chunks, numel, mine, runs, process_group, peers, **kw)


# ---- 4. The sharded step: pack -> reduce-scatter -> clip -> update mine -> all-gather ------------


def agreed_grad_mask(grads, process_group, device, extra=()):
    """Which parameters have a gradient on some rank, in one all-reduce (MAX) of flags.  grads:
    per parameter, None where this rank has none. Part of the algorithm, not a check: a gradient
    on any rank means the parameter steps (zero where a rank has None), none anywhere means it is
    left alone (as torch's optimizers leave it), and every rank must decide alike. A sparse
    gradient (flag 2) is refused by every rank alike, right after this collective. extra: integers
    below 2^62 that ride in the same all-reduce. -> (mask, the extras' maxima over the ranks)."""
    flags = [0 if g is None else 2 if g.layout != torch.strided else 1 for g in grads] + list(extra)
    mask = torch.tensor(flags, dtype=torch.int64, device=device)
    if process_group is not None and dist.get_world_size(process_group) > 1:
        dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=process_group)
    mask = mask.tolist()
    if sparse := [i for i, m in enumerate(mask[: len(grads)]) if m == 2]:
        raise ValueError(
            f"parameters {sparse[:4]} have sparse gradients (nn.Embedding(sparse=True)?): "
            f"MuonZeRO does not support sparse gradients, as torch.optim.AdamW does not; build "
            f"the embedding with sparse=False"
        )
    return [bool(m) for m in mask[: len(grads)]], mask[len(grads) :]


def settings_digest(param_groups):
    """62 bits of every param group's settings (lr, momentum, ns_coefficients, ...): ranks whose
    schedulers have drifted apart differ here."""

    def value(v):  # a tensor by its numbers (its repr names its device), an object by its type
        if torch.is_tensor(v):
            return v.tolist()
        if isinstance(v, (tuple, list)):
            return [value(x) for x in v]
        plain = isinstance(v, (int, float, str, torch.dtype)) or v is None
        return v if plain else type(v).__name__

    settings = [(k, value(g[k])) for g in param_groups for k in sorted(g) if k != "params"]
    digest = hashlib.blake2b(repr(settings).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


@torch.no_grad()
def sharded_step(
    kinds,
    grads,
    params,
    momenta,
    settings,
    has_grad,
    *,
    world_size,
    grad_sync,
    generator=None,
    max_norm=None,
    replicated_sq=0.0,
    process_group=None,
):
    """V4's sharded Muon step for every kind of matrices; every rank ends with the same params.
    One function on purpose: the distributed protocol, its steps numbered in the order they run.

    kinds: Shards (dense buckets, the expert vector); grads, params: per-parameter lists (a grad
    may be None: zero here); momenta: per kind, a stacked buffer [count, n, m] per run of mine;
    settings: a MuonSettings per param group; has_grad: per parameter, agreed by every rank.
    world_size: ranks of process_group, whose gradients are averaged; grad_sync: "bf16_sr" rounds
    what is sent with `generator`'s noise, else it travels exact; max_norm: clip the averaged
    gradient to this norm over the whole model (None: don't); replicated_sq: squared norm of the
    gradients outside these kinds (AdamW's), the same on every rank. Returns the clip factor (1
    without clipping), for the AdamW gradients. Buffers take the parameters' dtype.
    """
    # hint: per kind: pack, reduce_scatter_sum (+ replicas), mean; clip; update_run per run; gather
    ### BEGIN SOLUTION
    like, means = params[0], []
    for shards in kinds:
        # 1. pack: my gradients as one zero-padded chunk per peer, chunk q = what peer q owns
        packed = pack_chunks(shards.chunks, shards.chunk_numel, grads, like)  # [P, S]
        # 2. reduce-scatter: chunk q of every peer lands on peer q and is summed there (V4's MoE
        #    recipe: bf16 stochastic rounding, all-to-all, fp32 sum); then across the replicas
        summed = reduce_scatter_sum(packed, shards.group, grad_sync, generator)  # [S]
        if shards.replica_group is not None:
            dist.all_reduce(summed, group=shards.replica_group)
        means.append(summed.div_(world_size))
    # 3. clip the averaged gradient: one norm over the whole model, each matrix counted once
    scale = like.new_ones(())
    if max_norm is not None:
        sq = sum((m.square().sum() for m, s in zip(means, kinds) if s.counted), 0 * scale)
        if world_size > 1:
            dist.all_reduce(sq, group=process_group)
        scale = (max_norm / ((sq + replicated_sq).sqrt() + 1e-6)).clamp(max=1.0)
        for mean_grad in means:
            mean_grad.mul_(scale)
    for shards, mean_grad, buffers in zip(kinds, means, momenta):
        # 4. update the matrices I own: one batched Newton-Schulz call per same-shape run
        owned = [shards.chunks[shards.mine]]
        values = pack_chunks(owned, shards.chunk_numel, params, like)[0]  # [S]
        for run, M in zip(shards.runs, buffers):
            span = slice(run.offset, run.offset + M.numel())
            run_settings = [settings[s.param_group] for s in run.slots]
            active = [has_grad[s.param] for s in run.slots]
            G, W = mean_grad[span].view_as(M), values[span].view_as(M)
            update_run(G, W, M, run_settings, active, run.batched)
        # 5. all-gather every peer's updated chunk and unpack it into the parameters, everywhere
        unpack_chunks(all_gather_chunks(values, shards.group, shards.peers), shards.chunks, params)
    return scale
    ### END SOLUTION


def pack_chunks(chunks, numel, tensors, like):
    """Copy each slot's matrix from tensors[slot.param] into a zero-padded [len(chunks), numel]
    of `like`'s dtype and device."""
    out = like.new_empty(len(chunks), numel)  # zeroed only where nothing is copied
    for q, slots in enumerate(chunks):
        end = 0
        for s in slots:
            end = s.offset + math.prod(s.shape)
            if tensors[s.param] is None:  # no gradient here: zero
                out[q, s.offset : end].zero_()
            else:
                out[q, s.offset : end].view(s.shape).copy_(s.of(tensors))
        out[q, end:].zero_()  # the padding after the last slot
    return out


def unpack_chunks(flat, chunks, tensors):
    """The inverse of pack_chunks: flat [len(chunks), numel] back into each slot's matrix."""
    for q, slots in enumerate(chunks):
        for s in slots:
            s.of(tensors).copy_(flat[q, s.offset : s.offset + math.prod(s.shape)].view(s.shape))


def reduce_scatter_sum(packed, group, grad_sync, generator):
    """packed [P, S] (chunk q goes to peer q) -> [S]: every peer's chunk for me, summed in
    packed's dtype. All-to-all, then the sum: each gradient rounded once (a bf16 ring rounds at
    every hop)."""
    if packed.size(0) == 1:
        return packed[0]
    payload = stochastic_round_to_bf16(packed, generator) if grad_sync == "bf16_sr" else packed
    received = torch.empty_like(payload)
    dist.all_to_all_single(received, payload, group=group)
    return received.to(packed.dtype).sum(0)


def all_gather_chunks(chunk, group, size):
    """[S] -> [size, S], chunk q from peer q."""
    if size == 1:
        return chunk.unsqueeze(0)
    out = chunk.new_empty(size * chunk.numel())
    dist.all_gather_single(out, chunk, group=group)
    return out.view(size, -1)


def update_run(G, W, M, settings, active, batched=True):
    """Muon on one run [count, n, m] in place, one muon_update per equal-settings neighbours
    (batched) or per matrix; members with no gradient on any rank keep momentum and weights (as
    torch's optimizers do)."""
    idle = [k for k, a in enumerate(active) if not a]
    saved, start = (M[idle].clone(), W[idle].clone()) if idle else None, 0
    for s, members in groupby(settings):
        end = start + len(list(members))
        for part in [slice(start, end)] if batched else range(start, end):  # a stack, or [n, m]s
            update = muon_update(
                G[part],
                M[part],
                momentum=s.momentum,
                nesterov=s.nesterov,
                coefficients=s.ns_coefficients,
                ns_dtype=s.ns_dtype,
                update_rms=s.update_rms,
            )
            apply_update(W[part], update, s.lr, s.weight_decay)
        start = end
    if idle:
        M[idle], W[idle] = saved


def build_groups(process_group, world_size, zero_width):
    """(shard group, replica group): ranks r // zero_width share a replica (the reduce-scatter
    peers), ranks r % zero_width a position (the cross-replica all-reduce); only members create
    one (a DP subgroup)."""
    if zero_width == world_size:
        return process_group, None
    rank = dist.get_rank(process_group)

    def new_group(ranks):
        members = [dist.get_global_rank(process_group, r) for r in ranks]
        return launch.new_group(members, use_local_synchronization=True)  # the launch's timeout

    start = rank // zero_width * zero_width
    shard = new_group(range(start, start + zero_width)) if zero_width > 1 else None
    return shard, new_group(range(rank % zero_width, world_size, zero_width))


def unscale_for(grad_scaler, opt):
    """amp's GradScaler, handed to step(): unscale opt's gradients (unless scaler.unscale_ did),
    -> this rank's found_inf tensors, in the scaler (empty without a scaler)."""
    if grad_scaler is None:
        return []
    # what scaler.update() reads: GradScaler has no public API for the optimizer it steps
    state = grad_scaler._per_optimizer_states[id(opt)]
    if state["stage"] is OptState.READY:
        grad_scaler.unscale_(opt)
    return list(state["found_inf_per_device"].values())


def rounding_seed(seed, rank, steps):
    """The seed of the rounding noise of step `steps` on `rank`: a stream per rank and step, so
    a resumed run (any world size) draws what it would have drawn, from the step count alone. A hash
    mixes all three into every bit: a CPU generator keeps only the low 32, a CUDA one all 64."""
    digest = hashlib.blake2b(f"{seed} {rank} {steps}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: manual_seed takes it on any device


class MuonZeRO(torch.optim.Optimizer):
    """Muon for matrices and expert stacks, AdamW for the rest, ZeRO-sharded the way V4 does it.

    Param groups carry a `role` (see muon_param_groups). Each rank runs backward() on its own
    micro-batch; step() (a collective, like the constructor) averages the gradients, updates the
    matrices this rank owns and gathers them: every rank ends identical. Hyperparameters as
    torch.optim.Muon and AdamW, except that a group's `momentum` is the gradient's moving-average
    coefficient in either rule (Muon's mu; AdamW's beta1: the same lerp) and `beta2` AdamW's
    second: torch's schedulers cycle one key per optimizer (OneCycleLR and CyclicLR: "momentum",
    unless the defaults hold "betas"), so Muon's momentum and AdamW's beta1 cycle together, as
    they do for torch.optim.Muon and AdamW. betas: the AdamW groups' default (momentum, beta2).
    zero_width: ranks sharing the dense matrices (divides the group); grad_sync: "bf16_sr" (V4's)
    or "exact" (float64 parameters need it: every buffer takes the
    parameters' dtype); max_grad_norm: clip the averaged gradient, in step(); seed: the rounding
    noise's. Checkpoints: state_dict(), gather_state_dict() and torch.distributed.checkpoint
    (see the appendix). amp's GradScaler hands itself to step(): the gradients are unscaled here
    and an overflow on any rank skips the step on every rank, each scaler told alike.
    """

    _step_supports_amp_scaling = True  # GradScaler.step calls step(grad_scaler=...) on every rank

    def __init__(
        self,
        params,
        lr=0.02,
        momentum=0.95,
        weight_decay=0.1,
        nesterov=True,
        ns_coefficients=V4_NS_COEFFICIENTS,
        ns_dtype=torch.bfloat16,
        update_rms=0.18,
        betas=(0.9, 0.95),
        eps=1e-8,
        zero_width=None,
        grad_sync="bf16_sr",
        process_group=None,
        balance="both",
        seed=0,
        max_grad_norm=None,
    ):
        ns = dict(ns_coefficients=ns_coefficients, ns_dtype=ns_dtype, update_rms=update_rms)
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, **ns)
        defaults.update(nesterov=nesterov, eps=eps, role="dense")
        self.adamw_betas = betas  # the AdamW groups' defaults (see add_param_group)
        super().__init__(params, defaults)
        if process_group is None and dist.is_initialized():
            process_group = dist.group.WORLD
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group) if process_group is not None else 1
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.grad_sync, self.max_grad_norm, self.seed = grad_sync, max_grad_norm, seed
        self.params = [p for g in self.param_groups for p in g["params"]]
        # the door: every local check, then one agreement collective; all ranks raise alike
        agreed = dict(zero_width=zero_width, balance=balance, grad_sync=grad_sync, betas=betas)
        agreed["max_grad_norm"] = max_grad_norm
        refused = plan_refusal(self.world_size, zero_width, balance)
        check_and_agree(self.param_groups, process_group, agreed, EXPERT_ROLES, refused)
        self.device = self.params[0].device
        self.built_for = [(tuple(p.shape), p.dtype, p.device) for p in self.params]
        self._place(zero_width, balance)
        self.momenta = None  # per kind, a stacked buffer per run; created in the first step
        self.steps = 0

    def _place(self, zero_width, balance):
        """V4's placement: who owns which matrix and AdamW tensor (self.plan), and per kind the
        chunks each collective moves (self.shards: Muon's kinds; self.adamw_shards)."""
        process_group = self.process_group
        # V4's matrices: dense in parameter order; experts flattened, all downs, then ups, gates.
        self.dense_matrices = [
            Slot(i, None, k, tuple(p.shape)) for i, p, k in self._params_of(("dense",))
        ]
        self.expert_matrices = [
            Slot(i, e, k, tuple(p.shape[1:]))
            for role in EXPERT_ROLES
            for i, p, k in self._params_of((role,))
            for e in range(p.size(0))
        ]
        adamw = self._params_of(("adamw",))
        shapes = [s.shape for s in self.dense_matrices], [s.shape for s in self.expert_matrices]
        adamw_shapes = [tuple(p.shape) for _, p, _ in adamw]
        self.plan = plan_muon(*shapes, self.world_size, zero_width, balance, adamw_shapes)
        self.adamw_blocks = [  # AdamW's tensors in blocks of rows, as the plan cut them
            Slot(adamw[t][0], None, adamw[t][2], block_shape(adamw_shapes[t], rows), 0, rows, j)
            for t, j, rows, _ in self.plan.adamw_blocks
        ]
        self.zero_width = zero_width = self.plan.zero_width  # None became the world size
        shard_group, replica_group = build_groups(process_group, self.world_size, zero_width)
        self.shards = []  # the same kinds on every rank: one owning none still joins
        if self.dense_matrices:  # reduce-scatter over my replica, all-reduce across replicas
            buckets = [[self.dense_matrices[i] for i in b] for b in self.plan.dense_buckets]
            replicas = dict(replica_group=replica_group, counted=self.rank < zero_width)
            replicas.update(device_type=self.device.type)
            mine = self.rank % zero_width
            self.shards.append(make_shards(buckets, mine, shard_group, zero_width, **replicas))
        if self.expert_matrices:  # reduce-scatter over every rank
            pieces = [self.expert_matrices[a:b] for a, b in self.plan.expert_ranges]
            self.shards.append(
                make_shards(pieces, self.rank, process_group, self.world_size, self.device.type)
            )
        # AdamW's blocks over every rank (ZeRO-1): no runs, an element-wise update
        dealt = back_to_back([[self.adamw_blocks[i] for i in b] for b in self.plan.adamw_buckets])
        self.adamw_shards = Shards(
            dealt, self.plan.adamw_chunk_numel, self.rank, [], process_group, self.world_size
        )

    def add_param_group(self, param_group):
        if getattr(self, "plan", None) is not None:
            raise ValueError("MuonZeRO plans ownership at construction: pass every param group")
        if param_group.get("role") == "adamw":  # AdamW's own defaults, from betas
            beta1, beta2 = self.adamw_betas
            param_group = {"momentum": beta1, "beta2": beta2, **param_group}
        super().add_param_group(param_group)

    def _params_of(self, roles):
        """(index into self.params, parameter, param-group index) of the groups with these roles."""
        index = {id(p): i for i, p in enumerate(self.params)}
        return [
            (index[id(p)], p, k)
            for k, g in enumerate(self.param_groups)
            if g["role"] in roles
            for p in g["params"]
        ]

    @property
    def steps(self):
        """Steps taken: the rounding noise's counter, kept in every param group so that each
        checkpoint format (flattened ones rebuild the groups from their keys) carries it."""
        return self.param_groups[0]["steps"]

    @steps.setter
    def steps(self, value):
        for g in self.param_groups:
            g["steps"] = value

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """One step of every parameter: agree which have gradients, then sharded_step for Muon's
        matrices and ZeRO-1 AdamW for the rest. The settings a scheduler changes between steps
        (lr, momentum, ...) and amp's overflow flags ride in the gradient mask's all-reduce, so
        ranks that drifted apart all raise before any steps, at no extra collective."""
        loss = None if closure is None else torch.enable_grad()(closure)()
        self._check_param_groups()
        for i, (p, built) in enumerate(zip(self.params, self.built_for)):  # local: agreed once
            if (now := (tuple(p.shape), p.dtype, p.device)) != built:
                raise ValueError(
                    f"parameter {i} is now {now}, but MuonZeRO was built for {built}: build the "
                    f"optimizer after moving or converting the model"
                )
        found_inf = unscale_for(grad_scaler, self)  # this rank's overflow flags, in the scaler
        digest = settings_digest(self.param_groups)
        agree = any(t.item() for t in found_inf), digest, -digest  # MAX of -digest: -(its MIN)
        grads = [p.grad for p in self.params]
        has_grad, (overflow, high, low) = agreed_grad_mask(
            grads, self.process_group, self.device, agree
        )
        if high != -low:  # the same on every rank: all raise, before any rank steps
            raise ValueError(
                "MuonZeRO: the ranks' param groups hold different settings (lr, momentum, ...); "
                "change them alike on every rank, e.g. step ReduceLROnPlateau on a metric "
                "all-reduced over the ranks"
            )
        for t in found_inf:  # the scaler backs off (or grows) as every other rank's does
            t.fill_(overflow)
        if overflow or not any(has_grad):
            return loss
        if self.momenta is None:
            self._new_momenta()
        adamw_grad = self._adamw_mean(grads)  # my chunk of AdamW's averaged gradient
        adamw_sq = adamw_grad.square().sum()  # my share of the clip norm; the others hold theirs
        if self.max_grad_norm is not None and self.world_size > 1:
            dist.all_reduce(adamw_sq, group=self.process_group)
        settings = [MuonSettings(*(g[k] for k in MuonSettings._fields)) for g in self.param_groups]
        noise = torch.Generator(self.device)
        noise.manual_seed(rounding_seed(self.seed, self.rank, self.steps))
        scale = sharded_step(
            self.shards,
            grads,
            [p.detach() for p in self.params],
            self.momenta,
            settings,
            has_grad,
            world_size=self.world_size,
            grad_sync=self.grad_sync,
            generator=noise,
            max_norm=self.max_grad_norm,
            replicated_sq=adamw_sq,
            process_group=self.process_group,
        )
        self._adamw_step(adamw_grad.mul_(scale), has_grad)
        self.steps += 1
        return loss

    # AdamW is element-wise, so ZeRO-1 is exact: reduce-scatter, update mine, all-gather.

    def _adamw_mean(self, grads):
        """My chunk [S] of AdamW's gradients averaged over the ranks, exact (empty: no AdamW)."""
        adamw, like = self.adamw_shards, self.params[0]
        if not self.adamw_blocks:
            return like.new_zeros(0)
        packed = pack_chunks(adamw.chunks, adamw.chunk_numel, grads, like)  # [W, S]
        return reduce_scatter_sum(packed, adamw.group, "exact", None).div_(self.world_size)

    def _adamw_step(self, grad, has_grad):
        """Update the AdamW blocks I own from my chunk of the gradient, then all-gather them.
        A tensor's step counts once however many of its blocks I own."""
        if not self.adamw_blocks:
            return
        adamw, params = self.adamw_shards, [p.detach() for p in self.params]
        values = pack_chunks([adamw.chunks[adamw.mine]], adamw.chunk_numel, params, grad)[0]
        mine = [s for s in adamw.chunks[adamw.mine] if has_grad[s.param]]
        for i in dict.fromkeys(s.param for s in mine):
            state = self.state[self.params[i]]
            state["step"] = state.get("step", 0) + 1
        for s in mine:
            span = slice(s.offset, s.offset + math.prod(s.shape))
            self._adamw_update(s, values[span].view(s.shape), grad[span].view(s.shape))
        unpack_chunks(all_gather_chunks(values, adamw.group, adamw.peers), adamw.chunks, params)

    def _adamw_update(self, block, param, grad):
        """One AdamW step of a block I own, in place; its moments ({block: tensor} in its
        tensor's state) created on its first."""
        g, state = self.param_groups[block.param_group], self.state[self.params[block.param]]
        moments = [state.setdefault(key, {}) for key in ("exp_avg", "exp_avg_sq")]
        for m in moments:
            m.setdefault(block.block, torch.zeros_like(param))
        hyper = dict(lr=g["lr"], betas=(g["momentum"], g["beta2"]), eps=g["eps"])
        exp_avg, exp_avg_sq = (m[block.block] for m in moments)
        adamw_update(
            param, grad, exp_avg, exp_avg_sq, state["step"], weight_decay=g["weight_decay"], **hyper
        )

    def _new_momenta(self):
        """Zero momentum: a stacked buffer [count, n, m] per run of mine. self.state shows each
        parameter's view of it (a matrix's [n, m]; a stack's {expert: [n, m]}), empty for what
        another rank owns: every rank's state is non-empty after a step, as torch's is (DCP's
        get_optimizer_state_dict steps, a collective here, an optimizer whose state is empty)."""
        self.momenta = [
            [self.params[0].new_zeros(len(r.slots), *r.shape) for r in shards.runs]
            for shards in self.shards
        ]
        for _, p, _ in self._params_of(ROLES):
            self.state.setdefault(p, {})
        for shards, buffers in zip(self.shards, self.momenta):
            for run, M in zip(shards.runs, buffers):
                for s, matrix in zip(run.slots, M):
                    state = self.state[self.params[s.param]]
                    if s.expert is None:
                        state["momentum_buffer"] = matrix
                    else:
                        state.setdefault("momentum_buffer", {})[s.expert] = matrix

    def state_dict(self):  # this rank's share, no collective (see the appendix)
        return self._hooked_state_dict(gather=False)

    def gather_state_dict(self):  # a collective: the whole state, on every rank
        return self._hooked_state_dict(gather=True)

    def _hooked_state_dict(self, gather):
        """state_of between the hooks registered with register_state_dict_pre/post_hook, run as
        torch.optim.Optimizer runs them: a post hook may return a new dict. (Optimizer keeps
        them in private dicts and has no public API to run them.)"""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state_dict = state_of(self, gather)
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        return state_dict

    def load_state_dict(self, state_dict):  # a share, a gathered dict, or a DCP template
        self._check_param_groups()
        state_dict = dict(state_dict)  # a shallow copy for the pre hooks to edit, as torch's
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        load_state(self, state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _check_param_groups(self):
        """Local (agreed once): param_groups still list the parameters planned at construction."""
        if [id(p) for g in self.param_groups for p in g["params"]] != list(map(id, self.params)):
            raise ValueError(
                "param_groups changed after MuonZeRO was built (a parameter added, removed or "
                "listed twice): ownership is planned at construction; build a new MuonZeRO"
            )

    def __deepcopy__(self, memo):
        """A working copy: every attribute copied (torch's copies only defaults, state and
        param_groups); process groups are shared, as they cannot be copied."""
        for group in self._process_groups():
            memo[id(group)] = group
        twin = memo[id(self)] = type(self).__new__(type(self))
        twin.__dict__.update(deepcopy(self.__dict__, memo))
        return twin

    def __getstate__(self):
        """Pickle every attribute but the hooks (as torch's); at one process only: a process
        group cannot be pickled."""
        if self.world_size > 1:
            raise TypeError(
                f"a MuonZeRO over {self.world_size} ranks cannot be pickled (its process groups "
                f"cannot): save state_dict() or gather_state_dict() and load it into a MuonZeRO "
                f"built on the new ranks (copy.deepcopy works within a process)"
            )
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_optimizer_")}
        state["shards"] = [replace(s, group=None, replica_group=None) for s in self.shards]
        state["adamw_shards"] = replace(self.adamw_shards, group=None)
        return dict(state, process_group=None)

    def __setstate__(self, state):
        super().__setstate__(state)  # torch's: the hooks, the step's wrapper
        if self.momenta is not None:  # pickle parts the state's views from the stacked buffers
            momenta = self.momenta
            self._new_momenta()
            for new, old in zip(self.momenta, momenta):
                for M, saved in zip(new, old):
                    M.copy_(saved)

    def _process_groups(self):
        shards = [*self.shards, self.adamw_shards]
        groups = [self.process_group] + [g for s in shards for g in (s.group, s.replica_group)]
        return [g for g in groups if g is not None]

    def local_state_tensors(self):
        """The state tensors this rank holds: its stacked Muon momenta and its AdamW moments."""
        states = [s for s in self.state.values() if isinstance(s, dict)]  # not a hook's extras
        moments = [
            m for s in states for k in ("exp_avg", "exp_avg_sq") if k in s for m in s[k].values()
        ]
        return [M for buffers in self.momenta or [] for M in buffers] + moments

    def state_bytes(self):
        return sum(t.numel() * t.element_size() for t in self.local_state_tensors())


# ==== appendix: the checks, checkpoints, then the demo (TinyMoE, models/tiny_moe.py) ==============
#
# The checks MuonZeRO's constructor makes through one call, check_and_agree, before any other
# collective: what a param group of each role must hold (check_group, which load_state_dict runs
# too), then one agreement collective, so that bad input is one clear ValueError on every rank
# instead of a hang. Agreed once; what may change between steps (a scheduler's settings, amp's
# overflow) rides in step's gradient-mask all-reduce, which it needs anyway.


def _finite(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _coefficient(v):  # a moving-average coefficient
    return _finite(v) and 0 <= v < 1


GROUP_RULES = {  # setting: (test, what it must be)
    "lr": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "momentum": (_coefficient, "a number in [0, 1) (Muon's momentum, AdamW's beta1)"),
    "beta2": (_coefficient, "a number in [0, 1) (AdamW's betas[1])"),
    "weight_decay": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "update_rms": (lambda v: _finite(v) and v > 0, "a finite number > 0"),
    "eps": (lambda v: _finite(v) and v > 0, "a finite number > 0"),
    "betas": (
        lambda v: False,
        "spelt momentum (beta1) and beta2 in a param group: the key torch's schedulers cycle "
        "is 'momentum' in every group",
    ),
    "ns_coefficients": (
        lambda v: len(v) > 0 and all(len(c) == 3 and all(map(_finite, c)) for c in v),
        "one or more finite (a, b, c)",
    ),
    "ns_dtype": (
        lambda v: isinstance(v, torch.dtype) and v.is_floating_point,
        "a floating torch dtype",
    ),
}
TENSOR_RULES = (  # (test of a tensor in a param group of this role, what is wrong and the fix)
    (
        lambda p, role, experts: p.dtype in (torch.float32, torch.float64),
        "MuonZeRO updates float32 parameters (float64 for exact checks): keep fp32 master "
        "weights, e.g. model.float()",
    ),
    (lambda p, role, experts: p.numel() > 0, "an empty tensor: leave it out of the optimizer"),
    (
        lambda p, role, experts: role != "dense" or p.ndim != 3,
        "a 3-D tensor declared 'dense': an expert stack [E, n, m] needs an expert role, e.g. "
        "'expert_up'; any other (a Conv1d's [out, in, k]) a role='adamw' param group "
        "(muon_param_groups routes both)",
    ),
    (
        lambda p, role, experts: role != "dense" or p.ndim == 2,
        "Muon needs [n, m] matrices: put it in a role='adamw' param group (muon_param_groups does)",
    ),
    (
        lambda p, role, experts: role not in experts or p.ndim == 3,
        "an expert role needs an expert stack [E, n, m]; a single matrix belongs in a 'dense' "
        "param group",
    ),
)


def check_group(k, g, expert_roles):
    """Raise ValueError for the first problem with param group k's role, settings or tensors."""
    roles = ("dense", *expert_roles, "adamw")
    if g["role"] not in roles:
        raise ValueError(f"param group {k}: role must be one of {roles}, got {g['role']!r}")
    if len({id(p) for p in g["params"]}) < len(g["params"]):  # torch warns; we'd plan it twice
        raise ValueError(f"param group {k} lists a parameter twice: list each parameter once")
    if torch.is_tensor(g.get("lr")):  # torch's tests read these words as a refusal
        raise ValueError(f"param group {k}: lr as a Tensor is not supported; pass a number")
    bad = [
        f"{key} must be {what}, got {g[key]!r}"
        for key, (ok, what) in GROUP_RULES.items()
        if key in g and not ok(g[key])
    ] + [
        f"a {p.dtype} tensor {tuple(p.shape)}: {what}"
        for p in g["params"]
        for ok, what in TENSOR_RULES
        if not ok(p, g["role"], expert_roles)
    ]
    if bad:
        raise ValueError(f"param group {k}: {bad[0]}")


def agreement_fields(param_groups, settings):
    """What every rank must hold alike, by name, with a digest of the initial values."""
    fields = dict(settings, param_groups=len(param_groups))
    for k, g in enumerate(param_groups):
        fields[f"param group {k} shapes"] = [tuple(p.shape) for p in g["params"]]
        fields[f"param group {k} dtypes"] = [str(p.dtype) for p in g["params"]]
        fields.update({f"param group {k} {key}": g[key] for key in sorted(g) if key != "params"})
        named = [(str(j), p) for j, p in enumerate(g["params"])]  # replicas start bitwise equal
        fields[f"param group {k} initial values"] = launch.weights_digest(named)
    return fields


def check_and_agree(param_groups, process_group, settings, expert_roles, plan_refused):
    """Every local check on this rank, then one agreement collective: all ranks raise together.
    settings: zero_width, balance, grad_sync, max_grad_norm, betas; plan_refused: why the
    chapter's plan refuses zero_width and balance (its message), or None."""
    if process_group is not None and dist.get_rank(process_group) < 0:
        raise ValueError("this rank is not a member of process_group; build MuonZeRO on members")
    params = [p for g in param_groups for p in g["params"]]
    grad_sync, max_grad_norm, betas = (settings[k] for k in ("grad_sync", "max_grad_norm", "betas"))
    error = None
    try:
        if grad_sync not in ("bf16_sr", "exact"):
            raise ValueError(f"grad_sync must be 'bf16_sr' (V4's) or 'exact', got {grad_sync!r}")
        if not (max_grad_norm is None or GROUP_RULES["eps"][0](max_grad_norm)):
            raise ValueError(f"max_grad_norm must be None or > 0, got {max_grad_norm!r}")
        pair = isinstance(betas, (tuple, list)) and len(betas) == 2
        if not (pair and all(map(_coefficient, betas))):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if plan_refused:
            raise ValueError(plan_refused)
        for k, g in enumerate(param_groups):
            check_group(k, g, expert_roles)
        if len(devices := {str(p.device) for p in params}) > 1:
            raise ValueError(f"parameters sit on several devices {sorted(devices)}; use one")
        if len(dtypes := {str(p.dtype) for p in params}) > 1:
            raise ValueError(f"parameters of several dtypes {sorted(dtypes)}; use one")
        if grad_sync == "bf16_sr" and params[0].dtype != torch.float32:
            raise ValueError(
                f"grad_sync='bf16_sr' rounds float32 gradients to bf16 (V4's): "
                f"{params[0].dtype} parameters need grad_sync='exact'"
            )
    except ValueError as err:
        error = str(err)
    launch.agree(agreement_fields(param_groups, settings), error, process_group, "MuonZeRO")


# ---- checkpoints ---------------------------------------------------------------------------------
#
# A state dict, by parameter index: AdamW's {"step", "exp_avg", "exp_avg_sq"}, whole when gathered,
# else each moment {block: rows} for the blocks of the tensor this rank owns (ADAMW_BLOCK_NUMEL);
# Muon's {"momentum_buffer"}: a matrix's momentum, or an expert stack's, whole [E, n, m] when
# gathered, else {expert: [n, m]} for the experts this rank owns; {} for what a rank lacks. Each
# param group carries "steps", the rounding noise's counter. torch.distributed.checkpoint needs
# nothing more: get_optimizer_state_dict(model, opt) names each rank's share by parameter names,
# dcp.save writes each key once, from a rank holding it (a tensor's owner; replicas deduplicated),
# and at any world size and zero width the new owners' template, filled by dcp.load key by key,
# goes to set_optimizer_state_dict: whole matrices and AdamW blocks move to their new owners.


def state_of(opt, gather):
    """The state dict above: this rank's share (the live tensors, as torch's state_dict() gives:
    no copy, no collective), or with gather a copy of the whole state (a collective)."""
    state = {i: {} for i in range(len(opt.params))}
    for i, p in enumerate(opt.params):
        for key, value in opt.state.get(p, {}).items():
            value = dict(value) if isinstance(value, dict) else value  # a stack's {expert: [n, m]}
            state[i][key] = value.clone() if gather and torch.is_tensor(value) else value
    for shards, buffers in zip(opt.shards, opt.momenta if gather and opt.momenta else []):
        values = opt.params[0].new_zeros(shards.chunk_numel)  # my momenta, laid out as in the step
        for run, M in zip(shards.runs, buffers):
            values[run.offset : run.offset + M.numel()] = M.flatten()
        whole = {s.param: torch.zeros_like(opt.params[s.param]) for c in shards.chunks for s in c}
        unpack_chunks(all_gather_chunks(values, shards.group, shards.peers), shards.chunks, whole)
        for i, momentum_buffer in whole.items():
            state[i]["momentum_buffer"] = momentum_buffer
    if gather and opt.adamw_blocks:
        gather_adamw(opt, state)
    state.update((k, v) for k, v in opt.state.items() if not torch.is_tensor(k))  # hooks', as torch
    groups, start, number = [], 0, {}
    keys = dict.fromkeys(sorted({k for g in opt.param_groups for k in g}))  # None: not this role's
    for g in opt.param_groups:  # each group every key: DCP fills groups by index, not by role
        for i, p in enumerate(g["params"], start):
            number.setdefault(id(p), i)  # listed twice: numbered once, as torch numbers it
        params = [number[id(p)] for p in g["params"]]
        groups.append({**keys, **g, "params": params, "steps": opt.steps})
        start += len(g["params"])
    return {"state": state, "param_groups": groups}


def gather_adamw(opt, state):
    """Every AdamW tensor's step and moments, whole, into `state` (a collective): the owners'
    blocks all-gathered, each tensor's step the largest any rank holds (0: never stepped)."""
    shards, like = opt.adamw_shards, opt.params[0]
    tensors = list(dict.fromkeys(s.param for s in opt.adamw_blocks))
    held = {i: opt.state.get(opt.params[i], {}) for i in tensors}
    steps = torch.tensor([int(held[i].get("step", 0)) for i in tensors], device=like.device)
    if opt.world_size > 1:
        dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=opt.process_group)
    whole = {}
    for key in ("exp_avg", "exp_avg_sq"):
        values = like.new_zeros(shards.chunk_numel)  # my blocks' moments, laid out as in the step
        for s in shards.chunks[shards.mine]:
            if (m := held[s.param].get(key, {}).get(s.block)) is not None:
                values[s.offset : s.offset + m.numel()] = m.flatten()
        whole[key] = {i: torch.zeros_like(opt.params[i]) for i in tensors}
        gathered = all_gather_chunks(values, shards.group, shards.peers)
        unpack_chunks(gathered, shards.chunks, whole[key])
    for i, step in zip(tensors, steps.tolist(), strict=True):
        if step:
            state[i] = {"step": step, **{key: whole[key][i] for key in whole}}


def saved_block(held, block):
    """An AdamW block's moment in a saved one: rows of the whole tensor (a gathered dict's), or
    its entry in {block: tensor} (a share's), None if absent."""
    if not isinstance(held, dict):
        return block.of({block.param: torch.as_tensor(held)})
    return held.get(block.block, held.get(str(block.block)))


def _as_group_value(key, value):
    """Undo what a text round trip does to a hyperparameter (lists for tuples, dtype names)."""
    if key == "ns_dtype" and isinstance(value, str):
        return getattr(torch, value.replace("torch.", ""))
    if key == "ns_coefficients" and isinstance(value, list):
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return value


def load_state(opt, state_dict):
    """Load a share saved at this world size and zero width, a gathered dict (any) or a template
    dcp.load filled. State keys: indices, their text, or the names in param_groups' "params"
    (DCP's). Momentum this rank owns but the dict lacks raises rather than start from zero."""
    saved = state_dict["param_groups"]
    there = [(g.get("role"), len(g["params"])) for g in saved]
    here = [(g["role"], len(g["params"])) for g in opt.param_groups]
    if there != here:  # DCP's template matches groups by their parameters: then roles differ
        raise ValueError(
            f"the state_dict's param groups (role, parameters) {there} are laid out otherwise "
            f"than this optimizer's {here}: build the param groups as they were saved, or save "
            f"and load through torch.distributed.checkpoint with StateDictOptions("
            f"flatten_optimizer_state_dict=True), which keys each setting by parameter"
        )
    index = {}
    for i, key in enumerate(key for g in saved for key in g["params"]):
        index[key] = index[str(key)] = i
    # a parameter's state (a dict) must name a parameter; anything else is kept as torch keeps it
    unknown = [k for k, v in state_dict["state"].items() if k not in index and isinstance(v, dict)]
    if unknown:
        raise ValueError(f"state_dict keys {unknown[:4]} name no parameter of its param_groups")
    state = {index[key]: entry for key, entry in state_dict["state"].items() if key in index}
    extras = {k: v for k, v in state_dict["state"].items() if k not in index}
    settings = [
        {
            key: _as_group_value(key, v)
            for key, v in s.items()
            if key not in ("params", "steps") and v is not None  # None: another role's key
        }
        for s in saved
    ]
    for k, (g, s) in enumerate(zip(opt.param_groups, settings)):
        check_group(k, {**g, **s}, EXPERT_ROLES)

    def saved_momentum(s):  # slot s's momentum in the dict, or None
        held = state.get(s.param, {}).get("momentum_buffer")
        if s.expert is None or held is None:
            return held
        if torch.is_tensor(held):  # a whole stack
            return held[s.expert]
        return held.get(s.expert, held.get(str(s.expert)))  # its text after a JSON round trip

    owned = [s for shards in opt.shards for run in shards.runs for s in run.slots]
    momenta = [saved_momentum(s) for s in owned]
    missing = [
        f"parameter {s.param}" + ("" if s.expert is None else f" expert {s.expert}")
        for s, m in zip(owned, momenta)
        if m is None
    ]
    has_momentum = any("momentum_buffer" in entry for entry in state.values())
    if has_momentum and missing:
        raise ValueError(
            f"state_dict holds no momentum for {len(missing)} matrices this rank "
            f"owns ({', '.join(missing[:4])}): a state_dict() is one rank's share; "
            f"to resume at another world size or zero width save gather_state_dict(), "
            f"or use torch.distributed.checkpoint (get_optimizer_state_dict, "
            f"dcp.save, dcp.load, set_optimizer_state_dict)"
        )
    for g, s in zip(opt.param_groups, settings):
        g.update(s)
    opt.steps = max((g.get("steps", 0) for g in saved), default=0)
    opt.state.clear()
    opt.state.update(extras)
    for s in opt.adamw_shards.chunks[opt.adamw_shards.mine]:  # another rank's: its owner loads
        entry, p = state.get(s.param, {}), opt.params[s.param]
        if "exp_avg" not in entry:  # never stepped
            continue
        target = opt.state.setdefault(p, {})
        target["step"] = entry["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            if (block := saved_block(entry[key], s)) is None:
                raise ValueError(
                    f"state_dict holds no AdamW {key} for block {s.block} of parameter {s.param}, "
                    f"which this rank owns: a state_dict() is one rank's share; to resume at "
                    f"another world size save gather_state_dict(), or use "
                    f"torch.distributed.checkpoint"
                )
            target.setdefault(key, {})[s.block] = torch.as_tensor(block).to(p).clone()
    opt.momenta = None
    if has_momentum:  # new buffers, then copies: a DCP template's tensors are views of the old
        opt._new_momenta()
        for s, momentum_buffer in zip(owned, momenta):
            held = opt.state[opt.params[s.param]]["momentum_buffer"]
            (held if s.expert is None else held[s.expert]).copy_(torch.as_tensor(momentum_buffer))


@contextlib.contextmanager
def torch_muon_newton_schulz_in(dtype):
    """torch.optim.Muon, the reference the tests and compose.py prove against, computes
    Newton-Schulz in bf16 whatever the parameters' dtype; inside this context, the same iteration
    in `dtype` (its code with the one cast changed), so a float32 or float64 proof can be exact."""
    import torch.optim._muon as tm  # torch has no public option for Muon's Newton-Schulz dtype

    bf16 = tm._zeropower_via_newtonschulz

    def ns(grad, coefficients, steps, eps):
        a, b, c = coefficients
        X = grad.to(dtype)
        X = X.T if grad.size(0) > grad.size(1) else X
        X = X / X.norm().clamp(min=eps)
        for _ in range(steps):
            A = X @ X.T
            X = torch.addmm(X, torch.addmm(A, A, A, beta=b, alpha=c), X, beta=a)
        return X.T if grad.size(0) > grad.size(1) else X

    tm._zeropower_via_newtonschulz = bf16 if dtype == torch.bfloat16 else ns
    try:
        yield
    finally:
        tm._zeropower_via_newtonschulz = bf16


def format_plan(plan):
    """One line per rank: matrices, elements and padding (matrix entries), NS cost, NS calls;
    with AdamW's tensors in the plan, the elements of its blocks and their padding too."""
    rows = [("rank", "replica", "pos", "dense mats", "expert mats", "elements owned")]
    rows[0] += ("dense pad elems", "expert pad elems", "NS MACs/iter", "NS calls")
    rows[0] += ("AdamW elems", "AdamW pad elems") if plan.adamw_blocks else ()
    for r in range(plan.world_size):
        dense, experts = plan.owned(r)
        shapes = [plan.dense_shapes[i] for i in dense] + [plan.expert_shapes[i] for i in experts]
        d, e = sum(map(math.prod, shapes[: len(dense)])), sum(map(math.prod, shapes[len(dense) :]))
        pads = plan.dense_bucket_numel - d, plan.expert_chunk_numel - e
        owner = r, r // plan.zero_width, r % plan.zero_width, len(dense), len(experts)
        cost = f"{sum(map(ns_cost, shapes)):.3g}", len([k for k, _ in groupby(shapes)])
        rows.append((*owner, *(f"{n:,}" for n in (d + e, *pads)), *cost))
        if plan.adamw_blocks:
            held = plan.adamw_numel(r)
            rows[-1] += (f"{held:,}", f"{plan.adamw_chunk_numel - held:,}")
    widths = [max(len(h), 6) for h in rows[0]]
    return "\n".join(" ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows)


MAX_DEMO_SEQ = 4096  # the demo's attention costs seq² per sequence and step


def parse_args(argv=None):
    """The demo's options, each checked before any work (a one-line usage error)."""
    world, count = int(os.environ.get("WORLD_SIZE", "1")), launch.at_least(1)
    about = "Train a small MoE with MuonZeRO on every rank (V4 §3.4.1)."
    parser = launch.add_launch_options(argparse.ArgumentParser(description=about))
    add = parser.add_argument
    add("--steps", type=count, default=40, help="optimizer steps (default: %(default)s)")
    batch = "global batch in sequences (default: 24, rounded up to a multiple of the ranks)"
    add("--batch", type=count, default=-(-24 // world) * world, help=batch)
    seq = f"tokens per sequence, at most {MAX_DEMO_SEQ} (default: %(default)s)"
    add("--seq", type=count, default=16, help=seq)
    width = "ranks sharing the dense matrices (default: N/2 for even N > 2, else N)"
    half = world // 2 if world % 2 == 0 and world > 2 else world
    add("--zero-width", type=count, default=half, help=width)
    sync = "gradient exchange: V4's bf16 stochastic rounding, or exact (default: %(default)s)"
    add("--grad-sync", choices=("bf16_sr", "exact"), default="bf16_sr", help=sync)
    lr = "Muon's learning rate; AdamW's is 3e-3 (default: %(default)s)"
    add("--lr", type=launch.positive, default=0.02, help=lr)
    clip = "clip the averaged gradient to this norm (default: no clipping)"
    add("--max-grad-norm", type=launch.positive, help=clip)
    args = launch.check_launch_options(parser, parser.parse_args(argv))
    if args.seq > MAX_DEMO_SEQ:
        parser.error(f"--seq {args.seq}: pass at most {MAX_DEMO_SEQ}")
    if args.batch % world:
        parser.error(
            f"--batch {args.batch} does not split evenly over {world} ranks; pass a "
            f"multiple of {world}"
        )
    if world % args.zero_width:
        parser.error(f"--zero-width {args.zero_width} must divide the {world} ranks")
    return args


def demo(args, rank, world, device):
    start, per_rank = time.perf_counter(), args.batch // world
    model = TinyMoE().to(device)  # launch.setup seeded every rank alike: the same initial model
    groups = [{**g, "lr": 3e-3} if g["role"] == "adamw" else g for g in muon_param_groups(model)]
    sync = dict(zero_width=args.zero_width, grad_sync=args.grad_sync)
    opt = MuonZeRO(groups, lr=args.lr, max_grad_norm=args.max_grad_norm, **sync)
    replicas = world // opt.zero_width
    launch.say(
        f"{world} rank(s) = {replicas} replica(s) x zero width {opt.zero_width}; "
        "the plan (elements):"
    )
    launch.say(format_plan(opt.plan))
    data = torch.Generator().manual_seed(1)
    for step in range(1, args.steps + 1):
        tokens, targets = demo_batch(args.batch, args.seq, 64, data)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        x, y = tokens[rows].to(device), targets[rows].to(device)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        dist.all_reduce(mean_loss := loss.detach() / world)
        if step % 5 == 1 or step == args.steps:
            took = time.perf_counter() - start
            launch.say(f"step {step:3d}  loss {mean_loss.item():.4f}  ({took:.1f} s)")
    n_adamw = sum(p.numel() for g in opt.param_groups if g["role"] == "adamw" for p in g["params"])
    muon, adam = 4 * (sum(p.numel() for p in opt.params) - n_adamw), 8 * n_adamw  # fp32 buffers
    held = all_gather_chunks(torch.tensor([float(opt.state_bytes())], device=device), None, world)
    unsharded = f"{muon + adam:,} (Muon momentum {muon:,} + AdamW moments {adam:,})"
    launch.say(
        f"optimizer state held per rank (bytes): {held.long().flatten().tolist()}  vs "
        f"unsharded {unsharded}"
    )
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    same = all(torch.equal(flat, other) for other in all_gather_chunks(flat, None, world))
    launch.say(f"parameters bitwise identical on all {world} ranks: {same}")
    if not same:
        raise SystemExit("replicas diverged")


if __name__ == "__main__":
    launch.run(demo, parse_args())
