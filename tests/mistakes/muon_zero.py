"""Plausible wrong solutions for muon_zero.py's regions, each with the first line it must get."""

from tests.mistakes import Mistake

NS_TAIL = """
for a, b, c in coefficients:
    gram = Y @ Y.mT
    Y = a * Y + (b * gram + c * gram @ gram) @ Y
if tall:
    Y = Y.mT
return Y if X.ndim == 3 else Y.squeeze(0)
### END SOLUTION
"""

SR_BODY = """
### BEGIN SOLUTION
noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
rounded = ((x.view(torch.int32) + noise) & -65536).view(torch.float32)
rounded = torch.where(torch.isfinite(x), rounded.clamp(-BF16_MAX, BF16_MAX), x)
return rounded.to(torch.bfloat16)
### END SOLUTION
"""

PACK_BODY = """
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
    q = min(range(zero_width), key=lambda k: (load(cost[k] + costs[i], numel[k] + numels[i]), k))
    buckets[q].append(i)
    cost[q] += costs[i]
    numel[q] += numels[i]
return [sorted(b, key=lambda i: (tuple(shapes[i]), i)) for b in buckets]
### END SOLUTION
"""

SHARDED_BODY = """
### BEGIN SOLUTION
like, means = params[0], []
for shards in kinds:
    packed = pack(shards.chunks, shards.chunk_numel, grads, like)
    summed = reduce_scatter_sum(packed, shards.group, grad_sync, generator)
    if shards.replica_group is not None:
        dist.all_reduce(summed, group=shards.replica_group)
    means.append(summed.div_(world_size))
scale = like.new_ones(())
if max_norm is not None:
    sq = sum((m.square().sum() for m, s in zip(means, kinds) if s.counted), 0 * scale)
    if world_size > 1:
        dist.all_reduce(sq, group=process_group)
    scale = (max_norm / ((sq + replicated_sq).sqrt() + 1e-6)).clamp(max=1.0)
    for mean_grad in means:
        mean_grad.mul_(scale)
for shards, mean_grad, buffers in zip(kinds, means, momenta):
    values = pack([shards.chunks[shards.mine]], shards.chunk_numel, params, like)[0]
    for run, M in zip(shards.runs, buffers):
        span = slice(run.offset, run.offset + M.numel())
        run_settings = [settings[s.param_group] for s in run.slots]
        active = [has_grad[s.param] for s in run.slots]
        update_run(mean_grad[span].view_as(M), values[span].view_as(M), M, run_settings, active)
    unpack(all_gather_chunks(values, shards.group, shards.peers), shards.chunks, params)
return scale
### END SOLUTION
"""


def _swap(body, old, new):
    assert old in body, old
    return body.replace(old, new)


MISTAKES = [
    # newton_schulz
    Mistake(
        region="muon_zero.newton_schulz",
        name="tall matrices iterated as they are (the large Gram matrix)",
        message="tall matrices must be orthogonalised in their wide orientation",
        body="""
### BEGIN SOLUTION
Y = (X if X.ndim == 3 else X.unsqueeze(0)).to(dtype)
Y = Y / Y.norm(dim=(-2, -1), keepdim=True).clamp_min(eps)
tall = False
"""
        + NS_TAIL,
    ),
    Mistake(
        region="muon_zero.newton_schulz",
        name="no Frobenius normalisation",
        message="divided by its Frobenius norm",
        body="""
### BEGIN SOLUTION
Y = (X if X.ndim == 3 else X.unsqueeze(0)).to(dtype)
tall = Y.size(-2) > Y.size(-1)
if tall:
    Y = Y.mT
"""
        + NS_TAIL,
    ),
    Mistake(
        region="muon_zero.newton_schulz",
        name="a batch normalised by the norm of the whole stack",
        message="each matrix of a batch must be normalised by its own norm",
        body="""
### BEGIN SOLUTION
Y = (X if X.ndim == 3 else X.unsqueeze(0)).to(dtype)
tall = Y.size(-2) > Y.size(-1)
if tall:
    Y = Y.mT
Y = Y / Y.norm().clamp_min(eps)
"""
        + NS_TAIL,
    ),
    Mistake(
        region="muon_zero.newton_schulz",
        name="computed in fp32 whatever `dtype` says",
        message="newton_schulz must compute in `dtype`",
        body="""
### BEGIN SOLUTION
Y = (X if X.ndim == 3 else X.unsqueeze(0)).float()
tall = Y.size(-2) > Y.size(-1)
if tall:
    Y = Y.mT
Y = Y / Y.norm(dim=(-2, -1), keepdim=True).clamp_min(eps)
"""
        + NS_TAIL,
    ),
    # muon_update
    Mistake(
        region="muon_zero.muon_update",
        name="no Nesterov look-ahead (always the buffer)",
        message="X = lerp(G, M, momentum) with Nesterov",
        body="""
### BEGIN SOLUTION
momentum_buffer.lerp_(grad, 1 - momentum)
X = momentum_buffer
scale = update_rms * math.sqrt(max(X.shape[-2:]))
return newton_schulz(X, coefficients, ns_dtype).to(X.dtype) * scale
### END SOLUTION
""",
    ),
    Mistake(
        region="muon_zero.muon_update",
        name="V4's raw momentum M = mu M + G in the buffer",
        message="torch.optim.Muon's average form",
        body="""
### BEGIN SOLUTION
momentum_buffer.mul_(momentum).add_(grad)
X = grad + momentum * momentum_buffer if nesterov else momentum_buffer
scale = update_rms * math.sqrt(max(X.shape[-2:]))
return newton_schulz(X, coefficients, ns_dtype).to(X.dtype) * scale
### END SOLUTION
""",
    ),
    Mistake(
        region="muon_zero.muon_update",
        name="RMS scale by sqrt(min(n, m))",
        message="the update must be NS(X)·sqrt(max(n, m))·update_rms",
        body="""
### BEGIN SOLUTION
momentum_buffer.lerp_(grad, 1 - momentum)
X = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
scale = update_rms * math.sqrt(min(X.shape[-2:]))
return newton_schulz(X, coefficients, ns_dtype).to(X.dtype) * scale
### END SOLUTION
""",
    ),
    # stochastic_round_to_bf16
    Mistake(
        region="muon_zero.stochastic_round_to_bf16",
        name="round to nearest",
        message="rounding must be stochastic",
        body="""
### BEGIN SOLUTION
return x.to(torch.bfloat16)
### END SOLUTION
""",
    ),
    Mistake(
        region="muon_zero.stochastic_round_to_bf16",
        name="noise over half the dropped range (biased down)",
        message="rounding is biased",
        body=_swap(SR_BODY, "1 << 16", "1 << 15"),
    ),
    Mistake(
        region="muon_zero.stochastic_round_to_bf16",
        name="no saturation next to the bf16 maximum",
        message="must not become Inf",
        body=_swap(SR_BODY, "rounded.clamp(-BF16_MAX, BF16_MAX)", "rounded"),
    ),
    Mistake(
        region="muon_zero.stochastic_round_to_bf16",
        name="the global generator instead of `generator`",
        message="the rounding noise must come from `generator`",
        body=_swap(SR_BODY, "generator=generator", "generator=None"),
    ),
    # pack_dense
    Mistake(
        region="muon_zero.pack_dense",
        name="`balance` ignored (always both loads)",
        message="pack_dense must balance what `balance` names",
        body=_swap(
            PACK_BODY, 'balance in ("ns_cost", "both"), balance in ("numel", "both")', "True, True"
        ),
    ),
    Mistake(
        region="muon_zero.pack_dense",
        name="smallest matrices first",
        message="heaviest matrices first",
        body=_swap(
            PACK_BODY,
            "key=lambda i: (-load(costs[i], numels[i]), i))",
            "key=lambda i: (load(costs[i], numels[i]), i))",
        ),
    ),
    Mistake(
        region="muon_zero.pack_dense",
        name="bucket sorted by parameter index, not by shape",
        message="identical shapes must sit together",
        body=_swap(PACK_BODY, "sorted(b, key=lambda i: (tuple(shapes[i]), i))", "sorted(b)"),
    ),
    # split_experts
    Mistake(
        region="muon_zero.split_experts",
        name="floor boundaries (the last boundary at or below k/W)",
        message="must end at the matrix boundary nearest",
        body="""
### BEGIN SOLUTION
total, prefix = sum(numels), [0]
for n in numels:
    prefix.append(prefix[-1] + n)
cuts = [0]
for k in range(1, world_size):
    j = bisect.bisect_right(prefix, total * k / world_size) - 1
    cuts.append(max(j, cuts[-1]))
cuts.append(len(numels))
return [(cuts[k], cuts[k + 1]) for k in range(world_size)]
### END SOLUTION
""",
    ),
    Mistake(
        region="muon_zero.split_experts",
        name="equal numbers of experts, sizes ignored",
        message="must end at the matrix boundary nearest",
        body="""
### BEGIN SOLUTION
cuts = [round(len(numels) * k / world_size) for k in range(world_size + 1)]
return [(cuts[k], cuts[k + 1]) for k in range(world_size)]
### END SOLUTION
""",
    ),
    # sharded_step
    Mistake(
        region="muon_zero.sharded_step",
        name="dense buckets not summed across replica groups",
        message="summed across the replicas",
        body=_swap(
            SHARDED_BODY,
            "        dist.all_reduce(summed, group=shards.replica_group)\n",
            "        pass\n",
        ),
    ),
    Mistake(
        region="muon_zero.sharded_step",
        name="updated chunks never all-gathered",
        message="all-gathered",
        body=_swap(
            SHARDED_BODY,
            "all_gather_chunks(values, shards.group, shards.peers), shards.chunks,",
            "values.unsqueeze(0), [shards.chunks[shards.mine]],",
        ),
    ),
    Mistake(
        region="muon_zero.sharded_step",
        name="parameters without a gradient anywhere still stepped",
        message="must not move",
        body=_swap(
            SHARDED_BODY, "[has_grad[s.param] for s in run.slots]", "[True] * len(run.slots)"
        ),
    ),
    Mistake(
        region="muon_zero.sharded_step",
        name="the replicas' sum averaged, then divided by world_size again",
        message="the reduced gradient of",
        body=_swap(
            SHARDED_BODY,
            "        dist.all_reduce(summed, group=shards.replica_group)\n",
            "        dist.all_reduce(summed, group=shards.replica_group)\n"
            "        summed.div_(dist.get_world_size(shards.replica_group))\n",
        ),
    ),
    Mistake(
        region="muon_zero.sharded_step",
        name="the squared gradient norm averaged over the ranks, not summed",
        message="the clip factor",
        body=_swap(
            SHARDED_BODY,
            "        dist.all_reduce(sq, group=process_group)\n",
            "        dist.all_reduce(sq, group=process_group)\n        sq = sq / world_size\n",
        ),
    ),
    Mistake(
        region="muon_zero.sharded_step",
        name="replica buckets counted once per replica in the clip norm",
        message="the clip factor",
        body=_swap(SHARDED_BODY, "zip(means, kinds) if s.counted)", "zip(means, kinds))"),
    ),
    Mistake(
        region="muon_zero.sharded_step",
        name="replica buckets left out of the clip norm",
        message="the clip factor",
        body=_swap(
            SHARDED_BODY,
            "zip(means, kinds) if s.counted)",
            "zip(means, kinds) if s.replica_group is None)",
        ),
    ),
    Mistake(
        region="muon_zero.sharded_step",
        name="AdamW's gradients left out of the clip norm",
        message="the clip factor",
        body=_swap(SHARDED_BODY, "(sq + replicated_sq).sqrt()", "sq.sqrt()"),
    ),
    Mistake(
        region="muon_zero.sharded_step",
        name="the norm's all-reduce over the whole world, not process_group",
        message="collectives must stay inside process_group",
        body=_swap(
            SHARDED_BODY,
            "    if world_size > 1:\n        dist.all_reduce(sq, group=process_group)\n",
            "    dist.all_reduce(sq)\n",
        ),
    ),
]
