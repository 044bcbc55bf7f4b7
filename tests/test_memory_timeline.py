"""memory_timeline.py against independent measurements and exact formulas, the tests that are not
graded (the graded ones: tests/graded/test_memory_timeline.py). Steps are numbered from 1, as in
the notebooks."""

import os

import matplotlib
import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

matplotlib.use("Agg")

from graded.models_memory_timeline import small_model  # noqa: E402

from memory import memory_timeline  # noqa: E402
from memory.allocator_model import CachingAllocatorModel, SimulatedOutOfMemoryError  # noqa: E402
from memory.memory_timeline import (  # noqa: E402
    CATEGORIES,
    MemoryTimeline,
    gather_timelines,
    predicted_optimizer_state_bytes,
)
from memory.plots import plot_timeline, plot_timelines  # noqa: E402
from tools.spawn import run_ranks  # noqa: E402

MiB = 2**20


def train(model, opt, x, steps, tl=None):
    for step in range(1, steps + 1):
        with tl.phase("forward", step) if tl else _null():
            loss = model(x).square().mean()
        with tl.phase("backward", step) if tl else _null():
            loss.backward()
        with tl.phase("optimizer", step) if tl else _null():
            opt.step()
            opt.zero_grad()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def recorded(opt_cls=torch.optim.AdamW, steps=3, **opt_kwargs):
    model = small_model()
    opt = opt_cls(model.parameters(), **opt_kwargs)
    x = torch.randn(64, 256)
    tl = MemoryTimeline(model, opt)
    with tl.record():
        train(model, opt, x, steps, tl)
    return model, tl


# --- exact formulas -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "opt_cls, kwargs, state_per_param_bytes, extra_per_tensor",
    [
        (torch.optim.AdamW, {}, 8, 4),  # exp_avg + exp_avg_sq in fp32, plus a fp32 `step`
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 4, 0),  # one momentum buffer
    ],
)
def test_parameter_gradient_optimizer_bytes_equal_the_formulas(
    opt_cls, kwargs, state_per_param_bytes, extra_per_tensor
):
    model, tl = recorded(opt_cls, **kwargs)
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    assert tl.peak("parameters") == 4 * n_params
    assert tl.peak("gradients") == 4 * n_params
    state = state_per_param_bytes * n_params + extra_per_tensor * n_tensors
    assert tl.peak("optimizer_state") == state
    # step 1 starts with no state and no gradients: the state appears inside its optimizer phase
    assert tl.peak("optimizer_state", step=1, phase="forward") == 0
    assert tl.peak("gradients", step=1, phase="forward") == 0
    assert tl.peak("optimizer_state", step=2, phase="forward") == tl.peak("optimizer_state")


# --- the step-2 prediction ------------------------------------------------------------------------


def test_predicted_state_refuses_an_optimizer_it_does_not_know():
    with pytest.raises(ValueError, match="knows Adam, AdamW, SGD and Muon, not Adagrad"):
        predicted_optimizer_state_bytes(torch.optim.Adagrad(small_model().parameters()), "cpu")


def test_step_two_jump_is_the_predicted_state_on_cpu_and_off_it():
    """The notebook's claim, on the CPU and on a non-CPU device where `step` stays on the CPU."""
    for device in ("cpu", "meta"):
        model = small_model(device)
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        predicted = predicted_optimizer_state_bytes(opt, device)
        tl = MemoryTimeline(model, opt, device=device)
        with (
            tl.record()
        ):  # a batch whose activations outweigh the weights: step 1 peaks in backward
            train(model, opt, torch.randn(2048, 256, device=device), 2, tl)
        assert tl.peak("optimizer_state") == predicted, device
        assert tl.peak(step=2) - tl.peak(step=1) == predicted, device
    n = sum(p.numel() for p in model.parameters())
    assert predicted == 8 * n  # the last device was meta: the CPU step counters are not its memory


# --- the device's own line is sampled after each free takes effect --------------------------------


class _AllocatorStandIn(TorchDispatchMode):
    """On the CPU, what CUDA's memory_allocated reports: a storage counts until its memory is
    released, which happens after the recorder's weakref callback has run (StorageWeakRef expires
    only then). Registers every storage an op returns, like the recorder, but independently."""

    def __init__(self):
        super().__init__()
        self.live = {}

    def add(self, t):
        st = t.untyped_storage()
        old = self.live.get(st._cdata)
        if old is None or old[0].expired():
            self.live[st._cdata] = (StorageWeakRef(st), st.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out

    def __call__(self):
        allocated = sum(n for ref, n in self.live.values() if not ref.expired())
        return allocated, allocated


def test_device_line_is_sampled_after_each_free_takes_effect():
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # no CPU-made step counters
    device = _AllocatorStandIn()
    for p in model.parameters():
        device.add(p)
    tl = MemoryTimeline(model, opt, device_memory=device)
    with device:
        with tl.record():
            train(model, opt, torch.randn(64, 256), 3, tl)
    recorded_line, device_line = tl.series(), tl.cuda_allocated
    frees = np.flatnonzero(np.diff(recorded_line, prepend=0) < 0)
    assert len(frees) > 50  # many frees from weakref callbacks, not a handful
    # sampled inside the callback, the device would still count the freed storage: equal only if
    # the sample waits until the release has taken effect
    assert np.array_equal(device_line[frees], recorded_line[frees])
    # and the lines meet at every phase's end (within a phase an op with several outputs, e.g.
    # layer norm's output, mean and rstd, is on the device at once but registered one by one)
    ends = [b - 1 for (_, _, a, b, _, _) in tl.phases if b > a]
    assert np.array_equal(device_line[ends], recorded_line[ends])


# --- the modelled caching allocator ---------------------------------------------------------------


def test_caching_allocator_model_rules():
    m = CachingAllocatorModel()
    m.malloc("a", 100)  # rounds to 512 B, opens a 2 MiB small segment
    assert (m.allocated, m.reserved) == (512, 2 * MiB)
    m.malloc("b", 3 * MiB)  # large request under 10 MiB: a 20 MiB segment, split
    assert m.reserved == 22 * MiB and m.allocated == 512 + 3 * MiB
    m.malloc("x", 12 * MiB)  # best fit: carved from the 17 MiB left in that segment
    assert m.reserved == 22 * MiB
    m.malloc("c", 18 * MiB + 1)  # >= 10 MiB and no room: own segment, rounded up to 2 MiB
    assert m.reserved == 22 * MiB + 20 * MiB
    assert m.segments() == [  # each segment's blocks by offset, with the key using each
        (2 * MiB, "small", [(0, 512, "a"), (512, 2 * MiB - 512, None)]),
        (
            20 * MiB,
            "large",
            [(0, 3 * MiB, "b"), (3 * MiB, 12 * MiB, "x"), (15 * MiB, 5 * MiB, None)],
        ),
        (20 * MiB, "large", [(0, 18 * MiB + 512, "c"), (18 * MiB + 512, 2 * MiB - 512, None)]),
    ]
    m.free("b")
    m.malloc("d", 3 * MiB)  # reuses the cached block: reserved does not move
    assert m.reserved == 42 * MiB
    for key in "acdx":
        m.free(key)
    assert m.allocated == 0 and m.reserved == 42 * MiB  # freed memory stays cached
    m.malloc("e", 20 * MiB)  # a merged 20 MiB segment serves it whole
    assert m.reserved == 42 * MiB


def test_caching_allocator_model_merges_neighbours():
    m = CachingAllocatorModel()
    for k in "abc":
        m.malloc(k, 4 * MiB)  # three blocks carved from one 20 MiB segment
    m.free("a"), m.free("c"), m.free("b")  # free in an order that needs left and right merges
    m.malloc("big", 19 * MiB)  # fits only if the segment merged back into one block
    assert m.reserved == 20 * MiB


def _first_step_anomaly_run(steps, limit_bytes=None):
    """Activations large enough that step 2's backward, beside AdamW's state, peaks above step 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    tl = MemoryTimeline(model, opt, limit_bytes=limit_bytes)
    try:
        with tl.record():
            train(model, opt, torch.randn(2048, 512), steps, tl)
    except SimulatedOutOfMemoryError as e:
        return tl, e
    return tl, None


def test_simulated_limit_lets_step_one_fit_and_step_two_run_out():
    free_run, _ = _first_step_anomaly_run(2)
    step1, step2 = free_run.peak_reserved_model(step=1), free_run.peak_reserved_model(step=2)
    assert step2 > step1
    limit = (step1 + step2) // 2
    tl, error = _first_step_anomaly_run(1, limit)
    assert error is None and tl.out_of_memory is None  # step 1 fits the budget
    tl, error = _first_step_anomaly_run(2, limit)
    assert error is not None and "modelled CUDA out of memory" in str(error)
    assert f"limit {limit / MiB:.2f} MiB" in str(error) and "Fix:" in str(error)
    failed_phase, failed_step = tl.phases[-1][:2]
    assert failed_step == 2 and failed_phase in ("forward", "backward")  # step 2 runs out
    oom = tl.out_of_memory
    assert (oom.step, oom.phase, oom.event) == (2, failed_phase, tl.num_events) and oom.nbytes > 0
    assert tl.peak_reserved_model() <= limit
    ax = plot_timeline(tl)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "simulated out of memory" in labels and f"memory limit ({limit / MiB:.0f} MiB)" in labels


def test_reserved_model_never_below_allocated_and_never_shrinks_without_limit():
    _, tl = recorded()
    assert (tl.reserved_model >= tl.series()).all()
    assert (tl.reserved_model[1:] >= tl.reserved_model[:-1]).all()


# --- bad input, plots, ranks, the command line ----------------------------------------------------


def test_bad_input_gives_clear_errors():
    with pytest.raises(ValueError, match="records cpu, cuda or meta"):
        MemoryTimeline(device="xla")
    tl = MemoryTimeline(small_model())
    with pytest.raises(RuntimeError, match="cannot be nested"):
        with tl.record():
            with tl.record():
                pass
    empty = MemoryTimeline()
    with empty.record():
        pass
    with pytest.raises(ValueError, match="timeline is empty"):
        plot_timeline(empty)
    with pytest.raises(ValueError, match="at least one"):
        plot_timelines([])
    with pytest.raises(ValueError, match="cuda_history=True needs a CUDA timeline"):
        with MemoryTimeline(device="cpu").record(cuda_history=True):
            pass
    with pytest.raises(ValueError, match="unknown category"):
        recorded(torch.optim.SGD, steps=1, lr=0.1)[1].peak("weights")


def test_plots_draw_every_category_and_phase():
    _, tl = recorded(steps=2)
    ax = plot_timeline(tl, title="t")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert all(c in labels for c in CATEGORIES) and "reserved (modelled CUDA allocator)" in labels
    assert all(f"{p} phase" in labels for p in ("forward", "backward", "optimizer"))
    assert len(ax.patches) == 6  # 2 steps x 3 phase bands
    assert ax.get_xlabel().startswith("allocation events") and ax.get_ylabel() == "memory (MiB)"
    fig = plot_timelines([tl, tl, tl], titles=["a", "b", "c"])  # two per row
    assert sum(a.get_visible() for a in fig.axes) == 3 and len(fig.legends) == 1


def _record_on_rank(rank, world_size):
    torch.manual_seed(rank)
    model = nn.Linear(32 * (rank + 1), 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tl = MemoryTimeline(model, opt, name=f"rank {rank}")
    with tl.record():
        train(model, opt, torch.randn(4, 32 * (rank + 1)), 2, tl)
    gathered = gather_timelines(tl)
    if rank != 0:
        assert gathered is None
        return None
    return [(g.name, g.peak("parameters")) for g in gathered]


def test_each_rank_records_its_own_and_rank0_gathers():
    out = run_ranks(_record_on_rank, 3)
    assert out[0] == [(f"rank {r}", (32 * (r + 1) * 8 + 8) * 4) for r in range(3)]


def test_views_and_inplace_results_of_earlier_tensors_allocate_nothing():
    x = torch.randn(256, 256)  # made before recording: not ours to count
    nbytes = 256 * 256 * 4
    for tag_it in (False, True):
        tl = MemoryTimeline()
        with tl.record():
            with tl.phase("forward"):
                v = x.view(-1)  # a view allocates nothing
                x.mul_(2.0)  # neither does an in-place op
                d = x.detach()
                y = x + 1  # a new result does, held past the phase's end
            if tag_it:
                tl.tag(x, "other")  # tagging an earlier tensor makes it count from now on
        assert tl.peak("activations") == nbytes
        assert tl.peak("other") == (nbytes if tag_it else 0)
        assert tl.peak() == (2 if tag_it else 1) * nbytes
        del v, d, y


def test_command_line_checks_arguments_first_and_runs_the_demo(capsys):
    with pytest.raises(SystemExit):
        memory_timeline.main(["--help"])
    help_text = capsys.readouterr().out
    for option in ("--steps", "--batch", "--device"):
        assert option in help_text
    for bad, message in (
        (["--steps", "1"], "--steps must be at least 2"),
        (["--batch", "0"], "--batch must be positive"),
        (["--device", "cuda"], "no CUDA GPU is visible"),  # the suite hides CUDA
    ):
        with pytest.raises(SystemExit):
            memory_timeline.main(bad)
        assert message in capsys.readouterr().err
    memory_timeline.main(["--steps", "2"])
    out = capsys.readouterr().out
    assert "device: cpu" in out and "optimizer_state" in out and "off by +0 B" in out


def test_a_pipeline_step_in_one_forward_phase_keeps_its_activations():
    """1F1B runs forwards and backwards inside one "forward" phase: what a micro-batch's forward
    leaves for its backward is an activation (its bytes counted exactly), not a temporary."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    xs = [torch.randn(64, 256) for _ in range(3)]
    tl = MemoryTimeline(model)
    with tl.record():
        with tl.phase("forward", 1):  # F0 F1 B0 F2 B1 B2: two micro-batches in flight at most
            losses = [model(xs[0]).square().mean(), model(xs[1]).square().mean()]
            losses.pop(0).backward()
            losses.append(model(xs[2]).square().mean())
            losses.pop(0).backward()
            losses.pop(0).backward()
    # per micro-batch: Linear1's output and GELU's (saved), Linear2's output (saved by square),
    # and the loss, alive until its backward
    per_micro = (64 * 1024 * 2 + 64 * 256) * 4 + 4
    seed = 4  # backward()'s implicit gradient of the loss, made just before autograd starts
    assert tl.peak("activations") == 2 * per_micro + seed, (
        f"activations peak {tl.peak('activations')} B, expected two micro-batches' "
        f"{2 * per_micro} B and the 4-byte gradient seed"
    )
    assert tl.series("activations")[-1] == 0, (
        "every micro-batch's activations freed by its backward"
    )


@pytest.mark.parametrize(
    "model_seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in range(1, 6))]
)
def test_graded_tests_give_the_reference_full_marks_on_any_drawn_model(monkeypatch, model_seed):
    """At grading time the graded tests record a drawn model (drawn_layers): their references
    (MemTracker, the profiler, autograd's saved tensors) must agree with memory_timeline.py on
    every model the draw can pick, not only on the public one. Runs the graded tests themselves,
    the probes called here instead of in a sandboxed worker."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "tools"))  # where the graded tests find these
    monkeypatch.syspath_prepend(os.path.join(root, "tests", "graded"))
    import graded.test_memory_timeline as graded_tests
    from graded.hidden import references_memory_timeline
    from graded.models_memory_timeline import drawn_layers
    from graded.probes import memory_timeline as probes

    gen = torch.Generator().manual_seed(model_seed)
    layers = drawn_layers(gen)
    batch = (32, 48, 80, 96, 128)[model_seed % 5]
    if model_seed == 0:  # a drawn model whose peak total falls in backward, before the first step
        layers = ("linear 128", "sigmoid", "linear 384", "gelu", "linear 128", "layernorm",
                  "linear 256")  # fmt: skip
        batch = 128
    monkeypatch.setattr(graded_tests, "LAYERS", layers)
    monkeypatch.setattr(graded_tests, "BATCH", batch)
    monkeypatch.setattr(graded_tests, "SEED", 1000 + model_seed)
    monkeypatch.setattr(graded_tests, "H", references_memory_timeline)
    monkeypatch.setattr(
        graded_tests, "call", lambda name, **kw: getattr(probes, name.split(":")[1])(**kw)
    )
    graded_tests.test_activations_are_exactly_the_tensors_saved_for_backward()
    graded_tests.test_peaks_agree_with_memtracker_and_the_profiler()
