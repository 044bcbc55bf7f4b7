# %% [markdown]
# # The first-step anomaly: why step 2 needs more memory than step 1
#
# **What you will be able to do** after this notebook:
# 1. Name what a training step keeps in memory (parameters, gradients, optimizer state,
#    activations, and the short-lived temporaries that often make up a third of its peak) and find
#    each one on a recorded memory timeline.
# 2. Predict, from a model's size alone and before anything runs, how much higher step 2 peaks
#    than step 1: the optimizer state, created inside step 1, for AdamW, SGD with momentum and Muon.
# 3. Explain why a run can fit step 1 and run out of memory in step 2, including the part the
#    caching allocator's cached, fragmented segments play, and name the fixes.
#
# Course syllabus: topic **01, the training memory budget** (parameters, optimizer state,
# gradients, activations) and topic **07, ZeRO stages** (what optimizer state costs and why it is
# the first thing to shard). The graded exercise is [assignment 1 in docs/assignments.md][a1]: you
# write the activation category and the step-2 prediction of `memory/memory_timeline.py`. Terms
# used here are also defined in the [glossary](../docs/GLOSSARY.md). Steps are numbered
# from 1 throughout.
#
# Every number in this notebook carries its evidence: [MEASURED] on this CPU when the notebook
# ran, [PAPER] for DeepSeek-V4's own figures, [DERIVED] for what follows by arithmetic; the
# [evidence ledger](../docs/EVIDENCE.md) defines the tags and says where each figure comes from.
#
# [a1]: ../docs/assignments.md#1-memorymemory_timelinepy-where-a-training-steps-memory-goes

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from memory.allocator_model import CachingAllocatorModel, SimulatedOutOfMemoryError
from memory.memory_timeline import (
    CATEGORIES,
    COLORS,
    MemoryTimeline,
    MiB,
    predicted_optimizer_state_bytes,
)
from memory.plots import plot_timeline
from notebooks.checks import check, number

plt.rcParams.update({"figure.dpi": 110, "font.size": 10, "figure.figsize": (10, 4)})
torch.set_num_threads(2)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T0 = time.perf_counter()


def stage(message):
    """One progress line per stage of a long cell, with the time since the notebook started."""
    print(f"[{time.perf_counter() - T0:6.1f} s] {message}", flush=True)


print("device:", DEVICE, "(a GPU is visible)" if DEVICE == "cuda" else "(no GPU visible)")

# %% [markdown]
# ## The picture first: what a training step keeps in memory
# A training step has three phases. The **forward** pass computes the loss and keeps the
# intermediate results the backward pass will need: the **activations**. The **backward** pass
# computes one **gradient** per parameter and releases the activations as it goes. The
# **optimizer** step uses every gradient at once to update the **parameters**, and keeps its own
# running statistics, the **optimizer state** (AdamW keeps two numbers per parameter). The
# parameters stay throughout. Every phase also makes **temporaries**: working tensors an op needs
# only briefly and frees before its phase ends, such as the gradient of the logits at the start of
# backward. They are not kept, but they count at the moment they exist, and the peak is such a
# moment. A sixth category, **other**, holds what is made outside any phase (here the input
# batch). The sketch below is drawn by hand, not measured; each bar is its phase at its fullest
# moment, which for backward is its start, before any gradient exists.

# %%
# a hand-drawn cartoon in made-up units: each bar is one phase at its fullest
phases = ["forward", "backward", "optimizer"] * 2
sketch = {  # category: its height in each of the six phases
    "parameters": [1, 1, 1, 1, 1, 1],
    "optimizer_state": [0, 0, 1.5, 1.5, 1.5, 1.5],  # born in step 1's optimizer phase, never freed
    "gradients": [0, 0, 1, 0, 0, 1],  # none yet at backward's fullest moment, its start
    "activations": [3, 3, 0, 3, 3, 0],  # made in forward, released during backward
    "temporaries": [0.3, 1.2, 0.3, 0.3, 1.2, 0.3],  # e.g. the logits' gradient
}
x = np.arange(6) + np.array([0, 0, 0, 0.6, 0.6, 0.6])  # a gap between the two steps
fig, ax = plt.subplots(figsize=(10, 4))
base = np.zeros(6)
for category, heights in sketch.items():
    ax.bar(x, heights, 0.8, bottom=base, color=COLORS[category], label=category.replace("_", " "))
    base += heights
for k, name in enumerate(phases):
    ax.text(x[k], -0.35, name, ha="center", va="top", fontsize=10)
for k in (0, 3):
    ax.text(x[k + 1], 8.0, f"step {k // 3 + 1}", ha="center", fontsize=11, fontweight="bold")
for k in (0, 3):
    ax.annotate(
        f"step {k // 3 + 1} peak",
        (x[k + 1], base[k + 1]),
        xytext=(0, 6),
        textcoords="offset points",
        ha="center",
    )
ax.annotate(
    "",
    xy=(x[4] - 0.5, base[4]),
    xytext=(x[4] - 0.5, base[1]),
    arrowprops=dict(arrowstyle="<->", color="darkgreen", lw=2),
)
ax.hlines(base[1], x[1] + 0.4, x[4] - 0.4, color="0.4", ls="--", lw=1)
ax.text(
    x[4] - 0.6,
    (base[1] + base[4]) / 2 + 0.1,
    "higher by the\noptimizer state",
    ha="right",
    va="bottom",
    color="darkgreen",
)
ax.set_xlim(-0.6, x[-1] + 0.6)
ax.set_ylim(-1.1, 8.7)
ax.set_xticks([])
ax.set_yticks([])
ax.set_ylabel("memory in use")
ax.set_title("A sketch of two training steps: the optimizer state appears once, then stays")
ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
for side in ("top", "right"):
    ax.spines[side].set_visible(False)
fig.tight_layout()
plt.show()

# %% [markdown]
# **What to look at:** the green band. It does not exist during step 1's forward and backward
# passes, appears in step 1's optimizer phase and never leaves, so every later step stands on it.
# Each step peaks at the start of its backward pass, where the activations are still all there and
# backward's first temporaries (purple) join them. That is the **first-step anomaly**: step 1 is
# the odd one out, and a memory budget that step 1 fits can still be too small for step 2. PyTorch
# optimizers create their state lazily, inside the first `step()` call, which is why the band is
# born there.
#
# ## A small transformer, recorded
# Two pre-norm transformer blocks (causal attention + MLP) and a 4096-token vocabulary, in fp32.
# Small enough for a CPU, with a batch large enough that activations, not weights, dominate the
# forward and backward passes. `MemoryTimeline` records every tensor storage the run allocates and
# frees, and gives each one a category.


# %%
class PlainLayer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.transpose(1, 3).unbind(2)  # (B, heads, T, d / heads) each
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab=4096, d=128, heads=4, layers=2, seq=128):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(PlainLayer(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())


def make_run(seed=0):
    torch.manual_seed(seed)
    model = TinyGPT().to(DEVICE)
    idx = torch.randint(0, 4096, (8, 128), device=DEVICE)
    return model, idx, torch.roll(idx, -1, dims=1)


def train(model, optimizers, idx, targets, steps, tl, micro_batches=1):
    for step in range(1, steps + 1):  # steps are numbered from 1, as people count them
        for chunk, tgt in zip(idx.chunk(micro_batches), targets.chunk(micro_batches)):
            with tl.phase("forward", step):
                loss = model(chunk, tgt) / micro_batches
            with tl.phase("backward", step):
                loss.backward()
        with tl.phase("optimizer", step):
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)


def record(make_optimizers, steps, limit_bytes=None, micro_batches=1, name=""):
    """A fresh model trained `steps` steps, recorded; an out-of-memory is kept, not raised."""
    model, idx, targets = make_run()
    opts = make_optimizers(model)
    tl = MemoryTimeline(model, opts, limit_bytes=limit_bytes, name=name)
    try:
        with tl.record():
            train(model, opts, idx, targets, steps, tl, micro_batches)
    except SimulatedOutOfMemoryError as error:
        tl.error = error  # tl.out_of_memory says where
    return model, tl


def adamw(model, **options):
    return [torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False, **options)]


def sgd_momentum(model):
    return [torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, foreach=False)]


# %% [markdown]
# ## Predict before running
# With N fp32 parameters in T tensors: parameters take 4N bytes, gradients 4N, and AdamW's state
# 8N (two moments, `exp_avg` and `exp_avg_sq`) plus one 4-byte `step` counter per tensor. Where
# that counter lives depends on the device: PyTorch keeps it on the **CPU** unless the optimizer is
# `fused` or `capturable`, so on a GPU the state in GPU memory is 8N, on a CPU 8N + 4T.
# `predicted_optimizer_state_bytes(optimizer, device)` applies that rule before the state exists.
# Step 1 starts with no state; from step 2 on the state is there throughout, so **the step-2 peak
# is the step-1 peak plus the optimizer state**, as long as step 1 peaks before its optimizer step
# (here at the start of backward: activations and the loss's temporaries), not inside it.

# %%
model, idx, targets = make_run()
N = sum(p.numel() for p in model.parameters())
T = len(list(model.parameters()))
predicted = predicted_optimizer_state_bytes(adamw(model), DEVICE)  # the state does not exist yet
print(f"N = {N:,} parameters in T = {T} tensors")
print(f"parameters {4 * N / MiB:.3f} MiB, gradients {4 * N / MiB:.3f} MiB")
print(f"AdamW state on {DEVICE}: {predicted:,} B = {predicted / MiB:.4f} MiB  <- predicted jump")
print(f"  (8N + 4T = {8 * N + 4 * T:,} B on a CPU; 8N = {8 * N:,} B on a GPU, counters on the CPU)")

# %%
stage("recording 4 AdamW steps ...")
_, adamw_tl = record(adamw, 4, name="AdamW")
stage(f"recorded {adamw_tl.num_events} allocation events")

steps = [1, 2, 3, 4]
peaks = [adamw_tl.peak(step=s) for s in steps]
measured_jump = peaks[1] - peaks[0]
print("peak allocated per step (MiB):", ", ".join(f"{p / MiB:.3f}" for p in peaks))
print(
    f"step 1 -> step 2: {peaks[0] / MiB:.3f} -> {peaks[1] / MiB:.3f} MiB, a jump of "
    f"{measured_jump:,} B = {measured_jump / MiB:.4f} MiB; predicted {predicted:,} B "
    f"({measured_jump - predicted:+,} B)"
)
assert abs(measured_jump - predicted) <= 0.01 * predicted
assert peaks[1] == peaks[2] == peaks[3], "from step 2 on every step looks the same"


def peak_event(tl, step):
    """Index of the event where `step` reaches its peak total (the first, if reached twice)."""
    (a, _), *_, (_, b) = tl.window(step=step)
    return a - 1 + int(np.argmax(tl.series()[a - 1 : b]))


print("\nsummary(): each category's own peak over the run, then the peak of the total")
print(adamw_tl.summary())
at = peak_event(adamw_tl, 2)
parts = {c: adamw_tl.bytes[c][at] for c in CATEGORIES}
print(
    f"\nThe category lines add up to {sum(adamw_tl.peak(c) for c in CATEGORIES) / MiB:.3f} MiB, "
    f"more than the total's {adamw_tl.peak() / MiB:.3f} MiB: each category peaks at its own "
    "moment\n(gradients peak in backward, after the activations have been released). At the "
    "moment the total peaks, in step 2's backward:\n  "
    + ", ".join(f"{c} {v / MiB:.3f}" for c, v in parts.items() if v)
    + f" MiB = {sum(parts.values()) / MiB:.3f} MiB"
)

# %% [markdown]
# The plot below has one x position per **allocation event** (each allocation or free of a tensor
# storage), evenly spaced, as PyTorch's memory viz draws it: a spike that lasts a microsecond is as
# wide as a plateau. The background bands mark the phases; the coloured areas are memory by
# category. Each step's peak is marked.

# %%
first = adamw_tl.phases[0][2]  # event index where step 1's forward begins
ax = plot_timeline(adamw_tl, show_reserved=False, title="AdamW, 4 steps, memory by category")
fig = ax.figure
fig.set_size_inches(12, 4.8)
for s, p in zip(steps, peaks):
    i = peak_event(adamw_tl, s)
    ax.plot([i], [p / MiB], "v", color="k", ms=8)
    label = f"step {s} peak\n{p / MiB:.1f} MiB"
    ax.annotate(label, (i, p / MiB), xytext=(10, 2), textcoords="offset points", fontsize=10)
i2 = peak_event(adamw_tl, 2)
step2_start = adamw_tl.window(step=2)[0][0]
ax.annotate(
    "",
    xy=(i2 - 6, peaks[1] / MiB),
    xytext=(i2 - 6, peaks[0] / MiB),
    arrowprops=dict(arrowstyle="<->", color="darkgreen", lw=2.5),
)
ax.hlines(peaks[0] / MiB, peak_event(adamw_tl, 1), i2 - 6, color="0.3", lw=0.8, ls="--")
ax.annotate(
    f"+{measured_jump / MiB:.2f} MiB from step 1\nto step 2: AdamW's state\n(the green band)",
    (i2 - 8, (peaks[0] + peaks[1]) / 2 / MiB),
    xytext=(step2_start - 20, 52),
    ha="right",
    va="center",
    color="darkgreen",
    fontweight="bold",
    arrowprops=dict(arrowstyle="->", color="darkgreen"),
)
ax.annotate(
    "before step 1: the parameters,\ncounted as recording starts",
    (first / 2, 4 * N / MiB / 2),
    xytext=(first + 66, 30),
    fontsize=10,
    arrowprops=dict(arrowstyle="->", color="0.3"),
)
ax.set_ylim(0, peaks[1] / MiB * 1.22)
fig.tight_layout()
plt.show()

# %% [markdown]
# **What to look at:** the green optimizer-state band. In step 1 the forward pass stacks
# activations (red) on the parameters (blue) and the peak comes at the start of backward, when
# backward's first temporaries (purple) join them; the
# backward pass turns activations into gradients (orange); the optimizer phase creates AdamW's
# state (green) and it never leaves. Steps 2-4 repeat step 1's forward and backward on top of the
# green band: the same shape, raised by exactly the state's bytes (the green arrow).
#
# The next figure takes each step's peak apart: which categories make up the memory at that one
# moment.

# %%
fig, ax = plt.subplots(figsize=(9, 3.6))
bottom = np.zeros(len(steps))
for c in CATEGORIES:
    values = np.array([adamw_tl.bytes[c][peak_event(adamw_tl, s)] for s in steps]) / MiB
    if values.any():
        ax.barh(steps, values, left=bottom, color=COLORS[c], label=c.replace("_", " "))
        for y, (v, b) in enumerate(zip(values, bottom)):
            if v > 0:
                ax.text(b + v / 2, steps[y], f"{v:.1f}", ha="center", va="center", color="w")
        bottom += values
for y, total_mib in zip(steps, bottom):
    ax.text(total_mib + 0.5, y, f"{total_mib:.1f} MiB", va="center")
ax.set_yticks(steps, [f"step {s}" for s in steps])
ax.invert_yaxis()
ax.set_xlim(0, bottom.max() * 1.15)
ax.set_xlabel("memory in use at the step's peak (MiB)")
ax.set_title("What each step's peak is made of")
ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
fig.tight_layout()
plt.show()

# %% [markdown]
# **What to look at:** the four bars are identical except for the green segment, which step 1
# does not have. Gradients are zero at these peaks: the peak comes at the very start of backward,
# when the loss's working tensors (purple temporaries, 16 MiB each, such as the logits' gradient)
# exist but no parameter gradient has been computed yet.
# [MEASURED: this recording, on this CPU]
#
# ## Reserved memory: what a GPU's caching allocator holds
# On a GPU, PyTorch does not return freed memory to the device: its **caching allocator** keeps
# whole **segments** (blocks obtained from the device with one `cudaMalloc`) and reuses them.
# **Reserved** memory is the sum of those segments; **allocated** is the part handed out to live
# tensors. This notebook runs on a CPU, so the recorder replays every allocation through a
# **model** of that allocator (`memory/allocator_model.py`). Its segment rules, PyTorch's
# defaults: requests are rounded up to 512 bytes; a request of at most 1 MiB gets a 2 MiB segment,
# one between 1 and 10 MiB a 20 MiB segment, and one of **10 MiB or more a segment of its own
# size, rounded up to 2 MiB**; a request takes the best-fitting free block and splits it; a freed
# block merges with free neighbours and stays cached.
# [the allocator's rules: PyTorch's defaults, modelled here; on a GPU UNKNOWN until `make
# gpu-check`]

# %%
reserved = [adamw_tl.peak_reserved_model(step=s) for s in steps]
print("modelled reserved peak per step (MiB):", ", ".join(f"{r / MiB:.0f}" for r in reserved))
print("allocated peak per step (MiB):        ", ", ".join(f"{p / MiB:.1f}" for p in peaks))
later = "nothing more in steps 3-4" if reserved[3] == reserved[1] else "more in steps 3-4"
print(
    f"The modelled allocator reserves {reserved[0] / MiB:.0f} MiB in step 1, "
    f"{(reserved[1] - reserved[0]) / MiB:.0f} MiB more in step 2 when the state needs room, and "
    f"{later}; reserved stays {(reserved[3] - peaks[3]) / MiB:.1f} MiB above the allocated peak."
)

# %% [markdown]
# ## A budget where step 1 fits and step 2 runs out
# Give the run a memory limit between the step-1 and step-2 peaks of the (modelled) reserved
# memory. On a GPU the same experiment is `torch.cuda.set_per_process_memory_fraction`; here the
# recorder raises the out-of-memory error itself when its allocator model would need a new
# segment beyond the limit. Before giving up, it releases every wholly free segment, as PyTorch
# does on an out-of-memory retry.

# %%
limit = (reserved[0] + reserved[1]) // 2
print(
    f"step 1 needs {reserved[0] / MiB:.0f} MiB reserved, step 2 {reserved[1] / MiB:.0f} MiB; "
    f"limit {limit / MiB:.0f} MiB"
)
stage("recording AdamW under the budget ...")
_, budget = record(adamw, 4, limit_bytes=limit, name="AdamW under a budget")
oom = budget.out_of_memory
assert oom is not None and oom.step == 2, "expected the second step to run out of memory"
print(f"step {oom.step} ran out in its {oom.phase} pass:\n  {budget.error}")
model_at_oom = budget.allocator_model  # its segments as they were when the request failed
allocated_mib, request_mib = model_at_oom.allocated / MiB, oom.nbytes / MiB
free_blocks = [b for _, _, blocks in model_at_oom.segments() for _, b, key in blocks if key is None]
print(
    f"allocated {allocated_mib:.2f} + requested {request_mib:.2f} = "
    f"{allocated_mib + request_mib:.2f} MiB, under the {limit / MiB:.0f} MiB limit; but "
    f"{sum(free_blocks) / MiB:.2f} MiB of the {model_at_oom.reserved / MiB:.0f} MiB reserved is "
    f"free in {len(free_blocks)} pieces, the largest {max(free_blocks) / MiB:.2f} MiB"
)

# %%
fig, (top, bottom_ax) = plt.subplots(
    2, 1, figsize=(12, 7.6), gridspec_kw={"height_ratios": [3, 2.4]}
)
plot_timeline(budget, ax=top, title="", legend=False)
step2 = budget.window(step=2)[0][0]
top.set_xlim(step2 - 8, oom.event + 4)
for text in list(top.texts):  # step labels of the steps outside the zoom
    if text.get_text().startswith(" step") and text.get_position()[0] < step2 - 8:
        text.remove()
top.set_ylim(0, oom.reserved_needed / MiB * 1.12)
top.set_title(f"Zoom on step 2 under a {limit / MiB:.0f} MiB limit, up to the failed request")
top.text(
    step2 + 1,
    limit / MiB + 1.5,
    f"memory limit {limit / MiB:.0f} MiB",
    color="red",
    fontsize=10,
)
top.text(step2 + 1, oom.reserved / MiB + 1.5, "reserved (modelled)", fontsize=10)
handles, labels = top.get_legend_handles_labels()
keep = [k for k, lab in enumerate(labels) if lab in CATEGORIES]
top.legend([handles[k] for k in keep], [labels[k] for k in keep], loc="center left", ncol=3)

# the segment map at the failure: one row per segment, blocks coloured by what holds them
segments = sorted(model_at_oom.segments(), key=lambda seg: -seg[0])
for row, (size, pool, blocks) in enumerate(segments):
    for offset, nbytes, key in blocks:
        if key is None:
            bottom_ax.barh(row, nbytes / MiB, left=offset / MiB, color="w", ec="0.4", hatch="//")
        else:
            color = COLORS[budget.category_of(key)]
            bottom_ax.barh(row, nbytes / MiB, left=offset / MiB, color=color, ec="w", lw=0.3)
    largest = max((b for _, b, key in blocks if key is None), default=0)
    bottom_ax.text(
        size / MiB + 0.3,
        row,
        f"{size / MiB:.0f} MiB {pool} segment, largest free block {largest / MiB:.1f} MiB",
        va="center",
        fontsize=9,
    )
bottom_ax.barh(len(segments), oom.nbytes / MiB, color="none", ec="red", lw=1.5, ls="--")
bottom_ax.text(
    oom.nbytes / MiB + 0.3,
    len(segments),
    f"the request: {request_mib:.0f} MiB, fits in no free block -> needs a new segment",
    va="center",
    color="darkred",
    fontsize=9,
)
bottom_ax.set_yticks([])
bottom_ax.invert_yaxis()
bottom_ax.set_xlim(0, 34)
bottom_ax.set_xlabel("offset inside the segment (MiB); hatched = free but cached")
bottom_ax.set_title(
    f"The {len(segments)} segments at the failure: {model_at_oom.reserved / MiB:.0f} MiB "
    f"reserved, {sum(free_blocks) / MiB:.1f} MiB of it free, in pieces"
)
fig.tight_layout()
plt.show()

# %% [markdown]
# **What to look at:** in the bottom panel, the free (hatched) blocks. Step 2's backward asks for
# a 16 MiB tensor (the size of the logits, 8×128×4096 fp32 values). Allocated memory plus the
# request is under the limit, so by arithmetic alone it should fit. It fails because the free
# memory is scattered across cached segments and no single free block holds 16 MiB: a tensor needs
# contiguous memory. A request of 10 MiB or more gets a new segment of its own size (rounded up to
# 2 MiB), so the allocator needs a fresh 16 MiB segment, and the reserved total would cross the
# limit (the red dotted line and the X in the top panel). It cannot release any segment either:
# each holds at least one live tensor. This is **fragmentation**: memory that is free but unusable
# for this request.
# [MEASURED on the allocator model; DERIVED: 8×128×4096×4 bytes = 16 MiB]
#
# **What fixes it.** Anything that makes room for the state that arrives in step 1's optimizer
# phase: fewer activations (smaller micro-batches with gradient accumulation, or activation
# checkpointing: `tensor_ckpt.py`), a smaller state (SGD with momentum or Muon keep one buffer per
# matrix, not two), or a sharded state (ZeRO-1 keeps 1/N of it per rank: `muon_zero.py`). Here, two
# micro-batches of 4 sequences halve the activations with the same effective batch (the logits,
# 8×128×4096 floats, are the largest activation here).

# %%
stage("recording AdamW with 2 micro-batches under the same budget ...")
_, fixed = record(adamw, 4, limit_bytes=limit, micro_batches=2, name="AdamW, 2 micro-batches")
assert fixed.out_of_memory is None
stage("done")
print(
    f"peak modelled reserved {fixed.peak_reserved_model() / MiB:.0f} MiB <= limit "
    f"{limit / MiB:.0f} MiB; peak allocated {fixed.peak() / MiB:.1f} MiB "
    f"(one batch of 8: {adamw_tl.peak() / MiB:.1f} MiB)"
)
fig, ax = plt.subplots(figsize=(9, 3.6))
width = 0.38
one = [r / MiB for r in reserved]
two = [fixed.peak_reserved_model(step=s) / MiB for s in steps]
ax.bar(np.array(steps) - width / 2, one, width, color="0.55", label="one batch of 8 sequences")
ax.bar(np.array(steps) + width / 2, two, width, color="0.8", label="two micro-batches of 4")
for s, v in zip(steps, one):
    ax.text(s - width / 2, v + 1, f"{v:.0f}", ha="center")
for s, v in zip(steps, two):
    ax.text(s + width / 2, v + 1, f"{v:.0f}", ha="center")
ax.axhline(limit / MiB, color="red", ls="-.", lw=1.3, label=f"limit {limit / MiB:.0f} MiB")
ax.set_xticks(steps, [f"step {s}" for s in steps])
ax.set_ylabel("peak reserved (MiB, modelled)")
ax.set_ylim(0, max(one) * 1.2)
ax.set_title("Peak reserved memory per step: one batch of 8 crosses the limit from step 2")
ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
fig.tight_layout()
plt.show()

# %% [markdown]
# **What to look at:** the dark bars (one batch of 8, recorded without a limit) cross the red line
# from step 2 on, never in step 1; the light bars (two micro-batches, recorded under the limit) stay
# well under it in every step.
# [MEASURED on the allocator model]
#
# ## AdamW vs SGD with momentum vs Muon
# The jump is the optimizer state, so it scales with how much state an optimizer keeps per
# parameter. AdamW keeps two fp32 moments. **SGD with momentum** keeps one momentum buffer per
# parameter. **Muon** (the optimizer DeepSeek-V4 uses for its hidden matrices, see the
# [glossary](../docs/GLOSSARY.md)) keeps one momentum buffer too, but it is meant for 2-D hidden
# matrices only, so the embedding, positional table, norms, biases and head stay with AdamW (V4
# §2.4, the DeepSeek-V4 report's section 2.4). `torch.optim.Muon` is PyTorch's single-device Muon.
#
# ### Exercise 1 (predict, then run): RMSprop's step-2 jump
# A fourth optimizer, not in the comparison below: `torch.optim.RMSprop` (without momentum) keeps,
# for each parameter tensor, one running average of the squared gradient shaped like the tensor
# (`square_avg`, fp32) and, like AdamW, one `step` counter. Apply the rule of "Predict before
# running" to it: how many **bytes** higher does step 2 peak than step 1 on this CPU? Use N and T
# printed above.

# %%
answer_rmsprop_jump = None  # your prediction, in bytes (an int)


# %%
def matrices_and_rest(model):
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks")]
    hidden_ids = {id(p) for p in hidden}
    return hidden, [p for p in model.parameters() if id(p) not in hidden_ids]


def muon_and_adamw(model):
    hidden, rest = matrices_and_rest(model)
    return [
        torch.optim.Muon(hidden, lr=0.02, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(rest, lr=1e-3, foreach=False),
    ]


OPTIMIZERS = {"AdamW": adamw, "SGD + momentum": sgd_momentum, "Muon + AdamW": muon_and_adamw}
runs = {"AdamW": adamw_tl}
for kind in ("SGD + momentum", "Muon + AdamW"):
    stage(f"recording {kind} ...")
    runs[kind] = record(OPTIMIZERS[kind], 4, name=kind)[1]


# %%
# check: answer_rmsprop_jump
def rmsprop(model):
    return [torch.optim.RMSprop(model.parameters(), lr=1e-3, foreach=False)]


stage("recording RMSprop ...")
rmsprop_tl = record(rmsprop, 2, name="RMSprop")[1]
check(
    "answer_rmsprop_jump",
    answer_rmsprop_jump,
    number(
        rmsprop_tl.peak(step=2) - rmsprop_tl.peak(step=1),
        unit="B",
        hint="How many buffers shaped like each parameter does RMSprop keep, at how many bytes "
        "per fp32 value? And how many counters, at how many bytes each?",
    ),
)

# %%
hidden, rest = matrices_and_rest(make_run()[0])
n_hidden = sum(p.numel() for p in hidden)
print(f"Muon's matrices hold {n_hidden:,} of the {N:,} parameters ({n_hidden / N:.0%})")
adamw_state = runs["AdamW"].peak("optimizer_state")
ratio = {}
print(f"{'optimizer':>14} {'state MiB':>10} {'predicted':>10} {'step-2 jump':>12} {'vs AdamW':>9}")
for kind, tl in runs.items():
    state = tl.peak("optimizer_state")
    predicted_state = predicted_optimizer_state_bytes(OPTIMIZERS[kind](make_run()[0]), DEVICE)
    jump = tl.peak(step=2) - tl.peak(step=1)
    ratio[kind] = state / adamw_state
    print(
        f"{kind:>14} {state / MiB:10.3f} {predicted_state / MiB:10.3f} {jump / MiB:12.3f} "
        f"{ratio[kind]:9.1%}"
    )
    assert state == predicted_state and jump == predicted_state

kinds = list(runs)
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
for kind, marker, ls, gray in zip(kinds, "osD", ("-", "--", ":"), ("0.0", "0.35", "0.6")):
    step_peaks = [runs[kind].peak(step=s) / MiB for s in steps]
    left.plot(steps, step_peaks, marker=marker, ls=ls, color=gray, ms=7, lw=1.5, label=kind)
    left.annotate(
        f"{step_peaks[3]:.1f}",
        (4, step_peaks[3]),
        xytext=(9, 0),
        textcoords="offset points",
        va="center",
        fontsize=10,
    )
first_peak = runs["AdamW"].peak(step=1) / MiB
left.annotate(
    f"{first_peak:.1f} (all three)",
    (1, first_peak),
    xytext=(8, -3),
    textcoords="offset points",
    fontsize=10,
)
left.set_ylim(first_peak - 2, max(runs[k].peak(step=2) for k in kinds) / MiB + 2)
left.set_xlim(0.8, 4.5)
left.set_xticks(steps, [f"step {s}" for s in steps])
left.set_ylabel("peak allocated (MiB)")
left.set_title("peak per step: equal in step 1, apart from step 2 on")
left.legend(loc="lower right", fontsize=10)
states = [runs[k].peak("optimizer_state") / MiB for k in kinds]
right.barh(kinds, states, color=COLORS["optimizer_state"])
for y, (k, s) in enumerate(zip(kinds, states)):
    right.text(s, y, f" {s:.3f} MiB ({ratio[k]:.0%})", va="center", fontsize=10)
right.set_xlim(0, 1.45 * max(states))
right.invert_yaxis()
right.set_xlabel("optimizer state (MiB) = the step-2 jump")
right.set_title("state, as a share of AdamW's")
fig.tight_layout()
plt.show()

# %% [markdown]
# **What to look at:** the three lines start from the same step-1 peak and separate at step 2 by
# exactly the bars on the right: each optimizer's state.

# %%
sgd, muon = ratio["SGD + momentum"], ratio["Muon + AdamW"]
print(
    f"SGD with momentum keeps {sgd:.0%} of AdamW's state: one buffer per parameter, not two. "
    f"Muon keeps {muon:.0%}, not {sgd:.0%}: its one buffer covers only the blocks' matrices "
    f"({n_hidden / N:.0%} of the parameters); the embedding, positional table, norms and head stay "
    f"with AdamW and its two moments."
)

# %% [markdown]
# Muon's other catch is that its update is a whole-matrix operation, so ZeRO (which splits the
# optimizer state across data-parallel ranks, see the [glossary](../docs/GLOSSARY.md)) cannot
# shard its state element by element the way it shards AdamW's: the subject of `muon_zero.py` and
# `notebooks/01_muon_zero.ipynb`.
#
# **On a GPU** (this notebook picks CUDA when it is there) the recorder also draws the real
# `memory_allocated` and `memory_reserved` lines beside the modelled one; AdamW's `step` counters
# then stay on the CPU, which is why the prediction is 8N there [DERIVED; checked on the `meta`
# device, where a tensor has a shape and a device but no data]. The numbers printed in this
# notebook are the CPU's; what a GPU's allocator adds is entry A.6 of the
# [evidence ledger](../docs/EVIDENCE.md).
#
# ## Takeaway
# A training step holds parameters and, in turn, activations (forward), gradients (backward) and
# the optimizer's state (optimizer step). PyTorch creates the state inside the first `step()`, so
# step 1 peaks lower than every later step, by exactly the state's bytes: 8 bytes per parameter for
# AdamW, 4 for SGD with momentum, and that is predictable before the run [DERIVED, IMPLEMENTED;
# equal to the byte on this CPU: MEASURED; ledger A.1-A.3]. On a GPU the caching
# allocator adds its own cost: memory that is free but split across cached segments cannot serve a
# large request, so a run can fail with allocated + requested under the limit [MEASURED on a model
# of the allocator; on a GPU UNKNOWN until `make gpu-check`]. Budget for step 2,
# not step 1; make room with smaller micro-batches, checkpointing, a leaner optimizer or ZeRO.
#
# ## Exercises
# Write your answer into the variable, then run the check cell below it: it says right or wrong,
# and why. Each check runs its own small experiment.
#
# ### Exercise 2: a limit where SGD's step 1 fits and its step 2 runs out
# SGD with momentum needs less memory in step 2 than AdamW. Find a memory limit, in whole MiB, under
# which its step 1 completes and its step 2 runs out of (modelled) memory. Use what you know of the
# step-2 jump and of how reserved memory grows in whole segments.

# %%
answer_sgd_limit_mib = None  # your limit, in MiB (an int)


# %%
# check: answer_sgd_limit_mib
def judge_limit(limit_mib):
    tl = record(sgd_momentum, 2, limit_bytes=int(limit_mib * MiB))[1]
    failed = tl.out_of_memory
    if failed is not None and failed.step == 2:
        return True, f"under {limit_mib} MiB step 1 fits and step 2 runs out ({failed.phase})"
    if failed is not None:
        return False, f"under {limit_mib} MiB even step 1 runs out ({failed.phase}): raise it"
    return False, f"under {limit_mib} MiB both steps fit: lower it"


check("answer_sgd_limit_mib", answer_sgd_limit_mib, judge_limit)

# %% [markdown]
# ### Exercise 3: the segment rule
# Using the segment rules stated above, predict the size in MiB of the new segment the caching
# allocator opens for a request of 0.5 MiB, of 4 MiB and of 12.3 MiB, when no cached block can
# serve it. Answer with a list of three numbers.

# %%
answer_segments_mib = None  # e.g. [a, b, c], in MiB


# %%
# check: answer_segments_mib
def judge_segments(answer):
    requests = [0.5, 4, 12.3]
    truth = [CachingAllocatorModel.segment_size(int(r * MiB)) / MiB for r in requests]
    if len(list(answer)) != 3:
        return False, "give three sizes, one per request"
    wrong = [f"{r} MiB" for r, a, t in zip(requests, list(answer), truth) if float(a) != t]
    if not wrong:
        return True, "the small pool, the 20 MiB large segment, and a segment of its own size"
    return False, (
        f"wrong for the request(s) of {', '.join(wrong)}: which pool does each go to, and which "
        "requests get a segment of their own size, rounded up to what?"
    )


check("answer_segments_mib", answer_segments_mib, judge_segments)

# %% [markdown]
# ### Exercise 4 (predict, then run): AdamW with `amsgrad=True`
# `torch.optim.AdamW(..., amsgrad=True)` keeps one more buffer per parameter, the running maximum
# of `exp_avg_sq`. Predict its state, in bytes, on this CPU for this model (the step-2 jump).

# %%
answer_amsgrad_jump = None  # your prediction, in bytes (an int)


# %%
# check: answer_amsgrad_jump
amsgrad_model, amsgrad_idx, amsgrad_targets = make_run()
amsgrad_opt = torch.optim.AdamW(amsgrad_model.parameters(), amsgrad=True, foreach=False)
amsgrad_model(amsgrad_idx, amsgrad_targets).backward()
amsgrad_opt.step()  # one real step creates the state; count its bytes on this device
amsgrad_state = sum(
    t.untyped_storage().nbytes()
    for s in amsgrad_opt.state.values()
    for t in s.values()
    if torch.is_tensor(t) and t.device.type == DEVICE
)
check(
    "answer_amsgrad_jump",
    answer_amsgrad_jump,
    number(
        amsgrad_state,
        unit="B",
        hint="Count the buffers shaped like each parameter (with amsgrad), then the step counters: "
        "how many, how big, and on which device?",
    ),
)

# %% [markdown]
# ### Exercise 5 (change the code, run, observe): micro-batches under a tighter limit
# Two micro-batches brought AdamW under 88 MiB. Now the (modelled) limit is **50 MiB**. Edit
# `micro_batches` in the cell below (1, 2, 4 or 8: it must divide the batch of 8 sequences) and
# run it, to find the fewest micro-batches with which two AdamW steps complete. Compare each
# run's allocated peak with the limit before you conclude.

# %%
micro_batches = 2  # edit, run, repeat
_, tight = record(adamw, 2, limit_bytes=50 * MiB, micro_batches=micro_batches)
failed = tight.out_of_memory
print(
    f"{micro_batches} micro-batches: "
    + (f"out of memory in step {failed.step}'s {failed.phase}" if failed else "both steps fit")
    + f"; peak allocated {tight.peak() / MiB:.1f} MiB (until it stopped)"
)

# %%
answer_micro_batches = None  # the fewest micro-batches that fit under 50 MiB (an int)


# %%
# check: answer_micro_batches
def fits_under_50(micro):
    return record(adamw, 2, limit_bytes=50 * MiB, micro_batches=micro)[1].out_of_memory is None


check(
    "answer_micro_batches",
    answer_micro_batches,
    number(
        min(m for m in (1, 2, 4, 8) if fits_under_50(m)),
        unit="micro-batches",
        hint="An allocated peak under the limit is not enough: reserved memory grows in whole "
        "segments, and a fresh segment must fit too.",
    ),
)
