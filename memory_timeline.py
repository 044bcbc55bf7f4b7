"""Categorised memory timelines of any training loop, on CPU or CUDA, for the notebooks and benchmarks.

    from memory_timeline import MemoryTimeline, plot_timeline
    tl = MemoryTimeline(model=model, optimizer=opt)
    with tl.record():
        for step in range(3):
            with tl.phase("forward", step):   loss = model(x).mean()
            with tl.phase("backward", step):  loss.backward()
            with tl.phase("optimizer", step): opt.step(); opt.zero_grad()
    print(tl.peaks()); plot_timeline(tl)

How it sees memory. A TorchDispatchMode watches every aten op; each tensor storage an op returns is
registered once, with a weakref callback that records its release. So the timeline exists on a machine
with no GPU, and it counts storages (a view costs nothing; a reshape that copies does). Tensors created
before `record()` are not seen, except the model's parameters and any gradients and optimizer state that
already exist. On CUDA the real allocator is sampled beside it (`memory_allocated`, `memory_reserved`).

How it categorises (decided when recording ends, so a storage carries one category for its whole life):
- parameters: storages of the model's parameters;
- gradients: storages that end up as some parameter's `.grad`;
- optimizer_state: tensors reachable from `optimizer.state`, or tagged with `tl.tag(tensors, category)`;
- activations: allocated during a "forward" phase and still alive when that phase ends, i.e. held for the
  backward (by autograd, or by a checkpointing scheme);
- temporaries: every other storage allocated inside a phase (recomputation during backward lands here);
- other: allocated outside any phase (input batches, data).

The "reserved" line on CPU is a MODEL: each allocation and free is replayed through `CachingAllocatorModel`,
a small model of PyTorch's CUDA caching allocator, so a student can see allocated vs reserved and the
first-step set-up without a GPU. It is labelled as a model wherever it is drawn. `limit_bytes` turns that
model into a budget: an allocation that would push modelled reserved memory past it raises
`SimulatedOutOfMemoryError`, the way a real GPU raises `torch.OutOfMemoryError`.

The recorder costs Python time on every op: never time a step while recording.
"""
import bisect
import contextlib
import itertools
import time
import weakref

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")
PHASES = ("forward", "backward", "optimizer")
COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868",
          "activations": "#c44e52", "temporaries": "#8172b3", "other": "#937860"}
PHASE_COLORS = {"forward": "#e8f0fb", "backward": "#fdeee4", "optimizer": "#e9f5ea"}
MiB = 2 ** 20
_UNTRACKED = -1  # a storage that existed before recording and is not ours to count


class SimulatedOutOfMemoryError(RuntimeError):
    """The modelled CUDA allocator could not stay within `limit_bytes`."""


# --------------------------------------------------------------------------------------------------
# A model of the CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, default settings)
# --------------------------------------------------------------------------------------------------

class CachingAllocatorModel:
    """Replays allocations and frees the way PyTorch's CUDA caching allocator would serve them.

    The rules modelled (the allocator's defaults; expandable segments off):
    - every request is rounded up to a multiple of 512 bytes;
    - requests of at most 1 MiB come from the small pool, larger ones from the large pool;
    - a new segment (one cudaMalloc) is 2 MiB for the small pool, 20 MiB for large requests under 10 MiB,
      and the request rounded up to 2 MiB otherwise;
    - a request takes the best-fitting free block of its pool and splits it when the remainder is at
      least 512 bytes (small pool) or more than 1 MiB (large pool);
    - a freed block merges with free neighbours in its segment and stays cached: reserved memory never
      shrinks, except when a request would exceed `limit_bytes`, where wholly free segments are released
      first (as `empty_cache` does on an OOM retry) before giving up.
    Not modelled: streams, events, the per-stream pools, garbage-collection thresholds, max_split_size.
    """
    MIN_BLOCK, SMALL_SIZE, SMALL_BUFFER = 512, MiB, 2 * MiB
    LARGE_BUFFER, MIN_LARGE_ALLOC, ROUND_LARGE = 20 * MiB, 10 * MiB, 2 * MiB

    def __init__(self, limit_bytes=None):
        self.limit_bytes = limit_bytes
        self.reserved = 0        # bytes held in segments
        self.allocated = 0       # bytes in blocks handed out (rounded sizes)
        self._segments = {}      # segment id -> [size, pool, number of blocks in use]
        self._free = {"small": [], "large": []}  # sorted (size, segment, offset) of free blocks
        self._blocks = {}        # segment id -> {offset: [size, in_use]}
        self._block_ending_at = {}  # segment id -> {end offset: start offset}, to find left neighbours
        self._live = {}          # allocation key -> (segment, offset)
        self._segment_ids = itertools.count()

    @classmethod
    def round_size(cls, nbytes):
        return max(cls.MIN_BLOCK, -(-nbytes // cls.MIN_BLOCK) * cls.MIN_BLOCK)

    @classmethod
    def segment_size(cls, size):
        if size <= cls.SMALL_SIZE:
            return cls.SMALL_BUFFER
        if size < cls.MIN_LARGE_ALLOC:
            return cls.LARGE_BUFFER
        return -(-size // cls.ROUND_LARGE) * cls.ROUND_LARGE

    def malloc(self, key, nbytes):
        size = self.round_size(nbytes)
        pool = "small" if size <= self.SMALL_SIZE else "large"
        free = self._free[pool]
        i = bisect.bisect_left(free, (size, -1, -1))
        if i == len(free):
            self._new_segment(self.segment_size(size), pool, size)
            i = bisect.bisect_left(free, (size, -1, -1))
        block_size, seg, offset = free.pop(i)
        remainder = block_size - size
        if remainder >= self.MIN_BLOCK if pool == "small" else remainder > self.SMALL_SIZE:
            self._set_block(seg, offset + size, remainder, False)
            bisect.insort(free, (remainder, seg, offset + size))
        else:
            size = block_size
        self._set_block(seg, offset, size, True)
        self._segments[seg][2] += 1
        self._live[key] = (seg, offset)
        self.allocated += size

    def free(self, key):
        seg, offset = self._live.pop(key)
        size = self._pop_block(seg, offset)
        self.allocated -= size
        self._segments[seg][2] -= 1
        pool = self._segments[seg][1]
        blocks = self._blocks[seg]
        right = offset + size
        if right in blocks and not blocks[right][1]:
            right_size = self._pop_block(seg, right)
            self._unfree(pool, seg, right, right_size)
            size += right_size
        left = self._block_ending_at[seg].get(offset)
        if left is not None and not blocks[left][1]:
            left_size = self._pop_block(seg, left)
            self._unfree(pool, seg, left, left_size)
            offset, size = left, size + left_size
        self._set_block(seg, offset, size, False)
        bisect.insort(self._free[pool], (size, seg, offset))

    def _set_block(self, seg, offset, size, in_use):
        self._blocks[seg][offset] = [size, in_use]
        self._block_ending_at[seg][offset + size] = offset

    def _pop_block(self, seg, offset):
        size = self._blocks[seg].pop(offset)[0]
        del self._block_ending_at[seg][offset + size]
        return size

    def _unfree(self, pool, seg, offset, size):
        free = self._free[pool]
        del free[bisect.bisect_left(free, (size, seg, offset))]

    def _new_segment(self, seg_size, pool, request):
        if self.limit_bytes is not None and self.reserved + seg_size > self.limit_bytes:
            self._release_free_segments()
            if self.reserved + seg_size > self.limit_bytes:
                raise SimulatedOutOfMemoryError(
                    f"modelled CUDA out of memory: tried to allocate {request / MiB:.2f} MiB (a new "
                    f"{seg_size / MiB:.0f} MiB segment); {self.allocated / MiB:.2f} MiB allocated, "
                    f"{self.reserved / MiB:.2f} MiB reserved, limit {self.limit_bytes / MiB:.2f} MiB. "
                    "Fix: shrink the batch, shard or drop optimizer state, checkpoint activations, "
                    "or raise limit_bytes.")
        seg = next(self._segment_ids)
        self._segments[seg] = [seg_size, pool, 0]
        self._blocks[seg], self._block_ending_at[seg] = {}, {}
        self._set_block(seg, 0, seg_size, False)
        bisect.insort(self._free[pool], (seg_size, seg, 0))
        self.reserved += seg_size

    def _release_free_segments(self):
        for seg, (seg_size, pool, in_use) in list(self._segments.items()):
            if in_use == 0:
                self._unfree(pool, seg, 0, seg_size)
                del self._blocks[seg], self._block_ending_at[seg], self._segments[seg]
                self.reserved -= seg_size


# --------------------------------------------------------------------------------------------------
# The recorder
# --------------------------------------------------------------------------------------------------

class _StorageWatcher(TorchDispatchMode):
    """Registers every storage an op returns; the timeline does the bookkeeping."""

    def __init__(self, timeline):
        super().__init__()
        self.timeline = timeline

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = []  # filled lazily: only an output storage we have never seen needs the check

        def input_storages():
            if not inputs:
                inputs.append({_storage_key(a) for a in tree_flatten((args, kwargs))[0]
                               if isinstance(a, torch.Tensor)})
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
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)


class MemoryTimeline:
    """Records, per tensor storage, when it was allocated and freed and what it was for.

    model:       an nn.Module or an iterable of parameters (their storages are "parameters").
    optimizer:   an optimizer, a list of them, or None (tensors in `.state` are "optimizer_state").
    device:      "cpu" or "cuda[:i]"; default: the parameters' device, else cpu.
    limit_bytes: a budget for the modelled reserved memory; exceeding it raises SimulatedOutOfMemoryError.
    """

    def __init__(self, model=None, optimizer=None, device=None, limit_bytes=None, name=""):
        params = model.parameters() if isinstance(model, torch.nn.Module) else (model or [])
        self._params = list(params)
        self._optimizers = optimizer if isinstance(optimizer, (list, tuple)) else \
            ([optimizer] if optimizer is not None else [])
        if device is None:
            device = self._params[0].device if self._params else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"MemoryTimeline records cpu or cuda tensors; got device {self.device}. "
                             "Pass device='cpu' or device='cuda'.")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.name = name
        self.limit_bytes = limit_bytes
        self.allocator_model = CachingAllocatorModel(limit_bytes)
        self.phases = []        # (phase, step, first event index, last event index + 1, t0, t1)
        self._events = []       # (seconds since start, storage id, +bytes / -bytes)
        self._reserved_model = []  # modelled reserved bytes after each event
        self._cuda = []         # (allocated, reserved) after each event, CUDA only
        self._sizes = {}        # storage id -> bytes
        self._origin = {}       # storage id -> phase it was allocated in (None outside phases)
        self._alive_after_forward = set()
        self._kind = {}         # storage id -> parameters / gradients / optimizer_state / a tag
        self._ids = WeakIdKeyDictionary()
        self._refs = {}
        self._next_id = itertools.count()
        self._recording = False
        self._done = False
        self._current_phase = None
        self._t0 = None
        self._pending_tags = []
        self.cuda_snapshot = None  # the allocator history, when record(cuda_history=True) on CUDA

    # --- recording ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def record(self, cuda_history=False):
        """Records everything run inside the `with` block.

        cuda_history=True (CUDA only) also keeps the allocator's own event history, with stack traces,
        in `tl.cuda_snapshot`: save it with pickle and drop it on https://pytorch.org/memory_viz."""
        if self._recording:
            raise RuntimeError("this MemoryTimeline is already recording: record() cannot be nested. "
                               "Use one `with tl.record():` around the whole loop.")
        if self._done:
            raise RuntimeError("this MemoryTimeline has already recorded a run; make a new one.")
        if cuda_history and self.device.type != "cuda":
            raise ValueError("cuda_history=True needs a CUDA timeline (device='cuda'); on CPU the "
                             "modelled reserved line stands in for the allocator")
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
            self._recording, self._done = False, True
            self._finish()

    @contextlib.contextmanager
    def phase(self, name, step=0):
        """Marks a phase ("forward", "backward", "optimizer" or any label) of training step `step`."""
        if not self._recording:
            raise RuntimeError("tl.phase(...) is only meaningful inside `with tl.record():`")
        if self._current_phase is not None:
            raise RuntimeError(f"phase {name!r} opened inside phase {self._current_phase!r}; "
                               "phases do not nest")
        self._current_phase, start, t0 = name, len(self._events), self._now()
        try:
            yield
        finally:
            self._current_phase = None
            self._scan_known_tensors()
            if name == "forward":
                self._alive_after_forward.update(
                    sid for sid, origin in self._origin.items()
                    if origin == "forward" and sid in self._refs)
            self.phases.append((name, step, start, len(self._events), t0, self._now()))

    def tag(self, tensors, category):
        """Declares the category of tensors the recorder cannot infer (state kept outside .state).

        Call it before or inside `record()`; a tag wins over every inferred category."""
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

        input_storages: when t is an op's output, a callable giving the op's input storages. An output
        that aliases an input we never registered (a view or in-place result of a tensor made before
        recording) allocated nothing: it is remembered as untracked rather than counted as new."""
        if t.device != self.device or t.is_sparse:
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
        self._origin[sid] = self._current_phase
        self._alloc(sid, nbytes)
        return sid

    def _alloc(self, sid, nbytes):
        self._sizes[sid] = nbytes
        if nbytes:
            self._event(sid, nbytes, lambda: self.allocator_model.malloc(sid, nbytes))

    def _free(self, sid):
        nbytes = self._sizes[sid]
        self._sizes[sid] = 0
        if nbytes:
            self._event(sid, -nbytes, lambda: self.allocator_model.free(sid))

    def _on_collect(self, sid):
        if self._recording and sid in self._refs:
            del self._refs[sid]
            self._free(sid)

    def _event(self, sid, delta, update_model):
        update_model()  # may raise SimulatedOutOfMemoryError: the op that allocated fails, like on a GPU
        self._events.append((self._now(), sid, delta))
        self._reserved_model.append(self.allocator_model.reserved)
        if self.device.type == "cuda":
            self._cuda.append((torch.cuda.memory_allocated(self.device),
                               torch.cuda.memory_reserved(self.device)))

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
        n = len(self._events)
        self.times = np.array([e[0] for e in self._events], dtype=float)
        columns = {c: np.zeros(n, dtype=np.int64) for c in CATEGORIES}
        for i, (_, sid, delta) in enumerate(self._events):
            columns[self.category_of(sid)][i] = delta
        self.bytes = {c: np.cumsum(col) for c, col in columns.items()}
        self.reserved_model = np.array(self._reserved_model, dtype=np.int64)
        cuda = np.array(self._cuda, dtype=np.int64).reshape(-1, 2)
        self.cuda_allocated, self.cuda_reserved = (cuda[:, 0], cuda[:, 1]) if len(cuda) else (None, None)
        self.num_events = n
        self._params, self._optimizers, self._ids, self._refs = [], [], WeakIdKeyDictionary(), {}

    def __getstate__(self):  # picklable once recorded (gather_timelines sends it between ranks)
        if not self._done:
            raise RuntimeError("only a finished MemoryTimeline can be pickled or gathered")
        state = self.__dict__.copy()
        for key in ("_ids", "_refs", "_next_id", "_sizes", "_origin", "_kind", "_alive_after_forward"):
            state.pop(key, None)
        return state

    def _check_done(self):
        if not self._done:
            raise RuntimeError("no recorded run yet: use `with tl.record(): ...` first")
        if self.num_events == 0:
            raise ValueError("the timeline is empty: nothing was allocated while recording. Did the "
                             "training loop run inside `with tl.record():`, on this timeline's device?")

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
        return [(a, b) for (name, s, a, b, _, _) in self.phases
                if (step is None or s == step) and (phase is None or name == phase)]

    def peak(self, category=None, step=None, phase=None):
        """Peak bytes of a category (None: total) over the whole run, or within a step and/or phase."""
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
            raise ValueError(f"no recorded phase matches step={step!r}, phase={phase!r}; "
                             f"recorded: {sorted({(p[1], p[0]) for p in self.phases})}")
        # the level on entry counts too: it is what the phase starts from
        return int(max(values[max(a - 1, 0):max(b, a + 1)].max() for a, b in ranges))

    def summary(self):
        """One line per category: peak MiB over the run."""
        return "\n".join(f"{c:>16}: {self.peak(c) / MiB:9.3f} MiB" for c in CATEGORIES) + \
            f"\n{'total':>16}: {self.peak() / MiB:9.3f} MiB\n{'reserved (model)':>16}: " \
            f"{self.peak_reserved_model() / MiB:9.3f} MiB"


def gather_timelines(timeline, dst=0, group=None):
    """Inside a process group: every rank's finished timeline, as a list on `dst` (None elsewhere)."""
    import torch.distributed as dist
    timeline._check_done()
    world = dist.get_world_size(group)
    out = [None] * world if dist.get_rank(group) == dst else None
    dist.gather_object(timeline, out, dst=dst, group=group)
    return out


# --------------------------------------------------------------------------------------------------
# Plots (matplotlib is imported only when plotting)
# --------------------------------------------------------------------------------------------------

def plot_timeline(tl, ax=None, title=None, show_reserved=True, legend=True, ymax=None, x="events"):
    """Stacked area by category, phase bands, step boundaries, and the reserved line(s).

    x="events" (default) spaces allocations and frees evenly, as PyTorch's memory viz does, so a spike
    that lasts a microsecond is as visible as a plateau; x="time" uses seconds while recording (which
    include the recorder's own overhead)."""
    import matplotlib.pyplot as plt
    tl._check_done()
    if x not in ("events", "time"):
        raise ValueError(f"x must be 'events' or 'time', got {x!r}")
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.5))
    xs = np.arange(tl.num_events) if x == "events" else tl.times

    def at(i):  # x position of event index i (phase boundaries are event indices)
        return xs[min(i, tl.num_events - 1)] if x == "time" else i

    ax.stackplot(xs, *[tl.bytes[c] / MiB for c in CATEGORIES], labels=CATEGORIES,
                 colors=[COLORS[c] for c in CATEGORIES], step="post", linewidth=0)
    ax.plot(xs, tl.series() / MiB, color="k", lw=0.5, label="allocated (recorded)", drawstyle="steps-post")
    seen_steps = set()
    for name, step, a, b, _, _ in tl.phases:
        ax.axvspan(at(a), at(b), color=PHASE_COLORS.get(name, "#f2f2f2"), zorder=-1, lw=0)
        if step not in seen_steps:
            seen_steps.add(step)
            ax.axvline(at(a), color="0.4", lw=0.8, ls=":")
            ax.text(at(a), 1.0, f" step {step}", transform=ax.get_xaxis_transform(), va="bottom",
                    fontsize=8, color="0.3")
    if show_reserved:
        ax.plot(xs, tl.reserved_model / MiB, color="k", lw=1, ls="--",
                label="reserved (modelled CUDA allocator)", drawstyle="steps-post")
        if tl.cuda_reserved is not None:
            ax.plot(xs, tl.cuda_allocated / MiB, color="0.2", lw=1, label="allocated (CUDA)",
                    drawstyle="steps-post")
            ax.plot(xs, tl.cuda_reserved / MiB, color="0.5", lw=1.2, label="reserved (CUDA)",
                    drawstyle="steps-post")
    if tl.limit_bytes is not None:
        ax.axhline(tl.limit_bytes / MiB, color="red", lw=1, label="memory limit")
    ax.set_xlabel("allocation events (forward blue, backward orange, optimizer green)" if x == "events"
                  else "seconds while recording (forward blue, backward orange, optimizer green)")
    ax.set_ylabel("MiB")
    ax.set_xlim(xs[0], xs[-1])
    ax.set_ylim(0, ymax if ymax is not None else None)
    ax.set_title(title if title is not None else (tl.name or "memory timeline"), pad=14)
    if legend:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, framealpha=0.8)
    return ax


def plot_timelines(timelines, titles=None, sharey=True, width=4.2, height=3.2, x="events"):
    """Several timelines side by side, on one y scale so their heights compare."""
    import matplotlib.pyplot as plt
    if not timelines:
        raise ValueError("plot_timelines needs at least one recorded timeline")
    for tl in timelines:
        tl._check_done()
    titles = titles or [tl.name for tl in timelines]
    fig, axes = plt.subplots(1, len(timelines), figsize=(width * len(timelines) + 2.2, height),
                             squeeze=False)
    ymax = max(max(tl.series().max(), tl.reserved_model.max(), tl.limit_bytes or 0)
               for tl in timelines) / MiB * 1.08
    last = len(timelines) - 1
    for i, (tl, ax) in enumerate(zip(timelines, axes[0])):
        plot_timeline(tl, ax=ax, title=titles[i], legend=(i == last), ymax=ymax if sharey else None, x=x)
        if i:
            ax.set_ylabel("")
        ax.set_xlabel("allocation events" if x == "events" else "seconds")
    fig.tight_layout()
    return fig
