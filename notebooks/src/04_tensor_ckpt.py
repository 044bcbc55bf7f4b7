# %% [markdown]
# # Tensor-level activation checkpointing (DeepSeek-V4 §3.4.4)
#
# **What you will be able to do** after this notebook:
# 1. Say what activation checkpointing trades (memory after forward for work in backward), and
#    place V4's per-**tensor** choice beside checkpointing a whole layer and selective
#    checkpointing (SAC) per operator type; predict which of them peaks lowest, and why their peaks
#    differ less than the memory they free.
# 2. Read a traced graph: for a forgotten tensor, find its **recompute subgraph** (walk back to
#    tensors that are kept anyway) and predict the bytes forgetting it frees, knowing that a
#    **view** shares its base's **storage** and that only what autograd saves can be freed.
# 3. Explain how **saved-tensor hooks** swap a saved tensor for a handle in forward and bring it
#    back, once, in backward; predict when `checkpoint_tensors` warns that a forget pulls a
#    matmul or the attention into every backward.
#
# Course syllabus: topic **05, activation checkpointing**, with topic **01, the training memory
# budget** (activations are its largest part) and topic **03, the cost of a step** (backward costs
# about twice the forward; a recompute adds to it). The graded exercise is [assignment 5 in
# docs/assignments.md][a5]: you write `forget`, the storage units, the recompute subgraph, the
# recompute and the two hooks of `tensor_ckpt.py`. Terms in bold are defined where they first
# appear and in the [glossary](../docs/GLOSSARY.md); "V4 §3.4.4" is a section of the DeepSeek-V4
# technical report. Steps are numbered from 1.
#
# Every number in this notebook carries its evidence: [MEASURED] on this CPU when the notebook
# ran, [PAPER] for DeepSeek-V4's own figures, [DERIVED] for what follows by arithmetic; the
# [evidence ledger](../docs/EVIDENCE.md) defines the tags and says where each figure comes from.
#
# [a5]: ../docs/assignments.md#5-tensor_ckptpy-checkpointing-single-tensors-not-layers-v4-344

# %%
import operator
import textwrap
import time
import warnings

import matplotlib.pyplot as plt
import torch
import torch.fx as fx
import torch.nn as nn
from matplotlib.lines import Line2D
from matplotlib.patches import Arc, FancyArrowPatch, FancyBboxPatch, Patch

import tensor_ckpt as tc
from benchmarks import bench_tensor_ckpt as bench
from benchmarks.ckpt_meters import activation_bytes
from memory.memory_timeline import MiB
from memory.plots import plot_timelines
from notebooks.checks import check, number

plt.rcParams.update({"figure.dpi": 110, "font.size": 10})
torch.set_num_threads(2)
T0 = time.perf_counter()
KEPT, GONE, REDO, PLAIN = "#55a868", "#c44e52", "#dd8452", "0.55"  # the roles in the two drawings


def stage(what):
    print(f"[{time.perf_counter() - T0:6.1f} s] {what}", flush=True)


# %% [markdown]
# ## 1. The picture first: forget a tensor, recompute it in backward
# The forward pass keeps some of its intermediate results for the backward pass: a matmul's
# weight gradient needs the matmul's input, GELU's gradient needs GELU's input. Autograd stores
# these **saved tensors** (the **activations**) in the graph until the gradient that reads them
# has run, and they are the largest part of a training step's memory. **Activation
# checkpointing** keeps fewer of them and recomputes the rest in backward: memory for work.
#
# V4 chooses per tensor. The author writes `forget(h)` on tensors that are large and cheap to
# redo (norm outputs, activation-function outputs) and keeps the matmul outputs. In backward, a
# forgotten tensor comes back by re-running the ops between it and the nearest tensors that are
# kept anyway: its **recompute subgraph**. The sketch is the MLP half of a layer, drawn by hand.

# %%
fig, ax = plt.subplots(figsize=(10, 4.6))


def box(cx, cy, text, kind, w=0.9, h=0.55):
    face = {"kept": KEPT, "forgotten": "white", "output": "0.85", "redo": "white"}[kind]
    edge = {"kept": KEPT, "forgotten": GONE, "output": "0.5", "redo": REDO}[kind]
    ax.add_patch(
        FancyBboxPatch(
            (cx - w / 2, cy - h / 2),
            w,
            h,
            boxstyle="round,pad=0.05",
            fc=face,
            ec=edge,
            lw=2,
            ls="--" if kind == "forgotten" else "-",
        )
    )
    color = {"kept": "w", "output": "k"}.get(kind, edge)
    ax.text(cx, cy, text, ha="center", va="center", fontsize=12, fontweight="bold", color=color)


def arrow(a, b, color="0.3", text=None, dy=0.05, ls="-", lw=1.4):
    ax.add_patch(
        FancyArrowPatch(
            a,
            b,
            arrowstyle="-|>",
            mutation_scale=14,
            color=color,
            lw=lw,
            ls=ls,
            shrinkA=0,
            shrinkB=0,
        )
    )
    if text:
        ax.text((a[0] + b[0]) / 2, a[1] + dy, text, ha="center", va="bottom", color=color)


Y, GAP = 2.6, 2.2  # the forward row's height, the spacing of tensors
toy = [
    ("x", "kept", "saved by norm"),
    ("h", "forgotten", "saved by fc1"),
    ("u", "kept", "saved by gelu"),
    ("g", "forgotten", "saved by fc2"),
    ("y", "output", ""),
]
for i, (name, kind, who) in enumerate(toy):
    box(i * GAP, Y, name, kind)
    ax.text(i * GAP, Y - 0.45, who, ha="center", va="top", fontsize=9, color="0.3")
for i, op in enumerate(["norm", "fc1\n(matmul)", "gelu", "fc2\n(matmul)"]):
    arrow((i * GAP + 0.5, Y), ((i + 1) * GAP - 0.5, Y), text=op)
ax.text(-1.0, Y, "forward", ha="right", va="center", fontsize=11, fontweight="bold")
ax.text(-1.0, 0.9, "backward", ha="right", va="center", fontsize=11, fontweight="bold")
for src, dst, op, need in (
    (0, 1, "norm", "fc1's weight gradient needs h"),
    (2, 3, "gelu", "fc2's weight gradient needs g"),
):
    x0, x1 = src * GAP, dst * GAP
    ax.add_patch(
        FancyBboxPatch(
            (x0 - 0.6, 0.45),
            x1 - x0 + 1.2,
            0.9,
            boxstyle="round,pad=0.05",
            fc="none",
            ec=REDO,
            lw=1.5,
            ls=":",
        )
    )
    box(x0, 0.9, toy[src][0], "kept", w=0.6, h=0.45)
    box(x1, 0.9, toy[dst][0], "redo", w=0.6, h=0.45)
    arrow((x0 + 0.35, 0.9), (x1 - 0.35, 0.9), color=REDO, text=op, dy=0.03)
    ax.text((x0 + x1) / 2, 0.3, need, ha="center", va="top", fontsize=9, color=REDO)
    arrow((x0, Y - 0.85), (x0, 1.2), color=KEPT, ls="--", lw=1)  # the kept tensor, read again
legend = [
    Patch(fc=KEPT, ec=KEPT, label="kept: autograd saves it anyway"),
    Patch(fc="white", ec=GONE, ls="--", lw=2, label="forgotten: freed after forward"),
    Patch(fc="white", ec=REDO, lw=2, label="recomputed in backward, once"),
    Line2D([], [], color=REDO, ls=":", lw=1.5, label="a recompute subgraph"),
]
ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=4, frameon=False)
ax.set(xlim=(-2.2, 4 * GAP + 0.8), ylim=(-0.1, 3.4))
ax.axis("off")
ax.set_title("Forget two cheap tensors, keep the rest: each comes back by one cheap op")
fig.tight_layout()
plt.show()

# %% [markdown]
# **What to look at:** each forgotten tensor (red, dashed) sits one cheap op after a tensor that
# autograd keeps for another gradient anyway (green). Its recompute subgraph (dotted orange) is
# that one op, no matmul: forgetting h and g frees their memory for the price of a norm and a GELU
# in backward. Had u been forgotten as well, bringing g back would first need u, and u's walk back
# passes through fc1, a matmul.
#
# ## 2. Three granularities, and the words for the machinery
# - **Module-level checkpointing** (`torch.utils.checkpoint`): a whole region (here, a layer)
#   keeps only its input; backward re-runs the region's forward, matmuls included (up to the last
#   tensor its gradients need).
# - **SAC** (selective activation checkpointing): inside such a region, a policy per operator type
#   says what to save ("save every matmul and attention output, recompute the rest").
# - **Tensor-level** (V4, `tensor_ckpt.py`): `forget(x)` on individual tensors, anywhere.
#
# To know what a forget costs, `tensor_ckpt.py` needs the forward as a graph. An **FX trace**
# (`torch.fx`) runs the module's forward once on stand-in values that record every operation
# instead of computing it; the result is a graph of nodes, one per op, in execution order, each
# named after its module or function (`norm1`, `fc1`, `gelu`). A tensor's memory is its
# **storage**, a flat buffer of bytes; a **view** (`.view`, `.transpose`, `.permute`, a
# `.reshape` that needs no copy) is a new shape over the *same* storage. Memory is freed per
# storage, so forgetting a view forgets its base, and keeping any alias keeps all of it. The
# trace is run once on example inputs to learn which nodes share a storage, which storages
# autograd saves, and each op's matmul FLOPs.
#
# The layer below (`tensor_ckpt.MarkedLayer`) is a pre-norm transformer layer with V4's three marks:
# the two LayerNorm outputs and the GELU output, for a batch of 4 sequences of 128 tokens, width
# 128, fp32. The plan says, per forgotten storage, what it frees and what backward re-runs.

# %%
torch.manual_seed(0)
C, HEADS, T, BATCH = 128, 4, 128, 4
block = tc.MarkedLayer(C, HEADS)
x = torch.randn(BATCH, T, C, requires_grad=True)
ckpt = tc.checkpoint_tensors(block, (x,))
print(ckpt.plan)
plain_held, _ = activation_bytes(block, x)  # bytes the plain forward leaves alive (a meter)


# %%
class StorageOf(fx.Interpreter):
    """Runs a traced graph once, noting per node the storage its (first) tensor lives in."""

    def __init__(self, gm):
        super().__init__(gm, garbage_collect_values=False)  # keep every value: addresses stay
        self.storage = {}

    def run_node(self, n):
        out = super().run_node(n)
        items = out if isinstance(out, (tuple, list)) else [out]
        first = next((t for t in items if isinstance(t, torch.Tensor)), None)
        if first is not None:
            self.storage[n] = first.untyped_storage().data_ptr()
        return out


HIDDEN = {getattr, operator.getitem, operator.floordiv, tc.forget}  # shapes, indexing, marks


def draw_plan(gm, plan, example, ax):
    """The traced graph without its bookkeeping nodes (shapes, indexing, the forget marks)."""
    meter = StorageOf(gm)
    meter.run(*example)
    owner = {}
    for n, key in meter.storage.items():
        owner.setdefault(key, n)  # the first node writing a storage owns it
    nodes = [n for n in gm.graph.nodes if n.op != "output" and n.target not in HIDDEN]
    row = {n: i for i, n in enumerate(nodes)}

    def sources(m):  # the drawn nodes a value comes from, through hidden tensor nodes only
        if m in row:
            return {m}
        if m not in meter.storage:  # a shape or an int: not a data edge
            return set()
        return set().union(*(sources(k) for k in m.all_input_nodes))

    freed = {m: u.bytes_freed for u in plan.units for m in u.members}
    rerun = {n for u in plan.units for n in u.nodes}
    frontier = {s for u in plan.units for f in u.frontier for s in sources(f)}
    for n in nodes:
        for m in set().union(set(), *(sources(k) for k in n.all_input_nodes)):
            span = row[n] - row[m]
            ax.add_patch(
                Arc(
                    (0, (row[n] + row[m]) / 2),
                    width=0.3 * span,
                    height=span,
                    theta1=-90,
                    theta2=90,
                    lw=0.8,
                    color="0.65",
                )
            )
    for n in nodes:
        face = GONE if n.name in freed else KEPT if n in frontier else PLAIN
        if n in rerun:
            ax.scatter(0, row[n], s=220, facecolor="none", edgecolor=REDO, lw=2.5, zorder=3)
        ax.scatter(0, row[n], s=70, color=face, zorder=4)
        if n.op == "call_module":
            kind = type(gm.get_submodule(n.target)).__name__
            what = f"{kind} (matmul)" if kind == "Linear" else kind
        elif n.op == "call_method":
            what = f".{n.target}()"
        else:
            what = "input" if n.op == "placeholder" else getattr(n.target, "__name__", "")
        label = n.name if what == n.name else f"{n.name}  {what}"
        ax.text(-0.3, row[n], label, ha="right", va="center", fontsize=10)
        key = meter.storage.get(n)
        note = (
            f"forgotten: frees {freed[n.name] / 2**10:.0f} KiB"
            if n.name in freed
            else f"a view of {owner[key].name}'s storage"
            if key and owner[key] is not n
            else ""
        )
        ax.text(
            0.3,
            row[n],
            note,
            ha="left",
            va="center",
            fontsize=9,
            color=GONE if n.name in freed else "0.4",
        )
    ax.set_ylim(len(nodes) - 0.5, -0.8)
    ax.set_xlim(-4.5, 4.5)
    ax.axis("off")


fig, ax = plt.subplots(figsize=(9, 6.5))
draw_plan(ckpt.gm, ckpt.plan, (x,), ax)
legend = [
    Line2D([], [], marker="o", ls="", color=GONE, ms=8, label="forgotten"),
    Line2D(
        [], [], marker="o", ls="", mfc="none", mec=REDO, mew=2.5, ms=12, label="re-run in backward"
    ),
    Line2D([], [], marker="o", ls="", color=KEPT, ms=8, label="kept, read by a recompute"),
    Line2D([], [], marker="o", ls="", color=PLAIN, ms=8, label="other op"),
]
ax.legend(handles=legend, loc="lower right", frameon=False)
ax.set_title("One MarkedLayer, traced by FX: execution order top to bottom, arcs are data edges")
fig.tight_layout()
plt.show()

# %% [markdown]
# **What to look at:** every orange ring sits on a red dot: each recompute is one op deep, and
# starts from a green tensor that autograd saves anyway (the input x for `norm1`, the residual sum
# `add` for `norm2`, fc1's output for `gelu`). None of the re-run ops is a matmul. The grey notes
# say which nodes are views: q, k and v (`unbind`) live in qkv's storage, `reshape` in the
# attention output's.
#
# ### Exercise 1 (predict, then run): the bytes a forget frees
# Forget only the qkv projection's output (`names=["qkv"]`, shape 4 × 128 × 384, fp32) instead of
# the three marks. How many bytes of activations does that free? Think about what attention saves
# for its backward, and where those tensors live.

# %%
answer_qkv_bytes = None  # bytes freed by forgetting qkv's output (an int)

# %%
# check: answer_qkv_bytes
held, _ = activation_bytes(tc.checkpoint_tensors(block, (x,), names=["qkv"]), x)
check(
    "answer_qkv_bytes",
    answer_qkv_bytes,
    number(
        plain_held - held,
        unit="B",
        hint="Nothing keeps the Linear's output itself, but attention saves q, k and v for "
        "its backward: are they storages of their own? (fp32: 4 bytes a number)",
    ),
)

# %% [markdown]
# ### Exercise 2 (predict, then run): forget fc2's output
# Now forget fc2's output alone (`names=["fc2"]`, shape 4 × 128 × 128, fp32). It is a matmul
# output, and the last op before the residual sum `add_1`. How many bytes does forgetting it free?
# (Does `checkpoint_tensors` warn? The check cell says.)

# %%
answer_fc2_bytes = None  # bytes freed by forgetting fc2's output (an int)


# %%
# check: answer_fc2_bytes
def judge_fc2(answer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fc2_ckpt = tc.checkpoint_tensors(block, (x,), names=["fc2"])
    freed = plain_held - activation_bytes(fc2_ckpt, x)[0]
    if int(answer) == freed:
        return True, (
            f"{freed} B: a sum's gradient needs neither input, so autograd never saved fc2's "
            f"output; forgetting it frees nothing, is never recomputed, and raises "
            f"{len(caught)} warnings"
        )
    return False, (
        f"{answer} B is {'too high' if int(answer) > freed else 'too low'}: a forget frees only "
        "what autograd would have kept; which op would save fc2's output for its gradient?"
    )


check("answer_fc2_bytes", answer_fc2_bytes, judge_fc2)

# %% [markdown]
# ## 3. At run time: two saved-tensor hooks
# Autograd lets you intercept every tensor it saves. `torch.autograd.graph.saved_tensors_hooks(
# pack, unpack)` calls `pack(t)` in forward each time an op saves a tensor `t`, and stores
# whatever `pack` returns; in backward it calls `unpack` on that to get the tensor back. Those are
# **saved-tensor hooks**. The cell below only watches: it counts what one plain MarkedLayer
# forward saves.

# %%
seen = []


def watch(t):  # a pack hook that keeps the tensor itself, as autograd would
    seen.append((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
    return t


with torch.autograd.graph.saved_tensors_hooks(watch, lambda t: t):
    out = block(x)
given = {p.untyped_storage().data_ptr() for p in [x, *block.parameters()]}
made = {ptr: n for ptr, n in seen if ptr not in given}
print(
    f"one MarkedLayer forward: autograd saved {len(seen)} tensors in {len({p for p, _ in seen})} "
    f"storages; {len(made)} of the storages were made by the forward, "
    f"{sum(made.values()) / MiB:.2f} MiB (the rest are the input and the weights); the meter "
    f"of benchmarks/ckpt_meters.py finds {plain_held / MiB:.2f} MiB alive after the forward"
)
del out

# %% [markdown]
# `tensor_ckpt.py` runs the traced graph under its own pair. Its `pack_hook` returns a small
# handle instead of a tensor whose storage is forgotten, so nothing references that storage after
# forward and it is freed. Its `unpack_hook` asks the handle's storage to recompute (the first
# time; later unpacks reuse the value), rebuilds the saved alias as a view of it, and drops the
# storage after the last gradient that needs it. The gradients are the plain model's, bit for bit:

# %%
grads = []
for fn in (block, ckpt):
    block.zero_grad(set_to_none=True)
    ckpt.recomputations = 0
    fn(x).square().mean().backward()
    grads.append([p.grad.clone() for p in block.parameters()])
same = all(torch.equal(a, b) for a, b in zip(*grads))
print(
    f"gradients bitwise equal to the plain layer's: {same}; one backward ran "
    f"{ckpt.recomputations} recompute subgraphs, for {len(ckpt.plan.units)} forgotten storages"
)
block.zero_grad(set_to_none=True)

# %% [markdown]
# ## 4. What each choice saves and costs
# The same layer with other choices of what to forget, given by node name (no edit to the model).
# When a recompute would re-run a matmul or the attention that the choice did not name, because
# a tensor on the way back is kept by no one, `checkpoint_tensors` warns.
#
# ### Exercise 3 (predict, then run): which forgets warn?
# Of the five single forgets `"norm2"`, `"permute"` (the reordering of qkv's output into heads),
# `"scaled_dot_product_attention"`, `"proj"` and `"fc2"`, which make `checkpoint_tensors` warn?
# Answer with a list of names (possibly empty). Use the traced graph above: walk back from each
# to kept tensors.

# %%
answer_warned = None  # the names, among the five, whose forget warns (a list of strings)


# %%
# check: answer_warned
def warnings_of(names):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tc.checkpoint_tensors(block, (x,), names=names)
    return [str(w.message) for w in caught if str(w.message).startswith("tensor_ckpt")]


def judge_warned(answer):
    five = ["norm2", "permute", "scaled_dot_product_attention", "proj", "fc2"]
    chosen = {answer} if isinstance(answer, str) else set(answer)
    if not chosen <= set(five):
        return False, f"{sorted(chosen - set(five))} is not among the five: {five}"
    warned = {name for name in five if warnings_of([name])}
    if chosen == warned:
        return True, (
            "permute is a view of qkv's output, so forgetting it forgets that storage and qkv runs "
            "again. The others start from a kept tensor, or re-run only the op you named"
        )
    said = [
        f"{sorted(chosen - warned)} do not warn" if chosen - warned else "",
        f"{len(warned - chosen)} of the others do" if warned - chosen else "",
    ]
    return False, (
        "; ".join(s for s in said if s) + ". A forget warns when its walk back passes a matmul or "
        "the attention before reaching tensors autograd keeps; a view's storage is its base's"
    )


check("answer_warned", answer_warned, judge_warned)

# %% [markdown]
# All the choices at once, measured: memory saved is the bytes alive after forward, plain minus
# checkpointed; the recompute cost is the matmul and attention FLOPs that backward runs beyond the
# plain backward. The warnings are printed whole.

# %%
choices = {
    "norms": ["norm1", "norm2"],
    "gelu": ["gelu"],
    "V4: norms + gelu": ["norm1", "norm2", "gelu"],
    "reshape (a view!)": ["reshape"],
    "residual sum (add)": ["add"],
    "+ fc1 output": ["norm1", "norm2", "gelu", "fc1"],
    "+ qkv output": ["norm1", "norm2", "gelu", "qkv"],
    "+ attention out": ["norm1", "norm2", "gelu", "scaled_dot_product_attention"],
}
ones = torch.ones(BATCH, T, C)
plain_work = bench.backward_work(block, x, ones)
points = {}
for label, names in choices.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = tc.checkpoint_tensors(block, (x,), names=names)
    held, _ = activation_bytes(c, x)
    flops, ops, written = (a - b for a, b in zip(bench.backward_work(c, x, ones), plain_work))
    points[label] = ((plain_held - held) / MiB, flops / 1e6, written / MiB)
    print(
        f"{label:<19} saves {(plain_held - held) / MiB:4.2f} of {plain_held / MiB:.2f} MiB; "
        f"backward re-runs {flops / 1e6:5.1f} MFLOP of matmul/attention, {ops:3d} more aten "
        f"ops, allocates {written / MiB:4.2f} MiB more"
    )
    for w in caught:
        print(
            textwrap.fill(
                str(w.message), 96, initial_indent="    warning: ", subsequent_indent=" " * 13
            )
        )

fig, ax = plt.subplots(figsize=(9, 4.2))
for label, (saved, flops, _) in points.items():
    ax.scatter(flops, saved, color=GONE if label.startswith("V4") else "#4c72b0", s=40)
    ax.annotate(label, (flops, saved), textcoords="offset points", xytext=(5, 3))
ax.set_xlabel("matmul/attention work backward re-runs (MFLOP per backward)")
ax.set_ylabel("activation memory saved (MiB)")
ax.set_xlim(-0.05 * ax.get_xlim()[1], 1.3 * ax.get_xlim()[1])  # room for the labels
ax.grid(alpha=0.3)
ax.set_title("One layer: memory saved against recomputed matmul/attention, per choice")
fig.tight_layout()
plt.show()
free = {k: v for k, v in points.items() if v[1] == 0}
costly = {k: v for k, v in points.items() if v[1] > 0}
print(
    f"{len(free)} choices re-run no matmul or attention ({', '.join(free)}), saving up to "
    f"{max(v[0] for v in free.values()):.2f} MiB; {len(costly)} re-run "
    f"{min(v[1] for v in costly.values()):.1f} to {max(v[1] for v in costly.values()):.1f} "
    "MFLOP per backward"
)
gap, widest = max((abs(v[2] - v[0]), label) for label, v in points.items())
print(
    f"the bytes the backward allocates beyond the plain one track the bytes saved, within "
    f"{gap:.2f} MiB (the widest gap: {widest}); a recompute writes again what forgetting saved, so "
    "bytes hardly tell the choices apart; matmul FLOPs do"
)

# %% [markdown]
# **What to look at:** the left edge. The V4 choice (red) saves the most of all the choices that
# cost no matmul FLOPs; every further forget moves right, into matmul or attention work that each
# backward repeats. The two warned choices sit lowest: `reshape` and `add` save little (one small
# storage) and re-run the attention or the output projection for it.
#
# ### Exercise 4 (change the code, run, observe): the largest batch under a budget
# Say a layer may keep 4 MiB of activations for its backward. With V4's choice (norms and gelu
# forgotten) and sequences of T = 128 tokens, what is the **largest batch** (sequences) that
# stays under 4 MiB? Edit `batch_x` in the cell below and run it until you know.
# [MEASURED: the bytes printed below, on this CPU; the 4 MiB is the exercise's given]

# %%
V4_NAMES = ["norm1", "norm2", "gelu"]
batch_x = 4  # edit, run, repeat
x_b = torch.randn(batch_x, T, C)
held_b, _ = activation_bytes(tc.checkpoint_tensors(block, (x_b,), names=V4_NAMES), x_b)
print(f"batch {batch_x}: V4's choice keeps {held_b / MiB:.2f} MiB after forward")

# %%
answer_batch = None  # the largest batch under 4 MiB (an int)


# %%
# check: answer_batch
def kept_mib(batch):
    xb = torch.randn(batch, T, C)
    return activation_bytes(tc.checkpoint_tensors(block, (xb,), names=V4_NAMES), xb)[0] / MiB


largest = max(b for b in range(1, 17) if kept_mib(b) < 4)
check(
    "answer_batch",
    answer_batch,
    number(largest, unit="sequences", hint="What is kept grows in proportion to the batch."),
)

# %% [markdown]
# ## 5. Four ways to checkpoint, one step each
# Two layers of the same block, one training step, recorded with `memory/memory_timeline.py`
# (notebook 00 explains the recorder; the x axis counts allocation events). The variants are the
# benchmark's (`benchmarks/bench_tensor_ckpt.py`): `none`; `module`, `torch.utils.checkpoint`
# around each layer; `SAC`, a policy that saves every matmul and attention output; `tensor_ckpt`,
# V4's three marks per layer.
#
# ### Exercise 5 (predict, then run): the lowest peak
# Which of `"none"`, `"module"`, `"SAC"` and `"tensor_ckpt"` reaches the lowest peak memory over
# the step? The peak comes in backward, once gradients and recomputed tensors have appeared and
# before all the activations have been released.

# %%
answer_lowest_peak = None  # the variant's name (a string)

# %%
stage("recording one step of each variant, two layers")
torch.manual_seed(0)
stack = nn.Sequential(*[tc.MarkedLayer(C, HEADS) for _ in range(2)])
grad = torch.randn(BATCH, T, C)
timelines, held_after_forward, rerun_flops = {}, {}, {}
plain_flops = bench.backward_work(stack, x, grad)[0]
for name, fn in bench.variants(stack, x).items():
    held_after_forward[name], _, timelines[name] = bench.memory(stack, fn, x, grad)
    rerun_flops[name] = bench.backward_work(fn, x, grad)[0] - plain_flops
stack.zero_grad(set_to_none=True)
peaks = {name: tl.peak() for name, tl in timelines.items()}
stage("done")


# %%
# check: answer_lowest_peak
def judge_lowest(answer):
    lowest = min(peaks, key=peaks.get)
    if str(answer).strip() not in peaks:
        return False, f"{answer!r} is not one of {list(peaks)}"
    if str(answer).strip() == lowest:
        return True, (
            f"{lowest} peaks at {peaks[lowest] / MiB:.2f} MiB: it keeps each layer's input only "
            "and re-runs one layer at a time, so at most one layer's activations are alive"
        )
    return False, (
        f"not {answer}: at the peak backward is under way; count what is alive then, including "
        "what each variant has recomputed for the layer it is in"
    )


check("answer_lowest_peak", answer_lowest_peak, judge_lowest)

# %% [markdown]
# **The four timelines, and why their peaks are close.** In the figure below, **what to look
# at:** the red activation band at the end of forward (the grey phase) differs a lot
# between the panels; the peaks, in backward (yellow), much less. The re-run column is the price:
# `module` re-runs most of the forward's matmul and attention work (printed under the table). The
# table says why the peaks are close. At the peak, the parameters, the input and the first gradients
# are there in every variant (last column), and each variant's savings have partly come back as
# temporaries: `module` re-runs a whole layer's forward, `SAC` and `tensor_ckpt` recompute the
# current layer's forgotten tensors. With two layers that shared part is a large share of every
# peak. The savings are per layer, so they grow with depth: the same step for 2, 4 and 8 layers,
# recorded first and drawn after the timelines.

# %%
depths, by_depth = [2, 4, 8], {name: [peak / MiB] for name, peak in peaks.items()}
for depth in depths[1:]:  # two layers were recorded above
    stage(f"{depth} layers")
    torch.manual_seed(0)
    deep = nn.Sequential(*[tc.MarkedLayer(C, HEADS) for _ in range(depth)])
    for name, fn in bench.variants(deep, x).items():
        by_depth[name].append(bench.memory(deep, fn, x, grad)[2].peak() / MiB)

# %%
fig = plot_timelines(list(timelines.values()), titles=list(timelines), width=5, height=3.3)
for ax in fig.axes:  # a short label: panels side by side (one event per allocation or free)
    if ax.get_xlabel().startswith("allocation events"):
        ax.set_xlabel("allocation events")
fig.suptitle(
    "Memory over one training step, two layers (forward phase shaded grey, backward yellow)"
)
fig.subplots_adjust(top=0.885)  # room for the title above the panels' own
plt.show()
header = (
    "variant|kept after forward|re-run (MFLOP)|peak|at the peak: activations|temporaries|the rest"
)
rows = [tuple(header.split("|"))]
for name, tl in timelines.items():
    at = int(tl.series().argmax())
    act, tmp = (tl.bytes[c][at] for c in ("activations", "temporaries"))
    rest = peaks[name] - act - tmp
    rows.append(
        (
            name,
            f"{held_after_forward[name] / MiB:.2f} MiB",
            f"{rerun_flops[name] / 1e6:.1f}",
            *(f"{b / MiB:.2f} MiB" for b in (peaks[name], act, tmp, rest)),
        )
    )
widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
for r in rows:
    print(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    )
print("(the rest: parameters, the gradients made so far, the input batch and its gradient)")
with tc.count_flops() as counter:
    stack(x)
forward_flops = counter.get_total_flops()
print(
    f"the plain forward runs {forward_flops / 1e6:.1f} MFLOP of matmul/attention; module re-runs "
    f"{rerun_flops['module'] / forward_flops:.0%} of it (torch.utils.checkpoint stops once the "
    "last tensor a gradient needs is rebuilt: no gradient needs fc2's output)"
)
spread = lambda d: (max(d.values()) - min(d.values())) / MiB  # noqa: E731
print(
    f"the activations alive after forward span {spread(held_after_forward):.2f} MiB across the "
    f"four variants, their peaks only {spread(peaks):.2f} MiB"
)

# %%
fig, ax = plt.subplots(figsize=(8, 3.8))
for (name, ys), color in zip(by_depth.items(), ["0.3", "#8172b3", "#4c72b0", GONE]):
    ax.plot(depths, ys, marker="o", color=color, label=name)
ax.set_xticks(depths)
ax.set_xlabel("layers")
ax.set_ylabel("peak memory over the step (MiB)")
ax.grid(alpha=0.3)
ax.legend()
ax.set_title("Peak memory of one step against depth, per variant")
fig.tight_layout()
plt.show()
for i, depth in enumerate(depths):
    below = {name: by_depth["none"][i] - by_depth[name][i] for name in ("tensor_ckpt", "module")}
    print(
        f"{depth} layers: peak below none's by {below['tensor_ckpt']:.2f} MiB (tensor_ckpt), "
        f"{below['module']:.2f} MiB (module)"
    )
layer_params = sum(p.untyped_storage().nbytes() for p in tc.MarkedLayer(C, HEADS).parameters())
slopes = {name: (ys[-1] - ys[0]) / (depths[-1] - depths[0]) for name, ys in by_depth.items()}
print("peak per added layer: " + ", ".join(f"{n} {v:.2f} MiB" for n, v in slopes.items()))
print(
    f"per layer: activations kept after forward {held_after_forward['none'] / 2 / MiB:.2f} MiB "
    f"(none), {held_after_forward['tensor_ckpt'] / 2 / MiB:.2f} MiB (tensor_ckpt); parameters "
    f"{layer_params / MiB:.2f} MiB, as many again in their gradients"
)

# %% [markdown]
# **What to look at:** the lines fan out. Every variant grows with depth, at its own slope (printed
# per added layer): `none` by a layer's activations plus its parameters, `SAC` and `tensor_ckpt` by
# what they keep of the activations plus the parameters, `module` by a layer's parameters and
# their gradients (its peak comes in the backward of the first layer, the last to run, when the
# other layers' gradients exist). The gaps to `none` grow with the number of layers; at two layers
# they are small because the part every variant shares dominates.
#
# ## Takeaway
# Activation checkpointing trades memory held after forward for work in backward. V4's
# tensor-level version lets the author choose single tensors: forget the large, cheap ones (norm
# and GELU outputs), keep the matmul outputs. An FX trace finds each forgotten storage's recompute
# subgraph, the ops back to tensors autograd keeps anyway; saved-tensor hooks swap the storage for
# a handle in forward and recompute it, once, in backward, with gradients bit for bit the plain
# model's [IMPLEMENTED: ledger T.3-T.7]. Memory is freed per storage and only if autograd saved it:
# forgetting a view forgets its base (and may pull the attention into every backward), forgetting a
# tensor nobody saves frees nothing. Module-level checkpointing keeps the least but re-runs most
# matmuls; the tensor-level choice saves less but re-runs no matmul, and all savings grow with the
# number of layers while the parameters, gradients and backward temporaries under every peak do not
# shrink.
