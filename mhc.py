"""mHC made affordable: manifold-constrained hyper-connections and three things that pay for them.

DeepSeek-V4 §3.4.2 (the layer: V4 §2.2; the mHC paper, arXiv 2512.24880, §4).

What the standard tool assumes. The residual stream is one vector of C numbers per token,
x' = x + F(x): checkpointing keeps or drops whole modules, a pipeline stage sends C per token.

What V4 violates. Hyper-connections widen the stream to n_hc = 4 lanes, X in R^{n x C}, mixed by
three small per-token matrices computed from the stream itself:
    X' = B X + C F(A X),   A = sigmoid(.) in R^{1 x n},  C = 2 sigmoid(.) in R^{n x 1},
    B = Sinkhorn-Knopp(exp(.)) in R^{n x n}, doubly stochastic (the "manifold constraint").
Every layer's input is now n*C per token: n times the activation memory and the pipeline
traffic, and the mixing is memory-bound work that eager autograd runs as a string of small ops,
each reading and writing the whole widened stream and keeping its intermediates.

The fix, three reductions, each checked against the plain autograd layer:
  1. fused lane mixing (section 2): coefficients, pre-mix A X and post-mix + merge B X + C f as
     pure functions with their backward written out, reading the lanes once;
  2. selective recomputation (section 3): keep one block input (n*C) every L_r layers, each F
     output (C) and each layer's coefficients; in backward rebuild the lane states with the
     post-mix alone, never running F twice (the head's lane collapse folded into the last block);
  3. a 1F1B pipeline (section 4) whose stages exchange the n-lane stream with receives posted
     ahead, so the extra traffic hides behind compute (V4 does this inside DualPipe).
The variants are one choice, VARIANTS: "naive" (plain autograd), "fused" (1; each layer one
autograd op) and "optimised" (1 and 2; blocks of L_r layers).

Fidelity: for the same weights this computes what the public V4 code computes (transformers'
DeepseekV4HyperConnection and DeepseekV4HyperHead; interop/v4_mhc.py loads their weights and
tests/test_mhc_v4_oracle.py compares): Sinkhorn's axis order and eps, A = sigmoid(.) + eps,
coefficients and pre-mix in fp32, a learned lane collapse. F is a small attention/MLP, not V4's.

    python mhc.py                              # one process: residual vs naive vs optimised mHC
    torchrun --nproc_per_node=2 mhc.py         # CPU, gloo: the same model over 2 pipeline stages
    torchrun --nproc_per_node=4 mhc.py         # 4 stages; on GPUs NCCL is picked automatically
    python mhc.py --help                       # every option
"""

import argparse
import math
import os
import sys
import time
import weakref
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import launch

EPS = 1e-6  # V4's hc_eps and rms_norm_eps: in the norm, in A, and in every Sinkhorn sum
VARIANTS = ("naive", "fused", "optimised")  # the mHC variants (Transformer.run_layers)


@dataclass
class Config:
    vocab_size: int = 256
    seq_len: int = 64
    dim: int = 128  # C, the width of one lane
    n_heads: int = 4
    n_layers: int = 12  # attention and MLP sublayers alternate, each with its own HC (as in V4)
    n_hc: int = 4  # lanes in the widened residual stream
    sinkhorn_iters: int = 20
    gate_init: float = 0.01  # alpha: the data-dependent part of A, B, C starts small

    def __post_init__(self):
        check_config(self)  # appendix: one clear ValueError per bad field


# ---- 1. the mHC layer (V4 §2.2) ------------------------------------------------------------------


def sinkhorn_knopp(logits, iters=20, eps=EPS):
    """Project exp(logits) onto the doubly stochastic matrices. logits [..., n, n] -> [..., n, n].

    B acts as X' = B X. V4 fixes the order, and so does this (the oracle test compares bits):
    round 1 is a softmax down each column (exp without overflow) + eps, then a row normalisation;
    rounds 2..iters normalise columns, then rows; every sum gets + eps (a column that underflows
    to 0 at logits of +-60 would otherwise divide 0 by 0). Ending on rows makes each output lane a
    convex combination of input lanes. (V4 keeps comb = B^T and applies comb^T X: its softmax over
    comb's last axis is this softmax down B's columns.)
    """
    # hint: start from a softmax over dim=-2 plus eps; divide by (sum + eps) each time
    ### BEGIN SOLUTION
    matrix = torch.softmax(logits, dim=-2) + eps  # round 1's column step
    matrix = matrix / (matrix.sum(dim=-1, keepdim=True) + eps)  # round 1's row step
    for _ in range(iters - 1):
        matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + eps)  # columns
        matrix = matrix / (matrix.sum(dim=-1, keepdim=True) + eps)  # rows
    return matrix
    ### END SOLUTION


def mixing_dtype(dtype):
    """V4 computes A, B, C and the pre-mix in fp32 whatever the model's dtype (bf16 sums of n*C
    squares lose the coefficients); float64 stays float64 so tests can check to 1e-12."""
    return torch.promote_types(dtype, torch.float32)


def lane_init_bias(n):
    """S with sigmoid(S) = 1/n for n >= 2: A X and the head start as the lanes' mean. At n = 1 no
    finite S gives sigmoid(S) = 1; S = 0 gives 1/2, V4's own init at every n."""
    return torch.full((n,), -math.log(n - 1) if n > 1 else 0.0)


class HyperConnection(nn.Module):
    """One layer's parameters of A [..., n], B [..., n, n], C [..., n], made from X [..., n, C].

    One projection of width n + n + n^2 from the RMS-normalised flattened stream (no norm weight,
    as V4), static biases S plus gated dynamic terms alpha * (x W). proj's columns are
    [W_pre | W_post | W_res], W_res row-major in B's layout (V4 stores comb = B^T). At init A is
    1/n per lane (1/2 at n = 1: lane_init_bias) plus eps, C is 1 and B near the identity.
    """

    def __init__(self, n, dim, gate_init=0.01):
        super().__init__()
        if n < 1 or dim < 1:
            raise ValueError(f"HyperConnection needs n >= 1 lanes and dim >= 1, got {n}, {dim}")
        self.n, self.dim = n, dim
        self.proj = nn.Parameter(torch.randn(n * dim, 2 * n + n * n) * (n * dim) ** -0.5)
        self.gate = nn.Parameter(torch.full((3,), float(gate_init)))  # alpha_pre, _post, _res
        self.bias_pre = nn.Parameter(lane_init_bias(n))
        self.bias_post = nn.Parameter(torch.zeros(n))  # C = 2 sigmoid(0) = 1: F reaches each lane
        self.bias_res = nn.Parameter(3.0 * torch.eye(n))  # B starts near the identity

    def check_stream(self, stream):
        if stream.dim() < 2 or stream.shape[-2] != self.n or stream.shape[-1] != self.dim:
            raise ValueError(
                f"mHC stream must have shape [..., n_hc={self.n}, dim={self.dim}], got "
                f"{tuple(stream.shape)}: expand the embedding into n_hc lanes once "
                f"(Transformer.embed_stream) and keep that shape between layers"
            )


def mhc_coefficients(stream, hc, iters=20):
    """stream [..., n, C] -> (A [..., n], B [..., n, n], C [..., n]) in mixing_dtype, by autograd.

    x_hat = RMSNorm(vec X); [pre | post | res] = x_hat W; A = sigmoid(a_pre pre + S_pre) + eps,
    C = 2 sigmoid(a_post post + S_post), B = sinkhorn_knopp(a_res res (n x n) + S_res).
    """
    n = hc.n
    # hint: x_hat = RMSNorm(vec(X)); one projection; split n, n, n*n; A gets + EPS (as V4)
    ### BEGIN SOLUTION
    dtype = mixing_dtype(stream.dtype)
    flat = stream.flatten(-2).to(dtype)  # [..., nC]
    proj, gate = hc.proj.to(dtype), hc.gate.to(dtype)
    logits = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS)) @ proj
    pre, post, res = logits.split([n, n, n * n], dim=-1)
    a = torch.sigmoid(gate[0] * pre + hc.bias_pre.to(dtype)) + EPS  # + eps: as V4, A never 0
    c = 2 * torch.sigmoid(gate[1] * post + hc.bias_post.to(dtype))
    b = sinkhorn_knopp(gate[2] * res.unflatten(-1, (n, n)) + hc.bias_res.to(dtype), iters)
    return a, b, c
    ### END SOLUTION


def mhc_layer_reference(stream, sublayer, hc, iters=20):
    """The plain autograd mHC layer: X [..., n, C] -> B X + C F(A X)  [..., n, C].

    Pre-mix in fp32, post-mix in the stream's dtype with B and C cast to it, as V4 (the n-lane
    stream stays in the model dtype). Every other path is tested against this one.
    """
    hc.check_stream(stream)
    a, b, c = mhc_coefficients(stream, hc, iters)
    h = torch.einsum("...n,...nc->...c", a, stream.to(a.dtype)).to(stream.dtype)
    f = sublayer(h)
    b, c = b.to(stream.dtype), c.to(stream.dtype)
    return torch.einsum("...ij,...jc->...ic", b, stream) + c.unsqueeze(-1) * f.unsqueeze(-2)


class HyperHead(nn.Module):
    """The lanes' one collapse before the final norm and LM head (V4's HyperHead):
    X [..., n, C] -> sum_i w_i X_i [..., C], w = sigmoid(alpha x_hat W + S) + eps. At alpha = 0
    and its init S it is the lanes' mean times (1 + n eps) for n >= 2, and 0.5 (1 + 2 eps) X at
    n = 1 (lane_init_bias)."""

    def __init__(self, n, dim, gate_init=0.01):
        super().__init__()
        self.n, self.dim = n, dim
        self.proj = nn.Parameter(torch.randn(n * dim, n) * (n * dim) ** -0.5)
        self.gate = nn.Parameter(torch.full((1,), float(gate_init)))
        self.bias = nn.Parameter(lane_init_bias(n))

    def forward(self, stream):
        dtype = mixing_dtype(stream.dtype)
        flat = stream.flatten(-2).to(dtype)  # [..., nC]
        x_hat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS)
        weights = torch.sigmoid(
            x_hat @ self.proj.to(dtype) * self.gate.to(dtype) + self.bias.to(dtype)
        )
        return ((weights + EPS).unsqueeze(-1) * stream.to(dtype)).sum(-2).to(stream.dtype)


# ---- 2. fused lane mixing ------------------------------------------------------------------------
# Each operation as a pure forward and a pure backward: what one kernel reads, computes and writes,
# no autograd inside. Section 3 runs them; compiled/mhc_compiled.py hands the very same functions
# to torch.compile, which fuses each into a few loops over the lanes.


def lanes_matmul(m, x):
    """m [..., p, q] @ x [..., q, r]: the mixing's small per-token products (compiled/ swaps in a
    form Inductor fuses with the elementwise work around it)."""
    return m @ x


def norm_then_project(x, weight):
    """RMSNorm(x) W as (x W) * r, r = 1/rms(x): x [..., D], W [D, k] -> (x W [..., k], r [..., 1]).
    The division moves after the matmul (mHC paper §4): the normalised stream is never written."""
    return x @ weight, torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def norm_then_project_backward(grad, x, weight, projected, inv_rms):
    """Gradients of y = (x W) r for dy [..., k] -> (dx [..., D], dW [D, k]):
    dx = (dy r) W^T - (sum(dy * xW) r^3 / D) x, nothing n*C-sized kept."""
    scaled = grad * inv_rms  # [..., k]
    grad_weight = (scaled.reshape(-1, scaled.shape[-1]).T @ x.reshape(-1, x.shape[-1])).T
    through_rms = (grad * projected).sum(-1, keepdim=True) * inv_rms.pow(3) / x.shape[-1]
    return torch.addcmul(scaled @ weight.T, through_rms, x, value=-1), grad_weight


def sinkhorn_backward(logits, grad, iters=20, eps=EPS):
    """d loss / d logits of sinkhorn_knopp(logits, iters), given dB [..., n, n].

    Replays the normalisations (n x n per token: tiny) and walks them backwards, where autograd
    would keep every intermediate. One step Y = M / s, s = sum(M) + eps along an axis:
    dM = (dY - sum(dY * Y)) / s along that axis; the softmax's is s (g - sum(g s)) down columns.
    """
    soft = torch.softmax(logits, dim=-2)
    matrix, steps = soft + eps, []
    for dim in [-1] + [-2, -1] * (iters - 1):  # sinkhorn_knopp's order: rows, cols, rows, ...
        sums = matrix.sum(dim, keepdim=True) + eps
        matrix = matrix / sums
        steps.append((matrix, sums, dim))
    for matrix, sums, dim in reversed(steps):
        grad = (grad - (grad * matrix).sum(dim, keepdim=True)) / sums
    return soft * (grad - (grad * soft).sum(-2, keepdim=True))


def pre_mix(a, stream):
    """h = A X: A [..., n], X [..., n, C] -> [..., C]. Reads X once, writes C."""
    return lanes_matmul(a.unsqueeze(-2), stream).squeeze(-2)


def pre_mix_backward(grad_h, a, stream):
    """-> (dA [..., n] = <X_i, dh>, dX [..., n, C] = A_i dh)."""
    return (stream * grad_h.unsqueeze(-2)).sum(-1), a.unsqueeze(-1) * grad_h.unsqueeze(-2)


def post_mix(b, stream, c, f):
    """X' = B X + C f: B [..., n, n], X [..., n, C], C [..., n], f [..., C] -> X' [..., n, C].
    One output, no B X or C f temporaries: reads (n+1)C, writes nC (mHC paper §4: not 3nC)."""
    return lanes_matmul(b, stream).addcmul_(c.unsqueeze(-1), f.unsqueeze(-2))


def post_mix_backward(grad_out, b, stream, c, f):
    """Gradients of X' = B X + C f for dX' [..., n, C] -> (dB, dX, dC, df), shaped as b, X, c, f."""
    # hint: X' = B X + C f is linear in each input; write each gradient as one lanes_matmul
    ### BEGIN SOLUTION
    grad_b = lanes_matmul(grad_out, stream.transpose(-1, -2))  # [..., n, n]
    grad_stream = lanes_matmul(b.transpose(-1, -2), grad_out)  # [..., n, C]
    grad_c = lanes_matmul(grad_out, f.unsqueeze(-1)).squeeze(-1)  # [..., n]
    grad_f = lanes_matmul(c.unsqueeze(-2), grad_out).squeeze(-2)  # [..., C]
    return grad_b, grad_stream, grad_c, grad_f
    ### END SOLUTION


def mix_in(stream, params, iters):
    """One layer's coefficients and pre-mix, forward only: X [..., n, C] -> (h = A X, kept).

    params: hc_params(hc). kept = (A, B, C, x W [..., 2n + n^2], 1/rms [..., 1]): 2n^2 + 4n + 1
    numbers per token, all backward needs besides X. mhc_coefficients' math and dtypes.
    """
    proj, gate, bias_pre, bias_post, bias_res = (p.to(mixing_dtype(stream.dtype)) for p in params)
    n, x = stream.shape[-2], stream.to(proj.dtype)
    projected, inv_rms = norm_then_project(x.flatten(-2), proj)
    pre, post, res = (projected * inv_rms).split([n, n, n * n], dim=-1)
    a = torch.sigmoid(gate[0] * pre + bias_pre) + EPS
    c = 2 * torch.sigmoid(gate[1] * post + bias_post)
    b = sinkhorn_knopp(gate[2] * res.unflatten(-1, (n, n)) + bias_res, iters)
    return pre_mix(a, x).to(stream.dtype), (a, b, c, projected, inv_rms)


def mix_out(stream, kept, f):
    """Post-mix + merge in X's dtype (B, C cast to it, as V4): X [..., n, C], f [..., C] -> X'."""
    _, b, c, _, _ = kept
    return post_mix(b.to(stream.dtype), stream, c.to(stream.dtype), f)


def mix_out_backward(grad_out, stream, kept, f):
    """Backward of mix_out: dX' -> (dB, dX, dC, df), dB and dC in the mixing dtype."""
    _, b, c, _, _ = kept
    sd = stream.dtype
    grad_b, grad_x, grad_c, grad_f = post_mix_backward(grad_out, b.to(sd), stream, c.to(sd), f)
    return grad_b.to(b.dtype), grad_x, grad_c.to(c.dtype), grad_f


def mix_in_backward(grad_h, grad_b, grad_c, grad_x_post, stream, kept, params, iters):
    """Backward of mix_in, plus the post-mix's dX: -> (dX [..., n, C], grads of params).

    Pre-mix, then the gates (A = sigmoid + eps, C = 2 sigmoid, B by sinkhorn_backward), then the
    projection with its norm. Every n*C-sized tensor read is X or a gradient.
    """
    a, b, c, projected, inv_rms = kept
    proj, gate, _, _, bias_res = (p.to(a.dtype) for p in params)
    n, x = stream.shape[-2], stream.to(a.dtype)
    grad_a, grad_x = pre_mix_backward(grad_h.to(a.dtype), a, x)
    pre, post, res = (projected * inv_rms).split([n, n, n * n], dim=-1)
    res = res.unflatten(-1, (n, n))
    grad_pre = grad_a * (a - EPS) * (1 - (a - EPS))  # sigmoid' = s (1 - s)
    grad_post = grad_c * c * (1 - c / 2)  # (2 sigmoid)' = C (1 - C/2)
    grad_res = sinkhorn_backward(gate[2] * res + bias_res, grad_b, iters)
    grad_logits = torch.cat(
        [grad_pre * gate[0], grad_post * gate[1], (grad_res * gate[2]).flatten(-2)], dim=-1
    )
    grad_flat, grad_proj = norm_then_project_backward(
        grad_logits, x.flatten(-2), proj, projected, inv_rms
    )
    grad_x = grad_x + grad_flat.unflatten(-1, (n, -1)) + grad_x_post
    tokens = tuple(range(a.dim() - 1))
    pairs = ((grad_pre, pre), (grad_post, post), (grad_res, res))
    grad_gate = torch.stack([(g * v).sum() for g, v in pairs])
    grads = grad_proj, grad_gate, *(g.sum(tokens) for g in (grad_pre, grad_post, grad_res))
    return grad_x.to(stream.dtype), tuple(g.to(p.dtype) for g, p in zip(grads, params))


def collapse(stream, params):
    """HyperHead's collapse, forward only: X [..., n, C] -> (x [..., C], kept = (w, x W, 1/rms)).
    params: hyper_head_params(head). The plain head would also keep the normalised stream."""
    proj, gate, bias = (p.to(mixing_dtype(stream.dtype)) for p in params)
    x = stream.to(proj.dtype)
    projected, inv_rms = norm_then_project(x.flatten(-2), proj)
    weights = torch.sigmoid(gate * projected * inv_rms + bias) + EPS
    return pre_mix(weights, x).to(stream.dtype), (weights, projected, inv_rms)


def collapse_backward(grad_out, stream, kept, params):
    """Gradients of collapse for dx [..., C] -> (dX [..., n, C], dW, dgate, dbias)."""
    weights, projected, inv_rms = kept
    proj, gate, _ = (p.to(weights.dtype) for p in params)
    x = stream.to(proj.dtype)
    grad_w, grad_x = pre_mix_backward(grad_out.to(proj.dtype), weights, x)
    grad_z = grad_w * (weights - EPS) * (1 - (weights - EPS))  # sigmoid' = s (1 - s)
    grad_flat, grad_proj = norm_then_project_backward(
        grad_z * gate, x.flatten(-2), proj, projected, inv_rms
    )
    grad_gate = (grad_z * projected * inv_rms).sum().reshape(gate.shape)
    grad_bias = grad_z.reshape(-1, grad_z.shape[-1]).sum(0)
    grad_x = grad_x + grad_flat.unflatten(-1, grad_x.shape[-2:])
    grads = grad_proj, grad_gate, grad_bias
    return grad_x.to(stream.dtype), *(g.to(p.dtype) for g, p in zip(grads, params))


# ---- 3. selective recomputation ------------------------------------------------------------------


class RecomputedBlock(torch.autograd.Function):
    """Run layers X_0 -> X_L keeping only X_0 [..., n, C], each F output f [..., C] and each
    layer's coefficients (mix_in's kept).

    Forward: the mixing without autograd (kernels: this module, or compiled ones); each F runs once
    with grad on a detached leaf input, so F's own graph stays. Backward: rebuild X_1..X_{L-1}
    from X_0 with the post-mix alone (no projection, Sinkhorn or F), then walk the layers back:
    post-mix backward -> F's kept graph -> pre-mix, Sinkhorn and coefficient backward. F's
    parameter grads go to .grad directly (as reentrant checkpointing: use loss.backward()).
    head (the HyperHead, last block only): return its collapse [..., C], rebuild X_L too.
    """

    @staticmethod
    def forward(ctx, stream_in, layers, iters, kernels, head, *params):
        stream, graph, kept = stream_in, [], []
        for sublayer, hc in layers:
            h, coefficients = kernels.mix_in(stream, hc_params(hc), iters)
            h.requires_grad_()  # a leaf: F's graph starts here
            with torch.enable_grad():
                f = sublayer(h)
            graph.append((h, f))
            kept.extend(coefficients)
            stream = kernels.mix_out(stream, coefficients, f.detach())
        if head is not None:  # folded in: the final n-lane stream is rebuilt, not kept
            stream, head_kept = kernels.collapse(stream, head_params(head))
            kept.extend(head_kept)
        # f also through save_for_backward, so saved-tensor hooks (and memory tools) see it
        ctx.save_for_backward(stream_in, *[f.detach() for _, f in graph], *kept)
        ctx.layers, ctx.graph, ctx.iters, ctx.kernels, ctx.head = (
            layers,
            graph,
            iters,
            kernels,
            head,
        )
        return stream

    @staticmethod
    def backward(ctx, grad_stream):
        # hint: rebuild the lane states with kernels.mix_out (X_L too with a head: start from
        # kernels.collapse_backward), then per layer, last first: mix_out_backward, F's kept
        # graph (torch.autograd.backward), mix_in_backward
        ### BEGIN SOLUTION
        kernels, n_layers, head = ctx.kernels, len(ctx.layers), ctx.head
        saved = ctx.saved_tensors
        fs, kept = saved[1 : 1 + n_layers], saved[1 + n_layers :]
        coefficients = [kept[5 * i : 5 * i + 5] for i in range(n_layers)]
        states = [saved[0]]  # X_0; then the lane states rebuilt by the post-mix alone
        for i in range(n_layers if head is not None else n_layers - 1):
            states.append(kernels.mix_out(states[-1], coefficients[i], fs[i]))
        head_grads = []
        if head is not None:
            grad_stream, *head_grads = kernels.collapse_backward(
                grad_stream, states.pop(), kept[5 * n_layers :], head_params(head)
            )
        grads = []
        for i in reversed(range(n_layers)):
            (_, hc), (h, f), stream = ctx.layers[i], ctx.graph[i], states.pop()
            kept_i = coefficients[i]
            grad_b, grad_x, grad_c, grad_f = kernels.mix_out_backward(
                grad_stream, stream, kept_i, fs[i]
            )
            torch.autograd.backward(f, grad_f)  # F's kept graph: fills h.grad and F's .grad
            grad_stream, grad_params = kernels.mix_in_backward(
                h.grad, grad_b, grad_c, grad_x, stream, kept_i, hc_params(hc), ctx.iters
            )
            grads = [*grad_params, *grads]
        ctx.layers = ctx.graph = ctx.head = None
        return grad_stream, None, None, None, None, *grads, *head_grads
        ### END SOLUTION


def hc_params(hc):  # one layer's mixing parameters, in the order mix_in and its backward use
    return (hc.proj, hc.gate, hc.bias_pre, hc.bias_post, hc.bias_res)


def head_params(head):  # the HyperHead's, in the order collapse and its backward use
    return (head.proj, head.gate, head.bias)


def run_recomputed_block(stream, layers, iters=20, kernels=None, head=None):
    """Apply [(sublayer, hc), ...] to X [..., n, C] by RecomputedBlock; with a head (the last
    block) -> its collapse [..., C]. kernels: this module's functions unless given."""
    kernels = kernels or sys.modules[__name__]
    for _, hc in layers:
        hc.check_stream(stream)
    if not torch.is_grad_enabled():  # nothing to keep: a plain forward
        for sublayer, hc in layers:
            h, coefficients = kernels.mix_in(stream, hc_params(hc), iters)
            stream = kernels.mix_out(stream, coefficients, sublayer(h))
        return stream if head is None else kernels.collapse(stream, head_params(head))[0]
    if not stream.requires_grad:  # backward must still run, to fill the parameters' grads
        stream = stream.detach().requires_grad_()
    params = [p for _, hc in layers for p in hc_params(hc)] + list(
        head_params(head) if head else []
    )
    return RecomputedBlock.apply(stream, list(layers), iters, kernels, head, *params)


def recompute_blocks(start, end, block):
    """Layers [start, end) of one stage in blocks of at most `block`: [(first, stop), ...]. None
    crosses a stage boundary: a block's input must live on the stage that replays it."""
    if block < 1:
        raise ValueError(f"recompute block L_r must be >= 1 layer, got {block}")
    return [(first, min(first + block, end)) for first in range(start, end, block)]


def default_recompute_block(n, n_layers):
    """L_r ~ sqrt(n L / (n + 2)) (mHC paper §4), at least 1: the block inputs kept cost nC L / L_r,
    rebuilding one block holds ~(n + 2) C L_r; their sum is smallest there."""
    return max(1, round(math.sqrt(n * n_layers / (n + 2))))


def run_recomputed_layers(stream, layers, block, iters=20, kernels=None, head=None):
    """One stage's [(sublayer, hc), ...] in recompute blocks of at most `block` layers (L_r); a
    head is folded into the last block (-> [..., C])."""
    blocks = recompute_blocks(0, len(layers), block)
    for first, stop in blocks:
        last = head if stop == len(layers) else None
        stream = run_recomputed_block(stream, layers[first:stop], iters, kernels, last)
    return head(stream) if head is not None and not blocks else stream


# Compiled (compiled/mhc_compiled.py): eagerly each kernel is still a string of ops plus Python
# dispatch; torch.compile fuses each into a few loops. It compiles the six kernels, not a layer or
# a block: pure functions with their backward written out are inference graphs (nothing saved,
# nothing for AOTAutograd to partition) that serve every layer of a shape, while F, which must keep
# its own autograd graph, is compiled on its own; RecomputedBlock's bookkeeping stays in Python.


# ---- 4. pipeline parallelism: 1F1B ---------------------------------------------------------------


def stage_layers(n_layers, n_stages, stage):
    """Layers [first, stop) held by `stage` of `n_stages`: an equal contiguous share."""
    if n_stages < 1 or n_stages > n_layers or n_layers % n_stages:
        raise ValueError(
            f"{n_stages} pipeline stages cannot split {n_layers} layers evenly: use a stage "
            f"count that divides n_layers and is at most n_layers"
        )
    return stage * (n_layers // n_stages), (stage + 1) * (n_layers // n_stages)


def one_f_one_b(n_stages, stage, n_micro):
    """The order in which `stage` runs forwards and backwards: [('F', i) | ('B', i), ...].

    Warm-up: n_stages - stage - 1 forwards fill the pipe; the steady state alternates one forward
    then one backward; the cool-down drains the last backwards. A stage never holds more than
    n_stages - stage micro-batches' activations (GPipe would hold all n_micro).
    """
    if n_micro < n_stages:
        raise ValueError(
            f"1F1B needs at least as many micro-batches as stages: n_micro={n_micro} < "
            f"n_stages={n_stages}; raise n_micro or use fewer stages"
        )
    # hint: how many forwards must a stage run before its first backward can arrive?
    ### BEGIN SOLUTION
    warmup = min(n_stages - stage - 1, n_micro)
    order = [("F", i) for i in range(warmup)]  # warm-up
    for i in range(warmup, n_micro):  # steady state: forward i, backward i - warmup
        order += [("F", i), ("B", i - warmup)]
    order += [("B", i) for i in range(n_micro - warmup, n_micro)]  # cool-down
    return order
    ### END SOLUTION


@dataclass
class PipelineStats:
    """What one stage measured in one pipeline_step."""

    bytes_sent_forward: int = 0  # activations sent to the next stage
    bytes_sent_backward: int = 0  # gradients sent to the previous stage
    wait_s: float = 0.0  # blocked on receives: the bubble plus transfer that was not hidden
    compute_s: float = 0.0  # this stage's forward and backward compute


_GROUPS = weakref.WeakKeyDictionary()  # default group -> {"forward": group, "backward": group}


def pipeline_groups():
    """One group per direction over all ranks (see StageLinks), made once, on every rank."""
    if dist.group.WORLD not in _GROUPS:
        _GROUPS[dist.group.WORLD] = {"forward": dist.new_group(), "backward": dist.new_group()}
    return _GROUPS[dist.group.WORLD]


def clock(device):
    """Host time after the device is idle: under NCCL Work.wait() does not block the host."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class StageLinks:
    """One stage's sends and receives of streams [B/n_micro, T, (n,) C].

    NCCL runs the sends and receives between two ranks in issue order on one stream, ignores tags
    and does not buffer sends. Activations ("forward") go on one group and gradients ("backward")
    on another, so every (group, neighbour) link carries data one way, in micro-batch order: no
    issue order can deadlock. overlap=True posts each receive one micro-batch ahead.
    """

    def __init__(self, stage, world, n_micro, shape, like, overlap, groups=None):
        # groups: {"forward": g, "backward": g}, group ranks = stages (default: over the world)
        self.groups = groups or (pipeline_groups() if world > 1 else {})
        self.stage, self.n_micro, self.shape, self.like, self.overlap = (
            stage, n_micro, shape, like, overlap)  # fmt: skip
        self.pending, self.sends, self.stats = {}, [], PipelineStats()
        if overlap and stage > 0:
            self.post_recv("forward", 0)
        if overlap and stage < world - 1:
            self.post_recv("backward", 0)

    def post_recv(self, direction, i):
        if i < self.n_micro and (direction, i) not in self.pending:
            buffer = torch.empty(self.shape, dtype=self.like.dtype, device=self.like.device)
            peer = self.stage - 1 if direction == "forward" else self.stage + 1
            work = dist.irecv(buffer, group=self.groups[direction], group_src=peer)
            self.pending[direction, i] = buffer, work

    def recv(self, direction, i):
        """Micro-batch i's activation ("forward", from stage - 1) or gradient ("backward")."""
        self.post_recv(direction, i)
        buffer, work = self.pending.pop((direction, i))
        began = clock(self.like.device)
        work.wait()
        self.stats.wait_s += clock(self.like.device) - began
        if self.overlap:
            self.post_recv(direction, i + 1)  # the next one arrives while we compute
        return buffer

    def send(self, direction, tensor):
        """Asynchronous: two neighbours may send to each other at the same moment."""
        tensor = tensor.detach().contiguous()
        peer = self.stage + 1 if direction == "forward" else self.stage - 1
        work = dist.isend(tensor, group=self.groups[direction], group_dst=peer)
        self.sends.append((work, tensor))  # keep the tensor alive until the send is done
        field = f"bytes_sent_{direction}"
        setattr(
            self.stats, field, getattr(self.stats, field) + tensor.numel() * tensor.element_size()
        )

    def finish(self):
        for work, _ in self.sends:
            work.wait()
        return self.stats


def pipeline_step(
    model, idx, targets, n_micro, variant="fused", block=None, overlap=True, groups=None
):
    """One training step's forward and backward over the pipeline stages.

    idx, targets [B, T], the same on every rank (stage 0 reads idx, the last stage targets: the
    guard compares their digest). variant, block: as Transformer.run_layers, per stage. Fills
    .grad of this stage's parameters (the mean loss over the batch, as one process would) and
    returns (loss on the last stage else None, PipelineStats). overlap=False is the baseline that
    hides nothing: each receive is posted when its data is needed and waited at once. groups:
    StageLinks' two links (default: over the world; a device mesh passes its pipeline dimension).
    """
    group = groups["forward"] if groups else None  # the pipeline's ranks (default: the world)
    world, stage = (
        (dist.get_world_size(group), dist.get_rank(group)) if dist.is_initialized() else (1, 0)
    )
    check_pipeline_step(model, idx, targets, n_micro, variant, block, overlap, group)
    # hint: forward(i) and backward(i) each receive, compute, send; then run the phases in order
    ### BEGIN SOLUTION
    first, stop = stage_layers(model.cfg.n_layers, world, stage)
    order, warmup = one_f_one_b(world, stage, n_micro), min(world - stage - 1, n_micro)
    shape = model.stream_shape(idx.shape[0] // n_micro)
    links = StageLinks(stage, world, n_micro, shape, model.embed.weight, overlap, groups)
    idx_micro, tgt_micro = idx.chunk(n_micro), targets.chunk(n_micro)
    held_in, held_out, losses, last = {}, {}, [], stage == world - 1
    device = model.embed.weight.device

    def forward(i):
        if stage == 0:
            stream = model.embed_stream(idx_micro[i])
        else:
            stream = links.recv("forward", i).requires_grad_()
        began = clock(device)
        out = model.run_layers(stream, first, stop, variant, block, final=last)
        if last:
            out = model.head_loss(out, tgt_micro[i]) / n_micro
            losses.append(out.detach())
        links.stats.compute_s += clock(device) - began
        held_in[i], held_out[i] = stream, out
        if not last:
            links.send("forward", out)

    def backward(i):
        grad = None if last else links.recv("backward", i)
        began = clock(device)
        held_out.pop(i).backward(grad)
        links.stats.compute_s += clock(device) - began
        stream = held_in.pop(i)
        if stage > 0:
            links.send("backward", stream.grad)

    for _, i in order[:warmup]:  # warm-up: forwards fill the pipe
        forward(i)
    for kind, i in order[warmup : 2 * n_micro - warmup]:  # steady state: one F, one B
        forward(i) if kind == "F" else backward(i)
    for _, i in order[2 * n_micro - warmup :]:  # cool-down: the last backwards drain it
        backward(i)
    return (torch.stack(losses).sum() if last else None), links.finish()
    ### END SOLUTION


# ---- the small transformer -----------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight


class Attention(nn.Module):
    """F for an attention layer: causal self-attention on its RMSNorm'd input. [B, T, C] -> same"""

    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.norm = cfg.n_heads, RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).unflatten(-1, (3, self.n_heads, -1)).unbind(-3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    """F for an MLP layer: GELU MLP (4x) on its own RMSNorm'd input. [B, T, C] -> [B, T, C]."""

    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(self.norm(x))))


class Transformer(nn.Module):
    """A pre-norm transformer of alternating attention and MLP sublayers F.

    hyper=True: each layer an mHC layer; the embedding is copied into n lanes once (embed_stream)
    and collapsed once by the learned HyperHead (hyper_head) before the final norm and the LM head
    (lm_head), as in V4. hyper=False: the plain residual x' = x + F(x) with the same F modules.
    """

    def __init__(self, cfg, hyper=True):
        super().__init__()
        self.cfg, self.hyper = cfg, hyper
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.sublayers = nn.ModuleList(
            Attention(cfg) if i % 2 == 0 else MLP(cfg) for i in range(cfg.n_layers)
        )
        self.hcs = self.hyper_head = None
        if hyper:
            n, dim = cfg.n_hc, cfg.dim
            self.hcs = nn.ModuleList(HyperConnection(n, dim, cfg.gate_init) for _ in self.sublayers)
            self.hyper_head = HyperHead(n, dim, cfg.gate_init)
        self.norm = RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def stream_shape(self, batch):
        """What flows between layers and stages: [B, T, n, C], or [B, T, C] for the residual."""
        return (batch, self.cfg.seq_len, *((self.cfg.n_hc,) if self.hyper else ()), self.cfg.dim)

    def embed_stream(self, idx):
        """idx [B, T] -> the stream [B, T, n, C]: the embedding in n lanes, as a stride-0 view (the
        first recompute block then keeps C numbers per token for its input, not n*C)."""
        x = self.embed(idx)  # (B, T, C)
        return (
            x.unsqueeze(-2).expand(*x.shape[:-1], self.cfg.n_hc, x.shape[-1]) if self.hyper else x
        )

    def run_layers(self, stream, start, end, variant="naive", block=None, final=False):
        """Apply layers [start, end). variant (mHC models; VARIANTS):
          "naive"      the plain autograd layer, mhc_layer_reference: every intermediate kept;
          "fused"      section 2's kernels, each layer one autograd op (a block of one layer);
          "optimised"  the same in recompute blocks of `block` = L_r layers (default:
                       default_recompute_block of these layers), cut within [start, end).
        final (the last stage): end with the lanes collapsed by the HyperHead, [B, T, C]; fused
        and optimised fold it into their last block."""
        check_variant(variant, block)
        if not self.hyper:
            for sublayer in self.sublayers[start:end]:
                stream = stream + sublayer(stream)  # x' = x + F(x)
            return stream
        iters, head = self.cfg.sinkhorn_iters, self.hyper_head if final else None
        layers = list(zip(self.sublayers[start:end], self.hcs[start:end]))
        if variant == "naive":
            for sublayer, hc in layers:
                stream = mhc_layer_reference(stream, sublayer, hc, iters)  # X' = B X + C F(A X)
            return head(stream) if final else stream
        block = (
            1
            if variant == "fused"
            else block or default_recompute_block(self.cfg.n_hc, end - start)
        )
        return run_recomputed_layers(stream, layers, block, iters, None, head)

    def head_loss(self, stream, targets):
        """The HyperHead's collapse unless run_layers(final=True) did it ([B, T, C] in), then the
        final norm, the LM head and cross-entropy -> loss."""
        x = self.hyper_head(stream) if self.hyper and stream.dim() == 4 else stream
        return F.cross_entropy(self.lm_head(self.norm(x)).flatten(0, -2), targets.flatten())

    def forward(self, idx, targets, variant="naive", block=None):
        x = self.run_layers(self.embed_stream(idx), 0, self.cfg.n_layers, variant, block, True)
        return self.head_loss(x, targets)


# ---- appendix: validation and the agreement guard, then the demo ---------------------------------


def check_config(cfg):
    """One clear ValueError per impossible Config field."""
    for name in ("vocab_size", "seq_len", "dim", "n_heads", "n_layers", "n_hc", "sinkhorn_iters"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"Config.{name} must be an integer >= 1, got {value!r}")
    if cfg.dim % cfg.n_heads:
        raise ValueError(f"dim={cfg.dim} must be divisible by n_heads={cfg.n_heads}")
    if not math.isfinite(cfg.gate_init):
        raise ValueError(f"Config.gate_init must be finite, got {cfg.gate_init}")


def check_variant(variant, block):
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if block is not None and (variant != "optimised" or not isinstance(block, int) or block < 1):
        raise ValueError(f"recompute block L_r must be an int >= 1 with variant 'optimised' (or "
                         f"None), got block={block!r} with variant {variant!r}")  # fmt: skip


def validate_pipeline_inputs(model, idx, targets, n_micro, variant, block, world, stage):
    """Raise the clear ValueError for this rank's bad input (run before any collective)."""
    cfg, got = (
        model.cfg,
        f"got {tuple(idx.shape)} {idx.dtype} and {tuple(targets.shape)} {targets.dtype}",
    )
    if idx.shape != targets.shape or idx.dim() != 2 or idx.shape[1] != cfg.seq_len:
        raise ValueError(f"idx and targets must both be [batch, seq_len={cfg.seq_len}], {got}")
    if idx.dtype != torch.long or targets.dtype != torch.long:
        raise ValueError(f"idx and targets must be int64 token ids, {got}")
    if idx.device != model.embed.weight.device:
        raise ValueError(f"idx is on {idx.device} but the model on {model.embed.weight.device}")
    if not isinstance(n_micro, int) or n_micro < 1 or idx.shape[0] % n_micro:
        raise ValueError(f"batch {idx.shape[0]} does not split into n_micro={n_micro} equal "
                         "micro-batches")  # fmt: skip
    check_variant(variant, block)
    stage_layers(cfg.n_layers, world, stage)
    one_f_one_b(world, stage, n_micro)


_GUARDED = weakref.WeakSet()  # models whose initial parameters the guard has compared


def check_pipeline_step(model, idx, targets, n_micro, variant, block, overlap, group):
    """This rank's validation, then launch.agree on everything the stages share: the batch itself
    (a digest: stage 0 embeds idx, the last stage scores targets) and, on a model's first step,
    its initial parameters (every stage builds the whole model from one seed)."""
    world, stage = (
        (dist.get_world_size(group), dist.get_rank(group)) if dist.is_initialized() else (1, 0)
    )
    error = None
    try:
        validate_pipeline_inputs(model, idx, targets, n_micro, variant, block, world, stage)
    except ValueError as e:
        error = str(e)
    fields = {
        "config": asdict(model.cfg),
        "hyper": model.hyper,
        "parameter dtype": str(model.embed.weight.dtype),
        "idx shape": tuple(idx.shape),
        "targets shape": tuple(targets.shape),
        "batch (sha256 of idx, targets)": launch.weights_digest([("i", idx), ("t", targets)]),
        "n_micro": n_micro,
        "variant": variant,
        "block (L_r)": block,
        "overlap": bool(overlap),
    }
    if model not in _GUARDED:
        fields["initial parameters (sha256)"] = launch.weights_digest(model.named_parameters())
    launch.agree(fields, error, group)
    _GUARDED.add(model)


def saved_activation_bytes(model, run):
    """Bytes of distinct storages autograd holds for backward while run() builds the graph
    (parameters excluded). -> (run's result, bytes)."""
    params, seen = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(seen.values())


def synthetic_batch(cfg, batch, generator, device):
    """Learnable toy data [batch, T + 1]: each row counts up from a random start, stride 1..3."""
    start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=generator)
    stride = torch.randint(1, 4, (batch, 1), generator=generator)
    return ((start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size).to(device)


def compare_in_one_process(cfg, args, device):
    """Residual vs naive vs optimised mHC, each trained a few steps in this process."""
    l_r = default_recompute_block(cfg.n_hc, cfg.n_layers)
    print(f"optimised = fused mixing + selective recomputation (L_r = {l_r}); memory = bytes saved "
          f"for backward; step time = median of {args.steps} steps\n")  # fmt: skip
    print(f"{'variant':<10} {'loss start':>10} {'loss end':>9} {'saved act MiB':>14} "
          f"{'step ms':>9} {'F calls/step':>13}")  # fmt: skip
    base, began = None, time.perf_counter()
    for name in ("residual", "naive", "optimised"):
        torch.manual_seed(args.seed)
        model = Transformer(cfg, hyper=name != "residual").to(device)
        opt, gen = torch.optim.AdamW(model.parameters(), lr=3e-3), torch.Generator()
        gen.manual_seed(args.seed)
        variant, block = ("optimised", l_r) if name == "optimised" else ("naive", None)
        calls = [0]
        for m in model.sublayers:
            m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        losses, times = [], []
        for _ in range(args.steps + 1):  # step 0 warms up allocators and caches: not timed
            data = synthetic_batch(cfg, args.batch, gen, device)
            t0 = clock(device)
            run = lambda: model(data[:, :-1], data[:, 1:], variant, block)  # noqa: E731
            loss, saved = saved_activation_bytes(model, run)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times, losses = times + [clock(device) - t0], losses + [loss.item()]
        mib, ms = saved / 2**20, 1e3 * sorted(times[1:])[args.steps // 2]
        base = base or (mib, ms)
        cells = f"{losses[0]:>10.4f} {losses[-1]:>9.4f} {mib:>14.2f} {ms:>9.1f}"
        print(f"{name:<10} {cells} {calls[0] / (args.steps + 1):>13.0f}   (x{ms / base[1]:.2f} "
              f"time, x{mib / base[0]:.2f} memory; {time.perf_counter() - began:.0f} s "
              "elapsed)")  # fmt: skip


def train_pipeline(cfg, args, rank, world, device):
    """Residual then mHC (optimised) trained as a 1F1B pipeline over the ranks."""
    launch.say(f"\npipeline: {world} stage(s), 1F1B over {args.micro} micro-batches of "
               f"{args.batch // args.micro}, receives posted ahead")  # fmt: skip
    l_r = default_recompute_block(cfg.n_hc, cfg.n_layers // world)
    for hyper in (False, True):
        torch.manual_seed(args.seed)
        model = Transformer(cfg, hyper=hyper).to(device)
        opt, gen = torch.optim.AdamW(model.parameters(), lr=3e-3), torch.Generator()
        gen.manual_seed(args.seed + 1)
        variant, block = ("optimised", l_r) if hyper else ("naive", None)
        losses, waited, began = [], 0.0, time.perf_counter()
        for _ in range(args.steps):
            data = synthetic_batch(cfg, args.batch, gen, device)
            loss, stats = pipeline_step(
                model, data[:, :-1], data[:, 1:], args.micro, variant, block
            )
            opt.step()
            opt.zero_grad(set_to_none=True)
            waited, losses = waited + stats.wait_s, losses + ([] if loss is None else [loss.item()])
        name, ms = "mHC" if hyper else "residual", 1e3 * (time.perf_counter() - began) / args.steps
        if rank == world - 1:
            print(f"  {name:<9} loss {losses[0]:.4f} -> {losses[-1]:.4f} (last stage), "
                  f"{ms:.0f} ms per step", flush=True)  # fmt: skip
        if world > 1:
            dist.barrier()
            launch.say(f"  {name:<9} sent per step across each stage boundary: "
                       f"{stats.bytes_sent_forward / 2**20:.3f} MiB forward + the same backward; "
                       f"stage 0 waited on receives {1e3 * waited / args.steps:.1f} of "
                       f"{ms:.1f} ms per step")  # fmt: skip
            dist.barrier()


def parse_args(argv=None):
    """Every option with its help; every value checked here, before any work, one line each."""
    world, count = int(os.environ.get("WORLD_SIZE", "1")), launch.at_least(1)
    parser = argparse.ArgumentParser(
        description="mHC demo: residual vs naive vs optimised mHC in one process, then the same "
        "model as a 1F1B pipeline over the torchrun ranks, receives posted ahead."
    )
    add = parser.add_argument
    add("--dim", type=count, default=128, help="C, the width of one lane (128)")
    add("--layers", type=count, default=12, help="sublayers, attention and MLP alternating; must "
        "divide over the ranks (12 works at 1-4)")  # fmt: skip
    add("--heads", type=count, default=None, help="attention heads; must divide --dim "
        "(default dim // 32)")  # fmt: skip
    add("--seq-len", type=count, default=32, help="tokens per sequence, T (32)")
    add("--steps", type=count, default=6, help="training steps per run (6)")
    add("--batch", type=count, default=24, help="sequences per step; must split into --micro "
        "equal micro-batches (24 splits into 2, 4, 6, 8)")  # fmt: skip
    add("--micro", type=count, default=None, help="pipeline micro-batches per step, at least the "
        "rank count (default 2 x ranks)")  # fmt: skip
    add("--seed", type=int, default=0, help="seed of model and data (0)")
    args = launch.check_launch_options(parser, launch.add_launch_options(parser).parse_args(argv))
    args.heads = max(1, args.dim // 32) if args.heads is None else args.heads
    args.micro = 2 * world if args.micro is None else args.micro
    for bad, message in (
        (args.dim % args.heads, f"--heads {args.heads} must divide --dim {args.dim}"),
        (args.layers % world or args.layers < world,
         f"--layers {args.layers} must be a multiple of the {world} ranks (stages)"),
        (args.micro < world, f"--micro {args.micro} must be at least the {world} ranks (1F1B)"),
        (args.batch % args.micro,
         f"--batch {args.batch} must split into --micro {args.micro} equal parts"),
    ):  # fmt: skip
        if bad:
            parser.error(message)
    return args


def demo(args, rank, world, device):
    cfg = Config(seq_len=args.seq_len, dim=args.dim, n_layers=args.layers, n_heads=args.heads)
    launch.say(f"mHC demo: {cfg.n_layers} layers, C={cfg.dim}, n_hc={cfg.n_hc}, T={cfg.seq_len}, "
               f"batch {args.batch}, {args.steps} steps, {world} rank(s)")  # fmt: skip
    if world == 1:
        compare_in_one_process(cfg, args, device)
    else:
        launch.say("(the one-process comparison of residual, naive and optimised mHC runs with "
                   "`python mhc.py`)")  # fmt: skip
    launch.say("\nlane-mixing bytes and the expected overhead over C: "
               "python benchmarks/bench_mhc.py --accounting")  # fmt: skip
    train_pipeline(cfg, args, rank, world, device)
    if world >= 2:
        launch.say("\nposted-ahead vs blocking receives, timed side by side: "
                   "python benchmarks/bench_mhc.py (table 2)")  # fmt: skip


if __name__ == "__main__":
    launch.run(demo, parse_args())
