"""mHC made affordable: manifold-constrained hyper-connections and the three things that pay for them.

DeepSeek-V4 §3.4.2 (the layer: V4 §2.2; the mHC paper, arXiv 2512.24880, §4).

What the standard tool assumes. A transformer's residual stream is one vector of C numbers per token:
x' = x + F(x). Activation checkpointing keeps or drops whole modules, and a pipeline stage hands its
neighbour C numbers per token.

What V4's design violates. Hyper-connections widen the stream to n_hc = 4 lanes, X in R^{n x C}, mixed
by three small per-token matrices that are computed from the stream itself:
    X' = B X + C F(A X),   A = sigmoid(.) in R^{1 x n},  C = 2 sigmoid(.) in R^{n x 1},
    B = Sinkhorn-Knopp(exp(.)) in R^{n x n}, doubly stochastic (the "manifold constraint").
Every layer's input is now n*C per token: n times the residual's activation memory, n times the
pipeline traffic, and the lane mixing is memory-bound elementwise work that a plain framework runs as
a string of separate ops, each reading and writing the whole widened stream.

The fix, three reductions (each a section below, each checked against the plain autograd layer):
  1. fused lane mixing: the pre-mix A X, the post-mix + residual merge B X + C f, and the coefficient
     projection (RMS division moved after the matmul) each as one operation with a hand-written
     backward, reading the lanes once and writing them once;
  2. selective recomputation: keep one block input (n*C) every L_r layers and every F output (C);
     rebuild the lane states, A X and the normalised stream in backward; never run F twice;
  3. a 1F1B pipeline whose stages exchange the n-lane stream with sends/receives posted ahead, so the
     extra traffic hides behind compute (V4's DualPipe adjustment, here on a plain 1F1B).

Run it:
    python mhc.py                              # one process: residual vs naive vs optimised mHC
    torchrun --nproc_per_node=2 mhc.py         # CPU, gloo: the same model split over 2 pipeline stages
    torchrun --nproc_per_node=4 mhc.py         # 4 stages; on GPUs NCCL is picked automatically
"""
import argparse
import datetime
import gc
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

EPS = 1e-6


# ----------------------------------------------------------------------------- model configuration

@dataclass
class Config:
    vocab_size: int = 256
    seq_len: int = 64
    dim: int = 128           # C, the width of one lane
    n_heads: int = 4
    n_layers: int = 8        # mHC layers: attention and MLP sublayers alternate, each with its own HC (as in V4)
    n_hc: int = 4            # lanes in the widened residual stream
    sinkhorn_iters: int = 20
    gate_init: float = 0.01  # alpha: the data-dependent part of A, B, C starts small

    def __post_init__(self):
        if self.n_hc < 1:
            raise ValueError(f"n_hc must be >= 1 (the number of residual lanes), got {self.n_hc}")
        if self.n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {self.n_layers}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.sinkhorn_iters < 1:
            raise ValueError(f"sinkhorn_iters must be >= 1, got {self.sinkhorn_iters}")


# ----------------------------------------------------------------------------- the mHC layer (V4 §2.2)

def sinkhorn_knopp(logits, iters=20):
    """Project exp(logits) onto the doubly stochastic matrices. logits [..., n, n] -> [..., n, n].

    Starting form: a softmax over each row, which is exp(logits) with its rows normalised, computed
    without overflow (the public V4 code does the same, plus an eps we do not need: every entry of a
    softmax is > 0, so no sum can vanish). Then `iters` rounds of (normalise columns, normalise rows).
    We end on rows because B acts as X' = B X: unit row sums make every output lane a convex
    combination of input lanes, exactly; the column sums converge geometrically to 1.
    """
    if iters < 1:
        raise ValueError(f"sinkhorn iters must be >= 1, got {iters}")
    matrix = torch.softmax(logits, dim=-1)
    for _ in range(iters):
        matrix = matrix / matrix.sum(dim=-2, keepdim=True)
        matrix = matrix / matrix.sum(dim=-1, keepdim=True)
    return matrix


class HyperConnection(nn.Module):
    """The parameters that turn one layer's stream X [..., n, C] into its A [..., n], B [..., n, n], C [..., n].

    One projection of width n + n + n^2 from the RMS-normalised flattened stream (no RMSNorm weight: it
    would only rescale the projection), static biases S plus gated dynamic terms alpha * (x W).
    """

    def __init__(self, n, dim, gate_init=0.01):
        super().__init__()
        self.n, self.dim = n, dim
        self.proj = nn.Parameter(torch.randn(n * dim, 2 * n + n * n) * (n * dim) ** -0.5)  # [W_pre|W_post|W_res]
        self.gate = nn.Parameter(torch.full((3,), float(gate_init)))                      # alpha_pre, _post, _res
        # sigmoid(bias_pre) = 1/n: A X starts as the mean of the lanes.
        self.bias_pre = nn.Parameter(torch.full((n,), -math.log(n - 1) if n > 1 else 0.0))
        self.bias_post = nn.Parameter(torch.zeros(n))            # C = 2 sigmoid(0) = 1: F's output reaches every lane
        self.bias_res = nn.Parameter(3.0 * torch.eye(n))         # B starts near the identity, lane by lane a residual

    def check_stream(self, stream):
        if stream.dim() < 2 or stream.shape[-2] != self.n or stream.shape[-1] != self.dim:
            raise ValueError(f"mHC stream must have shape [..., n_hc={self.n}, dim={self.dim}], got "
                             f"{tuple(stream.shape)}: expand the embedding into n_hc lanes once "
                             f"(Transformer.embed_stream) and keep that shape between layers")


def mhc_coefficients(stream, hc, iters=20, optimised=False):
    """stream [..., n, C] -> (A [..., n], B [..., n, n], C [..., n]) for one layer.

    optimised=True uses NormThenProject, which divides by the RMS after the projection, and runs
    Sinkhorn-Knopp with a backward that replays the iterations instead of storing 2*iters n x n
    intermediates per token.
    """
    n = hc.n
    flat = stream.flatten(-2)
    if optimised:
        logits = NormThenProject.apply(flat, hc.proj)
    else:
        logits = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS)) @ hc.proj
    pre, post, res = logits.split([n, n, n * n], dim=-1)
    a = torch.sigmoid(hc.gate[0] * pre + hc.bias_pre)
    c = 2 * torch.sigmoid(hc.gate[1] * post + hc.bias_post)
    res_logits = hc.gate[2] * res.unflatten(-1, (n, n)) + hc.bias_res
    b = SinkhornReplay.apply(res_logits, iters) if optimised else sinkhorn_knopp(res_logits, iters)
    return a, b, c


# ----------------------------------------------------------------------------- reference implementation

def mhc_layer_reference(stream, sublayer, hc, iters=20):
    """The plain autograd mHC layer: X [..., n, C] -> B X + C F(A X)  [..., n, C].

    Obviously correct and nothing else: every optimised path in this file is tested against it.
    """
    hc.check_stream(stream)
    a, b, c = mhc_coefficients(stream, hc, iters)
    h = torch.einsum("...n,...nc->...c", a, stream)
    f = sublayer(h)
    return torch.einsum("...ij,...jc->...ic", b, stream) + c.unsqueeze(-1) * f.unsqueeze(-2)


# ----------------------------------------------------------------------------- 1. fused lane mixing

class NormThenProject(torch.autograd.Function):
    """RMSNorm(x) W computed as (x W) * r, r = 1/rms(x): x [..., D], W [D, k] -> [..., k].

    The division moves after the matmul (mHC paper §4), so the normalised stream (D = n*C per token)
    is never written; saved: x (the layer's stream, alive anyway), W, r and x W (k per token).
    Backward in two passes over x: dx = (g r) W^T - (sum(g * xW) r^3 / D) x.
    """

    @staticmethod
    def forward(ctx, x, weight):
        projected = x @ weight
        inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        ctx.save_for_backward(x, weight, inv_rms, projected)
        return projected * inv_rms

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, inv_rms, projected = ctx.saved_tensors
        scaled = grad_out * inv_rms                                             # [..., k]
        grad_weight = x.reshape(-1, x.shape[-1]).T @ scaled.reshape(-1, scaled.shape[-1])
        through_rms = (grad_out * projected).sum(-1, keepdim=True) * inv_rms.pow(3) / x.shape[-1]
        grad_x = torch.addcmul(scaled @ weight.T, through_rms, x, value=-1)
        return grad_x, grad_weight


class SinkhornReplay(torch.autograd.Function):
    """sinkhorn_knopp saving only its logits [..., n, n]; backward replays the 2*iters normalisations.

    Plain autograd keeps every intermediate matrix and its sums: ~2*iters*(n^2 + n) floats per token
    per layer, which for n = 4 and 20 iterations is more than the n*C stream itself until C ~ 200.
    """

    @staticmethod
    def forward(ctx, logits, iters):
        ctx.iters = iters
        ctx.save_for_backward(logits)
        return sinkhorn_knopp(logits, iters)

    @staticmethod
    def backward(ctx, grad_out):
        (logits,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_()
            (grad,) = torch.autograd.grad(sinkhorn_knopp(leaf, ctx.iters), leaf, grad_out)
        return grad, None


class FusedPreMix(torch.autograd.Function):
    """h = A X: A [..., n], X [..., n, C] -> h [..., C]. Reads X once, writes C; saves A and X only.

    X is the layer's input stream, alive anyway; the n x C product A_i X_i is never materialised.
    """

    @staticmethod
    def forward(ctx, a, stream):
        ctx.save_for_backward(a, stream)
        return (a.unsqueeze(-2) @ stream).squeeze(-2)

    @staticmethod
    def backward(ctx, grad_h):
        a, stream = ctx.saved_tensors
        grad_a = (stream @ grad_h.unsqueeze(-1)).squeeze(-1)          # [..., n]: <X_i, dh>
        grad_stream = a.unsqueeze(-1) * grad_h.unsqueeze(-2)           # [..., n, C]: A_i dh
        return grad_a, grad_stream


class FusedPostMixMerge(torch.autograd.Function):
    """X' = B X + C f: B [..., n, n], X [..., n, C], C [..., n], f [..., C] -> X' [..., n, C].

    One output buffer, no B X or C f temporaries: reads (n+1)C and writes nC per token instead of
    (3n+1)C and 3nC (mHC paper §4). Eager CPU still takes two passes over the output (matmul, then
    an in-place addcmul); on GPU torch.compile or a hand kernel makes it one. Saves B, X, C, f: X is
    the layer input and f the sublayer output, both alive anyway.
    """

    @staticmethod
    def forward(ctx, b, stream, c, f):
        ctx.save_for_backward(b, stream, c, f)
        out = b @ stream
        return out.addcmul_(c.unsqueeze(-1), f.unsqueeze(-2))

    @staticmethod
    def backward(ctx, grad_out):
        b, stream, c, f = ctx.saved_tensors
        grad_b = grad_out @ stream.transpose(-1, -2)                  # [..., n, n]
        grad_stream = b.transpose(-1, -2) @ grad_out                  # [..., n, C]
        grad_c = (grad_out @ f.unsqueeze(-1)).squeeze(-1)             # [..., n]
        grad_f = (c.unsqueeze(-2) @ grad_out).squeeze(-2)             # [..., C]
        return grad_b, grad_stream, grad_c, grad_f


def mhc_layer_fused(stream, sublayer, hc, iters=20):
    """The same layer as mhc_layer_reference, with the fused mixing ops. X [..., n, C] -> [..., n, C]."""
    hc.check_stream(stream)
    a, b, c = mhc_coefficients(stream, hc, iters, optimised=True)
    return FusedPostMixMerge.apply(b, stream, c, sublayer(FusedPreMix.apply(a, stream)))


def mixing_bytes_per_token(n, dim, fused, bytes_per_element=4):
    """Bytes one mHC layer's mixing reads and writes per token: {'coefficients'|'pre_mix'|'post_mix': (read, write)}.

    Counted op by op as eager autograd runs it (naive) or as one pass per operation (fused):
      coefficients  naive: sum of squares (read nC), X/rms (read nC, write nC), projection (read nC)
                    fused (NormThenProject): one pass reads nC (squares and projection together);
                    both write the 2n+n^2 logits
      pre-mix       naive: A_i X_i (read nC, write nC), sum over lanes (read nC, write C); fused: read nC, write C
      post-mix      naive: B X (read nC, write nC), C f (read C, write nC), add (read 2nC, write nC)
                    fused: read nC + C, write nC   (the mHC paper's (3n+1)C -> (n+1)C, 3nC -> nC)
    Small per-token coefficients (A, B, C: n^2 + 2n numbers) are left out: they are O(n^2), not O(nC).
    """
    nc, k = n * dim, 2 * n + n * n
    if fused:
        counts = {"coefficients": (nc, k), "pre_mix": (nc, dim), "post_mix": (nc + dim, nc)}
    else:
        counts = {"coefficients": (3 * nc, nc + k), "pre_mix": (2 * nc, nc + dim),
                  "post_mix": ((3 * n + 1) * dim, 3 * nc)}
    return {op: (r * bytes_per_element, w * bytes_per_element) for op, (r, w) in counts.items()}


# ----------------------------------------------------------------------------- 2. selective recomputation

def default_recompute_block(n, n_layers):
    """L_r ~ sqrt(n L / (n + 2)) (mHC paper §4), at least 1.

    Keeping one block input (nC) per block costs nC L / L_r; rebuilding one block in backward holds
    about (n + 2) C per layer of it (the paper's count: the n-lane state plus F's input and output):
    the sum is smallest at L_r = sqrt(n L / (n + 2)).
    """
    return max(1, round(math.sqrt(n * n_layers / (n + 2))))


def recompute_blocks(start, end, block):
    """Split the layers [start, end) of one pipeline stage into consecutive blocks of at most `block`.

    Returns [(first, stop), ...]. Blocks are cut inside the stage's range, so none crosses a stage
    boundary: a block's input must live on the stage that replays it.
    """
    if block < 1:
        raise ValueError(f"recompute block L_r must be >= 1 layer, got {block}")
    return [(first, min(first + block, end)) for first in range(start, end, block)]


class RecomputedBlock(torch.autograd.Function):
    """Run layers [X_0 -> X_L] keeping X_0 ([..., n, C]) and each F output f_l ([..., C]) only.

    Forward: lane mixing under no_grad (nothing of it is stored); each F runs once with grad enabled on
    a detached leaf input, so F's own graph and saved activations stay. Backward: rebuild X_1..X_{L-1}
    from X_0 and the stored f_l (lane mixing only, F is not called), then walk the layers backwards:
    post-mix -> into F's kept graph (fills F's parameter grads and dF/dh) -> pre-mix and coefficients.
    Parameter gradients accumulate into .grad directly, like reentrant checkpointing: use
    loss.backward(), not torch.autograd.grad, through this block.
    """

    @staticmethod
    def forward(ctx, stream_in, layers, fused, iters):
        ctx.layers, ctx.fused, ctx.iters = layers, fused, iters
        stream, graph = stream_in, []
        for sublayer, hc in layers:
            a, b, c = mhc_coefficients(stream, hc, iters, optimised=True)
            h = FusedPreMix.apply(a, stream).requires_grad_()   # a leaf: F's graph starts here
            with torch.enable_grad():
                f = sublayer(h)
            graph.append((h, f))
            stream = FusedPostMixMerge.apply(b, stream, c, f.detach())
        # The F outputs also go through save_for_backward (detached views of the same storage) so that
        # saved-tensor hooks, and the memory profilers built on them, see everything this block keeps.
        ctx.save_for_backward(stream_in, *[f.detach() for _, f in graph])
        ctx.graph = graph
        return stream

    @staticmethod
    def backward(ctx, grad_stream):
        stream_in = ctx.saved_tensors[0]
        layer_input = layer_mixing_fused if ctx.fused else layer_mixing_reference
        replay = []
        with torch.enable_grad():   # rebuild the block's lane states; F is not called
            stream = stream_in
            for (sublayer, hc), (h_kept, f_kept) in zip(ctx.layers, ctx.graph):
                leaf = stream.detach().requires_grad_()
                f_leaf = f_kept.detach().requires_grad_()
                h, out = layer_input(leaf, hc, f_leaf, ctx.iters)
                replay.append((leaf, h, f_leaf, out))
                stream = out
        for (sublayer, hc), (h_kept, f_kept) in zip(reversed(ctx.layers), reversed(ctx.graph)):
            leaf, h, f_leaf, out = replay.pop()   # popping frees each layer's replay once it is used
            (grad_f,) = torch.autograd.grad(out, f_leaf, grad_stream, retain_graph=True)
            torch.autograd.backward(f_kept, grad_f, inputs=[h_kept, *trainable(sublayer)])
            torch.autograd.backward([out, h], [grad_stream, h_kept.grad], inputs=[leaf, *trainable(hc)])
            grad_stream = leaf.grad
        ctx.graph = ctx.layers = None
        return grad_stream, None, None, None


def trainable(module):
    return [p for p in module.parameters() if p.requires_grad]


def layer_mixing_reference(stream, hc, f, iters):
    """Lane mixing of one layer around a given F output f: returns (h = A X [..., C], B X + C f [..., n, C])."""
    a, b, c = mhc_coefficients(stream, hc, iters)
    h = torch.einsum("...n,...nc->...c", a, stream)
    return h, torch.einsum("...ij,...jc->...ic", b, stream) + c.unsqueeze(-1) * f.unsqueeze(-2)


def layer_mixing_fused(stream, hc, f, iters):
    """layer_mixing_reference with the fused ops."""
    a, b, c = mhc_coefficients(stream, hc, iters, optimised=True)
    return FusedPreMix.apply(a, stream), FusedPostMixMerge.apply(b, stream, c, f)


def run_recomputed_block(stream, layers, fused=True, iters=20):
    """Apply [(sublayer, hc), ...] to stream [..., n, C] keeping only the block input and the F outputs."""
    for _, hc in layers:
        hc.check_stream(stream)
    if not torch.is_grad_enabled():  # nothing to save: a plain forward
        for sublayer, hc in layers:
            stream = mhc_layer_fused(stream, sublayer, hc, iters)
        return stream
    if not stream.requires_grad:     # backward must still run, to fill the parameters' grads
        stream = stream.detach().requires_grad_()
    return RecomputedBlock.apply(stream, list(layers), fused, iters)


# ---- compiled path (torch.compile) ----
#
# The fused autograd.Functions above are the readable version: each says what it reads, writes and
# keeps. Run eagerly they are still a string of separate ops plus Python dispatch, so on a CPU they
# are no faster than the naive layer. Here the same math goes to torch.compile (Inductor: C++ loops
# on CPUs, Triton kernels on GPUs), which fuses each region into a few loops over the lanes.
#
# Hand-written backward or not (one layer's mixing, forward + backward, C = 256, T = 128, batch 2,
# 1 thread, median of 15, on a busy 2-core machine: +-20%):
#     eager, plain autograd (layer_mixing_reference)     54 ms
#     eager, hand-written backward (layer_mixing_fused)  54 ms
#     compiled around the hand-written Functions         27-35 ms  3 graphs: SinkhornReplay's
#                                                                  backward is a graph break
#     compiled plain autograd                            17-19 ms  1 graph forward, 1 backward
# So the hand-written backward hinders the compiler. We compile the plain math (mhc_coefficients and
# the einsums of mhc_layer_reference) and let AOTAutograd derive the backward, which Inductor fuses
# like the forward; its partitioner already recomputes cheap elementwise work instead of saving it.
#
# What is one compiled region: per layer, (1) coefficients with their norm, Sinkhorn and the
# pre-mix, (2) the post-mix + merge; F is compiled on its own. F must stay outside the replayed
# regions (selective recomputation never runs F twice), and the block's bookkeeping (keep X_0 and
# each f, rebuild the lane states in backward) stays in Python, a few calls per layer, as in
# RecomputedBlock. Compiling a whole layer with F inside is the naive variant below: it fuses more
# but stores everything, and one graph per recompute block would have to tell F's saved tensors
# from the mixing's, which torch.compile does not expose.
#
# What it buys, measured (`python benchmarks/bench_mhc.py --curve`: 4 layers, T = 128, batch 2,
# 1 thread, forward + backward, overhead over the residual of the same mode, median of 7 rounds on
# a busy shared 2-core machine, so +-10 points; benchmarks/curve_cpu.json has the whole run):
#     C                        256     512    1024    2048
#     naive, compiled         +35%    +33%     +7%     +7%
#     optimised, compiled     +80%    +50%    +24%    +13%
#     naive, eager           +144%    +76%    +27%    +22%
#     optimised, eager       +184%    +90%    +23%    +27%
# Compiling cuts the overhead 2-4x, but with selective recomputation the optimised path costs MORE
# time than compiling the naive layer: the replay runs the mixing forward a second time, and
# Sinkhorn (20 unrolled rounds on a 4 x 4 matrix per token) costs 6-10 ms per layer here whatever
# C is, as much as a third of F at C = 256. What it buys is memory: 24-33% of naive's extra
# activations. Closing the time gap needs Sinkhorn forward and backward as one per-token kernel
# (TileKernels, Megatron-LM do this), which torch.compile does not make of the unrolled loop.
# Compile time: 1-2 minutes per variant and C on that machine, printed apart from the step times.
#
# Settings: dynamic=False, one graph per shape (no symbolic sizes: a shape change compiles again);
# dynamo's recompile limit is raised from 8 to 64 (every C, grad mode and F type is one more graph
# of the same code), and reaching it raises instead of falling back silently to eager.


def _pre_mix(stream, hc, iters):
    """Coefficients (norm, projection, gates, Sinkhorn) and the pre-mix of one layer: one region.

    stream X [..., n, C] -> (h = A X [..., C], B [..., n, n], C [..., n]).
    """
    a, b, c = mhc_coefficients(stream, hc, iters)
    # the same dtypes as mhc_layer_reference: the pre-mix in the coefficients' dtype
    return (a.unsqueeze(-1) * stream.to(a.dtype)).sum(-2).to(stream.dtype), b, c


def _post_mix(b, stream, c, f):
    """Post-mix + merge, mhc_layer_reference's B X + C f -> [..., n, C], as one loop over C.

    Written as broadcast products and sums over n rather than einsum: einsum becomes a batched
    matmul of n x n by n x C per token, an external call Inductor cannot fuse; this form compiles
    into one pass that reads X and f once and writes X' once (mixing fwd + bwd 10-20% faster).
    """
    b, c = b.to(stream.dtype), c.to(stream.dtype)  # as mhc_layer_reference: the stream's dtype
    mixed = (b.unsqueeze(-1) * stream.unsqueeze(-3)).sum(-2)
    return mixed + c.unsqueeze(-1) * f.unsqueeze(-2)


def _residual_layer(x, sublayer):
    """x + F(x), the baseline layer."""
    return x + sublayer(x)


_COMPILED = {}


def compiled(fn, backend="inductor"):
    """torch.compile(fn) made once per function and backend (graphs cached per shape, grad mode)."""
    if (fn, backend) not in _COMPILED:
        _COMPILED[fn, backend] = torch.compile(fn, backend=backend, dynamic=False)
    return _COMPILED[fn, backend]


class CompiledRecomputedBlock(torch.autograd.Function):
    """RecomputedBlock with compiled mixing: keeps X_0 [..., n, C] and each f_l [..., C] only.

    layers: [(f_l, hc_l), ...] with f_l the (compiled) F. Forward (grad off in here): the mixing
    regions run as inference graphs, nothing of them is stored; each F runs once with grad on a leaf
    input. Backward: rebuild the lane states from X_0 and the kept f_l with the training graphs of
    the same regions, then per layer, last first, two backward calls that each run every compiled
    backward once: post-mix -> F (F's kept graph: its parameter grads and dF/dh), then Sinkhorn,
    coefficients and pre-mix. B and C are cut between the two regions (detached leaves) so that the
    first call cannot run the pre-mix region's backward before dh is known.
    Parameter gradients accumulate into .grad directly: use loss.backward() through this block.
    """

    @staticmethod
    def forward(ctx, stream_in, layers, iters, backend):
        pre_mix, post_mix = compiled(_pre_mix, backend), compiled(_post_mix, backend)
        stream, kept = stream_in, []
        for run_f, hc in layers:
            h, b, c = pre_mix(stream, hc, iters)
            h.requires_grad_()  # a leaf: F's graph starts here
            with torch.enable_grad():
                f = run_f(h)
            kept.append((h, f))
            stream = post_mix(b, stream, c, f.detach())
        # F's outputs also go through save_for_backward (detached views of the same storage), so the
        # saved-tensor hooks that measure activation memory see everything this block keeps.
        ctx.save_for_backward(stream_in, *[f.detach() for _, f in kept])
        ctx.layers, ctx.kept, ctx.iters = layers, kept, iters
        ctx.pre_mix, ctx.post_mix = pre_mix, post_mix
        return stream

    @staticmethod
    def backward(ctx, grad_stream):
        replay, stream = [], ctx.saved_tensors[0]
        with torch.enable_grad():  # rebuild the block's lane states; F is not called
            for (_, hc), (_, f) in zip(ctx.layers, ctx.kept):
                leaf = stream.detach().requires_grad_()
                h, b, c = ctx.pre_mix(leaf, hc, ctx.iters)
                b_cut, c_cut = b.detach().requires_grad_(), c.detach().requires_grad_()
                stream = ctx.post_mix(b_cut, leaf, c_cut, f)  # f carries F's graph
                replay.append((leaf, (h, b, c), (b_cut, c_cut), stream))
        for h_kept, _ in reversed(ctx.kept):
            leaf, pre_outputs, (b_cut, c_cut), out = replay.pop()
            torch.autograd.backward(out, grad_stream)  # post-mix, then F: fills h_kept.grad
            torch.autograd.backward(pre_outputs, (h_kept.grad, b_cut.grad, c_cut.grad))
            grad_stream = leaf.grad
        ctx.layers = ctx.kept = None
        return grad_stream, None, None, None


def run_compiled_block(stream, layers, iters=20, backend="inductor"):
    """Apply [(f, hc), ...] to stream [..., n, C]: compiled mixing, selective recomputation."""
    for _, hc in layers:
        hc.check_stream(stream)
    if not torch.is_grad_enabled():  # nothing to save: a plain forward
        for run_f, hc in layers:
            h, b, c = compiled(_pre_mix, backend)(stream, hc, iters)
            stream = compiled(_post_mix, backend)(b, stream, c, run_f(h))
        return stream
    if not stream.requires_grad:  # backward must still run, to fill the parameters' grads
        stream = stream.detach().requires_grad_()
    return CompiledRecomputedBlock.apply(stream, list(layers), iters, backend)


class CompiledModel:
    """model(idx, targets) with its layers compiled: the same parameters and the same math.

    variant  'optimised' (mHC model, the default): the two mixing regions compiled, selective
                         recomputation in blocks of `recompute` layers (default L_r), F compiled on
                         its own and run once per layer per step (self.f[i] is layer i's F);
             'naive'     (mHC model): each plain autograd layer, mixing and F, compiled whole;
             'residual'  (residual model): each x + F(x) compiled whole.
    F is compiled in all three, so they compare fairly; the embedding and the head stay eager.
    Graphs are compiled on the first call per shape (seconds to minutes): warm up before timing.
    Train/eval mode, dtype, device and grad mode are guarded by torch.compile: a change compiles
    again instead of running a stale graph. backend: torch.compile's ("inductor" fuses; "aot_eager"
    traces the same graphs and derived backward without code generation, for quick checks).
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
        self.f = [torch.compile(s, backend=backend, dynamic=False) for s in model.sublayers]
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, 64)
        torch._dynamo.config.fail_on_recompile_limit_hit = True

    def run_layers(self, stream, start=0, end=None):
        """Layers [start, end) on the stream ([B, T, n, C], or [B, T, C] for the residual)."""
        model, iters = self.model, self.model.cfg.sinkhorn_iters
        end = model.cfg.n_layers if end is None else end
        if self.variant == "residual":
            for sublayer in model.sublayers[start:end]:
                stream = compiled(_residual_layer, self.backend)(stream, sublayer)
        elif self.variant == "naive":
            for sublayer, hc in zip(model.sublayers[start:end], model.hcs[start:end]):
                stream = compiled(mhc_layer_reference, self.backend)(stream, sublayer, hc, iters)
        else:
            for first, stop in recompute_blocks(start, end, self.recompute):
                layers = list(zip(self.f[first:stop], model.hcs[first:stop]))
                stream = run_compiled_block(stream, layers, iters, self.backend)
        return stream

    def __call__(self, idx, targets):
        stream = self.run_layers(self.model.embed_stream(idx))
        return self.model.head_loss(stream, targets)


# ----------------------------------------------------------------------------- the small transformer

class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight


class Attention(nn.Module):
    """F for an attention layer: causal self-attention on its own RMSNorm'd input. [B, T, C] -> [B, T, C]."""

    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm = RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).unflatten(-1, (3, self.n_heads, -1)).unbind(-3)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
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

    hyper=True: each layer is an mHC layer; the embedding is copied into n lanes once (embed_stream)
    and the lanes are averaged once before the head (head_loss). hyper=False: the plain residual
    x' = x + F(x) with the very same F modules, for comparison.
    """

    def __init__(self, cfg, hyper=True):
        super().__init__()
        self.cfg, self.hyper = cfg, hyper
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.sublayers = nn.ModuleList(Attention(cfg) if i % 2 == 0 else MLP(cfg) for i in range(cfg.n_layers))
        self.hcs = nn.ModuleList(HyperConnection(cfg.n_hc, cfg.dim, cfg.gate_init)
                                 for _ in range(cfg.n_layers)) if hyper else None
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def stream_shape(self, batch):
        """The tensor that flows between layers (and pipeline stages): [B, T, n, C], or [B, T, C] for residual."""
        lanes = (self.cfg.n_hc,) if self.hyper else ()
        return (batch, self.cfg.seq_len, *lanes, self.cfg.dim)

    def embed_stream(self, idx):
        """idx [B, T] -> the stream: copied into n lanes here and nowhere else."""
        x = self.embed(idx)
        return x.unsqueeze(-2).expand(*x.shape[:-1], self.cfg.n_hc, x.shape[-1]).contiguous() if self.hyper else x

    def run_layers(self, stream, start, end, fused=False, recompute=0):
        """Apply layers [start, end) to the stream. fused: fused mixing ops. recompute = L_r > 0: blocks of
        L_r layers (cut within [start, end)) run selective recomputation; 0 stores everything."""
        if not self.hyper:
            for sublayer in self.sublayers[start:end]:
                stream = stream + sublayer(stream)
            return stream
        if recompute:
            for first, stop in recompute_blocks(start, end, recompute):
                layers = list(zip(self.sublayers[first:stop], self.hcs[first:stop]))
                stream = run_recomputed_block(stream, layers, fused, self.cfg.sinkhorn_iters)
            return stream
        layer = mhc_layer_fused if fused else mhc_layer_reference
        for sublayer, hc in zip(self.sublayers[start:end], self.hcs[start:end]):
            stream = layer(stream, sublayer, hc, self.cfg.sinkhorn_iters)
        return stream

    def head_loss(self, stream, targets):
        """Collapse the lanes once (their mean), then final norm, head and cross-entropy. -> scalar loss."""
        x = stream.mean(-2) if self.hyper else stream
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())

    def forward(self, idx, targets, fused=False, recompute=0):
        stream = self.run_layers(self.embed_stream(idx), 0, self.cfg.n_layers, fused, recompute)
        return self.head_loss(stream, targets)


# ----------------------------------------------------------------------------- 3. pipeline parallelism (1F1B)

def stage_layers(n_layers, n_stages, stage):
    """Layers [first, stop) held by `stage` of `n_stages`: an equal contiguous share."""
    if n_stages < 1 or n_stages > n_layers or n_layers % n_stages:
        raise ValueError(f"{n_stages} pipeline stages cannot split {n_layers} layers evenly: use a stage "
                         f"count that divides n_layers and is at most n_layers")
    per_stage = n_layers // n_stages
    return stage * per_stage, (stage + 1) * per_stage


def one_f_one_b(n_stages, stage, n_micro):
    """The order in which `stage` runs forwards and backwards: [('F', i) | ('B', i), ...].

    Warm-up: n_stages - stage - 1 forwards fill the pipe; steady state alternates one forward, one
    backward; cool-down drains the backwards. A stage never holds more than n_stages - stage
    micro-batches' activations (GPipe would hold all n_micro).
    """
    if n_micro < n_stages:
        raise ValueError(f"1F1B needs at least as many micro-batches as stages: n_micro={n_micro} < "
                         f"n_stages={n_stages}; raise n_micro or use fewer stages")
    warmup = min(n_stages - stage - 1, n_micro)
    order = [("F", i) for i in range(warmup)]
    for i in range(warmup, n_micro):
        order += [("F", i), ("B", i - warmup)]
    order += [("B", i) for i in range(n_micro - warmup, n_micro)]
    return order


def pipeline_step(model, idx, targets, n_micro, fused=True, recompute=0, overlap=True):
    """One training step's forward and backward over the pipeline stages (the ranks of the default group).

    idx, targets [B, T] (the same on every rank; only stage 0 reads idx, only the last reads targets).
    Fills .grad of this stage's parameters (the mean loss over the whole batch, as in one process) and
    returns (loss on the last stage else None, stats). Streams [B/n_micro, T, n, C] go forward and their
    gradients backward; every receive is posted one micro-batch ahead and every send is asynchronous,
    so the transfers run while the stage computes. overlap=False is the baseline that hides nothing:
    each receive is posted only when its data is needed and waited at once (sends stay asynchronous, as
    any deadlock-free 1F1B exchange must: two neighbours may send to each other at the same moment).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    stage = dist.get_rank() if dist.is_initialized() else 0
    cfg = model.cfg
    # every check before the first send or receive: a rank that fails alone would leave its peers waiting
    first, stop = stage_layers(cfg.n_layers, world, stage)
    schedule = one_f_one_b(world, stage, n_micro)
    if idx.shape != targets.shape or idx.dim() != 2 or idx.shape[1] != cfg.seq_len:
        raise ValueError(f"idx and targets must both be [batch, seq_len={cfg.seq_len}], got "
                         f"{tuple(idx.shape)} and {tuple(targets.shape)}")
    if idx.shape[0] % n_micro:
        raise ValueError(f"batch {idx.shape[0]} does not split into n_micro={n_micro} equal micro-batches")
    if recompute and recompute < 1:
        raise ValueError(f"recompute block L_r must be >= 1 layer (or 0 for none), got {recompute}")
    last = stage == world - 1
    device = idx.device
    shape = model.stream_shape(idx.shape[0] // n_micro)
    idx_micro, tgt_micro = idx.chunk(n_micro), targets.chunk(n_micro)
    recv_fwd, recv_bwd, sends, held_in, held_out = {}, {}, [], {}, {}
    stats = {"bytes_sent_forward": 0, "bytes_sent_backward": 0, "wait_s": 0.0}
    loss = torch.zeros((), device=device)

    def post_recv(table, i, peer):
        if 0 <= peer < world and i < n_micro and i not in table:
            buffer = torch.empty(shape, device=device)
            table[i] = (buffer, dist.irecv(buffer, src=peer, tag=i))

    def take(table, i):
        buffer, work = table.pop(i)
        began = time.perf_counter()
        work.wait()
        stats["wait_s"] += time.perf_counter() - began
        return buffer

    def send(tensor, peer, i, key):
        tensor = tensor.detach().contiguous()
        sends.append((dist.isend(tensor, dst=peer, tag=i), tensor))   # keep the tensor alive until sent
        stats[key] += tensor.numel() * tensor.element_size()

    if overlap and stage > 0:
        post_recv(recv_fwd, 0, stage - 1)
    if overlap and not last:
        post_recv(recv_bwd, 0, stage + 1)
    for kind, i in schedule:
        if kind == "F":
            if stage == 0:
                stream = model.embed_stream(idx_micro[i])
            else:
                if overlap:
                    post_recv(recv_fwd, i + 1, stage - 1)    # the next micro-batch arrives while we compute
                post_recv(recv_fwd, i, stage - 1)
                stream = take(recv_fwd, i).requires_grad_()
            held_in[i] = stream
            out = model.run_layers(stream, first, stop, fused, recompute)
            if last:
                micro_loss = model.head_loss(out, tgt_micro[i]) / n_micro
                loss += micro_loss.detach()
                held_out[i] = micro_loss
            else:
                send(out, stage + 1, i, "bytes_sent_forward")
                held_out[i] = out
        else:
            if last:
                held_out.pop(i).backward()
            else:
                if overlap:
                    post_recv(recv_bwd, i + 1, stage + 1)
                post_recv(recv_bwd, i, stage + 1)
                held_out.pop(i).backward(take(recv_bwd, i))
            stream = held_in.pop(i)
            if stage > 0:
                send(stream.grad, stage - 1, i, "bytes_sent_backward")
    for work, _ in sends:
        work.wait()
    return (loss if last else None), stats


# ----------------------------------------------------------------------------- demo

def saved_activation_bytes(model, run):
    """Bytes of distinct storages autograd holds for backward while run() builds the graph (parameters excluded)."""
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


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _count_f_calls(model):
    calls = [0]
    handles = [m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in model.sublayers]
    return calls, handles


def synthetic_batch(cfg, batch, generator, device):
    """Learnable toy data [batch, T + 1]: each row counts up from a random start by a random stride 1..3."""
    start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=generator)
    stride = torch.randint(1, 4, (batch, 1), generator=generator)
    return ((start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size).to(device)


def train_single(cfg, variant, steps, batch, device, seed=0):
    """Train one variant ('residual' | 'naive' | 'optimised') a few steps; return what it measured."""
    torch.manual_seed(seed)
    model = Transformer(cfg, hyper=variant != "residual").to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    options = dict(fused=True, recompute=default_recompute_block(cfg.n_hc, cfg.n_layers)) if variant == "optimised" else {}
    calls, handles = _count_f_calls(model)
    losses, times, act_bytes = [], [], 0
    for step in range(steps + 1):
        data = synthetic_batch(cfg, batch, gen, device)
        _sync(device)
        began = time.perf_counter()
        loss, act_bytes = saved_activation_bytes(model, lambda: model(data[:, :-1], data[:, 1:], **options))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if step:  # step 0 warms up allocators and caches
            times.append(time.perf_counter() - began)
        losses.append(loss.item())
    for h in handles:
        h.remove()
    return {"loss0": losses[0], "loss": losses[-1], "act_MiB": act_bytes / 2**20,
            "step_ms": 1e3 * sorted(times)[len(times) // 2], "f_calls_per_step": calls[0] / (steps + 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600))
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    cfg = Config(dim=args.dim, n_layers=args.layers, n_heads=max(1, args.dim // 32))
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"mHC demo: {cfg.n_layers} layers, C={cfg.dim}, n_hc={cfg.n_hc}, T={cfg.seq_len}, batch {args.batch}, "
        f"{args.steps} steps, device {device.type}, {world} process(es)")
    if rank == 0:  # the one-process comparison; other ranks wait for the pipeline part
        l_r = default_recompute_block(cfg.n_hc, cfg.n_layers)
        say(f"optimised = fused mixing + selective recomputation (L_r = {l_r}); memory = bytes saved for backward\n")
        say(f"{'variant':<10} {'loss start':>10} {'loss end':>9} {'saved act MiB':>14} {'step ms':>9} {'F calls/step':>13}")
        base = None
        for variant in ("residual", "naive", "optimised"):
            r = train_single(cfg, variant, args.steps, args.batch, device)
            base = base or r
            say(f"{variant:<10} {r['loss0']:>10.4f} {r['loss']:>9.4f} {r['act_MiB']:>14.2f} {r['step_ms']:>9.1f} "
                f"{r['f_calls_per_step']:>13.0f}   (x{r['step_ms'] / base['step_ms']:.2f} time, "
                f"x{r['act_MiB'] / base['act_MiB']:.2f} memory)")
        naive, fused = mixing_bytes_per_token(cfg.n_hc, cfg.dim, False), mixing_bytes_per_token(cfg.n_hc, cfg.dim, True)
        say("\nlane-mixing bytes per token per layer, read/write (fp32):")
        for op in naive:
            say(f"  {op:<13} naive {naive[op][0]:>6}/{naive[op][1]:<6} fused {fused[op][0]:>6}/{fused[op][1]:<6}")
    if distributed:
        dist.barrier()
    n_micro = 2 * world
    say(f"\npipeline: {world} stage(s), 1F1B over {n_micro} micro-batches, async send/recv posted ahead")
    for hyper in (False, True):
        torch.manual_seed(0)
        model = Transformer(cfg, hyper=hyper).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(1)
        losses, waited, began = [], 0.0, time.perf_counter()
        for step in range(args.steps):
            data = synthetic_batch(cfg, args.batch, gen, device)
            loss, stats = pipeline_step(model, data[:, :-1], data[:, 1:], n_micro, fused=True,
                                        recompute=default_recompute_block(cfg.n_hc, cfg.n_layers // world))
            opt.step()
            opt.zero_grad(set_to_none=True)
            waited += stats["wait_s"]
            if loss is not None:
                losses.append(loss.item())
        name = "mHC" if hyper else "residual"
        if rank == world - 1:
            print(f"  {name:<9} loss {losses[0]:.4f} -> {losses[-1]:.4f} (last stage loss)", flush=True)
        if distributed:
            dist.barrier()
        if world > 1 and rank == 0:
            print(f"  {name:<9} bytes sent per step across each stage boundary: {stats['bytes_sent_forward'] / 2**20:.3f} "
                  f"MiB forward + the same backward; stage 0 waited on receives (bubble + transfer) "
                  f"{1e3 * waited / args.steps:.1f} ms of {1e3 * (time.perf_counter() - began) / args.steps:.1f} ms "
                  f"per step", flush=True)
        if distributed:
            dist.barrier()
    if distributed:
        gc.collect()  # drop cycles that still reach gloo state now, not during interpreter shutdown (it can abort)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
