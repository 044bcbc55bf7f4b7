"""Correct bodies for mhc.py's regions, each written unlike the reference."""

from tests.alternatives import Alternative

ALTERNATIVES = [
    Alternative(
        region="mhc.sinkhorn_knopp",
        name="max-shifted exp for the softmax, one loop over the normalised dims",
        body="""
### BEGIN SOLUTION
m = torch.exp(logits - logits.amax(dim=-2, keepdim=True))
m = m / m.sum(dim=-2, keepdim=True) + eps
for dim in [-1] + [-2, -1] * (iters - 1):
    m = m / (m.sum(dim=dim, keepdim=True) + eps)
return m
### END SOLUTION
""",
    ),
    Alternative(
        region="mhc.mhc_coefficients",
        name="torch's rms_norm, slices instead of split",
        body="""
### BEGIN SOLUTION
dtype = mixing_dtype(stream.dtype)
x = stream.to(dtype).reshape(*stream.shape[:-2], -1)
x_hat = torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=EPS)
z = x_hat @ hc.proj.to(dtype)
g = hc.gate.to(dtype)
pre, post = z[..., :n], z[..., n : 2 * n]
res = z[..., 2 * n :].reshape(*z.shape[:-1], n, n)
A = EPS + torch.sigmoid(g[0] * pre + hc.bias_pre.to(dtype))
C = torch.sigmoid(g[1] * post + hc.bias_post.to(dtype)) * 2
B = sinkhorn_knopp(g[2] * res + hc.bias_res.to(dtype), iters)
return A, B, C
### END SOLUTION
""",
    ),
    Alternative(
        region="mhc.post_mix_backward",
        name="einsum and broadcast sums instead of lanes_matmul",
        body="""
### BEGIN SOLUTION
dB = torch.einsum("...ic,...jc->...ij", grad_out, stream)
dX = torch.einsum("...ij,...ic->...jc", b, grad_out)
dC = (grad_out * f.unsqueeze(-2)).sum(-1)
df = (grad_out * c.unsqueeze(-1)).sum(-2)
return dB, dX, dC, df
### END SOLUTION
""",
    ),
    Alternative(
        region="mhc.RecomputedBlock.backward",
        name="all lane states rebuilt up front, grads collected then reversed, f.backward",
        body="""
### BEGIN SOLUTION
kernels, layers, head = ctx.kernels, ctx.layers, ctx.head
L = len(layers)
x0, *rest = ctx.saved_tensors
fs, kept = rest[:L], rest[L:]
per = [tuple(kept[k * KEPT_PER_LAYER : (k + 1) * KEPT_PER_LAYER]) for k in range(L)]
inputs = [x0]
while len(inputs) < L + (head is not None):
    k = len(inputs) - 1
    inputs.append(kernels.mix_out(inputs[k], per[k], fs[k]))
g, tail = grad_stream, ()
if head is not None:
    g, *tail = kernels.collapse_backward(
        g, inputs[L], kept[L * KEPT_PER_LAYER :], head_params(head)
    )
collected = []
for k in range(L - 1, -1, -1):
    h, f = ctx.graph[k]
    dB, dX, dC, df = kernels.mix_out_backward(g, inputs[k], per[k], fs[k])
    f.backward(df)
    g, pg = kernels.mix_in_backward(
        h.grad, dB, dC, dX, inputs[k], per[k], hc_params(layers[k][1]), ctx.iters
    )
    collected.append(pg)
ctx.layers = ctx.graph = ctx.head = None
flat = [p for pg in reversed(collected) for p in pg]
return (g, None, None, None, None, *flat, *tail)
### END SOLUTION
""",
    ),
    Alternative(
        region="mhc.one_f_one_b",
        name="simulated: forward while fewer than n_stages - stage are in flight",
        body="""
### BEGIN SOLUTION
limit = min(n_stages - stage, n_micro)
order, f, b = [], 0, 0
while b < n_micro:
    if f < n_micro and f - b < limit:
        order.append(("F", f))
        f += 1
    else:
        order.append(("B", b))
        b += 1
return order
### END SOLUTION
""",
    ),
    Alternative(
        region="mhc.pipeline_step",
        name="one loop over the schedule, running loss sum",
        body="""
### BEGIN SOLUTION
first, stop = stage_layers(model.cfg.n_layers, world, stage)
shape = model.stream_shape(idx.shape[0] // n_micro)
links = StageLinks(stage, world, n_micro, shape, model.embed.weight, overlap, groups)
last = stage == world - 1
inputs, outputs, total = {}, {}, None
micro_idx, micro_tgt = torch.chunk(idx, n_micro), torch.chunk(targets, n_micro)
for kind, i in one_f_one_b(world, stage, n_micro):
    if kind == "F":
        if stage == 0:
            x = model.embed_stream(micro_idx[i])
        else:
            x = links.recv("forward", i).requires_grad_()
        y = model.run_layers(x, first, stop, variant, block, final=last)
        if last:
            y = model.head_loss(y, micro_tgt[i]) / n_micro
            total = y.detach() if total is None else total + y.detach()
        else:
            links.send("forward", y)
        inputs[i], outputs[i] = x, y
    else:
        y, x = outputs.pop(i), inputs.pop(i)
        if last:
            y.backward()
        else:
            torch.autograd.backward(y, links.recv("backward", i))
        if stage > 0:
            links.send("backward", x.grad)
return total, links.finish()
### END SOLUTION
""",
    ),
]
