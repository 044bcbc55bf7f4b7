"""Plausible wrong solutions for muon_zero.py's regions, each with the first line it must get."""

from tests.mistakes import Mistake

MISTAKES = [
    # newton_schulz
    Mistake(
        region="muon_zero.newton_schulz",
        name="tall matrices iterated as they are (the large Gram matrix)",
        message="tall matrices must be orthogonalised in their wide orientation",
        edits=(("tall = Y.size(-2) > Y.size(-1)", "tall = False"),),
    ),
    Mistake(
        region="muon_zero.newton_schulz",
        name="no Frobenius normalisation",
        message="divided by its Frobenius norm",
        edits=(("Y = Y / Y.norm(dim=(-2, -1), keepdim=True).clamp_min(eps)\n", ""),),
    ),
    Mistake(
        region="muon_zero.newton_schulz",
        name="a batch normalised by the norm of the whole stack",
        message="each matrix of a batch must be normalised by its own norm",
        edits=(("Y.norm(dim=(-2, -1), keepdim=True)", "Y.norm()"),),
    ),
    Mistake(
        region="muon_zero.newton_schulz",
        name="computed in fp32 whatever `dtype` says",
        message="newton_schulz must compute in `dtype`",
        edits=(("torch.ldexp(Y, -exponent).to(dtype)", "torch.ldexp(Y, -exponent)"),),
    ),
    # muon_update
    Mistake(
        region="muon_zero.muon_update",
        name="no Nesterov look-ahead (always the buffer)",
        message="X = lerp(G, M, momentum) with Nesterov",
        edits=(
            (
                "grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer",
                "momentum_buffer",
            ),
        ),
    ),
    Mistake(
        region="muon_zero.muon_update",
        name="V4's raw momentum M = mu M + G in the buffer",
        message="torch.optim.Muon's average form",
        edits=(
            ("lerp_(grad, 1 - momentum)", "mul_(momentum).add_(grad)"),
            ("grad.lerp(momentum_buffer, momentum)", "grad + momentum * momentum_buffer"),
        ),
    ),
    Mistake(
        region="muon_zero.muon_update",
        name="RMS scale by sqrt(min(n, m))",
        message="the update must be NS(X)·sqrt(max(n, m))·update_rms",
        edits=(("max(X.shape[-2:]))", "min(X.shape[-2:]))"),),
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
        edits=(("<< 16, x.shape,", "<< 15, x.shape,"),),
    ),
    Mistake(
        region="muon_zero.stochastic_round_to_bf16",
        name="no saturation next to the bf16 maximum",
        message="must not become Inf",
        edits=(("rounded.clamp(-BF16_MAX, BF16_MAX),", "rounded,"),),
    ),
    Mistake(
        region="muon_zero.stochastic_round_to_bf16",
        name="the global generator instead of `generator`",
        message="the rounding noise must come from `generator`",
        edits=(("generator=generator", "generator=None"),),
    ),
    # pack_dense
    Mistake(
        region="muon_zero.pack_dense",
        name="`balance` ignored (always both loads)",
        message="pack_dense must balance what `balance` names",
        edits=(('balance in ("ns_cost", "both"), balance in ("numel", "both")', "True, True"),),
    ),
    Mistake(
        region="muon_zero.pack_dense",
        name="smallest matrices first",
        message="heaviest matrices first",
        edits=(("(-load(costs[i],", "(load(costs[i],"),),
    ),
    Mistake(
        region="muon_zero.pack_dense",
        name="bucket sorted by parameter index, not by shape",
        message="identical shapes must sit together",
        edits=(("b, key=lambda i: (tuple(shapes[i]), i))", "b)"),),
    ),
    # split_experts
    Mistake(
        region="muon_zero.split_experts",
        name="floor boundaries (the last boundary at or below k/W)",
        message="must end at the matrix boundary nearest",
        edits=(
            (
                (
                    "    target = total * k / world_size\n"
                    "    j = bisect.bisect_left(prefix, target)  # first boundary at"
                    " or past the target\n"
                    "    if j > 0 and (j > len(numels) or target - prefix[j - 1] <="
                    " prefix[j] - target):\n"
                    "        j -= 1  # the boundary before it is nearer"
                ),
                "    j = bisect.bisect_right(prefix, total * k / world_size) - 1",
            ),
        ),
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
        edits=(("dist.all_reduce(summed, group=shards.replica_group)", "pass"),),
    ),
    Mistake(
        region="muon_zero.sharded_step",
        name="updated chunks never all-gathered",
        message="all-gathered",
        edits=(
            (
                "all_gather_chunks(values, shards.group, shards.peers), shards.chunks,",
                "values.unsqueeze(0), [shards.chunks[shards.mine]],",
            ),
        ),
    ),
    Mistake(
        region="muon_zero.sharded_step",
        name="parameters without a gradient anywhere still stepped",
        message="must not move",
        edits=(("has_grad[s.param] for s in run.slots]", "True] * len(run.slots)"),),
    ),
    Mistake(
        region="muon_zero.sharded_step",
        name="the replicas' sum averaged, then divided by world_size again",
        message="the reduced gradient of",
        edits=(
            (
                "        dist.all_reduce(summed, group=shards.replica_group)",
                (
                    "        dist.all_reduce(summed, group=shards.replica_group)\n"
                    "        summed.div_(dist.get_world_size(shards.replica_group))"
                ),
            ),
        ),
    ),
    Mistake(
        region="muon_zero.sharded_step",
        name="the squared gradient norm averaged over the ranks, not summed",
        message="the clip factor",
        edits=(
            (
                "        dist.all_reduce(sq, group=process_group)",
                ("        dist.all_reduce(sq, group=process_group)\n        sq = sq / world_size"),
            ),
        ),
    ),
    Mistake(
        region="muon_zero.sharded_step",
        name="replica buckets counted once per replica in the clip norm",
        message="the clip factor",
        edits=(("kinds) if s.counted),", "kinds)),"),),
    ),
    Mistake(
        region="muon_zero.sharded_step",
        name="replica buckets left out of the clip norm",
        message="the clip factor",
        edits=(("if s.counted), 0", "if s.replica_group is None), 0"),),
    ),
    Mistake(
        region="muon_zero.sharded_step",
        name="AdamW's gradients left out of the clip norm",
        message="the clip factor",
        edits=(("((sq + replicated_sq).sqrt()", "(sq.sqrt()"),),
    ),
    Mistake(
        region="muon_zero.sharded_step",
        name="the norm's all-reduce over the whole world, not process_group",
        message="collectives must stay inside process_group",
        edits=(
            (
                ("    if world_size > 1:\n        dist.all_reduce(sq, group=process_group)"),
                "    dist.all_reduce(sq)",
            ),
        ),
    ),
]
