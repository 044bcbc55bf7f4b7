"""compose's agreement at every step, before the update: one all-gather of three numbers per rank
(the replica's batch digest, the loss, the first non-finite gradient) gives every rank the same
verdict, so a run stops with the same one line everywhere (Refused) and no rank is left waiting.
compose.train_step calls agreed_loss(); nothing here imports compose.
"""

import math

import torch
import torch.distributed as dist

import launch


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
    dist.all_gather(gathered, numbers)  # only the last stage's C x D ranks add a loss
    return check_step(step, torch.stack(gathered).cpu(), cfg, layout, model, allow_nonfinite)
