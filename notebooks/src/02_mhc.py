# %% [markdown]
# # mHC made affordable (DeepSeek-V4 §3.4.2)
#
# Hyper-connections widen the residual stream to n = 4 lanes: `X' = B X + C F(A X)`, with `B` a
# doubly stochastic matrix made by Sinkhorn-Knopp. The layer is cheap in FLOPs but its stream is n
# times the residual's: n times the activations held for backward and n times the pipeline traffic.
# This notebook looks at what that costs and what `mhc.py`'s reductions buy back:
#
# 1. memory timelines of residual, naive mHC and optimised mHC (fused mixing + selective
#    recomputation);
# 2. the bytes each layer keeps for backward;
# 3. why 20 Sinkhorn iterations are enough;
# 4. why B is constrained at all: the composite gain of many stacked mixings;
# 5. the recompute block size L_r: memory against block length, with sqrt(nL/(n+2)) marked;
# 6. the same weights in the public DeepSeek-V4 code and in `mhc.py`: the same numbers;
# 7. the time overhead over the hidden size C, eager and compiled (`bench_mhc.py --curve`).

# %%
import math

import matplotlib.pyplot as plt
import torch

import mhc
from memory.memory_timeline import MemoryTimeline
from memory.plots import plot_timelines

plt.rcParams.update({"figure.dpi": 110, "font.size": 10})
torch.set_num_threads(1)  # tiny tensors: threads only add contention
cfg = mhc.Config(vocab_size=128, seq_len=32, dim=64, n_heads=2, n_layers=4, n_hc=4)
BATCH = 4


def record(hyper, steps=2, **options):
    torch.manual_seed(0)
    model = mhc.Transformer(cfg, hyper=hyper)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tl = MemoryTimeline(model=model, optimizer=opt)
    gen = torch.Generator().manual_seed(0)
    with tl.record():
        for step in range(steps):
            data = mhc.synthetic_batch(cfg, BATCH, gen, "cpu")
            with tl.phase("forward", step):
                loss = model(data[:, :-1], data[:, 1:], **options)
            with tl.phase("backward", step):
                loss.backward()
            with tl.phase("optimizer", step):
                opt.step()
                opt.zero_grad(set_to_none=True)
    return tl


L_r = mhc.default_recompute_block(cfg.n_hc, cfg.n_layers)
timelines = [record(False), record(True), record(True, variant="optimised", block=L_r)]
titles = ["residual", "naive mHC", f"optimised mHC (fused, L_r={L_r})"]
plot_timelines(timelines, titles=titles, width=3.0, height=4.0)
plt.show()
for title, tl in zip(titles, timelines):
    peak_all = (tl.series("activations") + tl.series("temporaries")).max() / 2**20
    print(
        f"{title:<32} peak activations {tl.peak('activations', step=1) / 2**20:6.2f} MiB, "
        f"peak activations+temporaries {peak_all:6.2f} MiB"
    )

# %% [markdown]
# ## 1. Memory timelines
# The red band (activations: what forward leaves alive for backward) is where the widened stream
# shows. Naive mHC keeps every layer's n-lane input, its RMS-normalised copy and the Sinkhorn
# intermediates. The optimised run keeps one n-lane stream per block of L_r layers and each F's
# output; in backward it rebuilds the lane states block by block (purple temporaries), without
# calling F again. The head's lane collapse is folded into the last block, so the final n-lane
# stream is rebuilt there too instead of being kept for the head.
#
# ## 2. Bytes kept per layer
# Measured with saved-tensor hooks, as the slope over depth: the bytes autograd keeps for a 4-layer
# model minus a 2-layer one, per layer and per token, next to the size of one lane (C floats).


# %%
def per_layer_per_token(hyper, **options):
    sizes = []
    for n_layers in (2, 4):
        torch.manual_seed(0)
        model = mhc.Transformer(mhc.Config(**{**cfg.__dict__, "n_layers": n_layers}), hyper=hyper)
        data = mhc.synthetic_batch(cfg, BATCH, torch.Generator().manual_seed(0), "cpu")
        _, saved = mhc.saved_activation_bytes(
            model, lambda: model(data[:, :-1], data[:, 1:], **options)
        )
        sizes.append(saved)
    return (sizes[1] - sizes[0]) / 2 / (BATCH * cfg.seq_len)


rows = {
    "residual": per_layer_per_token(False),
    "naive mHC": per_layer_per_token(True),
    "fused": per_layer_per_token(True, variant="fused"),
    "fused + recompute L_r=2": per_layer_per_token(True, variant="optimised", block=2),
}
fig, ax = plt.subplots(figsize=(10, 3.5))
ax.barh(
    list(rows),
    [v / (4 * cfg.dim) for v in rows.values()],
    color=["#4c72b0", "#c44e52", "#dd8452", "#55a868"],
)
ax.axvline(cfg.n_hc, color="k", ls=":", lw=1, label=f"one n-lane stream ({cfg.n_hc} lanes)")
ax.legend(loc="lower right", fontsize=10)
ax.set_title("Bytes autograd keeps per layer and token")
ax.set_xlabel(f"bytes kept per layer per token, in units of one lane (C={cfg.dim} fp32)")
ax.invert_yaxis()
plt.tight_layout()
plt.show()
for name, value in rows.items():
    print(f"{name:<26} {value:8.0f} B/token/layer = {value / (4 * cfg.dim):5.2f} lanes")
extra = (rows["naive mHC"] - rows["fused"]) / (4 * cfg.dim * cfg.n_hc)
print(f"naive - fused = {extra:.1f} n-lane streams per layer (mostly Sinkhorn intermediates)")

# %% [markdown]
# At this small C the naive layer's Sinkhorn intermediates (2 x 20 normalisations of a 4 x 4 matrix,
# their sums and V4's eps: hundreds of floats per token) are most of the difference between the
# naive and the fused bars (printed above in n-lane streams); `mhc.py`'s fused path replays them in
# backward instead. The recomputed path keeps F's own activations (never recomputed), each F output
# (one lane), each layer's coefficients (49 numbers per token) and one n-lane block input per L_r
# layers; it rebuilds the lane states in backward with the post-mix alone.
#
# ## 3. Sinkhorn-Knopp: how many iterations
# `sinkhorn_knopp` starts from a softmax down each column of B (the public V4 code's order: it
# stores comb = B^T) and alternates row and column normalisation, each sum + 1e-6; it ends on rows,
# so rows are exact up to that eps and the column error is what converges. The larger the logits (a
# B far from uniform), the slower the convergence.

# %%
fig, ax = plt.subplots(figsize=(10, 4))
gen = torch.Generator().manual_seed(0)
for scale in (0.5, 1, 2, 4):
    matrix = mhc.sinkhorn_knopp(
        scale * torch.randn(1024, 4, 4, dtype=torch.float64, generator=gen), 1
    )
    errors = []
    # one more iteration each time: sinkhorn_knopp(log P, 1) continues from P
    for k in range(1, 41):
        errors.append((matrix.sum(-2) - 1).abs().max().item())
        matrix = mhc.sinkhorn_knopp(matrix.log(), 1)
    ax.semilogy(range(1, 41), errors, label=f"logits ~ N(0, {scale}²)")
ax.axvline(20, color="k", ls=":", lw=1)
ax.set_xlabel("iterations (column + row normalisation)")
ax.set_ylabel("worst |column sum - 1| (unitless)")
ax.set_title("Sinkhorn-Knopp convergence, 1024 random 4 x 4 matrices per logit scale")
ax.legend(fontsize=10)
plt.tight_layout()
plt.show()

# %% [markdown]
# Twenty iterations are plenty near the initialisation (small gated logits: B close to uniform plus
# the static bias) and for logits of order 1; for large logits some matrices converge slowly and B
# is only approximately doubly stochastic after 20 rounds. The floor at 1e-6 is V4's eps, added to
# every sum. The rows are still exact up to that eps, so each output lane stays a convex combination
# of the input lanes, which is what bounds the stream.
#
# ## 4. Why constrain B: the composite gain of stacked mixing
# Across L layers the residual path multiplies the mixing matrices: `X_L = B_L ... B_1 X_0 + ...`. A
# doubly stochastic B has every row and column sum 1, and products of doubly stochastic matrices
# stay doubly stochastic: the gain (largest absolute row sum) is 1 at any depth (with V4's eps, each
# row sums to 1 - 1e-6, so the gain printed below sits just under 1).
# Unconstrained hyper-connections learn B freely around the identity; even small deviations compound
# with depth.


# %%
def composite_gain(make_b, depth, tokens=256):
    product, gains = torch.eye(4, dtype=torch.float64).expand(tokens, 4, 4), []
    for _ in range(depth):
        product = make_b() @ product
        gains.append(product.abs().sum(-1).amax(-1).max().item())
    return gains


gen = torch.Generator().manual_seed(0)
depth = 64
constrained = composite_gain(
    lambda: mhc.sinkhorn_knopp(
        3 * torch.eye(4, dtype=torch.float64)
        + torch.randn(256, 4, 4, dtype=torch.float64, generator=gen),
        20,
    ),
    depth,
)
free = {
    s: composite_gain(
        lambda: (
            torch.eye(4, dtype=torch.float64)
            + s * torch.randn(256, 4, 4, dtype=torch.float64, generator=gen)
        ),
        depth,
    )
    for s in (0.05, 0.1, 0.2)
}
fig, ax = plt.subplots(figsize=(10, 4))
ax.semilogy(range(1, depth + 1), constrained, lw=2, label="mHC: Sinkhorn-projected B")
for s, gains in free.items():
    ax.semilogy(range(1, depth + 1), gains, label=f"HC: B = I + N(0, {s}²)")
ax.set_xlabel("layers stacked")
ax.set_ylabel("max abs row sum of B_L...B_1 (gain)")
ax.set_title("Composite gain of stacked lane mixing, 256 tokens")
ax.legend(fontsize=10)
plt.tight_layout()
plt.show()
print(
    f"mHC gain after {depth} layers: {constrained[-1]:.6f};  HC gains: "
    + ", ".join(f"{g[-1]:.3g}" for g in free.values())
)

# %% [markdown]
# ## 5. Choosing L_r
# With blocks of L_r layers, forward keeps one block input (nC) per block: n C L / L_r. Backward
# rebuilds one block at a time and holds about (n + 2) C per layer of it: (n + 2) C L_r. Each
# layer's mixing is recomputed exactly once whatever L_r is, so L_r trades stored against transient
# memory only; the sum is smallest at L_r = sqrt(n L / (n + 2)). Below: that model for L = 16, and
# the measured peak of activations + backward temporaries (memory_timeline) of a 16-layer model,
# shifted onto the model's minimum.

# %%
n, depth = cfg.n_hc, 16
blocks = [1, 2, 3, 4, 6, 8, 16]
model_cost = [n * depth / b + (n + 2) * b for b in blocks]
cfg_deep = mhc.Config(**{**cfg.__dict__, "n_layers": depth, "dim": 32, "seq_len": 16})
measured = []
for block in blocks:
    torch.manual_seed(0)
    model = mhc.Transformer(cfg_deep)
    tl = MemoryTimeline(model=model)
    data = mhc.synthetic_batch(cfg_deep, 2, torch.Generator().manual_seed(0), "cpu")
    with tl.record():
        with tl.phase("forward"):
            loss = model(data[:, :-1], data[:, 1:], variant="optimised", block=block)
        with tl.phase("backward"):
            loss.backward()
    measured.append((tl.series("activations") + tl.series("temporaries")).max())
lane_bytes = 4 * cfg_deep.dim * 2 * cfg_deep.seq_len
best = math.sqrt(n * depth / (n + 2))
fig, ax = plt.subplots(figsize=(10, 4))
ax.plot(blocks, model_cost, "o-", label="model: nL/L_r + (n+2)L_r  (lanes)")
ax.plot(
    blocks,
    [(m - min(measured)) / lane_bytes + min(model_cost) for m in measured],
    "s--",
    label="measured peak, shifted to the model's minimum",
)
ax.axvline(best, color="k", ls=":", lw=1)
ax.text(best, max(model_cost) * 0.9, f" sqrt(nL/(n+2)) = {best:.2f}", fontsize=10)
ax.set_xlabel("recompute block L_r (layers)")
ax.set_ylabel("memory, in lanes of C floats per token")
ax.set_title(f"Stored + transient memory against the recompute block, L = {depth} layers")
ax.set_xticks(blocks)
ax.legend(fontsize=10)
plt.tight_layout()
plt.show()
print(f"default L_r for n={n}, L={depth}:", mhc.default_recompute_block(n, depth))

# %% [markdown]
# ## 6. Faithful to the public V4 code
# The same random weights, loaded into Hugging Face transformers' DeepSeek-V4 modules
# (`DeepseekV4HyperConnection`, `DeepseekV4HyperHead`, and the mixing of `DeepseekV4DecoderLayer`)
# and, through `interop/v4_mhc.py`'s `from_v4_state_dict`, into `mhc.py`: A, B, C of every layer,
# the stream after each of six layers on every path (reference, fused, recomputed), the head's lane
# collapse, and B at logits of +-60 (where Sinkhorn without its eps returned NaN). This needs
# `transformers`, a test-only dependency (the cell says so and skips if it is missing). Where the
# project deliberately
# goes further (a hand-written backward, selective recomputation, a pipeline) it is checked against
# its own plain reference instead, in `tests/test_mhc.py`; F here is a small attention/MLP, not
# V4's attention and MoE, so only the hyper-connections are compared.

# %%
import time  # noqa: E402

began = time.perf_counter()
try:
    from tests.oracle_v4_mhc import comparison_rows
except ImportError as missing:  # transformers absent: say so, do not fail the notebook
    print(f"skipped: {missing}")
else:
    rows = comparison_rows()
    print(f"{'quantity':<58} {'max |V4 - mhc.py|':>18} {'tolerance':>10}  within")
    for row in rows:
        ok = row["max_abs_diff"] <= row["tolerance"]
        print(f"{row['quantity']:<58} {row['max_abs_diff']:>18.2e} {row['tolerance']:>10.0e}  {ok}")
    print(
        f"{sum(r['max_abs_diff'] <= r['tolerance'] for r in rows)} of {len(rows)} within "
        f"tolerance ({time.perf_counter() - began:.0f} s, most of it importing transformers)"
    )

# %% [markdown]
# ## 7. What it costs in time: overhead over the hidden size C, eager and compiled
# Per token and layer, mHC's lane mixing reads and writes the n lanes a few times, projects them to
# 2n + n² = 24 logits and runs 20 Sinkhorn rounds on a 4 × 4 matrix: work that grows like n·C, plus
# a fixed cost per token. F (attention or MLP) does matmuls that grow like C². So the relative
# overhead falls roughly like 1/C, and one size would hide the trend: the curve is the honest
# summary. It comes from `python benchmarks/bench_mhc.py --curve --save benchmarks/curve_cpu.json`
# (4 layers, T = 128, batch 2, 1 thread; forward + backward; residual, naive and optimised mHC, each
# eager and under torch.compile, with F compiled in every compiled run), read here from its JSON
# because compiling its ~60 graphs takes minutes. The demo's size, C = 128, is measured live below
# (eager, 3 rounds after one warm-up: small counts, a few seconds).

# %%
import json
import pathlib
import statistics
import time

began = time.perf_counter()
candidates = [
    pathlib.Path(mhc.__file__).resolve().parent,
    pathlib.Path.cwd(),
    pathlib.Path.cwd().parent,
]
curve_file = next(
    (
        p / "benchmarks" / "curve_cpu.json"
        for p in candidates
        if (p / "benchmarks" / "curve_cpu.json").exists()
    ),
    None,
)
curve = json.loads(curve_file.read_text()) if curve_file else None


def live_overheads(dim, rounds=3, batch=2, layers=4):
    """Eager forward + backward time of residual, naive and optimised mHC at one C, interleaved."""
    cfg_c = mhc.Config(dim=dim, n_layers=layers, n_heads=max(1, dim // 64), seq_len=128)
    torch.manual_seed(0)
    residual, hyper = mhc.Transformer(cfg_c, hyper=False), mhc.Transformer(cfg_c)
    data = mhc.synthetic_batch(cfg_c, batch, torch.Generator().manual_seed(0), "cpu")
    l_r = mhc.default_recompute_block(cfg_c.n_hc, layers)
    runs = {
        "residual": (residual, {}),
        "naive": (hyper, {}),
        "optimised": (hyper, dict(variant="optimised", block=l_r)),
    }
    times = {name: [] for name in runs}
    for rnd in range(rounds + 1):
        for name, (model, options) in runs.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            model(data[:, :-1], data[:, 1:], **options).backward()
            if rnd:  # round 0 warms up
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {name: 100 * (med[name] / med["residual"] - 1) for name in ("naive", "optimised")}


live = live_overheads(128)
print(
    f"[{time.perf_counter() - began:.1f} s] live, C=128, eager: naive {live['naive']:+.0f}%, "
    f"optimised {live['optimised']:+.0f}% step time over the residual"
)

fig, ax = plt.subplots(figsize=(10, 4), dpi=110)
styles = {
    ("naive", "eager"): ("#c44e52", "--", "o"),
    ("optimised", "eager"): ("#55a868", "--", "o"),
    ("naive", "compiled"): ("#c44e52", "-", "s"),
    ("optimised", "compiled"): ("#55a868", "-", "s"),
}
if curve:
    dims = curve["dims"]
    for (variant, mode), (color, ls, marker) in styles.items():
        ax.plot(
            dims,
            [curve["overhead_pct"][f"{variant} {mode} {d}"] for d in dims],
            color=color,
            ls=ls,
            marker=marker,
            lw=2,
            label=f"{variant} mHC, {mode}",
        )
    if "floor_pct" in curve:  # the optimised kernels' least bytes, streamed cold
        ax.plot(
            dims, [curve["floor_pct"][str(d)] for d in dims], color="crimson", ls="--", lw=1.5,
            label="floor: the optimised kernels' least bytes, streamed cold",
        )  # fmt: skip
    if "control_pct" in curve:  # how far apart two residual models of equal work read, compiled
        spread = [abs(curve["control_pct"][str(d)]) for d in dims]
        ax.fill_between(
            dims,
            [-s for s in spread],
            spread,
            color="#999999",
            alpha=0.25,
            label="A/A control: two equal residual models differ by this",
        )
for variant, color in (("naive", "#c44e52"), ("optimised", "#55a868")):
    ax.plot(
        [128],
        [live[variant]],
        marker="*",
        ms=14,
        color=color,
        ls="none",
        label=f"{variant}, eager, measured live at C=128",
    )
ax.axhline(6.7, color="#555555", ls=":", lw=1.5, label="V4's 6.7% (GPUs, overlapped 1F1B)")
ax.set_xscale("log", base=2)
ax.set_yscale("symlog", linthresh=2, linscale=0.5)  # log above 2%; a noisy point may read < 0
xticks = sorted({128, *(curve["dims"] if curve else [])})
ax.set_xticks(xticks, [str(d) for d in xticks])
ax.xaxis.set_minor_locator(plt.NullLocator())
ticks = [-5, 0, 2, 5, 10, 20, 50, 100, 200, 500]
ax.set_yticks(ticks, [str(t) for t in ticks])
ax.set_xlabel("hidden size C (width of one lane)")
ax.set_ylabel("step-time overhead over the residual (%)")
ax.set_title(
    "mHC's cost over C: eager (dashed) vs torch.compile (solid), 4 layers, T=128, 1 thread"
)
ax.legend(fontsize=9, ncol=2, loc="best")
ax.tick_params(labelsize=10)
ax.grid(alpha=0.3, which="major")
plt.tight_layout()
plt.show()
if curve:
    print(f"recorded: {curve['setup']} ({curve_file.name})")
    for d in curve["dims"]:
        cells = ", ".join(
            f"{v} {m} {curve['overhead_pct'][f'{v} {m} {d}']:+.1f}%" for v, m in styles
        )
        print(f"  C={d:<5} {cells}")
    if "control_pct" in curve:  # the A/A control: how far apart two models of equal work read
        print(
            "  resolution, a second residual model of the same work timed alongside: "
            + ", ".join(f"C={d} {curve['control_pct'][str(d)]:+.1f}%" for d in curve["dims"])
        )
    d0 = min(curve["dims"])
    guess = curve["overhead_pct"][f"optimised compiled {d0}"] * d0 / 128
    print(
        f"at C=128, compiled: about {guess:.0f}% to expect (C={d0}'s {d0 / 128:.0f}x, "
        f"overhead ~ 1/C), against the eager {live['optimised']:.0f}% measured live above"
    )
else:
    print("benchmarks/curve_cpu.json not found: run the bench command above to record the curve")
n = cfg.n_hc
for dim in (128, 1024):
    # per token and layer: F is the mean of attention (4 C^2 multiply-adds) and MLP (8 C^2);
    # the mixing: projection nC x (2n + n^2), pre-mix nC, post-mix n^2 C + nC
    f_flops = 2 * 6 * dim * dim
    mix_flops = 2 * (n * dim * (2 * n + n * n) + 2 * n * dim + n * n * dim)
    print(
        f"C={dim}: mixing ~{mix_flops / f_flops:.0%} of F's matmul flops, and its "
        f"{4 * n * dim * 2:,} bytes of lanes per read+write are memory-bound work F does not have"
    )

# %% [markdown]
# ### Where the time goes
# Left: one layer's parts, forward + backward, at each C, as plain autograd run eagerly, with the
# hand-written backward (eager), and the plain math under `torch.compile`: compiling cuts
# Sinkhorn's cost by more than half (40 tiny normalisations, each a separate op eagerly) and the
# coefficients' by about half (norm, gates and projection fuse); the post-mix, which moves the whole
# n-lane stream, gains least.
# Right: the optimised compiled model's own kernels, each timed inside the model, stacked against
# the step overhead measured in the same run. The bars are the steadier number: the overhead is a
# difference of two steps of separate models, and the A/A control (a second residual model of the
# same work, the grey band above and the error bars here) shows how far two such models read
# apart within a run: within 2.7% in the recorded one, but 5-9% at C = 2048 in others, and from
# run to run the overheads at C >= 1024 move by more than that (9.2-19% at C = 1024 over nine).
# The crimson dashes (and the dashed line above) are the kernels' floor: the least bytes those
# calls must move (each tensor they need read once, each output written once: 116 MiB read and
# 57 MiB written per step at C = 1024), at the rate one core streams memory with caches cold, as
# F's matmuls leave them. The other marks are stand-ins timed in the kernels' place: blue, the same
# kernels without the gates and Sinkhorn, which cost about as much as the kernels from C = 1024 on
# (the time is the passes over the stream, not the coefficient math); crimson crosses, stubs that
# only move the floor's bytes, each call's own cost included: 5.7% of the residual's step at
# C = 1024.
# V4's 6.7% is at this machine's floor for this design, and the compiled kernels take about twice
# it: each projection matmul goes to the BLAS library as a pass of its own over the stream, with
# the loops around it reading the stream again. Fusing those matmuls into the streaming loops is
# hand-written kernels' ground; a GPU is where V4 measured its 6.7%.

# %%
if curve and "parts_ms" in curve:
    parts = ["coefficients", "Sinkhorn", "pre-mix", "post-mix"]
    ways = [("eager", "plain, eager"), ("fused", "hand-written, eager"), ("compiled", "compiled")]
    dims = curve["dims"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.5))
    width = 0.8 / len(ways)
    for w, (key, label) in enumerate(ways):
        bottom = [0.0] * len(dims)
        for p, part in enumerate(parts):
            ms = [curve["parts_ms"].get(f"{part} {key} {d}", 0.0) for d in dims]
            left.bar(
                [i + (w - 1) * width for i in range(len(dims))],
                ms,
                width,
                bottom=bottom,
                color=plt.cm.tab10(p),
                alpha=(0.45, 0.7, 1.0)[w],
                label=part if w == 2 else None,
            )
            bottom = [b + m for b, m in zip(bottom, ms)]
    left.set_xticks(range(len(dims)), [f"C={d}" for d in dims])
    left.set_ylabel("ms per layer, forward + backward")
    left.set_title("One layer's mixing parts; per C: plain eager | hand-written eager | compiled")
    left.legend(fontsize=9)
    if "kernels_ms_per_step" in curve:
        kernels = list(dict.fromkeys(k.rsplit(" ", 1)[0] for k in curve["kernels_ms_per_step"]))
        bottom = [0.0] * len(dims)
        for k, kernel in enumerate(kernels):
            ms = [curve["kernels_ms_per_step"][f"{kernel} {d}"] for d in dims]
            right.bar(range(len(dims)), ms, 0.5, bottom=bottom, color=plt.cm.Set2(k), label=kernel)
            bottom = [b + m for b, m in zip(bottom, ms)]
        overhead = [
            curve["step_ms"][f"optimised compiled {d}"] - curve["step_ms"][f"residual compiled {d}"]
            for d in dims
        ]
        right.plot(range(len(dims)), overhead, "k_", ms=30, mew=2, label="measured step overhead")
        if "control_pct" in curve:  # the A/A control in ms: how far two equal models read apart
            spread = [
                abs(curve["control_pct"][str(d)]) / 100 * curve["step_ms"][f"residual compiled {d}"]
                for d in dims
            ]
            right.errorbar(
                range(len(dims)), overhead, yerr=spread, fmt="none", ecolor="k", capsize=6,
                label="± the A/A control",
            )  # fmt: skip
        if "floor_ms" in curve:  # the least bytes those calls must move, streamed cold
            floor = [curve["floor_ms"][str(d)] for d in dims]
            right.plot(
                range(len(dims)), floor, "_", color="crimson", ms=30, mew=2,
                label="floor: their least bytes, streamed cold",
            )  # fmt: skip
        stubs = curve.get("stubs_ms_per_step", {})  # stand-ins timed in the kernels' place
        for which, marker, color, label in (
            ("passes", "D", "#4c72b0", "the kernels without gates and Sinkhorn (same passes)"),
            ("floor", "x", "crimson", "stubs that only move the floor's bytes"),
        ):
            if f"{which} {dims[0]}" in stubs:
                right.plot(
                    range(len(dims)), [stubs[f"{which} {d}"] for d in dims], marker, ms=8,
                    mew=2, color=color, ls="none", label=label,
                )  # fmt: skip
        right.set_xticks(range(len(dims)), [f"C={d}" for d in dims])
        right.set_ylabel("ms per step (4 layers)")
        right.set_title("Optimised, compiled: its kernels, timed inside the model")
        right.legend(fontsize=9, loc="best", markerscale=0.5)
        for i, (d, total, extra) in enumerate(zip(dims, bottom, overhead)):
            floor_note = f", floor {floor[i]:.1f}" if "floor_ms" in curve else ""
            if f"passes {d}" in stubs:
                floor_note += (
                    f", without the coefficient math {stubs[f'passes {d}']:.1f}, "
                    f"floor stubs {stubs[f'floor {d}']:.1f}"
                )
            print(f"C={d}: kernels {total:.1f}{floor_note} ms per step, overhead {extra:.1f} ms")
    plt.tight_layout()
    plt.show()
else:
    print("no per-part timings in the recorded curve: rerun the bench command above")
