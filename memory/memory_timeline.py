"""Categorised memory timelines of any training loop, on CPU or CUDA, for lessons and benchmarks.

What the standard tools assume: a GPU (`torch.cuda.memory._record_memory_history`), or one step
(MemTracker refuses a second without a reset; the profiler's timeline is deprecated). The
first-step anomaly, optimizer state born in step 1 under every later step, needs several steps:

    from memory.memory_timeline import MemoryTimeline, predicted_optimizer_state_bytes
    tl = MemoryTimeline(model=model, optimizer=opt)
    with tl.record():
        for step in range(1, 4):
            with tl.phase("forward", step):   loss = model(x).mean()
            with tl.phase("backward", step):  loss.backward()
            with tl.phase("optimizer", step): opt.step(); opt.zero_grad()
    print(tl.summary())                        # memory.plots.plot_timeline(tl) draws it
    jump = tl.peak(step=2) - tl.peak(step=1)   # == predicted_optimizer_state_bytes(opt, tl.device)

How it sees memory: a TorchDispatchMode registers every storage an op returns, once, with a weakref
callback for its release (a view costs nothing). Only storages on the timeline's device count; on
CUDA the real allocator is sampled beside it after each free. Each storage gets one category:
parameters; gradients (ends up as a `.grad`); optimizer_state (in `optimizer.state`, or
`tl.tag`ged); activations (made in a "forward" phase, alive when it ends: held for backward);
temporaries (anything else made inside a phase); other (made outside any phase: input batches).
The "reserved" line is a MODEL of PyTorch's CUDA caching allocator (memory/allocator_model.py);
`limit_bytes` makes it raise `SimulatedOutOfMemoryError` as a GPU raises `torch.OutOfMemoryError`.
Never time a recorded step (Python runs per op). Run: `python -m memory.memory_timeline --help`;
`python -m memory.plots FILE.png` runs the same demo and draws it."""

import argparse
import contextlib
import itertools
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from memory.allocator_model import CachingAllocatorModel, SimulatedOutOfMemoryError

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")
PHASES = ("forward", "backward", "optimizer")
MiB = 2**20
_UNTRACKED = -1  # a storage that existed before recording and is not ours to count


@dataclass
class OutOfMemoryPoint:
    """Where a recording under `limit_bytes` ran out: the allocation that did not fit."""

    event: int  # index the failed allocation would have had in the event list
    nbytes: int  # bytes it asked for
    phase: str | None
    step: int | None
    reserved: int  # modelled reserved bytes when it failed
    reserved_needed: int  # what reserved would have become with the new segment (> the limit)


# ---- The recorder: every storage an op returns, registered once, freed by a weakref callback ----


class _StorageWatcher(TorchDispatchMode):
    """Registers every storage an op returns; the timeline does the bookkeeping."""

    def __init__(self, timeline):
        super().__init__()
        self.timeline = timeline

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # frees since the last op have been released by now: their device samples can be taken
        self.timeline._settle_device_samples()
        self.timeline._follow_autograd()
        out = func(*args, **kwargs)
        inputs = []  # filled lazily: only an output storage we have never seen needs the check

        def input_storages():
            if not inputs:
                flat = tree_flatten((args, kwargs))[0]
                inputs.append({_storage_key(a) for a in flat if isinstance(a, torch.Tensor)})
            return inputs[0]

        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.timeline._see(t, input_storages)
        return out


def _storage_key(t):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _tensors_in(obj):
    """Every tensor inside nested dicts / lists / tuples (optimizer state is such a nest)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (dict, list, tuple)):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors_in(v)


def _on_device(tensor_device, device):
    """True when a tensor on `tensor_device` lives on `device` ("cuda" matches every cuda:i)."""
    return tensor_device.type == device.type and device.index in (None, tensor_device.index)


class MemoryTimeline:
    """Records, per tensor storage, when it was allocated and freed and what it was for.

    model:         an nn.Module or an iterable of parameters (their storages are "parameters").
    optimizer:     an optimizer, a list of them, or None (its `.state` is "optimizer_state").
    device:        "cpu", "cuda[:i]" or "meta" (shapes only: no data, any size; it also stands in
                   for a GPU in tests, as a device that is not the CPU); default: the parameters'.
    limit_bytes:   a budget for the modelled reserved memory; exceeding it raises
                   SimulatedOutOfMemoryError and leaves the point in `tl.out_of_memory`.
    device_memory: a callable giving the device's (allocated, reserved) bytes, sampled beside every
                   event; default: torch.cuda.memory_allocated / memory_reserved on CUDA, else none.
    """

    def __init__(
        self, model=None, optimizer=None, device=None, limit_bytes=None, name="", device_memory=None
    ):
        self._params = list(
            model.parameters() if isinstance(model, torch.nn.Module) else model or []
        )
        optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
        self._optimizers = [opt for opt in optimizers if opt is not None]
        if device is None:
            device = self._params[0].device if self._params else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda", "meta"):
            raise ValueError(
                f"MemoryTimeline records cpu, cuda or meta tensors; got device {self.device}. "
                "Pass device='cpu' or device='cuda'."
            )
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if device_memory is None and self.device.type == "cuda":

            def device_memory(dev=self.device):
                return torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)

        self._device_memory = device_memory
        self.name, self.limit_bytes = name, limit_bytes
        self.allocator_model = CachingAllocatorModel(limit_bytes)
        self.phases = []  # (phase, step, first event index, last event index + 1, t0, t1)
        self._events = []  # (seconds since start, storage id, +bytes / -bytes)
        self._reserved_model = []  # modelled reserved bytes after each event
        self._device_samples = []  # (allocated, reserved) after each event, when sampled
        self._unsettled = []  # indices of frees whose memory was not yet released when recorded
        self._sizes = {}  # storage id -> bytes
        self._origin = {}  # storage id -> phase it was allocated in (None outside phases)
        self._alive_after_forward = set()
        self._kind = {}  # storage id -> parameters / gradients / optimizer_state / a tag
        self._ids, self._refs = WeakIdKeyDictionary(), {}  # storage -> id; id -> weakref
        self._next_id = itertools.count()
        self._recording = self._done = False
        self._current_phase = self._current_step = self._t0 = None
        self._in_backward = False  # inside autograd's backward during a "forward" phase (1F1B)
        self._pending_tags = []
        self.out_of_memory = None  # an OutOfMemoryPoint when limit_bytes was exceeded
        self.cuda_snapshot = None  # the allocator history, when record(cuda_history=True) on CUDA

    # --- recording ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def record(self, cuda_history=False):
        """Records everything run inside the `with` block.

        cuda_history=True (CUDA only) also keeps the allocator's own history, with stack traces,
        in `tl.cuda_snapshot`: pickle it and drop it on https://pytorch.org/memory_viz."""
        if self._recording:
            raise RuntimeError("record() cannot be nested: use one `with tl.record():` per run")
        if self._done:
            raise RuntimeError("this MemoryTimeline has already recorded a run; make a new one.")
        if cuda_history and self.device.type != "cuda":
            raise ValueError("cuda_history=True needs a CUDA timeline (device='cuda')")
        self._recording, self._t0 = True, time.perf_counter()
        for tensors, category in self._pending_tags:
            self.tag(tensors, category)
        self._pending_tags = []
        self._scan_known_tensors()
        if cuda_history:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        try:
            with _StorageWatcher(self):
                yield self
        finally:
            if cuda_history:
                self.cuda_snapshot = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
            self._scan_known_tensors()
            self._settle_device_samples()
            self._recording, self._done = False, True
            self._finish()

    @contextlib.contextmanager
    def phase(self, name, step=0):
        """Marks a phase ("forward", "backward", "optimizer" or any label) of step `step`."""
        if not self._recording:
            raise RuntimeError("tl.phase(...) is only meaningful inside `with tl.record():`")
        if self._current_phase is not None:
            raise RuntimeError(
                f"phase {name!r} opened inside phase {self._current_phase!r}; phases do not nest"
            )
        self._current_phase, self._current_step = name, step
        self._in_backward = False
        start, t0 = len(self._events), self._now()
        try:
            yield
        finally:
            self._current_phase = self._current_step = None
            self._in_backward = False
            self._scan_known_tensors()
            self._settle_device_samples()
            if name == "forward":
                self._alive_after_forward.update(self._held_for_backward())
            self.phases.append((name, step, start, len(self._events), t0, self._now()))

    def _follow_autograd(self):
        """A pipeline schedule runs several micro-batches' forwards and backwards inside one
        "forward" phase. Each time autograd's backward starts there, what that phase's forward ops
        made and is still alive is held for backward: an activation, as at a forward phase's end.
        What backward makes meanwhile is a temporary (its origin is "backward")."""
        if self._current_phase != "forward":
            return
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward and not self._in_backward:
            self._alive_after_forward.update(self._held_for_backward())
        self._in_backward = in_backward

    def _held_for_backward(self):
        """Ids of the storages allocated in a forward phase and still alive as it ends.

        These are the activations: whatever survives the forward pass is kept by someone for later
        (autograd's saved tensors, a checkpointing scheme's, the loss). Storages the forward made
        and has already freed were temporaries.
        """
        # hint: self._origin says in which phase each storage id was allocated; a storage is alive
        # while its id is a key of self._refs
        ### BEGIN SOLUTION
        return {
            sid for sid, origin in self._origin.items() if origin == "forward" and sid in self._refs
        }
        ### END SOLUTION

    def tag(self, tensors, category):
        """Declares the category of tensors kept outside `.state` (before or in record(); wins)."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; choose one of {CATEGORIES}")
        tensors = list(_tensors_in(tensors if isinstance(tensors, torch.Tensor) else list(tensors)))
        if not self._recording:
            self._pending_tags.append((tensors, category))
            return
        for t in tensors:
            sid = self._see(t)
            if sid is not None:
                self._kind[sid] = category

    def _now(self):
        return time.perf_counter() - self._t0

    def _see(self, t, input_storages=None):
        """Registers t's storage if it is new; returns its id (None for storages we do not track).

        input_storages: when t is an op's output, a callable giving the op's input storages. An
        output that aliases an input we never registered (a view or in-place result of a tensor made
        before recording) allocated nothing: it is remembered as untracked, not counted as new."""
        if not _on_device(t.device, self.device) or t.is_sparse:
            return None
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
            return None
        sid = self._ids.get(st)
        if sid == _UNTRACKED:
            if input_storages is not None:
                return None
            del self._ids[st]  # tagged or scanned explicitly: from now on it counts
            sid = None
        nbytes = st.nbytes()
        if sid is not None:
            if nbytes != self._sizes[sid]:  # resized in place (storage resize_): free + allocate
                self._free(sid)
                self._alloc(sid, nbytes)
            return sid
        if input_storages is not None and st._cdata in input_storages():
            self._ids[st] = _UNTRACKED
            return None
        sid = next(self._next_id)
        self._ids[st] = sid
        self._refs[sid] = weakref.ref(st, lambda _, sid=sid: self._on_collect(sid))
        self._origin[sid] = "backward" if self._in_backward else self._current_phase
        self._alloc(sid, nbytes)
        return sid

    def _alloc(self, sid, nbytes):
        self._sizes[sid] = 0  # stays 0 if the (modelled) allocation fails: nothing to free later
        if nbytes:
            self._event(sid, nbytes, lambda: self.allocator_model.malloc(sid, nbytes))
        self._sizes[sid] = nbytes

    def _free(self, sid, released=True):
        nbytes = self._sizes[sid]
        self._sizes[sid] = 0
        if nbytes:
            self._event(sid, -nbytes, lambda: self.allocator_model.free(sid), released)

    def _on_collect(self, sid):
        # Runs while the storage's Python object dies, BEFORE its memory goes back to the allocator.
        if self._recording and sid in self._refs:
            del self._refs[sid]
            self._free(sid, released=False)

    def _event(self, sid, delta, update_model, released=True):
        """Appends one allocation (+bytes) or free (-bytes), with the lines sampled after it.

        released=False: a free from a weakref callback, whose memory the device still counts: its
        sample is taken at the next hook (an event, an op, a phase's end), once it is released."""
        try:
            update_model()  # may raise SimulatedOutOfMemoryError: the op that allocated fails
        except SimulatedOutOfMemoryError:
            m, where = self.allocator_model, (self._current_phase, self._current_step)
            need = m.reserved + m.segment_size(m.round_size(delta))
            self.out_of_memory = OutOfMemoryPoint(
                len(self._events), delta, *where, m.reserved, need
            )
            raise
        self._events.append((self._now(), sid, delta))
        self._reserved_model.append(self.allocator_model.reserved)
        if self._device_memory is not None:
            self._settle_device_samples()
            self._device_samples.append(self._device_memory() if released else None)
            if not released:
                self._unsettled.append(len(self._device_samples) - 1)

    def _settle_device_samples(self):
        """Gives every free still waiting for its sample the device's reading now."""
        if self._unsettled:
            sample = self._device_memory()
            for i in self._unsettled:
                self._device_samples[i] = sample
            self._unsettled.clear()

    def _scan_known_tensors(self):
        for p in self._params:
            self._mark(p, "parameters")
        for p in self._params:
            if p.grad is not None:
                self._mark(p.grad, "gradients")
        for opt in self._optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._mark(p.grad, "gradients")
            for t in _tensors_in(list(opt.state.values())):
                self._mark(t, "optimizer_state")

    def _mark(self, t, kind):
        sid = self._see(t)
        if sid is not None and sid not in self._kind:
            self._kind[sid] = kind

    # --- the recorded run ---------------------------------------------------------------------

    def category_of(self, sid):
        if sid in self._kind:
            return self._kind[sid]
        if sid in self._alive_after_forward:
            return "activations"
        return "temporaries" if self._origin.get(sid) is not None else "other"

    def _finish(self):
        """Turns the event list into per-category series; drops every reference to live tensors."""
        self.num_events = n = len(self._events)
        self.times = np.array([e[0] for e in self._events], dtype=float)
        columns = {c: np.zeros(n, dtype=np.int64) for c in CATEGORIES}
        for i, (_, sid, delta) in enumerate(self._events):
            columns[self.category_of(sid)][i] = delta
        self.bytes = {c: np.cumsum(col) for c, col in columns.items()}
        self.reserved_model = np.array(self._reserved_model, dtype=np.int64)
        self._settle_device_samples()  # a free at the very end: sampled now, after the recording
        samples = np.array(self._device_samples, dtype=np.int64).reshape(-1, 2)
        # the device's own lines (CUDA's memory_allocated / memory_reserved), None where unsampled
        self.cuda_allocated, self.cuda_reserved = samples.T if len(samples) else (None, None)
        self._params, self._optimizers, self._ids, self._refs = [], [], WeakIdKeyDictionary(), {}
        self._device_memory = None  # a closure over the device: not picklable, not needed now

    def __getstate__(self):  # picklable once recorded (gather_timelines sends it between ranks)
        if not self._done:
            raise RuntimeError("only a finished MemoryTimeline can be pickled or gathered")
        live = ("_ids", "_refs", "_next_id", "_sizes", "_origin", "_kind", "_alive_after_forward")
        return {key: value for key, value in self.__dict__.items() if key not in live}

    def _check_done(self):
        if not self._done:
            raise RuntimeError("no recorded run yet: use `with tl.record(): ...` first")
        if self.num_events == 0:
            raise ValueError(
                "the timeline is empty: nothing on its device was allocated inside tl.record()"
            )

    def series(self, category=None):
        """Bytes of one category (None: all categories) after each event, as an int64 array."""
        self._check_done()
        if category is None:
            return sum(self.bytes[c] for c in CATEGORIES)
        if category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; choose one of {CATEGORIES}")
        return self.bytes[category]

    def window(self, step=None, phase=None):
        """Event-index ranges [start, end) of the phases matching step and phase."""
        return [
            (a, b)
            for (name, s, a, b, _, _) in self.phases
            if (step is None or s == step) and (phase is None or name == phase)
        ]

    def peak(self, category=None, step=None, phase=None):
        """Peak bytes of a category (None: total) over the run, or within a step and/or phase."""
        return self._peak_of(self.series(category), step, phase)

    def peaks(self, step=None, phase=None):
        return {c: self.peak(c, step, phase) for c in CATEGORIES}

    def peak_reserved_model(self, step=None, phase=None):
        """Peak of the modelled reserved line, over the run or within a step and/or phase."""
        self._check_done()
        return self._peak_of(self.reserved_model, step, phase)

    def _peak_of(self, values, step, phase):
        if step is None and phase is None:
            return int(values.max())
        ranges = self.window(step, phase)
        if not ranges:
            raise ValueError(
                f"no recorded phase matches step={step!r}, phase={phase!r}; "
                f"recorded: {sorted({(p[1], p[0]) for p in self.phases})}"
            )
        # the level on entry counts too: it is what the phase starts from
        return int(max(values[max(a - 1, 0) : max(b, a + 1)].max() for a, b in ranges))

    def summary(self):
        """One line per category: peak MiB over the run."""
        lines = [f"{c:>16}: {self.peak(c) / MiB:9.3f} MiB" for c in CATEGORIES]
        lines.append(f"{'total':>16}: {self.peak() / MiB:9.3f} MiB")
        lines.append(f"{'reserved (model)':>16}: {self.peak_reserved_model() / MiB:9.3f} MiB")
        return "\n".join(lines)


# ---- The step-2 prediction: what the optimizer's lazily created state costs, before any step ----


def predicted_optimizer_state_bytes(optimizer, device):
    """Bytes of state `optimizer` will hold on `device` once each of its parameters has had a step.

    Read from the parameters and hyperparameters alone, before the state exists. With N fp32
    parameter values in T tensors:
    - Adam / AdamW: exp_avg and exp_avg_sq (plus max_exp_avg_sq with amsgrad) shaped like each
      parameter, and a scalar `step` per tensor, kept beside the parameter only when fused or
      capturable, else on the CPU (a kernel launch to add 1 costs more than the copy): 8N + 4T
      bytes on the CPU, 8N on a GPU.
    - SGD: one momentum buffer shaped like the parameter when momentum != 0, else nothing.
    - Muon: one momentum buffer shaped like the parameter.
    optimizer: one optimizer or a list of them. device: where bytes count ("cpu", "cuda", "meta").
    """
    device = torch.device(device)
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    known = (torch.optim.Adam, torch.optim.SGD, torch.optim.Muon)  # AdamW subclasses Adam
    for opt in optimizers:
        if not isinstance(opt, known):
            raise ValueError(
                f"predicted_optimizer_state_bytes knows Adam, AdamW, SGD and Muon, not "
                f"{type(opt).__name__}; measure its state with a MemoryTimeline instead"
            )
    # hint: sum, parameter by parameter, the bytes of each state tensor the optimizer will create,
    # counting only those that will live on `device` (where does AdamW keep `step`?)
    ### BEGIN SOLUTION
    total = 0
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                like_p = p.numel() * p.element_size() if _on_device(p.device, device) else 0
                if isinstance(opt, torch.optim.Adam):
                    total += (3 if group["amsgrad"] else 2) * like_p
                    on_device = bool(group["fused"] or group["capturable"])
                    step_device = p.device if on_device else torch.device("cpu")
                    # the counter is fp32, or fp64 when fp64 is the default dtype (never when fused)
                    wide = torch.get_default_dtype() == torch.float64 and not group["fused"]
                    if _on_device(step_device, device):
                        total += 8 if wide else 4
                elif isinstance(opt, torch.optim.SGD):
                    total += like_p if group["momentum"] != 0 else 0
                else:  # Muon
                    total += like_p
    return total
    ### END SOLUTION


def gather_timelines(timeline, dst=0, group=None):
    """Inside a process group: every rank's finished timeline as a list on `dst`, None elsewhere."""
    import torch.distributed as dist

    timeline._check_done()
    out = [None] * dist.get_world_size(group) if dist.get_rank(group) == dst else None
    dist.gather_object(timeline, out, dst=dst, group=group)
    return out


# ---- categories' colours (the plots in memory/plots.py import them) ----

COLORS = dict(zip(CATEGORIES, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")))
# phase shading: neutral tints that no category uses, so a band never reads as memory
PHASE_COLORS = {"forward": "#e4e4e4", "backward": "#fbf0bd", "optimizer": "#d5eef2"}


def _demo_run(device, steps, batch):
    """A 2-layer MLP whose activations outweigh its weights, trained with AdamW, recorded."""
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(batch, 256, device=device)
    predicted = predicted_optimizer_state_bytes(opt, device)  # before the state exists
    tl = MemoryTimeline(model, opt, name=f"AdamW, {steps} steps on {device}")
    with tl.record():
        for step in range(1, steps + 1):  # steps numbered from 1, as people count them
            with tl.phase("forward", step):
                loss = model(x).square().mean()
            with tl.phase("backward", step):
                loss.backward()
            with tl.phase("optimizer", step):
                opt.step()
                opt.zero_grad(set_to_none=True)
    return model, tl, predicted


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Record a small AdamW training run's memory timeline, print the peak of each "
        "category, and check the step-2 prediction: step 2's peak = step 1's + the optimizer state."
    )
    add = parser.add_argument
    add("--steps", type=int, default=3, help="training steps to record, at least 2 (default 3)")
    add(
        "--batch",
        type=int,
        default=2048,
        help="rows per batch; activations grow with it (default 2048)",
    )
    add(
        "--device",
        choices=["cpu", "cuda"],
        help="where the model runs (default: cuda when a GPU is visible, else cpu)",
    )
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 to compare step 2 with step 1, got {args.steps}")
    if args.batch < 1:
        parser.error(f"--batch must be positive, got {args.batch}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible; pass --device cpu")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    why = "a GPU is visible" if device == "cuda" else "no GPU visible"
    why = f"--device {device}" if args.device else f"automatic: {why}"
    print(f"device: {device} ({why})")

    t0 = time.perf_counter()
    print(f"recording {args.steps} AdamW steps ...", flush=True)
    model, tl, predicted = _demo_run(device, args.steps, args.batch)
    n, t = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    took = time.perf_counter() - t0
    print(f"recorded {args.steps} steps, {tl.num_events} allocation events, in {took:.1f} s\n")
    print("peak bytes per category over the run:")
    print(tl.summary())
    if tl.cuda_allocated is not None:
        print(f"{'allocated (CUDA)':>16}: {tl.cuda_allocated.max() / MiB:9.3f} MiB (measured)")
        print(f"{'reserved (CUDA)':>16}: {tl.cuda_reserved.max() / MiB:9.3f} MiB (measured)")
    peaks = [tl.peak(step=s) for s in range(1, args.steps + 1)]
    print("\npeak allocated per step (MiB):", " ".join(f"{p / MiB:.3f}" for p in peaks))
    jump = peaks[1] - peaks[0]
    step_on = "on the CPU, not counted here" if device != "cpu" else "counted"
    print(
        f"\nstep-2 prediction: AdamW state for N = {n:,} values in T = {t} tensors, 8 B per "
        f"value\n(two fp32 moments) plus a 4 B step counter per tensor ({step_on}):\n"
        f"  predicted jump {predicted:>12,} B = {predicted / MiB:.4f} MiB\n"
        f"  measured  jump {jump:>12,} B = {jump / MiB:.4f} MiB "
        f"({peaks[0] / MiB:.3f} -> {peaks[1] / MiB:.3f} MiB), off by {jump - predicted:+,} B"
    )
    peak_phase = max(PHASES, key=lambda ph: tl.peak(step=1, phase=ph))
    if peak_phase != "backward":  # then the optimizer step, not backward, sets step 1's peak
        print(
            f"  note: step 1 peaks in its {peak_phase} phase, not in backward, so the jump is not "
            "the whole state (activations are too small next to the weights: raise --batch)"
        )
    return tl


if __name__ == "__main__":
    main()
