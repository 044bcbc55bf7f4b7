# %% [markdown]
# # Composing a parallelism layout from a memory and bandwidth budget
#
# **What you will be able to do** after this notebook:
# 1. List every **layout** pp × cp × dp of a world of ranks and, for each, predict the bytes one
#    rank holds by category: parameters, gradients, optimizer state (from MuonZeRO's own plan) and
#    activations (with mHC's n lanes, the tensors tensor_ckpt forgets, and the micro-batches 1F1B
#    keeps in flight).
# 2. Predict the bytes each link carries per step (pipeline sends, the CP halo and all-gather,
#    the gradient reduce-scatter and parameter all-gather), turn them into a communication time
#    from intra- and inter-node bandwidths, and read off which layouts fit which device, for this
#    model and for a V4-scale one.
# 3. Check the prediction against two layouts run here: per-rank memory timelines, measured peaks
#    and counted bytes next to the budget's numbers.
#
# Course syllabus: topic **10, composing a parallelism layout from a memory and bandwidth budget**
# (data, pipeline and shard dimensions interact non-linearly). The graded exercise is the budget's
# `link_bytes` in `compose.py` ([ASSIGNMENTS.md](../ASSIGNMENTS.md), the compose.py assignment):
# what each link carries per step. It composes the four chapters: notebooks 01 (MuonZeRO), 02
# (mHC and its pipeline), 03 (compressed attention under CP) and 04 (tensor checkpointing). Terms
# in bold are defined where they first appear and in the [README's glossary](../README.md#glossary).
# Ranks, stages and coordinates are numbered from 0 (they are indices), training steps from 1.

# %%
import dataclasses
import json
import os
import tempfile
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

import compose
import compose_budget
from memory.memory_timeline import COLORS, MiB
from memory.plots import plot_timelines
from notebooks.checks import check, number, one_of
from tests.harness import run_torchrun

plt.rcParams.update({"figure.dpi": 110, "font.size": 10})
torch.set_num_threads(2)
T0 = time.perf_counter()
GB = 1e9
CATEGORY_COLOR = {  # the recorder's palette, by the budget's category names
    "parameters": COLORS["parameters"],
    "gradients": COLORS["gradients"],
    "optimizer": COLORS["optimizer_state"],
    "activations": COLORS["activations"],
}


def stage(what):
    print(f"[{time.perf_counter() - T0:6.1f} s] {what}", flush=True)


# %% [markdown]
# ## 1. The picture first: one world, three dimensions
# A **layout** splits a world of W ranks (processes, one per device) along three dimensions whose
# sizes multiply to W. **pp** (pipeline parallelism) cuts the layers into pp **stages**; stage p
# sends each micro-batch's n-lane stream to stage p + 1 and gets its gradient back. **cp**
# (context parallelism) cuts every sequence into cp shards of T/cp tokens; inside every attention
# layer a rank borrows a **halo** of raw rows from its left neighbour and all-gathers the
# compressed entries. **dp** (data parallelism) gives each replica its own sequences. The ranks
# that hold the same stage (cp × dp of them) average their gradients and share the optimizer
# state: MuonZeRO reduce-scatters the gradients over them and all-gathers the updated parameters.
# The mesh numbers rank (p, c, d) as (p·cp + c)·dp + d: dp innermost, so a stage's ranks are
# neighbours. Two layouts of 4 ranks:

# %%
LINK_COLOR = {"pp_send": "#4c72b0", "cp": "#dd8452", "stage": "#55a868"}


def draw_mesh(ax, pp, cp, dp, title):
    """The ranks of one layout as a grid (rows: stages, or CP ranks when pp = 1), the stage's
    MuonZeRO group shaded, the pipeline and halo links drawn."""
    rows, cols = (pp, cp * dp) if pp > 1 else (cp, dp)

    def xy(p, c, d):
        row, col = (p, c * dp + d) if pp > 1 else (c, d)
        return col * 2.4, (rows - 1 - row) * 1.9

    for p in range(pp):  # the stage group: every rank of one stage
        x0, y0 = xy(p, 0, 0)
        height = 1.35 if pp > 1 else 1.9 * (cp - 1) + 1.35
        ax.add_patch(FancyBboxPatch((x0 - 0.3, y0 - 0.3 - (height - 1.35)), cols * 2.4 - 0.8,
                                    height, boxstyle="round,pad=0.05", color=LINK_COLOR["stage"],
                                    alpha=0.15, lw=0))  # fmt: skip
        ax.text(x0 + cols * 2.4 - 1.0, y0 + 1.1, f"stage {p}: MuonZeRO group", ha="right",
                fontsize=8, color=LINK_COLOR["stage"])  # fmt: skip
    for p, c, d in [(p, c, d) for p in range(pp) for c in range(cp) for d in range(dp)]:
        x, y = xy(p, c, d)
        ax.add_patch(FancyBboxPatch((x, y), 1.2, 0.7, boxstyle="round,pad=0.05", fc="white",
                                    ec="0.2"))  # fmt: skip
        ax.text(x + 0.6, y + 0.47, f"rank {(p * cp + c) * dp + d}", ha="center", fontweight="bold")
        ax.text(x + 0.6, y + 0.15, f"(p={p}, c={c}, d={d})", ha="center", fontsize=8)
        if p + 1 < pp:  # the pipeline link to the next stage, same c and d
            x2, y2 = xy(p + 1, c, d)
            ax.add_patch(FancyArrowPatch((x + 0.45, y - 0.05), (x2 + 0.45, y2 + 0.75),
                                         arrowstyle="-|>", mutation_scale=12,
                                         color=LINK_COLOR["pp_send"], lw=1.6))  # fmt: skip
            ax.add_patch(FancyArrowPatch((x2 + 0.75, y2 + 0.75), (x + 0.75, y - 0.05),
                                         arrowstyle="-|>", mutation_scale=12,
                                         color=LINK_COLOR["pp_send"], lw=1.0, ls="--"))  # fmt: skip
        if c + 1 < cp:  # the halo to the next CP rank, same p and d
            x2, y2 = xy(p, c + 1, d)
            start, end = ((x + 1.25, y + 0.35), (x2 - 0.05, y2 + 0.35)) if pp > 1 else (
                (x + 0.6, y - 0.05), (x2 + 0.6, y2 + 0.75))  # fmt: skip
            ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12,
                                         color=LINK_COLOR["cp"], lw=1.6))  # fmt: skip
    ax.set_xlim(-0.6, cols * 2.4)
    ax.set_ylim(-0.6, rows * 1.9)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title)


fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
draw_mesh(axes[0], 2, 2, 1, "pp = 2 × cp = 2 × dp = 1")
draw_mesh(axes[1], 1, 2, 2, "pp = 1 × cp = 2 × dp = 2")
handles = [
    plt.Line2D([], [], color=LINK_COLOR["pp_send"], lw=1.6, label="pp_send: stream down"),
    plt.Line2D([], [], color=LINK_COLOR["pp_send"], lw=1.0, ls="--", label="its gradient up"),
    plt.Line2D([], [], color=LINK_COLOR["cp"], lw=1.6, label="cp_halo to the next CP rank"),
    plt.Rectangle((0, 0), 1, 1, color=LINK_COLOR["stage"], alpha=0.3,
                  label="a stage's ranks: gradients, optimizer state"),
]  # fmt: skip
fig.legend(handles=handles, loc="lower center", ncol=4, frameon=False)
fig.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()

# %% [markdown]
# **What to look at:** on the left (rows are stages) the pipeline link joins ranks 0 and 2 (and 1
# and 3) and the CP link joins 0 and 1 inside a stage, so each stage's MuonZeRO group is 2 ranks;
# on the right (rows are CP ranks, columns replicas) there is no pipeline link, the halo joins 0
# and 2 (and 1 and 3), and all 4 ranks form one group, over which the gradients of the whole
# model are reduced. Every layout moves different bytes over different links.
#
# ## 2. The budget of every layout of 4 ranks
# `compose_budget.budget_table` predicts, for each factorisation, what each rank holds and sends,
# from the tensors the chapters make (each formula names them in its docstring): parameters and
# gradients of the rank's stage in fp32, MuonZeRO's momentum for the matrices its plan gives the
# rank plus AdamW's two moments, and the activations of the micro-batches in flight. A layout
# **fits** when its largest rank's sum stays under the device memory. The communication time
# sends each link's bytes one after another at that link's bandwidth: it leaves out compute,
# the overlap of communication with compute, per-message latency and the pipeline bubble, so it
# ranks layouts by what they move, not by how long a step takes.

# %%
cfg = compose.ComposeConfig()
print(f"the capstone model: {cfg.n_layers} sublayers (CSA, MoE, HCA, MoE, ...), C = {cfg.dim}, "
      f"n_hc = {cfg.n_hc}, T = {cfg.seq_len}, {cfg.batch} sequences per replica in "
      f"{cfg.n_micro} micro-batches; "
      f"{sum(t.numel for t in compose_budget.model_tensors(cfg)):,} parameters")  # fmt: skip
toy_device = 16 * MiB  # a small device, so that the table has a layout that does not fit
rows = compose_budget.budget_table(cfg, 4, toy_device, 10 * GB, 1 * GB, ranks_per_node=2)
print(
    f"device {toy_device / MiB:.0f} MiB; intra-node 10 GB/s, inter-node 1 GB/s, 2 ranks per "
    "node (assumed); gradients in bf16 (V4's grad_sync); columns: the largest rank's bytes, "
    "the busiest rank's bytes per step\n"
)
print(compose_budget.format_budget(rows))
print(
    f"\nfit in {toy_device / MiB:.0f} MiB: {', '.join(r.name for r in rows if r.fits)}; "
    f"do not: {', '.join(r.name for r in rows if not r.fits)}"
)

# %%
names = [r.name for r in rows]
fig, ax = plt.subplots(figsize=(9, 3.6))
bottom = np.zeros(len(rows))
for key, color in CATEGORY_COLOR.items():
    worst = [max(r.held, key=lambda h: sum(h.values()))[key] / MiB for r in rows]
    ax.bar(names, worst, bottom=bottom, color=color, label=key)
    bottom += worst
ax.axhline(toy_device / MiB, color="k", ls="--", lw=1)
ax.text(len(rows) - 0.5, toy_device / MiB, " device", va="bottom", ha="right")
ax.set_ylabel("MiB on the fullest rank")
ax.set_xlabel("layout pp x cp x dp (ranked: fitting and fastest first)")
ax.legend(ncol=4, fontsize=9, loc="upper left")
ax.set_title("What one rank holds, predicted")
plt.show()

# %% [markdown]
# **What to look at:** the red activation band dominates at this size and shrinks with cp (each
# rank holds T/cp tokens) but not with pp (stage 0 keeps pp micro-batches in flight, each of
# fewer layers); the parameter and gradient bands shrink only with pp, the optimizer band with
# cp × dp. The bars above the dashed device line are the layouts the table marks DOES NOT FIT.
#
# ### Exercise 1 (count): how many layouts?
# A layout is an ordered triple (pp, cp, dp) with pp · cp · dp = W. How many are there for a
# world of W = 12 ranks (before asking which the model accepts)?

# %%
answer_layouts_12 = None  # the number of (pp, cp, dp) with pp * cp * dp = 12

# %%
# check: answer_layouts_12
check(
    "answer_layouts_12",
    answer_layouts_12,
    number(len(compose_budget.factorisations(12)), unit="layouts",
           hint="12 = 2 x 2 x 3: count how the two 2s and the 3 can be dealt to three "
           "dimensions (order matters)"),
)  # fmt: skip

# %% [markdown]
# ### Exercise 2 (predict): what a pipeline stage sends
# In the layout 4 x 1 x 1 (four stages, no CP, no DP), stage 1 sends every micro-batch's stream
# [B/n_micro, T, n_hc, C] in fp32 to stage 2, and receives its gradient from stage 2 and sends the
# gradient of its own input to stage 0. How many bytes does stage 1 send per step on the
# pipeline links?

# %%
answer_stage1_bytes = None  # bytes stage 1 sends per step (an int)

# %%
# check: answer_stage1_bytes
pipeline4 = compose_budget.layout_budget(cfg, 4, 1, 1, toy_device, 10 * GB, 1 * GB, 2)
check(
    "answer_stage1_bytes",
    answer_stage1_bytes,
    number(pipeline4.sent[1]["pp_send"], unit="B",
           hint="an interior stage sends in both directions: n_micro streams forward and as "
           "many gradients backward, each B/n_micro x T x n_hc x C x 4 bytes"),
)  # fmt: skip

# %% [markdown]
# ### Exercise 3 (read the budget): the smallest peak
# Which layout of 4 ranks has the smallest predicted peak per rank? Answer with its name as the
# table prints it, e.g. `"2x2x1"`.

# %%
answer_smallest_peak = None  # "PPxCPxDP"

# %%
# check: answer_smallest_peak
smallest = min((r for r in rows if not r.problem), key=lambda r: r.peak_bytes)
check(
    "answer_smallest_peak",
    answer_smallest_peak,
    one_of([smallest.name], hint="compare the peak column: which dimension divides the largest "
           "band of the figure above?"),
)  # fmt: skip

# %% [markdown]
# ## 3. What each link carries
# The budget's bytes per step and link are what the chapters send: the pipeline's streams
# (mhc.StageLinks), the CP halo of `cp_compress.halo_rows` raw rows plus the window's rows and
# the all-gather of s/m + 1 entries per rank (cp_compress's protocol), and MuonZeRO's all-to-all
# of padded gradient chunks (bf16 under V4's stochastic rounding, fp32 in the exact proof) and
# all-gather of the updated parameters.

# %%
links = compose.SENT
fig, ax = plt.subplots(figsize=(10, 3.6))
width = 0.8 / len(links)
for k, link in enumerate(links):
    busiest = [max(s[link] for s in r.sent) / 2**10 for r in rows]
    ax.bar(np.arange(len(rows)) + (k - 2) * width, np.maximum(busiest, 1e-3), width, label=link)
ax.set_yscale("log")
ax.set_ylim(1, None)
ax.set_xticks(np.arange(len(rows)), names)
ax.set_ylabel("KiB per step (busiest rank)")
ax.set_xlabel("layout pp x cp x dp")
ax.legend(ncol=3, fontsize=9)
ax.set_title("Bytes per step on each link, predicted (log scale; bars absent: nothing sent)")
plt.show()
both = [r for r in rows if r.cp > 1 and r.cp * r.dp > 1]
ratio = min(max(s["grad_reduce_scatter"] for s in r.sent)
            / max(s["cp_halo"] + s["cp_gather"] for s in r.sent) for r in both)  # fmt: skip
print(f"with CP, the gradient reduce-scatter alone is at least {ratio:.1f} x the CP traffic")

# %% [markdown]
# **What to look at:** the CP links carry tens of KiB, below the gradient reduce-scatter and
# parameter all-gather (the printed ratio), which are the same size for every layout with the
# same pipeline depth (the whole stage moves once per step) and vanish without data or context
# parallelism (4 x 1 x 1). The pipeline's bytes grow with its depth.
#
# ## 4. At V4's scale
# The same procedure on the same model at the sizes of DeepSeek-V4-Flash's public configuration:
# hidden size 4096, 64 query heads of dim 512, a 128-token window, an indexer of 64 heads of dim
# 128 with top-k 512, m = 4 (CSA) and 128 (HCA), 256 experts of intermediate size 2048 with 6
# active, a vocabulary of 129,280 and n_hc = 4 (V4 report; the model's config). Two choices are
# ours and change the numbers: V4-Flash has 43 layers; we take 44 (88 sublayers) so that
# pipelines of 1, 2, 4, 8, 11, 22 and 44 stages divide them; and our attention has full-rank
# query and output projections where V4 uses low-rank ones. Sequences of 8192 tokens, 8 per
# replica in 8 micro-batches; everything in fp32, as this course trains. Devices: 80 GB (an
# A100/H100) and 141 GB (an H200); 8 per node, NVLink at 450 GB/s and 50 GB/s (400 Gb/s
# InfiniBand) between nodes: typical figures, assumed.

# %%
v4 = dataclasses.replace(
    cfg, vocab_size=129280, dim=4096, n_layers=88, seq_len=8192, batch=8, n_micro=8, n_heads=64,
    head_dim=512, csa_ratio=4, hca_ratio=128, window=128, top_k=512, index_heads=64,
    index_dim=128, n_experts=256, experts_per_token=6, expert_hidden=2048,
)  # fmt: skip
v4_params = sum(t.numel for t in compose_budget.model_tensors(v4))
print(f"V4-scale model: {v4_params / 1e9:.1f} B parameters (V4-Flash: 284 B)")
stage("V4-scale budget of 256 ranks")
v4_rows = compose_budget.budget_table(v4, 256, 141 * GB, 450 * GB, 50 * GB, ranks_per_node=8)
stage("done")
runnable = [r for r in v4_rows if not r.problem]
print(
    f"{len(v4_rows)} layouts of 256 ranks, {len(runnable)} the model accepts, "
    f"{sum(r.fits for r in runnable)} fit in 141 GB, "
    f"{sum(r.peak_bytes <= 80 * GB for r in runnable)} in 80 GB; the five smallest peaks:\n"
)
print(compose_budget.format_budget(sorted(runnable, key=lambda r: r.peak_bytes)[:5]))

# %%
best = {}
for r in runnable:
    if r.pp not in best or r.peak_bytes < best[r.pp].peak_bytes:
        best[r.pp] = r
deep = {  # deeper pipelines on 8 CP ranks each, one sequence per micro-batch (1F1B: n_micro >= pp)
    pp: compose_budget.layout_budget(dataclasses.replace(v4, batch=pp, n_micro=pp), pp, 8, 1,
                                     141 * GB, 450 * GB, 50 * GB, 8)
    for pp in (11, 22, 44)
}  # fmt: skip
print(", ".join(f"{r.name} ({r.pp * r.cp} ranks): peak {r.peak_bytes / GB:.0f} GB"
                for r in deep.values()))  # fmt: skip
chosen = [best[pp] for pp in sorted(best)] + [deep[pp] for pp in sorted(deep)]
fig, ax = plt.subplots(figsize=(9, 3.8))
bottom = np.zeros(len(chosen))
for key, color in CATEGORY_COLOR.items():
    worst = [max(r.held, key=lambda h: sum(h.values()))[key] / GB for r in chosen]
    ax.bar([f"{r.name}\n({r.pp * r.cp * r.dp} ranks)" for r in chosen], worst, bottom=bottom,
           color=color, label=key)  # fmt: skip
    bottom += worst
for limit in (80, 141):
    ax.axhline(limit, color="k", ls="--", lw=1)
    ax.text(len(chosen) - 0.5, limit, f" {limit} GB", va="bottom", ha="right")
ax.set_yscale("log")
ax.set_ylabel("GB on the fullest rank (log)")
ax.legend(ncol=4, fontsize=9, loc="upper right")
ax.set_title("V4 scale: the smallest peak at each pipeline depth")
plt.show()

# %% [markdown]
# **What to look at:** the blue and orange bands (fp32 parameters and gradients) are divided only
# by the pipeline depth, because ZeRO here shards only the optimizer state, and with 256 experts
# per MoE layer they are most of the model; at 256 ranks (pipelines of at most 8 stages) they
# alone exceed both devices. Deeper pipelines bring them down, and 1F1B's in-flight
# micro-batches then make stage 0's activations the next band to watch (they are large here
# because this model's MoE applies every expert to every token, as muon_zero.TinyMoE does:
# E / k = 256 / 6 times the work and memory of V4's routed experts). That is the case for
# the dimension this course leaves out, expert
# parallelism (each rank holds a share of the experts, paid for with an all-to-all of tokens), and
# for bf16 weights with fp32 master copies sharded as the optimizer state is.
#
# ### Exercise 4 (predict): how deep a pipeline for V4's weights?
# Parameters and gradients in fp32 are 8 bytes per parameter, divided over the pipeline's stages
# only. Of the depths that divide the 88 sublayers (1, 2, 4, 8, 11, 22, 44, 88), which is the
# smallest for which every stage's parameters and gradients together fit under 80 GB?

# %%
answer_v4_pp = None  # a pipeline depth

# %%
# check: answer_v4_pp
depths = [pp for pp in (1, 2, 4, 8, 11, 22, 44, 88)
          if max(8 * sum(t.numel for t in compose_budget.stage_tensors(v4, pp, p))
                 for p in range(pp)) <= 80 * GB]  # fmt: skip
check(
    "answer_v4_pp",
    answer_v4_pp,
    one_of([depths[0]], hint=f"{v4_params / 1e9:.0f} B parameters x 8 bytes, shared by the "
           "stages: find the first depth that brings one share under 80 GB"),
)  # fmt: skip

# %% [markdown]
# ## 5. Two layouts run here, against the prediction
# `compose.py` trains the model on a layout of torchrun ranks, records the first steps with
# memory_timeline's recorder (this stage's parameters, gradients, optimizer state, activations
# and temporaries) and counts the bytes each collective sends where it is called. Two layouts of
# 4 CPU ranks, 2 steps each; gradients synchronised in fp32, as in the exact proof.
# (These cells need the whole compose.py, model and demo; the budget alone cannot run them.)

# %%
RUNS = {}
if hasattr(compose, "run_layout"):
    out_dir = tempfile.mkdtemp()
    for layout in ((2, 2, 1), (1, 2, 2)):
        pp, cp, dp = layout
        path = os.path.join(out_dir, f"{pp}x{cp}x{dp}.json")
        stage(f"running compose.py --pp {pp} --cp {cp} --dp {dp}")
        run_torchrun(
            "compose.py",
            nproc=4,
            timeout=400,
            args=("--pp", pp, "--cp", cp, "--dp", dp, "--steps", 2, "--json", path),
        )
        with open(path) as f:
            RUNS[layout] = json.load(f)
    stage("both layouts ran")
else:
    print("compose.py here holds only the budget: merge the model and demo to run this section")

# %%
for (pp, cp, dp), run in RUNS.items():
    timelines = [torch.load(r["timeline"], weights_only=False) for r in run["ranks"]]
    titles = [f"rank {r['rank']} (p, c, d) = {tuple(r['coords'])}" for r in run["ranks"]]
    fig = plot_timelines(timelines, titles, ncols=2, width=5.5, height=3.2)
    fig.suptitle(f"layout {pp} x {cp} x {dp}: memory per rank, steps 1 and 2", y=1.02)
    plt.show()

# %% [markdown]
# **What to look at:** on every rank the green optimizer state appears only at the end of step 1,
# so step 2 starts from a higher baseline and peaks higher, and the dashed line (the reserved
# memory a CUDA caching allocator would hold, modelled) jumps at step 2: the first-step anomaly
# of notebook 00, now on every rank of a layout. The purple humps, one per micro-batch, are what
# the budget calls activations: the recorder files the tensors saved inside mHC's recomputed
# blocks (an autograd Function of their own) as temporaries, and the whole 1F1B step as one
# forward phase. In 2 x 2 x 1 the two ranks of stage 0 peak above those of stage 1 (the first
# stage keeps two micro-batches in flight, the last one); in 1 x 2 x 2 the four ranks hold the
# whole model and look alike.

# %%
for (pp, cp, dp), run in RUNS.items():
    cfg_run = compose.ComposeConfig(**run["config"])
    predicted = compose_budget.layout_budget(cfg_run, pp, cp, dp, 2**40, 10 * GB, 1 * GB, 4, "fp32")
    print(f"layout {pp} x {cp} x {dp}: MiB held, measured / predicted (peak: step 2's)")
    print(f"{'rank':>4}  {'peak':>13}  " + "  ".join(f"{k:>13}" for k in compose_budget.HELD))
    for r in run["ranks"]:
        mine = predicted.held[r["rank"]]
        cells = [
            f"{r['held_bytes'][k] / MiB:6.2f}/{mine[k] / MiB:6.2f}" for k in compose_budget.HELD
        ]
        peak = f"{max(r['peak_bytes']) / MiB:6.2f}/{sum(mine.values()) / MiB:6.2f}"
        print(f"{r['rank']:>4}  {peak:>13}  " + "  ".join(f"{c:>13}" for c in cells))
    exact = all(r["sent_bytes"][k] == predicted.sent[r["rank"]][k]
                for r in run["ranks"] for k in compose.SENT)  # fmt: skip
    counted = run["ranks"][0]["sent_bytes"]
    print("rank 0 bytes per step, counted / predicted: " + ", ".join(
        f"{k} {counted[k]:,}/{predicted.sent[0][k]:,}" for k in compose.SENT))  # fmt: skip
    print(f"every link of every rank counted exactly as predicted: {exact}\n")

# %%
if RUNS:
    fig, ax = plt.subplots(figsize=(6, 4.4))
    for key, color in CATEGORY_COLOR.items():
        for (pp, cp, dp), run in RUNS.items():
            cfg_run = compose.ComposeConfig(**run["config"])
            predicted = compose_budget.layout_budget(cfg_run, pp, cp, dp, 2**40, 1, 1, 4, "fp32")
            got = [r["held_bytes"][key] / MiB for r in run["ranks"]]
            want = [predicted.held[r["rank"]][key] / MiB for r in run["ranks"]]
            ax.scatter(want, got, color=color, marker="o" if pp == 2 else "s", s=30,
                       label=f"{key} ({pp}x{cp}x{dp})")  # fmt: skip
    top = ax.get_xlim()[1]
    ax.plot([0.1, top], [0.1, top], color="0.5", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted MiB (budget)")
    ax.set_ylabel("measured MiB (recorder)")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("Every rank and category, measured against predicted")
    plt.show()

# %% [markdown]
# **What to look at:** parameters, gradients and optimizer state sit on the diagonal (they are
# the same tensors, counted the same way); the activations sit slightly above it, because the
# recorder also counts the temporaries alive inside the operation running at the peak, of which
# the budget adds only the MoE's. The peaks add the optimizer step's own temporaries in step 2.
#
# ## Takeaway
# A layout is chosen by arithmetic before it is run. Parameters and gradients divide by the
# pipeline depth, the optimizer state by the ranks that share a stage (MuonZeRO owns whole
# matrices, so its plan, not W, sets each rank's share), activations by the context size, while
# 1F1B multiplies them on the first stages by the micro-batches in flight. On the links, the
# pipeline carries the n-lane stream (n times a residual model's), CP a small halo and an
# all-gather of compressed entries, and the stage group the whole stage's gradients and weights
# once per step. On this model the budget predicts parameters, gradients, optimizer state and
# every link's bytes exactly and activations within the temporaries it leaves out; at V4's scale
# the same arithmetic shows that these four techniques alone cannot hold the experts, which is
# why V4 adds expert parallelism.
