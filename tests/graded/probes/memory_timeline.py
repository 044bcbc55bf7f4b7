"""Probes for tests/graded/test_memory_timeline.py: they record runs with memory/memory_timeline.py
and call its functions, and return plain numbers. The verdicts are the test's."""

import torch
from models_memory_timeline import PUBLIC, small_model

from memory.memory_timeline import MemoryTimeline, predicted_optimizer_state_bytes

OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD,
              "Muon": torch.optim.Muon}  # fmt: skip


def activations(steps=3, batch=64, seed=0, layers=PUBLIC):
    """SGD, a batch made each step in a "data" phase inside the recording (before the forward):
    the activations' peak of step 1, of the run, and their bytes as each backward ends."""
    model = small_model(layers=layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tl = MemoryTimeline(model, opt)
    g = torch.Generator().manual_seed(seed)
    with tl.record():
        for step in range(1, steps + 1):
            with tl.phase("data", step):
                x = torch.randn(batch, 256, generator=g)
            with tl.phase("forward", step):
                loss = model(x).square().mean()
            with tl.phase("backward", step):
                loss.backward()
            with tl.phase("optimizer", step):
                opt.step()
                opt.zero_grad()
    ends = [int(tl.series("activations")[tl.window(s, "backward")[0][1] - 1]) for s in range(1, 4)]
    return {
        "step1": int(tl.peak("activations", step=1)),
        "run": int(tl.peak("activations")),
        "after_backward": ends,
    }


def peaks(steps=3, batch=64, seed=0, layers=PUBLIC):
    """AdamW, the batch made before the recording: every category's peak, and the total's."""
    model = small_model(layers=layers)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(seed))
    tl = MemoryTimeline(model, opt)
    with tl.record():
        for step in range(1, steps + 1):
            with tl.phase("forward", step):
                loss = model(x).square().mean()
            with tl.phase("backward", step):
                loss.backward()
            with tl.phase("optimizer", step):
                opt.step()
                opt.zero_grad()
    return {"peaks": {k: int(v) for k, v in tl.peaks().items()}, "total": int(tl.peak())}


def optimizers(params, specs):
    """[(name, kwargs, which)] -> optimizers over all params, the matrices, or the rest."""
    subset = {
        "all": params,
        "matrices": [p for p in params if p.ndim == 2],
        "rest": [p for p in params if p.ndim != 2],
    }
    return [OPTIMIZERS[name](subset[which], **kwargs) for name, kwargs, which in specs]


def predicted(model_device, cases, devices):
    """For each case (a list of optimizer specs: one optimizer, or a list of them), the predicted
    bytes on each of `devices`, before any state exists."""
    params = list(small_model(model_device).parameters())
    out = []
    for specs in cases:
        opts = optimizers(params, specs)
        opt = opts[0] if len(opts) == 1 else opts
        out.append([predicted_optimizer_state_bytes(opt, d) for d in devices])
    return out
