"""Graded tests of memory/memory_timeline.py. The student's code records and predicts in sandboxed
workers (probes in tests/graded/probes/memory_timeline.py); the references are computed here:
exact byte formulas, the optimizers' real state after a step, torch's MemTracker and profiler.
Steps are numbered from 1, as in the notebooks."""

import pytest
import torch
from sandbox import call

from graded.expected import DRAW, case_seed, hidden
from graded.models_memory_timeline import PUBLIC, drawn_layers, small_model

# the batch, its seed and the recorded model's layers move with the draw at grading time
BATCH = 64 if DRAW == 0 else (32, 48, 80, 96, 128)[DRAW % 5]
SEED = case_seed(0, "memory_timeline")
H = hidden("memory_timeline")  # the drawn models' activations: only in the autograder zip
LAYERS = (
    PUBLIC
    if DRAW == 0
    else drawn_layers(torch.Generator().manual_seed(case_seed(3, "memory_timeline")))
)


def train(model, opt, x, steps):
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def state_bytes_on(opt, device_type):
    """The optimizer's real state after a step, read off its tensors (the reference)."""
    return sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.device.type == device_type
    )


OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD,
              "Muon": torch.optim.Muon}  # fmt: skip


def optimizers(params, specs):
    """[(name, kwargs, which)] -> optimizers over all params, the matrices, or the rest."""
    subset = {
        "all": params,
        "matrices": [p for p in params if p.ndim == 2],
        "rest": [p for p in params if p.ndim != 2],
    }
    return [OPTIMIZERS[name](subset[which], **kwargs) for name, kwargs, which in specs]


def stepped_state(device, specs):
    """The real state on `device` after one step of the optimizers the specs name."""
    model = small_model(device)
    opts = optimizers(list(model.parameters()), specs)
    model(torch.randn(8, 256, device=device)).square().mean().backward()
    for opt in opts:
        opt.step()
    return sum(state_bytes_on(opt, torch.device(device).type) for opt in opts)


# --- activations --------------------------------------------------------------------------------


@pytest.mark.grade(points=3, solution="memory_timeline.MemoryTimeline._held_for_backward")
def test_activations_are_exactly_the_tensors_saved_for_backward():
    """Each step's batch is made inside the recording, in a "data" phase before the forward: it is
    alive as the forward ends but the forward did not make it, so it is not an activation."""
    got = call("memory_timeline:activations", batch=BATCH, seed=SEED, layers=LAYERS)
    for key in ("step1", "run"):
        assert type(got.get(key)) is int, f"the probe's {key} is not an int: {got.get(key)!r}"
    b, h, d = BATCH, 1024, 256
    # Linear1 output (saved by GELU), GELU output (saved by Linear2), Linear2 output, LayerNorm mean
    # and rstd, LayerNorm output (saved by Linear3), its output (saved by square); then the loss
    saved = (b * h + b * h + b * d + 2 * b + b * d + b * d) * 4 + 4
    if H is not None:  # the zip's reference agrees with the formula, and counts the drawn layers
        assert H.bytes_held_for_backward(PUBLIC, b) == saved, "the hidden reference disagrees"
        saved = H.bytes_held_for_backward(LAYERS, b)
    extra = got["step1"] - saved
    assert extra == 0, (
        f"step 1's activations peak at {got['step1']:,} bytes, the tensors held for backward "
        f"(and the loss) are {saved:,}: {extra:+,} bytes; activations are the storages a "
        f"forward phase allocated and still alive as it ends, not every live storage"
    )
    # later steps briefly hold the previous step's 4-byte loss too, until `loss` is rebound
    assert got["run"] == saved + 4, (
        f"the run's activations peak at {got['run']:,} bytes, expected {saved + 4:,} (step 1's "
        f"and the previous step's 4-byte loss)"
    )
    assert got["after_backward"] == [4, 4, 4], (
        f"as each backward ends only the 4-byte loss (still bound to `loss`) is an activation; "
        f"got {got['after_backward']} bytes: what the forward freed or backward released must "
        f"not stay counted"
    )


@pytest.mark.grade(points=2, solution="memory_timeline.MemoryTimeline._held_for_backward")
def test_peaks_agree_with_memtracker_and_the_profiler():
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, Category, MemoryProfileTimeline

    got = call("memory_timeline:peaks", batch=BATCH, seed=SEED, layers=LAYERS)
    ours = got["peaks"]

    model = small_model(layers=LAYERS)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(BATCH, 256, generator=torch.Generator().manual_seed(SEED))
    tracker = MemTracker()
    tracker.track_external(model, opt, x)
    act_after_forward, grad_after_step = [], []

    def now(category):
        current = tracker.get_tracker_snapshot("current")[x.device]
        return next(v for k, v in current.items() if getattr(k, "value", k) == category)

    with tracker:
        for step in range(3):
            loss = model(x).square().mean()
            act_after_forward.append(now("Activation"))
            loss.backward()
            opt.step()
            # MemTracker files a gradient as one only at the optimizer's step: its "peak" snapshot
            # is taken at the peak total, which for some models falls in backward, before that
            grad_after_step.append(now("Gradient"))
            opt.zero_grad()
            tracker.reset_mod_stats()  # MemTracker refuses a second iteration without it
    peak = tracker.get_tracker_snapshot("peak")[x.device]
    by_name = {k.value if hasattr(k, "value") else k: v for k, v in peak.items()}
    input_bytes = x.numel() * 4  # MemTracker counts the input batch, created before our recording

    model = small_model(layers=LAYERS)
    opt = torch.optim.AdamW(model.parameters())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as p:  # fmt: skip
        train(model, opt, x, 3)
    _, sizes = MemoryProfileTimeline(p._memory_profile())._coalesce_timeline("cpu")
    prof_opt_peak = max(row[_CATEGORY_TO_INDEX[Category.OPTIMIZER_STATE] + 1] for row in sizes)

    def close(a, b):  # 5%: the tools differ in what they count (MemTracker rounds nothing away)
        return abs(a - b) <= 0.05 * max(a, b)

    checks = [
        ("activations", ours["activations"], max(act_after_forward), "MemTracker after forward"),
        ("parameters", ours["parameters"], by_name["Parameter"], "MemTracker"),
        ("gradients", ours["gradients"], max(grad_after_step), "MemTracker after the step"),
        ("optimizer_state", ours["optimizer_state"], prof_opt_peak, "the profiler"),
        ("the total", got["total"], by_name["Total"] - input_bytes, "MemTracker"),
    ]
    for what, mine, theirs, tool in checks:
        assert close(mine, theirs), (
            f"the peak of {what} is {mine:,} bytes, {tool} measures {theirs:,} (tolerance 5%)"
        )


# --- the step-2 prediction ------------------------------------------------------------------------


@pytest.mark.grade(points=2, solution="memory_timeline.predicted_optimizer_state_bytes")
def test_predicted_state_on_cpu_equals_the_formula_and_the_real_state():
    params = list(small_model().parameters())
    n, t = sum(p.numel() for p in params), len(params)
    hidden = sum(p.numel() for p in params if p.ndim == 2)
    rest = [p for p in params if p.ndim != 2]
    muon = ("Muon", {"adjust_lr_fn": "match_rms_adamw"}, "matrices")
    cases = [  # (optimizers, formula in bytes: N fp32 values in T tensors)
        ([("AdamW", {"foreach": False}, "all")], 8 * n + 4 * t),
        ([("Adam", {"amsgrad": True}, "all")], 12 * n + 4 * t),
        ([("AdamW", {"fused": True}, "all")], 8 * n + 4 * t),
        ([("SGD", {"lr": 0.1, "momentum": 0.9}, "all")], 4 * n),
        ([("SGD", {"lr": 0.1}, "all")], 0),
        ([muon], 4 * hidden),
        (
            [muon, ("AdamW", {}, "rest")],
            4 * hidden + 8 * sum(p.numel() for p in rest) + 4 * len(rest),
        ),
    ]
    got = call("memory_timeline:predicted", "cpu", [specs for specs, _ in cases], ["cpu"])
    for (specs, formula), (predicted,) in zip(cases, got, strict=True):
        names = " + ".join(f"{name}({kwargs})" for name, kwargs, _ in specs)
        assert stepped_state("cpu", specs) == formula, names  # the formula is torch's state
        assert predicted == formula, (
            f"{names} on the CPU: predicted {predicted:,} bytes of state, it holds {formula:,} "
            f"after a step"
        )


@pytest.mark.grade(points=2, solution="memory_timeline.predicted_optimizer_state_bytes")
def test_predicted_state_off_the_cpu_leaves_adamw_step_counters_behind():
    # 'meta' stands in for a GPU: a device that is not the CPU, where a real AdamW step keeps its
    # moments beside the parameters and its `step` counters on the CPU (as on CUDA, unfused)
    params = list(small_model("meta").parameters())
    n, t = sum(p.numel() for p in params), len(params)
    unfused = [("AdamW", {"foreach": False}, "all")]
    model = small_model("meta")
    (opt,) = optimizers(list(model.parameters()), unfused)
    model(torch.randn(8, 256, device="meta")).square().mean().backward()
    opt.step()
    assert state_bytes_on(opt, "meta") == 8 * n and state_bytes_on(opt, "cpu") == 4 * t
    # fused or capturable: PyTorch keeps `step` beside the parameter (Adam's _init_group), so
    # the formula is 8N + 4T on the parameters' device (a fused meta step cannot run to check it)
    cases = [
        (unfused, {"meta": 8 * n, "cpu": 4 * t, "cuda": 0}),
        ([("AdamW", {"fused": True}, "all")], {"meta": 8 * n + 4 * t, "cpu": 0, "cuda": 0}),
        ([("AdamW", {"capturable": True}, "all")], {"meta": 8 * n + 4 * t, "cpu": 0, "cuda": 0}),
    ]
    devices = ["meta", "cpu", "cuda"]
    got = call("memory_timeline:predicted", "meta", [specs for specs, _ in cases], devices)
    for (specs, want), predicted in zip(cases, got, strict=True):
        ((_, kwargs, _),) = specs
        for device, p in zip(devices, predicted, strict=True):
            assert p == want[device], (
                f"AdamW({kwargs}) with parameters on 'meta' (a GPU's stand-in): predicted {p:,} "
                f"bytes on {device!r}, expected {want[device]:,}: unfused, the `step` counters "
                f"stay on the CPU; fused or capturable, beside the parameters"
            )
