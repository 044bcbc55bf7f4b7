# %% [markdown]
# # The first-step anomaly
#
# A training step moves memory in a fixed rhythm: **activations** rise through the forward pass; in the
# backward pass **gradients** appear while the activations are released; the **optimizer step** needs every
# gradient at once and updates its **state**. Yet the first step of a run does not look like the others.
# PyTorch optimizers create their state lazily, inside the first `step()`: AdamW's two fp32 moments
# appear there, and from then on they sit under every later step. A first step can fit in memory and the
# second run out. On a GPU the caching allocator adds its own first-step set-up (segments reserved once,
# then reused), so `reserved` stays above `allocated`.
#
# This notebook records that on the CPU with `memory_timeline.py`: every tensor storage, categorised,
# with a **modelled** CUDA caching allocator for the reserved line (a model, labelled so in every plot).
# It predicts the step-2 jump from the model's size before running, checks it against the measurement,
# puts the run under a memory budget where step 1 fits and step 2 does not, and compares AdamW, SGD with
# momentum and Muon. Course topics: the training memory budget (01), ZeRO stages (07).

# %%
import math

import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F

from memory_timeline import (MemoryTimeline, SimulatedOutOfMemoryError, plot_timeline, plot_timelines,
                             MiB)

plt.rcParams["figure.dpi"] = 72
torch.set_num_threads(2)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
print("device:", DEVICE)

# %% [markdown]
# ## A small transformer
# Two pre-norm blocks (causal attention + MLP) and a 4096-token vocabulary, in fp32. Small enough for a
# CPU, with a batch large enough that activations, not weights, dominate the forward and backward.

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
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
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
# With N fp32 parameters in T tensors: parameters 4N bytes, gradients 4N, AdamW state 8N (two moments)
# plus one 4-byte `step` counter per tensor. Step 1 starts with no state; from step 2 on the state is
# there throughout, so **the step-2 peak is the step-1 peak plus the optimizer state** — as long as the
# step-1 peak falls in the backward pass (activations + gradients), not in the optimizer step itself.

# %%
model, idx, targets = make_run()
N = sum(p.numel() for p in model.parameters())
T = len(list(model.parameters()))
adamw_state = 8 * N + 4 * T
print(f"N = {N:,} parameters in {T} tensors")
print(f"parameters {4 * N / MiB:.3f} MiB, gradients {4 * N / MiB:.3f} MiB, "
      f"AdamW state {adamw_state / MiB:.3f} MiB  <- predicted step-2 jump")

# %%
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
adamw = MemoryTimeline(model, opt, name="AdamW")
with adamw.record():
    train(model, [opt], idx, targets, 4, adamw)

peaks = [adamw.peak(step=s) for s in (1, 2, 3, 4)]
measured_jump = peaks[1] - peaks[0]
print("peak allocated per step (MiB):", [round(p / MiB, 3) for p in peaks])
print(f"measured step-2 jump {measured_jump / MiB:.4f} MiB vs predicted {adamw_state / MiB:.4f} MiB "
      f"-> error {abs(measured_jump - adamw_state) / adamw_state:.3%}")
assert abs(measured_jump - adamw_state) <= 0.01 * adamw_state
assert peaks[1] == peaks[2] == peaks[3], "from step 2 on every step looks the same"
print(adamw.summary())

# %%
ax = plot_timeline(adamw, title="AdamW, 4 steps: the optimizer state appears inside step 1's optimizer phase")
ax.figure.set_size_inches(11, 4)
ax.figure.tight_layout()
plt.show()

# %% [markdown]
# Read the plot left to right. In step 1 the forward pass stacks activations (red) on the parameters
# (blue); the backward pass turns them into gradients (orange); the optimizer phase creates AdamW's state
# (green) and it **never leaves**. Steps 2–4 repeat step 1's forward and backward on top of that green
# band: the same shape, raised by exactly the state's bytes. The thin black line is the total. The dashed line is the **modelled** CUDA
# caching allocator: it reserves whole segments (2 MiB for small tensors, 20 MiB for medium ones) and
# keeps them after the tensors die, so it steps up in step 1, once more in step 2 when the state needs room, and then stays flat.

# %%
print("modelled reserved peak per step (MiB):", [adamw.peak_reserved_model(step=s) / MiB for s in (1, 2, 3, 4)])
print("allocated peak per step (MiB):        ", [round(adamw.peak(step=s) / MiB, 2) for s in (1, 2, 3, 4)])

# %% [markdown]
# ## A budget where step 1 fits and step 2 runs out
# Give the run a memory limit between the step-1 and step-2 peaks of the (modelled) reserved memory. On a
# GPU the same experiment is `torch.cuda.set_per_process_memory_fraction`; here the recorder raises the
# out-of-memory error itself when its allocator model would need a segment beyond the limit.

# %%
step1_reserved = adamw.peak_reserved_model(step=1)
step2_reserved = adamw.peak_reserved_model(step=2)
limit = (step1_reserved + step2_reserved) // 2
print(f"step 1 needs {step1_reserved / MiB:.0f} MiB reserved, step 2 {step2_reserved / MiB:.0f} MiB; "
      f"limit {limit / MiB:.0f} MiB")

model, idx, targets = make_run()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
budget = MemoryTimeline(model, opt, limit_bytes=limit, name="AdamW under a budget")
try:
    with budget.record():
        train(model, [opt], idx, targets, 4, budget)
    raise AssertionError("expected the second step to run out of memory")
except SimulatedOutOfMemoryError as error:
    failed_phase, failed_step = budget.phases[-1][:2]
    print(f"step {failed_step} ran out in its {failed_phase} pass:\n  {error}")
assert failed_step == 2

# %% [markdown]
# **What fixes it.** Anything that makes room for the state that arrives in step 1's optimizer phase:
# fewer activations (smaller micro-batches with gradient accumulation, or activation checkpointing:
# `tensor_ckpt.py`), a smaller state (SGD with momentum or Muon keep one buffer, not two), or a sharded
# state (ZeRO-1 keeps 1/N of it per rank: `muon_zero.py`). Here, two micro-batches of 4 sequences halve
# the activations and the same budget holds for all four steps with the same effective batch (the logits, 8×128×4096
# floats, are the largest activation here).

# %%
model, idx, targets = make_run()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
fixed = MemoryTimeline(model, opt, limit_bytes=limit, name="AdamW, 2 micro-batches, same budget")
with fixed.record():
    train(model, [opt], idx, targets, 4, fixed, micro_batches=2)
print(f"peak modelled reserved {fixed.peak_reserved_model() / MiB:.0f} MiB <= limit {limit / MiB:.0f} MiB")
fig = plot_timelines([budget, fixed], titles=["budget: step 2 runs out", "2 micro-batches: fits"])
plt.show()

# %% [markdown]
# ## AdamW vs SGD with momentum vs Muon
# The jump is the optimizer state, so it scales with how much state an optimizer keeps per parameter:
# AdamW two fp32 moments (8 bytes/param), SGD with momentum one buffer (4), Muon one momentum buffer (4)
# for its matrices — and Muon is meant for 2-D matrices only, so the embedding, positional table, norms,
# biases and head stay with AdamW (V4 §2.4). `torch.optim.Muon` is PyTorch's single-device Muon.

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
        opts = [torch.optim.Muon(hidden, lr=0.02, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=1e-3, foreach=False)]
    tl = MemoryTimeline(model, opts, name=kind)
    with tl.record():
        train(model, opts, idx, targets, 4, tl)
    return model, tl


runs = {kind: run(kind) for kind in ("AdamW", "SGD + momentum", "Muon (+AdamW for the rest)")}
hidden, rest = matrices_and_rest(runs["AdamW"][0])
predicted = {"AdamW": 8 * N + 4 * T, "SGD + momentum": 4 * N,
             "Muon (+AdamW for the rest)": 4 * sum(p.numel() for p in hidden)
             + 8 * sum(p.numel() for p in rest) + 4 * len(rest)}
print(f"{'optimizer':>28} {'state MiB':>10} {'predicted':>10} {'step-2 jump MiB':>16}")
for kind, (_, tl) in runs.items():
    jump = tl.peak(step=2) - tl.peak(step=1)
    print(f"{kind:>28} {tl.peak('optimizer_state') / MiB:10.3f} {predicted[kind] / MiB:10.3f} {jump / MiB:16.3f}")
    assert tl.peak("optimizer_state") == predicted[kind]

# %%
fig = plot_timelines([tl for _, tl in runs.values()], titles=list(runs))
plt.show()
fig, ax = plt.subplots(figsize=(6, 2.6))
kinds = list(runs)
ax.barh(kinds, [runs[k][1].peak("optimizer_state") / MiB for k in kinds], color="#55a868")
ax.set_xlabel("optimizer state (MiB) = size of the step-2 jump")
ax.invert_yaxis()
plt.tight_layout()
plt.show()

# %% [markdown]
# The jump shrinks with the state: SGD with momentum and Muon keep half of AdamW's. Muon's catch is that
# its update is a whole-matrix operation, so ZeRO cannot shard its state element-wise the way it shards
# AdamW's — the subject of `muon_zero.py` and `notebooks/01_muon_zero.ipynb`.
#
# **On a GPU** (this notebook picks CUDA when it is there) the recorder also draws the real
# `memory_allocated` and `memory_reserved` lines beside the modelled one; the allocator's set-up in step 1
# (segments reserved while activations peak, then reused) shows as `reserved` rising in step 1 and staying.
