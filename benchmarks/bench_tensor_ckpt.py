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
FLOPs (FlopCounterMode over backward, minus the plain backward's), median step time (forward + backward,
timed without any recorder, variants interleaved so machine noise hits all alike). Gradients of every
variant are checked against the plain run before anything is timed.
"""
import argparse
import functools
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
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


def backward_flops(fn, x, grad):
    # Count forward too and subtract it: SAC replays its forward under the modes active in forward.
    with tc.count_flops() as counter:
        out = fn(x)
        forward = counter.get_total_flops()
        out.backward(grad)
    return counter.get_total_flops() - forward


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=7)
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

    base_flops = backward_flops(stack, x, grad)
    rows = {}
    for name, fn in fns.items():
        held, peak, _ = memory(stack, fn, x, grad)
        rows[name] = dict(held=held, peak=peak, flops=backward_flops(fn, x, grad) - base_flops, times=[])
    stack.zero_grad(set_to_none=True)

    for name, fn in fns.items():  # warm-up
        step(fn, x, grad)
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            step(fn, x, grad)
            rows[name]["times"].append(time.perf_counter() - start)
        stack.zero_grad(set_to_none=True)

    sac = rows["SAC"]
    print()
    print(f"{'variant':<12} {'activations':>12} {'act+temp peak':>14} {'recompute':>11} {'step (median)':>14}"
          f" {'vs none':>8} {'vs SAC':>7}  grads == none")
    for name, r in rows.items():
        t = statistics.median(r["times"])
        print(f"{name:<12} {r['held'] / MiB:>8.2f} MiB {r['peak'] / MiB:>10.2f} MiB "
              f"{r['flops'] / 1e9:>6.2f} GFLOP {t * 1e3:>11.1f} ms "
              f"{t / statistics.median(rows['none']['times']):>7.3f}x "
              f"{t / statistics.median(sac['times']):>6.3f}x  {'bitwise' if exact[name] else 'NO'}")
    ours = rows["tensor_ckpt"]
    t_ours, t_sac = statistics.median(ours["times"]), statistics.median(sac["times"])
    print()
    print(f"target: tensor_ckpt activations <= SAC's: {ours['held'] <= sac['held']} "
          f"({ours['held'] / MiB:.2f} vs {sac['held'] / MiB:.2f} MiB); recompute FLOPs <= SAC's: "
          f"{ours['flops'] <= sac['flops']} ({ours['flops']} vs {sac['flops']}); step time within 5% of "
          f"SAC's: {t_ours <= 1.05 * t_sac} ({t_ours / t_sac:.3f}x, {reps} interleaved reps, median)")


if __name__ == "__main__":
    main()
