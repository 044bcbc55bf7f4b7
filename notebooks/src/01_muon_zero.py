# %% [markdown]
# # Muon under ZeRO: whole matrices on flat shards (DeepSeek-V4 §3.4.1)
#
# **What you will be able to do** after this notebook:
# 1. Explain why ZeRO's flat, equal shards are exact for AdamW but break Muon, whose update needs
#    a whole matrix, and draw the alternative: each rank owns whole matrices, in a padded bucket.
# 2. Predict, for a list of matrix shapes and a ZeRO width, which rank owns what, how much padding
#    the plan adds, and how many bytes of optimizer state each rank keeps.
# 3. Explain why V4 rounds bf16 gradients stochastically and sums them in fp32 after one
#    all-to-all, instead of summing in bf16 around a ring.
#
# Course syllabus: topic **07, ZeRO stages** (sharding the optimizer state), with topic **02,
# fp16 and bf16** (the mantissa budget) and topic **06, ring all-reduce** (what a ring costs).
# The graded exercise is [assignment 2 in docs/assignments.md][a2]: you write Newton-Schulz, the
# packing, the expert split, stochastic rounding and the sharded step of `muon_zero.py`. Terms
# in bold are defined where they first appear and in the [glossary](../docs/GLOSSARY.md);
# "V4 §3.4.1" is a section of the DeepSeek-V4 technical report. Steps are numbered from 1.
#
# Every number in this notebook carries its evidence: [MEASURED] on this CPU when the notebook
# ran, [PAPER] for DeepSeek-V4's own figures, [DERIVED] for what follows by arithmetic; the
# [evidence ledger](../docs/EVIDENCE.md) defines the tags and says where each figure comes from.
#
# [a2]: ../docs/assignments.md#2-muon_zeropy-muons-whole-matrix-update-under-zero-sharding-v4-341

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

import muon_zero as mz
from benchmarks import bench_muon_zero as bench  # the V4-Flash-like inventory
from memory.memory_timeline import MiB
from notebooks.checks import check, number
from tools.spawn import run_ranks  # real gloo ranks, as the tests use

plt.rcParams.update({"figure.dpi": 110, "font.size": 10, "legend.fontsize": 10})
torch.set_num_threads(2)
T0 = time.perf_counter()


def stage(text):
    print(f"[{time.perf_counter() - T0:5.1f} s] {text}", flush=True)


# %% [markdown]
# ## 1. The picture first: a flat shard cuts a matrix
# A data-parallel run keeps a full copy of the model on every rank (one process per device).
# The optimizer's running statistics, its **optimizer state**, are often the largest part of that
# copy. **ZeRO** (Zero Redundancy Optimizer, stage 1) stops the duplication: it lays every
# parameter end to end into one **flat vector**, cuts it into equal pieces, one per rank, and each
# rank keeps the state of, and computes the update for, its piece only. The number of ranks
# sharing the pieces is the **ZeRO width** (`zero_width` in the code).
#
# For AdamW this is exact: its update of each number depends only on that number's gradient, so
# any cut works. **Muon** is different: it turns the momentum matrix of each weight matrix into
# the nearest orthogonal matrix with a few **Newton-Schulz (NS)** iterations (multiplying the
# matrix by its own transpose), and that needs *all* of the matrix on one rank. The sketch below
# uses four made-up matrices A-D on three ranks: on top, ZeRO's cuts; below, the fix, where each
# rank owns whole matrices in its **bucket**, and the buckets are **padded** (filled with unused
# zeros) to the size of the largest bucket so that every rank's piece is the same size, as the
# **collectives** need (the operations that move data between ranks: a **reduce-scatter** sums
# the gradients and leaves each rank the sum of its own piece; an **all-gather** gives every rank
# every rank's piece, here the updated parameters).

# %%
sizes = {"A": 7, "B": 4, "C": 5, "D": 2}  # elements of four made-up matrices
names = list(sizes)
ranks = 3
buckets = mz.pack_dense([(1, n) for n in sizes.values()], ranks, balance="numel")
biggest = max(sum(sizes[names[i]] for i in b) for b in buckets)
tints = dict(zip(names, ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]))
fig, axes = plt.subplots(2, 1, figsize=(10, 4.6), gridspec_kw=dict(hspace=0.9))
ax = axes[0]
left = 0
for name, n in sizes.items():
    ax.barh(0, n, left=left, color=tints[name], edgecolor="white")
    ax.text(left + n / 2, 0, name, ha="center", va="center", color="w", fontweight="bold")
    left += n
total = left
for k in range(1, ranks):
    cut = k * total / ranks
    ax.axvline(cut, color="k", lw=2, ls="--")
for k in range(ranks):
    ax.text((k + 0.5) * total / ranks, 0.55, f"rank {k}'s shard", ha="center")
ax.set(xlim=(0, total), ylim=(-0.5, 0.8), yticks=[], xlabel="position in the flat vector")
ax.set_title("ZeRO: equal flat shards (dashed cuts). A and C are cut in two: no rank can run "
             "Muon on them", fontsize=10)  # fmt: skip
ax = axes[1]
for q, bucket in enumerate(buckets):
    left = 0
    for i in bucket:
        n = sizes[names[i]]
        ax.barh(q, n, left=left, color=tints[names[i]], edgecolor="white")
        ax.text(left + n / 2, q, names[i], ha="center", va="center", color="w", fontweight="bold")
        left += n
    if biggest > left:
        ax.barh(q, biggest - left, left=left, color="none", edgecolor="grey", hatch="///")
        ax.text(biggest + 0.2, q, f"padding: {biggest - left}", va="center", color="0.3")
ax.set(xlim=(0, total), yticks=range(ranks), yticklabels=[f"rank {q}" for q in range(ranks)],
       xlabel="elements in the rank's bucket")  # fmt: skip
ax.invert_yaxis()
ax.set_title("Whole-matrix ownership: every matrix on one rank; buckets padded to the largest "
             "bucket (hatched)", fontsize=10)  # fmt: skip
plt.show()
pad = ranks * biggest - total
print(f"{total} elements on {ranks} ranks: ZeRO gives each rank {total / ranks:g}; whole "
      f"matrices give buckets of {[sum(sizes[names[i]] for i in b) for b in buckets]}, each padded "
      f"to {biggest}, so {pad} padding elements ({pad / total:.0%} extra)")  # fmt: skip

# %% [markdown]
# **What to look at:** the dashed cuts on top land inside A and C; below, no matrix is cut, and
# the price is the hatched padding, set by the *largest bucket*, not by the largest matrix.
#
# ## 2. The key picture: who owns what in one V4 stage
# Now the real shapes: one **pipeline stage** (the slice of consecutive layers one group of ranks
# holds when the model is split by layers) of a DeepSeek-V4-Flash-like model (6 of its 43 layers;
# shapes from the public config, see `bench_muon_zero.v4_flash_inventory`) over 16 data-parallel
# ranks. V4 treats two kinds of matrix differently. The **dense** matrices (attention and shared
# layers) go whole into `zero_width` buckets, packed largest-first (each matrix to the bucket it
# raises least) and balanced on both NS cost (compute) and element count (memory). The **expert**
# matrices of the **mixture-of-experts** layers (each token is sent to a few of many small
# feed-forward networks, the experts) are all the same few shapes, so V4 lays them end to
# end into one vector split over every rank at matrix boundaries. Each bar below is one rank's
# dense bucket, each segment one whole matrix (width = its elements); the hatched tail is padding.

# %%
dense, experts, _ = bench.v4_flash_inventory(layers=range(8, 14))
plan = mz.plan_muon(dense, experts, world_size=16, zero_width=16)
shapes = sorted(set(dense), key=lambda s: -s[0] * s[1])
# one distinct hue per shape: tab10's ten, then black and yellow (tab20 pairs near-twins)
colors = dict(zip(shapes, list(plt.cm.tab10.colors) + ["#000000", "#f0e442"]))
fig, ax = plt.subplots(figsize=(10, 5))
for q, bucket in enumerate(plan.dense_buckets):
    left = 0
    for i in bucket:
        n, m = dense[i]
        ax.barh(q, n * m / 1e6, left=left, color=colors[dense[i]], edgecolor="white", lw=0.5)
        left += n * m / 1e6
    pad = plan.dense_bucket_numel / 1e6 - left
    ax.barh(q, pad, left=left, color="none", edgecolor="grey", hatch="///")
for s in shapes:
    ax.barh(0, 0, color=colors[s], label=f"{s[0]}x{s[1]}")
ax.barh(0, 0, color="none", edgecolor="grey", hatch="///", label="padding")
ax.axvline(plan.dense_bucket_numel / 1e6, color="k", lw=1.5, ls=":")
ax.set(xlabel="elements in the rank's dense bucket (millions; dotted: the largest bucket)",
       ylabel="rank", title="Dense buckets of one V4-Flash stage over 16 ranks",
       ylim=(15.6, -0.6), xlim=(0, 1.06 * plan.dense_bucket_numel / 1e6))  # fmt: skip
ax.set_yticks(range(16))
ax.legend(ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="matrix shape")
fig.tight_layout()
plt.show()
s = bench.plan_summary(plan)
largest = max(dense, key=lambda t: t[0] * t[1])
print(
    f"Dense: {len(dense)} matrices, at most {s['max_dense_per_rank']} per rank. The largest "
    f"matrix, {largest[0]}x{largest[1]}, has {largest[0] * largest[1] / 1e6:.1f} M elements; the "
    f"largest bucket {plan.dense_bucket_numel / 1e6:.1f} M. Every bucket is padded up to the "
    f"largest bucket: {100 * s['dense_padding']:.1f}% padding.\nExperts: {len(experts)} matrices "
    f"of {experts[0][0] * experts[0][1] / 1e6:.1f} M elements, at most "
    f"{s['max_experts_per_rank']} per rank, padding {100 * s['expert_padding']:.1f}%."
)

# %% [markdown]
# **What to look at:** the bars end at different lengths and the hatching fills each up to the
# dotted line, the largest bucket. The table below gives the same plan per rank (`format_plan`):
# its `replica` and `pos` columns say which **replica group** the rank is in and its position
# there (section 3 explains groups; here all 16 ranks form one group, so `replica` is 0 and `pos`
# is the rank), then matrices, elements, padding, NS multiply-adds per iteration, and NS calls
# (matrices of the same shape on a rank share one stacked momentum and one batched NS call).

# %%
print(mz.format_plan(plan))

# %% [markdown]
# ### Exercise 1 (predict, then run): matrices per rank as the ZeRO width changes
# Seven small matrices: one 64x64 and six 32x32. They are packed with `balance="numel"`, elements
# only: largest first, each to the bucket with the fewest elements so far (the lowest rank on a
# tie). Predict how many matrices each of `zero_width = 4` ranks owns, as a list from rank 0 to
# rank 3.

# %%
answer_matrices_per_rank = None  # e.g. [a, b, c, d]


# %%
# check: answer_matrices_per_rank
def judge_matrices(answer):
    toy = [(64, 64)] + [(32, 32)] * 6
    truth = [len(b) for b in mz.pack_dense(toy, 4, balance="numel")]
    if list(answer) == truth:
        return True, "the 64x64 matrix alone fills a fair share: its rank takes nothing else"
    if sorted(answer) == sorted(truth):
        return False, "the right counts, on the wrong ranks: which rank gets the first matrix?"
    return False, (
        "not the packing: the 64x64 matrix holds as many elements as four 32x32 ones; place it "
        "first, then each 32x32 on the emptiest bucket"
    )


check("answer_matrices_per_rank", answer_matrices_per_rank, judge_matrices)

# %% [markdown]
# ### Exercise 2 (predict, then run): the padding of a plan
# Three matrices, one 64x64 and two 48x64, packed by elements onto `zero_width = 2` ranks as in
# exercise 1. How many padding elements does the plan add in all, over both buckets?

# %%
answer_padding_elements = None  # an int: padding elements over both buckets


# %%
# check: answer_padding_elements
pad_plan = mz.plan_muon([(64, 64), (48, 64), (48, 64)], [], 2, 2, balance="numel")
pad_total = 2 * pad_plan.dense_bucket_numel - sum(n * m for n, m in pad_plan.dense_shapes)
check(
    "answer_padding_elements",
    answer_padding_elements,
    number(
        pad_total,
        unit="elements",
        hint="Pack first (largest first, emptiest bucket), then pad every bucket up to the largest "
        "bucket, which need not be the one holding the largest matrix.",
    ),
)

# %% [markdown]
# ## 3. What padding costs as the ZeRO width grows
# The whole model's dense matrices (all 43 layers), packed for widths 8 to 256, three ways: by
# NS cost alone (compute, V4's stated goal), by elements alone (memory), and by the larger of the
# two shares (our default, `"both"`). Left: padding, as a share of the dense elements. Right:
# **NS-cost imbalance**, the slowest rank's NS work over the average rank's (1 is perfect; the
# slowest rank sets the step time).

# %%
full_dense, all_experts, adamw_shapes = bench.v4_flash_inventory()
widths = [8, 16, 32, 64, 128, 256]
balances = ("ns_cost", "numel", "both")
summaries = {b: [bench.plan_summary(mz.plan_muon(full_dense, [], w, w, balance=b)) for w in widths]
             for b in balances}  # fmt: skip
fig, axes = plt.subplots(1, 2, figsize=(10, 4))
for k, balance in enumerate(balances):
    x = np.arange(len(widths)) + (k - 1) * 0.27
    pads = [100 * r["dense_padding"] for r in summaries[balance]]
    axes[0].bar(x, pads, width=0.27, label=balance)
    axes[1].bar(x, [r["dense_imbalance"] for r in summaries[balance]], width=0.27, label=balance)
titles = ("Memory: padding of the dense buckets", "Compute: NS-cost imbalance")
ylabels = ("padding (% of dense elements)", "NS cost, slowest rank / average rank")
for ax, title, label in zip(axes, titles, ylabels):
    ax.set_xticks(range(len(widths)), widths)
    ax.set(xlabel="ZeRO width (ranks sharing the dense matrices)", ylabel=label, title=title)
axes[0].axhline(10, color="k", lw=0.8, ls="--", label="10% (V4's figure)")
axes[0].legend(title="balance")
axes[1].legend(title="balance")
fig.tight_layout()
plt.show()
for balance in balances:
    pads = ", ".join(f"{w}: {100 * r['dense_padding']:.0f}%"
                     for w, r in zip(widths, summaries[balance]))  # fmt: skip
    worst = max(r["dense_imbalance"] for r in summaries[balance])
    print(f"{balance:>8}: padding by width {pads}; worst NS imbalance {worst:.2f}")
dense_total = sum(n * m for n, m in full_dense)
largest_numel = max(n * m for n, m in full_dense)
print(f"\n{len(full_dense)} dense matrices; the largest is {largest_numel / 1e6:.1f} M elements")
for w, r in zip(widths, summaries["both"]):
    print(f"width {w:3d}: {len(full_dense) / w:6.1f} matrices per rank on average, the largest "
          f"matrix is {largest_numel / (dense_total / w):.2f} of a fair share; padding "
          f"{100 * r['dense_padding']:.0f}%")  # fmt: skip

# %% [markdown]
# **What to look at:** the bars for `"both"` (green) stay low on both panels up to width 32, sit
# just above the 10% line at 64, then padding jumps. Cost-only packing balances compute and
# wastes memory; element-only packing does the reverse. The lines printed last say why the jump
# comes: as the width grows, a rank holds fewer matrices on average and each is a larger piece of
# its fair share, so whole pieces can no longer fill equal buckets evenly; at the widest setting the
# largest matrix alone exceeds a fair share. That is why V4 caps the ZeRO width. V4 reports "at most
# 5 matrices per rank, under 10% padding"; with our reconstruction of the Flash shapes
# (`bench_muon_zero.py`, tables 1 and 1b) padding stays near 10% only with ten or more matrices per
# rank on average, so V4's real shapes, grouping of parameters or packing must differ from this
# sketch somewhere.
# [MEASURED: our reconstructed shapes; V4's "at most 5, under 10%" is PAPER and not reproduced here,
# ledger M.5]
#
# ### Exercise 3 (change the code, run, observe): a width between the bars
# The figure shows widths 8 to 256 in powers of two only. Edit `try_widths` in the cell below to
# the widths you want to test (any multiples of 8 from 72 to 120), run it, and find the
# **largest** ZeRO width up to 128 at which `"both"` pads the whole model's dense matrices by
# under 10%. Padding need not grow steadily with the width: look before you conclude.

# %%
try_widths = [72]  # edit: the widths to try
for w in try_widths:
    r = bench.plan_summary(mz.plan_muon(full_dense, [], w, w, balance="both"))
    print(f"width {w}: padding {100 * r['dense_padding']:.1f}%")

# %%
answer_widest_under_10 = None  # the largest width up to 128 with padding under 10% (an int)

# %%
# check: answer_widest_under_10
padding = {w: bench.plan_summary(mz.plan_muon(full_dense, [], w, w))["dense_padding"]
           for w in range(8, 129, 8)}  # fmt: skip
under = [w for w, p in padding.items() if p < 0.10]
check(
    "answer_widest_under_10",
    answer_widest_under_10,
    number(max(under), hint="Try every multiple of 8 between 64 and 128, not only the first."),
)

# %% [markdown]
# **Wider than the cap.** With more data-parallel ranks than `zero_width`, the ranks form
# world_size / zero_width **replica groups** of `zero_width` ranks; each group holds the dense
# buckets once, and ranks at the same position in different groups compute the same dense updates.
# The experts are still split over *every* rank.
#
# ### Exercise 4 (predict, then run): optimizer state per rank at V4 scale
# Muon keeps one fp32 momentum (4 bytes) per matrix element. Take the whole V4-Flash-like model on
# 256 data-parallel ranks with `zero_width = 32`. Predict the GiB (2³⁰ bytes) of Muon momentum one
# rank holds, ignoring padding. You need two numbers, printed by the cell below.

# %%
expert_total = sum(n * m for n, m in all_experts)
print(f"dense matrices: {dense_total:,} elements; expert matrices: {expert_total:,} elements")

# %%
answer_momentum_gib = None  # GiB of Muon momentum on one rank (a float)

# %%
# check: answer_momentum_gib
v4_plan = mz.plan_muon(full_dense, all_experts, 256, 32)
per_rank = 4 * (v4_plan.dense_bucket_numel + v4_plan.expert_chunk_numel) / 2**30  # with padding
check(
    "answer_momentum_gib",
    answer_momentum_gib,
    number(
        per_rank,
        rel=0.03,
        unit="GiB",
        hint="Over how many ranks are the dense matrices split, and over how many the experts?",
    ),
)

# %%
adamw_plan = mz.plan_muon([], [], 256, adamw_shapes=adamw_shapes)
adamw_total = sum(numel for *_, numel in adamw_plan.adamw_blocks)
print(
    f"replicated Muon: {4 * (dense_total + expert_total) / 2**30:,.0f} GiB of momentum per "
    f"rank, against a few GiB sharded (your answer); plus {8 * adamw_total / 2**30:.1f} GiB of "
    f"AdamW moments for the embedding, head and norms, dealt over the 256 ranks in blocks of "
    f"rows: {8 * adamw_plan.adamw_chunk_numel / 2**30:.3f} GiB on the fullest rank"
)

# %% [markdown]
# ## 4. Memory per rank on a small model: the state shrinks, the temporaries grow
# A small mixture-of-experts transformer (`muon_zero.TinyMoE`) trained two steps (1 and 2),
# recorded storage by storage with `memory/memory_timeline.py` (notebook 00 explains the
# recorder and why the optimizer state appears inside step 1). Four runs: AdamW; replicated Muon
# (MuonZeRO on one rank); and ranks 0 and 1 of MuonZeRO on 4 ranks with `zero_width = 2`, each
# rank a real process talking through **gloo** (PyTorch's CPU backend for collectives; on GPUs
# NCCL plays that part).
# For each, three peaks: the optimizer state, the **temporaries** (tensors made and freed inside
# a phase: here the optimizer step's flat gradient and parameter buffers that the collectives
# move, and NS's work arrays), and the total.

# %%
stage("recording AdamW, replicated Muon, and MuonZeRO on 4 ranks")
adamw = bench.record_rank_timeline(0, 1, optimizer="adamw")
replicated = bench.record_rank_timeline(0, 1)
sharded = run_ranks(bench.record_rank_timeline, 4, kwargs=dict(zero_width=2))
stage("recorded")
runs = {"AdamW": adamw, "Muon,\nreplicated": replicated, "MuonZeRO,\nrank 0 of 4": sharded[0],
        "MuonZeRO,\nrank 1 of 4": sharded[1]}  # fmt: skip
kinds = [("optimizer_state", "optimizer state", "#55a868"),
         ("temporaries", "temporaries", "#8172b3"), (None, "total peak", "0.45")]  # fmt: skip
fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 2]})
for k, (category, label, color) in enumerate(kinds):
    x = np.arange(len(runs)) + (k - 1) * 0.27
    ys = [tl.peak(category) / MiB if category else tl.peak() / MiB for tl in runs.values()]
    ax.bar(x, ys, width=0.27, color=color, label=label)
    for xi, y in zip(x, ys):
        ax.text(xi, y + 0.2, f"{y:.1f}", ha="center", fontsize=9)
ax.set_xticks(range(len(runs)), list(runs))
ax.set_ylabel("peak over the two steps (MiB)")
ax.set_title("A small model: Muon's state is smaller than AdamW's, its optimizer-step "
             "temporaries larger")  # fmt: skip
ax.legend(loc="upper left")


def compute_peak(tl, step):  # the peak of a step's forward and backward, before its optimizer
    return max(tl.peak(step=step, phase=p) for p in ("forward", "backward"))


for k, tl in enumerate(runs.values()):  # the first-step anomaly: step 2 computes on the state
    p1, p2 = compute_peak(tl, 1) / MiB, compute_peak(tl, 2) / MiB
    ax2.bar(k - 0.2, p1, 0.4, color="0.75", label="step 1" if k == 0 else None)
    ax2.bar(k + 0.2, p2, 0.4, color="0.35", label="step 2" if k == 0 else None)
    ax2.text(k + 0.2, p2 + 0.2, f"{p2 - p1:+.1f}", ha="center", fontsize=9)
ax2.set_xticks(range(len(runs)), list(runs), fontsize=8)
ax2.set_ylabel("peak of forward + backward (MiB)")
ax2.set_title("The first-step anomaly: step 2 against step 1")
ax2.legend(loc="lower right")
fig.tight_layout()
plt.show()
for name, tl in runs.items():
    p1, p2 = compute_peak(tl, 1) / MiB, compute_peak(tl, 2) / MiB
    print(
        f"{name.replace(chr(10), ' '):<22} forward + backward peak: step 1 {p1:5.2f} MiB, "
        f"step 2 {p2:5.2f} MiB ({p2 - p1:+.2f}); optimizer state "
        f"{tl.peak('optimizer_state') / MiB:.2f} MiB; whole-step peaks {tl.peak(step=1) / MiB:.2f}"
        f" and {tl.peak(step=2) / MiB:.2f} MiB"
    )
state = {name: tl.peak("optimizer_state") for name, tl in runs.items()}
temps = {name: tl.peak("temporaries") for name, tl in runs.items()}
totals = {name: tl.peak() for name, tl in runs.items()}
a, r0 = "AdamW", "MuonZeRO,\nrank 0 of 4"
print(f"MuonZeRO rank 0 keeps {(state[a] - state[r0]) / MiB:.2f} MiB less optimizer state than "
      f"AdamW, but its temporaries peak {(temps[r0] - temps[a]) / MiB:.2f} MiB higher, so its "
      f"total peak is {(totals[r0] - totals[a]) / MiB:+.2f} MiB against AdamW's")  # fmt: skip

# %% [markdown]
# **What to look at:** the green bars fall from AdamW to replicated Muon to MuonZeRO, as the
# heading of this section promises; yet every Muon run's grey total peak is above AdamW's,
# because the purple temporaries of Muon's optimizer step are larger than the state it saves *at
# this toy size* (the line printed under the figure gives the difference).
# The state is a fixed number of bytes per parameter, forever; the temporaries live only during
# the optimizer step. At V4 scale (exercise 4) the state is gigabytes per rank; whether the
# temporaries stay small there is not measured in this notebook.
#
# **On the right, the first-step anomaly** (notebook 00): in every run, step 2's forward and
# backward peak above step 1's by exactly that run's optimizer state (the printed lines), because
# the state is created inside step 1's optimizer phase and then sits under every later forward and
# backward. Sharding the state shrinks the jump with it: MuonZeRO's rank jumps by its share only.
# At this toy size each step's own peak is in its optimizer phase, where both steps hold the state
# and the optimizer's temporaries, so the whole-step peaks (printed last on each line) differ less.
# [MEASURED on this CPU, a toy model]
#
# ## 5. Stochastic rounding, and why V4 sums in fp32 after an all-to-all
# V4 sends the expert gradients in **bf16**, a 16-bit float with the exponent range of fp32 but
# only 8 significant bits, so between 1 and 2 the gap to the next bf16 number, one **ulp** (unit
# in the last place), is 2⁻⁷. **Round-to-nearest** turns a value 30% of the way from one bf16
# number to the next into the lower one, every time: a bias of 0.3 ulp. **Stochastic rounding**
# rounds up with probability equal to that distance (here 30%), so the *mean* of many roundings is
# the value. Left below: that running mean. Right: the error of a W-rank gradient sum against
# fp64. A bf16 **ring reduce-scatter** (each rank adds its part to a running sum and passes it
# on) re-rounds the sum at every one of its W-1 hops, so its error grows with W; V4 rounds each
# gradient once (stochastically), sends it with one **all-to-all** (every rank sends each other
# rank the piece that rank owns), and sums in fp32.
# [DERIVED; the error curves are MEASURED, ledger M.12]
#
# ### Exercise 5 (predict, then run): how often does stochastic rounding round up?
# x = 3.01 (an fp32 number) is rounded stochastically to bf16 4096 times. Predict the fraction of
# roundings that go *up* (a number between 0 and 1). bf16 keeps 8 significant bits at every
# magnitude: find the two bf16 numbers around 3.01 first.

# %%
answer_fraction_up = None  # a float in [0, 1]

# %%
# check: answer_fraction_up
x3 = torch.full((4096,), 3.01)
sr3 = mz.stochastic_round_to_bf16(x3, generator=torch.Generator().manual_seed(0)).double()
up = (sr3 > x3.double()).double().mean().item()
check(
    "answer_fraction_up",
    answer_fraction_up,
    number(
        up,
        rel=0.1,
        hint="Unbiased means the expected rounded value equals x itself; between 2 and 4 the gap "
        "between bf16 numbers is not the one between 1 and 2.",
    ),
)

# %%
stage("rounding and summing")
x0 = 1.0 + 0.3 * 2**-7  # the section's example, 0.3 ulp above 1
samples = torch.full((4096,), x0)
sr = mz.stochastic_round_to_bf16(samples, generator=torch.Generator().manual_seed(0)).double()
running = torch.cumsum(sr, 0) / torch.arange(1, 4097)
rne = samples.to(torch.bfloat16).double()[0].item()
ranks = [2, 4, 8, 16, 32, 64]
labels = ("bf16 SR + all-to-all + fp32 sum (V4)", "bf16 ring reduce-scatter")
errs = {label: [] for label in labels}
g = torch.Generator().manual_seed(0)
for w in ranks:
    signal = torch.randn(1 << 16, generator=g) * 1e-3
    grads = [signal + 3e-3 * torch.randn(1 << 16, generator=g) for _ in range(w)]
    exact = torch.stack([t.double() for t in grads]).sum(0)
    rounded = [mz.stochastic_round_to_bf16(t, generator=g).float() for t in grads]
    ours = torch.stack(rounded).sum(0).double()
    errs[labels[0]].append(((ours - exact).norm() / exact.norm()).item())
    errs[labels[1]].append(((bench.ring_bf16(grads) - exact).norm() / exact.norm()).item())
fig, axes = plt.subplots(1, 2, figsize=(10, 4))
ulp = 2**-7
axes[0].plot(np.arange(1, 4097), (running - x0) / ulp, label="stochastic rounding: running mean")
axes[0].axhline((rne - x0) / ulp, color="C3", label="round to nearest")
axes[0].axhline(0, color="k", lw=0.8)
axes[0].set(xscale="log", xlabel="roundings averaged", ylabel="mean error (bf16 ulps)",
            title="One value, rounded many times", ylim=(-0.45, 0.45))  # fmt: skip
axes[0].set_xticks([1, 10, 100, 1000], ["1", "10", "100", "1000"])
axes[0].legend()
for label, e in errs.items():
    axes[1].plot(ranks, e, "o-", label=label)
axes[1].set(xscale="log", yscale="log", xlabel="ranks summing a gradient",
            ylabel="relative L2 error vs fp64", title="A gradient sum over W ranks")  # fmt: skip
axes[1].minorticks_off()
axes[1].set_xticks(ranks, [str(r) for r in ranks])
yticks = [1e-3, 2e-3, 4e-3, 8e-3]
axes[1].set_yticks(yticks, [f"{t:.0e}" for t in yticks])
axes[1].legend()
fig.tight_layout()
plt.show()
print(f"after 4096 roundings the SR mean is {(running[-1].item() - x0) / ulp:+.3f} ulp off, "
      f"round-to-nearest {(rne - x0) / ulp:+.3f} ulp")  # fmt: skip
for w, a, b in zip(ranks, *errs.values()):
    print(f"{w:3d} ranks: V4 {a:.2e}, ring {b:.2e} ({b / a:.1f}x)")
stage("done")

# %% [markdown]
# **What to look at:** left, the blue running mean closes in on 0 while round-to-nearest stays at
# its fixed bias; right, the ring's error (orange) climbs with the number of ranks while V4's
# does not grow (it even falls here: the summed gradient grows with W faster than the
# independent rounding errors do).
#
# ## Takeaway
# ZeRO's equal flat shards suit element-wise optimizers; Muon's Newton-Schulz needs whole
# matrices, so `muon_zero.py` gives each rank whole matrices in a bucket and pays in padding, up
# to the largest bucket [PAPER, IMPLEMENTED]. Packing that balances both compute and memory keeps
# the padding small while each rank still holds many matrices; past that, capping the ZeRO width
# (and repeating the dense work in replica groups) is the fix. The state per rank shrinks by the
# width, though on a small model the optimizer step's temporaries can outweigh it. For the
# gradients, one stochastic rounding to bf16 and an fp32 sum after an all-to-all keep the sum
# unbiased and its error from growing with the number of ranks, where a bf16 ring's grows [PAPER;
# MEASURED: ledger M.12].
