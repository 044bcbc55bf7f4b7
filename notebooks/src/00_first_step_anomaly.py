# %% [markdown]
# # The first-step anomaly
#
# A training step moves memory in a fixed rhythm: **activations** rise through the forward pass; in
# the backward pass **gradients** appear while the activations are released; the **optimizer step**
# needs every gradient at once and updates its **state**. Yet the first step of a run does not look
# like the others. PyTorch optimizers create their state lazily, inside the first `step()`: AdamW's
# two fp32 moments appear there, and from then on they sit under every later step. A first step can
# fit in memory and the second run out. On a GPU the caching allocator adds its own first-step
# set-up (segments reserved once, then reused), so `reserved` stays above `allocated`.
#
# This notebook records that with `memory_timeline.py`: every tensor storage, categorised, with a
# **modelled** CUDA caching allocator for the reserved line on a CPU (a model, labelled so in every
# plot). It predicts the step-2 jump from the model's size before running, checks it against the
# measurement, puts the run under a memory budget where step 1 fits and step 2 does not, and
# compares AdamW, SGD with momentum and Muon. Steps are numbered from 1. Course topics: the training
# memory budget (01), ZeRO stages (07).

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from memory.allocator_model import SimulatedOutOfMemoryError
from memory.memory_timeline import COLORS, MemoryTimeline, MiB, predicted_optimizer_state_bytes
from memory.plots import plot_timeline, plot_timelines

plt.rcParams.update({"figure.dpi": 110, "font.size": 10, "figure.figsize": (10, 4)})
torch.set_num_threads(2)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T0 = time.perf_counter()


def stage(message):
    """One progress line per stage of a long cell, with the time since the notebook started."""
    print(f"[{time.perf_counter() - T0:6.1f} s] {message}", flush=True)


print("device:", DEVICE, "(a GPU is visible)" if DEVICE == "cuda" else "(no GPU visible)")


# %% [markdown]
# ## A small transformer
# Two pre-norm blocks (causal attention + MLP) and a 4096-token vocabulary, in fp32. Small enough
# for a CPU, with a batch large enough that activations, not weights, dominate the forward and
# backward.


# %%
class Block(nn.Module):
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
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
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


# %% [markdown]
# ## Predict before running
# With N fp32 parameters in T tensors: parameters 4N bytes, gradients 4N, AdamW state 8N (two
# moments) plus one 4-byte `step` counter per tensor. Where that counter lives depends on the
# device: PyTorch keeps it on the **CPU** unless the optimizer is `fused` or `capturable`, so on a
# GPU the state in GPU memory is 8N, and on a CPU it is 8N + 4T.
# `predicted_optimizer_state_bytes(optimizer, device)` applies that rule. Step 1 starts with no
# state; from step 2 on the state is there throughout, so **the step-2 peak is the step-1 peak plus
# the optimizer state**, as long as the step-1 peak falls in the backward pass (activations +
# gradients), not in the optimizer step itself.

# %%
model, idx, targets = make_run()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
N = sum(p.numel() for p in model.parameters())
T = len(list(model.parameters()))
predicted = predicted_optimizer_state_bytes(opt, DEVICE)  # the state does not exist yet
print(f"N = {N:,} parameters in T = {T} tensors")
print(f"parameters {4 * N / MiB:.3f} MiB, gradients {4 * N / MiB:.3f} MiB")
print(f"AdamW state on {DEVICE}: {predicted:,} B = {predicted / MiB:.4f} MiB  <- predicted jump")
print(f"  (8N + 4T = {8 * N + 4 * T:,} B on a CPU; 8N = {8 * N:,} B on a GPU, counters on the CPU)")

# %%
stage("recording 4 AdamW steps ...")
adamw = MemoryTimeline(model, opt, name="AdamW")
with adamw.record():
    train(model, [opt], idx, targets, 4, adamw)
stage(f"recorded {adamw.num_events} allocation events")

peaks = [adamw.peak(step=s) for s in (1, 2, 3, 4)]
measured_jump = peaks[1] - peaks[0]
print("peak allocated per step (MiB):", ", ".join(f"{p / MiB:.3f}" for p in peaks))
print(
    f"step 1 -> step 2: {peaks[0] / MiB:.3f} -> {peaks[1] / MiB:.3f} MiB, a jump of "
    f"{measured_jump:,} B = {measured_jump / MiB:.4f} MiB; predicted {predicted:,} B "
    f"({measured_jump - predicted:+,} B)"
)
assert abs(measured_jump - predicted) <= 0.01 * predicted
assert peaks[1] == peaks[2] == peaks[3], "from step 2 on every step looks the same"
print(adamw.summary())

# %% [markdown]
# The plot below has one x position per **allocation event** (each allocation or free of a tensor
# storage), evenly spaced, as PyTorch's memory viz draws it: a spike that lasts a microsecond is as
# wide as a plateau. The background bands mark the phases (forward grey, backward yellow, optimizer
# cyan); the coloured areas are memory by category.

# %%
ax = plot_timeline(
    adamw, title="AdamW, 4 steps: the optimizer state appears in step 1's optimizer phase"
)
ax.figure.tight_layout()
plt.show()

# %%
reserved = [adamw.peak_reserved_model(step=s) for s in (1, 2, 3, 4)]
print("modelled reserved peak per step (MiB):", ", ".join(f"{r / MiB:.0f}" for r in reserved))
print("allocated peak per step (MiB):        ", ", ".join(f"{p / MiB:.1f}" for p in peaks))
later = "nothing more in steps 3-4" if reserved[3] == reserved[1] else "more in steps 3-4"
print(
    f"The modelled allocator reserves {reserved[0] / MiB:.0f} MiB in step 1, "
    f"{(reserved[1] - reserved[0]) / MiB:.0f} MiB more in step 2 when the state needs room, and "
    f"{later}; reserved stays {(reserved[3] - peaks[3]) / MiB:.1f} MiB above the allocated peak."
)

# %% [markdown]
# Read the plot left to right. In step 1 the forward pass stacks activations (red) on the
# parameters (blue); the backward pass turns them into gradients (orange); the optimizer phase
# creates AdamW's state (green) and it **never leaves**. Steps 2–4 repeat step 1's forward and
# backward on top of that green band: the same shape, raised by exactly the state's bytes. The thin
# black line is the total. The dashed line is the **modelled** CUDA caching allocator: it reserves
# whole segments (2 MiB for small tensors, 20 MiB for medium ones) and keeps them after the tensors
# die, so it steps up in step 1, again in step 2 when the state needs room, and then stays flat
# (the numbers are printed above).
#
# ## A budget where step 1 fits and step 2 runs out
# Give the run a memory limit between the step-1 and step-2 peaks of the (modelled) reserved
# memory. On a GPU the same experiment is `torch.cuda.set_per_process_memory_fraction`; here the
# recorder raises the out-of-memory error itself when its allocator model would need a segment
# beyond the limit.

# %%
limit = (reserved[0] + reserved[1]) // 2
print(
    f"step 1 needs {reserved[0] / MiB:.0f} MiB reserved, step 2 {reserved[1] / MiB:.0f} MiB; "
    f"limit {limit / MiB:.0f} MiB"
)

stage("recording AdamW under the budget ...")
model, idx, targets = make_run()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
budget = MemoryTimeline(model, opt, limit_bytes=limit, name="AdamW under a budget")
try:
    with budget.record():
        train(model, [opt], idx, targets, 4, budget)
    raise AssertionError("expected the second step to run out of memory")
except SimulatedOutOfMemoryError as error:
    oom = budget.out_of_memory
    print(f"step {oom.step} ran out in its {oom.phase} pass:\n  {error}")
assert oom.step == 2

# %% [markdown]
# **What fixes it.** Anything that makes room for the state that arrives in step 1's optimizer
# phase: fewer activations (smaller micro-batches with gradient accumulation, or activation
# checkpointing: `tensor_ckpt.py`), a smaller state (SGD with momentum or Muon keep one buffer per
# matrix, not two), or a sharded state (ZeRO-1 keeps 1/N of it per rank: `muon_zero.py`). Here, two
# micro-batches of 4 sequences halve the activations with the same effective batch (the logits,
# 8×128×4096 floats, are the largest activation here).

# %%
stage("recording AdamW with 2 micro-batches under the same budget ...")
model, idx, targets = make_run()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
fixed = MemoryTimeline(model, opt, limit_bytes=limit, name="AdamW, 2 micro-batches, same budget")
with fixed.record():
    train(model, [opt], idx, targets, 4, fixed, micro_batches=2)
stage("done")
print(
    f"peak modelled reserved {fixed.peak_reserved_model() / MiB:.0f} MiB <= limit "
    f"{limit / MiB:.0f} MiB; peak allocated {fixed.peak() / MiB:.1f} MiB "
    f"(one batch of 8: {adamw.peak() / MiB:.1f} MiB)"
)
fig = plot_timelines(
    [budget, fixed],
    titles=[
        f"one batch of 8 sequences: step {oom.step} runs out ({oom.phase})",
        "two micro-batches of 4 sequences: all 4 steps fit",
    ],
    ncols=1,
    width=10,
    height=3.6,
)
plt.show()

# %% [markdown]
# ## AdamW vs SGD with momentum vs Muon
# The jump is the optimizer state, so it scales with how much state an optimizer keeps per
# parameter: AdamW two fp32 moments (8 bytes/param), SGD with momentum one buffer (4), Muon one
# momentum buffer (4) for its matrices. But Muon is meant for 2-D hidden matrices only, so the
# embedding, positional table, norms, biases and head stay with AdamW (V4 §2.4).
# `torch.optim.Muon` is PyTorch's single-device Muon.


# %%
def matrices_and_rest(model):
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks")]
    hidden_ids = {id(p) for p in hidden}
    return hidden, [p for p in model.parameters() if id(p) not in hidden_ids]


def run(kind):
    model, idx, targets = make_run()
    if kind == "AdamW":
        opts = [torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)]
    elif kind == "SGD + momentum":
        opts = [torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, foreach=False)]
    else:
        hidden, rest = matrices_and_rest(model)
        opts = [
            torch.optim.Muon(hidden, lr=0.02, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=1e-3, foreach=False),
        ]
    predicted = predicted_optimizer_state_bytes(opts, DEVICE)
    tl = MemoryTimeline(model, opts, name=kind)
    with tl.record():
        train(model, opts, idx, targets, 4, tl)
    return model, tl, predicted


runs = {}
for kind in ("AdamW", "SGD + momentum", "Muon (+AdamW for the rest)"):
    stage(f"recording {kind} ...")
    runs[kind] = run(kind)
hidden, rest = matrices_and_rest(runs["AdamW"][0])
n_hidden = sum(p.numel() for p in hidden)
print(f"\nMuon's matrices hold {n_hidden:,} of the {N:,} parameters ({n_hidden / N:.0%})")
adamw_state = runs["AdamW"][1].peak("optimizer_state")
ratio = {}
print(f"{'optimizer':>28} {'state MiB':>10} {'predicted':>10} {'step-2 jump':>12} {'vs AdamW':>9}")
for kind, (_, tl, predicted) in runs.items():
    state = tl.peak("optimizer_state")
    jump = tl.peak(step=2) - tl.peak(step=1)
    ratio[kind] = state / adamw_state
    print(
        f"{kind:>28} {state / MiB:10.3f} {predicted / MiB:10.3f} {jump / MiB:12.3f} "
        f"{ratio[kind]:9.1%}"
    )
    assert state == predicted and jump == predicted

# %%
kinds = list(runs)
short = {"AdamW": "AdamW", "SGD + momentum": "SGD + momentum", kinds[2]: "Muon + AdamW"}
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
steps = np.arange(1, 5)
for kind, marker, ls, gray in zip(kinds, "osD", ("-", "--", ":"), ("0.0", "0.35", "0.6")):
    step_peaks = [runs[kind][1].peak(step=s) / MiB for s in steps]
    left.plot(steps, step_peaks, marker=marker, ls=ls, color=gray, ms=7, lw=1.5, label=short[kind])
    left.annotate(
        f"{step_peaks[1]:.1f}",
        (2, step_peaks[1]),
        xytext=(0, 7),
        textcoords="offset points",
        ha="center",
        fontsize=10,
    )
first = runs[kinds[0]][1].peak(step=1) / MiB
left.annotate(
    f"{first:.1f} (all three)", (1, first), xytext=(8, -3), textcoords="offset points", fontsize=10
)
left.set_ylim(first - 2, max(runs[k][1].peak(step=2) for k in kinds) / MiB + 2)
left.set_xticks(steps, [f"step {s}" for s in steps])
left.set_ylabel("peak allocated (MiB)")
left.set_title("peak per step: equal in step 1, apart from step 2 on")
left.legend(loc="lower right", fontsize=10)
states = [runs[k][1].peak("optimizer_state") / MiB for k in kinds]
right.barh([short[k] for k in kinds], states, color=COLORS["optimizer_state"])
for y, (k, s) in enumerate(zip(kinds, states)):
    right.text(s, y, f" {s:.3f} MiB ({ratio[k]:.0%})", va="center", fontsize=10)
right.set_xlim(0, 1.45 * max(states))
right.invert_yaxis()
right.set_xlabel("optimizer state (MiB) = the step-2 jump")
right.set_title("state, as a share of AdamW's")
fig.tight_layout()
plt.show()

sgd, muon = ratio["SGD + momentum"], ratio[kinds[2]]
print(
    f"SGD with momentum keeps {sgd:.0%} of AdamW's state: one buffer per parameter, not two. "
    f"Muon keeps {muon:.0%}, not {sgd:.0%}: its one buffer covers only the blocks' matrices "
    f"({n_hidden / N:.0%} of the parameters); the embedding, positional table, norms and head stay "
    f"with AdamW and its two moments."
)

# %% [markdown]
# Muon's other catch is that its update is a whole-matrix operation, so ZeRO cannot shard its state
# element-wise the way it shards AdamW's: the subject of `muon_zero.py` and
# `notebooks/01_muon_zero.ipynb`.
#
# **On a GPU** (this notebook picks CUDA when it is there) the recorder also draws the real
# `memory_allocated` and `memory_reserved` lines beside the modelled one, each sampled after the
# free it follows has taken effect; AdamW's `step` counters then stay on the CPU, which is why the
# prediction above is 8N there. That path has not yet run on a GPU in this project.
