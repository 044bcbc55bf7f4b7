# %% [markdown]
# # Tensor-level activation checkpointing (DeepSeek-V4 §3.4.4)
#
# `torch.utils.checkpoint` decides per region: keep everything inside it, or recompute all of it.
# Selective activation checkpointing (SAC) decides per operator type. V4 decides per **tensor**: the
# author writes `forget(x)` on the cheap, large tensors (norm outputs, activation-function outputs) and
# keeps the matmul outputs. `tensor_ckpt.py` traces the forward with TorchFX on example inputs, finds each
# forgotten tensor's minimal recompute subgraph, and at run time replaces the forgotten storage in the
# autograd graph by a handle; the first gradient that needs it recomputes it, once.
#
# This notebook shows the traced graph with the plan drawn on it, the memory timelines of the four ways to
# checkpoint side by side, and what each choice of annotation saves and costs.

# %%
import sys

import matplotlib.pyplot as plt
import torch
import torch.nn as nn

sys.path[:0] = ["benchmarks"]
import bench_tensor_ckpt as bench
import tensor_ckpt as tc
from memory_timeline import MiB, plot_timelines

plt.rcParams["figure.dpi"] = 72
torch.set_num_threads(2)
torch.manual_seed(0)
C, HEADS, T, BATCH = 128, 4, 128, 4
block = tc.Block(C, HEADS)
x = torch.randn(BATCH, T, C, requires_grad=True)
ckpt = tc.checkpoint_tensors(block, (x,))
print(ckpt.plan)

# %% [markdown]
# ## The traced graph and the plan
# One layer's FX graph in execution order, top to bottom; arcs are data edges. Red: a forgotten storage
# (with its aliases); orange ring: an op the backward re-runs; green: the kept tensors a recompute starts
# from. Every recompute here is one op deep and starts from a tensor autograd saves anyway (the norm's
# input, fc1's output), and none of them is a matmul.

# %%
def draw_plan(gm, plan, ax):
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    row = {n: i for i, n in enumerate(nodes)}
    forgotten = {name for u in plan.units for name in u.members}
    rerun = {n for u in plan.units for n in u.nodes}
    frontier = {f for u in plan.units for f in u.frontier}
    for n in nodes:
        for m in n.all_input_nodes:
            if m in row:
                span = row[n] - row[m]
                ax.add_patch(plt.matplotlib.patches.Arc((0, (row[n] + row[m]) / 2), width=0.35 * span,
                                                         height=span, theta1=-90, theta2=90, lw=0.6, color="0.6"))
    for n in nodes:
        face = "#c44e52" if n.name in forgotten else "#55a868" if n in frontier else "0.85"
        if n in rerun:
            ax.scatter(0, row[n], s=170, facecolor="none", edgecolor="#dd8452", lw=2.5, zorder=3)
        ax.scatter(0, row[n], s=50, color=face, zorder=4)
        what = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        ax.text(-0.25, row[n], f"{n.name}  ({what})", ha="right", va="center", fontsize=8)
    widest = max((row[n] - row[m] for n in nodes for m in n.all_input_nodes if m in row), default=1)
    ax.set_ylim(len(nodes), -1)
    ax.set_xlim(-4.0, 0.2 * widest + 0.5)
    ax.axis("off")


fig, ax = plt.subplots(figsize=(7, 9))
draw_plan(ckpt.gm, ckpt.plan, ax)
ax.set_title("Block, traced: red forgotten, orange ring recomputed, green kept inputs of a recompute")
plt.show()

# %% [markdown]
# ## Four ways to checkpoint, one step each
# Two layers of the same block. Activations (red) are what forward leaves alive for backward; backward
# temporaries (purple) include every recompute. Module-level checkpointing keeps almost nothing and
# re-runs whole layers (the tall purple spikes); SAC keeps every matmul output, including those no
# gradient needs (the projection and fc2 outputs); tensor_ckpt keeps only what autograd needs, minus the
# forgotten tensors, and its backward spikes are the small GELU and norm recomputes.

# %%
stack = nn.Sequential(*[tc.Block(C, HEADS) for _ in range(2)])
grad = torch.randn(BATCH, T, C)
fns = bench.variants(stack, x)
timelines, rows = [], {}
base_flops = bench.backward_flops(stack, x, grad)
for name, fn in fns.items():
    held, peak, tl = bench.memory(stack, fn, x, grad)
    timelines.append(tl)
    rows[name] = (held, peak, bench.backward_flops(fn, x, grad) - base_flops)
fig = plot_timelines(timelines, titles=list(fns), width=3.6, height=3.0)
plt.show()
print(f"{'variant':<12} {'activations':>12} {'act+temp peak':>14} {'recompute':>12}")
for name, (held, peak, flops) in rows.items():
    print(f"{name:<12} {held / MiB:>8.2f} MiB {peak / MiB:>10.2f} MiB {flops / 1e6:>8.1f} MFLOP")

# %% [markdown]
# ## What each annotation saves and costs
# The same layer with different choices of what to forget, given by node name (no edit to the model).
# Memory saved is measured (bytes alive after forward, plain minus checkpointed), FLOPs are measured over
# the backward. Cheap tensors (norms, GELU) move right at zero cost; forgetting a matmul output (fc1, qkv)
# or the attention output buys memory with real recompute; the attention output's reshape is a *view* of it,
# so forgetting the reshape is forgetting attention itself.

# %%
choices = {
    "norms": ["norm1", "norm2"],
    "gelu": ["gelu"],
    "V4: norms + gelu": ["norm1", "norm2", "gelu"],
    "reshape (a view!)": ["reshape"],
    "+ fc1 output": ["norm1", "norm2", "gelu", "fc1"],
    "+ qkv output": ["norm1", "norm2", "gelu", "qkv"],
    "+ attention out": ["norm1", "norm2", "gelu", "scaled_dot_product_attention"],
}
plain_bytes, _ = tc.activation_bytes(block, x)
plain_flops = bench.backward_flops(block, x, torch.ones(BATCH, T, C))
points = {}
for label, names in choices.items():
    c = tc.checkpoint_tensors(block, (x,), forget=names)
    held, _ = tc.activation_bytes(c, x)
    flops = bench.backward_flops(c, x, torch.ones(BATCH, T, C)) - plain_flops
    points[label] = ((plain_bytes - held) / MiB, flops / 1e6)
    print(f"{label:<20} saved {(plain_bytes - held) / MiB:5.2f} MiB of {plain_bytes / MiB:.2f}   "
          f"recompute {flops / 1e6:6.1f} MFLOP   (plan: {c.plan.bytes_freed / MiB:.2f} MiB, "
          f"{c.plan.recompute_flops / 1e6:.1f} MFLOP)")

fig, ax = plt.subplots(figsize=(6.5, 3.8))
for label, (saved, flops) in points.items():
    ax.scatter(flops, saved, color="#c44e52" if label.startswith("V4") else "#4c72b0")
    ax.annotate(label, (flops, saved), textcoords="offset points", xytext=(5, 3), fontsize=8)
ax.set_xlabel("recompute FLOPs per backward (MFLOP, measured)")
ax.set_ylabel("activation memory saved (MiB, measured)")
ax.set_title("One layer: memory saved vs recompute, per annotation")
ax.grid(alpha=0.3)
plt.show()
