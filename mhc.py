"""mHC made affordable: manifold-constrained hyper-connections and three things that pay for them.

DeepSeek-V4 §3.4.2 (the layer: V4 §2.2; the mHC paper, arXiv 2512.24880, §4).

What the standard tool assumes. A transformer's residual stream is one vector of C numbers per
token: x' = x + F(x). Activation checkpointing keeps or drops whole modules, and a pipeline stage
hands its neighbour C numbers per token.

What V4's design violates. Hyper-connections widen the stream to n_hc = 4 lanes, X in R^{n x C},
mixed by three small per-token matrices computed from the stream itself:
    X' = B X + C F(A X),   A = sigmoid(.) in R^{1 x n},  C = 2 sigmoid(.) in R^{n x 1},
    B = Sinkhorn-Knopp(exp(.)) in R^{n x n}, doubly stochastic (the "manifold constraint").
Every layer's input is now n*C per token: n times the residual's activation memory, n times the
pipeline traffic, and the lane mixing is memory-bound elementwise work that a plain framework runs
as a string of separate ops, each reading and writing the whole widened stream.

The fix, three reductions (each a section below, each checked against the plain autograd layer):
  1. fused lane mixing: the pre-mix A X, the post-mix + residual merge B X + C f, the
     coefficient projection (RMS division moved after the matmul) and Sinkhorn each as one
     operation with its backward written out, reading the lanes once and writing them once;
  2. selective recomputation: keep one block input (n*C) every L_r layers, every F output (C) and
     each layer's coefficients (49 numbers per token); in backward rebuild the lane states with
     the post-mix alone; never run F twice. The last block folds in the head's lane collapse, so
     the final stream is rebuilt, not kept. Section 3b compiles the same functions (torch.compile);
  3. a 1F1B pipeline whose stages exchange the n-lane stream with receives posted ahead, so the
     extra traffic hides behind compute (V4's DualPipe adjustment, here on a plain 1F1B).

Fidelity: for the same weights this file computes what the public V4 code computes (Hugging Face
transformers' DeepseekV4HyperConnection and DeepseekV4HyperHead; `from_v4_state_dict` loads their
weights and tests/test_mhc_v4_oracle.py compares the two): Sinkhorn's axis order and its eps,
A = sigmoid(.) + 1e-6, coefficients and pre-mix in fp32, a learned lane collapse before the head.
Only the mHC parts are V4's: F here is a small attention/MLP, not V4's attention and MoE.

Run it:
    python mhc.py                              # one process: residual vs naive vs optimised mHC
    torchrun --nproc_per_node=2 mhc.py         # CPU, gloo: the same model over 2 pipeline stages
    torchrun --nproc_per_node=4 mhc.py         # 4 stages; on GPUs NCCL is picked automatically
    python mhc.py --help                       # every option
"""

import argparse
import datetime
import gc
import hashlib
import math
import os
import time
import weakref
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

EPS = 1e-6  # V4's hc_eps and rms_norm_eps: in the norm, in A, and in every Sinkhorn sum


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

    B acts as X' = B X. Round 1's column step is a softmax down each column (exp without overflow);
    then every round normalises rows, and rounds 2..iters normalise columns first. Ending on rows
    makes each output lane a convex combination of input lanes (to eps); columns converge
    geometrically. This is V4's public code in B's layout: it keeps comb = B^T and applies comb^T X,
    so its softmax over comb's rows is our softmax down B's columns. eps (after the softmax and in
    every sum) keeps a column that underflows to 0 from dividing 0 by 0 (logits of +-60 do that).
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


class HyperConnection(nn.Module):
    """One layer's parameters of A [..., n], B [..., n, n], C [..., n], made from X [..., n, C].

    One projection of width n + n + n^2 from the RMS-normalised flattened stream (no norm weight:
    it would only rescale the projection, V4 has none either), static biases S plus gated dynamic
    terms alpha * (x W). Layout: proj columns [W_pre | W_post | W_res], W_res row-major in B's
    layout (V4 stores comb = B^T: see from_v4_state_dict).
    """

    def __init__(self, n, dim, gate_init=0.01):
        super().__init__()
        if n < 1 or dim < 1:
            raise ValueError(
                f"HyperConnection needs n >= 1 lanes and dim >= 1, got n={n}, dim={dim}"
            )
        self.n, self.dim = n, dim
        width = 2 * n + n * n
        self.proj = nn.Parameter(torch.randn(n * dim, width) * (n * dim) ** -0.5)
        self.gate = nn.Parameter(torch.full((3,), float(gate_init)))  # alpha_pre, _post, _res
        # sigmoid(bias_pre) = 1/n: A X starts as the lanes' mean (V4's HF init is 0: 1/2 each)
        self.bias_pre = nn.Parameter(torch.full((n,), -math.log(n - 1) if n > 1 else 0.0))
        self.bias_post = nn.Parameter(torch.zeros(n))  # C = 2 sigmoid(0) = 1: F reaches every lane
        self.bias_res = nn.Parameter(3.0 * torch.eye(n))  # B starts near the identity

    def check_stream(self, stream):
        if stream.dim() < 2 or stream.shape[-2] != self.n or stream.shape[-1] != self.dim:
            raise ValueError(
                f"mHC stream must have shape [..., n_hc={self.n}, dim={self.dim}], got "
                f"{tuple(stream.shape)}: expand the embedding into n_hc lanes once "
                f"(Transformer.embed_stream) and keep that shape between layers"
            )


def mhc_coefficients(stream, hc, iters=20, optimised=False):
    """stream [..., n, C] -> (A [..., n], B [..., n, n], C [..., n]), in mixing_dtype.

    optimised=True uses NormThenProject (the RMS division after the projection) and SinkhornReplay
    (backward replays the iterations instead of storing 2*iters n x n intermediates per token).
    """
    n = hc.n
    # hint: x_hat = RMSNorm(vec(X)); one projection; split n, n, n*n; A gets + EPS (as V4)
    ### BEGIN SOLUTION
    dtype = mixing_dtype(stream.dtype)
    flat = stream.flatten(-2).to(dtype)  # [..., nC]
    proj, gate = hc.proj.to(dtype), hc.gate.to(dtype)
    if optimised:
        logits = NormThenProject.apply(flat, proj)
    else:
        logits = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS)) @ proj
    pre, post, res = logits.split([n, n, n * n], dim=-1)
    a = torch.sigmoid(gate[0] * pre + hc.bias_pre.to(dtype)) + EPS  # + eps: as V4, A never 0
    c = 2 * torch.sigmoid(gate[1] * post + hc.bias_post.to(dtype))
    res_logits = gate[2] * res.unflatten(-1, (n, n)) + hc.bias_res.to(dtype)
    b = SinkhornReplay.apply(res_logits, iters) if optimised else sinkhorn_knopp(res_logits, iters)
    return a, b, c
    ### END SOLUTION


def mhc_layer_reference(stream, sublayer, hc, iters=20):
    """The plain autograd mHC layer: X [..., n, C] -> B X + C F(A X)  [..., n, C].

    Pre-mix in fp32, post-mix in the stream's dtype with B and C cast to it: V4 does exactly this
    (the n-lane stream stays in the model dtype). Every optimised path is tested against this.
    """
    hc.check_stream(stream)
    a, b, c = mhc_coefficients(stream, hc, iters)
    h = torch.einsum("...n,...nc->...c", a, stream.to(a.dtype)).to(stream.dtype)
    f = sublayer(h)
    b, c = b.to(stream.dtype), c.to(stream.dtype)
    return torch.einsum("...ij,...jc->...ic", b, stream) + c.unsqueeze(-1) * f.unsqueeze(-2)


class HyperHead(nn.Module):
    """The lanes' one collapse before the final norm and head: [..., n, C] -> [..., C] (V4's
    HyperHead). Weights w = sigmoid(alpha x_hat W + S) + eps, output sum_i w_i X_i. Initialised
    with S = -log(n-1) and alpha small, it starts as the mean of the lanes (exactly so at alpha=0).
    """

    def __init__(self, n, dim, gate_init=0.01):
        super().__init__()
        self.n, self.dim = n, dim
        self.proj = nn.Parameter(torch.randn(n * dim, n) * (n * dim) ** -0.5)
        self.gate = nn.Parameter(torch.full((1,), float(gate_init)))
        self.bias = nn.Parameter(torch.full((n,), -math.log(n - 1) if n > 1 else 0.0))

    def forward(self, stream, fused=False):
        dtype = mixing_dtype(stream.dtype)
        if fused:  # section 2: no normalised stream written or kept, backward written out
            return FusedCollapse.apply(stream, *head_params(self))
        flat = stream.flatten(-2).to(dtype)  # [..., nC]
        x_hat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS)
        logits = x_hat @ self.proj.to(dtype)  # [..., n]
        weights = torch.sigmoid(logits * self.gate.to(dtype) + self.bias.to(dtype)) + EPS
        return (weights.unsqueeze(-1) * stream.to(dtype)).sum(-2).to(stream.dtype)


# ---- 2. fused lane mixing ------------------------------------------------------------------------
#
# Each operation as one pure forward and one pure backward function: what one kernel reads, computes
# and writes, with no autograd inside. The autograd.Functions wrap them for the fused layer; the
# recomputed block (section 3) calls the backward functions itself, and section 3b hands the very
# same functions to torch.compile.


def norm_then_project(x, weight):
    """RMSNorm(x) W as (x W) * r, r = 1/rms(x): x [..., D], W [D, k] -> (x W [..., k], r [..., 1]).

    The division moves after the matmul (mHC paper §4), so the normalised stream (D = n*C per
    token) is never written: one pass over x for the projection, one for its sum of squares.
    """
    return x @ weight, torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def norm_then_project_backward(grad, x, weight, projected, inv_rms):
    """Gradients of y = (x W) * r for dy [..., k] -> (dx [..., D], dW [D, k]).

    dx = (dy r) W^T - (sum(dy * xW) r^3 / D) x: two passes over x, nothing n*C-sized kept.
    """
    scaled = grad * inv_rms  # [..., k]
    # (dy r)^T x, transposed: MKL runs this skinny product ~30% faster than x^T (dy r)
    grad_weight = (scaled.reshape(-1, scaled.shape[-1]).T @ x.reshape(-1, x.shape[-1])).T
    through_rms = (grad * projected).sum(-1, keepdim=True) * inv_rms.pow(3) / x.shape[-1]
    return torch.addcmul(scaled @ weight.T, through_rms, x, value=-1), grad_weight


def lane_sum(m, dim):
    """m.sum(dim, keepdim=True) over a lane axis of n = 4. Under torch.compile as n - 1 adds:
    elementwise work Inductor fuses into the loop around it, where a sum is a loop of its own."""
    if not torch.compiler.is_compiling():
        return m.sum(dim, keepdim=True)
    parts = m.unbind(dim)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total.unsqueeze(dim)


def tokens_last(m):
    """[..., n, n] -> [n, n, ...] under torch.compile (a view), else unchanged; -> (m, rows, cols).

    Sinkhorn's 40 steps each touch 16 numbers per token. Tokens on the last axis let Inductor
    vectorise every step across tokens; with the 4 x 4 matrix last, each step is a loop of
    4-wide partial vectors (measured at T = 256: forward 0.24 -> 0.12 ms, backward 0.50 -> 0.25).
    """
    if not torch.compiler.is_compiling():
        return m, -2, -1
    return m.movedim((-2, -1), (0, 1)), 0, 1


def sinkhorn_fused(logits, iters=20, eps=EPS):
    """sinkhorn_knopp for the kernels: the same steps, laid out by tokens_last. [..., n, n]."""
    m, rows, cols = tokens_last(logits)
    m = torch.softmax(m, dim=rows) + eps
    for dim in [cols] + [rows, cols] * (iters - 1):
        m = m / (lane_sum(m, dim) + eps)
    # back to [..., n, n] in memory too: the post-mix reads B per token (with B tokens-last,
    # Inductor loops lanes outermost and reads the stream n times: 1.18 vs 0.58 ms at C = 1024)
    return m if rows == -2 else m.movedim((0, 1), (-2, -1)).contiguous()


def sinkhorn_backward(logits, grad, iters=20, eps=EPS):
    """d loss / d logits of sinkhorn_knopp(logits, iters), given grad = d loss / d B. [..., n, n].

    Replays the 2*iters normalisations (n x n per token: tiny) and walks them backwards. For one
    step Y = M / s, s = sum(M) + eps along one axis: dM = (dY - sum(dY * Y)) / s along that axis.
    Plain autograd would instead keep every intermediate: ~2*iters*(n^2 + n) floats per token.
    """
    (logits, rows, cols), (grad, _, _) = tokens_last(logits), tokens_last(grad)
    soft = torch.softmax(logits, dim=rows)
    matrix, steps = soft + eps, []
    for dim in [cols] + [rows, cols] * (iters - 1):  # sinkhorn_knopp's order: rows, cols, rows...
        sums = lane_sum(matrix, dim) + eps
        matrix = matrix / sums
        steps.append((matrix, sums, dim))
    for matrix, sums, dim in reversed(steps):
        grad = (grad - lane_sum(grad * matrix, dim)) / sums
    grad = soft * (grad - lane_sum(grad * soft, rows))  # softmax down each column
    return grad if rows == -2 else grad.movedim((0, 1), (-2, -1))


def lanes_matmul(m, x):
    """m [..., p, q] @ x [..., q, r] -> [..., p, r] for the small per-token matrices of the mixing.

    Eagerly a batched matmul. Under torch.compile a broadcast product summed over q instead: that
    is a loop Inductor fuses with the elementwise work around it, where a bmm stays an external
    call that writes its output to memory and reads it back (post-mix forward + backward compiled:
    ~1.5x faster this way; eagerly the broadcast form would write a p*q*r temporary per token).
    A long sum (q = C, as in dB = dX' X^T) is written as p * r dot products over the contiguous
    last axis: Inductor runs them as one loop with p * r accumulators, where a [p, r, q] product
    summed gives p * r loops of one dependent chain each (dB + dC + df at C = 1024, caches cold:
    2.1 vs 2.5 ms).
    """
    if not torch.compiler.is_compiling():
        return m @ x
    if m.shape[-1] > x.shape[-1]:  # a long sum (p, r <= n): dot products over the last axis
        rows, cols = m.unbind(-2), x.unbind(-1)
        return torch.stack([torch.stack([(r * c).sum(-1) for c in cols], -1) for r in rows], -2)
    return (m.unsqueeze(-1) * x.unsqueeze(-3)).sum(-2)


def pre_mix(a, stream):
    """h = A X: A [..., n], X [..., n, C] -> [..., C]. Reads X once, writes C."""
    return lanes_matmul(a.unsqueeze(-2), stream).squeeze(-2)


def pre_mix_backward(grad_h, a, stream):
    """-> (dA [..., n] = <X_i, dh>, dX [..., n, C] = A_i dh)."""
    return (stream * grad_h.unsqueeze(-2)).sum(-1), a.unsqueeze(-1) * grad_h.unsqueeze(-2)


def post_mix(b, stream, c, f):
    """X' = B X + C f: B [..., n, n], X [..., n, C], C [..., n], f [..., C] -> X' [..., n, C].

    One output buffer, no B X or C f temporaries: reads (n+1)C and writes nC per token instead of
    (3n+1)C and 3nC (mHC paper §4). Eager CPU still takes two passes over the output (matmul, then
    an in-place addcmul); torch.compile or a hand kernel makes it one.
    """
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


class NormThenProject(torch.autograd.Function):
    """norm_then_project as one autograd op: x [..., D], W [D, k] -> (x W) * r  [..., k].

    Saved: x (the layer's stream, alive anyway), W, r and x W; never the normalised stream.
    """

    @staticmethod
    def forward(ctx, x, weight):
        projected, inv_rms = norm_then_project(x, weight)
        ctx.save_for_backward(x, weight, projected, inv_rms)
        return projected * inv_rms

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, projected, inv_rms = ctx.saved_tensors
        return norm_then_project_backward(grad_out, x, weight, projected, inv_rms)


class SinkhornReplay(torch.autograd.Function):
    """sinkhorn_knopp saving only its logits [..., n, n]; backward is sinkhorn_backward."""

    @staticmethod
    def forward(ctx, logits, iters):
        ctx.iters = iters
        ctx.save_for_backward(logits)
        return sinkhorn_knopp(logits, iters)

    @staticmethod
    def backward(ctx, grad_out):
        (logits,) = ctx.saved_tensors
        return sinkhorn_backward(logits, grad_out, ctx.iters), None


class FusedPreMix(torch.autograd.Function):
    """pre_mix as one autograd op; saves A and X (the layer's input stream, alive anyway)."""

    @staticmethod
    def forward(ctx, a, stream):
        ctx.save_for_backward(a, stream)
        return pre_mix(a, stream)

    @staticmethod
    def backward(ctx, grad_h):
        return pre_mix_backward(grad_h, *ctx.saved_tensors)


class FusedPostMixMerge(torch.autograd.Function):
    """post_mix as one autograd op. Saves B, X, C, f: X is the layer input and f the sublayer
    output, both alive anyway."""

    @staticmethod
    def forward(ctx, b, stream, c, f):
        ctx.save_for_backward(b, stream, c, f)
        return post_mix(b, stream, c, f)

    @staticmethod
    def backward(ctx, grad_out):
        return post_mix_backward(grad_out, *ctx.saved_tensors)


def collapse(stream, params):
    """HyperHead's collapse, forward only: X [..., n, C] -> (x = sum_i w_i X_i [..., C], kept).

    w = sigmoid(gate * RMSNorm(vec X) W + bias) + eps, by norm_then_project and pre_mix in the
    mixing dtype; params = (W, gate, bias) as head_params gives them. kept = (w [..., n],
    x W [..., n], 1/rms [..., 1]): the plain head also keeps the normalised stream, n*C per token.
    """
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


class FusedCollapse(torch.autograd.Function):
    """collapse as one autograd op: X [..., n, C], W, gate, bias -> [..., C]. Saves X (the last
    layer's output, which backward needs anyway) and collapse's kept w, x W and 1/rms."""

    @staticmethod
    def forward(ctx, stream, *params):
        x, kept = collapse(stream, params)
        ctx.save_for_backward(stream, *params, *kept)
        return x

    @staticmethod
    def backward(ctx, grad_out):
        stream, proj, gate, bias, *kept = ctx.saved_tensors
        return collapse_backward(grad_out, stream, kept, (proj, gate, bias))


def pre_mix_fused(a, stream):
    """A X in A's (mixing) dtype, returned in the stream's dtype. -> [..., C]"""
    return FusedPreMix.apply(a, stream.to(a.dtype)).to(stream.dtype)


def post_mix_fused(b, stream, c, f):
    """B X + C f in the stream's dtype (B, C cast to it, as V4). -> [..., n, C]"""
    return FusedPostMixMerge.apply(b.to(stream.dtype), stream, c.to(stream.dtype), f)


def mhc_layer_fused(stream, sublayer, hc, iters=20):
    """mhc_layer_reference with the fused mixing ops. X [..., n, C] -> [..., n, C]."""
    hc.check_stream(stream)
    a, b, c = mhc_coefficients(stream, hc, iters, optimised=True)
    return post_mix_fused(b, stream, c, sublayer(pre_mix_fused(a, stream)))


# ---- 3. selective recomputation ------------------------------------------------------------------


def default_recompute_block(n, n_layers):
    """L_r ~ sqrt(n L / (n + 2)) (mHC paper §4), at least 1.

    Keeping one block input (nC) per block costs nC L / L_r; rebuilding one block in backward holds
    about (n + 2) C per layer of it (the n-lane state plus F's input and output): the sum is
    smallest at L_r = sqrt(n L / (n + 2)). (RecomputedBlock keeps F's input and output anyway, so
    its rebuild holds only the n C lane states and its own optimum is sqrt(L): 2 at L = 4 either
    way, one layer more per block at L = 8 or 16. The paper's rule is kept.)
    """
    return max(1, round(math.sqrt(n * n_layers / (n + 2))))


def recompute_blocks(start, end, block):
    """Split the layers [start, end) of one stage into consecutive blocks of at most `block`.

    Returns [(first, stop), ...]. Blocks are cut inside the stage's range, so none crosses a stage
    boundary: a block's input must live on the stage that replays it.
    """
    if block < 1:
        raise ValueError(f"recompute block L_r must be >= 1 layer, got {block}")
    return [(first, min(first + block, end)) for first in range(start, end, block)]


def hc_params(hc):
    """One layer's mixing parameters, in the order mix_in and mix_in_backward take and return."""
    return (hc.proj, hc.gate, hc.bias_pre, hc.bias_post, hc.bias_res)


def head_params(head):
    """The HyperHead's parameters, in the order collapse and collapse_backward take and return."""
    return (head.proj, head.gate, head.bias)


def mix_in(stream, params, iters):
    """One layer's coefficients and pre-mix, forward only: X [..., n, C] -> (h = A X, kept).

    kept = (A [..., n], B [..., n, n], C [..., n], x W [..., 2n + n^2], 1/rms [..., 1]): 2n^2 + 4n
    + 1 numbers per token (49 at n = 4), everything backward needs besides X itself. The math and
    dtypes of mhc_coefficients + the pre-mix: coefficients and A X in fp32, h in X's dtype.
    """
    proj, gate, bias_pre, bias_post, bias_res = (p.to(mixing_dtype(stream.dtype)) for p in params)
    n, x = stream.shape[-2], stream.to(proj.dtype)
    projected, inv_rms = norm_then_project(x.flatten(-2), proj)
    pre, post, res = (projected * inv_rms).split([n, n, n * n], dim=-1)
    a = torch.sigmoid(gate[0] * pre + bias_pre) + EPS
    c = 2 * torch.sigmoid(gate[1] * post + bias_post)
    b = sinkhorn_fused(gate[2] * res.unflatten(-1, (n, n)) + bias_res, iters)
    return pre_mix(a, x).to(stream.dtype), (a, b, c, projected, inv_rms)


def mix_out(stream, kept, f):
    """Post-mix + merge in X's dtype (B, C cast to it, as V4): X [..., n, C], f [..., C] -> X'."""
    _, b, c, _, _ = kept
    return post_mix(b.to(stream.dtype), stream, c.to(stream.dtype), f)


def mix_out_backward(grad_out, stream, kept, f):
    """Backward of mix_out into B, C and f: dX' [..., n, C] -> (dB, dC, df), dB and dC in the
    mixing dtype. dX = B^T dX' is left to mix_in_backward, which writes dX in one pass."""
    _, b, c, _, _ = kept
    grad_b = lanes_matmul(grad_out, stream.transpose(-1, -2))  # as post_mix_backward
    grad_c = lanes_matmul(grad_out, f.unsqueeze(-1)).squeeze(-1)
    grad_f = lanes_matmul(c.to(stream.dtype).unsqueeze(-2), grad_out).squeeze(-2)
    return grad_b.to(b.dtype), grad_c.to(c.dtype), grad_f


def mix_in_backward(grad_h, grad_b, grad_c, grad_out, stream, kept, params, iters):
    """Backward of mix_in, plus the post-mix's B^T dX': -> (dX [..., n, C], grads of params).

    Pre-mix, then the gates (A = sigmoid(.) + eps, C = 2 sigmoid(.), B = Sinkhorn of its logits,
    replayed by sinkhorn_backward), then the projection with its norm. Every n*C-sized tensor read
    here is X or a gradient: nothing of the forward's lane mixing was stored.
    """
    a, b, c, projected, inv_rms = kept
    proj, gate, _, _, bias_res = (p.to(a.dtype) for p in params)
    n, x = stream.shape[-2], stream.to(a.dtype)
    grad_a, grad_x = pre_mix_backward(grad_h.to(a.dtype), a, x)
    pre, post, res = (projected * inv_rms).split([n, n, n * n], dim=-1)
    res = res.unflatten(-1, (n, n))
    grad_pre = grad_a * (a - EPS) * (1 - (a - EPS))  # sigmoid' = s (1 - s)
    grad_post = grad_c * c * (1 - c / 2)  # (2 sigmoid)' = 2 s (1 - s) = C (1 - C/2)
    grad_res = sinkhorn_backward(gate[2] * res + bias_res, grad_b, iters)
    grad_logits = torch.cat(
        [grad_pre * gate[0], grad_post * gate[1], (grad_res * gate[2]).flatten(-2)], dim=-1
    )
    grad_flat, grad_proj = norm_then_project_backward(
        grad_logits, x.flatten(-2), proj, projected, inv_rms
    )
    through_post_mix = lanes_matmul(b.to(stream.dtype).transpose(-1, -2), grad_out)
    grad_x = grad_x + grad_flat.unflatten(-1, (n, -1)) + through_post_mix
    tokens = tuple(range(a.dim() - 1))
    grad_gate = torch.stack(
        [(g * v).sum() for g, v in ((grad_pre, pre), (grad_post, post), (grad_res, res))]
    )
    grads = grad_proj, grad_gate, *(g.sum(tokens) for g in (grad_pre, grad_post, grad_res))
    return grad_x.to(stream.dtype), tuple(g.to(p.dtype) for g, p in zip(grads, params))


class MixingKernels:
    """The four functions a recomputed block calls per layer, and the head's two: eager, or each
    wrapped by `wrap` (section 3b: torch.compile, which fuses each into a few loops)."""

    def __init__(self, wrap=None):
        wrap = wrap or (lambda fn: fn)
        self.mix_in, self.mix_out = wrap(mix_in), wrap(mix_out)
        self.mix_out_backward, self.mix_in_backward = wrap(mix_out_backward), wrap(mix_in_backward)
        self.collapse, self.collapse_backward = wrap(collapse), wrap(collapse_backward)


EAGER_KERNELS = MixingKernels()


class RecomputedBlock(torch.autograd.Function):
    """Run layers X_0 -> X_L keeping X_0 [..., n, C], each F output f_l [..., C] and each layer's
    coefficients (mix_in's `kept`, 49 numbers per token at n = 4) only.

    Forward: lane mixing without autograd (kernels.mix_in, kernels.mix_out); each F runs once with
    grad enabled on a detached leaf input, so F's own graph and saved activations stay. Backward:
    rebuild X_1..X_{L-1} from X_0 with the post-mix alone (the kept B, C and f: no projection, no
    Sinkhorn, no F), then walk the layers backwards: post-mix backward -> F's kept graph (its
    parameter grads and dF/dh) -> pre-mix, Sinkhorn and coefficient backward. The HC parameters are
    inputs, so autograd hands them their gradients; F's parameter gradients accumulate into .grad
    directly, like reentrant checkpointing: use loss.backward(), not torch.autograd.grad.

    head (the model's HyperHead, for the last block only): the block returns the collapsed
    x [..., C] and keeps the head's w, x W and 1/rms; backward rebuilds X_L as well and starts from
    collapse_backward. The final n-lane stream, which the head would otherwise keep, is not kept.
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
        if head is not None:  # the head's collapse, folded in: X_L is rebuilt in backward
            stream, head_kept = kernels.collapse(stream, head_params(head))
            kept.extend(head_kept)
        # The F outputs also go through save_for_backward (detached views of the same storage) so
        # saved-tensor hooks, and the memory profilers built on them, see everything kept.
        ctx.save_for_backward(stream_in, *[f.detach() for _, f in graph], *kept)
        ctx.layers, ctx.graph, ctx.iters, ctx.kernels = layers, graph, iters, kernels
        ctx.head = head
        return stream

    @staticmethod
    def backward(ctx, grad_stream):
        # hint: rebuild the lane states with kernels.mix_out (X_L too if ctx.head: start from
        # kernels.collapse_backward), then per layer, last first: mix_out_backward, F's kept graph
        # (torch.autograd.backward), mix_in_backward
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
            grad_b, grad_c, grad_f = kernels.mix_out_backward(
                grad_stream, stream, coefficients[i], fs[i]
            )
            torch.autograd.backward(f, grad_f)  # F's kept graph: fills h.grad and F's .grad
            grad_stream, grad_params = kernels.mix_in_backward(
                h.grad,
                grad_b,
                grad_c,
                grad_stream,
                stream,
                coefficients[i],
                hc_params(hc),
                ctx.iters,
            )
            grads = [*grad_params, *grads]
        ctx.layers = ctx.graph = ctx.head = None
        return grad_stream, None, None, None, None, *grads, *head_grads
        ### END SOLUTION


def run_recomputed_block(stream, layers, iters=20, kernels=None, head=None):
    """Apply [(sublayer, hc), ...] to [..., n, C] keeping only the block input, the F outputs and
    the coefficients. kernels: EAGER_KERNELS by default; section 3b passes compiled ones.
    head: a HyperHead to fold in (the last block): returns its collapse [..., C], not the stream."""
    kernels = kernels or EAGER_KERNELS
    for _, hc in layers:
        hc.check_stream(stream)
    if not torch.is_grad_enabled():  # nothing to save: a plain forward
        for sublayer, hc in layers:
            h, coefficients = kernels.mix_in(stream, hc_params(hc), iters)
            stream = kernels.mix_out(stream, coefficients, sublayer(h))
        return stream if head is None else kernels.collapse(stream, head_params(head))[0]
    if not stream.requires_grad:  # backward must still run, to fill the parameters' grads
        stream = stream.detach().requires_grad_()
    params = [p for _, hc in layers for p in hc_params(hc)]
    params += head_params(head) if head is not None else []
    return RecomputedBlock.apply(stream, list(layers), iters, kernels, head, *params)


def run_recomputed_layers(stream, layers, block, iters=20, kernels=None, head=None):
    """One stage's [(sublayer, hc), ...] in recompute blocks of at most `block` layers (L_r).
    head: the HyperHead, folded into the last block (-> [..., C]); no layers: collapsed here."""
    blocks = recompute_blocks(0, len(layers), block)
    for first, stop in blocks:
        last = head if stop == len(layers) else None
        stream = run_recomputed_block(stream, layers[first:stop], iters, kernels, last)
    return head(stream, fused=True) if head is not None and not blocks else stream


# ---- 3b. the compiled path (torch.compile) -------------------------------------------------------
#
# Run eagerly, the mixing functions above are still a string of separate ops plus Python dispatch.
# Here the same functions go to torch.compile (Inductor: C++ loops on CPUs, Triton kernels on GPUs),
# which fuses each into a few loops over the lanes. What is compiled, and why:
#   - the four MixingKernels functions, each one region: mix_in (projection, norm, gates, Sinkhorn,
#     pre-mix), mix_out (post-mix + merge), mix_out_backward, mix_in_backward. They are pure
#     functions with their backward written out, so every region is an inference graph: no
#     autograd inside, nothing saved, nothing for AOTAutograd to partition, and Sinkhorn's replay
#     and backward fuse into the same loops as the gates around them. The HC parameters are
#     arguments, so one graph serves every layer of a shape.
#   - F on its own (torch.compile of each sublayer), run once per layer per step; the residual
#     model compiles x + F(x) per layer, so F is compiled in every variant alike.
#   - not an autograd.Function with a hand-written backward: dynamo traces its forward but its
#     backward (SinkhornReplay's autograd.grad in an earlier version) broke the graph.
#   - not a whole layer or a whole recompute block: F would sit inside the region, and one graph
#     cannot keep F's autograd graph while running the mixing without one. Compiling a whole plain
#     layer is the naive variant below: its partitioner chooses what to keep and recomputes only
#     cheap elementwise work, so it keeps far more than one block input per L_r layers.
# The block's bookkeeping (keep X_0, each f and the coefficients, rebuild the lane states, walk the
# layers backwards) stays in Python: RecomputedBlock, a few calls per layer.
#
# What it buys, measured (`python benchmarks/bench_mhc.py --curve`: 4 layers, T = 128, batch 2,
# 1 thread, forward + backward, overhead over the residual of the same mode, median of 21
# interleaved rounds, glibc malloc told to keep what it frees; two runs on a shared 2-core
# machine, the first is benchmarks/curve_cpu.json):
#     C                     256            512            1024           2048
#     naive, compiled      +55% / +56%    +31% / +32%    +13% / +20%    +5.6% / +7.0%
#     optimised, compiled  +41% / +44%    +29% / +27%    +13% / +17%    +7.7% / +2.2%
#     naive, eager        +137% / +140%   +70% / +75%    +34% / +34%    +19% / +12%
#     optimised, eager    +117% / +118%   +58% / +55%    +23% / +25%    +7.7% / +2.6%
#     A/A control, comp.   -2.7% / -2.6%  -0.4% / +0.0%  -1.2% / -1.7%  -0.9% / -3.6%
# The A/A control is a second residual model timed alongside: the resolution within a run. From
# run to run the overheads at C >= 1024 move by more (compiled optimised 9.2-19% at C = 1024 over
# nine runs, naive 13-22%), and the kernels' own time with them: the machine is shared. Over the
# nine the optimised path is ahead of naive at C = 256 and 512 every time and at 1024 in seven;
# at C = 2048 the step times cannot order them. Its kernels, timed inside the model, are
# steadier: 36-52 ms per step at C = 1024, 62-79 ms at C = 2048. It keeps a quarter of naive's
# extra activations.
# An earlier version compiled the plain autograd math of two regions per layer and replayed the
# whole coefficient region (20 Sinkhorn rounds included) under autograd in backward: +80% / +24%
# at C = 256 / 1024, slower than naive everywhere. Keeping the 49 coefficients per token and
# writing the backward out removed the replay. V4's 6.7% is not reached at C = 1024 on this CPU.
# Where the kernels' time goes (bench_mhc.STUBS, stand-ins timed in the model in their place;
# C = 1024, the two runs): the kernels 44 / 38 ms per step; the same kernels without the gates and
# Sinkhorn 46 / 37 ms: fused, the coefficient math is nearly free and the time is the passes over
# the stream; stubs that only move the least bytes (116 MiB read, 57 written per step) 21 / 22 ms,
# 5.7 / 6.5% of the residual's step. So kernels at the floor would only just meet V4's 6.7% here,
# and these take about twice the floor: each projection matmul goes to the BLAS library (a compiled
# region on CPUs leaves it there: Inductor's CPU GEMM template, which fuses work around a matmul,
# takes constant weights only), a pass of its own over X, with the passes around it. At C = 2048:
# kernels 79 / 69 ms, without the coefficient math 86 / 71, floor stubs 39 / 34 (2.8 / 2.5%).
# Measured and dropped: one call for mix_out + the next mix_in and for mix_in_backward + the next
# mix_out_backward (13 calls per step, not 22: under 1 ms), token tiles unrolled inside the
# compiled functions (slower, and 50-105 s to compile).
#
# Settings: dynamic=False, one graph per shape (no symbolic sizes: a shape change compiles again);
# dynamo's recompile limit is raised from 8 to 64 (every C, grad mode and F type is one more graph
# of the same code), and reaching it raises instead of falling back silently to eager.


def _residual_layer(x, sublayer):
    """x + F(x), the baseline layer."""
    return x + sublayer(x)


_COMPILED = {}


def compiled(fn, backend="inductor"):
    """torch.compile(fn) made once per function and backend (graphs cached per shape, grad mode)."""
    if (fn, backend) not in _COMPILED:
        _COMPILED[fn, backend] = torch.compile(fn, backend=backend, dynamic=False)
    return _COMPILED[fn, backend]


def compiled_kernels(backend="inductor"):
    """MixingKernels whose four functions are compiled (one cache per backend)."""
    return MixingKernels(lambda fn: compiled(fn, backend))


class CompiledModel:
    """model(idx, targets) with its layers compiled: the same parameters and the same math.

    variant  'optimised' (mHC model, the default): RecomputedBlock in blocks of `recompute` layers
                         (default L_r) with compiled_kernels(); F compiled on its own and run once
                         per layer per step (self.f[i] is layer i's F);
             'naive'     (mHC model): each plain autograd layer, mixing and F, compiled whole;
             'residual'  (residual model): each x + F(x) compiled whole.
    F and the head (lane collapse, norm, logits, loss) are compiled in all three, so they compare
    fairly; 'optimised' folds the collapse into its last block (the compiled collapse kernels),
    'naive' collapses with the plain HyperHead inside the compiled head_loss.
    Graphs are compiled on the first call per shape (seconds to minutes): warm up before timing.
    Train/eval mode, dtype, device and grad mode are guarded by torch.compile: a change compiles
    again instead of running a stale graph. backend: torch.compile's ("inductor" fuses; "aot_eager"
    traces the same graphs without code generation, for quick checks).
    """

    VARIANTS = ("optimised", "naive", "residual")

    def __init__(self, model, variant=None, recompute=None, backend="inductor"):
        variant = variant or ("optimised" if model.hyper else "residual")
        if variant not in self.VARIANTS:
            raise ValueError(f"variant must be one of {self.VARIANTS}, got {variant!r}")
        if (variant == "residual") == model.hyper:
            raise ValueError(
                f"variant {variant!r} needs a model built with hyper={variant != 'residual'}"
            )
        cfg = model.cfg
        self.recompute = recompute or default_recompute_block(cfg.n_hc, cfg.n_layers)
        if self.recompute < 1:
            raise ValueError(f"recompute block L_r must be >= 1 layer, got {self.recompute}")
        self.model, self.variant, self.backend = model, variant, backend
        self.kernels = compiled_kernels(backend)
        self.f = [torch.compile(s, backend=backend, dynamic=False) for s in model.sublayers]
        self.head_loss = torch.compile(model.head_loss, backend=backend, dynamic=False)
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, 64)
        torch._dynamo.config.fail_on_recompile_limit_hit = True

    def run_layers(self, stream, start=0, end=None, collapse=False):
        """Layers [start, end) on the stream ([B, T, n, C], or [B, T, C] for the residual).
        collapse: end with the lanes collapsed (optimised: folded into the last block, as
        Transformer.run_layers; naive: HyperHead uncompiled, as __call__ leaves it to head_loss)."""
        model, iters = self.model, self.model.cfg.sinkhorn_iters
        end = model.cfg.n_layers if end is None else end
        if self.variant == "residual":
            for sublayer in model.sublayers[start:end]:
                stream = compiled(_residual_layer, self.backend)(stream, sublayer)
            return stream
        if self.variant == "naive":
            for sublayer, hc in zip(model.sublayers[start:end], model.hcs[start:end]):
                stream = compiled(mhc_layer_reference, self.backend)(stream, sublayer, hc, iters)
            return model.collapse(stream) if collapse else stream
        layers = list(zip(self.f[start:end], model.hcs[start:end]))
        head = model.collapse if collapse else None
        return run_recomputed_layers(stream, layers, self.recompute, iters, self.kernels, head)

    def __call__(self, idx, targets):
        optimised = self.variant == "optimised"
        x = self.run_layers(self.model.embed_stream(idx), collapse=optimised)
        return self.head_loss(x, targets)


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
        self.n_heads = cfg.n_heads
        self.norm = RMSNorm(cfg.dim)
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
    """A pre-norm transformer whose layers are attention and MLP sublayers F, alternating.

    hyper=True: each layer is an mHC layer; the embedding is copied into n lanes once
    (embed_stream) and the lanes are collapsed once by the learned HyperHead before the final norm
    (head_loss), as in V4. hyper=False: the plain residual x' = x + F(x) with the same F modules.
    """

    def __init__(self, cfg, hyper=True):
        super().__init__()
        self.cfg, self.hyper = cfg, hyper
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.sublayers = nn.ModuleList(
            Attention(cfg) if i % 2 == 0 else MLP(cfg) for i in range(cfg.n_layers)
        )
        self.hcs = self.collapse = None
        if hyper:
            n, dim = cfg.n_hc, cfg.dim
            self.hcs = nn.ModuleList(HyperConnection(n, dim, cfg.gate_init) for _ in self.sublayers)
            self.collapse = HyperHead(n, dim, cfg.gate_init)
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def stream_shape(self, batch):
        """What flows between layers and stages: [B, T, n, C], or [B, T, C] for the residual."""
        lanes = (self.cfg.n_hc,) if self.hyper else ()
        return (batch, self.cfg.seq_len, *lanes, self.cfg.dim)

    def embed_stream(self, idx):
        """idx [B, T] -> the stream [B, T, n, C]: the embedding in n lanes, here and nowhere else.

        A stride-0 view, not a copy: the first layer's output is the first real n-lane tensor,
        and a first recompute block keeps C numbers per token for its input instead of n*C.
        """
        x = self.embed(idx)  # (B, T, C)
        if not self.hyper:
            return x
        return x.unsqueeze(-2).expand(*x.shape[:-1], self.cfg.n_hc, x.shape[-1])

    def run_layers(self, stream, start, end, fused=False, recompute=0, collapse=False):
        """Apply layers [start, end). fused: the fused mixing ops. recompute = L_r > 0: blocks of
        L_r layers (cut within [start, end)) run selective recomputation, always with the fused
        mixing (what a block keeps is what their written-out backward needs), so `fused` is moot
        there; 0 stores everything. collapse (the last stage): end with the lanes collapsed,
        [B, T, C]; with recompute the collapse is folded into the last block, which then keeps
        its input instead of the head keeping the final n-lane stream."""
        if not self.hyper:
            for sublayer in self.sublayers[start:end]:
                stream = stream + sublayer(stream)  # x' = x + F(x)
            return stream
        if recompute:
            layers = list(zip(self.sublayers[start:end], self.hcs[start:end]))
            head = self.collapse if collapse else None
            return run_recomputed_layers(
                stream, layers, recompute, self.cfg.sinkhorn_iters, None, head
            )
        layer = mhc_layer_fused if fused else mhc_layer_reference
        for sublayer, hc in zip(self.sublayers[start:end], self.hcs[start:end]):
            stream = layer(stream, sublayer, hc, self.cfg.sinkhorn_iters)  # X' = B X + C F(A X)
        return self.collapse(stream, fused) if collapse else stream

    def head_loss(self, stream, targets):
        """Collapse the lanes once (the plain HyperHead) unless run_layers(collapse=True) already
        did ([B, T, C] in), then final norm, head and cross-entropy -> loss."""
        x = self.collapse(stream) if self.hyper and stream.dim() == 4 else stream
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())

    def forward(self, idx, targets, fused=False, recompute=0):
        stream = self.embed_stream(idx)
        x = self.run_layers(stream, 0, self.cfg.n_layers, fused, recompute, collapse=True)
        return self.head_loss(x, targets)


# ---- 4. pipeline parallelism: 1F1B ---------------------------------------------------------------


def stage_layers(n_layers, n_stages, stage):
    """Layers [first, stop) held by `stage` of `n_stages`: an equal contiguous share."""
    if n_stages < 1 or n_stages > n_layers or n_layers % n_stages:
        raise ValueError(
            f"{n_stages} pipeline stages cannot split {n_layers} layers evenly: use a stage "
            f"count that divides n_layers and is at most n_layers"
        )
    per_stage = n_layers // n_stages
    return stage * per_stage, (stage + 1) * per_stage


def one_f_one_b(n_stages, stage, n_micro):
    """The order in which `stage` runs forwards and backwards: [('F', i) | ('B', i), ...].

    Warm-up: n_stages - stage - 1 forwards fill the pipe; steady state alternates one forward and
    one backward; cool-down drains the backwards. A stage never holds more than n_stages - stage
    micro-batches' activations (GPipe would hold all n_micro).
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


@dataclass
class PipelineGroups:
    """Activations travel on one process group, gradients on another (see StageLinks)."""

    forward: object
    backward: object


_GROUPS = weakref.WeakKeyDictionary()  # default group -> its PipelineGroups, made once


def pipeline_groups():
    """The two groups over all ranks, created once per default group (every rank, same order)."""
    world_group = dist.group.WORLD
    if world_group not in _GROUPS:
        _GROUPS[world_group] = PipelineGroups(dist.new_group(), dist.new_group())
    return _GROUPS[world_group]


class StageLinks:
    """One stage's sends and receives of streams [B/n_micro, T, (n,) C].

    NCCL runs the sends and receives between two ranks in issue order on one stream, ignores tags
    and does not buffer sends. Activations go on one group and gradients on another, so every
    (group, neighbour) link carries data one way, in micro-batch order: no order of issue can
    deadlock. overlap=True posts each receive one micro-batch ahead, so it lands during compute.
    """

    def __init__(self, groups, stage, world, n_micro, shape, like, overlap):
        self.groups, self.stage, self.world, self.n_micro = groups, stage, world, n_micro
        self.shape, self.dtype, self.device = shape, like.dtype, like.device  # from the model
        self.overlap, self.pending, self.sends, self.stats = overlap, {}, [], PipelineStats()
        if overlap and stage > 0:
            self.post_recv("forward", 0)
        if overlap and stage < world - 1:
            self.post_recv("backward", 0)

    def clock(self):
        """Host time after the device is idle: under NCCL Work.wait() does not block the host."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def post_recv(self, direction, i):
        if i < self.n_micro and (direction, i) not in self.pending:
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            peer, group = (
                (self.stage - 1, self.groups.forward)
                if direction == "forward"
                else (self.stage + 1, self.groups.backward)
            )
            self.pending[direction, i] = buffer, dist.irecv(buffer, src=peer, group=group)

    def recv(self, direction, i):
        """Micro-batch i's activation ("forward", from stage-1) or gradient ("backward")."""
        self.post_recv(direction, i)
        buffer, work = self.pending.pop((direction, i))
        began = self.clock()
        work.wait()
        self.stats.wait_s += self.clock() - began
        if self.overlap:
            self.post_recv(direction, i + 1)  # the next one arrives while we compute
        return buffer

    def send(self, direction, tensor):
        """Asynchronous: two neighbours may send to each other at the same moment."""
        tensor = tensor.detach().contiguous()
        forward = direction == "forward"
        peer = self.stage + 1 if forward else self.stage - 1
        group = self.groups.forward if forward else self.groups.backward
        self.sends.append((dist.isend(tensor, dst=peer, group=group), tensor))  # keep it alive
        nbytes = tensor.numel() * tensor.element_size()
        if forward:
            self.stats.bytes_sent_forward += nbytes
        else:
            self.stats.bytes_sent_backward += nbytes

    def finish(self):
        for work, _ in self.sends:
            work.wait()
        return self.stats


def pipeline_step(model, idx, targets, n_micro, fused=True, recompute=0, overlap=True):
    """One training step's forward and backward over the pipeline stages (the default group).

    idx, targets [B, T], the same on every rank (stage 0 reads idx, the last stage targets). Fills
    .grad of this stage's parameters (the mean loss over the batch, as in one process) and returns
    (loss on the last stage else None, PipelineStats). overlap=False is the baseline that hides
    nothing: each receive is posted when its data is needed and waited at once.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    stage = dist.get_rank() if dist.is_initialized() else 0
    check_pipeline_step(model, idx, targets, n_micro, fused, recompute, overlap)  # every rank
    # hint: forward(i) and backward(i) each receive, compute, send; then run the phases in order
    ### BEGIN SOLUTION
    first, stop = stage_layers(model.cfg.n_layers, world, stage)
    order, warmup = one_f_one_b(world, stage, n_micro), min(world - stage - 1, n_micro)
    like = model.embed.weight  # receive buffers take the model's dtype and device
    groups = pipeline_groups() if world > 1 else None
    shape = model.stream_shape(idx.shape[0] // n_micro)
    links = StageLinks(groups, stage, world, n_micro, shape, like, overlap)
    idx_micro, tgt_micro = idx.chunk(n_micro), targets.chunk(n_micro)
    held_in, held_out, losses, last = {}, {}, [], stage == world - 1

    def forward(i):
        if stage == 0:
            stream = model.embed_stream(idx_micro[i])
        else:
            stream = links.recv("forward", i).requires_grad_()
        began = links.clock()
        out = model.run_layers(stream, first, stop, fused, recompute, collapse=last)
        if last:
            out = model.head_loss(out, tgt_micro[i]) / n_micro
            losses.append(out.detach())
        links.stats.compute_s += links.clock() - began
        held_in[i], held_out[i] = stream, out
        if not last:
            links.send("forward", out)

    def backward(i):
        grad = None if last else links.recv("backward", i)
        began = links.clock()
        held_out.pop(i).backward(grad)
        links.stats.compute_s += links.clock() - began
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


# ---- appendix: agreement guard, validation, V4 weights, accounting, demo -------------------------


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


def agree(fields, error=None, group=None):
    """The agreement guard: every rank runs it before the first collective of an entry point.

    fields: name -> readable value that must be equal on every rank. error: this rank's local
    validation failure (or None); it travels with the fields, so a rank that failed alone still
    joins this all_gather and every rank raises the same ValueError. A sha256 digest of the
    canonical fields decides; the readable fields say which one differs and where.
    """
    mine = {name: repr(value) for name, value in fields.items()}
    digest = hashlib.sha256(repr(sorted(mine.items())).encode()).hexdigest()
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    gathered = [(digest, mine, error)]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, (digest, mine, error), group=group)
    failed = [(rank, e) for rank, (_, _, e) in enumerate(gathered) if e]
    if failed:
        texts = {e for _, e in failed}
        if len(texts) == 1 and len(failed) == world:
            raise ValueError(failed[0][1])
        raise ValueError("; ".join(f"rank {rank}: {e}" for rank, e in failed))
    if len({d for d, _, _ in gathered}) == 1:
        return
    problems = []
    for name in mine:
        by_value = {}
        for rank, (_, theirs, _) in enumerate(gathered):
            by_value.setdefault(theirs.get(name), []).append(rank)
        if len(by_value) > 1:
            parts = [
                f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))} "
                f"{'have' if len(r) > 1 else 'has'} {v}"
                for v, r in by_value.items()
            ]
            problems.append(f"{name} differs across ranks: " + ", ".join(parts))
    raise ValueError("; ".join(problems) or "ranks disagree on their field names")


def parameter_checksum(model):
    """sha256 over every parameter's name, dtype, shape and bytes: exact, cheap at this size."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        data = p.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        digest.update(f"{name}:{p.dtype}:{tuple(p.shape)}".encode())
        digest.update(data.numpy().tobytes())
    return digest.hexdigest()[:16]


def validate_pipeline_inputs(model, idx, targets, n_micro, recompute, world, stage):
    """Raise the clear ValueError for this rank's bad input (run before any collective)."""
    cfg = model.cfg
    if idx.shape != targets.shape or idx.dim() != 2 or idx.shape[1] != cfg.seq_len:
        raise ValueError(
            f"idx and targets must both be [batch, seq_len={cfg.seq_len}], got "
            f"{tuple(idx.shape)} and {tuple(targets.shape)}"
        )
    if idx.dtype != torch.long or targets.dtype != torch.long:
        raise ValueError(
            f"idx and targets must be int64 token ids, got {idx.dtype}, {targets.dtype}"
        )
    if idx.device != model.embed.weight.device:
        raise ValueError(f"idx is on {idx.device} but the model on {model.embed.weight.device}")
    if not isinstance(n_micro, int) or n_micro < 1 or idx.shape[0] % n_micro:
        raise ValueError(
            f"batch {idx.shape[0]} does not split into n_micro={n_micro} equal micro-batches"
        )
    if not isinstance(recompute, int) or recompute < 0:
        raise ValueError(f"recompute block L_r must be >= 1 layer (or 0 for none), got {recompute}")
    stage_layers(cfg.n_layers, world, stage)
    one_f_one_b(world, stage, n_micro)


_GUARDED = weakref.WeakSet()  # models whose initial parameters the guard has compared


def check_pipeline_step(model, idx, targets, n_micro, fused, recompute, overlap):
    """Validate this rank's input, then agree across ranks on everything the stages share; the
    first step of a model also compares a checksum of its initial parameters (stages must start
    from one model: each holds its layers, but all build the whole model from the same seed)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    stage = dist.get_rank() if dist.is_initialized() else 0
    error = None
    try:
        validate_pipeline_inputs(model, idx, targets, n_micro, recompute, world, stage)
    except ValueError as e:
        error = str(e)
    fields = {
        "config": asdict(model.cfg),
        "hyper": model.hyper,
        "parameter dtype": str(model.embed.weight.dtype),
        "idx shape": tuple(idx.shape),
        "idx dtype": str(idx.dtype),
        "targets shape": tuple(targets.shape),
        "n_micro": n_micro,
        "fused": bool(fused),
        "recompute": recompute,
        "overlap": bool(overlap),
    }
    if model not in _GUARDED:
        fields["initial parameters (sha256)"] = parameter_checksum(model)
    agree(fields, error)
    _GUARDED.add(model)


def hc_params_from_v4(fn, base, scale, n):
    """One V4 HyperConnection (fn [(2+n)n, nC], base [(2+n)n], scale [3]) -> HyperConnection's
    parameters. V4 keeps comb = B^T (it computes comb^T X), so the comb block is transposed."""
    nc = fn.shape[1]
    comb_rows = fn[2 * n :].reshape(n, n, nc).transpose(0, 1).reshape(n * n, nc)  # (j,i) -> (i,j)
    return {
        "proj": torch.cat([fn[: 2 * n], comb_rows]).T,
        "gate": scale,
        "bias_pre": base[:n],
        "bias_post": base[n : 2 * n],
        "bias_res": base[2 * n :].reshape(n, n).T,
    }


def from_v4_state_dict(model, state_dict):
    """Load the mHC weights of a V4 checkpoint (transformers' DeepseekV4Model names) into model.

    V4 name (layer l)                  shape          -> this file           layout change
    layers.l.attn_hc.fn                [(2+n)n, nC]   hcs[2l].proj           transpose; comb rows
                                                                             (j,i) -> (i,j)
    layers.l.attn_hc.base              [(2+n)n]       hcs[2l].bias_pre, bias_post, bias_res
                                                                             split n|n|n^2; comb^T
    layers.l.attn_hc.scale             [3]            hcs[2l].gate           none (pre,post,comb)
    layers.l.ffn_hc.{fn,base,scale}    as above       hcs[2l+1].*            as above
    hc_head.hc_fn                      [n, nC]        collapse.proj          transpose
    hc_head.hc_base                    [n]            collapse.bias          none
    hc_head.hc_scale                   [1]            collapse.gate          none
    A leading "model." is accepted. Only mHC weights: F here is not V4's attention or MoE, so its
    weights stay as they are. Returns the list of this model's parameter names that were set.
    """
    if not model.hyper:
        raise ValueError("from_v4_state_dict needs an mHC model (hyper=True)")
    n = model.cfg.n_hc
    sd = {k.removeprefix("model."): v for k, v in state_dict.items()}
    targets = {}
    for i in range(model.cfg.n_layers):
        prefix = f"layers.{i // 2}.{'attn_hc' if i % 2 == 0 else 'ffn_hc'}."
        names = [prefix + s for s in ("fn", "base", "scale")]
        if any(name not in sd for name in names):
            missing = [name for name in names if name not in sd]
            raise ValueError(f"V4 state dict lacks {missing} for this model's layer {i}")
        for key, value in hc_params_from_v4(*(sd[name] for name in names), n).items():
            targets[f"hcs.{i}.{key}"] = value
    for src, dst in (("hc_fn", "proj"), ("hc_base", "bias"), ("hc_scale", "gate")):
        if f"hc_head.{src}" not in sd:
            raise ValueError(f"V4 state dict lacks hc_head.{src}")
        value = sd[f"hc_head.{src}"]
        targets[f"collapse.{dst}"] = value.T if dst == "proj" else value
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in targets.items():
            if params[name].shape != value.shape:
                raise ValueError(
                    f"{name}: V4 gives shape {tuple(value.shape)}, model has "
                    f"{tuple(params[name].shape)} (n_hc and dim must match the checkpoint)"
                )
            params[name].copy_(value)
    return list(targets)


def mixing_bytes_per_token(n, dim, fused, bytes_per_element=4):
    """Bytes one layer's lane mixing reads and writes per token: {op: (read, write)}.

    Counted op by op as eager autograd runs it (naive) or one pass per operation (fused):
      coefficients  naive: sum of squares (read nC), X/rms (read nC, write nC), projection (read
                    nC); fused (NormThenProject): one pass reads nC; both write the 2n+n^2 logits
      pre-mix       naive: A_i X_i (read nC, write nC), sum over lanes (read nC, write C);
                    fused: read nC, write C
      post-mix      naive: B X (read nC, write nC), C f (read C, write nC), add (read 2nC, write nC)
                    fused: read nC + C, write nC  (the mHC paper's (3n+1)C -> (n+1)C, 3nC -> nC)
    The per-token coefficients (n^2 + 2n numbers) are left out: O(n^2), not O(nC).
    """
    nc, k = n * dim, 2 * n + n * n
    if fused:
        counts = {"coefficients": (nc, k), "pre_mix": (nc, dim), "post_mix": (nc + dim, nc)}
    else:
        counts = {
            "coefficients": (3 * nc, nc + k),
            "pre_mix": (2 * nc, nc + dim),
            "post_mix": ((3 * n + 1) * dim, 3 * nc),
        }
    return {op: (r * bytes_per_element, w * bytes_per_element) for op, (r, w) in counts.items()}


@dataclass
class OverheadEstimate:
    """Work per token per layer, mixing against F (multiply-adds or element accesses)."""

    dim: int
    mixing: int  # projection multiply-adds + fused mixing element reads and writes
    f: int  # F's multiply-adds, attention and MLP layers averaged

    @property
    def ratio(self):
        return self.mixing / self.f


def expected_overhead(n, dim, seq_len):
    """mixing ~ n*C per token per layer (a projection to 2n+n^2 numbers plus ~(4n+2)C element
    reads/writes), F ~ C^2 (attention 4C^2 + 2TC, MLP 8C^2 multiply-adds): ratio ~ 1/C."""
    reads_writes = sum(r + w for r, w in mixing_bytes_per_token(n, dim, True, 1).values())
    mixing = n * dim * (2 * n + n * n) + reads_writes
    f = ((4 * dim * dim + 2 * seq_len * dim) + 8 * dim * dim) // 2
    return OverheadEstimate(dim, mixing, f)


def saved_activation_bytes(model, run):
    """Bytes of distinct storages autograd holds for backward while run() builds the graph
    (parameters excluded). Returns (run's result, bytes)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

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


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class VariantResult:
    loss0: float
    loss: float
    act_MiB: float
    step_ms: float
    f_calls_per_step: float


def train_single(cfg, variant, steps, batch, device, seed=0):
    """Train one variant ('residual' | 'naive' | 'optimised') a few steps in one process."""
    torch.manual_seed(seed)
    model = Transformer(cfg, hyper=variant != "residual").to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    options = {}
    if variant == "optimised":
        options = dict(fused=True, recompute=default_recompute_block(cfg.n_hc, cfg.n_layers))
    calls = [0]
    hooks = [
        m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        for m in model.sublayers
    ]
    losses, times, act_bytes = [], [], 0
    for step in range(steps + 1):
        data = synthetic_batch(cfg, batch, gen, device)
        _sync(device)
        began = time.perf_counter()
        run = lambda: model(data[:, :-1], data[:, 1:], **options)  # noqa: E731
        loss, act_bytes = saved_activation_bytes(model, run)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if step:  # step 0 warms up allocators and caches
            times.append(time.perf_counter() - began)
        losses.append(loss.item())
    for h in hooks:
        h.remove()
    step_ms = 1e3 * sorted(times)[len(times) // 2]
    return VariantResult(losses[0], losses[-1], act_bytes / 2**20, step_ms, calls[0] / (steps + 1))


@dataclass
class OverlapRow:
    """One pipeline variant's step, as the slowest stage saw it and as stage 0 spent it."""

    variant: str
    step_ms: float  # slowest stage, median over steps
    compute_ms: float  # stage 0: forward + backward compute
    wait_ms: float  # stage 0: blocked on receives
    other_ms: float  # stage 0: the rest (posting sends, Python, the final send waits)


def transfer_ms(shape, like, repeats=5):
    """Time for one stream [shape] to go from rank 0 to rank 1 alone (half a round trip)."""
    buffer = torch.zeros(shape, dtype=like.dtype, device=like.device)
    rank, times = dist.get_rank(), []
    for _ in range(repeats):
        dist.barrier()
        began = time.perf_counter()
        if rank == 0:
            dist.send(buffer, dst=1)
            dist.recv(buffer, src=1)
        elif rank == 1:
            dist.recv(buffer, src=0)
            dist.send(buffer, dst=0)
        _sync(like.device)
        times.append((time.perf_counter() - began) / 2)
    return 1e3 * sorted(times)[len(times) // 2]


def overlap_attribution(cfg, batch, n_micro, steps, device, seed=0):
    """Posted-ahead vs blocking receives on the same mHC pipeline (fused + recompute): a list of
    OverlapRow (every rank gets it) and the one-message transfer time in ms. Collective."""
    world = dist.get_world_size()
    recompute = default_recompute_block(cfg.n_hc, cfg.n_layers // world)
    torch.manual_seed(seed)
    model = Transformer(cfg).to(device)
    data = synthetic_batch(cfg, batch, torch.Generator().manual_seed(seed), device)
    samples = {"blocking": [], "posted ahead": []}
    for step in range(steps + 1):  # interleaved, so drift hits both alike; step 0 warms up
        for variant in samples:
            dist.barrier()
            began = time.perf_counter()
            _, stats = pipeline_step(
                model,
                data[:, :-1],
                data[:, 1:],
                n_micro,
                True,
                recompute,
                overlap=variant == "posted ahead",
            )
            model.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - began
            if step:
                samples[variant].append((elapsed, stats.compute_s, stats.wait_s))
    rows = []
    for variant, runs in samples.items():
        gathered = [None] * world
        dist.all_gather_object(gathered, runs)
        step_s = sorted(max(r[k][0] for r in gathered) for k in range(steps))[steps // 2]
        mid = sorted(gathered[0], key=lambda r: r[0])[steps // 2]
        rows.append(
            OverlapRow(
                variant, 1e3 * step_s, 1e3 * mid[1], 1e3 * mid[2], 1e3 * (mid[0] - mid[1] - mid[2])
            )
        )
    one = transfer_ms(model.stream_shape(batch // n_micro), model.embed.weight)
    return rows, one


# ---- set-up: the same block in every technique file, copied so each file stands alone ----


def choose_backend(backend=None, device=None):
    """Pick (backend, device type) for this launch and say why, in one line.

    Defaults: NCCL on CUDA when every local rank can have a GPU of its own, else gloo on the CPU.
    gloo with --device cuda lets several ranks share a GPU (a one-GPU machine can run N = 4).
    Refuses combinations that cannot work, before any process group exists.
    """
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"--backend must be gloo or nccl, got {backend!r}")
    if device is None:
        device = "cuda" if backend != "gloo" and 0 < local_ranks <= gpus else "cpu"
        if device == "cuda":
            why = f"{gpus} GPU(s) for {local_ranks} local rank(s)"
        elif backend == "gloo" or gpus == 0:
            why = "--backend gloo" if backend == "gloo" else "no GPU visible"
        else:
            why = f"{gpus} GPU(s) are too few for {local_ranks} local ranks"
    else:
        why = f"--device {device}"
    if device == "cuda" and gpus == 0:
        raise ValueError("--device cuda: no CUDA GPU is visible; pass --device cpu")
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if backend == "nccl" and device != "cuda":
        raise ValueError("--backend nccl moves only CUDA tensors: pass --device cuda, or gloo")
    if backend == "nccl" and local_ranks > gpus:
        raise ValueError(
            f"NCCL needs one GPU per local rank: {local_ranks} ranks, {gpus} GPU(s); "
            "launch fewer ranks, or pass --backend gloo to share GPUs"
        )
    return backend, device, f"backend {backend}, device {device} ({why})"


def setup(backend=None, device=None, seed=0, timeout_s=120):
    """Join torchrun's process group, or make a group of one when run as plain `python FILE`.

    Returns (rank, world_size, device). The CUDA device is set before the group is created, so
    NCCL binds each rank to its own GPU.
    """
    backend, device_type, why = choose_backend(backend, device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count() if device_type == "cuda" else 1
    dev = torch.device("cuda", local_rank % gpus) if device_type == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ:  # launched by torchrun: its environment carries the rendezvous
        dist.init_process_group(
            backend, timeout=timeout, device_id=dev if backend == "nccl" else None
        )
    else:  # plain `python FILE`: a group of one, no network
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    torch.manual_seed(seed)
    if dist.get_rank() == 0:
        print(f"[setup] {dist.get_world_size()} rank(s), {why}", flush=True)
    return dist.get_rank(), dist.get_world_size(), dev


def teardown():
    """Collect cycles that hold communicators, then destroy the group (torch warns otherwise)."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def parse_args(argv=None):
    """Every option with its help; every value checked here, before any work, one line each."""
    parser = argparse.ArgumentParser(
        description="mHC demo: residual vs naive vs optimised mHC in one process, then the same "
        "model as a 1F1B pipeline over the torchrun ranks (posted-ahead vs blocking receives)."
    )
    parser.add_argument("--dim", type=int, default=128, help="C, the width of one lane (128)")
    parser.add_argument(
        "--layers",
        type=int,
        default=12,
        help="sublayers, attention and MLP alternating; must divide evenly over "
        "the ranks (12 works at 1, 2, 3, 4)",
    )
    parser.add_argument(
        "--heads",
        type=int,
        default=None,
        help="attention heads; must divide --dim (default dim // 32)",
    )
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence, T (32)")
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (6)")
    parser.add_argument(
        "--batch",
        type=int,
        default=24,
        help="sequences per step; must split into --micro equal micro-batches "
        "(24 splits into 2, 4, 6 and 8)",
    )
    parser.add_argument(
        "--micro",
        type=int,
        default=None,
        help="pipeline micro-batches per step, at least the rank count (default 2 x ranks)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of model and data (0)")
    parser.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        default=None,
        help="process-group backend (default: NCCL when every rank has a GPU, else gloo)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="where tensors live (default: CUDA with NCCL, else CPU)",
    )
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args.heads = args.heads or max(1, args.dim // 32)
    args.micro = args.micro or 2 * world
    for name in ("dim", "layers", "heads", "seq_len", "steps", "batch", "micro"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.dim % args.heads:
        parser.error(f"--heads {args.heads} must divide --dim {args.dim}")
    if args.layers % world or args.layers < world:
        parser.error(f"--layers {args.layers} must be a multiple of the {world} ranks (stages)")
    if args.micro < world:
        parser.error(f"--micro {args.micro} must be at least the {world} ranks (1F1B)")
    if args.batch % args.micro:
        parser.error(f"--batch {args.batch} must split into --micro {args.micro} equal parts")
    return args


def compare_in_one_process(cfg, args, device):
    """Residual vs naive vs optimised mHC, each trained a few steps in this process."""
    l_r = default_recompute_block(cfg.n_hc, cfg.n_layers)
    print(
        f"optimised = fused mixing + selective recomputation (L_r = {l_r}); memory = bytes saved "
        f"for backward; step time = median of {args.steps} steps\n"
    )
    print(
        f"{'variant':<10} {'loss start':>10} {'loss end':>9} {'saved act MiB':>14} "
        f"{'step ms':>9} {'F calls/step':>13}"
    )
    base, began = None, time.perf_counter()
    for variant in ("residual", "naive", "optimised"):
        r = train_single(cfg, variant, args.steps, args.batch, device, args.seed)
        base = base or r
        print(
            f"{variant:<10} {r.loss0:>10.4f} {r.loss:>9.4f} {r.act_MiB:>14.2f} "
            f"{r.step_ms:>9.1f} {r.f_calls_per_step:>13.0f}   (x{r.step_ms / base.step_ms:.2f} "
            f"time, x{r.act_MiB / base.act_MiB:.2f} memory; {time.perf_counter() - began:.0f} s "
            f"elapsed)",
            flush=True,
        )
    naive = mixing_bytes_per_token(cfg.n_hc, cfg.dim, False)
    fused = mixing_bytes_per_token(cfg.n_hc, cfg.dim, True)
    print("\nlane-mixing bytes per token per layer, read/written (fp32):")
    for op in naive:
        print(
            f"  {op:<13} naive {naive[op][0]:>6}/{naive[op][1]:<6} "
            f"fused {fused[op][0]:>6}/{fused[op][1]:<6}"
        )


def say_expected_overhead(cfg):
    here, big = (expected_overhead(cfg.n_hc, c, cfg.seq_len) for c in (cfg.dim, 1024))
    print(
        f"\nwhat to expect at C={cfg.dim}: per token and layer the lane mixing does ~n*C work "
        f"({here.mixing} operations)\n  against F's ~C^2 ({here.f} multiply-adds): "
        f"{100 * here.ratio:.0f}%. But eager mode runs the mixing as over a hundred\n"
        f"  small ops per layer (the 20 Sinkhorn rounds alone are 120), each a pass over memory "
        f"plus\n  Python dispatch, while F is a few large matmuls: at this C mHC takes a multiple "
        f"of the\n  residual's step time on either path (the optimised one is the faster of the "
        f"two here\n  too, and keeps far less). The arithmetic ratio falls as 1/C "
        f"({100 * big.ratio:.1f}% at C=1024);\n  `python benchmarks/bench_mhc.py --curve` "
        f"measures the overhead over C."
    )


def train_pipeline(cfg, args, rank, world, device):
    """Residual then mHC trained as a 1F1B pipeline over the ranks; a line per stage of the run."""
    print0 = print if rank == 0 else (lambda *a, **k: None)
    print0(
        f"\npipeline: {world} stage(s), 1F1B over {args.micro} micro-batches of "
        f"{args.batch // args.micro}, receives posted ahead"
    )
    l_r = default_recompute_block(cfg.n_hc, cfg.n_layers // world)
    for hyper in (False, True):
        torch.manual_seed(args.seed)
        model = Transformer(cfg, hyper=hyper).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(args.seed + 1)
        losses, waited, began = [], 0.0, time.perf_counter()
        for step in range(args.steps):
            data = synthetic_batch(cfg, args.batch, gen, device)
            loss, stats = pipeline_step(
                model,
                data[:, :-1],
                data[:, 1:],
                args.micro,
                fused=True,
                recompute=l_r if hyper else 0,
            )
            opt.step()
            opt.zero_grad(set_to_none=True)
            waited += stats.wait_s
            if loss is not None:
                losses.append(loss.item())
        name, per_step = (
            ("mHC" if hyper else "residual"),
            (time.perf_counter() - began) / args.steps,
        )
        if rank == world - 1:
            print(
                f"  {name:<9} loss {losses[0]:.4f} -> {losses[-1]:.4f} (last stage), "
                f"{per_step * 1e3:.0f} ms per step",
                flush=True,
            )
        if world > 1:
            dist.barrier()
            print0(
                f"  {name:<9} sent per step across each stage boundary: "
                f"{stats.bytes_sent_forward / 2**20:.3f} MiB forward + the same backward; "
                f"stage 0 waited on receives {1e3 * waited / args.steps:.1f} of "
                f"{1e3 * per_step:.1f} ms per step",
                flush=True,
            )
            dist.barrier()


def show_overlap(cfg, args, rank, device):
    """At N >= 2: posted-ahead vs blocking receives, the step-time difference attributed."""
    rows, one = overlap_attribution(cfg, args.batch, args.micro, max(3, args.steps // 2), device)
    if rank:
        return
    print("\nposted-ahead vs blocking receives, mHC (fused + recompute); stage 0's time per step:")
    print(f"  {'receives':<13} {'step ms':>8} {'compute ms':>11} {'waited ms':>10} {'other ms':>9}")
    for r in rows:
        print(
            f"  {r.variant:<13} {r.step_ms:>8.1f} {r.compute_ms:>11.1f} {r.wait_ms:>10.1f} "
            f"{r.other_ms:>9.1f}"
        )
    block, ahead = rows
    messages = 2 * args.micro  # stage 0 receives one gradient per micro-batch and sends one stream
    print(
        f"  posting ahead changes the step by {ahead.step_ms - block.step_ms:+.1f} ms: waiting "
        f"{ahead.wait_ms - block.wait_ms:+.1f} ms, compute "
        f"{ahead.compute_ms - block.compute_ms:+.1f} ms, other "
        f"{ahead.other_ms - block.other_ms:+.1f} ms.\n  One stream alone takes {one:.2f} ms to "
        f"cross a boundary; {messages} messages per step per boundary\n  = {messages * one:.1f} "
        f"ms of transfer that posting ahead can hide; the rest of the wait is the pipeline\n"
        f"  bubble. Timings on a shared machine are noisy.",
        flush=True,
    )


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = setup(args.backend, args.device, seed=args.seed, timeout_s=600)
    try:
        cfg = Config(seq_len=args.seq_len, dim=args.dim, n_layers=args.layers, n_heads=args.heads)
        if rank == 0:
            print(
                f"mHC demo: {cfg.n_layers} layers, C={cfg.dim}, n_hc={cfg.n_hc}, "
                f"T={cfg.seq_len}, batch {args.batch}, {args.steps} steps, {world} rank(s)"
            )
            if world == 1:
                compare_in_one_process(cfg, args, device)
            else:
                print(
                    "(the one-process comparison of residual, naive and optimised mHC runs "
                    "with `python mhc.py`)"
                )
            say_expected_overhead(cfg)
        train_pipeline(cfg, args, rank, world, device)
        if world >= 2:
            show_overlap(cfg, args, rank, device)
    finally:
        teardown()


if __name__ == "__main__":
    main()
