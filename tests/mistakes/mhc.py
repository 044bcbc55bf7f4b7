"""Plausible wrong bodies for mhc.py's solution regions (see tests/mistakes/__init__.py)."""

from tests.mistakes import Mistake

MISTAKES = [
    Mistake(
        region="mhc.sinkhorn_knopp",
        name="rows first: softmax along rows, columns normalised last",
        message="B is normalised rows first",
        body="""
### BEGIN SOLUTION
matrix = torch.softmax(logits, dim=-1) + eps
matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + eps)
for _ in range(iters - 1):
    matrix = matrix / (matrix.sum(dim=-1, keepdim=True) + eps)
    matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + eps)
return matrix
### END SOLUTION
""",
    ),
    Mistake(
        region="mhc.sinkhorn_knopp",
        name="no eps in the sums",
        message="NaN or inf at logits of +-60",
        body="""
### BEGIN SOLUTION
matrix = torch.softmax(logits, dim=-2)
matrix = matrix / matrix.sum(dim=-1, keepdim=True)
for _ in range(iters - 1):
    matrix = matrix / matrix.sum(dim=-2, keepdim=True)
    matrix = matrix / matrix.sum(dim=-1, keepdim=True)
return matrix
### END SOLUTION
""",
    ),
    Mistake(
        region="mhc.sinkhorn_knopp",
        name="one round too many",
        message="B differs from V4's Sinkhorn",
        body="""
### BEGIN SOLUTION
matrix = torch.softmax(logits, dim=-2) + eps
matrix = matrix / (matrix.sum(dim=-1, keepdim=True) + eps)
for _ in range(iters):
    matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + eps)
    matrix = matrix / (matrix.sum(dim=-1, keepdim=True) + eps)
return matrix
### END SOLUTION
""",
    ),
    Mistake(
        region="mhc.mhc_coefficients",
        name="A without V4's + eps",
        message="A differs from V4",
        body="""
### BEGIN SOLUTION
dtype = mixing_dtype(stream.dtype)
flat = stream.flatten(-2).to(dtype)
proj, gate = hc.proj.to(dtype), hc.gate.to(dtype)
logits = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS)) @ proj
pre, post, res = logits.split([n, n, n * n], dim=-1)
a = torch.sigmoid(gate[0] * pre + hc.bias_pre.to(dtype))
c = 2 * torch.sigmoid(gate[1] * post + hc.bias_post.to(dtype))
b = sinkhorn_knopp(gate[2] * res.unflatten(-1, (n, n)) + hc.bias_res.to(dtype), iters)
return a, b, c
### END SOLUTION
""",
    ),
    Mistake(
        region="mhc.mhc_coefficients",
        name="W_res read column-major (B's logits transposed)",
        message="B differs from V4",
        body="""
### BEGIN SOLUTION
dtype = mixing_dtype(stream.dtype)
flat = stream.flatten(-2).to(dtype)
proj, gate = hc.proj.to(dtype), hc.gate.to(dtype)
logits = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS)) @ proj
pre, post, res = logits.split([n, n, n * n], dim=-1)
a = torch.sigmoid(gate[0] * pre + hc.bias_pre.to(dtype)) + EPS
c = 2 * torch.sigmoid(gate[1] * post + hc.bias_post.to(dtype))
b = sinkhorn_knopp(gate[2] * res.unflatten(-1, (n, n)).mT + hc.bias_res.to(dtype), iters)
return a, b, c
### END SOLUTION
""",
    ),
    Mistake(
        region="mhc.mhc_coefficients",
        name="C = sigmoid without the factor 2",
        message="C differs from V4",
        body="""
### BEGIN SOLUTION
dtype = mixing_dtype(stream.dtype)
flat = stream.flatten(-2).to(dtype)
proj, gate = hc.proj.to(dtype), hc.gate.to(dtype)
logits = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS)) @ proj
pre, post, res = logits.split([n, n, n * n], dim=-1)
a = torch.sigmoid(gate[0] * pre + hc.bias_pre.to(dtype)) + EPS
c = torch.sigmoid(gate[1] * post + hc.bias_post.to(dtype))
b = sinkhorn_knopp(gate[2] * res.unflatten(-1, (n, n)) + hc.bias_res.to(dtype), iters)
return a, b, c
### END SOLUTION
""",
    ),
    Mistake(
        region="mhc.mhc_coefficients",
        name="RMS norm over each lane instead of the flattened stream",
        message="A differs from V4",
        body="""
### BEGIN SOLUTION
dtype = mixing_dtype(stream.dtype)
lanes = stream.to(dtype)
flat = (lanes * torch.rsqrt(lanes.pow(2).mean(-1, keepdim=True) + EPS)).flatten(-2)
proj, gate = hc.proj.to(dtype), hc.gate.to(dtype)
pre, post, res = (flat @ proj).split([n, n, n * n], dim=-1)
a = torch.sigmoid(gate[0] * pre + hc.bias_pre.to(dtype)) + EPS
c = 2 * torch.sigmoid(gate[1] * post + hc.bias_post.to(dtype))
b = sinkhorn_knopp(gate[2] * res.unflatten(-1, (n, n)) + hc.bias_res.to(dtype), iters)
return a, b, c
### END SOLUTION
""",
    ),
    Mistake(
        region="mhc.post_mix_backward",
        name="dX through B instead of B^T",
        message="dX differs from autograd",
        body="""
### BEGIN SOLUTION
grad_b = lanes_matmul(grad_out, stream.transpose(-1, -2))
grad_stream = lanes_matmul(b, grad_out)
grad_c = lanes_matmul(grad_out, f.unsqueeze(-1)).squeeze(-1)
grad_f = lanes_matmul(c.unsqueeze(-2), grad_out).squeeze(-2)
return grad_b, grad_stream, grad_c, grad_f
### END SOLUTION
""",
    ),
    Mistake(
        region="mhc.post_mix_backward",
        name="dB transposed (X dX'^T)",
        message="dB differs from autograd",
        body="""
### BEGIN SOLUTION
grad_b = lanes_matmul(stream, grad_out.transpose(-1, -2))
grad_stream = lanes_matmul(b.transpose(-1, -2), grad_out)
grad_c = lanes_matmul(grad_out, f.unsqueeze(-1)).squeeze(-1)
grad_f = lanes_matmul(c.unsqueeze(-2), grad_out).squeeze(-2)
return grad_b, grad_stream, grad_c, grad_f
### END SOLUTION
""",
    ),
    Mistake(
        region="mhc.post_mix_backward",
        name="df without C (the sum of dX' over lanes)",
        message="df differs from autograd",
        body="""
### BEGIN SOLUTION
grad_b = lanes_matmul(grad_out, stream.transpose(-1, -2))
grad_stream = lanes_matmul(b.transpose(-1, -2), grad_out)
grad_c = lanes_matmul(grad_out, f.unsqueeze(-1)).squeeze(-1)
grad_f = grad_out.sum(-2)
return grad_b, grad_stream, grad_c, grad_f
### END SOLUTION
""",
    ),
    Mistake(
        region="mhc.RecomputedBlock.backward",
        name="one lane state too many rebuilt: each layer reads the next layer's input",
        message="backward must read its own input X_",
        body="""
### BEGIN SOLUTION
kernels, n_layers, head = ctx.kernels, len(ctx.layers), ctx.head
saved = ctx.saved_tensors
fs, kept = saved[1 : 1 + n_layers], saved[1 + n_layers :]
coefficients = [
    kept[KEPT_PER_LAYER * i : KEPT_PER_LAYER * (i + 1)] for i in range(n_layers)
]
states = [saved[0]]
for i in range(n_layers):
    states.append(kernels.mix_out(states[-1], coefficients[i], fs[i]))
head_grads = []
if head is not None:
    grad_stream, *head_grads = kernels.collapse_backward(
        grad_stream, states[-1], kept[KEPT_PER_LAYER * n_layers :], head_params(head)
    )
grads = []
for i in reversed(range(n_layers)):
    (_, hc), (h, f), stream = ctx.layers[i], ctx.graph[i], states.pop()
    kept_i = coefficients[i]
    grad_b, grad_x, grad_c, grad_f = kernels.mix_out_backward(grad_stream, stream, kept_i, fs[i])
    torch.autograd.backward(f, grad_f)
    grad_stream, grad_params = kernels.mix_in_backward(
        h.grad, grad_b, grad_c, grad_x, stream, kept_i, hc_params(hc), ctx.iters
    )
    grads = [*grad_params, *grads]
ctx.layers = ctx.graph = ctx.head = None
return grad_stream, None, None, None, None, *grads, *head_grads
### END SOLUTION
""",
    ),
    Mistake(
        region="mhc.RecomputedBlock.backward",
        name="F run again in backward instead of its kept graph",
        message="F must run once per layer",
        body="""
### BEGIN SOLUTION
kernels, n_layers, head = ctx.kernels, len(ctx.layers), ctx.head
saved = ctx.saved_tensors
fs, kept = saved[1 : 1 + n_layers], saved[1 + n_layers :]
coefficients = [
    kept[KEPT_PER_LAYER * i : KEPT_PER_LAYER * (i + 1)] for i in range(n_layers)
]
states = [saved[0]]
for i in range(n_layers if head is not None else n_layers - 1):
    states.append(kernels.mix_out(states[-1], coefficients[i], fs[i]))
head_grads = []
if head is not None:
    grad_stream, *head_grads = kernels.collapse_backward(
        grad_stream, states.pop(), kept[KEPT_PER_LAYER * n_layers :], head_params(head)
    )
grads = []
for i in reversed(range(n_layers)):
    (sublayer, hc), (h, _), stream = ctx.layers[i], ctx.graph[i], states.pop()
    kept_i = coefficients[i]
    grad_b, grad_x, grad_c, grad_f = kernels.mix_out_backward(grad_stream, stream, kept_i, fs[i])
    h = h.detach().requires_grad_()
    with torch.enable_grad():
        f = sublayer(h)  # recomputed: F runs twice per step
    torch.autograd.backward(f, grad_f)
    grad_stream, grad_params = kernels.mix_in_backward(
        h.grad, grad_b, grad_c, grad_x, stream, kept_i, hc_params(hc), ctx.iters
    )
    grads = [*grad_params, *grads]
ctx.layers = ctx.graph = ctx.head = None
return grad_stream, None, None, None, None, *grads, *head_grads
### END SOLUTION
""",
    ),
    Mistake(
        region="mhc.RecomputedBlock.backward",
        name="the post-mix's dX dropped (only the pre-mix path reaches X)",
        message="the gradient passed down from layer",
        body="""
### BEGIN SOLUTION
kernels, n_layers, head = ctx.kernels, len(ctx.layers), ctx.head
saved = ctx.saved_tensors
fs, kept = saved[1 : 1 + n_layers], saved[1 + n_layers :]
coefficients = [
    kept[KEPT_PER_LAYER * i : KEPT_PER_LAYER * (i + 1)] for i in range(n_layers)
]
states = [saved[0]]
for i in range(n_layers if head is not None else n_layers - 1):
    states.append(kernels.mix_out(states[-1], coefficients[i], fs[i]))
head_grads = []
if head is not None:
    grad_stream, *head_grads = kernels.collapse_backward(
        grad_stream, states.pop(), kept[KEPT_PER_LAYER * n_layers :], head_params(head)
    )
grads = []
for i in reversed(range(n_layers)):
    (_, hc), (h, f), stream = ctx.layers[i], ctx.graph[i], states.pop()
    kept_i = coefficients[i]
    grad_b, grad_x, grad_c, grad_f = kernels.mix_out_backward(grad_stream, stream, kept_i, fs[i])
    torch.autograd.backward(f, grad_f)
    grad_stream, grad_params = kernels.mix_in_backward(
        h.grad, grad_b, grad_c, torch.zeros_like(grad_x), stream, kept_i, hc_params(hc), ctx.iters
    )
    grads = [*grad_params, *grads]
ctx.layers = ctx.graph = ctx.head = None
return grad_stream, None, None, None, None, *grads, *head_grads
### END SOLUTION
""",
    ),
    Mistake(
        region="mhc.one_f_one_b",
        name="warm-up off by one (n_stages - stage forwards)",
        message="the warm-up is n_stages - stage - 1 forwards",
        body="""
### BEGIN SOLUTION
warmup = min(n_stages - stage, n_micro)
order = [("F", i) for i in range(warmup)]
for i in range(warmup, n_micro):
    order += [("F", i), ("B", i - warmup)]
order += [("B", i) for i in range(n_micro - warmup, n_micro)]
return order
### END SOLUTION
""",
    ),
    Mistake(
        region="mhc.one_f_one_b",
        name="steady state runs the backward before the forward",
        message="the steady state runs a forward, then a backward",
        body="""
### BEGIN SOLUTION
warmup = min(n_stages - stage - 1, n_micro)
order = [("F", i) for i in range(warmup)]
for i in range(warmup, n_micro):
    order += [("B", i - warmup), ("F", i)]
order += [("B", i) for i in range(n_micro - warmup, n_micro)]
return order
### END SOLUTION
""",
    ),
    Mistake(
        region="mhc.one_f_one_b",
        name="GPipe: every forward, then every backward",
        message="the warm-up is n_stages - stage - 1 forwards",
        body="""
### BEGIN SOLUTION
return [("F", i) for i in range(n_micro)] + [("B", i) for i in range(n_micro)]
### END SOLUTION
""",
    ),
]

_PIPELINE = """
### BEGIN SOLUTION
first, stop = stage_layers(model.cfg.n_layers, world, stage)
order, warmup = one_f_one_b(world, stage, n_micro), min(world - stage - 1, n_micro)
shape = model.stream_shape(idx.shape[0] // n_micro)
links = StageLinks(stage, world, n_micro, shape, model.embed.weight, overlap, groups)
idx_micro, tgt_micro = idx.chunk(n_micro), targets.chunk(n_micro)
held_in, held_out, losses, last = {}, {}, [], stage == world - 1


def forward(i):
    if stage == 0:
        stream = model.embed_stream(idx_micro[i])
    else:
        stream = links.recv("forward", i).requires_grad_()
    out = RUN_LAYERS
    if last:
        out = model.head_loss(out, TARGETS) SCALE
        losses.append(out.detach())
    held_in[i], held_out[i] = stream, out
    if not last:
        links.send("forward", out)


def backward(i):
    grad = None if last else links.recv("backward", i)
    held_out.pop(i).backward(grad)
    stream = held_in.pop(i)
    if stage > 0:
        links.send("backward", stream.grad)


SCHEDULE
return (torch.stack(losses).sum() if last else None), links.finish()
### END SOLUTION
"""
_RIGHT = {
    "RUN_LAYERS": "model.run_layers(stream, first, stop, variant, block, final=last)",
    "TARGETS": "tgt_micro[i]",
    "SCALE": "/ n_micro",
    "SCHEDULE": """for _, i in order[:warmup]:
    forward(i)
for kind, i in order[warmup : 2 * n_micro - warmup]:
    forward(i) if kind == "F" else backward(i)
for _, i in order[2 * n_micro - warmup :]:
    backward(i)""",
}


def _pipeline(**wrong):
    body = _PIPELINE
    for key, value in {**_RIGHT, **wrong}.items():
        body = body.replace(key, value)
    return body


MISTAKES += [
    Mistake(
        region="mhc.pipeline_step",
        name="micro-batch losses summed, not averaged",
        message="divide each micro-batch's loss by n_micro",
        body=_pipeline(SCALE=""),
    ),
    Mistake(
        region="mhc.pipeline_step",
        name="variant and block not passed on: every stage runs naive",
        message="pipeline_step ignored variant='optimised'",
        body=_pipeline(RUN_LAYERS="model.run_layers(stream, first, stop, final=last)"),
    ),
    Mistake(
        region="mhc.pipeline_step",
        name="last stage scores the next micro-batch's targets",
        message="each micro-batch's idx and targets must stay paired",
        body=_pipeline(TARGETS="tgt_micro[(i + 1) % n_micro]"),
    ),
    Mistake(
        region="mhc.pipeline_step",
        name="GPipe order: every forward, then every backward (same numbers, all activations held)",
        message="1F1B holds at most n_stages - stage",
        body=_pipeline(
            SCHEDULE="for i in range(n_micro):\n    forward(i)\n"
            "for i in range(n_micro):\n    backward(i)"
        ),
    ),
]
