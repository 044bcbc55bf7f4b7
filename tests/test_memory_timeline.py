"""memory_timeline.py against independent measurements (MemTracker, the profiler) and exact formulas."""
import matplotlib
import pytest
import torch
import torch.nn as nn

matplotlib.use("Agg")

from harness import run_ranks  # noqa: E402
from memory_timeline import (CATEGORIES, CachingAllocatorModel, MemoryTimeline,  # noqa: E402
                             SimulatedOutOfMemoryError, gather_timelines, plot_timeline, plot_timelines)

MiB = 2 ** 20


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.LayerNorm(256),
                         nn.Linear(256, 256))


def train(model, opt, x, steps, tl=None):
    for step in range(steps):
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


def param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


# --- exact formulas --------------------------------------------------------------------------------

@pytest.mark.parametrize("opt_cls, kwargs, state_per_param_bytes, extra_per_tensor", [
    (torch.optim.AdamW, {}, 8, 4),                   # exp_avg + exp_avg_sq in fp32, plus a fp32 `step`
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 4, 0),  # one momentum buffer
])
def test_parameter_gradient_optimizer_bytes_equal_the_formulas(opt_cls, kwargs, state_per_param_bytes,
                                                              extra_per_tensor):
    model, tl = recorded(opt_cls, **kwargs)
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    assert tl.peak("parameters") == 4 * n_params
    assert tl.peak("gradients") == 4 * n_params
    assert tl.peak("optimizer_state") == state_per_param_bytes * n_params + extra_per_tensor * n_tensors
    # step 0 starts with no state and no gradients: the state appears inside the first optimizer phase
    assert tl.peak("optimizer_state", step=0, phase="forward") == 0
    assert tl.peak("gradients", step=0, phase="forward") == 0
    assert tl.peak("optimizer_state", step=1, phase="forward") == tl.peak("optimizer_state")


def test_activations_are_exactly_the_tensors_saved_for_backward():
    model, tl = recorded(torch.optim.SGD, lr=0.1)
    b, h, d = 64, 1024, 256
    saved = (b * h + b * h          # Linear1 output (saved by GELU), GELU output (saved by Linear2)
             + b * d + 2 * b        # Linear2 output, LayerNorm mean and rstd
             + b * d + b * d) * 4 + 4  # LayerNorm output (saved by Linear3), its output (square); the loss
    assert tl.peak("activations", step=0) == saved
    # later steps briefly hold the previous step's 4-byte loss too, until `loss` is rebound
    assert tl.peak("activations") == saved + 4
    for step in range(3):  # all but the loss (still bound to `loss`) are gone once backward has run
        a, b_end = tl.window(step, "backward")[0]
        assert tl.series("activations")[b_end - 1] == 4


# --- against independent measurements ----------------------------------------------------------------

def test_peaks_agree_with_memtracker_and_the_profiler():
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, Category, MemoryProfileTimeline

    _, tl = recorded()
    ours = tl.peaks()

    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 256)
    tracker = MemTracker()
    tracker.track_external(model, opt, x)
    act_after_forward = []
    with tracker:
        for step in range(3):
            loss = model(x).square().mean()
            current = tracker.get_tracker_snapshot("current")[x.device]
            act_after_forward.append(next(v for k, v in current.items() if getattr(k, "value", k) == "Activation"))
            loss.backward()
            opt.step()
            opt.zero_grad()
            tracker.reset_mod_stats()  # MemTracker refuses a second iteration without it
    peak = tracker.get_tracker_snapshot("peak")[x.device]
    by_name = {k.value if hasattr(k, "value") else k: v for k, v in peak.items()}
    input_bytes = x.numel() * 4  # MemTracker counts the input batch, created before our recording began

    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        train(model, opt, x, 3)
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    prof_opt_peak = max(row[_CATEGORY_TO_INDEX[Category.OPTIMIZER_STATE] + 1] for row in sizes)

    def close(a, b):
        return abs(a - b) <= 0.05 * max(a, b)

    assert close(ours["parameters"], by_name["Parameter"]), (ours, by_name)
    assert close(ours["gradients"], by_name["Gradient"]), (ours, by_name)
    assert close(ours["optimizer_state"], prof_opt_peak), (ours, prof_opt_peak)
    assert close(ours["activations"], max(act_after_forward)), (ours, act_after_forward)
    assert close(tl.peak(), by_name["Total"] - input_bytes), (tl.peak(), by_name)


# --- the modelled caching allocator ----------------------------------------------------------------

def test_caching_allocator_model_rules():
    m = CachingAllocatorModel()
    m.malloc("a", 100)                        # rounds to 512 B, opens a 2 MiB small segment
    assert (m.allocated, m.reserved) == (512, 2 * MiB)
    m.malloc("b", 3 * MiB)                    # large request under 10 MiB: a 20 MiB segment, split
    assert m.reserved == 22 * MiB and m.allocated == 512 + 3 * MiB
    m.malloc("x", 12 * MiB)                   # best fit: carved from the 17 MiB left in that segment
    assert m.reserved == 22 * MiB
    m.malloc("c", 18 * MiB + 1)               # >= 10 MiB and no room: own segment, rounded up to 2 MiB
    assert m.reserved == 22 * MiB + 20 * MiB
    m.free("b")
    m.malloc("d", 3 * MiB)                    # reuses the cached block: reserved does not move
    assert m.reserved == 42 * MiB
    for key in "acdx":
        m.free(key)
    assert m.allocated == 0 and m.reserved == 42 * MiB   # freed memory stays cached
    m.malloc("e", 20 * MiB)                   # a merged 20 MiB segment serves it whole
    assert m.reserved == 42 * MiB


def test_caching_allocator_model_merges_neighbours():
    m = CachingAllocatorModel()
    for k in "abc":
        m.malloc(k, 4 * MiB)                  # three blocks carved from one 20 MiB segment
    m.free("a"), m.free("c"), m.free("b")     # free in an order that needs left and right merges
    m.malloc("big", 19 * MiB)                 # fits only if the segment merged back into one block
    assert m.reserved == 20 * MiB


def _first_step_anomaly_run(steps, limit_bytes=None):
    """Activations large enough that step 2's backward, now beside AdamW's state, peaks above step 1."""
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
    step1, step2 = free_run.peak_reserved_model(step=0), free_run.peak_reserved_model(step=1)
    assert step2 > step1
    limit = (step1 + step2) // 2
    tl, error = _first_step_anomaly_run(1, limit)
    assert error is None                                  # step 1 fits the budget
    tl, error = _first_step_anomaly_run(2, limit)
    assert error is not None and "modelled CUDA out of memory" in str(error)
    assert f"limit {limit / MiB:.2f} MiB" in str(error) and "Fix:" in str(error)
    failed_phase, failed_step = tl.phases[-1][:2]
    assert failed_step == 1 and failed_phase in ("forward", "backward")  # step 2 runs out
    assert tl.peak_reserved_model() <= limit


def test_reserved_model_never_below_allocated_and_never_shrinks_without_limit():
    _, tl = recorded()
    assert (tl.reserved_model >= tl.series()).all()
    assert (tl.reserved_model[1:] >= tl.reserved_model[:-1]).all()


# --- bad input, plots, ranks -----------------------------------------------------------------------

def test_bad_input_gives_clear_errors():
    with pytest.raises(ValueError, match="records cpu or cuda"):
        MemoryTimeline(device="meta")
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
    assert len(ax.patches) == 6  # 2 steps x 3 phase bands
    fig = plot_timelines([tl, tl], titles=["a", "b"])
    assert len(fig.axes) == 2


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
    x = torch.randn(256, 256)                  # made before recording: not ours to count
    nbytes = 256 * 256 * 4
    for tag_it in (False, True):
        tl = MemoryTimeline()
        with tl.record():
            with tl.phase("forward"):
                v = x.view(-1)                 # a view allocates nothing
                x.mul_(2.0)                    # neither does an in-place op
                d = x.detach()
                y = x + 1                      # a new result does, held past the phase's end
            if tag_it:
                tl.tag(x, "other")             # tagging an earlier tensor makes it count from now on
        assert tl.peak("activations") == nbytes
        assert tl.peak("other") == (nbytes if tag_it else 0)
        assert tl.peak() == (2 if tag_it else 1) * nbytes
        del v, d, y
