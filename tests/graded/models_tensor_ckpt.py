"""The small models tensor_ckpt.py's graded tests checkpoint, and the meter both sides measure
them by: the tests run them unmarked as their references, the probes (in the sandbox) with
tensor_ckpt.forget as ``mark``. Plain torch: no assignment file is imported here."""

import weakref
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

B, T, C, H = 2, 16, 32, 4


def unmarked(t):
    return t


class Model(nn.Module):
    """``mark``: tensor_ckpt.forget in the probes; the identity in the tests' references."""

    def __init__(self, mark=unmarked):
        super().__init__()
        self.mark = mark


class MLP(Model):
    def __init__(self, shared=False, mark=unmarked):
        super().__init__(mark)
        self.fc1, self.fc2 = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.fc3 = nn.Linear(4 * C, C) if shared else None

    def forward(self, x):
        h = self.mark(F.gelu(self.fc1(x)))
        return self.fc2(h) + self.fc3(h) if self.fc3 is not None else self.fc2(h)


class Attention(Model):
    """Hand-written causal attention: splits, views, transposes and a reshape that copies."""

    def __init__(self, forget_qkv=False, forget_probs=False, forget_merge=False, mark=unmarked):
        super().__init__(mark)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.register_buffer("future", torch.ones(T, T, dtype=torch.bool).triu(1))
        self.forgets = (forget_qkv, forget_probs, forget_merge)

    def forward(self, x):
        qkv = self.qkv(x)
        q, k, v = qkv.split(C, dim=-1)
        if self.forgets[0]:
            qkv, q = self.mark(qkv), self.mark(q)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (C // H) ** -0.5
        att = att.masked_fill(self.future, float("-inf")).softmax(dim=-1)
        if self.forgets[1]:
            att = self.mark(att)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        if self.forgets[2]:
            y = self.mark(y)
        return self.proj(y)


class ViewAndBase(Model):
    """Autograd saves the base and two views of it: one storage."""

    def __init__(self, mark=unmarked):
        super().__init__(mark)
        self.fc, self.out = nn.Linear(C, 2 * C), nn.Linear(C, C)

    def forward(self, x):
        h = self.mark(self.fc(x))
        a, b = self.mark(h[..., :C]), h[..., C:]
        return self.out(a * b + h.sin()[..., C:])


class DropoutMLP(Model):
    def __init__(self, mark=unmarked):
        super().__init__(mark)
        self.fc1, self.fc2, self.drop = nn.Linear(C, 4 * C), nn.Linear(4 * C, C), nn.Dropout(0.3)

    def forward(self, x):
        return self.fc2(self.mark(self.drop(F.gelu(self.fc1(x)))))


class Block(Model):
    """Pre-norm transformer layer: the norms' and the GELU's outputs forgotten."""

    def __init__(self, mark=unmarked):
        super().__init__(mark)
        self.norm1, self.norm2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc1, self.fc2 = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        h = self.mark(self.norm1(x))
        b, t, c = x.shape
        q, k, v = self.qkv(h).view(b, t, 3, H, c // H).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        h = self.mark(self.norm2(x))
        h = self.mark(F.gelu(self.fc1(h)))
        return x + self.fc2(h)


class Stack(nn.Sequential):
    def __init__(self, mark=unmarked):
        super().__init__(*[Block(mark) for _ in range(4)])


CHAIN_OPS = {"gelu": F.gelu, "relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
             "sin": torch.sin, "cos": torch.cos}  # fmt: skip


class Chain(Model):
    """A linear layer, then elementwise ops by name (CHAIN_OPS), the outputs at ``marked`` (indices
    into ``ops``) marked."""

    def __init__(self, ops=("gelu",), marked=(0,), mark=unmarked):
        super().__init__(mark)
        self.fc, self.ops, self.marked = nn.Linear(C, C), tuple(ops), tuple(marked)

    def forward(self, x):
        h = self.fc(x)
        for i, name in enumerate(self.ops):
            h = CHAIN_OPS[name](h)
            if i in self.marked:
                h = self.mark(h)
        return h


class Gate(nn.Module):
    def forward(self, h):
        return h * 2 if h.sum() > 0 else h


class BranchInLeaf(Model):
    def __init__(self, mark=unmarked):
        super().__init__(mark)
        self.fc, self.gate, self.out = nn.Linear(C, C), Gate(), nn.Linear(C, C)

    def forward(self, x):
        return self.out(self.mark(self.gate(F.gelu(self.fc(x)))))


MODELS = {
    "mlp": MLP,
    "mlp_shared": lambda mark=unmarked: MLP(shared=True, mark=mark),
    "attention": lambda mark=unmarked: Attention(forget_probs=True, forget_merge=True, mark=mark),
    "attention_qkv": lambda mark=unmarked: Attention(forget_qkv=True, mark=mark),
    "view_and_base": ViewAndBase,
    "dropout_mlp": DropoutMLP,
    "block": Block,
    "stack": Stack,
    "branch_in_leaf": BranchInLeaf,
}


def build(name, mark=unmarked):
    """``MODELS[name]``, or for "chain:OPS:MARKED" (comma-separated: "chain:tanh,sin:0") that
    Chain, whose ops and marks the autograder draws at grading time."""
    if name.startswith("chain:"):
        _, ops, marked = name.split(":")
        return Chain(ops.split(","), [int(i) for i in marked.split(",")], mark=mark)
    return MODELS[name](mark=mark)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops create that are still alive, and their peak (a storage is freed
    when its last tensor goes). Storages of ``exclude`` (inputs, parameters) are not counted."""

    def __init__(self, exclude=()):
        super().__init__()
        self.alive, self.now, self.peak = {id(t.untyped_storage()): 0 for t in exclude}, 0, 0

    def free(self, key):
        self.now -= self.alive.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(s := t.untyped_storage()) not in self.alive:
                self.alive[id(s)] = s.nbytes()
                self.now += s.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(s, self.free, id(s))
        return out


class OpCount(TorchDispatchMode):
    """How many times each op ran ("aten.gelu.default": 2): a forward op that runs again in
    backward is a recompute, counted here rather than by the code that recomputes."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def measured_run(model, fn, x, weights):
    """Output, gradients (parameters, then x) of sum(out * weights), and what it cost: bytes alive
    at the end of forward, the peaks of forward and backward, backward's matmul FLOPs and the ops
    it ran (name -> count)."""
    x = x.detach().clone().requires_grad_()
    params = list(model.parameters())
    meter = LiveBytes([x, weights, *params, *model.buffers()])
    with meter:
        out = fn(x)
        fwd_bytes, fwd_peak = meter.now, meter.peak
        meter.peak = meter.now
        with FlopCounterMode(display=False) as flops, OpCount() as ops:
            grads = torch.autograd.grad((out * weights).sum(), params + [x])
    return {
        "out": out.detach(),
        "grads": list(grads),
        "fwd_bytes": fwd_bytes,
        "fwd_peak": fwd_peak,
        "bwd_peak": meter.peak,
        "bwd_flops": flops.get_total_flops(),
        "bwd_ops": dict(ops.counts),
    }
