"""Correct bodies for muon_zero.py's regions, each written unlike the reference."""

from tests.alternatives import Alternative

ALTERNATIVES = [
    Alternative(
        region="muon_zero.newton_schulz",
        name="log2 prescale, transpose(-2, -1), A·(A·X) instead of A²·X",
        body="""
### BEGIN SOLUTION
Z = X.unsqueeze(0) if X.ndim == 2 else X
Z = Z.double() if Z.dtype == torch.float64 else Z.float()
peak = Z.abs().flatten(1).max(dim=1).values.view(-1, 1, 1)
shift = torch.floor(torch.log2(peak.clamp_min(torch.finfo(Z.dtype).tiny))) + 1
Z = (Z * torch.exp2(-shift)).to(dtype)
flip = X.shape[-2] > X.shape[-1]
if flip:
    Z = Z.transpose(-2, -1)
Z = Z / (Z.norm(dim=(-2, -1), keepdim=True) + eps)
for a, b, c in coefficients:
    A = torch.matmul(Z, Z.transpose(-2, -1))
    AZ = torch.matmul(A, Z)
    Z = a * Z + b * AZ + c * torch.matmul(A, AZ)
if flip:
    Z = Z.transpose(-2, -1)
return Z[0] if X.ndim == 2 else Z
### END SOLUTION
""",
    ),
    Alternative(
        region="muon_zero.muon_update",
        name="mul/add momentum, explicit Nesterov blend",
        body="""
### BEGIN SOLUTION
momentum_buffer.mul_(momentum).add_(grad, alpha=1 - momentum)
if nesterov:
    look = (1 - momentum) * grad + momentum * momentum_buffer
else:
    look = momentum_buffer
n, m = look.shape[-2], look.shape[-1]
O = newton_schulz(look, coefficients, dtype=ns_dtype)
return O.to(grad.dtype) * (max(n, m) ** 0.5 * update_rms)
### END SOLUTION
""",
    ),
    Alternative(
        region="muon_zero.stochastic_round_to_bf16",
        name="truncate, then step up one bf16 ulp with probability low bits / 2^16",
        body="""
### BEGIN SOLUTION
bits = x.view(torch.int32)
dropped = bits & 0xFFFF
truncated = bits - dropped
u = torch.rand(x.shape, device=x.device, generator=generator)
go_up = u * 65536.0 < dropped.to(torch.float32)
out = torch.where(go_up, truncated + 0x10000, truncated).view(torch.float32)
special = torch.isnan(x) | torch.isinf(x)
out = torch.where(special, x, torch.clamp(out, min=-BF16_MAX, max=BF16_MAX))
return out.to(torch.bfloat16)
### END SOLUTION
""",
    ),
    Alternative(
        region="muon_zero.pack_dense",
        name="ties to the later matrix and the last bucket; shapes grouped by first sight",
        body="""
### BEGIN SOLUTION
def weigh(shape):
    return ns_cost(shape), shape[0] * shape[1]

totals = [max(1, sum(weigh(s)[k] for s in shapes)) for k in (0, 1)]
keep = {"ns_cost": (0,), "numel": (1,), "both": (0, 1)}[balance]

def load(w):
    return max(w[k] / totals[k] for k in keep)

loads = [[0, 0] for _ in range(zero_width)]
buckets = [[] for _ in range(zero_width)]
for i in sorted(range(len(shapes)), key=lambda i: (load(weigh(shapes[i])), i), reverse=True):
    w = weigh(shapes[i])
    after = [load((c + w[0], n + w[1])) for c, n in loads]
    q = max(range(zero_width), key=lambda k: (-after[k], k))
    buckets[q].append(i)
    loads[q][0] += w[0]
    loads[q][1] += w[1]
result = []
for b in buckets:
    seen = list(dict.fromkeys(tuple(shapes[i]) for i in b))
    result.append([i for s in seen for i in b if tuple(shapes[i]) == s])
return result
### END SOLUTION
""",
    ),
    Alternative(
        region="muon_zero.split_experts",
        name="linear scan, ties to the later boundary",
        body="""
### BEGIN SOLUTION
bounds = list(accumulate(numels, initial=0))
total = bounds[-1]
ends = []
for k in range(1, world_size):
    target = total * k / world_size
    ends.append(min(range(len(bounds)), key=lambda j: (abs(bounds[j] - target), -j)))
return list(zip([0, *ends], [*ends, len(numels)]))
### END SOLUTION
""",
    ),
    Alternative(
        region="muon_zero.sharded_step",
        name="out-of-place mean, dot-product norm, clip applied as new tensors",
        body="""
### BEGIN SOLUTION
like = params[0]
averaged = []
for sh in kinds:
    packed = pack_chunks(sh.chunks, sh.chunk_numel, grads, like)
    chunk = reduce_scatter_sum(packed, sh.group, grad_sync, generator)
    if sh.replica_group is not None:
        dist.all_reduce(chunk, group=sh.replica_group)
    averaged.append(chunk / world_size)
clip = torch.ones((), dtype=like.dtype, device=like.device)
if max_norm is not None:
    local = torch.zeros((), dtype=like.dtype, device=like.device)
    for chunk, sh in zip(averaged, kinds):
        if sh.counted:
            local = local + torch.dot(chunk, chunk)
    if world_size > 1:
        dist.all_reduce(local, group=process_group)
    clip = torch.clamp(max_norm / (torch.sqrt(local + replicated_sq) + 1e-6), max=1.0)
    averaged = [chunk * clip for chunk in averaged]
for sh, chunk, buffers in zip(kinds, averaged, momenta):
    mine = pack_chunks([sh.chunks[sh.mine]], sh.chunk_numel, params, like)[0]
    for run, M in zip(sh.runs, buffers):
        lo, hi = run.offset, run.offset + M.numel()
        update_run(
            chunk[lo:hi].view(M.shape),
            mine[lo:hi].view(M.shape),
            M,
            [settings[s.param_group] for s in run.slots],
            [has_grad[s.param] for s in run.slots],
        )
    unpack_chunks(all_gather_chunks(mine, sh.group, sh.peers), sh.chunks, params)
return clip
### END SOLUTION
""",
    ),
]
