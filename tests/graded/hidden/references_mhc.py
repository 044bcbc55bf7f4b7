"""The independent reference for tests/graded/test_mhc.py: V4's mHC transformer written out in
float64 (attention over the whole sequence, each layer B X + C F(A X), autograd, no
recomputation, no pipeline). It ships only in the autograder zip: in the student repository it
would be an answer (a Sinkhorn in V4's order, the layer's coefficients); there the tests read the
values it gave, stored by `make expected` (tests/graded/expected.py)."""

import torch

EPS = 1e-6
N, DIM, HEADS = 4, 16, 2
# helpers whose code the released files hold too (a probe draws the same batches): the
# release's leak search leaves them out
SHARED = ("batch", "sub", "rms_normed", "attention", "mlp")


def v4_sinkhorn(logits, iters=20, eps=EPS):
    """V4's Sinkhorn in B's layout: exp(logits) scaled to unit columns, + eps, then scaled to unit
    rows, then iters - 1 times to unit columns and rows, each divisor a sum + eps."""
    scaled = torch.exp(logits - logits.amax(-2, keepdim=True))
    scaled = scaled / scaled.sum(-2, keepdim=True) + eps
    for axis in [-1] + [-2, -1] * (iters - 1):
        scaled = scaled / (scaled.sum(axis, keepdim=True) + eps)
    return scaled


def rms_normed(x, weight=None):
    y = x / torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True) + EPS)
    return y if weight is None else y * weight


def v4_coefficients(p, lanes):
    """V4 §2.2 for lanes [..., n, d]: x_hat = vec(X) / rms; [pre | post | res] = x_hat W;
    A = sigmoid(alpha_pre pre + S_pre) + eps, C = 2 sigmoid(alpha_post post + S_post),
    B = Sinkhorn(alpha_res res (row-major n x n) + S_res)."""
    z = rms_normed(lanes.reshape(*lanes.shape[:-2], N * DIM)) @ p["proj"]
    alpha = p["gate"]
    a = torch.sigmoid(alpha[0] * z[..., :N] + p["bias_pre"]) + EPS
    c = 2 * torch.sigmoid(alpha[1] * z[..., N : 2 * N] + p["bias_post"])
    res = z[..., 2 * N :].reshape(*z.shape[:-1], N, N)
    return a, v4_sinkhorn(alpha[2] * res + p["bias_res"]), c


def attention(p, x):
    """Pre-norm causal self-attention over the whole sequence, written out: [batch, T, d]."""
    q, k, v = (rms_normed(x, p["norm.weight"]) @ p["qkv.weight"].T).split(DIM, dim=-1)
    heads = [t.reshape(*t.shape[:2], HEADS, DIM // HEADS).transpose(1, 2) for t in (q, k, v)]
    scores = heads[0] @ heads[1].transpose(-1, -2) / (DIM // HEADS) ** 0.5
    t = x.shape[1]
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    y = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ heads[2]
    return y.transpose(1, 2).reshape(x.shape) @ p["out.weight"].T


def mlp(p, x):
    h = rms_normed(x, p["norm.weight"]) @ p["up.weight"].T
    return torch.nn.functional.gelu(h) @ p["down.weight"].T


def sub(params, prefix):
    return {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}


def v4_layer(params, i, lanes):
    """Layer i: X' = B X + C F(A X), F attention at even i, else the MLP."""
    a, b, c = v4_coefficients(sub(params, f"hcs.{i}."), lanes)
    h = (a.unsqueeze(-1) * lanes).sum(-2)
    f = (attention if i % 2 == 0 else mlp)(sub(params, f"sublayers.{i}."), h)
    return b @ lanes + c.unsqueeze(-1) * f.unsqueeze(-2)


def v4_head(params, lanes):
    """V4's HyperHead: sum_i w_i X_i, w = sigmoid(alpha x_hat W + S) + eps."""
    z = rms_normed(lanes.reshape(*lanes.shape[:-2], N * DIM)) @ params["hyper_head.proj"]
    w = torch.sigmoid(params["hyper_head.gate"] * z + params["hyper_head.bias"]) + EPS
    return (w.unsqueeze(-1) * lanes).sum(-2)


def v4_loss(params, idx, targets, n_layers):
    x = params["embed.weight"][idx]
    lanes = x.unsqueeze(-2).repeat_interleave(N, dim=-2)  # the embedding copied into n lanes
    for i in range(n_layers):
        lanes = v4_layer(params, i, lanes)
    logits = rms_normed(v4_head(params, lanes), params["norm.weight"]) @ params["lm_head.weight"].T
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(step, size=4, seq_len=8, vocab=64):
    gen = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, vocab, (size, seq_len + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def reference_steps(params, n_layers, steps, size):
    """Loss and gradients of each SGD(lr=0.1) step of the reference in float64 from ``params``."""
    params = {k: v.double().requires_grad_() for k, v in params.items()}
    out = []
    for step in range(steps):
        idx, tgt = batch(step, size=size)
        loss = v4_loss(params, idx, tgt, n_layers)
        grads = torch.autograd.grad(loss, list(params.values()))
        out.append((loss.item(), dict(zip(params, grads))))
        with torch.no_grad():
            for p, g in zip(params.values(), grads):
                p -= 0.1 * g
    return out


def block_gradients(params, stream, weight, with_head):
    """Gradients of sum(block(stream) * weight) through 3 plain layers (and the head): the block
    input's and each named parameter's."""
    params = {n: t.clone().requires_grad_() for n, t in params.items()}
    x = stream.clone().requires_grad_()
    y = x
    for i in range(3):
        y = v4_layer(params, i, y)
    y = v4_head(params, y) if with_head else y
    ref_x, *ref = torch.autograd.grad((y * weight).sum(), [x, *params.values()])
    return ref_x, dict(zip(params, ref, strict=True))


def coefficients_by_token(params, stream):
    """(A, B, C) of layer 0 for each token of ``stream`` [batch, T, n, d] alone, stacked."""
    hc = sub(params, "hcs.0.")
    rows = [[v4_coefficients(hc, stream[b, t]) for t in range(stream.shape[1])]
            for b in range(stream.shape[0])]  # fmt: skip
    return [torch.stack([torch.stack([r[i] for r in row]) for row in rows]) for i in range(3)]
