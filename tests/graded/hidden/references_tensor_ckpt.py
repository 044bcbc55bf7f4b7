"""The independent reference for tests/graded/test_tensor_ckpt.py's drawn chains: what
checkpointing a Chain's marked outputs must cost, found without tracing, planning or
recomputing anything. It ships only in the autograder zip: in the student repository it would
say which storages the plan frees and what the recompute re-runs; there the tests read the
values it gave for the public chain, stored by `make expected` (tests/graded/expected.py).

Measured on the plain chain: which outputs autograd saves (a pack hook) and the op that made
each one's storage (a dispatch mode). Then the rules, applied by hand along the chain: a marked
output that autograd saves is freed; each freed one is recomputed once per backward by its own
op, walking back through every output that is neither saved nor marked (re-run too) to a saved
one, a marked one (its recomputed value is reused, so it is recomputed too) or the input.
"""

from collections import Counter

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from graded.models_tensor_ckpt import CHAIN_OPS, Chain


class Makers(TorchDispatchMode):
    """The first op whose output lives in each storage."""

    def __init__(self):
        super().__init__()
        self.op = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.op.setdefault(t.untyped_storage().data_ptr(), str(func))
        return out


def chain_checkpoint_costs(ops, marked, state, x):
    """{"freed": bytes, "extra_ops": {aten op: runs}, "recompute_addmm": runs of fc}: what
    checkpointing Chain(ops, marked) saves in forward and adds to one backward."""
    model = Chain(ops, ())
    model.load_state_dict(state)
    x = x.detach().clone().requires_grad_()
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Makers() as makers:
        outs = [model.fc(x)]  # outs[0]: fc's output, outs[k + 1]: op k's
        for name in ops:
            outs.append(CHAIN_OPS[name](outs[-1]))
    ptr = [o.untyped_storage().data_ptr() for o in outs]
    is_saved = [p in saved for p in ptr]
    marks = {k + 1 for k in marked}
    kept = [is_saved[i] and i not in marks for i in range(len(outs))]

    def walk(i):  # the outputs re-run to recompute outs[i], and the marked ones it reads
        rerun, deps = [i], []
        j = i - 1
        while j >= 0 and not kept[j] and j not in marks:
            rerun.append(j)
            j -= 1
        if j >= 0 and j in marks:
            deps.append(j)
        return rerun, deps

    todo = sorted(i for i in marks if is_saved[i])
    freed = sum(outs[i].untyped_storage().nbytes() for i in todo)
    recomputed = set()
    while todo:
        i = todo.pop()
        if i in recomputed:
            continue
        recomputed.add(i)
        todo += walk(i)[1]
    extra = Counter(makers.op[ptr[j]] for i in recomputed for j in walk(i)[0])
    return {"freed": freed, "extra_ops": dict(extra)}
