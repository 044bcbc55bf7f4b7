"""Meters for tensor_ckpt's measurements: aten ops, bytes allocated, bytes left alive, FLOPs, and
the bytes a (compiled) autograd graph saved.

The chapter plans from its own example run (FLOPs per op, storage sizes); what a forward leaves
alive and what a backward costs is measured here: by bench_tensor_ckpt.py, the tests, notebook 04.
"""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tensor_ckpt import count_flops, tensors_in


class Meter(TorchDispatchMode):
    """Counts aten ops and the bytes of the storages they create (views create none); keeps a weak
    reference to each, so ``live_bytes()`` measures what is still alive."""

    def __init__(self):
        super().__init__()
        self.ops, self.bytes, self.made = 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        old = {t.untyped_storage().data_ptr() for t in tensors_in((args, kwargs))}
        new = [t.untyped_storage() for t in tensors_in(out)]
        new = [s for s in new if s.data_ptr() not in old]
        self.ops, self.bytes = self.ops + 1, self.bytes + sum(s.nbytes() for s in new)
        self.made += map(weakref.ref, new)
        return out

    def live_bytes(self):
        return sum({id(s): s.nbytes() for s in (r() for r in self.made) if s is not None}.values())


def activation_bytes(model, *inputs):
    """Bytes made by one forward and alive after it: what the autograd graph holds for backward."""
    with Meter() as meter:
        out = model(*inputs)
    return meter.live_bytes() - sum(t.untyped_storage().nbytes() for t in tensors_in(out)), out


def backward_work(loss):
    """(matmul/attention FLOPs, aten ops, bytes allocated) of ``loss.backward()``."""
    with count_flops() as counter, Meter() as meter:
        loss.backward()
    return counter.get_total_flops(), meter.ops, meter.bytes


def saved_by_graph(out, exclude):
    """Bytes of the storages autograd saved for backward in ``out``'s graph, ``exclude`` aside.
    Works where no dispatch mode may run (a compiled graph: Dynamo would fall back to eager)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen, stack, storages = set(), [out.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found = list(getattr(node, "saved_tensors", ()))  # custom Functions (compiled graphs)
        for name in dir(node):  # built-in nodes: _saved_self, _saved_result...
            if name.startswith("_saved_"):
                value = getattr(node, name)
                found += value if isinstance(value, (tuple, list)) else [value]
        for t in found:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in skip:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack += [f for f, _ in node.next_functions]
    return sum(storages.values())
