"""Meters for tensor_ckpt's measurements: aten ops, bytes allocated, bytes left alive, FLOPs;
and the plan's table (``print(model.plan)`` prints ``format_plan``).

The chapter plans from its own example run (FLOPs per op, storage sizes); what a forward leaves
alive and what a backward costs is measured here: by bench_tensor_ckpt.py, the tests, notebook 04.
"""

import weakref

from torch.utils._python_dispatch import TorchDispatchMode

from guards.tensor_ckpt_guard import flops_text
from tensor_ckpt import _tensors_in, count_flops


class Meter(TorchDispatchMode):
    """Counts aten ops and the bytes of the storages they create (views create none); keeps a weak
    reference to each, so ``live_bytes()`` measures what is still alive."""

    def __init__(self):
        super().__init__()
        self.ops, self.bytes, self.made = 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        old = {t.untyped_storage().data_ptr() for t in _tensors_in((args, kwargs))}
        new = [t.untyped_storage() for t in _tensors_in(out)]
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
    return meter.live_bytes() - sum(t.untyped_storage().nbytes() for t in _tensors_in(out)), out


def backward_work(loss):
    """(matmul/attention FLOPs, aten ops, bytes allocated) of ``loss.backward()``."""
    with count_flops() as counter, Meter() as meter:
        loss.backward()
    return counter.get_total_flops(), meter.ops, meter.bytes


def format_plan(plan):
    """The plan as a table: per forgotten storage, what is freed and what backward runs again."""
    rng = f", generator snapshots of {_mib(plan.rng_bytes)} deducted" if plan.rng_bytes else ""
    held = f"; {_mib(plan.held_bytes)} held for recompute" if plan.held_bytes else ""
    lines = [f"tensor_ckpt plan: {len(plan.units)} forgotten storages, {_mib(plan.bytes_freed)} "
             f"freed per forward{rng}{held}; recomputed per backward: "
             f"{flops_text(plan.recompute_flops)} in matmul/attention",
             f"  {'forgotten (aliases)':<30} {'shape':<16} {'freed':>10} {'matmul FLOP':>11}  "
             "recompute ops <- from kept (* = forgotten, shared)"]  # fmt: skip
    for u in plan.units:
        aliases = ", ".join(m for m in u.members if m != u.name)
        label = u.name + (f" ({aliases})" if aliases else "")
        freed = _mib(u.bytes_freed) if u.saved else "0 (unsaved)"
        ops = ", ".join(name + (f"[{flops_text(fl)}]" if fl else "") for name, fl in u.op_flops
                        if not name.startswith("forget"))  # fmt: skip
        kept = ", ".join([f.name for f in u.frontier] + [d.name + "*" for d in u.deps])
        rng = f"  [generator replayed: {', '.join(u.random_nodes)}]" if u.random_nodes else ""
        lines.append(f"  {label[:30]:<30} {str(tuple(u.shape)):<16} {freed:>10} "
                     f"{flops_text(u.flops):>11}  {ops} <- {kept}{rng}")  # fmt: skip
    return "\n".join(lines)


def _mib(b):
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 or b == 0 else f"{b / 2**10:.1f} KiB"
