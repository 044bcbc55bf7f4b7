# %% [markdown]
# # Tensor-level activation checkpointing (DeepSeek-V4 §3.4.4)
#
# `torch.utils.checkpoint` decides per region: keep everything inside it, or recompute all of it.
# Selective activation checkpointing (SAC) decides per operator type. V4 decides per **tensor**:
# the author writes `forget(x)` on the cheap, large tensors (norm outputs, activation-function
# outputs) and keeps the matmul outputs. `tensor_ckpt.py` traces the forward with TorchFX on example
# inputs, finds each forgotten tensor's minimal recompute subgraph, and at run time replaces the
# forgotten storage in the autograd graph by a handle; the first gradient that needs it recomputes
# it, once.
#
# This notebook shows the traced graph with the plan drawn on it, the memory timelines of four ways
# to checkpoint, and what each choice of annotation saves and costs.

# %%
import time
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn as nn

import tensor_ckpt as tc
from benchmarks import bench_tensor_ckpt as bench
from benchmarks.ckpt_meters import activation_bytes
from memory.memory_timeline import MiB
from memory.plots import plot_timeline

plt.rcParams.update({"figure.dpi": 110, "font.size": 11})
torch.set_num_threads(2)
torch.manual_seed(0)
C, HEADS, T, BATCH = 128, 4, 128, 4
block = tc.Block(C, HEADS)
x = torch.randn(BATCH, T, C, requires_grad=True)
ckpt = tc.checkpoint_tensors(block, (x,))
print(ckpt.plan)

# %% [markdown]
# ## The traced graph and the plan
# One layer's FX graph in execution order, top to bottom; arcs are data edges. Red: a forgotten
# storage (with its aliases); orange ring: an op the backward re-runs; green: the kept tensors a
# recompute starts from. Every recompute here is one op deep and starts from a tensor autograd
# saves anyway (the norm's input, fc1's output), and none of them is a matmul.


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
                arc = plt.matplotlib.patches.Arc(
                    (0, (row[n] + row[m]) / 2), width=0.35 * span, height=span,
                    theta1=-90, theta2=90, lw=0.7, color="0.6")  # fmt: skip
                ax.add_patch(arc)
    for n in nodes:
        face = "#c44e52" if n.name in forgotten else "#55a868" if n in frontier else "0.8"
        if n in rerun:
            ax.scatter(0, row[n], s=190, facecolor="none", edgecolor="#dd8452", lw=2.5, zorder=3)
        ax.scatter(0, row[n], s=60, color=face, zorder=4)
        what = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", n.target)
        ax.text(-0.25, row[n], f"{n.name}  ({what})", ha="right", va="center", fontsize=10)
    widest = max((row[n] - row[m] for n in nodes for m in n.all_input_nodes if m in row), default=1)
    ax.set_ylim(len(nodes), -1)
    ax.set_xlim(-4.5, 0.2 * widest + 0.5)
    ax.axis("off")


fig, ax = plt.subplots(figsize=(10, 8))
draw_plan(ckpt.gm, ckpt.plan, ax)
ax.set_title(
    "Block, traced: red forgotten, orange ring recomputed, green kept inputs of a recompute"
)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Four ways to checkpoint, one step each
# Two layers of the same block, on one memory scale. Activations are what forward leaves alive for
# backward; backward temporaries include every recompute. Module-level checkpointing keeps almost
# nothing and re-runs whole layers; SAC keeps every matmul output, including those no gradient
# needs (the projection and fc2 outputs); tensor_ckpt keeps what autograd needs minus the forgotten
# tensors, and its backward recomputes only the small GELU and norm outputs. The table under the
# plot gives the numbers.

# %%
# The benchmark's variants, memory recording and work counters, so the notebook shows what
# `benchmarks/bench_tensor_ckpt.py` measures (SAC's policy saves the matmul and attention outputs).
start = time.perf_counter()
stack = nn.Sequential(*[tc.Block(C, HEADS) for _ in range(2)])
grad = torch.randn(BATCH, T, C)
fns = bench.variants(stack, x)
plain_work = bench.backward_work(stack, x, grad)
timelines, rows = [], {}
for name, fn in fns.items():
    held, _, tl = bench.memory(stack, fn, x, grad)
    tl.name = name
    flops, ops, written = (a - b for a, b in zip(bench.backward_work(fn, x, grad), plain_work))
    timelines.append(tl)
    rows[name] = (held, flops, ops, written)
    print(f"[{name}, {time.perf_counter() - start:.1f} s] recorded")
stack.zero_grad(set_to_none=True)

fig, axes = plt.subplots(2, 2, figsize=(10, 7.5), sharey=True)
ymax = max(tl.series().max() for tl in timelines) / MiB * 1.08
for i, (tl, ax) in enumerate(zip(timelines, axes.flat)):
    plot_timeline(tl, ax=ax, title=tl.name, legend=False, ymax=ymax)
    ax.set_xlabel("allocation events" if i >= 2 else "")
    ax.set_ylabel("memory (MiB)" if i % 2 == 0 else "")
handles, labels = axes[0, 0].get_legend_handles_labels()
fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=10, frameon=False)
fig.suptitle("Memory over one training step (forward shaded blue, backward orange), two layers")
fig.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()
print(f"{'variant':<12} {'activations':>12} {'recompute (matmul/attn)':>24} "
      f"{'extra aten ops':>15} {'extra bytes allocated':>22}")  # fmt: skip
for name, (held, flops, ops, written) in rows.items():
    print(f"{name:<12} {held / MiB:>8.2f} MiB {flops / 1e6:>18.1f} MFLOP {ops:>15d} "
          f"{written / MiB:>18.2f} MiB")  # fmt: skip

# %% [markdown]
# ## What each annotation saves and costs
# The same layer with different choices of what to forget, given by node name (no edit to the
# model). Memory saved is measured (bytes alive after forward, plain minus checkpointed), the
# recompute cost is measured over the backward in two currencies: matmul/attention FLOPs (left)
# and bytes the extra elementwise work allocates (right). Where a forget pulls a matmul or attention
# into backward, `checkpoint_tensors` warns; the warnings are printed with the numbers.

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
ones = torch.ones(BATCH, T, C)
plain_bytes, _ = activation_bytes(block, x)
plain_work = bench.backward_work(block, x, ones)
points = {}
for label, names in choices.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = tc.checkpoint_tensors(block, (x,), names=names)
    held, _ = activation_bytes(c, x)
    flops, ops, written = (a - b for a, b in zip(bench.backward_work(c, x, ones), plain_work))
    points[label] = ((plain_bytes - held) / MiB, flops / 1e6, written / MiB)
    print(f"{label:<18} saved {(plain_bytes - held) / MiB:5.2f} of {plain_bytes / MiB:.2f} MiB; "
          f"recompute {flops / 1e6:6.1f} MFLOP matmul/attention, {ops:3d} more aten ops, "
          f"{written / MiB:5.2f} MiB more allocated")  # fmt: skip
    for w in caught:
        print(f"    warning: {str(w.message)[:150]}...")

fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
for label, (saved, flops, written) in points.items():
    color = "#c44e52" if label.startswith("V4") else "#4c72b0"
    for ax, cost in ((left, flops), (right, written)):
        ax.scatter(cost, saved, color=color, s=40)
        ax.annotate(label, (cost, saved), textcoords="offset points", xytext=(5, 3), fontsize=10)
left.set_xlabel("recomputed matmul/attention work per backward (MFLOP)")
right.set_xlabel("extra bytes allocated by the backward (MiB)")
left.set_ylabel("activation memory saved (MiB)")
left.set_title("cost in FLOPs")
right.set_title("cost in memory traffic")
for ax in (left, right):
    ax.grid(alpha=0.3)
    ax.set_xlim(-0.05 * ax.get_xlim()[1], 1.3 * ax.get_xlim()[1])  # room for the labels
fig.suptitle("One layer: memory saved against recompute cost, per choice of forgotten tensors")
fig.tight_layout()
plt.show()

cheap = {k: v for k, v in points.items() if v[1] == 0}
costly = {k: v for k, v in points.items() if v[1] > 0}
print(f"{len(cheap)} choices cost no matmul/attention FLOPs ({', '.join(cheap)}): they sit on the "
      f"left edge of the left panel, saving up to {max(v[0] for v in cheap.values()):.2f} MiB; "
      f"their cost is elementwise work, at most {max(v[2] for v in cheap.values()):.2f} MiB "
      "allocated (right panel).")  # fmt: skip
print(f"{len(costly)} choices recompute matmul or attention ({', '.join(costly)}): "
      f"{min(v[1] for v in costly.values()):.1f} to {max(v[1] for v in costly.values()):.1f} "
      "MFLOP per backward.")  # fmt: skip
