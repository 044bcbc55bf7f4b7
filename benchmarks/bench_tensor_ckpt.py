"""Tensor-level checkpointing against PyTorch's own, side by side in one run (V4 §3.4.4).

    .venv/bin/python benchmarks/bench_tensor_ckpt.py            # about a minute on 2 CPU cores
    .venv/bin/python benchmarks/bench_tensor_ckpt.py --quick    # smaller, for a smoke test

Model (documented size): 4 pre-norm transformer layers (tensor_ckpt.Block: LayerNorm, causal SDPA
attention, GELU MLP 4x), C = 256, 4 heads, T = 256, batch 8, fp32, CPU eager. Four variants:
  none          no checkpointing
  module        torch.utils.checkpoint around every layer (non-reentrant): keep only layer inputs
  SAC           selective activation checkpointing per layer, policy "save every matmul and attention
                output, recompute the rest" (create_selective_checkpoint_contexts)
  tensor_ckpt   the V4-style marks in Block: forget the two norm outputs and the GELU output
Columns: activation bytes held at the end of forward (memory_timeline: storages made in forward and
alive at its end), peak of activations + backward temporaries (recomputation lives there), recompute
FLOPs (FlopCounterMode over backward, minus the plain backward's), the extra aten ops the backward runs and
the extra bytes it allocates (the same subtraction; noise-free measures of recompute work, including
each scheme's own bookkeeping ops), median step time (forward + backward,
timed without any recorder, variants interleaved so machine noise hits all alike): the median wall
clock, and the minimum of the process's CPU time: on a shared machine other jobs only ever slow a step
down, so the least-disturbed run is the best estimate (timeit's advice); the ratios and the target line
use it. Gradients of every variant are checked against the plain run before anything is timed.
"""
import argparse
import functools
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tensor_ckpt as tc  # noqa: E402
from memory_timeline import MemoryTimeline  # noqa: E402

MiB = 2 ** 20
aten = torch.ops.aten
MATMULS = [aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default,
           aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_efficient_attention.default]


class PerLayer(nn.Module):
    """Wrap each layer of a stack in torch.utils.checkpoint, optionally with a SAC policy."""

    def __init__(self, stack, context_fn=None):
        super().__init__()
        self.stack, self.context_fn = stack, context_fn

    def forward(self, x):
        for layer in self.stack:
            kwargs = dict(context_fn=self.context_fn) if self.context_fn else {}
            x = checkpoint(layer, x, use_reentrant=False, **kwargs)
        return x


def variants(stack, x):
    return {
        "none": stack,
        "module": PerLayer(stack),
        "SAC": PerLayer(stack, functools.partial(create_selective_checkpoint_contexts, MATMULS)),
        "tensor_ckpt": tc.checkpoint_tensors(stack, (x,)),
    }


def step(fn, x, grad):
    out = fn(x)
    out.backward(grad)


def grads(stack, fn, x, grad):
    stack.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    step(fn, x, grad)
    return [p.grad.clone() for p in stack.parameters()] + [x.grad]


def memory(stack, fn, x, grad):
    stack.zero_grad(set_to_none=True)  # gradients appear in backward, as in a training step
    tl = MemoryTimeline(model=stack, name="step")
    tl.tag([x, grad, *stack.buffers()], "other")
    with tl.record():
        with tl.phase("forward", 0):
            out = fn(x)
        with tl.phase("backward", 0):
            out.backward(grad)
            del out
    stack.zero_grad(set_to_none=True)
    peak = int((tl.series("activations") + tl.series("temporaries")).max())
    return tl.peak("activations", step=0, phase="forward"), peak, tl


class OpCounter(TorchDispatchMode):
    """aten ops run, and bytes of the storages they allocate: a noise-free measure of work."""

    def __init__(self):
        super().__init__()
        self.ops = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tc._tensors_in((args, kwargs))}
        self.ops += 1
        self.bytes += sum(t.untyped_storage().nbytes() for t in tc._tensors_in(out)
                          if t.untyped_storage().data_ptr() not in inputs)
        return out


def backward_work(fn, x, grad):
    """(FLOPs, aten ops, bytes allocated) of one backward."""
    # Count forward too and subtract it: SAC replays its forward under the modes active in forward.
    with tc.count_flops() as counter, OpCounter() as ops:
        out = fn(x)
        forward = counter.get_total_flops(), ops.ops, ops.bytes
        out.backward(grad)
    return counter.get_total_flops() - forward[0], ops.ops - forward[1], ops.bytes - forward[2]


def backward_flops(fn, x, grad):
    return backward_work(fn, x, grad)[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    dim, heads, seq, batch, layers = (64, 4, 64, 4, 2) if args.quick else (256, 4, 256, 8, 4)
    reps = 2 if args.quick else args.reps
    torch.manual_seed(0)
    stack = nn.Sequential(*[tc.Block(dim, heads) for _ in range(layers)])
    x = torch.randn(batch, seq, dim, requires_grad=True)
    grad = torch.randn(batch, seq, dim)
    fns = variants(stack, x)
    print(f"model: {layers} layers, C={dim}, {heads} heads, T={seq}, batch {batch}, fp32, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(fns["tensor_ckpt"].plan)

    reference = grads(stack, stack, x, grad)
    exact = {name: all(torch.equal(a, b) for a, b in zip(reference, grads(stack, fn, x, grad)))
             for name, fn in fns.items()}

    base = backward_work(stack, x, grad)
    rows = {}
    for name, fn in fns.items():
        held, peak, _ = memory(stack, fn, x, grad)
        flops, ops, written = (a - b for a, b in zip(backward_work(fn, x, grad), base))
        rows[name] = dict(held=held, peak=peak, flops=flops, ops=ops, written=written, times=[], cpu=[])
    stack.zero_grad(set_to_none=True)

    for name, fn in fns.items():  # warm-up
        step(fn, x, grad)
    for _ in range(reps):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            step(fn, x, grad)
            rows[name]["times"].append(time.perf_counter() - start)
            rows[name]["cpu"].append(time.process_time() - start_cpu)
        stack.zero_grad(set_to_none=True)

    med = {name: (statistics.median(r["times"]), min(r["cpu"])) for name, r in rows.items()}
    print()
    print(f"{'variant':<12} {'activations':>12} {'act+temp peak':>14} {'recompute':>11} {'re-run ops':>10} "
          f"{'re-written':>11} {'wall (median)':>14}"
          f" {'CPU (min)':>11} {'vs none':>8} {'vs SAC':>7}  grads == none")
    for name, r in rows.items():
        wall, cpu = med[name]
        print(f"{name:<12} {r['held'] / MiB:>8.2f} MiB {r['peak'] / MiB:>10.2f} MiB "
              f"{r['flops'] / 1e9:>6.2f} GFLOP {r['ops']:>10d} {r['written'] / MiB:>7.2f} MiB "
              f"{wall * 1e3:>11.1f} ms {cpu * 1e3:>8.1f} ms "
              f"{cpu / med['none'][1]:>7.3f}x {cpu / med['SAC'][1]:>6.3f}x  {'bitwise' if exact[name] else 'NO'}")
    ours, sac = rows["tensor_ckpt"], rows["SAC"]
    ratio = med["tensor_ckpt"][1] / med["SAC"][1]
    print()
    print(f"target: tensor_ckpt activations <= SAC's: {ours['held'] <= sac['held']} "
          f"({ours['held'] / MiB:.2f} vs {sac['held'] / MiB:.2f} MiB); recompute FLOPs <= SAC's: "
          f"{ours['flops'] <= sac['flops']} ({ours['flops']} vs {sac['flops']}); step time within 5% of "
          f"SAC's: {ratio <= 1.05} (min CPU time {ratio:.3f}x, median wall "
          f"{med['tensor_ckpt'][0] / med['SAC'][0]:.3f}x; {reps} interleaved reps)")


if __name__ == "__main__":
    main()
