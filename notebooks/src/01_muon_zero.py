# %% [markdown]
# # Muon under ZeRO (DeepSeek-V4 §3.4.1)
#
# ZeRO shards optimizer state by cutting the flat parameter vector into equal pieces. That is exact for
# AdamW, whose update is element-wise. Muon's update is not: Newton-Schulz orthogonalises the whole
# momentum matrix, so a rank must own whole matrices. `muon_zero.py` implements V4's answer:
#
# * **dense matrices** go whole into at most `zero_width` buckets, packed largest-first and balanced on
#   Newton-Schulz cost (and element count, since every bucket is padded to the largest); wider data
#   parallelism makes replica groups that repeat the dense updates;
# * **expert matrices** (all down-projections, then ups, then gates) form one vector split over every rank
#   without cutting a matrix; their gradients go bf16-stochastic-rounded through an all-to-all and are
#   summed in fp32;
# * same-shape neighbours on a rank share one stacked momentum and one batched NS call.
#
# This notebook shows who owns what, what padding costs, the memory each rank holds, and why V4 sums
# bf16 gradients the way it does.

# %%
import sys

import matplotlib.pyplot as plt
import numpy as np
import torch

sys.path[:0] = ["tests", "benchmarks"]
import muon_zero as mz
import bench_muon_zero as bench
from harness import run_ranks
from memory_timeline import MiB, plot_timelines

plt.rcParams["figure.dpi"] = 72
torch.set_num_threads(2)

# %% [markdown]
# ## Who owns what
# One pipeline stage of a DeepSeek-V4-Flash-like model (6 of 43 layers; shapes from the public config, see
# `bench_muon_zero.v4_flash_inventory`) over 16 data-parallel ranks. Each bar is one rank's dense bucket,
# each segment one whole matrix (its width = elements); the hatched tail is padding up to the largest bucket.

# %%
dense, experts, _ = bench.v4_flash_inventory(layers=range(8, 14))
plan = mz.plan_muon(dense, experts, world_size=16, zero_width=16)
shapes = sorted(set(dense), key=lambda s: -s[0] * s[1])
colors = dict(zip(shapes, plt.cm.tab20(np.linspace(0, 1, len(shapes)))))
fig, ax = plt.subplots(figsize=(10, 4.5))
for q, bucket in enumerate(plan.dense_buckets):
    left = 0
    for i in bucket:
        n, m = dense[i]
        ax.barh(q, n * m / 1e6, left=left, color=colors[dense[i]], edgecolor="white", linewidth=0.5)
        left += n * m / 1e6
    ax.barh(q, plan.dense_bucket_numel / 1e6 - left, left=left, color="none", edgecolor="grey", hatch="///")
for s in shapes:
    ax.barh(0, 0, color=colors[s], label=f"{s[0]}x{s[1]}")
ax.set(xlabel="elements (millions)", ylabel="rank", title="Dense buckets, one V4-Flash stage, 16 ranks",
       ylim=(15.6, -0.6))
ax.legend(fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
fig.tight_layout()
plt.show()
print(plan.format())

# %% [markdown]
# Every rank also owns a contiguous run of whole experts: 6 layers x 256 experts x 3 projections = 4608
# matrices of 8.4 M elements split 288 per rank, no padding. The dense side is lumpier: a whole 32768x1024
# query up-projection is 33.6 M elements, so a bucket cannot hold "a fraction" of one and the others pad up.

# %% [markdown]
# ## What padding costs
# Dense-bucket padding for the whole model (666 matrices) as the ZeRO width grows, for three packings:
# NS cost alone (V4's stated goal), elements alone, and the larger of the two shares (our default).

# %%
full_dense, _, _ = bench.v4_flash_inventory()
widths = [8, 16, 32, 64, 128, 256]
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
for k, balance in enumerate(("ns_cost", "numel", "both")):
    s = [mz.plan_muon(full_dense, [], w, w, balance=balance).summary() for w in widths]
    x = np.arange(len(widths)) + (k - 1) * 0.27
    axes[0].bar(x, [100 * r["dense_padding"] for r in s], width=0.27, label=balance)
    axes[1].bar(x, [r["dense_imbalance"] for r in s], width=0.27, label=balance)
for ax, label in zip(axes, ("padding of dense buckets (%)", "NS cost, max / mean rank")):
    ax.set_xticks(range(len(widths)), widths)
    ax.set(xlabel="ZeRO width", ylabel=label)
axes[0].axhline(10, color="k", lw=0.8, ls="--")
axes[1].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# Cost-only packing balances compute perfectly and wastes memory (up to 93% at width 128); element-only
# packing does the reverse. Balancing the larger share keeps both within ~12% up to width 64. Past that,
# no packing helps: with ~2.6 matrices per rank, the largest matrix alone exceeds a fair share. That is why
# a width cap exists. V4 reports "<= 5 matrices per rank, < 10% padding"; with our reconstruction of the
# Flash shapes (`bench_muon_zero.py`, tables 1 and 1b) padding stays near 10% only with ~20-30 matrices per
# rank, so V4's real shapes, grouping of parameters or packing must differ from this sketch somewhere.

# %% [markdown]
# ## Memory per rank: MuonZeRO vs replicated Muon vs AdamW
# A small MoE transformer for two steps, recorded storage by storage with `memory_timeline.py`. Optimizer
# state appears lazily inside the first `step()` and sits under everything after it. AdamW keeps two fp32
# moments per parameter; Muon keeps one (its momentum) for every matrix; MuonZeRO splits that one over
# the ranks. Left to right: AdamW, replicated Muon (MuonZeRO on one rank), and ranks 0 and 1 of MuonZeRO on
# 4 gloo ranks with zero width 2.

# %%
adamw = bench.record_rank_timeline(0, 1, optimizer="adamw")
replicated = bench.record_rank_timeline(0, 1)
sharded = run_ranks(bench.record_rank_timeline, 4, kwargs=dict(zero_width=2))
runs = [adamw, replicated, sharded[0], sharded[1]]
fig = plot_timelines(runs, titles=["AdamW", "Muon, replicated", "MuonZeRO rank 0 / 4", "MuonZeRO rank 1 / 4"],
                     width=3.2)
plt.show()
for name, tl in zip(["AdamW", "Muon replicated", "MuonZeRO rank 0", "MuonZeRO rank 1"], runs):
    print(f"{name:>16}: optimizer state {tl.peak('optimizer_state') / MiB:6.2f} MiB, "
          f"temporaries {tl.peak('temporaries') / MiB:6.2f} MiB, total peak {tl.peak() / MiB:6.2f} MiB")

# %% [markdown]
# The first-step jump (green, appearing in step 0's optimizer phase) is the optimizer state: AdamW's two
# moments per parameter, Muon's one momentum per matrix element (plus AdamW moments for embedding, head and
# norms), and under MuonZeRO each rank's share of that momentum. Muon pays instead in the optimizer phase's
# temporaries (purple): the flat gradient and parameter buffers that the all-to-all and all-gather move, and
# Newton-Schulz's work arrays for a whole stack of same-shape matrices at once. At this toy size those
# transients outweigh the state saved; they scale with a rank's buckets, while the state they replace scales
# with the model: at V4-Flash scale replicated Muon momentum is ~1 TiB, while MuonZeRO's share at 64 ranks
# is 17 GiB, plus 8 GiB of AdamW moments for the embedding and head (benchmark table 2).

# %% [markdown]
# ## Stochastic rounding, and why V4 sums in fp32 after an all-to-all
# Left: a value 30% of the way from one bf16 number to the next. Round-to-nearest always goes down (a
# bias of 0.3 ulp every time); stochastic rounding goes up 30% of the time, so its mean converges to the
# value. Right: the error of a W-rank gradient sum against fp64. A bf16 ring reduce-scatter re-rounds the
# running sum at every one of W-1 hops, so its error grows with W; V4 rounds each gradient once
# (stochastically) and sums in fp32 after an all-to-all, so its relative error shrinks as W grows.

# %%
x0 = 1.0 + 0.3 * 2 ** -7
samples = torch.full((4096,), x0)
sr = mz.stochastic_round_to_bf16(samples, generator=torch.Generator().manual_seed(0)).double()
running = torch.cumsum(sr, 0) / torch.arange(1, 4097)
rne = samples.to(torch.bfloat16).double()[0].item()
ranks, errs = [2, 4, 8, 16, 32, 64], {"bf16 SR + all-to-all + fp32 sum (V4)": [], "bf16 ring reduce-scatter": []}
g = torch.Generator().manual_seed(0)
for w in ranks:
    signal = torch.randn(1 << 16, generator=g) * 1e-3
    grads = [signal + 3e-3 * torch.randn(1 << 16, generator=g) for _ in range(w)]
    exact = torch.stack([t.double() for t in grads]).sum(0)
    ours = torch.stack([mz.stochastic_round_to_bf16(t, generator=g).float() for t in grads]).sum(0).double()
    errs["bf16 SR + all-to-all + fp32 sum (V4)"].append(((ours - exact).norm() / exact.norm()).item())
    errs["bf16 ring reduce-scatter"].append(((bench.ring_bf16(grads) - exact).norm() / exact.norm()).item())
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
ulp = 2 ** -7
axes[0].plot((running - x0) / ulp, label="stochastic rounding: running mean")
axes[0].axhline((rne - x0) / ulp, color="C3", label="round to nearest")
axes[0].axhline(0, color="k", lw=0.8)
axes[0].set(xscale="log", xlabel="samples", ylabel="mean error (bf16 ulps)", title="one value, rounded many times",
            ylim=(-0.45, 0.45))
axes[0].legend()
for label, e in errs.items():
    axes[1].plot(ranks, e, "o-", label=label)
axes[1].set(xscale="log", yscale="log", xlabel="ranks", ylabel="relative error vs fp64", title="gradient sum")
axes[1].minorticks_off()
axes[1].set_xticks(ranks, ranks)
axes[1].legend()
fig.tight_layout()
plt.show()
