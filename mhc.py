"""mHC made affordable: manifold-constrained hyper-connections and three things that pay for them.
DeepSeek-V4 §3.4.2 (the layer: V4 §2.2; the mHC paper, arXiv 2512.24880, §4).

What the standard tool assumes. The residual stream is one vector of d numbers per token,
x' = x + F(x): checkpointing keeps or drops whole modules, a pipeline stage sends d per token.

What V4 violates. Hyper-connections widen the stream to n_hc lanes, X in R^{n x d}, mixed by
three small per-token matrices computed from the stream itself:
    X' = B X + C F(A X),   A = sigmoid(.) in R^{1 x n},  C = 2 sigmoid(.) in R^{n x 1},
    B = Sinkhorn-Knopp(exp(.)) in R^{n x n}, doubly stochastic (the "manifold constraint").
Every layer's input is now n*d per token: n times the activation memory and the pipeline
traffic, and eager autograd runs the memory-bound mixing as small ops that each keep their output.

The fix, three reductions, each checked against the plain autograd layer:
  1. fused lane mixing (section 2): coefficients, pre-mix A X and post-mix B X + C f as pure
     functions with their backward written out, reading the lanes once;
  2. selective recomputation (section 3): keep one block input every L_r layers, each F output
     and each layer's coefficients; backward rebuilds the lanes with the post-mix, never F;
  3. a 1F1B pipeline (section 4) whose stages post the n-lane stream's receives ahead, so the
     extra traffic hides behind compute (V4 does this inside DualPipe).
VARIANTS is the choice: "naive" (plain autograd), "fused" (1), "optimised" (1 and 2). The mHC
parts compute what the public V4 code does (tests/test_mhc_v4_oracle.py; interop/v4_mhc.py).

    python mhc.py                          # residual vs naive vs optimised mHC, one process
    torchrun --nproc_per_node=2 mhc.py     # the same over 2 pipeline stages (1-4 work; --help)
"""

import argparse
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.functional import cross_entropy, gelu, scaled_dot_product_attention

import launch

EPS = 1e-6  # V4's hc_eps and rms_norm_eps: in the norm, in A, and in every Sinkhorn sum
VARIANTS = ("naive", "fused", "optimised")  # the mHC variants (Transformer.run_layers)
KEPT_PER_LAYER = 5  # the tensors mix_in keeps per layer for backward: A, B, C, x W, 1/rms


@dataclass
class Config:
    vocab_size: int = 256
    seq_len: int = 64
    dim: int = 128  # d, the width of one lane
    n_heads: int = 4
    n_layers: int = 12  # attention and MLP sublayers alternate, each with its own HC (as in V4)
    n_hc: int = 4  # lanes in the widened residual stream
    sinkhorn_iters: int = 20
    gate_init: float = 0.01  # alpha: the data-dependent part of A, B, C starts small

    def __post_init__(self):
        check_config(self)


# ---- 1. the mHC layer (V4 §2.2) ------------------------------------------------------------------


def sinkhorn_knopp(logits, iters=20, eps=EPS):
    """Project exp(logits) onto the doubly stochastic matrices. logits [..., n, n] -> [..., n, n].
    V4's order: a softmax down each column + eps, then rows, then iters - 1 rounds of columns and
    rows, every sum + eps (at logits of +-60 a column underflows to 0). Ending on rows makes each
    output lane a convex combination of input lanes."""
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
    """A, B, C and the pre-mix in fp32 (or float64) whatever the model's dtype, as V4."""
    return torch.promote_types(dtype, torch.float32)


def lane_init_bias(n):
    """S with sigmoid(S) = 1/n: A X and the head start as the lanes' mean (at n = 1, S = 0)."""
    return torch.full((n,), -math.log(n - 1) if n > 1 else 0.0)


class HyperConnection(nn.Module):
    """One layer's A [..., n], B [..., n, n], C [..., n] from X [..., n, d]: biases S plus gated
    alpha * (x_hat W). proj's columns are [W_pre | W_post | W_res], W_res row-major as B."""

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
                f"mHC stream must have shape [..., n_hc={self.n}, dim={self.dim}], "
                f"got {tuple(stream.shape)}: expand the embedding into n_hc lanes "
                "once (PipelineModel.embed_stream)"
            )


def mhc_coefficients(stream, hc, iters=20):
    """stream [..., n, d] -> (A [..., n], B [..., n, n], C [..., n]) in mixing_dtype, by autograd:
    [pre | post | res] = RMSNorm(vec X) W; A = sigmoid(a_pre pre + S_pre) + eps,
    C = 2 sigmoid(a_post post + S_post), B = sinkhorn_knopp(a_res res (n x n) + S_res)."""
    n = hc.n
    # hint: x_hat = RMSNorm(vec(X)); one projection; split n, n, n*n; A gets + EPS (as V4)
    ### BEGIN SOLUTION
    dtype = mixing_dtype(stream.dtype)
    flat = stream.flatten(-2).to(dtype)  # [..., n*d]
    proj, gate = hc.proj.to(dtype), hc.gate.to(dtype)
    logits = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS)) @ proj
    pre, post, res = logits.split([n, n, n * n], dim=-1)
    a = torch.sigmoid(gate[0] * pre + hc.bias_pre.to(dtype)) + EPS  # + eps: as V4, A never 0
    c = 2 * torch.sigmoid(gate[1] * post + hc.bias_post.to(dtype))
    b = sinkhorn_knopp(gate[2] * res.unflatten(-1, (n, n)) + hc.bias_res.to(dtype), iters)
    return a, b, c
    ### END SOLUTION


def mhc_layer_reference(stream, sublayer, hc, iters=20):
    """The plain autograd mHC layer, X [..., n, d] -> B X + C F(A X): every other path is tested
    against it. Pre-mix in fp32, post-mix in the stream's dtype, as V4."""
    hc.check_stream(stream)
    a, b, c = mhc_coefficients(stream, hc, iters)
    f = sublayer(torch.einsum("...n,...nc->...c", a, stream.to(a.dtype)).to(stream.dtype))
    b, c = b.to(stream.dtype), c.to(stream.dtype)
    return torch.einsum("...ij,...jc->...ic", b, stream) + c.unsqueeze(-1) * f.unsqueeze(-2)


class HyperHead(nn.Module):
    """V4's HyperHead: X [..., n, d] -> sum_i w_i X_i, w = sigmoid(alpha x_hat W + S) + eps."""

    def __init__(self, n, dim, gate_init=0.01):
        super().__init__()
        self.n, self.dim = n, dim
        self.proj = nn.Parameter(torch.randn(n * dim, n) * (n * dim) ** -0.5)
        self.gate = nn.Parameter(torch.full((1,), float(gate_init)))
        self.bias = nn.Parameter(lane_init_bias(n))

    def forward(self, stream):
        dtype = mixing_dtype(stream.dtype)
        flat = stream.flatten(-2).to(dtype)  # [..., n*d]
        x_hat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS)
        z = x_hat @ self.proj.to(dtype) * self.gate.to(dtype) + self.bias.to(dtype)
        return ((torch.sigmoid(z) + EPS).unsqueeze(-1) * stream.to(dtype)).sum(-2).to(stream.dtype)


# ---- 2. fused lane mixing ------------------------------------------------------------------------
# Each operation a pure forward and a pure backward: what one kernel reads, computes and writes;
# section 3 runs them. Autograd only inside Sinkhorn's backward, a replay of the graded
# sinkhorn_knopp that lives and dies in the call. compiled/mhc_compiled.py hands these same
# functions to torch.compile, which fuses each into a few loops over the lanes: pure functions
# with their backward written out have nothing to save or partition, and one graph serves every
# layer.


def lanes_matmul(m, x):
    """m [..., p, q] @ x [..., q, r] -> [..., p, r], the small per-token products. Under
    torch.compile, as loops Inductor fuses with their neighbours (a bmm stays an external call
    that writes its output and reads it back): a short sum (q <= n) as a broadcast product summed
    over q; a long one (q = C, as dB = dX' X^T) as p * r dot products over the contiguous axis."""
    if not torch.compiler.is_compiling():
        return m @ x
    if m.shape[-1] > x.shape[-1]:  # one loop with p * r accumulators, not p * r dependent chains
        rows, cols = m.unbind(-2), x.unbind(-1)
        return torch.stack([torch.stack([(r * c).sum(-1) for c in cols], -1) for r in rows], -2)
    return (m.unsqueeze(-1) * x.unsqueeze(-3)).sum(-2)


def norm_then_project(x, weight):
    """RMSNorm(x) W as (x W) r, r = 1/rms(x): x [..., D] -> (x W, r); x / rms is never written."""
    return x @ weight, torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def norm_then_project_backward(grad, x, weight, projected, inv_rms):
    """Of y = (x W) r: dy [..., k] -> (dx = (dy r) W^T - (sum(dy * xW) r^3 / D) x, dW [D, k])."""
    scaled = grad * inv_rms  # [..., k]
    grad_weight = (scaled.reshape(-1, scaled.shape[-1]).T @ x.reshape(-1, x.shape[-1])).T
    through_rms = (grad * projected).sum(-1, keepdim=True) * inv_rms.pow(3) / x.shape[-1]
    return torch.addcmul(scaled @ weight.T, through_rms, x, value=-1), grad_weight


def sinkhorn_backward(logits, grad, iters=20, eps=EPS):
    """d logits of sinkhorn_knopp given dB [..., n, n]: sinkhorn_knopp replayed under autograd.
    The one kernel whose backward is not written out: its replay would be sinkhorn_knopp again.
    What the replay saves lives only inside this call: no caller's saved-tensor hook sees it."""
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
        x = logits.detach().requires_grad_()
        return torch.autograd.grad(sinkhorn_knopp(x, iters, eps), x, grad)[0]


def _as_is(t):
    return t


def pre_mix(a, stream):
    """h = A X: A [..., n], X [..., n, d] -> [..., d]. Reads X once, writes d."""
    return lanes_matmul(a.unsqueeze(-2), stream).squeeze(-2)


def pre_mix_backward(grad_h, a, stream):
    """-> (dA [..., n] = <X_i, dh>, dX [..., n, d] = A_i dh)."""
    return (stream * grad_h.unsqueeze(-2)).sum(-1), a.unsqueeze(-1) * grad_h.unsqueeze(-2)


def post_mix(b, stream, c, f):
    """X' = B X + C f [..., n, d] in one output, no B X or C f temporaries (mHC paper §4)."""
    return lanes_matmul(b, stream).addcmul_(c.unsqueeze(-1), f.unsqueeze(-2))


def post_mix_backward(grad_out, b, stream, c, f):
    """Gradients of X' = B X + C f for dX' [..., n, d] -> (dB, dX, dC, df), shaped as b, X, c, f."""
    # hint: X' = B X + C f is linear in each input; write each gradient as one lanes_matmul
    ### BEGIN SOLUTION
    grad_b = lanes_matmul(grad_out, stream.transpose(-1, -2))  # [..., n, n]
    grad_stream = lanes_matmul(b.transpose(-1, -2), grad_out)  # [..., n, d]
    grad_c = lanes_matmul(grad_out, f.unsqueeze(-1)).squeeze(-1)  # [..., n]
    grad_f = lanes_matmul(c.unsqueeze(-2), grad_out).squeeze(-2)  # [..., d]
    return grad_b, grad_stream, grad_c, grad_f
    ### END SOLUTION


def mix_in(stream, params, iters):
    """mhc_coefficients and the pre-mix, forward only: X [..., n, d] -> (h = A X, kept). params:
    hc_params(hc). kept = (A, B, C, x W, 1/rms): all backward needs besides X, per token. The
    coefficients come from mhc_coefficients, where they are written once; x W and 1/rms are
    projected again beside it, for the backward."""
    a, b, c = mhc_coefficients(stream, params, iters)
    x = stream.to(a.dtype)
    projected, inv_rms = norm_then_project(x.flatten(-2), params.proj.to(a.dtype))
    return pre_mix(a, x).to(stream.dtype), (a, b, c, projected, inv_rms)


def mix_out(stream, kept, f):
    """Post-mix + merge in X's dtype (B, C cast to it, as V4): X [..., n, d], f [..., d] -> X'."""
    return post_mix(kept[1].to(stream.dtype), stream, kept[2].to(stream.dtype), f)


def mix_out_backward(grad_out, stream, kept, f):
    """Backward of mix_out: dX' -> (dB, dX, dC, df), dB and dC in the mixing dtype."""
    (_, b, c, _, _), sd = kept, stream.dtype
    grad_b, grad_x, grad_c, grad_f = post_mix_backward(grad_out, b.to(sd), stream, c.to(sd), f)
    return grad_b.to(b.dtype), grad_x, grad_c.to(c.dtype), grad_f


def mix_in_backward(grad_h, grad_b, grad_c, grad_x_post, stream, kept, params, iters):
    """Backward of mix_in plus the post-mix's dX -> (dX [..., n, d], grads of params)."""
    a, b, c, projected, inv_rms = kept
    proj, gate, _, _, bias_res = (p.to(a.dtype) for p in params)
    n, x = stream.shape[-2], stream.to(a.dtype)
    grad_a, grad_x = pre_mix_backward(grad_h.to(a.dtype), a, x)
    pre, post, res = (projected * inv_rms).split([n, n, n * n], dim=-1)
    res = res.unflatten(-1, (n, n))
    grad_pre = grad_a * (a - EPS) * (1 - (a - EPS))  # sigmoid' = s (1 - s)
    grad_post = grad_c * c * (1 - c / 2)  # (2 sigmoid)' = C (1 - C/2)
    grad_res = sinkhorn_backward(gate[2] * res + bias_res, grad_b, iters)
    grad_z = [grad_pre * gate[0], grad_post * gate[1], (grad_res * gate[2]).flatten(-2)]
    grad_flat, grad_proj = norm_then_project_backward(
        torch.cat(grad_z, -1), x.flatten(-2), proj, projected, inv_rms
    )
    grad_x = grad_x + grad_flat.unflatten(-1, (n, -1)) + grad_x_post
    tokens = tuple(range(a.dim() - 1))
    pairs = ((grad_pre, pre), (grad_post, post), (grad_res, res))
    grad_gate = torch.stack([(g * v).sum() for g, v in pairs])
    grads = grad_proj, grad_gate, *(g.sum(tokens) for g in (grad_pre, grad_post, grad_res))
    return grad_x.to(stream.dtype), tuple(g.to(p.dtype) for g, p in zip(grads, params))


def collapse(stream, params):
    """HyperHead's forward alone: X [..., n, d] -> (x [..., d], kept = (w, x W, 1/rms))."""
    proj, gate, bias = (p.to(mixing_dtype(stream.dtype)) for p in params)
    x = stream.to(proj.dtype)
    projected, inv_rms = norm_then_project(x.flatten(-2), proj)
    weights = torch.sigmoid(gate * projected * inv_rms + bias) + EPS
    return pre_mix(weights, x).to(stream.dtype), (weights, projected, inv_rms)


def collapse_backward(grad_out, stream, kept, params):
    """Gradients of collapse for dx [..., d] -> (dX [..., n, d], dW, dgate, dbias)."""
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


@dataclass(frozen=True)
class Kernels:
    """The six kernels section 3 runs, passed to it as one object. EAGER: this file's functions;
    compiled/mhc_compiled.py builds the same six under torch.compile (compiled_kernels)."""

    mix_in: Callable
    mix_out: Callable
    mix_out_backward: Callable
    mix_in_backward: Callable
    collapse: Callable
    collapse_backward: Callable


EAGER = Kernels(mix_in, mix_out, mix_out_backward, mix_in_backward, collapse, collapse_backward)


# ---- 3. selective recomputation ------------------------------------------------------------------


class RecomputedBlock(torch.autograd.Function):
    """Run layers X_0 -> X_L keeping only X_0 [..., n, d], each F output f [..., d] and each
    layer's coefficients (mix_in's kept). Forward: the mixing without autograd (kernels: EAGER,
    or compiled ones); each F once, with grad, on a detached leaf input, so F's graph
    stays. Backward: rebuild X_1..X_{L-1} with the post-mix alone, then per layer: post-mix
    backward, F's kept graph (its .grad filled directly: use loss.backward()), mix_in's backward.
    head (the last block's HyperHead): return its collapse [..., d], rebuild X_L too."""

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
        ctx.layers, ctx.graph, ctx.head = layers, graph, head
        ctx.iters, ctx.kernels = iters, kernels
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
        coefficients = [
            kept[KEPT_PER_LAYER * i : KEPT_PER_LAYER * (i + 1)] for i in range(n_layers)
        ]
        states = [saved[0]]  # X_0; then the lane states rebuilt by the post-mix alone
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


class MixingParams(NamedTuple):
    """One layer's mixing parameters as tensors, named as HyperConnection names them, so that
    mhc_coefficients reads them as it reads the layer (n and dim from their shapes)."""

    proj: torch.Tensor
    gate: torch.Tensor
    bias_pre: torch.Tensor
    bias_post: torch.Tensor
    bias_res: torch.Tensor

    @property
    def n(self):
        return self.bias_pre.shape[-1]

    @property
    def dim(self):
        return self.proj.shape[0] // self.bias_pre.shape[-1]


def hc_params(hc):  # one layer's mixing parameters, in the order mix_in and its backward use
    return MixingParams(hc.proj, hc.gate, hc.bias_pre, hc.bias_post, hc.bias_res)


def head_params(head):  # the HyperHead's, in the order collapse and its backward use
    return (head.proj, head.gate, head.bias)


def run_recomputed_block(stream, layers, iters=20, kernels=EAGER, head=None):
    """[(sublayer, hc), ...] on X [..., n, d] by RecomputedBlock (-> [..., d] with a head)."""
    for _, hc in layers:
        hc.check_stream(stream)
    if not torch.is_grad_enabled():  # nothing to keep: a plain forward
        for sublayer, hc in layers:
            h, coefficients = kernels.mix_in(stream, hc_params(hc), iters)
            stream = kernels.mix_out(stream, coefficients, sublayer(h))
        return stream if head is None else kernels.collapse(stream, head_params(head))[0]
    if not stream.requires_grad:  # backward must still run, to fill the parameters' grads
        stream = stream.detach().requires_grad_()
    params = [p for _, hc in layers for p in hc_params(hc)]
    params += head_params(head) if head else ()
    return RecomputedBlock.apply(stream, list(layers), iters, kernels, head, *params)


def recompute_blocks(start, end, block):
    """Layers [start, end) of one stage in blocks of at most `block`: [(first, stop), ...]."""
    if block < 1:
        raise ValueError(f"recompute block L_r must be >= 1 layer, got {block}")
    return [(first, min(first + block, end)) for first in range(start, end, block)]


def default_recompute_block(n, n_layers):
    """L_r ~ sqrt(n L / (n + 2)) (mHC paper §4), at least 1: the block inputs kept cost n d L / L_r,
    rebuilding one block holds ~(n + 2) d L_r; their sum is smallest there."""
    return max(1, round(math.sqrt(n * n_layers / (n + 2))))


def run_recomputed_layers(stream, layers, block, iters=20, kernels=EAGER, head=None):
    """One stage's [(sublayer, hc), ...] in blocks of L_r = `block`, a head in the last one."""
    blocks = recompute_blocks(0, len(layers), block)
    for first, stop in blocks:
        last = head if stop == len(layers) else None
        stream = run_recomputed_block(stream, layers[first:stop], iters, kernels, last)
    return head(stream) if head is not None and not blocks else stream


# ---- 4. pipeline parallelism: 1F1B ---------------------------------------------------------------


def stage_layers(n_layers, n_stages, stage):
    """Layers [first, stop) held by `stage` of `n_stages`: an equal contiguous share."""
    if n_stages < 1 or n_stages > n_layers or n_layers % n_stages:
        raise ValueError(
            f"{n_stages} pipeline stages cannot split {n_layers} layers evenly: use "
            "a stage count that divides n_layers and is at most n_layers"
        )
    return stage * (n_layers // n_stages), (stage + 1) * (n_layers // n_stages)


def one_f_one_b(n_stages, stage, n_micro):
    """The order in which `stage` runs forwards and backwards: [('F', i) | ('B', i), ...].
    Warm-up: n_stages - stage - 1 forwards fill the pipe; the steady state alternates one forward
    and one backward; the cool-down drains the rest. A stage holds at most n_stages - stage
    micro-batches' activations (GPipe would hold all n_micro)."""
    if n_micro < n_stages:
        raise ValueError(
            f"1F1B needs at least as many micro-batches as stages: n_micro={n_micro}"
            f" < n_stages={n_stages}; raise n_micro or use fewer stages"
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
class PipelineStats:  # what one stage measured in one pipeline_step
    bytes_sent_forward: int = 0  # activations sent to the next stage
    bytes_sent_backward: int = 0  # gradients sent to the previous stage
    wait_s: float = 0.0  # blocked on receives: the bubble plus transfer that was not hidden


def pipeline_groups():
    """One group per direction over all ranks (see StageLinks), made once, on every rank."""
    return {way: launch.named_group(f"mhc pipeline {way}") for way in ("forward", "backward")}


def pipeline_rank(group=None):
    """-> (stage, stages): this rank's place in the pipeline, (rank, world) as everywhere else."""
    return (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)


def clock(device):
    """Host time after the device is idle: under NCCL Work.wait() does not block the host."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class StageLinks:
    """One stage's sends and receives of streams [batch/n_micro, T, (n,) d]. NCCL runs a rank pair's
    transfers in issue order and does not buffer sends, so activations and gradients each get a
    group, groups = {"forward": g, "backward": g} (group ranks = stages; default: the world): each
    link carries data one way in micro-batch order, and no issue order can deadlock."""

    def __init__(self, stage, world, n_micro, shape, like, overlap, groups=None):
        self.groups = groups or (pipeline_groups() if world > 1 else {})
        self.stage, self.n_micro, self.shape = stage, n_micro, shape
        self.like, self.overlap = like, overlap
        self.pending, self.sends, self.stats = {}, [], PipelineStats()
        if overlap and stage > 0:  # overlap: each receive posted one micro-batch ahead
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
        setattr(self.stats, field, getattr(self.stats, field) + tensor.nbytes)

    def finish(self):
        for work, _ in self.sends:
            work.wait()
        return self.stats


def pipeline_step(
    model, idx, targets, n_micro, variant="fused", block=None, overlap=True, groups=None
):
    """One training step's forward and backward over the pipeline stages. model: a PipelineModel;
    idx, targets [batch, T]: the same on every rank; variant, block: as its run_layers. A stage
    reads only its own layers (stage_layers), the embedding on the first stage and the head on the
    last; it fills their .grad for the batch's mean loss; -> (loss on the last stage else None,
    PipelineStats).
    overlap=False posts each receive only when needed. groups: StageLinks' (a device mesh's
    pipeline links)."""
    group = groups["forward"] if groups else None  # the pipeline's ranks (default: the world)
    stage, world = pipeline_rank(group)
    agree_pipeline_step(model, idx, targets, n_micro, variant, block, overlap, group)
    # hint: forward(i) and backward(i) each receive, compute, send; then run the phases in order
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
        out = model.run_layers(stream, first, stop, variant, block, final=last)
        if last:
            out = model.head_loss(out, tgt_micro[i]) / n_micro
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

    for _, i in order[:warmup]:  # warm-up: forwards fill the pipe
        forward(i)
    for kind, i in order[warmup : 2 * n_micro - warmup]:  # steady state: one F, one B
        forward(i) if kind == "F" else backward(i)
    for _, i in order[2 * n_micro - warmup :]:  # cool-down: the last backwards drain it
        backward(i)
    return (torch.stack(losses).sum() if last else None), links.finish()
    ### END SOLUTION


class PipelineModel(nn.Module):
    """What pipeline_step asks of a model: ``cfg`` (seq_len, n_layers, n_hc, dim), ``embed`` (an
    nn.Embedding: its weight gives the stream's dtype and device), ``hyper`` (n lanes, or one
    residual stream), and the four methods below. Transformer is one; compose.ComposeModel is
    another, with CSA/HCA/MoE sublayers."""

    hyper = True

    def stream_shape(self, batch):
        """What flows between layers and stages: [batch, T, n, d] ([batch, T, d]: residual)."""
        return (batch, self.cfg.seq_len, *((self.cfg.n_hc,) if self.hyper else ()), self.cfg.dim)

    def embed_stream(self, idx):
        """idx [batch, T] -> [batch, T, n, d], n stride-0 copies (a first block keeps d, not nd)."""
        x = self.embed(idx)  # (batch, T, d)
        return x.unsqueeze(-2).expand(*x.shape[:-1], self.cfg.n_hc, -1) if self.hyper else x

    def run_layers(self, stream, start, end, variant="naive", block=None, final=False):
        """Layers [start, end) of the stream as ``variant`` runs them; final (the last stage): end
        with the lanes collapsed -> [batch, T, d]."""
        raise NotImplementedError

    def head_loss(self, stream, targets):
        """The last stage's output -> the mean cross-entropy against targets."""
        raise NotImplementedError


# ---- appendix: the demo's model, validation and the agreement guard, then the demo ---------------


# ---- the small transformer -----------------------------------------------------------------------


class RMSNorm(nn.RMSNorm):  # torch's, with V4's eps
    def __init__(self, dim):
        super().__init__(dim, eps=EPS)


class Attention(nn.Module):  # F of an attention layer: causal self-attention, [batch, T, d] -> same
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.norm = cfg.n_heads, RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).unflatten(-1, (3, self.n_heads, -1)).unbind(-3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, nh, T, hs)
        y = scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(-2))


class MLP(nn.Module):  # F of an MLP layer: a 4x GELU MLP, [batch, T, d] -> same
    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down(gelu(self.up(self.norm(x))))


class Transformer(PipelineModel):
    """Pre-norm attention and MLP sublayers F, alternating. hyper: each an mHC layer, the lanes
    made once from the embedding and collapsed once by hyper_head, as V4; else x' = x + F(x).
    kernels: what the fused and optimised variants run (EAGER, or compiled/'s)."""

    def __init__(self, cfg, hyper=True, kernels=EAGER):
        super().__init__()
        self.cfg, self.hyper, self.kernels = cfg, hyper, kernels
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

    def run_layers(self, stream, start, end, variant="naive", block=None, final=False):
        """Layers [start, end) as one of VARIANTS: "naive" the plain autograd layer, "fused" each
        layer one RecomputedBlock, "optimised" blocks of `block` = L_r (default_recompute_block).
        final (the last stage): end with the lanes collapsed by hyper_head -> [batch, T, d]."""
        check_variant(variant, block)
        if not self.hyper:
            for sublayer in self.sublayers[start:end]:
                stream = stream + sublayer(stream)  # x' = x + F(x)
            return stream
        cfg, head = self.cfg, self.hyper_head if final else None
        layers = list(zip(self.sublayers[start:end], self.hcs[start:end]))
        if variant == "naive":
            for sublayer, hc in layers:
                stream = mhc_layer_reference(stream, sublayer, hc, cfg.sinkhorn_iters)
            return head(stream) if final else stream  # X' = B X + C F(A X), every layer
        block = 1 if variant == "fused" else block or default_recompute_block(cfg.n_hc, end - start)
        return run_recomputed_layers(stream, layers, block, cfg.sinkhorn_iters, self.kernels, head)

    def head_loss(self, stream, targets):
        """The HyperHead (unless run_layers(final=True) ran it), norm, LM head, cross-entropy."""
        x = self.hyper_head(stream) if self.hyper and stream.dim() == 4 else stream
        return cross_entropy(self.lm_head(self.norm(x)).flatten(0, -2), targets.flatten())

    def forward(self, idx, targets, variant="naive", block=None):
        x = self.run_layers(self.embed_stream(idx), 0, self.cfg.n_layers, variant, block, True)
        return self.head_loss(x, targets)


def check_config(cfg):
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
        raise ValueError(
            f"recompute block L_r must be an int >= 1 with variant 'optimised' (or "
            f"None), got block={block!r} with variant {variant!r}"
        )


def check_pipeline_inputs(model, idx, targets, n_micro, variant, block, group):
    (stage, world), cfg, device = pipeline_rank(group), model.cfg, model.embed.weight.device
    got = f"got {tuple(idx.shape)} {idx.dtype} and {tuple(targets.shape)} {targets.dtype}"
    if idx.shape != targets.shape or idx.dim() != 2 or idx.shape[1] != cfg.seq_len:
        raise ValueError(f"idx and targets must both be [batch, seq_len={cfg.seq_len}], {got}")
    if idx.dtype != torch.long or targets.dtype != torch.long:
        raise ValueError(f"idx and targets must be int64 token ids, {got}")
    if idx.device != device:
        raise ValueError(f"idx is on {idx.device} but the model on {device}")
    if not isinstance(n_micro, int) or n_micro < 1 or idx.shape[0] % n_micro:
        raise ValueError(
            f"batch {idx.shape[0]} does not split into n_micro={n_micro} equal micro-batches"
        )
    check_variant(variant, block)
    stage_layers(cfg.n_layers, world, stage)
    one_f_one_b(world, stage, n_micro)


def agree_pipeline_step(model, idx, targets, n_micro, variant, block, overlap, group):
    """This rank's validation on every step (local: shapes, dtypes), then
    launch.agree_when_changed: the stages compare when the model first runs on a group and
    whenever any stage's settings change: the config, the settings, the batch's digest and, the
    first time, the parameters' names, shapes and dtypes. Not their values: a stage reads only
    its own layers (and the embedding first, the head last), and what the others hold is not its
    business (a real pipeline never builds them). Other steps compare only a digest of the
    settings: one small all-reduce."""
    error = None
    try:
        check_pipeline_inputs(model, idx, targets, n_micro, variant, block, group)
    except ValueError as e:
        error = str(e)
    settings = {
        "config": asdict(model.cfg),
        "hyper": model.hyper,
        "parameter dtype": str(model.embed.weight.dtype),
        "idx shape": tuple(idx.shape),
        "targets shape": tuple(targets.shape),
        "token dtypes": (idx.dtype, targets.dtype),
        "n_micro": n_micro,
        "variant": variant,
        "block (L_r)": block,
        "overlap": bool(overlap),
    }

    def digests(first):  # the batch's sha256; the parameters' shapes too on the first step
        batch = launch.weights_digest([("i", idx), ("t", targets)])
        fields = {"batch (sha256 of idx, targets)": batch}
        if first:
            shapes = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}
            fields["parameters (digest of names, shapes, dtypes)"] = launch.fields_digest(shapes)
        return fields

    device = model.embed.weight.device
    launch.agree_when_changed(model, settings, device, error, group, costly=digests)


def saved_activation_bytes(model, run):
    """(run(), bytes of the distinct non-parameter storages autograd saves for backward in it)"""
    params, seen = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(size for ptr, size in seen.items() if ptr not in params)


def synthetic_batch(cfg, batch, generator, device):
    """Learnable toy data [batch, T + 1]: each row counts up from a random start, stride 1..3."""
    start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=generator)
    stride = torch.randint(1, 4, (batch, 1), generator=generator)
    return ((start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size).to(device)


def demo(args, rank, world, device):
    """Residual, naive and optimised mHC, one seed, each a 1F1B pipeline over the ranks."""
    cfg = Config(seq_len=args.seq_len, dim=args.dim, n_layers=args.layers, n_heads=args.heads)
    l_r, base = default_recompute_block(cfg.n_hc, cfg.n_layers // world), None
    launch.say(
        f"mHC demo: {cfg.n_layers} layers, d={cfg.dim}, n_hc={cfg.n_hc}, T={cfg.seq_len}, "
        f"{args.steps} steps, optimised = fused mixing + recomputation (L_r = {l_r})\n"
        f"pipeline: {world} stage(s), 1F1B over {args.micro} micro-batches of "
        f"{args.batch // args.micro}, receives posted ahead"
    )
    for name, block in (("residual", None), ("naive", None), ("optimised", l_r)):
        variant = "optimised" if block else "naive"
        torch.manual_seed(args.seed)
        model = Transformer(cfg, hyper=name != "residual").to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen, losses, waited = torch.Generator().manual_seed(args.seed), [], 0.0
        began = time.perf_counter()
        for _ in range(args.steps):
            data = synthetic_batch(cfg, args.batch, gen, device)
            idx, targets = data[:, :-1], data[:, 1:]
            loss, stats = pipeline_step(model, idx, targets, args.micro, variant, block)
            opt.step()
            opt.zero_grad(set_to_none=True)
            waited, losses = waited + stats.wait_s, losses + [loss]  # loss: on the last stage
        ms = 1e3 * (time.perf_counter() - began) / args.steps
        base = base or ms
        if rank == world - 1:
            row = (
                f"  {name:<9} loss {losses[0].item():.4f} -> {losses[-1].item():.4f} (last "
                f"stage), {ms:.0f} ms per step (x{ms / base:.2f})"
            )
            if world == 1:  # the whole model in this process: what autograd keeps for backward
                kept = saved_activation_bytes(model, lambda: model(idx, targets, variant, block))[1]
                row += f", {kept / 2**20:.2f} MiB saved for backward"
            else:
                row += (
                    f"\n  {name:<9} sent per step across each stage boundary: "
                    f"{stats.bytes_sent_backward / 2**20:.3f} MiB each way; the last stage "
                    f"waited on receives {1e3 * waited / args.steps:.1f} ms"
                )
            print(row, flush=True)
        dist.barrier()  # each row before what rank 0 prints next
    launch.say("\nmixing bytes: benchmarks/bench_mhc.py --accounting; blocking receives: table 2")


def parse_args(argv=None):
    world, count = int(os.environ.get("WORLD_SIZE", "1")), launch.at_least(1)
    parser = argparse.ArgumentParser(description="mHC: residual vs naive vs optimised, in 1F1B")
    add = parser.add_argument
    add("--dim", type=count, default=128, help="d, the width of one lane (128)")
    add("--layers", type=count, default=12, help="sublayers; a multiple of the ranks (12)")
    add("--heads", type=count, help="attention heads; must divide --dim (default dim // 32)")
    add("--seq-len", type=count, default=32, help="tokens per sequence, T (32)")
    add("--steps", type=count, default=6, help="training steps per run (6)")
    add("--batch", type=count, default=24, help="sequences per step, split into --micro (24)")
    add("--micro", type=count, help="pipeline micro-batches per step, >= ranks (default 2 x ranks)")
    add("--seed", type=int, default=0, help="seed of model and data (0)")
    args = launch.check_launch_options(parser, launch.add_launch_options(parser).parse_args(argv))
    args.heads, args.micro = args.heads or max(1, args.dim // 32), args.micro or 2 * world
    if args.dim % args.heads:
        parser.error(f"--heads {args.heads} must divide --dim {args.dim}")
    if args.layers % world or args.layers < world:
        parser.error(f"--layers {args.layers} must be a multiple of the {world} ranks (stages)")
    if args.micro < world:
        parser.error(f"--micro {args.micro} must be at least the {world} ranks (1F1B)")
    if args.batch % args.micro:
        parser.error(f"--batch {args.batch} must split into --micro {args.micro} equal parts")
    cfg = Config(seq_len=args.seq_len, dim=args.dim, n_layers=args.layers, n_heads=args.heads)
    weights = cfg.n_layers * cfg.dim**2 + 2 * cfg.vocab_size * cfg.dim  # a sublayer: d x d at least
    stream = args.batch // args.micro * cfg.seq_len * cfg.n_hc * cfg.dim  # one layer's input
    least = 4 * (weights + stream * cfg.n_layers // world) + 8 * args.batch * (cfg.seq_len + 1)
    launch.check_fits(parser, args, least, "--dim, --layers, --seq-len, --batch")
    return args


if __name__ == "__main__":
    launch.run(demo, parse_args())
