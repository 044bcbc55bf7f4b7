# %% [markdown]
# # Muon under ZeRO (DeepSeek-V4 §3.4.1)
#
# ZeRO shards optimizer state by cutting the flat parameter vector into equal pieces. That is exact
# for AdamW, whose update is element-wise. Muon's update is not: Newton-Schulz orthogonalises the
# whole momentum matrix, so a rank must own whole matrices. `muon_zero.py` implements V4's answer:
#
# * **dense matrices** go whole into at most `zero_width` buckets, packed largest-first and balanced
#   on Newton-Schulz cost (and element count, since every bucket is padded to the largest); wider
#   data parallelism makes replica groups that repeat the dense updates;
# * **expert matrices** (all down-projections, then ups, then gates) form one vector split over
#   every rank without cutting a matrix; their gradients go bf16-stochastic-rounded through an
#   all-to-all and are summed in fp32;
# * same-shape neighbours on a rank share one stacked momentum and one batched NS call.
#
# The file shows KellerJordan's round-robin first (`round_robin_step`), then V4's layout and its
# sharded step (`sharded_step`). This notebook shows who owns what, what padding costs, the memory
# each rank holds, and why V4 sums bf16 gradients the way it does.

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

import muon_zero as mz
from benchmarks import bench_muon_zero as bench  # the V4-Flash-like inventory
from memory.memory_timeline import MiB
from memory.plots import plot_timelines
from tests.harness import run_ranks  # real gloo ranks, as the tests use

plt.rcParams.update({"figure.dpi": 110, "font.size": 10, "legend.fontsize": 10})
torch.set_num_threads(2)
T0 = time.perf_counter()


def stage(text):
    print(f"[{time.perf_counter() - T0:5.1f} s] {text}", flush=True)


# %% [markdown]
# ## Who owns what
# One pipeline stage of a DeepSeek-V4-Flash-like model (6 of 43 layers; shapes from the public
# config, see `bench_muon_zero.v4_flash_inventory`) over 16 data-parallel ranks. Each bar is one
# rank's dense bucket, each segment one whole matrix (its width = elements); the hatched tail is
# padding up to the largest bucket.

# %%
dense, experts, _ = bench.v4_flash_inventory(layers=range(8, 14))
plan = mz.plan_muon(dense, experts, world_size=16, zero_width=16)
shapes = sorted(set(dense), key=lambda s: -s[0] * s[1])
colors = dict(zip(shapes, plt.cm.tab20(np.linspace(0, 1, len(shapes)))))
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
ax.set(xlabel="elements in the rank's dense bucket (millions)", ylabel="rank",
       title="Dense buckets of one V4-Flash stage over 16 ranks", ylim=(15.6, -0.6))  # fmt: skip
ax.set_yticks(range(16))
ax.legend(ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="matrix shape")
fig.tight_layout()
plt.show()
print(mz.format_plan(plan))

# %%
s = bench.plan_summary(plan)
largest = max(dense, key=lambda t: t[0] * t[1])
print(
    f"Experts: {len(experts)} matrices of {experts[0][0] * experts[0][1] / 1e6:.1f} M elements "
    f"split {s['max_experts_per_rank']} per rank at most, expert padding "
    f"{100 * s['expert_padding']:.1f}%.\nDense: {len(dense)} matrices, at most "
    f"{s['max_dense_per_rank']} per rank, padding {100 * s['dense_padding']:.1f}%; the largest, "
    f"{largest[0]}x{largest[1]} = {largest[0] * largest[1] / 1e6:.1f} M elements, cannot be "
    f"split, so the other buckets pad up to it."
)

# %% [markdown]
# ## What padding costs
# Dense-bucket padding for the whole model as the ZeRO width grows, for three packings: NS cost
# alone (V4's stated goal), elements alone, and the larger of the two shares (our default).

# %%
full_dense, _, _ = bench.v4_flash_inventory()
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
ylabels = ("padding (% of dense elements)", "NS cost, max rank / mean rank")
for ax, title, label in zip(axes, titles, ylabels):
    ax.set_xticks(range(len(widths)), widths)
    ax.set(xlabel="ZeRO width (ranks sharing the dense matrices)", ylabel=label, title=title)
    ax.legend(title="balance")
axes[0].axhline(10, color="k", lw=0.8, ls="--", label="10% (V4's figure)")
axes[0].legend(title="balance")
fig.tight_layout()
plt.show()
for balance in balances:
    pads = ", ".join(f"{w}: {100 * r['dense_padding']:.0f}%"
                     for w, r in zip(widths, summaries[balance]))  # fmt: skip
    worst = max(r["dense_imbalance"] for r in summaries[balance])
    print(f"{balance:>8}: padding by width {pads}; worst NS imbalance {worst:.2f}")
print(f"{len(full_dense)} dense matrices: {len(full_dense) / 128:.1f} per rank at width 128, "
      f"{len(full_dense) / 256:.1f} at width 256")  # fmt: skip

# %% [markdown]
# Cost-only packing balances compute and wastes memory; element-only packing does the reverse;
# balancing the larger share keeps both moderate up to width 64 (the numbers are printed above).
# Past that, no packing helps: with two or three matrices per rank, the largest matrix alone
# exceeds a fair share. That is why a width cap exists. V4 reports "<= 5 matrices per rank, < 10%
# padding"; with our reconstruction of the Flash shapes (`bench_muon_zero.py`, tables 1 and 1b)
# padding stays near 10% only with tens of matrices per rank, so V4's real shapes, grouping of
# parameters or packing must differ from this sketch somewhere.

# %% [markdown]
# ## Memory per rank: MuonZeRO vs replicated Muon vs AdamW
# A small MoE transformer for two steps (numbered 1 and 2), recorded storage by storage with
# `memory_timeline.py`. Optimizer state appears lazily inside the first `step()` and sits under
# everything after it. AdamW keeps two fp32 moments per parameter; Muon keeps one (its momentum)
# for every matrix; MuonZeRO splits that one over the ranks. Left to right: AdamW, replicated Muon
# (MuonZeRO on one rank), and rank 0 of MuonZeRO on 4 gloo ranks with zero width 2 (rank 1's
# figures are printed below: its panel looks the same). The x axis counts allocation events, one per
# allocation or free, evenly spaced.

# %%
stage("recording AdamW, replicated Muon, and MuonZeRO on 4 ranks")
adamw = bench.record_rank_timeline(0, 1, optimizer="adamw")
replicated = bench.record_rank_timeline(0, 1)
sharded = run_ranks(bench.record_rank_timeline, 4, kwargs=dict(zero_width=2))
stage("recorded")
runs = [adamw, replicated, sharded[0]]
fig = plot_timelines(runs, titles=["AdamW", "Muon, replicated", "MuonZeRO, rank 0 of 4"],
                     width=3.3, height=3.6, ncols=3)  # fmt: skip
for ax in fig.axes:  # three panels side by side: a short label (one event per allocation or free)
    if ax.get_xlabel().startswith("allocation events"):
        ax.set_xlabel("allocation events")
plt.show()
names = ["AdamW", "Muon replicated", "MuonZeRO rank 0", "MuonZeRO rank 1"]
for name, tl in zip(names, runs + [sharded[1]]):
    print(f"{name:>16}: optimizer state {tl.peak('optimizer_state') / MiB:6.3f} MiB, "
          f"temporaries {tl.peak('temporaries') / MiB:6.3f} MiB, "
          f"total peak {tl.peak() / MiB:6.3f} MiB")  # fmt: skip

# %% [markdown]
# The first-step jump (in step 1's optimizer phase) is the optimizer state: AdamW's two moments per
# parameter, Muon's one momentum per matrix element (plus AdamW moments for embedding, head and
# norms), and under MuonZeRO each rank's share of that momentum. Muon pays instead in the optimizer
# phase's temporaries: the flat gradient and parameter buffers that the all-to-all and all-gather
# move, and Newton-Schulz's work arrays for a whole stack of same-shape matrices at once. At this
# toy size those transients can outweigh the state saved; they scale with a rank's buckets, while
# the state they replace scales with the model. At V4-Flash scale:

# %%
_, all_experts, adamw_numel = bench.v4_flash_inventory()
muon_numel = sum(n * m for n, m in full_dense) + sum(n * m for n, m in all_experts)
big = mz.plan_muon(full_dense, all_experts, 64, 64)
share = max(r["numel"] + r["dense_padding"] + r["expert_padding"] for r in bench.rank_rows(big))
print(f"replicated Muon momentum {4 * muon_numel / 2**30:,.0f} GiB per rank; MuonZeRO at 64 "
      f"ranks {4 * share / 2**30:.1f} GiB per rank, plus {8 * adamw_numel / 2**30:.1f} GiB of "
      f"replicated AdamW moments for the embedding and head")  # fmt: skip

# %% [markdown]
# ## Stochastic rounding, and why V4 sums in fp32 after an all-to-all
# Left: a value 30% of the way from one bf16 number to the next. Round-to-nearest always goes down
# (a bias of 0.3 ulp every time); stochastic rounding goes up 30% of the time, so its mean converges
# to the value. Right: the error of a W-rank gradient sum against fp64. A bf16 ring reduce-scatter
# re-rounds the running sum at every one of W-1 hops, so its error grows with W; V4 rounds each
# gradient once (stochastically) and sums in fp32 after an all-to-all.

# %%
stage("rounding and summing")
x0 = 1.0 + 0.3 * 2**-7
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
