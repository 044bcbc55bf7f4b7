"""mhc.py under torch.compile: the same pure kernels and the same recompute bookkeeping, compiled.

Run eagerly, mhc.py's mixing kernels are still a string of separate ops plus Python dispatch. Here
the same functions go to torch.compile (Inductor: C++ loops on CPUs, Triton kernels on GPUs), which
fuses each into a few loops over the lanes. What is compiled, and why:
  - the six kernels (mix_in, mix_out, their backwards, the head's collapse and its
    backward), each one region. They are pure functions with their backward written out (Sinkhorn's
    replayed under autograd), so every region is an inference graph: nothing saved, nothing for
    AOTAutograd to partition. The parameters are arguments, so one graph serves every layer of a
    shape.
  - F on its own (torch.compile of each sublayer), run once per layer per step; the residual model
    compiles x + F(x) per layer, so F is compiled in every variant alike.
  - not an autograd.Function with a hand-written backward (dynamo traces its forward, not its
    backward), and not a whole layer or recompute block: F would sit inside the region, and one
    graph cannot keep F's autograd graph while running the mixing without one. Compiling a whole
    plain layer is the naive variant: its partitioner chooses what to keep.
The block's bookkeeping (keep X_0, each f and the coefficients, rebuild, walk backwards) stays in
Python: mhc.RecomputedBlock, a few calls per layer.

The kernels are mhc.py's own functions (mhc.EAGER), handed to torch.compile as they are; the one
place they differ under the compiler is mhc.lanes_matmul, which writes its small products as loops
Inductor fuses (torch.compiler.is_compiling). Sinkhorn is mhc.sinkhorn_knopp itself, the graded
function, and its backward a replay of it: written once, so no second copy of it sits beside the
assignment. compiled_kernels hands the kernels over as an mhc.Kernels, the object mhc.py's block
and model take in place of mhc.EAGER.

Settings: dynamic=False, one graph per shape (a shape change compiles again); dynamo's recompile
limit is raised to 64 (every C, grad mode and F type is one more graph of the same code), and
reaching it raises instead of falling back silently to eager. Timings: benchmarks/bench_mhc.py.
"""

import dataclasses

import torch

import mhc

_COMPILED = {}


def compiled(fn, backend="inductor"):
    """torch.compile(fn) made once per function and backend (graphs cached per shape, grad mode)."""
    if (fn, backend) not in _COMPILED:
        _COMPILED[fn, backend] = torch.compile(fn, backend=backend, dynamic=False)
    return _COMPILED[fn, backend]


KERNELS = tuple(field.name for field in dataclasses.fields(mhc.Kernels))


def compiled_kernels(backend="inductor"):
    """mhc.Kernels of mhc.EAGER's kernels, each compiled: what mhc.Transformer(kernels=...) and
    mhc.RecomputedBlock take in place of mhc.EAGER (compiled functions and graphs are cached)."""
    return mhc.Kernels(**{name: compiled(getattr(mhc.EAGER, name), backend) for name in KERNELS})


def residual_layer(x, sublayer):
    """x + F(x), the baseline layer."""
    return x + sublayer(x)


class CompiledModel:
    """model(idx, targets) with its layers compiled: the same parameters and the same math.

    variant (mHC models, mhc.VARIANTS; residual models take None):
      "optimised"  the default: mhc.RecomputedBlock in blocks of `block` layers (default L_r) with
                   compiled_kernels(); F compiled on its own, run once per layer per step
                   (self.f[i] is layer i's F);
      "fused"      the same in blocks of one layer;
      "naive"      each plain autograd layer, mixing and F, compiled whole.
    A residual model compiles each x + F(x) whole. The head (norm, logits, loss) is compiled in
    every variant; fused and optimised fold the lane collapse into their last block (compiled
    kernels), naive collapses with the plain HyperHead inside the compiled head_loss. Graphs
    compile on the first call per shape: warm up before timing. Train/eval mode, dtype, device
    and grad mode are guarded by torch.compile. backend: torch.compile's ("aot_eager" traces the
    same graphs without code generation, for quick checks).
    """

    def __init__(self, model, variant=None, block=None, backend="inductor"):
        if model.hyper:
            variant = variant or "optimised"
            mhc.check_variant(variant, block)
        elif variant is not None:
            raise ValueError(f"variant {variant!r} needs an mHC model built with hyper=True")
        cfg = model.cfg
        self.block = (
            1
            if variant == "fused"
            else block or mhc.default_recompute_block(cfg.n_hc, cfg.n_layers)
        )
        self.model, self.variant, self.backend = model, variant, backend
        self.kernels = compiled_kernels(backend)
        self.f = [torch.compile(s, backend=backend, dynamic=False) for s in model.sublayers]
        self.head_loss = torch.compile(model.head_loss, backend=backend, dynamic=False)
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, 64)
        torch._dynamo.config.fail_on_recompile_limit_hit = True

    def run_layers(self, stream, start=0, end=None, final=False):
        """Layers [start, end) on the stream ([B, T, n, C], or [B, T, C] for the residual).
        final: end with the lanes collapsed (fused, optimised: folded into the last block;
        naive: left to head_loss, as mhc.Transformer.head_loss does)."""
        model, iters = self.model, self.model.cfg.sinkhorn_iters
        end = model.cfg.n_layers if end is None else end
        if not model.hyper:
            for sublayer in model.sublayers[start:end]:
                stream = compiled(residual_layer, self.backend)(stream, sublayer)
            return stream
        if self.variant == "naive":
            layer = compiled(mhc.mhc_layer_reference, self.backend)
            for sublayer, hc in zip(model.sublayers[start:end], model.hcs[start:end]):
                stream = layer(stream, sublayer, hc, iters)
            return stream
        layers = list(zip(self.f[start:end], model.hcs[start:end]))
        head = model.hyper_head if final else None
        return mhc.run_recomputed_layers(stream, layers, self.block, iters, self.kernels, head)

    def __call__(self, idx, targets):
        final = self.variant in ("fused", "optimised")
        return self.head_loss(self.run_layers(self.model.embed_stream(idx), final=final), targets)
